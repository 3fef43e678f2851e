"""``join()`` on spawned gloo ranks: early termination raises on every rank."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from models import MLP
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
        if epoch == 0 and type(ddp) is torch.nn.parallel.DistributedDataParallel:
            settle_pytorchs_join()


def settle_pytorchs_join() -> None:
    """PyTorch's DDP, the reference here, is not deterministic after a ``join`` with ``find_unused_parameters`` on
    gloo: now and then it trains another model from the same data (docs/reliability.md, "PyTorch's DDP after a
    join"). Its joined rank all-reduces its usage map without waiting (``_DDPJoinHook.main_hook`` →
    ``_match_unused_params_allreduce``), into the map the rank's next backward reports; a gloo barrier waits for
    every collective issued before it, so none is left running when the training after the join begins.
    graphddp's joined rank waits for what it sends (the plan agreement carries its usage): it gets no barrier."""
    torch.distributed.barrier()


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


def zero_batch_join(rank: int, world: int, model: str, ours: tuple) -> int:
    """graphddp with the options ``ours``: rank r trains ``2 * r`` steps in a join (rank 0 none at all), then every
    rank two steps more, against PyTorch's DDP finding unused parameters in ``branchy`` (with ``static_graph``
    PyTorch's DDP aborts here: gloo's "collective mismatch"); returns how many parameters the usage policy
    marks unused up front on this rank in the end (the static graph's frozen set)."""
    case = Case(ddp=TINY_CAPS, graphddp=RAMPED, model=model, record_events=False)
    searching = (*TINY_CAPS, ("find_unused_parameters", model == "branchy"))
    states, frozen = [], 0
    for impl, options in (("graphddp", (*TINY_CAPS, *ours)), ("torch", searching)):
        ddp, model_ = wrap(impl, dataclasses.replace(case, ddp=options), rank)
        join_then_two_more(ddp, model_, case, rank, 2 * rank)
        states.append(state_of(ddp.module))
        if impl == "graphddp":
            frozen = len(ddp.reducer.usage.policy.locally_unused(None, {}))
    torch.testing.assert_close(states[0], states[1])
    return frozen


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
