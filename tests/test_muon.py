"""mpext.ops.muon_momentum_step_ / muon_update_step_ and mpext.optim.Muon: torch.optim.Muon's update bit for bit on FP32 params
(its elementwise phases against torch's own lerp / mul_ / add_ on every length and ISA path;
the whole optimizer against torch.optim.Muon), FP32 masters and remainders bit for bit with the
same fp32 values, bad inputs, opcheck, state_dict round trips with torch.optim.Muon, bytes per
param from live tensors, and the mixed model (Muon + AdamW in one optimizer) on HF GPT-2 against
torch.optim.Muon + torch.optim.AdamW on the same split."""
import math

import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import Muon, muon_param_groups
from mpext.optim.muon import adjust_lr_ratio, newton_schulz

import optim_table as T
from optim_table import f32

pytestmark = pytest.mark.filterwarnings("ignore:.*master_weights=False without stochastic")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 511, 512, 513, 1000, 4099]


def zero(device):
    return torch.zeros((), device=device)


# --------------------------------------------------------------------------------------------
# The op's phases against torch's own ops (torch.optim.Muon's lines), on the CPU.

def _phase1_ref(buf, g, momentum, nesterov):
    buf.lerp_(g, 1 - momentum)
    u = g.lerp(buf, momentum) if nesterov else buf
    return u.bfloat16()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.95, 0.3, 0.0, 0.5])
def test_phase1_bitwise_torch(device, momentum, nesterov):
    """Phase 1 on the device; torch's lerp_ / lerp / .bfloat16() on the CPU."""
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        buf_ref = torch.randn(n, generator=gen) * 0.1
        buf = buf_ref.to(device).clone()  # (to() of a CPU tensor is the tensor itself)
        step = zero(device)
        for k in range(4):
            g = torch.randn(n, generator=gen) * (10.0 ** (k - 2))
            u_ref = _phase1_ref(buf_ref, g, momentum, nesterov)
            u = torch.empty(n, dtype=BF16, device=device)
            ops.muon_momentum_step_([u], [g.to(device)], [buf], [step], momentum, nesterov)
            T.assert_bits(buf.cpu(), buf_ref, "buffer n=%d k=%d" % (n, k))
            T.assert_bits(u.cpu(), u_ref, "update n=%d k=%d" % (n, k))
        assert step.item() == 4  # (as every rule's op; mpext.optim.Muon passes a copy)


@pytest.mark.parametrize("wd", [0.0, 0.1, 1.5])
@pytest.mark.parametrize("ratio", [1.0, math.sqrt(3.0), 0.2 * math.sqrt(768)])
def test_phase3_bitwise_torch(device, wd, ratio):
    """Phase 3 on the device; torch's mul_ and add_(bf16 update, alpha) on the CPU."""
    gen = torch.Generator().manual_seed(1)
    lr = f32(0.02)
    for n in SIZES:
        p_ref = torch.randn(n, generator=gen)
        p = p_ref.to(device).clone()
        step = zero(device)
        for k in range(3):
            o = torch.randn(n, generator=gen).bfloat16()
            p_ref.mul_(1 - lr * wd)
            p_ref.add_(o, alpha=-(lr * ratio))
            ops.muon_update_step_([p], [o.float().to(device)], [], [step], lr, ratio, wd)
            T.assert_bits(p.cpu(), p_ref, "param n=%d k=%d" % (n, k))
        assert step.item() == 3


def test_phases_every_isa_path_bitwise_torch(isa):
    """Both phases on the ISA path of the conftest fixture ``isa``."""
    gen = torch.Generator().manual_seed(2)
    for n in SIZES:
        buf, g = torch.randn(n, generator=gen) * 0.1, torch.randn(n, generator=gen)
        buf_ref = buf.clone()
        u_ref = _phase1_ref(buf_ref, g, 0.95, True)
        u = torch.empty(n, dtype=BF16)
        ops.muon_momentum_step_([u], [g], [buf], [torch.zeros(())], 0.95, True)
        T.assert_bits(buf, buf_ref)
        T.assert_bits(u, u_ref)
        p = torch.randn(n, generator=gen)
        p_ref = p.clone().mul_(1 - f32(1e-2) * 0.1).add_(u, alpha=-(f32(1e-2) * 1.5))
        ops.muon_update_step_([p], [u.float()], [], [torch.zeros(())], f32(1e-2), 1.5, 0.1)
        T.assert_bits(p, p_ref)


