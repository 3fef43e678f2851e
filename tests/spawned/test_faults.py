"""Faults and resources (issue "Faults and resources"): a frozen or stuck peer makes the survivors raise within the
process group's timeout, ranks that differ in ``requires_grad`` fail on every rank, and wrappers leave no
process groups, threads, file descriptors or gradient hooks behind."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from models import build_model
from ranks import expect_failure_on_every_rank, run_on_ranks, run_with_faults
from training import Case, batch_for, loss_for, wrap

import graphddp

PG_TIMEOUT_S = 5.0
"""What the test's user gives ``init_process_group(timeout=...)``."""


# -- a peer that freezes or stays stuck: the survivor raises within the user's timeout -------------------------------
def freeze_peer(rank: int, world: int, how: str, compile: str | None) -> tuple[str, float]:
    """Rank 1 freezes in the third backward (SIGSTOP, or a sleep after catching its own error); rank 0 goes on."""
    case = Case(model="bag", compile=compile, ddp=(("bucket_cap_mb", 0.001),), graphddp=(("first_bucket_cap_mb", 0.0005),))
    ddp, model = wrap("graphddp", case, rank)
    table = ddp.module.emb.weight  # row-sparse: its bucket's mask all-reduce is one of the collectives in flight

    def stop_in_backward(_param: torch.Tensor) -> None:
        if rank == 1 and step == 2:
            if how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)  # a rank that raised, caught it, and stays alive doing something else

    table.register_post_accumulate_grad_hook(stop_in_backward)
    for step in range(4):
        loss = loss_for(model, case, batch_for(case, step, 0, rank), rank)
        started = time.monotonic()
        try:
            loss.backward()
        except Exception as error:  # noqa: BLE001 (the survivor's error is what the test looks at)
            return f"{type(error).__name__}: {error}", time.monotonic() - started
    return "finished", 0.0


@pytest.mark.parametrize("compile", [None, pytest.param("torch.compile", marks=pytest.mark.slow)])  # compiled: slow suite
@pytest.mark.parametrize("how", ["sigstop", pytest.param("stuck", marks=pytest.mark.slow)])  # stuck: the slow suite (time)
def test_a_frozen_peer_makes_the_survivor_raise_within_the_process_groups_timeout(how: str, compile: str | None) -> None:
    outcomes = run_with_faults(freeze_peer, 2, how, compile, pg_timeout_s=PG_TIMEOUT_S, timeout=60, wait_for=(0,))
    assert 0 in outcomes, f"rank 0 did not raise within 60 s (the user's timeout is {PG_TIMEOUT_S:.0f} s): it hangs"
    ok, (message, elapsed) = outcomes[0]
    assert ok and message != "finished", outcomes[0]
    assert elapsed < PG_TIMEOUT_S + 10, f"rank 0 raised after {elapsed:.1f} s, not within the {PG_TIMEOUT_S:.0f} s timeout"
    assert 1 not in outcomes, "rank 1 was frozen and must not have answered"


# -- requires_grad differs across ranks --------------------------------------------------------------------------
def frozen_on_rank_1(rank: int, world: int) -> None:
    model = build_model("mlp")
    if rank == 1:
        model.fc1.weight.requires_grad_(False)
    graphddp.DDP(model)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_differ_in_requires_grad_raise_on_every_rank(world: int) -> None:
    errors = expect_failure_on_every_rank(frozen_on_rank_1, world, timeout=60)
    for rank, text in errors.items():
        assert "ModelMismatchError" in text and "fc1.weight" in text and "requires_grad" in text, (rank, text)


# -- nothing leaks ---------------------------------------------------------------------------------------------
def resources(module: torch.nn.Module) -> dict[str, int]:
    gc.collect()
    return {
        "threads": len(os.listdir("/proc/self/task")),  # C++ threads too (gloo's)
        "fds": len(os.listdir("/proc/self/fd")),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()),
    }


def wrap_many_times(rank: int, world: int, compile: str | None) -> tuple[dict[str, int], dict[str, int]]:
    case = Case(model="bag", compile=compile)
    module = build_model("bag")
    counts = []
    for i in range(21):
        ddp = graphddp.DDP(module)  # re-wrapping the same module: the previous wrapper is dropped
        model = torch.compile(ddp, backend=graphddp.backend("aot_eager")) if compile else ddp
        loss_for(model, case, batch_for(case, i, 0, rank), rank).backward()
        if i in (0, 20):
            counts.append(resources(module))
    return counts[0], counts[1]


@pytest.mark.parametrize("compile", [None, pytest.param("torch.compile", marks=pytest.mark.slow)])  # compiled: slow suite (10 s)
def test_dropped_wrappers_leave_no_groups_threads_fds_or_hooks(compile: str | None) -> None:
    for first, last in run_on_ranks(wrap_many_times, 2, compile, timeout=300):
        assert last["groups"] == first["groups"] and last["hooks"] == first["hooks"] == 3, (first, last)
        assert last["threads"] <= first["threads"] + 2 and last["fds"] <= first["fds"] + 4, (first, last)
