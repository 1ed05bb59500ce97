"""Lightning Trainer with mpext: BF16 (or FP16) params, FP32 master weights, loss scaling, fused
clipping, the inf/NaN skip and a warm-up + cosine schedule that holds still on skipped steps.

    python examples/lightning_train.py                          # BF16, LayerNorm kept in FP32
    python examples/lightning_train.py --precision fp16         # FP16 with dynamic loss scaling
    python examples/lightning_train.py --epochs 2 --save half.ckpt   # half of the schedule
    python examples/lightning_train.py --epochs 4 --resume half.ckpt   # continues bit for bit

A synthetic regression task (no downloads). The GPU is used when there is one.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L

import mpext
import mpext.lightning
from mpext.optim import lr_scheduler


def synthetic(n=1024, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g) / dim ** 0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(2 * x @ w))


class Regressor(L.LightningModule):
    def __init__(self, width=256, lr=3e-3, total_steps=64, nan_at=()):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, width), nn.LayerNorm(width), nn.GELU(),
                                 nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        if self.global_step in self.hparams.nan_at:  # a bad batch, to show the skip
            loss = loss * float("nan")
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.hparams.total_steps
        warm = max(1, total // 10)
        # Device-side schedule: advances only on applied steps, no host sync.
        sched = lr_scheduler.SequentialLR(opt, [
            lr_scheduler.LinearLR(opt, start_factor=0.0, end_factor=1.0, total_iters=warm),
            lr_scheduler.CosineAnnealingLR(opt, T_max=total - warm, eta_min=self.hparams.lr / 20),
        ], milestones=[warm])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--epochs", type=int, default=4, help="train until this epoch")
    p.add_argument("--schedule-epochs", type=int, default=4, help="the schedule's length")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--nan-at", type=int, nargs="*", default=[5], help="steps with a NaN loss")
    p.add_argument("--save", default="", help="save a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    args = p.parse_args(argv)

    data = synthetic(args.samples)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    total = args.schedule_epochs * len(loader)
    model = Regressor(total_steps=total, nan_at=tuple(args.nan_at))
    plugin = mpext.lightning.MixedPrecision(args.precision, keep_fp32=[nn.LayerNorm])
    trainer = L.Trainer(accelerator="auto", devices=1, plugins=[plugin], max_epochs=args.epochs,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)

    opt = trainer.optimizers[0]           # the plugin's mpext.MixedPrecisionOptimizer
    sched = trainer.lr_scheduler_configs[0].scheduler
    result = {"loss": float(trainer.callback_metrics["loss"]), "steps": trainer.global_step,
              "applied_steps": sched.last_epoch, "skipped_steps": opt.scaler.get_skipped_steps(),
              "loss_scale": opt.get_scale(), "lr": float(sched.get_last_lr()[0]),
              "param_dtype": str(model.net[0].weight.dtype)}
    print(" ".join("%s=%s" % kv for kv in result.items()))
    return result


if __name__ == "__main__":
    main()
