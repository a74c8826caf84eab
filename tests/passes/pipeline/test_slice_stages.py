"""The slice-stages pass on captured training steps: its plan, its costs, its errors."""

import math
import os
import re

import numpy as np
import pytest

from graphpar.capture import Adam, capture_training
from graphpar.cost.cluster import get_cluster, mesh_for
from graphpar.cost.compute import Roofline
from graphpar.cost.limits import PlanLimits
from graphpar.errors import (
    MemoryLimitError,
    PassError,
    ShardingError,
    TimeLimitError,
    UsageError,
)
from graphpar.ir.graph import OutputRole, Role
from graphpar.models import example_batch, get_model
from graphpar.passes import PassContext, PassManager, parse_pipeline
from graphpar.passes.autoshard.ilp import Reduced, solve
from graphpar.passes.pipeline.clustering import (
    equal_ranges,
    regular_bounds,
    regular_clusterings,
)
from graphpar.passes.pipeline.partition import forward_backward_optimizer
from graphpar.passes.pipeline.plan import StagePlan
from graphpar.passes.pipeline.slice_stages import (
    FINER,
    LOCAL,
    UNBOUNDED,
    SliceStages,
    max_after,
    slice_stages,
)
from graphpar.passes.pipeline.solve_pool import map_in_order
from graphpar.passes.pipeline.stage_dp import pipeline_seconds, submesh_shapes


@pytest.fixture(scope="module")
def mlp_step():
    ex = get_model("mlp", "tiny", train=True, n_layers=4)
    return capture_training(ex.module, ex.inputs, ex.loss_fn, ex.targets,
                            optimizer=Adam(lr=1e-3), name="mlp").graph


def run_pass(graph, options: str) -> StagePlan:
    ctx = PassContext()
    PassManager(parse_pipeline(f"slice-stages{{{options}}}")).run(graph, ctx)
    return ctx.result(StagePlan)


def test_plan_puts_each_layer_forward_backward_and_update_on_one_stage(mlp_step):
    plan = run_pass(mlp_step, "mesh=1x4,microbatches=8,stages=2")
    assert len(plan.stages) == 2
    assert set(plan.stage_of) == set(mlp_step.nodes)
    assert sorted(d for s in plan.stages for d in s.devices) == [0, 1, 2, 3]
    assert sum(math.prod(s.submesh) for s in plan.stages) == 4
    assert all(math.prod(s.logical_mesh) == math.prod(s.submesh) for s in plan.stages)
    assert plan.est_step_seconds == pytest.approx(
        pipeline_seconds([s.est_seconds for s in plan.stages], 8), rel=1e-12)
    # layers in order, stages contiguous
    assert [s.layers[0] for s in plan.stages] == [0, plan.stages[0].layers[-1] + 1]
    forward, _, _ = forward_backward_optimizer(mlp_step)
    order = [plan.stage_of[n] for n in mlp_step.nodes if n in forward]
    assert order == sorted(order) and set(order) == {0, 1}
    # each parameter's update is computed where its gradient is, on the stage that uses it
    producer_stage = {o.target: plan.stage_of[o.value.producer] for o in mlp_step.outputs
                      if o.role is OutputRole.UPDATE and o.value.producer is not None}
    for param in mlp_step.inputs_with_role(Role.PARAM):
        users = {plan.stage_of[u] for u in param.users if u in forward}
        assert users == {producer_stage[param.name]}, param.name
    assert plan.stages[0].modules and all(m.startswith("layers.") for m in
                                          plan.stages[0].modules)
    assert plan.ilp_solves > 0 and plan.dp_seconds > 0


def test_one_device_one_microbatch_costs_what_the_whole_graph_ilp_costs(mlp_step):
    # On one device there is nothing to reshard or send: the layers' times add up exactly.
    search = slice_stages(mlp_step, "1x1", microbatches=1)
    _, whole = solve(mlp_step, mesh_for("1x1"), Roofline.of(get_cluster("dgx-a100"), "fp32"))
    assert len(search.plan.stages) == 1
    assert search.plan.est_step_seconds == pytest.approx(whole.step_seconds, rel=1e-9)


