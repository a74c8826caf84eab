"""A tiny Hugging Face causal LM (GPT-2 config) with batch(step): graphpar train's test model."""

import torch
import torch.nn.functional as F

VOCAB, BATCH, SEQ = 64, 4, 8


class CausalLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def build():
    import transformers  # here, not at the top: the ranks only call batch()

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=SEQ,
                                     vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    ids, _ = batch(0)
    return CausalLM(transformers.GPT2LMHeadModel(config)).eval(), ids


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def targets():
    return batch(0)[1]


def batch(step):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1000 + step))
    return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)
