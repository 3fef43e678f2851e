"""The bucket plan: which gradients travel together, in which order.

Note [Bucket plan]
~~~~~~~~~~~~~~~~~~
Gradients become ready during backward in roughly the reverse of the order in which the forward pass used the
parameters. A *bucket* is a group of gradients that is all-reduced as one flat tensor the moment its last
gradient is ready, so the network works while backward is still computing the earlier layers.

``plan_buckets`` takes the parameters **in the order their gradients are expected to become ready** and walks
them once, filling buckets up to a byte cap:

* one open bucket per (dtype, device): a flat buffer holds a single dtype on a single device;
* the first bucket of each (dtype, device) is capped at ``first_bucket_cap_bytes`` (small, so the first
  all-reduce starts early), the others at ``bucket_cap_bytes``;
* a bucket is closed *before* a gradient would push it over its cap, so no bucket is larger than its cap unless
  a single parameter alone is (it then gets a bucket of its own); PyTorch's Reducer instead closes a bucket
  *after* it crossed the cap, which lets buckets overshoot by up to one parameter;
* buckets are numbered by the ready position of their first parameter: bucket 0 becomes ready first.

Every rank must build the very same plan; ``BucketPlan.fingerprint`` is a digest of its content (parameter
names, shapes, dtypes and their grouping) that ranks compare instead of the plan itself.

The eager path calls ``plan_buckets`` with parameters in reverse registration order and again, once, with the
order observed in the first backward. The compile backend calls it with the order derived from the captured
graph. Both hand the resulting ``BucketPlan`` to the same Reducer: one plan, one code path.

This module is pure data: it imports nothing from ``torch.distributed`` and no graphddp runtime module.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

MiB = 1024 * 1024

__all__ = ["MiB", "ParamSpec", "Bucket", "BucketPlan", "plan_buckets", "plan_bucket_groups", "caps_from_mb"]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one trainable parameter."""

    name: str
    """Fully qualified name, as ``module.named_parameters()`` gives it."""
    shape: tuple[int, ...]
    """Shape of the parameter (and of its gradient)."""
    dtype: torch.dtype
    """Gradient dtype; a bucket holds one dtype only."""
    device: str
    """Device as a string (``"cpu"``, ``"cuda:0"``); a bucket lives on one device only."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> ParamSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype, str(tensor.device))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One group of gradients reduced together, laid out in ``params`` order in one flat buffer."""

    index: int
    """Launch position: bucket ``k`` is always launched before bucket ``k + 1`` on every rank."""
    params: tuple[ParamSpec, ...]
    """Parameters in the order of their slices in the flat buffer (their expected ready order)."""
    cap_bytes: int
    """The cap this bucket was filled up to."""

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> str:
        return self.params[0].device

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The bucket plan shared by the graph split and the Reducer (see Note [Bucket plan])."""

    buckets: tuple[Bucket, ...]
    """Buckets in launch order."""
    bucket_cap_bytes: int
    """Cap of every bucket but the first of each dtype/device."""
    first_bucket_cap_bytes: int
    """Cap of the first bucket of each dtype/device."""
    source: str = "registration"
    """Where the order came from: ``"registration"``, ``"ready-order"`` or ``"graph"`` (for logs and dumps)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for k, bucket in enumerate(self.buckets):
            assert bucket.index == k, f"bucket {bucket.index} stored at position {k}"
            assert bucket.params, f"bucket {k} is empty"
            for p in bucket.params:
                assert p.name not in seen, f"parameter {p.name} planned twice"
                assert (p.dtype, p.device) == (bucket.dtype, bucket.device), f"bucket {k} mixes dtypes/devices"
                seen.add(p.name)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(name for b in self.buckets for name in b.names)

    def bucket_of(self, name: str) -> int:
        for b in self.buckets:
            if name in b.names:
                return b.index
        raise KeyError(f"parameter {name!r} is in no bucket of this plan")

    @property
    def fingerprint(self) -> str:
        """A short digest of the grouping; equal on every rank that built the same plan."""
        h = hashlib.sha256()
        for b in self.buckets:
            h.update(f"[{b.index}]".encode())
            for p in b.params:
                h.update(f"{p.name}:{p.shape}:{p.dtype}:{p.device};".encode())
        return h.hexdigest()[:16]

    def describe(self) -> list[tuple[str, str]]:
        """One ``(bucket, content)`` line per bucket, used to name the first differing bucket between ranks."""
        return [(f"bucket {b.index}", ", ".join(f"{p.name}{list(p.shape)}" for p in b.params)) for b in self.buckets]

    def table_rows(self) -> list[list[object]]:
        """Rows for a tabulate table: index, bytes, parameter count, dtype, device, names."""
        return [
            [b.index, b.nbytes, len(b.params), str(b.dtype).replace("torch.", ""), b.device, ", ".join(b.names)]
            for b in self.buckets
        ]

    TABLE_HEADERS = ("bucket", "bytes", "params", "dtype", "device", "parameters")


