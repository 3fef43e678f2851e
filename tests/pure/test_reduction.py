"""In-graph reduction at the graph level (Note [In-graph reduction]), in one process: the choice of strategy, the
wait-sinking pass, and the backward graph AOTAutograd makes of a graph with the buckets' all-reduces inserted."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import pytest
import torch
import torch.distributed  # noqa: F401  (registers the functional collectives' ops)
from graphs import renamed, traced
from models import Wide, tied_gpt
from models import tokens as draw_tokens
from torch import fx, nn

from graphddp.compiler.capture import capture_graphs, parameter_names
from graphddp.compiler.graph_pipeline import prepare_graph
from graphddp.compiler.in_graph import in_graph_compiler, insert_bucket_reductions
from graphddp.passes import (
    BucketCaps,
    BucketPlan,
    ParamSpec,
    choose_reduction,
    compute_pieces_separately,
    divide_while_gathering,
    find_graph_params,
    launch_collectives_early,
    parts_named_in,
    plan_blockers,
    plan_bucket_groups,
    plan_buckets,
    reduce_in_place,
    schedule_reductions,
    sink_bucket_steps,
    sink_rows_nodes,
    sink_waits,
)

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
STEP = torch.ops.graphddp.step_bucket.default
ROWS = torch.ops.graphddp.reduce_rows.default


def test_auto_reduces_in_graph_unless_something_needs_the_reducer() -> None:
    assert choose_reduction("auto", []).strategy == "in_graph"
    assert choose_reduction("in_graph", []).reason == "asked for"
    chosen = choose_reduction("auto", ["a comm hook", "find_unused_parameters"])
    assert chosen.strategy == "split" and "a comm hook; find_unused_parameters" in chosen.reason
    assert choose_reduction("in_graph", ["a comm hook"]).strategy == "split"  # cannot: split, and the reason says why
    assert choose_reduction("split", []).strategy == "split"
    with pytest.raises(ValueError, match="'auto', 'split', 'in_graph'.*got 'ingraph'"):
        choose_reduction("ingraph", [])


def test_sparse_buckets_block_in_graph_reduction_and_rows_do_not() -> None:
    table = torch.nn.Parameter(torch.zeros(10, 4))
    dense = plan_buckets([ParamSpec.of("emb.weight", table)], caps=BucketCaps())
    assert plan_blockers(dense) == []
    rows = plan_buckets([ParamSpec.of("emb.weight", table, row_sparse=True)], caps=BucketCaps())
    assert plan_blockers(rows) == []  # an opaque node reduces them in-graph (Note [Rows in the compiled backward])
    sparse = plan_buckets([ParamSpec.of("emb.weight", table, sparse_grad=True)], caps=BucketCaps())
    assert plan_blockers(sparse) == ["sparse gradients"]
    # A comm hook registered after the table was planned as rows: the Reducer runs it, on the split.
    assert plan_blockers(rows, rows_in_use=False) == ["tables planned as rows, and a comm hook registered since"]


def _collective_graph() -> fx.Graph:
    """x -> all_reduce -> wait -> view -> output, with a matmul in between that does not need the result."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    reduced = graph.call_function(ALL_REDUCE, (x, "sum", "0"))
    waited = graph.call_function(WAIT, (reduced,))
    view = graph.call_function(torch.ops.aten.view.default, (waited, [4]))
    later = graph.call_function(torch.ops.aten.mm.default, (w, w))
    graph.output((view, later))
    return graph


def _linear_backward(mutation: bool = False) -> fx.Graph:
    """A linear layer's backward as autograd orders it: the input gradient first, then the weight gradient and its
    bucket's all-reduce; with ``mutation``, an in-place op on the incoming gradient between the two."""
    graph = fx.Graph()
    x, w, grad_out = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("grad_out")
    grad_in = graph.call_function(torch.ops.aten.mm.default, (grad_out, w))  # [B, IN]: only earlier layers need it
    if mutation:
        graph.call_function(torch.ops.aten.add_.Tensor, (x, 1))
    grad_w = graph.call_function(torch.ops.aten.mm.default, (graph.call_function(torch.ops.aten.t.default, (grad_out,)), x))
    flat = graph.call_function(torch.ops.aten.view.default, (grad_w, [-1]))
    reduced = graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (flat, "sum", "0")),))
    graph.output((grad_in, reduced))
    return graph


def _order(graph: fx.Graph) -> list[str]:
    return [str(n.target).split(".")[-2] for n in graph.nodes if n.op == "call_function"]


def test_collectives_go_out_before_the_compute_they_do_not_need() -> None:
    """Issue 27, item 1 (weight gradients first): the weight gradient and its all-reduce before the input gradient."""
    graph = _linear_backward()
    assert _order(graph) == ["mm", "t", "mm", "view", "all_reduce", "wait_tensor"]
    assert launch_collectives_early(graph) > 0
    assert _order(graph) == ["t", "mm", "view", "all_reduce", "mm", "wait_tensor"]
    assert launch_collectives_early(graph) == 0  # already as early as it goes
    graph.lint()
    assert schedule_reductions(_linear_backward())[1] > 0


def test_nothing_crosses_a_mutation() -> None:
    graph = _linear_backward(mutation=True)
    before = _order(graph)
    launch_collectives_early(graph)
    assert _order(graph) == before  # the weight gradient reads x after the add_: it may not move above it


