"""graphddp as a user installs it: a wheel built from this checkout, installed into a fresh virtual environment,
used from a temporary folder outside the repository (slow: it builds and installs).

The fresh environment sees torch and graphddp's other dependencies through a ``.pth`` line pointing at this
environment's site-packages (no download; graphddp itself is not visible there: an editable install's finder is a
``.pth`` *file* of that folder, which a path added this way does not run), and graphddp only from the wheel.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh environment's bin folder, a work folder outside the repository)."""
    root = tmp_path_factory.mktemp("wheel")
    env = root / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    dist = root / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(REPO)], cwd=root)
    (wheel,) = dist.glob("graphddp-*.whl")
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=root)
    work = root / "work"
    work.mkdir()
    return env / "bin", work


def test_the_installed_package_is_the_wheels_and_knows_its_version(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    where = run([str(bin_dir / "python"), "-c", "import graphddp; print(graphddp.__file__)"], cwd=work).stdout
    assert str(REPO) not in where and "site-packages" in where, where
    out = run([str(bin_dir / "graphddp"), "--version"], cwd=work).stdout
    assert out.startswith("graphddp ") and "(torch 2." in out, out
    typed = run([str(bin_dir / "python"), "-c", "import graphddp, pathlib; print(pathlib.Path(graphddp.__file__).with_name('py.typed').is_file())"], cwd=work)
    assert typed.stdout.strip() == "True"


def test_inspect_runs_from_anywhere(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    out = run([str(bin_dir / "graphddp"), "inspect", "mlp", "--size", "tiny", "--format", "json"], cwd=work).stdout
    assert json.loads(out)["graphs"], out[:500]


def test_the_benchmark_ships_and_an_out_folder_named_bench_does_not_shadow_it(installed: tuple[Path, Path]) -> None:
    bin_dir, work = installed
    args = ["--size", "tiny", "--iters", "2", "--rounds", "1", "--warmup", "1", "--modes", "local,graphddp-eager", "--out", "bench"]
    run([str(bin_dir / "graphddp"), "bench", *args], cwd=work)
    assert list((work / "bench").glob("*.json")), sorted(p.name for p in (work / "bench").iterdir())
    run([str(bin_dir / "python"), "-m", "graphddp.bench", *args[:-1], "bench2"], cwd=work)  # the folder exists now
    assert list((work / "bench2").glob("*.json"))


USER_SCRIPT = """
import graphddp
import torch
from torch import nn

ddp = graphddp.DDP(nn.Linear(4, 2), bucket_cap_mb=25)
reveal_type(graphddp.DDP)
reveal_type(ddp)
with ddp.no_sync():
    loss: torch.Tensor = ddp(torch.randn(3, 4)).sum()
graphddp.install()
"""


def test_mypy_reads_the_installed_types(installed: tuple[Path, Path]) -> None:
    """A user's script type-checks against the wheel: py.typed is honoured and the lazily loaded names of
    ``graphddp`` (PEP 562) are real types to mypy, not ``Any``."""
    bin_dir, work = installed
    (work / "user.py").write_text(USER_SCRIPT)
    result = subprocess.run(
        [str(bin_dir / "python"), "-m", "mypy", "--no-incremental", "--no-error-summary", "user.py"],
        cwd=work, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    revealed = [line.rpartition("Revealed type is ")[2] for line in result.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 2, result.stdout
    assert revealed[0].endswith('-> graphddp.ddp.DistributedDataParallel"'), revealed[0]  # the class's constructor
    assert revealed[1] == '"graphddp.ddp.DistributedDataParallel"', revealed[1]  # an instance, not Any
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not errors, result.stdout
