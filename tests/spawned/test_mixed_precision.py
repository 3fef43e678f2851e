"""``mixed_precision`` on spawned gloo ranks (Note [Mixed precision] in graphddp/runtime/precision.py)."""

from __future__ import annotations

import pytest
import torch
from models import build_model
from ranks import run_on_ranks
from training import Case, mixed_precision_reference, train

import graphddp

# PyTorch's DDP mixed precision needs an accelerator's streams and events ("cpu backend doesn't support events"), so
# the reference is the definition (training.mixed_precision_reference).
MIXED = {
    "bf16": {"param_dtype": torch.bfloat16},
    "bf16_reduce_fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "fp32_reduce_bf16": {"reduce_dtype": torch.bfloat16},
}
COMPILED = {"bf16_reduce_fp32": "in_graph", "fp32_reduce_bf16": "split"}
"""Also trained under torch.compile (graph plans use the reduce dtype too), with the strategy each must run: a
reduce dtype other than the parameters' keeps the split (the Reducer casts), else the gradients reduce in-graph."""


def train_mixed_precision(rank: int, world: int, name: str, compile: str | None) -> None:
    from torch.nn.parallel.distributed import _MixedPrecision

    case = Case(
        ddp=(("mixed_precision", _MixedPrecision(**MIXED[name])), ("bucket_cap_mb", 0.002)),
        graphddp=(("first_bucket_cap_mb", 0.001),),
        compile=compile,
        steps=4,
        record_events=compile is None,  # recording a timeline keeps a compiled graph off in-graph reduction
    )
    run = train("graphddp", case, rank)
    if compile:
        assert run.ddp.bucket_plan.source == "graph" and len(run.ddp.bucket_plan.buckets) > 1, run.ddp.bucket_plan.describe()
        target = run.ddp.reducer.compile_target
        strategies = [str(r) for r in target.reductions]
        assert strategies and all(s.startswith(COMPILED[name]) for s in strategies), strategies
        if COMPILED[name] == "split":
            assert all("mixed_precision reduces in another dtype" in s for s in strategies), strategies
        assert (target.gate.in_graph_forwards > 0) == (COMPILED[name] == "in_graph"), target.gate.in_graph_forwards
    reduce_dtype = MIXED[name].get("reduce_dtype", MIXED[name].get("param_dtype"))
    assert {b.dtype for b in run.ddp.bucket_plan.buckets} == {reduce_dtype}, run.ddp.bucket_plan.describe()
    for n, p in run.ddp.module.named_parameters():  # outside forward and backward: full precision
        assert p.dtype == torch.float32 and p.grad is None or p.grad.dtype == torch.float32, n
    reference = mixed_precision_reference(case, world, MIXED[name])
    # graphddp scales by 1/world before the sum, the reference after it: the same in low precision only when
    # dividing by the world size is exact (Note [Mixed precision]).
    exact = world & (world - 1) == 0
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if exact else {"rtol": 5e-2, "atol": 1e-3}  # bf16 rounding, 6 steps
    torch.testing.assert_close(run.ddp.module.state_dict(), reference.state_dict(), **tolerance)


@pytest.mark.parametrize(
    ("name", "world", "compile"),
    [(name, 2, None) for name in sorted(MIXED)]
    + [pytest.param(name, 3, None, marks=pytest.mark.slow) for name in sorted(MIXED)]  # 3 ranks: slow suite (time)
    + [(name, 2, "torch.compile") for name in sorted(COMPILED)]
    + [pytest.param(name, 3, "torch.compile", marks=pytest.mark.slow) for name in sorted(COMPILED)],
)
def test_mixed_precision_matches_its_definition(name: str, world: int, compile: str | None) -> None:
    run_on_ranks(train_mixed_precision, world, name, compile)


def mixed_precision_buffers_and_hooks(rank: int, world: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel.distributed import _MixedPrecision

    ddp = graphddp.DDP(build_model("bn"), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    assert ddp.module.bn.running_mean.dtype == torch.bfloat16 and ddp.module.bn.num_batches_tracked.dtype == torch.int64
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # PyTorch's mixed precision takes the hook slot
    x = torch.randn(8, 12)  # [B, IN]
    with torch.no_grad():
        assert ddp(x).dtype == torch.bfloat16  # computed in param_dtype; parameters stay full precision
    ddp(x).float().square().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in ddp.parameters())


def test_mixed_precision_casts_buffers_and_keeps_the_comm_hook_free() -> None:
    run_on_ranks(mixed_precision_buffers_and_hooks, 2)
