"""Parameters changed under the wrapper (``graphddp.runtime.placement``): replaced, added, unfrozen, reshaped or
re-placed after wrapping, each raises at the next forward on every rank, naming the parameter; PyTorch's DDP trains
on silently with those gradients never averaged."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp


def change(ddp: graphddp.DDP, what: str) -> None:
    module = ddp.module
    if what == "load_state_dict_assign":
        module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)
    elif what == "parameter_added":
        module.fc2.scale = torch.nn.Parameter(torch.ones(32))
    elif what == "unfrozen":
        module.fc1.bias.requires_grad_(True)
    elif what == "data_reshaped":
        module.fc3.bias.data = torch.zeros(3, module.fc3.bias.shape[0])
    elif what == "reassigned_itself":  # the same object registered again: nothing changed
        module.fc2.weight = module.fc2.weight
    else:
        raise ValueError(what)


def train_after(rank: int, world: int, what: str) -> str:
    """Train a step, change the module, train again: ``works`` or the error's text (the same on every rank)."""
    torch.manual_seed(0)
    model = MLP()
    model.fc1.bias.requires_grad_(False)  # a frozen parameter, for "unfrozen"
    ddp = graphddp.DDP(model, **CAPS)
    for step in range(2):
        x, y = batch_for(Case(), step, 0, rank)
        try:
            F.mse_loss(ddp(x), y).backward()
        except RuntimeError as e:
            return str(e).split(": ", 1)[1]  # without "[rank r] "
        if step == 0:
            change(ddp, what)
    return "works"


@pytest.mark.parametrize(
    ("what", "names"),
    [
        ("load_state_dict_assign", "'fc1.weight' was replaced by another tensor"),
        ("parameter_added", "'fc2.scale' was added after wrapping"),
        ("unfrozen", "'fc1.bias' was frozen when wrapped and now requires a gradient"),
        ("data_reshaped", "'fc3.bias' changed shape from"),
    ],
)
def test_a_parameter_changed_after_wrapping_raises_on_every_rank_naming_it(what: str, names: str) -> None:
    outcomes = run_on_ranks(train_after, 2, what)
    assert outcomes[0] == outcomes[1], outcomes
    assert names in outcomes[0] and "wrap the module again" in outcomes[0], outcomes[0]


def test_registering_the_same_parameter_again_changes_nothing() -> None:
    assert run_on_ranks(train_after, 2, "reassigned_itself") == ["works", "works"]


def warnings_of_local_backwards(rank: int, world: int) -> list[list[str]]:
    """The warnings of: a training step (none), a forward around the wrapper then backward (one), the same again
    (none: once per wrapper), a no_sync micro-step (expected local: none)."""
    import warnings

    torch.manual_seed(0)
    ddp = graphddp.DDP(MLP(), **CAPS)
    x, y = batch_for(Case(), 0, 0, rank)
    seen = []
    for how in ("step", "around", "around", "no_sync"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how in ("step", "no_sync"):
                with ddp.no_sync() if how == "no_sync" else contextlib.nullcontext():
                    F.mse_loss(ddp(x), y).backward()
            else:
                F.mse_loss(ddp.module(x), y).backward()
        seen.append([str(w.message) for w in caught if "graphddp" in str(w.message)])
    return seen


def test_training_around_the_wrapper_is_said_once_and_no_sync_is_not() -> None:
    for seen in run_on_ranks(warnings_of_local_backwards, 2):
        assert seen[0] == seen[2] == seen[3] == [], seen
        (message,) = seen[1]
        assert "with no forward through the wrapper" in message and "not averaged" in message, message
