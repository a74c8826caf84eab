"""lower-cuda for attention in training and prefill graphs: GEMM (scores, scaled) → mask →
softmax kernel → GEMM, its log-sum-exp form, and the backward that recomputes the
probabilities; grouped-query heads repeated (forward) and summed back (backward)."""

from __future__ import annotations

import math
from typing import Any

import torch

from graphpar.ir.graph import Node, Value
from graphpar.passes.lower_cuda.compute_ops import _keepdim, _rowwise, emit_gemm, emit_reduce
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.values import (
    Pending,
    View,
    broadcast_view,
    contiguous_strides,
    permute_view,
)


def _attention_parts(low: Lowering, node: Node):
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 and isinstance(node.inputs[3], Value) else None
    qt, kt = q.type, k.type
    vq, vk, vv = low.view(q), low.view(k), low.view(v)
    if kt.shape[-3] != qt.shape[-3]:  # grouped-query: each K/V head serves a query group
        vk, vv = (_repeat_heads(low, x, qt.shape[-3]) for x in (vk, vv))
    scale = node.attrs.get("scale")
    scale = 1.0 / math.sqrt(qt.shape[-1]) if scale is None else scale
    return vq, vk, vv, scale, None if mask is None else low.view(mask)


def _transposed(v: View) -> View:
    rank = len(v.shape)
    return permute_view(v, tuple(range(rank - 2)) + (rank - 1, rank - 2))


def _probabilities(low: Lowering, node: Node, q: View, k: View, scale: float,
                   lse: View | None = None, mask: View | None = None) -> View:
    """softmax(q k^T · scale + mask) (causal if the node says so; a boolean mask keeps where
    it is true), and its log-sum-exp per row."""
    batch, sq, sk = q.shape[:-2], q.shape[-2], k.shape[-2]
    scores = emit_gemm(low, q, _transposed(k), batch + (sq, sk), q.dtype, alpha=scale)
    if mask is not None:  # applied in place over the scores, element for element
        m = ("leaf", broadcast_view(mask, scores.shape))
        s = ("leaf", scores)
        expr = (("apply", "where", (m, s, ("const", -math.inf)), ()) if mask.dtype == torch.bool
                else ("apply", "add", (s, m), ()))
        low.materialize(Pending(expr, scores.shape, scores.dtype), out=scores)
    probs = low.new_view(scores.shape, scores.dtype)
    extra: list[tuple[str, Any]] = [("causal", bool(node.attrs.get("causal"))), ("sq", sq)]
    if lse is not None:
        extra.append(("lse", low.addr(lse)))
    _rowwise(low, "softmax", scores, probs, rows=math.prod(batch) * sq, cols=sk, extra=extra,
             more_writes=[lse] if lse is not None else [])
    return probs


def _attention(low: Lowering, node: Node) -> None:
    """GEMM (scores, scaled) -> softmax kernel (causal mask; with_lse: the log-sum-exp too) ->
    GEMM."""
    q, k, v, scale, mask = _attention_parts(low, node)
    lse = None
    if node.op == "attention_with_lse":
        lt = node.outputs[1].type
        lse = low.new_view(lt.shape, lt.dtype)
    probs = _probabilities(low, node, q, k, scale, lse, mask)
    low.bind(node.outputs[0], emit_gemm(low, probs, v, node.outputs[0].type.shape, q.dtype))
    if lse is not None:
        low.bind(node.outputs[1], lse)


def _attention_backward(low: Lowering, node: Node) -> None:
    """dq, dk, dv from the recomputed probabilities P: dv = P^T do, dP = do v^T,
    dS = P (dP - rowsum(do o)), dq = dS k · scale, dk = dS^T q · scale."""
    q, k, v, scale, mask = _attention_parts(low, _Shifted(node))
    do, o = low.view(node.inputs[0]), low.view(node.inputs[4])
    probs = _probabilities(low, node, q, k, scale, mask=mask)
    shape = probs.shape
    dv = emit_gemm(low, _transposed(probs), do, v.shape, q.dtype)
    dp = emit_gemm(low, do, _transposed(v), shape, q.dtype)
    rank = len(do.shape)
    rows = emit_reduce(low, Pending(("apply", "mul", (("leaf", do), ("leaf", o)), ()), do.shape,
                                    do.dtype), (rank - 1,), "sum")
    rows = broadcast_view(_keepdim(rows, (rank - 1,), rank), shape)
    ds = low.materialize(Pending(("apply", "mul", (("leaf", probs), ("apply", "sub", (
        ("leaf", dp), ("leaf", rows)), ())), ()), shape, probs.dtype))
    dq = emit_gemm(low, ds, k, node.outputs[0].type.shape, q.dtype, alpha=scale)
    dk = emit_gemm(low, _transposed(ds), q, k.shape, q.dtype, alpha=scale)
    kv_heads = node.outputs[1].type.shape[-3]
    if kv_heads != k.shape[-3]:  # grouped-query: sum each K/V head's gradient over its group
        dk, dv = (_sum_groups(low, x, kv_heads) for x in (dk, dv))
    for value, view in zip(node.outputs, (dq, dk, dv)):
        low.bind(value, view)


def _sum_groups(low: Lowering, x: View, kv_heads: int) -> View:
    """[.., heads, S, D] dense -> [.., kv_heads, S, D]: the sum over each head's group."""
    *batch, heads, s, d = x.shape
    grouped = (*batch, kv_heads, heads // kv_heads, s, d)
    view = View(x.buf, x.offset, grouped, contiguous_strides(grouped), x.dtype)
    out = emit_reduce(low, view, (len(batch) + 1,), "sum")
    shape = (*batch, kv_heads, s, d)
    return View(out.buf, 0, shape, contiguous_strides(shape), x.dtype)


class _Shifted:
    """attention_backward's operands seen as attention's (q, k, v first)."""

    def __init__(self, node: Node):
        self.op = "attention_backward"
        self.inputs = node.inputs[1:4] + node.inputs[6:7]
        self.attrs = node.attrs


def _repeat_heads(low: Lowering, x: View, heads: int) -> View:
    """K or V [.., kv_heads, S, D] with each head repeated for its query group: [.., heads,
    S, D], made dense by one copy (grouped-query attention as plain batched GEMMs)."""
    *batch, kv_heads, s, d = x.shape
    group = heads // kv_heads
    shape = (*batch, kv_heads, group, s, d)
    strides = (*x.strides[:-3], x.strides[-3], 0, *x.strides[-2:])
    dense = low.materialize(Pending(("leaf", View(x.buf, x.offset, shape, strides, x.dtype)),
                                    shape, x.dtype))
    out_shape = (*batch, heads, s, d)
    return View(dense.buf, 0, out_shape, contiguous_strides(out_shape), x.dtype)


HANDLERS.update({
    "attention": _attention,
    "attention_with_lse": _attention,
    "attention_backward": _attention_backward,
})
