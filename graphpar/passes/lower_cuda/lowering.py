"""Lowering one device program to a CUDA listing: the calls, then their memory plan.

Every IR value becomes either a *view* (a buffer, an element offset, a shape and strides) or a
*pending* elementwise expression over views. Views and reshapes make no call; elementwise
ops accumulate into a pending expression that one generated kernel computes when something
needs the value in memory (a GEMM, a row-wise kernel, a collective, a graph output, a second
user). GEMMs read views in place when their strides are those of a (transposed) matrix with
one uniform batch stride, and copy them contiguous first otherwise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphpar.errors import UnsupportedOpError
from graphpar.ir.cuda_listing import (
    ALIGNMENT,
    Addr,
    Apply,
    BufferSlot,
    Call,
    Const,
    Expr,
    Leaf,
    Listing,
    TensorRef,
    format_expr,
)
from graphpar.ir.graph import Graph, Node, Role, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import OpKind, get_op
from graphpar.ir.types import DTYPE_NAMES
from graphpar.ir.verify import describe
from graphpar.passes.lower_cuda.memory_plan import (
    Interval,
    aligned,
    check_fits,
    check_no_overlap,
    live_bytes_bound,
    place,
)

__all__ = ["lower_to_listing"]

STATE_ROLES = (Role.INPUT, Role.PARAM, Role.BUFFER, Role.OPTIM_STATE, Role.CONST)


# ------------------------------------------------------------------------- values

@dataclass(eq=False)
class Buf:
    """A buffer in the arena (or a graph input's place in the state region)."""

    name: str
    nbytes: int
    state: Addr | None = None  # a graph input: fixed in the state region
    output: bool = False  # a graph output lives to the end


@dataclass(frozen=True)
class View:
    """A tensor in memory: `shape` elements of `dtype` at `buf` + `offset` elements, with
    `strides` in elements (0 for a broadcast dim)."""

    buf: Buf
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    @property
    def contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape) or math.prod(self.shape) <= 1

    @property
    def whole(self) -> bool:
        """Exactly its buffer's elements, densely, in order."""
        return (self.offset == 0 and self.contiguous
                and math.prod(self.shape) * self.itemsize == self.buf.nbytes)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Pending:
    """An elementwise expression not yet in memory: leaves are views broadcast to `shape`."""

    expr: Any  # ("leaf", View) | ("const", value) | ("apply", op, (args...), attrs)
    shape: tuple[int, ...]
    dtype: torch.dtype


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def broadcast_view(v: View, shape: tuple[int, ...]) -> View:
    """`v` read as `shape` (numpy broadcasting: new leading dims and size-1 dims repeat)."""
    lead = len(shape) - len(v.shape)
    strides = [0] * lead + [0 if size == 1 and want != 1 else s
                            for size, want, s in zip(v.shape, shape[lead:], v.strides)]
    return View(v.buf, v.offset, shape, tuple(strides), v.dtype)


def permute_view(v: View, dims: Sequence[int]) -> View:
    return View(v.buf, v.offset, tuple(v.shape[d] for d in dims),
                tuple(v.strides[d] for d in dims), v.dtype)


def map_leaves(expr: Any, fn) -> Any:
    if expr[0] == "leaf":
        return ("leaf", fn(expr[1]))
    if expr[0] == "const":
        return expr
    return ("apply", expr[1], tuple(map_leaves(a, fn) for a in expr[2]), expr[3])


def leaves(expr: Any) -> list[View]:
    if expr[0] == "leaf":
        return [expr[1]]
    if expr[0] == "const":
        return []
    return [v for a in expr[2] for v in leaves(a)]


# ------------------------------------------------------------------------- the lowering

class UnsupportedLowering(UnsupportedOpError):
    """An op (or an op with these operands) has no CUDA lowering."""


@dataclass
class _CallDraft:
    kind: str
    params: list[tuple[str, Any]]  # values may be (Buf, byte offset) pairs until planned
    note: str
    reads: list[Buf] = field(default_factory=list)
    writes: list[Buf] = field(default_factory=list)


