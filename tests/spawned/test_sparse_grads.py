"""``torch.sparse`` gradients (``nn.Embedding(sparse=True)``) on spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
from ranks import run_on_ranks
from torch import nn
from training import refusing_sparse_all_reduce

import graphddp


class SparseTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor, use_table: bool) -> torch.Tensor:
        x = self.table(idx).sum(1) if use_table else self.head.weight.new_zeros(idx.shape[0], 4)  # [B, 2] -> [B, 4]
        return self.head(x + 1).sum()


def sparse_table_used_on_rank0_only(rank: int, world: int, reduce_dtype: torch.dtype | None) -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    idx = torch.tensor([[1, 2], [2, 7]])
    reference = SparseTable()
    reference(idx, True).backward()  # rank 0's gradient of the table
    precision = _MixedPrecision(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype) if reduce_dtype else None
    ddp = graphddp.DDP(SparseTable(), find_unused_parameters=True, mixed_precision=precision)
    ddp(idx, rank == 0).backward()
    grad = ddp.module.table.weight.grad
    assert grad is not None and grad.is_sparse, f"rank {rank}: the table's reduced gradient must stay sparse, got {grad}"
    assert grad.dtype == torch.float32, f"rank {rank}: .grad must be in the parameter's dtype, got {grad.dtype}"
    low = {"rtol": 1e-2, "atol": 1e-2} if reduce_dtype else {}  # bfloat16 forward, backward and average
    torch.testing.assert_close(grad.to_dense(), reference.table.weight.grad.to_dense() / world, **low)


@pytest.mark.parametrize(("world", "reduce_dtype"), [(2, None), (3, None), (2, torch.bfloat16)])
def test_sparse_gradient_used_on_one_rank_only(world: int, reduce_dtype: torch.dtype | None) -> None:
    """PyTorch's DDP fails here ("Expected sparse gradient to be defined"); graphddp sends an empty sparse tensor
    from the ranks that did not use the table (no entries to gather)."""
    run_on_ranks(sparse_table_used_on_rank0_only, world, reduce_dtype)


def rank_gradient(rank: int, shape: tuple[int, ...], sparse_dims: int) -> torch.Tensor:
    """Rank ``rank``'s sparse gradient: a different number of entries per rank (none on rank 1), some shared."""
    g = torch.Generator().manual_seed(rank)
    count = 0 if rank == 1 else 3 + 2 * rank
    indices = torch.stack([torch.randint(0, shape[d], (count,), generator=g) for d in range(sparse_dims)])  # [S, n]
    values = torch.randn(count, *shape[sparse_dims:], generator=g)  # [n, *D]
    return torch.sparse_coo_tensor(indices, values, shape).coalesce()  # repeated indices: summed


def gathered_sum_of_every_rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    from graphddp.runtime.reductions import GatheredSparseReduction

    reduction = GatheredSparseReduction(dist.group.WORLD)
    for shape, sparse_dims in [((7, 3), 1), ((5, 4), 2), ((6, 2, 2), 1)]:
        in_flight = reduction.start(None, rank_gradient(rank, shape, sparse_dims), is_last=True)  # type: ignore[arg-type]
        in_flight.commit()
        summed = in_flight.wait()
        expected = sum(rank_gradient(r, shape, sparse_dims).to_dense() for r in range(world))
        assert summed.is_sparse and summed.is_coalesced(), f"rank {rank}: {shape} came back as {summed.layout}"
        torch.testing.assert_close(summed.to_dense(), expected, msg=lambda m: f"rank {rank}, shape {shape}: {m}")
    nothing = reduction.start(None, torch.zeros(4, 2).to_sparse(1), is_last=True)  # type: ignore[arg-type]
    nothing.commit()
    assert nothing.wait()._nnz() == 0 and nothing.done(), f"rank {rank}: no rank had an entry, yet some came back"


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_sparse_reduction_sums_every_ranks_entries(world: int) -> None:
    """Note [Sparse gradients, gathered]: ranks with different entry counts (one with none, some indices shared),
    hybrid and fully sparse layouts, and no entry on any rank."""
    run_on_ranks(gathered_sum_of_every_rank, world)


def trained_without_sparse_all_reduce(rank: int, world: int, ddp_options: dict) -> None:
    idx = torch.tensor([[1, 2], [2, 7], [3, 3], [9, 1]])  # [world * 2, 2]: two samples per rank
    reference, model = SparseTable(), SparseTable()
    with refusing_sparse_all_reduce():
        ddp = graphddp.DDP(model, **ddp_options)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, reference))
        for step in range(3):
            batch = idx.roll(step, 0)
            ddp(batch[2 * rank : 2 * rank + 2], True).backward()
            (reference(batch[: 2 * world], True) / world).backward()  # the mean of the ranks' losses
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref, msg=lambda m: f"rank {rank}, {name} after 3 steps: {m}")


@pytest.mark.parametrize("ddp_options", [{}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True}], ids=str)
def test_sparse_gradients_never_use_the_backends_sparse_all_reduce(ddp_options: dict) -> None:
    """gloo's sparse all-reduce corrupts the heap now and then (docs/reliability.md): graphddp averages a
    ``torch.sparse`` gradient with all-gathers (Note [Sparse gradients, gathered]), and trains as one process on
    the whole batch does, with a group whose sparse all-reduce refuses."""
    run_on_ranks(trained_without_sparse_all_reduce, 2, ddp_options)
