"""mpext.ops.adam_step_ and mpext.optim.Adam / AdamW.

The op is checked against a float64 reference of the published algorithm (tests/reference.py)
and against torch.optim's own single-tensor Adam/AdamW; the optimizers run differentially
against torch.optim.Adam / AdamW (foreach=False) for 1,000 steps with LR schedules, with FP32
params (within rtol 1e-5) and BF16/FP16 params (the FP32 master tracks torch's FP32 optimizer fed
the same upcast gradients, and the param is the master rounded, bit for bit). Then the loss
scaling contract (fused unscale, on-device skip, no host sync) under both GradScalers, state
dicts in both directions, param groups, and bad input (a clear error, nothing modified)."""
import contextlib
import copy
import inspect
import io
import pickle
import re

import numpy as np
import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import Adam, AdamW

from conftest import CUDA_OK, HostReads, device_cases
from optim_table import (allow_any_grad_dtype, assert_bits as assert_bitwise, assert_opt_unchanged,
                         assert_opts_bitwise, bits, opt_tensors, snapshot_opt)
from reference import adam_step_reference

NAN, INF = float("nan"), float("inf")
LOW = (torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Helpers.


def clones(ts):
    return [t.detach().clone() for t in ts]


@contextlib.contextmanager
def count_calls(monkeypatch):
    """Records the arguments of every adam_step_ call the optimizers make."""
    real = torch.ops.mpext.adam_step_
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.mpext, "adam_step_", spy)
    try:
        yield calls
    finally:
        monkeypatch.setattr(torch.ops.mpext, "adam_step_", real)


# --------------------------------------------------------------------------------------------
# The op against the float64 reference.

# (param dtype, grad dtype, numel): every dtype pair, odd sizes, empty and single elements.
OP_LAYOUT = [(torch.float32, torch.float32, 1037), (torch.bfloat16, torch.bfloat16, 515),
             (torch.bfloat16, torch.float32, 77), (torch.float16, torch.float16, 333),
             (torch.float16, torch.float32, 1), (torch.float32, torch.float32, 0),
             (torch.bfloat16, torch.bfloat16, 0), (torch.float32, torch.float32, 4099)]

OP_HYPER = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                  maximize=False),
    "adam_l2": dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                    decoupled=False, maximize=False),
    "maximize": dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01,
                     decoupled=True, maximize=True),
    # A large eps at early steps tells "eps after dividing by sqrt(bias_correction2)" apart
    # from "eps before" by several percent.
    "big_eps": dict(lr=1e-2, beta1=0.5, beta2=0.9, eps=1e-2, weight_decay=0.0, decoupled=False,
                    maximize=False),
    "zero_betas": dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0,
                       decoupled=True, maximize=False),
}


def op_case(device, layout=OP_LAYOUT, seed=0, misalign=False, grad_scale=1.0):
    """Lists for one adam_step_ call with random state; misalign puts every tensor one element
    into a larger buffer (addresses not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)

    def make(n, dtype, scale=1.0, positive=False):
        t = torch.rand(n, generator=gen) if positive else torch.randn(n, generator=gen)
        t = (t * scale).to(dtype)
        if misalign:
            buf = torch.empty(n + 1, dtype=dtype)
            buf[1:].copy_(t)
            t = buf[1:]
        return t.to(device) if device != "cpu" else t

    params, grads, ms, vs, masters, steps = [], [], [], [], [], []
    for k, (pdt, gdt, n) in enumerate(layout):
        master = make(n, torch.float32)
        params.append(master.to(pdt) if pdt != torch.float32 else master)
        g = make(n, gdt)
        if grad_scale != 1.0:  # scaled in place, so that unscaling gives g back exactly
            g.copy_(g.float() * grad_scale)
        grads.append(g)
        ms.append(make(n, torch.float32, 0.1))
        vs.append(make(n, torch.float32, 0.01, positive=True))
        masters.append(master.clone() if pdt != torch.float32 else
                       torch.empty(0, device=device))
        steps.append(torch.full((), float([0, 4, 999][k % 3]), device=device))
    return params, grads, ms, vs, masters, steps


def run_op(case, hp, inv_scale=None, found_inf=None):
    params, grads, ms, vs, masters, steps = case
    ops.adam_step_(params, grads, ms, vs, masters, steps, hp["lr"], hp["beta1"], hp["beta2"],
                   hp["eps"], hp["weight_decay"], hp["decoupled"], hp["maximize"],
                   inv_scale=inv_scale, found_inf=found_inf)


def check_against_reference(device, hp, misalign=False, inv=1.0):
    case = op_case(device, misalign=misalign, grad_scale=1.0 / inv)
    before = [clones(lst) for lst in case]
    inv_t = None if inv == 1.0 else torch.full((), inv, device=device)
    run_op(case, hp, inv_scale=inv_t)
    params, grads, ms, vs, masters, steps = case
    lr32 = float(np.float32(hp["lr"]))  # the op reads lr from a float32 tensor
    for i, (pdt, gdt, n) in enumerate(OP_LAYOUT):
        low = pdt != torch.float32
        old_p = before[4][i] if low else before[0][i]
        p, m, v, t = adam_step_reference(
            old_p.cpu().numpy(), before[1][i].float().cpu().numpy(), before[2][i].cpu().numpy(),
            before[3][i].cpu().numpy(), before[5][i].item(), lr32, hp["beta1"], hp["beta2"],
            hp["eps"], hp["weight_decay"], hp["decoupled"], hp["maximize"], inv)
        new_p = masters[i] if low else params[i]
        what = "param %d (%s/%s)" % (i, pdt, gdt)
        for got, want, name in ((new_p, p, "param"), (ms[i], m, "exp_avg"),
                                (vs[i], v, "exp_avg_sq")):
            want = torch.from_numpy(np.asarray(want, dtype=np.float64))
            # fp32 rounding: relative to each value, plus a few ulps of the tensor's scale for
            # values that come out of a cancellation (m + w * (g - m) near zero).
            scale = float(want.abs().max()) if want.numel() else 0.0
            torch.testing.assert_close(got.cpu().double(), want, rtol=2e-6, atol=2e-7 * scale,
                                       msg=lambda s: "%s %s: %s" % (what, name, s))
        assert steps[i].item() == t
        if low:  # the param is the master, rounded to nearest even
            assert_bitwise(params[i], masters[i].to(pdt), what)


@pytest.mark.parametrize("hyper", sorted(OP_HYPER))
def test_op_matches_float64_reference(device, hyper):
    check_against_reference(device, OP_HYPER[hyper])


@pytest.mark.parametrize("hyper", ["adamw", "adam_l2"])
def test_op_every_isa_path(isa, hyper):
    check_against_reference("cpu", OP_HYPER[hyper], misalign=True)
    check_against_reference("cpu", OP_HYPER[hyper], inv=2.0 ** -10)


def test_op_isa_paths_are_bitwise_identical():
    """The vector paths round every operation as the scalar path does (no contraction into
    FMAs), so every supported path gives the same bits."""
    previous = mpext.cpu_isa()
    results = {}
    try:
        for name in mpext.build_info()["cpu_isas_supported"]:
            mpext.set_cpu_isa(name)
            for misalign in (False, True):
                case = op_case("cpu", misalign=misalign, seed=3)
                for hp in OP_HYPER.values():
                    run_op(case, hp, inv_scale=torch.full((), 0.25))
                results[(name, misalign)] = [t for lst in case for t in lst]
    finally:
        mpext.set_cpu_isa(previous)
    ref = results[("scalar", False)]
    for key, got in results.items():
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(bits(a), bits(b)), "%s: tensor %d differs" % (key, i)


def test_op_matches_torch_single_tensor_step(device):
    """One step from the same state: the fp32 master/param updated by the op and by
    torch.optim.AdamW / Adam (foreach=False) on fp32 copies agree to float32 rounding."""
    for cls, hp in ((torch.optim.AdamW, OP_HYPER["adamw"]), (torch.optim.Adam,
                                                              OP_HYPER["adam_l2"]),
                    (torch.optim.Adam, OP_HYPER["big_eps"])):
        case = op_case(device, seed=5)
        params, grads, ms, vs, masters, steps = case
        refs = []
        for i, (pdt, _, _) in enumerate(OP_LAYOUT):
            w = (masters[i] if pdt != torch.float32 else params[i]).detach().clone()
            w.grad = grads[i].float().clone()
            refs.append(w)
        topt = cls(refs, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                   weight_decay=hp["weight_decay"], maximize=hp["maximize"], foreach=False)
        for i, w in enumerate(refs):
            topt.state[w] = {"step": steps[i].detach().cpu().clone(),
                             "exp_avg": ms[i].clone(), "exp_avg_sq": vs[i].clone()}
        topt.step()
        run_op(case, hp)
        for i, (pdt, _, _) in enumerate(OP_LAYOUT):
            got = masters[i] if pdt != torch.float32 else params[i]
            torch.testing.assert_close(got, refs[i], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ms[i], topt.state[refs[i]]["exp_avg"], rtol=1e-6,
                                       atol=1e-8)
            torch.testing.assert_close(vs[i], topt.state[refs[i]]["exp_avg_sq"], rtol=1e-6,
                                       atol=1e-10)


def test_op_exp_avg_with_a_lerp_weight_near_one_is_torchs():
    """beta1 near 0 makes 1 - beta1 an fp32 weight near 1, which torch's lerp takes rounded to
    fp32 (off by up to half an ulp of 1): m = 1, g = 1e-4, beta1 = 1e-4 gives 2.0000659e-4, not
    the exact 1.9999e-4 (a relative 8e-5, which a hypothesis draw found against a reference that
    used the exact weight). The op gives torch's fused Adam's bits, and the float64 reference,
    which takes the weight as torch does, agrees to fp32 rounding."""
    hp = dict(lr=1e-3, beta1=1e-4, beta2=0.0, eps=1e-3, weight_decay=0.0, maximize=False)
    p0, g0 = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([1e-4, 2e-5, -1e-6])
    m0, v0 = torch.tensor([1.0, -2.0, 100.0]), torch.tensor([1.0, 4.0, 1e-4])
    ours = [p0.clone(), g0.clone(), m0.clone(), v0.clone(), torch.zeros(())]
    ops.adam_step_([ours[0]], [ours[1]], [ours[2]], [ours[3]], [torch.empty(0)], [ours[4]],
                   decoupled=False, **hp)
    # torch's optimizer counts the step before its fused op; mpext's op counts it itself
    theirs = [p0.clone(), g0.clone(), m0.clone(), v0.clone(), torch.ones(())]
    torch._fused_adam_([theirs[0]], [theirs[1]], [theirs[2]], [theirs[3]], [], [theirs[4]],
                       amsgrad=False, **hp)
    for a, b in zip(ours, theirs):
        assert_bitwise(a, b, "mpext vs torch._fused_adam_")
    p, m, v, _ = adam_step_reference(p0.double().numpy(), g0.double().numpy(),
                                     m0.double().numpy(), v0.double().numpy(), 0,
                                     decoupled=False, **hp)
    torch.testing.assert_close(ours[2].double(), torch.from_numpy(m), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ours[0].double(), torch.from_numpy(p), rtol=1e-6, atol=0.0)


def test_op_found_inf_skips_everything(device):
    for flag in (1.0, INF, NAN, -2.0):
        case = op_case(device, seed=1)
        before = [clones(lst) for lst in case]
        run_op(case, OP_HYPER["adamw"], inv_scale=torch.full((), 0.5, device=device),
               found_inf=torch.full((), flag, device=device))
        for lst, old in zip(case, before):
            for a, b in zip(lst, old):
                assert_bitwise(a, b, "found_inf=%s" % flag)
    case = op_case(device, seed=1)
    before = clones(case[5])
    run_op(case, OP_HYPER["adamw"], found_inf=torch.zeros((), device=device))
    assert [s.item() for s in case[5]] == [s.item() + 1 for s in before]


@pytest.mark.parametrize("log2_scale", [0, 7, 12, -3])
def test_op_fused_unscale_equals_unscale_then_step(device, log2_scale):
    """inv_scale inside the op gives the same bits as unscaling the gradients first with
    torch's own unscale op (power-of-two scales: the unscaled gradients are exact)."""
    inv = 2.0 ** -log2_scale
    fused = op_case(device, seed=2, grad_scale=1.0 / inv)
    plain = [clones(lst) for lst in fused]
    run_op(fused, OP_HYPER["adam_l2"], inv_scale=torch.full((), inv, device=device))
    by_dtype = {}
    for g in plain[1]:
        by_dtype.setdefault(g.dtype, []).append(g)
    found = torch.zeros((), device=device)
    for gs in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, torch.full((), inv,
                                                                               device=device))
    assert found.item() == 0
    run_op(plain, OP_HYPER["adam_l2"])
    for lst_a, lst_b, name in zip(fused, plain, ("params", "grads", "exp_avgs", "exp_avg_sqs",
                                                 "masters", "steps")):
        if name == "grads":
            continue
        for a, b in zip(lst_a, lst_b):
            assert_bitwise(a, b, name)


