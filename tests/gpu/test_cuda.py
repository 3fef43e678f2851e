"""graphddp on a GPU: parity with PyTorch's DDP on CUDA, the comm stream's ordering, row-sparse reduction of CUDA
tables. Skipped without CUDA (CI has none); on a GPU machine: ``python tests/cuda_check.py`` (docs/gpu.md).

* NCCL at world size 1 and gloo with CUDA tensors on 2 ranks sharing GPU 0: every feature PyTorch's DDP has on
  CUDA (bucket views, ``no_sync``, unused parameters, static graph, the four comm hooks, ``mixed_precision``),
  eager and compiled with Inductor, against ``torch.nn.parallel.DistributedDataParallel`` (eager: the reference).
* Ordering from recorded CUDA events, never timings: each bucket's collective is issued on the Reducer's comm
  stream and starts on the GPU after the event that ends its last gradient; the optimizer's first kernel comes
  after every bucket's collective. A GPU sleep makes one stream lag the other, so a missing wait would show; the
  same check run against a comm stream with its waits removed must fail (the check can fail).
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
from training import (
    RAMPED,
    TINY_CAPS,
    Case,
    assert_same_on_all_ranks,
    batch_for,
    loss_for,
    make_optimizer,
    state_of,
    train,
    wrap,
)

import graphddp.runtime.comm
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
# after 8 steps, 4.6e-4 absolute (gloo, 2 ranks) and 2.5e-3 on one element of 384 (NCCL, 1 rank); eager, it
# matches PyTorch's DDP at the default tolerance.
INDUCTOR_TOLERANCE_OF = {"hook_powersgd": (("rtol", 5e-2), ("atol", 5e-3))}


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


def cuda_parity(rank: int, world: int, name: str, mode: str) -> int:
    case = CASES[name]
    if mode == "inductor":
        tolerance = dict(case.tolerance) or dict(INDUCTOR_TOLERANCE_OF.get(name, INDUCTOR_TOLERANCE))
        case = dataclasses.replace(case, compile="torch.compile", inner="inductor", tolerance=tuple(tolerance.items()))
    ours = train("graphddp", case, rank).ddp
    theirs = train("torch", case.eager(), rank).ddp
    for p in ours.module.parameters():
        assert p.is_cuda, "graphddp moved a parameter off the GPU"
    torch.testing.assert_close(state_of(ours.module), state_of(theirs.module), **dict(case.tolerance))
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


class CudaMarks(EventLog):
    """The Reducer's events, each also a CUDA event on the stream current when it was recorded; ``comm_start`` and
    ``comm_end`` mark where a collective begins and becomes final on the comm stream."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[str, int | None, torch.cuda.Event, torch.cuda.Stream]] = []

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        super().record(kind, bucket, param)
        if kind == "ready":  # the compute stream lags: a collective that did not wait for it would start early
            torch.cuda._sleep(SLEEP_CYCLES)
        self.mark(kind, bucket, torch.cuda.current_stream())

    def mark(self, kind: str, bucket: int | None, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.marks.append((kind, bucket, event, stream))


def ordering_violations(marks: CudaMarks, comm_stream: torch.cuda.Stream) -> list[str]:
    """What the recorded CUDA events contradict: a collective not on the comm stream, started before its bucket's
    last gradient, or final after the optimizer began."""
    torch.cuda.synchronize()
    origin = marks.marks[0][2]
    t = [origin.elapsed_time(event) for _, _, event, _ in marks.marks]  # ms since the first mark, GPU clock
    launches = [m[1] for m in marks.marks if m[0] == "launch"]
    starts = [i for i, m in enumerate(marks.marks) if m[0] == "comm_start"]
    ends = [i for i, m in enumerate(marks.marks) if m[0] == "comm_end"]
    optimizer = next(i for i, m in enumerate(marks.marks) if m[0] == "optimizer")
    assert len(launches) == len(starts) == len(ends) > 1, (launches, len(starts), len(ends))
    problems = []
    for bucket, start, end in zip(launches, starts, ends):
        if marks.marks[start][3] != comm_stream or marks.marks[end][3] != comm_stream:
            problems.append(f"bucket {bucket}: collective not on the comm stream")
        last_ready = max(t[i] for i, m in enumerate(marks.marks) if m[0] == "ready" and m[1] == bucket)
        if t[start] < last_ready:
            problems.append(f"bucket {bucket}: collective began {last_ready - t[start]:.3f} ms before its last gradient")
        if t[optimizer] < t[end]:
            problems.append(f"bucket {bucket}: optimizer began {t[end] - t[optimizer]:.3f} ms before the collective was final")
    return problems


def ordering_on_gpu(rank: int, world: int, broken: str | None) -> list[str]:
    """Train two steps recording CUDA marks; return the ordering violations of the second (``broken``: the comm
    stream's launch wait or final join removed, to show the check fails then)."""
    comm_class = graphddp.runtime.comm.CudaCommStream
    original = {"launch": comm_class.launch, "wait": comm_class.wait, "join_compute": comm_class.join_compute}
    marks = CudaMarks()
    comm_streams: set[torch.cuda.Stream] = set()

    def launch(self: Any, fn: Any) -> Any:
        comm_streams.add(self.stream)

        def marked() -> Any:
            torch.cuda._sleep(SLEEP_CYCLES)  # the collective starts late: an optimizer that did not wait would pass it
            marks.mark("comm_start", None, torch.cuda.current_stream())
            return fn()

        if broken == "launch":
            with torch.cuda.stream(self.stream):
                return marked()
        return original["launch"](self, marked)

    def wait(self: Any, future: Any) -> Any:
        value = original["wait"](self, future)
        marks.mark("comm_end", None, self.stream)
        return value

    comm_class.launch, comm_class.wait = launch, wait
    if broken == "join":
        comm_class.join_compute = lambda self: None
    try:
        case = tiny(model="mlp", steps=2)
        ddp, model = wrap("graphddp", case, rank)
        opt = make_optimizer(model.parameters(), case)
        for step in range(case.steps):
            marks.marks.clear()
            ddp.reducer.events = marks
            loss_for(model, case, batch_for(case, step, 0, rank), rank).backward()
            marks.mark("optimizer", None, torch.cuda.current_stream())
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert len(comm_streams) == 1, "one Reducer, one comm stream"
        return ordering_violations(marks, comm_streams.pop())
    finally:
        for name, fn in original.items():
            setattr(comm_class, name, fn)


@pytest.mark.parametrize(("backend", "world"), [("nccl", 1), ("gloo", 2)])
def test_collectives_on_the_comm_stream_after_their_gradients_and_before_the_optimizer(backend: str, world: int) -> None:
    assert run_on_ranks(ordering_on_gpu, world, None, backend=backend) == [[]] * world


@pytest.mark.parametrize("broken", ["launch", "join"])
def test_the_ordering_check_fails_when_a_wait_is_missing(broken: str) -> None:
    found = run_on_ranks(ordering_on_gpu, 1, broken, backend="nccl")[0]
    word = "before its last gradient" if broken == "launch" else "before the collective was final"
    assert any(word in problem for problem in found), found


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
