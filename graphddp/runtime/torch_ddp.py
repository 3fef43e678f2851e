"""PyTorch's DDP class, bound once, at import.

Scripts and test suites swap a DDP implementation by rebinding the name
(``torch.nn.parallel.DistributedDataParallel = graphddp.DDP``), and ``graphddp.install()`` rebinds it too. Looked up
through that name at call time, PyTorch's class would then be graphddp's, which has no ``_get_active_ddp_module``
(every forward raised ``AttributeError``), or a subclass on which setting ``_active_ddp_module`` hides the module
from Dynamo, which reads PyTorch's own class. So every use of PyTorch's class — the active DDP module Dynamo's DDP
hook reads (Note [Split without asking]), ``isinstance`` refusals, its static helpers — goes through ``TorchDDP``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.parallel.distributed as _distributed


def _pytorchs_class() -> type:
    """The class ``torch.nn.parallel.distributed`` defines, even if a subclass or another class was bound there."""
    bound = _distributed.DistributedDataParallel
    for cls in getattr(bound, "__mro__", ()):
        if cls.__module__ == "torch.nn.parallel.distributed" and cls.__name__ == "DistributedDataParallel":
            return cls
    raise ImportError(f"graphddp: torch.nn.parallel.distributed.DistributedDataParallel is {bound!r}, not PyTorch's DDP")


TorchDDP: Any = _pytorchs_class()
"""``torch.nn.parallel.DistributedDataParallel`` as PyTorch defines it."""


def active_ddp_module() -> Any:
    """The DDP module whose forward runs now, as Dynamo sees it (PyTorch's or graphddp's)."""
    return TorchDDP._get_active_ddp_module()


def set_active_ddp_module(module: Any) -> Any:
    """Make ``module`` the active DDP module for Dynamo; returns the one before it."""
    previous = TorchDDP._active_ddp_module
    TorchDDP._active_ddp_module = module
    return previous
