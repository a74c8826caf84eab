"""`graphpar compile`: capture a model, run passes (auto-shard with --mesh), write IR, a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from graphpar.cli.common import (
    TIMED_STEPS,
    WARMUP_STEPS,
    _names,
    auto_shard_pass,
    bytes_sent_text,
    certified,
    check_output_dir,
    check_plan_options,
    check_size_options,
    load_target,
    publish_report,
    staged_output,
    step,
    step_time_line,
    step_time_report,
)
from graphpar.errors import UsageError


def cmd_compile(args: argparse.Namespace) -> int:
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.compiler.driver import compile_model
    from graphpar.cost.communication import annotate_comm
    from graphpar.ir.printer import format_count, print_program
    from graphpar.passes import parse_pipeline

    _check_compile_options(args)  # every option is checked before any slow work
    check_size_options(args)
    passes = parse_pipeline(args.passes)
    from graphpar.cli.pipeline import check_pipeline_options_need_pipeline

    check_pipeline_options_need_pipeline(args)
    if args.pipeline:
        from graphpar.cli.pipeline import check_pipeline_options, cmd_compile_pipeline

        check_pipeline_options(args)
        return cmd_compile_pipeline(args, passes)
    if args.mesh:  # bad meshes and clusters too, named by their option
        auto_shard = auto_shard_pass(args)
        if args.run_cpu is not None and args.run_cpu != auto_shard.mesh.size:
            raise UsageError(f"--run-cpu {args.run_cpu} does not match mesh {args.mesh} "
                             f"({auto_shard.mesh.size} devices): run one CPU rank per device")
        passes.append(auto_shard)
    for option in ("dump_after", "dump_before"):
        unknown = set(_names(getattr(args, option))) - {p.name for p in passes} - {"all"}
        if unknown:
            raise UsageError(f"--{option.replace('_', '-')} {', '.join(sorted(unknown))}: not a "
                             f"pass of this pipeline ({', '.join(p.name for p in passes)}) "
                             "nor 'all'")
    with step("loading the model"):
        spec = load_target(args.model, args.example, args.mode, weights=bool(args.run_cpu),
                           batch=args.batch, seq_len=args.seq_len)
    optimizer = optimizer_from_name(args.optimizer) if args.mode == "train" else None
    out = Path(args.out)
    with staged_output(out) as staging:
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
        cuda = getattr(args, "lower", None) == "cuda" or "lower-cuda" in {p.name for p in passes}
        compiled = None
        if args.run_cpu or (cuda and args.mesh):
            from graphpar.compiler.api import lower

            compiled = lower(result.captured, result.context, spec=result.spec,
                             optimizer=result.optimizer)
        if args.run_cpu:
            with step(f"running the plan on {args.run_cpu} CPU ranks (gloo)"):
                summary["run_cpu"] = run_on_cpu_ranks(result, compiled, args.run_cpu_steps)
        if cuda:
            from graphpar.cli.cuda import cuda_report, device_listings, write_listings

            with step("lowering to CUDA listings"):
                listings = device_listings(result, compiled)
            write_listings(listings, staging / "cuda")
            summary["cuda"] = cuda_report(listings)
            if args.run_cpu:
                with step(f"running the CUDA listings on {args.run_cpu} CPU ranks (gloo)"):
                    check = compiled.check(processes=True, backend="cuda", poison=True,
                                           steps=args.run_cpu_steps)
                summary["cuda"].update(check.report())
                summary["cuda"]["error_lines"] = check.lines()
                summary["cuda"]["arena_bytes_measured"] = list(compiled.peak_arena_bytes)
        publish_report(summary, staging, out)
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
              f"{p['communication_seconds_estimated'] * 1e3:.3f}, estimated; compute as a "
              f"{p['compute_model'] or 'roofline'}), "
              f"{p['memory_bytes_per_device_estimated'] / 2**20:.1f} MiB per device (estimated), "
              f"{p['reshards']} reshards")
        print(f"  solver     {p['solver']['status']}, {p['solver']['variables']} variables, "
              f"{p['solver']['solve_seconds']:.2f} s, gap {p['solver']['optimality_gap']}")
    if "run_cpu" in s:
        r = s["run_cpu"]
        print(f"  run-cpu    {r['ranks']} ranks: max |error| vs eager {r['max_abs_error']:.2e}")
        print("             bytes sent per rank: " + bytes_sent_text(
            r["bytes_counted"], r["bytes_logical"], r["bytes_predicted"]))
        for line in r["error_lines"]:
            print(f"             {line}")
        if "step_seconds_measured" in r:
            print(f"             {step_time_line(r)}")
        print(f"  {r['verdict']}")
    if "cuda" in s:
        from graphpar.cli.cuda import print_cuda_report

        print_cuda_report(s["cuda"])
    top = ", ".join(f"{op} {n}" for op, n in list(s["ops"].items())[:8])
    print(f"  top ops    {top}")
    print(f"  wrote      {out / ir_name}, {out / 'report.json'}"
          + (f", {out / 'cuda'}/" if "cuda" in s else "")
          + (f", {out / 'dumps'}/" if (out / "dumps").exists() and dump_dir else ""))
    return certified(s.get("run_cpu"), s.get("cuda"))


def _check_compile_options(args: argparse.Namespace) -> None:
    """Usage errors in compile's options, found before the model is loaded."""
    check_output_dir(args.out)
    check_plan_options(args)
    if args.run_cpu is not None and args.run_cpu < 1:
        raise UsageError(f"--run-cpu {args.run_cpu}: give the number of CPU ranks (>= 1)")
    if args.run_cpu_steps is None:
        args.run_cpu_steps = 3
    elif args.run_cpu is None:
        raise UsageError(f"--run-cpu-steps {args.run_cpu_steps} sets how many steps --run-cpu "
                         "compares: give --run-cpu N too")
    elif args.run_cpu_steps < 1:
        raise UsageError(f"--run-cpu-steps {args.run_cpu_steps}: give the number of steps to "
                         "compare (>= 1)")
    if not args.mesh:
        given = [name for name, value in (("--run-cpu", args.run_cpu),
                                          ("--memory-limit", args.memory_limit),
                                          ("--time-limit", args.time_limit)) if value is not None]
        if given:
            what = "runs a sharded plan" if given[0] == "--run-cpu" else "bounds the sharding plan"
            raise UsageError(f"{given[0]} {what}: give --mesh too")


