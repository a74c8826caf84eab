"""Lowering one device program to a CUDA listing: the calls, then their memory plan.

Every IR value becomes either a *view* (a buffer, an element offset, a shape and strides) or a
*pending* elementwise expression over views. Views and reshapes make no call; elementwise
ops accumulate into a pending expression that one generated kernel computes when something
needs the value in memory (a GEMM, a row-wise kernel, a collective, a graph output, a second
user). GEMMs read views in place when their strides are those of a (transposed) matrix with
one uniform batch stride, and copy them contiguous first otherwise.
"""

from __future__ import annotations

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
from graphpar.ir.graph import Graph, Role, Value
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import OpKind, get_op
from graphpar.ir.types import dtype_name
from graphpar.ir.verify import describe
from graphpar.passes.lower_cuda.memory_plan import (
    Interval,
    aligned,
    check_fits,
    check_no_overlap,
    live_bytes_bound,
    place,
)
from graphpar.passes.lower_cuda.values import (
    Buf,
    Pending,
    View,
    contiguous_strides,
    kernel_digest,
    leaves,
)

__all__ = ["HANDLERS", "Lowering", "UnsupportedLowering", "lower_to_listing"]

HANDLERS: dict[str, Any] = {}
"""op name -> handler(lowering, node), filled by the op modules (shape_ops, compute_ops,
comm_ops); "<elementwise>" lowers every op of OpKind.ELEMENTWISE without its own entry."""


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
        # dense copies of the current node's operands (`contiguous`): later steps of the node
        # read them as they would the operands, so no step may write over them
        self.operand_copies: set[Buf] = set()
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
        copy = self.materialize(Pending(("leaf", v), v.shape, v.dtype))
        self.operand_copies.add(copy.buf)
        return copy

    def dead_after_now(self, buf: Buf, own_input: bool = False,
                       computing: Pending | None = None) -> bool:
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
        if not own_input and buf in self.operand_copies:
            return False
        return not any(isinstance(x, Pending) and x is not computing
                       and self.last_use.get(v, -1) > self.node_index
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
            ("out", self.addr(out)), ("out_dtype", dtype_name(out.dtype)),
            ("out_strides", out.strides)]
        for i, v in enumerate(views):
            params += [(f"in{i}", self.addr(v)), (f"in{i}_dtype", dtype_name(v.dtype)),
                       (f"in{i}_strides", v.strides)]
        params.append(("expr", format_expr(expr)))
        params[0] = ("name", "pw_" + kernel_digest(params[1:], drop=("out", *(f"in{i}" for i in
                                                                       range(len(views))))))
        self.emit("kernel.pointwise", params, views, [out])
        return out

    def _in_place_target(self, views: list[View], p: Pending) -> View | None:
        for v in views:
            if (v.whole and v.shape == p.shape and v.itemsize * math.prod(p.shape) == v.buf.nbytes
                    and torch.empty((), dtype=p.dtype).element_size() == v.itemsize
                    and all(w.buf is not v.buf or w == v for w in views)
                    and self.dead_after_now(v.buf, computing=p)):
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
            self.last_use[o.value] = end + 1  # read after the last call
            self.users[o.value] = self.users.get(o.value, 0) + 1
        inputs = self._place_inputs()
        for i, node in enumerate(graph.nodes):
            self.node_index = i
            self.current_inputs = node.input_values
            self.note = f"{describe(node, graph, i)}"
            handler = HANDLERS.get(node.op)
            if handler is None and get_op(node.op).kind is OpKind.ELEMENTWISE:
                handler = HANDLERS["<elementwise>"]
            if handler is None:
                raise UnsupportedLowering(
                    f"lower-cuda: {describe(node, graph, i)} of graph @{graph.name}: op "
                    f"{node.op!r} has no CUDA lowering (supported: elementwise ops, "
                    f"{', '.join(sorted(k for k in HANDLERS if not k.startswith('<')))}); run "
                    "this graph on the CPU reference or lower it before the op")
            try:
                handler(self, node)
            except UnsupportedLowering:
                raise
            except UnsupportedOpError as exc:
                raise UnsupportedLowering(f"lower-cuda: {describe(node, graph, i)}: {exc}") \
                    from None
            self.current_inputs = []  # the node's own expression may overwrite its operands
            self.operand_copies = set()
            for out in node.outputs:  # a value several nodes read is computed once
                x = self.env.get(out)
                if isinstance(x, Pending) and self.users.get(out, 0) > 1:
                    self.view(out)
        self.node_index = end
        self.current_inputs = []
        self.operand_copies = set()
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
            if not isinstance(value.role, Role):  # every input of any role lives in state
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
            return TensorRef(name, resolve(self.addr(v)), dtype_name(v.dtype), v.shape,
                             v.strides, role)

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
