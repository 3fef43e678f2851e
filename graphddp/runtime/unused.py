"""Which parameters will get no gradient this iteration, decided once per forward.

Three small policies instead of flags in the hot hook:

* ``ExpectAllUsed`` (default): every parameter must get a gradient on every rank. The usage map is still
  all-reduced (a few bytes, after the last bucket) so that a parameter without a gradient, even on one rank
  only, becomes the same clear error on every rank instead of a hang. It travels in the plan agreement's
  all-reduce, issued just before the last bucket's (Note [Plan agreement] in ``graphddp.runtime.plans``), so
  it is done when the last bucket is.
* ``SearchEveryIteration`` (``find_unused_parameters=True``): walk the autograd graph from the forward's
  outputs; parameters not reached are marked ready at the backward's first gradient (their bucket can launch
  then; never by a forward alone, Note [Reducer]), and parameters unused on
  every rank keep ``.grad`` as it was (the globally-unused bitmap of the VLDB 2020 paper).
* ``StaticGraph`` (``static_graph=True``): no search at all; the parameters that got no gradient in the first
  iteration's backward are the unused ones from then on, as PyTorch's static graph learns them (a search of the
  autograd graph cannot see into a reentrant checkpoint, whose parameters' gradients come from its own inner
  backward); no usage all-reduce afterwards.

``GradientUsage`` keeps what the Reducer learns about usage: which parameters got a gradient here (over
``no_sync`` micro-batches too), the all-reduce of that map after the last bucket, and the missing-gradient error.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) forward output, in order: tensors, lists, tuples, dicts, dataclass-like objects.
    Lazy, so a caller that needs only the first one walks no further."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) forward output (``iter_tensors``)."""
    return list(iter_tensors(obj))


def reachable_params(outputs: Iterable[torch.Tensor], index_of: dict[int, int]) -> set[int]:
    """Indices of the parameters whose AccumulateGrad nodes the autograd graph of ``outputs`` reaches.

    ``index_of`` maps ``id(param)`` to the parameter's index in the Reducer.
    """
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    reached: set[int] = set()
    for t in outputs:  # an output that *is* a parameter (grad_fn None, requires_grad True)
        if t.requires_grad and id(t) in index_of:
            reached.add(index_of[id(t)])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in index_of:
            reached.add(index_of[id(variable)])
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached


class ExpectAllUsed:
    """Default: no parameter may miss its gradient (see the module docstring)."""

    allows_unused = False
    searches_each_iteration = False
    """Which parameters are unused may change from one iteration to the next (compiled graphs stay split)."""
    may_leave_unused = False
    """Some parameter may get no gradient in the next backward (in-graph reduction waits: Note [In-graph reduction])."""
    known_counts: list[int] | None = None
    """Per-parameter number of ranks that produced a gradient, when known without an all-reduce."""

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        return []

    def reduces_usage(self) -> bool:
        return True

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        pass

    def relearn(self) -> None:
        """Learn again from the next synchronised backward (after a ``join``); nothing is learned here."""


class SearchEveryIteration:
    """``find_unused_parameters=True``: one autograd-graph traversal per forward."""

    allows_unused = True
    searches_each_iteration = True
    may_leave_unused = True
    known_counts: list[int] | None = None

    def __init__(self) -> None:
        self.traversals = 0

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        self.traversals += 1
        reached = reachable_params(find_tensors(outputs), index_of)
        return sorted(set(index_of.values()) - reached)

    def reduces_usage(self) -> bool:
        return True

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        pass

    def relearn(self) -> None:
        """Learn again from the next synchronised backward (after a ``join``); nothing is learned here."""


class StaticGraph(SearchEveryIteration):
    """``static_graph=True``: the first iteration's backward says which parameters get no gradient; that holds for
    every later one. Nothing is searched: in the first iteration no parameter is marked unused up front, and the
    end of its backward fills the ones no gradient reached (``GradientUsage.end`` tells ``observe``)."""

    searches_each_iteration = False

    def __init__(self) -> None:
        super().__init__()
        self._frozen: list[int] | None = None

    @property
    def may_leave_unused(self) -> bool:  # type: ignore[override]
        """Until the first iteration has said, or when it found some parameter unused."""
        return self._frozen is None or bool(self._frozen)

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        return self._frozen if self._frozen is not None else []

    def reduces_usage(self) -> bool:
        return self._frozen is None

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        if self._frozen is None:
            self._frozen = list(local_unused)
            self.known_counts = global_counts

    def relearn(self) -> None:
        """The next synchronised backward is a first iteration again: counted, and frozen from (after a ``join``,
        where a rank with no batch froze what no rank used, not what it leaves unused itself)."""
        self._frozen, self.known_counts = None, None