def test_phase1_fused_unscale_and_skip(device):
    gen = torch.Generator().manual_seed(3)
    n = 300
    buf, g = (torch.randn(n, generator=gen).to(device) for _ in range(2))
    a_buf, a_g = buf.clone(), (g * 1024).clone()
    b_buf = buf.clone()
    ua, ub = (torch.empty(n, dtype=BF16, device=device) for _ in range(2))
    ops.muon_momentum_step_([ua], [a_g], [a_buf], [zero(device)], 0.9, True,
                            inv_scale=torch.tensor(1 / 1024, device=device),
                            found_inf=zero(device), unscale_grads=True)
    ops.muon_momentum_step_([ub], [g], [b_buf], [zero(device)], 0.9, True)
    T.assert_bits(a_buf, b_buf)
    T.assert_bits(ua, ub)
    T.assert_bits(a_g, g)  # the unscaled gradient written back
    before = a_buf.clone(), ua.clone()
    ops.muon_momentum_step_([ua], [a_g], [a_buf], [zero(device)], 0.9, True,
                            found_inf=torch.ones((), device=device))
    T.assert_bits(a_buf, before[0])
    T.assert_bits(ua, before[1])
    p = torch.randn(n, device=device)
    p0, s = p.clone(), zero(device)
    ops.muon_update_step_([p], [ua.float()], [], [s], 1e-2, 1.0, 0.1,
                          found_inf=torch.ones((), device=device))
    T.assert_bits(p, p0)
    assert s.item() == 0


def test_op_bad_arguments_change_nothing():
    p, g, b = torch.randn(10), torch.randn(10), torch.randn(10)
    u = torch.empty(10, dtype=BF16)
    s = torch.zeros(())
    before = [t.clone() for t in (p, b)]
    # (a negative momentum and a zero lr_ratio: tests/test_step_fake.py's "muon_* hyper" cases)
    with pytest.raises(ValueError, match=r"weight_decay must be in \[0, inf\), got -1"):
        ops.muon_update_step_([p], [g], [], [s], 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match=r"momentum_buffers must have one entry per param"):
        ops.muon_momentum_step_([u], [g], [], [s], 0.9, True)
    for t, t0 in zip((p, b), before):
        T.assert_bits(t, t0)
    assert s.item() == 0


def test_opcheck(device):
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(40, generator=gen).to(device)
    lr = torch.tensor(1e-2, device=device)
    for mfmt in ("f32", "bf16", "q8"):
        kw = dict(master_free=True)
        if mfmt == "q8":
            bufs = [torch.zeros(40, dtype=torch.int8, device=device)]
            kw.update(momentum_buffer_scales=[torch.zeros(2, device=device)], block_size=32)
        else:
            bufs = [torch.randn(40, device=device).to(F32 if mfmt == "f32" else BF16)]
        args = ([torch.empty(40, dtype=BF16, device=device)], [g.clone()], bufs, [],
                [zero(device)], lr, 0.9, True)
        torch.library.opcheck(torch.ops.mpext.muon_momentum_step_.default, args, kw)
    for dt, kw in ((F32, {}), (BF16, dict(master_free=True, stochastic_rounding=True))):
        args = ([torch.randn(40, device=device).to(dt)], [g.clone().to(dt)], [],
                [zero(device)], lr, 1.5, 0.1)
        torch.library.opcheck(torch.ops.mpext.muon_update_step_.default, args, kw)


# --------------------------------------------------------------------------------------------
# The optimizer against torch.optim.Muon.

SHAPES_2D = [(64, 32), (32, 64), (48, 48), (7, 300), (300, 7), (1, 5)]


def _params(shapes, device, seed=0, dtype=F32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(device=device, dtype=dtype))
            for s in shapes]


def _grads(shapes, steps, seed=10):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=gen) * (0.5 + k) for s in shapes] for k in range(steps)]


@pytest.mark.parametrize("kw", [dict(), dict(nesterov=False, momentum=0.9),
                                dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.0),
                                dict(weight_decay=0.3, ns_steps=3, eps=1e-3)],
                         ids=["default", "plain", "rms", "wd-ns3"])
def test_bitwise_torch_muon(device, kw):
    """FP32 params: params and momentum buffers bit for bit torch.optim.Muon's (NS is torch's
    own function on the update's same bits). lr an fp32 value (mpext keeps lr in fp32)."""
    kw = dict(kw, lr=f32(0.02))
    ours = _params(SHAPES_2D, device)
    ref = _params(SHAPES_2D, "cpu")
    opt = Muon(ours, **kw)
    ref_opt = torch.optim.Muon(ref, **kw)
    for grads in _grads(SHAPES_2D, 4):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.to(device), g.clone()
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            T.assert_bits(p.detach().cpu(), q.detach(), "param %d" % i)
            T.assert_bits(opt.state[p]["momentum_buffer"].cpu(),
                          ref_opt.state[q]["momentum_buffer"], "buffer %d" % i)


def test_python_float_lr_measured():
    """An lr that is not an fp32 value (0.02): mpext reads it as fp32, so the scalars
    1 - lr * wd and -lr * ratio are computed from float32(lr) in double. Measured: the params
    stay within 1 fp32 ulp per step of torch's (and are usually equal)."""
    ours, ref = _params(SHAPES_2D, "cpu"), _params(SHAPES_2D, "cpu")
    opt, ref_opt = Muon(ours, lr=0.02), torch.optim.Muon(ref, lr=0.02)
    steps = 5
    for grads in _grads(SHAPES_2D, steps):
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        ulp = torch.finfo(F32).eps * q.detach().abs().clamp(min=2 ** -126)
        assert ((p.detach() - q.detach()).abs() <= steps * ulp).all()


