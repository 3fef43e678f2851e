"""``Arrivals`` (Note [Counting without a frame] in graphddp.runtime.arrivals), alone: when a bucket moves to
counting in C and back, which hook each parameter gets, and what the end of backward settles."""

from __future__ import annotations

import types

import pytest
import torch

from graphddp.runtime.arrivals import STREAK, Arrivals

PARAMS = [torch.nn.Parameter(torch.zeros(2)) for _ in range(5)]
INDEX_OF_ID = {id(p): i for i, p in enumerate(PARAMS)}


def bucket(index: int, indices: list[int], *, parts: int = 0) -> types.SimpleNamespace:
    return types.SimpleNamespace(index=index, params=[PARAMS[i] for i in indices] + [PARAMS[0]] * parts,
                                 param_indices=indices + [0] * parts, whole=indices, complete=True, last_slot=0)  # fmt: skip


def steady_backwards(arrivals: Arrivals, buckets: list, used: list[bool], n: int) -> list[int]:
    """``n`` steady backwards in which every bucket completed on its last slot; returns the last rehook list."""
    rehook: list[int] = []
    for _ in range(n):
        rehook = arrivals.prepare(used, buckets, steady=True)
        for b in buckets:
            b.complete, b.last_slot = True, len(b.whole) - 1
        arrivals.observe(buckets, callback_ending=True)
        arrivals.settle(buckets, full_path=lambda i: pytest.fail("nothing to settle"))
        arrivals.opened(2)  # the first gradient of the next backward (the per-gradient path says so as it begins)
    return rehook


def test_a_bucket_is_counted_in_c_after_a_streak_and_its_hooks_say_so() -> None:
    buckets = [bucket(0, [0, 1]), bucket(1, [2, 3, 4])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    assert arrivals.use(buckets) == []
    assert steady_backwards(arrivals, buckets, used, STREAK) == []  # not yet
    assert arrivals.prepare(used, buckets, steady=True) == [0, 1, 2, 3, 4]  # every hook changes now
    assert arrivals.sentinel == [1, 4]  # the parameter that came last
    makers = {"sentinel": lambda b, i: ("sentinel", b, i), "opener": lambda b, i: ("opener", b, i)}
    assert arrivals.hook_of(1, 0, **makers) == ("sentinel", 0, 1)
    assert arrivals.hook_of(2, 1, **makers) == ("opener", 1, 2)  # the backward's first gradient
    hook = arrivals.hook_of(3, 1, **makers)
    assert isinstance(hook, type([].append)) and hook.__self__ is arrivals.lists[1]  # a builtin: no frame
    assert arrivals.prepare(used, buckets, steady=False) == [0, 1, 2, 3, 4]  # per-gradient work: all back
    assert arrivals.sentinel == [None, None]


def test_a_bucket_with_a_part_or_an_unsteady_last_gradient_stays_per_gradient() -> None:
    buckets = [bucket(0, [0, 1], parts=1), bucket(1, [2, 3, 4])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    arrivals.use(buckets)
    for last in [0, 1, 0, 1]:  # bucket 1's last gradient changes every time
        arrivals.prepare(used, buckets, steady=True)
        buckets[1].last_slot = last
        arrivals.observe(buckets, callback_ending=True)
        arrivals.settle(buckets, full_path=lambda i: None)
    assert arrivals.prepare(used, buckets, steady=True) == [] and arrivals.sentinel == [None, None]


def test_another_opener_puts_every_bucket_back_on_a_hook_per_gradient() -> None:
    buckets = [bucket(0, [0, 1]), bucket(1, [2, 3, 4])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    arrivals.use(buckets)
    steady_backwards(arrivals, buckets, used, STREAK)
    arrivals.prepare(used, buckets, steady=True)
    assert arrivals.sentinel == [1, 4]
    arrivals.opened(0)  # a backward began elsewhere (a reentrant checkpoint's nested backward, say)
    assert arrivals.prepare(used, buckets, steady=True) == [0, 1, 2, 3, 4] and arrivals.sentinel == [None, None]


def test_compiled_autograd_ends_counting_in_c_for_good() -> None:
    buckets = [bucket(0, [0, 1])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    arrivals.use(buckets)
    steady_backwards(arrivals, buckets, used, STREAK)
    arrivals.observe(buckets, callback_ending=False)  # a backward that ended at its last launch
    assert arrivals.prepare(used, buckets, steady=True) == [] and arrivals.sentinel == [None]
    steady_backwards(arrivals, buckets, used, 2 * STREAK)
    assert arrivals.sentinel == [None]


def test_settle_hands_an_early_sentinels_arrivals_and_a_duplicate_to_the_full_path() -> None:
    buckets = [bucket(0, [0, 1]), bucket(1, [2, 3, 4])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    arrivals.use(buckets)
    steady_backwards(arrivals, buckets, used, STREAK)
    arrivals.prepare(used, buckets, steady=True)
    # Bucket 0: its sentinel (1) came before parameter 0, so it was not completed. Bucket 1: complete, but 2 came twice.
    buckets[0].complete = False
    arrivals.lists[0].extend([PARAMS[1], PARAMS[0]])
    arrivals.lists[1].extend([PARAMS[2], PARAMS[3], PARAMS[4], PARAMS[2]])
    handed = []
    arrivals.settle(buckets, full_path=handed.append)
    assert handed == [1, 0, 2]  # every arrival of the incomplete bucket; only the duplicate of the complete one
    assert arrivals.lists == [[], []]  # a no_sync backward's arrivals are the only ones the next forward sees
    assert arrivals.prepare(used, buckets, steady=True) == [0, 1, 2, 3, 4] and arrivals.sentinel == [None, None]


def test_a_no_sync_backwards_arrivals_count_as_used_at_the_next_forward() -> None:
    buckets = [bucket(0, [0, 1]), bucket(1, [2, 3, 4])]
    arrivals, used = Arrivals(INDEX_OF_ID), [False] * 5
    arrivals.use(buckets)
    steady_backwards(arrivals, buckets, used, STREAK + 1)
    arrivals.lists[1].extend([PARAMS[3]])  # a no_sync backward: only kept
    arrivals.prepare(used, buckets, steady=True)
    assert used == [False, False, False, True, False] and arrivals.lists == [[], []]
