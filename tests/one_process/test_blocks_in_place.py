"""Note [Blocks written in place] (``passes/blocks_in_place.py``): a big gradient's blocks, as the in-graph
backward sends them, rewritten so the blocks' matmuls write into one gradient; the graph's nodes, and its values
against the functional graph's, in one gloo process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphddp.passes import arrange_reductions, schedule_reductions, write_blocks_in_place
from graphddp.runtime import in_graph_blocks  # noqa: F401  (registers graphddp::reduce_block_, ::wait_blocks_)

ROWS = (3, 2, 2, 1)
"""The big gradient's blocks: [8, 5] in 4 blocks of rows, as ``Bucket.pieces`` cuts one."""


def _pieces_backward(group: str, *, wire: torch.dtype | None = None):
    """A weight gradient ``dy^T x`` ([8, 5]) in ``ROWS`` blocks, as ``_average_in_pieces`` traces it: block 0 sent
    with a bias ([8]), each other block alone (cast to ``wire`` first, as ``fp16_compress_hook``'s), the cat."""

    def average(flat: torch.Tensor) -> torch.Tensor:
        sent = (flat.to(wire) if wire is not None else flat).div(2)
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(sent, "sum", group)).to(flat.dtype)

    def backward(dy_t: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = [sum(ROWS[:k]) for k in range(len(ROWS))]
        blocks = [torch.mm(dy_t[s : s + r], x).t().t().reshape(-1) for s, r in zip(starts, ROWS)]  # [r * 5]
        first, summed_bias = average(torch.cat([blocks[0], bias])).split([blocks[0].numel(), bias.numel()])
        return torch.cat([first, *(average(b) for b in blocks[1:])]).view(8, 5), summed_bias

    return backward


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 6, generator=g), torch.randn(6, 5, generator=g), torch.randn(8, generator=g)


def _ops_name(node: fx.Node) -> str:
    return getattr(node.target, "name", lambda: str(node.target))() if node.op == "call_function" else ""


def _ops(graph: fx.Graph) -> list[str]:
    return [_ops_name(n) for n in graph.nodes if n.op == "call_function"]


@pytest.mark.usefixtures("one_rank_group")
def test_the_blocks_are_written_into_the_gradient_with_the_functional_graphs_values() -> None:
    group = dist.group.WORLD.group_name
    functional = make_fx(_pieces_backward(group), tracing_mode="fake")(*_inputs())
    rewritten = make_fx(_pieces_backward(group), tracing_mode="fake")(*_inputs())
    assert write_blocks_in_place(rewritten.graph) == 3  # blocks 1-3; block 0 goes with the bias
    rewritten.recompile()
    ops = _ops(rewritten.graph)
    assert ops.count("graphddp::reduce_block_") == 3 and ops.count("graphddp::wait_blocks_") == 1
    assert ops.count("_c10d_functional::all_reduce") == 1 and ops.count("aten::cat") == 1  # block 0's, with the bias
    calls = [n for n in rewritten.graph.nodes if _ops_name(n) == "graphddp::reduce_block_"]
    assert [c.args[3] for c in calls] == [15, 25, 35] and [c.args[6] for c in calls] == [True, False, False]  # offsets
    (wait,) = [n for n in rewritten.graph.nodes if _ops_name(n) == "graphddp::wait_blocks_"]
    assert wait.args[2] == [0] and wait.args[0] is calls[0].args[0]  # block 0 copied in at the start
    for expected, got in zip(functional(*_inputs()), rewritten(*_inputs())):
        torch.testing.assert_close(got, expected)


@pytest.mark.usefixtures("one_rank_group")
def test_a_block_cast_for_the_wire_keeps_its_functional_all_reduce() -> None:
    # fp16_compress_hook's blocks are cast before they are sent: not a plain matmul's result, so nothing is rewritten
    rewritten = make_fx(_pieces_backward(dist.group.WORLD.group_name, wire=torch.float16), tracing_mode="fake")(*_inputs())
    before = _ops(rewritten.graph)
    assert write_blocks_in_place(rewritten.graph) == 0 and _ops(rewritten.graph) == before


@pytest.mark.usefixtures("one_rank_group")
def test_arrange_reductions_schedules_then_writes_the_blocks_as_every_compile_path_does() -> None:
    """The one order the Inductor pass, the aot_eager runner and the dump share: the blocks' ops are written after
    scheduling (they are barriers to it), so the result is the two passes run in that order, and its values the
    functional graph's."""
    group = dist.group.WORLD.group_name
    functional = make_fx(_pieces_backward(group), tracing_mode="fake")(*_inputs())
    by_hand = make_fx(_pieces_backward(group), tracing_mode="fake")(*_inputs())
    schedule_reductions(by_hand.graph)
    write_blocks_in_place(by_hand.graph)
    arranged = make_fx(_pieces_backward(group), tracing_mode="fake")(*_inputs())
    assert arrange_reductions(arranged.graph)
    assert _ops(arranged.graph) == _ops(by_hand.graph) and "graphddp::reduce_block_" in _ops(arranged.graph)
    arranged.recompile()
    for expected, got in zip(functional(*_inputs()), arranged(*_inputs())):
        torch.testing.assert_close(got, expected)
    plain = make_fx(lambda x, w: torch.mm(x, w).sum(), tracing_mode="fake")(*_inputs()[:2])
    assert not arrange_reductions(plain.graph)  # nothing to schedule, no blocks: the graph as it was
