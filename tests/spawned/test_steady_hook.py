"""The hook that only counts (Note [Hook that only counts]): in steady state a backward takes the Reducer's full
path once (its first hook) and counts every other gradient, with the same gradients as PyTorch's DDP.

The other spawned tests record events, which keeps the hooks on the full path: these run without a recorder."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp
from graphddp.runtime import countdown


def steady_backwards(rank: int, world: int, find_unused: bool) -> list[tuple[str, int]]:
    """Per step: whether it synchronised, and how many gradients took the full path; asserts parity throughout."""
    torch.manual_seed(0)
    model = MLP()
    ddp = graphddp.DDP(copy.deepcopy(model), find_unused_parameters=find_unused, **CAPS)
    ref = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    full_path = countdown._full_path
    taken = []

    def counted(countdown_ref, index):  # the hook looks the name up at each call
        taken.append(index)
        full_path(countdown_ref, index)

    countdown._full_path = counted
    record = []
    try:
        for step in range(6):
            sync = step != 3  # one no_sync micro-step: every gradient takes the full path, nothing is sent
            x, y = batch_for(Case(), step, 0, rank)
            taken.clear()
            for module in (ddp, ref):
                with contextlib.nullcontext() if sync else module.no_sync():
                    F.mse_loss(module(x), y).backward()
            record.append(("sync" if sync else "no_sync", len(taken)))
            if sync:
                for p, q in zip(ddp.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad)
                for module in (ddp, ref):
                    module.zero_grad(set_to_none=True)
    finally:
        countdown._full_path = full_path
    return record


def test_steady_backwards_take_the_full_path_once_and_match_pytorch() -> None:
    for find_unused in (False, True):
        for record in run_on_ranks(steady_backwards, 2, find_unused):
            params = len(list(MLP().parameters()))
            assert record[0] == ("sync", params)  # the first backward learns the ready order: every gradient
            assert record[3] == ("no_sync", params)  # no DDP forward prepared it: every gradient
            # Steady: only the first hook of each backward (agreement, ending), the other gradients only count.
            assert [r for i, r in enumerate(record) if i not in (0, 3)][1:] == [("sync", 1)] * 3, record
