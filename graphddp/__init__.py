"""graphddp: distributed data-parallel training for PyTorch that works with ``torch.compile``.

``graphddp.DistributedDataParallel`` (alias ``graphddp.DDP``) is a drop-in replacement for
``torch.nn.parallel.DistributedDataParallel`` built on a Python Reducer; its bucket plan is the one contract the
eager path and the compile backend share (see ``graphddp.passes.plan`` and ``docs/``).
"""

from ._version import __version__
from .compiler.backend import backend
from .ddp import DDP, DDPOptions, DistributedDataParallel, check_replicas, compile
from .integrations import checkpoint as _checkpoint  # noqa: F401 (takes part in every DDP construction)
from .integrations.frameworks import install, installed, uninstall

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
