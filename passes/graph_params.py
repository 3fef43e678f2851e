"""Find the trainable parameters of a captured graph and the node after whose backward each gradient is complete.

Note [Earliest use]
~~~~~~~~~~~~~~~~~~~
Backward visits the forward's nodes in reverse. A parameter used by several nodes receives one gradient
contribution per use, and autograd's AccumulateGrad for it runs once, after *all* contributions: after the
backward of its **earliest** use in forward. A tied weight (an embedding reused as the output layer) is therefore
ready only when the embedding's backward has run, at the very end of backward. PyTorch's DDPOptimizer assigns a
parameter to the bucket of its *last* use, which puts the tied weight in the first bucket: that bucket then
cannot launch until backward is over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .plan import ParamSpec


@dataclasses.dataclass(frozen=True)
class GraphParam:
    """A trainable parameter as the graph sees it."""

    spec: ParamSpec
    """Name (the DDP module's name for it), shape, dtype, device."""
    node: str
    """The placeholder or get_attr node that brings it into the graph."""
    first_use: int
    """Position (in ``graph.nodes`` order) of the earliest node that uses it; see Note [Earliest use]."""
    first_user: str
    """That node's name."""


def find_graph_params(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    names_by_id: Mapping[int, str],
) -> list[GraphParam]:
    """Trainable parameters of ``gm`` with their earliest use, in graph order.

    A placeholder is a parameter when its example input is one of the tensors in ``names_by_id`` (``id(param)``
    to its name), which is how Dynamo passes lifted parameters: the real ``nn.Parameter`` objects. ``get_attr``
    nodes are resolved on ``gm``. Parameters that no node uses are left out: they get no gradient from this graph.
    """
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: list[GraphParam] = []
    seen: set[int] = set()
    candidates: list[tuple[fx.Node, Any]] = list(zip(placeholders, example_inputs))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            candidates.append((node, _attr(gm, str(node.target))))
    for node, value in candidates:
        if not isinstance(value, torch.Tensor) or id(value) not in names_by_id or id(value) in seen:
            continue
        users = [u for u in node.users if u.op != "output"]
        if not users:
            continue
        seen.add(id(value))
        first = min(users, key=position.__getitem__)
        found.append(GraphParam(ParamSpec.of(names_by_id[id(value)], value), node.name, position[first], first.name))
    found.sort(key=lambda p: (position[_node(gm, p.node)], p.spec.name))
    return found


def ready_groups(params: Sequence[GraphParam]) -> list[list[ParamSpec]]:
    """Parameters in expected gradient-ready order, grouped by their earliest-use node.

    Groups come last-used-first (backward order). A group is indivisible: a node's parameters become ready
    together, so splitting them over two buckets could not give the two buckets different segments.
    """
    by_node: dict[int, list[ParamSpec]] = {}
    for p in params:
        by_node.setdefault(p.first_use, []).append(p.spec)
    return [by_node[pos] for pos in sorted(by_node, reverse=True)]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)
