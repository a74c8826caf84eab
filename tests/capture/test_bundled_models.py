"""Every bundled model, captured and run on the CPU reference executor, equals eager PyTorch."""

import copy

import pytest
import torch

from graphpar.capture import SGD, Adam, capture_inference, capture_training
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
    module, loss, _ = eager_step(ex, optimizer)
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=optimizer)
    verify(captured.graph)
    outputs = captured.run(*ex.inputs, *ex.targets)
    captured.apply_updates(outputs)
    (loss_index,) = [i for i, o in enumerate(captured.graph.outputs) if o.role is OutputRole.LOSS]
    close(outputs[loss_index], loss, f"{name} loss")
    for pname, param in module.named_parameters():
        close(captured.state[pname], param.detach(), f"{name} updated {pname}")
