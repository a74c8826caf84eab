"""Every bundled model, captured and run on the CPU reference executor, equals eager PyTorch."""

import copy

import pytest
import torch

from graphpar.capture import SGD, Adam, capture_inference, capture_training
from graphpar.compiler.check.eager import compare, eager_reference
from graphpar.compiler.driver import ModelSpec
from graphpar.ir.graph import OutputRole
from graphpar.ir.parser import parse
from graphpar.ir.printer import print_graph
from graphpar.ir.verify import verify
from graphpar.models import MODEL_NAMES, get_model
from graphpar.passes import run_pipeline

ATOL = RTOL = 1e-5


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inference_matches_eager_and_round_trips(name):
    ex = get_model(name, "tiny")
    captured = capture_inference(ex.module, ex.inputs, name=name)
    verify(captured.graph)
    text = print_graph(captured.graph, show_source=True)
    assert parse(text) == captured.graph
    (out,) = captured.run(*ex.inputs)
    with torch.no_grad():
        close(out, ex.module(*ex.inputs), f"{name} output")
    run_pipeline(captured.graph, "cleanup")
    (cleaned,) = captured.run(*ex.inputs)
    close(cleaned, out, f"{name} output after cleanup")


def eager_step(ex, optimizer=None):
    module = copy.deepcopy(ex.module)
    reference = optimizer.reference(module.parameters()) if optimizer else None
    loss = ex.loss_fn(module(*ex.inputs), *ex.targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    if reference:
        reference.step()
    return module, loss.detach(), grads


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_training_step_gradients_match_eager(name):
    ex = get_model(name, "tiny", train=True)
    module, loss, grads = eager_step(ex)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets)
    verify(captured.graph)
    assert parse(print_graph(captured.graph)) == captured.graph
    outputs = captured.run(*ex.inputs, *ex.targets)
    got = dict(zip(captured.graph.outputs, outputs))
    roles = {o.role for o in captured.graph.outputs}
    assert OutputRole.LOSS in roles
    for out, tensor in got.items():
        if out.role is OutputRole.LOSS:
            close(tensor, loss, f"{name} loss")
        elif out.role is OutputRole.GRAD:
            close(tensor, grads[out.target], f"{name} grad of {out.target}")
        elif out.role is OutputRole.UPDATE:  # batch-norm running statistics
            close(tensor, dict(module.named_buffers())[out.target], f"{name} {out.target}")
    assert {o.target for o in got if o.role is OutputRole.GRAD} == set(grads)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
                                       Adam()], ids=["sgd", "adam"])
@pytest.mark.parametrize("name", ["gpt", "llama", "wide_resnet"])
def test_training_step_updates_match_torch_optim(name, optimizer):
    ex = get_model(name, "tiny", train=True)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=optimizer)
    verify(captured.graph)
    outputs = captured.run(*ex.inputs, *ex.targets)
    spec = ModelSpec(name, ex.module, ex.inputs, ex.loss_fn, ex.targets)
    check = compare(captured.graph.outputs, [outputs], eager_reference(spec, True, optimizer))
    assert {"loss", "parameters"} <= set(check.errors)
    assert check.errors["parameters"].tensors == len(dict(ex.module.named_parameters()))
    assert ("optimizer state" in check.errors) == (optimizer.state_names("p") != [])
    # Not one atol for every element: a first Adam step moves each element by
    # lr·g/(|g| + eps), i.e. by about lr·sign(g), so a gradient that is itself at rounding
    # level (|g| ~ 1e-8 here, beside gradients of 1e-2) can come out anywhere in ±lr on
    # another CPU, while a gradient well above its rounding fixes its update tightly. The
    # check's bound per element comes from running eager PyTorch and torch.optim with
    # float32-sized rounding errors (compiler.check.rounding), so it follows Adam's formula.
    # A wrong formula (a lost bias correction, a wrong β or lr) is off by a fraction of lr on
    # every element and fails.
    assert check.within_tolerance, "\n".join(check.lines())
    captured.apply_updates(outputs)  # the next step starts from what was checked
    updates = {o.target: t for o, t in zip(captured.graph.outputs, outputs)
               if o.role is OutputRole.UPDATE}
    for pname, _ in ex.module.named_parameters():
        assert captured.state[pname] is updates[pname], pname
