"""Row-sparse embedding gradients and tied tables' parts, as passes on captured graphs (no process): which
tables go row-sparse, where their parts are planned and tapped, and that the tapped graph computes the same
gradients (Note [Row-sparse gradients] in passes/row_sparse.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from graphs import renamed
from models import VOCAB, Bag, tied_gpt
from models import tokens as draw_tokens
from torch import nn

from graphddp.compiler.capture import capture_graphs, parameter_names
from graphddp.compiler.gradient_tap import GradientTap
from graphddp.passes import (
    Bucket,
    BucketCaps,
    BucketPlan,
    ParamSpec,
    compose_plans,
    embedding_tables,
    find_graph_params,
    misplaced_parts,
    parts_named_in,
    plan_blockers,
    plan_buckets,
    plan_graph,
    row_sparse_params,
    sparse_gradient_params,
    split_at_buckets,
    tap_parts,
)

TINY = BucketCaps(bucket=2048, first=1024, last=512)


def tokens(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return draw_tokens("gpt", torch.Generator().manual_seed(1), batch)


class TwoHeads(nn.Module):
    """A table looked up once and used by two output layers at the end of forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.mid = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(self.emb(idx)))  # [B, T, 16]
        return (h @ self.emb.weight.t()).logsumexp(-1).mean() + (self.norm(h) @ self.emb.weight.t()).mean()


class OneTable(nn.Module):
    """One embedding table; the models below use it in different ways."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)


class UsedBeforeLookup(OneTable):
    """The table is multiplied with before it is looked up: its gradient is dense from the start."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        scale = self.emb.weight.sum()
        return (self.emb(idx) * scale).mean()


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, max_norm=1.0)  # renormalises the looked-up rows in place

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum()