def test_op_lr_as_float_or_tensor(device):
    a = op_case(device, seed=4)
    b = [clones(lst) for lst in a]
    run_op(a, OP_HYPER["adamw"])
    hp = dict(OP_HYPER["adamw"], lr=torch.full((1,), OP_HYPER["adamw"]["lr"], device=device))
    run_op(b, hp)
    for x, y in zip(sum(a, []), sum(b, [])):
        assert_bitwise(x, y)


def test_op_fp32_only_takes_empty_masters(device):
    layout = [(torch.float32, torch.float32, 9), (torch.float32, torch.float32, 4)]
    a = op_case(device, layout=layout)
    b = [clones(lst) for lst in a]
    b[4] = []
    run_op(a, OP_HYPER["adamw"])
    ops.adam_step_(b[0], b[1], b[2], b[3], None, b[5], 1e-3, 0.9, 0.999, 1e-8, 0.1, True)
    for x, y in zip(a[0] + a[2] + a[3] + a[5], b[0] + b[2] + b[3] + b[5]):
        assert_bitwise(x, y)


def test_op_channels_last(device):
    p = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    g = torch.randn_like(p)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ref = p.clone().contiguous()
    ops.adam_step_([p], [g], [m], [v], [], [torch.zeros((), device=device)], 1e-2)
    ops.adam_step_([ref], [g.contiguous()], [torch.zeros_like(ref)], [torch.zeros_like(ref)], [],
                   [torch.zeros((), device=device)], 1e-2)
    assert p.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(p, ref)


