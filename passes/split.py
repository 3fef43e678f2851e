"""Cut a captured graph at bucket boundaries, so that each bucket's gradients come out of their own backward.

Note [Split at buckets]
~~~~~~~~~~~~~~~~~~~~~~~
A compiled graph runs its backward as one autograd node: every gradient appears at its end and no all-reduce
can start earlier. Cutting the forward graph into segments gives one backward node per segment; the segments'
backwards run in reverse forward order, and AccumulateGrad (hence the Reducer's hook) runs for a parameter as
soon as the segment holding its earliest use has run its backward (Note [Earliest use]).

The cut points come from the plan: bucket ``k`` is complete once backward has passed ``c_k``, the earliest
first use among its parameters. Segment boundaries are placed right before every ``c_k`` (nodes before the
smallest one join the first segment), so segment boundaries and bucket completions coincide: the bucket
completing in segment ``s`` is launched before segment ``s - 1`` starts its backward.

``torch.fx.passes.split_module`` needs every segment to produce a value used later (or by the output). A segment
whose nodes feed nothing outside it (only in-place updates, say) is merged into the segment after it, which makes
its buckets ready no later than planned; the merge is recorded (``Segment.extended``) and shown in dumps.

Buckets that complete at the same node (possible only with several dtypes) share a segment. A cut inside an
autocast region is fine: ``split_module`` leaves the region at the end of the segment and enters it again at the
start of the next, as DDPOptimizer relies on. A cut never falls inside a ``torch.no_grad()``/``enable_grad``
region: ``split_module`` re-enters the mode in each later segment but does not restore it at the end of a
segment, so the segment before the cut would hand on outputs computed with the mode switched; the cut moves to
the region's entry (a parameter's earliest *differentiable* use is never inside a no_grad region, so this moves
no bucket's completion in practice).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .graph_params import GraphParam
from .plan import BucketPlan, ParamSpec

if TYPE_CHECKING:  # a symbolic size means Dynamo loaded sympy already; plain sizes never need it
    import sympy


@dataclasses.dataclass(frozen=True)
class Segment:
    """One piece of the split graph, in forward order."""

    index: int
    """Forward position: segment 0 runs first in forward and last in backward."""
    buckets: tuple[int, ...]
    """Buckets whose gradients are complete once this segment's backward ran."""
    nodes: int
    """Graph nodes in the segment (placeholders and output excluded)."""
    param_bytes: int
    """Bytes of the parameters of its buckets."""
    inbound_bytes: int | sympy.Expr
    """Bytes of activations produced by earlier segments and used here or later: what crosses the boundary
    in front of this segment (symbolic when shapes are dynamic). 0 for segment 0."""
    extended: bool = False
    """True when a segment without outputs of its own was merged into this one (see the Note)."""


@dataclasses.dataclass(frozen=True)
class Tap:
    """A tied weight's input to one segment goes through a tap, whose backward takes that segment's
    contribution to the weight's gradient as a part of its own (Note [Row-sparse gradients] in ``passes/row_sparse.py``)."""

    param: str
    """The parameter's name."""
    placeholder: str
    """The graph input that brings the parameter in."""
    part: str
    """The part's key (``ParamSpec.part``): the node whose contribution it is."""
    segment: int
    """The segment fed through the tap."""


