"""Convergence: the amp and lean studies (docs/convergence.md, docs/lean_state.md)."""
import dataclasses
import math
import time
from typing import Dict, List, Optional

import torch

from .common import (Bench, check, figure_title, markdown_table, pyplot, run_standalone,
                     save_figure)
from .gpt import GPT, GPTConfig, count_params, get_batch, load_corpus, split_corpus, \
    unigram_entropy
from . import training
from .training import BF16M, Q8, REM, SR, Trainer

NAME = "bench_convergence"
TITLE = "Convergence: FP32 vs native AMP vs mpext on a small GPT (character model)"
BF16, FP16, FP16_MIN_NORMAL = torch.bfloat16, torch.float16, 2.0 ** -14

MODES = [  # key, label, short label, plot colour and line style
    ("fp32", "1. FP32 params, torch AdamW (reference)", "FP32", "black", "-"),
    ("amp_bf16", "2. native AMP: BF16 autocast, FP32 params, AdamW(fused)", "AMP BF16",
     "tab:blue", "--"),
    ("amp_fp16", "3. native AMP: FP16 autocast + torch GradScaler", "AMP FP16 + GradScaler",
     "tab:cyan", "-."),
    ("mpext_bf16", "4. mpext: BF16 params + MixedPrecisionOptimizer", "mpext BF16", "tab:green",
     "-"),
    ("mpext_fp16", "5. mpext: FP16 params + MixedPrecisionOptimizer (dynamic scale)",
     "mpext FP16", "tab:olive", "--"),
    ("bf16_naive", "6. BF16 params, torch AdamW directly, no masters", "naive BF16", "tab:red",
     ":"),
]
MODE_KEYS = [m[0] for m in MODES]
MPEXT_MODES = ("mpext_bf16", "mpext_fp16")

# The lean study: mpext.optim.AdamW on BF16 params with these options; criteria: lean_state.md
LEAN_BASE = "mpext_optim_bf16"
LEAN_MODES = [  # key, label, short label, colour, style, options, criterion
    ("master", "FP32 master (reference)", "FP32 master", "black", "-", {}, "reference"),
    ("remainder", "remainder: BF16 param + int16 remainder", "remainder", "tab:gray", "--", REM,
     "exact"),
    ("remainder_bf16m", "remainder + BF16 moments (SR)", "remainder + BF16 m,v (SR)",
     "tab:green", "-", dict(REM, **BF16M), "band"),
    ("sr_bf16m", "no master, SR params + BF16 moments (SR)", "no master SR + BF16 m,v (SR)",
     "tab:blue", "-", dict(SR, **BF16M), "band"),
    ("sr", "no master, SR params, FP32 moments", "no master SR", "tab:cyan", "--", SR, "band"),
    ("remainder_q8", "remainder + 8-bit moments", "remainder + 8-bit m,v", "tab:purple", "-.",
     dict(REM, **Q8), "band"),
    ("sr_q8", "no master, SR params + 8-bit moments", "no master SR + 8-bit m,v", "tab:brown",
     ":", dict(SR, **Q8), "band"),
    ("rtn", "no master, params rounded to nearest", "no master, nearest", "tab:red", ":",
     dict(master_weights=False), "cautionary"),
    ("bf16m_rtn", "remainder + BF16 moments rounded to nearest", "BF16 m,v nearest",
     "tab:orange", "-.", dict(REM, moment_rounding="nearest", **BF16M), "cautionary"),
]
# The release study: the same fine-tuning released (param by param), clipped at CLIP, and FP16
# under a scale that overflows now and then; why these settings: docs/gradient_release.md,
# "Convergence". "band:ref": ref's noise band.
CLIP, FP16_BASE = 1.0, dict(base="mpext_optim_fp16", scaler=dict(init_scale=2.0 ** 24,
                                                                 growth_interval=20))


def _released(**kw):
    return dict(release=dict(bucket_bytes=0, **kw))


RELEASE_MODES = [
    ("released", "released (release_grads), no clipping", "released", "tab:green", "--",
     _released(), "exact"),
    ("clip", "step after backward, clip_grad_norm_(%g)" % CLIP, "clip_grad_norm_", "tab:gray",
     "-", dict(max_grad_norm=CLIP), "band"),
    ("clip_exact", "released, clip=\"exact\" (two backward passes)", "released, exact clip",
     "tab:blue", "--", _released(max_grad_norm=CLIP, clip="exact"), "band:clip"),
    ("clip_previous", "released, clip=\"previous\" (the previous step's norm)",
     "released, previous-norm clip", "tab:orange", "-.",
     _released(max_grad_norm=CLIP, clip="previous"), "band:clip"),
    ("fp16", "FP16 params + FP32 master, GradScaler, step after backward", "FP16",
     "tab:olive", "-", FP16_BASE, "reference"),
    ("fp16_released", "FP16 params + FP32 master, GradScaler, released", "FP16 released",
     "tab:red", ":", dict(FP16_BASE, **_released()), "band:fp16"),
]
STUDY_MODES = {"lean": [m[0] for m in LEAN_MODES], "release": [m[0] for m in RELEASE_MODES]}
LEAN_OPTIONS = {m[0]: m[5] for m in LEAN_MODES + RELEASE_MODES}
LEAN_CRITERION = {m[0]: m[6] for m in LEAN_MODES + RELEASE_MODES}
LABEL = {m[0]: m[1] for m in MODES + LEAN_MODES + RELEASE_MODES}
SHORT = {m[0]: m[2] for m in MODES + LEAN_MODES + RELEASE_MODES}
STYLE = {m[0]: (m[3], m[4]) for m in MODES + LEAN_MODES + RELEASE_MODES}

