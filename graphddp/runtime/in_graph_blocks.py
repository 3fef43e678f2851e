"""The ops a big gradient's blocks are written and reduced in place with (Note [Blocks written in place] in
``passes/blocks_in_place.py``): ``graphddp::reduce_block_`` and ``graphddp::wait_blocks_``.

Each block's all-reduce is issued asynchronously on the group the functional one would have used, in the graph's
order, so every rank issues the same collectives in the same order; its ``Work`` is kept with the gradient's
storage until ``wait_blocks_`` waits for it (on CUDA, as a functional collective's wait: the current stream waits
for the collective). The first block of a gradient starts its list afresh, so a backward abandoned half-way leaves
nothing for the next one to wait for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..passes.blocks_in_place import BLOCK_OP, WAIT_BLOCKS_OP  # the pass calls the ops by these names
from .in_graph_steps import step_rows
from .launch_context import CUDAGRAPH_UNSAFE, no_backward_context, settle

_pending: dict[int, tuple[list[dist.Work], list[torch.Tensor]]] = {}
"""The blocks' all-reduces in flight and the blocks they were given, by the data pointer of the gradient they
write (each block a view of its own, only held here: ``settle`` sees it given back, Note [A collective holds no
Python object]). The gradient's own pointer, not its storage's: two gradients may share one storage (Inductor's
memory planning pools buffers)."""


def drop_pending() -> None:
    """A backward was abandoned (Note [Abandoned backward]): forget the blocks it left in flight, so they do not
    keep its gradients' memory for good (a later gradient's first block starts a list of its own anyway)."""
    _pending.clear()


def _rows_of(gradient: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    """The block of ``gradient`` (1-D) that starts at ``offset``, as a contiguous ``shape`` view."""
    return gradient.view(-1)[offset : offset + shape[0] * shape[1]].view(shape)


@torch.library.custom_op(BLOCK_OP, mutates_args=("gradient",), tags=CUDAGRAPH_UNSAFE)
def reduce_block_(
    gradient: torch.Tensor,
    rows: torch.Tensor,
    by: torch.Tensor,
    offset: int,
    divisor: float,
    group_name: str,
    first: bool,
) -> None:
    """``rows @ by`` written into ``gradient`` at ``offset``, divided by ``divisor`` there, and all-reduced there
    (asynchronously, on ``group_name``)."""
    block = _rows_of(gradient, offset, (rows.shape[0], by.shape[1]))  # [r, C]
    torch.mm(rows, by, out=block)
    block.div_(divisor)
    with no_backward_context():  # Note [A collective holds no Python object]
        work = dist.all_reduce(block, group=_resolve_process_group(group_name), async_op=True)
    key = gradient.data_ptr()
    entry = None if first else _pending.get(key)
    if entry is None:  # the gradient's first block (or one whose first never ran): a list of its own
        entry = _pending[key] = ([], [])
    works, blocks = entry
    works.append(work)
    blocks.append(block)


@torch.library.custom_op(WAIT_BLOCKS_OP, mutates_args=("gradient",), tags=CUDAGRAPH_UNSAFE)
def wait_blocks_(gradient: torch.Tensor, copies: list[torch.Tensor], offsets: list[int], step: int, position: int) -> None:
    """Wait for ``gradient``'s blocks' all-reduces, then copy each of ``copies`` into it at its offset. With a
    ``step`` key (-1: none), the copies' rows are stepped first and each block's as its wait returns: the
    parameter at ``position`` of that bucket's step node (Note [Steps by rows] in ``graphddp/runtime/row_steps.py``)."""
    works, blocks = _pending.pop(gradient.data_ptr(), ([], []))
    flat = gradient.view(-1)
    if step < 0:
        settle(works, blocks, "a gradient block")
        _copy_in(flat, copies, offsets)
        return
    # The copies (the first block, sent with the bucket's small gradients) are in already: copied and stepped
    # first; then the blocks in the order they were sent, each stepped while the later ones travel.
    _copy_in(flat, copies, offsets)
    try:
        for copy, offset in zip(copies, offsets):
            step_rows(step, position, offset, copy)
        while works:
            one, block = [works.pop(0)], blocks.pop(0)
            settle(one, [block], "a gradient block")
            step_rows(step, position, block.storage_offset() - gradient.storage_offset(), block)
    except BaseException:
        settle(works, blocks, "a gradient block")  # a step raised: the blocks still in flight waited for first
        raise


def _copy_in(flat: torch.Tensor, copies: list[torch.Tensor], offsets: list[int]) -> None:
    for copy, offset in zip(copies, offsets):
        flat[offset : offset + copy.numel()].copy_(copy.reshape(-1))


@reduce_block_.register_fake
def _(gradient: torch.Tensor, *_: object) -> None:  # it writes ``gradient`` and returns nothing
    return None


@wait_blocks_.register_fake
def _(gradient: torch.Tensor, *_: object) -> None:
    return None
