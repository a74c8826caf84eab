"""A tiny Hugging Face GPT-2 (a fused qkv projection with bias, tied embeddings), built from its
config with random weights: `graphpar compile examples/hf_gpt2.py --mode train --mesh 2x2
--run-cpu 4`. See examples/hf_opt.py for why attention biases matter to the certificate."""

import torch
import transformers
from hf_opt import VOCAB, CausalLM, loss, targets, token_ids

__all__ = ["build", "loss", "targets"]


def build():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    return CausalLM(transformers.GPT2LMHeadModel(config)).eval(), (token_ids(),)