def caps_from_mb(bucket_cap_mb: float, first_bucket_cap_mb: float) -> tuple[int, int]:
    """Validate caps given in MiB (as users write them) and return them in bytes."""
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number of MiB, got {type(value).__name__} {value!r}")
        if not value > 0:
            raise ValueError(f"{name} must be > 0 MiB, got {value!r}")
    return max(1, int(bucket_cap_mb * MiB)), max(1, int(first_bucket_cap_mb * MiB))


def plan_buckets(
    params_in_ready_order: Iterable[ParamSpec],
    *,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
    source: str = "registration",
) -> BucketPlan:
    """Group parameters into buckets, see Note [Bucket plan].

    ``params_in_ready_order`` lists the parameters in the order their gradients are expected to be ready.
    """
    return plan_bucket_groups(
        [[p] for p in params_in_ready_order],
        bucket_cap_bytes=bucket_cap_bytes,
        first_bucket_cap_bytes=first_bucket_cap_bytes,
        source=source,
    )


def plan_bucket_groups(
    groups_in_ready_order: Iterable[Sequence[ParamSpec]],
    *,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
    source: str = "graph",
) -> BucketPlan:
    """Like ``plan_buckets``, but the parameters of a group always share a bucket (per dtype and device).

    The graph planner groups parameters by the node that first uses them: they become ready together, so
    separating them could not make either bucket ready earlier.
    """
    groups = [list(g) for g in groups_in_ready_order if g]
    if bucket_cap_bytes <= 0 or first_bucket_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got {bucket_cap_bytes} and {first_bucket_cap_bytes} bytes")
    names = [p.name for g in groups for p in g]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"parameter {dup!r} appears twice in the planning order")

    position = {name: i for i, name in enumerate(names)}
    open_buckets: dict[tuple[torch.dtype, str], list[ParamSpec]] = {}
    open_caps: dict[tuple[torch.dtype, str], int] = {}
    open_bytes: dict[tuple[torch.dtype, str], int] = {}
    closed: list[tuple[list[ParamSpec], int]] = []

    for group in groups:
        by_key: dict[tuple[torch.dtype, str], list[ParamSpec]] = {}
        for p in group:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        for key, members in by_key.items():
            nbytes = sum(p.nbytes for p in members)
            bucket = open_buckets.setdefault(key, [])
            cap = open_caps.setdefault(key, first_bucket_cap_bytes)
            if bucket and open_bytes[key] + nbytes > cap:
                closed.append((bucket, cap))
                bucket = open_buckets[key] = []
                open_caps[key] = bucket_cap_bytes
            bucket.extend(members)
            open_bytes[key] = (open_bytes[key] if len(bucket) > len(members) else 0) + nbytes
    closed.extend((bucket, open_caps[key]) for key, bucket in open_buckets.items() if bucket)

    # Bucket 0 is the one whose first gradient is ready first (see the Note).
    closed.sort(key=lambda item: position[item[0][0].name])
    buckets = tuple(Bucket(k, tuple(bucket), cap) for k, (bucket, cap) in enumerate(closed))
    return BucketPlan(buckets, bucket_cap_bytes, first_bucket_cap_bytes, source)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def first_difference_across(rows_per_rank: Sequence[Sequence[Any]], missing: Any) -> tuple[int, list[Any]] | None:
    """Where the ranks' lists first disagree: ``(index, every rank's entry there)``, ``missing`` standing for the
    entry of a list that is too short; None when all lists are equal. Used to name the first differing parameter
    or bucket in errors raised on every rank."""
    longest = max((len(rows) for rows in rows_per_rank), default=0)
    for i in range(longest):
        entries = [rows[i] if i < len(rows) else missing for rows in rows_per_rank]
        if any(e != entries[0] for e in entries):
            return i, entries
    return None


def compose_plans(
    graph_plans_in_forward_order: Sequence[BucketPlan],
    rest_in_ready_order: Sequence[ParamSpec],
    *,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
) -> BucketPlan:
    """One plan for a forward that runs several captured graphs (graph breaks).

    Graphs run in forward order and their backwards in reverse, so the composite takes their buckets last graph
    first, renumbered. A parameter several graphs use (a weight tied across a graph break) belongs to the graph
    that runs first in forward: its gradient completes only when that graph's backward has run (Note [Earliest
    use]); later graphs drop it. Parameters no graph covers (used eagerly) follow, planned from
    ``rest_in_ready_order``.
    """
    claimed: set[str] = set()
    kept: list[list[tuple[tuple[ParamSpec, ...], int]]] = []
    for plan in graph_plans_in_forward_order:
        buckets = [(tuple(p for p in b.params if p.name not in claimed), b.cap_bytes) for b in plan.buckets]
        kept.append([(params, cap) for params, cap in buckets if params])
        claimed |= set(plan.param_names)
    rest = [p for p in rest_in_ready_order if p.name not in claimed]
    tail = plan_buckets(rest, bucket_cap_bytes=bucket_cap_bytes, first_bucket_cap_bytes=first_bucket_cap_bytes) if rest else None
    groups = [group for graph in reversed(kept) for group in graph]
    groups += [(b.params, b.cap_bytes) for b in tail.buckets] if tail else []
    buckets = tuple(Bucket(k, params, cap) for k, (params, cap) in enumerate(groups))
    return BucketPlan(buckets, bucket_cap_bytes, first_bucket_cap_bytes, source="graph")
