"""Alpa's stage/sub-mesh DP (Eq. 3-5): slice L layers into pipeline stages and the cluster into
sub-meshes, minimizing sum(t_i) + (B - 1) * max(t_i) for B microbatches.

The inputs are cost tables over (first layer, last layer, sub-mesh shape): numpy arrays, so the
search itself is compiled with numba and knows nothing of graphs. For each candidate bound
t_max on a stage's time (ascending), F[s, k, d] is the least sum of stage times slicing layers
k..L-1 into s stages on exactly d devices, every stage at most t_max and within memory with
the s - 1 stages after it (1F1B stashes one microbatch per stage still to run, Eq. 5).
The plan's cost uses the actual slowest stage of the slicing found, not t_max.

Four prunings, all sound:

- the bounds below the least one some slicing meets are skipped, found by bisection (whether
  a slicing exists only grows with the bound);
- early stop: every plan found at t_max or later costs at least B * t_max (its sum is at least
  its max), so the enumeration stops once B * t_max reaches the best cost so far;
- a plan in hand (`beat`, another clustering's step): bounds t_max with B * t_max at or
  above it are dropped before the bisection, since no slicing under them can beat it;
- epsilon: candidates closer than `epsilon` are solved once, at the largest of them, so the
  answer is within (B - 1) * epsilon of the optimum (Alpa instead skips them, which loses
  that bound when the next candidate is far away).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from graphpar.errors import ShardingError


def submesh_shapes(hosts: int, devices_per_host: int, power_of_two_hosts: bool = False
                   ) -> tuple[tuple[int, int], ...]:
    """The sub-mesh shapes a stage may take (Alpa §5.2): (1, 1), (1, 2), (1, 4), ... up to a
    whole host, then (2, M), (3, M), ... (N, M) whole hosts — or only (2, M), (4, M), ...
    with `power_of_two_hosts` (what Alpa's code does by default: fewer ILP solves)."""
    if devices_per_host & (devices_per_host - 1):
        raise ShardingError(f"stage slicing needs a power-of-two number of devices per host, "
                            f"got {devices_per_host}")
    shapes = [(1, 1 << p) for p in range(devices_per_host.bit_length())]
    shapes += [(n, devices_per_host) for n in range(2, hosts + 1)
               if not power_of_two_hosts or not n & (n - 1)]
    return tuple(shapes)


def place_submeshes(shapes: Sequence[tuple[int, int]], hosts: int, devices_per_host: int
                    ) -> list[tuple[int, ...]]:
    """Physical devices for sub-meshes whose sizes add up to the cluster (Alpa's Theorem 1:
    such shapes always tile the N x M mesh). Whole-host shapes take hosts first; the (1, 2^p)
    shapes are then packed largest first, each aligned inside one host. Devices are numbered
    node-major; the result is in the order of `shapes`."""
    total = sum(n * m for n, m in shapes)
    if total != hosts * devices_per_host:
        raise ShardingError(f"sub-meshes of {total} devices cannot tile a {hosts}x"
                            f"{devices_per_host} mesh of {hosts * devices_per_host}")
    placed: list[tuple[int, ...]] = [()] * len(shapes)
    next_host = 0
    for i, (n, m) in enumerate(shapes):
        if n > 1 or m == devices_per_host:
            first = next_host * devices_per_host
            placed[i] = tuple(range(first, first + n * m))
            next_host += n
    cursor = next_host * devices_per_host  # sizes are powers of two, largest first: aligned
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i][1]):
        n, m = shapes[i]
        if n == 1 and m < devices_per_host:
            placed[i] = tuple(range(cursor, cursor + m))
            cursor += m
    return placed


@dataclass(frozen=True)
class StageCosts:
    """What the DP reads, for layers i..j (inclusive) on sub-mesh shape m:

    - `seconds[i, j, m]`: the stage's time per microbatch (inf where it cannot run there);
    - `max_after[i, j, m]`: how many stages may follow it before its stashed activations
      overflow the device (Eq. 5); -1 where it does not fit even as the last stage.
    """

    seconds: np.ndarray  # float64 [L, L, shapes]
    max_after: np.ndarray  # int64 [L, L, shapes]
    shapes: tuple[tuple[int, int], ...]

    @property
    def layers(self) -> int:
        return self.seconds.shape[0]


@dataclass(frozen=True)
class StageSolution:
    """The DP's answer: stages as (first layer, last layer, sub-mesh shape index), in order."""

    stages: tuple[tuple[int, int, int], ...]
    seconds: float  # sum(t_i) + (B - 1) * max(t_i)
    bounds_tried: int  # how many t_max bounds the DP ran for


def pipeline_seconds(stage_seconds: Sequence[float], microbatches: int) -> float:
    """Eq. 2: the first microbatch passes every stage, the rest follow at the slowest's pace."""
    return float(sum(stage_seconds) + (microbatches - 1) * max(stage_seconds))