def test_op_special_values(device):
    """NaN/Inf gradients without found_inf propagate into the param (the op never hides one),
    huge gradients overflow g*g to Inf exactly as fp32 torch does, subnormal and zero gradients
    stay finite: the same values as torch.optim.AdamW in fp32."""
    hp = OP_HYPER["adamw"]
    g = torch.tensor([NAN, INF, -INF, 0.0, 1e30, 1e-40, -3e38, 1.0, 1e-20, 3e19],
                     device=device)
    p = torch.ones(g.numel(), device=device)
    q = p.clone().requires_grad_()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    s = torch.zeros((), device=device)
    ref = torch.optim.AdamW([q], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    for _ in range(2):
        ops.adam_step_([p], [g], [m], [v], [], [s], hp["lr"], hp["beta1"], hp["beta2"],
                       hp["eps"], hp["weight_decay"], True, False)
        q.grad = g.clone()
        ref.step()
    assert torch.isnan(p[:3]).all()
    assert torch.isfinite(p[3:]).all()
    torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(v, ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=0,
                               equal_nan=True)


# --------------------------------------------------------------------------------------------
# opcheck, fake tensors, torch.compile.


def test_opcheck(device):
    case = op_case(device, layout=[(torch.float32, torch.float32, 33),
                                   (torch.bfloat16, torch.bfloat16, 17),
                                   (torch.float16, torch.float32, 5)])
    params, grads, ms, vs, masters, steps = case
    lr = torch.full((), 1e-3, device=device)
    inv = torch.full((), 0.5, device=device)
    cases = [
        ((params, grads, ms, vs, masters, steps, lr, 0.9, 0.999, 1e-8, 0.01, True, False), {}),
        ((params, grads, ms, vs, masters, steps, lr, 0.8, 0.99, 1e-6, 0.1, False, True),
         {"inv_scale": inv, "found_inf": torch.zeros((), device=device)}),
        ((params, grads, ms, vs, masters, steps, lr, 0.9, 0.999, 1e-8, 0.0, True, False),
         {"inv_scale": inv, "found_inf": torch.ones((), device=device)}),
        ((params[:1], grads[:1], ms[:1], vs[:1], [], steps[:1], lr, 0.9, 0.999, 1e-8, 0.0, True,
          False), {}),
        (([], [], [], [], [], [], lr, 0.9, 0.999, 1e-8, 0.0, True, False), {}),
    ]
    for args, kwargs in cases:
        torch.library.opcheck(torch.ops.mpext.adam_step_.default, args, kwargs)


# --------------------------------------------------------------------------------------------
# Bad input to the op: a clear error naming the argument, and nothing modified.


def bad_case(device):
    """fp32, bf16 and fp16 params with their state; returns a dict of the call's arguments."""
    case = op_case(device, layout=[(torch.float32, torch.float32, 6),
                                   (torch.bfloat16, torch.bfloat16, 6),
                                   (torch.float16, torch.float32, 4)], seed=11)
    params, grads, ms, vs, masters, steps = case
    return dict(params=params, grads=grads, exp_avgs=ms, exp_avg_sqs=vs, masters=masters,
                steps=steps, lr=torch.full((), 1e-3, device=device), beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False, inv_scale=None,
                found_inf=None)


def _set(key, index, make):
    def change(kw, d):
        lst = list(kw[key])
        lst[index] = make(lst[index], d)
        kw[key] = lst
    return change


def _put(key, make):
    def change(kw, d):
        kw[key] = make(kw, d)
    return change


OP_BAD = [
    # list lengths
    (_put("grads", lambda kw, d: kw["grads"][:2]), ValueError,
     r"adam_step_: grads must have one entry per param \(3\), got 2"),
    (_put("exp_avgs", lambda kw, d: kw["exp_avgs"] + kw["exp_avgs"][:1]), ValueError,
     r"exp_avgs must have one entry per param \(3\), got 4"),
    (_put("exp_avg_sqs", lambda kw, d: []), ValueError,
     r"exp_avg_sqs must have one entry per param \(3\), got 0"),
    (_put("steps", lambda kw, d: kw["steps"][1:]), ValueError,
     r"steps must have one entry per param \(3\), got 2"),
    (_put("masters", lambda kw, d: kw["masters"][:2]), ValueError,
     r"masters must be empty or have one entry per param \(3\), got 2"),
    (_put("masters", lambda kw, d: []), ValueError,
     r"params\[1\] is bfloat16 and needs an fp32 master \(masters\[1\]\) or a remainder "
     r"\(remainders\[1\]\); pass master_free=True to update it in place without one"),
    # dtypes
    (_set("params", 0, lambda t, d: t.double()), RuntimeError,
     r"params\[0\] must have dtype float32 or bfloat16 or float16, got float64"),
    (_set("grads", 1, lambda t, d: t.half()), RuntimeError,
     r"grads\[1\] must have the dtype of params\[1\] \(bfloat16\) or float32, got float16"),
    (_set("grads", 0, lambda t, d: t.bfloat16()), RuntimeError,
     r"grads\[0\] must have the dtype of params\[0\] \(float32\) or float32, got bfloat16"),
    (_set("exp_avgs", 1, lambda t, d: t.half()), RuntimeError,
     r"exp_avgs\[1\] must have dtype float32 or bfloat16 or int8, got float16"),
    (_set("exp_avg_sqs", 2, lambda t, d: t.double()), RuntimeError,
     r"exp_avg_sqs\[2\] must have dtype float32 or bfloat16 or uint8, got float64"),
    (_set("masters", 1, lambda t, d: t.half()), RuntimeError,
     r"masters\[1\] must have dtype float32, got float16"),
    (_set("steps", 0, lambda t, d: t.double()), RuntimeError,
     r"steps\[0\] must have dtype float32, got float64"),
    (_set("steps", 2, lambda t, d: t.long()), RuntimeError,
     r"steps\[2\] must have dtype float32, got int64"),
    (_put("lr", lambda kw, d: kw["lr"].double()), RuntimeError,
     r"lr must have dtype float32, got float64"),
    (_put("inv_scale", lambda kw, d: torch.ones((), dtype=torch.float64, device=d)),
     RuntimeError, r"inv_scale must have dtype float32, got float64"),
    (_put("found_inf", lambda kw, d: torch.zeros((), dtype=torch.int32, device=d)),
     RuntimeError, r"found_inf must have dtype float32, got int32"),
    # element counts
    (_set("steps", 1, lambda t, d: torch.zeros(2, device=d)), RuntimeError,
     r"steps\[1\] must have 1 element, got 2"),
    (_put("lr", lambda kw, d: torch.full((2,), 1e-3, device=d)), RuntimeError,
     r"lr must have 1 element, got 2"),
    (_put("inv_scale", lambda kw, d: torch.ones(0, device=d)), RuntimeError,
     r"inv_scale must have 1 element, got 0"),
    (_put("found_inf", lambda kw, d: torch.zeros(3, device=d)), RuntimeError,
     r"found_inf must have 1 element, got 3"),
    # shapes and layouts
    (_set("grads", 0, lambda t, d: t.reshape(2, 3)), ValueError,
     r"grads\[0\] \(sizes \[2, 3\], strides \[3, 1\]\) must match params\[0\] \(sizes \[6\]"),
    (_set("exp_avgs", 0, lambda t, d: torch.zeros(7, device=d)), ValueError,
     r"exp_avgs\[0\] \(sizes \[7\], strides \[1\]\) must match params\[0\]"),
    (_set("exp_avg_sqs", 1, lambda t, d: torch.zeros(5, device=d)), ValueError,
     r"exp_avg_sqs\[1\] .* must match params\[1\]"),
    (_set("masters", 1, lambda t, d: torch.zeros(6, 1, device=d)), ValueError,
     r"masters\[1\] \(sizes \[6, 1\], strides \[1, 1\]\) must match params\[1\]"),
    (_set("masters", 0, lambda t, d: torch.zeros(6, device=d)), ValueError,
     r"params\[0\] is float32 and takes no master, so masters\[0\] must be an empty tensor, "
     r"got 6 elements"),
    (_set("grads", 1, lambda t, d: torch.zeros(12, dtype=t.dtype, device=d)[::2]),
     RuntimeError, r"grads\[1\] must be dense and non-overlapping"),
    (_set("params", 0, lambda t, d: torch.zeros(1, device=d).expand(6)), RuntimeError,
     r"params\[0\] must be dense and non-overlapping"),
    (_set("exp_avgs", 2, lambda t, d: torch.zeros(4, 2, device=d)[:, 0]), RuntimeError,
     r"exp_avgs\[2\] must be dense and non-overlapping"),
    # hyperparameters
    (_put("beta1", lambda kw, d: 1.0), ValueError, r"beta1 must be in \[0, 1\), got 1"),
    (_put("beta1", lambda kw, d: -0.5), ValueError, r"beta1 must be in \[0, 1\), got -0.5"),
    (_put("beta2", lambda kw, d: NAN), ValueError, r"beta2 must be in \[0, 1\), got nan"),
    (_put("eps", lambda kw, d: -1e-8), ValueError, r"eps must be in \[0, inf\), got -1e-08"),
    (_put("eps", lambda kw, d: INF), ValueError, r"eps must be in \[0, inf\), got inf"),
    (_put("weight_decay", lambda kw, d: -0.1), ValueError,
     r"weight_decay must be in \[0, inf\), got -0.1"),
    # leaner storage: remainders, master-free params, stochastic-rounding streams
    (_put("remainders", lambda kw, d: [torch.empty(0, dtype=torch.int16, device=d)] * 2
          + [torch.zeros(4, dtype=torch.int16, device=d)]), ValueError,
     r"remainders\[2\] is given but params\[2\] is float16; only a bfloat16 param is its "
     r"fp32 value's high half"),
    (_put("remainders", lambda kw, d: [torch.empty(0, dtype=torch.int16, device=d),
                                       torch.zeros(6, dtype=torch.int16, device=d),
                                       torch.empty(0, dtype=torch.int16, device=d)]),
     ValueError, r"params\[1\] has both a master \(masters\[1\]\) and a remainder "
                 r"\(remainders\[1\]\); give one of them"),
    (_put("remainders", lambda kw, d: [torch.empty(0, dtype=torch.int16, device=d),
                                       torch.zeros(6, dtype=torch.int32, device=d),
                                       torch.empty(0, dtype=torch.int16, device=d)]),
     RuntimeError, r"remainders\[1\] must have dtype int16, got int32"),
    (_put("remainders", lambda kw, d: [torch.empty(0, dtype=torch.int16, device=d)]),
     ValueError, r"remainders must be empty or have one entry per param \(3\), got 1"),
    (_put("sr_streams", lambda kw, d: [0, 1]), ValueError,
     r"sr_streams must have one entry per param \(3\), got 2"),
    (_put("sr_streams", lambda kw, d: [0, 2 ** 32, 2]), ValueError,
     r"sr_streams\[1\] must be in \[0, 2\^32\), got 4294967296"),
    (_put("sr_streams", lambda kw, d: [0, 1, -1]), ValueError,
     r"sr_streams\[2\] must be in \[0, 2\^32\), got -1"),
    (_set("masters", 2, lambda t, d: torch.empty(0, device=d)), ValueError,
     r"params\[2\] is float16 and needs an fp32 master \(masters\[2\]\); pass "
     r"master_free=True to update it in place without one"),
    # sparse
    (_set("grads", 0, lambda t, d: t.to_sparse()), RuntimeError,
     r"grads\[0\] must be a strided \(dense\) tensor"),
    (_set("exp_avgs", 1, lambda t, d: t.to_sparse()), RuntimeError,
     r"exp_avgs\[1\] must be a strided \(dense\) tensor"),
    (_put("found_inf", lambda kw, d: torch.zeros(1, device=d).to_sparse()), RuntimeError,
     r"found_inf must be a strided \(dense\) tensor"),
]

# Overlaps need real addresses: checked by the C++ kernels only (not on the meta device). Each
# entry: the aliasing (see _alias) and the message.
OP_OVERLAP = [
    r"(params\[0\] and params\[2\]|params\[2\] and params\[0\]) overlap in memory",
    r"(exp_avgs\[1\] and exp_avg_sqs\[1\]|exp_avg_sqs\[1\] and exp_avgs\[1\]) overlap",
    r"(params\[0\] and grads\[0\]|grads\[0\] and params\[0\]) overlap",
    r"(exp_avgs\[2\] and masters\[2\]|masters\[2\] and exp_avgs\[2\]) overlap",
    r"(steps\[0\] and steps\[1\]|steps\[1\] and steps\[0\]) overlap",
    r"(steps\[2\] and lr|lr and steps\[2\]) overlap",
    r"(exp_avgs\[0\] and found_inf|found_inf and exp_avgs\[0\]) overlap",
]


def _alias(kw, index):
    """The aliasing each OP_OVERLAP entry stands for (needs the real tensors)."""
    p, g, m, v, w, s = (kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"],
                        kw["masters"], kw["steps"])
    if index == 0:
        kw["params"] = [p[0], p[1], p[0].view(torch.float16)[:4]]
        kw["grads"] = [g[0], g[1], torch.zeros(4, dtype=torch.float32, device=p[0].device)]
    elif index == 1:
        kw["exp_avg_sqs"] = [v[0], m[1], v[2]]
    elif index == 2:
        kw["grads"] = [p[0], g[1], g[2]]
    elif index == 3:
        kw["masters"] = [w[0], w[1], m[2]]
    elif index == 4:
        kw["steps"] = [s[0], s[0], s[2]]
    elif index == 5:
        kw["lr"] = s[2]
    elif index == 6:
        kw["found_inf"] = m[0][1:2]


def call_op(kw):
    kw = dict(kw)
    args = [kw.pop(k) for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters", "steps",
                                "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                                "maximize")]
    ops.adam_step_(*args, **kw)


def all_tensors(kw):
    out = []
    for v in kw.values():
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                out.append(t)
    return out


def assert_nothing_written(tensors, before):
    for a, b in zip(tensors, before):
        assert torch.equal(bits(a), bits(b))


def _case_id(match):
    return re.sub(r"[^A-Za-z0-9]+", "_", match.replace(r"\[", "").replace(r"\]", ""))[:48]


# Through each device's kernel (the fake kernel checks no argument: tests/test_step_fake.py).
@pytest.mark.parametrize("device,change,exc,match", device_cases(
    OP_BAD, [_case_id(c[2]) for c in OP_BAD]))
def test_op_bad_input_changes_nothing(device, change, exc, match):
    """Every check, through the real kernel: its exception type and message, nothing
    written."""
    dev = device
    kw = bad_case(dev)
    change(kw, dev)
    tensors = all_tensors(kw)
    before = [] if dev == "meta" else [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        call_op(kw)
    if dev != "meta":
        assert_nothing_written(tensors, before)


@pytest.mark.parametrize("index", range(len(OP_OVERLAP)))
def test_op_overlapping_tensors_rejected(device, index):
    kw = bad_case(device)
    _alias(kw, index)
    tensors = all_tensors(kw)
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=OP_OVERLAP[index]):
        call_op(kw)
    assert_nothing_written(tensors, before)


def test_op_shared_grads_and_empty_masters_allowed(device):
    """Only written tensors must not overlap: two params may read one gradient, and one empty
    master may stand for every fp32 param."""
    p = [torch.randn(5, device=device), torch.randn(5, device=device)]
    g = torch.randn(5, device=device)
    empty = torch.empty(0, device=device)
    low = torch.randn(3, device=device).bfloat16()
    ops.adam_step_(p + [low], [g, g, torch.randn(3, device=device)],
                   [torch.zeros(5, device=device), torch.zeros(5, device=device),
                    torch.zeros(3, device=device)],
                   [torch.zeros(5, device=device), torch.zeros(5, device=device),
                    torch.zeros(3, device=device)], [empty, empty, low.float()],
                   [torch.zeros((), device=device) for _ in range(3)], 1e-3)
    assert torch.equal(p[0] - p[0], torch.zeros(5, device=device))


# --------------------------------------------------------------------------------------------
# The optimizers against torch.optim, FP32 params.

HYPER = {
    "adamw_default": (AdamW, torch.optim.AdamW, {}),
    "adamw_wd_maximize": (AdamW, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1,
                                                         maximize=True)),
    "adamw_betas_eps": (AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-3,
                                                       weight_decay=0.0)),
    "adam_default": (Adam, torch.optim.Adam, {}),
    "adam_l2": (Adam, torch.optim.Adam, dict(lr=2e-3, weight_decay=0.05)),
    "adam_maximize_eps": (Adam, torch.optim.Adam, dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-6,
                                                       maximize=True, weight_decay=0.01)),
    "adam_decoupled": (Adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.2,
                                                    decoupled_weight_decay=True)),
}