class DetachedUse(OneTable):
    """The table is also read detached (a logged norm, say): that use sends no gradient back."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # [B, T, 16]
        return (h @ self.emb.weight.t()).logsumexp(-1).mean() * self.emb.weight.detach().norm()


class TakesParts:
    """Stands in for the Reducer: takes every part a tap offers."""

    def __init__(self) -> None:
        self.taken: dict[tuple[str, str], torch.Tensor] = {}

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        self.taken[key] = grad.clone()
        return True


def capture(model: nn.Module, *inputs: Any):
    (captured,) = capture_graphs(model, *inputs)
    return captured, find_graph_params(captured.gm, captured.example_inputs, parameter_names(model))


# -- the passes, no process -------------------------------------------------------------------------------------
def test_a_tied_table_is_row_sparse_and_its_output_use_a_part_planned_first() -> None:
    model = tied_gpt()
    captured, params = capture(model, *tokens())
    (table,) = row_sparse_params(params)
    assert table.name == "wte.weight" and [u.node for u in table.parts] == ["logits"]
    split = plan_graph(captured.gm, params, TINY)
    plan = split.plan
    assert plan.buckets[0].names == ("wte.weight@logits",)  # ready first: the output layer's backward
    assert plan.buckets[-1].names == ("wte.weight[rows]",) and plan.buckets[-1].row_sparse
    assert plan.parts == (ParamSpec.of("wte.weight", model.wte.weight).part_at("logits", one_matmul=True),)
    # In-graph, the part (the output layer's one matmul) goes in pieces over its cap; the rows never do.
    assert plan.buckets[0].pieces is not None and len(plan.buckets[0].pieces[1]) == plan.buckets[0].in_graph_collectives > 1
    assert plan.buckets[-1].pieces is None and plan.buckets[-1].in_graph_collectives == 1
    assert sorted(plan.param_names) == sorted(n for n, _ in model.named_parameters())  # parts are not params
    assert len(split.taps) == 1 and split.taps[0].segment == split.num_segments - 1  # feeds the last segment
    assert split.segments[-1].buckets == (0,) and split.segments[0].buckets == (len(plan.buckets) - 1,)
    # The position table is looked up with arange(16) in a 16-row table: every row, so it stays dense.
    assert not any(b.row_sparse for b in plan.buckets[:-1])


def test_a_recompile_that_names_a_part_anew_finds_it_by_its_place_among_the_tables_uses() -> None:
    # A recompile is cut by the plan made before; where it names the output layer's node anew, the part is found
    # at the same place among the table's uses (reduced in-graph, a part not found would send nothing on this rank
    # only: Note [Rows in the compiled backward]).
    model = tied_gpt()
    captured, params = capture(model, *tokens())
    plan = plan_graph(captured.gm, params, TINY).plan
    assert plan_blockers(plan) == [] and parts_named_in(plan, params) is plan
    again = renamed(captured.gm, {"logits": "logits_1"})
    again_params = find_graph_params(again, captured.example_inputs, parameter_names(model))
    named = parts_named_in(plan, again_params)
    assert [p.part for p in named.parts] == ["logits_1"] and named.fingerprint != plan.fingerprint
    assert [b.numel for b in named.buckets] == [b.numel for b in plan.buckets]
    assert [b.pieces for b in named.buckets] == [b.pieces for b in plan.buckets]


def test_two_parts_named_anew_are_matched_in_the_order_their_gradients_are_ready() -> None:
    model = TwoHeads()
    captured, params = capture(model, tokens()[0])
    plan = plan_graph(captured.gm, params, TINY).plan
    first, second = (p.part for p in plan.parts)  # bucket order: the later use's part is ready first
    again = renamed(captured.gm, {first: "head_b", second: "head_a"})  # "head_a" sorts first, yet is used later
    named = parts_named_in(plan, find_graph_params(again, captured.example_inputs, parameter_names(model)))
    assert named is not None and [p.part for p in named.parts] == ["head_b", "head_a"]


def test_a_recompile_with_another_number_of_uses_of_a_tied_table_has_no_match() -> None:
    # Two output layers in the plan, one (and a detached read) in this graph of the same table: no match that
    # every rank would make alike, so this graph has no in-graph variant (``InGraphGate`` refuses to go on).
    captured, params = capture(TwoHeads(), tokens()[0])
    plan = plan_graph(captured.gm, params, TINY).plan
    assert len(plan.parts) == 2
    _, other_params = capture(DetachedUse(), tokens()[0])
    assert parts_named_in(plan, other_params) is None


def test_the_plan_depends_on_the_graph_not_on_the_batch() -> None:
    # How many rows a batch touches is left to the all-reduced mask each iteration, so ranks with different batch
    # sizes (a short last batch, uneven shards) plan alike (Note [Row-sparse gradients], Note [Plan agreement]).
    model = tied_gpt()
    fingerprints = set()
    for batch in (1, 4, 32):  # 32 x 16 lookups could touch every one of the 512 rows
        captured, params = capture(model, *tokens(batch))
        assert [r.name for r in row_sparse_params(params)] == ["wte.weight"]
        fingerprints.add(plan_graph(captured.gm, params, TINY).plan.fingerprint)
    assert len(fingerprints) == 1


def test_the_stitched_graph_with_taps_computes_the_same_values_and_gradients() -> None:
    model = tied_gpt()
    captured, params = capture(model, *tokens())
    split = plan_graph(captured.gm, params, TINY)
    (reference,) = captured.gm(*captured.example_inputs)  # Dynamo's graphs return a tuple
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    reducer = TakesParts()
    split_gm = split_at_buckets(captured.gm, split)
    tap_parts(split_gm, split, lambda tap: GradientTap(reducer, tap.param, tap.part))
    assert "tap_0" in dict(split_gm.named_children())
    (out,) = split_gm(*captured.example_inputs)
    torch.testing.assert_close(out, reference)
    out.backward()
    part = reducer.taken[("wte.weight", "logits")]
    assert part.shape == model.wte.weight.shape and part.abs().amax(1).ne(0).all()  # the output layer: dense
    lookup = model.wte.weight.grad  # what .grad got: the lookups' rows only
    touched = lookup.abs().amax(1).ne(0)
    assert 0 < touched.sum() <= 64 and torch.equal(touched, torch.isin(torch.arange(VOCAB), captured.example_inputs[0]))
    torch.testing.assert_close(lookup + part, expected["wte.weight"])
    for name, p in model.named_parameters():
        if name != "wte.weight":
            torch.testing.assert_close(p.grad, expected[name], msg=name)

    # A tap without a Reducer (or one that declines) lets the gradient through: .grad is the whole gradient.
    model.zero_grad(set_to_none=True)
    plain = split_at_buckets(captured.gm, split)
    tap_parts(plain, split, lambda tap: GradientTap(None, tap.param, tap.part))
    plain(*captured.example_inputs)[0].backward()
    torch.testing.assert_close(model.wte.weight.grad, expected["wte.weight"])


def test_parts_that_the_cut_cannot_separate_are_planned_dense() -> None:
    captured, params = capture(TwoHeads(), tokens()[0])
    (table,) = row_sparse_params(params)
    assert len(table.parts) == 2  # the two output products
    fine = plan_graph(captured.gm, params, BucketCaps(bucket=1, first=1, last=1))
    assert len(fine.taps) == 2 and len({t.segment for t in fine.taps}) == 2 and not misplaced_parts(fine, [table])
    # One bucket for everything: one segment, so no tap can separate anything: no parts, no rows.
    whole = plan_graph(captured.gm, params, BucketCaps(bucket=1 << 30, first=1 << 30, last=1 << 30))
    assert whole.taps == () and not any(b.row_sparse for b in whole.plan.buckets) and whole.plan.parts == ()


def test_a_use_before_the_lookup_or_a_forbidden_lookup_keeps_the_table_dense() -> None:
    captured, params = capture(UsedBeforeLookup(), tokens()[0])
    assert row_sparse_params(params) == []

    captured, params = capture(MaxNorm(), tokens()[0])
    assert row_sparse_params(params) == []


def test_a_detached_use_is_no_part_and_a_get_attr_table_is_not_tapped() -> None:
    captured, params = capture(DetachedUse(), tokens()[0])
    (table,) = row_sparse_params(params)
    assert len(table.parts) == 1  # the output product; the detached norm sends nothing back
    # symbolic_trace brings parameters in with get_attr: copied into every segment, there is no input to tap.
    traced = torch.fx.symbolic_trace(TwoHeads())
    params = find_graph_params(traced, [], parameter_names(traced))
    assert [p.is_input for p in params] == [False] * len(params) and row_sparse_params(params) == []


def test_eager_candidates_are_unshared_embedding_tables() -> None:
    assert embedding_tables(Bag()) == {"emb.weight"}
    assert embedding_tables(tied_gpt()) == {"wpe.weight"}  # wte is also lm_head's weight
    sparse = nn.Embedding(10, 4, sparse=True)
    assert embedding_tables(nn.ModuleDict({"a": sparse, "b": nn.Embedding(10, 4, max_norm=2.0)})) == frozenset()


def spec(name: str, numel: int, **kw: Any) -> ParamSpec:
    return ParamSpec(name, (numel, 4), torch.float32, "cpu", **kw)


def test_a_row_sparse_gradient_gets_a_bucket_of_its_own_and_the_plan_guards_parts() -> None:
    params = [spec("a", 1), spec("table", 100, row_sparse=True), spec("b", 1), spec("c", 1)]
    plan = plan_buckets(params, caps=BucketCaps(bucket=1 << 20, first=1 << 20, last=1 << 20))
    assert [b.names for b in plan.buckets] == [("a",), ("table[rows]",), ("b", "c")]
    assert [b.row_sparse for b in plan.buckets] == [False, True, False]
    dense = plan_buckets([dataclasses.replace(p, row_sparse=False) for p in params], caps=plan.caps)
    assert dense.fingerprint != plan.fingerprint and len(dense.buckets) == 1
    part = spec("table", 100).part_at("head")
    with_part = plan_buckets([part, *params], caps=plan.caps)
    assert with_part.bucket_of("table", "head") < with_part.bucket_of("table") and with_part.parts == (part,)
    assert with_part.fingerprint != plan.fingerprint
    with pytest.raises(AssertionError, match="without a whole gradient in it or after it"):
        BucketPlan((Bucket(0, (spec("table", 100),), 1), Bucket(1, (part,), 1)), plan.caps)
    for mark in ("row_sparse", "sparse_grad"):
        with pytest.raises(AssertionError, match="a gradient planned alone shares it"):
            BucketPlan((Bucket(0, (spec("a", 1), spec("t", 1, **{mark: True})), 1),), plan.caps)
    with pytest.raises(ValueError, match="'table' part 'head' appears twice"):
        plan_buckets([part, part, *params], caps=plan.caps)


def test_a_table_that_went_dense_loses_its_parts_and_its_mark() -> None:
    caps = BucketCaps(bucket=1 << 20, first=1, last=1)
    plan = plan_buckets([spec("t", 10).part_at("head"), spec("a", 1), spec("t", 10, row_sparse=True)], caps=caps)
    assert [b.names for b in plan.buckets] == [("t@head",), ("a",), ("t[rows]",)]
    dense = plan.without_rows(["t"])
    assert [b.names for b in dense.buckets] == [("a",), ("t",)] and [b.index for b in dense.buckets] == [0, 1]
    assert dense.parts == () and dense.caps == plan.caps and plan.without_rows([]) == plan


def test_compose_keeps_each_part_once_and_the_whole_gradient_with_the_first_graph() -> None:
    caps = BucketCaps(bucket=1 << 20, first=1 << 20, last=1 << 20)
    table, part = spec("table", 10, row_sparse=True), spec("table", 10).part_at("head")
    lookups = plan_buckets([spec("x", 1), table], caps=caps)
    heads = plan_buckets([part, spec("y", 1), spec("table", 10)], caps=caps)  # a later graph using it densely
    composite = compose_plans([lookups, heads, heads], [], caps=caps)
    labels = [n for b in composite.buckets for n in b.names]
    assert labels.count("table@head") == 1 and labels.count("table[rows]") == 1 and "table" not in labels
    assert composite.bucket_of("table", "head") < composite.bucket_of("table")


# -- torch.sparse gradients (sparse=True): planned alone, never as rows ---------------------------------------------
def test_sparse_gradient_tables_are_planned_alone_in_graphs_and_eagerly() -> None:
    from models import SparseBags

    model = SparseBags()
    batch = draw_tokens("sparse_bags", torch.Generator().manual_seed(1), 4)
    (captured,) = capture_graphs(model, *batch)
    params = find_graph_params(captured.gm, captured.example_inputs, parameter_names(model))
    marks = {p.spec.name: (p.spec.sparse_grad, p.spec.row_sparse) for p in params}
    assert marks == {"emb.weight": (True, False), "bag.weight": (True, False), "head.weight": (False, False), "head.bias": (False, False)}
    assert sparse_gradient_params(model) == {"emb.weight", "bag.weight"}
    assert embedding_tables(model) == frozenset(), "a sparse=True table is never reduced as rows"
    plan = plan_graph(captured.gm, params, BucketCaps(bucket=1 << 20, first=1 << 20, last=1 << 20)).plan
    alone = [b.names for b in plan.buckets if b.sparse_grad]
    assert sorted(alone) == [("bag.weight[sparse]",), ("emb.weight[sparse]",)], plan.describe()
    unmarked = plan_buckets([dataclasses.replace(p, sparse_grad=False) for b in plan.buckets for p in b.params], caps=plan.caps)
    assert unmarked.fingerprint != plan.fingerprint, "ranks that disagree on sparse gradients must not agree on a plan"