class Lowering:
    """Lowers `graph` for the device at `rank` of `mesh` (None: a single device)."""

    def __init__(self, graph: Graph, mesh: Mesh | None, rank: int):
        self.graph = graph
        self.mesh = mesh
        self.rank = rank
        self.device = mesh.device_ids[rank] if mesh is not None else 0
        self.calls: list[_CallDraft] = []
        self.env: dict[Value, View | Pending] = {}
        self.buf_values: dict[Buf, list[Value]] = {}
        self.last_use: dict[Value, int] = {}
        self.users: dict[Value, int] = {}
        self.bufs: list[Buf] = []
        self.node_index = -1
        self.current_inputs: list[Value] = []
        self.note = ""

    # --- buffers ------------------------------------------------------------------------------

    def new_buf(self, nbytes: int) -> Buf:
        buf = Buf(f"b{len(self.bufs)}", nbytes)
        self.bufs.append(buf)
        return buf

    def new_view(self, shape: Sequence[int], dtype: torch.dtype) -> View:
        shape = tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return View(self.new_buf(math.prod(shape) * itemsize), 0, shape,
                    contiguous_strides(shape), dtype)

    @staticmethod
    def addr(v: View) -> tuple[Buf, int]:
        return (v.buf, v.offset * v.itemsize)

    def emit(self, kind: str, params: list[tuple[str, Any]], reads: Sequence[View],
             writes: Sequence[View]) -> None:
        self.calls.append(_CallDraft(kind, params, self.note, [v.buf for v in reads],
                                     [v.buf for v in writes]))

    # --- values -------------------------------------------------------------------------------

    def bind(self, value: Value, x: View | Pending) -> None:
        self.env[value] = x
        if isinstance(x, View):
            self.buf_values.setdefault(x.buf, []).append(value)

    def operand(self, x: Any) -> View | Pending | Any:
        return self.env[x] if isinstance(x, Value) else x

    def view(self, value: Value) -> View:
        """`value` in memory (a pending expression is computed now, by one kernel)."""
        x = self.env[value]
        if isinstance(x, Pending):
            x = self.materialize(x)
            self.env[value] = x
            self.buf_values.setdefault(x.buf, []).append(value)
        return x

    def contiguous(self, value: Value) -> View:
        v = self.view(value)
        if v.contiguous:
            return v
        return self.materialize(Pending(("leaf", v), v.shape, v.dtype))

    def dead_after_now(self, buf: Buf, own_input: bool = False) -> bool:
        """No value in `buf` is used after the current node, nor read by an expression still
        pending, nor (unless `own_input`: the node's result may replace its one operand, as an
        in-place all-reduce does) read later by the current node's own steps: its memory may
        take the current node's result."""
        if buf.state is not None or buf.output:
            return False
        if any(self.last_use.get(v, -1) > self.node_index for v in self.buf_values.get(buf, ())):
            return False
        if not own_input and any(isinstance(self.env.get(v), View) and self.env[v].buf is buf
                                 for v in self.current_inputs):
            return False
        return not any(isinstance(x, Pending) and self.last_use.get(v, -1) > self.node_index
                       and any(leaf.buf is buf for leaf in leaves(x.expr))
                       for v, x in self.env.items())

    def materialize(self, p: Pending, out: View | None = None) -> View:
        """Compute pending expression `p` into `out` (default: a new contiguous buffer, or in
        place over an input that dies here and is read element for element)."""
        views: list[View] = []
        index: dict[tuple, int] = {}

        def number(expr: Any) -> Expr:
            if expr[0] == "leaf":
                v = expr[1]
                key = (id(v.buf), v.offset, v.strides, v.dtype)
                if key not in index:
                    index[key] = len(views)
                    views.append(v)
                return Leaf(index[key])
            if expr[0] == "const":
                return Const(expr[1])
            return Apply(expr[1], tuple(number(a) for a in expr[2]), expr[3])

        expr = number(p.expr)
        if out is None:
            out = self._in_place_target(views, p) or self.new_view(p.shape, p.dtype)
        params: list[tuple[str, Any]] = [
            ("name", None), ("shape", p.shape), ("n", math.prod(p.shape)),
            ("out", self.addr(out)), ("out_dtype", _dt(out.dtype)), ("out_strides", out.strides)]
        for i, v in enumerate(views):
            params += [(f"in{i}", self.addr(v)), (f"in{i}_dtype", _dt(v.dtype)),
                       (f"in{i}_strides", v.strides)]
        params.append(("expr", format_expr(expr)))
        params[0] = ("name", "pw_" + _digest(params[1:], drop=("out", *(f"in{i}" for i in
                                                                       range(len(views))))))
        self.emit("kernel.pointwise", params, views, [out])
        return out

    def _in_place_target(self, views: list[View], p: Pending) -> View | None:
        for v in views:
            if (v.whole and v.shape == p.shape and v.itemsize * math.prod(p.shape) == v.buf.nbytes
                    and torch.empty((), dtype=p.dtype).element_size() == v.itemsize
                    and all(w.buf is not v.buf or w == v for w in views)
                    and self.dead_after_now(v.buf)):
                return View(v.buf, 0, p.shape, contiguous_strides(p.shape), p.dtype)
        return None

    # --- the walk -----------------------------------------------------------------------------

    def run(self) -> Listing:
        graph = self.graph
        for i, node in enumerate(graph.nodes):
            for v in node.input_values:
                self.last_use[v] = i
                self.users[v] = self.users.get(v, 0) + 1
        end = len(graph.nodes)
        for o in graph.outputs:
            self.last_use[o.value] = end
            self.users[o.value] = self.users.get(o.value, 0) + 1
        inputs = self._place_inputs()
        for i, node in enumerate(graph.nodes):
            self.node_index = i
            self.current_inputs = node.input_values
            self.note = f"{describe(node, graph, i)}"
            handler = _HANDLERS.get(node.op)
            if handler is None and get_op(node.op).kind is OpKind.ELEMENTWISE:
                handler = _elementwise
            if handler is None:
                raise UnsupportedLowering(
                    f"lower-cuda: {describe(node, graph, i)} of graph @{graph.name}: op "
                    f"{node.op!r} has no CUDA lowering (supported: elementwise ops, "
                    f"{', '.join(sorted(_HANDLERS))}); run this graph on the CPU reference "
                    "or lower it before the op")
            try:
                handler(self, node)
            except UnsupportedLowering:
                raise
            except UnsupportedOpError as exc:
                raise UnsupportedLowering(f"lower-cuda: {describe(node, graph, i)}: {exc}") \
                    from None
            self.current_inputs = []  # the node's own expression may overwrite its operands
            for out in node.outputs:  # a value several nodes read is computed once
                x = self.env.get(out)
                if isinstance(x, Pending) and self.users.get(out, 0) > 1:
                    self.view(out)
        self.node_index = end
        self.current_inputs = []
        self.note = "outputs"
        outputs = []
        for o in graph.outputs:
            v = self.view(o.value)
            if v.buf.state is None:
                v.buf.output = True
            outputs.append((o, v))
        return self._plan(inputs, outputs)

    def _place_inputs(self) -> list[tuple[Value, View]]:
        placed, top = [], 0
        for value in self.graph.inputs:
            if value.role not in STATE_ROLES:
                raise UnsupportedLowering(f"lower-cuda: input %{value.name} has role "
                                          f"{value.role}")
            t = value.type
            buf = Buf(f"%{value.name}", t.nbytes, state=Addr("state", top))
            view = View(buf, 0, t.shape, contiguous_strides(t.shape), t.dtype)
            self.bind(value, view)
            placed.append((value, view))
            top += aligned(t.nbytes)
        self.state_bytes = top
        return placed

    # --- planning -----------------------------------------------------------------------------

    def _plan(self, inputs, outputs) -> Listing:
        first: dict[Buf, int] = {}
        last: dict[Buf, int] = {}
        for i, call in enumerate(self.calls):
            for b in call.writes:
                first.setdefault(b, i)
                last[b] = i
            for b in call.reads:
                first.setdefault(b, i)  # read before written: only state buffers do that
                last[b] = i
        end = len(self.calls)
        intervals: dict[Buf, Interval] = {}
        for b in self.bufs:
            if b not in first:
                continue  # never touched (a view's base that no call used)
            intervals[b] = Interval(b.name, b.nbytes, first[b], end if b.output else last[b])
        arena = place(list(intervals.values()))
        check_no_overlap(list(intervals.values()))
        self.intervals = intervals
        bound = live_bytes_bound(list(intervals.values()), end)

        def resolve(value: Any) -> Any:
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Buf):
                buf, offset = value
                base = buf.state if buf.state is not None else Addr("arena",
                                                                    intervals[buf].offset)
                return base + offset
            return value

        def ref(name: str, v: View, role: str) -> TensorRef:
            return TensorRef(name, resolve(self.addr(v)), _dt(v.dtype), v.shape, v.strides, role)

        mesh = tuple(self.mesh.shape) if self.mesh is not None else (1,)
        listing = Listing(self.graph.name, self.rank, mesh, arena, self.state_bytes, bound)
        listing.inputs = [ref(value.name, view, value.role.value) for value, view in inputs]
        listing.buffers = [BufferSlot(b.name, Addr("arena", iv.offset), b.nbytes, iv.first,
                                      iv.last) for b, iv in intervals.items()]
        listing.calls = [Call(c.kind, tuple((k, resolve(v)) for k, v in c.params), c.note)
                         for c in self.calls]
        listing.outputs = [ref(str(k), v, o.role.value if o.target is None
                               else f"{o.role.value}:{o.target}")
                           for k, (o, v) in enumerate(outputs)]
        return listing