TOLERANCE = 0.02        # modes 4 and 5 within 2% of FP32; mode 6 worse by more than this
LOW_LR_FACTOR = 0.1     # the second setting, when mode 6 is not worse in the main one
LOW_LR_MODES = ("fp32", "mpext_bf16", "bf16_naive")
CPU_THREADS = 1  # unless --threads says otherwise (benchmarks/README.md, "Convergence")


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
    init_scale: float = 2.0 ** 16  # loss scaling, identical for torch's and mpext's scalers
    growth_interval: int = 100

    def lr_at(self, step: int, lr: float) -> float:
        """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr_frac`` x lr."""
        if step < self.warmup:
            return lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


SETTINGS = {
    "quick": Setting(preset="tiny", batch_size=16, steps=100, lr=3e-3, warmup=10,
                     eval_interval=10, eval_batches=4, final_k=3, growth_interval=25),
    "cpu": Setting(preset="small", batch_size=16, steps=300, lr=2e-3, warmup=20,
                   eval_interval=20, growth_interval=50),
    "cuda": Setting(preset="gpu", batch_size=64, steps=1500, lr=1e-3, warmup=100,
                    eval_interval=50, eval_batches=16, growth_interval=200),
}


def _finetune(preset, batch, steps, eval_interval, eval_batches):
    """The lean study's fine-tuning: lr 1e-4 decaying to 1e-5, torch's default betas."""
    return Setting(preset=preset, batch_size=batch, steps=steps, lr=1e-4, warmup=0,
                   betas=(0.9, 0.999), eval_interval=eval_interval, eval_batches=eval_batches,
                   final_k=2 if steps < 100 else 3, data_seed=8642)


# The lean study: (pretraining in FP32, once; fine-tuning from it in every lean mode). Seed s
# fixes the fine-tuning's batch order (data_seed + s) and the stochastic rounding (seed=s).
LEAN_SETTINGS = {
    "quick": (Setting(preset="tiny", batch_size=16, steps=100, lr=3e-3, warmup=10,
                      eval_interval=50, eval_batches=4), _finetune("tiny", 16, 40, 10, 4)),
    "cpu": (Setting(preset="tiny", batch_size=16, steps=300, lr=3e-3, warmup=20,
                    eval_interval=100, eval_batches=8), _finetune("tiny", 16, 300, 20, 8)),
    "cuda": (Setting(preset="gpu", batch_size=64, steps=1000, lr=1e-3, warmup=100,
                     eval_interval=250, eval_batches=16), _finetune("gpu", 64, 500, 25, 16)),
}
LEAN_SEEDS = 3
# --quick is a smoke run whose verdicts are marked not meaningful: two seeds (the fewest that
# give a band) of 40 fine-tuning steps exercise every mode and the bitwise remainder check in
# 40% of three seeds of 60 (CI runs it: 51 s of its 15 minutes went to this benchmark).
QUICK_LEAN_SEEDS = 2


SERIES = ("eval_steps", "eval_loss", "train_loss", "scale", "skipped", "v_decreased", "grad_norm")


class Run:
    """One mode's record: the ``SERIES`` (v_decreased: share of v lowered) and ``final``."""

    def __init__(self, mode: str, lr: float, seed: Optional[int] = None):
        self.mode, self.lr, self.seed, self.seconds, self.final = mode, lr, seed, 0.0, None
        for name in SERIES:
            setattr(self, name, [])

    def final_loss(self, k: int) -> float:
        return sum(self.eval_loss[-k:]) / len(self.eval_loss[-k:])

    def to_json(self, k: int) -> dict:
        return dict({n: getattr(self, n) or None for n in SERIES}, mode=self.mode,
                    label=LABEL[self.mode], final_loss=self.final_loss(k), lr=self.lr,
                    seed=self.seed, seconds=self.seconds)


def val_batches(val_data, st: Setting, cfg: GPTConfig, device) -> list:
    """The held-out batches every evaluation of a setting uses."""
    vgen = torch.Generator().manual_seed(st.data_seed + 1)
    return [tuple(t.to(device) for t in get_batch(val_data, st.batch_size, cfg.block_size, vgen))
            for _ in range(st.eval_batches)]


