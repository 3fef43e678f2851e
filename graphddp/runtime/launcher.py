"""The one place buckets are launched: in index order, when ready, for backward and for join's shadow alike.

A bucket that is ready early waits for its predecessors, so every rank issues collectives in the same order.
Each bucket is launched through its reduction strategy (``graphddp.runtime.reductions``); a strategy may leave a second
collective to ``commit``, which the launcher issues before the next bucket's launch or before awaiting the
bucket, whichever comes first: again the same point on every rank.

Custom comm hooks may chain further collectives in future callbacks (PowerSGD does, from gloo's threads). If
bucket k+1 were launched while bucket k's chain still runs, the two would interleave differently on each rank:
a collective mismatch (PyTorch's DDP hangs this way with PowerSGD on gloo and several buckets). So with a custom
hook, bucket k+1 starts only once bucket k's future has completed (``ChainedLaunch``); collectives of one group
run one at a time anyway, so little overlap is lost. Hooks known to issue exactly one collective (graphddp's
own, and PyTorch's ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``) launch every ready bucket
at once (``EagerLaunch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .buckets import FlatBucket
from .launch_context import no_backward_context
from .profiling import labelled, profiling
from .reductions import InFlight, builtin_hook

POLL_S = 0.0005
"""How often ``reduced_as_completed`` looks for a finished reduction while none is (half a millisecond: a
bucket's all-reduce takes milliseconds to seconds, so a bucket is stepped late by at most this)."""


class EagerLaunch:
    """Launch a complete bucket at once: the hook issues one collective and chains none."""

    chains = False
    """The hook may issue collectives after its first one (from future callbacks)."""

    @staticmethod
    def may_launch(previous: FlatBucket | None) -> bool:
        return True


class ChainedLaunch:
    """Launch a bucket only after its predecessor's result is there (see the module docstring)."""

    chains = True

    @staticmethod
    def may_launch(previous: FlatBucket | None) -> bool:
        return previous is None or (previous.in_flight is not None and previous.in_flight.done())


def _nothing() -> None:
    pass


def launch_policy(hook: Any) -> EagerLaunch | ChainedLaunch:
    """How buckets reduced by the comm hook function ``hook`` may be launched (see the module docstring)."""
    return EagerLaunch() if builtin_hook(hook)[0] else ChainedLaunch()


class Launcher:
    """Launches the buckets of one plan under one comm hook; rebuilt when either changes."""

    def __init__(self, buckets: Sequence[FlatBucket], reductions: Sequence[Any], policy: EagerLaunch | ChainedLaunch, events: Any) -> None:
        assert len(buckets) == len(reductions)
        self.buckets, self.reductions, self.policy, self.events = list(buckets), list(reductions), policy, events
        self.divides_by = tuple(r.divides_by for r in self.reductions)
        """What each bucket's collective divides it by (Note [Averaged on the wire] in ``graphddp.runtime.reductions``)."""
        self._next = 0
        self._open: tuple[int, InFlight] | None = None  # launched last, maybe with a collective left to commit
        self._watched = False
        """This backward's launches and waits are recorded or labelled: events are on, or a profiler records
        (asked once per backward, at ``reset``; a profiler started between a forward and its backward labels the
        next one)."""
        self.before_last: Callable[[], None] = _nothing
        """Issued just before the last bucket's collective, once (the Reducer's plan agreement and usage count,
        ``Iteration.count_usage``), where the launch policy does not chain collectives: every gradient is in by
        then, and the small all-reduce is done when the last bucket is, so the end of backward does not wait a
        round trip more for it, and nothing of the iteration is left in flight after it; where it rides the last
        bucket, it only seats its entries there (Note [The agreement rides a bucket])."""

    def reset(self) -> None:
        """A new backward: nothing launched."""
        self._next, self._open = 0, None
        self._watched = self.events.recording or profiling()

    def gave_up(self) -> list[FlatBucket]:
        """Buckets whose row-sparse reduction gave up rows (``reductions.RowSparseReduction.gave_up``)."""
        return [bucket for bucket, reduction in zip(self.buckets, self.reductions) if reduction.gave_up]

    def launch_ready(self) -> bool:
        """Launch every complete bucket the order allows; True once all are launched."""
        buckets, eager = self.buckets, not self.policy.chains
        while self._next < len(buckets):
            bucket = buckets[self._next]
            if not bucket.complete or not (eager or self.policy.may_launch(buckets[self._next - 1] if self._next else None)):
                break
            bucket.start(self._launch(bucket, bucket.reduced))
            self._next += 1
        return self._next == len(buckets)

    @property
    def committing(self) -> bool:
        """The last launched bucket still has a collective to issue (``flush`` would wait for its first one)."""
        return self._open is not None and self._open[1].pending_commit

    def flush(self) -> None:
        """Issue the last launched bucket's remaining collective now (before a collective of the Reducer's own)."""
        self._commit_open()

    def reduced_in_order(self) -> Iterator[tuple[FlatBucket, torch.Tensor]]:
        """End of backward: each bucket and its reduced buffer, in index order (buckets ``ChainedLaunch`` held
        back are launched as their predecessors finish)."""
        for bucket in self.buckets:
            if not bucket.started:
                self.launch_ready()
            if self._open is not None and self._open[0] <= bucket.index:  # not sooner: the buckets before it are
                self._commit_open()  # written back meanwhile (a row-sparse table's mask waits for them all on gloo)
            assert bucket.in_flight is not None, f"bucket {bucket.index} was never launched"
            if self._watched:
                with labelled(f"graphddp: wait for bucket {bucket.index}"):
                    reduced = bucket.in_flight.wait()
            else:
                reduced = bucket.in_flight.wait()
            yield bucket, reduced

    def reduced_as_completed(self) -> Iterator[tuple[FlatBucket, torch.Tensor]]:
        """End of backward, for a per-bucket optimizer step (Note [Optimizer overlap]): each bucket and its reduced
        buffer once its reduction is done, the lowest index first among those done, so a bucket that finished
        before an earlier one (gloo runs two collectives at once, by default) is stepped while that one is still
        being sent. In index order (``reduced_in_order``) while a collective is still to be issued (``ChainedLaunch``,
        a row-sparse table's rows, a sparse gradient's gathers): waiting in index order is what issues those, at the
        same point on every rank."""
        if self.policy.chains or self.committing:
            yield from self.reduced_in_order()
            return
        self._commit_open()  # a dense bucket launched last while events are recorded: nothing to issue, only watch
        pending = list(self.buckets)
        assert all(b.in_flight is not None for b in pending), "every bucket is launched before backward's end"
        while pending:
            bucket = next((b for b in pending if b.in_flight.done()), None)
            if bucket is None and len(pending) > 1:
                time.sleep(POLL_S)  # no wait-for-any on a c10d Work: look again soon, leaving the CPU to others
                continue
            bucket = bucket or pending[0]
            pending.remove(bucket)
            yield bucket, bucket.in_flight.wait()

    def shadow(self) -> None:
        """A joined rank's stand-in for one backward: every bucket launched on zeros and awaited, one after the
        other (the same sequence of collectives as either launch policy)."""
        self.reset()
        self.drain()

    def drain(self) -> None:
        """The rest of a backward, on zeros (a joined rank's shadow: all of it; Note [Abandoned backward] in
        ``graphddp.runtime.iteration``: what an abandoned backward left): the buckets already launched are awaited,
        the others launched on zeros and awaited, in index order, one after the other (the same sequence of
        collectives as either launch policy); nothing is kept."""
        for bucket in self.buckets:
            launched = bucket.index < self._next
            in_flight = bucket.in_flight if launched else self._launch(bucket, bucket.zeros())
            if self._open is not None and self._open[0] <= bucket.index:
                self._commit_open()
            assert in_flight is not None, f"bucket {bucket.index} was never launched"
            in_flight.wait()
            in_flight.let_go()  # nothing is kept
        self._next = len(self.buckets)

    def _launch(self, bucket: FlatBucket, buffer: torch.Tensor) -> InFlight:
        if self._open is not None:
            self._commit_open()  # the previous bucket's last collective goes first, on every rank
        is_last = bucket.index == len(self.buckets) - 1
        if is_last and not self.policy.chains:
            before, self.before_last = self.before_last, _nothing
            before()
        if self._watched:  # else a check each (Note [Lean bucket path])
            self.events.record("launch", bucket.index)
            with labelled(f"graphddp: all-reduce bucket {bucket.index}"):
                in_flight = self.reductions[bucket.index].start(bucket, buffer, is_last)
            self._watch(bucket.index, in_flight)
        else:
            in_flight = self.reductions[bucket.index].start(bucket, buffer, is_last)
        if in_flight.pending_commit or self.events.recording:
            self._open = (bucket.index, in_flight)
        return in_flight

    def _commit_open(self) -> None:
        if self._open is None:
            return
        (index, in_flight), self._open = self._open, None
        watched = self.events.recording and in_flight.future is not None
        with no_backward_context():  # a row-sparse table's rows: Note [A collective holds no Python object]
            in_flight.commit()
        if in_flight.outcome is not None:
            self.events.record(in_flight.outcome[0], index, in_flight.outcome[1])
        if not watched:
            self._watch(index, in_flight)

    def _watch(self, index: int, in_flight: InFlight) -> None:
        if self.events.recording and in_flight.future is not None:  # completion times, for timelines
            in_flight.future.add_done_callback(lambda _f: self.events.record("done", index))
