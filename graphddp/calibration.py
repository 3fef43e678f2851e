"""Measure the link a process group runs over: the α-β fit of the step cost model (Note [Step cost model] in
``passes/cost.py``), from a short series of all-reduces on the group itself, cached per group.

Every rank times the same all-reduces, but clocks and noise differ; rank 0's fit is broadcast so every rank
holds the same model (whatever is decided from it, such as bucket caps, must be the same on every rank).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .passes import LinkModel, fit_link

logger = logging.getLogger(__name__)

DEFAULT_SIZES = tuple(1 << k for k in range(12, 23, 2))
"""4 KiB to 4 MiB: latency-bound to bandwidth-bound on the links the benchmark emulates."""

_fitted: weakref.WeakKeyDictionary[dist.ProcessGroup, LinkModel] = weakref.WeakKeyDictionary()


def link_of(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 3,
    device: torch.device | None = None,
) -> LinkModel:
    """The link model of ``group`` (collective: every rank of it calls this), measured once and cached."""
    group = group if group is not None else dist.group.WORLD
    if group in _fitted:
        return _fitted[group]
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError("calibrating a link needs a process group of at least 2 ranks")
    device = device or torch.device("cpu")
    samples = []
    for nbytes in sizes:
        buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buffer, group=group)  # warm-up: connections, allocations
        for _ in range(repeats):
            dist.barrier(group=group)
            started = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append((buffer.numel() * 4, time.perf_counter() - started))
    local = fit_link(samples, world)
    agreed = torch.tensor([local.latency_s, local.seconds_per_byte], dtype=torch.float64, device=device)
    dist.broadcast(agreed, group=group, group_src=0)
    link = LinkModel(latency_s=float(agreed[0]), seconds_per_byte=float(agreed[1]))
    logger.info(
        "graphddp: link of a %d-rank group: latency %.1f us, %.2f Gbit/s (rank 0's fit of %d all-reduces)",
        world, link.latency_s * 1e6, 8e-9 / link.seconds_per_byte if link.seconds_per_byte else float("inf"), len(samples),
    )
    _fitted[group] = link
    return link
