"""Measure what the step cost model (Note [Step cost model] in ``passes/cost.py``) needs, on the ranks themselves:
the link (the α-β fit of a short series of all-reduces on the group, cached per group), how fast a rank computes
(``compute_rates``, for estimating graphs; with it what launching one collective costs the issuing thread,
``launch_seconds``), how much compute communication takes away on a CPU host
(``cpu_cost_of_communication``), and what putting a gradient sent in pieces back together costs
(``assembly_seconds_per_byte``).

Every rank measures, but clocks and noise differ; rank 0's figures are broadcast so every rank holds the same
model (whatever is decided from it, such as bucket caps, must be the same on every rank).

Note [What communication costs a CPU rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a CPU host gloo's worker threads copy, reduce and push the bytes through the network stack on the processors
the ranks compute on, so sending beside a backward slows it (``StepInputs.cpu_seconds_per_byte`` in
``passes/cost.py``). Up to session 41 the figure was the slowdown itself: a matmul loop timed alone and beside
all-reduces, the fastest of each, their difference per byte. That difference is a few percent of the window and
the loop's own time varies by as much: on the 2-vCPU testbed at 1 Gbit/s, 60 pairs of 0.1 s windows gave a pair's
slowdown per byte between 0.0 and 1.7 ns at its quartiles, 0.8-1.0 on average, and the fastest of two pairs,
resampled, a median of 0.1-0.5 ns/B, biased low. Eight calls with construction's windows ranged over 0.14-1.96
ns/B, eight with the benchmark's (5 of 0.8 s) over 0.0-1.3, on the same link and host. The automatic caps' choice
for the matrix's GPT at 1 Gbit/s followed that figure (``docs/benchmarks.md``, session 40).

What is measured now is the work itself: the CPU time gloo's threads run beside the all-reduces (by their names,
from ``/proc/self/task/*/schedstat``; where ``/proc`` does not show them in every window, every thread of the
process but the one that runs the loop), over what they run beside the loop alone; the median of each over the
windows (three at construction, so one disturbed window moves nothing), per byte each rank sends
(``ring_bytes_sent``). On the same testbed its 60 pairs averaged 0.86-0.98 ns/B (every thread but the loop's), level
with the slowdown's mean, and eight calls ranged over 0.62-1.54 ns/B with construction's windows, 0.67-0.86 with the
benchmark's: a host whose processors the ranks keep busy loses to gloo the CPU gloo runs. A host with idle
processors does not: gloo's threads run on them. So the figure is scaled by the share of a processor the host lacks
while the loop runs alone: ``1 - idle``, with ``idle`` the processors this process may run on
(``sched_getaffinity``) idle on average over the least idle alone window (``/proc/stat``); 0 from one whole idle
processor up, 1 where ``/proc/stat`` is not there to read. The ends are what the slowdown shows; the line between
them is an interpolation, not a measurement. The least idle window: a window in which one rank's loop ends early and
it waits at the barrier shows idle time a step does not have (on the testbed, unpinned, 0-0.34 of a processor window
by window; the least of two, 0-0.16).

``/proc/stat`` counts in ticks (10 ms): over a 0.1 s window on two processors the idle share is known to about
±0.2 of a processor, and the least of three windows leans towards charging more. Where ``/proc/stat`` shows none
of the processors ``sched_getaffinity`` names (a container that renumbers them), the whole figure is charged.

What this leaves out: the compute's own slowdown from sharing caches with gloo (not separable from the loop's
noise at this length); the kernel's network work that runs in softirq context on whatever thread it interrupts
(the loop's among them) or in ``ksoftirqd``, which the slowdown caught and gloo's threads' CPU does not; gloo
threads of the process's other groups, which count too (idle, they add little); and a container whose CPU quota
is below the processors it may run on (``/proc/stat`` shows the host's).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..passes import ComputeRates, LinkModel, fit_link, ring_bytes_sent

logger = logging.getLogger(__name__)

SERIES_START_BYTES = 1 << 12
"""The calibration's first all-reduce: 4 KiB, latency-bound on any link."""
SERIES_MAX_BYTES = 1 << 26
"""The largest all-reduce it sends: 64 MiB, past the default 25 MiB bucket cap."""
BANDWIDTH_BOUND_S = 0.1
"""The series grows (×4) until one all-reduce takes this long. A link's queue lets a burst through at the wire's
speed (the benchmark's token bucket holds 10 ms of traffic, a switch's buffers do the same): a series that stops at
a few MiB measures the burst, not the rate (Note [Step cost model] in ``passes/cost.py``)."""

