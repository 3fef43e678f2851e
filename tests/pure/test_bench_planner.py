"""The benchmark's planner pieces without running anything: mode variants, predictions from a recorded run,
the matrix's targets and the testbed limit, the scale projection, and the Chrome trace's rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import matrix, run, worker
from bench.modes import ModeConfig, ModeName, compute_baseline
from bench.pictures import _spans, chrome_trace
from bench.predict import _ready_fractions, compute_phases, mode_inputs, predict_modes
from bench.run import first_send
from bench.scale import project
from bench.worker import rows_sent
from graphddp.runtime import row_steps
from graphddp.runtime.reductions import goes_as_rows


def test_mode_variants_parse_and_bad_ones_say_what_is_allowed() -> None:
    assert ModeName.parse("graphddp-compiled@16") == ModeName("graphddp-compiled", "16", False)
    assert ModeName.parse("graphddp-eager@auto+step") == ModeName("graphddp-eager", "auto", True)
    assert ModeName.parse("graphddp-eager@auto").config(ModeConfig()).last_bucket_cap_mb == "auto"
    assert ModeName.parse("graphddp-eager@2.5").config(ModeConfig()).bucket_cap_mb == 2.5
    with pytest.raises(ValueError, match="only graphddp modes take @CAP, \\+step, \\+dense or \\+chK"):
        ModeName.parse("torch-eager@16")
    with pytest.raises(ValueError, match="the cap after @ must be a number of MiB or auto"):
        ModeName.parse("graphddp-compiled@big")
    with pytest.raises(ValueError, match="unknown mode 'graphddp'"):
        ModeName.parse("graphddp")
    assert ModeName.parse("graphddp-compiled+split").split and not ModeName.parse("graphddp-compiled").split
    assert ModeName.parse("graphddp-compiled@4+step+split") == ModeName("graphddp-compiled", "4", True, True)
    with pytest.raises(ValueError, match="only graphddp-compiled takes \\+split"):
        ModeName.parse("graphddp-eager+split")
    channels = ModeName.parse("graphddp-compiled+ch4+step")
    assert channels == ModeName("graphddp-compiled", None, True, False, 4) and channels.config(ModeConfig()).channels == 4
    assert ModeName.parse("graphddp-eager").config(ModeConfig()).channels == 1
    with pytest.raises(ValueError, match="unknown variant \\+ch0"):
        ModeName.parse("graphddp-eager+ch0")
    with pytest.raises(ValueError, match="only graphddp modes take"):
        ModeName.parse("torch-compiled+ch2")
    dense = ModeName.parse("graphddp-compiled+dense")
    assert dense.dense and not dense.config(ModeConfig()).sparse_embedding_grads
    assert ModeName.parse("graphddp-compiled").config(ModeConfig()).sparse_embedding_grads


def summary() -> dict:
    """A 2-rank run as bench.run summarises it: 1 byte per microsecond, no latency, no CPU cost; local computes
    100 ms forward, 200 ms backward, 50 ms optimizer; graphddp-eager launched its two 50 kB buckets halfway
    through backward and at its end (ms since the recorded iteration began)."""
    timeline = [
        ["forward", None, None, 0.0], ["backward", None, None, 100.0], ["ready", 0, "b", 150.0], ["ready", 0, "a", 200.0],
        ["launch", 0, None, 200.0], ["ready", 1, "c", 300.0], ["launch", 1, None, 300.0], ["finalize", None, None, 300.0],
        ["done", 0, None, 250.0], ["done", 1, None, 350.0], ["optimizer", None, None, 360.0], ["end", None, None, 400.0],
    ]  # fmt: skip
    phases = {"forward": 0.1, "backward": 0.2, "optimizer": 0.05}
    return {
        "options": {"world_size": 2, "bucket_cap_mb": 25, "first_bucket_cap_mb": 1, "last_bucket_cap_mb": 1, "bucket_ramps": True, "workload": "mlp"},
        "link": "1gbit",
        "calibration": {"latency_s": 0.0, "seconds_per_byte": 1e-6, "cpu_seconds_per_byte": 0.0},
        "params": [["a", 25_000], ["b", 25_000], ["c", 50_000]],
        "modes": {
            "local": {"median_s": 0.35, "phases_s": phases},
            "comm": {"median_s": 0.1, "phases_s": {}},
            "naive": {"median_s": 0.45, "phases_s": phases},
            "torch-eager": {"median_s": 0.4, "phases_s": phases},
            "graphddp-eager": {"median_s": 0.4, "phases_s": phases},
        },
        "timelines": {"graphddp-eager": [timeline, timeline]},
        "buckets": {"graphddp-eager": [{"bytes": 50_000, "sent": 50_000, "row_sparse": False}] * 2},
        "ratios": {"graphddp-eager / torch-eager": 1.0},
    }


def test_the_comm_mode_is_predicted_with_two_collectives_in_flight_as_gloo_runs_them() -> None:
    # Three 40 kB buckets (caps of 40 kB), issued at once; 2 ms of latency per message, 1 byte per microsecond:
    # one after another that is 3 x (2 x 2 ms + 40 ms); with gloo's two worker threads a bucket's latency runs
    # beside the previous one's bytes, so only the first's shows (cnn at 5 Gbit/s: +53 % one after another).
    s = summary()
    s["options"] |= {"bucket_cap_mb": 0.04 / 1.048576, "first_bucket_cap_mb": 0.04 / 1.048576, "last_bucket_cap_mb": 0.04 / 1.048576, "bucket_ramps": False}
    s["params"] = [["a", 40_000], ["b", 40_000], ["c", 40_000]]
    s["calibration"] = {"latency_s": 0.002, "seconds_per_byte": 1e-6, "cpu_seconds_per_byte": 0.0}
    assert predict_modes(s)["comm"]["predicted_s"] == pytest.approx(0.004 + 3 * 0.04)


def test_predictions_from_the_runs_own_measurements() -> None:
    predicted = predict_modes(summary())
    # graphddp-eager: bucket 0 complete at 100 ms of backward, 50 ms on the link; bucket 1 at 200 ms, 50 ms more.
    assert predicted["graphddp-eager"]["predicted_s"] == pytest.approx(0.1 + 0.2 + 0.05 + 0.05)
    assert predicted["graphddp-eager"]["exposed_s"] == pytest.approx(0.05)
    # The run's link has no latency to hide, so a second channel cannot pay: the planner keeps one.
    assert predicted["graphddp-eager"]["channels_pick"]["channels"] == 1
    assert "channels_pick" not in predicted["torch-eager"]  # PyTorch's DDP has one group
    # naive: every gradient after backward, one after another: 100 kB at 1 byte/us.
    assert predicted["naive"]["predicted_s"] == pytest.approx(0.35 + 0.1)
    assert predicted["comm"]["predicted_s"] == pytest.approx(0.1)  # one 100 kB bucket at the default caps
    # torch-eager: PyTorch's layout over graphddp-eager's ready times (b at 25 %, a at 50 %, c at 100 %): its first
    # bucket (the run's 25 MiB: an explicit cap is the first bucket's too) holds everything, complete at the end.
    assert predicted["torch-eager"]["predicted_s"] == pytest.approx(0.1 + 0.2 + 0.1 + 0.05)
    assert "local" not in predicted
    assert _ready_fractions(summary()) == {"a": 0.5, "b": 0.25, "c": 1.0}  # ms since the iteration began, both sides
    no_calibration = summary() | {"calibration": None}
    assert predict_modes(no_calibration) == {}


def test_an_in_graph_backward_ends_where_its_compute_ends_not_at_its_last_issue() -> None:
    # In-graph, profiled (bench.worker.profiled_timeline): a 100 kB bucket issued at 3/4 of the 200 ms backward, a
    # table's mask (the last bucket, 50 kB sent) at its end, the table's rows once the mask was back, 120 ms later:
    # the last issue, ``finalize``. Bucket 0 sends 150-250 ms into backward, the table 250-300: 100 ms exposed.
    s = summary()
    timeline = [
        ["forward", None, None, 0.0], ["backward", None, None, 100.0], ["launch", 0, None, 250.0], ["launch", 1, None, 300.0],
        ["done", 0, None, 350.0], ["done", 1, None, 400.0], ["launch", 2, None, 420.0], ["finalize", None, None, 420.0],
        ["done", 2, None, 430.0], ["optimizer", None, None, 440.0], ["end", None, None, 490.0],
    ]  # fmt: skip
    s["modes"]["graphddp-compiled"] = {"median_s": 0.45, "phases_s": s["modes"]["local"]["phases_s"]}
    s["timelines"]["graphddp-compiled"] = [timeline]
    s["buckets"]["graphddp-compiled"] = [{"bytes": 100_000, "sent": 100_000, "row_sparse": False}, {"bytes": 50_000, "sent": 50_000, "row_sparse": True}]
    expected = 0.1 + 0.2 + 0.1 + 0.05  # a window to finalize (320 ms) said 0.394: every bucket complete early
    assert predict_modes(s)["graphddp-compiled"]["predicted_s"] == pytest.approx(expected)
    # A timeline as steps in backward record it (the same mode predicted; only the events change): the mask goes
    # after the other buckets' steps, at 390 ms, and the backward's first wait (``compute_end``) is where its
    # compute ended. A window to the mask said 0.40.
    stepped = [e for e in timeline if e[:2] != ["launch", 1]] + [["launch", 1, None, 390.0], ["compute_end", None, None, 300.0]]
    s["timelines"]["graphddp-compiled"] = [sorted(stepped, key=lambda e: e[3])]
    assert predict_modes(s)["graphddp-compiled"]["predicted_s"] == pytest.approx(expected)


def test_the_matrix_reports_whether_the_model_would_step_the_optimizer_in_backward() -> None:
    """Issue 27, item 3: graphddp-compiled and ``+step`` with graphddp-eager's schedule. After backward the 50 ms
    optimizer follows bucket 1 (0.1 + 0.2 + 0.05 + 0.05 s); stepped per bucket, bucket 0's 25 ms step hides
    behind bucket 1 on the link, and only bucket 1's is left (0.375 s): a 6 % gain, above the margin."""
    s = summary()
    for mode, median in (("graphddp-compiled", 0.40), ("graphddp-compiled+step", 0.38)):
        s["modes"][mode] = {"median_s": median, "phases_s": s["modes"]["local"]["phases_s"]}
        s["timelines"][mode], s["buckets"][mode] = s["timelines"]["graphddp-eager"], s["buckets"]["graphddp-eager"]
    pick = predict_modes(s)["graphddp-compiled"]["step_pick"]
    assert pick["step_in_backward"] and pick["predicted_s"] == pytest.approx({"after": 0.4, "stepped": 0.375})
    for mode, predicted in predict_modes(s).items():
        s["modes"][mode].update(predicted)
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["step_pick"] == pytest.approx({"mode": "graphddp-compiled+step", "median_s": 0.38, "over_compiled": 0.95})
    assert "+step (0.950)" in matrix.report([result], command="c")
    # The limit target is also checked on the mode the model picks: what a user who follows the planner runs.
    assert result["ratios"]["model's pick / limit"] == pytest.approx(0.38 / result["limit_s"])
    assert result["met"]["model's pick / limit"] == (0.38 <= 1.10 * result["limit_s"])
    # With the @auto modes in the run, the planner's caps come with its optimizer pick.
    for mode, median in (("graphddp-compiled@auto", 0.39), ("graphddp-compiled@auto+step", 0.36)):
        s["modes"][mode] = {"median_s": median, "phases_s": s["modes"]["local"]["phases_s"]}
    with_auto = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert with_auto["step_pick"] == pytest.approx({"mode": "graphddp-compiled@auto+step", "median_s": 0.36, "over_compiled": 0.9})
    assert "+step @auto (0.900)" in matrix.report([with_auto], command="c")
    medians = {m: v["median_s"] for m, v in s["modes"].items()}
    assert matrix.planner_pick({"step_in_backward": False}, medians)["mode"] == "graphddp-compiled@auto"
    del medians["graphddp-compiled@auto+step"]  # one @auto mode only: the default caps for both picks
    assert [matrix.planner_pick({"step_in_backward": b}, medians)["mode"] for b in (False, True)] == ["graphddp-compiled", "graphddp-compiled+step"]
    del s["modes"]["graphddp-compiled+step"]  # no +step run: nothing to pick between
    assert "step_pick" not in predict_modes(s)["graphddp-compiled"]


