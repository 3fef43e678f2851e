"""FX graph helpers for the pure tests: a graph named anew as a recompile may name it, and the forward and
backward graphs AOTAutograd traces from a graph (the graphs an inner compiler would be handed)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from functorch.compile import make_boxed_compiler
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified


def renamed(gm: fx.GraphModule, names: dict[str, str]) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes in ``names`` are named anew, as a recompile may name them."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.name in names:
            node.name = names[node.name]
    return fx.GraphModule(gm, graph)


def traced(gm: fx.GraphModule, example_inputs: list, schedule: Callable[[fx.Graph], object]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``gm``'s (forward, backward) as AOTAutograd hands them to the inner compiler, the backward reordered by
    ``schedule`` first, as graphddp's in-graph compiler does."""
    graphs: dict[str, fx.GraphModule] = {}

    def keep(kind: str) -> Callable[[fx.GraphModule, list], object]:
        def compiler(graph_module: fx.GraphModule, inputs: list) -> object:
            if kind == "backward":
                schedule(graph_module.graph)
                graph_module.recompile()
            graphs[kind] = graph_module
            return graph_module.forward

        return compiler

    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        aot_module_simplified(gm, example_inputs, fw_compiler=make_boxed_compiler(keep("forward")), bw_compiler=make_boxed_compiler(keep("backward")))
    return graphs["forward"], graphs["backward"]
