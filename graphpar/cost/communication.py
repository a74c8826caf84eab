"""Alpha-beta costs of collectives on mesh axes, and of resharding a tensor between layouts.

The model (ring algorithms, as NCCL runs them for large messages). For a collective
over a group of `n` devices with per-step latency `a` (alpha, seconds) and per-device
bandwidth `B` (bytes/s, one direction), on a buffer of `M` bytes:

    kind            M is                            time                         bytes sent per rank
    all_reduce      the buffer, per rank            2(n-1)·a + 2(n-1)/n · M/B    2(n-1)/n · M
    all_gather      the gathered output, per rank    (n-1)·a +  (n-1)/n · M/B     (n-1)/n · M
    reduce_scatter  the full input, per rank         (n-1)·a +  (n-1)/n · M/B     (n-1)/n · M
    all_to_all      the local buffer, per rank       (n-1)·a +  (n-1)/n · M/B     (n-1)/n · M
    broadcast       the buffer                       (n-1)·a +           M/B     M
    send_recv       the message                            a +           M/B     M

Ring all-gather / reduce-scatter take n-1 steps, each sending M/n; all-reduce is a
reduce-scatter then an all-gather (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan
2009, optimal in bandwidth). All-to-all sends M/n to each of n-1 peers (pairwise exchange
through a switch). Broadcast is a pipelined chain: M crosses each link once. With n = 1
every collective is free. "Bytes sent per rank" is the bandwidth term's numerator: the
bytes one rank puts on its link (nccl-tests' bus bytes; for broadcast the most any rank
sends, the last rank of the chain sends nothing). The runtime's byte counters are compared
against this number.

Differences from Alpa (`LogicalDeviceMesh` / `ClusterEnvironment`): Alpa charges alpha once
per collective, adds tiny tie-breaking constants (0.1, 0.01, 0.001), and scales all-to-all
by (n-1)/n² · n/2. Here alpha is charged per ring step, no constants are added (the ILP may
add its own), and all-to-all has the same bandwidth term as all-gather. The bandwidth
terms of all-gather, all-reduce and reduce-scatter are the same as Alpa's.

A collective over several mesh axes at once runs as one ring over the product of their
sizes, at the slowest axis' bandwidth and the largest latency (`Mesh.group_bandwidth`).

Where the mesh's cluster gives measured numbers for a collective kind (`Cluster.collectives`,
as `graphpar calibrate` fits them to these same formulas), they replace the link-derived
alpha and B of that kind on every axis whose device groups stay inside one node
(`measured_rates`); axes that cross nodes keep the links' numbers.

`resharding_cost(global_shape, dtype_bytes, src, dst, mesh)` returns the cheapest sequence
of single-axis steps (collectives and free local slices) that turns `src` into `dst`; see
its docstring.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph, Node, OutputRole
from graphpar.ir.layout import Layout, Partial, Placement, Replicate, Shard
from graphpar.ir.mesh import Mesh
from graphpar.ir.registry import StepKind
from graphpar.ir.spmd_ops import comm_kind, node_axes
from graphpar.units import format_bytes, format_seconds

__all__ = [
    "DEFERRED_ROLES",
    "Cost",
    "deferred_nodes",
    "Step",
    "StepKind",
    "ZERO_COST",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "broadcast_cost",
    "bucketed_resharding_seconds",
    "collective_bytes",
    "collective_cost",
    "collective_terms",
    "collective_time",
    "cross_mesh_cost",
    "measured_rates",
    "reduce_scatter_cost",
    "resharding_cost",
    "resharding_cost_matrix",
    "send_recv_cost",
]

AxesArg = int | str | Sequence[int | str]

# A training rank defers the all-reduces whose results only reach outputs of one of these
# roles to the end of the backward and runs them in buckets (`graphpar.runtime.overlap`); the
# ILP prices them so (`bucketed_resharding_seconds`).
DEFERRED_ROLES = (OutputRole.UPDATE, OutputRole.LOSS)


def deferred_nodes(graph: Graph) -> set[Node]:
    """The nodes of a training step that may wait until the whole backward has run: those
    whose results only reach the parameter and state updates (the optimizer step and the
    gradient work only it reads), and those whose results only reach the loss (its last
    reduction, which the backward does not read)."""
    return set().union(*(graph.nodes_only_reaching(role) for role in DEFERRED_ROLES))


# (latency steps as a function of n, bandwidth factor as a function of n)
_FORMULAS = {
    StepKind.ALL_REDUCE: (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    StepKind.ALL_GATHER: (lambda n: n - 1, lambda n: (n - 1) / n),
    StepKind.REDUCE_SCATTER: (lambda n: n - 1, lambda n: (n - 1) / n),
    StepKind.ALL_TO_ALL: (lambda n: n - 1, lambda n: (n - 1) / n),
    StepKind.BROADCAST: (lambda n: n - 1, lambda n: 1.0),
    StepKind.SEND_RECV: (lambda n: 1, lambda n: 1.0),
}


@lru_cache(maxsize=1 << 10)
def measured_rates(mesh: Mesh) -> tuple[tuple[int, str, float, float], ...]:
    """(axis, kind, latency, bandwidth) for every axis of `mesh` whose device groups stay
    inside one node and every collective kind its cluster measured; () without either."""
    cluster = mesh.cluster
    if cluster is None or not cluster.collectives:
        return ()
    grid = np.array(mesh.device_ids).reshape(mesh.shape)
    out = []
    for axis in range(mesh.ndim):
        groups = np.moveaxis(grid, axis, -1).reshape(-1, mesh.shape[axis])
        if all(len({cluster.node_of(int(d)) for d in g}) == 1 for g in groups):
            out.extend((axis, kind, lat, bw) for kind, lat, bw in cluster.collectives)
    return tuple(out)


def _rates(kind: StepKind, mesh: Mesh, axes: tuple[int, ...]) -> tuple[float, float]:
    """(bandwidth, latency) of a `kind` collective along `axes`: measured where every axis
    has a measurement of that kind, else the slowest axis' links."""
    found = {a: (bw, lat) for a, k, lat, bw in measured_rates(mesh) if k == kind.value}
    if axes and all(a in found for a in axes):
        return min(found[a][0] for a in axes), max(found[a][1] for a in axes)
    return mesh.group_bandwidth(axes), mesh.group_latency(axes)


