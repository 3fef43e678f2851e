"""``tests/launched.py``: a torchrun job that ran past its time is stopped whole, workers in their own sessions
included, and says where each worker was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launched import processes_with, stop_job


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
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=2)
    assert len(processes_with(marker)) == 2, "the agent and its worker should both be running"
    stop_job(proc, marker)
    _, stderr = proc.communicate(timeout=30)  # every holder of the pipes is gone: returns at once
    assert proc.returncode is not None
    assert b'File "<string>", line 1 in <module>' in stderr, stderr.decode()[-2000:]
    assert processes_with(marker) == [], "a worker of the stopped job is still running"