def test_stepping_in_backward_steps_a_bucket_once_its_last_all_reduce_is_in() -> None:
    # The recorded layout says which all-reduce lets which bytes step: a bucket in two pieces steps after its
    # second, and a tied table's part never on its own. Without that record each all-reduce steps its own bytes.
    s = summary()
    s["modes"]["graphddp-compiled+step"] = {"median_s": 0.38, "phases_s": s["modes"]["local"]["phases_s"]}
    s["timelines"]["graphddp-compiled+step"] = s["timelines"]["graphddp-eager"]
    s["buckets"]["graphddp-compiled+step"] = [
        {"bytes": 50_000, "sent": 50_000, "row_sparse": False, "stepped": 0},
        {"bytes": 50_000, "sent": 50_000, "row_sparse": False, "stepped": 100_000},
    ]
    assert mode_inputs(s, "graphddp-compiled+step").step_per_bucket_s == pytest.approx((0.0, 0.05))
    # Big parameters stepped in cache-sized chunks (Note [Steps by rows]) at the calibrated ratio: 60 of the
    # 100 kB stepped at 0.5 of the time a byte.
    s["buckets"]["graphddp-compiled+step"][1]["chunked"] = 60_000
    s["calibration"]["chunked_step_ratio"] = 0.5
    assert mode_inputs(s, "graphddp-compiled+step").step_per_bucket_s == pytest.approx((0.0, 0.05 * (40 + 30) / 100))
    del s["calibration"]["chunked_step_ratio"]
    for bucket in s["buckets"]["graphddp-compiled+step"]:
        del bucket["stepped"]
    assert mode_inputs(s, "graphddp-compiled+step").step_per_bucket_s == pytest.approx((0.025, 0.025))


