"""Pipeline benchmark: the two-level plan (stage DP over the ILP) against one-level and hand
plans, all ESTIMATED by graphpar's cost model on a DGX-A100 cluster.

    python tools/bench/pipeline.py                 # quick: tiny models on 1x4 (a smoke test)
    python tools/bench/pipeline.py --full          # GPT 1.3B/6.7B/39B, MoE, Wide-ResNet on 2x8..8x8
    python tools/bench/pipeline.py --models gpt:1.3B --meshes 2x8 --append   # one row, merged

Per model and mesh, the estimated step time (sum(t_i) + (B - 1) max(t_i), per microbatch
stage times from the ILP's cost model) of:

- two-level: `slice-stages` (operator clustering, the stage DP, the ILP per stage);
- two-level+hand: the same search with Megatron-LM's and data-parallel layouts as further
  choices per stage, so it is never worse than the hand plans below;
- intra-op only: one stage on the whole mesh, ILP;
- inter-op only: a pipeline of data-parallel stages (PP-DP), stages by the DP;
- equal layer: S stages of equal layer counts on equal sub-meshes, best S, ILP;
- equal operator: layers of equal op counts instead of Eq. 6's clustering, then the DP;
- megatron (DP, TP, PP): every grid point of equal stages with Megatron-LM's layout, best one.

The "never worse" column checks the promise: two-level+hand is at most every other variant's
step. The two-level search is itself offered the equal-op layers beside Eq. 6's where they
add at most as many kinds of layers (shallow models), so there it is never worse than equal
operator by construction; on deep models it is offered Eq. 6's layers cut finer instead
(two more kinds of layers), equal operator is a baseline it may lose to, and the column
says so when it does. The "layers" of a row say which clustering the plan came from; the
baselines use Eq. 6's layers. Times of the search itself are measured wall-clock and CPU
seconds on this machine (the machine may be shared: CPU seconds are the fairer measure).
Models are captured on the meta device (no weights allocated).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from graphpar.calibration.calibrate import cpu_model
from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster
from graphpar.errors import GraphparError
from graphpar.ir.parser import parse_program
from graphpar.ir.printer import print_graph
from graphpar.models import example_batch, get_model
from graphpar.passes.pipeline.clustering import default_layer_count, equal_ranges, regular_bounds
from graphpar.passes.pipeline.partition import forward_backward_optimizer
from graphpar.passes.pipeline.slice_stages import logical_meshes, slice_stages
from graphpar.passes.pipeline.stage_dp import submesh_shapes

QUICK_MODELS = ["gpt:tiny", "moe:tiny", "wide_resnet:tiny"]
QUICK_MESHES = ["1x4"]
FULL_MODELS = ["gpt:1.3B", "gpt:6.7B", "gpt:39B", "moe:1.3B", "wide_resnet:1B"]
FULL_MESHES = ["2x8", "4x8", "8x8"]
# (microbatch size, microbatches) per family in the full set: Alpa's global batches (GPT and
# MoE 1024 sequences, Wide-ResNet 1536 images); the quick set uses 8 x 8.
FULL_BATCH = {"gpt": (8, 128), "moe": (8, 128), "wide_resnet": (16, 96)}
QUICK_BATCH = (8, 8)
HAND = ("data", "megatron", "data+megatron")


def capture(model: str, batch: int, ir_cache: str | None = None):
    """The model's training step with Adam, and the capture's wall seconds. With `ir_cache`
    (a folder), the IR text is kept there and read back next time instead of capturing."""
    name, _, preset = model.partition(":")
    kept = Path(ir_cache) / f"{name}-{preset}-b{batch}.gpir" if ir_cache else None
    start = time.perf_counter()
    if kept is not None and kept.exists():
        graph = next(iter(parse_program(kept.read_text())))
        return graph, time.perf_counter() - start
    ex = get_model(name, preset or "tiny", device="meta", train=True)
    inputs, targets = example_batch(name, ex.config, batch)
    graph = capture_training(ex.module, inputs, ex.loss_fn, targets, optimizer=Adam(lr=1e-4),
                             name=name).graph
    seconds = time.perf_counter() - start
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(print_graph(graph, show_source=True))
    return graph, seconds


def shape_index(shapes, devices: int) -> int | None:
    return next((i for i, (n, m) in enumerate(shapes) if n * m == devices), None)


KINDS = ("two-level", "two-level+hand", "intra-op only", "inter-op only", "equal layer",
         "equal operator", "megatron")


def run_variants(graph, mesh: str, microbatches: int, cluster, kinds=KINDS,
                 power_of_two_hosts: bool = False) -> list[dict]:
    """A row per variant of the `kinds` asked for (the two-level search always runs: the
    others use its layers)."""
    hosts, per_host = (int(x) for x in mesh.split("x"))
    devices = hosts * per_host
    shapes = submesh_shapes(hosts, per_host, power_of_two_hosts)
    cache: dict = {}
    rows = []

    def record(variant: str, run, **extra):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            search = run()
        except GraphparError as error:
            rows.append({"variant": variant, "error": str(error),
                         "search_s": round(time.perf_counter() - start, 2),
                         "search_cpu_s": round(time.process_time() - cpu, 2), **extra})
            return None
        plan = search.plan
        rows.append({
            "variant": variant, "est_step_s": plan.est_step_seconds,
            "stages": [{"layers": [s.layers[0], s.layers[-1]], "submesh": list(s.submesh),
                        "logical_mesh": list(s.logical_mesh), "family": f or "ilp",
                        "est_s": s.est_seconds, "mem_gib": round(s.mem_bytes / 2**30, 2)}
                       for s, f in zip(plan.stages, search.stage_families)],
            "clustering": search.clustering,
            "ilp_solves": plan.ilp_solves, "search_s": round(time.perf_counter() - start, 2),
            "steps_s": {k: round(v, 3) for k, v in search.seconds.items()},
            "search_cpu_s": round(time.process_time() - cpu, 2), **extra})
        return search

    # epsilon 0: exact, so that variants compare without the DP's tolerance
    common = dict(cluster=cluster, microbatches=microbatches, cache=cache, epsilon=0.0,
                  power_of_two_hosts=power_of_two_hosts)
    two = record("two-level", lambda: slice_stages(graph, mesh, **common))
    if two is None:
        return rows
    # the baselines' layers are Eq. 6's (the two-level plan's may be a finer clustering)
    forward_set, _, _ = forward_backward_optimizer(graph)
    forward = [n for n in graph.nodes if n in forward_set]
    layers = len(regular_bounds(graph, forward, default_layer_count(forward)))
    if "two-level+hand" in kinds:
        record("two-level+hand", lambda: slice_stages(graph, mesh, families=(None, *HAND),
                                                       **common))
    whole = shape_index(shapes, devices)
    if "intra-op only" in kinds:
        record("intra-op only", lambda: slice_stages(
            graph, mesh, fixed=[(0, layers - 1, whole)], **common))
    if "inter-op only" in kinds:
        record("inter-op only", lambda: slice_stages(
            graph, mesh, families=("data",), logical=lambda s: [(s[0] * s[1], 1)], **common))
    for stages in range(2, min(layers, devices) + 1) if "equal layer" in kinds else ():
        m = shape_index(shapes, devices // stages)
        if devices % stages or m is None:
            continue
        fixed = [(a, b, m) for a, b in equal_ranges(layers, stages)]
        record(f"equal layer S={stages}",
               lambda f=fixed: slice_stages(graph, mesh, fixed=f, **common))
    if "equal operator" in kinds:
        record("equal operator", lambda: slice_stages(
            graph, mesh, forward_layers=equal_ranges(len(forward), layers), **common))
    for pp in range(1, min(layers, devices) + 1) if "megatron" in kinds else ():
        m = shape_index(shapes, devices // pp)
        if devices % pp or m is None:
            continue
        fixed = [(a, b, m) for a, b in equal_ranges(layers, pp)]
        for tp in (1, 2, 4, 8):
            if (devices // pp) % tp or tp > per_host:
                continue
            dp = devices // pp // tp
            family = "data" if tp == 1 else ("megatron" if dp == 1 else "data+megatron")
            record(f"megatron dp={dp} tp={tp} pp={pp}", lambda f=fixed, d=dp, t=tp, fam=family:
                   slice_stages(graph, mesh, fixed=f, families=(fam,),
                                logical=lambda s: [(d, t)] if s[0] * s[1] == d * t else [],
                                **common))
    return rows


def summarize(rows: list[dict]) -> dict[str, float]:
    """The best estimated step of each kind of variant."""
    best: dict[str, float] = {}
    for row in rows:
        if "est_step_s" not in row:
            continue
        kind = row["variant"].split(" S=")[0].split(" dp=")[0]
        best[kind] = min(best.get(kind, float("inf")), row["est_step_s"])
    return best


BASELINES = ("intra-op only", "inter-op only", "equal layer", "equal operator", "megatron")


def beaten_by(best: dict[str, float], plan: str = "two-level+hand") -> list[str]:
    """The variants whose best step is faster than `plan`'s (beyond rounding): empty when the
    two-level plan is never worse."""
    if plan not in best:
        return []
    return [k for k in (*BASELINES, "two-level") if k in best and k != plan
            and best[k] < best[plan] * (1 - 1e-9)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="the issue's set: GPT 1.3B/6.7B/39B, MoE 1.3B, Wide-ResNet 1B on "
                        "2x8, 4x8, 8x8 (hours on 2 cores)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models on 1x4 (the default; a smoke test)")
    parser.add_argument("--models", help="comma-separated model:preset (overrides the set)")
    parser.add_argument("--meshes", help="comma-separated hosts x devices per host")
    parser.add_argument("--batch", type=int, help="microbatch size (default: per family)")
    parser.add_argument("--microbatches", type=int, help="B (default: per family)")
    parser.add_argument("--cluster", default="dgx-a100")
    parser.add_argument("--ir-cache", help="a folder keeping captured IR between runs")
    parser.add_argument("--power-of-two-hosts", action="store_true",
                        help="multi-host sub-meshes of 2, 4, 8, ... hosts only")
    parser.add_argument("--variants", default=",".join(KINDS),
                        help="which to run (two-level alone: its compile time)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--markdown", action="store_true",
                        help="print --out's results as docs/stage-slicing.md's table; run nothing")
    parser.add_argument("--append", action="store_true",
                        help="merge into --out: a model and mesh run before keeps the "
                        "variants not run again")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text())["results"]))
        return 0
    models = args.models.split(",") if args.models else (
        FULL_MODELS if args.full else QUICK_MODELS)
    meshes = args.meshes.split(",") if args.meshes else (
        FULL_MESHES if args.full else QUICK_MESHES)
    cluster = get_cluster(args.cluster)
    out = Path(args.out)
    results = []
    if args.append and out.exists():
        results = json.loads(out.read_text()).get("results", [])
    kinds = tuple(k for k in KINDS if k in args.variants.split(","))
    header = f"{'model':<18}{'mesh':<6}{'B':>5}" + "".join(f"{k:>16}" for k in kinds) + \
        f"{'never worse':>26}{'solves':>8}{'cpu s':>8}{'wall s':>8}"
    print("estimated step milliseconds (lower is better; ESTIMATED, dgx-a100); never worse: "
          "two-level+hand <= every other variant; solves, cpu s, wall s: the two-level "
          "search's ILP solves and its measured CPU and wall seconds")
    print(header)
    print("-" * len(header))
    for model in models:
        family, _, preset = model.partition(":")
        batch, microbatches = QUICK_BATCH if preset in ("", "tiny") else FULL_BATCH.get(
            family, QUICK_BATCH)
        batch, microbatches = args.batch or batch, args.microbatches or microbatches
        graph, capture_s = capture(model, batch, args.ir_cache)
        for mesh in meshes:
            rows = run_variants(graph, mesh, microbatches, cluster, kinds,
                                args.power_of_two_hosts)
            kept = next((r for r in results if (r["model"], r["mesh"]) == (model, mesh)
                         and r.get("microbatches") == microbatches), None)
            if kept is not None:  # --append: variants run before stay, unless run again
                ran = {r["variant"] for r in rows}
                rows = [r for r in kept["rows"] if r["variant"] not in ran] + rows
            best = summarize(rows)
            two = next((r for r in rows if r["variant"] == "two-level" and "est_step_s" in r),
                       {})
            beaten = beaten_by(best)
            entry = {"model": model, "mesh": mesh, "nodes": len(graph),
                     "microbatch_size": batch, "microbatches": microbatches,
                     "power_of_two_hosts": args.power_of_two_hosts,
                     "capture_s": round(capture_s, 2), "best": best,
                     "never_worse": not beaten if "two-level+hand" in best else None,
                     "beaten_by": beaten,
                     "two_level_ilp_solves": two.get("ilp_solves"),
                     "two_level_cpu_s": two.get("search_cpu_s"),
                     "two_level_wall_s": two.get("search_s"), "rows": rows,
                     "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
            results = [r for r in results if (r["model"], r["mesh"]) != (model, mesh)]
            results.append(entry)
            verdict = ("yes" if not beaten else "NO: " + ",".join(beaten)) \
                if "two-level+hand" in best else "-"
            print(f"{model:<18}{mesh:<6}{microbatches:>5}" + "".join(
                f"{best[k] * 1e3:>16.3f}" if k in best else f"{'-':>16}" for k in kinds)
                + f"{verdict:>26}{two.get('ilp_solves', '-'):>8}"
                + f"{two.get('search_cpu_s', '-'):>8}{two.get('search_s', '-'):>8}", flush=True)
            out.write_text(json.dumps(_document(args, results), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def markdown(results: list[dict]) -> str:
    """The results as a Markdown table: estimated step milliseconds per kind of variant (the
    best of its rows, with its S or grid point), "does not fit" where every row of the kind
    ran out of memory, "not run" where none ran."""
    head = ["model", "mesh", "mb x B", *KINDS, "never worse", "layers", "solves",
            "search CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["model"], r["mesh"], f"{r['microbatch_size']} x {r['microbatches']}"]
        for kind in KINDS:
            mine = [row for row in r["rows"]
                    if row["variant"].split(" S=")[0].split(" dp=")[0] == kind]
            done = [row for row in mine if "est_step_s" in row]
            if done:
                row = min(done, key=lambda row: row["est_step_s"])
                what = row["variant"][len(kind):].strip()  # "S=4", "dp=2 tp=4 pp=2"
                if what.startswith("dp="):
                    what = what.replace("=", " ").replace(" tp", ", tp").replace(" pp", ", pp")
                cell = f"{row['est_step_s'] * 1e3:,.{3 if row['est_step_s'] < 1 else 0}f}"
                cells.append(cell + (f" ({what})" if what else ""))
            else:
                cells.append("does not fit" if mine else "not run")
        two = next((row for row in r["rows"] if row["variant"] == "two-level"), {})
        verdict = r.get("never_worse")
        cells += ["yes" if verdict else "-" if verdict is None else
                  "no: " + ", ".join(r["beaten_by"]),
                  two.get("clustering", "-") if "est_step_s" in two else "-",
                  str(r.get("two_level_ilp_solves") or "-"),
                  f"{r['two_level_cpu_s']:.1f}" if r.get("two_level_cpu_s") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _document(args, results) -> dict:
    return {"benchmark": "pipeline",
            "units": "est_step_s, est_s: seconds ESTIMATED by the cost model (dgx-a100); "
                     "search_s, capture_s: measured wall seconds; search_cpu_s: CPU seconds",
            "settings": {"cluster": args.cluster,
                         "microbatch_size, microbatches": "per result",
                         "logical_meshes": "(d/mp, mp), mp = 1, 2, 4, ... up to the devices "
                         "per host; "
                         f"e.g. 1x8: {logical_meshes((1, 8))}"},
            "machine": {"cpu": cpu_model(), "cpu_count": torch.get_num_threads(),
                        "python": sys.version.split()[0], "torch": torch.__version__,
                        "platform": platform.platform()},
            "results": results}


if __name__ == "__main__":
    sys.exit(main())
