"""Optimizer steps inside the compiled backward (Note [Steps in the compiled backward]) on spawned gloo ranks:
``step_in_backward`` with the graph reducing in-graph trains exactly as PyTorch's DDP followed by
``optimizer.step()``, each bucket stepped by its node and not by the Reducer; no_sync micro-steps and the step
after them run split and the Reducer steps; an optimizer registered after compiling sends the graph back to the
split."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from models import IN, MLP, OUT, GraphBreaks
from ranks import expect_failure_on_every_rank, run_on_ranks
from training import CAPS

import graphddp
from graphddp.runtime import optimizer_overlap


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, IN, generator=g), torch.randn(6, OUT, generator=g)


def train(
    rank: int, world: int, inner: str, accumulate: int, register_after: int, breaks: bool = False
) -> list[tuple[bool, int, int]]:
    """Per step: (gate open, buckets stepped inside the compiled backward, buckets the Reducer stepped); parameters
    and optimizer state checked against PyTorch's DDP and ``optimizer.step()`` after every step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GraphBreaks() if breaks else MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = graphddp.DDP(model, **CAPS)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (ddp, ref))
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    compiled = torch.compile(ddp, backend=graphddp.backend(inner))
    counts = {"node": 0, "reducer": 0}
    step_with, bucket_final = optimizer_overlap.StepPerBucket.step_with, optimizer_overlap.StepPerBucket.bucket_final

    def counting_step_with(self, params, grads):  # the step nodes' way in
        counts["node"] += 1
        return step_with(self, params, grads)

    def counting_bucket_final(self, k, whole, params, events):  # the Reducer's way in
        counts["reducer"] += bool(whole)
        return bucket_final(self, k, whole, params, events)

    optimizer_overlap.StepPerBucket.step_with = counting_step_with
    optimizer_overlap.StepPerBucket.bucket_final = counting_bucket_final
    record = []
    try:
        for step in range(6):
            if step == register_after:
                ddp.step_in_backward(opt)
            stepping = step >= register_after
            counts.update(node=0, reducer=0)
            for micro in range(accumulate):
                x, y = batch(step, micro, rank)
                for module in (compiled, ref):
                    context = module.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                    with context:
                        F.mse_loss(module(x), y).backward()
            record.append((ddp.reducer.compile_target.gate.open, counts["node"], counts["reducer"]))
            if not stepping:
                opt.step()
            ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            for schedule in schedules:
                schedule.step()
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)
                torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
    finally:
        optimizer_overlap.StepPerBucket.step_with, optimizer_overlap.StepPerBucket.bucket_final = step_with, bucket_final
    return record


@pytest.mark.parametrize(("inner", "world"), [("aot_eager", 2), pytest.param("aot_eager", 3, marks=pytest.mark.slow),
                                              pytest.param("inductor", 2, marks=pytest.mark.slow)])  # fmt: skip
def test_buckets_are_stepped_inside_the_compiled_backward_as_optimizer_step_would(inner: str, world: int) -> None:
    for record in run_on_ranks(train, world, inner, 1, 0):
        # The first step runs split (the plan is agreed during it): the Reducer steps. From then on in-graph: every
        # bucket by its node, none by the Reducer.
        assert not record[0][0] and record[0][1] == 0 and record[0][2] > 1, record
        k = record[0][2]
        assert all(entry == (True, k, 0) for entry in record[1:]), record


def test_no_sync_micro_steps_and_the_step_after_them_are_stepped_by_the_reducer() -> None:
    for record in run_on_ranks(train, 2, "aot_eager", 2, 0):
        assert all(not open_ and node == 0 and reducer > 1 for open_, node, reducer in record), record


def test_an_optimizer_registered_after_compiling_in_graph_sends_the_graph_back_to_the_split() -> None:
    for record in run_on_ranks(train, 2, "aot_eager", 1, 3):
        assert [open_ for open_, _, _ in record] == [False, True, True, False, False, False], record
        assert all(node == 0 for _, node, _ in record) and all(reducer > 1 for _, _, reducer in record[3:]), record


def test_a_module_compiled_into_several_graphs_runs_split_and_the_reducer_steps() -> None:
    """A later graph's backward runs before an earlier one's, so its steps could change a parameter the earlier
    graph still reads or step a shared parameter on part of its gradient: with graph breaks, the split."""
    for record in run_on_ranks(train, 2, "aot_eager", 1, 0, True):
        assert all(not open_ and node == 0 and reducer > 1 for open_, node, reducer in record), record


def compiled_autograd_steps(rank: int, world: int) -> list[tuple[bool, int]]:
    """step_in_backward with the backward under compiled autograd (which traces the compiled backward again)."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = graphddp.DDP(model, **CAPS)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ddp, ref))
    ddp.step_in_backward(opt)
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    record = []
    for step in range(4):
        x, y = batch(step, 0, rank)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            F.mse_loss(compiled(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        record.append((ddp.reducer.compile_target.gate.open, step))
        ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    return record


def test_stepping_inside_the_compiled_backward_under_compiled_autograd() -> None:
    for record in run_on_ranks(compiled_autograd_steps, 2):
        assert [open_ for open_, _ in record][1:] == [True, True, True], record


class BlockTwice(torch.nn.Module):
    """One block called twice, a graph break between: two captured graphs over the same two parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        torch._dynamo.graph_break()
        return self.block(F.relu(x))[:, :OUT]  # [B, IN] -> [B, OUT]


def steps_through_a_block_twice(rank: int, world: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    ddp = graphddp.DDP(BlockTwice(), **CAPS)
    ddp.step_in_backward(torch.optim.SGD(ddp.parameters(), lr=0.1))
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    for step in range(3):
        F.mse_loss(compiled(batch(step, 0, rank)[0]), batch(step, 0, rank)[1]).backward()


def test_a_stepping_graph_run_twice_in_one_forward_raises_on_every_rank() -> None:
    """Each backward would step the block on part of its gradient (the later graph's first): a clear error
    before the second run, on every rank, instead of a silently wrong step."""
    errors = expect_failure_on_every_rank(steps_through_a_block_twice, 2, timeout=180)
    for rank, error in errors.items():
        assert f"[rank {rank}]" in error and "ran twice in one forward" in error, error
