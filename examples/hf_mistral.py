"""A tiny Hugging Face Mistral causal LM with a sliding window of 6 tokens over its 16, built
from its config with random weights. Token-pipelined training on 2 CPU ranks:
`graphpar compile examples/hf_mistral.py --mode train --mesh 2 --cluster cpu --pipeline 2
--token-slices 3 --run-cpu 2`. slice-tokens reads the window off the mask Hugging Face builds
(docs/token-slicing.md)."""

import torch
import transformers
from hf_opt import VOCAB, CausalLM, loss, targets, token_ids

__all__ = ["build", "loss", "targets"]


def build():
    torch.manual_seed(0)
    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=6,
                                        vocab_size=VOCAB, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return CausalLM(transformers.MistralForCausalLM(config)).eval(), (token_ids(),)
