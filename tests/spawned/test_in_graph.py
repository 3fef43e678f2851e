"""In-graph reduction on spawned gloo ranks (Note [In-graph reduction]): the same gradients as PyTorch's DDP on 2
and 3 ranks, no hook called while the graph reduces, and the split (with the Reducer) wherever in-graph must not or
cannot run: the first step, no_sync micro-steps and the step after them, features that need the Reducer."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from models import IN, MLP, OUT
from ranks import run_on_ranks
from training import CAPS, counted_hooks

import graphddp


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, IN, generator=g), torch.randn(6, OUT, generator=g)


def train(rank: int, world: int, inner: str, reduction: str, accumulate: int, ddp_kwargs: dict) -> list[tuple]:
    """Per step: (gate open at the synchronising forward, hook calls in its backward); asserts parity throughout."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_kwargs)
    with counted_hooks() as calls:
        ddp = graphddp.DDP(model, **CAPS, **ddp_kwargs)
        compiled = torch.compile(ddp, backend=graphddp.backend(inner, reduction=reduction))
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ddp, ref))
        record = []
        for step in range(5):
            for micro in range(accumulate):
                sync = micro == accumulate - 1
                x, y = batch(step, micro, rank)
                before = calls[0]
                for module in (compiled, ref):
                    with contextlib.nullcontext() if sync else (ddp if module is compiled else ref).no_sync():
                        F.mse_loss(module(x), y).backward()
                if sync:
                    record.append((ddp.reducer.compile_target.gate.open, calls[0] - before))
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    reductions = {str(r) for r in ddp.reducer.compile_target.reductions}
    return [*record, reductions]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_in_graph_matches_pytorch_ddp_and_calls_no_hook(world: int) -> None:
    params = len(list(MLP().parameters()))
    for *steps, reductions in run_on_ranks(train, world, "aot_eager", "auto", 1, {}):
        assert reductions == {"in_graph (traceable)"}
        # Step 0 runs split while the ranks agree on plan and strategy; from then on the graph reduces, no hook runs.
        assert steps[0] == (False, params)
        assert steps[1:] == [(True, 0)] * 4, steps


def test_no_sync_micro_steps_accumulate_locally_and_the_step_after_averages_the_whole_sum() -> None:
    params = len(list(MLP().parameters()))
    for *steps, _ in run_on_ranks(train, 2, "aot_eager", "auto", 2, {}):
        # Every step has a no_sync micro-step before it, so every synchronising step runs split, by the Reducer:
        # a hook per gradient, until its buckets are counted in C (one hook per bucket).
        assert all(not open_ for open_, _ in steps) and steps[0] == (False, params), steps
        assert 0 < steps[-1][1] < params, steps


def test_static_graph_reduces_in_graph_too() -> None:
    for *steps, reductions in run_on_ranks(train, 2, "aot_eager", "auto", 1, {"static_graph": True}):
        assert reductions == {"in_graph (traceable)"}
        assert steps[-1] == (True, 0)


def test_split_when_asked_or_when_a_feature_needs_the_reducer() -> None:
    params = len(list(MLP().parameters()))
    for *steps, reductions in run_on_ranks(train, 2, "aot_eager", "split", 1, {}):
        assert reductions == {"split (asked for)"} and all(not open_ for open_, _ in steps) and steps[0] == (False, params)
        assert 0 < steps[-1][1] < params, steps  # the split's buckets counted in C by then: one hook per bucket
    for *steps, reductions in run_on_ranks(train, 2, "aot_eager", "auto", 1, {"find_unused_parameters": True}):
        assert reductions == {"split (in-graph cannot serve: find_unused_parameters)"}
        assert all(not open_ for open_, _ in steps)
    for *_steps, reductions in run_on_ranks(train, 2, "eager", "in_graph", 1, {}):
        (reason,) = reductions
        assert reason.startswith("split (in-graph cannot serve: the inner compiler") and "not AOTAutograd-based" in reason


def compiled_again(rank: int, world: int, first: str, then: str) -> list[int]:
    """Three steps compiled with ``reduction=first``, Dynamo reset, three compiled with ``then``, against PyTorch's
    DDP step by step; the in-graph runs counted after each three."""
    ddp, ref = fresh_pair()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    runs = []
    for epoch, reduction in enumerate((first, then)):
        torch._dynamo.reset()
        compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager", reduction=reduction))
        for step in range(3):
            x, y = batch(step, epoch, rank)
            for module in (compiled, ref):
                F.mse_loss(module(x), y).backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            for p, q in zip(ddp.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)
        runs.append(ddp.reducer.compile_target.gate.in_graph_forwards)
    return runs


