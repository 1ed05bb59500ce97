"""AdamW step: mpext's fused master-weight step (``adam_step_``) against native PyTorch AMP's
ways of stepping ``torch.optim.AdamW`` under a loss scaler, in the same run on the same device.
Method, paths, bytes counted and columns: benchmarks/README.md, "AdamW step".

    python -m benchmarks.bench_adam [--quick] [--device auto|cpu|cuda] [--only paths|lean]
"""
import math
import sys


import torch

import mpext  # loads the extension: registers torch.ops.mpext
from .common import (Alternate, Context, MiB, PhaseClock, Timing, check, combine_rooflines,
                    count_subnormals, expect_same, figure_title, fmt_count, fmt_ms, free_memory,
                    gpt2_shapes, load_average, markdown_table, payload_header, pct,
                    peak_memory_many, plot_lines, report_footer, require_kernel, results,
                    roofline_hlines, roofline_line, run_standalone, section_head)

NAME = "bench_adam"
TITLE = "AdamW step: mpext's fused step (master weights, lean state) vs PyTorch AMP"

BF16, FP32 = torch.bfloat16, torch.float32
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-2
EMA_DECAY = 0.999  # the lean section's EMA row and its native counterpart
GRAD_STD = 1e-3
PARAM_STD = 0.02

SPEED_TARGET = 1.3   # >= 1.3x the best native path at 16M+ params; reported, never asserted
COPY_TARGET = 0.80   # >= 80% of the copy (memcpy) roofline at 16M+ params; reported only
TARGET_MIN_PARAMS = 16 << 20
NOISE_RATIO = 0.95

# 8-bit moment paths: >= this many times the best native path and >= this fraction of the
# in-place roofline at 16M+ params (reported, never asserted)
Q8_TARGETS = {"mpext_q8_rem": 2.0, "mpext_q8_sr": 2.5}
Q8_INPLACE_TARGET = 0.80

SIZES_FULL = [1 << 20, 16 << 20, 64 << 20]
SIZES_QUICK = [1 << 20, 4 << 20, 16 << 20]

# key, label, bytes per param, mpext?
PATHS = [
    ("mpext", "mpext adam_step_ (bf16 p/g, fp32 master+m+v, inv_scale + found_inf)", 28, True),
    ("mpext_chk", "mpext unscale_ inf check (reads bf16 g) + adam_step_", 30, True),
    ("mpext_wb", "mpext check + adam_step_ writing the unscaled grads back (mpext.optim's default "
     "under a GradScaler)", 32, True),
    ("fused_gs", "torch GradScaler.step: inf check + AdamW(fused) with grad_scale/found_inf", 40,
     False),
    ("fused_un", "torch unscale_ + AdamW(fused) with found_inf", 36, False),
    ("foreach", "torch unscale_ + found_inf.item() + AdamW(foreach)", 88, False),
    # 8-bit moments: int8/uint8 codes (1 + 1 B read, 1 + 1 written; the scales add 8/256)
    ("mpext_q8_rem", "mpext check + adam_step_, bf16 remainder + 8-bit moments", 16, True),
    ("mpext_q8_sr", "mpext check + adam_step_, no master (SR) + 8-bit moments", 12, True),
]
PATH_LABEL = {k: lab for k, lab, _, _ in PATHS}
PATH_BYTES = {k: b for k, _, b, _ in PATHS}
NATIVE = [k for k, _, _, is_mp in PATHS if not is_mp]
SHORT = {"mpext": "mpext", "mpext_chk": "mpext + check", "mpext_wb": "mpext + check + grads back",
         "mpext_q8_rem": "mpext remainder + 8-bit", "mpext_q8_sr": "mpext SR + 8-bit",
         "fused_gs": "torch fused (GradScaler)",
         "fused_un": "torch unscale_ + fused", "foreach": "torch unscale_ + foreach"}


# ---------------------------------------------------------------------------------------------
# State of both sides for one list of shapes


