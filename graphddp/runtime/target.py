"""What the compile backend sees of a Reducer: its ``CompileTarget`` (``graphddp.compiler.compile_target``).

The backend plans each graph Dynamo captures for the Reducer whose module runs (caps, bucket dtypes, the plan a
recompile reuses), proposes the graph's plan, records how it cut the graph, and its taps hand parts of tied
weights' gradients over (``take_part``). ``ReducerTarget`` answers all of that from the Reducer's plans and
parameters, so the Reducer itself keeps to one iteration. It matches the compiler's protocols by structure: the
runtime imports nothing of the compiler.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from ..passes import BucketCaps, BucketPlan, GraphParam, GraphSplit, ReductionChoice, rows_apply
from .auto_caps import AutoCaps
from .channels import Channels
from .countdown import Countdown, GradientHooks, remove_all
from .in_graph import InGraphGate
from .in_graph_rows import gave_up as rows_gave_up
from .in_graph_rows import streak_key
from .in_graph_steps import bucket_key
from .optimizer_overlap import StepPerBucket
from .plans import PlanKeeper
from .reductions import CommHook, in_graph_wire, local_average
from .rows_rule import RowsRule
from .trace import Events
from .unused import GradientUsage

logger = logging.getLogger(__name__)


class TargetOwner(Protocol):
    """What a ``ReducerTarget`` asks of its Reducer: what changes while it lives (the comm hook, the events, the
    iteration a part belongs to)."""

    @property
    def comm_hook(self) -> CommHook: ...

    @property
    def events(self) -> Events: ...

    @property
    def usage(self) -> GradientUsage: ...

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool: ...


class ReducerTarget:
    """One Reducer's ``CompileTarget``, made once by it and held by it. It holds its Reducer weakly (taps and
    compiled segments hold it weakly too), so a dropped Reducer goes at once, its hooks with it."""

    def __init__(
        self,
        owner: TargetOwner,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        plans: PlanKeeper,
        *,
        rank: int,
        world_size: int,
        rows: RowsRule,
        auto_caps: AutoCaps | None,
        channels: Channels,
        countdown: Countdown,
        skip: bool,
    ) -> None:
        self._owner = weakref.ref(owner)
        self._named_params = list(named_params)
        self._by_name = dict(self._named_params)
        self._plans = plans
        self.rank, self.world_size = rank, world_size
        self._rows = rows  # sparse_embedding_grads (Note [Row-sparse gradients])
        self._auto_caps = auto_caps  # bucket_cap_mb="auto" (Note [Automatic caps])
        self._group = channels.groups[0]  # the DDP's own
        self.channel_names = channels.names
        """The groups buckets are reduced on, channel by channel, as functional collectives name them (in-graph
        reduction; Note [Channels] in ``graphddp.runtime.channels``)."""
        hooks = GradientHooks(countdown, [p for _, p in named_params])  # the Reducer's, on or off (the gate says)
        weakref.finalize(owner, remove_all, hooks.handles)  # gone with the Reducer
        self.gate = InGraphGate(
            plans, hooks, [n for n, _ in named_params], rank=rank, world_size=world_size, device=named_params[0][1].device
        )
        self._blockers = ["skip_all_reduce_unused_params"] if skip else []
        self._traced_hook: CommHook | None = None  # the comm hook the in-graph variants were traced with
        self.splits: list[GraphSplit] = []
        """How each graph compiled for this Reducer was cut, in compile order (whatever backend the user named)."""
        self.reductions: list[ReductionChoice] = []
        """How each graph compiled for this Reducer reduces its gradients, in compile order."""
        self._stepper: StepPerBucket | None = None  # step_in_backward's, for the in-graph variants' step nodes
        self._in_graph_without_steps = False  # a graph compiled in-graph before an optimizer was registered
        self._streak_keys: dict[str, int] = {}  # a table's dense streak in the compiled backward, per table

    def _reducer(self) -> TargetOwner:
        owner = self._owner()
        assert owner is not None, "a ReducerTarget outlived its Reducer"
        return owner

    @property
    def caps(self) -> BucketCaps:
        return self._plans.current.caps

    def caps_for_graph(self, gm: fx.GraphModule, params: Sequence[GraphParam], row_sparse: bool, *, blocks: bool = False) -> BucketCaps:
        """The caps to plan a newly captured graph with (its tables as rows or not): the plan's, or the automatic
        choice for this graph (its big gradients sent in ``blocks`` where it will be reduced in-graph)."""
        if self._auto_caps is None:
            return self.caps
        wire = self._reducer().comm_hook.wire_dtype  # a compressing hook's blocks and buckets, as sent
        return self._auto_caps.for_graph(gm, params, row_sparse=row_sparse, blocks=blocks, wire=wire)

    def rows_for_graph(self, params: Sequence[GraphParam]) -> bool:
        """Are a newly captured graph's tables planned as rows (``graphddp.runtime.rows_rule``)?"""
        return self.reduces_rows and self._rows.for_graph(params)

    @property
    def reduces_rows(self) -> bool:
        """Row-sparse tables and parts are in use (``graphddp.passes.rows_apply``): the Reducer's launcher asks too."""
        return rows_apply(
            enabled=self._rows.on,
            world_size=self.world_size,
            device=str(self._named_params[0][1].device),
            custom_comm_hook=self._reducer().comm_hook.custom,
        )

    @property
    def events(self) -> Events:
        return self._reducer().events

    def params_by_id(self) -> Mapping[int, str]:
        return {id(p): n for n, p in self._named_params}

    def bucket_dtypes(self) -> Mapping[str, torch.dtype]:
        return {s.name: s.dtype for s in self._plans.specs}

    def plan_for_graph(self, params: frozenset[str]) -> BucketPlan | None:
        return self._plans.plan_for_graph(params)

    def propose_graph_plan(self, graph: str, plan: BucketPlan, strategy: str = "split", *, requested: str = "auto") -> None:
        self._plans.propose(graph, plan, strategy, requested=requested)

    def graph_recompiled(self, params: frozenset[str], strategy: str, *, requested: str) -> None:
        if self._plans.graph_plans.restrategize(params, strategy, self._plans.current, requested=requested):
            logger.info(
                "[rank %d] graphddp: a graph compiled again reduces %s now; proposed anew, switched once every rank "
                "agrees (Note [Plan agreement])", self.rank, strategy.replace("_", "-"),
            )

    def record_split(self, split: GraphSplit, reduction: ReductionChoice | None = None) -> None:
        self.splits.append(split)
        if reduction is not None:
            self.reductions.append(reduction)
            self._in_graph_without_steps |= reduction.strategy == "in_graph" and self._stepper is None

    def step_in_backward(self, stepper: StepPerBucket) -> None:
        """``DDP.step_in_backward``: graphs compiled from now on step each bucket inside their compiled backward
        (Note [Steps in the compiled backward]); where that cannot be (one rank, or a graph already compiled
        in-graph without the step nodes) every graph runs split, where the Reducer steps."""
        self._stepper = stepper
        if self.averages_alone():
            self.block_in_graph("step_in_backward on one rank (the Reducer steps it)")
        elif self._in_graph_without_steps:
            self.block_in_graph("step_in_backward registered after a graph was compiled to reduce in-graph")

    def in_graph_step_key(self, names: Sequence[str]) -> int | None:
        """The key of the step node for a bucket of ``names`` in an in-graph variant being compiled; None: no
        optimizer steps in backward, so no node."""
        return bucket_key(self, names) if self._stepper is not None else None

    def in_graph_rows_key(self, table: str) -> int:
        """The key of ``table``'s dense streak, for the rows node of every in-graph variant compiled for this DDP
        (Note [Rows in the compiled backward])."""
        if table not in self._streak_keys:
            self._streak_keys[table] = streak_key(self, table)
        return self._streak_keys[table]

    def tables_gone_dense_in_graph(self) -> frozenset[str]:
        """Tables planned as rows whose in-graph rows node gave up rows: they go dense, without their mask, in
        every in-graph backward from now on, and an in-graph variant that sends a part of one is compiled again
        without it (the Reducer re-plans its own instead)."""
        return frozenset(table for table, key in self._streak_keys.items() if rows_gave_up(key))

    def step_bucket(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """A step node runs: step these parameters with their averaged gradients."""
        if self._stepper is not None:
            self._stepper.step_with([self._by_name[n] for n in names], grads)

    def step_rows(self, name: str, offset: int, grad: torch.Tensor) -> None:
        """A block of a big gradient is averaged: step those rows of parameter ``name`` now (``offset``: the
        block's first element in the flattened parameter; ``grad``: the block, whole rows, any shape; Note [Steps
        by rows])."""
        if self._stepper is not None:
            param = self._by_name[name]
            row = param.numel() // param.shape[0]
            assert offset % row == 0 and grad.numel() % row == 0, (name, offset, grad.shape)  # blocks are whole rows
            self._stepper.step_rows(param, offset // row, grad.view(-1, *param.shape[1:]))

    def block_in_graph(self, reason: str) -> None:
        """A feature that needs the Reducer's hooks is on (``step_in_backward``): graphs compiled from now stay split."""
        if reason not in self._blockers:
            self._blockers.append(reason)

    def in_graph_blockers(self) -> list[str]:
        """What needs the Reducer's hooks, so graphs compiled for it stay split (``choose_reduction``)."""
        owner = self._reducer()
        checks = (
            ("a comm hook other than the built-in allreduce/fp16/bf16 ones", in_graph_wire(owner.comm_hook, self._group) is False),
            ("a comm hook registered after a graph was compiled to reduce in-graph",
             self._traced_hook is not None and owner.comm_hook is not self._traced_hook),
            ("find_unused_parameters", owner.usage.policy.searches_each_iteration),
            ("mixed_precision reduces in another dtype", any(s.dtype != p.dtype for s, (_, p) in zip(self._plans.specs, self._named_params))),
        )
        return [*self._blockers, *(why for why, blocks in checks if blocks)]

    def begin_forward(self, *, grad_enabled: bool, synchronising: bool, joining: bool) -> None:
        """Every DDP forward, after the plan switch: does this one reduce in-graph (``graphddp.runtime.in_graph``)?
        Not while a feature registered after compiling needs the hooks (a comm hook, ``step_in_backward``), nor
        while the Reducer's events are recorded (a timeline of its buckets: as the steady hook, the full path),
        nor while an optimizer steps in backward over several graphs (Note [Steps in the compiled backward])."""
        owner = self._reducer()
        needs_hooks = (
            joining or bool(self._blockers) or owner.comm_hook is not self._traced_hook or owner.events.recording
            or owner.usage.policy.may_leave_unused  # static_graph: until its first iteration found every one used
            or self._stepper is not None and len(self._plans.agreed_in_graph) > 1  # steps in-graph: one graph only
        )
        self.gate.begin_forward(grad_enabled=grad_enabled, synchronising=synchronising, needs_hooks=needs_hooks)
        if self._stepper is not None:  # rows a backward stepped without finishing them (Note [Steps by rows])
            self._stepper.rows.forget()

    def in_graph_wire(self) -> torch.dtype | None:
        """The dtype a graph's in-graph all-reduce sends (None: the gradients' own), as the comm hook in force says
        (``graphddp.runtime.reductions.in_graph_wire``). That hook is remembered: one registered later sends every
        graph back to the split, where the Reducer runs it (``in_graph_blockers``, ``begin_forward``). Remembered
        once: a graph compiled after that registration (a recompile, perhaps on one rank only) must not make the new
        hook the traced one, or that rank's gate would open alone and issue in-graph collectives the others do not."""
        hook = self._reducer().comm_hook
        if self._traced_hook is None:
            self._traced_hook = hook
        wire = in_graph_wire(hook, self._group)
        assert wire is not False, "in_graph_blockers refuses this hook"
        return wire

    def averages_alone(self) -> bool:
        """One rank under graphddp's own averaging (``local_average``, the rule the Reducer's ``LocalReduction``
        follows): the in-graph variant reduces nothing either, as its traced hook says."""
        return local_average(self.world_size, self._reducer().comm_hook)

    @property
    def abandon_signal(self) -> torch.Tensor:
        """The in-graph variants' last input (Note [Abandoned backward]; ``graphddp.runtime.in_graph.AbandonSignal``)."""
        return self.gate.signal.tensor

    def abandon_signal_for_run(self) -> torch.Tensor:
        """What an in-graph variant about to run takes last: the signal for a forward's first run, else zero."""
        return self.gate.signal.for_run()

    def watch_backward(self, outputs: Any) -> None:
        """An in-graph graph ran: watch its backward for an exception (Note [Abandoned backward])."""
        self.gate.watch.watch(outputs)

    def reduces_in_graph(self, params: frozenset[str], can: bool) -> bool:
        """Asked by each compiled graph as it runs (``graphddp.compiler.in_graph.ReductionSwitch``)."""
        return self.gate.reduces_in_graph(params, can, steps=self._stepper is not None)

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        """A tap's backward offers a part of a tied weight's gradient: the Reducer takes it into its slot (True)
        or declines (False: the tap passes it on to ``.grad``)."""
        owner = self._owner()
        return owner is not None and owner.take_part(key, grad)
