"""The graph passes on real captured graphs, in one process: no process group, no ranks."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphddp.compiler.capture import capture_graphs, parameter_names
from graphddp.compiler.graph_pipeline import prepare_graph
from graphddp.passes import (
    BucketCaps,
    BucketPlan,
    MiB,
    ParamSpec,
    compose_plans,
    plan_bucket_groups,
    plan_buckets,
    ready_groups,
    split_at_buckets,
)
from graphddp.runtime.plans import GraphPlans, agreed, agreement_entries
from graphddp.tools.workloads import build_workload


def plan_and_split(model: nn.Module, inputs: tuple, bucket_cap: int, first_cap: int, **capture_kwargs):
    """The first half of the graph pipeline the backend and ``graphddp inspect`` run, dense (no row-sparse tables)."""
    (captured,) = capture_graphs(model, *inputs, **capture_kwargs)
    caps = BucketCaps(bucket=bucket_cap, first=first_cap, last=first_cap)  # graphddp's default: last = first
    prepared = prepare_graph(captured.gm, captured.example_inputs, parameter_names(model), caps=caps, row_sparse=False)
    return captured, prepared.params, prepared.plan, prepared.split


SMALL = BucketCaps(bucket=16, first=16, last=16)


def tiny(name: str):
    wl = build_workload(name, size="tiny")
    return wl.model, wl.make_batch(torch.Generator().manual_seed(0))


def test_tied_weight_is_ready_at_its_earliest_use_so_it_lands_in_the_last_bucket() -> None:
    model, batch = tiny("gpt")
    _, params, plan, split = plan_and_split(model, batch, 4096, 2048)
    by_name = {p.spec.name: p for p in params}
    assert by_name["wte.weight"].first_user == "embedding"  # not the lm_head matmul at the end of forward
    assert plan.bucket_of("wte.weight") == len(plan.buckets) - 1
    # DDPOptimizer's rule (last use) would put it with the output layer, in the first bucket:
    assert plan.bucket_of("ln_f.weight") == 0
    assert split.num_segments == len(plan.buckets) and split.segments[0].buckets == (len(plan.buckets) - 1,)


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
@pytest.mark.parametrize("caps", [(MiB, MiB), (2048, 1024), (1, 1), (int(0.25 * MiB), MiB)])
def test_one_segment_per_bucket_on_every_workload_and_cap(name: str, caps: tuple[int, int]) -> None:
    model, batch = tiny(name)
    captured, params, plan, split = plan_and_split(model, batch, *caps)
    assert split.num_segments == len(plan.buckets)
    assert sorted(k for s in split.segments for k in s.buckets) == list(range(len(plan.buckets)))
    # Backward runs segments in reverse: the last segment completes bucket 0, the first the last bucket.
    assert [s.buckets for s in split.segments] == [(k,) for k in reversed(range(len(plan.buckets)))]
    assert set(plan.param_names) == {n for n, p in model.named_parameters()}
    if caps == (MiB, MiB):
        assert len(plan.buckets) == 1
    if caps == (1, 1):  # one bucket per node that uses parameters
        assert len(plan.buckets) == len(ready_groups(params))
    split_gm = split_at_buckets(captured.gm, split)
    assert len([n for n, _ in split_gm.named_children()]) == split.num_segments
    torch.testing.assert_close(split_gm(*captured.example_inputs), captured.gm(*captured.example_inputs))


def test_boundary_bytes_are_symbolic_when_the_batch_is_dynamic() -> None:
    model, batch = tiny("mlp")
    _, _, _, static = plan_and_split(model, batch, 1, 1)
    assert all(isinstance(s.inbound_bytes, int) for s in static.segments)
    assert static.segments[1].inbound_bytes == batch[0].shape[0] * 64 * 4  # [B, 64] float32 after layer 1
    _, _, _, dynamic = plan_and_split(model, batch, 1, 1, dynamic=True)
    symbolic = [s.inbound_bytes for s in dynamic.segments[1:]]
    assert all(isinstance(b, sympy.Expr) and b.free_symbols for b in symbolic), symbolic


class InPlaceTail(nn.Module):
    """The middle segment only updates a buffer in place: it has no output and must be merged."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.add_((self.scale * 2).detach())  # the first use of `scale` feeds only an in-place update
        return self.c(h).sum() * self.scale.sum()


def test_a_segment_without_outputs_is_merged_and_recorded() -> None:
    model = InPlaceTail()
    captured, _, plan, split = plan_and_split(model, (torch.randn(4, 8),), 1, 1)
    assert any(s.extended for s in split.segments)
    assert split.num_segments < len(plan.buckets)
    split_gm = split_at_buckets(captured.gm, split)
    torch.testing.assert_close(split_gm(*captured.example_inputs), captured.gm(*captured.example_inputs))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x))
        h = checkpoint(lambda t: F.relu(self.b(t)), h, use_reentrant=False)
        return self.c(h).sum()


