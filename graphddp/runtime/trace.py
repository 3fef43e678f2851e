"""Recorded events of the Reducer: what happened, in which order, on this rank.

Tests prove ordering claims (bucket k launched before ...) with these records, never with timings; the
benchmark draws its timelines from them. The default ``NullEvents`` records nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol


class Events(Protocol):
    """Where the Reducer and the backend record events: ``EventLog``, ``NullEvents``, or a test's own."""

    recording: bool

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None: ...


@dataclasses.dataclass(frozen=True)
class Event:
    seq: int
    """Position in this rank's record: the order things happened in."""
    kind: str
    """``ready`` (a gradient reached its bucket), ``launch`` (a bucket's collective started), ``done`` (its future
    completed), ``wait`` (its result was awaited), ``written`` (its averages are in ``.grad``), ``finalize`` (end of
    backward), ``segment_backward`` (a compiled
    segment's backward starts), or anything a test or benchmark records itself."""
    bucket: int | None = None
    param: str | None = None
    t_ns: int = 0
    """``time.perf_counter_ns()`` when recorded; for timelines only, never for ordering."""


class EventLog:
    """Records every event, in order."""

    recording = True

    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        self.events.append(Event(len(self.events), kind, bucket, param, time.perf_counter_ns()))

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def clear(self) -> None:
        self.events.clear()


class NullEvents:
    """Records nothing (the default)."""

    recording = False

    def record(self, kind: str, bucket: int | None = None, param: str | None = None) -> None:
        pass
