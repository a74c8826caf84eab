"""Token slicing (TeraPipe) on the paper's settings: the DP's slicing and estimated latency
beside the paper's Tables 2.1, 2.2 and 2.4.

    python tools/bench/token_slicing.py            # every row, writes token_slicing.json here
    python tools/bench/token_slicing.py --quick    # three rows (CI size)

Each row is a GPT-3 model on AWS p3.16xlarge nodes (the `p3.16xlarge` cluster preset, 8 x V100)
split as the paper does: #Data replicas x #Pipe stages x #Op-way operator partitioning inside a
node. A stage's latency table comes from graphpar's cost model (`transformer_latency`: the
roofline of the preset's fp16 compute table — matmuls at the V100's achieved tensor-core rate,
no faster than reading the weights from HBM, a per-call overhead — Megatron all-reduces over
NVLink, activations sent between nodes at the node's network share per GPU). Per replica batch
B / #Data, three estimates, each with the best split of the batch into equal slices, all
(batch slice, token slice) pairs back to back through one pipeline (Eq. 2.5 over them):

- without token slicing: every batch slice whole (GPipe's microbatches);
- with: the DP (Eq. 2.6-2.8) per batch-slice size, slices multiples of `--granularity` tokens;
- best uniform: the best of 1, 2, 4, ... equal slices per batch-slice size (Table 2.3).

All latencies are estimates (seconds per training step, forward and backward); DP seconds are
measured (wall and CPU) for the whole batch-and-token search of the row. A second table
times the DP alone on one GPT3-13B-like stage up to L = 8192 at granularity 1 (`DP_CASES`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from graphpar.cost.cluster import get_cluster
from graphpar.cost.compute import Roofline
from graphpar.passes.pipeline.token_slicing import (
    TokenLatency,
    pipeline_seconds,
    solve_batch_and_tokens,
    solve_token_slices,
    transformer_latency,
)

CLUSTER = "p3.16xlarge"
HEAD_DIM = 128  # GPT-3's heads are 128 wide


@dataclass(frozen=True)
class Setting:
    """One row of the paper: model, sequence length, replica batch and the 3-D split, with the
    paper's latency (seconds) without and with TeraPipe and its slicing."""

    name: str
    model: str
    layers: int
    hidden: int
    seq_len: int
    batch: int
    data: int
    pipe: int
    op: int
    paper_without: float
    paper_with: float
    paper_slicing: str
    paper_best_uniform: float | None = None


SETTINGS = [  # Table 2.1 / 2.2 (L = 2048), Table 2.3 (uniform), Table 2.4 (longer L)
    Setting("(1)", "GPT3-1B", 24, 2048, 2048, 128, 8, 24, 1, 1.517, 1.254, "[776,640,632]x16"),
    Setting("(2)", "GPT3-1B", 24, 2048, 2048, 72, 2, 12, 8, 1.018, 1.018, "batch only"),
    Setting("(3)", "GPT3-1B", 24, 2048, 2048, 72, 1, 24, 8, 0.913, 0.913, "batch only"),
    Setting("(4)", "GPT3-13B", 40, 5120, 2048, 32, 2, 20, 8, 2.637, 1.891, "[1024,1024]"),
    Setting("(5)", "GPT3-13B", 40, 5120, 2048, 32, 1, 40, 8, 1.863, 1.328, "[704,688,656]"),
    Setting("(6)", "GPT3-44B", 96, 6144, 2048, 8, 4, 96, 1, 13.319, 7.103,
            "[64]x26+[56]x6+[48]"),
    Setting("(7)", "GPT3-44B", 96, 6144, 2048, 8, 2, 24, 8, 4.311, 2.771,
            "[368,384,384,368,256,288]"),
    Setting("(8)", "GPT3-44B", 96, 6144, 2048, 8, 1, 48, 8, 2.662, 1.111,
            "[384,384,368,320,296,296]", paper_best_uniform=1.241),
    Setting("(9)", "GPT3-175B", 96, 12288, 2048, 2, 1, 96, 4, 9.990, 1.481,
            "[120]x4+[112]x6+[104]x8+[64]", paper_best_uniform=1.547),
    Setting("(10)", "GPT3-175B", 96, 12288, 2048, 2, 1, 48, 8, 5.822, 1.160, "[128]x16"),
    Setting("(5) L=4096", "GPT3-13B", 40, 5120, 4096, 8, 1, 40, 8, 2.526, 0.913,
            "[552,536,528,512,504,496,488,480]"),
    Setting("(5) L=6144", "GPT3-13B", 40, 5120, 6144, 4, 1, 40, 8, 3.754, 0.756,
            "[584,568]+[512]x6+[496,488,472,464]"),
    Setting("(5) L=8192", "GPT3-13B", 40, 5120, 8192, 2, 1, 40, 8, 4.978, 0.636,
            "[512]x6+[480]x2+[416]x10"),
]
QUICK = ("(5)", "(9)", "(5) L=8192")