def test_the_matrix_checks_each_target_and_the_limit_counts_the_cpu_cost() -> None:
    s = summary()
    s["calibration"]["cpu_seconds_per_byte"] = 1e-6  # 100 kB sent costs 100 ms of compute
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    s["modes"]["graphddp-compiled"] = {"median_s": 0.5, "phases_s": s["modes"]["local"]["phases_s"]}
    assert matrix.testbed_limit(s) == pytest.approx(0.35 + 0.1)
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["ratios"]["graphddp-compiled / limit"] == pytest.approx(0.5 / 0.45)
    assert result["met"] == {"graphddp-eager / torch-eager": False, "graphddp-compiled / limit": False}
    # 0.97 × torch-eager's 0.40 s is under the 0.45 s limit: no schedule meets that target in this cell.
    assert result["below_limit"] == ["graphddp-eager / torch-eager"]
    assert "graphddp-eager / torch-eager (below the testbed's limit)" in matrix.report([result], command="c")
    s["modes"]["torch-eager"]["median_s"] = 0.5
    assert matrix.cell("mlp", "1gbit", s, swept=None)["below_limit"] == []
    s["modes"]["comm"]["median_s"] = 0.5  # the link binds: it can only start once the 100 ms forward is over
    assert matrix.testbed_limit(s) == pytest.approx(0.1 + 0.5)
    swept = {"modes": {"graphddp-compiled@4": {"median_s": 1.0}, "graphddp-compiled@25": {"median_s": 0.9}, "graphddp-compiled@auto": {"median_s": 0.92}}}
    result = matrix.cell("mlp", "1gbit", s, swept=swept)
    assert result["sweep"]["best_fixed"] == "25" and result["met"]["auto within 3 % of the best fixed cap"]


