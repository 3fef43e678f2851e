"""Which parameters will get no gradient this iteration, decided once per forward.

Three small policies instead of flags in the hot hook:

* ``ExpectAllUsed`` (default): every parameter must get a gradient on every rank. The usage map is still
  all-reduced (a few bytes, after the last bucket) so that a parameter without a gradient, even on one rank
  only, becomes the same clear error on every rank instead of a hang.
* ``SearchEveryIteration`` (``find_unused_parameters=True``): walk the autograd graph from the forward's
  outputs; parameters not reached are marked ready at once (their bucket can launch), and parameters unused on
  every rank keep ``.grad`` as it was (the globally-unused bitmap of the VLDB 2020 paper).
* ``StaticGraph`` (``static_graph=True``): search in the first iteration only, then reuse the answer; no
  traversal and no usage all-reduce afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) forward output: tensors, lists, tuples, dicts, dataclass-like objects."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in find_tensors(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in find_tensors(getattr(obj, f.name))]
    return []


def reachable_params(outputs: Iterable[torch.Tensor], index_of: dict[int, int]) -> set[int]:
    """Indices of the parameters whose AccumulateGrad nodes the autograd graph of ``outputs`` reaches.

    ``index_of`` maps ``id(param)`` to the parameter's index in the Reducer.
    """
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    reached: set[int] = set()
    for t in outputs:  # an output that *is* a parameter (grad_fn None, requires_grad True)
        if t.requires_grad and id(t) in index_of:
            reached.add(index_of[id(t)])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in index_of:
            reached.add(index_of[id(variable)])
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached


class ExpectAllUsed:
    """Default: no parameter may miss its gradient (see the module docstring)."""

    allows_unused = False
    known_counts: list[int] | None = None
    """Per-parameter number of ranks that produced a gradient, when known without an all-reduce."""

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        return []

    def reduces_usage(self) -> bool:
        return True

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        pass


class SearchEveryIteration:
    """``find_unused_parameters=True``: one autograd-graph traversal per forward."""

    allows_unused = True
    known_counts: list[int] | None = None

    def __init__(self) -> None:
        self.traversals = 0

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        self.traversals += 1
        reached = reachable_params(find_tensors(outputs), index_of)
        return sorted(set(index_of.values()) - reached)

    def reduces_usage(self) -> bool:
        return True

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        pass


class StaticGraph(SearchEveryIteration):
    """``static_graph=True``: the first iteration's answer holds for every later one."""

    def __init__(self) -> None:
        super().__init__()
        self._frozen: list[int] | None = None

    def locally_unused(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        if self._frozen is not None:
            return self._frozen
        return super().locally_unused(outputs, index_of)

    def reduces_usage(self) -> bool:
        return self._frozen is None

    def observe(self, local_unused: list[int], global_counts: list[int] | None) -> None:
        if self._frozen is None:
            self._frozen = list(local_unused)
            self.known_counts = global_counts
