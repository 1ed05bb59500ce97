"""mpext.optim.lr_scheduler: device-side schedules against torch's own schedulers (and
transformers' warm-up schedules), holding still on skipped steps with every source of the skip
flag, no host sync, torch.compile, state_dict/resume, bad arguments."""
import gc
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mpext
from mpext.optim import lr_scheduler as S
from conftest import HostReads
from optim_table import f32

TS = torch.optim.lr_scheduler
BASES = (1e-3, 3e-4, 0.1)  # three param groups, three base rates


def groups(dtype=torch.float32, opt_cls=mpext.optim.AdamW, n=len(BASES), **kw):
    params = [torch.nn.Parameter(torch.zeros(3, dtype=dtype)) for _ in range(n)]
    return params, opt_cls([{"params": [p], "lr": lr} for p, lr in zip(params, BASES[:n])], **kw)


def lrs(opt):
    return [g["lr"].item() for g in opt.param_groups]


# ---------------------------------------------------------------------------------------------
# Values: torch's closed forms exactly (float32 rounding of the float64 formula), torch's own
# stepping to within its recursive formulas' drift.

# (mpext factory, torch factory) on an optimizer
CASES = {
    "linear_warmup": (lambda o: S.LinearLR(o, 0.01, 1.0, 37),
                      lambda o: TS.LinearLR(o, 0.01, 1.0, 37)),
    "linear_decay": (lambda o: S.LinearLR(o, 1.0, 0.0, 150),
                     lambda o: TS.LinearLR(o, 1.0, 0.0, 150)),
    "constant": (lambda o: S.ConstantLR(o, 0.25, 20), lambda o: TS.ConstantLR(o, 0.25, 20)),
    "cosine": (lambda o: S.CosineAnnealingLR(o, 120, eta_min=1e-5),
               lambda o: TS.CosineAnnealingLR(o, 120, eta_min=1e-5)),
}


def closed_form(torch_sched, e):
    """torch's own formula for step e (LambdaLR's get_lr is one)."""
    torch_sched.last_epoch = e
    if hasattr(torch_sched, "_get_closed_form_lr"):
        return torch_sched._get_closed_form_lr()
    with TS._enable_get_lr_call(torch_sched):
        return torch_sched.get_lr()


@pytest.mark.parametrize("name", sorted(CASES))
def test_closed_forms_exact(name):
    mine, theirs = CASES[name]
    _, opt = groups()
    sched = mine(opt)
    _, topt = groups(opt_cls=torch.optim.AdamW)
    ref = theirs(topt)
    for e in range(200):
        assert lrs(opt) == [f32(v) for v in closed_form(ref, e)], (name, e)
        sched.step(skipped=False)
    assert sched.last_epoch == 200


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch_stepping(name):
    """torch steps LinearLR/ConstantLR/CosineAnnealingLR by recursive formulas (each rate from
    the previous one): equal to within a few float32 units in the last place."""
    mine, theirs = CASES[name]
    params, opt = groups()
    sched = mine(opt)
    tparams, topt = groups(opt_cls=torch.optim.AdamW)
    ref = theirs(topt)
    for e in range(200):
        want = torch.tensor([g["lr"] for g in topt.param_groups], dtype=torch.float64)
        got = torch.tensor(lrs(opt), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-12)
        for p in params + tparams:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
        topt.step()
        ref.step()


def test_lambda_exact():
    """LambdaLR with the same lambda written in torch ops (for mpext) and in Python (for torch)."""
    _, opt = groups()
    sched = S.LambdaLR(opt, lambda e: torch.where(e < 10, (e + 1) / 10, 0.97 ** (e - 10)))
    _, topt = groups(opt_cls=torch.optim.AdamW)
    ref = TS.LambdaLR(topt, lambda e: (e + 1) / 10 if e < 10 else 0.97 ** (e - 10))
    for e in range(80):
        assert lrs(opt) == [f32(v) for v in closed_form(ref, e)]
        sched.step(skipped=False)
    # one lambda per group
    _, opt = groups()
    fns = [lambda e: 1 / (1 + e), lambda e: torch.exp(-e / 7), lambda e: 0.5]
    sched = S.LambdaLR(opt, fns)
    for e in range(30):
        b = BASES
        want = [b[0] * (1 / (1 + e)), b[1] * math.exp(-e / 7), b[2] * 0.5]
        assert lrs(opt) == pytest.approx([f32(w) for w in want], rel=1e-7)
        sched.step(skipped=False)


