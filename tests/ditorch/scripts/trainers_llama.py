"""transformers' Trainer (through accelerate) and Lightning's Trainer(accelerator="gpu", devices=WORLD_SIZE,
                                strategy="ddp" if WORLD_SIZE > 1 else "auto")
on a tiny Llama, as written for a CUDA node and launched by torchrun (2 processes); run by
tests/ditorch/test_trainers.py on sim. Each rank writes its per-step losses to ``OUT/<trainer>.rank<N>.json``.

``python trainers_llama.py OUT TRAINER 4`` without torchrun is the single-process run on the same global batch.
"""

import json
import os
import sys

import tiny_models  # tests/, on the path torchrun's children get
import torch

import ditorch  # noqa: F401 - the device layer

STEPS, SEQ, EXAMPLES = 3, 16, 12
PER_DEVICE = int(sys.argv[3]) if len(sys.argv) > 3 else 2
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))


def tiny_llama():
    torch.manual_seed(0)
    return tiny_models.tiny_llama()


def examples() -> list:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (EXAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def hf_trainer(out: str) -> list:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_DEVICE, max_steps=STEPS,
                             learning_rate=0.05, lr_scheduler_type="constant", optim="sgd", logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=examples())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]  # mean over the ranks


def lightning_trainer(out: str) -> list:
    import lightning

    losses: list = []

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            losses.append(loss.item())  # this rank's loss
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    # The ranks' batches in a known order (rank r takes examples r, r + 2, ...), so that the test can compare the
    # mean of their losses with one process on both ranks' batches together.
    sampler = None
    if WORLD_SIZE > 1:
        sampler = torch.utils.data.DistributedSampler(examples(), WORLD_SIZE, int(os.environ["RANK"]), shuffle=False)
    loader = torch.utils.data.DataLoader(examples(), batch_size=PER_DEVICE, sampler=sampler)
    trainer = lightning.Trainer(accelerator="gpu", devices=WORLD_SIZE,
                                strategy="ddp" if WORLD_SIZE > 1 else "auto", max_steps=STEPS, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                use_distributed_sampler=False, default_root_dir=out)
    trainer.fit(Module(), loader)
    return losses


def main() -> None:
    out, which = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    try:
        report = {"losses": {"hf": hf_trainer, "lightning": lightning_trainer}[which](out),
                  "device": torch.cuda.current_device()}
    except Exception as error:
        import traceback

        report = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, f"{which}.rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
