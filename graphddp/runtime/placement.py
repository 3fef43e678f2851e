"""The parameters as graphddp.DDP wrapped them, checked at every forward: the buckets were planned for them.

PyTorch's DDP is silent when the parameters change under it, and trains wrong: a parameter replaced after wrapping
(``load_state_dict(..., assign=True)``, ``to_empty``), added to a submodule, or unfrozen is never averaged (its
``.grad`` stays local: the replicas drift apart), and a parameter moved to another dtype or device has its gradient
cast silently. ``Placement.check`` raises instead, naming each parameter and what happened to it, at the next
forward. It costs one pass over the wrapped parameters (an identity, dtype, device and shape comparison each) and
one over the frozen ones per forward; a parameter *added* is seen by a ``register_module_parameter_registration_hook``
(torch's global hook, which costs nothing until a parameter is registered somewhere), then confirmed by one walk
of the module. A change made on some ranks only raises there (the others wait in their next collective until the
process group's timeout): make such changes on every rank, or rebuild the wrapper. Not seen: values changed in
place (``to_empty`` on the device the parameters are on, a checkpoint loaded on one rank without ``assign``): the
same objects, shapes and dtypes, only other numbers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

Entry = tuple[dict, str, str, torch.Tensor, torch.dtype, torch.device, torch.Size]
"""(owner's ``_parameters``, attribute, full name, the parameter, its dtype, device and shape when wrapped)."""


class Placement:
    """What ``check`` compares every forward against (see the module docstring)."""

    def __init__(self, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]], kept_local: frozenset[str]) -> None:
        self._module = module
        self._entries: list[Entry] = [_entry(module, n, p) for n, p in named_params]
        wrapped = {n for n, _ in named_params}
        self._frozen = [_entry(module, n, p) for n, p in module.named_parameters() if n not in wrapped and n not in kept_local]
        self._known = {n for n, _ in module.named_parameters()}
        self._modules = weakref.WeakSet(module.modules())
        self._maybe_added = False
        me = weakref.ref(self)

        def registered(owner: nn.Module, name: str, param: nn.Parameter | None) -> None:  # any module, anywhere
            placement = me()
            if placement is not None and owner in placement._modules:
                placement._maybe_added = True

        self._handle = nn.modules.module.register_module_parameter_registration_hook(registered)
        weakref.finalize(self, self._handle.remove)

    def check(self, rank: int) -> None:
        """Raise ``RuntimeError`` naming every parameter that changed since wrapping (nothing changed: no call per
        parameter)."""
        changed = False
        for params, attr, _, p, dtype, device, shape in self._entries:  # a loop, not any(): half the cost
            if params.get(attr) is not p or p.dtype != dtype or p.device != device or p.shape != shape:
                changed = True
                break
        if self._maybe_added and not changed:  # a registration somewhere in the module: was anything new added?
            self._maybe_added = False
            changed = not {n for n, _ in self._module.named_parameters()} <= self._known
        if changed or any(p.requires_grad for _, _, _, p, *_ in self._frozen):
            raise RuntimeError(self._describe(rank))

    def _describe(self, rank: int) -> str:
        problems = []
        for params, attr, name, p, dtype, device, shape in self._entries:
            now = params.get(attr)
            if now is not p:
                problems.append(f"{name!r} was replaced by another tensor (load_state_dict(..., assign=True), to_empty, or an assignment)")
            elif (p.dtype, p.device) != (dtype, device):
                problems.append(f"{name!r} is now {p.dtype} on {p.device}, but was {dtype} on {device}")
            elif p.shape != shape:
                problems.append(f"{name!r} changed shape from {list(shape)} to {list(p.shape)} (its .data was replaced)")
        problems += [f"{name!r} was frozen when wrapped and now requires a gradient" for _, _, name, p, *_ in self._frozen if p.requires_grad]
        problems += [f"{n!r} was added after wrapping" for n, _ in self._module.named_parameters() if n not in self._known]
        return (
            f"[rank {rank}] graphddp.DDP: the module's parameters changed after it was wrapped: " + "; ".join(problems)
            + ". Its gradients would not be averaged as planned (PyTorch's DDP trains on silently, the replicas drifting "
            "apart). Make such changes (dtype, device, loading with assign=True, adding or unfreezing parameters) "
            "before wrapping, or wrap the module again in a new graphddp.DDP."
        )


def _entry(module: nn.Module, name: str, p: nn.Parameter) -> Entry:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    return owner._parameters, attr, name, p, p.dtype, p.device, p.shape
