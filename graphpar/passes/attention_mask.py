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
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from graphpar.ir.graph import Graph, Node, OutputRole, Role, Value
from graphpar.ir.registry import OpKind, get_op
from graphpar.ir.verify import describe

__all__ = ["MaskReach", "mask_reach", "mask_reaches", "scores_reach", "scores_reaches"]

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


def mask_reaches(graph: Graph, nodes: list[Node],
                 constants: Mapping[str, torch.Tensor] | None = None) -> dict[Node, MaskReach]:
    """The reach of each attention in `nodes`, the masks' shared sub-graphs folded once.
    `constants`: values of graph inputs that hold constants (lifted tensors, mask buffers),
    by name; see `_Bounds`."""
    bounds = _Bounds(graph, constants)
    return {node: mask_reach(graph, node, bounds) for node in nodes}


def mask_reach(graph: Graph, node: Node, bounds: _Bounds | None = None) -> MaskReach:
    """The reach of attention `node` (`attention`, `attention_with_lse`: operands q, k, v,
    mask?, attribute `causal`) in `graph`."""
    q, k = node.inputs[0], node.inputs[1]
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    sq, sk = q.type.shape[-2], k.type.shape[-2]
    may = torch.ones(sq, sk, dtype=torch.bool)
    if node.attrs.get("causal"):
        may &= ~torch.ones(sq, sk, dtype=torch.bool).triu(1)  # SDPA's is_causal: top-left
    must = may.clone()  # where every sequence and head surely reads the key
    if isinstance(mask, Value):
        bounds = bounds or _Bounds(graph)
        try:
            lower, upper = bounds.of(mask)
        except _Unreadable as exc:
            return MaskReach(False, why=f"its mask cannot be read: {exc}")
        return bounds.explain(_reach(may, must, lower, upper), mask)
    if not node.attrs.get("causal"):
        return MaskReach(False, why="it has neither is_causal=True nor a mask")
    return _reach(may, must)


def scores_reaches(graph: Graph, sites: list[tuple[Value, Value]],
                   constants: Mapping[str, torch.Tensor] | None = None) -> list[MaskReach]:
    """`scores_reach` of each (logits, scores) pair, the masks' shared sub-graphs folded once."""
    bounds = _Bounds(graph, constants)
    return [scores_reach(graph, logits, scores, bounds) for logits, scores in sites]


def scores_reach(graph: Graph, logits: Value, scores: Value, bounds: _Bounds | None = None
                 ) -> MaskReach:
    """The reach of attention written out as ops (`eager_attention`): `logits` [..., Sq, Sk]
    go into the softmax, computed from the product `scores` = q @ k^T by scaling, soft-capping
    and adding masks and biases. The product can hold any finite value (it is bounded by
    +-SCORE_BOUND), so a key is out of reach where what the mask adds hides it whatever the
    product is."""
    bounds = bounds or _Bounds(graph)
    dtype = scores.type.dtype
    bound = torch.finfo(dtype).max * SCORE_BOUND
    bounds.seed(scores, torch.full(scores.type.shape, -bound, dtype=dtype),
                torch.full(scores.type.shape, bound, dtype=dtype))
    sq, sk = logits.type.shape[-2:]
    try:
        lower, upper = bounds.of(logits)
    except _Unreadable as exc:
        return MaskReach(False, why=f"its mask cannot be read: {exc}")
    finally:
        bounds.unseed(scores)
    everything = torch.ones(sq, sk, dtype=torch.bool)
    return bounds.explain(_reach(everything, everything.clone(), lower, upper), logits)


# The q @ k^T product is taken to lie within this fraction of its dtype's largest value: a
# mask adding the dtype's lowest still hides a key whatever the product.
SCORE_BOUND = 2.0 ** -10


