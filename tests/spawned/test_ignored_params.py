"""Parameters and buffers kept local (``_set_params_and_buffers_to_ignore_for_model``), eager and compiled, on
spawned gloo ranks: neither broadcast nor reduced."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from training import Case, train

IGNORED = ("fc2.weight", "bn.running_mean")


def train_with_ignored(rank: int, world: int, compile: str | None) -> dict[str, object]:
    torch._dynamo.reset()
    case = Case(
        model="bn", ignore=IGNORED, steps=4, compile=compile, ddp=(("bucket_cap_mb", 0.002),),
        graphddp=(("first_bucket_cap_mb", 0.001), ("last_bucket_cap_mb", 0.0005)),
    )
    ours = train("graphddp", case, rank)
    theirs = train("torch", case, rank)
    torch.testing.assert_close(ours.ddp.module.state_dict(), theirs.ddp.module.state_dict())
    state = {k: v.detach().clone() for k, v in ours.ddp.module.named_parameters()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, state)
    differ = sorted(k for k in state if not torch.equal(gathered[0][k], gathered[1][k]))
    reduced = sorted(ours.ddp.bucket_plan.param_names)
    return {"differ": differ, "reduced": reduced, "segments": [s.num_segments for s in ours.ddp.reducer.splits]}


@pytest.mark.parametrize("compile", [None, "torch.compile"])
def test_ignored_parameters_and_buffers_are_neither_broadcast_nor_reduced(compile: str | None) -> None:
    results = run_on_ranks(train_with_ignored, 2, compile, timeout=300)
    for result in results:
        # The ignored weight started different and trained on local gradients. (The ignored running mean is
        # shown local by the parity with PyTorch's DDP: broadcasting it would change rank 1's.)
        assert result["differ"] == ["fc2.weight"], result["differ"]
        assert "fc2.weight" not in result["reduced"] and "fc1.weight" in result["reduced"]
        if compile:
            assert result["segments"] and all(n > 1 for n in result["segments"]), result["segments"]
