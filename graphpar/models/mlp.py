"""A multi-layer perceptron regressed onto random targets: the smallest example model."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.models.common import init_weights, require, seeded

ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of an MLP; n_layers counts the Linear layers (an activation sits between each)."""

    in_dim: int = 32
    hidden_dim: int = 64
    out_dim: int = 16
    n_layers: int = 3
    activation: str = "gelu"

    def __post_init__(self) -> None:
        require(self.n_layers >= 1, f"MLP n_layers must be >= 1, got {self.n_layers}")
        require(
            self.activation in ACTIVATIONS,
            f"MLP activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}",
        )

    def dims(self) -> list[int]:
        """Feature sizes from input to output: n_layers + 1 entries."""
        return [self.in_dim] + [self.hidden_dim] * (self.n_layers - 1) + [self.out_dim]


PRESETS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(),
    # Eight 8192x8192 layers, ~537M parameters: big enough that sharding it pays.
    "large": MLPConfig(in_dim=8192, hidden_dim=8192, out_dim=8192, n_layers=8),
}


class MLP(nn.Module):
    """Linear -> activation -> ... -> Linear; no activation after the last layer."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        dims = config.dims()
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(pairwise(dims)):
            layers.append(nn.Linear(d_in, d_out))
            if i < config.n_layers - 1:
                layers.append(ACTIVATIONS[config.activation]())
        self.layers = nn.Sequential(*layers)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build(config: MLPConfig, seed: int = 0) -> MLP:
    """An MLP with weights drawn from `seed`."""
    with seeded(seed):
        return MLP(config)


def example_batch(
    config: MLPConfig, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs (x [B, in_dim],) and targets (y [B, out_dim],), both standard normal."""
    x = torch.randn(batch_size, config.in_dim, generator=generator)
    y = torch.randn(batch_size, config.out_dim, generator=generator)
    return (x,), (y,)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error against the target."""
    return F.mse_loss(output, target)


def param_count(config: MLPConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    dims = config.dims()
    return sum(a * b + b for a, b in pairwise(dims))
