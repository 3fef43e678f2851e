"""Ordering claims, proven with recorded events (never with timings).

* buckets are launched in index order on every rank, also when a later bucket is ready first;
* the launch sequence is identical on all ranks;
* the first bucket's all-reduce is launched while backward is still computing earlier layers;
* a bucket's averages are written into ``.grad`` before the next bucket is awaited (copies overlap the rest).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import IN, OUT, build_model
from ranks import run_on_ranks
from torch import nn
from training import Case, batch_for

import graphddp
from graphddp.runtime.trace import EventLog

CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001}


def record_iterations(rank: int, world: int, iterations: int = 3) -> list[list[tuple]]:
    ddp = graphddp.DDP(build_model("unordered"), **CAPS)
    ddp.reducer.events = log = EventLog()
    record = []
    for it in range(iterations):
        log.clear()
        x, y = batch_for(Case(), it, 0, rank)
        F.mse_loss(ddp(x), y).backward()
        record.append([(e.seq, e.kind, e.bucket, e.param) for e in log.events])
    return record


def completion_and_launch(events: list[tuple]) -> tuple[dict[int, int], dict[int, int]]:
    completed: dict[int, int] = {}  # bucket -> seq of its last "ready"
    launched: dict[int, int] = {}
    for seq, kind, bucket, _ in events:
        if kind == "ready":
            completed[bucket] = seq
        elif kind == "launch":
            launched[bucket] = seq
    return completed, launched


@pytest.mark.parametrize("world", [2, 3])
def test_launch_in_index_order_on_every_rank_even_when_readiness_is_not(world: int) -> None:
    per_rank = run_on_ranks(record_iterations, world)
    launches = [[[b for _, kind, b, _ in it if kind == "launch"] for it in rank] for rank in per_rank]
    for rank_launches in launches:
        for it in rank_launches:
            assert it == sorted(it) == list(range(len(it))) and len(it) > 2, rank_launches
    assert all(other == launches[0] for other in launches), "ranks launched buckets in different orders"

    # First iteration, registration-order plan: the model runs its layers out of registration order, so some
    # bucket k completes before an earlier bucket j, and still waits for j's launch.
    completed, launched = completion_and_launch(per_rank[0][0])
    inversions = [(j, k) for j in completed for k in completed if j < k and completed[k] < completed[j]]
    assert inversions, f"the model no longer makes buckets ready out of order: {completed}"
    for j, k in inversions:
        assert launched[j] >= completed[j] and launched[k] > launched[j]

    # After the one-time rebuild the plan follows the real ready order: buckets complete in index order.
    completed, _ = completion_and_launch(per_rank[0][-1])
    assert sorted(completed, key=completed.get) == sorted(completed)


@pytest.mark.parametrize("world", [2])
def test_each_bucket_is_written_back_before_the_next_one_is_awaited(world: int) -> None:
    for rank in run_on_ranks(record_iterations, world):
        for events in rank:
            seq = {(kind, bucket): s for s, kind, bucket, _ in events if kind in ("wait", "written")}
            buckets = sorted(b for kind, b in seq if kind == "wait")
            assert len(buckets) > 2 and all(("written", b) in seq for b in buckets), events
            for b in buckets[:-1]:
                assert seq[("wait", b)] < seq[("written", b)] < seq[("wait", b + 1)], (b, events)


class Marker(torch.autograd.Function):
    """Identity whose backward records an event: the moment backward reaches the first layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: EventLog) -> torch.Tensor:  # type: ignore[override]
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.log.record("backward reaches fc1")
        return grad, None


class Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, 32), nn.Linear(32, 32), nn.Linear(32, OUT)
        self.log: EventLog | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = Marker.apply(F.relu(self.fc1(x)), self.log)
        return self.fc3(F.relu(self.fc2(h)))


def record_overlap(rank: int, world: int) -> list[tuple]:
    torch.manual_seed(0)
    model = Marked()
    ddp = graphddp.DDP(model, **CAPS)
    model.log = ddp.reducer.events = log = EventLog()
    assert ddp.bucket_plan.bucket_of("fc3.weight") == 0 and ddp.bucket_plan.bucket_of("fc1.weight") > 0
    x, y = batch_for(Case(), 0, 0, rank)
    F.mse_loss(ddp(x), y).backward()
    return [(e.seq, e.kind, e.bucket, e.param) for e in log.events]


@pytest.mark.parametrize("world", [2, 3])
def test_first_bucket_is_launched_while_backward_still_runs(world: int) -> None:
    for events in run_on_ranks(record_overlap, world):
        seq = {(kind, bucket, param): s for s, kind, bucket, param in events}
        launch0 = seq[("launch", 0, None)]
        marker = seq[("backward reaches fc1", None, None)]
        ready = [s for s, kind, _, param in events if kind == "ready"]
        fc1_ready = [s for s, kind, _, param in events if kind == "ready" and param.startswith("fc1.")]
        # Bucket 0's all-reduce started before autograd even reached fc1, let alone computed its gradients.
        assert launch0 < marker < min(fc1_ready)
        assert launch0 < max(ready)
