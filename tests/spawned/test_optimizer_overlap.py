"""Optimizer steps during backward (Note [Optimizer overlap]) on spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
from models import build_model
from ranks import run_on_ranks
from torch import nn
from training import Case, batch_for, loss_for, state_of

import graphddp
from graphddp.runtime.trace import EventLog


def train_stepping_in_backward(rank: int, world: int, optim: str, model: str, overlap: bool, torch_ddp: bool = False) -> tuple[dict, list]:
    case = Case(model=model, optim=optim, ddp=(("bucket_cap_mb", 0.002),), graphddp=(("first_bucket_cap_mb", 0.001),))
    if torch_ddp:  # the reference: PyTorch's DDP and opt.step() after backward
        ddp: nn.Module = nn.parallel.DistributedDataParallel(build_model(model), find_unused_parameters=model == "branchy", **dict(case.ddp))
    else:
        ddp = graphddp.DDP(build_model(model), find_unused_parameters=model == "branchy", **dict(case.ddp), **dict(case.graphddp))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01) if optim == "adamw" else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # the optimizer's own groups change
    if overlap:
        ddp.step_in_backward(opt)
    log = EventLog()
    if not torch_ddp:
        ddp.reducer.events = log
    for step in range(5):
        loss_for(ddp, case, batch_for(case, step, 0, rank), rank).backward()
        if not overlap:
            opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
    if torch_ddp:
        return state_of(ddp.module) | {f"state/{k}": v for k, v in _flat_state(opt).items()}, []
    last = [(e.kind, e.bucket) for e in log.events if e.kind in ("wait", "stepped")][-2 * len(ddp.bucket_plan.buckets):]
    return state_of(ddp.module) | {f"state/{k}": v for k, v in _flat_state(opt).items()}, last


def _flat_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(("optim", "model", "world"), [("sgd", "mlp", 2), ("adamw", "mlp", 3), ("adamw", "branchy", 2)])
def test_stepping_in_backward_equals_optimizer_step_and_overlaps_the_waits(optim: str, model: str, world: int) -> None:
    overlapped = run_on_ranks(train_stepping_in_backward, world, optim, model, True)
    plain = run_on_ranks(train_stepping_in_backward, world, optim, model, False)
    pytorchs = run_on_ranks(train_stepping_in_backward, world, optim, model, False, True)
    for (ours, events), (theirs, _), (reference, _) in zip(overlapped, plain, pytorchs):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # parameters and optimizer state, bitwise
        torch.testing.assert_close(ours, reference)  # and PyTorch's DDP stepping after backward
        waits = [k for kind, k in events if kind == "wait"]
        stepped = [k for kind, k in events if kind == "stepped"]
        assert sorted(stepped) == sorted(waits) and len(waits) > 1, events
        if model == "mlp":  # every parameter used here: the first bucket awaited is stepped before the last is awaited
            # (which bucket is done first is the collectives' race: gloo runs two at once, and 3 ranks share 2 CPUs)
            assert events.index(("stepped", waits[0])) < events.index(("wait", waits[-1])), events


def test_stepping_in_backward_refuses_optimizers_that_read_every_gradient() -> None:
    run_on_ranks(refuse_lbfgs, 2)


def refuse_lbfgs(rank: int, world: int) -> None:
    ddp = graphddp.DDP(build_model("mlp"))
    with pytest.raises(TypeError, match="LBFGS is not one of the optimizers that update each parameter"):
        ddp.step_in_backward(torch.optim.LBFGS(ddp.parameters()))
    with pytest.raises(ValueError, match="does not synchronise"):
        ddp.step_in_backward(torch.optim.SGD([*ddp.parameters(), nn.Parameter(torch.ones(2))], lr=0.1))
    # A frozen parameter (never a gradient, never in a bucket) in an optimizer built from model.parameters(): fine.
    model = build_model("mlp")
    next(model.parameters()).requires_grad_(False)
    graphddp.DDP(model).step_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
