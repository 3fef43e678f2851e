"""``graphddp demo``: train a small GPT-style model on 2 gloo ranks with graphddp.DDP under torch.compile.

Prints the loss at every step (averaged over ranks), the bucket plan the compiled graph produced (shared by the
graph split and the Reducer), and ends with one line comparing compiled and eager iteration time on the same
model, data and ranks.

The default inner compiler is Inductor, what users train with: on 2 CPU cores it compiles the demo's 8 segments in
about 30 s with its cache warm (the whole demo takes about 50 s). ``--inner aot_eager`` keeps the same plan, split
and overlap (AOTAutograd still makes one backward per segment); the whole demo then takes about 20 s.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

from ..options import BucketOptions
from .launch import run_ranks
from .workloads import SIZES, WORKLOADS, build_workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions(BucketOptions):
    """What ``graphddp demo`` runs (its bucket caps are smaller than DDP's defaults)."""

    workload: str = "gpt"
    """One of ``graphddp.tools.workloads.WORKLOADS``."""
    size: str = "small"
    """One of ``graphddp.tools.workloads.SIZES``."""
    steps: int = 20
    """Optimizer steps to train and print."""
    world_size: int = 2
    """Ranks to spawn (ignored under torchrun, which says how many there are)."""
    bucket_cap_mb: float | str = 1.0
    """Bucket cap; small by default so the small model gets several buckets to show (or ``"auto"``)."""
    first_bucket_cap_mb: float | str = 0.25
    last_bucket_cap_mb: float | str = 0.25
    timed_steps: int = 8
    """Steps timed for the closing comparison, after 2 warm-up steps."""
    inner: str = "inductor"
    """Inner compiler for each segment (``aot_eager``, ``inductor``, ``eager``); see the module docstring."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; choose one of {', '.join(SIZES)}")
        for name in ("steps", "world_size", "timed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def run_demo(options: DemoOptions, *, log_level: str | None = None) -> None:
    """Train ``options`` on its ranks; ``log_level``: logging configured there (the CLI's ``--log-level``)."""
    run_ranks(_demo_rank, options.world_size, options, log_level=log_level)


def _demo_rank(options: DemoOptions) -> None:
    from ..compiler.backend import GraphDDPBackend  # on the ranks: the command line itself loads no Dynamo
    from ..ddp import DistributedDataParallel, compile

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    say = print if rank == 0 else (lambda *a, **k: None)

    workload = build_workload(options.workload, size=options.size, seed=0)
    ddp = DistributedDataParallel(workload.model, **options.bucket_kwargs())
    backend = GraphDDPBackend(options.inner)
    model = compile(ddp, backend)
    say(f"graphddp demo: {workload.description}, {world} gloo ranks, batch {workload.batch_size} per rank")
    say(f"compiling with graphddp.backend({options.inner!r}) ...")
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(options.steps):
        start = time.perf_counter()
        loss = model(*workload.make_batch(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        say(f"step {step:3d}  loss {mean.item() / world:.4f}  ({(time.perf_counter() - start) * 1e3:.0f} ms)")
        if step == 1:  # the plan the compiled graph proposed was agreed by all ranks and adopted
            plan = ddp.bucket_plan
            segments = sum(split.num_segments for split in backend.splits)
            say(
                f"bucket plan ({plan.source}, fingerprint {plan.fingerprint}): {len(plan.buckets)} buckets, "
                f"{segments} graph segments"
            )
            say(tabulate(_short_rows(plan.table_rows()), headers=plan.TABLE_HEADERS))

    compiled = _time_steps(model, optimizer, workload, data, options.timed_steps)
    reference = build_workload(options.workload, size=options.size, seed=0)
    eager_ddp = DistributedDataParallel(reference.model, **options.bucket_kwargs())
    eager = _time_steps(
        eager_ddp, torch.optim.AdamW(eager_ddp.parameters(), lr=3e-3), reference, data, options.timed_steps
    )
    say(
        f"median iteration: graphddp compiled ({options.inner}) {compiled * 1e3:.1f} ms, graphddp eager "
        f"{eager * 1e3:.1f} ms (compiled/eager {compiled / eager:.2f}; {options.timed_steps} steps after 2 warm-up)"
    )


def _time_steps(model, optimizer, workload, data, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        model(*workload.make_batch(data)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    # Every rank reports the slowest rank's median: the job runs at the pace of its slowest rank.
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _short_rows(rows: list[list[object]], width: int = 60) -> list[list[object]]:
    return [row[:-1] + [str(row[-1]) if len(str(row[-1])) <= width else str(row[-1])[: width - 3] + "..."] for row in rows]
