"""Hugging Face models with attention biases (OPT, GPT-2, ViT: examples/hf_*.py), whose
key-bias gradients (and a ViT's class token's) are mathematically zero and in float32 pure
rounding: sharded on a 2x2 mesh, pipelined in 2 stages and lowered to CUDA listings, three
training steps each equal eager PyTorch within the rounding their computation allows, with no
false alarm. A tolerance relative to each result's own size would call these 1e5 to 1e9 times
over."""

from __future__ import annotations

from pathlib import Path

import pytest

import graphpar
from graphpar.capture import Adam
from graphpar.compiler.model_file import load_model_file

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def build(name: str):
    spec = load_model_file(EXAMPLES / f"hf_{name}.py", "train")
    return spec.module, spec.inputs[0], spec.loss_fn, spec.targets[0]


def certify(name: str, how: str):
    module, x, loss, target = build(name)
    options = dict(mode="train", loss_fn=loss, targets=(target,), optimizer=Adam(),
                   cluster="cpu", time_limit=10, keep_grads=True)
    if how == "pipeline":
        compiled = graphpar.compile(module, (x,), mesh="2", pipeline=2, microbatches=2,
                                    **options)
        assert compiled.stages == 2
        return compiled.check(steps=3)
    compiled = graphpar.compile(module, (x,), mesh="2x2", **options)
    return compiled.check(steps=3, backend="cuda" if how == "cuda" else "interpreter")


CASES = [(name, how) for name in ("opt", "gpt2", "vit") for how in ("2x2", "pipeline", "cuda")]
DEFAULT = {("opt", "2x2"), ("vit", "pipeline")}


@pytest.mark.parametrize("name,how", [pytest.param(*c, marks=() if c in DEFAULT else
                                                   pytest.mark.slow) for c in CASES])
def test_no_false_alarm_on_attention_biases(name, how):
    check = certify(name, how)
    assert check.steps == 3
    assert {"loss", "gradients", "parameters", "optimizer state"} <= set(check.errors)
    assert check.within_tolerance, check.verdict() + "\n" + "\n".join(check.lines())
