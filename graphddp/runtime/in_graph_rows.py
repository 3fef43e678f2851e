"""An embedding table's rows, reduced inside the compiled backward: the op the in-graph strategy's rows node calls.

Note [Rows in the compiled backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which rows travel is known only at run time: the union, over the ranks, of the rows each rank's batch touched
(Note [Row-sparse gradients] in ``graphddp/passes/row_sparse.py``). No functional collective can trace that, but
an opaque op can run it: ``graphddp::reduce_rows(grad, group_name, divisor, streak, base)`` takes a table's
gradient (the lookups' contribution, ``[rows, C]``), max-reduces the byte mask of the rows it touches, and
all-reduces the touched rows only, packed, divided by ``divisor`` first as the in-graph buckets are; or the whole
table, when the union is over ``ROW_SPARSE_MAX_DENSITY`` of the rows (``goes_as_rows``, the Reducer's rule). It
returns the averaged table added to ``base`` (a tied table's parts' average; zero outside the rows without one).
Both collectives are issued and waited inside the op, on the bucket's channel.

* **Same order on every rank**: the op is a node of the compiled backward, which every rank compiled from the
  same graph, so it issues its two collectives at the same place among the functional all-reduces everywhere; a
  process group runs its collectives in the order they were issued, so the mask waits behind the buckets still
  on the link. A table used first in forward is the last bucket: nothing is left to compute behind that wait.
* **Tied tables**: the in-graph ``RowsAllReduce`` (``graphddp/compiler/in_graph.py``) also carries the parts (the
  output layer's contribution, reduced early in a bucket of its own) and hands their average to the op as
  ``base``, which the rows are added into (one table-sized tensor a step, not zeros and then a sum): the
  parameter's gradient leaves the graph whole and averaged, as from the Reducer.
* **Giving up**: as the Reducer's ``RowSparseReduction``, a table that goes dense ``DENSE_STREAK_LIMIT`` times in a
  row is reduced dense from then on, without its mask (``DenseStreak``, fed the all-reduced outcome, so every rank
  gives up on the same step). The streak is the DDP's, per table (``streak_key``): a graph one rank recompiled
  alone counts on from where the others are. A tied table's part, sent early on its own, would then be a second
  table-sized all-reduce beside the lookups' contribution sent dense (the sum stays right, the bytes double), so
  at the next forward each in-graph variant that sends a part of a table that gave up is compiled again for its
  plan without the part
  (``InGraphVariant`` in ``graphddp/compiler/in_graph.py``, ``BucketPlan.without_rows``): the table goes whole in
  a dense bucket of its own. Every rank gave up on the same step, so every rank compiles again at the same forward,
  and a graph Dynamo compiles after that (a recompile, on one rank or all) is planned without the part from the
  start: ranks keep issuing the same collectives. The variant is compiled again from the graph's inputs as Dynamo
  traced them (fake, symbolic where its shapes are dynamic), so it runs whatever shapes Dynamo's guards let it run;
  a graph with parts whose traced inputs are unknown runs split (``GraphDDPBackend.choose_reduction``), for a
  variant that kept its parts would send buckets a recompiled graph does not.
  The price is one compile of that graph, once; the Reducer re-plans its own plan the same way.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..passes.reduction import ROWS_OP  # the passes find the node by this name: they import nothing of the runtime
from .launch_context import CUDAGRAPH_UNSAFE
from .reductions import DENSE_STREAK_LIMIT, DenseStreak, goes_as_rows, touched_rows_mask

logger = logging.getLogger(__name__)


_keys = itertools.count()
_streaks: dict[int, tuple[DenseStreak, str, weakref.ref[object]]] = {}


def streak_key(owner: object, table: str) -> int:
    """A new key for the dense streak of ``table`` (one per DDP and table: ``owner``, the DDP's target, keeps it
    for all its graphs; held weakly, so the keys of freed DDPs are dropped as new ones are made)."""
    for dead in [k for k, (_, _, ref) in _streaks.items() if ref() is None]:
        del _streaks[dead]
    key = next(_keys)
    _streaks[key] = (DenseStreak(), table, weakref.ref(owner))
    return key


def gave_up(key: int) -> bool:
    """Has the table of ``key`` (a ``streak_key``) given up rows in the compiled backward: sent dense, no mask?"""
    counted = _streaks.get(key)
    return counted is not None and counted[0].gave_up


@torch.library.custom_op(ROWS_OP, mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def reduce_rows(grad: torch.Tensor, group_name: str, divisor: int, streak: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """``grad`` (``[rows, ...]``) averaged over the group ``group_name``, sent as the rows some rank touched (see
    the Note), added to ``base`` (a tied table's parts, averaged already; zeros without one): a new contiguous
    tensor of ``grad``'s shape. ``streak``: the table's ``streak_key``, or -1 for none (always try rows)."""
    _check_base(grad, base)
    group = _resolve_process_group(group_name)
    table = grad.reshape(grad.shape[0], -1).contiguous()  # [rows, C]; contiguous, as the fake op promises
    base = base.reshape(table.shape) if base is not None else None
    counted = _streaks.get(streak)
    if counted is not None and counted[0].gave_up:
        return _dense(table, group, divisor, base).reshape(grad.shape)
    mask = touched_rows_mask(table)  # [rows]
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    rows = mask.nonzero().squeeze(1)  # [U], the same on every rank
    sparse = goes_as_rows(rows.numel(), table.shape[0])
    if counted is not None:
        counted[0].observe(sparse)
        if counted[0].gave_up:
            logger.info(
                "[rank %d] graphddp: embedding table %s went dense %d times in a row in the compiled backward; it is "
                "reduced dense from now on (Note [Rows in the compiled backward])", dist.get_rank(group), counted[1], DENSE_STREAK_LIMIT,
            )
    if not sparse:
        return _dense(table, group, divisor, base).reshape(grad.shape)
    # The rows go straight into the parts' average: one table-sized tensor a step, not zeros and then a sum.
    averaged = base.clone(memory_format=torch.contiguous_format) if base is not None else torch.zeros_like(table)
    if rows.numel():  # no rank touched a row: nothing to send (every rank knows it)
        packed = table.index_select(0, rows).div_(divisor)  # [U, C]
        dist.all_reduce(packed, group=group)
        averaged.index_add_(0, rows, packed)
    return averaged.reshape(grad.shape)


def _dense(table: torch.Tensor, group: dist.ProcessGroup, divisor: int, base: torch.Tensor | None) -> torch.Tensor:
    dense = table.div(divisor)
    dist.all_reduce(dense, group=group)
    return dense if base is None else dense.add_(base)


def _check_base(grad: torch.Tensor, base: torch.Tensor | None) -> None:
    """The result has ``grad``'s shape and dtype (the fake op says so): a base must have them too."""
    if base is not None:
        torch._check(
            base.shape == grad.shape and base.dtype == grad.dtype,
            lambda: f"graphddp::reduce_rows: base {tuple(base.shape)} {base.dtype} must match grad {tuple(grad.shape)} {grad.dtype}",
        )


@reduce_rows.register_fake
def _(grad: torch.Tensor, group_name: str, divisor: int, streak: int, base: torch.Tensor | None = None) -> torch.Tensor:
    _check_base(grad, base)
    return grad.new_empty(grad.shape)  # contiguous, as the op returns it


# Its collectives are effects: no pass may drop or merge the node, whatever its output's use.
torch.fx.node.has_side_effect(torch.ops.graphddp.reduce_rows.default)
