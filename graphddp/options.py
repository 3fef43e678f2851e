"""What a ``graphddp.DDP`` is asked to do: its options, and PyTorch's constructor arguments translated into them.

``BucketOptions`` and ``DDPOptions`` are graphddp's own, validated once and never mutated (tools and the benchmark
build them too). ``from_torch_arguments`` takes the arguments of PyTorch's ``DistributedDataParallel`` constructor
as PyTorch 2.13 means them (its deprecations and warnings, its refusals for what graphddp does not implement) and
returns the options with the other pieces construction needs; ``trainable_parameters`` and ``device_of`` check the
module.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .passes import BucketCaps, CapsSearch
from .runtime.precision import FullPrecision, MixedPrecision
from .runtime.unused import ExpectAllUsed, SearchEveryIteration, StaticGraph

AUTO = "auto"
_CAP_FIELDS = ("bucket_cap_mb", "first_bucket_cap_mb", "last_bucket_cap_mb")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketOptions:
    """How gradients are bucketed and reduced, as users give it (caps in MiB); shared by ``DDPOptions`` and every
    tool that builds a DDP (demo, benchmark)."""

    bucket_cap_mb: float | str = 25
    """Cap of the buckets in the middle of backward, in MiB; ``"auto"``: chosen from the step cost model
    (Note [Automatic caps] in ``graphddp.passes.caps_choice``)."""
    first_bucket_cap_mb: float | str = 1
    """Cap of the first bucket, in MiB: small, so the first all-reduce starts early in backward; or ``"auto"``."""
    last_bucket_cap_mb: float | str = 1
    """Cap of the last bucket, in MiB: small, so little is left to all-reduce once backward is over; or
    ``"auto"``."""
    bucket_ramps: bool = True
    """Caps double from the first bucket's up to ``bucket_cap_mb`` and halve again down to the last bucket's
    (Note [Bucket ramps] in ``graphddp.passes.plan``); with them no bucket exceeds its cap unless one parameter
    alone does. False: PyTorch's layout, the first bucket's cap and then ``bucket_cap_mb`` to the end, each
    bucket closed once it holds its cap or more as PyTorch's Reducer closes it, so the same caps cut the same
    buckets as PyTorch's DDP (``BucketCaps.closes_over_cap``)."""
    bucket_cap_mb_list: tuple[float, ...] | None = None
    """Every bucket's cap in MiB, in ready order, the last repeating (PyTorch's ``bucket_cap_mb_list``); when
    given, the other caps and the ramps are not used, as PyTorch ignores ``bucket_cap_mb`` then."""
    sparse_embedding_grads: bool | str = AUTO
    """Reduce embedding tables' gradients as the rows some rank touched, and, compiled, send a tied table's other
    contributions early as parts of their own (Note [Row-sparse gradients] in ``graphddp.passes.row_sparse``). The
    result equals the dense all-reduce up to the order of floating-point sums. Applies to CPU buckets, several
    ranks and the default comm hook; elsewhere, and with False, every bucket is all-reduced dense. ``"auto"``:
    where the step cost model says rows pay on the link measured at construction (a fast link: dense; a slow one:
    rows; a compiled graph reduces in-graph either way); True: wherever they apply."""
    channels: int | str = 1
    """Process groups the buckets are reduced on in turn (bucket i on group ``i % channels``), so up to that many
    all-reduces are in flight at once; the groups beyond the DDP's own are made at construction, with its backend
    and timeout, and freed with the DDP (Note [Channels] in ``graphddp.runtime.channels``). ``"auto"``: as many as
    the step cost model says pay on the link measured at construction (1, 2 or 4)."""

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_ramps, bool):
            raise TypeError(f"bucket_ramps must be True or False, got {self.bucket_ramps!r}")
        if not isinstance(self.sparse_embedding_grads, bool) and self.sparse_embedding_grads != AUTO:
            raise TypeError(f"sparse_embedding_grads must be True, False or {AUTO!r}, got {self.sparse_embedding_grads!r}")
        if isinstance(self.channels, bool) or not isinstance(self.channels, (int, str)):
            raise TypeError(f"channels must be a whole number of process groups or {AUTO!r}, got {self.channels!r}")
        if isinstance(self.channels, str) and self.channels != AUTO:
            raise TypeError(f"channels must be a whole number of process groups or {AUTO!r}, got str {self.channels!r}")
        if isinstance(self.channels, int) and self.channels < 1:
            raise ValueError(f"channels must be at least 1 (1: every bucket on the DDP's own group), got {self.channels}")
        for field in _CAP_FIELDS:
            value = getattr(self, field)
            if isinstance(value, str) and value != AUTO:  # a type mistake, as any other non-number
                raise TypeError(f"{field} must be a number of MiB or {AUTO!r}, got str {value!r}")
        _ = self.caps  # raises on a bad cap

    @property
    def caps(self) -> BucketCaps:
        """The caps to plan with until an automatic choice is made (the defaults stand in for ``"auto"``)."""
        if self.bucket_cap_mb_list is not None:
            return BucketCaps.from_list_mb(self.bucket_cap_mb_list)
        defaults = {f.name: f.default for f in dataclasses.fields(BucketOptions)}
        fixed = [defaults[f] if v == AUTO else v for f, v in self._cap_fields().items()]
        return BucketCaps.from_mb(*fixed, ramps=self.bucket_ramps)

    @property
    def caps_search(self) -> CapsSearch | None:
        """Which caps are chosen automatically (None: none of them)."""
        fields = self._cap_fields()
        if AUTO not in fields.values() or self.bucket_cap_mb_list is not None:  # a list sets every cap
            return None
        bucket, first, last = (None if v == AUTO else float(v) for v in fields.values())
        return CapsSearch(bucket_mb=bucket, first_mb=first, last_mb=last, ramps=self.bucket_ramps, standing=self.caps)

    def _cap_fields(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _CAP_FIELDS}

    def bucket_kwargs(self) -> dict[str, Any]:
        """These options as ``graphddp.DDP`` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(BucketOptions)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPOptions(BucketOptions):
    """How a ``DistributedDataParallel`` synchronises; validated once, never mutated."""

    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before each forward."""
    find_unused_parameters: bool = False
    """Search the autograd graph after each forward for parameters that will get no gradient."""
    gradient_as_bucket_view: bool = False
    """Make ``param.grad`` a view into its bucket's flat buffer, saving one gradient-sized copy."""
    static_graph: bool = False
    """Promise that the set of used parameters never changes: search once, then skip the search."""
    check_replicas_every: int = 0
    """Compare the parameters' values across ranks before every this many training forwards and raise, naming the
    first that differs, when the replicas drifted apart (``graphddp.runtime.replicas``); 0: never. Forwards
    inside ``ddp.join()`` are not counted: a rank that joined takes no optimizer step until the join's end."""

    def __post_init__(self) -> None:
        for field in ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"graphddp.DDP: {field} must be True or False, got {value!r}")
        every = self.check_replicas_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"graphddp.DDP: check_replicas_every must be a whole number of forwards >= 0 (0: never), got {every!r}")
        super().__post_init__()

    def collective_lines(self, *, skip_all_reduce_unused_params: bool) -> list[str]:
        """The options that change which collectives a rank issues, as lines every rank must hold alike
        (``verify_same_params``)."""
        return [
            f"option buckets={self.caps} automatic={self.caps_search} channels={self.channels}",
            f"option find_unused_parameters={self.find_unused_parameters} static_graph={self.static_graph}",
            f"option forward_sync_buffers={self.broadcast_buffers} sparse_embedding_grads={self.sparse_embedding_grads}",
            f"option skip_all_reduce_unused_params={skip_all_reduce_unused_params} check_replicas_every={self.check_replicas_every}",
        ]

    def usage_policy(self) -> ExpectAllUsed | SearchEveryIteration | StaticGraph:
        if self.static_graph:
            return StaticGraph()
        if self.find_unused_parameters:
            return SearchEveryIteration()
        return ExpectAllUsed()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchArguments:
    """PyTorch's constructor arguments, checked and translated: what ``DistributedDataParallel.__init__`` keeps."""

    options: DDPOptions
    """How the DDP synchronises."""
    precision: FullPrecision | MixedPrecision
    """The policy for ``mixed_precision`` (Note [Mixed precision] in ``graphddp.runtime.precision``)."""
    process_group: dist.ProcessGroup
    """The group gradients are averaged over: the given one, the device mesh's, or the default group."""
    device_mesh: Any
    """The 1-D device mesh given (None: none)."""
    init_sync_buffers: bool
    """Whether construction broadcasts rank 0's buffers along with its parameters (when ``init_sync``)."""


