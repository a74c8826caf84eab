"""An `Interpreter`'s plan written out as one Python function, as `torch.fx.GraphModule` writes
its graph: a line per node, each value a local variable, `del` where a value dies.

    v12 = f7(v3, v9)                  # %12 = matmul(%3, %9)
    v13 = f8(v12, c8_1)               # %13 = add(%12, 1e-05)
    del v12

Running the function instead of walking the plan saves the interpreter's per-node work
(fetching operands from the slot list, storing results, the loop itself): about a quarter of a
small training step's time, whose 580 nodes each take a few microseconds (measured in
`docs/training.md`). Collectives go to the interpreter's `communicate` hook, buckets of
all-reduces are launched and waited for where planned (`graphpar.runtime.overlap`), exactly
as `Interpreter.run` interprets them. A failing line is mapped back to its node.

`Interpreter.code` shows the text; the traceback of a failure in it shows its lines.
"""

from __future__ import annotations

import itertools
import keyword
import linecache
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graphpar.ir.graph import Node, Value

if TYPE_CHECKING:
    from graphpar.backends.interpreter import Interpreter

__all__ = ["Generated", "generate", "spread"]

_COUNT = itertools.count()


class Generated:
    """The function, its source and, per line, the node it runs (for errors)."""

    def __init__(self, plan: list, source: str, function: Callable[[list], list],
                 line_nodes: dict[int, Node], filename: str) -> None:
        self.plan, self.source, self.function = plan, source, function
        self.line_nodes, self.filename = line_nodes, filename

    def failing_node(self, exc: BaseException) -> Node | None:
        """The node whose line raised `exc` (the innermost frame in the generated code). The
        source goes into `linecache` then, so that the traceback shows its lines (not before:
        a long-running server makes many programs, and linecache keeps what it is given)."""
        linecache.cache[self.filename] = (len(self.source), None,
                                          self.source.splitlines(True), self.filename)
        tb, node = exc.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                node = self.line_nodes.get(tb.tb_lineno, node)
            tb = tb.tb_next
        return node


def spread(result: Any, n: int) -> tuple:
    """An op's result as its `n` outputs: a tuple or list gives its items (an op may return a
    1-tuple for its one output), anything else is the first output; outputs it does not give
    are None."""
    given = tuple(result[:n]) if isinstance(result, (tuple, list)) else (result,)[:n]
    return given + (None,) * (n - len(given))


def generate(interp: Interpreter) -> Generated:
    """`interp`'s plan (its buckets included) as a function of the slot list `bind` fills,
    returning the graph's outputs."""
    graph, slot = interp.graph, interp.slot
    names: dict[str, Any] = {"_comm": interp.communicate, "_seq": (tuple, list),
                             "_spread": spread}
    lines = ["def step(env):"]
    line_nodes: dict[int, Node] = {}

    def emit(text: str, node: Node | None = None) -> None:
        lines.append("    " + text)
        if node is not None:
            line_nodes[len(lines)] = node

    def operand(i: int, k: int, x: object) -> str:
        if isinstance(x, Value):
            return f"v{slot[x]}"
        names[f"c{i}_{k}"] = x
        return f"c{i}_{k}"

    for _, index, _ in interp.inputs:
        emit(f"v{index} = env[{index}]")
    buckets = interp._buckets
    if buckets:
        emit("_pending = {}")
    for k, (requests, _) in enumerate(buckets):
        names[f"_launch{k}"] = interp.comm.launch_all_reduce  # type: ignore[union-attr]
        for i, node, _ in requests:
            names[f"n{i}"] = node

    def launch(after: int) -> None:
        for k in interp._launches.get(after, ()):
            requests = ", ".join(
                f"({i}, n{i}, [{', '.join(operand(i, j, x) for j, x in enumerate(node.inputs))}])"
                for i, node, _ in buckets[k][0])
            emit(f"_pending[{k}] = _launch{k}([{requests}])", buckets[k][0][0][1])

    def arrive(before: int) -> None:
        for k in interp._waits.get(before, ()):
            requests, slots = buckets[k]
            emit(f"{', '.join(f'v{s}' for s in slots)}, = _pending.pop({k})()", requests[0][1])

    launch(-1)
    for index, node, fn, _, attrs, outs, frees in interp.plan:
        arrive(index)
        if index not in interp._bucketed:
            args = [operand(index, k, x) for k, x in enumerate(node.inputs)]
            if fn is None:
                names[f"n{index}"] = node
                call = f"_comm({index}, n{index}, [{', '.join(args)}])"
            else:
                names[f"f{index}"] = fn
                if all(k.isidentifier() and not keyword.iskeyword(k) for k in attrs):
                    for key, value in attrs.items():
                        names[f"a{index}_{key}"] = value
                        args.append(f"{key}=a{index}_{key}")
                elif attrs:  # a name Python cannot spell as a keyword argument
                    names[f"a{index}"] = attrs
                    args.append(f"**a{index}")
                call = f"f{index}({', '.join(args)})"
            # as `spread`, the one output inline (the usual case, on the hot path)
            note = f"  # {node.op}" + (f" ({node.module})".replace("\n", " ")
                                       if node.module else "")
            if len(outs) == 1:
                emit(f"_r = {call}{note}", node)
                emit(f"v{outs[0]} = (_r[0] if _r else None) if isinstance(_r, _seq) else _r")
            elif outs:
                emit(f"{', '.join(f'v{o}' for o in outs)} = _spread({call}, {len(outs)}){note}",
                     node)
            else:
                emit(call, node)
        if frees:
            emit(f"del {', '.join(f'v{f}' for f in frees)}")
        launch(index)
    arrive(len(interp.plan))
    emit(f"return [{', '.join(f'v{i}' for i in interp.outputs)}]")
    source = "\n".join(lines) + "\n"
    filename = f"<graphpar @{graph.name} {next(_COUNT)}>"
    exec(compile(source, filename, "exec"), names)  # noqa: S102 - our own generated code
    return Generated(interp.plan, source, names["step"], line_nodes, filename)
