"""A bucket's only gradient reduced where it lies (Note [A lone gradient reduced where it lies] in
``graphddp.runtime.grad_layout``), on spawned gloo ranks: in ``.grad`` itself where the result is what the copy
gives, copied where it would not be (a stale gradient of a parameter unused here, a comm hook, a gradient with a
graph), and the same gradients as PyTorch's DDP either way."""

from __future__ import annotations

import time

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

import graphddp

CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.002}
"""2 KiB buckets: ``Two``'s 4 KiB weights are each alone in a bucket, its head's weight and bias share one."""


class Two(nn.Module):
    """Two 4 KiB weights and a small head; ``side`` only where the forward is asked to use it."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.side, self.head = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        out = self.main(x)
        return self.head(out + self.side(x) if use_side else out)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def wrapped(impl: str, **kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    if impl == "none":
        return Two()
    if impl == "torch":
        return nn.parallel.DistributedDataParallel(Two(), bucket_cap_mb=0.002, **kwargs)
    return graphddp.DDP(Two(), **CAPS, **kwargs)


def hand_averaged(rank: int, world: int, step: int, use_side: bool = True) -> list[torch.Tensor]:
    """The reference: each rank's local gradients of ``step`` on the same weights, all-reduced and divided by hand
    (zeros where a rank did not use a parameter)."""
    local = wrapped("none")
    local(batch(rank, step), use_side=use_side).square().mean().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in local.parameters()]
    for grad in grads:
        torch.distributed.all_reduce(grad)
    return [grad / world for grad in grads]


def reduced_in_grad_itself(bucket: object) -> bool:
    """Was ``bucket``'s gradient reduced in ``.grad`` itself this step? Then its buffer was never needed, so never
    allocated since the plan was made (no second copy of the gradient), and ``.grad`` holds the average."""
    return not bucket.allocated and bool(bucket.params[0].grad.ne(0).any())


def lone_buckets(ddp: graphddp.DDP) -> list[tuple[int, bool]]:
    """Each bucket of one whole gradient: (its index, whether its gradient was reduced in ``.grad`` itself)."""
    return [(b.index, reduced_in_grad_itself(b)) for b in ddp.reducer.buckets if len(b.params) == 1]


def reduced_in_grad(rank: int, world: int) -> dict[str, object]:
    """Three steps (the second on the rebuilt plan), gradients set to None between them as optimizers do; then a
    backward with ``create_graph=True``, whose gradients have a graph of their own."""
    grads: dict[str, list[list[torch.Tensor]]] = {}
    seen: dict[str, object] = {}
    for impl in ("graphddp", "torch"):
        ddp = wrapped(impl)
        grads[impl] = []
        for step in range(3):
            ddp(batch(rank, step)).square().mean().backward()
            grads[impl].append([p.grad.clone() for p in ddp.parameters()])
            if impl == "graphddp":
                seen[f"step {step}"] = lone_buckets(ddp)
                seen[f"shared {step}"] = [bool(b.buffer.ne(0).any()) for b in ddp.reducer.buckets if len(b.params) > 1]
            ddp.zero_grad(set_to_none=True)
        if impl == "graphddp":  # PyTorch's DDP raises under create_graph on gloo (tests/spawned/test_create_graph.py)
            ddp(batch(rank, 3)).square().mean().backward(create_graph=True)
            seen["create_graph"] = lone_buckets(ddp)
            ours_with_graph = [p.grad.detach().clone() for p in ddp.parameters()]
    for ours, theirs in zip(grads["graphddp"], grads["torch"]):
        torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_with_graph, hand_averaged(rank, world, 3))
    return seen


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: slow suite (time)
def test_a_lone_gradient_is_reduced_in_grad_itself_with_pytorchs_result(world: int) -> None:
    for seen in run_on_ranks(reduced_in_grad, world):
        for step in range(3):
            assert len(seen[f"step {step}"]) >= 2, seen  # the two weights, and biases alone between them
            assert all(in_place for _, in_place in seen[f"step {step}"]), seen
            assert seen[f"shared {step}"] and all(seen[f"shared {step}"]), seen  # the head's bucket: its buffer
        assert not any(in_place for _, in_place in seen["create_graph"]), seen  # a gradient with a graph: copied


def stale_unused(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """``side`` is used in step 0 and by no rank in step 1; gradients are not zeroed between the steps, and each
    rank changes its stale ``side`` gradient its own way. A parameter no rank used keeps its ``.grad`` as it was
    (PyTorch's DDP does), so each rank's stays its own."""
    out = {}
    for impl in ("graphddp", "torch"):
        ddp = wrapped(impl, find_unused_parameters=True)
        ddp(batch(rank, 0)).square().mean().backward()
        side = ddp.module.side.weight
        side.grad.add_(rank + 1.0)  # this rank's own
        before = side.grad.clone()
        ddp(batch(rank, 1), use_side=False).square().mean().backward()
        out[impl] = [before, side.grad.clone()]
    return out


@pytest.mark.parametrize("world", [2])
def test_a_stale_gradient_of_a_parameter_no_rank_used_stays_as_it_was(world: int) -> None:
    for rank, out in enumerate(run_on_ranks(stale_unused, world)):
        before, after = out["graphddp"]
        torch.testing.assert_close(after, before, msg=f"rank {rank}: the stale gradient was reduced")
        torch.testing.assert_close(after, out["torch"][1])


def recording_hook(seen, bucket):  # type: ignore[no-untyped-def]  # PyTorch's DDP refuses string annotations
    """An averaging all-reduce that notes whether the buffer it got is some parameter's ``.grad``."""
    grads = {p.grad.data_ptr() for p in bucket.parameters() if p.grad is not None}
    seen.append(bucket.buffer().data_ptr() in grads)
    work = torch.distributed.all_reduce(bucket.buffer().div_(torch.distributed.get_world_size()), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def hooked(rank: int, world: int) -> dict[str, object]:
    grads = {}
    seen: list[bool] = []
    for impl in ("graphddp", "torch"):
        ddp = wrapped(impl)
        ddp.register_comm_hook(seen if impl == "graphddp" else [], recording_hook)
        for step in range(2):
            ddp(batch(rank, step)).square().mean().backward()
        grads[impl] = [p.grad for p in ddp.parameters()]
    torch.testing.assert_close(grads["graphddp"], grads["torch"])
    return {"hook got a .grad": seen}


def test_a_comm_hook_gets_a_bucket_buffer_never_a_grad() -> None:
    for result in run_on_ranks(hooked, 2):
        assert result["hook got a .grad"] and not any(result["hook got a .grad"]), result


def skipped_then_used(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """``skip_all_reduce_unused_params``: no rank uses ``side`` in steps 0 and 1, so its buckets launch without a
    collective; in step 2 rank 0 uses it, and every rank reduces its buckets late. Rank 0's lone ``side.weight``
    gradient went in place, so the late all-reduce must reduce it there (the reference: the local gradients,
    averaged by hand, zeros where a rank did not use it)."""
    ddp = wrapped("graphddp", skip_all_reduce_unused_params=True, find_unused_parameters=True)
    for step in range(3):
        ddp(batch(rank, step), use_side=step == 2 and rank == 0).square().mean().backward()
        if step < 2:
            ddp.zero_grad(set_to_none=True)
    return {"ours": [p.grad for p in ddp.parameters()], "expected": hand_averaged(rank, world, 2, use_side=rank == 0)}


def test_a_skipped_bucket_used_after_all_is_reduced_late_where_its_gradient_lies() -> None:
    for rank, out in enumerate(run_on_ranks(skipped_then_used, 2)):
        torch.testing.assert_close(out["ours"], out["expected"], msg=lambda m, rank=rank: f"rank {rank}: {m}")


def freed_and_hooked(rank: int, world: int) -> dict[str, object]:
    """The end of backward keeps no reference to a gradient reduced in place (``zero_grad(set_to_none=True)`` frees
    it); and a post-accumulate-grad hook of the user's, registered after the DDP's, sees the local gradient, as
    under PyTorch's DDP: that parameter's bucket is copied."""
    out: dict[str, object] = {}
    ddp = wrapped("graphddp")
    for step in range(3):
        ddp(batch(rank, step)).square().mean().backward()
        if step < 2:
            ddp.zero_grad(set_to_none=True)
    storage = ddp.module.main.weight.grad.untyped_storage()
    weak = storage._weak_ref()
    del storage
    ddp.zero_grad(set_to_none=True)
    deadline = time.monotonic() + 10  # gloo's worker may drop its reference to the finished collective's tensor
    while not (freed := torch.UntypedStorage._expired(weak)) and time.monotonic() < deadline:  # a moment later
        time.sleep(0.05)
    out["freed"] = freed
    torch.UntypedStorage._free_weak_ref(weak)
    seen = {}
    for impl in ("graphddp", "torch"):
        model = wrapped(impl)
        weight = model.module.main.weight
        weight.register_post_accumulate_grad_hook(lambda p, impl=impl: seen.__setitem__(impl, p.grad.clone()))
        model(batch(rank, 0)).square().mean().backward()
    torch.testing.assert_close(seen["graphddp"], seen["torch"])
    local = wrapped("none")
    local(batch(rank, 0)).square().mean().backward()
    torch.testing.assert_close(seen["graphddp"], local.main.weight.grad)  # local, not scaled by 1/world
    return out


def test_the_end_of_backward_lets_the_gradient_go_and_a_users_hook_sees_the_local_gradient() -> None:
    for result in run_on_ranks(freed_and_hooked, 2):
        assert result["freed"], "a gradient reduced in place is still held after zero_grad(set_to_none=True)"
