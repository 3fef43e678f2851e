"""Reproduce the rare failure of the zero-batch join test against PyTorch's DDP (docs/reliability.md, "PyTorch's
DDP inside a join"): a rank that joins before any backward of its own sends uninitialized memory as its usage map.

    python tests/repro/pytorch_join_usage_map.py

Two gloo ranks on loopback, PyTorch's DDP with ``find_unused_parameters=True``, nothing of graphddp imported. Rank 0
joins with no batch; rank 1 takes one step inside the join. Rank 0's Reducer allocates its usage map with
``at::empty`` and, never having run a backward, all-reduces it as it is. Where it holds -1, rank 1's count for a
parameter it used sums to 0: rank 1 takes the parameter for unused everywhere and keeps its own gradient,
undivided, where the average (half of it) was due. Freed blocks of -1 make the garbage likely; without them it
happens now and then (about once in a thousand runs of the test with both ranks on one CPU). Not a test: it
prints, for each try, rank 0's map and the parameters whose gradient on rank 1 is not the average.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.shared, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_shared: bool) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        return self.head(F.relu(self.shared(h)) if use_shared else h)


def one_try(rank: int, poison: bool, results: dict) -> None:
    if poison and rank == 0:  # leave freed blocks holding -1 where the map's allocation may land
        blocks = [torch.full((8,), -1, dtype=torch.int32) for _ in range(64)]
        del blocks
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True, bucket_cap_mb=0.002)
    usage_map = ddp.reducer._get_local_used_map().tolist()  # what rank 0 will send: never written
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    with ddp.join():
        if rank == 1:  # rank 0 joins at once; rank 1 takes one step, without ``shared``
            F.mse_loss(ddp(x, use_shared=False), y).backward()
    if rank == 1:
        local = Branchy()
        local.load_state_dict(ddp.module.state_dict())
        F.mse_loss(local(x, use_shared=False), y).backward()
        wrong = [name for (name, p), q in zip(ddp.module.named_parameters(), local.parameters())
                 if p.grad is not None and q.grad is not None and not torch.equal(p.grad, q.grad / 2)]  # fmt: skip
        results["undivided on rank 1"] = wrong
    else:
        results["rank 0's map"] = usage_map


def rank_main(rank: int, init_file: str, tries: int, queue: object) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for i in range(tries):
        results: dict = {}
        one_try(rank, poison=i % 2 == 1, results=results)
        queue.put((i, rank, results))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main(tries: int = 6) -> None:
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(rank_main, args=(os.path.join(d, "init"), tries, queue), nprocs=2, start_method="spawn")
    by_try: dict[int, dict] = {}
    while not queue.empty():
        i, _rank, results = queue.get()
        by_try.setdefault(i, {}).update(results)
    for i in sorted(by_try):
        print(f"try {i} ({'freed -1 blocks' if i % 2 else 'as it comes'}): {by_try[i]}")


if __name__ == "__main__":
    main()
