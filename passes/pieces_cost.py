"""The step cost model's inputs for a graph reduced in-graph, its big gradients sent in pieces.

``step_inputs_from_split`` (``graphddp.passes.caps_choice``) gives one all-reduce per bucket, launched when the
segment that completes it has run. In-graph, a bucket with ``pieces`` (Note [Gradient pieces] in
``passes/plan.py``) goes as one all-reduce per block of rows, and each block's matmul is computed first in its
segment (weight gradients first: ``launch_collectives_early``), so block ``j`` goes once the rows up to it exist:

    segment p, T seconds, big gradient's matmul W of them:  | block 0 | block 1 | ... | block n-1 | the rest (T - W) |

with block ``j`` taking ``W * rows_j / R`` (its share of the gradient's ``R`` rows). The bucket's other
gradients (a bias) go with block 0, as ``_average_in_pieces`` sends them (``Bucket.piece_bytes``); the copy of
block 0 into the gradient (``Bucket.assembled_bytes``; the other blocks are written in place, Note [Blocks written
in place]; every block where a compressing hook casts them for the wire, ``Bucket.blocks_in_place``) runs after
the last block's wait (``StepInputs.tail_per_bucket_s``); an optimizer stepping in backward
steps each block's rows after its wait and the bucket's other parameters with the last block's (its seconds shared
out by ``Bucket.piece_stepped_bytes``, Note [Steps by rows]; all with the last block where a compressing hook casts
the blocks for the wire: they are not written in place). Every block goes on its bucket's channel (``StepInputs.bucket_of``).
A whole bucket the same segment completes counts as complete with the first block after it in plan order (a
bucket before a big one: with its block 0, which is late by that block's matmul; one after every big one: at
the segment's end). ``PiecesLayout`` says which bucket and segment of the plan each of the model's nodes stands
for.

Pure: no ``torch.distributed``, no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from .cost import StepInputs
from .graph_cost import ComputeRates
from .graph_params import GraphParam
from .plan import BucketPlan


@dataclasses.dataclass(frozen=True)
class PiecesLayout:
    """Which of the plan's segments and buckets each node of the expanded inputs stands for."""

    segment_of: tuple[tuple[int, int | None], ...]
    """Per expanded segment (backward order): the plan's segment (backward order) it is a part of, and the block
    of that segment's big gradient it computes (None: the segment's other work, or the whole segment)."""
    bucket_of: tuple[tuple[int, int | None], ...]
    """Per expanded all-reduce: the plan's bucket, and its block (None: the bucket goes whole)."""

    def name(self, node: str) -> str:
        """A node of the cost model's timeline (``segment i``, ``bucket k``, ``tail k``, ``step k``) named after
        the plan's segment (backward order) and bucket, with the block where there is one."""
        kind, _, index = node.partition(" ")
        if kind == "segment":
            segment, block = self.segment_of[int(index)]
            return f"segment {segment}" + ("" if block is None else f" block {block}")
        if kind in ("bucket", "tail", "step") and index.isdigit():
            bucket, block = self.bucket_of[int(index)]
            return f"{kind} {bucket}" + ("" if block is None else f" block {block}")
        return node


def estimated_in_pieces(
    inputs: StepInputs,
    plan: BucketPlan,
    params: Sequence[GraphParam],
    node_seconds: Mapping[str, float],
    rates: ComputeRates,
    *,
    wire: torch.dtype | None = None,
) -> tuple[StepInputs, PiecesLayout]:
    """``step_inputs_in_pieces`` for a captured graph whose compute is estimated (``node_seconds`` at ``rates``,
    ``graphddp.passes.graph_cost``): the blocks' matmuls from ``matmul_seconds_of_pieces``; copying the first block
    in, each byte read and written once at the rates' elementwise speed (the bench calibrates it instead,
    ``graphddp.runtime.calibration.assembly_seconds_per_byte``). What ``graphddp inspect`` predicts and the
    automatic caps search (Note [Automatic caps])."""
    matmuls = matmul_seconds_of_pieces(plan, params, node_seconds)
    return step_inputs_in_pieces(inputs, plan, matmuls, assembly_seconds_per_byte=2 / rates.bytes_per_s, wire=wire)


