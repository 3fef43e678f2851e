"""torchrun --max-restarts 1 recovers a graphddp job (slow: the real torchrun, about 15 s a run).

One rank is SIGKILLed mid-backward at step 25 of 40; torchrun restarts both ranks, they resume from the checkpoint
of step 20 and must end with parameters bitwise equal to an uninterrupted run. Two ways of following the recipe
(docs/reliability.md) are run, each ``RESTART_TRIES`` times (default 3; more to soak, e.g. 10):

* the script joins with ``init_distributed`` (a per-attempt store prefix), under plain ``torchrun --standalone``;
* the script keeps ``dist.init_process_group("gloo")`` and torchrun runs with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

PyTorch's own DDP under the first is run too (fewer tries): the cause and the recipe are torchrun's, not graphddp's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphddp.tools.launch import stop_job

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
TRIES = int(os.environ.get("RESTART_TRIES", "3"))  # 5 until session 39 (11-15 s a run; the slow suite was over budget)
RUN_TIMEOUT_S = 240  # a run takes ~15 s; a restarted attempt that hangs in gloo's connect would wait far longer
KILL_AT = 25
UNSHARED = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(workdir: Path, name: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Run restart_job.py under the real torchrun; (rank 0's output, torchrun's stderr)."""
    ckpt = workdir / name
    ckpt.mkdir()
    out = workdir / f"{name}.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        str(HERE / "restart_job.py"), "--ckpt", str(ckpt), "--out", str(out), *args,
    ]  # fmt: skip
    # A session of its own, so that a timeout ends torchrun's workers too, not only the agent.
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_job(proc, str(ckpt))
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"{name}: torchrun still running after {RUN_TIMEOUT_S} s:\n{stderr[-12000:]}")
    assert proc.returncode == 0, f"{name}: torchrun failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-8000:]}"
    return torch.load(out, weights_only=False), stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Uninterrupted runs (same script, no --kill-at), one per implementation."""
    workdir = tmp_path_factory.mktemp("reference")
    runs = {impl: torchrun(workdir, impl, "--impl", impl)[0] for impl in ("graphddp", "torch")}
    for impl, run in runs.items():
        assert run["restart_count"] == 0 and run["resumed_from"] == 0, (impl, run)
    return runs


def check_recovered(run: dict, stderr: str, reference: dict, *, shared_store: bool) -> None:
    assert f"SIGKILL mid-backward of step {KILL_AT}" in stderr, "rank 1 was not killed"
    assert run["restart_count"] == 1, f"the output is not from the restarted attempt: {run['restart_count']}"
    assert run["resumed_from"] == 20, f"resumed from step {run['resumed_from']}, not from the checkpoint of step 20"
    # Why the recipe is needed: the restarted attempt got the same agent store, with the dead attempt's keys in it.
    visible = run["previous_attempt_keys_visible"]
    assert visible is (True if shared_store else None), f"previous attempt's keys visible: {visible}"
    assert run["state"].keys() == reference["state"].keys()
    differing = [name for name, t in reference["state"].items() if not torch.equal(run["state"][name], t)]
    assert not differing, f"parameters differ from the uninterrupted run: {differing}"


@pytest.mark.parametrize("attempt", range(TRIES))
def test_graphddp_job_recovers_bitwise_with_a_per_attempt_store_prefix(
    attempt: int, reference: dict[str, dict], tmp_path: Path
) -> None:
    run, stderr = torchrun(tmp_path, "killed", "--impl", "graphddp", "--kill-at", str(KILL_AT), "--init", "recipe")
    assert run["impl"] == "graphddp.ddp"
    check_recovered(run, stderr, reference["graphddp"], shared_store=True)


@pytest.mark.parametrize("attempt", range(TRIES))
def test_graphddp_job_recovers_bitwise_when_torchrun_does_not_share_its_store(
    attempt: int, reference: dict[str, dict], tmp_path: Path
) -> None:
    run, stderr = torchrun(
        tmp_path, "killed", "--impl", "graphddp", "--kill-at", str(KILL_AT), "--init", "plain", env=UNSHARED
    )
    check_recovered(run, stderr, reference["graphddp"], shared_store=False)


def test_pytorch_ddp_job_recovers_bitwise_with_the_same_recipe(reference: dict[str, dict], tmp_path: Path) -> None:
    """One run: PyTorch's job is the control here (graphddp's run RESTART_TRIES times each way above). Its second run hung twice in CI
    at the restarted attempt (and never in 18 runs of its killed job here, 12 idle and 6 with both cores busy); on a hang the test now
    prints every worker's stacks (``stop_job``), which is what a diagnosis needs."""
    run, stderr = torchrun(tmp_path, "killed", "--impl", "torch", "--kill-at", str(KILL_AT), "--init", "recipe")
    assert "graphddp" not in run["impl"]
    check_recovered(run, stderr, reference["torch"], shared_store=True)
