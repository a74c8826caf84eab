"""What an attention's mask lets each query see, read off the graph: whether no query attends
to a later key (causal), and the sliding window if the mask has one.

Hugging Face builds its causal masks as tensors (`arange` positions compared with `le`, a
sliding window subtracted, a padding mask from an input gathered and and-ed in, a boolean mask
turned additive with `where`), so the `causal` flag of the attention op says nothing for them.
This module bounds the mask's sub-graph instead: every value on the way from the graph's inputs
to the mask gets a lower and an upper bound per element. Values that depend only on positions
(`arange`, `full`, comparisons of them, `tril`) fold to one exact tensor through the registry's
reference implementations; a graph input (a padding mask, token ids) can hold anything of its
dtype; ops that keep order (views and moves, `and`, `or`, `min`, `max`, `add`, `where`,
widening converts) bound their result from their operands' bounds; any other op on a value that
is not exact can give anything. A key is out of a query's reach when even the upper bound
forbids it (False, or an additive value no greater than half the dtype's lowest). So a padding
mask and-ed with a causal one is causal, whatever the padding, and a mask that only might hide
later keys is not.

Queries and keys are aligned at the end (query i of Sq sits at key position Sk - Sq + i), as
in a decoder reading a cache; for a training step Sq = Sk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphpar.ir.graph import Graph, Node, Value
from graphpar.ir.registry import OpKind, get_op
from graphpar.ir.verify import describe

__all__ = ["MaskReach", "mask_reach", "mask_reaches"]

# Bounding a mask builds tensors of its sub-graph's sizes; above this many elements per value
# the mask is not read (it is then not known to be causal).
MAX_ELEMENTS = 1 << 27

_AND = {"logical_and": torch.logical_and, "bitwise_and": torch.logical_and,
        "minimum": torch.minimum}
_OR = {"logical_or": torch.logical_or, "bitwise_or": torch.logical_or, "maximum": torch.maximum}
_GATHERS = ("index", "index_select", "gather")  # data moved by exact indices keeps its bounds


@dataclass(frozen=True)
class MaskReach:
    """What one attention's queries may read. `causal`: no query reaches a later key.
    `window`: w when every query reads at most its w - 1 previous keys and itself (a sliding
    window shorter than the keys), else None. `why`: when not causal, a query and a later key
    it may read, or why the mask could not be read. `plain`: every query reads exactly the
    keys up to its own (in its window), for every sequence and head, whatever the inputs: what
    is_causal=True (with the window) computes."""

    causal: bool
    window: int | None = None
    why: str = ""
    plain: bool = False


def mask_reaches(graph: Graph, nodes: list[Node]) -> dict[Node, MaskReach]:
    """The reach of each attention in `nodes`, the masks' shared sub-graphs folded once."""
    bounds = _Bounds(graph)
    return {node: mask_reach(graph, node, bounds) for node in nodes}


def mask_reach(graph: Graph, node: Node, bounds: _Bounds | None = None) -> MaskReach:
    """The reach of attention `node` (`attention`, `attention_with_lse`: operands q, k, v,
    mask?, attribute `causal`) in `graph`."""
    q, k = node.inputs[0], node.inputs[1]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    sq, sk = q.type.shape[-2], k.type.shape[-2]
    query_at = torch.arange(sk - sq, sk)[:, None]  # key position of each query
    later = torch.arange(sk)[None, :] > query_at  # [sq, sk]
    may = torch.ones(sq, sk, dtype=torch.bool)
    if node.attrs.get("causal"):
        may &= ~torch.ones(sq, sk, dtype=torch.bool).triu(1)  # SDPA's is_causal: top-left
    must = may.clone()  # where every sequence and head surely reads the key
    if isinstance(mask, Value):
        try:
            lower, upper = (bounds or _Bounds(graph)).of(mask)
            allowed, sure = _may_attend(upper), _may_attend(lower)
        except _Unreadable as exc:
            return MaskReach(False, why=f"its mask cannot be read: {exc}")
        if allowed.dim() > 2:
            allowed = allowed.reshape(-1, *allowed.shape[-2:]).any(0)
            sure = sure.reshape(-1, *sure.shape[-2:]).all(0)
        may &= allowed.expand(sq, sk)
        must &= sure.expand(sq, sk)
    elif not node.attrs.get("causal"):
        return MaskReach(False, why="it has neither is_causal=True nor a mask")
    seen = may & later
    if seen.any():
        i, j = (int(x) for x in seen.nonzero()[0])
        return MaskReach(False, why=f"query {i} may attend to the later key {j}")
    back = (query_at - torch.arange(sk)[None, :]).expand(sq, sk)
    width = int(back[may].max()) + 1 if may.any() else 0
    window = width if 0 < width < sk else None
    plain = bool(torch.equal(must, may) and torch.equal(may, (back >= 0) & (back < width)))
    return MaskReach(True, window, plain=plain)


def _may_attend(upper: torch.Tensor) -> torch.Tensor:
    """Where a mask whose elements are at most `upper` may let a query read a key."""
    if upper.dtype == torch.bool:
        return upper
    if upper.is_floating_point():
        return upper > torch.finfo(upper.dtype).min / 2
    raise _Unreadable(f"an attention mask of {upper.dtype} (give bool or float)")


