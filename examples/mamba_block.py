"""A Mamba-style block in plain torch: an input projection into two branches, a depthwise
causal 1-D convolution, the selective state-space scan (input-dependent step, B and C) as a
loop over the sequence, a SiLU gate and the output projection, as in Mamba's reference
implementation: `graphpar compile examples/mamba_block.py --mode train --mesh 2 --run-cpu 2`."""

import torch
import torch.nn.functional as F
from torch import nn


class MambaBlock(nn.Module):
    def __init__(self, dim=16, state=4, conv=4, expand=2):
        super().__init__()
        inner = expand * dim
        self.rank = max(1, dim // 16)  # the step's low-rank projection
        self.in_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1)
        self.x_proj = nn.Linear(inner, self.rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(self.rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1.0)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, dim, bias=False)
        self.norm = nn.RMSNorm(dim)

    def forward(self, x):  # [B, L, dim]
        length = x.shape[1]
        u, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        # causal: pad both sides by conv-1 and keep the first L outputs
        u = F.silu(self.conv(u.transpose(1, 2))[..., :length]).transpose(1, 2)  # [B, L, inner]
        dt, B, C = self.x_proj(u).split([self.rank, self.A_log.shape[1], self.A_log.shape[1]],
                                        dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # [B, L, inner]
        A = -torch.exp(self.A_log)  # [inner, state]
        h = x.new_zeros(x.shape[0], u.shape[2], A.shape[1])
        ys = []
        for t in range(length):  # the selective scan, one step at a time
            h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t, :, None] * B[:, t, None, :]
                                                        * u[:, t, :, None])
            ys.append((h * C[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + u * self.D
        return x + self.out_proj(y * F.silu(z))


class MambaLM(nn.Module):
    """Token embedding, two Mamba blocks, a norm and the LM head."""

    def __init__(self, vocab=64, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MambaBlock(dim) for _ in range(2))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


def build():
    torch.manual_seed(0)
    return MambaLM(), (tokens(),)


def loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def targets():
    return (torch.roll(tokens(), -1, 1),)
