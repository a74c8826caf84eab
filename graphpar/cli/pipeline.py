"""`graphpar compile --pipeline auto|S`: slice a training step into pipeline stages on sub-meshes
(Alpa's inter-op pass over the intra-op ILP), write the MPMD program and a report, and with
`--run-cpu` run one pipelined step on CPU ranks against eager PyTorch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from graphpar.cli.common import (
    check_output_file,
    load_target,
    plan_limits,
    plan_mesh,
    publish_report,
    staged_output,
    step,
)
from graphpar.errors import UsageError

if TYPE_CHECKING:  # imported at run time, inside the functions, like the rest of the CLI
    from graphpar.compiler.driver import CompileResult, ModelSpec
    from graphpar.compiler.pipelined import PipelineCompiled
    from graphpar.ir.graph import Program
    from graphpar.passes.pipeline.plan import StagePlan


def check_pipeline_options(args: argparse.Namespace) -> None:
    """Usage errors of the pipeline options, found before the model is loaded."""
    if args.mode != "train":
        raise UsageError("--pipeline slices a training step into stages: add --mode train")
    if not args.mesh:
        raise UsageError("--pipeline needs the devices to slice over: give --mesh too "
                         "(e.g. --mesh 2x4)")
    if args.pipeline != "auto" and not (args.pipeline.isdigit() and int(args.pipeline) >= 1):
        raise UsageError(f"--pipeline {args.pipeline}: give 'auto' or a number of stages")
    devices = plan_mesh(args).size
    if args.pipeline != "auto" and int(args.pipeline) > devices:
        raise UsageError(f"--pipeline {args.pipeline}: more stages than the {devices} devices "
                         f"of --mesh {args.mesh}; give at most {devices} stages or 'auto'")
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches}: give at least 1")
    if args.microbatches is not None and args.microbatches > MAX_MICROBATCHES:
        raise UsageError(f"--microbatches {args.microbatches}: more than {MAX_MICROBATCHES:,}; "
                         "give a number of microbatches that divides the batch")
    if args.schedule is None:
        args.schedule = DEFAULT_SCHEDULE
    if getattr(args, "trace", None):
        check_output_file(Path(args.trace), "--trace")
    steps = getattr(args, "run_cpu_steps", None)
    if steps is not None and steps < 1:
        raise UsageError(f"--run-cpu-steps {args.run_cpu_steps}: give the number of steps to "
                         "compare (>= 1)")
    if args.token_slices is not None:
        from graphpar.passes.pipeline.slice_tokens import slice_count

        slice_count(args.token_slices, "--token-slices ")
    if getattr(args, "trace", None) and not getattr(args, "run_cpu", None):
        raise UsageError("--trace writes the measured timeline of a run: give --run-cpu too")
    if getattr(args, "token_slices", None):
        from graphpar.passes.pipeline.schedules import TOKEN_SCHEDULES

        if args.schedule not in TOKEN_SCHEDULES:
            raise UsageError(f"--schedule {args.schedule} with --token-slices: token-sliced "
                             f"steps run {' or '.join(TOKEN_SCHEDULES)}")


def default_microbatches(batch: int, most: int = 4) -> int:
    """The microbatches a step is cut into when the user gives none: `most`, or the largest
    smaller count that divides the batch (every microbatch must be the same size)."""
    return max(d for d in range(1, min(most, batch) + 1) if batch % d == 0)


DEFAULT_SCHEDULE = "1f1b"  # --schedule when none is given
MAX_MICROBATCHES = 65_536  # more than any batch a step is cut into; the batch bounds it after


def check_pipeline_options_need_pipeline(args: argparse.Namespace) -> None:
    """--token-slices, --microbatches, --schedule and --trace only act on a pipeline: without
    --pipeline each is an error that says so, not silently ignored."""
    if args.pipeline:
        return
    for option, what in (("token_slices", "sends token slices through pipeline stages"),
                         ("microbatches", "cuts the step for pipeline stages"),
                         ("schedule", "orders the pipeline stages' work"),
                         ("trace", "writes the pipeline's measured timeline")):
        if getattr(args, option, None) is not None:
            raise UsageError(f"--{option.replace('_', '-')} {what}: give --pipeline auto|S "
                             "too (and --mode train); without it, it has no effect")


def check_microbatches_fit(args: argparse.Namespace, spec: ModelSpec) -> None:
    """--microbatches against the model's batch, once it is loaded and before capture."""
    batch = len(spec.inputs[0]) if spec.inputs and spec.inputs[0].dim() else 1
    n = args.microbatches
    if n is not None and (n > batch or batch % n):
        raise UsageError(f"--microbatches {n}: the batch of {batch} cannot be cut into {n} "
                         f"equal microbatches; give a divisor of {batch}")


