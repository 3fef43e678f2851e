"""Which parameters will get no gradient this iteration, decided once per forward.

Three small policies instead of flags in the hot hook:

* ``ExpectAllUsed`` (default): every parameter must get a gradient on every rank. The usage map is still
  all-reduced (a few bytes, after the last bucket) so that a parameter without a gradient, even on one rank
  only, becomes the same clear error on every rank instead of a hang (Note [Usage count read at the next
  forward]: in steady state nothing waits for it before then).
* ``SearchEveryIteration`` (``find_unused_parameters=True``): walk the autograd graph from the forward's
  outputs; parameters not reached are marked ready at once (their bucket can launch), and parameters unused on
  every rank keep ``.grad`` as it was (the globally-unused bitmap of the VLDB 2020 paper).
* ``StaticGraph`` (``static_graph=True``): search in the first iteration only, then reuse the answer; no
  traversal and no usage all-reduce afterwards.

``GradientUsage`` keeps what the Reducer learns about usage: which parameters got a gradient here (over
``no_sync`` micro-batches too), the all-reduce of that map after the last bucket, and the missing-gradient error.

Note [Usage count read at the next forward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The usage all-reduce goes after the last bucket, so a backward that waited for it would end one more round trip
after its last bucket: on two gloo ranks sharing two cores, that wait and the module walk of a buffer check cost
about as much as the rest of the gap to PyTorch's C++ Reducer (``docs/benchmarks.md``, session 9). In the common
case nothing at the end of backward needs the counts: when this rank produced every gradient, under a policy that
allows no unused parameter, with no bucket skipped (``skip_all_reduce_unused_params``), and the count sent with
the last bucket (not after the waits a comm hook's chained collectives need: a rank that fails in those never
issues it, and the others must learn so in this backward, ``Iteration.usage_counts``), the counts can only say
that *another* rank missed a gradient, and that error is raised at the next forward anyway. So there the
backward takes the counts as every rank's (``counts``), and the next forward (``raise_pending``) waits for the
real ones and raises the same error, on every rank, that the end of backward would have kept. The collective
is issued where it always was: ranks issue the same collectives in the same order whoever defers the read. A
rank that missed a gradient, or a policy that acts on the counts (``find_unused_parameters``: gradients of
parameters nobody used; ``static_graph``: the first iteration's answer), reads them at the end of backward.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

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


class StaticGraph(SearchEveryIteration):
    """``static_graph=True``: the first iteration's answer holds for every later one."""

    searches_each_iteration = False

    def __init__(self) -> None:
        super().__init__()
        self._frozen: list[int] | None = None

    @property
    def may_leave_unused(self) -> bool:  # type: ignore[override]
        """Until the first iteration has said, or when it found some parameter unused."""
        return self._frozen is None or bool(self._frozen)

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        if self._frozen is not None:
            return self._frozen
        return super().locally_unused(outputs, index_of)

    def reduces_usage(self) -> bool:
        return self._frozen is None

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        if self._frozen is None:
            self._frozen = list(local_unused)
            self.known_counts = global_counts


UsagePolicy = ExpectAllUsed | SearchEveryIteration | StaticGraph


class UsageCount:
    """The all-reduce of the usage map, in flight: per parameter, on how many ranks it got a gradient."""

    def __init__(self, counts: torch.Tensor, work: Any) -> None:
        self._counts = counts
        self._work = work

    def wait(self) -> list[int]:
        self._work.wait()
        return self._counts.tolist()


