"""``graphddp inspect``: one process, no ranks; its plan equals the one a real 2-rank run adopts."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from ranks import run_on_ranks

import graphddp
from graphddp.compiler.capture import capture_graphs, parameter_names
from graphddp.compiler.graph_pipeline import prepare_graph
from graphddp.options import BucketOptions
from graphddp.passes import CAPS_MARGIN, BucketCaps, BucketPlan, CapsSearch, ComputeRates, MiB
from graphddp.passes.caps_choice import MIDDLE_MB
from graphddp.runtime.auto_caps import AutoCaps
from graphddp.runtime.rows_rule import RowsRule
from graphddp.tools.cli import main
from graphddp.tools.inspection import parse_link
from graphddp.tools.workloads import build_workload

TESTS = os.path.dirname(os.path.dirname(__file__))  # inspect_factories.py


def inspect_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert main(["inspect", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
def test_builtin_workloads(name: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", name, "--size", "tiny", "--bucket-cap-mb", "0.004", "--first-bucket-cap-mb", "0.002"]) == 0
    out = capsys.readouterr().out
    assert "bucket" in out and "inbound activation bytes" in out and "fingerprint" in out
    record = inspect_json(capsys, name, "--size", "tiny", "--bucket-cap-mb", "0.004", "--first-bucket-cap-mb", "0.002")
    (graph,) = record["graphs"]
    assert len(graph["segments"]) == len(graph["buckets"]) > 1
    assert graph["versions"] == {"graphddp": graphddp.__version__, "torch": torch.__version__}
    model = build_workload(name, size="tiny").model
    # Every parameter's whole gradient once; a tied table's parts (Note [Row-sparse gradients]) come on top.
    wholes = [p["name"] for b in graph["buckets"] for p in b["params"] if not p["part"]]
    assert sorted(wholes) == sorted(n for n, _ in model.named_parameters())
    parts = [(p["name"], p["part"]) for b in graph["buckets"] for p in b["params"] if p["part"]]
    assert parts == ([("wte.weight", "logits")] if name == "gpt" else [])


def test_a_factory_from_a_test_module(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    record = inspect_json(capsys, "inspect_factories:small_model", "--bucket-cap-mb", "0.0005", "--first-bucket-cap-mb", "0.0001")
    names = [[p["name"] for p in b["params"]] for b in record["graphs"][0]["buckets"]]
    assert names == [["4.weight", "4.bias"], ["2.weight", "2.bias"], ["0.weight", "0.bias"]]


def adopted_fingerprint(rank: int, world: int) -> str:
    workload = build_workload("gpt", size="tiny", seed=0)
    ddp = graphddp.DDP(workload.model, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002, sparse_embedding_grads=True)  # inspect without --link plans rows
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    data = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(*workload.make_batch(data)).backward()
    assert ddp.bucket_plan.source == "graph"
    return ddp.bucket_plan.fingerprint


def test_json_matches_the_plan_a_real_two_rank_run_adopts(capsys: pytest.CaptureFixture) -> None:
    record = inspect_json(capsys, "gpt", "--size", "tiny", "--bucket-cap-mb", "0.004", "--first-bucket-cap-mb", "0.002")
    adopted = run_on_ranks(adopted_fingerprint, 2, timeout=300)
    assert adopted == [record["fingerprint"]] * 2
    assert record["graphs"][0]["fingerprint"] == record["fingerprint"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("resnet", "graphddp inspect: unknown target 'resnet': give a built-in workload (gpt, mlp, cnn) or package.module:factory"),
        ("no_such_package.models:build", "graphddp inspect: cannot import 'no_such_package.models': ModuleNotFoundError: No module named 'no_such_package'"),
        ("inspect_factories:missing", "graphddp inspect: 'inspect_factories' has no callable 'missing'"),
        ("inspect_factories:raising", "graphddp inspect: inspect_factories:raising raised ValueError: the factory is broken"),
        ("inspect_factories:frozen", "graphddp inspect: inspect_factories:frozen: the model has no parameter that requires a gradient; there is nothing to plan"),
        ("inspect_factories:not_a_pair", "graphddp inspect: inspect_factories:not_a_pair must return (model, example_inputs), got Linear"),
    ],
)
def test_bad_targets_are_one_line_and_exit_2(target: str, message: str) -> None:
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "graphddp", "inspect", target], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [message]


def test_verbose_shows_the_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": TESTS}
    result = subprocess.run(
        [sys.executable, "-m", "graphddp", "inspect", "inspect_factories:raising", "--verbose"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode != 0 and "Traceback" in result.stderr and "the factory is broken" in result.stderr


def test_dump_from_inspect_has_every_segments_aot_graphs(tmp_path, capsys: pytest.CaptureFixture) -> None:
    record = inspect_json(capsys, "gpt", "--size", "tiny", "--bucket-cap-mb", "0.004", "--first-bucket-cap-mb", "0.002", "--dump", str(tmp_path))
    folder = tmp_path / "rank0" / "graph0"
    segments = record["graphs"][0]["segments"]
    assert not list((folder / "aot").glob("*.error.txt"))
    for s in segments:
        assert "tangents" in (folder / "aot" / f"submod_{s['index']}.backward.py").read_text()
    assert json.loads((folder / "plan.json").read_text())["fingerprint"] == record["fingerprint"]


def test_a_weight_tied_across_a_graph_break(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(TESTS)
    record = inspect_json(capsys, "inspect_factories:tied_across_break", "--bucket-cap-mb", "1e-6", "--first-bucket-cap-mb", "1e-6")
    assert len(record["graphs"]) == 2
    # Complete only after the embedding's backward; planned as rows from the graph's structure (the lookups' graph
    # uses it only for lookups), and left to the all-reduced mask at run time (Note [Row-sparse gradients]).
    assert [b["params"] for b in record["buckets"]][-1] == ["wte.weight[rows]"]


def adopted_wide_plan(rank: int, world: int) -> tuple[str, list[list[str]]]:
    from inspect_factories import wide_tied_gpt

    torch._dynamo.reset()
    module, (idx, targets) = wide_tied_gpt()
    ddp = graphddp.DDP(module, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002, sparse_embedding_grads=True)
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager"))
    for _ in range(2):
        model(idx, targets).backward()
    assert ddp.bucket_plan.source == "graph"
    return ddp.bucket_plan.fingerprint, [list(b.names) for b in ddp.bucket_plan.buckets]


def test_row_sparse_table_and_its_part_match_a_real_run_and_show_in_the_dump(
    tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(TESTS)
    args = ("inspect_factories:wide_tied_gpt", "--bucket-cap-mb", "0.004", "--first-bucket-cap-mb", "0.002")
    record = inspect_json(capsys, *args, "--dump", str(tmp_path))
    (graph,) = record["graphs"]
    assert graph["buckets"][0]["params"][0]["part"] == "logits" and graph["buckets"][-1]["row_sparse"]
    assert [(t["param"], t["part"]) for t in graph["taps"]] == [("wte.weight", "logits")]
    assert "self.tap_0(" in (tmp_path / "rank0" / "graph0" / "split.py").read_text()
    adopted = run_on_ranks(adopted_wide_plan, 2, timeout=300)
    assert [fingerprint for fingerprint, _ in adopted] == [record["fingerprint"]] * 2
    assert adopted[0][1][0] == ["wte.weight@logits"] and adopted[0][1][-1] == ["wte.weight[rows]"]
    # The plan is a function of the graph, not of how many rows the ranks' batches may touch (the all-reduced mask
    # decides that each iteration): five ranks plan alike. One rank has nothing to send: no rows, no part.
    five = inspect_json(capsys, *args, "--world-size", "5")
    assert five["graphs"][0]["taps"] == graph["taps"] and five["fingerprint"] == record["fingerprint"]
    one = inspect_json(capsys, *args, "--world-size", "1")
    assert not one["graphs"][0]["taps"] and one["fingerprint"] != record["fingerprint"]



def test_a_bad_world_size_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "graphddp", "inspect", "gpt", "--size", "tiny", "--world-size", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip() == "graphddp inspect: world size must be >= 1, got 0"


def test_link_predicts_the_step_and_a_slower_link_exposes_more(capsys: pytest.CaptureFixture) -> None:
    args = ("mlp", "--size", "small", "--bucket-cap-mb", "1", "--world-size", "2")
    fast = inspect_json(capsys, *args, "--link", "100gbit")["graphs"][0]["prediction"]
    slow = inspect_json(capsys, *args, "--link", "100mbit:1ms")["graphs"][0]["prediction"]
    buckets = [k for k in slow["timeline"] if k.startswith("bucket")]
    assert len(buckets) > 1 and slow["timeline"]["forward"][0] == 0.0
    # ~4 MB over 100 Mbit/s is ~0.17 s of link time per rank pair: far more than this MLP's backward.
    assert slow["step_s"] > fast["step_s"] + 0.1 and slow["exposed_s"] > 0.1 and fast["exposed_s"] < slow["exposed_s"]
    assert slow["critical_path"][-2].startswith("bucket"), slow["critical_path"]  # the link binds at the end
    assert main(["inspect", *args, "--link", "2gbit"]) == 0
    assert "predicted step (forward, backward, all-reduces; no optimizer)" in capsys.readouterr().out


def test_inspect_says_which_channels_the_model_picks_for_the_link(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast, near link: one channel (bytes bind); a path with 20 ms of latency per message and many small
    buckets: more (Note [Step cost model], channels). ``--channels`` predicts the step on that many."""
    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)  # the same in every call
    args = ("mlp", "--size", "small", "--bucket-cap-mb", "0.25", "--first-bucket-cap-mb", "0.25", "--world-size", "2")
    near = inspect_json(capsys, *args, "--link", "1gbit:50us")["graphs"][0]
    far = inspect_json(capsys, *args, "--link", "10gbit:20ms")["graphs"][0]
    assert near["channels_choice"]["channels"] == 1, near["channels_choice"]
    assert far["channels_choice"]["channels"] > 1, far["channels_choice"]
    on_two = inspect_json(capsys, *args, "--link", "10gbit:20ms", "--channels", "2")["graphs"][0]["prediction"]["step_s"]
    assert on_two == pytest.approx(far["channels_choice"]["predicted_s"]["2"], rel=1e-9)
    assert on_two < far["prediction"]["step_s"]
    assert main(["inspect", *args, "--link", "10gbit:20ms"]) == 0
    assert "channels the model picks: " in capsys.readouterr().out
    auto = inspect_json(capsys, *args, "--link", "10gbit:20ms", "--channels", "auto")  # as channels="auto" decides
    assert auto["channels"] == far["channels_choice"]["channels"], auto["channels"]
    assert main(["inspect", *args, "--channels", "auto"]) == 2  # for a link: which one?
    assert "channels='auto' are chosen for a link" in capsys.readouterr().err


