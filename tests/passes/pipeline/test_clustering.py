"""Operator clustering (Eq. 6) against brute force; the structural layer signature."""

import itertools
import random

import numpy as np
import pytest
import torch

from graphpar.errors import ShardingError
from graphpar.ir.graph import Graph, Role
from graphpar.ir.structure import layer_signature
from graphpar.ir.types import TensorType
from graphpar.passes.pipeline.clustering import (
    Chain,
    cluster_bounds,
    default_layer_count,
    forward_chain,
    received_bytes,
    regular_bounds,
    regular_clusterings,
)
from graphpar.passes.pipeline.partition import forward_backward_optimizer


def random_chain(rng: random.Random, ops: int) -> Chain:
    """A random DAG in topological order: each value is read by 1-3 later ops."""
    producer, starts, readers, nbytes = [], [0], [], []
    for k in range(ops - 1):
        later = list(range(k + 1, ops))
        users = sorted(rng.sample(later, min(len(later), rng.randint(1, 3))))
        producer.append(k)
        readers += users
        starts.append(len(readers))
        nbytes.append(float(rng.choice([1, 2, 4, 8, 16])))
    flops = np.array([rng.choice([0, 1, 5, 10, 20]) for _ in range(ops)], dtype=np.int64)
    return Chain(flops, np.array(producer, dtype=np.int64), np.array(starts, dtype=np.int64),
                 np.array(readers, dtype=np.int64), np.array(nbytes))


def brute_force(chain: Chain, layers: int, bound: float):
    """(least max received, least sum of squared FLOPs among those) over every clustering."""
    return brute_force_from(chain, layers, bound, list(range(chain.flops.size)))


def score(chain: Chain, bounds):
    work = [int(chain.flops[a:b + 1].sum()) for a, b in bounds]
    return max(received_bytes(chain, a, b) for a, b in bounds), sum(w * w for w in work), work


def test_clustering_equals_brute_force_on_small_chains():
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        ops = rng.randint(2, 9)
        chain = random_chain(rng, ops)
        layers = rng.randint(1, ops)
        delta = rng.choice([0.0, 0.3, 0.6, 2.0])
        bound = max((1 + delta) * chain.flops.sum() / layers, chain.flops.max())
        want = brute_force(chain, layers, bound)
        if want is None:  # the bound is relaxed: not comparable with this brute force
            continue
        got = cluster_bounds(chain, layers, delta)
        assert got[0][0] == 0 and got[-1][1] == ops - 1 and len(got) == layers
        assert all(b + 1 == a for (_, b), (a, _) in zip(got, got[1:]))
        worst, squares, work = score(chain, got)
        assert max(work) <= bound
        assert (worst, squares) == want
        checked += 1
    assert checked > 100


def test_clustering_rejects_more_layers_than_ops():
    chain = random_chain(random.Random(1), 3)
    with pytest.raises(ShardingError, match="cannot cluster 3 forward ops into 4 layers"):
        cluster_bounds(chain, 4)


def _mlp_chain(depth: int) -> Graph:
    g = Graph("mlp")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    for i in range(depth):
        w = g.add_input(f"layers.{i}.weight", TensorType((8, 8), torch.float32), Role.PARAM)
        h = g.create("matmul", [x, w], module=f"layers.{i}").output
        x = g.create("relu", [h], module=f"layers.{i}").output
    g.add_output(x)
    return g


def test_identical_layers_cluster_alike_and_share_a_signature():
    g = _mlp_chain(4)
    forward = list(g.nodes)
    assert default_layer_count(forward) == 5  # 4 blocks, plus one
    chain = forward_chain(forward)
    assert chain.flops.tolist() == [2 * 4 * 8 * 8, 4 * 8] * 4
    bounds = cluster_bounds(chain, 4)
    assert bounds == [(0, 1), (2, 3), (4, 5), (6, 7)]  # each receives one 4x8 fp32 = 128 B
    assert max(received_bytes(chain, a, b) for a, b in bounds) == 128
    signatures = {layer_signature(forward[a:b + 1]) for a, b in bounds}
    assert len(signatures) == 1
    assert layer_signature(forward[0:1]) != layer_signature(forward[1:2])


