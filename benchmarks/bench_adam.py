"""Optimizer step: mpext's fused AdamW step (``adam_step_``) against native PyTorch AMP's ways
of stepping ``torch.optim.AdamW`` under a loss scaler, and every rule of mpext.optim (AdamW,
Lion, SGD) in every param/moment format under a GradScaler against the rule's native optimizer,
in the same run on the same device. Method, paths, bytes counted and columns:
benchmarks/README.md, "AdamW step" and "Rules x formats".

    python -m benchmarks.bench_adam [--quick] [--device auto|cpu|cuda] [--only paths|rules]
"""
if not __package__:  # run by path (python benchmarks/bench_adam.py): as the package module
    import os, runpy, sys  # noqa: E401
    sys.path[0] = os.path.dirname(sys.path[0])
    runpy.run_module("benchmarks.bench_adam", run_name="__main__")
    sys.exit()
import math
import sys

import torch

import mpext  # loads the extension: registers torch.ops.mpext
from .common import (Alternate, Bench, MiB, busy_cores, check, count_subnormals,
                     expect_same, figure_title, fmt_count, fmt_ms, free_memory, gpt2_shapes,
                     load_average, markdown_table, pct, peak_memory_many, plot_lines,
                     require_kernel, roofline_hlines, run_standalone, yes_no)

