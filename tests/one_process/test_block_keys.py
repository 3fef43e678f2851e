"""graphddp's ops in a compiled backward: ``reduce_block_`` keeps each gradient's blocks apart, even where
two share one storage (Inductor's memory planning pools buffers), an abandoned backward's blocks are dropped, and
no CUDA graph records any of them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphddp.runtime import in_graph_blocks

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def test_two_gradients_in_one_storage_keep_their_blocks_apart() -> None:
    pool = torch.zeros(2, 4 * 3)  # two gradients of [4, 3], one storage
    first, second = pool[0], pool[1]
    rows, by = torch.ones(2, 5), torch.ones(5, 3)
    group = dist.group.WORLD.group_name
    torch.ops.graphddp.reduce_block_(first, rows, by, 0, 1.0, group, True)
    torch.ops.graphddp.reduce_block_(second, rows, by, 0, 1.0, group, True)  # its first block: a list of its own
    torch.ops.graphddp.reduce_block_(first, rows, by, 6, 1.0, group, False)
    assert len(in_graph_blocks._pending) == 2
    for gradient in (first, second):
        torch.ops.graphddp.wait_blocks_(gradient, [], [], -1, -1)
    assert not in_graph_blocks._pending
    torch.testing.assert_close(pool, torch.tensor([[5.0] * 12, [5.0] * 6 + [0.0] * 6]))


def test_an_abandoned_backwards_blocks_are_dropped() -> None:
    gradient = torch.zeros(4, 3)
    torch.ops.graphddp.reduce_block_(gradient, torch.ones(2, 5), torch.ones(5, 3), 0, 1.0, dist.group.WORLD.group_name, True)
    assert in_graph_blocks._pending
    in_graph_blocks.drop_pending()
    assert not in_graph_blocks._pending


def test_graphddps_ops_in_a_compiled_backward_are_never_recorded_into_a_cuda_graph() -> None:
    """Their Python runs every step (collectives, an optimizer step): ``mode="reduce-overhead"`` must not record
    them once and replay the recording."""
    import graphddp.runtime.in_graph_rows  # noqa: F401  (registers graphddp::reduce_rows)
    import graphddp.runtime.in_graph_steps  # noqa: F401  (registers graphddp::step_bucket)

    ops = torch.ops.graphddp
    for op in (ops.reduce_block_, ops.wait_blocks_, ops.reduce_rows, ops.step_bucket):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op
