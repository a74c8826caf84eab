"""CUDA lowering benchmark: per model and mesh, the listing's calls by kind, its generated
kernels, the planned arena per device against the live-bytes lower bound and against what
eager PyTorch's caching allocator would hold for the same program, and lowering time.

    python tools/bench/cuda_lowering.py                          # tiny models + GPT-1.3B on 2x4
    python tools/bench/cuda_lowering.py --quick                  # tiny models only
    python tools/bench/cuda_lowering.py --models gpt:1.3B --meshes 2x4 --mode infer

Models are captured without weights (on the meta device, as `graphpar compile --example`
does), auto-sharded on the mesh (DGX-A100 cluster, ILP time limit `--time-limit`), lowered to
device programs and then to one listing per device. Times are measured (wall clock of
`lower_to_listing` for all devices); arena bytes are planned, not measured. Writes a table and
`cuda_lowering.json` next to this file (or `--out`).

The eager column (`eager_allocator_peak_bytes`) is measured, on the CPU, for device 0's
program run op by op by the reference interpreter over fake tensors (no data; the shapes,
dtypes and aliasing of real ones): every storage an ATen op creates counts, rounded up to 512
bytes as the CUDA caching allocator rounds its blocks, from its creation until the last tensor
viewing it is dropped (the interpreter drops each value after its last use). Its peak is what
`torch.cuda.max_memory_allocated` would report for intermediates (graph inputs, as the
listing's state region, are not counted) if eager PyTorch ran the same device program. It does
not count what libraries allocate inside one op (cuBLAS/cuDNN workspaces, a convolution's
im2col), nor the allocator's cached-but-free segments (`memory_reserved`), which can only be
higher; no GPU was used.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphpar.backends.interpreter import Interpreter
from graphpar.cli.common import load_target
from graphpar.compiler.api import lower
from graphpar.compiler.driver import compile_model
from graphpar.ir.graph import Graph
from graphpar.passes import parse_pipeline
from graphpar.passes.autoshard import AutoShard
from graphpar.passes.lower_cuda import lower_to_listing

QUICK = [("mlp:tiny", "infer", "2"), ("mlp:tiny", "train", "2x2"), ("gpt:tiny", "infer", "2x2"),
         ("gpt:tiny", "train", "2x2"), ("llama:tiny", "infer", "2x2"),
         ("bert:tiny", "infer", "2x2"), ("moe:tiny", "train", "2x2"),
         ("wide_resnet:tiny", "train", "2x2")]
DEFAULT = QUICK + [("gpt:1.3B", "infer", "2x4"), ("gpt:1.3B", "train", "2x4")]


ALLOCATOR_BLOCK = 512  # the CUDA caching allocator rounds every block up to this many bytes


class _StorageBytes(TorchDispatchMode):
    """Live bytes of the storages ATen ops create (each counted once, rounded to the
    allocator's block) and their peak; a storage dies with the last tensor that views it."""

    def __init__(self, excluded: set[int]):
        super().__init__()
        self.excluded = excluded
        self.tensors: dict[int, int] = {}  # storage -> tensors alive that view it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.tensors[key] -= 1
        if self.tensors[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.tensors[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.excluded:
                continue
            if key not in self.tensors:
                self.tensors[key] = 0
                self.sizes[key] = -(-storage.nbytes() // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK
                self.live += self.sizes[key]
            self.tensors[key] += 1
            weakref.finalize(t, self._drop, key)
        self.peak = max(self.peak, self.live)
        return out


class _ShapeOnlyComm:
    """Answers a collective with uninitialized tensors of its result types: the bytes eager
    PyTorch would hold are the same whatever the data."""

    def execute(self, node, args, index=None):
        outs = [torch.empty(o.type.shape, dtype=o.type.dtype) for o in node.outputs]
        return outs[0] if len(outs) == 1 else outs


def eager_allocator_peak(graph: Graph) -> int:
    """Peak bytes eager PyTorch's caching allocator would hold for `graph`'s intermediates
    (see the module docstring for what is and is not counted)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = {v.name: torch.empty(v.type.shape, dtype=v.type.dtype) for v in graph.inputs}
        tracker = _StorageBytes({t.untyped_storage()._cdata for t in inputs.values()})
        interpreter = Interpreter(graph, _ShapeOnlyComm() if graph.mesh is not None else None)
        with tracker:
            interpreter.run(inputs)
    return tracker.peak


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
    start = time.perf_counter()
    eager = eager_allocator_peak(compiled.spmd)
    eager_seconds = time.perf_counter() - start
    return {
        "model": model, "mode": mode, "mesh": mesh,
        "nodes": len(compiled.spmd.nodes),
        "calls_by_kind_rank0": listings[0].calls_by_kind(),
        "calls_rank0": len(listings[0].calls),
        "generated_kernels": len({k for x in listings for k in x.kernels()}),
        "arena_bytes_planned": planned, "arena_lower_bound_bytes": bound,
        "state_bytes": [x.state_bytes for x in listings],
        "worst_planned_over_bound": max(p / max(b, 1) for p, b in zip(planned, bound)),
        "eager_allocator_peak_bytes": eager,
        "planned_over_eager_rank0": planned[0] / max(eager, 1),
        "eager_peak_seconds_measured": round(eager_seconds, 3),
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
          f"{'arena MiB':>10} {'bound MiB':>10} {'ratio':>6} {'eager MiB':>10} {'lower s':>8}")
    for model, mode, mesh in cases:
        row = measure(model, mode, mesh, args.time_limit)
        rows.append(row)
        print(f"{model:<12} {mode:<5} {mesh:<5} {row['calls_rank0']:>6} "
              f"{row['generated_kernels']:>7} {max(row['arena_bytes_planned']) / 2**20:>10.2f} "
              f"{max(row['arena_lower_bound_bytes']) / 2**20:>10.2f} "
              f"{row['worst_planned_over_bound']:>6.3f} "
              f"{row['eager_allocator_peak_bytes'] / 2**20:>10.2f} "
              f"{row['lowering_seconds_measured']:>8.2f}",
              flush=True)
    Path(args.out).write_text(json.dumps({"machine": platform.platform(), "rows": rows},
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
