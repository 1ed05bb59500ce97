"""transformers.Trainer with mpext: a tiny GPT-2 built from its config (no downloads), trained
with mpext.optim.AdamW through optimizer_cls_and_kwargs, either as a BF16 model with FP32
masters or with fp16=True loss scaling by mpext.GradScaler, and a cosine schedule that holds
still on skipped steps.

    python examples/hf_trainer.py                              # BF16 model, FP32 masters
    python examples/hf_trainer.py --precision fp16             # fp16=True (on the CPU too)
    python examples/hf_trainer.py --steps 12 --resume out/checkpoint-6
"""
import argparse
import os

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")

import torch
import transformers

import mpext
import mpext.accelerate


class CountingSequences(torch.utils.data.Dataset):
    """Sequences a, a+1, a+2, ... (mod vocab): learnable in a few dozen steps."""

    def __init__(self, n=256, length=16, vocab=64):
        starts = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
        self.ids = (starts + torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--output-dir", default="hf_trainer_out")
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2,
                                     n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)      # BF16 params; the optimizer keeps FP32 masters
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=3e-3, warmup_steps=args.steps // 10, lr_scheduler_type="cosine",
        weight_decay=0.0, max_grad_norm=1.0, fp16=args.precision == "fp16",
        save_steps=args.save_steps, logging_steps=10, report_to=[], seed=0,
        disable_tqdm=True, dataloader_pin_memory=torch.cuda.is_available())
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=CountingSequences(),
        optimizer_cls_and_kwargs=(mpext.optim.AdamW, {"weight_decay": 0.1}))
    # Before train(): an mpext.GradScaler in the Trainer's Accelerator (fp16: loss scaling;
    # bf16: the inf/NaN skip) and the skip-aware version of the "cosine" schedule.
    scaler = mpext.accelerate.setup_trainer(trainer)
    trainer.train(resume_from_checkpoint=args.resume)

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"first_loss": losses[0], "last_loss": losses[-1],
              "applied_steps": trainer.lr_scheduler.last_epoch,
              "skipped_steps": scaler.get_skipped_steps(), "loss_scale": scaler.get_scale(),
              "param_dtype": str(next(trainer.model.parameters()).dtype),
              "optimizer": type(trainer.optimizer.optimizer).__name__}
    print(" ".join("%s=%s" % kv for kv in result.items()))
    return result


if __name__ == "__main__":
    main()
