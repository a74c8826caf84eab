"""Auto-sharding benchmark: ILP size and solve time, and the ILP plan against hand plans.

    python tools/bench/autoshard.py                  # the default set; writes autoshard.json here
    python tools/bench/autoshard.py --quick          # CI size: small shapes, two meshes
    python tools/bench/autoshard.py --models gpt:1.3B --meshes 2x8 --out results.json
    python tools/bench/autoshard.py --unsimplified   # also solve without follower merging

For each model (a training step with Adam, captured with uninitialized weights) and mesh on
DGX A100 nodes: the ILP's size after simplification (variables, constraints, shared
variables), its build and solve times (measured), and the estimated step time of the ILP plan
and of each hand plan (data parallel, DDP, ZeRO, ZeRO-3, Megatron-LM, data x Megatron) under the
same cost model and the same per-device memory limit. The last column checks that the ILP plan
is never worse than the best hand plan (`ok`), and the run fails if it is.

Models are built on the meta device and captured without weights, at their full depth (a
stack of identical layers is traced once and repeated, graphpar.capture.repeat). The `gpt3`
row is GPT-3 175B itself: 96 layers, hidden size 12288, on 4x8 (`--no-gpt3` skips it), without
a memory limit: its fp32 weights, gradients and Adam moments alone, 2.8 TB, need 88 GB per
device on 32 devices, so no plan fits the A100's 40 GB; the row measures the ILP at full size.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.hand_plans import HAND_PLANS, hand_plans
from graphpar.passes.autoshard.ilp import (
    DEFAULT_SOLVER,
    MEMORY_TIEBREAK,
    OBJECTIVE_UNIT,
    Problem,
    Reduced,
)

# model:preset[:overrides], overrides as key=value separated by '/'
# MoE: tokens are routed in groups of 1024 (Alpa: 2048) so that a batch of 32 has 32 groups.
DEFAULT_MODELS = ["gpt:125M", "gpt:1.3B", "gpt:2.6B", "gpt:6.7B",
                  "moe:1.3B:expert_group_size=1024", "wide_resnet:250M"]
DEFAULT_MESHES = ["1x8", "2x4", "2x8", "4x8"]
QUICK_MODELS = ["gpt:125M:n_layers=2/vocab_size=8192", "moe:tiny:n_layers=2",
                "wide_resnet:tiny"]
QUICK_MESHES = ["1x8", "2x4"]
TOLERANCE = 1e-9  # relative, on the solver's objective (step time + the memory tie-break)

# Alpa (OSDI'22) Table 5: compile-time breakdown for GPT-39B on 64 GPUs, in seconds.
ALPA_TABLE5 = {"compilation": 1582.66, "profiling": 804.48, "stage_construction_dp": 1.65,
               "other": 4.47, "total": 2393.26}


def parse_model(spec: str) -> tuple[str, str, dict]:
    name, preset, *rest = spec.split(":")
    overrides = {}
    for item in (rest[0].split("/") if rest else []):
        key, value = item.split("=")
        overrides[key] = int(value)
    return name, preset, overrides


def capture(name: str, preset: str, overrides: dict, batch: int) -> tuple:
    from graphpar.models import example_batch, get_model

    start = time.perf_counter()
    ex = get_model(name, preset, device="meta", train=True, **overrides)
    inputs, targets = example_batch(name, ex.config, batch)
    captured = capture_training(ex.module, inputs, ex.loss_fn, targets, Adam(), name=name)
    capture_s = time.perf_counter() - start
    start = time.perf_counter()
    PassManager(parse_pipeline("cleanup")).run(captured.graph, PassContext())
    cleanup_s = time.perf_counter() - start
    return captured.graph, ex.config, capture_s, cleanup_s


def objective(plan) -> float:
    """What the solver minimizes: step seconds plus the memory tie-break (0.1 ns per MiB). The
    ILP may trade that little step time for memory, so this is what it never does worse on."""
    return plan.step_seconds + plan.memory_bytes * MEMORY_TIEBREAK * OBJECTIVE_UNIT


def plan_row(plan) -> dict:
    if isinstance(plan, str):
        return {"status": plan}
    return {"step_ms": round(plan.step_seconds * 1e3, 4), "objective_s": objective(plan),
            "compute_ms": round(plan.compute_seconds * 1e3, 4),
            "comm_ms": round(plan.comm_seconds * 1e3, 4),
            "memory_gib": round(plan.memory_bytes / 2**30, 3),
            "solve_s": plan.stats["solve_seconds"]}


def measure(graph, mesh_shape: str, cluster, solver: str, unsimplified: bool,
            hand: bool = True, memory_limit: bool = True) -> dict:
    """Solve `graph` on the mesh (under the devices' memory, with `memory_limit`) and cost the
    hand plans beside it."""
    mesh = mesh_for(mesh_shape, cluster)
    limit = float(cluster.device_memory) if memory_limit else None
    start = time.perf_counter()
    problem = Problem(graph, mesh, Roofline.of(cluster, "fp32"))
    reduced = Reduced(problem)
    build_s = time.perf_counter() - start
    plan = reduced.solve(limit, time_limit=120, solver=solver)
    total_s = time.perf_counter() - start
    st = plan.stats
    row = {"mesh": mesh_shape, "nodes": st["nodes"], "variables": st["variables"],
           "constraints": st["constraints"], "classes": st["free_classes"],
           "choices": st["free_choices"], "edges": st["edges"], "followers": st["followers"],
           "tied": st["tied_layers"], "status": st["status"], "gap": st["optimality_gap"],
           "build_s": round(build_s, 3), "solve_s": st["solve_seconds"],
           "total_s": round(total_s, 3), "ilp": plan_row(plan), "hand": {}}
    if unsimplified:
        full = Reduced(problem, simplify=False)
        exact = full.solve(limit, time_limit=600, solver=solver)
        row["unsimplified"] = {"variables": exact.stats["variables"],
                               "build_s": round(full.build_seconds, 3),
                               "solve_s": exact.stats["solve_seconds"],
                               "status": exact.stats["status"], **plan_row(exact)}
    if hand:
        for name, hand_plan in hand_plans(reduced, limit, time_limit=120, solver=solver).items():
            row["hand"][name] = plan_row(hand_plan)
    steps = [h["step_ms"] for h in row["hand"].values() if "step_ms" in h]
    best = min(steps) if steps else None
    row["best_hand_ms"] = best
    row["ilp_over_best"] = None if best is None else round(row["ilp"]["step_ms"] / best, 6)
    row["ok"] = all(row["ilp"]["objective_s"] <= h["objective_s"] * (1 + TOLERANCE)
                    for h in row["hand"].values() if "objective_s" in h)
    return row


def _cell(h: dict) -> str:
    if "step_ms" in h:
        return f"{h['step_ms']:.4g}"
    return "OOM" if "memory" in h["status"] else "n/a"


def print_row(label: str, row: dict, first: bool) -> None:
    if first:
        hand = "".join(f"{n.replace('data+megatron', 'dp+mp'):>10}" for n in HAND_PLANS)
        header = (f"{'model':<24}{'mesh':>5}{'nodes':>7}{'vars':>7}{'solve s':>8}{'total s':>8}"
                  f"{'ILP ms':>10}{hand}{'ILP/best':>9}  ok")
        print(header)
        print("-" * len(header))
    cells = "".join(f"{_cell(row['hand'].get(n, {'status': 'n/a'})):>10}" for n in HAND_PLANS)
    ratio = "-" if row["ilp_over_best"] is None else f"{row['ilp_over_best']:.3f}"
    print(f"{label:<24}{row['mesh']:>5}{row['nodes']:>7}{row['variables']:>7}"
          f"{row['solve_s']:>8.2f}{row['total_s']:>8.2f}{row['ilp']['step_ms']:>10.4g}{cells}"
          f"{ratio:>9}  {'yes' if row['ok'] else 'NO'}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated model:preset[:k=v/...]")
    parser.add_argument("--meshes", default=None)
    parser.add_argument("--quick", action="store_true", help="CI size")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--cluster", default="dgx-a100")
    parser.add_argument("--solver", default=DEFAULT_SOLVER)
    parser.add_argument("--no-gpt3", action="store_true",
                        help="skip the GPT-3 175B row (96 layers, hidden 12288, on 4x8)")
    parser.add_argument("--unsimplified", action="store_true",
                        help="also solve without merging followers (exact, larger)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    models = (args.models.split(",") if args.models else
              QUICK_MODELS if args.quick else DEFAULT_MODELS)
    meshes = (args.meshes.split(",") if args.meshes else
              QUICK_MESHES if args.quick else DEFAULT_MESHES)
    batch = 8 if args.quick and args.batch == 32 else args.batch
    cluster = get_cluster(args.cluster)
    rows, first = [], True
    for spec in models:
        name, preset, overrides = parse_model(spec)
        graph, config, capture_s, cleanup_s = capture(name, preset, overrides, batch)
        layers = getattr(config, "n_layers", None)
        label = f"{name}:{preset}" + (f" L={layers}" if layers is not None else "")
        for mesh in meshes:
            row = measure(graph, mesh, cluster, args.solver, args.unsimplified)
            row.update({"model": spec, "label": label, "batch": batch,
                        "capture_s": round(capture_s, 2), "cleanup_s": round(cleanup_s, 2)})
            rows.append(row)
            print_row(label, row, first)
            first = False
        del graph
    gpt3 = None
    if not (args.no_gpt3 or args.quick):
        graph, config, capture_s, cleanup_s = capture("gpt", "175B", {}, batch)
        gpt3 = measure(graph, "4x8", cluster, args.solver, args.unsimplified,
                       memory_limit=False)
        gpt3.update({"model": "gpt:175B",
                     "label": f"gpt3-{config.n_layers}L h{config.d_model}", "batch": batch,
                     "capture_s": round(capture_s, 2), "cleanup_s": round(cleanup_s, 2)})
        print_row(gpt3["label"], gpt3, first)
        print(f"\n{gpt3['label']} on 4x8: capture {gpt3['capture_s']:.1f} s, cleanup "
              f"{gpt3['cleanup_s']:.1f} s, ILP build {gpt3['build_s']:.2f} s + solve "
              f"{gpt3['solve_s']:.2f} s = {gpt3['total_s']:.2f} s (measured). Alpa's Table 5, "
              f"GPT-39B on 64 GPUs: compilation {ALPA_TABLE5['compilation']} s, profiling "
              f"{ALPA_TABLE5['profiling']} s, stage DP {ALPA_TABLE5['stage_construction_dp']} s,"
              f" total {ALPA_TABLE5['total']} s.")
    bad = [r for r in rows + ([gpt3] if gpt3 else []) if not r["ok"]]
    result = {"benchmark": "autoshard",
              "units": "seconds and ms measured wall clock for build/solve; step ms and memory "
                       "GiB estimated by the cost model",
              "cluster": args.cluster, "solver": args.solver, "batch": batch,
              "machine": {"cpu_count": torch.get_num_threads(),
                          "python": sys.version.split()[0], "torch": torch.__version__,
                          "platform": platform.platform()},
              "alpa_table5_gpt39b_64gpu_s": ALPA_TABLE5,
              "rows": rows, "gpt3": gpt3}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if bad:
        print(f"ILP plan worse than a hand plan in {len(bad)} row(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