def _bf16_tie_rule_(x):
    """The engine's storage rule of a bf16 param's fp32 value (mpext/adam.h): a value exactly
    halfway between two bf16 values above an even one (low half 0x8000, bit 16 clear) is kept
    one fp32 ulp below, as a remainder must (16 bits cannot tell it from the point above an odd
    one)."""
    bits = x.view(torch.int32)
    tie = (bits & 0x1FFFF) == 0x8000
    bits.sub_(tie.to(torch.int32))


@pytest.mark.parametrize("storage", ["master", "remainder"])
def test_low_params_keep_torch_fp32_values(device, storage):
    """BF16 params with an FP32 master or a remainder, stepped with the FP32 run's gradients:
    their FP32 values are torch.optim.Muon's FP32 params bit for bit, the params their round
    to nearest even."""
    lr = f32(0.02)
    ref = _params(SHAPES_2D, "cpu")
    ours = [torch.nn.Parameter(q.detach().to(device=device, dtype=BF16)) for q in ref]
    with torch.no_grad():  # the FP32 values must start equal: the reference from the bf16
        for q in ref:
            q.copy_(q.bfloat16().float())
    opt = Muon(ours, lr=lr, param_remainders=storage == "remainder")
    ref_opt = torch.optim.Muon(ref, lr=lr)
    for grads in _grads(SHAPES_2D, 3):
        for p, q, g in zip(ours, ref, grads):
            p.grad_dtype = None  # an fp32 gradient for a bf16 param (mpext takes it)
            p.grad, q.grad = g.to(device), g.clone()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            for q in ref:
                _bf16_tie_rule_(q)
        for i, (p, q) in enumerate(zip(ours, ref)):
            T.assert_bits(opt.master_param(p).cpu(), q.detach(), "master %d" % i)
            T.assert_bits(p.detach().cpu(), q.detach().bfloat16(), "param %d" % i)


def test_newton_schulz_batched_matches_per_matrix_measured():
    """Batched NS (bmm) against torch's per-matrix function: the same math; the bits may
    differ where bmm and mm accumulate in another order. Measured here: equal, or within BF16
    rounding (2^-7 relative to the largest entry) on every entry."""
    gen = torch.Generator().manual_seed(5)
    for shape in [(64, 32), (32, 64), (48, 48)]:
        xs = [torch.randn(*shape, generator=gen).bfloat16() for _ in range(4)]
        ref = [torch.optim._muon._zeropower_via_newtonschulz(x.clone(), (3.4445, -4.7750, 2.0315),
                                                             5, 1e-7) for x in xs]
        one = [newton_schulz(x.clone(), (3.4445, -4.7750, 2.0315), 5, 1e-7) for x in xs]
        for a, b in zip(one, ref):
            T.assert_bits(a, b)  # the per-matrix path is torch's, bit for bit
        out = newton_schulz(torch.stack(xs), (3.4445, -4.7750, 2.0315), 5, 1e-7)
        for a, b in zip(out, ref):
            assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs().max()).all()


def test_adjust_lr_ratio_is_torchs():
    from torch.optim._muon import _adjust_lr
    for fn in (None, "original", "match_rms_adamw"):
        for shape in [(64, 32), (32, 64), (7, 300), (768, 3072)]:
            assert 1.0 * adjust_lr_ratio(fn, shape) == _adjust_lr(1.0, fn, torch.Size(shape))


# --------------------------------------------------------------------------------------------
# Bad inputs.

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(lr=-1.0), ValueError, r"Invalid learning rate: -1.0"),
    (dict(momentum=-0.1), ValueError, r"momentum should be >= 0 but is: -0.1"),
    (dict(weight_decay=-0.1), ValueError, r"weight decay should be >= 0 but is: -0.1"),
    (dict(adjust_lr_fn="sqrt"), ValueError, r"Adjust learning rate function sqrt is not "
                                            r"supported"),
    (dict(ns_steps=100), ValueError, r"ns_steps must be an int in \[0, 100\)"),
    (dict(ns_coefficients=(1.0, 2.0)), ValueError, r"ns_coefficients must be a tuple of "
                                                   r"exactly 3"),
    (dict(nesterov="yes"), TypeError, r"nesterov must be a bool"),
    (dict(momentum_dtype=torch.float16), ValueError, r"momentum_dtype must be torch.float32, "
                                                     r"torch.bfloat16 or torch.int8"),
    (dict(ns_sharded="ring"), ValueError, r"ns_sharded must be 'all_gather' or 'designated', "
                                          r"got 'ring'"),
])
def test_bad_arguments(kwargs, exc, match):
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(exc, match=match):
        Muon([p], **kwargs)


