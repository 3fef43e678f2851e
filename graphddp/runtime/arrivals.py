"""Buckets counted without a Python frame per gradient: in steady state, one Python hook call per bucket.

Note [Counting without a frame]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The hook that only counts (Note [Hook that only counts] in ``graphddp.runtime.countdown``) still runs a Python
function per gradient, where PyTorch's C++ Reducer runs a C++ one. But autograd takes any callable as a
post-accumulate-grad hook, and a *builtin* one runs in C, with no Python frame: ``list.append`` bound to a bucket's
arrival list. So in steady state a bucket may be *counted in C*:

* each of its parameters but one has ``arrivals[b].append`` as its hook: autograd appends the parameter, and no
  Python runs;
* the bucket's *sentinel*, the parameter whose gradient came last in the bucket in the previous backwards, has the
  one Python hook (``sentinel_ready``): it appends itself and, when every parameter of the bucket has arrived
  exactly once, marks the bucket complete and launches it. One Python call per bucket, not per gradient;
* the backward's first gradient, the *opener* (the one whose hook began the previous backwards), keeps a Python
  hook too (``opener_ready``), which begins the backward (the plan agreement, and the end-of-backward callback
  queued) as the per-gradient path's first hook does: the callback must go to the backward's own graph task, and
  the first gradient's hook runs there, where a later one may run in a nested one (a reentrant checkpoint's
  backward, whose callbacks run when *it* ends).

Autograd runs a static graph's nodes in the same order every time, so the sentinel comes last again. When it does
not (the graph changed, data-dependent control flow), it finds the bucket incomplete and leaves it; the end of
backward (``settle``, in the Reducer's finalize, before it fills in missing gradients) hands each arrival to the
Reducer's full path, which completes and launches the bucket there: correct, and late for that one backward. The
bucket then goes back to a Python hook per gradient (hooks are swapped at the next forward, never under a
backward) until its last gradient is steady again. A gradient that arrives twice is found the same way and raises
the Reducer's "ready twice" error. Buckets launch in index order whatever happens (``graphddp.runtime.launcher``),
so ranks whose sentinels differ still issue the same collectives in the same order.

A bucket is counted in C once the same parameter's gradient completed it, and the same one opened the backward,
``STREAK`` synchronised backwards in a row, with the hook that only counts armed (another opener puts every bucket
back on a hook per gradient), and none of:

* a part of a tied weight in the bucket (parts come through taps, not hooks);
* events recorded or the ready order being learned (work per gradient), or parameters the forward found unused
  (their slots are ready before backward begins): the forward that prepares such a backward puts every bucket back
  on a hook per gradient;
* compiled autograd, once it has run a backward of this Reducer: it ends at the last launch, with no end-of-backward
  callback that could settle a late bucket, so this Reducer never counts in C again. (A backward under compiled
  autograd right after eager ones, *and* with its gradients in a new order, would leave a bucket unlaunched: the
  next forward raises the error of a compiled-autograd backward that ended before every bucket was complete.)

Under ``no_sync`` (no DDP forward prepared the backward) the arrivals are only kept, and the next synchronising
forward marks their parameters used before it clears the lists: a parameter used in any micro-batch counts as used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .buckets import FlatBucket

STREAK = 2
"""Synchronised backwards in a row that a bucket's last gradient must be the same parameter's before it is counted
in C."""


class Arrivals:
    """Which buckets are counted in C, their arrival lists and sentinels, and when that changes (see the Note)."""

    def __init__(self, index_of_id: dict[int, int]) -> None:
        self._index_of_id = index_of_id
        self.lists: list[list[torch.Tensor]] = []
        """Per bucket: the parameters whose gradient arrived this backward (counted-in-C buckets only)."""
        self.sentinel: list[int | None] = []
        """Per bucket: the parameter with the Python hook, or None (a Python hook per gradient)."""
        self._last: list[int | None] = []
        self._streak: list[int] = []
        self._eligible: list[bool] = []
        self._params_of: list[list[int]] = []
        self._opener: int | None = None
        self._opener_streak = 0
        self._opener_moved = False
        self.never = False
        """Compiled autograd ran a backward of this Reducer: nothing is counted in C from then on."""

    def use(self, buckets: Sequence[FlatBucket]) -> list[int]:
        """A new plan: every bucket back on a hook per gradient. Returns the parameters whose hook must change."""
        rehook = self.counted_in_c()
        self.lists = [[] for _ in buckets]
        self.sentinel = [None] * len(buckets)
        self._last = [None] * len(buckets)
        self._streak = [0] * len(buckets)
        self._eligible = [len(b.whole) == len(b.params) for b in buckets]  # no part of a tied weight in it
        return rehook

    def counted_in_c(self) -> list[int]:
        """The parameters whose hook is not the per-gradient one: every parameter of a counted-in-C bucket."""
        return [i for b, s in enumerate(self.sentinel) if s is not None for i in self._params_of[b]]

    def hook_of(
        self, index: int, bucket: int, *, sentinel: Callable[[int, int], Any], opener: Callable[[int, int], Any]
    ) -> Callable[[torch.Tensor], Any] | None:
        """Parameter ``index``'s hook when its bucket is counted in C, else None (the per-gradient hook).
        ``sentinel(bucket, index)`` and ``opener(bucket, index)`` make the sentinel's and the opener's."""
        last = self.sentinel[bucket]
        if last is None or last == _DEMOTED:
            return None
        if last == index:
            return sentinel(bucket, index)
        if index == self._opener:
            return opener(bucket, index)
        return self.lists[bucket].append  # a builtin: no Python frame per gradient

    def opened(self, index: int) -> None:
        """Parameter ``index``'s hook began a steady backward (the opener, see the Note)."""
        self._opener_streak = self._opener_streak + 1 if index == self._opener else 1
        if index != self._opener and any(s is not None for s in self.sentinel):
            self._opener_moved = True  # the next forward puts every bucket back on a hook per gradient
        self._opener = index

    def prepare(self, used: list[bool], buckets: Sequence[FlatBucket], *, steady: bool) -> list[int]:
        """A synchronising forward before its backward: arrivals of ``no_sync`` backwards count as used, the lists
        are emptied, and buckets change how they are counted. Returns the parameters whose hook must change."""
        for arrived in self.lists:
            for param in arrived:
                used[self._index_of_id[id(param)]] = True
            arrived.clear()
        self._params_of = [b.param_indices for b in buckets]
        before = list(self.sentinel)
        steady = steady and not self._opener_moved
        if not steady:
            self._opener_streak, self._opener_moved = 0, False
        for b, sentinel in enumerate(self.sentinel):
            if not steady or self.never:
                self._streak[b] = 0
                self.sentinel[b] = None
            elif sentinel == _DEMOTED:
                self.sentinel[b] = None
            elif sentinel is None and self._eligible[b] and min(self._streak[b], self._opener_streak) >= STREAK:
                self.sentinel[b] = self._last[b]
        return [i for b, (old, new) in enumerate(zip(before, self.sentinel)) if old != new for i in self._params_of[b]]

    def observe(self, buckets: Sequence[FlatBucket], *, callback_ending: bool) -> None:
        """End of a synchronised backward, before missing gradients are filled in: which parameter completed each
        bucket counted per gradient (``FlatBucket.last_slot``), and whether it was the same as before."""
        if not callback_ending:
            self.never = True
        for bucket in buckets:
            b = bucket.index
            if self.sentinel[b] is not None:
                continue
            if not bucket.complete:
                self._streak[b], self._last[b] = 0, None
                continue
            last = bucket.param_indices[bucket.last_slot]
            self._streak[b] = self._streak[b] + 1 if last == self._last[b] else 1
            self._last[b] = last

    def settle(self, buckets: Sequence[FlatBucket], full_path: Callable[[int], None]) -> None:
        """End of a synchronised backward: a counted-in-C bucket whose sentinel was not last, or that got a gradient
        twice, goes through the Reducer's full path arrival by arrival (which completes and launches it, or raises
        "ready twice"), and back on a hook per gradient from the next forward."""
        for b, in_list in enumerate(self.lists):
            arrived = list(in_list)
            in_list.clear()  # what arrives from now until the next forward is a no_sync backward's (``prepare``)
            bucket = buckets[b]
            if self.sentinel[b] is not None and not (bucket.complete and len(arrived) == len(bucket.params)):
                self._streak[b], self._last[b] = 0, None
                self.sentinel[b] = _DEMOTED  # its hooks change at the next forward
                seen: set[int] = set()
                for param in arrived:
                    index = self._index_of_id[id(param)]
                    if index in seen or not bucket.complete:
                        full_path(index)  # marks it ready, completes the bucket; or raises "ready twice"
                    seen.add(index)


_DEMOTED = -1
"""A sentinel that is no parameter: the bucket is settled, and leaves counting in C at the next forward."""
