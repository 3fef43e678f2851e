"""Real launchers and frameworks (slow): torchrun with a plain script, Hugging Face's Trainer (eager and
torch_compile=True) and Lightning's DDPStrategy, each trained with graphddp (one line added, docs/migrating.md)
and with PyTorch's DDP, to the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def torchrun(script: str, out: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(HERE / script)]
    result = subprocess.run([*command, *args, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{script} {args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
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
