"""Convergence: does mixed precision train as well as FP32? Two studies of gpt.py's small
character model on the generated corpus, every run from the same weights, on the same batches,
with the same schedule:

- "amp": six modes (FP32, native AMP BF16/FP16, mpext BF16/FP16, naive BF16 without master
  weights); their validation loss, BF16's lost updates and the FP16 gradient underflow;
- "lean": mpext.optim.AdamW's lean optimizer states (exact remainders, BF16 moments, master-free
  stochastic rounding, and the round-to-nearest variants that fail) fine-tuning a pretrained
  checkpoint at a fine-tuning learning rate, over several seeds, against the FP32-master run's
  seed-to-seed spread; the remainder runs must equal the FP32-master runs bit for bit.

Method, criteria and how to read the plots: docs/convergence.md and docs/lean_state.md.

    python -m benchmarks.bench_convergence [--quick] [--device auto|cpu|cuda] [--study all|amp|lean]
        [--modes ...] [--seeds N]
"""
import argparse
import contextlib
import dataclasses
import math
import sys
import time
from typing import Dict, List, Optional


import torch

from .common import (Context, PhaseClock, check, markdown_table, payload_header, pyplot,
                     report_footer, results, run_standalone, save_figure, section_head)
from .gpt import GPT, GPTConfig, count_params, get_batch, load_corpus, split_corpus, \
    unigram_entropy
from .training import Trainer

NAME = "bench_convergence"
TITLE = "Convergence: FP32 vs native AMP vs mpext on a small GPT (character model)"

BF16, FP16 = torch.bfloat16, torch.float16

# key, label
MODES = [
    ("fp32", "1. FP32 params, torch AdamW (reference)"),
    ("amp_bf16", "2. native AMP: BF16 autocast, FP32 params, AdamW(fused)"),
    ("amp_fp16", "3. native AMP: FP16 autocast + torch GradScaler"),
    ("mpext_bf16", "4. mpext: BF16 params + MixedPrecisionOptimizer"),
    ("mpext_fp16", "5. mpext: FP16 params + MixedPrecisionOptimizer (dynamic scale)"),
    ("bf16_naive", "6. BF16 params, torch AdamW directly, no masters"),
]
MODE_KEYS = [k for k, _ in MODES]
LABEL = dict(MODES)
SHORT = {"fp32": "FP32", "amp_bf16": "AMP BF16", "amp_fp16": "AMP FP16 + GradScaler",
         "mpext_bf16": "mpext BF16", "mpext_fp16": "mpext FP16", "bf16_naive": "naive BF16",
         "master": "FP32 master", "remainder": "remainder", "remainder_bf16m":
         "remainder + BF16 m,v (SR)", "sr_bf16m": "no master SR + BF16 m,v (SR)",
         "sr": "no master SR", "rtn": "no master, nearest", "bf16m_rtn":
         "BF16 m,v nearest"}
MPEXT_MODES = ("mpext_bf16", "mpext_fp16")

# The lean study: mpext.optim.AdamW on BF16 params (training.MODES[LEAN_BASE]) with these
# options. key, label, options, criterion: "reference"; "exact" (bitwise the reference);
# "band" (mean final loss within the reference's noise band); "cautionary" (expected worse).
LEAN_BASE = "mpext_optim_bf16"
_BF16_MOMENTS = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
LEAN_MODES = [
    ("master", "FP32 master (reference)", {}, "reference"),
    ("remainder", "remainder: BF16 param + int16 remainder", dict(param_remainders=True),
     "exact"),
    ("remainder_bf16m", "remainder + BF16 moments (SR)",
     dict(param_remainders=True, **_BF16_MOMENTS), "band"),
    ("sr_bf16m", "no master, SR params + BF16 moments (SR)",
     dict(master_weights=False, stochastic_rounding=True, **_BF16_MOMENTS), "band"),
    ("sr", "no master, SR params, FP32 moments",
     dict(master_weights=False, stochastic_rounding=True), "band"),
    ("rtn", "no master, params rounded to nearest", dict(master_weights=False), "cautionary"),
    ("bf16m_rtn", "remainder + BF16 moments rounded to nearest",
     dict(param_remainders=True, moment_rounding="nearest", **_BF16_MOMENTS), "cautionary"),
]
LEAN_KEYS = [k for k, _, _, _ in LEAN_MODES]
LEAN_OPTIONS = {k: o for k, _, o, _ in LEAN_MODES}
LEAN_CRITERION = {k: c for k, _, _, c in LEAN_MODES}
LABEL.update({k: lab for k, lab, _, _ in LEAN_MODES})

TOLERANCE = 0.02        # modes 4 and 5 within 2% of FP32; mode 6 worse by more than this
LOW_LR_FACTOR = 0.1     # the second setting, when mode 6 is not worse in the main one
LOW_LR_MODES = ("fp32", "mpext_bf16", "bf16_naive")
# CPU: one torch thread unless --threads says otherwise. The model is too small to gain from a
# second thread, and on a shared machine a parallel region waits for descheduled threads.
CPU_THREADS = 1


