"""The Reducer: turns per-parameter "gradient ready" signals into one collective per bucket, during backward.

Note [Reducer]
~~~~~~~~~~~~~~
One iteration, on every rank:

1. ``begin_forward`` (start of a DDP forward): raise what the previous backward left (a missing gradient, or a
   compiled backward that ended unfinished), and switch plans if the ranks agreed on a new one
   (``graphddp.runtime.plans``, Note [Plan agreement]). A forward without gradients changes nothing while a
   prepared iteration waits for its backward (``q = ddp(x)``, then a target ``ddp(x2)`` under ``no_grad``, then
   the backward of ``q``): as in PyTorch's DDP, that backward is reduced.
2. ``prepare(outputs)`` (end of a synchronising forward): a fresh ``Iteration`` record
   (``graphddp.runtime.iteration``: its phase among its own collectives, and how its backward ends), every bucket
   reset, and the parameters the usage policy (``graphddp.runtime.unused``) finds unused noted.
3. Backward: the first gradient hook marks the noted parameters ready, their parts too (as PyTorch's Reducer
   does: a bucket they complete launches, and a forward that no backward follows must issue nothing, whichever
   parameters each rank left unused). A post-accumulate-grad hook per parameter fires when its ``.grad`` is final and marks its slot
   ready (in steady state it only counts its bucket down: Note [Hook that only counts] in
   ``graphddp.runtime.countdown``); a tap hands over a *part* of a tied weight's gradient through the compile backend's view of the Reducer
   (``graphddp.runtime.target``), written into its slot at once (``take_part``). When a bucket is complete, its
   gradients go into their slices in one call (``BucketSlots`` in ``graphddp.runtime.buckets``, through
   ``graphddp.runtime.grad_layout``: one multi-tensor copy, not one per parameter: on a GPU the hook's Python is
   the backward's pace), and the launcher (``graphddp.runtime.launcher``) launches every bucket the index order
   allows, each through its reduction strategy (``graphddp.runtime.reductions``: dense through the comm hook, an
   embedding table's rows, or no collective for a bucket no rank has used yet, ``graphddp.runtime.skipping``).
   Just before the last bucket's collective, once every gradient is in, the plan-agreement all-reduce, carrying
   the usage count (which parameters got a gradient, summed over ranks): the iteration's one collective of
   graphddp's own, on the DDP's own group like every one, done when the last bucket is (``Launcher.before_last``),
   or none, riding inside the last bucket's all-reduce where it can (Note [The agreement rides a bucket] in
   ``graphddp.runtime.agreement_ride``); with a hook that may chain collectives (``ChainedLaunch``), after the
   last wait. The first hook chooses how
   the backward ends (``backward_ending`` in ``graphddp.runtime.iteration``): ``_finalize`` queued as an
   autograd engine callback.
4. ``_finalize`` (end of backward): fill in parameters that got no gradient (zeros, or their current ``.grad``)
   so every bucket is launched on every rank (never a hang), await the buckets in index order and write each
   one's averages into ``.grad`` at once (for the gradients this rank produced) while later buckets are still in
   flight; the rest once the usage all-reduce has said which parameters some rank used (unused on *every* rank:
   ``.grad`` stays as it was; a skipped bucket some rank used after all is all-reduced now), adding a tied
   weight's reduced parts in. A missing gradient becomes an error for the next forward, the same on every rank,
   when the policy forbids it.

Under compiled autograd the hooks run eagerly between the pieces of the compiled backward (the trampoline is
``torch.compiler.disable``d), but its engine runs no queued callback: the first hook chooses the other ending
(``AtLastLaunchEnding``), step 4 runs in the hook that launches the last bucket, so every parameter must get a
gradient or be found unused (else the next forward says so).

A joined rank (``join``) runs ``shadow_backward`` instead: the same collectives, on zeros, through the same
launcher. The Reducer does not care where its plan came from: ``adopt(plan)`` installs any plan.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..passes import BucketCaps, BucketPlan, GraphSplit
from .agreement_ride import choose_ride, with_ride
from .auto_caps import AutoCaps
from .buckets import BucketSlots, FlatBucket, Where
from .channels import Channels
from .countdown import Countdown
from .grad_layout import dense_layout
from .iteration import Iteration, UnpreparedBackward
from .join import ActiveRanks
from .launcher import ChainedLaunch, EagerLaunch, Launcher, launch_policy
from .optimizer_overlap import NoStep, StepPerBucket
from .plans import PlanAgreement, PlanKeeper, planned_specs
from .reducer_surface import TorchReducerSurface
from .reductions import CommHook, bucket_reductions, dense_reduction, local_average
from .rows_rule import RowsRule
from .skipping import SkipNeverUsed, SkipNothing
from .stats import RuntimeStats
from .target import ReducerTarget
from .trace import Events, NullEvents
from .unused import ExpectAllUsed, GradientUsage, UsagePolicy, ready_twice


class Reducer(TorchReducerSurface):
    """Bucketed, overlapped gradient averaging for a list of parameters: the coordinator of one iteration (Note
    [Reducer]). The compile backend sees it as its ``compile_target`` (``graphddp.runtime.target``)."""

    def __init__(
        self, named_params: list[tuple[str, torch.nn.Parameter]], plan: BucketPlan, *, process_group: dist.ProcessGroup,
        collective_device: torch.device, gradient_as_bucket_view: bool = False, usage: UsagePolicy | None = None,
        active_ranks: ActiveRanks | None = None, rows: RowsRule | None = None, skip_unused: bool = False,
        auto_caps: AutoCaps | None = None, channels: Channels | None = None,
    ) -> None:  # fmt: skip
        self._names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        self._index_of_id = {id(p): i for i, p in enumerate(self._params)}
        self._channels = channels if channels is not None else Channels.single(process_group)  # Note [Channels]
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.usage = GradientUsage(self._names, usage if usage is not None else ExpectAllUsed(), rank=self.rank, world_size=self.world_size)
        self._active = active_ranks if active_ranks is not None else ActiveRanks(self.world_size)
        self._events: Events = NullEvents()
        self._skip = SkipNeverUsed(self.usage) if skip_unused else SkipNothing()  # skip_all_reduce_unused_params
        self._hook = CommHook.averaging(process_group)  # the Reducer scales while copying into the bucket
        self._layout = dense_layout(as_bucket_view=gradient_as_bucket_view, local=local_average(self.world_size, self._hook))
        self._policy: EagerLaunch | ChainedLaunch = EagerLaunch()
        self._after_bucket: NoStep | StepPerBucket = NoStep()
        self.plans = PlanKeeper(
            planned_specs(named_params, plan), plan, group=process_group, device=collective_device, auto_caps=auto_caps
        )
        self._iteration: Iteration | None = None
        self.unprepared = UnpreparedBackward(self.rank)  # a gradient with no DDP forward before it: said once
        self.stats = RuntimeStats()  # six instants per iteration, for _get_ddp_logging_data (graphddp.runtime.stats)
        self._countdown = Countdown(self, self.usage.used, self._index_of_id)  # the hooks' steady path (Note [Hook that only counts])
        self._target = ReducerTarget(self, named_params, self.plans, rank=self.rank, world_size=self.world_size,
                                     rows=rows if rows is not None else RowsRule(enabled=True), auto_caps=auto_caps,
                                     channels=self._channels, countdown=self._countdown, skip=skip_unused)
        self.adopt(plan)

    # -- plan and comm hook ----------------------------------------------------------------------------------
    def adopt(self, plan: BucketPlan) -> None:
        """Install ``plan``: new flat buffers, gradients moved into their new slices (bucket views follow)."""
        if self._iteration is not None:
            raise RuntimeError(f"[rank {self.rank}] graphddp: cannot change the bucket plan while a backward is in flight; "
                               "adopt a plan between iterations.")
        if (problem := plan.coverage_problem(self._names)) is not None:
            raise ValueError(f"[rank {self.rank}] graphddp: {problem}")
        self._slots = BucketSlots(plan, self._names, self._params, self._layout, self.usage.used)
        self.plans.ride = choose_ride(self._slots.buckets, PlanAgreement.OWN_ENTRIES, len(self._names), world_size=self.world_size,
                                      averaging=not self._hook.custom, skips=self._skip.skips, device=self.plans.device)
        self._countdown.use(self._slots)  # at once: the steady hook must never count an old plan's buckets
        self._slots.move_grads()
        self.plans.install(plan)
        self._launcher = self._make_launcher()  # new buckets: every row-sparse one tries rows again

    def _make_launcher(self) -> Launcher:
        dense = [dense_reduction(self._hook, self._channels.of_bucket(b.index), self.rank, sparse=b.spec.sparse_grad,
                                 dtype=b.dtype, device=b.device) for b in self.buckets]
        each = bucket_reductions(self.buckets, dense, rows=self._target.reduces_rows, channels=self._channels)
        reductions = with_ride(self._skip.reductions(self.buckets, each, dense), self.plans.ride, self._channels.of_bucket)
        return Launcher(self.buckets, reductions, self._policy, self._events)

    def set_comm_hook(self, state: Any, hook: Any) -> None:
        self._hook = CommHook(state, hook, custom=True)
        self._policy = launch_policy(hook)
        self._layout = self._layout.with_comm_hook()  # a hook gets every gradient in its bucket, on one rank too
        self.adopt(self.plans.plan_for_comm_hook())  # a hook reduces dense buckets, as PyTorch hands them over
        self.plans.comm_hook_registered(self._hook.wire_dtype)

    def set_after_bucket(self, after: NoStep | StepPerBucket) -> None:
        """Once a bucket's averages are in ``.grad``: nothing, or its optimizer step (Note [Optimizer overlap])."""
        self._after_bucket = after

    @property
    def compile_target(self) -> ReducerTarget:
        """What the compile backend plans for while this Reducer's module runs (``graphddp.runtime.target``)."""
        return self._target

    @property
    def comm_hook(self) -> CommHook:
        return self._hook

    @property
    def events(self) -> Events:
        return self._events

    @events.setter
    def events(self, events: Events) -> None:
        self._events = self._launcher.events = events
        self._countdown.disarm()  # the rest of this backward records each gradient: the full path

    # -- iteration -------------------------------------------------------------------------------------------
    def begin_forward(self, grad_enabled: bool) -> None:
        """Step 1 of Note [Reducer], on every rank alike."""
        self._countdown.disarm()  # hooks take the full path until a backward's first hook has begun it
        stale = self._iteration
        if stale is not None and stale.abandoned_mid_way():  # Note [Abandoned backward]: drained, nothing kept
            self._iteration = None
            late = functools.partial(self._skip.reduce_late, self._slots, events=self._events, joined=True)
            stale.drain(self.plans, self._launcher, self.usage, late, self.rank)
            self.plans.backward_abandoned([i for b in self.buckets for i in b.param_indices])
            self._active.clear()
        elif stale is not None and not grad_enabled and not stale.ending.begun:
            return  # a forward without gradients (a target under no_grad) before the backward: it stays prepared
        elif stale is not None and stale.ending.dropped_by_next_forward:
            self._iteration = None  # its forward had no backward, or its compiled backward ended unfinished
            stale.ending.check_finished(self.rank)
        self.usage.raise_pending()
        self.switch_plan(grad_enabled)
        self.plans.forward_began(grad_enabled)

    def switch_plan(self, grad_enabled: bool) -> None:
        """Adopt the plan the ranks agreed on, if any (collective: every rank, joined ones too, calls it)."""
        gone_dense = [self._names[bucket.param_indices[0]] for bucket in self._launcher.gave_up()]  # one table each
        plan = self.plans.next_plan(grad_enabled=grad_enabled, allows_unused=self.usage.policy.allows_unused, gone_dense=gone_dense)
        if plan is not None:
            self.adopt(plan)
        elif self._skip.outdated():  # between iterations, joined ranks too: skip what no rank ever used
            self._launcher = self._make_launcher()

    def prepare(self, outputs: Any) -> None:
        """Step 2 of Note [Reducer]: arm the hooks for the backward of this forward."""
        self._slots.reset()
        self._launcher.reset()
        self.plans.ready_order.restart()
        prescales = self._hook.prescales(self._active.divisor, self._launcher.divides_by)  # Note [Averaged on the wire]
        self._iteration = iteration = Iteration(self.usage.policy.locally_unused(outputs, self._index_of_id), prescales)
        iteration.before_last(self._launcher, self.usage, self.plans)  # the agreement and usage count (Note [Reducer])
        self._countdown.prepare(steady=not (iteration.local_unused or self._events.recording or self.plans.ready_order.learning))
        iteration.watch.watch(outputs)  # a backward that raises before the first hook is drained too

    def on_grad_ready(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (step 3 of Note [Reducer])."""
        if not self.begin_gradients(i):
            return
        assert (iteration := self._iteration) is not None
        bucket, slot = self._slots.slot[i]
        if self._slots.buckets[bucket].is_ready(slot):
            raise RuntimeError(ready_twice(self.rank, self._names[i], marked_unused=i in iteration.local_unused))
        self.plans.ready_order.observe(i)
        self._mark_ready(i)

    def begin_gradients(self, i: int) -> bool:
        """Parameter ``i``'s gradient is in: begin the backward if first; False if no DDP forward prepared it."""
        self.usage.used[i] = True  # also under no_sync(): a parameter used in any micro-batch counts as used
        if (iteration := self._iteration) is None:
            self.unprepared.gradient(self._names[i])
        elif not iteration.ending.begun:
            self._begin_backward(iteration)
        return iteration is not None

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        """A tap's part of a tied weight's gradient (``ReducerTarget.take_part``): True when it is in its slot."""
        iteration = self._iteration
        if iteration is None or (where := self._slots.open_part(key)) is None:
            return False
        self.begin_gradients(self._slots.owner(where))  # the weight's gradient counts as used
        self._part_ready(where, grad)
        return True

    def _begin_backward(self, iteration: Iteration) -> None:
        """The first hook: the ending, the steady hook, the forward's unused parameters ready (Note [Reducer], 3)."""
        iteration.begin_backward(self._finalize)
        self.stats.mark("backward_start")
        self._countdown.arm(per_gradient_work=self._events.recording or self.plans.ready_order.learning)
        self._slots.mark_unused(iteration.local_unused, self._mark_ready, self._part_ready)

    def _mark_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final: copied with the bucket's others once it is complete."""
        where = self._slots.slot[i]
        self._events.record("ready", where[0], self._names[i])
        if (bucket := self._slots.mark_ready(where)) is not None:
            self.bucket_complete(bucket)

    def _part_ready(self, where: Where, grad: torch.Tensor | None = None) -> None:
        """A part's slot is filled: with ``grad``, or zeros (no contribution this iteration)."""
        assert self._iteration is not None
        self._events.record("ready", where[0], self._slots.fill_part(where, grad, self._iteration.prescales[where[0]]))
        if (bucket := self._slots.mark_ready(where)) is not None:
            self.bucket_complete(bucket)

    def bucket_complete(self, bucket: FlatBucket) -> None:
        """Every slot of ``bucket`` is filled: into its buffer, and launch what the index order allows."""
        iteration = self._iteration
        assert iteration is not None
        self.stats.mark("comm_start")
        self._slots.gather(bucket, iteration.prescales[bucket.index])
        if self._launcher.launch_ready():
            iteration.ending.all_launched(self._finalize)

    def _finalize(self) -> None:
        """End of backward (step 4 of Note [Reducer])."""
        iteration = self._iteration
        assert iteration is not None
        self._countdown.disarm()
        self.stats.mark("backward_end")
        try:
            self._events.record("finalize")
            self.plans.ready_order.compute_ended()
            self._countdown.end_of_backward(callback_ending=iteration.ending.by_callback)
            missing = self._slots.fill_missing(self._mark_ready, self._part_ready)
            used_here = self.usage.used  # a gradient produced here: some rank used it, whatever the usage all-reduce says
            later = []  # buckets with a parameter not used here: final only once the usage count is in
            for bucket, reduced in self._after_bucket.reduced(self._launcher):  # stepping: as they complete
                self._events.record("wait", bucket.index)
                # Gradients this rank produced are written back now, while later buckets are still in flight.
                whole = self._slots.take_reduced(bucket, reduced, write=used_here)
                self._events.record("written", bucket.index)
                if all(map(used_here.__getitem__, whole)):  # no Python frame per parameter
                    self._after_bucket.bucket_final(bucket.index, whole, self._params, self._events)
                else:
                    later.append((bucket.index, whole))
            self.stats.mark("comm_end")
            iteration.count_usage(self._launcher, self.usage, self.plans)  # ChainedLaunch: only now, after every bucket
            counts = self.usage.counts(iteration.usage)
            self._skip.reduce_late(self._slots, counts, self._events)
            self._slots.finish_write_back(used_here, counts)  # the rest, once the ranks' usage is known
            for k, whole in later:
                self._after_bucket.bucket_final(k, whole, self._params, self._events)
            self.usage.end(iteration.local_unused, counts, missing, self._active.count() if self.world_size > 1 else 1)
            self.plans.backward_ended([i for b in self.buckets for i in b.param_indices])
        finally:
            self._iteration = None
            self._active.clear()

    # -- join ------------------------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for one synchronised iteration: the same collectives, every bucket on zeros."""
        shadow = Iteration([], ())  # its usage entries: the last backward's, as PyTorch's (GradientUsage.entries)
        shadow.before_last(self._launcher, self.usage, self.plans, joined=True)
        self._launcher.shadow()
        shadow.count_usage(self._launcher, self.usage, self.plans, joined=True)  # ChainedLaunch: after the waits
        self._skip.reduce_late(self._slots, self.usage.shadowed(shadow.usage), self._events, joined=True)
        self.plans.backward_ended([i for b in self.buckets for i in b.param_indices])  # as the others' did

    # -- introspection ---------------------------------------------------------------------------------------
    @property
    def plan(self) -> BucketPlan:
        return self.plans.current

    @property
    def buckets(self) -> list[FlatBucket]:
        return self._slots.buckets

    @property
    def caps(self) -> BucketCaps:
        return self.plans.current.caps

    @property
    def splits(self) -> list[GraphSplit]:
        return self._target.splits  # how each graph compiled for this Reducer was cut

    def params(self) -> list[torch.nn.Parameter]:
        return list(self._params)
