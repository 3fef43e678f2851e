"""A cost model of one data-parallel training step: the link, the backward segments, and their overlap.

Note [Step cost model]
~~~~~~~~~~~~~~~~~~~~~~
**The link** (α-β): one all-reduce of ``n`` bytes over ``w`` ranks with the ring algorithm sends
``2 (w - 1) / w * n`` bytes per rank in ``2 (w - 1)`` steps, so it takes

    T(n, w) = 2 (w - 1) α + 2 (w - 1) / w · n β

with ``α`` the per-message latency and ``β`` the seconds per byte (1 / bandwidth). ``allreduce_seconds`` gives the
expression in sympy, symbolic in bytes, world size, latency and bandwidth; ``fit_link`` fits ``α`` and ``β`` to
measured all-reduce times (Note [Fitting the link]). The measured sizes must reach past the
link's burst: a queue (a token bucket, a switch's buffer) passes its first megabytes at the wire's speed, and a fit
of sizes that all fit in it sees the burst, not the rate (``graphddp.runtime.calibration.grow_series`` grows the series
until one all-reduce takes 0.1 s).

A ring's ``2 (w - 1) α`` grows with every rank: at 256 ranks a small bucket is all latency. Libraries switch to
a log-latency algorithm there (gloo's halving-doubling, NCCL's double binary tree, MPI's Rabenseifner):
recursive halving reduce-scatters and recursive doubling all-gathers, ``2 log2(w)`` messages and the ring's bytes,

    T_hd(n, w) = 2 log2(w') α + 2 (w' - 1) / w' · n β  (+ 2 α + 2 n β when w is not a power of two)

with ``w'`` the largest power of two ≤ ``w`` (the ``w - w'`` extra ranks hand their whole vector to a partner
first and get the result back last). ``LinkModel.algorithm`` says which one a prediction uses: ``"ring"`` (the
2-rank matrix: gloo and NCCL both run rings there, where the two agree), ``"halving-doubling"``, or ``"best"``
(the faster of the two per bucket, as NCCL chooses per size); ``project_scaling`` gives each.

**The step** is a DAG (networkx): the backward segments run one after the other on the compute side; bucket
``k``'s all-reduce can start when the segment that completes it has run *and* bucket ``k - 1``'s all-reduce is
done (one link, buckets in index order); the step ends when the last segment and the last all-reduce are done,
plus the time after backward (the optimizer; or, stepped per bucket, each bucket's step once backward's compute
is over and its all-reduce done). A bucket may also leave compute for that tail (``tail_per_bucket_s``: in-graph,
the copy that puts a gradient sent in pieces back together after its last piece's wait), run in bucket order
before its step, or before the optimizer. On CPU hosts communication also costs CPU (gloo's reduction, the
network stack): ``cpu_seconds_per_byte`` adds that much compute time per byte sent (``2 (w - 1) / w`` per bucket
byte in a ring) to the segment that runs while a bucket is sent (the one after the segment that completed it). A
bucket sent once backward's compute is over costs nothing while the CPU only waits for it; where the bucket before
it has work of its own (its step, its copy), that work runs meanwhile and gets the cost (the CPU it shares with
gloo); a bucket with none (a gradient's first pieces: its step runs with its last) leaves the CPU waiting (an
approximation: work of earlier buckets still running then is not charged).
And each bucket costs the thread that runs the backward a fixed time (``cpu_seconds_per_bucket``): the Reducer's
Python (gather, launch, wait and write-back, ``REDUCER_CALLS_PER_BUCKET`` calls counted by ``bench.overhead`` at
this machine's cost per call) and the collective's launch, measured on the ranks (``ComputeRates.launch_s``: with
gloo 0.1-0.2 ms on the 2-vCPU testbed, a hundred times the Python, sessions 44-45), added to the segment that
completes it: on a launch-bound backward that is what many small buckets cost. (Reduced in-graph, a bucket costs
no Python but the same launch; the estimate keeps the Reducer's figure, an upper bound.) The longest path
through the DAG is the predicted step time; the timeline gives each node's start and end.

**Channels** (``StepInputs.channels``, Note [Channels] in ``graphddp/runtime/channels.py``): each bucket's
all-reduce is two nodes, its latency term and its bytes on the wire. The bytes of bucket ``k`` follow those of
bucket ``k - 1`` (one link); its latency term may start once its segment has run and its channel is free, that
is once bucket ``k - channels`` is off the wire. With one channel that is the serial schedule above; with more,
a bucket's latency runs under the previous bucket's bytes, which is all that several process groups can win on
one link. ``choose_channels`` compares candidates and keeps one channel unless more pay by a margin (what an
extra group costs the CPUs is not in the model).

Note [Fitting the link]
~~~~~~~~~~~~~~~~~~~~~~~
The calibration times all-reduces from 4 KiB up to sizes that take 0.1 s, each size's fastest repeat kept. ``β``
is the slope of a least-squares line through them, in seconds per byte sent: the large sizes set it (on the
emulated 1 and 5 Gbit/s links, 0.96-0.97 and 4.1-5.1 Gbit/s in the fits below). ``α`` is *not* that line's
intercept. Extrapolated from sizes that take tens of milliseconds, the intercept carries their noise, a
millisecond or more, onto a term worth a few tenths of one; and where the link's queue lets a burst through at
the wire's speed, the line through the sizes past it meets zero below the origin. Eight fits in a row on the
2-vCPU testbed (``docs/benchmarks.md``, session 51) put the intercept's ``α`` at 14-1830 µs over loopback, and at
0 (clamped) in 7 of 12 on the emulated 1 and 5 Gbit/s links, where the fastest 4 KiB all-reduce took 0.3-0.6 ms. So
``α`` comes from the series' smallest size (4 KiB: latency-bound on a link of 1 Gbit/s or more): its fastest
time less its bytes, over the ``2 (w - 1)`` messages a ring sends. Its bytes are charged at the rate between the
two smallest sizes, at most ``β``: on a link whose queue passes a burst at the wire's speed both sizes go through
it and their bytes cost next to nothing, where at the fitted rate a slow link's 4 KiB (330 µs at 100 Mbit/s)
would exceed the whole all-reduce and clamp ``α`` to 0 again; without a burst that rate is ``β`` and the model
gives the smallest all-reduce the time it was measured at. The calibration times that size more often (``graphddp.runtime.calibration.LATENCY_REPEATS``): 24
fits, eight per link, then put ``α`` at 96-297 µs over all three links.
What ``α`` holds is what a bucket's all-reduce costs apart from its bytes: gloo's threads waking, the round trips,
the calls; a step's prediction moves little with it (the matrix's buckets are megabytes), but choices that weigh
many small buckets against few (automatic caps, channels, rows against a dense bucket) read it directly.

This module is pure: no ``torch.distributed``, no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .plan import bucket_channel

if TYPE_CHECKING:  # sympy and networkx load when a prediction is made, not with graphddp (issue 25)
    import sympy

ALGORITHMS = ("ring", "halving-doubling", "best")
"""All-reduce algorithms the link model knows (Note [Step cost model])."""

REDUCER_CALLS_PER_BUCKET = 30
"""Python calls the Reducer makes per bucket in a steady backward (gather, launch, wait, write-back) on the lean
bucket path (Note [Lean bucket path]; 95 before it), as ``tests/spawned/test_steady_hook.py`` and
``bench.overhead`` count them (``docs/benchmarks.md``)."""


def allreduce_seconds() -> tuple[sympy.Expr, dict[str, sympy.Symbol]]:
    """The ring all-reduce time as a sympy expression, and its symbols by name (``bytes``, ``world``,
    ``latency``, ``bandwidth`` in bytes per second)."""
    import sympy

    n, w, alpha, bw = sympy.symbols("bytes world latency bandwidth", positive=True)
    expr = 2 * (w - 1) * alpha + 2 * (w - 1) / w * n / bw
    return expr, {"bytes": n, "world": w, "latency": alpha, "bandwidth": bw}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkModel:
    """α-β model of the link between the ranks (see Note [Step cost model])."""

    latency_s: float
    """α: seconds per message."""
    seconds_per_byte: float
    """β: seconds per byte on the wire (1 / bandwidth)."""
    algorithm: str = "ring"
    """The all-reduce algorithm predicted (one of ``ALGORITHMS``; see Note [Step cost model])."""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.seconds_per_byte < 0:
            raise ValueError(f"a link's latency and seconds per byte must be >= 0, got {self}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"a link's all-reduce algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")

    @classmethod
    def of_rate(cls, bits_per_second: float, latency_s: float = 50e-6) -> LinkModel:
        """A link of ``bits_per_second`` (e.g. ``2e9`` for 2 Gbit/s) and ``latency_s``."""
        if bits_per_second <= 0:
            raise ValueError(f"a link's rate must be > 0 bit/s, got {bits_per_second}")
        return cls(latency_s=latency_s, seconds_per_byte=8.0 / bits_per_second)

    def allreduce_s(self, nbytes: int, world: int) -> float:
        """Seconds for one all-reduce of ``nbytes`` over ``world`` ranks by ``algorithm``."""
        return sum(self.allreduce_parts(nbytes, world))

    def allreduce_parts(self, nbytes: int, world: int) -> tuple[float, float]:
        """One all-reduce of ``nbytes`` over ``world`` ranks by ``algorithm`` as (its latency term, its bytes
        term) in seconds: on several channels a bucket's latency overlaps the bytes of the one before."""
        if world <= 1:
            return 0.0, 0.0
        ring = (2 * (world - 1) * self.latency_s, 2 * (world - 1) / world * nbytes * self.seconds_per_byte)
        if self.algorithm == "ring":
            return ring
        power = 1 << (world.bit_length() - 1)  # w': the largest power of two <= world
        steps = power.bit_length() - 1  # log2(w')
        latency, wire = 2 * steps * self.latency_s, 2 * (power - 1) / power * nbytes * self.seconds_per_byte
        if power != world:  # the extra ranks' vectors in and results out
            latency, wire = latency + 2 * self.latency_s, wire + 2 * nbytes * self.seconds_per_byte
        if self.algorithm == "halving-doubling" or latency + wire < sum(ring):
            return latency, wire
        return ring


