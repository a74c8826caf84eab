"""A model file in graphpar's convention: `graphpar compile examples/tiny_mlp.py`."""

import torch
import torch.nn.functional as F
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 64, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def build():
    torch.manual_seed(0)
    return TinyMLP(), (torch.randn(8, 16),)


# Only needed for --mode train.
def loss(output, target):
    return F.mse_loss(output, target)


def targets():
    return (torch.randn(8, 4),)
