"""The EMA of the FP32 masters kept inside the fused step (``ema_decay``): what the rules x
formats table (tests/test_optim_table.py: test_ema, the EMA bit for bit against the documented
lerp in both of torch.lerp's forms; a skipped step, resume, torch.compile and CUDA with an EMA)
cannot say: torch's own ``AveragedModel(get_ema_multi_avg_fn)`` for what a user gets today,
under a loss scale, ema_weights(), state dicts across EMA settings, MixedPrecisionOptimizer,
and the op's checks. (Thread counts and ISA paths on a param split across threads with an EMA:
the table's test_same_bits_for_every_thread_count_and_isa.)
"""
import copy

import numpy as np
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import mpext
from mpext import ops
from mpext.optim import AdamW

import optim_table as T
from reference import lerp_f32

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def params(dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (128,), (3, 4, 5, 6), (0, 3), (1,), (64, 80)]  # the last: 8-bit moments
    out = [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]
    out[2] = out[2].to(memory_format=torch.channels_last)
    return [p.requires_grad_() for p in out]


def grads(ps, step, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * (10.0 ** (step % 5 - 3)))
            .to(dtype or p.dtype).to(p.device).contiguous(memory_format=torch.preserve_format)
            if p.dim() != 4 else
            (torch.randn(p.shape, generator=g)).to(dtype or p.dtype).to(p.device)
            .to(memory_format=torch.channels_last) for p in ps]




def test_ema_of_a_bf16_model_beats_averaged_model_in_bf16():
    """What a user gets today: AveragedModel on the bf16 model averages in bf16, where (1 -
    decay) * (p - ema) is mostly below half an ulp and lost. mpext's EMA of the masters stays
    with the EMA of an fp32 run (same data); AveragedModel(bf16) does not."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 64)
    m16 = copy.deepcopy(base).to(BF16)
    m32 = copy.deepcopy(m16).float()
    ours = AdamW(m16.parameters(), lr=1e-3, ema_decay=0.999)
    ref = torch.optim.AdamW(m32.parameters(), lr=1e-3, foreach=False)
    avg32 = AveragedModel(m32, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    avg16 = AveragedModel(m16, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    for step in range(300):
        x = torch.randn(32, 64)
        for model, opt in ((m16, ours), (m32, ref)):
            opt.zero_grad()
            model(x.to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
            opt.step()
        avg32.update_parameters(m32)
        avg16.update_parameters(m16)
    w32 = avg32.module.weight.detach()
    ours_err = (ours.ema_param(m16.weight) - w32).abs().mean().item()
    bf16_err = (avg16.module.weight.detach().float() - w32).abs().mean().item()
    assert ours_err * 20 < bf16_err, (ours_err, bf16_err)


def test_ema_under_grad_scaler_matches_unscaled(device):
    """The EMA of a run under a loss scale (a power of two: exact) equals the unscaled run's."""
    a, b = params(BF16, device), params(BF16, device)
    oa, ob = AdamW(a, lr=1e-2, ema_decay=0.99), AdamW(b, lr=1e-2, ema_decay=0.99)
    scaler = mpext.GradScaler(device, init_scale=2.0 ** 10, growth_interval=1000)
    scaler.scale(torch.zeros((), device=device))  # the scale is made by the first scale()
    for step in range(10):
        gs = grads(a, step)
        for p, q, g in zip(a, b, gs):
            p.grad = g.clone()
            q.grad = (g.float() * 2.0 ** 10).to(g.dtype)
        oa.step()
        scaler.step(ob)
        scaler.update()
    for p, q in zip(a, b):
        T.assert_bits(oa.ema_param(p), ob.ema_param(q))


