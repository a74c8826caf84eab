"""A tiny Hugging Face OPT causal LM (attention with biases on q, k, v), built from its config
with random weights: `graphpar compile examples/hf_opt.py --mode train --mesh 2x2 --run-cpu 4`.

Its key projection's bias gets a gradient that is zero in exact arithmetic (softmax ignores a
constant added to every score) and pure rounding in float32: the certificate's rounding bound
follows the terms that cancel there (docs/certificate.md)."""

import torch
import torch.nn.functional as F
import transformers

VOCAB = 128


class CausalLM(torch.nn.Module):
    """The model called on token ids, returning its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))


def build():
    torch.manual_seed(0)
    config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
                                    num_attention_heads=4, vocab_size=VOCAB,
                                    max_position_embeddings=32, word_embed_proj_dim=32,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    # eval(): no dropout, which a captured step cannot draw; gradients flow all the same
    return CausalLM(transformers.OPTForCausalLM(config)).eval(), (token_ids(),)


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def targets():
    return (torch.roll(token_ids(), -1, 1),)
