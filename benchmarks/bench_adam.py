"""Optimizer step: mpext.optim's rules x formats vs native AMP (benchmarks/README.md)."""
import torch

import mpext  # loads the extension: registers torch.ops.mpext
from .common import (Bench, MiB, busy_cores, check, count_subnormals, expect_same, fmt_count,
                     fmt_ms, free_memory, load_average, markdown_table, pct, peak_memory_many,
                     require_kernel, run_standalone, yes_no)
from .training import REM, SR

NAME = "bench_adam"
TITLE = "Optimizer step: mpext's fused steps (rules x formats) vs PyTorch AMP"
BF16, FP32 = torch.bfloat16, torch.float32
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
EMA_DECAY = 0.999  # the EMA rows and their native counterparts
GRAD_STD, PARAM_STD = 1e-3, 0.02


def _metrics(rule, case, times, n, roof, inplace_n, peaks=None):
    """One case's rows: per stepper its label, bytes, baseline, target, timing and fractions."""
    same = times["inplace"].gbps(8.0 * inplace_n)
    best = min(_natives(rule)[:1] + list(NATIVE_VARIANTS if rule == "adamw" else ()),
               key=lambda k: times[k].median)  # AdamW's default: against the fastest native
    modes = {}
    for key in list(FMT) + _natives(rule):
        (state, step), t = _bytes(rule, key), times[key]
        if key.startswith("native"):
            label = "torch.amp.GradScaler + %s, fp32 params%s" % (
                NATIVE_VARIANTS[key][0] if key in NATIVE_VARIANTS else RULES[rule][4],
                " + fp32 EMA (torch._foreach_lerp_)" if key == "native_ema" else "")
            base, target = "native", None
        else:
            label, target = FMT[key][0], FMT[key][4] if rule == "adamw" else None
            base = best if target and key == "master" else "native_ema" if FMT[key][3] else "native"
        gb = t.gbps(step * n)
        row = modes[key] = {
            "label": label, "state_bytes_per_param": state, "step_bytes_per_param": step,
            "timing": t.to_json(), "ns_per_param": t.median / n * 1e9, "gbps": gb,
            "baseline": base, "speedup_vs_baseline": times[base].median / t.median,
            "bytes_bound_vs_baseline": _bytes(rule, base)[1] / step,
            "frac_inplace_same_rounds": gb / same,
            "frac_inplace_best": gb / roof["inplace_gbps"],
            "frac_copy_best": gb / roof["copy_gbps"], "peak_bytes": (peaks or {}).get(key),
            "target": target}
        if target is not None:
            row["target_speed_met"] = row["speedup_vs_baseline"] >= target[0]
            row["target_roofline_met"] = row[target[2]] >= target[1]
    return {"case": case, "params": n, "inplace_gbps_same_rounds": same,
            "inplace": times["inplace"].to_json(), "modes": modes, "group": rule}


