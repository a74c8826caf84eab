"""Hugging Face LLaMA-2-70B as a model file, built plainly: `graphpar compile
examples/hf_llama2_70b.py --mesh 8x8`.

The full-size model (80 layers, hidden 8192, 64 heads with 8 key/value heads, 28672 MLP,
vocabulary 32000) is written as most people write it, with no meta device: graphpar runs
`build()` on the meta device when nothing will run, so planning it allocates no weights.
`GRAPHPAR_HF_LLAMA=tiny` builds a two-layer LLaMA instead, small enough for `--run-cpu`.
Requires `transformers`.
"""

import os

import torch
import transformers

BATCH, SEQ = 8, 4096  # the example batch planned for
TINY_BATCH, TINY_SEQ = 2, 16


class CausalLM(torch.nn.Module):
    """The HF model called on token ids, returning the logits tensor alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def tiny() -> bool:
    return os.environ.get("GRAPHPAR_HF_LLAMA", "full") == "tiny"


def config() -> transformers.LlamaConfig:
    if tiny():
        return transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    return transformers.LlamaConfig(  # LLaMA-2-70B
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-5, dtype=torch.bfloat16)


def build():
    cfg = config()
    cfg._attn_implementation = "sdpa"  # attention stays one op
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if not tiny():
        model = model.to(torch.bfloat16)
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny() else (BATCH, SEQ)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return CausalLM(model).eval(), (ids,)


def loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def targets():
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny() else (BATCH, SEQ)
    return (torch.randint(0, config().vocab_size, (batch, seq)),)
