"""Row-sparse embedding gradients and tied tables' parts (Note [Row-sparse gradients] in passes/rows.py).

In layers: the passes on captured graphs (no process), the two-step reduction in one gloo process, then parity
on spawned ranks against PyTorch's DDP and against graphddp with ``sparse_embedding_grads=False``, with the
order of events recorded by the Reducer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from graphddp.passes import (
    Bucket,
    BucketCaps,
    BucketPlan,
    ParamSpec,
    compose_plans,
    embedding_tables,
    find_graph_params,
    misplaced_parts,
    plan_buckets,
    plan_graph,
    row_sparse_params,
    split_at_buckets,
    tap_parts,
)
from ranks import run_on_ranks
from torch import nn

import graphddp
from graphddp.buckets import FlatBucket
from graphddp.capture import capture_graphs, parameter_names
from graphddp.comm import HostComm
from graphddp.gradient_tap import GradientTap
from graphddp.reductions import DENSE_STREAK_LIMIT, CommHook, DenseReduction, RowSparseReduction
from graphddp.trace import EventLog
from graphddp.workloads import GPT, GPTConfig

VOCAB = 512  # 4 x 16 tokens per rank: at most 192 of 512 rows on 3 ranks, so the table is row-sparse
TINY = BucketCaps(bucket=2048, first=1024, last=512)


def tied_gpt(vocab: int = VOCAB) -> GPT:
    torch.manual_seed(0)
    # No biases: the attention key bias's gradient is zero up to rounding, which Adam would amplify into noise.
    return GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False))


class Bag(nn.Module):
    """An untied embedding table (the mean of the looked-up rows) and a linear head."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(idx).mean(1)), target)  # idx [B, 8] -> [B, 16] -> [B, 8]


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


class UsedBeforeLookup(nn.Module):
    """The table is multiplied with before it is looked up: its gradient is dense from the start."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        scale = self.emb.weight.sum()
        return (self.emb(idx) * scale).mean()


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8, max_norm=1.0)  # renormalises the looked-up rows in place

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum()


class DetachedUse(nn.Module):
    """The table is also read detached (a logged norm, say): that use sends no gradient back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # [B, T, 16]
        return (h @ self.emb.weight.t()).logsumexp(-1).mean() * self.emb.weight.detach().norm()


