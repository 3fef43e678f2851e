"""When embedding tables pay to be reduced as rows (Note [Row-sparse gradients], "When rows pay"): the pure rule
``rows_pay``, and ``RowsRule`` deciding the eager tables and each captured graph from a given link (no process)."""

from __future__ import annotations

import pytest
import torch
from models import tied_gpt
from models import tokens as draw_tokens

from graphddp.compiler.capture import capture_graphs, parameter_names
from graphddp.compiler.graph_pipeline import prepare_graph
from graphddp.passes import (
    SPLIT_LAUNCHES_PER_PARAMETER,
    BucketCaps,
    ComputeRates,
    LinkModel,
    choose_reduction,
    plan_blockers,
    rows_pay,
    split_seconds,
)
from graphddp.runtime.rows_rule import RowsRule

LOOPBACK = LinkModel(latency_s=1e-3, seconds_per_byte=0.7e-9)
"""Gloo over loopback on the 2-CPU development machine, as ``link_of`` measured it (session 10)."""
ONE_GBIT = LinkModel.of_rate(1e9)
BENCH_OVERHEAD_TABLE = (4096, 128 * 4)
"""``bench.overhead``'s tied table: 4096 rows of 128 float32."""
BENCH_GPT_TABLE = (32768, 128 * 4)
"""The matrix's GPT table, 16.8 MB."""


def test_a_fast_link_keeps_the_bench_table_dense_and_a_slow_one_sends_rows() -> None:
    fast = rows_pay([BENCH_OVERHEAD_TABLE], link=LOOPBACK, world=2)
    assert not fast.rows and fast.saved_s < 0  # the mask's round trip costs more than the bytes it saves
    slow = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2)
    rows, row_bytes = BENCH_GPT_TABLE
    # The dense table's bytes, less half of them (the most still sent as rows) and the one-byte-per-row mask.
    expected = (rows * row_bytes - rows * row_bytes // 2 - rows) * ONE_GBIT.seconds_per_byte - 2 * ONE_GBIT.latency_s
    assert slow.rows and slow.saved_s == pytest.approx(expected)
    assert slow.saved_s > 0.06  # ~67 ms a step at 1 Gbit/s


def test_the_split_cost_tips_the_compiled_choice_and_gloo_cpu_counts_for_rows() -> None:
    saved = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2).saved_s
    assert rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, split_s=0.99 * saved).rows
    assert not rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, split_s=1.01 * saved).rows
    # gloo's CPU per byte weighs on the dense table's bytes more than on the rows'.
    with_cpu = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, cpu_seconds_per_byte=1e-9)
    assert with_cpu.saved_s > saved
    # Several tables of one graph add their savings and pay one split.
    both = rows_pay([BENCH_GPT_TABLE, BENCH_GPT_TABLE], link=ONE_GBIT, world=2, split_s=1.5 * saved)
    assert both.rows and both.saved_s == pytest.approx(2 * saved)


def test_no_table_no_rows_and_bad_inputs_are_refused() -> None:
    assert not rows_pay([], link=ONE_GBIT, world=2).rows
    assert not rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=1).rows  # one rank sends nothing
    with pytest.raises(ValueError, match="costs >= 0"):
        rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, split_s=-1.0)
    with pytest.raises(ValueError, match="compute rates"):
        ComputeRates(flops_per_s=1.0, bytes_per_s=1.0, op_launch_s=-1.0)


def test_split_seconds_counts_launches_per_parameter() -> None:
    assert split_seconds(148, 1e-6) == pytest.approx(148 * SPLIT_LAUNCHES_PER_PARAMETER * 1e-6)
    assert split_seconds(148, 0.0) == 0.0  # not measured: the split costs nothing, rows win on bytes alone


def rule(link: LinkModel | None, enabled: bool | str = "auto", launch_s: float = 1e-6) -> RowsRule:
    rates = ComputeRates(flops_per_s=1e10, bytes_per_s=1e10, op_launch_s=launch_s)
    return RowsRule(enabled=enabled, link=link, rates=rates if link is not None else None, world=2)


def test_the_eager_tables_are_decided_one_by_one() -> None:
    tables = {"small": ((64, 8), torch.float32), "big": ((32768, 128), torch.float32)}
    assert rule(ONE_GBIT).eager_tables(tables) == {"big"}  # 2 KiB save less than the mask's round trip costs
    assert rule(LOOPBACK).eager_tables(tables) == {"big"}  # 16.8 MB: half of it outweighs the mask even here
    assert rule(LOOPBACK).eager_tables({"bench": ((4096, 128), torch.float32)}) == frozenset()  # bench.overhead's
    assert rule(None, enabled=True).eager_tables(tables) == {"small", "big"}  # True: wherever they apply


def captured_gpt(vocab: int) -> tuple[object, list[object], dict[int, str]]:
    model = tied_gpt(vocab)
    (graph,) = capture_graphs(model, *draw_tokens("gpt", torch.Generator().manual_seed(0), 2, vocab))
    return graph.gm, graph.example_inputs, parameter_names(model)


@pytest.mark.parametrize(("link", "vocab", "rows"), [(ONE_GBIT, 65536, True), (LOOPBACK, 4096, False), (LOOPBACK, 65536, True), (ONE_GBIT, 512, False)])
def test_a_graph_planned_dense_reduces_in_graph_and_one_planned_as_rows_splits(link: LinkModel, vocab: int, rows: bool) -> None:
    # 65536 x 32 float32 (8 MiB) pays as rows even over loopback; 4096 rows (512 KiB) do not; nor do 512 rows
    # (64 KiB) at 1 Gbit/s, once the split's launches are paid.
    gm, example_inputs, names = captured_gpt(vocab)
    decided = []

    def decide(params: list[object]) -> bool:
        decided.append(rule(link).for_graph(params))  # type: ignore[arg-type]
        return decided[-1]

    prepared = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=decide)
    assert prepared is not None and decided == [rows]
    planned_rows = bool(prepared.plan.parts) or any(b.row_sparse for b in prepared.plan.buckets)
    assert planned_rows == rows
    strategy = choose_reduction("auto", plan_blockers(prepared.plan)).strategy
    assert strategy == ("split" if rows else "in_graph")


def test_a_recompile_is_cut_by_its_plan_and_asks_nothing() -> None:
    gm, example_inputs, names = captured_gpt(65536)
    first = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=True)
    assert first is not None and first.plan.parts

    def never(params: object) -> bool:
        raise AssertionError("a graph cut by an earlier plan decides no rows")

    again = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=never, plan_for=lambda params: first.plan)
    assert again is not None and again.plan == first.plan and again.reused_plan


def test_the_verdict_says_both_sides() -> None:
    compiled = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, split_s=0.002)
    assert compiled.describe().startswith("as rows: rows would save 66.") and "the split would cost 2.00 ms" in compiled.describe()
    eager = rows_pay([BENCH_OVERHEAD_TABLE], link=LOOPBACK, world=2)
    assert eager.describe().startswith("dense: rows would save -") and "split" not in eager.describe()
