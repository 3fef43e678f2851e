"""``GradientUsage`` (``graphddp.runtime.unused``) in one process: what a joined rank's shadow reports and learns,
without ranks (the spawned join tests run the same through real collectives)."""

from __future__ import annotations

from graphddp.runtime.unused import ExpectAllUsed, GradientUsage, SearchEveryIteration, StaticGraph

NAMES = ["trunk", "shared", "dead"]


def trained(policy: ExpectAllUsed | SearchEveryIteration | StaticGraph, counts: list[int]) -> GradientUsage:
    """A two-rank usage after one synchronised backward of its own whose ranks' summed usage was ``counts``."""
    usage = GradientUsage(NAMES, policy, rank=0, world_size=2)
    usage.used[:] = [c > 0 for c in counts]
    usage.end([i for i, c in enumerate(counts) if c == 0], counts, [], expected=2)
    return usage


def test_searching_a_joined_rank_reports_what_was_used_in_its_last_backward_as_pytorchs() -> None:
    # PyTorch's joined rank all-reduces its last (all-reduced) usage map: ``shared``, used on the other rank only,
    # counts as used while this rank is joined, so the training rank gives it a zero gradient, not None.
    usage = trained(SearchEveryIteration(), [2, 1, 0])
    assert usage.entries(joined=True) == [1, 1, 0]
    assert usage.shadowed(None) == [0, 0, 0]  # one process: no all-reduce; nothing was used here this time
    assert usage.entries(joined=True) == [0, 0, 0]  # ... and the next shadow says so


def test_not_searching_a_joined_rank_reports_nothing_so_a_missing_gradient_is_still_found() -> None:
    # Under the default policy a training rank raises for a gradient missing on a rank that trains: a joined rank
    # reporting "used" would hide it (PyTorch's joined rank sends no usage map without find_unused_parameters).
    usage = trained(ExpectAllUsed(), [2, 2, 2])
    assert usage.entries(joined=True) == [0, 0, 0]
    assert usage.entries() == [0, 0, 0] and usage.entries(fill=1) == [1, 1, 1]


def test_a_shadow_teaches_the_static_graph_and_the_join_end_has_it_learned_again() -> None:
    usage = GradientUsage(NAMES, StaticGraph(), rank=0, world_size=2)
    assert usage.entries(joined=True) == [0, 0, 0]  # the first iteration counts usage, a shadow too
    usage.shadowed(None)  # counts [0, 0, 0] in one process: no rank used anything
    assert usage.entries(joined=True) is None  # frozen like the training ranks': no count from now on
    assert usage.never_used == frozenset({0, 1, 2}) and usage.iterations == 1  # skip_all_reduce_unused_params
    assert sorted(usage.policy.locally_unused(None, {})) == [0, 1, 2]
    usage.join_ended()  # what no rank used is not what this rank leaves unused: learned again
    assert usage.entries() == [0, 0, 0] and usage.policy.locally_unused(None, {}) == []
