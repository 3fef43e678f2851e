"""Buckets counted in C (Note [Counting without a frame] in graphddp.runtime.arrivals): once a bucket's last
gradient is steady, its other parameters' hooks are a builtin and one Python hook runs per bucket; when the order
changes, a parameter goes unused, or a gradient arrives twice, the end of backward settles the bucket and the
gradients still equal PyTorch's DDP's.

No events are recorded here: a recorder keeps every hook on the per-gradient path."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from ranks import RankFailure, run_on_ranks
from torch import nn
from training import assert_same_grads_then_zero

import graphddp
from bench.overhead import CallCounter
from graphddp.runtime.reducer import Reducer

ONE_BUCKET = {"bucket_cap_mb": 1, "first_bucket_cap_mb": 1, "last_bucket_cap_mb": 1, "bucket_ramps": False}


class Stack(nn.Module):
    """``layers`` small linear layers; ``flip`` runs them in the other order, so another parameter's gradient
    comes last in backward; ``skip_last`` leaves the last layer out (its parameters get no gradient)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: torch.Tensor, flip: bool = False, skip_last: bool = False) -> torch.Tensor:
        layers = list(self.layers)[: -1 if skip_last else None]
        for layer in reversed(layers) if flip else layers:
            x = torch.tanh(layer(x))
        return x


def calls_per_backward(rank: int, world: int, layers: int) -> list[int]:
    """The Python calls of each of five backwards of a ``layers``-layer model in one bucket."""
    torch.manual_seed(0)
    ddp = graphddp.DDP(Stack(layers), **ONE_BUCKET)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    calls = []
    for _ in range(5):
        calls.append(CallCounter().count_backward(ddp(x).square().mean()))
        ddp.zero_grad(set_to_none=True)
    assert len(ddp.bucket_plan.buckets) == 1
    return calls


def test_steady_backwards_cost_python_per_bucket_not_per_parameter() -> None:
    few = run_on_ranks(calls_per_backward, 2, 8)[0]  # 16 parameters
    many = run_on_ranks(calls_per_backward, 2, 40)[0]  # 80 parameters, the same single bucket
    # Backward 1 (index 1) is steady but not yet counted in C: a hook per gradient (two calls each).
    assert many[1] - few[1] >= 2 * 64, (few, many)
    # From backward 3 on the bucket is counted in C: 64 more parameters cost no Python call.
    assert many[3] == few[3] and many[4] == few[4], (few, many)
    assert few[4] < few[1] - 20, few


def parity_through_changes(rank: int, world: int) -> list[int]:
    """Train graphddp and PyTorch's DDP side by side through: steady steps (counted in C from step 3), a step with
    the layers in the other order (the sentinel is not last: settled at the end of backward), ``no_sync``
    micro-steps, and steps with a layer unused (``find_unused_parameters``). Gradients equal at every sync step;
    returns, per step, the Reducer's full-path calls (``on_grad_ready``) in that backward."""
    torch.manual_seed(0)
    model = Stack(4)
    ddp = graphddp.DDP(copy.deepcopy(model), find_unused_parameters=True, **ONE_BUCKET)
    ref = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    full_path = Reducer.on_grad_ready
    taken = []

    def counted(self, i):
        taken.append(i)
        return full_path(self, i)

    Reducer.on_grad_ready = counted
    record = []
    flips = [False] * 4 + [True] + [False] * 7
    syncs = [True] * 5 + [False, True] + [True] * 5
    skips = [False] * 7 + [True, True] + [False] * 3
    try:
        for step, (flip, sync, skip_last) in enumerate(zip(flips, syncs, skips)):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
            taken.clear()
            for module in (ddp, ref):
                with contextlib.nullcontext() if sync else module.no_sync():
                    F.mse_loss(module(x, flip, skip_last), y).backward()
            record.append(len(taken))
            if sync:
                assert_same_grads_then_zero(ddp, ref)
    finally:
        Reducer.on_grad_ready = full_path
    return record


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_order_changes_no_sync_and_unused_parameters_keep_parity(world: int) -> None:
    params = 8
    for record in run_on_ranks(parity_through_changes, world):
        assert record[0] == params  # the first backward learns the ready order: every gradient
        assert record[1:3] == [1, 1], record  # steady, per gradient: only the first hook takes the full path
        assert record[3] == 0, record  # counted in C (the same last gradient and opener twice): no full path
        assert record[4] == params, record  # the other order: the sentinel came early, every arrival settled
        assert record[5] == 0, record  # no_sync: the hooks change at the next synchronising forward, not before
        assert record[6] == 1, record  # per gradient again (the bucket left counting in C)
        assert record[7:9] == [1, 1], record  # a layer unused (marked ready at forward): per gradient
        # Steady again, with the last layer's gradient opening the backward again (the unused steps' opener was
        # the layer before): counted in C from the third step.
        assert record[9:] == [1, 1, 0], record