def _dt(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def _digest(params: Sequence[tuple[str, Any]], drop: Sequence[str] = ()) -> str:
    """A kernel's name: a hash of what its source depends on (not where its operands are)."""
    text = repr([(k, v) for k, v in params if k not in drop])
    return hashlib.sha1(text.encode()).hexdigest()[:10]


# ------------------------------------------------------------------------- elementwise

def _as_expr(low: Lowering, x: Any, shape: tuple[int, ...]) -> Any:
    if isinstance(x, View):
        return ("leaf", broadcast_view(x, shape))
    if isinstance(x, Pending):
        if x.shape == shape:
            return x.expr
        return map_leaves(x.expr, lambda v: broadcast_view(v, shape))
    if isinstance(x, (bool, int, float)):
        return ("const", x)
    raise UnsupportedOpError(f"operand {x!r} is not a tensor or a number")


def _elementwise(low: Lowering, node: Node) -> None:
    out = node.output.type
    args = tuple(_as_expr(low, low.operand(x), out.shape) for x in node.inputs)
    attrs = tuple(sorted(node.attrs.items()))
    low.bind(node.output, Pending(("apply", node.op, args, attrs), out.shape, out.dtype))


def _full(low: Lowering, node: Node) -> None:
    t = node.output.type
    value = node.attrs["value"]
    expr = ("apply", "convert", (("const", value),), (("dtype", _dt(t.dtype)),))
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
        low.bind(node.output, Pending(_as_expr(low, x, shape), shape, x.dtype))
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


def _into(low: Lowering, out: View, dim: int, start: int, source: Any) -> None:
    """Copy `source` (a view or pending expression) into `out` from `start` along `dim`."""
    shape = list(out.shape)
    shape[dim] = source.shape[dim]
    target = View(out.buf, out.offset + start * out.strides[dim], tuple(shape), out.strides,
                  out.dtype)
    low.materialize(Pending(_as_expr(low, source, tuple(shape)), tuple(shape), out.dtype),
                    target)


def _cat(low: Lowering, node: Node) -> None:
    t = node.output.type
    dim = node.attrs["dim"] % len(t.shape)
    out = low.new_view(t.shape, t.dtype)
    start = 0
    for x in node.inputs:
        source = low.operand(x)
        _into(low, out, dim, start, source)
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
    low.materialize(Pending(_as_expr(low, low.operand(node.inputs[0]), t.shape), t.shape,
                            t.dtype), out)
    _into(low, out, dim, start, low.operand(node.inputs[1]))
    low.bind(node.output, out)


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
        ("A", low.addr(vb)), ("Atype", _dt(vb.dtype)), ("lda", ld_b),
        *([("strideA", stride_b)] if batched else []),
        ("B", low.addr(va)), ("Btype", _dt(va.dtype)), ("ldb", ld_a),
        *([("strideB", stride_a)] if batched else []),
        ("beta", 0.0), ("C", low.addr(out)), ("Ctype", _dt(dtype)), ("ldc", n),
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
    expr = ("apply", "add", (("leaf", out), _as_expr(low, low.operand(bias), t.shape)), ())
    low.bind(node.output, Pending(expr, t.shape, t.dtype))


def _attention_parts(low: Lowering, node: Node):
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if isinstance(mask, Value):
        raise UnsupportedOpError("attention with a mask tensor (only causal masks lower)")
    qt, kt = q.type, k.type
    vq, vk, vv = low.view(q), low.view(k), low.view(v)
    if node.attrs.get("gqa") and kt.shape[-3] != qt.shape[-3]:
        vk, vv = (_repeat_heads(low, x, qt.shape[-3]) for x in (vk, vv))
    scale = node.attrs.get("scale")
    scale = 1.0 / math.sqrt(qt.shape[-1]) if scale is None else scale
    return vq, vk, vv, scale


def _transposed(v: View) -> View:
    rank = len(v.shape)
    return permute_view(v, tuple(range(rank - 2)) + (rank - 1, rank - 2))


def _probabilities(low: Lowering, node: Node, q: View, k: View, scale: float,
                   lse: View | None = None) -> View:
    """softmax(q k^T · scale) (causal if the node says so), and its log-sum-exp per row."""
    batch, sq, sk = q.shape[:-2], q.shape[-2], k.shape[-2]
    scores = emit_gemm(low, q, _transposed(k), batch + (sq, sk), q.dtype, alpha=scale)
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
    q, k, v, scale = _attention_parts(low, node)
    lse = None
    if node.op == "attention_with_lse":
        lt = node.outputs[1].type
        lse = low.new_view(lt.shape, lt.dtype)
    probs = _probabilities(low, node, q, k, scale, lse)
    low.bind(node.outputs[0], emit_gemm(low, probs, v, node.outputs[0].type.shape, q.dtype))
    if lse is not None:
        low.bind(node.outputs[1], lse)


def _attention_backward(low: Lowering, node: Node) -> None:
    """dq, dk, dv from the recomputed probabilities P: dv = P^T do, dP = do v^T,
    dS = P (dP - rowsum(do o)), dq = dS k · scale, dk = dS^T q · scale."""
    if node.attrs.get("gqa"):
        raise UnsupportedOpError("attention_backward with grouped K/V heads")
    q, k, v, scale = _attention_parts(low, _Shifted(node))
    do, o = low.view(node.inputs[0]), low.view(node.inputs[4])
    probs = _probabilities(low, node, q, k, scale)
    shape = probs.shape
    dv = emit_gemm(low, _transposed(probs), do, node.outputs[2].type.shape, q.dtype)
    dp = emit_gemm(low, do, _transposed(v), shape, q.dtype)
    rank = len(do.shape)
    rows = emit_reduce(low, Pending(("apply", "mul", (("leaf", do), ("leaf", o)), ()), do.shape,
                                    do.dtype), (rank - 1,), "sum")
    rows = broadcast_view(_keepdim(rows, (rank - 1,), rank), shape)
    ds = low.materialize(Pending(("apply", "mul", (("leaf", probs), ("apply", "sub", (
        ("leaf", dp), ("leaf", rows)), ())), ()), shape, probs.dtype))
    dq = emit_gemm(low, ds, k, node.outputs[0].type.shape, q.dtype, alpha=scale)
    dk = emit_gemm(low, _transposed(ds), q, node.outputs[1].type.shape, q.dtype, alpha=scale)
    for value, view in zip(node.outputs, (dq, dk, dv)):
        low.bind(value, view)


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


# ------------------------------------------------------------------------- row-wise kernels

def _rowwise(low: Lowering, template: str, x: View, out: View, rows: int, cols: int,
             extra: Sequence[tuple[str, Any]] = (), weights: Sequence[View | None] = (),
             more_writes: Sequence[View] = ()) -> None:
    params: list[tuple[str, Any]] = [("name", None), ("rows", rows), ("cols", cols),
                                     ("dtype", _dt(x.dtype)), *extra,
                                     ("x", low.addr(x))]
    for label, w in zip(("w", "b"), weights):
        params.append((label, None if w is None else low.addr(w)))
    params.append(("y", low.addr(out)))
    drop = ("x", "w", "b", "y", "mean", "rstd", "lse")
    params[0] = ("name", f"{template}_" + _digest(
        [(k, v if k not in drop or v is None else "ptr") for k, v in params[1:]]))
    low.emit(f"kernel.{template}", params, [x] + [w for w in weights if w is not None],
             [out, *more_writes])


def _softmax(low: Lowering, node: Node) -> None:
    t = node.output.type
    if node.attrs["dim"] % t.rank != t.rank - 1:
        raise UnsupportedOpError("softmax over a dim other than the last")
    x = low.contiguous(node.inputs[0])
    out = low.new_view(t.shape, t.dtype)
    template = "softmax" if node.op == "softmax" else "log_softmax"
    _rowwise(low, template, x, out, rows=t.numel // t.shape[-1], cols=t.shape[-1],
             extra=[("causal", False), ("sq", 1)])
    low.bind(node.output, out)


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
        ("x", low.addr(x)), ("x_dtype", _dt(x.dtype)), ("x_strides", x.strides),
        ("y", low.addr(out)), ("y_dtype", _dt(out.dtype))]
    params[0] = ("name", "reduce_" + _digest(params[1:], drop=("x", "y")))
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
        ("cols", w.type.shape[-1]), ("vocab", w.type.shape[0]), ("dtype", _dt(t.dtype)),
        ("index_dtype", _dt(vi.dtype)), ("weight", low.addr(vw)), ("index", low.addr(vi)),
        ("y", low.addr(out))]
    params[0] = ("name", "embedding_" + _digest(params[1:], drop=("weight", "index", "y")))
    low.emit("kernel.embedding", params, [vw, vi], [out])
    low.bind(node.output, out)


