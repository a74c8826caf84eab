"""lower-cuda for compute: GEMMs, row-wise kernels, reductions, index kernels and the
paged-attention kernels (attention: attention_ops; convolutions, pooling, batch norm:
conv_ops; top-k, cumsum, scatter: index_ops)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Node, Value
from graphpar.ir.types import dtype_name
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.values import (
    Pending,
    View,
    as_expr,
    broadcast_view,
    contiguous_strides,
    kernel_digest,
    permute_view,
)

# ------------------------------------------------------------------------- GEMMs

def _matrix(v: View) -> tuple[str, int] | None:
    """How cuBLAS reads the last two dims of `v` as a row-major matrix: ("row", ld) when its
    rows are dense, ("col", ld) when its columns are (a transposed matrix), else None."""
    rows, cols = v.shape[-2], v.shape[-1]
    sr, sc = v.strides[-2], v.strides[-1]
    if sc == 1 or cols == 1:
        ld = sr if rows > 1 else cols
        if ld >= max(cols, 1):
            return "row", ld
    if sr == 1 or rows == 1:
        ld = sc if cols > 1 else rows
        if ld >= max(rows, 1):
            return "col", ld
    return None


def _batch(v: View) -> tuple[int, int] | None:
    """The batch dims of `v` as (count, one uniform stride), or None if they are not one."""
    dims = [(size, stride) for size, stride in zip(v.shape[:-2], v.strides[:-2]) if size != 1]
    count = math.prod(size for size, _ in dims)
    if not dims:
        return 1, 0
    if all(stride == 0 for _, stride in dims):
        return count, 0
    for (_, stride), (next_size, next_stride) in zip(dims, dims[1:]):
        if stride != next_stride * next_size:
            return None
    return count, dims[-1][1]


def _gemm_operand(low: Lowering, value: Value | View, batch_shape: tuple[int, ...]) -> View:
    v = value if isinstance(value, View) else low.view(value)
    v = broadcast_view(v, batch_shape + v.shape[-2:])
    if _matrix(v) is None or _batch(v) is None:
        dense = low.materialize(Pending(("leaf", v), v.shape, v.dtype))
        v = dense
    return v


def emit_gemm(low: Lowering, a: Value | View, b: Value | View, out_shape: tuple[int, ...],
              dtype: torch.dtype, alpha: float = 1.0) -> View:
    """C = alpha · A @ B over batch dims, as one cuBLAS call into a new contiguous buffer."""
    batch_shape = tuple(out_shape[:-2])
    va = _gemm_operand(low, a, batch_shape)
    vb = _gemm_operand(low, b, batch_shape)
    m_rows, k = va.shape[-2], va.shape[-1]
    n = vb.shape[-1]
    count, stride_a = _batch(va)  # type: ignore[misc]
    _, stride_b = _batch(vb)  # type: ignore[misc]
    # One big GEMM when B is shared across the batch and A's batch rows stack densely.
    form_a, ld_a = _matrix(va)  # type: ignore[misc]
    form_b, ld_b = _matrix(vb)  # type: ignore[misc]
    if count > 1 and stride_b == 0 and form_a == "row" and stride_a == m_rows * ld_a:
        m_rows, count, stride_a = m_rows * count, 1, 0
    out = low.new_view(out_shape, dtype)
    batched = count > 1
    # Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's A is our B and its B our A.
    params: list[tuple[str, Any]] = [
        ("transa", "N" if form_b == "row" else "T"),
        ("transb", "N" if form_a == "row" else "T"),
        ("m", n), ("n", m_rows), ("k", k), ("alpha", float(alpha)),
        ("A", low.addr(vb)), ("Atype", dtype_name(vb.dtype)), ("lda", ld_b),
        *([("strideA", stride_b)] if batched else []),
        ("B", low.addr(va)), ("Btype", dtype_name(va.dtype)), ("ldb", ld_a),
        *([("strideB", stride_a)] if batched else []),
        ("beta", 0.0), ("C", low.addr(out)), ("Ctype", dtype_name(dtype)), ("ldc", n),
        *([("strideC", m_rows * n), ("batchCount", count)] if batched else []),
        ("computeType", "CUBLAS_COMPUTE_64F" if dtype == torch.float64
         else "CUBLAS_COMPUTE_32F"),
    ]
    kind = "cublas.gemmStridedBatchedEx" if count > 1 else "cublas.gemmEx"
    low.emit(kind, params, [va, vb], [out])
    return out


def _matmul(low: Lowering, node: Node) -> None:
    a, b = node.inputs
    t = node.output.type
    if a.type.rank < 2 or b.type.rank < 2:
        raise UnsupportedOpError("matmul of a vector: reshape it to a matrix first")
    low.bind(node.output, emit_gemm(low, a, b, t.shape, t.dtype))


def _linear(low: Lowering, node: Node) -> None:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    t = node.output.type
    wt = permute_view(low.view(w), (1, 0))
    vx = low.view(x)
    if vx.contiguous and len(vx.shape) > 2:  # [*, K] rows stack densely: one matrix
        rows = math.prod(vx.shape[:-1])
        flat = View(vx.buf, vx.offset, (rows, vx.shape[-1]), (vx.shape[-1], 1), vx.dtype)
        out = emit_gemm(low, flat, wt, (rows, t.shape[-1]), t.dtype)
        out = View(out.buf, 0, t.shape, contiguous_strides(t.shape), t.dtype)
    else:
        out = emit_gemm(low, vx, wt, t.shape, t.dtype)
    if bias is None:
        low.bind(node.output, out)
        return
    expr = ("apply", "add", (("leaf", out), as_expr(low.operand(bias), t.shape)), ())
    low.bind(node.output, Pending(expr, t.shape, t.dtype))


# ------------------------------------------------------------------------- row-wise kernels

def _rowwise(low: Lowering, template: str, x: View, out: View, rows: int, cols: int,
             extra: Sequence[tuple[str, Any]] = (), weights: Sequence[View | None] = (),
             more_writes: Sequence[View] = ()) -> None:
    params: list[tuple[str, Any]] = [("name", None), ("rows", rows), ("cols", cols),
                                     ("dtype", dtype_name(x.dtype)), *extra,
                                     ("x", low.addr(x))]
    for label, w in zip(("w", "b"), weights):
        params.append((label, None if w is None else low.addr(w)))
    params.append(("y", low.addr(out)))
    drop = ("x", "w", "b", "y", "mean", "rstd", "lse")
    params[0] = ("name", f"{template}_" + kernel_digest(
        [(k, v if k not in drop or v is None else "ptr") for k, v in params[1:]]))
    low.emit(f"kernel.{template}", params, [x] + [w for w in weights if w is not None],
             [out, *more_writes])


def _softmax(low: Lowering, node: Node) -> None:
    """A row-wise kernel over the last dim; another dim is first made last by one copy, and
    the result is read back through the inverse permutation (no call)."""
    t = node.output.type
    dim = node.attrs["dim"] % t.rank
    order = tuple(d for d in range(t.rank) if d != dim) + (dim,)
    if dim == t.rank - 1:
        x = low.contiguous(node.inputs[0])
    else:
        moved = permute_view(low.view(node.inputs[0]), order)
        x = low.materialize(Pending(("leaf", moved), moved.shape, moved.dtype))
    out = low.new_view(x.shape, t.dtype)
    template = "softmax" if node.op == "softmax" else "log_softmax"
    _rowwise(low, template, x, out, rows=t.numel // t.shape[dim], cols=t.shape[dim],
             extra=[("causal", False), ("sq", 1)])
    inverse = tuple(order.index(d) for d in range(t.rank))
    low.bind(node.output, out if dim == t.rank - 1 else permute_view(out, inverse))


def _norm(low: Lowering, node: Node) -> None:
    t = node.outputs[0].type
    cols = math.prod(node.attrs["shape"])
    x = low.contiguous(node.inputs[0])
    n_weights = 1 if node.op == "rms_norm" else 2
    weights = [low.contiguous(w) if isinstance(w, Value) else None
               for w in (list(node.inputs[1:]) + [None, None])[:n_weights]]
    eps = node.attrs.get("eps")
    if eps is None:
        eps = torch.finfo(t.dtype).eps
    out = low.new_view(t.shape, t.dtype)
    stats = [low.new_view(o.type.shape, o.type.dtype) for o in node.outputs[1:]]
    extra: list[tuple[str, Any]] = [("eps", float(eps))]
    if stats:  # layer_norm_with_stats: each row's mean and 1/std too, for the backward
        extra += [("mean", low.addr(stats[0])), ("rstd", low.addr(stats[1]))]
    template = "rms_norm" if node.op == "rms_norm" else "layer_norm"
    _rowwise(low, template, x, out, rows=t.numel // cols, cols=cols, extra=extra,
             weights=weights, more_writes=stats)
    for value, view in zip(node.outputs, [out, *stats]):
        low.bind(value, view)


def _layer_norm_backward(low: Lowering, node: Node) -> None:
    """dx, dw, db from the saved mean and rstd, as GEMM-free kernels: two row reductions for
    dx, column reductions for dw and db."""
    g, x, mean, rstd = (low.view(v) for v in node.inputs[:4])
    w = node.inputs[4] if len(node.inputs) > 4 and isinstance(node.inputs[4], Value) else None
    shape = x.shape
    k = len(node.attrs["shape"])
    rows_dims = tuple(range(len(shape) - k))
    norm_dims = tuple(range(len(shape) - k, len(shape)))
    mask = node.attrs.get("mask", (True, True, True))

    def leaf(v: View) -> Any:
        return ("leaf", broadcast_view(v, shape))

    def op(name: str, *args: Any) -> Any:
        return ("apply", name, args, ())

    xhat = op("mul", op("sub", leaf(x), leaf(mean)), leaf(rstd))
    gw = op("mul", leaf(g), leaf(low.view(w))) if w is not None else leaf(g)
    outputs = iter(node.outputs)
    if mask[0]:
        c1 = _keepdim(emit_reduce(low, Pending(gw, shape, x.dtype), norm_dims, "mean"),
                      norm_dims, len(shape))
        c2 = _keepdim(emit_reduce(low, Pending(op("mul", gw, xhat), shape, x.dtype), norm_dims,
                                  "mean"), norm_dims, len(shape))
        dx = op("mul", leaf(rstd), op("sub", op("sub", gw, leaf(c1)), op("mul", xhat, leaf(c2))))
        low.bind(next(outputs), low.materialize(Pending(dx, shape, x.dtype)))
    if len(mask) > 1 and mask[1]:
        low.bind(next(outputs), emit_reduce(low, Pending(op("mul", leaf(g), xhat), shape,
                                                         x.dtype), rows_dims, "sum"))
    if len(mask) > 2 and mask[2]:
        low.bind(next(outputs), emit_reduce(low, g, rows_dims, "sum"))


def _log_softmax_backward(low: Lowering, node: Node) -> None:
    """g - exp(y) * sum(g over dim): one reduction and one fused kernel."""
    g, y = low.view(node.inputs[0]), low.view(node.inputs[1])
    dim = node.attrs["dim"] % len(g.shape)
    total = _keepdim(emit_reduce(low, g, (dim,), "sum"), (dim,), len(g.shape))
    expr = ("apply", "sub", (("leaf", g), ("apply", "mul", (
        ("apply", "exp", (("leaf", y),), ()), ("leaf", broadcast_view(total, g.shape))), ())), ())
    low.bind(node.output, Pending(expr, g.shape, g.dtype))


def emit_reduce(low: Lowering, x: View | Pending, dims: Sequence[int], op: str,
                dtype: torch.dtype | None = None) -> View:
    """`op` ("sum", "mean", "amax", "amin") of `x` over `dims` into a new dense buffer (the
    kept dims, in order); a pending expression is computed first."""
    if isinstance(x, Pending):
        x = low.materialize(x)
    dims = tuple(sorted(d % len(x.shape) for d in dims))
    shape = tuple(size for d, size in enumerate(x.shape) if d not in dims)
    out = low.new_view(shape, dtype or x.dtype)
    params: list[tuple[str, Any]] = [
        ("name", None), ("op", op), ("shape", x.shape), ("dims", dims),
        ("x", low.addr(x)), ("x_dtype", dtype_name(x.dtype)), ("x_strides", x.strides),
        ("y", low.addr(out)), ("y_dtype", dtype_name(out.dtype))]
    params[0] = ("name", "reduce_" + kernel_digest(params[1:], drop=("x", "y")))
    low.emit("kernel.reduce", params, [x], [out])
    return out


def _keepdim(v: View, dims: Sequence[int], rank: int) -> View:
    """A reduction's dense result seen with its reduced dims back as size 1 (to broadcast)."""
    shape = tuple(1 if d in dims else size for d, size in
                  zip(range(rank), _expand_kept(v.shape, dims, rank)))
    return View(v.buf, v.offset, shape, contiguous_strides(shape), v.dtype)