def sequential_pair(opt, topt, W=25, T=180):
    mine = S.SequentialLR(opt, [S.LinearLR(opt, 0.001, 1.0, W),
                                S.CosineAnnealingLR(opt, T - W - 30, eta_min=2e-6),
                                S.ConstantLR(opt, 0.02, 10 ** 6)], milestones=[W, T - 30])
    theirs = TS.SequentialLR(topt, [TS.LinearLR(topt, 0.001, 1.0, W),
                                    TS.CosineAnnealingLR(topt, T - W - 30, eta_min=2e-6),
                                    TS.ConstantLR(topt, 0.02, 10 ** 6)], milestones=[W, T - 30])
    return mine, theirs


def test_sequential_closed_form_and_stepping():
    """Warm-up, cosine, then a constant floor: exact against the children's closed forms at
    the local step SequentialLR gives them, and close to torch's SequentialLR stepping."""
    params, opt = groups()
    sched, _ = sequential_pair(opt, groups(opt_cls=torch.optim.AdamW)[1])
    tparams, topt = groups(opt_cls=torch.optim.AdamW)
    _, ref = sequential_pair(groups()[1], topt)
    _, cf_opt = groups(opt_cls=torch.optim.AdamW)
    kids = [TS.LinearLR(cf_opt, 0.001, 1.0, 25), TS.CosineAnnealingLR(cf_opt, 125, eta_min=2e-6),
            TS.ConstantLR(cf_opt, 0.02, 10 ** 6)]
    starts = [0, 25, 150]
    for e in range(220):
        k = max(i for i, s in enumerate(starts) if e >= s)
        assert lrs(opt) == [f32(v) for v in closed_form(kids[k], e - starts[k])], e
        want = torch.tensor([g["lr"] for g in topt.param_groups], dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(lrs(opt), dtype=torch.float64), want,
                                   rtol=3e-7, atol=1e-12)
        for p in params + tparams:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
        topt.step()
        ref.step()


def test_transformers_schedules_exact():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    for name, args in (("get_linear_schedule_with_warmup", (12, 90)),
                       ("get_cosine_schedule_with_warmup", (12, 90)),
                       ("get_constant_schedule_with_warmup", (12,)),
                       ("get_linear_schedule_with_warmup", (0, 50)),
                       ("get_cosine_schedule_with_warmup", (7, 7))):
        _, opt = groups()
        sched = getattr(S, name)(opt, *args)
        _, topt = groups(opt_cls=torch.optim.AdamW)
        ref = getattr(transformers, name)(topt, *args)
        for e in range(110):
            assert lrs(opt) == [f32(v) for v in closed_form(ref, e)], (name, args, e)
            sched.step(skipped=False)
    # num_cycles other than 0.5
    _, opt = groups()
    sched = S.get_cosine_schedule_with_warmup(opt, 5, 60, num_cycles=1.5)
    _, topt = groups(opt_cls=torch.optim.AdamW)
    ref = transformers.get_cosine_schedule_with_warmup(topt, 5, 60, num_cycles=1.5)
    for e in range(70):
        assert lrs(opt) == [f32(v) for v in closed_form(ref, e)]
        sched.step(skipped=False)


# ---------------------------------------------------------------------------------------------
# Holding still on skipped steps, with every source of the skip flag. The reference is a plain
# host loop that knows which steps overflowed (it injected them) and evaluates torch's closed
# form at the count of applied steps.

OVERFLOW = {2, 3, 7, 11, 12, 13}
STEPS = 18


def cosine_ref(applied):
    _, topt = groups(opt_cls=torch.optim.AdamW)
    ref = TS.CosineAnnealingLR(topt, 15, eta_min=1e-5)
    return [f32(v) for v in closed_form(ref, applied)]


def run_with_overflows(step_fn, opt, sched, params, check=True):
    applied = 0
    for i in range(STEPS):
        for p in params:
            p.grad = torch.full_like(p, float("inf") if i in OVERFLOW else 1.0)
        step_fn()
        sched.step()
        applied += i not in OVERFLOW
        if check:
            assert lrs(opt) == cosine_ref(applied), i
            assert sched.last_epoch == applied
    return applied


