"""Training step end to end, twelve modes: time and memory (benchmarks/README.md)."""
import dataclasses
import itertools

import torch

from mpext import memory
from .common import (MiB, Bench, check, figure_title, fmt_ms, free_memory, markdown_table,
                     peak_memory_many, pyplot, ratio, run_standalone, save_figure)
from .gpt import GPT, GPTConfig, count_params, get_batch, load_corpus
from . import training

NAME = "bench_train"
TITLE = "Training step end to end: FP32 vs native AMP vs mpext on a GPT model"
LR, WEIGHT_DECAY, INIT_SCALE = 1e-3, 0.01, 2.0 ** 10
AGREEMENT = 0.10     # measured persistent memory within 10% of mpext.memory's estimate
POOL = 16            # batches in the pool every mode cycles through
_OPT = "mpext BF16 params, mpext.optim.AdamW"
MODES = [  # key (training.MODES), label, short label
    ("fp32", "FP32, AdamW(fused)", "FP32"),
    ("amp_bf16", "native AMP BF16 autocast, AdamW(fused)", "AMP BF16"),
    ("amp_fp16", "native AMP FP16 autocast + GradScaler, AdamW(fused)", "AMP FP16"),
    ("mpext_bf16", "mpext BF16 params, MixedPrecisionOptimizer(AdamW)", "mpext BF16"),
    ("mpext_fp16", "mpext FP16 params, MixedPrecisionOptimizer(AdamW), dynamic scale",
     "mpext FP16"),
    ("mpext_optim_fp16", "mpext FP16 params, mpext.optim.AdamW + mpext.GradScaler",
     "mpext.optim FP16"),
    ("mpext_bf16_remainder", _OPT + "(param_remainders=True)", "remainder"),
    ("mpext_bf16_remainder_bf16m", _OPT + ", remainders + BF16 moments", "rem. + bf16 m"),
    ("mpext_bf16_sr", _OPT + ", no master (stochastic rounding) + BF16 moments", "SR + bf16 m"),
    ("mpext_bf16_remainder_8bit", _OPT + ", remainders + 8-bit moments", "rem. + 8-bit m"),
    ("mpext_bf16_sr_8bit", _OPT + ", no master (stochastic rounding) + 8-bit moments",
     "SR + 8-bit m"),
    ("mpext_bf16_remainder_bf16m_ema", _OPT + ", remainders + BF16 moments + FP32 EMA of the "
     "masters (ema_decay=0.999)", "rem. + bf16 m + EMA"),
]
LABEL = {k: lab for k, lab, _ in MODES}
SHORT = {k: s for k, _, s in MODES}
FP16_MODES = ("mpext_fp16", "mpext_optim_fp16")
MAIN_PARTS = ("weights", "gradients", "master_weights", "optimizer_states", "ema")
# (label, gpt.py preset, batch size, GPTConfig overrides) per run kind (README, "Sizes")
_GPT2_BODY = ("gpt2-body", "gpu", 16, dict(n_layer=12, n_head=12, n_embd=768))
_WIDE = ("wide", "small", 1, dict(n_layer=4, n_head=8, n_embd=512, block_size=32))
SIZES = {"cpu": [("tiny", "tiny", 8, {}), ("small", "small", 8, {}), _WIDE],
         "cpu_quick": [("tiny", "tiny", 4, {})],
         "cuda": [("small", "small", 64, {}), ("gpu", "gpu", 64, {}), _GPT2_BODY],
         "cuda_quick": [("gpu", "gpu", 32, {})]}


class Run:
    """One mode's ``training.Trainer`` on gpt.py's model, cycling through the batch pool."""

    def __init__(self, key, cfg, batches, device, fp32_gemm):
        torch.manual_seed(0)
        self.tr = training.Trainer.for_mode(key, GPT(cfg, fp32_gemm=fp32_gemm), device, lr=LR,
                                            weight_decay=WEIGHT_DECAY, fused=True,
                                            scaler_options=dict(init_scale=INIT_SCALE))
        self.batches = itertools.cycle(batches)
        self.losses = []  # device tensors: read once at the end

    def step(self, zero_grad=True):
        self.losses.append(self.tr.train_step(*next(self.batches), zero_grad)[0].detach())

    def measure(self):
        """Persistent bytes after one more step, before zero_grad (grads alive)."""
        self.step(zero_grad=False)
        got = memory.measure(self.tr.params, self.tr.opt, self.tr.scaler)
        self.tr.opt.zero_grad(set_to_none=True)
        return got


