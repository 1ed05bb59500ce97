"""Checks every fused rule class of mpext.optim passes whatever its update (Lion, SGD, ...),
written once and called from each rule's test module (tests/test_lion.py, tests/test_sgd.py)
with the rule's factory: each storage format, the param storages agreeing bit for bit, CPU ISA
paths and thread counts, both GradScalers, state_dict round trips and conversions,
torch.compile. A rule is described by a :class:`Rule`: its class, keyword arguments that make
it move, the name of its moment setting and its op."""
import contextlib
import io
from typing import Any, Callable, Dict, NamedTuple, Optional

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mpext

from test_adam import assert_bitwise, opt_tensors, snapshot_opt

NAN, INF = float("nan"), float("inf")


class Rule(NamedTuple):
    cls: Callable
    kwargs: Dict[str, Any]      # hyperparameters that exercise the rule (momentum, decay, ...)
    moment_setting: Optional[str]  # "exp_avg_dtype", "momentum_dtype"
    moment: str                 # its state quantity: "exp_avg", "momentum_buffer"


# The param storages (param dtype, keywords) and the moment formats every rule takes.
PARAM_FORMATS = {
    "fp32": (torch.float32, {}),
    "bf16_master": (torch.bfloat16, {}),
    "bf16_remainder": (torch.bfloat16, {"param_remainders": True}),
    "bf16_nearest": (torch.bfloat16, {"master_weights": False}),
    "bf16_stochastic": (torch.bfloat16, {"master_weights": False, "stochastic_rounding": True}),
    "fp16_master": (torch.float16, {}),
    "fp16_stochastic": (torch.float16, {"master_weights": False, "stochastic_rounding": True}),
}
MOMENT_FORMATS = {
    "float32": (torch.float32, {}),
    "bfloat16": (torch.bfloat16, {}),
    "bfloat16_nearest": (torch.bfloat16, {"moment_rounding": "nearest"}),
    "q8": ("q8", {}),
}


def snapshot(opt):
    return snapshot_opt(opt)


def assert_same(now, then):
    assert [n for n, _ in now] == [n for n, _ in then]
    for (name, a), (_, b) in zip(now, then):
        assert_bitwise(a, b, name)


