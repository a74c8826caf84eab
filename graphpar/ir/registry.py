"""The one op registry: each op is declared once with its type rule, cost, traits and reference."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphpar.errors import UnsupportedOpError
from graphpar.ir.cluster import COMPUTE_CLASSES
from graphpar.ir.types import DTYPES_BY_NAME, TensorType


class OpKind(str, enum.Enum):
    """Families of ops: the cost model and the sharding rules start from the family."""

    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    MATMUL = "matmul"
    SHAPE = "shape"  # moves or views data without arithmetic
    CREATION = "creation"  # makes a tensor from attributes only
    COMPOSITE = "composite"  # a unit later passes want whole: attention, norms, conv
    INDEXING = "indexing"  # gathers and scatters driven by an index tensor
    COLLECTIVE = "collective"


class Trait(str, enum.Enum):
    """Facts about an op that passes act on, declared with the op instead of kept in a pass."""

    FOLLOWS_OPERAND = "follows-operand"  # auto-shard gives it its dominant operand's layout
    SHAPE_ATTR = "shape-attr"  # attrs["shape"] is the result shape: lower-spmd localizes it
    KEEPS_UNIFORM = "keeps-uniform"  # one repeated value in gives one repeated value out
    WRITES_OPERAND = "writes-operand"  # updates an operand in place at run time: not pure
    REPLICATE_ONLY = "replicate-only"  # no sharding rule: auto-shard runs it replicated


class StepKind(str, enum.Enum):
    """What one communication step does (an op's `comm_kind`; a step of a resharding plan in
    `graphpar.cost.communication`). The first six communicate; the `local_*` ones are free."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"
    LOCAL_SLICE = "local_slice"  # R -> S(d): keep this device's chunk of dim d
    LOCAL_ZERO = "local_zero"  # R -> P: for sum, devices not at coordinate 0 on the axis zero
    #                            their copy; for avg/max/min, keep it (no change in data)
    LOCAL_PAD = "local_pad"  # S(d) -> P(sum): a zero tensor of the unsharded size with
    #                          this device's chunk in place

    @property
    def communicates(self) -> bool:
        return not self.value.startswith("local_")

    def __str__(self) -> str:
        return self.value


# What a type rule, cost rule or reference sees: operand types (or scalars) and the attributes.
OperandTypes = Sequence["TensorType | int | float | bool | None"]
TypeRule = Callable[[OperandTypes, dict[str, Any]], list[TensorType]]
FlopRule = Callable[[OperandTypes, list[TensorType], dict[str, Any]], int]

# The op class a family is priced as when its op declares none (`OpDef.cost_class`); "free":
# not priced as compute (views and copies of shape ops, creation, collectives: the alpha-beta
# model prices those). A composite says what it is.
FREE = "free"
_FAMILY_COST_CLASS = {
    OpKind.ELEMENTWISE: "elementwise", OpKind.REDUCTION: "normalization",
    OpKind.MATMUL: "gemm", OpKind.INDEXING: "gather", OpKind.SHAPE: FREE,
    OpKind.CREATION: FREE, OpKind.COLLECTIVE: FREE,
}


