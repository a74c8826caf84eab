"""The eager check: compiled training steps on a 2x2 mesh match eager PyTorch (float64) and the
real torch.optim step, over several steps, element by element within the rounding their own
computation allows; wrong steps are caught and named, also when they only show from the
second step."""

import copy

import pytest
import torch

import graphpar
from graphpar.capture import SGD, Adam, capture_training
from graphpar.capture.optim import STEP
from graphpar.compiler.check.eager import compare, eager_reference, eager_steps
from graphpar.compiler.driver import ModelSpec
from graphpar.models import MODEL_NAMES, get_model


def spec_of(ex) -> ModelSpec:
    return ModelSpec(ex.name, ex.module, tuple(ex.inputs), ex.loss_fn, tuple(ex.targets))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sharded_training_steps_match_eager_and_torch_optim(name):
    ex = get_model(name, "tiny", train=True)
    before = {n: p.detach().clone() for n, p in ex.module.named_parameters()}
    compiled = graphpar.compile(ex.module, ex.inputs, mesh="2x2", mode="train",
                                loss_fn=ex.loss_fn, targets=ex.targets, optimizer=Adam(),
                                cluster="cpu", time_limit=10, keep_grads=True)
    state = dict(compiled.captured.state)
    check = compiled.check(steps=3)
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.steps == 3 and all(set(s) == set(check.errors) for s in check.by_step)
    params = len(before)
    assert check.errors["gradients"].tensors == check.errors["parameters"].tensors == params
    assert check.errors["optimizer state"].tensors == 2 * params + 1  # m, v each, and the step
    # each difference is one rounding explains, element by element (graphpar.compiler.check.eager)
    assert check.within_tolerance, "\n".join(check.lines())
    assert check.verdict().startswith("verdict    PASS: 3 steps")
    for n, p in ex.module.named_parameters():  # the check ran on a copy
        assert torch.equal(p.detach(), before[n]), n
    assert compiled.captured.state == state  # and left the compiled state as it was


def single_device_steps(ex, optimizer, steps=1, graph_edit=None):
    captured = capture_training(copy.deepcopy(ex.module), ex.inputs, ex.loss_fn, ex.targets,
                                optimizer=optimizer, keep_grads=True)
    if graph_edit is not None:
        graph_edit(captured.graph)
    runs = []
    for _ in range(steps):
        outputs = captured.run(*ex.inputs, *ex.targets)
        runs.append(outputs)
        captured.apply_updates(outputs)
    return captured.graph.outputs, runs


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9, weight_decay=0.01), Adam()],
                         ids=["sgd", "adam"])
def test_a_different_optimizer_step_is_caught_and_named(optimizer):
    ex = get_model("mlp", "tiny", train=True)
    outputs, runs = single_device_steps(ex, optimizer)
    good = compare(outputs, runs, eager_reference(spec_of(ex), True, optimizer))
    assert good.within_tolerance, "\n".join(good.lines())
    # the same step compared with a torch.optim step of a 1% larger learning rate
    wrong_lr = type(optimizer)(**{**optimizer.__dict__, "lr": optimizer.lr * 1.01})
    bad = compare(outputs, runs, eager_reference(spec_of(ex), True, wrong_lr))
    assert not bad.within_tolerance
    assert bad.errors["parameters"].tolerance_used > 1
    assert bad.errors["gradients"].tolerance_used <= 1  # only the update is wrong
    assert bad.verdict().startswith("verdict    FAIL: 1 step, parameters ")


def test_a_wrong_gradient_is_named():
    ex = get_model("mlp", "tiny", train=True)
    outputs, runs = single_device_steps(ex, Adam())
    (index,) = [i for i, o in enumerate(outputs)
                if o.role.value == "grad" and o.target.endswith("bias")][-1:]
    runs[0][index] = runs[0][index] * 1.0001  # 1e-4 off: a real bug, far above rounding
    check = compare(outputs, runs, eager_reference(spec_of(ex), True, Adam()))
    worst = check.errors["gradients"]
    assert worst.at == outputs[index].target and worst.step == 1
    assert worst.tolerance_used > 10
    assert abs(worst.error) <= worst.max_abs_error and worst.bound > 0
    assert f"gradients {worst.at}[" in check.verdict()


def test_a_bug_from_the_second_step_is_caught():
    """Bias corrections that read a step counter which does not advance (always the first
    step's) give the right first step and wrong updates from the second on: one step compared
    passes it, three do not."""
    ex = get_model("mlp", "tiny", train=True)

    def stale_counter(graph):
        counter = graph.input(STEP)
        (advance,) = [n for n in counter.users if n.op == "add"]
        stale = graph.create("sub", [advance.output, counter],
                             before=next(iter(graph.nodes.after(advance))))
        for user in list(advance.output.users):
            if user is not stale:
                user.replace_input(advance.output, stale.output)

    outputs, runs = single_device_steps(ex, Adam(), steps=3, graph_edit=stale_counter)
    one = compare(outputs, runs[:1], eager_reference(spec_of(ex), True, Adam(), steps=1))
    assert one.within_tolerance, "\n".join(one.lines())
    three = compare(outputs, runs, eager_reference(spec_of(ex), True, Adam(), steps=3))
    assert not three.within_tolerance
    assert three.by_step[0]["parameters"].tolerance_used <= 1
    assert three.by_step[1]["parameters"].tolerance_used > 1
    assert three.worst.step >= 2


