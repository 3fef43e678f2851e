"""``graphddp.tools.launch.stop_job``: a torchrun job that ran past its time is stopped whole, workers in their own sessions
included, and says where each worker was."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphddp.tools.launch import processes_with, stop_job


def test_a_job_past_its_time_is_stopped_with_the_workers_in_their_own_sessions(tmp_path: Path) -> None:
    """What torchrun leaves when its agent is killed: a worker in a session of its own, holding the agent's pipes.
    Before it is killed, it says where it was (its stacks on stderr, as the scripts' workers do); after, no process
    of the job is left."""
    marker = str(tmp_path / "killed")
    worker = f"import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1); time.sleep(600)  # --out {marker}"
    agent = (
        "import subprocess, sys, time;"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True);"
        f"time.sleep(600)  # --out {marker}"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", agent], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 60
    try:  # until the worker has its handler: a SIGUSR1 before that would end it without a stack
        while not (len(found := processes_with(marker)) == 2 and any(map(_handles_sigusr1, found))):
            assert time.monotonic() < deadline, f"the agent and its worker did not both start: {found}"
            time.sleep(0.1)
    finally:
        stop_job(proc, marker)
    _, stderr = proc.communicate(timeout=30)  # every holder of the pipes is gone: returns at once
    assert proc.returncode is not None
    assert b'File "<string>", line 1 in <module>' in stderr, stderr.decode()[-2000:]
    assert processes_with(marker) == [], "a worker of the stopped job is still running"


def _handles_sigusr1(pid: int) -> bool:
    """Has process ``pid`` a handler for SIGUSR1 (``faulthandler.register`` done)? From ``SigCgt`` in its status."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)


def test_a_benchmark_job_that_fails_is_stopped_with_its_workers(tmp_path: Path) -> None:
    """``bench.run.run_jobs``: one job fails; the other, an agent whose worker runs in a session of its own (as
    torchrun's do), is stopped whole, the worker too, and the failure is raised."""
    from bench.run import run_jobs

    marker = str(tmp_path / "config.json")
    worker = f"import time; time.sleep(600)  # {marker}"
    agent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); time.sleep(600)  # {marker}"
    failing = f"import sys, time; time.sleep(1); sys.exit(3)  # {marker}"
    with pytest.raises(RuntimeError, match=r"a benchmark rank failed: exit codes \[None, 3\]"):
        run_jobs([[sys.executable, "-c", agent], [sys.executable, "-c", failing]], marker)
    assert processes_with(marker) == [], "a worker of the failed benchmark is still running"