def scaler_step(scaler, opt):
    def step():
        scaler.scale(torch.ones(()))  # makes the scale tensor, as the loss would
        scaler.step(opt)
        scaler.update()
    return step


def test_holds_on_skip_mpext_scaler_fused():
    params, opt = groups(torch.bfloat16)
    scaler = mpext.GradScaler("cpu")
    sched = S.CosineAnnealingLR(opt, 15, eta_min=1e-5)

    def step():
        scaler_step(scaler, opt)()
        assert bool(S.step_was_skipped(opt)) == bool(scaler.last_step_skipped(opt))

    run_with_overflows(step, opt, sched, params)


def test_holds_on_skip_torch_scaler_fused():
    params, opt = groups()
    scaler = torch.amp.GradScaler("cpu")
    sched = S.CosineAnnealingLR(opt, 15, eta_min=1e-5)

    run_with_overflows(scaler_step(scaler, opt), opt, sched, params)


def test_holds_on_skip_non_fused_optimizer_with_scaler_arg():
    """torch's SGD is stepped by the scaler only after a host check; the scaler's record (an
    mpext.GradScaler given as scaler=) tells the schedule."""
    params, opt = groups(opt_cls=torch.optim.SGD)
    scaler = mpext.GradScaler("cpu")
    sched = S.CosineAnnealingLR(opt, 15, eta_min=1e-5, scaler=scaler)

    run_with_overflows(scaler_step(scaler, opt), opt, sched, params)


@pytest.mark.parametrize("inner", ["torch_adamw", "sgd"])
def test_holds_on_skip_mixed_precision_optimizer(inner):
    """The scheduler on the wrapper or on the optimizer it wraps: the wrapper's scaler tells."""
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in BASES]
    cls = torch.optim.AdamW if inner == "torch_adamw" else torch.optim.SGD
    raw = cls([{"params": [p], "lr": lr} for p, lr in zip(params, BASES)])
    sched = S.CosineAnnealingLR(raw, 15, eta_min=1e-5)  # made on the raw optimizer
    opt = mpext.MixedPrecisionOptimizer(raw)
    run_with_overflows(opt.step, opt, sched, params)
    # and made on the wrapper
    params2 = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)) for _ in BASES]
    opt2 = mpext.MixedPrecisionOptimizer(cls([{"params": [p], "lr": lr}
                                              for p, lr in zip(params2, BASES)]))
    sched2 = S.CosineAnnealingLR(opt2, 15, eta_min=1e-5)
    run_with_overflows(opt2.step, opt2, sched2, params2)


def test_explicit_flag_and_found_inf_argument():
    params, opt = groups()
    sched = S.CosineAnnealingLR(opt, 15, eta_min=1e-5)
    flag = torch.zeros(())

    def step():
        flag.fill_(float(not torch.isfinite(params[0].grad).all()))
        opt.step(found_inf=flag)

    run_with_overflows(step, opt, sched, params)
    # skipped= given explicitly: a bool tensor, a float found_inf, a Python bool
    _, opt = groups()
    sched = S.LinearLR(opt, 0.5, 1.0, 4)
    for skipped in (torch.tensor(True), torch.tensor(0.0), False, True, torch.tensor(1.0)):
        sched.step(skipped=skipped)
    assert sched.last_epoch == 2


def test_no_host_sync_in_step():
    params, opt = groups(torch.bfloat16)
    scaler = mpext.GradScaler("cpu")
    sched = S.SequentialLR(opt, [S.LinearLR(opt, 0.0, 1.0, 5), S.CosineAnnealingLR(opt, 50)],
                           [5])
    for i in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        reads = HostReads()
        with reads.counting():
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
            sched.step()
            S.step_was_skipped(opt)
        assert reads.count == 0, reads.calls


def test_warns_when_no_optimizer_step_was_seen():
    _, opt = groups()
    sched = S.LinearLR(opt, 0.5, 1.0, 4)
    with pytest.warns(UserWarning, match="before any step"):
        sched.step()
    assert sched.last_epoch == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()