def test_maximize_refused_in_a_muon_group_before_anything_changes():
    """torch.optim.Muon has no maximize: a Muon group with maximize=True is refused at the
    step (not ignored), nothing written; an AdamW group takes it."""
    w, b = _params([(8, 12), (12,)], "cpu")
    opt = Muon([dict(params=[w]), dict(params=[b], use_muon=False, maximize=True)])
    w.grad, b.grad = torch.randn(8, 12), torch.randn(12)
    opt.step()
    opt.param_groups[0]["maximize"] = True
    before = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match=r"maximize=True is not supported by a Muon group"):
        opt.step()
    T.assert_bits(w.detach(), before[0])
    T.assert_bits(opt.state[w]["momentum_buffer"], before[1])


def test_fp16_params_with_fp16_gradients(device):
    """FP16 params (FP32 masters) with FP16 gradients: the masters are torch.optim.Muon's FP32
    params stepped with the widened gradients, bit for bit; under a GradScaler the unscaled
    gradient is written back in FP16, as the unscale of every rule."""
    shapes = [(24, 40), (40, 24)]
    lr = f32(0.02)
    ref = _params(shapes, "cpu")
    with torch.no_grad():
        for q in ref:
            q.copy_(q.half().float())
    ours = [torch.nn.Parameter(q.detach().to(device, F16)) for q in ref]
    opt, ref_opt = Muon(ours, lr=lr), torch.optim.Muon(ref, lr=lr)
    scaler = mpext.GradScaler(device=torch.device(device).type, init_scale=2.0 ** 6,
                              growth_interval=1000)
    for grads in _grads(shapes, 3):
        for p, q, g in zip(ours, ref, grads):
            g16 = g.half()
            p.grad, q.grad = (g16 * 64).to(device), g16.float()
        scaler.scale(torch.ones((), device=device))
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            T.assert_bits(p.grad.cpu(), q.grad.half(), "unscaled gradient %d" % i)
            T.assert_bits(opt.master_param(p).cpu(), q.detach(), "master %d" % i)
            T.assert_bits(p.detach().cpu(), q.detach().half(), "param %d" % i)


def test_non_2d_param_refused_and_adamw_group_takes_it():
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters whereas we found a "
                                         r"parameter with size: torch.Size\(\[4\]\)"):
        Muon([w, b])
    opt = Muon([w])
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters"):
        opt.add_param_group(dict(params=[b]))
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[b], use_muon=False))
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)


# --------------------------------------------------------------------------------------------
# state_dict to and from torch.optim.Muon. (GradScaler's poisoned and fused steps, the lean
# formats step by step against torch.optim.Muon, the EMA, resume, conversions between every
# format, torch.compile and gradient release are Muon's rows of the rules x formats table:
# tests/test_optim_table.py, test_grad_release.py, test_memory.py.)

def test_state_dict_round_trip_and_format_conversions(tmp_path):
    shapes = [(64, 40), (40, 64)]
    grads = _grads(shapes, 4)
    lr = f32(0.02)
    a = _params(shapes, "cpu")
    opt = Muon(a, lr=lr)
    for p, g in zip(a, grads[0]):
        p.grad = g
    opt.step()
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "muon.pt")
    # torch.optim.Muon continues from mpext's FP32 state bit for bit, and mpext from torch's
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    tref = torch.optim.Muon(b, lr=lr)
    # (torch's load keeps tensors of the right dtype and device as they are: a clone, so that
    # the two optimizers do not share a buffer)
    tref.load_state_dict({"state": {k: {"momentum_buffer": v["momentum_buffer"].clone()}
                                    for k, v in sd["state"].items()},
                          "param_groups": [{k: v for k, v in sd["param_groups"][0].items()
                                            if k in tref.param_groups[0] or k == "params"}]})
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    back = Muon(c, lr=lr)
    back.load_state_dict(tref.state_dict())
    d = [torch.nn.Parameter(p.detach().clone()) for p in a]
    reload = Muon(d, lr=lr)
    reload.load_state_dict(torch.load(tmp_path / "muon.pt"))
    for grads_k in grads[1:]:
        for ps in (a, b, c, d):
            for p, g in zip(ps, grads_k):
                p.grad = g.clone()
        for o in (opt, tref, back, reload):
            o.step()
    for name, ps in (("torch from mpext", b), ("mpext from torch", c), ("reloaded", d)):
        for p, q in zip(ps, a):
            T.assert_bits(p.detach(), q.detach(), name)
    # FP32 -> BF16 (to nearest even) -> 8-bit -> FP32: each conversion is the format's encode
    e = [torch.nn.Parameter(p.detach().clone()) for p in a]
    bf = Muon(e, lr=lr, momentum_dtype=BF16)
    bf.load_state_dict(opt.state_dict())
    for p, q in zip(e, a):
        T.assert_bits(bf.state[p]["momentum_buffer"],
                      opt.state[q]["momentum_buffer"].bfloat16())
    q8 = Muon([torch.nn.Parameter(p.detach().clone()) for p in a], lr=lr,
              momentum_dtype=torch.int8, block_size=64)
    q8.load_state_dict(bf.state_dict())
    f = Muon([torch.nn.Parameter(p.detach().clone()) for p in a], lr=lr)
    f.load_state_dict(q8.state_dict())
    for p, (k, st) in zip(a, sorted(f.state_dict()["state"].items())):
        m = opt.state[p]["momentum_buffer"]
        assert ((st["momentum_buffer"] - m).abs() <= 2 ** -4 * m.abs().max() + 2 ** -8 * m.abs()).all()


