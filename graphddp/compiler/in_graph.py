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
   Inductor fuses the copy and the division into one kernel per bucket; its peak-memory reordering, which would
   hoist the waits again, is off for these graphs.
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
for every step, tables planned as rows (by default only where rows pay: Note [Row-sparse gradients]), a reduce
dtype of ``mixed_precision``, an inner compiler that is not AOTAutograd-based. An optimizer stepping in backward
(``step_in_backward``) is stepped by one more node per bucket, after its wait (Note [Steps in the compiled
backward] in ``graphddp/runtime/in_graph_steps.py``).
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from ..passes import BucketPlan, GraphParam, bucket_channel, schedule_reductions
from ..runtime import in_graph_steps  # noqa: F401  (registers graphddp::step_bucket, which step nodes call)

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


class BucketAllReduce(torch.autograd.Function):
    """Identity in forward; in backward, the bucket's gradients averaged over the group (Note [In-graph
    reduction], step 1). The first bucket of a graph also carries the abandon signal (Note [Abandoned backward]
    in ``graphddp/runtime/iteration.py``): one more element of its all-reduce, this rank's flag, whose sum over
    the ranks becomes the signal's gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        group_name: str,
        divisor: int,
        wire: torch.dtype | None,
        pieces: Pieces,
        step: int | None,
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
        # [1]: this rank's flag, times the divisor the average divides it by, so the ranks' flags are summed
        told = [ctx.saved_tensors[0].to(some.dtype) * ctx.divisor] if ctx.signals else []
        if ctx.pieces is not None:  # one big gradient in blocks of rows (Note [Gradient pieces])
            averaged, summed = _average_in_pieces(grads, flats, told, ctx)
        else:
            flat = _average(torch.cat([*flats, *told]), ctx)  # [bucket numel (+ 1)]
            *chunks, summed = flat.split([*(s.numel() for s in ctx.shapes), len(told)])
            averaged = [chunk.view(s) for chunk, s in zip(chunks, ctx.shapes)]
        signal_grad = summed.float() if ctx.signals else None
        if ctx.step is not None:  # Note [Steps in the compiled backward]: its zero keeps the node in the graph
            stepped = torch.ops.graphddp.step_bucket(ctx.step, averaged)
            signal_grad = stepped if signal_grad is None else signal_grad + stepped
        return (None, None, None, None, None, signal_grad, None, *averaged)


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
) -> fx.GraphModule:
    """A copy of ``gm`` in which each bucket of ``plan`` is reduced in backward (step 1 of the Note) on its channel
    of ``group_names`` (Note [Channels]), sent as ``wire`` (a compressing comm hook's dtype; None: the gradients'
    own); ``gm`` is left as it was (the split variant is cut from it). With ``signal``, the graph takes one more
    input, last (``SIGNAL_INPUT``), which its first bucket's all-reduce carries (Note [Abandoned backward]).
    ``alone``: one rank under graphddp's own averaging (``graphddp.runtime.reductions.local_average``, as the
    Reducer's ``LocalReduction``): the average of one gradient is itself, so no bucket is reduced (and no rank is
    there to tell: the signal input is taken, unused). ``step_key``: the key of each bucket's optimizer step node,
    given its parameters' names, or None for none (Note [Steps in the compiled backward]; needs ``signal``)."""
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    signal_node = None
    if signal:
        with graph.inserting_after([n for n in graph.nodes if n.op == "placeholder"][-1]):
            signal_node = graph.placeholder(SIGNAL_INPUT)
    position = {n: i for i, n in enumerate(graph.nodes)}
    by_name = {p.spec.name: p for p in params}
    for bucket in () if alone else plan.buckets:
        members = [by_name[s.name] for s in bucket.params]
        # Before the earliest use a gradient flows through: a use under no_grad would make the bucket's outputs
        # carry none (a parameter with no such use gets its zeros through the same call).
        uses = [u for p in members for u in p.uses if u.differentiable] or [u for p in members for u in p.uses]
        at = nodes[min(uses, key=lambda u: u.position).node] if uses else nodes[min(members, key=lambda p: p.first_use).first_user]
        with graph.inserting_before(at):
            group_name = group_names[bucket_channel(bucket.index, len(group_names))]
            carries = signal_node is not None and bucket is plan.buckets[0]  # one bucket carries it: the one sent first
            step = step_key([p.spec.name for p in members]) if step_key is not None else None
            assert step is None or signal_node is not None, "a step node's zero goes into the signal's gradient"
            call = graph.call_function(
                reduce_bucket,
                (group_name, divisor, wire, bucket.pieces, step, signal_node if carries or step is not None else None,
                 carries, *(nodes[p.node] for p in members)),
            )  # fmt: skip
            for k, member in enumerate(members):
                item = graph.call_function(operator.getitem, (call, k))
                nodes[member.node].replace_all_uses_with(  # the uses from here on: earlier ones carry no gradient
                    item, delete_user_cb=lambda user, call=call, at=at: user is not call and position.get(user, -1) >= position[at]
                )
    graph.lint()
    return fx.GraphModule(gm, graph)


