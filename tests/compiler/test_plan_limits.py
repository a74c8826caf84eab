"""The user's plan limits (`memory_limit`, `time_limit`) reach every ILP a compile solves."""

import graphpar
from graphpar.capture import Adam
from graphpar.cost.limits import PlanLimits
from graphpar.models import get_model


def test_the_users_limits_reach_every_stage_ilp_of_a_pipelined_compile(ilp_limits):
    # One stage on both devices, sharded on its logical mesh as planned: each of its phases
    # is re-solved under the limits given, "none" included (no memory limit, not the
    # device's memory).
    ex = get_model("mlp", "tiny", train=True)
    pipe = graphpar.compile(ex.module, ex.inputs, mesh="2", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu",
                            memory_limit="none", time_limit=9, pipeline=1, microbatches=2)
    assert pipe.limits == PlanLimits(None, 9.0)
    (stage,) = pipe.plan.stages
    assert set(pipe.sharded) == {0}
    assert ilp_limits["layers"] and set(ilp_limits["layers"]) == {(None, 9.0)}
    assert len(ilp_limits["plans"]) == len(pipe.sharded[0]) >= 3
    assert set(ilp_limits["plans"]) == {(tuple(stage.logical_mesh), PlanLimits(None, 9.0))}


def test_the_users_limits_reach_the_ilp_of_a_compile(ilp_limits):
    ex = get_model("mlp", "tiny", train=True)
    graphpar.compile(ex.module, ex.inputs, mesh="2", mode="train", loss_fn=ex.loss_fn,
                     targets=ex.targets, optimizer=Adam(), cluster="cpu",
                     memory_limit="3GB", time_limit=9)
    assert ilp_limits["plans"] == [((2,), PlanLimits(3e9, 9.0))]
    assert ilp_limits["layers"] == []