def _terms(kind: StepKind, n: int, latency: float) -> tuple[float, float]:
    """(latency term, bandwidth factor) of a `kind` step over `n` ranks: it takes
    `latency term + factor * nbytes / bandwidth` seconds and sends `factor * nbytes` bytes.
    (0, 0) for local steps and n = 1."""
    if not kind.communicates or (n <= 1 and kind is not StepKind.SEND_RECV):
        return 0.0, 0.0
    steps, factor = _FORMULAS[kind]
    return steps(n) * latency, factor(n)


def collective_terms(kind: StepKind | str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of a `kind` collective over `n` ranks: it takes
    `steps * latency + factor * nbytes / bandwidth` seconds (the table above). What
    `graphpar.calibration.fit` fits measured times to."""
    return _terms(StepKind(kind), n, 1.0)


def collective_bytes(kind: StepKind | str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a `kind` collective over `n` ranks on an `nbytes` buffer
    (see the module docstring for what `nbytes` is per kind). 0 for local steps and n = 1."""
    factor = _terms(StepKind(kind), n, 0.0)[1]
    return factor * nbytes if factor else 0.0


def collective_time(kind: StepKind | str, nbytes: float, n: int, bandwidth: float,
                    latency: float) -> float:
    """Seconds for a `kind` collective over `n` ranks: steps·latency + bytes sent/bandwidth."""
    alpha, factor = _terms(StepKind(kind), n, latency)
    return alpha + factor * nbytes / bandwidth if factor else 0.0


@dataclass(frozen=True)
class Step:
    """One step of a plan: a collective (or a free local op) along some mesh axes.

    - `nbytes`: the buffer size per device as the table in the module docstring defines it
      (gathered output for all_gather, full input for reduce_scatter, ...).
    - `bytes_sent`: bytes each device sends (`collective_bytes`); `seconds`: estimated time.
    - `gather_dim`: the tensor dim that is concatenated (all_gather; all_to_all's source
      shard dim; local_pad). `scatter_dim`: the tensor dim that is split (reduce_scatter;
      all_to_all's destination shard dim; local_slice).
    - `reduce_op`: for all_reduce / reduce_scatter / local_zero.
    - `src`, `dst`: the layout before and after the step (resharding plans only).
    """

    kind: StepKind
    axes: tuple[int, ...]
    group_size: int
    nbytes: float
    bytes_sent: float
    seconds: float
    gather_dim: int | None = None
    scatter_dim: int | None = None
    reduce_op: str | None = None
    src: Layout | None = None
    dst: Layout | None = None

    def __str__(self) -> str:
        attrs = [f"mesh_axis={','.join(map(str, self.axes))}"]
        if self.gather_dim is not None:
            attrs.append(f"gather_dim={self.gather_dim}")
        if self.scatter_dim is not None:
            attrs.append(f"scatter_dim={self.scatter_dim}")
        if self.reduce_op is not None:
            attrs.append(f"op={self.reduce_op}")
        text = f"{self.kind}{{{', '.join(attrs)}}}"
        if self.src is not None and self.dst is not None:
            text += f" {self.src} -> {self.dst}"
        if self.kind.communicates:
            text += (f"  # n={self.group_size}, {format_bytes(self.nbytes)} buffer, "
                     f"{format_bytes(self.bytes_sent)} sent/device, "
                     f"{format_seconds(self.seconds)} est")
        return text


def collective_cost(kind: StepKind | str, nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """The cost of one `kind` collective on an `nbytes` buffer along mesh `axes` (one axis, or
    several run as one ring at the slowest axis' bandwidth)."""
    kind = StepKind(kind)
    ax = mesh.axes(axes)
    n = mesh.group_size(ax)
    seconds = collective_time(kind, nbytes, n, *_rates(kind, mesh, ax))
    return Step(kind, ax, n, float(nbytes), collective_bytes(kind, nbytes, n), seconds)


def all_reduce_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """All-reduce of an `nbytes` buffer: 2(n-1)·a + 2(n-1)/n · nbytes/B."""
    return collective_cost(StepKind.ALL_REDUCE, nbytes, mesh, axes)


def all_gather_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """All-gather whose gathered output is `nbytes` per device: (n-1)·a + (n-1)/n · nbytes/B."""
    return collective_cost(StepKind.ALL_GATHER, nbytes, mesh, axes)


def reduce_scatter_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """Reduce-scatter of an `nbytes` input per device: (n-1)·a + (n-1)/n · nbytes/B."""
    return collective_cost(StepKind.REDUCE_SCATTER, nbytes, mesh, axes)


def all_to_all_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """All-to-all of an `nbytes` local buffer per device: (n-1)·a + (n-1)/n · nbytes/B."""
    return collective_cost(StepKind.ALL_TO_ALL, nbytes, mesh, axes)


def broadcast_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """Broadcast of `nbytes` from one device of each group: (n-1)·a + nbytes/B."""
    return collective_cost(StepKind.BROADCAST, nbytes, mesh, axes)


def send_recv_cost(nbytes: float, mesh: Mesh, axes: AxesArg) -> Step:
    """Point-to-point send of `nbytes` between two devices along `axes`: a + nbytes/B."""
    return collective_cost(StepKind.SEND_RECV, nbytes, mesh, axes)


@dataclass(frozen=True)
class CrossMeshCost:
    """Moving a whole tensor from one sub-mesh to every device of another (pipeline stages):
    estimated seconds, bytes over the links between the meshes, bytes inside the destination."""

    seconds: float
    bytes_across: float
    bytes_inside: float


def cross_mesh_cost(nbytes: float, dst: Mesh, bandwidth: float, latency: float,
                    local_all_gather: bool = True) -> CrossMeshCost:
    """Give every device of sub-mesh `dst` a whole `nbytes` tensor that another sub-mesh holds,
    over links of `bandwidth` bytes/s and `latency` s between the meshes.

    Sent naively, each of the n destination devices receives all of it: n·M bytes cross, one
    after another on the sender's link, a + n·M/B. With Alpa's local all-gather (§6) each
    tile crosses once: device i of `dst` receives M/n of it (a + M/B across, the n pieces in
    parallel from the source's devices, bounded by its link), then an all-gather over all of
    `dst`'s axes, on its own faster links, makes it whole everywhere."""
    n = dst.size
    if not local_all_gather or n == 1:
        return CrossMeshCost(latency + n * nbytes / bandwidth, float(n * nbytes), 0.0)
    gather = all_gather_cost(nbytes, dst, tuple(range(dst.ndim)))
    return CrossMeshCost(latency + nbytes / bandwidth + gather.seconds, float(nbytes),
                         gather.bytes_sent * n)


@dataclass(frozen=True)
class Cost:
    """A plan and what it costs: total estimated seconds, total bytes sent per device (sum of
    the steps' `bytes_sent`), and the steps in order (collectives and free local ops)."""

    seconds: float
    bytes: float
    steps: tuple[Step, ...] = ()

    @property
    def collectives(self) -> tuple[Step, ...]:
        """The steps that communicate."""
        return tuple(s for s in self.steps if s.kind.communicates)

    @property
    def is_free(self) -> bool:
        return not self.collectives

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.seconds + other.seconds, self.bytes + other.bytes,
                    self.steps + other.steps)

    def __str__(self) -> str:
        head = (f"{format_seconds(self.seconds)} est, {format_bytes(self.bytes)} sent/device, "
                f"{len(self.collectives)} collective(s)")
        return "\n".join([head] + [f"  {s}" for s in self.steps])


ZERO_COST = Cost(0.0, 0.0, ())


# ------------------------------------------------------------------------- resharding
#
# The search works on placements encoded as ints (hashing and comparing tuples of ints is
# several times faster than of dataclasses): d >= 0 is Shard(d), -1 Replicate, and -2 - i
# the i-th Partial of `_partials` (index 0 is Partial("sum")).

_R = -1


def _encode(p: Placement, partials: list[Partial]) -> int:
    if isinstance(p, Shard):
        return p.dim
    if isinstance(p, Replicate):
        return _R
    assert isinstance(p, Partial)
    if p not in partials:
        partials.append(p)
    return -2 - partials.index(p)


def _decode(code: int, partials: list[Partial]) -> Placement:
    if code >= 0:
        return Shard(code)
    return Replicate() if code == _R else partials[-2 - code]


def _last_axis(state: tuple[int, ...], dim: int) -> int:
    """The most minor mesh axis sharding tensor dim `dim`, or -1."""
    for axis in range(len(state) - 1, -1, -1):
        if state[axis] == dim:
            return axis
    return -1


def _transition(state: tuple[int, ...], axis: int, new: int, local_bytes: float, n: int,
                partials: list[Partial]) \
        -> tuple[StepKind, float, int | None, int | None, str | None] | None:
    """The step that changes mesh axis `axis` of `state` to `new` in place, as
    (kind, nbytes, gather_dim, scatter_dim, reduce_op), or None if no single step can.
    `local_bytes` is the per-device size in `state`, `n` the size of mesh axis `axis`.

    Exactness: with several mesh axes on one tensor dim the lowest is major, so a device's
    chunk is contiguous within its parent chunk only for the most minor axis. Hence a
    dim can be gathered only along its most minor sharding axis, and a new shard of a dim
    can be added only below (more minor than) the axes already sharding it.
    """
    old = state[axis]
    if old >= 0:  # Shard(old)
        if _last_axis(state, old) != axis:
            return None
        if new == _R:
            return StepKind.ALL_GATHER, local_bytes * n, old, None, None
        if new >= 0:
            if _last_axis(state, new) > axis:
                return None
            return StepKind.ALL_TO_ALL, local_bytes, old, new, None
        if partials[-2 - new].reduce_op == "sum":
            return StepKind.LOCAL_PAD, 0.0, old, None, None
        return None
    if old == _R:
        if new >= 0:
            if _last_axis(state, new) > axis:
                return None
            return StepKind.LOCAL_SLICE, 0.0, None, new, None
        return StepKind.LOCAL_ZERO, 0.0, None, None, partials[-2 - new].reduce_op
    op = partials[-2 - old].reduce_op  # Partial(op)
    if new == _R:
        return StepKind.ALL_REDUCE, local_bytes, None, None, op
    if new >= 0:
        if _last_axis(state, new) > axis:
            return None
        return StepKind.REDUCE_SCATTER, local_bytes, None, new, op
    return None  # one partial op to another: through R


@dataclass(frozen=True)
class _Tree:
    """Every layout reachable from one source, searched once: per state its best (seconds,
    bytes, steps) and the step that reached it. Shared by all destinations of that source."""

    start: tuple[int, ...]
    partials: tuple[Partial, ...]
    best: dict[tuple[int, ...], tuple[float, float, int]]
    came_from: dict[tuple[int, ...], tuple]


def _local_bytes(state: tuple[int, ...], dims: tuple[int, ...], total_bytes: int,
                 mesh_shape: tuple[int, ...]) -> int | None:
    """Bytes per device, or None if some sharded dim does not divide."""
    sizes = list(dims)
    shards = 1
    for axis, code in enumerate(state):
        if code >= 0:
            if sizes[code] % mesh_shape[axis]:
                return None
            sizes[code] //= mesh_shape[axis]
            shards *= mesh_shape[axis]
    return total_bytes // shards


class _Steps:
    """The single steps out of each layout of one tensor class on one mesh, with their costs:
    (next state, axis, move, seconds, bytes sent) per edge, in the order the search tries them.
    Built per state on first use and shared by the searches from every source."""

    def __init__(self, dims: tuple[int, ...], total_bytes: int, partials: tuple[Partial, ...],
                 candidates: tuple[tuple[int, ...], ...], mesh_shape: tuple[int, ...],
                 bandwidth: tuple[float, ...], latency: tuple[float, ...],
                 measured: tuple[tuple[int, str, float, float], ...] = ()):
        self.dims, self.total_bytes, self.partials = dims, total_bytes, partials
        self.candidates, self.mesh_shape = candidates, mesh_shape
        # per axis and step kind, looked up once rather than per edge: (latency term,
        # bandwidth factor, bandwidth), from a measurement of the kind on the axis if any
        rate = {(a, k): (lat, bw) for a, k, lat, bw in measured}
        self.terms = [
            {kind: (*_terms(kind, n, rate.get((a, kind.value), (lat, 0.0))[0]),
                    rate.get((a, kind.value), (0.0, bw))[1]) for kind in StepKind}
            for a, (n, lat, bw) in enumerate(zip(mesh_shape, latency, bandwidth))]
        self._out: dict[tuple[int, ...], list[tuple]] = {}

    def out_of(self, state: tuple[int, ...]) -> list[tuple]:
        found = self._out.get(state)
        if found is None:
            found = self._out[state] = self._edges(state)
        return found

    def _edges(self, state: tuple[int, ...]) -> list[tuple]:
        dims, total, mesh_shape = self.dims, self.total_bytes, self.mesh_shape
        local = _local_bytes(state, dims, total, mesh_shape)
        assert local is not None
        local_bytes = float(local)
        edges = []
        for axis, options in enumerate(self.candidates):
            n, old = mesh_shape[axis], state[axis]
            for new in options:
                if new == old:
                    continue
                move = _transition(state, axis, new, local_bytes, n, self.partials)
                if move is None:
                    continue
                nxt = state[:axis] + (new,) + state[axis + 1:]
                if _local_bytes(nxt, dims, total, mesh_shape) is None:
                    continue
                alpha, factor, bandwidth = self.terms[axis][move[0]]
                buffer = move[1]
                step_seconds = alpha + factor * buffer / bandwidth if factor else 0.0
                edges.append((nxt, axis, move, step_seconds, factor * buffer if factor else 0.0))
        return edges


@lru_cache(maxsize=1 << 10)
def _steps(dims: tuple[int, ...], total_bytes: int, partials: tuple[Partial, ...],
           candidates: tuple[tuple[int, ...], ...], mesh_shape: tuple[int, ...],
           bandwidth: tuple[float, ...], latency: tuple[float, ...],
           measured: tuple = ()) -> _Steps:
    return _Steps(dims, total_bytes, partials, candidates, mesh_shape, bandwidth, latency,
                  measured)


@lru_cache(maxsize=1 << 12)  # a tree holds every state it reached: keep fewer
def _tree(steps: _Steps, start: tuple[int, ...]) -> _Tree:
    """Dijkstra from `start` over every layout it reaches; an edge changes one mesh axis'
    placement by one step (`_transition`), to one of that axis' candidates. Ties on seconds
    are broken by bytes, then by the number of steps.

    The search depends on the tensor only through its class in `steps`: each dim's gcd with
    the mesh size (what decides which shardings divide) and its size in bytes. Searching to
    the end rather than stopping at one goal changes no goal's result: the states settled
    before a goal, and so its path, are the same either way.
    """
    best: dict[tuple[int, ...], tuple[float, float, int]] = {start: (0.0, 0.0, 0)}
    # state -> (previous state, axis, (kind, nbytes, gather_dim, scatter_dim, op), seconds, sent)
    came_from: dict[tuple[int, ...], tuple] = {}
    counter = itertools.count()
    heap = [(0.0, 0.0, 0, next(counter), start)]
    done: set[tuple[int, ...]] = set()
    while heap:
        seconds, nbytes, nsteps, _, state = heapq.heappop(heap)
        if state in done:
            continue
        done.add(state)
        for nxt, axis, move, step_seconds, sent in steps.out_of(state):
            if nxt in done:
                continue
            cost = (seconds + step_seconds, nbytes + sent, nsteps + 1)
            known = best.get(nxt)
            if known is not None and known <= cost:
                continue
            best[nxt] = cost
            came_from[nxt] = (state, axis, move, step_seconds, sent)
            heapq.heappush(heap, (*cost, next(counter), nxt))
    return _Tree(start, steps.partials, best, came_from)


def _search(shape: tuple[int, ...], dtype_bytes: int, src: Layout, dst: Layout,
            mesh_shape: tuple[int, ...], bandwidth: tuple[float, ...],
            latency: tuple[float, ...], via_partial: bool, measured: tuple = ()
            ) -> tuple[_Tree, tuple[int, ...]]:
    """The search tree from `src` that holds the cheapest way to `dst`, and `dst`'s state.

    Each axis may pass through Replicate, any Shard(d), the Partial placements that `src`
    or `dst` have on that axis, and (if `via_partial`) Partial("sum"), which can stand in
    for any other partial intermediate. Destinations that add no partial of their own to
    those (the common case) share the source's one tree.
    """
    steps, start = _source(shape, dtype_bytes, src, mesh_shape, bandwidth, latency, via_partial,
                           measured)
    goal = _sum_state(dst)
    if goal is None or any(code < _R and code not in options
                           for code, options in zip(goal, steps.candidates)):
        partials = list(steps.partials)  # dst brings a partial of its own: a tree of its own
        goal = tuple(_encode(p, partials) for p in dst)
        candidates = tuple(
            options + ((goal[axis],) if goal[axis] < _R and goal[axis] not in options else ())
            for axis, options in enumerate(steps.candidates))
        steps = _steps(steps.dims, steps.total_bytes, tuple(partials), candidates,
                       mesh_shape, bandwidth, latency, measured)
    tree = _tree(steps, start)
    if goal not in tree.best:  # unreachable: src -> all-Replicate -> dst always exists
        raise ShardingError(f"no resharding plan from {src} to {dst} on mesh "
                            f"{'x'.join(map(str, mesh_shape))}")
    return tree, goal


@lru_cache(maxsize=1 << 14)
def _source(shape: tuple[int, ...], dtype_bytes: int, src: Layout,
            mesh_shape: tuple[int, ...], bandwidth: tuple[float, ...],
            latency: tuple[float, ...], via_partial: bool, measured: tuple = ()
            ) -> tuple[_Steps, tuple[int, ...]]:
    """The steps a search from `src` may take (per axis Replicate, every Shard(d), Partial
    (sum) if `via_partial`, and the partial `src` has there), and `src`'s state. Partials
    are numbered sum first, then `src`'s own, so further ones keep `src`'s state valid."""
    partials: list[Partial] = [Partial()]
    start = tuple(_encode(p, partials) for p in src)
    candidates: list[tuple[int, ...]] = []
    for axis in range(len(mesh_shape)):
        options = [_R] + list(range(len(shape)))
        if via_partial:
            options.append(-2)
        if start[axis] < _R and start[axis] not in options:
            options.append(start[axis])
        candidates.append(tuple(options))
    size = math.prod(mesh_shape)
    dims = tuple(math.gcd(d, size) for d in shape)
    steps = _steps(dims, math.prod(shape) * dtype_bytes, tuple(partials), tuple(candidates),
                   mesh_shape, bandwidth, latency, measured)
    return steps, start


@lru_cache(maxsize=1 << 14)
def _sum_state(layout: Layout) -> tuple[int, ...] | None:
    """`layout` encoded, if its partials are all sums (they encode the same in every search);
    None if it has another partial."""
    if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in layout):
        return None
    return tuple(_encode(p, [Partial()]) for p in layout)


