"""The `graphpar` command: compile, dump, viz, ops, passes. Errors print without a traceback."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from graphpar.errors import GraphparError, OutputError, UsageError

DEFAULT_EXAMPLE = "gpt:125M"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors exit 2 like ours
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _progress(message: str) -> None:
    print(f"graphpar: {message}", file=sys.stderr, flush=True)


@contextmanager
def step(what: str) -> Iterator[None]:
    """Announce a step, and its time when it took over a second."""
    _progress(f"{what} ...")
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    if seconds > 1.0:
        _progress(f"{what}: done in {seconds:.1f} s")


def progress_printer() -> Callable[[str, int, int], None]:
    """`on_progress(stage, done, total)` for long loads: a line at most once a second, and
    only once the work has taken a second."""
    start = last = time.perf_counter()

    def report(stage: str, done: int, total: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - start > 1.0 and now - last > 1.0:
            last = now
            unit = "bytes" if stage == "parsing" else "nodes"
            _progress(f"{stage}: {done:,} of {total:,} {unit} ({now - start:.0f} s)")
    return report


def check_output_file(path: Path, option: str) -> None:
    """Refuse an output file path that cannot be one, before any slow work."""
    if not str(path) or path.is_dir():
        raise UsageError(f"{option} {str(path)!r}: give a file name, not a directory")
    if path.exists() and not path.is_file():  # a device or pipe: never rename over it
        raise UsageError(f"{option} {path}: exists and is not a regular file; give a file name")
    if not path.absolute().parent.is_dir():
        raise OutputError(f"{path}: cannot write {option} there: "
                          f"{path.absolute().parent} is not a folder")


@contextmanager
def atomic_output(path: str | os.PathLike[str], option: str) -> Iterator[IO[str]]:
    """A text file that appears at `path` only once the block finishes: it is written next to
    it and renamed over it, so a failure or an interrupt leaves nothing half-written."""
    path = Path(path)
    check_output_file(path, option)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                   dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write {option} there: {exc.strerror or exc}"
                          ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            yield file
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def example_spec(text: str, train: bool = False):
    """`gpt` or `gpt:125M` -> the bundled example model as a ModelSpec (in train mode for
    `train`: batch norm then normalizes by the batch, as a training step does)."""
    from graphpar.compiler import ModelSpec
    from graphpar.models import get_model

    name, _, preset = text.partition(":")
    example = get_model(name, preset or "tiny", train=train)
    return ModelSpec(f"{name}_{example.preset}", example.module, tuple(example.inputs),
                     example.loss_fn, tuple(example.targets), f"graphpar.models:{name}/"
                                                              f"{example.preset}")


def load_target(path: str | None, example: str | None, mode: str = "infer"):
    from graphpar.model_file import load_model_file

    if path and example:
        raise UsageError("give a model file or --example, not both")
    if example or not path:
        return example_spec(example or DEFAULT_EXAMPLE, mode == "train")
    return load_model_file(path, mode)


def cmd_compile(args: argparse.Namespace) -> int:
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.compiler import compile_model
    from graphpar.cost.communication import annotate_comm
    from graphpar.ir.printer import format_count, print_program
    from graphpar.passes import parse_pipeline

    _check_compile_options(args)  # every option is checked before any slow work
    passes = parse_pipeline(args.passes)
    if args.mesh:
        from graphpar.passes.autoshard import AutoShard

        passes.append(AutoShard(mesh=args.mesh, cluster=args.cluster,
                                memory_limit=args.memory_limit or "",
                                time_limit=args.time_limit if args.time_limit is not None
                                else 30.0))
    for option in ("dump_after", "dump_before"):
        unknown = set(_names(getattr(args, option))) - {p.name for p in passes} - {"all"}
        if unknown:
            raise UsageError(f"--{option.replace('_', '-')} {', '.join(sorted(unknown))}: not a "
                             f"pass of this pipeline ({', '.join(p.name for p in passes)}) "
                             "nor 'all'")
    if args.mesh:  # bad meshes and clusters too
        from graphpar.cost.cluster import mesh_for
        from graphpar.errors import ShardingError

        try:
            mesh_size = mesh_for(args.mesh, args.cluster).size
        except ShardingError as exc:
            raise UsageError(f"--mesh {args.mesh}: {exc}") from None
        if args.run_cpu is not None and args.run_cpu != mesh_size:
            raise UsageError(f"--run-cpu {args.run_cpu} does not match mesh {args.mesh} "
                             f"({mesh_size} devices): run one CPU rank per device")
    with step("loading the model"):
        spec = load_target(args.model, args.example, args.mode)
    optimizer = optimizer_from_name(args.optimizer) if args.mode == "train" else None
    out = Path(args.out)
    try:
        staging = Path(tempfile.mkdtemp(prefix=".graphpar-", dir=_existing_parent(out)))
    except OSError as exc:
        raise OutputError(f"{out}: cannot write --out there: {exc.strerror or exc}") from None
    try:
        dump_dir = staging / "dumps" if args.dump_after or args.dump_before else None
        with step(f"capturing {spec.name} ({args.mode})"):
            result = compile_model(
                spec, args.mode, passes, optimizer=optimizer, dump_dir=dump_dir,
                dump_after=_names(args.dump_after), dump_before=_names(args.dump_before),
                on_pass=lambda p, i, n: None, keep_grads=bool(args.run_cpu))
        ir_name = f"{result.graph.name}.gpir"
        (staging / ir_name).write_text(
            print_program(result.program, show_source=True, annotate=annotate_comm))
        summary = result.summary()
        if args.run_cpu:
            with step(f"running the plan on {args.run_cpu} CPU ranks (gloo)"):
                summary["run_cpu"] = run_on_cpu_ranks(result)
        summary["files"] = sorted(str(p.relative_to(staging)) for p in staging.rglob("*")
                                  if p.is_file()) + ["report.json"]
        (staging / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    s = summary
    print(f"graphpar compile: {s['model']} ({s['mode']}) from {s['source']}")
    print(f"  graph      {s['nodes']} nodes, {len(s['ops'])} distinct ops")
    print(f"  params     {s['parameters']:,} in {s['parameter_tensors']} tensors "
          f"({s['parameter_bytes'] / 2**20:.1f} MiB)")
    print(f"  compute    {format_count(s['flops_estimated'], 'FLOP')} per step (estimated)")
    print(f"  capture    {s['capture_seconds_measured']:.2f} s (measured)")
    for p in s["passes"]:
        print(f"  pass {p['name']:<16} {p['seconds_measured'] * 1e3:8.1f} ms   "
              f"nodes {p['nodes_before']} -> {p['nodes_after']}")
    if "plan" in s:
        p = s["plan"]
        print(f"  plan       mesh {p['mesh']} on {p['cluster']}: step "
              f"{p['step_seconds_estimated'] * 1e3:.3f} ms (compute "
              f"{p['compute_seconds_estimated'] * 1e3:.3f} + communication "
              f"{p['communication_seconds_estimated'] * 1e3:.3f}, estimated), "
              f"{p['memory_bytes_per_device_estimated'] / 2**20:.1f} MiB per device (estimated), "
              f"{p['reshards']} reshards")
        print(f"  solver     {p['solver']['status']}, {p['solver']['variables']} variables, "
              f"{p['solver']['solve_seconds']:.2f} s, gap {p['solver']['optimality_gap']}")
    if "run_cpu" in s:
        r = s["run_cpu"]
        print(f"  run-cpu    {r['ranks']} ranks: max |error| vs eager {r['max_abs_error']:.2e}; "
              f"bytes sent per rank {r['bytes_measured']:.0f} measured, "
              f"{r['bytes_predicted']:.0f} predicted")
        for line in r["error_lines"]:
            print(f"             {line}")
    top = ", ".join(f"{op} {n}" for op, n in list(s["ops"].items())[:8])
    print(f"  top ops    {top}")
    print(f"  wrote      {out / ir_name}, {out / 'report.json'}"
          + (f", {out / 'dumps'}/" if (out / "dumps").exists() and dump_dir else ""))
    return 0


def _check_compile_options(args: argparse.Namespace) -> None:
    """Usage errors in compile's options, found before the model is loaded."""
    if not args.out:
        raise UsageError("--out: give a directory name")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory; give a directory")
    if not _existing_parent(out).is_dir() or (out.parent.exists() and not out.parent.is_dir()):
        raise OutputError(f"{out}: cannot write --out there: a path component is a file")
    if args.time_limit is not None and not (math.isfinite(args.time_limit)
                                            and args.time_limit > 0):
        raise UsageError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if args.run_cpu is not None and args.run_cpu < 1:
        raise UsageError(f"--run-cpu {args.run_cpu}: give the number of CPU ranks (>= 1)")
    if args.memory_limit is not None:
        from graphpar.units import parse_bytes

        try:
            if parse_bytes(args.memory_limit) <= 0:
                raise ValueError("a memory limit must be positive")
        except ValueError as exc:
            raise UsageError(f"--memory-limit {args.memory_limit}: {exc}") from None
    if not args.mesh:
        given = [name for name, value in (("--run-cpu", args.run_cpu),
                                          ("--memory-limit", args.memory_limit),
                                          ("--time-limit", args.time_limit)) if value is not None]
        if given:
            what = "runs a sharded plan" if given[0] == "--run-cpu" else "bounds the sharding plan"
            raise UsageError(f"{given[0]} {what}: give --mesh too")
    from graphpar.cost.cluster import PRESETS

    if args.cluster not in PRESETS and Path(args.cluster).exists():  # a file, not a preset
        from graphpar.ir.parser import read_text_file

        try:
            read_text_file(Path(args.cluster), "cluster JSON file")
        except GraphparError as exc:
            raise UsageError(f"--cluster {exc}") from None


