"""``graphddp.DistributedDataParallel``: the module users wrap, with PyTorch's DDP API on graphddp's Reducer.

The wrapper owns what happens around the user's forward (buffer broadcast, join bookkeeping, arming the
Reducer); the Reducer (``graphddp.runtime.reducer``) owns everything that happens during backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .compiler import compile_target, dynamo_hook
from .compiler.backend import GraphDDPBackend, inner_compiler
from .passes import (
    BucketCaps,
    BucketPlan,
    CapsSearch,
    ParamSpec,
    embedding_tables,
    plan_buckets,
    rows_apply,
    sparse_gradient_params,
)
from .runtime.auto_caps import AutoCaps
from .runtime.comm import broadcast_coalesced, collective_device, comm_for, verify_same_params
from .runtime.join import ActiveRanks
from .runtime.optimizer_overlap import StepPerBucket
from .runtime.precision import MixedPrecision
from .runtime.reducer import Reducer
from .runtime.unused import ExpectAllUsed, SearchEveryIteration, StaticGraph

logger = logging.getLogger(__name__)

AUTO = "auto"
_construction_hooks: list[Callable[[], object]] = []


def on_construction(hook: Callable[[], object]) -> None:
    """Run ``hook()`` whenever a graphddp DDP is built: how an integration (``graphddp.integrations``) takes
    part without the DDP importing it (imports point down only: docs/architecture.md)."""
    if hook not in _construction_hooks:
        _construction_hooks.append(hook)

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
    (Note [Bucket ramps] in ``graphddp.passes.plan``). False: PyTorch's layout."""
    sparse_embedding_grads: bool = True
    """Reduce embedding tables' gradients as the rows some rank touched, and, compiled, send a tied table's other
    contributions early as parts of their own (Note [Row-sparse gradients] in ``graphddp.passes.row_sparse``). The
    result equals the dense all-reduce up to the order of floating-point sums. Applies to CPU buckets, several
    ranks and the default comm hook; elsewhere, and with False, every bucket is all-reduced dense."""

    def __post_init__(self) -> None:
        for field in ("bucket_ramps", "sparse_embedding_grads"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field} must be True or False, got {getattr(self, field)!r}")
        for field in _CAP_FIELDS:
            value = getattr(self, field)
            if isinstance(value, str) and value != AUTO:  # a type mistake, as any other non-number
                raise TypeError(f"{field} must be a number of MiB or {AUTO!r}, got str {value!r}")
        _ = self.caps  # raises on a bad cap

    @property
    def caps(self) -> BucketCaps:
        """The caps to plan with until an automatic choice is made (the defaults stand in for ``"auto"``)."""
        defaults = {f.name: f.default for f in dataclasses.fields(BucketOptions)}
        fixed = [defaults[f] if v == AUTO else v for f, v in self._cap_fields().items()]
        return BucketCaps.from_mb(*fixed, ramps=self.bucket_ramps)

    @property
    def caps_search(self) -> CapsSearch | None:
        """Which caps are chosen automatically (None: none of them)."""
        fields = self._cap_fields()
        if AUTO not in fields.values():
            return None
        bucket, first, last = (None if v == AUTO else float(v) for v in fields.values())
        return CapsSearch(bucket_mb=bucket, first_mb=first, last_mb=last, ramps=self.bucket_ramps)

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

    def __post_init__(self) -> None:
        for field in ("broadcast_buffers", "find_unused_parameters", "gradient_as_bucket_view", "static_graph"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"graphddp.DDP: {field} must be True or False, got {value!r}")
        super().__post_init__()

    def usage_policy(self) -> ExpectAllUsed | SearchEveryIteration | StaticGraph:
        if self.static_graph:
            return StaticGraph()
        if self.find_unused_parameters:
            return SearchEveryIteration()
        return ExpectAllUsed()


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel training with bucketed, overlapped gradient all-reduce; a drop-in for PyTorch's DDP.

    Construction is collective: every rank checks that all ranks hold the same parameters and buffers, then rank
    0's values are broadcast. See ``docs/`` and Note [Reducer] in ``graphddp.runtime.reducer`` for how backward works.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | str = 1,
        last_bucket_cap_mb: float | str = 1,
        bucket_ramps: bool = True,
        sparse_embedding_grads: bool = True,
    ) -> None:
        """PyTorch 2.13's arguments in PyTorch's order and meaning, then graphddp's own, keyword-only. Arguments
        graphddp does not implement raise ``NotImplementedError`` saying why (``_unsupported_arguments``)."""
        nn.Module.__init__(self)  # not super(): in InstalledDDP (Note [Frameworks]) PyTorch's DDP comes next
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"graphddp.DDP wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            raise ValueError("graphddp.DDP: the module is already wrapped in a DistributedDataParallel; wrap the inner module")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "graphddp.DDP needs a process group: call torch.distributed.init_process_group() first "
                "(launch with torchrun, or spawn ranks and pass rank/world_size)"
            )
        _unsupported_arguments(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            bucket_cap_mb_list=bucket_cap_mb_list,
        )
        if check_reduction:  # as in PyTorch: a no-op, the Reducer always completes the reduction
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
                "using it.",
                FutureWarning,
                stacklevel=2,
            )
        forward_sync, init_sync_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.dim = dim  # kept for PyTorch's API: one device per process, inputs are never scattered
        self.batched_grad_copy = batched_grad_copy  # a copy-speed knob of PyTorch's C++ Reducer: nothing to batch
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)  # reductions.SkippedReduction
        self.mixed_precision = mixed_precision  # as given (PyTorch's attribute); the policy is self._precision
        self._precision = MixedPrecision.of(mixed_precision)  # Note [Mixed precision] in graphddp.runtime.precision
        self.options = DDPOptions(
            bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            last_bucket_cap_mb=last_bucket_cap_mb,
            bucket_ramps=bucket_ramps,
            sparse_embedding_grads=sparse_embedding_grads,
            broadcast_buffers=forward_sync,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        process_group, self.device_mesh = _group_of(process_group, device_mesh)
        self.module = module
        self.process_group = process_group
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)

        self.parameters_to_ignore = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        """Names of parameters and buffers kept local: never broadcast nor reduced (as in PyTorch's DDP, set with
        ``_set_params_and_buffers_to_ignore_for_model``)."""
        named = [(n, p) for n, p in self._synced_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError(  # PyTorch's type: scripts match on it
                f"[rank {self.rank}] graphddp.DDP: the module has no parameter that requires a gradient, so there "
                "is nothing to synchronise; do not wrap it."
            )
        self.device = _single_device([p for _, p in module.named_parameters()], self.rank)
        if self.device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
            raise ValueError("SyncBatchNorm layers only work with GPU modules")  # PyTorch's check and words
        self.device_ids = _check_device_ids(device_ids, output_device, self.device, self.rank)

        reduces_rows = rows_apply(
            enabled=self.options.sparse_embedding_grads,
            world_size=self.world_size,
            device=str(self.device),
            custom_comm_hook=False,
        )
        row_sparse = embedding_tables(module) - self.parameters_to_ignore if reduces_rows else frozenset()
        sparse = sparse_gradient_params(module)  # torch.sparse gradients: each alone, all-reduced as sparse tensors

        def spec(name: str, p: torch.Tensor, label: str = "") -> ParamSpec:
            return ParamSpec.of(
                label + name, p, row_sparse=name in row_sparse, sparse_grad=name in sparse,
                dtype=self._precision.reduce_dtype_of(p),  # buckets in mixed_precision's reduce_dtype
            )

        if init_sync:  # as in PyTorch: every collective of construction is gated by it
            verify_same_params(
                # requires_grad is compared too: ranks that differ in it would plan different buckets.
                [spec(n, p, "parameter " if p.requires_grad else "parameter (requires_grad=False) ") for n, p in self._synced_parameters()]
                + [ParamSpec.of(f"buffer {n}", b) for n, b in self._synced_buffers()],
                group=self.process_group,
                options=self._collective_options(),
            )
            if self.world_size > 1:
                self._broadcast_state(src=0, buffers=init_sync_buffers)

        self._precision.cast_buffers(module, self.parameters_to_ignore)
        self._auto_caps = self._calibrate_auto_caps()
        plan = plan_buckets(
            [spec(n, p) for n, p in reversed(named)],
            caps=self.options.caps,
            source="registration",
        )
        self._make_reducer(plan)
        self.require_backward_grad_sync = True
        self._sync_buffers_next_forward = True
        self._logged_error: str | None = None  # the last usage error, for _get_ddp_logging_data as PyTorch keeps it
        dynamo_hook.install()  # torch.compile with any backend splits at our buckets (Note [Split without asking])
        for hook in _construction_hooks:  # e.g. checkpoints (Note [Checkpoints] in graphddp.integrations.checkpoint)
            hook()
        logger.info(
            "[rank %d] graphddp.DDP: %d trainable parameters in %d buckets (bytes %s), world size %d",
            self.rank,
            len(named),
            len(plan.buckets),
            [b.nbytes for b in plan.buckets],
            self.world_size,
        )

    def _collective_options(self) -> list[str]:
        """The options that change which collectives a rank issues: every rank must pass the same ones."""
        o = self.options
        return [
            f"option buckets={o.caps} automatic={o.caps_search}",
            f"option find_unused_parameters={o.find_unused_parameters} static_graph={o.static_graph}",
            f"option forward_sync_buffers={o.broadcast_buffers} sparse_embedding_grads={o.sparse_embedding_grads}",
            f"option skip_all_reduce_unused_params={self.skip_all_reduce_unused_params}",
        ]

    def _calibrate_auto_caps(self) -> AutoCaps | None:
        """For caps left to ``"auto"``: measure the link and the ranks (collective; Note [Automatic caps])."""
        search = self.options.caps_search
        if search is None:
            return None
        if self.world_size == 1:
            logger.info("[rank %d] graphddp.DDP: one rank communicates nothing; automatic caps keep %s", self.rank, self.options.caps)
            return None
        return AutoCaps.calibrate(search, self.process_group, collective_device(self.process_group, self.device))

    def _make_reducer(self, plan: BucketPlan) -> None:
        """The Reducer for ``plan`` (local: no collective), with what it shares with this module."""
        self._collective_device = collective_device(self.process_group, self.device)
        self._active_ranks = ActiveRanks(self.world_size)
        self.reducer = Reducer(
            [(n, p) for n, p in self._synced_parameters() if p.requires_grad],
            plan,
            process_group=self.process_group,
            collective_device=self._collective_device,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view,
            usage=self.options.usage_policy(),
            comm=comm_for(self.device),
            active_ranks=self._active_ranks,
            sparse_embedding_grads=self.options.sparse_embedding_grads,
            skip_unused=self.skip_all_reduce_unused_params,
            auto_caps=self._auto_caps,
        )

    # -- pickling (torch.save, copy.deepcopy), as PyTorch's DDP: no process group, no Reducer in the state --------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("process_group", "reducer", "_active_ranks", "device_mesh"):
            state.pop(name, None)
        state["_plan"] = self.reducer.plan  # pure data: the copy starts on the plan in force
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        plan = state.pop("_plan")
        nn.Module.__setstate__(self, state)  # not super(): see __init__
        self.process_group, self.device_mesh = dist.group.WORLD, None  # as PyTorch: the default group
        self._make_reducer(plan)

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes, as on PyTorch's DDP (Dynamo's DDP hook reads it)."""
        return self.options.caps.bucket

    # -- forward ---------------------------------------------------------------------------------------------
    # Dynamo does not trace this frame (it runs eagerly: collectives, Join, Reducer bookkeeping) but does trace
    # what it calls, so under torch.compile only the user's module is captured, with no graph break of ours.
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._pre_forward()
        if self.device_ids:
            inputs, kwargs = _move_to(inputs, self.device), _move_to(kwargs, self.device)
        compile_target.enter(self.reducer.compile_target)  # graphs Dynamo captures now are planned for this Reducer
        previous = dynamo_hook.activate(self)  # and split at its buckets whatever the backend (Note [Split without asking])
        try:
            output = self._precision.run(self.module, inputs, kwargs, self.parameters_to_ignore)
        finally:
            dynamo_hook.deactivate(previous)
            compile_target.leave()
        return self._post_forward(output)

    @torch.compiler.disable  # collectives and bookkeeping: never captured
    def _pre_forward(self) -> None:
        _refuse_torch_ddp_outside(self.rank)
        work = Join.notify_join_context(self)
        if work is not None:
            self._active_ranks.set_join_work(work)
        self.reducer.begin_forward(torch.is_grad_enabled())
        if self._will_sync_buffers():
            src = self._find_common_rank(True) if self._join_config.enable else 0
            self._broadcast_buffers(src)
        if self._join_config.enable:
            self._agree_on_backward_sync(joined=False)

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        synchronise = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synchronise:
            self.reducer.prepare_for_backward(output)
        # As in PyTorch: buffers are broadcast before a forward only if the previous one was synchronised.
        self._sync_buffers_next_forward = synchronise
        return output

    # -- buffers and state -------------------------------------------------------------------------------------
    def _will_sync_buffers(self) -> bool:
        return (
            self.world_size > 1
            and self.options.broadcast_buffers
            and self._sync_buffers_next_forward
            and any(True for _ in self._synced_buffers())
        )

    def _broadcast_buffers(self, src: int) -> None:
        # Buffers may have been replaced since construction: look them up each time.
        broadcast_coalesced([b.detach() for _, b in self._synced_buffers()], src=src, group=self.process_group)

    def _broadcast_state(self, src: int, buffers: bool | None = None) -> None:
        """Parameters (and buffers: by default with ``broadcast_buffers``) from ``src`` to every rank, ignored ones
        kept."""
        buffers = self.options.broadcast_buffers if buffers is None else buffers
        state = [p.detach() for _, p in self._synced_parameters()]
        state += [b.detach() for _, b in self._synced_buffers()] if buffers else []
        broadcast_coalesced(state, src=src, group=self.process_group)

    def _synced_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _synced_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Keep these parameters and buffers (fully qualified names) local: a DDP built on ``module`` afterwards
        neither broadcasts nor reduces them. The same call as PyTorch's DDP, which frameworks make."""
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore)

    def _find_common_rank(self, candidate: bool) -> int:
        """The largest rank among those with ``candidate`` True (a collective)."""
        rank = torch.tensor([self.rank if candidate else -1], device=self.join_device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        assert rank.item() >= 0, "no rank volunteered as the authoritative copy"
        return int(rank.item())

    # -- user API ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside the context synchronises the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        """Replace the averaging all-reduce with ``hook(state, bucket) -> Future[Tensor]``, as in PyTorch.

        ``bucket`` behaves like ``torch.distributed.GradBucket``, so PyTorch's own hooks
        (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
        ``powerSGD_hook.powerSGD_hook``) work unchanged.
        """
        _check_comm_hook(hook)
        if self.reducer.has_custom_comm_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.reducer.set_comm_hook(state, hook)

    def step_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Let graphddp call ``optimizer.step()`` during backward, bucket by bucket, as soon as each bucket's
        averaged gradients are final, hidden behind the all-reduces still in flight (Note [Optimizer overlap] in
        ``graphddp/runtime/optimizer_overlap.py``). The training loop then drops its ``optimizer.step()`` and keeps
        ``zero_grad()``. Only optimizers that update each parameter from its own gradient and state (SGD, Adam,
        AdamW, ...): ``TypeError`` otherwise."""
        self.reducer.set_after_bucket(StepPerBucket(optimizer, self.reducer.params()))

    def _set_static_graph(self) -> None:
        """PyTorch's way (used by Lightning strategies) to turn on ``static_graph`` after construction; only
        before the first iteration, as there."""
        if self.options.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self.reducer.usage.iterations:
            # PyTorch's words (its tests and frameworks match on them), and logged as PyTorch logs it.
            self._logged_error = (
                f"[rank {self.rank}] graphddp.DDP: _set_static_graph() should be called before training loop starts "
                "and after DistributedDataParallel is constructed (or pass static_graph=True to the constructor)."
            )
            raise RuntimeError(self._logged_error)
        self.options = dataclasses.replace(self.options, static_graph=True)
        self.reducer.set_usage_policy(self.options.usage_policy())

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """The subset of PyTorch's DDP logging data that frameworks read (Lightning's teardown, for one)."""
        usage = self.reducer.usage
        return {
            "module_name": type(self.module).__name__,
            "world_size": self.world_size,
            "rank": self.rank,
            "device_ids": ",".join(str(d) for d in self.device_ids or ()),
            "backend_name": dist.get_backend(self.process_group),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "broadcast_buffers": int(self.options.broadcast_buffers),
            "find_unused_parameters": int(self.options.find_unused_parameters),
            "gradient_as_bucket_view": int(self.options.gradient_as_bucket_view),
            "static_graph": int(self.options.static_graph),
            "has_rebuilt_buckets": int(self.bucket_plan.source != "registration"),
            "num_buckets": len(self.bucket_plan.buckets),
            "comm_hook": "custom" if self.reducer.has_custom_comm_hook else "graphddp average all-reduce",
            "iteration": usage.iterations,
            # As PyTorch: the set of unused parameters never changed, so static_graph=True would be safe.
            "can_set_static_graph": int(usage.iterations > 0 and len(usage.unused_sets) == 1),
            "has_error": int(self._logged_error is not None),
            "error": self._logged_error or "",
        }

    def register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """PyTorch's built-in hooks by name: ``ALLREDUCE`` (sum, then average) or ``FP16_COMPRESS``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise ValueError(f"graphddp.DDP: unknown built-in comm hook {comm_hook_type!r}")
        if self.reducer.has_custom_comm_hook:
            raise RuntimeError("register_builtin_comm_hook or register_comm_hook can only be called once.")
        self.reducer.set_comm_hook(self.process_group, hooks[comm_hook_type])

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs: ranks that run out of data shadow the others' collectives.

        Built on ``torch.distributed.algorithms.Join``; the arguments mean what they mean for PyTorch's DDP.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._collective_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # PyTorch's DDP exposes its options as attributes; scripts read them.
    find_unused_parameters = property(lambda self: self.options.find_unused_parameters)
    static_graph = property(lambda self: self.options.static_graph)
    gradient_as_bucket_view = property(lambda self: self.options.gradient_as_bucket_view)
    broadcast_buffers = property(lambda self: self.options.broadcast_buffers)

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast before each synchronising forward (PyTorch 2.13's name)."""
        return self.options.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.options = dataclasses.replace(self.options, broadcast_buffers=value)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the module's buffers (as PyTorch's DDP answers it)."""
        return self._will_sync_buffers()

    @property
    def bucket_plan(self):
        """The ``BucketPlan`` the Reducer runs on now."""
        return self.reducer.plan

    # -- join internals ----------------------------------------------------------------------------------------
    def _agree_on_backward_sync(self, joined: bool) -> bool | None:
        """Tell joined ranks whether this iteration synchronises gradients (they then shadow the backward)."""
        flag = torch.zeros(1, device=self.join_device)
        if not joined and self.require_backward_grad_sync:
            flag += 1
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not joined:
            return None
        work.wait()
        return bool(flag.item() != 0)

    def _shadow_iteration(self) -> None:
        """What a joined rank does while others still train: mirror their forward and backward collectives."""
        self.reducer.switch_plan(grad_enabled=True)
        if self._will_sync_buffers():
            self._broadcast_buffers(self._find_common_rank(False))
        should_sync = self._agree_on_backward_sync(joined=True)
        self._sync_buffers_next_forward = bool(should_sync)
        if should_sync:
            self.reducer.shadow_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """After all ranks joined, the last joiner's parameters (and buffers) become everyone's."""
        self._broadcast_state(src=self._find_common_rank(is_last_joiner))


def _internal(name: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"graphddp: DistributedDataParallel.{name} belongs to PyTorch's C++ Reducer and logger, which graphddp's "
            "DDP does not have; code calling it needs PyTorch's DDP (with graphddp.install(): graphddp.uninstall())."
        )

    refuse.__name__ = name
    return refuse


# PyTorch DDP methods that reach into its C++ Reducer or logger: they say so (an InstalledDDP, Note [Frameworks],
# would otherwise inherit PyTorch's and fail with an AttributeError deep inside).
for _name in (
    "_register_fused_optim", "_set_sparse_metadata", "_remove_autograd_hooks", "_update_process_group",
    "_set_ddp_sink_clone", "_register_buffer_comm_hook", "_get_data_parallel_params", "_check_reducer_finalized",
    "scatter", "gather", "to_kwargs", "_run_ddp_forward", "_delay_all_reduce",
):
    if hasattr(nn.parallel.DistributedDataParallel, _name) and _name not in DistributedDataParallel.__dict__:
        setattr(DistributedDataParallel, _name, _internal(_name))
DistributedDataParallel._set_ddp_runtime_logging_sample_rate = lambda self, sample_rate: None  # nothing sampled
DistributedDataParallel._register_builtin_comm_hook = DistributedDataParallel.register_builtin_comm_hook


DDP = DistributedDataParallel


def compile(
    model: nn.Module,
    backend: str | Callable[..., Any] | GraphDDPBackend = "inductor",
    *,
    debug_dir: str | None = None,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """``torch.compile`` for a ``graphddp.DDP`` module: the wrapper stays eager, the inner module is compiled.

    ``backend`` is the inner backend (as for ``graphddp.backend``) or a ``graphddp.backend(...)`` object.
    ``mode`` and ``options`` configure the inner compiler as ``torch.compile`` would (Inductor's modes and config);
    ``dynamic``, ``fullgraph`` and any other keyword go to ``torch.compile``.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"graphddp.compile expects a graphddp.DDP module, got {type(model).__name__}; wrap the model first: "
            "graphddp.compile(graphddp.DDP(model))"
        )
    if isinstance(backend, GraphDDPBackend):
        backend = backend.configured(mode=mode, options=options, dynamic=dynamic)
    else:
        backend = GraphDDPBackend(inner_compiler(backend, mode=mode, options=options, dynamic=dynamic), debug_dir=debug_dir)
    return torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph, **kwargs)