@lru_cache(maxsize=1 << 16)
def _plan(shape: tuple[int, ...], dtype_bytes: int, src: Layout, dst: Layout,
          mesh_shape: tuple[int, ...], bandwidth: tuple[float, ...],
          latency: tuple[float, ...], via_partial: bool, measured: tuple = ()) -> Cost:
    """The cheapest plan from `src` to `dst`, read off the search tree from `src`."""
    if src == dst:
        return ZERO_COST
    tree, goal = _search(shape, dtype_bytes, src, dst, mesh_shape, bandwidth, latency,
                         via_partial, measured)

    def layout(state: tuple[int, ...]) -> Layout:
        return Layout(tuple(_decode(code, tree.partials) for code in state))

    steps: list[Step] = []
    state = goal
    while state != tree.start:
        prev, axis, (kind, buffer, gather_dim, scatter_dim, op), step_seconds, sent = \
            tree.came_from[state]
        steps.append(Step(kind, (axis,), mesh_shape[axis], buffer, sent, step_seconds,
                          gather_dim, scatter_dim, op, layout(prev), layout(state)))
        state = prev
    steps.reverse()
    total_seconds, total_bytes, _ = tree.best[goal]
    return Cost(total_seconds, total_bytes, tuple(steps))


def resharding_cost(global_shape: Sequence[int], dtype_bytes: int, src: Layout, dst: Layout,
                    mesh: Mesh, via_partial: bool = True) -> Cost:
    """The cheapest way to turn a tensor laid out as `src` into `dst` on `mesh`.

    Each step changes one mesh axis' placement:

        S(d) -> R     all_gather along the axis (gathered size = local size x axis size)
        P    -> R     all_reduce
        P    -> S(d)  reduce_scatter
        S(d) -> S(e)  all_to_all (same local size before and after)
        R    -> S(d)  local_slice, free
        R    -> P     local_zero, free
        S(d) -> P     local_pad, free (sum only)

    A step on an axis is allowed only where it is exact (see `_transition`): a dim sharded
    by several axes is gathered minor axis first and sharded major axis first. The order
    and route with the least time are searched (Dijkstra over intermediate layouts), so:

    - {S(0),S(1)} -> {S(1),S(0)} on a 3-D tensor goes through S(2) with three all-to-alls
      rather than an all-gather;
    - {P,P} -> {R,R} on 2x4 is the hierarchical all-reduce: reduce_scatter on axis 1,
      all_reduce the quarter on axis 0, all_gather on axis 1;
    - on 2 DGX A100 as 2x8 (axis 0 25 GB/s, axis 1 300 GB/s), {S(0),R} -> {R,R} of a
      matrix slices dim 1 on axis 1, all-gathers 1/8 of the data across the slow axis,
      then all-gathers on axis 1;
    - with `via_partial` (default) a zero-padded partial sum may be an intermediate: for a
      vector on that mesh, {S(0),R} -> {R,R} pads to {P,R}, slices to {P,S(0)},
      all-reduces 1/8 of the data across axis 0 and all-gathers on axis 1: 2.5x faster
      than one all-gather across the slow axis, though it sends more bytes in all.
      `via_partial=False` keeps to the partials that `src` or `dst` have (closer to
      torch.distributed.tensor's redistribute).

    `src == dst` costs nothing. Results are cached on (shape, dtype_bytes, src, dst, mesh
    shape, bandwidths, latencies, via_partial); device ids and axis names do not affect
    the cost. Raises ShardingError if `src` or `dst` does not fit `global_shape` on `mesh`.
    """
    shape = tuple(int(s) for s in global_shape)
    src.check(shape, mesh)
    dst.check(shape, mesh)
    return _plan(shape, int(dtype_bytes), src, dst, mesh.shape, mesh.bandwidth, mesh.latency,
                 bool(via_partial), measured_rates(mesh))


