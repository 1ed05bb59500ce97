"""Convergence: does mixed precision train as well as FP32? gpt.py's small character model
trained on the generated corpus in six modes (FP32, native AMP BF16/FP16, mpext BF16/FP16, naive
BF16 without master weights) from the same weights, on the same batches, with the same schedule;
its validation loss, BF16's lost updates and the FP16 gradient underflow. Method, criteria and
how to read the plots: docs/convergence.md (and benchmarks/README.md, "Convergence").

    python benchmarks/bench_convergence.py [--quick] [--device auto|cpu|cuda] [--modes ...]
"""
import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import (Context, PhaseClock, check, markdown_table, payload_header, report_footer,
                    results, run_standalone, save_figure, section_head)
from gpt import GPT, GPTConfig, count_params, get_batch, load_corpus, split_corpus, \
    unigram_entropy
from training import Trainer

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
         "mpext_bf16": "mpext BF16", "mpext_fp16": "mpext FP16", "bf16_naive": "naive BF16"}
MPEXT_MODES = ("mpext_bf16", "mpext_fp16")

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


def _half_ulp_bf16(p: torch.Tensor) -> torch.Tensor:
    """Half the spacing of BF16 numbers at each element of the FP32 ``p`` (an update smaller
    than this leaves ``p.to(bfloat16)`` unchanged)."""
    b = p.detach().to(BF16).float().abs()
    b = torch.where(b < torch.finfo(BF16).tiny, torch.full_like(b, torch.finfo(BF16).tiny), b)
    exp = torch.floor(torch.log2(b))
    return torch.exp2(exp - 8)  # ulp = 2^(e - 7) for 8 significand bits; half of it


class Run:
    """The record of one mode's training: curves, scales, skips, lost updates, time."""

    def __init__(self, mode: str, lr: float):
        self.mode, self.lr = mode, lr
        self.eval_steps: List[int] = []
        self.eval_loss: List[float] = []
        self.train_loss: List[float] = []
        self.scale: List[float] = []
        self.skipped: List[int] = []
        self.unchanged: List[float] = []  # bf16_naive: fraction of weights a step left alone
        self.below_half_ulp: List[float] = []  # fp32: fraction of updates < half a bf16 ulp
        self.seconds = 0.0
        self.final_grads: Optional[List[torch.Tensor]] = None

    def final_loss(self, k: int) -> float:
        return sum(self.eval_loss[-k:]) / len(self.eval_loss[-k:])

    def to_json(self, k: int) -> dict:
        return {"mode": self.mode, "label": LABEL[self.mode], "lr": self.lr,
                "final_loss": self.final_loss(k), "eval_steps": self.eval_steps,
                "eval_loss": self.eval_loss, "train_loss": self.train_loss,
                "scale": self.scale or None, "skipped_steps": self.skipped,
                "unchanged_fraction": self.unchanged or None,
                "below_half_bf16_ulp_fraction": self.below_half_ulp or None,
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


def train(mode: str, st: Setting, cfg: GPTConfig, train_data, val_batches, device, *,
          lr: Optional[float] = None, fp32_gemm: bool = False, track_updates: bool = False,
          keep_grads: bool = False, bar=None) -> Run:
    """Trains one mode (training.MODES) from the shared initial weights on the shared batch
    sequence."""
    lr = st.lr if lr is None else lr
    run = Run(mode, lr)
    torch.manual_seed(st.seed)
    tr = Trainer.for_mode(mode, GPT(cfg, fp32_gemm=fp32_gemm), device,  # FP32 init for all
                          lr=st.lr, betas=st.betas, weight_decay=st.weight_decay,
                          fused=mode == "amp_bf16",
                          scaler_options=dict(init_scale=st.init_scale,
                                              growth_interval=st.growth_interval))
    params = tr.params
    gen = torch.Generator().manual_seed(st.data_seed)
    t0 = time.perf_counter()
    for step in range(st.steps):
        for group in tr.opt.param_groups:
            group["lr"] = st.lr_at(step, lr)
        x, y = get_batch(train_data, st.batch_size, cfg.block_size, gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with tr.autocast():
            _, loss = tr.model(x, y)
        before = [p.detach().clone() for p in params] if track_updates else None
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
            if mode == "bf16_naive":
                same = sum(int((p.detach() == b).sum()) for p, b in zip(params, before))
                run.unchanged.append(same / n)
            else:  # fp32: updates that a bf16 weight could not have taken
                small = sum(int(((p.detach() - b).abs() < _half_ulp_bf16(b)).sum())
                            for p, b in zip(params, before))
                run.below_half_ulp.append(small / n)
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


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    plt = _plt()
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
    plt = _plt()
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
    plt = _plt()
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
# Options and the run


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--modes", nargs="+", choices=MODE_KEYS, default=None,
                        help="modes to run (default: all six; fp32 is always run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per mode")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--preset", default=None, help="GPT preset (tiny, small, gpu)")
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


def run(ctx: Context) -> dict:
    dev = ctx.device
    st = _setting(ctx)
    modes = list(getattr(ctx.args, "modes", None) or MODE_KEYS)
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    modes = [k for k in MODE_KEYS if k in modes]
    fp32_gemm = dev.type == "cpu" and not getattr(ctx.args, "native_lowp_gemm", False)
    threads_before = torch.get_num_threads()
    if dev.type == "cpu" and not ctx.args.threads:
        torch.set_num_threads(CPU_THREADS)
    try:
        return _run(ctx, st, modes, fp32_gemm)
    finally:
        torch.set_num_threads(threads_before)


def _run(ctx: Context, st: Setting, modes: List[str], fp32_gemm: bool) -> dict:
    dev = ctx.device
    phase = PhaseClock()
    phases = phase.times

    data, vocab = load_corpus()
    train_data, val_data = split_corpus(data)
    cfg = GPTConfig.preset(st.preset, len(vocab))
    entropy = unigram_entropy(train_data)
    vgen = torch.Generator().manual_seed(st.data_seed + 1)
    val_batches = [tuple(t.to(dev) for t in get_batch(val_data, st.batch_size,
                                                       cfg.block_size, vgen))
                   for _ in range(st.eval_batches)]
    phase("corpus")

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
    seconds = phase.elapsed()

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

    md = section_head(ctx, TITLE)
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
    md += report_footer(NAME, misses if meaningful else [], seconds, phases)
    markdown = "\n".join(md)

    payload = {
        **payload_header(ctx, NAME, TITLE, dev, seconds, phases, None),
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
        m = ctx.machine
        title = "%s: GPT preset %s, %d steps%s; %s, torch %s" % (
            NAME, st.preset, st.steps, " (quick)" if ctx.quick else "",
            m["gpu_name"] if ctx.is_cuda else m["cpu_model"], m["torch_version"])
        files = [plot_loss(ctx.out_dir / "convergence_loss.png", runs, low, st, entropy, title)]
        if any(key in runs for key in ("amp_fp16", "mpext_fp16")):
            files.append(plot_scale(ctx.out_dir / "convergence_fp16_scale.png", runs, title))
        files.append(plot_underflow(ctx.out_dir / "grad_underflow.png", gflat, uf, title))
        return files

    return results(ctx, NAME, markdown, payload, seconds, misses if meaningful else [], plots)


def main(argv=None):
    return run_standalone(run, __doc__, add_args, argv)


if __name__ == "__main__":
    sys.exit(main())