_UNSUPPORTED = {
    "delay_all_reduce_named_params": "delaying some parameters' all-reduce to the end of backward",
    "param_to_hook_all_reduce": "delaying some parameters' all-reduce to the end of backward",
    "bucket_cap_mb_list": "per-bucket caps (graphddp's first/last caps and ramps: Note [Bucket ramps])",
}


def _check_comm_hook(hook: Any) -> None:
    """A comm hook's shape, checked as PyTorch checks it (its exception types and words), before any backward."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. (graphddp.DDP.register_comm_hook got {type(hook).__name__})")
    try:  # annotations written under `from __future__ import annotations` are strings: evaluate them
        signature = inspect.signature(hook, eval_str=True)
    except Exception:  # noqa: BLE001 (a name the hook's module cannot resolve: compare what is written)
        signature = inspect.signature(hook)
    params = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(params) != 2:
        raise TypeError(
            f"graphddp.DDP.register_comm_hook: a hook takes exactly two arguments (state, bucket), got {signature}"
        )
    if params[1].annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")


def _unsupported_arguments(**given: Any) -> None:
    """PyTorch arguments graphddp does not implement: ``NotImplementedError`` naming the argument, if set."""
    for name, value in given.items():
        if value not in (None, False):
            raise NotImplementedError(
                f"graphddp.DDP does not implement {name}= ({_UNSUPPORTED[name]}); leave it at its default, or use "
                "torch.nn.parallel.DistributedDataParallel for it."
            )


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
            stacklevel=3,
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


class _DDPJoinHook(JoinHook):
    """Join hook: shadow one iteration per main_hook call, then agree on the final model."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._active_ranks.divide_by_initial_world_size(divide_by_initial_world_size)

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


def _refuse_torch_ddp_outside(rank: int) -> None:
    """PyTorch's DDP wrapped around a graphddp DDP would all-reduce every gradient twice (Note [Frameworks])."""
    if nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
        raise RuntimeError(
            f"[rank {rank}] graphddp.DDP runs inside torch.nn.parallel.DistributedDataParallel's forward: every "
            "gradient would be all-reduced twice. Hand the framework the unwrapped model and call graphddp.install() "
            "first, so that the DDP it builds is graphddp's (docs/migrating.md)."
        )


def _single_device(params: list[nn.Parameter], rank: int) -> torch.device:
    devices = sorted({str(p.device) for p in params})
    if len(devices) != 1:
        raise ValueError(
            f"[rank {rank}] graphddp.DDP: the module's parameters live on several devices {devices}; "
            "graphddp.DDP supports single-device modules: one rank per device."
        )
    return params[0].device


def _check_device_ids(
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    device: torch.device,
    rank: int,
) -> list[int] | None:
    if device_ids is None:
        return None
    if device.type == "cpu":
        raise ValueError(
            f"[rank {rank}] graphddp.DDP: device_ids must be None for a module on the CPU, got {device_ids}"
        )
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


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj
