"""The Reducer: turns per-parameter "gradient ready" signals into one collective per bucket, during backward.

Note [Reducer]
~~~~~~~~~~~~~~
One iteration, on every rank:

1. ``begin_forward`` (start of a DDP forward): raise what the previous backward left (a missing gradient), and
   switch plans if the ranks agreed on a new one (``graphddp.runtime.plans``, Note [Plan agreement]).
2. ``prepare_for_backward(outputs)`` (end of a synchronising forward): a fresh ``Iteration`` record
   (``graphddp.runtime.iteration``), every bucket reset, the plan-agreement all-reduce started, and the parameters the
   usage policy (``graphddp.runtime.unused``) finds unused marked ready at once.
3. Backward: a post-accumulate-grad hook per parameter fires when its ``.grad`` is final and marks its slot
   ready; a tap hands over a *part* of a tied weight's gradient, written into its slot at once (``take_part``).
   When a bucket is complete, its gradients go into their slices in one call (``graphddp.runtime.grad_layout``: one
   multi-tensor copy, not one per parameter: on a GPU the hook's Python is the backward's pace), and the launcher (``graphddp.runtime.launcher``) launches every bucket the
   index order allows, each through its reduction strategy (``graphddp.runtime.reductions``: dense through the comm
   hook, or an embedding table's rows). After the last bucket's collectives, the usage all-reduce (which
   parameters got a gradient, summed over ranks), on the DDP's own group like every collective of graphddp's:
   after the last launch, or, with a hook that may chain collectives (``ChainedLaunch``), after the last wait.
   The first hook queues ``_finalize`` as an autograd engine callback.
4. ``_finalize`` (end of backward): fill in parameters that got no gradient (zeros, or their current ``.grad``)
   so every bucket is launched on every rank (never a hang), await the buckets in index order and write each
   one's averages into ``.grad`` at once (for the gradients this rank produced) while later buckets are still in
   flight; the rest once the usage all-reduce has said which parameters some rank used (unused on *every* rank:
   ``.grad`` stays as it was), adding a tied weight's reduced parts in. A missing gradient becomes an error for
   the next forward, the same on every rank, when the policy forbids it.

Under compiled autograd the hooks run eagerly between the pieces of the compiled backward (the trampoline is
``torch.compiler.disable``d), but its engine runs no queued callback: step 4 then runs in the hook that launches
the last bucket, so every parameter must get a gradient or be found unused (else the next forward says so).

A joined rank (``join``) runs ``shadow_backward`` instead: the same collectives, on zeros, through the same
launcher. The Reducer does not care where its plan came from: ``adopt(plan)`` installs any plan.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import fx

from ..passes import BucketCaps, BucketPlan, GraphParam, GraphSplit, ParamSpec, rows_apply
from .auto_caps import AutoCaps
from .buckets import BucketSlots, FlatBucket
from .comm import AverageState, CudaCommStream, HostComm, average_allreduce_hook
from .grad_layout import BucketViewGrads, CopiedGrads, fill
from .iteration import Iteration
from .join import ActiveRanks
from .launcher import ChainedLaunch, EagerLaunch, Launcher, launch_policy
from .optimizer_overlap import NoStep, StepPerBucket
from .plans import PlanKeeper
from .profiling import trace_artifact
from .reductions import CommHook, RowSparseReduction, SkippedReduction, dense_reduction
from .trace import Events, NullEvents
from .unused import ExpectAllUsed, GradientUsage, UsagePolicy, ready_twice

logger = logging.getLogger(__name__)


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters (see Note [Reducer]). Also the compile
    backend's ``CompileTarget`` (``graphddp.compiler.compile_target``)."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        plan: BucketPlan,
        *,
        process_group: dist.ProcessGroup,
        collective_device: torch.device,
        gradient_as_bucket_view: bool = False,
        usage: UsagePolicy | None = None,
        comm: HostComm | CudaCommStream | None = None,
        active_ranks: ActiveRanks | None = None,
        sparse_embedding_grads: bool = True,
        skip_unused: bool = False,
        auto_caps: AutoCaps | None = None,
    ) -> None:
        self._names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        self._placed = [(p.dtype, p.device) for p in self._params]  # as planned; begin_forward checks it holds
        self._index_of_name = {n: i for i, n in enumerate(self._names)}
        self._index_of_id = {id(p): i for i, p in enumerate(self._params)}
        self._group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._layout = BucketViewGrads() if gradient_as_bucket_view else CopiedGrads()
        self._comm = comm if comm is not None else HostComm()
        self.usage = GradientUsage(
            self._names, usage if usage is not None else ExpectAllUsed(),
            group=process_group, device=collective_device, rank=self.rank, world_size=self.world_size,
        )
        self._active = active_ranks if active_ranks is not None else ActiveRanks(self.world_size)
        self._events: Events = NullEvents()
        self._rows_enabled = sparse_embedding_grads
        self._skip_unused = skip_unused  # skip_all_reduce_unused_params (reductions.SkippedReduction)
        self._skipped: frozenset[int] = frozenset()  # buckets launched without a collective
        self._skip_basis: frozenset[int] = frozenset()  # the never-used parameters they were chosen from
        state = AverageState(process_group)
        state.divisor = 1  # the Reducer scales while copying into the bucket: the default hook only sums
        self._hook = CommHook(state, average_allreduce_hook, custom=False)
        self._policy: EagerLaunch | ChainedLaunch = EagerLaunch()
        self._after_bucket: NoStep | StepPerBucket = NoStep()

        # As planned: marks (row-sparse, sparse) and bucket dtype (mixed_precision) carry over to every re-plan.
        planned = {s.name: s for b in plan.buckets for s in b.params if not s.part}
        specs = [planned.get(n) or ParamSpec.of(n, p) for n, p in named_params]
        self._auto_caps = auto_caps  # bucket_cap_mb="auto" (Note [Automatic caps])
        self.plans = PlanKeeper(specs, plan, group=process_group, device=collective_device, auto_caps=auto_caps)
        self._iteration: Iteration | None = None
        self._pending_error: str | None = None
        self.splits: list[GraphSplit] = []
        """How each graph compiled for this Reducer was cut, in compile order (whatever backend the user named)."""
        self.adopt(plan)

        me = weakref.ref(self)
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready_trampoline, me, i))
            for i, p in enumerate(self._params)
        ]
        weakref.finalize(self, _remove_all, handles)  # a discarded Reducer leaves no hooks behind

    # -- plan ------------------------------------------------------------------------------------------------
    def adopt(self, plan: BucketPlan) -> None:
        """Install ``plan``: new flat buffers, gradients moved into their new slices (bucket views follow)."""
        if self._iteration is not None:
            raise RuntimeError(
                f"[rank {self.rank}] graphddp: cannot change the bucket plan while a backward is in flight; "
                "adopt a plan between iterations."
            )
        if (problem := plan.coverage_problem(self._names)) is not None:
            raise ValueError(f"[rank {self.rank}] graphddp: {problem}")
        slots = BucketSlots(plan, self._params, self._index_of_name, self._layout)
        for i, p in enumerate(self._params):
            slots.layout[i].move(p, slots.view(slots.slot[i]))
        self._slots, self.plans.current = slots, plan
        self._launcher = self._make_launcher()  # new buckets: every row-sparse one tries rows again
        trace_artifact(
            "graphddp_bucket_plan",
            lambda: f"rank {self.rank}, {plan.source}, fingerprint {plan.fingerprint}\n"
            + tabulate(plan.table_rows(), headers=plan.TABLE_HEADERS),
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "[rank %d] bucket plan (%s, fingerprint %s):\n%s",
                self.rank, plan.source, plan.fingerprint, tabulate(plan.table_rows(), headers=plan.TABLE_HEADERS),
            )

    def _make_launcher(self) -> Launcher:
        dense = dense_reduction(self._hook, self._comm, self.rank)
        never_used = self._skip_basis = self.usage.never_used if self._skip_unused else frozenset()
        self._skipped = frozenset(
            b.index for b in self._slots.buckets if not any(p.part for p in b.spec.params) and never_used.issuperset(b.param_indices)
        )
        reductions = [
            SkippedReduction(dense)
            if bucket.index in self._skipped
            else RowSparseReduction(dense, group=self._group)
            if self.reduces_rows and bucket.spec.row_sparse
            else dense
            for bucket in self._slots.buckets
        ]
        return Launcher(self._slots.buckets, reductions, self._policy, self._events)

    @property
    def plan(self) -> BucketPlan:
        return self.plans.current

    @property
    def buckets(self) -> list[FlatBucket]:
        return self._slots.buckets

    def set_comm_hook(self, state: Any, hook: Any) -> None:
        self._hook = CommHook(state, hook, custom=True)
        self._policy = launch_policy(hook)
        self._launcher = self._make_launcher()  # a hook reduces dense buckets, as PyTorch hands them over
        parts = {p.label for plan in (self.plan, self.plans.graph_plans.proposed) if plan is not None for p in plan.parts}
        if parts:
            logger.warning(
                "[rank %d] graphddp: a comm hook was registered after torch.compile split tied tables' gradients "
                "into parts (%s); with a hook every bucket is reduced dense, so those tables now travel twice. "
                "Register the hook before the first compiled forward.",
                self.rank, ", ".join(sorted(parts)),
            )

    def set_after_bucket(self, after: NoStep | StepPerBucket) -> None:
        """What happens once a bucket's averages are in ``.grad``: nothing, or its optimizer step (Note
        [Optimizer overlap] in ``graphddp.runtime.optimizer_overlap``)."""
        self._after_bucket = after

    def set_usage_policy(self, policy: UsagePolicy) -> None:
        """How unused parameters are found from now on (``_set_static_graph`` before the first iteration)."""
        self.usage.set_policy(policy)

    @property
    def compile_target(self) -> Any:
        """What the compile backend plans for while this Reducer's module runs (``graphddp.compiler.compile_target``)."""
        return self

    @property
    def has_custom_comm_hook(self) -> bool:
        return self._hook.custom

    # -- the compile backend's interface (graphddp.compiler.compile_target.CompileTarget) -------------------------------
    @property
    def caps(self) -> BucketCaps:
        return self.plan.caps

    def caps_for_graph(self, gm: fx.GraphModule, params: Sequence[GraphParam]) -> BucketCaps:
        """The caps to plan a newly captured graph with: the plan's, or the automatic choice for this graph."""
        if self._auto_caps is None:
            return self.caps
        return self._auto_caps.for_graph(gm, params, row_sparse=self.reduces_rows)

    @property
    def reduces_rows(self) -> bool:
        return rows_apply(
            enabled=self._rows_enabled,
            world_size=self.world_size,
            device=str(self._params[0].device),
            custom_comm_hook=self._hook.custom,
        )

    @property
    def events(self) -> Events:
        return self._events

    @events.setter
    def events(self, events: Events) -> None:
        self._events = self._launcher.events = events

    def params_by_id(self) -> Mapping[int, str]:
        return {id(p): n for n, p in zip(self._names, self._params)}

    def bucket_dtypes(self) -> Mapping[str, torch.dtype]:
        return {s.name: s.dtype for s in self.plans.specs}

    def plan_for_graph(self, params: frozenset[str]) -> BucketPlan | None:
        return self.plans.plan_for_graph(params)

    def propose_graph_plan(self, graph: str, plan: BucketPlan) -> None:
        self.plans.propose(graph, plan)

    def record_split(self, split: GraphSplit) -> None:
        self.splits.append(split)

    # -- iteration -------------------------------------------------------------------------------------------
    def begin_forward(self, grad_enabled: bool) -> None:
        """Step 1 of Note [Reducer], on every rank alike."""
        if self._iteration is not None and self._iteration.finalize_at_last_launch:
            self._iteration = None
            raise RuntimeError(
                f"[rank {self.rank}] graphddp.DDP: the previous backward ran under compiled autograd and ended "
                "before every bucket was complete (some parameter got no gradient). Under compiled autograd the "
                "Reducer finishes when the last bucket is launched, so every parameter must get a gradient or be "
                "found unused: pass find_unused_parameters=True, or run that backward without compiled autograd."
            )
        if self._iteration is not None and not self._iteration.finalize_queued:
            self._iteration = None  # the previous forward had no backward: nothing is in flight
        if self._pending_error is not None:
            message, self._pending_error = self._pending_error, None
            raise RuntimeError(message)
        self._check_placement()
        self.switch_plan(grad_enabled)
        if grad_enabled:
            self.plans.training_forwards += 1  # sent with the next agreement: ranks out of step are found

    def _check_placement(self) -> None:
        """A parameter moved to another dtype or device after wrapping no longer fits its bucket: say which,
        instead of casting its gradient silently as PyTorch's DDP does (docs/reliability.md)."""
        for i, p in enumerate(self._params):
            if (p.dtype, p.device) != self._placed[i]:
                dtype, device = self._placed[i]
                raise RuntimeError(
                    f"[rank {self.rank}] graphddp.DDP: parameter {self._names[i]!r} is now {p.dtype} on {p.device}, "
                    f"but was {dtype} on {device} when graphddp.DDP wrapped the module; its bucket was planned for "
                    "that. Change dtypes and devices (model.to(...), .half(), .double()) before wrapping."
                )

    def switch_plan(self, grad_enabled: bool) -> None:
        """Adopt the plan the ranks agreed on, if any (collective: every rank, joined ones too, calls it)."""
        gone_dense = [
            self._names[bucket.param_indices[0]]
            for bucket, reduction in zip(self.buckets, self._launcher.reductions)
            if reduction.gave_up and self._slots.parts_of.get(bucket.param_indices[0])
        ]
        plan = self.plans.next_plan(
            grad_enabled=grad_enabled, allows_unused=self.usage.policy.allows_unused, gone_dense=gone_dense
        )
        if plan is not None:
            self.adopt(plan)

    def prepare_for_backward(self, outputs: Any) -> None:
        """Step 2 of Note [Reducer]: arm the hooks for the backward of this forward."""
        for bucket in self.buckets:
            bucket.reset()
        self._launcher.reset()
        self.plans.ready_order.restart()
        divisor = None if self._hook.custom else self._active.divisor()  # a custom hook averages itself
        self._iteration = Iteration(
            local_unused=self.usage.policy.locally_unused(outputs, self._index_of_id),
            prescale=1.0 / divisor if divisor not in (None, 1) else None,
        )
        if self._iteration.local_unused:  # they may launch a bucket now: the agreement goes first
            self._start_agreement(self._iteration)
        for i in self._iteration.local_unused:
            self._mark_ready(i)
            for where in self._slots.parts_of.get(i, ()):  # no gradient reaches it, through a tap neither
                self._mark_part_ready(where, None)

    def on_grad_ready(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (step 3 of Note [Reducer])."""
        self.usage.used[i] = True  # also under no_sync(): a parameter used in any micro-batch counts as used
        iteration = self._iteration
        if iteration is None:  # no_sync(), or a backward that no DDP forward prepared: accumulate locally
            return
        if not iteration.finalize_queued:
            self._queue_finalize(iteration)
        bucket, slot = self._slots.slot[i]
        if self.buckets[bucket].is_ready(slot):
            raise RuntimeError(ready_twice(self.rank, self._names[i], marked_unused=i in iteration.local_unused))
        self.plans.ready_order.observe(i)
        self._mark_ready(i)

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        """A tap's backward offers one part of a tied weight's gradient (``graphddp.compiler.gradient_tap``). True: it is in
        its slot; False: the tap must pass it on to ``.grad`` (not synchronising, no such slot, or filled)."""
        iteration = self._iteration
        where = self._slots.part_slot.get(key) if iteration is not None else None
        if iteration is None or where is None or self.buckets[where[0]].is_ready(where[1]):
            return False
        self.usage.used[self.buckets[where[0]].param_indices[where[1]]] = True
        if not iteration.finalize_queued:
            self._queue_finalize(iteration)
        self._mark_part_ready(where, grad)
        return True

    def _start_agreement(self, iteration: Iteration) -> None:
        """The iteration's first collective, before any bucket's: only once a backward begins (or a bucket of
        unused parameters launches), so a forward without backward on one rank issues nothing."""
        if not iteration.agreement_started:
            iteration.agreement_started = True
            self.plans.start_agreement()

    def _queue_finalize(self, iteration: Iteration) -> None:
        self._start_agreement(iteration)
        iteration.finalize_queued = True
        if _compiled_autograd_running():
            iteration.finalize_at_last_launch = True  # its engine runs no queued callback (Note [Reducer])
        else:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _mark_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final; it is copied into the bucket with the bucket's others, once the
        bucket is complete (``_slot_filled``)."""
        where = self._slots.slot[i]
        self._events.record("ready", where[0], self._names[i])
        self._slot_filled(where)

    def _mark_part_ready(self, where: tuple[int, int], grad: torch.Tensor | None) -> None:
        assert self._iteration is not None
        fill(self._slots.view(where), grad, self._iteration.prescale)  # None: no contribution this iteration
        self._events.record("ready", where[0], self.buckets[where[0]].spec.params[where[1]].label)
        self._slot_filled(where)

    def _slot_filled(self, where: tuple[int, int]) -> None:
        bucket = self.buckets[where[0]]
        if not bucket.mark_ready(where[1]):
            return
        self._gather(bucket)
        if self._launcher.launch_ready():
            if not self._policy.chains:  # else a hook's chained collectives may still come: count after the waits
                self._reduce_usage()
            assert self._iteration is not None
            if self._iteration.finalize_at_last_launch:
                self._finalize()

    def _gather(self, bucket: FlatBucket) -> None:
        """A complete bucket's gradients into its buffer, in one call (parts are in their slots already)."""
        assert self._iteration is not None
        slots = [slot for slot, spec in enumerate(bucket.spec.params) if not spec.part]
        if slots:
            params = [bucket.params[slot] for slot in slots]
            # One layout per bucket: the dense one, or SparseGrads for a bucket of its own.
            self._slots.layout[bucket.param_indices[slots[0]]].to_bucket_many(
                params, [bucket.views[slot] for slot in slots], self._iteration.prescale
            )

    def _reduce_usage(self) -> None:
        """After the buckets' collectives: count on how many ranks each parameter got a gradient
        (``graphddp.runtime.unused``), on the DDP's own group, at the same point of the collective sequence as a joined
        rank's ``shadow_backward``: after the last bucket's every collective."""
        iteration = self._iteration
        assert iteration is not None
        if not iteration.usage_counting:
            iteration.usage_counting = True
            self._launcher.flush()
            iteration.usage = self.usage.start_count()

    def _finalize(self) -> None:
        """End of backward (step 4 of Note [Reducer])."""
        iteration = self._iteration
        assert iteration is not None
        try:
            self._events.record("finalize")
            self.plans.ready_order.compute_ended()
            missing = self._fill_missing()
            used_here = self.usage.used  # a gradient produced here: some rank used it, whatever the usage all-reduce says
            later = []  # buckets with a parameter not used here: final only once the usage count is in
            for bucket, reduced in self._launcher.reduced_in_order():
                self._events.record("wait", bucket.index)
                self._comm.join_compute()  # on CUDA: the compute stream waits for the collective's result
                bucket.take(reduced)
                # Gradients this rank produced are written back now, while later buckets are still in flight.
                whole = [i for i, spec in zip(bucket.param_indices, bucket.spec.params) if not spec.part]
                self._write_back_many([i for i in whole if used_here[i]])
                self._events.record("written", bucket.index)
                if all(used_here[i] for i in whole):
                    self._bucket_final(bucket.index, whole)
                else:
                    later.append((bucket.index, whole))
            self._reduce_usage()  # ChainedLaunch: only now, after every bucket (and its hook's chain) is done
            counts = self.usage.counts(iteration.usage)
            self._reduce_late(counts)
            self._comm.join_compute()
            for i, used in enumerate(used_here):  # the rest, once the ranks' usage is known
                if not used and counts[i] > 0:  # unused everywhere: keep .grad as it was
                    self._write_back(i)
            for k, whole in later:
                self._bucket_final(k, whole)
            expected = self._active.count() if self.world_size > 1 else 1
            error = self.usage.end(iteration.local_unused, counts, missing, expected)
            if self._skip_unused and self.usage.never_used != self._skip_basis:
                self._launcher = self._make_launcher()  # between iterations: skip what no rank ever used
            if error is not None:
                logger.warning("%s", error)
                self._pending_error = error
            self.plans.ready_order.backward_ended([i for b in self.buckets for i in b.param_indices])
        finally:
            self._iteration = None
            self._active.clear()

    def _bucket_final(self, k: int, whole: list[int]) -> None:
        """Bucket ``k``'s parameters have their final ``.grad``: the optimizer may step them (Note [Optimizer
        overlap])."""
        if whole:
            self._after_bucket.bucket_final([self._params[i] for i in whole])
            self._events.record("stepped", k)

    def _reduce_late(self, counts: list[int], *, joined: bool = False) -> None:
        """Skipped buckets that some rank used after all (every rank knows from ``counts``): all-reduce them now,
        in index order, and write their averages back (``reductions.SkippedReduction``); a joined rank adds
        zeros."""
        for k in sorted(self._skipped):
            bucket = self.buckets[k]
            used = [i for i in bucket.param_indices if counts[i] > 0]
            if not used:
                continue
            self._events.record("late", k)
            buffer = torch.zeros_like(bucket.buffer) if joined else bucket.buffer
            in_flight = self._launcher.reductions[k].dense.start(bucket, buffer, False)  # the SkippedReduction's
            in_flight.commit()
            reduced = in_flight.wait()
            if not joined:
                bucket.take(reduced)
                for i in used:
                    self._write_back(i)

    def _fill_missing(self) -> list[int]:
        """Mark every slot no gradient reached (parts: zeros); returns the parameters among them."""
        missing = []
        for bucket in self.buckets:
            for slot in bucket.missing_slots():
                if bucket.spec.params[slot].part:
                    self._mark_part_ready((bucket.index, slot), None)  # no contribution from that use here
                else:
                    missing.append(bucket.param_indices[slot])
                    self._mark_ready(missing[-1])
        return missing

    def _write_back_many(self, indices: list[int]) -> None:
        """``_write_back`` for parameters of one bucket (one layout), in one call."""
        if indices:
            self._slots.layout[indices[0]].from_bucket_many(
                [self._params[i] for i in indices],
                [self._slots.view(self._slots.slot[i]) for i in indices],
                [self._slots.parts(i) for i in indices],
            )

    def _write_back(self, i: int) -> None:
        """Parameter ``i``'s averaged gradient from its bucket slice into ``param.grad``, with its parts added in:
        their buckets come earlier, so they are reduced already (Note [Row-sparse gradients])."""
        self._slots.layout[i].from_bucket(self._params[i], self._slots.view(self._slots.slot[i]), self._slots.parts(i))

    # -- join ------------------------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for one synchronised forward and backward: the plan agreement, every bucket on
        zeros through the same launcher, the usage all-reduce."""
        self.plans.start_agreement(joined=True)
        self._launcher.shadow()
        self._reduce_late(self.usage.shadow(), joined=True)
        self._comm.join_compute()

    # -- introspection ---------------------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self._names)

    def params(self) -> list[torch.nn.Parameter]:
        return list(self._params)


def _compiled_autograd_running() -> bool:
    from torch._dynamo import compiled_autograd

    # While the compiled backward runs (our hooks, eagerly, between its pieces), only the region flag is set.
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


@torch.compiler.disable  # under compiled autograd too, the Reducer runs eagerly, between the compiled pieces
def _grad_ready_trampoline(reducer_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    # The hook holds the Reducer weakly: a discarded DDP wrapper leaves no live reducer behind its hooks.
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad_ready(index)


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()

