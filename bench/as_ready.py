"""``bound-ready``: the floor under a DDP that sends each bucket as its gradients become ready (``bench.overhead``).

``bound-backward`` sends every byte at the backward's first instant: no DDP sends earlier, but none sends all of it
then either, since a bucket can leave only once its last gradient exists. ``AsReady`` sends as a DDP does and
costs nothing else: a hook per parameter counts its bucket down after the gradient is accumulated, and a bucket
that reaches zero is all-reduced at once, in bucket order, from a buffer of its size made beforehand. No copy into
the bucket or out of it, no division, no collective of its own, no check; the all-reduces are waited for at the end
of the backward (an engine callback), before the optimizer, as in a DDP. What it adds over the step without DDP is
what sending those bytes, in those buckets, as the backward makes them, costs on the machine. The difference
between a DDP and this floor is the DDP's own cost; the difference between two layouts of this floor is what the
layouts cost.

Two layouts, both cut over the order in which the gradients became ready in a first backward (the order both
DDPs rebuild their buckets in after their first iteration):

* ``graphddp``: graphddp's plan at the caps (``plan_buckets``, ramps off, as ``bench.overhead`` runs graphddp);
* ``torch``: PyTorch's (``bench.modes.torch_buckets``, PyTorch's own function; PyTorch's DDP built with the cap,
  as ``bench.overhead`` builds it, makes that the first bucket's cap too).

``BareDDP`` is the same with the data path of a DDP added and nothing else: when a bucket is complete its gradients
are copied into its buffer (one ``_foreach_copy_``) and scaled by ``1 / world size`` (one ``mul_``), and after the
wait the averages are copied back into ``.grad`` (one ``_foreach_copy_`` per bucket): graphddp's lean bucket path
(Note [Lean bucket path] in ``graphddp.runtime.reductions``) without a line of graphddp's bookkeeping (no plan
agreement, no usage, no checks, no ordering rules beyond bucket order). It averages correctly, so it is a DDP,
for a static graph with every parameter used: a reference for what graphddp's bookkeeping costs. Not a floor: its
hook per gradient is a Python call where graphddp's steady hooks count in C (Note [Counting without a frame]), and
PyTorch's C++ Reducer copies each gradient as it arrives, scaling while copying.

Since session 32 the two coincide (ramps off, graphddp closes a bucket once it holds its cap or more, as PyTorch
does: ``BucketCaps.closes_over_cap``); before, graphddp kept every bucket within its cap and cut 13 buckets of the
bench GPT where PyTorch cut 10. Both are still measured: each from its own DDP's rules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphddp.passes import BucketCaps

from .modes import graphddp_buckets, torch_buckets

LAYOUTS = ("graphddp", "torch")


def ready_order(model: nn.Module, one_backward: Callable[[], None]) -> list[nn.Parameter]:
    """The trainable parameters of ``model`` in the order ``one_backward`` accumulates their gradients."""
    order: list[nn.Parameter] = []
    params = [p for p in model.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(order.append) for p in params]
    try:
        one_backward()
    finally:
        for h in handles:
            h.remove()
    seen = {id(p) for p in order}
    return order + [p for p in params if id(p) not in seen]  # unused ones last, as both DDPs place them


def bucket_layout(model: nn.Module, order: Sequence[nn.Parameter], layout: str, cap_mb: float) -> list[list[nn.Parameter]]:
    """``order`` cut into buckets as ``layout`` cuts it, bucket 0 first ready."""
    if layout == "graphddp":
        names = {id(p): n for n, p in model.named_parameters()}
        return graphddp_buckets([(names[id(p)], p) for p in order], BucketCaps.from_mb(cap_mb, cap_mb, cap_mb, ramps=False))
    if layout == "torch":
        return [[order[i] for i in bucket] for bucket in torch_buckets(order, cap_mb)]
    raise ValueError(f"a bucket layout is one of {', '.join(LAYOUTS)}, got {layout!r}")


class AsReady:
    """All-reduces of ``buckets``' sizes, each issued once its parameters' gradients are all accumulated, in bucket
    order; ``step`` runs a step with them, waited for at the end of its backward."""

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], device: torch.device | str | None = None) -> None:
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=device) for b in buckets]
        self.sizes = [len(b) for b in buckets]
        self._left: list[int] = []
        self._ready: list[bool] = []
        self._works: list[Any] = []
        self._queued = False
        self.waited = False
        """The last step's backward waited for every all-reduce before it returned."""
        for k, bucket in enumerate(buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, k))

    def _send(self, k: int) -> Any:
        """Bucket ``k``'s all-reduce, issued."""
        return dist.all_reduce(self.buffers[k], async_op=True)

    def _received(self, k: int) -> None:
        """Bucket ``k``'s all-reduce is done."""

    def _accumulated(self, k: int, _param: nn.Parameter) -> None:
        if not self._queued:  # the backward's first gradient: wait at its end, as a DDP does
            torch.autograd.Variable._execution_engine.queue_callback(self._wait_all)
            self._queued = True
        self._left[k] -= 1
        if self._left[k]:
            return
        self._ready[k] = True
        while len(self._works) < len(self.buffers) and self._ready[len(self._works)]:  # launch in bucket order
            self._works.append(self._send(len(self._works)))

    def _wait_all(self) -> None:
        """End of backward: every bucket's all-reduce is done before ``backward()`` returns (the optimizer needs the
        averages), as in a DDP."""
        assert len(self._works) == len(self.buffers), f"{len(self._works)} of {len(self.buffers)} buckets became ready"
        for k, work in enumerate(self._works):
            work.wait()
            self._received(k)
        self.waited = True

    def step(self, step: Callable[..., int | None], count: Any = None) -> int | None:
        """``step(count)`` with every bucket sent as it becomes ready and waited for at the end of its backward."""
        self._left, self._ready, self._works = list(self.sizes), [False] * len(self.sizes), []
        self._queued = self.waited = False
        calls = step(count)
        assert self.waited, "the backward ended without waiting for its all-reduces"
        return calls


class BareDDP(AsReady):
    """``AsReady`` with a DDP's data path: a bucket's gradients copied in and scaled by ``1 / world size`` before it
    is sent, the averages copied back into ``.grad`` after its wait; nothing else (the module's docstring)."""

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], device: torch.device | str | None = None) -> None:
        super().__init__(buckets, device)
        self.params = [list(b) for b in buckets]
        self.views = [  # per bucket, per parameter: its slice of the buffer, shaped like it
            [v.view(p.shape) for v, p in zip(torch.split(buffer, [p.numel() for p in b]), b)] for buffer, b in zip(self.buffers, buckets)
        ]
        self.scale = 1.0 / dist.get_world_size()

    def _send(self, k: int) -> Any:
        torch._foreach_copy_(self.views[k], [p.grad for p in self.params[k]])
        self.buffers[k].mul_(self.scale)
        return super()._send(k)

    def _received(self, k: int) -> None:
        torch._foreach_copy_([p.grad for p in self.params[k]], self.views[k])
