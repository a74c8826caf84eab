"""The one table from ATen ops to IR ops.

Each entry takes the op's arguments, normalized to the ATen schema's order with defaults filled
in, and emits IR nodes through an `Emitter`. Most entries are one node; a few ATen ops become
several (addmm is matmul + add, split is slices) and aliases become nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphpar.ir.graph import Value
from graphpar.ir.registry import all_ops
from graphpar.ir.types import dtype_name

aten = torch.ops.aten

# An emitter function: (emit, args) -> a Value, a tuple of Values, or a scalar.
Lowering = Callable[["Emitter", list[Any]], Any]
TABLE: dict[Any, Lowering] = {}


class Emitter:
    """What a table entry sees: `emit(op, operands, attrs)` appends an IR node, returning its
    result (or tuple of results). The capture front end supplies the concrete one."""

    def emit(self, op: str, operands: list[Any], attrs: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError


def _on(*targets):
    def register(fn: Lowering) -> Lowering:
        for target in targets:
            TABLE[target] = fn
        return fn
    return register


def rank(v: Any) -> int:
    return v.type.rank if isinstance(v, Value) else 0


def shape(v: Value) -> tuple[int, ...]:
    return v.type.shape


def pos(dim: int, r: int) -> int:
    """Dims are stored non-negative, so sharding rules never see -1."""
    return dim % r if r else 0


def dims_of(dims, r: int) -> tuple[int, ...] | None:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(pos(d, r) for d in dims))


def dt(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else dtype_name(dtype)


def scalar(v: Any) -> Any:
    """An ATen Scalar argument as an inline IR literal."""
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise TypeError("symbolic scalars are not supported; use static shapes")
    return v


# --- elementwise ------------------------------------------------------------------------------

def _one_to_one(name: str) -> Lowering:
    return lambda e, a: e.emit(name, [scalar(x) for x in a])


# Ops declared with an ATen name (`OpDef.aten`) lower 1:1, every argument an operand: binary
# ops from their Tensor and Scalar overloads where ATen has them, others from their default.
for _op in all_ops().values():
    if _op.aten is not None:
        _packet = getattr(aten, _op.aten)
        _overloads = ("Tensor", "Scalar") if "Tensor" in _packet.overloads() else ("default",)
        for _overload in _overloads:
            TABLE[getattr(_packet, _overload)] = _one_to_one(_op.name)


@_on(aten.gelu.default)
def _gelu(e, a):
    return e.emit("gelu", [a[0]], {"approximate": a[1]} if a[1] != "none" else {})


def _scaled(e, b, alpha):
    return b if alpha == 1 else e.emit("mul", [b, scalar(alpha)])


@_on(aten.add.Tensor, aten.add.Scalar)
def _add(e, a):
    return e.emit("add", [a[0], _scaled(e, scalar(a[1]), a[2])])


@_on(aten.sub.Tensor, aten.sub.Scalar)
def _sub(e, a):
    return e.emit("sub", [a[0], _scaled(e, scalar(a[1]), a[2])])


@_on(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(e, a):
    return e.emit("sub", [scalar(a[1]), _scaled(e, a[0], a[2])])


@_on(aten.div.Tensor, aten.div.Scalar)
def _div(e, a):
    return e.emit("div", [a[0], scalar(a[1])])


@_on(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(e, a):
    return e.emit("div", [a[0], scalar(a[1])], {"rounding_mode": a[2]} if a[2] else {})


@_on(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(e, a):
    return e.emit("pow", [scalar(a[0]), scalar(a[1])])


@_on(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(e, a):
    return e.emit("where", [a[0], scalar(a[1]), scalar(a[2])])


@_on(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(e, a):
    return e.emit("where", [a[1], scalar(a[2]), a[0]])


@_on(aten.clamp.default, aten.clamp.Tensor)
def _clamp(e, a):
    x, lo, hi = a
    if isinstance(lo, Value) or isinstance(hi, Value):  # tensor bounds: elementwise max, min
        x = x if lo is None else e.emit("maximum", [x, lo])
        return x if hi is None else e.emit("minimum", [x, hi])
    return e.emit("clamp", [x], {"min": scalar(lo), "max": scalar(hi)})


@_on(aten.clamp_min.default)
def _clamp_min(e, a):
    return e.emit("clamp", [a[0]], {"min": scalar(a[1]), "max": None})


@_on(aten._to_copy.default)
def _to_copy(e, a):
    x, dtype = a[0], a[1] if len(a) > 1 else None
    if dtype is None or dtype == x.type.dtype:
        return x
    return e.emit("convert", [x], {"dtype": dt(dtype)})


@_on(aten.to.dtype)
def _to_dtype(e, a):
    return a[0] if a[1] == a[0].type.dtype else e.emit("convert", [a[0]], {"dtype": dt(a[1])})


@_on(aten.gelu_backward.default)
def _gelu_backward(e, a):
    return e.emit("gelu_backward", [a[0], a[1]], {"approximate": a[2]} if a[2] != "none" else {})


for _name in ("silu_backward", "sigmoid_backward", "tanh_backward"):
    TABLE[getattr(aten, _name).default] = (lambda name: lambda e, a: e.emit(name, [a[0], a[1]]))(
        _name)


@_on(aten.threshold_backward.default)
def _threshold_backward(e, a):
    return e.emit("threshold_backward", [a[0], a[1]], {"threshold": a[2]})


# --- reductions -------------------------------------------------------------------------------

def _reduction(name):
    def lower(e, a):
        x = a[0]
        attrs = {"dims": dims_of(a[1], rank(x)), "keepdim": bool(a[2])}
        if len(a) > 3 and a[3] is not None:
            attrs["dtype"] = dt(a[3])
        return e.emit(name, [x], attrs)
    return lower


def _full_reduction(name):
    def lower(e, a):
        attrs = {"dims": None, "keepdim": False}
        if len(a) > 1 and a[1] is not None:
            attrs["dtype"] = dt(a[1])
        return e.emit(name, [a[0]], attrs)
    return lower


TABLE[aten.sum.dim_IntList] = _reduction("sum")
TABLE[aten.sum.default] = _full_reduction("sum")
TABLE[aten.mean.dim] = _reduction("mean")
TABLE[aten.mean.default] = _full_reduction("mean")
TABLE[aten.amax.default] = _reduction("amax")
TABLE[aten.amin.default] = _reduction("amin")
TABLE[aten.any.dims] = _reduction("any")
TABLE[aten.any.dim] = _reduction("any")
TABLE[aten.all.dim] = _reduction("all")
TABLE[aten.any.default] = _full_reduction("any")


@_on(aten.linalg_vector_norm.default)
def _vector_norm(e, a):
    """‖x‖ₚ over dims as reductions: √Σx² for p=2 (weight normalization's), Σ|x|, max |x|,
    (Σ|x|ᵖ)^(1/p) otherwise."""
    x, p, dims, keepdim, dtype = a
    if dtype is not None:
        x = e.emit("convert", [x], {"dtype": dt(dtype)})
    attrs = {"dims": dims_of(dims, rank(x)), "keepdim": bool(keepdim)}
    if p == 2:
        return e.emit("sqrt", [e.emit("sum", [e.emit("mul", [x, x])], attrs)])
    size = e.emit("abs", [x])
    if p == float("inf"):
        return e.emit("amax", [size], attrs)
    if p == 1:
        return e.emit("sum", [size], attrs)
    if p == 0 or p == float("-inf"):
        raise TypeError(f"vector norm of order {p} is not supported")
    return e.emit("pow", [e.emit("sum", [e.emit("pow", [size, p])], attrs), 1 / p])


@_on(aten._weight_norm_interface_backward.default)
def _weight_norm_backward(e, a):
    """Weight normalization w = g·v/‖v‖ (norms over every dim but `dim`), differentiated:
    dg = Σ(dw·v)/‖v‖, dv = (g/‖v‖)·(dw - v·dg/‖v‖)."""
    grad, v, g, norms, dim = a
    others = tuple(d for d in range(rank(v)) if d != pos(dim, rank(v)))
    dg = e.emit("div", [e.emit("sum", [e.emit("mul", [grad, v])],
                               {"dims": others, "keepdim": True}), norms])
    scale = e.emit("div", [g, norms])
    along = e.emit("mul", [v, e.emit("div", [dg, norms])])
    dv = e.emit("mul", [scale, e.emit("sub", [grad, along])])
    return dv, dg


@_on(aten.var.correction)
def _var(e, a):
    x = a[0]
    correction = 1 if a[2] is None else a[2]
    return e.emit("var", [x], {"dims": dims_of(a[1], rank(x)), "correction": correction,
                               "keepdim": bool(a[3])})


@_on(aten.var_mean.correction)
def _var_mean(e, a):
    x, dims, correction, keepdim = a[0], dims_of(a[1], rank(a[0])), a[2], bool(a[3])
    correction = 1 if correction is None else correction
    return (e.emit("var", [x], {"dims": dims, "correction": correction, "keepdim": keepdim}),
            e.emit("mean", [x], {"dims": dims, "keepdim": keepdim}))


TABLE[aten.argmax.default] = lambda e, a: e.emit("argmax", [a[0]], {"dim": pos(a[1], rank(a[0])),
                                                                    "keepdim": bool(a[2])})
TABLE[aten.argmin.default] = lambda e, a: e.emit("argmin", [a[0]], {"dim": pos(a[1], rank(a[0])),
                                                                    "keepdim": bool(a[2])})


@_on(aten.max.dim)
def _max_dim(e, a):
    x, dim, keepdim = a[0], pos(a[1], rank(a[0])), bool(a[2])
    return (e.emit("amax", [x], {"dims": (dim,), "keepdim": keepdim}),
            e.emit("argmax", [x], {"dim": dim, "keepdim": keepdim}))


@_on(aten.cumsum.default)
def _cumsum(e, a):
    attrs = {"dim": pos(a[1], rank(a[0]))}
    if a[2] is not None:
        attrs["dtype"] = dt(a[2])
    return e.emit("cumsum", [a[0]], attrs)


@_on(aten.topk.default)
def _topk(e, a):
    return e.emit("topk", [a[0]], {"k": a[1], "dim": pos(a[2], rank(a[0])), "largest": a[3],
                                   "sorted": a[4]})


@_on(aten.sort.default)
def _sort(e, a):
    return e.emit("sort", [a[0]], {"dim": pos(a[1], rank(a[0])), "descending": a[2]})


# --- matmul -----------------------------------------------------------------------------------

@_on(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _matmul(e, a):
    return e.emit("matmul", [a[0], a[1]])


@_on(aten.addmm.default)
def _addmm(e, a):
    bias, x, w, beta, alpha = a
    product = _scaled(e, e.emit("matmul", [x, w]), alpha)
    return e.emit("add", [product, _scaled(e, bias, beta)])


@_on(aten.linear.default)
def _linear(e, a):
    return e.emit("linear", [a[0], a[1], a[2]])


# --- shape ------------------------------------------------------------------------------------

def reshape(e, x, new_shape):
    new_shape = tuple(int(d) for d in new_shape)
    if -1 in new_shape:
        known = 1
        for d in new_shape:
            known *= d if d != -1 else 1
        new_shape = tuple(x.type.numel // known if d == -1 else d for d in new_shape)
    return x if new_shape == shape(x) else e.emit("reshape", [x], {"shape": new_shape})


TABLE[aten.view.default] = lambda e, a: reshape(e, a[0], a[1])
TABLE[aten.reshape.default] = lambda e, a: reshape(e, a[0], a[1])
TABLE[aten._unsafe_view.default] = lambda e, a: reshape(e, a[0], a[1])


@_on(aten.unsqueeze.default)
def _unsqueeze(e, a):
    x = a[0]
    d = pos(a[1], rank(x) + 1)
    return reshape(e, x, shape(x)[:d] + (1,) + shape(x)[d:])


@_on(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(e, a):
    x = a[0]
    dims = dims_of(a[1], rank(x)) if len(a) > 1 else None
    dims = dims if dims is not None else range(rank(x))
    return reshape(e, x, tuple(s for i, s in enumerate(shape(x)) if not (i in dims and s == 1)))


@_on(aten.flatten.using_ints)
def _flatten(e, a):
    x = a[0]
    start, end = pos(a[1], rank(x)), pos(a[2], rank(x))
    s = shape(x)
    merged = 1
    for d in s[start:end + 1]:
        merged *= d
    return reshape(e, x, s[:start] + (merged,) + s[end + 1:])


def permute(e, x, dims):
    dims = tuple(pos(d, rank(x)) for d in dims)
    return x if dims == tuple(range(rank(x))) else e.emit("permute", [x], {"dims": dims})


TABLE[aten.permute.default] = lambda e, a: permute(e, a[0], a[1])


@_on(aten.transpose.int)
def _transpose(e, a):
    x = a[0]
    dims = list(range(rank(x)))
    i, j = pos(a[1], rank(x)), pos(a[2], rank(x))
    dims[i], dims[j] = dims[j], dims[i]
    return permute(e, x, dims)


@_on(aten.t.default, aten.numpy_T.default)
def _t(e, a):
    return permute(e, a[0], list(range(rank(a[0])))[::-1])


@_on(aten.expand.default)
def _expand(e, a):
    x, new = a[0], list(a[1])
    offset = len(new) - rank(x)
    new = [shape(x)[i - offset] if d == -1 else d for i, d in enumerate(new)]
    return x if tuple(new) == shape(x) else e.emit("expand", [x], {"shape": tuple(new)})


def slice_(e, x, dim, start, end, step=1):
    size = shape(x)[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = max(0, min(start, size)), max(0, min(end, size))
    if (start, end, step) == (0, size, 1):
        return x
    return e.emit("slice", [x], {"dim": dim, "start": start, "end": end, "step": step})


@_on(aten.slice.Tensor)
def _slice(e, a):
    return slice_(e, a[0], pos(a[1], rank(a[0])), a[2], a[3], a[4])


@_on(aten.narrow.default)
def _narrow(e, a):
    return slice_(e, a[0], pos(a[1], rank(a[0])), a[2], a[2] + a[3])


@_on(aten.slice_scatter.default)
def _slice_scatter(e, a):
    x, src, dim, start, end, step = a
    dim = pos(dim, rank(x))
    size = shape(x)[dim]
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    return e.emit("slice_scatter", [x, src], {"dim": dim, "start": start, "end": end,
                                              "step": step})


@_on(aten.select_scatter.default)
def _select_scatter(e, a):
    x, src, dim, index = a
    dim = pos(dim, rank(x))
    index = index + shape(x)[dim] if index < 0 else index
    return e.emit("select_scatter", [x, src], {"dim": dim, "index": index})


@_on(aten.select.int)
def _select(e, a):
    x, dim = a[0], pos(a[1], rank(a[0]))
    index = a[2] + shape(x)[dim] if a[2] < 0 else a[2]
    return e.emit("select", [x], {"dim": dim, "index": index})


@_on(aten.split.Tensor, aten.split_with_sizes.default)
def _split(e, a):
    x, dim = a[0], pos(a[2], rank(a[0]))
    size = shape(x)[dim]
    sizes = a[1] if isinstance(a[1], (list, tuple)) else [min(a[1], size - s)
                                                          for s in range(0, size, a[1])]
    parts, start = [], 0
    for s in sizes:
        parts.append(slice_(e, x, dim, start, start + s))
        start += s
    return tuple(parts)


@_on(aten.chunk.default)
def _chunk(e, a):
    size = shape(a[0])[pos(a[2], rank(a[0]))]
    return _split(e, [a[0], -(-size // a[1]), a[2]])


@_on(aten.unbind.int)
def _unbind(e, a):
    x, dim = a[0], pos(a[1], rank(a[0]))
    return tuple(e.emit("select", [x], {"dim": dim, "index": i}) for i in range(shape(x)[dim]))


@_on(aten.cat.default)
def _cat(e, a):
    xs = [x for x in a[0] if x.type.numel > 0 or len(a[0]) == 1]
    if len(xs) == 1:
        return xs[0]
    return e.emit("cat", xs, {"dim": pos(a[1], rank(xs[0]))})


@_on(aten.stack.default)
def _stack(e, a):
    dim = pos(a[1], rank(a[0][0]) + 1)
    parts = [reshape(e, x, shape(x)[:dim] + (1,) + shape(x)[dim:]) for x in a[0]]
    return parts[0] if len(parts) == 1 else e.emit("cat", parts, {"dim": dim})


@_on(aten.constant_pad_nd.default)
def _pad(e, a):
    return e.emit("pad", [a[0]], {"pad": tuple(a[1]), "value": float(a[2])})


@_on(aten.flip.default)
def _flip(e, a):
    return e.emit("flip", [a[0]], {"dims": dims_of(a[1], rank(a[0]))})


TABLE[aten.tril.default] = lambda e, a: e.emit("tril", [a[0]], {"diagonal": a[1]})
TABLE[aten.triu.default] = lambda e, a: e.emit("triu", [a[0]], {"diagonal": a[1]})
TABLE[aten.repeat.default] = lambda e, a: e.emit("repeat", [a[0]], {"repeats": tuple(a[1])})

@_on(aten.native_dropout.default)
def _dropout(e, a):
    x, p, train = a
    if train and p > 0:
        raise TypeError(f"dropout (p={p}) is random and not supported: set dropout "
                        "probabilities to 0 or call .eval() before capture")
    return x, full(e, shape(x), True, torch.bool)


@_on(aten.copy.default)
def _copy(e, a):
    """A functionalized `x.copy_(src)`: src in x's dtype, broadcast to x's shape."""
    x, src = a[0], a[1]
    if not isinstance(src, Value):
        return full(e, shape(x), src, x.type.dtype)
    src = _to_dtype(e, [src, x.type.dtype])
    return _expand(e, [src, shape(x)])


# Runtime checks of dtype/shape that torch.export leaves in; static types already say so.
TABLE[aten._assert_tensor_metadata.default] = lambda e, a: None

# Copies and aliases carry no computation in a functional IR.
for _target in (aten.clone.default, aten.contiguous.default, aten.alias.default,
                aten.detach.default, aten.lift_fresh_copy.default, aten.dropout.default):
    TABLE[_target] = lambda e, a: a[0]


# --- indexing ---------------------------------------------------------------------------------

def _present(indices) -> tuple[list[Value], tuple[int, ...]]:
    present = [(d, i) for d, i in enumerate(indices) if i is not None]
    return [i for _, i in present], tuple(d for d, _ in present)


@_on(aten.index.Tensor)
def _index_tensor(e, a):
    idx, dims = _present(a[1])
    return e.emit("index", [a[0], *idx], {"dims": dims})


@_on(aten.index_put.default)
def _index_put(e, a):
    idx, dims = _present(a[1])
    return e.emit("index_put", [a[0], a[2], *idx], {"dims": dims, "accumulate": bool(a[3])})


@_on(aten.index_select.default)
def _index_select(e, a):
    return e.emit("index_select", [a[0], a[2]], {"dim": pos(a[1], rank(a[0]))})


@_on(aten.gather.default)
def _gather(e, a):
    return e.emit("gather", [a[0], a[2]], {"dim": pos(a[1], rank(a[0]))})


@_on(aten.scatter_add.default)
def _scatter_add(e, a):
    return e.emit("scatter_add", [a[0], a[2], a[3]], {"dim": pos(a[1], rank(a[0]))})


@_on(aten.scatter.src)
def _scatter(e, a):
    return e.emit("scatter", [a[0], a[2], a[3]], {"dim": pos(a[1], rank(a[0]))})


@_on(aten.scatter.value)
def _scatter_value(e, a):
    src = full(e, shape(a[2]), a[3], a[0].type.dtype)
    return e.emit("scatter", [a[0], a[2], src], {"dim": pos(a[1], rank(a[0]))})


@_on(aten.index_add.default)
def _index_add(e, a):
    x, dim, index, src, alpha = a
    return e.emit("index_add", [x, index, _scaled(e, src, alpha)], {"dim": pos(dim, rank(x))})


@_on(aten.histc.default)
def _histc(e, a):
    x, bins, lo, hi = a
    return e.emit("histc", [x], {"bins": bins, "min": scalar(lo), "max": scalar(hi)})


@_on(aten.bincount.default)
def _bincount(e, a):
    raise TypeError("bincount's result length depends on the values counted, and graphpar's "
                    "shapes are static: count into a fixed number of bins with "
                    "torch.histc(x.float(), bins=n, min=0, max=n - 1) instead")


# --- mixture of experts -----------------------------------------------------------------------

def grouped_mm(e, a, b, offs):
    """ATen's grouped matmul: `offs` holds each group's end; the IR op takes each group's start
    as well (the previous end, 0 for the first), so a device holding some experts' weights and
    bounds knows their rows without the others'."""
    if offs is None:  # no groups: a batched matmul
        return e.emit("matmul", [a, b])
    if rank(a) != 2 or rank(b) not in (2, 3):
        raise TypeError(f"grouped matmul of {a.type} and {b.type}: only a 2-D left operand "
                        "(rows or contraction grouped) is supported")
    groups = shape(offs)[0]
    starts = _pad(e, [slice_(e, offs, 0, 0, groups - 1), (1, 0), 0]) if groups > 1 else \
        full(e, (1,), 0, offs.type.dtype)
    return e.emit("grouped_mm", [a, b, starts, offs])


@_on(aten._grouped_mm.default)
def _aten_grouped_mm(e, a):
    x, w, offs, bias, out_dtype = a
    if bias is not None:
        raise TypeError("grouped matmul with a bias is not supported: add the bias after it")
    out = grouped_mm(e, x, w, offs)
    return out if out_dtype is None else _to_dtype(e, [out, out_dtype])


def _grouped_mm_backward(e, a):
    """Gradients of grouped_mm(x [S, K], w [E, K, N]): dx = per group grad @ w[e]^T and
    dw[e] = x[group]^T @ grad[group]."""
    x, w, offs, grad = a
    dx = grouped_mm(e, grad, permute(e, w, (0, 2, 1)), offs)
    dw = grouped_mm(e, permute(e, x, (1, 0)), grad, offs)
    return dx, dw


# Library ops that stand for a grouped matmul, by qualified name: they exist only once their
# library is imported (Hugging Face transformers registers these for its MoE experts where
# torch's grouped matmul does not apply, e.g. float32 under torch.export).
BY_NAME: dict[str, Lowering] = {
    "transformers::grouped_mm_fallback": lambda e, a: grouped_mm(e, *a),
    "transformers::grouped_mm_fallback_backward": _grouped_mm_backward,
}


def lowering_for(target: Any) -> Lowering | None:
    """The table entry of an fx call target: by the op itself, or by its qualified name."""
    found = TABLE.get(target)
    if found is None and isinstance(target, torch._ops.OpOverload):
        found = BY_NAME.get(target.name())
    return found


# --- creation ---------------------------------------------------------------------------------

def full(e, shape_, value, dtype):
    return e.emit("full", [], {"shape": tuple(shape_), "value": scalar(value),
                               "dtype": dt(dtype or torch.float32)})


def _default_dtype(value) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, int) else torch.float32


