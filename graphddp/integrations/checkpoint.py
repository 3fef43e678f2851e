"""Checkpoints move between PyTorch's DDP, graphddp and an unwrapped model.

Note [Checkpoints]
~~~~~~~~~~~~~~~~~~
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``, ``set_model_state_dict``, and through them
``dcp.save``/``dcp.load`` of a model's state) names every parameter by its fully qualified name *without* DDP's
``module.`` prefix. It finds DDP wrappers with ``isinstance(obj, DistributedDataParallel)``, which a graphddp.DDP
is not. ``install`` adds graphddp's class to that check (the name the module looks up, made a tuple of both
classes), so a checkpoint taken from either wrapper, or from the bare model, loads into any of the three.
``ddp.state_dict()`` keeps the ``module.`` prefix, as PyTorch's DDP's does.
"""

from __future__ import annotations

import logging

from ..ddp import DistributedDataParallel, on_construction

logger = logging.getLogger(__name__)

_installed: bool | None = None


def install() -> bool:
    """Make ``torch.distributed.checkpoint.state_dict`` treat graphddp.DDP as a DDP (once per process; run at the
    first construction of a graphddp DDP, through ``graphddp.ddp.on_construction``)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from torch.distributed.checkpoint import state_dict
    except ImportError:  # a torch without distributed checkpointing: nothing to take part in
        _installed = False
        return False
    known = getattr(state_dict, "DDP", None)
    if known is None:
        logger.warning(
            "graphddp: torch.distributed.checkpoint.state_dict has no DDP check this version of graphddp knows; "
            "get_model_state_dict(graphddp_model) keeps the 'module.' prefix: pass graphddp_model.module instead."
        )
        _installed = False
        return False
    classes = known if isinstance(known, tuple) else (known,)
    if DistributedDataParallel not in classes:
        state_dict.DDP = (*classes, DistributedDataParallel)  # subclasses (InstalledDDP) match through it
    _installed = True
    return True


on_construction(install)
