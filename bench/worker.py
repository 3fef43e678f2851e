"""One rank of a benchmark run (started by torchrun): every mode, timed in rounds, in one process group.

Each round goes through every mode, in one of two orders (``--interleave``, ``bench.interleave``):

- ``modes`` (the default): build a mode on a fresh copy of the workload, run its first iteration (compiles; later
  rounds hit the compile caches) and the warm-up, time ``iters / rounds`` iterations, and free it before the next
  mode is built. Only one mode is alive at a time. Drift of a shared machine between rounds hits every mode alike;
  drift within a round does not: a mode's iterations and the limit's sit up to a minute apart, and on a 2-vCPU VM
  one cell's rounds differed by more than 10 % (``docs/benchmarks.md``, session 48).
- ``steps``: build and warm up every mode, then time one iteration of each in turn, the order reversed on every
  other pass (``pass_order``: an iteration pays for the mode before it), so drift slower than two passes over the
  modes moves them alike. Every mode is resident at once (memory is the sum of the modes'; in the first
  sessions, with glibc handing memory back, that made every mode slower: ``--allocator retain`` keeps it).

Writes ``rank{R}.json`` into the run's folder: per mode, the iteration times with the round each was timed in,
each iteration's phases (forward, backward, optimizer; ``naive`` also its all-reduce), compile time (first
iteration of the first round), added peak memory, and for graphddp modes one recorded iteration (events with
times) for the timeline.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import graphddp
from graphddp.passes.blocks_in_place import WAIT_BLOCKS_OP
from graphddp.passes.reduction import WAIT_OP
from graphddp.runtime.calibration import assembly_seconds_per_byte, best_of, cpu_cost_of_communication, link_of
from graphddp.runtime.optimizer_overlap import StepPerBucket
from graphddp.runtime.reductions import goes_as_rows
from graphddp.runtime.row_steps import steps_in_chunks
from graphddp.runtime.trace import EventLog, NullEvents
from graphddp.tools.launch import init_process_group
from graphddp.tools.workloads import Workload, build_workload

from .allocator import minor_page_faults
from .interleave import graphs_compiled, isolated_model, pass_order, shared_frames
from .modes import ModeConfig, ModeName, Step, build, optimizer_for, reduction_ran


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
    rows_touched: int | None = None


def main(config_path: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank says where it is (graphddp.tools.launch.stop_job)
    config = json.loads(Path(config_path).read_text())
    pinned = config.get("pin", False) and _pin_to_own_cpu(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    init_process_group("gloo")  # torchrun-restart safe (Note [Restarts] in graphddp/tools/launch.py)
    rank, world = dist.get_rank(), dist.get_world_size()
    # Pinned, the CPUs this rank may use are its own; unpinned, the ranks share them.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // (1 if pinned else world)))
    say = print if rank == 0 else (lambda *a, **k: None)
    mode_config = ModeConfig(**config["mode_config"])
    modes = config["modes"]
    results: dict[str, Any] = {
        "rank": rank, "world_size": world, "batch_size": None, "cpus": sorted(os.sched_getaffinity(0)), "modes": {},
        "calibration": calibrate(world, stepping=any(ModeName.parse(m).step_in_backward for m in modes)),
    }  # fmt: skip
    rounds_of = _rounds_of_steps if config.get("interleave", "modes") == "steps" else _rounds_of_modes
    rounds_of(config, mode_config, rank, results, say)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _iters_in_round(config: dict, r: int) -> int:
    """Round ``r``'s share of the timed iterations (the first rounds take one more where they do not divide)."""
    return config["iters"] // config["rounds"] + (r < config["iters"] % config["rounds"])