TABLE[aten.full.default] = lambda e, a: full(e, a[0], a[1], a[2] or _default_dtype(a[1]))
TABLE[aten.zeros.default] = lambda e, a: full(e, a[0], 0, a[1])
TABLE[aten.ones.default] = lambda e, a: full(e, a[0], 1, a[1])
TABLE[aten.empty.memory_format] = lambda e, a: full(e, a[0], 0, a[1])
TABLE[aten.scalar_tensor.default] = lambda e, a: full(e, (), a[0], a[1])
TABLE[aten.full_like.default] = lambda e, a: full(e, shape(a[0]), a[1], a[2] or a[0].type.dtype)
TABLE[aten.zeros_like.default] = lambda e, a: full(e, shape(a[0]), 0, a[1] or a[0].type.dtype)
TABLE[aten.ones_like.default] = lambda e, a: full(e, shape(a[0]), 1, a[1] or a[0].type.dtype)
TABLE[aten.empty_permuted.default] = lambda e, a: full(e, a[0], 0, a[2])
TABLE[aten.empty_like.default] = lambda e, a: full(e, shape(a[0]), 0, a[1] or a[0].type.dtype)
TABLE[aten.new_zeros.default] = lambda e, a: full(e, a[1], 0, a[2] or a[0].type.dtype)
TABLE[aten.new_ones.default] = lambda e, a: full(e, a[1], 1, a[2] or a[0].type.dtype)
TABLE[aten.new_full.default] = lambda e, a: full(e, a[1], a[2], a[3] or a[0].type.dtype)
TABLE[aten.new_empty.default] = lambda e, a: full(e, a[1], 0, a[2] or a[0].type.dtype)
# Values in the IR have no strides, and an empty tensor's contents are whatever the op that
# fills it writes (autograd makes one for a strided gradient, then copies into it).
TABLE[aten.new_empty_strided.default] = lambda e, a: full(e, a[1], 0, a[3] or a[0].type.dtype)


