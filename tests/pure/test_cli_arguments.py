"""Command-line mistakes are one-line errors with exit status 2, before any rank starts."""

from __future__ import annotations

import pytest

from graphddp.tools.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--inner", "nope"], "argument --inner: unknown backend 'nope'; for example"),
        (["demo", "--inner", "graphddp"], "graphddp is the splitting backend itself"),
        (["--log-level", "loud", "demo"], "argument --log-level: unknown level 'loud'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_bench_checks_inner_too(capsys: pytest.CaptureFixture) -> None:
    from bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--inner", "nope"])
    assert exit_info.value.code == 2 and "unknown backend 'nope'" in capsys.readouterr().err


def test_inspect_finds_a_factory_in_the_current_directory(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "mymodels_here.py").write_text(
        "import torch\n"
        "def factory():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "    return model, (torch.randn(2, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert main(["inspect", "mymodels_here:factory"]) == 0
    assert "fingerprint" in capsys.readouterr().out