def _expand_kept(kept: Sequence[int], dims: Sequence[int], rank: int) -> list[int]:
    it = iter(kept)
    return [1 if d in dims else next(it) for d in range(rank)]


def _reduce(low: Lowering, node: Node) -> None:
    x = low.view(node.inputs[0])
    t = node.output.type
    dims = node.attrs.get("dims")
    dims = tuple(range(len(x.shape))) if dims is None else tuple(d % len(x.shape) for d in dims)
    out = emit_reduce(low, x, dims, node.op, t.dtype)
    low.bind(node.output, View(out.buf, 0, t.shape, contiguous_strides(t.shape), t.dtype))


def _embedding(low: Lowering, node: Node) -> None:
    w, idx = node.inputs
    t = node.output.type
    vw = low.contiguous(w)
    vi = low.contiguous(idx)
    out = low.new_view(t.shape, t.dtype)
    params: list[tuple[str, Any]] = [
        ("name", None), ("rows", vi.shape and math.prod(vi.shape) or 1),
        ("cols", w.type.shape[-1]), ("vocab", w.type.shape[0]), ("dtype", dtype_name(t.dtype)),
        ("index_dtype", dtype_name(vi.dtype)), ("weight", low.addr(vw)), ("index", low.addr(vi)),
        ("y", low.addr(out))]
    params[0] = ("name", "embedding_" + kernel_digest(params[1:], drop=("weight", "index", "y")))
    low.emit("kernel.embedding", params, [vw, vi], [out])
    low.bind(node.output, out)


