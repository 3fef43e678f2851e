"""PyTorch's own DDP tests, run against graphddp by substitution (slow; see ``torch_ddp_suite.py``).

Each test name below is run from torch's ``distributed_test.DistributedTest._DistTestBase`` (gloo, world size 2,
``MultiProcessTestCase``, ranks forked from a fork server: ``torch_ddp_suite.rank_process``), all of them in one
subprocess, three times each: with PyTorch's DDP (the control, ``TestTorchDDPControl``), with ``graphddp.install()``
in every rank (``TestGraphDDPInstalled``), and with the name rebound to ``graphddp.DDP`` (``TestGraphDDPRebound``:
how scripts swapped DDP before ``install()``). A test the control does not pass here is a
failure of the environment; one the control passes must pass under graphddp both ways.

Which tests: every test of ``_DistTestBase`` that builds a ``DistributedDataParallel`` (the 79 named "ddp" or
"DistributedDataParallel", and 24 others that build one through a helper) was run with PyTorch's DDP on this CPU-only,
gloo-only machine (torch 2.13.0+cpu). 11 run and build a DDP; all are INCLUDED:

  test_DistributedDataParallelCPU                             training parity with the local model, buffers, state_dict
  test_DistributedDataParallelCPU_grad_is_view                the same, gradient_as_bucket_view=True
  test_DistributedDataParallel_requires_grad                  a module with no trainable parameter is refused
  test_ddp_create_graph                                       backward(create_graph=True), double backward
  test_ddp_logging_data_cpu                                   _get_ddp_logging_data() fields, sampled runtime statistics
  test_static_graph_api_cpu                                   _set_static_graph() after training: PyTorch's error, logged
  test_accumulate_gradients_no_sync                           no_sync() accumulation equals a big batch
  test_accumulate_gradients_no_sync_grad_is_view              the same, gradient_as_bucket_view=True
  test_accumulate_gradients_no_sync_allreduce_hook            the same with an all-reduce comm hook
  test_accumulate_gradients_no_sync_allreduce_with_then_hook  the same with a hook chaining Future.then
  test_grads_same_across_ranks_with_no_sync                   gradients agree across ranks after no_sync

EXCLUDED (one line each):
  test_dump_DDP_relevant_env_vars      runs on CPU but builds no DDP (tests torch's env-var dump helper only)
  66 DDP-named + 17 others             skipped by torch itself without CUDA ("CUDA is not available", "Need at least
                                       2/4 CUDA devices"): the SyncBatchNorm, AMP, mixed precision, join/uneven
                                       inputs, comm hook parity, profiling, static graph, unused-parameter tests
  9 tests                              unconditionally skipped by torch on Linux (skipIf(IS_LINUX)/skip with a
                                       pytorch issue link, "flaky", "failing"), e.g. test_ddp_has_finalized

Known gaps of the "relies on PyTorch's internals" kind (xfail, strict: it reports when it starts passing): none now.
``test_ddp_logging_data_cpu`` passes since graphddp samples PyTorch's runtime statistics (``graphddp.runtime.stats``).

Needs ``expecttest`` (torch's test utilities import it; in the test extra). Run::

    .venv/bin/python -m pytest -m slow tests/conformance/test_torch_ddp_suite.py -rA
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.relpath(os.path.join(HERE, "torch_ddp_suite.py"), REPO)

INCLUDED = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_grads_same_across_ranks_with_no_sync",
]

RELIES_ON_TORCH_INTERNALS = {}  # test -> why (none now)

TEST_TIMEOUT_S = 240
"""Per test (one class, one test, two ranks): ~1 s each on 2 cores with the ranks forked from the server, 3-15 s
when each was spawned."""
CLASSES = {
    "TestTorchDDPControl": "PyTorch's DDP",
    "TestGraphDDPInstalled": "with graphddp.install()",
    "TestGraphDDPRebound": "rebound to graphddp.DDP",
}
"""The suite's classes, each run on every INCLUDED test: the control, then graphddp both ways."""
_OUTCOME = re.compile(r"^\S+::(\w+)::(\w+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


@dataclasses.dataclass(frozen=True)
class SuiteRun:
    """Every (class, test) of the suite run in one subprocess: a pytest start and torch's test modules imported
    once, not 33 times (that cost about 4 s a run, ~2 minutes of the slow suite); each test still starts two fresh
    ranks (``MultiProcessTestCase``, from ``torch_ddp_suite.rank_process``), so the tests stay independent."""

    outcomes: dict[tuple[str, str], str]
    """(class, test) -> passed/failed/skipped/error; a test missing here did not finish (see ``output``)."""
    output: str
    seconds: float

    def section(self, cls: str, name: str) -> str:
        """The failure report of ``cls::name`` (pytest's ``____ cls.name ____`` section), else the output's end."""
        match = re.search(rf"^_+ {cls}\.{name} _+$(.*?)(?=^_+ \w+\.\w+ _+$|^=+ short test summary)", self.output, re.M | re.S)
        return match.group(1) if match else self.output[-4000:]


def _run_suite(names: list[str]) -> SuiteRun:
    """Run every class of the suite on ``names`` in one pytest subprocess (verbose: one outcome line per test)."""
    ids = [f"{SUITE}::{cls}::{name}" for cls in CLASSES for name in names]
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-v", "-rA", "--color=no",
        f"--timeout={TEST_TIMEOUT_S}", *ids,
    ]  # fmt: skip
    # One outcome line per test, as _OUTCOME reads them: nothing from the caller's pytest options or colours.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PY_COLORS", "FORCE_COLOR")}
    env.update(BACKEND="gloo", WORLD_SIZE="2")
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=SUITE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks and their fork server too
        out, _ = proc.communicate()
    except BaseException:  # interrupted (Ctrl-C, the outer timeout): its own session would outlive us
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    outcomes = {(cls, name): outcome.lower() for cls, name, outcome in _OUTCOME.findall(out)}
    return SuiteRun(outcomes, out, time.monotonic() - start)


