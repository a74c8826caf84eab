"""Measure pipelined training steps on gloo CPU ranks, one process per stage, per schedule.

For each schedule the step runs once to warm up and once measured; each rank times its own
actions (wall clock). The table gives the measured step time and bubble fraction, the
simulator's estimate from the measured per-action times (median F, B, I, W, send per stage:
does the schedule model predict the runtime?), the cost model's transfer time for the bytes
between stages, and (p-1)/(m+p-1), GPipe's and 1F1B's bubble with uniform stages and free
transfers. Every step is also checked against eager PyTorch.

    python tools/bench/pipeline_runtime.py            # table; writes pipeline_runtime.json here

Timings are measured on a shared machine; run it on an idle one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from graphpar.capture import Adam
from graphpar.models import get_model
from graphpar.pipelined import compile_pipeline
from graphpar.runtime.schedules import COMPUTE_KINDS, ActionKind, simulate


def measure(pipe, schedule: str) -> dict:
    pipe = pipe.with_schedule(schedule)
    pipe.run(*pipe.spec.inputs, *pipe.spec.targets, processes=True)  # warm-up
    start = time.perf_counter()
    check = pipe.check(processes=True)
    wall = time.perf_counter() - start
    spans = pipe.last_run.spans
    stages = pipe.stages
    step = max(s.end_s for s in spans) - min(s.start_s for s in spans)
    compute = sum(s.end_s - s.start_s for s in spans if s.action.kind in COMPUTE_KINDS)
    measured_bubble = 1 - compute / (stages * step)

    def median(kind: ActionKind, stage: int) -> float:
        times = [s.end_s - s.start_s for s in spans
                 if s.action.kind is kind and s.stage == stage]
        return statistics.median(times) if times else 0.0

    if schedule == "zb":
        forward = [median(ActionKind.F, s) for s in range(stages)]
        weight = [median(ActionKind.W, s) for s in range(stages)]
        backward = [median(ActionKind.I, s) + w for s, w in enumerate(weight)]
    else:
        forward = [median(ActionKind.F, s) for s in range(stages)]
        backward = [median(ActionKind.B, s) for s in range(stages)]
        weight = None
    comm = [median(ActionKind.SEND_F, s) for s in range(stages - 1)]
    update = [median(ActionKind.UPDATE, s) for s in range(stages)]
    estimate = simulate(pipe.schedule, forward, backward, comm, weight, update)
    m = pipe.microbatches
    calibrated = pipe.estimate(str(Path(__file__).with_name("gloo_cluster.json")))
    return {
        "schedule": schedule, "stages": stages, "microbatches": m,
        "step_seconds_measured": step,
        "step_seconds_simulated_from_measured_actions": estimate.step_seconds,
        "step_seconds_estimated_by_cost_model": calibrated.step_seconds,
        "bubble_fraction_estimated_by_cost_model": calibrated.bubble_fraction,
        "bubble_fraction_measured": measured_bubble,
        "bubble_fraction_simulated": estimate.bubble_fraction,
        "bubble_fraction_uniform_formula": (stages - 1) / (m + stages - 1),
        "bytes_between_stages_measured": sum(pipe.last_run.bytes_sent),
        "bytes_between_stages_predicted": pipe.predicted_bytes,
        "equal_to_eager": check.within_tolerance,
        "wall_seconds_including_process_start": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    ex = get_model("gpt", "tiny", train=True, batch_size=2 * args.microbatches, n_layers=4,
                   d_model=128)
    pipe = compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                            optimizer=Adam(), stages=args.stages,
                            microbatches=args.microbatches)
    rows = [measure(pipe, name) for name in ("gpipe", "1f1b", "zb")]
    print(f"gpt tiny (4 layers, d_model 128), {args.stages} stages x 1 gloo rank, "
          f"{args.microbatches} microbatches; times measured (wall clock, shared machine)")
    print(f"{'schedule':8} {'step ms':>8} {'sim ms':>8} {'est ms':>7} {'bubble':>7} {'sim':>6} "
          f"{'est':>5} {'(p-1)/(m+p-1)':>13} {'bytes':>9} {'eager':>5}")
    for r in rows:
        print(f"{r['schedule']:8} {1e3 * r['step_seconds_measured']:8.1f} "
              f"{1e3 * r['step_seconds_simulated_from_measured_actions']:8.1f} "
              f"{1e3 * r['step_seconds_estimated_by_cost_model']:7.1f} "
              f"{r['bubble_fraction_measured']:7.2f} {r['bubble_fraction_simulated']:6.2f} "
              f"{r['bubble_fraction_estimated_by_cost_model']:5.2f} "
              f"{r['bubble_fraction_uniform_formula']:13.2f} "
              f"{r['bytes_between_stages_measured']:9d} {str(r['equal_to_eager']):>5}")
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
