"""Model internals: GShard top-2 routing, the MoE layer against a per-token loop, and RoPE."""

import pytest
import torch

import graphpar.models as models
from graphpar.models import llama, moe
from graphpar.models.common import seeded


def routing(groups: int = 3, tokens: int = 16, experts: int = 4, capacity: int = 5):
    logits = torch.randn(groups, tokens, experts, generator=torch.Generator().manual_seed(0))
    combine, dispatch = moe.top2_gating(logits, capacity)
    return logits, combine, dispatch


def test_routing_respects_capacity_and_top2():
    logits, combine, dispatch = routing()
    assert combine.shape == dispatch.shape == (3, 16, 4, 5)
    assert set(dispatch.unique().tolist()) <= {0.0, 1.0}
    # Each (expert, slot) holds at most one token; each token goes to at most two experts.
    assert dispatch.sum(dim=1).max() <= 1
    assert dispatch.sum(dim=(2, 3)).max() <= 2
    # Every kept choice is one of the token's two largest gates.
    top2 = logits.topk(2, dim=-1).indices
    chosen = dispatch.sum(dim=-1).nonzero()
    for g, s, e in chosen.tolist():
        assert e in top2[g, s].tolist()
    # Combine weights live where dispatch does, and a token's kept weights sum to 1.
    assert torch.equal(combine > 0, dispatch > 0)
    kept = dispatch.sum(dim=(2, 3)) > 0
    torch.testing.assert_close(combine.sum(dim=(2, 3))[kept], torch.ones(int(kept.sum())))


def test_routing_fills_slots_in_token_order_first_choices_first():
    _, _, dispatch = routing(groups=1, capacity=16)
    # With room for everyone, no choice is dropped and each expert's slots fill from 0 up.
    assert dispatch.sum() == 2 * 16
    used = dispatch.sum(dim=1)[0]  # [E, C]
    for e in range(used.shape[0]):
        n = int(used[e].sum())
        assert torch.equal(used[e, :n], torch.ones(n))


def test_moe_layer_equals_a_per_token_loop_when_nothing_is_dropped():
    d, hidden, experts, group = 8, 16, 4, 6
    with seeded(0):
        layer = moe.MoELayer(d, hidden, experts, group_size=group, capacity=group)
        x = torch.randn(2, 3, d)
    gates = layer.router(x).softmax(dim=-1)
    weights, chosen = gates.topk(2, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    expected = torch.zeros_like(x)
    for b in range(2):
        for s in range(3):
            for k in range(2):
                e = chosen[b, s, k]
                h = layer.act(x[b, s] @ layer.w_in[e]) @ layer.w_out[e]
                expected[b, s] += weights[b, s, k] * h
    torch.testing.assert_close(layer(x), expected)


def test_moe_group_size_must_divide_the_tokens():
    spec = models.get_model("moe")
    with pytest.raises(ValueError, match="not a multiple of the group size 32"):
        spec.module(spec.inputs[0][:1, :7])


def test_rope_scores_depend_only_on_relative_position():
    config = models.get_config("llama")
    cos, sin = llama.rope_tables(config)
    q, k = torch.randn(2, config.head_dim, generator=torch.Generator().manual_seed(0))

    def rotate(x: torch.Tensor, pos: int) -> torch.Tensor:
        return x * cos[pos] + llama.rotate_half(x) * sin[pos]

    near = rotate(q, 5) @ rotate(k, 2)
    far = rotate(q, 25) @ rotate(k, 22)
    torch.testing.assert_close(near, far)
    torch.testing.assert_close(rotate(q, 7).norm(), q.norm())
