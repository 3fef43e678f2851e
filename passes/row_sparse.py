"""Embedding tables whose gradient is reduced as the rows a batch touched, and tied tables' parts: which ones.

Note [Row-sparse gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An embedding lookup's gradient touches only the rows of the tokens in the batch: a few hundred of a table's
thousands. Reduced as a dense bucket, the whole table travels; and since the table is used at the very start of
forward, its gradient is complete only at the very end of backward, with no backward left to hide its
all-reduce behind (the bench GPT's 16.8 MB table: 70 ms at 2 Gbit/s, all of it exposed).

The Reducer reduces such a gradient as rows (``RowSparseReduction`` in ``graphddp.runtime.reductions``):

1. each rank finds the rows its gradient touches (a scan of the bucket), and the ranks take the union of those
   sets with a small all-reduce of one byte per row;
2. if the union holds at most ``ROW_SPARSE_MAX_DENSITY`` (half) of the rows, the ranks all-reduce those rows
   only, packed ``[U, C]``, and scatter them back into the bucket; otherwise they all-reduce the bucket dense.

Both steps depend only on all-reduced data, so every rank takes the same branch, and the result never depends
on the gradient really being sparse: a table that some other code also uses simply goes dense. A table that
goes dense ``DENSE_STREAK_LIMIT`` times in a row (a small vocabulary most of which every batch touches, a position
table, gradients accumulated under ``no_sync``) is reduced dense from then on, and its parts are dropped from the
plan (``BucketPlan.without_rows``), so they do not travel on top of it; under the Reducer's own plan it also
leaves its bucket of its own for the buckets it would have shared dense (``graphddp.runtime.plans.dense_again``):
again decided from all-reduced outcomes.

**When rows pay** (``rows_pay``, the one rule for both paths; ``sparse_embedding_grads="auto"``, the default).
Rows are not free: they add a collective (the mask) per table, a round trip that a fast link measures at about
1 ms over loopback, more than the bytes of a small table. On a slow link the bytes win instead: the bench GPT's
table is 134 ms at 1 Gbit/s. So, on the link measured at construction (the same on every rank,
``graphddp.runtime.calibration``), the rows save ``dense - rows`` seconds a step per table: the table's
all-reduce, against the mask's (one byte per row) and the rows' at the worst case still reduced as rows
(``ROW_SPARSE_MAX_DENSITY`` of them), both with gloo's CPU per byte (on the bytes each rank sends, ``2 (w - 1) /
w`` of the payload, as it is measured: ``ring_bytes_sent``); that rows are all exposed at the end of
backward holds for the dense table too. A tied table's parts (below) are not free either: dense, the output
layer's contribution is summed into the table's gradient and travels once; as rows, each part is a table-sized
all-reduce of its own, early in backward, where its link time can hide behind the compute that follows but gloo's
CPU per byte cannot (on a CPU rank it slows that compute), so the rows are charged each part's CPU, at
``PART_CPU_FACTOR`` (2) times the calibrated CPU per byte: sent beside a backward, gloo's bytes cost the compute
about twice what the calibration measured (session 23: ~1.5 against 0.69 ns/B, when the calibration timed a matmul
loop's slowdown; since session 42 it measures gloo's threads' CPU, 0.6-1.5 ns/B at construction on the same
testbed, Note [What communication costs a CPU rank] in ``graphddp/runtime/calibration.py``, and the factor stays:
the matrix's verdicts below hold from 0.70 to 1.84 ns/B, ``tests/pure/test_rows_pay.py``; at 5 Gbit/s the verdict
turns to rows below 0.47-0.57 ns/B, the line it was near before). Charged at
1x, the rule said rows by 9 ms at 5 Gbit/s for the bench GPT's tied table (16.8 MB), where dense was as fast or
faster in every matrix run that had both (sessions 21-34, by up to ~110 ms a step); at 2x it says dense there
(-3 ms at 0.70 ns/B) and rows at 1 Gbit/s (+49 ms), where rows won in most runs. A part's link time is not
charged where the link binds. Gloo's CPU per byte is measured at construction where a CPU group's ``"auto"``
decides for a module with a tied table (``tied_tables``), or automatic caps measured it already; where measured,
every table's verdict counts it (on an untied table it only moves the verdict towards rows). 0 where nothing
measured it (a module without a tied table, fixed caps) and on GPUs: ``graphddp.runtime.rows_rule.charges_gloo_cpu``
decides, for a run and for ``graphddp inspect --comm-cpu`` alike.
The tables go rows when ``saved`` is positive (eagerly each table for itself;
compiled all the tables of a graph together). Compiled, rows no longer keep a graph on the split: in-graph, an
opaque node reduces them (Note [Rows in the compiled backward] in ``graphddp/runtime/in_graph_rows.py``); until
then (session 10) the rule also charged the split's launches, and the matrix's GPT ran split.

Only the table's shape and agreed measurements go in, never a batch (below), so
every rank decides alike. ``True`` keeps rows wherever they apply, without measuring; ``False`` never uses them.

**What a plan may depend on.** Every rank must build the same plan, and ranks see different batches (a short
last batch, uneven shards) and may recompile alone. So whether a table is planned as rows is a function of the
graph's *structure* only, never of a batch: how many rows a batch touches is left to the all-reduced mask,
every iteration. Four rules, each one function:

* ``rows_apply``: is row-sparse reduction used at all (the option, several ranks, CPU buckets, the default comm
  hook)? The DDP module, the Reducer, the compile backend and ``graphddp inspect`` all ask it.
* ``rows_pay`` (with ``"auto"``): do rows pay on the measured link (above)?
* ``embedding_tables`` (eager, no graph): the weights of ``nn.Embedding`` modules that no other module shares.
* ``row_sparse_params`` (compiled): a 2-D parameter that a captured graph brings in as an input and looks rows
  up in, not with ``torch.arange`` (a position table), whose other uses (if any) all come after the last lookup
  in forward.

A **tied** table (the GPT's ``wte``, also the output layer's weight) receives, at the *start* of backward, a
dense contribution from the output layer, which makes the sum dense. Compiled, graphddp splits it off: the
contribution of each other use is a *part* (``ParamSpec.part``), a slot of its own in the bucket of the segment
that computes it. A tap in the stitched graph (``passes/taps.py``, ``graphddp.compiler.gradient_tap``) feeds the
parameter to that segment; the tap's backward hands the segment's contribution to the Reducer and passes nothing
on to ``.grad``. The part is all-reduced early, hidden behind the rest of backward; the lookups' rows go last,
and they are few. Once both are reduced, the Reducer adds the part into the parameter's gradient: all-reduce is
linear, so the result is the all-reduce of the sum, as in PyTorch's DDP. The bench GPT sends 2 MB after backward
instead of 16.8 MB. In-graph there is no tap and no Reducer: the part's use goes through its bucket's call, and
the table's own call adds the part's average to the rows' (Note [Rows in the compiled backward]).

A use that sends no gradient back (a ``.detach()``, anything under ``no_grad``) does not count. Once the graph
is cut, each part must sit in a segment of its own, apart from the lookups' segments (a tap feeds one segment's
input, so two uses in one segment cannot be told apart); ``plan_graph`` re-plans without the parameters for
which the cut fails that (``misplaced_parts``). A graph cut by a plan made earlier (a recompile, Note [Plan
agreement] in ``graphddp/runtime/plans.py``) gets taps only where that plan's parts can still be placed.

A tap passes its gradient on to ``.grad`` unchanged when its slot is not in the Reducer's plan, is already
filled, or the backward is not synchronised (``no_sync``): autograd then accumulates it with the parameter's
other contributions, before the parameter's gradient is complete, which is always correct (a part slot nobody
filled is reduced as zeros). It also passes it on when the backward will not accumulate into the parameter at
all (``torch.autograd.grad``): that gradient is the caller's, whole, and no bucket may move.

This module is pure: no ``torch.distributed``, no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch import nn

from .cost import LinkModel, ring_bytes_sent
from .graph_params import GraphParam, GraphUse
from .plan import BucketPlan
from .split import GraphSplit

ROW_SPARSE_MAX_DENSITY = 0.5
"""A row-sparse bucket is reduced as rows when at most this share of its rows is touched on some rank."""

PART_CPU_FACTOR = 2.0
"""What a tied table's part, sent beside the backward, costs the compute, in multiples of the CPU per byte the
calibration measures (the Note, "When rows pay")."""


def rows_apply(*, enabled: bool, world_size: int, device: str, custom_comm_hook: bool) -> bool:
    """Is row-sparse reduction (and, compiled, splitting tied tables into parts) used at all?

    Only with ``sparse_embedding_grads`` on, between several ranks (one rank has nothing to send), on CPU buckets
    (CUDA buckets are not measured yet) and under the default comm hook (a hook reduces dense buckets, as PyTorch
    hands them over).
    """
    return enabled and world_size > 1 and device.startswith("cpu") and not custom_comm_hook


@dataclasses.dataclass(frozen=True)
class RowsVerdict:
    """Whether some tables' gradients pay to be reduced as rows, and by how much (see the Note)."""

    rows: bool
    saved_s: float
    """Seconds a step the rows save over the dense all-reduce, at the worst case still reduced as rows."""

    def describe(self) -> str:
        return f"{'as rows' if self.rows else 'dense'}: rows would save {self.saved_s * 1e3:.2f} ms a step on the link"