SCHEDULES = {
    "constant": None,
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=150, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=1000),
    "warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 100)),
    # OneCycleLR also cycles beta1 every step (group["betas"] changes).
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=1000),
}

SHAPES = [(13, 7), (31,), (2, 3, 5), (), (1, 1)]


def make_params(device, dtype=torch.float32, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_()
            for s in shapes]


def random_grads(params, step, dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    return [torch.randn(p.shape, generator=gen).to(device=p.device,
                                                   dtype=dtype or p.dtype) for p in params]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("hyper", sorted(HYPER))
def test_fp32_matches_torch_1000_steps(device, hyper, schedule):
    ours_cls, torch_cls, kw = HYPER[hyper]
    ours_p, ref_p = make_params(device), make_params(device)
    ours = ours_cls(ours_p, **kw)
    ref = torch_cls(ref_p, foreach=False, **kw)
    scheds = [SCHEDULES[schedule](o) for o in (ours, ref)] if SCHEDULES[schedule] else []
    for step in range(1000):
        grads = random_grads(ours_p, step)
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
        if step % 100 == 99:
            for p, q in zip(ours_p, ref_p):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    for p, q in zip(ours_p, ref_p):
        a, b = ours.state[p], ref.state[q]
        assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert a["step"].dtype == torch.float32 and a["step"].device == p.device
        assert a["step"].item() == b["step"].item() == 1000
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# BF16 / FP16 params with FP32 masters.


@pytest.mark.parametrize("grad_dtype", ["param", "float32"])
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("hyper", ["adamw_wd_maximize", "adam_l2", "adamw_betas_eps"])
def test_low_precision_master_tracks_torch_fp32(device, dtype, grad_dtype, hyper):
    ours_cls, torch_cls, kw = HYPER[hyper]
    ours_p = make_params(device, dtype)
    ref_p = [p.detach().float().requires_grad_() for p in ours_p]
    ours = ours_cls(ours_p, **kw)
    ref = torch_cls(ref_p, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=1000)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=1000)
    gdt = dtype if grad_dtype == "param" else torch.float32
    allow_any_grad_dtype(ours_p)
    for step in range(1000):
        grads = random_grads(ours_p, step, dtype=gdt)
        for p, q, g in zip(ours_p, ref_p, grads):
            p.grad, q.grad = g.clone(), g.float()  # torch's FP32 optimizer: the upcast grad
        ours.step()
        ref.step()
        sched.step()
        ref_sched.step()
        for p in ours_p:  # the model param is the master rounded to nearest even
            master = ours.state[p]["master_param"]
            assert master.dtype == torch.float32
            assert_bitwise(p.detach(), master.to(dtype), "step %d" % step)
        if step % 100 == 99:
            for p, q in zip(ours_p, ref_p):
                torch.testing.assert_close(ours.state[p]["master_param"], q.detach(),
                                           rtol=1e-5, atol=1e-6)
    for p, q in zip(ours_p, ref_p):
        st = ours.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert st["step"].item() == 1000
        torch.testing.assert_close(st["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-6)


def test_master_weights_accumulate_small_updates():
    """The reason for masters: updates far below a bf16 ulp accumulate in the master (and reach
    the param once large enough) instead of being rounded away every step."""
    p = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    q = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    with_master = AdamW([p], lr=1e-4, weight_decay=0.0)
    without = AdamW([q], lr=1e-4, weight_decay=0.0, master_weights=False)
    for _ in range(200):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
        with_master.step()
        without.step()
    assert "master_param" not in without.state[q]
    assert torch.equal(q, torch.ones_like(q))  # 1e-4 < half a bf16 ulp at 1.0: lost each step
    assert (p < 1).all()
    torch.testing.assert_close(with_master.state[p]["master_param"],
                               torch.full((64,), 1 - 200 * 1e-4), rtol=0, atol=2e-5)


def test_master_weights_false_is_a_temporary_master(device):
    """master_weights=False: no state beyond torch's; each step is the op with a master made
    from the param."""
    p = make_params(device, torch.bfloat16)
    ref = [t.detach().clone() for t in p]
    opt = Adam(p, lr=1e-2, weight_decay=0.1, master_weights=False)
    ms = [torch.zeros(t.shape, device=device) for t in ref]
    vs = [torch.zeros(t.shape, device=device) for t in ref]
    ss = [torch.zeros((), device=device) for _ in ref]
    for step in range(5):
        grads = random_grads(p, step)
        for t, g in zip(p, grads):
            t.grad = g
        opt.step()
        ops.adam_step_(ref, grads, ms, vs, [t.float() for t in ref], ss, 1e-2, 0.9, 0.999, 1e-8,
                       0.1, False)
        for a, b in zip(p, ref):
            assert_bitwise(a.detach(), b)
    for t in p:
        assert set(opt.state[t]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("hyper", ["adamw_wd_maximize", "adam_l2"])
def test_every_isa_path_trains_like_torch(isa, hyper):
    ours_cls, torch_cls, kw = HYPER[hyper]
    ours_p = make_params("cpu", torch.bfloat16, shapes=[(67, 3), (129,), (5,)])
    mixed = make_params("cpu", torch.float32, seed=1, shapes=[(33,)])
    ref_p = [p.detach().float().requires_grad_() for p in ours_p + mixed]
    ours = ours_cls(ours_p + mixed, **kw)
    ref = torch_cls(ref_p, foreach=False, **kw)
    for step in range(100):
        grads = random_grads(ours_p + mixed, step, dtype=torch.float32)
        for p, q, g in zip(ours_p + mixed, ref_p, grads):
            p.grad, q.grad = g.to(p.dtype), g.to(p.dtype).float()
        ours.step()
        ref.step()
    for p, q in zip(ours_p + mixed, ref_p):
        st = ours.state[p]
        got = st.get("master_param", p.detach())
        torch.testing.assert_close(got, q.detach(), rtol=1e-5, atol=1e-6)
        if p.dtype != torch.float32:
            assert_bitwise(p.detach(), got.to(p.dtype))


# --------------------------------------------------------------------------------------------
# Loss scaling: fused unscale, skipped steps, no host syncs, under both scalers.

SCALERS = {"torch": torch.amp.GradScaler, "mpext": mpext.GradScaler}


class Model(torch.nn.Module):
    """Mixed-dtype params: fp32, bf16 and fp16 layers, a loss in fp32."""

    def __init__(self, device, c_dtype=torch.float16):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 6, generator=gen).to(device))
        self.b = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(device).bfloat16())
        self.c = torch.nn.Parameter(torch.randn(5, 3, generator=gen).to(device, c_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(3, device=device))

    def forward(self, x):
        h = torch.tanh(x @ self.a)
        h = torch.tanh(h.bfloat16() @ self.b).float()
        h = (h.to(self.c.dtype) @ self.c).float()
        return h + self.bias


def loss_of(model, step, device):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=gen).to(device)
    y = torch.randn(4, 3, generator=gen).to(device)
    return ((model(x) - y) ** 2).mean()


