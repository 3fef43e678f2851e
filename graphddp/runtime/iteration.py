"""What one synchronised backward carries, in one record made at its start and dropped at its end."""

from __future__ import annotations

import dataclasses

from .unused import UsageCount


@dataclasses.dataclass
class Iteration:
    """The Reducer's state for one synchronised backward (Note [Reducer] in ``graphddp.runtime.reducer``). Made by
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
    """The usage count (``graphddp.runtime.unused``) was started, after the last bucket."""
    usage: UsageCount | None = None
    """That count in flight, where the usage policy needs one."""
