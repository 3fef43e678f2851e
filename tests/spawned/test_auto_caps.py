"""``bucket_cap_mb="auto"`` on spawned gloo ranks (Note [Automatic caps]): every rank chooses the same caps,
eager from the first backward and compiled from the graph; the choice follows the link; training is unchanged
(parity with PyTorch's DDP)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
import torch
from ranks import run_on_ranks
from training import Case, graphddp_warnings, state_of, train

import graphddp.runtime.auto_caps
from graphddp.passes import ComputeRates, LinkModel

AUTO = (("bucket_cap_mb", "auto"), ("first_bucket_cap_mb", "auto"), ("last_bucket_cap_mb", "auto"))
MODEL = "w:mlp:small"  # ~4 MB of gradients: enough for the candidates (0.25 MiB and up) to differ
RATES = ComputeRates(flops_per_s=2e10, bytes_per_s=5e9)


@contextlib.contextmanager
def measured_as(link: LinkModel | None, rates: ComputeRates = RATES) -> Iterator[None]:
    """Replace the calibration's measurements (rank processes are reused: restored after)."""
    if link is None:
        yield
        return
    saved = graphddp.runtime.auto_caps.link_of, graphddp.runtime.auto_caps.compute_rates, graphddp.runtime.auto_caps.cpu_cost_of_communication
    graphddp.runtime.auto_caps.link_of = lambda group, device=None: link
    graphddp.runtime.auto_caps.compute_rates = lambda group, device=None: rates
    graphddp.runtime.auto_caps.cpu_cost_of_communication = lambda group, link=None: 0.0
    try:
        yield
    finally:
        graphddp.runtime.auto_caps.link_of, graphddp.runtime.auto_caps.compute_rates, graphddp.runtime.auto_caps.cpu_cost_of_communication = saved


def train_auto(rank: int, world: int, compile: str | None, link: LinkModel | None, hook: str | None = None, hook_at: int = 0) -> dict:
    case = Case(model=MODEL, steps=3, graphddp=AUTO, compile=compile, hook=hook, hook_at=hook_at)
    with measured_as(link), graphddp_warnings() as warnings:
        run = train("graphddp", case, rank)
    plan = run.ddp.bucket_plan
    chosen = [c.caps.mb for c in run.ddp.automatic_caps.choices]  # each choice made, kept for the bench and logs
    # Compiled, the choice cuts the graph's own plan (the module's plan keeps the standing caps).
    planned = list(run.ddp.reducer.plans.graph_plans.caps_by_graph().values()) if compile else [plan.caps.mb]
    return {
        "state": state_of(run.ddp.module), "fingerprint": plan.fingerprint, "caps": plan.caps, "source": plan.source,
        "buckets": len(plan.buckets), "chosen": chosen, "planned": planned, "records": run.ddp.automatic_caps.as_record()["choices"],
        "warnings": warnings,
    }  # fmt: skip


def train_torch(rank: int, world: int) -> dict:
    return state_of(train("torch", Case(model=MODEL, steps=3), rank).ddp.module)


@pytest.mark.parametrize(("world", "compile"), [(2, None), pytest.param(3, None, marks=pytest.mark.slow), (2, "torch.compile")])
def test_every_rank_chooses_the_same_caps_and_trains_as_pytorchs_ddp(world: int, compile: str | None) -> None:
    ours = run_on_ranks(train_auto, world, compile, None)  # the real calibration on this machine's loopback
    theirs = run_on_ranks(train_torch, world)
    assert len({(r["fingerprint"], r["caps"]) for r in ours}) == 1, ours
    # One choice each, whose caps cut the plan in force (eager: unless they cut the registration order's buckets,
    # which then stay, below).
    assert all(len(r["chosen"]) == 1 and (r["chosen"] == r["planned"] or r["source"] == "registration") for r in ours), ours
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


