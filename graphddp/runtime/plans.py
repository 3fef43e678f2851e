"""Which bucket plan the Reducer runs, and when it switches: the ready-order rebuild, the compiled graphs' plans,
and the step in which the ranks agree on one.

Note [Plan agreement]
~~~~~~~~~~~~~~~~~~~~~
A plan changes the collectives every rank issues, so every rank must switch to the same plan at the same
iteration. Three sources of a new plan, all switched to at the start of a forward (``next_plan``), never under a
backward in flight:

* **ready order** (eager): after the first synchronised backward, the order in which gradients became ready,
  rank 0's order broadcast (as PyTorch's DDP rebuilds its buckets once); with ``bucket_cap_mb="auto"`` rank 0's
  ready times too, from which every rank chooses the same caps (Note [Automatic caps]);
* **graph plans** (compiled): the backend plans each graph Dynamo captures while it compiles, in the middle of a
  forward, possibly on one rank only. It must not issue a collective there, so it only *proposes* the plan
  (``GraphPlans``): the composite of all graphs' plans in forward order, with how each graph reduces (split or
  in-graph, Note [In-graph reduction]: ranks that differ there would issue different collectives, so the
  strategies are hashed into the tokens with the fingerprint). In every synchronised backward each rank
  contributes two tokens of its proposal (two 20-bit slices of its fingerprint, plus one; 0 for "none"), each
  with its square, to **one small all-reduce on the main group**: it runs whatever ``find_unused_parameters``
  and ``static_graph`` say, and where the policy counts usage it carries the usage count too (the iteration's
  only collective of graphddp's own besides the buckets: each one costs two ranks sharing a CPU a round trip
  and a worker's wake-up, ``docs/benchmarks.md``, session 9; where the last bucket can carry it, it rides
  inside that bucket's all-reduce and is no collective of its own, Note [The agreement rides a bucket] in
  ``graphddp.runtime.agreement_ride``). The sums
  equal ``n * token`` and ``n * token**2`` exactly when every rank contributed the same token (equality in
  Cauchy-Schwarz). At the next forward every rank adopts the proposal. When the tokens disagree, every rank
  gathers the proposals: if they hold the same parameters in other orders (data-dependent control flow: each
  rank captured another graph), every rank adopts rank 0's and reduces split (each graph keeps its own cut, its
  hooks fill the agreed buckets, some perhaps later; each rank's in-graph variant would all-reduce its own
  buckets, so none runs); otherwise (other parameters, or parts of tied tables, which name one rank's graph
  nodes) every rank raises the same error naming the first differing bucket (with
  ``find_unused_parameters=True``, where ranks may legitimately capture different branches, it warns and keeps
  the current plan). Ranks never reduce mismatched buckets. A joined rank (``join``) takes part as any other,
  except that one which proposed nothing (a rank with no batch at all compiled no graph) abstains: where the
  training ranks proposed the same, it adopts their proposals, broadcast from the first of them, and every rank
  adopts the plan (``joined_ranks_abstain``; one all-gather of the tokens before the gather of the plans).
  The same all-reduce carries each rank's count of training forwards (forwards with gradients enabled), so ranks
  that fell out of step (one skipped a backward, ran one under ``no_sync`` alone, ran out of data without
  ``join``) raise a clear error at their next forward instead of reducing one iteration's gradients with
  another's. It is issued just before the last bucket's collective, once every gradient is in
  (``Launcher.before_last``; after the waits where a comm hook chains collectives), so it is done when the last
  bucket is and the end of backward waits no round trip more for it; never at the end of a forward: a forward
  that no backward follows issues nothing. Where the last bucket can carry it, it is no all-reduce of its own:
  its entries ride in room after that bucket's gradients (Note [The agreement rides a bucket] in
  ``graphddp.runtime.agreement_ride``).
  Adopting a graph plan ends the ready-order rebuild (the graph knows the order), so a graph plan equal to the
  plan in force is proposed and adopted all the same: else the rebuild would re-cut the buckets away from the
  graph's split;
* **tables gone dense**: a row-sparse table that gave up rows (``graphddp.runtime.reductions``: every row touched
  every step, as a position table's, or gradients accumulated under ``no_sync``) is re-planned dense
  (``dense_again``): under the Reducer's own plan (registration or ready order) the plan it would have had
  without rows, the table in the buckets its neighbours fill (alone it cost every step a collective more, two
  where it split a bucket); under a compiled graphs' plan, whose buckets are the graphs' cuts, only a table with
  parts, and only its parts go. Every rank saw the same all-reduced outcomes, so every rank does it at the same
  forward.

A plan is a function of data every rank agrees on: the graph's structure and the caps (``plan_graph``), never one
rank's batch. And a graph is planned once: a **recompile** of a graph (same parameters; a shorter last batch, a
shape only one rank saw, dynamic shapes) is cut by the plan made for it before (``plan_for_graph``) and proposes
nothing, so a rank that recompiles alone keeps the collective order of the others. Where the new graph's natural
cut would differ, the split follows the agreed plan: buckets still launch in plan order, only perhaps later. One
exception: a recompile that reduces otherwise *by choice* (Dynamo's cache reset and the model compiled again with
another ``reduction`` asked of the backend, which every rank's code does alike) proposes the same plans anew with
its new strategy (``GraphPlans.restrategize``); that forward runs split through the Reducer, and the ranks switch
once they agree. A recompile that merely cannot build its in-graph variant proposes nothing: the other ranks
still run theirs, and ``InGraphGate`` raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pickle
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from tabulate import tabulate

from ..passes import BucketPlan, ParamSpec, compose_plans, first_difference_across, plan_buckets
from .agreement_ride import AgreementRide, Passage
from .auto_caps import AutoCaps
from .comm import all_gather_bytes, broadcast_bytes, broadcast_coalesced
from .launch_context import given_back, lend
from .profiling import trace_artifact
from .reductions import DENSE_STREAK_LIMIT

logger = logging.getLogger(__name__)


class GraphPlans:
    """The graph plans proposed so far, composed into the one plan the Reducer would switch to."""

    def __init__(self, specs_in_registration_order: Sequence[ParamSpec]) -> None:
        self._specs = list(specs_in_registration_order)
        self._by_graph: dict[str, BucketPlan] = {}  # in the order forward first ran them
        self._strategies: dict[str, str] = {}  # how each graph reduces: "split" or "in_graph"
        self._requests: dict[str, str] = {}  # the reduction its backend was asked for: "auto", "split", "in_graph"
        self.proposed: BucketPlan | None = None

    def propose(
        self, graph: str, plan: BucketPlan, current: BucketPlan, strategy: str = "split", *, requested: str = "auto"
    ) -> None:
        """Record ``plan`` for ``graph``, compiled now for the first time (graphs are first compiled in the order
        forward runs them), reduced by ``strategy`` (Note [In-graph reduction]) as its backend was ``requested``."""
        self._by_graph[graph] = plan
        self._strategies[graph] = strategy
        self._requests[graph] = requested
        # Proposed even when it equals the plan in force: adopting it (agreed by every rank) is what stops the
        # ready-order rebuild, which would otherwise re-cut the buckets away from the graph's split.
        self.proposed = compose_plans(list(self._by_graph.values()), self._specs[::-1], caps=current.caps)

    def caps_by_graph(self) -> dict[tuple[str, ...], str]:
        """The caps each graph was planned with (MiB), by its parameters' names: ``bucket_cap_mb="auto"`` chooses
        them per graph (Note [Automatic caps]); keyed by parameters, so ranks that compiled the same graphs in
        another order or other graphs are compared graph by graph."""
        return {tuple(sorted(plan.param_names)): plan.caps.mb for plan in self._by_graph.values()}

    def plan_for(self, params: frozenset[str]) -> BucketPlan | None:
        """The plan made for an earlier graph with exactly these parameters (a recompile cuts by it)."""
        graph = self._graph_of(params)
        return None if graph is None else self._by_graph[graph]

    def strategy_for(self, params: frozenset[str]) -> str | None:
        """How the earlier graph with exactly these parameters reduces, as last proposed (None: no such graph)."""
        graph = self._graph_of(params)
        return None if graph is None else self._strategies[graph]

    def restrategize(self, params: frozenset[str], strategy: str, current: BucketPlan, *, requested: str) -> bool:
        """A recompile of an earlier graph (same parameters) whose backend was ``requested`` another reduction
        than that graph's (Dynamo's cache reset, the model compiled again with another ``reduction``: every rank's
        code alike) reduces by ``strategy``: where that differs from what was proposed for it, every graph is
        proposed again with it, for the ranks to agree on (Note [Plan agreement]). True if so. A recompile asked
        the same (a shape one rank saw) changes nothing: its choice may be this rank's alone."""
        graph = self._graph_of(params)
        if graph is None or self._requests[graph] == requested:
            return False
        self._requests[graph] = requested
        if self._strategies[graph] == strategy:
            return False
        self._strategies[graph] = strategy
        self.proposed = compose_plans(list(self._by_graph.values()), self._specs[::-1], caps=current.caps)
        return True

    def _graph_of(self, params: frozenset[str]) -> str | None:
        return next((g for g, plan in self._by_graph.items() if set(plan.param_names) == params), None)

    @property
    def graphs(self) -> dict[str, BucketPlan]:
        return dict(self._by_graph)

    def in_graph_sets(self) -> frozenset[frozenset[str]]:
        """The parameter sets of the graphs that reduce in-graph."""
        return frozenset(frozenset(p.param_names) for g, p in self._by_graph.items() if self._strategies[g] == "in_graph")

    def tokens(self) -> tuple[int, int]:
        """What this rank contributes to the agreement (see the Note); zeros when nothing is proposed. The
        graphs' strategies and the blocks their big gradients go in (Note [Gradient pieces]) are part of it:
        ranks must not issue different collectives."""
        if self.proposed is None:
            return (0, 0)
        strategies = ",".join(self._strategies[g] for g in self._by_graph)
        pieces = ";".join(str([b.pieces for b in plan.buckets]) for plan in self._by_graph.values())
        digest = hashlib.sha1(f"{self.proposed.fingerprint}|{strategies}|{pieces}".encode()).hexdigest()
        return (int(digest[:5], 16) + 1, int(digest[5:10], 16) + 1)

    def take(self) -> BucketPlan | None:
        proposed, self.proposed = self.proposed, None
        return proposed

    def snapshot(self) -> tuple[dict[str, BucketPlan], dict[str, str], dict[str, str], BucketPlan | None]:
        """Everything proposed so far (each graph's plan, strategy and request, the composite), for a rank to
        ``adopt``."""
        return dict(self._by_graph), dict(self._strategies), dict(self._requests), self.proposed

    def adopt(self, snapshot: tuple[dict[str, BucketPlan], dict[str, str], dict[str, str], BucketPlan | None]) -> None:
        """Another rank's proposals become this rank's (a joined rank that compiled nothing, Note [Join]): its
        graphs, compiled later, are cut by the plans made for them there (``plan_for``) and propose nothing."""
        by_graph, strategies, requests, proposed = snapshot
        self._by_graph, self._strategies, self._requests = dict(by_graph), dict(strategies), dict(requests)
        self.proposed = proposed