class TwiceInCheckpoint(nn.Module):
    """With ``twice``, ``a`` is used in a reentrant checkpoint and after it: autograd accumulates its gradient once
    in the backward's own graph and once more in the checkpoint's nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, twice: bool = False) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, x, use_reentrant=True) if twice else x
        return self.b(self.a(h))


def ready_twice_when_counted_in_c(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ddp = graphddp.DDP(TwiceInCheckpoint(), **ONE_BUCKET)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(4):  # counted in C from the third backward on
        ddp(x).sum().backward()
    ddp(x, twice=True).sum().backward()


def test_a_gradient_ready_twice_raises_when_counted_in_c() -> None:
    with pytest.raises(RankFailure, match="marked ready twice"):
        run_on_ranks(ready_twice_when_counted_in_c, 2)


def missing_gradient_when_counted_in_c(rank: int, world: int) -> None:
    """A parameter without a gradient in a backward counted in C: the same error as ever at the next forward (what
    arrived in the backward before must not count as used in this one)."""
    torch.manual_seed(0)
    ddp = graphddp.DDP(Stack(4), **ONE_BUCKET)
    x = torch.randn(4, 8)
    for _ in range(4):  # counted in C from the third backward on
        ddp(x).sum().backward()
    ddp(x, skip_last=rank == 0).sum().backward()
    ddp(x)


def test_a_missing_gradient_raises_when_counted_in_c() -> None:
    with pytest.raises(RankFailure, match=r"no gradient for 'layers.3.weight' \(gradient on 1 of 2 ranks"):
        run_on_ranks(missing_gradient_when_counted_in_c, 2)


def reentrant_checkpoint_parity(rank: int, world: int, static: bool = False) -> None:
    """The middle layer under a reentrant checkpoint: its gradients arrive in a nested backward, whose engine
    callbacks run when *it* ends. The backward must still be begun (its end-of-backward callback queued) in the
    outer one, by the first gradient's hook, counted in C or not."""
    from models import IN, OUT, CheckpointKinds
    from training import CAPS

    torch.manual_seed(0)
    model = CheckpointKinds("reentrant")
    # small buckets: the middle layer's complete in the nested backward
    ddp = graphddp.DDP(copy.deepcopy(model), static_graph=static, **CAPS)
    assert len(ddp.bucket_plan.buckets) > 2
    ref = torch.nn.parallel.DistributedDataParallel(model, static_graph=static)
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)
        for module in (ddp, ref):
            F.mse_loss(module(x), y).backward()
        assert_same_grads_then_zero(ddp, ref)


@pytest.mark.parametrize("static", [False, True])
def test_a_reentrant_checkpoint_keeps_parity_when_counted_in_c(static: bool) -> None:
    """With ``static_graph`` too, what PyTorch documents it for: a search of the autograd graph would find the
    checkpointed layer unused (its parameters are not in the outer graph), then its gradients came."""
    run_on_ranks(reentrant_checkpoint_parity, 2, static)
