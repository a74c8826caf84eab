"""Elimination before (or instead of) the sharding ILP: exact on small problems checked by
brute force, and the same objective as the whole ILP on the bundled models' training steps."""

import itertools

import numpy as np
import pytest

from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.models import example_batch, get_model
from graphpar.passes.autoshard import ilp as ilp_module
from graphpar.passes.autoshard.chains import eliminate, solve_exactly
from graphpar.passes.autoshard.ilp import Problem, Reduced, _solve_instance

CLUSTER = get_cluster("dgx-a100")
ROOF = Roofline.of(CLUSTER, "fp32")


def _cost(unary, edges, picks):
    return (sum(float(unary[c][p]) for c, p in picks.items())
            + sum(float(m[picks[a], picks[b]]) for (a, b), m in edges.items()))


def _least(unary, edges, variables):
    """The minimum over `variables` (a whole connected part) by trying every combination."""
    sizes = [len(unary[c]) for c in variables]
    edges = {(a, b): m for (a, b), m in edges.items() if a in variables}
    unary = {c: unary[c] for c in variables}
    return min(_cost(unary, edges, dict(zip(variables, combo)))
               for combo in itertools.product(*map(range, sizes)))


# a chain, a triangle hanging off it, a star, a 4-cycle with a chord and a variable with no
# edge: integer costs, so ties are many
GRAPH = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (4, 6), (5, 6), (2, 7), (7, 8), (7, 9),
         (10, 11), (11, 12), (12, 13), (10, 13), (10, 12)]


@pytest.mark.parametrize("seed", range(3))
def test_eliminating_chains_keeps_the_optimum(seed):
    rng = np.random.default_rng(seed)
    variables = list(range(15))
    unary = {c: rng.integers(0, 20, size=int(rng.integers(2, 4))).astype(float)
             for c in variables}
    edges = {(a, b): rng.integers(0, 20, size=(len(unary[a]), len(unary[b]))).astype(float)
             for a, b in GRAPH}
    least = _least(unary, edges, variables[:10]) + _least(unary, edges, variables[10:14]) \
        + float(unary[14].min())
    chains = eliminate(variables, unary, edges)
    # every variable goes: removing one leaves its neighbours fewer edges (the chorded
    # cycle's chord ends have three, then one after its corners are removed)
    assert chains.kept == []
    picks = chains.picks([], len(variables))
    assert _cost(unary, edges, dict(enumerate(picks))) == least


def test_variables_with_three_edges_stay_and_the_rest_extends_their_choices():
    rng = np.random.default_rng(7)
    # K4 (every variable has three edges) plus a tail of two on variable 0
    graph = [(a, b) for a, b in itertools.combinations(range(4), 2)] + [(0, 4), (4, 5)]
    unary = {c: rng.random(3) for c in range(6)}
    edges = {(a, b): rng.random((3, 3)) for a, b in graph}
    chains = eliminate(list(range(6)), unary, edges)
    assert chains.kept == [0, 1, 2, 3]
    assert set(chains.edges) == {(a, b) for a, b in itertools.combinations(range(4), 2)}
    best = min(itertools.product(range(3), repeat=4),
               key=lambda p: _cost(dict(enumerate(chains.unary)), chains.edges,
                                   dict(enumerate(p))))
    picks = chains.picks(list(best), 6)
    assert _cost(unary, edges, dict(enumerate(picks))) == pytest.approx(
        _least(unary, edges, list(range(6))), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_eliminating_every_variable_finds_the_optimum_of_a_dense_problem(seed):
    # 7 variables, every pair joined with probability 0.6: tables over up to 6 neighbours
    rng = np.random.default_rng(seed)
    variables = list(range(7))
    unary = {c: rng.integers(0, 9, size=int(rng.integers(2, 4))).astype(float)
             for c in variables}
    edges = {(a, b): rng.integers(0, 9, size=(len(unary[a]), len(unary[b]))).astype(float)
             for a, b in itertools.combinations(variables, 2) if rng.random() < 0.6}
    picks = solve_exactly(variables, unary, edges, 7)
    assert _cost(unary, edges, dict(enumerate(picks))) == _least(unary, edges, variables)


def test_elimination_declines_before_making_a_table_too_large():
    # K5 with 4 choices each: the first variable removed touches 4 others, 4^5 entries
    unary = {c: np.arange(4.0) for c in range(5)}
    edges = {(a, b): np.ones((4, 4)) for a, b in itertools.combinations(range(5), 2)}
    assert solve_exactly(list(range(5)), unary, edges, 5, most_entries=4**5 - 1) is None
    assert solve_exactly(list(range(5)), unary, edges, 5, most_entries=4**5) == [0] * 5


def _training_step(name: str):
    ex = get_model(name, "tiny", device="meta", train=True)
    inputs, targets = example_batch(name, ex.config, 2)
    return capture_training(ex.module, inputs, ex.loss_fn, targets, Adam()).graph


@pytest.mark.parametrize("name, mesh", [
    ("gpt", "2x2"), pytest.param("llama", "2x2", marks=pytest.mark.slow),
    pytest.param("moe", "2x2", marks=pytest.mark.slow)])
def test_the_objective_is_the_whole_ilps_on_the_bundled_models(name, mesh):
    # Without a memory limit (how slice-stages prices each layer) the solver sees fewer
    # classes and finds the same objective as the whole reduced ILP.
    reduced = Reduced(Problem(_training_step(name), mesh_for(mesh, CLUSTER), ROOF))
    inst = reduced.instance()
    whole, none_removed = _solve_instance(inst, None, 30.0, "highs", simplify=False)
    chained, removed = _solve_instance(inst, None, 30.0, "highs")
    assert whole.status == chained.status == "OPTIMAL"
    assert none_removed == 0 and removed > 0
    assert chained.variables < whole.variables
    assert inst.cost(chained.picks) == pytest.approx(inst.cost(whole.picks), rel=1e-12)
    # and with elimination alone stopped at two edges, before the MIP
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ilp_module, "solve_exactly", lambda *args: None)
        before_mip, removed_before = _solve_instance(inst, None, 30.0, "highs")
    assert 0 < removed_before <= removed and before_mip.variables > 0
    assert inst.cost(before_mip.picks) == pytest.approx(inst.cost(whole.picks), rel=1e-12)
    # and through `solve`: the plan, costed on the full graph, is what the ILP minimised
    plan = reduced.solve()
    assert plan.stats["eliminated_classes"] == removed
    assert plan.step_seconds == pytest.approx(inst.cost(whole.picks), rel=1e-9)
