"""Which tensor-parallel decode plan the ILP picks for a GPT on 2 gloo ranks, priced by FLOPs
alone and by the roofline, and what each plan costs under the roofline.

The case: GPT-125M decode at batch 8 on 2 CPU processes (docs/serving.md, section 5a). Priced
by FLOPs over peak on the measured gloo cluster (tools/bench/gloo_cluster.json), the ILP kept
the MLP whole (fewer collectives), and the engine ran slower than under Megatron's layout
(59 vs 68 tokens/s, measured): decode matmuls are bound by reading their weights, which only
splitting them halves. This benchmark takes the cluster file's links and compute table (as
`graphpar calibrate` measured them: tools/bench/gloo_cluster.py), optionally one FLOP/s or
bandwidth for every op class instead (what-ifs), and plans the decode program three ways:

- `auto, FLOP model`: the ILP with compute at the cluster's peak FLOP/s (what it did before);
- `auto, roofline`: the ILP with the roofline (what auto-shard and shard-serving do now);
- `megatron, roofline`: Megatron-LM's hand plan under the serving constraints.

It prints, per plan, the collectives of one decode step (the lowered device program), and the
plan's estimated compute, communication and step time under the roofline and under the FLOP
model (all estimated, ms). Nothing here is measured: the rates are the cluster file's.

    python tools/bench/serving_roofline.py            # GPT-125M; writes serving_roofline.json
    python tools/bench/serving_roofline.py --quick    # the tiny GPT, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def decode_graphs(example: str):
    """The paged decode program of a bundled GPT: base graph and its other sizes (global)."""
    import torch

    from graphpar.models import get_model
    from graphpar.serving.compile import compile_decoder

    name, _, preset = example.partition(":")
    torch.manual_seed(0)
    module = get_model(name, preset or "tiny").module.eval()
    programs = compile_decoder(module, tensor_parallel=1)
    base, _, variants = programs.graphs["decode"]
    return base, [g for _, g in variants.values()]


def collectives(base, mesh, plan) -> int:
    """Communicating nodes of the lowered decode program (one decode step)."""
    from graphpar.ir.graph import Program
    from graphpar.ir.spmd_ops import comm_kind
    from graphpar.passes.autoshard.apply import shard_graph
    from graphpar.passes.autoshard.serving import _moved
    from graphpar.passes.lower_spmd import LowerSPMD
    from graphpar.passes.manager import PassContext, PassManager

    copy = base.copy()
    shard_graph(copy, mesh, _moved(plan, copy, base))
    (lowered,) = PassManager([LowerSPMD()]).run(Program.of([copy]), PassContext())
    return sum(1 for n in lowered.nodes
               if (k := comm_kind(n.op)) is not None and k.communicates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default="gpt:125M")
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, a quicker table")
    parser.add_argument("--cluster", default=str(HERE / "gloo_cluster.json"),
                        help="the cluster file whose links and compute table to use")
    parser.add_argument("--bandwidth", type=float,
                        help="bytes/s for every op class instead of the file's (what-if)")
    parser.add_argument("--flops", type=float,
                        help="FLOP/s for every op class instead of the file's (what-if)")
    parser.add_argument("--out", default=str(HERE / "serving_roofline.json"))
    args = parser.parse_args(argv)
    from graphpar.cost.cluster import get_cluster, mesh_for
    from graphpar.cost.compute import Roofline
    from graphpar.passes.autoshard.ilp import Problem
    from graphpar.passes.autoshard.serving import solve_serving

    example = "gpt:tiny" if args.quick else args.example
    wall, cpu = time.perf_counter(), time.process_time()
    cluster = get_cluster(args.cluster)
    table = cluster.compute_table()
    for classes in table.values():
        for rate in classes.values():
            for key in ("bandwidth", "flops"):
                if getattr(args, key) is not None:
                    rate[key] = getattr(args, key)  # given, not measured
    cluster = dataclasses.replace(cluster, compute=table)
    rates = dict(cluster.compute_rate("fp32", "gemm_skinny")._asdict())
    mesh = mesh_for("2", cluster)
    flop_model = Roofline.flops_only(cluster.peak_flops("fp32"))
    roofline = Roofline.of(cluster, "fp32")
    base, others = decode_graphs(example)
    plans = {
        "auto, FLOP model": solve_serving(base, others, mesh, "auto", roofline=flop_model),
        "auto, roofline": solve_serving(base, others, mesh, "auto", roofline=roofline),
        "megatron, roofline": solve_serving(base, others, mesh, "megatron", roofline=roofline),
    }
    under_roofline, under_flops = Problem(base, mesh, roofline), Problem(base, mesh, flop_model)
    rows = []
    for name, plan in plans.items():
        roof, flops = under_roofline.recost(plan), under_flops.recost(plan)
        rows.append({
            "plan": name, "collectives_per_decode_step": collectives(base, mesh, plan),
            "roofline_compute_ms": 1e3 * roof.compute_seconds,
            "roofline_comm_ms": 1e3 * roof.comm_seconds,
            "roofline_step_ms": 1e3 * roof.step_seconds,
            "flop_model_step_ms": 1e3 * flops.step_seconds,
            "mlp_split": any(not plan.input_layout[v].is_replicated for v in base.inputs
                             if v.name.endswith("mlp.up.weight")),
        })
    seconds = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    from graphpar.serving.compile import DECODE_BASE

    given = [k for k in ("bandwidth", "flops") if getattr(args, k) is not None]
    note = f" (given, not measured: {', '.join(given)})" if given else ""
    print(f"{example} decode (batch {DECODE_BASE['N']}, the base size) on 2 ranks of "
          f"{cluster.name}; compute table of {args.cluster}{note}: gemm_skinny (decode "
          f"matmuls) {rates['flops'] / 1e9:.1f} GFLOP/s, {rates['bandwidth'] / 1e9:.2f} GB/s, "
          f"{1e6 * rates['overhead']:.1f} us per op")
    print(f"{'plan':<20} {'collectives':>11} {'MLP split':>9} {'roofline: compute':>18} "
          f"{'comm':>8} {'step ms':>8} {'FLOP model: step ms':>20}")
    for r in rows:
        print(f"{r['plan']:<20} {r['collectives_per_decode_step']:>11} "
              f"{'yes' if r['mlp_split'] else 'no':>9} {r['roofline_compute_ms']:>18.3f} "
              f"{r['roofline_comm_ms']:>8.3f} {r['roofline_step_ms']:>8.3f} "
              f"{r['flop_model_step_ms']:>20.3f}")
    print(f"(all times estimated, ms; the benchmark took {seconds['wall_s']:.1f} s wall, "
          f"{seconds['cpu_s']:.1f} s CPU)")
    Path(args.out).write_text(json.dumps({
        "benchmark": "serving_roofline", "example": example, "mesh": "2",
        "units": {"*_ms": "ms (estimated)",
                  "compute_rates": "FLOP/s, bytes/s, s (fp32 gemm_skinny of the cluster file)"},
        "cluster": args.cluster, "compute_rates": rates,
        "compute_rates_given_not_measured": given,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "rows": rows, "benchmark_seconds": seconds}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