@dataclasses.dataclass
class Setting:
    """One training setting, shared by every mode."""

    preset: str
    batch_size: int
    steps: int
    lr: float
    warmup: int
    min_lr_frac: float = 0.1
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.01
    eval_interval: int = 25
    eval_batches: int = 8
    final_k: int = 4
    seed: int = 1234
    data_seed: int = 4321
    # loss scaling, identical for torch's GradScaler and mpext's
    init_scale: float = 2.0 ** 16
    growth_interval: int = 100

    def lr_at(self, step: int, lr: Optional[float] = None) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_frac`` x lr."""
        base = self.lr if lr is None else lr
        if step < self.warmup:
            return base * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return base * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi
                                                                                     * t)))


SETTINGS = {
    "quick": Setting(preset="tiny", batch_size=16, steps=100, lr=3e-3, warmup=10,
                     eval_interval=10, eval_batches=4, final_k=3, growth_interval=25),
    "cpu": Setting(preset="small", batch_size=16, steps=300, lr=2e-3, warmup=20,
                   eval_interval=20, growth_interval=50),
    "cuda": Setting(preset="gpu", batch_size=64, steps=1500, lr=1e-3, warmup=100,
                    eval_interval=50, eval_batches=16, growth_interval=200),
}


@dataclasses.dataclass
class LeanSetting:
    """The lean study: a checkpoint pretrained in FP32 (``pretrain``, once), fine-tuned from it
    in every lean mode (``finetune``) with ``seeds`` seeds. Seed s fixes the fine-tuning's batch
    order (``finetune.data_seed + s``) and the stochastic rounding (``seed=s``)."""

    pretrain: Setting
    finetune: Setting
    seeds: int = 3


# Fine-tuning: lr 1e-4 decaying to 1e-5, betas (0.9, 0.999) as torch's defaults. Most of the
# pretrained weights are large enough that such updates are below half a BF16 ulp.
LEAN_SETTINGS = {
    "quick": LeanSetting(
        Setting(preset="tiny", batch_size=16, steps=100, lr=3e-3, warmup=10, eval_interval=50,
                eval_batches=4),
        Setting(preset="tiny", batch_size=16, steps=60, lr=1e-4, warmup=0, betas=(0.9, 0.999),
                eval_interval=10, eval_batches=4, final_k=2, data_seed=8642)),
    "cpu": LeanSetting(
        Setting(preset="tiny", batch_size=16, steps=300, lr=3e-3, warmup=20, eval_interval=100,
                eval_batches=8),
        Setting(preset="tiny", batch_size=16, steps=300, lr=1e-4, warmup=0, betas=(0.9, 0.999),
                eval_interval=20, eval_batches=8, final_k=3, data_seed=8642)),
    "cuda": LeanSetting(
        Setting(preset="gpu", batch_size=64, steps=1000, lr=1e-3, warmup=100,
                eval_interval=250, eval_batches=16),
        Setting(preset="gpu", batch_size=64, steps=500, lr=1e-4, warmup=0, betas=(0.9, 0.999),
                eval_interval=25, eval_batches=16, final_k=3, data_seed=8642)),
}


def _half_ulp_bf16(p: torch.Tensor) -> torch.Tensor:
    """Half the spacing of BF16 numbers at each element of the FP32 ``p`` (an update smaller
    than this leaves ``p.to(bfloat16)`` unchanged)."""
    b = p.detach().to(BF16).float().abs()
    b = torch.where(b < torch.finfo(BF16).tiny, torch.full_like(b, torch.finfo(BF16).tiny), b)
    exp = torch.floor(torch.log2(b))
    return torch.exp2(exp - 8)  # ulp = 2^(e - 7) for 8 significand bits; half of it


class Run:
    """The record of one mode's training: curves, scales, skips, lost updates, time."""

    def __init__(self, mode: str, lr: float, seed: Optional[int] = None):
        self.mode, self.lr, self.seed = mode, lr, seed
        self.eval_steps: List[int] = []
        self.eval_loss: List[float] = []
        self.train_loss: List[float] = []
        self.scale: List[float] = []
        self.skipped: List[int] = []
        self.unchanged: List[float] = []  # BF16/FP16 params: fraction a step left alone
        self.below_half_ulp: List[float] = []  # FP32 values: fraction of updates < half a BF16 ulp
        self.v_decreased: List[float] = []  # fraction of exp_avg_sq elements a step lowered
        self.seconds = 0.0
        self.final_grads: Optional[List[torch.Tensor]] = None
        self.final_params: Optional[List[torch.Tensor]] = None
        self.final_fp32: Optional[List[torch.Tensor]] = None  # masters (or FP32 params)
        self.final_state: Optional[Dict[str, torch.Tensor]] = None  # the model's, in FP32

    def final_loss(self, k: int) -> float:
        return sum(self.eval_loss[-k:]) / len(self.eval_loss[-k:])

    def to_json(self, k: int) -> dict:
        return {"mode": self.mode, "label": LABEL[self.mode], "lr": self.lr, "seed": self.seed,
                "final_loss": self.final_loss(k), "eval_steps": self.eval_steps,
                "eval_loss": self.eval_loss, "train_loss": self.train_loss,
                "scale": self.scale or None, "skipped_steps": self.skipped,
                "unchanged_fraction": self.unchanged or None,
                "below_half_bf16_ulp_fraction": self.below_half_ulp or None,
                "exp_avg_sq_decreased_fraction": self.v_decreased or None,
                "seconds": self.seconds}


@torch.no_grad()
def evaluate(tr: Trainer, batches) -> float:
    """Mean loss over the fixed validation batches, in the mode's own precision."""
    tr.model.eval()
    total = 0.0
    for x, y in batches:
        with tr.autocast():
            _, loss = tr.model(x, y)
        total += float(loss)
    tr.model.train()
    return total / len(batches)


def _recipe(mode: str):
    """A mode's training.MODES key and optimizer options (the lean modes' state layout)."""
    if mode in LEAN_OPTIONS:
        return LEAN_BASE, dict(LEAN_OPTIONS[mode])
    return mode, {}


