"""``sparse_embedding_grads="auto"`` (the default) on spawned gloo ranks (Note [Row-sparse gradients], "When rows
pay"): every rank decides alike from the link measured at construction. The tied GPT's 512-row table goes dense
on a fast link, eagerly and compiled, and as rows on a slow link; compiled, the graph reduces in-graph either way
(Note [Rows in the compiled backward]); training matches PyTorch's DDP. Over loopback, measured for real, the
64 KiB table is a close call (its dense bytes against the mask's round trip and half the rows: on one VM it went
dense, on another rows), so there the test holds the verdict to ``rows_pay`` on the link the ranks measured."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from ranks import run_on_ranks
from training import Case, state_of, train

import graphddp.runtime.calibration
import graphddp.runtime.rows_rule
from graphddp.passes import LinkModel, rows_pay

SLOW = LinkModel.of_rate(1e6)  # 1 Mbit/s: the table's 64 KiB cost half a second dense
FAST = LinkModel.of_rate(100e9, latency_s=100e-6)  # 100 Gbit/s: 64 KiB dense in 5 us, less than a round trip
AUTO = (("sparse_embedding_grads", "auto"),)


@contextlib.contextmanager
def measured_as(link: LinkModel | None) -> Iterator[None]:
    """Replace the link measurement (rank processes are reused: restored after); None: measure for real."""
    if link is None:
        yield
        return
    saved = graphddp.runtime.rows_rule.link_of
    graphddp.runtime.rows_rule.link_of = lambda group, device=None: link
    try:
        yield
    finally:
        graphddp.runtime.rows_rule.link_of = saved


def train_auto(rank: int, world: int, compile: str | None, link: LinkModel | None) -> dict:
    case = Case(model="gpt", steps=3, graphddp=AUTO, compile=compile, record_events=False)
    with measured_as(link):
        run = train("graphddp", case, rank)
    plan = run.ddp.bucket_plan
    measured = graphddp.runtime.calibration.link_of(run.ddp.process_group) if link is None else link  # cached at construction
    table = run.ddp.module.wte.weight
    return {
        "pays": rows_pay([(table.shape[0], table.shape[1] * table.element_size())], link=measured, world=world).rows,
        "state": state_of(run.ddp.module),
        "fingerprint": plan.fingerprint,
        "rows": bool(plan.parts) or any(b.row_sparse for b in plan.buckets),
        "reductions": sorted({r.strategy for r in run.ddp.reducer.compile_target.reductions}),
    }


def train_torch(rank: int, world: int) -> dict:
    return state_of(train("torch", Case(model="gpt", steps=3), rank).ddp.module)


@pytest.mark.parametrize(("world", "compile", "link", "rows"), [
    (2, None, None, None),  # loopback, measured: whatever rows_pay says of the measured link
    (2, "torch.compile", None, None),
    (2, None, FAST, False),  # 64 KiB dense cost less than the mask's round trip
    (2, "torch.compile", FAST, False),
    (2, None, SLOW, True),
    (2, "torch.compile", SLOW, True),
    pytest.param(3, "torch.compile", None, None, marks=pytest.mark.slow),
])  # fmt: skip
def test_every_rank_decides_alike_and_trains_as_pytorchs_ddp(world: int, compile: str | None, link: LinkModel | None, rows: bool | None) -> None:
    ours = run_on_ranks(train_auto, world, compile, link)
    theirs = run_on_ranks(train_torch, world)
    assert len({r["fingerprint"] for r in ours}) == 1, ours
    assert len({r["pays"] for r in ours}) == 1, "ranks measured different links"
    pays = ours[0]["pays"]
    if rows is not None:  # a pinned link: the case says what rows_pay must say of it
        assert pays == rows, f"rows_pay on {link} says {pays}, the case expects {rows}"
    assert {r["rows"] for r in ours} == {pays}, ours
    if compile is not None:  # rows or a dense table: nothing keeps the graph off in-graph reduction
        assert {tuple(r["reductions"]) for r in ours} == {("in_graph",)}, ours
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine["state"], reference)