@dataclass(frozen=True)
class CompiledPipeline:
    """What `compile_pipeline` made: the model, the sliced training step at the microbatch
    size (its `StagePlan` in `plan`), the stage programs and schedule (`pipe`) and the MPMD
    program lowered from them."""

    spec: ModelSpec  # the full batch
    result: CompileResult  # the compile of one microbatch
    plan: StagePlan
    pipe: PipelineCompiled  # the stage programs and schedule
    program: Program  # the MPMD program (graphpar.passes.pipeline.lower_mpmd)
    microbatch_size: int


def compile_pipeline(args: argparse.Namespace, passes: list,
                     weights: bool = False) -> CompiledPipeline:
    """Capture the step at the microbatch size, run `passes` and slice-stages, build the
    stage programs and the schedule and lower them to the MPMD program. Reads the options of
    `graphpar compile --pipeline` from `args` (model, example, mode, mesh, cluster, pipeline,
    microbatches, schedule, optimizer, memory_limit, time_limit, run_cpu). The model is built
    with its weights when they will be used (`weights`, or --run-cpu); else on meta."""
    from graphpar.capture.optim import optimizer_from_name
    from graphpar.compiler.pipelined import slice_and_build
    from graphpar.passes.pipeline.lower_mpmd import lower_mpmd
    from graphpar.passes.pipeline.slice_tokens import slice_count
    from graphpar.runtime.pipeline import MicrobatchError

    run_cpu = getattr(args, "run_cpu", None)
    mesh = plan_mesh(args)  # the user's options, read once: every ILP gets these objects
    limits = plan_limits(args, mesh.cluster)
    if run_cpu is not None and run_cpu != mesh.size:
        raise UsageError(f"--run-cpu {run_cpu} does not match mesh {args.mesh} "
                         f"({mesh.size} devices): run one CPU rank per device")
    with step("loading the model"):
        spec = load_target(args.model, args.example, args.mode, weights=weights or bool(run_cpu),
                           batch=args.batch, seq_len=args.seq_len)
    check_microbatches_fit(args, spec)
    if args.microbatches is None:
        args.microbatches = default_microbatches(len(spec.inputs[0]))
    optimizer = optimizer_from_name(args.optimizer)
    with step(f"capturing {spec.name} (train, {args.microbatches} microbatches) and "
              "slicing stages"):
        try:
            sliced = slice_and_build(
                spec, mesh, limits, stages=args.pipeline, microbatches=args.microbatches,
                schedule=args.schedule, optimizer=optimizer, passes=passes,
                keep_grads=bool(run_cpu),
                token_slices=slice_count(getattr(args, "token_slices", None), "--token-slices "),
                power_of_two_hosts=getattr(args, "power_of_two_hosts", False))
        except MicrobatchError as exc:
            raise UsageError(f"--microbatches {args.microbatches}: {exc}") from None
    plan, pipe = sliced.plan, sliced.pipe
    program = lower_mpmd(pipe.programs, [s.devices or (i,) for i, s in
                                         enumerate(plan.stages)])
    for key in ("token_slices", "batch_slices"):  # every stage graph carries the slicing
        if key in sliced.result.graph.attrs:
            for graph in program:
                graph.attrs[key] = sliced.result.graph.attrs[key]
    size = len(spec.inputs[0]) // args.microbatches
    return CompiledPipeline(spec, sliced.result, plan, pipe, program, size)


