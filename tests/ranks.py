"""The one helper every multi-rank test goes through: run a function on N gloo rank processes, with a timeout.

``run_on_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of a gloo process
group and returns the per-rank results. Ranks are real processes (``spawn``), kept in a pool per world size
between tests so each test does not pay for process start-up and ``import torch`` again; each rank of a pool
hashes strings with a seed of its own (``RankPool``). Any failure or timeout tears the pool down, so the next test
starts from fresh processes and a clean process group. Fault tests take fresh ranks for every scenario
(``run_with_faults``), forked from a server that has imported torch once (``fault_context``).

A hang (a rank stuck in a collective) fails after ``timeout`` seconds with a message naming the ranks that
did not answer, instead of freezing the suite.
"""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from graphddp.tools.launch import MODULES_BINDING_THE_DEFAULT_GROUP

DEFAULT_TIMEOUT_S = 120.0

PRELOADED = ("torch", "torch.distributed", *MODULES_BINDING_THE_DEFAULT_GROUP)
"""What the fault ranks' fork server imports once: importing these takes a new process 2.2-2.6 s on CI's 2 cores,
and every fault scenario starts fresh ranks (``test_misuse.py``, ``test_faults.py`` and ``test_bad_input.py`` took
110 s with every rank spawned, 52 s forked). The last three are what ``import_before_init`` imports before any
group exists, so the server binds no group."""

START_METHODS = ("forkserver", "spawn")


def fault_context() -> Any:
    """The multiprocessing context fault ranks start from: ``forkserver`` with ``PRELOADED`` imported in the server.

    Each rank is a new process with a process group of its own, given this process's ``sys.path`` and, through
    ``in_parent_env``, its environment at the start, as under ``spawn``. What a new interpreter takes at its own
    start comes from the server instead (the parent's environment when the server started at the first fault rank):
    the string-hash seed is one for every fault rank. The pool's ranks, where training parity is tested, are
    spawned with a seed each (``RankPool``). ``GRAPHDDP_TEST_START_METHOD=spawn`` spawns fault ranks too, to rule the
    server out when one misbehaves. Never add a module of ``tests/`` to ``PRELOADED``: the server imports with
    the interpreter's own path, not this process's."""
    method = os.environ.get("GRAPHDDP_TEST_START_METHOD", "forkserver")
    if method not in START_METHODS:
        raise ValueError(f"GRAPHDDP_TEST_START_METHOD must be one of {START_METHODS}, got {method!r}")
    return forkserver_context(PRELOADED) if method == "forkserver" else mp.get_context(method)


def forkserver_context(preload: Sequence[str]) -> Any:
    """Multiprocessing's ``forkserver`` context, its server to import ``preload`` once (one server a process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # takes effect when the server starts: at the first rank
    return ctx


def in_parent_env(env: dict[str, str], target: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run ``target`` in a new rank with its parent's environment ``env`` (a forked rank has the server's)."""
    os.environ.clear()
    os.environ.update(env)
    target(*args, **kwargs)


class RankFailure(AssertionError):
    """At least one rank raised; the message holds every failing rank's traceback."""


