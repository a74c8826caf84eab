"""A LLaMA-style decoder: RMSNorm, rotary positions, SwiGLU and grouped-query attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.models.common import init_weights, lm_loss, require, seeded, token_batch


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a LLaMA; seq_len is the rotary table length and the example length."""

    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        require(
            self.d_model % self.n_heads == 0,
            f"LLaMA d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"LLaMA n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})",
        )
        require(self.head_dim % 2 == 0, f"LLaMA head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Real model shapes; seq_len is shortened to 2048 so that example batches stay affordable.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    # Llama-2-7B: multi-head attention (n_kv_heads == n_heads), 6.74e9 parameters.
    "7B": LlamaConfig(
        vocab_size=32000,
        seq_len=2048,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
    ),
    # Llama-3-8B: grouped-query attention with 8 KV heads, 8.03e9 parameters.
    "8B": LlamaConfig(
        vocab_size=128256,
        seq_len=2048,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=500000.0,
    ),
    # Llama-2-70B: 80 layers, 8 KV heads, 6.90e10 parameters.
    "70B": LlamaConfig(
        vocab_size=32000,
        seq_len=2048,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
    ),
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim: the rotate-half form of RoPE."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings on q and k."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        d = config.d_model
        self.wq = nn.Linear(d, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # enable_gqa: SDPA shares each KV head among n_heads / n_kv_heads query heads.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, ffn_dim, bias=False)
        self.up = nn.Linear(d_model, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # nn.RMSNorm calls F.rms_norm, which torch.export keeps as one aten.rms_norm op.
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token ids [B, S] -> next-token logits [B, S, vocab]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        # Non-persistent: derived from the config, so not part of the state_dict.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's {self.config.seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    # What graphpar's serving capture drives (graphpar.capture.decoder.PositionsAdapter).
    decoder_family = "llama"

    @property
    def max_model_len(self) -> int:
        return self.config.seq_len

    def forward_positions(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of tokens at explicit positions: rotary tables indexed by position, only at
        `logits_indices` along the sequence when given."""
        cos = self.rope_cos[positions].unsqueeze(1)  # [B, 1, S, head_dim]: broadcast over heads
        sin = self.rope_sin[positions].unsqueeze(1)
        x = self.tok_emb(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        if logits_indices is not None:
            x = x[:, logits_indices]
        return self.lm_head(self.norm(x))


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, [seq_len, head_dim], halves repeated for rotate-half."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    # float64 for the table itself: large positions times small frequencies lose bits in fp32.
    return angles.cos().float(), angles.sin().float()


def build(config: LlamaConfig, seed: int = 0) -> Llama:
    """A LLaMA with weights drawn from `seed`."""
    with seeded(seed):
        return Llama(config)


def example_batch(
    config: LlamaConfig, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs (token ids [B, S],) and targets (the next token at each position [B, S],)."""
    ids, labels = token_batch(config.vocab_size, batch_size, config.seq_len, generator)
    return (ids,), (labels,)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy averaged over every position."""
    return lm_loss(logits, labels)


def param_count(config: LlamaConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    d, hd = config.d_model, config.head_dim
    attn = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2
    block = 2 * d + attn + 3 * d * config.ffn_dim
    return 2 * config.vocab_size * d + config.n_layers * block + d
