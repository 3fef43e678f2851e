"""An embedding table's rows, reduced inside the compiled backward: the op the in-graph strategy's rows node calls.

Note [Rows in the compiled backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which rows travel is known only at run time: the union, over the ranks, of the rows each rank's batch touched
(Note [Row-sparse gradients] in ``graphddp/passes/row_sparse.py``). No functional collective can trace that, but
an opaque op can run it: ``graphddp::reduce_rows(grad, group_name, divisor)`` takes a table's gradient (the
lookups' contribution, ``[rows, C]``), max-reduces the byte mask of the rows it touches, and all-reduces the touched
rows only, packed, divided by ``divisor`` first as the in-graph buckets are; or the whole table, when the union
is over ``ROW_SPARSE_MAX_DENSITY`` of the rows (``goes_as_rows``, the Reducer's rule). It returns the averaged
table, zero outside the rows. Both collectives are issued and waited inside the op, on the bucket's channel.

* **Same order on every rank**: the op is a node of the compiled backward, which every rank compiled from the
  same graph, so it issues its two collectives at the same place among the functional all-reduces everywhere; a
  process group runs its collectives in the order they were issued, so the mask waits behind the buckets still
  on the link. A table used first in forward is the last bucket: nothing is left to compute behind that wait.
* **Tied tables**: the in-graph ``RowsAllReduce`` (``graphddp/compiler/in_graph.py``) also carries the parts (the
  output layer's contribution, reduced early in a bucket of its own) and adds their average to the rows': the
  parameter's gradient leaves the graph whole and averaged, as from the Reducer.
* **Not kept**: the Reducer's streak (a table that goes dense ``DENSE_STREAK_LIMIT`` times in a row gives up rows
  and its parts); in-graph the mask's round trip is paid each step. ``rows_pay`` plans rows only where the table is
  large against the rows a batch can touch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .reductions import goes_as_rows, touched_rows_mask

ROWS_OP = "graphddp::reduce_rows"


@torch.library.custom_op(ROWS_OP, mutates_args=())
def reduce_rows(grad: torch.Tensor, group_name: str, divisor: int) -> torch.Tensor:
    """``grad`` (``[rows, ...]``) averaged over the group ``group_name``, sent as the rows some rank touched (see
    the Note); a new tensor of ``grad``'s shape, zero in the rows no rank touched."""
    group = _resolve_process_group(group_name)
    table = grad.reshape(grad.shape[0], -1)  # [rows, C]
    mask = touched_rows_mask(table)  # [rows]
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    rows = mask.nonzero().squeeze(1)  # [U], the same on every rank
    if not goes_as_rows(rows.numel(), table.shape[0]):
        dense = table.div(divisor)
        dist.all_reduce(dense, group=group)
        return dense.reshape(grad.shape)
    averaged = torch.zeros_like(table)
    if rows.numel():  # no rank touched a row: nothing to send (every rank knows it)
        packed = table.index_select(0, rows).div_(divisor)  # [U, C]
        dist.all_reduce(packed, group=group)
        averaged.index_copy_(0, rows, packed)
    return averaged.reshape(grad.shape)


@reduce_rows.register_fake
def _(grad: torch.Tensor, group_name: str, divisor: int) -> torch.Tensor:
    return torch.empty_like(grad)
