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


class TiedAcrossBreak(nn.Module):
    """An embedding tied to the output layer, with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(32, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, idx):
        h = self.mid(self.wte(idx))
        torch._dynamo.graph_break()
        return (h @ self.wte.weight.t()).sum()


def tied_across_break():
    return TiedAcrossBreak(), (torch.randint(0, 32, (2, 5)),)


def wide_tied_gpt():
    """A tied GPT whose table has 512 rows and 64 lookups per batch: row-sparse for up to 4 ranks."""
    from graphddp.tools.workloads import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=16, n_layer=2, n_head=2, n_embd=32))
    g = torch.Generator().manual_seed(0)
    return model, (torch.randint(0, 512, (4, 16), generator=g), torch.randint(0, 512, (4, 16), generator=g))


class UntiedBag(nn.Module):
    """An untied embedding table (512 x 16) looked up 32 times a batch, and a linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(512, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1)).sum()


def untied_bag():
    torch.manual_seed(0)
    return UntiedBag(), (torch.randint(0, 512, (4, 8), generator=torch.Generator().manual_seed(0)),)