def resharding_cost_matrix(global_shape: Sequence[int], dtype_bytes: int,
                           srcs: Sequence[Layout], dsts: Sequence[Layout],
                           mesh: Mesh, via_partial: bool = True) -> list[list[float]]:
    """`[[resharding_cost(..., s, d, mesh).seconds for d in dsts] for s in srcs]`: the R_vu
    matrix of Alpa's ILP for one edge. Each layout is checked once and each source searched
    once for all its destinations; no plans are spelled out, only their times read."""
    shape, dtype_bytes = tuple(int(s) for s in global_shape), int(dtype_bytes)
    for layout in {*srcs, *dsts}:
        layout.check(shape, mesh)
    args = (mesh.shape, mesh.bandwidth, mesh.latency, bool(via_partial), measured_rates(mesh))
    rows = []
    for s in srcs:
        row = []
        for d in dsts:
            if s == d:
                row.append(0.0)
            else:
                tree, goal = _search(shape, dtype_bytes, s, d, *args)
                row.append(tree.best[goal][0])
        rows.append(row)
    return rows


def bucketed_resharding_seconds(global_shape: Sequence[int], dtype_bytes: int, src: Layout,
                                dst: Layout, mesh: Mesh, bucket_bytes: float) -> float:
    """`resharding_cost(...).seconds` of a value whose all-reduce the runtime runs in a bucket
    with others of about `bucket_bytes` (a training step's gradients:
    `graphpar.runtime.overlap`): where the cheapest resharding is one all-reduce, its
    latency term is shared by the bucket's members in proportion to their bytes (this one's
    share: its local bytes over `bucket_bytes`, at most all of it), its bandwidth term stays
    whole. Linear in each value's bytes, as the ILP needs; a bucket that is not full is priced
    below what it costs, one that mixes a large value with small ones about right. Any other
    resharding costs what `resharding_cost` says."""
    cost = resharding_cost(global_shape, dtype_bytes, src, dst, mesh)
    if len(cost.steps) != 1 or cost.steps[0].kind is not StepKind.ALL_REDUCE:
        return cost.seconds
    step = cost.steps[0]
    latency = _rates(StepKind.ALL_REDUCE, mesh, step.axes)[1]
    alpha = _terms(StepKind.ALL_REDUCE, step.group_size, latency)[0]
    share = min(1.0, step.nbytes / bucket_bytes)
    return cost.seconds - alpha * (1.0 - share)