def test_a_compressing_hooks_buckets_are_predicted_as_it_sends_them() -> None:
    """Note [Automatic caps]: under ``fp16_compress_hook`` every choice is made on the bytes the hook sends, half
    the fp32 gradients' (compiled, from the same mocked rates: the standing caps' step predicted shorter)."""
    link = LinkModel(latency_s=1e-4, seconds_per_byte=8 / 1e8)  # 100 Mbit/s: the bytes weigh
    records = {}
    for compile in (None, "torch.compile"):
        (records[compile],) = run_on_ranks(train_auto, 2, compile, link, "fp16")[0]["records"]
        assert records[compile]["wire"] == "float16" and records[compile]["source"] == ("graph" if compile else "first backward"), records
    (whole,) = run_on_ranks(train_auto, 2, "torch.compile", link)[0]["records"]
    assert whole["wire"] is None and records["torch.compile"]["standing_ms"] < 0.75 * whole["standing_ms"], (records, whole)
    # A hook registered once the caps were chosen changes nothing, and says so.
    late = run_on_ranks(train_auto, 2, None, link, "fp16", 2)
    for rank, run in enumerate(late):
        (record,) = run["records"]
        assert record["wire"] is None, record
        assert any(f"[rank {rank}] graphddp: a comm hook that sends buckets in torch.float16 was registered after the automatic caps" in w for w in run["warnings"]), run["warnings"]


# Ranks whose first compiled inputs differ in shape estimate other backwards from their graphs. Stood in for here
# by other compute rates per rank (a workload draws batches of its own size): rank 0 estimates a backward so short
# that one bucket is fastest on messages that cost 2 ms (100/100/100 MiB); rank 1 one of ~20 ms, which the
# default caps overlap within the margin of the best (it keeps 25/1/1 MiB). So each rank chooses other caps from
# its own graph, as other shapes would.
SLOW_MESSAGES = LinkModel(latency_s=2e-3, seconds_per_byte=1e-9)


def rates_of(rank: int) -> ComputeRates:
    return ComputeRates(flops_per_s=2e13 / 1000**rank, bytes_per_s=5e12 / 1000**rank)


def train_with_own_estimates(rank: int, world: int, model: str) -> dict:
    case = Case(model=model, steps=3, graphddp=AUTO, compile="torch.compile")
    with graphddp_warnings() as warnings:
        try:
            with measured_as(SLOW_MESSAGES, rates_of(rank)):
                run = train("graphddp", case, rank)
        except RuntimeError as e:
            return {"error": str(e)}
    plan = run.ddp.bucket_plan
    return {"state": state_of(run.ddp.module), "fingerprint": plan.fingerprint, "source": plan.source, "warnings": warnings}


def test_ranks_whose_automatic_caps_differ_adopt_rank_0s_plan_and_are_told_why() -> None:
    """A compiled graph's automatic caps are each rank's own choice from its own shapes (Note [Automatic caps]):
    where they differ, the plan agreement adopts rank 0's plan, reduced split, trains as PyTorch's DDP, and warns
    naming each rank's caps."""
    ours = run_on_ranks(train_with_own_estimates, 2, MODEL)
    theirs = run_on_ranks(train_torch, 2)
    assert ours[0]["fingerprint"] == ours[1]["fingerprint"] and ours[0]["source"] == "graph", ours
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine["state"], reference)
    (warning,) = [m for m in ours[1]["warnings"] if "left to 'auto'" in m]
    assert "cut into other buckets; every rank adopts rank 0's bucket plan" in warning, warning
    caps = re.findall(r"rank (\d): ([\d./]+) MiB", warning)
    assert [r for r, _ in caps] == ["0", "1"] and caps[0][1] != caps[1][1], warning
    assert "give bucket_cap_mb, first_bucket_cap_mb, last_bucket_cap_mb a number" in warning, warning


def test_tied_tables_parts_with_automatic_caps_that_differ_raise_naming_the_cause() -> None:
    """Parts of a tied table name one rank's graph nodes, so rank 0's plan cannot serve the others: every rank
    raises, and the error says the automatic caps differ and what to do."""
    errors = [r.get("error", "") for r in run_on_ranks(train_with_own_estimates, 2, "w:gpt:small")]
    for error in errors:
        assert "the ranks compiled different bucket plans" in error and "The caps left to 'auto'" in error, error
        assert "pad them to one length" in error and "Every rank must capture graphs of the same parameters" not in error, error
