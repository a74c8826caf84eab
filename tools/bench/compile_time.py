"""Compile-time benchmark: how long `graphpar compile` takes, by phase, and its peak memory.

    python tools/bench/compile_time.py               # every row; writes compile_time.json
    python tools/bench/compile_time.py --models gpt:175B --meshes 8x8
    python tools/bench/compile_time.py --models gpt:tiny --meshes 1x8 --out /tmp/t.json

Each row (a model and a mesh) runs in a fresh Python process, as `graphpar compile --example
MODEL --mesh MESH` does: import torch and graphpar and build the model on the meta device
(load), capture it without weights (the training step with Adam for GPT, inference for LLaMA
and the Mixtral shape), the cleanup passes, then auto-shard on DGX A100 nodes (strategies, the
ILP and its solve). It reports wall
seconds and CPU seconds per phase (on a shared machine the CPU seconds are the steadier number)
and the process' peak resident memory (ru_maxrss). Beside them: Alpa's published compile time
for GPT-39B on 64 GPUs (OSDI'22, Table 5), which also profiles on the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

# A row's clock starts with its process: "load" includes importing torch and graphpar.
STARTED = (time.perf_counter(), time.process_time())

# model -> (bundled family, preset, config overrides, mode)
MODELS = {
    "gpt:1.3B": ("gpt", "1.3B", {}, "train"),
    "gpt:6.7B": ("gpt", "6.7B", {}, "train"),
    "gpt:39B": ("gpt", "39B", {}, "train"),
    "gpt:175B": ("gpt", "175B", {}, "train"),
    "llama:7B": ("llama", "7B", {}, "infer"),
    "llama:70B": ("llama", "70B", {}, "infer"),
    # Mixtral-8x7B's shape on the bundled MoE LM (top-2 of 8 experts in every layer; its FFN
    # is 4x wide where Mixtral's SwiGLU is 3.5x, and it has LayerNorm and learned positions).
    "mixtral:8x7B": ("moe", "tiny", {"vocab_size": 32000, "seq_len": 1024, "d_model": 4096,
                                     "n_layers": 32, "n_heads": 32, "mlp_ratio": 4,
                                     "n_experts": 8, "moe_every": 1,
                                     "expert_group_size": 1024}, "infer"),
    "gpt:tiny": ("gpt", "tiny", {}, "infer"),  # the smoke test's
}
DEFAULT_MODELS = ["gpt:1.3B", "gpt:6.7B", "gpt:39B", "gpt:175B", "llama:7B", "llama:70B",
                  "mixtral:8x7B"]
DEFAULT_MESHES = ["1x8", "2x8", "4x8", "8x8"]
PHASES = ("load", "capture", "cleanup", "auto_shard")
CLUSTER = "dgx-a100"
TIME_LIMIT_S = 600.0  # auto-shard's: generous, so a slow row is measured rather than failed

# Alpa (OSDI'22) Table 5: compile-time breakdown for GPT-39B on 64 GPUs, in seconds.
ALPA_TABLE5 = {"compilation": 1582.66, "profiling": 804.48, "stage_construction_dp": 1.65,
               "other": 4.47, "total": 2393.26}


def measure_row(model: str, mesh: str) -> dict:
    """One compile, phase by phase, in this process (the parent runs it in a fresh one)."""
    import torch

    from graphpar.capture import Adam
    from graphpar.compiler.driver import ModelSpec, capture
    from graphpar.cost.cluster import get_cluster
    from graphpar.models import example_batch, get_model
    from graphpar.passes import PassContext, PassManager, parse_pipeline
    from graphpar.passes.autoshard import AutoShard
    from graphpar.passes.autoshard.auto_shard import ShardingPlans

    family, preset, overrides, mode = MODELS[model]
    wall, cpu, marks = {}, {}, [STARTED]

    def done(phase: str) -> None:
        now = (time.perf_counter(), time.process_time())
        wall[phase] = round(now[0] - marks[-1][0], 3)
        cpu[phase] = round(now[1] - marks[-1][1], 3)
        marks.append(now)

    example = get_model(family, preset, train=mode == "train", device="meta", **overrides)
    inputs, targets = example_batch(family, example.config)
    spec = ModelSpec(model, example.module, tuple(inputs), example.loss_fn, tuple(targets))
    done("load")
    captured = capture(spec, mode, Adam() if mode == "train" else None)
    done("capture")
    context = PassContext()
    PassManager(parse_pipeline("cleanup")).run(captured.graph, context)
    nodes = len(captured.graph.nodes)
    done("cleanup")
    # No memory limit: the rows time the same search on every mesh, including meshes too
    # small to hold the model (the row's `fits_device_memory` says which).
    PassManager([AutoShard(mesh=mesh, cluster=CLUSTER, time_limit=TIME_LIMIT_S,
                           memory_limit="none")]).run(captured.graph, context)
    done("auto_shard")
    plan = context.result(ShardingPlans)[captured.graph.name]
    return {
        "model": model, "mesh": mesh, "mode": mode,
        "layers": example.config.n_layers, "nodes_after_cleanup": nodes,
        "parameters": sum(v.type.numel for v in captured.graph.inputs
                          if v.role.value == "param"),
        "wall_s": {**wall, "total": round(marks[-1][0] - marks[0][0], 3)},
        "cpu_s": {**cpu, "total": round(marks[-1][1] - marks[0][1], 3)},
        "solve_s": plan.stats["solve_seconds"],
        "ilp_variables": plan.stats["variables"],
        "solver_status": plan.stats["status"],
        "step_ms_estimated": round(plan.step_seconds * 1e3, 3),
        "memory_gib_estimated": round(plan.memory_bytes / 2**30, 3),
        "fits_device_memory": plan.memory_bytes <= get_cluster(CLUSTER).device_memory,
        # Linux reports KiB.
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "torch_threads": torch.get_num_threads(),
    }


def run_row(model: str, mesh: str) -> dict:
    """`measure_row` in a fresh process: its peak memory is the row's alone."""
    result = subprocess.run([sys.executable, __file__, "--row", model, mesh],
                            capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"model": model, "mesh": mesh, "error": tail}
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_row(row: dict, first: bool) -> None:
    if first:
        header = (f"{'model':<14}{'mesh':>5}{'layers':>7}{'nodes':>7}{'load s':>8}"
                  f"{'capture s':>10}{'cleanup s':>10}{'shard s':>8}{'(solve)':>8}"
                  f"{'total s':>8}{'cpu s':>7}{'RSS GiB':>8}")
        print(header)
        print("-" * len(header))
    if "error" in row:
        print(f"{row['model']:<14}{row['mesh']:>5}  failed: {row['error']}", flush=True)
        return
    w = row["wall_s"]
    print(f"{row['model']:<14}{row['mesh']:>5}{row['layers']:>7}{row['nodes_after_cleanup']:>7}"
          f"{w['load']:>8.1f}{w['capture']:>10.1f}{w['cleanup']:>10.2f}{w['auto_shard']:>8.1f}"
          f"{row['solve_s']:>8.2f}{w['total']:>8.1f}{row['cpu_s']['total']:>7.1f}"
          f"{row['peak_rss_gib']:>8.2f}", flush=True)


def write_result(path: Path, rows: list[dict]) -> None:
    result = {"benchmark": "compile_time",
              "units": "wall_s and cpu_s measured seconds per phase; peak_rss_gib measured "
                       "(ru_maxrss of the row's own process); step_ms_estimated by the cost "
                       "model",
              "cluster": CLUSTER,
              "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0],
                          "platform": platform.platform(),
                          "load_average_at_end": os.getloadavg()},
              "alpa_table5_gpt39b_64gpu_s": ALPA_TABLE5,
              "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES))
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--row", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:  # the child process of one row
        print(json.dumps(measure_row(*args.row)))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    rows: list[dict] = []
    for model in models:
        for mesh in meshes:
            rows.append(run_row(model, mesh))
            print_row(rows[-1], len(rows) == 1)
            write_result(Path(args.out), rows)  # after every row: a long run keeps what it did
    print(f"\nAlpa (OSDI'22, Table 5), GPT-39B on 64 GPUs: compilation "
          f"{ALPA_TABLE5['compilation']} s + profiling {ALPA_TABLE5['profiling']} s + stage DP "
          f"{ALPA_TABLE5['stage_construction_dp']} s + other {ALPA_TABLE5['other']} s = "
          f"{ALPA_TABLE5['total']} s.")
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