def make_run(device, scaler_name, opt_cls=AdamW, init_scale=2.0 ** 10, c_dtype=torch.float16,
             **kw):
    model = Model(device, c_dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    scaler = SCALERS[scaler_name](device, init_scale=init_scale, growth_interval=4)
    return model, opt, scaler


def poison(model, step, kind):
    """NaN/Inf in one element of one gradient."""
    targets = [model.a, model.b, model.c, model.bias]
    g = targets[step % len(targets)].grad
    g.view(-1)[step % g.numel()] = {"nan": NAN, "inf": INF, "-inf": -INF}[kind]


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
def test_poisoned_steps_change_nothing(device, scaler_name, kind, monkeypatch):
    model, opt, scaler = make_run(device, scaler_name)
    checks = []
    real_check = type(scaler)._check_inf_per_device

    def spy(self, optimizer):
        checks.append(optimizer)
        return real_check(self, optimizer)

    monkeypatch.setattr(type(scaler), "_check_inf_per_device", spy)
    poisoned = {3, 4, 9}
    for step in range(12):
        opt.zero_grad()
        scaler.scale(loss_of(model, step, device)).backward()
        if step in poisoned:
            poison(model, step, kind)
        before = snapshot_opt(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step in poisoned:
            assert_opt_unchanged(opt, before)
            assert scaler.get_scale() == scale * 0.5
        else:
            assert any(not torch.equal(bits(t), bits(b)) for (_, t), (_, b)
                       in zip(opt_tensors(opt), before) if t.dim() > 0)
        for p in model.parameters():
            if p.dtype != torch.float32:
                assert_bitwise(p.detach(), opt.state[p]["master_param"].to(p.dtype))
    # The scaler checked the still-scaled gradients itself (the fused-optimizer path).
    assert len(checks) == 12 and all(o is opt for o in checks)
    assert opt.state[model.a]["step"].item() == 12 - len(poisoned)


def test_step_grad_scale_and_found_inf_arguments(device):
    """step(grad_scale=, found_inf=) directly, as a custom training loop would use it."""
    p1 = make_params(device, torch.bfloat16)
    p2 = [t.detach().clone().requires_grad_() for t in p1]
    o1, o2 = AdamW(p1), AdamW(p2)
    for step in range(3):
        grads = random_grads(p1, step)
        for a, b, g in zip(p1, p2, grads):
            a.grad = (g.float() * 256).to(g.dtype)
            b.grad = g.clone()
        o1.step(grad_scale=torch.full((), 256.0, device=device),
                found_inf=torch.zeros((), device=device))
        o2.step()
    assert_opts_bitwise(o1, o2)
    before = snapshot_opt(o1)
    o1.step(found_inf=torch.ones((), device=device))
    assert_opt_unchanged(o1, before)
    o1.step(grad_scale=2.0, found_inf=0.0)  # host numbers are accepted as well
    o1.step(found_inf=1.0)


@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
def test_no_host_sync_per_step(device, scaler_name):
    """0 reads of tensor values per training step with either scaler (and an LR scheduler);
    on CUDA also with torch's sync debug mode set to error."""
    model, opt, scaler = make_run(device, scaler_name)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    reads = HostReads()
    for step in range(8):
        opt.zero_grad()
        scaler.scale(loss_of(model, step, device)).backward()
        if step == 5:
            poison(model, step, "nan")
        counted = step >= 2  # after the lazy initialisations
        if counted and device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            with reads.counting() if counted else contextlib.nullcontext():
                scaler.step(opt)
                scaler.update()
                sched.step()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    assert reads.calls == []
    assert opt.state[model.a]["step"].item() == 7


def test_no_host_sync_without_scaler(device):
    params = make_params(device, torch.bfloat16)
    opt = AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    reads = HostReads()
    for step in range(5):
        for p, g in zip(params, random_grads(params, step)):
            p.grad = g
        with reads.counting():
            opt.step()
            sched.step()
    assert reads.calls == []


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device")
def test_cuda_graph_capture():
    """The step has no host sync and no allocation once the state exists, so it can be
    captured in a CUDA graph and replayed."""
    params = make_params("cuda", torch.bfloat16)
    opt = AdamW(params, lr=1e-3, capturable=True)
    static_grads = random_grads(params, 0)
    for p, g in zip(params, static_grads):
        p.grad = g
    opt.step()  # creates the state
    ref_params = [p.detach().clone() for p in params]
    ref = AdamW([p.requires_grad_() for p in ref_params], lr=1e-3)
    ref.load_state_dict(opt.state_dict())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        graph.replay()
        for p, g in zip(ref_params, static_grads):
            p.grad = g
        ref.step()
    torch.cuda.synchronize()
    assert_opts_bitwise(opt, ref)


@pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA device")
def test_cuda_and_cpu_params_in_one_optimizer(monkeypatch):
    """Params on two devices: one call per device, the scaler's found_inf and scale moved to
    each; the same bits as separate unscaled optimizers per device."""
    cpu_p = make_params("cpu", torch.bfloat16)
    cuda_p = make_params("cuda", torch.bfloat16)
    refs = [[p.detach().clone().requires_grad_() for p in ps] for ps in (cpu_p, cuda_p)]
    opt = AdamW(cpu_p + cuda_p)
    ref_opts = [AdamW(r) for r in refs]
    scaler = mpext.GradScaler("cuda")
    with count_calls(monkeypatch) as calls:
        for step in range(3):
            grads = random_grads(cpu_p + cuda_p, step)
            for p, g in zip(cpu_p + cuda_p, grads):
                p.grad = (g.float() * 65536.0).to(g.dtype)  # exact: a power of two
            scaler.step(opt)
            scaler.update()
            for q, g in zip(refs[0] + refs[1], grads):
                q.grad = g
            for o in ref_opts:
                o.step()
    assert len(calls) == 3 * 3  # ours: one per device per step; the references: one each
    for p, q in zip(cpu_p + cuda_p, refs[0] + refs[1]):
        assert_bitwise(p.detach(), q.detach())
        assert_bitwise(opt.state[p]["master_param"], ref_opts[0 if p.is_cpu else 1]
                       .state[q]["master_param"])


# --------------------------------------------------------------------------------------------
# Param groups, grads, calls.


def test_param_groups_with_their_own_hyperparameters(device, monkeypatch):
    """Three groups, two with the same hyperparameters: one op call for those two (mixed
    dtypes), one for the third; each matches torch with the same groups."""
    ps = make_params(device, seed=1)
    qs = [p.detach().clone().requires_grad_() for p in ps]

    def groups(t):
        return [dict(params=t[:2], lr=1e-3, weight_decay=0.1),
                dict(params=t[2:4], lr=1e-2, betas=(0.8, 0.9), weight_decay=0.0, eps=1e-4),
                dict(params=t[4:], lr=1e-3, weight_decay=0.1)]

    ours = AdamW(groups(ps))
    ref = torch.optim.AdamW(groups(qs), foreach=False)
    with count_calls(monkeypatch) as calls:
        for step in range(200):
            for p, q, g in zip(ps, qs, random_grads(ps, step)):
                p.grad, q.grad = g.clone(), g.clone()
            ours.step()
            ref.step()
    assert len(calls) == 400
    assert [len(c[0][0]) for c in calls[:2]] == [3, 2]
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_call_for_mixed_dtypes(device, monkeypatch):
    model = Model(device)
    opt = AdamW(model.parameters())
    with count_calls(monkeypatch) as calls:
        loss_of(model, 0, device).backward()
        opt.step()
    assert len(calls) == 1
    args = calls[0][0]
    assert [p.dtype for p in args[0]] == [torch.float32, torch.bfloat16, torch.float16,
                                          torch.float32]
    assert args[4][0].numel() == 0 and args[4][1].dtype == torch.float32


def test_params_without_grads_are_skipped(device, monkeypatch):
    ps = make_params(device, torch.bfloat16)
    before = clones(ps)
    opt = AdamW([dict(params=ps[:2]), dict(params=ps[2:], lr=1e-2)])
    ps[1].grad = torch.randn_like(ps[1])
    with count_calls(monkeypatch) as calls:
        opt.step()
    assert len(calls) == 1  # the second group has no grads: no call at all
    assert list(opt.state.keys()) == [ps[1]]
    for i in (0, 2, 3, 4):
        assert_bitwise(ps[i].detach(), before[i])
    assert not torch.equal(bits(ps[1]), bits(before[1]))
    with count_calls(monkeypatch) as calls:
        opt.zero_grad()
        opt.step()
    assert calls == []


def test_grads_in_other_layouts_are_copied(device):
    """A channels_last param with a contiguous gradient: the gradient is copied into the param's
    layout; the state keeps the param's layout."""
    p = torch.randn(4, 3, 3, 3, device=device).to(memory_format=torch.channels_last)
    p.requires_grad_()
    q = p.detach().clone().contiguous().requires_grad_()
    ours = AdamW([p], lr=1e-2)
    ref = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for step in range(20):
        g = torch.randn(4, 3, 3, 3, device=device)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours.state[p]["exp_avg"].is_contiguous(memory_format=torch.channels_last)


def test_tensor_lr(device):
    ps, qs = make_params(device), make_params(device)
    ours = AdamW(ps, lr=torch.tensor(1e-2))
    ref = torch.optim.AdamW(qs, lr=1e-2, foreach=False)
    for step in range(50):
        for p, q, g in zip(ps, qs, random_grads(ps, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_closure(device):
    ps = make_params(device)
    opt = Adam(ps)

    def closure():
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in ps)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert opt.state[ps[0]]["step"].item() == 1


def test_step_hooks_and_zero_grad_work(device):
    ps = make_params(device)
    opt = AdamW(ps)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    assert seen == ["pre", "post"] and all(p.grad is None for p in ps)


# --------------------------------------------------------------------------------------------
# Constructor and bad input to the optimizer.


def test_constructor_defaults_match_torch():
    for ours, theirs in ((Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)):
        sig_o = inspect.signature(ours.__init__).parameters
        sig_t = inspect.signature(theirs.__init__).parameters
        for name, par in sig_t.items():
            assert name in sig_o, name
            assert sig_o[name].default == par.default, name
            assert sig_o[name].kind == par.kind, name
        assert sig_o["master_weights"].default is True
        assert sig_o["unscale_grads"].default is True
        assert sig_o["stochastic_rounding"].default is False
        assert sig_o["param_remainders"].default is False
        assert sig_o["ema_decay"].default is None
        assert sig_o["exp_avg_dtype"].default is torch.float32
        assert sig_o["exp_avg_sq_dtype"].default is torch.float32
        assert sig_o["moment_rounding"].default == "stochastic" and sig_o["seed"].default == 0
    p = [torch.zeros(3, requires_grad=True)]
    assert AdamW(p).defaults["weight_decay"] == 1e-2
    assert Adam(p).defaults["weight_decay"] == 0
    ours = AdamW(p).param_groups[0]
    theirs = torch.optim.AdamW(p).param_groups[0]
    mpext_keys = ("master_weights", "unscale_grads", "param_remainders", "stochastic_rounding",
                  "exp_avg_dtype", "ema_decay",
                  "exp_avg_sq_dtype", "moment_rounding", "seed", "block_size")
    assert {k: v for k, v in ours.items() if k not in mpext_keys} == theirs
    assert AdamW._step_supports_amp_scaling is True and Adam._step_supports_amp_scaling is True
    assert issubclass(AdamW, torch.optim.Optimizer)
    for flag in ("foreach", "fused", "capturable"):
        AdamW(p, **{flag: True})  # accepted for compatibility


# The checks of every rule's constructor and param groups (lr, betas, eps, weight_decay,
# differentiable, master_weights, param_remainders, stochastic_rounding, moment formats,
# moment_rounding, seed) are the table's (tests/test_optim_table.py,
# test_bad_options_raise_and_change_nothing); these are the rest.
CTOR_BAD = [
    (dict(betas=(0.9, torch.tensor(0.99))), ValueError,
     r"betas must be either both floats or both Tensors"),
    (dict(param_remainders=1), TypeError, r"param_remainders must be a bool, got 1"),
    (dict(stochastic_rounding=1), TypeError, r"stochastic_rounding must be a bool"),
    (dict(exp_avg_sq_dtype="bf16"), ValueError,  # "bfloat16" names the format: accepted
     r"exp_avg_sq_dtype must be torch.float32, torch.bfloat16 or torch.uint8, got 'bf16'"),
    (dict(seed=1.5), ValueError, r"seed must be an int in \[0, 2\*\*64\), got 1.5"),
    (dict(unscale_grads=1), TypeError, r"unscale_grads must be a bool"),
]


@pytest.mark.parametrize("kw,exc,match", CTOR_BAD, ids=[_case_id(c[2]) for c in CTOR_BAD])
def test_constructor_rejects(kw, exc, match):
    with pytest.raises(exc, match=match):
        AdamW([torch.zeros(3, requires_grad=True)], **kw)


# float64 / complex and non-contiguous params are stepped (tests/test_dropin.py)
@pytest.mark.parametrize("make,exc,match", [
    (lambda: torch.zeros(3, dtype=torch.int64), TypeError,
     r"params\[0\] \(param group 0\) has dtype int64; only float32, bfloat16 and float16"),
    (lambda: torch.zeros(3, device="meta", requires_grad=True), ValueError,
     r"is on meta, a device this build of mpext has no adam_step_ kernel for"),
])
def test_unsupported_params_rejected(make, exc, match):
    with pytest.raises(exc, match=match):
        AdamW([make()])
    opt = AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(exc, match=match.replace("group 0", "group 1")):
        opt.add_param_group({"params": [make()]})
    assert len(opt.param_groups) == 1


def test_add_param_group_with_bad_hyperparameters_changes_nothing():
    opt = AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)],
                             "betas": (0.9, 1.5)})
    with pytest.raises(ValueError, match=r"is bfloat16 in a group that keeps FP32 masters"):  # torch's path keeps no masters
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.bfloat16,
                                                    requires_grad=True)], "amsgrad": True})
    assert len(opt.param_groups) == 1


