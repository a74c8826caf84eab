"""lower-cuda for elementwise ops (pending expressions) and for views and copies."""

from __future__ import annotations

import math
from typing import Any

from graphpar.errors import UnsupportedOpError
from graphpar.ir.graph import Node
from graphpar.ir.types import dtype_name
from graphpar.passes.lower_cuda.lowering import HANDLERS, Lowering
from graphpar.passes.lower_cuda.values import (
    Pending,
    View,
    as_expr,
    broadcast_view,
    contiguous_strides,
    map_leaves,
    permute_view,
)


def _elementwise(low: Lowering, node: Node) -> None:
    out = node.output.type
    args = tuple(as_expr(low.operand(x), out.shape) for x in node.inputs)
    attrs = tuple(sorted(node.attrs.items()))
    low.bind(node.output, Pending(("apply", node.op, args, attrs), out.shape, out.dtype))


def _full(low: Lowering, node: Node) -> None:
    t = node.output.type
    value = node.attrs["value"]
    expr = ("apply", "convert", (("const", value),), (("dtype", dtype_name(t.dtype)),))
    low.bind(node.output, Pending(expr, t.shape, t.dtype))


# ------------------------------------------------------------------------- views

def _reshape(low: Lowering, node: Node) -> None:
    x = low.operand(node.inputs[0])
    t = node.output.type
    if isinstance(x, Pending) and math.prod(x.shape) == 1:
        low.bind(node.output, Pending(map_leaves(x.expr, lambda v: View(
            v.buf, v.offset, t.shape, (0,) * len(t.shape), v.dtype)), t.shape, t.dtype))
        return
    v = low.contiguous(node.inputs[0])
    low.bind(node.output, View(v.buf, v.offset, t.shape, contiguous_strides(t.shape), v.dtype))


def _permute(low: Lowering, node: Node) -> None:
    x = low.operand(node.inputs[0])
    dims = node.attrs["dims"]
    dims = tuple(d % len(dims) for d in dims)
    if isinstance(x, Pending):
        shape = tuple(x.shape[d] for d in dims)
        low.bind(node.output, Pending(map_leaves(x.expr, lambda v: permute_view(v, dims)),
                                      shape, x.dtype))
    else:
        low.bind(node.output, permute_view(x, dims))


def _expand(low: Lowering, node: Node) -> None:
    x = low.operand(node.inputs[0])
    shape = node.output.type.shape
    if isinstance(x, Pending):
        low.bind(node.output, Pending(as_expr(x, shape), shape, x.dtype))
    else:
        low.bind(node.output, broadcast_view(x, shape))


def _slice(low: Lowering, node: Node) -> None:
    v = low.view(node.inputs[0])
    a = node.attrs
    dim = a["dim"] % len(v.shape)
    size = v.shape[dim]
    start = 0 if a.get("start") is None else a["start"]
    end = size if a.get("end") is None else a["end"]
    start = max(0, min(size, start + size if start < 0 else start))
    end = max(start, min(size, end + size if end < 0 else end))
    step = a.get("step", 1)
    shape = list(v.shape)
    strides = list(v.strides)
    shape[dim] = node.output.type.shape[dim]
    strides[dim] *= step
    low.bind(node.output, View(v.buf, v.offset + start * v.strides[dim], tuple(shape),
                               tuple(strides), v.dtype))


def _select(low: Lowering, node: Node) -> None:
    v = low.view(node.inputs[0])
    dim = node.attrs["dim"] % len(v.shape)
    index = node.attrs["index"] % v.shape[dim]
    low.bind(node.output, View(v.buf, v.offset + index * v.strides[dim],
                               v.shape[:dim] + v.shape[dim + 1:],
                               v.strides[:dim] + v.strides[dim + 1:], v.dtype))


def _clone(low: Lowering, node: Node) -> None:
    low.bind(node.output, low.operand(node.inputs[0]))


def copy_into(low: Lowering, out: View, dim: int, start: int, source: Any) -> None:
    """Copy `source` (a view or pending expression) into `out` from `start` along `dim`."""
    shape = list(out.shape)
    shape[dim] = source.shape[dim]
    target = View(out.buf, out.offset + start * out.strides[dim], tuple(shape), out.strides,
                  out.dtype)
    low.materialize(Pending(as_expr(source, tuple(shape)), tuple(shape), out.dtype),
                    target)


def _cat(low: Lowering, node: Node) -> None:
    t = node.output.type
    dim = node.attrs["dim"] % len(t.shape)
    out = low.new_view(t.shape, t.dtype)
    start = 0
    for x in node.inputs:
        source = low.operand(x)
        copy_into(low, out, dim, start, source)
        start += source.shape[dim]
    low.bind(node.output, out)


def _slice_scatter(low: Lowering, node: Node) -> None:
    t = node.output.type
    a = node.attrs
    if a.get("step", 1) != 1:
        raise UnsupportedOpError("slice_scatter with a step other than 1")
    dim = a["dim"] % len(t.shape)
    start = a.get("start") or 0
    start = start + t.shape[dim] if start < 0 else start
    out = low.new_view(t.shape, t.dtype)
    low.materialize(Pending(as_expr(low.operand(node.inputs[0]), t.shape), t.shape,
                            t.dtype), out)
    copy_into(low, out, dim, start, low.operand(node.inputs[1]))
    low.bind(node.output, out)



HANDLERS.update({
    "<elementwise>": _elementwise,
    "full": _full,
    "reshape": _reshape,
    "permute": _permute,
    "expand": _expand,
    "slice": _slice,
    "select": _select,
    "clone": _clone,
    "cat": _cat,
    "slice_scatter": _slice_scatter,
})