class _Unreadable(Exception):
    """The mask's sub-graph is too big to bound."""


class _Bounds:
    """Per-element (lower, upper) bounds of values, computed on demand; exact when lo is hi."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.known: dict[Value, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, value: Value) -> tuple[torch.Tensor, torch.Tensor]:
        stack = [value]
        while stack:  # post-order without recursion: mask cones can be deep
            v = stack[-1]
            if v in self.known:
                stack.pop()
                continue
            node = v.producer
            pending = [] if node is None else [x for x in node.input_values
                                               if x not in self.known]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._size_check(v)
            if node is None:
                self.known[v] = _anything(v)
            else:
                for out, bounds in zip(node.outputs, self._node(node)):
                    self.known[out] = bounds
        return self.known[value]

    def _size_check(self, v: Value) -> None:
        if math.prod(v.type.shape) > MAX_ELEMENTS:
            producer = v.producer
            where = describe(producer, self.graph) if producer is not None else f"%{v.name}"
            raise _Unreadable(f"{where} has {math.prod(v.type.shape):,} elements, more than "
                              f"the {MAX_ELEMENTS:,} graphpar folds")

    def _node(self, node: Node) -> list[tuple[torch.Tensor, torch.Tensor]]:
        op = get_op(node.op)
        bounds = [self.known[x] if isinstance(x, Value) else None for x in node.inputs]
        exact = all(b is None or b[0] is b[1] for b in bounds)
        if exact:
            args = [b[0] if b is not None else x for x, b in zip(node.inputs, bounds)]
            results = op.reference(*args, **node.attrs)
            results = results if isinstance(results, (tuple, list)) else (results,)
            return [(r, r) for r in results]
        if len(node.outputs) == 1:
            bounded = self._bounded(node, op.kind, bounds)
            if bounded is not None:
                return [bounded]
        return [_anything(out) for out in node.outputs]

    def _bounded(self, node: Node, kind: OpKind, bounds: list):
        """Bounds of an op that keeps order, from its operands' bounds; None for any other."""
        name, inputs, attrs = node.op, node.inputs, node.attrs
        out_dtype = node.output.type.dtype

        def apply(side: int):
            args = [b[side] if b is not None else x for x, b in zip(inputs, bounds)]
            return get_op(name).reference(*args, **attrs)

        moves_only = kind is OpKind.SHAPE or (
            name in _GATHERS and all(b is None or b[0] is b[1] for b in bounds[1:]))
        if moves_only:
            return apply(0), apply(1)
        values = [b for b in bounds if b is not None]
        if name in _AND or name in _OR:
            if len(values) != 2:
                return None
            join = _AND.get(name) or _OR[name]
            (alo, ahi), (blo, bhi) = values
            return join(alo, blo), join(ahi, bhi)
        if name == "logical_not" or (name == "bitwise_not" and out_dtype == torch.bool):
            lo, hi = values[0]
            return ~hi, ~lo
        if name == "convert":
            source = inputs[0].type.dtype
            if out_dtype == torch.bool and source != torch.bool:
                return None  # x != 0 does not keep order
            return apply(0), apply(1)
        if name in ("add", "sub") and out_dtype.is_floating_point:
            a, b = (self._operand_bounds(x, bd) for x, bd in zip(inputs, bounds))
            if name == "sub":
                b = (-b[1], -b[0])
            return _nan_to(a[0] + b[0], -math.inf), _nan_to(a[1] + b[1], math.inf)
        if name == "where":
            (clo, chi), a, b = bounds[0], *(self._operand_bounds(x, bd)
                                            for x, bd in zip(inputs[1:], bounds[1:]))
            sure = clo == chi
            lo = torch.where(sure, torch.where(clo, a[0], b[0]), torch.minimum(a[0], b[0]))
            hi = torch.where(sure, torch.where(chi, a[1], b[1]), torch.maximum(a[1], b[1]))
            return lo.to(out_dtype), hi.to(out_dtype)
        if name in ("lt", "le", "gt", "ge") and all(
                not getattr(x, "type", None) or x.type.dtype != torch.bool for x in inputs):
            a, b = (self._operand_bounds(x, bd) for x, bd in zip(inputs, bounds))
            if name in ("gt", "ge"):
                a, b = b, a  # a > b is b < a
            strict = name in ("lt", "gt")
            # a < b surely when a's upper < b's lower; possibly when a's lower < b's upper
            if strict:
                return a[1] < b[0], a[0] < b[1]
            return a[1] <= b[0], a[0] <= b[1]
        return None

    @staticmethod
    def _operand_bounds(x, bounds) -> tuple[torch.Tensor, torch.Tensor]:
        if bounds is None:  # a scalar operand
            t = torch.tensor(x)
            return t, t
        return bounds


def _anything(v: Value) -> tuple[torch.Tensor, torch.Tensor]:
    """The bounds of a value that can hold anything of its type."""
    shape, dtype = v.type.shape, v.type.dtype
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype), torch.ones(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.full(shape, -math.inf, dtype=dtype), torch.full(shape, math.inf, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.full(shape, info.min, dtype=dtype), torch.full(shape, info.max, dtype=dtype)


def _nan_to(t: torch.Tensor, value: float) -> torch.Tensor:
    return torch.nan_to_num(t, nan=value, posinf=math.inf, neginf=-math.inf)