def cmd_compile_pipeline(args: argparse.Namespace, passes: list) -> int:
    """`compile_pipeline`, then write IR and report; optionally run on CPU ranks."""
    from graphpar.ir.printer import print_program

    out = Path(args.out)
    with staged_output(out) as staging:
        compiled = compile_pipeline(args, passes)
        spec, result, plan, pipe = compiled.spec, compiled.result, compiled.plan, compiled.pipe
        ir_name = f"{result.graph.name}_pipeline.gpir"
        annotate_stage_estimates(compiled.program, plan)
        (staging / ir_name).write_text(print_program(compiled.program, show_source=True))
        summary = result.summary()
        summary["pipeline"] = pipeline_report(plan, pipe, args.schedule)
        if args.token_slices is not None:
            from graphpar.cost.timeline import chrome_trace

            tokens = token_slicing_report(result)
            timeline = token_timeline(plan, result)
            tokens["schedule_step_seconds_estimated"] = timeline.step_seconds
            tokens["trace"] = "token_trace.json"
            chrome_trace(timeline.spans, staging / tokens["trace"],
                         slices=len(tokens["token_slices"]))
            summary["pipeline"]["token_slicing"] = tokens
        if args.lower == "cuda":
            with step("lowering every stage program to CUDA listings"):
                summary["cuda"] = lower_stage_programs(compiled.program, staging / "cuda")
        if args.run_cpu and getattr(args, "token_slices", None):
            from graphpar.compiler.token_pipelined import run_token_pipeline_on_cpu

            with step("running the pipeline token slice by token slice on CPU ranks (gloo, "
                      "one process per stage)"):
                spec.real_module()  # weights are made only now, to run
                summary["run_cpu_tokens"] = run_token_pipeline_on_cpu(
                    pipe, list(result.graph.attrs["token_slices"]), args.schedule,
                    trace=args.trace, steps=args.run_cpu_steps)
        elif args.run_cpu:
            with step("running the pipeline on CPU ranks (gloo, one process per device)"):
                summary["run_cpu"] = run_pipeline_on_cpu(spec, pipe, args,
                                                         summary["pipeline"])
        publish_report(summary, staging, out)
    print_pipeline_report(summary, out / ir_name, out / "report.json")
    from graphpar.cli.common import certified

    return certified(summary.get("run_cpu"), summary.get("run_cpu_tokens"))


def annotate_stage_estimates(program, plan) -> None:
    """Each stage graph of the MPMD program gets its stage's estimates as graph attributes
    (`est_seconds` per microbatch, `mem_bytes` per device, both from the cost model), so the
    written file carries them: `graphpar viz` shows them on the stage's band."""
    from graphpar.viz.stages import stage_of_graph

    for graph in program:
        found = stage_of_graph(graph)
        if found is not None and found[0] < len(plan.stages):
            stage = plan.stages[found[0]]
            graph.attrs["est_seconds"] = float(stage.est_seconds)
            graph.attrs["mem_bytes"] = int(stage.mem_bytes)

def lower_stage_programs(program, directory: Path) -> dict:
    """Each graph of the MPMD program (a stage's forward, backward, update) lowered to one
    listing per device of its sub-mesh, written to `directory/<graph>/`; their reports."""
    from graphpar.cli.cuda import cuda_report, write_listings
    from graphpar.passes.lower_cuda import lower_to_listing

    reports = {}
    for graph in program:
        listings = [lower_to_listing(graph, graph.mesh, r) for r in range(graph.mesh.size)]
        write_listings(listings, directory / graph.name)
        reports[graph.name] = cuda_report(listings)
    return reports


def pipeline_report(plan, pipe, schedule: str) -> dict:
    """The stage plan as report data; step time and bubble from the schedule simulated over
    the DP's per-stage estimates (forward : backward taken as 1 : 2)."""
    from graphpar.cost.timeline import simulate

    per_stage = [s.est_seconds for s in plan.stages]
    timeline = simulate(pipe.schedule, [t / 3 for t in per_stage],
                        [2 * t / 3 for t in per_stage], [0.0] * (len(per_stage) - 1),
                        [t / 3 for t in per_stage] if schedule == "zb" else None)
    return {
        "stages": [{"layers": list(s.layers), "modules": list(s.modules),
                    "submesh": "x".join(map(str, s.submesh)),
                    "logical_mesh": "x".join(map(str, s.logical_mesh)),
                    "devices": list(s.devices),
                    "seconds_per_microbatch_estimated": s.est_seconds,
                    "memory_bytes_per_device_estimated": s.mem_bytes} for s in plan.stages],
        "schedule": schedule,
        "microbatches": plan.microbatches,
        "step_seconds_estimated": plan.est_step_seconds,
        "schedule_step_seconds_estimated": timeline.step_seconds,
        "bubble_fraction_estimated": timeline.bubble_fraction,
        "search_seconds_measured": plan.dp_seconds,
        "ilp_solves": plan.ilp_solves,
        "layer_solves": plan.layer_solves.as_dict(),  # the same solves, counted by outcome
        "bytes_between_stages_predicted": pipe.predicted_bytes,
    }


def token_slicing_report(result) -> dict:
    """The slice-tokens result as report data (times estimated by the cost model, the DP's
    own time measured)."""
    from graphpar.passes.pipeline.token_slicing import TokenSlicing

    tokens = result.context.result(TokenSlicing)
    return {"token_slices": list(tokens.slices), "batch_slices": list(tokens.batch_slices),
            "step_seconds_estimated": tokens.est_seconds,
            "step_seconds_unsliced_estimated": tokens.est_unsliced_seconds,
            "gap_bound_seconds": tokens.gap_bound_seconds,
            "dp_seconds_measured": tokens.dp_seconds, "dp_bounds_evaluated": tokens.evaluated}


