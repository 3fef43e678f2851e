"""The classic DDP training script with one import swapped, as docs/migrating.md shows it:

    torchrun --standalone --nproc-per-node 2 tests/frameworks/plain_script.py --impl graphddp --out state.pt
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["graphddp", "torch"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank says where it is (graphddp.tools.launch.stop_job)
    if args.impl == "graphddp":
        from graphddp import DistributedDataParallel as DDP  # the only line that changes
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    for _ in range(5):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save({"state": model.module.state_dict(), "wrapper": type(model).__module__}, args.out)
    # Free the DDP while the group is still registered, then destroy the group, the order docs/reliability.md
    # ("A deadlock at exit") gives every script. (Here PyTorch's modules bind the group at import, as Dynamo is
    # imported after init_process_group, so this run could not deadlock that way; the order is kept for when they
    # do not.)
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