NAME = "bench_adam"
TITLE = "Optimizer step: mpext's fused steps (AdamW paths; rules x formats) vs PyTorch AMP"
BF16, FP32 = torch.bfloat16, torch.float32
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-2
HYPER = dict(lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
EMA_DECAY = 0.999  # the EMA rows and their native counterparts
GRAD_STD, PARAM_STD = 1e-3, 0.02
SPEED_TARGET = 1.3   # >= 1.3x the best native path at 16M+ params; reported, never asserted
COPY_TARGET = 0.80   # >= 80% of the copy roofline at 16M+ params; reported only
TARGET_MIN_PARAMS = 16 << 20
SIZES_FULL = [1 << 20, 16 << 20, 64 << 20]
SIZES_QUICK = [1 << 20, 4 << 20, 16 << 20]
PATHS = [  # key, label, short label, bytes per param, mpext?
    ("mpext", "mpext adam_step_ (bf16 p/g, fp32 master+m+v, inv_scale + found_inf)", "mpext",
     28, True),
    ("mpext_chk", "mpext unscale_ inf check (reads bf16 g) + adam_step_", "mpext + check", 30,
     True),
    ("mpext_wb", "mpext check + adam_step_ writing the unscaled grads back (mpext.optim's "
     "default under a GradScaler)", "mpext + check + grads back", 32, True),
    ("fused_gs", "torch GradScaler.step: inf check + AdamW(fused) with grad_scale/found_inf",
     "torch fused (GradScaler)", 40, False),
    ("fused_un", "torch unscale_ + AdamW(fused) with found_inf", "torch unscale_ + fused", 36,
     False),
    ("foreach", "torch unscale_ + found_inf.item() + AdamW(foreach)", "torch unscale_ + foreach",
     88, False),
]
PATH_LABEL = {p[0]: p[1] for p in PATHS}
SHORT = {p[0]: p[2] for p in PATHS}
PATH_BYTES = {p[0]: p[3] for p in PATHS}
NATIVE = [p[0] for p in PATHS if not p[4]]


class Problem:
    """The tensors of one case, both sides from the same values (benchmarks/README.md, "AdamW
    step"); the native paths share the fp32 params and grads, each optimizer its own state."""

    def __init__(self, shapes, dev, seed):
        g = torch.Generator().manual_seed(seed)
        self.dev = dev
        self.numel = sum(math.prod(s) for s in shapes)
        self.p32 = [(torch.randn(s, generator=g) * PARAM_STD).to(dev).to(BF16).float()
                    for s in shapes]
        self.g32 = [(torch.randn(s, generator=g) * GRAD_STD).to(dev).to(BF16).float()
                    for s in shapes]
        self.p16, self.g16 = [p.to(BF16) for p in self.p32], [gr.to(BF16) for gr in self.g32]
        self.masters = [p.clone() for p in self.p32]
        self.m, self.v = ([torch.zeros_like(p) for p in self.p32] for _ in range(2))
        self.steps = [torch.zeros(1, dtype=FP32, device=dev) for _ in shapes]
        self.lr = torch.full((1,), LR, dtype=FP32, device=dev)
        self.found = torch.zeros((), dtype=FP32, device=dev)
        self.one = torch.ones((), dtype=FP32, device=dev)
        for p, gr in zip(self.p32, self.g32):
            p.grad = gr
        self.opt_fused = torch.optim.AdamW(self.p32, fused=True, **HYPER)
        self.opt_foreach = torch.optim.AdamW(self.p32, foreach=True, **HYPER)
        self.mpext_calls = 0
        # x0.5 / x2 in turn: inv_scale for mpext and the unscale passes; grad_scale (the fused
        # kernel divides by it) 2 / 0.5. Each alternator's net effect on the grads is x1 or x0.5.
        self.alt = {k: Alternate(2.0, 0.5, dev) if k == "fused_gs" else Alternate(0.5, 2.0, dev)
                    for k in PATH_LABEL}

    def fns(self):
        """key -> callable doing one step of that path."""
        adam, unscale_mp = torch.ops.mpext.adam_step_, torch.ops.mpext.unscale_
        t_unscale = torch._amp_foreach_non_finite_check_and_unscale_
        found, one, alt, g16 = self.found, self.one, self.alt, self.g16
        opt_f, opt_fe = self.opt_fused, self.opt_foreach

        def mpext_step(key, check_first, **kw):
            def f():
                self.mpext_calls += 1
                if check_first:
                    found.zero_()
                    unscale_mp(g16, found, one)  # inv_scale 1: check only, nothing written
                adam(self.p16, g16, self.m, self.v, self.masters, self.steps, self.lr, BETA1,
                     BETA2, EPS, WEIGHT_DECAY, True, False, inv_scale=alt[key](),
                     found_inf=found, **kw)
            return f

        def fused(key, unscale_first):
            def f():
                found.zero_()
                if unscale_first:  # scaler.unscale_(opt)
                    t_unscale(self.g32, found, alt[key]())
                    opt_f.grad_scale = None
                else:  # GradScaler.step's _check_inf_per_device: dummy inv_scale 1.0
                    t_unscale(self.g32, found, one)
                    opt_f.grad_scale = alt[key]()
                opt_f.found_inf = found
                opt_f.step()
                del opt_f.grad_scale, opt_f.found_inf
            return f

        def f_foreach():
            found.zero_()
            t_unscale(self.g32, found, alt["foreach"]())  # scaler.unscale_(opt)
            if not found.item():  # GradScaler._maybe_opt_step
                opt_fe.step()

        return {"mpext": mpext_step("mpext", False), "mpext_chk": mpext_step("mpext_chk", True),
                "mpext_wb": mpext_step("mpext_wb", True, unscale_grads=True),
                "fused_gs": fused("fused_gs", False), "fused_un": fused("fused_un", True),
                "foreach": f_foreach}

    def after_timing_checks(self):
        """No subnormals anywhere, found_inf still 0, mpext's steps advanced once per call."""
        check(float(self.found) == 0.0, "found_inf became %r during timing (finite grads)"
              % float(self.found))
        steps = {float(s) for s in self.steps}
        check(steps == {float(self.mpext_calls)}, "mpext step counts %s after %d calls"
              % (sorted(steps), self.mpext_calls))
        native = self.p32 + self.g32 + [st[k] for opt in (self.opt_fused, self.opt_foreach)
                                        for st in opt.state.values()
                                        for k in ("exp_avg", "exp_avg_sq")]
        mine = self.p16 + self.g16 + self.masters + self.m + self.v
        return {"subnormals": count_subnormals(mine + native), "mpext_calls": self.mpext_calls,
                "elements_checked": sum(t.numel() for t in mine + native)}


def _sanity(dev):
    """One step of every timed path on a small list against torch.optim.AdamW(foreach=False) on
    fp32 copies fed the same gradients, unscaled (each path's first call unscales by 0.5)."""
    for key in PATH_LABEL:
        prob = Problem([((1 << 20) + 3,), (300, 257), (17,)], dev, seed=99)
        ref = [p.clone() for p in prob.p32]
        for p, g in zip(ref, prob.g32):
            p.grad = g * 0.5
        torch.optim.AdamW(ref, foreach=False, **HYPER).step()
        prob.fns()[key]()
        expect_same(key, prob.masters if key.startswith("mpext") else prob.p32, ref,
                    rtol=1e-5, atol=1e-8)


ROOF_NAME = {"frac_copy_best": "copy", "frac_inplace_same_rounds": "in-place"}


def _metrics(case, times, n, modes, roof, inplace_n=0, peaks=None):
    """One case's rows, the paths' and the rules' alike: per mode (key -> (label, state B/param
    or None, step B/param, baseline key, target: (x baseline, roofline fraction, its field) or
    None)) timing, bytes, GB/s, speed and bytes bound against its baseline, the fractions of
    the run's best rooflines and, where the in-place roofline's buffer of ``inplace_n``
    elements was timed in the same rounds, of that one."""
    same = times["inplace"].gbps(8.0 * inplace_n) if inplace_n else None
    out = {"case": case, "params": n, "inplace_gbps_same_rounds": same,
           "inplace": times["inplace"].to_json() if inplace_n else None, "modes": {}}
    for key, (label, state, step, base, target) in modes.items():
        t = times[key]
        gb = t.gbps(step * n)
        row = out["modes"][key] = {
            "label": label, "state_bytes_per_param": state, "step_bytes_per_param": step,
            "timing": t.to_json(), "ns_per_param": t.median / n * 1e9, "gbps": gb,
            "baseline": base, "speedup_vs_baseline": times[base].median / t.median,
            "bytes_bound_vs_baseline": modes[base][2] / step,
            "frac_inplace_same_rounds": gb / same if same else None,
            "frac_inplace_best": gb / roof["inplace_gbps"],
            "frac_copy_best": gb / roof["copy_gbps"], "peak_bytes": (peaks or {}).get(key),
            "target": target}
        if target is not None:
            row["target_speed_met"] = row["speedup_vs_baseline"] >= target[0]
            row["target_roofline_met"] = row[target[2]] >= target[1]
    return out


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
        if mtr["inplace"] is not None:
            rows.append(["", "in-place roofline x.add_(0.5) (same rounds)", "", "8",
                         fmt_ms(mtr["inplace"]), "", "%.1f" % mtr["inplace_gbps_same_rounds"],
                         "100%"] + [""] * 8)
    return markdown_table(["case", "path / mode", "state B/param", "step B/param", "ms",
                           "ns/param", "GB/s", "% in-place (same rounds)", "% in-place (best)",
                           "% copy (best)", "vs baseline", "bytes bound", "cores busy",
                           "peak MiB", "target", "met"], rows)


def _path_modes(times, n):
    """The op-level paths as ``_metrics`` modes: the baseline is the fastest native path."""
    best = min(NATIVE, key=lambda k: times[k].median)
    return {k: (SHORT[k], None, PATH_BYTES[k], best,
                (SPEED_TARGET, COPY_TARGET, "frac_copy_best")
                if k == "mpext" and n >= TARGET_MIN_PARAMS else None) for k in PATH_LABEL}


def _rule_modes(rule):
    """A rule's formats and natives as ``_metrics`` modes (AdamW's formats carry targets)."""
    out = {}
    for key in list(FMT) + ["native", "native_ema"]:
        if key.startswith("native"):
            label = "torch.amp.GradScaler + %s, fp32 params%s" % (
                RULES[rule][4], " + fp32 EMA (torch._foreach_lerp_)"
                if key == "native_ema" else "")
            out[key] = (label,) + _native_bytes(rule, key == "native_ema") + ("native", None)
        else:
            tgt = FMT[key][4] if rule == "adamw" else None
            out[key] = (FMT[key][0],) + _mpext_bytes(rule, key) + (
                "native_ema" if FMT[key][3] else "native",
                None if tgt is None else tgt + ("frac_inplace_same_rounds",))
    return out



# ---- Rules x formats: the whole step as a user runs it, ``scaler.step(opt); scaler.update()``
# under a GradScaler at scale 1 (BF16 training), for every rule (mpext.optim.AdamW, Lion, SGD)
# in every param/moment format, against the rule's native optimizer on fp32 params and the
# in-place roofline, in the same rounds (benchmarks/README.md, "Rules x formats").

LEAN_SIZES_FULL = [16 << 20, 64 << 20]
LEAN_SIZES_QUICK = [16 << 20]
CHECK_BYTES = 2  # mpext.GradScaler's inf check at scale 1 reads the bf16 grads


def _lion(params, hyper):
    try:
        from lion_pytorch import Lion
    except ImportError:
        raise RuntimeError("bench_adam: the Lion rows need lion-pytorch (pip install "
                           "lion-pytorch==0.2.5; make's environment has it)") from None
    return Lion(params, **hyper)


# rule -> (mpext.optim class, the moments' dtype options, hyperparameters, the native optimizer
# on fp32 params (None: imported on use), its label, the bytes per param its step moves after
# torch GradScaler's inf check (8: reads and writes back the fp32 grads), its state bytes)
RULES = {
    "adamw": ("AdamW", ("exp_avg_dtype", "exp_avg_sq_dtype"), HYPER,
              lambda ps, h: torch.optim.AdamW(ps, fused=True, **h), "AdamW(fused=True)",
              # reads param, grad, m, v; writes param, m, v and the unscaled grad
              32, 8),
    "lion": ("Lion", ("exp_avg_dtype",), dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-2),
             _lion, "lion-pytorch Lion",
             # not fused: the scaler's unscale_ and found_inf.item(), then p.mul_ 8, clone m 8,
             # mul_ 8, add(g) 12, sgn_ 8, p.add_ 12, m.mul_ 8, m.add_(g) 12
             76, 4),
    "sgd": ("SGD", ("momentum_dtype",), dict(lr=1e-3, momentum=0.9, weight_decay=1e-2),
            lambda ps, h: torch.optim.SGD(ps, fused=True, **h), "SGD(momentum, fused=True)",
            # reads param, grad, buffer; writes param, buffer and the unscaled grad
            24, 4),
}
NATIVE_CHECK_BYTES = 8
# param format -> (options, persistent B/param beyond param + grad, B/param of the step's
# param traffic): a master reads and writes 4 + 4 and writes the param 2; a remainder reads and
# writes param and remainder 2 + 2 + 2 + 2; none reads and writes the param
PARAM_FORMATS = {"master": ({}, 4, 10), "remainder": (dict(param_remainders=True), 2, 8),
                 "sr": (dict(master_weights=False, stochastic_rounding=True), 0, 4),
                 "rne": (dict(master_weights=False), 0, 4)}
