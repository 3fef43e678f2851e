"""Bad input across ranks: a clear error on *every* rank within the timeout, never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP, Branchy
from ranks import expect_failure_on_every_rank, run_on_ranks
from torch import nn
from training import Case, batch_for

import graphddp

TIMEOUT = 60


def mismatched_shape(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = MLP()
    if rank == 1:
        model.fc2 = nn.Linear(32, 33)
        model.fc3 = nn.Linear(33, 6)
    graphddp.DDP(model)


def mismatch_raises_runtime_error(rank: int, world: int) -> str:
    try:
        mismatched_shape(rank, world)
    except RuntimeError as e:  # PyTorch's type, which scripts match on
        return type(e).__name__
    return "no error"


def test_models_that_differ_raise_runtime_error_as_pytorch_does() -> None:
    assert run_on_ranks(mismatch_raises_runtime_error, 2, timeout=TIMEOUT) == ["ModelMismatchError"] * 2


def mismatched_count(rank: int, world: int) -> None:
    model = MLP()
    if rank == world - 1:
        model.extra = nn.Linear(4, 4)
    graphddp.DDP(model)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: slow suite (time)
def test_different_models_on_different_ranks(world: int) -> None:
    errors = expect_failure_on_every_rank(mismatched_shape, world, timeout=TIMEOUT)
    for rank, text in errors.items():
        assert "ModelMismatchError" in text and f"[rank {rank}]" in text
        assert "parameter fc2.weight shape=[32, 32]" in text and "rank 1 has 'parameter fc2.weight shape=[33, 32]" in text
    errors = expect_failure_on_every_rank(mismatched_count, world, timeout=TIMEOUT)
    for text in errors.values():
        assert f"rank {world - 1} has 'parameter extra.weight" in text and "<missing>" not in text.split("rank 0 has")[0]


def run_steps(ddp: nn.Module, rank: int, steps: int, use_shared: bool) -> None:
    case = Case(model="branchy")
    for step in range(steps):
        x, y = batch_for(case, step, 0, rank)
        F.mse_loss(ddp(x, use_shared=use_shared), y).backward()


def unused_everywhere(rank: int, world: int) -> None:
    ddp = graphddp.DDP(Branchy(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    run_steps(ddp, rank, 2, use_shared=True)  # `dead` never gets a gradient


def unused_on_one_rank(rank: int, world: int) -> None:
    model = Branchy()
    model.dead.requires_grad_(False)
    ddp = graphddp.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    run_steps(ddp, rank, 2, use_shared=rank != 1)  # `shared` is used everywhere but on rank 1


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: slow suite (time)
def test_parameter_without_gradient_and_without_the_flag(world: int) -> None:
    for fn, name, detail in [
        (unused_everywhere, "dead.weight", f"gradient on 0 of {world} ranks, not on this one"),
        (unused_on_one_rank, "shared.weight", f"gradient on {world - 1} of {world} ranks"),
    ]:
        errors = expect_failure_on_every_rank(fn, world, timeout=TIMEOUT)
        for rank, text in errors.items():
            assert f"[rank {rank}] graphddp.DDP: Expected to have finished reduction in the prior iteration" in text
            assert f"the previous backward produced no gradient for '{name}'" in text
            assert detail in text and "find_unused_parameters=True" in text
            assert "run_steps" in text and "_pre_forward" in text  # raised by the next forward


def wrong_shape_hook(state: object, bucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0][:-1])


def hook_returns_wrong_shape(rank: int, world: int) -> None:
    ddp = graphddp.DDP(MLP(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, wrong_shape_hook)
    x, y = batch_for(Case(), 0, 0, rank)
    F.mse_loss(ddp(x), y).backward()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: slow suite (time)
def test_comm_hook_returning_the_wrong_shape(world: int) -> None:
    errors = expect_failure_on_every_rank(hook_returns_wrong_shape, world, timeout=TIMEOUT)
    for rank, text in errors.items():
        assert f"[rank {rank}] graphddp: the communication hook returned a tensor of shape" in text
        assert "for bucket 0, expected" in text
