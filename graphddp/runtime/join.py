"""Uneven inputs (``DistributedDataParallel.join``): how many ranks take part in an iteration."""

from __future__ import annotations

from typing import Any


class ActiveRanks:
    """How many ranks take part in this iteration: the world, or (under ``join``) the non-joined ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._divide_by_initial_world_size = True
        self._work: Any = None

    def divide_by_initial_world_size(self, value: bool) -> None:
        """Under ``join``: average over the initial world size (True, the default) or over the ranks still
        training (``DistributedDataParallel.join(divide_by_initial_world_size=...)``)."""
        self._divide_by_initial_world_size = value

    def set_join_work(self, work: Any) -> None:
        """The all-reduce of ones that ``Join.notify_join_context`` issued this iteration."""
        self._work = work

    def count(self) -> int:
        if self._work is None:
            return self.world_size
        self._work.wait()
        return int(self._work.result()[0].item())

    def divisor(self) -> int:
        """What the sum of the gradients is divided by this iteration."""
        return self.world_size if self._divide_by_initial_world_size else self.count()

    def clear(self) -> None:
        self._work = None
