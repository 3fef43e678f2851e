"""The link's calibration (Note [Step cost model]) on spawned gloo ranks."""

from __future__ import annotations

from ranks import run_on_ranks


def calibrate(rank: int, world: int) -> tuple[float, float, bool, dict[int, int]]:
    import collections

    import torch.distributed as dist

    from graphddp.runtime import calibration

    group = dist.new_group(list(range(world)))  # a group of its own: the pool's ranks may have measured WORLD already

    timed: collections.Counter[int] = collections.Counter()
    fit = calibration.fit_link

    def counting_fit(samples, world):  # the samples each rank fits, counted by size
        timed.update(n for n, _ in samples)
        return fit(samples, world)

    calibration.fit_link = counting_fit
    try:
        link = calibration.link_of(group, sizes=(1 << 18, 1 << 12, 1 << 22), repeats=2)
    finally:
        calibration.fit_link = fit
    again = calibration.link_of(group)  # cached: no collective, the same object
    dist.destroy_process_group(group)
    return link.latency_s, link.seconds_per_byte, again is link, dict(timed)


def test_the_link_is_calibrated_once_and_every_rank_holds_rank_0s_fit() -> None:
    results = run_on_ranks(calibrate, 2)
    assert len({(a, b) for a, b, *_ in results}) == 1, results  # the same model on every rank
    assert all(cached for _, _, cached, _ in results)
    latency, per_byte, *_ = results[0]
    assert per_byte >= 0, results  # timings on a loaded CPU are noisy
    # Note [Fitting the link]: the latency is the smallest all-reduce's time less its bytes (4 KiB: microseconds),
    # never 0 as the line's intercept could be; that size is timed LATENCY_REPEATS times, the others `repeats`.
    assert latency > 0, results
    from graphddp.runtime.calibration import LATENCY_REPEATS

    assert all(timed == {1 << 12: LATENCY_REPEATS, 1 << 18: 2, 1 << 22: 2} for *_, timed in results), results


def collectives_of_a_second_auto_ddp(rank: int, world: int) -> tuple[int, int]:
    """(collectives of the first ``bucket_cap_mb="auto"`` construction's calibration, of a second one) on a group
    of its own (the link, compute rates and communication's CPU cost are measured once per group)."""
    import torch
    import torch.distributed as dist

    import graphddp

    group = dist.new_group(list(range(world)))
    counted = {"n": 0}
    originals = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "broadcast")}

    def counting(fn):
        def call(*args, **kwargs):
            counted["n"] += 1
            return fn(*args, **kwargs)

        return call

    counts = []
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(fn))
        for _ in range(2):
            counted["n"] = 0
            graphddp.DDP(torch.nn.Linear(8, 8), process_group=group, bucket_cap_mb="auto", init_sync=False)
            counts.append(counted["n"])
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    dist.destroy_process_group(group)
    return counts[0], counts[1]


def test_a_second_auto_ddp_on_a_group_measures_nothing() -> None:
    for first, second in run_on_ranks(collectives_of_a_second_auto_ddp, 2):
        assert first > 10, first  # the link series, the compute rates, the CPU cost of communication
        assert second == 0, second


def communication_cpu_cost(rank: int, world: int) -> tuple[float, list[float]]:
    """(the figure this rank holds, the figure each rank measured itself, by rank)."""
    import torch
    import torch.distributed as dist

    from graphddp.runtime import calibration

    raw: list[float] = []
    rule = calibration.displaced_seconds_per_byte

    def kept(alone, beside, sent):  # noqa: ANN001 - the rule's own arguments, passed through
        raw.append(rule(alone, beside, sent))
        return raw[-1]

    idle = calibration.idle_seconds
    calibration.displaced_seconds_per_byte = kept
    calibration.idle_seconds = lambda *args, **kwargs: None  # charge all of gloo's CPU, also on a host with idle CPUs
    try:
        cost = calibration.cpu_cost_of_communication(window_s=0.05, repeats=2)
    finally:
        calibration.displaced_seconds_per_byte = rule
        calibration.idle_seconds = idle
    assert len(raw) == 1, raw  # measured once, by this rank
    mine = torch.tensor(raw, dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return cost, [float(t[0]) for t in everyone]


def test_the_cpu_cost_of_communication_is_rank_0s_figure_on_every_rank() -> None:
    # What each rank measured differs (clocks, load); what each holds is rank 0's, so choices made from it agree.
    results = run_on_ranks(communication_cpu_cost, 2)
    held = {cost for cost, _ in results}
    assert len(held) == 1, results
    (cost,) = held
    measured = results[0][1]
    assert all(figure > 0.0 for figure in measured), results  # sending costs gloo's threads some CPU on every rank
    assert cost == measured[0], results


def launch_costs(rank: int, world: int) -> tuple[float, float, list[float], float]:
    """(the launch this rank's compute rates hold, what they charge a bucket, what each rank measured itself, the
    launch held for a group of this rank alone)."""
    import torch
    import torch.distributed as dist

    from graphddp.runtime import calibration

    raw: list[float] = []
    measure = calibration.launch_seconds

    def kept(*args, **kwargs):  # noqa: ANN002, ANN003 - the measurement's own arguments, passed through
        raw.append(measure(*args, **kwargs))
        return raw[-1]

    calibration.launch_seconds = kept
    try:
        rates = calibration.compute_rates(dist.new_group(list(range(world))))
        alone, _ = dist.new_subgroups(group_size=1)  # one rank launches no collective: nothing to measure
        solo = calibration.compute_rates(alone).launch_s
    finally:
        calibration.launch_seconds = measure
    assert len(raw) == 1, raw  # measured once, by this rank
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor(raw, dtype=torch.float64))
    return rates.launch_s, rates.reducer_seconds_per_bucket, [float(t[0]) for t in everyone], solo


def test_a_collectives_launch_is_measured_on_the_ranks_and_charged_to_every_bucket() -> None:
    from graphddp.passes.cost import REDUCER_CALLS_PER_BUCKET

    results = run_on_ranks(launch_costs, 2)
    assert len({(launch, per_bucket) for launch, per_bucket, *_ in results}) == 1, results  # rank 0's, on every rank
    launch, per_bucket, measured, _ = results[0]
    assert all(solo == 0.0 for *_, solo in results), results
    assert all(figure > 0.0 for figure in measured), results  # issuing a collective takes its caller some time
    assert launch == measured[0], results
    # Each bucket pays its launch beside the Reducer's Python (which is what it paid alone before).
    assert per_bucket > launch > 0.0 and per_bucket - launch < REDUCER_CALLS_PER_BUCKET * 1e-5, results


def random_state_moved_by_an_auto_ddp(rank: int, world: int) -> bool:
    """Whether building a DDP with automatic caps (every calibration, on a group of its own) moved the global random
    state a script draws from next."""
    import torch
    import torch.distributed as dist

    import graphddp

    group = dist.new_group(list(range(world)))
    model = torch.nn.Linear(8, 8)  # its initialisation draws from the state, as it should
    before = torch.get_rng_state()
    graphddp.DDP(model, process_group=group, bucket_cap_mb="auto", init_sync=False)
    return not torch.equal(before, torch.get_rng_state())


def test_calibrating_at_construction_leaves_the_scripts_random_state_alone() -> None:
    # PyTorch's DDP draws no random number; a drop-in that times kernels on random operands must not either.
    assert run_on_ranks(random_state_moved_by_an_auto_ddp, 2) == [False, False]
