"""lower-cuda for the ops a mixture of experts routes tokens with: top-k, cumulative sums,
scatters, and the softmax backward."""

from __future__ import annotations

import math

from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Node, Value
from graphpar.ir.types import dtype_name
from graphpar.passes.lower_cuda.compute_ops import _index_kernel, _keepdim, emit_reduce
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.values import Pending, broadcast_view


def _lines(shape: tuple[int, ...], dim: int) -> list[tuple[str, int]]:
    """A dense tensor as lines along `dim`: (outer, length, inner)."""
    return [("outer", math.prod(shape[:dim])), ("length", shape[dim]),
            ("inner", math.prod(shape[dim + 1:]))]


def _topk(low: Lowering, node: Node) -> None:
    """One thread per line picks its k first elements in (value, index) order (sorted, which
    also answers sorted=False)."""
    x = low.contiguous(node.inputs[0])
    dim = node.attrs.get("dim", -1) % len(x.shape)
    vt, it = (o.type for o in node.outputs)
    values, indices = low.new_view(vt.shape, vt.dtype), low.new_view(it.shape, it.dtype)
    _index_kernel(low, "kernel.topk", [
        *_lines(x.shape, dim), ("k", node.attrs["k"]),
        ("largest", bool(node.attrs.get("largest", True))), ("dtype", dtype_name(x.dtype)),
        ("index_dtype", dtype_name(it.dtype)), ("x", low.addr(x)), ("values", low.addr(values)),
        ("indices", low.addr(indices))], [x], [values, indices], ("x", "values", "indices"))
    low.bind(node.outputs[0], values)
    low.bind(node.outputs[1], indices)


def _cumsum(low: Lowering, node: Node) -> None:
    """One thread per line adds along it."""
    x = low.contiguous(node.inputs[0])
    t = node.output.type
    dim = node.attrs["dim"] % len(x.shape)
    y = low.new_view(t.shape, t.dtype)
    _index_kernel(low, "kernel.cumsum", [
        *_lines(x.shape, dim), ("x_dtype", dtype_name(x.dtype)), ("y_dtype", dtype_name(t.dtype)),
        ("x", low.addr(x)), ("y", low.addr(y))], [x], [y], ("x", "y"))
    low.bind(node.output, y)


def _scatter(low: Lowering, node: Node) -> None:
    """The copy of x (none when x dies here: the scatter writes over it), then one thread per
    index element writes (scatter_add: adds) its src element."""
    if not isinstance(node.inputs[2], Value):
        raise UnsupportedOpError(f"{node.op} of a number (only a src tensor lowers)")
    idx, src = low.contiguous(node.inputs[1]), low.view(node.inputs[2])
    t = node.output.type
    x = low.view(node.inputs[0])
    others = (idx.buf, src.buf)
    if (x.whole and x.buf not in others and low.dead_after_now(x.buf, own_input=True)
            and node.inputs[0] not in node.inputs[1:]):
        out = x
    else:
        out = low.new_view(t.shape, t.dtype)
        low.materialize(Pending(("leaf", x), x.shape, x.dtype), out=out)
    _index_kernel(low, "kernel.scatter", [
        ("mode", "add" if node.op == "scatter_add" else "set"), ("dim", node.attrs["dim"] %
                                                                 len(t.shape)),
        ("out_shape", t.shape), ("index_shape", idx.shape), ("src_strides", src.strides),
        ("dtype", dtype_name(t.dtype)), ("index_dtype", dtype_name(idx.dtype)),
        ("index", low.addr(idx)), ("src", low.addr(src)), ("out", low.addr(out))],
        [idx, src, out], [out], ("index", "src", "out"))
    low.bind(node.output, out)


def _softmax_backward(low: Lowering, node: Node) -> None:
    """y · (g − Σ g·y over dim): one reduction and one fused kernel."""
    g, y = low.view(node.inputs[0]), low.view(node.inputs[1])
    rank = len(g.shape)
    dim = node.attrs["dim"] % rank
    gy = Pending(("apply", "mul", (("leaf", g), ("leaf", y)), ()), g.shape, g.dtype)
    total = broadcast_view(_keepdim(emit_reduce(low, gy, (dim,), "sum"), (dim,), rank), g.shape)
    expr = ("apply", "mul", (("leaf", y), ("apply", "sub", (("leaf", g), ("leaf", total)), ())),
            ())
    low.bind(node.output, Pending(expr, g.shape, g.dtype))


HANDLERS.update({
    "topk": _topk,
    "cumsum": _cumsum,
    "scatter": _scatter,
    "scatter_add": _scatter,
    "softmax_backward": _softmax_backward,
})