def test_sink_waits_moves_the_wait_and_its_views_behind_later_compute() -> None:
    graph = _collective_graph()
    assert sink_waits(graph) == 1
    order = [n.target for n in graph.nodes if n.op == "call_function"]
    assert order == [ALL_REDUCE, torch.ops.aten.mm.default, WAIT, torch.ops.aten.view.default]
    assert sink_waits(graph) == 0  # already as late as it goes
    gm = fx.GraphModule(nn.Module(), graph)
    assert gm.code.index("mm") < gm.code.index("wait_tensor")


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


def _backward_of_reducing_graph(
    caps: BucketCaps, model: nn.Module | None = None, schedule: Any = sink_waits, signal: bool = False, step_key: Any = None,
    world_size: int = 2, wire: torch.dtype | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule, BucketPlan, int]:
    model = model if model is not None else Layers()
    dtype = next(model.parameters()).dtype
    (captured,) = capture_graphs(model, torch.randn(5, 8, dtype=dtype))
    prepared = prepare_graph(captured.gm, captured.example_inputs, parameter_names(model), caps=caps, row_sparse=False)
    reducing = insert_bucket_reductions(
        captured.gm, prepared.params, prepared.plan, group_names=("0",), divisor=world_size, signal=signal,
        step_key=step_key, wire=wire,
    )
    example_inputs = [*captured.example_inputs, *([torch.zeros(1, requires_grad=True)] if signal else [])]
    forward, backward = traced(reducing, example_inputs, schedule)
    return forward, backward, prepared.plan, prepared.split.num_segments


def test_k_buckets_give_k_all_reduces_and_k_waits_in_the_backward_each_wait_after_later_compute() -> None:
    forward, backward, plan, _ = _backward_of_reducing_graph(BucketCaps(bucket=1200, first=1200, last=1200))
    k = len(plan.buckets)
    assert k >= 3, plan.table_rows()
    nodes = list(backward.graph.nodes)
    reduces = [i for i, n in enumerate(nodes) if n.target is ALL_REDUCE]
    waits = [i for i, n in enumerate(nodes) if n.target is WAIT]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(reduces) == k and len(waits) == k
    assert not any(n.target in (ALL_REDUCE, WAIT) for n in forward.graph.nodes)
    # Each bucket's all-reduce is issued before the backward's remaining matmuls, and waited for after all of them.
    assert reduces[0] < matmuls[-1], "the first bucket goes out while earlier layers' backward still computes"
    assert min(waits) > matmuls[-1]
    # Bucket k's all-reduce carries exactly its parameters' elements, divided by the world size before it.
    sizes = sorted(n.args[0].meta["val"].numel() for n in nodes if n.target is ALL_REDUCE)
    assert sizes == sorted(b.numel for b in plan.buckets)


def test_the_first_bucket_carries_the_abandon_signal_and_its_sum_is_the_signals_gradient() -> None:
    """Note [Abandoned backward], in-graph: the signal is one more element of the first bucket's all-reduce (no
    collective of its own), its value times the divisor (the average divides it again, so the ranks' flags are
    summed), and what comes back is the signal input's gradient."""
    forward, backward, plan, _ = _backward_of_reducing_graph(BucketCaps(bucket=1200, first=1200, last=1200), signal=True)
    reduces = [n for n in backward.graph.nodes if n.target is ALL_REDUCE]
    assert len(reduces) == len(plan.buckets)  # no collective of its own
    sizes = [n.args[0].meta["val"].numel() for n in reduces]
    assert sizes[0] == plan.buckets[0].numel + 1 and sizes[1:] == [b.numel for b in plan.buckets[1:]], (sizes, plan.table_rows())
    assert [n for n in forward.graph.nodes if n.op == "placeholder"][-1].meta["val"].shape == (1,)
    (output,) = [n for n in backward.graph.nodes if n.op == "output"]
    gradients = output.args[0]
    assert gradients[-1] is not None and gradients[-1].meta["val"].shape == (1,)  # the signal's gradient, last
    plain_forward, plain_backward, _, _ = _backward_of_reducing_graph(BucketCaps(bucket=1200, first=1200, last=1200))
    assert [n.args[0].meta["val"].numel() for n in plain_backward.graph.nodes if n.target is ALL_REDUCE][0] == plan.buckets[0].numel


@pytest.mark.parametrize(
    ("dtype", "wire", "ranks", "apart"),
    [
        (torch.bfloat16, None, 256, False),
        (torch.bfloat16, None, 257, True),
        (torch.float16, None, 2049, True),
        (torch.float32, None, 2049, False),
        (torch.bfloat16, torch.float16, 257, True),  # the fp16 sum is cast back to bf16: 257 -> 256
        (torch.float32, torch.bfloat16, 257, True),  # fp32 gradients sent as bf16 (bf16_compress_hook)
    ],
)
def test_the_abandon_signal_goes_apart_in_float32_where_the_first_buckets_dtype_cannot_count_the_ranks(
    dtype: torch.dtype, wire: torch.dtype | None, ranks: int, apart: bool
) -> None:
    """In bfloat16 a sum of 257 ones is 256: "every rank abandoned" would read as "256 of 257" and raise on every
    rank. Where the gradients' dtype or the wire's (a compressing comm hook's) cannot count the ranks, the flag goes
    in a [1] float32 all-reduce of its own."""
    caps = BucketCaps(bucket=1200, first=1200, last=1200)
    _, backward, plan, _ = _backward_of_reducing_graph(caps, Layers().to(dtype), signal=True, world_size=ranks, wire=wire)
    reduces = [n.args[0].meta["val"] for n in backward.graph.nodes if n.target is ALL_REDUCE]
    sizes = [(value.numel(), value.dtype) for value in reduces]
    buckets = [(b.numel, wire or dtype) for b in plan.buckets]
    if apart:
        assert sorted(sizes, key=str) == sorted([*buckets, (1, torch.float32)], key=str)
    else:
        assert sizes == [(buckets[0][0] + 1, wire or dtype), *buckets[1:]]
    assert torch.tensor(1.0, dtype=torch.bfloat16).expand(257).cumsum(0)[-1] == 256  # why: the sum stops at 256


