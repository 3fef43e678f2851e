"""PyTorch's own DDP tests, run against graphddp by substitution (slow; see ``torch_ddp_suite.py``).

Each test name below is run from torch's ``distributed_test.DistributedTest._DistTestBase`` (gloo, world size 2,
``MultiProcessTestCase`` spawn) in a subprocess, three times: with PyTorch's DDP (the control, ``TestTorchDDPControl``),
with ``graphddp.install()`` in every rank (``TestGraphDDPInstalled``), and with the name rebound to ``graphddp.DDP``
(``TestGraphDDPRebound``: how scripts swapped DDP before ``install()``). A test the control does not pass here is a
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
"""Per run (one class, one test, two ranks): torch's DDP takes 7-15 s each on 2 cores."""


def _run(cls: str, name: str) -> tuple[str, str, float]:
    """Run ``cls::name`` of the suite in a subprocess: (outcome, output, seconds); outcome is
    passed/failed/skipped/timeout."""
    cmd = [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rA",
        f"--timeout={TEST_TIMEOUT_S}", f"{SUITE}::{cls}::{name}",
    ]
    env = {**os.environ, "BACKEND": "gloo", "WORLD_SIZE": "2"}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TEST_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the spawned ranks too
        out, _ = proc.communicate()
        return "timeout", out, time.monotonic() - start
    seconds = time.monotonic() - start
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if proc.returncode == 0 and re.search(r"\b1 passed\b", summary):
        return "passed", out, seconds
    if proc.returncode == 0 and re.search(r"\b1 skipped\b", summary):
        return "skipped", out, seconds
    return "failed", out, seconds


def _errors(out: str, limit: int = 40) -> str:
    """The lines that say what went wrong (the ranks' exceptions as MultiProcessTestCase relays them)."""
    lines = [line for line in out.splitlines() if line.startswith("E ") or "Error" in line or "Timeout" in line]
    return "\n".join(lines[:limit]) or out[-4000:]


def _param(name: str):
    marks = [pytest.mark.timeout(2 * (TEST_TIMEOUT_S + 90))]
    if name in RELIES_ON_TORCH_INTERNALS:
        marks.append(pytest.mark.xfail(strict=True, reason=RELIES_ON_TORCH_INTERNALS[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n) for n in INCLUDED])
def test_torch_ddp_test_passes_with_graphddp(name: str) -> None:
    control, control_out, control_s = _run("TestTorchDDPControl", name)
    assert control == "passed", (  # the list holds tests PyTorch's DDP passes here: anything else is the machine's fault
        f"{name}: PyTorch's own DDP does not pass it here ({control}, {control_s:.0f}s):\n{_errors(control_out)}"
    )
    for cls, how in (("TestGraphDDPInstalled", "with graphddp.install()"), ("TestGraphDDPRebound", "rebound to graphddp.DDP")):
        outcome, out, seconds = _run(cls, name)
        assert outcome == "passed", (
            f"{name}: PyTorch's DDP passed ({control_s:.0f}s); {how} it {outcome} ({seconds:.0f}s):\n{_errors(out)}"
        )
