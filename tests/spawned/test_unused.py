"""Parameters that get no gradient, on spawned gloo ranks: ``static_graph`` learns them from its first backward,
``skip_all_reduce_unused_params`` skips the buckets no rank used and reduces late what one rank did."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import build_model
from ranks import run_on_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from training import CAPS, Case, batch_for, loss_for, state_of

import graphddp
from graphddp.runtime.trace import EventLog


# -- static_graph --------------------------------------------------------------------------------------------------
def count_traversals(rank: int, world: int, static: bool) -> tuple[int, int]:
    ddp = graphddp.DDP(build_model("branchy"), static_graph=static, find_unused_parameters=not static, **CAPS)
    case = Case(model="branchy")
    for step in range(4):
        x, y = batch_for(case, step, 0, rank)
        loss_for(ddp, case, (x, y), rank).backward()
    return ddp.reducer.usage.policy.traversals, int(ddp.module.dead.weight.grad is None)


@pytest.mark.parametrize("world", [2, 3])
def test_static_graph_learns_unused_parameters_from_its_first_backward_without_searching(world: int) -> None:
    for traversals, dead_untouched in run_on_ranks(count_traversals, world, True):
        assert traversals == 0 and dead_untouched
    for traversals, dead_untouched in run_on_ranks(count_traversals, world, False):
        assert traversals == 4 and dead_untouched


# -- skip_all_reduce_unused_params ---------------------------------------------------------------------------------
class RarelyUsed(nn.Module):
    """``extra`` is used only where the caller says: no rank uses it in the first steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.extra = nn.Linear(12, 32), nn.Linear(32, 6), nn.Linear(12, 6)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.fc2(torch.relu(self.fc1(x)))  # [B, 12] -> [B, 6]
        return y + self.extra(x) if use_extra else y


def train_rarely_used(
    rank: int, world: int, impl: str, compiled: bool = False
) -> tuple[dict[str, torch.Tensor], list[tuple[str, int | None]], list[str]]:
    kwargs: dict[str, Any] = {"find_unused_parameters": True, "bucket_cap_mb": 0.0005}
    if impl == "graphddp":
        ddp: nn.Module = graphddp.DDP(RarelyUsed(), skip_all_reduce_unused_params=True, first_bucket_cap_mb=0.0005, **kwargs)
        ddp.reducer.events = log = EventLog()
    else:  # the reference: PyTorch's DDP without the skip (with it, step 3 would desynchronise the ranks)
        ddp, log = nn.parallel.DistributedDataParallel(RarelyUsed(), **kwargs), EventLog()
    # Compiled, each value of use_extra is a graph of its own: rank 0 captures the second alone, at step 3.
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager")) if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):
        x, y = batch_for(Case(), step, 0, rank)
        F.mse_loss(model(x, use_extra=step == 3 and rank == 0), y).backward()  # step 3: rank 0 uses it after all
        opt.step()
        opt.zero_grad()
    strategies = [str(r) for r in ddp.reducer.compile_target.reductions] if compiled else []
    return state_of(ddp.module), [(e.kind, e.bucket) for e in log.events if e.kind in ("skipped", "late")], strategies


@pytest.mark.parametrize(
    ("world", "compiled"), [(2, False), pytest.param(3, False, marks=pytest.mark.slow), (2, True), pytest.param(3, True, marks=pytest.mark.slow)]
)
def test_skip_all_reduce_unused_params_skips_what_no_rank_used_and_reduces_late_what_one_did(world: int, compiled: bool) -> None:
    ours = run_on_ranks(train_rarely_used, world, "graphddp", compiled)
    theirs = run_on_ranks(train_rarely_used, world, "torch")
    for rank, ((state, events, strategies), (reference, _, _)) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(state, reference)
        skipped = [b for kind, b in events if kind == "skipped"]
        late = [b for kind, b in events if kind == "late"]
        # Iteration 0 reduces everything; then extra's buckets skip their collectives, step 3 reduces them late,
        # and from then on they are reduced as usual (rank 0 used them).
        assert skipped and late and set(late) == set(skipped), events
        assert len(skipped) == 3 * len(set(skipped)), events  # steps 1, 2 and 3
        if compiled:  # the skip needs the Reducer's hooks: every graph stays on the split, and says why
            assert len(strategies) == (2 if rank == 0 else 1), strategies
            assert all(s.startswith("split") and "skip_all_reduce_unused_params" in s for s in strategies), strategies


# -- a forward that no backward follows ----------------------------------------------------------------------------
class PerRankHead(nn.Module):
    """A trunk and one head per rank: each rank leaves the other ranks' heads unused (per-rank heads, experts)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(12, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 6) for _ in range(world))

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](torch.relu(self.trunk(x)))  # [B, 12] -> [B, 6]


def train_with_an_evaluation_forward(rank: int, world: int, impl: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Four steps; after step 1 a forward with gradients enabled and no backward (an evaluation that forgot
    ``no_grad``). Returns the module's state and the buckets a comm hook was asked to reduce, in order."""
    # 52-byte caps: each tensor a bucket of its own, so the first buckets in ready order (rank 0's: its head first)
    # are exactly what rank 1 leaves unused.
    kwargs: dict[str, Any] = {"find_unused_parameters": True, "bucket_cap_mb": 0.00005}
    module = PerRankHead(world)
    ddp: nn.Module = graphddp.DDP(module, first_bucket_cap_mb=0.00005, **kwargs) if impl == "graphddp" else nn.parallel.DistributedDataParallel(module, **kwargs)
    reduced: list[int] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: PyTorch checks a real annotation
        reduced.append(bucket.index())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch_for(Case(), step, 0, rank)
        F.mse_loss(ddp(x, rank), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            reduced_before = len(reduced)
            ddp(x, rank)  # no backward: no collective, on any rank (the heads it leaves unused differ by rank)
            assert len(reduced) == reduced_before, f"rank {rank}: a forward alone reduced buckets {reduced[reduced_before:]}"
    return state_of(ddp.module), reduced


def test_a_forward_no_backward_follows_reduces_nothing_whatever_each_rank_left_unused() -> None:
    """Parameters unused in a forward are marked ready at the backward's first gradient, as PyTorch's Reducer
    does, not at the forward's end: a bucket they complete would otherwise be reduced by a forward alone, on the
    ranks whose unused parameters complete it, and the ranks would issue different collectives."""
    ours = run_on_ranks(train_with_an_evaluation_forward, 2, "graphddp", timeout=120)
    theirs = run_on_ranks(train_with_an_evaluation_forward, 2, "torch", timeout=120)
    for (state, _), (reference, _) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(state, reference)
    assert ours[0][1] == ours[1][1]  # the same buckets, in the same order, on both ranks
