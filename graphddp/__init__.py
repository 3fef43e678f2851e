"""graphddp: distributed data-parallel training for PyTorch that works with ``torch.compile``.

``graphddp.DistributedDataParallel`` (alias ``graphddp.DDP``) is a drop-in replacement for
``torch.nn.parallel.DistributedDataParallel`` built on a Python Reducer; its bucket plan is the one contract the
eager path and the compile backend share (see ``graphddp.passes.plan`` and ``docs/``).
"""

from .backend import backend, compile
from .ddp import DDP, DDPOptions, DistributedDataParallel
from .frameworks import install, installed, uninstall

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "DDPOptions",
    "DistributedDataParallel",
    "__version__",
    "backend",
    "compile",
    "install",
    "installed",
    "uninstall",
]
