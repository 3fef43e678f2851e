"""When gradients are reduced inside the compiled graph instead of by the Reducer: the runtime half of Note
[In-graph reduction] (``graphddp/compiler/in_graph.py``).

The compile backend compiles an in-graph variant beside the split one for a graph whose strategy is
``"in_graph"``; this gate says, per forward, which one runs. It is open (in-graph) for a synchronising forward
when every rank agreed on plans whose graphs all reduce in-graph and together cover every parameter of the
Reducer, nothing new is proposed, no rank has joined, and ``.grad`` holds no sum of ``no_sync`` micro-steps (the
step after them runs split, so the Reducer averages the whole accumulated gradient). While it is open the
Reducer's hooks are off, so no Python runs per gradient. A graph that cannot reduce in-graph, run while it is
open (a new graph, compiled mid-forward), closes it for the rest of the forward: the hooks are back and the
Reducer prepares as usual; a graph that already reduced in this forward is then averaged twice, which leaves the
same average on every rank. A graph the ranks agreed to reduce in-graph that this rank compiled again without an
in-graph variant (a recompile: ``graphddp.passes.parts_named_in`` found no match for a tied table's parts) raises:
the other ranks would issue collectives this rank does not. A forward that ran no compiled graph at all (the
module called eagerly, Dynamo's fallback to eager code) closes it at its end, before backward. Not detected: a parameter also used, with a
gradient, by eager code between two graphs (an op Dynamo cannot trace) while the graphs reduce in-graph; that
part of its gradient would not be averaged — ``reduction="split"`` for such a model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from .countdown import GradientHooks
from .in_graph_blocks import drop_pending
from .iteration import BackwardWatch
from .plans import PlanKeeper

logger = logging.getLogger(__name__)


class AbandonSignal:
    """Tells every rank that some rank abandoned an in-graph backward (Note [Abandoned backward] in
    ``graphddp.runtime.iteration``), with no collective of its own: one more element in the first bucket's
    all-reduce of the next in-graph backward (in a float32 all-reduce of its own where that bucket's dtypes, its
    gradients' and a compressing hook's, cannot count the ranks, and beside a table's rows).

    ``tensor`` ([1] float32, requires grad) is the last input of the first in-graph variant run in a training
    forward (later runs get ``spare``, zero, so it is summed once); its value is this rank's flag (1 once this
    rank abandoned a backward, until a backward carried it), and its gradient, after a backward, the flags summed
    over the ranks. Read without a host sync: copied to the host at the next training forward, looked at the one
    after (every rank alike, since every rank runs the same in-graph forwards). Some but not all ranks: every
    rank raises. All of them (a skip they agreed on): training goes on."""

    def __init__(self, device: torch.device, *, rank: int, world_size: int) -> None:
        self.tensor = torch.zeros(1, device=device, requires_grad=True)
        self.spare = torch.zeros(1, device=device, requires_grad=True)
        self._rank, self._world_size = rank, world_size
        self._told = False  # this rank's flag is set
        self._handed = False  # this forward's first in-graph run has the signal
        self._carried = False  # ... and its value was this rank's flag
        self._told_since_handed = False  # a later abandon set the flag again: it stays once the carried one is counted
        self._pending: tuple[torch.Tensor, Any, bool] | None = None  # (count on the host, copy's event, told here)

    def tell(self) -> None:
        """This rank abandoned its last in-graph backward: the next one carries the flag."""
        self._told = self._told_since_handed = True
        with torch.no_grad():
            self.tensor.fill_(1.0)

    def for_run(self) -> torch.Tensor:
        """The last input of an in-graph variant about to run: the signal for the forward's first run."""
        if self._handed:
            return self.spare
        self._handed, self._carried, self._told_since_handed = True, self._told, False
        return self.tensor

    def begin_training_forward(self) -> None:
        """Every training forward: raise what the count copied one forward ago says; start copying the count the
        last backward brought."""
        self._handed, self.spare.grad = False, None
        pending, self._pending = self._pending, None
        if pending is not None:
            host, event, told_here = pending
            if event is not None:
                event.synchronize()  # copied a whole iteration ago: nothing left to wait for
            self._check(float(host.item()), told_here)
        count = self.tensor.grad
        if count is None:
            return
        self.tensor.grad = None
        if count.device.type == "cuda":
            host = torch.empty(1, pin_memory=True)
            host.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event, self._carried)
        else:
            self._pending = (count.to("cpu"), None, self._carried)
        if self._carried:  # told once; a flag set since, by a later abandon (``tell`` runs first), stays
            self._carried = False
            if not self._told_since_handed:
                self._told = False
                with torch.no_grad():
                    self.tensor.zero_()

    def _check(self, count: float, told_here: bool) -> None:
        ranks = round(count)
        if 0 < ranks < self._world_size:
            here = " (this rank among them)" if told_here else ""
            raise RuntimeError(
                f"[rank {self._rank}] graphddp.DDP: {ranks} of {self._world_size} ranks{here} abandoned a backward "
                "(an exception inside it, caught) while gradients were reduced inside the compiled graph, two "
                "training forwards before this one; the other ranks averaged and stepped, so the replicas differ "
                "now. Skip a failed batch on every rank together, or rebuild the model from a checkpoint "
                "(Note [Abandoned backward] in graphddp/runtime/iteration.py)."
            )


