"""What a steady synchronised step waits for and walks, on two gloo ranks: the usage count is read by the next
forward, not by the backward (Note [Usage count read at the next forward] in graphddp.runtime.unused), and a
module without buffers is not walked for buffers every forward. Claims from recorded calls, never from timing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

import graphddp
from graphddp.runtime import unused

CAPS = {"bucket_cap_mb": 1, "first_bucket_cap_mb": 1, "last_bucket_cap_mb": 1, "bucket_ramps": False}


def chained_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: PyTorch checks the annotations
    """A user's hook that chains a callback: the Reducer counts usage only after the end of backward's waits."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(state, bucket).then(lambda fut: fut.value())


def record_usage_waits(rank: int, world: int, find_unused: bool, hook: bool = False) -> list[tuple[str, int]]:
    """Per step: how many usage counts were waited for when its backward returned, and when its next forward did."""
    waits = 0
    original = unused.UsageCount.wait

    def counted(self: Any) -> list[int]:
        nonlocal waits
        waits += 1
        return original(self)

    unused.UsageCount.wait = counted  # type: ignore[method-assign]  # the pool keeps this process: restored below
    try:
        torch.manual_seed(0)
        ddp = graphddp.DDP(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), find_unused_parameters=find_unused, **CAPS)
        if hook:
            ddp.register_comm_hook(None, chained_allreduce)
        x = torch.randn(4, 8) + rank
        seen = []
        for _ in range(4):
            out = ddp(x)
            seen.append(("forward", waits))
            out.sum().backward()
            seen.append(("backward", waits))
        return seen
    finally:
        unused.UsageCount.wait = original  # type: ignore[method-assign]


def test_the_backward_leaves_the_usage_count_to_the_next_forward() -> None:
    for rank, seen in enumerate(run_on_ranks(record_usage_waits, 2, False)):
        # step k's count is issued after its last bucket and read by forward k + 1: never by a backward
        assert seen == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1),
                        ("forward", 2), ("backward", 2), ("forward", 3), ("backward", 3)], f"rank {rank}: {seen}"  # fmt: skip


@pytest.mark.parametrize(
    "find_unused, hook",
    [(True, False), (False, True)],
    ids=["find_unused_parameters: the counts decide which .grad nobody produced", "a hook's chained collectives: the count goes after the waits"],
)
def test_the_backward_reads_the_count_where_it_needs_it(find_unused: bool, hook: bool) -> None:
    for rank, seen in enumerate(run_on_ranks(record_usage_waits, 2, find_unused, hook)):
        assert [n for what, n in seen if what == "backward"] == [1, 2, 3, 4], f"rank {rank}: {seen}"


def count_buffer_walks(rank: int, world: int, with_norm: bool) -> tuple[int, int]:
    """(``named_buffers`` calls over three forwards after the first, buffer broadcasts over them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8) if with_norm else nn.Tanh(), nn.Linear(8, 2))
    ddp = graphddp.DDP(model, **CAPS)
    x = torch.randn(4, 8) + rank
    ddp(x).sum().backward()
    walks = broadcasts = 0
    original_walk, original_broadcast = model.named_buffers, ddp._broadcast_buffers

    def walk(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal walks
        walks += 1
        return original_walk(*args, **kwargs)

    def broadcast(src: int) -> None:
        nonlocal broadcasts
        broadcasts += 1
        original_broadcast(src)

    model.named_buffers, ddp._broadcast_buffers = walk, broadcast  # type: ignore[method-assign]
    for _ in range(3):
        ddp(x).sum().backward()
    return walks, broadcasts


@pytest.mark.parametrize("with_norm", [False, True], ids=["no buffers", "batch norm"])
def test_buffers_are_looked_up_only_where_there_are_some(with_norm: bool) -> None:
    for rank, (walks, broadcasts) in enumerate(run_on_ranks(count_buffer_walks, 2, with_norm)):
        if with_norm:
            # which tensors: looked up at each broadcast, so a buffer replaced after wrapping is the one sent
            assert broadcasts == 3 and walks == 3, f"rank {rank}: one lookup per broadcast, got {walks} for {broadcasts}"
        else:
            assert (walks, broadcasts) == (0, 0), f"rank {rank}: a module without buffers was walked {walks} times"
