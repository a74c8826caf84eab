"""A Stable-Diffusion-style UNet block in plain torch: a residual block conditioned on the
timestep (group norm, SiLU, 3x3 convolutions, a 1x1 shortcut), spatial self-attention over
the pixels, a strided-convolution downsample and a transposed-convolution upsample:
`graphpar compile examples/unet_block.py --mode train --mesh 2 --run-cpu 2`."""

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """Group norm, SiLU, conv; plus the timestep's embedding; again; plus the shortcut."""

    def __init__(self, channels, out_channels, time_dim, groups=4):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, out_channels, 3, padding=1)
        self.time = nn.Linear(time_dim, out_channels)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.shortcut = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(t))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.shortcut(x) + h


class SpatialAttention(nn.Module):
    """Self-attention over the H·W pixels as tokens, heads split from the channels."""

    def __init__(self, channels, heads=2, groups=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # [B, HW, C]
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, h * w, self.heads, c // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, c)
        return x + self.out(y).transpose(1, 2).reshape(b, c, h, w)


class UNetBlock(nn.Module):
    """Down (a resblock, attention, a stride-2 conv), middle, up (a transposed conv, a
    resblock over the skip concatenated), as one level of a diffusion UNet."""

    def __init__(self, channels=8, time_dim=16):
        super().__init__()
        self.down = ResBlock(channels, 16, time_dim)
        self.attn = SpatialAttention(16)
        self.downsample = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.mid = ResBlock(16, 16, time_dim)
        self.upsample = nn.ConvTranspose2d(16, 16, 4, stride=2, padding=1)
        self.up = ResBlock(32, channels, time_dim)

    def forward(self, x, t):
        skip = self.attn(self.down(x, t))
        h = self.mid(self.downsample(skip), t)
        return self.up(torch.cat([self.upsample(h), skip], dim=1), t)


def build():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    latents, time = torch.randn(4, 8, 8, 8, generator=gen), torch.randn(4, 16, generator=gen)
    return UNetBlock(), (latents, time)


def loss(pred, noise):
    return F.mse_loss(pred, noise)


def targets():
    return (torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(2)),)