def _index_kernel(low: Lowering, kind: str, params: list[tuple[str, Any]], reads, writes,
                  addresses: Sequence[str]) -> None:
    params = [("name", kind.split(".")[1] + "_" + _digest(
        [(k, "ptr" if k in addresses and v is not None else v) for k, v in params])), *params]
    low.emit(kind, params, reads, writes)


def _nll_loss(low: Lowering, node: Node) -> None:
    """-logp[i, target[i]] summed (reduction 2) or averaged (1) over rows whose target is not
    ignore_index; total_weight is the number of such rows."""
    logp, target = low.contiguous(node.inputs[0]), low.contiguous(node.inputs[1])
    if len(node.inputs) > 2 and isinstance(node.inputs[2], Value):
        raise UnsupportedOpError("nll_loss with class weights")
    if len(logp.shape) != 2:
        raise UnsupportedOpError("nll_loss over other than [rows, classes]")
    loss, total = (low.new_view(o.type.shape, o.type.dtype) for o in node.outputs)
    _index_kernel(low, "kernel.nll_loss", [
        ("rows", logp.shape[0]), ("classes", logp.shape[1]), ("dtype", _dt(logp.dtype)),
        ("target_dtype", _dt(target.dtype)), ("reduction", node.attrs.get("reduction", 1)),
        ("ignore_index", node.attrs.get("ignore_index", -100)), ("logp", low.addr(logp)),
        ("target", low.addr(target)), ("loss", low.addr(loss)),
        ("total_weight", low.addr(total))], [logp, target], [loss, total],
        ("logp", "target", "loss", "total_weight"))
    low.bind(node.outputs[0], loss)
    low.bind(node.outputs[1], total)


