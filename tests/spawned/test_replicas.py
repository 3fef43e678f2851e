"""Replicas that drift apart (``graphddp.runtime.replicas``): silent in both DDPs; with ``check_replicas_every``
(or ``graphddp.check_replicas``) every rank raises the same error naming the first parameter that differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from ranks import run_on_ranks
from training import CAPS, Case, batch_for

import graphddp
from graphddp.runtime.replicas import ReplicasDiffer, digest


def drift(rank: int, world: int, every: int) -> list[str]:
    """Train 3 steps; after the first, rank 1 alone changes fc2.bias in place (a checkpoint loaded on one rank).
    Returns what each step and an explicit check said."""
    torch.manual_seed(0)
    ddp = graphddp.DDP(MLP(), **CAPS, check_replicas_every=every)
    said = []
    for step in range(3):
        x, y = batch_for(Case(), step, 0, rank)
        try:
            F.mse_loss(ddp(x), y).backward()
            said.append("trained")
        except ReplicasDiffer as e:
            said.append(str(e).split(": ", 1)[1])
            break
        if step == 0 and rank == 1:
            with torch.no_grad():
                ddp.module.fc2.bias[3] += 1e-3
    try:
        graphddp.check_replicas(ddp)
        said.append("same")
    except ReplicasDiffer as e:
        said.append(str(e).split(": ", 1)[1])
    return said


def test_replicas_that_drift_apart_are_named_on_every_rank() -> None:
    zero, one = run_on_ranks(drift, 2, 2)
    assert zero == one, (zero, one)
    assert zero[0] == "trained" and len(zero) == 3, zero  # step 1 is the 2nd training forward: checked, raised
    assert "the replicas differ: 1 parameter(s), the first 'fc2.bias'" in zero[1], zero
    assert "'fc2.bias'" in zero[2], zero  # the explicit check says the same


def test_without_the_option_nothing_is_checked_but_the_explicit_check_still_finds_it() -> None:
    zero, one = run_on_ranks(drift, 2, 0)
    assert zero[:3] == one[:3] == ["trained"] * 3, (zero, one)
    assert "'fc2.bias'" in zero[3] and zero[3] == one[3]


def test_the_digest_sees_one_changed_element_and_only_that() -> None:
    t = torch.randn(1000)
    u = t.clone()
    assert digest(t) == digest(u)
    u[123] = torch.nextafter(u[123], torch.tensor(float("inf")))  # one ulp
    assert digest(t) != digest(u)
    assert digest(torch.randn(8, dtype=torch.bfloat16)).dtype == torch.int64


def test_check_replicas_every_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="check_replicas_every must be a whole number of forwards >= 0"):
        graphddp.DDPOptions(check_replicas_every=-1)
