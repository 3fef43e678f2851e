"""The per-gradient hook, which in steady state only counts its bucket down.

Note [Hook that only counts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
PyTorch's C++ Reducer runs one C++ hook per gradient; graphddp's hook is Python, and on a launch-bound backward (a
GPU, many small parameters) every Python call in it is time the backward waits for. So the hook does the least it
can, and everything else runs once per bucket:

* per gradient: the hook (a plain function: the ``torch.compiler.disable`` wrapper the Reducer needs costs five
  Python calls and four eval-frame switches) and ``FlatBucket.count_down``: mark the slot, count the bucket down;
* per bucket, when its count reaches zero: ``Reducer.bucket_complete`` (gather, launch), disabled for Dynamo.

That is the *steady* path. The Reducer arms it (``arm``) in the first hook of a backward, once that hook has done
what only happens once (the plan agreement, how the backward ends), and only where nothing is asked per gradient:
no events recorded, no ready order being learned. Otherwise, and for a gradient with no DDP forward before it
(``no_sync``), a gradient ready twice, or under compiled autograd, the hook takes the full path,
``Reducer.on_grad_ready``, as before.

A bucket whose last gradient is steady goes one step further: its hooks count in C, and one Python hook runs per
bucket (Note [Counting without a frame] in ``graphddp.runtime.arrivals``; ``GradientHooks`` registers whichever
hook each parameter's bucket asks for, and swaps them between backwards).

Dynamo: the hook is ``torch._dynamo.skip``-ped (Dynamo never compiles its frame, and under compiled autograd
calls it rather than tracing it), so a backward run from inside a compiled region or by compiled autograd costs
no compile of graphddp's code; the hook sees compiled autograd's region flag first and takes the full path
(disabled) there, where the Reducer's bookkeeping must run eagerly between the compiled pieces.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.decorators import skip

from .arrivals import Arrivals

if TYPE_CHECKING:
    from .buckets import BucketSlots, FlatBucket
    from .reducer import Reducer


class Countdown:
    """What the steady hook reads: each parameter's bucket and slot, and whether the steady path is armed."""

    def __init__(self, reducer: Reducer, used: list[bool], index_of_id: dict[int, int]) -> None:
        self._reducer = weakref.ref(reducer)  # the Reducer holds this; hooks hold it weakly
        self.used = used
        """``GradientUsage.used``: a gradient this rank produced (set by the hook, read at the end of backward)."""
        self.slot_of: list[tuple[FlatBucket, int]] = []
        self.armed = False
        self.arrivals = Arrivals(index_of_id)
        """Buckets counted without a Python frame per gradient (Note [Counting without a frame])."""
        self.rehook: Callable[[list[int]], None] = lambda indices: None
        """Set by ``GradientHooks``: give these parameters the hook their bucket's counting asks for now."""
        self._buckets: list[FlatBucket] = []

    def use(self, slots: BucketSlots) -> None:
        """A new plan's buckets: parameter ``i``'s gradient goes to ``slot_of[i]`` (its part slots are not here:
        parts come through taps, which the full path takes); every bucket counted per gradient again."""
        self.slot_of = [(slots.buckets[b], s) for b, s in slots.slot]
        self._buckets = slots.buckets
        self.rehook(self.arrivals.use(slots.buckets))

    def prepare(self, *, steady: bool) -> None:
        """A synchronising forward, before its backward: which buckets are counted in C for it (``steady``: no
        work per gradient asked, no parameter found unused)."""
        self.rehook(self.arrivals.prepare(self.used, self._buckets, steady=steady))

    def end_of_backward(self, *, callback_ending: bool) -> None:
        """The Reducer's finalize, before missing gradients are filled in: learn which buckets are steady, and
        settle the counted-in-C ones whose sentinel was not last (Note [Counting without a frame])."""
        self.arrivals.observe(self._buckets, callback_ending=callback_ending)
        self.arrivals.settle(self._buckets, self.full_path)

    def begin(self, index: int) -> bool:
        """A Python hook of a counted-in-C bucket (its sentinel's or the opener's) is the backward's first: begin
        the backward (the full path's first steps). False when no DDP forward prepared it."""
        reducer = self._reducer()
        began = reducer is not None and _begin(reducer, index)
        if self.armed:
            self.arrivals.opened(index)
        return began

    def arm(self, *, per_gradient_work: bool) -> None:
        """A backward has begun: the steady path from now on, unless something is asked of every gradient (events
        recorded, the ready order learned)."""
        self.armed = not per_gradient_work

    def disarm(self) -> None:
        self.armed = False

    def full_path(self, index: int) -> None:
        reducer = self._reducer()
        if reducer is not None:
            was_armed = self.armed
            reducer.on_grad_ready(index)
            if self.armed and not was_armed:  # this gradient began a steady backward
                self.arrivals.opened(index)

    def complete(self, bucket: FlatBucket) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.bucket_complete(bucket)