@pytest.mark.parametrize("kw", [{}, dict(param_remainders=True)], ids=["master", "remainder"])
def test_ema_weights_swaps_in_and_back_exactly(kw):
    """Inside ema_weights() the params hold their EMA rounded to nearest even; after it they
    are exactly what they were, so training continues as if the swap never happened (masters
    and remainders still valid)."""
    a, b = params(BF16), params(BF16)
    oa, ob = AdamW(a, lr=1e-2, ema_decay=0.9, **kw), AdamW(b, lr=1e-2, ema_decay=0.9, **kw)
    for step in range(20):
        for opt, ps in ((oa, a), (ob, b)):
            for p, g in zip(ps, grads(ps, step)):
                p.grad = g
            opt.step()
        if step == 9:
            before = [p.detach().clone() for p in a]
            with oa.ema_weights() as o:
                assert o is oa
                for p in a:
                    T.assert_bits(p.detach(), oa.ema_param(p).to(BF16))
            for p, x in zip(a, before):
                T.assert_bits(p.detach(), x)
    for p, q in zip(a, b):
        T.assert_bits(p.detach(), q.detach())
        T.assert_bits(oa.master_param(p), ob.master_param(q))
        T.assert_bits(oa.ema_param(p), ob.ema_param(q))


def test_ema_weights_restores_after_an_exception():
    ps = params(BF16)
    opt = AdamW(ps, ema_decay=0.5)
    for p, g in zip(ps, grads(ps, 0)):
        p.grad = g
    opt.step()
    for p, g in zip(ps, grads(ps, 1)):
        p.grad = g
    opt.step()
    before = [p.detach().clone() for p in ps]
    with pytest.raises(KeyError):
        with opt.ema_weights():
            raise KeyError("evaluation failed")
    for p, x in zip(ps, before):
        T.assert_bits(p.detach(), x)


def test_ema_weights_without_an_ema_is_refused():
    opt = AdamW(params(BF16))
    with pytest.raises(RuntimeError, match=r"ema_weights: no param group keeps an EMA; "
                                           r"construct the optimizer with ema_decay"):
        with opt.ema_weights():
            pass


@pytest.mark.parametrize("bad", [1.5, -0.1, "0.9", float("nan"), True])
def test_bad_ema_decay(bad):
    with pytest.raises(ValueError, match=r"ema_decay must be None or a number in \[0, 1\], "
                                         r"got %s" % repr(bad).replace(".", r"\.")):
        AdamW(params(BF16), ema_decay=bad)


def test_state_dict_across_ema_settings():
    """ema_decay is a setting of the state dict's (as lr is, in torch): a state with an EMA
    brings it along; setting the group's ema_decay to None drops it at the next step. A state
    without one (torch's AdamW) loaded into an optimizer asking for one starts it from the
    param's fp32 value at the next step, then it follows the masters."""
    ps = params(BF16)
    with_ema = AdamW(ps, lr=1e-2, ema_decay=0.9)
    for p, g in zip(ps, grads(ps, 0)):
        p.grad = g
    with_ema.step()
    without = AdamW(ps, lr=1e-2)
    without.load_state_dict(with_ema.state_dict())
    assert without.param_groups[0]["ema_decay"] == 0.9
    for p in ps:
        T.assert_bits(without.ema_param(p), with_ema.ema_param(p))
    without.param_groups[0]["ema_decay"] = None
    for p, g in zip(ps, grads(ps, 1)):
        p.grad = g
    without.step()
    assert all("ema_param" not in s for s in without.state.values())

    qs = [p.detach().float().requires_grad_() for p in ps]
    torch_opt = torch.optim.AdamW(qs, lr=1e-2, foreach=False)
    for q, g in zip(qs, grads(ps, 0)):
        q.grad = g.float()
    torch_opt.step()
    again = AdamW(ps, lr=1e-2, ema_decay=0.9)
    again.load_state_dict(torch_opt.state_dict())
    assert again.param_groups[0]["ema_decay"] == 0.9  # torch's state has no such setting
    for p in ps:
        assert again.ema_param(p) is None  # made from the param at the next step
    for p, g in zip(ps, grads(ps, 1)):
        p.grad = g
    before = [p.detach().float() for p in ps]  # what the EMA starts from (not zeros)
    again.step()
    for p, e in zip(ps, before):
        want = lerp_f32(e, again.master_param(p), float(np.float32(1.0 - 0.9)))
        T.assert_bits(again.ema_param(p).contiguous(), want.reshape(p.shape).contiguous())