def _reach(may: torch.Tensor, must: torch.Tensor, lower: torch.Tensor | None = None,
           upper: torch.Tensor | None = None) -> MaskReach:
    """The reach of queries allowed `may` (and surely reading `must`) [Sq, Sk] before a mask,
    narrowed by a mask between `lower` and `upper`."""
    sq, sk = may.shape
    if upper is not None:
        try:
            allowed, sure = _may_attend(upper), _may_attend(lower)
        except _Unreadable as exc:
            return MaskReach(False, why=f"its mask cannot be read: {exc}")
        if allowed.dim() > 2:
            allowed = allowed.reshape(-1, *allowed.shape[-2:]).any(0)
            sure = sure.reshape(-1, *sure.shape[-2:]).all(0)
        may &= allowed.expand(sq, sk)
        must &= sure.expand(sq, sk)
    query_at = torch.arange(sk - sq, sk)[:, None]  # key position of each query
    later = torch.arange(sk)[None, :] > query_at  # [sq, sk]
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
    """Per-element (lower, upper) bounds of values, computed on demand; exact when lo is hi.

    A graph input is exact when `constants` holds its value and it cannot change between steps
    (a lifted constant, or a buffer the step does not update, such as GPT-Neo's causal `bias`);
    any other input can hold anything of its type."""

    def __init__(self, graph: Graph, constants: Mapping[str, torch.Tensor] | None = None
                 ) -> None:
        self.graph = graph
        self.known: dict[Value, tuple[torch.Tensor, torch.Tensor]] = {}
        updated = {o.target for o in graph.outputs if o.role is OutputRole.UPDATE}
        fixed = [v for v in graph.inputs
                 if v.role in (Role.CONST, Role.BUFFER) and v.name not in updated]
        self.constants = {
            v: t for v in fixed
            if isinstance(t := (constants or {}).get(v.name), torch.Tensor)
            and type(t) is torch.Tensor and t.device.type == "cpu"  # not fake, not meta
            and tuple(t.shape) == tuple(v.type.shape) and t.dtype == v.type.dtype}
        self.seeds: dict[Value, tuple[torch.Tensor, torch.Tensor]] = {}
        # constant inputs read as "anything" for want of a value (a model built on the meta
        # device to plan without weights): named when a mask that reads one is not causal
        self.valueless = {v for v in fixed if v not in self.constants}

    def explain(self, reach: MaskReach, value: Value) -> MaskReach:
        """`reach`, its `why` naming the valueless constants the value's cone reads, if any."""
        if reach.causal:
            return reach
        seen, stack, missing = {value}, [value], []
        while stack:
            v = stack.pop()
            if v in self.valueless:
                missing.append(v)
            if v.producer is not None:
                for x in v.producer.input_values:
                    if x not in seen:
                        seen.add(x)
                        stack.append(x)
        if not missing:
            return reach
        names = " and ".join(f"%{v.name}" for v in sorted(missing, key=lambda v: v.name)[:2])
        return MaskReach(False, why=(
            f"{reach.why}, as far as its mask can be read: it reads {names}, which "
            f"{'have' if len(missing) > 1 else 'has'} no values in a planning-only compile "
            "(the model is built on the meta device); "
            "compile with --run-cpu N, which builds the model with its weights and buffers"))

    def seed(self, value: Value, lower: torch.Tensor, upper: torch.Tensor) -> None:
        """Take `value` to lie between `lower` and `upper` (what depends on it is re-read)."""
        self.seeds[value] = (lower, upper)
        self.known = {v: b for v, b in self.known.items() if v in self.constants}

    def unseed(self, value: Value) -> None:
        del self.seeds[value]
        self.known = {v: b for v, b in self.known.items() if v in self.constants}

    def of(self, value: Value) -> tuple[torch.Tensor, torch.Tensor]:
        stack = [value]
        while stack:  # post-order without recursion: mask cones can be deep
            v = stack[-1]
            if v in self.seeds:
                self.known[v] = self.seeds[v]
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
                t = self.constants.get(v)
                self.known[v] = (t, t) if t is not None else _anything(v)
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
        if name in ("mul", "div") and out_dtype.is_floating_point and len(inputs) == 2:
            # scaling by an exact factor: each element's bounds scale (and swap if negative)
            a, b = (self._operand_bounds(x, bd) for x, bd in zip(inputs, bounds))
            if name == "mul" and a[0] is a[1]:
                a, b = b, a
            if b[0] is not b[1]:
                return None
            ends = (a[0] * b[0], a[1] * b[1]) if name == "mul" else (a[0] / b[0], a[1] / b[1])
            ends = [_nan_to(e, 0.0) for e in ends]  # 0 * inf: the factor is 0
            return torch.minimum(*ends), torch.maximum(*ends)
        if name in ("neg", "tanh") and out_dtype.is_floating_point:
            lo, hi = values[0]
            return (-hi, -lo) if name == "neg" else (torch.tanh(lo), torch.tanh(hi))
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
