"""The `graphpar` command line: subcommands, and one line per error with its exit status."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from contextlib import suppress

import graphpar.cli.show as show
from graphpar.cli.calibrate import add_calibrate_parser
from graphpar.cli.common import (
    _Parser,
    add_model_options,
    add_pipeline_options,
    add_plan_options,
    add_size_options,
)
from graphpar.cli.compile import cmd_compile
from graphpar.cli.explain import add_explain_parser
from graphpar.cli.export import add_export_parser
from graphpar.cli.generate import add_generate_parser
from graphpar.cli.place import add_place_parser
from graphpar.cli.serve import add_serve_parser
from graphpar.cli.train import add_train_parser
from graphpar.errors import GraphparError, UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphpar", description="Compile PyTorch models for many devices.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    c = sub.add_parser("compile", help="capture a model, run passes, write IR and a report")
    add_model_options(c)
    c.add_argument("--passes", default="cleanup", help="pipeline, e.g. 'cleanup' or 'cse,dce'")
    c.add_argument("--dump-after", help="pass names (comma-separated) or 'all'")
    c.add_argument("--dump-before", help="pass names (comma-separated) or 'all'")
    c.add_argument("--out", default="graphpar-out", help="output directory")
    add_plan_options(c, "auto-shard on a device mesh, e.g. 2x4 (2-D) or 8 (1-D)")
    c.add_argument("--run-cpu", type=int, metavar="N",
                   help="certify the plan: run it on N CPU ranks (gloo) against eager PyTorch "
                        "(float64), each element against its float32 rounding; exit 1 when it "
                        "differs")
    c.add_argument("--run-cpu-steps", type=int, metavar="K",
                   help="with --run-cpu in train mode: compare K steps, state carried "
                        "(default 3)")
    c.add_argument("--lower", "--backend", dest="lower", choices=["cuda"],
                   help="also lower each device program to a CUDA listing (cuBLAS, NCCL and "
                        "generated-kernel calls): OUT/cuda/rank<R>.calls and kernels/")
    add_pipeline_options(c, "slice the training step into pipeline stages on sub-meshes of "
                            "--mesh (Alpa's inter-op DP over the ILP): 'auto' or a number of "
                            "stages")
    c.add_argument("--trace", metavar="FILE",
                   help="with --pipeline and --run-cpu: write each rank's measured timeline as "
                        "a Chrome trace")
    c.set_defaults(fn=cmd_compile)

    d = sub.add_parser("dump", help="validate and print an IR file (or a CUDA listing, *.calls)")
    d.add_argument("file")
    d.add_argument("--show-source", action="store_true")
    d.add_argument("--no-verify", action="store_true")
    d.set_defaults(fn=show.cmd_dump)

    v = sub.add_parser("viz", help="write a self-contained HTML view of a graph")
    v.add_argument("target", nargs="?", default="", help="an IR file or a model file")
    v.add_argument("--example", help="a bundled model instead, e.g. gpt:tiny")
    v.add_argument("-o", "--output", default="graph.html")
    v.add_argument("--mode", choices=["infer", "train"], default="infer")
    add_size_options(v)
    v.add_argument("--passes", default="cleanup")
    v.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    v.add_argument("--mesh", help="with --pipeline: the devices to slice over, e.g. 1x4")
    v.add_argument("--cluster", default="dgx-a100",
                   help="cluster preset (dgx-a100, dgx-h100, p3.16xlarge, cpu) or a JSON file")
    v.add_argument("--memory-limit", help="with --pipeline: per-device memory, as for compile")
    v.add_argument("--time-limit", type=float, help="with --pipeline: ILP time limit, seconds")
    add_pipeline_options(v, "slice the training step into stages as `compile --pipeline` does "
                            "and draw the MPMD program as bands, plus the global graph coloured "
                            "by stage")
    v.set_defaults(fn=show.cmd_viz)

    add_explain_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_place_parser(sub)
    add_calibrate_parser(sub)
    add_train_parser(sub)

    sub.add_parser("ops", help="list the IR ops").set_defaults(fn=show.cmd_ops)
    sub.add_parser("passes", help="list the passes").set_defaults(fn=show.cmd_passes)
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
