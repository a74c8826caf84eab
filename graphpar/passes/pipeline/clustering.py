"""Operator clustering (Alpa Eq. 6): group the forward ops, in order, into L layers that each
do at most (1 + delta) / L of the FLOPs, minimizing the most data any layer receives from
the layers before it; ties go to the clustering whose layers' FLOPs vary least.

The DP runs on the forward graph only; backward ops and optimizer updates follow their forward
ops (`graphpar.passes.pipeline.partition.follow_forward`), so a layer's forward, backward and
update always land in one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph, Node
from graphpar.ir.registry import get_op
from graphpar.ir.structure import layer_of
from graphpar.passes.autoshard.identical_layers import repeated_layers

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


def cluster_bounds(chain: Chain, layers: int, delta: float = DEFAULT_DELTA,
                   starts: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Eq. 6: (first op, last op) of each of `layers` layers. The FLOP bound is raised to the
    largest single op's FLOPs when one op alone exceeds it, and doubled in slack while no
    clustering meets it. `starts` (ascending, 0 first) are the ops a layer may begin at; every
    op when not given."""
    found = _cluster(chain, layers, delta, _allowed(chain, starts))
    if found is None:
        raise ShardingError(f"cannot cluster {chain.flops.size} forward ops into {layers} "
                            f"layers that begin at {len(starts or ())} allowed ops: give at "
                            "most that many layers")
    return found.bounds


@dataclass(frozen=True)
class _Clustering:
    doubled: int  # times the FLOP bound's slack was doubled before a clustering met it
    worst: float  # Eq. 6: the most bytes a layer receives
    squares: float  # the tie-break: sum of squared layer FLOPs
    bounds: list[tuple[int, int]]

    @property
    def key(self) -> tuple[int, float, float]:
        """Better clusterings of the same ops compare lower."""
        return self.doubled, self.worst, self.squares


def _allowed(chain: Chain, starts: Sequence[int] | None) -> np.ndarray:
    ops = chain.flops.size
    if starts is None:
        return np.arange(ops, dtype=np.int64)
    allowed = np.unique(np.asarray(starts, dtype=np.int64))
    if allowed.size == 0 or allowed[0] != 0 or allowed[-1] >= ops:
        raise ShardingError(f"layer starts must include op 0 and lie below the {ops} ops")
    return allowed


def _cluster(chain: Chain, layers: int, delta: float, starts: np.ndarray) -> _Clustering | None:
    """Eq. 6 and its tie-break over the clusterings whose layers begin at `starts`; None
    when there are fewer starts than layers."""
    ops = chain.flops.size
    if layers < 1 or layers > ops:
        raise ShardingError(f"cannot cluster {ops} forward ops into {layers} layers: give "
                            f"layers between 1 and {ops}")
    if starts.size < layers:
        return None
    total = float(chain.flops.sum())
    bound = max((1.0 + delta) * total / layers, float(chain.flops.max(initial=0)))
    prefix = np.concatenate([[0.0], np.cumsum(chain.flops.astype(np.float64))])
    arrays = (chain.producer, chain.reader_start, chain.readers, chain.nbytes)
    doubled = 0
    while True:
        worst, _ = _cluster_dp(*arrays, layers, bound, prefix, starts, np.inf, False)
        if worst < np.inf:
            break
        bound *= 2.0
        doubled += 1
    squares, ends = _cluster_dp(*arrays, layers, bound, prefix, starts, worst, True)
    firsts = [0, *(int(e) + 1 for e in ends[:-1])]
    return _Clustering(doubled, float(worst), float(squares),
                       list(zip(firsts, (int(e) for e in ends))))


