"""A BERT-style encoder with a masked-LM head and, optionally, the pooler and NSP head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.models.common import TransformerConfig, init_weights, lm_loss, seeded
from graphpar.models.layers import FeedForward, SelfAttention, attention_params, feed_forward_params


@dataclass(frozen=True)
class BertConfig(TransformerConfig):
    """Sizes of a BERT (see TransformerConfig).

    With pooler=True the model also returns next-sentence logits from the [CLS] position, and
    the loss adds their cross entropy against a second label tensor.
    """

    family: ClassVar[str] = "BERT"
    norm_eps: float = 1e-12
    type_vocab_size: int = 2
    pooler: bool = False


PRESETS: dict[str, BertConfig] = {
    "tiny": BertConfig(),
    "base": BertConfig(
        vocab_size=30522, seq_len=512, d_model=768, n_layers=12, n_heads=12, pooler=True
    ),
    "large": BertConfig(
        vocab_size=30522, seq_len=512, d_model=1024, n_layers=24, n_heads=16, pooler=True
    ),
}


class Layer(nn.Module):
    """Post-LN encoder layer: ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn = SelfAttention(d, config.n_heads, causal=False)
        self.ln1 = nn.LayerNorm(d, eps=config.norm_eps)
        self.mlp = FeedForward(d, config.mlp_ratio * d)
        self.ln2 = nn.LayerNorm(d, eps=config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    """(token ids [B, S], token types [B, S]) -> MLM logits [B, S, vocab] (, NSP logits [B, 2])."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, d)
        self.pos_emb = nn.Embedding(config.seq_len, d)
        self.type_emb = nn.Embedding(config.type_vocab_size, d)
        self.emb_ln = nn.LayerNorm(d, eps=config.norm_eps)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layers))
        # Masked-LM head: transform (dense, GELU, LayerNorm), then an untied decoder.
        self.mlm_dense = nn.Linear(d, d)
        self.mlm_ln = nn.LayerNorm(d, eps=config.norm_eps)
        self.mlm_decoder = nn.Linear(d, config.vocab_size)
        if config.pooler:
            self.pooler = nn.Linear(d, d)
            self.nsp_head = nn.Linear(d, 2)
        init_weights(self)

    def forward(
        self, idx: torch.Tensor, token_types: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        s = idx.shape[1]
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's {self.config.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb.weight[:s] + self.type_emb(token_types)
        x = self.emb_ln(x)
        for layer in self.layers:
            x = layer(x)
        mlm_logits = self.mlm_decoder(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        if not self.config.pooler:
            return mlm_logits
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return mlm_logits, self.nsp_head(pooled)


def build(config: BertConfig, seed: int = 0) -> Bert:
    """A BERT with weights drawn from `seed`."""
    with seeded(seed):
        return Bert(config)


def example_batch(
    config: BertConfig, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs (token ids, token types) and targets (MLM labels [B, S] (, NSP labels [B])).

    Token types mark a sentence pair: 0 for the first half of the sequence, 1 for the rest.
    MLM labels are random tokens for every position (no masking: the compute is the same).
    """
    b, s = batch_size, config.seq_len
    ids = torch.randint(0, config.vocab_size, (b, s), generator=generator)
    types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
    labels = torch.randint(0, config.vocab_size, (b, s), generator=generator)
    if not config.pooler:
        return (ids, types), (labels,)
    return (ids, types), (labels, torch.randint(0, 2, (b,), generator=generator))


def loss_fn(
    output: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    mlm_labels: torch.Tensor,
    nsp_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked-LM cross entropy over every position, plus NSP cross entropy with the pooler."""
    if nsp_labels is None:
        return lm_loss(output, mlm_labels)
    mlm_logits, nsp_logits = output
    return lm_loss(mlm_logits, mlm_labels) + F.cross_entropy(nsp_logits, nsp_labels)


def param_count(config: BertConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    d, v = config.d_model, config.vocab_size
    embeddings = (v + config.seq_len + config.type_vocab_size) * d + 2 * d
    layer = attention_params(d) + feed_forward_params(d, config.mlp_ratio * d) + 2 * (2 * d)
    mlm_head = d * d + d + 2 * d + d * v + v
    pooler = (d * d + d) + (2 * d + 2) if config.pooler else 0
    return embeddings + config.n_layers * layer + mlm_head + pooler
