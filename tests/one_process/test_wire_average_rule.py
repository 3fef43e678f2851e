"""The one rule of Note [Averaged on the wire] (``graphddp.runtime.reductions``), in one process: which backends,
dtypes and PyTorch versions average in the collective, what each reduction divides by, and what a bucket's
gradients are scaled by on their way in (``CommHook.prescales``). What a backward then issues is in
``tests/spawned/test_wire_average.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphddp.runtime import reductions
from graphddp.runtime.reductions import (
    AveragingReduction,
    CommHook,
    RowSparseReduction,
    SkippedReduction,
    WireAveragingReduction,
    averages_correctly,
    averages_on_the_wire,
    backend_name,
    dense_reduction,
    summing,
)


@pytest.mark.parametrize(
    ("backend", "dtype", "version", "expected"),
    [
        ("nccl", torch.float32, "2.13.0", True),  # a sum pre-multiplied by 1/world in float32: PyTorch's DDP's rounding
        ("nccl", torch.bfloat16, "2.13.0", False),  # its 1/world pre-multiplier rounded to bfloat16: a bias
        ("gloo", torch.int64, "2.13.0", False),  # an integer average would truncate
        ("gloo", torch.complex64, "2.13.0", False),
        ("gloo", torch.float32, "2.13.0+cpu", True),
        ("gloo", torch.float64, "2.8.0", True),
        ("gloo", torch.float32, "2.7.1", False),  # gloo took ReduceOp.AVG in PyTorch 2.8
        ("gloo", torch.bfloat16, "2.13.0", False),  # gloo sums before it divides: a 16-bit sum may overflow
        ("gloo", torch.float16, "2.13.0", False),
        ("mpi", torch.float32, "2.13.0", False),  # not known to average
        ("", torch.float32, "2.13.0", False),  # a group that cannot name its backend
    ],
)
def test_which_backends_average_correctly_on_the_wire(backend: str, dtype: torch.dtype, version: str, expected: bool) -> None:
    assert averages_correctly(backend, dtype, version) is expected


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_no_backend_is_let_average_by_default(backend: str) -> None:
    """Both average a float32 bucket correctly, and neither is let: gloo's division costs its worker more than the
    ``mul_`` saves (``bench.wire_average``); NCCL is not measured."""
    assert averages_correctly(backend, torch.float32, "2.13.0")
    assert not averages_on_the_wire(backend, torch.float32, "2.13.0")


def test_a_backend_let_in_averages_what_it_averages_correctly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reductions, "WIRE_AVERAGING", frozenset({"gloo"}))
    assert averages_on_the_wire("gloo", torch.float32, "2.13.0")
    assert not averages_on_the_wire("gloo", torch.bfloat16, "2.13.0")  # not correctly: it may overflow
    assert not averages_on_the_wire("nccl", torch.float32, "2.13.0")  # not let in


@pytest.mark.parametrize(
    ("divisor", "divides_by", "expected"),
    [
        (2, [2, 1], [None, 0.5]),  # AVG over the world: nothing; a sum: 1/world
        (3, [3, 1, 3], [None, 1 / 3, None]),
        (2, [3, 1], [1.5, 0.5]),  # join, averaging over the 2 ranks still training of 3
        (1, [1], [None]),
    ],
)
def test_a_bucket_is_scaled_by_what_its_collective_does_not_divide_by(divisor: int, divides_by: list[int], expected: list[float | None]) -> None:
    hook = CommHook(state=None, fn=lambda state, bucket: None, custom=False)
    assert hook.prescales(lambda: divisor, divides_by) == pytest.approx(expected)


def test_a_comm_hook_is_never_scaled_nor_asked_for_the_divisor() -> None:
    def divisor() -> int:  # under join, asking waits for the count of ranks still training
        raise AssertionError("a custom hook averages itself: the divisor must not be asked")

    hook = CommHook(state=None, fn=lambda state, bucket: None, custom=True)
    assert hook.prescales(divisor, [2, 1]) == [None, None]


def test_reductions_say_what_they_divide_by(one_rank_group: None) -> None:
    group = dist.group.WORLD
    assert backend_name(group, torch.device("cpu")) == "gloo"
    wire, summed = WireAveragingReduction(group), AveragingReduction(group)
    assert (wire.divides_by, summed.divides_by) == (group.size(), 1)
    assert type(summing(wire)) is AveragingReduction and summing(summed) is summed
    assert SkippedReduction(wire).divides_by == group.size()  # its late all-reduce is the wire's
    assert RowSparseReduction(summing(wire), group=group).divides_by == 1


class AveragesOverTwo:
    divides_by = 2
    """A dense reduction that averages over two ranks on the wire (the one-rank group here cannot make one)."""


def test_a_tables_rows_refuse_a_fallback_that_averages(one_rank_group: None) -> None:
    with pytest.raises(AssertionError, match="must sum"):  # rows are scaled on their way in: so must the fallback be
        RowSparseReduction(AveragesOverTwo(), group=dist.group.WORLD)  # type: ignore[arg-type]


def test_one_rank_reduces_nothing_whatever_the_backend(one_rank_group: None) -> None:
    averaging = CommHook.averaging(dist.group.WORLD)
    reduction = dense_reduction(averaging, dist.group.WORLD, 0, dtype=torch.float32, device=torch.device("cpu"))
    assert reduction.divides_by == 1 and not isinstance(reduction, AveragingReduction)  # LocalReduction
