"""``python -m bench.checks``: what the per-forward checks of issue 26 cost alone, in one process.

* the in-graph backward watch (``graphddp.runtime.iteration.BackwardWatch``): a tensor hook on a graph's output, the
  hook, its engine callback (Note [Abandoned backward]), timed around a tiny forward and backward;
* the in-graph abandon signal's host side (``graphddp.runtime.in_graph.AbandonSignal``): per training forward,
  taking the gradient the last backward left and copying it to the host, and reading the copy of the forward
  before (the element it adds to the first bucket's all-reduce is not timed: that collective runs anyway);
* the buffer-broadcast guard (``PlanKeeper.broadcast_buffers``): one int64 count beside the buffers, coalesced
  with the int64 ones, compared and kept on the device, timed around the coalescing it joins (no collective: the
  broadcast itself is the same either way);
* the placement check (``graphddp.runtime.placement.Placement.check``, Note [Placement checked without a loop]) of
  an unchanged stack of linear layers, 148 and 5,000 parameter tensors, beside the per-parameter loop it runs
  when something may have changed (``check_each``), which until session 52 ran every forward.

Prints microseconds per iteration; ``docs/benchmarks.md`` has the figures of the development machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from graphddp.runtime.in_graph import AbandonSignal
from graphddp.runtime.iteration import BackwardWatch
from graphddp.runtime.placement import Placement


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


def placement_cost(tensors: int, repeats: int = 40, batches: int = 5) -> tuple[float, float]:
    """(seconds per forward of ``Placement.check``, of its per-parameter loop) for ``tensors`` unchanged parameters
    (``tensors // 2`` ``Linear(16, 16)`` layers): the fastest of ``batches`` batches of ``repeats`` calls, as
    ``timeit`` advises, since on a shared VM the slower batches time the neighbours."""
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(tensors // 2)])
    placement = Placement(model, list(model.named_parameters()), frozenset())

    def per_call(check: Callable[[int], None]) -> float:
        check(0)  # warm up
        fastest = float("inf")
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(repeats):
                check(0)
            fastest = min(fastest, (time.perf_counter() - start) / repeats)
        return fastest

    return per_call(placement.check), per_call(placement.check_each)


def main() -> int:
    torch.set_num_threads(1)
    watched, base = watch_cost()
    print(f"in-graph backward watch: {watched * 1e6:.1f} us per iteration (a tiny forward+backward: {base * 1e6:.1f} us)")
    print(f"in-graph abandon signal: {signal_cost() * 1e6:.1f} us per training forward (host side)")
    guarded, base = guard_cost()
    print(f"buffer-broadcast guard: {guarded * 1e6:.1f} us per forward that broadcasts buffers (coalescing: {base * 1e6:.1f} us)")
    for tensors in (148, 5000):
        check, loop = placement_cost(tensors)
        print(f"placement check, {tensors} parameter tensors: {check * 1e6:.1f} us per forward (the loop: {loop * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