def node_comm_cost(node: Node, mesh: Mesh) -> Step | None:
    """The estimated cost of a communicating node of a device program on `mesh`, or None.

    The cost model's buffer size is the larger of the node's local input and result: the
    gathered result of all_gather, the full input of reduce_scatter, the tensor itself for
    all_reduce, all_to_all and send.
    """
    kind = comm_kind(node.op)
    if kind is None or not kind.communicates:
        return None
    types = [v.type for v in node.input_values] + [o.type for o in node.outputs]
    nbytes = max(t.nbytes for t in types)
    if kind is StepKind.SEND_RECV:
        bandwidth, latency = _rates(kind, mesh, tuple(range(mesh.ndim)))
        seconds = collective_time(kind, nbytes, 2, bandwidth, latency)
        return Step(kind, (), 2, float(nbytes), collective_bytes(kind, nbytes, 2), seconds)
    return collective_cost(kind, nbytes, mesh, node_axes(node))


def annotate_comm(node: Node) -> str:
    """The printer's `annotate` hook in dumps, for graphs declared on a mesh: '12.6 MB, 0.21 ms
    est' for a collective of a device program (its buffer), '3.1 MB sent, 0.05 ms est' for a
    `reshard` of a sharded global graph (what its planned collectives send per device); ''
    otherwise."""
    mesh = node.graph.mesh if node.graph is not None else None
    if mesh is None:
        return ""
    if node.op == "reshard":
        (src,) = node.input_values
        dst = node.outputs[0].layout
        if src.layout is None or dst is None:
            return ""
        cost = resharding_cost(src.type.shape, src.type.itemsize, src.layout, dst, mesh)
        return f"{format_bytes(cost.bytes)} sent, {format_seconds(cost.seconds)} est"
    step = node_comm_cost(node, mesh)
    if step is None:
        return ""
    return f"{format_bytes(step.nbytes)}, {format_seconds(step.seconds)} est"
