"""The Reducer: turns per-parameter "gradient ready" signals into one collective per bucket, during backward.

Note [Reducer]
~~~~~~~~~~~~~~
One iteration, on every rank:

1. ``prepare_for_backward(outputs)`` (end of the DDP forward): arm, reset every bucket, ask the usage policy
   which parameters will get no gradient (``graphddp.unused``) and mark those ready at once.
2. Backward: a post-accumulate-grad hook per parameter fires when its ``.grad`` is final. The gradient goes
   into its bucket slice (``graphddp.grad_layout``); when a bucket is complete, every complete bucket from
   ``next_to_launch`` on is handed to the comm hook, asynchronously, in index order. A bucket that is ready
   early waits for its predecessors, so all ranks issue collectives in the same order. The first hook queues
   ``_finalize`` as an autograd engine callback.
3. ``_finalize`` (end of backward): fill in parameters that got no gradient (zeros, or their current
   ``.grad``) so every bucket is launched on every rank (never a hang), launch the usage all-reduce, wait on
   the futures in bucket order, write the averages back (parameters unused on *every* rank keep ``.grad`` as it
   was), and turn a missing gradient into an error for the next forward when the policy forbids it. A bucket's
   averages are written back as soon as it is awaited, for the gradients this rank produced, while later buckets
   are still in flight; the rest once the usage all-reduce has said which parameters some rank used. A hook
   result that fails validation raises with the earlier buckets already written back.

Two kinds of slot besides a parameter's ``.grad`` (Note [Row-sparse gradients] in ``passes/rows.py``):
a *part* of a tied weight's gradient arrives from a tap in the compiled graph (``take_part``), not from a hook;
it is reduced with its bucket and added into the parameter's averaged gradient at write-back (the plan puts
parts in earlier buckets, so they are reduced by then). A *row-sparse* bucket is launched in two steps
(``graphddp.rows``): the mask of touched rows goes out when the bucket is complete, and the rows themselves
just before the next bucket is launched (or at the end of backward), so the main group still sees one order of
collectives on every rank. A table that keeps going dense stops trying rows, and its parts are dropped from the
plan at the next forward (they would travel on top of the dense table).

Custom comm hooks may chain further collectives in future callbacks (PowerSGD does, from gloo's threads). If
bucket k+1 were launched while bucket k's chain still runs, the two would interleave differently on each rank:
a collective mismatch (PyTorch's DDP hangs this way with PowerSGD on gloo and several buckets). So with a
custom hook, bucket k+1 starts only once bucket k's future has completed (``ChainedLaunch``); collectives of
one group run one at a time anyway, so little overlap is lost. Hooks known to issue exactly one collective
(graphddp's own, and PyTorch's ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``) launch
every ready bucket at once (``EagerLaunch``).

After the first synchronised iteration the buckets are re-planned once in the order gradients really became
ready (rank 0's order, broadcast), as PyTorch does. ``adopt(plan)`` installs any plan, including one made from
a compiled graph: the Reducer does not care where its plan came from.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

from .buckets import FlatBucket, GradBucket
from .comm import AverageState, CudaCommStream, HostComm, all_gather_bytes, average_allreduce_hook
from .grad_layout import BucketViewGrads, CopiedGrads
from .passes import BucketPlan, ParamSpec, first_difference_across, plan_buckets
from .proposals import GraphPlans, agreed, agreement_entries
from .rows import DENSE_STREAK_LIMIT, RowSparseLaunch, RowSparsePolicy
from .trace import NullEvents
from .unused import ExpectAllUsed

logger = logging.getLogger(__name__)


class EagerLaunch:
    """Launch a complete bucket at once: the hook issues one collective and chains none."""

    @staticmethod
    def may_launch(previous: FlatBucket | None) -> bool:
        return True


class ChainedLaunch:
    """Launch a bucket only after its predecessor's future completed (see Note [Reducer])."""

    @staticmethod
    def may_launch(previous: FlatBucket | None) -> bool:
        return previous is None or (previous.future is not None and previous.future.done())


