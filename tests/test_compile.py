"""graphddp under torch.compile, on spawned gloo ranks.

Every case trains the same model, data and optimizer three ways: compiled graphddp, eager graphddp and
PyTorch's eager DDP, and checks that they reach the same parameters; that each captured graph got one segment
per bucket (unless a segment was extended, which the split records); that the Reducer adopted the graph plan
and covers every trainable parameter once; and, from recorded events, that bucket k's all-reduce was launched
before the next segment's backward started.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ranks import run_on_ranks
from training import Case, batch_for, build_model, make_hook

import graphddp
from graphddp.trace import EventLog
from graphddp.workloads import build_workload

TINY = (("bucket_cap_mb", 0.002),)
INDUCTOR_TOLERANCE = (("rtol", 1e-3), ("atol", 1e-4))


@dataclasses.dataclass(frozen=True)
class CompileCase:
    model: str = "mlp"
    """A model of tests/training.py, or ``w:<name>[:<size>]`` for a graphddp workload (gpt, mlp, cnn; tiny)."""
    inner: str = "aot_eager"
    ddp: tuple[tuple[str, Any], ...] = TINY
    first_bucket_cap_mb: float | None = 0.001
    last_bucket_cap_mb: float | None = 0.0005
    """With the TINY caps, both ramps (Note [Bucket ramps]) are cut; None: graphddp's default."""
    steps: int = 5
    optim: str = "sgd"
    compile_kwargs: tuple[tuple[str, Any], ...] = ()
    via: str = "torch.compile"
    hook: str | None = None
    accumulate: int = 1
    no_grad_forward: bool = False
    dynamic_batch: bool = False
    rank_branch: bool = False
    eager_steps: int = 0
    """The first steps call the DDP module eagerly (a warm-up), the rest the compiled one."""
    tolerance: tuple[tuple[str, float], ...] = ()


CASES = {
    "mlp_adam": CompileCase(optim="adam"),
    # SGD: the attention key bias has a zero gradient up to rounding, which Adam would amplify into noise.
    "gpt_tied_weights": CompileCase(model="w:gpt"),
    "cnn_batchnorm": CompileCase(model="w:cnn"),
    "workload_mlp": CompileCase(model="w:mlp"),
    "in_place_ops": CompileCase(model="inplace"),
    "checkpointing": CompileCase(model="checkpointed"),
    "graph_breaks_and_a_graph_without_parameters": CompileCase(model="graph_breaks"),
    "find_unused_rank_dependent_branch": CompileCase(
        model="branchy", ddp=TINY + (("find_unused_parameters", True),), rank_branch=True
    ),
    "static_graph": CompileCase(ddp=TINY + (("static_graph", True),)),
    # The graph is compiled after iteration 0, when static_graph has stopped searching for unused parameters:
    # its plan is still agreed on and adopted (Note [Plan agreement]).
    "static_graph_after_an_eager_step": CompileCase(ddp=TINY + (("static_graph", True),), eager_steps=1),
    "no_sync": CompileCase(accumulate=3),
    "fp16_comm_hook": CompileCase(hook="fp16", tolerance=(("rtol", 1e-3), ("atol", 1e-4))),
    "gradient_as_bucket_view": CompileCase(ddp=TINY + (("gradient_as_bucket_view", True),)),
    "no_grad_forward": CompileCase(no_grad_forward=True),
    "mark_dynamic_batch": CompileCase(dynamic_batch=True),
    "one_bucket": CompileCase(ddp=(), first_bucket_cap_mb=None),
    "one_bucket_per_layer": CompileCase(ddp=(("bucket_cap_mb", 1e-6),), first_bucket_cap_mb=1e-6),
    # 0.25 MiB buckets under the default 1 MiB first bucket: PyTorch's DDPOptimizer refuses this; the small GPT
    # (3.7 MB of gradients) gets many buckets from it.
    "cap_quarter_mb_first_cap_default": CompileCase(model="w:gpt:small", ddp=(("bucket_cap_mb", 0.25),), first_bucket_cap_mb=None, steps=3),
    "fullgraph_via_graphddp_compile": CompileCase(model="w:gpt", via="graphddp.compile", compile_kwargs=(("fullgraph", True),)),
}
# Slow (Inductor compiles each segment): run by CI through the `slow` marker.
INDUCTOR_CASES = {f"inductor_{m}": CompileCase(model=f"w:{m}", inner="inductor") for m in ("mlp", "gpt", "cnn")}


