"""A 2,000-iteration soak (slow): memory, threads and file descriptors stay flat, eager and compiled."""

from __future__ import annotations

import gc
import os

import pytest
from ranks import run_on_ranks
from training import Case, batch_for, loss_for, make_optimizer, wrap

pytestmark = pytest.mark.slow

ITERATIONS = 2000
RSS_BOUND_MB = 16.0
"""Growth allowed between iteration 200 (warm: plans rebuilt, graphs compiled, allocator primed) and the end."""


def usage() -> dict[str, float]:
    gc.collect()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def soak(rank: int, world: int, compile: str | None) -> tuple[dict[str, float], dict[str, float]]:
    case = Case(model="bag", compile=compile, ddp=(("bucket_cap_mb", 0.002),), graphddp=(("first_bucket_cap_mb", 0.001),))
    ddp, model = wrap("graphddp", case, rank)
    opt = make_optimizer(ddp.parameters(), case)
    samples = {}
    for step in range(ITERATIONS):
        loss_for(model, case, batch_for(case, step % 50, 0, rank), rank).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 in (200, ITERATIONS):
            samples[step + 1] = usage()
    return samples[200], samples[ITERATIONS]


@pytest.mark.parametrize("compile", [None, "torch.compile"])
def test_two_thousand_iterations_keep_memory_threads_and_fds_flat(compile: str | None) -> None:
    for rank, (warm, end) in enumerate(run_on_ranks(soak, 2, compile, timeout=900)):
        assert end["rss_mb"] - warm["rss_mb"] <= RSS_BOUND_MB, (rank, warm, end)
        assert end["threads"] == warm["threads"] and end["fds"] == warm["fds"], (rank, warm, end)