def agreement_entries(tokens: tuple[int, ...]) -> list[int]:
    """The entries a rank adds to the agreement all-reduce: each token and its square."""
    return [v for t in tokens for v in (t, t * t)]


def agreed(tokens: tuple[int, ...], sums: list[int], ranks: int) -> bool | None:
    """True: every rank proposed this plan. False: ranks disagree. None: nobody proposed anything.

    ``sums`` are the all-reduced ``agreement_entries`` of ``ranks`` ranks.
    """
    if not any(sums):
        return None
    return all(t != 0 and s == ranks * t and q == ranks * t * t for t, s, q in zip(tokens, sums[0::2], sums[1::2]))


class PlanAgreement:
    """One agreement all-reduce in flight (see the Note); its verdict is read at the next forward. It also carries
    the rank's count of training forwards (``step``; None for a joined rank, which does not count), so ranks that
    fell out of step (Note [Plan agreement]) are found, and whatever int64 entries the iteration adds
    (``carrying``: the usage count, ``graphddp.runtime.unused``), so that graphddp's bookkeeping costs an iteration
    one small collective, not two; or, riding a bucket (``ride``), none of its own (Note [The agreement rides a
    bucket] in ``graphddp.runtime.agreement_ride``)."""

    OWN_ENTRIES = 2 * 2 + 5
    """Entries of its own: two tokens and their squares, and the five counted ones (``__init__``)."""

    def __init__(
        self, tokens: tuple[int, int], step: int | None, group: dist.ProcessGroup, device: torch.device, *,
        abandoned: bool = False, buffers_out_of_step: torch.Tensor | None = None, carrying: Sequence[int] = (),
        ride: AgreementRide | None = None,
    ) -> None:  # fmt: skip
        self.tokens, self.step, self.abandoned = tokens, step, abandoned
        self._ranks = dist.get_world_size(group)
        # [step, step², ranks counting, ranks that abandoned their last backward (Note [Abandoned backward]),
        #  ranks that received buffers broadcast from another forward than theirs]
        counted = (step, step * step, 1, int(abandoned), 0) if step is not None else (0,) * 5
        own = [*agreement_entries(tokens), *counted]
        self._own = len(own)
        assert self._own == self.OWN_ENTRIES
        flag = buffers_out_of_step if step is not None else None  # on the device: no host sync for a GPU's flag
        self._work: dist.Work | None = None
        self._passage: Passage | None = None  # riding: the ride's ``Passage``, until it is read
        if ride is not None:  # the sums come back in the bucket's room, read on the host (``settle``)
            self._sums = torch.zeros(self._own + len(carrying), dtype=torch.int64)
            self._passage = ride.seat([*own, *carrying], self._own, flag)
            return
        self._sums = torch.tensor([*own, *carrying], dtype=torch.int64, device=device)
        if flag is not None:
            self._sums[self._own - 1 : self._own] += flag
        self._alias = lend(self._sums)
        self._work = dist.all_reduce(self._alias, group=group, async_op=True)

    def verdict(self) -> bool | None:
        return agreed(self.tokens, self._read()[:-5], self._ranks)

    @property
    def joined(self) -> bool:
        """Issued by a joined rank's shadow (``join``), which counts no training forward."""
        return self.step is None

    def carried(self) -> tuple[torch.Tensor, PlanAgreement]:
        """The summed ``carrying`` entries (valid once ``settle`` returned) and this agreement, to settle."""
        return self._sums[self._own :], self

    def settle(self) -> None:
        """The backward's end: wait (the all-reduce went before the last bucket's, so it is done) and drop the
        ``Work``, so that nothing of the iteration stays in flight after backward (Note [A collective holds no
        Python object]: a ``barrier`` the script issues next would otherwise keep it, and with it ``_sums``, for
        one of gloo's threads to release, perhaps while the interpreter exits). Riding a bucket: its sums read
        back from the bucket's room (the bucket is waited for here if nothing has yet: an error in the end of
        backward before it)."""
        if self._passage is not None:
            passage, self._passage = self._passage, None
            self._sums.copy_(torch.tensor(passage.sums(), dtype=torch.int64))
        if self._work is not None:
            self._work.wait()
            self._work = None
            given_back(self._alias, "the plan agreement's tensor")

    @property
    def settled(self) -> bool:
        return self._work is None and (self._passage is None or self._passage.landed)

    def _read(self) -> list[int]:
        self.settle()
        return self._sums[: self._own].tolist()

    def out_of_step(self) -> bool:
        """Some counting rank was at another training forward than this one (read after ``verdict``)."""
        step_sum, square_sum, counting, _, _ = self._read()[-5:]
        return self.step is not None and (step_sum != counting * self.step or square_sum != counting * self.step**2)

    def buffers_from_another_forward(self) -> int:
        """Ranks that received the module's buffers broadcast from another forward than theirs (read after
        ``verdict``)."""
        return self._read()[-1]

    def abandoned_by_some(self) -> tuple[int, int] | None:
        """(ranks that abandoned their last backward, ranks counting) when some but not all did (read after
        ``verdict``), else None."""
        counting, abandoned, _ = self._read()[-3:]
        return (abandoned, counting) if 0 < abandoned < counting else None


