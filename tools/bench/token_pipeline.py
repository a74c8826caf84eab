"""Measure token-pipelined training steps (TeraPipe) of the bundled GPT for several slicings.

For each slicing the slice steps are captured (measured CPU and wall seconds), then per
schedule the step runs once to warm up and `--repeat` times measured: wall seconds per step
(median), CPU seconds per step in this process (`time.process_time`; in-process runs only),
the bytes between stages measured against the programs' prediction, and whether the step
equals eager PyTorch + torch.optim. Beside them, estimated: Eq. 2.5 of the token-slicing DP
(`pipeline_seconds` over `transformer_latency` at the cpu cluster preset's peak, per
microbatch), which prices FLOPs only.

    python tools/bench/token_pipeline.py --quick       # sequence 8, a few seconds per slicing
    python tools/bench/token_pipeline.py --processes   # one gloo process per stage

Timings are measured on a shared machine; run it on an idle one for numbers to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from graphpar.capture import Adam
from graphpar.compiler.pipelined import compile_pipeline
from graphpar.compiler.token_pipelined import token_pipeline
from graphpar.cost.cluster import get_cluster
from graphpar.models import get_model
from graphpar.passes.pipeline.token_slicing import pipeline_seconds, transformer_latency


def measure(tokens, schedule: str, repeat: int, processes: bool) -> dict:
    tokens = tokens.with_schedule(schedule)
    spec = tokens.pipe.spec
    tokens.run(*spec.inputs, *spec.targets, processes=processes)  # warm-up
    walls, cpus, steps = [], [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens.run(*spec.inputs, *spec.targets, processes=processes)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        spans = tokens.last_run.spans
        steps.append(max(s.end_s for s in spans) - min(s.start_s for s in spans))
    check = tokens.check(processes=processes)
    return {"schedule": schedule,
            "step_wall_seconds_measured": statistics.median(walls),
            "step_cpu_seconds_measured_this_process": statistics.median(cpus),
            "step_seconds_measured_from_spans": statistics.median(steps),
            "bytes_between_stages_measured": sum(tokens.last_run.bytes_sent),
            "bytes_between_stages_predicted": tokens.predicted_bytes,
            "equal_to_eager": check.within_tolerance, "max_abs_error": check.max_abs_error}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="sequence 8, batch 4, slicings 8; 4,4; 5,2,1; one repeat")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--slicings", help="';'-separated slicings, each a comma list of "
                                           "lengths (default 32;16,16;11,11,10;8,8,8,8)")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", action="store_true", help="one gloo process per stage")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len, args.batch, args.repeat = 8, 4, 1
    args.slicings = args.slicings or ("8;4,4;5,2,1" if args.quick
                                      else "32;16,16;11,11,10;8,8,8,8")
    ex = get_model("gpt", "tiny", train=True, batch_size=args.batch, seq_len=args.seq_len)
    config = ex.config
    pipe = compile_pipeline(ex.module, ex.inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                            optimizer=Adam(), stages=args.stages,
                            microbatches=args.microbatches, keep_grads=True)
    peak = get_cluster("cpu").peak_flops("fp32")
    latency = transformer_latency(args.seq_len, config.d_model, config.n_heads,
                                  config.mlp_ratio * config.d_model,
                                  max(1, config.n_layers // args.stages), peak)
    per_microbatch = args.batch // args.microbatches  # the latency model is per sequence
    rows = []
    for text in args.slicings.split(";"):
        slices = [int(x) for x in text.split(",")]
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = token_pipeline(pipe, slices, "gpipe")
        captured = {"capture_wall_seconds_measured": time.perf_counter() - wall,
                    "capture_cpu_seconds_measured": time.process_time() - cpu}
        estimate = per_microbatch * pipeline_seconds(latency, slices, args.stages)
        for schedule in args.schedules.split(","):
            row = {"token_slices": slices, **captured,
                   "eq_2_5_seconds_per_microbatch_estimated": estimate,
                   **measure(tokens, schedule, args.repeat, args.processes)}
            rows.append(row)
            wall_ms = row["step_wall_seconds_measured"] * 1e3
            cpu_ms = row["step_cpu_seconds_measured_this_process"] * 1e3
            print(f"{str(slices):<16} {schedule:<6} step {wall_ms:8.1f} ms wall, {cpu_ms:8.1f} "
                  "ms CPU "
                  f"(measured); Eq. 2.5 {estimate*1e6:8.2f} us (estimated); bytes "
                  f"{row['bytes_between_stages_measured']} measured = "
                  f"{row['bytes_between_stages_predicted']} predicted; capture "
                  f"{captured['capture_cpu_seconds_measured']:.1f} s CPU; eager "
                  f"{'equal' if row['equal_to_eager'] else 'DIFFERENT'}")
    result = {"model": "gpt:tiny", "seq_len": args.seq_len, "batch": args.batch,
              "microbatches": args.microbatches, "stages": args.stages,
              "processes": args.processes, "peak_flops_cpu_preset": peak,
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "load_average_at_end": os.getloadavg()[0], "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
