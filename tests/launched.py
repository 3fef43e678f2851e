"""Stopping a job started under the real torchrun that ran past its time, workers included (one helper for every
test that launches torchrun: tests/restart, tests/frameworks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def stop_job(proc: subprocess.Popen, marker: str) -> None:
    """Stops ``proc`` (torchrun, started with ``start_new_session=True``) and every process of its job.

    torchrun starts every worker in a session of its own, so killing the agent's group leaves them running; a
    worker left over holds the pipes ``communicate`` reads, and the test would wait on them for ever (it did, in a
    CI run where a restarted attempt hung), or outlive the test and load the machine for the ones after it (it did,
    in a CI run where a framework's reference run hung at exit). SIGTERM first lets torchrun stop its workers;
    whatever still runs is found by ``marker`` on its command line (a path unique to this run). Before that, every
    worker that has registered ``faulthandler`` for SIGUSR1 (the scripts do, first thing) writes its threads' stacks
    to stderr, so the failure says where each one hung; one still starting up is ended by the signal instead."""
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
