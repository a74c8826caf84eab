"""The eager check: a compiled training step on a 2x2 mesh matches eager PyTorch and the real
torch.optim step in its loss, every gradient, parameter and optimizer state, for every bundled
model; a wrong step is caught and named."""

import copy

import pytest
import torch

import graphpar
from graphpar.capture import SGD, Adam, capture_training
from graphpar.compiler import ModelSpec
from graphpar.eager_check import allowed_errors, check_against_eager, eager_results
from graphpar.models import MODEL_NAMES, get_model


def spec_of(ex) -> ModelSpec:
    return ModelSpec(ex.name, ex.module, tuple(ex.inputs), ex.loss_fn, tuple(ex.targets))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sharded_training_step_matches_eager_and_torch_optim(name):
    ex = get_model(name, "tiny", train=True)
    before = {n: p.detach().clone() for n, p in ex.module.named_parameters()}
    compiled = graphpar.compile(ex.module, ex.inputs, mesh="2x2", mode="train",
                                loss_fn=ex.loss_fn, targets=ex.targets, optimizer=Adam(),
                                cluster="cpu", time_limit=10, keep_grads=True)
    check = compiled.check()
    kinds = set(check.errors)
    assert {"loss", "gradients", "parameters", "optimizer state"} <= kinds, kinds
    params = len(before)
    assert check.errors["gradients"].tensors == check.errors["parameters"].tensors == params
    assert check.errors["optimizer state"].tensors == 2 * params + 1  # m, v each, and the step
    # the loss and the gradients are reductions: rounding moves them by far less than 1e-5 of
    # their scale, and the loss and the gradients of these models are below 10
    assert check.errors["loss"].max_abs_error < 1e-5
    assert check.errors["gradients"].max_abs_error < 1e-5
    # each difference is one rounding explains, element by element (see allowed_errors)
    assert check.within_tolerance, "\n".join(check.lines())
    for n, p in ex.module.named_parameters():  # the check ran on a copy
        assert torch.equal(p.detach(), before[n]), n


def single_device_step(ex, optimizer):
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=optimizer, keep_grads=True)
    return captured.graph.outputs, captured.run(*ex.inputs, *ex.targets)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9, weight_decay=0.01), Adam()],
                         ids=["sgd", "adam"])
def test_a_different_optimizer_step_is_caught_and_named(optimizer):
    ex = get_model("mlp", "tiny", train=True)
    outputs, tensors = single_device_step(ex, optimizer)
    good = check_against_eager(outputs, tensors, spec_of(ex), optimizer)
    assert good.within_tolerance, "\n".join(good.lines())
    # the same step compared with a torch.optim step of a 1% larger learning rate
    wrong_lr = type(optimizer)(**{**optimizer.__dict__, "lr": optimizer.lr * 1.01})
    bad = check_against_eager(outputs, tensors, spec_of(ex), wrong_lr)
    assert not bad.within_tolerance
    assert bad.errors["parameters"].tolerance_used > 1
    assert bad.errors["gradients"].tolerance_used <= 1  # only the update is wrong


def test_a_wrong_gradient_is_named():
    ex = get_model("mlp", "tiny", train=True)
    outputs, tensors = single_device_step(ex, Adam())
    (index,) = [i for i, o in enumerate(outputs)
                if o.role.value == "grad" and o.target.endswith("bias")][-1:]
    tensors[index] = tensors[index] * 1.001  # 0.1% off: a real bug, far above rounding
    check = check_against_eager(outputs, tensors, spec_of(ex), Adam())
    assert check.errors["gradients"].at == outputs[index].target
    assert check.errors["gradients"].tolerance_used > 1


def test_adam_tolerance_follows_the_first_step():
    """Adam's first step moves each element by lr·g/(|g| + eps): by about lr wherever the
    gradient is well above its rounding (a tight bound there), anywhere in ±lr where it is at
    rounding level (a loose one)."""
    grad = torch.tensor([1.0, 1e-3, 1e-9, 0.0])
    params = {"w": torch.zeros(4)}
    expected = {("gradients", "w"): grad, ("parameters", "w"): torch.zeros(4)}
    adam = Adam(lr=1e-3)
    allowed = allowed_errors(expected, params, adam)["parameters", "w"]
    delta = 1e-5  # REDUCTION_RTOL of the gradient's scale, 1.0
    # eps·δ/g² is negligible: only the float32 bias corrections' 5e-5·4 of lr
    assert allowed[0] < adam.lr * 1e-3
    assert allowed[2] == pytest.approx(2 * adam.lr, rel=0.1)
    assert allowed[3] == pytest.approx(2 * adam.lr, rel=0.1)
    assert allowed[1] < allowed[2] and allowed[1] > adam.lr * adam.eps * delta / 1e-6


def test_eager_results_name_state_as_the_graph_does():
    ex = get_model("mlp", "tiny", train=True)
    expected = eager_results(spec_of(ex), True, Adam())
    pname = next(n for n, _ in ex.module.named_parameters())
    for key in [("loss", "loss"), ("gradients", pname), ("parameters", pname),
                ("optimizer state", f"{pname}.exp_avg"), ("optimizer state", "optim.step")]:
        assert key in expected, key


def test_pipelined_compile_from_python_matches_eager():
    """graphpar.compile(..., pipeline=S): the stage DP's plan, run by ZB-H1 over two
    microbatches, equals eager PyTorch + torch.optim on the full batch."""
    ex = get_model("mlp", "tiny", train=True)
    pipe = graphpar.compile(ex.module, ex.inputs, mesh="2", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu",
                            keep_grads=True, pipeline=2, microbatches=2, schedule="zb")
    assert len(pipe.plan.stages) == pipe.stages == 2 and pipe.schedule_name == "zb"
    check = pipe.check()
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.within_tolerance, "\n".join(check.lines())
    with pytest.raises(graphpar.errors.UsageError, match="pass mode='train'"):
        graphpar.compile(ex.module, ex.inputs, mesh="2", pipeline=2)


def test_a_tied_parameter_is_keyed_by_both_of_its_names():
    # one tensor, two names: stepped once, and a graph naming it either way finds it
    ex = get_model("gpt", "tiny", train=True, tie_embeddings=True)
    expected = eager_results(spec_of(ex), True, Adam())
    for kind, suffix in (("gradients", ""), ("parameters", ""),
                         ("optimizer state", ".exp_avg"), ("optimizer state", ".exp_avg_sq")):
        first = expected[kind, "tok_emb.weight" + suffix]
        assert expected[kind, "lm_head.weight" + suffix] is first
    untied = eager_results(spec_of(get_model("gpt", "tiny", train=True)), True, Adam())
    assert len([k for k in expected if k[0] == "parameters"]) == len(
        [k for k in untied if k[0] == "parameters"])  # the same names as the untied model
