"""Reproduce the heap corruption behind the rare deaths of the sparse parity tests (docs/reliability.md, "A heap
corruption with sparse gradients on gloo"): two gloo ranks on loopback train a model with a ``torch.sparse``
embedding gradient under a DDP, a fresh model every 6 steps, until ``--seconds`` pass or a rank dies.

    python tests/repro/sparse_gloo_heap.py --impl torch --seconds 150

With ``--impl torch`` nothing of graphddp is imported: PyTorch's own DDP (built-in reduction) dies with
"malloc(): unaligned tcache chunk detected" (SIGABRT) or SIGSEGV within a minute or two on this project's 2-core
VM. A rank that dies prints its Python stack (faulthandler); a core file (``ulimit -c unlimited``) shows the
corruption found by a gloo worker thread's allocation. With ``--impl graphddp`` the sparse gradient goes through
dense all-gathers instead (Note [Sparse gradients, gathered] in ``graphddp/runtime/reductions.py``). Not a test:
it runs until it fails, and a run that survives proves little.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Bag(nn.Module):
    """A sparse-gradient table and a dense head: one sparse bucket and one dense bucket."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16, sparse=True)
        self.head = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(1))  # idx [B, 8] -> [B, 8]


def wrap(impl: str, model: nn.Module) -> nn.Module:
    if impl == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
    import graphddp

    return graphddp.DDP(model, bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)


def time_is_up(here: bool) -> bool:
    """Whether some rank's clock says stop: the ranks stop after the same model, never one while the other starts
    another (a rank that left early would look like a crash to the other: "Connection closed by peer")."""
    flag = torch.tensor([int(here)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train(rank: int, args: argparse.Namespace, init: str) -> None:
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    g = torch.Generator().manual_seed(rank)
    start, steps = time.monotonic(), 0
    while not time_is_up(time.monotonic() - start >= args.seconds):
        ddp = wrap(args.impl, Bag(args.vocab))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=args.momentum)
        for _ in range(6):
            idx = torch.randint(0, args.vocab, (4, 8), generator=g)
            F.cross_entropy(ddp(idx), torch.randint(0, 8, (4,), generator=g)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
    if rank == 0:
        print(f"{args.impl}: {steps} steps in {args.seconds:.0f} s, no rank died", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("torch", "graphddp"), default="torch")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (0.9 fails fastest)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(train, args=(args, f"file://{os.path.join(tmp, 'init')}"), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