def test_the_matrix_gives_the_ratios_to_the_limit_round_by_round() -> None:
    """Each round's medians against that round's limit (``bound`` beside the compute, or the forward then
    ``comm``): with the modes interleaved step by step, the rounds' spread is the noise left in the cell's ratio."""
    s = summary()
    s["options"]["rounds"] = 3
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    s["modes"]["graphddp-compiled"] = {"median_s": 0.5, "phases_s": s["modes"]["local"]["phases_s"], "round_medians_s": [0.48, 0.5, 0.6]}
    s["modes"]["bound"] = {"median_s": 0.45, "phases_s": {}, "round_medians_s": [0.4, 0.45, 0.5]}
    s["modes"]["comm"]["round_medians_s"] = [0.1, 0.1, 0.45]  # the third round's link binds: forward 0.1 + 0.45
    for mode in ("local", "naive", "torch-eager", "graphddp-eager"):
        s["modes"][mode]["round_medians_s"] = [s["modes"][mode]["median_s"]] * 3
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["ratio_rounds"]["graphddp-compiled / limit"] == pytest.approx([0.48 / 0.4, 0.5 / 0.45, 0.6 / 0.55])
    text = matrix.report([result], command="c")
    assert f"{0.5 / 0.45:.3f} ✗ (rounds 1.09-1.20)" in text
    # The model's pick too (here +step, predicted faster), and without ``bound`` each round's limit is its compute
    # plus the CPU its bytes cost (0.1 s for 100 kB at 1 µs/B).
    s["modes"]["graphddp-compiled+step"] = {"median_s": 0.44, "phases_s": s["modes"]["local"]["phases_s"], "round_medians_s": [0.4, 0.44, 0.5]}
    s["modes"]["graphddp-compiled"]["step_pick"] = {"step_in_backward": True}
    del s["modes"]["bound"]
    s["calibration"]["cpu_seconds_per_byte"] = 1e-6
    s["modes"]["local"]["round_medians_s"] = [0.3, 0.35, 0.4]
    rounds = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)["ratio_rounds"]
    assert rounds["model's pick / limit"] == pytest.approx([0.4 / 0.4, 0.44 / 0.45, 0.5 / 0.55])
    del s["modes"]["graphddp-compiled+step"]["round_medians_s"]  # a mode without rounds: no spread, no error
    assert "model's pick / limit" not in matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)["ratio_rounds"]
    s["options"]["rounds"] = 1  # a run of one round: nothing to spread
    assert "graphddp-compiled / limit" not in matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)["ratio_rounds"]


def test_the_matrix_shows_the_backward_floor_and_the_targets_no_ddp_meets_under_it() -> None:
    s = summary()
    s["calibration"]["cpu_seconds_per_byte"] = 1e-6
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    s["modes"]["graphddp-compiled"] = {"median_s": 0.5, "phases_s": s["modes"]["local"]["phases_s"]}
    s["modes"]["torch-eager"]["median_s"] = 0.5  # 0.97 × 0.5 is above the 0.45 s limit
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["backward_floor_s"] is None and result["below_backward_floor"] == []
    s["modes"]["bound-backward"] = {"median_s": 0.49, "phases_s": {}}  # the link costs more beside the backward
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["below_limit"] == [] and result["backward_floor_s"] == pytest.approx(0.49)
    assert result["below_backward_floor"] == ["graphddp-eager / torch-eager"]  # 0.485 s < 0.49 s
    assert result["limit_s"] == pytest.approx(0.45)  # the limit stays the issue's
    text = matrix.report([result], command="c")
    assert "graphddp-eager / torch-eager (below the backward floor: no DDP meets it here)" in text
    header, _, row = text.splitlines()[2:5]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["backward floor ms"] == "490" and cells["limit ms"] == "450"


