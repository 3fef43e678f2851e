"""``join()`` on spawned gloo ranks: early termination raises on every rank."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from models import MLP
from ranks import expect_failure_on_every_rank
from training import CAPS, Case, batch_for

import graphddp


def join_throws_early(rank: int, world: int) -> None:
    ddp = graphddp.DDP(MLP(), **CAPS)
    with ddp.join(throw_on_early_termination=True):
        for step in range(2 + rank):
            x, y = batch_for(Case(), step, 0, rank)
            F.mse_loss(ddp(x), y).backward()


@pytest.mark.parametrize("world", [2, 3])
def test_join_throw_on_early_termination_raises_on_every_rank(world: int) -> None:
    errors = expect_failure_on_every_rank(join_throws_early, world, timeout=60)
    assert "Rank 0 exhausted all inputs" in errors[0]
    for rank in range(1, world):
        assert "Detected at least one rank that exhausted inputs" in errors[rank]
