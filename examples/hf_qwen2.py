"""A tiny Hugging Face Qwen2 causal LM (grouped-query attention, biases on q, k, v), built from
its config with random weights. Token-pipelined training on 2 CPU ranks:
`graphpar compile examples/hf_qwen2.py --mode train --mesh 2 --cluster cpu --pipeline 2
--token-slices 3 --run-cpu 2`. Hugging Face builds its causal mask as a tensor; slice-tokens
reads causality off that mask (docs/token-slicing.md)."""

import torch
import transformers
from hf_opt import VOCAB, CausalLM, loss, targets, token_ids

__all__ = ["build", "loss", "targets"]


def build():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return CausalLM(transformers.Qwen2ForCausalLM(config)).eval(), (token_ids(),)