def _rounds_of_modes(config: dict, mode_config: ModeConfig, rank: int, results: dict[str, Any], say: Any) -> None:
    """``--interleave modes``: one mode alive at a time, built afresh every round, its iterations timed in a row."""
    modes, rounds = config["modes"], config["rounds"]
    for r in range(rounds):
        for i, mode in enumerate(modes):
            say(f"round {r + 1}/{rounds}, [{i + 1}/{len(modes)}] {mode}: building, compiling, warming up ...", flush=True)
            m = prepare(mode, config, mode_config, rank)
            timed = [timed_step(m) for _ in range(_iters_in_round(config, r))]
            record_round(results, m, timed, r, last=r == rounds - 1, say=say)
            del m
            gc.collect()


def _rounds_of_steps(config: dict, mode_config: ModeConfig, rank: int, results: dict[str, Any], say: Any) -> None:
    """``--interleave steps``: every round builds and warms up every mode, then times one iteration of each in
    turn (``bench.interleave``), so a mode's iterations and its baseline's are one pass over the modes apart, not
    up to a minute. Every mode is resident at once: memory is the sum of theirs."""
    with shared_frames(len(config["modes"])):
        for r in range(config["rounds"]):
            try:
                _one_round_of_steps(config, mode_config, rank, results, say, r)
            finally:  # the round's modes and their compiled code, freed before the next round builds its own
                torch._dynamo.reset()
                gc.collect()


def _one_round_of_steps(config: dict, mode_config: ModeConfig, rank: int, results: dict[str, Any], say: Any, r: int) -> None:
    """Round ``r`` of ``_rounds_of_steps``: its modes live only here, so none outlives the round."""
    modes, rounds = config["modes"], config["rounds"]
    prepared = {}
    for i, mode in enumerate(modes):
        say(f"round {r + 1}/{rounds}, [{i + 1}/{len(modes)}] {mode}: building, compiling, warming up ...", flush=True)
        prepared[mode] = prepare(mode, config, mode_config, rank, isolated=True)
    for _ in range(config["warmup"]):  # after every mode is built, in the timed order: no mode is timed cold
        for m in prepared.values():
            dist.barrier()
            m.step(m.workload.make_batch(m.data))
    timed: dict[str, list[Timed]] = {mode: [] for mode in modes}
    compiled = graphs_compiled()
    for k in range(_iters_in_round(config, r)):
        for mode in pass_order(modes, k):
            timed[mode].append(timed_step(prepared[mode]))
    if graphs_compiled() != compiled:  # a timed step compiled: its time is not a steady step's
        results["compiles_while_timed"] = results.get("compiles_while_timed", 0) + graphs_compiled() - compiled
        say(f"round {r + 1}/{rounds}: {graphs_compiled() - compiled} graph(s) compiled while timed", flush=True)
    for mode, m in prepared.items():
        record_round(results, m, timed[mode], r, last=r == rounds - 1, say=say)


def record_round(results: dict[str, Any], m: PreparedMode, timed: list[Timed], r: int, *, last: bool, say: Any) -> None:
    """Round ``r``'s timed iterations of one mode into ``results``; in the ``last`` round also its recorded
    timeline, its buckets and what it reduced with."""
    entry = results["modes"].setdefault(
        m.name,
        {"first_s": m.first_s, "added_peak_rss_mb": m.added_peak_rss_mb, "times_s": [], "round_of": [], "phases_s": [], "page_faults": [], "started_ns": []},
    )  # fmt: skip
    entry["times_s"] += [t.seconds for t in timed]
    entry["phases_s"] += [t.phases for t in timed]
    entry["page_faults"] += [t.page_faults for t in timed]
    entry["started_ns"] += [t.started_ns for t in timed]
    entry["round_of"] += [r] * len(timed)
    if (auto := automatic_caps(m)) is not None:  # every round: each builds its DDP, and may choose again
        entry.setdefault("auto_caps", []).append(auto)
    if last:
        entry["timeline"] = record_timeline(m)
        entry["buckets"] = bucket_layout(m)
        entry["reduction"] = reduction_ran(m.ddp) if isinstance(m.ddp, graphddp.DDP) else None
    results["batch_size"] = m.workload.batch_size
    results["params"] = [[n, p.numel() * p.element_size()] for n, p in m.workload.model.named_parameters() if p.requires_grad]
    say(f"      {m.name}: first iteration {m.first_s:.2f} s, median so far {statistics.median(entry['times_s']) * 1e3:.1f} ms", flush=True)


