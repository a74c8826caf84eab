"""The backbone check of sharding: any valid plan, lowered to device programs and run on CPU
ranks, computes what eager PyTorch computes, and moves exactly the bytes the plan predicts."""

import copy
import random
import zlib

import pytest
import torch

import graphpar
from graphpar.capture import SGD, Adam, capture_inference, capture_training
from graphpar.compiler.api import lower
from graphpar.compiler.driver import ModelSpec
from graphpar.cost.cluster import mesh_for
from graphpar.ir.graph import OutputRole
from graphpar.ir.verify import verify
from graphpar.models import MODEL_NAMES, get_model
from graphpar.passes import PassContext, run_pipeline
from graphpar.passes.autoshard.apply import shard_graph
from graphpar.passes.autoshard.auto_shard import ShardingPlans
from graphpar.passes.autoshard.ilp import Plan
from graphpar.passes.autoshard.strategies import input_layouts, node_strategies

MESHES = ["2", "4", "2x2", "2x4", "2x2x2"]


def random_plan(graph, mesh, seed: int) -> Plan:
    """Every node and input takes a random valid strategy: exercises every sharding rule,
    resharding path and collective the lowering can produce."""
    rng = random.Random(seed)
    plan = Plan(mesh, {}, {})
    for v in graph.inputs:
        plan.input_layout[v] = rng.choice(input_layouts(v, mesh))
    for node in graph.nodes:
        plan.node_strategy[node] = rng.choice(node_strategies(node, mesh, 1e12))
    return plan


def sharded(captured, mesh_text: str, seed: int, spec=None, optimizer=None):
    mesh = mesh_for(mesh_text, "cpu")
    run_pipeline(captured.graph, "cleanup")
    plan = random_plan(captured.graph, mesh, seed)
    shard_graph(captured.graph, mesh, plan)
    verify(captured.graph)
    ctx = PassContext()
    ctx.result(ShardingPlans)[captured.graph.name] = plan
    return lower(captured, ctx, spec=spec, optimizer=optimizer)


def check_bytes(compiled):
    assert compiled.bytes_sent, "the run recorded no communication accounting"
    for sent in compiled.bytes_sent:
        assert sent == pytest.approx(compiled.predicted_bytes)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_random_plans_compute_what_eager_computes(name, mesh):
    ex = get_model(name, "tiny", batch_size=4)
    captured = capture_inference(ex.module, ex.inputs)
    compiled = sharded(captured, mesh, seed=hash((name, mesh)) % 1000)
    (out,) = compiled.run(*ex.inputs)
    with torch.no_grad():
        torch.testing.assert_close(out, ex.module(*ex.inputs), atol=1e-5, rtol=1e-5)
    check_bytes(compiled)


@pytest.mark.parametrize("mesh", ["4", "2x2", "2x2x2"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_random_plans_train_like_eager(name, mesh):
    ex = get_model(name, "tiny", batch_size=4, train=True)
    optimizer = SGD(lr=0.1)
    module = copy.deepcopy(ex.module)
    reference = optimizer.reference(module.parameters())
    loss = ex.loss_fn(module(*ex.inputs), *ex.targets)
    loss.backward()
    reference.step()
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=optimizer)
    compiled = sharded(captured, mesh, seed=hash((name, mesh, "train")) % 1000)
    outputs = compiled.step(*ex.inputs, *ex.targets)
    torch.testing.assert_close(outputs[compiled.loss_index()], loss.detach(), atol=1e-5,
                               rtol=1e-5)
    for pname, param in module.named_parameters():
        torch.testing.assert_close(captured.state[pname], param.detach(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, p=pname: f"{p}: {m}")
    check_bytes(compiled)
    assert {o.role for o in compiled.spmd.outputs} >= {OutputRole.LOSS, OutputRole.UPDATE}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_random_plans_check_every_gradient_and_adam_state_against_eager(name):
    """The eager check on sharded plans that communicate: the loss, each gradient, updated
    parameter and Adam state agree with eager + torch.optim within their rounding tolerance."""
    ex = get_model(name, "tiny", batch_size=4, train=True)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=Adam(), keep_grads=True)
    spec = ModelSpec(name, ex.module, ex.inputs, ex.loss_fn, ex.targets)
    compiled = sharded(captured, "2x2", seed=zlib.crc32(name.encode()) % 1000, spec=spec,
                       optimizer=Adam())
    check = compiled.check()
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.within_tolerance, "\n".join(check.lines())
    assert max(compiled.bytes_sent) > 0  # the plan communicates


def test_ilp_plan_on_gloo_ranks_equals_in_process_and_eager():
    ex = get_model("gpt", "tiny", batch_size=4)
    compiled = graphpar.compile(ex.module, ex.inputs, mesh="2x2", cluster="cpu", time_limit=20)
    in_process = compiled.run(*ex.inputs)
    bytes_in_process = list(compiled.bytes_sent)
    assert compiled.bytes_counted is None  # no wire in one process
    multi = compiled.run(*ex.inputs, processes=True)
    assert torch.equal(in_process[0], multi[0])
    assert compiled.bytes_sent == bytes_in_process
    # every collective is a gloo all-gather (then the group's sum or cut), which sends at
    # least the logical collective's bytes: (n-1)·B against 2·(n-1)/n·B, (n-1)/n·B, ...
    assert len(compiled.bytes_counted) == 4
    assert all(c >= s for c, s in zip(compiled.bytes_counted, compiled.bytes_sent))
    with torch.no_grad():
        torch.testing.assert_close(multi[0], ex.module(*ex.inputs), atol=1e-5, rtol=1e-5)
