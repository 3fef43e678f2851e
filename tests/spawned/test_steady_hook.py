"""The hook that only counts (Note [Hook that only counts]): in steady state a backward takes the Reducer's full
path once (its first hook) and counts every other gradient, with the same gradients as PyTorch's DDP. (Buckets
counted in C, the step after, are tests/spawned/test_counting_in_c.py's.)

The other spawned tests record events, which keeps the hooks on the full path: these run without a recorder."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, assert_same_grads_then_zero, batch_for

import graphddp
from bench.overhead import CallCounter
from graphddp.runtime import arrivals, countdown


def steady_backwards(rank: int, world: int, find_unused: bool) -> list[tuple[str, int]]:
    """Per step: whether it synchronised, and how many gradients took the full path; asserts parity throughout."""
    torch.manual_seed(0)
    model = MLP()
    ddp = graphddp.DDP(copy.deepcopy(model), find_unused_parameters=find_unused, **CAPS)
    ref = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    full_path = countdown._full_path
    taken = []

    def counted(countdown_ref, index):  # the hook looks the name up at each call
        taken.append(index)
        full_path(countdown_ref, index)

    countdown._full_path = counted
    streak, arrivals.STREAK = arrivals.STREAK, 10**9  # this test is the per-gradient hook's: no bucket moves on to counting in C
    record = []
    try:
        for step in range(6):
            sync = step != 3  # one no_sync micro-step: every gradient takes the full path, nothing is sent
            x, y = batch_for(Case(), step, 0, rank)
            taken.clear()
            for module in (ddp, ref):
                with contextlib.nullcontext() if sync else module.no_sync():
                    F.mse_loss(module(x), y).backward()
            record.append(("sync" if sync else "no_sync", len(taken)))
            if sync:
                assert_same_grads_then_zero(ddp, ref)
    finally:
        countdown._full_path = full_path
        arrivals.STREAK = streak
    return record


def test_steady_backwards_take_the_full_path_once_and_match_pytorch() -> None:
    for find_unused in (False, True):
        for record in run_on_ranks(steady_backwards, 2, find_unused):
            params = len(list(MLP().parameters()))
            assert record[0] == ("sync", params)  # the first backward learns the ready order: every gradient
            assert record[3] == ("no_sync", params)  # no DDP forward prepared it: every gradient
            # Steady: only the first hook of each backward (agreement, ending), the other gradients only count.
            assert [r for i, r in enumerate(record) if i not in (0, 3)][1:] == [("sync", 1)] * 3, record


# -- the lean bucket path (Note [Lean bucket path] in graphddp.runtime.reductions) -----------------------------------
def _allreduces_in_backward(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The all-reduce collectives one backward issues, as the profiler sees them (the dispatcher's op)."""
    loss = F.mse_loss(module(x), y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sum(e.count for e in prof.key_averages() if e.key == "c10d::allreduce_")


def one_rank_reductions(rank: int, world: int) -> dict[str, int]:
    """One rank: graphddp's averaging issues no collective and leaves the gradients as PyTorch's DDP makes them;
    a user's comm hook still runs per bucket; a ``reduce_dtype`` still rounds the gradients through it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel.distributed import _MixedPrecision

    counts = {}
    for name in ("default", "allreduce_hook"):
        torch.manual_seed(0)
        model = MLP()
        ddp = graphddp.DDP(copy.deepcopy(model), **CAPS)
        ref = torch.nn.parallel.DistributedDataParallel(model)
        if name == "allreduce_hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        for step in range(3):
            x, y = batch_for(Case(), step, 0, rank)
            counts[name] = _allreduces_in_backward(ddp, x, y)
            F.mse_loss(ref(x), y).backward()
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            for module in (ddp, ref):
                module.zero_grad(set_to_none=True)
        counts[f"{name} buckets"] = len(ddp.bucket_plan.buckets)
    # fp16 compute, bf16 reduction: fp16 gradients are rounded to bf16's 8 bits, as PyTorch's DDP rounds them
    # (PyTorch's mixed precision needs CUDA events, so the check is the rounding itself).
    torch.manual_seed(0)
    ddp = graphddp.DDP(MLP(), **CAPS, mixed_precision=_MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.bfloat16))
    x, y = batch_for(Case(), 0, 0, rank)
    counts["mixed_precision"] = _allreduces_in_backward(ddp, x, y)
    grads = [p.grad for p in ddp.parameters()]
    assert all(torch.equal(g, g.bfloat16().float()) for g in grads), "gradients not rounded through bf16"
    assert not all(torch.equal(g, g.bfloat16().float()) for g in (g.half().float() * 1.001 for g in grads))  # can fail
    return counts


def test_one_rank_averages_without_a_collective_unless_a_hook_asks() -> None:
    (counts,) = run_on_ranks(one_rank_reductions, 1)
    assert counts["default"] == 0, counts  # the average of one gradient is itself: nothing to send or copy
    assert counts["allreduce_hook"] == counts["allreduce_hook buckets"] > 1, counts  # a hook runs, as in PyTorch
    assert counts["mixed_precision"] == 0, counts


def calls_of_a_steady_backward(rank: int, world: int, cap_mb: float, as_view: bool = False) -> tuple[int, int]:
    """(Python calls of one steady backward, buckets) for a model of 48 small parameters; ``as_view``:
    ``gradient_as_bucket_view=True``, the gradients set to None after every step (the optimizers' default)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])
    ddp = graphddp.DDP(
        model, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb, last_bucket_cap_mb=cap_mb, bucket_ramps=False,
        gradient_as_bucket_view=as_view,
    )  # fmt: skip
    x = torch.randn(8, 16)
    for _ in range(3):
        ddp(x).square().mean().backward()
        ddp.zero_grad(set_to_none=True)
    return CallCounter().count_backward(ddp(x).square().mean()), len(ddp.bucket_plan.buckets)


def test_a_steady_backward_costs_a_few_dozen_calls_per_bucket() -> None:
    (few, few_buckets), _ = run_on_ranks(calls_of_a_steady_backward, 2, 0.02)
    (many, many_buckets), _ = run_on_ranks(calls_of_a_steady_backward, 2, 0.001)  # a layer a bucket
    assert many_buckets >= few_buckets + 10, (few_buckets, many_buckets)
    # Same parameters, same hooks: the difference is what each bucket costs (gather, launch, wait, write back):
    # ~77 calls before the lean bucket path (Note [Lean bucket path]), ~30 with it.
    per_bucket = (many - few) / (many_buckets - few_buckets)
    assert per_bucket <= 40, (few, few_buckets, many, many_buckets, per_bucket)


def test_bucket_views_cost_no_python_per_parameter_either() -> None:
    """``gradient_as_bucket_view=True`` after ``zero_grad(set_to_none=True)``: autograd hands over fresh gradients
    every step, and a bucket takes them in one ``_foreach_copy_`` as a copied one does, not one call chain per
    parameter (48 here)."""
    (copied, buckets), _ = run_on_ranks(calls_of_a_steady_backward, 2, 0.02)
    (viewed, same_buckets), _ = run_on_ranks(calls_of_a_steady_backward, 2, 0.02, True)
    assert buckets == same_buckets and viewed <= copied + 10, (copied, viewed, buckets)
