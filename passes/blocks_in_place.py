"""A big gradient sent in pieces, written by its blocks' matmuls straight into the gradient: no copy at the end.

Note [Blocks written in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In-graph, a gradient sent in pieces (Note [Gradient pieces] in ``passes/plan.py``) is computed block by block,
each block by its own matmul, divided by the world size and all-reduced on its own. Written functionally, each
block's all-reduce returns a tensor of its own, and once the last one is waited for a ``cat`` copies them all
into the gradient: a copy of the whole gradient into memory no one has touched yet (the bench MLP's two 64 MiB
weights: ~65 ms each on a 2-vCPU host, most of it page faults), on the CPU or stream the next computation and the
collectives share, and, for the gradient completed last, after the link is done.
Neither compiler removes it: Inductor realises the blocks before it lowers the ``cat``, and aot_eager runs the
graph as written.

``write_blocks_in_place`` rewrites that assembly. The gradient is allocated once (``aten.empty``) before its first
block, and each block that is a plain matmul's result (``mm``, through pairs of transposes, flattened, divided,
all-reduced with ``sum``) becomes one ``graphddp::reduce_block_`` call: the matmul written into the block's rows of
the gradient (``mm`` with ``out=``), divided there, and all-reduced there, asynchronously, on the bucket's group.
The ``cat`` becomes one ``graphddp::wait_blocks_`` call: it waits for those all-reduces, then copies the blocks that
are not plain matmuls' (the first block, sent with the bucket's small gradients and the abandon signal) into their
rows. Where an optimizer steps the gradient's bucket in backward, it is handed that step node's key, and steps
each block's rows as the block's wait returns (Note [Steps by rows] in ``graphddp/runtime/row_steps.py``). The ops' schemas say that they write the gradient (``mutates_args``, so Inductor can run them as
auto-functionalizable fallbacks), and the gradient's readers come after ``wait_blocks_``: every compiler keeps
their order, as a buffer's writes come before its later reads; the page faults move into the blocks' matmuls, inside
backward, where a run without pieces pays them too.

The same collectives go out in the same order on every rank (a block's all-reduce is issued where the functional
one was: the pass runs after the scheduling passes, on a graph every rank compiled alike). The blocks' values are
the functional graph's: the same matmul on the same rows, the same division, the same all-reduce. A pattern the
pass does not know (a block cast for the wire by ``fp16_compress_hook``, a block not contiguous) keeps its
functional all-reduce and is copied in by ``wait_blocks_`` like the first block; a ``cat`` with no such block is
left as it was. The runtime half (the ops) is ``graphddp/runtime/in_graph_blocks.py``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from .reduction import divide_while_gathering, is_step, is_wait, schedule_reductions, transposed_input

BLOCK_OP = "graphddp::reduce_block_"
"""A block written into its gradient, divided and all-reduced there: ``(gradient, rows, by, offset, divisor,
group_name, first) -> None``, writes ``gradient`` (the block is ``rows @ by``; ``first``: the gradient's first such block)."""

WAIT_BLOCKS_OP = "graphddp::wait_blocks_"
"""The blocks' all-reduces waited for, and the other blocks copied in: ``(gradient, copies, offsets, step, position)
-> None``, writes ``gradient``; with a ``step`` key (-1: none), each block's rows stepped as it is waited for, the
gradient being the one at ``position`` of that step node's (Note [Steps by rows] in ``graphddp/runtime/row_steps.py``)."""

_FLATTEN = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_DIVIDE = {torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar}


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block of the assembly ``cat`` that its matmul can write in place: the nodes that compute and send it."""

    matmul: fx.Node  # aten.mm(rows, by) -> [r, C], contiguous
    chain: tuple[fx.Node, ...]  # matmul .. all_reduce .. wait, in graph order: replaced by one call
    all_reduce: fx.Node
    divisor: object
    group_name: str


def _used_only_by(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _block(wait: object, assembly: fx.Node) -> _Block | None:
    """The block behind ``wait`` (an input of ``assembly``) when it is a plain matmul's, sent alone; else None."""
    if not isinstance(wait, fx.Node) or not is_wait(wait):
        return None
    reduce = wait.args[0]
    if not isinstance(reduce, fx.Node) or reduce.target is not torch.ops._c10d_functional.all_reduce.default:
        return None
    if not (_used_only_by(wait, assembly) and _used_only_by(reduce, wait)) or reduce.args[1] != "sum":
        return None
    divide = reduce.args[0]
    if not isinstance(divide, fx.Node) or divide.target not in _DIVIDE or not _used_only_by(divide, reduce):
        return None
    flat = divide.args[0]
    if not isinstance(flat, fx.Node) or flat.target not in _FLATTEN or not _used_only_by(flat, divide):
        return None
    chain, source = [flat], flat.args[0]
    while isinstance(source, fx.Node) and (inner := transposed_input(source)) is not None:  # pairs of transposes only
        innermost = transposed_input(inner) if isinstance(inner, fx.Node) else None
        if innermost is None or not _used_only_by(source, chain[-1]) or not _used_only_by(inner, source):
            return None
        chain += [source, inner]
        source = innermost
    if not isinstance(source, fx.Node) or source.target is not torch.ops.aten.mm.default:
        return None
    if not _used_only_by(source, chain[-1]):
        return None
    value, sent = _value(source), _value(divide)
    if (
        value is None
        or sent is None
        or not value.is_contiguous()
        or value.dtype != sent.dtype
        or not isinstance(divide.args[1], int | float)
    ):
        return None
    nodes = (source, *reversed(chain), divide, reduce, wait)
    return _Block(source, nodes, reduce, divide.args[1], str(reduce.args[2]))


def _stepped_by(assembly: fx.Node) -> tuple[int, int]:
    """The optimizer step node that steps the gradient ``assembly`` puts together, whole or reshaped (Note [Steps
    in the compiled backward]): its key and the gradient's position among its gradients; (-1, -1): none."""
    frontier, seen = [assembly], {assembly}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_step(user) and isinstance(user.args[1], list | tuple) and node in user.args[1]:
                return int(user.args[0]), list(user.args[1]).index(node)  # type: ignore[arg-type]
            if user.target in _FLATTEN and user not in seen:
                seen.add(user)
                frontier.append(user)
    return -1, -1


def write_blocks_in_place(graph: fx.Graph) -> int:
    """Note [Blocks written in place]: each assembly ``cat`` of a gradient's blocks rewritten so its blocks'
    matmuls write into the gradient. Run it after the scheduling passes (its ops write: a barrier to them), before
    ``reduce_in_place``. Returns how many blocks are written in place."""
    written = 0
    for assembly in [n for n in graph.nodes if n.target is torch.ops.aten.cat.default]:
        inputs = list(assembly.args[0])  # type: ignore[arg-type]
        value = _value(assembly)
        if len(assembly.args) > 1 and assembly.args[1] not in (0, -1) or value is None or value.dim() != 1:
            continue
        blocks = [_block(i, assembly) for i in inputs]
        if not any(blocks) or any(_value(i) is None for i in inputs):
            continue
        reduce_block = torch.ops.graphddp.reduce_block_.default  # registered by graphddp.runtime.in_graph_blocks
        wait_blocks = torch.ops.graphddp.wait_blocks_.default
        offsets = [sum(_value(i).numel() for i in inputs[:k]) for k in range(len(inputs))]  # type: ignore[union-attr]
        order = {n: k for k, n in enumerate(graph.nodes)}
        first = min((b for b in blocks if b is not None), key=lambda b: order[b.all_reduce])
        earliest = min((b.matmul for b in blocks if b is not None), key=order.__getitem__)
        with graph.inserting_before(earliest):
            gradient = graph.call_function(
                torch.ops.aten.empty.memory_format, ([value.numel()],), {"dtype": value.dtype, "device": value.device}
            )
        gradient.meta["val"] = value.new_empty(value.shape)
        for block, offset in sorted(
            ((b, o) for b, o in zip(blocks, offsets) if b is not None), key=lambda bo: order[bo[0].all_reduce]
        ):
            rows, by = block.matmul.args
            with graph.inserting_before(block.all_reduce):
                call = graph.call_function(
                    reduce_block, (gradient, rows, by, offset, block.divisor, block.group_name, block is first)
                )  # fmt: skip
            call.meta["val"] = None
            written += 1
        copies = [i for i, b in zip(inputs, blocks) if b is None]
        where = [o for o, b in zip(offsets, blocks) if b is None]
        step, position = _stepped_by(assembly)  # its blocks stepped as they come in (Note [Steps by rows])
        with graph.inserting_before(assembly):
            done = graph.call_function(wait_blocks, (gradient, copies, where, step, position))
        done.meta["val"] = None
        assembly.replace_all_uses_with(gradient)  # read after ``done``: the gradient, whole and averaged
        graph.erase_node(assembly)
        for block in (b for b in blocks if b is not None):
            for node in reversed(block.chain):  # each used only by the next, the wait by the erased cat
                graph.erase_node(node)
    if written:
        graph.lint()
    return written


def arrange_reductions(graph: fx.Graph, *, fusing: bool = False) -> bool:
    """The passes graphddp runs on an in-graph backward, in their one order, wherever it compiles or shows one
    (Inductor's post-grad pass, the aot_eager runner, the debug dump): ``schedule_reductions``, then
    ``write_blocks_in_place``, whose ops write a buffer and so are barriers the scheduling passes could not move
    (Note [Blocks written in place]), then, for a ``fusing`` compiler (Inductor), ``divide_while_gathering``.
    Returns whether the graph changed."""
    moved = schedule_reductions(graph)
    written = write_blocks_in_place(graph)
    divided = divide_while_gathering(graph) if fusing else 0
    return written > 0 or divided > 0 or any(moved)