def test_framework_wrappers_are_looked_through():
    """A scheduler made on a wrapper that forwards param_groups (accelerate's, Lightning's)
    sees the skip flag of the optimizer it wraps."""

    class Wrapper:  # the shape of accelerate's AcceleratedOptimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        def step(self, *a, **k):
            return self.optimizer.step(*a, **k)

    params, raw = groups()
    opt = Wrapper(raw)
    scaler = mpext.GradScaler("cpu")
    sched = S.CosineAnnealingLR(opt, 15, eta_min=1e-5)

    run_with_overflows(scaler_step(scaler, raw), opt, sched, params)


# ---------------------------------------------------------------------------------------------
# torch.compile, state_dict / resume, optimizer state loading, bad arguments.


def warmup_cosine():
    _, opt = groups()
    return opt, S.SequentialLR(opt, [S.LinearLR(opt, 0.0, 1.0, 6),
                                     S.CosineAnnealingLR(opt, 30, eta_min=1e-6)], [6])


def test_torch_compile_fullgraph():
    eager_opt, eager = warmup_cosine()
    comp_opt, comp = warmup_cosine()
    torch._dynamo.reset()
    step = torch.compile(lambda flag: comp.step(skipped=flag), backend="aot_eager",
                         fullgraph=True)
    flags = [0.0, 0.0, 1.0, 0.0, 1.0, 1.0] + [0.0] * 30
    for f in flags:
        flag = torch.tensor(f)
        eager.step(skipped=flag)
        step(flag)
        assert lrs(comp_opt) == lrs(eager_opt)
    assert comp.last_epoch == eager.last_epoch == flags.count(0.0)


def test_state_dict_resume_continues_identically():
    params, opt = groups(torch.bfloat16)
    scaler = mpext.GradScaler("cpu")
    sched = S.get_cosine_schedule_with_warmup(opt, 4, 40)

    def one(i, opt, sched, scaler, params):
        for p in params:
            p.grad = torch.full_like(p, float("inf") if i % 5 == 2 else 0.5)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        sched.step()

    for i in range(10):
        one(i, opt, sched, scaler, params)
    ckpt = {"opt": opt.state_dict(), "sched": sched.state_dict(), "scaler": scaler.state_dict(),
            "params": [p.detach().clone() for p in params]}
    ckpt = torch.load(_roundtrip(ckpt), weights_only=True)
    # a fresh run, resumed: optimizer first (its saved lr tensors replace the groups' lr), then
    # the scheduler, as Lightning and HF Trainer restore them
    params2, opt2 = groups(torch.bfloat16)
    with torch.no_grad():
        for p, v in zip(params2, ckpt["params"]):
            p.copy_(v)
    sched2 = S.get_cosine_schedule_with_warmup(opt2, 4, 40)
    scaler2 = mpext.GradScaler("cpu")
    opt2.load_state_dict(ckpt["opt"])
    assert all(g["lr"] is v for g, v in zip(opt2.param_groups, sched2._views))  # rebound
    sched2.load_state_dict(ckpt["sched"])
    scaler2.load_state_dict(ckpt["scaler"])
    for i in range(10, 30):
        one(i, opt, sched, scaler, params)
        one(i, opt2, sched2, scaler2, params2)
        assert lrs(opt) == lrs(opt2)
        assert all(torch.equal(a, b) for a, b in zip(params, params2))
    assert sched.last_epoch == sched2.last_epoch == 30 - len([i for i in range(30) if i % 5 == 2])


def _roundtrip(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_lr_is_rebound_at_once_after_a_wrapper_loads_its_state():
    """A schedule made on a MixedPrecisionOptimizer watches the inner optimizer's loads (the
    wrapper runs no load hooks of its own): right after the wrapper's load_state_dict the groups
    hold the schedule's rate tensors again, so the next step reads the schedule's rate."""
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in BASES]
    mpo = mpext.MixedPrecisionOptimizer(torch.optim.AdamW([{"params": [p], "lr": lr}
                                                           for p, lr in zip(params, BASES)]))
    sched = S.LinearLR(mpo, 0.5, 1.0, 4)
    saved = mpo.state_dict()
    sched.step(skipped=False)
    mpo.load_state_dict(saved)
    assert all(g["lr"] is v for g, v in zip(mpo.param_groups, sched._views))
    assert lrs(mpo) == [f32(b * (0.5 + 0.5 / 4)) for b in BASES]


