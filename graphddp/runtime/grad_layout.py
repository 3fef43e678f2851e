"""How ``param.grad`` relates to its bucket slice: small policies, chosen per parameter when a plan is installed
(``buckets.BucketSlots``): copied or a view for dense gradients, reduced where it lies when it is a bucket's only
one, the tensor itself for sparse ones.

The Reducer moves a bucket's gradients in one call when the bucket is complete (``to_bucket_many``) and back in one
call per awaited bucket (``from_bucket_many``): on a GPU, one multi-tensor kernel and one Python call per bucket
instead of one per parameter, which a backward that launches kernels faster than the GPU runs them cannot hide.

Note [A lone gradient reduced where it lies]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bucket that holds one whole gradient (a parameter larger than the cap, most often: an embedding table, a large
layer's weight) gains nothing from a flat buffer: copying the gradient in and the average back out is two passes
over the largest tensors of the model, for a buffer that is the gradient's own shape. So, under graphddp's
averaging with copied gradients (``gradient_as_bucket_view=False``, the default), such a bucket's gradient is
scaled by ``1/world`` in place (not at all where the backend averages: Note [Averaged on the wire] in
``graphddp.runtime.reductions``) and all-reduced in place (``GradInPlace``): ``.grad`` is the same tensor before and
after, holding the average, as with the copy; ``FlatBucket.reduced`` tells the launcher which tensor goes out.
PyTorch's Reducer copies here too. With GPT-2's vocabulary the tied table is 70 % of the gradient bytes, and
reducing it in place took graphddp-eager from 1.06 to 0.71 × what PyTorch's DDP adds to a two-rank step
(``docs/benchmarks.md``, session 26).

The gradient is reduced where it lies only when the result is what the copy gives:

* this rank produced it (``GradientUsage.used``): its average is written into ``.grad`` in any case. A gradient the
  rank did not produce (a parameter found unused, a gradient missing at the end of backward) may be a stale
  ``.grad`` that must stay as it was: it is copied;
* it is a plain tensor of its own (not a view of another, not part of a graph: ``backward(create_graph=True)``),
  contiguous, in the bucket's dtype and on its device;
* no other post-accumulate-grad hook is on the parameter (``only_our_hook``): one of the user's, registered after
  the DDP's, runs after graphddp's and would read ``.grad`` while the collective writes it; under PyTorch's DDP
  it sees the local gradient, so it does here, from a copied bucket;
* the bucket is reduced by graphddp's averaging all-reduce, which reduces whatever tensor it is given: a comm hook
  gets a bucket buffer, as PyTorch hands it (``with_comm_hook``), and a table reduced as rows keeps its buffer.
  A bucket that ``skip_all_reduce_unused_params`` launched without a collective and some rank used after all is
  all-reduced late from the same tensor (``graphddp.runtime.skipping``).

Such a bucket's flat buffer is allocated only when first asked for (``FlatBucket.buffer``): while its gradient is
always reduced where it lies, it never is, so the bucket holds no second copy of the gradient (PyTorch's Reducer
keeps one for every parameter unless ``gradient_as_bucket_view=True``); at GPT-2's vocabulary that is the tied
table's 25.7 MB at the bench's width, 154 MB at GPT-2-small's.

Else the bucket takes the copy, as every other bucket. The end of backward drops the iteration's references to the
gradient (``FlatBucket.release``), so ``zero_grad(set_to_none=True)`` frees it as before. Two differences remain,
both outside a backward that completes: from the moment its bucket is complete (the first gradients of a
backward; for a parameter found unused, its forward) until the end of backward, ``.grad`` holds the scaled and
then the summed gradient, not the local one. So a backward abandoned after that (Note [Abandoned backward] in
``graphddp.runtime.iteration``) leaves that ``.grad`` scaled or averaged, and its collective may still be writing
it until the next forward drains it: after an abandoned backward, drop the gradients
(``zero_grad(set_to_none=True)``, the optimizers' default) rather than zeroing them in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from .buckets import FlatBucket, SparseGradBucket


F = TypeVar("F", bound=Callable[..., None])


def as_data(fn: F) -> F:
    """Run ``fn`` with gradients disabled: a gradient with a graph of its own (``backward(create_graph=True)``) is
    reduced as data, as in PyTorch. Backward usually runs with them disabled already; then this costs one check
    instead of entering ``torch.no_grad()``, which matters in a hook that runs once per parameter per step."""

    @functools.wraps(fn)
    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


@as_data
def fill(view: torch.Tensor, grad: torch.Tensor | None, scale: float | None = None) -> None:
    """``view = grad * scale`` (zeros where there is no gradient); scaled while copying: one pass, not two."""
    if grad is None:
        view.zero_()
    elif scale is None:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)


def copied_in(bucket: FlatBucket, scale: float | None) -> bool:
    """A plain bucket's gradients into its buffer with one ``_foreach_copy_``, scaled with one ``mul_`` of the buffer
    (equal dtypes: the rounding of ``torch.mul(grad, scale, out=view)``); False, with nothing copied, where some
    parameter has no gradient (the caller's per-parameter path fills zeros)."""
    try:
        torch._foreach_copy_(bucket.views, [p.grad for p in bucket.params])
    except TypeError:  # a None among the gradients, found before anything was copied
        return False
    if scale is not None:
        bucket.buffer.mul_(scale)
    return True


class PerParameter:
    """``to_bucket_many`` / ``from_bucket_many`` as one ``to_bucket`` / ``from_bucket`` per parameter; a plain
    bucket's (``FlatBucket.plain``) ``gather`` / ``scatter`` through them."""

    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        """A plain bucket's gradients, scaled, into its buffer."""
        self.to_bucket_many(bucket.params, bucket.views, scale)

    def scatter(self, bucket: FlatBucket) -> None:
        """A plain bucket's reduced gradients into every parameter's ``.grad``."""
        self.from_bucket_many(bucket.params, bucket.views, [()] * len(bucket.params))

    def to_bucket_many(self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], scale: float | None = None) -> None:
        for param, view in zip(params, views):
            self.to_bucket(param, view, scale)  # type: ignore[attr-defined]

    def from_bucket_many(
        self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], parts: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        for param, view, its_parts in zip(params, views, parts):
            self.from_bucket(param, view, its_parts)  # type: ignore[attr-defined]

    def of_lone_gradient(self, used: Sequence[bool]) -> PerParameter:
        """The layout of a bucket that holds one whole gradient: this one, except where ``CopiedGrads`` says
        (Note [A lone gradient reduced where it lies])."""
        return self


