"""The process groups a DDP's buckets are reduced on: one (the DDP's own), or ``channels`` of them in turn.

Note [Channels]
~~~~~~~~~~~~~~~
A process group runs its collectives one after the other: gloo has one worker thread and one set of connections
per group, so bucket k+1's all-reduce starts only once bucket k's has finished, even when the link could carry
both (its latency, the time to fill a long link, the CPU work of a ring step). The DDP paper (Li et al., VLDB
2020) measured *round-robin process groups* for this: consecutive buckets issued on k groups in turn, so up to k
all-reduces are in flight at once, with the largest gains on gloo. PyTorch has since removed its round-robin
group; graphddp offers it as ``channels=k``:

* **which group**: bucket ``i`` goes on channel ``bucket_channel(i, k)`` = ``i % k``
  (``graphddp.passes.bucket_channel``), channel 0 being the DDP's own group. Buckets are still launched in plan
  order on every rank (``graphddp.runtime.launcher``), so each group sees the same sequence of collectives on
  every rank; the Reducer's own small collectives (plan agreement, usage count) and the buffer broadcast stay on
  the DDP's group (the agreement travels on the last bucket's channel where it rides that bucket, Note [The
  agreement rides a bucket] in ``graphddp.runtime.agreement_ride``). The in-graph reduction (Note [In-graph reduction]) names each bucket's group by the same rule.
* **how they are made**: at construction, on every rank, k-1 new groups over the DDP's ranks, with its backend
  and its timeout (``torch.distributed.new_group``; every rank of the default group takes part, so the DDP's
  group must span them all). The ranks' ``channels`` are compared with the other construction options first
  (``verify_same_params``): ranks that differ raise, instead of pairing their groups wrongly.
* **what they reduce**: graphddp's own averaging (and a row-sparse table's mask and rows). A registered comm hook
  reduces on the group in its state, as in PyTorch, so it runs on one channel whatever ``k`` says.
* **lifetime**: the groups are destroyed when the DDP is freed (``weakref.finalize``; nothing left: threads,
  sockets, entries in ``torch.distributed``'s tables), or earlier by ``torch.distributed.destroy_process_group()``.
  A copy of the DDP (``copy.deepcopy``, unpickling) reduces on one channel: making groups is a collective, and a
  copy is often made on one rank only.

* **how many, with ``channels="auto"``**: the step cost model decides (``graphddp.passes.choose_channels``, Note
  [Step cost model]): the link is measured at construction (``calibration.link_of``, rank 0's fit, the one
  ``bucket_cap_mb="auto"`` measures if it is asked for too), and the registration-order buckets are predicted on
  1, 2 and 4 channels as if all were ready at once (nothing is known of the backward yet; that is the schedule
  where the link queues most, the only one where channels can pay). More than one only where they pay by the
  model's margin: a latency-bound link (many buckets, each mostly α). The same count on every rank: rank 0's
  fit, the verified parameters' plan.

The price: k-1 more groups (a thread and a connection to every peer each, on gloo) and, for a collective split
over several groups, no ordering between the channels' traffic; the sums themselves are the same up to the order
of floating-point additions inside each all-reduce.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..passes import LinkModel, StepInputs, bucket_channel, choose_channels
from .calibration import link_of

logger = logging.getLogger(__name__)


class Channels:
    """The groups buckets are reduced on, in turn (Note [Channels]); the first is the DDP's own group."""

    def __init__(self, groups: Sequence[dist.ProcessGroup]) -> None:
        assert groups, "at least the DDP's own group"
        self.groups = tuple(groups)

    @classmethod
    def single(cls, group: dist.ProcessGroup) -> Channels:
        """Every bucket on ``group``."""
        return cls((group,))

    @classmethod
    def open(
        cls, group: dist.ProcessGroup, count: int | str, *, owner: Any, bucket_bytes: Sequence[int] = (),
        link: LinkModel | None = None, device: torch.device | None = None,
    ) -> Channels:  # fmt: skip
        """``group`` and ``count - 1`` new groups over its ranks, destroyed when ``owner`` is freed. A collective
        over every rank of the default group (``torch.distributed.new_group``). ``count="auto"``: as many as pay
        for ``bucket_bytes`` on ``link`` (measured here when None; see the Note)."""
        if count == "auto":
            count = auto_channel_count(group, bucket_bytes, link, device)
        assert isinstance(count, int), "DDPOptions validates channels"
        if count == 1:
            return cls.single(group)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) != dist.get_world_size():
            raise ValueError(
                f"[rank {dist.get_rank()}] graphddp.DDP: channels={count} makes {count - 1} more process groups, "
                f"which every rank of the default group must take part in, but the DDP's process group holds "
                f"{len(ranks)} of the {dist.get_world_size()} ranks. Use channels=1 with a process group of part "
                "of the ranks (Note [Channels] in graphddp/runtime/channels.py)."
            )
        timeout, backend = group_timeout(group), dist.get_backend(group)
        extra = [
            dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"graphddp_channel_{k}")
            for k in range(1, count)
        ]
        weakref.finalize(owner, _destroy, extra)
        logger.info("[rank %d] graphddp.DDP: buckets reduced on %d channels (%s, timeout %s)",
                    dist.get_rank(group), count, backend, timeout)  # fmt: skip
        return cls((group, *extra))

    def of_bucket(self, index: int) -> dist.ProcessGroup:
        """The group bucket ``index`` is reduced on."""
        return self.groups[bucket_channel(index, len(self.groups))]

    @property
    def names(self) -> tuple[str, ...]:
        """The groups as functional collectives name them, channel by channel (in-graph reduction)."""
        return tuple(g.group_name for g in self.groups)


def auto_channel_count(
    group: dist.ProcessGroup, bucket_bytes: Sequence[int], link: LinkModel | None, device: torch.device | None
) -> int:
    """``channels="auto"`` (see the Note): the count the step cost model picks for these buckets on this link."""
    world = dist.get_world_size(group)
    if world == 1 or not bucket_bytes:
        return 1
    link = link if link is not None else link_of(group, device=device)
    all_ready = StepInputs(segment_backward_s=(0.0,), bucket_bytes=tuple(bucket_bytes), completed_by=(0,) * len(bucket_bytes))
    count, steps = choose_channels(all_ready, link, world)
    logger.info(  # the link itself: calibration.link_of logs it when it measures it
        "[rank %d] graphddp.DDP: channels='auto' picks %d for %d buckets (predicted all-reduces %s ms on 1, 2, 4 channels)",
        dist.get_rank(group), count, len(bucket_bytes), [round(s * 1e3, 1) for s in steps.values()],
    )  # fmt: skip
    return count


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was made with (the user's), read from its backend; None: the backend's default."""
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def _destroy(groups: Sequence[dist.ProcessGroup]) -> None:
    """Destroy the channel groups still alive (``destroy_process_group()`` may have destroyed them already)."""
    if not dist.is_initialized():
        return
    alive = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in alive:
            dist.destroy_process_group(group)
