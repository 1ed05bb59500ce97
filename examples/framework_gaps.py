"""Measures what the frameworks' own mixed precision lacks that mpext adds, on a small model on
the CPU (the figures in docs/integrations.md come from this script):

1. Lightning ``bf16-true`` keeps no FP32 master weights: each AdamW update is applied to the
   BF16 param itself and rounded away when it is smaller than half a unit in the last place.
   Counted: (element, step) pairs where the tensor the optimizer updates (the BF16 param under
   ``bf16-true``, the FP32 master under mpext) did not change at all, and the distance of the
   final weights and loss from an FP32 (``32-true``) run with the same data.
2. Lightning ``bf16-mixed`` refuses a scaler, so nothing skips a step with a NaN gradient: one
   bad batch and the weights are NaN. Counted: NaN weights after one NaN batch.
3. accelerate (and transformers.Trainer, which steps the scheduler through it) advance the LR
   schedule on steps a fused optimizer skipped: ``optimizer_step_was_skipped`` stays False.
   Counted: schedule steps taken on skipped steps by a torch scheduler and by an mpext one.
4. accelerate with ``mixed_precision="fp16"`` on a CPU: no autocast and no loss scaling.

    python examples/framework_gaps.py             # the default run (about a minute)
    python examples/framework_gaps.py --steps 40  # quicker
"""
import argparse
import contextlib
import io
import logging
import math
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpext
import mpext.lightning
import mpext.accelerate
from mpext.optim import lr_scheduler

import lightning as L
import accelerate


def data(n, dim=64, seed=0):
    """Inputs drawn with ``seed``; the target function is the same for every seed."""
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(dim, 1, generator=torch.Generator().manual_seed(12345)) / dim ** 0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(2 * x @ w))


class MLP(L.LightningModule):
    def __init__(self, lr, nan_at=()):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                                 nn.Linear(256, 1))
        self.lr, self.nan_at = lr, set(nan_at)

    def training_step(self, batch, i):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        return loss * float("nan") if self.global_step in self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class UpdateCounter(L.Callback):
    """Counts (element, step) pairs where the tensor the optimizer updates did not change."""

    def __init__(self):
        self.unchanged = self.total = 0
        self._before = None

    def _targets(self, trainer, module):
        opt = trainer.optimizers[0]
        if isinstance(opt, mpext.MixedPrecisionOptimizer):
            return [opt.master_param(p) if opt.master_param(p) is not None else p
                    for p in module.parameters()]
        return list(module.parameters())

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._before = [t.detach().clone() for t in self._targets(trainer, module)]

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        for a, b in zip(self._before, self._targets(trainer, module)):
            self.unchanged += int((a == b).sum())
            self.total += a.numel()


