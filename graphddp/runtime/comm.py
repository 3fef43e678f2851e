"""Collectives graphddp needs around the Reducer: coalesced broadcast, the cross-rank parameter check, and the
default averaging hook.

Everything goes through ``torch.distributed`` process groups; graphddp has no transport of its own. Collectives
run on the current stream, as PyTorch's C++ Reducer issues them: on CUDA the process group orders its own stream
after the current one when a collective is issued, and ``Work.wait()`` orders the current stream after the
collective (no stream of graphddp's own, no ``wait_stream`` per bucket: Note [Lean bucket path] in
``graphddp.runtime.reductions``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..passes import MiB, ParamSpec, first_difference_across

BROADCAST_CAP_BYTES = 250 * MiB
"""Tensors are broadcast in flat chunks of at most this size (PyTorch's DDP uses the same figure)."""


# -- coalesced broadcast ------------------------------------------------------------------------------------
def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup,
    cap_bytes: int = BROADCAST_CAP_BYTES,
) -> int:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (``src`` is a rank in ``group``).

    Tensors are grouped by dtype and device and flattened into chunks of at most ``cap_bytes``, so a model
    costs a few large collectives, not one per tensor. Returns the number of collectives issued.
    """
    chunks = _chunk_by_dtype_device([t for t in tensors if t.numel() > 0], cap_bytes)
    receiving = dist.get_rank(group) != src
    pending = []
    with torch.no_grad():
        for chunk in chunks:
            flat = torch.cat([t.detach().reshape(-1) for t in chunk]) if len(chunk) > 1 else chunk[0].detach().reshape(-1).clone()
            work = dist.broadcast(flat, group=group, group_src=src, async_op=True)
            pending.append((work, flat, chunk))
        for work, flat, chunk in pending:
            work.wait()
            if receiving:
                offset = 0
                for t in chunk:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
    return len(chunks)


def _chunk_by_dtype_device(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        chunks = groups.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes[key] + nbytes > cap_bytes:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [chunk for chunks in groups.values() for chunk in chunks]


# -- all ranks hold the same parameters ---------------------------------------------------------------------
class ModelMismatchError(RuntimeError, ValueError):
    """Ranks wrapped different models; raised on every rank. A ``RuntimeError`` as PyTorch's DDP raises there (a
    ``ValueError`` too, as graphddp raised before)."""


def verify_same_params(specs: Sequence[ParamSpec], *, group: dist.ProcessGroup, options: Sequence[str] = ()) -> None:
    """Check on every rank that all ranks hold the same parameters (count, names, shapes, dtypes, order), and the
    same ``options`` (lines such as ``"option find_unused_parameters=True"``: what changes the collectives).

    Two small collectives when the models agree (a digest each); on a mismatch, every rank gathers the full
    lists and raises the same ``ModelMismatchError`` naming the first differing entry and the ranks involved.
    """
    rows = [
        f"{s.name} shape={list(s.shape)} dtype={str(s.dtype).replace('torch.', '')}" + (" row-sparse" if s.row_sparse else " sparse" if s.sparse_grad else "")
        for s in specs
    ] + list(options)
    digest = hashlib.sha256("\n".join(rows).encode()).digest()
    digests = all_gather_bytes(digest, group=group)
    if all(d == digests[0] for d in digests):
        return
    all_rows = [b.decode().split("\n") for b in all_gather_bytes("\n".join(rows).encode(), group=group)]
    raise ModelMismatchError(_describe_mismatch(all_rows, dist.get_rank(group)))


def _bytes_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group`` takes the tensors that carry bytes: the current CUDA device on NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_gather_bytes(data: bytes, *, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's ``data``, in rank order: two tensor collectives (lengths, then padded payloads).

    Used instead of ``all_gather_object``, which needs numpy and pickles.
    """
    device = _bytes_device(group)
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    payload = torch.zeros(longest, dtype=torch.uint8, device=device)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else payload[:0]
    payloads = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(payloads, payload, group=group)
    return [bytes(p[: int(n.item())].cpu().tolist()) for p, n in zip(payloads, lengths)]


def broadcast_bytes(data: bytes, *, src: int, group: dist.ProcessGroup) -> bytes:
    """``src``'s ``data`` on every rank (what the others pass is ignored): two tensor collectives (length, then
    payload), as ``all_gather_bytes``, instead of ``broadcast_object_list``."""
    device = _bytes_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=src)
    payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank(group) == src and data:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, group=group, group_src=src)
    return bytes(payload.cpu().tolist())


def _describe_mismatch(all_rows: list[list[str]], rank: int) -> str:
    found = first_difference_across(all_rows, "<missing>")
    assert found is not None, "digests differ but the rows are equal"
    i, entries = found
    differing = [r for r, e in enumerate(entries) if e != entries[0]]
    counts = ", ".join(f"rank {r}: {len(rows)}" for r, rows in enumerate(all_rows))
    return (
        f"[rank {rank}] graphddp.DDP: the ranks wrapped different models. First difference at entry #{i}: "
        f"rank 0 has {entries[0]!r}, "
        + "; ".join(f"rank {r} has {entries[r]!r}" for r in differing)
        + f" (entries per rank: {counts}). Build the same model on every rank (same parameters and buffers, same "
        "order, shapes, dtypes and requires_grad) and pass the same DDP options before wrapping it in graphddp.DDP."
    )


# -- the default communication hook -------------------------------------------------------------------------
class AverageState:
    """State of graphddp's default hook: the group, and what to divide the sum by in this iteration.

    The Reducer scales gradients by ``1 / divisor`` while copying them into the bucket (as PyTorch's C++
    Reducer does), or the backend averages (Note [Averaged on the wire] in ``graphddp.runtime.reductions``), so it
    sets ``divisor`` to 1 and the hook makes no extra pass over the buffer.
    """

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        self.divisor: int = dist.get_world_size(process_group)


def average_allreduce_hook(state: AverageState, bucket: Any) -> torch.futures.Future:
    """Sum the bucket over ranks and divide by ``state.divisor`` (the world size, or the non-joined ranks), as a
    comm hook: a future of the averaged buffer."""
    return average_all_reduce(state, bucket.buffer()).get_future().then(lambda fut: fut.value()[0])


def average_all_reduce(state: AverageState, buffer: torch.Tensor) -> dist.Work:
    """The averaging all-reduce of ``buffer``, in place; the collective's ``Work``."""
    if state.divisor != 1:
        buffer.div_(state.divisor)  # before the sum, as PyTorch does, so low precision sums do not overflow
    return dist.all_reduce(buffer, group=state.process_group, async_op=True)


def collective_device(group: dist.ProcessGroup, param_device: torch.device) -> torch.device:
    """Where small bookkeeping collectives run: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if param_device.type == "cuda" and dist.get_backend(group) != "gloo":
        return param_device
    return torch.device("cpu")
