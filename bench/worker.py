"""One rank of a benchmark run (started by torchrun): every mode in turn, in one process group.

Writes ``rank{R}.json`` into the run's folder: per mode, the iteration times, compile time (first iteration),
peak memory, and for graphddp modes one recorded iteration (events with times) for the timeline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import graphddp
from graphddp.trace import EventLog
from graphddp.workloads import build_workload

from .modes import ModeConfig, build


def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mode_config = ModeConfig(**config["mode_config"])
    results = {"rank": rank, "world_size": world, "modes": {}, "batch_size": None}
    for i, mode in enumerate(config["modes"]):
        if rank == 0:
            print(f"[{i + 1}/{len(config['modes'])}] {mode}: building and warming up ...", flush=True)
        results["modes"][mode] = run_mode(mode, config, mode_config, rank)
        results["batch_size"] = results["modes"][mode].pop("batch_size")
        if rank == 0:
            r = results["modes"][mode]
            print(f"      {mode}: first iteration {r['first_s']:.2f} s, median {sorted(r['times_s'])[len(r['times_s']) // 2] * 1e3:.1f} ms", flush=True)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_mode(mode: str, config: dict, mode_config: ModeConfig, rank: int) -> dict:
    torch._dynamo.reset()
    workload = build_workload(config["workload"], size=config["size"], batch_size=config["batch_size"], seed=0)
    step, ddp = build(mode, workload.model, mode_config)
    data = torch.Generator().manual_seed(1000 + rank)
    batch = workload.make_batch(data)
    _reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    step(batch)  # compiles, for compiled modes
    first = time.perf_counter() - start
    for _ in range(config["warmup"]):
        step(workload.make_batch(data))
    times = []
    for _ in range(config["iters"]):
        batch = workload.make_batch(data)
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    timeline = None
    if isinstance(ddp, graphddp.DDP):  # one recorded iteration, for the timeline
        ddp.reducer.events = log = EventLog()
        dist.barrier()
        step(workload.make_batch(data), log)
        # "done" events come from future callbacks on gloo's threads and may trail the step: let them land.
        dist.barrier()
        time.sleep(0.05)
        t0 = log.events[0].t_ns
        timeline = [(e.kind, e.bucket, (e.t_ns - t0) / 1e6) for e in log.events]
    return {"first_s": first, "times_s": times, "peak_rss_mb": _peak_rss_mb(), "timeline": timeline, "batch_size": workload.batch_size}


def _reset_peak_rss() -> None:
    try:  # Linux: writing 5 resets the peak resident set size (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main(sys.argv[1])