UsagePolicy = ExpectAllUsed | SearchEveryIteration | StaticGraph


class UsageCount:
    """The all-reduce of the usage map, in flight: per parameter, on how many ranks it got a gradient (``counts``:
    the plan agreement's entries that carry it, ``agreement``: that all-reduce's)."""

    def __init__(self, counts: torch.Tensor, agreement: Any) -> None:
        self._counts = counts
        self._agreement = agreement  # graphddp.runtime.plans.PlanAgreement

    def wait(self) -> list[int]:
        self._agreement.settle()
        return self._counts.tolist()


class GradientUsage:
    """Which parameters got a gradient: on this rank, and summed over the ranks once the last bucket is out.

    The count goes over the DDP's own process group (no group of graphddp's: it would need threads, sockets and a
    timeout of its own), in the plan agreement's all-reduce; the Reducer says when (Note [Reducer]).
    """

    def __init__(self, names: list[str], policy: UsagePolicy, *, rank: int, world_size: int) -> None:
        self.policy = policy
        """How unused parameters are found (replaced only through ``set_policy``)."""
        self._names = names
        self._rank = rank
        self._world_size = world_size
        self.used = [False] * len(names)
        """Per parameter: got a gradient here since the last synchronised backward ended (no_sync included)."""
        self.iterations = 0
        """Synchronised backwards ended so far."""
        self.unused_sets: set[frozenset[int]] = set()
        """The distinct sets of parameters without a gradient anywhere, one per kind of iteration seen."""
        self.never_used: frozenset[int] = frozenset()
        """Parameters that got no gradient on any rank in any synchronised backward so far (none before the first
        ends): from all-reduced counts, so the same on every rank (``skip_all_reduce_unused_params``)."""
        self._pending_error: str | None = None  # the last backward's missing gradient, raised by the next forward
        # Per parameter: got a gradient on some rank in the last synchronised backward this rank took part in (its
        # own, or joined, its shadow of the others'): what a joined rank reports (``entries(joined=True)``).
        self._last_used = [False] * len(names)

    def set_policy(self, policy: UsagePolicy) -> None:
        """Find unused parameters by ``policy`` from now on (``static_graph`` turned on before the first iteration)."""
        self.policy = policy

    def entries(self, fill: int | None = None, *, joined: bool = False) -> list[int] | None:
        """This rank's part in the usage count, which the plan agreement's all-reduce carries (Note [Plan
        agreement] in ``graphddp.runtime.plans``): per parameter 1 if it got a gradient here, or ``fill`` for every
        one (1: an abandoned backward's stand-in, so no rank reports a gradient this one merely dropped). None where
        the policy needs no count. ``joined``: a joined rank's shadow; searching for unused parameters
        (``find_unused_parameters``) it reports what was used anywhere in the last backward it took part in, as
        PyTorch's DDP's joined rank all-reduces its last (all-reduced) usage map: a parameter some rank used then
        gets a zero gradient on the training ranks, not None; otherwise nothing (PyTorch's sends no map there, and
        a gradient missing on a training rank must still be found missing) (Note [Join] in
        ``graphddp.runtime.join``)."""
        if self._world_size == 1 or not self.policy.reduces_usage():
            return None
        if joined:  # PyTorch's joined rank sends its usage map only where it searches for unused parameters
            sticky = self.policy.searches_each_iteration
            return [int(u and sticky) for u in self._last_used]
        return [int(u) for u in self.used] if fill is None else [fill] * len(self._names)

    def shadowed(self, pending: UsageCount | None) -> list[int]:
        """A joined rank's shadow of a synchronised backward ends: its counts (``counts``), learned from as the
        training ranks learn from their backward (``end``): the next shadow's entries, the parameters no rank has
        used (``skip_all_reduce_unused_params``: the same buckets skipped on every rank), and the usage policy
        (``static_graph``: the first iteration freezes what no rank used and stops the count on every rank alike,
        this one included, until the join ends: ``join_ended``)."""
        counts = self.counts(pending)
        self._learn(counts, [i for i, c in enumerate(counts) if c == 0])
        return counts

    def join_ended(self) -> None:
        """Every rank left a ``join``: a static graph frozen from a shadow (a rank with no batch, which never ran the
        first iteration itself) is learned again at the next synchronised backward, on every rank alike."""
        self.policy.relearn()

    def _learn(self, counts: list[int], unused_here: list[int]) -> None:
        """A synchronised backward's usage, summed over the ranks (``counts``) and on this rank."""
        self.policy.observe(unused_here, counts)
        self._last_used = [c > 0 for c in counts]
        unused_everywhere = frozenset(i for i, c in enumerate(counts) if c == 0)
        self.never_used = unused_everywhere if self.iterations == 0 else self.never_used & unused_everywhere
        self.iterations += 1
        self.unused_sets.add(unused_everywhere)

    def counts(self, pending: UsageCount | None) -> list[int]:
        """Per parameter: on how many ranks it got a gradient this iteration."""
        if pending is not None:
            return pending.wait()
        if self.policy.known_counts is not None:
            return self.policy.known_counts
        return [1 if u else 0 for u in self.used]  # one rank, or a policy that does not reduce: all there is

    def stand_in(self, issued: UsageCount | None) -> list[int]:
        """An abandoned backward's counts (Note [Abandoned backward]): the count it issued, awaited (its own
        entries, or the stand-in ones of ``entries(fill=1)``), else every parameter counted as used here. Forgets
        this rank's usage (its gradients were dropped)."""
        self.used[:] = [False] * len(self._names)
        return issued.wait() if issued is not None else [1] * len(self._names)

    def end(self, local_unused: list[int], counts: list[int], missing: list[int], expected: int) -> None:
        """End of a synchronised backward: tell the policy, forget this rank's usage, and keep the error for the
        next forward (``raise_pending``) if a parameter missed its gradient where the policy forbids it (the same
        on every rank)."""
        self._learn(counts, sorted({*local_unused, *missing}))  # unused: marked up front, or filled at the end
        self.used[:] = [False] * len(self._names)  # in place: the steady hook writes this list (graphddp.runtime.countdown)
        error = self._missing_error(counts, missing, expected)
        if error is not None:
            logger.warning("%s", error)
            self._pending_error = error

    def raise_pending(self) -> None:
        """Start of a forward: raise the error the last synchronised backward left, once."""
        if self._pending_error is not None:
            message, self._pending_error = self._pending_error, None
            raise RuntimeError(message)

    def _missing_error(self, counts: list[int], missing: list[int], expected: int) -> str | None:
        """The error for parameters that got a gradient on fewer than ``expected`` ranks, if the policy forbids it."""
        if self.policy.allows_unused:
            return None
        bad = [i for i, c in enumerate(counts) if c < expected]
        if not bad:
            return None
        here = set(missing)
        described = ", ".join(
            f"{self._names[i]!r} (gradient on {counts[i]} of {expected} ranks"
            + (", not on this one)" if i in here else ")")
            for i in bad[:5]
        )
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        return (
            f"[rank {self._rank}] graphddp.DDP: Expected to have finished reduction in the prior iteration before "
            f"starting a new one: the previous backward produced no gradient for {described}{more}. "
            "Every trainable parameter must take part in the loss on every rank. If some parameters are "
            "legitimately unused in some iterations (conditional branches), pass find_unused_parameters=True to "
            "graphddp.DDP; if they are never used, set requires_grad=False on them."
        )


def ready_twice(rank: int, name: str, *, marked_unused: bool) -> str:
    """The error for a parameter whose gradient arrives twice in one synchronised backward."""
    why = (
        "find_unused_parameters marked it unused, yet it received a gradient (is a tensor that depends on it "
        "missing from the forward's outputs?)"
        if marked_unused
        else "its gradient was accumulated twice in one backward (reentrant checkpointing, or the same parameter "
        "reached through two backward calls)"
    )
    return (
        f"[rank {rank}] graphddp: parameter {name!r} was marked ready twice in one iteration: {why}. Use "
        "torch.utils.checkpoint(..., use_reentrant=False) and one backward per forward."
    )