def test_the_matrix_holds_compiled_to_issue_27s_095_of_torch_compiled_and_marks_it_from_that_target() -> None:
    # Issue 27: graphddp-compiled <= 0.95 x torch-compiled where the limit allows it. The column's header, its tick
    # and the cell's marker all read the one figure in TARGETS (the matrix used to check issue 14's 0.90).
    s = summary()
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    s["modes"]["graphddp-compiled"] = {"median_s": 0.46, "phases_s": s["modes"]["local"]["phases_s"]}
    s["modes"]["torch-compiled"] = {"median_s": 0.49, "phases_s": s["modes"]["local"]["phases_s"]}
    s["ratios"]["graphddp-compiled / torch-compiled"] = 0.46 / 0.49  # 0.939: over 0.90, under 0.95
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert matrix.TARGETS["graphddp-compiled / torch-compiled"] == 0.95
    assert result["met"]["graphddp-compiled / torch-compiled"]
    text = matrix.report([result], command="c")
    header, _, row = text.splitlines()[2:5]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["ratio (≤0.95)"] == "0.939 ✓" and cells["ratio (≤0.97)"] == "1.000 ✗"
    # With rounds recorded, each ratio shows their range beside it; the mark stays the ratio of medians'.
    s["ratio_rounds"] = {"graphddp-compiled / torch-compiled": [0.90, 0.97, 1.12], "graphddp-eager / torch-eager": [1.0]}
    header, _, row = matrix.report([matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)], command="c").splitlines()[2:5]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|"))))
    assert cells["ratio (≤0.95)"] == "0.939 ✓ (rounds 0.90-1.12)" and cells["ratio (≤0.97)"] == "1.000 ✗"
    # 0.95 x 0.44 s is under this cell's 0.35 s + 0.1 s limit: no schedule meets it, and the cell says so.
    s["calibration"]["cpu_seconds_per_byte"] = 1e-6
    s["modes"]["torch-compiled"]["median_s"] = 0.44
    assert "graphddp-compiled / torch-compiled" in matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)["below_limit"]


def test_compiled_modes_are_limited_and_predicted_by_the_compiled_compute_where_the_run_measured_it() -> None:
    # Inductor's kernels are not eager's: with local-compiled measured, a compiled mode's limit and prediction start
    # from its compute (here 20 % faster throughout), an eager mode's still from local's.
    s = summary()
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    s["timelines"]["graphddp-compiled"] = s["timelines"]["graphddp-eager"]
    s["modes"]["graphddp-compiled"] = {"median_s": 0.5, "phases_s": s["modes"]["local"]["phases_s"]}
    eager_limit, before = matrix.testbed_limit(s), predict_modes(s)
    local = s["modes"]["local"]
    s["modes"]["local-compiled"] = {"median_s": 0.8 * local["median_s"], "phases_s": {k: 0.8 * v for k, v in local["phases_s"].items()}}
    assert compute_baseline("graphddp-compiled", s["modes"]) == "local-compiled" == compute_baseline("torch-compiled", ["local-compiled"])
    assert compute_baseline("graphddp-eager", s["modes"]) == "local" == compute_baseline("graphddp-compiled", ["local"])
    assert matrix.testbed_limit(s) == pytest.approx(0.8 * eager_limit)  # the link is idle here: compute binds
    s["modes"]["bound"] = {"median_s": 0.9 * eager_limit, "phases_s": {}}  # measured beside the link: it replaces the model
    assert matrix.testbed_limit(s) == pytest.approx(0.9 * eager_limit)
    del s["modes"]["bound"]
    after = predict_modes(s)
    assert after["graphddp-compiled"]["predicted_s"] < before["graphddp-compiled"]["predicted_s"]
    assert after["graphddp-eager"]["predicted_s"] == before["graphddp-eager"]["predicted_s"]
    assert "local-compiled" not in after


def test_the_compute_phases_take_the_slower_ranks_step_the_bench_times() -> None:
    # The step is timed as the slower rank's, each phase as the median over both ranks: here the phases add up to
    # 350 ms and local's step is 420 ms. Predictions and the limit's forward take the phases scaled by 1.2.
    s = summary()
    before = predict_modes(s)
    s["modes"]["local"]["median_s"] = 0.42
    assert compute_phases(s, "graphddp-eager") == pytest.approx((0.12, 0.24, 0.06))
    after = predict_modes(s)
    # graphddp-eager: 120 ms forward, buckets complete halfway (120 ms) and at the end (240 ms) of backward, then
    # 50 ms on the link and the 60 ms optimizer.
    assert after["graphddp-eager"]["predicted_s"] == pytest.approx(0.12 + 0.24 + 0.05 + 0.06)
    assert after["graphddp-eager"]["predicted_s"] > before["graphddp-eager"]["predicted_s"]
    s["modes"]["comm"]["median_s"] = 0.5  # the link binds: it starts after the slower rank's forward
    s["buckets"]["graphddp-compiled"] = s["buckets"]["graphddp-eager"]
    assert matrix.testbed_limit(s) == pytest.approx(0.12 + 0.5)


