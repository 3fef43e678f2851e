"""What frameworks call on PyTorch's C++ Reducer through ``ddp.reducer``: ``TorchReducerSurface``, a mixin of
graphddp's ``Reducer`` (as ``graphddp.torch_compat.TorchDDPSurface`` is of the DDP).

Lightning's manual optimization calls ``model.reducer._rebuild_buckets()`` and ``model.reducer.prepare_for_backward
(outputs)`` after the DDP's forward, and ``_delay_all_reduce()`` after the first backward of a ``static_graph``
model; accelerate's ``Accelerator.trigger_sync_in_backward`` calls ``prepare_for_backward([])`` after a forward run
under ``no_sync`` so the backward synchronises after all. graphddp's forward prepares its backward itself
(``Reducer.prepare``, Note [Reducer]), switches plans only where every rank agreed (Note [Plan agreement]) and ends
every backward with its own callback, so each of these is either done already or done here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .iteration import Iteration


class TorchReducerSurface:
    """PyTorch's ``Reducer`` methods that frameworks call, on graphddp's ``Reducer``."""

    _iteration: Iteration | None
    prepare: Callable[[Any], None]
    """graphddp's own preparation (Note [Reducer], step 2)."""

    def prepare_for_backward(self, outputs: Any) -> None:
        """PyTorch's name for arming the hooks for the next backward. Where the DDP's forward prepared it already
        (a synchronising forward), nothing more: preparing again would forget nothing but search ``outputs``
        again, which callers pass empty where PyTorch would not search (``static_graph``). After a forward that
        prepared nothing (under ``no_sync``), it prepares the backward to synchronise, as PyTorch's does."""
        iteration = self._iteration
        if iteration is None or iteration.ending.begun:
            self.prepare(outputs)

    def _rebuild_buckets(self) -> bool:
        """PyTorch's Reducer rebuilds its buckets once, from the first backward's ready order; graphddp's adopts a
        new plan at a forward, where every rank agreed to it: nothing to rebuild here (False: none was)."""
        return False

    def _delay_all_reduce(self) -> None:
        """PyTorch's Reducer holds a ``static_graph`` model's first all-reduces until here; graphddp's reduced them
        by the end of that backward: nothing is left to launch."""
