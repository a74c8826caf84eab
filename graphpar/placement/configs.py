"""Parallel configurations of a model on a device group, from graphpar's own passes (AlpaServe
§4.1, inference only, no data parallelism inside a group):

1. capture the model's forward pass at the serving dtype (weightless, on meta) and cluster its
   ops into layers with the pipeline pass's clustering (`passes.pipeline.clustering`);
2. cost every layer range as one stage on a k-device sub-mesh with the auto-shard ILP, as
   `slice-stages` does (`passes.pipeline.slice_stages.ServingStages`): one ILP solve per
   (layer structure, logical mesh), shared between models of the same shape; a range costs
   its layers' ILP objectives (compute + the collectives of their plans), the resharding
   between their plans, and, before the last stage, the send of its boundary activation;
3. S pipeline stages × k intra-op: the serving DP F(s, j) = min_i max{F(s−1, i−1),
   cost(i..j)} picks the stage boundaries that minimise the slowest stage.

When the ILP is unavailable (no solver, or a layer it cannot plan on one device) the profile
says so in `pricing` and configurations fall back to an estimate: a layer's compute time on one
device (the roofline of `graphpar.cost.compute`), divided by k, plus one all-reduce of its
output (Megatron-style).

Every latency here is an estimate (seconds); configurations are cached per (model shape,
group size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from graphpar.errors import GraphparError, PlacementSpecError

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# ILP solves shared by every profile: keyed by layer structure and mesh, so models of one
# shape (and the repeated layers of one model) are solved once per logical mesh
_ILP_SOLVES: dict = {}


@dataclass(frozen=True)
class LayerProfile:
    """A model as placement sees it: per layer (seconds on one device, weight bytes, bytes
    of the activation it passes on), all estimates. `pricing` says how its configurations are
    costed: "ilp" (the auto-shard ILP per stage and sub-mesh, through `stages`) or
    "estimate: <why the ILP is unavailable>" (the Megatron-style fallback)."""

    name: str
    seconds: tuple[float, ...]
    weight_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    pricing: str = "estimate"
    stages: object = field(default=None, compare=False, repr=False)  # ServingStages or None

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
def _stage_dp(cost, stages):
    """F[s, k]: the least slowest-stage latency of layers 0..k-1 in s stages, where layers
    i..j as one stage take cost[i, j]; `cut[s, k]` the first layer of the last stage."""
    n = cost.shape[0]
    f = np.full((stages + 1, n + 1), np.inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    f[0, 0] = 0.0
    for s in range(1, stages + 1):
        for k in range(s, n + 1):
            for i in range(s - 1, k):
                v = max(f[s - 1, i], cost[i, k - 1])
                if v < f[s, k]:
                    f[s, k], cut[s, k] = v, i
    return f, cut


def stage_bounds(costs: np.ndarray, stages: int) -> list[tuple[int, int]]:
    """The serving DP's stages as (first layer, end) ranges minimising the slowest stage.
    `costs` is per-layer seconds (a stage takes the sum of its layers) or an [L, L] table of
    each range i..j as one stage."""
    cost = np.asarray(costs, dtype=np.float64)
    if cost.ndim == 1:
        prefix = np.concatenate([[0.0], np.cumsum(cost)])
        cost = prefix[None, 1:] - prefix[:-1, None]  # cost[i, j]: layers i..j
    _, cut = _stage_dp(cost, stages)
    bounds, end = [], cost.shape[0]
    for s in range(stages, 0, -1):
        first = int(cut[s, end])
        bounds.append((first, end))
        end = first
    return bounds[::-1]


def _intra_degrees(devices: int, layers: int) -> list[int]:
    """Intra-op degrees k (powers of two) of a group: k divides it, devices / k ≤ layers."""
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if devices % k == 0 and devices // k <= layers]


def configs_for(profile: LayerProfile, devices: int, cluster: str = "dgx-a100"
                ) -> list[ParallelConfig]:
    """Every (stages × intra-op degree) = `devices` configuration of `profile`, stages no more
    than its layers, intra-op degrees powers of two; priced by the ILP when the profile
    carries its stages (on the cluster it was profiled for), else estimated on `cluster`."""
    if profile.stages is not None:
        return _ilp_configs(profile, devices)
    return _estimated_configs(profile, devices, cluster)


@functools.cache
def _ilp_configs(profile: LayerProfile, devices: int) -> list[ParallelConfig]:
    stages = profile.stages
    per_host = stages.cluster.devices_per_node
    out = []
    for intra in _intra_degrees(devices, len(profile.seconds)):
        if intra > per_host and intra % per_host:
            continue
        shape = (1, intra) if intra <= per_host else (intra // per_host, per_host)
        seconds, weights = _ilp_ranges(profile, shape, devices <= per_host)
        bounds = stage_bounds(seconds, devices // intra)
        lat = tuple(float(seconds[a, b - 1]) for a, b in bounds)
        if not np.isfinite(lat).all():
            continue  # some layer has no plan on this sub-mesh
        mem = max(float(weights[a, b - 1]) for a, b in bounds)
        out.append(ParallelConfig(devices // intra, intra, lat, mem))
    return out


@functools.cache
def _ilp_ranges(profile: LayerProfile, shape: tuple[int, int], one_host: bool):
    # a stage's send goes over intra-node links when the whole group sits on one host, else
    # over its share of the NICs (which does not depend on how many hosts beyond one)
    return profile.stages.ranges(shape, 1 if one_host else 2)


def _estimated_configs(profile: LayerProfile, devices: int, cluster: str
                       ) -> list[ParallelConfig]:
    """The fallback without the ILP: intra-op degree k divides a layer's time and weights by
    k and adds one all-reduce of its output (Megatron-style); a stage adds the send of its
    boundary activation."""
    from graphpar.cost.cluster import mesh_for
    from graphpar.cost.communication import all_reduce_cost, send_recv_cost

    out = []
    for intra in _intra_degrees(devices, len(profile.seconds)):
        stages = devices // intra
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
                    batch_size: int = 1, ilp: bool = True) -> LayerProfile:
    """The layer profile of a bundled model (`gpt:1.3B`, `bert:large`), captured on meta."""
    from graphpar.models import get_model

    name, _, preset = example.partition(":")
    try:
        model = get_model(name, preset or "tiny", batch_size=batch_size, device="meta")
    except (KeyError, ValueError) as exc:
        raise PlacementSpecError(f"model example {example!r}: {exc}") from None
    return profile_module(example, model.module, model.inputs, dtype, cluster, ilp)


@functools.cache
def example_weight_bytes(example: str, dtype: str = "fp16") -> float:
    """Bytes of a bundled model's parameters and buffers at `dtype`, from a meta build: what
    must fit before it is worth capturing and pricing it."""
    from graphpar.models import get_model

    name, _, preset = example.partition(":")
    try:
        model = get_model(name, preset or "tiny", device="meta")
    except (KeyError, ValueError) as exc:
        raise PlacementSpecError(f"model example {example!r}: {exc}") from None
    return weight_bytes(model.module, dtype)


def weight_bytes(module, dtype: str = "fp16") -> float:
    """Bytes of `module`'s parameters and buffers at `dtype` (floating ones; others as they
    are)."""
    total = 0.0
    for t in [*module.parameters(), *module.buffers()]:
        total += t.numel() * (DTYPE_BYTES.get(dtype, 4) if t.is_floating_point()
                              else t.element_size())
    return total


def profile_file(path: str, dtype: str = "fp16", cluster: str = "dgx-a100",
                 ilp: bool = True, check=None) -> LayerProfile:
    """The layer profile of a model file defining build(), as `graphpar compile` reads it;
    `check(module)` runs once it is built, before it is captured."""
    from graphpar.compiler.model_file import load_model_file

    spec = load_model_file(path, weights=False)  # planning: built on meta
    if check is not None:
        check(spec.module)
    return profile_module(spec.name, spec.module, spec.inputs, dtype, cluster, ilp)


def profile_module(name: str, module, inputs, dtype: str = "fp16",
                   cluster: str = "dgx-a100", ilp: bool = True) -> LayerProfile:
    """Capture `module` for inference at `dtype` and cost its layers (see the module
    docstring); `ilp=False` takes the estimate without trying the ILP."""
    import torch

    from graphpar.capture import capture_inference
    from graphpar.cost.cluster import get_cluster, mesh_for
    from graphpar.cost.compute import Roofline, node_seconds
    from graphpar.ir.graph import Role
    from graphpar.passes.pipeline.clustering import (
        cluster_bounds,
        default_layer_count,
        forward_chain,
    )
    from graphpar.passes.pipeline.slice_stages import ServingStages

    if dtype not in DTYPE_BYTES:
        raise PlacementSpecError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    module = module.eval().to(torch_dtype)
    inputs = tuple(x.to(torch_dtype) if torch.is_tensor(x) and x.is_floating_point() else x
                   for x in inputs)
    graph = capture_inference(module, inputs).graph
    nodes = list(graph.nodes)
    stages, pricing, ilp_seconds = None, "estimate: not asked for the ILP", None
    if ilp:
        try:
            stages = ServingStages(graph, cluster, dtype, cache=_ILP_SOLVES)
            ilp_seconds = stages.layer_seconds(mesh_for((1, 1), cluster))
            if not np.isfinite(ilp_seconds).all():
                raise GraphparError("a layer has no plan on one device")
            pricing = "ilp"
        except (ImportError, GraphparError) as exc:
            stages, pricing = None, f"estimate: the auto-shard ILP is unavailable ({exc})"
    if stages is not None:
        bounds = stages.layers
    else:
        bounds = cluster_bounds(forward_chain(nodes), default_layer_count(nodes))
    roof = Roofline.of(get_cluster(cluster), dtype)
    # weights and activations at the serving dtype, whatever the capture's dtype
    scale = lambda t: t.nbytes / t.itemsize * DTYPE_BYTES[dtype]  # noqa: E731
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
        seconds.append(max(sum(node_seconds(n, roof, torch_dtype) for n in layer), 1e-12))
        weights.append(w)
        outs.append(float(max((scale(o.type) for o in layer[-1].outputs), default=0.0)))
    if ilp_seconds is not None:
        seconds = [float(t) for t in ilp_seconds]
    return LayerProfile(name, tuple(seconds), tuple(weights), tuple(outs), pricing, stages)
