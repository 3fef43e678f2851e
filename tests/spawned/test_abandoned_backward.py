"""A backward abandoned on some ranks mid-way (issue 26, item 5): the common "catch out-of-memory, skip the batch"
loop, after some buckets were sent. Note [Abandoned backward] in ``graphddp.runtime.iteration``: the next forward
drains what the abandoned backward left unsent, so every rank's collectives stay matched, and the forward after
that raises the same error on every rank when only some ranks abandoned it (the others stepped with gradients
their peers dropped). When every rank abandons the same backward, training goes on.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ranks import run_with_faults
from training import Case, batch_for, graphddp_warnings, loss_for, make_optimizer, state_of, train_single_process, wrap

PG_TIMEOUT_S = 20.0
CASE = Case(model="mlp", steps=5, ddp=(("bucket_cap_mb", 0.002),), graphddp=(("first_bucket_cap_mb", 0.002),))
"""Small caps: mlp's three layers in several buckets, so some are sent before fc1's gradients are ready."""


BEFORE_ANY_GRADIENT = "(the model's output)"
"""Where a rank fails: in backward, before any parameter's gradient exists (nothing was sent yet)."""


def skip_failed_batches(
    rank: int, world: int, failing: dict[int, str], compile: str | None = None, reduction: str = "auto"
) -> tuple[list[str], dict[str, list], list[str]]:
    """Train 5 steps; at step 1 each rank in ``failing`` raises out of memory once the gradient of the parameter
    named there is final (fc2.weight: fc3's bucket sent, fc1's not), catches it and skips the batch, as training
    loops do (or, for ``BEFORE_ANY_GRADIENT``, as soon as backward has reached the model's output). What happened
    at each step, and the final parameters."""
    case = dataclasses.replace(CASE, compile=compile, compile_kwargs=(("reduction", reduction),) if compile else ())
    with graphddp_warnings() as warnings:
        ddp, model = wrap("graphddp", case, rank)
        optimizer = make_optimizer(model.parameters(), case)

        def out_of_memory(_param: torch.Tensor) -> None:
            if step == 1:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")

        if failing.get(rank) == BEFORE_ANY_GRADIENT:  # runs once the gradient of the module's output exists
            ddp.module.register_full_backward_pre_hook(lambda _module, _grad: out_of_memory(_grad[0]))
        elif rank in failing:
            ddp.module.get_parameter(failing[rank]).register_post_accumulate_grad_hook(out_of_memory)
        what = []
        for step in range(CASE.steps):
            try:
                loss = loss_for(model, CASE, batch_for(CASE, step, 0, rank), rank)
                loss.backward()
            except torch.OutOfMemoryError:
                optimizer.zero_grad()
                what.append("skipped")
                continue
            except RuntimeError as error:
                what.append(f"RuntimeError: {error}")
                break
            optimizer.step()
            optimizer.zero_grad()
            what.append("stepped")
        state = {k: v.tolist() for k, v in state_of(ddp.module).items()}  # plain data: the rank is killed after
    return what, state, warnings


@pytest.mark.parametrize(
    ("world", "compile"), [(2, None), pytest.param(3, None, marks=pytest.mark.slow), (2, "graphddp.compile")]
)
def test_one_rank_abandoning_a_backward_raises_the_same_error_on_every_rank(world: int, compile: str | None) -> None:
    """Compiled: with the split strategy (the Reducer's hooks see the backward)."""
    outcomes = run_with_faults(
        skip_failed_batches, world, {0: "fc2.weight"}, compile, "split", pg_timeout_s=PG_TIMEOUT_S, timeout=120
    )
    assert sorted(outcomes) == list(range(world)), f"ranks {sorted(set(range(world)) - set(outcomes))} died or hung: {outcomes}"
    for rank, (ok, value) in outcomes.items():
        assert ok, (rank, value)
        what = value[0]
        # Step 1 abandoned on rank 0 (finished elsewhere), step 2 drains it, step 3's forward reads the agreement.
        assert what[:3] == (["stepped", "skipped", "stepped"] if rank == 0 else ["stepped"] * 3), (rank, what)
        assert len(what) == 4 and what[3].startswith(f"RuntimeError: [rank {rank}] graphddp.DDP: 1 of {world} ranks"), (rank, what)
        assert "abandoned the backward of training forward #2" in what[3], what[3]
        assert ("(this rank among them)" in what[3]) == (rank == 0), what[3]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_backward_abandoned_before_any_gradient_on_one_rank_raises_the_same_error_on_every_rank(world: int) -> None:
    """The out-of-memory comes in the first op of backward, before any parameter's gradient hook ran, so nothing
    was sent. A hook on the forward's output saw the backward begin, so the next forward drains it, the agreement
    first (before: every rank raised "the ranks are out of step", naming an evaluation forward as the cause)."""
    outcomes = run_with_faults(
        skip_failed_batches, world, {0: BEFORE_ANY_GRADIENT}, pg_timeout_s=PG_TIMEOUT_S, timeout=120
    )
    assert sorted(outcomes) == list(range(world)), f"ranks {sorted(set(range(world)) - set(outcomes))} died or hung: {outcomes}"
    for rank, (ok, value) in outcomes.items():
        assert ok, (rank, value)
        what = value[0]
        assert what[:3] == (["stepped", "skipped", "stepped"] if rank == 0 else ["stepped"] * 3), (rank, what)
        assert len(what) == 4 and what[3].startswith(f"RuntimeError: [rank {rank}] graphddp.DDP: 1 of {world} ranks"), (rank, what)
        assert ("(this rank among them)" in what[3]) == (rank == 0), what[3]