# -- rank side ----------------------------------------------------------------------------------------------------
def workload_of(case: CompileCase):
    name, _, size = case.model[2:].partition(":")
    return build_workload(name, size=size or "tiny", seed=0)


def build(case: CompileCase) -> torch.nn.Module:
    if case.model.startswith("w:"):
        return workload_of(case).model
    return build_model(case.model)


def loss_of(model: torch.nn.Module, case: CompileCase, step: int, micro: int, rank: int) -> torch.Tensor:
    if case.model.startswith("w:"):
        workload = workload_of(case)  # for make_batch (the model it builds is not used)
        return model(*workload.make_batch(torch.Generator().manual_seed(1000 * step + 10 * micro + rank)))
    x, y = batch_for(Case(), step, micro, rank)
    if case.dynamic_batch:  # a different batch size every step, marked dynamic: no recompile
        x, y = x[: 3 + step], y[: 3 + step]
        torch._dynamo.mark_dynamic(x, 0)
    out = model(x, use_shared=rank != 1) if case.rank_branch else model(x)
    return F.mse_loss(out, y)


def train(impl: str, case: CompileCase, rank: int) -> tuple[torch.nn.Module, Any, Any]:
    kwargs = dict(case.ddp)
    module = build(case)
    if impl == "torch":
        ddp = model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
        backend = None
    else:
        if case.first_bucket_cap_mb is not None:
            kwargs["first_bucket_cap_mb"] = case.first_bucket_cap_mb
        if case.last_bucket_cap_mb is not None:
            kwargs["last_bucket_cap_mb"] = case.last_bucket_cap_mb
        ddp = model = graphddp.DDP(module, **kwargs)
        backend = graphddp.backend(case.inner)
        if impl == "compiled":
            compile_kwargs = dict(case.compile_kwargs)
            if case.via == "graphddp.compile":
                model = graphddp.compile(ddp, backend, **compile_kwargs)
            else:
                model = torch.compile(ddp, backend=backend, **compile_kwargs)
    if case.hook:
        ddp.register_comm_hook(*make_hook(case.hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if case.optim == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01)
    log = None
    for step in range(case.steps):
        if impl == "compiled" and step == case.steps - 1:
            ddp.reducer.events = log = EventLog()
        for micro in range(case.accumulate):
            sync = micro == case.accumulate - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss_of(ddp if step < case.eager_steps else model, case, step, micro, rank).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if case.no_grad_forward:
            with torch.no_grad():
                loss_of(model, case, step, 9, rank)
    return ddp, backend, log


def check_case(rank: int, world: int, name: str) -> dict[str, Any]:
    case = {**CASES, **INDUCTOR_CASES}[name]
    torch._dynamo.reset()
    compiled, backend, log = train("compiled", case, rank)
    eager, _, _ = train("eager", case, rank)
    theirs, _, _ = train("torch", case, rank)
    tolerance = dict(case.tolerance or (INDUCTOR_TOLERANCE if case.inner == "inductor" else ()))
    ours_state = compiled.module.state_dict()
    torch.testing.assert_close(ours_state, eager.module.state_dict(), **tolerance)
    torch.testing.assert_close(ours_state, theirs.module.state_dict(), **tolerance)

    plan = compiled.bucket_plan
    trainable = [n for n, p in compiled.module.named_parameters() if p.requires_grad]
    assert sorted(plan.param_names) == sorted(trainable), "every trainable parameter reduced exactly once"
    splits = [(s.num_segments, len(s.plan.buckets), any(seg.extended for seg in s.segments)) for s in backend.splits]
    for segments, buckets, extended in splits:
        assert segments == buckets or extended, splits
    # Where each bucket of the plan in force completes: the segment holding its first slot in the graph's split
    # (the same as bucket k -> segment n-1-k, unless a table gave up rows and its part's bucket was dropped).
    split = backend.splits[-1]
    segment_of = {k: seg.index for seg in split.segments for k in seg.buckets}
    completes_in = [segment_of.get(split.plan.bucket_of(b.params[0].name, b.params[0].part)) if b.params[0].name in split.plan.param_names else None for b in plan.buckets]
    return {
        "splits": splits,
        "completes_in": completes_in,
        "source": plan.source,
        "buckets": len(plan.buckets),
        "fingerprint": plan.fingerprint,
        "events": [(e.kind, e.bucket) for e in log.events] if log else [],
    }


# -- test side ----------------------------------------------------------------------------------------------------
def assert_launch_before_next_segment_backward(
    events: list[tuple[str, int | None]], segments: int, completes_in: list[int | None] | None = None
) -> None:
    """Bucket k completes with segment ``completes_in[k]`` (default: segments-1-k); it must be launched before the
    segment in front of that one runs its backward."""
    seq = {(kind, index): i for i, (kind, index) in enumerate(events) if kind in ("launch", "segment_backward")}
    backward_order = [index for kind, index in events if kind == "segment_backward"]
    assert backward_order == sorted(backward_order, reverse=True) == list(range(segments - 1, -1, -1))
    completes_in = completes_in or list(range(segments - 1, -1, -1))
    checked = [k for k, segment in enumerate(completes_in) if segment]
    assert len(checked) >= segments - 2, (completes_in, segments)
    for k in checked:
        assert seq[("launch", k)] < seq[("segment_backward", completes_in[k] - 1)], (k, events)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_matches_eager_and_torch_ddp(name: str) -> None:
    results = run_on_ranks(check_case, 2, name, timeout=300)
    assert len({r["fingerprint"] for r in results}) == 1, "ranks run different plans"
    first = results[0]
    assert first["splits"], "the backend planned no graph"
    if name == "find_unused_rank_dependent_branch":
        # Ranks captured different graphs (the branch is a Python bool): the shared eager plan stays.
        assert first["source"] != "graph"
        return
    assert first["source"] == "graph"
    if name == "graph_breaks_and_a_graph_without_parameters":
        assert len(first["splits"]) == 2  # the parameter-free graph is compiled whole, not planned
    elif name == "one_bucket":
        assert first["splits"] == [(1, 1, False)]
    elif name not in ("no_sync",) and len(first["splits"]) == 1 and not first["splits"][0][2]:
        segments = first["splits"][0][0]
        assert segments > 1
        assert_launch_before_next_segment_backward(first["events"], segments, first["completes_in"])


def test_world_size_three() -> None:
    results = run_on_ranks(check_case, 3, "gpt_tied_weights", timeout=300)
    assert len({r["fingerprint"] for r in results}) == 1 and results[0]["source"] == "graph"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(INDUCTOR_CASES))
def test_inductor_parity(name: str) -> None:
    results = run_on_ranks(check_case, 2, name, timeout=900)
    assert len({r["fingerprint"] for r in results}) == 1 and results[0]["source"] == "graph"
    splits = results[0]["splits"]
    assert len(splits) == 1 and splits[0][0] == splits[0][1] > 1
    assert_launch_before_next_segment_backward(results[0]["events"], splits[0][0], results[0]["completes_in"])


def ranks_capture_different_graphs(rank: int, world: int) -> None:
    torch._dynamo.reset()
    ddp = graphddp.DDP(build_model("swapped"), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    for step in range(3):
        x, _ = batch_for(Case(), step, 0, rank)
        model(x, a_first=rank == 0).sum().backward()


def test_ranks_with_different_plans_fail_on_every_rank_naming_the_first_differing_bucket() -> None:
    from ranks import expect_failure_on_every_rank

    errors = expect_failure_on_every_rank(ranks_capture_different_graphs, 2, timeout=120)
    for rank, text in errors.items():
        assert f"[rank {rank}] graphddp: the ranks compiled different bucket plans. First difference at bucket 0" in text
        assert "rank 0 has [b.weight" in text and "rank 1 has [a.weight" in text
        assert "find_unused_parameters=True" in text