ALL_REDUCE_IN_PLACE = torch.ops._c10d_functional.all_reduce_.default


@pytest.mark.parametrize("cap", [1200, 300])
def test_an_op_by_op_backward_reduces_each_bucket_in_the_tensor_it_gathered_it_in(cap: int) -> None:
    """aot_eager runs the backward op by op, so a functional all-reduce clones its input and the average writes a
    tensor of its own: two copies of every bucket that Inductor fuses away. ``reduce_in_place`` divides the
    gathered bucket in place and all-reduces it in place; a block of a big gradient (300 B caps: a view of it) is
    divided into a tensor of its own, which its all-reduce then reuses."""

    def schedule(graph: fx.Graph) -> None:
        schedule_reductions(graph)
        assert reduce_in_place(graph) == len([n for n in graph.nodes if n.target is ALL_REDUCE_IN_PLACE])

    _, backward, plan, _ = _backward_of_reducing_graph(BucketCaps(bucket=cap, first=cap, last=cap), schedule=schedule, signal=True)
    nodes = list(backward.graph.nodes)
    assert not any(n.target is ALL_REDUCE for n in nodes)
    reduces = [n for n in nodes if n.target is ALL_REDUCE_IN_PLACE]
    assert len(reduces) == sum(len(b.pieces[1]) if b.pieces else 1 for b in plan.buckets) >= 3
    for reduce in reduces:
        (divided,) = reduce.all_input_nodes
        assert list(divided.users) == [reduce] and divided.target in (torch.ops.aten.div.Tensor, torch.ops.aten.div_.Tensor)
        gathered = divided.args[0]
        # In place exactly where the division's input is the bucket's own gathered copy, not a view of a gradient.
        assert (divided.target is torch.ops.aten.div_.Tensor) == (gathered.target is torch.ops.aten.cat.default), gathered.target
    assert any(n.target is torch.ops.aten.div_.Tensor for n in nodes)
    assert (cap == 300) == any(n.target is torch.ops.aten.div.Tensor for n in nodes)  # the blocks: views
    # A graph input is never overwritten.
    graph = _collective_graph()
    assert reduce_in_place(graph) == 0 and not any(n.target is ALL_REDUCE_IN_PLACE for n in graph.nodes)


def _gathered_and_divided(also_read: str | None, divided: torch.dtype = torch.float32) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """x -> cat -> div (into ``divided``) -> all_reduce -> wait -> output; ``also_read`` ("cat", "div") is an
    output too."""
    graph, nodes = fx.Graph(), {}
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    nodes["cat"] = graph.call_function(torch.ops.aten.cat.default, ([x, x],))
    nodes["div"] = graph.call_function(torch.ops.aten.div.Tensor, (nodes["cat"], 2))
    reduced = graph.call_function(ALL_REDUCE, (nodes["div"], "sum", "0"))
    waited = graph.call_function(WAIT, (reduced,))
    nodes["cat"].meta["val"] = torch.empty(8)
    for node in (nodes["div"], reduced, waited):
        node.meta["val"] = torch.empty(8, dtype=divided)
    graph.output((waited, nodes[also_read]) if also_read else (waited,))
    return graph, nodes


@pytest.mark.parametrize("wire", [None, torch.float16])
def test_for_a_fusing_compiler_each_gradient_is_divided_as_it_is_gathered(wire: torch.dtype | None) -> None:
    """``divide_while_gathering``: ``div(cat(gs))`` becomes ``cat(div(g) ...)`` (through the wire's cast), so Inductor
    writes each quotient straight into the bucket, one pass over it. A block of a big gradient (a view, no
    ``cat``) is left as it is."""
    rewritten: list[int] = []

    def schedule(graph: fx.Graph) -> None:
        schedule_reductions(graph)
        rewritten.append(divide_while_gathering(graph))

    caps = BucketCaps(bucket=300, first=300, last=300)
    _, backward, plan, _ = _backward_of_reducing_graph(caps, schedule=schedule, signal=True, wire=wire)
    reduces = [n for n in backward.graph.nodes if n.target is ALL_REDUCE]
    gathered = [r.args[0] for r in reduces if r.args[0].target is torch.ops.aten.cat.default]
    assert rewritten == [len(gathered)] and len(gathered) == len(plan.buckets) >= 3  # a cat per bucket
    for cat in gathered:
        for piece in cat.args[0]:  # each piece divided on its own, after its cast to the wire
            assert piece.target is torch.ops.aten.div.Tensor and piece.args[1] == 2 and piece.meta["val"].dtype == (wire or torch.float32)
            assert (piece.args[0].target is torch.ops.aten._to_copy.default) == (wire is not None)
        assert cat.meta["val"].shape[0] == sum(p.meta["val"].numel() for p in cat.args[0])
    assert not any(n.target is torch.ops.aten.div.Tensor and n.args[0].target is torch.ops.aten.cat.default for n in backward.graph.nodes)
    others = [r.args[0] for r in reduces if r.args[0] not in gathered]  # the blocks: a division of a view
    assert others and all(d.target is torch.ops.aten.div.Tensor for d in others)