@njit(cache=True)
def _cluster_dp(chain_producer, reader_start, readers, nbytes, layers, bound, prefix, starts,
                limit, squares):
    """One DP over layers that begin at `starts`, each doing at most `bound` FLOPs. Without
    `squares`: the least max over layers of the bytes received (Eq. 6). With it: among the
    clusterings whose every layer receives at most `limit` bytes, the least sum of squared
    layer FLOPs (least variance: the total and count are fixed). Returns the optimum and each
    layer's last op.

    best[e, r]: ops before starts[e] (e = len(starts): all ops) in r layers. C(starts[a], k) is
    kept in column[a] and updated per op from each value's previous reader, so no K x K table
    is kept: O(K * starts * layers)."""
    ops = prefix.size - 1
    count = starts.size
    last_start = np.empty(ops, dtype=np.int64)  # index of the last start at or before op p
    a = 0
    for p in range(ops):
        while a + 1 < count and starts[a + 1] <= p:
            a += 1
        last_start[p] = a
    ends_at = np.full(ops, -1, dtype=np.int64)  # a layer may end at op k: the slot after it
    for a in range(1, count):
        ends_at[starts[a] - 1] = a
    ends_at[ops - 1] = count
    best = np.full((count + 1, layers + 1), np.inf)
    cut = np.zeros((count + 1, layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    column = np.zeros(count)
    by_op = _events_by_op(chain_producer, reader_start, readers, ops)
    for k in range(ops):
        for e in range(by_op[0][k], by_op[0][k + 1]):
            v, low = by_op[1][e], by_op[2][e]
            for a in range(last_start[low] + 1, last_start[k] + 1):  # starts in (low, k]
                column[a] += nbytes[v]
        slot = ends_at[k]
        if slot < 0:
            continue
        for a in range(last_start[k], -1, -1):  # the last layer is ops starts[a]..k
            work = prefix[k + 1] - prefix[starts[a]]
            if work > bound:
                break
            if squares and column[a] > limit:
                continue
            for r in range(1, layers + 1):
                before = best[a, r - 1]
                if before == np.inf:
                    continue
                value = before + work * work if squares else max(before, column[a])
                if value < best[slot, r]:
                    best[slot, r] = value
                    cut[slot, r] = a
    ends = np.zeros(layers, dtype=np.int64)
    slot = count
    for r in range(layers, 0, -1):
        ends[r - 1] = (ops if slot == count else starts[slot]) - 1
        slot = cut[slot, r]
    return best[count, layers], ends


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


def regular_bounds(graph: Graph, forward: Sequence[Node], layers: int,
                   delta: float = DEFAULT_DELTA) -> list[tuple[int, int]]:
    """Eq. 6 over the clusterings that cut every repeated block at the same place, so that the
    layers in the middle of a stack are identical and share their ILP solves: the first of
    `regular_clusterings`."""
    return regular_clusterings(graph, forward, layers, delta)[0]


def regular_clusterings(graph: Graph, forward: Sequence[Node], layers: int,
                        delta: float = DEFAULT_DELTA, cuts: int = 1
                        ) -> list[list[tuple[int, int]]]:
    """Eq. 6 over the clusterings that cut every repeated block at the same place; then, for
    c = 2 .. `cuts`, the same clustering with each of its block-long middle layers cut at c - 1
    places (the same in each), so finer but still identical middle layers. One clustering
    per c (fewer when the blocks have too few ops); one, plain Eq. 6 over every op, without
    repeated blocks.

    The blocks are autoshard's `repeated_layers` of the forward ops (module paths `blocks.7`,
    identical ops). For each offset into the blocks of the largest group, layers may begin at
    that offset in each of its blocks (at the first op of each block of any other group) and
    anywhere outside the blocks; the offset whose clustering is best by Eq. 6 (then the FLOP
    tie-break) wins. Each further cut keeps the layers found so far and adds, in every middle
    layer, the cut that makes the finer clustering best by the same key (greedy: O(cuts x
    block length) DPs). The layers at the ends are left as they are, so a finer clustering
    adds only its middle pieces as new kinds of layers (a transformer's: two); the stage DP
    can then end stages inside a block."""
    chain = forward_chain(forward)
    blocks = _block_runs(graph, forward)
    if not blocks:
        return [cluster_bounds(chain, layers, delta)]
    inside = np.zeros(len(forward), dtype=bool)
    for firsts, length in blocks:
        for first in firsts:
            inside[first:first + length] = True
    fixed = np.concatenate([[0], np.flatnonzero(~inside),
                            [first for firsts, _ in blocks[1:] for first in firsts]])
    (main, length), best = blocks[0], None
    for offset in range(length):
        starts = np.unique(np.concatenate([fixed, main + offset]))
        found = _cluster(chain, layers, delta, starts.astype(np.int64))
        if found is not None and (best is None or found.key < best[1].key):
            best = (offset, found)
    if best is None:
        return [cluster_bounds(chain, layers, delta)]
    found = [best[1].bounds]
    block_starts = set((main + best[0]).tolist())
    middle = [a for a, b in found[0] if a in block_starts
              and b - a + 1 == length]  # the layers that are exactly one block
    starts, inner = np.array([a for a, _ in found[0]], dtype=np.int64), []
    for _ in range(cuts - 1 if middle else 0):
        finer = None
        for shift in range(1, length):
            if shift in inner:
                continue
            tried = np.unique(np.concatenate([starts, np.array(middle, dtype=np.int64) + shift]))
            # every start is used: the one clustering of these layers, and its key
            clustering = _cluster(chain, tried.size, delta, tried)
            if finer is None or clustering.key < finer[1].key:
                finer = (shift, clustering)
        if finer is None:
            break
        inner.append(finer[0])
        starts = np.array([a for a, _ in finer[1].bounds], dtype=np.int64)
        found.append(finer[1].bounds)
    return found


def _block_runs(graph: Graph, forward: Sequence[Node]) -> list[tuple[np.ndarray, int]]:
    """Per group of identical forward blocks that each lie in one run of consecutive ops: the
    position of every block's first op and the block's op count, the group with the most
    blocks first."""
    position = {node: k for k, node in enumerate(forward)}
    runs = []
    for group in repeated_layers(graph, within=set(forward)):
        length = len(group.representative.nodes)
        firsts = [position[layer.nodes[0]] for layer in group.layers]
        if length and all(position[n] == first + k for layer, first in zip(group.layers, firsts)
                          for k, n in enumerate(layer.nodes)):
            runs.append((np.array(firsts, dtype=np.int64), length))
    return sorted(runs, key=lambda run: (-run[0].size, int(run[0][0])))


def equal_ranges(count: int, parts: int) -> list[tuple[int, int]]:
    """(first, last) of `parts` consecutive ranges of `count` items, equal in size within one:
    of ops, Alpa's "equal operator" clustering (§8.3); of layers, equal-layer stages."""
    edges = [round(i * count / parts) for i in range(parts + 1)]
    return [(a, b - 1) for a, b in zip(edges, edges[1:])]


def default_layer_count(forward: Sequence[Node]) -> int:
    """Layers to cluster into when not told: the model's repeated blocks (distinct
    `name.<index>` module prefixes, e.g. `blocks.0` ... `blocks.47`) plus one, at least 2 and
    at most the ops. With one more layer than blocks, the clustering of a transformer is
    regular (embedding + first attention, then MLP + next attention, ..., last MLP + head), so
    its layers come in 3 kinds whatever the depth; with two more it ends irregularly."""
    blocks = {layer_of(n.module) for n in forward} - {None}
    return max(1, min(len(forward), max(2, len(blocks) + 1)))
