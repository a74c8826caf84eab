"""The `slice-tokens` pass (TeraPipe): cut a causal LM's sequence into token slices that flow
through the pipeline stages one after another, and record them in the graph's attrs
(`token_slices=[l1, ...]`, summing to the sequence length, and `batch_slices=[b1, ...]`, the
microbatches' sizes, summing to the batch).

After `slice-stages` it slices for that stage plan: each stage's latency model counts the
causal attention layers it holds, split over its logical mesh (tensor parallelism), scaled so
that a whole sequence costs what the plan estimated for the stage, and the pipeline is priced
by its slowest stage (`token_slicing` assumes identical stages). Without a
stage plan it assumes `stages` identical stages of equal layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from graphpar.cost.cluster import get_cluster
from graphpar.cost.compute import Roofline
from graphpar.errors import PassError, UsageError
from graphpar.ir.cluster import Cluster
from graphpar.ir.graph import Graph, Node
from graphpar.ir.verify import describe
from graphpar.passes.attention_mask import mask_reaches, scores_reaches
from graphpar.passes.eager_attention import eager_attention
from graphpar.passes.manager import GraphPass, PassContext, register_pass
from graphpar.passes.pipeline.plan import StagePlan
from graphpar.passes.pipeline.token_slicing import (
    TokenLatency,
    TokenSlicing,
    pipeline_seconds,
    solve_token_slices,
    transformer_latency,
)

ATTENTION = ("attention", "attention_with_lse")  # forward attention ops


@register_pass("slice-tokens")
@dataclass
class SliceTokens(GraphPass):
    """Slice a causal LM's sequence into token slices (TeraPipe). `slices` 0: the DP's best;
    N: N slices as equal as the granularity allows. Records `token_slices` and `batch_slices`
    in the graph's attrs and sets a `TokenSlicing` result (with the step's estimate unsliced).
    The latency model is `transformer_latency` on the cluster, with the hidden size, heads and
    layers read off the graph's causal attention (the MLP's width is an option)."""

    seq_len: int = 0  # 0: the causal attention's sequence length
    stages: int = 2  # without a stage plan
    microbatches: int = 1  # without a stage plan
    slices: int = 0  # 0: the DP chooses
    granularity: int = 1
    epsilon: float = 0.0  # seconds
    cluster: Cluster | str = "dgx-a100"  # a preset or cluster file, or a `Cluster`
    dtype: str = "fp32"
    ffn: int = 0  # the MLP's width; 0: 4 x hidden (GPT)

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "granularity"):
            if getattr(self, name) < 1:
                raise PassError(f"{name}={getattr(self, name)}: give at least 1")
        if self.slices < 0:
            raise PassError(f"slices={self.slices}: give 0 (the DP chooses) or a number of "
                            "slices")
        if self.epsilon < 0:
            raise PassError(f"epsilon={self.epsilon}: give a number >= 0 (seconds)")
        get_cluster(self.cluster).peak_flops(self.dtype)

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        plan = ctx.result(StagePlan)
        attention = causal_attention(graph, ctx.options.get("constants"))
        stages = len(plan.stages) or self.stages
        microbatches = plan.microbatches if plan.stages else self.microbatches
        latency = self.latency_of(graph, attention, plan)
        seq_len = latency.seq_len
        if self.slices > seq_len // self.granularity:
            raise PassError(f"slices={self.slices}: the sequence has only {seq_len} tokens"
                            + (f" ({seq_len // self.granularity} slices of granularity "
                               f"{self.granularity})" if self.granularity > 1 else "")
                            + "; give fewer slices")
        if self.slices:
            units = seq_len // self.granularity
            sizes = [(units // self.slices + (i < units % self.slices)) * self.granularity
                     for i in range(self.slices)]
            result = TokenSlicing(tuple(sizes), pipeline_seconds(latency, sizes, stages,
                                                                 microbatches))
        else:
            result = solve_token_slices(latency, stages, self.granularity, self.epsilon,
                                        repeats=microbatches)
        batch = attention[0].shape[0]
        contexts = np.cumsum((0,) + result.slices[:-1])
        shares = tuple(latency(length, int(context)) / latency(seq_len, 0)
                       for length, context in zip(result.slices, contexts))
        result = dataclasses.replace(
            result, batch_slices=(batch,) * microbatches, slice_shares=shares,
            est_unsliced_seconds=pipeline_seconds(latency, [seq_len], stages, microbatches))
        graph.attrs["token_slices"] = result.slices
        graph.attrs["batch_slices"] = result.batch_slices
        ctx.set_result(result)
        return True

    def latency_of(self, graph: Graph, attention: list[Attention], plan: StagePlan
                   ) -> TokenLatency:
        """The slowest stage's latency model: per stage its causal layers, split over its
        logical mesh; without a plan `stages` stages of equal layers."""
        batch, heads, seq, head_dim = attention[0].shape
        seq_len = self.seq_len or seq
        if seq_len != seq:
            raise PassError(f"seq_len={self.seq_len} but the causal attention of graph "
                            f"@{graph.name} runs over {seq} tokens; leave seq_len out or give "
                            f"{seq}")
        if self.granularity > seq_len or seq_len % self.granularity:
            raise PassError(f"granularity={self.granularity} does not divide the sequence "
                            f"length {seq_len}; choose a divisor of it (e.g. 1 or 8)")
        if plan.stages:
            per_stage = [(sum(1 for a in attention if plan.stage_of.get(a.node) == k),
                          math.prod(stage.logical_mesh), stage.est_seconds)
                         for k, stage in enumerate(plan.stages)]
        else:
            layers = len(attention)
            if layers % self.stages:
                raise PassError(f"stages={self.stages} does not divide the {layers} attention "
                                f"layers of graph @{graph.name}; token slicing assumes "
                                "identical stages")
            per_stage = [(layers // self.stages, 1, None)] * self.stages
        hidden = heads * head_dim
        cluster = get_cluster(self.cluster)
        itemsize = 2 if self.dtype in ("fp16", "bf16") else 4
        models = []
        for layers, devices, stage_seconds in per_stage:
            if not layers:
                continue
            model = transformer_latency(
                seq_len, hidden, heads, self.ffn or 4 * hidden, layers,
                Roofline.of(cluster, self.dtype), itemsize=itemsize,
                send_bandwidth=cluster.intra_node_bandwidth,
                send_latency=cluster.intra_node_latency, batch=batch, tensor_parallel=devices,
                allreduce_bandwidth=cluster.intra_node_bandwidth,
                allreduce_latency=cluster.intra_node_latency)
            # The stage plan's estimate of the whole stage (every op, its sharding's
            # communication) sets the scale; transformer_latency the shape over (l, c).
            scale = stage_seconds / model(seq_len, 0) if stage_seconds else 1.0
            models.append((np.asarray(model.base) * scale, np.asarray(model.ctx) * scale))
        return TokenLatency(tuple(np.max([m[0] for m in models], axis=0).tolist()),
                            tuple(np.max([m[1] for m in models], axis=0).tolist()))


def slice_count(value: str | int | None, option: str = "token_slices=") -> int | None:
    """The token slices option (`--token-slices`, `token_slices=`): None (off), "auto" -> 0
    (the DP chooses), else a positive number of slices; a UsageError naming `option` if not."""
    if value is None:
        return None
    if str(value) == "auto":
        return 0
    if not (str(value).isdigit() and int(value) >= 1):
        raise UsageError(f"{option}{value}: give 'auto' or a number of slices")
    return int(value)


@dataclass(frozen=True)
class Attention:
    """One causal attention of the graph: an `attention` op, or the `softmax` of attention
    written out as ops (`eager_attention`); `shape` is (batch, heads, queries, head size)."""

    node: Node
    shape: tuple[int, int, int, int]


def causal_attention(graph: Graph, constants=None) -> list[Attention]:
    """The graph's forward attention, all causal: `attention` ops (`attention_mask.mask_reach`:
    the is_causal flag, or a mask whose position-only part hides every later key, whatever any
    padding from an input adds; sliding windows too) and attention written out as ops
    (`eager_attention`: what is added to q @ k^T hides every later key, whatever the product).
    `constants`: values of the graph's constant inputs by name (a mask buffer). Else a clear
    error naming the one that is not (a token there reads later tokens, so slicing the
    sequence would change the result)."""
    ops = [n for n in graph.nodes if n.op in ATTENTION]
    reaches = mask_reaches(graph, ops, constants)
    attention = [Attention(n, tuple(n.input_values[0].type.shape)) for n in ops]
    sites = eager_attention(graph)
    for site, reach in zip(sites, scores_reaches(graph, [(s.logits, s.scores) for s in sites],
                                                 constants)):
        reaches[site.softmax] = reach
        attention.append(Attention(site.softmax, site.shape))
    for node, reach in reaches.items():
        if not reach.causal:
            raise PassError(
                f"graph @{graph.name}: {describe(node, graph)} is not causal ({reach.why}): "
                "its tokens may attend to later tokens, so token slicing would change the "
                "result; slice-tokens needs a causal language model (is_causal=True, or a "
                "mask that hides every later key)")
    if not attention:
        raise PassError(
            f"graph @{graph.name} has no causal attention, so it has no sequence dimension "
            "to slice: slice-tokens needs a causal language model (attention with "
            "causal=True, e.g. is_causal=True in scaled_dot_product_attention, or a causal "
            "mask)")
    return attention