def run_on_cpu_ranks(result, compiled=None, steps: int = 3) -> dict:
    """Run the compiled plan on CPU ranks over gloo, `steps` steps in train mode, and compare
    each output with eager PyTorch in float64 (and torch.optim): the worst error of each kind,
    by name, and the verdict (`graphpar.compiler.check.eager`)."""
    from graphpar.compiler.api import lower

    if compiled is None:
        compiled = lower(result.captured, result.context, spec=result.spec,
                         optimizer=result.optimizer)
    check = compiled.check(processes=True, steps=steps)
    report = {"ranks": compiled.mesh.size, **check.report(),
              "error_lines": check.lines(),
              # per rank, the most: payloads handed to gloo; by the plan's definition
              "bytes_counted": max(compiled.bytes_counted, default=0.0),
              "bytes_logical": max(compiled.bytes_sent, default=0.0),
              "bytes_predicted": compiled.predicted_bytes}
    if not check.within_tolerance:  # a wrong plan's speed is beside the point
        return report
    from graphpar.calibration.plan_runs import program_seconds

    (times,) = compiled.time_steps(TIMED_STEPS, WARMUP_STEPS)
    # the estimate of the program that ran (its nodes priced): the plan's objective can be
    # higher, as it prices a value resharded for several readers once per reader
    report.update(step_time_report(times.as_dict(), program_seconds(compiled)))
    report["step_seconds_objective"] = compiled.plan.step_seconds
    return report
