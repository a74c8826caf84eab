"""Transformer building blocks shared by the GPT, BERT and MoE example models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, SDPA over [B, H, S, D], output proj.

    The fused projection's rows are ordered head by head ([H, 3, D/H], Megatron-LM's layout), so
    splitting its output features across devices splits heads, and q, k, v stay together.
    """

    def __init__(self, d_model: int, n_heads: int, causal: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, self.n_heads, 3, d // self.n_heads)
        # [B, S, H, D/H] -> [B, H, S, D/H]: the head layout SDPA expects.
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    """The transformer MLP: Linear(d, r*d) -> GELU -> Linear(r*d, d)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class PreLNBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)); mlp is any [.., d] map."""

    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, eps: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = SelfAttention(d_model, n_heads, causal=True)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def attention_params(d_model: int) -> int:
    """Parameters of one SelfAttention (fused QKV and output projection, with biases)."""
    return d_model * 3 * d_model + 3 * d_model + d_model * d_model + d_model


def feed_forward_params(d_model: int, hidden: int) -> int:
    """Parameters of one FeedForward (two linears with biases)."""
    return d_model * hidden + hidden + hidden * d_model + d_model