def make_params(dtype, shapes=((300,), (17, 5), (2048 + 3,)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def grads_for(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def formats_kwargs(rule, param_fmt, moment_fmt):
    dtype, kw = PARAM_FORMATS[param_fmt]
    kw = dict(kw)
    if rule.moment_setting is not None:
        mdt, mkw = MOMENT_FORMATS[moment_fmt]
        kw[rule.moment_setting] = mdt
        kw.update(mkw)
    return dtype, kw


def run(rule, param_fmt, moment_fmt, steps=4, seed=0, shapes=None, **extra):
    """An optimizer of the rule in the given formats after `steps` steps of fixed gradients."""
    dtype, kw = formats_kwargs(rule, param_fmt, moment_fmt)
    params = make_params(dtype, seed=seed) if shapes is None else make_params(dtype, shapes,
                                                                              seed)
    opt = rule.cls(params, **rule.kwargs, seed=7, **kw, **extra)
    for k in range(steps):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        opt.step()
    return opt


def check_every_format_moves_and_is_finite(rule, param_fmt, moment_fmt):
    """Every pair of formats steps: the params move, nothing turns NaN, the state has the
    format's keys (8-bit codes under their own keys, as docs/lean_state.md says)."""
    start = make_params(PARAM_FORMATS[param_fmt][0])
    opt = run(rule, param_fmt, moment_fmt)
    for p, p0 in zip(opt.param_groups[0]["params"], start):
        assert torch.isfinite(p.float()).all()
        assert not torch.equal(p.detach(), p0.detach())
        st = opt.state[p]
        if rule.moment_setting is None:
            continue
        coded = moment_fmt == "q8" and p.numel() >= mpext.optim.MIN_8BIT_NUMEL
        assert (rule.moment + "_q8" in st) == coded
        assert (rule.moment in st) == (not coded)
        if not coded:
            want = MOMENT_FORMATS[moment_fmt][0]
            want = torch.float32 if want == "q8" else want
            assert st[rule.moment].dtype == want


def check_remainder_equals_master(rule, moment_fmt):
    """A bf16 param's remainder holds the master exactly: the same bits as an FP32 master."""
    a = run(rule, "bf16_master", moment_fmt, steps=6)
    b = run(rule, "bf16_remainder", moment_fmt, steps=6)
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        assert_bitwise(p, q)
        assert_bitwise(a.master_param(p), b.master_param(q))
        assert_bitwise(a.state[p]["master_param"].to(torch.bfloat16), p.detach())


def check_isa_paths_agree(rule):
    """Every CPU ISA path gives the same bits in every format pair."""
    names = mpext.build_info()["cpu_isas_supported"]
    previous = mpext.cpu_isa()
    try:
        for pf in PARAM_FORMATS:
            for mf in (MOMENT_FORMATS if rule.moment_setting else ["float32"]):
                results = []
                for name in names:
                    mpext.set_cpu_isa(name)
                    results.append(snapshot(run(rule, pf, mf, steps=3)))
                for r in results[1:]:
                    assert_same(r, results[0])
    finally:
        mpext.set_cpu_isa(previous)


def check_thread_count_invariance(rule):
    """One large param (split across threads) gives the same bits on 1 and 2 threads."""
    n = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for pf, mf in (("bf16_stochastic", "bfloat16"), ("fp32", "q8")):
                out.append((t, pf, mf, snapshot(run(rule, pf, mf, steps=2,
                                                    shapes=((3, 1 << 17),)))))
    finally:
        torch.set_num_threads(n)
    half = len(out) // 2
    for (_, _, _, a), (_, _, _, b) in zip(out[:half], out[half:]):
        assert_same(a, b)


class Model(torch.nn.Module):
    """Mixed-dtype params: fp32 and bf16 layers, a loss in fp32."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 6, generator=gen))
        self.b = torch.nn.Parameter(torch.randn(6, 3, generator=gen).bfloat16())

    def forward(self, x):
        return (torch.tanh(x @ self.a).bfloat16() @ self.b).float()


def loss_of(model, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    return ((model(x) - y) ** 2).mean()


SCALERS = {"torch": torch.amp.GradScaler, "mpext": mpext.GradScaler}


def check_grad_scaler(rule, scaler_name):
    """Under a GradScaler: the unscale is fused (the same bits as unscale_ then step) and a
    poisoned step changes nothing, bitwise (steps not advanced)."""
    runs = []
    for fused in (True, False):
        model = Model()
        opt = rule.cls(model.parameters(), **dict(rule.kwargs, lr=1e-2))
        scaler = SCALERS[scaler_name]("cpu", init_scale=2.0 ** 10, growth_interval=4)
        runs.append((model, opt, scaler, fused))
    for step in range(8):
        for model, opt, scaler, fused in runs:
            opt.zero_grad()
            scaler.scale(loss_of(model, step)).backward()
            if step in (3, 4):
                model.b.grad.view(-1)[step] = NAN if step == 3 else INF
            if not fused:
                scaler.unscale_(opt)
            before = snapshot(opt)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if step in (3, 4):
                assert_same(opt_tensors(opt), before)
                assert scaler.get_scale() == scale * 0.5
        assert_same(opt_tensors(runs[0][1]), opt_tensors(runs[1][1]))
    assert runs[0][1].state[runs[0][0].a]["step"].item() == 6


def check_state_dict_resume(rule, param_fmt, moment_fmt):
    """Saving after 3 steps and loading into a new optimizer continues bit for bit."""
    dtype, kw = formats_kwargs(rule, param_fmt, moment_fmt)
    whole = run(rule, param_fmt, moment_fmt, steps=6)
    first = run(rule, param_fmt, moment_fmt, steps=3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    params = [torch.nn.Parameter(p.detach().clone()) for p in first.param_groups[0]["params"]]
    second = rule.cls(params, **rule.kwargs, seed=7, **kw)
    buf.seek(0)
    second.load_state_dict(torch.load(buf, weights_only=False))
    for k in range(3, 6):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        second.step()
    assert_same(opt_tensors(second), opt_tensors(whole))


def check_state_conversion(rule, src_fmt, dst_fmt):
    """A checkpoint of one moment format loads into an optimizer of another: the moments are
    converted (within the target format's rounding), and the step continues."""
    src = run(rule, "fp32", src_fmt, steps=3)
    sd = src.state_dict()
    params = [torch.nn.Parameter(p.detach().clone()) for p in src.param_groups[0]["params"]]
    _, kw = formats_kwargs(rule, "fp32", dst_fmt)
    dst = rule.cls(params, **rule.kwargs, seed=7, **kw)
    dst.load_state_dict(sd)
    fmt = mpext.optim.formats
    for p, q in zip(src.param_groups[0]["params"], params):
        a = src.state[p]
        b = dst.state[q]
        want = (fmt.Q8.decode(a[rule.moment + "_q8"], a[rule.moment + "_q8_scale"])
                if rule.moment + "_q8" in a else a[rule.moment].float())
        got = (fmt.Q8.decode(b[rule.moment + "_q8"], b[rule.moment + "_q8_scale"])
               if rule.moment + "_q8" in b else b[rule.moment].float())
        tol = {"float32": 0, "bfloat16": 2 ** -8, "bfloat16_nearest": 2 ** -8, "q8": 2 ** -4}
        scale = want.abs().max().item() + 1e-30
        assert (got - want).abs().max().item() <= tol[dst_fmt] * scale + 0.0
    for p, g in zip(params, grads_for(params, 3)):
        p.grad = g
    dst.step()
    assert all(torch.isfinite(p).all() for p in params)


def check_compiled_step(rule):
    """torch.compile(opt.step): no graph break, at most 2 compiles in 20 steps, the same bits
    as eager steps."""
    from torch._dynamo.utils import counters
    results = []
    frames = None
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        model = Model()
        opt = rule.cls(model.parameters(), **dict(rule.kwargs, lr=1e-2))
        counter = CompileCounter()
        step = torch.compile(opt.step, backend=counter) if compiled else opt.step
        for i in range(20):
            gen = torch.Generator().manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            step(found_inf=torch.tensor(float(i == 5)))
        if compiled:
            frames = counter.frame_count
            assert not counters["graph_break"], dict(counters["graph_break"])
        results.append(snapshot(opt))
    assert 1 <= frames <= 2, frames
    assert_same(results[1], results[0])


def check_op_bad_input(op, base, change, exc, match, device):
    """A call of ``op`` with keyword arguments ``base`` (CPU tensors) changed by ``change``
    raises ``exc`` matching ``match`` and writes nothing, through the real kernel (cpu) or the
    fake one (meta)."""
    kw = dict(base, **change)
    def to(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    kw = {k: [to(t) for t in v] if isinstance(v, list) else to(v) for k, v in kw.items()}
    tensors = [t for v in kw.values() for t in (v if isinstance(v, list) else [v])
               if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors] if device != "meta" else []
    with pytest.raises(exc, match=match):
        op(**kw)
    for a, b in zip(tensors, before):
        assert_bitwise(a, b)


@contextlib.contextmanager
def isa(name):
    previous = mpext.cpu_isa()
    mpext.set_cpu_isa(name)
    try:
        yield
    finally:
        mpext.set_cpu_isa(previous)


def rule_tests(rule, resume_formats=(("fp32", "float32"), ("bf16_remainder", "q8"),
                                     ("bf16_stochastic", "bfloat16"),
                                     ("fp16_master", "bfloat16_nearest"))):
    """The tests every rule passes, as test functions for a rule's test module to take into
    its namespace (``globals().update(rule_tests(RULE))``): one place to add a check."""
    moments = sorted(MOMENT_FORMATS) if rule.moment_setting else [None]

    @pytest.mark.parametrize("moment_fmt", moments)
    @pytest.mark.parametrize("param_fmt", sorted(PARAM_FORMATS))
    def test_every_format(param_fmt, moment_fmt):
        check_every_format_moves_and_is_finite(rule, param_fmt, moment_fmt)

    def test_isa_paths_agree():
        check_isa_paths_agree(rule)

    def test_thread_count_invariance():
        check_thread_count_invariance(rule)

    @pytest.mark.parametrize("scaler_name", sorted(SCALERS))
    def test_grad_scaler(scaler_name):
        check_grad_scaler(rule, scaler_name)

    def test_compiled_step():
        check_compiled_step(rule)

    tests = dict(test_every_format=test_every_format, test_isa_paths_agree=test_isa_paths_agree,
                 test_thread_count_invariance=test_thread_count_invariance,
                 test_grad_scaler=test_grad_scaler, test_compiled_step=test_compiled_step)
    if rule.moment_setting is None:
        return tests

    @pytest.mark.parametrize("moment_fmt", moments)
    def test_remainder_equals_master(moment_fmt):
        check_remainder_equals_master(rule, moment_fmt)

    @pytest.mark.parametrize("param_fmt,moment_fmt", list(resume_formats))
    def test_state_dict_resume(param_fmt, moment_fmt):
        check_state_dict_resume(rule, param_fmt, moment_fmt)

    @pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("float32", "q8"),
                                         ("q8", "float32"), ("bfloat16", "float32")])
    def test_state_conversion(src, dst):
        check_state_conversion(rule, src, dst)

    tests.update(test_remainder_equals_master=test_remainder_equals_master,
                 test_state_dict_resume=test_state_dict_resume,
                 test_state_conversion=test_state_conversion)
    return tests
