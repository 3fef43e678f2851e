"""What graphddp shows where users look: labelled ranges in ``torch.profiler`` traces, and the split and bucket
plans in torch's structured trace (``TORCH_TRACE=dir``, read with ``tlparse``). Logs: ``TORCH_LOGS="+graphddp"``
(torch registers any importable module named there) or ``logging.getLogger("graphddp")``.

Ranges cost nothing when no profiler runs: each helper checks first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def profiling() -> bool:
    """Does a torch profiler record? The process-wide flag every ``torch.profiler`` sets (not the calling thread's
    state, ``torch._C._autograd._profiler_enabled()``: a profiler of all threads started on another thread, as
    ``torch.distributed.debug``'s on-demand one is, leaves that False). The launcher asks once per backward, not
    per bucket (Note [Lean bucket path])."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def labelled(name: str) -> Any:
    """A ``torch.profiler`` range named ``name`` while a profiler runs; nothing otherwise."""
    return torch.profiler.record_function(name) if profiling() else contextlib.nullcontext()


def label_backward(node: Any, name: str) -> None:
    """A range named ``name`` around the backward of autograd ``node`` (a compiled segment's); call it while
    ``profiling()``."""
    record = torch.profiler.record_function(name)
    node.register_prehook(lambda grads: record.__enter__() and None)
    node.register_hook(lambda grad_inputs, grad_outputs: record.__exit__(None, None, None) and None)


def trace_artifact(name: str, payload: Callable[[], str]) -> None:
    """``payload()`` into torch's structured trace as the artifact ``name`` (computed only when tracing)."""
    from torch._logging import trace_structured

    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload)
