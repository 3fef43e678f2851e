"""Start ranks the standard way: under ``torchrun`` (environment variables) or spawned on this machine.

The CLI's commands run a function on every rank; this module only decides where ranks come from. Transport
and rendezvous are ``torch.distributed``'s own (a TCP store on loopback when spawning).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(*args)`` on every rank with a default process group initialised.

    Under torchrun this process is one rank of the job; otherwise ``world_size`` ranks are spawned here.
    """
    if launched_by_torchrun():
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, backend, fn, args)
        return
    port = _free_port()
    mp.start_processes(
        _rank_main, args=(world_size, port, backend, fn, args), nprocs=world_size, join=True, start_method="spawn"
    )


def _rank_main(rank: int, world_size: int, port: int | None, backend: str, fn: Callable[..., Any], args: tuple) -> None:
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
