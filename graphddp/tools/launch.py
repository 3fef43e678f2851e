"""Start ranks the standard way: under ``torchrun`` (environment variables) or spawned on this machine.

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
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_process_group(backend: str = "gloo", *, timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` from the environment that a torchrun restart can rejoin
    (Note [Restarts]). ``timeout``: as PyTorch's (None: its default)."""
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