class Problem:
    """The tensors of one benchmark case. mpext: bf16 params and grads, fp32 masters, moments and
    steps. torch: fp32 params and grads (the same starting values, shared by the native paths),
    one AdamW(fused=True) and one AdamW(foreach=True) over them, each with its own state."""

    def __init__(self, shapes, dev, seed):
        g = torch.Generator().manual_seed(seed)
        self.dev = dev
        self.numel = sum(math.prod(s) for s in shapes)
        self.p32 = [(torch.randn(s, generator=g) * PARAM_STD).to(dev).to(BF16).float()
                    for s in shapes]
        self.g32 = [(torch.randn(s, generator=g) * GRAD_STD).to(dev).to(BF16).float()
                    for s in shapes]
        self.p16 = [p.to(BF16) for p in self.p32]
        self.g16 = [gr.to(BF16) for gr in self.g32]
        self.masters = [p.clone() for p in self.p32]
        self.m = [torch.zeros_like(p) for p in self.p32]
        self.v = [torch.zeros_like(p) for p in self.p32]
        self.steps = [torch.zeros(1, dtype=FP32, device=dev) for _ in shapes]
        # the 8-bit moment paths: bf16 params of their own, with a zero remainder or none
        self.q8 = {}
        for key in Q8_TARGETS:
            self.q8[key] = dict(
                p=[p.clone() for p in self.p16],
                rem=[torch.zeros_like(p, dtype=torch.int16) for p in self.p16],
                m=[torch.zeros_like(p, dtype=torch.int8) for p in self.p16],
                v=[torch.zeros_like(p, dtype=torch.uint8) for p in self.p16],
                ms=[torch.zeros(-(-p.numel() // 256), device=dev) for p in self.p16],
                vs=[torch.zeros(-(-p.numel() // 256), device=dev) for p in self.p16],
                steps=[torch.zeros(1, dtype=FP32, device=dev) for _ in shapes])
        self.lr = torch.full((1,), LR, dtype=FP32, device=dev)
        self.found = torch.zeros((), dtype=FP32, device=dev)
        self.one = torch.ones((), dtype=FP32, device=dev)
        for p, gr in zip(self.p32, self.g32):
            p.grad = gr
        kw = dict(lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
        self.opt_fused = torch.optim.AdamW(self.p32, fused=True, **kw)
        self.opt_foreach = torch.optim.AdamW(self.p32, foreach=True, **kw)
        self.mpext_calls = 0
        # x0.5 / x2 in turn: inv_scale for mpext and the unscale passes; grad_scale (the fused
        # kernel divides by it) 2 / 0.5. Each alternator's net effect on the grads is x1 or x0.5.
        self.alt = {"mpext": Alternate(0.5, 2.0, dev), "mpext_chk": Alternate(0.5, 2.0, dev),
                    "mpext_wb": Alternate(0.5, 2.0, dev),
                    "fused_gs": Alternate(2.0, 0.5, dev), "fused_un": Alternate(0.5, 2.0, dev),
                    "foreach": Alternate(0.5, 2.0, dev)}
        self.alt.update({k: Alternate(0.5, 2.0, dev) for k in Q8_TARGETS})

    def fns(self):
        """key -> callable doing one step of that path."""
        adam = torch.ops.mpext.adam_step_
        unscale_mp = torch.ops.mpext.unscale_
        t_unscale = torch._amp_foreach_non_finite_check_and_unscale_
        p16, g16, m, v, ms, st, lr = self.p16, self.g16, self.m, self.v, self.masters, \
            self.steps, self.lr
        g32, found, one = self.g32, self.found, self.one
        alt = self.alt
        opt_f, opt_fe = self.opt_fused, self.opt_foreach

        def f_mpext():
            self.mpext_calls += 1
            adam(p16, g16, m, v, ms, st, lr, BETA1, BETA2, EPS, WEIGHT_DECAY, True, False,
                 inv_scale=alt["mpext"](), found_inf=found)

        def f_mpext_chk():
            self.mpext_calls += 1
            found.zero_()
            unscale_mp(g16, found, one)  # inv_scale 1: check only, nothing written
            adam(p16, g16, m, v, ms, st, lr, BETA1, BETA2, EPS, WEIGHT_DECAY, True, False,
                 inv_scale=alt["mpext_chk"](), found_inf=found)

        def f_mpext_wb():
            self.mpext_calls += 1
            found.zero_()
            unscale_mp(g16, found, one)
            adam(p16, g16, m, v, ms, st, lr, BETA1, BETA2, EPS, WEIGHT_DECAY, True, False,
                 inv_scale=alt["mpext_wb"](), found_inf=found, unscale_grads=True)

        def f_fused_gs():
            # torch.amp.GradScaler.step with a _step_supports_amp_scaling optimizer
            found.zero_()
            t_unscale(g32, found, one)  # _check_inf_per_device: dummy inv_scale 1.0
            opt_f.grad_scale = alt["fused_gs"]()
            opt_f.found_inf = found
            opt_f.step()
            del opt_f.grad_scale, opt_f.found_inf

        def f_fused_un():
            found.zero_()
            t_unscale(g32, found, alt["fused_un"]())  # scaler.unscale_(opt)
            opt_f.grad_scale = None
            opt_f.found_inf = found
            opt_f.step()
            del opt_f.grad_scale, opt_f.found_inf

        def f_foreach():
            found.zero_()
            t_unscale(g32, found, alt["foreach"]())  # scaler.unscale_(opt)
            if not found.item():  # GradScaler._maybe_opt_step
                opt_fe.step()

        def q8(key):
            q, sr = self.q8[key], key == "mpext_q8_sr"
            empty = torch.empty(0, dtype=FP32, device=self.dev)

            def f():
                found.zero_()
                unscale_mp(g16, found, one)
                adam(q["p"], g16, q["m"], q["v"], [] if sr else [empty] * len(g16), q["steps"],
                     lr, BETA1, BETA2, EPS, WEIGHT_DECAY, True, False,
                     inv_scale=alt[key](), found_inf=found,
                     remainders=None if sr else q["rem"], master_free=sr,
                     stochastic_rounding=sr, exp_avg_scales=q["ms"], exp_avg_sq_scales=q["vs"],
                     block_size=256)
            return f

        return {"mpext": f_mpext, "mpext_chk": f_mpext_chk, "mpext_wb": f_mpext_wb,
                "fused_gs": f_fused_gs,
                "fused_un": f_fused_un, "foreach": f_foreach,
                **{k: q8(k) for k in Q8_TARGETS}}

    def native_state(self):
        """Every fp32 tensor the native paths own (params, grads, both optimizers' moments)."""
        out = list(self.p32) + list(self.g32)
        for opt in (self.opt_fused, self.opt_foreach):
            for st in opt.state.values():
                out += [st["exp_avg"], st["exp_avg_sq"]]
        return out


def _after_timing_checks(prob):
    """No subnormals anywhere, found_inf still 0, mpext's steps advanced once per call."""
    check(float(prob.found) == 0.0, "found_inf became %r during timing (finite grads)"
          % float(prob.found))
    steps = {float(s) for s in prob.steps}
    check(steps == {float(prob.mpext_calls)}, "mpext step counts %s after %d calls"
          % (sorted(steps), prob.mpext_calls))
    for key, q in prob.q8.items():
        check(all(bool(p.isfinite().all()) for p in q["p"]), "%s: non-finite params" % key)
    mp = count_subnormals(prob.p16 + prob.g16 + prob.masters + prob.m + prob.v)
    nat = count_subnormals(prob.native_state())
    return {"subnormals_mpext": mp, "subnormals_torch": nat, "mpext_calls": prob.mpext_calls,
            "mpext_elements_checked": 5 * prob.numel,
            "torch_elements_checked": sum(t.numel() for t in prob.native_state())}


def _sanity(dev):
    """One step of every timed path on a small list against torch.optim.AdamW(foreach=False) on
    fp32 copies fed the same gradients, unscaled (each path's first call unscales by 0.5)."""
    shapes = [((1 << 20) + 3,), (300, 257), (17,)]
    for key in PATH_LABEL:
        prob = Problem(shapes, dev, seed=99)  # one per path: the native paths share tensors
        ref = [p.clone() for p in prob.p32]
        for p, g in zip(ref, prob.g32):
            p.grad = g * 0.5
        torch.optim.AdamW(ref, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY,
                          foreach=False).step()
        prob.fns()[key]()
        if key == "mpext_q8_rem":  # the first step uses the fp32 moments: as the master path
            q = prob.q8[key]
            got = [mpext.optim.formats.join_remainder(p, r) for p, r in zip(q["p"], q["rem"])]
            expect_same(key, got, ref, rtol=1e-5, atol=1e-8)
        elif key == "mpext_q8_sr":  # the param stochastically rounded: within one bf16 ulp
            expect_same(key, [p.float() for p in prob.q8[key]["p"]], ref, rtol=2.0 ** -7,
                        atol=1e-30)
        else:
            expect_same(key, prob.masters if key.startswith("mpext") else prob.p32, ref,
                        rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Lean optimizer state: the whole step as a user runs it, under a GradScaler at scale 1 (BF16
# training), in every storage mode of mpext.optim.AdamW, against native AMP's step and the in-place
# roofline in the same rounds.

LEAN_SIZES_FULL = [16 << 20, 64 << 20]
LEAN_SIZES_QUICK = [16 << 20]
# mpext.GradScaler's inf check at scale 1: mpext.ops.unscale_ with inv_scale 1 reads the bf16 grads
LEAN_CHECK_BYTES = 2
# key, label, mpext.optim.AdamW options, persistent B/param (param + grad + optimizer state),
# B/param the fused pass moves, targets (x native, fraction of the in-place roofline) or None
LEAN_MODES = [
    ("master", "fp32 master + fp32 moments (default)", {}, 16, 28, None),
    ("remainder", "remainder + fp32 moments", dict(param_remainders=True), 14, 26, None),
    ("remainder_bf16m", "remainder + bf16 moments",
     dict(param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), 10, 18, (1.6, 0.80)),
    ("sr_bf16m", "no master, SR + bf16 moments",
     dict(master_weights=False, stochastic_rounding=True, exp_avg_dtype=BF16,
          exp_avg_sq_dtype=BF16), 8, 14, (2.0, 0.80)),
    ("sr", "no master, SR + fp32 moments",
     dict(master_weights=False, stochastic_rounding=True), 12, 22, None),
    ("rne", "no master, round to nearest + fp32 moments (cautionary)",
     dict(master_weights=False), 12, 22, None),
    # the EMA reads and writes 4 + 4 B/param more in the same pass; compared with native + EMA
    ("remainder_bf16m_ema", "remainder + bf16 moments + fp32 EMA of the masters (vs native "
     "+ EMA)", dict(param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                    ema_decay=EMA_DECAY), 14, 26, None),
]
LEAN = {k: (lab, opts, state, step, tgt) for k, lab, opts, state, step, tgt in LEAN_MODES}
# The native steps each mode is compared with: key -> (label, persistent B/param, step B/param).
# torch.amp.GradScaler.step + AdamW(fused=True) on fp32 params: the inf check reads and writes
# back the fp32 grads (8), the fused kernel reads param, grad, m, v and writes param, m, v and
# the unscaled grad (32). Persistent: fp32 param, grad, m, v. With an EMA, what
# AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay)).update_parameters runs after the step:
# torch._foreach_lerp_ on an fp32 copy (reads the copy and the param, writes the copy: 12).
LEAN_NATIVE = {
    "native": ("torch.amp.GradScaler + AdamW(fused=True), fp32 params", 16, 40),
    "native_ema": ("the same + fp32 EMA (torch._foreach_lerp_, AveragedModel's EMA)", 20, 52),
}


def _lean_baseline(key):
    """The native step a lean mode is compared with: with an EMA, native's with one."""
    return "native_ema" if "ema_decay" in LEAN[key][1] else "native"


def _lean_bound(key):
    """The bytes bound of a lean mode: its baseline's step bytes over its own."""
    return LEAN_NATIVE[_lean_baseline(key)][2] / (LEAN[key][3] + LEAN_CHECK_BYTES)


class LeanProblem:
    """One lean-state case of ``n`` params. Per mpext mode: a bf16 param (the same starting
    values for all) with its own ``mpext.optim.AdamW`` (the mode's options) and
    ``mpext.GradScaler(bf16_check_only=True)`` (scale held at 1); the bf16 gradient is one
    tensor shared by all modes, which nothing writes at scale 1. Native: an fp32 copy of the
    param and gradient under ``torch.optim.AdamW(fused=True)`` and
    ``torch.amp.GradScaler(init_scale=1)`` (no growth: the scale stays 1). ``roof_numel``: the
    buffer of the in-place roofline, timed in the same rounds (0: none)."""

    def __init__(self, n, dev, seed, roof_numel=0):
        gen = torch.Generator().manual_seed(seed)
        p0 = (torch.randn(n, generator=gen) * PARAM_STD).to(BF16)
        g0 = (torch.randn(n, generator=gen) * GRAD_STD).to(BF16)
        self.n, self.dev = n, dev
        self.grad = g0.to(dev)
        kw = dict(lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
        self.steppers = {}  # key -> (param, optimizer, scaler)
        for key, (_, opts, _, _, _) in LEAN.items():
            p = p0.to(dev, copy=True)
            p.grad = self.grad
            self.steppers[key] = (p, mpext.optim.AdamW([p], **kw, **opts),
                                  mpext.GradScaler(dev.type, bf16_check_only=True))
        for key in LEAN_NATIVE:
            p32 = p0.to(dev, FP32)
            p32.grad = g0.to(dev, FP32)
            self.steppers[key] = (p32, torch.optim.AdamW([p32], fused=True, **kw),
                                  torch.amp.GradScaler(dev.type, init_scale=1.0,
                                                       growth_interval=1 << 30))
        self.native_ema = []  # native_ema's fp32 EMA: a copy of the param after its first step
        for _, _, scaler in self.steppers.values():
            scaler.scale(torch.ones((), device=dev))  # makes the scale, as scaling a loss does
        self.calls = {k: 0 for k in self.steppers}
        self.roof = torch.zeros(roof_numel, dtype=FP32, device=dev) if roof_numel else None

    def fns(self):
        """key -> one training step's optimizer part: ``scaler.step(opt); scaler.update()``;
        plus ``inplace`` (``x.add_(0.5)`` on the roofline buffer) when there is one."""
        def stepper(key):
            _, opt, scaler = self.steppers[key]

            def f():
                self.calls[key] += 1
                scaler.step(opt)
                scaler.update()
            if key != "native_ema":
                return f
            p = self.steppers[key][0]

            def f_ema():  # AveragedModel's EMA update, after an applied step (always, at scale 1)
                f()
                if self.native_ema:
                    torch._foreach_lerp_(self.native_ema, [p.detach()], 1.0 - EMA_DECAY)
                else:
                    self.native_ema.append(p.detach().clone())
            return f_ema
        out = {k: stepper(k) for k in self.steppers}
        if self.roof is not None:
            buf = self.roof
            out["inplace"] = lambda: buf.add_(0.5)
        return out

    def after_timing_checks(self):
        """Every step was taken (none skipped), the scales are still 1, the shared gradient was
        never written, and no state went non-finite or subnormal."""
        for key, (p, opt, scaler) in self.steppers.items():
            st = opt.state[p]
            check(float(st["step"]) == self.calls[key], "%s: step count %s after %d calls"
                  % (key, float(st["step"]), self.calls[key]))
            check(scaler.get_scale() == 1.0, "%s: the loss scale left 1" % key)
            if isinstance(scaler, mpext.GradScaler):
                check(int(scaler.skipped_steps()) == 0, "%s: skipped steps" % key)
            tensors = [p] + [v for v in st.values() if isinstance(v, torch.Tensor)
                             and v.numel() == p.numel() and v.is_floating_point()]
            check(all(bool(t.isfinite().all()) for t in tensors), "%s: non-finite state" % key)
        check(bool(self.grad.equal(self.steppers["native"][0].grad.to(BF16))),
              "the shared bf16 gradient was written")
        check(bool(self.native_ema[0].isfinite().all()), "native_ema: non-finite EMA")
        tensors = [t for p, opt, _ in self.steppers.values() for t in
                   [p] + [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)
                          and v.is_floating_point() and v.numel() == p.numel()]]
        return {"calls": dict(self.calls), "subnormals": count_subnormals(tensors),
                "elements_checked": sum(t.numel() for t in tensors)}


def _lean_sanity(dev):
    """One step of every lean case's stepper on 1M + 3 params against
    torch.optim.AdamW(foreach=False) on fp32 copies fed the same gradient: the fp32-master
    mode's master within rtol 1e-5 of the reference and the remainder mode's master and param
    the same bits; every other mode's param and moments within one bf16 ulp of the reference's
    (stochastic or nearest rounding of the same fp32 values); native's param within rtol 1e-5;
    the gradient unchanged (scale 1: nothing is written back)."""
    prob = LeanProblem((1 << 20) + 3, dev, seed=98)
    p_ref = prob.steppers["native"][0].detach().clone()
    p_ref.grad = prob.steppers["native"][0].grad.clone()
    ref_opt = torch.optim.AdamW([p_ref], lr=LR, betas=(BETA1, BETA2), eps=EPS,
                                weight_decay=WEIGHT_DECAY, foreach=False)
    ref_opt.step()
    ref_state = ref_opt.state[p_ref]
    g_before = prob.grad.clone()
    for f in prob.fns().values():
        f()
    expect_same("lean: native", prob.steppers["native"][0], p_ref, rtol=1e-5, atol=1e-8)
    # after the first step an EMA is a copy of the value: mpext's of the (joined) master
    expect_same("lean: native EMA", prob.native_ema[0], p_ref, rtol=1e-5, atol=1e-8)
    p_e, opt_e, _ = prob.steppers["remainder_bf16m_ema"]
    expect_same("lean: EMA", opt_e.ema_param(p_e), p_ref, rtol=1e-5, atol=1e-8)
    p_m, opt_m, _ = prob.steppers["master"]
    expect_same("lean: master", opt_m.master_param(p_m), p_ref, rtol=1e-5, atol=1e-8)
    p_r, opt_r, _ = prob.steppers["remainder"]
    expect_same("lean: remainder vs master (bits)", [p_r, opt_r.master_param(p_r)],
                [p_m, opt_m.master_param(p_m)])
    ulp = dict(rtol=2.0 ** -7, atol=1e-30)  # one bf16 ulp of the value at most
    for key in LEAN:
        p, opt, _ = prob.steppers[key]
        st = opt.state[p]
        expect_same("lean: %s param" % key, p.float(), p_ref, **ulp)
        expect_same("lean: %s moments" % key, [st["exp_avg"].float(), st["exp_avg_sq"].float()],
                    [ref_state["exp_avg"], ref_state["exp_avg_sq"]], **ulp)
    expect_same("lean: the gradient at scale 1", prob.grad, g_before)


def _lean_metrics(times, n, roof_numel, roof):
    """Per lean mode and native: timing, bytes, GB/s, speed vs native, the bytes bound, the
    fractions of the in-place roofline timed in the same rounds and of the run's best."""
    inplace_same = times["inplace"].gbps(8.0 * roof_numel)
    out = {"params": n, "inplace_gbps_same_rounds": inplace_same,
           "inplace": times["inplace"].to_json(), "modes": {}}
    for key in list(LEAN) + list(LEAN_NATIVE):
        if key in LEAN_NATIVE:
            label, state, step = LEAN_NATIVE[key]
            target, base = None, "native"
        else:
            label, _, state, fused, target = LEAN[key]
            step = fused + LEAN_CHECK_BYTES
            base = _lean_baseline(key)
        t = times[key]
        gb = t.gbps(step * n)
        row = {"label": label, "state_bytes_per_param": state, "step_bytes_per_param": step,
               "timing": t.to_json(), "ns_per_param": t.median / n * 1e9, "gbps": gb,
               "baseline": base, "speedup_vs_native": times[base].median / t.median,
               "bytes_bound_vs_native": LEAN_NATIVE[base][2] / step,
               "frac_inplace_same_rounds": gb / inplace_same,
               "frac_inplace_best": gb / roof["inplace_gbps"],
               "target": target}
        if target is not None:
            row["target_speed_met"] = row["speedup_vs_native"] >= target[0]
            row["target_roofline_met"] = row["frac_inplace_same_rounds"] >= target[1]
        out["modes"][key] = row
    return out


def _lean_report(lean):
    """The lean section's Markdown lines and its missed targets."""
    headers = ["params", "mode", "state B/param", "step B/param", "ms", "GB/s",
               "% in-place (same rounds)", "% in-place (best)", "vs native", "bytes bound",
               "target", "met"]
    rows, misses = [], []
    for size, mtr in lean.items():
        for key in list(LEAN) + list(LEAN_NATIVE):
            m = mtr["modes"][key]
            tgt = m["target"]
            met = ""
            if tgt is not None:
                ok = m["target_speed_met"] and m["target_roofline_met"]
                met = "yes" if ok else "**no**"
                if not m["target_speed_met"]:
                    misses.append("lean %s, %s params: %.2fx native (target %.1fx)"
                                  % (key, fmt_count(int(size)), m["speedup_vs_native"], tgt[0]))
                if not m["target_roofline_met"]:
                    misses.append("lean %s, %s params: %s of the in-place roofline (target %s)"
                                  % (key, fmt_count(int(size)),
                                     pct(m["frac_inplace_same_rounds"]), pct(tgt[1])))
            rows.append([fmt_count(int(size)) if key == "master" else "", m["label"],
                         str(m["state_bytes_per_param"]), str(m["step_bytes_per_param"]),
                         fmt_ms(Timing.from_json(m["timing"])), "%.1f" % m["gbps"],
                         pct(m["frac_inplace_same_rounds"]), pct(m["frac_inplace_best"]),
                         "—" if key == "native" else "%.2fx" % m["speedup_vs_native"],
                         "—" if key == "native" else "%.2fx" % m["bytes_bound_vs_native"],
                         "" if tgt is None else "≥ %.1fx, ≥ %s" % (tgt[0], pct(tgt[1])), met])
        t_in = Timing.from_json(mtr["inplace"])
        rows.append(["", "in-place roofline x.add_(0.5) (same rounds)", "", "8",
                     fmt_ms(t_in), "%.1f" % mtr["inplace_gbps_same_rounds"], "100%", "", "", "",
                     "", ""])
    md = ["### Lean optimizer state under a GradScaler (scale 1, BF16 training)", "",
          "`scaler.step(opt); scaler.update()` with `mpext.GradScaler(bf16_check_only=True)` "
          "and `mpext.optim.AdamW` in each storage mode (bf16 params and grads), against "
          "`torch.amp.GradScaler(init_scale=1)` with `torch.optim.AdamW(fused=True)` on fp32 "
          "params, and the in-place roofline, all interleaved in the same rounds. Step bytes "
          "include the inf check (mpext: a read of the bf16 grads, 2; torch: a read and "
          "write-back of the fp32 grads, 8); \"bytes bound\" = native's 40 / the mode's bytes. "
          "The EMA row is compared with native + an fp32 EMA updated as AveragedModel's "
          "get_ema_multi_avg_fn does (torch._foreach_lerp_ after the step: 52 bytes); that "
          "row's own \"vs native\" is its cost over native without one. "
          "Method: benchmarks/README.md, \"Lean optimizer state\".", "",
          markdown_table(headers, rows)]
    return md, misses


# ---------------------------------------------------------------------------------------------
# Benchmark


def _case_metrics(times, n, roof, peaks=None):
    """Per path: timing, bytes, GB/s, fractions of both rooflines, ratio mpext / path."""
    best_native = min(NATIVE, key=lambda k: times[k].median)
    out = {"params": n, "best_native": best_native, "paths": {}}
    for key in times:
        t = times[key]
        nbytes = PATH_BYTES[key] * n
        gb = t.gbps(nbytes)
        out["paths"][key] = {
            "label": PATH_LABEL[key],
            "bytes_per_param": PATH_BYTES[key],
            "bytes": nbytes,
            "timing": t.to_json(),
            "ns_per_param": t.median / n * 1e9,
            "gbps": gb,
            "frac_inplace_roofline": gb / roof["inplace_gbps"],
            "frac_copy_roofline": gb / roof["copy_gbps"],
            "mpext_speedup": times[key].median / times["mpext"].median,
            "peak_bytes": (peaks or {}).get(key),
        }
    t_best = times[best_native].median
    out["speedup_vs_best_native"] = t_best / times["mpext"].median
    out["speedup_with_check_vs_best_native"] = t_best / times["mpext_chk"].median
    # the ratio if both sides moved their bytes at the same bandwidth
    out["bytes_bound_vs_best_native"] = PATH_BYTES[best_native] / PATH_BYTES["mpext"]
    return out


def run(ctx: Context) -> dict:
    dev = ctx.device
    require_kernel(dev, "adam_step_")
    only = getattr(ctx.args, "only", None)  # None (run_all): both sections
    do_paths, do_lean = only in (None, "paths"), only in (None, "lean")
    sizes = (SIZES_QUICK if ctx.quick else SIZES_FULL) if do_paths else []
    lean_sizes = (LEAN_SIZES_QUICK if ctx.quick else LEAN_SIZES_FULL) if do_lean else []
    load_start = load_average()
    phase = PhaseClock()
    phases = phase.times

    roof_start = ctx.roofline()
    phase("roofline")
    if do_paths:
        _sanity(dev)
    if do_lean:
        _lean_sanity(dev)
    phase("correctness")

    raw = {}      # case key -> (times, numel, peaks)
    drift = {}
    gpt_shapes = [shape for _, shape in gpt2_shapes(reduced=ctx.quick)]
    cases = [(str(n), "1 tensor", [(n,)]) for n in sizes]
    if do_paths:
        cases.append(("gpt2", "GPT-2 %s list" % ("reduced" if ctx.quick else "small"),
                      gpt_shapes))
    bar = ctx.progress(total=len(cases), desc="adam cases")
    with bar:
        for ci, (key, label, shapes) in enumerate(cases):
            prob = Problem(shapes, dev, seed=ci)
            fns = prob.fns()
            peaks = None
            if key == str(sizes[-1]):  # peak memory at the largest single size
                for f in fns.values():  # create the optimizers' state first
                    f()
                peaks = peak_memory_many(fns, dev)
            times = ctx.time_fns(fns, desc="%s (%s params)" % (label,
                                                               fmt_count(prob.numel)))
            drift[key] = _after_timing_checks(prob)
            raw[key] = (times, prob.numel, peaks)
            del prob, fns
            free_memory(dev)
            bar.update(1)
            phase("case_" + key)
    lean_raw, lean_checks = {}, {}
    roof_numel = roof_start["numel"]
    for ci, n in enumerate(lean_sizes):
        prob = LeanProblem(n, dev, seed=100 + ci, roof_numel=roof_numel)
        times = ctx.time_fns(prob.fns(), desc="lean state (%s params)" % fmt_count(n))
        lean_checks[str(n)] = prob.after_timing_checks()
        lean_raw[str(n)] = times
        del prob
        free_memory(dev)
        phase("lean_" + str(n))
    roof = combine_rooflines(roof_start, ctx.roofline())
    phase("roofline_end")
    metrics = {k: _case_metrics(t, n, roof, pk) for k, (t, n, pk) in raw.items()}
    lean = {k: _lean_metrics(t, int(k), roof_numel, roof) for k, t in lean_raw.items()}
    seconds = phase.elapsed()
    load_end = load_average()

    # ---- report
    case_label = {k: ("%s params, 1 tensor" % fmt_count(int(k)) if k != "gpt2" else
                      "GPT-2 %s list: %.1fM params, %d tensors"
                      % ("reduced (4 layers, 8K vocab)" if ctx.quick else "small",
                         metrics[k]["params"] / 1e6, len(gpt_shapes)))
                  for k in metrics}
    headers = ["case", "path", "B/param", "ms", "ns/param", "GB/s", "% in-place roof",
               "% copy roof", "mpext speedup", "cores busy", "peak MiB"]
    rows = []
    for k, mtr in metrics.items():
        for pk, *_ in PATHS:
            m = mtr["paths"][pk]
            best = " (best native)" if pk == mtr["best_native"] else ""
            rows.append([case_label[k] if pk == "mpext" else "", SHORT[pk] + best,
                         str(m["bytes_per_param"]), fmt_ms(Timing.from_json(m["timing"])),
                         "%.3g" % m["ns_per_param"], "%.1f" % m["gbps"],
                         pct(m["frac_inplace_roofline"]), pct(m["frac_copy_roofline"]),
                         # the 8-bit paths are mpext's own: the 8-bit table compares them
                         "—" if pk == "mpext" or pk in Q8_TARGETS
                         else "%.2fx" % m["mpext_speedup"],
                         "" if m["timing"]["cpu_busy"] is None else
                         "%.1f" % m["timing"]["cpu_busy"],
                         "" if m["peak_bytes"] is None else "%.0f" % (m["peak_bytes"] / MiB)])

    sum_headers = ["case", "best native path", "mpext vs best native",
                   "bytes bound", "mpext + check vs best native",
                   "mpext vs GradScaler.step + fused", "mpext GB/s", "% copy roof",
                   "% in-place roof", "≥ %.1fx" % SPEED_TARGET,
                   "≥ %d%% copy" % round(100 * COPY_TARGET)]
    sum_rows, misses = [], []
    for k, mtr in metrics.items():
        mp = mtr["paths"]["mpext"]
        targeted = mtr["params"] >= TARGET_MIN_PARAMS
        sp, fc = mtr["speedup_vs_best_native"], mp["frac_copy_roofline"]
        if targeted:
            sp_ok, fc_ok = sp >= SPEED_TARGET, fc >= COPY_TARGET
            if not sp_ok:
                misses.append("%s: mpext %.2fx the best native path" % (case_label[k], sp))
            if not fc_ok:
                misses.append("%s: mpext at %s of the copy roofline" % (case_label[k], pct(fc)))
            mtr["target_speed_met"], mtr["target_copy_met"] = sp_ok, fc_ok
        else:
            mtr["target_speed_met"] = mtr["target_copy_met"] = None
        sum_rows.append([case_label[k], SHORT[mtr["best_native"]], "%.2fx" % sp,
                         "%.2fx" % mtr["bytes_bound_vs_best_native"],
                         "%.2fx" % mtr["speedup_with_check_vs_best_native"],
                         "%.2fx" % mtr["paths"]["fused_gs"]["mpext_speedup"],
                         "%.1f" % mp["gbps"], pct(fc), pct(mp["frac_inplace_roofline"]),
                         "—" if not targeted else ("yes" if sp_ok else "**no**"),
                         "—" if not targeted else ("yes" if fc_ok else "**no**")])

    q8_headers = ["case", "8-bit path", "B/param", "vs best native", "bytes bound",
                  "ns/param", "ns/param for the target x", "% in-place roof", "≥ target x",
                  "≥ %d%% in-place" % round(100 * Q8_INPLACE_TARGET)]
    q8_rows = []
    for k, mtr in metrics.items():
        t_best = Timing.from_json(mtr["paths"][mtr["best_native"]]["timing"]).median
        targeted = mtr["params"] >= TARGET_MIN_PARAMS
        for qk, target in Q8_TARGETS.items():
            m = mtr["paths"][qk]
            sp = t_best / Timing.from_json(m["timing"]).median
            fi = m["frac_inplace_roofline"]
            m["speedup_vs_best_native"] = sp
            m["target"] = (target, Q8_INPLACE_TARGET)
            # the time per param the speed target allows, against this path's own: where the
            # path takes as long with its arrays in cache (the 1M row) as from memory, the gap
            # is its instruction count, not its bytes
            m["target_ns_per_param"] = mtr["paths"][mtr["best_native"]]["ns_per_param"] / target
            if targeted:
                m["target_speed_met"] = sp >= target
                m["target_inplace_met"] = fi >= Q8_INPLACE_TARGET
                if not m["target_speed_met"]:
                    misses.append("%s: %s %.2fx the best native path (target %.1fx)"
                                  % (case_label[k], SHORT[qk], sp, target))
                if not m["target_inplace_met"]:
                    misses.append("%s: %s at %s of the in-place roofline"
                                  % (case_label[k], SHORT[qk], pct(fi)))
            q8_rows.append([case_label[k], SHORT[qk], str(PATH_BYTES[qk]), "%.2fx" % sp,
                            "%.2fx" % (PATH_BYTES[mtr["best_native"]] / PATH_BYTES[qk]),
                            "%.3g" % m["ns_per_param"], "%.3g" % m["target_ns_per_param"],
                            pct(fi), "—" if not targeted else
                            ("%.1fx: %s" % (target, "yes" if sp >= target else "**no**")),
                            "—" if not targeted else
                            ("yes" if fi >= Q8_INPLACE_TARGET else "**no**")])

    sub = sum(d["subnormals_mpext"] + d["subnormals_torch"] for d in drift.values())
    md = section_head(ctx, TITLE)
    cores = ctx.machine.get("cpu_affinity") or ctx.machine.get("cpu_count") or 1
    if load_start and load_end:
        busy = max(load_start[0], load_end[0]) > 0.5 * cores
        md += ["1-minute load average at the start / end of this benchmark: %.2f / %.2f on %d "
               "cores%s" % (load_start[0], load_end[0], cores,
                            ": **other processes shared the cores**, so on lists the ratios "
                            "overstate mpext's lead (benchmarks/README.md, \"AdamW step\")."
                            if busy else "."), ""]
    md += [roofline_line(roof), ""]
    if do_paths:
        md += [markdown_table(sum_headers, sum_rows), "",
               "8-bit moments (docs/moments_8bit.md): the step with mpext's read-only inf check, "
               "against the best native path of the same rounds; \"ns/param for the target\" is "
               "the best native path's time per param over the target ratio. A path that takes "
               "as long per param on the smallest case (arrays in cache) as on the largest is "
               "bound by its instructions, not by memory.", "",
               markdown_table(q8_headers, q8_rows), "",
               markdown_table(headers, rows), "",
               "%d samples per path; after the timings %d subnormal values in all states (%s "
               "elements checked), found_inf 0, mpext steps = calls. Method, paths, bytes "
               "counted and columns: benchmarks/README.md, \"AdamW step\"."
               % (ctx.repeats, sub,
                  "{:,}".format(sum(d["mpext_elements_checked"] + d["torch_elements_checked"]
                                    for d in drift.values()))),
               ""]
    if do_lean:
        lean_md, lean_misses = _lean_report(lean)
        misses += lean_misses
        md += lean_md + ["",
                         "%d samples per row, the rows of a size interleaved; after the timings "
                         "every step taken (none skipped), scales 1, the shared gradient "
                         "unwritten, %d subnormal values (%s elements checked)."
                         % (ctx.repeats, sum(c["subnormals"] for c in lean_checks.values()),
                            "{:,}".format(sum(c["elements_checked"]
                                              for c in lean_checks.values()))), ""]
    md += report_footer(NAME, misses, seconds, phases)
    markdown = "\n".join(md)

    payload = {
        **payload_header(ctx, NAME, TITLE, dev, seconds, phases, roof),
        "hyperparameters": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS,
                            "weight_decay": WEIGHT_DECAY, "grad_std": GRAD_STD},
        "paths": {k: {"label": lab, "bytes_per_param": b} for k, lab, b, _ in PATHS},
        "speed_target": SPEED_TARGET,
        "copy_target_fraction": COPY_TARGET,
        "target_min_params": TARGET_MIN_PARAMS,
        "cases": {k: dict(v, label=case_label[k]) for k, v in metrics.items()},
        "after_timing_checks": drift,
        "lean_modes": {k: {"label": lab, "options": {o: str(v) for o, v in opts.items()},
                           "state_bytes_per_param": st,
                           "step_bytes_per_param": b + LEAN_CHECK_BYTES, "target": tgt}
                       for k, (lab, opts, st, b, tgt) in LEAN.items()},
        "lean": lean,
        "lean_after_timing_checks": lean_checks,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "targets_missed": misses,
    }
    return results(ctx, NAME, markdown, payload, seconds, misses,
                   lambda: _plot(ctx, sizes, metrics, roof, lean))


def _plot(ctx, sizes, metrics, roof, lean):
    keys = [str(n) for n in sizes]
    hl = roofline_hlines(roof, COPY_TARGET)
    panels = []
    if keys:
        gb = {SHORT[p]: (sizes, [metrics[k]["paths"][p]["gbps"] for k in keys])
              for p, *_ in PATHS}
        ns = {SHORT[p]: (sizes, [metrics[k]["paths"][p]["ns_per_param"] for k in keys])
              for p, *_ in PATHS}
        panels += [{"title": "bandwidth (bytes counted per path / median time)",
                    "xlabel": "params", "ylabel": "GB/s", "logx": True, "series": gb,
                    "hlines": hl},
                   {"title": "time per parameter", "xlabel": "params", "ylabel": "ns / param",
                    "logx": True, "series": ns}]
    if lean:
        ls = [int(k) for k in lean]
        modes = list(LEAN) + ["native"]
        label = lambda k: lean[str(ls[0])]["modes"][k]["label"]  # noqa: E731
        panels += [{"title": "lean state: speed vs native (lines: bytes bounds)",
                    "xlabel": "params", "ylabel": "x native", "logx": True,
                    "series": {label(k): (ls, [lean[str(n)]["modes"][k]["speedup_vs_native"]
                                               for n in ls]) for k in modes},
                    "hlines": {"bound %s %.2fx" % (k, _lean_bound(k)): _lean_bound(k)
                               for k in ("remainder_bf16m", "sr_bf16m")}},
                   {"title": "lean state: fraction of in-place roofline (same rounds)",
                    "xlabel": "params", "ylabel": "fraction", "logx": True,
                    "series": {label(k): (ls, [lean[str(n)]["modes"][k]
                                               ["frac_inplace_same_rounds"] for n in ls])
                               for k in modes},
                    "hlines": {"80%": 0.8}}]
    return plot_lines(ctx.out_dir / (NAME + ".png"), panels,
                      title=figure_title(ctx, TITLE, isa=True))


def _add_args(parser):
    parser.add_argument("--only", choices=("paths", "lean"), default=None,
                        help="run one section: the op-level paths, or the lean-state modes "
                             "under a GradScaler (default: both)")
    return parser


def main(argv=None):
    return run_standalone(run, __doc__, _add_args, argv)


if __name__ == "__main__":
    sys.exit(main())
