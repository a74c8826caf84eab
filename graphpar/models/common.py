"""Shared helpers for the example models: seeding, weight init, token batches, LM loss."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.errors import UsageError

# Small enough that activations stay well scaled in fp32 through many layers (GPT-2's choice).
INIT_STD = 0.02


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed the CPU generator for the block and restore the caller's RNG state afterwards."""
    # devices=[]: never touch CUDA generators; models are initialised on the CPU (or meta).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """Give every parameter (and BatchNorm statistic) of the standard layers a seeded value.

    Biases, norm scales and running statistics get small random values rather than the usual
    0 / 1: a compiler that drops a bias or swaps a norm's scale and shift must change the output,
    or comparisons against eager PyTorch cannot catch it.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm2d)):
            if m.weight is not None:
                nn.init.normal_(m.weight, 1.0, std)
        else:
            continue
        bias = getattr(m, "bias", None)
        if bias is not None:
            nn.init.normal_(bias, 0.0, std)
        if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None:
            nn.init.normal_(m.running_mean, 0.0, 0.1)
            nn.init.uniform_(m.running_var, 0.5, 1.5)


def require(condition: bool, message: str) -> None:
    """Raise UsageError(message) unless condition holds; for config checks."""
    if not condition:
        raise UsageError(message)


@dataclass(frozen=True)
class TransformerConfig:
    """The sizes GPT, BERT and the MoE LM share; seq_len is both the number of learned positions
    and the example length. `family` names the model in errors."""

    family: ClassVar[str] = "transformer"
    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        require(
            self.d_model % self.n_heads == 0,
            f"{self.family} d_model ({self.d_model}) must be divisible by n_heads "
            f"({self.n_heads})",
        )


def token_batch(
    vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [B, S] and their next-token labels [B, S], from one [B, S+1] draw."""
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits [B, S, V] against labels [B, S] over every position."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
