"""The link's calibration (Note [Step cost model]) on spawned gloo ranks."""

from __future__ import annotations

from ranks import run_on_ranks


def calibrate(rank: int, world: int) -> tuple[float, float, bool]:
    from graphddp.runtime.calibration import link_of

    link = link_of(sizes=(1 << 12, 1 << 18, 1 << 22), repeats=2)
    again = link_of()  # cached: no collective, the same object
    return link.latency_s, link.seconds_per_byte, again is link


def test_the_link_is_calibrated_once_and_every_rank_holds_rank_0s_fit() -> None:
    results = run_on_ranks(calibrate, 2)
    assert len({(a, b) for a, b, _ in results}) == 1, results  # the same model on every rank
    assert all(cached for *_, cached in results)
    latency, per_byte, _ = results[0]
    assert latency >= 0 and per_byte >= 0 and latency + per_byte > 0, results  # timings on a loaded CPU are noisy
