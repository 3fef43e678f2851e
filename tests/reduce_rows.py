"""Drive ``RowSparseReduction`` on one table the way the launcher does (start, commit, wait), for the one-process
and the two-rank tests of the two-step reduction."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from graphddp.passes import BucketCaps, ParamSpec, plan_buckets
from graphddp.runtime.buckets import FlatBucket
from graphddp.runtime.reductions import CommHook, RowSparseInFlight, RowSparseReduction, dense_reduction


def reduce_rows(table: torch.Tensor) -> tuple[torch.Tensor, RowSparseInFlight]:
    """``table`` reduced on the world group, its mask too (dense fallback: the plain sum)."""
    spec = plan_buckets([ParamSpec.of("t", table, row_sparse=True)], caps=BucketCaps(bucket=2048, first=1024, last=512)).buckets[0]
    bucket = FlatBucket(spec, [nn.Parameter(table.clone())], [0])
    summed = CommHook(None, lambda state, b: dist.all_reduce(b.buffer(), async_op=True).get_future(), custom=True)
    dense = dense_reduction(summed, dist.group.WORLD, dist.get_rank())
    reduction = RowSparseReduction(dense, group=dist.group.WORLD)
    in_flight = reduction.start(bucket, table.view(-1), is_last=True)
    in_flight.commit()
    return in_flight.wait().view_as(table), in_flight