def stage_latency(setting: Setting, batch: int, overhead: float = 0.0) -> TokenLatency:
    """The latency model of one of the row's stages on `batch` sequences at once; `overhead`
    seconds per layer per slice stand for kernel launches and framework time."""
    cluster = get_cluster(CLUSTER)
    return transformer_latency(
        setting.seq_len, setting.hidden, setting.hidden // HEAD_DIM, 4 * setting.hidden,
        setting.layers // setting.pipe, Roofline.of(cluster, "fp16"), itemsize=2,
        send_bandwidth=cluster.inter_node_bandwidth / cluster.devices_per_node,
        send_latency=cluster.inter_node_latency, batch=batch, tensor_parallel=setting.op,
        allreduce_bandwidth=cluster.intra_node_bandwidth,
        allreduce_latency=cluster.intra_node_latency, overhead=overhead)


def uniform_slices(seq_len: int, granularity: int) -> list[list[int]]:
    """1, 2, 4, ... equal slices, each a multiple of the granularity."""
    out, count = [], 1
    while seq_len % count == 0 and (seq_len // count) % granularity == 0:
        out.append([seq_len // count] * count)
        count *= 2
    return out


def compact(slices: tuple[int, ...]) -> str:
    """[64, 64, 64, 56, 48] -> "[64]x3+[56,48]": runs of three or more folded."""
    parts, plain, at = [], [], 0
    while at < len(slices):
        run = 1
        while at + run < len(slices) and slices[at + run] == slices[at]:
            run += 1
        if run >= 3:
            if plain:
                parts.append("[" + ",".join(map(str, plain)) + "]")
                plain = []
            parts.append(f"[{slices[at]}]x{run}")
        else:
            plain += [slices[at]] * run
        at += run
    if plain:
        parts.append("[" + ",".join(map(str, plain)) + "]")
    return "+".join(parts)


def batch_and_tokens(batch_slices: tuple[int, ...], token_slices) -> str:
    """Batch slices with their token slicing, equal ones counted: "2 x b1 [704,688,656]"."""
    groups: dict[tuple, int] = {}
    for b, slices in zip(batch_slices, token_slices):
        groups[(b, tuple(slices))] = groups.get((b, tuple(slices)), 0) + 1
    return " ; ".join(f"{n}x b{b} {compact(s)}" for (b, s), n in groups.items())


def row(setting: Setting, granularity: int, epsilon: float, overhead: float = 0.0) -> dict:
    batch = setting.batch // setting.data
    stages = setting.pipe
    sizes = [b for b in range(1, batch + 1) if batch % b == 0]
    latencies = {b: stage_latency(setting, b, overhead) for b in sizes}
    without, without_size = min((pipeline_seconds(latencies[b], [setting.seq_len], stages,
                                                  batch // b), b) for b in sizes)
    best_uniform = min(pipeline_seconds(latencies[b], s, stages, batch // b)
                       for b in sizes for s in uniform_slices(setting.seq_len, granularity))
    cpu = time.process_time()
    tera = solve_batch_and_tokens(latencies.__getitem__, batch, stages, granularity, epsilon)
    dp_cpu = time.process_time() - cpu
    return {
        "setting": setting.name, "model": setting.model, "seq_len": setting.seq_len,
        "replica_batch": batch, "data": setting.data, "pipe_stages": stages, "op": setting.op,
        "devices": setting.data * setting.pipe * setting.op,
        "est_without_s": without, "est_with_s": tera.est_seconds,
        "est_best_uniform_s": best_uniform, "est_speedup": without / tera.est_seconds,
        "dp_over_best_uniform": best_uniform / tera.est_seconds,
        "batch_slices_without": [without_size] * (batch // without_size),
        "batch_slices": list(tera.batch_slices),
        "token_slices": [list(s) for s in tera.token_slices],
        "slicing": batch_and_tokens(tera.batch_slices, tera.token_slices),
        "dp_wall_s": tera.dp_seconds, "dp_cpu_s": dp_cpu,
        "paper_without_s": setting.paper_without, "paper_with_s": setting.paper_with,
        "paper_speedup": setting.paper_without / setting.paper_with,
        "paper_best_uniform_s": setting.paper_best_uniform,
        "paper_slicing": setting.paper_slicing,
    }


# The DP alone on a GPT3-13B-like stage (h 5120, f 20480, one layer, K = 40, 125 TFLOP/s,
# fp16 sends at 300 GB/s + 10 us): (L, granularity, epsilon seconds, overhead seconds).
DP_CASES = [(2048, 8, 0.0, 2e-4), (2048, 1, 0.0, 2e-4), (8192, 8, 0.0, 2e-4),
            (8192, 1, 0.0, 2e-4), (8192, 1, 1e-4, 2e-4), (2048, 1, 0.0, 0.0),
            (8192, 1, 0.0, 0.0)]
DP_QUICK = [(8192, 1, 0.0, 2e-4)]


def dp_rows(cases) -> list[dict]:
    """The DP's time (measured: CPU and wall) and answer for each case of DP_CASES."""
    rows = []
    for seq_len, granularity, epsilon, overhead in cases:
        latency = transformer_latency(seq_len, 5120, 40, 20480, 1, 125e12, itemsize=2,
                                      send_bandwidth=300e9, send_latency=10e-6,
                                      overhead=overhead)
        cpu = time.process_time()
        got = solve_token_slices(latency, 40, granularity, epsilon)
        rows.append({"seq_len": seq_len, "granularity": granularity, "epsilon_s": epsilon,
                     "overhead_s": overhead, "slices": list(got.slices),
                     "est_seconds": got.est_seconds, "bounds_evaluated": got.evaluated,
                     "dp_cpu_s": time.process_time() - cpu, "dp_wall_s": got.dp_seconds})
    return rows


def print_dp_table(rows: list[dict]) -> None:
    print(f"{'L':>5}{'gran':>5}{'eps s':>8}{'ovh s':>8}{'slices':>7}  {'first..last':<12}"
          f"{'est s':>9}{'bounds':>7}{'DP cpu s':>9}{'DP wall s':>10}")
    for r in rows:
        ends = f"{r['slices'][0]}..{r['slices'][-1]}"
        print(f"{r['seq_len']:>5}{r['granularity']:>5}{r['epsilon_s']:>8.0e}"
              f"{r['overhead_s']:>8.0e}{len(r['slices']):>7}  {ends:<12}{r['est_seconds']:>9.4f}"
              f"{r['bounds_evaluated']:>7}{r['dp_cpu_s']:>9.3f}{r['dp_wall_s']:>10.3f}")


def print_table(rows: list[dict]) -> None:
    print(f"{'setting':<12}{'model':<10}{'L':>5}{'B':>4}{'DxPxO':>10}"
          f"{'est w/o s':>10}{'est w/ s':>9}{'uniform s':>10}{'speedup':>8}{'vs unif':>8}"
          f"{'paper w/o':>10}{'paper w/':>9}{'paper x':>8}{'DP cpu s':>9}  slicing (ours | paper)")
    for r in rows:
        split = f"{r['data']}x{r['pipe_stages']}x{r['op']}"
        print(f"{r['setting']:<12}{r['model']:<10}{r['seq_len']:>5}{r['replica_batch']:>4}"
              f"{split:>10}{r['est_without_s']:>10.3f}{r['est_with_s']:>9.3f}"
              f"{r['est_best_uniform_s']:>10.3f}{r['est_speedup']:>7.2f}x"
              f"{r['dp_over_best_uniform']:>7.2f}x{r['paper_without_s']:>10.3f}"
              f"{r['paper_with_s']:>9.3f}{r['paper_speedup']:>7.2f}x{r['dp_cpu_s']:>9.3f}"
              f"  {r['slicing']} | {r['paper_slicing']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only rows {', '.join(QUICK)}")
    parser.add_argument("--granularity", type=int, default=8,
                        help="slice lengths are multiples of this many tokens (paper: 8)")
    parser.add_argument("--epsilon", type=float, default=0.0,
                        help="the DP's gap in seconds (0: exact; the paper: 1e-4)")
    parser.add_argument("--overhead", type=float, default=0.0,
                        help="seconds per layer per slice besides FLOPs and bytes (kernel "
                             "launches; default 0: the cost model alone)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    settings = [s for s in SETTINGS if not args.quick or s.name in QUICK]
    solve_batch_and_tokens(lambda b: stage_latency(SETTINGS[0], b), 1, 2, 8)  # numba compile
    rows = [row(s, args.granularity, args.epsilon, args.overhead) for s in settings]
    print_table(rows)
    print()
    dp = dp_rows(DP_QUICK if args.quick else DP_CASES)
    print_dp_table(dp)
    result = {
        "cluster": CLUSTER, "granularity": args.granularity, "epsilon_s": args.epsilon,
        "overhead_s_per_layer_per_slice": args.overhead,
        "units": {"est_*_s": "seconds per step, estimated", "paper_*_s": "seconds, measured "
                  "by the paper", "dp_wall_s": "seconds, measured", "dp_cpu_s": "CPU seconds, "
                  "measured"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": sys.version.split()[0]},
        "rows": rows,
        "dp_timing": dp,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