def test_a_gathered_bucket_something_else_reads_is_divided_after_it_as_before() -> None:
    for also_read in ("cat", "div"):
        graph, nodes = _gathered_and_divided(also_read)
        assert divide_while_gathering(graph) == 0 and nodes["div"].args[0] is nodes["cat"]
    graph, nodes = _gathered_and_divided(None)
    assert divide_while_gathering(graph) == 1
    (reduce,) = [n for n in graph.nodes if n.target is ALL_REDUCE]
    assert reduce.args[0].target is torch.ops.aten.cat.default and [p.target for p in reduce.args[0].args[0]] == [torch.ops.aten.div.Tensor] * 2


def test_a_tensor_something_else_reads_is_not_overwritten() -> None:
    graph, nodes = _gathered_and_divided(None)  # the plain case: both in place
    assert reduce_in_place(graph) == 1 and nodes["div"].target is torch.ops.aten.div_.Tensor
    graph, nodes = _gathered_and_divided("div")
    assert reduce_in_place(graph) == 0 and nodes["div"].target is torch.ops.aten.div.Tensor
    graph, nodes = _gathered_and_divided("cat")  # the all-reduce may still reuse the division's result
    assert reduce_in_place(graph) == 1 and nodes["div"].target is torch.ops.aten.div.Tensor
    graph, nodes = _gathered_and_divided(None, torch.float64)  # a promoting division cannot write in place
    assert reduce_in_place(graph) == 1 and nodes["div"].target is torch.ops.aten.div.Tensor


@pytest.mark.parametrize("cap", [1200, 300])  # 300 B: each weight in blocks of rows, an all-reduce and wait each
def test_each_buckets_optimizer_step_runs_after_all_compute_right_after_its_waits(cap: int) -> None:
    """Note [Steps in the compiled backward]: one step node per bucket, with that bucket's parameters' averaged
    gradients; after scheduling, every step comes after the last matmul (no kernel reads a parameter a step has
    changed), right behind its own bucket's waits and ahead of the next bucket's, so a bucket is stepped while
    the later ones are still in flight."""
    keys: dict[int, tuple[str, ...]] = {}

    def step_key(names: list[str]) -> int:
        keys[100 + len(keys)] = tuple(names)
        return 100 + len(keys) - 1

    caps = BucketCaps(bucket=cap, first=cap, last=cap)
    _, backward, plan, _ = _backward_of_reducing_graph(caps, schedule=schedule_reductions, signal=True, step_key=step_key)
    assert (cap == 300) == any(b.pieces for b in plan.buckets)
    nodes = list(backward.graph.nodes)
    steps = [n for n in nodes if n.target is STEP]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert len(steps) == len(plan.buckets) == len(keys) >= 3
    assert {n.args[0] for n in steps} == set(keys)
    for step in steps:  # each step hands over as many gradients as its bucket has parameters
        assert len(step.args[1]) == len(keys[step.args[0]])
    assert min(nodes.index(n) for n in steps) > max(matmuls)
    waits_then_step, group = [], []
    for node in (n for n in nodes if n.target in (WAIT, STEP)):
        if node.target is WAIT:
            group.append(node)
        else:
            waits_then_step.append((group, node))
            group = []
    assert not group and min(nodes.index(w) for w, _ in [(g[0], s) for g, s in waits_then_step]) > max(matmuls)
    for waits, step in waits_then_step:  # the waits just before a step are exactly the ones it needs
        assert set(waits) == {a for a in _ancestors(step) if a.target is WAIT}, [n.name for n in waits]
    (output,) = [n for n in nodes if n.op == "output"]
    assert output.args[0][-1] is not None  # the steps' zeros reach the signal's gradient: the nodes stay
    _, plain, _, _ = _backward_of_reducing_graph(caps, schedule=schedule_reductions, signal=True)
    assert not any(n.target is STEP for n in plain.graph.nodes)  # no optimizer: no step node


def _ancestors(node: fx.Node) -> set[fx.Node]:
    found, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def test_a_step_goes_behind_compute_that_reads_the_parameter_it_changes() -> None:
    """A bucket's step node traced right after its wait, ahead of the input gradient that reads the weight the
    step changes in place: ``schedule_reductions`` puts the step, and the zero it feeds into the signal's gradient,
    after that matmul (``sink_bucket_steps``); the wait follows it down."""
    graph = fx.Graph()
    x, w, grad_out, signal = (graph.placeholder(name) for name in ("x", "w", "grad_out", "signal"))
    grad_w = graph.call_function(torch.ops.aten.mm.default, (graph.call_function(torch.ops.aten.t.default, (grad_out,)), x))
    reduced = graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (grad_w, "sum", "0")),))
    zero = graph.call_function(STEP, (7, [reduced]))
    signal_grad = graph.call_function(torch.ops.aten.add.Tensor, (signal, zero))
    grad_in = graph.call_function(torch.ops.aten.mm.default, (grad_out, w))  # reads w
    graph.output((grad_in, reduced, signal_grad))
    assert _order(graph) == ["t", "mm", "all_reduce", "wait_tensor", "step_bucket", "add", "mm"]
    schedule_reductions(graph)
    assert _order(graph) == ["t", "mm", "all_reduce", "mm", "wait_tensor", "step_bucket", "add"]
    assert sink_bucket_steps(graph) == 1 and _order(graph)[-3:] == ["wait_tensor", "step_bucket", "add"]


