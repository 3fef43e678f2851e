"""A forward through the wrapper on some ranks only (issue 26, item 7): after a training forward it broadcasts the
module's buffers (BatchNorm's), which the other ranks receive at another forward. The count of training forwards
travels with the buffers; every rank warns once (Note [Plan agreement]); an evaluation on every rank alike, the
documented ``ddp.module(x)`` on one rank, and plain training warn nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import WithBatchNorm
from ranks import run_on_ranks
from training import graphddp_warnings

import graphddp


def train_with_a_log(rank: int, world: int, how: str) -> list[str]:
    """Six steps of a BatchNorm model; after step 2 an evaluation forward ``how``; the warnings this rank logged."""
    with graphddp_warnings() as warned:
        torch.manual_seed(0)
        ddp = graphddp.DDP(WithBatchNorm(), bucket_cap_mb=0.002)
        g = torch.Generator().manual_seed(rank)
        for step in range(6):
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
            F.mse_loss(ddp(x), y).backward()
            if step == 2 and how != "none" and (how == "every rank" or rank == 0):
                ddp.eval()
                with torch.no_grad():
                    (ddp.module if how == "module on rank 0" else ddp)(x)
                ddp.train()
    return [m for m in warned if "buffers broadcast from another forward" in m]


def test_a_forward_through_the_wrapper_on_one_rank_is_named_on_every_rank_once() -> None:
    for rank, warned in enumerate(run_on_ranks(train_with_a_log, 2, "wrapper on rank 0", timeout=120)):
        assert len(warned) == 1 and "ddp.module(x)" in warned[0], (rank, warned)


@pytest.mark.parametrize("how", ["every rank", "module on rank 0", "none"])
def test_forwards_every_rank_runs_alike_warn_nothing(how: str) -> None:
    assert run_on_ranks(train_with_a_log, 2, how, timeout=120) == [[], []]


def two_forwards_then_one_backward(rank: int, world: int) -> list[torch.Tensor]:
    """A Siamese step: two forwards through the wrapper (each broadcasts BatchNorm's buffers, written in place on
    rank 1), then one backward through both; the averaged gradients."""
    torch.manual_seed(0)
    ddp = graphddp.DDP(WithBatchNorm(), bucket_cap_mb=0.002)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randn(8, 12, generator=g)
        (ddp(x).pow(2).mean() + ddp(2 * x).pow(2).mean()).backward()
    return [p.grad.clone() for p in ddp.parameters()]


def test_two_forwards_then_one_backward_with_batchnorm_trains_on_every_rank() -> None:
    """The buffers' broadcast keeps their version counters (as PyTorch's DDP): rank 1's backward must not find the
    running statistics the first forward saved "modified by an inplace operation"."""
    grads = run_on_ranks(two_forwards_then_one_backward, 2, timeout=120)
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs)  # averaged: the same on both ranks
