"""graphddp: distributed data-parallel training for PyTorch that works with ``torch.compile``.

``graphddp.DistributedDataParallel`` (alias ``graphddp.DDP``) is a drop-in replacement for
``torch.nn.parallel.DistributedDataParallel`` built on a Python Reducer; its bucket plan is the one contract the
eager path and the compile backend share (see ``graphddp.passes.plan`` and ``docs/``).

``import graphddp`` is cheap: the names below load on first use (PEP 562), so the command line, ``--version`` and a
script that only imports the package do not pay for Dynamo, sympy or networkx. The first use of any of them loads
the DDP, the backend and the integrations together, as one import of the old package did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time __getattr__ below loads the same names
    from .compiler.backend import backend
    from .ddp import DDP, DDPOptions, DistributedDataParallel, check_replicas, compile
    from .integrations.frameworks import install, installed, uninstall

_LAZY = {
    "DDP": ".ddp",
    "DDPOptions": ".ddp",
    "DistributedDataParallel": ".ddp",
    "check_replicas": ".ddp",
    "compile": ".ddp",
    "backend": ".compiler.backend",
    "install": ".integrations.frameworks",
    "installed": ".integrations.frameworks",
    "uninstall": ".integrations.frameworks",
}
"""Public name -> the module that defines it."""

__all__ = [
    "DDP",
    "DDPOptions",
    "DistributedDataParallel",
    "__version__",
    "backend",
    "check_replicas",
    "compile",
    "install",
    "installed",
    "uninstall",
]


def _load_all() -> None:
    """Import every module behind the public names, and bind the names here (later lookups skip ``__getattr__``).

    The checkpoint integration is imported with them: it takes part in every DDP construction (Note [Checkpoints])."""
    importlib.import_module(".integrations.checkpoint", __name__)
    for name, module in _LAZY.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'graphddp' has no attribute {name!r}")
    _load_all()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