LATENCY_REPEATS = 8
"""Times the series' smallest all-reduce is repeated (the others ``link_of``'s ``repeats``): the link's latency is
read from its fastest (Note [Fitting the link] in ``passes/cost.py``). Over loopback on the 2-vCPU testbed the
fastest of two 4 KiB all-reduces ranged over 0.32-4.2 ms in eight series, the fastest of eight over 0.36-0.57 ms
(``docs/benchmarks.md``, session 51). It costs a few milliseconds."""

LAUNCH_SAMPLES = 9
"""All-reduces ``launch_seconds`` times at construction (the median of nine: one descheduled call moves nothing)."""
LAUNCH_SPACING_MATMUL = 256
"""The matmul run between two timed launches, four times (256³: a few tenths of a ms each on a CPU core)."""

CONSTRUCTION_MATMUL = 512
"""The matmul ``compute_rates`` times at construction (512³: ~1 ms on a CPU core, near the large-matmul rate)."""

_fitted: weakref.WeakKeyDictionary[dist.ProcessGroup, LinkModel] = weakref.WeakKeyDictionary()
_rates: weakref.WeakKeyDictionary[dist.ProcessGroup, ComputeRates] = weakref.WeakKeyDictionary()
_cpu_costs: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[float, int], float]] = weakref.WeakKeyDictionary()


