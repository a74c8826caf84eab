"""Compile-time benchmark: how long `graphpar compile` takes, by phase, and its peak memory.

    python tools/bench/compile_time.py               # every row; writes compile_time.json
    python tools/bench/compile_time.py --models gpt:175B --meshes 8x8 --update
    python tools/bench/compile_time.py --models gpt:175B --meshes 8x8 \
        --cluster dgx-a100-80gb --via cli --update     # the README's command, end to end
    python tools/bench/compile_time.py --models gpt:tiny --meshes 1x8 --out /tmp/t.json

Each row (a model and a mesh) runs in a fresh Python process, as `graphpar compile --example
MODEL --mesh MESH` does: import torch and graphpar and build the model on the meta device
(load), capture it without weights (the training step with Adam for GPT, inference for LLaMA
and the Mixtral shape), the cleanup passes, then auto-shard on `--cluster` (strategies, the
ILP and its solve) with the CLI's plan limits unless told otherwise (`--memory-limit device`:
the plan must fit the cluster's memory per device, or the row says it was refused). It reports
wall seconds and CPU seconds per phase (on a shared machine the CPU seconds are the steadier
number) and the process' peak resident memory (ru_maxrss). `--via cli` times the command
itself instead (`python -m graphpar.cli compile ...`, also writing the IR listing and
report.json): its total only. Every row keeps its settings, CPU and load average, so
`--update` can replace some rows of a kept JSON and leave the others. Beside them: Alpa's
published compile time for GPT-39B on 64 GPUs (OSDI'22, Table 5), which also profiles on the
cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
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
# a row is one of these settings; --update replaces the kept rows of the same key
ROW_KEY = ("model", "mesh", "cluster", "memory_limit", "via")

# Alpa (OSDI'22) Table 5: compile-time breakdown for GPT-39B on 64 GPUs, in seconds.
ALPA_TABLE5 = {"compilation": 1582.66, "profiling": 804.48, "stage_construction_dp": 1.65,
               "other": 4.47, "total": 2393.26}


def cli_limits() -> tuple[str, float]:
    """The `graphpar compile` defaults of --memory-limit and --time-limit, as text and
    seconds (a row keeps the text)."""
    from graphpar.cost.limits import DEFAULT_MEMORY, DEFAULT_TIME_SECONDS

    return DEFAULT_MEMORY, DEFAULT_TIME_SECONDS


def settings_of(args: argparse.Namespace) -> dict:
    """What a row was measured with, the CLI's defaults filled in."""
    memory_limit, time_limit = cli_limits()
    return {"cluster": args.cluster, "memory_limit": args.memory_limit or memory_limit,
            "time_limit_s": args.time_limit if args.time_limit is not None else time_limit,
            "via": args.via}


def measure_row(model: str, mesh: str, settings: dict) -> dict:
    """One compile, phase by phase, in this process (the parent runs it in a fresh one)."""
    import torch

    from graphpar.capture import Adam
    from graphpar.compiler.driver import ModelSpec, capture
    from graphpar.cost.cluster import get_cluster
    from graphpar.errors import GraphparError
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
    cluster = settings["cluster"]
    row = {"model": model, "mesh": mesh, "mode": mode,
           "layers": example.config.n_layers, "nodes_after_cleanup": nodes,
           "parameters": sum(v.type.numel for v in captured.graph.inputs
                             if v.role.value == "param")}
    try:
        PassManager([AutoShard(mesh=mesh, cluster=cluster,
                               time_limit=settings["time_limit_s"],
                               memory_limit=settings["memory_limit"])]
                    ).run(captured.graph, context)
    except GraphparError as e:  # refused: no plan fits the memory limit, or out of time
        done("auto_shard")
        row["refused"] = str(e)
    else:
        done("auto_shard")
        plan = context.result(ShardingPlans)[captured.graph.name]
        row |= {"solve_s": plan.stats["solve_seconds"],
                "ilp_variables": plan.stats["variables"],
                "solver_status": plan.stats["status"],
                "step_ms_estimated": round(plan.step_seconds * 1e3, 3),
                "memory_gib_estimated": round(plan.memory_bytes / 2**30, 3),
                "fits_device_memory": plan.memory_bytes <= get_cluster(cluster).device_memory}
    return row | {
        "wall_s": {**wall, "total": round(marks[-1][0] - marks[0][0], 3)},
        "cpu_s": {**cpu, "total": round(marks[-1][1] - marks[0][1], 3)},
        # Linux reports KiB.
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "torch_threads": torch.get_num_threads(),
    }


