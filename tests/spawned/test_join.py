"""``join()`` on spawned gloo ranks: early termination raises on every rank; replica checks, compiled graphs, a static
graph and skipped buckets with ranks that run out of data (one with no batch at all), trained on after the join."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models import MLP, build_model
from ranks import expect_failure_on_every_rank, run_on_ranks
from training import CAPS, RAMPED, TINY_CAPS, Case, batch_for, loss_for, make_optimizer, state_of, wrap

import graphddp


def join_throws_early(rank: int, world: int) -> None:
    ddp = graphddp.DDP(MLP(), **CAPS)
    with ddp.join(throw_on_early_termination=True):
        for step in range(2 + rank):
            x, y = batch_for(Case(), step, 0, rank)
            F.mse_loss(ddp(x), y).backward()


@pytest.mark.parametrize("world", [2, 3])
def test_join_throw_on_early_termination_raises_on_every_rank(world: int) -> None:
    errors = expect_failure_on_every_rank(join_throws_early, world, timeout=60)
    assert "Rank 0 exhausted all inputs" in errors[0]
    for rank in range(1, world):
        assert "Detected at least one rank that exhausted inputs" in errors[rank]


def join_with_replica_checks(rank: int, world: int, steps_on_rank_0: int) -> None:
    """``check_replicas_every=1`` with ``join()``: rank 0 trains ``steps_on_rank_0`` steps in a join (the others
    two more), then every rank trains two steps more, the replicas checked before each. Raises or hangs on error."""
    ddp = graphddp.DDP(MLP(), **CAPS, check_replicas_every=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for step in range(steps_on_rank_0 + 2 * (rank > 0)):
            x, y = batch_for(Case(), step, 0, rank)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    for step in range(2):  # after the join the replicas agree again (its end broadcasts the model)
        x, y = batch_for(Case(), step, 1, rank)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("steps_on_rank_0", [3, 0])
def test_join_with_replica_checks_and_uneven_inputs_trains_on(steps_on_rank_0: int) -> None:
    """While a rank has joined the replicas differ by design (it takes no step): no check runs in a join, and
    the counts stay alike on every rank, so the checks after it run at the same forward everywhere. A rank with
    no batch at all (0) joins before any backward of its own."""
    run_on_ranks(join_with_replica_checks, 2, steps_on_rank_0, timeout=60)


def join_then_two_more(ddp: torch.nn.Module, model: torch.nn.Module, case: Case, rank: int, steps_in_join: int) -> None:
    """``steps_in_join`` steps of ``model`` (``ddp``, or ``ddp`` compiled) inside ``ddp.join()``, then two more
    after it, with ``case``'s optimizer and batches (epoch 0, then 1)."""
    opt = make_optimizer(model.parameters(), case)
    for epoch, count in enumerate((steps_in_join, 2)):
        with ddp.join() if epoch == 0 else contextlib.nullcontext():
            for step in range(count):
                loss_for(model, case, batch_for(case, step, epoch, rank), rank).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)


def compiled_join_then_train(rank: int, world: int, steps_on_rank_0: int) -> list[str]:
    """Compiled: rank r trains ``steps_on_rank_0 + r`` steps inside ``join()`` (rank 0 none at all with 0: it
    never compiles a graph before the others' first agreement), then every rank trains two steps more. Against
    PyTorch's DDP doing the same eagerly; returns the adopted plan's parameters (alike on every rank)."""
    case = Case(ddp=TINY_CAPS, graphddp=RAMPED, compile="torch.compile", record_events=False)
    torch._dynamo.reset()
    states = []
    for impl in ("graphddp", "torch"):
        ddp, model = wrap(impl, case if impl == "graphddp" else case.eager(), rank)
        join_then_two_more(ddp, model, case, rank, steps_on_rank_0 + rank)
        states.append(state_of(ddp.module))
        if impl == "graphddp":
            plan = [name for b in ddp.bucket_plan.buckets for name in b.names]
            source = ddp.bucket_plan.source
    torch.testing.assert_close(states[0], states[1])
    return [source, *plan]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_compiled_join_with_a_rank_that_has_no_batch_trains_on_as_pytorchs(world: int) -> None:
    """The training ranks propose their graphs' plan; the rank with no batch proposes nothing (it compiled
    nothing) and adopts theirs, and after the join it compiles the same graph and cuts it by that plan
    (Note [Join]). Before, every rank raised "the ranks compiled different bucket plans"."""
    plans = run_on_ranks(compiled_join_then_train, world, 0, timeout=120)
    assert all(p == plans[0] for p in plans), plans
    assert plans[0][0] == "graph", plans[0]  # the graph's plan was adopted, on every rank


