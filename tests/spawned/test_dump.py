"""The debug dump: layout and content on a 2-rank compiled run with a recompile; bad directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks

import graphddp
from graphddp.tools.workloads import build_workload

CAPS = {"bucket_cap_mb": 0.004, "first_bucket_cap_mb": 0.002, "sparse_embedding_grads": True}


def train_with_recompile(rank: int, world: int, debug_dir: str | None) -> dict:
    torch._dynamo.reset()
    workload = build_workload("gpt", size="tiny", seed=0)
    ddp = graphddp.DDP(workload.model, **CAPS)
    # The split, asked for: the Reducer reduces the table, and gives its rows up (as in-graph does, keeping its part).
    model = torch.compile(ddp, backend=graphddp.backend("aot_eager", debug_dir=debug_dir, reduction="split"))
    data = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        idx, targets = workload.make_batch(data)
        if step >= 2:  # a new batch size: Dynamo recompiles (with a dynamic batch dimension)
            idx, targets = idx[:2], targets[:2]
        model(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    (graph_plan,) = ddp.reducer.plans.graph_plans.graphs.values()  # the recompile reused it
    # The tiny GPT's lookups touch most of its rows: the table went dense twice and lost its part (Note
    # [Row-sparse gradients]); otherwise the graph's plan is what runs.
    assert ddp.bucket_plan.fingerprint == graph_plan.without_rows(["wte.weight"]).fingerprint
    return {
        "fingerprint": graph_plan.fingerprint,
        "params": {k: v.clone() for k, v in workload.model.state_dict().items()},
    }


def test_dump_layout_and_content_on_two_ranks_with_a_recompile(tmp_path: Path) -> None:
    results = run_on_ranks(train_with_recompile, 2, str(tmp_path), timeout=300)
    assert (tmp_path / "README.txt").read_text().startswith("graphddp debug dump")
    for rank in (0, 1):
        graphs = sorted((tmp_path / f"rank{rank}").iterdir())
        assert len(graphs) == 2, f"a recompile gets its own folder: {graphs}"
        for folder in graphs:
            plan = json.loads((folder / "plan.json").read_text())
            segments = plan["segments"]
            assert len(segments) == len(plan["buckets"]) > 1
            assert plan["versions"] == {"graphddp": graphddp.__version__, "torch": torch.__version__}
            assert {"name", "shape", "dtype", "bytes"} <= set(plan["buckets"][0]["params"][0])
            assert "def forward" in (folder / "captured.py").read_text()
            split = (folder / "split.py").read_text()
            assert all(f"submod_{s['index']}" in split for s in segments)
            for s in segments:
                assert "def forward" in (folder / "segments" / f"submod_{s['index']}.py").read_text()
                assert "tangents" in (folder / "aot" / f"submod_{s['index']}.backward.py").read_text()
                assert (folder / "aot" / f"submod_{s['index']}.forward.py").exists()
            table = (folder / "buckets.txt").read_text()
            assert plan["fingerprint"] in table and "extended" in table and "wte.weight" in table
        first, recompiled = (json.loads((g / "plan.json").read_text()) for g in graphs)
        assert first["fingerprint"] == results[rank]["fingerprint"] == recompiled["fingerprint"]
        assert all(isinstance(s["inbound_activation_bytes"], int) for s in first["segments"])
        assert any(isinstance(s["inbound_activation_bytes"], str) for s in recompiled["segments"]), "symbolic sizes"


@pytest.mark.slow  # compiles twice; the default suite stays under 10 minutes
def test_the_dump_does_not_change_what_is_compiled(tmp_path: Path) -> None:
    with_dump = run_on_ranks(train_with_recompile, 2, str(tmp_path), timeout=300)
    without = run_on_ranks(train_with_recompile, 2, None, timeout=300)
    for a, b in zip(with_dump, without):
        torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=0)


def test_an_unwritable_dump_directory_fails_before_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=f"cannot write the debug dump to '{blocker}/dump'"):
        graphddp.backend("aot_eager", debug_dir=str(blocker / "dump"))
    monkeypatch.setenv("GRAPHDDP_DEBUG_DIR", str(blocker / "env-dump"))
    with pytest.raises(ValueError, match="GRAPHDDP_DEBUG_DIR"):
        graphddp.backend("aot_eager")
    monkeypatch.setenv("GRAPHDDP_DEBUG_DIR", str(tmp_path / "from-env"))
    graphddp.backend("aot_eager")
    assert (tmp_path / "from-env" / "README.txt").exists()