def from_torch_arguments(
    *,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    process_group: dist.ProcessGroup | None,
    device_mesh: Any,
    bucket_cap_mb: float | str | None,
    check_reduction: bool,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    mixed_precision: Any,
    bucket_cap_mb_list: list[float] | None,
    first_bucket_cap_mb: float | str,
    last_bucket_cap_mb: float | str,
    bucket_ramps: bool,
    sparse_embedding_grads: bool | str,
    check_replicas_every: int = 0,
    channels: int | str = 1,
) -> TorchArguments:
    """The arguments of ``DistributedDataParallel.__init__`` (PyTorch's, then graphddp's own) as graphddp runs them.

    Called from ``__init__`` only: its warnings name the line that built the DDP (``stacklevel``)."""
    if check_reduction:  # as in PyTorch: a no-op, the Reducer always completes the reduction
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
            "using it.",
            FutureWarning,
            stacklevel=3,  # the caller of DistributedDataParallel.__init__
        )
    forward_sync, init_sync_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
    precision = MixedPrecision.of(mixed_precision)  # Note [Mixed precision] in graphddp.runtime.precision
    options = DDPOptions(
        bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        last_bucket_cap_mb=last_bucket_cap_mb,
        bucket_ramps=bucket_ramps,
        # PyTorch's: an empty list is no list (``if bucket_cap_mb_list:``)
        bucket_cap_mb_list=(tuple(bucket_cap_mb_list) or None) if isinstance(bucket_cap_mb_list, list) else bucket_cap_mb_list,
        sparse_embedding_grads=sparse_embedding_grads,
        broadcast_buffers=forward_sync,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        check_replicas_every=check_replicas_every,
        channels=channels,
    )
    group, mesh = _group_of(process_group, device_mesh)
    return TorchArguments(
        options=options, precision=precision, process_group=group, device_mesh=mesh, init_sync_buffers=init_sync_buffers
    )


