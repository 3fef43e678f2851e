"""What each DDP adds to a launch-bound step: ``python -m bench.overhead`` (CPU by default, CUDA when present).

A step is *launch-bound* when its time goes to starting work rather than to the work itself: many small tensors,
small matmuls. Then a DDP's own Python (hooks per gradient, copies, checks, per-bucket bookkeeping) shows in the
step time, as it does on a GPU, where the CPU that launches kernels is the backward's pace. This benchmark builds
such a step anywhere: GPT-2-small's parameter structure (12 blocks, 148 parameter tensors, tied head) at a small
width, or with ``--model mlp`` a stack of small linear layers (``--layers 2500 --width 16``: 5,000 tensors, where
a cost per parameter shows most), and times, interleaved step by step in the same processes (``--interleave``,
below),

- ``local`` and ``local-compiled``: no DDP (the baselines each DDP is measured against);
- ``torch-eager`` / ``graphddp-eager``: PyTorch's DDP (C++ Reducer) and graphddp's;
- ``torch-compiled`` / ``graphddp-compiled``: the same under ``torch.compile`` with the inner compiler(s) given
  (``inductor``, ``aot_eager``): PyTorch's through DDPOptimizer, graphddp's through its own backend as a user gets
  it (``reduction="auto"``: in-graph where the graph can be traced, Note [In-graph reduction]);
  ``graphddp-compiled-split``: graphddp's backend with ``reduction="split"`` (one segment per bucket, the Reducer's
  hooks), for comparison. The table's ``reduction`` column says what each graphddp mode ran;
- ``bound`` / ``bound-compiled`` (more than one rank): ``local`` / ``local-compiled`` with the bytes a dense DDP
  sends (one all-reduce per bucket of graphddp's plan at the caps) issued at the step's first instant, beside it
  (the matrix's ``bound``, ``bench.modes``, is the compiled one). No DDP can send them earlier (no gradient exists
  before backward), so what ``bound`` adds is a floor under what a DDP that sends those bytes in those buckets
  on the same CPUs adds: where it is more than half of what PyTorch's DDP adds, halving PyTorch's added time is
  out of reach on that machine. (PyTorch's DDP sends the same bytes in fewer buckets, ``bucket_count``, so for
  it the floor is approximate.)
- ``bound-backward`` / ``bound-backward-compiled``: the same, the all-reduces issued when the backward starts (the
  forward has returned). A DDP's first byte leaves no earlier, and then not all of them at once, so this is a
  floor under what *any* DDP adds that sends those bytes in those buckets: where gloo's thread costs the compute
  more beside the backward than beside the forward, it lies above ``bound``, and the part of a target between the
  two is out of reach of every DDP.
- ``bound-ready`` / ``bound-ready-torch`` (eager): each bucket all-reduced the moment its last gradient is
  accumulated, from a buffer made beforehand, and nothing else (``bench.as_ready``): a DDP that costs only its
  collectives, sent as an eager DDP sends them. ``bound-ready`` sends graphddp's buckets, ``bound-ready-torch``
  PyTorch's, so a DDP's distance from its own layout's row is its own cost (since session 32 the two layouts
  are the same: ramps off, graphddp closes a bucket at its cap or more, as PyTorch does).
- ``bare-ddp`` (eager): ``bound-ready`` with a DDP's data path and nothing else (``bench.as_ready.BareDDP``): a
  complete bucket's gradients copied into its buffer and scaled, sent, and the averages copied back after the
  wait, as graphddp's lean bucket path does, with none of graphddp's bookkeeping. graphddp-eager's distance from it
  is graphddp's bookkeeping; PyTorch's distance from it is what its C++ Reducer saves, or costs, over a DDP in
  Python that copies as graphddp does.

Both DDPs get the same bucket layout: every cap ``--cap-mb`` (≥ 1 MiB: DDPOptimizer asserts below), graphddp's
ramps off. Two orders (``--interleave``):

- ``steps`` (the default): each round builds every mode, warms each up, then times one step of each mode in turn,
  ``--steps`` times over, with a barrier before each step, the modes in the listed order on even passes and in
  reverse on odd ones (``pass_order``: a step pays for the mode before it, so no mode always follows the same
  one). A mode's steps and its baseline's are then at most two passes over the modes apart (~2.5 s a pass for the
  14 modes at two ranks), so a ratio of added times is not moved by drift slower than that. Each mode's model gets a ``forward`` code object of its own (``isolated_model``): Dynamo
  keeps its compiled code per code object, so no mode's step looks through another mode's cache entries, and no
  compiled graph is reused by another mode. A step that compiles anything while timed is counted
  (``compiles_while_timed``) and the run says so.
- ``modes`` (the default up to session 18, ``docs/benchmarks.md``): one mode is alive at a time; each round builds
  it afresh (Dynamo reset, Inductor's caches warm), warms it up and times ``--steps`` steps in a row. Drift of the
  machine between rounds hits every mode alike; drift within a round (a mode's steps and its baseline's sit up to a
  minute apart) does not, and on a 2-vCPU VM it moved ratios of added times by about ±0.5.

Each mode's steps run in turn under 0, 3 and 7 extra Python frames (``STACK_SHIFTS``), and a mode's figure is the
median of its steps. CPython 3.11 keeps frames on a stack of 16 KiB chunks, maps a chunk when a call does not fit
in the current one and unmaps it when that call returns: where a large frame (a compiled graph's code with a local
per node: 12.6 KiB for the in-graph backward under aot_eager) ends just short of its chunk's end, every call made
from it maps a fresh chunk and faults its pages in. Which steps that hits depends only on the harness's call depth,
within a window of about two frames (session 52: ~990 faults a step at one depth, 4-10 at the 23 others tried),
so no depth is kept for all of a mode's steps.

Besides time, it *counts* (never times) the Python function calls one backward makes, per mode, with
``sys.setprofile`` in every thread that runs it: what a DDP adds over its baseline is the per-gradient and
per-bucket Python the issue of a lean path is about — O(parameters) or O(buckets).

And it measures the CPU time each step costs a rank (``time.process_time``: every thread of the process, gloo's
workers included; the ``cpu ms`` columns, the mean over ranks of each mode's median), and how much of it ran on
threads other than the one that called the step (``other threads cpu ms``: on a CPU, where the backward runs on
the calling thread, and with ``--threads 1`` (the default; more adds the intra-op pool), that is the process group's
workers doing the collectives). On a machine whose cores the
ranks share (2 vCPUs, 2 ranks), a step's time is mostly its CPU time, which varies less from step to step than
wall time does: it separates what a DDP *does* from when it waits, and its own work from its collectives'.

And it counts the minor page faults each step takes a rank (``page faults``: ``minor_page_faults``): a DDP that
allocates its buffers afresh each step, where glibc hands large blocks back to the OS when they are freed, faults
every page of them in again each step (``--allocator retain`` keeps them; ``docs/benchmarks.md``, session 30).

Prints a table and writes ``DIR/overhead.json``. ``bench.gpu`` is the GPU-sized sibling (GPT-2-small at full width).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from graphddp.passes import BucketCaps
from graphddp.tools.launch import free_port, import_before_init

from .allocator import ALLOCATORS, allocator_env, minor_page_faults
from .as_ready import AsReady, BareDDP, bucket_layout, ready_order
from .interleave import INTERLEAVINGS, graphs_compiled, isolated_model, pass_order, shared_frames
from .modes import all_reduce_every, dense_bucket_buffers, reduction_ran

EAGER_MODES = ("local", "bound", "bound-backward", "bound-ready", "bound-ready-torch", "bare-ddp", "torch-eager", "graphddp-eager")
COMPILED_MODES = ("local-compiled", "bound-compiled", "bound-backward-compiled", "torch-compiled", "graphddp-compiled",
                  "graphddp-compiled-split")  # fmt: skip
STACK_SHIFTS = (0, 3, 7)
"""Extra Python frames the timed steps run under, in turn: a step's time must not rest on where CPython's frame stack
puts a compiled graph's frame (the module's docstring)."""
MODELS = ("gpt", "mlp")
"""The models ``--model`` names (``OverheadOptions.model``)."""
LINK_MODES = ("bound", "bound-compiled", "bound-backward", "bound-backward-compiled", "bound-ready", "bound-ready-torch", "bare-ddp")
"""The modes that only mean something where there is a link: left out at one rank."""
AS_READY: dict[str, tuple[str, type[AsReady]]] = {
    "bound-ready": ("graphddp", AsReady), "bound-ready-torch": ("torch", AsReady), "bare-ddp": ("graphddp", BareDDP),
}
"""The link modes that send each bucket as its gradients become ready (``bench.as_ready``): whose bucket layout
they send, and whether they only send (``AsReady``) or also copy and average (``BareDDP``)."""
FROM_BACKWARD = ("bound-backward", "bound-backward-compiled")
"""The link modes whose all-reduces start with the backward, not with the step."""


def baseline_of(name: str) -> str | None:
    """The mode without DDP that ``name``'s added time and calls are measured against (None for those modes)."""
    _known(name)
    if name.startswith("local"):
        return None
    return "local-compiled" if name in COMPILED_MODES else "local"


