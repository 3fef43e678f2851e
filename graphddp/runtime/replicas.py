"""Are the replicas still the same? An opt-in check of the parameters' values across ranks.

Replicas drift apart silently, in PyTorch's DDP and in graphddp alike, when something changes the weights on some
ranks only: a checkpoint loaded on rank 0 after wrapping, a parameter re-initialised in place, an optimizer step
skipped on one rank. ``check_replicas`` finds it: per parameter, a digest of its bits (the sum of its elements read
as integers of its width: equal tensors give equal digests, a changed element almost surely changes it), all-reduced
as its maximum and its minimum; where they differ, the ranks differ, and every rank raises the same error naming
the first such parameter and the ranks' digests. Two small all-reduces and one pass over the parameters: measured
in ``docs/reliability.md``. ``graphddp.DDP(..., check_replicas_every=N)`` runs it before every N-th training
forward; ``graphddp.check_replicas(ddp)`` runs it once (collective: call it on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDiffer(RuntimeError):
    """The ranks hold different values of some parameter (raised on every rank alike)."""


def digest(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64: the sum of ``t``'s elements read as integers of their width (bit-exact, order-free)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_BITS[t.element_size()]).sum(dtype=torch.int64)


@torch.no_grad()
def check_replicas(named: Sequence[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise ``ReplicasDiffer`` on every rank if some parameter in ``named`` differs across the ranks of ``group``."""
    if dist.get_world_size(group) == 1 or not named:
        return
    here = torch.stack([digest(p) for _, p in named]).to(device)  # [params]
    high, low = here.clone(), here.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    differ = (high != low).nonzero().flatten().tolist()
    if differ:
        first = differ[0]
        raise ReplicasDiffer(
            f"[rank {dist.get_rank(group)}] graphddp: the replicas differ: {len(differ)} parameter(s), the first "
            f"{named[first][0]!r} (its digests range from {int(low[first])} to {int(high[first])} across the ranks). "
            "Something changed the weights on some ranks only (a checkpoint loaded on one rank after "
            "wrapping, an in-place re-initialisation, an optimizer step skipped): load or change them on every rank, "
            "or broadcast rank 0's (torch.distributed.broadcast) before training on."
        )


class ReplicaCheck:
    """``check_replicas_every=N``: ``check_replicas`` before every N-th synchronising forward (0: never)."""

    def __init__(self, every: int, named: Sequence[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup, device: torch.device) -> None:
        self.every, self._named, self._group, self._device = every, list(named), group, device
        self._forwards = 0

    def before_forward(self, synchronising: bool) -> None:
        if self.every and synchronising:
            self._forwards += 1
            if self._forwards % self.every == 0:
                check_replicas(self._named, group=self._group, device=self._device)
