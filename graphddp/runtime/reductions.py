"""How one bucket is reduced: a small strategy object per bucket, so the Reducer's hot path has no feature ``if``.

Every strategy's ``start(bucket, buffer)`` issues the bucket's first collective and returns an ``InFlight``:

* ``commit()`` issues whatever collectives are left. The launcher (``graphddp.runtime.launcher``) calls it before it
  launches the next bucket, or before it awaits this one, so the main group sees one order of collectives on
  every rank;
* ``done()`` says whether the result is there (``ChainedLaunch`` asks);
* ``wait()`` returns the reduced bucket, checked: one tensor with the buffer's element count.

``dense_reduction``: the bucket through the user's comm hook (``HookReduction``), or graphddp's averaging
all-reduce (``AveragingReduction``, or ``WireAveragingReduction`` where the backend averages: Note [Averaged on the
wire]), one step, nothing to commit; a ``torch.sparse`` gradient under graphddp's
averaging through all-gathers, two steps (``GatheredSparseReduction``, Note [Sparse gradients, gathered]). The
averaging all-reduce keeps the collective's ``Work`` and waits on it: no future, no callback. On a GPU a Python
future chain (``get_future().then(...)``, its ``value()``) costs ~0.4 ms of CPU per bucket, measured on an H100
(docs/gpu.md), which a backward that feeds the GPU from Python cannot hide.

``RowSparseReduction`` (Note [Row-sparse gradients] in ``passes/row_sparse.py``): an embedding table's gradient
in two steps, both issued from the thread that runs backward:

* ``start``: which rows does this rank's gradient touch? A ``[rows]`` byte mask, max-reduced on the DDP's group
  (the bucket's channel: the DDP's group unless ``channels`` > 1, Note [Channels]);
* ``commit``: with the union known, the main group all-reduces the touched rows only, packed; or, when the union
  is over ``ROW_SPARSE_MAX_DENSITY`` of the rows, the whole bucket through the default hook. ``commit`` waits
  for the mask: for a table in the middle of backward that is one small round trip in which backward pauses; a
  table used first in forward is the last bucket, and nothing waits;
* ``wait``, on the thread that awaits the bucket: the reduced rows back into the zeroed table. (Not in a future
  callback: that would run on gloo's thread, ahead of its next collective.)

The outcome depends only on the all-reduced mask, so every rank takes the same branch. A table that went dense
``DENSE_STREAK_LIMIT`` times in a row gives up rows (``gave_up``): reduced dense without trying; at the next forward
the Reducer plans it dense (Note [Plan agreement] in ``graphddp.runtime.plans``, "tables gone dense").

Note [Averaged on the wire]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A backend may average inside its all-reduce (``ReduceOp.AVG``): gloo from PyTorch 2.8 (the sum, then one division
on gloo's worker thread), NCCL (each contribution pre-multiplied by ``1/world`` in the kernel). A plain dense bucket
under graphddp's averaging could then be copied in unscaled and sent with ``AVG`` (``WireAveragingReduction``): the
``mul_`` of the whole bucket (or of a lone gradient, Note [A lone gradient reduced where it lies]) would leave the
backward's thread. ``averages_on_the_wire`` is the one rule, per bucket:

* the backend averages such a bucket correctly (``averages_correctly``, by name, on the bucket's device): floating
  dtypes of 32 bits or more only. gloo sums before it divides, so a float16 or bfloat16 sum can overflow where the
  scaled gradients would not; NCCL rounds its ``1/world`` pre-multiplier to the bucket's dtype first (a constant
  bias of +-0.2 % in bfloat16 at 3, 6, 7 or 12 ranks);
* and it pays there (``WIRE_AVERAGING``): **no backend so far**. On gloo the division is one more pass over the
  bucket on gloo's worker, after the sum, on data that has left the cache, while the ``mul_`` it replaces runs on
  a bucket just copied in: ``python -m bench.wire_average`` (the bench's ten GPT buckets, 2 ranks, 2 vCPUs) measured
  the ``mul_`` at 0.5-0.6 ms of the backward's thread a step and the division at 0.8-0.9 ms of gloo's; inside the DDP's
  step the scaled sum cost 0.5-1.5 ms less CPU and was 0.5-1.9 ms faster (``docs/benchmarks.md``, session 54). A
  host's cores are most often all busy training (intra-op threads, other ranks), so moving a pass to a worker
  thread does not make it free. NCCL is not measured: read in its kernel generator, its NVLink SHARP (NVLS)
  algorithms do not implement the pre-multiplied sum, so on an NVSwitch node a bucket could lose NVLS to save a
  ``mul_`` that costs a GPU microseconds (``docs/gpu.md`` says what a multi-GPU run should measure);
* graphddp's averaging reduces the bucket (a comm hook averages as it likes: ``HookReduction``), whole and dense: a
  table reduced as rows (``RowSparseReduction``, whose dense fallback then sums too: ``summing``), a
  ``torch.sparse`` gradient (all-gathers) and the bucket that carries the plan agreement (its counts must be summed:
  Note [The agreement rides a bucket]) keep the scaled copy and a sum.

Each reduction says what its collective divides by (``divides_by``: the group's size for ``AVG``, else 1), and the
Reducer scales a bucket's gradients on their way in by ``divides_by / divisor`` (``CommHook.prescales``): nothing
for ``AVG`` over the world size, ``1/divisor`` for a sum, and ``world/active`` under ``join`` with
``divide_by_initial_world_size=False``, so the average is over the ranks still training either way. The results
equal the scaled sum's up to rounding (exactly for a world size that is a power of two), as PyTorch's DDP allows
itself: its comm hook ``allreduce_hook`` divides before the sum, its C++ Reducer while copying in. (The tests run the
rule with gloo let in: ``tests/spawned/test_wire_average.py``.) The compiled
in-graph strategy keeps its division (Note [In-graph reduction] in ``graphddp/compiler/in_graph.py``): Inductor
writes each quotient straight into the bucket, so there the division costs no pass of its own.

Note [Sparse gradients, gathered]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``torch.sparse`` gradient (``nn.Embedding(sparse=True)``, its own bucket: ``buckets.SparseGradBucket``) is averaged
by ``GatheredSparseReduction`` with dense collectives, never the backend's sparse all-reduce:

* ``start``: every rank's ``nnz`` (its gradient coalesced: ``[S, nnz]`` indices, ``[nnz, *D]`` values), all-gathered;
* ``commit``: the indices and the values, each padded to the largest ``nnz``, all-gathered (nothing when no rank has
  a row);
* ``wait``: every rank's rows, unpadded, as one sparse tensor, coalesced: rows several ranks touched are summed (the
  Reducer divided by the world size while putting the gradient in its bucket).

Why not ``all_reduce`` of the sparse tensor, as PyTorch's Reducer does: gloo's sparse all-reduce corrupts the heap
now and then when other collectives run beside it (``tests/repro/sparse_gloo_heap.py`` kills a rank of PyTorch's own
DDP within minutes; docs/reliability.md, "A heap corruption with sparse gradients on gloo"), and all-gathers of dense
tensors are what every backend has. They are what gloo's sparse all-reduce does inside (sizes, then indices and
values), with padding to the largest ``nnz``: each rank receives ``world`` times the largest rank's entries, so one
rank with many rows makes every rank's buffers that large (the backend's sparse all-reduce receives each rank's own
count). A user's comm hook still gets the sparse tensor itself, as in PyTorch.

Note [Lean bucket path]
~~~~~~~~~~~~~~~~~~~~~~~
What a plain dense bucket costs per iteration, the path of nearly every bucket (PyTorch's C++ Reducer runs the same
steps in C++; here each Python call is time a launch-bound backward waits for):

* into the bucket: one ``_foreach_copy_`` of its gradients and, for graphddp's averaging, one ``mul_`` of the
  whole buffer by ``1/world`` (``grad_layout.CopiedGrads.gather``: the same rounding as a scaled copy, as the
  dtypes are equal; a bucket of another dtype, parts or gradients missing take the per-parameter path); no
  ``mul_`` where the collective averages itself (Note [Averaged on the wire]);
* the collective: ``ProcessGroup.allreduce`` called directly (``torch.distributed.all_reduce`` checks its arguments
  in Python every call: ten calls per bucket), on the *current* stream, waited through its ``Work``: no future, no
  callback, no stream of graphddp's own (on CUDA the process group orders its stream after the current one when
  the collective is issued, and ``Work.wait()`` orders the current stream after the collective, as for PyTorch's
  Reducer); nothing left to ``commit``, so the launcher keeps no record of it;
* back into ``.grad``: one ``_foreach_copy_`` per bucket (``CopiedGrads.scatter``).

A bucket of one whole gradient skips both copies: the gradient is scaled and all-reduced in ``.grad`` itself
(Note [A lone gradient reduced where it lies] in ``graphddp.runtime.grad_layout``).

Events, profiler ranges and the optimizer step per bucket cost a check each when nobody asked for them. On one
rank with graphddp's averaging there is nothing to average (``LocalReduction``): no copy, no collective, ``.grad``
is the gradient autograd produced.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from ..passes import ROW_SPARSE_MAX_DENSITY
from .buckets import FlatBucket, GradBucket
from .channels import Channels
from .comm import AverageState, average_allreduce_hook
from .launch_context import GIVE_BACK_LIMIT_S, TELLS_USE_COUNTS, given_back, lend, no_backward_context, warn_still_held

DENSE_STREAK_LIMIT = 2
"""After this many dense outcomes in a row, a row-sparse bucket is reduced dense without trying."""
AVERAGES_CORRECTLY: dict[str, tuple[tuple[int, int], int]] = {"gloo": ((2, 8), 32), "nccl": ((2, 4), 32)}
"""Backends whose ``ReduceOp.AVG`` gives what the scaled sum gives, by name: from which PyTorch version (gloo took
``AVG`` in 2.8; NCCL has had it longer than graphddp supports PyTorch, so 2.4, ``pyproject.toml``'s floor), and the
fewest bits of a floating dtype (gloo sums, then divides: a 16-bit sum may overflow; NCCL pre-multiplies by
``1/world`` rounded to the dtype: a bias in bfloat16)."""
WIRE_AVERAGING: frozenset[str] = frozenset()
"""Of those, the backends graphddp lets average: where ``AVG`` was measured to cost less than the scaled sum. None
so far (Note [Averaged on the wire] says why): gloo's division costs its worker more than the ``mul_`` it saves the
backward's thread, and NCCL is not measured. The mechanism (``WireAveragingReduction``, ``summing``, the
reductions' ``divides_by``) is kept for NCCL, which a multi-GPU run of ``bench.wire_average`` decides
(``docs/gpu.md``); the tests run it with gloo let in."""


class InFlight(Protocol):
    pending_commit: bool
    """``commit`` has something to issue, or an outcome to record (else the launcher keeps no record of it)."""
    outcome: tuple[str, str] | None
    """An event to record once committed (``("rows", "12/512")``), or None."""
    future: torch.futures.Future | None
    """The main-group future, once committed."""

    def commit(self) -> None: ...

    def done(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...

    def let_go(self) -> None:
        """After ``wait``, at the end of backward: drop the references to the collective and, for graphddp's own,
        wait until the process group has given back the tensors lent to it (Note [A collective holds no Python
        object] in ``graphddp.runtime.launch_context``)."""


@dataclasses.dataclass(frozen=True)
class CommHook:
    """The user's ``register_comm_hook(state, hook)``, or graphddp's averaging all-reduce."""

    state: Any
    fn: Callable[[Any, Any], torch.futures.Future]
    custom: bool

    @classmethod
    def averaging(cls, group: dist.ProcessGroup) -> CommHook:
        """graphddp's averaging all-reduce: the Reducer scales while copying into the bucket, or the backend averages
        (Note [Averaged on the wire])."""
        state = AverageState(group)
        state.divisor = 1
        return cls(state, average_allreduce_hook, custom=False)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype the hook sends a bucket in, where it is known: PyTorch's ``fp16_compress_hook`` and
        ``bf16_compress_hook`` cast it; None for the gradients' own (graphddp's averaging, ``allreduce_hook``, or a
        hook of the user's, whose wire graphddp cannot know). The automatic caps predict the bytes so sent."""
        return builtin_hook(self.fn)[1] if self.custom else None

    def prescales(self, divisor: Callable[[], int], divides_by: Sequence[int]) -> list[float | None]:
        """What each bucket's gradients are multiplied by while copied into it, for buckets whose collectives
        divide by ``divides_by`` (Note [Averaged on the wire]): ``divides_by / divisor()`` under graphddp's
        averaging, so the bucket ends up averaged over ``divisor()`` ranks, or None where that is 1; None for a
        custom hook (it averages itself, and ``divisor``, which may wait for ``join``'s count, is not asked)."""
        if self.custom:
            return [None] * len(divides_by)
        ranks = divisor()
        return [by / ranks if by != ranks else None for by in divides_by]


def builtin_hook(fn: Any) -> tuple[bool, torch.dtype | None]:
    """Whether ``fn`` is one of PyTorch's built-in hooks that reduce a bucket with one all-reduce
    (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``: launched as soon as ready, traceable
    in-graph), and the dtype it sends the bucket in (None: the gradients' own). By identity: a hook may be any
    callable, hashable or not."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for builtin, wire in ((default_hooks.allreduce_hook, None), (default_hooks.fp16_compress_hook, torch.float16),
                          (default_hooks.bf16_compress_hook, torch.bfloat16)):  # fmt: skip
        if fn is builtin:
            return True, wire
    return False, None


def in_graph_wire(hook: CommHook, group: dist.ProcessGroup) -> torch.dtype | None | bool:
    """How a compiled backward can run ``hook`` itself (Note [In-graph reduction]): None (graphddp's averaging, or
    PyTorch's ``allreduce_hook``: average in the gradients' dtype), a dtype (``fp16_compress_hook``,
    ``bf16_compress_hook``: cast, average, cast back), or False: a Python hook it cannot trace."""
    if not hook.custom:
        return None
    # The built-in hooks' state is the group they reduce on; None means the default group (WORLD), so on a DDP of
    # a subgroup the hook reduces over every rank, which the in-graph all-reduce (on the DDP's group) would not.
    if (hook.state if hook.state is not None else dist.group.WORLD) is not group:
        return False
    traceable, wire = builtin_hook(hook.fn)
    return wire if traceable else False


class HookReduction:
    """The whole bucket through the user's comm hook, whose future resolves to the reduced bucket."""

    gave_up = False
    """Never tries rows (see ``RowSparseReduction.gave_up``)."""
    divides_by = 1
    """What the bucket's collective divides it by (Note [Averaged on the wire]): a hook averages as it likes."""

    def __init__(self, hook: CommHook, rank: int) -> None:
        self.hook, self.rank = hook, rank

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> DenseInFlight:
        with no_backward_context():  # the hook's Works may outlive backward: Note [A collective holds no Python object]
            future = self.hook.fn(self.hook.state, GradBucket(bucket.index, buffer, bucket.params, is_last))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and the C++ futures of Work
            raise RuntimeError(  # PyTorch's type and words, with the bucket and what to return
                f"[rank {self.rank}] graphddp: DDP communication hook's callback must return a torch.futures.Future "
                f"object, but got {type(future).__name__} for bucket {bucket.index} (e.g. return "
                "dist.all_reduce(..., async_op=True).get_future())."
            )
        return DenseInFlight(future, bucket, buffer, self.rank)


class AveragingReduction:
    """The whole bucket through graphddp's averaging all-reduce (the Reducer scaled it while copying it in), waited
    on through the collective's ``Work`` (Note [Lean bucket path])."""

    gave_up = False
    """Never tries rows (see ``RowSparseReduction.gave_up``)."""
    divides_by = 1
    """What the collective divides the bucket by: it sums (Note [Averaged on the wire])."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._allreduce = group.allreduce  # what dist.all_reduce calls, after its per-call argument checks
        self._options = dist.AllreduceOptions()  # ReduceOp.SUM

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> AveragedInFlight:
        alias = buffer.view(buffer.shape)  # ``lend``, inlined: Note [A collective holds no Python object]
        return AveragedInFlight(self._allreduce([alias], self._options), buffer, alias)


class WireAveragingReduction(AveragingReduction):
    """graphddp's averaging all-reduce where the backend averages (``ReduceOp.AVG``): the Reducer copies the
    gradients in unscaled (Note [Averaged on the wire])."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self.divides_by = group.size()
        self._options.reduceOp = dist.ReduceOp.AVG


class LocalReduction:
    """One rank and graphddp's averaging: the average of one gradient is itself. No collective; the gradients stay
    in ``.grad`` (``grad_layout.LocalGrads`` moves nothing), as ``local_average`` decides."""

    gave_up = False
    divides_by = 1

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> SkippedInFlight:
        return SkippedInFlight(buffer, outcome=None)


class GatheredSparseReduction:
    """A ``torch.sparse`` gradient (``nn.Embedding(sparse=True)``) averaged with dense all-gathers, not the backend's
    sparse all-reduce (Note [Sparse gradients, gathered]). The Reducer scaled it while putting it in its bucket."""

    gave_up = False
    divides_by = 1

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> GatheredSparseInFlight:
        return GatheredSparseInFlight(self.group, buffer)


def local_average(world_size: int, hook: CommHook) -> bool:
    """The one rule for ``LocalReduction``: one rank, graphddp's own averaging (a user's hook runs even alone, as
    in PyTorch: it may compress, and so change the gradient)."""
    return world_size == 1 and not hook.custom


DenseReduction = HookReduction | AveragingReduction | LocalReduction | GatheredSparseReduction


def dense_reduction(
    hook: CommHook, group: dist.ProcessGroup, rank: int, *, sparse: bool = False, dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> DenseReduction:  # fmt: skip
    """The whole bucket through ``hook``: the user's (a future), graphddp's averaging (its ``Work``; averaged by the
    backend where ``averages_on_the_wire`` says so for the bucket's ``dtype`` on ``device``; a ``torch.sparse``
    gradient, ``sparse``, by all-gathers), or nothing to do on one rank."""
    if hook.custom:
        return HookReduction(hook, rank)  # a user's hook gets a sparse gradient as it is, as in PyTorch
    if local_average(group.size(), hook):
        return LocalReduction()
    if sparse:
        return GatheredSparseReduction(group)
    if dtype is not None and device is not None and averages_on_the_wire(backend_name(group, device), dtype):
        return WireAveragingReduction(group)
    return AveragingReduction(group)


def averages_on_the_wire(backend: str, dtype: torch.dtype, version: Any = torch.__version__) -> bool:
    """The one rule of Note [Averaged on the wire]: a dense bucket of ``dtype`` is averaged by ``backend``'s
    all-reduce (``ReduceOp.AVG``) under PyTorch ``version``, not scaled on its way in: where graphddp lets the
    backend average (``WIRE_AVERAGING``) and it averages such a bucket correctly (``averages_correctly``)."""
    return backend in WIRE_AVERAGING and averages_correctly(backend, dtype, version)


def averages_correctly(backend: str, dtype: torch.dtype, version: Any = torch.__version__) -> bool:
    """Does ``backend``'s ``ReduceOp.AVG`` under PyTorch ``version`` give a bucket of ``dtype`` what the scaled sum
    gives (``AVERAGES_CORRECTLY``)? What the backend can do, whether or not graphddp lets it."""
    if backend not in AVERAGES_CORRECTLY or not dtype.is_floating_point or dtype.is_complex:
        return False
    since, fewest_bits = AVERAGES_CORRECTLY[backend]
    return TorchVersion(str(version)) >= since and torch.finfo(dtype).bits >= fewest_bits


def backend_name(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name of the backend that runs ``group``'s collectives on ``device`` (``"gloo"``, ``"nccl"``), or ``""``
    when the group cannot say (a process group written in Python)."""
    try:
        return group._get_backend(device).name().lower()
    except (RuntimeError, AttributeError, ValueError, TypeError):
        return ""


def bucket_reductions(
    buckets: Sequence[FlatBucket], dense: Sequence[DenseReduction], *, rows: bool, channels: Channels
) -> list[DenseReduction | RowSparseReduction]:
    """One strategy per bucket, on the bucket's channel (Note [Channels] in ``graphddp.runtime.channels``): an
    embedding table's rows where rows apply (``rows``), else the bucket's ``dense`` reduction."""
    return [
        RowSparseReduction(summing(dense[b.index]), group=channels.of_bucket(b.index)) if rows and b.spec.row_sparse else dense[b.index]
        for b in buckets
    ]


def summing(dense: DenseReduction) -> DenseReduction:
    """``dense``, summing where it would average on the wire: a table's rows are scaled on their way in, and its
    dense fallback must reduce what the rows would (Note [Averaged on the wire])."""
    return AveragingReduction(dense.group) if isinstance(dense, WireAveragingReduction) else dense


class DenseInFlight:
    pending_commit = False
    outcome = None

    def __init__(self, future: Any, bucket: FlatBucket, buffer: torch.Tensor, rank: int) -> None:
        self.future, self._bucket, self._buffer, self._rank = future, bucket, buffer, rank

    def commit(self) -> None:
        pass

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> torch.Tensor:
        return checked_result(self.future.wait(), self._bucket, self._buffer, self._rank)

    def let_go(self) -> None:
        pass  # the hook's futures are the hook's: it may keep them


class AveragedInFlight:
    """graphddp's averaging all-reduce of one bucket, in place in ``buffer``."""

    pending_commit = False
    outcome = None

    def __init__(self, work: Any, buffer: torch.Tensor, alias: torch.Tensor) -> None:
        self._work, self._buffer, self._alias = work, buffer, alias  # ``alias``: what the collective was given
        self._future: torch.futures.Future | None = None

    @property
    def future(self) -> torch.futures.Future:
        """Made only when asked (the launcher asks while recording events, for completion times)."""
        if self._future is None:
            self._future = self._work.get_future()
        return self._future

    def commit(self) -> None:
        pass

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._buffer

    def let_go(self) -> None:
        self._work = self._future = None
        alias = self._alias
        # ``given_back``, inlined on purpose: no Python call on the hot path, and none either while a late worker
        # is waited for, so a backward's count of Python calls does not depend on how gloo's threads were
        # scheduled (``tests/spawned/test_counting_in_c.py`` compares two counts exactly; calling ``given_back``
        # only when late made them differ by one now and then).
        if TELLS_USE_COUNTS and alias._use_count() > 1:
            deadline = time.monotonic() + GIVE_BACK_LIMIT_S
            while alias._use_count() > 1 and time.monotonic() < deadline:
                time.sleep(0.0001)
            if alias._use_count() > 1:
                warn_still_held("a bucket's buffer", GIVE_BACK_LIMIT_S)


def checked_result(value: Any, bucket: FlatBucket, buffer: torch.Tensor, rank: int) -> torch.Tensor:
    """What a hook's future resolved to, as the reduced bucket; a clear error when it is not one."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"[rank {rank}] graphddp: the communication hook's future for bucket {bucket.index} "
            f"resolved to {type(value).__name__}; it must resolve to the reduced bucket, one tensor shaped "
            f"like bucket.buffer() ({buffer.numel()} elements)."
        )
    if value.numel() != buffer.numel():
        raise ValueError(
            f"[rank {rank}] graphddp: the communication hook returned a tensor of shape "
            f"{tuple(value.shape)} for bucket {bucket.index}, expected {tuple(buffer.shape)} (the shape "
            f"of bucket.buffer(); parameters {list(bucket.spec.names)[:4]}). Return the reduced buffer from "
            "the hook's future."
        )
    return value


class SkippedReduction:
    """``skip_all_reduce_unused_params``: a bucket none of whose parameters got a gradient on any rank in any
    iteration so far (``GradientUsage.never_used``, the same on every rank) issues no collective. If some rank
    used one after all, every rank learns it from the usage all-reduce and the Reducer all-reduces the bucket
    late (``graphddp.runtime.skipping``): never a hang, never a silently local gradient, unlike PyTorch's DDP."""

    gave_up = False

    def __init__(self, dense: DenseReduction) -> None:
        self.dense = dense
        self.divides_by = dense.divides_by  # its late all-reduce is ``dense``'s

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> SkippedInFlight:
        return SkippedInFlight(buffer)


class SkippedInFlight:
    """No collective: the buffer is the result (``outcome``: what the events say of it, if anything)."""

    future = None

    def __init__(self, buffer: torch.Tensor, outcome: tuple[str, str] | None = ("skipped", "")) -> None:
        self._buffer = buffer
        self.outcome = outcome
        self.pending_commit = outcome is not None

    def commit(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self._buffer

    def let_go(self) -> None:
        pass  # nothing was lent


class GatheredSparseInFlight:
    """One iteration's average of one ``torch.sparse`` gradient (``[S, nnz]`` indices, ``[nnz, *D]`` values):
    ``start`` gathers every rank's ``nnz``; ``commit`` gathers the indices and values, each padded to the largest
    ``nnz``; ``wait`` sums them into one coalesced sparse tensor."""

    pending_commit = True
    outcome = None

    def __init__(self, group: dist.ProcessGroup, grad: torch.Tensor) -> None:
        grad = grad.coalesce()  # a no-op for the Reducer's (``SparseGradBucket.put``); zeros for a joined rank
        self._group, self._shape = group, grad.shape
        self._indices, self._values = grad._indices(), grad._values()  # [S, nnz], [nnz, *D]
        count = torch.full((1,), self._values.shape[0], dtype=torch.long, device=self._values.device)  # no H2D copy
        self._counts = count.new_empty(group.size(), 1)  # [world, 1]
        self._count_work = _all_gather(group, self._counts, count)
        self._works: list[Any] = []
        self._gathered: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
        self._future: torch.futures.Future | None = None

    @property
    def future(self) -> torch.futures.Future | None:
        """Once committed: done when both gathers are (the launcher asks while recording events; the count's
        gather is done by then: ``commit`` waited for it)."""
        if self._gathered is None:
            return None
        if self._future is None:
            self._future = torch.futures.collect_all([w.get_future() for w in self._works])
        return self._future

    def commit(self) -> None:
        if self._gathered is not None:
            return
        self._count_work.wait()
        counts = self._counts.view(-1).tolist()  # the same on every rank
        most, world = max(counts), len(counts)
        indices = self._indices.new_zeros(world, self._indices.shape[0], most)  # [world, S, most]
        values = self._values.new_zeros(world, most, *self._values.shape[1:])  # [world, most, *D]
        if most > 0:  # else no rank has a row: nothing to send (every rank knows it)
            mine_i, mine_v = self._indices.new_zeros(indices.shape[1:]), self._values.new_zeros(values.shape[1:])
            mine_i[:, : self._indices.shape[1]] = self._indices
            mine_v[: self._values.shape[0]] = self._values
            self._works = [_all_gather(self._group, indices, mine_i), _all_gather(self._group, values, mine_v)]
        self._gathered = (counts, indices, values)

    def done(self) -> bool:
        return self._gathered is not None and all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        assert self._gathered is not None, "wait() before commit()"
        for work in self._works:
            work.wait()
        counts, indices, values = self._gathered
        summed = torch.sparse_coo_tensor(
            torch.cat([indices[r, :, :n] for r, n in enumerate(counts)], dim=1),  # [S, sum(counts)]
            torch.cat([values[r, :n] for r, n in enumerate(counts)]),  # [sum(counts), *D]
            self._shape,
            check_invariants=False,  # each rank's indices were a coalesced gradient's, in range
        )
        return summed.coalesce()  # a row several ranks touched: summed

    def let_go(self) -> None:
        pass  # its gathers' tensors are its own, dropped with it


def _all_gather(group: dist.ProcessGroup, out: torch.Tensor, mine: torch.Tensor) -> Any:
    """``out[r] = rank r's mine`` (``out``: ``[world, *mine.shape]``), issued on ``group``: its ``allgather`` with
    views of ``out`` as outputs, which every backend has had (gloo's all-gather into one tensor is recent), without
    ``dist.all_gather``'s per-call checks. Returns the ``Work``."""
    return group.allgather([list(out.unbind(0))], [mine])


def touched_rows_mask(table: torch.Tensor) -> torch.Tensor:
    """``[rows]`` uint8: 1 where this rank's gradient ``table`` (``[rows, C]``) touches the row, to be max-reduced.
    A row's max and min are both 0 exactly for an untouched row; a NaN row stays touched (both propagate NaN, and
    NaN != 0), so NaNs travel. Two reductions and no ``[rows, C]`` temporary: ``|x|``'s max allocated one the
    table's size, whose fresh pages cost more than the pass (~15 ms for the bench GPT's 16 MiB table on a 2-vCPU
    VM)."""
    return (table.amax(dim=1).ne(0) | table.amin(dim=1).ne(0)).to(torch.uint8)


def goes_as_rows(touched: int, rows: int) -> bool:
    """The one rule, eager and in-graph alike: ``touched`` rows of a ``rows``-row table (the all-reduced mask's
    count, the same on every rank) travel as rows, else the table goes dense (``ROW_SPARSE_MAX_DENSITY``)."""
    return touched <= ROW_SPARSE_MAX_DENSITY * rows


class DenseStreak:
    """A table's outcomes, counted: after ``DENSE_STREAK_LIMIT`` dense ones in a row it gives up rows. Fed only
    all-reduced outcomes, so it gives up on the same iteration on every rank."""

    def __init__(self) -> None:
        self._dense = 0

    @property
    def gave_up(self) -> bool:
        return self._dense >= DENSE_STREAK_LIMIT

    def observe(self, sparse: bool) -> None:
        self._dense = 0 if sparse else self._dense + 1


class RowSparseReduction:
    """A row-sparse bucket (one 2-D table): rows while they stay few, dense after a streak of dense outcomes."""

    divides_by = 1
    """Rows and the dense fallback both sum (``summing``)."""

    def __init__(self, dense: DenseReduction, *, group: dist.ProcessGroup) -> None:
        assert dense.divides_by == 1, "a table's rows are scaled on their way in: its dense fallback must sum"
        self.dense, self.group = dense, group
        self._streak = DenseStreak()

    @property
    def gave_up(self) -> bool:
        return self._streak.gave_up

    def start(self, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> InFlight:
        if self.gave_up:
            return self.dense.start(bucket, buffer, is_last)
        return RowSparseInFlight(self, bucket, buffer, is_last)

    def observe(self, sparse: bool) -> None:
        self._streak.observe(sparse)


class RowSparseInFlight:
    """One iteration's reduction of one row-sparse bucket (``[rows, C]`` once viewed)."""

    pending_commit = True

    def __init__(self, reduction: RowSparseReduction, bucket: FlatBucket, buffer: torch.Tensor, is_last: bool) -> None:
        self._reduction, self._bucket, self._buffer, self._is_last = reduction, bucket, buffer, is_last
        self.table = buffer.view(bucket.spec.params[0].shape[0], -1)  # [rows, C]
        self.future: Any = None
        self.outcome: tuple[str, str] | None = None
        self.touched: int | None = None
        """Rows touched on some rank (known after ``commit``)."""
        self._dense: InFlight | None = None
        self._rows: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._mask = touched_rows_mask(self.table)  # [rows]
        self._lent = [lend(self._mask)]  # each collective's tensor: Note [A collective holds no Python object]
        with no_backward_context():
            self._mask_work = dist.all_reduce(self._lent[0], op=dist.ReduceOp.MAX, group=reduction.group, async_op=True)

    def commit(self) -> None:
        if self.outcome is not None:
            return
        self._mask_work.wait()
        rows = self._mask.nonzero().squeeze(1)  # [U], the same on every rank
        self.touched = rows.numel()
        sparse = goes_as_rows(self.touched, self.table.shape[0])
        self._reduction.observe(sparse)
        self.outcome = ("rows" if sparse else "dense", f"{self.touched}/{self.table.shape[0]}")
        if not sparse:
            self._dense = self._reduction.dense.start(self._bucket, self._buffer, self._is_last)
            self.future = self._dense.future
            return
        self._rows, self._packed = rows, self.table.index_select(0, rows)  # [U, C]
        if rows.numel() == 0:  # no rank touched a row: nothing to send (every rank knows it)
            self.future = torch.futures.Future()
            self.future.set_result([self._packed])
        else:
            self._lent.append(lend(self._packed))
            self.future = dist.all_reduce(self._lent[-1], group=self._reduction.group, async_op=True).get_future()

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def wait(self) -> torch.Tensor:
        assert self.outcome is not None, "wait() before commit()"
        if self._dense is not None:
            return self._dense.wait()
        self.future.wait()
        assert self._rows is not None and self._packed is not None
        self.table.zero_()
        self.table.index_copy_(0, self._rows, self._packed)  # all-reduced in place
        return self._buffer

    def let_go(self) -> None:
        self.future = self._mask_work = None  # ``future`` may be the dense all-reduce's: it holds the tensor it sent
        if self._dense is not None:  # the table went dense: graphddp's averaging all-reduce
            self._dense.let_go()
        for alias in self._lent:  # the mask's and the rows' collectives
            given_back(alias, "a row-sparse table's mask or rows")  # a constant: no string built per step
        self._lent = []
