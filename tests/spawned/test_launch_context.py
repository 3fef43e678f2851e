"""Nothing of an iteration is left in the process group after its backward, and what a comm hook keeps holds
nothing of the backward's (Note [A collective holds no Python object] in ``graphddp.runtime.launch_context``), on
spawned gloo ranks.

The backward's ``contextvars.Context`` (stashed in the thread-local state while the engine runs) is counted after
backward: each ``Work`` still alive that copied the thread-local state holds one reference more. A ``Work`` that
holds a Python object can abort the process at exit when a gloo thread destroys it last.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

import graphddp

CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.002}
"""2 KiB buckets: several buckets, a lone gradient among them (``GradInPlace``), so several launches."""


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def references_after_backward(model: nn.Module, rank: int, seen_during: list[bool]) -> int:
    """References to the backward's context once ``backward`` returned, beside this function's own."""
    captured: list[object] = []
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    # The input's gradient comes after every bucket but the first has been launched: is the context back by then?
    x.register_hook(lambda g: seen_during.append(torch._C._is_key_in_tls("context")))
    loss = model(x).square().mean()
    loss.register_hook(lambda g: captured.append(torch._C._get_obj_in_tls("context")))  # the first node to run
    loss.backward()
    assert len(captured) == 1, captured
    context = captured.pop()
    return sys.getrefcount(context) - 2  # the local name and getrefcount's argument


def keeping_hook(kept, bucket):  # type: ignore[no-untyped-def]  # PyTorch's DDP refuses string annotations
    """An averaging all-reduce that keeps every ``Work`` it issues (a hook may keep state across steps)."""
    work = torch.distributed.all_reduce(bucket.buffer().div_(torch.distributed.get_world_size()), async_op=True)
    kept.append(work)
    return work.get_future().then(lambda fut: fut.value()[0])


def hooked(rank: int, world: int) -> dict[str, object]:
    """A comm hook's collectives, kept past backward: they hold nothing of the backward's."""
    seen_during: list[bool] = []
    local = references_after_backward(net(), rank, seen_during)
    model = graphddp.DDP(net(), **CAPS)
    kept: list[object] = []
    model.register_comm_hook(kept, keeping_hook)
    ours = [references_after_backward(model, rank, seen_during) for _ in range(3)]
    return {"local": local, "graphddp": ours, "kept": len(kept), "seen_during": seen_during}


def test_a_comm_hooks_kept_collectives_hold_no_reference_to_the_backwards_python_context() -> None:
    for rank, out in enumerate(run_on_ranks(hooked, 2)):
        assert out["kept"] >= 9, out  # three steps of three buckets or more
        assert out["graphddp"] == [out["local"]] * 3, f"rank {rank}: a collective holds the backward's context: {out}"
        assert all(out["seen_during"]), f"rank {rank}: the context was not put back during backward: {out}"


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def counted(rank: int, world: int, static_graph: bool = False) -> dict[str, object]:
    seen_during: list[bool] = []
    local = references_after_backward(net(), rank, seen_during)
    model = graphddp.DDP(net(), **CAPS, static_graph=static_graph)
    warnings = Warnings()
    logging.getLogger("graphddp.runtime.launch_context").addHandler(warnings)
    ours, in_flight = [], []
    for _ in range(3):  # the rebuilt plan's steps too
        ours.append(references_after_backward(model, rank, seen_during))
        in_flight.append(model.reducer.plans.agreement_in_flight)
    logging.getLogger("graphddp.runtime.launch_context").removeHandler(warnings)
    return {
        "local": local, "graphddp": ours, "buckets": len(model.reducer.buckets), "seen_during": seen_during,
        "in_flight": in_flight, "warnings": warnings.messages,
    }  # fmt: skip


def test_graphddp_collectives_keep_no_reference_to_the_backwards_python_context() -> None:
    for rank, out in enumerate(run_on_ranks(counted, 2)):
        assert out["buckets"] >= 3, out  # several launches, the agreement's among them
        assert out["graphddp"] == [out["local"]] * 3, f"rank {rank}: a collective holds the backward's context: {out}"
        assert all(out["seen_during"]), f"rank {rank}: the context was not put back during backward: {out}"


@pytest.mark.parametrize("static_graph", [False, True])  # True: no usage count waits for it after iteration 0
def test_nothing_of_an_iteration_is_in_flight_after_its_backward(static_graph: bool) -> None:
    """The plan agreement (issued before the last bucket's all-reduce, read at the next forward) is waited and its
    ``Work`` dropped at the end of backward: a ``barrier`` issued next cannot keep it."""
    for rank, out in enumerate(run_on_ranks(counted, 2, static_graph)):
        assert out["in_flight"] == [False] * 3, f"rank {rank}: the agreement outlived its backward: {out}"
        # Each collective was dropped before waiting for its tensors (else the wait gives up, with a warning).
        assert out["warnings"] == [], f"rank {rank}: {out['warnings']}"


def joined(rank: int, world: int, static_graph: bool) -> dict[str, object]:
    """Rank 1 runs out of data first and shadows rank 0's last two backwards (Note [Join])."""
    model = graphddp.DDP(net(), **CAPS, static_graph=static_graph)
    seen: list[bool] = []
    with model.join():
        for step in range(4 if rank == 0 else 2):
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
            seen.append(model.reducer.plans.agreement_in_flight)
    seen.append(model.reducer.plans.agreement_in_flight)
    return {"seen": seen}


@pytest.mark.parametrize("static_graph", [False, True])
def test_a_joined_ranks_shadow_leaves_nothing_in_flight(static_graph: bool) -> None:
    for rank, out in enumerate(run_on_ranks(joined, 2, static_graph)):
        assert not any(out["seen"]), f"rank {rank}: an agreement outlived its backward or shadow: {out}"