class CopiedGrads(PerParameter):
    """``param.grad`` is its own tensor: copied into the bucket when ready, the average copied back after."""

    @as_data
    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        """One ``_foreach_copy_`` and one ``mul_`` of the buffer (Note [Lean bucket path]); a parameter without a
        gradient (unused here: zeros) takes the per-parameter path."""
        if not copied_in(bucket, scale):
            self.to_bucket_many(bucket.params, bucket.views, scale)

    @as_data
    def scatter(self, bucket: FlatBucket) -> None:
        try:
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
        except TypeError:  # a parameter without .grad: the per-parameter path makes one
            super().scatter(bucket)

    @as_data
    def to_bucket_many(self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], scale: float | None = None) -> None:
        """One ``_foreach_copy_`` (and ``_foreach_mul_``) for the gradients of the bucket's dtype; a gradient of
        another dtype (``mixed_precision``) is scaled before its cast, as ``fill`` does, so the result is the same."""
        same, other = [], []
        for param, view in zip(params, views):
            grad = param.grad
            (same if grad is not None and grad.dtype == view.dtype else other).append((param, view))
        if same:
            targets = [view for _, view in same]
            torch._foreach_copy_(targets, [param.grad for param, _ in same])
            if scale is not None:
                torch._foreach_mul_(targets, scale)  # the same rounding as torch.mul(grad, scale, out=view)
        for param, view in other:
            fill(view, param.grad, scale)  # unused here: zeros

    @as_data
    def from_bucket_many(
        self, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor], parts: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        plain = [(p, v) for p, v, its_parts in zip(params, views, parts) if not its_parts and p.grad is not None]
        if plain:
            torch._foreach_copy_([p.grad for p, _ in plain], [v for _, v in plain])
        for param, view, its_parts in zip(params, views, parts):
            if its_parts or param.grad is None:
                self.from_bucket(param, view, its_parts)

    @as_data
    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        fill(view, param.grad, scale)  # unused here: zeros

    @as_data
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

    @as_data
    def move(self, param: torch.Tensor, new_view: Callable[[], torch.Tensor]) -> None:
        """Buckets were re-planned; nothing points into the old buffers (``new_view`` is not asked for: asking
        allocates the new bucket's buffer)."""

    def with_comm_hook(self) -> CopiedGrads:
        """The layout once a comm hook is registered (it reduces whatever is in the bucket)."""
        return HookedGrads()

    def of_lone_gradient(self, used: Sequence[bool]) -> CopiedGrads:
        """The layout of a bucket that holds one whole gradient (Note [A lone gradient reduced where it lies])."""
        return GradInPlace(used)


