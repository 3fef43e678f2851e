"""``gradient_as_bucket_view`` on spawned gloo ranks: gradients are views into the buckets' buffers (the rebuilt
ones too), which saves one gradient-sized copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp


def held_grad_bytes(ddp: graphddp.DDP) -> int:
    """Bytes of distinct storages that gradients and bucket buffers keep alive."""
    storages = {b.buffer.untyped_storage().data_ptr(): b.buffer.untyped_storage().nbytes() for b in ddp.reducer.buckets}
    for p in ddp.parameters():
        if p.grad is not None:
            storages[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    return sum(storages.values())


def bucket_views_and_memory(rank: int, world: int) -> dict[str, int]:
    result = {}
    for as_view in (False, True):
        torch.manual_seed(0)
        ddp = graphddp.DDP(MLP(), gradient_as_bucket_view=as_view, **CAPS)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):  # step 1 runs on the rebuilt plan: views must follow the new buffers
            x, y = batch_for(Case(), step, 0, rank)
            F.mse_loss(ddp(x), y).backward()
            for bucket in ddp.reducer.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    is_view = p.grad.data_ptr() == view.data_ptr() and p.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
                    assert is_view == as_view, (step, as_view)
            result[f"view={as_view}"] = held_grad_bytes(ddp)
            opt.step()
            opt.zero_grad(set_to_none=True)
        result["params"] = sum(p.numel() * p.element_size() for p in ddp.parameters())
        # the plan agreement's room after the last bucket's gradients (Note [The agreement rides a bucket])
        result["room"] = sum(b.room * b.buffer.element_size() for b in ddp.reducer.buckets)
    return result


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: slow suite (time)
def test_gradient_as_bucket_view_saves_one_gradient_sized_copy(world: int) -> None:
    for r in run_on_ranks(bucket_views_and_memory, world):
        assert r["view=True"] == r["params"] + r["room"]
        assert r["view=False"] == 2 * r["params"] + r["room"]
        assert 0 < r["room"] < 0.05 * r["params"]
