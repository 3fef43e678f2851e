"""One rank of a benchmark run (started by torchrun): every mode, timed in rounds, in one process group.

Each round goes through every mode in turn: build it on a fresh copy of the workload, run its first iteration
(compiles; later rounds hit the compile caches) and the warm-up, time ``iters / rounds`` iterations, and free it
before the next mode is built. Slow drifts of a shared machine (other tenants, thermal) thus hit every mode
alike, and the ratios between modes hold even when absolute times wander. Only one mode is alive at a time:
keeping all seven resident made every mode slower and noisier on the development machine.

Writes ``rank{R}.json`` into the run's folder: per mode, the iteration times with the round each was timed in,
each iteration's phases (forward, backward, optimizer; ``naive`` also its all-reduce), compile time (first
iteration of the first round), added peak memory, and for graphddp modes one recorded iteration (events with
times) for the timeline.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
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
    """One mode, built and warmed up."""

    name: str
    step: Step
    ddp: Any
    workload: Workload
    data: torch.Generator
    first_s: float
    added_peak_rss_mb: float | None


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    if config.get("pin", False):
        _pin_to_own_cpu(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    say = print if rank == 0 else (lambda *a, **k: None)
    mode_config = ModeConfig(**config["mode_config"])
    modes, rounds = config["modes"], config["rounds"]
    results: dict[str, Any] = {
        "rank": rank, "world_size": world, "batch_size": None, "cpus": sorted(os.sched_getaffinity(0)), "modes": {}
    }  # fmt: skip
    for r in range(rounds):
        iters = config["iters"] // rounds + (r < config["iters"] % rounds)
        for i, mode in enumerate(modes):
            say(f"round {r + 1}/{rounds}, [{i + 1}/{len(modes)}] {mode}: building, compiling, warming up ...", flush=True)
            m = prepare(mode, config, mode_config, rank)
            timed = [timed_step(m) for _ in range(iters)]
            entry = results["modes"].setdefault(
                mode, {"first_s": m.first_s, "added_peak_rss_mb": m.added_peak_rss_mb, "times_s": [], "round_of": [], "phases_s": []}
            )
            entry["times_s"] += [t for t, _ in timed]
            entry["phases_s"] += [phases for _, phases in timed]
            entry["round_of"] += [r] * iters
            if r == rounds - 1:
                entry["timeline"] = record_timeline(m)
            results["batch_size"] = m.workload.batch_size
            say(f"      {mode}: first iteration {m.first_s:.2f} s, median so far {statistics.median(entry['times_s']) * 1e3:.1f} ms", flush=True)
            del m
            gc.collect()
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def prepare(mode: str, config: dict, mode_config: ModeConfig, rank: int) -> PreparedMode:
    """Build ``mode`` on its own copy of the workload, run its first iteration (compiles) and the warm-up."""
    torch._dynamo.reset()
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


PHASES = ("forward", "backward", "allreduce", "optimizer", "end")


def timed_step(m: PreparedMode) -> tuple[float, dict[str, float]]:
    """One iteration: its time, and how long each phase the step recorded took (seconds).

    With a graphddp Reducer, its events are recorded too, and two instants (``perf_counter`` ns, one clock for
    all ranks of this machine) join the phases: ``finalize_ns``, when backward's compute ended here, and
    ``written_ns``, when the last averaged gradient was in ``.grad``.
    """
    batch = m.workload.make_batch(m.data)
    log = EventLog()
    if isinstance(m.ddp, graphddp.DDP):
        m.ddp.reducer.events = log
    dist.barrier()
    start = time.perf_counter()
    m.step(batch, log)
    elapsed = time.perf_counter() - start
    marks = [e for e in log.events if e.kind in PHASES]
    phases = {a.kind: (b.t_ns - a.t_ns) / 1e9 for a, b in zip(marks, marks[1:])}
    if isinstance(m.ddp, graphddp.DDP):
        m.ddp.reducer.events = NullEvents()
        finalize, written = log.of_kind("finalize"), log.of_kind("written")
        if finalize and written:
            phases |= {"finalize_ns": finalize[-1].t_ns, "written_ns": written[-1].t_ns}
    return elapsed, phases


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
    t0 = log.events[0].t_ns
    return [(e.kind, e.bucket, (e.t_ns - t0) / 1e6) for e in log.events]


def _pin_to_own_cpu(rank: int, world: int) -> None:
    """Rank r runs on the r-th CPU of those this process may use, if there is one for every rank.

    Called before the process group exists, so gloo's threads (created with it) inherit the affinity: each rank
    computes and communicates on its own CPU, as on a host of its own. Unpinned, the scheduler sometimes stacks
    both ranks' compute threads on one CPU for a while, which shows up as one rank running 30-50 % slower.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= world:
        os.sched_setaffinity(0, {cpus[rank]})


def _reset_peak_rss() -> None:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


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