def test_lr_is_rebound_after_replacement_and_get_last_lr_copies():
    params, opt = groups()
    sched = S.LinearLR(opt, 0.5, 1.0, 4)
    opt.param_groups[1]["lr"] = 123.0  # replaced by hand: the next step puts the tensor back
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    assert opt.param_groups[1]["lr"] is sched._views[1]
    last = sched.get_last_lr()
    last[0].fill_(7.0)
    assert lrs(opt)[0] == f32(BASES[0] * (0.5 + 0.5 * 1 / 4))
    assert all(t.dtype == torch.float32 and t.dim() == 0 for t in sched.get_last_lr())


def test_bad_arguments():
    _, opt = groups()
    with pytest.raises(ValueError, match="T_max"):
        S.CosineAnnealingLR(opt, 0)
    with pytest.raises(ValueError, match="start_factor"):
        S.LinearLR(opt, 1.5, 1.0, 3)
    with pytest.raises(ValueError, match="total_iters"):
        S.LinearLR(opt, 0.5, 1.0, 0)
    with pytest.raises(ValueError, match="factor"):
        S.ConstantLR(opt, -0.1, 3)
    with pytest.raises(TypeError, match="optimizer"):
        S.LinearLR(object(), 0.5, 1.0, 3)
    with pytest.raises(ValueError, match="lr_lambdas"):
        S.LambdaLR(opt, [lambda e: e])
    with pytest.raises(TypeError, match="mpext.optim.lr_scheduler scheduler"):
        S.SequentialLR(opt, [TS.LinearLR(opt, 0.5, 1.0, 3)], [])
    a, b = S.LinearLR(opt, 0.5, 1.0, 3), S.ConstantLR(opt, 0.5, 3)
    with pytest.raises(ValueError, match="milestones"):
        S.SequentialLR(opt, [a, b], [3, 4])
    with pytest.raises(ValueError, match="milestones"):
        S.SequentialLR(opt, [a, b], [-1])
    seq = S.SequentialLR(opt, [a, b], [3])
    with pytest.raises(RuntimeError, match="SequentialLR"):
        a.step()
    with pytest.raises(TypeError, match="epoch"):
        seq.step(3)
    with pytest.raises(ValueError, match="last_epoch"):
        seq.load_state_dict({"last_epoch": -2})
    with pytest.raises(TypeError, match="mpext.GradScaler"):
        S.step_was_skipped(opt, scaler=torch.amp.GradScaler("cpu"))
    opt.param_groups[0]["initial_lr"] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        S.LinearLR(opt, 0.5, 1.0, 3)


def test_is_a_torch_lr_scheduler_and_drives_torch_fused_adamw():
    """Frameworks check for torch's LRScheduler base class; torch's own fused AdamW reads the
    tensor lr on the device, so its updates follow the schedule like mpext's."""
    _, opt = groups()
    assert isinstance(S.LinearLR(opt, 0.5, 1.0, 3), TS.LRScheduler)
    params, topt = groups(opt_cls=torch.optim.AdamW, fused=True)
    sched = S.LinearLR(topt, 0.5, 1.0, 3)
    ref_params, ropt = groups(opt_cls=torch.optim.AdamW, fused=True)
    rsched = TS.LinearLR(ropt, 0.5, 1.0, 3)
    for _ in range(5):
        for p in params + ref_params:
            p.grad = torch.ones_like(p)
        topt.step()
        sched.step()
        ropt.step()
        rsched.step()
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def _bits(tensors):
    """The bit patterns of tensors (for bit-for-bit comparisons of any dtype)."""
    return [t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
            for t in tensors]


def _compiled_steps(make, compiled, steps=20):
    """Runs ``steps`` iterations of ``make()``'s (model, optimizer, one-step function) with a
    warm-up cosine schedule, through torch.compile(opt.step) (a CompileCounter backend, which
    runs the captured graphs as they are, so results stay bit for bit) or eagerly; step 5's
    gradients overflow. Returns the rates after each step, the params' bits, the schedule's
    count and the number of frames compiled after each step. The first-step warning would fail
    the run: once a compiled step ran, the schedule must know it."""
    lin, opt, step_fn = make()
    sched = S.get_cosine_schedule_with_warmup(opt, 3, steps)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter) if compiled else opt.step
    rates, frames = [], []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*before any step")
        for i in range(steps):
            if i in (8, 12):  # another scheduled optimizer made, then collected
                _scheduled_garbage(i == 8)
            step_fn(lin, step, i, overflow=(i == 5))
            sched.step()
            rates.append(lrs(opt))
            frames.append(counter.frame_count)
    return rates, _bits(lin.parameters()), sched.last_epoch, frames