def test_a_tables_rows_node_goes_to_the_tail_with_its_tables_step() -> None:
    """A bucket's step and a tied table's: the table's rows node blocks until the link is done, so left where
    autograd traced it (before every step) it would hold the bucket's step behind the last all-reduce;
    ``sink_bucket_steps`` moves it, as a wait, to just before the table's step."""
    graph = fx.Graph()
    grad_w, grad_table, part, signal = (graph.placeholder(name) for name in ("grad_w", "grad_table", "part", "signal"))
    reduced = graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (grad_w, "sum", "0")),))
    part_reduced = graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (part, "sum", "0")),))
    rows = graph.call_function(ROWS, (grad_table, "0", 2, -1))
    table = graph.call_function(torch.ops.aten.add.Tensor, (rows, part_reduced))
    zero = graph.call_function(STEP, (7, [reduced]))
    zero_table = graph.call_function(STEP, (8, [table]))
    total = graph.call_function(torch.ops.aten.add.Tensor, (zero, zero_table))
    graph.output((reduced, table, graph.call_function(torch.ops.aten.add.Tensor, (signal, total))))
    assert sink_bucket_steps(graph) == 2
    order = [n.name for n in graph.nodes]
    assert order.index(zero.name) < order.index(rows.name) < order.index(zero_table.name), order


def _collectives_of(gm: fx.GraphModule, params: list, plan: BucketPlan, example_inputs: list) -> list[tuple[str, int]]:
    """The collectives the in-graph backward of ``gm`` issues, in order: (op, elements)."""
    reducing = insert_bucket_reductions(gm, params, plan, group_names=("0",), divisor=2)
    _, backward = traced(reducing, example_inputs, schedule_reductions)
    return [(str(n.target), n.args[0].meta["val"].numel()) for n in backward.graph.nodes if n.target in (ALL_REDUCE, ROWS)]


def test_a_recompile_that_names_a_tied_tables_part_anew_issues_the_same_collectives_in_the_same_order() -> None:
    """A recompile on one rank, cut by the plan made before, whose output layer's node has another name: its
    in-graph backward must issue what every other rank's does (``graphddp.passes.parts_named_in``). Before, the
    part's bucket sent nothing, or, fed zeros from the lookups, sent them last."""
    model = tied_gpt()
    (captured,) = capture_graphs(model, *draw_tokens("gpt", torch.Generator().manual_seed(1), 4))
    names = parameter_names(model)
    prepared = prepare_graph(captured.gm, captured.example_inputs, names, caps=BucketCaps(bucket=2048, first=1024, last=512), row_sparse=True)
    assert prepared.plan.parts and any(b.pieces for b in prepared.plan.buckets)  # the part goes in pieces
    original = _collectives_of(captured.gm, prepared.params, prepared.plan, captured.example_inputs)
    again = renamed(captured.gm, {prepared.plan.parts[0].part: "logits_1"})
    params = find_graph_params(again, captured.example_inputs, names)
    named = parts_named_in(prepared.plan, params)
    assert named is not None and named.parts[0].part == "logits_1"
    assert _collectives_of(again, params, named, captured.example_inputs) == original
    assert original[0] == (str(ALL_REDUCE), prepared.plan.buckets[0].pieces[1][0] * model.wte.weight.shape[1])  # the part's first block first
    with pytest.raises(AssertionError, match="no use in this graph contributes it"):
        insert_bucket_reductions(again, params, prepared.plan, group_names=("0",), divisor=2)


def test_a_rows_node_traced_in_the_middle_of_backward_goes_behind_the_compute_that_does_not_need_it() -> None:
    """A table looked up after the first layer: autograd traces its rows node before the earlier layer's backward,
    where its wait for the link would stall that compute; it goes just before the use of its result, and the
    earlier layer's bucket goes out before it (each rank moves it alike)."""
    graph = fx.Graph()
    names = ("grad_table", "part", "grad_out", "x", "w")
    grad_table, part, grad_out, x, w = (graph.placeholder(name) for name in names)
    table = graph.call_function(ROWS, (grad_table, "0", 2, -1, part))  # the parts' average: the rows' base
    grad_w = graph.call_function(torch.ops.aten.mm.default, (grad_out, x))  # the earlier layer's weight gradient
    reduced = graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (grad_w, "sum", "0")),))
    grad_x = graph.call_function(torch.ops.aten.mm.default, (grad_out, w))
    graph.output((table, reduced, grad_x))
    assert sink_rows_nodes(graph) == 1
    assert _order(graph) == ["mm", "all_reduce", "wait_tensor", "mm", "reduce_rows"]
    assert sink_rows_nodes(graph) == 0  # already where it goes
    schedule_reductions(graph)
    assert _order(graph) == ["mm", "all_reduce", "mm", "reduce_rows", "wait_tensor"]


def test_a_rows_node_does_not_cross_a_node_with_side_effects() -> None:
    graph = fx.Graph()
    grad_table, buffer, grad_w = graph.placeholder("grad_table"), graph.placeholder("buffer"), graph.placeholder("grad_w")
    rows = graph.call_function(ROWS, (grad_table, "0", 2, -1))
    graph.call_function(torch.ops.aten.add_.Tensor, (buffer, grad_w))  # mutates: nothing crosses it
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (rows, 2)),))
    assert sink_rows_nodes(graph) == 0 and _order(graph) == ["reduce_rows", "add_", "mul"]


