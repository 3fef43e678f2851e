"""Where the average of a bucket costs least: ``python -m bench.wire_average`` (gloo on the CPU, NCCL on CUDA).

A DDP averages a bucket in one of two ways, and ``WIRE_AVERAGING`` (Note [Averaged on the wire] in
``graphddp.runtime.reductions``) picks, per backend, the one measured here:

- ``sum``: the caller multiplies the bucket by ``1/world`` (one ``mul_``, on the thread that runs backward, right
  after the bucket was copied in, so on data still in cache where the bucket fits), then all-reduces it with
  ``ReduceOp.SUM``: what PyTorch's DDP does, and graphddp on a backend not in the table;
- ``avg``: the bucket goes unscaled and is all-reduced with ``ReduceOp.AVG``, the backend dividing (gloo: one more
  pass on its worker thread, after the sum; NCCL: each contribution pre-multiplied inside the kernel).

Every step copies each bucket in from a tensor of its own (the gradients) and all-reduces it, for buckets of the
sizes given (``--sizes``; the default is the ten buckets ``bench.overhead``'s GPT plan makes at 1 MiB caps), one
after the other without waiting, then waits for all, as a backward does; so ``sum``'s ``mul_`` runs on a bucket
just written, as in a DDP. The two ways are interleaved step by step (``pass_order``: in turn, the order reversed
every other pass), with a barrier before each step. Per step it reports, as the median over steps and the mean over
ranks: wall time; CPU time of the calling thread (the copies, the ``mul_`` and the launches); CPU time of every
other thread of the process (the process group's workers: gloo reduces there); and CPU time of the whole process
(its own median, not the sum of the two). On a host whose cores the ranks share (2 vCPUs, 2 ranks), a pass moved
onto a worker thread is not free: it is CPU the other rank's backward does not get, so the total is what counts
there. On CUDA the CPU clocks are read before the stream is synchronised, so they show the launches only; wall
time (after it) is the figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

from graphddp.tools.launch import free_port, import_before_init

from .interleave import pass_order
from .modes import dense_bucket_buffers
from .overhead import OverheadOptions, build_model, spawn_and_collect

WAYS = ("sum", "avg")


@functools.cache
def gpt_buckets() -> tuple[int, ...]:
    """Elements of each bucket of ``bench.overhead``'s GPT plan at its caps, as its ``bound`` modes send them (148
    tensors at width 128, vocabulary 4096, caps of 1 MiB: nine buckets of a block and a third each, and the last
    with the tied table): the default ``--sizes``."""
    o = OverheadOptions()
    return tuple(buffer.numel() for buffer in dense_bucket_buffers(build_model(o), o.caps))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireAverageOptions:
    """One ``bench.wire_average`` run."""

    world_size: int = 2
    """Ranks (gloo over loopback on the CPU, NCCL on CUDA: a GPU per rank)."""
    sizes: tuple[int, ...] = dataclasses.field(default_factory=gpt_buckets)
    """Elements of each bucket all-reduced per step, in launch order."""
    dtype: str = "float32"
    """The buckets' dtype (a ``torch`` attribute name)."""
    steps: int = 300
    """Timed steps per way (after ``warmup``)."""
    warmup: int = 20
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"--world-size must be >= 2 (one rank sends nothing), got {self.world_size}")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"--sizes must be positive element counts, got {self.sizes}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and {self.warmup}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype) or not getattr(torch, self.dtype).is_floating_point:
            raise ValueError(f"--dtype must name a floating torch dtype (float32, bfloat16, ...), got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def one_step(group: dist.ProcessGroup, grads: list[torch.Tensor], buckets: list[torch.Tensor], way: str) -> None:
    """Copy every bucket in and average it ``way``: launch all, then wait for all (as a backward's buckets)."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.AVG if way == "avg" else dist.ReduceOp.SUM
    works = []
    for grad, bucket in zip(grads, buckets):
        bucket.copy_(grad)
        if way == "sum":
            bucket.mul_(1.0 / group.size())
        works.append(group.allreduce([bucket], options))
    for work in works:
        work.wait()


def run_rank(rank: int, world_size: int, port: int, o: WireAverageOptions, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device(o.device, rank) if o.device == "cuda" else torch.device("cpu")
    if o.device == "cuda":
        torch.cuda.set_device(device)
    import_before_init()  # Note [The default group outlives destroy_process_group]
    dist.init_process_group(o.backend, rank=rank, world_size=world_size, device_id=device if o.device == "cuda" else None)
    try:
        results.put((rank, time_both_ways(o, device)))
    finally:
        dist.destroy_process_group()


def time_both_ways(o: WireAverageOptions, device: torch.device) -> dict[str, list[float]]:
    """This rank's medians, per way: wall, caller CPU, other threads' CPU and the process's CPU, in ms a step."""
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(dist.get_rank())
    grads = [torch.randn(n, generator=generator).to(device=device, dtype=getattr(torch, o.dtype)) for n in o.sizes]
    buckets = [torch.empty_like(grad) for grad in grads]
    record: dict[str, list[tuple[float, float, float, float]]] = {way: [] for way in WAYS}
    for k in range(o.warmup + o.steps):
        for way in pass_order(list(WAYS), k):
            dist.barrier()
            wall, caller, process = time.perf_counter(), time.thread_time(), time.process_time()
            one_step(group, grads, buckets, way)
            caller, process = time.thread_time() - caller, time.process_time() - process  # before a CUDA sync spins
            if o.device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - wall
            if k >= o.warmup:
                record[way].append((wall, caller, process - caller, process))
    return {way: [statistics.median(column) * 1e3 for column in zip(*steps)] for way, steps in record.items()}


def summarise(per_rank: dict[int, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for way in WAYS:
        wall, caller, others, process = (statistics.mean(per_rank[r][way][i] for r in per_rank) for i in range(4))
        rows.append({"way": way, "wall_ms": wall, "caller_cpu_ms": caller, "other_threads_cpu_ms": others,
                     "cpu_ms": process})  # fmt: skip
    return rows


def element_counts(text: str) -> tuple[int, ...]:
    """``--sizes``: comma-separated element counts (``"1000,2000"``)."""
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (elements per bucket), got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    d = WireAverageOptions()
    p = argparse.ArgumentParser(prog="python -m bench.wire_average", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--sizes", type=element_counts, default=d.sizes, help="elements of each bucket, comma-separated")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    a = p.parse_args(argv)
    try:
        o = WireAverageOptions(world_size=a.world_size, sizes=a.sizes, dtype=a.dtype,
                               steps=a.steps, warmup=a.warmup, device=a.device)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    if o.device == "cuda" and o.world_size > torch.cuda.device_count():
        p.error(f"--world-size {o.world_size} on NCCL needs a GPU per rank; this machine has {torch.cuda.device_count()}: "
                "pass --world-size at most that, or --device cpu")
    print(f"bench.wire_average: {o.world_size} ranks on {o.device} ({o.backend}), {len(o.sizes)} buckets of {o.dtype}, "
          f"{sum(o.sizes)} elements, {o.steps} steps per way", flush=True)  # fmt: skip
    rows = summarise(spawn_and_collect(run_rank, o.world_size, free_port(), o))
    print(tabulate([[r["way"], *(f"{r[k]:.2f}" for k in ("wall_ms", "caller_cpu_ms", "other_threads_cpu_ms", "cpu_ms"))] for r in rows],
                   headers=["way", "wall ms", "caller cpu ms", "other threads cpu ms", "cpu ms (all)"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
