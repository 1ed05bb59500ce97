"""Lightning Fabric with mpext: your own loop, BF16 (or FP16) params, FP32 master weights, loss
scaling, fused clipping, the inf/NaN skip, a skip-aware schedule, and checkpoints that resume
bit for bit.

    python examples/fabric_train.py                             # BF16
    python examples/fabric_train.py --precision fp16            # FP16, dynamic loss scaling
    python examples/fabric_train.py --steps 30 --save half.ckpt
    python examples/fabric_train.py --steps 30 --start 30 --resume half.ckpt

With Fabric the plugin cannot see the optimizer before its first step, so wrap it yourself after
``fabric.setup_module`` (the params are BF16/FP16 by then): the wrapper's state_dict then carries
the FP32 masters and the loss scale. Clip with ``plugin.clip_gradients`` (fused, after
unscaling); ``fabric.clip_gradients`` would clip the scaled gradients.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L

import mpext
import mpext.lightning
from mpext.optim import lr_scheduler


def batch(step, size=64, dim=32):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, dim, generator=g)
    w = torch.Generator().manual_seed(12345)
    return x, torch.tanh(2 * x @ (torch.randn(dim, 1, generator=w) / dim ** 0.5))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--start", type=int, default=0, help="the first step's index (resuming)")
    p.add_argument("--total", type=int, default=60, help="the schedule's length")
    p.add_argument("--nan-at", type=int, nargs="*", default=[7], help="steps with a NaN loss")
    p.add_argument("--save", default="")
    p.add_argument("--resume", default="")
    args = p.parse_args(argv)

    plugin = mpext.lightning.MixedPrecision(args.precision, keep_fp32=[nn.LayerNorm])
    fabric = L.Fabric(accelerator="auto", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 1))
    model = fabric.setup_module(model)                      # params -> BF16/FP16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = lr_scheduler.get_cosine_schedule_with_warmup(opt, args.total // 10, args.total)
    opt = fabric.setup_optimizers(plugin.wrap_optimizer(opt))   # FP32 masters, loss scale
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    if args.resume:
        fabric.load(args.resume, state)

    for step in range(args.start, args.start + args.steps):
        x, y = fabric.to_device(batch(step))
        loss = F.mse_loss(model(x), y)                      # outputs come back in FP32
        if step in args.nan_at:
            loss = loss * float("nan")
        fabric.backward(loss)                               # loss x scale (FP16)
        plugin.clip_gradients(opt, 1.0)                     # fused, after unscaling
        opt.step()                                          # skipped on the device on inf/NaN
        sched.step()                                        # holds still on a skipped step
        opt.zero_grad()
    if args.save:
        fabric.save(args.save, state)

    wrapper = opt.optimizer
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    result = {"loss": final, "applied_steps": sched.last_epoch,
              "skipped_steps": wrapper.scaler.get_skipped_steps(),
              "loss_scale": wrapper.get_scale(), "lr": float(sched.get_last_lr()[0]),
              "param_dtype": str(model.module[0].weight.dtype)}
    fabric.print(" ".join("%s=%s" % kv for kv in result.items()))
    return result


if __name__ == "__main__":
    main()
