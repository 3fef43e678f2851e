"""A bucket's flat gradient buffer, its lifecycle, and the view of it that comm hooks get.

Lifecycle of one bucket in one iteration:

    reset() ──► mark_ready(slot) × len(params) ──► start(in_flight) ──► in_flight.wait() -> reduced buffer
      ▲                                                                                       │
      └──────────────────────────────────────── next iteration ◄─────────────────────────────┘

``mark_ready`` returns True when the last slot arrives; the launcher (``graphddp.runtime.launcher``) then *starts* the
bucket, but only when all buckets with a smaller index have started, so every rank launches collectives in the
same order. ``BucketSlots`` says where each parameter's gradient (and each part of one) lives in a plan's
buckets, and moves gradients between ``.grad`` and those slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.decorators import skip

from ..passes import Bucket, BucketPlan
from .grad_layout import SparseGrads, fill


class FlatBucket:
    """One bucket of the plan: a flat buffer holding its gradients and the per-parameter views into it."""

    buffer: torch.Tensor  # [spec.numel], made on first use (``__getattr__``)
    views: list[torch.Tensor]  # per parameter, its slice of ``buffer``
    carrier: torch.Tensor  # [spec.numel + room]: ``buffer`` and the agreement's room after it (if any)
    room = 0
    """Elements after the gradients for the plan agreement's entries (Note [The agreement rides a bucket] in
    ``graphddp.runtime.agreement_ride``): 0 but in the bucket the agreement rides."""

    def __init__(self, spec: Bucket, params: list[torch.nn.Parameter], param_indices: list[int]) -> None:
        assert len(params) == len(spec.params) == len(param_indices)
        self.spec = spec
        self.index = spec.index
        self.params = params
        self.param_indices = param_indices
        self.dtype, self.device, self.numel = spec.dtype, torch.device(spec.device), spec.numel  # read every step
        # ``buffer`` and ``views`` are made on first use (``__getattr__``), then plain attributes.
        self.whole = [i for i, p in zip(param_indices, spec.params) if not p.part]
        """The parameters whose whole gradient is here (the others' slots hold a part of a tied weight's)."""
        self.plain = len(self.whole) == len(params) and all(p.dtype == spec.dtype for p in params)
        """Every slot a whole gradient in the bucket's dtype, none with parts elsewhere (``BucketSlots`` says):
        ``views`` and ``params`` pair up, and a scaled copy is a copy and one scaling of the buffer (Note [Lean
        bucket path] in ``graphddp.runtime.reductions``)."""
        self._ready = [False] * len(params)
        self._pending = len(params)
        self.last_slot = -1
        """The slot counted down last (which gradient completed the bucket: Note [Counting without a frame])."""
        self.in_flight: Any = None
        """This iteration's reduction (``graphddp.runtime.reductions.InFlight``), once started."""
        self._in_place: torch.Tensor | None = None  # this iteration's gradient reduced where it lies, flat

    @staticmethod
    def _storage(spec: Bucket, room: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # [numel + room]: the gradients of the bucket's parameters, back to back, in plan order, then the
        # agreement's room; a view per parameter.
        carrier = torch.zeros(spec.numel + room, dtype=spec.dtype, device=spec.device)
        views, offset = [], 0
        for p in spec.params:
            views.append(carrier[offset : offset + p.numel].view(p.shape))
            offset += p.numel
        return carrier, views

    def make_room(self, room: int) -> None:
        """``room`` elements after the gradients (the bucket the agreement rides), before the buffer is made."""
        assert not self.allocated and room > 0, f"bucket {self.index}: room is made once, before the buffer"
        self.room = room

    def __getattr__(self, name: str) -> Any:
        """``buffer``: the flat buffer (zeros until written), and ``views``: per parameter, its slice of it shaped
        like it, allocated when first asked for. A bucket whose one gradient is always reduced where it lies never
        asks (Note [A lone gradient reduced where it lies]), so it holds no second copy of that gradient. Once made
        they are plain attributes: no Python call per access on the hot path (Python calls ``__getattr__`` only
        for an attribute it did not find)."""
        if name not in ("buffer", "views", "carrier"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        carrier, views = self._storage(self.spec, self.room)
        self.__dict__.setdefault("buffer", carrier[: self.numel] if self.room else carrier)  # a sparse gradient's
        self.__dict__.setdefault("views", views)  # bucket may have put its own buffer already
        self.__dict__.setdefault("carrier", carrier)
        return self.__dict__[name]

    @property
    def allocated(self) -> bool:
        """Has the buffer been made (asked for) yet?"""
        return "buffer" in self.__dict__

    def zeros(self) -> torch.Tensor:
        """A new tensor of zeros shaped like ``carrier`` (a joined rank's or a drained bucket's stand-in: the room
        too), without allocating ``buffer``."""
        return torch.zeros(self.numel + self.room, dtype=self.dtype, device=self.device)

    @property
    def reduced_in_place(self) -> bool:
        """This iteration reduces the bucket's one gradient itself, not ``buffer``."""
        return self._in_place is not None

    @property
    def reduced(self) -> torch.Tensor:
        """What this iteration reduces: the buffer, or the bucket's one gradient itself where its layout reduces it
        in place (Note [A lone gradient reduced where it lies] in ``graphddp.runtime.grad_layout``)."""
        return self.buffer if self._in_place is None else self._in_place

    def reduce_in_place(self, grad: torch.Tensor | None) -> None:
        """This iteration reduces ``grad`` itself (the bucket's one gradient), or the buffer (None)."""
        self._in_place = None if grad is None else grad.view(-1)

    def release(self) -> None:
        """The end of backward: drop this iteration's collective once the process group has given back what was
        lent to it (Note [A collective holds no Python object] in ``graphddp.runtime.launch_context``), and the
        reference to a gradient reduced in place, so the optimizer's ``zero_grad(set_to_none=True)`` frees it."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is not None:
            in_flight.let_go()
        self._in_place = None

    def take(self, reduced: torch.Tensor) -> None:
        """The reduced result becomes the bucket's content (a hook may return a tensor of its own)."""
        if reduced.data_ptr() != self.reduced.data_ptr():
            assert self.reduced is self.buffer, f"bucket {self.index}: a gradient reduced in place came back elsewhere"
            self.buffer.copy_(reduced.reshape(-1))

    # -- lifecycle -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = len(self.params)
        self.release()

    def is_ready(self, slot: int) -> bool:
        return self._ready[slot]

    def mark_ready(self, slot: int) -> bool:
        """Record that the gradient in ``slot`` is in the buffer; True when it was the last one missing."""
        assert not self._ready[slot], "the Reducer checks double readiness before calling mark_ready"
        return self.count_down(slot) == 0

    @skip  # the steady hook's one call per gradient (Note [Hook that only counts]): Dynamo never compiles it
    def count_down(self, slot: int) -> int:
        """``slot``'s gradient is final: how many slots are still missing, or -1 if it was final already."""
        if self._ready[slot]:
            return -1
        self._ready[slot] = True
        self._pending -= 1
        self.last_slot = slot
        return self._pending

    def mark_all_ready(self) -> None:
        """Every slot's gradient arrived, counted in C (Note [Counting without a frame] in
        ``graphddp.runtime.arrivals``)."""
        self._ready = [True] * len(self._ready)
        self._pending = 0

    @property
    def complete(self) -> bool:
        return self._pending == 0

    def missing_slots(self) -> list[int]:
        return [i for i, ready in enumerate(self._ready) if not ready]

    def start(self, in_flight: Any) -> None:
        assert self.in_flight is None, f"bucket {self.index} started twice"
        self.in_flight = in_flight

    @property
    def started(self) -> bool:
        return self.in_flight is not None


class SparseGradBucket(FlatBucket):
    """A bucket of one ``torch.sparse`` gradient (``ParamSpec.sparse_grad``): no flat storage, ``buffer`` *is* the
    gradient in the bucket's dtype (``mixed_precision``'s ``reduce_dtype``), put there when it is ready
    (``grad_layout.SparseGrads``) and replaced by the reduced tensor (a sparse average has a size of its own), as
    PyTorch's Reducer does with sparse gradients."""

    def __init__(self, spec: Bucket, params: list[torch.nn.Parameter], param_indices: list[int]) -> None:
        super().__init__(spec, params, param_indices)
        self.plain = False  # its buffer is the gradient tensor itself, put there whole

    @staticmethod
    def _storage(spec: Bucket, room: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        (param,) = spec.params
        empty = _no_rows(param.shape, param.dtype, param.device)
        return empty, [empty]  # the view is never written: ``put`` replaces the buffer

    @torch.no_grad()
    def put(self, grad: torch.Tensor | None, scale: float | None) -> None:
        """The parameter's gradient in the bucket's dtype, scaled, as the bucket's content (a copy: ``.grad`` stays
        as it was until the write-back); no gradient: a tensor with no rows. Every rank's is then of one dtype."""
        spec = self.spec.params[0]
        if grad is None:
            self.buffer = _no_rows(spec.shape, spec.dtype, spec.device)
        else:
            # coalesce() and the cast (mixed_precision's reduce dtype) copy only where they must; either copy is
            # already the bucket's own, so only a tensor that is still ``.grad`` itself is cloned.
            own = grad.coalesce().to(spec.dtype)
            if scale is not None:
                self.buffer = own * scale
            elif own is grad:
                self.buffer = own.clone()
            else:
                self.buffer = own

    def take(self, reduced: torch.Tensor) -> None:
        self.buffer = reduced

    def zeros(self) -> torch.Tensor:
        return torch.zeros_like(self.buffer)  # sparse, laid out like the gradient (the buffer costs nothing here)


def _no_rows(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    # indices [1, 0], values [0, *shape[1:]]: the hybrid layout of an embedding's gradient, so ranks that had no
    # gradient send a tensor laid out like the others' (the only sparse gradients planned: sparse_gradient_params).
    return torch.sparse_coo_tensor(
        torch.empty(1, 0, dtype=torch.long), torch.empty(0, *shape[1:], dtype=dtype), shape, device=device,
        check_invariants=False,  # empty: nothing to check
    )


Where = tuple[int, int]
"""A slot: ``(bucket index, position in the bucket)``."""


class BucketSlots:
    """A plan's flat buckets for the Reducer's parameters, where each gradient lives in them, and how it gets there
    and back (step 3 and 4 of Note [Reducer] in ``graphddp.runtime.reducer``).

    ``slot[i]`` is parameter ``i``'s ``(bucket, slot)``; ``parts_of[i]`` the slots of its parts (a tied weight's
    contributions reduced on their own, Note [Row-sparse gradients]); ``part_slot[(name, node)]`` the same by key.
    """

    def __init__(
        self, plan: BucketPlan, names: list[str], params: list[torch.nn.Parameter], dense_layout: Any, used: Sequence[bool]
    ) -> None:
        index_of_name = {n: i for i, n in enumerate(names)}
        self._params = params
        self.buckets: list[FlatBucket] = []
        self.layout: list[Any] = [dense_layout] * len(params)
        """Parameter ``i``'s ``graphddp.runtime.grad_layout`` policy: ``dense_layout``, or ``SparseGrads`` for its bucket."""
        self.slot: list[tuple[int, int]] = [(-1, -1)] * len(params)
        self.part_slot: dict[tuple[str, str], tuple[int, int]] = {}
        self.parts_of: dict[int, list[tuple[int, int]]] = {}
        for spec in plan.buckets:
            indices = [index_of_name[p.name] for p in spec.params]
            bucket = (SparseGradBucket if spec.sparse_grad else FlatBucket)(spec, [params[i] for i in indices], indices)
            self.buckets.append(bucket)
            if isinstance(bucket, SparseGradBucket):
                self.layout[indices[0]] = SparseGrads(bucket)
            for slot, (i, p) in enumerate(zip(indices, spec.params)):
                if p.part:
                    self.part_slot[p.key] = (bucket.index, slot)
                    self.parts_of.setdefault(i, []).append((bucket.index, slot))
                else:
                    self.slot[i] = (bucket.index, slot)
        for i in self.parts_of:  # its parts are added in at write-back: the per-parameter path
            self.buckets[self.slot[i][0]].plain = False
        for bucket in self.buckets:  # Note [A lone gradient reduced where it lies] in graphddp.runtime.grad_layout
            if bucket.plain and len(bucket.params) == 1 and not bucket.spec.params[0].row_sparse:
                self.layout[bucket.param_indices[0]] = dense_layout.of_lone_gradient(used)
        # Per parameter, its parts' slices, looked up once (the write-back runs every iteration); its own slice is
        # looked up when needed: a bucket whose gradient is reduced where it lies never allocates its buffer.
        self._parts = [[self.view(where) for where in self.parts_of.get(i, ())] for i in range(len(params))]

    def move_grads(self) -> None:
        """Each parameter's gradient into its slice of these buckets (a new plan: bucket views follow)."""
        for i, param in enumerate(self._params):
            self.layout[i].move(param, functools.partial(self.view, self.slot[i]))

    def reset(self) -> None:
        """A new synchronised backward: every slot empty, nothing launched."""
        for bucket in self.buckets:
            bucket.reset()

    def view(self, where: tuple[int, int]) -> torch.Tensor:
        bucket, slot = where
        return self.buckets[bucket].views[slot]

    def parts(self, i: int) -> list[torch.Tensor]:
        """The bucket views of parameter ``i``'s parts (reduced before its own bucket, so added at write-back)."""
        return self._parts[i]

    # -- into the buckets ------------------------------------------------------------------------------------
    def gather(self, bucket: FlatBucket, scale: float | None) -> None:
        """A complete bucket's gradients into its buffer, in one call (parts are in their slots already)."""
        if bucket.plain:
            self.layout[bucket.param_indices[0]].gather(bucket, scale)
            return
        slots = [slot for slot, spec in enumerate(bucket.spec.params) if not spec.part]
        if slots:
            params = [bucket.params[slot] for slot in slots]
            # One layout per bucket: the dense one, or SparseGrads for a bucket of its own.
            self.layout[bucket.param_indices[slots[0]]].to_bucket_many(
                params, [bucket.views[slot] for slot in slots], scale
            )

    def open_part(self, key: tuple[str, str]) -> Where | None:
        """The slot of part ``key`` of a tied weight's gradient, if this plan has one and it is not filled yet."""
        where = self.part_slot.get(key)
        return where if where is not None and not self.buckets[where[0]].is_ready(where[1]) else None

    def fill_part(self, where: Where, grad: torch.Tensor | None, scale: float | None) -> str:
        """Part slot ``where`` becomes ``grad * scale`` (zeros for None: no contribution this iteration); returns
        the part's label."""
        fill(self.view(where), grad, scale)
        return self.buckets[where[0]].spec.params[where[1]].label

    def owner(self, where: Where) -> int:
        """The parameter whose gradient (or part of one) slot ``where`` holds."""
        return self.buckets[where[0]].param_indices[where[1]]

    def mark_ready(self, where: Where) -> FlatBucket | None:
        """Slot ``where`` is filled: its bucket when that made it complete, else None."""
        bucket = self.buckets[where[0]]
        return bucket if bucket.mark_ready(where[1]) else None

    def mark_unused(self, unused: list[int], mark: Callable[[int], None], mark_part: Callable[[Where], None]) -> None:
        """The forward's unused parameters are ready, their parts too (no gradient reaches them, through a tap
        neither): ``mark(i)``, ``mark_part(where)``; at the backward's first hook (Note [Reducer])."""
        for i in unused:
            mark(i)
            for where in self.parts_of.get(i, ()):
                mark_part(where)

    def fill_missing(self, mark: Callable[[int], None], mark_part: Callable[[Where], None]) -> list[int]:
        """End of backward: mark every slot no gradient reached, in bucket order (``mark(i)`` for parameter ``i``,
        ``mark_part(where)`` for a part: no contribution from that use here); returns those parameters."""
        missing = []
        for bucket in self.buckets:
            if bucket.complete:
                continue
            for slot in bucket.missing_slots():
                if bucket.spec.params[slot].part:
                    mark_part((bucket.index, slot))
                else:
                    missing.append(bucket.param_indices[slot])
                    mark(missing[-1])
        return missing

    # -- back into .grad -------------------------------------------------------------------------------------
    def take_reduced(self, bucket: FlatBucket, reduced: torch.Tensor, write: Sequence[bool]) -> list[int]:
        """Bucket ``bucket``'s reduced result in, and the averages of its parameters that ``write`` selects into
        their ``.grad`` in one call; returns its parameters (not its parts: those are added to their weight's)."""
        bucket.take(reduced)
        whole = bucket.whole
        if bucket.plain and all(map(write.__getitem__, whole)):  # the usual case: no Python frame per parameter
            self.layout[whole[0]].scatter(bucket)
        else:
            self.write_back_many([i for i in whole if write[i]])
        return whole

    def write_back_many(self, indices: list[int]) -> None:
        """``write_back`` for parameters of one bucket (one layout), in one call."""
        if indices:
            self.layout[indices[0]].from_bucket_many(
                [self._params[i] for i in indices], [self.view(self.slot[i]) for i in indices], [self._parts[i] for i in indices]
            )

    def finish_write_back(self, used_here: Sequence[bool], counts: Sequence[int]) -> None:
        """The iteration's last write-back: the averages of the parameters this rank did not use and some rank did,
        one by one (used nowhere: ``.grad`` stays as it was); then every bucket drops the iteration's tensors it
        does not own (``FlatBucket.release``)."""
        for i, used in enumerate(used_here):
            if not used and counts[i] > 0:
                self.write_back(i)
        for bucket in self.buckets:
            bucket.release()

    def write_back(self, i: int) -> None:
        """Parameter ``i``'s averaged gradient from its bucket slice into ``param.grad``, with its parts added in:
        their buckets come earlier, so they are reduced already (Note [Row-sparse gradients])."""
        self.layout[i].from_bucket(self._params[i], self.view(self.slot[i]), self._parts[i])


class GradBucket:
    """What a communication hook receives: behaves like ``torch.distributed.GradBucket``.

    PyTorch's hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``) only
    use the methods below, so they run unchanged on graphddp's buckets. ``gradients()`` returns views into the
    current buffer: PowerSGD writes through them and returns the buffer.
    """

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.nn.Parameter], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._params = params
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def is_last(self) -> bool:
        return self._is_last

    # The name older PyTorch hooks use.
    is_the_last_bucket_to_allreduce = is_last

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        if self._buffer.is_sparse:  # a sparse gradient's bucket is that gradient (as in PyTorch)
            return [self._buffer]
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, params={len(self._params)})"
