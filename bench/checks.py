"""``python -m bench.checks``: what the per-forward checks of issue 26 cost alone, in one process.

* the in-graph backward watch (``graphddp.runtime.iteration.BackwardWatch``): a tensor hook on a graph's output, the
  hook, its engine callback (Note [Abandoned backward]), timed around a tiny forward and backward;
* the in-graph abandon signal's host side (``graphddp.runtime.in_graph.AbandonSignal``): per training forward,
  taking the gradient the last backward left and copying it to the host, and reading the copy of the forward
  before (the element it adds to the first bucket's all-reduce is not timed: that collective runs anyway);
* the buffer-broadcast guard (``PlanKeeper.broadcast_buffers``): one int64 count beside the buffers, coalesced
  with the int64 ones, compared and kept on the device, timed around the coalescing it joins (no collective: the
  broadcast itself is the same either way).

Prints microseconds per iteration; ``docs/benchmarks.md`` has the figures of the development machine.
"""

from __future__ import annotations

import time

import torch

from graphddp.runtime.in_graph import AbandonSignal
from graphddp.runtime.iteration import BackwardWatch


def watch_cost(repeats: int = 3000) -> tuple[float, float]:
    """(seconds per iteration with the watch minus without, without)."""
    watch = BackwardWatch()
    x = torch.randn(8, 8, requires_grad=True)

    def run(watched: bool) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            y = (x * 2).sum()
            if watched:
                watch.watch(y)
            y.backward()
            watch.abandoned()
        return (time.perf_counter() - start) / repeats

    run(False), run(True)  # warm up
    base = run(False)
    return run(True) - base, base


def signal_cost(repeats: int = 5000) -> float:
    """Seconds per training forward of the abandon signal's host side, with a gradient to take every time."""
    signal = AbandonSignal(torch.device("cpu"), rank=0, world_size=2)
    count = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(repeats):
        signal.tensor.grad = count  # what the backward's all-reduce leaves (set outside the timed work's own code)
        signal.begin_training_forward()
        signal.for_run()
    return (time.perf_counter() - start) / repeats


def guard_cost(repeats: int = 5000) -> tuple[float, float]:
    """(seconds per forward with the count beside BatchNorm-like buffers minus without, without)."""
    buffers = [torch.randn(32), torch.randn(32), torch.tensor(3)]

    def run(guarded: bool) -> float:
        kept = None
        start = time.perf_counter()
        for k in range(repeats):
            count = [torch.tensor([k], dtype=torch.int64)] if guarded else []
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for b in [*buffers, *count]:
                by_dtype.setdefault(b.dtype, []).append(b)
            for chunk in by_dtype.values():
                torch.cat([b.reshape(-1) for b in chunk])
            if guarded:
                differs = (count[0] != k).to(torch.int64)
                kept = differs if kept is None else torch.maximum(kept, differs)
        return (time.perf_counter() - start) / repeats

    run(False), run(True)
    base = run(False)
    return run(True) - base, base


def main() -> int:
    torch.set_num_threads(1)
    watched, base = watch_cost()
    print(f"in-graph backward watch: {watched * 1e6:.1f} us per iteration (a tiny forward+backward: {base * 1e6:.1f} us)")
    print(f"in-graph abandon signal: {signal_cost() * 1e6:.1f} us per training forward (host side)")
    guarded, base = guard_cost()
    print(f"buffer-broadcast guard: {guarded * 1e6:.1f} us per forward that broadcasts buffers (coalescing: {base * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
