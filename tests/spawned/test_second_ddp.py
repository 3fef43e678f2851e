"""Two graphddp.DDPs over modules of the same class in one process, both compiled (Note [Split without asking],
"One recompile region per DDP"): Dynamo caches frames by code, and the second module passes the first one's guards
under the same backend, so the second DDP ran the first one's graphs (split, through its hooks, its gradient taps
reporting to the first). Each DDP's forward now runs in a recompile region of its own: both reduce in-graph, no
hook is called once they do, and each trains as PyTorch's DDP does, one after the other or step by step in turn.
The same where the wrapped module is compiled itself (``DDP(torch.compile(model))``, ``model.compile()``): its
compile wrapper, which sets a region of its own inside the DDP's, is moved into the DDP's region."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import IN, MLP, OUT
from ranks import run_on_ranks
from training import CAPS, counted_hooks

import graphddp


def batch(step: int, which: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * which + rank)
    return torch.randn(6, IN, generator=g), torch.randn(6, OUT, generator=g)


def wrapped(model: torch.nn.Module, how: str, backend: object) -> tuple[graphddp.DDP, torch.nn.Module]:
    """(the DDP, what a step calls) for ``model`` compiled ``how``."""
    if how == "torch.compile(DDP)":
        ddp = graphddp.DDP(model, **CAPS)
        return ddp, torch.compile(ddp, backend=backend)
    if how == "DDP(torch.compile)":
        ddp = graphddp.DDP(torch.compile(model, backend=backend), **CAPS)
    else:  # "DDP(model.compile())"
        model.compile(backend=backend)
        ddp = graphddp.DDP(model, **CAPS)
    return ddp, ddp


def two_ddps(rank: int, world: int, order: str, backend: str, how: str = "torch.compile(DDP)") -> list[tuple]:
    """Per DDP: (its strategies, its in-graph forwards, hook calls in each of its backwards)."""
    torch._dynamo.reset()
    shared = graphddp.backend("aot_eager") if backend == "graphddp.backend" else "aot_eager"  # one object for both
    ddps, refs, compiled, hook_calls = [], [], [], [[], []]
    with counted_hooks() as calls:
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = MLP()
            refs.append(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model)))
            ddp, step = wrapped(model, how, shared)
            ddps.append(ddp)
            compiled.append(step)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*ddps, *refs)]
        schedule = [(s, w) for w in (0, 1) for s in range(3)] if order == "one after the other" else [(s, w) for s in range(3) for w in (0, 1)]
        for step, which in schedule:
            x, y = batch(step, which, rank)
            before = calls[0]
            F.mse_loss(compiled[which](x), y).backward()
            hook_calls[which].append(calls[0] - before)
            F.mse_loss(refs[which](x), y).backward()
            for p, q in zip(ddps[which].parameters(), refs[which].parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            for opt in (opts[which], opts[2 + which]):
                opt.step(), opt.zero_grad()
    return [
        (sorted({str(r) for r in d.reducer.compile_target.reductions}), d.reducer.compile_target.gate.in_graph_forwards, calls)
        for d, calls in zip(ddps, hook_calls)
    ]


@pytest.mark.parametrize("order", ["one after the other", "in turn"])
@pytest.mark.parametrize("backend", ["aot_eager", "graphddp.backend"])
def test_a_second_ddp_of_the_same_class_compiles_its_own_graphs_and_reduces_in_graph(order: str, backend: str) -> None:
    for per_rank in run_on_ranks(two_ddps, 2, order, backend):
        for which, (reductions, in_graph_forwards, hook_calls) in enumerate(per_rank):
            # The first forward proposes the graph's plan; the two after it reduce in-graph, calling no hook.
            assert reductions == ["in_graph (traceable)"], (which, reductions)
            assert in_graph_forwards == 2 and hook_calls[1:] == [0, 0], (which, in_graph_forwards, hook_calls)


@pytest.mark.parametrize("how", ["DDP(torch.compile)", "DDP(model.compile())"])
def test_a_second_ddp_over_a_compiled_module_of_the_same_class_reduces_in_graph(how: str) -> None:
    for per_rank in run_on_ranks(two_ddps, 2, "in turn", "aot_eager", how):
        for which, (reductions, in_graph_forwards, hook_calls) in enumerate(per_rank):
            assert reductions == ["in_graph (traceable)"], (which, reductions)
            assert in_graph_forwards == 2 and hook_calls[1:] == [0, 0], (which, in_graph_forwards, hook_calls)
