"""``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce`` (``graphddp.runtime.delayed``): the delayed
parameters train as PyTorch's DDP trains them, their all-reduce is final when ``backward()`` returns, and
``no_sync`` micro-steps send nothing."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP
from ranks import expect_failure_on_every_rank, run_on_ranks
from training import CAPS, Case, batch_for

import graphddp


def delayed(module: torch.nn.Module) -> dict:
    """fc3 (whose gradients come first) delayed until fc1.weight's gradient is computed (the last)."""
    return {"delay_all_reduce_named_params": list(module.fc3.named_parameters(prefix="fc3")),
            "param_to_hook_all_reduce": module.fc1.weight}  # fmt: skip


def train_delayed(rank: int, world: int, accumulate: int) -> None:
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ours = graphddp.DDP(model, **CAPS, **delayed(model))
    if accumulate == 1:  # PyTorch's delayed hook ignores no_sync: compare with it on plain steps only
        ref = torch.nn.parallel.DistributedDataParallel(twin, **delayed(twin))
    else:  # graphddp without delay: no_sync accumulates, the synchronising step averages the sum
        ref = graphddp.DDP(twin, **CAPS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    assert "fc3.weight" not in {p.name for b in ours.bucket_plan.buckets for p in b.params}
    for step in range(3):
        for micro in range(accumulate):
            x, y = batch_for(Case(), step, micro, rank)
            last = micro == accumulate - 1
            for module in (ours, ref):
                with contextlib.nullcontext() if last else module.no_sync():
                    F.mse_loss(module(x), y).backward()
            if not last:  # nothing sent: each rank's fc3 gradient is its own
                mine = ours.module.fc3.weight.grad.clone()
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                assert not torch.equal(mine, ours.module.fc3.weight.grad), "a no_sync micro-step all-reduced fc3"
        dist.barrier()  # PyTorch leaves its delayed Work unwaited; gloo's barrier waits for it
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"step {step} {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_delayed_parameters_train_as_pytorchs_ddp_and_respect_no_sync(accumulate: int) -> None:
    run_on_ranks(train_delayed, 2, accumulate)


def train_resetting_some(rank: int, world: int) -> None:
    """Each step resets fc3.weight's gradient only (another optimizer's parameters keep accumulating): the
    delayed view it gets back holds the last average and must be zeroed, as PyTorch's ``_clear_grad_buffer``."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ours = graphddp.DDP(model, **CAPS, **delayed(model))
    ref = torch.nn.parallel.DistributedDataParallel(twin, **delayed(twin))
    for step in range(3):
        x, y = batch_for(Case(), step, 0, rank)
        for module in (ours, ref):
            F.mse_loss(module(x), y).backward()
        dist.barrier()  # PyTorch leaves its delayed Work unwaited; gloo's barrier waits for it
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"step {step} {name}: {m}")
        for module in (ours, ref):
            module.module.fc3.weight.grad = None


def test_a_delayed_gradient_reset_alone_starts_from_zero_as_in_pytorchs_ddp() -> None:
    run_on_ranks(train_resetting_some, 2)


def join_with_delayed(rank: int, world: int) -> None:
    model = MLP()
    ddp = graphddp.DDP(model, **CAPS, **delayed(model))
    with ddp.join():
        pass


def test_a_join_with_delayed_parameters_is_refused_on_every_rank() -> None:
    # A joined rank cannot mirror an all-reduce a gradient hook issues among the buckets: PyTorch's DDP hangs.
    for error in expect_failure_on_every_rank(join_with_delayed, 2, timeout=60).values():
        assert "join() cannot shadow the all-reduce of delay_all_reduce_named_params" in error
