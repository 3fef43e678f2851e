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
    PART_CPU_FACTOR,
    BucketCaps,
    ComputeRates,
    LinkModel,
    choose_reduction,
    embedding_tables,
    plan_blockers,
    rows_pay,
    tied_tables,
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


def test_gloo_cpu_counts_for_rows_and_tables_add_up() -> None:
    saved = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2).saved_s
    # gloo's CPU per byte weighs on the dense table's bytes more than on the rows'.
    with_cpu = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, cpu_seconds_per_byte=1e-9)
    assert with_cpu.saved_s > saved
    both = rows_pay([BENCH_GPT_TABLE, BENCH_GPT_TABLE], link=ONE_GBIT, world=2)
    assert both.rows and both.saved_s == pytest.approx(2 * saved)


def test_a_tied_tables_parts_are_charged_their_cpu() -> None:
    # As rows, a tied table's part (the output layer's contribution) is a table-sized all-reduce of its own; dense,
    # it travels inside the table's gradient. Its link time may hide in backward, its gloo CPU cannot.
    rows, row_bytes = BENCH_GPT_TABLE
    untied = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, cpu_seconds_per_byte=1e-9)
    tied = rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, cpu_seconds_per_byte=1e-9, parts=[1])
    assert tied.saved_s == pytest.approx(untied.saved_s - PART_CPU_FACTOR * 1e-9 * rows * row_bytes)
    assert rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, parts=[2]) == rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2)
    with pytest.raises(ValueError, match="parts must give each"):
        rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, parts=[1, 1])


MATRIX_GPT_TABLE = (8192, 512 * 4)
"""``bench.matrix``'s gpt: its tied token table, 8192 rows of 512 float32 (16.8 MB)."""


@pytest.mark.parametrize(("latency_s", "seconds_per_byte", "cpu_seconds_per_byte", "rows"), [
    (0.27e-3, 1.82e-9, 0.70e-9, False),  # 5 Gbit/s as session 33's matrix calibrated it
    (0.81e-3, 1.63e-9, 0.79e-9, False),  # 5 Gbit/s, session 34
    (0.65e-3, 8.10e-9, 1.84e-9, True),  # 1 Gbit/s, session 33
    (0.65e-3, 8.10e-9, 0.70e-9, True),
])  # fmt: skip
def test_the_matrix_gpts_tied_table_goes_dense_at_5_gbits_and_as_rows_at_1(
    latency_s: float, seconds_per_byte: float, cpu_seconds_per_byte: float, rows: bool
) -> None:
    # Every matrix run that had both since session 21 measured the tied table dense as fast as rows or faster at 5
    # Gbit/s (by up to ~110 ms a step); at 1 Gbit/s rows won in most. Charged its part's CPU once, the rule said
    # rows at 5 Gbit/s by ~9 ms; charged PART_CPU_FACTOR times, as sending beside a backward costs, it says dense.
    link = LinkModel(latency_s=latency_s, seconds_per_byte=seconds_per_byte)
    verdict = rows_pay([MATRIX_GPT_TABLE], link=link, world=2, cpu_seconds_per_byte=cpu_seconds_per_byte, parts=[1])
    assert verdict.rows == rows, verdict.describe()
    untied = rows_pay([MATRIX_GPT_TABLE], link=link, world=2, cpu_seconds_per_byte=cpu_seconds_per_byte, parts=[0])
    assert untied.rows  # without a part the same table pays as rows at either rate


def test_tied_and_untied_tables_are_told_apart_by_the_modules_that_share_them() -> None:
    model = tied_gpt()
    assert tied_tables(model) == {"wte.weight"} and "wte.weight" not in embedding_tables(model)
    assert embedding_tables(model) and not tied_tables(model) & embedding_tables(model)  # the position table
    untied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    assert tied_tables(untied) == frozenset() and embedding_tables(untied) == {"0.weight"}


