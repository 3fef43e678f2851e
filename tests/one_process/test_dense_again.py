"""A row-sparse table that gave up rows is planned dense again (Note [Plan agreement], "tables gone dense"): under
the Reducer's own plans, the plan it would have had without rows; under a compiled graphs' plan, only a table's
parts go."""

from __future__ import annotations

import dataclasses

import torch

from graphddp.passes import BucketCaps, ParamSpec, plan_buckets
from graphddp.runtime.plans import dense_again

CAPS = BucketCaps(bucket=4096, first=4096, last=4096, ramps=False)  # bytes: a bucket closes at 1024 float32s or more


def spec(name: str, *shape: int, **fields: object) -> ParamSpec:
    return ParamSpec(name, tuple(shape), torch.float32, "cpu", **fields)  # type: ignore[arg-type]


def names(plan: object) -> list[tuple[str, ...]]:
    return [tuple(p.label for p in b.params) for b in plan.buckets]  # type: ignore[attr-defined]


def test_a_position_table_that_gave_up_rows_rejoins_its_neighbours_buckets() -> None:
    """Alone, the table split the bucket it sits in: three collectives where the dense plan has one."""
    order = [spec("head.weight", 4, 200), spec("wpe.weight", 16, 32, row_sparse=True), spec("ln.weight", 100)]
    with_rows = plan_buckets(order, caps=CAPS, source="ready-order")
    assert names(with_rows) == [("head.weight",), ("wpe.weight[rows]",), ("ln.weight",)]

    again = dense_again(with_rows, ["wpe.weight"])

    dense = plan_buckets([dataclasses.replace(p, row_sparse=False) for p in order], caps=CAPS, source="ready-order")
    assert again is not None and names(again) == names(dense) == [("head.weight", "wpe.weight"), ("ln.weight",)]
    assert again.fingerprint == dense.fingerprint and again.source == "ready-order"
    assert dense_again(again, ["wpe.weight"]) is None  # nothing changes any more: no plan is adopted again


def test_a_graph_plan_keeps_its_cuts_and_drops_only_parts() -> None:
    table, part = spec("wte.weight", 16, 32, row_sparse=True), spec("wte.weight", 16, 32, part="linear")
    graph = plan_buckets([part, spec("h.weight", 4, 100), table], caps=CAPS, source="graph")
    assert names(graph) == [("wte.weight@linear", "h.weight"), ("wte.weight[rows]",)]

    again = dense_again(graph, ["wte.weight"])

    assert again is not None and names(again) == [("h.weight",), ("wte.weight",)]  # the segments' cut is kept
    untied = plan_buckets([spec("h.weight", 4, 100), table], caps=CAPS, source="graph")
    assert dense_again(untied, ["wte.weight"]) is None  # no parts: its reduction stops trying rows, nothing else


def test_a_plan_of_two_dtypes_keeps_its_buckets_the_table_dense() -> None:
    """Buckets are per dtype, and the order between the dtypes' buckets is not kept in them: planned again from
    the buckets, a later bucket could get an index ahead of one ready before it. So the table stays where it is."""
    half = ParamSpec("norm.weight", (100,), torch.bfloat16, "cpu")
    order = [spec("head.weight", 4, 200), half, spec("wpe.weight", 16, 32, row_sparse=True), spec("ln.weight", 100)]
    with_rows = plan_buckets(order, caps=CAPS, source="registration")

    again = dense_again(with_rows, ["wpe.weight"])

    assert again is not None and [len(b.params) for b in again.buckets] == [len(b.params) for b in with_rows.buckets]
    assert "wpe.weight" in names(again)[with_rows.bucket_of("wpe.weight")]  # its bucket, no longer "[rows]"