def _nll_loss_backward(low: Lowering, node: Node) -> None:
    g, logp, target, total = (low.contiguous(x) for x in node.inputs[:4])
    if len(node.inputs) > 4 and isinstance(node.inputs[4], Value):
        raise UnsupportedOpError("nll_loss_backward with class weights")
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    _index_kernel(low, "kernel.nll_loss_backward", [
        ("rows", t.shape[0]), ("classes", t.shape[1]), ("dtype", _dt(t.dtype)),
        ("target_dtype", _dt(target.dtype)), ("reduction", node.attrs.get("reduction", 1)),
        ("ignore_index", node.attrs.get("ignore_index", -100)), ("grad", low.addr(g)),
        ("target", low.addr(target)), ("total_weight", low.addr(total)),
        ("y", low.addr(out))], [g, target, total], [out],
        ("grad", "target", "total_weight", "y"))
    low.bind(node.output, out)


def _arange(low: Lowering, node: Node) -> None:
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    a = node.attrs
    _index_kernel(low, "kernel.arange", [("n", t.numel), ("start", a["start"]),
                                          ("step", a["step"]), ("dtype", _dt(t.dtype)),
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
        ("padding_idx", node.attrs.get("padding_idx", -1)), ("dtype", _dt(t.dtype)),
        ("index_dtype", _dt(idx.dtype)), ("grad", low.addr(g)), ("index", low.addr(idx)),
        ("y", low.addr(out))], [g, idx, out], [out], ("grad", "index", "y"))
    low.bind(node.output, out)


