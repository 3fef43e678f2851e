"""What PyTorch's DDP has that scripts and frameworks call, on graphddp's DDP: ``TorchDDPSurface``.

Frameworks and scripts written for ``torch.nn.parallel.DistributedDataParallel`` read its option attributes
(``ddp.static_graph``, ``ddp.find_unused_parameters``), call its semi-private methods (Lightning's
``_set_static_graph`` and ``_get_ddp_logging_data``, accelerate's ``_set_params_and_buffers_to_ignore_for_model``)
and, now and then, methods that reach into PyTorch's C++ Reducer and logger, which graphddp has not got.

They live on a mixin class rather than in module functions because they *are* attributes of the DDP object: the
callers look them up on it, and the refusals of the C++-Reducer methods must sit on the class the user gets. An
``InstalledDDP`` (Note [Frameworks] in ``graphddp.integrations.frameworks``) has graphddp's DDP first in its bases
and PyTorch's second; ``DistributedDataParallel`` puts this mixin before ``nn.Module``, so the mixin comes before
PyTorch's class in the method resolution order and every name here shadows PyTorch's. Keeping the surface in its
own class leaves ``DistributedDataParallel`` with what graphddp does; the mixin reads the DDP's state listed in
its annotations, and writes only the DDP's own options (``self.options``, replaced, never mutated).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from .runtime.torch_ddp import TorchDDP, active_ddp_module

if TYPE_CHECKING:
    from .options import DDPOptions
    from .passes import BucketPlan
    from .runtime.reducer import Reducer


class TorchDDPSurface:
    """What PyTorch's DDP has that scripts and frameworks call: its option attributes, its logging data, its
    built-in comm hooks, its ``_set_static_graph``; and, for the methods of its C++ Reducer, an error that says so.
    A mixin of ``graphddp.DistributedDataParallel`` (see the module's docstring)."""

    # What the surface reads of the DDP it is mixed into.
    options: DDPOptions
    reducer: Reducer
    bucket_plan: BucketPlan
    module: nn.Module
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    device_ids: list[int] | None
    device: torch.device
    _will_sync_buffers: Callable[[], bool]

    # PyTorch's attributes (DistributedDataParallel.__init__ sets them).
    parameters_to_ignore: frozenset[str]
    """Names of parameters and buffers kept local: never broadcast nor reduced (as in PyTorch's DDP, set with
    ``_set_params_and_buffers_to_ignore_for_model``)."""
    dim: int
    """Kept for PyTorch's API: one device per process, inputs are never scattered."""
    batched_grad_copy: bool
    """A copy-speed knob of PyTorch's C++ Reducer: nothing to batch."""
    mixed_precision: Any
    """PyTorch's ``_MixedPrecision`` as given (the DDP runs the policy made of it, ``graphddp.runtime.precision``)."""

    _logged_error: str | None = None
    """The last usage error, for ``_get_ddp_logging_data`` as PyTorch keeps it (None: none yet)."""

    # PyTorch's DDP exposes its options as attributes; scripts read them.
    find_unused_parameters = property(lambda self: self.options.find_unused_parameters)
    static_graph = property(lambda self: self.options.static_graph)
    gradient_as_bucket_view = property(lambda self: self.options.gradient_as_bucket_view)
    is_multi_device_module = False
    """graphddp wraps a module on one device (PyTorch's attribute: its multi-device path is not here)."""

    @property
    def device_type(self) -> str:
        """The type of the module's device (``"cpu"``, ``"cuda"``), as PyTorch's DDP keeps it."""
        return self.device.type

    @property
    def output_device(self) -> int | None:
        """PyTorch's: None for a CPU module or without ``device_ids``, else the device's index."""
        return None if not self.device_ids else self.device.index

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for uneven inputs: ranks that run out of data shadow the others' collectives (Note
        [Join] in ``graphddp.runtime.join``; the DDP's ``join_hook``).

        Built on ``torch.distributed.algorithms.Join``; the arguments mean what they mean for PyTorch's DDP.
        """
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    @property
    def broadcast_buffers(self) -> bool:
        """PyTorch's option attribute; assigning it, as scripts do, changes what the next forward broadcasts."""
        return self.options.broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def forward_sync_buffers(self) -> bool:
        """Whether buffers are broadcast before each synchronising forward (PyTorch 2.13's name)."""
        return self.options.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.options = dataclasses.replace(self.options, broadcast_buffers=value)

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes, as on PyTorch's DDP (Dynamo's DDP hook reads it)."""
        return self.options.caps.bucket

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the module's buffers (as PyTorch's DDP answers it)."""
        return self._will_sync_buffers()

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
        self.reducer.usage.set_policy(self.options.usage_policy())

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """PyTorch's DDP logging data (frameworks read it; PyTorch's own tests check it): the construction fields,
        the runtime statistics of the last sampled iteration (``graphddp.runtime.stats``), the plan's buckets, the
        environment PyTorch's logger records, and the last usage error. ``prev_iteration_grad_ready_order_indices``
        is the order graphddp last observed (it learns it while the plan is rebuilt, not every iteration)."""
        usage, plan = self.reducer.usage, self.bucket_plan
        trainable = [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore and p.requires_grad]
        index = {n: i for i, (n, _) in enumerate(trainable)}
        sizes = ", ".join(str(b.nbytes) for b in plan.buckets)
        data: dict[str, Any] = {
            "module_name": type(self.module).__name__,
            "world_size": self.world_size,
            "rank": self.rank,
            "device_ids": ",".join(str(d) for d in self.device_ids or ()),
            "output_device": -1 if self.device.type == "cpu" else self.device.index,  # PyTorch's -1: no output device
            "backend_name": dist.get_backend(self.process_group),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "broadcast_buffers": int(self.options.broadcast_buffers),
            "find_unused_parameters": int(self.options.find_unused_parameters),
            "gradient_as_bucket_view": int(self.options.gradient_as_bucket_view),
            "static_graph": int(self.options.static_graph),
            "dtypes": ", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for _, p in trainable})),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for _, p in trainable),
            "num_parameter_tensors": len(trainable),
            "bucket_sizes": sizes,
            "has_rebuilt_buckets": int(usage.iterations > 0),  # the first backward's ready order was weighed
            "rebuilt_bucket_sizes": sizes,
            "rebuilt_per_bucket_param_indices": ", ".join(" ".join(str(index[n]) for n in b.names if n in index) for b in plan.buckets),
            "prev_iteration_grad_ready_order_indices": ", ".join(map(str, self.reducer.plans.ready_order.observed)),
            "num_buckets": len(plan.buckets),
            "comm_hook": getattr(self.reducer.comm_hook.fn, "__qualname__", "custom") if self.reducer.comm_hook.custom else "graphddp average all-reduce",
            "iteration": 0,
            # As PyTorch: the set of unused parameters never changed, so static_graph=True would be safe.
            "can_set_static_graph": int(usage.iterations > 0 and len(usage.unused_sets) == 1),
            "has_error": int(self._logged_error is not None),
            "error": self._logged_error or "",
            **_environment(self.process_group),
            **self.reducer.stats.published,
        }
        return data

    def _check_new_comm_hook(self, hook: Any) -> None:
        """Before ``register_comm_hook``: PyTorch's checks with its exception types and words, each error also kept
        for ``_get_ddp_logging_data`` (``has_error``, ``error``), as PyTorch's logger keeps it."""
        try:
            check_comm_hook(hook)
            if self.reducer.comm_hook.custom:
                raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        except (TypeError, ValueError, RuntimeError) as e:
            self._logged_error = str(e)
            raise

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Time every ``sample_rate``-th synchronised iteration after the first ten (PyTorch's sampling)."""
        self.reducer.stats.set_sample_rate(sample_rate)

    def register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """PyTorch's built-in hooks by name: ``ALLREDUCE`` (sum, then average) or ``FP16_COMPRESS``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise ValueError(f"graphddp.DDP: unknown built-in comm hook {comm_hook_type!r}")
        self._check_new_comm_hook(hooks[comm_hook_type])
        self.reducer.set_comm_hook(self.process_group, hooks[comm_hook_type])

    _register_builtin_comm_hook = register_builtin_comm_hook

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Keep these parameters and buffers (fully qualified names) local: a DDP built on ``module`` afterwards
        neither broadcasts nor reduces them. The same call as PyTorch's DDP, which frameworks make."""
        TorchDDP._set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore)


