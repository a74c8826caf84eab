"""Operator clustering (Alpa Eq. 6): group the forward ops, in order, into L layers that each
do at most (1 + delta) / L of the FLOPs, minimizing the most data any layer receives from
the layers before it; ties go to the clustering whose layers' FLOPs vary least.

The DP runs on the forward graph only; backward ops and optimizer updates follow their forward
ops (`graphpar.passes.pipeline.partition.follow_forward`), so a layer's forward, backward and
update always land in one stage.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.errors import ShardingError
from graphpar.ir.graph import Node, Role, Value
from graphpar.ir.registry import get_op

DEFAULT_DELTA = 0.6  # Alpa's default slack on FLOPs per layer


@dataclass(frozen=True)
class Chain:
    """The forward ops as the DP sees them: FLOPs per op, and per value read across ops its
    producer, its readers (op indices, ascending) and its bytes."""

    flops: np.ndarray  # int64 [K]
    producer: np.ndarray  # int64 [V]
    reader_start: np.ndarray  # int64 [V + 1]: readers of value v are readers[start[v]:start[v+1]]
    readers: np.ndarray  # int64
    nbytes: np.ndarray  # float64 [V]


def forward_chain(forward: Sequence[Node]) -> Chain:
    """The chain of `forward` (in topological order). Values from outside it (parameters,
    inputs) are not counted: a layer's data received is what earlier layers send it."""
    index = {node: k for k, node in enumerate(forward)}
    flops = np.zeros(len(forward), dtype=np.int64)
    producer, starts, readers, nbytes = [], [0], [], []
    for k, node in enumerate(forward):
        operands = [getattr(v, "type", v) for v in node.inputs]
        flops[k] = get_op(node.op).flops(operands, [o.type for o in node.outputs], node.attrs)
        for out in node.outputs:
            users = sorted(index[u] for u in out.users if u in index)
            if users:
                producer.append(k)
                readers.extend(users)
                starts.append(len(readers))
                nbytes.append(float(out.type.nbytes))
    return Chain(flops, np.array(producer, dtype=np.int64), np.array(starts, dtype=np.int64),
                 np.array(readers, dtype=np.int64), np.array(nbytes, dtype=np.float64))


def received_bytes(chain: Chain, first: int, last: int) -> float:
    """C(first, last): bytes of the values ops first..last read from ops before `first`."""
    total = 0.0
    for v in range(chain.producer.size):
        if chain.producer[v] < first:
            users = chain.readers[chain.reader_start[v]:chain.reader_start[v + 1]]
            if ((users >= first) & (users <= last)).any():
                total += chain.nbytes[v]
    return total


def cluster_bounds(chain: Chain, layers: int, delta: float = DEFAULT_DELTA
                   ) -> list[tuple[int, int]]:
    """Eq. 6: (first op, last op) of each of `layers` layers. The FLOP bound is raised to the
    largest single op's FLOPs when one op alone exceeds it, and doubled in slack while no
    clustering meets it."""
    ops = chain.flops.size
    if layers < 1 or layers > ops:
        raise ShardingError(f"cannot cluster {ops} forward ops into {layers} layers: give "
                            f"layers between 1 and {ops}")
    total = float(chain.flops.sum())
    bound = max((1.0 + delta) * total / layers, float(chain.flops.max(initial=0)))
    prefix = np.concatenate([[0.0], np.cumsum(chain.flops.astype(np.float64))])
    while True:
        worst = _min_max(chain, layers, bound, prefix)
        if worst < np.inf:
            break
        bound *= 2.0
    ends = _least_variance(chain, layers, bound, prefix, worst)
    firsts = [0, *(int(e) + 1 for e in ends[:-1])]
    return list(zip(firsts, (int(e) for e in ends)))


@njit(cache=True)
def _min_max_received(chain_producer, reader_start, readers, nbytes, layers, bound, prefix):
    ops = prefix.size - 1
    best = np.full((ops + 1, layers + 1), np.inf)  # best[k, r]: ops 0..k-1 in r layers
    best[0, 0] = 0.0
    column = np.zeros(ops + 1)  # column[i] = C(i, k) for the current k
    by_op = _events_by_op(chain_producer, reader_start, readers, ops)
    for k in range(ops):
        for e in range(by_op[0][k], by_op[0][k + 1]):
            v, low = by_op[1][e], by_op[2][e]
            for i in range(low + 1, k + 1):
                column[i] += nbytes[v]
        for i in range(k, -1, -1):  # the last layer is ops i..k
            if prefix[k + 1] - prefix[i] > bound:
                break
            for r in range(1, layers + 1):
                before = best[i, r - 1]
                if before == np.inf:
                    continue
                worst = max(before, column[i])
                if worst < best[k + 1, r]:
                    best[k + 1, r] = worst
    return best[ops, layers]


