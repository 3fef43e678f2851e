"""Embedding tables whose gradient is reduced as the rows a batch touched, and tied tables' parts.

Note [Row-sparse gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An embedding lookup's gradient touches only the rows of the tokens in the batch: a few hundred of a table's
thousands. Reduced as a dense bucket, the whole table travels; and since the table is used at the very start of
forward, its gradient is complete only at the very end of backward, with no backward left to hide its
all-reduce behind (the bench GPT's 16.8 MB table: 70 ms at 2 Gbit/s, all of it exposed).

The Reducer reduces such a gradient as rows (``graphddp.rows``):

1. each rank finds the rows its gradient touches (a scan of the bucket), and the ranks take the union of those
   sets with a small all-reduce of one byte per row;
2. if the union holds at most ``ROW_SPARSE_MAX_DENSITY`` (half) of the rows, the ranks all-reduce those rows
   only, packed ``[U, C]``, and scatter them back into the bucket; otherwise they all-reduce the bucket dense.

Both steps depend only on all-reduced data, so every rank takes the same branch, and the result never depends
on the gradient really being sparse: a table that some other code also uses simply goes dense.

Which gradients are candidates (``ParamSpec.row_sparse``): eagerly, the weights of ``nn.Embedding`` modules
that no other module shares (``embedding_tables``; a table that turns out dense costs a scan and the mask, and
stops being tried after a few iterations); compiled, a 2-D parameter that a captured graph brings in as an
input and uses in embedding lookups taking so few indices that all ranks together cannot touch more than half
of its rows (``row_sparse_params``). Those go sparse, except when ``.grad`` held a dense gradient before
backward (accumulated under ``no_sync``), when another graph uses the table too (a graph break between the
lookup and the output layer: no part can be split off across it), or when a dynamic batch grew past the size
the graph was captured with. A table that goes dense twice in a row is reduced dense from then on, and its
parts are dropped from the plan (``BucketPlan.without_rows``), so they do not travel on top of it.

A **tied** table (the GPT's ``wte``, also the output layer's weight) receives, at the *start* of backward, a
dense contribution from the output layer, which makes the sum dense. Compiled, graphddp splits it off: the
contribution of each other use is a *part* (``ParamSpec.part``), a slot of its own in the bucket of the segment
that computes it. A tap in the stitched graph (``tap_parts``) feeds the parameter to that segment; the tap's
backward hands the segment's contribution to the Reducer and passes nothing on to ``.grad``. The part is
all-reduced early, hidden behind the rest of backward; the lookups' rows go last, and they are few. Once both
are reduced, the Reducer adds the part into the parameter's gradient: all-reduce is linear, so the result is the
all-reduce of the sum, as in PyTorch's DDP. The bench GPT sends 2 MB after backward instead of 16.8 MB.

A parameter is treated so only when every use that is not a lookup comes after the last lookup in forward (its
part is then ready before the lookups' rows in backward; uses that send no gradient back, a ``.detach()`` or
anything under ``no_grad``, do not count) and, once the graph is cut, each part sits in a segment of its own,
apart from the lookups' segments (a tap feeds one segment's input, so two uses in one segment
cannot be told apart). ``plan_graph`` re-plans without the parameters for which the cut fails that
(``misplaced_parts``).

A tap passes its gradient on to ``.grad`` unchanged when its slot is not in the Reducer's plan, is already
filled, or the backward is not synchronised (``no_sync``): autograd then accumulates it with the parameter's
other contributions, before the parameter's gradient is complete, which is always correct. It also passes it on
when the backward will not accumulate into the parameter at all (``torch.autograd.grad``): that gradient is
the caller's, whole, and no bucket may move (``graphddp.taps``).

This module is pure: no ``torch.distributed``, no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch import fx, nn

from .graph_params import GraphParam, GraphUse, ready_groups
from .plan import BucketCaps, plan_bucket_groups
from .split import GraphSplit, Tap, assign_segments

ROW_SPARSE_MAX_DENSITY = 0.5
"""A row-sparse bucket is reduced as rows when at most this share of its rows is touched on some rank."""


@dataclasses.dataclass(frozen=True)
class RowSparseParam:
    """A parameter of a captured graph whose gradient can be reduced as rows."""

    name: str
    placeholder: str
    """The graph input that brings it in."""
    lookups: tuple[GraphUse, ...]
    """The embedding lookups of it: their contributions make the row-sparse gradient."""
    parts: tuple[GraphUse, ...]
    """Its other uses, all after the last lookup: each contribution is a part of its own."""


def row_sparse_params(params: Sequence[GraphParam], world_size: int) -> list[RowSparseParam]:
    """The 2-D parameters some node looks rows up in, whose other uses all come after the last lookup, and whose
    lookups on ``world_size`` ranks together touch at most ``ROW_SPARSE_MAX_DENSITY`` of the rows even when
    every index differs (so a tied table's part is never sent on top of a dense table; a position embedding
    looked up with ``arange(T)`` is left out)."""
    found = []
    for p in params:
        uses = [u for u in p.uses if u.differentiable]  # a detached or no_grad use sends no gradient back
        lookups = [u for u in uses if u.lookup]
        others = [u for u in uses if not u.lookup]
        if len(p.spec.shape) != 2 or not lookups:
            continue
        if not p.is_input:  # get_attr: copied into each segment, so there is no segment input to tap
            continue
        if any(u.position < lookups[-1].position for u in others):  # its part would be ready after the rows
            continue
        indices = [u.indices for u in lookups]
        if None in indices or world_size * sum(i or 0 for i in indices) > ROW_SPARSE_MAX_DENSITY * p.spec.shape[0]:
            continue  # the ranks might touch more than that share of the rows
        found.append(RowSparseParam(p.spec.name, p.node, tuple(lookups), tuple(others)))
    return found


def misplaced_parts(split: GraphSplit, row_sparse: Sequence[RowSparseParam]) -> set[str]:
    """Names of the parameters whose parts the cut did not put in segments of their own (see the Note)."""
    bad = set()
    for r in row_sparse:
        part_segments = [split.partition[u.node] for u in r.parts]
        lookup_segments = {split.partition[u.node] for u in r.lookups}
        if len(set(part_segments)) != len(part_segments) or lookup_segments & set(part_segments):
            bad.add(r.name)
    return bad


def plan_graph(
    gm: fx.GraphModule, params: Sequence[GraphParam], caps: BucketCaps, *, world_size: int, row_sparse: bool = True
) -> GraphSplit:
    """Plan the buckets of one captured graph and decide where to cut it: what the backend and ``graphddp
    inspect`` both run, so they always agree.

    With ``row_sparse``, embedding tables are planned as row-sparse gradients and tied tables' other uses as
    parts (Note [Row-sparse gradients]); a table whose parts the cut cannot separate is planned again without.
    ``world_size`` bounds how many rows the ranks can touch together.
    """
    candidates = row_sparse_params(params, world_size) if row_sparse else []
    while True:
        plan = plan_bucket_groups(ready_groups(params, {r.name: r.parts for r in candidates}), caps=caps)
        split = assign_segments(gm, params, plan)
        bad = misplaced_parts(split, candidates)
        if not bad:
            break
        candidates = [r for r in candidates if r.name not in bad]  # each round drops one at least: it ends
    taps = tuple(Tap(r.name, r.placeholder, u.node, split.partition[u.node]) for r in candidates for u in r.parts)
    return dataclasses.replace(split, taps=taps)


def tap_parts(split_gm: fx.GraphModule, split: GraphSplit, make_tap: Callable[[Tap], nn.Module]) -> None:
    """Feed each tapped parameter to its segment through ``make_tap(tap)``, a module added to ``split_gm``.

    ``split_gm`` is ``split_at_buckets(gm, split)``: its ``submod_K`` is segment K, called with the parameter's
    placeholder among its arguments; the tap's output replaces that argument.
    """
    if not split.taps:
        return
    graph = split_gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
    for k, tap in enumerate(split.taps):
        call, param = calls[f"submod_{tap.segment}"], placeholders[tap.placeholder]
        assert param in call.args, f"segment {tap.segment} does not take {tap.param} as an input"
        name = f"tap_{k}"
        split_gm.add_submodule(name, make_tap(tap))
        with graph.inserting_before(call):
            tapped = graph.call_module(name, (param,))
        call.args = tuple(tapped if a is param else a for a in call.args)
    graph.lint()
    split_gm.recompile()


def embedding_tables(module: nn.Module) -> frozenset[str]:
    """Trainable weights of ``nn.Embedding`` modules that no other module shares: their gradients touch only the
    looked-up rows (Note [Row-sparse gradients]). A tied table (also an output layer's weight) is left out: its
    gradient is dense unless the compile backend splits the other use off. (A module-level question, asked
    eagerly, where there is no graph: which tables to try as rows.)"""
    owners: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    names = {id(p): n for n, p in module.named_parameters()}
    return frozenset(
        names[id(m.weight)]
        for m in module.modules()
        if isinstance(m, nn.Embedding)
        and not m.sparse
        and m.max_norm is None
        and m.weight.requires_grad
        and m.weight.dim() == 2
        and owners[id(m.weight)] == 1
    )