_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}
"""The names PyTorch's logger gives dtypes (``caffe2::TypeMeta::name``)."""


def _environment(group: dist.ProcessGroup) -> dict[str, Any]:
    """What PyTorch's logger records of the environment ("N/A": unset), and the gloo group's thread count."""
    env = {k: os.environ.get(v, "N/A") for k, v in (("master_port", "MASTER_PORT"), ("master_addr", "MASTER_ADDR"),
           ("torch_distributed_debug", "TORCH_DISTRIBUTED_DEBUG"), ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"))}  # fmt: skip
    backend = dist.get_backend(group)
    if backend == "gloo":
        env.update(gloo_socket_ifname=os.environ.get("GLOO_SOCKET_IFNAME", "N/A"), gloo_device_transport=os.environ.get("GLOO_DEVICE_TRANSPORT", "N/A"))
        options = getattr(group._get_backend(torch.device("cpu")), "options", None)
        env["gloo_num_threads"] = getattr(options, "_threads", 2)
    elif backend == "nccl":
        names = ("NCCL_SOCKET_IFNAME", "NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "NCCL_NTHREADS", "NCCL_IB_TIMEOUT")
        env.update({name.lower(): os.environ.get(name, "N/A") for name in names})
    return env


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
    if hasattr(TorchDDP, _name) and _name not in TorchDDPSurface.__dict__:
        setattr(TorchDDPSurface, _name, _internal(_name))


def check_comm_hook(hook: Any) -> None:
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


def refuse_torch_ddp_outside(rank: int) -> None:
    """PyTorch's DDP wrapped around a graphddp DDP would all-reduce every gradient twice (Note [Frameworks])."""
    if active_ddp_module() is not None:
        raise RuntimeError(
            f"[rank {rank}] graphddp.DDP runs inside torch.nn.parallel.DistributedDataParallel's forward: every "
            "gradient would be all-reduced twice. Hand the framework the unwrapped model and call graphddp.install() "
            "first, so that the DDP it builds is graphddp's (docs/migrating.md)."
        )