def test_the_prediction_numbers_segments_as_the_segment_table(capsys: pytest.CaptureFixture) -> None:
    graph = inspect_json(capsys, "mlp", "--size", "small", "--bucket-cap-mb", "1", "--world-size", "2", "--link", "2gbit")["graphs"][0]
    indices = sorted(s["index"] for s in graph["segments"])
    timeline = graph["prediction"]["timeline"]
    first_start: dict[int, float] = {}  # a segment's blocks (in-graph, a big gradient in pieces) are parts of it
    for node, (start, _) in timeline.items():
        if node.startswith("segment"):
            index = int(node.split()[1])
            first_start[index] = min(start, first_start.get(index, start))
    in_backward = sorted((start, i) for i, start in first_start.items())
    assert len(indices) > 1 and sorted(first_start) == indices
    assert [i for _, i in in_backward] == indices[::-1], in_backward  # backward runs the last segment first
    blocks = [node for node in timeline if " block " in node]
    assert any(n.startswith("segment") for n in blocks) and any(n.startswith("bucket") for n in blocks), sorted(timeline)
    for node in blocks:  # weight gradients first: a segment's blocks run before the rest of it
        if node.startswith("segment"):
            assert timeline[node][1] <= timeline[" ".join(node.split()[:2])][0] + 1e-12, node