def _index_kernel(low: Lowering, kind: str, params: list[tuple[str, Any]], reads, writes,
                  addresses: Sequence[str]) -> None:
    params = [("name", kind.split(".")[1] + "_" + kernel_digest(
        [(k, "ptr" if k in addresses and v is not None else v) for k, v in params])), *params]
    low.emit(kind, params, reads, writes)


def _class_weight(low: Lowering, node: Node, index: int) -> tuple[list, list]:
    """The optional class-weight operand: its ("weight", address) parameter and read, or
    nothing (an unweighted call's parameters stay as they were)."""
    if len(node.inputs) > index and isinstance(node.inputs[index], Value):
        w = low.contiguous(node.inputs[index])
        return [("weight", low.addr(w))], [w]
    return [], []


def _nll_loss(low: Lowering, node: Node) -> None:
    """-w[t]·logp[i, t = target[i]] summed (reduction 2) or divided by Σ w[t] (1) over rows
    whose target is not ignore_index; total_weight is Σ w[t] (w = 1 without class weights:
    the number of such rows)."""
    logp, target = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[1])
    if len(logp.shape) != 2:
        raise UnsupportedOpError("nll_loss over other than [rows, classes]")
    weight, weight_read = _class_weight(low, node, 2)
    loss, total = (low.new_view(o.type.shape, o.type.dtype) for o in node.outputs)
    _index_kernel(low, "kernel.nll_loss", [
        ("rows", logp.shape[0]), ("classes", logp.shape[1]), ("dtype", dtype_name(logp.dtype)),
        ("target_dtype", dtype_name(target.dtype)), ("reduction", node.attrs.get("reduction", 1)),
        ("ignore_index", node.attrs.get("ignore_index", -100)), ("logp", low.addr(logp)),
        ("target", low.addr(target)), *weight, ("loss", low.addr(loss)),
        ("total_weight", low.addr(total))], [logp, target, *weight_read], [loss, total],
        ("logp", "target", "weight", "loss", "total_weight"))
    low.bind(node.outputs[0], loss)
    low.bind(node.outputs[1], total)


