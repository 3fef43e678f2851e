"""``graphddp.DistributedDataParallel``: the module users wrap, with PyTorch's DDP API on graphddp's Reducer.

The wrapper owns what happens around the user's forward (buffer broadcast, join bookkeeping, arming the
Reducer); the Reducer (``graphddp.runtime.reducer``) owns everything that happens during backward. PyTorch's
constructor arguments are translated in ``graphddp.options``, the join machinery lives in
``graphddp.runtime.join`` and the rest of PyTorch's DDP surface that frameworks call in ``graphddp.torch_compat``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.nn.utils.rnn import PackedSequence

from .compiler import compile_target, dynamo_hook
from .compiler.backend import GraphDDPBackend, inner_compiler
from .options import AUTO, BucketOptions, DDPOptions, device_of, from_torch_arguments, trainable_parameters
from .passes import BucketPlan, ParamSpec, embedding_tables, plan_buckets, rows_apply, sparse_gradient_params
from .runtime import replicas
from .runtime.auto_caps import AutoCaps
from .runtime.channels import Channels
from .runtime.comm import broadcast_coalesced, collective_device, verify_same_params
from .runtime.delayed import DelayedAllReduce, named_delayed
from .runtime.join import ActiveRanks, JoinSupport, ShadowedModule
from .runtime.optimizer_overlap import StepPerBucket
from .runtime.placement import Placement
from .runtime.reducer import Reducer
from .runtime.replicas import ReplicaCheck
from .runtime.rows_rule import RowsRule
from .runtime.torch_ddp import TorchDDP
from .torch_compat import TorchDDPSurface, refuse_torch_ddp_outside

__all__ = ["AUTO", "DDP", "BucketOptions", "DDPOptions", "DistributedDataParallel", "check_replicas", "compile", "on_construction"]

logger = logging.getLogger(__name__)

_construction_hooks: list[Callable[[], object]] = []


def on_construction(hook: Callable[[], object]) -> None:
    """Run ``hook()`` whenever a graphddp DDP is built: how an integration (``graphddp.integrations``) takes
    part without the DDP importing it (imports point down only: docs/architecture.md)."""
    if hook not in _construction_hooks:
        _construction_hooks.append(hook)


# torch.compile with any backend splits at our buckets (Note [Split without asking]); first of the hooks.
on_construction(dynamo_hook.install)


class DistributedDataParallel(TorchDDPSurface, nn.Module, Joinable):
    """Data-parallel training with bucketed, overlapped gradient all-reduce; a drop-in for PyTorch's DDP.

    Construction is collective: every rank checks that all ranks hold the same parameters and buffers, then rank
    0's values are broadcast. See ``docs/`` and Note [Reducer] in ``graphddp.runtime.reducer`` for how backward works.
    PyTorch's DDP attributes that frameworks call come from ``TorchDDPSurface`` (``graphddp.torch_compat``), first
    in the bases so that they shadow PyTorch's in an ``InstalledDDP`` (Note [Frameworks]).
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
        sparse_embedding_grads: bool | str = AUTO,
        check_replicas_every: int = 0,
        channels: int | str = 1,
    ) -> None:
        """PyTorch 2.13's arguments in PyTorch's order and meaning, then graphddp's own, keyword-only."""
        nn.Module.__init__(self)  # not super(): in InstalledDDP (Note [Frameworks]) PyTorch's DDP comes next
        Joinable.__init__(self)
        _check_wrappable(module)
        given = from_torch_arguments(
            broadcast_buffers=broadcast_buffers, forward_sync_buffers=forward_sync_buffers, process_group=process_group,
            device_mesh=device_mesh, bucket_cap_mb=bucket_cap_mb, check_reduction=check_reduction,
            find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph, mixed_precision=mixed_precision, bucket_cap_mb_list=bucket_cap_mb_list,
            first_bucket_cap_mb=first_bucket_cap_mb, last_bucket_cap_mb=last_bucket_cap_mb, bucket_ramps=bucket_ramps,
            sparse_embedding_grads=sparse_embedding_grads, check_replicas_every=check_replicas_every, channels=channels,
        )
        self.dim, self.batched_grad_copy, self.mixed_precision = dim, batched_grad_copy, mixed_precision  # PyTorch's
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)  # reductions.SkippedReduction
        self.options, self._precision = given.options, given.precision  # the policy for mixed_precision
        self.module, self._sparse_grads = module, sparse_gradient_params(module)  # torch.sparse gradients: averaged sparse
        self.process_group, self.device_mesh = given.process_group, given.device_mesh
        self.rank, self.world_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        self._delayed_names = named_delayed(module, delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.parameters_to_ignore = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | frozenset(self._delayed_names[0])  # kept local, or delayed (as PyTorch)
        named = trainable_parameters(synced := self._synced_parameters(), self.rank)
        self.device, self.device_ids = device_of(module, synced, device_ids, output_device, self.rank)
        self._make_reducer(self._first_plan(named, init_sync=init_sync, init_sync_buffers=given.init_sync_buffers))
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # PyTorch's name: the next forward broadcasts buffers
        for hook in _construction_hooks:  # e.g. checkpoints (Note [Checkpoints] in graphddp.integrations.checkpoint)
            hook()
        buckets = self.bucket_plan.buckets
        logger.info("[rank %d] graphddp.DDP: %d trainable parameters in %d buckets (bytes %s), world size %d",
                    self.rank, len(named), len(buckets), [b.nbytes for b in buckets], self.world_size)

    def _first_plan(self, named: list[tuple[str, nn.Parameter]], *, init_sync: bool, init_sync_buffers: bool) -> BucketPlan:
        """Check that every rank holds the same parameters and buffers and take rank 0's (collectives gated by
        ``init_sync``, as in PyTorch), then plan the buckets in registration order, reversed."""
        rows = self.options.sparse_embedding_grads
        reduces_rows = rows_apply(enabled=rows is not False, world_size=self.world_size, device=str(self.device), custom_comm_hook=False)
        row_sparse = embedding_tables(self.module) - self.parameters_to_ignore if reduces_rows else frozenset()  # ranks compare these

        def spec(name: str, p: torch.Tensor, label: str = "") -> ParamSpec:
            return ParamSpec.of(
                label + name, p, row_sparse=name in row_sparse, sparse_grad=name in self._sparse_grads,
                dtype=self._precision.reduce_dtype_of(p),  # buckets in mixed_precision's reduce_dtype
            )

        if init_sync:  # as in PyTorch: every collective of construction is gated by it
            verify_same_params(
                # requires_grad is compared too: ranks that differ in it would plan different buckets.
                [spec(n, p, "parameter " if p.requires_grad else "parameter (requires_grad=False) ") for n, p in self._synced_parameters()]
                + [ParamSpec.of(f"buffer {n}", b) for n, b in self._synced_buffers()],
                group=self.process_group,
                options=self.options.collective_lines(skip_all_reduce_unused_params=self.skip_all_reduce_unused_params),
            )
            if self.world_size > 1:
                self._broadcast_state(src=0, buffers=init_sync_buffers)

        self._precision.cast_buffers(self.module, self.parameters_to_ignore)
        self._auto_caps = self._calibrate_auto_caps()
        device = collective_device(self.process_group, self.device)
        self._rows = RowsRule.measure(
            rows, self.module, self.process_group, device, applies=reduces_rows, auto_caps=self._auto_caps, ignored=self.parameters_to_ignore
        )
        shapes = {n: (p.shape, self._precision.reduce_dtype_of(p)) for n, p in named if n in row_sparse}
        row_sparse = self._rows.eager_tables(shapes)  # spec() reads it from here on: the tables that pay as rows
        plan = plan_buckets([spec(n, p) for n, p in reversed(named)], caps=self.options.caps, source="registration")
        self._channels = Channels.open(  # Note [Channels]; "auto": on the link auto caps measured, if they did
            self.process_group, self.options.channels, owner=self, bucket_bytes=[b.nbytes for b in plan.buckets],
            link=self._auto_caps.link if self._auto_caps is not None else None, device=device,
        )
        return plan

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
        active_ranks = ActiveRanks(self.world_size)
        named = [(n, p) for n, p in self._synced_parameters() if p.requires_grad]
        self.reducer = Reducer(
            named, plan, process_group=self.process_group, collective_device=self._collective_device,
            gradient_as_bucket_view=self.options.gradient_as_bucket_view, usage=self.options.usage_policy(),
            active_ranks=active_ranks, rows=self._rows,
            skip_unused=self.skip_all_reduce_unused_params, auto_caps=self._auto_caps, channels=self._channels,
        )  # fmt: skip
        self._join = JoinSupport(self.reducer, active_ranks, group=self.process_group, rank=self.rank, device=self._collective_device)
        self._delayed = DelayedAllReduce.of(self.module, *self._delayed_names, group=self.process_group, rank=self.rank)
        self._placement = Placement(self.module, named, self.parameters_to_ignore)  # checked per forward
        self._replicas = ReplicaCheck(self.options.check_replicas_every, named, group=self.process_group, device=self._collective_device)

    # -- pickling (torch.save, copy.deepcopy), as PyTorch's DDP: no process group, no Reducer in the state --------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("process_group", "reducer", "_join", "device_mesh", "_delayed", "_placement", "_replicas", "_channels"):
            state.pop(name, None)
        state["_plan"] = self.reducer.plan  # pure data: the copy starts on the plan in force
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        plan = state.pop("_plan")
        nn.Module.__setstate__(self, state)  # not super(): see __init__
        self.process_group, self.device_mesh = dist.group.WORLD, None  # as PyTorch: the default group
        self._channels = Channels.single(self.process_group)  # making groups is a collective (Note [Channels])
        self._make_reducer(plan)

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
            output = self._precision.run(self.module, inputs, kwargs, self.parameters_to_ignore, self._sparse_grads)
        finally:
            dynamo_hook.deactivate(previous)
            compile_target.leave()
        return self._post_forward(output)

    @torch.compiler.disable  # collectives and bookkeeping: never captured
    def _pre_forward(self) -> None:
        refuse_torch_ddp_outside(self.rank)
        self._placement.check(self.rank)  # the parameters as wrapped (graphddp.runtime.placement)
        self._join.notify(self)
        grad_enabled = torch.is_grad_enabled()
        synchronising = grad_enabled and self.require_backward_grad_sync
        if synchronising:  # PyTorch's logger samples synchronised iterations (graphddp.runtime.stats)
            self.reducer.stats.forward_started()
        self._replicas.before_forward(synchronising and not self._join_config.enable)  # a join's replicas differ
        self.reducer.begin_forward(grad_enabled)
        self._delayed.before_forward(grad_enabled=grad_enabled, synchronising=synchronising)
        # In-graph reduction this forward? (Note [In-graph reduction])
        self.reducer.compile_target.begin_forward(grad_enabled=grad_enabled, synchronising=synchronising, joining=self._join_config.enable)
        if self._will_sync_buffers():
            src = self._join.common_rank(True) if self._join_config.enable else 0
            self._broadcast_buffers(src)
        if self._join_config.enable:
            self._join.announce_backward_sync(self.require_backward_grad_sync)

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        synchronise = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.reducer.stats.mark("forward_end")
        if synchronise and not self.reducer.compile_target.gate.reduced_in_graph():  # else: the graphs reduced
            self.reducer.prepare(output)
        self._forward_done(synchronise)
        return output

    def _forward_done(self, synchronised: bool) -> None:
        self.reducer.unprepared.forward_ran(grad_enabled=torch.is_grad_enabled(), synchronised=synchronised)
        self.require_forward_param_sync = synchronised  # as PyTorch: buffers broadcast only after a synced forward

    # -- buffers and state -------------------------------------------------------------------------------------
    def _will_sync_buffers(self) -> bool:
        wanted = self.world_size > 1 and self.options.broadcast_buffers and self.require_forward_param_sync
        return wanted and self._has_synced_buffers

    @functools.cached_property
    def _has_synced_buffers(self) -> bool:
        """Buffers to broadcast? Asked once, as PyTorch's DDP does (which ones: at each broadcast): a module walk
        per forward costs a launch-bound step ~0.3 ms."""
        return any(True for _ in self._synced_buffers())

    def _broadcast_buffers(self, src: int) -> None:
        # Buffers may have been replaced since construction: look them up each time.
        synced = tuple(b for _, b in self._synced_buffers())
        with torch.autograd._unsafe_preserve_version_counter(synced):  # as PyTorch's DDP (PlanKeeper.broadcast_buffers)
            self.reducer.plans.broadcast_buffers([b.detach() for b in synced], src, counted=not self._join_config.enable)  # an out-of-step guard

    def _broadcast_state(self, src: int, buffers: bool | None = None) -> None:
        """Parameters (and buffers: by default with ``broadcast_buffers``) from ``src`` to every rank, ignored ones
        kept."""
        buffers = self.options.broadcast_buffers if buffers is None else buffers
        state = [p.detach() for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore or n in self._delayed_names[0]]
        state += [b.detach() for _, b in self._synced_buffers()] if buffers else []
        broadcast_coalesced(state, src=src, group=self.process_group)

    def _synced_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _synced_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

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
        self._check_new_comm_hook(hook)  # PyTorch's checks, words and logged error (graphddp.torch_compat)
        self.reducer.set_comm_hook(state, hook)

    def step_in_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """Let graphddp call ``optimizer.step()`` during backward, bucket by bucket, as soon as each bucket's
        averaged gradients are final, hidden behind the all-reduces still in flight (Note [Optimizer overlap] in
        ``graphddp/runtime/optimizer_overlap.py``). The training loop then drops its ``optimizer.step()`` and keeps
        ``zero_grad()``. Only optimizers that update each parameter from its own gradient and state (SGD, Adam,
        AdamW, ...): ``TypeError`` otherwise."""
        stepper = StepPerBucket(optimizer, self.reducer.params())
        self.reducer.set_after_bucket(stepper)  # on the split and eagerly
        self.reducer.compile_target.step_in_backward(stepper)  # in-graph (Note [Steps in the compiled backward])

    @property
    def bucket_plan(self) -> BucketPlan:
        """The ``BucketPlan`` the Reducer runs on now."""
        return self.reducer.plan

    @property
    def automatic_caps(self) -> AutoCaps | None:
        """What ``bucket_cap_mb="auto"`` measured at construction and every choice made from it so far
        (``AutoCaps.as_record()``: as plain data); None where no cap is left to ``"auto"``, or at one rank (Note
        [Automatic caps] in ``graphddp.passes.caps_choice``)."""
        return self._auto_caps

    # -- join (Note [Join] in graphddp.runtime.join): PyTorch's Joinable, over this module's JoinSupport ---------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self._delayed_names[0]:  # issued by a gradient hook, among the buckets: a joined rank has no such moment
            raise RuntimeError(f"[rank {self.rank}] graphddp.DDP: join() cannot shadow the all-reduce of "
                               "delay_all_reduce_named_params (PyTorch's DDP hangs there); train without a join or without delaying.")
        divide = kwargs.get("divide_by_initial_world_size", True)
        return self._join.hook(self._shadowed(), divide_by_initial_world_size=divide)

    @property
    def join_device(self) -> torch.device:
        return self._collective_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _shadowed(self) -> ShadowedModule:
        """What a joined rank does to this module's state (given per join: JoinSupport keeps no reference to it)."""
        return ShadowedModule(
            buffers_due=self._will_sync_buffers,
            broadcast_buffers=self._broadcast_buffers,
            broadcast_state=self._broadcast_state,
            forward_done=self._forward_done,
        )


DDP = DistributedDataParallel


def check_replicas(ddp: DistributedDataParallel) -> None:
    """Raise ``graphddp.runtime.replicas.ReplicasDiffer`` on every rank if the ranks' synchronised parameters differ,
    naming the first (collective: call it on every rank; ``check_replicas_every=N`` runs it every N steps)."""
    replicas.check_replicas(ddp._synced_parameters(), group=ddp.process_group, device=ddp._collective_device)


def _check_wrappable(module: nn.Module) -> None:
    """Refuse what ``DistributedDataParallel`` cannot wrap: a non-module, a DDP, or anything before a process group."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"graphddp.DDP wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, (DistributedDataParallel, TorchDDP)):
        raise ValueError("graphddp.DDP: the module is already wrapped in a DistributedDataParallel; wrap the inner module")
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        raise RuntimeError(  # PyTorch's type and words: scripts match on them
            "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. Run a dummy forward "
            "pass to correctly initialize the modules (graphddp.DDP: a lazy module, nn.LazyLinear and the like)."
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "graphddp.DDP needs a process group: call torch.distributed.init_process_group() first "
            "(launch with torchrun, or spawn ranks and pass rank/world_size)"
        )


def compile(
    model: nn.Module,
    backend: str | Callable[..., Any] | GraphDDPBackend = "inductor",
    *,
    debug_dir: str | None = None,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    reduction: str = "auto",
    **kwargs: Any,
) -> nn.Module:
    """``torch.compile`` for a ``graphddp.DDP`` module: the wrapper stays eager, the inner module is compiled.

    ``backend`` is the inner backend (as for ``graphddp.backend``) or a ``graphddp.backend(...)`` object.
    ``mode`` and ``options`` configure the inner compiler as ``torch.compile`` would (Inductor's modes and config);
    ``dynamic``, ``fullgraph`` and any other keyword go to ``torch.compile``. ``reduction``: how gradients are
    reduced, as for ``graphddp.backend`` (``"auto"``, ``"split"``, ``"in_graph"``; ignored for a backend object).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"graphddp.compile expects a graphddp.DDP module, got {type(model).__name__}; wrap the model first: "
            "graphddp.compile(graphddp.DDP(model))"
        )
    if isinstance(backend, GraphDDPBackend):
        backend = backend.configured(mode=mode, options=options, dynamic=dynamic)
    else:
        inner = inner_compiler(backend, mode=mode, options=options, dynamic=dynamic)
        backend = GraphDDPBackend(inner, debug_dir=debug_dir, reduction=reduction)
    return torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph, **kwargs)


def _move_to(obj: Any, device: torch.device) -> Any:
    """``obj``'s tensors on ``device``, every container of the type it was (a namedtuple, a ``PackedSequence``, an
    ``OrderedDict`` or another dict subclass), as PyTorch's DDP moves its inputs (``torch.distributed.utils.
    _recursive_to``): a forward that reads ``batch.x`` or takes a ``PackedSequence`` gets one."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_move_to(o, device) for o in obj))
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _move_to(v, device)) for k, v in obj.items())
    return obj