def test_a_bad_link_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "graphddp", "inspect", "mlp", "--size", "tiny", "--link", "fast"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == "graphddp inspect: --link must be RATE[:LATENCY] such as 2gbit or 10gbit:20us, got 'fast'"


# -- automatic caps (Note [Automatic caps]) ------------------------------------------------------------------------
RATES = ComputeRates(flops_per_s=1e11, bytes_per_s=1e10)
"""Fixed compute rates, so the choice is the same on every machine and load."""
AUTO = ("--bucket-cap-mb", "auto", "--first-bucket-cap-mb", "auto", "--last-bucket-cap-mb", "auto")


def compiled_run_choice(link: str, world: int) -> BucketPlan:
    """The plan of gpt (small) as a compiled run with every cap ``"auto"`` makes it, given its calibration
    (``graphddp.runtime.auto_caps.AutoCaps.for_graph`` in the backend's pipeline; reduced in-graph, so its big
    gradients predicted in blocks)."""
    workload = build_workload("gpt", size="small", seed=0)
    search = BucketOptions(bucket_cap_mb="auto", first_bucket_cap_mb="auto", last_bucket_cap_mb="auto").caps_search
    assert search is not None and search.standing == BucketCaps()  # the defaults stand until a choice beats them
    auto = AutoCaps(search, parse_link(link), RATES, cpu_seconds_per_byte=0.0, world=world, rank=0)
    rows = RowsRule(enabled="auto", link=parse_link(link), world=world)  # sparse_embedding_grads="auto"
    (captured,) = capture_graphs(workload.model, *workload.make_batch(torch.Generator().manual_seed(0)))
    prepared = prepare_graph(
        captured.gm, captured.example_inputs, parameter_names(workload.model),
        caps=lambda gm, params, rows_planned: auto.for_graph(gm, params, row_sparse=rows_planned, blocks=True), row_sparse=rows.for_graph,
    )  # fmt: skip
    assert prepared is not None
    return prepared.plan