def test_more_stages_than_layers_is_a_clear_error(mlp_step):
    with pytest.raises(PassError, match=r"stages=9 is more than the 3 layers .*at most 3"):
        slice_stages(mlp_step, "1x16", stages=9, layers=3)
    with pytest.raises(UsageError, match="stages='two'"):
        parse_pipeline("slice-stages{stages=two}")


def test_a_memory_limit_no_pipeline_meets_says_what_the_best_needs(mlp_step):
    with pytest.raises(MemoryLimitError, match=r"fits 1.0 kB per device: the leanest one needs "
                       r"about [0-9.]+ kB per device on its fullest stage") as error:
        run_pass(mlp_step, "mesh=1x2,memory_limit=1kB")
    need = float(re.search(r"needs about ([0-9.]+) kB", str(error.value)).group(1)) * 1000
    plan = run_pass(mlp_step, f"mesh=1x2,memory_limit={int(need * 1.01)}")  # enough, it says
    assert max(s.mem_bytes for s in plan.stages) <= need * 1.01
    with pytest.raises(MemoryLimitError):
        run_pass(mlp_step, f"mesh=1x2,memory_limit={int(need * 0.97)}")  # and no less


def test_a_normal_run_counts_every_layer_solve_optimal(mlp_step):
    plan = slice_stages(mlp_step, "1x2").plan
    solves = plan.layer_solves
    assert solves.counted == solves.counts["optimal"] == plan.ilp_solves > 0
    assert solves.all_optimal and solves.examples == () and solves.no_plan_on == ()
    assert solves.warning() is None
    text = plan.describe()
    assert f"{plan.ilp_solves} ILP solves (counted): {plan.ilp_solves} optimal" in text
    assert "warning" not in text


def _forced_solves(monkeypatch, by_mesh):
    """Reduced.solve as `by_mesh[shape](solve, time_limit)` on the logical meshes of those
    shapes, where `solve(memory_limit)` is the real solve (by default with the memory limit it
    was given); returns the mesh shape of every solve, in order."""
    original, seen = Reduced.solve, []

    def solve(self, memory_limit=None, time_limit=30.0, *args, **kwargs):
        shape = tuple(self.problem.mesh.shape)
        seen.append(shape)

        def real(limit=memory_limit):
            return original(self, limit, time_limit, *args, **kwargs)

        return by_mesh[shape](real, time_limit) if shape in by_mesh else real()

    monkeypatch.setattr(Reduced, "solve", solve)
    return seen


def test_time_limit_hits_are_counted_and_reported(monkeypatch, mlp_step):
    # On 1x2 the layers are solved on logical meshes 1x1, 2x1 and 1x2. On 2x1 every solve
    # stops at its time limit with a plan not proven optimal (kept, used by the DP); on 1x2
    # before any plan (the mesh is left out).
    def not_proven(solve, time_limit):
        plan = solve()
        plan.stats.update(status="FEASIBLE", optimality_gap=0.25)
        return plan

    def no_plan(solve, time_limit):
        raise TimeLimitError(f"the sharding ILP found no plan (UNKNOWN) within the "
                             f"{time_limit:.3g} s it had")

    seen = _forced_solves(monkeypatch, {(2, 1): not_proven, (1, 2): no_plan})
    plan = slice_stages(mlp_step, "1x2", limits=PlanLimits.parse("device", 0.5)).plan
    solves = plan.layer_solves
    assert dict(solves.counts) == {
        "optimal": seen.count((1, 1)), "time_limit_not_proven_optimal": seen.count((2, 1)),
        "time_limit_no_plan": seen.count((1, 2)), "infeasible": 0, "failed": 0}
    assert solves.counted == plan.ilp_solves == len(seen)
    assert seen.count((2, 1)) > 0 and seen.count((1, 2)) > 0
    assert solves.no_plan_on == ("1x2",)
    assert all(s.logical_mesh != (1, 2) for s in plan.stages)
    # three examples of each outcome but optimal: where, and why
    assert [e.outcome for e in solves.examples] == (
        ["time_limit_not_proven_optimal"] * 3 + ["time_limit_no_plan"] * 3)
    late = solves.examples[-1]
    assert late.submesh == (1, 2) and late.logical_mesh == (1, 2) and late.layering == "eq6"
    assert late.modules and "within the 0.5 s it had" in late.message
    assert ("optimality gap 25.0% when the 0.5 s time limit ran out"
            in solves.examples[0].message)
    warning = solves.warning()
    assert warning == (
        f"stage search: {seen.count((2, 1))} hit the time limit with a plan not proven "
        f"optimal (kept), {seen.count((1, 2))} hit the time limit before any plan, of "
        f"{len(seen)} layer ILP solves (counted); logical mesh 1x2 left out of every layering "
        "with those layers")
    text = plan.describe()
    assert f"warning: {warning}" in text
    assert "on logical mesh 1x2 of sub-mesh 1x2: hit the time limit before any plan" in text