SUITE_TIMEOUT_S = TEST_TIMEOUT_S * 4 + 60 * len(INCLUDED)
"""The whole run: ~1 s a (class, test) here (32 s for 33; 137 s when each rank was spawned and imported torch), a
hung one stopped by pytest-timeout at TEST_TIMEOUT_S."""


@pytest.fixture(scope="module")
def suite() -> SuiteRun:
    return _run_suite(INCLUDED)


def _errors(out: str, limit: int = 40) -> str:
    """The lines that say what went wrong (the ranks' exceptions as MultiProcessTestCase relays them)."""
    lines = [line for line in out.splitlines() if line.startswith("E ") or "Error" in line or "Timeout" in line]
    return "\n".join(lines[:limit]) or out[-4000:]


def _param(name: str):
    marks = [pytest.mark.timeout(SUITE_TIMEOUT_S + 120)]  # the first test waits for the whole run (the fixture)
    if name in RELIES_ON_TORCH_INTERNALS:
        marks.append(pytest.mark.xfail(strict=True, reason=RELIES_ON_TORCH_INTERNALS[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n) for n in INCLUDED])
def test_torch_ddp_test_passes_with_graphddp(name: str, suite: SuiteRun) -> None:
    control = suite.outcomes.get(("TestTorchDDPControl", name), "did not finish")
    assert control == "passed", (  # the list holds tests PyTorch's DDP passes here: anything else is the machine's fault
        f"{name}: PyTorch's own DDP does not pass it here ({control}; the run took {suite.seconds:.0f} s):\n"
        f"{_errors(suite.section('TestTorchDDPControl', name))}"
    )
    for cls, how in list(CLASSES.items())[1:]:
        outcome = suite.outcomes.get((cls, name), "did not finish")
        assert outcome == "passed", f"{name}: PyTorch's DDP passed; {how} it {outcome}:\n{_errors(suite.section(cls, name))}"
