"""What communication costs a CPU rank's compute (Note [What communication costs a CPU rank] in
``graphddp/runtime/calibration.py``): the rule that turns timed windows into a figure, and the window's clocks."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from graphddp.runtime.calibration import (
    Window,
    displaced_seconds_per_byte,
    gloo_threads_cpu_s,
    idle_seconds,
    measure_window,
)

MB = 1_000_000


def windows(*gloo_ms: float, idle: float | None = 0.0, others_ms: float = 90.0) -> list[Window]:
    """Windows in which gloo's threads ran ``gloo_ms`` each (and every thread but the caller's ``others_ms``)."""
    return [Window(gloo_cpu_s=ms / 1e3, others_cpu_s=others_ms / 1e3, idle_cpus=idle) for ms in gloo_ms]


def test_the_figure_is_gloos_extra_cpu_per_byte_sent() -> None:
    # 4 MB sent; gloo's threads ran 4.3 ms beside the loop, 0.3 ms beside it alone (the intra-op pool's 90 ms in
    # every window is not gloo's).
    cost = displaced_seconds_per_byte(windows(0.3, 0.3), windows(4.3, 4.3), 4 * MB)
    assert cost == pytest.approx(1e-9)


def test_a_window_without_gloos_threads_makes_every_window_count_every_thread() -> None:
    # Two measures never mix: one window that could not read gloo's threads sends all of them to the other one.
    alone = windows(0.3, 0.3, others_ms=90.0)
    beside = [*windows(4.3, others_ms=96.0), Window(gloo_cpu_s=None, others_cpu_s=96.0e-3, idle_cpus=0.0)]
    assert displaced_seconds_per_byte(alone, beside, 4 * MB) == pytest.approx(6e-3 / (4 * MB))


def test_one_disturbed_window_does_not_set_the_figure() -> None:
    # The median of three (construction's windows): a window in which something else ran on gloo's threads moves
    # it by nothing.
    cost = displaced_seconds_per_byte(windows(0.3, 0.3, 0.3), windows(4.3, 4.3, 40.0), 4 * MB)
    assert cost == pytest.approx(1e-9)


def test_a_host_with_a_whole_idle_processor_loses_no_compute_to_the_collectives() -> None:
    assert displaced_seconds_per_byte(windows(0.3, 0.3, idle=1.0), windows(4.3, 4.3), 4 * MB) == 0.0
    assert displaced_seconds_per_byte(windows(0.3, 0.3, idle=6.5), windows(4.3, 4.3), 4 * MB) == 0.0


def test_the_least_idle_window_alone_gives_the_share_the_host_lacks() -> None:
    # One rank's loop ended early in a window and it waited at the barrier: that window's idle time is not the
    # host's; the least idle window is (0.25 of a processor idle: 0.75 of gloo's CPU displaces compute).
    alone = [Window(gloo_cpu_s=0.3e-3, others_cpu_s=0.3e-3, idle_cpus=idle) for idle in (0.25, 0.9)]
    assert displaced_seconds_per_byte(alone, windows(4.3, 4.3), 4 * MB) == pytest.approx(0.75e-9)


def test_without_proc_stat_the_whole_cpu_is_charged() -> None:
    assert displaced_seconds_per_byte(windows(0.3, idle=None), windows(4.3), 4 * MB) == pytest.approx(1e-9)


def test_less_cpu_beside_than_alone_is_no_cost_not_a_negative_one() -> None:
    assert displaced_seconds_per_byte(windows(2.0), windows(1.0), 4 * MB) == 0.0


@pytest.mark.parametrize(("alone", "beside", "sent", "match"), [
    ([], windows(1.0), MB, "at least one window alone"),
    (windows(1.0), [], MB, "at least one window alone"),
    (windows(1.0), windows(2.0), 0, "needs bytes sent, got 0"),
])  # fmt: skip
def test_bad_input_says_what_is_missing(alone: list[Window], beside: list[Window], sent: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        displaced_seconds_per_byte(alone, beside, sent)


def test_idle_seconds_reads_idle_and_iowait_of_the_processors_asked_for(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  100 0 50 700 30 0 5 0 0 0\n"
        "cpu0 50 0 25 350 15 0 2 0 0 0\n"
        "cpu1 50 0 25 350 15 0 3 0 0 0\n"
        "intr 1 2 3\n"
    )
    ticks = os.sysconf("SC_CLK_TCK")
    assert idle_seconds(str(stat), cpus=[1]) == pytest.approx(365 / ticks)  # idle + iowait of cpu1 alone
    assert idle_seconds(str(stat), cpus=[0, 1]) == pytest.approx(730 / ticks)
    assert idle_seconds(str(stat), cpus=[7]) is None  # a processor /proc/stat does not show
    assert idle_seconds(str(tmp_path / "missing")) is None
    (tmp_path / "odd").write_text("cpu0 x y z a b c\n")
    assert idle_seconds(str(tmp_path / "odd"), cpus=[0]) is None


def test_gloo_threads_are_found_by_name(tmp_path) -> None:
    threads = [
        ("10", "python", 9_000_000_000), ("11", "pt_gloo_runloop", 2_000_000_000), ("12", "gloo_tcp_loop", 500_000_000)
    ]
    for tid, name, ns in threads:
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "comm").write_text(name + "\n")
        (tmp_path / tid / "schedstat").write_text(f"{ns} 1000 7\n")
    assert gloo_threads_cpu_s(str(tmp_path)) == pytest.approx(2.5)  # the interpreter's own thread is not gloo's
    (tmp_path / "11" / "comm").write_text("python\n")
    (tmp_path / "12" / "comm").write_text("python\n")
    assert gloo_threads_cpu_s(str(tmp_path)) is None  # no gloo thread: the caller falls back
    assert gloo_threads_cpu_s(str(tmp_path / "missing")) is None


class _BurningWork:
    """A collective's stand-in: a thread, started at once and named ``name`` (as gloo's workers exist and are named
    before any collective), that burns ``seconds`` of CPU once ``go`` is called; ``wait`` returns when it has,
    ``close`` ends the thread."""

    def __init__(self, seconds: float, name: str | None = None) -> None:
        self._go, self._named, self._done, self._closed = (threading.Event() for _ in range(4))
        self._thread = threading.Thread(target=self._burn, args=(seconds, name))
        self._thread.start()
        self._named.wait()

    def _burn(self, seconds: float, name: str | None) -> None:
        if name is not None:
            ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/self/task/*/comm shows
        self._named.set()
        self._go.wait()
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        self._done.set()
        self._closed.wait()  # alive after its work, as gloo's threads are: its CPU stays in /proc/self/task

    def go(self) -> _BurningWork:
        self._go.set()
        return self

    def wait(self) -> None:
        self._done.wait()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()


def _loop() -> None:
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass


def test_a_window_counts_every_thread_but_the_callers_as_the_fallback_measure() -> None:
    alone = measure_window(_loop, lambda: [])
    work = _BurningWork(0.04)
    beside = measure_window(_loop, lambda: [work.go()])
    work.close()
    assert alone.others_cpu_s < 0.02, alone  # the caller's 50 ms of loop are not in it
    assert beside.others_cpu_s >= 0.04 - 0.005, beside  # the worker's 40 ms are (clock granularity aside)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="names threads with prctl, reads schedstat")
def test_with_gloo_threads_a_window_counts_theirs_and_not_the_intra_op_pools() -> None:
    # A thread named as gloo names its workers burns 40 ms; an unnamed one beside it (as the intra-op pool's
    # threads run the loop) burns 60 ms, which is compute, not communication.
    works = [_BurningWork(0.04, name="pt_gloo_test"), _BurningWork(0.06)]
    beside = measure_window(_loop, lambda: [w.go() for w in works])
    for w in works:
        w.close()
    assert beside.gloo_cpu_s is not None and 0.04 - 0.005 <= beside.gloo_cpu_s < 0.06, beside