# -- the inner compiler, made to keep waits late ---------------------------------------------------------------
@functools.cache
def _scheduling_pass() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # Inductor only when used

    from ..passes import reduction as reduction_passes

    class ScheduleReductions(CustomGraphPass):
        """Inductor's post-grad hook running ``schedule_reductions`` (after a pass the user had set)."""

        def __init__(self, before: Any = None) -> None:
            self.before = before

        def __call__(self, graph: fx.Graph) -> None:
            if self.before is not None:
                self.before(graph)
            schedule_reductions(graph)

        def uuid(self) -> Any:  # part of Inductor's FX-graph cache key
            # The pass's source itself: a changed pass (an upgrade of graphddp) must not reuse a graph the old one
            # ordered; a fixed version tag did, and ran steps after every wait (Note [Steps in the compiled backward]).
            before = self.before.uuid() if self.before is not None and hasattr(self.before, "uuid") else None
            return ("graphddp.schedule_reductions", get_hash_for_files((reduction_passes.__file__,)), before)

    return ScheduleReductions


def _inductor_patches(patches: dict[str, Any]) -> dict[str, Any]:
    return {
        **patches,
        "post_grad_custom_post_pass": _scheduling_pass()(patches.get("post_grad_custom_post_pass")),
        "reorder_for_peak_memory": False,  # it hoists the waits back next to their all-reduce
    }


def _sinking(compiler: Callable[..., Any]) -> Callable[..., Any]:
    def compile_backward(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        schedule_reductions(gm.graph)
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
        return functools.partial(aot_eager, bw_compiler=_sinking(boxed_nop), **keywords)
    return None


def describe_inner(inner: Any) -> str:
    fn = getattr(inner, "_torchdynamo_orig_backend", inner)
    return getattr(fn, "compiler_name", None) or getattr(fn, "__name__", None) or type(fn).__name__


# -- which variant runs --------------------------------------------------------------------------------------
class ReductionSwitch:
    """What Dynamo runs for a graph compiled for a graphddp.DDP: the in-graph variant while the DDP's gate is open
    for this graph's parameters, the split one otherwise (Note [In-graph reduction]). One Python call per graph
    and forward, nothing per parameter."""

    def __init__(self, in_graph: Callable[..., Any] | None, split: Callable[..., Any], target: Any, params: frozenset[str]) -> None:
        self.in_graph, self.split = in_graph, split
        self._target = weakref.ref(target)
        self.params = params

    def __call__(self, *args: Any) -> Any:
        target = self._target()
        if target is not None and target.reduces_in_graph(self.params, self.in_graph is not None):
            outputs = self.in_graph(*args, target.abandon_signal_for_run())  # type: ignore[misc]
            target.watch_backward(outputs)  # Note [Abandoned backward]: no hook of the Reducer sees this backward
            return outputs
        return self.split(*args)
