"""The benchmark's model of PyTorch's DDP's buckets (``bench.predict.torch_buckets``) against the buckets PyTorch's
DDP itself rebuilds, in one process: the predictions of the ``torch-*`` modes stand on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.predict import torch_buckets
from graphddp.passes import BucketCaps, ParamSpec, plan_buckets

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def rebuilt_buckets(model: nn.Module, **ddp_options: object) -> list[list[int]]:
    """PyTorch's DDP's buckets after its rebuild, as parameter indices in launch order (its own logging data)."""
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_options)
    for _ in range(3):  # rebuilt from the first backward's ready order, logged by the third forward
        ddp(torch.randn(4, 300)).sum().backward()
    logged = ddp._get_ddp_logging_data()
    assert logged["has_rebuilt_buckets"] == 1
    return [[int(i) for i in bucket.split()] for bucket in logged["rebuilt_per_bucket_param_indices"].split(", ")]


@pytest.mark.parametrize("cap_mb", [0.5, 1.2, None, 0])
def test_the_model_lays_out_pytorchs_buckets_as_pytorch_does(cap_mb: float | None) -> None:
    # Six 300 x 300 layers (361,200 B each with the bias): ready last layer first. At 0.5 MiB PyTorch closes a
    # bucket once it holds the cap or more (two layers, 0.69 MiB), where graphddp's planner with its ramps keeps
    # each bucket under it (one layer and a bias or weight at most): the model must be PyTorch's rule, and
    # graphddp's ``bucket_ramps=False`` (PyTorch's layout) must cut the very same buckets.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(300, 300) for _ in range(6)])
    names = [name for name, _ in model.named_parameters()]
    options = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    measured = [[names[i] for i in bucket] for bucket in rebuilt_buckets(model, **options)]
    specs = [ParamSpec(name, tuple(p.shape), p.dtype, "cpu") for name, p in reversed(list(model.named_parameters()))]
    modelled = [[p.name for p in bucket] for bucket in torch_buckets(specs, bucket_cap_mb=cap_mb)]
    assert modelled == measured
    if cap_mb == 0:  # PyTorch accepts 0: every gradient closes its bucket
        assert measured == [[name] for name in reversed(names)]
    first, bucket = (1, 25) if cap_mb is None else (cap_mb, cap_mb)  # torch 2.13: an explicit cap is the first's
    pytorchs_layout = plan_buckets(specs, caps=BucketCaps.from_mb(bucket, first, first, ramps=False))
    assert [list(b.names) for b in pytorchs_layout.buckets] == measured
    if cap_mb == 0.5:  # the case that tells the two rules apart
        ramped = plan_buckets(specs, caps=BucketCaps.from_mb(cap_mb, cap_mb, cap_mb, ramps=True)).buckets
        assert len(ramped) > len(measured)


def test_a_torch_without_the_caps_config_gets_a_one_mib_first_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before ``_BucketCapacityConfig`` (torch < 2.13), PyTorch's first bucket was 1 MiB whatever ``bucket_cap_mb``
    # said; with it, an explicit cap is the first bucket's cap too. The model must follow the torch it runs on.
    from bench.modes import _torch_caps_bytes

    assert _torch_caps_bytes(1.2) == (int(1.2 * 2**20), int(1.2 * 2**20))  # this torch: the explicit cap, twice
    monkeypatch.delattr(torch.nn.parallel.distributed, "_BucketCapacityConfig")
    assert _torch_caps_bytes(1.2) == (2**20, int(1.2 * 2**20))
    assert _torch_caps_bytes(None) == (2**20, 25 * 2**20)
