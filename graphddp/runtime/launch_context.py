"""Collectives issued in backward: free of the backward's Python context, and given back before backward ends.

Note [A collective holds no Python object]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A c10d ``Work`` is destroyed only once its strong *and* weak references are gone, and a gloo ``barrier`` keeps weak
references to every collective queued or running when it was issued (running includes one that has just
completed while its worker thread has not yet cleared it). A barrier issued by a script after a step can therefore
keep one of graphddp's collectives, which a gloo worker thread then destroys when it drops the barrier. Destroying
it releases Python objects: the tensors lent to it, which Python may have dropped by then (graphddp's buffers are
Python tensors, unlike the C++ ones of PyTorch's Reducer), and the thread-local state copied when it was issued,
which during backward holds the ``contextvars.Context`` that ``torch.autograd.backward`` stashes there
(``torch._C._stash_obj_in_tls("context", ...)``). Releasing a Python object takes the GIL. If the script is by then
leaving (``dist.barrier(); dist.destroy_process_group()``, the interpreter finalising, the DDP collected), CPython
ends the worker with ``pthread_exit``, whose unwinding through a destructor aborts the process ("terminate called
without an active exception", SIGABRT after the last line). The core dumps of ``tests/restart/restart_job.py`` show
``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` (or a tensor) -> ``take_gil``.

(In torch 2.13 a Python tensor's C++ references falling back to the one its Python object holds release that
object too: destroying any ``Work`` that holds a Python tensor may take the GIL.) So graphddp's usual collectives
do not outlive their backward in the process group, and what may outlive it holds nothing of Python's thread state:
- once it has waited for them, graphddp drops its references to its own collectives and waits until the process
  group has given their tensors back: each collective was given a tensor of its own (``lend``: a private alias),
  whose use count is one again then. At the end of backward: each bucket's averaging all-reduce
  (``reductions.AveragedInFlight.let_go``, skipped buckets reduced late too), a row-sparse table's mask and rows
  (``RowSparseInFlight.let_go``), the plan agreement (``plans.PlanAgreement.settle``), the delayed parameters'
  buffer (``settle``, from the engine callback). Inside the compiled backward: a big gradient's blocks, as soon as
  ``wait_blocks_`` has waited for them (``settle``). By then a worker has nearly always finished with them, so
  this is one check per collective; it yields the CPU only if a worker thread is late (just after a wait that
  blocked it can be a few microseconds late: one 0.1 ms sleep), and after ``GIVE_BACK_LIMIT_S`` warns and goes on;
- collectives issued during backward leave the backward's context out of the thread-local state
  (``no_backward_context``: taken out, put back right after; ~0.5 us and two Python calls, which the lean bucket
  path does not pay: its collectives are given back): a comm hook's, in-graph blocks, the delayed all-reduce,
  skipped buckets reduced late, a row-sparse table's. What still holds Python tensors past backward: a comm hook's
  collectives (a hook may keep its futures on purpose, and send any tensor), the blocks of a backward abandoned
  before ``wait_blocks_`` and a delayed all-reduce whose backward raised before its callback (both dropped
  unwaited at the next backward). One of those caught by a barrier at exit could still abort as above (not seen).
The abort also needs a worker thread alive during finalisation, which ``destroy_process_group`` prevents only if
nothing holds the group; graphddp's launcher makes sure PyTorch itself does not (Note [The default group outlives
destroy_process_group] in ``graphddp/tools/launch.py``).
Tested in ``tests/spawned/test_launch_context.py`` and ``tests/one_process/test_lent.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

_KEY = "context"
"""The key ``torch.autograd.graph._engine_run_backward`` stashes its ``contextvars.Context`` under."""

_TLS = all(hasattr(torch._C, name) for name in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls"))
"""This torch has the Python objects' thread-local map (without it there is nothing to take out)."""


TELLS_USE_COUNTS = hasattr(torch.Tensor, "_use_count")
"""This torch tells a tensor's use count."""


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


CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,)
"""The tags of graphddp's ops inside a compiled backward (a big gradient's blocks, a table's rows, a bucket's
optimizer step): their Python issues collectives and steps the optimizer every step, so no CUDA graph may record
them (``mode="reduce-overhead"``: Inductor then runs that graph without CUDA graphs, or cuts it around them)."""

GIVE_BACK_LIMIT_S = 1.0
"""How long ``given_back`` waits for a worker thread that is late (a loaded machine), after which it logs a
warning and goes on: nothing is wrong with the step, the collective is only destroyed later, on that thread."""


def lend(tensor: torch.Tensor) -> torch.Tensor:
    """A private alias of ``tensor`` to give a collective (the same storage, ``[*tensor.shape]``): while the process
    group holds it, its use count is above one (``still_held``); nothing else ever holds it."""
    return tensor.view(tensor.shape)


def still_held(alias: torch.Tensor) -> bool:
    """Does the process group still hold ``alias`` (from ``lend``)? A torch that does not tell use counts: never
    seen held. (The hot path, ``AveragedInFlight.let_go``, inlines this test and ``given_back``'s wait.)"""
    return TELLS_USE_COUNTS and alias._use_count() > 1


def given_back(alias: torch.Tensor, what: str, limit_s: float = GIVE_BACK_LIMIT_S) -> bool:
    """Wait until the process group gives back ``alias`` (call it once the references to its collective are
    dropped): True at once in the common case, else after yielding the CPU to the late worker; False, with a
    warning, after ``limit_s``. The loop calls into C only, so a late worker adds no Python call to a backward
    (``bench.overhead.CallCounter`` counts them)."""
    if not TELLS_USE_COUNTS or alias._use_count() <= 1:
        return True
    deadline = time.monotonic() + limit_s
    while alias._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.0001)
    if alias._use_count() <= 1:
        return True
    warn_still_held(what, limit_s)
    return False


def warn_still_held(what: str, waited_s: float) -> None:
    logger.warning(
        "graphddp: %s is still held by its collective %.1f s after the collective completed; going on "
        "(Note [A collective holds no Python object] in graphddp/runtime/launch_context.py)",
        what, waited_s,
    )


def settle(works: list[Any], lent: Sequence[torch.Tensor], what: str) -> None:
    """Wait for ``works`` in the order they were issued, emptying the list (the caller keeps no other reference, so
    each is dropped here), then see each tensor of ``lent`` (what they were given, from ``lend`` or private to the
    caller) given back (``given_back``)."""
    while works:
        works.pop(0).wait()  # no name holds it after this line
    for alias in lent:
        given_back(alias, what)