def test_a_cell_with_more_ranks_than_cpus_is_marked_and_compared_with_no_target() -> None:
    """Issue 27, item 5: 3 ranks on a 2-CPU machine measure the scheduler; the figures stay, the targets do not."""
    s = summary()
    s["options"]["world_size"] = 3
    result = matrix.cell("mlp", "1gbit", s, swept=None, cpus=2)
    assert result["oversubscribed"] and result["met"] == {} and result["ratios"]
    text = matrix.report([result], command="c")
    assert "mlp ‡" in text and "Targets missed: none" in text and "‡ not compared (more ranks than CPUs" in text
    assert not matrix.cell("mlp", "1gbit", s, swept=None, cpus=4)["oversubscribed"]
    # Nor are its predictions counted: a 2-rank cell's are, the 3-rank cell's (50 % off) are not.
    two = summary()
    result["prediction_error"] = {"graphddp-eager": 0.5}
    compared = matrix.cell("mlp", "1gbit", two, swept=None, cpus=2) | {"prediction_error": {"graphddp-eager": 0.05}}
    assert "Predictions within 15 %: 1 of 1 (mode, cell) pairs outside ‡ cells" in matrix.report([compared, result], command="c")


def test_scale_projection_slows_with_ranks() -> None:
    projected = project(summary() | {"modes": {**summary()["modes"], "graphddp-compiled": summary()["modes"]["graphddp-eager"]}, "timelines": {"graphddp-compiled": summary()["timelines"]["graphddp-eager"]}, "buckets": {"graphddp-compiled": summary()["buckets"]["graphddp-eager"]}})
    assert projected is not None and list(projected) == [2, 8, 64, 256]
    assert projected[2][0] == pytest.approx(0.4) and projected[256][0] > projected[2][0]
    assert 1 >= projected[2][1] > projected[256][1]
    best = project(summary() | {"modes": {**summary()["modes"], "graphddp-compiled": summary()["modes"]["graphddp-eager"]}, "timelines": {"graphddp-compiled": summary()["timelines"]["graphddp-eager"]}, "buckets": {"graphddp-compiled": summary()["buckets"]["graphddp-eager"]}}, algorithm="best")
    assert best is not None and best[2] == projected[2] and best[256][0] <= projected[256][0]


def test_overlapping_collectives_get_rows_of_their_own_and_the_trace_is_chrome_format(tmp_path: Path) -> None:
    timeline = [["launch", 0, None, 0.0], ["launch", 1, None, 1.0], ["done", 0, None, 5.0], ["done", 1, None, 3.0], ["launch", 2, None, 4.0], ["done", 2, None, 6.0]]
    rows = {name: row for name, _, _, row in _spans(timeline)}
    assert rows == {"bucket 0": "comm 0", "bucket 1": "comm 1", "bucket 2": "comm 1"}  # 2 starts after 1 ends
    chrome_trace({"timelines": {"graphddp-eager": [timeline]}}, tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {1: "comm 0", 2: "comm 1"}
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["graphddp-eager rank 0"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["name"], e["tid"], e["ts"], e["dur"]) for e in spans} == {("bucket 0", 1, 0.0, 5000.0), ("bucket 1", 2, 1000.0, 2000.0), ("bucket 2", 2, 4000.0, 2000.0)}


def test_the_gpu_bench_compares_each_graphddp_variant_with_pytorchs_mode_of_its_kind() -> None:
    from bench.gpu import MODES, summary_line

    assert "graphddp-compiled+split" in MODES  # in-graph (the default) and the split, side by side
    figures = {"forward_backward_s": 0.015, "optimizer_s": 0.003, "peak_memory_bytes": 2**30}
    records = [
        {"mode": "torch-compiled", "step_s": 0.020, **figures},
        {"mode": "graphddp-compiled", "step_s": 0.018, "reduction": "in_graph", **figures},
        {"mode": "graphddp-compiled+split", "step_s": 0.021, "reduction": "split (asked for)", **figures},
    ]
    assert summary_line(records[1], records).endswith("×0.900 of torch-compiled  [in_graph]")
    assert summary_line(records[2], records).endswith("×1.050 of torch-compiled  [split (asked for)]")


def test_first_send_is_the_first_all_reduce_after_backward_begins() -> None:
    """``bench.run.first_send``: the first ``launch`` at or after the ``backward`` mark, in ms after it and as a
    share of the backward (to the ``optimizer`` mark); one before backward (a forward's unused bucket) does not
    count, and a timeline without a launch in backward gives None."""
    timeline = [
        ["forward", None, None, 0.0], ["launch", 0, None, 5.0], ["backward", None, None, 100.0],
        ["launch", 1, None, 150.0], ["launch", 2, None, 120.0], ["optimizer", None, None, 300.0],
    ]  # fmt: skip
    assert first_send(timeline) == pytest.approx({"ms": 20.0, "share": 0.1})
    assert first_send([row for row in timeline if row[0] != "launch" or row[3] < 100]) is None
    assert first_send([row for row in timeline if row[0] != "optimizer"]) is None


def test_a_row_sparse_bucket_counts_what_the_one_rule_sends() -> None:
    # A 100-row table of 400 bytes a row: the mask (1 byte a row), then the touched rows, or the whole table
    # where the union is too dense to go as rows (``goes_as_rows``, the Reducer's and the rows node's rule).
    table = SimpleNamespace(params=[SimpleNamespace(shape=(100, 100))], nbytes=40_000)
    sparse_enough = next(t for t in range(100, 0, -1) if goes_as_rows(t, 100))
    assert rows_sent(table, 10) == 100 + 4_000
    assert rows_sent(table, sparse_enough) == 100 + 400 * sparse_enough
    assert rows_sent(table, sparse_enough + 1) == 100 + 40_000  # went dense: mask and table
    assert rows_sent(table, None) == 40_000  # nothing recorded: the table


