"""Hugging Face Mixtral as a model file: `graphpar compile examples/hf_mixtral.py --mesh 8x8`.

By default the full-size Mixtral-8x7B (32 layers, hidden 4096, 8 experts of 14336, top-2,
bfloat16) is built plainly from its config, with no meta device: graphpar runs `build()` on
the meta device when nothing will run (shapes only, no weights, no download), so planning it
takes seconds and little memory. `GRAPHPAR_HF_MIXTRAL=tiny` builds a two-layer Mixtral
instead, small enough for `--run-cpu`.
Requires `transformers`.
"""

import os

import torch
import transformers

BATCH, SEQ = 8, 1024  # the example batch planned for
TINY_BATCH, TINY_SEQ = 2, 16


class CausalLM(torch.nn.Module):
    """The HF model called on token ids, returning the logits tensor alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def config(tiny: bool) -> transformers.MixtralConfig:
    if tiny:
        return transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.MixtralConfig(dtype=torch.bfloat16)  # the defaults are Mixtral-8x7B


def build():
    tiny = os.environ.get("GRAPHPAR_HF_MIXTRAL", "full") == "tiny"
    cfg = config(tiny)
    cfg._attn_implementation = "sdpa"  # attention stays one op
    torch.manual_seed(0)
    if tiny:
        model = transformers.MixtralForCausalLM(cfg)
        batch, seq = TINY_BATCH, TINY_SEQ
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        batch, seq = BATCH, SEQ
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return CausalLM(model).eval(), (ids,)


def loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def targets():
    tiny = os.environ.get("GRAPHPAR_HF_MIXTRAL", "full") == "tiny"
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny else (BATCH, SEQ)
    vocab = 256 if tiny else 32000
    return (torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)),)