def prepare(mode: str, config: dict, mode_config: ModeConfig, rank: int, *, isolated: bool = False) -> PreparedMode:
    """Build ``mode`` on its own copy of the workload, run its first iteration (compiles) and the warm-up.
    ``isolated``: other modes stay alive beside it (``--interleave steps``): Dynamo is not reset, the model's
    compiled code is its own (``bench.interleave.isolated_model``), and the warm-up is left to the caller, which
    runs it once every mode is built."""
    if not isolated:
        torch._dynamo.reset()
    rss_before = _rss_mb("VmRSS")
    _reset_peak_rss()
    workload = build_workload(config["workload"], size=config["size"], batch_size=config["batch_size"], seed=0)
    model = isolated_model(workload.model, mode) if isolated else workload.model
    step, ddp = build(mode, model, mode_config)
    data = torch.Generator().manual_seed(1000 + rank)
    dist.barrier()
    start = time.perf_counter()
    step(workload.make_batch(data))  # compiles, for compiled modes
    first = time.perf_counter() - start
    for _ in range(0 if isolated else config["warmup"]):
        step(workload.make_batch(data))
    peak = _rss_mb("VmHWM")
    added = peak - rss_before if peak is not None and rss_before is not None else None
    return PreparedMode(mode, step, ddp, workload, data, first, added)


PHASES = ("forward", "backward", "allreduce", "optimizer", "end")


class Timed(NamedTuple):
    """One timed iteration of a mode."""

    seconds: float
    phases: dict[str, float]
    """How long each phase the step recorded took (seconds; ``PhaseMarks.phases``)."""
    page_faults: int
    """Minor page faults the rank's process took meanwhile (``minor_page_faults``: gloo's threads' included)."""
    started_ns: int
    """When it started (``perf_counter_ns``): the order the modes' iterations ran in."""


def timed_step(m: PreparedMode) -> Timed:
    """One iteration, timed (``Timed``).

    With a graphddp Reducer, its events are recorded too, and two instants (``perf_counter`` ns, one clock for
    all ranks of this machine) join the phases: ``finalize_ns``, when backward's compute ended here, and
    ``written_ns``, when the last averaged gradient was in ``.grad``.
    """
    batch = m.workload.make_batch(m.data)
    log = PhaseMarks()
    if isinstance(m.ddp, graphddp.DDP):
        m.ddp.reducer.events = log
    dist.barrier()
    faults = minor_page_faults()
    start = time.perf_counter_ns()
    m.step(batch, log)
    elapsed = (time.perf_counter_ns() - start) / 1e9
    faults = minor_page_faults() - faults
    if isinstance(m.ddp, graphddp.DDP):
        m.ddp.reducer.events = NullEvents()
    return Timed(elapsed, log.phases(), faults, start)


class PhaseMarks:
    """What a timed iteration records: the start of each phase, and, from a graphddp Reducer, when backward's
    compute ended (``finalize``) and when the last average was written. ``recording`` is False, so nothing that
    only timelines need (segment-backward prehooks, completion callbacks on gloo's threads) runs: the timed
    graphddp modes carry no instrumentation the PyTorch modes do not."""

    recording = False

    def __init__(self) -> None:
        self.marks: list[tuple[str, int]] = []
        self.instants: dict[str, int] = {}

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        if kind in PHASES:
            self.marks.append((kind, time.perf_counter_ns()))
        elif kind in ("finalize", "written"):
            self.instants[f"{kind}_ns"] = time.perf_counter_ns()  # the last one wins

    def phases(self) -> dict[str, float]:
        durations = {a: (tb - ta) / 1e9 for (a, ta), (_, tb) in zip(self.marks, self.marks[1:])}
        return durations | (self.instants if len(self.instants) == 2 else {})


