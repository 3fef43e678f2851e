"""The usage count read at the next forward (Note [Usage count read at the next forward] in
graphddp.runtime.unused), on ``GradientUsage`` alone: a fake count in flight records when it is waited for."""

from __future__ import annotations

import pytest
import torch

from graphddp.runtime.unused import ExpectAllUsed, GradientUsage, SearchEveryIteration

NAMES = ["a.weight", "a.bias", "b.weight"]


class CountInFlight:
    """Stands for ``UsageCount``: the all-reduced counts, and whether anyone waited for them."""

    def __init__(self, counts: list[int]) -> None:
        self._counts = counts
        self.waited = 0

    def wait(self) -> list[int]:
        self.waited += 1
        return self._counts


def usage(policy: object = None, world: int = 2) -> GradientUsage:
    return GradientUsage(NAMES, policy or ExpectAllUsed(), group=None, device=torch.device("cpu"), rank=0, world_size=world)


def end_backward(u: GradientUsage, pending: CountInFlight, *, wanted_now: bool = False, expected: int = 2) -> list[int]:
    """What the Reducer's finalize does with the counts: read them, then end the backward."""
    counts = u.counts(pending, wanted_now=wanted_now)  # type: ignore[arg-type]
    u.end([], counts, [i for i, used in enumerate(u.used) if not used], expected)
    return counts


def test_a_backward_that_produced_every_gradient_does_not_wait_for_the_count() -> None:
    u = usage()
    u.used[:] = [True] * len(NAMES)
    pending = CountInFlight([2, 2, 2])
    assert end_backward(u, pending) == [2, 2, 2]
    assert pending.waited == 0, "the end of backward waited for the usage all-reduce"
    assert u.never_used == frozenset() and u.iterations == 1
    u.raise_pending()  # the next forward reads it: every rank produced every gradient
    assert pending.waited == 1


def test_another_ranks_missing_gradient_still_raises_at_the_next_forward() -> None:
    u = usage()
    u.used[:] = [True] * len(NAMES)
    pending = CountInFlight([2, 1, 2])  # the other rank produced no gradient for a.bias
    end_backward(u, pending)
    assert pending.waited == 0
    with pytest.raises(RuntimeError, match=r"no gradient for 'a.bias' \(gradient on 1 of 2 ranks\)"):
        u.raise_pending()
    u.raise_pending()  # once


@pytest.mark.parametrize(
    "why, used, policy, wanted_now",
    [
        ("this rank missed a gradient", [True, False, True], None, False),
        ("find_unused_parameters acts on the counts", [True, True, True], SearchEveryIteration(), False),
        ("the caller needs them (skipped buckets)", [True, True, True], None, True),
    ],
)
def test_the_end_of_backward_reads_the_count_where_it_acts_on_it(why: str, used: list[bool], policy: object, wanted_now: bool) -> None:
    u = usage(policy)
    u.used[:] = used
    pending = CountInFlight([2, 1, 2])
    assert end_backward(u, pending, wanted_now=wanted_now) == [2, 1, 2], why
    assert pending.waited == 1, why