# ------------------------------------------------------------------------- communication

def _comm_name(axes: Sequence[int]) -> str:
    return "axes" + "_".join(map(str, axes))


def _split_leading(low: Lowering, v: View, dim: int, n: int) -> View:
    """`v` with `dim` split into n chunks, the chunk index moved to the front, dense: the
    layout NCCL's rank-major buffers have (no copy when dims before `dim` are all 1)."""
    chunk = v.shape[dim] // n
    shape = v.shape[:dim] + (n, chunk) + v.shape[dim + 1:]
    strides = v.strides[:dim] + (v.strides[dim] * chunk, v.strides[dim]) + v.strides[dim + 1:]
    order = (dim,) + tuple(d for d in range(len(shape)) if d != dim)
    packed = permute_view(View(v.buf, v.offset, shape, strides, v.dtype), order)
    if packed.contiguous:
        return packed
    return low.materialize(Pending(("leaf", packed), packed.shape, v.dtype))


def _join_leading(low: Lowering, staged: View, dim: int, shape: tuple[int, ...]) -> View:
    """The inverse: `staged` is [n, *chunk] dense; the result has the chunks along `dim`."""
    n = staged.shape[0]
    chunk_shape = staged.shape[1:]
    if all(s == 1 for s in shape[:dim]):
        return View(staged.buf, staged.offset, shape, contiguous_strides(shape), staged.dtype)
    out = low.new_view(shape, staged.dtype)
    split_shape = shape[:dim] + (n, chunk_shape[dim]) + shape[dim + 1:]
    strides = contiguous_strides(staged.shape)
    src_strides = strides[1:dim + 1] + (strides[0], strides[dim + 1]) + strides[dim + 2:]
    src = View(staged.buf, staged.offset, split_shape, src_strides, staged.dtype)
    target = View(out.buf, 0, split_shape, contiguous_strides(split_shape), out.dtype)
    low.materialize(Pending(("leaf", src), split_shape, staged.dtype), target)
    return out


