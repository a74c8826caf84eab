"""The `ddp` hand plan: data parallelism as DistributedDataParallel runs it, compiled for a
training step through `compile_training(..., plan="ddp")`."""

from collections import Counter

import pytest

from graphpar.capture.optim import optimizer_from_name
from graphpar.cli.common import example_spec
from graphpar.compiler.api import compile_training
from graphpar.cost.cluster import mesh_for
from graphpar.cost.limits import PlanLimits
from graphpar.errors import UsageError
from graphpar.ir.graph import Role
from graphpar.ir.spmd_ops import GROUP_OPS
from graphpar.passes import parse_pipeline
from graphpar.passes.autoshard.hand_plans import HAND_PLANS, NotApplicable


@pytest.fixture(scope="module")
def gpt_tiny_ddp():
    spec = example_spec("gpt:tiny", train=True)
    mesh = mesh_for("2", "cpu")
    return compile_training(spec, mesh, PlanLimits(None, 60.0),
                            optimizer_from_name("adam", 1e-3), plan="ddp")


def test_ddp_replicates_state_slices_inputs_and_all_reduces_only_gradients(gpt_tiny_ddp):
    compiled = gpt_tiny_ddp
    graph, plan = compiled.graph, compiled.plan
    assert "ddp" in HAND_PLANS and plan.name == "ddp"
    layouts = Counter((v.role, str(plan.layout_of(v))) for v in graph.inputs)
    params = list(graph.inputs_with_role(Role.PARAM))
    state = list(graph.inputs_with_role(Role.OPTIM_STATE))
    batch = list(graph.inputs_with_role(Role.INPUT))
    assert [v.name for v in batch] == ["idx", "target"]
    assert layouts == {(Role.PARAM, "{R}"): len(params), (Role.OPTIM_STATE, "{R}"): len(state),
                       (Role.INPUT, "{S(0)}"): len(batch)}
    collectives = [n for n in compiled.spmd.nodes if n.op in GROUP_OPS]
    assert {n.op for n in collectives} == {"all_reduce"}
    # every gradient once (its elements: one parameter's), and the loss's two scalars (the
    # sum over this rank's tokens and their count); nothing else crosses ranks
    reduced = sorted(n.outputs[0].type.numel for n in collectives if n.outputs[0].type.rank)
    assert reduced == sorted(v.type.numel for v in params)
    assert len(collectives) == len(params) + 2


def test_auto_shard_takes_a_hand_plan_by_name():
    (shard,) = parse_pipeline("auto-shard{mesh=2,cluster=cpu,plan=ddp}")
    assert shard.plan == "ddp"
    with pytest.raises(UsageError, match="pass 'auto-shard': unknown plan 'dpp'; choose auto "
                                         "or a hand plan: data, ddp, zero"):
        parse_pipeline("auto-shard{mesh=2,plan=dpp}")


def test_a_hand_plan_that_does_not_apply_says_why():
    spec = example_spec("gpt:tiny", train=True)
    with pytest.raises(NotApplicable, match="mesh 1 has one device"):
        compile_training(spec, mesh_for("1", "cpu"), PlanLimits(None, 60.0),
                         optimizer_from_name("sgd", 1e-3), plan="ddp")
