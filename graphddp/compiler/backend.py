"""The torch.compile backend: split captured graphs at bucket boundaries, compile each piece, join the Reducer.

Note [graphddp backend]
~~~~~~~~~~~~~~~~~~~~~~~
``torch.compile(ddp, backend=graphddp.backend("inductor"))``: the DDP wrapper's forward is hidden from Dynamo
(``torch.compiler.disable(recursive=False)``), so buffer broadcast and Reducer bookkeeping run eagerly, add no
graph break, and only the user's module is captured. For every graph Dynamo captures under a graphddp.DDP
forward (it asks ``graphddp.compiler.compile_target.running()``), the backend

1. finds the trainable parameters among the graph's inputs and the earliest node using each
   (``graphddp.passes.find_graph_params``, Note [Earliest use]);
2. plans buckets in backward order with the DDP's caps, a node's parameters kept together (Note [Bucket
   plan]), embedding tables as row-sparse gradients and a tied table's other uses as parts of their own
   (Note [Row-sparse gradients]), and decides where to cut (``plan_graph``, Note [Split at buckets]); a
   recompile of a graph is cut by the plan made for it before instead (Note [Plan agreement]);
3. proposes a new graph's plan to the Reducer, which adopts it once all ranks agree (Note [Plan agreement]);
4. cuts the graph so each bucket completes at a segment boundary (``split_at_buckets``), feeds tied tables to
   the segments of their parts through taps (``tap_parts``, ``graphddp.compiler.gradient_tap``), and compiles each
   segment with the inner backend (AOTAutograd for ``"aot_eager"``/``"inductor"``), propagating fake tensors
   from one segment to the next (``graphddp.compiler.graph_pipeline``, which ``graphddp inspect`` runs too);
5. returns the stitched module: during backward each segment is its own autograd node, so bucket k's
   all-reduce starts before the segment in front of it runs its backward;
6. where the graph can be traced (``graphddp.passes.choose_reduction``), also compiles the whole graph with each
   bucket's all-reduce inside its backward, and returns a ``ReductionSwitch`` that runs that variant once every
   rank agreed on the plan and the strategy (Note [In-graph reduction] in ``graphddp/compiler/in_graph.py``).

Unlike PyTorch's DDPOptimizer, the graph split and the Reducer use the same plan, higher-order ops (activation
checkpointing) are split like any node, and any pair of caps works.

Note [Several AOT graphs in one frame]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where one Dynamo graph becomes several AOTAutograd graphs (split segments, an in-graph variant beside its
split), they share Dynamo's one ``TracingContext``, whose ``fw_metadata`` each compile overwrites. A backward is
compiled lazily, at its first run, and Inductor reads which of its inputs are *donated* (buffers it may overwrite
in place, ``get_donated_idxs``) from that context: every segment's backward would take the last compiled graph's
list, naming other tensors, some still needed (an earlier segment's saved activation). PyTorch's DDPOptimizer
keeps a list of metadata and pops it in reverse, which holds only if backwards compile in the reverse order of
their forwards; the in-graph variant and the split share the context too. So such graphs are compiled without
donated buffers (``_one_metadata_per_frame``: a memory optimisation of the backward, not a change of its
results); a graph compiled alone keeps them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tabulate import tabulate
from torch import fx, nn
from torch._guards import detect_fake_mode

from ..passes import (
    BucketCaps,
    BucketPlan,
    GraphSplit,
    ReductionChoice,
    check_reduction,
    choose_reduction,
    parts_named_in,
    plan_blockers,
)
from ..runtime.profiling import label_backward, labelled, profiling, trace_artifact
from ..runtime.torch_ddp import TorchDDP, active_ddp_module
from ..runtime.trace import Events
from .compile_target import CompileTarget, running
from .dump import DebugDump
from .graph_pipeline import fake_mode_for, lower_graph, prepare_graph
from .in_graph import InGraphVariant, ReductionSwitch, describe_inner, in_graph_compiler, insert_bucket_reductions

logger = logging.getLogger(__name__)

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]
_graph_ids = itertools.count()


def backend(
    inner: str | CompilerFn = "inductor", *, debug_dir: str | None = None, reduction: str = "auto"
) -> GraphDDPBackend:
    """A Dynamo backend that splits captured graphs at graphddp's bucket boundaries (Note [graphddp backend]), or
    reduces their gradients inside the compiled backward (Note [In-graph reduction]).

    ``inner`` is a Dynamo backend name (``"inductor"``, ``"aot_eager"``, ``"eager"``) or a compiler function
    ``(gm, example_inputs) -> callable``, used for every segment. ``reduction``: ``"auto"`` (in-graph where it can be
    traced, else split), ``"split"`` or ``"in_graph"`` (split where it cannot, with a warning).
    """
    return GraphDDPBackend(inner, debug_dir=debug_dir, reduction=reduction)


def inner_compiler(
    inner: str | CompilerFn, *, mode: str | None = None, options: dict[str, Any] | None = None, dynamic: bool | None = None
) -> CompilerFn:
    """The compiler each segment goes through: ``inner`` configured by ``mode``/``options`` as ``torch.compile``
    configures its backend (Inductor: its modes and config patches; another backend: the keywords passed on)."""
    if isinstance(inner, str) and inner == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    if isinstance(inner, str):
        inner = torch._dynamo.lookup_backend(inner)
    elif not callable(inner):
        raise TypeError(f"graphddp.compiler.backend: inner must be a backend name or a compiler function, got {inner!r}")
    extra = {**({"mode": mode} if mode not in (None, "default") else {}), **({"options": options} if options else {})}
    return functools.partial(inner, **extra) if extra else inner


class GraphDDPBackend:
    """The callable ``graphddp.backend(...)`` returns; Dynamo calls it once per captured graph."""

    def __init__(self, inner: str | CompilerFn, *, debug_dir: str | None = None, reduction: str = "auto") -> None:
        self._inner_spec = inner
        self.reduction = check_reduction(reduction)
        """What the user asked for: ``"auto"``, ``"split"`` or ``"in_graph"`` (``graphddp.passes.choose_reduction``)."""
        self.inner: CompilerFn = inner_compiler(inner)
        # Checked now, before anything is compiled: an unwritable dump directory is a clear error.
        self.dump = DebugDump.from_argument_or_env(debug_dir)
        self.splits: list[GraphSplit] = []
        """Every split made by this backend, in compile order (for tests and tools)."""
        self._configured: dict[tuple[Any, ...], GraphDDPBackend] = {}

    def configured(self, *, mode: str | None = None, options: dict[str, Any] | None = None, dynamic: bool | None = None) -> GraphDDPBackend:
        """This backend with its inner compiler configured by ``mode``/``options`` (itself when neither is given);
        the configured one shares ``splits`` with this one."""
        if mode in (None, "default") and not options:
            return self
        key = (mode, tuple(sorted((options or {}).items())), dynamic)
        if key not in self._configured:
            configured = GraphDDPBackend.__new__(GraphDDPBackend)
            configured.__dict__.update(self.__dict__)
            configured.inner = inner_compiler(self._inner_spec, mode=mode, options=options, dynamic=dynamic)
            configured._configured = {}
            self._configured[key] = configured
        return self._configured[key]

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: dict[str, Any] | None = None
    ) -> Callable[..., Any]:
        """``mode``/``options``: what ``torch.compile(..., mode=, options=)`` passes a backend; they configure the
        inner compiler of every segment."""
        if mode not in (None, "default") or options:
            return self.configured(mode=mode, options=options)(gm, example_inputs)
        target = running()
        if target is None:
            _refuse_pytorch_ddp()
            warnings.warn(
                "graphddp.compiler.backend: this graph does not run under a graphddp.DDP forward; it is split and compiled, "
                "but no Reducer is attached, so nothing is all-reduced. Wrap the model: graphddp.DDP(model).",
                stacklevel=2,
            )
        if not torch.is_grad_enabled():  # no backward will run: nothing to overlap, nothing to plan
            return self.inner(gm, example_inputs)
        prepared = prepare_graph(
            gm,
            example_inputs,
            target.params_by_id() if target is not None else _parameter_names_without_ddp(gm, example_inputs),
            caps=functools.partial(target.caps_for_graph, blocks=self._in_graph_unless_the_plan_blocks(target))
            if target is not None else BucketCaps(),
            row_sparse=target.rows_for_graph if target is not None else False,  # without a Reducer, nothing takes parts
            plan_for=target.plan_for_graph if target is not None else lambda params: None,
            sink=target,
            bucket_dtypes=target.bucket_dtypes() if target is not None else None,
        )
        if prepared is None:
            logger.debug("graphddp.compiler.backend: graph without trainable parameters, compiled whole")
            return self.inner(gm, example_inputs)
        self.splits.append(prepared.split)
        in_graph_plan = parts_named_in(prepared.plan, prepared.params)  # a recompile may name its parts anew
        # Dynamo's traced inputs, which a variant with a tied table's parts is compiled again from (InGraphVariant)
        again = _fake_inputs(gm, target.abandon_signal) if target is not None and prepared.plan.parts else None
        compiles_again = not prepared.plan.parts or again is not None
        choice = self.choose_reduction(prepared.plan, in_graph_plan is not None, target, compiles_again=compiles_again)
        if target is not None:
            target.record_split(prepared.split, choice)
        graph_key = f"graph{next(_graph_ids)}"
        if target is not None and not prepared.reused_plan:
            target.propose_graph_plan(graph_key, prepared.plan, choice.strategy, requested=self.reduction)
        elif target is not None:  # proposed anew where the reduction asked for changed (Dynamo reset, compiled
            # again with another reduction: every rank alike); not where only its choice did (InGraphGate refuses a
            # recompile on one rank that cannot build the in-graph variant the other ranks run)
            target.graph_recompiled(frozenset(p.spec.name for p in prepared.params), choice.strategy, requested=self.reduction)
        split = prepared.split
        trace_artifact(f"graphddp_split_{graph_key}", lambda: _describe_split(prepared))
        extended = [s.index for s in split.segments if s.extended]
        logger.info(
            "[rank %s] graphddp.compiler.backend: %s: %d parameters, %d buckets, %d segments%s%s; reduction: %s",
            getattr(target, "rank", "-"),
            graph_key,
            len(prepared.params),
            len(prepared.plan.buckets),
            split.num_segments,
            f" (extended: {extended})" if extended else "",
            " (a recompile: cut by the plan made before)" if prepared.reused_plan else "",
            choice,
        )
        if choice.strategy == "split" and self.reduction == "in_graph":
            _warn_once(f"graphddp: reduction='in_graph' was asked for, but this graph runs split: {choice.reason}")
        in_graph = None
        several = (target is not None and choice.strategy == "in_graph") or split.num_segments > 1
        with _one_metadata_per_frame(several):
            if target is not None and choice.strategy == "in_graph":  # compiled first: gm is cut for the split below
                in_graph = self._compile_in_graph(gm, example_inputs, prepared.params, in_graph_plan, graph_key, target, again)
            split_fn = self._compile_split(prepared, gm, example_inputs, graph_key, target)
        if target is None:
            return split_fn
        return ReductionSwitch(in_graph, split_fn, target, frozenset(p.spec.name for p in prepared.params))

    def choose_reduction(
        self, plan: BucketPlan, parts_found: bool, target: CompileTarget | None, *, compiles_again: bool = True
    ) -> ReductionChoice:
        """How a graph planned as ``plan`` reduces, for ``target`` (``graphddp.passes.choose_reduction``).
        ``parts_found``: its tied tables' uses match the plan's parts (``parts_named_in``); only a recompile can
        miss them, and one that does runs no in-graph variant, which ``InGraphGate`` refuses where the ranks
        agreed on one (the other ranks would issue its collectives). ``compiles_again``: the graph's inputs as
        Dynamo traced them are known (``_fake_inputs``), so its variant can be compiled again without a tied table's
        parts once the table gives up rows. Without them the variant would keep sending the parts while a graph a
        rank recompiles alone is planned without them (``_compile_in_graph``): bucket sizes would differ between
        ranks, so such a graph runs split."""
        if target is None:
            return ReductionChoice("split", "no graphddp.DDP runs it")
        blockers = [*plan_blockers(plan, rows_in_use=target.reduces_rows), *self._blockers_of_any_plan(target)]
        if not parts_found:
            blockers.append("a recompile whose uses of a tied table no longer match the parts of the plan made before")
        if not compiles_again:
            blockers.append("a tied table's parts in a graph whose traced inputs are unknown (it could not be compiled again without them)")
        return choose_reduction(self.reduction, blockers)

    def _blockers_of_any_plan(self, target: CompileTarget) -> list[str]:
        """What keeps every graph of ``target`` off the in-graph strategy, whatever its plan: the DDP's settings
        (``in_graph_blockers``) and an inner compiler that is not AOTAutograd-based."""
        blockers = list(target.in_graph_blockers())
        if in_graph_compiler(self.inner) is None:
            blockers.append(f"the inner compiler {describe_inner(self.inner)!r} is not AOTAutograd-based (Inductor, aot_eager)")
        return blockers

    def _in_graph_unless_the_plan_blocks(self, target: CompileTarget) -> bool:
        """May a graph of ``target`` be reduced in-graph, unless its plan blocks it (``choose_reduction``)? Then the
        automatic caps see its big gradients sent in blocks (Note [Automatic caps]). An iteration may still run
        the split (the first, a ``no_sync`` one, events recorded: ``ReductionSwitch``); the steady state is what
        the caps are for."""
        return choose_reduction(self.reduction, self._blockers_of_any_plan(target)).strategy == "in_graph"

    def _compile_in_graph(
        self, gm: fx.GraphModule, example_inputs: list[Any], params: Sequence[Any], plan: BucketPlan, graph_key: str,
        target: CompileTarget, again: list[Any] | None,
    ) -> InGraphVariant:
        """The graph with each bucket of ``plan`` reduced in its backward, compiled; built again, from a copy of
        ``gm`` as captured (the split cuts ``gm`` itself), where a tied table gives up rows (``InGraphVariant``,
        from ``again``: ``_fake_inputs``, found where the graph was planned with parts)."""
        compiler = in_graph_compiler(self.inner)
        assert compiler is not None, "choose_reduction checks the inner compiler"
        # Tables that gave up rows before this graph was compiled (a recompile) go without their parts from the start.
        plan = plan.without_rows(target.tables_gone_dense_in_graph() & {p.name for p in plan.parts})
        captured = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if plan.parts else gm
        signalled = [*example_inputs, target.abandon_signal]  # ReductionSwitch passes the signal last
        dumped = (self.dump, signalled, fake_mode_for(example_inputs)) if self.dump is not None else None  # none kept otherwise
        variants = itertools.count()
        target_ref = weakref.ref(target)  # Dynamo's cache keeps the variant: it must not keep the DDP alive

        def build(plan: BucketPlan) -> fx.GraphModule:
            target = target_ref()
            assert target is not None, "a variant is built for a DDP that runs it"
            reducing = insert_bucket_reductions(
                captured, params, plan, group_names=target.channel_names, divisor=target.world_size,
                wire=target.in_graph_wire(), signal=True, alone=target.averages_alone(), step_key=target.in_graph_step_key,
                rows_key=target.in_graph_rows_key,
            )
            if dumped is not None:  # forward and backward, waits sunk: beside the split's
                dump, inputs, fake_mode = dumped
                variant = next(variants)  # _1, _2, ...: compiled again without a table's parts
                folder = dump.graph_folder(f"{graph_key}_in_graph" + (f"_{variant}" if variant else ""))
                dump.write_aot(folder, {"in_graph": (reducing, inputs)}, fake_mode)
            return reducing

        assert again is not None or not plan.parts, "choose_reduction keeps a graph it could not compile again split"
        return InGraphVariant(build, compiler, plan, signalled, again=again if plan.parts else None)

    def _compile_split(
        self, prepared: Any, gm: fx.GraphModule, example_inputs: list[Any], graph_key: str, target: CompileTarget | None
    ) -> Callable[..., Any]:
        if prepared.split_gm is None:
            lower_graph(prepared, gm, example_inputs, name=graph_key, dump=self.dump)
            compiled = self.inner(gm, example_inputs)
            return CompiledSegment(compiled, 0, unwrap=False, target=target).forward if target is not None else compiled

        def compile_segment(name: str, segment: fx.GraphModule, fake_args: list[Any]) -> nn.Module:
            unwrap = _make_output_a_tuple(segment)
            return CompiledSegment(self.inner(segment, fake_args), int(name.rsplit("_", 1)[1]), unwrap, target)

        lower_graph(prepared, gm, example_inputs, name=graph_key, dump=self.dump, on_segment=compile_segment)
        return prepared.split_gm


def _one_metadata_per_frame(several: bool) -> contextlib.AbstractContextManager[Any]:
    """No donated buffers while ``several`` AOT graphs of one frame compile (Note [Several AOT graphs in one
    frame])."""
    return torch._functorch.config.patch(donated_buffer=False) if several else contextlib.nullcontext()


def _fake_inputs(gm: fx.GraphModule, signal: torch.Tensor) -> list[Any] | None:
    """The graph's inputs as Dynamo traced them (fake tensors and sizes, symbolic where its shapes are dynamic),
    the abandon signal last: what compiling it again later takes, with no run's tensors kept alive and no run's
    shapes baked in. None where a placeholder has no traced value."""
    values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None or any(v is None for v in values):
        return None
    return [*values, fake_mode.from_tensor(signal)]


_named_backends: dict[tuple[Any, ...], GraphDDPBackend] = {}


def registered_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The backend named ``"graphddp"`` (entry point ``torch_dynamo_backends``):
    ``torch.compile(model, backend="graphddp", options={"inner": "inductor", "debug_dir": ..., "reduction": ...})``;
    the other options and ``mode`` configure the inner compiler (for Inductor: its config and modes)."""
    options = dict(options or {})
    inner = options.pop("inner", "inductor")
    debug_dir = options.pop("debug_dir", None)
    reduction = options.pop("reduction", "auto")
    key = (inner if isinstance(inner, str) else id(inner), mode, repr(sorted(options.items())), debug_dir, reduction)
    if key not in _named_backends:
        made = GraphDDPBackend(inner, debug_dir=debug_dir, reduction=reduction)
        _named_backends[key] = made.configured(mode=mode, options=options)
    return _named_backends[key](gm, example_inputs)


