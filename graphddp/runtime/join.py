"""Uneven inputs (``DistributedDataParallel.join``): ranks that run out of data shadow the others' collectives.

Note [Join]
~~~~~~~~~~~
Under ``torch.distributed.algorithms.Join``, a rank that has run out of inputs keeps taking part in every collective
the ranks still training issue, until all have joined:

1. each forward of a training rank announces itself (``Join.notify_join_context``: an all-reduce of ones, counted
   by ``ActiveRanks``), broadcasts buffers from the largest rank still training (``common_rank``) when they are
   due, and tells joined ranks whether this iteration synchronises gradients (``announce_backward_sync``);
2. a joined rank mirrors that forward (``JoinSupport``'s hook, once per iteration): the buffer broadcast and,
   when the training ranks synchronise, a backward that contributes zeros, with the plan agreement where theirs
   goes (``Reducer.shadow_backward``); with ``find_unused_parameters`` it reports the parameters used anywhere
   in the last backward it took part in, as PyTorch's joined rank all-reduces its last usage map, so those get
   zero gradients on the training ranks, not None (``GradientUsage.entries``), and it learns from the shadow as
   a training rank from its backward (what no rank used, a static graph); compiled, a joined rank that never
   compiled a graph (no batch at all) proposes no plan there and adopts the one the training ranks agree on
   (Note [Plan agreement]);
3. once every rank joined, the last joiner's parameters (and buffers) become everyone's, and a static graph is
   learned again at the next synchronised backward on every rank (a rank with no batch froze it from a shadow:
   what no rank used, not what it leaves unused itself).

Gradients are averaged over the initial world size (PyTorch's default) or over the ranks still training
(``divide_by_initial_world_size=False``). This layer never imports the DDP: it is given what it needs of it
(``ShadowedModule``), and the DDP keeps PyTorch's ``join``/``join_hook`` as one-liners over ``JoinSupport``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from .plans import PlanKeeper
    from .unused import GradientUsage


class ActiveRanks:
    """How many ranks take part in this iteration: the world, or (under ``join``) the non-joined ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._divide_by_initial_world_size = True
        self._work: Any = None

    def divide_by_initial_world_size(self, value: bool) -> None:
        """Under ``join``: average over the initial world size (True, the default) or over the ranks still
        training (``DistributedDataParallel.join(divide_by_initial_world_size=...)``)."""
        self._divide_by_initial_world_size = value

    def set_join_work(self, work: Any) -> None:
        """The all-reduce of ones that ``Join.notify_join_context`` issued this iteration."""
        self._work = work

    def count(self) -> int:
        if self._work is None:
            return self.world_size
        self._work.wait()
        return int(self._work.result()[0].item())

    def divisor(self) -> int:
        """What the sum of the gradients is divided by this iteration."""
        return self.world_size if self._divide_by_initial_world_size else self.count()

    def clear(self) -> None:
        self._work = None


class ShadowsBackward(Protocol):
    """What a joined rank needs of the Reducer (``graphddp.runtime.reducer.Reducer``)."""

    plans: PlanKeeper
    usage: GradientUsage

    def switch_plan(self, grad_enabled: bool) -> None: ...

    def shadow_backward(self) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShadowedModule:
    """What a joined rank does to the DDP's module state, given by the DDP for one ``join`` (never stored by
    ``JoinSupport``, which the DDP owns: no reference cycle keeps a dropped DDP's hooks alive)."""

    buffers_due: Callable[[], bool]
    """Whether this iteration's forward broadcasts the buffers."""
    broadcast_buffers: Callable[[int], None]
    """Broadcast the buffers from a rank (a collective)."""
    broadcast_state: Callable[[int], None]
    """Broadcast the parameters (and buffers, with ``broadcast_buffers``) from a rank (a collective)."""
    forward_done: Callable[[bool], None]
    """Record whether the (shadowed) forward synchronises gradients: the next forward broadcasts buffers only then."""


class JoinSupport:
    """The join machinery of one DDP (Note [Join]): the active ranks its Reducer divides by, and the collectives a
    joined rank shadows."""

    def __init__(
        self,
        reducer: ShadowsBackward,
        active_ranks: ActiveRanks,
        *,
        group: dist.ProcessGroup,
        rank: int,
        device: torch.device,
    ) -> None:
        self._reducer = reducer
        self._active_ranks = active_ranks
        self._group = group
        self._rank = rank
        self._device = device

    def hook(self, module: ShadowedModule, divide_by_initial_world_size: bool) -> JoinHook:
        """The ``JoinHook`` of ``Joinable.join_hook``: averages as asked, shadows ``module``'s iterations."""
        self._active_ranks.divide_by_initial_world_size(divide_by_initial_world_size)
        return _DDPJoinHook(self, module)

    def notify(self, joinable: Joinable) -> None:
        """A training rank's forward: announce it to the join context, which counts the ranks still training."""
        work = Join.notify_join_context(joinable)
        if work is not None:
            self._active_ranks.set_join_work(work)

    def common_rank(self, candidate: bool) -> int:
        """The largest rank among those with ``candidate`` True (a collective)."""
        rank = torch.tensor([self._rank if candidate else -1], device=self._device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self._group)
        assert rank.item() >= 0, "no rank volunteered as the authoritative copy"
        return int(rank.item())

    def announce_backward_sync(self, synchronises: bool) -> None:
        """A training rank tells joined ranks whether this iteration synchronises gradients (they then shadow the
        backward)."""
        self._backward_sync_flag(synchronises)

    def shadow_iteration(self, module: ShadowedModule) -> None:
        """What a joined rank does while others still train: mirror their forward and backward collectives."""
        self._reducer.switch_plan(grad_enabled=True)
        if module.buffers_due():
            module.broadcast_buffers(self.common_rank(False))
        flag, work = self._backward_sync_flag(False)
        work.wait()
        should_sync = bool(flag.item() != 0)
        module.forward_done(should_sync)
        if should_sync:
            self._reducer.shadow_backward()

    def sync_final_model(self, module: ShadowedModule, is_last_joiner: bool) -> None:
        """After all ranks joined, the last joiner's parameters (and buffers) become everyone's, and its count of
        training forwards (ranks that joined stopped counting: the next agreement would find them out of step);
        a static graph is learned again (``GradientUsage.join_ended``)."""
        src = self.common_rank(is_last_joiner)
        module.broadcast_state(src)
        self._reducer.plans.adopt_forward_count(src)
        self._reducer.usage.join_ended()

    def _backward_sync_flag(self, synchronises: bool) -> tuple[torch.Tensor, Any]:
        """The all-reduce behind ``announce_backward_sync`` (joined ranks add nothing): (flag, work)."""
        flag = torch.zeros(1, device=self._device)
        if synchronises:
            flag += 1
        return flag, dist.all_reduce(flag, group=self._group, async_op=True)


class _DDPJoinHook(JoinHook):
    """Join hook: shadow one iteration per main_hook call, then agree on the final model."""

    def __init__(self, join: JoinSupport, module: ShadowedModule) -> None:
        self._join = join
        self._module = module

    def main_hook(self) -> None:
        self._join.shadow_iteration(self._module)

    def post_hook(self, is_last_joiner: bool) -> None:
        self._join.sync_final_model(self._module, is_last_joiner)
