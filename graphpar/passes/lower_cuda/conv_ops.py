"""lower-cuda for convolutional networks: 2-D convolution as im2col + one batched cuBLAS GEMM
(and its backward: GEMMs, col2im, reductions), max pooling, and batch norm as reductions and fused
kernels (inference: running statistics; training: batch statistics and the running-stat
updates; backward)."""

from __future__ import annotations

import math
from typing import Any

from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Node, Value
from graphpar.ir.types import dtype_name
from graphpar.passes.lower_cuda.compute_ops import _index_kernel, _keepdim, emit_gemm, emit_reduce
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.values import (
    Pending,
    View,
    broadcast_view,
    contiguous_strides,
    permute_view,
)

# ------------------------------------------------------------------------- convolution


def _reshaped(v: View, shape: tuple[int, ...]) -> View:
    """A dense view seen with another shape of as many elements."""
    assert v.contiguous and math.prod(shape) == math.prod(v.shape)
    return View(v.buf, v.offset, shape, contiguous_strides(shape), v.dtype)


def _window_params(node: Node, image: tuple[int, ...], out_hw: tuple[int, int],
                   kernel: tuple[int, int]) -> list[tuple[str, Any]]:
    a = node.attrs
    return [("image", tuple(image)), ("out_hw", tuple(out_hw)), ("kernel", tuple(kernel)),
            ("stride", tuple(a["stride"])), ("padding", tuple(a["padding"])),
            ("dilation", tuple(a["dilation"]))]


def _pointwise_window(node: Node, kernel: tuple[int, int]) -> bool:
    """A 1x1 window with stride 1 and no padding: im2col is the image itself."""
    a = node.attrs
    return (tuple(kernel) == (1, 1) and tuple(a["stride"]) == (1, 1)
            and tuple(a["padding"]) == (0, 0))


def _columns(low: Lowering, node: Node, x: View, out_hw: tuple[int, int],
             kernel: tuple[int, int]) -> View:
    """x [N, C, H, W] as the GEMM operand [N, C·kh·kw, Ho·Wo] (im2col)."""
    n, c, h, w = x.shape
    rows = c * kernel[0] * kernel[1]
    if _pointwise_window(node, kernel):
        return _reshaped(x, (n, rows, h * w))
    cols = low.new_view((n, rows, out_hw[0] * out_hw[1]), x.dtype)
    _index_kernel(low, "kernel.im2col", [
        *_window_params(node, x.shape, out_hw, kernel), ("dtype", dtype_name(x.dtype)),
        ("x", low.addr(x)), ("cols", low.addr(cols))], [x], [cols], ("x", "cols"))
    return cols


def _check_groups(node: Node) -> None:
    """The listings hold 2-D, ungrouped, non-transposed convolutions only (the IR has more)."""
    if node.attrs.get("groups", 1) != 1:
        raise UnsupportedOpError("convolution with groups != 1")
    if node.attrs.get("transposed", False) or node.inputs[1].type.rank != 4:
        raise UnsupportedOpError("convolution other than 2-D and non-transposed")


def _conv2d(low: Lowering, node: Node) -> None:
    """y[n] = W [O, C·kh·kw] · im2col(x)[n]: one batched GEMM (W shared, stride 0); the bias
    is the next fused kernel's add."""
    _check_groups(node)
    x, w = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[1])
    bias = node.inputs[2] if len(node.inputs) > 2 and isinstance(node.inputs[2], Value) else None
    t = node.output.type
    n, o, ho, wo = t.shape
    kernel = tuple(w.shape[2:])
    cols = _columns(low, node, x, (ho, wo), kernel)
    weights = _reshaped(w, (o, cols.shape[1]))
    out = emit_gemm(low, weights, cols, (n, o, ho * wo), t.dtype)
    out = _reshaped(out, t.shape)
    if bias is None:
        low.bind(node.output, out)
        return
    b = low.view(bias)
    b = broadcast_view(View(b.buf, b.offset, (o, 1, 1), (b.strides[0], 0, 0), b.dtype), t.shape)
    low.bind(node.output, Pending(("apply", "add", (("leaf", out), ("leaf", b)), ()), t.shape,
                                  t.dtype))