def _report(b: Bench, results):
    """One table of the cases' rows (``_metrics``), recording missed targets."""
    rows = []
    for mtr in results:
        for i, (key, m) in enumerate(mtr["modes"].items()):
            tgt, met, busy, peak = m["target"], "", m["timing"]["cpu_busy"], m["peak_bytes"]
            if tgt is not None:
                where, roof = "%s, %s" % (mtr["case"], m["label"]), ROOF_NAME[tgt[2]]
                b.target(m["target_speed_met"], "%s: %.2fx its baseline (target %.1fx)"
                         % (where, m["speedup_vs_baseline"], tgt[0]))
                b.target(m["target_roofline_met"], "%s: %s of the %s roofline (target %s)"
                         % (where, pct(m[tgt[2]]), roof, pct(tgt[1])))
                met = yes_no(m["target_speed_met"] and m["target_roofline_met"])
            is_base = key == m["baseline"]
            rows.append(["" if i else mtr["case"], m["label"] + (" (baseline)" if is_base
                                                                 else ""),
                         "" if m["state_bytes_per_param"] is None else
                         str(m["state_bytes_per_param"]), str(m["step_bytes_per_param"]),
                         fmt_ms(m["timing"]), "%.3g" % m["ns_per_param"], "%.1f" % m["gbps"],
                         pct(m["frac_inplace_same_rounds"]), pct(m["frac_inplace_best"]),
                         pct(m["frac_copy_best"]),
                         "—" if is_base else "%.2fx" % m["speedup_vs_baseline"],
                         "—" if is_base else "%.2fx" % m["bytes_bound_vs_baseline"],
                         "" if busy is None else "%.1f" % busy,
                         "" if peak is None else "%.0f" % (peak / MiB),
                         "" if tgt is None else
                         "≥ %.1fx, ≥ %s %s" % (tgt[0], pct(tgt[1]), roof),
                         met])
        rows.append(["", "in-place roofline x.add_(0.5) (same rounds)", "", "8",
                     fmt_ms(mtr["inplace"]), "", "%.1f" % mtr["inplace_gbps_same_rounds"],
                     "100%"] + [""] * 8)
    return markdown_table(["case", "mode", "state B/param", "step B/param", "ms",
                           "ns/param", "GB/s", "% in-place (same rounds)", "% in-place (best)",
                           "% copy (best)", "vs baseline", "bytes bound", "cores busy",
                           "peak MiB", "target", "met"], rows)


def _lion(params, hyper):
    try:
        from lion_pytorch import Lion
    except ImportError:
        raise RuntimeError("bench_adam: the Lion rows need lion-pytorch (pip install "
                           "lion-pytorch==0.2.5; make's environment has it)") from None
    return Lion(params, **hyper)


# rule -> (mpext.optim class, its moments' options, hyperparameters, the native optimizer, its
# label, its step's bytes per param after the inf check and its state's; README: "native")
RULES = {
    "adamw": ("AdamW", ("exp_avg_dtype", "exp_avg_sq_dtype"), HYPER,
              lambda ps, h: torch.optim.AdamW(ps, fused=True, **h), "AdamW(fused=True)", 32, 8),
    "lion": ("Lion", ("exp_avg_dtype",), dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2),
             _lion, "lion-pytorch Lion", 76, 4),
    "sgd": ("SGD", ("momentum_dtype",), dict(lr=1e-3, momentum=0.9, weight_decay=1e-2),
            lambda ps, h: torch.optim.SGD(ps, fused=True, **h), "SGD(momentum, fused=True)", 24, 4),
}
# the inf checks: mpext.GradScaler's at scale 1 reads the bf16 grads, torch's reads and writes
CHECK_BYTES, NATIVE_CHECK_BYTES = 2, 8
# AdamW's other native variants: key -> (label, options); both step 80 B/param (README)
NATIVE_VARIANTS = {"native_foreach": ("AdamW(foreach=True)", dict(foreach=True)),
                   "native_forloop": ("AdamW(foreach=False), the for-loop", dict(foreach=False))}
NATIVE_VARIANT_BYTES = 80
# param format -> (options, persistent B/param beyond param + grad, the step's param traffic)
PARAM_FORMATS = {"master": ({}, 4, 10), "remainder": (REM, 2, 8), "sr": (SR, 0, 4),
                 "rne": (dict(master_weights=False), 0, 4)}