def device_of(
    module: nn.Module,
    synced: list[tuple[str, nn.Parameter]],
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    rank: int,
) -> tuple[torch.device, list[int] | None]:
    """(the device of the ``synced`` parameters, the module's less the ignored ones, as PyTorch's DDP takes it;
    ``device_ids`` as PyTorch keeps them), checked against each other."""
    device = _single_device([p for _, p in synced], rank)
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules")  # PyTorch's check and words
    return device, _check_device_ids(device_ids, output_device, device, rank)


def trainable_parameters(synced: list[tuple[str, nn.Parameter]], rank: int) -> list[tuple[str, nn.Parameter]]:
    """The parameters the Reducer averages (of ``synced``: the module's, less the ignored ones); a module with none
    is refused, there being nothing to synchronise."""
    named = [(n, p) for n, p in synced if p.requires_grad]
    if not named:
        raise RuntimeError(  # PyTorch's type: scripts match on it
            f"[rank {rank}] graphddp.DDP: the module has no parameter that requires a gradient, so there "
            "is nothing to synchronise; do not wrap it."
        )
    return named


def _buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers before each forward, sync buffers at construction), with PyTorch 2.13's rules and warnings:
    ``broadcast_buffers`` is deprecated for ``forward_sync_buffers``, which never turns off the first sync."""
    if broadcast_buffers is not None:
        warnings.warn(
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is deprecated "
            "and its value is ignored when `forward_sync_buffers` is provided."
            if forward_sync_buffers is not None
            else "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
            "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init.",
            FutureWarning,
            stacklevel=4,  # the caller of DistributedDataParallel.__init__ (through from_torch_arguments)
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _group_of(process_group: dist.ProcessGroup | None, device_mesh: Any) -> tuple[dist.ProcessGroup, Any]:
    """The process group to reduce over: the given one, a 1-D device mesh's, or the default group."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is None:
        return (process_group if process_group is not None else dist.group.WORLD), None
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group(mesh_dim=0), device_mesh


def _single_device(params: list[nn.Parameter], rank: int) -> torch.device:
    devices = sorted({str(p.device) for p in params})
    if len(devices) != 1:
        raise ValueError(
            f"[rank {rank}] graphddp.DDP: the module's parameters live on several devices {devices}; "
            "graphddp.DDP supports single-device modules: one rank per device."
        )
    if params[0].is_meta:  # PyTorch fails too (Tensor.item() on a meta tensor); silently, graphddp would not sync
        raise RuntimeError(  # PyTorch's type
            f"[rank {rank}] graphddp.DDP: the module's parameters are on the meta device (deferred initialisation): there is nothing to "
            "broadcast, and parameters materialised later are new objects no hook of graphddp's would see. Materialise "
            "them first (module.to_empty(device=...) and initialise them), then wrap the module."
        )
    return params[0].device


def _check_device_ids(
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    device: torch.device,
    rank: int,
) -> list[int] | None:
    if device.type == "cpu":
        if device_ids or output_device:  # PyTorch's test: an empty list, or device 0, passes
            raise ValueError(
                f"[rank {rank}] graphddp.DDP: device_ids and output_device must be None for a module on the CPU, got "
                f"device_ids={device_ids}, output_device={output_device}"
            )
        return None
    if not device_ids:  # None or [], as PyTorch: the module's device
        return None
    if len(device_ids) != 1:
        raise ValueError(
            f"[rank {rank}] graphddp.DDP: device_ids must name the single device of this rank, got {device_ids}"
        )
    wanted = torch.device(device.type, device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
    if wanted != device:
        raise ValueError(
            f"[rank {rank}] graphddp.DDP: device_ids={device_ids} but the module is on {device}; move the "
            "module to its device before wrapping it."
        )
    return [wanted.index]
