"""``torch.sparse`` gradients (``nn.Embedding(sparse=True)``) on spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
from ranks import run_on_ranks
from torch import nn

import graphddp


class SparseTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor, use_table: bool) -> torch.Tensor:
        x = self.table(idx).sum(1) if use_table else torch.zeros(idx.shape[0], 4)  # [B, 2] -> [B, 4]
        return self.head(x + 1).sum()


def sparse_table_used_on_rank0_only(rank: int, world: int) -> None:
    idx = torch.tensor([[1, 2], [2, 7]])
    reference = SparseTable()
    reference(idx, True).backward()  # rank 0's gradient of the table
    ddp = graphddp.DDP(SparseTable(), find_unused_parameters=True)
    ddp(idx, rank == 0).backward()
    grad = ddp.module.table.weight.grad
    assert grad is not None and grad.is_sparse, f"rank {rank}: the table's reduced gradient must stay sparse, got {grad}"
    torch.testing.assert_close(grad.to_dense(), reference.table.weight.grad.to_dense() / world)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_gradient_used_on_one_rank_only(world: int) -> None:
    """PyTorch's DDP fails here ("Expected sparse gradient to be defined"); graphddp all-reduces an empty sparse
    tensor from the ranks that did not use the table."""
    run_on_ranks(sparse_table_used_on_rank0_only, world)