_kept = []


def _scheduled_garbage(make):
    """Makes an unrelated optimizer with a schedule (kept alive), or drops it and collects it:
    what another test, or another model in the user's process, does while a compiled step is in
    use. The step's compiled code must not depend on it."""
    if make:
        other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        _kept.append((other, S.get_cosine_schedule_with_warmup(other, 3, 10)))
    else:
        _kept.clear()
        gc.collect()


def _mpext_adamw():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
    return lin, mpext.optim.AdamW(lin.parameters(), lr=1e-2, weight_decay=0.1), _found_inf_step


def _found_inf_step(lin, step, i, overflow):
    gen = torch.Generator().manual_seed(i)
    for p in lin.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    step(found_inf=torch.tensor(float(overflow)))  # as a GradScaler hands it


def _mixed_precision():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(torch.float16)
    mpo = mpext.MixedPrecisionOptimizer(mpext.optim.AdamW(lin.parameters(), lr=1e-2),
                                        loss_scale="dynamic", init_scale=2.0 ** 8)

    def one(lin, step, i, overflow):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=gen).to(torch.float16), torch.randn(4, 4,
                                                                              generator=gen)
        mpo.zero_grad()
        mpo.backward(((lin(x).float() - y) ** 2).mean())
        if overflow:
            lin.weight.grad.view(-1)[1] = float("inf")
        step()

    return lin, mpo, one


@pytest.mark.parametrize("make", [_mpext_adamw, _mixed_precision],
                         ids=["mpext_adamw", "mixed_precision_optimizer"])
def test_compiled_step_with_schedule_does_not_recompile(make):
    """torch.compile(opt.step) with a schedule attached: the step hook that records the skip
    flag for the schedule changes nothing the compiled step reads, so no step after the second
    compiles anything (the first compiles the step's setup: the optimizer's state, the
    wrapper's lazily made scale; the second the steady step), where a count in the hook made
    every step recompile until dynamo's limit sent it back to eager. The rates, the held step
    and the params equal the eager run's bit for bit. Another scheduled optimizer made and
    garbage-collected in between changes nothing either (a global registry the hook read became
    guards on its keys: a collection during compilation crashed dynamo, one after recompiled)."""
    torch._dynamo.reset()
    eager_rates, eager_params, eager_count, _ = _compiled_steps(make, compiled=False)
    rates, params, count, frames = _compiled_steps(make, compiled=True)
    torch._dynamo.reset()
    assert frames[1] == frames[-1], frames
    if make is _mpext_adamw:
        assert frames[-1] <= 2, frames  # the optimizer's own step, whole
    assert count == eager_count == 19
    assert rates == eager_rates
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from inside inductor
def test_torch_compile_inductor():
    """The default backend (inductor generates its own kernels for the schedule's math): the
    same rates as eager to within a float32 unit in the last place."""
    eager_opt, eager = warmup_cosine()
    comp_opt, comp = warmup_cosine()
    torch._dynamo.reset()
    step = torch.compile(lambda flag: comp.step(skipped=flag), fullgraph=True)
    for i in range(20):
        flag = torch.tensor(float(i % 3 == 0))
        eager.step(skipped=flag)
        step(flag)
        torch.testing.assert_close(torch.tensor(lrs(comp_opt)), torch.tensor(lrs(eager_opt)),
                                   rtol=1.2e-7, atol=0)
    assert comp.last_epoch == eager.last_epoch


def test_framework_modules_import_cleanly_or_say_what_to_install():
    """``import mpext`` imports no framework; mpext.lightning / mpext.accelerate without their
    framework raise an ImportError naming the package to install."""
    code = ("import sys\n"
            "import mpext, mpext.optim.lr_scheduler\n"
            "bad = [m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "for mod, blocked, hint in (('mpext.lightning', 'lightning', 'pip install lightning'),\n"
            "                           ('mpext.accelerate', 'accelerate', 'pip install accelerate')):\n"
            "    sys.modules[blocked] = None\n"
            "    try:\n"
            "        __import__(mod)\n"
            "    except ImportError as e:\n"
            "        assert hint in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(mod + ' imported without ' + blocked)\n"
            "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
