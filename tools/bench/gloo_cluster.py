"""Measure this machine as a cluster of gloo CPU processes, and write it as a cluster file.

The `cpu` cluster preset's link numbers are placeholders. This benchmark starts two processes
the way torchrun does (gloo over loopback), times all-gather and all-reduce over message sizes
from 256 B to 16 MiB, and fits the cost model's alpha-beta formulas
(graphpar/cost/communication.py; two ranks):

    all_gather  t = a + M / (2 B)        M: the gathered output's bytes
    all_reduce  t = 2 a + M / B          M: the buffer's bytes

by least squares on both at once (a: latency per ring step in s, B: bandwidth in bytes/s). It
also times, on one thread, a fp32 matmul (1024^3: the peak FLOP/s), an elementwise add of
2^24 floats (memory bandwidth) and a one-element add (per-op overhead): the compute table the
roofline prices ops by. The result is the `cpu` preset with those numbers replaced, written as
a cluster file (the timings go to ``<out>.timings.json`` beside it):

    python tools/bench/gloo_cluster.py                  # table; writes gloo_cluster.json here
    graphpar compile --example gpt:tiny --mesh 2 --cluster tools/bench/gloo_cluster.json

Timings are medians of repeated calls after a warm-up (measured, wall clock, rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SIZES = [2**k for k in range(8, 25, 2)]  # bytes of the message: 256 B .. 16 MiB
REPEATS = 30


def _median_seconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def worker(out: Path) -> None:
    """One rank: time the collectives; rank 0 writes what it measured to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for size in SIZES:
        elements = size // 4
        reps = REPEATS if size <= 2**20 else 5
        buffer = torch.ones(elements)
        part = torch.ones(elements // 2)
        parts = [torch.empty(elements // 2) for _ in range(2)]
        gather = _median_seconds(lambda p=parts, x=part: dist.all_gather(p, x), reps)
        reduce = _median_seconds(lambda x=buffer: dist.all_reduce(x), reps)
        rows.append({"bytes": size, "all_gather_s": gather, "all_reduce_s": reduce})
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def fit(rows: list[dict]) -> tuple[float, float]:
    """(latency a in s, bandwidth B in bytes/s) of the two-rank alpha-beta formulas."""
    design, times = [], []
    for r in rows:
        design.append([1.0, r["bytes"] / 2])
        times.append(r["all_gather_s"])
        design.append([2.0, float(r["bytes"])])
        times.append(r["all_reduce_s"])
    (a, inverse_b), *_ = np.linalg.lstsq(np.array(design), np.array(times), rcond=None)
    return max(float(a), 0.0), 1.0 / max(float(inverse_b), 1e-15)


def matmul_flops() -> float:
    return compute_rates(quick=True)["flops"]


def compute_rates(quick: bool = False) -> dict[str, float]:
    """One thread's achieved fp32 rates (measured medians): FLOP/s of a 1024^3 matmul, bytes/s
    of an elementwise add of 2^24 floats (two read, one written), and seconds per call of a
    one-element add (eager dispatch: the per-op overhead)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        flops = 2 * 1024**3 / _median_seconds(lambda: a @ b, 5 if quick else 10)
        n = 2**22 if quick else 2**24
        x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
        bandwidth = 3 * 4 * n / _median_seconds(lambda: torch.add(x, y, out=out),
                                                 5 if quick else 10)
        one = torch.ones(1)
        overhead = _median_seconds(lambda: one + one, 200)
    finally:
        torch.set_num_threads(threads)
    return {"flops": flops, "bandwidth": bandwidth, "overhead": overhead}


def compute_table(rates: dict[str, float]) -> dict:
    """The cluster file's `compute` table from `compute_rates`: every op class at the matmul's
    FLOP/s, the add's bandwidth and the one-element add's overhead (fp16/bf16 at half the
    FLOP/s, as the peak rates are)."""
    from graphpar.ir.cluster import COMPUTE_CLASSES

    def row(flops: float) -> dict:
        return {c: {"flops": flops, "bandwidth": rates["bandwidth"],
                    "overhead": rates["overhead"]} for c in COMPUTE_CLASSES}

    return {"fp32": row(rates["flops"]), "fp16": row(rates["flops"] / 2),
            "bf16": row(rates["flops"] / 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("gloo_cluster.json")))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    from graphpar.cost.cluster import get_cluster
    from graphpar.runtime.launch import free_port, torchrun_env

    with tempfile.TemporaryDirectory(prefix="graphpar-gloo-") as tmp:
        result = Path(tmp) / "rows.json"
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(result)],
                                  env=torchrun_env(rank, 2, port)) for rank in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            print(f"gloo_cluster: a rank failed (exit codes {codes})", file=sys.stderr)
            return 1
        rows = json.loads(result.read_text())
    latency, bandwidth = fit(rows)
    rates = compute_rates()
    flops = rates["flops"]
    print(f"{'bytes':>10} {'all_gather us':>14} {'model us':>9} {'all_reduce us':>14} "
          f"{'model us':>9}")
    for r in rows:
        r["all_gather_model_s"] = latency + r["bytes"] / (2 * bandwidth)
        r["all_reduce_model_s"] = 2 * latency + r["bytes"] / bandwidth
        print(f"{r['bytes']:>10} {1e6 * r['all_gather_s']:>14.1f} "
              f"{1e6 * r['all_gather_model_s']:>9.1f} {1e6 * r['all_reduce_s']:>14.1f} "
              f"{1e6 * r['all_reduce_model_s']:>9.1f}")
    print(f"fit: latency {1e6 * latency:.1f} us per ring step, bandwidth "
          f"{bandwidth / 1e9:.2f} GB/s; single-thread fp32 matmul {flops / 1e9:.1f} GFLOP/s, "
          f"add {rates['bandwidth'] / 1e9:.2f} GB/s, {1e6 * rates['overhead']:.1f} us per op "
          "(all measured)")
    base = get_cluster("cpu")
    measured = dataclasses.replace(
        base, name="cpu-measured", intra_node_latency=latency, intra_node_bandwidth=bandwidth,
        inter_node_latency=max(base.inter_node_latency, latency),
        inter_node_bandwidth=min(base.inter_node_bandwidth, bandwidth),
        peak_flops_fp32=flops, peak_flops_fp16=flops / 2, peak_flops_bf16=flops / 2,
        compute=compute_table(rates),
        source=(f"Measured by tools/bench/gloo_cluster.py on {platform.node() or 'this host'} "
                f"({platform.platform()}, {os.cpu_count()} CPUs): two gloo processes on "
                "loopback, alpha-beta fit of all-gather and all-reduce; compute: every op class "
                "at a single-thread 1024^3 matmul's FLOP/s, a 2^24-float add's bandwidth and a "
                "one-element add's overhead. "
                "Inter-node: the cpu preset's placeholders, never better than intra-node."))
    out = Path(args.out)
    out.write_text(json.dumps(measured.to_dict(), indent=2) + "\n")
    timings = out.with_name(out.stem + ".timings.json")
    timings.write_text(json.dumps({
        "benchmark": "gloo_cluster", "units": {"*_s": "s (measured medians; *_model_s: fit)",
                                               "bytes": "B"},
        "fit": {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth,
                "matmul_flops_fp32": flops, "add_bandwidth_bytes_per_s": rates["bandwidth"],
                "op_overhead_s": rates["overhead"]},
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {out} (cluster file) and {timings}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
