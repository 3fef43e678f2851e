"""``no_sync()`` on spawned gloo ranks: gradients accumulate locally, the next backward synchronises."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp


def grads_with_and_without_sync(rank: int, world: int) -> list[bool]:
    ddp = graphddp.DDP(MLP(), **CAPS)
    same = []
    for sync in (False, True):
        with contextlib.nullcontext() if sync else ddp.no_sync():
            x, y = batch_for(Case(), 0, 0, rank)
            F.mse_loss(ddp(x), y).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(gathered, grads)
        same.append(all(torch.equal(g, gathered[0]) for g in gathered))
    return same


def test_no_sync_accumulates_locally_and_the_next_backward_synchronises() -> None:
    for same in run_on_ranks(grads_with_and_without_sync, 2):
        assert same == [False, True]