MOMENT_FORMATS = {"fp32": (FP32, 4), "bf16": (BF16, 2), "q8": (torch.int8, 1)}  # 8/256 scales
# AdamW's targets (reported): (x its baseline, fraction, of which roofline); the default format
# is held against the fastest native AdamW and the copy roofline
COPY, INPLACE = "frac_copy_best", "frac_inplace_same_rounds"
ROOF_NAME = {COPY: "copy", INPLACE: "in-place"}
# key, label, param format, moment format, EMA (vs native + EMA), AdamW's target
FORMATS = [
    ("master", "fp32 master + fp32 moments (default)", "master", "fp32", False, (1.3, 0.8, COPY)),
    ("remainder", "remainder + fp32 moments", "remainder", "fp32", False, None),
    ("remainder_bf16m", "remainder + bf16 moments", "remainder", "bf16", False,
     (1.6, 0.8, INPLACE)),
    ("sr_bf16m", "no master, SR + bf16 moments", "sr", "bf16", False, (2.0, 0.8, INPLACE)),
    ("sr", "no master, SR + fp32 moments", "sr", "fp32", False, None),
    ("rne", "no master, round to nearest + fp32 moments (cautionary)", "rne", "fp32", False,
     None),
    ("remainder_q8", "remainder + 8-bit moments", "remainder", "q8", False, (2.0, 0.8, INPLACE)),
    ("sr_q8", "no master, SR + 8-bit moments", "sr", "q8", False, (2.5, 0.8, INPLACE)),
    ("remainder_bf16m_ema", "remainder + bf16 moments + fp32 EMA of the masters (vs native "
     "+ EMA)", "remainder", "bf16", True, None),
]
FMT = {f[0]: f[1:] for f in FORMATS}


def _natives(rule):
    """The keys of a rule's native steppers."""
    return ["native", "native_ema"] + (list(NATIVE_VARIANTS) if rule == "adamw" else [])


def _bytes(rule, key):
    """(persistent, step) B/param of a stepper, the step with its inf check (README)."""
    if key.startswith("native"):  # on fp32 params; an EMA adds 4 and 12
        ema, step = key == "native_ema", NATIVE_VARIANT_BYTES if key in NATIVE_VARIANTS else \
            RULES[rule][5]
        return 8 + RULES[rule][6] + 4 * ema, NATIVE_CHECK_BYTES + step + 12 * ema
    _, pf, mf, ema, _ = FMT[key]
    nm, mom = len(RULES[rule][1]), MOMENT_FORMATS[mf][1]
    state, traffic = PARAM_FORMATS[pf][1:]
    return 2 + 2 + state + nm * mom + 4 * ema, 2 + traffic + 2 * nm * mom + 8 * ema + CHECK_BYTES