def join_definition(case: Case, world: int) -> list[dict[str, torch.Tensor]]:
    """What ``zero_batch_join`` must end with on each rank, computed in one process from what a join means: rank r
    trains ``2 * r`` steps inside the join, each step's gradient the sum over the ranks still training divided by
    the initial world size (PyTorch's default), the joined ranks adding nothing and taking no step; at the join's
    end every replica takes the last joiner's parameters (optimizer states stay each rank's own); then two steps
    on every rank, averaged. A parameter no training rank used gets no gradient. Where a DDP gives it zeros instead,
    nothing changes here: under SGD with momentum and no weight decay a zero gradient moves a parameter only
    through a momentum buffer it already has, and these have none yet (``dead`` never gets a gradient; ``shared``
    gets its first after the join at 2 ranks, and from rank 2 inside it at 3).

    The reference, not PyTorch's DDP: in about one run in a thousand, with the ranks sharing a CPU, PyTorch's DDP
    (``find_unused_parameters``) returned ``trunk``'s gradients in the first step of the join summed over the ranks
    instead of averaged: its joined rank sent an uninitialized usage map (docs/reliability.md, "PyTorch's DDP inside a
    join"). In the usual run its model equals
    this one bitwise at 2 ranks, as graphddp's does."""
    replicas = [build_model(case.model) for _ in range(world)]
    optimizers = [make_optimizer(m.parameters(), case) for m in replicas]

    def step(training: list[int], epoch: int, index: int) -> None:
        grads: dict[str, torch.Tensor] = {}
        for r in training:  # each rank's gradient of its own batch on its own replica
            replicas[r].zero_grad(set_to_none=True)
            loss_for(replicas[r], case, batch_for(case, index, epoch, r), r).backward()
            for name, p in replicas[r].named_parameters():
                if p.grad is not None:
                    grads[name] = grads[name] + p.grad / world if name in grads else p.grad / world
        for r in training:
            for name, p in replicas[r].named_parameters():
                p.grad = grads[name].clone() if name in grads else None
            optimizers[r].step()
            optimizers[r].zero_grad(set_to_none=True)

    for index in range(2 * (world - 1)):
        step([r for r in range(world) if 2 * r > index], 0, index)
    for m in replicas[:-1]:  # the last joiner (the rank with the most steps) is the authoritative copy
        m.load_state_dict(replicas[-1].state_dict())
    for index in range(2):
        step(list(range(world)), 1, index)
    return [state_of(m) for m in replicas]


def zero_batch_join(rank: int, world: int, model: str, ours: tuple) -> int:
    """graphddp with the options ``ours``: rank r trains ``2 * r`` steps in a join (rank 0 none at all), then every
    rank two steps more, against what that means (``join_definition``); returns how many parameters the usage
    policy marks unused up front on this rank in the end (the static graph's frozen set). (PyTorch's DDP with
    ``static_graph`` aborts here: gloo's "collective mismatch".)"""
    case = Case(ddp=TINY_CAPS, graphddp=RAMPED, model=model, record_events=False)
    ddp, model_ = wrap("graphddp", dataclasses.replace(case, ddp=(*TINY_CAPS, *ours)), rank)
    join_then_two_more(ddp, model_, case, rank, 2 * rank)
    torch.testing.assert_close(state_of(ddp.module), join_definition(case, world)[rank])
    return len(ddp.reducer.usage.policy.locally_unused(None, {}))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", ["mlp", "branchy"])
def test_static_graph_join_with_a_rank_that_has_no_batch(world: int, model: str) -> None:
    """The joined rank's shadow of the first backward is its first iteration too: its static graph freezes there
    and stops counting usage as the training ranks' does. Before, it went on sending the usage count, and gloo
    aborted the training ranks on a collective of the wrong size."""
    frozen = run_on_ranks(zero_batch_join, world, model, (("static_graph", True),), timeout=120)
    # In the join rank 0 froze what no rank used in the iteration it shadowed (with 2 ranks branchy's ``shared``
    # too, which only rank 0 itself uses); after it every rank learned its own: ``dead`` (weight and bias), and
    # ``shared`` on rank 1, which never uses it. Frozen from the shadow, rank 0's first step after the join raised.
    expected = [0] * world if model == "mlp" else [4 if r == 1 else 2 for r in range(world)]
    assert frozen == expected


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_skipping_never_used_buckets_with_a_rank_that_has_no_batch(world: int) -> None:
    """``skip_all_reduce_unused_params``: the joined rank learns what no rank ever used from its shadows, so it
    skips the same buckets the training ranks skip (branchy's ``dead``); else its shadow all-reduced a bucket
    they no longer send."""
    skip = (("find_unused_parameters", True), ("skip_all_reduce_unused_params", True))
    run_on_ranks(zero_batch_join, world, "branchy", skip, timeout=120)
