"""A smoke run of the benchmark: tiny sizes, loopback, every mode, every output file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.modes import NO_DDP

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the default suite stays under 10 minutes on 2 cores
def test_bench_smoke_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--iters", "2", "--warmup", "0", "--inner", "aot_eager",
         "--modes", "local,local-compiled,comm,bound,bound-backward,naive,torch-eager,torch-compiled,graphddp-eager,graphddp-compiled,graphddp-eager@auto+step",
         "--out", str(tmp_path)],  # default caps: PyTorch's DDPOptimizer refuses a bucket cap below its 1 MiB first cap
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    assert list(summary["modes"]) == [
        "local", "local-compiled", "comm", "bound", "bound-backward", "naive", "torch-eager", "torch-compiled", "graphddp-eager", "graphddp-compiled",
        "graphddp-eager@auto+step",
    ]  # fmt: skip
    for name, mode in summary["modes"].items():
        assert mode["median_s"] > 0 and mode["min_s"] <= mode["median_s"] <= mode["max_s"]
        assert len(mode["round_medians_s"]) == 2  # --rounds 2 (the default)
        phases = set(mode["phases_s"])
        with_wait = {"forward", "backward", "allreduce", "optimizer"}
        expected = {"comm": {"allreduce"}, "naive": with_wait, "bound": with_wait, "bound-backward": with_wait}
        assert phases == expected.get(name, {"forward", "backward", "optimizer"}), (name, phases)
        reducer_ran = name.startswith("graphddp") and summary["reductions"][name] != "in_graph"
        assert (mode["tail_s"] is not None) == reducer_ran, name  # only a graphddp Reducer says
        assert isinstance(mode["page_faults"], (int, float)) and mode["page_faults"] >= 0, (name, mode["page_faults"])
        # The step cost model's prediction beside every mode but the compute and the bound (Note [Step cost model]).
        unpredicted = name in NO_DDP
        assert unpredicted == ("predicted_s" not in mode) and mode.get("predicted_s", 1) > 0, (name, mode)
    assert set(summary["calibration"]) == {
        "latency_s", "seconds_per_byte", "cpu_seconds_per_byte", "assembly_seconds_per_byte", "chunked_step_ratio"
    }
    assert summary["calibration"]["chunked_step_ratio"] > 0  # the bench optimizer's chunked steps against whole ones
    assert summary["calibration"]["assembly_seconds_per_byte"] > 0
    for mode, layout in summary["buckets"].items():  # what each all-reduce lets step, and leaves to put together
        assert layout is None or all({"stepped", "assembled", "bucket"} <= set(b) for b in layout), mode
    assert summary["modes"]["graphddp-eager@auto+step"]["phases_s"]["optimizer"] < summary["modes"]["graphddp-eager"]["phases_s"]["optimizer"]
    # The @auto mode's calibration and choice, per rank and round, as its DDP made them (AutoCaps.as_record); no other
    # mode's. The calibration is rank 0's, broadcast, and the eager choice follows the broadcast ready times: every
    # rank's record is the same but for its rank.
    assert list(summary["auto_caps"]) == ["graphddp-eager@auto+step"], summary["auto_caps"]
    per_rank = summary["auto_caps"]["graphddp-eager@auto+step"]
    assert [len(rounds) for rounds in per_rank] == [2, 2]  # --rounds 2: each round builds its DDP
    for records in zip(*per_rank):
        assert [r["rank"] for r in records] == [0, 1] and records[0] == {**records[1], "rank": 0}, records
        (choice,) = records[0]["choices"]  # eager: one choice, from the first backward's ready times
        assert choice["source"] == "first backward" and choice["predicted_ms"] > 0 and choice["standing_ms"] > 0, choice
    assert any(line.startswith("graphddp-eager@auto+step") and ": automatic caps " in line for line in result.stdout.splitlines())
    assert set(summary["ratios"]) == set(summary["ratio_rounds"]) == {
        "graphddp-compiled / torch-compiled", "graphddp-eager / torch-eager", "graphddp-compiled / max(local-compiled, comm)"
    }
    assert all(len(r) == 2 for r in summary["ratio_rounds"].values())
    if len(os.sched_getaffinity(0)) >= 2:  # each rank on a CPU of its own (--no-pin lets the OS place them)
        cpus = summary["rank_cpus"]
        assert all(len(c) == 1 for c in cpus) and len({c[0] for c in cpus}) == len(cpus), cpus
    out = result.stdout.splitlines()
    assert out[-2].startswith("graphddp-compiled / max(local-compiled, comm):")  # the ratios come last, before the file list
    assert "round by round" in out[-2] and any(line.startswith("phase ms") for line in out)
    timeline = summary["timelines"]["graphddp-compiled"][0]
    kinds = {kind for kind, _, _, _ in timeline}
    # "done" comes from a future callback on gloo's thread: usually there, but not ordered with the rest.
    assert {"forward", "backward", "launch", "optimizer", "end"} <= kinds, kinds
    assert {"launch", "done"} <= {kind for kind, *_ in summary["timelines"]["torch-eager"][0]}  # from torch.profiler
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {"forward", "backward", "optimizer"} <= {e["name"] for e in trace["traceEvents"]}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in trace["traceEvents"])
    for e in trace["traceEvents"]:
        assert e["ph"] == "M" or (e["pid"], e["tid"]) in names, e  # every span on a named row
    assert (tmp_path / "modes.png").stat().st_size > 0 and (tmp_path / "timeline-graphddp-compiled.png").stat().st_size > 0


@pytest.mark.slow  # the default suite stays under 10 minutes on 2 cores
def test_bench_interleaved_by_steps_times_one_iteration_of_each_mode_in_turn(tmp_path: Path) -> None:
    """``--interleave steps``: every mode alive at once, one iteration of each in turn (from each iteration's
    recorded start), each mode compiled apart (two compiled graphddp modes share the DDP's forward, yet neither
    reuses the other's graph: no compile while timed), and both still reduce in-graph."""
    modes = ["local", "local-compiled", "torch-compiled", "graphddp-compiled", "graphddp-compiled+step"]
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--iters", "4", "--rounds", "2", "--warmup", "0", "--inner", "aot_eager",
         "--modes", ",".join(modes), "--interleave", "steps", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["options"]["interleave"] == "steps" and list(summary["modes"]) == modes
    assert summary["compiles_while_timed"] == 0
    assert summary["reductions"]["graphddp-compiled"] == summary["reductions"]["graphddp-compiled+step"] == "in_graph"
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())["modes"]
        started = sorted((t, name, k) for name in modes for t, k in zip(record[name]["started_ns"], record[name]["round_of"]))
        for r in (0, 1):
            order = [name for _, name, k in started if k == r]
            assert order == modes + modes[::-1], (rank, r, order)  # two iterations a round, the second pass reversed