def test_activation_checkpointing_is_split_like_any_node() -> None:
    model = Checkpointed()
    captured, params, plan, split = plan_and_split(model, (torch.randn(4, 8),), 1, 1)
    hop = [n for n in captured.gm.graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    assert hop, "expected a higher-order checkpoint node in the captured graph"
    assert {p.spec.name for p in params if p.first_user == hop[0].name} == {"b.weight", "b.bias"}
    assert split.num_segments == len(plan.buckets) == 3
    split_gm = split_at_buckets(captured.gm, split)
    torch.testing.assert_close(split_gm(*captured.example_inputs), captured.gm(*captured.example_inputs))


def test_compose_plans_keeps_graph_buckets_and_plans_the_rest() -> None:
    def spec(n: str) -> ParamSpec:
        return ParamSpec(n, (4,), torch.float32, "cpu")

    late = plan_buckets([spec("d"), spec("c")], caps=SMALL)
    early = plan_buckets([spec("b")], caps=SMALL)
    composite = compose_plans([early, late], [spec("e"), spec("d"), spec("b"), spec("a")], caps=BucketCaps(bucket=32, first=32, last=32))
    assert [b.names for b in composite.buckets] == [("d",), ("c",), ("b",), ("e", "a")]
    assert composite.source == "graph"


def test_a_weight_tied_across_a_graph_break_belongs_to_the_graph_that_runs_first() -> None:
    def spec(n: str) -> ParamSpec:
        return ParamSpec(n, (4,), torch.float32, "cpu")

    embedding_graph = plan_buckets([spec("pos"), spec("wte")], caps=SMALL)
    head_graph = plan_buckets([spec("wte"), spec("ln")], caps=SMALL)
    composite = compose_plans([embedding_graph, head_graph], [], caps=SMALL)
    # The head's backward runs first but cannot complete wte: wte waits for the embedding graph's backward.
    assert [b.names for b in composite.buckets] == [("ln",), ("pos",), ("wte",)]


def test_a_recompile_finds_its_graphs_plan_and_agreement_needs_every_rank() -> None:
    specs = [ParamSpec(n, (4,), torch.float32, "cpu") for n in ("a", "b", "c")]
    current = plan_buckets(specs[::-1], caps=SMALL)
    plans = GraphPlans(specs)
    plans.propose("g0", current, current)
    # Proposed even when equal to what runs: adopting it ends the ready-order rebuild (Note [Plan agreement]).
    assert plans.proposed is not None and plans.proposed.fingerprint == current.fingerprint and plans.tokens() != (0, 0)
    # A recompile (same parameters) is cut by the plan made before and proposes nothing (Note [Plan agreement]).
    assert plans.plan_for(frozenset("abc")) is current and plans.plan_for(frozenset("ab")) is None
    other = plan_buckets(specs, caps=SMALL)
    plans = GraphPlans(specs)
    plans.propose("g1", other, current)
    assert list(plans.graphs) == ["g1"] and isinstance(plans.proposed, BucketPlan)
    mine = plans.tokens()
    everyone = [3 * v for v in agreement_entries(mine)]
    assert agreed(mine, everyone, ranks=3) is True
    other = (mine[0], mine[1] + 1)  # a plan whose first 20-bit slice collides but whose second does not
    assert agreed(mine, [a + b for a, b in zip([2 * v for v in agreement_entries(mine)], agreement_entries(other))], ranks=3) is False
    assert agreed(mine, [2 * v for v in agreement_entries(mine)], ranks=3) is False  # one rank proposed nothing
    assert agreed((0, 0), [0, 0, 0, 0], ranks=3) is None


def test_the_strategy_is_part_of_what_ranks_agree_on() -> None:
    # Same plan, one rank reducing in-graph and the other split: different collectives, so different tokens.
    specs = [ParamSpec(n, (4,), torch.float32, "cpu") for n in ("a", "b", "c")]
    current = plan_buckets(specs[::-1], caps=SMALL)
    split, in_graph = GraphPlans(specs), GraphPlans(specs)
    split.propose("g0", current, current, "split")
    in_graph.propose("g0", current, current, "in_graph")
    assert split.proposed.fingerprint == in_graph.proposed.fingerprint and split.tokens() != in_graph.tokens()
    assert split.in_graph_sets() == frozenset() and in_graph.in_graph_sets() == {frozenset("abc")}


def test_the_blocks_of_a_big_gradient_are_part_of_what_ranks_agree_on() -> None:
    # Note [Gradient pieces]: the same buckets under another cap cut a big weight into other blocks in-graph, so
    # other collectives: other tokens, though the fingerprint (the buckets' content) is the same.
    specs = [ParamSpec("w", (64, 16), torch.float32, "cpu", one_matmul=True), ParamSpec("b", (64,), torch.float32, "cpu")]
    tokens = []
    for cap in (1024, 2048):
        plan = plan_bucket_groups([specs], caps=BucketCaps(bucket=cap, first=cap, last=cap))
        plans = GraphPlans(specs)
        plans.propose("g0", plan, plan, "in_graph")
        tokens.append((plan.fingerprint, plan.buckets[0].pieces, plans.tokens()))
    (fingerprint_a, pieces_a, tokens_a), (fingerprint_b, pieces_b, tokens_b) = tokens
    assert fingerprint_a == fingerprint_b and pieces_a != pieces_b and tokens_a != tokens_b



def test_cuts_fall_inside_an_autocast_region_and_each_segment_enters_it_again() -> None:
    from models import AutocastInside

    torch.manual_seed(0)
    model = AutocastInside()
    x = torch.randn(4, 12)
    captured, _, plan, split = plan_and_split(model, (x,), 1, 1)
    assert split.num_segments == len(plan.buckets) == 4
    split_gm = split_at_buckets(captured.gm, split)
    entered = [
        name
        for name, sub in split_gm.named_children()
        if any(n.target is torch.amp._enter_autocast for n in sub.graph.nodes)
    ]
    assert len(entered) >= 3  # the region spans the first three segments: each enters and leaves it
    (out,) = split_gm(*captured.example_inputs)
    torch.testing.assert_close(out, model(x))
