"""The benchmark's modes: one small object each, all with ``build(model) -> step_fn``.

Every mode trains the same workload (same seed, data, optimizer); only how gradients are synchronised differs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import graphddp
from graphddp.ddp import BucketOptions
from graphddp.passes import BucketCaps, ParamSpec, plan_buckets

MODES = ("local", "local-compiled", "comm", "bound", "naive", "torch-eager", "torch-compiled", "graphddp-eager", "graphddp-compiled")
"""The default modes (``local-compiled``: ``local`` under ``torch.compile`` with the inner compiler, the compute the
compiled modes are measured and predicted against: ``compute_baseline``; ``bound``: ``local-compiled`` with
``comm``'s all-reduces beside it from the step's first instant, the testbed's limit measured). A graphddp mode also
takes variants: ``graphddp-compiled@16`` (``bucket_cap_mb=16``), ``graphddp-compiled@auto`` (every cap ``"auto"``,
Note [Automatic caps]), ``graphddp-compiled+step`` (each bucket's optimizer step inside backward, Note [Optimizer overlap]),
``graphddp-compiled+ch2`` (``channels=2``, buckets on two process groups in turn, Note [Channels]),
``graphddp-compiled+dense`` (every table dense); ``graphddp-eager@auto+step`` combines them."""

KNOWN_MODES = (*MODES, "bound-backward")
"""Every mode, the default ones (``MODES``) and those named only on request: ``bound-backward`` is ``bound`` with the
all-reduces issued when the backward starts instead of the step: what no DDP can beat (``_bound_backward``)."""

NO_DDP = ("local", "local-compiled", "bound", "bound-backward")
"""The modes that compute with no DDP (``bound``, ``bound-backward`` with the link busy beside it): what the DDP modes
are measured against. The step cost model predicts none of them, and none has communication of its own to expose."""


@dataclasses.dataclass(frozen=True)
class ModeName:
    """A mode as the command line names it: the base mode and its variant."""

    base: str
    cap: str | None = None
    """``bucket_cap_mb`` for this mode (a number of MiB, or ``auto`` for every cap)."""
    step_in_backward: bool = False
    split: bool = False
    """``graphddp-compiled+split``: the backend's ``reduction="split"`` (Note [In-graph reduction])."""

    channels: int | None = None
    """``graphddp-compiled+ch4``: ``channels=4`` (Note [Channels]); None: the configuration's."""
    dense: bool = False
    """``graphddp-compiled+dense``: ``sparse_embedding_grads=False``, every table reduced dense (Note [Row-sparse
    gradients]); compiled, a graph with a row-sparse table may then reduce in-graph."""

    @classmethod
    def parse(cls, name: str) -> ModeName:
        rest, *variants = name.split("+")
        base, _, cap = rest.partition("@")
        if base not in KNOWN_MODES:
            raise ValueError(
                f"unknown mode {name!r}; choose from {', '.join(KNOWN_MODES)} (graphddp modes also as MODE@CAP_MB, MODE@auto, "
                "MODE+step, MODE+chK; graphddp-compiled also as MODE+split)"
            )
        unknown = [v for v in variants if v not in ("split", "step", "dense") and not re.fullmatch(r"ch[1-9][0-9]*", v)]
        if unknown:
            raise ValueError(f"mode {name!r}: unknown variant +{unknown[0]} (+step, +split, +dense, +chK with K >= 1)")
        split, step, dense = "split" in variants, "step" in variants, "dense" in variants
        channels = next((int(v[2:]) for v in variants if v.startswith("ch")), None)
        if (cap or step or channels or dense) and not base.startswith("graphddp"):
            raise ValueError(f"mode {name!r}: only graphddp modes take @CAP, +step, +dense or +chK")
        if split and base != "graphddp-compiled":
            raise ValueError(f"mode {name!r}: only graphddp-compiled takes +split")
        if cap and cap != "auto":
            try:
                float(cap)
            except ValueError:
                raise ValueError(f"mode {name!r}: the cap after @ must be a number of MiB or auto") from None
        return cls(base, cap or None, step, split, channels, dense)

    def config(self, cfg: ModeConfig) -> ModeConfig:
        if self.channels is not None:
            cfg = dataclasses.replace(cfg, channels=self.channels)
        if self.dense:
            cfg = dataclasses.replace(cfg, sparse_embedding_grads=False)
        if self.cap == "auto":
            return dataclasses.replace(cfg, bucket_cap_mb="auto", first_bucket_cap_mb="auto", last_bucket_cap_mb="auto")
        if self.cap is not None:
            return dataclasses.replace(cfg, bucket_cap_mb=float(self.cap))
        return cfg


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeConfig(BucketOptions):
    """What every mode shares. The caps are graphddp's and the ``comm`` mode's; PyTorch's DDP takes
    ``bucket_cap_mb`` only (given explicitly, torch 2.13 makes it its first bucket's cap too; no ramps)."""

    inner: str = "inductor"
    """Inner compiler of both compiled modes."""


Step = Callable[..., None]
"""``step(batch, log=None)``: one iteration; every mode marks the start of its phases in ``log`` (forward,
backward, optimizer, ...; ``end`` last). With a graphddp Reducer whose events go to the same log, the timeline
gets the buckets' events too."""


def build(mode: str, model: nn.Module, cfg: ModeConfig) -> tuple[Step, Any]:
    """``(step, handle)``: ``step(batch)`` runs one iteration; ``handle`` is the DDP module, when there is one."""
    name = ModeName.parse(mode)
    mode, cfg = name.base, name.config(cfg)
    step_in_backward = name.step_in_backward
    builders: dict[str, Callable[[nn.Module, ModeConfig], tuple[Step, Any]]] = {
        "local": _local,
        "local-compiled": lambda m, c: _trained(m, compile_with=c.inner),
        "comm": _comm_only,
        "bound": _bound,
        "bound-backward": _bound_backward,
        "naive": _naive,
        "torch-eager": lambda m, c: _trained(nn.parallel.DistributedDataParallel(m, bucket_cap_mb=c.bucket_cap_mb)),
        "torch-compiled": lambda m, c: _trained(
            nn.parallel.DistributedDataParallel(m, bucket_cap_mb=c.bucket_cap_mb), compile_with=c.inner
        ),
        "graphddp-eager": lambda m, c: _trained(graphddp.DDP(m, **c.bucket_kwargs()), step_in_backward=step_in_backward),
        "graphddp-compiled": lambda m, c: _trained(
            graphddp.DDP(m, **c.bucket_kwargs()),
            graphddp_backend=graphddp.backend(c.inner, reduction="split" if name.split else "auto"),
            step_in_backward=step_in_backward,
        ),
    }
    if mode not in builders:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(KNOWN_MODES)}")
    return builders[mode](model, cfg)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every mode trains with (and ``bench.worker.chunked_step_ratio`` calibrates)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


Beside = Callable[[], Callable[[Any], None]]
"""Work a step starts beside it, returning what waits for it after the optimizer (``_bound``: the link)."""


def _trained(
    ddp: nn.Module, compile_with: str | None = None, graphddp_backend: Any = None, step_in_backward: bool = False,
    beside: Beside | None = None, beside_from: str = "forward",
) -> tuple[Step, Any]:
    """``beside``, when given, starts at the start of the phase ``beside_from`` names (``forward`` or ``backward``)."""
    assert beside_from in ("forward", "backward"), beside_from
    opt = optimizer_for(ddp)
    if step_in_backward:  # each bucket's update runs inside backward; opt.step() below then has nothing to do
        ddp.step_in_backward(opt)
    model = ddp
    if graphddp_backend is not None:
        model = torch.compile(ddp, backend=graphddp_backend)
    elif compile_with is not None:
        model = torch.compile(ddp, backend=compile_with)

    def step(batch: tuple, log: Any = None) -> None:
        wait_beside = beside() if beside is not None and beside_from == "forward" else None
        _mark(log, "forward")
        loss = model(*batch)
        if beside is not None and beside_from == "backward":
            wait_beside = beside()
        _mark(log, "backward")  # for DDP modes: until the averaged gradients are in .grad
        loss.backward()
        _mark(log, "optimizer")
        if not step_in_backward:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if wait_beside is not None:
            wait_beside(log)
        _mark(log, "end")

    return step, ddp


def compute_baseline(mode: str, measured: Any) -> str:
    """The no-DDP mode whose compute ``mode`` is measured and predicted against: ``local-compiled`` for a compiled
    mode where the run measured it (Inductor's kernels are not eager's: for gpt its forward was ~9 % shorter),
    else ``local``. ``measured``: the run's modes (a container of names)."""
    compiled = ModeName.parse(mode).base.endswith("-compiled")
    return "local-compiled" if compiled and "local-compiled" in measured else "local"


def reduction_ran(ddp: Any) -> str:
    """What a graphddp mode ran: ``eager``, ``in_graph``, or ``split`` with the reason the backend gave."""
    target = ddp.reducer.compile_target
    if not target.reductions:
        return "eager"
    if target.gate.in_graph_forwards:
        return "in_graph"
    return "; ".join(sorted({str(r) for r in target.reductions}))


def _mark(log: Any, phase: str) -> None:
    """The start of ``phase`` (``end``: the end of the iteration), when the caller records phases."""
    if log is not None:
        log.record(phase)


def _local(model: nn.Module, cfg: ModeConfig) -> tuple[Step, Any]:
    """Compute only: the same work with no communication at all (the lower bound on compute)."""
    return _trained(model)


def _naive(model: nn.Module, cfg: ModeConfig) -> tuple[Step, Any]:
    """All-reduce every gradient after backward, one by one: no buckets, no overlap (seed 002's baseline)."""
    opt = optimizer_for(model)
    world = dist.get_world_size()

    def step(batch: tuple, log: Any = None) -> None:
        _mark(log, "forward")
        loss = model(*batch)
        _mark(log, "backward")
        loss.backward()
        _mark(log, "allreduce")
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        _mark(log, "optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        _mark(log, "end")

    return step, None


def _comm_only(model: nn.Module, cfg: ModeConfig) -> tuple[Step, Any]:
    """The buckets' all-reduces alone, no compute (the lower bound on communication)."""
    buffers = dense_bucket_buffers(model, cfg.caps)

    def step(batch: tuple, log: Any = None) -> None:
        _mark(log, "allreduce")
        all_reduce_every(buffers)()
        _mark(log, "end")

    return step, None


def _bound(model: nn.Module, cfg: ModeConfig, *, start: str = "forward") -> tuple[Step, Any]:
    """``local-compiled``'s step with ``comm``'s all-reduces issued at its first instant, beside it: every byte a
    dense DDP sends, sent as early as no DDP can (no gradient exists before backward), on the CPU the compute uses.
    No schedule of these bytes beats it, so it is the testbed's limit measured rather than modelled
    (``bench.matrix.testbed_limit``): what gloo's thread takes from this workload's own compute is in it. It bounds
    a DDP that sends at least the dense bytes (the matrix's tied GPTs send their part and rows, more); one that
    sends fewer, an untied table as rows, may beat it."""
    buffers = dense_bucket_buffers(model, cfg.caps)

    def send() -> Callable[[Any], None]:
        wait_all = all_reduce_every(buffers)

        def wait(log: Any) -> None:
            _mark(log, "allreduce")  # what of the link outlasts the compute
            wait_all()

        return wait

    step, _ = _trained(model, compile_with=cfg.inner, beside=send, beside_from=start)
    return step, None


def _bound_backward(model: nn.Module, cfg: ModeConfig) -> tuple[Step, Any]:
    """``_bound`` with the all-reduces issued when the backward starts, once the forward has returned: the earliest
    a DDP's first byte can leave, since no gradient exists before. Every byte is then on the link from that
    instant, beside the backward's compute, so no DDP that sends these bytes from its backward beats it. Where the
    link's thread costs the compute more beside the backward than beside the forward (two ranks sharing two CPUs,
    ``docs/benchmarks.md``), it is slower than ``bound``, and the difference is what the testbed's limit asks of a
    DDP that no DDP can give."""
    return _bound(model, cfg, start="backward")


def graphddp_buckets(named: Sequence[tuple[str, nn.Parameter]], caps: BucketCaps) -> list[list[nn.Parameter]]:
    """``named`` (in the order their gradients become ready) cut into buckets as graphddp's dense plan at ``caps``
    cuts them, bucket 0 first: the one layout ``dense_bucket_buffers`` and ``bench.as_ready`` send."""
    by_name = dict(named)
    plan = plan_buckets([ParamSpec.of(n, p) for n, p in named], caps=caps)
    return [[by_name[s.name] for s in b.params] for b in plan.buckets]


def torch_buckets(tensors: Sequence[torch.Tensor], bucket_cap_mb: float | None) -> list[list[int]]:
    """``tensors`` (in the order their gradients become ready; meta tensors will do) cut into buckets as PyTorch's
    DDP built with ``bucket_cap_mb`` cuts them once it rebuilt them from that order, as indices, bucket 0 first:
    ``bench.as_ready``'s ``torch`` layout and ``bench.predict``'s model of PyTorch's modes. PyTorch's own rules,
    not restated: its caps from its ``_BucketCapacityConfig`` (in torch 2.13 a ``bucket_cap_mb`` given explicitly
    is the first bucket's cap too, ``dist._DEFAULT_FIRST_BUCKET_BYTES`` only by default) and its cut from the
    function its Reducer calls, ``dist._compute_bucket_assignment_by_size``, which closes a bucket once it holds its
    cap *or more*: graphddp's planner does so too without ramps (``BucketCaps.closes_over_cap``), and
    ``tests/one_process/test_torch_layout.py`` holds the two to the same buckets."""
    first, cap = _torch_caps_bytes(bucket_cap_mb)
    indices, _ = dist._compute_bucket_assignment_by_size(list(tensors), [first, cap], [False] * len(tensors))
    return sorted(indices, key=min)


def _torch_caps_bytes(bucket_cap_mb: float | None) -> tuple[int, int]:
    """PyTorch's DDP's (first bucket, bucket) caps in bytes for ``bucket_cap_mb``."""
    config = getattr(torch.nn.parallel.distributed, "_BucketCapacityConfig", None)
    if config is None:  # older torch: always a 1 MiB first bucket
        return dist._DEFAULT_FIRST_BUCKET_BYTES, int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    made = config.create(bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=None, use_python_reducer=False)
    return made.first_bucket_bytes_cap, made.bucket_bytes_cap


def dense_bucket_buffers(model: nn.Module, caps: BucketCaps, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """One zero buffer per bucket of graphddp's dense plan of ``model`` at ``caps`` (parameters in reverse order, as
    before the ready order is known), on ``device``: the bytes and collectives a dense DDP sends (``comm``,
    ``bound``, and ``bench.overhead``'s ``bound``)."""
    named = [(n, p) for n, p in reversed(list(model.named_parameters())) if p.requires_grad]
    return [
        torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=device) for b in graphddp_buckets(named, caps)
    ]


def all_reduce_every(buffers: list[torch.Tensor]) -> Callable[[], None]:
    """Issue every buffer's all-reduce now, in order; the returned call waits for them all."""
    works = [dist.all_reduce(buf, async_op=True) for buf in buffers]

    def wait() -> None:
        for w in works:
            w.wait()

    return wait
