"""Timing modes step by step in one process: what lets several modes stay alive at once.

A benchmark that times one mode after another compares steps taken up to a minute apart, and a shared VM's speed
drifts on that scale (``docs/benchmarks.md``: two identical builds 12 % apart in one cell, rounds of one mode
bimodal with no page fault and no steal). Timing one step of each mode in turn, every mode built and alive, puts a
mode's steps and its baseline's one pass over the modes apart, so drift slower than that moves them alike.
``bench.overhead`` and ``bench`` (``--interleave steps``) both do it with what is here, reversing the order on every
other pass (``pass_order``).
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
from collections.abc import Iterator

import torch

INTERLEAVINGS = ("steps", "modes")
"""``steps``: every mode alive at once, one step of each in turn; ``modes``: one mode alive at a time, its steps
in a row, each mode built afresh every round."""


def pass_order(modes: list[str], k: int) -> list[str]:
    """The order of pass ``k`` over the modes: as listed on even passes, reversed on odd ones, so each mode follows
    each of its neighbours as often as it precedes it. A step pays for the mode timed just before it (session 53:
    graphddp-eager timed right after PyTorch's DDP added 0.1-0.3 x PyTorch's added time more than timed right
    before it, ``docs/benchmarks.md``); in one fixed order that cost fell on the later of the two DDPs every time."""
    return list(modes) if k % 2 == 0 else list(reversed(modes))


def isolated_model(model: torch.nn.Module, tag: str) -> torch.nn.Module:
    """``model``, its class replaced by a subclass whose ``forward`` runs the same code from a code object of its
    own (named after ``tag``). Dynamo caches compiled code per code object, so modes alive at once (``--interleave
    steps``) neither reuse nor look through each other's compiled graphs."""
    cls = type(model)
    forward = cls.forward
    name = "forward_" + re.sub(r"\W", "_", tag)
    names = {"co_name": name} | ({"co_qualname": f"{cls.__qualname__}.{name}"} if sys.version_info >= (3, 11) else {})
    code = forward.__code__.replace(**names)
    own = types.FunctionType(code, forward.__globals__, name, forward.__defaults__, forward.__closure__)
    own.__kwdefaults__ = forward.__kwdefaults__
    model.__class__ = type(f"{cls.__name__}_{name}", (cls,), {"forward": own, "__module__": cls.__module__})
    return model


@contextlib.contextmanager
def shared_frames(modes: int) -> Iterator[None]:
    """Dynamo's recompile limit raised for ``modes`` modes alive at once: frames outside each mode's isolated
    forward (a DDP's own ``forward``) are one code object for all of them, each mode its own cache entry. Should
    a frame reach the limit anyway, Dynamo raises instead of running it eagerly, which would time a compiled mode
    uncompiled with nothing to say so."""
    config = torch._dynamo.config
    limit, fail = config.recompile_limit, config.fail_on_recompile_limit_hit
    config.recompile_limit, config.fail_on_recompile_limit_hit = max(limit, 2 * modes), True
    try:
        yield
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = limit, fail


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its own counter): a timed step that moves it compiled."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
