"""Every tiny example model: forward shapes, loss and gradients, export and make_fx capture."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphpar.models as models

# Output shapes for batch 2: LMs give logits [B, S, V]; BERT without a pooler does too.
OUTPUT_SHAPES = {
    "mlp": (2, 16),
    "gpt": (2, 32, 256),
    "llama": (2, 32, 256),
    "bert": (2, 32, 256),
    "moe": (2, 32, 256),
    "wide_resnet": (2, 10),
}


@pytest.fixture(params=models.MODEL_NAMES)
def spec(request) -> models.ExampleModel:
    return models.get_model(request.param)


def test_forward_shape(spec):
    assert spec.module(*spec.inputs).shape == OUTPUT_SHAPES[spec.name]


def test_param_count_matches_module(spec):
    actual = sum(p.numel() for p in spec.module.parameters())
    assert models.param_count(spec.name, spec.config) == actual


def test_loss_backward_reaches_every_parameter(spec):
    spec.module.train()
    loss = spec.training_loss()
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in spec.module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_export_matches_eager(spec):
    exported = torch.export.export(spec.module, spec.inputs, strict=False)
    torch.testing.assert_close(exported.module()(*spec.inputs), spec.module(*spec.inputs))


def test_training_step_traces_with_make_fx(spec):
    module = spec.module
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())

    def step(params, buffers, inputs, targets):
        out = torch.func.functional_call(module, (params, buffers), inputs)
        loss = spec.loss_fn(out, *targets)
        return loss, torch.autograd.grad(loss, list(params.values()))

    # Fake-tensor tracing: the same graph as real-tensor tracing, several times faster.
    graph = make_fx(step, tracing_mode="fake")(params, buffers, spec.inputs, spec.targets)
    loss, grads = graph(params, buffers, spec.inputs, spec.targets)
    eager_loss, eager_grads = step(params, buffers, spec.inputs, spec.targets)
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(grads, eager_grads)


def test_bert_with_pooler_returns_nsp_logits_and_adds_their_loss():
    spec = models.get_model("bert", pooler=True)
    mlm, nsp = spec.module(*spec.inputs)
    assert mlm.shape == (2, 32, 256) and nsp.shape == (2, 2)
    assert spec.training_loss() > spec.loss_fn(mlm, spec.targets[0])
    torch.export.export(spec.module, spec.inputs, strict=False)


def test_gpt_tied_embeddings_share_one_weight():
    spec = models.get_model("gpt", tie_embeddings=True)
    assert spec.module.lm_head.weight is spec.module.tok_emb.weight
    exported = torch.export.export(spec.module, spec.inputs, strict=False)
    # torch.export gives each name of the tied tensor its own input; the state_dict shares it.
    assert {"lm_head.weight", "tok_emb.weight"} <= set(exported.graph_signature.parameters)
    assert exported.state_dict["lm_head.weight"] is exported.state_dict["tok_emb.weight"]
    torch.testing.assert_close(exported.module()(*spec.inputs), spec.module(*spec.inputs))


def test_shorter_sequences_run_and_longer_ones_are_refused():
    spec = models.get_model("llama")
    assert spec.module(spec.inputs[0][:, :5]).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="exceeds"):
        spec.module(torch.zeros(1, 33, dtype=torch.long))


def test_wide_resnet_batchnorm_train_mode_exports_buffer_updates():
    spec = models.get_model("wide_resnet", train=True)
    initial = {name: buf.clone() for name, buf in spec.module.named_buffers()}
    exported = torch.export.export(spec.module, spec.inputs, strict=False)
    # The functional form names every running statistic the step writes.
    mutated = set(exported.run_decompositions({}).graph_signature.buffers_to_mutate.values())
    assert {"stem.1.running_mean", "stem.1.running_var", "blocks.0.bn3.running_var"} <= mutated

    # Running the exported program updates the statistics exactly as eager PyTorch does.
    # (It shares buffer tensors with spec.module, hence the copy of the initial values.)
    eager = models.get_model("wide_resnet", train=True).module
    captured = exported.module()
    torch.testing.assert_close(captured(*spec.inputs), eager(*spec.inputs))
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(captured.get_buffer(name), buf, msg=name)
    assert not torch.equal(eager.stem[1].running_mean, initial["stem.1.running_mean"])