class InGraphGate:
    """Per forward: does this iteration's backward reduce inside the compiled graphs? (see the module doc)"""

    def __init__(
        self, plans: PlanKeeper, hooks: GradientHooks, names: Iterable[str], *, rank: int, world_size: int, device: torch.device
    ) -> None:
        self._plans, self._hooks = plans, hooks
        self._names = frozenset(names)
        self._rank = rank
        self.signal = AbandonSignal(device, rank=rank, world_size=world_size)
        """Tells the other ranks of a backward abandoned here (every in-graph variant's last input)."""
        self.open = False
        """This forward's graphs reduce in-graph; the Reducer's hooks are off and it prepares nothing."""
        self._local_sum = False  # .grad holds no_sync micro-steps' gradients, not yet averaged
        self._covered: tuple[frozenset[frozenset[str]], bool] = (frozenset(), False)  # (agreed sets, they cover all)
        self.in_graph_forwards = 0
        """Runs of a compiled graph that reduced in-graph (the benchmark and tests read it)."""
        self._runs_before = 0  # in_graph_forwards when this forward began
        self._ran: set[frozenset[str]] = set()  # the parameter sets of this forward's in-graph runs
        self.watch = BackwardWatch()
        """Sees an in-graph backward that raised (the compiled graphs' switch hands it their outputs)."""

    def begin_forward(self, *, grad_enabled: bool, synchronising: bool, needs_hooks: bool) -> None:
        """At the start of every DDP forward, after the plan switch (a forward without gradients changes
        nothing: it has no backward). ``needs_hooks``: a rank has joined, or a feature set after compiling (a
        comm hook, ``step_in_backward``) needs the Reducer."""
        self._ran.clear()
        if self.watch.abandoned():
            logger.warning(
                "[rank %d] graphddp.DDP: the previous backward stopped before its end (an exception inside it) while "
                "its gradients were reduced inside the compiled graph; the next in-graph backward tells the other "
                "ranks, and two training forwards later every rank raises unless every rank dropped that backward "
                "(Note [Abandoned backward] in graphddp/runtime/iteration.py).", self._rank,
            )
            self.signal.tell()
            drop_pending()
        if not grad_enabled:
            return
        self.signal.begin_training_forward()
        agreed = self._plans.agreed_in_graph
        if agreed is not self._covered[0]:  # O(parameters) once per agreement, not per forward
            self._covered = (agreed, bool(agreed) and self._names <= frozenset().union(*agreed))
        covered = self._covered[1]
        self._set(synchronising and covered and not needs_hooks and not self._local_sum and not self._plans.proposing)
        self._local_sum = not synchronising
        self._runs_before = self.in_graph_forwards

    def reduced_in_graph(self) -> bool:
        """At the end of a synchronising forward: did its graphs reduce in-graph? If the gate was open but no
        compiled graph ran (the module called eagerly, or Dynamo fell back to eager code, e.g. past its recompile
        limit), it closes now, before backward: the hooks are back and the Reducer prepares, so nothing goes
        unreduced."""
        if self.open and self.in_graph_forwards == self._runs_before:
            logger.info("[rank %d] graphddp: this forward ran no compiled graph; the Reducer reduces its gradients", self._rank)
            self._set(False)
        return self.open

    def reduces_in_graph(self, params: frozenset[str], can: bool, *, steps: bool = False) -> bool:
        """Asked by each compiled graph as it runs: reduce in-graph (True), or run split (False)? ``steps``: its
        backward steps the optimizer (Note [Steps in the compiled backward])."""
        if not self.open:
            return False
        if can and params in self._plans.agreed_in_graph:
            if steps and params in self._ran:
                raise RuntimeError(
                    f"[rank {self._rank}] graphddp.DDP: a graph that steps the optimizer inside its compiled backward "
                    "(step_in_backward) ran twice in one forward (the same parameters: a block called twice, perhaps "
                    "across a graph break); each backward would step them on part of their gradient. Step after "
                    "backward instead, or compile with reduction='split' (Note [Steps in the compiled backward])."
                )
            self._ran.add(params)
            self.in_graph_forwards += 1
            return True
        agreed = params in self._plans.agreed_in_graph  # every other rank runs its in-graph variant ...
        if agreed and self._plans.graph_plans.strategy_for(params) != "split":  # ... unless compiled again split on purpose
            raise RuntimeError(
                f"[rank {self._rank}] graphddp.DDP: a graph that every rank agreed to reduce in-graph was compiled "
                "again on this rank without an in-graph variant (graphddp.compiler.backend's log line says why); the "
                "other ranks issue its in-graph all-reduces, which this rank cannot match. Compile the model with "
                "reduction='split' (graphddp.backend(..., reduction='split')) (Note [In-graph reduction])."
            )
        logger.info(
            "[rank %d] graphddp: a graph not agreed for in-graph reduction runs (a new graph?); this forward's "
            "gradients go through the Reducer (Note [In-graph reduction])", self._rank,
        )
        self._set(False)
        return False

    def _set(self, open_: bool) -> None:
        if open_ != self.open:
            self._hooks.detach() if open_ else self._hooks.attach()
            self.open = open_
