"""Runtime statistics for ``_get_ddp_logging_data()``, sampled as PyTorch's DDP logger samples them.

PyTorch's C++ logger times the first ten synchronised iterations and every ``sample_rate``-th after them (100 by
default, ``_set_ddp_runtime_logging_sample_rate``), and at the forward of a sampled iteration publishes the previous
iteration's figures, with ``iteration`` set to the count of synchronised forwards before it. graphddp records the
same six instants of every synchronised iteration (a clock read each, no call per gradient or per bucket):

    forward start ─ forward end ─ backward start (first hook) ─ comm start (first bucket complete)
                  ─ backward end (end of backward) ─ comm end (every bucket awaited)

and derives PyTorch's fields from them, in nanoseconds: ``forward_compute_time``, ``backward_compute_time``,
``backward_comm_time``, ``backward_compute_comm_overlap_time`` (communication while backward still computed), their
running averages (``avg_...``), and the host-side instants (``..._start``/``..._end``, ns since the epoch).
"""

from __future__ import annotations

import time
from typing import Any

INSTANTS = ("forward_start", "forward_end", "backward_start", "comm_start", "backward_end", "comm_end")
DEFAULT_SAMPLE_RATE = 100
"""PyTorch's ``kDDPRuntimeLoggingSampleRate``."""


class RuntimeStats:
    """The instants of the running iteration and what the last sampled one published (see the module docstring)."""

    def __init__(self) -> None:
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0
        """Synchronised forwards so far (PyTorch's ``num_iterations_``)."""
        self._now: dict[str, int] = {}
        self._samples = 0
        self._sums = dict.fromkeys(("forward_compute_time", "backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time"), 0)
        self.published: dict[str, Any] = {}

    def set_sample_rate(self, rate: int) -> None:
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"DDP runtime logging sample rate should be >= 1, got {rate!r}")  # PyTorch's check
        self.sample_rate = rate

    def forward_started(self) -> None:
        """A synchronised forward begins: publish the last iteration if this one is sampled, then start anew."""
        n = self.iterations
        if n > 0 and (n <= 10 or n % self.sample_rate == 0) and len(self._now) == len(INSTANTS):
            self._publish(n)
        self.iterations += 1
        self._now = {"forward_start": time.time_ns()}

    def mark(self, instant: str) -> None:
        """The first time ``instant`` happens in this iteration (later ones keep the first)."""
        if instant not in self._now and self._now:
            self._now[instant] = time.time_ns()

    def _publish(self, iteration: int) -> None:
        t = self._now
        figures = {
            "forward_compute_time": t["forward_end"] - t["forward_start"],
            "backward_compute_time": t["backward_end"] - t["backward_start"],
            "backward_comm_time": t["comm_end"] - t["comm_start"],
            "backward_compute_comm_overlap_time": max(0, t["backward_end"] - t["comm_start"]),
        }
        figures = {k: max(v, 1) if k != "backward_compute_comm_overlap_time" else v for k, v in figures.items()}
        figures["backward_compute_comm_overlap_time"] = min(
            figures["backward_compute_comm_overlap_time"], figures["backward_compute_time"], figures["backward_comm_time"]
        )
        self._samples += 1
        for k, v in figures.items():
            self._sums[k] += v
        self.published = {
            "iteration": iteration,
            **figures,
            **{f"avg_{k}": s // self._samples for k, s in self._sums.items()},
            "forward_compute_time_start": t["forward_start"],
            "backward_compute_time_start": t["backward_start"],
            "backward_compute_time_end": t["backward_end"],
            "backward_comm_time_start": t["comm_start"],
            "backward_comm_time_end": t["comm_end"],
        }
