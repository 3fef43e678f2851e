"""One rank of a benchmark run (started by torchrun): every mode, timed in rounds, in one process group.

Every mode is built, compiled and warmed up first, all kept alive. Then each round runs every mode in turn: one
untimed iteration (switching modes costs the first iteration some time: allocator and page state) and then
``iters / rounds`` timed ones. Slow drifts of a shared machine (other tenants, thermal) thus hit every mode
alike, and the ratios between modes hold even when absolute times wander.

Writes ``rank{R}.json`` into the run's folder: per mode, the iteration times, compile time (first iteration),
added peak memory, and for graphddp modes one recorded iteration (events with times) for the timeline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import graphddp
from graphddp.trace import EventLog, NullEvents
from graphddp.workloads import Workload, build_workload

from .modes import ModeConfig, Step, build


@dataclasses.dataclass
class PreparedMode:
    """One mode, built and warmed up, with what was measured of it so far."""

    name: str
    step: Step
    ddp: Any
    workload: Workload
    data: torch.Generator
    first_s: float
    added_peak_rss_mb: float | None
    times_s: list[float] = dataclasses.field(default_factory=list)


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    say = print if rank == 0 else (lambda *a, **k: None)
    mode_config = ModeConfig(**config["mode_config"])
    modes = config["modes"]
    torch._dynamo.reset()
    prepared = []
    for i, mode in enumerate(modes):
        say(f"[{i + 1}/{len(modes)}] {mode}: building, compiling, warming up ...", flush=True)
        prepared.append(prepare(mode, config, mode_config, rank))
        say(f"      {mode}: first iteration {prepared[-1].first_s:.2f} s", flush=True)
    rounds = config["rounds"]
    for r in range(rounds):
        per_round = config["iters"] // rounds + (r < config["iters"] % rounds)
        for m in prepared:
            m.step(m.workload.make_batch(m.data))  # back to this mode: untimed
            m.times_s += [timed_step(m) for _ in range(per_round)]
        say(f"round {r + 1}/{rounds}, median so far: " + ", ".join(f"{m.name} {_median(m.times_s) * 1e3:.0f} ms" for m in prepared), flush=True)
    results = {"rank": rank, "world_size": world, "batch_size": prepared[0].workload.batch_size, "modes": {}}
    for m in prepared:
        results["modes"][m.name] = {
            "first_s": m.first_s,
            "times_s": m.times_s,
            "added_peak_rss_mb": m.added_peak_rss_mb,
            "timeline": record_timeline(m),
        }
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def prepare(mode: str, config: dict, mode_config: ModeConfig, rank: int) -> PreparedMode:
    """Build ``mode`` on its own copy of the workload, run its first iteration (compiles) and the warm-up."""
    rss_before = _rss_mb("VmRSS")
    _reset_peak_rss()
    workload = build_workload(config["workload"], size=config["size"], batch_size=config["batch_size"], seed=0)
    step, ddp = build(mode, workload.model, mode_config)
    data = torch.Generator().manual_seed(1000 + rank)
    dist.barrier()
    start = time.perf_counter()
    step(workload.make_batch(data))  # compiles, for compiled modes
    first = time.perf_counter() - start
    for _ in range(config["warmup"]):
        step(workload.make_batch(data))
    peak = _rss_mb("VmHWM")
    added = peak - rss_before if peak is not None and rss_before is not None else None
    return PreparedMode(mode, step, ddp, workload, data, first, added)


def timed_step(m: PreparedMode) -> float:
    batch = m.workload.make_batch(m.data)
    dist.barrier()
    start = time.perf_counter()
    m.step(batch)
    return time.perf_counter() - start


def record_timeline(m: PreparedMode) -> list[tuple[str, int | None, float]] | None:
    """One more iteration of a graphddp mode with the Reducer's events recorded; None for other modes."""
    if not isinstance(m.ddp, graphddp.DDP):
        return None
    m.ddp.reducer.events = log = EventLog()
    dist.barrier()
    m.step(m.workload.make_batch(m.data), log)
    # "done" events come from future callbacks on gloo's threads and may trail the step: let them land.
    dist.barrier()
    time.sleep(0.05)
    m.ddp.reducer.events = NullEvents()
    t0 = log.events[0].t_ns
    return [(e.kind, e.bucket, (e.t_ns - t0) / 1e6) for e in log.events]


def _reset_peak_rss() -> None:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _rss_mb(field: str) -> float | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak since the last reset) of this process, in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main(sys.argv[1])