def solve_stages(costs: StageCosts, devices: int, microbatches: int, stages: int = 0,
                 epsilon: float = 0.0, prune: bool = True, beat: float = math.inf
                 ) -> StageSolution | None:
    """The cheapest slicing of all layers into stages covering exactly `devices` devices
    (`stages` > 0 forces that many), or None when no slicing fits. `beat`: the step of a plan
    already in hand; only a strictly cheaper slicing is wanted (None when there is none), so
    the early stop starts from it rather than from the first slicing found. The answer is the
    one found without `beat` whenever that one is cheaper than `beat`."""
    t = np.ascontiguousarray(costs.seconds, dtype=np.float64)
    after = np.ascontiguousarray(costs.max_after, dtype=np.int64)
    sizes = np.array([n * m for n, m in costs.shapes], dtype=np.int64)
    usable = np.isfinite(t) & (after >= 0)
    bounds = np.unique(t[usable])
    # a slicing whose slowest stage takes t costs at least B * t: bounds that cannot beat
    # `beat` find nothing wanted, so they are not tried (not even by the bisection)
    bounds = bounds[microbatches * bounds < beat]
    if bounds.size == 0:
        return None
    best, path, count, tried = _search(t, after, sizes, int(devices), int(microbatches),
                                       int(stages), float(epsilon), bool(prune), bounds,
                                       float(beat))
    if count == 0:
        return None
    chosen = tuple((int(a), int(b), int(m)) for a, b, m in path[:count])
    return StageSolution(chosen, float(best), int(tried))


@njit(cache=True)
def _fill(t, after, sizes, devices, most_stages, t_max, total, slowest, end, mesh):
    """F for one bound: total[s, k, d] (least sum), slowest[s, k, d] (the max stage time of
    that slicing), and its first stage's last layer and sub-mesh."""
    layers, shapes = t.shape[0], t.shape[2]
    total[:] = np.inf
    slowest[:] = 0.0
    total[0, layers, 0] = 0.0
    for s in range(1, most_stages + 1):
        for k in range(layers - 1, -1, -1):
            for d in range(1, devices + 1):
                best = np.inf
                for i in range(k, layers - s + 1):  # leave a layer for each later stage
                    for m in range(shapes):
                        size = sizes[m]
                        cost = t[k, i, m]
                        if size > d or cost > t_max or after[k, i, m] < s - 1:
                            continue
                        rest = total[s - 1, i + 1, d - size]
                        if rest == np.inf:
                            continue
                        if cost + rest < best:
                            best = cost + rest
                            total[s, k, d] = best
                            slowest[s, k, d] = max(cost, slowest[s - 1, i + 1, d - size])
                            end[s, k, d] = i
                            mesh[s, k, d] = m


@njit(cache=True)
def _search(t, after, sizes, devices, microbatches, forced, epsilon, prune, bounds, beat):
    layers = t.shape[0]
    most = min(layers, devices) if forced <= 0 else forced
    total = np.empty((most + 1, layers + 1, devices + 1))
    slowest = np.empty((most + 1, layers + 1, devices + 1))
    end = np.zeros((most + 1, layers + 1, devices + 1), dtype=np.int64)
    mesh = np.zeros((most + 1, layers + 1, devices + 1), dtype=np.int64)
    path = np.zeros((max(most, 1), 3), dtype=np.int64)
    best, count, tried = beat, 0, 0
    low = 1 if forced <= 0 else forced
    first = 0
    if prune:  # skip the bounds no slicing meets: feasibility only grows with the bound
        first, high = 0, bounds.size - 1
        while first < high:
            middle = (first + high) // 2
            tried += 1
            _fill(t, after, sizes, devices, most, bounds[middle], total, slowest, end, mesh)
            if np.isfinite(total[low:, 0, devices]).any():
                high = middle
            else:
                first = middle + 1
    while first < bounds.size:
        # Bounds within epsilon of this one are solved once, at the largest of them.
        last = first
        while last + 1 < bounds.size and bounds[last + 1] - bounds[first] <= epsilon:
            last += 1
        if prune and microbatches * bounds[first] >= best:
            break
        tried += 1
        _fill(t, after, sizes, devices, most, bounds[last], total, slowest, end, mesh)
        for s in range(low, most + 1):
            if total[s, 0, devices] == np.inf:
                continue
            cost = total[s, 0, devices] + (microbatches - 1) * slowest[s, 0, devices]
            if cost < best:
                best, count = cost, s
                k, d = 0, devices
                for level in range(s, 0, -1):
                    i, m = end[level, k, d], mesh[level, k, d]
                    path[s - level, 0], path[s - level, 1], path[s - level, 2] = k, i, m
                    k, d = i + 1, d - sizes[m]
        first = last + 1
    return best, path, count, tried
