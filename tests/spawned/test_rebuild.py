"""The one-time rebuild on spawned gloo ranks: the buckets are re-cut once, in rank 0's ready order."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from models import build_model
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp
from graphddp.runtime.trace import EventLog


def ready_order_and_rebuilt_plan(rank: int, world: int) -> tuple[list[str], list[str], str, str]:
    ddp = graphddp.DDP(build_model("unordered"), **CAPS)
    before = ddp.bucket_plan
    ddp.reducer.events = log = EventLog()
    for step in range(2):
        x, y = batch_for(Case(), step, 0, rank)
        F.mse_loss(ddp(x), y).backward()
        if step == 0:
            ready = [e.param for e in log.of_kind("ready")]
    return ready, list(ddp.bucket_plan.param_names), ddp.bucket_plan.source, before.fingerprint


@pytest.mark.parametrize("world", [2, 3])
def test_buckets_are_rebuilt_once_in_rank0s_ready_order(world: int) -> None:
    results = run_on_ranks(ready_order_and_rebuilt_plan, world)
    ready0, planned, source, _ = results[0]
    assert source == "ready-order" and planned == ready0
    assert planned != list(reversed(["a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]))
    assert all(r[1] == planned for r in results)
