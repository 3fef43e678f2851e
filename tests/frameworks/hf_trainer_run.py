"""A Hugging Face ``Trainer`` run on a tiny GPT-2 built from its config, as a user launches it:

    torchrun --standalone --nproc-per-node 2 tests/frameworks/hf_trainer_run.py --impl graphddp --out state.pt

``--impl graphddp`` adds the one line of docs/migrating.md (``graphddp.install()``); ``--impl torch`` is the same
run on PyTorch's DDP. Rank 0 saves the trained weights and the class of the DDP wrapper the Trainer built.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import signal
import weakref

import torch
import transformers


class Tokens(torch.utils.data.Dataset):
    """32 sequences of 16 random token ids from the config's 256-token vocabulary (the same on every rank)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["graphddp", "torch"], required=True)
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True), aot_eager")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank says where it is (graphddp.tools.launch.stop_job)
    if args.impl == "graphddp":
        import graphddp

        # The line docs/migrating.md adds: the Trainer's DDP is graphddp's from here on (small first and last
        # buckets, so the tiny model gets several buckets and, compiled, several segments).
        graphddp.install(first_bucket_cap_mb=0.01, last_bucket_cap_mb=0.005)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, bos_token_id=0, eos_token_id=0, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=args.out + ".trainer",
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        ddp_bucket_cap_mb=0.02,
        data_seed=0,
        dataloader_num_workers=0,
        torch_compile=args.compile,
        torch_compile_backend="aot_eager" if args.compile else None,
    )
    trainer = transformers.Trainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()
    if torch.distributed.get_rank() == 0:
        ddp = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)
        wrapper = f"{type(ddp).__module__}.{type(ddp).__qualname__}"
        splits = [s.num_segments for s in ddp.reducer.splits] if args.impl == "graphddp" else []
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"state": state, "wrapper": wrapper, "splits": splits}, args.out)
        del ddp
    # As PyTorch asks of every script (and plain_script.py does): leave together, with the group destroyed, not
    # one rank exiting while the other still saves. Without it a rank aborted once in CI at exit ("terminate called
    # without an active exception", SIGABRT) after training had finished on both ranks.
    # Free the DDP (and what holds it) while the group is still registered, then destroy the group: freed after it,
    # PyTorch's DDP can deadlock at exit (seen in CI; the why is docs/reliability.md, "A deadlock at exit").
    wrapper_alive = weakref.ref(getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped))  # the DDP itself
    del trainer, model
    gc.collect()
    assert wrapper_alive() is None, "the Trainer's DDP outlived the Trainer: it would be freed after the group"
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