@njit(cache=True)
def _events_by_op(chain_producer, reader_start, readers, ops):
    """(start per op, value, low): for each reading op k, each value it reads newly counts
    in C(i, k) for low < i <= k, low being the value's producer or its previous reader."""
    count = np.zeros(ops + 1, dtype=np.int64)
    for r in range(readers.size):
        count[readers[r] + 1] += 1
    start = np.cumsum(count)
    fill = start[:-1].copy()
    value = np.zeros(readers.size, dtype=np.int64)
    low = np.zeros(readers.size, dtype=np.int64)
    for v in range(chain_producer.size):
        previous = chain_producer[v]
        for r in range(reader_start[v], reader_start[v + 1]):
            k = readers[r]
            value[fill[k]] = v
            low[fill[k]] = previous
            fill[k] += 1
            previous = k
    return start, value, low


def _min_max(chain: Chain, layers: int, bound: float, prefix: np.ndarray) -> float:
    return float(_min_max_received(chain.producer, chain.reader_start, chain.readers,
                                   chain.nbytes, layers, bound, prefix))


@njit(cache=True)
def _least_squares(chain_producer, reader_start, readers, nbytes, layers, bound, prefix, limit):
    """Among clusterings whose every layer receives at most `limit` bytes, the one with the
    least sum of squared layer FLOPs (least variance: the total and count are fixed)."""
    ops = prefix.size - 1
    best = np.full((ops + 1, layers + 1), np.inf)
    cut = np.zeros((ops + 1, layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    column = np.zeros(ops + 1)
    by_op = _events_by_op(chain_producer, reader_start, readers, ops)
    for k in range(ops):
        for e in range(by_op[0][k], by_op[0][k + 1]):
            v, low = by_op[1][e], by_op[2][e]
            for i in range(low + 1, k + 1):
                column[i] += nbytes[v]
        for i in range(k, -1, -1):
            work = prefix[k + 1] - prefix[i]
            if work > bound:
                break
            if column[i] > limit:
                continue
            for r in range(1, layers + 1):
                before = best[i, r - 1]
                if before == np.inf:
                    continue
                if before + work * work < best[k + 1, r]:
                    best[k + 1, r] = before + work * work
                    cut[k + 1, r] = i
    ends = np.zeros(layers, dtype=np.int64)
    k = ops
    for r in range(layers, 0, -1):
        ends[r - 1] = k - 1
        k = cut[k, r]
    return ends


def _least_variance(chain: Chain, layers: int, bound: float, prefix: np.ndarray,
                    limit: float) -> np.ndarray:
    return _least_squares(chain.producer, chain.reader_start, chain.readers, chain.nbytes,
                          layers, bound, prefix, limit)


_LAYER_INDEX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def default_layer_count(forward: Sequence[Node]) -> int:
    """Layers to cluster into when not told: the model's repeated blocks (distinct
    `name.<index>` module prefixes, e.g. `blocks.0` ... `blocks.47`) plus one, at least 2 and
    at most the ops. With one more layer than blocks, the clustering of a transformer is
    regular (embedding + first attention, then MLP + next attention, ..., last MLP + head), so
    its layers come in 3 kinds whatever the depth; with two more it ends irregularly."""
    blocks = {m.group(1) for n in forward if n.module for m in [_LAYER_INDEX.match(n.module)]
              if m}
    return max(1, min(len(forward), max(2, len(blocks) + 1)))


def layer_signature(nodes: Sequence[Node]) -> str:
    """A structural hash: equal for two node sets that do the same ops on the same types wired
    the same way, so that identical layers share their cost. Values from outside are compared
    by type and role only (an activation computed elsewhere counts as an input)."""
    local: dict[Value, tuple[int, int]] = {}
    outside: dict[Value, int] = {}
    digest = hashlib.sha256()
    for k, node in enumerate(nodes):
        operands = []
        for v in node.inputs:
            if not isinstance(v, Value):
                operands.append(repr(v))
            elif v in local:
                operands.append(local[v])
            else:
                if v not in outside:
                    outside[v] = len(outside)
                # An activation from another layer and a graph input are both just data in.
                role = Role.INPUT if v.role is None else v.role
                operands.append(("ext", outside[v], str(v.type), role.value))
        digest.update(repr((node.op, sorted(node.attrs.items()), operands,
                            [str(o.type) for o in node.outputs])).encode())
        for out in node.outputs:
            local[out] = (k, out.index)
    return digest.hexdigest()[:16]
