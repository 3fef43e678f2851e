"""How a compiled graph's gradients are reduced: split at buckets, or all-reduced inside the compiled backward.

One rule, one place: the compile backend, ``graphddp inspect`` and the benchmark all ask ``choose_reduction``.
The algorithm of the in-graph strategy is Note [In-graph reduction] in ``graphddp/compiler/in_graph.py``; this
module only decides, from facts every rank shares (the options, the comm hook's kind, the plan), so every rank
decides alike, and the plan agreement checks it all the same (Note [Plan agreement]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
from torch import fx

from .plan import BucketPlan

Strategy = Literal["split", "in_graph"]
REDUCTIONS = ("auto", "split", "in_graph")
"""What a user may ask for: ``"auto"`` (in-graph where it can be traced, else split), or one strategy."""


@dataclasses.dataclass(frozen=True)
class ReductionChoice:
    """The strategy one graph runs, and why (shown in the log, ``inspect``, the dump and the benchmark)."""

    strategy: Strategy
    reason: str

    def __str__(self) -> str:
        return f"{self.strategy} ({self.reason})"


def check_reduction(requested: object) -> str:
    """``requested`` as given, or a ``ValueError`` naming the choices."""
    if requested not in REDUCTIONS:
        raise ValueError(f"graphddp: reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {requested!r}")
    return str(requested)


def plan_blockers(plan: BucketPlan, *, rows_in_use: bool = True) -> list[str]:
    """What in ``plan`` cannot be reduced in-graph: ``torch.sparse`` gradients; tables planned as rows once rows
    are no longer in use (``rows_in_use`` False: a comm hook registered since, which the Reducer runs on them
    dense). Tables planned as rows and their parts are otherwise reduced in-graph: an opaque node picks the rows at
    run time (Note [Rows in the compiled backward] in ``graphddp/runtime/in_graph_rows.py``). A function of the
    plan and the DDP's settings only, so every rank decides alike."""
    blockers = []
    rows = bool(plan.parts) or any(b.row_sparse for b in plan.buckets)
    if rows and not rows_in_use:
        blockers.append("tables planned as rows, and a comm hook registered since")
    if any(b.sparse_grad for b in plan.buckets):
        blockers.append("sparse gradients")
    return blockers


def choose_reduction(requested: str, blockers: Sequence[str]) -> ReductionChoice:
    """The strategy for one graph: the one asked for, else in-graph unless something in ``blockers`` needs the
    Reducer (a Python comm hook, unused parameters, sparse gradients, ...), which the split path serves.

    The step cost model predicts the same communication for both (each bucket's all-reduce starts once its last
    gradient exists, in the same order) and less CPU per bucket for in-graph, so ``"auto"`` takes in-graph
    wherever it can be traced.
    """
    check_reduction(requested)
    if requested == "split":
        return ReductionChoice("split", "asked for")
    if blockers:
        return ReductionChoice("split", "in-graph cannot serve: " + "; ".join(blockers))
    return ReductionChoice("in_graph", "asked for" if requested == "in_graph" else "traceable")


# -- waits as late as the graph allows -------------------------------------------------------------------------
_VIEW_OPS = {"view", "_unsafe_view", "slice", "reshape", "alias", "as_strided", "detach", "split", "split_with_sizes",
             "narrow", "t", "permute", "expand"}
"""ATen ops whose result is a view of their input (``operator.getitem`` of a split's outputs counts too)."""


WAIT_OP = "_c10d_functional::wait_tensor"
"""A functional collective's wait (also the op name ``torch.profiler`` records for it: ``bench.worker``)."""


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "name", lambda: "")() == WAIT_OP


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if getattr(node.target, "__name__", "") == "getitem":
        return True
    packet = getattr(node.target, "_overloadpacket", None)
    return packet is not None and packet.__name__ in _VIEW_OPS