# --------------------------------------------------------------------------------------------
# Bytes per param, from live tensors.

def _state_bytes(opt):
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("fmt,want", [
    # BF16 param (2) + 8-bit code (1) + an fp32 scale per block (4 / 256 by default; the
    # issue's 3.03 is a 128-element block)
    (dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8),
     2 + 1 + 4 / 256),
    (dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8,
          block_size=128), 2 + 1 + 4 / 128),
    (dict(param_remainders=True, momentum_dtype=torch.int8), 2 + 2 + 1 + 4 / 256),
    (dict(momentum_dtype=BF16, master_weights=False, stochastic_rounding=True), 4.0),
    (dict(), 2 + 4 + 4)])  # BF16 param, FP32 master, FP32 buffer
def test_bytes_per_param_live(fmt, want):
    """Param + state bytes per param element, counted from the live tensors' storages (the
    step counts included)."""
    ps = [torch.nn.Parameter(torch.randn(256, 512, dtype=BF16)) for _ in range(2)]
    opt = Muon(ps, **fmt)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    n = sum(p.numel() for p in ps)
    total = sum(p.untyped_storage().nbytes() for p in ps) + _state_bytes(opt)
    assert abs(total / n - want) < 1e-3, total / n


# --------------------------------------------------------------------------------------------
# Mixed models: Muon for the hidden 2-D weights, AdamW for the rest, in one optimizer.

