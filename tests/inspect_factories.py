"""Factories for ``graphddp inspect package.module:factory`` tests (imported by the CLI, not collected)."""

import torch
from torch import nn


def small_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, (torch.randn(4, 8),)


def raising():
    raise ValueError("the factory is broken")


def frozen():
    return nn.Linear(4, 4).requires_grad_(False), torch.randn(2, 4)


def not_a_pair():
    return nn.Linear(4, 4)
