"""How ``param.grad`` relates to its bucket slice: small policies, chosen per parameter when a plan is installed
(``buckets.BucketSlots``): copied or a view for dense gradients, the tensor itself for sparse ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .buckets import SparseGradBucket


@torch.no_grad()  # a gradient with a graph of its own (backward(create_graph=True)) is reduced as data, as in PyTorch
def fill(view: torch.Tensor, grad: torch.Tensor | None, scale: float | None = None) -> None:
    """``view = grad * scale`` (zeros where there is no gradient); scaled while copying: one pass, not two."""
    if grad is None:
        view.zero_()
    elif scale is None:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)


class CopiedGrads:
    """``param.grad`` is its own tensor: copied into the bucket when ready, the average copied back after."""

    @torch.no_grad()
    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        fill(view, param.grad, scale)  # unused here: zeros

    @torch.no_grad()
    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        """``view``, plus the reduced ``parts`` of a tied weight's gradient, into ``param.grad``: one pass."""
        if param.grad is None:
            param.grad = torch.empty_like(param, memory_format=torch.preserve_format)
        if parts:
            torch.add(view, parts[0], out=param.grad)
            for part in parts[1:]:
                param.grad.add_(part)
        else:
            param.grad.copy_(view)

    @torch.no_grad()
    def move(self, param: torch.Tensor, new_view: torch.Tensor) -> None:
        """Buckets were re-planned; nothing points into the old buffers."""


class BucketViewGrads:
    """``gradient_as_bucket_view=True``: ``param.grad`` *is* the bucket slice, so no gradient-sized copy lives
    next to the bucket. After ``zero_grad(set_to_none=True)`` autograd hands us a fresh tensor once; it is
    copied into the slice and ``param.grad`` re-pointed, and later accumulation happens in place."""

    @torch.no_grad()
    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            fill(view, grad, scale)
            param.grad = view
        elif scale is not None:
            view.mul_(scale)

    @torch.no_grad()
    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        for part in parts:  # .grad is the view: the parts go into the bucket slice itself
            view.add_(part)
        if param.grad is None:  # unused on this rank, used on another: the average is its gradient
            param.grad = view

    @torch.no_grad()
    def move(self, param: torch.Tensor, new_view: torch.Tensor) -> None:
        """Buckets were re-planned: keep the gradient's value, now in its new slice."""
        if param.grad is not None:
            new_view.copy_(param.grad)
            param.grad = new_view


class SparseGrads:
    """A ``torch.sparse`` gradient (``nn.Embedding(sparse=True)``): its bucket (``buckets.SparseGradBucket``)
    holds the gradient tensor itself, and the reduced tensor becomes ``param.grad``. Whatever
    ``gradient_as_bucket_view`` says: a sparse tensor is no slice of anything (PyTorch does the same)."""

    def __init__(self, bucket: SparseGradBucket) -> None:
        self.bucket = bucket

    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        self.bucket.put(param.grad, scale)

    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        assert not parts, "a sparse gradient has no parts"
        param.grad = self.bucket.buffer

    def move(self, param: torch.Tensor, new_view: torch.Tensor) -> None:
        """Buckets were re-planned: the gradient is its own tensor, nothing to move."""
