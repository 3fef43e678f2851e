"""Reduce an embedding table's gradient as the rows some rank touched (Note [Row-sparse gradients] in
``passes/rows.py``, which also says which buckets qualify).

Two collectives per bucket, both issued from the thread that runs backward, in an order every rank shares:

* ``RowSparseLaunch.begin``: which rows does this rank's gradient touch? A ``[rows]`` byte mask, max-reduced on
  the Reducer's side group (off the main group, where the buckets' all-reduces queue);
* ``RowSparseLaunch.finish``: with the union known, the main group all-reduces the touched rows only, packed;
  or, when the union is over ``MAX_DENSITY`` of the rows (gradients accumulated under ``no_sync``, say), the
  whole bucket through the default hook. The Reducer calls ``finish`` before it launches the next bucket, or
  at the end of backward, so the main group sees the same sequence of collectives on every rank. ``finish``
  waits for the mask: for a table in the middle of backward (an untied table used late in forward) that is
  one small round trip in which backward pauses; a table used first in forward is the last bucket, and
  nothing waits.
* ``RowSparseLaunch.unpack``, on the thread that awaits the bucket: the reduced rows back into the zeroed
  table. (Not in a future callback: that would run on gloo's thread, ahead of its next collective.)

The outcome depends only on the all-reduced mask, so every rank takes the same branch. A table that turns out
dense costs a scan and a mask of one byte per row more than a plain all-reduce; one that went dense
``DENSE_STREAK_LIMIT`` times in a row (a position embedding, or a table whose gradients are always accumulated
over several micro-batches) is reduced dense from then on, until the plan changes: again a decision every rank
makes alike, from the same outcomes. (The Reducer then also drops the table's parts, which would otherwise
travel on top of the dense table.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .passes import ROW_SPARSE_MAX_DENSITY as MAX_DENSITY

DENSE_STREAK_LIMIT = 2
"""After this many dense outcomes in a row, a bucket is reduced dense without trying (until the plan changes)."""


class RowSparseLaunch:
    """One iteration's reduction of one row-sparse bucket (a 2-D gradient, ``[rows, row_numel]`` once viewed)."""

    def __init__(self, buffer: torch.Tensor, rows: int, *, group: dist.ProcessGroup, mask_group: dist.ProcessGroup) -> None:
        self.buffer = buffer
        self.table = buffer.view(rows, -1)  # [rows, C]
        self._group = group
        self._mask_group = mask_group
        self._mask: torch.Tensor | None = None
        self._mask_work: dist.Work | None = None
        self._rows: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self.touched: int | None = None
        """Rows touched on some rank (known after ``finish``)."""

    def begin(self) -> None:
        # |x| max per row is 0 exactly for untouched rows; a NaN row stays "touched" (NaN != 0), so NaNs travel.
        self._mask = self.table.abs().amax(dim=1).ne(0).to(torch.uint8)  # [rows]
        self._mask_work = dist.all_reduce(self._mask, op=dist.ReduceOp.MAX, group=self._mask_group, async_op=True)

    def finish(self, dense: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """Issue the main-group collective and return its future: of the packed rows, or, when too many rows
        are touched, of ``dense()`` (the bucket through the default hook). Pass its value to ``unpack``."""
        assert self._mask is not None and self._mask_work is not None, "finish() before begin()"
        self._mask_work.wait()
        self._rows = self._mask.nonzero().squeeze(1)  # [U], the same on every rank
        self.touched = self._rows.numel()
        if not self.sparse:
            return dense()
        self._packed = self.table.index_select(0, self._rows)  # [U, C]
        if self.touched == 0:  # no rank touched a row: nothing to send (every rank knows it)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([self._packed])
            return done
        return dist.all_reduce(self._packed, group=self._group, async_op=True).get_future()

    def unpack(self, value: object) -> object:
        """The reduced bucket, from what ``finish``'s future resolved to."""
        if not self.sparse:
            return value
        assert self._rows is not None and self._packed is not None
        self.table.zero_()
        self.table.index_copy_(0, self._rows, self._packed)  # all-reduced in place
        return self.buffer

    @property
    def sparse(self) -> bool:
        assert self.touched is not None
        return self.touched <= MAX_DENSITY * self.table.shape[0]


class RowSparsePolicy:
    """Which row-sparse buckets still try rows: all, until one goes dense ``DENSE_STREAK_LIMIT`` times in a row."""

    def __init__(self) -> None:
        self._dense_streak: dict[int, int] = {}

    def wants(self, bucket_index: int) -> bool:
        return self._dense_streak.get(bucket_index, 0) < DENSE_STREAK_LIMIT

    def observe(self, bucket_index: int, sparse: bool) -> bool:
        """Record one outcome; True when it made the bucket give up rows."""
        self._dense_streak[bucket_index] = 0 if sparse else self._dense_streak.get(bucket_index, 0) + 1
        return self._dense_streak[bucket_index] == DENSE_STREAK_LIMIT
