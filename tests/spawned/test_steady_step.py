"""What a synchronised step issues besides its buckets, and what it walks, on two gloo ranks: the plan agreement
carrying the usage count (Note [Plan agreement] in graphddp.runtime.plans), issued just before the last bucket's
and done when backward returns, inside that bucket's all-reduce where it can ride it (Note [The agreement rides
a bucket]: no collective of graphddp's own), as one small collective of its own where not; and no module walk for
buffers every forward where the module has none. Claims from recorded calls, never from timing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

import graphddp
from graphddp.runtime import launcher, plans, unused

CAPS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001, "last_bucket_cap_mb": 0.001, "bucket_ramps": False}


@contextlib.contextmanager
def patched(owner: Any, name: str, wrapper: Any) -> Iterator[None]:
    """``owner.name`` replaced by ``wrapper(original)`` (the pool keeps this process: restored after)."""
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def record_collectives(rank: int, world: int, find_unused: bool, hook: bool) -> list[list[str]]:
    """Per backward: graphddp's collectives in the order issued, then ``done`` if every usage count issued was
    waited for when ``backward()`` returned."""
    seen: list[str] = []
    waited = issued = 0

    def launch(original: Any) -> Any:
        def start(self: Any, bucket: Any, buffer: torch.Tensor) -> Any:
            in_flight = original(self, bucket, buffer)  # what it issues before the bucket's collective comes first
            seen.append(f"bucket {bucket.index}")
            return in_flight

        return start

    def agree(original: Any) -> Any:
        def start(self: Any, **kwargs: Any) -> Any:
            nonlocal issued
            own: list[Any] = []

            def all_reduce(*args: Any, **kw: Any) -> Any:  # the agreement's collective of its own, if any
                own.append(args)
                return real(*args, **kw)

            real = plans.dist.all_reduce
            with patched(plans.dist, "all_reduce", lambda _: all_reduce):
                agreement = original(self, **kwargs)
            seen.append("agreement" if own else "agreement riding")
            issued += bool(kwargs.get("carrying"))
            return agreement

        return start

    def wait(original: Any) -> Any:
        def counted(self: Any) -> list[int]:
            nonlocal waited
            waited += 1
            return original(self)

        return counted

    with patched(launcher.Launcher, "_launch", launch), patched(plans.PlanKeeper, "start_agreement", agree), patched(unused.UsageCount, "wait", wait):  # fmt: skip
        torch.manual_seed(0)
        # 4 KiB weights: three buckets (each closed by a weight), the last one layer's bias and weight
        model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
        ddp = graphddp.DDP(model, find_unused_parameters=find_unused, **CAPS)
        if hook:
            ddp.register_comm_hook(None, chained_allreduce)
        per_backward = []
        for _ in range(3):
            seen.clear()
            ddp(torch.randn(4, 32) + rank).sum().backward()
            per_backward.append([*seen, "done" if waited == issued else f"{issued - waited} usage counts in flight"])
        return per_backward


def chained_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: PyTorch checks the annotations
    """A user's hook that chains a callback: the Reducer issues its agreement only after the end of backward's waits."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(state, bucket).then(lambda fut: fut.value())


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused_parameters"])
def test_the_agreement_rides_the_last_bucket_with_no_collective_of_its_own(find_unused: bool) -> None:
    for rank, per_backward in enumerate(run_on_ranks(record_collectives, 2, find_unused, False)):
        for seen in per_backward:
            buckets = [s for s in seen if s.startswith("bucket")]
            assert len(buckets) >= 3, f"rank {rank}: {seen}"
            assert seen == [*buckets[:-1], "agreement riding", buckets[-1], "done"], f"rank {rank}: {seen}"


def test_a_hook_that_chains_collectives_gets_the_agreement_after_them() -> None:
    for rank, per_backward in enumerate(run_on_ranks(record_collectives, 2, False, True)):
        for seen in per_backward:
            assert seen[-2:] == ["agreement", "done"] and seen.count("agreement") == 1, f"rank {rank}: {seen}"


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