def test_the_reducing_graph_is_not_split() -> None:
    # The split variant of the same graph is cut into one segment per bucket; the reducing one is one graph.
    _, backward, plan, segments = _backward_of_reducing_graph(BucketCaps(bucket=1200, first=1200, last=1200))
    assert segments == len(plan.buckets) > 1
    assert sum(1 for n in backward.graph.nodes if n.op == "output") == 1


def test_inserted_reductions_are_identities_in_forward() -> None:
    model = Layers()
    x = torch.randn(5, 8)
    (captured,) = capture_graphs(model, x)
    prepared = prepare_graph(captured.gm, captured.example_inputs, parameter_names(model), caps=BucketCaps(), row_sparse=False)
    reducing = insert_bucket_reductions(captured.gm, prepared.params, prepared.plan, group_names=("0",), divisor=2)
    calls = [n for n in reducing.graph.nodes if n.op == "call_function" and n.target.__name__ == "reduce_bucket"]
    assert len(calls) == len(prepared.plan.buckets)
    assert all(any(u.target is operator.getitem for u in c.users) for c in calls)
    with torch.no_grad():
        torch.testing.assert_close(reducing(*_real_inputs(captured, model, x))[0], model(x))


def test_each_bucket_is_reduced_on_its_channel_in_turn() -> None:
    # Note [Channels]: bucket i names group i % k, the rule the Reducer follows too (graphddp.passes.bucket_channel).
    model = Layers()
    (captured,) = capture_graphs(model, torch.randn(5, 8))
    caps = BucketCaps(bucket=1200, first=1200, last=1200)
    prepared = prepare_graph(captured.gm, captured.example_inputs, parameter_names(model), caps=caps, row_sparse=False)
    assert len(prepared.plan.buckets) >= 4
    reducing = insert_bucket_reductions(captured.gm, prepared.params, prepared.plan, group_names=("g0", "g1", "g2"), divisor=2)
    calls = [n for n in reducing.graph.nodes if n.op == "call_function" and n.target.__name__ == "reduce_bucket"]
    by_bucket = {}
    for call in calls:  # a call's parameters are one bucket's
        members = {a.name for a in call.args[7:]}
        (bucket,) = [b.index for b in prepared.plan.buckets if members <= {p.node for p in prepared.params if p.spec in b.params}]
        by_bucket[bucket] = call.args[0]
    assert by_bucket == {b.index: ("g0", "g1", "g2")[b.index % 3] for b in prepared.plan.buckets}


def _real_inputs(captured, model: nn.Module, x: torch.Tensor) -> list:
    by_name = dict(model.named_parameters())
    names = parameter_names(model)
    values = []
    for value in captured.example_inputs:
        if isinstance(value, nn.Parameter):
            values.append(by_name[names[id(value)]])
        else:
            values.append(x)
    return values


def test_only_aot_autograd_compilers_can_reduce_in_graph() -> None:
    assert in_graph_compiler(torch._TorchCompileInductorWrapper(None, None, None)) is not None
    assert in_graph_compiler(torch._dynamo.lookup_backend("aot_eager")) is not None
    assert in_graph_compiler(torch._TorchCompileWrapper("aot_eager", None, None, None)) is not None
    assert in_graph_compiler(torch._dynamo.lookup_backend("eager")) is None
    assert in_graph_compiler(lambda gm, inputs: gm.forward) is None


# -- Note [Gradient pieces] ----------------------------------------------------------------------------------------
def test_a_parameter_over_its_cap_is_cut_into_blocks_of_rows() -> None:
    def pieces(*specs: ParamSpec, cap: int) -> object:
        return plan_buckets(list(specs), caps=BucketCaps(bucket=cap, first=cap, last=cap)).buckets[0].pieces

    big = dataclasses.replace(ParamSpec.of("w", torch.zeros(64, 100)), one_matmul=True)  # 25 600 bytes
    assert pieces(big, cap=10_000) == (0, (22, 21, 21))
    assert pieces(big, cap=30_000) is None
    assert pieces(dataclasses.replace(big, one_matmul=False), cap=10_000) is None  # a tied table's, a conv's: whole
    two_rows = dataclasses.replace(ParamSpec.of("w", torch.zeros(2, 10_000)), one_matmul=True)
    assert pieces(two_rows, cap=4_000) == (0, (1, 1))  # no more blocks than rows
    assert pieces(ParamSpec.of("b", torch.zeros(10_000)), cap=1000) is None  # 1-D
    assert pieces(ParamSpec.of("e", torch.zeros(64, 100), row_sparse=True), cap=1000) is None  # its rows travel
    # A graph plan keeps a layer's weight and bias together: the bias goes with the weight's first block.
    graph_plan = plan_bucket_groups([[ParamSpec.of("b", torch.zeros(64)), big]], caps=BucketCaps(bucket=10_000, first=10_000, last=10_000))
    assert graph_plan.buckets[0].pieces == (1, (22, 21, 21))