@dataclasses.dataclass(frozen=True)
class GraphSplit:
    """Where to cut one captured graph; pure data, computed without running anything."""

    plan: BucketPlan
    segments: tuple[Segment, ...]
    partition: dict[str, int]
    """Node name to segment index, for every node ``split_module`` asks about."""
    taps: tuple[Tap, ...] = ()
    """Where the parts of tied weights' gradients are taken off (Note [Row-sparse gradients])."""

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def assign_segments(gm: fx.GraphModule, params: Sequence[GraphParam], plan: BucketPlan) -> GraphSplit:
    """Decide which segment every node goes to (see Note [Split at buckets])."""
    nodes = list(gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    first_use = {p.spec.name: p.first_use for p in params}

    def ready_at(spec: ParamSpec) -> int | None:  # a part is ready after its own node's backward
        return position.get(spec.part) if spec.part else first_use.get(spec.name)

    completes_at = {
        b.index: min(at for at in map(ready_at, b.params) if at is not None)
        for b in plan.buckets
        if any(ready_at(p) is not None for p in b.params)
    }
    regions = _mode_regions(nodes)
    cuts = sorted({_outside_regions(pos, regions) for pos in completes_at.values()}) or [0]
    cuts[0] = 0  # nodes before the first parameter use belong to the first segment

    def segment_at(position: int) -> int:
        seg = 0
        for i, cut in enumerate(cuts):
            if position >= cut:
                seg = i
        return seg

    partition = {n.name: segment_at(i) for i, n in enumerate(nodes) if n.op not in ("placeholder", "output", "get_attr")}
    merged_into = _merge_segments_without_outputs(nodes, partition)
    # Renumber densely, keeping forward order.
    survivors = sorted(set(partition.values()))
    renumber = {old: new for new, old in enumerate(survivors)}
    partition = {name: renumber[seg] for name, seg in partition.items()}

    bucket_segment = {k: renumber[_final(segment_at(pos), merged_into)] for k, pos in completes_at.items()}
    extended = {renumber[_final(s, merged_into)] for s in merged_into}
    inbound = _inbound_bytes(nodes, partition, len(survivors))
    counts = [0] * len(survivors)
    for seg in partition.values():
        counts[seg] += 1
    segments = tuple(
        Segment(
            index=s,
            buckets=tuple(sorted(k for k, seg in bucket_segment.items() if seg == s)),
            nodes=counts[s],
            param_bytes=sum(plan.buckets[k].nbytes for k, seg in bucket_segment.items() if seg == s),
            inbound_bytes=inbound[s],
            extended=s in extended,
        )
        for s in range(len(survivors))
    )
    return GraphSplit(plan, segments, partition)


def _mode_regions(nodes: list[fx.Node]) -> list[tuple[int, int]]:
    """``(enter, exit)`` positions of ``torch.no_grad()``/``enable_grad`` regions in the graph: cuts move to a
    region's entry (Note [Split at buckets]). Autocast regions are cut like any code."""
    regions, open_grad = [], []
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled:
            if open_grad:
                regions.append((open_grad.pop(), i))
            else:
                open_grad.append(i)
    return regions


def _outside_regions(position: int, regions: list[tuple[int, int]]) -> int:
    moved = True
    while moved:
        moved = False
        for enter, exit_ in regions:
            if enter < position <= exit_:
                position, moved = enter, True
    return position


def split_at_buckets(gm: fx.GraphModule, split: GraphSplit) -> fx.GraphModule:
    """Cut ``gm`` into ``submod_0..submod_{n-1}`` with ``split_module``, following ``split.partition``."""
    return split_module(gm, None, lambda node: split.partition[node.name])  # type: ignore[arg-type]


def _merge_segments_without_outputs(nodes: list[fx.Node], partition: dict[str, int]) -> dict[int, int]:
    """Merge every segment that produces nothing used outside it into the next one; returns old -> new."""
    merged: dict[int, int] = {}
    while True:
        segments = sorted(set(partition.values()))
        if len(segments) <= 1:
            return merged
        lonely = next((s for s in segments if not _has_external_output(nodes, partition, s)), None)
        if lonely is None:
            return merged
        later = [s for s in segments if s > lonely]
        target = later[0] if later else max(s for s in segments if s < lonely)
        for name, seg in partition.items():
            if seg == lonely:
                partition[name] = target
        merged[lonely] = target


def _has_external_output(nodes: list[fx.Node], partition: dict[str, int], segment: int) -> bool:
    for node in nodes:
        if partition.get(node.name) != segment:
            continue
        for user in node.users:
            if user.op == "output" or partition.get(user.name, segment) != segment:
                return True
    return False


def _final(segment: int, merged_into: dict[int, int]) -> int:
    while segment in merged_into:
        segment = merged_into[segment]
    return segment


def _inbound_bytes(nodes: list[fx.Node], partition: dict[str, int], count: int) -> list[int | sympy.Expr]:
    """For each segment s > 0: bytes of values made before s and used at s or later (activations only)."""
    totals: list[int | sympy.Expr] = [0] * count
    for node in nodes:
        made = partition.get(node.name)
        if made is None:  # placeholders (inputs, parameters) and get_attr do not cross as activations
            continue
        used = [partition[u.name] for u in node.users if u.name in partition]
        if any(u.op == "output" for u in node.users):
            used.append(count - 1)
        if not used:
            continue
        size = tensor_bytes(node.meta.get("example_value", node.meta.get("val")))
        for s in range(made + 1, max(used) + 1):
            totals[s] = totals[s] + size
    return [t.simplify() if is_symbolic(t) else t for t in totals]


def is_symbolic(value: object) -> TypeGuard[sympy.Expr]:
    """Is ``value`` a sympy expression (a size under dynamic shapes)? Such a value exists only once sympy is loaded,
    so this never imports it."""
    sympy = sys.modules.get("sympy")
    return sympy is not None and isinstance(value, sympy.Expr)


def tensor_bytes(value: object) -> int | sympy.Expr:
    """Bytes of a (fake) tensor or a tuple of them; a sympy expression when a size is symbolic."""
    if isinstance(value, (tuple, list)):
        total: int | sympy.Expr = 0
        for v in value:
            total = total + tensor_bytes(v)
        return total
    if not isinstance(value, torch.Tensor):
        return 0
    numel: int | sympy.Expr = 1
    for size in value.shape:
        numel = numel * (size.node.expr if isinstance(size, torch.SymInt) else int(size))
    return numel * value.element_size()
