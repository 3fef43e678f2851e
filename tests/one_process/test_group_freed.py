"""``destroy_process_group`` frees the default group and joins its gloo threads while the interpreter runs
(Note [The default group outlives destroy_process_group] in ``graphddp/tools/launch.py``).

Each case runs in a fresh interpreter: whether PyTorch's modules bind the group depends on what was imported
before ``init_process_group``, which a process that has run other tests has long settled.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from graphddp.runtime.calibration import GLOO_THREAD_PREFIXES
from graphddp.tools.launch import MODULES_BINDING_THE_DEFAULT_GROUP

_RANK = """
import gc, os, sys, tempfile, time
import torch, torch.distributed as dist

def gloo_threads():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sum(name.startswith(GLOO_THREAD_PREFIXES) for name in names)
""" + f"GLOO_THREAD_PREFIXES = {GLOO_THREAD_PREFIXES!r}\n"

_AFTER = """
deadline = time.monotonic() + 30  # a thread names itself once it runs, which on a busy machine can be a while
while gloo_threads() == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
assert gloo_threads() > 0, "no gloo thread was seen while the group was up"
dist.destroy_process_group()
gc.collect()
print("gloo threads after destroy_process_group:", gloo_threads())
"""


def _run(body: str) -> str:
    code = _RANK + textwrap.dedent(body) + _AFTER
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def _init_world_of_one() -> str:
    return "dist.init_process_group('gloo', init_method='file://' + tempfile.mkdtemp() + '/init', rank=0, world_size=1)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' names from /proc")
@pytest.mark.parametrize(
    "module",
    # One fresh interpreter each (~3 s): the case that brings the trouble in stays in the default suite, the
    # module-by-module record of PyTorch's behaviour runs with the slow tests.
    [*(pytest.param(m, marks=pytest.mark.slow) for m in MODULES_BINDING_THE_DEFAULT_GROUP), "torch._dynamo"],
)
def test_pytorch_keeps_the_group_when_a_binding_module_is_imported_after_init(module: str) -> None:
    """The behaviour the mend is for, module by module (``torch._dynamo``: what brings the first in). If a PyTorch
    release stops one of them binding the group at import, its case fails and it can leave the list."""
    out = _run(_init_world_of_one() + f"import {module}\n")
    assert out != "gloo threads after destroy_process_group: 0", out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' names from /proc")
def test_imported_before_init_the_group_is_freed_with_its_threads() -> None:
    out = _run(
        "from graphddp.tools.launch import import_before_init\n"
        "import_before_init()\n" + _init_world_of_one() + f"import torch._dynamo, {', '.join(MODULES_BINDING_THE_DEFAULT_GROUP)}\n"
    )
    assert out == "gloo threads after destroy_process_group: 0", out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads' names from /proc")
def test_a_rank_started_by_graphddps_launcher_frees_its_group_after_a_ddp_step() -> None:
    """What the demo's rank does (``graphddp.tools.launch``), short of compiling: its DDP and the Dynamo import
    that its construction brings, then ``destroy_process_group``."""
    out = _run(
        """
        import graphddp
        from graphddp.tools.launch import free_port, init_process_group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        init_process_group("gloo")
        model = graphddp.DDP(torch.nn.Linear(4, 4))
        model(torch.randn(2, 4)).sum().backward()
        del model
        """
    )
    assert out == "gloo threads after destroy_process_group: 0", out


def test_called_after_init_it_refuses_and_says_why() -> None:
    code = _RANK + _init_world_of_one() + textwrap.dedent(
        """
        from graphddp.tools.launch import import_before_init
        try:
            import_before_init()
        except RuntimeError as e:
            print(e)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    assert "called after init_process_group()" in result.stdout
    assert "torch.distributed.nn.functional" in result.stdout
    assert "Note [The default group outlives destroy_process_group]" in result.stdout
