"""Note [Gradient pieces]: compiled in-graph, a weight gradient larger than its bucket's cap is computed and sent
in blocks of rows, each its own all-reduce, with the gradients of PyTorch's DDP and of one process that sees every
batch (up to float summation order) on 2 and 3 gloo ranks, under aot_eager and Inductor."""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F
from models import Wide
from ranks import run_on_ranks
from torch import nn

import graphddp

CAPS = {"bucket_cap_mb": 4 / 1024, "first_bucket_cap_mb": 4 / 1024, "last_bucket_cap_mb": 4 / 1024}
"""4 KiB caps: ``Wide``'s 16 KiB weight goes in 4 blocks of 64 rows."""


class BigFirst(nn.Module):
    """``Wide`` without its last layer: the 16 KiB weight's gradient is the first backward makes, so it opens the
    first bucket, where its blocks grow as the head ramp does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.big = nn.Linear(8, 16), nn.Linear(16, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(torch.relu(self.a(x)))


LAYOUTS = {
    "even": (Wide, CAPS, [64] * 4),
    # A 2 KiB first cap growing to the 8 KiB middle cap: blocks of 2, 4, 8 KiB, then the 2 KiB left (64-byte rows).
    "growing": (BigFirst, {"bucket_cap_mb": 8 / 1024, "first_bucket_cap_mb": 2 / 1024, "last_bucket_cap_mb": 1 / 1024}, [32, 64, 128, 32]),
    # The tail ramp from a 1 KiB last cap: ``a`` in the last bucket, the big weight in the 2 KiB one before it, in
    # the growing blocks reversed: the 2 KiB left, then 8, 4, 2 KiB.
    "shrinking": (Wide, {"bucket_cap_mb": 8 / 1024, "first_bucket_cap_mb": 4 / 1024, "last_bucket_cap_mb": 1 / 1024}, [32, 128, 64, 32]),
}
"""The model, graphddp's caps and the rows of the big weight's blocks: every block at the bucket's cap, blocks
that grow (``Bucket.blocks_grow_to``) or that shrink (``Bucket.blocks_shrink_from``)."""


def train_in_pieces(rank: int, world: int, inner: str, layout: str) -> dict[str, int]:
    """Five Adam steps beside PyTorch's DDP and one process that sees every rank's batch, parameters compared
    after each; the all-reduces in the compiled backward and the buckets of the plan."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model_class, caps, rows = LAYOUTS[layout]
    model = model_class()
    ref, single = nn.parallel.DistributedDataParallel(copy.deepcopy(model)), copy.deepcopy(model)
    ddp = graphddp.DDP(model, **caps)
    dump = tempfile.mkdtemp(prefix=f"pieces-{rank}-")
    compiled = torch.compile(ddp, backend=graphddp.backend(inner, reduction="in_graph", debug_dir=dump))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ddp, ref, single)]
    outputs = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features  # the targets' width
    for step in range(5):
        batches = [batch(step, r, outputs) for r in range(world)]
        x, y = batches[rank]
        for module in (compiled, ref):
            F.mse_loss(module(x), y).backward()
        F.mse_loss(single(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        for p, q, s in zip(ddp.parameters(), ref.parameters(), single.parameters()):
            torch.testing.assert_close(p.grad, q.grad)  # averaged alike: blocks are the whole gradient's rows
            torch.testing.assert_close(p.grad, s.grad)  # equal batches: the mean of means is the mean
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    (backward,) = pathlib.Path(dump).rglob("in_graph.backward.py")
    code = backward.read_text()
    reduces = len(re.findall(r"_c10d_functional\.all_reduce\.default\(", code))
    in_place = len(re.findall(r"graphddp\.reduce_block_\.default\(", code))  # Note [Blocks written in place]
    waits = len(re.findall(r"graphddp\.wait_blocks_\.default\(", code))
    records = [json.loads(p.read_text()) for p in pathlib.Path(dump).rglob("plan.json")]
    shown = [b["in_graph_pieces"] for r in records for b in r["buckets"] if b["in_graph_pieces"]]
    expected = {"param": "big.weight", "rows": rows, "blocks": layout}  # the dump says so, and which ramp cut them
    assert shown and all(s == expected for s in shown), shown
    shutil.rmtree(dump)
    pieces = [b.pieces for b in ddp.bucket_plan.buckets if b.pieces is not None]
    blocks = sum(len(rows) for _, rows in pieces)
    return {"reduces": reduces, "in_place": in_place, "waits": waits, "buckets": len(ddp.bucket_plan.buckets), "blocks": blocks}


def batch(step: int, rank: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(12, 8, generator=g), torch.randn(12, outputs, generator=g)


def check(records: list[dict[str, int]]) -> None:
    for record in records:
        assert record["blocks"] == 4, record  # big.weight: 16 KiB in 4 blocks
        # Block 0 goes with the bias, functionally; blocks 1-3 are written into the gradient and sent from there,
        # and one wait_blocks_ takes the place of the cat that copied them together (Note [Blocks written in place])
        assert record["reduces"] == record["buckets"], record
        assert (record["in_place"], record["waits"]) == (record["blocks"] - 1, 1), record


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_big_weight_gradient_goes_in_blocks_with_pytorchs_gradients(layout: str) -> None:
    check(run_on_ranks(train_in_pieces, 2, "aot_eager", layout))


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("world", "inner"), [(3, "aot_eager"), (2, "inductor")])
def test_blocks_on_three_ranks_and_under_inductor(world: int, inner: str, layout: str) -> None:
    check(run_on_ranks(train_in_pieces, world, inner, layout))


def train_stepping_in_pieces(rank: int, world: int, inner: str, layout: str) -> list[int]:
    """``step_in_backward`` with the big gradient in blocks: parameters and AdamW's state against PyTorch's DDP and
    ``optimizer.step()`` after each of five steps; per step, how many blocks were stepped on their own (Note
    [Steps by rows])."""
    from graphddp.runtime.optimizer_overlap import StepPerBucket

    torch._dynamo.reset()
    torch.manual_seed(0)
    model_class, caps, _ = LAYOUTS[layout]
    model = model_class()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = graphddp.DDP(model, **caps)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ddp, ref))
    ddp.step_in_backward(opt)
    compiled = torch.compile(ddp, backend=graphddp.backend(inner, reduction="in_graph"))
    outputs = [m for m in model.modules() if isinstance(m, nn.Linear)][-1].out_features
    stepped, step_rows = [], StepPerBucket.step_rows

    def counting(self: StepPerBucket, *args: object) -> None:
        stepped[-1] += 1
        return step_rows(self, *args)

    StepPerBucket.step_rows = counting  # type: ignore[method-assign]
    try:
        for step in range(5):
            stepped.append(0)
            x, y = batch(step, rank, outputs)
            for module in (compiled, ref):
                F.mse_loss(module(x), y).backward()
            ref_opt.step()
            opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key])
    finally:
        StepPerBucket.step_rows = step_rows  # type: ignore[method-assign]
    return stepped


@pytest.mark.parametrize("layout", ["shrinking", pytest.param("growing", marks=pytest.mark.slow)])
@pytest.mark.parametrize(("world", "inner"), [(2, "aot_eager"), pytest.param(3, "aot_eager", marks=pytest.mark.slow),
                                              pytest.param(2, "inductor", marks=pytest.mark.slow)])  # fmt: skip
def test_a_big_gradients_blocks_are_stepped_as_they_come_in(world: int, inner: str, layout: str) -> None:
    for stepped in run_on_ranks(train_stepping_in_pieces, world, inner, layout):
        # The first step runs split (the plan is agreed during it): the Reducer steps each bucket whole. Then
        # in-graph: block 0 (sent with the bias, waited for already) stepped first, blocks 1-3 as their waits return.
        assert stepped == [0, 4, 4, 4, 4], stepped
