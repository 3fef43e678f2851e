"""Swapping DDP the old way: rebinding ``torch.nn.parallel.DistributedDataParallel`` to graphddp's class. graphddp
binds PyTorch's class once, at import (``graphddp.runtime.torch_ddp``), so forwards, the compiled split (Dynamo's
DDP hook) and the refusals keep working, with PyTorch's DDP's gradients."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from models import IN, MLP, OUT
from ranks import run_on_ranks
from training import CAPS

import graphddp
from graphddp.runtime.torch_ddp import TorchDDP


def rebound(rank: int, world: int, compiled: bool) -> list[str]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    reference = TorchDDP(copy.deepcopy(model))
    saved = (torch.nn.parallel.DistributedDataParallel, torch.nn.parallel.distributed.DistributedDataParallel)
    torch.nn.parallel.DistributedDataParallel = graphddp.DDP  # what such scripts do
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, **CAPS)
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, IN, generator=g), torch.randn(4, OUT, generator=g)
            for module in (run, reference):
                F.mse_loss(module(x), y).backward()
            for p, q in zip(ddp.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            ddp.zero_grad(), reference.zero_grad()
        assert TorchDDP._get_active_ddp_module() is None  # every forward put the one before it back
        return [r.strategy for r in ddp.reducer.compile_target.reductions]
    finally:
        torch.nn.parallel.DistributedDataParallel = saved[0]


def test_rebinding_torchs_name_to_graphddp_trains_like_pytorch_ddp_eager_and_compiled() -> None:
    assert run_on_ranks(rebound, 2, False) == [[], []]
    assert run_on_ranks(rebound, 2, True) == [["in_graph"], ["in_graph"]]  # Dynamo's hook found graphddp's module
