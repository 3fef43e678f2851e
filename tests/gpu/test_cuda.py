"""graphddp on a GPU: parity with PyTorch's DDP on CUDA, the collectives' stream ordering, row-sparse reduction of CUDA
tables. Skipped without CUDA (CI has none); on a GPU machine: ``python tests/cuda_check.py`` (docs/gpu.md).

* NCCL at world size 1 and gloo with CUDA tensors on 2 ranks sharing GPU 0: every feature PyTorch's DDP has on
  CUDA (bucket views, ``no_sync``, unused parameters, static graph, the four comm hooks, ``mixed_precision``),
  eager and compiled with Inductor, against ``torch.nn.parallel.DistributedDataParallel`` (eager: the reference);
  ``mixed_precision`` against its definition instead (``reference``: PyTorch 2.11's DDP departs from it on CUDA,
  docs/gpu.md), as on the CPU.
* Ordering, never from timings: collectives run on the current stream (Note [Lean bucket path]); with GPU sleeps
  making the compute stream lag before every gradient is final, the gradients still equal PyTorch's DDP's, and
  the same check with the collectives moved to a side stream (not ordered after the copies into their bucket)
  must fail (the check can fail).
* The same training under ``CUDA_LAUNCH_BLOCKING=0`` and ``=1`` gives the same parameters.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from torch import nn
from training import (
    RAMPED,
    TINY_CAPS,
    Case,
    assert_same_on_all_ranks,
    batch_for,
    loss_for,
    mixed_precision_reference,
    state_of,
    train,
    wrap,
)

from graphddp.runtime.trace import EventLog

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (docs/gpu.md)")

LOW_PRECISION = (("rtol", 1e-2), ("atol", 1e-3))  # fp16/bf16 sums and casts: rounding, 6 steps


def tiny(**fields: Any) -> Case:
    return Case(ddp=TINY_CAPS + fields.pop("ddp", ()), graphddp=fields.pop("graphddp", RAMPED), device="cuda", **fields)


def mixed(**dtypes: torch.dtype) -> tuple[tuple[str, Any], ...]:
    from torch.nn.parallel.distributed import _MixedPrecision

    return (("mixed_precision", _MixedPrecision(**dtypes)),)


CASES = {
    "default": tiny(),
    "gradient_as_bucket_view": tiny(ddp=(("gradient_as_bucket_view", True),)),
    "no_sync": tiny(accumulate=3),
    "find_unused_parameters": tiny(model="branchy", ddp=(("find_unused_parameters", True),)),
    "static_graph": tiny(ddp=(("static_graph", True),)),
    "hook_allreduce": tiny(hook="allreduce"),
    "hook_fp16": tiny(hook="fp16", tolerance=LOW_PRECISION),
    "hook_bf16": tiny(hook="bf16", tolerance=LOW_PRECISION),
    # PowerSGD compresses per bucket: both implementations must cut the same buckets, so one bucket.
    "hook_powersgd": Case(hook="powersgd", steps=8, device="cuda"),
    # A token model: its cross-entropy takes bf16 logits (MSE on the regression models would meet a bf16 output
    # and an fp32 target, which CUDA's mse_loss backward refuses under either DDP). Untied: PyTorch's DDP marks a
    # tied weight ready twice under mixed_precision ("lm_head.weight has been marked as ready twice", seen on an
    # H100 with torch 2.11), so the tied GPT has no reference there.
    "mixed_precision": tiny(model="gpt_untied", ddp=mixed(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), tolerance=LOW_PRECISION),
    "mixed_precision_bf16_reduce": tiny(model="gpt_untied", ddp=mixed(param_dtype=torch.bfloat16), tolerance=LOW_PRECISION),
}
NCCL_ONLY = {"hook_bf16"}  # bf16_compress_hook refuses other backends
INDUCTOR_TOLERANCE = (("rtol", 1e-3), ("atol", 1e-4))  # Inductor's fused kernels round differently from eager's
# PowerSGD's rank-1 approximation with error feedback carries Inductor's rounding from step to step: on an H100,
# after 8 steps, 4.6e-4 absolute (gloo, 2 ranks) and 2.5e-3 on one element of 384 (NCCL, 1 rank); on an H200
# (torch 2.11), 7.0e-3 (gloo, 2 ranks); eager, it matches PyTorch's DDP at the default tolerance.
INDUCTOR_TOLERANCE_OF = {"hook_powersgd": (("rtol", 5e-2), ("atol", 1e-2))}


def setups() -> list[Any]:
    """(backend, world size, case, mode) for every parity test."""
    out = []
    for backend, world in (("nccl", 1), ("gloo", 2)):
        for name in CASES:
            if backend != "nccl" and name in NCCL_ONLY:
                continue
            for mode in ("eager", "inductor"):
                out.append(pytest.param(backend, world, name, mode, id=f"{backend}{world}-{name}-{mode}"))
    return out


def reference(case: Case, world: int, rank: int) -> nn.Module:
    """PyTorch's DDP trained eagerly on the same case; for ``mixed_precision``, its definition instead: on an H200
    with torch 2.11, PyTorch's DDP differs from that definition (5e-2 on the LayerNorm weights after one SGD step,
    NCCL, one rank), where graphddp equals it exactly (docs/gpu.md)."""
    config = dict(case.ddp).get("mixed_precision")
    if config is None:
        return train("torch", case.eager(), rank).ddp.module
    dtypes = {k: getattr(config, k) for k in ("param_dtype", "reduce_dtype") if getattr(config, k) is not None}
    return mixed_precision_reference(case.eager(), world, dtypes)


def cuda_parity(rank: int, world: int, name: str, mode: str) -> int:
    case = CASES[name]
    if mode == "inductor":
        tolerance = dict(case.tolerance) or dict(INDUCTOR_TOLERANCE_OF.get(name, INDUCTOR_TOLERANCE))
        case = dataclasses.replace(case, compile="torch.compile", inner="inductor", tolerance=tuple(tolerance.items()))
    ours = train("graphddp", case, rank).ddp
    for p in ours.module.parameters():
        assert p.is_cuda, "graphddp moved a parameter off the GPU"
    torch.testing.assert_close(state_of(ours.module), state_of(reference(case, world, rank)), **dict(case.tolerance))
    assert_same_on_all_ranks({n: p.detach() for n, p in ours.module.named_parameters()})
    return len(ours.bucket_plan.buckets)


@pytest.mark.parametrize(("backend", "world", "name", "mode"), setups())
def test_parity_with_pytorch_ddp_on_cuda(backend: str, world: int, name: str, mode: str) -> None:
    buckets = run_on_ranks(cuda_parity, world, name, mode, backend=backend, timeout=300)
    assert len(set(buckets)) == 1
    if name != "hook_powersgd":
        assert buckets[0] > 1, "the case should cut several buckets"


# -- ordering on the GPU ------------------------------------------------------------------------------------------
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time: the stream that sleeps lags far behind the CPU that feeds it


class LaggingStream(EventLog):
    """The Reducer's events; each gradient's ``ready`` also puts a GPU sleep on the current stream, so the copies
    into a bucket run long after the CPU launched its collective: a collective not ordered after them would
    reduce a stale buffer."""

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        super().record(kind, bucket, param)
        if kind == "ready":
            torch.cuda._sleep(SLEEP_CYCLES)


def ordering_on_gpu(rank: int, world: int, broken: str | None) -> list[str]:
    """Train two steps with the compute stream lagging; return where the gradients differ from PyTorch's DDP's.
    graphddp issues each collective on the current stream (Note [Lean bucket path]): the process group orders it
    after the copies into the bucket, and ``Work.wait()`` the write-back after it. ``broken="launch"`` issues the
    collectives on a side stream instead, which the process group orders after nothing of the backward's: the
    check must then find stale gradients."""
    from graphddp.runtime import reductions

    original = reductions.AveragingReduction.start
    side = torch.cuda.Stream()

    def on_side_stream(self: Any, bucket: Any, buffer: torch.Tensor, is_last: bool) -> Any:
        with torch.cuda.stream(side):
            return original(self, bucket, buffer, is_last)

    if broken == "launch":
        reductions.AveragingReduction.start = on_side_stream
    try:
        case = tiny(model="mlp", steps=2)
        ddp, model = wrap("graphddp", case, rank)
        ref, _ = wrap("torch", case.eager(), rank)
        problems = []
        for step in range(case.steps):
            ddp.reducer.events = LaggingStream()
            batch = batch_for(case, step, 0, rank)
            loss_for(model, case, batch, rank).backward()
            loss_for(ref, case, batch, rank).backward()
            for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
                if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
                    problems.append(f"step {step}: {name}: gradient differs from PyTorch's DDP's")
            for module in (ddp, ref):
                module.zero_grad(set_to_none=True)
        return problems
    finally:
        reductions.AveragingReduction.start = original


@pytest.mark.parametrize(("backend", "world"), [("nccl", 1), ("nccl", 2), ("gloo", 2)])
def test_collectives_ordered_after_their_gradients_and_before_the_write_back(backend: str, world: int) -> None:
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL on {world} ranks needs {world} GPUs")
    assert run_on_ranks(ordering_on_gpu, world, None, backend=backend) == [[]] * world


def test_the_ordering_check_fails_when_a_collective_is_not_ordered_after_its_gradients() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("one rank sums nothing: a stale buffer shows only between two GPUs")
    found = run_on_ranks(ordering_on_gpu, 2, "launch", backend="nccl")
    assert any(found), found


# -- CUDA_LAUNCH_BLOCKING ------------------------------------------------------------------------------------------
def test_same_parameters_with_and_without_launch_blocking(tmp_path: Any) -> None:
    """Asynchronous launches (the default) may not change results: a missing stream wait would, by racing."""
    states = []
    for blocking in ("0", "1"):
        out = tmp_path / f"state-{blocking}.pt"
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": blocking}
        probe = os.path.join(os.path.dirname(__file__), "launch_probe.py")
        subprocess.run([sys.executable, probe, str(out)], env=env, check=True, timeout=300)
        states.append(torch.load(out))
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)


# -- row-sparse reduction of CUDA tables (Note [Row-sparse gradients]) ------------------------------------------
def rows_on_cuda(rank: int, world: int) -> list[int]:
    from reduce_rows import reduce_rows

    touched = []
    for rows in ([1, 2 + rank], [3], []):
        table = torch.zeros(64, 8, device="cuda")
        if rows:
            table.index_fill_(0, torch.tensor(rows, device="cuda"), float(rank + 1))
        dense = table.clone()
        dist.all_reduce(dense)
        result, launch = reduce_rows(table)
        assert result.is_cuda
        torch.testing.assert_close(result, dense)
        touched.append(launch.touched)
    return touched


def test_row_sparse_reduction_of_cuda_tables_equals_the_dense_all_reduce() -> None:
    assert run_on_ranks(rows_on_cuda, 2) == [[3, 1, 0]] * 2
