"""Hugging Face models with attention biases (OPT, GPT-2, ViT), whose key-bias gradients (and a
ViT's class token's) are mathematically zero and in float32 pure rounding: sharded on a 2x2 mesh,
pipelined in 2 stages and lowered to CUDA listings, three training steps each equal eager
PyTorch within the rounding their computation allows, with no false alarm. A tolerance relative
to each result's own size would call these 1e5 to 1e9 times over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpar
from graphpar.capture import Adam

transformers = pytest.importorskip("transformers")

VOCAB = 128


class Logits(torch.nn.Module):
    """A Hugging Face model called on one tensor, returning its logits."""

    def __init__(self, model, key: str):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).logits


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(name: str):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    if name == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=16, patch_size=4,
                                        num_labels=5)
        model = Logits(transformers.ViTForImageClassification(config), "pixel_values")
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
        return model.eval(), x, F.cross_entropy, torch.tensor([0, 3, 1, 4])
    if name == "opt":
        config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
                                        num_attention_heads=4, vocab_size=VOCAB,
                                        max_position_embeddings=32, word_embed_proj_dim=32)
        model = transformers.OPTForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                         vocab_size=VOCAB)
        model = transformers.GPT2LMHeadModel(config)
    return Logits(model, "input_ids").eval(), ids, lm_loss, torch.roll(ids, -1, 1)


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
