"""A tiny Hugging Face BLOOM causal LM (ALiBi, attention written out as matmuls, an added mask
and a softmax under `"eager"`), built from its config with random weights. Token-pipelined
training on 2 CPU ranks: `graphpar compile examples/hf_bloom.py --mode train --mesh 2
--cluster cpu --pipeline 2 --token-slices 3 --run-cpu 2`. slice-tokens finds the written-out
attention and reads its causality off the mask (docs/token-slicing.md)."""

import torch
import transformers
from hf_opt import VOCAB, CausalLM, loss, targets, token_ids

__all__ = ["build", "loss", "targets"]


def build():
    torch.manual_seed(0)
    config = transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"  # BLOOM has no SDPA path
    return CausalLM(transformers.BloomForCausalLM(config)).eval(), (token_ids(),)
