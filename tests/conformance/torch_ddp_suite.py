"""PyTorch's own DDP tests (``torch.testing._internal.distributed.distributed_test``) run against graphddp.

The tests are imported from the torch wheel, never copied. This module is PyTorch's
``test/distributed/test_distributed_spawn.py`` for ``BACKEND=gloo``, twice:

* ``TestTorchDDPControl``: PyTorch's setup, PyTorch's DDP (the control);
* ``TestGraphDDPInstalled``: the same, with ``graphddp.install()`` called in each rank before the process
  group and the test body, so every ``torch.nn.parallel.DistributedDataParallel(...)`` the test builds is graphddp's
  (``graphddp.integrations.frameworks.InstalledDDP``, Note [Frameworks]);
* ``TestGraphDDPRebound``: the same, swapping the old way instead: each rank rebinds
  ``torch.nn.parallel.DistributedDataParallel = graphddp.DDP`` (graphddp's class itself, not a subclass of PyTorch's).

The file name does not match ``test_*.py``, so the default pytest run does not collect it; the slow entry
``test_torch_ddp_suite.py`` runs a chosen list of tests from it, every class on every test in one subprocess; one alone, e.g.::

    python -m pytest -p no:cacheprovider tests/conformance/torch_ddp_suite.py -k "TestGraphDDPInstalled and test_ddp_logging_data_cpu"

One difference from PyTorch's setup: the ranks are not spawned but forked from a fork server that has imported torch
and its test module once (``rank_process``), so each of the 33 (class, test) pairs does not pay for two ranks
importing them again; each rank is still a fresh process with its parent's environment (``TEMP_DIR``).

Needs ``expecttest`` (imported by torch's common_utils). Env: ``BACKEND`` (gloo), ``WORLD_SIZE`` (2) default here,
``TEMP_DIR`` is made per test by ``TestDistBackend.setUp``.

Which of torch's DDP tests run on CPU/gloo, and which the entry includes, is recorded in
``test_torch_ddp_suite.py`` (INCLUDED / EXCLUDED, one line each).
"""

import os
import sys

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False

if not dist.is_available():  # pragma: no cover
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

PRELOADED = ["torch", "torch.distributed", "torch.testing._internal.distributed.distributed_test"]
"""What the fork server imports once: most of a rank's start-up, which spawn pays in every rank of every test."""


def _in_parent_env(env, target, *args, **kwargs):
    """A forked rank has the server's environment: take the parent's (``TEMP_DIR`` is made per test), as spawn does."""
    os.environ.clear()
    os.environ.update(env)
    target(*args, **kwargs)


def rank_process(*, target, name, args, kwargs):
    """A ``Process`` for ``MultiProcessTestCase._start_processes``: forked from the server, in the parent's environment."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # takes effect when the server starts: at the first rank
    return ctx.Process(target=_in_parent_env, name=name, args=(dict(os.environ), target, *args), kwargs=kwargs)


class TestTorchDDPControl(TestDistBackend, DistributedTest._DistTestBase):
    """PyTorch's tests with PyTorch's DDP, set up as ``test_distributed_spawn.py`` does (ranks from ``rank_process``)."""

    def setUp(self):
        super().setUp()
        self._start_processes(rank_process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


class TestGraphDDPInstalled(TestTorchDDPControl):
    """The same tests, each rank with ``graphddp.install()`` in force before the test runs."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        # Runs in the spawned rank process (MultiProcessTestCase._start_processes targets cls._run).
        import graphddp

        graphddp.install()
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class TestGraphDDPRebound(TestTorchDDPControl):
    """The same tests, each rank with ``torch.nn.parallel.DistributedDataParallel`` rebound to ``graphddp.DDP``."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        import graphddp

        torch.nn.parallel.DistributedDataParallel = graphddp.DDP
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