def setup_two_calls(device):
    """Two groups with different lr (two op calls); three steps taken."""
    ps = make_params(device, torch.bfloat16)
    opt = AdamW([dict(params=ps[:2]), dict(params=ps[2:], lr=1e-2)])
    for step in range(3):
        for p, g in zip(ps, random_grads(ps, step)):
            p.grad = g
        opt.step()
    return ps, opt


STEP_BAD = [
    ("sparse", RuntimeError, r"does not support sparse gradients \(param 2 of group 1"),
    ("fp16_grad_for_bf16", TypeError, r"the gradient of param 1 of group 1 has dtype float16; "
                                      r"it must have the param's dtype \(bfloat16\) or float32"),
    ("float64_grad", TypeError, r"has dtype float64"),
    ("bad_beta", ValueError, r"Invalid beta parameter at index 0: 1.0"),
    ("negative_lr", ValueError, r"Invalid learning rate: -1.0"),
    ("amsgrad", ValueError, r"param \d of group 1 is bfloat16 in a group that keeps FP32 "
                            r"masters"),
]


@pytest.mark.parametrize("what,exc,match", STEP_BAD, ids=[c[0] for c in STEP_BAD])
def test_bad_step_changes_nothing(device, what, exc, match):
    """A problem anywhere (here in the second group, whose call would come second) is found
    before the first call writes anything."""
    ps, opt = setup_two_calls(device)
    for p, g in zip(ps, random_grads(ps, 7)):
        p.grad = g
    if what == "sparse":
        ps[4].grad = torch.ones(ps[4].shape, dtype=ps[4].dtype, device=device).to_sparse()
    elif what == "fp16_grad_for_bf16":
        allow_any_grad_dtype(ps)
        ps[3].grad = None
        ps[3].grad = torch.ones(ps[3].shape, dtype=torch.float16, device=device)
    elif what == "float64_grad":
        allow_any_grad_dtype(ps)
        ps[2].grad = None
        ps[2].grad = torch.ones(ps[2].shape, dtype=torch.float64, device=device)
    elif what == "bad_beta":
        opt.param_groups[1]["betas"] = (1.0, 0.999)
    elif what == "negative_lr":
        opt.param_groups[1]["lr"] = -1.0
    elif what == "amsgrad":
        opt.param_groups[1]["amsgrad"] = True
    before = snapshot_opt(opt)
    with pytest.raises(exc, match=match):
        opt.step()
    assert_opt_unchanged(opt, before)