def test_infeasible_and_failed_solves_are_counted_and_reported(monkeypatch, mlp_step):
    # On 1x2: a memory limit of 1 byte on logical mesh 1x2 (each solve there is infeasible:
    # the ILP's own MemoryLimitError), and another ShardingError on 2x1. Sub-mesh 1x2 is left
    # with no option, so the plan runs on 1x1 sub-meshes.
    def tiny_memory(solve, time_limit):
        return solve(1)

    def fails(solve, time_limit):
        raise ShardingError("no allowed choice for %3")

    seen = _forced_solves(monkeypatch, {(1, 2): tiny_memory, (2, 1): fails})
    plan = slice_stages(mlp_step, "1x2").plan
    solves = plan.layer_solves
    assert dict(solves.counts) == {
        "optimal": seen.count((1, 1)), "time_limit_not_proven_optimal": 0,
        "time_limit_no_plan": 0, "infeasible": seen.count((1, 2)),
        "failed": seen.count((2, 1))}
    assert solves.counted == plan.ilp_solves == len(seen) and not solves.all_optimal
    assert seen.count((2, 1)) > 0 and seen.count((1, 2)) > 0
    assert all(s.submesh == (1, 1) for s in plan.stages)
    assert set(solves.no_plan_on) == {"2x1", "1x2"}
    infeasible = next(e for e in solves.examples if e.outcome == "infeasible")
    assert infeasible.logical_mesh == (1, 2) and "per device" in infeasible.message
    failed = next(e for e in solves.examples if e.outcome == "failed")
    assert failed.logical_mesh == (2, 1) and failed.message == "no allowed choice for %3"
    assert (f"{seen.count((1, 2))} infeasible (no plan fits the memory limit), "
            f"{seen.count((2, 1))} failed (no plan), of {len(seen)} layer ILP solves "
            "(counted)") in solves.warning()


def test_max_after_is_eq_5_with_the_1f1b_in_flight_count():
    # 10 GB of weights, 2 GB per microbatch stashed, 16 GB per device: 3 in flight fit, so two
    # stages may follow; with 2 microbatches at most 2 are ever in flight, so any number may.
    persistent, stashed = np.array([10.0, 10.0, 17.0, 3.0]), np.array([2.0, 2.0, 0.0, 0.0])
    assert max_after(persistent, stashed, 16.0, 8).tolist() == [2, 2, -1, UNBOUNDED]
    assert max_after(persistent[:1], stashed[:1], 16.0, 2).tolist() == [UNBOUNDED]
    assert max_after(np.array([15.0]), np.array([2.0]), 16.0, 8).tolist() == [-1]


def test_ilp_solves_do_not_grow_with_depth(gpt_step):
    # Identical layers share one solve per logical mesh: twice the blocks, the same solves.
    # One device: one logical mesh, so the solves are the kinds of layers (Eq. 6's, at most
    # 5, and the two pieces its middle layers are cut into by the finer candidate).
    shallow = slice_stages(gpt_step(6), "1x1", microbatches=2)
    deep = slice_stages(gpt_step(12), "1x1", microbatches=2)
    assert len(deep.forward_layers) == 2 * len(shallow.forward_layers) - 1
    assert deep.plan.ilp_solves == shallow.plan.ilp_solves <= 5 + 2


