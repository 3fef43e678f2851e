"""The two-step row-sparse reduction in one gloo process (Note [Row-sparse gradients]), and the option's checks."""

from __future__ import annotations

import pytest
import torch
from models import Bag
from reduce_rows import reduce_rows

import graphddp


@pytest.mark.usefixtures("one_rank_group")
def test_row_sparse_launch_in_one_process_keeps_the_table_and_falls_back_when_dense() -> None:
    table = torch.zeros(8, 3)
    table[[1, 6]] = torch.tensor([[1.0, -2.0, 0.0], [float("nan"), 0.0, 0.0]])
    expected = table.clone()
    result, launch = reduce_rows(table)
    assert launch.touched == 2 and launch.outcome[0] == "rows" and result.data_ptr() == table.data_ptr()
    torch.testing.assert_close(result, expected, equal_nan=True)
    result, launch = reduce_rows(torch.ones(8, 3))
    assert launch.touched == 8 and launch.outcome[0] == "dense" and torch.equal(result, torch.ones(8, 3))


@pytest.mark.usefixtures("one_rank_group")
def test_the_option_is_validated_and_one_rank_plans_no_rows() -> None:
    with pytest.raises(TypeError, match="sparse_embedding_grads must be True, False or 'auto', got 'yes'"):
        graphddp.DDP(Bag(), sparse_embedding_grads="yes")  # type: ignore[arg-type]
    # Nothing to send at world size 1: no side group, no rows, no isolated table bucket.
    assert not any(b.row_sparse for b in graphddp.DDP(Bag(), sparse_embedding_grads=True).bucket_plan.buckets)


@pytest.mark.usefixtures("one_rank_group")
def test_the_in_graph_rows_op_returns_a_contiguous_table_as_its_fake_says() -> None:
    # Its fake (what the compiled graph plans its buffers by) is contiguous; a transposed gradient must not make
    # the real one differ (graphddp/runtime/in_graph_rows.py).
    import torch.distributed as dist

    from graphddp.runtime import in_graph_rows  # noqa: F401  (registers graphddp::reduce_rows)

    grad = torch.zeros(3, 8)
    grad[:, 2] = 1.0  # [3, 8] -> transposed [8, 3]: rows 2 touched
    averaged = torch.ops.graphddp.reduce_rows(grad.t(), dist.group.WORLD.group_name, 1, -1)
    assert averaged.is_contiguous() and averaged.shape == (8, 3)
    torch.testing.assert_close(averaged, grad.t())


@pytest.mark.usefixtures("one_rank_group")
def test_the_in_graph_rows_op_adds_the_rows_into_the_parts_average() -> None:
    # A tied table's parts, averaged by their buckets, are the op's base: rows and dense alike, the result is the
    # base plus the lookups' average, a new contiguous tensor (the base is left as it was).
    import torch.distributed as dist

    from graphddp.runtime import in_graph_rows  # noqa: F401  (registers graphddp::reduce_rows)

    group = dist.group.WORLD.group_name
    lookups = torch.zeros(8, 3)
    lookups[[1, 6]] = torch.tensor([[2.0, -4.0, 6.0], [8.0, 0.0, 2.0]])  # 2 of 8 rows: sent as rows
    base = torch.arange(24.0).reshape(3, 8).t()  # transposed: a base need not be contiguous
    kept = base.clone()
    averaged = torch.ops.graphddp.reduce_rows(lookups, group, 2, -1, base)
    assert averaged.is_contiguous() and torch.equal(base, kept)
    torch.testing.assert_close(averaged, kept + lookups / 2)
    dense = torch.ones(8, 3)  # every row touched: sent dense, the base added all the same
    torch.testing.assert_close(torch.ops.graphddp.reduce_rows(dense, group, 2, -1, base), kept + 0.5)
    torch.testing.assert_close(torch.ops.graphddp.reduce_rows(lookups, group, 2, -1), lookups / 2)  # no base: zeros
    with pytest.raises(RuntimeError, match="base .* must match grad"):
        torch.ops.graphddp.reduce_rows(lookups, group, 2, -1, base.double())


def test_a_row_is_touched_where_any_element_is_nonzero_or_nan() -> None:
    """``touched_rows_mask``: a row of only negative values, a NaN or an infinity is touched; a row of zeros,
    ``-0.0`` among them, is not (its max and its min are both 0)."""
    from graphddp.runtime.reductions import touched_rows_mask

    table = torch.zeros(6, 4)
    table[1] = -3.0
    table[2, 3] = float("nan")
    table[3, 0] = float("-inf")
    table[4, 1] = -0.0
    table[5, 2] = 1e-30
    assert touched_rows_mask(table).tolist() == [0, 1, 1, 1, 0, 1]
    assert touched_rows_mask(table).dtype == torch.uint8