def calibrate(world: int, *, stepping: bool) -> dict[str, float] | None:
    """What the step cost model needs (graphddp.runtime.calibration): of the link, α, β and the compute each
    communicated byte costs (rank 0's figures, on every rank); what a byte of putting a gradient sent in pieces
    back together costs (this rank's; the run keeps rank 0's calibration); and where a mode is ``stepping`` the
    optimizer in backward, what its chunked steps cost against whole ones (~1 s and ~320 MiB, so only then)."""
    if world < 2:
        return None
    link = link_of()
    measured = {
        "latency_s": link.latency_s,
        "seconds_per_byte": link.seconds_per_byte,
        # Longer than construction's, and steadier: eight calls at 1 Gbit/s measured 0.67-0.86 ns/B against
        # construction's 0.62-1.54 (Note [What communication costs a CPU rank]).
        "cpu_seconds_per_byte": cpu_cost_of_communication(link=link, window_s=0.8, repeats=5),
        "assembly_seconds_per_byte": assembly_seconds_per_byte(),
    }
    return measured | ({"chunked_step_ratio": chunked_step_ratio()} if stepping else {})


def chunked_step_ratio(rows: int = 4096, columns: int = 4096) -> float:
    """What the bench's optimizer costs stepping a big CPU parameter chunk by chunk, as ``step_in_backward`` does
    (Note [Steps by rows], ``CPU_CHUNK_BYTES``), against one step of it whole: best of 5 each, on a [rows, columns]
    float32 parameter with its state made (64 MiB: the bench MLP's two hidden weights)."""
    weight = torch.nn.Parameter(torch.randn(rows, columns))
    optimizer = optimizer_for(torch.nn.ParameterList([weight]))
    weight.grad = torch.randn(rows, columns)
    optimizer.step()  # the state, made
    stepper = StepPerBucket(optimizer, [weight])
    cpu = torch.device("cpu")
    return best_of(lambda: stepper.step_whole([weight]), cpu) / best_of(optimizer.step, cpu)


def record_timeline(m: PreparedMode) -> list[tuple[str, int | None, str | None, float]] | None:
    """One more iteration with its events recorded: a graphddp mode's from its Reducer, any other mode's that
    communicates, and a graphddp mode that reduces inside the compiled graph (recording the Reducer's events would
    switch it to the split), from ``torch.profiler`` (``profiled_timeline``); None for ``local`` and ``local-compiled``."""
    if not isinstance(m.ddp, graphddp.DDP) or reduction_ran(m.ddp) == "in_graph":
        return profiled_timeline(m) if not m.name.startswith("local") else None  # local, local-compiled: no comm
    m.ddp.reducer.events = log = EventLog()
    batch = m.workload.make_batch(m.data)
    dist.barrier()
    m.step(batch, log)
    # "done" events come from future callbacks on gloo's threads and may trail the step: let them land.
    dist.barrier()
    time.sleep(0.05)
    t0 = log.events[0].t_ns
    m.ddp.reducer.events = NullEvents()
    m.rows_touched = _rows_touched(batch)
    return [(e.kind, e.bucket, e.param, (e.t_ns - t0) / 1e6) for e in log.events]


class ProfilerMarks:
    """Phase marks as zero-length ``torch.profiler`` ranges, so they share the profiler's clock."""

    recording = False

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        with torch.profiler.record_function(f"bench:{kind}"):
            pass


WAITS = (WAIT_OP, WAIT_BLOCKS_OP)
"""The ops an in-graph backward waits for its all-reduces with (``profiled_timeline``'s ``compute_end``)."""


