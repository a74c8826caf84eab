"""Compute time, the one place it is priced: a roofline per op class.

An op's time on one device is

    max(FLOPs / achieved FLOP/s, bytes moved / achieved bandwidth) + per-call overhead

with the achieved rates of the op's class (`OpDef.cost_class`, declared with the op) from the
cluster's `compute` table (`graphpar.ir.cluster.Cluster.compute_rate`). Bytes moved are the
operands read and the results written, of the shard one device holds (`OpDef.bytes_accessed`).
A matmul whose rows (M) are at most `SKINNY_ROWS` is a `gemm_skinny`: a decode step's matmul,
which reads every weight to use it on a handful of rows, so the memory term decides it.

    roof = Roofline.of(get_cluster("dgx-a100"), "bf16")
    roof.seconds("gemm", flops=2 * 4096**3, nbytes=3 * 4096**2 * 2)   # FLOP-bound: ~0.59 ms
    node_seconds(node, roof)                                            # one node, unsharded

`Roofline.flops_only(peak)` is the FLOP-only model (FLOPs / peak, nothing else): what an
abstract mesh or a bare peak rate prices by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphpar.ir.cluster import COMPUTE_CLASSES, Cluster, ComputeRate
from graphpar.ir.registry import FREE, OpDef, OpKind, get_op
from graphpar.ir.types import TensorType

__all__ = ["SKINNY_ROWS", "Roofline", "bytes_moved", "node_seconds", "op_class", "op_seconds"]

SKINNY_ROWS = 16
"""A matmul with at most this many rows (M) is priced as `gemm_skinny`."""


@dataclass(frozen=True)
class Roofline:
    """The achieved rates of one device per op class, at one dtype. Hashable: a cache key."""

    rates: tuple[tuple[str, ComputeRate], ...]
    name: str = ""  # what the rates are of, for messages: "dgx-a100 bf16"
    per_result_byte: float = 0.0  # seconds per byte of a call's results (fresh memory)

    @classmethod
    def of(cls, cluster: Cluster, dtype: object = "fp32") -> Roofline:
        """The rates of `cluster`'s devices at `dtype` (classes its table lacks: peak FLOP/s)."""
        return cls(tuple((c, cluster.compute_rate(dtype, c)) for c in COMPUTE_CLASSES),
                   f"{cluster.name} {dtype}", cluster.seconds_per_result_byte)

    @classmethod
    def flops_only(cls, peak_flops: float) -> Roofline:
        """FLOPs at `peak_flops` for every class, no memory term, no overhead."""
        if not peak_flops > 0:
            raise ValueError(f"peak FLOP/s must be > 0, got {peak_flops!r}")
        rate = ComputeRate(float(peak_flops), math.inf, 0.0)
        return cls(tuple((c, rate) for c in COMPUTE_CLASSES), f"peak {peak_flops:g} FLOP/s")

    @classmethod
    def coerce(cls, value: Roofline | float) -> Roofline:
        """A roofline as is; a number as the FLOP-only roofline at that peak."""
        return value if isinstance(value, Roofline) else cls.flops_only(float(value))

    def rate(self, op_class: str) -> ComputeRate:
        for name, rate in self.rates:
            if name == op_class:
                return rate
        raise ValueError(f"unknown op class {op_class!r}; the classes are "
                         f"{', '.join(COMPUTE_CLASSES)}")

    def seconds(self, op_class: str, flops: float, nbytes: float, result_bytes: float = 0.0
                ) -> float:
        """max(flops / achieved FLOP/s, nbytes / achieved bandwidth) + overhead, plus the
        fresh memory of `result_bytes` of results; 0 if free."""
        if op_class == FREE:
            return 0.0
        rate = self.rate(op_class)
        return (max(flops / rate.flops, nbytes / rate.bandwidth) + rate.overhead
                + result_bytes * self.per_result_byte)

    def bound(self, op_class: str, flops: float, nbytes: float) -> str:
        """Which term decides: "compute", "memory" (or "free")."""
        if op_class == FREE:
            return FREE
        rate = self.rate(op_class)
        return "memory" if nbytes / rate.bandwidth > flops / rate.flops else "compute"


def _rows(op: OpDef, operands: Sequence[Any]) -> int | None:
    """The M of a matmul: rows of the first operand that meet one weight matrix (all leading
    dims when the second operand is a matrix, as in a linear layer), else its last-but-one."""
    if op.kind is not OpKind.MATMUL or not operands or not isinstance(operands[0], TensorType):
        return None
    a, b = operands[0], operands[1] if len(operands) > 1 else None
    if a.rank < 2:
        return 1
    if isinstance(b, TensorType) and b.rank <= 2:
        return math.prod(a.shape[:-1])
    return a.shape[-2]


def op_class(op: str | OpDef, operands: Sequence[Any]) -> str:
    """The class `op` is priced as on these operand types (the shard one device holds)."""
    op = get_op(op) if isinstance(op, str) else op
    cls = op.cost_class or FREE
    if cls == "gemm":
        rows = _rows(op, operands)
        if rows is not None and rows <= SKINNY_ROWS:
            return "gemm_skinny"
    return cls


def bytes_moved(op: str | OpDef, operands: Sequence[Any], results: Sequence[TensorType],
                attrs: dict | None = None) -> int:
    """Bytes read and written by one call on these (local) types."""
    op = get_op(op) if isinstance(op, str) else op
    return op.bytes_accessed(operands, list(results), attrs)


def result_bytes(results: Sequence[Any]) -> int:
    """Bytes of a call's tensor results: the fresh memory a step allocates for it (priced at
    the cluster's `seconds_per_result_byte`)."""
    return sum(r.nbytes for r in results if isinstance(r, TensorType))


def op_seconds(op: str | OpDef, operands: Sequence[Any], results: Sequence[TensorType],
               attrs: dict, roofline: Roofline | float, flops: float | None = None) -> float:
    """Seconds one device spends on `op` over these operand and result types (the shard it
    holds). `flops` overrides the op's FLOP rule on those types (a caller that divides the
    whole op's FLOPs by how far a strategy splits it)."""
    op = get_op(op) if isinstance(op, str) else op
    roof = Roofline.coerce(roofline)
    cls = op_class(op, operands)
    if cls == FREE:
        return 0.0
    if flops is None:
        flops = op.flops(operands, list(results), attrs)
    return roof.seconds(cls, flops, bytes_moved(op, operands, results, attrs),
                        result_bytes(results))


def node_seconds(node, roofline: Roofline | float, dtype: torch.dtype | None = None) -> float:
    """Seconds one device spends on `node` with the types it has (global ones before
    lower-spmd, a device's local ones after); with `dtype`, its floating-point tensors are
    taken at that dtype (a model captured in fp32 and served in fp16)."""
    def typed(t):
        if dtype is None or not isinstance(t, TensorType) or not t.dtype.is_floating_point:
            return t
        return TensorType(t.shape, dtype)

    operands = [typed(getattr(v, "type", v)) for v in node.inputs]
    return op_seconds(node.op, operands, [typed(o.type) for o in node.outputs], node.attrs,
                      roofline)
