"""Pipeline benchmark: the two-level plan (stage DP over the ILP) against one-level and hand
plans, all ESTIMATED by graphpar's cost model on a DGX-A100 cluster.

    python tools/bench/pipeline.py                                  # the default set
    python tools/bench/pipeline.py --models gpt:1.3B --meshes 2x8 --out results.json

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

Times of the search itself are measured wall-clock seconds on this machine (and CPU seconds:
the machine may be shared). Models are captured on the meta device (no weights allocated).
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

from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster
from graphpar.errors import GraphparError
from graphpar.ir.parser import parse_program
from graphpar.ir.printer import print_graph
from graphpar.models import example_batch, get_model
from graphpar.passes.pipeline.partition import forward_backward_optimizer
from graphpar.passes.pipeline.slice_stages import logical_meshes, slice_stages
from graphpar.passes.pipeline.stage_dp import submesh_shapes

DEFAULT_MODELS = ["gpt:1.3B", "gpt:6.7B", "gpt:39B", "moe:1.3B", "wide_resnet:1B"]
DEFAULT_MESHES = ["2x8", "4x8", "8x8"]
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


def equal_ranges(count: int, stages: int) -> list[tuple[int, int]]:
    edges = [round(i * count / stages) for i in range(stages + 1)]
    return [(a, b - 1) for a, b in zip(edges, edges[1:])]


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
    layers = len(two.forward_layers)
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
        forward, _, _ = forward_backward_optimizer(graph)
        ops = sum(1 for n in graph.nodes if n in forward)
        record("equal operator", lambda: slice_stages(
            graph, mesh, forward_layers=equal_ranges(ops, layers), **common))
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES))
    parser.add_argument("--batch", type=int, default=32, help="microbatch size")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--cluster", default="dgx-a100")
    parser.add_argument("--ir-cache", help="a folder keeping captured IR between runs")
    parser.add_argument("--power-of-two-hosts", action="store_true",
                        help="multi-host sub-meshes of 2, 4, 8, ... hosts only")
    parser.add_argument("--variants", default=",".join(KINDS),
                        help="which to run (two-level alone: its compile time)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)
    cluster = get_cluster(args.cluster)
    results = []
    kinds = KINDS
    header = f"{'model':<16}{'mesh':<6}" + "".join(f"{k:>16}" for k in kinds) + \
        f"{'solves':>8}{'search s':>10}"
    print("estimated step milliseconds (lower is better); search: measured wall seconds of "
          "the two-level search")
    print(header)
    print("-" * len(header))
    for model in args.models.split(","):
        graph, capture_s = capture(model, args.batch, args.ir_cache)
        for mesh in args.meshes.split(","):
            rows = run_variants(graph, mesh, args.microbatches, cluster,
                                tuple(args.variants.split(",")), args.power_of_two_hosts)
            best = summarize(rows)
            two = next((r for r in rows if r["variant"] == "two-level" and "est_step_s" in r),
                       {})
            results.append({"model": model, "mesh": mesh, "nodes": len(graph),
                            "capture_s": round(capture_s, 2), "best": best, "rows": rows,
                            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                            // 1024})
            print(f"{model:<16}{mesh:<6}" + "".join(
                f"{best[k] * 1e3:>16.3f}" if k in best else f"{'-':>16}" for k in kinds)
                + f"{two.get('ilp_solves', '-'):>8}{two.get('search_s', '-'):>10}", flush=True)
            Path(args.out).write_text(json.dumps(_document(args, results), indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _document(args, results) -> dict:
    return {"benchmark": "pipeline",
            "units": "est_step_s, est_s: seconds ESTIMATED by the cost model (dgx-a100); "
                     "search_s, capture_s: measured wall seconds; search_cpu_s: CPU seconds",
            "settings": {"microbatch_size": args.batch, "microbatches": args.microbatches,
                         "cluster": args.cluster,
                         "power_of_two_hosts": args.power_of_two_hosts,
                         "logical_meshes": "(d/mp, mp), mp = 1, 2, 4, ... up to the devices "
                         "per host; "
                         f"e.g. 1x8: {logical_meshes((1, 8))}"},
            "machine": {"cpu_count": torch.get_num_threads(), "python": sys.version.split()[0],
                        "torch": torch.__version__, "platform": platform.platform()},
            "results": results}


if __name__ == "__main__":
    sys.exit(main())