def token_timeline(plan, result):
    """The step as GPipe over (microbatch, token slice) units (`token_schedule`), simulated on
    the stage plan's estimates (forward : backward as 1 : 2), each unit's time the stage's per
    microbatch time times its slice's share (`TokenSlicing.slice_shares`). Estimated."""
    from graphpar.cost.timeline import simulate
    from graphpar.passes.pipeline.schedules import token_schedule
    from graphpar.passes.pipeline.token_slicing import TokenSlicing

    tokens = result.context.result(TokenSlicing)
    per_stage = [s.est_seconds for s in plan.stages]
    schedule = token_schedule("gpipe", len(per_stage), len(tokens.batch_slices),
                              len(tokens.slices))
    shares = list(tokens.slice_shares) * len(tokens.batch_slices)
    return simulate(schedule, [t / 3 for t in per_stage], [2 * t / 3 for t in per_stage],
                    [0.0] * (len(per_stage) - 1), microbatch_scale=shares)


def run_pipeline_on_cpu(spec, pipe, args, estimated: dict) -> dict:
    """One pipelined step on CPU processes, one per device (a stage on several devices runs
    its phases' SPMD programs over process groups of its sub-mesh, and tensors cross between
    sub-meshes as tiles), against eager PyTorch and torch.optim; then the step
    timed (`TIMED_STEPS` after `WARMUP_STEPS`), whole and per stage, beside `estimated` (the
    report's pipeline estimates)."""
    from graphpar.cli.common import TIMED_STEPS, WARMUP_STEPS, step_time_report
    from graphpar.cost.timeline import timeline_of

    spec.real_module()  # weights are made only now, to run
    pipe = pipe.sharded_as_planned()  # on the cluster and within the limits it was planned
    check = pipe.check(processes=True, steps=args.run_cpu_steps, timed_steps=TIMED_STEPS,
                       warmup=WARMUP_STEPS)
    run = pipe.last_run
    timed = step_time_report(run.step_times.as_dict(),
                             estimated["schedule_step_seconds_estimated"])
    stages = []
    for s, seconds in enumerate(run.stage_compute_seconds):
        per_microbatch = sorted(seconds)[len(seconds) // 2] / pipe.microbatches
        est = estimated["stages"][s]["seconds_per_microbatch_estimated"]
        stages.append({"seconds_per_microbatch_measured": per_microbatch,
                       "seconds_per_microbatch_estimated": est,
                       "ratio": per_microbatch / est if est > 0 else None})
    report = {"ranks": args.run_cpu, "processes": sum(len(d) for d in pipe.devices),
              **check.report(), "error_lines": check.lines(),
              # payloads handed to gloo; the same by the plan's definition (tiles)
              "bytes_between_stages_counted": sum(run.bytes_counted),
              "bytes_between_stages_logical": sum(run.bytes_sent),
              "bytes_between_stages_predicted": pipe.predicted_bytes,
              "first_step_seconds_measured": timeline_of(run.spans).step_seconds,
              "bubble_fraction_measured": timeline_of(run.spans).bubble_fraction,
              **timed, "stages": stages}
    if args.trace:
        pipe.trace(args.trace)
        report["trace"] = args.trace
    return report


def print_pipeline_report(s: dict, ir_path: Path, report_path: Path) -> None:
    from graphpar.cli.common import bytes_sent_text, step_time_line
    from graphpar.ir.printer import format_count
    from graphpar.passes.pipeline.plan import OUTCOMES

    p = s["pipeline"]
    print(f"graphpar compile: {s['model']} (train, pipelined) from {s['source']}")
    print(f"  graph      {s['nodes']} nodes per microbatch step, {len(s['ops'])} distinct ops")
    print(f"  params     {s['parameters']:,} in {s['parameter_tensors']} tensors "
          f"({s['parameter_bytes'] / 2**20:.1f} MiB)")
    print(f"  compute    {format_count(s['flops_estimated'], 'FLOP')} per microbatch "
          "(estimated)")
    print(f"  pipeline   {len(p['stages'])} stages, {p['microbatches']} microbatches, "
          f"schedule {p['schedule']}: step {p['step_seconds_estimated'] * 1e3:.3f} ms "
          f"(Eq. 2), {p['schedule_step_seconds_estimated'] * 1e3:.3f} ms simulated, bubble "
          f"{p['bubble_fraction_estimated']:.1%} (estimated)")
    for i, st in enumerate(p["stages"]):
        modules = f"{len(st['modules'])} modules"
        print(f"  stage {i:<4} layers {st['layers'][0]}..{st['layers'][-1]} ({modules}) on "
              f"sub-mesh {st['submesh']} (devices {_span(st['devices'])}), logical mesh "
              f"{st['logical_mesh']}: {st['seconds_per_microbatch_estimated'] * 1e3:.3f} ms/"
              f"microbatch, {st['memory_bytes_per_device_estimated'] / 2**20:.1f} MiB/device "
              "(estimated)")
    solves = p["layer_solves"]
    counted = ", ".join(f"{solves[k]} {OUTCOMES[k]}" for k in OUTCOMES if solves[k])
    print(f"  search     {p['search_seconds_measured']:.2f} s (measured), {solves['counted']} "
          f"ILP solves (counted): {counted or 'none'}")
    if solves["warning"]:
        print(f"  warning    {solves['warning']} (examples: {report_path}, "
              "pipeline.layer_solves)")
    if "token_slicing" in p:
        t = p["token_slicing"]
        print(f"  tokens     {len(t['token_slices'])} slices {t['token_slices']} per sequence, "
              f"microbatches of {t['batch_slices']} sequences: step "
              f"{t['step_seconds_estimated'] * 1e3:.3f} ms with, "
              f"{t['step_seconds_unsliced_estimated'] * 1e3:.3f} ms without token slicing "
              f"(estimated); DP {t['dp_seconds_measured'] * 1e3:.1f} ms (measured)")
        print(f"             GPipe over (microbatch, slice) units: step "
              f"{t['schedule_step_seconds_estimated'] * 1e3:.3f} ms simulated (estimated), "
              f"trace {ir_path.parent / t['trace']}")
    if "run_cpu" in s:
        r = s["run_cpu"]
        print(f"  run-cpu    {r['ranks']} devices in {r['processes']} processes: max |error| vs "
              f"eager {r['max_abs_error']:.2e}; bytes between stages "
              + bytes_sent_text(r["bytes_between_stages_counted"],
                                r["bytes_between_stages_logical"],
                                r["bytes_between_stages_predicted"]) + "; first step "
              f"{r['first_step_seconds_measured'] * 1e3:.1f} ms, bubble "
              f"{r['bubble_fraction_measured']:.1%} (measured)")
        for line in r["error_lines"]:
            print(f"             {line}")
        print(f"             {step_time_line(r)} (simulated schedule)")
        for i, st in enumerate(r["stages"]):
            ratio = "n/a" if st["ratio"] is None else f"{st['ratio']:.3g}"
            print(f"             stage {i}: forward + backward "
                  f"{st['seconds_per_microbatch_measured'] * 1e3:.3f} ms/microbatch measured "
                  f"(median of {r['steps']} steps), "
                  f"{st['seconds_per_microbatch_estimated'] * 1e3:.3f} ms estimated, "
                  f"ratio {ratio}")
        print(f"  {r['verdict']}")
        if "trace" in r:
            print(f"  trace      {r['trace']}")
    if "run_cpu_tokens" in s:
        r = s["run_cpu_tokens"]
        sharded = r.get("sharded_stages")
        note = ("; " + ", ".join(f"stage {s} sharded on {m} in lockstep" for s, m in
                                 sharded.items()) if sharded else "")
        print(f"  run-cpu    token slices {r['token_slices']} ({r['schedule']}) on "
              f"{r['processes']} processes, one per stage{note}: max "
              f"|error| vs eager {r['max_abs_error']:.2e}; bytes between stages "
              + bytes_sent_text(r.get("bytes_counted"), r["bytes_sent"], r["predicted_bytes"])
              + "; step "
              f"{r['step_seconds_measured'] * 1e3:.1f} ms (measured)")
        for line in r["lines"]:
            print(f"             {line}")
        print(f"  {r['verdict']}")
        if "trace" in r:
            print(f"  trace      {r['trace']}")
    for name, c in s.get("cuda", {}).items():
        print(f"  cuda       {name}: {c['calls_per_device'][0]} calls, "
              f"{c['generated_kernels']} generated kernels, arena "
              f"{max(c['arena_bytes_planned'])} B planned (lower bound "
              f"{max(c['arena_lower_bound_bytes'])} B) per device; "
              f"{ir_path.parent / 'cuda' / name}/")
    print(f"  wrote      {ir_path}, {report_path}")


def _span(devices: list[int]) -> str:
    if not devices:
        return "-"
    return str(devices[0]) if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"
