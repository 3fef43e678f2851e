"""The torch.compile backend: split captured graphs at bucket boundaries, compile each piece, join the Reducer.

Note [graphddp backend]
~~~~~~~~~~~~~~~~~~~~~~~
``torch.compile(ddp, backend=graphddp.backend("inductor"))``: the DDP wrapper's forward is hidden from Dynamo
(``torch.compiler.disable(recursive=False)``), so buffer broadcast and Reducer bookkeeping run eagerly, add no
graph break, and only the user's module is captured. For every graph Dynamo captures under a graphddp.DDP
forward, the backend

1. finds the trainable parameters among the graph's inputs and the earliest node using each
   (``graphddp.passes.find_graph_params``, Note [Earliest use]);
2. plans buckets in backward order with the DDP's caps, a node's parameters kept together (Note [Bucket
   plan]), embedding tables as row-sparse gradients and a tied table's other uses as parts of their own
   (Note [Row-sparse gradients]), and decides where to cut (``plan_graph``, Note [Split at buckets]);
3. proposes that plan to the Reducer, which adopts it once all ranks agree (Note [Plan agreement]);
4. cuts the graph so each bucket completes at a segment boundary (``split_at_buckets``), feeds tied tables to
   the segments of their parts through taps (``tap_parts``, ``graphddp.taps``), and compiles each segment with
   the inner backend (AOTAutograd for ``"aot_eager"``/``"inductor"``), propagating fake tensors from one
   segment to the next;
5. returns the stitched module: during backward each segment is its own autograd node, so bucket k's
   all-reduce starts before the segment in front of it runs its backward.

Unlike PyTorch's DDPOptimizer, the graph split and the Reducer use the same plan, higher-order ops (activation
checkpointing) are split like any node, and any pair of caps works.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from .passes import GraphSplit, BucketCaps, find_graph_params, plan_graph, split_at_buckets, tap_parts
from .capture import as_fake
from .dump import DebugDump
from .taps import GradientTap
from .trace import EventLog

logger = logging.getLogger(__name__)

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]
_graph_ids = itertools.count()


def backend(inner: str | CompilerFn = "inductor", *, debug_dir: str | None = None) -> GraphDDPBackend:
    """A Dynamo backend that splits captured graphs at graphddp's bucket boundaries (Note [graphddp backend]).

    ``inner`` is a Dynamo backend name (``"inductor"``, ``"aot_eager"``, ``"eager"``) or a compiler function
    ``(gm, example_inputs) -> callable``, used for every segment.
    """
    return GraphDDPBackend(inner, debug_dir=debug_dir)


def compile(
    model: nn.Module,
    backend: str | CompilerFn | GraphDDPBackend = "inductor",
    *,
    debug_dir: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """``torch.compile`` for a ``graphddp.DDP`` module: the wrapper stays eager, the inner module is compiled.

    ``backend`` is the inner backend (as for ``graphddp.backend``) or a ``graphddp.backend(...)`` object.
    Extra keyword arguments (``fullgraph``, ``dynamic``, ``mode``...) go to ``torch.compile``.
    """
    from .ddp import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"graphddp.compile expects a graphddp.DDP module, got {type(model).__name__}; wrap the model first: "
            "graphddp.compile(graphddp.DDP(model))"
        )
    if not isinstance(backend, GraphDDPBackend):
        backend = GraphDDPBackend(backend, debug_dir=debug_dir)
    return torch.compile(model, backend=backend, **kwargs)


class GraphDDPBackend:
    """The callable ``graphddp.backend(...)`` returns; Dynamo calls it once per captured graph."""

    def __init__(self, inner: str | CompilerFn, *, debug_dir: str | None = None) -> None:
        if isinstance(inner, str):
            self.inner: CompilerFn = torch._dynamo.lookup_backend(inner)
        elif callable(inner):
            self.inner = inner
        else:
            raise TypeError(f"graphddp.backend: inner must be a backend name or a compiler function, got {inner!r}")
        # Checked now, before anything is compiled: an unwritable dump directory is a clear error.
        self.dump = DebugDump.from_argument_or_env(debug_dir)
        self.splits: list[GraphSplit] = []
        """Every split made by this backend, in compile order (for tests and tools)."""

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        ddp = _active_graphddp_module()
        if ddp is None:
            _refuse_pytorch_ddp()
            warnings.warn(
                "graphddp.backend: this graph does not run under a graphddp.DDP forward; it is split and compiled, "
                "but no Reducer is attached, so nothing is all-reduced. Wrap the model: graphddp.DDP(model).",
                stacklevel=2,
            )
            names = _parameter_names_without_ddp(gm, example_inputs)
            caps, row_sparse = BucketCaps(), False  # no Reducer: nothing to take parts
            reducer = None
        else:
            names = {id(p): n for n, p in zip(ddp.reducer.param_names(), ddp.reducer.params())}
            # With a custom comm hook every bucket is reduced dense: a tied table's part would travel twice.
            caps, row_sparse = ddp.options.caps, ddp._reduces_rows and not ddp.reducer.has_custom_comm_hook
            reducer = ddp.reducer

        params = find_graph_params(gm, example_inputs, names)
        if not params:
            logger.debug("graphddp.backend: graph without trainable parameters, compiled whole")
            return self.inner(gm, example_inputs)
        world_size = reducer.world_size if reducer is not None else 1
        split = plan_graph(gm, params, caps, world_size=world_size, row_sparse=row_sparse)
        plan = split.plan
        self.splits.append(split)
        graph_key = f"graph{next(_graph_ids)}"
        if reducer is not None:
            reducer.propose_graph_plan(graph_key, plan)
        logger.info(
            "[rank %s] graphddp.backend: %s: %d parameters, %d buckets, %d segments%s",
            getattr(reducer, "rank", "-"),
            graph_key,
            len(params),
            len(plan.buckets),
            split.num_segments,
            " (extended: %s)" % [s.index for s in split.segments if s.extended] if any(s.extended for s in split.segments) else "",
        )
        folder = self.dump.graph_folder(graph_key) if self.dump is not None else None
        if split.num_segments == 1:
            if folder is not None:
                self.dump.write_graph(folder, graph=graph_key, captured=gm, plan=plan, split=split, split_gm=None)
                self.dump.write_aot(folder, {"graph": (gm, example_inputs)}, _fake_mode(example_inputs))
            compiled = self.inner(gm, example_inputs)
            return _traced(compiled, 0, reducer) if reducer is not None else compiled
        split_gm = split_at_buckets(gm, split)
        tap_parts(split_gm, split, lambda tap: GradientTap(reducer, tap.param, tap.part))
        if folder is not None:
            self.dump.write_graph(folder, graph=graph_key, captured=gm, plan=plan, split=split, split_gm=split_gm)
        segments = _compile_segments(split_gm, example_inputs, self.inner, reducer)
        if folder is not None:
            self.dump.write_aot(folder, segments, _fake_mode(example_inputs))
        return split_gm


# -- which DDP is running -------------------------------------------------------------------------------------
def _active_graphddp_module():
    from .ddp import DistributedDataParallel

    return DistributedDataParallel._active


def _refuse_pytorch_ddp() -> None:
    if nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
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
    """One compiled segment in the stitched module: unwraps single outputs and can mark its backward start."""

    def __init__(self, compiled: Callable[..., Any], index: int, unwrap: bool, reducer: Any) -> None:
        super().__init__()
        self.compiled = compiled
        self.index = index
        self.unwrap = unwrap
        self._reducer = weakref.ref(reducer) if reducer is not None else None

    def forward(self, *args: Any) -> Any:
        out = self.compiled(*args)
        if self.unwrap:
            out = out[0]
        reducer = self._reducer() if self._reducer is not None else None
        if reducer is not None and isinstance(reducer.events, EventLog):
            _mark_backward_start(out, self.index, reducer.events)
        return out


def _traced(compiled: Callable[..., Any], index: int, reducer: Any) -> Callable[..., Any]:
    segment = CompiledSegment(compiled, index, unwrap=False, reducer=reducer)
    return segment.forward


def _mark_backward_start(out: Any, index: int, events: EventLog) -> None:
    """Record ``segment_backward`` when autograd is about to run this segment's backward (tests, timelines)."""
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    for t in outputs:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads, index=index: events.record("segment_backward", index))
            return


