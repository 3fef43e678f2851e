"""``bench.allocator``: the ranks' CPU allocator the benchmarks start them with (no ranks: one child process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench.allocator import allocator_env
from bench.overhead import OverheadOptions
from bench.run import BenchOptions

FAULTS = """
import resource, torch
def step():  # a step's big tensors: 16 and 64 MiB, a 64 MiB temporary, all freed at its end
    a = torch.ones(4096, 1024); b = torch.ones(16384, 1024) + 1; del a, b
for _ in range(3):  # the first steps' pages are fresh with any allocator (the heap grows to its size)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS], env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def _thp_always() -> bool:
    """Transparent huge pages on every mapping: a fault then maps 2 MiB, and both counts are too small to compare."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the variables are glibc's; another C library ignores them")
@pytest.mark.skipif(bool(os.environ.get("LD_PRELOAD")), reason="a preloaded allocator (jemalloc, tcmalloc) ignores glibc's tunables")
@pytest.mark.skipif(_thp_always(), reason="huge pages on every mapping: too few faults to compare")
def test_retain_keeps_freed_memory_so_the_next_tensor_touches_no_fresh_pages() -> None:
    """Five steps that each allocate and free 144 MiB: glibc maps and unmaps every tensor (~172 k page faults in
    all); with ``retain`` the first steps' pages are reused (16-64 k in all on the development VM: now and then a
    64 MiB tensor still lands on fresh pages)."""
    system, retain = _faults(allocator_env("system")), _faults(allocator_env("retain"))
    assert retain * 2 < system, (system, retain)


def test_an_unknown_allocator_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="allocator must be one of system, retain, got 'jemalloc'"):
        BenchOptions(allocator="jemalloc")
    with pytest.raises(ValueError, match="allocator must be one of system, retain"):
        OverheadOptions(allocator="tcmalloc")
    assert allocator_env("system") == {}


def test_a_bench_run_starts_its_ranks_with_the_allocators_environment(tmp_path, monkeypatch) -> None:
    """``bench.run.run`` hands the allocator's variables to the torchrun jobs it starts (loopback here)."""
    import bench.run

    started: list[dict[str, str] | None] = []

    class Started(Exception):
        pass

    def run_jobs(commands: list[list[str]], marker: str, extra_env: dict[str, str] | None = None) -> None:
        started.append(extra_env)
        raise Started

    monkeypatch.setattr(bench.run, "run_jobs", run_jobs)
    for allocator, expected in (("retain", allocator_env("retain")), ("system", {})):
        with pytest.raises(Started):
            bench.run.run(BenchOptions(allocator=allocator, out=str(tmp_path / allocator)))
        assert started.pop() == expected


def test_an_overhead_run_starts_its_ranks_with_the_allocators_environment_and_restores_it_after(tmp_path, monkeypatch) -> None:
    """``bench.overhead.run`` spawns its ranks with the allocator's variables set, and leaves ``os.environ`` as it
    found it."""
    import bench.overhead

    seen: list[str | None] = []

    class Started(Exception):
        pass

    def start_processes(*args: object, **kwargs: object) -> None:
        seen.append(os.environ.get("MALLOC_TRIM_THRESHOLD_"))
        raise Started

    monkeypatch.setattr(bench.overhead.mp, "start_processes", start_processes)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with pytest.raises(Started):
        bench.overhead.run(OverheadOptions(world_sizes=(1,), allocator="retain", out=str(tmp_path)))
    assert seen == [str(16 << 30)] and "MALLOC_TRIM_THRESHOLD_" not in os.environ
