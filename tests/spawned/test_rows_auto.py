"""``sparse_embedding_grads="auto"`` (the default) on spawned gloo ranks (Note [Row-sparse gradients], "When rows
pay"): every rank decides alike from the link measured at construction. The tied GPT's 512-row table goes dense
over loopback, eagerly and compiled, and as rows on a slow link; compiled, the graph reduces in-graph either way
(Note [Rows in the compiled backward]); training matches PyTorch's DDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from ranks import run_on_ranks
from training import Case, state_of, train

import graphddp.runtime.rows_rule
from graphddp.passes import LinkModel

SLOW = LinkModel.of_rate(1e6)  # 1 Mbit/s: the table's 64 KiB cost half a second dense
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
    return {
        "state": state_of(run.ddp.module),
        "fingerprint": plan.fingerprint,
        "rows": bool(plan.parts) or any(b.row_sparse for b in plan.buckets),
        "reductions": sorted({r.strategy for r in run.ddp.reducer.compile_target.reductions}),
    }


def train_torch(rank: int, world: int) -> dict:
    return state_of(train("torch", Case(model="gpt", steps=3), rank).ddp.module)


@pytest.mark.parametrize(("world", "compile", "link", "rows"), [
    (2, None, None, False),  # loopback, measured: 64 KiB save less than the mask's round trip
    (2, "torch.compile", None, False),
    (2, None, SLOW, True),
    (2, "torch.compile", SLOW, True),
    pytest.param(3, "torch.compile", None, False, marks=pytest.mark.slow),
])  # fmt: skip
def test_every_rank_decides_alike_and_trains_as_pytorchs_ddp(world: int, compile: str | None, link: LinkModel | None, rows: bool) -> None:
    ours = run_on_ranks(train_auto, world, compile, link)
    theirs = run_on_ranks(train_torch, world)
    assert len({r["fingerprint"] for r in ours}) == 1, ours
    assert {r["rows"] for r in ours} == {rows}, ours
    if compile is not None:  # rows or a dense table: nothing keeps the graph off in-graph reduction
        assert {tuple(r["reductions"]) for r in ours} == {("in_graph",)}, ours
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine["state"], reference)