class _SegmentCompiler(fx.Interpreter):
    """Walks the stitched module with fake tensors, compiling each ``submod_k`` with the inner backend."""

    def __init__(self, split_gm: fx.GraphModule, inner: CompilerFn, fake_mode: Any, reducer: Any) -> None:
        super().__init__(split_gm)
        self.inner = inner
        self.fake_mode = fake_mode
        self.reducer = reducer
        self.segments: dict[str, tuple[fx.GraphModule, list[Any]]] = {}
        """Each segment as compiled, with its fake inputs (for the debug dump)."""

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args = tuple(as_fake(a, self.fake_mode, static_shapes=False) for a in args)
        if n.op != "call_module" or not str(n.target).startswith("submod_"):  # taps run as they are
            return getattr(self, n.op)(n.target, args, kwargs)
        assert not kwargs, "split_module passes segment inputs positionally"
        segment: fx.GraphModule = self.fetch_attr(str(n.target))
        unwrap = _make_output_a_tuple(segment)
        # Fake outputs for the next segment come from the uncompiled segment: shapes, dtypes, strides.
        grad_mode = torch.is_grad_enabled()
        with self.fake_mode:
            out = segment(*args)
        self.segments[str(n.target)] = (segment, list(args))
        torch.set_grad_enabled(grad_mode)  # a segment may switch grad mode; the next compile must not inherit it
        compiled = self.inner(segment, list(args))
        torch.set_grad_enabled(grad_mode)
        index = int(str(n.target).rsplit("_", 1)[1])
        wrapped = CompiledSegment(compiled, index, unwrap, self.reducer)
        self.module.delete_submodule(str(n.target))
        n.target = f"compiled_{n.target}"
        self.module.add_submodule(n.target, wrapped)
        return out[0] if unwrap else out


def _make_output_a_tuple(segment: fx.GraphModule) -> bool:
    """AOTAutograd-based compilers want a tuple of outputs; returns True when the caller must unwrap one."""
    output = next(n for n in segment.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    segment.recompile()
    return True


def _compile_segments(
    split_gm: fx.GraphModule, example_inputs: list[Any], inner: CompilerFn, reducer: Any
) -> dict[str, tuple[fx.GraphModule, list[Any]]]:
    compiler = _SegmentCompiler(split_gm, inner, _fake_mode(example_inputs), reducer)
    compiler.run(*example_inputs)
    split_gm.recompile()
    return compiler.segments


def _fake_mode(example_inputs: list[Any]) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode()