def test_auto_caps_are_chosen_for_the_link_as_a_compiled_run_chooses_them(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)
    chosen = {}
    for link in ("1gbit", "10gbit:1ms"):
        record = inspect_json(capsys, "gpt", "--size", "small", *AUTO, "--link", link, "--world-size", "2")
        (graph,) = record["graphs"]
        auto = graph["automatic_caps"]
        assert auto["caps"] == graph["caps"]  # the graph is planned with the choice
        # The defaults, unless the candidate closest to the fastest at every compute speed beats them by more than
        # the margin at the measured one (Note [Automatic caps]); it is at most its worst regret behind the fastest.
        defaults = json.loads(json.dumps(dataclasses.asdict(BucketCaps())))
        (defaults_s,) = [c["predicted_s"] for c in auto["ranking"] if c["caps"] == defaults]
        fastest_s = auto["ranking"][0]["predicted_s"]
        if auto["kept_standing"]:
            assert auto["caps"] == defaults and auto["predicted_s"] == defaults_s, auto
            (robust_s,) = [c["predicted_s"] for c in auto["ranking"] if c["caps"] == auto["robust"]]
            assert robust_s >= (1 - CAPS_MARGIN) * defaults_s, auto
        else:
            (chosen_s,) = [c["predicted_s"] for c in auto["ranking"] if c["caps"] == auto["caps"]]
            assert auto["predicted_s"] == chosen_s < (1 - CAPS_MARGIN) * defaults_s, auto
            assert fastest_s <= chosen_s <= (1 + auto["worst_regret"]) * fastest_s * (1 + 1e-12), auto
        assert len(auto["ranking"]) == len(CapsSearch().candidates())  # the defaults are on the grid
        assert [c["predicted_s"] for c in auto["ranking"]] == sorted(c["predicted_s"] for c in auto["ranking"])
        expected = compiled_run_choice(link, 2)
        as_json = json.loads(json.dumps(dataclasses.asdict(expected.caps)))  # a tuple (BucketCaps.sequence) is a list
        assert graph["caps"] == as_json and graph["fingerprint"] == expected.fingerprint
        chosen[link] = (graph["caps"], len(graph["buckets"]))
    assert chosen["1gbit"] != chosen["10gbit:1ms"], chosen  # the link decides
    # The table says which caps were chosen, as the runtime's log line writes them.
    assert main(["inspect", "gpt", "--size", "small", *AUTO, "--link", "1gbit"]) == 0
    caps = BucketCaps(**chosen["1gbit"][0])
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("automatic caps"))
    assert line.startswith(f"automatic caps (Note [Automatic caps]): {caps.bucket / MiB:g}/{caps.first / MiB:g}/{caps.last / MiB:g} MiB;")