def test_a_compiled_graphs_tied_table_is_charged_its_part() -> None:
    # 65536 x 32 float32 (8 MiB) over loopback: rows save ~0.9 ms on the link; at 1 ns/B of gloo CPU an untied
    # table gains from that too (half the bytes), but the tied GPT's output-layer part costs 8 MiB of CPU more.
    gm, example_inputs, names = captured_gpt(65536)
    charged = RowsRule(enabled="auto", link=LOOPBACK, world=2, cpu_seconds_per_byte=1e-9)
    assert charged.verdict([(65536, 32 * 4)]).rows  # the table alone, untied
    decided: list[bool] = []

    def decide(params: list[object]) -> bool:
        decided.append(charged.for_graph(params))  # type: ignore[arg-type]
        return decided[-1]

    prepared = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=decide)
    assert prepared is not None and decided == [False] and not prepared.plan.parts


def test_no_table_no_rows_and_bad_inputs_are_refused() -> None:
    assert not rows_pay([], link=ONE_GBIT, world=2).rows
    assert not rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=1).rows  # one rank sends nothing
    with pytest.raises(ValueError, match="costs >= 0"):
        rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2, cpu_seconds_per_byte=-1.0)
    with pytest.raises(ValueError, match="compute rates"):
        ComputeRates(flops_per_s=1.0, bytes_per_s=1.0, python_call_s=-1.0)


def rule(link: LinkModel | None, enabled: bool | str = "auto") -> RowsRule:
    return RowsRule(enabled=enabled, link=link, world=2)


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


@pytest.mark.parametrize(("link", "vocab", "rows"), [(ONE_GBIT, 65536, True), (LOOPBACK, 4096, False), (LOOPBACK, 65536, True), (ONE_GBIT, 512, True), (ONE_GBIT, 64, False)])
def test_a_graph_reduces_in_graph_with_its_tables_as_rows_or_dense(link: LinkModel, vocab: int, rows: bool) -> None:
    # 65536 x 32 float32 (8 MiB) pays as rows even over loopback; 4096 rows (512 KiB) do not. At 1 Gbit/s 512 rows
    # (64 KiB) save 0.16 ms, 64 rows less than the mask's round trip. Either way the graph reduces in-graph
    # (Note [Rows in the compiled backward]): rows no longer cost the split.
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
    assert strategy == "in_graph"


def test_a_recompile_is_cut_by_its_plan_and_asks_nothing() -> None:
    gm, example_inputs, names = captured_gpt(65536)
    first = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=True)
    assert first is not None and first.plan.parts

    def never(params: object) -> bool:
        raise AssertionError("a graph cut by an earlier plan decides no rows")

    again = prepare_graph(gm, example_inputs, names, caps=BucketCaps(), row_sparse=never, plan_for=lambda params: first.plan)
    assert again is not None and again.plan == first.plan and again.reused_plan


def test_the_verdict_says_what_rows_save() -> None:
    assert rows_pay([BENCH_GPT_TABLE], link=ONE_GBIT, world=2).describe().startswith("as rows: rows would save 66.")
    assert rows_pay([BENCH_OVERHEAD_TABLE], link=LOOPBACK, world=2).describe().startswith("dense: rows would save -")


def test_gloos_cpu_is_charged_on_the_bytes_each_rank_sends_as_the_step_model_charges_it() -> None:
    # The CPU per byte is measured against what a rank sends in a ring all-reduce, 2 (w - 1) / w of the payload
    # (graphddp.runtime.calibration, passes.cost.ring_bytes_sent): the verdict's CPU term grows by 4/3 from 2 to 3
    # ranks, as predict_step's does, for the table and for its part.
    table = [BENCH_GPT_TABLE]

    def cpu_term(world: int) -> float:
        charged = rows_pay(table, link=ONE_GBIT, world=world, cpu_seconds_per_byte=1e-9, parts=[1])
        return charged.saved_s - rows_pay(table, link=ONE_GBIT, world=world, parts=[1]).saved_s

    assert cpu_term(2) < 0 and cpu_term(3) == pytest.approx(cpu_term(2) * 4 / 3)