class HookedGrads(CopiedGrads):
    """``CopiedGrads`` under a comm hook: a bucket of one gradient is copied too (the hook gets a bucket buffer)."""

    def of_lone_gradient(self, used: Sequence[bool]) -> CopiedGrads:
        return self


class GradInPlace(CopiedGrads):
    """A bucket's only gradient scaled and reduced in ``.grad`` itself where it may be, else copied (Note [A lone
    gradient reduced where it lies])."""

    def __init__(self, used: Sequence[bool]) -> None:
        self._used = used  # GradientUsage.used: read when the bucket is complete, not copied

    @as_data
    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        param = bucket.params[0]
        grad = param.grad
        if (
            self._used[bucket.param_indices[0]]
            and grad is not None
            and reducible_in_place(grad, bucket)
            and only_our_hook(param)
        ):
            if scale is not None:
                grad.mul_(scale)
            bucket.reduce_in_place(grad)
        else:
            bucket.reduce_in_place(None)
            super().gather(bucket, scale)

    @as_data
    def scatter(self, bucket: FlatBucket) -> None:
        if not bucket.reduced_in_place:
            super().scatter(bucket)  # copied in: copied back


def only_our_hook(param: torch.Tensor) -> bool:
    """Has ``param`` no post-accumulate-grad hook but graphddp's (``graphddp.runtime.countdown``, one per
    parameter)? torch keeps them in ``Tensor._post_accumulate_grad_hooks`` (None until the first)."""
    hooks = param._post_accumulate_grad_hooks
    return hooks is None or len(hooks) <= 1


def reducible_in_place(grad: torch.Tensor, bucket: FlatBucket) -> bool:
    """Can ``grad`` itself stand for the buffer of ``bucket``, the buffer left unallocated (Note [A lone gradient
    reduced where it lies])?"""
    return (
        type(grad) is torch.Tensor
        and grad.layout == torch.strided
        and grad.dtype == bucket.dtype
        and grad.device == bucket.device
        and grad.numel() == bucket.numel
        and not grad.requires_grad
        and not grad._is_view()
        and grad.is_contiguous()
    )


class LocalGrads(CopiedGrads):
    """One rank and graphddp's averaging (``reductions.local_average``): the average of a gradient is itself, so a
    plain bucket's gradients stay in ``.grad`` and its buffer is never used; a bucket of another dtype
    (``mixed_precision``'s ``reduce_dtype``) still rounds its gradients through that dtype, as PyTorch's does."""

    to_bucket_many = PerParameter.to_bucket_many  # each: a copy only into a bucket of another dtype
    from_bucket_many = PerParameter.from_bucket_many
    of_lone_gradient = PerParameter.of_lone_gradient  # nothing is copied: nothing to save

    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        assert scale is None, "one rank: nothing to scale by"

    def scatter(self, bucket: FlatBucket) -> None:
        pass

    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        if view.dtype != param.dtype:
            super().to_bucket(param, view, scale)

    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        assert not parts, "one rank plans no parts"
        if view.dtype != param.dtype:
            super().from_bucket(param, view, parts)


