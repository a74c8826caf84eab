"""Attention written out as ops (`graphpar.passes.eager_attention`) and its causality read off
what is added to q @ k^T (`attention_mask.scores_reach`), on small captured modules written as
Hugging Face's eager attentions are: a scale, an additive or selected mask, ALiBi, soft-capping
(Gemma-2), sink columns (GPT-OSS), a mask kept as a buffer (GPT-Neo). `slice-tokens` accepts
the causal ones and refuses, naming the softmax, one that is not."""

import pytest
import torch

from graphpar.capture import capture_inference
from graphpar.errors import PassError
from graphpar.passes.attention_mask import scores_reaches
from graphpar.passes.eager_attention import eager_attention
from graphpar.passes.pipeline.slice_tokens import causal_attention

SEQ, HEADS, DIM = 6, 2, 4
LOWEST = torch.finfo(torch.float32).min


def causal_additive(scores, ids):
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return scores + torch.where(causal, 0.0, LOWEST)


def alibi_masked_fill(scores, ids):  # MPT: ALiBi added, the mask filled in with the lowest
    slopes = torch.tensor([0.5, 0.25])[:, None, None]
    alibi = slopes * torch.arange(1 - SEQ, 1)[None, None, :]
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    return (scores + alibi).masked_fill(future, LOWEST)


def softcapped(scores, ids):  # Gemma-2: tanh soft-capping before the mask
    return causal_additive(torch.tanh(scores / 50.0) * 50.0, ids)


def bidirectional_padding(scores, ids):  # BERT: only padding from the input
    return scores + torch.where(ids != 0, 0.0, LOWEST)[:, None, None, :]


def one_ahead(scores, ids):
    near = torch.ones(SEQ, SEQ, dtype=torch.bool).tril(1)
    return scores + torch.where(near, 0.0, LOWEST)


class Eager(torch.nn.Module):
    """q @ k^T * scale, masked by `mask_of`, softmax (with sinks), @ v, as eager attention."""

    def __init__(self, mask_of, sinks=False):
        super().__init__()
        self.mask_of, self.sinks = mask_of, sinks
        self.embed = torch.nn.Embedding(8, HEADS * DIM)
        self.router = torch.nn.Linear(HEADS * DIM, 4)  # a softmax that is not attention
        self.sink = torch.nn.Parameter(torch.zeros(HEADS))

    def forward(self, ids):
        x = self.embed(ids).view(ids.shape[0], SEQ, HEADS, DIM).transpose(1, 2)
        logits = self.mask_of(torch.matmul(x, x.transpose(2, 3)) * DIM ** -0.5, ids)
        if self.sinks:
            sink = self.sink.reshape(1, -1, 1, 1).expand(ids.shape[0], -1, SEQ, -1)
            logits = torch.cat([logits, sink], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = torch.softmax(logits, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, x).transpose(1, 2).reshape(ids.shape[0], SEQ, -1)
        return out + torch.softmax(self.router(out), dim=-1).sum(-1, keepdim=True)


class BufferMask(torch.nn.Module):
    """GPT-Neo: the causal mask a buffer, the masked value a lifted tensor constant."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, HEADS * DIM)
        self.register_buffer("bias", torch.ones(SEQ, SEQ, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, ids):
        x = self.embed(ids).view(ids.shape[0], SEQ, HEADS, DIM).transpose(1, 2)
        scores = torch.matmul(x, x.transpose(-1, -2))
        scores = torch.where(self.bias, scores, torch.tensor(LOWEST))
        return torch.matmul(torch.softmax(scores, dim=-1), x)


def captured(module):
    ids = torch.randint(1, 8, (2, SEQ), generator=torch.Generator().manual_seed(0))
    cap = capture_inference(module, (ids,), name="eager")
    torch.testing.assert_close(cap.run(ids)[0], module(ids))  # the graph is the module's
    return cap


def reach(module):
    cap = captured(module)
    (site,) = eager_attention(cap.graph)  # the router's softmax is not attention
    assert site.shape == (2, HEADS, SEQ, DIM)
    assert site.logits.type.shape[-1] == SEQ  # the sink column is not a key
    return scores_reaches(cap.graph, [(site.logits, site.scores)], cap.state)[0]


@pytest.mark.parametrize("mask_of, sinks", [
    (causal_additive, False), (alibi_masked_fill, False), (softcapped, False),
    (causal_additive, True)])
def test_causal_eager_attention_is_recognised(mask_of, sinks):
    got = reach(Eager(mask_of, sinks))
    assert got.causal and got.why == ""


@pytest.mark.parametrize("mask_of, why", [
    (bidirectional_padding, "query 0 may attend to the later key 1"),
    (one_ahead, "query 0 may attend to the later key 1")])
def test_eager_attention_that_reads_later_keys_is_not_causal(mask_of, why):
    got = reach(Eager(mask_of))
    assert not got.causal and got.why == why


def test_a_mask_kept_in_a_buffer_is_read_from_the_constants():
    cap = captured(BufferMask())
    (site,) = eager_attention(cap.graph)
    pair = [(site.logits, site.scores)]
    assert scores_reaches(cap.graph, pair, cap.state)[0].causal
    # without the buffer's value the mask could hold anything: not known to be causal
    assert not scores_reaches(cap.graph, pair)[0].causal


def test_slice_tokens_refuses_non_causal_eager_attention_naming_the_softmax():
    cap = captured(Eager(bidirectional_padding))
    with pytest.raises(PassError, match=r"node \d+ \(softmax\) .*is not causal \(query 0 may "
                                        r"attend to the later key 1\)"):
        causal_attention(cap.graph, cap.state)
    (site,) = causal_attention(captured(Eager(softcapped)).graph)
    assert site.node.op == "softmax" and site.shape == (2, HEADS, SEQ, DIM)
