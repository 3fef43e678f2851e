"""Plan one captured graph: its buckets, where to cut it, where to tap tied tables' parts.

The one function the compile backend and ``graphddp inspect`` both run (through ``graphddp.compiler.graph_pipeline``), so
what inspect shows is what a real run adopts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import fx

from .graph_params import GraphParam, ready_groups
from .plan import BucketCaps, BucketPlan, plan_bucket_groups
from .row_sparse import misplaced_parts, row_sparse_params
from .split import GraphSplit, assign_segments
from .taps import place_taps


def plan_graph(
    gm: fx.GraphModule,
    params: Sequence[GraphParam],
    caps: BucketCaps,
    *,
    row_sparse: bool = True,
    plan: BucketPlan | None = None,
) -> GraphSplit:
    """Plan the buckets of one captured graph and decide where to cut it.

    With ``row_sparse``, embedding tables are planned as row-sparse gradients and tied tables' other uses as
    parts (Note [Row-sparse gradients]); a table whose parts the cut cannot separate is planned again without.
    The result depends on the graph's structure and ``caps`` only, never on a batch, so ranks that captured the
    same code plan alike.

    ``plan``: cut by this plan instead of making one (a recompile of a graph whose plan the ranks already share:
    Note [Plan agreement] in ``graphddp/runtime/plans.py``). It must cover the graph's parameters; taps go only where its
    parts can still be placed.
    """
    if plan is not None:
        split = assign_segments(gm, params, plan)
        return dataclasses.replace(split, taps=place_taps(split, params, plan.parts))
    candidates = row_sparse_params(params) if row_sparse else []
    while True:
        made = plan_bucket_groups(ready_groups(params, {r.name: r.parts for r in candidates}), caps=caps)
        split = assign_segments(gm, params, made)
        bad = misplaced_parts(split, candidates)
        if not bad:
            break
        candidates = [r for r in candidates if r.name not in bad]  # each round drops one at least: it ends
    return dataclasses.replace(split, taps=place_taps(split, params, made.parts))
