"""A tiny Hugging Face T5 (an encoder-decoder: relative position biases, cross-attention, a
tied LM head), built from its config with random weights: `graphpar compile examples/hf_t5.py
--mesh 2 --run-cpu 2`, or trained pipelined, its stages spanning encoder and decoder:
`--mode train --pipeline 2 --run-cpu 2`."""

import torch
import torch.nn.functional as F
import transformers

VOCAB = 96


class Seq2Seq(torch.nn.Module):
    """The model called on the encoder's and the decoder's tokens, returning its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                          use_cache=False).logits


def tokens(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, length), generator=torch.Generator().manual_seed(seed))


def build():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    # eval(): no dropout, which a captured step cannot draw; gradients flow all the same
    return Seq2Seq(transformers.T5ForConditionalGeneration(config)).eval(), (tokens(1, 12),
                                                                             tokens(2, 8))


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def targets():
    return (torch.roll(tokens(2, 8), -1, 1),)
