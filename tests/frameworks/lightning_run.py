"""A Lightning ``Trainer`` run with ``DDPStrategy`` on CPU, as a user launches it:

    torchrun --standalone --nproc-per-node 2 tests/frameworks/lightning_run.py --impl graphddp --out state.pt

``--impl graphddp`` adds the one line of docs/migrating.md (``graphddp.install()``); ``--impl torch`` is the same
run on PyTorch's DDP. Rank 0 saves the trained weights, the DDP wrapper's class and what teardown left.
"""

from __future__ import annotations

import argparse
import faulthandler
import signal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 6))
        self.wrapper = ""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if not self.wrapper:  # what Lightning wrapped this module in
            ddp = self.trainer.strategy.model
            self.wrapper = f"{type(ddp).__module__}.{type(ddp).__qualname__}"
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["graphddp", "torch"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank says where it is (graphddp.tools.launch.stop_job)
    if args.impl == "graphddp":
        import graphddp

        graphddp.install(first_bucket_cap_mb=0.001, last_bucket_cap_mb=0.0005)  # the line docs/migrating.md adds

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randn(64, 6, generator=g))
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", bucket_cap_mb=0.002),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))  # Lightning adds the DistributedSampler
    if trainer.global_rank == 0:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        unwrapped = trainer.strategy.model is model  # teardown unwrapped it (after reading the logging data)
        torch.save({"state": state, "wrapper": model.wrapper, "unwrapped": unwrapped}, args.out)
    # Lightning leaves the process group alive at exit. As PyTorch asks of every script (hf_trainer_run.py and
    # plain_script.py do the same): leave together, with the group destroyed. Without it rank 1 aborted once in CI
    # at exit ("terminate called without an active exception", SIGABRT) after both ranks had finished training.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
