"""Measure pipelined training steps on gloo CPU ranks, one process per device, per schedule.

For each schedule one step is checked against eager PyTorch, then the same processes time 5
steps after 2 untimed ones (all ranks start each after a barrier; wall clock). The table gives
the measured step time and bubble fraction (medians of the timed steps), the step and bubble
the cost model estimates on this machine's calibration (`graphpar calibrate --ranks n` for as
many ranks as the pipeline has processes, `gloo_cluster.<n>ranks.json`, else the 2-rank
`gloo_cluster.json`), the schedule simulator's step from the checked step's per-action times
(median F, B, I, W, send per stage: does the schedule model predict the runtime?),
(p-1)/(m+p-1), GPipe's and 1F1B's bubble with uniform stages and free transfers, and how long
the checked step's receives waited (the hand-over between stages, docs/pipeline.md).

With `--submeshes` some stages run on sub-meshes of several devices (their phases sharded by
the auto-shard ILP, one process per device): the second table gives the bytes that crossed
between sub-meshes (measured, as tiles: each byte once) beside what a naive transfer would
send (every receiving device the whole tensor) and the local all-gathers inside the
receiving sub-meshes (measured against `cross_mesh_cost`).

    python tools/bench/pipeline_runtime.py            # table; writes pipeline_runtime.json here
    python tools/bench/pipeline_runtime.py --quick --submeshes 1,1x2 --out cross_mesh.json

Timings are measured on a shared machine; run it on an idle one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from graphpar.calibration.calibrate import cluster_file_for
from graphpar.capture import Adam
from graphpar.cli.common import TIMED_STEPS, WARMUP_STEPS
from graphpar.compiler.pipelined import compile_pipeline
from graphpar.cost.timeline import simulate
from graphpar.ir.schedule import ActionKind
from graphpar.models import get_model

DEFAULT_CLUSTER = Path(__file__).with_name("gloo_cluster.json")


def cross_mesh_bytes(pipe) -> dict:
    """Per step, bytes between sub-meshes as tiles (predicted), sent naively (every receiving
    device the whole tensor) and gathered inside the receiving sub-meshes (cost model)."""
    from graphpar.cost.communication import cross_mesh_cost
    from graphpar.passes.pipeline.lower_mpmd import transfers
    from graphpar.runtime.pipeline import stage_meshes

    meshes = stage_meshes(pipe.stages, pipe.sharded)
    naive = inside = 0
    for phase, _, dst, plan in transfers(pipe.programs, pipe.devices):
        times = 1 if phase == "U" else pipe.microbatches
        naive += times * plan.tiles * plan.type.nbytes
        if plan.gathered:
            inside += times * cross_mesh_cost(plan.type.nbytes, meshes[dst], 1.0, 0.0
                                              ).bytes_inside
    return {"bytes_across_naive": naive, "bytes_gathered_inside_predicted": int(inside)}


def measure(pipe, schedule: str, timed_steps: int = TIMED_STEPS) -> dict:
    """One schedule: a step checked against eager, then `timed_steps` steps timed after
    `WARMUP_STEPS` untimed ones, in the same processes. The measured step and bubble are the
    timed steps' medians (every rank starts a step together after a barrier); the per-action
    medians of the checked step feed the schedule simulator."""
    pipe = pipe.with_schedule(schedule)
    start, cpu = time.perf_counter(), _cpu_seconds()
    check = pipe.check(processes=True, timed_steps=timed_steps, warmup=WARMUP_STEPS)
    wall = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu
    run = pipe.last_run
    spans = run.spans
    stages = pipe.stages
    timed = run.step_times.as_dict()
    step = timed["step_seconds_measured"]
    # each stage's compute in a step (its first device's), median over the timed steps
    compute = [statistics.median(c) for c in run.stage_compute_seconds]
    measured_bubble = 1 - sum(compute) / (stages * step)

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
    # how long each receive of the checked step waited (RECV_F and RECV_B actions)
    waits = [s.end_s - s.start_s for s in spans
             if s.action.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
    waits_per_stage = [sum(s.end_s - s.start_s for s in spans if s.stage == stage
                           and s.action.kind in (ActionKind.RECV_F, ActionKind.RECV_B))
                       for stage in range(stages)]
    handover = hand_over_seconds(spans)
    comm = [median(ActionKind.SEND_F, s) for s in range(stages - 1)]
    update = [median(ActionKind.UPDATE, s) for s in range(stages)]
    estimate = simulate(pipe.schedule, forward, backward, comm, weight, update)
    m = pipe.microbatches
    cluster = cluster_file_for(sum(len(d) for d in pipe.devices), DEFAULT_CLUSTER)
    calibrated = pipe.estimate(cluster)
    return {
        "schedule": schedule, "stages": stages, "microbatches": m,
        "step_seconds_measured": step, "step_seconds_measured_min": timed["step_seconds_min"],
        "steps_timed": timed["steps"],
        "stage_compute_seconds_measured": compute,
        "stage_compute_seconds_estimated": list(calibrated.compute_seconds),
        "cluster": cluster,
        "step_seconds_simulated_from_measured_actions": estimate.step_seconds,
        "step_seconds_estimated_by_cost_model": calibrated.step_seconds,
        "bubble_fraction_estimated_by_cost_model": calibrated.bubble_fraction,
        "bubble_fraction_measured": measured_bubble,
        "bubble_fraction_simulated": estimate.bubble_fraction,
        "bubble_fraction_uniform_formula": (stages - 1) / (m + stages - 1),
        "receive_wait_seconds_median_measured": statistics.median(waits) if waits else 0.0,
        "receive_wait_seconds_max_measured": max(waits, default=0.0),
        "receive_wait_seconds_per_stage_measured": waits_per_stage,
        "hand_over_seconds_median_measured": statistics.median(handover),
        "hand_over_seconds_max_measured": max(handover),
        "bytes_between_stages_measured": sum(pipe.last_run.bytes_sent),
        "bytes_between_stages_predicted": pipe.predicted_bytes,
        "bytes_gathered_inside_measured": sum(pipe.last_run.gathered_bytes),
        **cross_mesh_bytes(pipe),
        "devices": [len(d) for d in pipe.devices],
        "equal_to_eager": check.within_tolerance,
        "wall_seconds_including_process_start": wall,
        "cpu_seconds_including_process_start": cpu,
    }


def hand_over_seconds(spans) -> list[float]:
    """Per receive of a measured step, how long it took once the data had been sent and the
    receive had started: its end minus the later of its start and the end of the matching
    send (the sending stage's last device to finish it; wall clock, one machine)."""
    sent: dict = {}
    for s in spans:
        if s.action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            key = (s.action.kind, s.stage, s.action.microbatch)
            sent[key] = max(sent.get(key, s.end_s), s.end_s)
    out = []
    for s in spans:
        if s.action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            forward = s.action.kind is ActionKind.RECV_F
            key = (ActionKind.SEND_F if forward else ActionKind.SEND_B,
                   s.stage - 1 if forward else s.stage + 1, s.action.microbatch)
            out.append(max(0.0, s.end_s - max(s.start_s, sent[key])))
    return out


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the rank processes)."""
    import resource

    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--submeshes", default="",
                        help="each stage's sub-mesh, comma-separated (e.g. 1,1x2: stage 1 "
                             "sharded on 2 devices); default one device per stage")
    parser.add_argument("--quick", action="store_true",
                        help="gpt tiny as bundled (2 layers, d_model 64), 1F1B only, 2 "
                             "timed steps")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    submeshes = [m.strip() for m in args.submeshes.split(",") if m.strip()]
    stages = len(submeshes) or args.stages
    size = {} if args.quick else {"n_layers": 4, "d_model": 128}
    ex = get_model("gpt", "tiny", train=True, batch_size=2 * args.microbatches, **size)
    pipe = compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                            optimizer=Adam(), stages=stages, microbatches=args.microbatches,
                            keep_grads=True)
    sharded = {s: m for s, m in enumerate(submeshes) if m not in ("1", "1x1")}
    if sharded:
        pipe = pipe.on_submeshes(sharded)
    schedules = ("1f1b",) if args.quick else ("gpipe", "1f1b", "zb")
    rows = [measure(pipe, name, 2 if args.quick else TIMED_STEPS) for name in schedules]
    model = "bundled size" if args.quick else "4 layers, d_model 128"
    print(f"gpt tiny ({model}), {stages} stages on {'+'.join(map(str, rows[0]['devices']))} "
          f"gloo ranks (one per device), {args.microbatches} microbatches; times measured "
          "(wall clock, shared machine)")
    print(f"priced on {rows[0]['cluster']}")
    print(f"{'schedule':8} {'step ms':>8} {'est ms':>7} {'ratio':>6} {'bubble':>7} {'est':>5} "
          f"{'(p-1)/(m+p-1)':>13} {'sim ms':>7} {'sim bubble':>10} {'eager':>5}")
    for r in rows:
        print(f"{r['schedule']:8} {1e3 * r['step_seconds_measured']:8.1f} "
              f"{1e3 * r['step_seconds_estimated_by_cost_model']:7.1f} "
              f"{r['step_seconds_measured'] / r['step_seconds_estimated_by_cost_model']:6.2f} "
              f"{r['bubble_fraction_measured']:7.2f} "
              f"{r['bubble_fraction_estimated_by_cost_model']:5.2f} "
              f"{r['bubble_fraction_uniform_formula']:13.2f} "
              f"{1e3 * r['step_seconds_simulated_from_measured_actions']:7.1f} "
              f"{r['bubble_fraction_simulated']:10.2f} {str(r['equal_to_eager']):>5}")
    print("\neach stage's compute per step (ms), measured / estimated")
    for r in rows:
        print(f"{r['schedule']:8} " + "  ".join(
            f"{1e3 * m:.1f} / {1e3 * e:.1f}" for m, e in
            zip(r["stage_compute_seconds_measured"], r["stage_compute_seconds_estimated"])))
    print("\nreceives in the checked step (ms, measured): wait median, max, each stage's sum; "
          "hand-over (done after both sent and posted) median, max")
    for r in rows:
        print(f"{r['schedule']:8} {1e3 * r['receive_wait_seconds_median_measured']:6.2f} "
              f"{1e3 * r['receive_wait_seconds_max_measured']:6.2f}   " + "  ".join(
                  f"{1e3 * w:.1f}" for w in r["receive_wait_seconds_per_stage_measured"])
              + f"   {1e3 * r['hand_over_seconds_median_measured']:6.2f} "
              f"{1e3 * r['hand_over_seconds_max_measured']:6.2f}")
    print("\nbytes per step between and inside sub-meshes (B); seconds for the whole check")
    print(f"{'schedule':8} {'across meas.':>12} {'predicted':>10} {'naive':>10} "
          f"{'gathered meas.':>14} {'cost model':>10} {'wall s':>7} {'CPU s':>6}")
    for r in rows:
        print(f"{r['schedule']:8} {r['bytes_between_stages_measured']:12d} "
              f"{r['bytes_between_stages_predicted']:10d} {r['bytes_across_naive']:10d} "
              f"{r['bytes_gathered_inside_measured']:14d} "
              f"{r['bytes_gathered_inside_predicted']:10d} "
              f"{r['wall_seconds_including_process_start']:7.1f} "
              f"{r['cpu_seconds_including_process_start']:6.1f}")
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
