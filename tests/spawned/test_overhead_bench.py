"""``python -m bench.overhead``: the launch-bound benchmark runs, and its counts and ratios mean what they say."""

from __future__ import annotations

import collections
import json
import mmap
import sys

import pytest
import torch

from bench.allocator import minor_page_faults
from bench.interleave import graphs_compiled, isolated_model, pass_order
from bench.overhead import (
    COMPILED_MODES,
    EAGER_MODES,
    STACK_SHIFTS,
    CallCounter,
    OverheadOptions,
    PreparedMode,
    baseline_of,
    batch_of,
    build_model,
    link_beside,
    main,
    round_spread,
    spawn_and_collect,
    summarise,
    torch_peer_of,
)


def put_a_big_record(rank: int, world_size: int, nbytes: int, results: object) -> None:
    results.put((rank, bytes([rank]) * nbytes))  # type: ignore[attr-defined]


@pytest.mark.timeout(120, func_only=True)
def test_records_larger_than_a_pipe_come_back_while_the_ranks_run() -> None:
    """Each rank's record is read while the ranks run: one larger than a pipe's 64 KiB blocks its rank in ``put``
    until it is read, and read only after the ranks exited, the bench hung (session 40: 19 modes x 4 rounds)."""
    records = spawn_and_collect(put_a_big_record, 2, 1 << 20)
    assert sorted(records) == [0, 1] and all(records[r] == bytes([r]) * (1 << 20) for r in records)


def test_bad_options_are_refused_with_the_flag() -> None:
    with pytest.raises(ValueError, match="--cap-mb must be >= 1"):
        OverheadOptions(cap_mb=0.5)
    with pytest.raises(ValueError, match="--width must be a multiple of 32"):
        OverheadOptions(width=100)
    with pytest.raises(ValueError, match="--interleave must be one of steps, modes"):
        OverheadOptions(interleave="rounds")
    with pytest.raises(ValueError, match="--model must be one of gpt, mlp"):
        OverheadOptions(model="resnet")
    OverheadOptions(model="mlp", width=16)  # no attention heads: any width
    with pytest.raises(SystemExit):
        main(["--world-sizes", "0"])


def test_the_process_group_backend_follows_the_device_unless_named() -> None:
    """``--backend``: NCCL on CUDA and gloo on the CPU by default; gloo on CUDA lets two ranks share one GPU (the
    per-bucket path on CUDA tensors, which one NCCL rank never runs: graphddp sends nothing there)."""
    assert OverheadOptions().process_group_backend == "gloo"
    assert OverheadOptions(device="cuda").process_group_backend == "nccl"
    assert OverheadOptions(device="cuda", backend="gloo").process_group_backend == "gloo"
    with pytest.raises(ValueError, match="--backend nccl needs --device cuda"):
        OverheadOptions(backend="nccl")
    with pytest.raises(ValueError, match="--backend must be auto, gloo or nccl"):
        OverheadOptions(backend="mpi")
    OverheadOptions(world_sizes=(1, 2)).check_gpus(0)  # the CPU needs none
    OverheadOptions(device="cuda", backend="gloo", world_sizes=(2,)).check_gpus(1)  # two ranks share the GPU
    with pytest.raises(ValueError, match="needs 2 GPUs, this machine has 1; --backend gloo"):
        OverheadOptions(device="cuda", world_sizes=(1, 2)).check_gpus(1)
    with pytest.raises(ValueError, match="no GPU is visible"):
        OverheadOptions(device="cuda", backend="gloo").check_gpus(0)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # refused before any rank is spawned
            main(["--device", "cuda", "--world-sizes", "2"])


