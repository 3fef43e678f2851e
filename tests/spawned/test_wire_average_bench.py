"""``python -m bench.wire_average``: the two ways it times average alike, and it runs end to end."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks

from bench.wire_average import WAYS, WireAverageOptions, main, one_step
from graphddp.runtime.reductions import averages_correctly


def both_ways(rank: int, world: int, ways: tuple[str, ...]) -> dict[str, torch.Tensor]:
    grads = [torch.full((5,), float(rank + 1)), torch.arange(7, dtype=torch.float32) * (rank + 1)]
    averaged = {}
    for way in ways:
        buckets = [torch.empty_like(g) for g in grads]
        one_step(dist.group.WORLD, grads, buckets, way)
        averaged[way] = torch.cat(buckets)
    return averaged


@pytest.mark.parametrize("world", [2, 3])
def test_the_scaled_sum_and_the_backends_average_give_the_average(world: int) -> None:
    ways = WAYS if averages_correctly("gloo", torch.float32) else ("sum",)  # gloo takes AVG from PyTorch 2.8
    mean = sum(range(1, world + 1)) / world
    expected = torch.cat([torch.full((5,), mean), torch.arange(7, dtype=torch.float32) * mean])
    for rank, averaged in enumerate(run_on_ranks(both_ways, world, ways)):
        assert set(averaged) == set(ways)
        for way in ways:
            torch.testing.assert_close(averaged[way], expected, msg=f"rank {rank}, {way}")


def test_it_prints_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "1000,3000", "--steps", "3", "--warmup", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "2 buckets of float32, 4000 elements" in out
    table = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in WAYS]
    assert [row[0] for row in table] == list(WAYS) and all(float(v) >= 0 for row in table for v in row[1:]), out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"world_size": 1}, "one rank sends nothing"),
        ({"sizes": (10, 0)}, "positive element counts"),
        ({"dtype": "int64"}, "floating torch dtype"),
        ({"dtype": "nonsense"}, "floating torch dtype"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"device": "tpu"}, "cpu or cuda"),
    ],
)
def test_bad_options_say_what_is_wrong(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WireAverageOptions(**options)


def test_more_ranks_than_gpus_on_nccl_is_refused(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--world-size", "2"])
    assert "needs a GPU per rank; this machine has 1: pass --world-size at most that, or --device cpu" in capsys.readouterr().err


def test_sizes_that_are_not_integers_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--sizes", "1000,x", "--device", "cpu"])
    assert "--sizes: must be comma-separated integers (elements per bucket), got '1000,x'" in capsys.readouterr().err