def _conv2d_backward(low: Lowering, node: Node) -> None:
    """dx = col2im(Wᵀ · g[n]) (batched GEMM, then a gathering kernel), dw = Σₙ g[n] ·
    im2col(x)[n]ᵀ (batched GEMM, then a sum over n), db = Σ g over n, h, w."""
    _check_groups(node)
    g, x, w = (low.contiguous(v) for v in node.inputs[:3])
    n, o, ho, wo = g.shape
    kernel = tuple(w.shape[2:])
    rows = w.shape[1] * kernel[0] * kernel[1]
    g3 = _reshaped(g, (n, o, ho * wo))
    weights = _reshaped(w, (o, rows))
    mask = tuple(node.attrs.get("mask", (True, True, True)))
    outputs = iter(node.outputs)
    if mask[0]:
        dcols = emit_gemm(low, permute_view(weights, (1, 0)), g3, (n, rows, ho * wo), g.dtype)
        if _pointwise_window(node, kernel):
            dx = _reshaped(dcols, x.shape)
        else:
            dx = low.new_view(x.shape, x.dtype)
            _index_kernel(low, "kernel.col2im", [
                *_window_params(node, x.shape, (ho, wo), kernel), ("dtype", dtype_name(x.dtype)),
                ("cols", low.addr(dcols)), ("x", low.addr(dx))], [dcols], [dx], ("cols", "x"))
        low.bind(next(outputs), dx)
    if len(mask) > 1 and mask[1]:
        cols = _columns(low, node, x, (ho, wo), kernel)
        cols_t = permute_view(cols, (0, 2, 1))
        per_image = emit_gemm(low, g3, cols_t, (n, o, rows), g.dtype)
        dw = per_image if n == 1 else emit_reduce(low, per_image, (0,), "sum")
        low.bind(next(outputs), _reshaped(dw, w.shape))
    if len(mask) > 2 and mask[2]:
        low.bind(next(outputs), emit_reduce(low, g, (0, 2, 3), "sum"))


# ------------------------------------------------------------------------- max pooling

def _max_pool2d(low: Lowering, node: Node) -> None:
    x = low.contiguous(node.inputs[0])
    if len(x.shape) != 4:
        raise UnsupportedOpError("max_pool2d of other than [N, C, H, W]")
    vt, it = (o.type for o in node.outputs)
    y, idx = low.new_view(vt.shape, vt.dtype), low.new_view(it.shape, it.dtype)
    _index_kernel(low, "kernel.max_pool2d", [
        *_window_params(node, x.shape, vt.shape[2:], node.attrs["kernel"]),
        ("ceil_mode", bool(node.attrs.get("ceil_mode", False))), ("dtype", dtype_name(x.dtype)),
        ("x", low.addr(x)), ("y", low.addr(y)), ("indices", low.addr(idx))], [x], [y, idx],
        ("x", "y", "indices"))
    low.bind(node.outputs[0], y)
    low.bind(node.outputs[1], idx)


def _max_pool2d_backward(low: Lowering, node: Node) -> None:
    g, idx = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[2])
    t = node.output.type
    y = low.new_view(t.shape, t.dtype)
    _index_kernel(low, "kernel.max_pool2d_backward", [
        *_window_params(node, t.shape, g.shape[2:], node.attrs["kernel"]),
        ("ceil_mode", bool(node.attrs.get("ceil_mode", False))), ("dtype", dtype_name(t.dtype)),
        ("grad", low.addr(g)), ("indices", low.addr(idx)), ("y", low.addr(y))], [g, idx], [y],
        ("grad", "indices", "y"))
    low.bind(node.output, y)


# ------------------------------------------------------------------------- batch norm

def _op(name: str, *args: Any, attrs: tuple = ()) -> Any:
    return ("apply", name, args, attrs)


def _channel(low: Lowering, value: Any, shape: tuple[int, ...]) -> Any:
    """A per-channel [C] tensor (or a View of one) as a leaf broadcast over x's `shape`."""
    v = value if isinstance(value, View) else low.view(value)
    rank = len(shape)
    seen = View(v.buf, v.offset, (shape[1],) + (1,) * (rank - 2), (v.strides[0],) + (0,) *
                (rank - 2), v.dtype)
    return ("leaf", broadcast_view(seen, shape))


def _normalized(low: Lowering, x: View, mean: Any, rstd: Any, w: Any, b: Any) -> Any:
    """(x − mean) · rstd · w + b, with per-channel operands (w, b: None for none)."""
    shape = x.shape
    out = _op("mul", _op("sub", ("leaf", x), _channel(low, mean, shape)),
              _channel(low, rstd, shape))
    if w is not None:
        out = _op("mul", out, _channel(low, w, shape))
    if b is not None:
        out = _op("add", out, _channel(low, b, shape))
    return out


def _optional(node: Node, i: int) -> Value | None:
    return node.inputs[i] if len(node.inputs) > i and isinstance(node.inputs[i], Value) else None