class RuleProblem:
    """One rule's case of ``n`` params: every format's and native's stepper (README)."""

    def __init__(self, rule, n, dev, seed, roof_numel=0):
        cls, mopts, hyper, native, *_ = RULES[rule]
        gen = torch.Generator().manual_seed(seed)
        p0 = (torch.randn(n, generator=gen) * PARAM_STD).to(BF16)
        g0 = (torch.randn(n, generator=gen) * GRAD_STD).to(BF16)
        self.rule, self.hyper, self.grad, self.numel = rule, hyper, g0.to(dev), n
        self.steppers = {}  # key -> (param, optimizer, scaler)
        for key, (_, pf, mf, ema, _) in FMT.items():
            p = p0.to(dev, copy=True)
            p.grad = self.grad
            opts = dict(PARAM_FORMATS[pf][0], **{o: MOMENT_FORMATS[mf][0] for o in mopts})
            if mf == "q8" and rule == "adamw":
                opts["exp_avg_sq_dtype"] = torch.uint8
            if ema:
                opts["ema_decay"] = EMA_DECAY
            self.steppers[key] = (p, getattr(mpext.optim, cls)([p], **hyper, **opts),
                                  mpext.GradScaler(dev.type, bf16_check_only=True))
        for key in _natives(rule):
            p32 = p0.to(dev, FP32)
            p32.grad = g0.to(dev, FP32)
            opt = torch.optim.AdamW([p32], **NATIVE_VARIANTS[key][1], **hyper) \
                if key in NATIVE_VARIANTS else native([p32], hyper)
            self.steppers[key] = (p32, opt, torch.amp.GradScaler(
                dev.type, init_scale=1.0, growth_interval=1 << 30))
        self.native_ema = []  # native_ema's fp32 EMA: a copy of the param after its first step
        for _, _, scaler in self.steppers.values():
            scaler.scale(torch.ones((), device=dev))  # makes the scale, as scaling a loss does
        self.calls = {k: 0 for k in self.steppers}
        self.roof = torch.zeros(roof_numel, dtype=FP32, device=dev) if roof_numel else None

    def fns(self):
        """key -> ``scaler.step(opt); scaler.update()``, plus ``inplace`` on the roofline buffer."""
        def stepper(key):
            p, opt, scaler = self.steppers[key]

            def f():
                self.calls[key] += 1
                scaler.step(opt)
                scaler.update()
                if key == "native_ema":  # AveragedModel's EMA update after an applied step
                    if self.native_ema:
                        torch._foreach_lerp_(self.native_ema, [p.detach()], 1.0 - EMA_DECAY)
                    else:
                        self.native_ema.append(p.detach().clone())
            return f
        out = {k: stepper(k) for k in self.steppers}
        if self.roof is not None:
            out["inplace"] = lambda buf=self.roof: buf.add_(0.5)
        return out

    def after_timing_checks(self):
        """Every step taken, the scales 1, the gradient unwritten, state finite."""
        tensors = []
        for key, (p, opt, scaler) in self.steppers.items():
            st = opt.state[p]
            if "step" in st:  # lion-pytorch and torch's SGD count no steps
                check(float(st["step"]) == self.calls[key], "%s %s: step count %s after %d "
                      "calls" % (self.rule, key, float(st["step"]), self.calls[key]))
            check(scaler.get_scale() == 1.0, "%s %s: the loss scale left 1" % (self.rule, key))
            if isinstance(scaler, mpext.GradScaler):
                check(int(scaler.skipped_steps()) == 0, "%s %s: skipped steps" % (self.rule, key))
            own = [p] + [v for v in st.values() if isinstance(v, torch.Tensor)
                         and v.numel() == p.numel() and v.is_floating_point()]
            check(all(bool(t.isfinite().all()) for t in own), "%s %s: non-finite state"
                  % (self.rule, key))
            tensors += own
        check(bool(self.grad.equal(self.steppers["native"][0].grad.to(BF16))),
              "%s: the shared bf16 gradient was written" % self.rule)
        check(bool(self.native_ema[0].isfinite().all()), "native_ema: non-finite EMA")
        return {"calls": dict(self.calls), "subnormals": count_subnormals(tensors),
                "elements_checked": sum(t.numel() for t in tensors)}


def _rule_sanity(rule, dev):
    """One step of every stepper on 1M + 3 params against the rule's reference."""
    prob = RuleProblem(rule, (1 << 20) + 3, dev, seed=98)
    native = prob.steppers["native"][0]
    p_ref = native.detach().clone()
    p_ref.grad = native.grad.clone()
    ref_opt = _lion([p_ref], prob.hyper) if rule == "lion" else \
        getattr(torch.optim, RULES[rule][0])([p_ref], foreach=False, **prob.hyper)
    ref_opt.step()
    ref_state = ref_opt.state[p_ref]
    g_before = prob.grad.clone()
    for f in prob.fns().values():
        f()
    close, ulp = dict(rtol=1e-5, atol=1e-8), dict(rtol=2.0 ** -7, atol=1e-30)  # ulp: bf16's
    name = "%s: " % rule
    for key in _natives(rule):
        if key != "native_ema":
            expect_same(name + key, prob.steppers[key][0], p_ref, **close)
    expect_same(name + "native EMA", prob.native_ema[0], p_ref, **close)
    p_e, opt_e, _ = prob.steppers["remainder_bf16m_ema"]
    expect_same(name + "EMA", opt_e.ema_param(p_e), p_ref, **close)
    p_m, opt_m, _ = prob.steppers["master"]
    expect_same(name + "master", opt_m.master_param(p_m), p_ref, **close)
    p_r, opt_r, _ = prob.steppers["remainder"]
    expect_same(name + "remainder vs master (bits)", [p_r, opt_r.master_param(p_r)],
                [p_m, opt_m.master_param(p_m)])
    moments = [k for k in ref_state if k != "step"]
    for key, (_, _, mf, _, _) in FMT.items():
        p, opt, _ = prob.steppers[key]
        expect_same(name + key + " param", p.float(), p_ref, **ulp)
        if mf != "q8":  # the 8-bit codes keep other keys (docs/moments_8bit.md)
            expect_same(name + key + " moments", [opt.state[p][k].float() for k in moments],
                        [ref_state[k] for k in moments], **ulp)
    expect_same(name + "the gradient at scale 1", prob.grad, g_before)


