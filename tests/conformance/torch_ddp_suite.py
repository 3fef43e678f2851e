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

Where this differs from PyTorch's setup: the ranks are not spawned but forked from a fork server that has imported
torch and its test module once (``rank_process``), so each of the 33 (class, test) pairs does not pay for two ranks
importing them again. Each rank is a new process with its parent's environment (``TEMP_DIR``), but both ranks hash
strings with the server's seed (graphddp's parity tests run on spawned ranks with a seed each: ``tests/ranks.py``),
and a process a rank starts forks by default, where PyTorch's setup makes every rank spawn (none of the included
tests starts one).

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

from ranks import forkserver_context, in_parent_env  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

PRELOADED = ["torch", "torch.distributed"] + (
    [] if torch.version.cuda else ["torch.testing._internal.distributed.distributed_test"]
)
"""What the fork server imports once: most of a rank's start-up, which spawn pays in every rank of every test. Not
torch's test module on a CUDA build: importing it asks ``torch.cuda.is_available()``, which initialises CUDA's driver in
the server and marks every rank forked from it as unable to initialise CUDA."""


def rank_process(*, target, name, args, kwargs):
    """A ``Process`` for ``MultiProcessTestCase._start_processes``: forked from the server, in the parent's
    environment (``ranks.in_parent_env``: ``TEMP_DIR`` is made per test)."""
    return forkserver_context(PRELOADED).Process(target=in_parent_env, name=name, args=(dict(os.environ), target, *args), kwargs=kwargs)


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
        # Runs in the rank process (MultiProcessTestCase._start_processes targets cls._run).
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