def _describe_split(prepared: Any) -> str:
    plan, split = prepared.plan, prepared.split
    rows = [(s.index, s.buckets, s.nodes, s.param_bytes, s.extended) for s in split.segments]
    return (
        tabulate(plan.table_rows(), headers=plan.TABLE_HEADERS)
        + "\n\n"
        + tabulate(rows, headers=("segment", "buckets", "nodes", "parameter bytes", "extended"))
    )


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


# -- without a graphddp.DDP -------------------------------------------------------------------------------------
def _refuse_pytorch_ddp() -> None:
    if isinstance(active_ddp_module(), TorchDDP):
        raise RuntimeError(
            "graphddp.backend was used on a model wrapped in torch.nn.parallel.DistributedDataParallel, whose own "
            "Reducer would not follow graphddp's bucket plan. Wrap the model in graphddp.DDP instead: "
            "torch.compile(graphddp.DDP(model), backend=graphddp.backend(...))."
        )


def _parameter_names_without_ddp(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, str]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {
        id(value): node.name
        for node, value in zip(placeholders, example_inputs)
        if isinstance(value, nn.Parameter) and value.requires_grad
    }


# -- compiling the segments ----------------------------------------------------------------------------------
class CompiledSegment(nn.Module):
    """One compiled segment in the stitched module: unwraps single outputs and marks its backward start."""

    def __init__(self, compiled: Callable[..., Any], index: int, unwrap: bool, target: CompileTarget | None) -> None:
        super().__init__()
        self.compiled = compiled
        self.index = index
        self.unwrap = unwrap
        self._target = weakref.ref(target) if target is not None else None

    def forward(self, *args: Any) -> Any:
        with labelled(f"graphddp: segment {self.index} forward"):
            out = self.compiled(*args)
        if self.unwrap:
            out = out[0]
        target = self._target() if self._target is not None else None
        recording = target is not None and target.events.recording
        if recording or profiling():  # nothing to find on the hot path otherwise
            nodes = _segment_nodes(out)
            if profiling():
                for node in nodes:
                    label_backward(node, f"graphddp: segment {self.index} backward")
            if recording:
                _mark_backward_start(nodes, self.index, target.events)
        return out


