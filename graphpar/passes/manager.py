"""The one pass manager: named passes, pipeline strings, verification, timing, dumps, analyses.

A pass is a dataclass whose fields are its options, registered under a name:

    @register_pass("dce")
    @dataclass
    class DeadCodeElimination(GraphPass):
        def run_on_graph(self, graph, ctx) -> bool: ...   # True if it changed the graph

Pipelines are strings like `cleanup,auto-shard{mesh=2x4}` or lists of pass objects.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from graphpar.cost.communication import annotate_comm
from graphpar.errors import GraphparError, PassError, UsageError
from graphpar.ir.graph import Graph, Program
from graphpar.ir.printer import print_program
from graphpar.ir.verify import verify

_PASSES: dict[str, type[Pass]] = {}
_ALIASES: dict[str, str] = {}


class Pass:
    """Base of all passes. Subclasses are dataclasses; their fields are the pass's options."""

    name: ClassVar[str] = ""

    def run(self, program: Program, ctx: PassContext) -> bool:
        raise NotImplementedError

    def __str__(self) -> str:
        opts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


class GraphPass(Pass):
    """A pass that runs on each graph of the program on its own."""

    def run(self, program: Program, ctx: PassContext) -> bool:
        changed = False
        for graph in program:
            changed |= bool(self.run_on_graph(graph, ctx))
        return changed

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        raise NotImplementedError


def register_pass(name: str) -> Callable[[type], type]:
    def register(cls: type) -> type:
        if name in _PASSES:
            raise ValueError(f"pass {name!r} is registered twice")
        cls.name = name
        _PASSES[name] = cls
        return cls
    return register


def register_alias(name: str, pipeline: str) -> None:
    """A name that stands for a pipeline, e.g. `cleanup`."""
    _ALIASES[name] = pipeline


def available_passes() -> list[str]:
    return sorted(list(_PASSES) + list(_ALIASES))


# --- analyses ---------------------------------------------------------------------------------

R = TypeVar("R")


class PassContext:
    """What passes share during one pipeline run: cached analyses, typed results, options.

    A result is what a pass hands to later passes and to its caller beside the IR (auto-shard's
    plans, lower-spmd's map from device programs to global graphs), keyed by its type.
    """

    def __init__(self, options: dict[str, Any] | None = None):
        self.options = dict(options or {})
        self._analyses: dict[tuple[Any, int], Any] = {}
        self._results: dict[type, Any] = {}

    def result(self, kind: type[R]) -> R:
        """The `kind` result of this run, made empty (`kind()`) on first use."""
        if kind not in self._results:
            self._results[kind] = kind()
        return self._results[kind]

    def set_result(self, value: Any) -> None:
        """Store a result made whole (a frozen dataclass), read back by `result(type(value))`."""
        self._results[type(value)] = value

    def analysis(self, compute: Callable[[Graph], Any], graph: Graph) -> Any:
        """`compute(graph)`, cached until a pass changes the graph."""
        key = (compute, id(graph))
        if key not in self._analyses:
            self._analyses[key] = compute(graph)
        return self._analyses[key]

    def invalidate(self) -> None:
        self._analyses.clear()


# --- pipelines --------------------------------------------------------------------------------