def _batch_norm(low: Lowering, node: Node) -> None:
    """Inference: one fused kernel with the running statistics (rstd computed per channel)."""
    x = low.view(node.inputs[0])
    mean, var = low.view(node.inputs[3]), low.view(node.inputs[4])
    eps = float(node.attrs.get("eps", 1e-5))
    rstd = low.materialize(Pending(_op("rsqrt", _op("add", ("leaf", var), ("const", eps))),
                                   var.shape, var.dtype))
    t = node.output.type
    low.bind(node.output, Pending(_normalized(low, x, mean, rstd, _optional(node, 1),
                                              _optional(node, 2)), t.shape, t.dtype))


def _batch_norm_train(low: Lowering, node: Node) -> None:
    """Batch mean and (biased) variance by two reductions over every dim but the channel's;
    the output, rstd and the running-stat updates (unbiased variance) as fused kernels."""
    x = low.contiguous(node.inputs[0])
    shape, rank = x.shape, len(x.shape)
    dims = tuple(d for d in range(rank) if d != 1)
    count = math.prod(shape) // shape[1]
    momentum, eps = float(node.attrs.get("momentum", 0.1)), float(node.attrs.get("eps", 1e-5))
    mean = emit_reduce(low, x, dims, "mean")
    centered = _op("sub", ("leaf", x), _channel(low, mean, shape))
    var = emit_reduce(low, Pending(_op("mul", centered, centered), shape, x.dtype), dims, "mean")
    # not in place over var: the running-variance update below still reads it
    rstd = low.materialize(Pending(_op("rsqrt", _op("add", ("leaf", var), ("const", eps))),
                                   var.shape, var.dtype), out=low.new_view(var.shape, var.dtype))
    out_t = node.outputs[0].type
    low.bind(node.outputs[0], Pending(_normalized(low, x, mean, rstd, _optional(node, 1),
                                                  _optional(node, 2)), out_t.shape, out_t.dtype))
    low.bind(node.outputs[1], mean)
    low.bind(node.outputs[2], rstd)
    running_mean, running_var = low.view(node.inputs[3]), low.view(node.inputs[4])
    unbiased = count / max(count - 1, 1)

    def update(running: View, batch: Any) -> Pending:
        return Pending(_op("add", _op("mul", ("leaf", running), ("const", 1.0 - momentum)),
                           _op("mul", batch, ("const", momentum))), running.shape,
                       running.dtype)

    low.bind(node.outputs[3], update(running_mean, ("leaf", mean)))
    low.bind(node.outputs[4], update(running_var, _op("mul", ("leaf", var),
                                                      ("const", unbiased))))


def _batch_norm_backward(low: Lowering, node: Node) -> None:
    """From the saved batch mean and rstd: x̂ = (x − mean)·rstd; dx = w·rstd·(g − mean(g) −
    x̂·mean(g·x̂)) (two per-channel reductions, one fused kernel); dw = Σ g·x̂, db = Σ g."""
    g, x = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[1])
    w = _optional(node, 2)
    save_mean, save_rstd = low.view(node.inputs[5]), low.view(node.inputs[6])
    shape, rank = x.shape, len(x.shape)
    dims = tuple(d for d in range(rank) if d != 1)
    xhat = _op("mul", _op("sub", ("leaf", x), _channel(low, save_mean, shape)),
               _channel(low, save_rstd, shape))
    g_xhat = Pending(_op("mul", ("leaf", g), xhat), shape, x.dtype)
    mask = tuple(node.attrs.get("mask", (True, True, True)))
    outputs = iter(node.outputs)
    if mask[0]:
        c1 = _keepdim(emit_reduce(low, g, dims, "mean"), dims, rank)
        c2 = _keepdim(emit_reduce(low, g_xhat, dims, "mean"), dims, rank)
        scale = _channel(low, save_rstd, shape)
        if w is not None:
            scale = _op("mul", scale, _channel(low, w, shape))
        dx = _op("mul", scale, _op("sub", _op("sub", ("leaf", g), ("leaf", broadcast_view(
            c1, shape))), _op("mul", xhat, ("leaf", broadcast_view(c2, shape)))))
        low.bind(next(outputs), low.materialize(Pending(dx, shape, x.dtype)))
    if len(mask) > 1 and mask[1]:
        low.bind(next(outputs), emit_reduce(low, g_xhat, dims, "sum"))
    if len(mask) > 2 and mask[2]:
        low.bind(next(outputs), emit_reduce(low, g, dims, "sum"))


HANDLERS.update({
    "convolution": _conv2d,
    "convolution_backward": _conv2d_backward,
    "max_pool2d": _max_pool2d,
    "max_pool2d_backward": _max_pool2d_backward,
    "batch_norm": _batch_norm,
    "batch_norm_train": _batch_norm_train,
    "batch_norm_backward": _batch_norm_backward,
})
