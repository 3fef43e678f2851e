"""Each parameter's dtype and device as graphddp.DDP wrapped it: the buckets were planned for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Placement:
    """The parameters' dtypes and devices when wrapped, checked at every forward (``check``)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        self._named_params = list(named_params)
        self._placed = [(p.dtype, p.device) for _, p in self._named_params]

    def check(self, rank: int) -> None:
        """A parameter moved to another dtype or device after wrapping no longer fits its bucket: say which,
        instead of casting its gradient silently as PyTorch's DDP does (docs/reliability.md)."""
        for (name, p), (dtype, device) in zip(self._named_params, self._placed):
            if (p.dtype, p.device) != (dtype, device):
                raise RuntimeError(
                    f"[rank {rank}] graphddp.DDP: parameter {name!r} is now {p.dtype} on {p.device}, "
                    f"but was {dtype} on {device} when graphddp.DDP wrapped the module; its bucket was planned for "
                    "that. Change dtypes and devices (model.to(...), .half(), .double()) before wrapping."
                )
