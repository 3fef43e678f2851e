"""``bucket_cap_mb="auto"`` on spawned gloo ranks (Note [Automatic caps]): every rank chooses the same caps,
eager from the first backward and compiled from the graph; the choice follows the link; training is unchanged
(parity with PyTorch's DDP)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from ranks import run_on_ranks
from training import Case, state_of, train

import graphddp.runtime.auto_caps
from graphddp.passes import ComputeRates, LinkModel

AUTO = (("bucket_cap_mb", "auto"), ("first_bucket_cap_mb", "auto"), ("last_bucket_cap_mb", "auto"))
MODEL = "w:mlp:small"  # ~4 MB of gradients: enough for the candidates (0.25 MiB and up) to differ


@contextlib.contextmanager
def measured_as(link: LinkModel | None) -> Iterator[None]:
    """Replace the calibration's measurements (rank processes are reused: restored after)."""
    if link is None:
        yield
        return
    saved = graphddp.runtime.auto_caps.link_of, graphddp.runtime.auto_caps.compute_rates, graphddp.runtime.auto_caps.cpu_cost_of_communication
    graphddp.runtime.auto_caps.link_of = lambda group, device=None: link
    graphddp.runtime.auto_caps.compute_rates = lambda group, device=None: ComputeRates(flops_per_s=2e10, bytes_per_s=5e9)
    graphddp.runtime.auto_caps.cpu_cost_of_communication = lambda group, link=None: 0.0
    try:
        yield
    finally:
        graphddp.runtime.auto_caps.link_of, graphddp.runtime.auto_caps.compute_rates, graphddp.runtime.auto_caps.cpu_cost_of_communication = saved


def train_auto(rank: int, world: int, compile: str | None, link: LinkModel | None) -> dict:
    case = Case(model=MODEL, steps=3, graphddp=AUTO, compile=compile)
    with measured_as(link):
        run = train("graphddp", case, rank)
    plan = run.ddp.bucket_plan
    return {"state": state_of(run.ddp.module), "fingerprint": plan.fingerprint, "caps": plan.caps, "source": plan.source, "buckets": len(plan.buckets)}


def train_torch(rank: int, world: int) -> dict:
    return state_of(train("torch", Case(model=MODEL, steps=3), rank).ddp.module)


@pytest.mark.parametrize(("world", "compile"), [(2, None), pytest.param(3, None, marks=pytest.mark.slow), (2, "torch.compile")])
def test_every_rank_chooses_the_same_caps_and_trains_as_pytorchs_ddp(world: int, compile: str | None) -> None:
    ours = run_on_ranks(train_auto, world, compile, None)  # the real calibration on this machine's loopback
    theirs = run_on_ranks(train_torch, world)
    assert len({(r["fingerprint"], r["caps"]) for r in ours}) == 1, ours
    # Chosen at compile time, or eagerly at the first backward from its real ready times: where that choice cuts
    # the same buckets as the registration order (a loaded machine's timings can make it so), the plan in force
    # stays the registration one (PlanKeeper keeps an identical plan instead of rebuilding it).
    assert ours[0]["source"] in (("graph",) if compile else ("ready-order", "registration")), ours[0]
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine["state"], reference)


@pytest.mark.parametrize("compile", [None, "torch.compile"])
def test_the_choice_follows_the_link(compile: str | None) -> None:
    latency_bound = LinkModel(latency_s=0.5, seconds_per_byte=1e-12)  # every message costs a second
    # 10 Gbit/s and no latency: backward hides all but what is sent after it, so buckets start early.
    free_messages = LinkModel(latency_s=0.0, seconds_per_byte=8 / 1e10)
    few = run_on_ranks(train_auto, 2, compile, latency_bound)
    many = run_on_ranks(train_auto, 2, compile, free_messages)
    assert few[0]["buckets"] == 1, few[0]
    assert many[0]["buckets"] > 1, many[0]
    assert all(r["fingerprint"] == many[0]["fingerprint"] for r in many), many
