"""``graphddp.install()``: code that builds PyTorch's DDP (Hugging Face Trainer/accelerate, Lightning) gets graphddp's.

Note [Frameworks]
~~~~~~~~~~~~~~~~~
Frameworks construct ``torch.nn.parallel.DistributedDataParallel`` themselves, through whatever name they imported
it under (Lightning binds the class at import time), and then recognise the wrapper with
``isinstance(model, DistributedDataParallel)`` to call ``no_sync``, ``require_backward_grad_sync``,
``_get_ddp_logging_data``, ``static_graph``. So swapping a module attribute is not enough, and a wrapper that is
not an instance of PyTorch's class would be silently treated as "not DDP".

``install()`` gives PyTorch's class a ``__new__`` that, for a construction (a call with arguments), makes an
``InstalledDDP``: graphddp's ``DistributedDataParallel`` first in its bases, PyTorch's second. Every method is
graphddp's (PyTorch's ``__init__`` never runs, nor its Reducer), and ``isinstance`` checks against PyTorch's class
hold, so frameworks treat it as their DDP. ``torch.compile`` of it (accelerate compiles after wrapping) splits at
graphddp's buckets through Note [Split without asking]. ``uninstall()`` and the context manager ``installed()``
make PyTorch's class build PyTorch's DDP again.

A module that is already a graphddp DDP passes through unchanged (frameworks that wrap what they are given must
not reduce twice). Without ``install()``, PyTorch's DDP wrapped around a graphddp DDP would reduce every gradient
twice; graphddp's forward refuses to run inside PyTorch's DDP forward for that reason (``refuse_torch_ddp_outside``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..ddp import DistributedDataParallel
from ..runtime.torch_ddp import TorchDDP

logger = logging.getLogger(__name__)

_TorchDDP = TorchDDP  # PyTorch's own class, even when install() or a script rebound the name


class InstalledDDP(DistributedDataParallel, _TorchDDP):
    """graphddp's DDP, also an instance of PyTorch's class (see Note [Frameworks]); built by ``install()``."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if "reducer" in self.__dict__:  # a pass-through (see _new): already built, nothing to redo
            return
        DistributedDataParallel.__init__(self, module, *args, **{**_options, **kwargs})


_installed = False
_options: dict[str, Any] = {}
"""graphddp's own options (keyword-only arguments of graphddp.DDP) for every DDP built while installed."""


def _new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """PyTorch DDP's ``__new__`` once ``install()`` ran: while installed, constructions become ``InstalledDDP``;
    unpickling and copies (no arguments), subclasses of PyTorch's DDP other than ours, and everything after
    ``uninstall()`` are left alone. (It stays in place after ``uninstall()``: CPython cannot give a class back the
    ``object.__new__`` it had once ``__new__`` was assigned.)"""
    if _installed and cls is _TorchDDP and (args or kwargs):
        module = args[0] if args else kwargs.get("module")
        if isinstance(module, DistributedDataParallel):
            logger.info("graphddp.install: the module is already a graphddp DDP; it passes through unwrapped")
            return module  # InstalledDDP.__init__ returns at once; a plain graphddp DDP gets no __init__ call
        return object.__new__(InstalledDDP)
    return object.__new__(cls)


def install(**graphddp_options: Any) -> None:
    """From now on, in this process, ``torch.nn.parallel.DistributedDataParallel(...)`` builds graphddp's DDP
    (Note [Frameworks]). Call it before the framework wraps the model (before ``Trainer.train()``/``fit()``).

    ``graphddp_options``: graphddp's own keyword-only options (``first_bucket_cap_mb``, ``last_bucket_cap_mb``,
    ``bucket_ramps``, ``sparse_embedding_grads``) for the DDPs frameworks build, which pass PyTorch's arguments only.
    """
    global _installed, _options
    unknown = sorted(set(graphddp_options) - _graphddp_only_options())
    if unknown:
        raise TypeError(
            f"graphddp.install: unknown option(s) {unknown}; it takes graphddp's own options "
            f"{sorted(_graphddp_only_options())} (PyTorch's arguments come from the framework)"
        )
    _options = dict(graphddp_options)
    if _TorchDDP.__dict__.get("__new__") is not _new:
        _TorchDDP.__new__ = _new  # type: ignore[assignment]
    if not _installed:
        logger.info("graphddp.install: torch.nn.parallel.DistributedDataParallel now builds graphddp.DDP")
    _installed = True


def _graphddp_only_options() -> set[str]:
    signature = inspect.signature(DistributedDataParallel.__init__)
    return {name for name, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY}


def uninstall() -> None:
    """Undo ``install()``: PyTorch's DDP builds PyTorch's DDP again (models built meanwhile stay graphddp's)."""
    global _installed
    _installed = False


def is_installed() -> bool:
    return _installed


@contextlib.contextmanager
def installed(**graphddp_options: Any) -> Iterator[None]:
    """``install(**graphddp_options)`` for the duration of a ``with`` block (as it was after it)."""
    global _options
    was, options = _installed, dict(_options)
    install(**graphddp_options)
    try:
        yield
    finally:
        _options = options
        if not was:
            uninstall()