_ITEM = re.compile(r"\s*([A-Za-z0-9_\-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str) -> list[Pass]:
    """`cleanup,auto-shard{mesh=2x4}` -> pass objects; unknown names and options are errors."""
    passes: list[Pass] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if m is None or m.end() == pos:
            raise UsageError(f"bad pipeline {text!r} at character {pos + 1}: expected "
                             "'name' or 'name{option=value,...}' separated by commas")
        name, options = m.group(1), m.group(2)
        pos = m.end()
        if name in _ALIASES:
            if options:
                raise UsageError(f"pipeline alias {name!r} takes no options")
            passes.extend(parse_pipeline(_ALIASES[name]))
            continue
        passes.append(make_pass(name, _parse_options(name, options or "")))
    if not passes:
        raise UsageError("empty pipeline: name at least one pass "
                         f"(available: {', '.join(available_passes())})")
    return passes


def _parse_options(pass_name: str, text: str) -> dict[str, str]:
    options = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise UsageError(f"pass {pass_name!r}: option {item!r} needs a value (name=value)")
        key, value = (s.strip() for s in item.split("=", 1))
        if not value:
            raise UsageError(f"pass {pass_name!r}: option {key!r} is empty; give a value "
                             f"({key}=...)")
        options[key] = value
    return options


def make_pass(name: str, options: dict[str, Any] | None = None) -> Pass:
    if name not in _PASSES:
        raise UsageError(f"unknown pass {name!r}; available passes: "
                         f"{', '.join(available_passes())}")
    cls = _PASSES[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (options or {}).items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise UsageError(f"pass {name!r} has no option {key!r}; its options: {known}")
        kwargs[key] = _convert(name, key, value, fields[key])
    try:
        return cls(**kwargs)
    except (GraphparError, ValueError) as exc:  # options the pass itself refuses
        raise UsageError(f"pass {name!r}: {exc}") from None


def _convert(pass_name: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    if not isinstance(value, str):
        return value
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if kind == "int":
            return int(value)
        if kind == "float":
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(value)
            return number
    except ValueError:
        raise UsageError(f"pass {pass_name!r}: option {key}={value!r} is not a {kind}") from None
    return value


# --- running ----------------------------------------------------------------------------------

@dataclass
class PassRecord:
    """What one pass did: its time and how the node count moved."""

    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    changed: bool


@dataclass
class PassManager:
    """Runs a pipeline over a program with instrumentation.

    verify: run the verifier after every pass (the failing pass is named).
    dump_after: pass names (or "all") whose result is printed to `dump_dir` (or `dump_fn`).
    """

    passes: list[Pass]
    verify: bool = True
    dump_after: Sequence[str] = ()
    dump_before: Sequence[str] = ()
    dump_dir: Path | None = None
    dump_fn: Callable[[str, str], None] | None = None
    on_pass: Callable[[Pass, int, int], None] | None = None  # progress: pass, index, total
    records: list[PassRecord] = field(default_factory=list)

    @classmethod
    def from_string(cls, pipeline: str, **kwargs: Any) -> PassManager:
        return cls(parse_pipeline(pipeline), **kwargs)

    def run(self, target: Graph | Program, ctx: PassContext | None = None) -> Program:
        program = target if isinstance(target, Program) else Program.of([target])
        ctx = ctx or PassContext()
        for i, p in enumerate(self.passes):
            if self.on_pass:
                self.on_pass(p, i, len(self.passes))
            if self._wants(self.dump_before, p):
                self._dump(f"{i:02d}-before-{p.name}", program)
            before = sum(len(g) for g in program)
            start = time.perf_counter()
            try:
                changed = bool(p.run(program, ctx))
            except GraphparError:
                raise
            except Exception as exc:
                raise PassError(f"pass {p.name!r} failed: {type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - start
            if changed:
                ctx.invalidate()
            if self.verify:
                for graph in program:
                    try:
                        verify(graph)
                    except GraphparError as exc:
                        raise PassError(f"after pass {p.name!r}: {exc}") from None
            self.records.append(PassRecord(p.name, seconds, before,
                                           sum(len(g) for g in program), changed))
            if self._wants(self.dump_after, p):
                self._dump(f"{i:02d}-after-{p.name}", program)
        return program

    @staticmethod
    def _wants(names: Sequence[str], p: Pass) -> bool:
        return "all" in names or p.name in names

    def _dump(self, label: str, program: Program) -> None:
        text = print_program(program, show_source=True, annotate=annotate_comm)
        if self.dump_fn is not None:
            self.dump_fn(label, text)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (Path(self.dump_dir) / f"{label}.gpir").write_text(text)


def run_pipeline(target: Graph | Program, pipeline: str | Sequence[Pass], **kwargs: Any
                 ) -> Program:
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    return PassManager(passes, **kwargs).run(target)
