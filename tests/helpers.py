"""Small models and data shared by the tests: seeded, generated, a few milliseconds a step.

Import as `from helpers import tiny_convnet, separable_loader` (pytest puts tests/ on the path).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def tiny_convnet(classes: int = 2, width: int = 8, *, batchnorm: bool = False, seed: int | None = 0) -> nn.Sequential:
    """conv3x3 (+ BatchNorm) + ReLU, global average pool, linear head: the smallest image classifier
    with every layer kind the library rewrites (conv, norm, activation, pooling, linear)."""
    if seed is not None:
        torch.manual_seed(seed)
    norm = [nn.BatchNorm2d(width)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), *norm, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, classes))


def two_stage_convnet(classes: int = 4, seed: int | None = 0) -> nn.Sequential:
    """Two conv + BatchNorm + ReLU stages (the second strided), pooled, linear head: enough depth for
    fusion, quantization and pruning to have something to do. In eval mode."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes)).eval()


def separable_images(n: int = 256, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 3, size, size) noise images and labels a small net can learn: 1 where channel 0's mean > 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    return x, (x[:, 0].mean((1, 2)) > 0).long()


def separable_loader(n: int = 256, batch: int = 32, *, size: int = 8, seed: int = 0, shuffle: bool = False,
                     device: str | torch.device = "cpu") -> DataLoader:
    """A DataLoader over `separable_images` (shuffled by its own seeded generator when asked)."""
    x, y = separable_images(n, size, seed)
    return DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed) if shuffle else None)
