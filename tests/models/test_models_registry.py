"""The model registry: names, presets, overrides, errors, seeding, devices and dtypes."""

import pytest
import torch

import graphpar.models as models
from graphpar.errors import UsageError


def same(xs, ys) -> bool:
    """Equal sequences of tensors: same length, same values."""
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_model_names():
    assert models.MODEL_NAMES == ("mlp", "gpt", "llama", "bert", "moe", "wide_resnet")
    for name in models.MODEL_NAMES:
        assert "tiny" in models.presets(name)


def test_unknown_model_lists_the_models():
    with pytest.raises(UsageError, match="unknown model 'gtp'.*gpt, llama"):
        models.get_model("gtp")


def test_unknown_preset_lists_the_presets():
    with pytest.raises(UsageError, match="unknown preset '13B'.*tiny, 125M"):
        models.get_model("gpt", "13B")


def test_unknown_override_lists_the_fields():
    with pytest.raises(UsageError, match="n_layer .*fields: vocab_size"):
        models.get_config("gpt", n_layer=3)


def test_bad_config_values_are_usage_errors():
    with pytest.raises(UsageError, match="divisible by n_heads"):
        models.get_config("gpt", n_heads=5)
    with pytest.raises(UsageError, match="multiple of n_kv_heads"):
        models.get_config("llama", n_kv_heads=3)
    with pytest.raises(UsageError, match="activation"):
        models.get_config("mlp", activation="tanh")


def test_config_of_another_model_is_rejected():
    with pytest.raises(UsageError, match="takes a GPTConfig, got LlamaConfig"):
        models.build("gpt", models.get_config("llama"))


def test_overrides_reach_the_module():
    spec = models.get_model("gpt", n_layers=3, d_model=32)
    assert len(spec.module.blocks) == 3
    assert spec.config.d_model == 32
    assert spec.preset == "tiny"


def test_same_seed_same_weights_and_batch_and_rng_state_untouched():
    before = torch.random.get_rng_state()
    a = models.get_model("llama", seed=3)
    b = models.get_model("llama", seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert same(list(a.module.state_dict().values()), list(b.module.state_dict().values()))
    assert same(a.inputs + a.targets, b.inputs + b.targets)
    c = models.get_model("llama", seed=4)
    assert not torch.equal(a.module.tok_emb.weight, c.module.tok_emb.weight)
    assert not torch.equal(a.inputs[0], c.inputs[0])


def test_eval_mode_by_default():
    assert not models.get_model("wide_resnet").module.training
    assert models.get_model("wide_resnet", train=True).module.training


def test_lm_targets_are_next_tokens():
    ids, labels = models.example_batch("gpt", models.get_config("gpt"), batch_size=3)
    assert ids[0].shape == labels[0].shape == (3, 32)
    assert torch.equal(ids[0][:, 1:], labels[0][:, :-1])


def test_example_inputs_and_targets_agree_with_example_batch():
    config = models.get_config("bert", pooler=True)
    inputs, targets = models.example_batch("bert", config, batch_size=4, seed=1)
    assert same(inputs, models.example_inputs("bert", config, batch_size=4, seed=1))
    assert same(targets, models.example_targets("bert", config, batch_size=4, seed=1))
    assert [t.shape for t in targets] == [(4, 32), (4,)]


def test_dtype_casts_floats_only():
    spec = models.get_model("llama", dtype=torch.bfloat16)
    assert spec.inputs[0].dtype == torch.int64
    assert spec.module.tok_emb.weight.dtype == torch.bfloat16
    assert spec.module.rope_cos.dtype == torch.bfloat16
    assert spec.module(*spec.inputs).dtype == torch.bfloat16
    mlp = models.get_model("mlp", dtype=torch.float64)
    assert mlp.inputs[0].dtype == mlp.targets[0].dtype == torch.float64


def test_meta_device_builds_big_models_without_memory():
    spec = models.get_model("gpt", "175B", device="meta")
    weight = spec.module.blocks[0].attn.qkv.weight
    assert weight.is_meta and weight.shape == (3 * 12288, 12288)
    assert spec.inputs[0].is_meta and spec.inputs[0].shape == (2, 1024)
    assert sum(p.numel() for p in spec.module.parameters()) == models.param_count(
        "gpt", spec.config
    )