def test_repeated_sub_problems_are_solved_once(gpt_step):
    # A (layer structure, logical mesh) is solved once: a second search on the same graph
    # with the first one's cache (the same cluster, dtype, microbatches) solves nothing and
    # finds the same plan.
    graph = gpt_step(6)
    cache: dict = {}
    first = slice_stages(graph, "1x2", microbatches=4, cache=cache)
    again = slice_stages(graph, "1x2", microbatches=4, cache=cache)
    assert first.plan.ilp_solves == first.plan.layer_solves.counted > 0
    assert again.plan.ilp_solves == again.plan.layer_solves.counted == 0
    assert again.plan.est_step_seconds == first.plan.est_step_seconds
    assert [(s.layers, s.submesh, s.logical_mesh) for s in again.plan.stages] == [
        (s.layers, s.submesh, s.logical_mesh) for s in first.plan.stages]


def test_finer_layers_win_where_block_long_layers_balance_stages_poorly(gpt_step):
    # The tiny GPT with a heavy head on 1x2, B = 8: on Eq. 6's layers (one per block) the
    # stage ends fall on block boundaries and the head's stage is the slowest; with middle
    # layers cut once more (each, or those next to Eq. 6's stage ends) the DP ends a stage
    # inside a block. All are searched under the one cost model and the fastest is kept; the
    # solves stay the same whatever the depth.
    common = dict(microbatches=8, epsilon=0.0)
    solves = []
    for n_layers, wins in [(6, FINER), (12, LOCAL)]:
        graph = gpt_step(n_layers)
        forward_set = forward_backward_optimizer(graph)[0]
        forward = [n for n in graph.nodes if n in forward_set]
        eq6, finer = regular_clusterings(graph, forward, n_layers + 1, cuts=2)
        two = slice_stages(graph, "1x2", cache={}, **common)
        # at 12 blocks, cutting every block and cutting next to Eq. 6's stage ends find the
        # same stages (their estimates agree to the last bits): either may be kept
        assert two.clustering == wins or (wins == LOCAL and two.clustering == FINER)
        # the layers are Eq. 6's, some cut as in the finer clustering
        assert {a for a, _ in eq6} <= {a for a, _ in two.forward_layers} <= {a for a, _ in finer}
        if n_layers == 6:  # each clustering alone, priced the same way
            alone = {name: slice_stages(graph, "1x2", forward_layers=bounds, cache={},
                                        **common).plan.est_step_seconds
                     for name, bounds in [("eq6", eq6), ("chosen", two.forward_layers),
                                          ("equal operator",
                                           equal_ranges(len(forward), len(eq6)))]}
            assert two.plan.est_step_seconds == alone["chosen"]
            assert two.plan.est_step_seconds < alone["eq6"]
            assert two.plan.est_step_seconds < alone["equal operator"]
        solves.append(two.plan.ilp_solves)
    # twice the blocks, the same solves: Eq. 6's kinds of layers and the two pieces, each on
    # at most the 3 logical meshes of 1x2's sub-meshes (1x1; 2x1 and 1x2)
    assert solves[0] == solves[1] <= 3 * (5 + 2), solves



@pytest.fixture(scope="module")
def gpt_tiny_microbatch_8():
    ex = get_model("gpt", "tiny", device="meta", train=True)
    inputs, targets = example_batch("gpt", ex.config, 8)
    return capture_training(ex.module, inputs, ex.loss_fn, targets, optimizer=Adam(lr=1e-4),
                            name="gpt").graph