def _nll_loss_backward(low: Lowering, node: Node) -> None:
    g, logp, target, total = (low.contiguous(x) for x in node.inputs[:4])
    weight, weight_read = _class_weight(low, node, 4)
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    _index_kernel(low, "kernel.nll_loss_backward", [
        ("rows", t.shape[0]), ("classes", t.shape[1]), ("dtype", dtype_name(t.dtype)),
        ("target_dtype", dtype_name(target.dtype)), ("reduction", node.attrs.get("reduction", 1)),
        ("ignore_index", node.attrs.get("ignore_index", -100)), ("grad", low.addr(g)),
        ("target", low.addr(target)), *weight, ("total_weight", low.addr(total)),
        ("y", low.addr(out))], [g, target, total, *weight_read], [out],
        ("grad", "target", "weight", "total_weight", "y"))
    low.bind(node.output, out)


def _arange(low: Lowering, node: Node) -> None:
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    a = node.attrs
    _index_kernel(low, "kernel.arange", [("n", t.numel), ("start", a["start"]),
                                          ("step", a["step"]), ("dtype", dtype_name(t.dtype)),
                                          ("y", low.addr(out))], [], [out], ("y",))
    low.bind(node.output, out)


def _embedding_backward(low: Lowering, node: Node) -> None:
    """Zero the weight gradient, then add each row of the gradient at its index (atomically on
    a GPU)."""
    g, idx = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[1])
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    low.emit("cuda.memsetAsync", [("dst", low.addr(out)), ("value", 0),
                                  ("count", out.buf.nbytes)], [], [out])
    _index_kernel(low, "kernel.embedding_backward", [
        ("rows", math.prod(idx.shape)), ("cols", t.shape[1]), ("vocab", t.shape[0]),
        ("padding_idx", node.attrs.get("padding_idx", -1)), ("dtype", dtype_name(t.dtype)),
        ("index_dtype", dtype_name(idx.dtype)), ("grad", low.addr(g)), ("index", low.addr(idx)),
        ("y", low.addr(out))], [g, idx, out], [out], ("grad", "index", "y"))
    low.bind(node.output, out)