def torch_peer_of(name: str) -> str | None:
    """The PyTorch DDP mode that ``name``'s added time is compared with (None for it and the modes without DDP)."""
    _known(name)
    if name.startswith(("local", "torch")):
        return None
    return "torch-compiled" if name in COMPILED_MODES else "torch-eager"


def _known(name: str) -> None:
    if name not in EAGER_MODES and name not in COMPILED_MODES:  # a new mode must say which kind it is
        raise ValueError(f"bench.overhead: unknown mode {name!r}; the modes are {', '.join(EAGER_MODES + COMPILED_MODES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverheadOptions:
    """One ``bench.overhead`` run."""

    world_sizes: tuple[int, ...] = (1, 2)
    """Ranks per run (gloo over loopback on the CPU, NCCL on CUDA); one run per entry."""
    model: str = "gpt"
    """``gpt``: GPT-2-small's parameter structure (below). ``mlp``: a stack of ``layers`` ``Linear(width, width)``
    layers with ReLUs between, two parameter tensors each, on ``batch * seq`` rows of ``width`` features:
    ``--model mlp --layers 2500 --width 16`` is the issue's model of 5,000 small tensors, where a cost per parameter
    shows most."""
    width: int = 128
    """The model's width (``n_embd``): small, so that launching work costs more than doing it."""
    layers: int = 12
    """Transformer blocks (``gpt``: 12 gives GPT-2-small's 148 parameter tensors) or linear layers (``mlp``)."""
    vocab: int = 4096
    seq: int = 64
    batch: int = 4
    """Sequences per rank per step."""
    steps: int = 20
    """Timed steps per mode per round."""
    rounds: int = 3
    warmup: int = 3
    """Steps after the first (which compiles) before timing, every round."""
    inners: tuple[str, ...] = ("inductor", "aot_eager")
    """Inner compilers of the compiled modes (each a set of three modes); empty: eager modes only."""
    cap_mb: float = 1.0
    """Every bucket cap of both DDPs, in MiB."""
    threads: int = 1
    """Intra-op threads per rank."""
    tables: bool | str = "auto"
    """graphddp's ``sparse_embedding_grads``: ``"auto"`` (the default: rows where they pay on the link measured at
    construction), True (rows wherever they apply) or False (dense,
    as PyTorch's DDP reduces them)."""
    interleave: str = "steps"
    """The order of the timed steps (see the module's docstring): ``"steps"``, one step of every mode in turn,
    every mode alive at once; or ``"modes"``, ``--steps`` of one mode in a row, each mode built afresh."""
    device: str = "cpu"
    backend: str = "auto"
    """The ranks' process group: ``auto`` (NCCL on CUDA, gloo on the CPU), ``gloo`` or ``nccl`` (CUDA only). With
    one GPU, ``gloo`` is how two ranks run on CUDA tensors (they share the GPU; NCCL wants one GPU per rank): the
    per-bucket path of both DDPs, which at one NCCL rank graphddp skips (it sends nothing, ``LocalReduction``)."""
    allocator: str = "system"
    """The ranks' CPU memory allocator: ``system`` or ``retain`` (``bench.allocator``)."""
    out: str = "bench-overhead"

    def __post_init__(self) -> None:
        for name in ("width", "layers", "vocab", "seq", "batch", "steps", "rounds", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"--world-sizes must be positive, got {self.world_sizes}")
        if self.cap_mb < 1:
            raise ValueError(f"--cap-mb must be >= 1 (PyTorch's DDPOptimizer asserts a first bucket of 1 MiB at least), got {self.cap_mb}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "gpt" and self.width % 32:
            raise ValueError(f"--width must be a multiple of 32 (heads of 32), got {self.width}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL reduces CUDA tensors only); on the CPU the bench runs gloo")
        allocator_env(self.allocator)  # raises on an unknown allocator
        if self.interleave not in INTERLEAVINGS:
            raise ValueError(f"--interleave must be one of {', '.join(INTERLEAVINGS)}, got {self.interleave!r}")

    @property
    def process_group_backend(self) -> str:
        """The backend the ranks' default group is made with (``backend``, ``auto`` resolved for ``device``)."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def caps(self) -> BucketCaps:
        """The caps both DDPs run at, as graphddp's planner takes them: every bucket ``cap_mb``, ramps off."""
        return BucketCaps.from_mb(self.cap_mb, self.cap_mb, self.cap_mb, ramps=False)

    def check_gpus(self, gpus: int) -> None:
        """Raises ``ValueError`` when ``device`` is CUDA and ``gpus`` GPUs cannot hold the ranks: none at all, or
        fewer than the largest world size on NCCL (a GPU per rank)."""
        if self.device != "cuda":
            return
        if gpus == 0:
            raise ValueError("--device cuda, but no GPU is visible to torch (torch.cuda.device_count() is 0)")
        if self.process_group_backend == "nccl" and max(self.world_sizes) > gpus:
            raise ValueError(
                f"--world-sizes {max(self.world_sizes)} on NCCL needs {max(self.world_sizes)} GPUs, this machine has {gpus}; "
                "--backend gloo runs the ranks on CUDA tensors sharing the GPUs"
            )

    def modes(self, world_size: int) -> list[str]:
        """The modes a run at ``world_size`` times, in the order each round times them."""
        def timed(modes: tuple[str, ...]) -> list[str]:  # one rank has no link to send beside
            return [m for m in modes if world_size > 1 or m not in LINK_MODES]

        return timed(EAGER_MODES) + [f"{m}:{inner}" for inner in self.inners for m in timed(COMPILED_MODES)]


def build_model(o: OverheadOptions) -> torch.nn.Module:
    from graphddp.tools.workloads import GPT, MLP, GPTConfig

    torch.manual_seed(0)
    if o.model == "mlp":
        return MLP(sizes=(o.width,) * (o.layers + 1))
    return GPT(GPTConfig(vocab_size=o.vocab, block_size=o.seq, n_layer=o.layers, n_head=o.width // 32, n_embd=o.width))


def batch_of(o: OverheadOptions, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step of ``rank`` trains on, ``model(x, y)`` a loss: tokens and next tokens (``gpt``), or
    ``batch * seq`` rows of ``width`` features and a class each (``mlp``)."""
    g = torch.Generator().manual_seed(100 + rank)
    if o.model == "mlp":
        rows = o.batch * o.seq
        x, y = torch.randn(rows, o.width, generator=g), torch.randint(0, o.width, (rows,), generator=g)
        return x.to(o.device), y.to(o.device)
    idx = torch.randint(0, o.vocab, (o.batch, o.seq + 1), generator=g).to(o.device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def build_mode(mode: str, o: OverheadOptions, *, isolated: bool = False) -> tuple[torch.nn.Module, Any]:
    """``(what a step calls, the DDP module or None)`` for ``mode`` (``name`` or ``name:inner``); ``bound``'s
    link is added by ``measure`` (``link_beside``). ``isolated``: the model's compiled code is its own
    (``isolated_model``)."""
    import graphddp

    name, _, inner = mode.partition(":")
    model = build_model(o)
    model = (isolated_model(model, mode) if isolated else model).to(o.device)
    device_ids = [torch.cuda.current_device()] if o.device == "cuda" else None
    ddp: Any = None
    if name.startswith("torch"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=o.cap_mb)
    elif name.startswith("graphddp"):
        cap = o.cap_mb
        ddp = graphddp.DDP(
            model, device_ids=device_ids, bucket_cap_mb=cap, first_bucket_cap_mb=cap, last_bucket_cap_mb=cap, bucket_ramps=False,
            sparse_embedding_grads=o.tables,
        )  # fmt: skip
    wrapped = ddp if ddp is not None else model
    if not inner:
        return wrapped, ddp
    reduction = "split" if name.endswith("-split") else "auto"
    backend = graphddp.backend(inner, reduction=reduction) if name.startswith("graphddp") else inner
    return torch.compile(wrapped, backend=backend), ddp


class CallCounter:
    """Counts Python function calls in every thread a backward runs on (autograd's device threads included)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1  # the GIL serialises the increments; threads add up

    def count_backward(self, loss: torch.Tensor) -> int:
        """``loss.backward()``, profiled; returns the calls it made, the counter's own prehook included (one call
        per backward, the same in every mode: compare counts, as the added calls do)."""
        self.calls = 0
        main = threading.get_ident()

        def start_here(*_: Any) -> None:  # runs on the thread that runs the graph's first node
            if threading.get_ident() != main:
                sys.setprofile(self)
                torch.autograd.Variable._execution_engine.queue_callback(lambda: sys.setprofile(None))

        handle = loss.grad_fn.register_prehook(start_here) if loss.grad_fn is not None else None
        sys.setprofile(self)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
            if handle is not None:
                handle.remove()
        return self.calls


def run_rank(rank: int, world_size: int, port: int, o: OverheadOptions, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(o.threads)
    if o.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import_before_init()  # Note [The default group outlives destroy_process_group]
    dist.init_process_group(o.process_group_backend, rank=rank, world_size=world_size)
    try:
        results.put((rank, measure(o, rank)))
    finally:
        dist.destroy_process_group()


def measure(o: OverheadOptions, rank: int) -> dict[str, Any]:
    """Every mode, round by round, in the order ``o.interleave`` names: step times (this rank), and the calls of
    one backward (last round)."""
    x, y = batch_of(o, rank)
    modes = o.modes(dist.get_world_size())
    record: dict[str, Any] = {m: {"times_s": [], "cpu_s": [], "other_threads_cpu_s": [], "page_faults": [], "compiles_while_timed": 0}
                             for m in modes}  # fmt: skip
    rounds = _rounds_of_steps if o.interleave == "steps" else _rounds_of_modes
    rounds(o, modes, x, y, record)
    return record


def _rounds_of_modes(o: OverheadOptions, modes: list[str], x: torch.Tensor, y: torch.Tensor, record: dict[str, Any]) -> None:
    """``--interleave modes``: one mode alive at a time, built afresh each round, its steps timed in a row."""
    for r in range(o.rounds):
        for mode in modes:
            torch._dynamo.reset()
            prepared = PreparedMode.build(mode, o, x, y, isolated=False)
            prepared.warm_up(o)
            dist.barrier()
            for _ in range(o.steps):
                prepared.time_one(o, record[mode])
            prepared.end_round(record[mode], last=r == o.rounds - 1)
            del prepared


def _rounds_of_steps(o: OverheadOptions, modes: list[str], x: torch.Tensor, y: torch.Tensor, record: dict[str, Any]) -> None:
    """``--interleave steps``: every mode alive at once, one step of each in turn, a barrier before each."""
    with shared_frames(len(modes)):
        for r in range(o.rounds):
            torch._dynamo.reset()
            _one_round_of_steps(o, modes, x, y, record, last=r == o.rounds - 1)


def _one_round_of_steps(o: OverheadOptions, modes: list[str], x: torch.Tensor, y: torch.Tensor, record: dict[str, Any], *, last: bool) -> None:
    """One round of ``_rounds_of_steps``: its modes live only here, so none outlives the round (a loop variable
    kept the last one alive while the next round built all of its own)."""
    prepared = {mode: PreparedMode.build(mode, o, x, y, isolated=True) for mode in modes}
    for p in prepared.values():
        p.warm_up(o)
    for k in range(o.steps):
        for mode in pass_order(modes, k):
            dist.barrier()
            prepared[mode].time_one(o, record[mode])
    for mode, p in prepared.items():
        p.end_round(record[mode], last=last)


@dataclasses.dataclass
class PreparedMode:
    """One mode, built: the step it times and what its record needs."""

    step: Callable[..., int | None]
    ddp: Any
    params: int
    buckets: int | None = None
    """A link mode's collectives per step (a DDP mode's come from the DDP)."""

    @classmethod
    def build(cls, mode: str, o: OverheadOptions, x: torch.Tensor, y: torch.Tensor, *, isolated: bool) -> PreparedMode:
        step_model, ddp = build_mode(mode, o, isolated=isolated)
        opt = torch.optim.SGD(step_model.parameters(), lr=1e-3)
        step = functools.partial(one_step, step_model, opt, x, y)
        name = mode.partition(":")[0]
        buckets = None
        if name in AS_READY:  # cut over the ready order of a first backward, as both DDPs rebuild theirs
            order = ready_order(step_model, lambda: step_model(x, y).backward())
            step_model.zero_grad(set_to_none=True)
            layout, sender = AS_READY[name]
            as_ready = sender(bucket_layout(step_model, order, layout, o.cap_mb), o.device)
            step, buckets = functools.partial(as_ready.step, step), len(as_ready.buffers)
        elif name in LINK_MODES:
            buffers = dense_bucket_buffers(step_model, o.caps, o.device)  # at the caps the DDP modes run
            step = functools.partial(link_beside, buffers, step, from_backward=name in FROM_BACKWARD)
            buckets = len(buffers)
        return cls(step, ddp, sum(1 for p in step_model.parameters() if p.requires_grad), buckets)

    def warm_up(self, o: OverheadOptions) -> None:
        for _ in range(1 + o.warmup):  # the first compiles
            self.step()
        _sync(o)

    def time_one(self, o: OverheadOptions, record: dict[str, Any]) -> None:
        """One timed step, under the next of ``STACK_SHIFTS`` extra frames (the module's docstring says why)."""
        shift = STACK_SHIFTS[len(record["times_s"]) % len(STACK_SHIFTS)]
        compiled = graphs_compiled()
        faults = minor_page_faults()
        start, cpu, here = time.perf_counter(), time.process_time(), time.thread_time()
        at_depth(shift, self.step)
        _sync(o)
        here = time.thread_time() - here  # read inside the process clock's interval, so the difference is >= 0
        record["page_faults"].append(minor_page_faults() - faults)
        record["cpu_s"].append(time.process_time() - cpu)
        record["times_s"].append(time.perf_counter() - start)
        record["other_threads_cpu_s"].append(record["cpu_s"][-1] - here)
        record["compiles_while_timed"] += graphs_compiled() - compiled

    def end_round(self, record: dict[str, Any], *, last: bool) -> None:
        """After a round's timed steps: the parameter count, and in the ``last`` round the calls of one backward."""
        if last:
            self.count_calls(record)
        record["params"] = self.params

    def count_calls(self, record: dict[str, Any]) -> None:
        record["backward_calls"] = self.step(CallCounter())
        if self.buckets is not None:
            record["buckets"] = self.buckets
        if self.ddp is not None:
            record["buckets"] = bucket_count(self.ddp)
            if hasattr(self.ddp, "bucket_plan"):
                record["reduction"] = reduction_ran(self.ddp)
                # "auto" decides on the link measured at construction, a close call over loopback that can go either
                # way from one run to the next: a run's table says which way it went.
                record["rows"] = list(self.ddp.bucket_plan.row_sparse_tables)


def at_depth(frames: int, fn: Callable[[], Any]) -> Any:
    """``fn()``, called under ``frames`` more Python frames of this function."""
    return at_depth(frames - 1, fn) if frames else fn()


def _sync(o: OverheadOptions) -> None:
    if o.device == "cuda":
        torch.cuda.synchronize()


def bucket_count(ddp: Any) -> int | None:
    """Buckets a DDP reduces per step, each from the DDP's own record: the bench runs both at the same caps, ramps
    off for graphddp, and both then close a bucket once it holds its cap or more (PyTorch's layout), so the
    counts agree (10 for the bench GPT at 1 MiB)."""
    if hasattr(ddp, "bucket_plan"):
        return len(ddp.bucket_plan.buckets)
    logged = ddp._get_ddp_logging_data()  # PyTorch's DDP: its own record of the buckets it rebuilt
    sizes = logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or ""
    return len(sizes.split(",")) if sizes else None


def link_beside(
    buffers: list[torch.Tensor], step: Callable[..., int | None], count: CallCounter | None = None, *, from_backward: bool = False
) -> int | None:
    """``bound``: every bucket's all-reduce issued before ``step`` (the step without DDP), or, ``from_backward``
    (``bound-backward``), once its forward has returned; waited for after the step."""
    waits: list[Callable[[], None]] = []

    def issue() -> None:
        waits.append(all_reduce_every(buffers))

    if not from_backward:
        issue()
    calls = step(count, before_backward=issue if from_backward else None)
    waits.pop()()
    return calls


def one_step(model: Callable[..., torch.Tensor], opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             count: CallCounter | None = None, *, before_backward: Callable[[], None] | None = None) -> int | None:
    """Forward, ``before_backward``, backward (its Python calls counted when ``count`` is given), optimizer step."""
    loss = model(x, y)
    if before_backward is not None:
        before_backward()
    calls = count.count_backward(loss) if count is not None else loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return calls


def summarise(o: OverheadOptions, world_size: int, per_rank: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode: the median step over ranks' step times (each step: the slowest rank), what it adds over
    its baseline, its CPU time (each rank's median step, averaged over the ranks) and what that adds, the part of
    it on threads other than the step's own (the same way), and the backward's Python calls (rank 0) and what
    they add.

    The ratios against PyTorch's DDP are also taken round by round (``added_vs_torch_rounds``): each round times
    every mode back to back, so a ratio within one round is not moved by the machine's drift between rounds; their
    median and spread are what a claim about the ratio may rest on."""
    rows = []
    for mode in o.modes(world_size):
        times = [max(per_rank[r][mode]["times_s"][i] for r in per_rank) for i in range(len(per_rank[0][mode]["times_s"]))]
        rounds = [statistics.median(times[i : i + o.steps]) for i in range(0, len(times), o.steps)]
        rows.append({"mode": mode, "step_s": statistics.median(times), "round_step_s": rounds,
                     "cpu_s": _mean_of_medians(per_rank, mode, "cpu_s"),
                     "other_threads_cpu_s": _mean_of_medians(per_rank, mode, "other_threads_cpu_s"),
                     "page_faults": _mean_of_medians(per_rank, mode, "page_faults"),
                     "backward_calls": per_rank[0][mode].get("backward_calls"),
                     "buckets": per_rank[0][mode].get("buckets"), "params": per_rank[0][mode]["params"],
                     "reduction": per_rank[0][mode].get("reduction"), "rows": per_rank[0][mode].get("rows"),
                     "compiles_while_timed": sum(per_rank[r][mode].get("compiles_while_timed", 0) for r in per_rank)})  # fmt: skip
    by_mode = {row["mode"]: row for row in rows}
    for row in rows:
        name, _, inner = row["mode"].partition(":")
        if (baseline := baseline_of(name)) is not None:
            base = by_mode[baseline + (f":{inner}" if inner else "")]
            row["added_s"] = row["step_s"] - base["step_s"]
            row["round_added_s"] = [t - b for t, b in zip(row["round_step_s"], base["round_step_s"], strict=True)]
            row["added_calls"] = row["backward_calls"] - base["backward_calls"]
            row["added_cpu_s"] = row["cpu_s"] - base["cpu_s"] if row["cpu_s"] is not None and base["cpu_s"] is not None else None
            if row["page_faults"] is not None and base["page_faults"] is not None:
                row["added_page_faults"] = row["page_faults"] - base["page_faults"]
    for row in rows:
        name, _, inner = row["mode"].partition(":")
        if (peer := torch_peer_of(name)) is not None:
            torch_row = by_mode[peer + (f":{inner}" if inner else "")]
            row["step_vs_torch"] = row["step_s"] / torch_row["step_s"]
            row["added_vs_torch"] = row["added_s"] / torch_row["added_s"] if torch_row["added_s"] > 0 else None
            row["added_vs_torch_rounds"] = [
                ours / theirs if theirs > 0 else None
                for ours, theirs in zip(row["round_added_s"], torch_row["round_added_s"], strict=True)
            ]  # None: PyTorch's DDP came out no slower than no DDP in that round (noise), so no ratio
    return [dict(row, world_size=world_size) for row in rows]


def _mean_of_medians(per_rank: dict[int, dict[str, Any]], mode: str, key: str) -> float | None:
    """Each rank's median of ``mode``'s ``key`` samples, averaged over the ranks (None where none was recorded)."""
    medians = [statistics.median(per_rank[r][mode][key]) for r in per_rank if per_rank[r][mode].get(key)]
    return statistics.fmean(medians) if medians else None


def round_spread(ratios: list[float | None] | None) -> str:
    """``median (min-max, n of N)`` of the per-round ratios that exist, or '' where none does."""
    if not ratios:
        return ""
    known = [r for r in ratios if r is not None]
    if not known:
        return f"(0 of {len(ratios)})"
    return f"{statistics.median(known):.2f} ({min(known):.2f}-{max(known):.2f}, {len(known)} of {len(ratios)})"


def render(rows: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "" if v is None else f"{v * 1e3:.2f}"

    def ratio(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    def count(v: float | None) -> str:
        return "" if v is None else f"{v:.0f}"

    table = [
        [r["world_size"], r["mode"], ms(r["step_s"]), ms(r.get("added_s")), ratio(r.get("step_vs_torch")),
         ratio(r.get("added_vs_torch")), round_spread(r.get("added_vs_torch_rounds")), ms(r.get("cpu_s")), ms(r.get("added_cpu_s")),
         ms(r.get("other_threads_cpu_s")), count(r.get("page_faults")), count(r.get("added_page_faults")), r["backward_calls"],
         r.get("added_calls", ""), r.get("buckets") or "", r.get("reduction") or "", ", ".join(r.get("rows") or ())]
        for r in rows
    ]  # fmt: skip
    headers = ["ranks", "mode", "step ms", "added ms", "step / torch's", "added / torch's", "per round: median (range)", "cpu ms",
               "added cpu ms", "other threads cpu ms", "page faults", "added faults", "py calls (bwd)", "added calls", "buckets", "reduction", "tables as rows"]  # fmt: skip
    return tabulate(table, headers=headers, disable_numparse=True)


def spawn_and_collect(fn: Callable[..., None], world_size: int, *args: Any) -> dict[int, Any]:
    """Spawn ``fn(rank, world_size, *args, results)`` on ``world_size`` processes; each puts ``(rank, record)`` into
    ``results``. The records are read *while* the ranks run: a record larger than a pipe's buffer (64 KiB; every
    mode's per-step figures of a long run) blocks its rank in ``put`` until it is read, so reading only after the
    ranks exit hangs both sides (seen: 19 modes x 4 rounds). A rank that fails raises here, as ``join`` does."""
    results = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(fn, args=(world_size, *args, results), nprocs=world_size, join=False, start_method="spawn")
    per_rank: dict[int, Any] = {}
    exited = False
    while not exited:
        exited = ranks.join(timeout=0.5)  # True once every rank exited cleanly (a failed one raises)
        while not results.empty():  # after the last exit too: what the ranks put before it
            rank, record = results.get()
            per_rank[rank] = record
    assert len(per_rank) == world_size, f"ranks {sorted(set(range(world_size)) - set(per_rank))} exited without a record"
    return per_rank


def run(o: OverheadOptions) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    Path(o.out).mkdir(parents=True, exist_ok=True)
    for world_size in o.world_sizes:
        print(f"bench.overhead: {world_size} rank(s) on {o.device} ({o.process_group_backend}), {len(o.modes(world_size))} modes x "
              f"{o.rounds} rounds x {o.steps} steps, interleaved by {o.interleave}", flush=True)
        with mock.patch.dict(os.environ, allocator_env(o.allocator)):  # read by each rank's C library as it starts
            per_rank = spawn_and_collect(run_rank, world_size, free_port(), o)
        rows += summarise(o, world_size, per_rank)
        Path(o.out, "overhead.json").write_text(json.dumps({"options": dataclasses.asdict(o), "rows": rows}, indent=1))
    return rows



def main(argv: list[str] | None = None) -> int:
    d = OverheadOptions()
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default=",".join(map(str, d.world_sizes)), help="comma-separated, e.g. 1,2")
    p.add_argument("--inners", default=",".join(d.inners), help="inner compilers of the compiled modes, comma-separated ('' for eager only)")
    p.add_argument("--model", choices=MODELS, default=d.model, help="gpt (GPT-2-small's structure) or mlp (--layers linear layers of --width)")
    for name in ("width", "layers", "vocab", "seq", "batch", "steps", "rounds", "warmup", "threads"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    p.add_argument("--cap-mb", type=float, default=d.cap_mb, help="every bucket cap of both DDPs, in MiB (>= 1)")
    p.add_argument(
        "--tables", choices=("auto", "rows", "dense"), default="auto",
        help="graphddp's sparse_embedding_grads: auto (rows where they pay), rows (True), dense (False, as PyTorch)",
    )  # fmt: skip
    p.add_argument("--dense-tables", dest="tables", action="store_const", const="dense", help="--tables dense")
    p.add_argument(
        "--interleave", choices=INTERLEAVINGS, default=d.interleave,
        help="steps (default): one step of each mode in turn; modes: each mode's steps in a row, built afresh each round",
    )  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default=d.backend,
        help="the ranks' process group: auto (NCCL on CUDA, gloo on the CPU); gloo on CUDA lets ranks share one GPU",
    )  # fmt: skip
    p.add_argument("--allocator", choices=ALLOCATORS, default=d.allocator, help="the ranks' CPU allocator (bench/allocator.py)")
    p.add_argument("--out", default=d.out)
    args = p.parse_args(argv)
    try:
        o = OverheadOptions(
            world_sizes=tuple(int(w) for w in args.world_sizes.split(",") if w.strip()),
            inners=tuple(i.strip() for i in args.inners.split(",") if i.strip()),
            **{n: getattr(args, n) for n in ("model", "width", "layers", "vocab", "seq", "batch", "steps", "rounds", "warmup", "threads", "cap_mb", "interleave", "device", "backend", "allocator", "out")},
            tables={"auto": "auto", "rows": True, "dense": False}[args.tables],
        )  # fmt: skip
        o.check_gpus(torch.cuda.device_count())
    except ValueError as e:
        p.error(str(e))
    rows = run(o)
    print(render(rows))
    for row in rows:
        if row["compiles_while_timed"]:
            print(f"bench.overhead: {row['mode']} at {row['world_size']} rank(s) compiled {row['compiles_while_timed']} "
                  "graph(s) in timed steps (summed over ranks): its times include compiling")
    print(f"bench.overhead: wrote {Path(o.out, 'overhead.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