def measure_cli(model: str, mesh: str, settings: dict) -> dict:
    """The `graphpar compile` command itself, in a child process: its wall and CPU seconds
    and peak memory (the child's own rusage), and the plan from its report.json."""
    family, preset, overrides, mode = MODELS[model]
    if overrides:
        return {"model": model, "mesh": mesh,
                "error": "a shape with config overrides: no --example of the CLI"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        command = [sys.executable, "-m", "graphpar.cli", "compile",
                   "--example", f"{family}:{preset}", "--mode", mode, "--mesh", mesh,
                   "--cluster", settings["cluster"],
                   "--memory-limit", settings["memory_limit"],
                   "--time-limit", str(settings["time_limit_s"]), "--out", str(out)]
        with open(Path(tmp) / "stderr", "w+") as err:
            wall = time.perf_counter()
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage
            wall = time.perf_counter() - wall
            child.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            stderr = err.read()
        report = out / "report.json"
        summary = json.loads(report.read_text()) if report.exists() else {}
    row = {"model": model, "mesh": mesh, "mode": mode,
           "command": " ".join(["graphpar", *command[3:-2]]),
           "exit_status": child.returncode,
           "wall_s": {"total": round(wall, 3)},
           "cpu_s": {"total": round(usage.ru_utime + usage.ru_stime, 3)},
           "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3)}
    if "plan" in summary:
        plan = summary["plan"]
        row |= {"nodes": summary["nodes"],
                "solve_s": plan["solver"]["solve_seconds"],
                "ilp_variables": plan["solver"]["variables"],
                "solver_status": plan["solver"]["status"],
                "step_ms_estimated": round(plan["step_seconds_estimated"] * 1e3, 3),
                "memory_gib_estimated": round(plan["memory_bytes_per_device_estimated"]
                                              / 2**30, 3)}
    else:
        row["refused"] = (stderr.strip().splitlines() or ["(no output)"])[-1]
    return row


def run_row(model: str, mesh: str, settings: dict) -> dict:
    """`measure_row` in a fresh process (its peak memory is the row's alone), or the command
    itself (`via` "cli"); with the row's settings, CPU and load average."""
    from graphpar.calibration.calibrate import cpu_model

    load = os.getloadavg()[0]
    if settings["via"] == "cli":
        row = measure_cli(model, mesh, settings)
    else:
        result = subprocess.run([sys.executable, __file__, "--row", model, mesh,
                                 "--settings", json.dumps(settings)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            row = {"model": model, "mesh": mesh, "error": tail}
        else:
            row = json.loads(result.stdout.strip().splitlines()[-1])
    return row | settings | {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                             "load_average_1min_before": round(load, 2),
                             "load_average_1min_after": round(os.getloadavg()[0], 2),
                             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def print_row(row: dict, first: bool) -> None:
    if first:
        header = (f"{'model':<14}{'mesh':>5}{'layers':>7}{'nodes':>7}{'load s':>8}"
                  f"{'capture s':>10}{'cleanup s':>10}{'shard s':>8}{'(solve)':>8}"
                  f"{'total s':>8}{'cpu s':>7}{'RSS GiB':>8}  plan")
        print(header)
        print("-" * len(header))
    if "error" in row:
        print(f"{row['model']:<14}{row['mesh']:>5}  failed: {row['error']}", flush=True)
        return
    w = row["wall_s"]
    phases = (f"{w['load']:>8.1f}{w['capture']:>10.1f}{w['cleanup']:>10.2f}"
              f"{w['auto_shard']:>8.1f}" if "load" in w else f"{'(the command: total only)':>36s}")
    plan = (f"refused: {row['refused']}" if "refused" in row else
            f"{row['step_ms_estimated']:.1f} ms, {row['memory_gib_estimated']:.1f} GiB per "
            f"device (estimated)")
    print(f"{row['model']:<14}{row['mesh']:>5}{row.get('layers', '-'):>7}"
          f"{row.get('nodes_after_cleanup', row.get('nodes', '-')):>7}{phases}"
          f"{row.get('solve_s', float('nan')):>8.2f}{w['total']:>8.1f}"
          f"{row['cpu_s']['total']:>7.1f}{row['peak_rss_gib']:>8.2f}  {plan}", flush=True)


def write_result(path: Path, rows: list[dict]) -> None:
    result = {"benchmark": "compile_time",
              "units": "wall_s and cpu_s measured seconds per phase (via cli: the command's "
                       "total); peak_rss_gib measured (ru_maxrss of the row's own process); "
                       "step_ms_estimated and memory_gib_estimated by the cost model; each "
                       "row keeps its settings (cluster, memory_limit, time_limit_s, via), "
                       "CPU, load average and time",
              "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
              "alpa_table5_gpt39b_64gpu_s": ALPA_TABLE5,
              "rows": rows}
    path.write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES))
    parser.add_argument("--cluster", default="dgx-a100",
                        help="cluster preset or file (default dgx-a100, the CLI's)")
    parser.add_argument("--memory-limit", default=None,
                        help="as the CLI takes it (default: the CLI's, 'device')")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="auto-shard's, seconds (default: the CLI's)")
    parser.add_argument("--via", choices=["phases", "cli"], default="phases",
                        help="time the phases in one process (default), or the graphpar "
                             "compile command itself")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--update", action="store_true",
                        help="keep --out's other rows: replace only those of the same model, "
                             "mesh, cluster, memory limit and via")
    parser.add_argument("--row", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:  # the child process of one row
        print(json.dumps(measure_row(*args.row, json.loads(args.settings))))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    settings = settings_of(args)
    out = Path(args.out)
    kept = json.loads(out.read_text())["rows"] if args.update and out.exists() else []
    rows: list[dict] = []
    for model in models:
        for mesh in meshes:
            rows.append(run_row(model, mesh, settings))
            print_row(rows[-1], len(rows) == 1)
            new = {tuple(r.get(k) for k in ROW_KEY) for r in rows}
            # after every row: a long run keeps what it did
            write_result(out, [r for r in kept if tuple(r.get(k) for k in ROW_KEY) not in new]
                         + rows)
    print(f"\nAlpa (OSDI'22, Table 5), GPT-39B on 64 GPUs: compilation "
          f"{ALPA_TABLE5['compilation']} s + profiling {ALPA_TABLE5['profiling']} s + stage DP "
          f"{ALPA_TABLE5['stage_construction_dp']} s + other {ALPA_TABLE5['other']} s = "
          f"{ALPA_TABLE5['total']} s.")
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