def test_eager_steps_name_state_as_the_graph_does():
    ex = get_model("mlp", "tiny", train=True)
    (expected,) = eager_steps(spec_of(ex), True, Adam())
    pname = next(n for n, _ in ex.module.named_parameters())
    for key in [("loss", "loss"), ("gradients", pname), ("parameters", pname),
                ("optimizer state", f"{pname}.exp_avg"), ("optimizer state", "optim.step")]:
        assert key in expected, key
        assert expected[key].dtype in (torch.float64, torch.float32), key
    assert expected["parameters", pname].dtype == torch.float64  # the reference is float64


def test_eager_steps_carry_the_optimizer_state():
    ex = get_model("mlp", "tiny", train=True)
    steps = eager_steps(spec_of(ex), True, Adam(), steps=3)
    assert [float(s["optimizer state", STEP]) for s in steps] == [1.0, 2.0, 3.0]
    pname = next(n for n, _ in ex.module.named_parameters())
    assert not torch.equal(steps[0]["parameters", pname], steps[1]["parameters", pname])


def test_pipelined_compile_from_python_matches_eager():
    """graphpar.compile(..., pipeline=S): the stage DP's plan, run by ZB-H1 over two
    microbatches, equals eager PyTorch + torch.optim on the full batch for two steps."""
    ex = get_model("mlp", "tiny", train=True)
    pipe = graphpar.compile(ex.module, ex.inputs, mesh="2", mode="train", loss_fn=ex.loss_fn,
                            targets=ex.targets, optimizer=Adam(), cluster="cpu",
                            keep_grads=True, pipeline=2, microbatches=2, schedule="zb")
    assert len(pipe.plan.stages) == pipe.stages == 2 and pipe.schedule_name == "zb"
    check = pipe.check(steps=2)
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.steps == 2
    assert check.within_tolerance, "\n".join(check.lines())
    with pytest.raises(graphpar.errors.UsageError, match="pass mode='train'"):
        graphpar.compile(ex.module, ex.inputs, mesh="2", pipeline=2)


def test_a_tied_parameter_is_keyed_by_both_of_its_names():
    # one tensor, two names: stepped once, and a graph naming it either way finds it
    ex = get_model("gpt", "tiny", train=True, tie_embeddings=True)
    (expected,) = eager_steps(spec_of(ex), True, Adam())
    for kind, suffix in (("gradients", ""), ("parameters", ""),
                         ("optimizer state", ".exp_avg"), ("optimizer state", ".exp_avg_sq")):
        first = expected[kind, "tok_emb.weight" + suffix]
        assert expected[kind, "lm_head.weight" + suffix] is first
    (untied,) = eager_steps(spec_of(get_model("gpt", "tiny", train=True)), True, Adam())
    assert len([k for k in expected if k[0] == "parameters"]) == len(
        [k for k in untied if k[0] == "parameters"])  # the same names as the untied model


def test_adams_update_is_allowed_the_rounding_of_its_gradients_copies():
    """A plan may compute a gradient twice and feed m and v copies rounded apart: the update
    lr·m̂/(√v̂ + eps), which cancels the gradient in exact arithmetic, keeps their difference.
    Each parameter's spread gains lr·(1-β1)/(1-β1^t)·δ/(√v̂ + eps) for the gradient's spread δ;
    the gradient's own bound is unchanged."""
    from graphpar.compiler.check.eager import SIGMAS, Reference, adam_copies

    adam = Adam(lr=1e-3)
    g = torch.tensor([1e-2, 1e-5], dtype=torch.float64)
    delta = torch.tensor([1e-9, 1e-9], dtype=torch.float64)
    values = {("parameters", "w"): torch.zeros(2, dtype=torch.float64),
              ("gradients", "w"): g,
              ("optimizer state", "w.exp_avg_sq"): (1 - adam.beta2) * g.square()}
    spreads = {("parameters", "w"): torch.zeros(2, dtype=torch.float64),
               ("gradients", "w"): delta,
               ("optimizer state", "w.exp_avg_sq"): torch.zeros(2, dtype=torch.float64)}
    reference = Reference([values], [spreads])
    reference.extra = adam_copies(reference, adam)
    want = adam.lr * delta / (g.abs() + adam.eps)  # first step: v̂ = g², (1-β1)/(1-β1) = 1
    assert torch.allclose(reference.bound(0, ("parameters", "w")), SIGMAS * want)
    assert torch.equal(reference.bound(0, ("gradients", "w")), SIGMAS * delta + 2**-24 * g)
