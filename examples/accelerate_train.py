"""accelerate with mpext: FP16 loss scaling with mpext.GradScaler (on the CPU too, where
accelerate alone does none), or a BF16 model with FP32 masters and the inf/NaN skip; the
unscale and the skip fused into mpext.optim.AdamW's step; a schedule that holds still on skipped
steps; save_state/load_state.

    python examples/accelerate_train.py                        # FP16 autocast + loss scaling
    python examples/accelerate_train.py --precision bf16       # BF16 params, FP32 masters
    python examples/accelerate_train.py --steps 30 --save state_dir
    python examples/accelerate_train.py --steps 60 --resume state_dir   # continues bit for bit
    accelerate launch examples/accelerate_train.py             # several processes (DDP)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator

import mpext
import mpext.accelerate
from mpext.optim import lr_scheduler


def synthetic(n, dim=32):
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(12345)) / dim ** 0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(2 * x @ w))


class Progress:
    """The number of steps taken, saved by accelerator.save_state with the rest."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--steps", type=int, default=60, help="train until this step")
    p.add_argument("--total", type=int, default=60, help="the schedule's length (steps)")
    p.add_argument("--nan-at", type=int, nargs="*", default=[7], help="steps with a NaN loss")
    p.add_argument("--save", default="")
    p.add_argument("--resume", default="")
    args = p.parse_args(argv)

    # fp16: autocast in float16 and FP32 params; bf16: the params themselves in BF16 (no
    # autocast needed), mpext.optim.AdamW keeping FP32 masters.
    accelerator = Accelerator(mixed_precision="fp16" if args.precision == "fp16" else "no")
    scaler = mpext.accelerate.use_grad_scaler(accelerator)  # before prepare()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 1))
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = mpext.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = lr_scheduler.get_linear_schedule_with_warmup(opt, args.total // 10, args.total)
    loader = torch.utils.data.DataLoader(synthetic(64 * args.total), batch_size=64)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)
        loader = accelerator.skip_first_batches(loader, progress.step)

    dtype = next(model.parameters()).dtype
    for step, (x, y) in enumerate(loader, progress.step):
        if step == args.steps:
            break
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        if step in args.nan_at:
            loss = loss * float("nan")
        accelerator.backward(loss)                            # loss x scale
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales first (fp16)
        opt.step()                                            # fused unscale + skip
        sched.step()                                          # holds still when skipped
        opt.zero_grad()
        progress.step = step + 1
    if args.save:
        accelerator.save_state(args.save)

    with torch.no_grad():
        final = F.mse_loss(model(x.to(dtype)).float(), y).item()
    result = {"loss": final,
              "applied_steps": sched.scheduler.last_epoch,
              "skipped_steps": scaler.get_skipped_steps(), "loss_scale": scaler.get_scale(),
              "lr": float(sched.get_last_lr()[0]), "param_dtype": str(dtype),
              # accelerate's own flag cannot see a skip inside a fused step:
              "accelerate_step_was_skipped": accelerator.optimizer_step_was_skipped}
    accelerator.print(" ".join("%s=%s" % kv for kv in result.items()))
    return result


if __name__ == "__main__":
    main()
