"""The `paged-attention` pass: causal attention over an explicit KV cache becomes
`reshape_and_cache` + `paged_attention` over a cache of fixed-size blocks and a block table.

It rewrites the graphs of :mod:`graphpar.capture.decoder` (and any inference graph whose
attention is causal self-attention):

* prefill, ``attention(q, k, v) {causal}``: the new K/V are written into the paged cache and the
  queries attend through the block table (``mode=prefill``: each sequence's new tokens see its
  cached context and, causally, each other);
* decode, ``attention(q, cat(%past_key, k), cat(%past_value, v), %mask)``: the contiguous past
  and its padding mask are dropped; the new token's K/V are written and its query reads the whole
  context through the block table (``mode=decode``, one query per sequence, Eq. 4).

Every ``[B, H, S, D]`` operand is flattened to tokens ``[B*S, H, D]`` (the batch of a step is a
list of tokens, as in vLLM). The graph gains inputs ``slot_mapping i64[B*S]``,
``block_tables i32[seqs, max_blocks]``, ``context_lens i32[seqs]``, for prefill
``query_start_loc i32[seqs + 1]``, and per layer the buffers ``key_cache.i``/``value_cache.i``
``[num_blocks, block_size, kv_heads, D]`` with ``update`` outputs; the contiguous cache inputs
and outputs go. The block tables are plain inputs, so a tensor-parallel runtime can broadcast
them to every rank unchanged (each rank holds its heads' slice of the same physical blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import graphpar.ir.paged_ops  # noqa: F401  (registers reshape_and_cache, paged_attention)
from graphpar.errors import GenerationError, PassError
from graphpar.ir.graph import Graph, Node, OutputRole, Role, Value
from graphpar.ir.paged_ops import KERNELS
from graphpar.ir.paged_reference import SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES
from graphpar.ir.types import TensorType
from graphpar.ir.verify import describe
from graphpar.passes.attention_mask import mask_reach
from graphpar.passes.cleanup import DeadCodeElimination
from graphpar.passes.manager import GraphPass, PassContext, register_pass

# Ops a mask may pass through on its way from a graph input to the attention.
_MASK_VIEWS = ("reshape", "expand", "convert", "slice", "permute")


@dataclass
class _Site:
    """One attention to rewrite, with where its keys and values come from."""

    node: Node
    query: Value
    key: Value  # the new tokens' keys [B, Hkv, S, D]
    value: Value
    past: tuple[Value, ...]  # contiguous past inputs that go away
    mask_input: Value | None  # the padding-mask input that goes away


def _split_past(graph: Graph, operand: Value) -> tuple[Value, Value | None]:
    """(new keys, past input) for ``cat(%past, new) {dim=2}``, else (operand, None)."""
    node = operand.producer
    if node is not None and node.op == "cat" and node.attrs.get("dim") == 2 and \
            len(node.inputs) == 2:
        past, new = node.inputs
        if isinstance(past, Value) and past.is_input and past.role is Role.INPUT:
            return new, past
    return operand, None


def _mask_source(mask: Value) -> Value | None:
    """The graph input a mask is a view of, or None if it is computed from anything else."""
    while mask.producer is not None:
        if mask.producer.op not in _MASK_VIEWS:
            return None
        mask = mask.producer.inputs[0]
    return mask if mask.role is Role.INPUT else None


@register_pass("paged-attention")
@dataclass
class PagedAttention(GraphPass):
    """Causal attention over an explicit KV cache -> reshape_and_cache + paged_attention over
    fixed-size KV blocks read through per-sequence block tables."""

    block_size: int = 16
    num_blocks: int = 256
    max_blocks_per_seq: int = 0  # 0: ceil(graph attr max_model_len / block_size)
    num_seqs: int = 0  # block-table rows; 0: decode one per token, prefill logits rows or batch
    kernel: str = "auto"  # auto | reference | cuda (checks the CUDA kernels' head sizes)

    def run_on_graph(self, graph: Graph, ctx: PassContext) -> bool:
        attentions = graph.find("attention")
        if not attentions:
            return False
        self._check_options(graph)
        sites = [self._site(graph, node) for node in attentions]
        if len({s.node.inputs[0].type.shape[0] * s.node.inputs[0].type.shape[2]
                for s in sites}) != 1:
            raise PassError(f"graph @{graph.name}: attention layers see different token counts")
        first = sites[0]
        batch, _, seq, _ = first.query.type.shape
        tokens = batch * seq
        decode = bool(first.past) and seq == 1
        seqs = self._num_seqs(graph, batch, tokens, decode)
        width = self._width(graph)
        slot_mapping = graph.add_input("slot_mapping", TensorType((tokens,), torch.int64))
        tables = graph.add_input("block_tables", TensorType((seqs, width), torch.int32))
        lens = graph.add_input("context_lens", TensorType((seqs,), torch.int32))
        starts = None if decode else graph.add_input(
            "query_start_loc", TensorType((seqs + 1,), torch.int32))
        removable: set[Value] = set()
        for layer, site in enumerate(sites):
            self._rewrite(graph, layer, site, slot_mapping, tables, lens, starts,
                          "decode" if decode else "prefill")
            removable.update(site.past)
            if site.mask_input is not None:
                removable.add(site.mask_input)
        DeadCodeElimination().run_on_graph(graph, ctx)
        graph.inputs = [v for v in graph.inputs if v not in removable or v.users]
        kept = {v.name for v in graph.inputs}
        graph.outputs = [o for o in graph.outputs if o.target is None or o.target in kept]
        graph.attrs["kv_block_size"] = self.block_size
        graph.attrs["kv_num_blocks"] = self.num_blocks
        return True

    # --- checks -----------------------------------------------------------------------------

    def _check_options(self, graph: Graph) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise PassError(f"paged-attention: block_size ({self.block_size}) and num_blocks "
                            f"({self.num_blocks}) must be positive")
        if self.kernel not in KERNELS:
            raise PassError(f"paged-attention: kernel must be one of {', '.join(KERNELS)}, "
                            f"got {self.kernel!r}")

    def _site(self, graph: Graph, node: Node) -> _Site:
        where = f"graph @{graph.name}, {describe(node, graph)}"
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        key, past_key = _split_past(graph, k)
        value, past_value = _split_past(graph, v)
        if (past_key is None) != (past_value is None):
            raise PassError(f"{where}: keys and values must both come from a past cache or "
                            "both not")
        past = tuple(p for p in (past_key, past_value) if p is not None)
        mask_input = None
        if mask is not None and past:
            mask_input = _mask_source(mask)
            if mask_input is None:
                raise PassError(
                    f"{where}: attention over a past cache with a computed mask cannot be "
                    "paged; its mask must be a padding-mask input (capture with "
                    "graphpar.capture.decoder)")
        elif not past:
            # A prefill: its mask (Hugging Face builds causal masks from positions) or flag
            # must be exactly causal; the paged prefill masks causally itself.
            reach = mask_reach(graph, node)
            if not reach.plain or reach.window is not None:
                what = (f"not causal ({reach.why})" if not reach.causal else
                        f"causal with a sliding window of {reach.window} keys"
                        if reach.window else "causal, but its mask hides some earlier keys "
                        "too (e.g. padding from an input)")
                raise PassError(f"{where}: attention is {what}; only plain causal "
                                "self-attention (decoder LMs) can be paged")
        for what, t in (("query", q), ("key", key), ("value", value)):
            if t.type.rank != 4:
                raise PassError(f"{where}: {what} must be [batch, heads, seq, head_size], got "
                                f"{t.type}")
        b, heads, s, d = q.type.shape
        kb, kv_heads, ks, kd = key.type.shape
        if (kb, ks, kd) != (b, s, d) or value.type.shape != key.type.shape or heads % kv_heads:
            raise PassError(f"{where}: query {q.type} and new keys/values {key.type}, "
                            f"{value.type} are not self-attention over the same tokens")
        self._check_kernel(where, d, q.type.dtype)
        return _Site(node, q, key, value, past, mask_input)

    def _check_kernel(self, where: str, head_size: int, dtype: torch.dtype) -> None:
        if self.kernel != "cuda":
            return
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise GenerationError(
                f"{where}: head size {head_size} is not supported by the paged-attention CUDA "
                f"kernels (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))}); use "
                "kernel=reference (the torch reference takes any head size)")
        if dtype not in SUPPORTED_DTYPES:
            raise GenerationError(f"{where}: the paged-attention CUDA kernels take fp32, fp16 "
                                  f"or bf16, not {dtype}")

    def _num_seqs(self, graph: Graph, batch: int, tokens: int, decode: bool) -> int:
        if decode:
            if self.num_seqs not in (0, tokens):
                raise PassError(f"paged-attention: a decode step has one token per sequence "
                                f"({tokens}), num_seqs={self.num_seqs}")
            return tokens
        if self.num_seqs:
            return self.num_seqs
        for v in graph.inputs:
            if v.name == "logits_indices" and v.type.rank == 1:
                return v.type.shape[0]
        return batch

    def _width(self, graph: Graph) -> int:
        if self.max_blocks_per_seq:
            return self.max_blocks_per_seq
        context = graph.attrs.get("max_model_len")
        if not isinstance(context, int):
            raise PassError(f"paged-attention: graph @{graph.name} has no max_model_len "
                            "attribute; give max_blocks_per_seq")
        return math.ceil(context / self.block_size)

    # --- the rewrite ------------------------------------------------------------------------

    def _rewrite(self, graph: Graph, layer: int, site: _Site, slot_mapping: Value,
                 tables: Value, lens: Value, starts: Value | None, mode: str) -> None:
        node = site.node
        b, heads, s, d = site.query.type.shape
        kv_heads = site.key.type.shape[1]
        cache_type = TensorType((self.num_blocks, self.block_size, kv_heads, d),
                                site.key.type.dtype)
        key_cache = graph.add_input(f"key_cache.{layer}", cache_type, Role.BUFFER)
        value_cache = graph.add_input(f"value_cache.{layer}", cache_type, Role.BUFFER)

        def emit(op, operands, attrs=None):
            return graph.create(op, operands, attrs, module=node.module, loc=node.loc,
                                before=node)

        def tokens(x: Value, h: int) -> Value:  # [B, h, S, D] -> [B*S, h, D]
            t = emit("permute", [x], {"dims": (0, 2, 1, 3)}).output
            return emit("reshape", [t], {"shape": (b * s, h, d)}).output

        q, k, v = tokens(site.query, heads), tokens(site.key, kv_heads), tokens(site.value,
                                                                                kv_heads)
        new_key_cache, new_value_cache = emit(
            "reshape_and_cache", [key_cache, value_cache, k, v, slot_mapping],
            {"kernel": self.kernel}).outputs
        scale = node.attrs.get("scale")
        attrs = {"scale": float(scale) if scale is not None else 1.0 / math.sqrt(d),
                 "mode": mode, "kernel": self.kernel}
        operands = [q, new_key_cache, new_value_cache, tables, lens]
        if starts is not None:
            operands.append(starts)
        out = emit("paged_attention", operands, attrs).output
        out = emit("reshape", [out], {"shape": (b, s, heads, d)}).output
        out = emit("permute", [out], {"dims": (0, 2, 1, 3)}).output
        graph.replace_all_uses(node.output, out)
        cache_values = {node.inputs[1], node.inputs[2]}
        graph.outputs = [o for o in graph.outputs if o.value not in cache_values]
        graph.erase(node)
        graph.add_output(new_key_cache, OutputRole.UPDATE, key_cache.name)
        graph.add_output(new_value_cache, OutputRole.UPDATE, value_cache.name)