def dense_again(plan: BucketPlan, tables: Sequence[str]) -> BucketPlan | None:
    """``plan`` with the row-sparse ``tables`` reduced dense (Note [Plan agreement], "tables gone dense"), or None
    where nothing changes. A Reducer's own plan (``"registration"``, ``"ready-order"``) of one dtype and device is
    planned again at its caps in its order, the tables no longer alone; with several (``mixed_precision``, a
    module across devices) the order between them is not kept in the buckets, so the tables keep their buckets,
    reduced dense. A compiled graphs' plan keeps its buckets, which are its graphs' cuts, and drops the parts of
    those tables that have some."""
    if plan.source == "graph":
        with_parts = sorted({p.name for p in plan.parts} & set(tables))
        return plan.without_rows(with_parts) if with_parts else None
    dense = plan.without_rows(tables)
    if len({(b.dtype, b.device) for b in plan.buckets}) > 1:
        return dense if dense.fingerprint != plan.fingerprint else None
    again = plan_buckets((p for b in dense.buckets for p in b.params), caps=plan.caps, source=plan.source)
    return again if again.fingerprint != plan.fingerprint else None


class DenseAgain:
    """Row-sparse tables planned dense (Note [Plan agreement], "tables gone dense"): those that gave up rows, each
    answered once per plan in force (under a compiled graphs' plan an untied table's layout stays what it was: not
    O(parameters) every forward), and, when a comm hook is registered, every one (a hook reduces dense buckets, as
    PyTorch hands them over; rows never apply under one). Under a Reducer's own plan they stay dense in every later
    re-plan (the ready-order rebuild plans from the specs, which say so)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._answered: set[str] = set()

    def installed(self) -> None:
        """A plan is in force: its row-sparse tables are reduced afresh, and may give up again."""
        self._answered.clear()

    def gave_up(self, plan: BucketPlan, specs: list[ParamSpec], tables: Sequence[str]) -> tuple[BucketPlan | None, list[ParamSpec]]:
        """``plan`` and ``specs`` with the ``tables`` that gave up rows and were not answered yet reduced dense."""
        fresh = [t for t in tables if t not in self._answered]
        self._answered.update(fresh)
        again, specs = self._dense(plan, specs, fresh)
        if again is not None:
            logger.info(
                "[rank %d] graphddp: %s went dense %d iterations in a row (every row touched, as a position table's, or "
                "gradients accumulated under no_sync); all-reduced dense from now on: %d buckets "
                "(Note [Row-sparse gradients])", self._rank, ", ".join(fresh), DENSE_STREAK_LIMIT, len(again.buckets),
            )  # fmt: skip
        return again, specs

    def for_comm_hook(self, plan: BucketPlan, specs: list[ParamSpec]) -> tuple[BucketPlan | None, list[ParamSpec]]:
        """``plan`` and ``specs`` with every row-sparse table dense, under a Reducer's own plan; a compiled graphs'
        plan keeps its parts, which then travel twice (``PlanKeeper.comm_hook_registered`` warns)."""
        if plan.source == "graph":
            return None, specs
        return self._dense(plan, specs, plan.row_sparse_tables)

    @staticmethod
    def _dense(plan: BucketPlan, specs: list[ParamSpec], tables: Sequence[str]) -> tuple[BucketPlan | None, list[ParamSpec]]:
        again = dense_again(plan, tables) if tables else None
        if again is None or again.source == "graph":
            return again, specs
        return again, [dataclasses.replace(s, row_sparse=False) if s.name in tables else s for s in specs]


def joined_ranks_abstain(graph_plans: GraphPlans, joined: bool, *, group: dist.ProcessGroup, device: torch.device) -> bool:
    """The ranks proposed different plans: True when the only difference is that ranks which shadowed that
    backward inside ``join()`` (``joined``: this rank did) proposed nothing (a rank with no batch at all never
    compiled a graph) while the training ranks proposed the same; those ranks then adopt the training ranks'
    proposals into ``graph_plans`` (a broadcast from the first of them) and every rank adopts the plan as agreed.
    False otherwise (``PlanKeeper._plans_differ`` decides). Collective: an all-gather of each rank's tokens
    (Note [Plan agreement], Note [Join] in ``graphddp.runtime.join``)."""
    tokens = graph_plans.tokens()
    mine = torch.tensor([*tokens, int(joined and tokens == (0, 0))], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    votes = [v.tolist() for v in everyone]
    voters = [r for r, v in enumerate(votes) if not v[2]]
    if len(voters) in (0, len(votes)) or any(votes[r][:2] != votes[voters[0]][:2] for r in voters):
        return False
    rank = dist.get_rank(group)
    mine = pickle.dumps(graph_plans.snapshot()) if rank == voters[0] else b""
    shared = broadcast_bytes(mine, src=voters[0], group=group)
    if votes[rank][2]:
        graph_plans.adopt(pickle.loads(shared))
        logger.info(
            "[rank %d] graphddp: this rank joined without compiling a graph; it adopts the graph plans rank %d "
            "proposed, as every training rank did (Note [Join])", rank, voters[0],
        )
    return True


class ReadyOrder:
    """The order gradients became ready in the first synchronised backward, and when (seconds since the end of
    forward), for the one-time rebuild and automatic caps."""

    def __init__(self) -> None:
        self._seen: list[int] | None = []  # None: not learning (any more)
        self._times: list[float] = []
        self._started = time.perf_counter()
        self.learned: list[int] | None = None
        self.learned_times: list[float] = []
        """Seconds from the end of forward to each of ``learned``'s gradients (the end of backward for gradients
        that came in no hook)."""
        self.backward_s = 0.0
        self.observed: list[int] = []
        """The last order learned, kept after the plan is rebuilt (``_get_ddp_logging_data`` reports it)."""

    @property
    def learning(self) -> bool:
        """Still learning the order (each gradient's hook must ``observe``)."""
        return self._seen is not None

    def restart(self) -> None:
        """A backward begins: one that failed part-way leaves no stale order behind."""
        if self._seen is not None:
            self._seen, self._times, self._started = [], [], time.perf_counter()

    def observe(self, i: int) -> None:
        if self._seen is not None:
            self._seen.append(i)
            self._times.append(time.perf_counter() - self._started)

    def compute_ended(self) -> None:
        """Backward's compute is over (the Reducer's finalize begins, before it waits for the collectives)."""
        if self._seen is not None:
            self.backward_s = time.perf_counter() - self._started

    def backward_ended(self, in_plan_order: Sequence[int]) -> None:
        if self._seen is not None:
            seen = set(self._seen)
            missing = [i for i in dict.fromkeys(in_plan_order) if i not in seen]
            self.learned = self.observed = self._seen + missing
            self.learned_times = self._times + [self.backward_s] * len(missing)
            self._seen = None

    def forget(self) -> None:
        """A graph's plan was adopted: the graph knows the order better than one observed backward."""
        self._seen = self.learned = None


def planned_specs(named_params: Sequence[tuple[str, torch.nn.Parameter]], plan: BucketPlan) -> list[ParamSpec]:
    """Every parameter's spec, by index, as ``plan`` has it: its marks (row-sparse, sparse) and bucket dtype
    (``mixed_precision``) carry over to every re-plan."""
    planned = {s.name: s for b in plan.buckets for s in b.params if not s.part}
    return [planned.get(n) or ParamSpec.of(n, p) for n, p in named_params]


def _warn_chosen_for_another_wire(rank: int, auto_caps: AutoCaps, *, chosen_for: torch.dtype | None, now: torch.dtype | None) -> None:
    """A comm hook that sends buckets in ``now`` came after the automatic caps were chosen for ``chosen_for``."""
    logger.warning(
        "[rank %d] graphddp: a comm hook that sends buckets in %s was registered after the automatic caps were "
        "chosen (%s) for buckets sent in %s; those caps stay. Register the hook before the first backward (and the "
        "first compiled forward) for the caps to be chosen on what it sends.",
        rank, now or "the gradients' dtype", ", ".join(c.caps.mb + " MiB" for c in auto_caps.choices), chosen_for or "the gradients' dtype",
    )  # fmt: skip


class PlanKeeper:
    """Holds the plan in force and decides, at the start of each forward, whether to switch (see the Note)."""

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        initial: BucketPlan,
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        auto_caps: AutoCaps | None = None,
    ) -> None:
        self.specs = list(specs)
        """Every parameter the Reducer covers, by index."""
        self.current = initial
        self.graph_plans = GraphPlans(self.specs)
        self.ready_order = ReadyOrder()
        self._group, self._device = group, device
        self._auto_caps = auto_caps
        self._wire: torch.dtype | None = None  # what the comm hook in force sends a bucket in (None: the gradients' own)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._agreement: PlanAgreement | None = None
        self._abandoned = False  # drained an abandoned backward since the last agreement (Note [Abandoned backward])
        self._buffers_out_of_step: torch.Tensor | None = None  # 1: buffers came from another forward (on the device)
        self._buffers_warned = False
        self._dense = DenseAgain(self.rank)
        self.agreed_in_graph: frozenset[frozenset[str]] = frozenset()
        """Parameter sets of the agreed graphs that reduce in-graph (``graphddp.runtime.in_graph``)."""
        self.training_forwards = 0
        """Forwards run with gradients enabled (synchronising or under no_sync); ranks must agree on it."""
        self.ride: AgreementRide | None = None
        """The bucket the agreement rides in the plan in force, if any (set by the Reducer with its buckets)."""

    @property
    def device(self) -> torch.device:
        """Where the DDP's collectives run (the agreement's own, where it does not ride)."""
        return self._device

    def install(self, plan: BucketPlan) -> None:
        """``plan`` is in force from now on (the Reducer has made its buckets): traced, and logged at DEBUG."""
        self.current = plan
        self._dense.installed()
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

    def forward_began(self, grad_enabled: bool) -> None:
        """A forward began (after ``next_plan``): one more training forward if it has gradients enabled, sent with
        the next agreement, so ranks out of step are found."""
        if grad_enabled:
            self.training_forwards += 1

    def adopt_forward_count(self, src: int) -> None:
        """The end of a ``join``: ``src``'s count of training forwards becomes every rank's (a collective)."""
        count = torch.tensor([self.training_forwards], dtype=torch.int64, device=self._device)
        dist.broadcast(count, group=self._group, group_src=src)
        self.training_forwards = int(count.item())

    def comm_hook_registered(self, wire: torch.dtype | None) -> None:
        """A comm hook now reduces every bucket dense, sending it in ``wire`` (``CommHook.wire_dtype``; the automatic
        caps predict those bytes): warn if tied tables' gradients were split into parts, or if caps were chosen
        already on other bytes."""
        if wire != self._wire and self._auto_caps is not None and self._auto_caps.choices:
            _warn_chosen_for_another_wire(self.rank, self._auto_caps, chosen_for=self._wire, now=wire)
        self._wire = wire
        parts = {p.label for plan in (self.current, self.graph_plans.proposed) if plan is not None for p in plan.parts}
        if parts:
            logger.warning(
                "[rank %d] graphddp: a comm hook was registered after torch.compile split tied tables' gradients "
                "into parts (%s); with a hook every bucket is reduced dense, so those tables now travel twice. "
                "Register the hook before the first compiled forward.",
                self.rank, ", ".join(sorted(parts)),
            )

    # -- compiled graphs -----------------------------------------------------------------------------------------
    def propose(self, graph: str, plan: BucketPlan, strategy: str = "split", *, requested: str = "auto") -> None:
        self.graph_plans.propose(graph, plan, self.current, strategy, requested=requested)

    @property
    def proposing(self) -> bool:
        """A graph plan awaits the ranks' agreement."""
        return self.graph_plans.proposed is not None

    def plan_for_graph(self, params: frozenset[str]) -> BucketPlan | None:
        return self.graph_plans.plan_for(params)

    def start_agreement(self, *, joined: bool = False, carrying: Sequence[int] = ()) -> PlanAgreement | None:
        """Once a synchronised backward's gradients are all in (or a joined rank's shadow of it), before its last
        bucket's collective: the agreement all-reduce, async, with ``carrying`` summed in the same collective; or
        none of its own where it rides that bucket (``ride``, Note [The agreement rides a bucket]). None on one
        rank."""
        if self.world_size == 1:
            return None
        step = None if joined else self.training_forwards
        abandoned, self._abandoned = self._abandoned and not joined, False
        buffers, self._buffers_out_of_step = self._buffers_out_of_step, None
        self._agreement = PlanAgreement(
            self.graph_plans.tokens(), step, self._group, self._device, abandoned=abandoned,
            buffers_out_of_step=buffers, carrying=carrying, ride=self.ride,
        )  # fmt: skip
        if joined and self.ride is None:  # a shadow has no end of backward to settle at; a joined rank is idle anyway
            self._agreement.settle()  # (riding: once the shadow has waited for its bucket, ``backward_ended``)
        return self._agreement

    def broadcast_buffers(self, buffers: Sequence[torch.Tensor], src: int, *, counted: bool) -> None:
        """The module's buffers from ``src``, with ``src``'s count of training forwards beside them (coalesced with
        the int64 buffers, e.g. BatchNorm's ``num_batches_tracked``). A rank whose count differs received them
        from a forward it did not run at the same point (an evaluation forward through the wrapper on some ranks
        only): its next agreement says so and every rank warns, once. Not an error: after a backward the
        collectives still match and the buffers are rank 0's, as in PyTorch's DDP. Not ``counted`` under ``join``,
        where ranks that joined legitimately stopped counting. Written in place on the receiving ranks, the buffers
        may be saved by an earlier forward's graph (two forwards, one backward: a Siamese model's BatchNorm): the
        caller keeps their version counters, as PyTorch's DDP does, or that backward raises on those ranks only."""
        step = torch.tensor([self.training_forwards], dtype=torch.int64, device=self._device)
        broadcast_coalesced([*buffers, step], src=src, group=self._group)
        if counted:  # compared on the device, read with the agreement's verdict (no host sync per forward)
            differs = (step != self.training_forwards).to(torch.int64)
            previous = self._buffers_out_of_step
            self._buffers_out_of_step = differs if previous is None else torch.maximum(previous, differs)

    def backward_ended(self, in_plan_order: Sequence[int]) -> None:
        """A synchronised backward ended, or a joined rank's shadow of one: the ready order learns from it (a rank
        that joined before any backward of its own offers the plan's order, which serves every rank if it is rank
        0: the first backward's rebuild is a broadcast on every rank), and its agreement is settled
        (``PlanAgreement.settle``; a shadow's that rides no bucket at once, in ``start_agreement``)."""
        self.ready_order.backward_ended(in_plan_order)
        if self._agreement is not None:
            self._agreement.settle()

    @property
    def agreement_in_flight(self) -> bool:
        """An agreement all-reduce was issued and not yet waited for (only ever between its issue and the end of
        the backward that issued it)."""
        return self._agreement is not None and not self._agreement.settled

    def backward_abandoned(self, in_plan_order: Sequence[int]) -> None:
        """This rank drained an abandoned backward (Note [Abandoned backward]): its next agreement says so, and it
        ends as the other ranks' did for the ready order (a first backward's rebuild is a broadcast at the next
        forward, on every rank)."""
        self._abandoned = True
        self.ready_order.backward_ended(in_plan_order)

    # -- switching -----------------------------------------------------------------------------------------------
    def next_plan(self, *, grad_enabled: bool, allows_unused: bool, gone_dense: Sequence[str]) -> BucketPlan | None:
        """The plan to adopt before this forward, or None to keep the current one. Collective when the last
        agreement failed (every rank gathers the plans) and for the ready-order rebuild (a broadcast)."""
        agreement = self._agreement
        verdict = self._read_agreement()
        if verdict is False:
            joined = agreement is not None and agreement.joined
            if joined_ranks_abstain(self.graph_plans, joined, group=self._group, device=self._device):
                verdict = True  # this rank now holds the training ranks' proposal
            elif (plan := self._plans_differ(allows_unused)) is not None:
                return plan
        if verdict:
            return self._adopt_graph_plans()
        if self.ready_order.learned is not None and grad_enabled:
            plan = self._rebuild_in_ready_order()
            if plan is not None:
                return plan
        plan, self.specs = self._dense.gave_up(self.current, self.specs, gone_dense)
        return plan

    def plan_for_comm_hook(self) -> BucketPlan:
        """The plan a comm hook reduces: the plan in force, its row-sparse tables dense (``DenseAgain``)."""
        plan, self.specs = self._dense.for_comm_hook(self.current, self.specs)
        return plan or self.current

    def _adopt_graph_plans(self) -> BucketPlan:
        """Every rank proposed the same graph plans (or adopted them, ``joined_ranks_abstain``): they are in force
        from this forward."""
        self.agreed_in_graph = self.graph_plans.in_graph_sets()
        plan = self.graph_plans.take()
        assert plan is not None
        self.ready_order.forget()
        logger.info(
            "[rank %d] graphddp: adopting the compiled graphs' bucket plan: %d buckets, bytes %s, fingerprint %s",
            self.rank, len(plan.buckets), [b.nbytes for b in plan.buckets], plan.fingerprint,
        )
        return plan

    def _read_agreement(self) -> bool | None:
        if self.world_size == 1:
            return True if self.graph_plans.proposed is not None else None
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            return None
        verdict = agreement.verdict()
        if agreement.out_of_step():
            raise RuntimeError(
                f"[rank {self.rank}] graphddp.DDP: the ranks are out of step: this rank's last synchronised backward "
                f"(after its training forward #{agreement.step}) was matched with another rank's at a different "
                "forward. The common cause: a forward with gradients enabled on one rank only (an evaluation or "
                "logging forward on rank 0): run it through ddp.module under torch.no_grad(), which no rank counts. "
                "Otherwise a rank skipped a backward, ran one under no_sync() alone, or ran out of data without "
                "ddp.join(); every rank must run the same sequence of training forwards and backwards "
                "(Note [Plan agreement] in graphddp/runtime/plans.py)."
            )
        if agreement.buffers_from_another_forward() and not self._buffers_warned:
            self._buffers_warned = True  # once per wrapper: a periodic log on rank 0 would repeat it every time
            logger.warning(
                "[rank %d] graphddp.DDP: some rank received the module's buffers broadcast from another forward than "
                "its own: a forward through the wrapper ran on some ranks only (an evaluation or log on rank 0 via "
                "ddp(x), even under torch.no_grad(): after a training forward it broadcasts the buffers). Run it as "
                "ddp.module(x): between a forward and its backward the same call aborts the job, in PyTorch's DDP too.",
                self.rank,
            )
        if (some := agreement.abandoned_by_some()) is not None:
            here = " (this rank among them)" if agreement.abandoned else ""
            raise RuntimeError(
                f"[rank {self.rank}] graphddp.DDP: {some[0]} of {some[1]} ranks{here} abandoned the backward of "
                f"training forward #{agreement.step - 1} mid-way (an error raised inside backward, such as out of "
                "memory, caught and the batch skipped) while the other ranks finished it and averaged their "
                "gradients with zeros: if they stepped, the replicas differ now. Skip a batch on every rank "
                "together (all-reduce a flag saying some rank failed, then every rank skips), or restart from a "
                "checkpoint (Note [Abandoned backward] in graphddp/runtime/iteration.py)."
            )
        return verdict

    def _rebuild_in_ready_order(self) -> BucketPlan | None:
        """Rank 0's observed order, broadcast (collective), planned with the current caps, or, with automatic
        caps, with caps chosen from rank 0's ready times (broadcast too; Note [Automatic caps])."""
        learned = self.ready_order
        assert learned.learned is not None
        order = torch.tensor(learned.learned, dtype=torch.int64, device=self._device)
        if self.world_size > 1:
            dist.broadcast(order, group=self._group, group_src=0)
        specs = [self.specs[i] for i in order.tolist()]
        caps = self.current.caps
        if self._auto_caps is not None:
            times = torch.tensor([*learned.learned_times, learned.backward_s], dtype=torch.float64, device=self._device)
            if self.world_size > 1:
                dist.broadcast(times, group=self._group, group_src=0)
            *ready_s, backward_s = times.tolist()
            caps = self._auto_caps.for_ready_times(specs, ready_s, backward_s, wire=self._wire)
        self.ready_order.forget()
        plan = plan_buckets(specs, caps=caps, source="ready-order")
        if plan.fingerprint == self.current.fingerprint:
            return None
        logger.info(
            "[rank %d] graphddp: buckets rebuilt in gradient-ready order: %d buckets, bytes %s",
            self.rank, len(plan.buckets), [b.nbytes for b in plan.buckets],
        )
        return plan

    def _plans_differ(self, allows_unused: bool) -> BucketPlan | None:
        """The ranks proposed different plans. Every rank gathers every rank's proposal (a collective). Proposals of
        the same parameters in other orders (data-dependent control flow): rank 0's serves every rank, each graph
        keeps its own split and its gradients reach the Reducer's buckets by their hooks (in plan order, some
        perhaps later), reduced split, never in-graph. Otherwise every rank raises naming the first differing
        bucket (with ``find_unused_parameters``, where branches legitimately differ, it warns and keeps the plan)."""
        proposed = self.graph_plans.take()
        rows = proposed.describe() if proposed is not None else []
        # What a proposal holds (parameters and shapes, in any order); parts are tied to one rank's graph nodes.
        holds = sorted(f"{p.label}{list(p.shape)}" for b in proposed.buckets for p in b.params) if proposed else None
        caps = self.graph_plans.caps_by_graph()
        mine = (rows, holds, bool(proposed and proposed.parts), proposed if self.rank == 0 else None, caps)
        everyone = [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(mine), group=self._group)]
        plan = everyone[0][3]  # rank 0's proposal; every rank decides from the same gathered data
        same = all(h is not None and h == everyone[0][1] and not parts for _, h, parts, *_ in everyone)
        cause = automatic_caps_differ([e[4] for e in everyone], self._auto_caps.search.searched()) if self._auto_caps else ""
        if same and plan is not None and plan.coverage_problem(p.name for p in self.specs) is None:
            self.agreed_in_graph = frozenset()  # each rank's in-graph variant all-reduces its own buckets
            self.ready_order.forget()
            logger.log(
                logging.WARNING if cause else logging.INFO,
                "[rank %d] graphddp: the ranks compiled the same parameters %s; every rank adopts rank 0's bucket "
                "plan (%d buckets, fingerprint %s) and reduces split (Note [Plan agreement]).%s",
                self.rank, "cut into other buckets" if cause else "in different orders", len(plan.buckets),
                plan.fingerprint, cause,
            )  # fmt: skip
            return plan
        index, entries = first_difference_across([r for r, *_ in everyone], ("", "<no such bucket>")) or (
            0, [("", "")] * len(everyone)
        )  # fmt: skip
        differing = [r for r, e in enumerate(entries) if e != entries[0]]
        message = (
            f"[rank {self.rank}] graphddp: the ranks compiled different bucket plans. First difference at bucket "
            f"{index}: rank 0 has [{entries[0][1]}]; "
            + "; ".join(f"rank {r} has [{entries[r][1]}]" for r in differing)
            + ". The previous plan stays in use (Note [Plan agreement] in graphddp/runtime/plans.py)."
        )
        if not allows_unused:
            raise RuntimeError(
                message + (cause or " Every rank must capture graphs of the same parameters (same code path, same "
                "graph breaks), or pass find_unused_parameters=True when ranks take different branches.")
            )
        # With find_unused_parameters / static_graph, rank-dependent branches legitimately capture different
        # graphs: keep the current plan, which every rank shares.
        logger.warning("%s%s", message, cause or " Ranks take different branches (find_unused_parameters=True): the current plan stays.")
        return None