def rate_bits_per_second(rate: str) -> float:
    """A rate as ``tc`` writes it (``2gbit``, ``500mbit``, ``100kbit``, ``9600bit``) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"a rate must be a number with bit, kbit, mbit or gbit, such as 2gbit; got {rate!r}")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def fit_link(samples: Sequence[tuple[int, float]], world: int) -> LinkModel:
    """α and β from measured ``(bytes, seconds)`` all-reduces over ``world`` ranks, each size at its fastest sample:
    β the slope of a least-squares line over the sizes against the ring's bytes term ``2 (w - 1) / w · bytes``; α
    the smallest size's time less its bytes, over the ring's ``2 (w - 1)`` messages, its bytes at the rate the two
    smallest sizes show (at most β); both clamped at zero (Note [Fitting the link]).

    Only the fastest: what a shared machine adds (another tenant, a descheduled gloo thread) only slows an
    all-reduce down, so the fastest of a size's repeats is the closest to the link's own time (a queue's burst
    can make a repeat fast, but the series reaches sizes far past it, which set the slope). It leans the model
    toward the link's good moments where the bench compares medians; in the first matrix after the change its
    ``comm`` predictions erred by -1 to +14 %, none of them fast. Fitted
    over every repeat, one slow all-reduce of the largest size, which sets the slope, tilts every prediction made
    from the fit (session 49's matrix had one 5 Gbit/s cell calibrate 1.92 ns/B where the others measured
    1.63-1.64; its samples were not kept, so whether one repeat or a longer slowdown did it is not known)."""
    if world < 2:
        raise ValueError(f"fitting a link needs at least 2 ranks, got world size {world}")
    fastest: dict[int, float] = {}
    for n, t in samples:
        fastest[n] = min(t, fastest.get(n, t))
    if len(fastest) < 2:
        raise ValueError("fitting a link needs all-reduces of at least two different sizes")
    wire = {n: 2 * (world - 1) / world * n for n in fastest}  # bytes each rank sends: β's coefficient
    beta, _ = statistics.linear_regression(list(wire.values()), list(fastest.values()))
    beta = max(beta, 0.0)
    smallest, next_size = sorted(fastest)[:2]
    # The rate the smallest sizes see, at most β: a queue's burst passes them faster (Note [Fitting the link]).
    small_sizes_rate = (fastest[next_size] - fastest[smallest]) / (wire[next_size] - wire[smallest])
    bytes_s = wire[smallest] * min(max(small_sizes_rate, 0.0), beta)
    alpha = (fastest[smallest] - bytes_s) / (2 * (world - 1))
    return LinkModel(latency_s=max(alpha, 0.0), seconds_per_byte=beta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """What one step's prediction needs, all per rank."""

    segment_backward_s: tuple[float, ...]
    """Backward seconds of each segment, in the order backward runs them (segment 0 first)."""
    bucket_bytes: tuple[int, ...]
    """Bytes of each bucket, in launch order."""
    completed_by: tuple[int, ...]
    """For bucket ``k``: the position (in ``segment_backward_s``) of the segment whose backward completes it."""
    forward_s: float = 0.0
    """Forward seconds (before backward starts)."""
    after_backward_s: float = 0.0
    """Seconds after the last all-reduce (the optimizer step, zeroing gradients)."""
    cpu_seconds_per_byte: float = 0.0
    """Compute time each byte a rank sends costs it (CPU hosts: gloo and the network stack share the CPU); a ring
    all-reduce of ``n`` bytes sends ``2 (w - 1) / w · n`` per rank."""
    cpu_seconds_per_bucket: float = 0.0
    """Compute time each bucket costs the rank (the Reducer's Python and the collective's launch per bucket,
    ``ComputeRates.reducer_seconds_per_bucket``), on the segment completing it."""
    step_per_bucket_s: tuple[float, ...] = ()
    """With the optimizer stepped per bucket inside backward (Note [Optimizer overlap]): each bucket's step, run
    on the compute side once backward's compute is over and the bucket's all-reduce is done, in bucket order."""
    tail_per_bucket_s: tuple[float, ...] = ()
    """Compute each all-reduce leaves for the end of backward, in bucket order (a gradient sent in pieces,
    in-graph: copying its blocks back into one gradient after its last block's wait, Note [Gradient pieces]): it
    runs where the bucket's step would, once backward's compute is over and the all-reduce is done, before that
    step. Empty: none."""
    channels: int = 1
    """Process groups the buckets go on in turn (Note [Channels] in ``graphddp/runtime/channels.py``): with more
    than one, a bucket's latency term runs while the bucket before it is still on the wire."""
    bucket_of: tuple[int, ...] = ()
    """Per all-reduce, the plan's bucket it sends (a bucket sent in blocks, Note [Gradient pieces], is several):
    the channel is the bucket's (``graphddp.passes.bucket_channel``), so all its blocks go on one. Empty: each
    all-reduce is a bucket of its own."""

    def __post_init__(self) -> None:
        if self.channels < 1:
            raise ValueError(f"a step needs at least one channel, got channels={self.channels}")
        if self.bucket_of and (len(self.bucket_of) != len(self.bucket_bytes) or list(self.bucket_of) != sorted(self.bucket_of)):
            raise ValueError(f"bucket_of must name each all-reduce's bucket, in order; got {self.bucket_of} for {len(self.bucket_bytes)}")
        if len(self.bucket_bytes) != len(self.completed_by):
            raise ValueError("every bucket needs the segment that completes it")
        if self.step_per_bucket_s and len(self.step_per_bucket_s) != len(self.bucket_bytes):
            raise ValueError("a per-bucket optimizer step needs one duration per bucket")
        if self.tail_per_bucket_s and len(self.tail_per_bucket_s) != len(self.bucket_bytes):
            raise ValueError("the compute a bucket leaves for the end of backward needs one duration per bucket")
        for k, segment in enumerate(self.completed_by):
            if not 0 <= segment < len(self.segment_backward_s):
                raise ValueError(f"bucket {k} is completed by segment {segment}, which does not exist")
            if k and segment < self.completed_by[k - 1]:
                raise ValueError(f"bucket {k} completes before bucket {k - 1}: buckets are numbered in ready order")

    def at_compute_speed(self, speed: float) -> StepInputs:
        """These inputs on a machine that computes ``speed`` times as fast: every compute duration (forward, the
        segments' backward, the work after backward, per bucket and per block, the Python per bucket) divided by
        ``speed``; the bytes, the channels and gloo's CPU per byte, measured on their own, stay (Note [Automatic
        caps], "Robust to the compute rate")."""
        if not speed > 0:
            raise ValueError(f"a compute speed is a positive multiple of the measured one, got {speed}")

        def scaled(seconds: Sequence[float]) -> tuple[float, ...]:
            return tuple(s / speed for s in seconds)

        return dataclasses.replace(
            self, segment_backward_s=scaled(self.segment_backward_s), forward_s=self.forward_s / speed,
            after_backward_s=self.after_backward_s / speed, cpu_seconds_per_bucket=self.cpu_seconds_per_bucket / speed,
            step_per_bucket_s=scaled(self.step_per_bucket_s), tail_per_bucket_s=scaled(self.tail_per_bucket_s),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    """Predicted step time: the longest path through the step's DAG."""
    timeline: dict[str, tuple[float, float]]
    """Each node (``forward``, ``segment i``, ``bucket k``, ``after``; ``step k`` with per-bucket steps, else
    ``tail k`` with tail work) with its (start, end) in seconds."""
    exposed_s: float
    """Communication not hidden behind backward: step time minus the time without any communication."""
    critical_path: tuple[str, ...]
    """The nodes whose durations add up to the step time: which of compute and link binds where."""


def ring_bytes_sent(nbytes: float, world: int) -> float:
    """Bytes each of ``world`` ranks sends in a ring all-reduce of ``nbytes``: ``2 (w - 1) / w · n`` (0 alone).
    What gloo's CPU per byte is measured against and charged on (``StepInputs.cpu_seconds_per_byte``)."""
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def predict_step(inputs: StepInputs, link: LinkModel, world: int) -> Prediction:
    """The step's DAG (Note [Step cost model]) and its longest path."""
    import networkx as nx

    graph = nx.DiGraph()
    segments, steps = list(inputs.segment_backward_s), _tail_work(inputs)
    for k, segment in enumerate(inputs.completed_by):  # the CPU cost of sending bucket k: on what computes meanwhile
        cpu = inputs.cpu_seconds_per_byte * ring_bytes_sent(inputs.bucket_bytes[k], world)
        if segment + 1 < len(segments):  # the next segment
            segments[segment + 1] += cpu
        elif k and steps and steps[k - 1]:  # sent after backward's compute: beside the work of the bucket
            steps[k - 1] += cpu  # before it, its step or its copy, if it has any (else the CPU only waits)
        segments[segment] += inputs.cpu_seconds_per_bucket
    durations = {"forward": inputs.forward_s, "after": inputs.after_backward_s}
    chain = ["forward"] + [f"segment {i}" for i in range(len(segments))]
    durations.update({f"segment {i}": s for i, s in enumerate(segments)})
    for a, b in zip(chain, chain[1:]):
        graph.add_edge(a, b)
    graph.add_edge(chain[-1], "after")
    previous_on_channel = _previous_on_channel(inputs)
    for k, nbytes in enumerate(inputs.bucket_bytes):  # bucket k: its latency term ("bucket k"), then its bytes
        node, wire = f"bucket {k}", f"bucket {k} on the wire"
        durations[node], durations[wire] = link.allreduce_parts(nbytes, world)
        graph.add_edge(f"segment {inputs.completed_by[k]}", node)
        graph.add_edge(node, wire)
        if k:
            graph.add_edge(f"bucket {k - 1} on the wire", wire)  # one link: bytes go one bucket after another
        before = previous_on_channel[k]
        if before is not None:  # its channel is free once the all-reduce before on it is done (1: the previous one)
            graph.add_edge(f"bucket {before} on the wire", node)
        graph.add_edge(wire, "after")
    tail = "step" if inputs.step_per_bucket_s else "tail"  # a bucket's tail work: its step, or only its copy
    for k, seconds in enumerate(steps):
        node = f"{tail} {k}"
        durations[node] = seconds
        graph.add_edge(chain[-1], node)  # after backward's compute (the Reducer's finalize, or in-graph step nodes)
        graph.add_edge(f"bucket {k} on the wire", node)
        if k:
            graph.add_edge(f"{tail} {k - 1}", node)
        graph.add_edge(node, "after")
    start: dict[str, float] = {}
    for node in nx.topological_sort(graph):
        start[node] = max((start[p] + durations[p] for p in graph.predecessors(node)), default=0.0)
    timeline = {node: (start[node], start[node] + durations[node]) for node in graph.nodes}
    step = timeline["after"][1]
    local = inputs.forward_s + sum(inputs.segment_backward_s) + inputs.after_backward_s + sum(inputs.step_per_bucket_s)
    for a, b in graph.edges:
        graph.edges[a, b]["seconds"] = durations[a]
    graph.add_edge("after", "end", seconds=durations["after"])
    path = [n.removesuffix(" on the wire") for n in nx.dag_longest_path(graph, weight="seconds") if n != "end"]
    for k in range(len(inputs.bucket_bytes)):  # a bucket's all-reduce: from its latency's start to its bytes' end
        timeline[f"bucket {k}"] = (timeline[f"bucket {k}"][0], timeline.pop(f"bucket {k} on the wire")[1])
    critical = tuple(n for i, n in enumerate(path) if not i or n != path[i - 1])
    return Prediction(step, timeline, max(step - local, 0.0), critical)


def _previous_on_channel(inputs: StepInputs) -> list[int | None]:
    """Per all-reduce, the one issued last before it on the same channel (None: the first on its channel)."""
    buckets = inputs.bucket_of or range(len(inputs.bucket_bytes))
    last: dict[int, int] = {}
    previous: list[int | None] = []
    for k, bucket in enumerate(buckets):
        channel = bucket_channel(bucket, inputs.channels)
        previous.append(last.get(channel))
        last[channel] = k
    return previous


def _tail_work(inputs: StepInputs) -> list[float]:
    """Per bucket, what the compute side does for it once backward's compute is over and its all-reduce is done:
    its tail (``tail_per_bucket_s``), then its step (``step_per_bucket_s``); empty where there is neither."""
    steps, tails = inputs.step_per_bucket_s, inputs.tail_per_bucket_s
    if not steps and not tails:
        return []
    n = len(inputs.bucket_bytes)
    return [(steps[k] if steps else 0.0) + (tails[k] if tails else 0.0) for k in range(n)]


def choose_channels(
    inputs: StepInputs, link: LinkModel, world: int, *, candidates: Sequence[int] = (1, 2, 4), margin: float = 0.05
) -> tuple[int, dict[int, float]]:
    """The number of channels for a step (Note [Channels] in ``graphddp/runtime/channels.py``), and each
    candidate's predicted step in seconds: 1 unless the best candidate's step is shorter than one channel's by more
    than ``margin`` (a share of it); then the fewest channels within ``margin`` of the best. The margin stands for what the model does not see: every extra
    channel is a process group with threads and connections of its own, sharing the CPUs (on the 2-CPU testbed a
    second gloo channel cost 2-6 % where the link was bandwidth-bound, ``docs/benchmarks.md``). Channels pay
    where latency binds: many buckets, each a small share of a long path's α."""
    if 1 not in candidates or any(k < 1 for k in candidates):
        raise ValueError(f"channel candidates must include 1 and be >= 1, got {tuple(candidates)}")
    check_margin(margin)
    steps = {k: predict_step(dataclasses.replace(inputs, channels=k), link, world).step_s for k in sorted(set(candidates))}
    best = min(steps.values())
    if best >= steps[1] * (1 - margin):
        return 1, steps
    return min(k for k, step in steps.items() if step <= best * (1 + margin)), steps


STEP_IN_BACKWARD_MARGIN = 0.03
"""The predicted gain below which the planner keeps the optimizer after backward. The model charges each step the
CPU that gloo spends on the bucket still on the link beside it (``cpu_seconds_per_byte``), but a calibration
that is off moves the gain. Set from the
2-rank matrix of session 8 (six cells, ``docs/benchmarks.md``), where the two predicted
gains above 3 % were measured gains (mlp and gpt at 1 Gbit/s: 3.6 and 3.8 % predicted, 2.3 and 3.3 % measured),
and cnn at 1 Gbit/s, 2.2 % predicted, lost 0.8 %. Below the margin the model cannot tell a gain from a loss.
Checked again in session 11, with the steps inside the compiled backward, on two runs: there 3 % picked right
in 10 of 12 cells. A 2 % margin would have picked right in all six cells of the first run, but in the second it
would have picked two cells (2.3 and 2.2 % predicted) where stepping in backward lost."""


def choose_optimizer_overlap(
    after: StepInputs, stepped: StepInputs, link: LinkModel, world: int, *, margin: float = STEP_IN_BACKWARD_MARGIN
) -> tuple[bool, dict[str, float]]:
    """Whether stepping the optimizer per bucket inside backward (``DDP.step_in_backward``, Note [Optimizer
    overlap] in ``graphddp/runtime/optimizer_overlap.py``) pays, and both predicted steps in seconds (``"after"``,
    ``"stepped"``). ``after`` is the step as it runs with the optimizer after backward (``after_backward_s``),
    ``stepped`` the schedule that steps per bucket (``step_per_bucket_s``), its buckets completing where the
    stepping run's do (in-graph or split, whichever the graph runs). True only where
    ``stepped`` is shorter by more than ``margin`` (a share of ``after``'s step)."""
    if after.step_per_bucket_s:
        raise ValueError("`after` must step the optimizer after backward (after_backward_s), not per bucket")
    if not stepped.step_per_bucket_s:
        raise ValueError("`stepped` must give each bucket's optimizer step (step_per_bucket_s)")
    check_margin(margin)
    steps = {"after": predict_step(after, link, world).step_s, "stepped": predict_step(stepped, link, world).step_s}
    return steps["stepped"] < steps["after"] * (1 - margin), steps


def check_margin(margin: float) -> None:
    """A planner's margin is a share of the predicted step (``choose_channels``, ``choose_optimizer_overlap``,
    ``choose_caps``)."""
    if not 0 <= margin < 1:
        raise ValueError(f"the margin is a share of the step, in [0, 1), got {margin}")


def project_scaling(inputs: StepInputs, link: LinkModel, worlds: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Weak scaling on paper: each rank keeps its batch, compute and buckets; per world size, the predicted step
    and the scaling efficiency (the step alone, with nothing to communicate, over the step at that size).
    Assumes one all-reduce per bucket by ``link.algorithm`` (Note [Step cost model]), a link whose α and β per rank do not change with the number of ranks
    (a non-blocking switch), the CPU cost per byte sent unchanged, and ranks in lockstep (no stragglers)."""
    alone = predict_step(dataclasses.replace(inputs, tail_per_bucket_s=()), link, 1).step_s  # one rank: no pieces
    projected = {}
    for world in worlds:
        step = predict_step(inputs, link, world).step_s
        projected[world] = (step, alone / step)
    return projected
