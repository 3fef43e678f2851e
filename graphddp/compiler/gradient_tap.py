"""Taps: how a part of a tied weight's gradient reaches its own bucket (Note [Row-sparse gradients] in
``passes/row_sparse.py``).

``tap_parts`` puts a ``GradientTap`` between the weight and a segment of the stitched graph that uses it. Forward,
the tap is the identity (a view of the weight). Backward, it receives that segment's contribution to the weight's
gradient and offers it to the Reducer: taken, the contribution goes into the part's slot and the tap passes
nothing on to ``.grad``; declined, it passes the contribution on, and autograd adds it to ``.grad`` with the
weight's other contributions, as if there were no tap. The Reducer declines outside a synchronised backward
(``no_sync``), when the plan running now has no such slot, or when the slot is filled already; the tap itself
declines when this backward will not accumulate into the weight at all (``torch.autograd.grad``, or
``backward(inputs=...)`` without it): those gradients are the caller's, whole, and no bucket may move.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..runtime.iteration import compiled_autograd_running
from .compile_target import PartSink


class GradientTap(nn.Module):
    """Identity forward; backward hands the gradient to ``sink.take_part(key, grad)`` (the Reducer's compile
    target, ``graphddp.runtime.target.ReducerTarget``)."""

    def __init__(self, sink: PartSink | None, param: str, part: str) -> None:
        super().__init__()
        self._sink = weakref.ref(sink) if sink is not None else None
        self.key = (param, part)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _Tap.apply(weight, self)

    def take(self, grad: torch.Tensor) -> bool:
        sink = self._sink() if self._sink is not None else None
        return sink is not None and sink.take_part(self.key, grad)

    def extra_repr(self) -> str:
        return f"{self.key[0]}@{self.key[1]}"


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tap: GradientTap) -> torch.Tensor:
        ctx.tap = tap
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        accumulator = ctx.next_functions[0][0]  # the weight's AccumulateGrad (None if it needs no gradient)
        if accumulator is not None and _accumulates(accumulator) and ctx.tap.take(grad):
            # Compiled autograd traced this backward as returning a tensor and sums the weight's contributions in
            # its graph (a None there is a TypeError in its add): zeros; eager autograd skips a None, at no cost.
            return (torch.zeros_like(grad) if compiled_autograd_running() else None), None
        return grad, None


def _accumulates(node: Any) -> bool:
    """Will the running backward execute ``node`` (accumulate into the weight's ``.grad``)?"""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch.autograd.grad() with the weight among its inputs: nothing is accumulated
        return False