def profiled_timeline(m: PreparedMode) -> list[tuple[str, int | None, str | None, float]]:
    """One iteration under ``torch.profiler``: the phase marks, and each all-reduce numbered in issue order as
    buckets: ``launch`` when it was issued (the ``c10d::allreduce_`` op, from PyTorch's C++ Reducer or from a
    compiled graph's functional all-reduce alike), ``done`` when gloo's thread finished it (the k-th
    ``gloo:all_reduce`` range by start). A graphddp mode that reduced in-graph has no Reducer events: its
    ``finalize`` is its last issue, and ``compute_end`` the first wait of its backward (``WAITS``): the waits
    are sunk to their first consumer (a gradient's: the graph's output; a tied table's part's: the table's rows
    node, with the last gradient), and with steps in backward the steps and their waits go after every computation
    (Note [Steps in the compiled backward]). Not exact: a gradient sent in pieces is joined (``wait_blocks_``)
    where autograd traced the join, so compute no collective needs (a table's lookups' gradient) can follow its
    wait; in gpt at 1 Gbit/s ``compute_end`` came 2 ms before the table's mask (session 46). Where the backward's
    compute ends, the predictions' window ends (``bench.predict``); neither ``finalize`` nor the last bucket's
    launch alone finds it: a row-sparse last bucket's last issue is its rows, sent only once its mask is back,
    and with steps in backward its mask is sent after the other buckets' steps."""
    batch = m.workload.make_batch(m.data)
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m.step(batch, ProfilerMarks())
        dist.barrier()
    if isinstance(m.ddp, graphddp.DDP):  # a table's rows reduced in-graph: what they sent (bucket_layout)
        m.rows_touched = _rows_touched(batch)
    marks = [(e.name.removeprefix("bench:"), e.time_range.start) for e in prof.events() if e.name.startswith("bench:")]
    issued = sorted(e.time_range.start for e in prof.events() if e.name == "c10d::allreduce_")
    ran = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "gloo:all_reduce")
    if not marks:
        return []
    t0 = min(t for _, t in marks)
    events: list[tuple[str, int | None, str | None, float]] = [(kind, None, None, (t - t0) / 1e3) for kind, t in marks]
    for k, (issue, (_start, end)) in enumerate(zip(issued, ran)):
        events += [("launch", k, None, (issue - t0) / 1e3), ("done", k, None, (end - t0) / 1e3)]
    if isinstance(m.ddp, graphddp.DDP) and issued:
        events.append(("finalize", None, None, (issued[-1] - t0) / 1e3))
        backward = next((t for kind, t in marks if kind == "backward"), None)
        if backward is not None:
            waited = [e.time_range.start for e in prof.events() if e.name in WAITS and e.time_range.start >= backward]
            if waited:
                events.append(("compute_end", None, None, (min(waited) - t0) / 1e3))
    return sorted(events, key=lambda e: e[3])


def automatic_caps(m: PreparedMode) -> dict[str, Any] | None:
    """An ``@auto`` mode's calibration and caps choices this round, as its DDP made them
    (``graphddp.DDP.automatic_caps``); None for every other mode."""
    auto = m.ddp.automatic_caps if isinstance(m.ddp, graphddp.DDP) else None
    return auto.as_record() if auto is not None else None