def automatic_caps_differ(caps_by_rank: Sequence[Mapping[tuple[str, ...], str]], searched: Sequence[str]) -> str:
    """Why the ranks' plans differ where the caps left to ``"auto"`` (``searched``: the options' names) were chosen
    otherwise on some rank for the same graph (the same parameters; ``GraphPlans.caps_by_graph`` per rank): each
    rank chooses a compiled graph's caps from its own graph's shapes (Note [Automatic caps]), so ranks whose first
    compiled inputs differ in shape may choose differently. Empty where every graph's caps agree (another cause:
    other graphs, other orders)."""
    graphs = sorted(set().union(*caps_by_rank))
    differing = [g for g in graphs if len({caps[g] for caps in caps_by_rank if g in caps}) > 1]
    if not differing:
        return ""
    graph = differing[0]
    options = ", ".join(searched)
    return (
        f" The caps left to 'auto' ({options}) were chosen by each rank from the shapes of its own captured graph, and "
        f"for the graph holding {graph[0]} they differ: "
        + "; ".join(f"rank {r}: {caps[graph]} MiB" for r, caps in enumerate(caps_by_rank) if graph in caps)
        + f". Give every rank inputs of the same shapes in the first compiled step (pad them to one length), or give "
        f"{options} a number; Note [Automatic caps] in passes/caps_choice.py."
    )