MOMENT_FORMATS = {"fp32": (FP32, 4), "bf16": (BF16, 2), "q8": (torch.int8, 1)}  # 8/256 scales
# key, label, param format, moment format, EMA (4 + 4 B/param more in the same pass, compared
# with native + an EMA), targets (x native, fraction of the in-place roofline) or None
FORMATS = [
    ("master", "fp32 master + fp32 moments (default)", "master", "fp32", False, None),
    ("remainder", "remainder + fp32 moments", "remainder", "fp32", False, None),
    ("remainder_bf16m", "remainder + bf16 moments", "remainder", "bf16", False, (1.6, 0.80)),
    ("sr_bf16m", "no master, SR + bf16 moments", "sr", "bf16", False, (2.0, 0.80)),
    ("sr", "no master, SR + fp32 moments", "sr", "fp32", False, None),
    ("rne", "no master, round to nearest + fp32 moments (cautionary)", "rne", "fp32", False,
     None),
    # 8-bit moments (docs/moments_8bit.md)
    ("remainder_q8", "remainder + 8-bit moments", "remainder", "q8", False, (2.0, 0.80)),
    ("sr_q8", "no master, SR + 8-bit moments", "sr", "q8", False, (2.5, 0.80)),
    ("remainder_bf16m_ema", "remainder + bf16 moments + fp32 EMA of the masters (vs native "
     "+ EMA)", "remainder", "bf16", True, None),
]
FMT = {f[0]: f[1:] for f in FORMATS}


