"""Collectives launched in backward, free of the backward's Python context.

Note [A collective holds no Python object]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.autograd.backward`` stashes a ``contextvars.Context`` in the C++ thread-local state for as long as the
engine runs (``torch._C._stash_obj_in_tls("context", ...)`` in ``torch.autograd.graph``), and a gloo collective
copies the whole thread-local state into its ``Work`` when it is issued. A collective graphddp issues from a
gradient hook or the end-of-backward callback therefore holds a Python object, released when the ``Work`` is
destroyed, and that can happen on one of gloo's worker threads: a ``barrier`` keeps weak references to the
collectives in flight when it was issued, and a c10d ``Work`` is destroyed only once its weak references are gone
too. A script that ends ``dist.barrier(); dist.destroy_process_group()`` returns while the worker may still be
dropping that barrier; when the interpreter is already finalising by then, the worker's attempt to take the GIL
ends the thread with ``pthread_exit``, whose unwinding through a destructor aborts the process ("terminate called
without an active exception", SIGABRT after "done"; seen about once in a hundred runs of
``tests/restart/restart_job.py``, whose last agreement all-reduce (Note [Plan agreement]) is held until the
DDP is collected while finalising, and found from the core dump's stack: ``~AsyncBarrierWork`` ->
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``SafePyObject`` decref -> ``take_gil``).

So every collective graphddp launches in backward is issued with that object taken out of the thread-local state
and put back right after (``no_backward_context``): its ``Work`` then holds nothing of Python's, and may be
destroyed on any thread at any time. The engine's own use of the object (compiler configuration seen by device
threads) is untouched: the object is back before any other hook or node runs. Cost: ~0.5 us per launch (three
calls into C and the ``with``). Collectives graphddp issues outside backward need nothing: the map is empty there.
Tested in ``tests/spawned/test_launch_context.py``.
"""

from __future__ import annotations

import torch

_KEY = "context"
"""The key ``torch.autograd.graph._engine_run_backward`` stashes its ``contextvars.Context`` under."""

_TLS = all(hasattr(torch._C, name) for name in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls"))
"""This torch has the Python objects' thread-local map (without it there is nothing to take out)."""


class no_backward_context:  # noqa: N801 (a context manager, named as torch names its own: no_grad)
    """Within: the backward's Python context is out of the thread-local state (Note [A collective holds no Python
    object]); outside backward, or on a torch without the map, nothing happens."""

    __slots__ = ("_context",)

    def __enter__(self) -> None:
        self._context = torch._C._get_obj_in_tls(_KEY) if _TLS and torch._C._is_key_in_tls(_KEY) else None
        if self._context is not None:
            torch._C._remove_obj_from_tls(_KEY)

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            torch._C._stash_obj_in_tls(_KEY, self._context)
            self._context = None
