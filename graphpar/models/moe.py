"""A GShard-style top-2 mixture-of-experts layer with static shapes, and a small MoE LM."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import graphpar.models.gpt as gpt
from graphpar.models.common import INIT_STD, TransformerConfig, require, seeded
from graphpar.models.layers import (
    FeedForward,
    PreLNBlock,
    attention_params,
    feed_forward_params,
)


@dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    """Sizes of an MoE LM: a GPT whose every moe_every-th block (from block 0) uses experts.

    Tokens are routed in groups of expert_group_size (GShard's S); B * seq_len must be a
    multiple of it. Each expert takes at most `capacity` tokens per group; the rest of the
    tokens routed to it are dropped from that expert (they keep their residual path).
    """

    family: ClassVar[str] = "MoE"
    n_experts: int = 4
    moe_every: int = 2
    expert_group_size: int = 32
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.n_experts >= 2, f"top-2 gating needs n_experts >= 2, got {self.n_experts}")
        require(self.moe_every >= 1, f"MoE moe_every must be >= 1, got {self.moe_every}")
        require(self.expert_group_size >= 1, "MoE expert_group_size must be >= 1")

    @property
    def capacity(self) -> int:
        """Tokens each expert takes per group: capacity_factor times an even share of 2 picks."""
        return max(1, math.ceil(self.capacity_factor * 2 * self.expert_group_size / self.n_experts))

    def is_moe_layer(self, i: int) -> bool:
        return i % self.moe_every == 0


def _alpa(d_model: int, n_layers: int, n_experts: int) -> MoEConfig:
    # Alpa's MoE benchmark: 16 heads, vocab 32000, 8x MLPs, group size 2048, C = 2 * S / E.
    return MoEConfig(
        vocab_size=32000,
        seq_len=1024,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=16,
        mlp_ratio=8,
        n_experts=n_experts,
        expert_group_size=2048,
    )


# Alpa's table; the names count a tied embedding, so these (untied) run up to 8% larger.
PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(),
    "380M": _alpa(768, 8, 8),
    "690M": _alpa(768, 8, 16),
    "1.3B": _alpa(768, 16, 16),
    "2.4B": _alpa(1024, 16, 16),
    "10B": _alpa(1536, 16, 32),
    "27B": _alpa(2048, 16, 48),
    "70B": _alpa(2048, 32, 64),
    "140B": _alpa(2048, 32, 128),
}


def one_hot(index: torch.Tensor, n: int) -> torch.Tensor:
    """int64 one-hot of `index` over n classes, [..., n].

    Written as a comparison because F.one_hot range-checks its input with .item() when traced
    by make_fx on real tensors, which fails; this form traces the same in every mode.
    """
    return (index.unsqueeze(-1) == torch.arange(n, device=index.device)).long()


def top2_gating(logits: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GShard top-2 routing of router logits [G, S, E] into [G, S, E, C] tensors.

    Returns (combine, dispatch): dispatch[g, s, e, c] is 1 where token s of group g takes slot
    c of expert e; combine holds the token's (renormalised) gate weight there instead.
    """
    n_experts = logits.shape[-1]
    gates = logits.softmax(dim=-1)
    top_gates, top_idx = gates.topk(2, dim=-1)
    mask1 = one_hot(top_idx[..., 0], n_experts)
    mask2 = one_hot(top_idx[..., 1], n_experts)
    # A token's slot in its expert's buffer: earlier tokens first, all first choices before
    # any second choice. Choices that land past the capacity are dropped.
    pos1 = torch.cumsum(mask1, dim=1) - mask1
    mask1 = mask1 * (pos1 < capacity)
    pos2 = torch.cumsum(mask2, dim=1) - mask2 + mask1.sum(dim=1, keepdim=True)
    mask2 = mask2 * (pos2 < capacity)
    # Renormalise the kept gates; eps keeps a token whose choices were both dropped at 0.
    gate1 = top_gates[..., 0] * mask1.sum(dim=-1)
    gate2 = top_gates[..., 1] * mask2.sum(dim=-1)
    denom = (gate1 + gate2).clamp_min(torch.finfo(gates.dtype).eps)
    gate1, gate2 = gate1 / denom, gate2 / denom
    # Dropped choices have mask 0, so their slot index (0) never reaches the output.
    slot1 = one_hot((pos1 * mask1).sum(dim=-1), capacity)
    slot2 = one_hot((pos2 * mask2).sum(dim=-1), capacity)
    dispatch1 = (mask1.unsqueeze(-1) * slot1.unsqueeze(-2)).to(gates.dtype)
    dispatch2 = (mask2.unsqueeze(-1) * slot2.unsqueeze(-2)).to(gates.dtype)
    combine = gate1[..., None, None] * dispatch1 + gate2[..., None, None] * dispatch2
    return combine, dispatch1 + dispatch2


class MoELayer(nn.Module):
    """Position-wise top-2 MoE: route, dispatch by einsum, batched expert MLPs, combine."""

    def __init__(
        self, d_model: int, hidden: int, n_experts: int, group_size: int, capacity: int
    ) -> None:
        super().__init__()
        self.group_size = group_size
        self.capacity = capacity
        self.router = nn.Linear(d_model, n_experts, bias=False)
        # All experts' weights batched: [E, M, H] and [E, H, M], no biases (as in GShard).
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.act = nn.GELU()
        nn.init.normal_(self.w_in, 0.0, INIT_STD)
        nn.init.normal_(self.w_out, 0.0, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, m = x.shape
        if (b * s) % self.group_size:
            raise ValueError(
                f"MoE: batch * seq = {b * s} tokens is not a multiple of the group size "
                f"{self.group_size}"
            )
        groups = x.reshape(-1, self.group_size, m)
        combine, dispatch = top2_gating(self.router(groups), self.capacity)
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, groups)
        h = self.act(torch.einsum("egcm,emh->egch", expert_in, self.w_in))
        expert_out = torch.einsum("egch,ehm->egcm", h, self.w_out)
        return torch.einsum("gsec,egcm->gsm", combine, expert_out).reshape(b, s, m)


class MoELM(gpt.DecoderLM):
    """GPT's frame with MoE MLPs in every moe_every-th block."""

    def __init__(self, config: MoEConfig) -> None:
        d = config.d_model
        hidden = config.mlp_ratio * d
        super().__init__(config, lambda: (
            PreLNBlock(d, config.n_heads, mlp, config.norm_eps)
            for mlp in (
                MoELayer(d, hidden, config.n_experts, config.expert_group_size, config.capacity)
                if config.is_moe_layer(i)
                else FeedForward(d, hidden)
                for i in range(config.n_layers)
            )))


def build(config: MoEConfig, seed: int = 0) -> MoELM:
    """An MoE LM with weights drawn from `seed`."""
    with seeded(seed):
        return MoELM(config)


# Batches and loss are a language model's, as for GPT (no load-balancing loss).
example_batch = gpt.example_batch
loss_fn = gpt.loss_fn


def param_count(config: MoEConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    d, v, e = config.d_model, config.vocab_size, config.n_experts
    hidden = config.mlp_ratio * d
    shared = 2 * (2 * d) + attention_params(d)
    dense = shared + feed_forward_params(d, hidden)
    moe = shared + d * e + 2 * e * d * hidden
    n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    blocks = n_moe * moe + (config.n_layers - n_moe) * dense
    return v * d + config.seq_len * d + blocks + 2 * d + v * d