# --------------------------------------------------------------------------------------------
# state_dict: layout, both directions, resume bit-identically, bad state dicts.


def train(opt, params, steps, start=0):
    for step in range(start, start + steps):
        for p, g in zip(params, random_grads(params, step, seed=7)):
            p.grad = g
        opt.step()


def test_state_dict_layout(device):
    model = Model(device)
    opt = AdamW(model.parameters(), lr=1e-3)
    loss_of(model, 0, device).backward()
    opt.step()
    sd = opt.state_dict()
    assert sorted(sd) == ["param_groups", "state"]
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["param_groups"][0]["master_weights"] is True
    for i, p in enumerate(model.parameters()):
        st = sd["state"][i]
        want = {"step", "exp_avg", "exp_avg_sq"} | ({"master_param"} if p.dtype in LOW else set())
        assert set(st) == want
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
        assert st["step"].device == p.device
        for k in want - {"step"}:
            assert st[k].dtype == torch.float32 and st[k].shape == p.shape
            assert st[k].device == p.device


@pytest.mark.parametrize("pair", ["adamw", "adam"])
def test_torch_state_dict_loads_into_mpext(device, pair):
    ours_cls, torch_cls = {"adamw": (AdamW, torch.optim.AdamW),
                           "adam": (Adam, torch.optim.Adam)}[pair]
    kw = dict(lr=3e-3, weight_decay=0.05)
    tp = make_params(device)
    topt = torch_cls(tp, foreach=False, **kw)
    train(topt, tp, 20)
    sd = copy.deepcopy(topt.state_dict())
    ours_p = [p.detach().clone().requires_grad_() for p in tp]
    ours = ours_cls(ours_p, lr=1.0)  # hyperparameters come from the state dict
    ours.load_state_dict(sd)
    assert ours.param_groups[0]["lr"] == 3e-3
    assert ours.param_groups[0]["master_weights"] is True
    for p in ours_p:
        st = ours.state[p]
        assert st["step"].item() == 20 and st["step"].dtype == torch.float32
        assert st["step"].device == p.device
    train(topt, tp, 50, start=20)
    train(ours, ours_p, 50, start=20)
    for p, q in zip(ours_p, tp):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_torch_state_of_low_precision_params_gets_masters(device):
    """torch's AdamW over bf16 params keeps bf16 moments and no master: loading converts the
    moments to fp32, and each master is made from its param at the next step -- so the model's
    state may be loaded after the optimizer's (the usual order in some frameworks) and the
    master still starts from the loaded weights."""
    tp = make_params(device, torch.bfloat16)
    topt = torch.optim.AdamW(tp, foreach=False)
    train(topt, tp, 5)
    ours_p = [torch.zeros_like(p).requires_grad_() for p in tp]  # the model not loaded yet
    ours = AdamW(ours_p)
    ours.load_state_dict(topt.state_dict())
    with torch.no_grad():  # now the model's state
        for p, q in zip(ours_p, tp):
            p.copy_(q)
    for p, q in zip(ours_p, tp):
        st, ts = ours.state[p], topt.state[q]
        assert "master_param" not in st
        assert_bitwise(ours.master_param(p), p.detach().float())
        assert_bitwise(st["exp_avg"], ts["exp_avg"].float())
        assert_bitwise(st["exp_avg_sq"], ts["exp_avg_sq"].float())
        assert st["step"].item() == 5
    ref_p = [p.detach().clone().requires_grad_() for p in tp]  # loaded in the other order
    ref = AdamW(ref_p)
    ref.load_state_dict(topt.state_dict())
    train(ours, ours_p, 3, start=5)
    train(ref, ref_p, 3, start=5)
    for p, q in zip(ours_p, ref_p):
        assert_bitwise(ours.state[p]["master_param"], ref.state[q]["master_param"])
        assert_bitwise(p.detach(), q.detach())


def test_mpext_fp32_state_dict_loads_into_torch(device):
    ps = make_params(device)
    ours = AdamW(ps, lr=2e-3, weight_decay=0.1)
    train(ours, ps, 20)
    tp = [p.detach().clone().requires_grad_() for p in ps]
    topt = torch.optim.AdamW(tp, foreach=False)
    topt.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert topt.param_groups[0]["lr"] == 2e-3
    train(ours, ps, 50, start=20)
    train(topt, tp, 50, start=20)
    for p, q in zip(ps, tp):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
def test_save_load_mid_training_is_bit_identical(device, scaler_name):
    """torch.save of model, optimizer, scaler and scheduler in the middle of a run; a fresh
    run loaded from it continues with identical bits."""
    def build():
        model, opt, scaler = make_run(device, scaler_name)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        return model, opt, scaler, sched

    def step(run, i):
        model, opt, scaler, sched = run
        opt.zero_grad()
        scaler.scale(loss_of(model, i, device)).backward()
        if i == 12:
            poison(model, i, "nan")
        scaler.step(opt)
        scaler.update()
        sched.step()

    a = build()
    for i in range(10):
        step(a, i)
    buf = io.BytesIO()
    torch.save({"model": a[0].state_dict(), "opt": a[1].state_dict(),
                "scaler": a[2].state_dict(), "sched": a[3].state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = build()
    b[0].load_state_dict(ckpt["model"])
    b[1].load_state_dict(ckpt["opt"])
    b[2].load_state_dict(ckpt["scaler"])
    b[3].load_state_dict(ckpt["sched"])
    assert_opts_bitwise(a[1], b[1])
    for i in range(10, 20):
        step(a, i)
        step(b, i)
        assert_opts_bitwise(a[1], b[1])


def test_loaded_state_is_a_copy(device):
    ps = make_params(device, torch.bfloat16)
    a = AdamW(ps)
    train(a, ps, 2)
    b = AdamW(ps)
    b.load_state_dict(a.state_dict())
    for p in ps:
        for k in ("exp_avg", "exp_avg_sq", "master_param", "step"):
            assert b.state[p][k].data_ptr() != a.state[p][k].data_ptr()


def test_pickle_and_deepcopy(device):
    ps = make_params(device, torch.bfloat16)
    opt = AdamW(ps, lr=1e-2)
    train(opt, ps, 2)
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert type(other) is AdamW
        assert other.param_groups[0]["decoupled_weight_decay"] is True
        qs = other.param_groups[0]["params"]
        for p, q in zip(ps, qs):
            assert_bitwise(p.detach(), q.detach())
            assert_bitwise(opt.state[p]["master_param"], other.state[q]["master_param"])
        train(other, qs, 2, start=2)


def test_adam_state_dict_into_adamw_stays_decoupled():
    ps = make_params("cpu")
    a = Adam(ps, weight_decay=0.1)
    train(a, ps, 2)
    w = AdamW(ps)
    w.load_state_dict(a.state_dict())
    assert w.param_groups[0]["decoupled_weight_decay"] is True


def _sd_mutations():
    def moment_shape(sd):
        sd["state"][1]["exp_avg"] = torch.zeros(5)

    def master_shape(sd):
        sd["state"][2]["master_param"] = torch.zeros(2, 3, 4)

    def missing_key(sd):
        del sd["state"][3]["exp_avg_sq"]

    def step_shape(sd):
        sd["state"][0]["step"] = torch.zeros(2)

    def not_tensor(sd):
        sd["state"][4]["exp_avg"] = [0.0]

    def int_moment(sd):
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].long()

    def group_count(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0], params=[]))

    def group_size(sd):
        sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:-1]

    def amsgrad(sd):
        sd["param_groups"][0]["amsgrad"] = True

    def max_exp_avg_sq(sd):
        sd["state"][0]["max_exp_avg_sq"] = torch.zeros(7)  # (amsgrad's state: loaded, checked)

    def bad_beta(sd):
        sd["param_groups"][1]["betas"] = (0.9, 1.0)

    return [
        (moment_shape, ValueError, r"state of param 1: exp_avg has shape \(5,\) but the param "
                                   r"has shape \(31,\)"),
        (master_shape, ValueError, r"state of param 2: master_param has shape \(2, 3, 4\) but "
                                   r"the param has shape \(2, 3, 5\)"),
        (missing_key, ValueError, r"state of param 3 has no 'exp_avg_sq'"),
        (step_shape, ValueError, r"state of param 0: step must be a number or a 1-element "
                                 r"tensor"),
        (not_tensor, TypeError, r"state of param 4: exp_avg must be a tensor, got list"),
        (int_moment, TypeError, r"exp_avg must be a dense floating-point tensor"),
        (group_count, ValueError, r"different number of parameter groups"),
        (group_size, ValueError, r"doesn't match the size of optimizer's group"),
        (amsgrad, ValueError, r"params\[\d\] \(loaded param group 0\) is bfloat16 in a "
                              r"group that keeps FP32 masters"),
        (max_exp_avg_sq, ValueError, r"state of param 0: max_exp_avg_sq has shape \(7,\) but "
                                     r"the param has shape"),
        (bad_beta, ValueError, r"Invalid beta parameter at index 1: 1.0"),
    ]


