"""``skip_all_reduce_unused_params``: which buckets launch without a collective, chosen once per launcher.

``SkipNothing`` (the default) reduces every bucket. ``SkipNeverUsed`` gives each bucket none of whose parameters
got a gradient on any rank in any synchronised backward so far (``GradientUsage.never_used``: from all-reduced
counts, so the same on every rank) a ``reductions.SkippedReduction``, which issues nothing. If some rank used one
after all, every rank learns it from the usage all-reduce, and every rank all-reduces that bucket late, after the
count, in index order (``reduce_late``): never a hang, never a silently local gradient, unlike PyTorch's DDP. A
bucket with parts (``Note [Row-sparse gradients]``) is always reduced. One object, chosen when the Reducer is made,
so the Reducer asks no flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .buckets import BucketSlots, FlatBucket
from .launch_context import no_backward_context
from .reductions import DenseReduction, SkippedReduction
from .trace import Events
from .unused import GradientUsage


class SkipNothing:
    """Every bucket is reduced (``skip_all_reduce_unused_params=False``)."""

    skips = False
    """Some bucket may skip its collective (so none can carry the plan agreement: ``agreement_ride``)."""

    def reductions(self, buckets: Sequence[FlatBucket], reductions: list[Any], dense: Sequence[DenseReduction]) -> list[Any]:
        return reductions

    def outdated(self) -> bool:
        return False

    def reduce_late(self, slots: BucketSlots, counts: list[int], events: Events, *, joined: bool = False) -> None:
        pass


class SkipNeverUsed:
    """Buckets of parameters no rank has used yet skip their collective (see the module docstring)."""

    skips = True

    def __init__(self, usage: GradientUsage) -> None:
        self._usage = usage
        self._skipped: dict[int, SkippedReduction] = {}  # by bucket index: launched without a collective
        self._basis: frozenset[int] = frozenset()  # the never-used parameters they were chosen from

    def reductions(self, buckets: Sequence[FlatBucket], reductions: list[Any], dense: Sequence[DenseReduction]) -> list[Any]:
        """``reductions`` (one per bucket), with a ``SkippedReduction`` for each bucket of never-used parameters (its
        late all-reduce through the bucket's ``dense`` reduction)."""
        never_used = self._basis = self._usage.never_used
        self._skipped = {
            b.index: SkippedReduction(dense[b.index])
            for b in buckets
            if not any(p.part for p in b.spec.params) and never_used.issuperset(b.param_indices)
        }
        return [self._skipped.get(b.index, reduction) for b, reduction in zip(buckets, reductions)]

    def outdated(self) -> bool:
        """The never-used parameters changed since the skipped buckets were chosen: choose again (between
        iterations)."""
        return self._usage.never_used != self._basis

    def reduce_late(self, slots: BucketSlots, counts: list[int], events: Events, *, joined: bool = False) -> None:
        """Skipped buckets that some rank used after all (every rank knows from ``counts``): all-reduce them now,
        in index order, and write their averages back; a joined rank adds zeros."""
        for k in sorted(self._skipped):
            bucket = slots.buckets[k]
            used = [i for i in bucket.param_indices if counts[i] > 0]
            if not used:
                continue
            events.record("late", k)
            # What its gather left: the buffer, or a gradient reduced where it lies (Note [A lone gradient reduced
            # where it lies] in graphddp.runtime.grad_layout), scaled for its collective (Note [Averaged on the wire]
            # in graphddp.runtime.reductions) and not yet reduced.
            buffer = bucket.zeros() if joined else bucket.reduced
            with no_backward_context():  # Note [A collective holds no Python object]
                in_flight = self._skipped[k].dense.start(bucket, buffer, False)
                in_flight.commit()
            reduced = in_flight.wait()
            if not joined:
                slots.take_reduced(bucket, reduced, [count > 0 for count in counts])
            in_flight.let_go()