def test_muon_param_groups_split_gpt2():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32))
    groups = muon_param_groups(model, lr=0.02)
    muon, adamw = groups[0]["params"], groups[1]["params"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert groups[0]["use_muon"] and groups[0]["lr"] == 0.02 and not groups[1]["use_muon"]
    assert all(p.ndim == 2 for p in muon)
    assert {names[id(p)] for p in muon} == {
        "transformer.h.%d.%s.weight" % (i, m) for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    # the tied embedding / lm_head, the positions, norms and biases: AdamW, each param once
    assert "transformer.wte.weight" in {names[id(p)] for p in adamw}
    assert "transformer.wpe.weight" in {names[id(p)] for p in adamw}
    assert len(muon) + len(adamw) == len(list(model.parameters()))


@pytest.mark.parametrize("fmt", [dict(), dict(momentum_dtype=torch.int8,
                                              exp_avg_dtype=torch.int8,
                                              exp_avg_sq_dtype=torch.uint8)],
                         ids=["fp32", "q8"])
def test_mixed_gpt2_vs_torch_muon_and_adamw(fmt):
    """HF GPT-2 (hub defaults, small): one mpext.optim.Muon with the split of
    muon_param_groups against torch.optim.Muon + torch.optim.AdamW on the same split, from the
    same weights and dropout draws. FP32 state: the first step's Muon params bit for bit, the
    AdamW params within a few fp32 ulps (mpext's AdamW tolerance, tests/optim_table.py); then the
    losses of 4 more steps within 1e-4 relative. 8-bit state: the losses within 2%."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    ours = transformers.GPT2LMHeadModel(cfg)
    ref = transformers.GPT2LMHeadModel(cfg)
    ref.load_state_dict(ours.state_dict())
    lr_m, lr_a = f32(0.02), f32(3e-4)
    groups = muon_param_groups(ours, lr=lr_m)
    groups[1].update(lr=lr_a, weight_decay=0.01)
    opt = Muon(groups, **fmt)
    rgroups = muon_param_groups(ref)
    rm = torch.optim.Muon(rgroups[0]["params"], lr=lr_m)
    ra = torch.optim.AdamW(rgroups[1]["params"], lr=lr_a, weight_decay=0.01)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for k in range(5):
        out = []
        for model, opts in ((ours, (opt,)), (ref, (rm, ra))):
            torch.manual_seed(100 + k)
            loss = model(ids, labels=ids).loss
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            out.append(loss.item())
        losses.append(out)
        if k == 0 and not fmt:
            for p, q in zip(groups[0]["params"], rgroups[0]["params"]):
                T.assert_bits(p.detach(), q.detach())
            for p, q in zip(groups[1]["params"], rgroups[1]["params"]):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=4e-7, atol=lr_a * 1e-5)
    rtol = 0.02 if fmt else 1e-4
    for a, b in losses:
        assert abs(a - b) <= rtol * abs(b), losses
    assert losses[-1][0] < losses[0][0]  # it trains


def test_bf16_momentum_draws_the_documented_stream():
    """A BF16 buffer is stochastically rounded with the bits of the stream (seed, t, 2k) at
    each element's position (k the param's index in the optimizer, t its step count after
    the step), as every rule's moments: tests/reference.py's generator, independently."""
    import numpy as np
    from reference import bf16_sr_array, sr_bits_array, sr_key
    shapes = [(8, 16), (24, 40)]
    ps = _params(shapes, "cpu")
    seed = 1234
    opt = Muon(ps, lr=f32(0.02), momentum_dtype=BF16, seed=seed)
    grads = _grads(shapes, 1)[0]
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()
    for k, (p, g) in enumerate(zip(ps, grads)):
        exact = (torch.tensor(f32(1 - 0.95)) * g).reshape(-1)  # lerp(0, g, w) = fma(w, g, 0)
        r = sr_bits_array(sr_key(seed, 1, 2 * k), np.arange(exact.numel(), dtype=np.uint64))
        want, _ = bf16_sr_array(exact.view(torch.int32).numpy().view(np.uint32), r)
        got = opt.state[p]["momentum_buffer"].reshape(-1).view(torch.int16).numpy()
        assert (got.view(np.uint16) == want).all()


# --------------------------------------------------------------------------------------------
# FSDP2 / DTensor: the update gathered whole, NS on every rank, each rank its shard.

# rows that 2 and 3 ranks split unevenly (torch.chunk: 3 rows on 2 ranks are 2 + 1; 1 row on
# 3 ranks leaves two empty shards), one tall, one wide
DIST_SHAPES = [(67, 24), (24, 53), (3, 40), (1, 16)]
DIST_FORMATS = {
    # NS on one rank per param (round-robin: gather, NS, scatter), the default
    "fp32": dict(),
    "sr-q8": dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8,
                  block_size=32),
    "remainder-bf16": dict(param_remainders=True, momentum_dtype=BF16),
    # NS on every rank (all-gather)
    "fp32-all-gather": dict(ns_sharded="all_gather"),
    "sr-q8-all-gather": dict(master_weights=False, stochastic_rounding=True,
                             momentum_dtype=torch.int8, block_size=32, ns_sharded="all_gather"),
}


def _dist_run(fmt, params, grads, shard):
    """Three Muon steps of ``params`` (full tensors) with ``grads``; shard(t) the tensor as
    this rank's param (a DTensor) or itself. Returns the params' (local) values, FP32 values
    and buffers."""
    kw = DIST_FORMATS[fmt]
    low = kw.get("master_weights", True) is False or kw.get("param_remainders", False)
    dt = BF16 if low else F32
    ps = [torch.nn.Parameter(shard(p.to(dt))) for p in params]
    opt = Muon(ps, lr=f32(0.02), seed=3, **kw)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = shard(g.to(dt))
        opt.step()
    out = []
    for p in ps:
        loc = p.to_local() if hasattr(p, "to_local") else p
        st = opt.state[p]
        buf = st.get("momentum_buffer", st.get("momentum_buffer_q8"))
        buf = buf.to_local() if hasattr(buf, "to_local") else buf
        m = opt.master_param(p)
        m = m.to_local() if hasattr(m, "to_local") else m
        out.append((loc.detach().clone(), m, buf.clone()))
    return out


def _dist_body(rank, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    params = _params(DIST_SHAPES, "cpu", seed=7)
    grads = _grads(DIST_SHAPES, 3, seed=8)
    res = {}
    for fmt in DIST_FORMATS:
        mine = _dist_run(fmt, [p.detach() for p in params], grads,
                         lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        one = _dist_run(fmt, [p.detach() for p in params], grads, lambda t: t)
        # this rank's rows of the one-process run
        res[fmt] = [tuple(x.clone() for x in m) + tuple(
            distribute_tensor(v.reshape(p.shape) if v.numel() == p.numel() else v, mesh,
                              [Shard(0)]).to_local() if v.dim() == 2 else v
            for v in o) for m, o, p in zip(mine, one, params)]
    return res


def _rank_body(root, rank, out_dir):
    """Everything this file runs at one world size, in one spawn (CI time): the Shard(0)
    checks; at 2 ranks the DCP checkpoints; at 3 ranks and on the 2 x 2 HSDP mesh their loads
    (the 2-rank spawn runs first)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    out = {"dtensor": _dist_body(rank, out_dir)}
    if world == 2:
        _dcp_save(root)
    elif world in (3, 4):
        out["dcp"] = _dcp_load(root)
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """world -> what each rank of _rank_body returned, one spawn per world size."""
    import functools
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    from test_distributed import _spawn
    root, cache = tmp_path_factory.mktemp("muon_dcp"), {}

    def get(world):
        if world not in cache:
            if world in (3, 4):
                get(2)  # the checkpoints they load
            cache[world] = _spawn(functools.partial(_rank_body, str(root)),
                                  tmp_path_factory.mktemp("muon_%d_ranks" % world), world=world)
        return cache[world]
    get.root = str(root)
    return get


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dtensor_shard0_same_bits_as_one_process(spawned, world):
    """Shard(0) DTensor params (FSDP2's placement; uneven shards, empty ones): params, FP32
    values and buffers bit for bit those of one process, in FP32, in BF16 SR params with 8-bit
    momentum (blocks shared between shards) and with remainders and a BF16 buffer; NS on one
    designated rank per param (gather, scatter: the default) and on every rank (all-gather)."""
    for rank, res in enumerate(spawned(world)):
        for fmt, per_param in res["dtensor"].items():
            for i, (p, m, b, p1, m1, b1) in enumerate(per_param):
                where = "rank %d %s param %d" % (rank, fmt, i)
                T.assert_bits(p, p1, where + " param")
                T.assert_bits(m, m1, where + " fp32 value")
                T.assert_bits(b, b1, where + " buffer")  # 8-bit: one code per element


@pytest.mark.parametrize("fmt,mode", [
    (dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8),
     "mpext-bf16-sr-8bit"),
    (dict(param_remainders=True, momentum_dtype=torch.int8), "mpext-bf16-remainder-8bit"),
    (dict(), "mpext-bf16")])
