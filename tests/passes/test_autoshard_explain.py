"""Why this plan: per-node costs under a plan and counterfactual re-solves of the same ILP."""

import pytest

from graphpar.capture.optim import optimizer_from_name
from graphpar.cli.common import example_spec
from graphpar.compiler.driver import compile_model
from graphpar.cost.limits import PlanLimits
from graphpar.errors import ShardingError
from graphpar.passes.autoshard import AutoShard
from graphpar.passes.autoshard.explain import Explainer, explain, strategy_text
from graphpar.passes.autoshard.ilp import MEMORY_TIEBREAK, OBJECTIVE_UNIT


@pytest.fixture(scope="module")
def mlp_train():
    """mlp:tiny's training step (Adam) on 2 devices: repeated layers share ILP variables and
    the optimizer's elementwise ops follow their state."""
    spec = example_spec("mlp:tiny", train=True)
    graph = compile_model(spec, "train", "cleanup", optimizer=optimizer_from_name("adam")).graph
    reduced, plan = AutoShard(mesh="2", memory_limit="none").solve(graph)
    return reduced, plan


def test_node_costs_add_up_to_the_plan(mlp_train):
    reduced, plan = mlp_train
    ex = Explainer(reduced, plan, PlanLimits(None, 30.0))
    compute = sum(ex.compute.values())
    resharding = sum(ex.resharding.values())
    assert compute == pytest.approx(plan.compute_seconds, rel=1e-12)
    assert resharding == pytest.approx(plan.comm_seconds, rel=1e-12, abs=1e-15)
    assert plan.step_seconds == pytest.approx(plan.stats["objective_seconds"], rel=1e-12)
    rows = ex.costliest(len(reduced.problem.graph.nodes))
    # every node is in exactly one row (with its copies), rows costliest first
    covered = [n for r in rows for n in r.copies]
    assert sorted(map(id, covered)) == sorted(map(id, reduced.problem.graph.nodes))
    costs = [r.cost_seconds for r in rows]
    assert costs == sorted(costs, reverse=True)
    assert sum(costs) == pytest.approx(plan.step_seconds, rel=1e-12)
    assert any(len(r.copies) > 1 for r in rows) and any(r.follows for r in rows)


def test_forcing_a_choice_never_beats_the_optimum(mlp_train):
    """The ILP is exact: a re-solve with a node forced to another strategy costs at least the
    optimum (up to the memory tie-break), and the forced node and its copies take it."""
    reduced, plan = mlp_train
    assert plan.stats["status"] == "OPTIMAL"
    explanation = explain(reduced, plan, PlanLimits(None, 30.0), top=4, tries=2)
    assert len(explanation.rows) == 4
    solved = 0
    for row in explanation.rows:
        for forced in row.tried:
            assert forced.plan is not None, forced.why_not
            solved += 1
            extra_memory = max(0, forced.plan.memory_bytes - plan.memory_bytes)
            slack = extra_memory * MEMORY_TIEBREAK * OBJECTIVE_UNIT + 1e-15
            assert forced.delta_seconds >= -slack
            assert forced.delta_seconds == pytest.approx(
                forced.plan.step_seconds - plan.step_seconds)
            for node in row.copies:
                assert strategy_text(node, forced.plan.node_strategy[node]) == forced.strategy
            assert forced.strategy != row.strategy
            changed = {name for name, _, _ in forced.changed}
            assert row.name not in changed
    assert solved >= 4


def test_a_forced_strategy_that_fits_no_memory_says_so(mlp_train):
    reduced, plan = mlp_train
    ex = Explainer(reduced, plan, PlanLimits(memory_bytes=1, time_seconds=30.0))
    row = ex.explain_row(ex.costliest(1)[0], tries=1)
    (forced,) = row.tried
    assert forced.plan is None
    assert forced.why_not == "no plan with it fits the memory limit"


def test_nodes_and_strategies_are_found_by_name(mlp_train):
    reduced, plan = mlp_train
    ex = Explainer(reduced, plan, PlanLimits(None, 30.0))
    node = ex.node("layers.0:matmul")
    assert node.op == "matmul" and node.module == "layers.0"
    assert ex.node("%1") is node  # the value number the IR printer gives it
    with pytest.raises(ShardingError, match=r"--node layers.0:matmull: no such node .*closest: "
                                            r"layers.0:matmul"):
        ex.node("layers.0:matmull")
    assert strategy_text(node, ex.strategy(node, "({S(0)},{R})->{S(0)}")) == \
        "({S(0)}, {R}) -> {S(0)}"
    with pytest.raises(ShardingError, match=r"--strategy \{S\(7\)\}: is not one of the "
                                            r"strategies of node layers.0:matmul; they are: "
                                            r"\(\{R\}, \{R\}\) -> \{R\}; "):
        ex.strategy(node, "{S(7)}")


def test_nodes_of_one_ilp_variable_share_their_re_solves(mlp_train):
    """Optimizer ops that follow the same state are decided by one ILP variable: forcing any
    of them to the same layouts is the same restriction, solved once."""
    reduced, plan = mlp_train
    ex = Explainer(reduced, plan, PlanLimits(None, 30.0))
    rows = ex.costliest(len(reduced.problem.graph.nodes))
    by_class = {}
    for row in rows:
        by_class.setdefault(row.ilp_class, []).append(row)
    a, b = next(group[:2] for group in by_class.values()
                if len(group) > 1 and all(r.follows for r in group[:2]))
    (strategy, _), *_ = ex.alternatives(a.node)
    forced_a = ex.force(a.node, strategy)
    twin = next(s for s, _ in ex.alternatives(b.node)
                if s.outputs == strategy.outputs)
    forced_b = ex.force(b.node, twin)
    assert forced_a.plan is not None and forced_a.plan is forced_b.plan
    assert forced_a.plan.node_strategy[b.node].outputs == strategy.outputs
