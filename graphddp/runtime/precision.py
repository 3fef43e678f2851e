"""``mixed_precision=``: PyTorch's ``_MixedPrecision`` (parameter, reduce and buffer dtypes) on graphddp.

Note [Mixed precision]
~~~~~~~~~~~~~~~~~~~~~~
What PyTorch's DDP promises, and graphddp keeps: the forward (and so the backward) computes with parameters and
floating-point inputs in ``param_dtype``; gradients are all-reduced in ``reduce_dtype`` (default:
``param_dtype``); buffers live in ``buffer_dtype``; outside forward and backward the parameters, their ``.grad``
and ``state_dict()`` are in full precision, so the optimizer steps in full precision.

How graphddp does it differs, on purpose. PyTorch swaps each ``param.data`` for a low-precision copy before
forward and back after the all-reduce, from a comm hook (so no other hook can be registered, and a forward with
no backward leaves the parameters in low precision). graphddp runs the module on low-precision *copies* made by a
differentiable cast (``torch.func.functional_call``): the parameters never change dtype, autograd casts each
gradient back to the parameter's dtype on its way to ``.grad`` (an exact widening), and the Reducer's buckets are
planned in ``reduce_dtype`` (``MixedPrecision.reduce_dtype_of``), so the all-reduce runs in that dtype as in
PyTorch. Any comm hook can still be registered; ``no_sync`` accumulates in full precision. A ``torch.sparse``
gradient (``nn.Embedding(sparse=True)``) comes back through ``SparseGradCast`` (autograd's cast refuses a sparse
gradient) and is averaged in ``reduce_dtype`` as well (``buckets.SparseGradBucket.put`` casts it).

The average: graphddp scales each gradient by 1/world while copying it into its bucket (as PyTorch's default
Reducer does; in a ``reduce_dtype`` of 16 bits always, since only wider buckets may be averaged by the backend,
Note [Averaged on the wire] in ``graphddp.runtime.reductions``); PyTorch's mixed-precision hook divides after the
sum. In a low-precision ``reduce_dtype`` the two round differently when the world size is not a power of two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only


class SparseGradCast(torch.autograd.Function):
    """``param.to(dtype)`` whose backward casts a ``torch.sparse`` gradient back too: autograd's own cast refuses one
    ("to(options) doesn't support converting to a different layout"), so an ``nn.Embedding(sparse=True)`` could not
    run in ``param_dtype`` otherwise."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = param.dtype
        return param.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None  # keeps grad's layout, sparse or strided


@dataclasses.dataclass(frozen=True)
class FullPrecision:
    """No ``mixed_precision``: the module runs as it is."""

    def run(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], skip: frozenset[str], sparse_grads: frozenset[str]) -> Any:
        return module(*inputs, **kwargs)

    def reduce_dtype_of(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype

    def cast_buffers(self, module: nn.Module, skip: frozenset[str]) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """PyTorch's ``_MixedPrecision`` (any object with ``param_dtype``, ``reduce_dtype``, ``buffer_dtype``), see
    Note [Mixed precision]. A ``None`` dtype leaves that part in the tensor's own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"graphddp.DDP: mixed_precision.{field.name} must be a floating dtype or None, got {value!r}")

    @classmethod
    def of(cls, config: Any) -> FullPrecision | MixedPrecision:
        """The policy for ``DDP(mixed_precision=config)``."""
        if config is None:
            return FullPrecision()
        try:
            return cls(config.param_dtype, config.reduce_dtype, config.buffer_dtype)
        except AttributeError:
            raise TypeError(
                "graphddp.DDP: mixed_precision must be a torch.nn.parallel.distributed._MixedPrecision (param_dtype, "
                f"reduce_dtype, buffer_dtype), got {type(config).__name__}"
            ) from None

    def run(self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], skip: frozenset[str], sparse_grads: frozenset[str]) -> Any:
        """``module(*inputs, **kwargs)`` on ``param_dtype`` copies of its floating parameters (but ``skip``: the
        ignored ones) and floating inputs; gradients flow back to the full-precision parameters through the casts
        (``sparse_grads``: parameters autograd gives a ``torch.sparse`` gradient, cast by ``SparseGradCast``)."""
        if self.param_dtype is None:
            return module(*inputs, **kwargs)
        low = {
            # [same shape]: a differentiable cast, a new tensor each forward
            name: SparseGradCast.apply(p, self.param_dtype) if name in sparse_grads else p.to(self.param_dtype)
            for name, p in module.named_parameters()
            if p.is_floating_point() and name not in skip
        }
        inputs, kwargs = tree_map_only(torch.Tensor, self._cast_input, (inputs, kwargs))
        return torch.func.functional_call(module, low, inputs, kwargs, strict=False)

    def _cast_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.param_dtype) if x.is_floating_point() else x

    def reduce_dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of ``param``'s bucket: the all-reduce runs in it."""
        if not param.is_floating_point():
            return param.dtype
        return self.reduce_dtype or self.param_dtype or param.dtype

    def cast_buffers(self, module: nn.Module, skip: frozenset[str]) -> None:
        """Floating buffers (but the ignored ones) to ``buffer_dtype``, once, at construction (as PyTorch)."""
        if self.buffer_dtype is None:
            return
        for name, buffer in module.named_buffers():
            if buffer.is_floating_point() and name not in skip:
                buffer.data = buffer.to(self.buffer_dtype)
