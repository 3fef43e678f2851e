"""``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``: PyTorch's delayed all-reduce, its own object.

Some parameters are left out of the buckets: their gradients accumulate into one flat buffer of their own (each
``.grad`` a view of it), and one all-reduce of that buffer averages them, issued when autograd computes the
gradient of ``param_to_hook_all_reduce`` (a tensor hook, as in PyTorch: choose a parameter whose gradient comes
after theirs, e.g. the first layer's). Two differences from PyTorch's DDP, both on purpose:

* the collective is waited on at the end of backward (an autograd engine callback), so the averages are in
  ``.grad`` when ``backward()`` returns; PyTorch leaves the ``Work`` unwaited (on gloo the optimizer may read a
  half-reduced buffer);
* ``no_sync()`` micro-steps issue nothing: the buffer accumulates the micro-batches' gradients, and the
  synchronising step averages the sum, as for every other parameter; PyTorch's hook ignores ``no_sync``.

At least one parameter must stay in the buckets (PyTorch also runs with every parameter delayed; graphddp
refuses that: wrap nothing, or all-reduce yourself).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .launch_context import lend, no_backward_context, settle


class DelayedAllReduce:
    """The delayed parameters' flat gradient buffer and the hook that all-reduces it (see the module docstring)."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], hook_param: torch.nn.Parameter, *, group: dist.ProcessGroup, rank: int
    ) -> None:
        if not params:
            raise ValueError(f"[rank {rank}] graphddp.DDP: delay_all_reduce_named_params is empty; leave it and param_to_hook_all_reduce at None.")
        if not isinstance(hook_param, torch.Tensor) or not hook_param.requires_grad:
            raise ValueError(
                f"[rank {rank}] graphddp.DDP: param_to_hook_all_reduce must be a parameter that requires a gradient "
                f"(its gradient's computation triggers the delayed all-reduce), got {type(hook_param).__name__}."
            )
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(
                f"[rank {rank}] graphddp.DDP: the parameters of delay_all_reduce_named_params share one flat buffer, "
                f"so one dtype and device; got {sorted(map(str, kinds))}. Delay parameters of one dtype."
            )
        ((dtype, device),) = kinds
        self._params, self._group = list(params), group
        self._world = dist.get_world_size(group)
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self._views = [self.buffer[a:b].view(p.shape) for p, a, b in zip(params, offsets, offsets[1:])]
        self._sync = False  # set by each forward (before_forward)
        self._handle = hook_param.register_hook(self._all_reduce)

    @classmethod
    def of(
        cls, module: torch.nn.Module, names: tuple[str, ...], hook_name: str | None, *, group: dist.ProcessGroup, rank: int
    ) -> DelayedAllReduce | NoDelay:
        """The delayed all-reduce of ``module``'s parameters ``names`` (``named_delayed``), or none to do."""
        if hook_name is None:
            return NoDelay()
        params = dict(module.named_parameters())
        return cls([params[n] for n in names], params[hook_name], group=group, rank=rank)

    def before_forward(self, *, grad_enabled: bool, synchronising: bool) -> None:
        """PyTorch's ``_clear_grad_buffer``: gradients all reset (``zero_grad(set_to_none=True)``) zero the buffer;
        a missing ``.grad`` becomes its view, so autograd accumulates into the buffer in place, zeroed where others
        were kept (one optimizer reset its parameters, another accumulates): the view still holds the last
        average. A forward without gradients changes nothing (a prepared backward's all-reduce stays armed)."""
        if not grad_enabled:
            return
        self._sync = synchronising
        every_one_reset = all(p.grad is None for p in self._params)
        if every_one_reset:
            self.buffer.zero_()
        for p, view in zip(self._params, self._views):
            if p.grad is None:
                p.grad = view if every_one_reset else view.zero_()

    def _all_reduce(self, grad: torch.Tensor) -> torch.Tensor:
        if self._sync:
            self._sync = False  # once per backward, even if the hook parameter is used twice
            alias = lend(self.buffer)  # Note [A collective holds no Python object]
            with torch.no_grad(), no_backward_context():
                self.buffer.div_(self._world)  # before the sum, as PyTorch does
                work = dist.all_reduce(alias, group=self._group, async_op=True)
            settled = functools.partial(settle, [work], [alias], "the delayed parameters' buffer")
            del work  # only ``settled`` holds it, and drops it there
            torch.autograd.Variable._execution_engine.queue_callback(settled)
        return grad


class NoDelay:
    """No parameter delayed (the default)."""

    def before_forward(self, *, grad_enabled: bool, synchronising: bool) -> None:
        pass


def named_delayed(
    module: torch.nn.Module, named_params: Sequence[tuple[str, torch.nn.Parameter]] | None, hook_param: torch.nn.Parameter | None
) -> tuple[tuple[str, ...], str | None]:
    """(the delayed parameters' names, the hook parameter's name) in ``module``, as PyTorch's arguments give them:
    both or neither (PyTorch's ValueError and words)."""
    if (named_params is None) != (hook_param is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time.")
    if named_params is None:
        return (), None
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = []
    for name, param in named_params:
        if name_of.get(id(param)) != name:
            raise ValueError(
                f"graphddp.DDP: delay_all_reduce_named_params names {name!r}, which is not that parameter of the "
                "module (pass module.named_parameters() entries)."
            )
        names.append(name)
    if id(hook_param) not in name_of:
        raise ValueError("graphddp.DDP: param_to_hook_all_reduce must be a parameter of the module.")
    return tuple(names), name_of[id(hook_param)]
