"""The one graph pipeline: find parameters -> plan (or reuse a plan) -> split -> taps -> segments on fake tensors
-> debug dump. The compile backend runs it with a compiler per segment; ``graphddp inspect`` runs it without; the
pass tests run its first half. What inspect shows is therefore what a real run compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn

from ..passes import (
    BucketCaps,
    BucketPlan,
    GraphParam,
    GraphSplit,
    find_graph_params,
    plan_graph,
    split_at_buckets,
    tap_parts,
)
from .capture import as_fake
from .compile_target import PartSink
from .dump import DebugDump
from .gradient_tap import GradientTap

SegmentHook = Callable[[str, fx.GraphModule, list[Any]], "nn.Module | None"]
"""Called with each segment's name, module and fake inputs; may return a module to run in its place."""


@dataclasses.dataclass(frozen=True)
class PreparedGraph:
    """One captured graph, planned and cut (not compiled)."""

    params: list[GraphParam]
    split: GraphSplit
    split_gm: fx.GraphModule | None
    """The stitched module (``submod_K`` per segment, taps in front of tapped ones); None for one segment."""
    reused_plan: bool
    """Cut by a plan made before for a graph with the same parameters (a recompile), not planned afresh."""

    @property
    def plan(self) -> BucketPlan:
        return self.split.plan


def prepare_graph(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    names: Mapping[int, str],
    *,
    caps: BucketCaps | Callable[[fx.GraphModule, list[GraphParam], bool], BucketCaps],
    row_sparse: bool | Callable[[list[GraphParam]], bool],
    plan_for: Callable[[frozenset[str]], BucketPlan | None] = lambda params: None,
    sink: PartSink | None = None,
    bucket_dtypes: Mapping[str, torch.dtype] | None = None,
) -> PreparedGraph | None:
    """Plan and cut ``gm``; None when it has no trainable parameter (``names``: ``id(param)`` to name).

    ``row_sparse``: are its tables planned as rows, or a function deciding it for this graph
    (``sparse_embedding_grads="auto"``); ``caps``: the caps, or a function choosing them for this graph and that
    decision (``bucket_cap_mb="auto"``).
    ``plan_for(params)`` returns a plan already made for a graph with exactly these parameters, to cut by instead
    of planning afresh (Note [Plan agreement] in ``graphddp/runtime/plans.py``). Taps hand parts to ``sink``.
    """
    params = find_graph_params(gm, example_inputs, names, bucket_dtypes)
    if not params:
        return None
    earlier = plan_for(frozenset(p.spec.name for p in params))
    if callable(row_sparse):  # a recompile is cut by its earlier plan: nothing to choose
        row_sparse = earlier is None and row_sparse(params)
    if callable(caps):
        caps = caps(gm, params, row_sparse) if earlier is None else earlier.caps
    split = plan_graph(gm, params, caps, row_sparse=row_sparse, plan=earlier)
    split_gm = None
    if split.num_segments > 1:
        split_gm = split_at_buckets(gm, split)
        tap_parts(split_gm, split, lambda tap: GradientTap(sink, tap.param, tap.part))
    return PreparedGraph(params, split, split_gm, reused_plan=earlier is not None)


def lower_graph(
    prepared: PreparedGraph,
    gm: fx.GraphModule,
    example_inputs: list[Any],
    *,
    name: str,
    dump: DebugDump | None,
    on_segment: SegmentHook | None = None,
) -> dict[str, tuple[fx.GraphModule, list[Any]]]:
    """Walk the segments on fake tensors (``on_segment`` compiles or records each), writing the debug dump around
    it; returns each segment with its fake inputs (the whole graph under ``"graph"`` when it is one segment)."""
    folder = dump.graph_folder(name) if dump is not None else None
    if folder is not None:
        dump.write_graph(folder, graph=name, captured=gm, plan=prepared.plan, split=prepared.split, split_gm=prepared.split_gm)
    fake_mode = fake_mode_for(example_inputs)
    if prepared.split_gm is None:
        segments = {"graph": (gm, list(example_inputs))}
    else:
        walker = _SegmentWalker(prepared.split_gm, fake_mode, on_segment)
        walker.run(*example_inputs)
        prepared.split_gm.recompile()
        segments = walker.segments
    if folder is not None:
        dump.write_aot(folder, segments, fake_mode)
    return segments


def fake_mode_for(example_inputs: list[Any]) -> Any:
    """Dynamo's fake mode while it compiles; a fresh one (that accepts real constants) elsewhere."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(example_inputs) or torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)


def _discarding_fresh_unbacked_symbols(fake_mode: Any) -> Any:
    """Running a segment on fake tensors to learn its outputs is not a trace: data-dependent values it makes
    (``.item()``, ``nonzero()``) would otherwise stay pending in the shape environment, and the next trace (the
    inner compiler's, of this very segment) would fail looking for them in its outputs."""
    shape_env = getattr(fake_mode, "shape_env", None)
    return shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()


class _SegmentWalker(fx.Interpreter):
    """Runs the stitched module on fake tensors, handing each ``submod_K`` to ``on_segment`` on the way: its fake
    outputs (shapes, dtypes, strides) are the next segment's inputs."""

    def __init__(self, split_gm: fx.GraphModule, fake_mode: Any, on_segment: SegmentHook | None) -> None:
        super().__init__(split_gm)
        self.fake_mode = fake_mode
        self.on_segment = on_segment
        self.segments: dict[str, tuple[fx.GraphModule, list[Any]]] = {}

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args = tuple(as_fake(a, self.fake_mode, static_shapes=False) for a in args)
        if n.op != "call_module" or not str(n.target).startswith("submod_"):  # taps run as they are
            return getattr(self, n.op)(n.target, args, kwargs)
        assert not kwargs, "split_module passes segment inputs positionally"
        name = str(n.target)
        segment: fx.GraphModule = self.fetch_attr(name)
        grad_mode = torch.is_grad_enabled()
        with self.fake_mode, _discarding_fresh_unbacked_symbols(self.fake_mode):
            out = segment(*args)
        torch.set_grad_enabled(grad_mode)  # a segment may switch grad mode; the next one must not inherit it
        self.segments[name] = (segment, list(args))
        replacement = self.on_segment(name, segment, list(args)) if self.on_segment is not None else None
        torch.set_grad_enabled(grad_mode)
        if replacement is not None:
            self.module.delete_submodule(name)
            n.target = f"compiled_{name}"
            self.module.add_submodule(n.target, replacement)
        return out
