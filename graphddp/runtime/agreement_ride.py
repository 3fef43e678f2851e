"""The plan agreement riding the last bucket's all-reduce, so an iteration issues no collective of graphddp's own.

Note [The agreement rides a bucket]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The plan agreement (Note [Plan agreement] in ``graphddp.runtime.plans``) is a few int64 entries summed over the
ranks once per synchronised iteration: the proposal's tokens, the count of training forwards, an abandoned
backward, buffers received from another forward, and, where the usage policy counts (by default, to turn a
gradient missing on one rank into the same error on every rank), one entry per parameter. PyTorch's DDP issues
nothing of the kind, and on its own the agreement costs every iteration one more collective: a round trip and a
gloo worker's wake-up, about 2.5 ms of a launch-bound two-rank step on the development VM (``docs/benchmarks.md``,
session 31). Coalescing it with a bucket (``allreduce_coalesced``) costs gloo more than the two collectives do
(session 32). It is issued just before the last bucket's collective, once every gradient is in; so where the last
bucket can carry it, it travels *inside* that bucket's all-reduce:

* **room**: the last bucket's flat buffer has ``AgreementRide.room`` elements after its gradients
  (``FlatBucket.carrier``); the gradients' views and the copies in and out stay ``FlatBucket.buffer``, the
  gradients only;
* **limbs**: each of the agreement's own entries (all >= 0; squares of forward counts reach 2**40) is written as
  limbs of ``b`` bits, ``entry = sum_k limb_k * 2**(b*k)``, each a float of the bucket's dtype, encoded on the host
  (nine entries: a few dozen Python operations) and copied into the room at once, the buffers' flag added on the
  device; the all-reduce sums each limb over the ``n`` ranks exactly while ``n * (2**b - 1) < 2**mantissa``
  (``limb_bits``: 16 bits up to 256 ranks in float32), and each entry's sum is put back together from the summed
  limbs on the host, where the agreement was always read. A usage entry is 0 or 1 per rank, so it goes as one
  element. graphddp's averaging all-reduce only sums (the gradients were scaled while copied in), so the room is
  not scaled;
* **which bucket** (``choose_ride``): the last, where every rank always reduces its flat buffer with graphddp's
  averaging all-reduce: two or more whole gradients in its own dtype (never a lone gradient reduced where it
  lies), float32 or float64, no comm hook (a hook may compress, or never see the room), nothing skipped
  (``skip_all_reduce_unused_params``), more than one rank. A function of the plan and the DDP's options: every
  rank makes the same room, and every stand-in of that bucket (a drain's or a joined rank's zeros) comes with it.
  The bucket must live where the DDP's collectives run (a CUDA module on gloo carries nothing). Elsewhere the
  agreement stays an all-reduce of its own, as before;
* **when**: unchanged: issued as the last bucket launches (``Launcher.before_last``), read once that bucket has been
  waited for (the end of backward, a drain, a joined rank's shadow); a read before that (an error in the end of
  backward before the last wait) waits for the bucket then (``Passage.sums``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .reductions import AveragedInFlight, AveragingReduction

MANTISSA_BITS = {torch.float32: 24, torch.float64: 53}
"""Bits of a float's significand: integers up to ``2**bits`` are exact (the dtypes a bucket may carry limbs in)."""


def limb_bits(dtype: torch.dtype, world_size: int) -> int:
    """Bits per limb so that ``world_size`` limbs of the largest value sum exactly in ``dtype`` (0: none do)."""
    if dtype not in MANTISSA_BITS:
        return 0
    bits = min(16, MANTISSA_BITS[dtype] - math.ceil(math.log2(world_size)))
    return bits if bits >= 4 else 0


class Passage:
    """One agreement's trip in the riding bucket: its entries, on the host, until they come back summed."""

    def __init__(self, values: list[int], flag: torch.Tensor | None, decode: Callable[[list[float], int], list[int]]) -> None:
        self.values = values
        """The agreement's own entries, then its usage entries (each >= 0; a usage entry 0 or 1)."""
        self.flag = flag
        """Added to the last own entry on the device (the buffers' flag: no host sync for a GPU's), or None."""
        self._decode = decode
        self._room: torch.Tensor | None = None  # the summed room, once the bucket was waited for
        self._wait: Callable[[], Any] | None = None  # the bucket's wait, once launched

    def departed(self, wait: Callable[[], Any]) -> None:
        self._wait = wait

    def land(self, room: torch.Tensor) -> None:
        """The bucket was waited for: ``room`` holds the sums over the ranks (kept: a drain's zeros go away)."""
        self._room, self._wait = room.clone(), None

    @property
    def landed(self) -> bool:
        return self._room is not None

    def sums(self) -> list[int]:
        """The entries' sums over the ranks (one host read). Waits for the bucket if nothing has yet (an error in
        the end of backward before it)."""
        if self._room is None:
            if self._wait is None:
                raise RuntimeError(
                    "graphddp: the plan agreement's bucket was never launched (Note [The agreement rides a bucket] in "
                    "graphddp/runtime/agreement_ride.py); a backward stopped before its last bucket and was not drained."
                )
            self._wait()
        assert self._room is not None
        return self._decode(self._room.tolist(), len(self.values))