def test_a_gradient_sent_in_pieces_leaves_its_copy_for_the_end_of_backward() -> None:
    # The recorded layout says which all-reduce is a gradient's last piece, and how many bytes are then copied
    # back into one gradient; the calibration what a byte of that copy costs.
    s = summary()
    s["modes"]["graphddp-compiled"] = {"median_s": 0.4, "phases_s": s["modes"]["local"]["phases_s"]}
    s["timelines"]["graphddp-compiled"] = s["timelines"]["graphddp-eager"]
    s["buckets"]["graphddp-compiled"] = [
        {"bytes": 50_000, "sent": 50_000, "row_sparse": False, "stepped": 0, "assembled": 0},
        {"bytes": 50_000, "sent": 50_000, "row_sparse": False, "stepped": 100_000, "assembled": 100_000},
    ]
    assert mode_inputs(s, "graphddp-compiled").tail_per_bucket_s == ()  # no cost calibrated: nothing to charge
    s["calibration"]["assembly_seconds_per_byte"] = 2e-7
    assert mode_inputs(s, "graphddp-compiled").tail_per_bucket_s == pytest.approx((0.0, 0.02))
    # The copy follows the last piece's 50 ms on the link, before the 50 ms optimizer.
    assert predict_modes(s)["graphddp-compiled"]["predicted_s"] == pytest.approx(0.1 + 0.2 + 0.05 + 0.02 + 0.05)
    # Both all-reduces are blocks of one bucket: on two channels they share its group, as in-graph sends them.
    assert mode_inputs(s, "graphddp-compiled").bucket_of == ()  # a run that did not record the buckets
    for entry in s["buckets"]["graphddp-compiled"]:
        entry["bucket"] = 0
    assert mode_inputs(s, "graphddp-compiled").bucket_of == (0, 0)


