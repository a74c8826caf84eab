"""Plan quality, measured: every plan's estimated step time against its step time on gloo ranks.

    python tools/bench/plan_quality.py                   # the default set; writes plan_quality.json
    python tools/bench/plan_quality.py --quick           # a small subset (GPT, 2 ranks)
    python tools/bench/plan_quality.py --cluster cpu --models gpt --modes decode --meshes 2
    python tools/bench/plan_quality.py --models gpt:125M --modes decode --meshes 2

For each model (bundled GPT, LLaMA, MoE and Wide-ResNet at sizes a CPU runs in seconds), mode
(`train`: forward, backward and an Adam update in one step; `decode`: for GPT and LLaMA one new
token per sequence over a KV cache, `capture_decode`'s graph; for the others, inference) and
mesh, the ILP's plan and every hand plan (data parallel, DDP's pure data parallel, ZeRO,
ZeRO-3, Megatron-LM, data x Megatron; graphpar/passes/autoshard/hand_plans.py) are solved under
one cost model, the cluster file's (default tools/bench/gloo_cluster.json, this machine
measured), lowered to device programs and run on one gloo process per rank: `--repeats` times
`--steps` timed steps after `--warmup` untimed ones, with one set of processes per plan. A step
is as long as its slowest rank; a plan's measured time is the median over all its timed steps,
and its noise the spread of its repeats' medians ((max - min) / median), so that repeated runs
say how far apart two plans must be to differ.

Per row: predicted ms (the device program's estimate: its nodes priced by the cost model; the
JSON also has `objective_ms`, the ILP objective the plan was chosen by, which prices a value
resharded for several consumers once per consumer where the program reshards it once), measured
ms (median, min), the relative error (predicted - measured) / measured. Per (model, mode,
mesh): Kendall's tau-b between the predicted and measured orders of the plans, and whether the
ILP's plan is the fastest measured or within noise of it (its median at most the fastest's
times 1 + the larger of the two plans' noise); by wall time, and again by the ranks' CPU time
(`cpu ms`, the max over ranks per step), which other work sharing the cores inflates far less
than wall time but which leaves out time spent waiting in collectives. Estimated and measured
figures are kept apart in the JSON.

The last repeat of each plan also times every node of rank 0's program: the per-op table sums,
over all plans, what the cost model predicts for each op (compute: the roofline on its local
shapes; collectives: alpha-beta on their buffer) against what it took, to show which op classes
and collectives are mispriced (`--no-profile` skips it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from graphpar.calibration.plan_runs import NodeRow, PlanCase, capture_case, node_rows, solve_plan
from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.errors import MemoryLimitError
from graphpar.passes.autoshard.hand_plans import HAND_PLANS, NotApplicable

HERE = Path(__file__).resolve().parent
DEFAULT_CLUSTER = str(HERE / "gloo_cluster.json")
PLANS = ("ilp", *HAND_PLANS)

# Sizes a CPU core runs a step of in tens of milliseconds: big enough that the matmuls, not
# the interpreter's per-op overhead, are most of a step. `batch` divides every mesh's size.
SIZES = {
    "gpt": dict(preset="tiny", batch=8, config=dict(vocab_size=1024, seq_len=64, d_model=256,
                                                    n_layers=2, n_heads=8)),
    "llama": dict(preset="tiny", batch=8, config=dict(vocab_size=1024, seq_len=64, d_model=256,
                                                      n_layers=2, n_heads=8, n_kv_heads=4,
                                                      ffn_dim=704)),
    "moe": dict(preset="tiny", batch=8, config=dict(vocab_size=1024, seq_len=64, d_model=256,
                                                    n_layers=2, n_heads=8, n_experts=4,
                                                    expert_group_size=64)),
    "wide_resnet": dict(preset="tiny", batch=8, config=dict(image_size=32, base_channels=32,
                                                            width_factor=2, stage_sizes=(1, 1))),
}
PRESET_BATCH = 8  # for `model:preset` given on the command line
DECODE_PAST = 63  # tokens already in the KV cache (seq_len - 1 of the default sizes)

DEFAULT_MODELS = ["gpt", "llama", "moe", "wide_resnet"]
DEFAULT_MODES = ["train", "decode"]
DEFAULT_MESHES = ["2", "2x2", "4"]
QUICK = dict(models=["gpt"], modes=["train", "decode"], meshes=["2"], steps=3, warmup=1,
             repeats=2)


def build_case(model: str, mode: str) -> PlanCase:
    """`model` ("gpt", or "gpt:125M" for a preset) captured in `mode` with real weights."""
    name, _, preset = model.partition(":")
    size = SIZES[name] if not preset else dict(preset=preset, batch=PRESET_BATCH, config={})
    return capture_case(name, mode, batch=size["batch"], config=size["config"],
                        preset=size["preset"], past=DECODE_PAST)


def measure_plan(case: PlanCase, mesh, name: str, cluster, args) -> dict:
    """One row: the plan's estimate and its measured step times."""
    row = {"model": case.model, "mode": case.mode, "mesh": "x".join(map(str, mesh.shape)),
           "plan": name}
    try:
        plan, compiled = solve_plan(case, mesh, name)
    except NotApplicable as exc:
        return {**row, "status": f"n/a: {exc}"}
    except MemoryLimitError:
        return {**row, "status": "does not fit in memory"}
    start = time.perf_counter()
    runs = compiled.time_steps(args.steps, args.warmup, args.repeats, args=case.args,
                               profile=args.profile)
    wall = time.perf_counter() - start
    rows = node_rows(compiled, runs[-1] if args.profile else None)
    if args.profile:
        row["ops"] = op_breakdown(rows)
    steps = [s for r in runs for s in r.step_seconds]
    medians = [r.median for r in runs]
    measured = statistics.median(steps)
    # the program's estimate: what the cost model prices the nodes that run at (the ILP's
    # objective prices a value resharded for several consumers once per consumer)
    predicted = sum(r.predicted for r in rows)
    return {**row, "status": "ok",
            "predicted_ms": predicted * 1e3,
            "predicted_compute_ms": sum(r.predicted for r in rows if not r.collective) * 1e3,
            "predicted_comm_ms": sum(r.predicted for r in rows if r.collective) * 1e3,
            "objective_ms": plan.step_seconds * 1e3,
            "measured_ms": measured * 1e3, "measured_min_ms": min(steps) * 1e3,
            "measured_repeat_medians_ms": [m * 1e3 for m in medians],
            "measured_cpu_ms": statistics.median(r.cpu_median for r in runs) * 1e3,
            "noise": _spread(medians),
            "cpu_noise": _spread([r.cpu_median for r in runs]),
            "relative_error": (predicted - measured) / measured,
            "bytes_per_device_predicted": compiled.predicted_bytes,
            "bench_wall_s": round(wall, 2)}


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far apart repeated measurements of one thing land."""
    return (max(values) - min(values)) / statistics.median(values)


def op_breakdown(rows: list[NodeRow]) -> dict[str, dict]:
    """A step by op: per op name, its nodes, the seconds the cost model predicts for them on
    one device and the seconds they took (mean over ranks and timed steps)."""
    ops: dict[str, dict] = {}
    for row in rows:
        entry = ops.setdefault(row.op, {"nodes": 0, "predicted_ms": 0.0, "measured_ms": 0.0})
        entry["nodes"] += 1
        entry["predicted_ms"] += row.predicted * 1e3
        entry["measured_ms"] += row.measured * 1e3
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]["measured_ms"]))


def op_totals(rows: list[dict]) -> dict[str, dict]:
    """`op_breakdown` summed over every profiled row, biggest measured first."""
    totals: dict[str, dict] = {}
    for r in rows:
        for op, e in r.get("ops", {}).items():
            t = totals.setdefault(op, {"nodes": 0, "predicted_ms": 0.0, "measured_ms": 0.0})
            for k in t:
                t[k] += e[k]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["measured_ms"]))


def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b of two orderings of the same items (ties count as neither); None with
    fewer than two items or when one side is all ties."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x)
                            * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else None


def summarize(rows: list[dict]) -> dict:
    """Per (model, mode, mesh): tau between predicted and measured, the fastest plan, and
    whether the ILP's plan is the fastest or within noise of it; by wall time, and (`_cpu`) by
    the ranks' CPU time, which a machine shared with other work inflates far less (but which
    leaves out time spent waiting on a collective)."""
    ran = [r for r in rows if r["status"] == "ok"]
    out = {}
    for key in dict.fromkeys((r["model"], r["mode"], r["mesh"]) for r in ran):
        group = [r for r in ran if (r["model"], r["mode"], r["mesh"]) == key]
        summary = {"plans": len(group)}
        for suffix, measured, noise in (("", "measured_ms", "noise"),
                                        ("_cpu", "measured_cpu_ms", "cpu_noise")):
            if not all(measured in r for r in group):
                continue
            fastest = min(group, key=lambda r, m=measured: r[m])
            ilp = next((r for r in group if r["plan"] == "ilp"), None)
            within = None
            if ilp is not None:
                spread = max(ilp.get(noise, 0.0), fastest.get(noise, 0.0))
                within = ilp[measured] <= fastest[measured] * (1 + spread)
            summary.update({
                f"kendall_tau{suffix}": kendall_tau([r["predicted_ms"] for r in group],
                                                    [r[measured] for r in group]),
                f"fastest{suffix}": fastest["plan"],
                f"ilp_fastest_or_within_noise{suffix}": within})
        summary["median_abs_relative_error"] = statistics.median(
            abs(r["relative_error"]) for r in group)
        summary["median_abs_relative_error_cpu"] = statistics.median(
            abs(r["predicted_ms"] - r["measured_cpu_ms"]) / r["measured_cpu_ms"] for r in group)
        out["/".join(key)] = summary
    return out


def print_table(rows: list[dict], groups: dict) -> None:
    print(f"{'model':<12}{'mode':<8}{'mesh':<6}{'plan':<15}{'pred ms':>10}{'meas ms':>10}"
          f"{'min ms':>10}{'noise':>8}{'rel err':>9}{'cpu ms':>10}")
    for r in rows:
        head = f"{r['model']:<12}{r['mode']:<8}{r['mesh']:<6}{r['plan']:<15}"
        if r["status"] != "ok":
            print(f"{head}{r['status'][:60]}")
            continue
        print(f"{head}{r['predicted_ms']:>10.3f}{r['measured_ms']:>10.3f}"
              f"{r['measured_min_ms']:>10.3f}{r['noise']:>8.1%}{r['relative_error']:>+9.1%}"
              f"{r['measured_cpu_ms']:>10.3f}")
    print()
    print(f"{'model/mode/mesh':<28}{'plans':>6}{'|err| med':>10}{'tau':>7}  {'fastest':<14}"
          f"{'ILP ok':<8}{'tau cpu':>8}  {'fastest cpu':<14}ILP ok cpu")
    for key, g in groups.items():
        def tau(value):
            return "n/a" if value is None else f"{value:.2f}"
        print(f"{key:<28}{g['plans']:>6}{g['median_abs_relative_error']:>10.1%}"
              f"{tau(g['kendall_tau']):>7}  {g['fastest']:<14}"
              f"{g['ilp_fastest_or_within_noise']!s:<8}{tau(g['kendall_tau_cpu']):>8}  "
              f"{g['fastest_cpu']:<14}{g['ilp_fastest_or_within_noise_cpu']}")


def print_ops(totals: dict[str, dict], top: int = 15) -> None:
    print(f"\n{'op (rank 0, all plans)':<24}{'nodes':>7}{'pred ms':>10}{'meas ms':>10}"
          f"{'meas/pred':>10}")
    for op, t in list(totals.items())[:top]:
        ratio = t["measured_ms"] / t["predicted_ms"] if t["predicted_ms"] else float("inf")
        print(f"{op:<24}{t['nodes']:>7}{t['predicted_ms']:>10.2f}{t['measured_ms']:>10.2f}"
              f"{ratio:>10.3g}")


def machine() -> dict:
    from graphpar.calibration.calibrate import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": list(os.getloadavg()),
            "python": platform.python_version(), "torch": torch.__version__}


def cluster_for(devices: int, given: str | None) -> str:
    """The cluster a mesh of `devices` ranks is priced on: `given`, else this machine
    calibrated on that many ranks (`calibration.cluster_file_for`)."""
    from graphpar.calibration.calibrate import cluster_file_for

    return given or cluster_file_for(devices, DEFAULT_CLUSTER)


def run(args) -> dict:
    rows = []
    used = {}
    for model in args.models:
        for mode in args.modes:
            start = time.perf_counter()
            case = build_case(model, mode)
            capture_s = time.perf_counter() - start
            for mesh_shape in args.meshes:
                devices = math.prod(int(d) for d in mesh_shape.split("x"))
                path = cluster_for(devices, args.cluster)
                cluster = used.setdefault(path, get_cluster(path))
                mesh = mesh_for(mesh_shape, cluster)
                for name in args.plans:
                    row = measure_plan(case, mesh, name, cluster, args)
                    row["capture_s"] = round(capture_s, 2)
                    row["cluster"] = path
                    rows.append(row)
                    if args.verbose:
                        print(f"  {row['model']} {row['mode']} {row['mesh']} {name}: "
                              f"{row['status']}", file=sys.stderr, flush=True)
    groups = summarize(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    return {"clusters": {path: c.name for path, c in used.items()},
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "machine": machine(), "rows": rows, "groups": groups, "ops": op_totals(rows),
            "median_abs_relative_error": (statistics.median(abs(r["relative_error"])
                                                            for r in ok) if ok else None)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (GPT on 2 ranks)")
    parser.add_argument("--models", nargs="+", help=f"default: {' '.join(DEFAULT_MODELS)}; "
                        "model:preset for a bundled preset")
    parser.add_argument("--modes", nargs="+", choices=["train", "decode"])
    parser.add_argument("--meshes", nargs="+")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    parser.add_argument("--cluster", default=None,
                        help="the cost model's cluster, a preset or file (default: this "
                             "machine calibrated on as many ranks as the mesh has, "
                             "gloo_cluster[.<n>ranks].json beside this script)")
    parser.add_argument("--steps", type=int, help="timed steps per repeat (default 5)")
    parser.add_argument("--warmup", type=int, help="untimed steps before them (default 2)")
    parser.add_argument("--repeats", type=int, help="repeats per plan (default 3)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="do not time every node in the last repeat (the per-op table)")
    parser.add_argument("--out", default=str(HERE / "plan_quality.json"))
    parser.add_argument("--verbose", action="store_true", help="a line per plan as it runs")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else dict(models=DEFAULT_MODELS, modes=DEFAULT_MODES,
                                             meshes=DEFAULT_MESHES, steps=5, warmup=2,
                                             repeats=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    result = run(args)
    print_table(result["rows"], result["groups"])
    if result["ops"]:
        print_ops(result["ops"])
    if result["median_abs_relative_error"] is not None:
        print(f"\nmedian |relative error| over all plans: "
              f"{result['median_abs_relative_error']:.1%} (clusters "
              f"{', '.join(Path(p).name for p in result['clusters'])}; "
              f"load average {result['machine']['load_average'][0]:.1f} on "
              f"{result['machine']['cores']} cores)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