def rows_pay(
    tables: Sequence[tuple[int, int]], *, link: LinkModel, world: int, cpu_seconds_per_byte: float = 0.0,
    parts: Sequence[int] = (),
) -> RowsVerdict:
    """Do ``tables`` (each as ``(rows, bytes per row)``) pay to be reduced as rows rather than dense, on ``link``
    between ``world`` ranks? (Note [Row-sparse gradients], "When rows pay".) ``parts``: per table, how many
    table-sized parts go dense beside its rows (a tied table's other uses; none where not given). No table: no
    rows."""
    if world < 1 or cpu_seconds_per_byte < 0:
        raise ValueError(f"rows_pay: world must be >= 1 and costs >= 0, got world={world}, cpu={cpu_seconds_per_byte}")
    if parts and (len(parts) != len(tables) or min(parts) < 0):
        raise ValueError(f"rows_pay: parts must give each of the {len(tables)} tables a count >= 0, got {list(parts)}")

    def reduce_s(nbytes: int) -> float:
        return link.allreduce_s(nbytes, world) + cpu_seconds_per_byte * ring_bytes_sent(nbytes, world)

    saved = 0.0
    for (rows, row_bytes), sent_dense in zip(tables, parts or [0] * len(tables)):
        worst = math.ceil(rows * ROW_SPARSE_MAX_DENSITY) * row_bytes  # the most rows still reduced as rows
        saved += reduce_s(rows * row_bytes) - reduce_s(rows) - reduce_s(worst)
        # Dense, a part's contribution travels inside the table's gradient; as rows, each part is a table-sized
        # all-reduce of its own, sent while backward computes: its link time may hide there, its CPU cannot.
        saved -= sent_dense * PART_CPU_FACTOR * cpu_seconds_per_byte * ring_bytes_sent(rows * row_bytes, world)
    return RowsVerdict(bool(tables) and saved > 0, saved)


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