@dataclass(frozen=True, eq=False)
class OpDef:
    """Everything graphpar knows about one op.

    `reference(*operands, **attrs)` is the torch implementation the CPU executor runs; it
    returns a tensor, or a tuple for ops with several results. Without an explicit `type_rule`,
    result types come from running the reference on meta tensors, so shapes cannot drift from
    what the op computes.
    """

    name: str
    kind: OpKind
    reference: Callable[..., Any]
    num_outputs: int | None = 1  # None: decided by the attributes (e.g. a backward's mask)
    type_rule: TypeRule | None = None
    flop_rule: FlopRule | None = None
    doc: str = ""
    traits: frozenset[Trait] = frozenset()
    # The ATen op (packet name, e.g. "neg") whose overloads lower 1:1 to this op: every ATen
    # argument is an operand, in order. None when capture lowers it by hand or not at all.
    aten: str | None = None
    # SPMD ops: the kind of communication step they are (what the cost model prices).
    comm_kind: StepKind | None = None
    # Attached by graphpar.passes.autoshard (`attach_sharding_rule`): node -> its factors.
    sharding_rule: Callable[..., Any] | None = field(default=None, compare=False)
    # The op class the compute cost model prices it as (`graphpar.cost.compute`): one of
    # `graphpar.ir.cluster.COMPUTE_CLASSES` or "free"; None takes the family's.
    cost_class: str | None = None
    # Bytes the op reads and writes, where that is not its operands and results in full (an op
    # that touches a few rows of a large operand, as the paged KV cache ops do).
    bytes_rule: FlopRule | None = None
    # FLOPs an elementwise op counts per result element without a `flop_rule`: 1 for an add,
    # about ten for a transcendental function (an exp, erf or tanh is a polynomial evaluation
    # plus range reduction; GELU ran 10.8 times an add's time per element on the CPU ranks)
    flops_per_element: int = 1
    # Attributes that count something a plan can split (a convolution's groups): given the
    # node's attrs and its operands' global and local types, the attrs of one device's shard
    # (lower-spmd calls it; SHAPE_ATTR ops' shapes are localized there too).
    local_attrs: Callable[[dict, list, list], dict] | None = None

    def __post_init__(self) -> None:
        if self.cost_class is None:
            if self.kind not in _FAMILY_COST_CLASS:
                raise ValueError(f"op {self.name!r} ({self.kind.value}) must declare its "
                                 f"cost_class: one of {', '.join(COMPUTE_CLASSES)} or {FREE!r}")
            object.__setattr__(self, "cost_class", _FAMILY_COST_CLASS[self.kind])
        elif self.cost_class not in (*COMPUTE_CLASSES, FREE):
            raise ValueError(f"op {self.name!r}: unknown cost_class {self.cost_class!r}; one of "
                             f"{', '.join(COMPUTE_CLASSES)} or {FREE!r}")

    def has(self, trait: Trait) -> bool:
        return trait in self.traits

    def attach_sharding_rule(self, rule: Callable[..., Any]) -> None:
        """Set the op's sharding rule once (the registry lives below the passes that own rules)."""
        if self.sharding_rule is not None:
            raise ValueError(f"op {self.name!r} already has a sharding rule")
        if Trait.REPLICATE_ONLY in self.traits:
            raise ValueError(f"op {self.name!r} is declared replicate-only")
        object.__setattr__(self, "sharding_rule", rule)

    def infer(self, operands: OperandTypes, attrs: dict[str, Any]) -> list[TensorType]:
        if self.type_rule is not None:
            return self.type_rule(operands, attrs)
        # Running the reference on meta tensors costs about half a millisecond; graphs repeat
        # the same (op, types, attributes) many times over (every layer of a model).
        try:
            key: Any = (self.name, tuple((type(t), t) for t in operands),
                        tuple((k, type(v), v) for k, v in attrs.items()))
            cached = _INFERRED.get(key)
        except TypeError:  # an unhashable operand or attribute: no cache
            key, cached = None, None
        if cached is None:
            cached = _infer_on_meta(self, operands, attrs)
            if key is not None:
                if len(_INFERRED) >= _INFERRED_MAX:
                    _INFERRED.clear()
                _INFERRED[key] = cached
        return list(cached)

    def flops(self, operands: OperandTypes, results: list[TensorType], attrs: dict) -> int:
        if self.flop_rule is not None:
            return int(self.flop_rule(operands, results, attrs))
        if self.kind is OpKind.ELEMENTWISE:
            return self.flops_per_element * sum(r.numel for r in results)
        if self.kind is OpKind.REDUCTION:
            return sum(t.numel for t in operands if isinstance(t, TensorType))
        return 0

    def bytes_accessed(self, operands: OperandTypes, results: list[TensorType],
                       attrs: dict | None = None) -> int:
        """Bytes read and written, the memory-bound part of the cost model: every operand and
        result in full unless the op declares a `bytes_rule`."""
        if self.bytes_rule is not None:
            return int(self.bytes_rule(operands, results, attrs or {}))
        tensors = [t for t in operands if isinstance(t, TensorType)] + list(results)
        return sum(t.nbytes for t in tensors)


_REGISTRY: dict[str, OpDef] = {}
_INFERRED: dict[Any, list[TensorType]] = {}  # OpDef.infer's results on meta tensors
_INFERRED_MAX = 1 << 16


def register(op: OpDef) -> OpDef:
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedOpError(
            f"unknown op {name!r}: it is not in graphpar's op registry "
            f"({len(_REGISTRY)} ops; see `graphpar ops`)"
        ) from None


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def infer_types(op: str, operands: Sequence[Any], attrs: dict[str, Any]) -> list[TensorType]:
    """Result types of `op` applied to operands (Values or scalars) with `attrs`."""
    types = [getattr(v, "type", v) for v in operands]
    return get_op(op).infer(types, attrs)


def _infer_on_meta(op: OpDef, operands: OperandTypes, attrs: dict[str, Any]) -> list[TensorType]:
    args = [t.meta() if isinstance(t, TensorType) else t for t in operands]
    try:
        result = op.reference(*args, **attrs)
    except Exception as exc:  # the op rejects these operand types: say which
        shown = ", ".join(str(t) for t in operands)
        raise TypeError(f"{op.name}({shown}) {attrs}: {exc}") from exc
    results = result if isinstance(result, (tuple, list)) else (result,)
    return [TensorType.of(r) for r in results]


def dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of an IR dtype name held in an attribute (attributes stay plain data)."""
    return None if name is None else DTYPES_BY_NAME[name]


def matmul_flops(operands: OperandTypes, results: list[TensorType], attrs: dict) -> int:
    """2·M·N·K per output matrix: the contraction size is the last dim of the first operand."""
    k = operands[0].shape[-1]
    return 2 * math.prod(results[0].shape) * k