def test_auto_keeps_the_caps_the_user_fixed(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)
    args = ("gpt", "--size", "small", "--bucket-cap-mb", "auto", "--first-bucket-cap-mb", "0.25", "--last-bucket-cap-mb", "0.5")
    ranking = inspect_json(capsys, *args, "--link", "1gbit")["graphs"][0]["automatic_caps"]["ranking"]
    assert len(ranking) == len(MIDDLE_MB) and {(c["caps"]["first"], c["caps"]["last"]) for c in ranking} == {(MiB // 4, MiB // 2)}
    # One rank communicates nothing: as graphddp.DDP, no choice (and no link needed); the defaults stand in.
    one = inspect_json(capsys, *args, "--world-size", "1")["graphs"][0]
    assert "automatic_caps" not in one and one["caps"]["bucket"] == 25 * MiB


def test_inspect_says_how_each_graph_reduces(capsys) -> None:
    from graphddp.tools.inspection import inspect_target

    one_rank = inspect_target("gpt", size="tiny", world_size=1)
    assert [str(g.reduction) for g in one_rank.graphs] == ["in_graph (traceable)"]
    two_ranks = inspect_target("gpt", size="tiny", world_size=2)  # the tied table's rows, in-graph too
    assert [str(g.reduction) for g in two_ranks.graphs] == ["in_graph (traceable)"] and two_ranks.plan.parts
    # "auto" (the default) on a link given: a fast one keeps the table dense, a slow one sends rows (Note
    # [Row-sparse gradients], "When rows pay"); in-graph either way (Note [Rows in the compiled backward]).
    fast = inspect_target("gpt", size="tiny", world_size=2, link="100gbit")
    assert [str(g.reduction) for g in fast.graphs] == ["in_graph (traceable)"] and not fast.plan.parts
    slow = inspect_target("gpt", size="tiny", world_size=2, link="1mbit")
    assert [str(g.reduction) for g in slow.graphs] == ["in_graph (traceable)"] and slow.plan.parts
    assert inspect_target("gpt", size="tiny", world_size=2, link="100gbit", sparse_embedding_grads=True).plan.parts
    assert main(["inspect", "mlp", "--size", "tiny", "--reduction", "split", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs"][0]["reduction"] == "split (asked for)"
    with pytest.raises(SystemExit):  # argparse's choices name the three
        main(["inspect", "mlp", "--size", "tiny", "--reduction", "ingraph"])
    assert "invalid choice: 'ingraph'" in capsys.readouterr().err


def test_the_cpu_communication_costs_is_charged_as_a_run_charges_it(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--comm-cpu``: the compute each MB sent costs, as a CPU run measures and logs it. On the link given, it is
    charged to the tied table's part as the run's ``RowsRule`` charges it (its verdict turns at 100 Mbit/s for the
    tiny GPT's 64 x 32 table), and to the predicted step."""
    from graphddp.tools.inspection import inspect_target

    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)
    table = build_workload("gpt", size="tiny", seed=0).model.wte.weight
    for ms_per_mb in (0.0, 50.0):
        run = RowsRule(enabled="auto", link=parse_link("100mbit"), world=2, cpu_seconds_per_byte=ms_per_mb * 1e-9)
        rows = run.verdict([(table.shape[0], table.shape[1] * table.element_size())], parts=[1]).rows
        inspection = inspect_target("gpt", size="tiny", world_size=2, link="100mbit", comm_cpu_ms_per_mb=ms_per_mb)
        assert bool(inspection.plan.parts) == rows == (ms_per_mb == 0.0), (ms_per_mb, rows)
    dense = {  # the same plan both ways (several buckets, a fast link: what a bucket sent beside compute costs it binds)
        ms: inspect_target(
            "gpt", size="tiny", world_size=2, link="100gbit", sparse_embedding_grads=False, comm_cpu_ms_per_mb=ms,
            bucket_cap_mb=0.004, first_bucket_cap_mb=0.002, last_bucket_cap_mb=0.002,
        )
        for ms in (0.0, 50.0)
    }
    assert len(dense[0.0].plan.buckets) > 1
    assert dense[0.0].plan.fingerprint == dense[50.0].plan.fingerprint
    assert dense[50.0].graphs[0].prediction.step_s > dense[0.0].graphs[0].prediction.step_s
    charged = inspect_target("gpt", size="tiny", world_size=2, link="100mbit", comm_cpu_ms_per_mb=50.0).plan.fingerprint
    assert inspect_json(capsys, "gpt", "--size", "tiny", "--link", "100mbit", "--comm-cpu", "50")["fingerprint"] == charged


def test_the_cpu_communication_costs_is_not_charged_to_an_untied_table_under_fixed_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run measures gloo's CPU for the rows verdict only for a tied table's part (or with automatic caps, which
    measure it anyway): an untied table's verdict is the link's alone. Charged, 50 ms/MB would turn this 512 x 16
    table from dense to rows at 10 Gbit/s (its dense bytes cost more CPU than its rows)."""
    from graphddp.tools.inspection import inspect_target

    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)
    target = "inspect_factories:untied_bag"
    plans = [inspect_target(target, world_size=2, link="10gbit", comm_cpu_ms_per_mb=ms).plan for ms in (0.0, 50.0)]
    assert [any(b.row_sparse for b in plan.buckets) for plan in plans] == [False, False]
    assert plans[0].fingerprint == plans[1].fingerprint


@pytest.mark.parametrize(("args", "message"), [
    (("--comm-cpu", "1"), "--comm-cpu is charged on a link: give the link to plan for with --link RATE[:LATENCY] (e.g. --link 5gbit)"),
    (("--comm-cpu", "-1", "--link", "1gbit"), "--comm-cpu must be a finite number of ms per MB >= 0, got -1.0"),
    (("--comm-cpu", "inf", "--link", "1gbit"), "--comm-cpu must be a finite number of ms per MB >= 0, got inf"),
    (("--launch-us", "100"), "--launch-us is charged on a link: give the link to plan for with --link RATE[:LATENCY] (e.g. --link 5gbit)"),
    (("--launch-us", "-1", "--link", "1gbit"), "--launch-us must be a finite number of microseconds >= 0, got -1.0"),
    (("--launch-us", "nan", "--link", "1gbit"), "--launch-us must be a finite number of microseconds >= 0, got nan"),
])  # fmt: skip
def test_a_bad_cost_to_charge_is_one_line_and_exit_2(args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "mlp", "--size", "tiny", *args]) == 2
    assert capsys.readouterr().err.strip() == f"graphddp inspect: {message}"


def test_a_launch_cost_given_is_charged_to_every_bucket_by_automatic_caps_and_in_the_prediction(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--launch-us``: what launching one collective costs the backward's thread, as a run measures and logs it
    (``ComputeRates.launch_s``). Automatic caps charge it to every bucket, as a run's do: 5 ms a launch leaves the
    small GPT at 10 Gbit/s fewer buckets than none does; under fixed caps the plan stays and each bucket's launch
    is in the predicted step."""
    from graphddp.tools.inspection import inspect_target

    monkeypatch.setattr("graphddp.tools.inspection.measure_compute_rates", lambda: RATES)
    args = ("gpt", "--size", "small", "--link", "10gbit", *AUTO)
    free, charged = (len(inspect_json(capsys, *args, "--launch-us", us)["buckets"]) for us in ("0", "5000"))
    assert 1 <= charged < free, (charged, free)
    fixed = {us: inspect_target("gpt", size="small", world_size=2, link="10gbit", launch_us=us) for us in (0.0, 5000.0)}
    assert fixed[0.0].plan.fingerprint == fixed[5000.0].plan.fingerprint
    (graph,), (launched,) = fixed[0.0].graphs, fixed[5000.0].graphs
    # The backward's thread runs the launches between its segments: at least one lies on the step's path, and
    # the step grows by no more than all of them.
    grown = launched.prediction.step_s - graph.prediction.step_s
    assert 5e-3 <= grown <= 5e-3 * len(graph.plan.buckets) + 1e-9, (grown, len(graph.plan.buckets))

