"""A two-layer MLP wide enough that auto-shard splits it on a 2x2 mesh of the cpu cluster:
the export tests' model (it compiles and runs in seconds)."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int = 128, hidden: int = 512):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def build():
    torch.manual_seed(0)
    return MLP(), (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)),)


def loss(output, target):
    return F.mse_loss(output, target)


def targets():
    return (torch.randn(64, 128, generator=torch.Generator().manual_seed(2)),)