@pytest.mark.parametrize(
    "failing",
    [
        {0: "fc2.weight", 1: BEFORE_ANY_GRADIENT},
        pytest.param({0: "fc2.weight", 1: "fc3.weight", 2: "fc1.bias"}, marks=pytest.mark.slow),
    ],
    ids=["2-ranks", "3-ranks"],
)
def test_every_rank_abandoning_the_same_backward_trains_on_as_if_the_batch_was_skipped(failing: dict[int, str]) -> None:
    """Each rank stops at another point (before any gradient existed, before any bucket went out, with all but
    the last sent): the drains still match, and every rank ends where one process that skipped step 1 ends."""
    world = len(failing)
    outcomes = run_with_faults(skip_failed_batches, world, failing, pg_timeout_s=PG_TIMEOUT_S, timeout=120)
    assert sorted(outcomes) == list(range(world)), f"ranks {sorted(set(range(world)) - set(outcomes))} died or hung: {outcomes}"
    reference = train_single_process(CASE, world, skip_steps=(1,))
    for rank, (ok, value) in outcomes.items():
        assert ok, (rank, value)
        what, state, _ = value
        assert what == ["stepped", "skipped", "stepped", "stepped", "stepped"], (rank, what)
        torch.testing.assert_close({k: torch.tensor(v) for k, v in state.items()}, state_of(reference))


def test_an_in_graph_backward_abandoned_on_one_rank_raises_on_every_rank() -> None:
    """Gradients reduced inside the compiled graph: no hook of the Reducer runs and there is no agreement, yet the
    abandoning rank sees it (a hook on the graph's outputs), its next in-graph backward carries its flag in the
    first bucket's all-reduce (``AbandonSignal``), and two training forwards later every rank raises. Before: only
    the abandoning rank warned; the other trained on with replicas that differ."""
    outcomes = run_with_faults(
        skip_failed_batches, 2, {0: "fc2.weight"}, "graphddp.compile", "in_graph", pg_timeout_s=PG_TIMEOUT_S, timeout=120
    )
    assert sorted(outcomes) == [0, 1], outcomes
    for rank, (ok, value) in outcomes.items():
        assert ok, (rank, value)
        what, _, warned = value
        assert what[:4] == (["stepped", "skipped", "stepped", "stepped"] if rank == 0 else ["stepped"] * 4), (rank, what)
        assert len(what) == 5 and what[4].startswith(f"RuntimeError: [rank {rank}] graphddp.DDP: 1 of 2 ranks"), (rank, what)
        assert "inside the compiled graph" in what[4] and ("(this rank among them)" in what[4]) == (rank == 0), what[4]
        assert bool([m for m in warned if "stopped before its end" in m]) == (rank == 0), warned


@pytest.mark.slow
def test_every_rank_abandoning_the_same_in_graph_backward_trains_on() -> None:
    """Every rank drops the same in-graph backward (a skip they agreed on): the signal's count is the world size,
    nobody raises, and every rank ends where one process that skipped step 1 ends."""
    outcomes = run_with_faults(
        skip_failed_batches, 2, {0: "fc2.weight", 1: "fc3.weight"}, "graphddp.compile", "in_graph",
        pg_timeout_s=PG_TIMEOUT_S, timeout=120,
    )  # fmt: skip
    assert sorted(outcomes) == [0, 1], outcomes
    reference = train_single_process(CASE, 2, skip_steps=(1,))
    for rank, (ok, value) in outcomes.items():
        assert ok, (rank, value)
        what, state, _ = value
        assert what == ["stepped", "skipped", "stepped", "stepped", "stepped"], (rank, what)
        torch.testing.assert_close({k: torch.tensor(v) for k, v in state.items()}, state_of(reference))
