"""A checkpointing training job that torchrun restarts after one rank is SIGKILLed mid-backward.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/restart/restart_job.py --impl graphddp --ckpt DIR --out FILE [--kill-at 25] [--init recipe|plain]

40 steps of SGD with momentum on a small MLP, each rank's data seeded by (step, rank), so a resumed run sees what
an uninterrupted one saw. Every 10 steps rank 0 writes the model, the optimizer state and the step (to a temporary
file, then ``os.replace``), and all ranks wait on a barrier. At start every rank resumes from that checkpoint if
there is one. On the first attempt only (``TORCHELASTIC_RESTART_COUNT == "0"``), rank 1 SIGKILLs itself from a
post-accumulate-grad hook during the backward of step ``--kill-at``, while rank 0 has all-reduces in flight.
Rank 0 saves the final parameters (and how the run went) to ``--out``.

``--init recipe`` (the default) joins the process group as ``init_distributed`` below shows, so that a restarted
attempt cannot read the addresses the previous attempt left in torchrun's store; ``--init plain`` is the
classic ``dist.init_process_group("gloo")``, which only survives a restart when torchrun was started with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/reliability.md explains why).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 40
EVERY = 10
TIMEOUT = datetime.timedelta(seconds=60)


def init_distributed(backend: str = "gloo", timeout: datetime.timedelta = TIMEOUT) -> None:
    """``dist.init_process_group`` that a torchrun restart can rejoin (the recipe; docs/reliability.md).

    torchrun's c10d (and static) rendezvous hands every attempt the same agent-hosted TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``, same ``MASTER_PORT``), and ``init_process_group(env://)`` uses it
    without a per-attempt prefix, so gloo's address keys of the dead attempt are still there and a new rank may
    connect to a dead peer's port ("Connection refused") or wait for a connection that never comes. A prefix per
    attempt gives each attempt keys of its own. When the agent does not share its store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 hosts a fresh store on a fresh port each attempt), plain
    env:// is already safe, and no prefix is added.
    """
    from graphddp.tools.launch import init_process_group

    init_process_group(backend, timeout=timeout)


def agent_store() -> dist.TCPStore | None:
    """A client of torchrun's agent-hosted store, where the job's process group keys go (None: no agent store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=TIMEOUT)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Atomically: a reader finds the previous checkpoint or this one, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def log(message: str) -> None:
    print(
        f"[attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} rank {os.environ.get('RANK')} pid {os.getpid()}] "
        f"{message}",
        file=sys.stderr,
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["graphddp", "torch"], required=True)
    parser.add_argument("--ckpt", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--init", choices=["recipe", "plain"], default="recipe")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks a hung worker where it is
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # Evidence for the test: each attempt marks the store it was given; a restarted attempt looks for the mark of
    # the attempt before it (there, so is everything the dead attempt's process group wrote).
    raw = agent_store()
    previous_visible = raw.check([f"restart_job/attempt_{int(attempt) - 1}"]) if raw is not None else None
    log(
        f"MASTER_PORT={os.environ['MASTER_PORT']} TORCHELASTIC_USE_AGENT_STORE="
        f"{os.environ.get('TORCHELASTIC_USE_AGENT_STORE')} previous attempt's keys in this store: {previous_visible}"
    )

    if args.init == "recipe":
        init_distributed("gloo")
    else:  # the classic call, as a user's script has it (with the import docs/reliability.md advises before it)
        from graphddp.tools.launch import import_before_init

        import_before_init()
        dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    log("process group up")
    if raw is not None and rank == 0:
        raw.set(f"restart_job/attempt_{attempt}", "up")

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    )
    ckpt_path = Path(args.ckpt) / "checkpoint.pt"
    start = 0
    state = torch.load(ckpt_path, weights_only=True) if ckpt_path.exists() else None
    if state is not None:
        net.load_state_dict(state["model"])
        start = state["step"]
    # Small buckets, so several all-reduces are in flight when rank 1 dies.
    if args.impl == "graphddp":
        from graphddp import DistributedDataParallel as DDP

        model = DDP(net, bucket_cap_mb=0.1, first_bucket_cap_mb=0.1, last_bucket_cap_mb=0.1)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    if state is not None:
        opt.load_state_dict(state["optim"])
    log(f"starting at step {start}")

    current = {"step": start}
    if args.kill_at is not None and attempt == "0" and rank == 1:

        def die_mid_backward(param: torch.Tensor) -> None:
            if current["step"] == args.kill_at:
                log(f"SIGKILL mid-backward of step {args.kill_at}")
                os.kill(os.getpid(), signal.SIGKILL)

        net[2].weight.register_post_accumulate_grad_hook(die_mid_backward)  # a middle layer: later buckets in flight

    for step in range(start, STEPS):
        current["step"] = step
        x, y = batch(step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if (step + 1) % EVERY == 0:
            if rank == 0:
                save_checkpoint(ckpt_path, model.module, opt, step + 1)
            dist.barrier()

    if rank == 0:
        out = {
            "state": {k: v.clone() for k, v in model.module.state_dict().items()},
            "restart_count": int(attempt),
            "resumed_from": start,
            "previous_attempt_keys_visible": previous_visible,
            "impl": type(model).__module__,
        }
        torch.save(out, args.out)
    log("done")
    # Both ranks leave together: a rank destroying its group while the other still saves or reads can hang in
    # gloo's teardown (pytorch/pytorch#75097; seen once here in CI with PyTorch's DDP: rank 1 of the restarted
    # attempt stuck in destroy_process_group after "done").
    # Free the DDP (and what holds it) while the group is still registered, then destroy the group: freed after it,
    # PyTorch's DDP can deadlock at exit (seen in CI; the why is docs/reliability.md, "A deadlock at exit").
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
