"""``import graphddp`` and the command line load neither Dynamo nor sympy nor networkx (issue 25, item 4): each costs
seconds, and a script that only imports the package, ``graphddp --version`` or ``graphddp --help`` uses none of
them. The names of the package still resolve to the real objects on first use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch._dynamo", "sympy", "networkx")


def loaded_after(code: str) -> list[str]:
    """Which of ``HEAVY`` a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import graphddp",
        "import graphddp.passes",  # the plan, the split and the cost model's names, not its solvers
        "import graphddp.tools.cli; graphddp.tools.cli.build_parser()",  # --version, --help, argument checks
        "from graphddp.passes import BucketCaps, plan_buckets, predict_step",
    ],
)
def test_importing_loads_no_compiler_and_no_solver(code: str) -> None:
    assert loaded_after(code) == []


def test_the_heavy_modules_load_when_used() -> None:
    """The probe can see them: a prediction loads networkx, a sympy expression sympy, the backend Dynamo."""
    assert loaded_after("from graphddp.passes import allreduce_seconds; allreduce_seconds()") == ["sympy"]
    code = "from graphddp.passes import LinkModel, StepInputs, predict_step"
    assert "networkx" not in loaded_after(code)
    assert "torch._dynamo" in loaded_after("import graphddp; graphddp.backend")


def test_the_lazy_names_are_the_real_objects() -> None:
    import graphddp
    import graphddp.compiler.backend
    import graphddp.ddp
    import graphddp.integrations.frameworks

    assert graphddp.DDP is graphddp.DistributedDataParallel is graphddp.ddp.DistributedDataParallel
    assert graphddp.backend is graphddp.compiler.backend.backend
    assert graphddp.install is graphddp.integrations.frameworks.install
    assert set(graphddp.__all__) <= set(dir(graphddp))
    assert all(getattr(graphddp, name) is not None for name in graphddp.__all__)
    with pytest.raises(AttributeError, match="no attribute 'DPP'"):
        graphddp.DPP  # noqa: B018


def test_the_checkpoint_integration_loads_with_the_ddp() -> None:
    """``graphddp.DDP`` brings Note [Checkpoints]'s construction hook with it, as the eager package import did."""
    code = "import graphddp; graphddp.DDP\nimport sys; print('graphddp.integrations.checkpoint' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "True"