def _size_metrics(ctx, size, vocab, data, fp32_gemm):
    label, preset, batch, overrides = size
    dev = ctx.device
    cfg = GPTConfig.preset(preset, len(vocab), **overrides)
    gen = torch.Generator().manual_seed(1234)
    batches = [tuple(t.to(dev) for t in get_batch(data, batch, cfg.block_size, gen))
               for _ in range(POOL)]
    trainers = {k: Run(k, cfg, batches, dev, fp32_gemm) for k, _, _ in MODES}
    n = count_params(trainers["fp32"].tr.model)
    times = ctx.time_fns({k: tr.step for k, tr in trainers.items()},
                         desc="%s (%.2fM params, batch %d)" % (label, n / 1e6, batch))
    persistent = {k: tr.measure() for k, tr in trainers.items()}
    # peak during a step: grads do not exist between steps (zero_grad(set_to_none=True))
    extra = peak_memory_many({k: tr.step for k, tr in trainers.items()}, dev)
    out = {"preset": label, "batch": batch, "params": n, "config": dataclasses.asdict(cfg),
           "modes": {}}
    for k, tr in trainers.items():
        got, t = persistent[k], times[k]
        mode = training.MODES[k]
        est = memory.estimate([p.numel() for p in tr.tr.params], "adamw", mode.memory_mode,
                              ema="ema_decay" in mode.options, batch=batch, seq=cfg.block_size,
                              hidden=cfg.n_embd, layers=cfg.n_layer, heads=cfg.n_head,
                              vocab=cfg.vocab_size, dropout=False)
        total = sum(got.values())
        m = out["modes"][k] = {
            "label": LABEL[k], "timing": t.to_json(), "persistent_bytes": got,
            "persistent_bytes_per_param": {c: v / n for c, v in got.items()},
            "persistent_per_param_total": total / n,
            "predicted": est.to_dict(), "predicted_per_param": est.persistent / n,
            "agreement": total / est.persistent - 1.0,
            "peak_bytes": None if extra[k] is None else total - got["gradients"] + extra[k],
            "predicted_peak_bytes": est.persistent + est.transient,
            "losses": [float(v) for v in tr.losses], "skipped_steps": tr.tr.skipped_steps(),
            "vs_amp_bf16": times["amp_bf16"].median / t.median,
            "vs_amp_fp16": times["amp_fp16"].median / t.median
            if k in FP16_MODES + ("amp_fp16",) else None}
        check(abs(m["agreement"]) <= AGREEMENT,
              "%s, %s: measured persistent memory %.2f B/param vs mpext.memory's %.2f "
              "(%+.1f%%, limit %d%%)" % (label, k, total / n, est.persistent / n,
                                         100 * m["agreement"], round(100 * AGREEMENT)))
        for part in MAIN_PARTS:  # the bytes per param of each mode: exactly the prediction
            check(got[part] == m["predicted"][part], "%s, %s: %s measured %d bytes, mpext.memory "
                  "predicts %d" % (label, k, part, got[part], m["predicted"][part]))
    del trainers, batches
    free_memory(dev)
    return out


def _main_per_param(m):
    """Weights + gradients + masters + optimizer states + EMA per param."""
    return sum(m["persistent_bytes_per_param"][p] for p in MAIN_PARTS)


