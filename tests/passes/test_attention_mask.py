"""Causality read off attention masks (`graphpar.passes.attention_mask`): masks built from
positions as Hugging Face builds them (arange comparisons, tril, sliding windows, additive
masks), padding from an input and-ed in, and masks that let a query see a later key."""

import pytest
import torch
import torch.nn.functional as F

from graphpar.capture import capture_inference
from graphpar.passes.attention_mask import mask_reach

SEQ = 6


def positions_causal(ids):  # HF's sdpa_mask under export: kv_idx <= q_idx from two aranges
    q = torch.arange(SEQ)[None, None, :, None]
    k = torch.arange(SEQ)[None, None, None, :]
    return k <= q


def windowed(ids):  # Mistral: causal and kv_idx > q_idx - window
    q = torch.arange(SEQ)[None, None, :, None]
    k = torch.arange(SEQ)[None, None, None, :]
    return (k <= q) & (k > q - 3)


def tril(ids):
    return torch.ones(SEQ, SEQ, dtype=torch.bool).tril()


def additive(ids):  # a boolean mask made additive, as eager attention takes it
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return torch.where(causal, 0.0, torch.finfo(torch.float32).min)


def padded(ids):  # a padding mask from an input, and-ed with a causal part
    keep = (ids != 0)[:, None, None, :]
    return keep & positions_causal(ids)


def padding_inverted(ids):  # ~ on the input side: still only removes keys
    pad = (ids == 0)[:, None, None, :]
    return ~pad & positions_causal(ids)


def padding_added(ids):  # an additive padding mask from an input plus an additive causal one
    pad = torch.where(ids == 0, float("-inf"), 0.0)[:, None, None, :]
    return pad + additive(ids)


def bidirectional(ids):
    return torch.ones(SEQ, SEQ, dtype=torch.bool)


def one_ahead(ids):  # query i also sees key i + 1
    return torch.ones(SEQ, SEQ, dtype=torch.bool).tril(1)


def padding_alone(ids):
    return (ids != 0)[:, None, None, :]


def padding_or(ids):  # or-ing an input in can reopen later keys
    return (ids != 0)[:, None, None, :] | positions_causal(ids)


class Attend(torch.nn.Module):
    def __init__(self, mask_of):
        super().__init__()
        self.mask_of = mask_of
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, ids):
        x = self.embed(ids)[:, None]  # [B, 1, S, 8]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=self.mask_of(ids))


def reach(mask_of):
    ids = torch.randint(1, 8, (2, SEQ), generator=torch.Generator().manual_seed(0))
    module = Attend(mask_of)
    captured = capture_inference(module, (ids,), name=mask_of.__name__)
    (out,) = captured.run(ids)
    torch.testing.assert_close(out, module(ids))  # the graph is the module's
    (node,) = captured.graph.find("attention")
    assert len(node.inputs) == 4 and not node.attrs["causal"]  # causality is in the mask only
    return mask_reach(captured.graph, node)


@pytest.mark.parametrize("mask_of, window, plain", [
    (positions_causal, None, True), (tril, None, True), (additive, None, True),
    (windowed, 3, True), (padded, None, False), (padding_inverted, None, False),
    (padding_added, None, False)])
def test_masks_that_hide_every_later_key_are_causal(mask_of, window, plain):
    got = reach(mask_of)
    assert got.causal and got.window == window and got.why == ""
    assert got.plain == plain  # plain: what is_causal=True computes, whatever the inputs


@pytest.mark.parametrize("mask_of, why", [
    (bidirectional, "query 0 may attend to the later key 1"),
    (one_ahead, "query 0 may attend to the later key 1"),
    (padding_alone, "query 0 may attend to the later key 1"),
    (padding_or, "query 0 may attend to the later key 1")])
def test_masks_that_may_show_a_later_key_are_not(mask_of, why):
    got = reach(mask_of)
    assert not got.causal and not got.plain and got.why == why


class BufferMasked(Attend):  # GPT-Neo: the causal mask is a buffer made in __init__
    def __init__(self):
        super().__init__(None)
        self.register_buffer("bias", torch.ones(SEQ, SEQ, dtype=torch.bool).tril())

    def forward(self, ids):
        x = self.embed(ids)[:, None]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias)


def test_a_mask_buffer_is_read_when_it_has_values_and_named_when_it_has_none():
    from graphpar.passes.attention_mask import mask_reaches

    ids = torch.randint(1, 8, (2, SEQ), generator=torch.Generator().manual_seed(0))
    module = BufferMasked()
    graph = capture_inference(module, (ids,), name="buffer_masked").graph
    (node,) = graph.find("attention")
    (mask,) = [v for v in graph.inputs if v.name.endswith("bias")]
    assert mask_reaches(graph, [node], {mask.name: module.bias})[node].causal
    # built on meta to plan, the buffer has no values: the reason is said, and what to do
    got = mask_reaches(graph, [node], {mask.name: module.bias.to("meta")})[node]
    assert not got.causal
    assert got.why == (f"query 0 may attend to the later key 1, as far as its mask can be "
                       f"read: it reads %{mask.name}, which has no values in a planning-only "
                       "compile (the model is built on the meta device); compile with "
                       "--run-cpu N, which builds the model with its weights and buffers")
