"""Find the trainable parameters of a captured graph and the node after whose backward each gradient is complete.

Note [Earliest use]
~~~~~~~~~~~~~~~~~~~
Backward visits the forward's nodes in reverse. A parameter used by several nodes receives one gradient
contribution per use, and autograd's AccumulateGrad for it runs once, after *all* contributions: after the
backward of its **earliest** use in forward. A tied weight (an embedding reused as the output layer) is therefore
ready only when the embedding's backward has run, at the very end of backward. PyTorch's DDPOptimizer assigns a
parameter to the bucket of its *last* use, which puts the tied weight in the first bucket: that bucket then
cannot launch until backward is over.

A use that sends no gradient back (``.detach()``, under ``no_grad``) counts too. Within one graph it has no
autograd edge; but once the graph is cut (Note [Split at buckets]), the segment holding that use takes the
parameter as an input, and the engine runs the parameter's AccumulateGrad only after that segment's backward. The
plan serves the split and the in-graph reduction alike, so it takes the split's (later) moment for both.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from .plan import ParamSpec


@dataclasses.dataclass(frozen=True)
class GraphUse:
    """One node that uses a parameter."""

    position: int
    """Position of the node in ``graph.nodes``."""
    node: str
    """The node's name."""
    lookup: bool
    """The node is an embedding lookup with the parameter as its table, whose gradient touches only the looked-up
    rows (``F.embedding``/``torch.embedding`` without ``max_norm`` or ``sparse``)."""
    differentiable: bool = True
    """Its output can carry a gradient back to the parameter (False for ``.detach()``, or inside ``no_grad``)."""
    positions: bool = False
    """A lookup whose indices are ``torch.arange(...)``: positions, every row up to the sequence length."""
    sparse_grad: bool = False
    """An embedding (or embedding-bag) lookup with ``sparse=True``: the table's gradient is a ``torch.sparse``
    tensor (``ParamSpec.sparse_grad``)."""
    matmul: bool = False
    """A linear layer or matmul by the parameter: its contribution is one matmul's (Note [Gradient pieces])."""


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
    uses: tuple[GraphUse, ...] = ()
    """Every node that uses it, in graph order (the first is ``first_user``)."""
    is_input: bool = True
    """``node`` is a placeholder (an input of the graph, as Dynamo lifts parameters), not a ``get_attr``."""


def find_graph_params(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    names_by_id: Mapping[int, str],
    bucket_dtypes: Mapping[str, torch.dtype] | None = None,
) -> list[GraphParam]:
    """Trainable parameters of ``gm`` with their earliest use, in graph order.

    A placeholder is a parameter when its example input is one of the tensors in ``names_by_id`` (``id(param)``
    to its name), which is how Dynamo passes lifted parameters: the real ``nn.Parameter`` objects. ``get_attr``
    nodes are resolved on ``gm``. Parameters that no node uses are left out: they get no gradient from this graph.
    ``bucket_dtypes``: a parameter's bucket dtype where it is not its own (``mixed_precision``'s reduce dtype).
    """
    bucket_dtypes = bucket_dtypes or {}
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
        users.sort(key=position.__getitem__)
        uses = tuple(_use(u, node, position[u]) for u in users)
        # Autograd makes the gradient sparse only if every use that sends one back is a sparse lookup.
        sparse_grad = all(u.sparse_grad for u in uses if u.differentiable) and any(u.differentiable for u in uses)
        name = names_by_id[id(value)]
        spec = ParamSpec.of(name, value, sparse_grad=sparse_grad, dtype=bucket_dtypes.get(name))
        sending = [u for u in users if _carries_gradient(u)]
        if len(sending) == 1 and _is_matmul(sending[0], node):  # Note [Gradient pieces]: it can go in blocks
            spec = dataclasses.replace(spec, one_matmul=True)
        found.append(GraphParam(spec, node.name, uses[0].position, uses[0].node, uses, node.op == "placeholder"))
    found.sort(key=lambda p: (position[_node(gm, p.node)], p.spec.name))
    return found


