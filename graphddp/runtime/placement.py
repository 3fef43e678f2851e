"""The parameters as graphddp.DDP wrapped them, checked at every forward: the buckets were planned for them.

PyTorch's DDP is silent when the parameters change under it, and trains wrong: a parameter replaced after wrapping
(``load_state_dict(..., assign=True)``, ``to_empty``), added to a submodule, or unfrozen is never averaged (its
``.grad`` stays local: the replicas drift apart), and a parameter moved to another dtype or device has its gradient
cast silently. ``Placement.check`` raises instead, naming each parameter and what happened to it, at the next
forward. It compares every wrapped parameter's identity, dtype, device and shape, and every frozen one's
``requires_grad``, per forward, without a Python call per parameter while nothing changed (Note [Placement checked
without a loop]); a parameter *added* is seen by a ``register_module_parameter_registration_hook``
(torch's global hook, which costs nothing until a parameter is registered somewhere), then confirmed by one walk
of the module. A change made on some ranks only raises there (the others wait in their next collective until the
process group's timeout): make such changes on every rank, or rebuild the wrapper. Not seen: values changed in
place (``to_empty`` on the device the parameters are on, a checkpoint loaded on one rank without ``assign``): the
same objects, shapes and dtypes, only other numbers.

Note [Placement checked without a loop]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The comparison runs every forward, so its cost is a term of every step: as a Python loop, about 0.6 µs per
parameter (45-66 µs for the bench GPT's 148 tensors, 1.7-3.2 ms for 5,000 small ones in `bench.checks`, where PyTorch's DDP checks nothing
per forward). So the forward first asks two questions that run without a Python frame per parameter:

* *the same objects?* ``map(operator.is_not, map(dict.get, owners, names), params)``, iterated by ``any``: C calls
  only, ~45 ns a parameter;
* *the same dtype, device and shape?* Dynamo's C++ tensor check (``torch._C._dynamo.guards.TensorGuards``, over
  the ``TensorCheck`` its tensor-match guards are made of), built over the wrapped and the frozen parameters: one
  C++ call, ~0.1-0.3 µs a parameter. It compares more than the loop does (the Python type, strides,
  ``requires_grad``, the dispatch keys, which ``torch.autocast`` and ``torch.inference_mode`` change), so a miss
  is not yet an error; a hit is a state the loop passed, so nothing the loop compares has changed.

Both yes: the forward goes on. Otherwise the loop runs and raises what it finds. When it finds nothing (a wrapped
parameter frozen, a forward under autocast), the guard of *that* state is kept (``StateGuards``): up to
``GUARD_STATES`` states, asked most recent first, the least recently seen dropped, so a run that alternates
between a few states (training under autocast, evaluating under ``inference_mode``) stays on the fast path. The
loop alone checks every forward, as before this Note, where the guard cannot serve:

* a parameter that is not a plain strided tensor (sparse CSR, nested, a tensor subclass): ``TensorGuards`` reads
  strides in C++, and for a CSR or nested tensor that read throws an error that ends the process;
* a torch without a ``TensorGuards`` of this signature (it is Dynamo's, not a public API; 2.4 to 2.13 have it);
* a run that meets ``MISSES_BEFORE_GIVING_UP`` new states in a row: it cycles through more states than are kept,
  and building a guard every forward would cost more than the loop.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

GUARD_STATES = 4
"""States of the parameters (autocast or not, frozen or not, ...) whose guards ``Placement`` keeps at once (Note
[Placement checked without a loop])."""
MISSES_BEFORE_GIVING_UP = 2 * GUARD_STATES
"""New states in a row, none seen again in between, after which ``StateGuards`` stops guarding: a run that cycles
through more states than it keeps would build a guard every forward, costing more than the loop alone."""

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
        # The fast path's inputs (Note [Placement checked without a loop]).
        self._owners = [params for params, *_ in self._entries]
        self._attrs = [attr for _, attr, *_ in self._entries]
        self._params = [p for _, _, _, p, *_ in self._entries]
        self._states = StateGuards(self._params + [p for _, _, _, p, *_ in self._frozen])
        self._states.remember()

    @property
    def guarded(self) -> bool:
        """Whether an unchanged forward is checked without the loop (False: every forward runs ``check_each``)."""
        return self._states.available

    def check(self, rank: int) -> None:
        """Raise ``RuntimeError`` naming every parameter that changed since wrapping; nothing changed: no Python
        call per parameter (Note [Placement checked without a loop])."""
        if self._unchanged():
            return
        self.check_each(rank)
        self._states.remember()  # nothing the loop compares changed: this state's guard, for the next forwards

    def _unchanged(self) -> bool:
        """The same objects, dtypes, devices and shapes as a state seen before (False: maybe not; ask the loop)."""
        if self._maybe_added:
            return False
        if any(map(operator.is_not, map(dict.get, self._owners, self._attrs), self._params)):
            return False
        return self._states.seen()

    def check_each(self, rank: int) -> None:
        """The loop: compare every parameter with its entry, raise naming every one that changed."""
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


class StateGuards:
    """Dynamo's C++ tensor check over fixed tensors, for the few states they were seen in (Note [Placement checked
    without a loop]): ``seen`` asks, ``remember`` keeps the current state."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = list(tensors)
        self._guards: list[Any] = []  # torch._C._dynamo.guards.TensorGuards, the most recently seen state last
        self._misses = 0
        self.available = all(map(_guardable, self._tensors))
        """False where the tensors are checked by the loop alone: a tensor the guard cannot read, no ``TensorGuards``
        in this torch, or states that never repeat."""

    def seen(self) -> bool:
        """The tensors are as in a kept state, asked from the most recent one; that state becomes the most recent."""
        guards = self._guards
        for i in range(len(guards) - 1, -1, -1):
            if guards[i].check(*self._tensors):
                if i != len(guards) - 1:
                    guards.append(guards.pop(i))
                self._misses = 0
                return True
        return False

    def remember(self) -> None:
        """Keep the tensors' current state (one the loop accepted), dropping the least recently seen beyond
        ``GUARD_STATES``; stop guarding after ``MISSES_BEFORE_GIVING_UP`` new states in a row."""
        if not self.available or self.seen():
            return
        if self._guards:
            self._misses += 1
            if self._misses > MISSES_BEFORE_GIVING_UP:
                self._give_up(f"{self._misses} new states in a row")
                return
        try:
            from torch._C._dynamo.guards import TensorGuards

            guard = TensorGuards(*self._tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        except (ImportError, TypeError, RuntimeError) as e:  # Dynamo's signature, not a public one: the loop alone
            self._give_up(f"no TensorGuards of the signature graphddp builds in this torch: {e}")
            return
        self._guards = [*self._guards[-(GUARD_STATES - 1):], guard]

    def _give_up(self, why: str) -> None:
        self.available = False
        self._guards = []
        logger.debug("graphddp.DDP: the parameters are checked in Python at every forward (%s)", why)


def _guardable(t: torch.Tensor) -> bool:
    """A tensor ``TensorGuards`` reads safely: plain, strided, not nested (it reads strides in C++, and a sparse CSR or
    nested tensor's throw there ends the process, past any ``except``); a subclass is left to the loop too."""
    return type(t) in (nn.Parameter, torch.Tensor) and t.layout == torch.strided and not t.is_nested