_REGION_FLAG = hasattr(compiled_autograd, "in_compiled_autograd_region")  # the flag is newer than torch 2.4


@skip
def gradient_ready(countdown_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter ``index`` (Note [Hook that only counts])."""
    if _REGION_FLAG and compiled_autograd.in_compiled_autograd_region:
        return _full_path(countdown_ref, index)
    countdown = countdown_ref()
    if countdown is None or not countdown.armed:
        return _full_path(countdown_ref, index)
    bucket, slot = countdown.slot_of[index]
    left = bucket.count_down(slot)
    if left > 0:
        countdown.used[index] = True
    elif left == 0:
        countdown.used[index] = True
        _complete(countdown, bucket)
    else:  # ready twice: the full path says so
        _full_path(countdown_ref, index)


@torch.compiler.disable  # the Reducer runs eagerly, between compiled pieces too
def _full_path(countdown_ref: weakref.ref, index: int) -> None:
    countdown = countdown_ref()
    if countdown is not None:
        countdown.full_path(index)


@torch.compiler.disable
def _complete(countdown: Countdown, bucket: FlatBucket) -> None:
    countdown.complete(bucket)


@torch.compiler.disable
def _begin(reducer: Reducer, index: int) -> bool:
    return reducer.begin_gradients(index)


@skip
def opener_ready(countdown_ref: weakref.ref, b: int, index: int, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook of the backward's first gradient when its bucket is counted in C (Note
    [Counting without a frame]): record it, and begin the backward here, in the backward's own graph task."""
    countdown = countdown_ref()
    if countdown is None:
        return
    countdown.arrivals.lists[b].append(param)
    if not countdown.armed:
        countdown.begin(index)


@skip
def sentinel_ready(countdown_ref: weakref.ref, b: int, index: int, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook of a counted-in-C bucket's sentinel (Note [Counting without a frame] in
    ``graphddp.runtime.arrivals``): complete and launch the bucket once every gradient of it is in."""
    countdown = countdown_ref()
    if countdown is None:
        return
    arrived = countdown.arrivals.lists[b]
    arrived.append(param)
    if not countdown.armed and not countdown.begin(index):
        return  # no DDP forward prepared this backward (no_sync): the next forward marks the arrivals used
    bucket = countdown.slot_of[index][0]
    if len(arrived) == len(bucket.params) and len(set(map(id, arrived))) == len(arrived):
        used = countdown.used
        for i in bucket.param_indices:  # a loop, no call per parameter
            used[i] = True
        bucket.mark_all_ready()
        _complete(countdown, bucket)
    # else the sentinel was not last, or a gradient came twice: the end of backward settles the bucket


class GradientHooks:
    """The post-accumulate-grad hook of every parameter, each holding the countdown weakly. ``detach`` takes them
    off while gradients are reduced inside the compiled graph (Note [In-graph reduction]: no hook is called at
    all), ``attach`` puts them back; ``handles`` is one list for the Reducer's finalizer."""

    def __init__(self, countdown: Countdown, params: list[torch.nn.Parameter]) -> None:
        self._countdown = weakref.ref(countdown)
        self._params = params
        self.handles: list[Any] = []
        """One per parameter, in parameter order, while attached (empty while detached)."""
        self.attach()
        countdown.rehook = self.rehook

    def attach(self) -> None:
        if not self.handles:
            self.handles.extend(self._register(i) for i in range(len(self._params)))

    def rehook(self, indices: list[int]) -> None:
        """Swap these parameters' hooks for the ones their buckets' counting asks for now (between backwards)."""
        if self.handles:  # detached: attach() registers the right ones
            for i in indices:
                self.handles[i].remove()
                self.handles[i] = self._register(i)

    def _register(self, i: int) -> Any:
        me = self._countdown
        countdown = me()
        hook = None
        if countdown is not None and countdown.slot_of:
            bucket = countdown.slot_of[i][0].index
            hook = countdown.arrivals.hook_of(
                i, bucket, sentinel=lambda b, index: functools.partial(sentinel_ready, me, b, index),
                opener=lambda b, index: functools.partial(opener_ready, me, b, index),
            )
        return self._params[i].register_post_accumulate_grad_hook(hook or functools.partial(gradient_ready, me, i))

    def detach(self) -> None:
        remove_all(self.handles)
        self.handles.clear()


def remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