def ready_groups(
    params: Sequence[GraphParam], row_sparse: Mapping[str, Sequence[GraphUse]] | None = None
) -> list[list[ParamSpec]]:
    """Parameters in expected gradient-ready order, grouped by their earliest-use node.

    Groups come last-used-first (backward order). A group is indivisible: a node's parameters become ready
    together, so splitting them over two buckets could not give the two buckets different segments.
    ``row_sparse`` names the parameters whose gradient is reduced as rows, each with the uses whose
    contributions are split off as parts (Note [Row-sparse gradients] in ``passes/row_sparse.py``); a part is ready
    with the other parameters of its node.
    """
    row_sparse = row_sparse or {}
    by_node: dict[int, list[ParamSpec]] = {}
    for p in params:
        spec = p.spec
        if spec.name in row_sparse:
            for use in row_sparse[spec.name]:
                by_node.setdefault(use.position, []).append(spec.part_at(use.node, one_matmul=use.matmul))
            spec = dataclasses.replace(spec, row_sparse=True)
        by_node.setdefault(p.first_use, []).append(spec)
    return [by_node[pos] for pos in sorted(by_node, reverse=True)]


_MATMULS = {torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, torch.addmm, operator.matmul}
"""Ops whose weight gradient is one matmul (``dY^T X``), whose row blocks are matmuls of their own."""


def _is_matmul(user: fx.Node, weight: fx.Node) -> bool:
    """``user`` multiplies by ``weight``: a linear layer (the weight as its second argument) or a matmul."""
    if user.op != "call_function" or user.target not in _MATMULS:
        return False
    if user.target in (torch._C._nn.linear, torch.nn.functional.linear):
        return (user.args[1] if len(user.args) > 1 else user.kwargs.get("weight")) is weight
    return True


def _use(user: fx.Node, table: fx.Node, position: int) -> GraphUse:
    lookup = _is_lookup(user, table)
    return GraphUse(
        position,
        user.name,
        lookup,
        _carries_gradient(user),
        lookup and _is_arange(_lookup_input(user)),
        sparse_grad=bool((args := _embedding_args(user, table)) and args.get("sparse", False)),
        matmul=_is_matmul(user, table),
    )


def _value(node: Any) -> Any:
    """The fake value Dynamo recorded for ``node`` (None for constants and unknown nodes)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _carries_gradient(node: fx.Node) -> bool:
    """False when ``node``'s recorded output cannot carry a gradient (a detach, a use under ``no_grad``); True
    when it can or when nothing was recorded (a use must not be ignored on a guess)."""
    value = _value(node)
    tensors = [v for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, torch.Tensor)]
    return not tensors or any(t.requires_grad for t in tensors)


def _lookup_input(user: fx.Node) -> Any:
    """The index argument of an embedding lookup node."""
    if user.target is torch.nn.functional.embedding:
        return user.args[0] if user.args else user.kwargs.get("input")
    return user.args[1] if len(user.args) > 1 else user.kwargs.get("input")


def _is_arange(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start)


_EMBEDDING_ARGS = {
    torch.nn.functional.embedding: ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    torch.embedding: ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse"),
    torch.nn.functional.embedding_bag: (
        "input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse",
    ),
}


def _embedding_args(user: fx.Node, table: fx.Node) -> dict[str, Any] | None:
    """The arguments by name of ``user`` when it is an embedding (or bag) lookup in ``table``, else None."""
    names = _EMBEDDING_ARGS.get(user.target) if user.op == "call_function" else None
    if names is None:
        return None
    args = dict(zip(names, user.args)) | dict(user.kwargs)
    return args if args.get("weight") is table and args.get("input") is not table else None


def _is_lookup(user: fx.Node, table: fx.Node) -> bool:
    """Does ``user`` look rows of ``table`` up, with a dense gradient for ``table`` that touches only those rows?"""
    args = _embedding_args(user, table)
    # max_norm renormalises the looked-up rows in place; sparse=True makes a sparse gradient tensor (planned
    # apart: ``GraphUse.sparse_grad``); a bag's rows are not tracked.
    return (
        args is not None
        and user.target is not torch.nn.functional.embedding_bag
        and args.get("max_norm") is None
        and not args.get("sparse", False)
    )


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)