class RankTimeout(AssertionError):
    """Some ranks did not finish in time, which almost always means a collective that never matched."""


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any, backend: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    from graphddp.tools.launch import import_before_init

    # A rank killed by a signal (SIGSEGV, or SIGABRT from a heap check) otherwise shows only its exit code: print
    # every thread's Python stack to stderr, which pytest shows with the failure, to say which test and which line.
    faulthandler.enable(all_threads=True)

    torch.set_num_threads(1)  # 2 cores shared by up to 3 ranks: oversubscription only adds noise
    if torch.cuda.is_available():  # the GPU tests: rank r on GPU r (mod the count; gloo ranks may share one)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import_before_init()  # the group is freed at close (Note [The default group outlives destroy_process_group])
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException as e:  # report everything, including assertion errors, to the parent
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes sharing one process group (gloo, or NCCL for the GPU tests).

    Rank r hashes strings with ``PYTHONHASHSEED=r + 1``, as ranks a launcher starts each have a seed of their own:
    an order taken from a set of names, where the ranks must agree, then differs between the ranks in every run."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="graphddp-ranks-")
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self._tasks[r], self._results, backend), daemon=True)
            for r in range(world_size)
        ]
        seed = os.environ.get("PYTHONHASHSEED")
        try:
            for r, p in enumerate(self._procs):
                os.environ["PYTHONHASHSEED"] = str(r + 1)  # a spawned interpreter reads it as it starts
                p.start()
        finally:
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + timeout
        done: dict[int, tuple[bool, Any]] = {}
        while len(done) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                done[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
            if dead:
                codes = [self._procs[r].exitcode for r in dead]
                raise RankFailure(
                    f"{fn.__name__}: rank(s) {dead} died (exit codes {codes}; a negative code is the signal that "
                    "killed it, and its Python stack is in the captured stderr)"
                )
            if time.monotonic() > deadline:
                waiting = sorted(set(range(self.world_size)) - set(done))
                failed = {r: v for r, (ok, v) in done.items() if not ok}
                raise RankTimeout(
                    f"{fn.__name__} on {self.world_size} ranks: rank(s) {waiting} did not finish within {timeout:.0f}s "
                    f"(probably stuck in a collective no other rank issued). Ranks that failed first: "
                    + ("".join(f"\n--- rank {r} ---\n{v}" for r, v in failed.items()) or "none")
                )
        failures = {r: v for r, (ok, v) in done.items() if not ok}
        if failures:
            raise RankFailure(
                f"{fn.__name__} failed on rank(s) {sorted(failures)}:"
                + "".join(f"\n--- rank {r} ---\n{v}" for r, v in sorted(failures.items()))
            )
        return [done[r][1] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=5)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


_pools: dict[tuple[int, str], RankPool] = {}


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` process group; return the
    results in rank order.

    ``fn`` must be a module-level function (it is pickled to the ranks). Raises ``RankFailure`` with every
    failing rank's traceback, or ``RankTimeout`` when a rank does not answer within ``timeout`` seconds.
    """
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = RankPool(world_size, backend)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        # A failed task may leave collectives half-issued: never reuse that process group.
        _pools.pop(key).close(graceful=False)
        raise


def expect_failure_on_every_rank(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> dict[int, str]:
    """Run ``fn`` and require that *every* rank raised; return ``{rank: error text}``.

    ``fn`` is expected to catch nothing: the point of these tests is that each rank raises on its own, within the
    timeout, rather than one rank raising while the others hang.
    """
    try:
        run_on_ranks(fn, world_size, *args, timeout=timeout)
    except RankFailure as e:
        text = str(e)
        missing = [r for r in range(world_size) if f"--- rank {r} ---" not in text]
        if missing:
            raise AssertionError(f"rank(s) {missing} did not raise:\n{text}") from None
        return {r: text.split(f"--- rank {r} ---", 1)[1].split("--- rank ", 1)[0] for r in range(world_size)}
    raise AssertionError(f"{fn.__name__} was expected to raise on every rank, but succeeded")


# -- faults: fresh ranks with the process group timeout a user would give ---------------------------------------
def _isolated_worker(rank: int, world_size: int, init_file: str, pg_timeout_s: float, fn: Any, args: tuple, results: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from graphddp.tools.launch import import_before_init

    torch.set_num_threads(1)
    import_before_init()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException as e:
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_with_faults(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    pg_timeout_s: float,
    timeout: float = DEFAULT_TIMEOUT_S,
    wait_for: tuple[int, ...] | None = None,
) -> dict[int, tuple[bool, Any]]:
    """Run ``fn`` on fresh ranks (no pool: a fault may leave a rank stopped, dead or stuck) whose process group
    has ``pg_timeout_s``, as ``init_process_group(timeout=...)`` gives it. Returns ``{rank: (ok, value or error)}``
    for the ranks that answered within ``timeout``; every rank is killed afterwards, stopped ones included.
    ``wait_for``: the ranks whose answers to wait for (default: all; a frozen rank never answers)."""
    import signal

    ctx = fault_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="graphddp-faults-") as directory:
        init_file = os.path.join(directory, "init")
        procs = [
            ctx.Process(
                target=in_parent_env,
                args=(dict(os.environ), _isolated_worker, r, world_size, init_file, pg_timeout_s, fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        done: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        awaited = set(range(world_size) if wait_for is None else wait_for)
        try:
            while not awaited <= set(done) and time.monotonic() < deadline:
                try:
                    rank, ok, value = results.get(timeout=0.5)
                    done[rank] = (ok, value)
                except queue.Empty:
                    if all(not p.is_alive() for r, p in enumerate(procs) if r not in done):
                        break
        finally:
            for p in procs:
                if p.is_alive():
                    try:
                        os.kill(p.pid, signal.SIGCONT)  # a stopped rank must wake to die
                    except ProcessLookupError:  # it exited between the check and the signal: nothing to wake
                        pass
                    p.kill()  # multiprocessing's kill ignores a process already gone
                p.join(timeout=10)
    return done


def close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_all)