@pytest.mark.parametrize(("first", "then", "runs"), [("auto", "split", [2, 2]), ("split", "auto", [0, 2])])
def test_compiled_again_with_another_reduction_switches_on_every_rank(first: str, then: str, runs: list[int]) -> None:
    """The recompile cuts by the plan made before and proposes it anew with its new strategy; the ranks switch
    once they agree: in-graph to split (it raised "compiled again without an in-graph variant" before), split to
    in-graph (it stayed split for good before). The first forward of each graph proposes, so two of three run
    in-graph."""
    assert run_on_ranks(compiled_again, 2, first, then) == [runs, runs]


def fresh_pair() -> tuple[graphddp.DDP, torch.nn.parallel.DistributedDataParallel]:
    """graphddp's DDP and PyTorch's around the same initial MLP, Dynamo's caches cleared (ranks are pooled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    return graphddp.DDP(model, **CAPS), ref


def register_late(rank: int, world: int, feature: str) -> list[bool]:
    """A comm hook or step_in_backward set after the graph was compiled for in-graph reduction: the Reducer takes
    over at the next forward (its hooks back on), with PyTorch's DDP's gradients and weights."""
    ddp, ref = fresh_pair()
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    opened = []
    for step in range(5):
        if step == 3:
            if feature == "comm_hook":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                for module in (ddp, ref):
                    module.register_comm_hook(None, allreduce_hook)
            else:
                ddp.step_in_backward(opt)
        x, y = batch(step, 0, rank)
        for module in (compiled, ref):
            F.mse_loss(module(x), y).backward()
        opened.append(ddp.reducer.compile_target.gate.open)
        if not (feature == "step_in_backward" and step >= 3):
            opt.step()
        ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    return opened


@pytest.mark.parametrize("feature", ["comm_hook", "step_in_backward"])
def test_a_feature_set_after_compiling_closes_the_gate(feature: str) -> None:
    for opened in run_on_ranks(register_late, 2, feature):
        assert opened == [False, True, True, False, False]


def register_late_then_recompile_alone(rank: int, world: int) -> list[bool]:
    """A built-in comm hook registered after compiling (step 3), then rank 0 alone compiles the graph again (a
    shorter batch at step 4): the gate stays closed on every rank, and the gradients stay PyTorch's DDP's."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp, ref = fresh_pair()
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    opened = []
    for step in range(6):
        if step == 3:
            for module in (ddp, ref):
                module.register_comm_hook(None, allreduce_hook)
        x, y = batch(step, 0, rank)
        if step >= 4 and rank == 0:
            x, y = x[:4], y[:4]  # another shape on rank 0 only: Dynamo compiles the graph again there
        for module in (compiled, ref):
            F.mse_loss(module(x), y).backward()
        opened.append(ddp.reducer.compile_target.gate.open)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        ddp.zero_grad(), ref.zero_grad()
    return opened


def test_a_graph_compiled_again_on_one_rank_after_a_late_comm_hook_keeps_the_gate_closed() -> None:
    for opened in run_on_ranks(register_late_then_recompile_alone, 2, timeout=180):
        assert opened == [False, True, True, False, False, False]


def users_allreduce(state, bucket):  # a comm hook a user wrote: Python graphddp does not trace
    import torch.distributed as dist

    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def hooked(rank: int, world: int, hook_name: str) -> tuple[list[str], int]:
    """A comm hook registered before compiling, on both DDPs: PyTorch's built-in ones are traced into the graph."""
    from training import make_hook

    ddp, ref = fresh_pair()
    for module in (ddp, ref):
        module.register_comm_hook(*(make_hook(hook_name) if hook_name != "users" else (None, users_allreduce)))
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    for step in range(4):
        x, y = batch(step, 0, rank)
        for module in (compiled, ref):
            F.mse_loss(module(x), y).backward()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)  # fp16 on the wire: both round alike
        ddp.zero_grad(), ref.zero_grad()
    target = ddp.reducer.compile_target
    return sorted({str(r) for r in target.reductions}), target.gate.in_graph_forwards


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "users"])  # bf16: PyTorch refuses it on gloo
def test_builtin_comm_hooks_are_traced_and_others_keep_the_split(hook_name: str) -> None:
    for reductions, in_graph_runs in run_on_ranks(hooked, 2, hook_name):
        if hook_name == "users":
            assert reductions == ["split (in-graph cannot serve: a comm hook other than the built-in allreduce/fp16/bf16 ones)"]
            assert in_graph_runs == 0
        else:
            assert reductions == ["in_graph (traceable)"] and in_graph_runs == 3