def _collective(low: Lowering, node: Node) -> None:
    a = node.attrs
    axes = tuple(a["axes"])
    n = a["n"]
    comm = _comm_name(axes)
    t = node.output.type
    x = low.contiguous(node.inputs[0])
    count = math.prod(x.shape)
    dt = _dt(x.dtype)
    if node.op == "all_reduce":
        out = x if low.dead_after_now(x.buf, own_input=True) and x.whole \
            else low.new_view(t.shape, t.dtype)
        low.emit("nccl.allReduce", [("sendbuff", low.addr(x)), ("recvbuff", low.addr(out)),
                                    ("count", count), ("datatype", dt),
                                    ("op", a.get("op", "sum")), ("comm", comm)], [x], [out])
        low.bind(node.output, View(out.buf, out.offset, t.shape, contiguous_strides(t.shape),
                                   t.dtype))
    elif node.op == "all_gather":
        dim = a["dim"] % len(x.shape)
        staged = low.new_view((n,) + x.shape, x.dtype)
        low.emit("nccl.allGather", [("sendbuff", low.addr(x)), ("recvbuff", low.addr(staged)),
                                    ("sendcount", count), ("datatype", dt), ("comm", comm)],
                 [x], [staged])
        low.bind(node.output, _join_leading(low, staged, dim, t.shape))
    elif node.op == "reduce_scatter":
        dim = a["dim"] % len(x.shape)
        packed = _split_leading(low, x, dim, n)
        out = low.new_view(t.shape, t.dtype)
        low.emit("nccl.reduceScatter", [("sendbuff", low.addr(packed)),
                                        ("recvbuff", low.addr(out)), ("recvcount", count // n),
                                        ("datatype", dt), ("op", a.get("op", "sum")),
                                        ("comm", comm)], [packed], [out])
        low.bind(node.output, out)
    else:  # all_to_all: grouped send/recv of rank-major chunks
        split, concat = a["split_dim"] % len(x.shape), a["concat_dim"] % len(x.shape)
        packed = _split_leading(low, x, split, n)
        staged = low.new_view(packed.shape, x.dtype)
        chunk = count // n
        itemsize = x.itemsize
        group = low.mesh.group_of(low.device, axes)
        me = group.index(low.device)
        low.emit("nccl.groupStart", [("comm", comm)], [], [])
        for peer in range(n):
            send = View(packed.buf, packed.offset + peer * chunk, (chunk,), (1,), x.dtype)
            recv = View(staged.buf, peer * chunk, (chunk,), (1,), x.dtype)
            if peer == me:
                low.emit("cuda.memcpyAsync", [("dst", low.addr(recv)), ("src", low.addr(send)),
                                              ("count", chunk * itemsize)], [send], [recv])
                continue
            low.emit("nccl.send", [("sendbuff", low.addr(send)), ("count", chunk),
                                   ("datatype", dt), ("peer", peer), ("comm", comm)], [send], [])
            low.emit("nccl.recv", [("recvbuff", low.addr(recv)), ("count", chunk),
                                   ("datatype", dt), ("peer", peer), ("comm", comm)], [], [recv])
        low.emit("nccl.groupEnd", [("comm", comm)], [packed], [staged])
        low.bind(node.output, _join_leading(low, staged, concat, t.shape))


def _position(low: Lowering, node: Node) -> int:
    if low.mesh is None:
        return 0
    return low.mesh.group_of(low.device, tuple(node.attrs["axes"])).index(low.device)


def _local_slice(low: Lowering, node: Node) -> None:
    v = low.view(node.inputs[0])
    dim = node.attrs["dim"] % len(v.shape)
    chunk = v.shape[dim] // node.attrs["n"]
    shape = v.shape[:dim] + (chunk,) + v.shape[dim + 1:]
    low.bind(node.output, View(v.buf, v.offset + _position(low, node) * chunk * v.strides[dim],
                               shape, v.strides, v.dtype))


def _local_zero(low: Lowering, node: Node) -> None:
    x = low.operand(node.inputs[0])
    t = node.output.type
    if node.attrs.get("op", "sum") != "sum" or _position(low, node) == 0:
        low.bind(node.output, x)
        return
    expr = ("apply", "convert", (("const", 0),), (("dtype", _dt(t.dtype)),))
    low.bind(node.output, Pending(expr, t.shape, t.dtype))


def _local_pad(low: Lowering, node: Node) -> None:
    t = node.output.type
    dim = node.attrs["dim"] % t.rank
    out = low.new_view(t.shape, t.dtype)
    low.emit("cuda.memsetAsync", [("dst", low.addr(out)), ("value", 0),
                                  ("count", out.buf.nbytes)], [], [out])
    source = low.operand(node.inputs[0])
    _into(low, out, dim, _position(low, node) * source.shape[dim], source)
    low.bind(node.output, out)


def _send(low: Lowering, node: Node) -> None:
    x = low.contiguous(node.inputs[0])
    low.emit("nccl.send", [("sendbuff", low.addr(x)), ("count", math.prod(x.shape)),
                           ("datatype", _dt(x.dtype)), ("peer", node.attrs["dst"]),
                           ("comm", "world")], [x], [])
    low.bind(node.output, x)


def _recv(low: Lowering, node: Node) -> None:
    t = node.output.type
    out = low.new_view(t.shape, t.dtype)
    low.emit("nccl.recv", [("recvbuff", low.addr(out)), ("count", t.numel),
                           ("datatype", _dt(t.dtype)), ("peer", node.attrs["src"]),
                           ("comm", "world")], [], [out])
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
        ("kv_heads", kv_heads), ("head_size", head_size), ("dtype", _dt(kc.dtype)),
        ("slot_dtype", _dt(slots.dtype))], [key, value, slots, kc, vc], [kc, vc])
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
        ("dtype", _dt(t.dtype)), ("index_dtype", _dt(tables.dtype)),
        ("lens_dtype", _dt(lens.dtype)),
        ("starts_dtype", None if starts is None else _dt(starts.dtype))], reads, [out])
    low.bind(node.output, out)


