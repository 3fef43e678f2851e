"""The bucket plan as pure data: no process group, no processes."""

from __future__ import annotations

import pytest
import torch

from graphddp.passes import BucketCaps, MiB, ParamSpec, plan_bucket_groups, plan_buckets


def spec(name: str, numel: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ParamSpec:
    return ParamSpec(name, (numel,), dtype, device)


def plan(params, bucket_cap: int, first_cap: int, last_cap: int | None = None):
    """``last_cap=None``: no ramps (PyTorch's layout), so the first-bucket and cap rules are seen alone."""
    caps = BucketCaps(bucket=bucket_cap, first=first_cap, last=last_cap or first_cap, ramps=last_cap is not None)
    return plan_buckets(params, caps=caps)


def test_fills_buckets_in_the_given_order_up_to_the_caps() -> None:
    params = [spec(f"p{i}", 100) for i in range(10)]  # 400 bytes each
    p = plan(params, bucket_cap=1200, first_cap=400)
    assert [b.names for b in p.buckets] == [
        ("p0",),
        ("p1", "p2", "p3"),
        ("p4", "p5", "p6"),
        ("p7", "p8", "p9"),
    ]
    assert [b.nbytes for b in p.buckets] == [400, 1200, 1200, 1200]
    assert p.param_names == tuple(f"p{i}" for i in range(10))


SIZES = [7, 300, 5, 5, 900, 1, 64, 64, 64, 2000, 3]  # elements: 28, 1200, 20, 20, 3600, ... bytes


def test_with_ramps_no_bucket_exceeds_its_cap_unless_one_parameter_alone_does() -> None:
    p = plan([spec(f"p{i}", n) for i, n in enumerate(SIZES)], bucket_cap=1024, first_cap=256, last_cap=1024)
    for b in p.buckets:
        if len(b.params) > 1:
            assert b.nbytes <= b.cap_bytes, (b.index, b.nbytes, b.cap_bytes)
    assert p.buckets[0].cap_bytes == 256
    lonely = [b for b in p.buckets if b.nbytes > b.cap_bytes]
    # 1200 bytes over the 256-byte first cap, then 3600 and 8000 over 1024: each alone in its bucket
    assert [b.names for b in lonely] == [("p1",), ("p4",), ("p9",)]


def test_without_ramps_a_bucket_closes_at_its_cap_or_more_as_pytorchs_reducer_closes_it() -> None:
    # PyTorch's rule (``BucketCaps.closes_over_cap``): add a gradient, close once the bucket holds the cap or more.
    p = plan([spec(f"p{i}", n) for i, n in enumerate(SIZES)], bucket_cap=1024, first_cap=256)
    assert [b.names for b in p.buckets] == [
        ("p0", "p1"),  # 28 + 1200 >= 256
        ("p2", "p3", "p4"),  # 20 + 20 + 3600 >= 1024
        ("p5", "p6", "p7", "p8", "p9"),  # 4 + 3 * 256 + 8000 >= 1024
        ("p10",),  # what is left
    ]
    for b in p.buckets[:-1]:
        assert b.nbytes >= b.cap_bytes > b.nbytes - b.params[-1].nbytes


def test_one_bucket_per_dtype_and_device_numbered_by_first_ready_parameter() -> None:
    params = [
        spec("a", 10),
        spec("b", 10, torch.float64),
        spec("c", 10),
        spec("d", 10, torch.float64),
        spec("e", 10, device="meta"),
    ]
    p = plan(params, bucket_cap=MiB, first_cap=MiB)
    assert [b.names for b in p.buckets] == [("a", "c"), ("b", "d"), ("e",)]
    assert [b.dtype for b in p.buckets] == [torch.float32, torch.float64, torch.float32]
    assert [b.index for b in p.buckets] == [0, 1, 2]


def test_fingerprint_is_stable_and_sensitive_to_grouping_shapes_and_dtypes() -> None:
    params = [spec(f"p{i}", 100) for i in range(6)]
    a = plan(params, 800, 400)
    assert a.fingerprint == plan(list(params), 800, 400).fingerprint
    assert a.fingerprint != plan(params, 1200, 400).fingerprint  # other grouping
    assert a.fingerprint != plan(params[::-1], 800, 400).fingerprint  # other order
    changed = params[:-1] + [spec("p5", 101)]
    assert a.fingerprint != plan(changed, 800, 400).fingerprint
    retyped = params[:-1] + [spec("p5", 100, torch.float64)]
    assert a.fingerprint != plan(retyped, 800, 400).fingerprint


def test_any_combination_of_caps_works() -> None:
    params = [spec(f"p{i}", 1000) for i in range(8)]  # 4000 bytes each
    for bucket_cap, first_cap in [(1, 1), (1, MiB), (MiB, 1), (4000, 8000), (int(0.25 * MiB), MiB)]:
        p = plan(params, bucket_cap, first_cap)
        assert p.param_names == tuple(f"p{i}" for i in range(8))
    assert len(plan(params, 1, 1).buckets) == 8  # one bucket per parameter
    assert len(plan(params, MiB, MiB).buckets) == 1


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        plan([spec("a", 1), spec("a", 1)], 10, 10)
    with pytest.raises(ValueError, match="BucketCaps.bucket must be > 0"):
        plan([spec("a", 1)], 0, 10)
    with pytest.raises(TypeError, match="BucketCaps.last must be a whole number"):
        BucketCaps(last=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="caps must be a BucketCaps"):
        plan_buckets([spec("a", 1)], caps=(25, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number of MiB >= 0"):
        BucketCaps.from_mb(-0.5, 1, 1)
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be a finite number of MiB >= 0"):
        BucketCaps.from_mb(25, -1, 1)
    with pytest.raises(ValueError, match="last_bucket_cap_mb must be a finite number of MiB >= 0"):
        BucketCaps.from_mb(25, 1, float("nan"))
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number"):
        BucketCaps.from_mb("25", 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be a finite number"):
        BucketCaps.from_mb(25, float("inf"), 1)
    assert BucketCaps.from_mb(0.25, 1, 2) == BucketCaps(bucket=MiB // 4, first=MiB, last=2 * MiB)


def test_caps_ramp_up_after_the_first_bucket_and_down_to_the_last() -> None:
    params = [spec(f"p{i}", 100) for i in range(20)]  # 400 bytes each
    p = plan(params, bucket_cap=3200, first_cap=400, last_cap=400)
    # First 400; then the tail from the end: 400, 800, 1600; then the head ramp 800, 1600 and the middle 3200
    # on what is left (Note [Bucket ramps]).
    assert [len(b.params) for b in p.buckets] == [1, 2, 4, 6, 4, 2, 1]
    assert [b.cap_bytes for b in p.buckets] == [400, 800, 1600, 3200, 1600, 800, 400]
    assert p.param_names == tuple(f"p{i}" for i in range(20))
    assert list(BucketCaps(bucket=3200, first=400, last=400).ramp(400)) == [400, 800, 1600]


def test_a_large_parameter_ready_last_goes_alone_and_the_ramp_goes_on_before_it() -> None:
    # A tied embedding: ready last and larger than any tail cap.
    params = [spec(f"block{i}", 100) for i in range(8)] + [spec("wte", 1000)]
    p = plan(params, bucket_cap=2400, first_cap=400, last_cap=400)
    assert [b.names for b in p.buckets][-3:] == [("block2", "block3", "block4", "block5"), ("block6", "block7"), ("wte",)]
    assert [b.cap_bytes for b in p.buckets][-3:] == [1600, 800, 400]


def test_without_ramps_the_layout_is_pytorchs_and_large_caps_end_a_ramp_early() -> None:
    params = [spec(f"p{i}", 100) for i in range(10)]
    pytorch_like = [("p0",), ("p1", "p2", "p3"), ("p4", "p5", "p6"), ("p7", "p8", "p9")]
    assert [b.names for b in plan(params, 1200, 400).buckets] == pytorch_like
    # last >= bucket: no tail ramp, the head ramp alone (400, then 800, then 1200 to the end).
    assert [len(b.params) for b in plan(params, 1200, 400, last_cap=1200).buckets] == [1, 2, 3, 3, 1]
    # 2 * first >= bucket: no head ramp, the tail alone (then 800, 400 at the end).
    assert [len(b.params) for b in plan(params, 1200, 800, last_cap=400).buckets] == [2, 3, 2, 2, 1]
    with pytest.raises(TypeError, match="ramps must be True or False"):
        BucketCaps(ramps=1)  # type: ignore[arg-type]


def test_plan_contract_holds_for_random_sizes_caps_groups_and_lanes() -> None:
    gen = torch.Generator().manual_seed(0)
    lanes = [(torch.float32, "cpu"), (torch.float64, "cpu"), (torch.float32, "meta")]
    for trial in range(300):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        sizes = torch.randint(1, 600, (n,), generator=gen).tolist()
        lane_of = torch.randint(0, 3 if trial % 2 else 1, (n,), generator=gen).tolist()
        bucket, first, last = (int(v) for v in torch.randint(4, 3000, (3,), generator=gen))
        params = [spec(f"p{i}", s, *lanes[k]) for i, (s, k) in enumerate(zip(sizes, lane_of))]
        cuts = sorted(set(torch.randint(1, n + 1, (n // 3,), generator=gen).tolist()) | {n})
        groups = [params[a:b] for a, b in zip([0, *cuts], cuts)]  # a node's parameters, kept together
        p = plan_bucket_groups(groups, caps=BucketCaps(bucket=bucket, first=first, last=last))
        assert sorted(p.param_names) == sorted(f"p{i}" for i in range(n)), trial  # every parameter once
        firsts = [min(int(q.name[1:]) for q in b.params) for b in p.buckets]
        assert firsts == sorted(firsts), trial  # numbered by the ready position of their first parameter
        for group in groups:
            for lane in {(q.dtype, q.device) for q in group}:
                assert len({p.bucket_of(q.name) for q in group if (q.dtype, q.device) == lane}) == 1, trial
        for lane in lanes:
            mine = [b for b in p.buckets if (b.dtype, b.device) == lane]
            if not mine:
                continue
            assert mine[0].cap_bytes == first, trial  # the lane's first bucket
            for b in mine[1:]:
                assert b.cap_bytes <= bucket, (trial, b)
            for b in mine:  # over its cap only when one node's parameters alone are
                assert b.nbytes <= b.cap_bytes or any(set(b.names) <= {q.name for q in g} for g in groups), (trial, b)
            caps = [b.cap_bytes for b in mine[1:]]
            top = caps.index(max(caps)) if caps else 0  # ramps: up to the middle, then down
            assert caps[:top] == sorted(caps[:top]) and caps[top:] == sorted(caps[top:], reverse=True), (trial, caps)
            if len(mine) > 2 and bucket > 2 * last:
                assert mine[-1].cap_bytes == last, trial  # the tail ramp ends at the last cap


def test_bucket_of_and_table() -> None:
    p = plan([spec("w", 10), spec("b", 2)], bucket_cap=MiB, first_cap=40)
    assert p.bucket_of("w") == 0 and p.bucket_of("b") == 1
    with pytest.raises(KeyError, match="no bucket"):
        p.bucket_of("nope")
    rows = p.table_rows()
    assert rows[0][:3] == [0, 40, 1] and rows[1][:3] == [1, 8, 1]