@torch.no_grad()
def evaluate(tr: Trainer, batches) -> float:
    """Mean loss over the fixed validation batches, in the mode's own precision."""
    tr.model.eval()
    total = 0.0
    for x, y in batches:
        with tr.autocast():
            total += float(tr.model(x, y)[1])
    tr.model.train()
    return total / len(batches)


def train(mode: str, st: Setting, cfg: GPTConfig, train_data, val_batches, device, *,
          lr: Optional[float] = None, fp32_gemm: bool = False, track_moments: bool = False,
          keep_grads: bool = False, keep_final: bool = False,
          init: Optional[Dict[str, torch.Tensor]] = None, seed: Optional[int] = None,
          base: Optional[str] = None, options: Optional[dict] = None, on_step=None,
          bar=None) -> Run:
    """The studies' one training loop (and measure_q8_codes'); README, "Convergence"."""
    lr = st.lr if lr is None else lr
    run = Run(mode, lr, seed)
    if base is None:
        base, options = (LEAN_BASE, LEAN_OPTIONS[mode]) if mode in LEAN_OPTIONS else (mode, {})
    options = dict(options or {})
    base = options.pop("base", base)
    if seed is not None and training.MODES[base].kind == "mpext-optim":
        options["seed"] = seed
    torch.manual_seed(st.seed)
    model = GPT(cfg, fp32_gemm=fp32_gemm)  # FP32 init for all
    if init is not None:
        model.load_state_dict(init)
    tr = Trainer.for_mode(base, model, device, lr=st.lr, betas=st.betas,
                          weight_decay=st.weight_decay, fused=mode == "amp_bf16",
                          scaler_options=dict(init_scale=st.init_scale,
                                              growth_interval=st.growth_interval), **options)
    params = tr.params
    gen = torch.Generator().manual_seed(st.data_seed + (seed or 0))
    if init is not None:
        run.eval_steps.append(0)
        run.eval_loss.append(evaluate(tr, val_batches))
    t0 = time.perf_counter()
    for step in range(st.steps):
        tr.set_lr(st.lr_at(step, lr))
        x, y = (t.to(device, non_blocking=True) for t in get_batch(
            train_data, st.batch_size, cfg.block_size, gen))
        if track_moments:  # not with 8-bit moments (only the small params keep a plain v)
            v_before = [(p, tr.opt.state[p]["exp_avg_sq"].clone()) for p in params
                        if "exp_avg_sq" in tr.opt.state.get(p, {})]
            v_before = v_before if len(v_before) == len(params) else []
        scale = tr.get_scale()  # the scale this step's backward uses
        last_grads = keep_grads and step == st.steps - 1
        loss, applied = tr.train_step(x, y, zero_grad=not last_grads)
        if last_grads:  # kept after the step: the fp32 reference's step leaves them as they are
            run.final = {"grads": [p.grad.detach().clone() for p in params]}
            tr.opt.zero_grad(set_to_none=True)
        if scale is not None:
            run.scale.append(scale)
            # torch's GradScaler says nothing of a skip but lowers its scale
            if (not bool(applied)) if applied is not None else tr.get_scale() < scale:
                run.skipped.append(step)
        if track_moments and v_before:
            lowered = [tr.opt.state[p]["exp_avg_sq"] < v for p, v in v_before]
            run.v_decreased.append(sum(int(x.sum()) for x in lowered)
                                   / sum(x.numel() for x in lowered))
        run.train_loss.append(float(loss.detach()))
        if tr.grad_norm is not None:
            run.grad_norm.append(float(tr.grad_norm))
        if (step + 1) % st.eval_interval == 0 or step == st.steps - 1:
            run.eval_steps.append(step + 1)
            run.eval_loss.append(evaluate(tr, val_batches))
            check(math.isfinite(run.eval_loss[-1]), "%s: validation loss became %r at step %d"
                  % (mode, run.eval_loss[-1], step + 1))
        if on_step is not None:
            on_step(step, tr)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str("%s loss %.3f" % (SHORT.get(mode, mode), run.train_loss[-1]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - t0
    if keep_final:  # FP32 values: the params, or the masters mpext's optimizer keeps
        fp32 = [p.detach().clone() for p in params] if params[0].dtype is torch.float32 else \
            [tr.opt.master_param(p) for p in params] if tr.kind == "mpext-optim" and \
            options.get("master_weights", True) else None
        run.final = {"params": [p.detach().clone() for p in params], "fp32": fp32,
                     "state": {k: v.detach().float().clone()
                               for k, v in tr.model.state_dict().items()}}
    return run


# ---- the amp study

def underflow_stats(grads: List[torch.Tensor], scale: float):
    """Fractions of the non-zero FP32 gradients lost to FP16/BF16, unscaled and scaled."""
    g = torch.cat([t.detach().float().flatten() for t in grads]).cpu()
    g = g[g != 0]
    h, hs = g.to(FP16), (g * scale).to(FP16)

    def frac(mask):
        return int(mask.sum()) / g.numel()

    return {"elements": g.numel(), "scale": scale, "fp16_zero": frac(h == 0),
            "fp16_subnormal": frac((h != 0) & (h.abs() < FP16_MIN_NORMAL)),
            "fp16_scaled_zero": frac(hs == 0),
            "fp16_scaled_subnormal": frac((hs != 0) & (hs.abs() < FP16_MIN_NORMAL)),
            "fp16_scaled_overflow": frac(torch.isinf(hs)), "bf16_zero": frac(g.to(BF16) == 0),
            **{"log2_abs_" + k: float(getattr(g.abs(), k)().log2())
               for k in ("min", "median", "max")}}


def _config_text(cfg: GPTConfig) -> str:
    return ", ".join("%s=%s" % (f, getattr(cfg, f))
                     for f in ("n_layer", "n_head", "n_embd", "block_size"))


def amp_study(ctx, b: Bench, st: Setting, modes: List[str]):
    """The amp study: its Markdown lines, JSON fields and plot function."""
    (data, vocab), fp32_gemm = load_corpus(), training.fp32_gemm(ctx)
    train_data, val_data = split_corpus(data)
    entropy, cfg = unigram_entropy(train_data), GPTConfig.preset(st.preset, len(vocab))
    val = val_batches(val_data, st, cfg, ctx.device)

    def train_all(keys, desc, lr=None):
        out = {}
        with ctx.progress(total=st.steps * len(keys), desc=desc) as bar:
            for k in keys:
                out[k] = train(k, st, cfg, train_data, val, ctx.device, lr=lr, bar=bar,
                               fp32_gemm=fp32_gemm, keep_grads=k == "fp32" and lr is None)
                b.phase(k if lr is None else "low_lr")
        return out

    k = st.final_k
    runs = train_all(modes, "convergence")
    ratio = {m: r.final_loss(k) / runs["fp32"].final_loss(k) for m, r in runs.items()}
    # mode 6 at a lower learning rate when the main setting does not show it worse
    low, low_lr = {}, st.lr * LOW_LR_FACTOR
    if "bf16_naive" in runs and ratio["bf16_naive"] <= 1 + TOLERANCE and not ctx.quick:
        low = train_all([m for m in LOW_LR_MODES if m in runs],
                        "convergence, lr x%g" % LOW_LR_FACTOR, lr=low_lr)
    low_ratio = {m: r.final_loss(k) / low["fp32"].final_loss(k) for m, r in low.items()}
    # underflow: the reference's FP32 gradients at its last step, and the FP16 scale
    scale_src = next((m for m in ("mpext_fp16", "amp_fp16") if m in runs), None)
    uf = underflow_stats(runs["fp32"].final["grads"],
                                runs[scale_src].scale[-1] if scale_src else st.init_scale)
    uf["scale_from"] = scale_src or "init_scale"
    b.phase("underflow")
    meaningful = not ctx.quick
    nm = "" if meaningful else " (n/m)"

    def verdict(key, r):
        if key in MPEXT_MODES:
            ok = abs(r - 1) <= TOLERANCE
            if meaningful:
                b.target(ok, "%s: final loss %.2f%% from FP32 (criterion ±2%%)"
                         % (SHORT[key], 100 * (r - 1)))
            return ("yes" if ok else "**no**") + nm
        return ("worse: yes" if r > 1 + TOLERANCE else "worse: no") + nm \
            if key == "bf16_naive" else "—"

    rows = [[LABEL[m] + tag, "%g" % r.lr, "%.4f" % r.final_loss(k), "%.4f" % rat[m],
             "— (reference)" if tag and m == "fp32" else verdict(m, rat[m]),
             str(len(r.skipped)) if m in ("amp_fp16", "mpext_fp16") and not tag else "—",
             "%.1f" % r.seconds, "%.1f" % (1e3 * r.seconds / st.steps)]
            for src, rat, tag in ((runs, ratio, ""), (low, low_ratio, " (low lr)"))
            for m, r in src.items()]
    if "bf16_naive" in runs and meaningful:
        b.target((low_ratio or ratio)["bf16_naive"] > 1 + TOLERANCE,
                 "naive BF16 not measurably worse than FP32, even at lr x%g" % LOW_LR_FACTOR)
    md = ["Model: GPT preset `%s` (%s), %s params, tied head; corpus: %d generated characters, "
          "vocabulary %d, unigram entropy %.3f nats/char; %d steps of batch %d x %d tokens, "
          "AdamW betas %s, weight decay %g, warm-up %d steps then cosine decay to %g x the peak "
          "lr; %d torch threads. Final loss: mean of the last %d validation evaluations (every "
          "%d steps, %d held-out batches). Loss scaling (modes 3, 5): init %g, growth interval "
          "%d.%s" % (st.preset, _config_text(cfg), "{:,}".format(count_params(GPT(cfg))),
                     len(data), len(vocab), entropy, st.steps, st.batch_size, cfg.block_size,
                     st.betas, st.weight_decay, st.warmup, st.min_lr_frac,
                     torch.get_num_threads(), k, st.eval_interval, st.eval_batches,
                     st.init_scale, st.growth_interval,
                     " CPU: BF16/FP16 GEMMs in FP32 from rounded operands (gpt.Linear)."
                     if fp32_gemm else ""), "",
          markdown_table(["mode", "peak lr", "final val loss", "/ FP32", "criterion", "skipped",
                          "time s", "ms/step"], rows), "",
          "Criterion: modes 4 and 5 within ±%d%% of FP32; mode 6 more than %d%% above%s "
          "(docs/convergence.md)." % (round(100 * TOLERANCE), round(100 * TOLERANCE),
                                      "" if meaningful else "; **n/m: not meaningful with "
                                      "--quick**")]
    if low:
        md += ["", "Mode 6 was within 2%% at lr %g, so FP32, mpext BF16 and naive BF16 also "
               "ran at lr %g (rows \"low lr\")." % (st.lr, low_lr)]
    md += ["", "Gradient underflow (FP32's gradients at its last step, %s non-zero elements, "
           "log2|g| %.1f to %.1f, median %.1f): to FP16 unscaled **%.4f%%** become 0, %.4f%% "
           "subnormal; times the loss scale %g (%s's at the end) %.4f%% 0, %.4f%% subnormal, "
           "%.4f%% overflow; to BF16 %.4f%% become 0."
           % ("{:,}".format(uf["elements"]), uf["log2_abs_min"], uf["log2_abs_max"],
              uf["log2_abs_median"], 100 * uf["fp16_zero"], 100 * uf["fp16_subnormal"],
              uf["scale"], uf["scale_from"], 100 * uf["fp16_scaled_zero"],
              100 * uf["fp16_scaled_subnormal"], 100 * uf["fp16_scaled_overflow"],
              100 * uf["bf16_zero"]), ""]
    payload = {
        "setting": dataclasses.asdict(st), "model": dataclasses.asdict(cfg),
        "params": count_params(GPT(cfg)), "fp32_gemm_emulation": fp32_gemm,
        "corpus": {"chars": len(data), "vocab": "".join(vocab), "unigram_entropy": entropy},
        "tolerance": TOLERANCE, "criterion_meaningful": meaningful,
        "runs": {m: r.to_json(k) for m, r in runs.items()}, "ratio_to_fp32": ratio,
        "low_lr": {"lr": low_lr, "runs": {m: r.to_json(k) for m, r in low.items()},
                   "ratio_to_fp32": low_ratio} if low else None,
        "underflow": uf}

    def plots():
        title = figure_title(ctx, "%s: GPT preset %s, %d steps" % (NAME, st.preset, st.steps))
        files = [plot_loss(ctx.out_dir / "convergence_loss.png", runs, low, st, entropy, title)]
        if any(m in runs for m in ("amp_fp16", "mpext_fp16")):
            files.append(plot_scale(ctx.out_dir / "convergence_fp16_scale.png", runs, title))
        return files

    return md, payload, plots


# ---- plots

def _label_axes(ax, title: str, xlabel: str, ylabel: str = "", fontsize: int = 7, **legend):
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=fontsize, **legend)


def _line(ax, key, xs, ys, **kw):
    c, ls = STYLE[key]
    ax.plot(xs, ys, color=c, linestyle=ls, **kw)


def plot_loss(path, runs: Dict[str, Run], low: Dict[str, Run], st: Setting, entropy: float,
              title: str):
    fig, axes = pyplot().subplots(1, 2, figsize=(12.5, 4.4))
    faint = dict(alpha=0.5, linewidth=2.5)
    lowtag = ", lr x%g" % LOW_LR_FACTOR
    for src, extra, tag in ((runs, {}, ""), (low, faint, lowtag)):
        for k, r in src.items():
            _line(axes[0], k, r.eval_steps, r.eval_loss, label=SHORT[k] + tag, **extra)
    axes[0].axhline(entropy, color="grey", linewidth=1, linestyle=":",
                    label="unigram entropy %.2f" % entropy)
    _label_axes(axes[0], "validation loss (held-out 10%)", "step", "cross-entropy (nats/char)")
    ax = axes[1]
    if "fp32" in runs:
        for src, extra, tag in ((runs, {}, ""), (low, faint, " / FP32" + lowtag)):
            for k, r in src.items():
                if src is runs or (k != "fp32" and "fp32" in low):
                    _line(ax, k, r.eval_steps, [a / b for a, b in zip(
                        r.eval_loss, src["fp32"].eval_loss)], label=SHORT[k] + tag, **extra)
        ax.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="green", alpha=0.1, label="±2%")
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        ax.set_ylim(min(0.97, min(ys) - 0.005), max(1.05, max(ys) + 0.01))
        ax.set_xlim(left=st.steps * 0.2)
    _label_axes(ax, "validation loss / FP32's (same lr)", "step")
    return save_figure(fig, path, title)