def matmul_seconds_of_pieces(plan: BucketPlan, params: Sequence[GraphParam], node_seconds: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """``step_inputs_in_pieces``'s ``matmul_seconds`` for a captured graph: a big gradient's matmul costs what its
    forward uses with the weight cost (the same flops; ``node_seconds``, ``graphddp.passes.graph_cost``); a tied
    table's part is its own matmul's, not the lookup's."""
    uses = {p.spec.name: p.uses for p in params}
    seconds = {}
    for bucket in plan.buckets:
        if bucket.pieces is not None:
            big = bucket.params[bucket.pieces[0]]
            nodes = [big.part] if big.part else [u.node for u in uses[big.name] if u.differentiable]
            seconds[big.key] = sum(node_seconds.get(n, 0.0) for n in nodes)
    return seconds


def step_inputs_in_pieces(
    inputs: StepInputs,
    plan: BucketPlan,
    matmul_seconds: Mapping[tuple[str, str], float],
    *,
    assembly_seconds_per_byte: float = 0.0,
    wire: torch.dtype | None = None,
) -> tuple[StepInputs, PiecesLayout]:
    """``inputs`` (one all-reduce per bucket of ``plan``, as ``step_inputs_from_split`` makes them) with each
    bucket that has ``pieces`` sent block by block (see the module docstring). ``matmul_seconds``: the backward
    seconds of the matmul that makes each big gradient, by ``ParamSpec.key`` (a tied table's part is its own
    matmul's), capped at its segment's; ``assembly_seconds_per_byte``: the copy after the last block's wait
    (``graphddp.runtime.calibration.assembly_seconds_per_byte``); ``wire``: the dtype a compressing comm hook
    sends in, whose bytes ``inputs`` already count (``Bucket.blocks_in_place`` says which blocks are copied back)."""
    if len(inputs.bucket_bytes) != len(plan.buckets) or inputs.bucket_of:
        raise ValueError(
            f"step_inputs_in_pieces takes one all-reduce per bucket of the plan ({len(plan.buckets)}), got "
            f"{len(inputs.bucket_bytes)}{' in blocks already' if inputs.bucket_of else ''}: build them from the "
            "plan's split (step_inputs_from_split)"
        )
    missing = [b.params[b.pieces[0]].label for b in plan.buckets if b.pieces and b.params[b.pieces[0]].key not in matmul_seconds]
    if missing:
        raise ValueError(f"no matmul seconds for {', '.join(missing)}: give each gradient sent in pieces its matmul's")
    segments: list[float] = []
    segment_of: list[tuple[int, int | None]] = []
    bytes_, completed, sends, tails, steps = [], [], [], [], []  # per all-reduce; sends: (bucket, block)
    old_steps, old_tails = inputs.step_per_bucket_s, inputs.tail_per_bucket_s
    for p, seconds in enumerate(inputs.segment_backward_s):
        here = [b for b in plan.buckets if inputs.completed_by[b.index] == p]
        big = [b for b in here if b.pieces is not None]
        left = seconds
        current = len(segments)  # a whole bucket before a big one completes with the next block (its block 0)
        for bucket in here:
            step = old_steps[bucket.index] if old_steps else 0.0
            tail = old_tails[bucket.index] if old_tails else 0.0
            if bucket.pieces is None:
                later_big = any(b.index > bucket.index for b in big)
                completed.append(current if later_big else None)  # None: with the segment's rest, filled below
                bytes_.append(inputs.bucket_bytes[bucket.index])
                sends.append((bucket.index, None))
                tails.append(tail)
                steps.append(step)
                continue
            position, rows = bucket.pieces
            gradient = bucket.params[position]
            total = sum(rows)
            matmul = min(matmul_seconds[gradient.key], left)
            left -= matmul
            scale = inputs.bucket_bytes[bucket.index] / bucket.nbytes  # as sent (a compressing hook's wire dtype)
            in_place = bucket.blocks_in_place(wire)
            sizes = [round(n * scale) for n in bucket.piece_bytes]
            assembled = bucket.assembled_bytes if in_place else gradient.nbytes
            # each block's rows stepped once it is in (Note [Steps by rows]), where not cast for the wire
            stepped = bucket.piece_stepped_bytes(blocks_in_place=in_place)
            for j, (r, size) in enumerate(zip(rows, sizes)):
                segments.append(matmul * r / total)
                segment_of.append((p, j))
                current = len(segments) - 1
                completed.append(current)
                bytes_.append(size)
                sends.append((bucket.index, j))
                last = j == len(rows) - 1
                tails.append(tail + assembly_seconds_per_byte * assembled if last else 0.0)
                steps.append(step * stepped[j] / sum(stepped) if sum(stepped) else 0.0)
        segments.append(left)  # the segment's other work (all of it, without a big gradient)
        segment_of.append((p, None))
        completed = [len(segments) - 1 if c is None else c for c in completed]
    expanded = dataclasses.replace(
        inputs,
        segment_backward_s=tuple(segments),
        bucket_bytes=tuple(bytes_),
        completed_by=tuple(completed),
        step_per_bucket_s=tuple(steps) if old_steps else (),
        tail_per_bucket_s=tuple(tails) if old_tails or any(tails) else (),
        bucket_of=tuple(b for b, _ in sends),
    )
    return expanded, PiecesLayout(tuple(segment_of), tuple(sends))
