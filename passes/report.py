"""What a plan and a split look like to a person or a program: table rows and a JSON-ready record.

Pure data in, pure data out; the runtime (``graphddp.compiler.dump``, ``graphddp inspect``) renders the rows with
tabulate and writes the record as ``plan.json``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .plan import BucketPlan, dtype_name
from .split import GraphSplit, is_symbolic

if TYPE_CHECKING:
    import sympy

BUCKET_HEADERS = ("bucket", "bytes", "params", "segment", "extended", "parameters")
SEGMENT_HEADERS = ("segment", "buckets", "nodes", "param bytes", "inbound activation bytes", "extended")


def segment_of_buckets(split: GraphSplit | None) -> dict[int, int]:
    return {} if split is None else {k: s.index for s in split.segments for k in s.buckets}


def bucket_rows(plan: BucketPlan, split: GraphSplit | None) -> list[list[Any]]:
    """One row per bucket: index, bytes, parameter count, segment, whether that segment was extended, names."""
    segment = segment_of_buckets(split)
    extended = {s.index for s in split.segments if s.extended} if split is not None else set()
    return [
        [b.index, b.nbytes, len(b.params), segment.get(b.index, "-"), segment.get(b.index) in extended, ", ".join(b.names)]
        for b in plan.buckets
    ]


def segment_rows(split: GraphSplit) -> list[list[Any]]:
    return [
        [s.index, ", ".join(map(str, s.buckets)) or "-", s.nodes, s.param_bytes, _bytes(s.inbound_bytes), s.extended]
        for s in split.segments
    ]


def plan_record(plan: BucketPlan, split: GraphSplit | None, *, graph: str, versions: dict[str, str]) -> dict[str, Any]:
    """``plan.json``: buckets with parameter names, dtypes and bytes; segments; boundary bytes; fingerprint."""
    segment = segment_of_buckets(split)
    return {
        "graph": graph,
        "fingerprint": plan.fingerprint,
        "source": plan.source,
        "caps": dataclasses.asdict(plan.caps),
        "buckets": [
            {
                "index": b.index,
                "bytes": b.nbytes,
                "dtype": dtype_name(b.dtype),
                "device": b.device,
                "segment": segment.get(b.index),
                "row_sparse": b.row_sparse,
                "in_graph_pieces": None if b.pieces is None else {
                    "param": b.params[b.pieces[0]].name, "rows": list(b.pieces[1]), "blocks": b.blocks_layout,
                },
                "params": [
                    {"name": p.name, "part": p.part, "shape": list(p.shape), "dtype": dtype_name(p.dtype), "bytes": p.nbytes}
                    for p in b.params
                ],
            }
            for b in plan.buckets
        ],
        "segments": []
        if split is None
        else [
            {
                "index": s.index,
                "buckets": list(s.buckets),
                "nodes": s.nodes,
                "param_bytes": s.param_bytes,
                "inbound_activation_bytes": _bytes(s.inbound_bytes),
                "extended": s.extended,
            }
            for s in split.segments
        ],
        "taps": [] if split is None else [dataclasses.asdict(t) for t in split.taps],
        "versions": dict(versions),
    }


def _bytes(value: int | sympy.Expr) -> int | str:
    """Concrete byte counts stay numbers; symbolic ones (dynamic shapes) become their expression, e.g. ``256*s0``."""
    if is_symbolic(value):
        return int(value) if value.is_number else str(value)
    return value