def run(ctx) -> dict:
    dev = ctx.device
    require_kernel(dev, "adam_step_")
    load_start = load_average()
    b = Bench(ctx, NAME, TITLE)
    roof_numel = b.start_roofline()["numel"]
    # --rules: some rules' cases only (a quiet-machine measurement of one rule takes minutes,
    # not the whole module's); every rule's, as in the suite, by default
    rules = [r for r in RULES if r in (getattr(ctx.args, "rules", None) or ",".join(RULES))
             .split(",")]
    if not rules:
        raise SystemExit("bench_adam: --rules: none of %s" % ", ".join(RULES))
    for rule in rules:
        _rule_sanity(rule, dev)
    b.phase("correctness")
    sizes = [16 << 20] if ctx.quick else [16 << 20, 64 << 20]
    jobs = [(rule, ci, n) for ci, n in enumerate(sizes) for rule in rules]
    raw, checks = [], {}
    for rule, ci, n in ctx.progress(jobs, desc="adam cases"):
        label = "%s params, %s" % (fmt_count(n), rule)
        prob = RuleProblem(rule, n, dev, seed=100 + ci, roof_numel=roof_numel)
        fns = prob.fns()
        peaks = None
        if rule == "adamw" and n == sizes[-1]:  # peak memory at the largest size
            for f in fns.values():  # create the optimizers' state first
                f()
            peaks = peak_memory_many(fns, dev)
        times = ctx.time_fns(fns, desc=label)
        checks[label] = prob.after_timing_checks()
        raw.append((rule, label, times, n, peaks))
        del prob, fns
        free_memory(dev)
        b.phase(label)
    roof = b.end_roofline()
    results = [_metrics(rule, label, t, n, roof, roof_numel, peaks)
               for rule, label, t, n, peaks in raw]
    load_end = load_average()
    md = []
    if load_start and load_end:
        cores = busy_cores(ctx.machine)
        md += ["1-minute load average at the start / end: %.2f / %.2f on %d cores%s"
               % (load_start[0], load_end[0], cores,
                  ": **other processes shared the cores**, so the ratios against torch's "
                  "unfused variants overstate mpext's lead (benchmarks/README.md, \"Optimizer "
                  "step\")." if max(load_start[0], load_end[0]) > 0.5 * cores else "."), ""]
    md += [_report(b, results), "",
           "%d samples per row, a case's rows interleaved. After the timings %d subnormal "
           "values (%s elements checked); every step taken, scales 1, the shared gradient "
           "unwritten. Method, formats, bytes and columns: benchmarks/README.md, \"Optimizer "
           "step\"." % (ctx.repeats, sum(c["subnormals"] for c in checks.values()),
                        "{:,}".format(sum(c["elements_checked"] for c in checks.values())))]
    payload = {"hyperparameters": {r: RULES[r][2] for r in rules}, "grad_std": GRAD_STD,
               "cases": results, "after_timing_checks": checks,
               "load_average_start": load_start, "load_average_end": load_end}
    return b.finish(md, payload)


def _add_args(parser):
    parser.add_argument("--rules", default=None,
                        help="comma list of the rules to time (default: all of %s)"
                        % ",".join(RULES))
    return parser


if __name__ == "__main__":
    run_standalone(run, __doc__, _add_args)