def compiled_autograd_steps(rank: int, world: int) -> tuple[list[str], int]:
    ddp, ref = fresh_pair()
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    from torch._dynamo import compiled_autograd

    for step in range(3):
        x, y = batch(step, 0, rank)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            F.mse_loss(compiled(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        ddp.zero_grad(), ref.zero_grad()
    target = ddp.reducer.compile_target
    return sorted({str(r) for r in target.reductions}), target.gate.in_graph_forwards


def test_in_graph_under_compiled_autograd() -> None:
    for reductions, in_graph_runs in run_on_ranks(compiled_autograd_steps, 2):
        # compiled autograd traces the in-graph backward's collectives with the rest: still no hook, no split
        assert reductions == ["in_graph (traceable)"] and in_graph_runs == 2, (reductions, in_graph_runs)


def backward_calls_under_inductor(rank: int, world: int, cap_mb: float | None) -> tuple[int, int, list[str]]:
    """(Python calls of one steady compiled backward, buckets, strategies) for 24 layers (48 parameters) under
    Inductor: graphddp's DDP at ``cap_mb`` every cap, or the model alone (``None``)."""
    from bench.overhead import CallCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(24)])
    ddp = None
    if cap_mb is not None:
        ddp = graphddp.DDP(model, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb, last_bucket_cap_mb=cap_mb, bucket_ramps=False)
    compiled = torch.compile(ddp if ddp is not None else model, backend=graphddp.backend("inductor") if ddp is not None else "inductor")
    x = torch.randn(8, 16)  # [B, 16]
    for _ in range(3):
        compiled(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    calls = CallCounter().count_backward(compiled(x).square().mean())  # bench.overhead's count, every thread
    if ddp is None:
        return calls, 0, []
    return calls, len(ddp.bucket_plan.buckets), sorted({str(r) for r in ddp.reducer.compile_target.reductions})


@pytest.mark.slow
def test_in_graph_backward_costs_python_per_bucket_not_per_parameter() -> None:
    """Issue 24: the Python calls a compiled backward adds at two ranks grow with the buckets, not the parameters."""
    (alone, _, _), _ = run_on_ranks(backward_calls_under_inductor, 2, None)
    (few, few_buckets, strategies), _ = run_on_ranks(backward_calls_under_inductor, 2, 0.02)
    (many, many_buckets, _), _ = run_on_ranks(backward_calls_under_inductor, 2, 0.001)  # a layer a bucket
    assert strategies == ["in_graph (traceable)"], strategies
    assert many_buckets >= few_buckets + 10, (few_buckets, many_buckets)
    per_bucket = (many - few) / (many_buckets - few_buckets)  # the functional collectives' Python entry points
    assert per_bucket <= 12, (alone, few, few_buckets, many, many_buckets)
    # What the DDP adds at few buckets is what those buckets cost, nothing per parameter (48 of them).
    assert few - alone <= per_bucket * few_buckets + 8 < 48, (alone, few, few_buckets, per_bucket)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_in_graph_with_inductor_matches_pytorch_ddp(world: int) -> None:
    for *steps, reductions in run_on_ranks(train, world, "inductor", "auto", 1, {}):
        assert reductions == {"in_graph (traceable)"} and steps[1:] == [(True, 0)] * 4, steps


def eager_in_between(rank: int, world: int) -> list[bool]:
    """Compiled steps reducing in-graph, then a step through the DDP module called eagerly (what Dynamo's fallback
    past its recompile limit does too): the Reducer takes that step, with PyTorch's DDP's gradients."""
    ddp, ref = fresh_pair()
    compiled = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    reduced_in_graph = []
    for step in range(5):
        x, y = batch(step, 0, rank)
        runs = ddp.reducer.compile_target.gate.in_graph_forwards
        for module in (ddp if step == 3 else compiled, ref):
            F.mse_loss(module(x), y).backward()
        reduced_in_graph.append(ddp.reducer.compile_target.gate.in_graph_forwards > runs)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        ddp.zero_grad(), ref.zero_grad()
    return reduced_in_graph


def test_a_forward_that_runs_no_compiled_graph_is_reduced_by_the_reducer() -> None:
    for reduced_in_graph in run_on_ranks(eager_in_between, 2):
        assert reduced_in_graph == [False, True, True, False, True]
