"""The stage DP against brute force over every slicing and sub-mesh assignment; Theorem 1."""

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar.errors import ShardingError
from graphpar.passes.pipeline.stage_dp import (
    StageCosts,
    pipeline_seconds,
    place_submeshes,
    solve_stages,
    submesh_shapes,
)


def brute_force(costs: StageCosts, devices: int, microbatches: int, stages: int = 0):
    """The least Eq. 2 cost over every contiguous slicing and every sub-mesh per stage whose
    devices add up to `devices`, each stage within memory given the stages after it."""
    layers = costs.layers
    sizes = [n * m for n, m in costs.shapes]
    best = math.inf
    for cuts in itertools.product([False, True], repeat=layers - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [layers]
        ranges = list(zip(bounds, bounds[1:]))
        if stages and len(ranges) != stages:
            continue
        for meshes in itertools.product(range(len(sizes)), repeat=len(ranges)):
            if sum(sizes[m] for m in meshes) != devices:
                continue
            times = []
            for s, ((a, b), m) in enumerate(zip(ranges, meshes)):
                if costs.max_after[a, b - 1, m] < len(ranges) - 1 - s:
                    break
                times.append(costs.seconds[a, b - 1, m])
            else:
                if all(np.isfinite(times)):
                    best = min(best, pipeline_seconds(times, microbatches))
    return best


def random_costs(rng: random.Random, layers: int, shapes) -> StageCosts:
    """Stage times roughly additive in layers and falling with devices, with noise, some
    infeasible entries and memory bounds."""
    per_layer = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    t = np.full((layers, layers, len(shapes)), np.inf)
    after = np.full((layers, layers, len(shapes)), -1, dtype=np.int64)
    for i in range(layers):
        for j in range(i, layers):
            for m, (n, w) in enumerate(shapes):
                size = n * w
                if rng.random() < 0.1:
                    continue  # e.g. no logical mesh of this sub-mesh divides the layer
                work = sum(per_layer[i:j + 1])
                t[i, j, m] = work / size ** rng.uniform(0.6, 1.0) + rng.uniform(0, 0.3)
                after[i, j, m] = rng.choice([-1, 0, 1, 2, 3, 8, 8, 8])
    return StageCosts(t, after, tuple(shapes))


CLUSTERS = [(1, 1), (1, 2), (1, 4), (2, 2), (1, 8), (2, 4)]


def test_dp_equals_brute_force_on_random_tables():
    rng = random.Random(0)
    for case in range(300):
        hosts, per_host = CLUSTERS[case % len(CLUSTERS)]
        layers = rng.randint(1, 6)
        costs = random_costs(rng, layers, submesh_shapes(hosts, per_host))
        microbatches = rng.choice([1, 2, 4, 8])
        stages = rng.choice([0, 0, 0, 1, 2, 3])
        want = brute_force(costs, hosts * per_host, microbatches, stages)
        for prune in (True, False):
            got = solve_stages(costs, hosts * per_host, microbatches, stages, prune=prune)
            if math.isinf(want):
                assert got is None, (case, prune)
                continue
            assert got is not None and got.seconds == pytest.approx(want, rel=1e-12), (case, prune)
            times = [costs.seconds[a, b, m] for a, b, m in got.stages]
            assert pipeline_seconds(times, microbatches) == pytest.approx(got.seconds, rel=1e-12)
            assert [a for a, _, _ in got.stages][0] == 0 and got.stages[-1][1] == layers - 1
            assert all(b + 1 == a for (_, b, _), (a, _, _) in zip(got.stages, got.stages[1:]))
            assert sum(math.prod(costs.shapes[m]) for _, _, m in got.stages) == hosts * per_host
            if stages:
                assert len(got.stages) == stages


def test_epsilon_stays_within_its_bound_and_pruning_saves_bounds():
    rng = random.Random(1)
    saved = 0
    for case in range(100):
        hosts, per_host = CLUSTERS[case % len(CLUSTERS)]
        costs = random_costs(rng, rng.randint(2, 6), submesh_shapes(hosts, per_host))
        microbatches = rng.choice([2, 4, 8])
        want = brute_force(costs, hosts * per_host, microbatches)
        if math.isinf(want):
            continue
        epsilon = 0.05
        near = solve_stages(costs, hosts * per_host, microbatches, epsilon=epsilon)
        assert want - 1e-12 <= near.seconds <= want + (microbatches - 1) * epsilon + 1e-12
        full = solve_stages(costs, hosts * per_host, microbatches, prune=False)
        pruned = solve_stages(costs, hosts * per_host, microbatches)
        assert pruned.bounds_tried <= full.bounds_tried
        saved += full.bounds_tried - pruned.bounds_tried
    assert saved > 0  # the early stop does cut the enumeration


def test_a_plan_in_hand_gives_the_same_answer_below_it_and_none_at_or_above_it():
    # `beat` (another clustering's step): the DP answers exactly as without it when it finds
    # something strictly cheaper, None otherwise (where the early stop, starting from `beat`,
    # saves the most: the candidate that loses is not searched to its end).
    rng = random.Random(2)
    checked = 0
    for case in range(120):
        hosts, per_host = CLUSTERS[case % len(CLUSTERS)]
        costs = random_costs(rng, rng.randint(2, 6), submesh_shapes(hosts, per_host))
        microbatches = rng.choice([2, 4, 8])
        free = solve_stages(costs, hosts * per_host, microbatches)
        if free is None:
            assert solve_stages(costs, hosts * per_host, microbatches, beat=1e9) is None
            continue
        for beat in (free.seconds * 1.2, free.seconds, free.seconds * 0.9):
            got = solve_stages(costs, hosts * per_host, microbatches, beat=beat)
            if free.seconds < beat:
                assert got is not None and got.stages == free.stages
                assert got.seconds == free.seconds and got.bounds_tried <= free.bounds_tried
                checked += 1
            else:
                assert got is None, (case, beat)
    assert checked > 50


def test_homogeneous_layers_get_equal_layers_per_stage():
    # Identical GPT-like layers: a stage's time is linear in its layers, and intra-op
    # parallelism loses 10% per doubling of devices. Alpa §8.3: the DP cuts equal stages.
    shapes = submesh_shapes(1, 4)
    layers = 8
    t = np.zeros((layers, layers, len(shapes)))
    for i in range(layers):
        for j in range(i, layers):
            for m, (n, w) in enumerate(shapes):
                t[i, j, m] = (j - i + 1) * 1.0 / (n * w) * 1.1 ** math.log2(n * w)
    costs = StageCosts(t, np.full(t.shape, 8, dtype=np.int64), shapes)
    for microbatches in (1, 4, 16, 64):
        got = solve_stages(costs, 4, microbatches)
        assert len({b - a + 1 for a, b, _ in got.stages}) == 1, got.stages
        assert len({m for _, _, m in got.stages}) == 1, got.stages
        assert got.seconds == pytest.approx(brute_force(costs, 4, microbatches), rel=1e-12)
    assert len(solve_stages(costs, 4, 1).stages) == 1  # no pipelining for one microbatch
    assert len(solve_stages(costs, 4, 64).stages) == 4  # a deep pipeline for many


def test_memory_bound_rules_out_deep_pipelines():
    shapes = submesh_shapes(1, 2)
    t = np.ones((2, 2, len(shapes)))
    after = np.zeros(t.shape, dtype=np.int64)  # a stage fits only as the last one
    got = solve_stages(StageCosts(t, after, shapes), 2, 4)
    assert len(got.stages) == 1
    assert solve_stages(StageCosts(t, after, shapes), 2, 4, stages=2) is None


def test_submesh_shapes_follow_alpa():
    assert submesh_shapes(1, 8) == ((1, 1), (1, 2), (1, 4), (1, 8))
    assert submesh_shapes(4, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8))
    assert submesh_shapes(8, 8, power_of_two_hosts=True)[4:] == ((2, 8), (4, 8), (8, 8))
    with pytest.raises(ShardingError, match="power-of-two"):
        submesh_shapes(2, 6)


@st.composite
def tilings(draw):
    hosts = draw(st.integers(1, 4))
    per_host = 1 << draw(st.integers(0, 3))
    shapes = submesh_shapes(hosts, per_host)
    left, chosen = hosts * per_host, []
    while left:
        fits = [s for s in shapes if s[0] * s[1] <= left]
        shape = draw(st.sampled_from(fits))
        chosen.append(shape)
        left -= shape[0] * shape[1]
    return hosts, per_host, draw(st.permutations(chosen))


@settings(max_examples=200, deadline=None)
@given(tilings())
def test_theorem_1_allowed_shapes_adding_up_always_tile_the_mesh(case):
    hosts, per_host, shapes = case
    placed = place_submeshes(shapes, hosts, per_host)
    devices = [d for p in placed for d in p]
    assert sorted(devices) == list(range(hosts * per_host))  # disjoint and covering
    for (n, m), ids in zip(shapes, placed):
        assert len(ids) == n * m
        rows = sorted({d // per_host for d in ids})
        assert rows == list(range(rows[0], rows[0] + n))  # whole consecutive hosts, or one host
        assert ids == tuple(range(ids[0], ids[0] + n * m)) and ids[0] % m == 0  # aligned block