def test_the_layout_says_which_stepped_bytes_go_in_cache_sized_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``chunked`` per block of a bucket in pieces (Note [Steps by rows]): the big gradient's rows where it is over
    ``CPU_CHUNK_BYTES``, none of the small parameters stepped with the last block."""
    import dataclasses

    import torch

    from graphddp.passes import BucketCaps, ParamSpec, plan_bucket_groups

    big = dataclasses.replace(ParamSpec.of("w", torch.zeros(64, 100)), one_matmul=True)  # 25 600 B in 3 blocks
    plan = plan_bucket_groups([[ParamSpec.of("b", torch.zeros(64)), big]], caps=BucketCaps(bucket=10_000, first=10_000, last=10_000))
    (bucket,) = plan.buckets
    assert bucket.piece_stepped_bytes() == (8800, 8400, 8400 + 256)
    monkeypatch.setattr(row_steps, "CPU_CHUNK_BYTES", 20_000)  # the runtime's rule: 50 rows of 400 B a chunk
    assert worker._chunked_in_pieces(bucket) == [8800, 8400, 8400]  # the bias (256 B) is not
    monkeypatch.setattr(row_steps, "CPU_CHUNK_BYTES", 30_000)
    assert worker._chunked_in_pieces(bucket) == [0, 0, 0]


def test_the_chunked_step_ratio_is_calibrated_only_for_a_run_that_steps_in_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """~1 s and ~320 MiB a rank: measured where a mode steps the optimizer in backward (the only prediction that
    reads it), not in every run."""
    monkeypatch.setattr(worker, "link_of", lambda: SimpleNamespace(latency_s=1e-4, seconds_per_byte=1e-9))
    monkeypatch.setattr(worker, "cpu_cost_of_communication", lambda **_: 2e-10)
    monkeypatch.setattr(worker, "assembly_seconds_per_byte", lambda: 3e-10)
    monkeypatch.setattr(worker, "chunked_step_ratio", lambda: 0.45)
    assert worker.calibrate(1, stepping=True) is None  # one rank: no link to model
    assert "chunked_step_ratio" not in worker.calibrate(2, stepping=False)
    assert worker.calibrate(2, stepping=True) == {
        "latency_s": 1e-4, "seconds_per_byte": 1e-9, "cpu_seconds_per_byte": 2e-10, "assembly_seconds_per_byte": 3e-10,
        "chunked_step_ratio": 0.45,
    }  # fmt: skip


def test_automatic_caps_are_kept_as_data_and_read_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """What ``bucket_cap_mb="auto"`` measured and chose (``AutoCaps.as_record``, kept per rank and round in
    ``results.json``) survives JSON, says what each choice was made for, and reads as one line per mode; the
    search time goes to the log, not the record (every rank's record is the same but for its rank)."""
    import torch

    from graphddp.passes import BucketCaps, CapsSearch, ComputeRates, LinkModel, ParamSpec
    from graphddp.runtime.auto_caps import AutoCaps

    auto = AutoCaps(
        CapsSearch(standing=BucketCaps()), LinkModel(latency_s=4e-4, seconds_per_byte=8e-9),
        ComputeRates(flops_per_s=5e10, bytes_per_s=4e9), 1.5e-9, world=2, rank=0,
    )  # fmt: skip
    assert auto.as_record()["choices"] == [] and auto.choices == ()
    specs = [ParamSpec.of(f"layer{i}.weight", torch.empty(1024, 1024)) for i in range(4)]  # 4 MiB each
    with caplog.at_level(logging.INFO, logger="graphddp.runtime.auto_caps"):
        caps = auto.for_ready_times(specs, [0.01, 0.02, 0.03, 0.04], backward_s=0.05)
    (logged,) = [r.getMessage() for r in caplog.records if "automatic caps" in r.getMessage()]
    assert "from the first backward (50 ms), searched in " in logged and caps.mb in logged
    record = json.loads(json.dumps(auto.as_record()))
    (choice,) = record["choices"]
    assert auto.choices[0].caps == caps and choice["caps"]["mb"] == caps.mb and record["standing"]["mb"] == "25/1/1"
    assert choice["source"] == "first backward" and choice["backward_s"] == 0.05
    assert choice["worst_regret"] == auto.choices[0].worst_regret >= 0.0 and choice["wire"] is None
    assert choice["robust"]["mb"] == auto.choices[0].robust.mb and choice["robust_ms"] > 0 and "search_s" not in choice
    assert choice["ready_s"] == [["layer0.weight", 0.01], ["layer1.weight", 0.02], ["layer2.weight", 0.03], ["layer3.weight", 0.04]]
    standing_ms = dict((c["mb"], ms) for c, ms in auto.as_record(top=100)["choices"][0]["ranking"])["25/1/1"]
    assert choice["standing_ms"] == pytest.approx(standing_ms) and record["link"]["latency_s"] == 4e-4

    link = {"latency_s": 1.5e-4, "seconds_per_byte": 8e-9, "algorithm": "ring"}
    rates = {"flops_per_s": 5.1e10, "bytes_per_s": 2.06e10}
    small, default = {"mb": "2/2/2"}, {"mb": "25/1/1"}
    chose = {"caps": small, "predicted_ms": 1233.3, "standing_ms": 1332.0, "kept_standing": False, "margin": 0.05, "ranking": [[small, 1233.3]]}
    kept = {"caps": default, "predicted_ms": 100.0, "standing_ms": 100.0, "kept_standing": True, "margin": 0.05, "ranking": [[small, 98.0], [default, 100.0]]}
    base = {"link": link, "rates": rates, "cpu_seconds_per_byte": 7.7e-10, "standing": default}
    line = run.automatic_caps_line({**base, "choices": [chose]})
    assert line == (
        "automatic caps chose 2/2/2 MiB (1233.3 ms predicted, 7.4% faster than 25/1/1 MiB's 1332.0 ms); from a link of "
        "150 µs and 1.00 Gbit/s, matmul 51 Gflop/s, elementwise 20.6 GB/s, gloo's CPU 0.77 ns/B"
    ), line
    line = run.automatic_caps_line({**base, "rates": {**rates, "launch_s": 1.41e-4}, "choices": [chose]})  # since session 45
    assert line.endswith("elementwise 20.6 GB/s, a launch 141 µs, gloo's CPU 0.77 ns/B"), line
    line = run.automatic_caps_line({**base, "choices": [{**chose, "worst_regret": 0.0123}]})  # since session 43
    assert line.startswith("automatic caps chose 2/2/2 MiB (1233.3 ms predicted, 7.4% faster than 25/1/1 MiB's 1332.0 ms, within 1.2% of the fastest at every compute speed); "), line
    line = run.automatic_caps_line({**base, "choices": [kept]})
    assert line.startswith("automatic caps kept 25/1/1 MiB (100.0 ms predicted; best 2/2/2 MiB 98.0 ms, 2.0% faster; margin 5%); "), line
    robust = {**kept, "robust": {"mb": "4/1/4"}, "robust_ms": 99.0, "worst_regret": 0.01}  # since session 43: the search's candidate
    line = run.automatic_caps_line({**base, "choices": [robust]})
    assert line.startswith("automatic caps kept 25/1/1 MiB (100.0 ms predicted; candidate 4/1/4 MiB 99.0 ms, 1.0% faster; margin 5%); "), line
    one, other = {**base, "choices": [chose]}, {**base, "choices": [kept]}
    assert run.automatic_caps_lines("m", [one, one]) == [f"m: {run.automatic_caps_line(one)}"]  # rounds alike: once
    assert [line.split(":")[0] for line in run.automatic_caps_lines("m", [one, other])] == ["m, round 1", "m, round 2"]


def test_page_faults_are_the_median_of_each_iterations_slowest_rank_and_absent_when_a_rank_did_not_count() -> None:
    # rank 0 and rank 1, three iterations each: the most per iteration is 15, 200, 40; their median 40.
    assert run._median_page_faults([[10, 200, 30], [15, 100, 40]]) == 40
    assert run._median_page_faults([[10, 200, 30], None]) is None  # a rank file from before the count
    assert run._whole(None) == "-" and run._whole(40.0) == "40"
