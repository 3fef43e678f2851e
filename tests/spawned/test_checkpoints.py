"""Distributed checkpoints (``dcp.save``/``dcp.load`` of ``get_model_state_dict``) move between graphddp, PyTorch's
DDP and the bare model in every direction, on spawned ranks writing one checkpoint (Note [Checkpoints])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from training import Case, batch_for

import graphddp


def wrapped(kind: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """``(what get/set_model_state_dict is given, the bare module)``."""
    torch.manual_seed(seed)
    module = MLP()
    if kind == "graphddp":
        return graphddp.DDP(module), module
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(module), module
    return module, module


def save_then_load(rank: int, world: int, source: str, target: str, directory: str) -> None:
    saver, saved = wrapped(source, seed=0)
    x, y = batch_for(Case(), 0, 0, 0)  # one batch everywhere: a bare saver stays the same on every rank
    F.mse_loss(saver(x), y).backward()
    torch.optim.SGD(saver.parameters(), lr=0.1).step()  # values no fresh model has
    dcp.save({"model": get_model_state_dict(saver)}, checkpoint_id=directory)

    loader, loaded = wrapped(target, seed=1)
    state = {"model": get_model_state_dict(loader)}
    assert sorted(state["model"]) == sorted(saved.state_dict()), "keys without the 'module.' prefix"
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(loader, state["model"])
    torch.testing.assert_close(loaded.state_dict(), saved.state_dict())


@pytest.mark.parametrize(
    ("source", "target"),
    [("graphddp", "torch"), ("torch", "graphddp"), ("graphddp", "bare"), ("bare", "graphddp"), ("graphddp", "graphddp")],
)
def test_dcp_checkpoints_move_between_graphddp_torch_ddp_and_the_bare_model(source: str, target: str, tmp_path) -> None:
    run_on_ranks(save_then_load, 2, source, target, str(tmp_path / "checkpoint"))