def _segment_nodes(out: Any) -> set[Any]:
    """The autograd nodes that run a segment's backward: its outputs' gradient functions, past the view nodes
    AOTAutograd puts on view outputs (usually one compiled node)."""
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return {_past_views(t.grad_fn) for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}


def _mark_backward_start(nodes: set[Any], index: int, events: Events) -> None:
    """Record ``segment_backward`` when autograd is about to run this segment's backward (tests, timelines): at the
    first of its nodes to run (an output may carry no gradient, e.g. a mask)."""
    fired = [False]

    def record(grads: Any) -> None:
        if not fired[0]:
            fired[0] = True
            events.record("segment_backward", index)

    for node in nodes:
        node.register_prehook(record)


_VIEW_NODES = ("ViewBackward", "AsStridedBackward", "AliasBackward", "UnsafeViewBackward", "TBackward", "TransposeBackward")


def _past_views(node: Any) -> Any:
    """The node that computes a segment output: AOTAutograd regenerates an output that is a view outside the
    compiled function, whose view node runs as soon as its gradient arrives, before the segment's backward."""
    while node.name().rstrip("0123456789").endswith(_VIEW_NODES) and node.next_functions and node.next_functions[0][0] is not None:
        node = node.next_functions[0][0]
    return node


def _make_output_a_tuple(segment: fx.GraphModule) -> bool:
    """AOTAutograd-based compilers want a tuple of outputs; returns True when the caller must unwrap one."""
    output = next(n for n in segment.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    segment.recompile()
    return True