def row_sparse_params(params: Sequence[GraphParam]) -> list[RowSparseParam]:
    """The 2-D graph inputs some node looks rows up in, whose other uses all come after the last lookup (their
    parts are then ready before the lookups' rows in backward). A function of the graph's structure only: how
    many rows a batch touches is decided every iteration from the all-reduced mask (see the Note)."""
    found = []
    for p in params:
        uses = [u for u in p.uses if u.differentiable]  # a detached or no_grad use sends no gradient back
        lookups = [u for u in uses if u.lookup]
        others = [u for u in uses if not u.lookup]
        if len(p.spec.shape) != 2 or not lookups or any(u.positions for u in lookups):
            continue  # a position table (looked up with arange) has every row up to the sequence length touched
        if not p.is_input:  # get_attr: copied into each segment, so there is no segment input to tap
            continue
        if any(u.position < lookups[-1].position for u in others):  # its part would be ready after the rows
            continue
        found.append(RowSparseParam(p.spec.name, p.node, tuple(lookups), tuple(others)))
    return found


def parts_named_in(plan: BucketPlan, params: Sequence[GraphParam]) -> BucketPlan | None:
    """``plan`` with each part of a tied table named after the use that contributes it in the graph of ``params``.

    A recompile is cut by the plan made before (Note [Plan agreement]) and may name its nodes anew (``logits``
    becomes ``logits_1``). Reduced in-graph, a part whose node is not found would get no gradient, and its bucket
    would send nothing on this rank only; so a table's other uses here are matched to its parts in the order their
    gradients are ready (the last use first: the parts' bucket order), which is what every rank's graph of this
    structure gives. ``plan`` itself where every part is found; None where a table's other uses here do not match
    its parts one for one (another structure, with no match every rank would make alike)."""
    uses = {p.spec.name: [u for u in p.uses if u.differentiable] for p in params}
    if all(part.part in {u.node for u in uses.get(part.name, ())} for part in plan.parts):
        return plan
    named: dict[tuple[str, str], str] = {}
    for table in dict.fromkeys(part.name for part in plan.parts):
        planned = [s.part for b in plan.buckets for s in b.params if s.part and s.name == table]  # ready order
        here = [u.node for u in sorted(uses.get(table, ()), key=lambda u: -u.position) if not u.lookup]
        if len(here) != len(planned):
            return None
        named.update({(table, old): new for old, new in zip(planned, here)})
    buckets = tuple(
        dataclasses.replace(b, params=tuple(dataclasses.replace(s, part=named[(s.name, s.part)]) if s.part else s for s in b.params))
        for b in plan.buckets
    )
    return dataclasses.replace(plan, buckets=buckets)