def test_calculator_agrees_with_live_tensors(fmt, mode):
    """mpext.memory's estimate for rule='muon' (its RULES read Muon's one moment) equals the
    live tensors (mpext.memory.measure) after two steps, component by component."""
    from mpext import memory
    from mpext.memory import estimate
    assert memory.modes.RULES["muon"] == ("momentum_buffer",)
    ps = [torch.nn.Parameter(torch.randn(s, dtype=BF16)) for s in [(256, 512), (512, 96)]]
    opt = Muon(ps, ema_decay=0.9, **fmt)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    got = memory.measure(ps, opt)
    want = estimate([p.numel() for p in ps], mode=mode, rule="muon", ema=True)
    for field in ("weights", "gradients", "master_weights", "optimizer_states", "ema"):
        assert got[field] == getattr(want, field), (field, got, want)


# --------------------------------------------------------------------------------------------
# torch.distributed.checkpoint: a 2-rank FSDP2 run saved in every momentum format, reloaded in
# one process, at 3 ranks and on a 2 x 2 HSDP mesh (replicate x shard), continued: the bits of
# the uninterrupted run (which is one process's: test_dtensor_shard0_same_bits_as_one_process).
# Gradients are set, not computed, so that the gradient reduction's order plays no part.

DCP_FORMATS = {  # name -> (param dtype, kwargs): every momentum format, three param formats
    "fp32": (F32, dict(ns_sharded="all_gather")),  # (both NS variants: HSDP too)
    "bf16": (BF16, dict(param_remainders=True, momentum_dtype=BF16)),
    "q8": (BF16, dict(master_weights=False, stochastic_rounding=True, momentum_dtype=torch.int8,
                      block_size=32)),
}


def _dcp_model(dtype, seed=0):
    """Hidden weights of 67, 3 and 1 rows (uneven shards, empty ones; the first one's 8-bit
    blocks straddle the shards) for Muon, a bias for the AdamW group."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 67), torch.nn.Linear(67, 3, bias=False),
                               torch.nn.Linear(3, 1, bias=False)).to(dtype)


def _dcp_opt(model, fmt):
    groups = muon_param_groups(model, lr=f32(0.02))
    groups[1].update(lr=f32(1e-2))
    return Muon(groups, seed=5, **DCP_FORMATS[fmt][1])


def _dcp_steps(model, opt, steps):
    from torch.distributed.tensor import DTensor, distribute_tensor
    for k in steps:
        gen = torch.Generator().manual_seed(50 + k)
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) \
                if isinstance(p, DTensor) else g
        opt.step()


def _dcp_values(model, opt):
    """Every param's value and FP32 value (master, remainder-exact or the param), whole."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return [(full(p.detach()).clone(), full(opt.master_param(p)).clone())
            for p in model.parameters()]


def _dcp_sharded(fmt, mesh, seed=1):
    from torch.distributed.fsdp import fully_shard
    model = _dcp_model(DCP_FORMATS[fmt][0], seed)  # seed 1 (a load): weights it must replace
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _dcp_opt(model, fmt)


def _dcp_save(root):
    import os
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    for fmt in DCP_FORMATS:
        model, opt = _dcp_sharded(fmt, mesh, seed=0)
        _dcp_steps(model, opt, range(3))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, fmt))


def _dcp_resume(path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import mpext.integrations.dcp
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=mpext.integrations.dcp.LoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _dcp_steps(model, opt, range(3, 5))
    return _dcp_values(model, opt)


def _dcp_load(root):
    """At 3 ranks: Shard(0) on 3; at 4 ranks: HSDP, replicate 2 x shard 2."""
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) \
        if world == 4 else init_device_mesh("cpu", (world,))
    return {fmt: _dcp_resume(os.path.join(root, fmt), *_dcp_sharded(fmt, mesh))
            for fmt in DCP_FORMATS}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["1 process", "3 ranks", "HSDP 2x2"])