def test_a_big_gradient_at_the_head_of_backward_goes_in_blocks_that_grow_as_the_ramp() -> None:
    """Note [Gradient pieces]: in the first bucket and the head ramp's, a big gradient's blocks start at the
    bucket's cap and double up to the middle cap, as the buckets after them would; at the tail, after a first
    block of the cap, they halve down to the bucket's cap, as the tail's buckets do; in the middle and without
    ramps every block is about the bucket's cap."""
    big = dataclasses.replace(ParamSpec.of("w", torch.zeros(160, 100)), one_matmul=True)  # 400 bytes a row
    small = [ParamSpec.of(f"p{i}", torch.zeros(100)) for i in range(40)]  # 400 bytes each
    caps = BucketCaps(bucket=16_000, first=2_000, last=2_000)

    first = plan_buckets([big, *small[:35]], caps=caps).buckets[0]
    assert (first.cap_bytes, first.blocks_grow_to) == (2_000, 16_000)
    assert first.pieces == (0, (5, 10, 20, 40, 40, 40, 5))  # 2 000, 4 000, 8 000, then 16 000 bytes, the rest last
    assert first.piece_bytes == (2_000, 4_000, 8_000, 16_000, 16_000, 16_000, 2_000)
    assert first.assembled_bytes == 2_000  # only the first block is copied in

    # Five small gradients fill the first bucket, 35 the tail (2 000, 4 000, 8 000 bytes from the end): the big
    # one is the head ramp's first bucket, capped at 4 000 bytes.
    head = plan_buckets([*small[:5], big, *small[5:]], caps=caps).buckets[1]
    assert (head.names, head.cap_bytes) == (("w",), 4_000)
    assert head.pieces == (0, (10, 20, 40, 40, 40, 10))

    # The last bucket: a block of its cap, then the head's blocks reversed, so only its cap's worth is left to
    # send after backward.
    tail = plan_buckets([*small[:5], big], caps=caps).buckets[-1]
    assert (tail.cap_bytes, tail.blocks_grow_to, tail.blocks_shrink_from) == (2_000, None, 16_000)
    assert tail.pieces == (0, (5, 40, 40, 40, 20, 10, 5))  # 2 000, 16 000 bytes three times, 8 000, 4 000, 2 000
    assert tail.piece_bytes == (2_000, 16_000, 16_000, 16_000, 8_000, 4_000, 2_000)
    assert tail.assembled_bytes == 2_000
    # With a bias in the bucket (a graph plan) and rows left over from the doubling: the cap's block first, with
    # the bias (the one block copied in at the end), then what is left (10 rows), then halving to the cap.
    wide = dataclasses.replace(ParamSpec.of("w", torch.zeros(170, 100)), one_matmul=True)
    groups = [*([s] for s in small[:5]), [wide, ParamSpec.of("b", torch.zeros(170))]]
    grouped = plan_bucket_groups(groups, caps=caps).buckets[-1]
    assert grouped.blocks_shrink_from == 16_000 and grouped.pieces == (0, (5, 10, 40, 40, 40, 20, 10, 5))
    assert (grouped.piece_bytes[0], grouped.assembled_bytes) == (2_000 + 680, 2_000)
    # Just over the cap, halving (10 rows, then 1) takes as many blocks as the cap's: blocks of the cap.
    near = dataclasses.replace(ParamSpec.of("w", torch.zeros(11, 50)), one_matmul=True)  # 2 200 bytes
    assert plan_buckets([*small[:5], near], caps=caps).buckets[-1].pieces == (0, (6, 5))
    more = [ParamSpec.of(f"q{i}", torch.zeros(100)) for i in range(30)]  # head ramp and tail full: big in the middle
    middle = plan_buckets([*small[:35], big, *small[35:], *more], caps=caps).buckets[3]
    assert (middle.names, middle.cap_bytes, middle.blocks_grow_to, middle.blocks_shrink_from) == (("w",), 16_000, None, None)
    assert middle.pieces == (0, (40, 40, 40, 40))  # blocks of the middle cap
    flat = plan_buckets([big, *small[:35]], caps=dataclasses.replace(caps, ramps=False)).buckets[0]
    assert (flat.blocks_grow_to, flat.blocks_shrink_from, flat.pieces) == (None, None, (0, (5,) * 32))
    layouts = [b.blocks_layout for b in (first, head, tail, grouped, middle, flat)]
    assert layouts == ["growing", "growing", "shrinking", "shrinking", "even", "even"]
    assert plan_buckets([*small[:5], near], caps=caps).buckets[-1].blocks_layout == "even"  # the fallback says so
    assert plan_buckets(small[:5], caps=caps).buckets[0].blocks_layout is None  # no big gradient
    for bucket in (first, head, tail, grouped, middle, flat):
        assert sum(bucket.piece_bytes) == bucket.nbytes