@pytest.mark.timeout(300, func_only=True)
def test_isolated_models_compile_apart_and_compute_as_the_model() -> None:
    """``--interleave steps`` keeps every mode alive: each model's forward has a code object of its own, so each
    compiles its own graph (Dynamo caches per code object) and computes what the plain model does."""
    o = OverheadOptions(layers=1)
    plain, first, second = build_model(o), isolated_model(build_model(o), "a:x"), isolated_model(build_model(o), "b")
    assert type(first).forward.__code__ is not type(second).forward.__code__
    assert isinstance(first, type(plain)) and type(first).__name__ == "GPT_forward_a_x"
    idx = torch.randint(0, o.vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    before = graphs_compiled()
    outputs = [torch.compile(m, backend="aot_eager")(idx, idx) for m in (first, second)]
    assert graphs_compiled() - before == 2  # the second model did not reuse the first one's graph
    for out in outputs:
        torch.testing.assert_close(out, plain(idx, idx))


def test_the_counter_sees_calls_a_backward_hook_makes() -> None:
    x = torch.ones(3, requires_grad=True)
    seen = []

    def helper() -> None:
        seen.append(1)

    x.register_hook(lambda g: [helper() for _ in range(5)] and g)
    calls = CallCounter().count_backward((x * 2).sum())
    plain = CallCounter().count_backward((torch.ones(3, requires_grad=True) * 2).sum())
    assert len(seen) == 5 and calls >= plain + 6  # the hook's lambda and five helper calls


def test_summary_measures_each_ddp_against_its_baseline() -> None:
    o = OverheadOptions(inners=("aot_eager",))
    times = {"local": 10, "torch-eager": 12, "graphddp-eager": 11, "local-compiled:aot_eager": 8,
             "torch-compiled:aot_eager": 12, "graphddp-compiled:aot_eager": 9, "graphddp-compiled-split:aot_eager": 13}  # fmt: skip
    per_rank = {0: {m: {"times_s": [t / 1e3] * 3, "cpu_s": [t / 2e3] * 3, "backward_calls": t * 10, "params": 5} for m, t in times.items()}}
    rows = {r["mode"]: r for r in summarise(o, 1, per_rank)}
    assert rows["graphddp-eager"]["added_s"] == pytest.approx(1e-3)
    assert rows["graphddp-eager"]["cpu_s"] == pytest.approx(5.5e-3) and rows["graphddp-eager"]["added_cpu_s"] == pytest.approx(0.5e-3)
    assert rows["graphddp-eager"]["added_vs_torch"] == pytest.approx(0.5)
    assert rows["graphddp-compiled:aot_eager"]["added_vs_torch"] == pytest.approx(0.25)
    assert rows["graphddp-compiled:aot_eager"]["added_calls"] == 10
    assert rows["graphddp-compiled-split:aot_eager"]["added_vs_torch"] == pytest.approx(1.25)  # against torch-compiled


def test_passes_alternate_the_order_so_no_mode_always_follows_the_same_one() -> None:
    modes = ["local", "torch-eager", "graphddp-eager"]
    passes = [pass_order(modes, k) for k in range(4)]
    assert passes[0] == passes[2] == modes and passes[1] == passes[3] == modes[::-1]
    follows = collections.Counter((a, b) for order in passes for a, b in zip(order, order[1:]))
    assert follows[("torch-eager", "graphddp-eager")] == follows[("graphddp-eager", "torch-eager")] == 2
    assert pass_order(modes, 1) is not modes and modes == ["local", "torch-eager", "graphddp-eager"]  # untouched


def test_timed_steps_run_at_each_stack_shift_in_turn() -> None:
    """A compiled graph's frame at the end of its frame-stack chunk makes every call from it map a fresh chunk
    (module docstring): a mode's steps run under ``STACK_SHIFTS`` extra frames in turn, so its median is not one
    depth's."""
    depths: list[int] = []

    def step() -> None:
        frame, depth = sys._getframe(), 0
        while frame is not None:
            frame, depth = frame.f_back, depth + 1
        depths.append(depth)

    prepared = PreparedMode(step, None, 1)
    record = {"times_s": [], "cpu_s": [], "other_threads_cpu_s": [], "page_faults": [], "compiles_while_timed": 0}
    for _ in range(2 * len(STACK_SHIFTS)):
        prepared.time_one(OverheadOptions(), record)
    shallowest = min(depths)
    assert [d - shallowest for d in depths] == [*STACK_SHIFTS, *STACK_SHIFTS]
    assert len(record["times_s"]) == len(record["page_faults"]) == 2 * len(STACK_SHIFTS)


def test_page_faults_are_counted_per_step_and_read_against_the_baseline() -> None:
    fresh = mmap.mmap(-1, 64 * mmap.PAGESIZE)  # pages from the OS, whatever the allocator keeps: none touched yet
    before = minor_page_faults()
    for page in range(0, len(fresh), mmap.PAGESIZE):
        fresh[page] = 1  # each first touch: one fault
    assert minor_page_faults() - before >= 32  # the kernel may map a few around each fault, never all 64 at once
    fresh.close()
    o = OverheadOptions(inners=())
    faults = {"local": 10, "torch-eager": 12, "graphddp-eager": 4000}
    per_rank = {r: {m: {"times_s": [1e-3] * 3, "page_faults": [f + r, f + r, 10**6], "backward_calls": 1, "params": 5}
                    for m, f in faults.items()} for r in (0, 1)}  # fmt: skip
    rows = {r["mode"]: r for r in summarise(o, 1, per_rank)}
    assert rows["graphddp-eager"]["page_faults"] == pytest.approx(4000.5)  # each rank's median, averaged: no outlier
    assert rows["graphddp-eager"]["added_page_faults"] == pytest.approx(3990)
    assert rows["torch-eager"]["added_page_faults"] == pytest.approx(2)


def test_each_mode_is_measured_against_its_kind_of_baseline_and_pytorch_peer() -> None:
    eager = {m: (baseline_of(m), torch_peer_of(m)) for m in EAGER_MODES}
    compiled = {m: (baseline_of(m), torch_peer_of(m)) for m in COMPILED_MODES}
    assert eager["local"] == (None, None) and eager["torch-eager"] == ("local", None)
    assert all(v == ("local", "torch-eager") for m, v in eager.items() if m not in ("local", "torch-eager"))
    assert compiled["local-compiled"] == (None, None) and compiled["torch-compiled"] == ("local-compiled", None)
    assert all(v == ("local-compiled", "torch-compiled") for m, v in compiled.items() if m not in ("local-compiled", "torch-compiled"))
    with pytest.raises(ValueError, match="unknown mode 'graphddp-eagre'"):
        baseline_of("graphddp-eagre")


def test_bound_is_a_floor_read_against_pytorchs_added_time_and_only_where_there_is_a_link() -> None:
    o = OverheadOptions(inners=("inductor",))
    assert not {"bound", "bound-backward", "bound-ready", "bound-ready-torch", "bare-ddp", "bound-compiled:inductor",
                "bound-backward-compiled:inductor"} & set(o.modes(1))  # fmt: skip
    assert o.modes(2)[:6] == ["local", "bound", "bound-backward", "bound-ready", "bound-ready-torch", "bare-ddp"]
    assert {"bound-compiled:inductor", "bound-backward-compiled:inductor"} <= set(o.modes(2))
    times = {"local": 10, "bound": 13, "bound-backward": 14, "bound-ready": 15, "bound-ready-torch": 14, "bare-ddp": 17, "torch-eager": 16,
             "graphddp-eager": 15,
             "local-compiled:inductor": 8, "bound-compiled:inductor": 11, "bound-backward-compiled:inductor": 12,
             "torch-compiled:inductor": 14, "graphddp-compiled:inductor": 12, "graphddp-compiled-split:inductor": 16}  # fmt: skip
    per_rank = {r: {m: {"times_s": [t / 1e3] * 3, "cpu_s": [(t + r) / 1e3] * 3, "other_threads_cpu_s": [0.0, r / 1e3, 1.0],
                        "backward_calls": 7, "params": 5} for m, t in times.items()}
                for r in (0, 1)}  # fmt: skip
    rows = {r["mode"]: r for r in summarise(o, 2, per_rank)}
    # CPU time: each rank's median, averaged over the ranks (rank 1 spends 1 ms more on every mode here).
    assert rows["bound"]["cpu_s"] == pytest.approx(13.5e-3) and rows["bound"]["added_cpu_s"] == pytest.approx(3e-3)
    assert rows["bound"]["other_threads_cpu_s"] == pytest.approx(0.5e-3)  # medians 0 and 1 ms: an outlier moves neither
    assert rows["bound"]["added_s"] == pytest.approx(3e-3) and rows["bound"]["added_vs_torch"] == pytest.approx(0.5)
    # The compiled floor, 3 of PyTorch's 6 ms: half of it is the most any DDP sending these bytes could save.
    assert rows["bound-compiled:inductor"]["added_vs_torch"] == pytest.approx(0.5)
    assert rows["graphddp-compiled:inductor"]["added_vs_torch"] == pytest.approx(4 / 6)
    # Sent from the backward's start, the floor any DDP meets: 4 of PyTorch's 6 ms.
    assert rows["bound-backward-compiled:inductor"]["added_vs_torch"] == pytest.approx(4 / 6)
    assert rows["bound-backward"]["added_s"] == pytest.approx(4e-3)
    # Sent as the gradients become ready, in graphddp's buckets and in PyTorch's: against PyTorch's DDP too.
    assert rows["bound-ready"]["added_vs_torch"] == pytest.approx(5 / 6)
    assert rows["bound-ready-torch"]["added_vs_torch"] == pytest.approx(4 / 6)
    assert rows["bare-ddp"]["added_vs_torch"] == pytest.approx(7 / 6)  # a reference, not a floor: it may lie above


@pytest.mark.parametrize("from_backward, expected", [
    (False, ["issue", "forward", "backward", "wait"]),
    (True, ["forward", "issue", "backward", "wait"]),
])  # fmt: skip
def test_the_floors_issue_the_link_at_the_step_or_at_the_backward(monkeypatch, from_backward, expected) -> None:
    events: list[str] = []

    def all_reduce_every(buffers):
        events.append("issue")
        return lambda: events.append("wait")

    def step(count=None, *, before_backward=None):
        events.append("forward")
        if before_backward is not None:
            before_backward()
        events.append("backward")
        return 3

    monkeypatch.setattr("bench.overhead.all_reduce_every", all_reduce_every)
    assert link_beside([torch.zeros(1)], step, from_backward=from_backward) == 3
    assert events == expected


def test_ratios_are_also_taken_round_by_round() -> None:
    """A slow round moves every mode alike: the overall medians mix rounds, the per-round ratios do not."""
    o = OverheadOptions(inners=(), steps=2, rounds=3)
    per_round = {"local": [10, 30, 10], "torch-eager": [12, 34, 11], "graphddp-eager": [11, 32, 12]}
    times = {m: [t / 1e3 for t in ts for _ in range(o.steps)] for m, ts in per_round.items()}
    per_rank = {0: {m: {"times_s": ts, "backward_calls": 1, "params": 5} for m, ts in times.items()}}
    row = {r["mode"]: r for r in summarise(o, 1, per_rank)}["graphddp-eager"]
    assert row["round_added_s"] == pytest.approx([1e-3, 2e-3, 2e-3])
    assert row["added_vs_torch_rounds"] == pytest.approx([0.5, 0.5, 2.0])
    assert round_spread(row["added_vs_torch_rounds"]) == "0.50 (0.50-2.00, 3 of 3)"
    assert round_spread([None, 1.5]) == "1.50 (1.50-1.50, 1 of 2)"  # a round where PyTorch's added nothing


@pytest.mark.timeout(300, func_only=True)
def test_a_tiny_run_prints_every_mode_and_writes_json(tmp_path, capsys) -> None:
    assert main(["--world-sizes", "1", "--inners", "", "--layers", "1", "--steps", "1", "--rounds", "1",
                 "--warmup", "0", "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["local", "torch-eager", "graphddp-eager"]
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["graphddp-eager"]["params"] == 16  # one block: 12 tensors, wte, wpe, ln_f's two
    assert by_mode["graphddp-eager"]["buckets"] >= 1
    assert by_mode["torch-eager"]["buckets"] >= 1  # from PyTorch's own logging data: layouts differ at one cap
    assert by_mode["local"].get("buckets") is None
    assert by_mode["graphddp-eager"]["added_calls"] > 0  # graphddp's hooks are Python; PyTorch's are C++
    assert all(r["cpu_s"] > 0 for r in rows) and by_mode["graphddp-eager"]["added_cpu_s"] is not None
    assert all(0 <= r["other_threads_cpu_s"] <= r["cpu_s"] for r in rows)  # one rank: no collective, little beside
    assert all(r["page_faults"] >= 0 for r in rows) and by_mode["graphddp-eager"]["added_page_faults"] is not None
    out = capsys.readouterr().out
    assert "graphddp-eager" in out and "added cpu ms" in out and "other threads cpu ms" in out and "page faults" in out


def test_the_mlp_model_is_a_stack_of_small_layers_each_rank_on_its_own_batch() -> None:
    o = OverheadOptions(model="mlp", layers=5, width=16, batch=2, seq=3)
    model = build_model(o)
    assert [tuple(p.shape) for p in model.parameters()] == [(16, 16), (16,)] * 5
    (x, y), (x1, _) = batch_of(o, 0), batch_of(o, 1)
    assert x.shape == (6, 16) and y.shape == (6,) and y.dtype == torch.int64 and int(y.max()) < 16
    assert not torch.equal(x, x1)
    assert model(x, y).ndim == 0


@pytest.mark.slow  # a run of the bench; the default suite keeps the mlp model's options, shapes and batches
def test_a_run_of_the_mlp_model_times_its_parameters(tmp_path) -> None:
    assert main(["--world-sizes", "1", "--inners", "", "--model", "mlp", "--layers", "40", "--width", "16",
                 "--steps", "1", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert {r["mode"]: r["params"] for r in rows}["graphddp-eager"] == 80
    assert json.loads((tmp_path / "overhead.json").read_text())["options"]["model"] == "mlp"


@pytest.mark.timeout(300, func_only=True)
def test_two_ranks_time_the_bound_beside_the_eager_modes_one_mode_at_a_time(tmp_path) -> None:
    # Tables dense: under "auto" whether a table goes as rows (a bucket of its own) is decided on the link measured
    # at construction, and a loaded machine's measurement chose rows once (CI, session 28); the floors send the
    # dense plan.
    assert main(["--world-sizes", "2", "--inners", "", "--layers", "1", "--steps", "2", "--rounds", "1",
                 "--warmup", "0", "--interleave", "modes", "--tables", "dense", "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == [
        "local", "bound", "bound-backward", "bound-ready", "bound-ready-torch", "bare-ddp", "torch-eager", "graphddp-eager",
    ]  # fmt: skip
    by_mode = {r["mode"]: r for r in rows}
    for bound in rows[1:6]:
        assert bound["step_s"] > 0 and "added_s" in bound and "added_vs_torch" in bound
    for bound in rows[1:3]:
        assert bound["added_calls"] == 0  # the link beside the step runs no Python in backward
        assert bound["buckets"] == by_mode["graphddp-eager"]["buckets"]  # graphddp's dense plan at the caps
    # As ready: one hook call per gradient (and what launching costs), the layouts' own bucket counts.
    assert by_mode["bound-ready"]["added_calls"] >= by_mode["bound-ready"]["params"]
    assert by_mode["bound-ready"]["buckets"] == by_mode["graphddp-eager"]["buckets"]
    assert by_mode["bound-ready-torch"]["buckets"] == by_mode["torch-eager"]["buckets"]
    assert by_mode["bare-ddp"]["buckets"] == by_mode["graphddp-eager"]["buckets"]  # graphddp's buckets, copied as it copies
    assert by_mode["bare-ddp"]["added_calls"] >= by_mode["bare-ddp"]["params"]  # a hook per gradient, as bound-ready
    assert by_mode["graphddp-eager"]["rows"] == []  # every table dense, as asked


@pytest.mark.slow  # 6 s; the default suite has the Reducer's side in test_row_sparse_training.py (a table that gave up)
@pytest.mark.timeout(300, func_only=True)
def test_a_position_table_tried_as_rows_is_timed_in_the_dense_plan(tmp_path) -> None:
    """``--tables rows`` (what ``auto`` may choose on a loaded machine's measurement): GPT's position table, whose
    every row each batch touches, goes dense at once and, after ``DENSE_STREAK_LIMIT`` steps of the warm-up, back
    into the dense plan's buckets (Note [Plan agreement], "tables gone dense"): the timed steps send as many
    collectives as the dense plan (session 50's run timed two more, 12 buckets against 10)."""
    assert main(["--world-sizes", "2", "--inners", "", "--layers", "1", "--steps", "1", "--rounds", "1",
                 "--warmup", "3", "--interleave", "modes", "--tables", "rows", "--out", str(tmp_path)]) == 0  # fmt: skip
    by_mode = {r["mode"]: r for r in json.loads((tmp_path / "overhead.json").read_text())["rows"]}
    assert by_mode["graphddp-eager"]["rows"] == []
    assert by_mode["graphddp-eager"]["buckets"] == by_mode["bound"]["buckets"]  # graphddp's dense plan at the caps


@pytest.mark.slow  # 13 s; the default suite checks that no hook runs in-graph in tests/spawned/test_in_graph.py
@pytest.mark.timeout(300, func_only=True)
def test_compiled_graphddp_reduces_in_graph_with_python_calls_per_bucket_not_per_parameter(tmp_path) -> None:
    assert main(["--world-sizes", "1", "--inners", "aot_eager", "--layers", "2", "--steps", "1", "--rounds", "1",
                 "--warmup", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    by_mode = {r["mode"]: r for r in json.loads((tmp_path / "overhead.json").read_text())["rows"]}
    in_graph, split = by_mode["graphddp-compiled:aot_eager"], by_mode["graphddp-compiled-split:aot_eager"]
    assert in_graph["reduction"] == "in_graph" and split["reduction"] == "split (asked for)"
    # The split's hooks cost Python per gradient; the in-graph backward runs none of graphddp's.
    assert in_graph["added_calls"] < split["added_calls"] - in_graph["params"]


@pytest.mark.slow  # 14 s: every compiled mode compiled; test_a_tiny_run_prints_every_mode_and_writes_json stays
@pytest.mark.timeout(300, func_only=True)
def test_steps_interleaved_time_every_mode_compiled_before_timing(tmp_path, capsys) -> None:
    assert main(["--world-sizes", "2", "--inners", "aot_eager", "--layers", "1", "--steps", "2", "--rounds", "1",
                 "--warmup", "1", "--out", str(tmp_path)]) == 0  # fmt: skip (steps: the default order)
    by_mode = {r["mode"]: r for r in json.loads((tmp_path / "overhead.json").read_text())["rows"]}
    assert list(by_mode) == OverheadOptions(inners=("aot_eager",)).modes(2)
    assert all(r["compiles_while_timed"] == 0 for r in by_mode.values())
    assert by_mode["graphddp-compiled:aot_eager"]["reduction"] == "in_graph"
    # Each compiled mode ran its own compiled graph, not the eager model: aot_eager's backward is Python.
    assert by_mode["local-compiled:aot_eager"]["backward_calls"] > by_mode["local"]["backward_calls"]
    assert by_mode["torch-compiled:aot_eager"]["added_calls"] > 0
    assert "interleaved by steps" in capsys.readouterr().out
