"""``InGraphGate`` (``graphddp/runtime/in_graph.py``) on its own: which variant of a compiled graph runs, and what
it refuses (no process group: the plans and hooks it consults are stand-ins)."""

from __future__ import annotations

import types

import pytest
import torch

from graphddp.runtime.in_graph import InGraphGate


class Hooks:
    def __init__(self) -> None:
        self.attached = True

    def attach(self) -> None:
        self.attached = True

    def detach(self) -> None:
        self.attached = False


def open_gate(agreed: frozenset[frozenset[str]], proposed: str = "in_graph") -> tuple[InGraphGate, Hooks]:
    """A gate opened for a forward, the graphs ``agreed`` to reduce in-graph, each ``proposed`` so since."""
    graph_plans = types.SimpleNamespace(strategy_for=lambda params: proposed if params in agreed else None)
    plans = types.SimpleNamespace(agreed_in_graph=agreed, proposing=False, graph_plans=graph_plans)
    hooks = Hooks()
    gate = InGraphGate(plans, hooks, ["w", "b"], rank=1, world_size=2, device=torch.device("cpu"))
    gate.begin_forward(grad_enabled=True, synchronising=True, needs_hooks=False)
    assert gate.open and not hooks.attached
    return gate, hooks


def test_an_agreed_graph_runs_in_graph_and_a_new_one_closes_the_gate() -> None:
    graph = frozenset({"w", "b"})
    gate, hooks = open_gate(frozenset({graph}))
    assert gate.reduces_in_graph(graph, can=True)
    assert not gate.reduces_in_graph(frozenset({"w"}), can=False)  # not agreed: the Reducer takes this forward
    assert not gate.open and hooks.attached


def test_an_agreed_graph_compiled_again_without_an_in_graph_variant_raises_instead_of_running_split_alone() -> None:
    # Every other rank runs its in-graph variant, whose collectives this rank's Reducer would not match (a recompile
    # whose tied table's uses no longer match the plan's parts: graphddp.passes.parts_named_in).
    graph = frozenset({"w", "b"})
    gate, hooks = open_gate(frozenset({graph}))
    with pytest.raises(RuntimeError, match=r"\[rank 1\] .* agreed to reduce in-graph was compiled again on this rank"):
        gate.reduces_in_graph(graph, can=False)


def test_an_agreed_graph_compiled_again_split_on_purpose_closes_the_gate() -> None:
    # Dynamo reset and the model compiled again with reduction="split" on every rank: the recompile proposed the
    # graph anew as split (GraphPlans.restrategize), so every rank's Reducer takes this forward alike.
    graph = frozenset({"w", "b"})
    gate, hooks = open_gate(frozenset({graph}), proposed="split")
    assert not gate.reduces_in_graph(graph, can=False)
    assert not gate.open and hooks.attached