def _mpext_bytes(rule, fmt):
    """(persistent, step) B/param of a rule's format: bf16 param and grad, the param format,
    its moments, the EMA; the step adds the check's 2."""
    _, pf, mf, ema, _ = FMT[fmt]
    nm, mom = len(RULES[rule][1]), MOMENT_FORMATS[mf][1]
    state, traffic = PARAM_FORMATS[pf][1:]
    return 2 + 2 + state + nm * mom + 4 * ema, 2 + traffic + 2 * nm * mom + 8 * ema + CHECK_BYTES


def _native_bytes(rule, ema=False):
    """(persistent, step) B/param of the native step on fp32 params; an EMA adds an fp32 copy
    and torch._foreach_lerp_ on it (what AveragedModel's EMA runs): 4, and 4 + 4 + 4."""
    return 8 + RULES[rule][6] + 4 * ema, NATIVE_CHECK_BYTES + RULES[rule][5] + 12 * ema


class RuleProblem:
    """One rule's case of ``n`` params: per format a param, optimizer and scaler (scale 1),
    one bf16 gradient shared by the mpext formats, the native steppers on fp32 copies, and
    ``roof_numel``: the in-place roofline's buffer, timed in the same rounds."""

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
        for key in ("native", "native_ema"):
            p32 = p0.to(dev, FP32)
            p32.grad = g0.to(dev, FP32)
            self.steppers[key] = (p32, native([p32], hyper), torch.amp.GradScaler(
                dev.type, init_scale=1.0, growth_interval=1 << 30))
        self.native_ema = []  # native_ema's fp32 EMA: a copy of the param after its first step
        for _, _, scaler in self.steppers.values():
            scaler.scale(torch.ones((), device=dev))  # makes the scale, as scaling a loss does
        self.calls = {k: 0 for k in self.steppers}
        self.roof = torch.zeros(roof_numel, dtype=FP32, device=dev) if roof_numel else None

    def fns(self):
        """key -> one training step's optimizer part, ``scaler.step(opt); scaler.update()``;
        plus ``inplace`` (``x.add_(0.5)`` on the roofline buffer) when there is one."""
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
        """Every step taken (none skipped), the scales still 1, the shared gradient never
        written, no state non-finite."""
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
    """One step of every stepper of ``rule`` on 1M + 3 params against the rule's reference
    (torch's AdamW and SGD with foreach=False, lion-pytorch's Lion) on fp32 copies (the
    tolerances: benchmarks/README.md, "Rules x formats")."""
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
    expect_same(name + "native", native, p_ref, **close)
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
    only = getattr(ctx.args, "only", None)  # run_all's --only (a list) runs both sections
    only = only if isinstance(only, str) else None
    do_paths, do_rules = only in (None, "paths"), only in (None, "rules", "lean")
    load_start = load_average()
    b = Bench(ctx, NAME, TITLE)
    roof_numel = b.start_roofline()["numel"]
    if do_paths:
        _sanity(dev)
    for rule in RULES if do_rules else ():
        _rule_sanity(rule, dev)
    b.phase("correctness")
    # (group, case label, the problem, its modes, the in-place buffer timed along, peaks?)
    jobs = []
    if do_paths:
        sizes = SIZES_QUICK if ctx.quick else SIZES_FULL
        gpt_shapes = [shape for _, shape in gpt2_shapes(reduced=ctx.quick)]
        jobs = [("paths", "%s params, 1 tensor" % fmt_count(n),
                 lambda n=n, ci=ci: Problem([(n,)], dev, seed=ci), _path_modes, 0,
                 n == sizes[-1]) for ci, n in enumerate(sizes)]
        jobs.append(("paths", "GPT-2 %s list: %.1fM params, %d tensors" % (
            "reduced (4 layers, 8K vocab)" if ctx.quick else "small",
            sum(math.prod(s) for s in gpt_shapes) / 1e6, len(gpt_shapes)),
            lambda: Problem(gpt_shapes, dev, seed=len(sizes)), _path_modes, 0, False))
    rule_sizes = (LEAN_SIZES_QUICK if ctx.quick else LEAN_SIZES_FULL) if do_rules else []
    jobs += [(rule, "%s params, %s" % (fmt_count(n), rule),
              lambda n=n, ci=ci, rule=rule: RuleProblem(rule, n, dev, seed=100 + ci,
                                                        roof_numel=roof_numel),
              lambda t, n, rule=rule: _rule_modes(rule), roof_numel, False)
             for ci, n in enumerate(rule_sizes) for rule in RULES]
    raw, checks = [], {}
    for group, label, make, modes, inplace_n, peak in ctx.progress(jobs, desc="adam cases"):
        prob = make()
        fns = prob.fns()
        peaks = None
        if peak:  # peak memory at the largest single size
            for f in fns.values():  # create the optimizers' state first
                f()
            peaks = peak_memory_many(fns, dev)
        times = ctx.time_fns(fns, desc=label)
        checks[label] = prob.after_timing_checks()
        raw.append((group, label, times, prob.numel, modes(times, prob.numel), inplace_n, peaks))
        del prob, fns
        free_memory(dev)
        b.phase(label)
    roof = b.end_roofline()
    results = [dict(_metrics(label, t, n, modes, roof, inplace_n, peaks), group=group)
               for group, label, t, n, modes, inplace_n, peaks in raw]
    load_end = load_average()
    md = []
    if load_start and load_end:
        cores = busy_cores(ctx.machine)
        md += ["1-minute load average at the start / end: %.2f / %.2f on %d cores%s"
               % (load_start[0], load_end[0], cores,
                  ": **other processes shared the cores**, so on lists the ratios overstate "
                  "mpext's lead (benchmarks/README.md, \"AdamW step\")."
                  if max(load_start[0], load_end[0]) > 0.5 * cores else "."), ""]
    md += [_report(b, results), "",
           "%d samples per row, a case's rows interleaved. After the timings %d subnormal "
           "values (%s elements checked); the paths' found_inf 0 and mpext steps = calls; the "
           "rules' every step taken, scales 1, the shared gradient unwritten. Method, paths, "
           "formats, bytes and columns: benchmarks/README.md, \"AdamW step\" and \"Rules x "
           "formats\"." % (ctx.repeats, sum(c["subnormals"] for c in checks.values()),
                            "{:,}".format(sum(c["elements_checked"] for c in checks.values())))]
    payload = {"hyperparameters": dict(HYPER, grad_std=GRAD_STD),
               "rules": {r: {"class": c, "hyperparameters": h, "native": lab}
                         for r, (c, _, h, _, lab, _, _) in RULES.items()},
               "cases": results, "after_timing_checks": checks,
               "load_average_start": load_start, "load_average_end": load_end}
    return b.finish(md, payload, lambda: _plot(ctx, results, roof))


