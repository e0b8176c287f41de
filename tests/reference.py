"""Plain-torch reference training, to check paramserver's numbers against."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(seed: int = 0, sizes=(784, 64, 32, 10)) -> nn.Module:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batches(steps: int, batch: int = 16, features: int = 784, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, features, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def train(model: nn.Module, opt, data, scheduler=None) -> None:
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_relative_error(a: nn.Module, b: nn.Module) -> float:
    """Largest ||a - b|| / ||b|| over the parameters."""
    return max(((pa - pb).norm() / pb.norm()).item() for pa, pb in zip(a.parameters(), b.parameters()))


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