def test_only_a_gradient_that_is_one_matmuls_is_marked_for_pieces() -> None:
    """``find_graph_params``: a linear layer's weight (its one use that sends a gradient back) is one matmul's; a
    tied table (a lookup and the head's linear) and a convolution's weight are not (Note [Gradient pieces])."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.conv, self.fc = nn.Embedding(32, 8), nn.Conv1d(8, 8, 1), nn.Linear(8, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.fc(self.conv(self.wte(idx).transpose(1, 2)).transpose(1, 2))
            return h @ self.wte.weight.T  # the head shares the table

    model = Tied()
    (captured,) = capture_graphs(model, torch.randint(0, 32, (2, 5)))
    params = find_graph_params(captured.gm, captured.example_inputs, parameter_names(model))
    one_matmul = {p.spec.name for p in params if p.spec.one_matmul}
    assert one_matmul == {"fc.weight"}, one_matmul


def test_each_block_of_a_big_gradient_is_its_own_matmul_and_goes_out_before_the_next_is_computed() -> None:
    caps = BucketCaps(bucket=4096, first=4096, last=4096)
    _, backward, plan, _ = _backward_of_reducing_graph(caps, Wide(), schedule=schedule_reductions)
    (piecewise,) = [b for b in plan.buckets if b.pieces is not None]
    assert piecewise.names == ("big.weight", "big.bias") and piecewise.pieces == (0, (64, 64, 64, 64))
    nodes = list(backward.graph.nodes)
    reduces = [n for n in nodes if n.target is ALL_REDUCE]
    assert len(reduces) == len(plan.buckets) - 1 + 4
    sizes = [n.args[0].meta["val"].numel() for n in reduces]
    assert sizes.count(64 * 16) == 3 and sizes.count(64 * 16 + 256) == 1  # 4 blocks of 64 x 16, the bias with one
    # Each block is computed by a matmul of its own, and sent before the next block's matmul runs.
    position = {n: i for i, n in enumerate(nodes)}
    block_mms = [n for n in nodes if n.target is torch.ops.aten.mm.default and n.meta["val"].shape in ((64, 16), (16, 64))]
    assert len(block_mms) == 4
    block_reduces = sorted((n for n in reduces if n.args[0].meta["val"].numel() in (1024, 1280)), key=position.__getitem__)
    for reduce, next_mm in zip(block_reduces, block_mms[1:]):
        assert position[reduce] < position[next_mm]
    assert not any(n.target is torch.ops.aten.mm.default and n.meta["val"].shape in ((256, 16), (16, 256)) for n in nodes)


def _sliced_product(*, whole_used: bool, sent: bool) -> fx.Graph:
    """``a @ b`` cut into two row blocks, each all-reduced if ``sent``; the whole product an output too if
    ``whole_used``."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    product = graph.call_function(torch.ops.aten.mm.default, (a, b))
    blocks = [graph.call_function(torch.ops.aten.slice.Tensor, (product, 0, s, s + 2)) for s in (0, 2)]
    if sent:
        blocks = [graph.call_function(WAIT, (graph.call_function(ALL_REDUCE, (blk, "sum", "0")),)) for blk in blocks]
    graph.output((*blocks, product) if whole_used else tuple(blocks))
    return graph


def test_only_blocks_that_are_sent_and_whose_matmul_is_used_nowhere_else_are_rewritten() -> None:
    assert compute_pieces_separately(_sliced_product(whole_used=False, sent=True)) == 2
    # The whole product is needed too: slicing the matmul would compute it twice.
    assert compute_pieces_separately(_sliced_product(whole_used=True, sent=True)) == 0
    # The model's own slicing of a matmul, sent nowhere: not graphddp's to change.
    assert compute_pieces_separately(_sliced_product(whole_used=False, sent=False)) == 0


def test_inductors_cache_key_follows_the_scheduling_pass_source(tmp_path, monkeypatch) -> None:
    """Inductor reuses a compiled graph whose cache key matches: the key of graphddp's post-grad pass is the hash
    of the pass's source, so a changed pass never runs a graph the old one ordered (a fixed tag did)."""
    from graphddp.compiler import in_graph
    from graphddp.passes import reduction

    key = in_graph._scheduling_pass()().uuid()
    assert key == in_graph._scheduling_pass()().uuid()
    changed = tmp_path / "reduction.py"
    changed.write_text(open(reduction.__file__).read() + "\n# changed\n")
    monkeypatch.setattr(reduction, "__file__", str(changed))
    assert in_graph._scheduling_pass()().uuid() != key


class DetachedTableFirst(nn.Module):
    """A tied table read without gradient (``.detach()``) before anything else, then a layer used before the
    table's lookup, then the lookup, and the table again as the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.wte, self.mid = nn.Linear(8, 8), nn.Embedding(64, 8), nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        scale = self.wte.weight.detach().mean()  # sends no gradient back
        gate = self.pre(torch.ones(8) * scale)  # [8], used before the lookup
        x = self.mid(self.wte(idx) * gate)  # [B, T, 8]
        return torch.nn.functional.linear(x, self.wte.weight)  # [B, T, 64]: the table's part


def test_a_tables_part_never_shares_a_bucket_with_a_layer_used_before_the_tables_lookup() -> None:
    """The ``.detach()`` counts as the table's earliest use (Note [Earliest use]), so the table comes last in ready
    order, behind ``pre``. A bucket holding the output layer's part and ``pre`` would put its in-graph call before
    ``pre``'s linear, ahead of the rows call it takes the table from; it cannot be planned: such a bucket completes
    before the lookup, so the part's node shares the lookup's segment and the table gives up its parts
    (``misplaced_parts``). For every first cap, a plan with parts keeps them apart, and its calls lint."""
    model = DetachedTableFirst()
    (captured,) = capture_graphs(model, torch.randint(0, 64, (2, 5)))
    names = parameter_names(model)
    with_parts = 0
    for first in (256, 512, 1024, 2048, 2600, 3000, 4096):
        caps = BucketCaps(bucket=1024, first=first, last=256)
        prepared = prepare_graph(captured.gm, captured.example_inputs, names, caps=caps, row_sparse=True)
        for bucket in prepared.plan.buckets:
            if any(s.part for s in bucket.params):
                assert not {s.name for s in bucket.params} & {"pre.weight", "pre.bias"}, prepared.plan.table_rows()
        with_parts += bool(prepared.plan.parts)
        insert_bucket_reductions(captured.gm, prepared.params, prepared.plan, group_names=("0",), divisor=2)  # lints
    assert with_parts >= 3  # the check above ran on plans with parts
