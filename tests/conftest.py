import os
import sys

# Multi-rank tests pickle functions from test modules to their ranks; the ranks import them by module name,
# which works because spawn and forkserver hand the parent's sys.path (with tests/ on it) to the children.
sys.path.insert(0, os.path.dirname(__file__))


import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from graphddp.tools.launch import import_before_init  # noqa: E402


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of world size 1 in this process, for the one-process test modules."""
    with tempfile.TemporaryDirectory() as d:
        import_before_init()  # Note [The default group outlives destroy_process_group]
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        yield
        dist.destroy_process_group()
