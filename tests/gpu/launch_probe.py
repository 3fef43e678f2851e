"""Train a tiny GPT with graphddp on NCCL (world size 1) and save its parameters to ``argv[1]``: run twice by
``tests/gpu/test_cuda.py`` under ``CUDA_LAUNCH_BLOCKING=0`` and ``=1``, whose results must agree."""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from training import Case, state_of, train  # noqa: E402

if __name__ == "__main__":
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        case = Case(model="gpt", device="cuda", steps=4, ddp=(("bucket_cap_mb", 0.002),), graphddp=(("first_bucket_cap_mb", 0.001),))
        run = train("graphddp", case, 0)
        assert len(run.ddp.bucket_plan.buckets) > 1
        torch.save({k: v.cpu() for k, v in state_of(run.ddp.module).items()}, sys.argv[1])
        dist.destroy_process_group()
