"""In-graph reduction: each bucket's all-reduce traced into the compiled backward, no hook, no split.

Note [In-graph reduction]
~~~~~~~~~~~~~~~~~~~~~~~~~
The split (Note [graphddp backend]) gives autograd one node per bucket segment, and a Python hook per gradient
tells the Reducer what is ready; on a launch-bound backward (a GPU, many small parameters) that Python is the
step's pace, and the cut stops the inner compiler fusing across it. The in-graph strategy puts the reduction into
the graph instead, bucketed by the same ``BucketPlan`` the split would use (one plan still serves both):

1. ``insert_bucket_reductions``: for each bucket of the graph's plan, every use of its parameters goes through one
   call of ``BucketAllReduce``, an identity in forward placed just before the bucket's earliest use (Note
   [Earliest use]). Autograd runs a node's backward once all its outputs' gradients are in, and runs the nodes it
   can in reverse creation order, so the call's backward runs right after the bucket's last gradient is complete:
   it flattens the bucket (one ``cat``), divides by the world size, and issues a functional all-reduce
   (``_c10d_functional.all_reduce``) on the bucket's channel (the DDP's own process group unless ``channels`` > 1,
   Note [Channels] in ``graphddp/runtime/channels.py``), then ``wait_tensor`` and the views that hand
   each parameter its slice. PyTorch's built-in ``allreduce_hook``, ``fp16_compress_hook`` and
   ``bf16_compress_hook`` are traced the same way (the last two cast the bucket before and after).
2. AOTAutograd traces that into the compiled backward (``in_graph_compiler``: Inductor or aot_eager); in the
   backward graph ``graphddp.passes.schedule_reductions`` first moves each all-reduce, with the nodes it needs,
   ahead of the nodes it does not need (``launch_collectives_early``: a layer's weight gradients and its bucket's
   all-reduce before the input gradient only earlier layers read, as autograd's order would have it after), then
   moves each wait, with its views, to just before the first node that reads the result (``sink_waits``; the
   graph's output, for a gradient), so the compute after the all-reduce overlaps it.
   For Inductor, ``graphddp.passes.divide_while_gathering`` then divides each gradient on its way into the
   bucket (``cat`` of quotients, not a quotient of the ``cat``), so Inductor writes each quotient straight into
   the bucket's slice, one pass over the bucket where the gathering and the division took two, and reinplaces
   the all-reduce; its peak-memory reordering, which would hoist the waits again, is off for these graphs.
   aot_eager runs the graph op by op, where a functional all-reduce clones its input and the division writes a tensor of its own:
   ``graphddp.passes.reduce_in_place`` has the division write into the bucket's gathered copy and the
   all-reduce reduce the division's result. Under both, a big gradient sent in blocks is then written block by
   block into the gradient itself, each block divided and all-reduced there (``write_blocks_in_place``, Note
   [Blocks written in place] in ``passes/blocks_in_place.py``), not copied together after the last.
   On one rank under graphddp's own averaging nothing is inserted: the average of one gradient is itself
   (``local_average``, the rule the Reducer's ``LocalReduction`` follows); a comm hook still runs, as in PyTorch.
3. The gradient that autograd accumulates into ``.grad`` is already averaged. The Reducer's hooks are off for
   the step (``graphddp.runtime.in_graph``: zero hook calls), the Reducer prepares nothing, and no Python runs per
   gradient or per bucket.

Both variants are compiled; ``ReductionSwitch`` runs the in-graph one only once every rank has agreed on the plan
*and* the strategy (Note [Plan agreement]: the strategy is part of what is agreed, so ranks never issue different
collectives), and the split one otherwise: the first iteration, a ``no_sync`` micro-step (which must not reduce) and
the synchronising step after it (whose ``.grad`` holds the local sum, which the Reducer averages whole), while a
rank has joined (``join``), or while a graph not yet agreed runs. What cannot be traced stays on the split for
good (``graphddp.passes.choose_reduction``): a comm hook other than the built-in three, unused parameters searched
for every step, ``torch.sparse`` gradients, a reduce dtype of ``mixed_precision``, tables planned as rows once a
comm hook was registered after them, an inner compiler that is not AOTAutograd-based. A table planned as rows goes
through ``RowsAllReduce`` instead, whose backward runs an opaque rows node (Note [Rows in the compiled backward] in
``graphddp/runtime/in_graph_rows.py``); a tied table's parts go through their own buckets' calls, fed from it (in a
recompile cut by the plan made before, found by their place among the table's uses: ``parts_named_in``). An
optimizer stepping in backward (``step_in_backward``) is stepped by one more node per bucket, after its wait (Note
[Steps in the compiled backward] in ``graphddp/runtime/in_graph_steps.py``).
"""