class BrokenGPT(GPT):
    """The tied GPT with a graph break between the blocks and the output layer: lookup and lm_head in two graphs."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        torch._dynamo.graph_break()
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))


class TakesParts:
    """Stands in for the Reducer: takes every part a tap offers."""

    def __init__(self) -> None:
        self.taken: dict[tuple[str, str], torch.Tensor] = {}

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        self.taken[key] = grad.clone()
        return True


def tokens(model: str, step: int, micro: int, rank: int, vocab: int = VOCAB, batch: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank + 1)
    if model == "bag":
        return torch.randint(0, vocab, (batch, 8), generator=g), torch.randint(0, 8, (batch,), generator=g)
    return torch.randint(0, vocab, (batch, 16), generator=g), torch.randint(0, vocab, (batch, 16), generator=g)


def capture(model: nn.Module, *inputs: Any):
    (captured,) = capture_graphs(model, *inputs)
    return captured, find_graph_params(captured.gm, captured.example_inputs, parameter_names(model))


# -- the passes, no process -------------------------------------------------------------------------------------
def test_a_tied_table_is_row_sparse_and_its_output_use_a_part_planned_first() -> None:
    model = tied_gpt()
    captured, params = capture(model, *tokens("gpt", 0, 0, 0))
    (table,) = row_sparse_params(params)
    assert table.name == "wte.weight" and [u.node for u in table.parts] == ["logits"]
    split = plan_graph(captured.gm, params, TINY)
    plan = split.plan
    assert plan.buckets[0].names == ("wte.weight@logits",)  # ready first: the output layer's backward
    assert plan.buckets[-1].names == ("wte.weight[rows]",) and plan.buckets[-1].row_sparse
    assert plan.parts == (ParamSpec.of("wte.weight", model.wte.weight).part_at("logits"),)
    assert sorted(plan.param_names) == sorted(n for n, _ in model.named_parameters())  # parts are not params
    assert len(split.taps) == 1 and split.taps[0].segment == split.num_segments - 1  # feeds the last segment
    assert split.segments[-1].buckets == (0,) and split.segments[0].buckets == (len(plan.buckets) - 1,)
    # The position table is looked up with arange(16) in a 16-row table: every row, so it stays dense.
    assert not any(b.row_sparse for b in plan.buckets[:-1])


def test_the_plan_depends_on_the_graph_not_on_the_batch() -> None:
    # How many rows a batch touches is left to the all-reduced mask each iteration, so ranks with different batch
    # sizes (a short last batch, uneven shards) plan alike (Note [Row-sparse gradients], Note [Plan agreement]).
    model = tied_gpt()
    fingerprints = set()
    for batch in (1, 4, 32):  # 32 x 16 lookups could touch every one of the 512 rows
        captured, params = capture(model, *tokens("gpt", 0, 0, 0, batch=batch))
        assert [r.name for r in row_sparse_params(params)] == ["wte.weight"]
        fingerprints.add(plan_graph(captured.gm, params, TINY).plan.fingerprint)
    assert len(fingerprints) == 1


def test_the_stitched_graph_with_taps_computes_the_same_values_and_gradients() -> None:
    model = tied_gpt()
    captured, params = capture(model, *tokens("gpt", 0, 0, 0))
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
    captured, params = capture(TwoHeads(), tokens("gpt", 0, 0, 0)[0])
    (table,) = row_sparse_params(params)
    assert len(table.parts) == 2  # the two output products
    fine = plan_graph(captured.gm, params, BucketCaps(bucket=1, first=1, last=1))
    assert len(fine.taps) == 2 and len({t.segment for t in fine.taps}) == 2 and not misplaced_parts(fine, [table])
    # One bucket for everything: one segment, so no tap can separate anything: no parts, no rows.
    whole = plan_graph(captured.gm, params, BucketCaps(bucket=1 << 30, first=1 << 30, last=1 << 30))
    assert whole.taps == () and not any(b.row_sparse for b in whole.plan.buckets) and whole.plan.parts == ()


def test_a_use_before_the_lookup_or_a_forbidden_lookup_keeps_the_table_dense() -> None:
    captured, params = capture(UsedBeforeLookup(), tokens("gpt", 0, 0, 0)[0])
    assert row_sparse_params(params) == []

    captured, params = capture(MaxNorm(), tokens("gpt", 0, 0, 0)[0])
    assert row_sparse_params(params) == []


def test_a_detached_use_is_no_part_and_a_get_attr_table_is_not_tapped() -> None:
    captured, params = capture(DetachedUse(), tokens("gpt", 0, 0, 0)[0])
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
    with pytest.raises(AssertionError, match="row-sparse gradient shares"):
        BucketPlan((Bucket(0, (spec("a", 1), spec("t", 1, row_sparse=True)), 1),), plan.caps)
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


# -- the two-step reduction ---------------------------------------------------------------------------------------
def reduce_rows(table: torch.Tensor, mask_group: Any) -> tuple[torch.Tensor, Any]:
    """``table`` reduced by ``RowSparseReduction`` on the world group, as the launcher drives it (dense: sum)."""
    spec = plan_buckets([ParamSpec.of("t", table, row_sparse=True)], caps=TINY).buckets[0]
    bucket = FlatBucket(spec, [nn.Parameter(table.clone())], [0])
    summed = CommHook(None, lambda state, b: dist.all_reduce(b.buffer(), async_op=True).get_future(), custom=True)
    reduction = RowSparseReduction(DenseReduction(summed, HostComm(), dist.get_rank()), group=dist.group.WORLD, mask_group=mask_group)
    in_flight = reduction.start(bucket, table.view(-1), is_last=True)
    in_flight.commit()
    return in_flight.wait().view_as(table), in_flight


@pytest.mark.usefixtures("one_rank_group")
def test_row_sparse_launch_in_one_process_keeps_the_table_and_falls_back_when_dense() -> None:
    table = torch.zeros(8, 3)
    table[[1, 6]] = torch.tensor([[1.0, -2.0, 0.0], [float("nan"), 0.0, 0.0]])
    expected = table.clone()
    result, launch = reduce_rows(table, dist.group.WORLD)
    assert launch.touched == 2 and launch.outcome[0] == "rows" and result.data_ptr() == table.data_ptr()
    torch.testing.assert_close(result, expected, equal_nan=True)
    result, launch = reduce_rows(torch.ones(8, 3), dist.group.WORLD)
    assert launch.touched == 8 and launch.outcome[0] == "dense" and torch.equal(result, torch.ones(8, 3))


@pytest.mark.usefixtures("one_rank_group")
def test_the_option_is_validated_and_one_rank_plans_no_rows() -> None:
    with pytest.raises(TypeError, match="sparse_embedding_grads must be True or False, got 'yes'"):
        graphddp.DDP(Bag(), sparse_embedding_grads="yes")  # type: ignore[arg-type]
    # Nothing to send at world size 1: no side group, no rows, no isolated table bucket.
    assert not any(b.row_sparse for b in graphddp.DDP(Bag()).bucket_plan.buckets)


def rows_against_dense(rank: int, world: int) -> list[str]:
    """Tables whose touched rows overlap, differ, hold a NaN on one rank, or are all zero: rows = dense sum."""
    side = dist.new_group(backend="gloo")
    tables = {
        "overlapping": torch.zeros(16, 4).index_fill_(0, torch.tensor([1, 2 + rank]), float(rank + 1)),
        "nan_on_rank_0": torch.zeros(16, 4).index_fill_(0, torch.tensor([3]), float("nan") if rank == 0 else 2.0),
        "untouched": torch.zeros(16, 4),
        "only_rank_1": torch.zeros(16, 4).index_fill_(0, torch.tensor([9]), 5.0 if rank == 1 else 0.0),
    }
    seen = []
    for name, table in tables.items():
        dense = table.clone()
        dist.all_reduce(dense)
        result, launch = reduce_rows(table, side)
        torch.testing.assert_close(result, dense, equal_nan=True, msg=name)
        seen.append(f"{name}:{launch.touched}")
    dist.destroy_process_group(side)
    return seen


def test_row_sparse_launch_on_two_ranks_equals_the_dense_all_reduce() -> None:
    seen = run_on_ranks(rows_against_dense, 2, timeout=120)
    assert seen[0] == seen[1] == ["overlapping:3", "nan_on_rank_0:1", "untouched:0", "only_rank_1:1"]


# -- spawned ranks ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RowsCase:
    model: str = "gpt"
    """``gpt`` (tied table, compiled) or ``bag`` (untied table)."""
    compiled: bool = True
    vocab: int = VOCAB
    optim: str = "sgd"
    steps: int = 4
    accumulate: int = 1
    """Micro-batches per step; all but the last under ``no_sync()``."""
    extra_steps_per_rank: int = 0
    """Rank r trains r * this many more steps, inside ``join()``."""
    ddp: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments for both DDPs."""
    grad_first: bool = False
    """Each step also asks ``torch.autograd.grad`` for the loss's gradient (a penalty term, say) before backward."""
    shrink_batch_at: int | None = None
    """From this step on, half the batch: Dynamo recompiles, and the backend plans again."""
    hook_at: int | None = None
    """Register ``fp16_compress_hook`` before this step (both DDPs)."""
    batch_sizes: tuple[tuple[int, ...], ...] = ()
    """Rank r's batch size at each step (``batch_sizes[r][step]``); empty: 4 everywhere."""
    tolerance: tuple[tuple[str, float], ...] = ()