def sink_waits(graph: fx.Graph) -> int:
    """Move each functional collective's ``wait_tensor``, with the views of its result that hang off it, to just
    before the first node that computes with the result (the output, for a gradient): compute issued after the
    collective then runs while it is in flight. Returns how many waits moved. Pure graph surgery: only nodes
    before that first consumer move, down, in their order, so every input still comes first."""
    moved = 0
    for wait in [n for n in graph.nodes if is_wait(n)]:
        chain, frontier = {wait}, [wait]
        while frontier:  # the views of the result, all the way down
            for user in frontier.pop().users:
                if _is_view(user) and user not in chain:
                    chain.add(user)
                    frontier.append(user)
        consumers = {u for n in chain for u in n.users if u not in chain}
        if not consumers:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(consumers, key=order.__getitem__)
        to_move = sorted((n for n in chain if order[n] < order[first]), key=order.__getitem__)
        if order[to_move[-1]] - order[wait] + 1 == len(to_move) and order[first] == order[to_move[-1]] + 1:
            continue  # already together, right before the first consumer
        for node in to_move:
            first.prepend(node)
        moved += 1
    graph.lint()
    return moved


# -- collectives as early as the graph allows ------------------------------------------------------------------
def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "name", lambda: "")() if node.op == "call_function" else ""


def _is_collective(node: fx.Node) -> bool:
    name = _op_name(node)
    return name.startswith("_c10d_functional::") and name != WAIT_OP


def _is_barrier(node: fx.Node) -> bool:
    """A node nothing may cross: it mutates or has another side effect (a functional collective and its wait
    have none that ordering could break: each rank issues them in the same order either way)."""
    if node.op != "call_function" or _is_collective(node) or is_wait(node):
        return False
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or node.is_impure()