def bucket_layout(m: PreparedMode) -> list[dict[str, Any]] | None:
    """A graphddp mode's buckets as the step cost model sees them: bytes each all-reduce sends (a row-sparse
    table: the row mask, then the rows some rank touched in the recorded iteration, or the whole table where the
    one rule, ``goes_as_rows``, sent it dense; in-graph, only the table once its dense streak gave up),
    ``stepped``, the bytes of parameters an optimizer stepping in backward can step once it is done, and
    ``assembled``, the bytes of a gradient sent in pieces that are copied into it once it is done, and
    ``bucket``, the plan's bucket (a bucket in pieces has an entry per block; all go on its channel)."""
    if not isinstance(m.ddp, graphddp.DDP):
        return None
    layout = []
    in_graph = reduction_ran(m.ddp) == "in_graph"
    gone_dense = m.ddp.reducer.compile_target.tables_gone_dense_in_graph() if in_graph else frozenset()
    for b in m.ddp.bucket_plan.buckets:
        if in_graph and b.pieces is not None:  # one all-reduce per block (Note [Gradient pieces])
            layout += [
                {"bytes": n, "sent": n, "row_sparse": False, "stepped": stepped, "chunked": chunked, "assembled": 0, "bucket": b.index}
                for n, stepped, chunked in zip(b.piece_bytes, b.piece_stepped_bytes(), _chunked_in_pieces(b))
            ]  # fmt: skip
            layout[-1]["assembled"] = b.assembled_bytes  # then its first block is copied into the gradient
            continue
        (stepped,) = b.piece_stepped_bytes()  # a part's table steps with the table's own bucket
        chunked = sum(p.nbytes for p in b.params if not p.part and _in_chunks(p))
        row_sparse = b.row_sparse and b.params[0].name not in gone_dense
        sent = rows_sent(b, m.rows_touched) if row_sparse else b.nbytes
        layout.append(
            {"bytes": b.nbytes, "sent": sent, "row_sparse": row_sparse, "stepped": stepped, "chunked": chunked, "assembled": 0, "bucket": b.index}
        )  # fmt: skip
    return layout


def _chunked_in_pieces(bucket: Any) -> list[int]:
    """Per block of a bucket in pieces: of its ``piece_stepped_bytes``, those of parameters stepped in chunks
    (``steps_in_chunks``) or in blocks (Note [Steps by rows]): the big gradient's rows each block steps where it
    is that big, and with the last block any other parameter that is."""
    big = bucket.pieces[0]
    chunked = [r if _in_chunks(bucket.params[big]) else 0 for r in bucket.piece_rows_stepped_bytes()]
    chunked[-1] += sum(p.nbytes for k, p in enumerate(bucket.params) if k != big and not p.part and _in_chunks(p))
    return chunked


def _in_chunks(p: Any) -> bool:
    """A parameter (``ParamSpec``) ``step_in_backward`` steps in chunks on this CPU host."""
    return not p.sparse_grad and steps_in_chunks(p.shape, p.nbytes, on_cpu=True)


def rows_sent(bucket: Any, touched: int | None) -> int:
    """Bytes a row-sparse ``bucket`` (one table) sends when ``touched`` of its rows are in some rank's batch:
    the byte mask, then those rows, or the whole table where there are too many (None: not recorded, the table)."""
    rows = bucket.params[0].shape[0]
    if touched is None:
        return bucket.nbytes
    touched = min(touched, rows)
    return rows + (bucket.nbytes * touched // rows if goes_as_rows(touched, rows) else bucket.nbytes)


def _rows_touched(batch: tuple) -> int | None:
    """Embedding rows some rank looked up: the distinct token ids of every rank's batch (token workloads)."""
    tokens = batch[0]
    if tokens.is_floating_point():
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tokens.unique().tolist())
    return len(set().union(*everyone))


def _pin_to_own_cpu(rank: int, world: int) -> bool:
    """Rank r runs on the r-th slice of ``cpus // world`` of the CPUs this process may use (when there is at least
    one for every rank; returns whether it pinned); it then computes with that many threads.

    Called before the process group exists, so gloo's threads (created with it) inherit the affinity: each rank
    computes and communicates on CPUs of its own, as on a host with that many cores, where gloo's threads also
    take cycles from compute. Unpinned, the scheduler sometimes stacks both ranks' compute threads on one CPU
    for a while, which shows up as one rank running 30-50 % slower.
    """
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // world
    if share < 1:  # more ranks than CPUs: nothing of its own to give each
        return False
    os.sched_setaffinity(0, set(cpus[rank * share : (rank + 1) * share]))
    return True


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