def arange(e, start, end, step, dtype):
    if dtype is None:
        dtype = torch.int64 if all(isinstance(v, int) for v in (start, end, step)) else \
            torch.float32
    return e.emit("arange", [], {"start": start, "end": end, "step": step, "dtype": dt(dtype)})


TABLE[aten.arange.default] = lambda e, a: arange(e, 0, a[0], 1, a[1])
TABLE[aten.arange.start] = lambda e, a: arange(e, a[0], a[1], 1, a[2])
TABLE[aten.arange.start_step] = lambda e, a: arange(e, a[0], a[1], a[2], a[3])


# --- composites -------------------------------------------------------------------------------

@_on(aten.scaled_dot_product_attention.default)
def _sdpa(e, a):
    q, k, v, mask, dropout, causal, scale, gqa = a
    if dropout:
        raise TypeError("attention dropout is not supported; capture in eval mode or set p=0")
    attrs = {"causal": bool(causal), "scale": scale, "gqa": bool(gqa)}
    return e.emit("attention", [q, k, v, mask], attrs)


@_on(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_train(e, a):
    q, k, v, dropout, causal, mask, scale = a
    if dropout:
        raise TypeError("attention dropout is not supported; capture with p=0")
    return e.emit("attention_with_lse", [q, k, v, mask], {"causal": bool(causal), "scale": scale})


@_on(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_backward(e, a):
    grad, q, k, v, out, lse, dropout, causal, mask, scale = a
    return e.emit("attention_backward", [grad, q, k, v, out, lse, mask],
                  {"causal": bool(causal), "scale": scale})


@_on(aten.layer_norm.default)
def _layer_norm(e, a):
    x, shape_, w, b, eps = a[:5]
    return e.emit("layer_norm", [x, w, b], {"shape": tuple(shape_), "eps": eps})


@_on(aten.native_layer_norm.default)
def _native_layer_norm(e, a):
    x, shape_, w, b, eps = a
    return e.emit("layer_norm_with_stats", [x, w, b], {"shape": tuple(shape_), "eps": eps})


@_on(aten.native_layer_norm_backward.default)
def _layer_norm_backward(e, a):
    grad, x, shape_, mean, rstd, w, b, mask = a
    mask = tuple(bool(m) for m in mask)
    results = iter(e.emit("layer_norm_backward", [grad, x, mean, rstd, w, b],
                          {"shape": tuple(shape_), "mask": mask}))
    return tuple(next(results) if m else None for m in mask)


def _groups_of(e, x, n, groups):
    """x [N, C, *space] as [N, groups, C/groups·space]: group norm is a layer norm over the
    last dim of this view (and shards as one, by batch and group). Its backward reaches
    capture already taken apart by torch's core decompositions."""
    return e.emit("reshape", [x], {"shape": (n, groups, x.type.numel // (n * groups))})


def _per_channel(e, w, x):
    """A [C] weight as [C, 1, ...] to broadcast over x [N, C, *space]."""
    return e.emit("reshape", [w], {"shape": (w.type.shape[0],) + (1,) * (rank(x) - 2)})


@_on(aten.native_group_norm.default)
def _group_norm(e, a):
    x, w, b, n, _, _, groups, eps = a
    grouped = _groups_of(e, x, n, groups)
    y, mean, rstd = e.emit("layer_norm_with_stats", [grouped, None, None],
                           {"shape": (grouped.type.shape[-1],), "eps": eps})
    y = e.emit("reshape", [y], {"shape": shape(x)})
    if w is not None:
        y = e.emit("mul", [y, _per_channel(e, w, x)])
    if b is not None:
        y = e.emit("add", [y, _per_channel(e, b, x)])
    stats = {"shape": (n, groups)}
    return y, e.emit("reshape", [mean], stats), e.emit("reshape", [rstd], stats)


@_on(aten.rms_norm.default)
def _rms_norm(e, a):
    x, shape_, w, eps = a
    return e.emit("rms_norm", [x, w], {"shape": tuple(shape_), "eps": eps})


@_on(aten._softmax.default, aten.softmax.int)
def _softmax(e, a):
    x = a[0]
    if len(a) > 2 and isinstance(a[2], torch.dtype):
        x = _to_dtype(e, [x, a[2]])
    return e.emit("softmax", [x], {"dim": pos(a[1], rank(a[0]))})


@_on(aten._log_softmax.default, aten.log_softmax.int)
def _log_softmax(e, a):
    x = a[0]
    if len(a) > 2 and isinstance(a[2], torch.dtype):
        x = _to_dtype(e, [x, a[2]])
    return e.emit("log_softmax", [x], {"dim": pos(a[1], rank(a[0]))})


@_on(aten._softmax_backward_data.default)
def _softmax_backward(e, a):
    return e.emit("softmax_backward", [a[0], a[1]], {"dim": pos(a[2], rank(a[1]))})


@_on(aten._log_softmax_backward_data.default)
def _log_softmax_backward(e, a):
    return e.emit("log_softmax_backward", [a[0], a[1]], {"dim": pos(a[2], rank(a[1]))})


@_on(aten.embedding.default)
def _embedding(e, a):
    return e.emit("embedding", [a[0], a[1]])


@_on(aten.embedding_dense_backward.default)
def _embedding_backward(e, a):
    grad, idx, num_weights, padding_idx, scale_grad = a
    if scale_grad:
        raise TypeError("embedding with scale_grad_by_freq is not supported")
    return e.emit("embedding_backward", [grad, idx], {"num_weights": num_weights,
                                                       "padding_idx": padding_idx})


def _conv_attrs(stride, padding, dilation, groups, transposed=False, output_padding=()):
    attrs = {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation),
             "groups": groups}
    if transposed:
        attrs.update(transposed=True, output_padding=tuple(output_padding))
    return attrs


@_on(aten.convolution.default)
def _convolution(e, a):
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = a
    if rank(x) != rank(w):
        raise TypeError("convolution of an unbatched input is not supported; add a batch dim")
    return e.emit("convolution", [x, w, b],
                  _conv_attrs(stride, padding, dilation, groups, transposed, output_padding))


@_on(aten.conv2d.default)
def _conv2d(e, a):
    x, w, b, stride, padding, dilation, groups = a
    if rank(x) != 4:
        raise TypeError("conv2d of an unbatched input is not supported; add a batch dim")
    return e.emit("convolution", [x, w, b], _conv_attrs(stride, padding, dilation, groups))


@_on(aten.convolution_backward.default)
def _conv_backward(e, a):
    grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, \
        mask = a
    mask = tuple(bool(m) for m in mask)
    attrs = _conv_attrs(stride, padding, dilation, groups, transposed, output_padding)
    attrs.update(bias=bias_sizes is not None, mask=mask)
    results = iter(e.emit("convolution_backward", [grad, x, w], attrs))
    return tuple(next(results) if m else None for m in mask)


@_on(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(e, a):
    x, w, b, mean, var, momentum, eps = a
    out = e.emit("batch_norm", [x, w, b, mean, var], {"momentum": momentum, "eps": eps})
    return out, None, None


@_on(aten._native_batch_norm_legit_functional.default)
def _batch_norm_train(e, a):
    x, w, b, mean, var, training, momentum, eps = a
    if not training:
        return _batch_norm_eval(e, [x, w, b, mean, var, momentum, eps])
    return e.emit("batch_norm_train", [x, w, b, mean, var], {"momentum": momentum, "eps": eps})


@_on(aten.native_batch_norm_backward.default)
def _batch_norm_backward(e, a):
    grad, x, w, mean, var, save_mean, save_rstd, train, eps, mask = a
    if not train:
        raise TypeError("batch norm backward in eval mode is not supported")
    mask = tuple(bool(m) for m in mask)
    results = iter(e.emit("batch_norm_backward", [grad, x, w, mean, var, save_mean, save_rstd],
                          {"eps": eps, "mask": mask}))
    return tuple(next(results) if m else None for m in mask)


def _pool_attrs(kernel, stride, padding, dilation, ceil_mode):
    pair = lambda v: tuple(v) * (2 // len(v)) if len(v) in (1, 2) else tuple(v)  # noqa: E731
    return {"kernel": pair(kernel), "stride": pair(stride or kernel), "padding": pair(padding),
            "dilation": pair(dilation), "ceil_mode": bool(ceil_mode)}


@_on(aten.max_pool2d_with_indices.default)
def _max_pool(e, a):
    return e.emit("max_pool2d", [a[0]], _pool_attrs(*a[1:]))


@_on(aten.max_pool2d.default)
def _max_pool_values(e, a):
    return _max_pool(e, a)[0]


@_on(aten.max_pool2d_with_indices_backward.default)
def _max_pool_backward(e, a):
    grad, x, kernel, stride, padding, dilation, ceil_mode, indices = a
    return e.emit("max_pool2d_backward", [grad, x, indices],
                  _pool_attrs(kernel, stride, padding, dilation, ceil_mode))


MEAN, SUM = 1, 2  # ATen's reduction codes


@_on(aten.nll_loss_forward.default)
def _nll_loss(e, a):
    """A mean loss becomes sum / total weight: sums of shards add up, means do not."""
    x, target, weight, reduction, ignore_index = a
    attrs = {"reduction": SUM if reduction == MEAN else reduction, "ignore_index": ignore_index}
    loss, total_weight = e.emit("nll_loss", [x, target, weight], attrs)
    if reduction == MEAN:
        loss = e.emit("div", [loss, total_weight])
    return loss, total_weight


@_on(aten.nll_loss_backward.default)
def _nll_loss_backward(e, a):
    grad, x, target, weight, reduction, ignore_index, total_weight = a
    return e.emit("nll_loss_backward", [grad, x, target, total_weight, weight],
                  {"reduction": reduction, "ignore_index": ignore_index})


# Composite ATen ops kept whole at capture (not decomposed), because IR ops stand for them.
PRESERVED = [
    aten.linear.default, aten.layer_norm.default, aten.rms_norm.default,
    aten.scaled_dot_product_attention.default, aten.softmax.int, aten.log_softmax.int,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.native_layer_norm_backward.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.gelu_backward.default,
    aten.embedding_dense_backward.default, aten.nll_loss_forward.default,
    aten.nll_loss_backward.default, aten.native_batch_norm_backward.default,
    aten.silu_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default,
    aten.threshold_backward.default, aten.conv2d.default,
    aten.max_pool2d_with_indices_backward.default, aten.index_add.default,
]
