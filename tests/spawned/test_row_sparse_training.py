"""Row-sparse embedding gradients and tied tables' parts on spawned gloo ranks (Note [Row-sparse gradients] in
passes/row_sparse.py): the two-step reduction against the dense all-reduce, then training parity against PyTorch's
DDP and against graphddp with ``sparse_embedding_grads=False``, with the order of events the Reducer recorded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from reduce_rows import reduce_rows
from training import RAMPED, TINY_CAPS, Case, graphddp_warnings, train

from graphddp.runtime.reductions import DENSE_STREAK_LIMIT


# -- the two-step reduction ---------------------------------------------------------------------------------------
def rows_against_dense(rank: int, world: int) -> list[str]:
    """Tables whose touched rows overlap, differ, hold a NaN on one rank, or are all zero: rows = dense sum."""
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
        result, launch = reduce_rows(table)
        torch.testing.assert_close(result, dense, equal_nan=True, msg=name)
        seen.append(f"{name}:{launch.touched}")
    return seen


def test_row_sparse_launch_on_two_ranks_equals_the_dense_all_reduce() -> None:
    seen = run_on_ranks(rows_against_dense, 2, timeout=120)
    assert seen[0] == seen[1] == ["overlapping:3", "nan_on_rank_0:1", "untouched:0", "only_rank_1:1"]


# -- training -------------------------------------------------------------------------------------------------


def rows_case(**fields: Any) -> Case:
    """A tied GPT (row-sparse on, tiny buckets), compiled unless the fields say otherwise; SGD at lr 0.1."""
    fields = {"model": "gpt", "steps": 4, "compile": "torch.compile", **fields}
    if fields.get("optim", "sgd") == "sgd":
        fields.setdefault("lr", 0.1)
    return Case(ddp=TINY_CAPS + fields.pop("ddp", ()), graphddp=RAMPED, **fields)


def check_rows(rank: int, world: int, case: Case) -> dict[str, Any]:
    torch._dynamo.reset()
    with graphddp_warnings() as warnings:
        ours = train("graphddp", case, rank)
    dense = train("graphddp", case.with_graphddp(sparse_embedding_grads=False), rank)
    theirs = train("torch", case, rank)
    tolerance = dict(case.tolerance)
    torch.testing.assert_close(ours.ddp.module.state_dict(), theirs.ddp.module.state_dict(), **tolerance)
    torch.testing.assert_close(ours.ddp.module.state_dict(), dense.ddp.module.state_dict(), **tolerance)
    torch.testing.assert_close(ours.grads, theirs.grads, **tolerance)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {n: p.detach() for n, p in ours.ddp.module.named_parameters()})
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)
    return {"buckets": [b.names for b in ours.ddp.bucket_plan.buckets], "events": ours.events, "warnings": warnings,
            "dense_buckets": [b.names for b in dense.ddp.bucket_plan.buckets]}  # fmt: skip


def outcomes(events: list[tuple[str, int | None, str | None]]) -> list[str]:
    return [kind for kind, _, _ in events if kind in ("rows", "dense")]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("optim", ["sgd", pytest.param("adam", marks=pytest.mark.slow)])  # adam: slow suite (time)
def test_compiled_tied_table_sends_its_part_early_and_its_rows_last(world: int, optim: str) -> None:
    results = run_on_ranks(check_rows, world, rows_case(optim=optim), timeout=300)
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
    results = run_on_ranks(check_rows, world, rows_case(model="bag", compile=None, optim="adam"), timeout=300)
    assert ("emb.weight[rows]",) in results[0]["buckets"]
    for result in results:
        assert all(outcomes(step) == ["rows"] for step in result["events"][1:]), result["events"]


def test_a_table_every_rank_touches_densely_falls_back_to_the_dense_all_reduce_and_stops_trying() -> None:
    results = run_on_ranks(check_rows, 2, rows_case(model="bag", compile=None, vocab=16, steps=5), timeout=300)
    for result in results:
        steps = [outcomes(step) for step in result["events"]]
        # Eagerly, any unshared table is tried (its bucket's first outcome); dense every time it tries; after
        # DENSE_STREAK_LIMIT dense outcomes in a row it stops trying.
        assert steps[0] == ["dense"] and all(o in ([], ["dense"]) for o in steps) and steps[-1] == [], steps
        assert sum(map(len, steps)) <= DENSE_STREAK_LIMIT + 1, steps  # + 1: the plan may be rebuilt once
        # And it is planned as if it had never been tried: not alone in a bucket, a collective more every step
        # (Note [Plan agreement], "tables gone dense").
        assert result["buckets"] == result["dense_buckets"], (result["buckets"], result["dense_buckets"])
        assert not any("[rows]" in name for bucket in result["buckets"] for name in bucket), result["buckets"]
        # A dense outcome's all-reduce is given back at the end of backward (Note [A collective holds no Python
        # object]): nothing keeps it waiting (its future, kept by the row-sparse reduction, did once: 1 s a step).
        assert not [w for w in result["warnings"] if "still held" in w], result["warnings"]


def test_a_comm_hook_plans_an_eager_table_dense() -> None:
    """A hook gets every bucket dense, as PyTorch hands them over, so a table planned as rows would only cost its
    bucket of its own: registered, the hook finds it back in the dense plan, on every rank alike."""
    case = rows_case(model="bag", compile=None, hook="allreduce", hook_at=0, steps=3)
    for result in run_on_ranks(check_rows, 2, case, timeout=300):
        assert result["buckets"] == result["dense_buckets"], (result["buckets"], result["dense_buckets"])
        assert not any("[rows]" in name for bucket in result["buckets"] for name in bucket), result["buckets"]
        assert all(outcomes(step) == [] for step in result["events"]), result["events"]  # never tried as rows


@pytest.mark.parametrize(  # ~7 s each: three in the default suite, three in the slow one (CI runs both)
    "case",
    [
        pytest.param(rows_case(accumulate=3), id="no_sync_accumulation"),
        pytest.param(rows_case(ddp=(("gradient_as_bucket_view", True),)), id="gradient_as_bucket_view", marks=pytest.mark.slow),
        pytest.param(rows_case(ddp=(("find_unused_parameters", True),), optim="adam"), id="find_unused_parameters"),
        pytest.param(rows_case(model="bag", compile=None, extra_steps_per_rank=2), id="join_uneven_inputs"),
        pytest.param(rows_case(extra_steps_per_rank=1, steps=3), id="compiled_join_uneven_inputs", marks=pytest.mark.slow),
        pytest.param(rows_case(model="bag", ddp=(("static_graph", True),)), id="compiled_untied_static_graph", marks=pytest.mark.slow),
    ],
)
def test_features_keep_parity_with_rows_and_parts(case: Case) -> None:
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
    results = run_on_ranks(check_rows, 2, rows_case(grad_first=True), timeout=300)
    assert outcomes(results[0]["events"][-1]) == ["rows"]


@pytest.mark.slow  # ~12 s; the default suite's uneven-batch tests below recompile on some ranks, with parity
def test_a_recompiled_graphs_plan_is_adopted_with_parity() -> None:
    halved = rows_case(steps=5, batch_sizes=((4, 4, 2, 2, 2),) * 2)  # half the batch from step 2: Dynamo recompiles
    results = run_on_ranks(check_rows, 2, halved, timeout=300)
    assert outcomes(results[0]["events"][-1]) == ["rows"]  # the recompiled graph's plan, adopted


def test_a_graph_break_between_lookup_and_output_layer_keeps_parity_with_the_table_dense() -> None:
    # The lookup and the output layer in two graphs: no part can be split off across the break, so the table's
    # gradient is dense; it goes dense twice, then it stops trying.
    results = run_on_ranks(check_rows, 2, rows_case(model="broken", steps=5), timeout=300)
    assert not any("@" in n for b in results[0]["buckets"] for n in b)
    assert [outcomes(step) for step in results[0]["events"][1:]] == [["dense"], ["dense"], [], []]


def test_a_hook_registered_after_compile_warns_and_reduces_parts_densely() -> None:
    case = rows_case(hook="fp16", hook_at=2, tolerance=(("rtol", 1e-3), ("atol", 1e-4)))  # fp16 sums, associated differently
    results = run_on_ranks(check_rows, 2, case, timeout=300)
    for rank, result in enumerate(results):
        (warning,) = [w for w in result["warnings"] if "comm hook was registered after torch.compile" in w]
        assert f"[rank {rank}]" in warning and "wte.weight@logits" in warning
        assert outcomes(result["events"][-1]) == []  # the hook reduces every bucket


# -- ranks that see different batch sizes (Note [Plan agreement]) --------------------------------------------------
def uneven_batches(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Parity with PyTorch's DDP after every step while the ranks' batch sizes differ (recompiles on some ranks)."""
    torch._dynamo.reset()
    ours = train("graphddp", case, rank, keep_states=True)
    theirs = train("torch", case, rank, keep_states=True)
    for step, (a, b) in enumerate(zip(ours.states, theirs.states, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step}: {m}")
    plan = ours.ddp.bucket_plan
    return {"fingerprint": plan.fingerprint, "source": plan.source, "events": ours.events}


def schedule(world: int, kind: str, steps: int = 5) -> tuple[tuple[int, ...], ...]:
    if kind == "fixed":  # 4, 6, 8 sequences per rank, every step
        return tuple((4 + 2 * r,) * steps for r in range(world))
    if kind == "shrink_and_grow":  # rank 0 has one short batch in the middle
        return tuple((6, 6, 4, 6, 6) if r == 0 else (6,) * steps for r in range(world))
    if kind == "last_partial":  # DataLoader(drop_last=False) over uneven shards: short last batches, not on rank 0
        return tuple((6,) * (steps - 1) + (6 if r == 0 else 1 + r,) for r in range(world))
    raise ValueError(kind)


# Table sizes at which a rule deciding rows from one rank's batch (world x this rank's tokens <= half the rows)
# splits the ranks: 4 sequences of 16 tokens pass it, 6 do not (2 ranks: 128 <= 160 < 192; 3 ranks:
# 192 <= 280 < 288). The tokens the ranks really touch together stay under half the rows (about 40 %), so the
# all-reduced mask still chooses rows.
VOCAB_FOR_WORLD = {2: 320, 3: 560}


def uneven_batch_cases() -> list[Any]:
    """(kind, model, world) for the uneven-batch test, 10-14 s each. The default suite runs the tied GPT on 2 ranks
    with a fixed and a partial last batch; the slow suite the rest: batches that shrink and grow, 3 ranks (tied),
    and the untied table (the same rows without a part) on 2 ranks, where 3 ranks add nothing the tied cases do
    not cover."""
    cases = []
    for model, world in (("gpt", 2), ("gpt", 3), ("gpt_untied", 2)):
        for kind in ("fixed", "shrink_and_grow", "last_partial"):
            slow = model != "gpt" or world != 2 or kind == "shrink_and_grow"
            cases.append(pytest.param(kind, model, world, marks=pytest.mark.slow) if slow else (kind, model, world))
    return cases


@pytest.mark.parametrize(("kind", "model", "world"), uneven_batch_cases())
def test_compiled_tables_train_when_ranks_see_different_batch_sizes(kind: str, model: str, world: int) -> None:
    case = rows_case(model=model, vocab=VOCAB_FOR_WORLD[world], steps=5, batch_sizes=schedule(world, kind))
    results = run_on_ranks(uneven_batches, world, case, timeout=300)
    assert len({r["fingerprint"] for r in results}) == 1 and {r["source"] for r in results} == {"graph"}
    for result in results:
        last = result["events"][-1]
        # The table is still reduced as rows at the end: no rank's batch made it dense for everyone.
        assert outcomes(last) == ["rows"], last
        if model == "gpt":
            assert any(e[0] == "ready" and e[2] == "wte.weight@logits" for e in last), "the part was not taken"


def tied_gpt_under_users_compiled_autograd(rank: int, world: int, reduction: str) -> list[tuple[bool, bool]]:
    """A compiled tied GPT whose every backward runs under the user's compiled autograd (no events recorded: the
    user's path), against PyTorch's DDP; returns, per step, whether the plan has the table's part and whether the
    step reduced in-graph."""
    import copy

    from models import tied_gpt
    from training import compiled_backward

    import graphddp

    model = tied_gpt()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp = graphddp.DDP(model, **dict(TINY_CAPS), **dict(RAMPED), sparse_embedding_grads=True)
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager", reduction=reduction))
    data = torch.Generator().manual_seed(rank)
    parts = []
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 9), generator=data)
        x, y = idx[:, :-1], idx[:, 1:]
        loss = compiled(x, y)
        with compiled_backward():  # TypeError in compiled autograd's add before: a taken part returned None
            loss.backward()
        ref(x, y).backward()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
        for module in (ddp, ref):
            module.zero_grad(set_to_none=True)
        parts.append((any(p.part for b in ddp.bucket_plan.buckets for p in b.params), ddp.reducer.compile_target.gate.open))
    return parts


@pytest.mark.slow  # ~30 s each: compiled autograd recompiles per step; the default suite stays under 10 minutes
@pytest.mark.parametrize("reduction", ["split", "in_graph"])
def test_a_tied_table_trains_under_the_users_compiled_autograd(reduction: str) -> None:
    for steps in run_on_ranks(tied_gpt_under_users_compiled_autograd, 2, reduction, timeout=300):
        # Split: the table's part keeps its own slot, the tap took it every step. In-graph (from the second step,
        # once the ranks agreed): the rows node and the part's bucket, with the same gradients.
        assert steps[-1] == (True, reduction == "in_graph"), steps
