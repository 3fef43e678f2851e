"""The ``graphddp`` command as a user runs it (a subprocess; the demo spawns its own ranks)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "graphddp", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def check_demo_output(out: str, steps: int) -> None:
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([\d.]+)", out, re.M)]
    assert len(losses) == steps
    assert losses[-1] < losses[0], "the synthetic sequences are learnable: the loss must fall"
    assert re.search(r"bucket plan \(graph, fingerprint [0-9a-f]{16}\): (\d+) buckets, \1 graph segments", out)
    assert "wte.weight" in out and re.search(r"^median iteration: graphddp compiled .* graphddp eager", out, re.M)


def test_demo_rejects_bad_options_in_one_line() -> None:
    result = run_cli("demo", "--workload", "resnet")
    assert result.returncode == 2
    assert result.stderr.strip() == "graphddp demo: unknown workload 'resnet'; choose one of gpt, mlp, cnn"


@pytest.mark.slow
def test_demo_as_the_readme_runs_it() -> None:
    result = run_cli("demo", timeout=600)
    assert result.returncode == 0, result.stderr
    check_demo_output(result.stdout, 20)


def test_torch_logs_turns_on_graphddps_debug_log() -> None:
    script = (
        "import tempfile, torch, torch.distributed as dist, graphddp\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mkdtemp() + '/i', rank=0, world_size=1)\n"
        "graphddp.DDP(torch.nn.Linear(4, 4))\n"
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "+graphddp"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert "bucket plan (registration, fingerprint" in result.stderr  # the plan keeper's DEBUG line (graphddp.runtime.plans)


def write_log_level(directory: str) -> None:
    """On a rank ``run_ranks`` spawned: the level graphddp's loggers log at, into ``directory/rank<r>``."""
    import logging
    from pathlib import Path

    import torch.distributed as dist

    Path(directory, f"rank{dist.get_rank()}").write_text(str(logging.getLogger("graphddp").getEffectiveLevel()))


def test_the_log_level_reaches_the_ranks_the_cli_spawns(tmp_path) -> None:
    from graphddp.tools.launch import run_ranks

    run_ranks(write_log_level, 2, str(tmp_path), log_level="INFO")  # what `graphddp --log-level INFO demo` passes
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["20", "20"]  # logging.INFO on both ranks
