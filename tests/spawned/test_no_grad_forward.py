"""A forward without gradients between a training forward and its backward (a target computed by the same model
under ``no_grad``, as in DQN or FixMatch): as in PyTorch's DDP it leaves the training forward's backward to be
reduced, the delayed parameters' all-reduce included (Note [Reducer], step 1)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp


def train_with_a_target(rank: int, world: int, options: str) -> list[str]:
    """Three SGD steps, each ``q = ddp(x)``, ``t = ddp(x2)`` under ``no_grad``, ``mse(q, t).backward()``, for
    graphddp's DDP and PyTorch's side by side; the gradients compared each step; the warnings graphddp gave."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    kwargs: dict = {"find_unused_parameters": True} if options == "find_unused" else {}
    if options == "delayed":  # fc3 (its gradients come first) all-reduced once fc1.weight's gradient is in
        kwargs = {"delay_all_reduce_named_params": list(model.fc3.named_parameters(prefix="fc3")),
                  "param_to_hook_all_reduce": model.fc1.weight}  # fmt: skip
    ours = graphddp.DDP(model, **CAPS, **kwargs)
    torch._dynamo.reset()
    step_ours = torch.compile(ours, backend=graphddp.backend("aot_eager")) if options == "compiled" else ours
    if options == "delayed":
        kwargs = {"delay_all_reduce_named_params": list(twin.fc3.named_parameters(prefix="fc3")),
                  "param_to_hook_all_reduce": twin.fc1.weight}  # fmt: skip
    ref = torch.nn.parallel.DistributedDataParallel(twin, **kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, _ = batch_for(Case(), step, 0, rank)
            x2, _ = batch_for(Case(), step, 1, rank)
            for module in (step_ours, ref):
                q = module(x)
                with torch.no_grad():
                    target = module(x2)
                F.mse_loss(q, target + 1).backward()
            dist.barrier()  # PyTorch leaves its delayed Work unwaited; gloo's barrier waits for it
            for (name, p), r in zip(ours.module.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"rank {rank} step {step} {name}: {m}")
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return [str(w.message) for w in caught if "graphddp" in str(w.message)]


@pytest.mark.parametrize("options", ["default", "find_unused", "delayed", "compiled"])
def test_a_no_grad_forward_before_the_backward_leaves_it_reduced_as_pytorchs_ddp_does(options: str) -> None:
    for rank, warned in enumerate(run_on_ranks(train_with_a_target, 2, options, timeout=120)):
        assert warned == [], (rank, warned)
