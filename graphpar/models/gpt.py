"""A GPT-2-style decoder-only language model with presets from Alpa's GPT-3 table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from graphpar.models.common import (
    TransformerConfig,
    init_weights,
    lm_loss,
    seeded,
    token_batch,
)
from graphpar.models.layers import (
    FeedForward,
    PreLNBlock,
    attention_params,
    feed_forward_params,
)


@dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """Sizes of a GPT (see TransformerConfig)."""

    family: ClassVar[str] = "GPT"
    # Tied: the LM head reuses the token embedding (GPT-2, and how Alpa's names count).
    tie_embeddings: bool = False


def _alpa(n_layers: int, d_model: int, n_heads: int) -> GPTConfig:
    # Alpa's benchmark suite (and Megatron's GPT-3 runs) use vocab 51200 and 1024 positions.
    return GPTConfig(
        vocab_size=51200, seq_len=1024, d_model=d_model, n_layers=n_layers, n_heads=n_heads
    )


# Named by parameter count with a tied embedding, as in Alpa's table; untied adds vocab * d_model.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "125M": _alpa(12, 768, 12),
    "350M": _alpa(24, 1024, 16),
    "760M": _alpa(24, 1536, 16),
    "1.3B": _alpa(24, 2048, 32),
    "2.6B": _alpa(32, 2560, 32),
    "6.7B": _alpa(32, 4096, 32),
    "15B": _alpa(48, 5120, 40),
    "39B": _alpa(48, 8192, 64),
    "76B": _alpa(60, 10240, 80),
    "175B": _alpa(96, 12288, 96),
}


class DecoderLM(nn.Module):
    """Token ids [B, S] -> next-token logits [B, S, vocab]: token and learned position
    embeddings, the blocks `make_blocks()` returns, a final LayerNorm and an LM head. GPT and the
    MoE LM are this frame with their own blocks."""

    def __init__(self, config: TransformerConfig,
                 make_blocks: Callable[[], Iterable[nn.Module]]) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(config.seq_len, d)
        self.blocks = nn.ModuleList(make_blocks())
        self.ln_f = nn.LayerNorm(d, eps=config.norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        init_weights(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's {self.config.seq_len}")
        # Slicing the position table (rather than embedding an arange) keeps it one static slice.
        x = self.tok_emb(idx) + self.pos_emb.weight[:s]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPT(DecoderLM):
    """A GPT-2-style decoder: pre-LN blocks of attention and a GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        d = config.d_model
        super().__init__(config, lambda: (
            PreLNBlock(d, config.n_heads, FeedForward(d, config.mlp_ratio * d), config.norm_eps)
            for _ in range(config.n_layers)))
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    # What graphpar's serving capture drives (graphpar.capture.decoder.PositionsAdapter).
    decoder_family = "gpt"

    @property
    def max_model_len(self) -> int:
        return self.config.seq_len

    def forward_positions(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of tokens at explicit positions (a learned position table), only at
        `logits_indices` along the sequence when given."""
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        if logits_indices is not None:
            x = x[:, logits_indices]
        return self.lm_head(self.ln_f(x))


def build(config: GPTConfig, seed: int = 0) -> GPT:
    """A GPT with weights drawn from `seed`."""
    with seeded(seed):
        return GPT(config)


def example_batch(
    config: GPTConfig, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs (token ids [B, S],) and targets (the next token at each position [B, S],)."""
    ids, labels = token_batch(config.vocab_size, batch_size, config.seq_len, generator)
    return (ids,), (labels,)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy averaged over every position."""
    return lm_loss(logits, labels)


def param_count(config: GPTConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    d, v = config.d_model, config.vocab_size
    block = 2 * (2 * d) + attention_params(d) + feed_forward_params(d, config.mlp_ratio * d)
    head = 0 if config.tie_embeddings else v * d
    return v * d + config.seq_len * d + config.n_layers * block + 2 * d + head
