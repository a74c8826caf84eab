"""A module built on the meta device captures to the same IR as a real one, allocating no
weights, and runs equal to eager once its weights are made."""

import pytest
import torch
from torch import nn

from graphpar.capture import Adam, capture_inference, capture_training
from graphpar.cli.common import example_spec
from graphpar.compiler.driver import ModelSpec, compile_model
from graphpar.ir.printer import print_graph
from graphpar.models import MODEL_NAMES, get_model


def same_state_types(real, meta):
    assert sorted(real.state) == sorted(meta.state)
    for name, tensor in real.state.items():
        assert (meta.state[name].shape, meta.state[name].dtype) == (tensor.shape, tensor.dtype)
        assert meta.state[name].is_meta, f"{name} was allocated"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_meta_inference_capture_prints_the_same_ir(name):
    real = get_model(name, "tiny")
    meta = get_model(name, "tiny", device="meta")
    expected = capture_inference(real.module, real.inputs, name=name)
    captured = capture_inference(meta.module, real.inputs, name=name)
    assert print_graph(captured.graph, show_source=True) == print_graph(expected.graph,
                                                                        show_source=True)
    same_state_types(expected, captured)
    assert all(p.is_meta for p in meta.module.parameters()), "the module gets its own back"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_meta_training_step_capture_prints_the_same_ir(name):
    real = get_model(name, "tiny", train=True)
    meta = get_model(name, "tiny", train=True, device="meta")
    expected = capture_training(real.module, real.inputs, real.loss_fn, real.targets,
                                optimizer=Adam(), name=name)
    captured = capture_training(meta.module, real.inputs, meta.loss_fn, real.targets,
                                optimizer=Adam(), name=name)
    assert print_graph(captured.graph, show_source=True) == print_graph(expected.graph,
                                                                        show_source=True)
    same_state_types(expected, captured)


class TiedLM(nn.Module):
    """An embedding whose weight the output projection shares, as GPT-2's does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_tied_weights_stay_tied_without_weights_and_after_making_them(mode):
    ids = torch.randint(0, 32, (2, 5))
    labels = torch.randint(0, 32, (2, 5))

    def loss(logits, target):
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    torch.manual_seed(0)
    real = ModelSpec("tied", TiedLM(), (ids,), loss, (labels,))
    with torch.device("meta"):
        meta = ModelSpec("tied", TiedLM(), (ids,), loss, (labels,))
    expected = compile_model(real, mode, optimizer=Adam()).captured
    captured = compile_model(meta, mode, optimizer=Adam()).captured
    assert captured.graph.attrs.get("tied") == expected.graph.attrs.get("tied") is not None
    assert str(captured.graph) == str(expected.graph)
    assert captured.abstract
    args = (ids, labels) if mode == "train" else (ids,)
    outputs = captured.run(*args)  # the weights are made now, by the module's own init
    module = meta.module
    assert not captured.abstract and module.head.weight is module.embed.weight
    assert not module.embed.weight.is_meta
    with torch.no_grad():
        logits = module(ids)
        torch.testing.assert_close(outputs[0], loss(logits, labels) if mode == "train"
                                   else logits)


def test_a_bundled_example_compiles_on_meta_and_runs_with_the_cpu_build_weights():
    spec = example_spec("llama:tiny", train=True)
    assert all(p.is_meta for p in spec.module.parameters())
    result = compile_model(spec, "train", optimizer=Adam())
    assert result.captured.abstract
    loss, *_ = result.captured.run(*spec.inputs, *spec.targets)
    real = get_model("llama", "tiny", train=True)
    for name, tensor in real.module.named_parameters():
        torch.testing.assert_close(result.captured.state[name], tensor.detach())
    torch.testing.assert_close(loss, real.training_loss().detach())