class AgreementRide:
    """Room for the agreement's entries in the last bucket's all-reduce (Note [The agreement rides a bucket]):
    ``own`` entries as limbs, then up to ``counts`` usage entries, one element each."""

    def __init__(self, bucket_index: int, own: int, counts: int, dtype: torch.dtype, world_size: int) -> None:
        self.bucket_index = bucket_index
        self._bits = limb_bits(dtype, world_size)
        assert self._bits, f"no exact limbs in {dtype} for {world_size} ranks"
        self._limbs = -(-63 // self._bits)  # an int64 >= 0 has 63 bits
        self._own, self._counts = own, counts
        self.room = own * self._limbs + counts
        """Elements after the riding bucket's gradients."""
        self._seat: Passage | None = None

    def seat(self, values: list[int], own: int, flag: torch.Tensor | None) -> Passage:
        """This iteration's agreement rides the bucket's next launch: ``own`` entries of its own, then none or
        ``counts`` usage entries; ``flag`` added to the last own entry on the device."""
        assert self._seat is None, "one agreement per launch"
        assert own == self._own and len(values) - own in (0, self._counts), (own, len(values), self._counts)
        self._seat = Passage(values, flag, self._decode)
        return self._seat

    def board(self, room: torch.Tensor) -> Passage | None:
        """The bucket launches: the seated entries into ``room`` (its carrier's last ``room`` elements), encoded on
        the host and copied once; None when nothing is seated (the room goes as zeros)."""
        if self._seat is None:
            room.zero_()
            return None
        passage, self._seat = self._seat, None
        mask, own = (1 << self._bits) - 1, passage.values[: self._own]
        limbs = [(v >> (self._bits * k)) & mask for v in own for k in range(self._limbs)]
        counts = passage.values[self._own :]
        room.copy_(torch.tensor([*limbs, *counts, *[0] * (self._counts - len(counts))], dtype=room.dtype))
        if passage.flag is not None:  # 0 or 1: the last own entry's lowest limb
            at = (self._own - 1) * self._limbs
            room[at : at + 1].add_(passage.flag)
        return passage

    def _decode(self, room: list[float], entries: int) -> list[int]:
        summed = [round(v) for v in room]  # each limb's, each count's exact sum over the ranks
        own, limbs = [], self._limbs
        for e in range(self._own):  # loops, not generators: a generator is a Python call per entry, every step
            value = 0
            for k in range(limbs):
                value += summed[e * limbs + k] << (self._bits * k)
            own.append(value)
        return [*own, *summed[self._own * limbs :][: entries - self._own]]


def choose_ride(
    buckets: Sequence[Any], own: int, counts: int, *, world_size: int, averaging: bool, skips: bool, device: torch.device
) -> AgreementRide | None:
    """The ride of the agreement in the last of ``buckets`` (the plan's ``FlatBucket``s in launch order, none
    allocated yet), with room for ``own`` entries and ``counts`` usage entries, or None where it cannot ride
    (Note [The agreement rides a bucket]). ``averaging``: graphddp's own all-reduce reduces the dense buckets (no
    comm hook); ``skips``: buckets of never-used parameters may skip theirs; ``device``: where the DDP's
    collectives run (a CUDA module on gloo runs them on the CPU: its buckets carry nothing)."""
    if world_size == 1 or not averaging or skips or not buckets:
        return None
    last = buckets[-1]
    spec = last.spec
    if not (last.plain and len(last.params) >= 2 and limb_bits(last.dtype, world_size) and last.device == device
            and not (spec.sparse_grad or any(p.row_sparse for p in spec.params))):  # fmt: skip
        return None
    ride = AgreementRide(last.index, own, counts, last.dtype, world_size)
    last.make_room(ride.room)
    return ride


def with_ride(
    reductions: list[Any], ride: AgreementRide | None, group_of: Callable[[int], dist.ProcessGroup]
) -> list[Any]:
    """``reductions`` (one per bucket), the riding bucket's graphddp's averaging all-reduce now over its carrier."""
    if ride is not None:
        assert isinstance(reductions[ride.bucket_index], AveragingReduction), reductions[ride.bucket_index]
        reductions = [*reductions]
        reductions[ride.bucket_index] = RidingReduction(group_of(ride.bucket_index), ride)
    return reductions


class RidingReduction(AveragingReduction):
    """The riding bucket's averaging all-reduce over its carrier: its gradients and the agreement's room."""

    def __init__(self, group: dist.ProcessGroup, ride: AgreementRide) -> None:
        super().__init__(group)
        self._ride = ride

    def start(self, bucket: Any, buffer: torch.Tensor, is_last: bool) -> RiddenInFlight:
        # ``buffer``: the bucket's own (its carrier holds the room), or a stand-in's zeros, made with the room
        carrier = buffer if buffer.numel() > bucket.numel else bucket.carrier
        room = carrier[bucket.numel :]
        passage = self._ride.board(room)
        alias = carrier.view(carrier.shape)  # ``lend``: Note [A collective holds no Python object]
        gradients = buffer if carrier is not buffer else carrier[: bucket.numel]
        in_flight = RiddenInFlight(self._allreduce([alias], self._options), gradients, alias, room, passage)
        if passage is not None:
            passage.departed(in_flight.wait)
        return in_flight


class RiddenInFlight(AveragedInFlight):
    """The riding bucket's all-reduce: waited for, it hands the agreement its summed room (once)."""

    def __init__(self, work: Any, gradients: torch.Tensor, alias: torch.Tensor, room: torch.Tensor, passage: Passage | None) -> None:
        super().__init__(work, gradients, alias)
        self._room, self._passage = room, passage

    def wait(self) -> torch.Tensor:
        gradients = super().wait()
        if self._passage is not None:
            passage, self._passage = self._passage, None
            passage.land(self._room)
        return gradients