_HANDLERS = {
    "reshape_and_cache": _reshape_and_cache, "paged_attention": _paged_attention,
    "full": _full,
    "reshape": _reshape, "permute": _permute, "expand": _expand, "slice": _slice,
    "select": _select, "clone": _clone, "cat": _cat, "slice_scatter": _slice_scatter,
    "matmul": _matmul, "linear": _linear, "attention": _attention,
    "attention_with_lse": _attention, "attention_backward": _attention_backward,
    "layer_norm_with_stats": _norm, "layer_norm_backward": _layer_norm_backward,
    "log_softmax_backward": _log_softmax_backward, "nll_loss": _nll_loss,
    "nll_loss_backward": _nll_loss_backward, "arange": _arange,
    "embedding_backward": _embedding_backward,
    "softmax": _softmax, "log_softmax": _softmax, "layer_norm": _norm, "rms_norm": _norm,
    "sum": _reduce, "mean": _reduce, "amax": _reduce, "amin": _reduce,
    "embedding": _embedding,
    "all_reduce": _collective, "all_gather": _collective, "reduce_scatter": _collective,
    "all_to_all": _collective,
    "local_slice": _local_slice, "local_zero": _local_zero, "local_pad": _local_pad,
    "send": _send, "recv": _recv,
}


def lower_to_listing(graph: Graph, mesh: Mesh | None = None, rank: int = 0,
                     memory_limit: int = 0) -> Listing:
    """The listing device `rank` of `mesh` runs for device program `graph` (a graph with no
    mesh: one device). `memory_limit` (bytes, 0: none) bounds the arena."""
    low = Lowering(graph, mesh, rank)
    listing = low.run()
    check_fits(list(low.intervals.values()), listing.arena_bytes, memory_limit,
               f"graph @{graph.name} on device {low.device}")
    assert ALIGNMENT % 8 == 0
    return listing
