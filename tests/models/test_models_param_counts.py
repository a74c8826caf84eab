"""Analytic parameter counts of the big presets: close to their names, exact where known."""

import dataclasses

import pytest
import torch

import graphpar.models as models


def name_to_count(preset: str) -> float:
    scale = {"M": 1e6, "B": 1e9}[preset[-1]]
    return float(preset[:-1]) * scale


NAMED_PRESETS = [
    (name, preset)
    for name in models.MODEL_NAMES
    for preset in models.presets(name)
    if preset[-1] in "MB" and preset[0].isdigit()
]


@pytest.mark.parametrize(("name", "preset"), NAMED_PRESETS)
def test_named_presets_are_within_10_percent_of_their_name(name, preset):
    config = models.get_config(name, preset)
    if name == "gpt" and preset in ("125M", "350M", "760M"):
        # Alpa's names count a tied embedding; untied adds 51200 * d, up to 31% at 125M.
        config = dataclasses.replace(config, tie_embeddings=True)
    count = models.param_count(name, config)
    assert count == pytest.approx(name_to_count(preset), rel=0.10)


def test_gpt_presets_match_alpa_within_3_percent_when_tied():
    for preset in ("125M", "350M", "760M", "1.3B", "2.6B", "6.7B", "15B", "39B", "76B", "175B"):
        config = models.get_config("gpt", preset, tie_embeddings=True)
        assert models.param_count("gpt", config) == pytest.approx(name_to_count(preset), rel=0.03)


def test_counts_equal_published_models():
    # GPT-2 small (vocab 50257, tied): 124,439,808 parameters.
    gpt2 = models.get_config("gpt", "125M", vocab_size=50257, tie_embeddings=True)
    assert models.param_count("gpt", gpt2) == 124_439_808
    # Llama-2-7B, Llama-3-8B, Llama-2-70B.
    assert models.param_count("llama", models.get_config("llama", "7B")) == 6_738_415_616
    assert models.param_count("llama", models.get_config("llama", "8B")) == 8_030_261_248
    assert models.param_count("llama", models.get_config("llama", "70B")) == 68_976_648_192
    # BERT base / large (BertModel with pooler: 109,482,240 / 335,141,888) plus our heads.
    for preset, encoder in (("base", 109_482_240), ("large", 335_141_888)):
        config = models.get_config("bert", preset)
        d, v = config.d_model, config.vocab_size
        heads = (d * d + d + 2 * d + d * v + v) + (2 * d + 2)
        assert models.param_count("bert", config) == encoder + heads


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("gpt", "1.3B"),
        ("llama", "8B"),
        ("bert", "large"),
        ("moe", "380M"),
        ("wide_resnet", "1B"),
        ("mlp", "large"),
    ],
)
def test_analytic_count_equals_a_meta_built_module(name, preset):
    with torch.device("meta"):
        module = models.build(name, models.get_config(name, preset))
    assert sum(p.numel() for p in module.parameters()) == models.param_count(
        name, models.get_config(name, preset)
    )