def lightning_run(precision, lr, steps, nan_at=(), counter=None):
    loader = torch.utils.data.DataLoader(data(steps * 32), batch_size=32, shuffle=False)
    model = MLP(lr, nan_at)
    kw = {"plugins": [mpext.lightning.MixedPrecision("bf16")]} if precision == "mpext" else {
        "precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[counter] if counter is not None else [], **kw)
    trainer.fit(model, loader)
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    x, y = data(512, seed=1).tensors
    with torch.no_grad():
        loss = F.mse_loss(model.net(x.to(next(model.parameters()).dtype)).float(), y).item()
    return weights, loss


def masters_table(steps, lrs):
    rows = []
    for lr in lrs:
        ref, ref_loss = lightning_run("32-true", lr, steps)
        for name in ("bf16-true", "mpext"):
            counter = UpdateCounter()
            w, loss = lightning_run(name, lr, steps, counter=counter)
            rows.append({"lr": lr, "run": name,
                         "updates_lost_pct": 100.0 * counter.unchanged / counter.total,
                         "weight_error_vs_fp32": ((w - ref).norm() / ref.norm()).item(),
                         "eval_loss": loss, "eval_loss_fp32": ref_loss})
    return rows


def nan_table(steps):
    rows = []
    for name in ("bf16-mixed", "mpext"):
        w, loss = lightning_run(name, 1e-3, steps, nan_at=(steps // 2,))
        rows.append({"run": name, "nan_weights": int(torch.isnan(w).sum()),
                     "weights": w.numel(), "eval_loss": loss})
    return rows


def schedule_table(steps, overflow_every=5):
    """accelerate on the CPU with the helper's FP16 loss scaling, mpext's fused AdamW, an
    overflow every ``overflow_every`` steps; a torch LambdaLR and an mpext LambdaLR prepared
    and stepped through accelerate as its docs say."""
    rows = []
    for kind in ("torch", "mpext"):
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
        scaler = mpext.accelerate.use_grad_scaler(acc)
        torch.manual_seed(0)
        model = nn.Linear(64, 1)
        opt = mpext.optim.AdamW(model.parameters(), lr=1e-3)
        if kind == "torch":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
        else:
            sched = lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
        model, opt, sched = acc.prepare(model, opt, sched)
        flagged = 0
        for step in range(steps):
            x = torch.randn(8, 64)
            loss = model(x).float().pow(2).mean()
            if step % overflow_every == overflow_every - 1:
                loss = loss * float("inf")
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            flagged += bool(acc.optimizer_step_was_skipped)
        skipped = scaler.get_skipped_steps()
        advanced = sched.scheduler.last_epoch
        rows.append({"scheduler": kind, "steps": steps, "skipped": skipped,
                     "step_was_skipped_reported": flagged,
                     "schedule_advances_on_skipped_steps": advanced - (steps - skipped)})
    return rows


def fp16_cpu_row():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    model = acc.prepare(nn.Linear(4, 4))
    plain = {"scaler": type(acc.scaler).__name__ if acc.scaler else None,
             "autocast": acc.native_amp, "forward_dtype": str(model(torch.randn(2, 4)).dtype)}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    mpext.accelerate.use_grad_scaler(acc)
    inner = nn.Sequential(nn.Linear(4, 4))
    seen = []
    inner[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    acc.prepare(inner)(torch.randn(2, 4))
    helped = {"scaler": type(acc.scaler).__name__, "autocast": acc.native_amp,
              "forward_dtype": str(seen[0])}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return plain, helped


def quietly(fn, *args):
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        return fn(*args)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-4])
    args = p.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))

    out = {"masters": quietly(masters_table, args.steps, args.lrs),
           "nan": quietly(nan_table, max(10, args.steps // 4)),
           "schedule": quietly(schedule_table, max(10, args.steps // 4)),
           "fp16_cpu": quietly(fp16_cpu_row)}

    print("## 1. Lightning bf16-true vs mpext (BF16 params + FP32 masters), AdamW, %d steps"
          % args.steps)
    print("| lr | run | updates rounded away | weight error vs FP32 run | eval loss (FP32 run) |")
    print("|---|---|---|---|---|")
    for r in out["masters"]:
        print("| %g | %s | %.1f%% | %.2e | %.4f (%.4f) |" % (
            r["lr"], r["run"], r["updates_lost_pct"], r["weight_error_vs_fp32"],
            r["eval_loss"], r["eval_loss_fp32"]))
    print("\n## 2. One NaN batch: Lightning bf16-mixed vs mpext bf16")
    print("| run | NaN weights after the run | eval loss |")
    print("|---|---|---|")
    for r in out["nan"]:
        print("| %s | %d of %d | %s |" % (r["run"], r["nan_weights"], r["weights"],
                                         "nan" if math.isnan(r["eval_loss"])
                                         else "%.4f" % r["eval_loss"]))
    print("\n## 3. accelerate, fused AdamW, FP16 overflows: schedule steps on skipped steps")
    print("| scheduler | steps | skipped | step_was_skipped reported | schedule advanced on "
          "skipped steps |")
    print("|---|---|---|---|---|")
    for r in out["schedule"]:
        print("| %s | %d | %d | %d | %d |" % (r["scheduler"], r["steps"], r["skipped"],
                                              r["step_was_skipped_reported"],
                                              r["schedule_advances_on_skipped_steps"]))
    plain, helped = out["fp16_cpu"]
    print("\n## 4. accelerate mixed_precision='fp16' on a CPU")
    print("| | scaler | autocast | forward output dtype |")
    print("|---|---|---|---|")
    print("| accelerate alone | %s | %s | %s |" % (plain["scaler"], plain["autocast"],
                                                   plain["forward_dtype"]))
    print("| with mpext.accelerate.use_grad_scaler | %s | %s | %s (inside the model) |" % (
        helped["scaler"], helped["autocast"], helped["forward_dtype"]))
    return out


if __name__ == "__main__":
    main()
