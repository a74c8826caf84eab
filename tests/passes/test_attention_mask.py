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
