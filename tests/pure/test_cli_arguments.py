"""Command-line mistakes are one-line errors with exit status 2, before any rank starts."""

from __future__ import annotations

import argparse
import signal

import pytest
import torch

from graphddp.tools.cli import build_parser, main


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


def bench_exit(argv: list[str]) -> int:
    """``python -m bench ARGV``'s exit status, in this process (five subprocesses took 18 s of the slow suite)."""
    from bench.__main__ import main as bench_main

    on_sigterm = signal.getsignal(signal.SIGTERM)  # bench's main installs its own
    try:
        return bench_main(argv)
    except SystemExit as e:  # argparse's errors
        return int(e.code)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link", "fast"], "bench: --link must be 'loopback' or RATE[:DELAY] such as 2gbit or 1gbit:2ms, got 'fast'"),
        (["--iters", "2", "--rounds", "3"], "bench: rounds must be between 1 and iters (2), got 3"),
        (["--modes", "local,comm,local"], "bench: each mode may be named once; named more than once: local"),
    ],
)
def test_the_bench_rejects_bad_options_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert bench_exit(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == message and captured.out == ""


def test_the_bench_rejects_bad_flags_with_argparse_s_usage(capsys: pytest.CaptureFixture) -> None:
    assert bench_exit(["--interleave", "rounds"]) == 2
    assert "argument --interleave: invalid choice: 'rounds'" in capsys.readouterr().err
    # A bucket flag is checked by argparse (graphddp.tools.bucket_args, the same for demo, inspect and bench): its
    # usage line, then the one line that names the flag; no traceback.
    assert bench_exit(["--last-bucket-cap-mb", "-1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "python -m bench: error: argument --last-bucket-cap-mb: must be a finite number of MiB >= 0 or auto, got '-1'"
    )


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


# -- the bucket arguments: one helper for graphddp demo, graphddp inspect and python -m bench ------------------------
CAP_FLAGS = ("--bucket-cap-mb", "--first-bucket-cap-mb", "--last-bucket-cap-mb")
BUCKET_FLAGS = (*CAP_FLAGS, "--no-bucket-ramps", "--no-sparse-embedding-grads", "--channels")


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    from bench.__main__ import build_parser as bench_parser
    from graphddp.tools.cli import build_parser

    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {"demo": commands.choices["demo"], "inspect": commands.choices["inspect"], "bench": bench_parser()}


def bucket_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] in BUCKET_FLAGS}


def test_the_three_commands_take_the_same_bucket_flags_from_one_helper() -> None:
    from bench.run import BenchOptions
    from graphddp.ddp import BucketOptions
    from graphddp.tools.bucket_args import cap_mb
    from graphddp.tools.demo import DemoOptions

    parsers = command_parsers()
    described = {
        name: {flag: (a.dest, a.type, a.help, a.metavar, a.const, a.nargs) for flag, a in bucket_actions(p).items()}
        for name, p in parsers.items()
    }
    assert set(described["demo"]) == set(BUCKET_FLAGS)
    assert described["demo"] == described["inspect"] == described["bench"]
    assert all(bucket_actions(p)[flag].type is cap_mb for p in parsers.values() for flag in CAP_FLAGS)
    # Each command keeps its own defaults: the demo's small caps, graphddp.DDP's for inspect and the bench.
    for name, options in (("demo", DemoOptions()), ("inspect", BucketOptions()), ("bench", BenchOptions())):
        defaults = {a.dest: a.default for a in bucket_actions(parsers[name]).values()}
        assert defaults == {f: getattr(options, f) for f in defaults}, name


@pytest.mark.parametrize("command", ["demo", "inspect", "bench"])
def test_auto_and_numbers_parse_to_bucket_options(command: str) -> None:
    from graphddp.ddp import BucketOptions
    from graphddp.tools.bucket_args import bucket_options

    positional = ["gpt"] if command == "inspect" else []
    parser = command_parsers()[command]
    args = parser.parse_args([*positional, "--bucket-cap-mb", "auto", "--first-bucket-cap-mb", "0.5", "--last-bucket-cap-mb", "AUTO"])
    options = bucket_options(args)
    assert options == BucketOptions(bucket_cap_mb="auto", first_bucket_cap_mb=0.5, last_bucket_cap_mb="auto")
    assert options.caps_search is not None and options.caps_search.first_mb == 0.5
    flags = bucket_options(parser.parse_args([*positional, "--no-bucket-ramps", "--no-sparse-embedding-grads", "--channels", "3"]))
    assert not flags.bucket_ramps and not flags.sparse_embedding_grads and flags.channels == 3
    assert bucket_options(parser.parse_args([*positional, "--channels", "auto"])).channels == "auto"


