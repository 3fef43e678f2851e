"""What the compile backend and a graphddp.DDP say to each other: a small typed interface, and which DDP is running.

``graphddp.DDP.forward`` runs its module between ``enter(reducer.compile_target)`` and ``leave()``; the backend,
called by Dynamo while it captures that module, asks ``running()`` whom it plans for. It sees only this
``CompileTarget`` (implemented by ``graphddp.runtime.target.ReducerTarget``, the Reducer's ``compile_target``), never
the DDP module or the Reducer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import fx

from ..passes import BucketCaps, BucketPlan, GraphParam, GraphSplit, ReductionChoice
from ..runtime.trace import Events


class PartSink(Protocol):
    """Where a tap's backward hands a part of a tied weight's gradient (``graphddp.compiler.gradient_tap``)."""

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        """True: the part is in its bucket slot. False: the tap must pass it on to ``.grad``."""
        ...


class CompileTarget(PartSink, Protocol):
    """What the backend needs from the DDP whose module Dynamo is capturing."""

    rank: int
    world_size: int
    channel_names: tuple[str, ...]
    """The groups buckets are reduced on, channel by channel (bucket i on ``bucket_channel(i, len(...))``), as
    functional collectives name them: the DDP's own first (Note [In-graph reduction], Note [Channels])."""
    abandon_signal: torch.Tensor
    """The in-graph variants' last input: the [1] float32 abandon signal, which requires grad (Note [Abandoned
    backward] in ``graphddp/runtime/iteration.py``)."""

    def caps_for_graph(self, gm: fx.GraphModule, params: Sequence[GraphParam], row_sparse: bool, *, blocks: bool = False) -> BucketCaps:
        """The caps to plan a newly captured graph with, its tables as rows or not (``rows_for_graph``): chosen
        for it, with ``bucket_cap_mb="auto"``, knowing whether its big gradients go in ``blocks`` (in-graph)."""
        ...

    @property
    def reduces_rows(self) -> bool:
        """Row-sparse tables and parts are in use (``graphddp.passes.rows_apply``)."""
        ...

    def rows_for_graph(self, params: Sequence[GraphParam]) -> bool:
        """Are a newly captured graph's tables planned as rows (``sparse_embedding_grads``; with ``"auto"``, where
        they pay: Note [Row-sparse gradients], "When rows pay")?"""
        ...

    @property
    def events(self) -> Events: ...

    def params_by_id(self) -> Mapping[int, str]:
        """``id(param)`` to name, for every parameter the Reducer covers."""
        ...

    def bucket_dtypes(self) -> Mapping[str, torch.dtype]:
        """Each parameter's bucket dtype (its own, or ``mixed_precision``'s reduce dtype): graph plans use it too."""
        ...

    def plan_for_graph(self, params: frozenset[str]) -> BucketPlan | None:
        """The plan already made for a graph with exactly these parameters: a recompile is cut by it."""
        ...

    def propose_graph_plan(self, graph: str, plan: BucketPlan, strategy: str = "split", *, requested: str = "auto") -> None:
        """A new graph's plan and how it reduces (its backend ``requested`` a reduction, and chose ``strategy``),
        adopted once every rank agrees (Note [Plan agreement] in ``graphddp.runtime.plans``)."""
        ...

    def graph_recompiled(self, params: frozenset[str], strategy: str, *, requested: str) -> None:
        """A graph with the parameters of one planned before was compiled again (cut by that plan) to reduce by
        ``strategy``, its backend ``requested`` a reduction: where the request and the strategy changed, it is
        proposed anew (Note [Plan agreement] in ``graphddp.runtime.plans``)."""
        ...

    def record_split(self, split: GraphSplit, reduction: ReductionChoice | None = None) -> None:
        """A graph compiled for this target was cut so, and reduces so (``splits``, ``reductions``: tools, tests)."""
        ...

    def in_graph_blockers(self) -> list[str]:
        """What in the DDP's set-up needs the Reducer's hooks (a comm hook, unused parameters, ...)."""
        ...

    def in_graph_wire(self) -> torch.dtype | None:
        """The dtype the in-graph all-reduces send (a compressing comm hook's; None: the gradients' own)."""
        ...

    def averages_alone(self) -> bool:
        """One rank under graphddp's own averaging: nothing to reduce, in-graph as in the Reducer."""
        ...

    def in_graph_step_key(self, names: Sequence[str]) -> int | None:
        """The key of an in-graph bucket's optimizer step node (None: no optimizer steps in backward; Note [Steps
        in the compiled backward] in ``graphddp/runtime/in_graph_steps.py``)."""
        ...

    def in_graph_rows_key(self, table: str) -> int:
        """The key of a table's dense streak, for in-graph rows nodes (Note [Rows in the compiled backward] in
        ``graphddp/runtime/in_graph_rows.py``)."""
        ...

    def reduces_in_graph(self, params: frozenset[str], can: bool) -> bool:
        """Asked by a compiled graph as it runs: its in-graph variant (True) or its split one? ``can``: it has an
        in-graph variant (Note [In-graph reduction])."""
        ...

    def tables_gone_dense_in_graph(self) -> frozenset[str]:
        """Tables planned as rows whose in-graph rows node gave up rows: an in-graph variant that still sends their
        parts is compiled again without them (``graphddp.compiler.in_graph.InGraphVariant``)."""
        ...


_running: list[CompileTarget] = []


# Called from graphddp.DDP.forward, whose frame Dynamo skips but whose callees it traces: kept out of the graph.
@torch.compiler.disable
def enter(target: CompileTarget) -> None:
    """Graphs Dynamo captures from now until ``leave()`` belong to ``target`` (nested DDPs: the innermost)."""
    _running.append(target)


@torch.compiler.disable
def leave() -> None:
    _running.pop()


def running() -> CompileTarget | None:
    """The target of the graphddp.DDP forward running now, if any."""
    return _running[-1] if _running else None