def _random(*shape: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random operands for the timed kernels, from a generator of their own: building a DDP with automatic caps
    must not move the random state a user's script draws from next (PyTorch's DDP leaves it alone)."""
    return torch.randn(*shape, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(0))


def link_of(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] | None = None,
    repeats: int = 2,
    device: torch.device | None = None,
) -> LinkModel:
    """The link model of ``group`` (collective: every rank of it calls this), measured once and cached.

    ``sizes``: the all-reduce sizes (bytes) to time; by default a series from 4 KiB that grows until one
    all-reduce is bandwidth-bound (``grow_series``). ``repeats``: timed all-reduces per size, the smallest size's at
    least ``LATENCY_REPEATS`` (it gives the latency, Note [Fitting the link])."""
    group = group if group is not None else dist.group.WORLD
    if group in _fitted:
        return _fitted[group]
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError("calibrating a link needs a process group of at least 2 ranks")
    if repeats < 1:
        raise ValueError(f"calibrating a link needs at least one timed all-reduce per size, got repeats={repeats}")
    sizes = tuple(sizes) if sizes is not None else None
    if sizes is not None and len({_sent(n) for n in sizes}) < 2:
        raise ValueError(
            f"calibrating a link needs all-reduces of at least two different sizes (whole float32 elements), got sizes={sizes}"
        )
    device = device or torch.device("cpu")
    samples: list[tuple[int, float]] = []
    # The same on every rank: the sizes asked for, or the series' start (grow_series's first size).
    smallest = _sent(min(sizes) if sizes is not None else SERIES_START_BYTES)

    def measure(nbytes: int) -> float:
        """Times ``repeats`` all-reduces of ``nbytes`` (the smallest size: ``LATENCY_REPEATS``); returns the
        slowest rank's best (the same on every rank, so every rank grows the series alike)."""
        sent = _sent(nbytes)
        buffer = torch.zeros(sent // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buffer, group=group)  # warm-up: connections, allocations
        times = []
        for _ in range(max(repeats, LATENCY_REPEATS) if sent == smallest else repeats):
            dist.barrier(group=group)
            started = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        samples.extend((sent, t) for t in times)
        slowest = torch.tensor([min(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        return float(slowest)

    if sizes is None:
        grow_series(measure, start=SERIES_START_BYTES)
    else:
        for nbytes in sizes:
            measure(nbytes)
    local = fit_link(samples, world)
    agreed = torch.tensor([local.latency_s, local.seconds_per_byte], dtype=torch.float64, device=device)
    dist.broadcast(agreed, group=group, group_src=0)
    link = LinkModel(latency_s=float(agreed[0]), seconds_per_byte=float(agreed[1]))
    logger.info(
        "graphddp: link of a %d-rank group: latency %.1f us, %.2f Gbit/s (rank 0's fit of %d sizes, %d to %d bytes, each its fastest of %d, the smallest's of %d)",
        world, link.latency_s * 1e6, 8e-9 / link.seconds_per_byte if link.seconds_per_byte else float("inf"),
        len({n for n, _ in samples}), smallest, max(n for n, _ in samples), repeats, max(repeats, LATENCY_REPEATS),
    )  # fmt: skip
    _fitted[group] = link
    return link


def _sent(nbytes: int) -> int:
    """Bytes an all-reduce asked for ``nbytes`` sends: whole float32 elements, at least one."""
    return 4 * max(1, nbytes // 4)


def grow_series(
    measure: Callable[[int], float],
    *,
    start: int = SERIES_START_BYTES,
    max_bytes: int = SERIES_MAX_BYTES,
    bound_s: float = BANDWIDTH_BOUND_S,
) -> list[int]:
    """Calls ``measure(nbytes)`` (seconds of one all-reduce) from ``start`` bytes, ×4 each time, until one takes
    ``bound_s`` or ``max_bytes`` is reached; returns the sizes measured. ``measure`` must return the same figure
    on every rank (the series is part of a collective)."""
    sizes, nbytes = [], start
    while True:
        sizes.append(nbytes)
        if measure(nbytes) >= bound_s or nbytes >= max_bytes:
            return sizes
        nbytes = min(4 * nbytes, max_bytes)


def compute_rates(group: dist.ProcessGroup | None = None, *, device: torch.device | None = None) -> ComputeRates:
    """How fast this rank computes (a matmul's flop rate, an elementwise op's byte rate, a Python call) and, on more
    than one rank, what launching a collective costs (``launch_seconds``: ten more all-reduces), rank 0's
    measurement broadcast so every rank estimates graphs and charges buckets alike (``graphddp.passes.graph_cost``).
    Collective; measured once per group (a second DDP on it costs nothing)."""
    group = group if group is not None else dist.group.WORLD
    if group in _rates:
        return _rates[group]
    device = device or torch.device("cpu")
    here = measure_compute_rates(device, matmul_size=CONSTRUCTION_MATMUL)
    world = dist.get_world_size(group)
    several = world > 1
    launch = launch_seconds(group, device=device) if several else 0.0  # one rank launches no collective
    agreed = torch.tensor([here.flops_per_s, here.bytes_per_s, here.python_call_s, launch], dtype=torch.float64, device=device)
    if several:
        dist.broadcast(agreed, group=group, group_src=0)
    flops, moved, call, launch = (float(v) for v in agreed)
    _rates[group] = rates = ComputeRates(flops_per_s=flops, bytes_per_s=moved, python_call_s=call, launch_s=launch)
    if several:  # `graphddp inspect --launch-us` takes this figure
        logger.info("graphddp: launching a collective costs %.0f us of the calling thread (rank 0's median of %d, %d-rank group)",
                    launch * 1e6, LAUNCH_SAMPLES, world)  # fmt: skip
    return rates


def launch_seconds(
    group: dist.ProcessGroup, *, device: torch.device | None = None, samples: int = LAUNCH_SAMPLES, nbytes: int = SERIES_START_BYTES
) -> float:
    """Seconds of wall time the calling thread spends issuing one asynchronous all-reduce of ``nbytes`` while the
    group is idle, as a DDP issues a bucket between spans of backward: the median of ``samples`` calls, each after
    a span of compute long enough for the group's workers to go back to sleep (the previous all-reduce waited
    for). Issued back to back the calls are several times cheaper (gloo, 2 vCPUs: 166 µs of wall spaced, 25 µs back
    to back; ``docs/benchmarks.md``, session 44): the spaced figure is what a bucket pays.

    4 KiB by default: the part of a launch that does not grow with the bucket. Where gloo's worker shares the
    caller's processor (each rank pinned to one, as the benchmark runs them), a bigger all-reduce's call also holds
    the worker's work on its bytes (1 MiB: 0.3-2.6 ms a call against 0.1-0.3 ms for 4 KiB, session 45), which the
    model charges per byte already (``cpu_cost_of_communication``).
    This rank's own figure (``compute_rates`` broadcasts rank 0's). Collective: every rank issues ``samples + 1``
    all-reduces."""
    if samples < 1 or nbytes < 4:
        raise ValueError(f"timing a launch needs samples >= 1 and nbytes >= 4, got {samples} and {nbytes}")
    device = device or torch.device("cpu")
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    a = _random(LAUNCH_SPACING_MATMUL, LAUNCH_SPACING_MATMUL, device=device)
    dist.all_reduce(buffer, group=group)  # warm-up: connections, allocations
    times = []
    for _ in range(samples):
        for _ in range(4):  # the span before the launch: 1-2 ms of a CPU core
            torch.mm(a, a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the launch's own cost, not a wait for the queue
        started = time.perf_counter()
        work = dist.all_reduce(buffer, group=group, async_op=True)
        times.append(time.perf_counter() - started)
        assert work is not None
        work.wait()
    return statistics.median(times)


def measure_compute_rates(
    device: torch.device | None = None, *, dtype: torch.dtype = torch.float32, matmul_size: int = 1024
) -> ComputeRates:
    """This process's compute rates (no process group): a ``matmul_size``³ matmul and an add of 4 Mi elements in
    ``dtype``, best of 5 (a GPU under bf16 autocast: ``dtype=torch.bfloat16`` and a size its matmuls reach)."""
    device = device or torch.device("cpu")
    n = matmul_size
    a, b = _random(n, n, device=device, dtype=dtype), _random(n, n, device=device, dtype=dtype)
    x, y = _random(1 << 22, device=device, dtype=dtype), _random(1 << 22, device=device, dtype=dtype)
    matmul_s = best_of(lambda: torch.mm(a, b), device)
    add_s = best_of(lambda: torch.add(x, y), device)
    return ComputeRates(
        flops_per_s=2 * n**3 / matmul_s, bytes_per_s=3 * x.nbytes / add_s, python_call_s=python_call_seconds()
    )


def python_call_seconds(calls: int = 5_000) -> float:
    """One Python call of a small method, best of 5 loops (what the Reducer's per-bucket work is counted in)."""

    class Probe:
        def touch(self, value: int) -> int:
            return value

    probe, best = Probe(), float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            probe.touch(i)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def cpu_cost_of_communication(
    group: dist.ProcessGroup | None = None, *, link: LinkModel | None = None, window_s: float = 0.1, repeats: int = 3
) -> float:
    """Seconds of compute each byte a CPU rank sends costs it (Note [What communication costs a CPU rank]): the
    CPU gloo's threads spend while all-reduces run beside a fixed matmul loop, over what they spend beside the loop
    alone, per byte sent, times the share of a processor the host lacks. ``repeats`` pairs of windows of
    ``window_s`` (construction's default: ~0.7 s; the benchmark takes longer ones), the median of each. Rank 0's
    figure, broadcast. Collective; CPU groups only (on a GPU, communication does not take compute's processor);
    measured once per group and window."""
    if repeats < 1 or window_s <= 0:
        raise ValueError(
            f"the CPU cost of communication needs repeats >= 1 and window_s > 0, got {repeats} and {window_s}"
        )
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world < 2:
        return 0.0
    if (window_s, repeats) in _cpu_costs.get(group, {}):
        return _cpu_costs[group][(window_s, repeats)]
    link = link or link_of(group)
    # Enough bytes to keep the link busy for half the window, in 4 MiB buffers.
    per_byte = 2 * (world - 1) / world * link.seconds_per_byte
    buffers = [torch.zeros(1 << 20) for _ in range(max(1, int(0.5 * window_s / max(per_byte, 1e-12)) >> 22))]
    sent = sum(b.nbytes for b in buffers)
    a = _random(512, 512)
    loops = max(1, int(window_s / max(best_of(lambda: torch.mm(a, a), torch.device("cpu")), 1e-6)))

    def compute() -> None:
        for _ in range(loops):
            torch.mm(a, a)

    def all_reduces() -> list[Any]:
        return [dist.all_reduce(b, group=group, async_op=True) for b in buffers]

    alone, beside = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        alone.append(measure_window(compute, lambda: []))
        dist.barrier(group=group)
        beside.append(measure_window(compute, all_reduces))
    cost = torch.tensor([displaced_seconds_per_byte(alone, beside, ring_bytes_sent(sent, world))], dtype=torch.float64)
    dist.broadcast(cost, group=group, group_src=0)
    logger.info("graphddp: communication costs %.2f ms of compute per MB (rank 0's measurement)", float(cost) * 1e9)
    _cpu_costs.setdefault(group, {})[(window_s, repeats)] = float(cost)
    return float(cost)


@dataclass(frozen=True)
class Window:
    """One timed run of the calibration's matmul loop, alone or beside all-reduces: the CPU seconds threads other
    than the caller's ran, from before the all-reduces were issued to after the last one was waited for."""

    gloo_cpu_s: float | None
    """gloo's threads, by name; None where ``/proc`` does not show them (not Linux, no schedstat, no gloo thread)."""
    others_cpu_s: float
    """Every thread but the caller's (the intra-op pool's too: the windows alone subtract them, with their noise)."""
    idle_cpus: float | None
    """The processors this process may run on, idle on average over the window (``/proc/stat``); None where it
    cannot be read."""


GLOO_THREAD_PREFIXES = ("pt_gloo", "gloo")
"""How gloo's threads name themselves (``/proc/self/task/*/comm``): its workers and its transport's loop."""


def measure_window(compute: Callable[[], None], issue: Callable[[], list[Any]]) -> Window:
    """Run ``issue()`` (collectives, async), then ``compute()`` on this thread, then wait for what ``issue``
    returned."""
    idle_before, started = idle_seconds(), time.perf_counter()
    gloo_before = gloo_threads_cpu_s()
    process, thread = time.process_time(), time.thread_time()
    works = issue()
    compute()
    for work in works:
        work.wait()
    thread = time.thread_time() - thread  # read inside the process clock's interval: the difference is >= 0
    process = time.process_time() - process
    gloo_after = gloo_threads_cpu_s()
    wall, idle_after = time.perf_counter() - started, idle_seconds()
    idle = None if idle_before is None or idle_after is None or wall <= 0 else (idle_after - idle_before) / wall
    gloo = None if gloo_before is None or gloo_after is None else max(0.0, gloo_after - gloo_before)
    return Window(gloo_cpu_s=gloo, others_cpu_s=max(0.0, process - thread), idle_cpus=idle)


def displaced_seconds_per_byte(alone: Sequence[Window], beside: Sequence[Window], sent_bytes: float) -> float:
    """Compute seconds a byte sent takes from a rank (Note [What communication costs a CPU rank]): the median
    extra CPU of the collectives' threads beside the all-reduces, per byte each rank sent, times the share of a
    processor the host lacked in the least idle window alone."""
    if not alone or not beside:
        raise ValueError("the CPU cost of communication needs at least one window alone and one beside all-reduces")
    if sent_bytes <= 0:
        raise ValueError(f"the CPU cost of communication needs bytes sent, got {sent_bytes}")
    # One measure for every window: gloo's threads where every window saw them, else every thread but the caller's.
    by_gloo = all(w.gloo_cpu_s is not None for w in (*alone, *beside))

    def cpu(w: Window) -> float:
        return (w.gloo_cpu_s or 0.0) if by_gloo else w.others_cpu_s

    extra = statistics.median(map(cpu, beside)) - statistics.median(map(cpu, alone))
    idle = [w.idle_cpus for w in alone if w.idle_cpus is not None]
    lacking = 1.0 if not idle else min(1.0, max(0.0, 1.0 - min(idle)))
    return max(0.0, extra) * lacking / sent_bytes


def gloo_threads_cpu_s(task_dir: str = "/proc/self/task") -> float | None:
    """CPU seconds this process's gloo threads have run (``schedstat``, in nanoseconds); None where ``/proc`` does
    not show them (not Linux, no schedstat) or there is no gloo thread."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    total_ns, found = 0, False
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm") as f:
                if not f.read().startswith(GLOO_THREAD_PREFIXES):
                    continue
            with open(f"{task_dir}/{tid}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile, or no schedstat
            continue
        found = True
    return total_ns / 1e9 if found else None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""``/proc/stat``'s unit: ticks per second."""


def idle_seconds(path: str = "/proc/stat", cpus: Iterable[int] | None = None) -> float | None:
    """Seconds the processors in ``cpus`` (default: those this process may run on) have spent idle (idle and
    iowait, summed) since boot; None where ``/proc/stat`` cannot be read (not Linux) or shows none of them."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    wanted = None if cpus is None else {f"cpu{c}" for c in cpus}
    try:
        with open(path) as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    ticks, found = 0, False
    for fields in lines:
        name = fields[0] if fields else ""
        if (name != "cpu" if wanted is None else name not in wanted) or len(fields) < 6:
            continue
        try:
            ticks += int(fields[4]) + int(fields[5])
        except ValueError:
            continue
        found = True
    return ticks / _CLOCK_TICKS if found else None


ASSEMBLY_BLOCKS = 16
"""Blocks ``assembly_seconds_per_byte`` puts together (a figure per byte: the count matters little; the bench
MLP's 64 MiB weights go in 6 and 7)."""


def assembly_seconds_per_byte(device: torch.device | None = None, *, nbytes: int = SERIES_MAX_BYTES) -> float:
    """Seconds per byte of copying blocks of a gradient sent in pieces into it (Note [Gradient pieces] in
    ``passes/plan.py``; the compiled backward copies the first block, ``Bucket.assembled_bytes``, after the last
    block's wait): a ``cat`` of ``ASSEMBLY_BLOCKS`` blocks of ``nbytes`` in all into a new tensor, best of 5. This process's figure (no process group).
    A new tensor, as in the graph: on a CPU host a large one may come fresh from the OS, and touching its pages
    first then costs more than the copy (64 MiB on the 2-vCPU testbed: ~65 ms, of which ~14 ms the copy; the
    bench's calibrations of one session ranged over 0.13-1.01 ms per MB, the low end below the copy alone: the
    memory does not always come fresh)."""
    device = device or torch.device("cpu")
    blocks = [_random(nbytes // 4 // ASSEMBLY_BLOCKS, device=device) for _ in range(ASSEMBLY_BLOCKS)]
    return best_of(lambda: torch.cat(blocks), device) / nbytes


def best_of(op: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs of ``op`` after one warm-up, in seconds (the device synchronised after each
    on CUDA): the least disturbed run on a shared host."""
    op()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times)
