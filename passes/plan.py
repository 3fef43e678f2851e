"""The bucket plan: which gradients travel together, in which order.

Note [Bucket plan]
~~~~~~~~~~~~~~~~~~
Gradients become ready during backward in roughly the reverse of the order in which the forward pass used the
parameters. A *bucket* is a group of gradients that is all-reduced as one flat tensor the moment its last
gradient is ready, so the network works while backward is still computing the earlier layers.

``plan_buckets`` takes the parameters **in the order their gradients are expected to become ready** and cuts
that order into buckets, each up to a byte cap (``BucketCaps``):

* one sequence per (dtype, device): a flat buffer holds a single dtype on a single device;
* the first bucket of each (dtype, device) is capped at ``caps.first`` (small, so the first all-reduce starts
  early);
* the caps ramp up from there and down again at the end (Note [Bucket ramps]), with ``caps.bucket`` in the
  middle: no bucket but the first of each (dtype, device) has a cap above ``caps.bucket``;
* with the ramps, a bucket is closed *before* a gradient would push it over its cap, so no bucket is larger than
  its cap unless a single parameter alone is (it then gets a bucket of its own); without them (PyTorch's layout,
  ``BucketCaps.closes_over_cap``) a bucket is closed *once* it holds its cap or more, as PyTorch's Reducer closes
  it, which lets buckets overshoot by up to one parameter;
* with a cap per bucket (``BucketCaps.sequence``, PyTorch's ``bucket_cap_mb_list``) the k-th bucket of each
  (dtype, device) in ready order is capped at the k-th entry, the last one repeating, and nothing ramps;
* buckets are numbered by the ready position of their first parameter: bucket 0 becomes ready first;
* every parameter's gradient is in exactly one bucket; besides, a tied embedding table may have *parts* (the
  contribution of one other use, ``ParamSpec.part``), each in a bucket no later than the table's own, and a
  row-sparse gradient (``ParamSpec.row_sparse``, Note [Row-sparse gradients] in ``passes/row_sparse.py``) and a
  ``torch.sparse`` gradient (``ParamSpec.sparse_grad``) are each alone in their bucket.

Note [Gradient pieces]
~~~~~~~~~~~~~~~~~~~~~~
A parameter larger than its bucket's cap fills a bucket of its own (with its bias, in a graph plan), and the
bucket's all-reduce can start only once the whole gradient is computed: an MLP's 64 MiB weight gradient keeps the
link idle through the whole matmul that makes it. Reduced in-graph (Note [In-graph reduction]), such a gradient
is sent in ``Bucket.pieces``: blocks of whole rows, each its own all-reduce (the bucket's small gradients, a
bias, with the first), the first about the bucket's cap. The blocks follow the ramps (Note [Bucket ramps]):

* in the first bucket and the head ramp's (``Bucket.blocks_grow_to``), the first block is the bucket's cap and
  each next one twice as large, up to the middle cap, the last what is left: the first still leaves early, and
  while each block travels the next, twice as large, is computed, as the buckets of the ramp are. Cut at the
  first cap alone, the bench GPT's 16 MiB head part went in 16 all-reduces of 1 MiB at the head of backward,
  each costing two ranks that share a CPU a worker's wake-up where a fast link did not need them
  (``docs/benchmarks.md``, session 22); it now goes in 5 (1, 2, 4, 8 and 1 MiB).
* in the tail ramp's buckets (``Bucket.blocks_shrink_from``), the first block is the bucket's cap, and the rest
  are the head's blocks in reverse: what is left of the doubling, then blocks halving from the middle cap down
  to the bucket's cap at the gradient's end. What is exposed after backward is the last block, as small as the
  bucket's cap, and from the largest block on a block travels while the next, half its size, is computed. Where
  that would take as many blocks as cutting at the cap (a gradient under about 4 caps), the blocks are the cap's.
  Cut in blocks of the tail's caps (4, 2 and 1 MiB), the bench MLP's weights took 65 all-reduces a step, which
  cost ~5 % of the step where the link did not bind (each a wake-up of both ranks' gloo workers, and each block a
  smaller, slower matmul; ``docs/benchmarks.md``, sessions 35 and 36); halving, they take 19 (4-7-25-16-8-4,
  2-7-25-16-8-4-2 and 1-8-4-2-1 MiB).
* in the middle (and without ramps), every block is about the bucket's own cap (``Bucket.cap_bytes``).

Each block costs the link's latency once more. ``graphddp.passes.compute_pieces_separately`` then computes each
block by its own matmul (a row block of a weight gradient ``dY^T X`` is ``dY[:, rows]^T X``), so
``launch_collectives_early`` sends block 1 while block 2 is computed. The blocks' gradients are the whole
gradient's rows, up to the order of floating-point sums inside the matmul; every rank cuts the same blocks, as
they follow from the agreed plan. Each block's matmul writes
its rows of the gradient, and the block is divided and all-reduced there (Note [Blocks written in place] in
``passes/blocks_in_place.py``); only the first block, sent with the bucket's small gradients, comes back in a
tensor of its own and is copied in once the last block is waited for: ``Bucket.assembled_bytes``, which the step
cost model charges there (``StepInputs.tail_per_bucket_s``, before the bucket's optimizer step). Copying every
block back instead (a ``cat``, as a functional graph spells it) cost the bench MLP 144 MiB of copies per step
into new memory, most of it hidden behind the later buckets' all-reduces (``docs/benchmarks.md``, session 18). The split strategy sends whole
gradients (its hooks see whole ones). Only a gradient that is one matmul's is cut (``ParamSpec.one_matmul``): a
tied table's whole gradient (a lookup's rows plus the head's matmul) or a convolution's is whole before any block
of it could go, and cutting it only adds collectives and copies (cutting the whole tied table of ``bench.overhead``'s
launch-bound GPT, 2 MiB over a 1 MiB cap, took in-graph reduction from 0.94 to 1.12 × PyTorch's compiled step). A
tied table's part (the output layer's matmul alone, Note [Row-sparse gradients]) is one matmul's, and is cut.

Note [Bucket ramps]
~~~~~~~~~~~~~~~~~~~
A bucket's all-reduce hides behind the backward of the layers that come after it in ready order (the earlier
layers of the model). Two places in backward have too little to hide behind, and PyTorch's layout (a 1 MiB
first bucket, then 25 MiB buckets to the end) leaves the network idle or exposed there:

* **the tail**: the last buckets have no backward left after them. Whatever they hold is all-reduced while
  every rank waits, and the iteration is that much longer (a 25 MiB last bucket is 100 ms at 2 Gbit/s, all of
  it exposed). So the caps ramp *down* towards the end: the bucket completed last holds at most ``caps.last``
  bytes, the one before at most twice that, and so on while below ``caps.bucket``. Each is launched as soon as
  its layers' backward is done; only the last small ones (and a large parameter that is ready last, such as a
  tied embedding) remain after backward.
* **the head**: after the small first bucket, a full-size second bucket launches only once all of its 25 MiB
  are computed, and the network idles meanwhile. So the caps ramp *up*: ``2 * caps.first``, ``4 *
  caps.first``, ... up to ``caps.bucket``. While each bucket's all-reduce runs, the next one, twice as large,
  computes, which keeps the network fed whenever communicating a byte takes at most twice as long as computing
  its gradient.

The order of cutting: the first bucket from the start, then the tail from the end, then the head ramp and the
middle on what is left. The price is a few more collectives (and, compiled, more graph segments): at the default
caps (25, 1, 1 MiB) up to four more at the head and five at the tail. ``BucketCaps(ramps=False)`` (DDP's
``bucket_ramps=False``) gives PyTorch's layout: its sequence of caps, each bucket closed once it holds its cap or
more as PyTorch's Reducer closes it (``BucketCaps.closes_over_cap``), so the same caps cut the same buckets; with
the ramps, every bucket stays within its cap.

The ramps step by bucket, not by bytes: a parameter larger than its slot's cap takes the slot alone, and the
next, doubled cap may then hold only a little (a 0.25 MB bucket between the 3 MB and 16 MB ones of the bench
GPT's tail). That is deliberate at the tail, where every layer's gradients should leave as soon as they are
ready, and costs one small collective at the head. With graph breaks, each captured graph is planned with its
own ramps (``compose_plans`` keeps them), so a break adds a few small buckets in the middle of backward.

Every rank must build the very same plan; ``BucketPlan.fingerprint`` is a digest of its content (parameter
names, shapes, dtypes and their grouping) that ranks compare instead of the plan itself.

The eager path calls ``plan_buckets`` with parameters in reverse registration order and again, once, with the
order observed in the first backward. The compile backend calls it with the order derived from the captured
graph. Both hand the resulting ``BucketPlan`` to the same Reducer: one plan, one code path.

This module is pure data: it imports nothing from ``torch.distributed`` and no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

MiB = 1024 * 1024

__all__ = ["MiB", "ParamSpec", "Bucket", "BucketCaps", "BucketPlan", "bucket_channel", "plan_buckets", "plan_bucket_groups"]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one trainable parameter, or about one part of its gradient."""

    name: str
    """Fully qualified name, as ``module.named_parameters()`` gives it."""
    shape: tuple[int, ...]
    """Shape of the parameter (and of its gradient)."""
    dtype: torch.dtype
    """Gradient dtype; a bucket holds one dtype only."""
    device: str
    """Device as a string (``"cpu"``, ``"cuda:0"``); a bucket lives on one device only."""
    part: str = ""
    """Empty for the gradient autograd accumulates into ``.grad``. Otherwise a *part*: the contribution of the
    graph node named here to a tied weight's gradient, reduced on its own as soon as that node's backward has
    run and added to the parameter's gradient afterwards (Note [Row-sparse gradients] in ``passes/row_sparse.py``)."""
    row_sparse: bool = False
    """The gradient is expected to touch few rows (an embedding table's): its bucket holds it alone, and the
    Reducer may reduce only the rows some rank touched (Note [Row-sparse gradients])."""
    sparse_grad: bool = False
    """Autograd gives this parameter a ``torch.sparse`` COO gradient (``nn.Embedding``/``nn.EmbeddingBag`` with
    ``sparse=True``): its bucket holds it alone and the Reducer averages it as a sparse tensor, as PyTorch's DDP
    does (graphddp through dense all-gathers: Note [Sparse gradients, gathered] in ``graphddp.runtime.reductions``) (``sparse_gradient_params`` in ``passes/row_sparse.py`` says which)."""
    one_matmul: bool = False
    """Its gradient is one matmul's: the only use in the captured graph that sends a gradient back is a linear or
    matmul (``find_graph_params``), or, for a part, its use is (``part_at``); False in eager plans. Only such a gradient is sent in pieces, each block
    computed by a matmul of its own (Note [Gradient pieces]); another one (a tied table's sum of a lookup and a
    matmul, a convolution's) would only be sliced after it is whole: more collectives, no earlier start."""

    @property
    def alone(self) -> bool:
        """The planner gives this gradient a bucket of its own (row-sparse or a sparse tensor)."""
        return self.row_sparse or self.sparse_grad

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def nbytes_in(self, wire: torch.dtype | None) -> int:
        """Bytes of this gradient as sent in ``wire``, the dtype a compressing comm hook casts it to (None: its own)."""
        return self.nbytes if wire is None else self.numel * _itemsize(wire)

    @property
    def key(self) -> tuple[str, str]:
        """What identifies a slot of the plan: a parameter has one whole gradient and at most one part per node."""
        return (self.name, self.part)

    @property
    def label(self) -> str:
        """``name``, ``name@node`` for a part, ``name[rows]`` for a row-sparse gradient, ``name[sparse]`` for a
        sparse tensor (tables and errors)."""
        if self.part:
            return f"{self.name}@{self.part}"
        return f"{self.name}[rows]" if self.row_sparse else f"{self.name}[sparse]" if self.sparse_grad else self.name

    @classmethod
    def of(
        cls,
        name: str,
        tensor: torch.Tensor,
        *,
        row_sparse: bool = False,
        sparse_grad: bool = False,
        dtype: torch.dtype | None = None,
    ) -> ParamSpec:
        """The spec of ``tensor``; ``dtype``: the bucket's, when the gradient is reduced in another dtype than the
        tensor's (``mixed_precision``'s ``reduce_dtype``)."""
        assert not (row_sparse and sparse_grad), f"{name}: a sparse gradient is not reduced as rows"
        return cls(
            name, tuple(tensor.shape), dtype or tensor.dtype, str(tensor.device), row_sparse=row_sparse, sparse_grad=sparse_grad
        )

    def part_at(self, node: str, *, one_matmul: bool = False) -> ParamSpec:
        """The part of this parameter's gradient that graph node ``node`` contributes (``one_matmul``: by one
        matmul, so it may go in pieces in-graph, as the output layer's part of a tied table)."""
        return dataclasses.replace(self, part=node, row_sparse=False, one_matmul=one_matmul)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketCaps:
    """Byte caps of the buckets (Note [Bucket plan], Note [Bucket ramps])."""

    bucket: int = 25 * MiB
    """Cap of the buckets in the middle of backward (PyTorch's ``bucket_cap_mb``)."""
    first: int = MiB
    """Cap of the first bucket of each dtype/device: small, so the first all-reduce starts early. The caps after
    it double up to ``bucket`` (Note [Bucket ramps])."""
    last: int = MiB
    """Cap of the last bucket of each dtype/device; the caps before it double up to ``bucket``, so the
    all-reduces left after backward are small (Note [Bucket ramps])."""

    ramps: bool = True
    """Ramp the caps up after the first bucket and down to ``last`` at the end (Note [Bucket ramps]). False
    gives PyTorch's layout: the first bucket, then buckets of ``bucket`` to the end, each closed as PyTorch's
    Reducer closes it (``closes_over_cap``)."""

    sequence: tuple[int, ...] = ()
    """Every bucket's cap, in ready order (PyTorch's ``bucket_cap_mb_list``): bucket ``k`` of each dtype/device
    is capped at ``sequence[k]``, the last entry repeating; ``bucket``, ``first``, ``last`` and ramps are then
    unused for cutting (``from_list_mb`` keeps them consistent). Empty: the caps above."""

    def __post_init__(self) -> None:
        if not isinstance(self.ramps, bool):
            raise TypeError(f"BucketCaps.ramps must be True or False, got {self.ramps!r}")
        if isinstance(self.sequence, list):  # as JSON gives it back
            object.__setattr__(self, "sequence", tuple(self.sequence))
        if not isinstance(self.sequence, tuple) or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in self.sequence):
            raise ValueError(f"BucketCaps.sequence must be a tuple of byte counts > 0, got {self.sequence!r}")
        for name in ("bucket", "first", "last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"BucketCaps.{name} must be a whole number of bytes, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"BucketCaps.{name} must be > 0 bytes, got {value}")

    @classmethod
    def from_mb(
        cls, bucket_cap_mb: float, first_bucket_cap_mb: float, last_bucket_cap_mb: float, *, ramps: bool = True
    ) -> BucketCaps:
        """Caps given in MiB, as users write them (``bucket_cap_mb=25``); validated here. 0 is accepted as PyTorch's
        DDP accepts it: a cap of one byte, so every gradient closes its bucket (a bucket per gradient)."""
        values = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb, "last_bucket_cap_mb": last_bucket_cap_mb}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's numbers too, as from a config
                raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__} {value!r}")
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of MiB >= 0 (0: a bucket per gradient), got {value!r}")
        bucket, first, last = (max(1, int(v * MiB)) for v in values.values())
        return cls(bucket=bucket, first=first, last=last, ramps=ramps)

    @classmethod
    def from_list_mb(cls, caps_mb: Sequence[float]) -> BucketCaps:
        """PyTorch's ``bucket_cap_mb_list``: every bucket's cap in MiB, in ready order (the last one repeats)."""
        if isinstance(caps_mb, (str, bytes)) or not isinstance(caps_mb, Sequence) or not caps_mb:
            raise ValueError(f"bucket_cap_mb_list must be a non-empty list of MiB, got {caps_mb!r}")
        for value in caps_mb:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"bucket_cap_mb_list entries must be numbers of MiB, got {type(value).__name__} {value!r}")
            if not 0 <= value < float("inf"):
                raise ValueError(f"bucket_cap_mb_list entries must be finite numbers of MiB >= 0, got {value!r}")
        sequence = tuple(max(1, int(v * MiB)) for v in caps_mb)
        return cls(bucket=max(sequence), first=sequence[0], last=sequence[-1], ramps=False, sequence=sequence)

    @property
    def mb(self) -> str:
        """The caps as users write them: ``bucket/first/last`` in MiB (every bucket's, for a ``sequence``)."""
        caps = self.sequence or (self.bucket, self.first, self.last)
        return "/".join(f"{c / MiB:g}" for c in caps)

    @property
    def closes_over_cap(self) -> bool:
        """A bucket closes once it holds its cap or more (its last gradient may take it over the cap), as PyTorch's
        Reducer and DDPOptimizer close theirs: PyTorch's layout (no ramps, or a cap per bucket), so that the same
        caps cut the same buckets. With ramps, a bucket never exceeds its cap (a gradient larger than its cap
        goes alone), which the ramps' steps are reckoned in (Note [Bucket ramps])."""
        return not self.ramps

    def ramp(self, start: int) -> Iterator[int]:
        """``start``, doubling, while below ``bucket``: the caps of a ramp (Note [Bucket ramps]); none without
        ramps."""
        if not self.ramps:
            return
        cap = start
        while cap < self.bucket:
            yield cap
            cap *= 2


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One group of gradients reduced together, laid out in ``params`` order in one flat buffer."""

    index: int
    """Launch position: bucket ``k`` is always launched before bucket ``k + 1`` on every rank."""
    params: tuple[ParamSpec, ...]
    """Parameters in the order of their slices in the flat buffer (their expected ready order)."""
    cap_bytes: int
    """The cap this bucket was filled up to."""
    blocks_grow_to: int | None = None
    """Set on the first bucket and the head ramp's (Note [Bucket ramps]): the blocks its big gradient is sent in,
    reduced in-graph (Note [Gradient pieces]), double from ``cap_bytes`` up to this many bytes, as the buckets
    after it would. None: every block about ``cap_bytes``, or as ``blocks_shrink_from`` says."""
    blocks_shrink_from: int | None = None
    """Set on the tail ramp's buckets (Note [Bucket ramps]): the blocks its big gradient is sent in, reduced
    in-graph (Note [Gradient pieces]), after a first block of ``cap_bytes``, halve from this many bytes down to
    ``cap_bytes`` at the gradient's end, as the buckets of the tail do. None: as ``blocks_grow_to`` says."""

    def __post_init__(self) -> None:
        assert self.blocks_grow_to is None or self.blocks_shrink_from is None, "a bucket's blocks grow or shrink, not both"

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> str:
        return self.params[0].device

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        """Labels of its slots (``ParamSpec.label``): parameter names, marked when a part or row-sparse."""
        return tuple(p.label for p in self.params)

    @property
    def pieces(self) -> tuple[int, tuple[int, ...]] | None:
        """How its gradients are reduced in pieces, compiled in-graph (Note [Gradient pieces]): (the position in
        ``params`` of a dense parameter of two or more dimensions that alone is larger than the cap and whose
        gradient is one matmul's (``ParamSpec.one_matmul``), the rows of
        each block it is cut into), or None for one piece. ``ceil(bytes / cap)`` blocks of whole rows (dim 0), as
        equal as rows allow, or blocks that grow up to ``blocks_grow_to``, or fewer that shrink from
        ``blocks_shrink_from``; the bucket's other (small) gradients travel with the first block."""
        cut = self._blocks()
        return None if cut is None else (cut[0], cut[2])

    @property
    def blocks_layout(self) -> str | None:
        """How ``pieces`` cut the big gradient (Note [Gradient pieces]): ``"growing"`` (the head ramp's),
        ``"shrinking"`` (the tail ramp's), ``"even"`` (blocks of the cap), or None in one piece."""
        cut = self._blocks()
        return None if cut is None else cut[1]

    def _blocks(self) -> tuple[int, str, tuple[int, ...]] | None:
        """The big gradient's position, its blocks' layout and their rows (``pieces``, ``blocks_layout``)."""
        big = [
            k for k, p in enumerate(self.params)
            if p.nbytes > self.cap_bytes and len(p.shape) >= 2 and p.shape[0] >= 2 and p.one_matmul
            and not (p.row_sparse or p.sparse_grad)
        ]  # fmt: skip
        if len(big) != 1:
            return None
        p = self.params[big[0]]
        row_bytes = p.nbytes // p.shape[0]
        if self.blocks_grow_to is not None:
            return big[0], "growing", _growing_blocks(p.shape[0], row_bytes, self.cap_bytes, self.blocks_grow_to)
        count = min(-(-p.nbytes // self.cap_bytes), p.shape[0])
        rows, extra = divmod(p.shape[0], count)
        equal = tuple(rows + (1 if k < extra else 0) for k in range(count))
        if self.blocks_shrink_from is not None:
            shrinking = _shrinking_blocks(p.shape[0], row_bytes, self.cap_bytes, self.blocks_shrink_from)
            if len(shrinking) < len(equal):
                return big[0], "shrinking", shrinking
        return big[0], "even", equal

    @property
    def piece_bytes(self) -> tuple[int, ...]:
        """Bytes of each all-reduce this bucket takes in-graph: the whole bucket, or one per block of its big
        gradient, the bucket's other gradients with block 0 (as ``_average_in_pieces`` sends them)."""
        if self.pieces is None:
            return (self.nbytes,)
        big, rows = self.pieces
        per_row = self.params[big].nbytes // sum(rows)
        return (self.nbytes - per_row * sum(rows[1:]), *(per_row * r for r in rows[1:]))

    def piece_stepped_bytes(self, *, blocks_in_place: bool = True) -> tuple[int, ...]:
        """Per all-reduce of ``piece_bytes``: the bytes of parameters an optimizer stepping in backward steps once
        it is in (Note [Steps by rows] in ``graphddp/runtime/row_steps.py``): the big gradient's rows each block
        lets step (``piece_rows_stepped_bytes``), the last block also the bucket's other parameters, which its step
        node steps after it. A tied table's part steps with its table, not here."""
        stepped = sum(p.nbytes for p in self.params if not p.part)
        if self.pieces is None:
            return (stepped,)
        early = self.piece_rows_stepped_bytes(blocks_in_place=blocks_in_place)[:-1]
        return (*early, stepped - sum(early))

    def piece_rows_stepped_bytes(self, *, blocks_in_place: bool = True) -> tuple[int, ...]:
        """Per all-reduce of ``piece_bytes`` (a bucket in pieces): the bytes of the big gradient's rows an optimizer
        stepping in backward steps once it is in. With the blocks written in place (Note [Blocks written in
        place]), each block its own rows; not in place (``blocks_in_place=False``: cast for the wire by a
        compressing comm hook), every row with the last block; none for a tied table's part."""
        assert self.pieces is not None, "only a bucket in pieces has blocks"
        big, rows = self.pieces
        if self.params[big].part:
            return (0,) * len(rows)
        per_row = self.params[big].nbytes // sum(rows)
        early = [per_row * r if blocks_in_place else 0 for r in rows[:-1]]
        return (*early, self.params[big].nbytes - sum(early))

    def blocks_in_place(self, wire: torch.dtype | None) -> bool:
        """Are this bucket's blocks written in place (Note [Blocks written in place]) when it is sent in ``wire``
        (a compressing comm hook's dtype; None: its own)? Not where they are cast for the wire: those are copied
        back, every one, after the last (``write_blocks_in_place`` leaves a cast block to ``wait_blocks_``)."""
        return wire is None or wire == self.dtype

    @property
    def assembled_bytes(self) -> int:
        """Bytes copied into its big gradient once the last block is in, reduced in-graph: the first block's, which
        travels with the bucket's small gradients; the other blocks are written in place (Note [Blocks written in
        place] in ``passes/blocks_in_place.py``). 0 without pieces."""
        if self.pieces is None:
            return 0
        big, rows = self.pieces
        return self.params[big].nbytes // sum(rows) * rows[0]

    @property
    def in_graph_collectives(self) -> int:
        """All-reduces this bucket takes when reduced in-graph: one, or one per block (Note [Gradient pieces])."""
        pieces = self.pieces
        return 1 if pieces is None else len(pieces[1])

    @property
    def row_sparse(self) -> bool:
        """The bucket is one row-sparse gradient (the planner keeps those alone)."""
        return len(self.params) == 1 and self.params[0].row_sparse

    @property
    def sparse_grad(self) -> bool:
        """The bucket is one ``torch.sparse`` gradient (``ParamSpec.sparse_grad``; alone, too)."""
        return len(self.params) == 1 and self.params[0].sparse_grad


def _growing_blocks(rows: int, row_bytes: int, first: int, largest: int) -> tuple[int, ...]:
    """Rows of each block of a gradient of ``rows`` rows cut under the head ramp: about ``first`` bytes, then
    twice as many each time up to ``largest``, the last block what is left (Note [Gradient pieces]). Rows of
    ``row_bytes`` each."""
    blocks: list[int] = []
    cap = first
    while rows > sum(blocks):
        blocks.append(min(rows - sum(blocks), max(1, cap // row_bytes)))
        cap = min(2 * cap, largest)
    return tuple(blocks)


def _shrinking_blocks(rows: int, row_bytes: int, last: int, largest: int) -> tuple[int, ...]:
    """Rows of each block cut under the tail ramp: about ``last`` bytes first (the block sent with the bucket's
    small gradients, and copied into the gradient at the end: kept small), then the rest as ``_growing_blocks``
    cuts it, in reverse: what is left, then halving from ``largest`` down to about ``last`` bytes at the end
    (Note [Gradient pieces])."""
    first = min(rows - 1, max(1, last // row_bytes))
    return (first, *_growing_blocks(rows - first, row_bytes, last, largest)[::-1])


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The bucket plan shared by the graph split and the Reducer (see Note [Bucket plan])."""

    buckets: tuple[Bucket, ...]
    """Buckets in launch order."""
    caps: BucketCaps
    """The caps the buckets were filled up to."""
    source: str = "registration"
    """Where the order came from: ``"registration"``, ``"ready-order"`` or ``"graph"`` (for logs and dumps)."""

    def __post_init__(self) -> None:
        seen: dict[tuple[str, str], int] = {}
        for k, bucket in enumerate(self.buckets):
            assert bucket.index == k, f"bucket {bucket.index} stored at position {k}"
            assert bucket.params, f"bucket {k} is empty"
            assert not any(p.alone for p in bucket.params) or len(bucket.params) == 1, f"bucket {k}: a gradient planned alone shares it"
            for p in bucket.params:
                assert p.key not in seen, f"{p.label} planned twice"
                assert (p.dtype, p.device) == (bucket.dtype, bucket.device), f"bucket {k} mixes dtypes/devices"
                seen[p.key] = k
        for (name, part), k in seen.items():
            # A part is added into the whole gradient once both are reduced: its bucket must not come later.
            assert not part or seen.get((name, ""), -1) >= k, f"part {name}@{part} (bucket {k}) without a whole gradient in it or after it"

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every parameter once (its whole gradient's slot), in bucket order; parts are not listed."""
        return tuple(p.name for b in self.buckets for p in b.params if not p.part)

    @property
    def parts(self) -> tuple[ParamSpec, ...]:
        """The parts of tied weights' gradients (``ParamSpec.part``), in bucket order."""
        return tuple(p for b in self.buckets for p in b.params if p.part)

    @property
    def row_sparse_tables(self) -> tuple[str, ...]:
        """The tables reduced as rows (``Bucket.row_sparse``: each alone in its bucket), in bucket order."""
        return tuple(b.params[0].name for b in self.buckets if b.row_sparse)

    def without_rows(self, names: Iterable[str]) -> BucketPlan:
        """This plan with the tables ``names`` reduced dense: their parts dropped (buckets left empty go, the
        rest are renumbered), their row-sparse mark cleared (Note [Row-sparse gradients])."""
        names = set(names)
        kept = []
        for b in self.buckets:
            params = tuple(
                dataclasses.replace(p, row_sparse=False) if p.name in names else p
                for p in b.params
                if not (p.part and p.name in names)
            )
            if params:
                kept.append(dataclasses.replace(b, index=len(kept), params=params))
        return BucketPlan(tuple(kept), self.caps, self.source)

    def bucket_of(self, name: str, part: str = "") -> int:
        for b in self.buckets:
            if any(p.key == (name, part) for p in b.params):
                return b.index
        raise KeyError(f"{name!r}{f' part {part!r}' if part else ''} is in no bucket of this plan")

    def coverage_problem(self, names: Iterable[str]) -> str | None:
        """Why this plan cannot serve a Reducer of the parameters ``names``, or None when it holds each once."""
        names = sorted(names)
        if sorted(self.param_names) == names:
            return None
        missing = sorted(set(names) - set(self.param_names))
        extra = sorted(set(self.param_names) - set(names))
        return (
            "bucket plan does not cover the trainable parameters exactly: "
            f"missing {missing[:5]}, unknown {extra[:5]}. A plan must hold every trainable parameter once."
        )

    @property
    def fingerprint(self) -> str:
        """A short digest of the grouping; equal on every rank that built the same plan."""
        h = hashlib.sha256()
        for b in self.buckets:
            h.update(f"[{b.index}]".encode())
            for p in b.params:
                h.update(f"{p.name}:{p.shape}:{p.dtype}:{p.device}:{p.part}:{int(p.row_sparse)}:{int(p.sparse_grad)};".encode())
        return h.hexdigest()[:16]

    def describe(self) -> list[tuple[str, str]]:
        """One ``(bucket, content)`` line per bucket, used to name the first differing bucket between ranks."""
        return [(f"bucket {b.index}", ", ".join(f"{p.label}{list(p.shape)}" for p in b.params)) for b in self.buckets]

    def table_rows(self) -> list[list[object]]:
        """Rows for a tabulate table: index, bytes, parameter count, dtype, device, names."""
        return [
            [b.index, b.nbytes, len(b.params), dtype_name(b.dtype), b.device, ", ".join(b.names)]
            for b in self.buckets
        ]

    TABLE_HEADERS = ("bucket", "bytes", "params", "dtype", "device", "parameters")


def plan_buckets(
    params_in_ready_order: Iterable[ParamSpec],
    *,
    caps: BucketCaps,
    source: str = "registration",
) -> BucketPlan:
    """Group parameters into buckets, see Note [Bucket plan].

    ``params_in_ready_order`` lists the parameters in the order their gradients are expected to be ready.
    """
    return plan_bucket_groups([[p] for p in params_in_ready_order], caps=caps, source=source)


def plan_bucket_groups(
    groups_in_ready_order: Iterable[Sequence[ParamSpec]],
    *,
    caps: BucketCaps,
    source: str = "graph",
) -> BucketPlan:
    """Like ``plan_buckets``, but the parameters of a group always share a bucket (per dtype and device).

    The graph planner groups parameters by the node that first uses them: they become ready together, so
    separating them could not make either bucket ready earlier. A gradient planned alone (``ParamSpec.alone``:
    row-sparse, or a sparse tensor) leaves its group and gets a bucket of its own, at the same place in the order.
    """
    if not isinstance(caps, BucketCaps):
        raise TypeError(f"caps must be a BucketCaps, got {type(caps).__name__}")
    groups = [
        split
        for g in groups_in_ready_order
        for split in ([p for p in g if not p.alone], *([p] for p in g if p.alone))
        if split
    ]
    keys = [p.key for g in groups for p in g]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"parameter {dup[0]!r}{f' part {dup[1]!r}' if dup[1] else ''} appears twice in the planning order")

    # One lane per (dtype, device), in ready order; a group's members of one lane stay together.
    lanes: dict[tuple[torch.dtype, str], list[list[ParamSpec]]] = {}
    for group in groups:
        by_key: dict[tuple[torch.dtype, str], list[ParamSpec]] = {}
        for p in group:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        for key, members in by_key.items():
            lanes.setdefault(key, []).append(members)
    cut = [bucket for lane in lanes.values() for bucket in _cut_lane(lane, caps)]

    # Bucket 0 is the one whose first gradient is ready first (see the Note).
    position = {key: i for i, key in enumerate(keys)}
    cut.sort(key=lambda item: position[item[0][0].key])
    buckets = tuple(Bucket(k, tuple(params), cap, grows, shrinks) for k, (params, cap, grows, shrinks) in enumerate(cut))
    return BucketPlan(buckets, caps, source)


Cut = tuple[list[ParamSpec], int, int | None, int | None]
"""One bucket as ``_cut_lane`` cuts it: its parameters, its cap, ``Bucket.blocks_grow_to`` and
``Bucket.blocks_shrink_from``."""


def _cut_lane(items: list[list[ParamSpec]], caps: BucketCaps) -> list[Cut]:
    """One lane's buckets in ready order (Note [Bucket ramps]): the first bucket, then the tail filled from the
    end, then the head ramp and the middle on what is left in between; or, with a cap per bucket
    (``caps.sequence``), bucket after bucket in ready order. The first bucket and the head ramp's let a big
    gradient's blocks grow as the ramp does (``Bucket.blocks_grow_to``), the tail's shrink as it does
    (``Bucket.blocks_shrink_from``)."""
    over = caps.closes_over_cap
    if caps.sequence:
        cut: list[Cut] = []
        for cap in itertools.chain(caps.sequence, itertools.repeat(caps.sequence[-1])):
            if not items:
                return cut
            n = _fitting(items, cap, over=over)
            cut.append((_flat(items[:n]), cap, None, None))
            items = items[n:]
    grows = caps.bucket if caps.ramps and caps.first < caps.bucket else None
    n = _fitting(items, caps.first, over=over)
    first, rest = (_flat(items[:n]), caps.first, grows, None), items[n:]
    tail: list[Cut] = []
    for cap in caps.ramp(caps.last):  # the last bucket first
        if not rest:
            break
        n = _fitting(rest[::-1], cap)
        tail.insert(0, (_flat(rest[len(rest) - n :]), cap, None, caps.bucket))
        rest = rest[: len(rest) - n]
    head: list[Cut] = []
    ramp = list(caps.ramp(2 * caps.first))
    for cap in itertools.chain(ramp, itertools.repeat(caps.bucket)):
        if not rest:
            break
        n = _fitting(rest, cap, over=over)
        head.append((_flat(rest[:n]), cap, caps.bucket if len(head) < len(ramp) else None, None))
        rest = rest[n:]
    return [first, *head, *tail]


def _fitting(items: Sequence[list[ParamSpec]], cap: int, *, over: bool = False) -> int:
    """How many leading items fit in ``cap`` bytes; at least one (a parameter larger than the cap goes alone).
    ``over`` (``BucketCaps.closes_over_cap``): as many as it takes to hold ``cap`` bytes or more, the last one
    perhaps taking the bucket over its cap, as PyTorch's Reducer fills a bucket. A gradient planned alone
    (``ParamSpec.alone``) is always alone."""
    if items[0][0].alone:
        return 1
    total = 0
    for n, members in enumerate(items):
        if members[0].alone or (over and total >= cap):
            return n
        total += sum(p.nbytes for p in members)
        if total > cap and n > 0 and not over:
            return n
    return len(items)


def _flat(items: Sequence[list[ParamSpec]]) -> list[ParamSpec]:
    return [p for members in items for p in members]


def dtype_name(dtype: Any) -> str:
    """A dtype as the plan's table, the dump and the records write it: ``"float32"``."""
    return str(dtype).replace("torch.", "")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bucket_channel(index: int, channels: int) -> int:
    """The channel (process group) bucket ``index`` is reduced on when a DDP reduces on ``channels`` of them:
    round robin in plan order, so every rank issues each group's collectives in the same order (Note [Channels]
    in ``graphddp/runtime/channels.py``). The one rule the Reducer and the in-graph reduction both follow."""
    assert channels >= 1, channels
    return index % channels


def first_difference_across(rows_per_rank: Sequence[Sequence[Any]], missing: Any) -> tuple[int, list[Any]] | None:
    """Where the ranks' lists first disagree: ``(index, every rank's entry there)``, ``missing`` standing for the
    entry of a list that is too short; None when all lists are equal. Used to name the first differing parameter
    or bucket in errors raised on every rank."""
    longest = max((len(rows) for rows in rows_per_rank), default=0)
    for i in range(longest):
        entries = [rows[i] if i < len(rows) else missing for rows in rows_per_rank]
        if any(e != entries[0] for e in entries):
            return i, entries
    return None


def compose_plans(
    graph_plans_in_forward_order: Sequence[BucketPlan],
    rest_in_ready_order: Sequence[ParamSpec],
    *,
    caps: BucketCaps,
) -> BucketPlan:
    """One plan for a forward that runs several captured graphs (graph breaks).

    Graphs run in forward order and their backwards in reverse, so the composite takes their buckets last graph
    first, renumbered. A parameter several graphs use (a weight tied across a graph break) belongs to the graph
    that runs first in forward: its gradient completes only when that graph's backward has run (Note [Earliest
    use]); later graphs drop it. They keep their parts of it (Note [Row-sparse gradients]): those are reduced
    before the whole gradient, which is what the plan requires. Of two parts with the same key, one slot is kept
    (the first graph's): in backward the later graph's tap fills it, and the first graph's tap, finding it taken,
    lets its gradient through to ``.grad``. Either way every contribution is counted once.
    Parameters no graph covers (used eagerly) follow, planned from ``rest_in_ready_order``.
    """
    claimed: set[tuple[str, str]] = set()
    kept: list[list[Bucket]] = []
    for plan in graph_plans_in_forward_order:
        buckets = [dataclasses.replace(b, params=tuple(p for p in b.params if p.key not in claimed)) for b in plan.buckets]
        kept.append([b for b in buckets if b.params])
        claimed |= {p.key for b in plan.buckets for p in b.params}
    rest = [p for p in rest_in_ready_order if p.key not in claimed]
    eager = plan_buckets(rest, caps=caps) if rest else None
    groups = [bucket for graph in reversed(kept) for bucket in graph]
    groups += list(eager.buckets) if eager else []
    buckets = tuple(dataclasses.replace(b, index=k) for k, b in enumerate(groups))
    return BucketPlan(buckets, caps, source="graph")