class BucketViewGrads(PerParameter):
    """``gradient_as_bucket_view=True``: ``param.grad`` *is* the bucket slice, so no gradient-sized copy lives
    next to the bucket. After ``zero_grad(set_to_none=True)`` autograd hands us a fresh tensor once; it is
    copied into the slice and ``param.grad`` re-pointed, and later accumulation happens in place."""

    @as_data
    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        """A plain bucket in one ``_foreach_copy_`` and one ``mul_`` of the buffer, then every ``.grad`` re-pointed
        at its slice (an attribute set: no Python call per parameter). After ``zero_grad(set_to_none=True)``, the
        optimizers' default, autograd hands over fresh tensors every step; a gradient that is its slice already
        (accumulated in place) is copied onto itself, and the ``mul_`` scales both alike, as ``to_bucket`` does. A
        parameter without a gradient (unused here: zeros) takes the per-parameter path."""
        if not copied_in(bucket, scale):
            super().gather(bucket, scale)
            return
        for param, view in zip(bucket.params, bucket.views):
            param.grad = view

    @as_data
    def scatter(self, bucket: FlatBucket) -> None:
        """A plain bucket's averages are its slices, which every ``.grad`` that ``gather`` re-pointed is already; a
        parameter without a gradient here (used on another rank) gets its slice, as ``from_bucket`` gives it."""
        for param, view in zip(bucket.params, bucket.views):
            if param.grad is None:
                param.grad = view

    @as_data
    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            fill(view, grad, scale)
            param.grad = view
        elif scale is not None:
            view.mul_(scale)

    @as_data
    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        for part in parts:  # .grad is the view: the parts go into the bucket slice itself
            view.add_(part)
        if param.grad is None:  # unused on this rank, used on another: the average is its gradient
            param.grad = view

    @as_data
    def move(self, param: torch.Tensor, new_view: Callable[[], torch.Tensor]) -> None:
        """Buckets were re-planned: keep the gradient's value, now in its new slice."""
        if param.grad is not None:
            view = new_view()
            view.copy_(param.grad)
            param.grad = view

    def with_comm_hook(self) -> BucketViewGrads:
        return self


class SparseGrads(PerParameter):
    """A ``torch.sparse`` gradient (``nn.Embedding(sparse=True)``): its bucket (``buckets.SparseGradBucket``)
    holds the gradient tensor itself, and the reduced tensor becomes ``param.grad``. Whatever
    ``gradient_as_bucket_view`` says: a sparse tensor is no slice of anything (PyTorch does the same)."""

    def __init__(self, bucket: SparseGradBucket) -> None:
        self.bucket = bucket

    def to_bucket(self, param: torch.Tensor, view: torch.Tensor, scale: float | None = None) -> None:
        self.bucket.put(param.grad, scale)

    def from_bucket(self, param: torch.Tensor, view: torch.Tensor, parts: Sequence[torch.Tensor] = ()) -> None:
        assert not parts, "a sparse gradient has no parts"
        param.grad = self.bucket.buffer.to(param.dtype)  # from mixed_precision's reduce_dtype, if it is another

    def move(self, param: torch.Tensor, new_view: Callable[[], torch.Tensor]) -> None:
        """Buckets were re-planned: the gradient is its own tensor, nothing to move."""


def dense_layout(*, as_bucket_view: bool, local: bool) -> CopiedGrads | BucketViewGrads:
    """How a dense ``.grad`` relates to its bucket: a view with ``gradient_as_bucket_view``; left where autograd put
    it where the reduction is the identity (``local``: one rank and graphddp's averaging, ``LocalReduction``); else
    copied in and out."""
    if as_bucket_view:
        return BucketViewGrads()
    return LocalGrads() if local else CopiedGrads()
