"""What one synchronised backward carries, in one record made at its start and dropped at its end: its phase, and
how the backward ends.

The Reducer's end of backward (``_finalize``, step 4 of Note [Reducer]) must run once autograd has produced every
gradient. The backward's first hook chooses how (``backward_ending``):

* ``EngineCallbackEnding``: ``_finalize`` is queued as an autograd engine callback, which runs once the backward
  is done (a backward that raises drops it; the next forward drains its iteration: Note [Abandoned backward]);
* ``AtLastLaunchEnding``: under compiled autograd, whose engine runs no queued callback, the hook that launches
  the last bucket runs ``_finalize``. So every parameter must get a gradient or be found unused: a backward that
  ends with a bucket incomplete leaves its iteration behind, and the next forward drops it and says so.

Until the first hook, an iteration's ending is ``NOT_BEGUN``; the next forward drops such an iteration (its forward
had no backward: nothing is in flight), unless its backward began and raised before that hook (``BackwardWatch``).

How the backward ends is a property of the backward, not a step of the iteration: the steps (``Phase``) are the
iteration's own collectives, each issued once, in order.

Note [Abandoned backward]
~~~~~~~~~~~~~~~~~~~~~~~~~
A training loop that catches an error raised inside ``backward()`` (out of memory, most often) and skips the
batch leaves an iteration whose backward began (its first hook ran, and perhaps some buckets went out) but
whose engine callback never ran. If the other ranks finished that backward, they issued
the rest of its buckets and wait for this rank's matching collectives; this rank's next collective of any other
size would abort gloo ("Received data size doesn't match", SIGABRT, no Python exception). So the next forward
*drains* it (``Iteration.drain``): every bucket it did not launch is launched on zeros (never on the bucket's
own buffer, which may be ``.grad``), in index order, each awaited as a joined rank's shadow does, then the plan
agreement with the usage count (every parameter counted as used here: no rank reports a gradient this one merely
dropped) and the late
reductions where the policy takes them; nothing is written into ``.grad`` (a bucket's only gradient, reduced in
``.grad`` itself, holds its partial average if its bucket went out before the error: Note [A lone gradient reduced
where it lies] in ``graphddp.runtime.grad_layout``). The collectives of every rank stay matched, whichever ranks
abandoned and wherever.

The gradients cannot stay consistent: the ranks that finished averaged against this rank's zeros and (most likely)
stepped, this rank did not. So the draining rank says so in its next plan agreement (``PlanAgreement``: one more
entry, 1 for a rank that abandoned its last backward), and at the forward after that every rank reads the same
sum: between 0 and the number of counting ranks, every rank raises the same error; equal to it, every rank
dropped the same backward (a skip all ranks agreed on) and training goes on. One iteration late, but every rank
and never silent.

A backward abandoned before its first hook (out of memory in its first op) issued nothing and looks like a
forward that no backward followed, which must issue nothing. ``BackwardWatch`` tells
them apart: ``Reducer.prepare`` puts a tensor hook on the forward's first output autograd computed, which
queues an engine callback when the backward reaches it; the callback never runs if the backward raised. Such an
iteration is drained too. (A ``torch.autograd.grad`` through the outputs ends normally: not
abandoned. A backward that raised before reaching that output, in the loss's own backward, is not seen.) Under
compiled autograd the iteration's ending is ``AtLastLaunchEnding`` and the next forward raises on the abandoning
rank, as before.

Gradients reduced inside the compiled graph (Note [In-graph reduction]) run no hook of the Reducer and no
agreement, and that path exists to have no collective of graphddp's own per iteration. A ``BackwardWatch`` on
the graphs' outputs still sees the abandoned backward, and the other ranks are told inside a collective that runs
anyway: every in-graph variant takes one more input, the abandon signal (``AbandonSignal`` in
``graphddp.runtime.in_graph``: a [1] tensor that requires grad, 1 on a rank that abandoned its last backward),
which its first bucket's all-reduce carries as one more element (an all-reduce of its own in float32 where that
bucket's gradients or a compressing hook's wire dtype cannot count the ranks exactly: bfloat16 beyond 256 ranks,
float16 beyond 2048; and where the first bucket is a table's rows); the sum over the ranks comes back as the
signal's gradient. It is copied to the host at the next training forward (no host sync on a GPU) and read at the
one after, on every rank alike: some but not all ranks: every rank raises, two training forwards after the
backward that carried it; all of them: training goes on. The abandoning rank also warns at once. (An exception
inside the compiled backward itself, between two of its collectives, leaves them unmatched either way: the split
path drains the Reducer's buckets, but nothing can issue the rest of a compiled graph's collectives.)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .unused import UsageCount, iter_tensors

if TYPE_CHECKING:
    from .launcher import Launcher
    from .plans import PlanKeeper
    from .unused import GradientUsage

logger = logging.getLogger(__name__)


class NotBegun:
    """No hook has run yet: the backward has not begun (perhaps never will)."""

    begun = False
    dropped_by_next_forward = True
    """The next forward drops an unfinished iteration with this ending (else it stays, as nothing replaced it)."""
    by_callback = False
    """``_finalize`` runs after the backward's last hook, so it can still launch a bucket the hooks left (Note
    [Counting without a frame] in ``graphddp.runtime.arrivals``)."""

    def all_launched(self, finalize: Callable[[], None]) -> None:
        """Every bucket is launched (never before the first hook: the forward's unused parameters are marked
        ready there)."""

    def check_finished(self, rank: int) -> None:
        """Raise if a backward with this ending ended unfinished (called by the next forward)."""


NOT_BEGUN = NotBegun()


class EngineCallbackEnding:
    """``_finalize`` is queued on the autograd engine (see the module docstring)."""

    begun = True
    dropped_by_next_forward = False
    by_callback = True

    def all_launched(self, finalize: Callable[[], None]) -> None:
        """The engine's callback finalizes, after the backward's last hook."""

    def check_finished(self, rank: int) -> None:
        pass


class AtLastLaunchEnding:
    """Compiled autograd: the hook that launches the last bucket finalizes (see the module docstring)."""

    begun = True
    dropped_by_next_forward = True
    by_callback = False

    def all_launched(self, finalize: Callable[[], None]) -> None:
        finalize()

    def check_finished(self, rank: int) -> None:
        raise RuntimeError(
            f"[rank {rank}] graphddp.DDP: the previous backward ran under compiled autograd and ended "
            "before every bucket was complete (some parameter got no gradient). Under compiled autograd the "
            "Reducer finishes when the last bucket is launched, so every parameter must get a gradient or be "
            "found unused: pass find_unused_parameters=True, or run that backward without compiled autograd."
        )


Ending = NotBegun | EngineCallbackEnding | AtLastLaunchEnding


def backward_ending(finalize: Callable[[], None]) -> EngineCallbackEnding | AtLastLaunchEnding:
    """How the backward that is beginning now ends (see the module docstring): chosen by its first hook."""
    if compiled_autograd_running():
        return AtLastLaunchEnding()  # its engine runs no queued callback
    torch.autograd.Variable._execution_engine.queue_callback(finalize)
    return EngineCallbackEnding()


def compiled_autograd_running() -> bool:
    """Is a compiled-autograd backward running now (this Reducer's ending; a tap's return value)?"""
    from torch._dynamo import compiled_autograd

    # While the compiled backward runs (our hooks, eagerly, between its pieces), only the region flag is set.
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


class BackwardWatch:
    """Did a backward through these outputs begin and not reach its end? (Note [Abandoned backward].)

    A tensor hook on the first output autograd computed (one per forward): when it fires, the backward has
    reached the outputs, and it queues an engine callback that marks the backward ended; an exception inside the
    backward drops the callback. It tells a backward that raised before any gradient hook from a forward that no
    backward followed, and from a ``torch.autograd.grad`` that ended normally (it reached the outputs too)."""

    def __init__(self) -> None:
        self._begun = False

    def watch(self, outputs: Any) -> None:
        """``outputs`` of a forward (nested as a forward returns them): the first tensor that autograd computed
        (``grad_fn`` set) carries the hook; a backward that never reaches it (a loss from other outputs) is not
        watched. Never a leaf: a parameter returned as an output would keep one more hook every forward."""
        for value in iter_tensors(outputs):
            if value.grad_fn is not None:
                value.register_hook(self._began)
                return

    def _began(self, grad: torch.Tensor) -> None:
        if compiled_autograd_running():  # its engine runs no queued callback: nothing to watch there
            return
        if not self._begun:
            self._begun = True
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self) -> None:
        self._begun = False

    def abandoned(self) -> bool:
        """A backward began and never ended since the last call (read once per forward)."""
        begun, self._begun = self._begun, False
        return begun


class Phase(enum.Enum):
    """Where an iteration stands among its own collectives besides the buckets, each issued once, in this order.
    (Not the backward: the forward's unused parameters, marked ready at its first hook, may launch every bucket
    there, and so start the count, before any other gradient is in.)"""

    PREPARED = 1
    """The forward is done (``Reducer.prepare``); nothing issued yet."""
    COUNTING_USAGE = 2
    """The plan agreement, with the usage count (``graphddp.runtime.unused``) where the policy takes one, was
    issued (``bookkeeping``): just before the last bucket's collective, or after the waits of a hook's chained
    ones."""


def bookkeeping(plans: PlanKeeper, entries: list[int] | None, *, joined: bool = False) -> UsageCount | None:
    """An iteration's one collective of graphddp's own: the plan agreement (Note [Plan agreement] in
    ``graphddp.runtime.plans``), carrying the usage count's ``entries`` where the policy takes one
    (``GradientUsage.entries``); inside the last bucket's all-reduce where it rides (Note [The agreement rides a
    bucket] in ``graphddp.runtime.agreement_ride``). Returns the count in flight, or None."""
    agreement = plans.start_agreement(joined=joined, carrying=entries or ())
    return UsageCount(*agreement.carried()) if agreement is not None and entries is not None else None


@dataclasses.dataclass
class Iteration:
    """The Reducer's state for one synchronised backward (Note [Reducer] in ``graphddp.runtime.reducer``). Made by
    ``Reducer.prepare``; the Reducer holds none between iterations, so nothing stale survives one."""

    local_unused: list[int]
    """Parameters the usage policy found unused on this rank (marked ready at the backward's first hook)."""
    prescales: Sequence[float | None]
    """By bucket index: what its gradients are multiplied by while copied in (graphddp's averaging, where the
    collective does not average: ``CommHook.prescales``), or None: not at all."""
    phase: Phase = Phase.PREPARED
    """The last of the iteration's collectives issued so far."""
    ending: Ending = NOT_BEGUN
    """How the backward ends, once it has begun (``begin_backward``; see the module docstring)."""
    usage: UsageCount | None = None
    """The usage count in flight, where the usage policy needs one (``count_usage``)."""
    watch: BackwardWatch = dataclasses.field(default_factory=BackwardWatch)
    """Sees a backward that reached the forward's outputs and raised before any gradient hook (Note [Abandoned
    backward]); armed by ``Reducer.prepare``."""

    def begin_backward(self, finalize: Callable[[], None]) -> None:
        """The backward's first hook: the backward's ending is chosen."""
        self.ending = backward_ending(finalize)

    def count_usage(
        self, launcher: Launcher, usage: GradientUsage, plans: PlanKeeper, *, fill: int | None = None,
        joined: bool = False,
    ) -> None:  # fmt: skip
        """Once, when every gradient is in: the agreement, counting on how many ranks each parameter got a gradient
        (``bookkeeping``; ``fill`` and ``joined`` as there), after the previous buckets' collectives (the
        launcher's open one committed first). The launcher issues it just before the last bucket's collective
        (``Launcher.before_last``), the end of backward after the waits where a comm hook chains collectives."""
        if self._advance(Phase.COUNTING_USAGE):
            launcher.flush()
            self.usage = bookkeeping(plans, usage.entries(fill, joined=joined), joined=joined)

    def before_last(self, launcher: Launcher, usage: GradientUsage, plans: PlanKeeper, **how: Any) -> None:
        """Have ``launcher`` issue this iteration's ``count_usage`` (with ``how``) just before its last bucket."""
        launcher.before_last = functools.partial(self.count_usage, launcher, usage, plans, **how)

    def abandoned_mid_way(self) -> bool:
        """Seen by the next forward (once): this iteration's backward began and its engine callback never ran, so
        it raised, after its first gradient hook or before it (Note [Abandoned backward])."""
        if self.ending.begun:
            return isinstance(self.ending, EngineCallbackEnding)
        return self.watch.abandoned()

    def drain(
        self, plans: PlanKeeper, launcher: Launcher, usage: GradientUsage, late: Callable[[list[int]], None], rank: int
    ) -> None:
        """Issue and await every collective this abandoned iteration left unissued, on zeros, where the other
        ranks' backward issues them (the agreement where theirs does, every parameter counted as used here); keep
        nothing (Note [Abandoned backward])."""
        self.before_last(launcher, usage, plans, fill=1)
        launcher.drain()
        self.count_usage(launcher, usage, plans, fill=1)  # a hook's chained collectives: after them (else a no-op)
        counts = usage.stand_in(self.usage)
        late(counts)  # skipped buckets some rank used after all
        logger.warning(
            "[rank %d] graphddp.DDP: the previous backward stopped before its end (an exception inside it); the "
            "collectives it left were issued on zeros so every rank's stay matched, and none of its gradients was "
            "kept. Unless every rank dropped that backward, the next forward raises on every rank "
            "(Note [Abandoned backward] in graphddp/runtime/iteration.py).",
            rank,
        )

    def _advance(self, phase: Phase) -> bool:
        """Enter ``phase`` unless the iteration is there or past it: True once, to whoever issues its collective."""
        if self.phase.value >= phase.value:
            return False
        self.phase = phase
        return True


class UnpreparedBackward:
    """Gradients that reach the hooks with no synchronising DDP forward before them accumulate locally, as in
    PyTorch's DDP. After a ``no_sync()`` forward that is the point; otherwise the training went around the wrapper
    (``ddp.module(x)`` then ``backward()``, or a second backward of one forward) and the gradients are not
    averaged: PyTorch says nothing, graphddp warns once per wrapper, naming the first such parameter."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._local_expected = False
        self._warned = False

    def forward_ran(self, *, grad_enabled: bool, synchronised: bool) -> None:
        """A forward through the wrapper: one under ``no_sync()`` with gradients makes local backwards expected,
        until the next synchronising one."""
        if grad_enabled:
            self._local_expected = not synchronised

    def gradient(self, name: str) -> None:
        """A gradient reached its hook outside any synchronised backward."""
        if not (self._local_expected or self._warned):
            self._warned = True
            warnings.warn(
                f"[rank {self._rank}] graphddp.DDP: the gradient of {name!r} reached graphddp's hooks with no forward "
                "through the wrapper before it (ddp.module(...) then backward(), or a second backward of one forward): "
                "it stays local, not averaged across ranks, as in PyTorch's DDP. Train through ddp(...); for a local "
                "backward on purpose, run its forward under ddp.no_sync().",
                stacklevel=2,
            )