def test_dcp_fsdp2_2_ranks_resumes_bit_for_bit(spawned, where):
    """Saved by 2 FSDP2 ranks, loaded (through mpext.integrations.dcp.LoadPlanner) in one
    process, at 3 ranks or on 4 HSDP ranks, 2 more steps: the uninterrupted run's params and
    FP32 values bit for bit, in every momentum format."""
    import os
    spawned(2)
    for fmt, (dtype, _) in DCP_FORMATS.items():
        model = _dcp_model(dtype)
        opt = _dcp_opt(model, fmt)
        _dcp_steps(model, opt, range(5))
        want = _dcp_values(model, opt)
        if where == "1 process":
            model = _dcp_model(dtype, seed=1)
            got = _dcp_resume(os.path.join(spawned.root, fmt), model, _dcp_opt(model, fmt))
        else:
            got = spawned(3 if where == "3 ranks" else 4)[0]["dcp"][fmt]
        for i, ((p, m), (p1, m1)) in enumerate(zip(got, want)):
            T.assert_bits(p, p1, "%s %s param %d" % (where, fmt, i))
            T.assert_bits(m, m1, "%s %s fp32 value %d" % (where, fmt, i))


# --------------------------------------------------------------------------------------------
# State dicts of mixed optimizers; MixedPrecisionOptimizer around torch's Muon and mpext's.

def test_mixed_state_dict_round_trip_and_group_checks():
    """A Muon + AdamW optimizer loads its own state_dict (its AdamW group's keys alone look
    like RAdam's) and continues bit for bit; groups in another order are refused, naming
    both kinds, and nothing is loaded; torch.optim.AdamW's group loads into the AdamW group."""
    def make(seed=0):
        w, b = _params([(12, 20), (20,)], "cpu", seed=seed)
        return [w, b], Muon([dict(params=[w], lr=f32(0.02)),
                             dict(params=[b], use_muon=False, lr=f32(1e-2))],
                            momentum_dtype=torch.int8, block_size=32)
    (a, opt), (c, other) = make(), make(seed=1)
    grads = _grads([(12, 20), (20,)], 4)
    for p, g in zip(a, grads[0]):
        p.grad = g
    opt.step()
    with torch.no_grad():
        for p, q in zip(c, a):
            p.copy_(q)
    other.load_state_dict(opt.state_dict())
    for gs in grads[1:]:
        for ps, o in ((a, opt), (c, other)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            o.step()
    for p, q in zip(a, c):
        T.assert_bits(p.detach(), q.detach())
    w, b = _params([(12, 20), (20,)], "cpu")
    swapped = Muon([dict(params=[b], use_muon=False), dict(params=[w])])
    with pytest.raises(ValueError, match=r"param group 0 of the checkpoint is a Muon group and "
                                         r"this optimizer's is an AdamW group"):
        swapped.load_state_dict(opt.state_dict())
    assert not swapped.state
    ta = torch.optim.AdamW([b])
    b.grad = grads[0][1]
    ta.step()
    adamw = Muon([dict(params=[torch.nn.Parameter(b.detach().clone())], use_muon=False)])
    adamw.load_state_dict(ta.state_dict())
    assert adamw.param_groups[0]["use_muon"] is False


@pytest.mark.parametrize("inner", ["torch", "mpext"])
def test_mixed_precision_optimizer_around_muon(device, inner):
    """MixedPrecisionOptimizer (FP32 masters of BF16 params, fixed loss scale) around a Muon:
    torch.optim.Muon (a user's own) or mpext.optim.Muon in FP32 state. The masters are
    torch.optim.Muon's FP32 params stepped with the same (unscaled, widened) gradients, bit
    for bit, the model params their round to nearest even; a step with an inf is skipped."""
    shapes = [(24, 40), (40, 24)]
    lr = f32(0.02)
    ref = _params(shapes, "cpu")
    with torch.no_grad():
        for q in ref:
            q.copy_(q.bfloat16().float())
    model = [torch.nn.Parameter(q.detach().to(device, BF16)) for q in ref]
    make = torch.optim.Muon if inner == "torch" else Muon
    opt = mpext.MixedPrecisionOptimizer(make(model, lr=lr), loss_scale=1024.0)
    ref_opt = torch.optim.Muon(ref, lr=lr)
    for k, grads in enumerate(_grads(shapes, 4)):
        for p, q, g in zip(model, ref, grads):
            p.grad = (g * 1024).to(device, BF16)
            q.grad = (g * 1024).bfloat16().float() / 1024
        if k == 2:
            model[1].grad[3, 4] = float("inf")
        opt.step()
        opt.zero_grad()
        if k != 2:
            ref_opt.step()
        for i, (p, q) in enumerate(zip(model, ref)):
            T.assert_bits(opt.master_param(p).cpu(), q.detach(), "master %d step %d" % (i, k))
            T.assert_bits(p.detach().cpu(), q.detach().bfloat16(), "param %d step %d" % (i, k))


def test_mixed_precision_optimizer_refuses_muons_own_param_storage():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=BF16))
    for kw, text in ((dict(param_remainders=True), "param_remainders=True"),
                     (dict(master_weights=False, stochastic_rounding=True),
                      "master_weights=False")):
        inner = Muon([p], **kw)
        with pytest.raises(ValueError, match=r"inner Muon asks for %s, which "
                                             r"MixedPrecisionOptimizer cannot honour" % text):
            mpext.MixedPrecisionOptimizer(inner)
        assert p.dtype == BF16 and inner.param_groups[0]["params"][0] is p