def misplaced_parts(split: GraphSplit, row_sparse: Sequence[RowSparseParam]) -> set[str]:
    """Names of the parameters whose parts the cut did not put in segments of their own (see the Note)."""
    bad = set()
    for r in row_sparse:
        part_segments = [split.partition[u.node] for u in r.parts]
        lookup_segments = {split.partition[u.node] for u in r.lookups}
        if len(set(part_segments)) != len(part_segments) or lookup_segments & set(part_segments):
            bad.add(r.name)
    return bad


def embedding_tables(module: nn.Module) -> frozenset[str]:
    """Trainable weights of ``nn.Embedding`` modules that no other module shares: their gradients touch only the
    looked-up rows (Note [Row-sparse gradients]). A tied table (also an output layer's weight) is left out: its
    gradient is dense unless the compile backend splits the other use off. (A module-level question, asked
    eagerly, where there is no graph: which tables to try as rows.)"""
    return frozenset(name for name, owners in _dense_tables(module).items() if owners == 1)


def tied_tables(module: nn.Module) -> frozenset[str]:
    """Trainable weights of ``nn.Embedding`` modules that another module shares (an output layer tied to the
    token table): compiled, their rows plan sends that module's contribution as a part of its own, which
    ``rows_pay`` charges gloo's CPU (the Note, "When rows pay")."""
    return frozenset(name for name, owners in _dense_tables(module).items() if owners > 1)


def _dense_tables(module: nn.Module) -> dict[str, int]:
    """Each trainable 2-D weight of a dense ``nn.Embedding`` without ``max_norm``, by name: how many modules
    register it."""
    owners: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        names[id(m.weight)]: owners[id(m.weight)]
        for m in module.modules()
        if isinstance(m, nn.Embedding)
        and not m.sparse
        and m.max_norm is None
        and m.weight.requires_grad
        and m.weight.dim() == 2
    }


def sparse_gradient_params(module: nn.Module) -> frozenset[str]:
    """Trainable weights that autograd gives a ``torch.sparse`` gradient: those of ``nn.Embedding`` and
    ``nn.EmbeddingBag`` modules built with ``sparse=True``, the rule PyTorch's DDP applies. Each is planned alone
    (``ParamSpec.sparse_grad``) and averaged as a sparse tensor; never as rows, which are for dense tables."""
    names = {id(p): n for n, p in module.named_parameters()}
    return frozenset(
        names[id(m.weight)]
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad and id(m.weight) in names
    )