@pytest.mark.parametrize("mesh", ["1x2", pytest.param("1x4", marks=pytest.mark.slow)])
def test_the_two_level_plan_is_never_worse_than_equal_operator_or_equal_layer_slicing(
        gpt_tiny_microbatch_8, mesh):
    # gpt:tiny, microbatch 8, B = 8 (1x4 is the bench's quick row). Eq. 6 cuts after each
    # attention's residual add (64 kB received per layer), whose layers take 243, 355 and
    # 253 us forward + backward on one device; equal op counts cut inside the blocks (192 kB
    # received) at 287, 261 and 302 us, which balances the stages better; so do Eq. 6's
    # layers with the middle one cut once more. The search is offered these clusterings and
    # keeps the fastest plan under the one cost model.
    graph = gpt_tiny_microbatch_8
    devices = int(mesh.split("x")[1])
    common = dict(microbatches=8, epsilon=0.0, cache={})
    two = slice_stages(graph, mesh, **common)
    forward, _, _ = forward_backward_optimizer(graph)
    eq6 = regular_bounds(graph, [n for n in graph.nodes if n in forward], 3)
    assert len(eq6) == 3
    ops = sum(1 for n in graph.nodes if n in forward)
    equal_op = slice_stages(graph, mesh, forward_layers=equal_ranges(ops, 3), **common)
    assert two.plan.est_step_seconds <= equal_op.plan.est_step_seconds
    assert two.clustering == FINER  # what wins here (equal operator did before FINER)
    # equal layers: S stages of Eq. 6's layers on S equal (1, devices / S) sub-meshes
    shapes = submesh_shapes(1, devices)
    equal_layer = [slice_stages(graph, mesh, fixed=[(a, b, shapes.index((1, devices // n)))
                                                    for a, b in equal_ranges(3, n)],
                                **common).plan.est_step_seconds
                   for n in range(1, 4) if devices % n == 0]
    assert len(equal_layer) == 2 and two.plan.est_step_seconds <= min(equal_layer)
    eq6_only = slice_stages(graph, mesh, forward_layers=eq6, **common)
    assert two.plan.est_step_seconds < eq6_only.plan.est_step_seconds  # the search did gain


def test_the_plan_is_the_same_on_one_worker_and_on_two(gpt_step):
    # The layer ILPs of a candidate clustering are solved side by side in forked workers;
    # each solve depends only on its own problem and results are taken in the order asked,
    # so the search finds the same plan, table and solve counts on any number of workers.
    graph = gpt_step(6)
    one, two = (slice_stages(graph, "1x2", microbatches=4, cache={}, workers=w)
                for w in (1, 2))
    assert two.plan.stages == one.plan.stages
    assert two.plan.est_step_seconds == one.plan.est_step_seconds
    assert two.plan.ilp_solves == one.plan.ilp_solves > 0
    assert two.plan.layer_solves == one.plan.layer_solves
    assert np.array_equal(two.costs.seconds, one.costs.seconds)
    assert (two.clustering, two.forward_layers) == (one.clustering, one.forward_layers)


def test_solves_run_in_forked_workers_and_come_back_in_order():
    parent = os.getpid()
    pids = map_in_order(lambda i: (i, os.getpid()), 6, 2)
    assert [i for i, _ in pids] == list(range(6))
    assert parent not in {pid for _, pid in pids}
    assert map_in_order(lambda i: os.getpid(), 3, 1) == [parent] * 3
    with pytest.raises(PassError, match="workers=-1"):
        SliceStages(workers=-1)


def test_the_solve_pool_ends_its_workers_quietly_under_the_clis_sigterm_handler():
    """The CLI raises on SIGTERM to clean up (`cli.main._on_sigterm`); forked solve workers
    inherit that handler, and the pool ends them with SIGTERM, which printed a traceback per
    worker. A worker takes SIGTERM's default (it just ends) and leaves Ctrl-C to the parent."""
    import signal

    from graphpar.cli.main import _on_sigterm

    def handlers(i: int) -> tuple:
        return (i, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
                signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        assert map_in_order(handlers, 4, 2) == [(i, True, True) for i in range(4)]
        assert signal.getsignal(signal.SIGTERM) is _on_sigterm  # the parent's is kept
    finally:
        signal.signal(signal.SIGTERM, previous)