def test_mixed_precision_optimizer_keeps_the_inner_ema():
    """MixedPrecisionOptimizer around mpext.optim.AdamW(ema_decay=...): the fused path keeps
    the EMA of its FP32 masters, the same bits as mpext.optim.AdamW on the bf16 model."""
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 8).to(BF16)
    b = copy.deepcopy(a)
    plain = AdamW(a.parameters(), lr=1e-2, ema_decay=0.9)
    mpo = mpext.MixedPrecisionOptimizer(AdamW(b.parameters(), lr=1e-2, ema_decay=0.9),
                                        loss_scale=None)
    for step in range(5):
        x = torch.randn(4, 16).to(BF16)
        plain.zero_grad()
        a(x).float().pow(2).mean().backward()
        plain.step()
        mpo.zero_grad()
        mpo.backward(b(x).float().pow(2).mean())
        mpo.step()
    inner = mpo.optimizer
    for p, q in zip(a.parameters(), b.parameters()):
        master = mpo.master_param(q)
        T.assert_bits(plain.master_param(p), master)
        T.assert_bits(plain.ema_param(p), inner.state[master]["ema_param"])


def test_mixed_precision_optimizer_ema_weights():
    """MixedPrecisionOptimizer.ema_weights() puts the inner optimizer's EMA into the model's
    params (bf16 ones rounded to nearest even, the FP32 LayerNorm exactly), the same as
    mpext.optim.AdamW's own ema_weights() on an identical model, and gives every param and
    master back exactly; an inner optimizer with no EMA is refused."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    a[0].to(BF16)
    b = copy.deepcopy(a)
    plain = AdamW(a.parameters(), lr=1e-2, ema_decay=0.8)
    mpo = mpext.MixedPrecisionOptimizer(AdamW(b.parameters(), lr=1e-2, ema_decay=0.8),
                                        loss_scale=None)
    for step in range(4):
        x = torch.randn(4, 16).to(BF16)
        for opt, m in ((plain, a), (mpo, b)):
            opt.zero_grad()
            (mpo.backward if opt is mpo else torch.Tensor.backward)(
                m(x).float().pow(2).mean())
            opt.step()
    before = [q.detach().clone() for q in b.parameters()]
    masters = [mpo.master_param(q) for q in b.parameters()]
    masters = [None if m is None else m.clone() for m in masters]
    with plain.ema_weights(), mpo.ema_weights() as o:
        assert o is mpo
        for p, q in zip(a.parameters(), b.parameters()):
            T.assert_bits(q.detach(), p.detach())
            T.assert_bits(q.detach(), plain.ema_param(p).to(q.dtype))
    for q, x, m in zip(b.parameters(), before, masters):
        T.assert_bits(q.detach(), x)
        if m is not None:
            T.assert_bits(mpo.master_param(q), m)
    assert any(not torch.equal(plain.ema_param(p).to(p.dtype), x)
               for p, x in zip(a.parameters(), before))  # the swap changed something
    torch_inner = mpext.MixedPrecisionOptimizer(torch.optim.AdamW(copy.deepcopy(a).parameters()))
    no_ema = mpext.MixedPrecisionOptimizer(AdamW(copy.deepcopy(a).parameters()))
    for opt, name in ((torch_inner, "AdamW"), (no_ema, "AdamW")):
        with pytest.raises(RuntimeError, match=r"MixedPrecisionOptimizer.ema_weights: the inner "
                                               r"optimizer \(%s\) keeps no EMA" % name):
            with opt.ema_weights():
                pass


# --- the op: every check through the real and the fake kernel, with one message --------------

def _op_case(device):
    p = torch.randn(6, device=device).to(BF16)
    return dict(params=[p, torch.randn(3, device=device)],
                grads=[torch.randn(6, device=device).to(BF16), torch.randn(3, device=device)],
                exp_avgs=[torch.zeros(6, device=device), torch.zeros(3, device=device)],
                exp_avg_sqs=[torch.zeros(6, device=device), torch.zeros(3, device=device)],
                masters=[p.float(), torch.empty(0, device=device)],
                steps=[torch.zeros((), device=device), torch.zeros((), device=device)],
                ema_params=[torch.zeros(6, device=device), torch.zeros(3, device=device)])


OP_BAD = [
    (lambda kw: kw.update(ema_params=kw["ema_params"][:1]), ValueError,
     r"ema_params must be empty or have one entry per param \(2\), got 1"),
    (lambda kw: kw.update(ema_decay=1.5), ValueError, r"ema_decay must be in \[0, 1\], got 1.5"),
    (lambda kw: kw.update(ema_decay=-1e-3), ValueError, r"ema_decay must be in \[0, 1\]"),
    (lambda kw: kw["ema_params"].__setitem__(1, kw["ema_params"][1].double()), RuntimeError,
     r"ema_params\[1\] must have dtype float32, got float64"),
    (lambda kw: kw["ema_params"].__setitem__(0, torch.zeros(2, 3, device=kw["params"][0].device)),
     ValueError, r"ema_params\[0\] \(sizes \[2, 3\], strides \[3, 1\]\) must match params\[0\] "
                 r"\(sizes \[6\], strides \[1\]\)"),
    (lambda kw: kw["ema_params"].__setitem__(0, torch.zeros(12, device=kw["params"][0].device)
                                              [::2]),
     RuntimeError, r"ema_params\[0\] must be dense and non-overlapping"),
]


@pytest.mark.parametrize("change,exc,match", OP_BAD, ids=[m[:40] for _, _, m in OP_BAD])
def test_op_bad_ema_arguments_change_nothing(change, exc, match):
    dev = "cpu"  # the kernel's checks (the fake kernel checks none: tests/test_step_fake.py)
    kw = _op_case(dev)
    kw.setdefault("ema_decay", 0.9)
    change(kw)
    tensors = [t for v in kw.values() if isinstance(v, list) for t in v]
    before = [] if dev == "meta" else [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        ops.adam_step_(kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"],
                       kw["masters"], kw["steps"], torch.full((), 1e-2, device=dev),
                       ema_params=kw["ema_params"], ema_decay=kw["ema_decay"])
    for t, b in zip(tensors, before):
        assert T.same_bits(t, b)


def test_op_ema_overlapping_a_param_is_refused():
    kw = _op_case("cpu")
    kw["ema_params"][1] = kw["params"][1]  # fp32 param as its own EMA: both written
    with pytest.raises(RuntimeError, match=r"overlap"):
        ops.adam_step_(kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"],
                       kw["masters"], kw["steps"], 1e-2, ema_params=kw["ema_params"],
                       ema_decay=0.9)


def test_op_empty_ema_entry_means_none():
    kw = _op_case("cpu")
    kw["ema_params"][0] = torch.empty(0)
    ops.adam_step_(kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"],
                   kw["masters"], kw["steps"], 1e-2, ema_params=kw["ema_params"], ema_decay=0.5)
    T.assert_bits(kw["ema_params"][1], kw["params"][1].detach())  # the first step copies


def test_op_first_step_copies_whatever_the_ema_held():
    """On a param's first step the EMA becomes a copy of its new fp32 value, as
    AveragedModel's first update copies: an ema_params buffer holding NaN, Inf, -0.0 or huge
    values of the other sign (e.g. torch.empty) is overwritten, not lerped into NaN."""
    p = torch.randn(6).to(BF16)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), -3e38, 3e38, -0.0])
    kw = dict(params=[p], grads=[torch.randn(6).to(BF16)], exp_avgs=[torch.zeros(6)],
              exp_avg_sqs=[torch.zeros(6)], masters=[p.float()], steps=[torch.zeros(())])
    ema = junk.clone()
    ops.adam_step_(kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"], kw["masters"],
                   kw["steps"], torch.full((), 1e-2), ema_params=[ema], ema_decay=0.9)
    T.assert_bits(ema, kw["masters"][0])
    # later steps lerp, as torch.lerp does (an Inf that gets in stays one)
    ema[1] = float("inf")
    master_before = kw["masters"][0].clone()
    ops.adam_step_(kw["params"], kw["grads"], kw["exp_avgs"], kw["exp_avg_sqs"], kw["masters"],
                   kw["steps"], torch.full((), 1e-2), ema_params=[ema], ema_decay=0.9)
    assert not torch.equal(kw["masters"][0], master_before)
    want = lerp_f32(torch.where(torch.arange(6) == 1, torch.tensor(float("inf")),
                                master_before), kw["masters"][0], 0.1)
    T.assert_bits(ema, want)
