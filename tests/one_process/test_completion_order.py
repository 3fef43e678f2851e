"""``Launcher.reduced_as_completed`` (Note [Optimizer overlap]): with an optimizer stepping in backward, the end of
backward takes each bucket as its reduction completes, the lowest index first among those done; in index order
where a collective is still to be issued."""

from __future__ import annotations

import types

import torch

from graphddp.runtime import launcher as launcher_module
from graphddp.runtime.launcher import ChainedLaunch, EagerLaunch, Launcher
from graphddp.runtime.trace import NullEvents


class Clock:
    """Fake time: ``sleep`` advances it, and each reduction is done from its own instant on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


class FakeInFlight:
    pending_commit = False
    outcome = None
    future = None

    def __init__(self, clock: Clock, done_at: float, waited: list[int], index: int) -> None:
        self.clock, self.done_at, self.waited, self.index = clock, done_at, waited, index

    def commit(self) -> None:
        pass

    def done(self) -> bool:
        return self.clock.now >= self.done_at

    def wait(self) -> torch.Tensor:
        self.clock.now = max(self.clock.now, self.done_at)  # a blocking wait lasts until it is done
        self.waited.append(self.index)
        return torch.zeros(1)


def launched(done_at: list[float], policy) -> tuple[Launcher, Clock, list[int]]:
    clock, waited = Clock(), []
    buckets = []
    for i, t in enumerate(done_at):
        b = types.SimpleNamespace(index=i, complete=True, started=True)
        b.in_flight = FakeInFlight(clock, t, waited, i)
        buckets.append(b)
    reductions = [types.SimpleNamespace(divides_by=1)] * len(buckets)  # stand-ins: these buckets are already in flight
    return Launcher(buckets, reductions, policy, NullEvents()), clock, waited


def test_buckets_come_as_their_reductions_complete(monkeypatch) -> None:
    launcher, clock, waited = launched([0.0, 0.010, 0.004, 0.004], EagerLaunch())
    monkeypatch.setattr(launcher_module.time, "sleep", clock.sleep)
    order = [bucket.index for bucket, _ in launcher.reduced_as_completed()]
    assert order == [0, 2, 3, 1]  # 2 and 3 finished before 1: stepped in 1's shadow, the lower index first
    assert waited == order
    assert clock.sleeps >= 8 and clock.now < 0.010 + 2 * launcher_module.POLL_S  # looked again, never much late


def test_one_bucket_left_is_waited_for_not_polled(monkeypatch) -> None:
    launcher, clock, _ = launched([0.0, 5.0], EagerLaunch())
    monkeypatch.setattr(launcher_module.time, "sleep", clock.sleep)
    assert [b.index for b, _ in launcher.reduced_as_completed()] == [0, 1]
    assert clock.sleeps == 0


def test_a_hook_that_chains_collectives_keeps_the_index_order(monkeypatch) -> None:
    launcher, clock, waited = launched([0.0, 0.010, 0.004], ChainedLaunch())
    monkeypatch.setattr(launcher_module.time, "sleep", clock.sleep)
    assert [b.index for b, _ in launcher.reduced_as_completed()] == [0, 1, 2] == waited