class GradientUsage:
    """Which parameters got a gradient: on this rank, and summed over the ranks once the last bucket is out.

    The count goes over the DDP's own process group (no group of graphddp's: it would need threads, sockets and a
    timeout of its own), after the buckets' collectives; the Reducer says when (Note [Reducer]).
    """

    def __init__(
        self, names: list[str], policy: UsagePolicy, *, group: Any, device: torch.device, rank: int, world_size: int
    ) -> None:
        self.policy = policy
        """How unused parameters are found (replaced only through ``set_policy``)."""
        self._names = names
        self._group, self._device = group, device
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
        self._unread: UsageCount | None = None  # the last backward's count, read by the next forward (Note above)
        self._unread_expected = 0

    def set_policy(self, policy: UsagePolicy) -> None:
        """Find unused parameters by ``policy`` from now on (``static_graph`` turned on before the first iteration)."""
        self.policy = policy

    def start_count(self) -> UsageCount | None:
        """Issue the usage all-reduce (after the last bucket), or None where the policy does not need one."""
        if self._world_size == 1 or not self.policy.reduces_usage():
            return None
        counts = torch.tensor([int(u) for u in self.used], dtype=torch.int64, device=self._device)
        return UsageCount(counts, dist.all_reduce(counts, group=self._group, async_op=True))

    def counts(self, pending: UsageCount | None, *, wanted_now: bool = True) -> list[int]:
        """Per parameter: on how many ranks it got a gradient this iteration. Not ``wanted_now``: the caller acts
        on no parameter unused here, so where the count can only say that another rank missed a gradient, it is
        read at the next forward and every rank is taken to have produced every one until then (Note [Usage
        count read at the next forward])."""
        if pending is not None and not wanted_now and not self.policy.allows_unused and all(self.used):
            self._unread = pending
            return [self._world_size] * len(self._names)
        if pending is not None:
            return pending.wait()
        if self.policy.known_counts is not None:
            return self.policy.known_counts
        return [1 if u else 0 for u in self.used]  # one rank, or a policy that does not reduce: all there is

    def shadow(self) -> list[int]:
        """A joined rank's part in the usage all-reduce: it used nothing. Returns the counts (what others used)."""
        if self._world_size > 1 and self.policy.reduces_usage():
            counts = torch.zeros(len(self._names), dtype=torch.int64, device=self._device)
            dist.all_reduce(counts, group=self._group)
            return counts.tolist()
        return [0] * len(self._names)

    def stand_in(self, issued: UsageCount | None) -> list[int]:
        """An abandoned backward's part in the usage all-reduce (Note [Abandoned backward]): awaited if ``issued``,
        else every parameter counted as used here, so no rank reports a missing gradient that this rank merely
        dropped. Returns the counts, and forgets this rank's usage (its gradients were dropped)."""
        self.used[:] = [False] * len(self._names)
        if issued is not None:
            return issued.wait()
        if self._world_size > 1 and self.policy.reduces_usage():
            counts = torch.ones(len(self._names), dtype=torch.int64, device=self._device)
            dist.all_reduce(counts, group=self._group)
            return counts.tolist()
        return [1] * len(self._names)

    def end(self, local_unused: list[int], counts: list[int], missing: list[int], expected: int) -> None:
        """End of a synchronised backward: tell the policy, forget this rank's usage, and keep the error for the
        next forward (``raise_pending``) if a parameter missed its gradient where the policy forbids it (the same
        on every rank)."""
        self.policy.observe(local_unused, counts)
        self.used[:] = [False] * len(self._names)  # in place: the steady hook writes this list (graphddp.runtime.countdown)
        unused_everywhere = frozenset(i for i, c in enumerate(counts) if c == 0)
        self.never_used = unused_everywhere if self.iterations == 0 else self.never_used & unused_everywhere
        self.iterations += 1
        self.unused_sets.add(unused_everywhere)
        self._unread_expected = expected
        if self._unread is None:
            self._keep_error(counts, missing, expected)

    def _keep_error(self, counts: list[int], missing: list[int], expected: int) -> None:
        error = self._missing_error(counts, missing, expected)
        if error is not None:
            logger.warning("%s", error)
            self._pending_error = error

    def raise_pending(self) -> None:
        """Start of a forward: raise the error the last synchronised backward left, once (read from its usage
        count here if the backward did not wait for it)."""
        if self._unread is not None:
            unread, self._unread = self._unread, None
            self._keep_error(unread.wait(), [], self._unread_expected)
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
