"""Construction on spawned gloo ranks: rank 0's parameters and buffers reach every rank in few coalesced
collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from torch import nn

import graphddp


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(10)])
        self.bn = nn.BatchNorm1d(16)  # float buffers and an int64 one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.layers(x))


def construct_from_different_states(rank: int, world: int) -> tuple[int, int]:
    torch.manual_seed(rank)  # every rank starts from different values
    model = Deep()
    model.bn.running_mean.fill_(rank)
    calls = []
    original = dist.broadcast
    try:
        dist.broadcast = lambda *a, **k: calls.append(a[0].numel()) or original(*a, **k)
        graphddp.DDP(model)
    finally:
        dist.broadcast = original
    torch.manual_seed(0)
    expected = Deep()
    torch.testing.assert_close(model.state_dict(), {**expected.state_dict(), "bn.running_mean": torch.zeros(16)})
    return len(calls), len(list(model.parameters())) + len(list(model.buffers()))


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_state_is_broadcast_in_few_coalesced_collectives(world: int) -> None:
    for collectives, tensors in run_on_ranks(construct_from_different_states, world):
        assert tensors == 25 and collectives == 2  # one per dtype (float32, int64), not one per tensor
