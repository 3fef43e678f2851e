"""What one synchronised backward carries, in one record made at its start and dropped at its end; and how many
ranks take part in it (all of them, or under ``join`` the ones that still have data)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .unused import UsageCount


@dataclasses.dataclass
class Iteration:
    """The Reducer's state for one synchronised backward (Note [Reducer] in ``graphddp.reducer``). Made by
    ``prepare_for_backward``; the Reducer holds none between iterations, so nothing stale survives one."""

    local_unused: list[int]
    """Parameters the usage policy found unused on this rank (marked ready at once)."""
    prescale: float | None
    """Gradients are multiplied by this while copied into their buckets (default hook), or not at all."""
    finalize_queued: bool = False
    """The end-of-backward callback is queued: the backward has begun."""
    agreement_started: bool = False
    """The plan agreement all-reduce was issued: before the first hook or the first launch, whichever comes first."""
    finalize_at_last_launch: bool = False
    """Under compiled autograd, which runs no queued callback: finalize once the last bucket is launched."""
    usage_counting: bool = False
    """The usage count (``graphddp.unused``) was started, after the last bucket."""
    usage: UsageCount | None = None
    """That count in flight, where the usage policy needs one."""


class ActiveRanks:
    """How many ranks take part in this iteration: the world, or (under ``join``) the non-joined ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.divide_by_initial_world_size = True
        """Under ``join``: average over the initial world size (True) or over the ranks still training."""
        self._work: Any = None

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
        return self.world_size if self.divide_by_initial_world_size else self.count()

    def clear(self) -> None:
        self._work = None