class ActiveRanks:
    """How many ranks take part in this iteration: the world, or (under ``join``) the non-joined ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._work: Any = None

    def set_join_work(self, work: Any) -> None:
        """The all-reduce of ones that ``Join.notify_join_context`` issued this iteration."""
        self._work = work

    def count(self) -> int:
        if self._work is None:
            return self.world_size
        self._work.wait()
        return int(self._work.result()[0].item())

    def clear(self) -> None:
        self._work = None


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters (see Note [Reducer])."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        plan: BucketPlan,
        *,
        process_group: dist.ProcessGroup,
        gradient_as_bucket_view: bool = False,
        usage: Any = None,
        comm: HostComm | CudaCommStream | None = None,
        divide_by_initial_world_size: bool = True,
        row_sparse: frozenset[str] = frozenset(),
    ) -> None:
        self._names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        self._index_of_name = {n: i for i, n in enumerate(self._names)}
        self._index_of_id = {id(p): i for i, p in enumerate(self._params)}
        self._row_sparse_names = row_sparse  # parameters planned as row-sparse gradients when re-planned eagerly
        self._group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._layout = BucketViewGrads() if gradient_as_bucket_view else CopiedGrads()
        self.usage_policy = usage if usage is not None else ExpectAllUsed()
        self._comm = comm if comm is not None else HostComm()
        self._coll_device = _collective_device(process_group, self._params[0].device)
        self._usage_group = _side_group(process_group) if self.world_size > 1 else None
        self.events: Any = NullEvents()
        self.active = ActiveRanks(self.world_size)
        self.divide_by_initial_world_size = divide_by_initial_world_size

        self._hook: Any = average_allreduce_hook
        self._hook_state: Any = AverageState(process_group)
        self.has_custom_comm_hook = False
        self._launch_policy: EagerLaunch | ChainedLaunch = EagerLaunch()
        self._prescale: float | None = None
        # Row-sparse buckets (Note [Row-sparse gradients]): only under the default hook, between CPU ranks.
        self._row_policy: RowSparsePolicy | None = RowSparsePolicy() if self._usage_group is not None else None
        self._row_pending: tuple[FlatBucket, RowSparseLaunch] | None = None
        self._row_launches: dict[int, RowSparseLaunch] = {}  # this iteration's, by bucket: unpacked when awaited
        self._gone_dense: set[str] = set()  # tables with parts that gave up rows: re-planned at the next forward

        self.plan: BucketPlan | None = None
        self._buckets: list[FlatBucket] = []
        self._slot: list[tuple[int, int]] = [(-1, -1)] * len(self._params)
        self._part_slot: dict[tuple[str, str], tuple[int, int]] = {}
        self._parts_of: dict[int, list[tuple[int, int]]] = {}
        self.adopt(plan)

        # Per-iteration state.
        self._armed = False
        self._finalize_queued = False
        self._next_launch = 0
        self._used = [False] * len(self._params)
        self._local_unused: list[int] = []
        self._usage_work: Any = None
        self._usage_tensor: torch.Tensor | None = None
        self._pending_error: str | None = None
        # Ready order of the first synchronised backward, for the one-time rebuild.
        self._ready_order: list[int] | None = []
        self._rebuild_order: list[int] | None = None
        # Plans proposed by the compile backend (Note [Plan agreement] in graphddp.proposals).
        self.graph_plans = GraphPlans([ParamSpec.of(n, p, row_sparse=n in row_sparse) for n, p in named_params])
        self._tokens: tuple[int, int] = (0, 0)
        self._agreed_plan: BucketPlan | None = None
        self._plan_mismatch = False
        self.iterations = 0

        me = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready_trampoline, me, i))
            for i, p in enumerate(self._params)
        ]

    # -- plan ------------------------------------------------------------------------------------------------
    def adopt(self, plan: BucketPlan) -> None:
        """Install ``plan``: new flat buffers, gradients moved into their new slices (bucket views follow)."""
        if getattr(self, "_armed", False):
            raise RuntimeError(
                f"[rank {self.rank}] graphddp: cannot change the bucket plan while a backward is in flight; "
                "adopt a plan between iterations."
            )
        planned = plan.param_names
        if sorted(planned) != sorted(self._names):
            missing = sorted(set(self._names) - set(planned))
            extra = sorted(set(planned) - set(self._names))
            raise ValueError(
                f"[rank {self.rank}] graphddp: bucket plan does not cover the trainable parameters exactly: "
                f"missing {missing[:5]}, unknown {extra[:5]}. A plan must hold every trainable parameter once."
            )
        buckets = []
        for spec in plan.buckets:
            indices = [self._index_of_name[p.name] for p in spec.params]
            buckets.append(FlatBucket(spec, [self._params[i] for i in indices], indices))
        self._part_slot, self._parts_of = {}, {}
        for bucket in buckets:
            for slot, (i, spec) in enumerate(zip(bucket.param_indices, bucket.spec.params)):
                if spec.part:  # a part of a tied weight's gradient (Note [Row-sparse gradients])
                    self._part_slot[spec.key] = (bucket.index, slot)
                    self._parts_of.setdefault(i, []).append((bucket.index, slot))
                else:
                    self._slot[i] = (bucket.index, slot)
                    self._layout.move(self._params[i], bucket.views[slot])
        self._buckets = buckets
        self.plan = plan
        if self._row_policy is not None:
            self._row_policy = RowSparsePolicy()  # new buckets: every row-sparse one tries rows again
        self._gone_dense = set()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "[rank %d] bucket plan (%s, fingerprint %s):\n%s",
                self.rank,
                plan.source,
                plan.fingerprint,
                tabulate(plan.table_rows(), headers=plan.TABLE_HEADERS),
            )

    @property
    def buckets(self) -> list[FlatBucket]:
        return self._buckets

    def rebuild_from_ready_order(self) -> bool:
        """Re-plan once in the order gradients became ready in the first backward (rank 0's order wins).

        Collective: every rank calls it at the same point (the next forward, or a joined rank's shadow).
        Returns True when the plan changed.
        """
        assert self._rebuild_order is not None and self.plan is not None
        order = torch.tensor(self._rebuild_order, dtype=torch.int64, device=self._coll_device)
        if self.world_size > 1:
            dist.broadcast(order, group=self._group, group_src=0)
        self._rebuild_order = None
        specs = [ParamSpec.of(self._names[i], self._params[i], row_sparse=self._names[i] in self._row_sparse_names) for i in order.tolist()]
        plan = plan_buckets(
            specs,
            caps=self.plan.caps,
            source="ready-order",
        )
        if plan.fingerprint == self.plan.fingerprint:
            return False
        self.adopt(plan)
        logger.info(
            "[rank %d] graphddp: buckets rebuilt in gradient-ready order: %d buckets, bytes %s",
            self.rank,
            len(plan.buckets),
            [b.nbytes for b in plan.buckets],
        )
        return True

    # -- comm hook -------------------------------------------------------------------------------------------
    def set_comm_hook(self, state: Any, hook: Any) -> None:
        self._hook, self._hook_state, self.has_custom_comm_hook = hook, state, True
        self._launch_policy = EagerLaunch() if hook in _single_collective_hooks() else ChainedLaunch()
        self._row_policy = None  # a hook reduces dense buckets, as PyTorch hands them over
        parts = {p.label for plan in (self.plan, self.graph_plans.proposed) if plan is not None for p in plan.parts}
        if parts:
            logger.warning(
                "[rank %d] graphddp: a comm hook was registered after torch.compile split tied tables' gradients "
                "into parts (%s); with a hook every bucket is reduced dense, so those tables now travel twice. "
                "Register the hook before the first compiled forward.",
                self.rank,
                ", ".join(sorted(parts)),
            )

    # -- iteration -------------------------------------------------------------------------------------------
    def begin_forward(self, grad_enabled: bool) -> None:
        """Start of a DDP forward, on every rank alike: report what the previous backward found, switch plans.

        Raises the error the previous backward left (missing gradients), or, when ranks proposed different
        graph plans, gathers them (a collective every rank runs) and raises naming the first differing bucket.
        """
        if self._armed and not self._finalize_queued:
            self._armed = False  # the previous forward had no backward: nothing is in flight
        if self._pending_error is not None:
            message, self._pending_error = self._pending_error, None
            raise RuntimeError(message)
        if self._plan_mismatch:
            self._plan_mismatch = False
            message = self._describe_plan_mismatch()
            if not self.usage_policy.allows_unused:
                raise RuntimeError(
                    message + " Every rank must capture the same graphs (same code path, same graph breaks), or "
                    "pass find_unused_parameters=True when ranks take different branches."
                )
            # With find_unused_parameters / static_graph, rank-dependent branches legitimately capture
            # different graphs: keep the current plan, which every rank shares.
            logger.warning("%s Ranks take different branches (find_unused_parameters=True): the current plan stays.", message)
        self.replan(grad_enabled)

    def replan(self, grad_enabled: bool) -> None:
        """Adopt an agreed graph plan, or rebuild once in gradient-ready order (collective, same on all ranks)."""
        if self.world_size == 1 and self.graph_plans.proposed is not None:
            self._agreed_plan = self.graph_plans.proposed
        if self._agreed_plan is not None:
            plan, self._agreed_plan = self._agreed_plan, None
            if self.graph_plans.proposed is plan:
                self.graph_plans.taken()
            self.adopt(plan)
            self._rebuild_order = None  # the graph knows the order better than one observed backward
            logger.info(
                "[rank %d] graphddp: adopted the compiled graphs' bucket plan: %d buckets, bytes %s, fingerprint %s",
                self.rank,
                len(plan.buckets),
                [b.nbytes for b in plan.buckets],
                plan.fingerprint,
            )
        elif self._rebuild_order is not None and grad_enabled:
            self.rebuild_from_ready_order()
        if self._gone_dense:
            self._drop_parts_of_dense_tables()

    def _drop_parts_of_dense_tables(self) -> None:
        """Tables that gave up rows (``graphddp.rows``) lose their parts: every rank saw the same outcomes, so every
        rank re-plans alike, here, between iterations."""
        assert self.plan is not None
        names, self._gone_dense = sorted(self._gone_dense), set()
        self.adopt(self.plan.without_rows(names))
        logger.info(
            "[rank %d] graphddp: %s went dense %d iterations in a row (gradients accumulated under no_sync?); "
            "all-reduced dense from now on, without separate parts (Note [Row-sparse gradients])",
            self.rank,
            ", ".join(names),
            DENSE_STREAK_LIMIT,
        )

    def propose_graph_plan(self, graph: str, plan: BucketPlan) -> None:
        """The compile backend's plan for one captured graph; adopted once every rank agrees."""
        assert self.plan is not None
        self.graph_plans.propose(graph, plan, self.plan)

    def _describe_plan_mismatch(self) -> str:
        proposed = self.graph_plans.proposed
        self.graph_plans.taken()
        rows = proposed.describe() if proposed is not None else []
        payload = "\n".join(f"{a}\t{b}" for a, b in rows).encode()
        everyone = [
            [tuple(line.split("\t", 1)) for line in b.decode().split("\n") if line]
            for b in all_gather_bytes(payload, group=self._group)
        ]
        index, entries = first_difference_across(everyone, ("", "<no such bucket>")) or (0, [("", "")] * len(everyone))
        differing = [r for r, e in enumerate(entries) if e != entries[0]]
        return (
            f"[rank {self.rank}] graphddp: the ranks compiled different bucket plans. First difference at bucket "
            f"{index}: rank 0 has [{entries[0][1]}]; "
            + "; ".join(f"rank {r} has [{entries[r][1]}]" for r in differing)
            + ". The previous plan stays in use (Note [Plan agreement] in graphddp/proposals.py)."
        )

    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the hooks for the backward of this forward (step 1 of Note [Reducer])."""
        for bucket in self._buckets:
            bucket.reset()
        self._next_launch = 0
        self._usage_work = None
        self._row_pending = None
        self._row_launches = {}
        self._finalize_queued = False
        if self._ready_order is not None:
            self._ready_order = []  # a backward that failed part-way leaves no stale order behind
        self._armed = True
        self._prescale = None
        if not self.has_custom_comm_hook:  # scale while copying into the bucket; the hook then only sums
            divisor = self.world_size if self.divide_by_initial_world_size else self.active.count()
            self._prescale = 1.0 / divisor if divisor != 1 else None
            self._hook_state.divisor = 1
        self._local_unused = self.usage_policy.locally_unused(outputs, self._index_of_id)
        for i in self._local_unused:
            self._mark_ready(i)
            for where in self._parts_of.get(i, ()):  # no gradient reaches it, through a tap neither
                self._mark_part_ready(*where, None)

    def _queue_finalize(self) -> None:
        self._finalize_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def on_grad_ready(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (step 2 of Note [Reducer])."""
        self._used[i] = True  # also under no_sync(): a parameter used in any micro-batch counts as used
        if not self._armed:  # no_sync(), or a backward that no DDP forward prepared: accumulate locally
            return
        if not self._finalize_queued:
            self._queue_finalize()
        bucket_index, slot = self._slot[i]
        if self._buckets[bucket_index].is_ready(slot):
            why = (
                "find_unused_parameters marked it unused, yet it received a gradient (is a tensor that depends "
                "on it missing from the forward's outputs?)"
                if i in self._local_unused
                else "its gradient was accumulated twice in one backward (reentrant checkpointing, or the "
                "same parameter reached through two backward calls)"
            )
            raise RuntimeError(
                f"[rank {self.rank}] graphddp: parameter {self._names[i]!r} was marked ready twice in one "
                f"iteration: {why}. Use torch.utils.checkpoint(..., use_reentrant=False) and one backward per "
                "forward."
            )
        if self._ready_order is not None:
            self._ready_order.append(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        bucket_index, slot = self._slot[i]
        bucket = self._buckets[bucket_index]
        self._layout.to_bucket(self._params[i], bucket.views[slot], self._prescale)
        self.events.record("ready", bucket_index, self._names[i])
        if bucket.mark_ready(slot):
            self._launch_ready_buckets()

    def take_part(self, key: tuple[str, str], grad: torch.Tensor) -> bool:
        """A tap's backward offers one part of a tied weight's gradient (``graphddp.taps``). True: it is in its
        slot; False: the tap must pass it on to ``.grad`` (not synchronising, no such slot, or already filled)."""
        where = self._part_slot.get(key) if self._armed else None
        if where is None or self._buckets[where[0]].is_ready(where[1]):
            return False
        self._used[self._buckets[where[0]].param_indices[where[1]]] = True
        if not self._finalize_queued:
            self._queue_finalize()
        self._mark_part_ready(*where, grad)
        return True

    def _mark_part_ready(self, bucket_index: int, slot: int, grad: torch.Tensor | None) -> None:
        bucket = self._buckets[bucket_index]
        view = bucket.views[slot]
        if grad is None:  # no contribution this iteration
            view.zero_()
        elif self._prescale is None:
            view.copy_(grad)
        else:
            torch.mul(grad, self._prescale, out=view)
        self.events.record("ready", bucket_index, bucket.spec.params[slot].label)
        if bucket.mark_ready(slot):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets, policy = self._buckets, self._launch_policy
        while (
            self._next_launch < len(buckets)
            and buckets[self._next_launch].complete
            and policy.may_launch(buckets[self._next_launch - 1] if self._next_launch else None)
        ):
            self._finish_row_sparse()  # its rows go before the next bucket, on every rank
            self._launch(buckets[self._next_launch])
            self._next_launch += 1
        if self._next_launch == len(buckets) and self._usage_work is None and self._reduces_usage():
            # Tiny, after the last bucket: which parameters got a gradient, summed over ranks. It goes through
            # a side group: comm hooks such as PowerSGD issue further collectives on the main group from
            # future callbacks, and ours must not interleave with theirs.
            # The last entries carry the plan agreement (Note [Plan agreement]).
            self._tokens = self.graph_plans.tokens()
            used = torch.tensor([int(u) for u in self._used] + agreement_entries(self._tokens), dtype=torch.int64)
            self._usage_tensor = used
            self._usage_work = dist.all_reduce(used, group=self._usage_group, async_op=True)

    def _reduces_usage(self) -> bool:
        return self.world_size > 1 and self.usage_policy.reduces_usage()

    def _launch(self, bucket: FlatBucket) -> None:
        self.events.record("launch", bucket.index)
        if self._reduces_rows(bucket):
            # Step one of two (graphddp.rows): the rows touched here; the rest waits for the union.
            self._row_pending = (bucket, self._begin_rows(bucket, bucket.buffer))
            return
        self._start(bucket, self._launch_dense(bucket))

    def _begin_rows(self, bucket: FlatBucket, buffer: torch.Tensor) -> RowSparseLaunch:
        """Start a row-sparse bucket's reduction of ``buffer`` (its own, or a joined rank's zeros): the mask."""
        assert self._usage_group is not None
        launch = RowSparseLaunch(buffer, bucket.spec.params[0].shape[0], group=self._group, mask_group=self._usage_group)
        launch.begin()
        return launch

    def _reduces_rows(self, bucket: FlatBucket) -> bool:
        """Row-sparse buckets (Note [Row-sparse gradients]) under the default hook, on CPU, between ranks."""
        return (
            self._row_policy is not None
            and bucket.spec.row_sparse
            and bucket.spec.device == "cpu"
            and self._row_policy.wants(bucket.index)
        )

    def _launch_dense(self, bucket: FlatBucket) -> Any:
        grad_bucket = GradBucket(bucket.index, bucket.buffer, bucket.params, bucket.index == len(self._buckets) - 1)
        return self._comm.launch(lambda: self._hook(self._hook_state, grad_bucket))

    def _finish_row_sparse(self) -> None:
        """Step two for the row-sparse bucket launched last, if any: its rows, or the whole bucket, all-reduced."""
        if self._row_pending is None:
            return
        (bucket, launch), self._row_pending = self._row_pending, None
        future = launch.finish(lambda: self._launch_dense(bucket))
        self._observe_rows(bucket, launch.sparse)
        self._row_launches[bucket.index] = launch
        self.events.record("rows" if launch.sparse else "dense", bucket.index, f"{launch.touched}/{launch.table.shape[0]}")
        self._start(bucket, future)

    def _observe_rows(self, bucket: FlatBucket, sparse: bool) -> None:
        assert self._row_policy is not None
        if self._row_policy.observe(bucket.index, sparse) and self._parts_of.get(bucket.param_indices[0]):
            self._gone_dense.add(self._names[bucket.param_indices[0]])

    def _start(self, bucket: FlatBucket, future: Any) -> None:
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and the C++ futures of Work
            raise TypeError(
                f"[rank {self.rank}] graphddp: the communication hook returned {type(future).__name__} for "
                f"bucket {bucket.index}; a hook must return a torch.futures.Future (e.g. "
                "dist.all_reduce(..., async_op=True).get_future())."
            )
        bucket.start(future)
        if self.events.recording:  # completion times, for timelines
            future.add_done_callback(lambda _f, index=bucket.index: self.events.record("done", index))

    def _finalize(self) -> None:
        """End of backward (step 3 of Note [Reducer])."""
        try:
            self.events.record("finalize")
            missing = []
            for b in self._buckets:
                for slot in b.missing_slots():
                    if b.spec.params[slot].part:
                        self._mark_part_ready(b.index, slot, None)  # no contribution from that use here
                    else:
                        missing.append(b.param_indices[slot])
                        self._mark_ready(missing[-1])
            self._finish_row_sparse()
            used_here = self._used  # a gradient produced here: some rank used it, whatever the usage all-reduce says
            for bucket in self._buckets:
                if not bucket.started:  # held back by ChainedLaunch: its predecessor was just awaited
                    self._launch_ready_buckets()
                assert bucket.future is not None, f"bucket {bucket.index} was never launched"
                value = self._comm.wait(bucket.future)
                if bucket.index in self._row_launches:
                    value = self._row_launches[bucket.index].unpack(value)
                reduced = self._check_hook_result(value, bucket)
                self.events.record("wait", bucket.index)
                self._comm.join_compute()  # on CUDA: the compute stream waits for the collective's result
                if reduced.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(reduced.reshape(-1))
                # Gradients this rank produced are written back now, while later buckets are still in flight.
                for i, spec in zip(bucket.param_indices, bucket.spec.params):
                    if used_here[i] and not spec.part:
                        self._write_back(i)
                self.events.record("written", bucket.index)
            counts = self._global_usage_counts()
            self._comm.join_compute()
            for i, used in enumerate(used_here):  # the rest, once the ranks' usage is known
                if not used and counts[i] > 0:  # unused everywhere: keep .grad as it was
                    self._write_back(i)
            self._check_all_used(counts, missing)
            self.usage_policy.observe(self._local_unused, counts)
            if self._ready_order is not None:
                seen = set(self._ready_order)
                rest = [i for i in dict.fromkeys(i for b in self._buckets for i in b.param_indices) if i not in seen]
                self._rebuild_order, self._ready_order = self._ready_order + rest, None
        finally:
            self._armed = False
            self._finalize_queued = False
            self._used = [False] * len(self._params)  # usage accumulates over no_sync() micro-batches until here
            self.active.clear()
            self.iterations += 1

    def _write_back(self, i: int) -> None:
        """Parameter ``i``'s averaged gradient from its bucket slice into ``param.grad``, with its parts added in:
        their buckets come earlier, so they are reduced already (Note [Row-sparse gradients])."""
        bucket_index, slot = self._slot[i]
        parts = [self._buckets[b].views[s] for b, s in self._parts_of.get(i, ())]
        self._layout.from_bucket(self._params[i], self._buckets[bucket_index].views[slot], parts)

    def _check_hook_result(self, value: Any, bucket: FlatBucket) -> torch.Tensor:
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"[rank {self.rank}] graphddp: the communication hook's future for bucket {bucket.index} "
                f"resolved to {type(value).__name__}; it must resolve to the reduced bucket, one tensor shaped "
                f"like bucket.buffer() ({bucket.buffer.numel()} elements)."
            )
        if value.numel() != bucket.buffer.numel():
            raise ValueError(
                f"[rank {self.rank}] graphddp: the communication hook returned a tensor of shape "
                f"{tuple(value.shape)} for bucket {bucket.index}, expected {tuple(bucket.buffer.shape)} (the shape "
                f"of bucket.buffer(); parameters {list(bucket.spec.names)[:4]}). Return the reduced buffer from "
                "the hook's future."
            )
        return value

    def _global_usage_counts(self) -> list[int]:
        """Per parameter: on how many ranks it got a gradient this iteration."""
        if self._usage_work is not None:
            self._usage_work.wait()
            assert self._usage_tensor is not None
            sums = self._usage_tensor.tolist()
            counts, agreement = sums[: len(self._params)], sums[len(self._params) :]
            verdict = agreed(self._tokens, agreement, self.active.count())
            if verdict:
                self._agreed_plan = self.graph_plans.proposed
            elif verdict is False:
                self._plan_mismatch = True
            return counts
        known = self.usage_policy.known_counts
        if known is not None:
            return known
        # One rank, or a policy that does not reduce: what this rank saw is all there is.
        return [1 if u else 0 for u in self._used]

    def _check_all_used(self, counts: list[int], missing: list[int]) -> None:
        if self.usage_policy.allows_unused:
            return
        expected = self.active.count() if self.world_size > 1 else 1
        bad = [i for i, c in enumerate(counts) if c < expected]
        if not bad:
            return
        here = set(missing)
        described = ", ".join(
            f"{self._names[i]!r} (gradient on {counts[i]} of {expected} ranks"
            + (", not on this one)" if i in here else ")")
            for i in bad[:5]
        )
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        self._pending_error = (
            f"[rank {self.rank}] graphddp.DDP: the previous backward produced no gradient for {described}{more}. "
            "Every trainable parameter must take part in the loss on every rank. If some parameters are "
            "legitimately unused in some iterations (conditional branches), pass find_unused_parameters=True to "
            "graphddp.DDP; if they are never used, set requires_grad=False on them."
        )
        logger.warning("%s", self._pending_error)

    # -- join ------------------------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's stand-in for one backward: the same collectives, in the same order, on zeros.

        Buckets are shadowed one after the other (each future awaited before the next hook runs), which issues
        the same sequence of collectives as either launch policy.
        """
        for bucket in self._buckets:
            zeros = torch.zeros_like(bucket.buffer)
            grad_bucket = GradBucket(bucket.index, zeros, bucket.params, bucket.index == len(self._buckets) - 1)
            dense = lambda: self._comm.launch(lambda: self._hook(self._hook_state, grad_bucket))  # noqa: E731
            if self._reduces_rows(bucket):
                launch = self._begin_rows(bucket, zeros)
                self._comm.wait(launch.finish(dense))
                self._observe_rows(bucket, launch.sparse)
            else:
                self._comm.wait(dense())
        if self._reduces_usage():
            unused = torch.zeros(len(self._params) + len(agreement_entries((0, 0))), dtype=torch.int64)
            dist.all_reduce(unused, group=self._usage_group)
        self._comm.join_compute()

    # -- introspection ---------------------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        return list(self._names)

    def params(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def _grad_ready_trampoline(reducer_ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    # The hook holds the Reducer weakly: a discarded DDP wrapper leaves no live reducer behind its hooks.
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad_ready(index)


def _single_collective_hooks() -> tuple[Any, ...]:
    """PyTorch's hooks that issue one collective and chain no other (see ``ChainedLaunch``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)


def _side_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the same ranks, for the usage bitmap (CPU, off the main group's queue)."""
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


def _collective_device(group: dist.ProcessGroup, param_device: torch.device) -> torch.device:
    """Small bookkeeping collectives run where the backend wants them: NCCL needs CUDA tensors."""
    if param_device.type == "cuda" and dist.get_backend(group) != "gloo":
        return param_device
    return torch.device("cpu")
