"""The plan agreement's entries in the last bucket's room (Note [The agreement rides a bucket]): exact sums over
the ranks, and which plans can carry them; no process group needed."""

from __future__ import annotations

import pytest
import torch

from graphddp.passes import BucketCaps, ParamSpec, plan_buckets
from graphddp.runtime.agreement_ride import AgreementRide, choose_ride, limb_bits
from graphddp.runtime.buckets import BucketSlots
from graphddp.runtime.grad_layout import dense_layout


def summed_over_ranks(ride: AgreementRide, per_rank: list[list[int]], dtype: torch.dtype, flags: list[int]) -> list[int]:
    """What each rank's ``board`` writes (``flags``: each rank's buffers flag, added on the device), summed in
    ``dtype`` as the all-reduce sums it, read back by the last rank."""
    rooms = []
    for values, flag in zip(per_rank, flags):
        passage = ride.seat(values, 9, torch.tensor([flag]))
        room = torch.empty(ride.room, dtype=dtype)
        assert ride.board(room) is passage and not passage.landed
        rooms.append(room)
    passage.land(torch.stack(rooms).sum(0))  # what the bucket's wait hands over
    return passage.sums()


@pytest.mark.parametrize("dtype, world", [(torch.float32, 2), (torch.float32, 256), (torch.float32, 1000), (torch.float64, 4096)])
@pytest.mark.parametrize("usage", [0, 5])
def test_every_entry_sums_exactly_over_the_ranks(dtype: torch.dtype, world: int, usage: int) -> None:
    g = torch.Generator().manual_seed(world)
    powers = torch.tensor([1, 2] * 4 + [1])  # tokens below 2**21 and their squares (~2**42), a count
    per_rank = [
        torch.cat([torch.randint(0, 2**21, (9,), generator=g, dtype=torch.int64) ** powers, torch.randint(0, 2, (usage,), generator=g)]).tolist()
        for _ in range(world)
    ]
    flags = torch.randint(0, 2, (world,), generator=g).tolist()
    ride = AgreementRide(0, 9, 5, dtype, world)
    expected = (torch.tensor(per_rank).sum(0) + torch.tensor([0] * 8 + [sum(flags)] + [0] * usage)).tolist()
    assert summed_over_ranks(ride, per_rank, dtype, flags) == expected


def test_no_exact_limbs_in_half_precision_and_an_empty_seat_sends_zeros() -> None:
    assert limb_bits(torch.bfloat16, 2) == limb_bits(torch.float16, 2) == 0
    assert limb_bits(torch.float32, 2) == 16 and limb_bits(torch.float32, 257) == 15
    ride = AgreementRide(0, 9, 3, torch.float32, 2)
    assert ride.room == 9 * 4 + 3
    room = torch.ones(ride.room)
    assert ride.board(room) is None and not room.any()  # nothing seated: zeros ride, nobody reads them


def slots(*numels: tuple[int, ...], dtype: torch.dtype = torch.float32) -> BucketSlots:
    """One bucket per entry of ``numels`` (its parameters' sizes), in that order."""
    specs, params, names = [], [], []
    for k, sizes in enumerate(numels):
        for j, n in enumerate(sizes):
            names.append(f"b{k}.p{j}")
            params.append(torch.nn.Parameter(torch.zeros(n, dtype=dtype)))
            specs.append(ParamSpec.of(names[-1], params[-1]))
    caps = tuple(sum(sizes) * params[0].element_size() for sizes in numels)  # each bucket closes at its cap
    plan = plan_buckets(specs, caps=BucketCaps(bucket=max(caps), first=caps[0], last=caps[-1], ramps=False, sequence=caps))
    return BucketSlots(plan, names, params, dense_layout(as_bucket_view=False, local=False), [True] * len(params))


def test_the_agreement_rides_the_last_bucket_with_room_after_its_gradients() -> None:
    buckets = slots((100,), (10, 10), (5, 5)).buckets
    ride = choose_ride(buckets, 9, 5, world_size=2, averaging=True, skips=False, device=torch.device("cpu"))
    assert ride is not None and ride.bucket_index == 2 and buckets[2].room == ride.room == 9 * 4 + 5
    assert buckets[2].carrier.numel() == 10 + ride.room and buckets[2].buffer.numel() == 10
    assert buckets[2].buffer.data_ptr() == buckets[2].carrier.data_ptr() and buckets[2].zeros().numel() == 10 + ride.room
    assert [b.room for b in buckets] == [0, 0, ride.room]


@pytest.mark.parametrize(
    "why", ["one rank", "a comm hook", "skip_all_reduce_unused_params", "bfloat16 buckets", "a lone last gradient",
            "collectives on another device"],  # fmt: skip
)
def test_no_ride_where_the_last_bucket_cannot_carry_it(why: str) -> None:
    shape = ((10, 10), (20,)) if why == "a lone last gradient" else ((10, 10),)
    buckets = slots(*shape, dtype=torch.bfloat16 if why == "bfloat16 buckets" else torch.float32).buckets
    device = torch.device("meta" if why == "collectives on another device" else "cpu")  # as a CUDA module on gloo
    ride = choose_ride(buckets, 9, 5, world_size=1 if why == "one rank" else 2, averaging=why != "a comm hook",
                       skips=why == "skip_all_reduce_unused_params", device=device)  # fmt: skip
    assert ride is None and all(b.room == 0 for b in buckets)


def test_a_passage_read_before_its_bucket_was_waited_for_waits_for_it() -> None:
    # An error in the end of backward before the last bucket's wait: the next forward's read waits for it then.
    ride = AgreementRide(0, 9, 0, torch.float32, 2)
    passage = ride.seat(list(range(9)), 9, None)
    room = torch.empty(ride.room)
    ride.board(room)
    passage.departed(lambda: passage.land(room * 2))  # the bucket's wait: two ranks with the same entries
    assert passage.sums() == [2 * v for v in range(9)]
    never = ride.seat(list(range(9)), 9, None)
    with pytest.raises(RuntimeError, match="bucket was never launched"):
        never.sums()
