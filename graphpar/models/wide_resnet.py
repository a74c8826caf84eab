"""A Wide-ResNet (bottleneck ResNet whose 3x3 convs are widened) as in Alpa's benchmarks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphpar.models.common import init_weights, require, seeded


@dataclass(frozen=True)
class WideResNetConfig:
    """Sizes of a Wide-ResNet: stage i has stage_sizes[i] bottleneck blocks of
    base_channels * 2**i filters, the middle 3x3 conv widened by width_factor (Alpa's WResNet).
    """

    image_size: int = 16
    in_channels: int = 3
    num_classes: int = 10
    base_channels: int = 16
    width_factor: int = 2
    stage_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        require(len(self.stage_sizes) >= 1, "WideResNet needs at least one stage")
        require(all(n >= 1 for n in self.stage_sizes), "WideResNet stage sizes must be >= 1")

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """(in_channels, filters, stride) of every bottleneck block, in order."""
        channels = self.base_channels
        for i, n_blocks in enumerate(self.stage_sizes):
            filters = self.base_channels * 2**i
            for j in range(n_blocks):
                yield channels, filters, 2 if i > 0 and j == 0 else 1
                channels = 4 * filters

    @property
    def out_channels(self) -> int:
        return 4 * self.base_channels * 2 ** (len(self.stage_sizes) - 1)


def _alpa(base_channels: int, width_factor: int, depth: int = 50) -> WideResNetConfig:
    # Alpa's WResNet benchmark: ResNet-50/101 layout, 224x224 images, 1024 classes.
    stages = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth]
    return WideResNetConfig(
        image_size=224,
        num_classes=1024,
        base_channels=base_channels,
        width_factor=width_factor,
        stage_sizes=stages,
    )


PRESETS: dict[str, WideResNetConfig] = {
    "tiny": WideResNetConfig(),
    "250M": _alpa(160, 2),
    "500M": _alpa(224, 2),
    "1B": _alpa(320, 2),
    "2B": _alpa(448, 2),
    "4B": _alpa(640, 2),
    "6.8B": _alpa(320, 16),
    "13B": _alpa(320, 16, depth=101),
}


class Bottleneck(nn.Module):
    """1x1 conv -> widened 3x3 conv (strided) -> 1x1 conv to 4x filters, plus the shortcut."""

    def __init__(self, in_channels: int, filters: int, width_factor: int, stride: int) -> None:
        super().__init__()
        wide, out = filters * width_factor, 4 * filters
        self.conv1 = nn.Conv2d(in_channels, filters, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(filters)
        self.conv2 = nn.Conv2d(filters, wide, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(wide)
        self.conv3 = nn.Conv2d(wide, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(self.shortcut(x) + y)


class WideResNet(nn.Module):
    """Images [B, C, H, W] -> class logits [B, num_classes]."""

    def __init__(self, config: WideResNetConfig) -> None:
        super().__init__()
        c = config.base_channels
        # The ImageNet stem: 7x7 stride-2 conv and a 3x3 stride-2 max pool.
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, c, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        self.blocks = nn.Sequential(
            *(Bottleneck(i, f, config.width_factor, s) for i, f, s in config.blocks())
        )
        self.fc = nn.Linear(config.out_channels, config.num_classes)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def build(config: WideResNetConfig, seed: int = 0) -> WideResNet:
    """A Wide-ResNet with weights (and BatchNorm statistics) drawn from `seed`."""
    with seeded(seed):
        return WideResNet(config)


def example_batch(
    config: WideResNetConfig, batch_size: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Inputs (images [B, C, H, W],) and targets (class labels [B],)."""
    size = (batch_size, config.in_channels, config.image_size, config.image_size)
    images = torch.randn(size, generator=generator)
    labels = torch.randint(0, config.num_classes, (batch_size,), generator=generator)
    return (images,), (labels,)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the class logits."""
    return F.cross_entropy(logits, labels)


def param_count(config: WideResNetConfig) -> int:
    """Number of parameters build(config) would have, computed without building it."""
    c = config.base_channels
    total = config.in_channels * 49 * c + 2 * c
    for in_ch, filters, stride in config.blocks():
        wide, out = filters * config.width_factor, 4 * filters
        total += in_ch * filters + 2 * filters
        total += 9 * filters * wide + 2 * wide
        total += wide * out + 2 * out
        if stride != 1 or in_ch != out:
            total += in_ch * out + 2 * out
    return total + config.out_channels * config.num_classes + config.num_classes