CAPS = {"bucket_cap_mb": 0.002, "first_bucket_cap_mb": 0.001, "last_bucket_cap_mb": 0.0005}


def build_rows_model(case: RowsCase) -> nn.Module:
    if case.model == "bag":
        return Bag(case.vocab)
    module = tied_gpt(case.vocab)
    if case.model == "gpt_untied":  # the output layer gets a weight of its own
        module.lm_head.weight = nn.Parameter(module.wte.weight.detach().clone())
    if case.model == "broken":
        module.__class__ = BrokenGPT  # same parameters, a graph break before the output layer
    return module


def rows_step(model: nn.Module, case: RowsCase, step: int, micro: int, rank: int, grads: list[Any]) -> None:
    size = case.batch_sizes[rank][step] if case.batch_sizes else 4
    batch = tokens("bag" if case.model == "bag" else "gpt", step, micro, rank, case.vocab, size)
    if case.shrink_batch_at is not None and step >= case.shrink_batch_at:
        batch = tuple(t[:2] for t in batch)
    loss = model(*batch)
    if case.grad_first:
        table = dict(model.named_parameters())[next(n for n, _ in model.named_parameters() if n.endswith("wte.weight"))]
        grads.append(torch.autograd.grad(loss, [table], retain_graph=True)[0])  # this rank's own, whole
    loss.backward()