@pytest.mark.parametrize("command", ["demo", "inspect", "bench"])
@pytest.mark.parametrize(("value", "message"), [("0", "must be at least 1"), ("two", "must be a whole number of process groups")])
def test_a_bad_channel_count_is_an_argparse_error(command: str, value: str, message: str, capsys: pytest.CaptureFixture) -> None:
    from bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        if command == "bench":
            bench_main(["--channels", value])
        else:
            main([command, *(["gpt"] if command == "inspect" else []), "--channels", value])
    assert exit_info.value.code == 2
    assert f"error: argument --channels: {message}" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError), (True, TypeError), ("2", TypeError), (1.5, TypeError)])
def test_channels_must_be_a_whole_number_of_groups(value: object, error: type[Exception]) -> None:
    from graphddp.ddp import BucketOptions, DDPOptions

    for options in (BucketOptions, DDPOptions):
        with pytest.raises(error, match="channels must be"):
            options(channels=value)  # type: ignore[arg-type]
        assert options(channels="auto").channels == "auto"  # the step cost model picks (Note [Channels])


@pytest.mark.parametrize("command", ["demo", "inspect", "bench"])
@pytest.mark.parametrize("flag", CAP_FLAGS)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "must be a finite number of MiB >= 0 or auto, got '-1'"),
        ("nan", "must be a finite number of MiB >= 0 or auto, got 'nan'"),
        ("inf", "must be a finite number of MiB >= 0 or auto, got 'inf'"),
        ("big", "must be a number of MiB or auto, got 'big'"),
    ],
)
def test_a_bad_cap_is_an_argparse_error_naming_the_flag(command: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture) -> None:
    from bench.__main__ import main as bench_main

    with pytest.raises(SystemExit) as exit_info:
        if command == "bench":
            bench_main([flag, value])
        else:
            main([command, *(["gpt"] if command == "inspect" else []), flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: argument {flag}: {message}")


def test_inspect_with_auto_caps_asks_for_the_link(capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "mlp", "--size", "tiny", "--bucket-cap-mb", "auto"]) == 2
    assert capsys.readouterr().err.strip() == (
        "graphddp inspect: automatic caps are chosen for a link and a world size: give the link to plan for with "
        "--link RATE[:LATENCY] (e.g. --link 10gbit or --link 10gbit:20us) and the ranks with --world-size"
    )


def test_the_bench_times_automatic_caps_as_a_mode(capsys: pytest.CaptureFixture) -> None:
    from bench.__main__ import main as bench_main

    assert bench_main(["--first-bucket-cap-mb", "auto"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench: the run's caps must be numbers of MiB (PyTorch's modes, the comm mode and the predictions plan with "
        "them), got auto for first_bucket_cap_mb; time automatic caps as a mode, e.g. --modes local,comm,graphddp-compiled@auto"
    )


def test_version_names_graphddp_and_torch(capsys: pytest.CaptureFixture) -> None:
    from graphddp import __version__

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["--version"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"graphddp {__version__} (torch ") and torch.__version__.split("+")[0] in out, out


def test_the_package_ships_py_typed() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    section = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert 'graphddp = ["py.typed"]' in section, section
    assert (root / "graphddp" / "py.typed").is_file()


def test_graphddp_bench_forwards_to_the_installed_benchmark(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["bench", "overhead", "--help"])  # graphddp.bench.overhead's own help
    assert exit.value.code == 0 and "--world-sizes" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "mlp", "--no-such-flag"])  # other commands still refuse what they do not know
    assert exit.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_the_bench_launches_its_worker_from_the_package_it_was_imported_as() -> None:
    import bench.run
    import graphddp.bench.run

    assert bench.run._torchrun(2, 1, 0, "127.0.0.1", "c")[-2] == "bench.worker"  # python -m bench, in the repository
    assert graphddp.bench.run._torchrun(2, 1, 0, "127.0.0.1", "c")[-2] == "graphddp.bench.worker"  # installed
