"""``bench.as_ready.BareDDP`` (``bench.overhead``'s ``bare-ddp``) averages as PyTorch's DDP does: it is a DDP."""

from __future__ import annotations

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

from bench.as_ready import BareDDP, bucket_layout, ready_order


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def two_steps_both_ways(rank: int, world: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    bare_model, torch_model = _model(), _model()
    reference = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=1e-4)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch
    batches = [torch.randn(4, 6, generator=generator) for _ in range(3)]  # [B, 6]
    order = ready_order(bare_model, lambda: bare_model(batches[0]).sum().backward())
    bare_model.zero_grad(set_to_none=True)
    bare = BareDDP(bucket_layout(bare_model, order, "graphddp", 1e-4))  # a bucket per layer or so
    assert len(bare.buffers) > 1
    grads = []
    for x in batches[1:]:
        bare.step(lambda count, x=x: bare_model(x).sum().backward())
        reference(x).sum().backward()
        grads.append(([p.grad.clone() for p in bare_model.parameters()], [p.grad.clone() for p in torch_model.parameters()]))
        bare_model.zero_grad(set_to_none=True)
        torch_model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("world", [2, 3])
def test_bare_ddp_gives_pytorchs_averages(world: int) -> None:
    for rank, steps in enumerate(run_on_ranks(two_steps_both_ways, world)):
        for step, (bare, pytorchs) in enumerate(steps):
            for k, (ours, theirs) in enumerate(zip(bare, pytorchs)):
                torch.testing.assert_close(ours, theirs, msg=f"rank {rank}, step {step}, parameter {k}")
