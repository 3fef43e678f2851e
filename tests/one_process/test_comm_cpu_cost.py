"""What communication costs a CPU rank's compute (Note [What communication costs a CPU rank] in
``graphddp/runtime/calibration.py``): the rule that turns timed windows into a figure, and the window's clocks."""

from __future__ import annotations

import threading
import time

import pytest

from graphddp.runtime.calibration import Window, displaced_seconds_per_byte, host_idle_seconds, measure_window

MB = 1_000_000


def windows(*others_ms: float, idle: float | None = 0.0) -> list[Window]:
    return [Window(others_cpu_s=ms / 1e3, idle_cpus=idle) for ms in others_ms]


def test_the_figure_is_the_other_threads_extra_cpu_per_byte_sent() -> None:
    # 4 MB sent; gloo's threads ran 4 ms beside the loop where the process's other threads ran 0.3 ms alone.
    cost = displaced_seconds_per_byte(windows(0.3, 0.3), windows(4.3, 4.3), 4 * MB)
    assert cost == pytest.approx(1e-9)


def test_one_disturbed_window_does_not_set_the_figure() -> None:
    # The median of three: a window in which something else ran on the process's threads moves it by nothing.
    cost = displaced_seconds_per_byte(windows(0.3, 0.3, 0.3), windows(4.3, 4.3, 40.0), 4 * MB)
    assert cost == pytest.approx(1e-9)


def test_a_host_with_a_whole_idle_processor_loses_no_compute_to_the_collectives() -> None:
    assert displaced_seconds_per_byte(windows(0.3, 0.3, idle=1.0), windows(4.3, 4.3), 4 * MB) == 0.0
    assert displaced_seconds_per_byte(windows(0.3, 0.3, idle=6.5), windows(4.3, 4.3), 4 * MB) == 0.0


def test_the_least_idle_window_alone_gives_the_share_the_host_lacks() -> None:
    # One rank's loop ended early in a window and it waited at the barrier: that window's idle time is not the
    # host's; the least idle window is (0.25 of a processor idle: 0.75 of gloo's CPU displaces compute).
    alone = [Window(others_cpu_s=0.3e-3, idle_cpus=0.25), Window(others_cpu_s=0.3e-3, idle_cpus=0.9)]
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


def test_host_idle_seconds_reads_idle_and_iowait(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 700 30 0 5 0 0 0\ncpu0 50 0 25 350 15 0 2 0 0 0\n")
    ticks = 730 / host_idle_seconds(str(stat))
    assert ticks == pytest.approx(round(ticks)) and ticks >= 1  # idle + iowait, in the clock's ticks per second
    assert host_idle_seconds(str(tmp_path / "missing")) is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert host_idle_seconds(str(tmp_path / "odd")) is None


class _BurningWork:
    """A collective's stand-in: a thread that burns ``seconds`` of CPU; ``wait`` joins it."""

    def __init__(self, seconds: float) -> None:
        self._thread = threading.Thread(target=self._burn, args=(seconds,))
        self._thread.start()

    @staticmethod
    def _burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def wait(self) -> None:
        self._thread.join()


def test_a_window_counts_the_cpu_of_other_threads_and_not_the_callers() -> None:
    def compute() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    alone = measure_window(compute, lambda: [])
    beside = measure_window(compute, lambda: [_BurningWork(0.04)])
    assert alone.others_cpu_s < 0.02, alone  # the caller's 50 ms of loop are not in it
    assert beside.others_cpu_s >= 0.04 - 0.005, beside  # the worker's 40 ms are (clock granularity aside)
