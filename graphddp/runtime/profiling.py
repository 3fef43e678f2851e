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


def _python_profiling() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", _python_profiling)
"""Does a profiler record on this thread (autograd's worker threads inherit the caller's)? Torch's own C check, so
the hot path asks it per bucket without a Python call (Note [Lean bucket path]); where a torch lacks it, the
process-wide flag ``torch.profiler`` sets."""


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
