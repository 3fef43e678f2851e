"""Real launchers and frameworks (slow): torchrun with a plain script, Hugging Face's Trainer (eager and
torch_compile=True) and Lightning's DDPStrategy, each trained with graphddp (one line added, docs/migrating.md)
and with PyTorch's DDP, to the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphddp.tools.launch import stop_job

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


RUN_TIMEOUT_S = 270
"""Per torchrun: a run takes under 30 s here; two of them must fit the test's 600 s (pytest-timeout), so a hung
one fails with its own output and name instead of the whole test being cut off mid-way."""


def torchrun(script: str, out: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(HERE / script)]
    # A session of its own; a hung run is stopped with its workers (``stop_job``), found by ``out`` on their command line.
    with subprocess.Popen([*command, *args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as run:  # fmt: skip
        try:
            stdout, stderr = run.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_job(run, str(out))
            stdout, stderr = run.communicate(timeout=60)
            raise AssertionError(f"{script} {args} hung: no exit after {RUN_TIMEOUT_S} s, launcher and ranks stopped. "
                                 f"Its output:\n{stdout[-3000:]}\n{stderr[-6000:]}") from None
    assert run.returncode == 0, f"{script} {args} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize(
    ("script", "extra", "wrapper"),
    [
        ("plain_script.py", (), "graphddp.ddp"),
        ("hf_trainer_run.py", (), "graphddp.integrations.frameworks.InstalledDDP"),
        ("hf_trainer_run.py", ("--compile",), "graphddp.integrations.frameworks.InstalledDDP"),
        ("lightning_run.py", (), "graphddp.integrations.frameworks.InstalledDDP"),
    ],
)
def test_graphddp_trains_like_pytorchs_ddp_under_a_real_launcher_or_framework(script: str, extra: tuple[str, ...], wrapper: str, tmp_path: Path) -> None:
    ours = torchrun(script, tmp_path / "graphddp.pt", "--impl", "graphddp", *extra)
    theirs = torchrun(script, tmp_path / "torch.pt", "--impl", "torch")  # the reference: PyTorch's DDP, eager
    assert ours["wrapper"] == wrapper and "graphddp" not in theirs["wrapper"], (ours["wrapper"], theirs["wrapper"])
    torch.testing.assert_close(ours["state"], theirs["state"])
    if "--compile" in extra:
        assert ours["splits"] and max(ours["splits"]) > 1, f"torch.compile did not split at graphddp's buckets: {ours['splits']}"
    if script == "lightning_run.py":
        assert ours["unwrapped"], "Lightning's teardown (which reads _get_ddp_logging_data) did not run through"