def launch_collectives_early(graph: fx.Graph) -> int:
    """Each functional collective as early as its inputs allow: in a backward graph, the nodes a bucket's
    all-reduce needs (its weight gradients, the copy into the flat buffer) run before the nodes it does not need
    (the input gradient that only earlier layers read), so the bucket goes out before them and that compute
    overlaps it (weight gradients first, issue 27). Collectives keep their order; every other node keeps its
    order among the nodes it is moved with; nothing crosses a node that mutates or has a side effect.
    ``sink_waits`` then puts each wait as late as it can go. Returns how many nodes changed place."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    sequence: list[fx.Node] = []
    segment: list[fx.Node] = []
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output") or _is_barrier(node):
            sequence += _collectives_first(segment, order)
            segment = []
            sequence.append(node)
        else:
            segment.append(node)
    sequence += _collectives_first(segment, order)
    assert len(sequence) == len(nodes)
    moved = sum(a is not b for a, b in zip(sequence, nodes))
    if moved:
        for before, node in zip(sequence, sequence[1:]):
            before.append(node)  # moves ``node`` to just after ``before``
        graph.lint()
    return moved


def _collectives_first(segment: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """``segment`` reordered: each collective with what it needs in the segment (in the segment's order), in the
    order of the collectives; then the rest."""
    inside, placed, result = set(segment), set(), []
    for collective in (n for n in segment if _is_collective(n)):
        needed, stack = [], [collective]
        while stack:
            node = stack.pop()
            if node in placed or node not in inside:
                continue
            placed.add(node)
            needed.append(node)
            stack.extend(node.all_input_nodes)
        result += sorted(needed, key=order.__getitem__)
    return result + [n for n in segment if n not in placed]


# -- a big gradient computed in pieces ---------------------------------------------------------------------------
def transposed_input(node: fx.Node) -> fx.Node | None:
    """X, when ``node`` is X's 2-D transpose (``t``, or ``permute`` by [1, 0])."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.aten.t.default:
        return node.args[0]  # type: ignore[return-value]
    if node.target is torch.ops.aten.permute.default and list(node.args[1]) == [1, 0]:  # type: ignore[arg-type]
        return node.args[0]  # type: ignore[return-value]
    return None


def _slice_spec(node: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(source, dim, start, end) of a unit-step ``aten.slice`` along dim 0 or 1 of a 2-D tensor, else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return None
    source, dim, start, end, *step = node.args
    if step and step[0] != 1 or dim not in (0, 1) or not isinstance(source, fx.Node):
        return None
    return source, dim, start, end  # type: ignore[return-value]


def _sliced_at_the_source(graph: fx.Graph, source: fx.Node, dim: int, start: int, end: int) -> fx.Node | None:
    """A node computing ``source[start:end]`` along ``dim`` from sliced inputs of the matmul that makes it, through
    its transposes; None when ``source`` is no such chain (then nothing was added)."""
    inner = transposed_input(source)
    if inner is not None:
        sliced = _sliced_at_the_source(graph, inner, 1 - dim, start, end)
        return None if sliced is None else graph.call_function(source.target, (sliced, *source.args[1:]))
    if source.op != "call_function" or source.target is not torch.ops.aten.mm.default:
        return None
    a, b = source.args
    if dim == 0:  # rows of A @ B are A's rows
        rows = graph.call_function(torch.ops.aten.slice.Tensor, (a, 0, start, end))
        return graph.call_function(torch.ops.aten.mm.default, (rows, b))
    columns = graph.call_function(torch.ops.aten.slice.Tensor, (b, 1, start, end))  # columns of A @ B are B's
    return graph.call_function(torch.ops.aten.mm.default, (a, columns))


def compute_pieces_separately(graph: fx.Graph) -> int:
    """Note [Gradient pieces] (``passes/plan.py``): each row block a piecewise bucket slices off a matmul's result
    (through its transposes) is computed by its own matmul on the sliced operand, so a block's all-reduce needs
    only its own block. Only where every use of that result is such a slice: nothing is computed twice. Returns
    how many slices it rewrote."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        spec = _slice_spec(node)
        if spec is not None and _feeds_a_collective(node):  # a block of a bucket, not the model's own slicing
            groups.setdefault(spec[0], []).append(node)
    rewritten = 0
    for source, slices in groups.items():
        if len(slices) < 2 or set(source.users) != set(slices) or not _is_matmul_chain(source):
            continue
        for node in slices:
            _, dim, start, end = _slice_spec(node)  # type: ignore[misc]
            with graph.inserting_before(node):
                replacement = _sliced_at_the_source(graph, source, dim, start, end)
            assert replacement is not None, "checked by _is_matmul_chain"
            _copy_meta(replacement)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
            rewritten += 1
        _erase_unused(graph, source)
    if rewritten:
        graph.lint()
    return rewritten


def _feeds_a_collective(node: fx.Node, hops: int = 5) -> bool:
    """A functional collective reads ``node`` within ``hops`` nodes (a block's flatten, cast, cat, division)."""
    frontier = [node]
    for _ in range(hops):
        frontier = [user for n in frontier for user in n.users]
        if any(_is_collective(n) for n in frontier):
            return True
    return False


def _is_matmul_chain(node: fx.Node) -> bool:
    """``node`` is a matmul, or transposes of one each used once along the way."""
    while (inner := transposed_input(node)) is not None:
        if len(inner.users) != 1:
            return False
        node = inner
    return node.op == "call_function" and node.target is torch.ops.aten.mm.default


def _copy_meta(node: fx.Node) -> None:
    """Fake values for the new nodes (Inductor's lowering reads ``meta["val"]``), from their inputs' own."""
    if node.op != "call_function":
        return
    for arg in node.all_input_nodes:
        if "val" not in arg.meta:
            _copy_meta(arg)
    values = [a.meta.get("val") for a in node.all_input_nodes]
    if any(v is None for v in values):  # a graph without fake values (built by hand): nothing to copy
        return
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(values)
    args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])  # a cast's dtype
    if mode is None:
        node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then each input of it left unused, down the chain (pure ops only)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.users or current.op != "call_function" or current.is_impure():
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        stack.extend(inputs)


STEP_OP = "graphddp::step_bucket"
"""A bucket's optimizer step node (Note [Steps in the compiled backward], ``graphddp/runtime/in_graph_steps.py``)."""

ROWS_OP = "graphddp::reduce_rows"
"""A table's rows node (Note [Rows in the compiled backward], ``graphddp/runtime/in_graph_rows.py``): it blocks until
its collectives, queued behind every bucket still on the link, are done, so it is scheduled as a wait."""


def is_step(node: fx.Node) -> bool:
    """A bucket's optimizer step node (``STEP_OP``): ``(key, gradients)``."""
    return _op_name(node) == STEP_OP


def sink_bucket_steps(graph: fx.Graph) -> int:
    """The optimizer step nodes, last (Note [Steps in the compiled backward]): at the end of the graph, bucket by
    bucket in the steps' order, what a step needs of the waits (the bucket's waits, the views and copies that make
    its averaged gradients) and then the step; after them, whatever else follows from those (the zeros the steps
    return, summed into the abandon signal's gradient). So a bucket's step runs once its own all-reduces are
    waited for, while the later buckets' are still in flight, and after every computation that does not need a
    wait, so nothing reads a parameter a step has changed. A table's rows node (``ROWS_OP``) counts as a wait: it
    goes to the tail with its table's step. Returns how many step nodes there are."""
    steps = [n for n in graph.nodes if is_step(n)]
    if not steps:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    # A rows node waits for the link like a wait does: left in place it would hold every step behind the last
    # bucket's all-reduce; in the tail it runs just before its table's step.
    after_waits = _downstream([n for n in graph.nodes if is_wait(n) or _op_name(n) == ROWS_OP])
    tail: list[fx.Node] = []
    placed: set[fx.Node] = set()
    for step in steps:
        needed, stack = set(), [step]
        while stack:  # what the step needs that comes from a wait
            for node in stack.pop().all_input_nodes:
                if node in after_waits and node not in needed and node not in placed:
                    needed.add(node)
                    stack.append(node)
        for node in [*sorted(needed, key=order.__getitem__), step]:
            tail.append(node)
            placed.add(node)
    following = _downstream(tail) - placed
    tail += sorted(following, key=order.__getitem__)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in tail:
        output.prepend(node)
    graph.lint()
    return len(steps)


def _downstream(roots: Sequence[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node computed from them, the output excepted."""
    found, frontier = set(roots), list(roots)
    while frontier:
        for user in frontier.pop().users:
            if user.op != "output" and user not in found:
                found.add(user)
                frontier.append(user)
    return found


def sink_rows_nodes(graph: fx.Graph) -> int:
    """Each table's rows node (``ROWS_OP``; a tied table's parts' average is its ``base`` input), with what is
    computed from it (the table's gradient, stepped where an optimizer steps in backward), as late as the graph
    allows: before the output, or before the first node after it that mutates or has another side effect. It
    blocks until the buckets ahead of it on the link are done; where autograd traced it (right after a table's
    lookups: in the middle of backward, for a table used after the first layer) it would hold the rest of the
    backward's compute behind the link. Returns how many moved."""
    moved = 0
    for rows in [n for n in graph.nodes if _op_name(n) == ROWS_OP]:
        chain = _downstream([rows])  # closed under users: only the output uses it from outside
        stop = rows.next
        while stop.op != "output" and (stop in chain or not _is_barrier(stop)):
            stop = stop.next
        order = {n: i for i, n in enumerate(graph.nodes)}
        to_move = sorted((n for n in chain if order[n] < order[stop]), key=order.__getitem__)
        if order[stop] - order[to_move[0]] == len(to_move):
            continue  # already together, right before it
        for node in to_move:
            stop.prepend(node)
        moved += 1
    if moved:
        graph.lint()
    return moved


# -- one pass over a bucket's gradients --------------------------------------------------------------------------
def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}
"""A bucket's cast to the wire's dtype, as Inductor's post-grad graph spells it, and as AOTAutograd's does."""


def divide_while_gathering(graph: fx.Graph) -> int:
    """Each bucket's average divided as its gradients are gathered into it, not after: ``div(cat(gs), n)`` becomes
    ``cat([div(g, n) for g in gs])`` (through the wire's cast too: ``div(convert(cat(gs)))``) where the ``cat`` feeds
    only that chain and the division only an all-reduce. Inductor writes a ``cat`` of computed inputs straight into
    the bucket's slices, so each gradient is read once and its quotient written once, where the ``cat`` then the
    division read and wrote the bucket twice and allocated it twice. The same values, element by element. For a
    fusing compiler only: run op by op (aot_eager), it would add a tensor per gradient (``reduce_in_place``
    divides the gathered bucket in place there). Returns how many buckets it rewrote."""
    rewritten = 0
    for div in [n for n in graph.nodes if n.op == "call_function" and n.target in _IN_PLACE]:
        user = _only_user(div)
        if user is None or _op_name(user) != "_c10d_functional::all_reduce" or not isinstance(div.args[0], fx.Node):
            continue
        chain, gathered = [div], div.args[0]
        if gathered.target in _CASTS and _only_user(gathered) is div:
            chain, gathered = [gathered, div], gathered.args[0]
        if gathered.target is not torch.ops.aten.cat.default or _only_user(gathered) is not chain[0] or gathered.kwargs:
            continue
        if len(gathered.args) > 1 and gathered.args[1] not in (0, -1) or not isinstance(gathered.args[0], (list, tuple)):
            continue
        with graph.inserting_before(gathered):
            pieces = []
            for piece in gathered.args[0]:
                for op in chain:
                    piece = graph.call_function(op.target, (piece, *op.args[1:]), dict(op.kwargs))
                    _copy_meta(piece)
                pieces.append(piece)
            cat = graph.call_function(torch.ops.aten.cat.default, (pieces, *gathered.args[1:]))
            _copy_meta(cat)
        div.replace_all_uses_with(cat)
        _erase_unused(graph, div)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


# -- no copies a fusing compiler would not make ----------------------------------------------------------------
_IN_PLACE = {torch.ops.aten.div.Tensor: torch.ops.aten.div_.Tensor, torch.ops.aten.div.Scalar: torch.ops.aten.div_.Scalar}
"""The out-of-place ops of a bucket's reduction (the average's division) and their in-place twins."""


def _fresh_for(node: object, user: fx.Node) -> bool:
    """``node`` is a contiguous tensor the graph made (not an input, not a view of anything) that only ``user``
    reads: ``user`` may overwrite it."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or list(node.users) != [user] or _is_view(node):
        return False
    schema = getattr(node.target, "_schema", None)
    value = node.meta.get("val")
    return (
        schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
        and isinstance(value, torch.Tensor) and value.is_contiguous()
    )  # fmt: skip


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    """Two nodes' tensors have one dtype, shape and strides: an op from one into the other may write in place."""
    x, y = a.meta.get("val"), b.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())


def reduce_in_place(graph: fx.Graph) -> int:
    """Each bucket's reduction without the copies a functional graph spells out and a fusing compiler removes:
    a functional ``all_reduce`` clones its input before it reduces, and the average's division writes a new
    tensor. Where the input is a fresh tensor of the graph's own that nothing else reads (the bucket's ``cat``,
    the division's result), the in-place twins (``all_reduce_``, ``div_``) reuse it. For a graph that is then run
    op by op (aot_eager): Inductor fuses the ``cat`` and the division into one kernel and reinplaces the
    collective itself. Run it last: an in-place op is a barrier to the scheduling passes. Returns how many
    collectives run in place."""
    in_place = 0
    for node in [n for n in graph.nodes if _op_name(n) == "_c10d_functional::all_reduce"]:
        source = node.args[0]
        if not _fresh_for(source, node):
            continue
        node.target = torch.ops._c10d_functional.all_reduce_.default
        in_place += 1
        twin = _IN_PLACE.get(source.target)
        if twin is not None and _fresh_for(source.args[0], source) and _same_layout(source.args[0], source):
            source.target = twin
    graph.lint()
    return in_place


def schedule_reductions(graph: fx.Graph) -> tuple[int, int, int]:
    """The in-graph backward's order (Note [In-graph reduction], step 2): big gradients computed in pieces, rows
    nodes as late as they can go, each collective as early as the graph allows, optimizer step nodes last, each
    wait as late as the graph allows. Returns (slices rewritten, nodes moved, waits moved)."""
    pieces = compute_pieces_separately(graph)
    sink_rows_nodes(graph)
    sink_bucket_steps(graph)
    return pieces, launch_collectives_early(graph), sink_waits(graph)