@pytest.mark.parametrize("mutate,exc,match", _sd_mutations(),
                         ids=[c[0].__name__ for c in _sd_mutations()])
def test_bad_state_dict_changes_nothing(mutate, exc, match):
    ps = make_params("cpu", torch.bfloat16)
    opt = AdamW([dict(params=ps[:2]), dict(params=ps[2:], lr=1e-2)])
    train(opt, ps, 3)
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    train(opt, ps, 1, start=3)  # the live state now differs from sd
    before = snapshot_opt(opt)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                   for g in opt.param_groups])
    state_objs = {id(p): opt.state[p] for p in ps}
    with pytest.raises(exc, match=match):
        opt.load_state_dict(sd)
    assert_opt_unchanged(opt, before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        groups_before
    assert all(opt.state[p] is state_objs[id(p)] for p in ps)


def test_state_dict_with_old_style_number_step():
    ps = make_params("cpu")
    a = torch.optim.AdamW(ps, foreach=False)
    train(a, ps, 2)
    sd = copy.deepcopy(a.state_dict())
    for st in sd["state"].values():
        st["step"] = 2  # a checkpoint from an old torch
    b = AdamW([p.detach().clone().requires_grad_() for p in ps])
    b.load_state_dict(sd)
    for st in b.state.values():
        assert st["step"].dtype == torch.float32 and st["step"].item() == 2


def test_reset_masters():
    ps = make_params("cpu", torch.bfloat16)
    opt = AdamW(ps)
    train(opt, ps, 2)
    with torch.no_grad():
        ps[0].fill_(3.0)
    opt.reset_masters()
    assert torch.equal(opt.state[ps[0]]["master_param"], torch.full(ps[0].shape, 3.0))


# "other device": a CPU step with CUDA params, so on CUDA only.
@pytest.mark.parametrize("device,form", device_cases(
    ["float64 tensor", "int64 tensor", "python float", "other device"],
    keep=lambda dev, form: not (dev == "cpu" and form == "other device")))
def test_step_counts_loaded_by_other_code_are_converted(device, form):
    """Other code writes the state directly (ZeroRedundancyOptimizer.load_state_dict moves 0-dim
    state such as ``step`` to the CPU, torch's non-fused Adam keeps a float or an int tensor):
    the step converts such a count to the float32 device tensor the kernel needs, once, and
    continues exactly like an optimizer whose state never left it."""
    ps = make_params(device, torch.bfloat16)
    a, b = AdamW(ps, lr=1e-2), AdamW(clones(ps), lr=1e-2)
    qs = b.param_groups[0]["params"]
    for q in qs:
        q.requires_grad_()
    train(a, ps, 3)
    train(b, qs, 3)
    for q in qs:
        step = b.state[q]["step"]
        b.state[q]["step"] = {"float64 tensor": step.double(), "int64 tensor": step.long(),
                              "python float": float(step.item()),
                              "other device": step.cpu()}[form]
    train(a, ps, 2, start=3)
    train(b, qs, 2, start=3)
    assert_opts_bitwise(a, b)
    for q in qs:
        s = b.state[q]["step"]
        assert s.dtype == torch.float32 and s.device == q.device and s.dim() == 0
        assert s.item() == 5.0


@pytest.mark.parametrize("scaler_name", sorted(SCALERS))
def test_grads_after_a_scaled_step_are_unscaled_like_torch_fused(device, scaler_name):
    """After scaler.step(opt) the gradients hold the unscaled values, written in the fused pass,
    as torch's fused AdamW leaves them (torch's plain optimizers see scaler.unscale_'s); with
    unscale_grads=False they keep the scale; a skipped step leaves them as they were."""
    torch.manual_seed(0)
    p32 = torch.randn(5, 3, device=device, requires_grad=True)
    p16 = torch.randn(7, device=device, dtype=torch.bfloat16, requires_grad=True)
    ref = p32.detach().clone().requires_grad_()
    ours = AdamW([p32, p16], lr=1e-2)
    theirs = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    s_ours = SCALERS[scaler_name](device, init_scale=128.0)
    s_ref = torch.amp.GradScaler(device, init_scale=128.0)
    one = torch.ones((), device=device)
    for step in range(3):
        s_ours.scale(one)  # (the scale is made lazily by scale())
        s_ref.scale(one)
        g = torch.randn(5, 3, device=device)
        g16 = torch.randn(7, device=device).bfloat16()
        p32.grad = g * 128
        p16.grad = g16 * 128
        ref.grad = g * 128
        s_ours.step(ours)
        s_ours.update()
        s_ref.step(theirs)
        s_ref.update()
        assert_bitwise(p32.grad, ref.grad)  # torch's fused kernel divides by the same 2^7
        assert_bitwise(p32.grad, g)
        assert_bitwise(p16.grad, (g16 * 128).float().mul(1 / 128).bfloat16())
        assert_bitwise(p32.detach(), ref.detach())
    # Opt out: the gradients keep the scale.
    keep = AdamW([p32, p16], lr=1e-2, unscale_grads=False)
    p32.grad, p16.grad = g * 128, g16 * 128
    s_keep = SCALERS[scaler_name](device, init_scale=128.0)
    s_keep.scale(one)
    s_keep.step(keep)
    assert_bitwise(p32.grad, g * 128)
    assert_bitwise(p16.grad, g16 * 128)
    # A skipped step writes nothing, gradients included.
    poisoned = (g * 128).clone()
    poisoned[0, 0] = float("inf")
    p32.grad, p16.grad = poisoned.clone(), g16 * 128
    s_ours.scale(one)
    s_ours.step(ours)
    assert_bitwise(p32.grad, poisoned)
    assert_bitwise(p16.grad, g16 * 128)


def test_unscaled_grads_are_written_in_the_gradients_own_layout(device):
    """A channels_last param with a contiguous gradient: the step runs on a copy in the
    param's layout, and the unscaled values go back into the gradient itself."""
    p = torch.randn(2, 3, 4, 5, device=device).contiguous(memory_format=torch.channels_last)
    p.requires_grad_()
    opt = AdamW([p], lr=1e-2)
    g = torch.randn(2, 3, 4, 5, device=device)
    p.grad = (g * 64).contiguous()
    opt.step(grad_scale=torch.tensor(64.0, device=device),
             found_inf=torch.zeros((), device=device))
    assert p.grad.is_contiguous()
    assert_bitwise(p.grad, g)


def test_op_unscale_grads_writes_the_unscaled_gradient(device):
    """The op on its own: grads become round(grads * inv_scale) only with unscale_grads and an
    inv_scale other than 1; the rest of the step is the same bits either way."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for inv in (0.25, 1.0 / 3.0, 1.0):
            runs = []
            for flag in (False, True):  # the same inputs for both runs
                gen = torch.Generator().manual_seed(5)
                p = torch.randn(257, generator=gen).to(device, dtype)
                g = (torch.randn(257, generator=gen) * 8).to(device, dtype)
                g0 = g.clone()
                m, v = torch.zeros(257, device=device), torch.zeros(257, device=device)
                w = [] if dtype == torch.float32 else [p.float()]
                s = torch.zeros((), device=device)
                ops.adam_step_([p], [g], [m], [v], w, [s], 1e-3, 0.9, 0.999, 1e-8, 0.01, True,
                               inv_scale=torch.tensor(inv, device=device), unscale_grads=flag)
                runs.append((p, g, g0, m, v))
            (p0, ga, g0, m0, v0), (p1, gb, _, m1, v1) = runs
            for a, b in ((p0, p1), (m0, m1), (v0, v1)):
                assert_bitwise(a, b)
            assert_bitwise(ga, g0)
            want = g0 if inv == 1.0 else (g0.float() * inv).to(dtype)
            assert_bitwise(gb, want)
