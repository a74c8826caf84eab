"""Parallel configurations of a model on a device group, from graphpar's own passes and cost
model (AlpaServe §4.1, inference only, no data parallelism inside a group):

1. capture the model's forward pass (weightless, on meta) and cluster its ops into layers
   with the pipeline pass's clustering (`passes.pipeline.layers`);
2. per layer, its compute time on one device (the roofline of `graphpar.cost.compute` over
   the cluster's achieved rates at the serving dtype, the cost the auto-shard ILP charges),
   its weight bytes, and the bytes it hands the next layer;
3. intra-op degree k (Megatron-style operator sharding inside a stage): a layer runs in
   time/k plus one all-reduce of its output over the k devices (the cost model's alpha-beta
   all-reduce), and holds 1/k of its weights;
4. S pipeline stages: the serving DP F(s,k) = min_i max{F(s−1,i−1), latency(i,k)} picks the
   stage boundaries that minimise the slowest stage; a stage sends its output to the next
   (the cost model's send/recv).

Every latency here is an estimate (seconds); configurations are cached per (model, dtype,
cluster, group size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.errors import PlacementSpecError

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class LayerProfile:
    """A model as placement sees it: per layer (seconds on one device, weight bytes, bytes
    of the activation it passes on), all estimates."""

    name: str
    seconds: tuple[float, ...]
    weight_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]

    @property
    def latency(self) -> float:
        """Single-device latency (seconds, estimated): what `slo: {scale: x}` multiplies."""
        return float(sum(self.seconds))

    @property
    def weights(self) -> float:
        return float(sum(self.weight_bytes))


@dataclass(frozen=True)
class ParallelConfig:
    """One way to run a model on a group: `stages` × `intra` devices, the latency of each
    stage (seconds, estimated) and the weight bytes each device holds (the largest stage's)."""

    stages: int
    intra: int
    stage_latency: tuple[float, ...]
    weight_bytes_per_device: float

    @property
    def devices(self) -> int:
        return self.stages * self.intra

    @property
    def label(self) -> str:
        return f"{self.stages}x{self.intra}"


@njit(cache=True)
def _stage_dp(t, stages):
    """F[s, k]: the least slowest-stage latency of layers 0..k-1 in s stages; `cut[s, k]` the
    first layer of the last stage."""
    n = t.size
    prefix = np.zeros(n + 1)
    for i in range(n):
        prefix[i + 1] = prefix[i] + t[i]
    f = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    f[0, 0] = 0.0
    for s in range(1, stages + 1):
        for k in range(s, n + 1):
            for i in range(s - 1, k):
                v = max(f[s - 1, i], prefix[k] - prefix[i])
                if v < f[s, k]:
                    f[s, k], cut[s, k] = v, i
    return f, cut


def stage_bounds(layer_seconds: np.ndarray, stages: int) -> list[tuple[int, int]]:
    """The serving DP's stages as (first layer, end) ranges minimising the slowest stage."""
    _, cut = _stage_dp(np.asarray(layer_seconds, dtype=np.float64), stages)
    bounds, end = [], layer_seconds.size
    for s in range(stages, 0, -1):
        first = int(cut[s, end])
        bounds.append((first, end))
        end = first
    return bounds[::-1]


def configs_for(profile: LayerProfile, devices: int, cluster: str = "dgx-a100"
                ) -> list[ParallelConfig]:
    """Every (stages × intra-op degree) = `devices` configuration of `profile`, stages no more
    than its layers, intra-op degrees powers of two."""
    from graphpar.cost.cluster import mesh_for
    from graphpar.cost.communication import all_reduce_cost, send_recv_cost

    out = []
    layers = len(profile.seconds)
    for intra in [k for k in (1, 2, 4, 8, 16, 32, 64) if devices % k == 0]:
        stages = devices // intra
        if stages > layers:
            continue
        seconds = np.array(profile.seconds) / intra
        if intra > 1:
            mesh = mesh_for([intra], cluster)
            seconds += [all_reduce_cost(b, mesh, 0).seconds for b in profile.out_bytes]
        bounds = stage_bounds(seconds, stages)
        lat, mem = [], []
        pair = mesh_for([2], cluster) if stages > 1 else None
        for s, (a, b) in enumerate(bounds):
            t = float(seconds[a:b].sum())
            if s + 1 < stages:
                t += send_recv_cost(profile.out_bytes[b - 1] / intra, pair, 0).seconds
            lat.append(t)
            mem.append(sum(profile.weight_bytes[a:b]) / intra)
        out.append(ParallelConfig(stages, intra, tuple(lat), float(max(mem))))
    return out


@functools.cache
def profile_example(example: str, dtype: str = "fp16", cluster: str = "dgx-a100",
                    batch_size: int = 1) -> LayerProfile:
    """The layer profile of a bundled model (`gpt:1.3B`, `bert:large`), captured on meta."""
    from graphpar.models import get_model

    name, _, preset = example.partition(":")
    try:
        model = get_model(name, preset or "tiny", batch_size=batch_size, device="meta")
    except (KeyError, ValueError) as exc:
        raise PlacementSpecError(f"model example {example!r}: {exc}") from None
    return profile_module(example, model.module, model.inputs, dtype, cluster)


def profile_file(path: str, dtype: str = "fp16", cluster: str = "dgx-a100") -> LayerProfile:
    """The layer profile of a model file defining build(), as `graphpar compile` reads it."""
    from graphpar.model_file import load_model_file

    spec = load_model_file(path)
    return profile_module(spec.name, spec.module, spec.inputs, dtype, cluster)


def profile_module(name: str, module, inputs, dtype: str = "fp16",
                   cluster: str = "dgx-a100") -> LayerProfile:
    """Capture `module` for inference and cost its layers (see the module docstring)."""
    import torch

    from graphpar.capture import capture_inference
    from graphpar.cost.cluster import get_cluster
    from graphpar.cost.compute import Roofline, node_seconds
    from graphpar.ir.graph import Role
    from graphpar.passes.pipeline.layers import cluster_bounds, default_layer_count, forward_chain

    if dtype not in DTYPE_BYTES:
        raise PlacementSpecError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    module.eval()
    graph = capture_inference(module, tuple(inputs)).graph
    nodes = list(graph.nodes)
    chain = forward_chain(nodes)
    bounds = cluster_bounds(chain, default_layer_count(nodes))
    roof = Roofline.of(get_cluster(cluster), dtype)
    # weights and activations at the serving dtype, whatever the capture's dtype
    scale = lambda t: t.nbytes / t.itemsize * DTYPE_BYTES[dtype]  # noqa: E731
    serving = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    seen: set = set()
    seconds, weights, outs = [], [], []
    for first, last in bounds:
        layer = nodes[first:last + 1]
        w = 0.0
        for node in layer:
            for v in node.inputs:
                if getattr(v, "role", None) in (Role.PARAM, Role.BUFFER) and v not in seen:
                    seen.add(v)
                    w += scale(v.type)
        seconds.append(max(sum(node_seconds(n, roof, serving) for n in layer), 1e-12))
        weights.append(w)
        outs.append(float(max((scale(o.type) for o in layer[-1].outputs), default=0.0)))
    return LayerProfile(name, tuple(seconds), tuple(weights), tuple(outs))
