"""Buckets averaged by the backend's all-reduce (Note [Averaged on the wire] in ``graphddp.runtime.reductions``), on
spawned gloo ranks. No backend is let average by default (gloo's division costs more than the ``mul_`` it saves),
so the rule's path is run with gloo let in (``WIRE_AVERAGING`` patched in each rank; gloo takes ``ReduceOp.AVG``
from PyTorch 2.8): the all-reduces a steady backward issues, and what runs on the backward's thread, recorded by a
dispatch mode, by default and let in; the gradients against PyTorch's DDP and against an average made by hand, at
world sizes 2 and 3 (where ``1/3`` is not exact), and under ``join`` averaging over the ranks still training."""

from __future__ import annotations

import collections
import contextlib
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphddp
from graphddp.runtime import reductions

CAPS = {"bucket_cap_mb": 0.3, "first_bucket_cap_mb": 0.3, "bucket_ramps": False}
"""0.3 MiB caps: a bucket closes once it holds its cap or more, so two of ``model``'s 256 x 256 layers (0.25 MiB
and a bias each) fill one: three buckets."""
AVG, SUM = 1, 0
"""``ReduceOp.RedOpType`` as the dispatcher's ``c10d.allreduce_`` carries it (``op()`` of its argument)."""


def gloo_let_in(let_in: bool = True) -> contextlib.AbstractContextManager:
    """In a rank: gloo let average on the wire (``WIRE_AVERAGING``) for as long as the DDP lives (a new plan
    rebuilds its reductions through the rule)."""
    return mock.patch.object(reductions, "WIRE_AVERAGING", frozenset({"gloo"})) if let_in else contextlib.nullcontext()


def skip_unless_gloo_averages() -> None:
    if not reductions.averages_correctly("gloo", torch.float32):  # CI pins a newer torch (constraints.txt)
        pytest.skip(f"gloo averages from PyTorch 2.8; this is {torch.__version__}")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 256, generator=torch.Generator().manual_seed(100 * step + rank))


class Recorded(TorchDispatchMode):
    """The reduce op of every ``c10d.allreduce_`` and the count of every aten op run on this thread (the CPU
    backward's: autograd runs a CPU graph on the thread that calls ``backward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reduce_ops: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[str(func)] += 1
        if func is torch.ops.c10d.allreduce_.default:
            self.reduce_ops.append(args[2].op())
        return func(*args, **(kwargs or {}))


def steady_backward(rank: int, world: int, let_in: bool) -> dict[str, Any]:
    """Three steps to reach the steady plan, then one recorded; every step's gradients beside PyTorch's DDP's."""
    with gloo_let_in(let_in):
        return _steady_backward(rank)


def _steady_backward(rank: int) -> dict[str, Any]:
    ours, theirs = graphddp.DDP(model(), **CAPS), nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.3)
    seen: dict[str, Any] = {}
    for step in range(4):
        for ddp in (ours, theirs):
            loss = ddp(batch(rank, step)).square().mean()
            if ddp is ours and step == 3:
                with Recorded() as recorded:
                    loss.backward()
                seen["reduce_ops"], seen["mul_"] = recorded.reduce_ops, recorded.ops["aten.mul_.Tensor"]
            else:
                loss.backward()
        torch.testing.assert_close([p.grad for p in ours.parameters()], [p.grad for p in theirs.parameters()])
        for ddp in (ours, theirs):
            ddp.zero_grad(set_to_none=True)
    seen["buckets"] = len(ours.reducer.buckets)
    return seen


def test_by_default_every_bucket_is_scaled_on_its_way_in_and_summed() -> None:
    """gloo is not let average (it costs more than it saves): one ``mul_`` per bucket, every all-reduce a sum."""
    for seen in run_on_ranks(steady_backward, 2, False):
        assert seen["buckets"] == 3, seen
        assert seen["reduce_ops"] == [SUM, SUM, SUM], seen
        assert seen["mul_"] == 3, seen


@pytest.mark.parametrize("world", [2, 3])
def test_a_steady_backward_sends_every_bucket_averaged_but_the_agreements(world: int) -> None:
    skip_unless_gloo_averages()
    for seen in run_on_ranks(steady_backward, world, True):
        assert seen["buckets"] == 3, seen
        # Every bucket but the last, which carries the plan agreement's counts (Note [The agreement rides a
        # bucket]): those must be summed, so its gradients are scaled on their way in, by the one mul_ left.
        assert seen["reduce_ops"] == [AVG, AVG, SUM], seen
        assert seen["mul_"] == 1, seen


def joined_early(rank: int, world: int, divide_by_initial_world_size: bool) -> dict[str, Any]:
    """Rank 0 trains one step, the others three, under ``join``; the last step's gradients, and the reduce ops its
    backward issued."""
    with gloo_let_in():
        ddp = graphddp.DDP(model(), **CAPS)
        steps = 1 if rank == 0 else 3
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(steps):
                ddp.zero_grad(set_to_none=True)
                loss = ddp(batch(rank, step)).square().mean()
                with Recorded() as recorded:
                    loss.backward()
    return {"grads": [p.grad.clone() for p in ddp.parameters()], "reduce_ops": recorded.reduce_ops}


def by_hand(rank: int, step: int) -> list[torch.Tensor]:
    local = model()
    local(batch(rank, step)).square().mean().backward()
    return [p.grad for p in local.parameters()]


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_under_join_the_average_is_over_the_ranks_it_should_be(divide_by_initial_world_size: bool) -> None:
    """At the last step only ranks 1 and 2 train: their gradients summed, divided by 3 (the initial world size)
    or by 2 (the ranks still training), which the backend's ``AVG`` over 3 ranks gives only with the gradients
    scaled by 3/2 on their way in."""
    skip_unless_gloo_averages()
    results = run_on_ranks(joined_early, 3, divide_by_initial_world_size)
    divisor = 3 if divide_by_initial_world_size else 2
    expected = [(a + b) / divisor for a, b in zip(by_hand(1, 2), by_hand(2, 2))]
    for rank in (1, 2):
        assert results[rank]["reduce_ops"] == [AVG, AVG, SUM], results[rank]["reduce_ops"]  # the let-in path
        torch.testing.assert_close(results[rank]["grads"], expected, msg=f"rank {rank}")


def hook_sums(rank: int, world: int) -> dict[str, Any]:
    """A comm hook (PyTorch's ``allreduce_hook``) averages itself: graphddp scales nothing, sends what it is given."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with gloo_let_in():
        ddp = graphddp.DDP(model(), **CAPS)
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        for step in range(3):
            ddp(batch(rank, step)).square().mean().backward()
            ddp.zero_grad(set_to_none=True)
        loss = ddp(batch(rank, 3)).square().mean()
        with Recorded() as recorded:
            loss.backward()
    return {"reduce_ops": recorded.reduce_ops, "grads": [p.grad for p in ddp.parameters()]}


def test_a_comm_hook_still_gets_the_unscaled_bucket_and_sums_it() -> None:
    results = run_on_ranks(hook_sums, 2)
    expected = [(a + b) / 2 for a, b in zip(by_hand(0, 3), by_hand(1, 3))]
    for rank, seen in enumerate(results):
        assert seen["reduce_ops"] and set(seen["reduce_ops"]) == {SUM}, seen["reduce_ops"]
        torch.testing.assert_close(seen["grads"], expected, msg=f"rank {rank}")
