"""Start ranks the standard way: under ``torchrun`` (environment variables) or spawned on this machine; and stop a
torchrun job whole (``stop_job``: the benchmark's and the tests' jobs that fail or run past their time).

The CLI's commands run a function on every rank; this module only decides where ranks come from. Transport
and rendezvous are ``torch.distributed``'s own (a TCP store on loopback when spawning).

Note [Restarts]
~~~~~~~~~~~~~~~
``torchrun --max-restarts N`` (c10d or static rendezvous) hands every attempt the same agent-hosted TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``, the same ``MASTER_PORT``), and PyTorch 2.13's
``init_process_group(env://)`` uses it without a per-attempt prefix. Each rank's gloo address key of the dead
attempt is still there, so a restarted rank may read its peer's old address: "Gloo connectFullMesh failed ...
Connection refused", or both ranks waiting for each other past the timeout (pytorch/pytorch#135712). Every extra
process group is one more such race. ``init_process_group`` below gives each attempt keys of its own (a
``PrefixStore`` per ``TORCHELASTIC_RESTART_COUNT``); with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torchrun itself
gives each attempt a fresh store and plain env:// is safe. ``docs/reliability.md`` has the recipe and its test.

Note [The default group outlives destroy_process_group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A few of PyTorch's modules give functions the default group as a default argument, evaluated when the module is
imported: ``torch.distributed.nn.functional`` (ten functions), ``torch.distributed.optim.zero_redundancy_optimizer``
and ``torch.distributed.fsdp.sharded_grad_scaler``. Imported before ``init_process_group`` they bind ``None``;
imported after it they hold the group for the life of the interpreter. ``torch._dynamo`` imports the first one, so
the first ``torch.compile`` or DDP construction (PyTorch's, and graphddp's) after ``init_process_group`` does
that. ``destroy_process_group`` then cannot free the group: its gloo worker threads live on into interpreter
finalisation, the window in which a worker that releases a Python object aborts the process (Note [A collective
holds no Python object] in ``graphddp/runtime/launch_context.py``; seen once, as SIGABRT of the demo's rank 0 at
exit). ``import_before_init`` imports those modules first. ``init_process_group`` below calls it, and so do
``bench.overhead``, ``bench.gpu``, the tests' rank pools and their one-process fixture. There
``destroy_process_group`` frees the group and joins its threads while the interpreter runs, once nothing else
holds the group (a live DDP does: PyTorch's, and graphddp's with its channels). A script of one's own gets the
same by calling ``import_before_init`` before ``init_process_group``. Importing ``torch._dynamo`` there (as ``from
graphddp import DDP`` at the top of a script does) covers only the module Dynamo brings in, the first. Where the
group is freed this way, a PyTorch DDP freed after ``destroy_process_group`` drops the group's last reference
from C++ with the GIL held, which can deadlock with a gloo worker (docs/reliability.md, "A deadlock at exit"):
free it, and what holds it, first.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

MODULES_BINDING_THE_DEFAULT_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)
"""PyTorch's modules whose functions take the default group as a default argument evaluated at import."""


def import_before_init() -> None:
    """Import the modules that would otherwise keep the default group alive past ``destroy_process_group``
    (Note [The default group outlives destroy_process_group]); call it before ``init_process_group``.

    Called after the default group exists it would bind that group itself, so it refuses then.
    """
    if dist.is_initialized():
        unbound = [name for name in MODULES_BINDING_THE_DEFAULT_GROUP if name not in sys.modules]
        if unbound:
            raise RuntimeError(
                f"import_before_init() called after init_process_group(): importing {', '.join(unbound)} now would "
                "bind the default group for the life of the interpreter; call it before init_process_group() "
                "(Note [The default group outlives destroy_process_group] in graphddp/tools/launch.py)"
            )
        return
    for name in MODULES_BINDING_THE_DEFAULT_GROUP:
        importlib.import_module(name)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_process_group(backend: str = "gloo", *, timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` from the environment that a torchrun restart can rejoin
    (Note [Restarts]), with the group freed again by ``destroy_process_group`` (Note [The default group outlives
    destroy_process_group]). ``timeout``: as PyTorch's (None: its default)."""
    if not dist.is_initialized():  # a second init is PyTorch's error to raise
        import_before_init()
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # no shared agent store: env:// is safe
        dist.init_process_group(backend, **kwargs)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world_size, **kwargs
    )


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""How the CLI's log lines look, in the CLI's process and in every rank it spawns."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", log_level: str | None = None) -> None:
    """Run ``fn(*args)`` on every rank with a default process group initialised.

    Under torchrun this process is one rank of the job; otherwise ``world_size`` ranks are spawned here.
    ``log_level`` (a ``logging`` level name): logging configured at that level in every rank (a spawned process
    starts with none: the CLI's ``--log-level`` would stop at its own process).
    """
    if launched_by_torchrun():
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, backend, log_level, fn, args)
        return
    port = free_port()
    mp.start_processes(
        _rank_main, args=(world_size, port, backend, log_level, fn, args), nprocs=world_size, join=True,
        start_method="spawn",
    )


def _rank_main(
    rank: int, world_size: int, port: int | None, backend: str, log_level: str | None, fn: Callable[..., Any], args: tuple
) -> None:
    if log_level is not None:
        logging.basicConfig(level=log_level, format=LOG_FORMAT)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    init_process_group(backend)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on loopback now (the one helper: the CLI, the benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_job(proc: subprocess.Popen, marker: str) -> None:
    """Stops ``proc`` (torchrun, or a command that execs it, started with ``start_new_session=True``) and every
    process of its job.

    torchrun starts every worker in a session of its own, so killing the agent's group leaves them running; a
    worker left over holds the pipes a caller reads, which then waits on them for ever (a test did, in a CI run
    where a restarted attempt hung), or outlives its job and loads the machine for whatever runs next (in a CI run
    where a framework's reference run hung at exit). SIGTERM first lets torchrun stop its workers; whatever still
    runs is found by ``marker`` on its command line (a path unique to the run). Before that, every process of the
    job but ``proc`` gets SIGUSR1: a worker that registered ``faulthandler`` for it (the benchmark's and the tests'
    scripts do, first thing) writes its threads' stacks to stderr, so a failure says where each one hung; one
    without a handler is ended by the signal."""
    for pid in processes_with(marker):
        if pid != proc.pid:  # the agent has no handler: SIGUSR1 would end it
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in processes_with(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def processes_with(marker: str) -> list[int]:
    """The processes with ``marker`` on their command line (a run's agent and workers)."""
    needle, found = marker.encode(), []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except (OSError, ValueError):  # gone meanwhile
            pass
    return found