def train_rows(impl: str, case: RowsCase, rank: int, states: list[Any] | None = None) -> tuple[nn.Module, list[Any], list[Any]]:
    """Train ``case``; ``states`` (if given) receives the module's state after every optimizer step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    module = build_rows_model(case)
    if impl == "torch":
        ddp = model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=CAPS["bucket_cap_mb"], **dict(case.ddp))
    else:
        ddp = model = graphddp.DDP(module, **CAPS, sparse_embedding_grads=impl == "graphddp", **dict(case.ddp))
        if case.compiled:
            model = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if case.optim == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01)
    events: list[Any] = []
    grads: list[Any] = []
    join = ddp.join() if case.extra_steps_per_rank else contextlib.nullcontext()
    with join:
        for step in range(case.steps + rank * case.extra_steps_per_rank):
            if step == case.hook_at:
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            log = EventLog()
            if impl != "torch":
                ddp.reducer.events = log
            for micro in range(case.accumulate):
                with contextlib.nullcontext() if micro == case.accumulate - 1 else ddp.no_sync():
                    rows_step(model, case, step, micro, rank, grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
            events.append([(e.kind, e.bucket, e.param) for e in log.events])
            if states is not None:
                states.append({k: v.detach().clone() for k, v in ddp.module.state_dict().items()})
    return ddp, events, grads


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_rows(rank: int, world: int, case: RowsCase) -> dict[str, Any]:
    torch._dynamo.reset()
    warnings = Warnings()
    logging.getLogger("graphddp").addHandler(warnings)
    try:
        ours, events, our_grads = train_rows("graphddp", case, rank)
    finally:
        logging.getLogger("graphddp").removeHandler(warnings)
    dense, _, _ = train_rows("graphddp-dense", case, rank)
    theirs, _, their_grads = train_rows("torch", case, rank)
    tolerance = dict(case.tolerance)
    torch.testing.assert_close(ours.module.state_dict(), theirs.module.state_dict(), **tolerance)
    torch.testing.assert_close(ours.module.state_dict(), dense.module.state_dict(), **tolerance)
    torch.testing.assert_close(our_grads, their_grads, **tolerance)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {n: p.detach() for n, p in ours.module.named_parameters()})
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)
    return {"buckets": [b.names for b in ours.bucket_plan.buckets], "events": events, "warnings": warnings.messages}


def outcomes(events: list[tuple[str, int | None, str | None]]) -> list[str]:
    return [kind for kind, _, _ in events if kind in ("rows", "dense")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_compiled_tied_table_sends_its_part_early_and_its_rows_last(world: int, optim: str) -> None:
    results = run_on_ranks(check_rows, world, RowsCase(optim=optim), timeout=300)
    buckets = results[0]["buckets"]
    assert buckets[0] == ("wte.weight@logits",) and buckets[-1] == ("wte.weight[rows]",)
    for result in results:
        last = result["events"][-1]  # a step with the graph plan adopted
        assert outcomes(last) == ["rows"], last
        kinds = [(kind, bucket) for kind, bucket, _ in last]
        part_ready = next(i for i, e in enumerate(last) if e[0] == "ready" and e[2] == "wte.weight@logits")
        backwards = [i for i, (kind, _) in enumerate(kinds) if kind == "segment_backward"]
        # The part is taken and launched in the first segment's backward, before any other segment's runs.
        assert backwards[0] < part_ready < kinds.index(("launch", 0)) < backwards[1]
        rows = next(e for e in last if e[0] == "rows")
        assert rows[1] == len(buckets) - 1 and int(rows[2].split("/")[0]) <= world * 64


@pytest.mark.parametrize("world", [2, 3])
def test_eager_untied_table_is_reduced_as_rows(world: int) -> None:
    results = run_on_ranks(check_rows, world, RowsCase(model="bag", compiled=False, optim="adam"), timeout=300)
    assert ("emb.weight[rows]",) in results[0]["buckets"]
    for result in results:
        assert all(outcomes(step) == ["rows"] for step in result["events"][1:]), result["events"]


def test_a_table_every_rank_touches_densely_falls_back_to_the_dense_all_reduce_and_stops_trying() -> None:
    results = run_on_ranks(check_rows, 2, RowsCase(model="bag", compiled=False, vocab=16, steps=5), timeout=300)
    assert ("emb.weight[rows]",) in results[0]["buckets"]  # eagerly, any unshared table is tried
    for result in results:
        steps = [outcomes(step) for step in result["events"]]
        # Dense every time it tries; after DENSE_STREAK_LIMIT dense outcomes in a row it stops trying.
        assert steps[0] == ["dense"] and all(o in ([], ["dense"]) for o in steps) and steps[-1] == [], steps
        assert sum(map(len, steps)) <= DENSE_STREAK_LIMIT + 1, steps  # + 1: the plan may be rebuilt once


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(RowsCase(accumulate=3), id="no_sync_accumulation"),
        pytest.param(RowsCase(ddp=(("gradient_as_bucket_view", True),)), id="gradient_as_bucket_view"),
        pytest.param(RowsCase(ddp=(("find_unused_parameters", True),), optim="adam"), id="find_unused_parameters"),
        pytest.param(RowsCase(model="bag", compiled=False, extra_steps_per_rank=2), id="join_uneven_inputs"),
        pytest.param(RowsCase(extra_steps_per_rank=1, steps=3), id="compiled_join_uneven_inputs"),
        pytest.param(RowsCase(model="bag", compiled=True, ddp=(("static_graph", True),)), id="compiled_untied_static_graph"),
    ],
)
def test_features_keep_parity_with_rows_and_parts(case: RowsCase) -> None:
    results = run_on_ranks(check_rows, 2, case, timeout=300)
    steps = [outcomes(step) for step in results[0]["events"][: case.steps]]
    if case.accumulate > 1:
        # .grad held the accumulated micro-batches: dense (the part sent on top) twice, then the table's parts
        # are dropped and it is all-reduced dense without trying.
        assert steps[1:] == [["dense"], ["dense"], []], steps
        assert not any("@" in n for b in results[0]["buckets"] for n in b), results[0]["buckets"]
        assert ("wte.weight",) in results[0]["buckets"]
    else:
        assert steps[-1] == ["rows"], steps


def test_autograd_grad_gets_the_whole_gradient_and_backward_still_synchronises() -> None:
    # torch.autograd.grad accumulates nothing: the tap must not take its part, nor may any bucket move.
    results = run_on_ranks(check_rows, 2, RowsCase(grad_first=True), timeout=300)
    assert outcomes(results[0]["events"][-1]) == ["rows"]


def test_recompile_and_graph_break_keep_parity() -> None:
    results = run_on_ranks(check_rows, 2, RowsCase(shrink_batch_at=2, steps=5), timeout=300)
    assert outcomes(results[0]["events"][-1]) == ["rows"]  # the recompiled graph's plan, adopted
    # The lookup and the output layer in two graphs: no part can be split off across the break, so the table's
    # gradient is dense; it goes dense twice, then it stops trying.
    results = run_on_ranks(check_rows, 2, RowsCase(model="broken", steps=5), timeout=300)
    assert not any("@" in n for b in results[0]["buckets"] for n in b)
    assert [outcomes(step) for step in results[0]["events"][1:]] == [["dense"], ["dense"], [], []]


def test_a_hook_registered_after_compile_warns_and_reduces_parts_densely() -> None:
    case = RowsCase(hook_at=2, tolerance=(("rtol", 1e-3), ("atol", 1e-4)))  # fp16 sums, associated differently
    results = run_on_ranks(check_rows, 2, case, timeout=300)
    for rank, result in enumerate(results):
        (warning,) = [w for w in result["warnings"] if "comm hook was registered after torch.compile" in w]
        assert f"[rank {rank}]" in warning and "wte.weight@logits" in warning
        assert outcomes(result["events"][-1]) == []  # the hook reduces every bucket


# -- ranks that see different batch sizes (Note [Plan agreement]) --------------------------------------------------
def uneven_batches(rank: int, world: int, case: RowsCase) -> dict[str, Any]:
    """Parity with PyTorch's DDP after every step while the ranks' batch sizes differ (recompiles on some ranks)."""
    torch._dynamo.reset()
    ours_states: list[Any] = []
    theirs_states: list[Any] = []
    ours, events, _ = train_rows("graphddp", case, rank, ours_states)
    train_rows("torch", case, rank, theirs_states)
    for step, (a, b) in enumerate(zip(ours_states, theirs_states, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step}: {m}")
    return {"fingerprint": ours.bucket_plan.fingerprint, "source": ours.bucket_plan.source, "events": events}


def schedule(world: int, kind: str, steps: int = 5) -> tuple[tuple[int, ...], ...]:
    if kind == "fixed":  # 4, 6, 8 rows per rank, every step
        return tuple((4 + 2 * r,) * steps for r in range(world))
    if kind == "shrink_and_grow":  # rank 0 has one short batch in the middle
        return tuple((6, 6, 4, 6, 6) if r == 0 else (6,) * steps for r in range(world))
    if kind == "last_partial":  # DataLoader(drop_last=False) over uneven shards: a short last batch
        return tuple((6,) * (steps - 1) + (1 + r,) for r in range(world))
    raise ValueError(kind)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["gpt", "gpt_untied"])
@pytest.mark.parametrize("kind", ["fixed", "shrink_and_grow", "last_partial"])
def test_compiled_tables_train_when_ranks_see_different_batch_sizes(kind: str, model: str, world: int) -> None:
    case = RowsCase(model=model, vocab=2048, steps=5, batch_sizes=schedule(world, kind))
    results = run_on_ranks(uneven_batches, world, case, timeout=300)
    assert len({r["fingerprint"] for r in results}) == 1 and {r["source"] for r in results} == {"graph"}
    for result in results:
        last = result["events"][-1]
        # The table's rows (at most 3 ranks x 8 x 16 of 2048 rows) are still reduced as rows at the end.
        assert outcomes(last) == ["rows"], last
        if model == "gpt":
            assert any(e[0] == "ready" and e[2] == "wte.weight@logits" for e in last), "the part was not taken"