# ------------------------------------------------------------------------- paged attention

def _reshape_and_cache(low: Lowering, node: Node) -> None:
    """The existing reshape_and_cache kernel, writing the caches in place (their outputs are
    the caches themselves, as the runtime donates them)."""
    kc, vc = (low.view(x) for x in node.inputs[:2])
    if not (kc.whole and vc.whole):
        raise UnsupportedOpError("reshape_and_cache on caches that are views of other tensors")
    key, value, slots = (low.contiguous(x) for x in node.inputs[2:5])
    blocks, block_size, kv_heads, head_size = kc.shape
    low.emit("paged.reshape_and_cache", [
        ("key", low.addr(key)), ("value", low.addr(value)), ("key_cache", low.addr(kc)),
        ("value_cache", low.addr(vc)), ("slot_mapping", low.addr(slots)),
        ("tokens", key.shape[0]), ("num_blocks", blocks), ("block_size", block_size),
        ("kv_heads", kv_heads), ("head_size", head_size), ("dtype", dtype_name(kc.dtype)),
        ("slot_dtype", dtype_name(slots.dtype))], [key, value, slots, kc, vc], [kc, vc])
    low.bind(node.outputs[0], kc)
    low.bind(node.outputs[1], vc)


def _paged_attention(low: Lowering, node: Node) -> None:
    """The existing paged-attention kernels (decode, or prefill over query_start_loc)."""
    query, kc, vc, tables, lens = (low.contiguous(x) for x in node.inputs[:5])
    starts = low.contiguous(node.inputs[5]) if len(node.inputs) > 5 and isinstance(
        node.inputs[5], Value) else None
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    blocks, block_size, kv_heads, head_size = kc.shape
    reads = [query, kc, vc, tables, lens] + ([starts] if starts is not None else [])
    low.emit("paged.attention", [
        ("mode", node.attrs.get("mode", "decode")), ("scale", float(node.attrs.get("scale", 1.0))),
        ("query", low.addr(query)), ("key_cache", low.addr(kc)), ("value_cache", low.addr(vc)),
        ("block_tables", low.addr(tables)), ("context_lens", low.addr(lens)),
        ("query_start_loc", None if starts is None else low.addr(starts)),
        ("out", low.addr(out)), ("tokens", t.shape[0]), ("heads", t.shape[1]),
        ("kv_heads", kv_heads), ("head_size", head_size), ("num_blocks", blocks),
        ("block_size", block_size), ("seqs", tables.shape[0]), ("max_blocks", tables.shape[1]),
        ("dtype", dtype_name(t.dtype)), ("index_dtype", dtype_name(tables.dtype)),
        ("lens_dtype", dtype_name(lens.dtype)),
        ("starts_dtype", None if starts is None else dtype_name(starts.dtype))], reads, [out])
    low.bind(node.output, out)



HANDLERS.update({
    "reshape_and_cache": _reshape_and_cache,
    "paged_attention": _paged_attention,
    "matmul": _matmul,
    "linear": _linear,
    "layer_norm_with_stats": _norm,
    "layer_norm_backward": _layer_norm_backward,
    "log_softmax_backward": _log_softmax_backward,
    "nll_loss": _nll_loss,
    "nll_loss_backward": _nll_loss_backward,
    "arange": _arange,
    "embedding_backward": _embedding_backward,
    "softmax": _softmax,
    "log_softmax": _softmax,
    "layer_norm": _norm,
    "rms_norm": _norm,
    "sum": _reduce,
    "mean": _reduce,
    "amax": _reduce,
    "amin": _reduce,
    "embedding": _embedding,
})
