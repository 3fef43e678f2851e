"""Where the parts of tied tables' gradients are taken off a split graph, and the FX edit that puts taps there
(Note [Row-sparse gradients] in ``passes/row_sparse.py``).

Pure: the tap module itself is the runtime's (``graphddp.compiler.gradient_tap``), handed in by a factory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx, nn

from .graph_params import GraphParam
from .plan import ParamSpec
from .split import GraphSplit, Tap


def place_taps(split: GraphSplit, params: Sequence[GraphParam], parts: Sequence[ParamSpec]) -> tuple[Tap, ...]:
    """A tap for each of ``parts`` (the plan's parts of tied tables), where the cut allows one: the parameter is a
    graph input, and its parts sit in segments of their own, apart from its lookups. A parameter whose parts
    cannot all be placed gets no tap at all (its part slots are then reduced as zeros and its whole gradient
    goes to ``.grad``: correct, only not early)."""
    by_name = {p.spec.name: p for p in params}
    taps: list[Tap] = []
    for name in dict.fromkeys(s.name for s in parts):
        param = by_name.get(name)
        specs = [s for s in parts if s.name == name]
        if param is None or not param.is_input:
            continue
        segments = [split.partition.get(s.part) for s in specs]
        lookups = {split.partition.get(u.node) for u in param.uses if u.lookup}
        if None in segments or len(set(segments)) != len(segments) or lookups & set(segments):
            continue
        taps += [Tap(name, param.node, s.part, seg) for s, seg in zip(specs, segments) if seg is not None]
    return tuple(taps)


def tap_parts(split_gm: fx.GraphModule, split: GraphSplit, make_tap: Callable[[Tap], nn.Module]) -> None:
    """Feed each tapped parameter to its segment through ``make_tap(tap)``, a module added to ``split_gm``.

    ``split_gm`` is ``split_at_buckets(gm, split)``: its ``submod_K`` is segment K, called with the parameter's
    placeholder among its arguments; the tap's output replaces that argument.
    """
    if not split.taps:
        return
    graph = split_gm.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
    for k, tap in enumerate(split.taps):
        call, param = calls[f"submod_{tap.segment}"], placeholders[tap.placeholder]
        assert param in call.args, f"segment {tap.segment} does not take {tap.param} as an input"
        name = f"tap_{k}"
        split_gm.add_submodule(name, make_tap(tap))
        with graph.inserting_before(call):
            tapped = graph.call_module(name, (param,))
        call.args = tuple(tapped if a is param else a for a in call.args)
    graph.lint()
    split_gm.recompile()