def plot_scale(path, runs: Dict[str, Run], title: str):
    fig, ax = pyplot().subplots(figsize=(8.5, 4.4))
    for k in ("amp_fp16", "mpext_fp16"):
        r = runs.get(k)
        if r is not None:
            ax.step(range(len(r.scale)), r.scale, where="post", color=STYLE[k][0],
                    linestyle=STYLE[k][1], label="%s (%d skipped)" % (SHORT[k], len(r.skipped)))
            ax.scatter(r.skipped, [r.scale[i] for i in r.skipped], marker="x", color="tab:red",
                       zorder=3, s=30)
    ax.scatter([], [], marker="x", color="tab:red", label="skipped step (inf/NaN gradient)")
    ax.set_yscale("log", base=2)
    _label_axes(ax, "FP16 loss scale per step (the scale the step's backward used)", "step",
                "loss scale", fontsize=8)
    return save_figure(fig, path, title)


# ---- the lean study

INT_OF = {2: torch.int16, 4: torch.int32}  # the integer view of a float's bits


def same_training(ref: Run, other: Run) -> Optional[str]:
    """None if ``other`` trained bit for bit as ``ref`` (losses, params, FP32), else what."""
    for name, x, y in (("training losses", ref.train_loss, other.train_loss),
                       ("validation losses", ref.eval_loss, other.eval_loss)):
        if x != y:
            return "the %s differ from #%d on" % (name, next(
                (i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
    for name in ("params", "fp32"):  # the elements whose bits differ (all of them: a mismatch)
        a, c = ref.final[name], other.final[name]
        n = max(sum(t.numel() for t in a or []), sum(t.numel() for t in c or []), 1) \
            if a is None or c is None or len(a) != len(c) else sum(
                max(x.numel(), y.numel(), 1) if x.dtype != y.dtype or x.shape != y.shape else
                int((x.view(INT_OF[x.element_size()]) != y.view(INT_OF[y.element_size()])).sum())
                for x, y in zip(a, c))
        if n:
            return "the final %s differ in %d elements" % (name, n)
    return None


def _seed_mean(runs: List[Run], attr: str) -> float:
    """The mean over the seeds of a per-step series' mean over its second half."""
    tails = [xs[len(xs) // 2:] for xs in (getattr(r, attr) for r in runs) if xs]
    vals = [sum(t) / len(t) for t in tails if t]
    return sum(vals) / len(vals) if vals else float("nan")


def _notes(rs: List[Run], steps: int) -> str:
    """A lean or release mode's telling count: the steps skipped, or clipped (the norm above
    CLIP), or the share of v lowered per step; per run, the mean over the seeds."""
    if rs[0].scale:
        return "%.1f skipped" % (sum(len(r.skipped) for r in rs) / len(rs))
    if rs[0].grad_norm:
        return "%.0f%% clipped" % (100 * sum(sum(n > CLIP for n in r.grad_norm) for r in rs)
                                   / (steps * len(rs)))
    return "%.1f%% v lowered" % (100 * _seed_mean(rs, "v_decreased")) if rs[0].v_decreased \
        else "—"


HEADING = {"lean": "Lean optimizer state: fine-tuning a pretrained checkpoint",
           "release": "Gradient release: the same fine-tuning, stepped inside backward"}


def _criterion(key: str):
    """A lean or release mode's criterion and the mode whose noise band judges it."""
    crit, _, ref = LEAN_CRITERION[key].partition(":")
    return crit, ref or "master"


def lean_study(ctx, b: Bench, pre: Setting, ft: Setting, seeds: int, modes: List[str], name: str):
    """Study ``name`` ("lean" or "release"): its Markdown, JSON and plots. Criteria and noise
    bands: docs/lean_state.md; "exact" is checked only where a seed-0 rerun is bitwise equal."""
    named_refs = {_criterion(k)[1] for k in modes if k in LEAN_CRITERION}  # run them too
    modes = ["master"] + [k for k in STUDY_MODES[name] if k != "master" and (k in modes or
                                                                            k in named_refs)]
    crit_ref = {k: _criterion(k) for k in modes}
    refs = {r for _, r in crit_ref.values()}
    (data, vocab), fp32_gemm = load_corpus(), training.fp32_gemm(ctx)
    (train_data, val_data), cfg = split_corpus(data), GPTConfig.preset(ft.preset, len(vocab))
    val, kw = val_batches(val_data, ft, cfg, ctx.device), dict(fp32_gemm=fp32_gemm)
    with ctx.progress(total=pre.steps + ft.steps * (len(modes) * seeds + 1), desc=name) as bar:
        kw["bar"] = bar
        base = train("fp32", pre, cfg, train_data, val, ctx.device, keep_final=True, **kw)
        b.phase(name + "_pretrain")
        kw["init"] = base.final["state"]
        runs = {k: [train(k, ft, cfg, train_data, val, ctx.device, seed=s,
                          track_moments=True,
                          keep_final=crit_ref[k][0] == "exact" or k in refs, **kw)
                    for s in range(seeds)] for k in modes}
        repeat = train("master", ft, cfg, train_data, val, ctx.device, seed=0,
                       keep_final=True, **kw)
    deterministic = same_training(runs["master"][0], repeat) is None
    exact = [k for k in modes if crit_ref[k][0] == "exact"]
    if deterministic:
        for k in exact:
            for ref, other in zip(runs[crit_ref[k][1]], runs[k]):
                diff = same_training(ref, other)
                check(diff is None, "%s vs %s, seed %s: %s" % (k, crit_ref[k][1], other.seed,
                                                               diff))
    b.phase(name + "_finetune")
    finals = {k: [r.final_loss(ft.final_k) for r in rs] for k, rs in runs.items()}
    bands = {r: (sum(finals[r]) / seeds, max(finals[r]) - min(finals[r])) for r in refs}
    center, half = bands["master"]
    verdicts, rows = {}, []
    for key, xs in finals.items():
        (crit, ref_key), (c, h) = crit_ref[key], bands[crit_ref[key][1]]
        mean = sum(xs) / len(xs)
        d = mean - c
        m = verdicts[key] = {"finals": xs, "mean": mean, "delta": d, "inside": abs(d) <= h,
                             "criterion": crit, "reference": ref_key,
                             "met": {"reference": True, "exact": xs == finals[ref_key],
                                     "band": abs(d) <= h, "cautionary": d > h}[crit]}
        of = "" if ref_key == "master" else " of %s" % SHORT[ref_key]
        if crit == "reference":
            verdict = "— (reference)"
        elif crit == "exact":
            verdict = ("bitwise equal%s: **yes**" % of if deterministic else
                       "bitwise: not checked (training not deterministic here)")
        elif crit == "band":
            verdict = "inside%s: " % of + ("yes" if m["met"] else "**no**")
            b.target(m["met"], "%s: mean final loss %+.4f from %s's, outside its noise band "
                     "(±%.4f)" % (SHORT[key], m["delta"], SHORT[ref_key], h))
        else:
            verdict = "worse than the band: " + ("yes" if m["met"] else "no")
            if key == "rtn":
                b.target(m["met"], "master-free round-to-nearest not worse than the noise band "
                         "(%+.4f, band ±%.4f): this setting does not show its stall"
                         % (m["delta"], h))
        rows.append([LABEL[key], "%.4f" % mean, " / ".join("%.4f" % x for x in xs),
                     "%+.4f" % d + ("" if ref_key == "master" else " (vs %s)" % SHORT[ref_key]),
                     verdict, _notes(runs[key], ft.steps),
                     "%.1f" % (sum(r.seconds for r in runs[key]) / seeds)])
    md = ["### " + HEADING[name], "",
          "GPT preset `%s` (%s) pretrained in FP32 for %d steps (peak lr %g, betas %s), "
          "validation loss %.4f in BF16; fine-tuned from it for %d steps of batch %d, BF16 "
          "params (FP16 where the mode says), `mpext.optim.AdamW` in each mode, lr %g "
          "decaying to %g, betas %s, weight decay %g, %d seeds (batch order and rounding seed). "
          "Final loss: mean of the last %d evaluations (every %d steps, %d held-out batches). "
          "Noise band (FP32 master's mean ± its seed-to-seed range): %.4f ± %.4f."
          % (ft.preset, _config_text(cfg), pre.steps, pre.lr, pre.betas,
             runs["master"][0].eval_loss[0], ft.steps, ft.batch_size, ft.lr,
             ft.lr * ft.min_lr_frac, ft.betas, ft.weight_decay, seeds, ft.final_k,
             ft.eval_interval, ft.eval_batches, center, half), "",
          markdown_table(["mode", "final val loss (mean)", "per seed", "Δ vs FP32 master",
                          "criterion", "per step", "time s / run"],
                         rows), ""]
    if exact:
        md += [("Every run of %s equals its seed's reference run bit for bit (every loss, the "
                "final params and masters); asserted." if deterministic else "%s **not "
                "compared**: two FP32-master runs of one seed differed on this device (not "
                "deterministic).") % ", ".join(SHORT[k] for k in exact), ""]
    if "bf16m_rtn" in runs:
        v_low = [100 * _seed_mean(runs[k], "v_decreased") for k in ("bf16m_rtn", "master")]
        md += ["- BF16 moments rounded to nearest lowered v in %.2f%% of its elements per step "
               "(FP32 moments: %.1f%%): 0.999 v rounds back to v, so v never decays; here that "
               "%s." % (*v_low, "stays inside the band" if verdicts["bf16m_rtn"]["inside"]
                        else "is outside the band"), ""]
    payload = {"setting": {"pretrain": dataclasses.asdict(pre),
                           "finetune": dataclasses.asdict(ft), "seeds": seeds},
               "pretrain_run": base.to_json(pre.final_k), "deterministic": deterministic,
               "bitwise_checked": exact if deterministic else [],
               "band": {"center": center, "half_width": half}, "verdict": verdicts,
               "runs": {k: [r.to_json(ft.final_k) for r in rs] for k, rs in runs.items()}}
    title = figure_title(ctx, "%s: %s, GPT preset %s fine-tuned %d steps, %d seeds" % (
        NAME, HEADING[name].split(":")[0].lower(), ft.preset, ft.steps, seeds))
    return md, {name: payload}, lambda: [
        plot_lean(ctx.out_dir / ("%s_convergence.png" % name), runs, seeds, title)]


def plot_lean(path, runs: Dict[str, List[Run]], seeds: int, title: str):
    """The lean modes' mean validation loss with the noise band, and Δ (symlog)."""
    steps = runs["master"][0].eval_steps

    def mean_curve(rs):
        return [sum(v) / len(v) for v in zip(*(r.eval_loss for r in rs))]

    center = mean_curve(runs["master"])
    half = [max(v) - min(v) for v in zip(*(r.eval_loss for r in runs["master"]))]
    fig, (ax, ax_d) = pyplot().subplots(1, 2, figsize=(13, 4.6))
    ax.fill_between(steps, [c - h for c, h in zip(center, half)],
                    [c + h for c, h in zip(center, half)], color="grey", alpha=0.25,
                    label="noise band: FP32 master mean ± seed range")
    lin = max(max(half), 1e-6)
    ax_d.fill_between(steps, [-h for h in half], half, color="grey", alpha=0.25,
                      label="noise band")
    for k, rs in runs.items():
        _line(ax, k, steps, mean_curve(rs), label=SHORT[k])
        _line(ax_d, k, steps, [a - c for a, c in zip(mean_curve(rs), center)], label=SHORT[k])
    _label_axes(ax, "validation loss, mean of %d seeds (step 0: the pretrained model)" % seeds,
                "fine-tuning step", "cross-entropy (nats/char)", loc="lower left")
    ax_d.set_yscale("symlog", linthresh=2 * lin)
    _label_axes(ax_d, "difference from the FP32 master's mean (symlog; linear within ±%.1g)"
                % (2 * lin), "fine-tuning step", "Δ loss")
    return save_figure(fig, path, title)


# ---- options and the run

def add_args(parser):
    a = parser.add_argument
    a("--study", choices=("all", "amp", "lean", "release"), default="all",
      help="amp: FP32 vs native AMP vs mpext; lean: mpext.optim's lean optimizer states over "
           "several seeds; release: gradient release, its clipping and FP16 (default: all)")
    a("--modes", nargs="+", choices=MODE_KEYS + list(LEAN_OPTIONS), default=None,
      help="modes to run (default: all; fp32 and master, the references, always run, and a "
           "named mode's own reference; a study none of whose modes is named is skipped)")
    a("--steps", type=int, default=None, help="training steps per mode (amp)")
    a("--lr", type=float, default=None, help="peak learning rate (amp)")
    a("--seeds", type=int, default=None, help="seeds per lean mode (default 3, 2 with --quick; at least 2)")
    return training.add_gemm_arg(parser)


def _selected(study: str, name: str, keys: List[str], ref: str, named) -> Optional[List[str]]:
    """A study's modes (its reference first), or None when it does not run."""
    keys = [k for k in keys if named is None or k in named]
    if study not in ("all", name) or not (keys or study == name):
        return None
    return [ref] + [k for k in keys if k != ref]


def run(ctx) -> dict:
    a = ctx.args
    kind = "quick" if ctx.quick else ("cuda" if ctx.is_cuda else "cpu")
    study, named = getattr(a, "study", None) or "all", getattr(a, "modes", None)
    amp = _selected(study, "amp", MODE_KEYS, "fp32", named)
    lean, release = (_selected(study, n, STUDY_MODES[n], "master", named)
                     for n in ("lean", "release"))
    st, (pre, ft) = SETTINGS[kind], LEAN_SETTINGS[kind]
    steps, lr, seeds = (getattr(a, k, None) for k in ("steps", "lr", "seeds"))
    if steps and steps < 2 * st.eval_interval:
        raise SystemExit("--steps must be at least %d" % (2 * st.eval_interval))
    if lr is not None and not lr > 0:
        raise SystemExit("--lr must be positive")
    if seeds is not None and seeds < 2:
        raise SystemExit("--seeds must be at least 2 (the noise band is their spread)")
    st, seeds = dataclasses.replace(st, steps=steps or st.steps, lr=lr or st.lr), \
        seeds or (QUICK_LEAN_SEEDS if ctx.quick else LEAN_SEEDS)
    threads_before = torch.get_num_threads()
    if not ctx.is_cuda and not a.threads:
        torch.set_num_threads(CPU_THREADS)
    try:
        b, out = Bench(ctx, NAME, TITLE), []
        if amp:
            out.append(amp_study(ctx, b, st, amp))
        for name, modes in (("lean", lean), ("release", release)):
            if modes:
                out.append(lean_study(ctx, b, pre, ft, seeds, modes, name))
        return b.finish([x for o in out for x in o[0]], {k: v for o in out for k, v in
                                                         o[1].items()},
                        lambda: [f for o in out for f in o[2]()])
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    run_standalone(run, __doc__, add_args)