def _plot(ctx, results, roof):
    panels, single = [], [r for r in results if r["case"].endswith("1 tensor")]
    ns = [r["params"] for r in single]
    for title, field, ylabel, hl in (
            ("bandwidth (bytes counted per path / median time)", "gbps", "GB/s",
             roofline_hlines(roof, COPY_TARGET)),
            ("time per parameter", "ns_per_param", "ns / param", {})) if single else ():
        panels.append({"title": title, "xlabel": "params", "ylabel": ylabel, "logx": True,
                       "hlines": hl, "series": {SHORT[p]: (ns, [r["modes"][p][field]
                                                                for r in single])
                                                for p in SHORT}})
    for rule in RULES:
        res = [r for r in results if r["group"] == rule]
        if not res:
            continue
        bounds = {"bound %s %.2fx" % (k, res[0]["modes"][k]["bytes_bound_vs_baseline"]):
                  res[0]["modes"][k]["bytes_bound_vs_baseline"] for k in ("remainder_bf16m",
                                                                          "sr_bf16m")}
        panels.append({"title": "%s: speed vs native (lines: bytes bounds)" % rule,
                       "xlabel": "params", "ylabel": "x native", "logx": True, "hlines": bounds,
                       "series": {FMT[k][0] if k in FMT else k: ([r["params"] for r in res], [
                           r["modes"][k]["speedup_vs_baseline"] for r in res])
                           for k in list(FMT) + ["native"]}})
    return plot_lines(ctx.out_dir / (NAME + ".png"), panels,
                      title=figure_title(ctx, TITLE, isa=True))


def _add_args(parser):
    parser.add_argument("--only", choices=("paths", "rules", "lean"), default=None,
                        help="run one section: the op-level AdamW paths, or every rule's "
                             "formats under a GradScaler ('lean' is 'rules'; default: both)")
    return parser


if __name__ == "__main__":
    sys.exit(run_standalone(run, __doc__, _add_args))