def train(mode: str, st: Setting, cfg: GPTConfig, train_data, val_batches, device, *,
          lr: Optional[float] = None, fp32_gemm: bool = False, track_updates: bool = False,
          track_moments: bool = False, keep_grads: bool = False, keep_final: bool = False,
          init: Optional[Dict[str, torch.Tensor]] = None, seed: Optional[int] = None,
          bar=None) -> Run:
    """Trains one mode (training.MODES, or a lean mode of LEAN_MODES) on the shared batch
    sequence, from the shared initial weights or (``init``) from a checkpoint, then evaluated
    before the first step too. ``seed`` (lean modes): the stochastic-rounding seed, and the
    batch order ``st.data_seed + seed``. ``track_updates``: per step, the fraction of
    low-precision params left unchanged and of FP32 values (params or masters) that moved less
    than half a BF16 ulp; ``track_moments``: the fraction of second-moment elements lowered;
    ``keep_final``: the final params, FP32 values and model state."""
    lr = st.lr if lr is None else lr
    run = Run(mode, lr, seed)
    base, options = _recipe(mode)
    if seed is not None:
        if mode not in LEAN_OPTIONS:
            raise ValueError("train: seed is for the lean modes, not %r" % (mode,))
        options["seed"] = seed
    torch.manual_seed(st.seed)
    model = GPT(cfg, fp32_gemm=fp32_gemm)  # FP32 init for all
    if init is not None:
        model.load_state_dict(init)
    tr = Trainer.for_mode(base, model, device,
                          lr=st.lr, betas=st.betas, weight_decay=st.weight_decay,
                          fused=mode == "amp_bf16",
                          scaler_options=dict(init_scale=st.init_scale,
                                              growth_interval=st.growth_interval), **options)
    params = tr.params
    low = params[0].dtype is not torch.float32
    # an FP32 value to watch: the param itself, or a master mpext's optimizer keeps
    has_fp32 = not low or (tr.kind == "mpext-optim" and options.get("master_weights", True))

    def fp32_values():
        if not low:
            return [p.detach().clone() for p in params]
        return [tr.opt.master_param(p) for p in params]

    gen = torch.Generator().manual_seed(st.data_seed + (seed or 0))
    if init is not None:
        run.eval_steps.append(0)
        run.eval_loss.append(evaluate(tr, val_batches))
    t0 = time.perf_counter()
    for step in range(st.steps):
        for group in tr.opt.param_groups:
            group["lr"] = st.lr_at(step, lr)
        x, y = get_batch(train_data, st.batch_size, cfg.block_size, gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with tr.autocast():
            _, loss = tr.model(x, y)
        if track_updates:
            before = [p.detach().clone() for p in params] if low else None
            before32 = fp32_values() if has_fp32 else None
        if track_moments:
            v_before = [(p, tr.opt.state[p]["exp_avg_sq"].clone()) for p in params
                        if "exp_avg_sq" in tr.opt.state.get(p, {})]
        scale = tr.get_scale()  # the scale this step's backward uses
        tr.backward(loss)
        if keep_grads and step == st.steps - 1:
            run.final_grads = [p.grad.detach().clone() for p in params]
        applied = tr.step()
        if scale is not None:
            run.scale.append(scale)
            # torch's GradScaler says nothing of a skip but lowers its scale
            if (not bool(applied)) if applied is not None else tr.get_scale() < scale:
                run.skipped.append(step)
        if track_updates:
            n = sum(p.numel() for p in params)
            if low:
                same = sum(int((p.detach() == b).sum()) for p, b in zip(params, before))
                run.unchanged.append(same / n)
            if has_fp32:  # updates that a BF16 weight rounded to nearest could not have taken
                small = sum(int(((a - b).abs() < _half_ulp_bf16(b)).sum())
                            for a, b in zip(fp32_values(), before32))
                run.below_half_ulp.append(small / n)
        if track_moments and v_before:
            lowered = sum(int((tr.opt.state[p]["exp_avg_sq"] < v).sum()) for p, v in v_before)
            run.v_decreased.append(lowered / sum(v.numel() for _, v in v_before))
        run.train_loss.append(float(loss.detach()))
        if (step + 1) % st.eval_interval == 0 or step == st.steps - 1:
            run.eval_steps.append(step + 1)
            run.eval_loss.append(evaluate(tr, val_batches))
            check(math.isfinite(run.eval_loss[-1]), "%s: validation loss became %r at step %d"
                  % (mode, run.eval_loss[-1], step + 1))
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str("%s loss %.3f" % (SHORT[mode], run.train_loss[-1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - t0
    if keep_final:
        run.final_params = [p.detach().clone() for p in params]
        run.final_fp32 = fp32_values() if has_fp32 else None
        run.final_state = {k: v.detach().float().clone()
                           for k, v in tr.model.state_dict().items()}
    return run


# ---------------------------------------------------------------------------------------------
# Underflow demonstration


FP16_MIN_SUB = 2.0 ** -24
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = 65504.0
BF16_MIN_NORMAL = 2.0 ** -126
BF16_MIN_SUB = 2.0 ** -133


def underflow_stats(grads: List[torch.Tensor], scale: float):
    """Fractions of the non-zero FP32 gradient elements that cast to zero / to a subnormal in
    FP16 (unscaled, and multiplied by ``scale``), and to zero in BF16; also the fraction that
    overflows FP16 after scaling. Counted by casting (round to nearest even), not by
    comparing against thresholds. Returns ``(stats, the non-zero gradient elements)``."""
    g = torch.cat([t.detach().float().flatten() for t in grads]).cpu()
    g = g[g != 0]
    n = g.numel()
    h = g.to(FP16)
    hs = (g * scale).to(FP16)
    out = {
        "elements": n,
        "scale": scale,
        "fp16_zero": int((h == 0).sum()) / n,
        "fp16_subnormal": int(((h != 0) & (h.abs() < FP16_MIN_NORMAL)).sum()) / n,
        "fp16_scaled_zero": int((hs == 0).sum()) / n,
        "fp16_scaled_subnormal": int(((hs != 0) & (hs.abs() < FP16_MIN_NORMAL)).sum()) / n,
        "fp16_scaled_overflow": int(torch.isinf(hs).sum()) / n,
        "bf16_zero": int((g.to(BF16) == 0).sum()) / n,
        "log2_abs_min": float(g.abs().min().log2()),
        "log2_abs_median": float(g.abs().median().log2()),
        "log2_abs_max": float(g.abs().max().log2()),
    }
    return out, g


# ---------------------------------------------------------------------------------------------
# Plots


def _label_axes(ax, title: str, xlabel: str, ylabel: str = "", fontsize: int = 7) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=fontsize)



STYLE = {"fp32": ("black", "-"), "amp_bf16": ("tab:blue", "--"), "amp_fp16": ("tab:cyan", "-."),
         "mpext_bf16": ("tab:green", "-"), "mpext_fp16": ("tab:olive", "--"),
         "bf16_naive": ("tab:red", ":")}


def plot_loss(path, runs: Dict[str, Run], low: Dict[str, Run], st: Setting, entropy: float,
              title: str):
    plt = pyplot()
    ncols = 3
    fig, axes = plt.subplots(1, ncols, figsize=(6.0 * ncols, 4.4))
    ax = axes[0]
    for k, r in runs.items():
        c, ls = STYLE[k]
        ax.plot(r.eval_steps, r.eval_loss, color=c, linestyle=ls, label=SHORT[k])
    for k, r in low.items():
        c, ls = STYLE[k]
        ax.plot(r.eval_steps, r.eval_loss, color=c, linestyle=ls, alpha=0.5, linewidth=2.5,
                label="%s, lr x%g" % (SHORT[k], LOW_LR_FACTOR))
    ax.axhline(entropy, color="grey", linewidth=1, linestyle=":",
               label="unigram entropy %.2f" % entropy)
    _label_axes(ax, "validation loss (held-out 10%)", "step", "cross-entropy (nats/char)")

    ax = axes[1]
    ref = runs.get("fp32")
    if ref is not None:
        for k, r in runs.items():
            c, ls = STYLE[k]
            ax.plot(r.eval_steps, [a / b for a, b in zip(r.eval_loss, ref.eval_loss)], color=c,
                    linestyle=ls, label=SHORT[k])
        lref = low.get("fp32")
        for k, r in low.items():
            if k == "fp32" or lref is None:
                continue
            c, ls = STYLE[k]
            ax.plot(r.eval_steps, [a / b for a, b in zip(r.eval_loss, lref.eval_loss)],
                    color=c, linestyle=ls, alpha=0.5, linewidth=2.5,
                    label="%s / FP32, lr x%g" % (SHORT[k], LOW_LR_FACTOR))
        ax.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="green", alpha=0.1, label="±2%")
        ratios = [line.get_ydata() for line in ax.get_lines()]
        top = max(max(y) for y in ratios) if ratios else 1.0
        bottom = min(min(y) for y in ratios) if ratios else 1.0
        ax.set_ylim(min(0.97, bottom - 0.005), max(1.05, top + 0.01))
        ax.set_xlim(left=st.steps * 0.2)
    _label_axes(ax, "validation loss / FP32's (same lr)", "step")

    ax = axes[2]
    for src, attr, lab in ((runs, "unchanged", "naive BF16: weights a step left unchanged"),
                           (runs, "below_half_ulp",
                            "FP32: updates < half a BF16 ulp of the weight"),
                           (low, "unchanged", "naive BF16, lr x%g" % LOW_LR_FACTOR),
                           (low, "below_half_ulp", "FP32 (< half ulp), lr x%g" % LOW_LR_FACTOR)):
        for k, r in src.items():
            ys = getattr(r, attr)
            if ys:
                c, ls = STYLE[k]
                ax.plot(range(1, len(ys) + 1), [100 * v for v in ys], color=c, linestyle=ls,
                        alpha=1.0 if src is runs else 0.5, label=lab)
    ax.set_ylim(0, 100)
    _label_axes(ax, "lost updates in BF16 without master weights", "step", "% of weights")
    return save_figure(fig, path, title)


def plot_scale(path, runs: Dict[str, Run], title: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    for k in ("amp_fp16", "mpext_fp16"):
        r = runs.get(k)
        if r is None:
            continue
        c, ls = STYLE[k]
        ax.step(range(len(r.scale)), r.scale, where="post", color=c, linestyle=ls,
                label="%s (%d skipped)" % (SHORT[k], len(r.skipped)))
        if r.skipped:
            ax.scatter(r.skipped, [r.scale[i] for i in r.skipped], marker="x", color="tab:red",
                       zorder=3, s=30)
    ax.scatter([], [], marker="x", color="tab:red", label="skipped step (inf/NaN gradient)")
    ax.set_yscale("log", base=2)
    _label_axes(ax, "FP16 loss scale per step (the scale the step's backward used)", "step",
                "loss scale", fontsize=8)
    return save_figure(fig, path, title)


def plot_underflow(path, g: torch.Tensor, stats: dict, title: str):
    plt = pyplot()
    lg = g.abs().log2()
    scale = stats["scale"]
    lgs = lg + math.log2(scale)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [1, 1.3]})
    for ax, (lo, hi), zoom in ((axes[0], (-140, 20), False),
                               (axes[1], (math.floor(float(lg.min())) - 2,
                                          max(18, math.ceil(float(lgs.max())) + 1)), True)):
        bins = torch.linspace(lo, hi, 161 if zoom else 321)
        ax.hist(lg.numpy(), bins=bins.numpy(), alpha=0.6, color="tab:blue",
                label="|grad| unscaled")
        ax.hist(lgs.numpy(), bins=bins.numpy(), alpha=0.5, color="tab:orange",
                label="|grad| x scale %g" % scale)
        ax.axvspan(math.log2(FP16_MIN_SUB), math.log2(FP16_MIN_NORMAL), color="gold", alpha=0.2,
                   label="FP16 subnormal")
        ax.axvline(math.log2(FP16_MIN_SUB) - 1, color="red", linestyle="--", linewidth=1,
                   label="FP16: below 2^-25 rounds to 0")
        ax.axvline(math.log2(FP16_MIN_NORMAL), color="darkorange", linestyle=":", linewidth=1,
                   label="FP16 min normal 2^-14")
        ax.axvline(math.log2(FP16_MAX), color="purple", linestyle="--", linewidth=1,
                   label="FP16 max 65504")
        ax.axvline(math.log2(BF16_MIN_NORMAL), color="green", linestyle="--", linewidth=1,
                   label="BF16 min normal 2^-126")
        ax.set_xlim(lo, hi)
        ax.set_yscale("log")
        ax.set_xlabel("log2 |gradient|")
        ax.set_ylabel("elements")
        ax.grid(True, alpha=0.3)
        if zoom:
            ax.set_title("zoom: FP16 zero %.3g%% unscaled, %.3g%% scaled; subnormal %.3g%% / %.3g%%"
                         % (100 * stats["fp16_zero"], 100 * stats["fp16_scaled_zero"],
                            100 * stats["fp16_subnormal"], 100 * stats["fp16_scaled_subnormal"]),
                         fontsize=9)
        else:
            ax.set_title("full range: BF16 zero %.3g%%; BF16's range reaches 2^-133"
                         % (100 * stats["bf16_zero"]), fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------------
# The lean study


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits, as integers of its width."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def bits_differ(a: List[torch.Tensor], b: List[torch.Tensor]) -> int:
    """The number of elements whose bits differ between two lists of float tensors (every
    element, if dtypes or shapes do not match)."""
    if len(a) != len(b):
        return max(sum(t.numel() for t in a), sum(t.numel() for t in b), 1)
    n = 0
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            n += max(x.numel(), y.numel(), 1)
        else:
            n += int((_bits(x) != _bits(y)).sum())
    return n


def _first_difference(a: List[float], b: List[float]) -> Optional[int]:
    if len(a) != len(b):
        return min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check_same_training(ref: Run, other: Run) -> None:
    """Raises CorrectnessError unless ``other`` trained exactly as ``ref`` did: the same loss at
    every step and evaluation, and bitwise the same final params and FP32 values (masters)."""
    what = "%s vs %s, seed %s" % (other.mode, ref.mode, other.seed)
    i = _first_difference(ref.train_loss, other.train_loss)
    check(i is None, "%s: the training losses differ from step %s on" % (what, i))
    i = _first_difference(ref.eval_loss, other.eval_loss)
    check(i is None, "%s: the validation losses differ from evaluation %s on" % (what, i))
    for name, a, b in (("params", ref.final_params, other.final_params),
                       ("FP32 masters", ref.final_fp32, other.final_fp32)):
        check(a is not None and b is not None, "%s: no final %s kept" % (what, name))
        n = bits_differ(a, b)
        check(n == 0, "%s: the final %s differ in %d of %d elements"
              % (what, name, n, sum(t.numel() for t in a)))


def lean_verdicts(finals: Dict[str, List[float]]) -> dict:
    """The noise band and each mode's place in it. ``finals``: per mode, its final validation
    loss for each seed (the reference "master" among them). The band is the reference's mean
    plus or minus its seed-to-seed range (max - min); a mode is inside when its mean over the
    seeds is at most that range from the reference's mean. Criteria (LEAN_CRITERION): "exact"
    modes equal the reference seed for seed, "band" modes are inside, "cautionary" modes are
    expected above the band (worse)."""
    ref = finals["master"]
    center = sum(ref) / len(ref)
    half = max(ref) - min(ref)
    modes = {}
    for key, xs in finals.items():
        mean = sum(xs) / len(xs)
        delta = mean - center
        crit = LEAN_CRITERION[key]
        met = {"reference": True, "exact": list(xs) == list(ref), "band": abs(delta) <= half,
               "cautionary": delta > half}[crit]
        modes[key] = {"finals": list(xs), "mean": mean, "delta": delta,
                      "inside": abs(delta) <= half, "criterion": crit, "met": met}
    return {"center": center, "half_width": half, "modes": modes}


def band_curve(runs: List[Run]) -> tuple:
    """The reference runs' mean and seed-to-seed range (the band's half-width) at each of
    their (shared) evaluation steps."""
    losses = list(zip(*(r.eval_loss for r in runs)))
    return ([sum(v) / len(v) for v in losses], [max(v) - min(v) for v in losses])


def moment_decay_demo(device, steps: int = 2000, n: int = 4096, drop_at: int = 100,
                      factor: float = 0.1, every: int = 10, beta2: float = 0.999) -> dict:
    """The second moment of a BF16 param whose gradients (normal noise) shrink ``1/factor``-fold
    at step ``drop_at``, kept in FP32, in BF16 rounded stochastically and in BF16 rounded to
    nearest: the mean of exp_avg_sq every ``every`` steps, with its expectation (float64,
    ignoring the gradients' own BF16 rounding)."""
    import mpext

    kinds = {"fp32": {}, "bf16_sr": dict(exp_avg_sq_dtype=BF16),
             "bf16_nearest": dict(exp_avg_sq_dtype=BF16, moment_rounding="nearest")}
    out = {"steps": list(range(every, steps + 1, every)), "drop_at": drop_at, "factor": factor,
           "beta2": beta2, "n": n, "mean_v": {}}
    e, expected = 0.0, []
    for t in range(steps):
        e = beta2 * e + (1 - beta2) * (1.0 if t < drop_at else factor ** 2)
        if (t + 1) % every == 0:
            expected.append(e)
    out["expected"] = expected
    for kind, options in kinds.items():
        p = torch.zeros(n, dtype=BF16, device=device, requires_grad=True)
        opt = mpext.optim.AdamW([p], lr=1e-3, betas=(0.9, beta2), weight_decay=0.0, **options)
        gen = torch.Generator().manual_seed(0)
        means = []
        for t in range(steps):
            sigma = 1.0 if t < drop_at else factor
            p.grad = (torch.randn(n, generator=gen) * sigma).to(device=device, dtype=BF16)
            opt.step()
            if (t + 1) % every == 0:
                means.append(float(opt.state[p]["exp_avg_sq"].double().mean()))
        out["mean_v"][kind] = means
    return out


def lean_study(ls: LeanSetting, cfg: GPTConfig, train_data, val_batches, device,
               modes: List[str], *, fp32_gemm: bool = False, progress=None,
               phase=None) -> dict:
    """Pretrains once in FP32, fine-tunes from that checkpoint in every lean mode of ``modes``
    (the reference "master" always) for each seed, checks that the remainder runs equal the
    reference runs bit for bit, and places every mode in the reference's noise band (see
    lean_verdicts). The bitwise check needs deterministic training: a second reference run of
    seed 0 tells whether it is (a non-deterministic device skips the check, and says so)."""
    ft = ls.finetune
    modes = [k for k in LEAN_KEYS if k in modes or k == "master"]
    total = ls.pretrain.steps + ft.steps * (len(modes) * ls.seeds + 1)
    bar = progress(total=total, desc="lean state") if progress else None
    with bar if bar is not None else contextlib.nullcontext():
        pre = train("fp32", ls.pretrain, cfg, train_data, val_batches, device,
                    fp32_gemm=fp32_gemm, keep_final=True, bar=bar)
        if phase:
            phase("lean_pretrain")
        runs: Dict[str, List[Run]] = {k: [] for k in modes}
        for s in range(ls.seeds):
            for k in modes:
                runs[k].append(train(k, ft, cfg, train_data, val_batches, device,
                                     fp32_gemm=fp32_gemm, init=pre.final_state, seed=s,
                                     track_updates=True, track_moments=True,
                                     keep_final=LEAN_CRITERION[k] in ("reference", "exact"),
                                     bar=bar))
        repeat = train("master", ft, cfg, train_data, val_batches, device, fp32_gemm=fp32_gemm,
                       init=pre.final_state, seed=0, keep_final=True, bar=bar)
    first = runs["master"][0]
    deterministic = (repeat.train_loss == first.train_loss and repeat.eval_loss ==
                     first.eval_loss and bits_differ(repeat.final_params, first.final_params) == 0
                     and bits_differ(repeat.final_fp32, first.final_fp32) == 0)
    checked = deterministic and "remainder" in runs
    if checked:
        for ref, rem in zip(runs["master"], runs["remainder"]):
            check_same_training(ref, rem)
    if phase:
        phase("lean_finetune")
    finals = {k: [r.final_loss(ft.final_k) for r in rs] for k, rs in runs.items()}
    demo = moment_decay_demo(device)
    if phase:
        phase("lean_moment_demo")
    return {"pretrain": pre, "runs": runs, "deterministic": deterministic,
            "remainder_checked": checked, "verdict": lean_verdicts(finals), "demo": demo}


def _tail_mean(xs: List[float]) -> float:
    """The mean over the second half of a per-step series (nan when empty)."""
    tail = xs[len(xs) // 2:]
    return sum(tail) / len(tail) if tail else float("nan")


def _seed_mean(runs: List[Run], attr: str) -> float:
    vals = [_tail_mean(getattr(r, attr)) for r in runs if getattr(r, attr)]
    return sum(vals) / len(vals) if vals else float("nan")


def lean_report(ls: LeanSetting, cfg: GPTConfig, res: dict, device) -> tuple:
    """The lean study's Markdown lines, JSON and missed criteria."""
    ft, pre = ls.finetune, ls.pretrain
    v = res["verdict"]
    runs = res["runs"]
    center, half = v["center"], v["half_width"]
    misses = []
    rows = []
    for key, rs in runs.items():
        m = v["modes"][key]
        crit = m["criterion"]
        if crit == "reference":
            verdict = "— (reference)"
        elif crit == "exact":
            verdict = ("bitwise equal: **yes**" if res["remainder_checked"] else
                       "bitwise: not checked (training not deterministic here)")
        elif crit == "band":
            verdict = "inside: yes" if m["met"] else "inside: **no**"
            if not m["met"]:
                misses.append("%s: mean final loss %+.4f from the FP32 master's, outside its "
                              "noise band (±%.4f)" % (SHORT[key], m["delta"], half))
        else:
            verdict = "worse than the band: " + ("yes" if m["met"] else "no")
            if key == "rtn" and not m["met"]:
                misses.append("master-free round-to-nearest not worse than the noise band "
                              "(%+.4f, band ±%.4f): this setting does not show its stall"
                              % (m["delta"], half))
        rows.append([LABEL[key], "%.4f" % m["mean"], " / ".join("%.4f" % x for x in m["finals"]),
                     "%+.4f" % m["delta"], verdict,
                     "%.1f%%" % (100 * _seed_mean(rs, "unchanged")),
                     "%.1f%%" % (100 * _seed_mean(rs, "v_decreased")),
                     "%.1f" % (sum(r.seconds for r in rs) / len(rs))])
    headers = ["mode (BF16 params, mpext.optim.AdamW)", "final val loss (mean)", "per seed",
               "Δ vs FP32 master", "criterion", "weights unchanged / step",
               "v lowered / step", "time s / run"]
    pre_loss = runs["master"][0].eval_loss[0]
    md = ["### Lean optimizer state: fine-tuning a pretrained checkpoint", "",
          "GPT preset `%s` (%s) pretrained in FP32 for %d steps (torch AdamW, peak lr %g, "
          "betas %s), validation loss %.4f in BF16; then fine-tuned from that checkpoint for "
          "%d steps of batch %d, BF16 params and `mpext.optim.AdamW` in each mode, lr %g "
          "decaying (cosine) to %g, betas %s, weight decay %g, %d seeds (seed s: the batch "
          "order and the stochastic-rounding seed). Final loss: mean of the last %d of the "
          "validation evaluations (every %d steps, %d fixed held-out batches). Noise band: "
          "the FP32-master runs' mean ± their seed-to-seed range (max − min), %.4f ± %.4f."
          % (ft.preset, ", ".join("%s=%s" % (f, getattr(cfg, f)) for f in
                                  ("n_layer", "n_head", "n_embd", "block_size")),
             pre.steps, pre.lr, pre.betas, pre_loss, ft.steps, ft.batch_size, ft.lr,
             ft.lr * ft.min_lr_frac, ft.betas, ft.weight_decay, ls.seeds, ft.final_k,
             ft.eval_interval, ft.eval_batches, center, half), ""]
    md += [markdown_table(headers, rows), ""]
    if res["remainder_checked"]:
        md += ["Remainders: every remainder run equals the FP32-master run of its seed bit for "
               "bit (the loss at every step and evaluation, the final BF16 params and the FP32 "
               "masters rebuilt from the remainders); the benchmark asserts it.", ""]
    elif "remainder" in runs:
        md += ["Remainders: **not compared** -- two FP32-master runs of the same seed differed "
               "on this device (its kernels are not deterministic), so no bitwise comparison "
               "of separate runs is meaningful here.", ""]
    ref_small = _seed_mean(runs["master"], "below_half_ulp")
    lines = []
    if "rtn" in runs:
        lines.append(
            "- Why round to nearest stalls: per step, %.1f%% of the FP32-master reference's "
            "updates were smaller than half a BF16 ulp of their weight (mean over the second "
            "half and the seeds). Without a master, round to nearest drops exactly those: the "
            "master-free run left %.1f%% of its weights unchanged per step and its loss stops "
            "falling (%+.4f). Stochastic rounding leaves about as many unchanged per step (%s) "
            "but moves a weight by a whole ulp with probability |update| / ulp, so the "
            "expected step is the update: no bias, only noise."
            % (100 * ref_small, 100 * _seed_mean(runs["rtn"], "unchanged"),
               v["modes"]["rtn"]["delta"],
               "%.1f%%" % (100 * _seed_mean(runs["sr"], "unchanged")) if "sr" in runs
               else "n/a"))
    demo = res["demo"]
    d_end = {k: xs[-1] for k, xs in demo["mean_v"].items()}
    if "bf16m_rtn" in runs:
        lines.append(
            "- BF16 moments rounded to nearest: the second moment was lowered in %.2f%% of its "
            "elements per step (FP32 master, FP32 moments: %.1f%%): v = 0.999 v + 0.001 g² "
            "rounds back to v unless g² adds at least half an ulp, because 0.999 is within half "
            "a BF16 ulp of 1, so v can grow but never decay. Here that %s: over %d steps with "
            "beta2 = 0.999 the FP32 second moment forgets little either, and these gradients "
            "do not shrink. Where they do, it matters: gradient noise falling %gx at step %d "
            "(synthetic, %d elements) leaves after %d steps a mean v of %.3g in FP32 (expected "
            "%.3g), %.3g in BF16 with stochastic rounding and %.3g (%.1fx) in BF16 rounded to "
            "nearest, whose Adam steps are then %.1fx too small."
            % (100 * _seed_mean(runs["bf16m_rtn"], "v_decreased"),
               100 * _seed_mean(runs["master"], "v_decreased"),
               "stays inside the band" if v["modes"]["bf16m_rtn"]["inside"] else
               "is outside the band",
               ft.steps, 1 / demo["factor"], demo["drop_at"], demo["n"], demo["steps"][-1],
               d_end["fp32"], demo["expected"][-1], d_end["bf16_sr"], d_end["bf16_nearest"],
               d_end["bf16_nearest"] / d_end["fp32"],
               math.sqrt(d_end["bf16_nearest"] / d_end["fp32"])))
    md += lines + [""] if lines else []
    payload = {"setting": {"pretrain": dataclasses.asdict(pre),
                           "finetune": dataclasses.asdict(ft), "seeds": ls.seeds},
               "pretrain_run": res["pretrain"].to_json(pre.final_k),
               "deterministic": res["deterministic"],
               "remainder_bitwise_checked": res["remainder_checked"],
               "band": {"center": center, "half_width": half},
               "verdict": v["modes"],
               "runs": {k: [r.to_json(ft.final_k) for r in rs] for k, rs in runs.items()},
               "moment_decay_demo": demo, "targets_missed": misses}
    return md, payload, misses


LEAN_STYLE = {"master": ("black", "-"), "remainder": ("tab:gray", "--"),
              "remainder_bf16m": ("tab:green", "-"), "sr_bf16m": ("tab:blue", "-"),
              "sr": ("tab:cyan", "--"), "rtn": ("tab:red", ":"),
              "bf16m_rtn": ("tab:orange", "-.")}


def plot_lean(path, res: dict, ls: LeanSetting, title: str):
    """Four panels: the mean validation loss of every lean mode with the noise band; each mode's
    difference from the reference (symlog); the weights a step left unchanged; the second
    moment of the synthetic shrinking-gradient demo."""
    plt = pyplot()
    runs = res["runs"]
    steps = runs["master"][0].eval_steps
    center, half = band_curve(runs["master"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))

    def mean_curve(rs):
        return [sum(v) / len(v) for v in zip(*(r.eval_loss for r in rs))]

    ax = axes[0][0]
    ax.fill_between(steps, [c - h for c, h in zip(center, half)],
                    [c + h for c, h in zip(center, half)], color="grey", alpha=0.25,
                    label="noise band: FP32 master mean ± seed range")
    for k, rs in runs.items():
        c, ls_ = LEAN_STYLE[k]
        ax.plot(steps, mean_curve(rs), color=c, linestyle=ls_, label=SHORT[k])
    _label_axes(ax, "validation loss, mean of %d seeds (step 0: the pretrained model)"
                % ls.seeds, "fine-tuning step", "cross-entropy (nats/char)")
    ax.legend(fontsize=7, loc="lower left")

    ax = axes[0][1]
    lin = max(max(half), 1e-6)
    ax.fill_between(steps, [-h for h in half], half, color="grey", alpha=0.25,
                    label="noise band")
    for k, rs in runs.items():
        c, ls_ = LEAN_STYLE[k]
        ax.plot(steps, [a - b for a, b in zip(mean_curve(rs), center)], color=c,
                linestyle=ls_, label=SHORT[k])
    ax.set_yscale("symlog", linthresh=2 * lin)
    _label_axes(ax, "difference from the FP32 master's mean (symlog; linear within ±%.1g)"
                % (2 * lin), "fine-tuning step", "Δ loss")

    ax = axes[1][0]
    for k, rs in runs.items():
        ys = [sum(v) / len(v) for v in zip(*(r.unchanged for r in rs))]
        if ys and k in ("master", "sr", "sr_bf16m", "rtn"):
            c, ls_ = LEAN_STYLE[k]
            ax.plot(range(1, len(ys) + 1), [100 * y for y in ys], color=c, linestyle=ls_,
                    label="%s: BF16 weights unchanged" % SHORT[k])
    ys = [sum(v) / len(v) for v in zip(*(r.below_half_ulp for r in runs["master"]))]
    ax.plot(range(1, len(ys) + 1), [100 * y for y in ys], color="tab:purple", linewidth=1,
            label="FP32 master: updates < half a BF16 ulp")
    ax.set_ylim(0, 100)
    _label_axes(ax, "weights a step left unchanged", "fine-tuning step", "% of weights")

    ax = axes[1][1]
    demo = res["demo"]
    ax.plot(demo["steps"], demo["expected"], color="grey", linewidth=4, alpha=0.4,
            label="expectation")
    for kind, (c, ls_, lab) in {"fp32": ("black", "-", "FP32 moments"),
                                "bf16_sr": ("tab:green", "--", "BF16, stochastic rounding"),
                                "bf16_nearest": ("tab:orange", "-.", "BF16, round to nearest")
                                }.items():
        ax.plot(demo["steps"], demo["mean_v"][kind], color=c, linestyle=ls_, label=lab)
    ax.set_yscale("log")
    _label_axes(ax, "second moment, gradients %gx smaller from step %d (beta2 %g)"
                % (1 / demo["factor"], demo["drop_at"], demo["beta2"]), "step",
                "mean exp_avg_sq (synthetic, %d elements)" % demo["n"])
    return save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------------
# Options and the run


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--study", choices=("all", "amp", "lean"), default="all",
                        help="amp: FP32 vs native AMP vs mpext; lean: mpext.optim's lean "
                             "optimizer states over several seeds (default: both)")
    parser.add_argument("--modes", nargs="+", choices=MODE_KEYS + LEAN_KEYS, default=None,
                        help="modes to run (default: all; fp32 and master, the references, "
                             "always run; a study none of whose modes is named is skipped)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per mode (amp)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (amp)")
    parser.add_argument("--preset", default=None, help="GPT preset (tiny, small, gpu) (amp)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per lean mode (default 3; at least 2)")
    parser.add_argument("--ft-steps", type=int, default=None, help="fine-tuning steps (lean)")
    parser.add_argument("--ft-lr", type=float, default=None, help="fine-tuning peak lr (lean)")
    parser.add_argument("--native-lowp-gemm", action="store_true",
                        help="CPU: use torch's own BF16/FP16 matmuls (slow without AVX512-BF16)")
    return parser


def _setting(ctx: Context) -> Setting:
    st = dataclasses.replace(SETTINGS["quick" if ctx.quick else
                                      ("cuda" if ctx.is_cuda else "cpu")])
    a = ctx.args
    if getattr(a, "steps", None):
        if a.steps < 2 * st.eval_interval:
            raise SystemExit("--steps must be at least %d" % (2 * st.eval_interval))
        st.steps = a.steps
    if getattr(a, "lr", None):
        if not a.lr > 0:
            raise SystemExit("--lr must be positive")
        st.lr = a.lr
    if getattr(a, "preset", None):
        st.preset = a.preset
    return st


def _lean_setting(ctx: Context) -> LeanSetting:
    base = LEAN_SETTINGS["quick" if ctx.quick else ("cuda" if ctx.is_cuda else "cpu")]
    ls = LeanSetting(dataclasses.replace(base.pretrain), dataclasses.replace(base.finetune),
                     base.seeds)
    a = ctx.args
    if getattr(a, "seeds", None) is not None:
        if a.seeds < 2:
            raise SystemExit("--seeds must be at least 2 (the noise band is their spread)")
        ls.seeds = a.seeds
    if getattr(a, "ft_steps", None):
        if a.ft_steps < 2 * ls.finetune.eval_interval:
            raise SystemExit("--ft-steps must be at least %d" % (2 * ls.finetune.eval_interval))
        ls.finetune.steps = a.ft_steps
    if getattr(a, "ft_lr", None):
        if not a.ft_lr > 0:
            raise SystemExit("--ft-lr must be positive")
        ls.finetune.lr = a.ft_lr
    return ls


def _studies(ctx: Context):
    """The modes each study runs (None: the study is skipped)."""
    a = ctx.args
    study = getattr(a, "study", None) or "all"
    named = getattr(a, "modes", None)
    amp = [k for k in MODE_KEYS if named is None or k in named]
    lean = [k for k in LEAN_KEYS if named is None or k in named]
    amp = (["fp32"] + [k for k in amp if k != "fp32"]) if study in ("all", "amp") and (
        amp or study == "amp") else None
    lean = (["master"] + [k for k in lean if k != "master"]) if study in ("all", "lean") and (
        lean or study == "lean") else None
    return amp, lean


def run(ctx: Context) -> dict:
    dev = ctx.device
    amp_modes, lean_modes = _studies(ctx)
    fp32_gemm = dev.type == "cpu" and not getattr(ctx.args, "native_lowp_gemm", False)
    threads_before = torch.get_num_threads()
    if dev.type == "cpu" and not ctx.args.threads:
        torch.set_num_threads(CPU_THREADS)
    try:
        return _run(ctx, amp_modes, lean_modes, fp32_gemm)
    finally:
        torch.set_num_threads(threads_before)


def _run(ctx: Context, amp_modes: Optional[List[str]], lean_modes: Optional[List[str]],
         fp32_gemm: bool) -> dict:
    dev = ctx.device
    phase = PhaseClock()
    phases = phase.times

    data, vocab = load_corpus()
    train_data, val_data = split_corpus(data)
    entropy = unigram_entropy(train_data)
    phase("corpus")

    def val_batches_for(st: Setting, cfg: GPTConfig):
        vgen = torch.Generator().manual_seed(st.data_seed + 1)
        return [tuple(t.to(dev) for t in get_batch(val_data, st.batch_size, cfg.block_size,
                                                    vgen))
                for _ in range(st.eval_batches)]

    md = section_head(ctx, TITLE)
    payload = payload_header(ctx, NAME, TITLE, dev, 0.0, phases, None)
    misses: List[str] = []
    plot_fns = []
    fig_title = "%s: %%s; %s, torch %s" % (
        NAME, ctx.machine["gpu_name"] if ctx.is_cuda else ctx.machine["cpu_model"],
        ctx.machine["torch_version"])
    if amp_modes is not None:
        st = _setting(ctx)
        amp_md, amp_payload, amp_misses, amp_plots = _run_amp(
            ctx, st, amp_modes, fp32_gemm, phase, data, vocab, train_data, entropy,
            val_batches_for, fig_title)
        md += amp_md
        payload.update(amp_payload)
        misses += amp_misses
        plot_fns.append(amp_plots)
    if lean_modes is not None:
        ls = _lean_setting(ctx)
        cfg = GPTConfig.preset(ls.finetune.preset, len(vocab))
        res = lean_study(ls, cfg, train_data, val_batches_for(ls.finetune, cfg), dev, lean_modes,
                         fp32_gemm=fp32_gemm, progress=ctx.progress, phase=phase)
        lean_md, lean_payload, lean_misses = lean_report(ls, cfg, res, dev)
        md += ([""] if amp_modes is not None else []) + lean_md
        payload["lean"] = lean_payload
        misses += lean_misses
        title = fig_title % ("lean optimizer state, GPT preset %s fine-tuned %d steps, %d seeds%s"
                             % (ls.finetune.preset, ls.finetune.steps, ls.seeds,
                                " (quick)" if ctx.quick else ""))
        plot_fns.append(lambda: [plot_lean(ctx.out_dir / "lean_convergence.png", res, ls,
                                           title)])
    seconds = phase.elapsed()
    md += ([""] if md[-1] else []) + report_footer(NAME, misses, seconds, phases)
    payload.update(seconds=seconds, phase_seconds=phases, targets_missed=misses)

    def plots():
        return [f for fn in plot_fns for f in fn()]

    return results(ctx, NAME, "\n".join(md), payload, seconds, misses, plots)


def _run_amp(ctx: Context, st: Setting, modes: List[str], fp32_gemm: bool, phase, data, vocab,
             train_data, entropy: float, val_batches_for, fig_title: str) -> tuple:
    """The amp study: its Markdown lines, JSON fields, missed criteria and plot function."""
    dev = ctx.device
    cfg = GPTConfig.preset(st.preset, len(vocab))
    val_batches = val_batches_for(st, cfg)

    runs: Dict[str, Run] = {}
    bar = ctx.progress(total=st.steps * len(modes), desc="convergence")
    with bar:
        for k in modes:
            runs[k] = train(k, st, cfg, train_data, val_batches, dev, fp32_gemm=fp32_gemm,
                            track_updates=k in ("fp32", "bf16_naive"),
                            keep_grads=k == "fp32", bar=bar)
            phase(k)
    ref = runs["fp32"].final_loss(st.final_k)
    ratio = {k: r.final_loss(st.final_k) / ref for k, r in runs.items()}

    # Mode 6 at a lower learning rate when the main setting does not show it worse.
    low: Dict[str, Run] = {}
    low_lr = st.lr * LOW_LR_FACTOR
    if "bf16_naive" in runs and ratio["bf16_naive"] <= 1 + TOLERANCE and not ctx.quick:
        low_modes = [k for k in LOW_LR_MODES if k in runs]
        bar = ctx.progress(total=st.steps * len(low_modes), desc="convergence, lr x%g"
                           % LOW_LR_FACTOR)
        with bar:
            for k in low_modes:
                low[k] = train(k, st, cfg, train_data, val_batches, dev, lr=low_lr,
                               fp32_gemm=fp32_gemm,
                               track_updates=k in ("fp32", "bf16_naive"), bar=bar)
        phase("low_lr")
    low_ratio = ({k: r.final_loss(st.final_k) / low["fp32"].final_loss(st.final_k)
                  for k, r in low.items()} if low else {})

    # Underflow: the reference's FP32 gradients at its last step, and the FP16 scale.
    scale_src = next((k for k in ("mpext_fp16", "amp_fp16") if k in runs), None)
    scale = runs[scale_src].scale[-1] if scale_src else st.init_scale
    uf, gflat = underflow_stats(runs["fp32"].final_grads, scale)
    uf["scale_from"] = scale_src or "init_scale"
    phase("underflow")

    # ---- report
    n_params = count_params(GPT(cfg))
    k = st.final_k
    meaningful = not ctx.quick
    misses = []
    rows = []

    def verdict(key, r):
        if key in MPEXT_MODES:
            ok = abs(r - 1) <= TOLERANCE
            if not ok and meaningful:
                misses.append("%s: final loss %.2f%% from FP32 (criterion ±2%%)"
                              % (SHORT[key], 100 * (r - 1)))
            return ("yes" if ok else "**no**") + ("" if meaningful else " (n/m)")
        if key == "bf16_naive":
            worse = r > 1 + TOLERANCE
            return ("worse: yes" if worse else "worse: no") + ("" if meaningful else " (n/m)")
        return "—"

    for key, r in runs.items():
        fl = r.final_loss(k)
        rows.append([LABEL[key], "%g" % r.lr, "%.4f" % fl, "%.4f" % ratio[key],
                     verdict(key, ratio[key]),
                     str(len(r.skipped)) if key in ("amp_fp16", "mpext_fp16") else "—",
                     "%.1f" % r.seconds, "%.1f" % (1e3 * r.seconds / st.steps)])
    for key, r in low.items():
        rows.append([LABEL[key] + " (low lr)", "%g" % r.lr, "%.4f" % r.final_loss(k),
                     "%.4f" % low_ratio[key], verdict(key, low_ratio[key]) if key != "fp32"
                     else "— (reference)", "—", "%.1f" % r.seconds,
                     "%.1f" % (1e3 * r.seconds / st.steps)])
    if "bf16_naive" in runs:
        naive_worse = (low_ratio if low else ratio)["bf16_naive"] > 1 + TOLERANCE
        if not naive_worse and meaningful:
            misses.append("naive BF16 not measurably worse than FP32, even at lr x%g"
                          % LOW_LR_FACTOR)
    headers = ["mode", "peak lr", "final val loss", "/ FP32", "criterion", "skipped",
               "time s", "ms/step"]

    def frac_tail(xs):
        tail = xs[len(xs) // 2:]
        return sum(tail) / len(tail) if tail else float("nan")

    lost_lines = []
    for tag, src in (("lr %g" % st.lr, runs), ("lr %g" % low_lr, low)):
        if "bf16_naive" in src and "fp32" in src:
            lost_lines.append(
                "- %s: naive BF16 left %.1f%% of its weights unchanged per step (mean over the "
                "second half of training); the FP32 reference's updates were below half a BF16 "
                "ulp of their weight for %.1f%% of the weights."
                % (tag, 100 * frac_tail(src["bf16_naive"].unchanged),
                   100 * frac_tail(src["fp32"].below_half_ulp)))

    md = []
    md += ["Model: GPT preset `%s` (%s), %s params, tied head; corpus: %d generated characters, "
           "vocabulary %d, unigram entropy %.3f nats/char; %d steps of batch %d x %d tokens, "
           "AdamW betas %s, weight decay %g, warm-up %d steps then cosine decay to %g x the "
           "peak lr; same initial weights, batches and schedule for every mode; %d torch "
           "threads. Final loss: mean of the last %d of the validation evaluations (every %d "
           "steps, %d fixed held-out batches), each mode evaluated in its own precision. Loss "
           "scaling (modes 3 and 5): init scale %g, growth interval %d, growth 2, backoff 0.5."
           % (st.preset, ", ".join("%s=%s" % (f, getattr(cfg, f)) for f in
                                   ("n_layer", "n_head", "n_embd", "block_size")),
              "{:,}".format(n_params), len(data), len(vocab), entropy, st.steps,
              st.batch_size, cfg.block_size, st.betas, st.weight_decay, st.warmup,
              st.min_lr_frac, torch.get_num_threads(), k, st.eval_interval, st.eval_batches,
              st.init_scale, st.growth_interval), ""]
    if fp32_gemm:
        md += ["CPU: the linear layers' BF16/FP16 GEMMs computed in FP32 from operands rounded "
               "to BF16/FP16 (gpt.Linear); everything else in the real dtypes.", ""]
    md += [markdown_table(headers, rows), ""]
    md += ["Criterion: modes 4 and 5 within ±%d%% of FP32's final loss; mode 6 measurably worse "
           "(more than %d%% above FP32)%s. Method and criteria: docs/convergence.md."
           % (round(100 * TOLERANCE), round(100 * TOLERANCE),
              "" if meaningful else "; **(n/m): not meaningful with --quick** (a tiny model for "
              "%d steps; no low-lr rerun)" % st.steps)]
    if low:
        md += ["", "Mode 6 was not more than 2%% worse at lr %g, so FP32, mpext BF16 and naive "
               "BF16 also ran at lr %g (rows \"low lr\", ratios to FP32 at that lr)."
               % (st.lr, low_lr)]
    md += [""] + lost_lines
    md += ["", "Gradient underflow (FP32 reference's gradients at its last step, %s non-zero "
           "elements, log2|g| from %.1f to %.1f, median %.1f): cast to FP16 unscaled, "
           "**%.4f%%** become 0 and %.4f%% subnormal; multiplied by the loss scale %g (%s's at "
           "the end), %.4f%% become 0, %.4f%% subnormal, %.4f%% overflow; cast to BF16, %.4f%% "
           "become 0."
           % ("{:,}".format(uf["elements"]), uf["log2_abs_min"], uf["log2_abs_max"],
              uf["log2_abs_median"], 100 * uf["fp16_zero"], 100 * uf["fp16_subnormal"],
              uf["scale"], uf["scale_from"], 100 * uf["fp16_scaled_zero"],
              100 * uf["fp16_scaled_subnormal"], 100 * uf["fp16_scaled_overflow"],
              100 * uf["bf16_zero"]), ""]
    payload = {
        "setting": dataclasses.asdict(st), "model": dataclasses.asdict(cfg),
        "params": n_params, "fp32_gemm_emulation": fp32_gemm,
        "corpus": {"chars": len(data), "vocab": "".join(vocab), "unigram_entropy": entropy},
        "tolerance": TOLERANCE, "criterion_meaningful": meaningful,
        "runs": {key: r.to_json(k) for key, r in runs.items()},
        "ratio_to_fp32": ratio,
        "low_lr": {"lr": low_lr, "runs": {key: r.to_json(k) for key, r in low.items()},
                   "ratio_to_fp32": low_ratio} if low else None,
        "underflow": uf,
        "targets_missed": misses if meaningful else [],
    }

    def plots():
        title = fig_title % ("GPT preset %s, %d steps%s" % (st.preset, st.steps,
                                                           " (quick)" if ctx.quick else ""))
        files = [plot_loss(ctx.out_dir / "convergence_loss.png", runs, low, st, entropy, title)]
        if any(key in runs for key in ("amp_fp16", "mpext_fp16")):
            files.append(plot_scale(ctx.out_dir / "convergence_fp16_scale.png", runs, title))
        files.append(plot_underflow(ctx.out_dir / "grad_underflow.png", gflat, uf, title))
        return files

    return md, payload, misses if meaningful else [], plots


def main(argv=None):
    return run_standalone(run, __doc__, add_args, argv)


if __name__ == "__main__":
    sys.exit(main())