from __future__ import annotations

import copy
import functools
import logging
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from ..passes import (
    Bucket,
    BucketPlan,
    GraphParam,
    GraphUse,
    ParamSpec,
    arrange_reductions,
    bucket_channel,
    reduce_in_place,
)  # fmt: skip
from ..runtime import in_graph_blocks, in_graph_rows, in_graph_steps  # noqa: F401  (register graphddp's ops)
from .compile_target import running

logger = logging.getLogger(__name__)

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


class BucketAllReduce(torch.autograd.Function):
    """Identity in forward; in backward, the bucket's gradients averaged over the group (Note [In-graph
    reduction], step 1). The first bucket of a graph also carries the abandon signal (Note [Abandoned backward]
    in ``graphddp/runtime/iteration.py``): one more element of its all-reduce, this rank's flag, whose sum over
    the ranks becomes the signal's gradient (summed apart where the bucket's dtype cannot count the ranks)."""

    @staticmethod
    def forward(
        ctx: Any,
        group_name: str,
        divisor: int,
        wire: torch.dtype | None,
        pieces: Pieces,
        step: StepSpec,
        signal: torch.Tensor | None,
        carries: bool,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group_name, ctx.divisor, ctx.wire, ctx.pieces, ctx.step = group_name, divisor, wire, pieces, step
        ctx.shapes = [p.shape for p in params]
        ctx.signals = 1 if carries else 0  # this bucket's all-reduce carries the signal (the others return it 0)
        if signal is not None:
            ctx.save_for_backward(signal)
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        some = next((g for g in grads if g is not None), None)
        if some is None:  # no gradient for the whole bucket: the same graph on every rank, so no rank sends it
            return (None, None, None, None, None, None, None, *grads)
        flats = [
            g.reshape(-1) if g is not None else some.new_zeros(s.numel())  # an output no loss depends on
            for g, s in zip(grads, ctx.shapes)
        ]
        # [1]: this rank's flag, times the divisor the average divides it by, so the ranks' flags are summed; in
        # the bucket's own all-reduce where both its dtypes (the gradients', the wire's) count the ranks exactly,
        # else apart (_sum_flags): bf16 gradients sent as fp16 still round the fp16 sum back to bf16
        together = ctx.signals and all(_counts_ranks(d, ctx.divisor) for d in (some.dtype, ctx.wire) if d is not None)
        told = [ctx.saved_tensors[0].to(some.dtype) * ctx.divisor] if together else []
        if ctx.pieces is not None:  # one big gradient in blocks of rows (Note [Gradient pieces])
            averaged, summed = _average_in_pieces(grads, flats, told, ctx)
        else:
            flat = _average(torch.cat([*flats, *told]), ctx)  # [bucket numel (+ 1)]
            *chunks, summed = flat.split([*(s.numel() for s in ctx.shapes), len(told)])
            averaged = [chunk.view(s) for chunk, s in zip(chunks, ctx.shapes)]
        signal_grad = (summed.float() if together else _sum_flags(ctx)) if ctx.signals else None
        if ctx.step is not None:  # Note [Steps in the compiled backward]: its zero keeps the node in the graph
            key, whole = ctx.step
            stepped = torch.ops.graphddp.step_bucket(key, [averaged[k] for k in whole])
            signal_grad = stepped if signal_grad is None else signal_grad + stepped
        return (None, None, None, None, None, signal_grad, None, *averaged)


StepSpec = tuple[int, tuple[int, ...]] | None
"""A bucket's step node: its key (Note [Steps in the compiled backward]) and the positions of the parameters it
steps (not the parts of tied tables: a table is stepped with its whole gradient, by ``RowsAllReduce``); or None."""


class RowsAllReduce(torch.autograd.Function):
    """A table planned as rows (Note [Rows in the compiled backward] in ``graphddp/runtime/in_graph_rows.py``):
    identity in forward, twice, the table for its lookups and for its parts' buckets; in backward, the lookups'
    gradient averaged as rows (``graphddp::reduce_rows``) plus the parts' gradients (averaged by their buckets):
    the table's whole averaged gradient, stepped here when an optimizer steps in backward."""

    @staticmethod
    def forward(
        ctx: Any, group_name: str, divisor: int, streak: int, step: int | None, signal: torch.Tensor | None, carries: bool,
        table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group_name, ctx.divisor, ctx.wire, ctx.step, ctx.shape = group_name, divisor, None, step, table.shape
        ctx.streak = streak
        ctx.signals = 1 if carries else 0
        if signal is not None:
            ctx.save_for_backward(signal)
        return table.view_as(table), table.view_as(table)

    @staticmethod
    def backward(ctx: Any, lookups: torch.Tensor | None, parts: torch.Tensor | None) -> tuple[Any, ...]:
        some = lookups if lookups is not None else parts
        if some is None:  # no gradient at all: the same graph on every rank, so no rank sends
            return (None, None, None, None, None, None, None)
        rows = lookups.contiguous() if lookups is not None else some.new_zeros(ctx.shape)  # [rows, C]
        # The parts, averaged by their buckets, are the base the rows are added to: all-reduce is linear, so this is
        # the sum's average.
        averaged = torch.ops.graphddp.reduce_rows(rows, ctx.group_name, ctx.divisor, ctx.streak, parts)
        signal_grad = None
        if ctx.signals:  # the plan's first bucket: its all-reduce carries the abandon signal (here, one of its own)
            signal_grad = _sum_flags(ctx)
        if ctx.step is not None:
            stepped = torch.ops.graphddp.step_bucket(ctx.step, [averaged])
            signal_grad = stepped if signal_grad is None else signal_grad + stepped
        return (None, None, None, None, signal_grad, None, averaged)


def reduce_table_rows(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What an inserted rows node calls: the table through ``RowsAllReduce`` (group name, divisor, streak key, step
    key, signal, whether it carries it, table)."""
    return RowsAllReduce.apply(*args)


Pieces = tuple[int, tuple[int, ...]] | None
"""``graphddp.passes.Bucket.pieces``: the big gradient's position and its blocks' rows, or None."""


def _average_in_pieces(
    grads: tuple[torch.Tensor | None, ...], flats: list[torch.Tensor], told: list[torch.Tensor], ctx: Any
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each block of rows of the big gradient averaged by an all-reduce of its own, the others (and ``told``,
    the abandon signal) with the first block; the averaged gradients, in ``ctx.shapes``' order, and the summed
    signal ([0] without one)."""
    big, rows = ctx.pieces
    whole = grads[big] if grads[big] is not None else flats[big].view(ctx.shapes[big])  # [R, ...]
    others = [f for k, f in enumerate(flats) if k != big]
    starts = [sum(rows[:k]) for k in range(len(rows))]
    blocks = [whole[start : start + count].reshape(-1) for start, count in zip(starts, rows)]  # slices: no copy
    averaged = [_average(torch.cat([blocks[0], *others, *told]) if others or told else blocks[0], ctx)]
    averaged += [_average(block, ctx) for block in blocks[1:]]
    first, *rest, summed = averaged[0].split([blocks[0].numel(), *(f.numel() for f in others), len(told)])
    big_averaged = torch.cat([first, *averaged[1:]]).view(ctx.shapes[big])
    small = iter(rest)
    return [big_averaged if k == big else next(small).view(s) for k, s in enumerate(ctx.shapes)], summed


def _counts_ranks(dtype: torch.dtype, ranks: int) -> bool:
    """``dtype`` holds every count from 0 to ``ranks`` exactly, so the ranks' flags summed in it, in any order, are
    their number: integers up to 2 ** (mantissa bits + 1), 256 in bfloat16, 2048 in float16. Beyond, a sum of ones
    stops growing (256 + 1 rounds to 256 in bfloat16) and "every rank abandoned" would read as "some"."""
    return not dtype.is_floating_point or ranks <= 2 / torch.finfo(dtype).eps  # eps: 2 ** -(mantissa bits)


def _sum_flags(ctx: Any) -> torch.Tensor:
    """The ranks' abandon flags summed by an all-reduce of their own, in float32 (``ctx.saved_tensors[0]``, the
    [1] signal): where the first bucket's dtype cannot count the ranks (``_counts_ranks``), and for a table's rows,
    whose packed all-gathers carry no element of it. Every rank decides alike (dtype and world size agree), so
    every rank issues it."""
    reduced = torch.ops._c10d_functional.all_reduce(ctx.saved_tensors[0].float(), "sum", ctx.group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


def _average(flat: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``flat`` averaged over the group: sent as ``ctx.wire`` if set (fp16/bf16_compress_hook: cast, then average,
    as PyTorch's hooks do), returned in its own dtype."""
    sent = flat.to(ctx.wire) if ctx.wire is not None else flat
    reduced = torch.ops._c10d_functional.all_reduce(sent.div(ctx.divisor), "sum", ctx.group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced).to(flat.dtype)


def reduce_bucket(*args: Any) -> tuple[torch.Tensor, ...]:
    """What an inserted node calls: the bucket's parameters, through ``BucketAllReduce`` (its ``forward``'s
    arguments: group name, divisor, wire dtype, pieces, step key, signal, whether it carries it, parameters)."""
    return BucketAllReduce.apply(*args)


SIGNAL_INPUT = "graphddp_abandon_signal"
"""The graph input ``insert_bucket_reductions(..., signal=True)`` adds, last: the abandon signal, a [1] float32
tensor that requires grad (Note [Abandoned backward] in ``graphddp/runtime/iteration.py``)."""


def insert_bucket_reductions(
    gm: fx.GraphModule,
    params: Sequence[GraphParam],
    plan: BucketPlan,
    *,
    group_names: Sequence[str],
    divisor: int,
    wire: torch.dtype | None = None,
    signal: bool = False,
    alone: bool = False,
    step_key: Callable[[Sequence[str]], int | None] | None = None,
    rows_key: Callable[[str], int] | None = None,
) -> fx.GraphModule:
    """A copy of ``gm`` in which each bucket of ``plan`` is reduced in backward (step 1 of the Note) on its channel
    of ``group_names`` (Note [Channels]), sent as ``wire`` (a compressing comm hook's dtype; None: the gradients'
    own); ``gm`` is left as it was (the split variant is cut from it). With ``signal``, the graph takes one more
    input, last (``SIGNAL_INPUT``), which its first bucket's all-reduce carries (Note [Abandoned backward]).
    ``alone``: one rank under graphddp's own averaging (``graphddp.runtime.reductions.local_average``, as the
    Reducer's ``LocalReduction``): the average of one gradient is itself, so no bucket is reduced (and no rank is
    there to tell: the signal input is taken, unused). ``step_key``: the key of each bucket's optimizer step node,
    given its parameters' names, or None for none (Note [Steps in the compiled backward]; needs ``signal``).
    A table planned as rows goes through ``RowsAllReduce`` (Note [Rows in the compiled backward]), and each of its
    parts through its own bucket's call, fed from the table's call; ``rows_key`` gives a table's dense streak
    (None: none kept, rows tried every step)."""
    graph = copy.deepcopy(gm.graph)
    signal_node = None
    if signal:
        with graph.inserting_after([n for n in graph.nodes if n.op == "placeholder"][-1]):
            signal_node = graph.placeholder(SIGNAL_INPUT)
    inserting = _Inserting(
        graph, {p.spec.name: p for p in params}, plan.parts, signal_node, group_names, divisor, step_key, rows_key
    )
    if not alone:
        assert wire is None or not plan.parts, "rows apply under graphddp's own averaging only (rows_apply)"
        for bucket in plan.buckets:  # first the tables: their parts' buckets take the table from their calls
            if bucket.row_sparse:
                inserting.rows(bucket, carries=signal_node is not None and bucket is plan.buckets[0])
        for bucket in plan.buckets:
            if not bucket.row_sparse:
                inserting.bucket(bucket, wire, carries=signal_node is not None and bucket is plan.buckets[0])
    graph.lint()
    return fx.GraphModule(gm, graph)


class _Inserting:
    """``insert_bucket_reductions``' state: the graph being changed and where each parameter now comes from."""

    def __init__(
        self, graph: fx.Graph, by_name: dict[str, GraphParam], parts: Sequence[ParamSpec], signal_node: fx.Node | None,
        group_names: Sequence[str], divisor: int, step_key: Callable[[Sequence[str]], int | None] | None,
        rows_key: Callable[[str], int] | None,
    ) -> None:
        self.graph, self.by_name, self.signal_node = graph, by_name, signal_node
        self.group_names, self.divisor, self.step_key, self.rows_key = group_names, divisor, step_key, rows_key
        self.nodes = {n.name: n for n in graph.nodes}
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.part_sources: dict[str, fx.Node] = {}  # a table's name: its RowsAllReduce output its parts take
        self.part_nodes: dict[str, frozenset[str]] = {}  # a table's name: the nodes whose contributions are parts
        for part in parts:
            self.part_nodes[part.name] = self.part_nodes.get(part.name, frozenset()) | {part.part}
            # A part without its use here would get no gradient, and its bucket would send nothing on this rank only.
            assert part.part in {u.node for u in by_name[part.name].uses if u.differentiable}, (
                f"{part.label}: no use in this graph contributes it (graphddp.passes.parts_named_in names parts first)"
            )

    def _step(self, names: Sequence[str]) -> int | None:
        step = self.step_key(names) if self.step_key is not None and names else None
        assert step is None or self.signal_node is not None, "a step node's zero goes into the signal's gradient"
        return step

    def _at(self, uses: Sequence[GraphUse], members: Sequence[GraphParam]) -> fx.Node:
        # Before the earliest use a gradient flows through: a use under no_grad would make the bucket's outputs
        # carry none (a parameter with no such use gets its zeros through the same call).
        usable = [u for u in uses if u.differentiable] or list(uses)
        if usable:
            return self.nodes[min(usable, key=lambda u: u.position).node]
        return self.nodes[min(members, key=lambda p: p.first_use).first_user]

    def _replace(self, source: fx.Node, item: fx.Node, call: fx.Node, at: fx.Node, only: frozenset[str] | None, skip: frozenset[str]) -> None:
        """``source``'s uses from ``at`` on (earlier ones carry no gradient) by ``item``: only those in nodes
        named in ``only`` where given, none in ``skip``."""
        def chosen(user: fx.Node) -> bool:
            if user is call or self.position.get(user, -1) < self.position[at] or user.name in skip:
                return False
            return only is None or user.name in only

        source.replace_all_uses_with(item, delete_user_cb=chosen)

    def bucket(self, bucket: Bucket, wire: torch.dtype | None, *, carries: bool) -> None:
        """One ``BucketAllReduce`` call for a dense bucket (parts of tied tables included)."""
        specs = bucket.params
        members = [self.by_name[s.name] for s in specs]
        uses = [u for s, p in zip(specs, members) for u in p.uses if not s.part or u.node == s.part]
        at = self._at(uses, members)
        whole = [k for k, s in enumerate(specs) if not s.part]  # a part is stepped with its table, not here
        step = self._step([specs[k].name for k in whole])
        assert all(s.name in self.part_sources for s in specs if s.part), "a part comes with its table planned as rows"
        sources = [self.part_sources[s.name] if s.part else self.nodes[p.node] for s, p in zip(specs, members)]
        with self.graph.inserting_before(at):
            group_name = self.group_names[bucket_channel(bucket.index, len(self.group_names))]
            call = self.graph.call_function(
                reduce_bucket,
                (group_name, self.divisor, wire, bucket.pieces, None if step is None else (step, tuple(whole)),
                 self.signal_node if carries or step is not None else None, carries, *sources),
            )  # fmt: skip
            for k, (spec, source) in enumerate(zip(specs, sources)):
                item = self.graph.call_function(operator.getitem, (call, k))
                only = frozenset({spec.part}) if spec.part else None
                self._replace(source, item, call, at, only, frozenset())

    def rows(self, bucket: Bucket, *, carries: bool) -> None:
        """One ``RowsAllReduce`` call for a table planned as rows, before its first lookup; its parts' uses are
        handed its second output, which their own buckets' calls then take."""
        (spec,) = bucket.params
        table = self.by_name[spec.name]
        parts = self.part_nodes.get(spec.name, frozenset())
        uses = [u for u in table.uses if u.node not in parts]
        at = self._at(uses, [table])
        step = self._step([spec.name])
        source = self.nodes[table.node]
        with self.graph.inserting_before(at):
            group_name = self.group_names[bucket_channel(bucket.index, len(self.group_names))]
            call = self.graph.call_function(
                reduce_table_rows,
                (group_name, self.divisor, self.rows_key(spec.name) if self.rows_key is not None else -1, step,
                 self.signal_node if carries or step is not None else None, carries, source),
            )  # fmt: skip
            lookups = self.graph.call_function(operator.getitem, (call, 0))
            for_parts = self.graph.call_function(operator.getitem, (call, 1))
        self._replace(source, lookups, call, at, None, parts)
        self._replace(source, for_parts, call, at, parts, frozenset())
        self.part_sources[spec.name] = for_parts


# -- the inner compiler, made to keep waits late ---------------------------------------------------------------
@functools.cache
def _scheduling_pass() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # Inductor only when used

    from ..passes import blocks_in_place
    from ..passes import reduction as reduction_passes

    class ScheduleReductions(CustomGraphPass):
        """Inductor's post-grad hook running ``arrange_reductions`` for a fusing compiler (after a pass the user
        had set)."""

        def __init__(self, before: Any = None) -> None:
            self.before = before

        def __call__(self, graph: fx.Graph) -> None:
            if self.before is not None:
                self.before(graph)
            arrange_reductions(graph, fusing=True)

        def uuid(self) -> Any:  # part of Inductor's FX-graph cache key
            # The pass's source itself: a changed pass (an upgrade of graphddp) must not reuse a graph the old one
            # ordered; a fixed version tag did, and ran steps after every wait (Note [Steps in the compiled backward]).
            before = self.before.uuid() if self.before is not None and hasattr(self.before, "uuid") else None
            return ("graphddp.schedule_reductions", get_hash_for_files((reduction_passes.__file__, blocks_in_place.__file__)), before)

    return ScheduleReductions


def _inductor_patches(patches: dict[str, Any]) -> dict[str, Any]:
    return {
        **patches,
        "post_grad_custom_post_pass": _scheduling_pass()(patches.get("post_grad_custom_post_pass")),
        "reorder_for_peak_memory": False,  # it hoists the waits back next to their all-reduce
    }


def _op_by_op(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """A backward compiler that runs the graph op by op (aot_eager's), given the graph Inductor's passes would
    make of it: scheduled, and the reductions in place (``reduce_in_place``: no clone per collective)."""

    def compile_backward(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        arrange_reductions(gm.graph)
        reduce_in_place(gm.graph)
        gm.recompile()
        return compiler(gm, example_inputs)

    return compile_backward


def in_graph_compiler(inner: Any) -> CompilerFn | None:
    """``inner`` (as ``graphddp.backend`` got it, or as Dynamo hands it over) made to sink waits in the backward
    it compiles; None when it is not a compiler whose backward graph graphddp can reach (Inductor, aot_eager)."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop
    from torch._inductor.compile_fx import compile_fx

    fn = getattr(inner, "_torchdynamo_orig_backend", inner)
    keywords: dict[str, Any] = {}
    if isinstance(fn, torch._TorchCompileInductorWrapper):
        return functools.partial(compile_fx, config_patches=_inductor_patches(dict(fn.config)))
    if isinstance(fn, torch._TorchCompileWrapper):
        fn, keywords = fn.compiler_fn, dict(fn.kwargs)
    if isinstance(fn, functools.partial) and not fn.args:
        fn, keywords = fn.func, {**fn.keywords, **keywords}
    if fn is compile_fx:
        return functools.partial(compile_fx, config_patches=_inductor_patches(keywords.get("config_patches") or {}))
    if fn is aot_eager and not ({"fw_compiler", "bw_compiler"} & keywords.keys()):
        return functools.partial(aot_eager, bw_compiler=_op_by_op(boxed_nop), **keywords)
    return None


def describe_inner(inner: Any) -> str:
    fn = getattr(inner, "_torchdynamo_orig_backend", inner)
    return getattr(fn, "compiler_name", None) or getattr(fn, "__name__", None) or type(fn).__name__


# -- which variant runs --------------------------------------------------------------------------------------
class InGraphVariant:
    """A graph's in-graph variant, compiled for ``plan``, and compiled again without the parts of tied tables that
    gave up rows (Note [Rows in the compiled backward], "Giving up"): their rows node sends the whole table dense
    from then on, so a part sent beside it would only cost a table-sized all-reduce more (the sum stays right),
    but a graph compiled after the give-up is planned without it, and every rank must send the same buckets."""

    def __init__(
        self, build: Callable[[BucketPlan], fx.GraphModule], compiler: CompilerFn, plan: BucketPlan, inputs: list[Any],
        *, again: list[Any] | None,
    ) -> None:
        """``build`` inserts a plan's reductions into the graph as captured; ``inputs``: the example inputs it is
        compiled with now; ``again``: the graph's inputs as Dynamo traced them, which compiling it again takes (None:
        not known, so it is never compiled again)."""
        self._build, self._compiler, self._again = build, compiler, again
        self.plan = plan
        self.tables_with_parts = frozenset(p.name for p in plan.parts) if again is not None else frozenset()
        """The tables whose giving up changes this variant: those with parts in its plan (``choose_reduction`` runs
        a graph with parts split where ``again`` is unknown)."""
        self.fn = compiler(build(plan), inputs)

    def drop_parts(self, tables: frozenset[str]) -> None:
        """Compile again for the plan with ``tables`` dense, their parts dropped (``BucketPlan.without_rows``), from
        the inputs as Dynamo traced them (``again``: fake, symbolic where the graph's shapes are dynamic)."""
        from torch._guards import TracingContext, tracing

        assert self._again is not None, "tables_with_parts is empty without them"
        self.plan = self.plan.without_rows(tables)
        self.tables_with_parts = frozenset(p.name for p in self.plan.parts)
        fake_mode = next(v.fake_mode for v in self._again if isinstance(v, torch.Tensor))
        with tracing(TracingContext(fake_mode)):
            self.fn = self._compiler(self._build(self.plan), self._again)

    def tables_to_drop(self, gone_dense: frozenset[str]) -> frozenset[str]:
        """Of the tables that gave up rows in the compiled backward, those whose parts this variant still sends."""
        return gone_dense & self.tables_with_parts


class ReductionSwitch:
    """What Dynamo runs for a graph compiled for a graphddp.DDP: the in-graph variant while the DDP's gate is open
    for this graph's parameters and that DDP's forward runs it, the split one otherwise (Note [In-graph
    reduction]): the same compiled code called outside the wrapper (``ddp.module(x)``, with
    ``DDP(torch.compile(model))``) reduces nothing, as PyTorch's DDP, its gradients left to the hooks, which keep
    them local. One Python call per graph and forward, nothing per parameter."""

    def __init__(self, in_graph: InGraphVariant | None, split: Callable[..., Any], target: Any, params: frozenset[str]) -> None:
        self.in_graph, self.split = in_graph, split
        self._target = weakref.ref(target)
        self.params = params

    def __call__(self, *args: Any) -> Any:
        target = self._target()
        if target is not None and running() is target and target.reduces_in_graph(self.params, self.in_graph is not None):
            variant = self.in_graph
            assert variant is not None, "reduces_in_graph says no without a variant"
            if variant.tables_with_parts and (dropped := variant.tables_to_drop(target.tables_gone_dense_in_graph())):
                # Every rank gave up on the same step (the outcome is all-reduced), so every rank compiles again here.
                logger.info(
                    "[rank %d] graphddp: %s gave up rows in the compiled backward; its graph is compiled again "
                    "without the parts it sent beside the whole table", target.rank, ", ".join(sorted(dropped)),
                )
                variant.drop_parts(dropped)
            outputs = variant.fn(*args, target.abandon_signal_for_run())
            target.watch_backward(outputs)  # Note [Abandoned backward]: no hook of the Reducer sees this backward
            return outputs
        return self.split(*args)
