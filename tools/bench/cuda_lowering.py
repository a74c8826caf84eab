"""CUDA lowering benchmark: per model and mesh, the listing's calls by kind, its generated
kernels, the planned arena per device against the live-bytes lower bound, and lowering time.

    python tools/bench/cuda_lowering.py                          # tiny models + GPT-1.3B on 2x4
    python tools/bench/cuda_lowering.py --quick                  # tiny models only
    python tools/bench/cuda_lowering.py --models gpt:1.3B --meshes 2x4 --mode infer

Models are captured without weights (on the meta device, as `graphpar compile --example`
does), auto-sharded on the mesh (DGX-A100 cluster, ILP time limit `--time-limit`), lowered to
device programs and then to one listing per device. Times are measured (wall clock of
`lower_to_listing` for all devices); bytes are planned, not measured. Writes a table and
`cuda_lowering.json` next to this file (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from graphpar.api import lower
from graphpar.cli.common import load_target
from graphpar.compiler import compile_model
from graphpar.passes import parse_pipeline
from graphpar.passes.autoshard import AutoShard
from graphpar.passes.lower_cuda import lower_to_listing

QUICK = [("mlp:tiny", "infer", "2"), ("mlp:tiny", "train", "2x2"), ("gpt:tiny", "infer", "2x2"),
         ("gpt:tiny", "train", "2x2"), ("llama:tiny", "infer", "2x2"),
         ("bert:tiny", "infer", "2x2")]
DEFAULT = QUICK + [("gpt:1.3B", "infer", "2x4"), ("gpt:1.3B", "train", "2x4")]


def measure(model: str, mode: str, mesh: str, time_limit: float) -> dict:
    spec = load_target(None, model, mode)
    start = time.perf_counter()
    passes = [*parse_pipeline("cleanup"), AutoShard(mesh=mesh, time_limit=time_limit)]
    result = compile_model(spec, mode, passes)
    compiled = lower(result.captured, result.context)
    plan_seconds = time.perf_counter() - start
    start = time.perf_counter()
    listings = [lower_to_listing(compiled.spmd, compiled.mesh, r)
                for r in range(compiled.mesh.size)]
    seconds = time.perf_counter() - start
    planned = [x.arena_bytes for x in listings]
    bound = [x.lower_bound_bytes for x in listings]
    return {
        "model": model, "mode": mode, "mesh": mesh,
        "nodes": len(compiled.spmd.nodes),
        "calls_by_kind_rank0": listings[0].calls_by_kind(),
        "calls_rank0": len(listings[0].calls),
        "generated_kernels": len({k for x in listings for k in x.kernels()}),
        "arena_bytes_planned": planned, "arena_lower_bound_bytes": bound,
        "state_bytes": [x.state_bytes for x in listings],
        "worst_planned_over_bound": max(p / max(b, 1) for p, b in zip(planned, bound)),
        "lowering_seconds_measured": round(seconds, 3),
        "capture_and_plan_seconds_measured": round(plan_seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", help="comma-separated model:preset (with --meshes)")
    parser.add_argument("--meshes", default="2x4")
    parser.add_argument("--mode", default="infer", choices=["infer", "train"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()
    if args.models:
        cases = [(m, args.mode, mesh) for m in args.models.split(",")
                 for mesh in args.meshes.split(",")]
    else:
        cases = QUICK if args.quick else DEFAULT
    rows = []
    print(f"{'model':<12} {'mode':<5} {'mesh':<5} {'calls':>6} {'kernels':>7} "
          f"{'arena MiB':>10} {'bound MiB':>10} {'ratio':>6} {'lower s':>8}")
    for model, mode, mesh in cases:
        row = measure(model, mode, mesh, args.time_limit)
        rows.append(row)
        print(f"{model:<12} {mode:<5} {mesh:<5} {row['calls_rank0']:>6} "
              f"{row['generated_kernels']:>7} {max(row['arena_bytes_planned']) / 2**20:>10.2f} "
              f"{max(row['arena_lower_bound_bytes']) / 2**20:>10.2f} "
              f"{row['worst_planned_over_bound']:>6.3f} {row['lowering_seconds_measured']:>8.2f}",
              flush=True)
    Path(args.out).write_text(json.dumps({"machine": platform.platform(), "rows": rows},
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
