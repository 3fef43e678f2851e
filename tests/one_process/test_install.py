"""``graphddp.install()`` (Note [Frameworks]): code that builds PyTorch's DDP, through any name it imported it
under, gets graphddp's, recognisable with ``isinstance`` as PyTorch's; nothing is wrapped, or reduced, twice."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from models import MLP
from torch import nn
from torch.nn.parallel.distributed import DistributedDataParallel as BoundAtImport  # as Lightning imports it

import graphddp
from graphddp.integrations.frameworks import InstalledDDP

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def test_while_installed_pytorchs_ddp_builds_graphddps_recognisable_as_pytorchs() -> None:
    with graphddp.installed(first_bucket_cap_mb=0.001):
        ddp = BoundAtImport(module=MLP(), find_unused_parameters=True)
        assert type(ddp) is InstalledDDP and isinstance(ddp, graphddp.DDP) and isinstance(ddp, nn.parallel.DistributedDataParallel)
        assert ddp.find_unused_parameters and ddp.options.first_bucket_cap_mb == 0.001  # PyTorch's and graphddp's options
        ddp(torch.randn(4, 12)).sum().backward()
        assert all(p.grad is not None for p in ddp.parameters())
        assert nn.parallel.DistributedDataParallel(ddp) is ddp, "a graphddp DDP passes through: never wrapped twice"
        plain = graphddp.DDP(MLP())
        assert nn.parallel.DistributedDataParallel(plain) is plain
        assert type(copy.deepcopy(ddp)) is InstalledDDP
        buffer = io.BytesIO()
        torch.save(ddp, buffer)
        buffer.seek(0)
        assert type(torch.load(buffer, weights_only=False)) is InstalledDDP
        assert ddp._get_ddp_logging_data()["find_unused_parameters"] == 1
        # PyTorch DDP methods that need its C++ Reducer say so instead of failing deep inside.
        with pytest.raises(NotImplementedError, match="_register_fused_optim belongs to PyTorch's C\\+\\+ Reducer"):
            ddp._register_fused_optim(torch.optim.SGD, lr=0.1)
        ddp._set_ddp_runtime_logging_sample_rate(10)  # accepted: nothing to sample
    assert type(BoundAtImport(MLP())) is nn.parallel.DistributedDataParallel, "the context manager uninstalls"


def test_install_takes_graphddps_own_options_only() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bucket_cap_mb'\]"):
        graphddp.install(bucket_cap_mb=1)  # PyTorch's arguments come from the framework
    assert type(nn.parallel.DistributedDataParallel(MLP())) is nn.parallel.DistributedDataParallel


def test_pytorchs_ddp_around_graphddps_refuses_to_reduce_twice() -> None:
    wrapped = nn.parallel.DistributedDataParallel(graphddp.DDP(MLP()))  # not installed: PyTorch's DDP outside
    with pytest.raises(RuntimeError, match="would be all-reduced twice.*graphddp.install"):
        wrapped(torch.randn(4, 12))
