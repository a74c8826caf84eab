"""`graphpar dump`, `viz`, `ops` and `passes`: look at IR files, graphs, ops and passes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphpar.cli.common import (
    atomic_output,
    check_output_file,
    check_size_options,
    load_target,
    progress_printer,
    step,
)
from graphpar.errors import UsageError


def cmd_dump(args: argparse.Namespace) -> int:
    from graphpar.cost.communication import annotate_comm
    from graphpar.ir.parser import load
    from graphpar.ir.printer import print_program

    if str(args.file).endswith(".calls"):  # a CUDA listing (graphpar compile --lower cuda)
        from graphpar.ir.cuda_listing import parse_listing, print_listing
        from graphpar.ir.parser import read_text_file

        sys.stdout.write(print_listing(parse_listing(read_text_file(Path(args.file),
                                                                    "CUDA listing"),
                                                     str(args.file))))
        return 0
    program = load(args.file, verify=not args.no_verify, on_progress=progress_printer())
    sys.stdout.write(print_program(program, show_source=args.show_source, annotate=annotate_comm))
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from graphpar.viz import render_html

    out = Path(args.output)
    check_output_file(out, "-o")
    check_size_options(args)
    from graphpar.cli.pipeline import check_pipeline_options_need_pipeline

    check_pipeline_options_need_pipeline(args)
    if args.pipeline:
        page = _pipeline_page(args)
    elif args.target.endswith(".py") or args.example:
        from graphpar.compiler.driver import compile_model
        from graphpar.passes import parse_pipeline

        passes = parse_pipeline(args.passes)
        spec = load_target(None if args.example else args.target, args.example, args.mode,
                           weights=False, batch=args.batch, seq_len=args.seq_len)
        with step(f"capturing {spec.name} ({args.mode})"):
            program = compile_model(spec, args.mode, passes).program
    else:
        from graphpar.ir.parser import load

        program = load(args.target, verify=True, on_progress=progress_printer())
    if not args.pipeline:
        page = render_html(program)
    with atomic_output(out, "-o") as file:
        file.write(page)
    print(f"graphpar viz: wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


def _pipeline_page(args: argparse.Namespace) -> str:
    """`viz --pipeline`: the MPMD program of `compile --pipeline` (same options, same compile)
    and, after it, the sliced global training step with its nodes coloured by stage."""
    from graphpar.cli.pipeline import check_pipeline_options, compile_pipeline
    from graphpar.ir.graph import Program
    from graphpar.passes import parse_pipeline
    from graphpar.viz import render_html

    if args.target and not args.target.endswith(".py"):
        raise UsageError(f"viz --pipeline compiles a model: give a model file (.py) or "
                         f"--example, not {args.target}; an MPMD program file (*_pipeline.gpir) "
                         "is drawn as a pipeline without --pipeline")
    options = argparse.Namespace(**vars(args), model=args.target or None, run_cpu=None,
                                 trace=None, lower=None)
    check_pipeline_options(options)
    compiled = compile_pipeline(options, parse_pipeline(args.passes))
    plan = compiled.plan
    program = Program.of([*compiled.program, compiled.result.graph])
    estimates = [{"est_seconds": s.est_seconds, "mem_bytes": s.mem_bytes} for s in plan.stages]
    title = (f"{compiled.spec.name}: {len(plan.stages)} stages, {plan.microbatches} "
             f"microbatches, {options.schedule}")
    return render_html(program, title, stage_of=plan.stage_of, stage_estimates=estimates)


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