def run(ctx) -> dict:
    b = Bench(ctx, NAME, TITLE)
    fp32_gemm = training.fp32_gemm(ctx)
    sizes = SIZES[("cuda" if ctx.is_cuda else "cpu") + ("_quick" if ctx.quick else "")]
    data, vocab = load_corpus()
    out = []
    for size in ctx.progress(sizes, desc=NAME):
        out.append(_size_metrics(ctx, size, vocab, data, fp32_gemm))
        b.phase(size[0])
    md = []
    for res in out:
        # the targets (benchmarks/README.md), reported, never asserted
        mp, amp = res["modes"]["mpext_bf16"], res["modes"]["amp_bf16"]
        res["target_speed_met"] = b.target(
            mp["vs_amp_bf16"] > 1.0 if ctx.is_cuda else mp["vs_amp_bf16"] >= 1.0,
            "%s: mpext BF16 step %.2fx AMP BF16's speed" % (res["preset"], mp["vs_amp_bf16"]))
        res["target_memory_met"] = b.target(
            _main_per_param(mp) <= _main_per_param(amp),
            "%s: mpext BF16 keeps %.2f B/param > AMP BF16's %.2f"
            % (res["preset"], _main_per_param(mp), _main_per_param(amp)))
        rows = []
        for k, m in res["modes"].items():
            p = m["persistent_bytes_per_param"]
            rows.append([SHORT[k], fmt_ms(m["timing"]), ratio(m["vs_amp_bf16"]),
                         ratio(m["vs_amp_fp16"]), "—" if m["peak_bytes"] is None else
                         "%.1f (%.1f)" % (m["peak_bytes"] / MiB, m["predicted_peak_bytes"] / MiB),
                         "%.2f" % m["persistent_per_param_total"]]
                        + ["%.2f" % p[part] for part in MAIN_PARTS]
                        + ["%.3f" % (p["scaler"] + p["other"]), "%.2f" % m["predicted_per_param"],
                           "%+.1f%%" % (100 * m["agreement"]),
                           "%.3f → %.3f" % (m["losses"][0], m["losses"][-1]),
                           "" if m["skipped_steps"] is None else str(m["skipped_steps"])])
        md += ["**%s: %s params, batch %d × %d tokens**" % (
            res["preset"], "{:,}".format(res["params"]), res["batch"],
            res["config"]["block_size"]), "",
            markdown_table(["mode", "ms / iter", "vs AMP BF16", "vs AMP FP16", "peak MiB (est.)",
                            "persistent B/param", "weights", "grads", "masters", "opt. states",
                            "EMA", "scaler + other", "mpext.memory B/param", "agreement",
                            "loss first → last", "skipped"], rows), ""]
    md.append("%d samples per mode; %s. Method, modes and columns: benchmarks/README.md, "
              "\"Training step\"." % (ctx.repeats, "BF16/FP16 GEMMs in FP32 from rounded "
                                      "operands (gpt.Linear; --native-lowp-gemm for PyTorch's)"
                                      if fp32_gemm else "native BF16/FP16 GEMMs"))
    payload = {"fp32_gemm": fp32_gemm, "lr": LR, "weight_decay": WEIGHT_DECAY,
               "init_scale": INIT_SCALE, "sizes": out}
    return b.finish(md, payload, lambda: [_plot_memory(ctx, out[-1])])


def _plot_memory(ctx, res):
    parts = [(p, p.replace("_weights", " weights").replace("_", " ")) for p in MAIN_PARTS[:4]]
    parts += [("ema", "EMA"), ("small", "scaler + other")]
    keys = list(res["modes"])
    fig, ax = pyplot().subplots(figsize=(12, 4.8))
    width = 0.38
    for measured, off in ((True, -width / 2), (False, width / 2)):
        bottom = [0.0] * len(keys)
        for i, (field, label) in enumerate(parts):
            srcs = [res["modes"][k]["persistent_bytes_per_param"] if measured else
                    res["modes"][k]["predicted"]["bytes_per_param"] for k in keys]
            ys = [src.get("scaler", 0) + src.get("other", 0) if field == "small" else src[field]
                  for src in srcs]
            ax.bar([j + off for j in range(len(keys))], ys, width, bottom=bottom,
                   color="C%d" % i, hatch=None if measured else "//",
                   edgecolor="white", label=label if measured else None)
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([SHORT[k] for k in keys], fontsize=8)
    ax.set_ylabel("persistent bytes per parameter")
    ax.set_title("%s (%s params): measured (plain) vs mpext.memory (hatched)"
                 % (res["preset"], "{:,}".format(res["params"])), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, ctx.out_dir / "train_memory.png", figure_title(ctx, TITLE))


if __name__ == "__main__":
    run_standalone(run, __doc__, training.add_gemm_arg)