def brute_force_from(chain: Chain, layers: int, bound: float, starts: list[int]):
    """(least max received, least sum of squared FLOPs among those) over the clusterings whose
    layers begin only at `starts` (starts[0] is op 0)."""
    ops = chain.flops.size
    best = None
    for cuts in itertools.combinations(starts[1:], layers - 1):
        edges = [0, *cuts, ops]
        spans = list(zip(edges, edges[1:]))
        work = [int(chain.flops[a:b].sum()) for a, b in spans]
        if max(work) > bound:
            continue
        key = (max(received_bytes(chain, a, b - 1) for a, b in spans), sum(w * w for w in work))
        best = key if best is None else min(best, key)
    return best


def test_clustering_with_allowed_starts_equals_brute_force():
    rng = random.Random(2)
    checked = 0
    for _ in range(150):
        ops = rng.randint(3, 10)
        chain = random_chain(rng, ops)
        starts = [0, *sorted(rng.sample(range(1, ops), rng.randint(1, ops - 1)))]
        layers = rng.randint(1, len(starts))
        delta = rng.choice([0.0, 0.3, 0.6, 2.0])
        bound = max((1 + delta) * chain.flops.sum() / layers, chain.flops.max())
        want = brute_force_from(chain, layers, bound, starts)
        if want is None:
            continue
        got = cluster_bounds(chain, layers, delta, starts=starts)
        assert [a for a, _ in got] == sorted(set(a for a, _ in got)) and got[-1][1] == ops - 1
        assert {a for a, _ in got} <= set(starts)
        worst, squares, work = score(chain, got)
        assert max(work) <= bound
        assert (worst, squares) == want
        checked += 1
    assert checked > 100
    with pytest.raises(ShardingError, match="begin at 2 allowed ops: give at most that many"):
        cluster_bounds(random_chain(rng, 6), 3, starts=[0, 3])


@pytest.mark.parametrize("n_layers", [6, 12])
def test_gpt_blocks_cluster_into_one_kind_of_middle_layer(gpt_step, n_layers):
    graph = gpt_step(n_layers)
    forward_set, _, _ = forward_backward_optimizer(graph)
    forward = [n for n in graph.nodes if n in forward_set]
    count = default_layer_count(forward)
    assert count == n_layers + 1
    bounds = regular_bounds(graph, forward, count)
    assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == len(forward) - 1
    kinds = [layer_signature(forward[a:b + 1]) for a, b in bounds]
    middle = [k for k in kinds if kinds.count(k) > 1]
    assert len(set(middle)) == 1 and len(middle) >= n_layers - 3, kinds
    # the cuts sit at one offset into every block they fall in
    block = [".".join(n.module.split(".")[:2]) if (n.module or "").startswith("blocks.")
             else None for n in forward]
    first_op = {}
    for k, b in enumerate(block):
        first_op.setdefault(b, k)
    offsets = {a - first_op[block[a]] for a, _ in bounds[1:] if block[a] is not None}
    assert len(offsets) == 1, offsets
    # plain Eq. 6 (any op may start a layer) makes more kinds: what the offsets fix
    plain = cluster_bounds(forward_chain(forward), count)
    assert len({layer_signature(forward[a:b + 1]) for a, b in plain}) > len(set(kinds))


def test_the_finer_regular_clustering_cuts_every_middle_layer_once_more_alike(gpt_step):
    graph = gpt_step(6)
    forward_set, _, _ = forward_backward_optimizer(graph)
    forward = [n for n in graph.nodes if n in forward_set]
    eq6, finer = regular_clusterings(graph, forward, default_layer_count(forward), cuts=2)
    assert eq6 == regular_bounds(graph, forward, default_layer_count(forward))
    # a refinement: every layer of Eq. 6's clustering is one or two layers of the finer one
    starts = {a for a, _ in finer}
    assert {a for a, _ in eq6} <= starts and finer[-1][1] == eq6[-1][1]
    pieces = [[(x, y) for x, y in finer if a <= x <= b] for a, b in eq6]
    cut = [p for p in pieces if len(p) == 2]
    assert all(len(p) <= 2 for p in pieces) and len(cut) >= 6 - 3
    # at the same offset in each, so the pieces come in two kinds whatever the depth
    assert len({p[1][0] - p[0][0] for p in cut}) == 1
    kinds = {layer_signature(forward[a:b + 1]) for a, b in eq6}
    new = {layer_signature(forward[a:b + 1]) for a, b in finer} - kinds
    assert len(new) == 2, new
