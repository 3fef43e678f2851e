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

Dynamo: the hook is ``torch._dynamo.skip``-ped (Dynamo never compiles its frame, and under compiled autograd
calls it rather than tracing it), so a backward run from inside a compiled region or by compiled autograd costs
no compile of graphddp's code; the hook sees compiled autograd's region flag first and takes the full path
(disabled) there, where the Reducer's bookkeeping must run eagerly between the compiled pieces.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.decorators import skip

if TYPE_CHECKING:
    from .buckets import BucketSlots, FlatBucket
    from .reducer import Reducer


class Countdown:
    """What the steady hook reads: each parameter's bucket and slot, and whether the steady path is armed."""

    def __init__(self, reducer: Reducer, used: list[bool]) -> None:
        self._reducer = weakref.ref(reducer)  # the Reducer holds this; hooks hold it weakly
        self.used = used
        """``GradientUsage.used``: a gradient this rank produced (set by the hook, read at the end of backward)."""
        self.slot_of: list[tuple[FlatBucket, int]] = []
        self.armed = False

    def use(self, slots: BucketSlots) -> None:
        """A new plan's buckets: parameter ``i``'s gradient goes to ``slot_of[i]`` (its part slots are not here:
        parts come through taps, which the full path takes)."""
        self.slot_of = [(slots.buckets[b], s) for b, s in slots.slot]

    def arm(self, *, per_gradient_work: bool) -> None:
        """A backward has begun: the steady path from now on, unless something is asked of every gradient (events
        recorded, the ready order learned)."""
        self.armed = not per_gradient_work

    def disarm(self) -> None:
        self.armed = False

    def full_path(self, index: int) -> None:
        reducer = self._reducer()
        if reducer is not None:
            reducer.on_grad_ready(index)

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


class GradientHooks:
    """The post-accumulate-grad hook of every parameter, each holding the countdown weakly. ``detach`` takes them
    off while gradients are reduced inside the compiled graph (Note [In-graph reduction]: no hook is called at
    all), ``attach`` puts them back; ``handles`` is one list for the Reducer's finalizer."""

    def __init__(self, countdown: Countdown, params: list[torch.nn.Parameter]) -> None:
        self._countdown = weakref.ref(countdown)
        self._params = params
        self.handles: list[Any] = []
        self.attach()

    def attach(self) -> None:
        if not self.handles:
            me = self._countdown
            self.handles.extend(
                p.register_post_accumulate_grad_hook(functools.partial(gradient_ready, me, i)) for i, p in enumerate(self._params)
            )

    def detach(self) -> None:
        remove_all(self.handles)
        self.handles.clear()


def remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