def run_on_cpu_ranks(result) -> dict:
    """Run the compiled plan on CPU ranks over gloo and compare each output with eager PyTorch
    (and torch.optim): the worst error of each kind, by name."""
    from graphpar.api import lower

    compiled = lower(result.captured, result.context, spec=result.spec,
                     optimizer=result.optimizer)
    check = compiled.check(processes=True)
    return {"ranks": compiled.mesh.size,
            "max_abs_error": check.max_abs_error,
            "errors": check.as_dict(),
            "error_lines": check.lines(),
            "bytes_measured": max(compiled.bytes_sent, default=0.0),
            "bytes_predicted": compiled.predicted_bytes}


def _names(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",")] if value else []


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path if path.is_dir() else path.parent


def _publish(staging: Path, out: Path) -> None:
    """Move finished files into `out`: a failed compile leaves nothing half-written there."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    for item in staging.iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(item, target)


def cmd_dump(args: argparse.Namespace) -> int:
    from graphpar.cost.communication import annotate_comm
    from graphpar.ir.parser import load
    from graphpar.ir.printer import print_program

    program = load(args.file, verify=not args.no_verify, on_progress=progress_printer())
    sys.stdout.write(print_program(program, show_source=args.show_source, annotate=annotate_comm))
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from graphpar.viz import render_html

    out = Path(args.output)
    check_output_file(out, "-o")
    if args.target.endswith(".py") or args.example:
        from graphpar.compiler import compile_model
        from graphpar.passes import parse_pipeline

        passes = parse_pipeline(args.passes)
        spec = load_target(None if args.example else args.target, args.example, args.mode)
        with step(f"capturing {spec.name} ({args.mode})"):
            program = compile_model(spec, args.mode, passes).program
    else:
        from graphpar.ir.parser import load

        program = load(args.target, verify=True, on_progress=progress_printer())
    with atomic_output(out, "-o") as file:
        file.write(render_html(program))
    print(f"graphpar viz: wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    from graphpar.ir.registry import all_ops

    for name, op in sorted(all_ops().items()):
        traits = sorted(t.value for t in op.traits)
        if op.comm_kind is not None:
            traits.append(f"comm={op.comm_kind}")
        shown = f"[{', '.join(traits)}]" if traits else ""
        doc = op.doc.splitlines()[0] if op.doc else ""
        print(f"{name:<24} {op.kind.value:<12} {shown:<44} {doc}".rstrip())
    return 0


def cmd_passes(args: argparse.Namespace) -> int:
    from graphpar.passes import available_passes
    from graphpar.passes.manager import _ALIASES, _PASSES

    for name in available_passes():
        if name in _ALIASES:
            print(f"{name:<20} = {_ALIASES[name]}")
        else:
            doc = (_PASSES[name].__doc__ or "").strip().splitlines()
            print(f"{name:<20} {doc[0] if doc else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphpar", description="Compile PyTorch models for many devices.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("compile", help="capture a model, run passes, write IR and a report")
    c.add_argument("model", nargs="?", help="model file defining build() (see README)")
    c.add_argument("--example", help=f"a bundled model instead, e.g. gpt:125M (default when no "
                                     f"file is given: {DEFAULT_EXAMPLE})")
    c.add_argument("--mode", choices=["infer", "train"], default="infer")
    c.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    c.add_argument("--passes", default="cleanup", help="pipeline, e.g. 'cleanup' or 'cse,dce'")
    c.add_argument("--dump-after", help="pass names (comma-separated) or 'all'")
    c.add_argument("--dump-before", help="pass names (comma-separated) or 'all'")
    c.add_argument("--out", default="graphpar-out", help="output directory")
    c.add_argument("--mesh", help="auto-shard on a device mesh, e.g. 2x4 (2-D) or 8 (1-D)")
    c.add_argument("--cluster", default="dgx-a100",
                   help="cluster preset (dgx-a100, dgx-h100, p3.16xlarge, cpu) or a JSON file")
    c.add_argument("--memory-limit", help="per-device memory limit, e.g. 40GB")
    c.add_argument("--time-limit", type=float,
                   help="auto-shard time limit, seconds: building and solving the ILP "
                        "(default 30)")
    c.add_argument("--run-cpu", type=int, metavar="N",
                   help="execute the plan on N CPU ranks (gloo) and report the error vs eager")
    c.set_defaults(fn=cmd_compile)

    d = sub.add_parser("dump", help="validate and print an IR file")
    d.add_argument("file")
    d.add_argument("--show-source", action="store_true")
    d.add_argument("--no-verify", action="store_true")
    d.set_defaults(fn=cmd_dump)

    v = sub.add_parser("viz", help="write a self-contained HTML view of a graph")
    v.add_argument("target", nargs="?", default="", help="an IR file or a model file")
    v.add_argument("--example", help="a bundled model instead, e.g. gpt:tiny")
    v.add_argument("-o", "--output", default="graph.html")
    v.add_argument("--mode", choices=["infer", "train"], default="infer")
    v.add_argument("--passes", default="cleanup")
    v.set_defaults(fn=cmd_viz)

    from graphpar.cli_generate import add_generate_parser

    add_generate_parser(sub)

    sub.add_parser("ops", help="list the IR ops").set_defaults(fn=cmd_ops)
    sub.add_parser("passes", help="list the passes").set_defaults(fn=cmd_passes)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the process is so that cleanup (`finally`) runs as for Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (errors print one line, no traceback)."""
    previous = signal.getsignal(signal.SIGTERM)
    with suppress(ValueError):  # not the main thread: leave signals alone
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _run(argv)
    finally:
        with suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning as one line of ours, not a source excerpt of graphpar's code."""
    text = " ".join(str(message).split())
    print(f"graphpar: warning: {text}", file=sys.stderr)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if not getattr(args, "fn", None):
            build_parser().print_help()
            return 2
        if args.command == "viz" and not (args.target or args.example):
            raise UsageError("viz needs an IR file, a model file or --example")
        return args.fn(args)
    except GraphparError as exc:
        print(f"graphpar: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("graphpar: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("graphpar: terminated", file=sys.stderr)
        return 143
    except BrokenPipeError:  # the reader went away (`graphpar ops | head`): nothing to say
        with suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MemoryError:
        print("graphpar: error: ran out of memory (RAM); try a smaller model, input or mesh, "
              "or a machine with more memory", file=sys.stderr)
        return 1
    except OSError as exc:
        return _os_error(exc)
    except Exception as exc:  # a bug in graphpar, not the user's input
        return _internal_error(exc)


def _os_error(exc: OSError) -> int:
    """A file system error: the user's path, or the disk, named; else a bug."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f"writing {exc.filename}" if exc.filename else "writing output"
        print(f"graphpar: error: no space left on the device ({where}); free some space or "
              "write somewhere else", file=sys.stderr)
        return 1
    if exc.filename is None:  # not a path the user gave: a bug, reported below
        return _internal_error(exc)
    print(f"graphpar: error: {exc.filename}: {exc.strerror or exc}; check that the path "
          "exists and can be written (or read)", file=sys.stderr)
    return 1


def _internal_error(exc: Exception) -> int:
    if os.environ.get("GRAPHPAR_DEBUG"):
        raise exc
    print(f"graphpar: internal error: {type(exc).__name__}: {exc}\n"
          "  this is a graphpar bug; rerun with GRAPHPAR_DEBUG=1 for a traceback and "
          "report it", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
