"""CUDA paths, for a machine with a GPU: ``python tests/cuda_check.py`` (exits non-zero on failure).

Not collected by pytest (the default suite runs on CPU-only machines). Checks:
1. NCCL at world size 1: graphddp.DDP gradients equal local training; collectives ran on the Reducer's own
   CUDA stream (CudaCommStream), and the bf16 compression hook (NCCL-only) matches PyTorch's DDP.
2. gloo with CUDA tensors at world size 2 (both ranks on GPU 0): parity with PyTorch's DDP.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from models import MLP  # noqa: E402
from training import Case, batch_for  # noqa: E402

import graphddp  # noqa: E402
from graphddp.comm import CudaCommStream  # noqa: E402


def train(ddp, rank: int, steps: int = 4) -> dict:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = (t.cuda() for t in batch_for(Case(), step, 0, rank))
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {k: v.detach().cpu() for k, v in ddp.module.state_dict().items()}


def nccl_world_one(init_file: str) -> None:
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    torch.manual_seed(0)
    ours = graphddp.DDP(MLP().cuda(), device_ids=[0], bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    assert isinstance(ours.reducer._comm, CudaCommStream), "CUDA module without a comm stream"
    launched_on = []
    hook = ours.reducer._hook
    ours.reducer._hook = lambda s, b: launched_on.append(torch.cuda.current_stream()) or hook(s, b)
    torch.manual_seed(0)
    local = MLP().cuda()
    a, b = train(ours, 0), train(torch.nn.parallel.DistributedDataParallel(local, device_ids=[0]), 0)
    torch.testing.assert_close(a, b)
    assert launched_on and all(s == ours.reducer._comm.stream for s in launched_on), "collectives not on the comm stream"
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    results = []
    for impl in (graphddp.DDP, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        ddp = impl(MLP().cuda(), device_ids=[0], bucket_cap_mb=0.002)
        ddp.register_comm_hook(None, bf16_compress_hook)
        results.append(train(ddp, 0))
    torch.testing.assert_close(results[0], results[1])
    dist.destroy_process_group()
    print("nccl world size 1: parity, comm stream, bf16 hook: ok")


def gloo_cuda_rank(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = []
    for impl in (graphddp.DDP, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        results.append(train(impl(MLP().cuda(), device_ids=[0], bucket_cap_mb=0.002), rank))
    torch.testing.assert_close(results[0], results[1])
    dist.destroy_process_group()
    if rank == 0:
        print("gloo with CUDA tensors, 2 ranks: parity: ok")


if __name__ == "__main__":
    assert torch.cuda.is_available(), "this check needs a GPU"
    with tempfile.TemporaryDirectory() as d:
        nccl_world_one(os.path.join(d, "nccl"))
        mp.spawn(gloo_cuda_rank, args=(os.path.join(d, "gloo"),), nprocs=2)
    print("all CUDA checks passed")
