"""mpext.MixedPrecisionOptimizer against PyTorch.

Every run is differential: the wrapper over BF16/FP16 params on one side, the same torch.optim
optimizer over FP32 params fed the same (upcast, unscaled) gradients on the other, with
torch.amp.GradScaler for the loss scale and torch.nn.utils.clip_grad_norm_ for clipping. The FP32
masters must track the FP32 reference (bit for bit through the generic path, which runs torch's
own optimizer code on the masters; within rtol 1e-6 through the fused Adam path) and every model
param must be its master rounded, bit for bit. Then overflowing steps (nothing changes), the
state_dict round trip, host reads, and bad input (a clear error, nothing modified)."""
import contextlib
import copy
import io
import warnings

import pytest
import torch

import mpext
from mpext import MixedPrecisionOptimizer as MPO

from conftest import HostReads
from optim_table import allow_any_grad_dtype, assert_bits as assert_bitwise

LOW = (torch.bfloat16, torch.float16)
SHAPES = [(13, 7), (31,), (2, 3, 5), (1,)]

# name -> (optimizer class, kwargs, fused path?)
INNER = {
    "torch_adamw": (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1), True),
    "torch_adam_l2": (torch.optim.Adam, dict(lr=2e-3, betas=(0.8, 0.99), weight_decay=0.05,
                                             maximize=True), True),
    "mpext_adamw": (mpext.optim.AdamW, dict(lr=3e-3, weight_decay=0.1), True),
    "torch_adam_amsgrad": (torch.optim.Adam, dict(lr=2e-3, amsgrad=True), False),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=1e-3), False),
    "sgd_fused": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, fused=True), False),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True), False),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, weight_decay=0.01), False),
}


def ref_class(cls):
    """The torch optimizer the reference side runs (mpext's Adam classes are checked against
    torch's in test_adam)."""
    return {mpext.optim.AdamW: torch.optim.AdamW, mpext.optim.Adam: torch.optim.Adam}.get(cls, cls)


class Run:
    """The wrapper over low-precision params (plus FP32 ones) and the FP32 torch reference."""

    def __init__(self, device, name, dtype=torch.bfloat16, fp32_shapes=((9,),), groups=None,
                 use_fused=True, seed=0, **mpo_kw):
        cls, kw, self.fused = INNER[name]
        gen = torch.Generator().manual_seed(seed)
        self.low = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_()
                    for s in SHAPES]
        self.f32 = [torch.randn(s, generator=gen).to(device).requires_grad_()
                    for s in fp32_shapes]
        self.params = self.low + self.f32
        self.ref = [p.detach().float().clone().requires_grad_() for p in self.params]
        allow_any_grad_dtype(self.params)
        if groups is None:
            ours_groups, ref_groups = [{"params": self.params}], [{"params": self.ref}]
        else:  # groups: list of (indices, extra kwargs)
            ours_groups = [dict(params=[self.params[i] for i in ix], **g) for ix, g in groups]
            ref_groups = [dict(params=[self.ref[i] for i in ix], **g) for ix, g in groups]
        self.inner = cls(ours_groups, **kw)
        self.mpo = MPO(self.inner, **mpo_kw)
        self.mpo._use_fused = use_fused
        self.torch_opt = ref_class(cls)(ref_groups, **kw)
        self.device = device

    def masters(self):
        return [self.mpo.master_param(p) if p.dtype in LOW else p for p in self.params]

    def set_grads(self, step, scale=1.0, big=False, poison=None, skip=()):
        """Gradients for this step: the wrapper's params get ``g * scale`` in the param dtype,
        the reference the same values upcast and unscaled (so a power-of-two scale is exact)."""
        gen = torch.Generator().manual_seed(7919 * step + 1)
        for i, (p, q) in enumerate(zip(self.params, self.ref)):
            g = torch.randn(p.shape, generator=gen) * (30.0 if big else 1.0)
            if i in skip:
                p.grad = q.grad = None
                continue
            p.grad = (g * scale).to(self.device, p.dtype)
            q.grad = g.to(p.dtype).float().to(self.device)
            if poison is not None and i == poison[0]:
                p.grad.view(-1)[step % p.numel()] = poison[1]
                q.grad.view(-1)[step % p.numel()] = poison[1]

    def check(self, exact, what=""):
        for i, (p, m, q) in enumerate(zip(self.params, self.masters(), self.ref)):
            if exact:
                assert_bitwise(m.detach(), q.detach(), "%s param %d" % (what, i))
            else:
                torch.testing.assert_close(m.detach(), q.detach(), rtol=1e-6, atol=1e-7,
                                           msg="%s param %d" % (what, i))
            if p.dtype in LOW:
                assert m.dtype == torch.float32
                assert_bitwise(p.detach(), m.detach().to(p.dtype), "%s rounded %d" % (what, i))


def snapshot(mpo):
    """Every tensor the wrapper and its model hold: model params, masters, inner state."""
    out = []
    for i, (p, q) in enumerate(mpo._entries):
        out.append(("param %d" % i, p.detach().clone()))
        out.append(("inner param %d" % i, q.detach().clone()))
        for k, v in sorted(mpo.state.get(q, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append(("%s %d" % (k, i), v.detach().clone()))
    return out


def assert_unchanged(mpo, before, what=""):
    """Nothing changed since ``before``: the same bits everywhere; state that did not exist
    then may only be fresh (zero) state, made before the step was skipped on the device."""
    now = dict(snapshot(mpo))
    old = dict(before)
    assert set(old) <= set(now), what
    for name, t in now.items():
        if name in old:
            assert_bitwise(t, old[name], "%s %s" % (what, name))
        else:
            assert not name.startswith(("param", "inner param")), name
            assert not t.any(), "%s: fresh state %s is not zero" % (what, name)


def assert_same(a, b, what=""):
    assert [n for n, _ in a] == [n for n, _ in b], what
    for (n, x), (_, y) in zip(a, b):
        assert_bitwise(x, y, "%s %s" % (what, n))


# --------------------------------------------------------------------------------------------
# The masters track torch's FP32 optimizer.


@pytest.mark.parametrize("name", sorted(INNER))
def test_masters_track_torch_fp32_optimizer(device, name):
    run = Run(device, name)
    sched = torch.optim.lr_scheduler.StepLR(run.mpo, step_size=7, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(run.torch_opt, step_size=7, gamma=0.5)
    for step in range(20):
        run.set_grads(step)
        applied = run.mpo.step()
        run.torch_opt.step()
        sched.step()
        ref_sched.step()
        assert applied.dtype == torch.bool and applied.dim() == 0
        assert applied.device.type == torch.device(device).type and bool(applied)
        run.check(exact=not run.fused, what="%s step %d" % (name, step))
    assert run.mpo.param_groups[0]["lr"] == run.torch_opt.param_groups[0]["lr"]
    # FP32 params are held by the inner optimizer as they are; the others by their masters.
    assert all(run.mpo.master_param(p) is None and any(p is q for q in run.inner.param_groups[0]
                                                       ["params"]) for p in run.f32)
    # The inner optimizer's state is torch's, in FP32, with torch's keys.
    sd, ref_sd = run.inner.state_dict(), run.torch_opt.state_dict()
    for i, st in sd["state"].items():
        assert set(st) == set(ref_sd["state"][i])
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.dtype == torch.float32
                torch.testing.assert_close(v, ref_sd["state"][i][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["torch_adamw", "torch_adam_l2"])
def test_fused_path_equals_generic_path(dtype, name):
    """The fused adam_step_ pass and torch's own Adam over the masters (generic path) agree,
    with dynamic scaling, clipping and an overflowing step."""
    fused = Run("cpu", name, dtype, loss_scale="dynamic", init_scale=2.0 ** 8,
                growth_interval=3, max_grad_norm=5.0)
    generic = Run("cpu", name, dtype, use_fused=False, loss_scale="dynamic",
                  init_scale=2.0 ** 8, growth_interval=3, max_grad_norm=5.0)
    for step in range(12):
        for run in (fused, generic):
            run.set_grads(step, scale=run.mpo.get_scale(),
                          poison=(1, float("inf")) if step == 5 else None)
            run.mpo.step()
        assert fused.mpo.get_scale() == generic.mpo.get_scale()
        for pf, pg, mf, mg in zip(fused.params, generic.params, fused.masters(),
                                  generic.masters()):
            torch.testing.assert_close(mf, mg, rtol=1e-6, atol=1e-7)
            if pf.dtype in LOW:
                assert_bitwise(pf.detach(), mf.detach().to(dtype))
                assert_bitwise(pg.detach(), mg.detach().to(dtype))


@pytest.mark.parametrize("name", ["torch_adamw", "sgd_nesterov"])
def test_fp32_grads_and_other_grad_layouts(name):
    """BF16 params may carry FP32 gradients, and a channels_last param a contiguous gradient:
    both paths take them and match torch on the same FP32 values."""
    cls, kw, fused = INNER[name]
    p = torch.randn(2, 3, 4, 5).bfloat16().contiguous(memory_format=torch.channels_last)
    p.requires_grad_()
    v = torch.randn(7).bfloat16().requires_grad_()
    allow_any_grad_dtype([p, v])
    refs = [t.detach().float().requires_grad_() for t in (p, v)]
    mpo = MPO(cls([p, v], **kw), loss_scale=64.0)
    ref = cls(refs, **kw)
    assert mpo.master_param(p).is_contiguous(memory_format=torch.channels_last)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        g = [torch.randn(t.shape, generator=gen) for t in (p, v)]
        p.grad = (g[0] * 64).contiguous()  # fp32, contiguous: not the param's layout
        v.grad = (g[1] * 64).bfloat16()
        refs[0].grad, refs[1].grad = g[0].clone(), v.grad.float() / 64
        assert bool(mpo.step())
        ref.step()
        for t, r in zip((p, v), refs):
            m = mpo.master_param(t)
            if fused:
                torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
            else:
                assert_bitwise(m, r.detach())
            assert_bitwise(t.detach(), m.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------
# Loss scaling.


@pytest.mark.parametrize("name", ["torch_adamw", "sgd_nesterov", "sgd_fused"])
def test_fp16_dynamic_scale_and_overflow_like_torch_gradscaler(device, name):
    """FP16 params, dynamic scale: the scale follows torch.amp.GradScaler over the reference
    exactly, overflowing steps (injected Inf/NaN and natural fp16 overflow of big gradients)
    change nothing at all, and step() reports them as a device bool."""
    run = Run(device, name, torch.float16, init_scale=2.0 ** 12, growth_interval=3)
    assert run.mpo.loss_scale == "dynamic"  # the default for FP16 params
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3)
    scaler.scale(torch.ones((), device=device))  # its lazy initialisation
    events = {4: dict(poison=(0, float("inf"))), 5: dict(poison=(2, float("nan"))),
              9: dict(big=True), 13: dict(poison=(4, -float("inf")))}
    for step in range(16):
        scale = run.mpo.get_scale()
        assert scale == scaler.get_scale()
        run.set_grads(step, scale=scale, **events.get(step, {}))
        if step == 9:  # the big gradients overflow fp16 once scaled
            assert not torch.isfinite(run.params[0].grad).all()
            for q, p in zip(run.ref, run.params):  # the reference sees the same overflow
                q.grad = p.grad.float() / scale
        before = snapshot(run.mpo)
        applied = run.mpo.step()
        for q in run.ref:  # torch's side: scaled FP32 gradients into GradScaler
            q.grad = q.grad * scale
        scaler.step(run.torch_opt)
        scaler.update()
        overflow = step in events
        assert applied.dtype == torch.bool and bool(applied) is not overflow
        assert bool(run.mpo.scaler.last_step_skipped()) is overflow
        if overflow:
            assert_unchanged(run.mpo, before, "step %d" % step)
        run.check(exact=not run.fused, what="step %d" % step)
    assert run.mpo.get_scale() == scaler.get_scale()
    assert run.mpo.scaler.get_skipped_steps() == len(events)


@pytest.mark.parametrize("name", ["torch_adamw", "rmsprop"])
def test_fixed_loss_scale(name):
    """A fixed power-of-two scale gives the bits of unscaled training, never moves (not even
    after an overflow), and still skips an overflowing step."""
    scaled = Run("cpu", name, torch.float16, loss_scale=1024.0)
    plain = Run("cpu", name, torch.float16, loss_scale=None)
    assert plain.mpo.get_scale() == 1.0
    for step in range(8):
        poison = (1, float("nan")) if step == 3 else None
        scaled.set_grads(step, scale=1024.0, poison=poison)
        plain.set_grads(step, poison=poison)
        before = snapshot(scaled.mpo)
        a, b = scaled.mpo.step(), plain.mpo.step()
        assert bool(a) is bool(b) is (step != 3)
        if step == 3:
            assert_unchanged(scaled.mpo, before)
        assert_same(snapshot(scaled.mpo), snapshot(plain.mpo), "step %d" % step)
        assert scaled.mpo.get_scale() == 1024.0
    assert scaled.mpo.scaler.get_skipped_steps() == plain.mpo.scaler.get_skipped_steps() == 1


def test_backward_scales_the_loss_and_zero_grad(device):
    w = torch.randn(6, 4).to(device, torch.float16).requires_grad_()
    b = torch.zeros(4, device=device, requires_grad=True)
    mpo = MPO(torch.optim.SGD([w, b], lr=0.1), init_scale=2.0 ** 10)
    x = torch.randn(3, 6).to(device, torch.float16)

    def loss_fn():
        return ((x @ w).float() + b).square().mean()

    loss_fn().backward()
    plain = [w.grad.clone(), b.grad.clone()]
    mpo.zero_grad()
    assert w.grad is None and b.grad is None
    mpo.backward(loss_fn())
    torch.testing.assert_close(w.grad.float(), plain[0].float() * 1024, rtol=2e-3, atol=0)
    assert_bitwise(b.grad, plain[1] * 1024)  # fp32: a power of two is exact
    mpo.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    # BF16 needs no scaling: backward is plain.
    v = torch.randn(3).bfloat16().requires_grad_()
    bf = MPO(torch.optim.SGD([v], lr=0.1))
    assert bf.loss_scale is None
    bf.backward(v.float().sum() * 3)
    assert torch.equal(v.grad, torch.full((3,), 3.0, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------------
# Clipping.


@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
@pytest.mark.parametrize("name", ["torch_adamw", "sgd_nesterov"])
def test_clipping_matches_torch_clip_grad_norm(name, how):
    kw = dict(max_grad_norm=4.0) if how == "max_grad_norm" else {}
    run = Run("cpu", name, torch.bfloat16, loss_scale=256.0, **kw)
    for step in range(10):
        run.set_grads(step, scale=256.0, big=step % 2 == 0)  # clipped on even steps only
        if how == "clip_grad_norm_":
            norm = run.mpo.clip_grad_norm_(4.0)
            assert norm.dtype == torch.float32 and norm.dim() == 0
        ref_norm = torch.nn.utils.clip_grad_norm_(run.ref, 4.0)
        if how == "clip_grad_norm_":
            torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        run.mpo.step()
        run.torch_opt.step()
        run.check(exact=False, what="step %d" % step)


def test_clip_grad_norm_twice_composes_like_torch():
    run = Run("cpu", "sgd_nesterov", torch.bfloat16, loss_scale=None)
    run.set_grads(0, big=True)
    n1, n2 = run.mpo.clip_grad_norm_(5.0), run.mpo.clip_grad_norm_(2.0)
    r1 = torch.nn.utils.clip_grad_norm_(run.ref, 5.0)
    r2 = torch.nn.utils.clip_grad_norm_(run.ref, 2.0)
    torch.testing.assert_close(n1, r1, rtol=1e-6, atol=0)
    torch.testing.assert_close(n2, r2, rtol=1e-5, atol=0)
    run.mpo.step()
    run.torch_opt.step()
    run.check(exact=False)


def test_non_finite_norm_skips_the_step():
    run = Run("cpu", "torch_adamw", torch.bfloat16, max_grad_norm=1.0)
    run.set_grads(0, poison=(3, float("nan")))
    before = snapshot(run.mpo)
    assert not bool(run.mpo.step())
    assert_unchanged(run.mpo, before)
    run.set_grads(1)
    assert bool(run.mpo.step())


# --------------------------------------------------------------------------------------------
# Params without gradients, param groups, add_param_group.


@pytest.mark.parametrize("name", ["torch_adamw", "sgd_nesterov"])
def test_params_without_grads_are_untouched(name):
    run = Run("cpu", name)
    frozen = (1, 4)  # a bf16 param and the fp32 one
    start = [run.params[i].detach().clone() for i in frozen]
    for step in range(5):
        run.set_grads(step, skip=frozen)
        run.mpo.step()
        run.torch_opt.step()
        run.check(exact=not run.fused)
    for i, s in zip(frozen, start):
        assert_bitwise(run.params[i].detach(), s)
        assert len(run.mpo.state[run.masters()[i]]) == 0


@pytest.mark.parametrize("name", ["torch_adamw", "mpext_adamw", "sgd_nesterov"])
def test_param_groups_with_own_hyperparameters(name):
    wd_key = "weight_decay"
    groups = [([0, 1], dict(lr=0.01, **{wd_key: 0.2})), ([2, 4], dict(lr=0.003)), ([3], {})]
    if INNER[name][2]:
        groups[2][1]["betas"] = (0.5, 0.9)
    run = Run("cpu", name, groups=groups)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.02, 0.01, 0.005], total_steps=20)
              for o in (run.mpo, run.torch_opt)]
    for step in range(12):
        run.set_grads(step)
        run.mpo.step()
        run.torch_opt.step()
        for s in scheds:
            s.step()
        run.check(exact=not run.fused, what="step %d" % step)
    assert [g["lr"] for g in run.mpo.param_groups] == [g["lr"] for g in run.torch_opt.param_groups]


def test_add_param_group():
    run = Run("cpu", "sgd_nesterov")
    extra = torch.randn(5, 2).bfloat16().requires_grad_()
    extra_ref = extra.detach().float().requires_grad_()
    run.mpo.add_param_group({"params": [extra], "lr": 0.5})
    run.torch_opt.add_param_group({"params": [extra_ref], "lr": 0.5})
    master = run.mpo.master_param(extra)
    assert master is not None and run.mpo.param_groups[1]["params"][0] is master
    assert_bitwise(master, extra.detach().float())
    for step in range(3):
        run.set_grads(step)
        extra.grad = torch.full_like(extra, 0.25 * (step + 1))
        extra_ref.grad = extra.grad.float()
        run.mpo.step()
        run.torch_opt.step()
        run.check(exact=True)
        assert_bitwise(master, extra_ref.detach())
        assert_bitwise(extra.detach(), master.to(torch.bfloat16))
    with pytest.raises(ValueError, match="same tensor"):
        run.mpo.add_param_group({"params": [extra]})
    with pytest.raises(ValueError, match="several devices"):
        run.mpo.add_param_group({"params": [torch.zeros(2, device="meta")]})
    assert len(run.mpo.param_groups) == 2


# --------------------------------------------------------------------------------------------
# state_dict.


def _train(run, steps, first, poison_at=()):
    for step in range(first, first + steps):
        run.set_grads(step, scale=run.mpo.get_scale(),
                      poison=(0, float("inf")) if step in poison_at else None)
        run.mpo.step()


@pytest.mark.parametrize("name", ["torch_adamw", "mpext_adamw", "sgd_nesterov", "rmsprop"])
def test_state_dict_round_trip_is_bit_identical(device, name):
    kw = dict(dtype=torch.float16, init_scale=2.0 ** 10, growth_interval=2, max_grad_norm=50.0)
    a = Run(device, name, **kw)
    _train(a, 6, 0, poison_at={3})
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in a.params], "optim": a.mpo.state_dict()}, buf)
    _train(a, 6, 6, poison_at={8})
    b = Run(device, name, seed=1, **kw)  # other initial weights: all come from the checkpoint
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    with torch.no_grad():
        for p, saved in zip(b.params, ckpt["model"]):
            if p.dtype == torch.float32:  # the FP32 params are the model's to load; the
                p.copy_(saved)            # BF16/FP16 ones are written from the masters
    b.mpo.load_state_dict(ckpt["optim"])
    for p, saved in zip(b.params, ckpt["model"]):
        assert_bitwise(p.detach(), saved)
    _train(b, 6, 6, poison_at={8})
    assert_same(snapshot(a.mpo), snapshot(b.mpo))
    assert a.mpo.get_scale() == b.mpo.get_scale()
    assert a.mpo.scaler.state_dict() == b.mpo.scaler.state_dict()


@pytest.mark.parametrize("name", ["torch_adamw", "sgd_fused"])
def test_deepcopy_continues_identically(name):
    a = Run("cpu", name, torch.float16, init_scale=2.0 ** 10, growth_interval=2)
    torch.optim.lr_scheduler.StepLR(a.mpo, step_size=1)  # wraps a.mpo.step on the instance
    _train(a, 3, 0)
    b = copy.copy(a)
    b.mpo = copy.deepcopy(a.mpo)
    b.params = [p for p, _ in b.mpo._entries]
    assert all(x is not y for x, y in zip(a.params, b.params))
    _train(a, 3, 3, poison_at={4})
    _train(b, 3, 3, poison_at={4})
    assert_same(snapshot(a.mpo), snapshot(b.mpo))
    assert a.mpo.get_scale() == b.mpo.get_scale()


def test_inner_state_dict_is_torchs_format():
    run = Run("cpu", "torch_adamw")
    _train(run, 3, 0)
    sd = run.mpo.state_dict()
    assert set(sd) == {"optimizer", "masters", "scaler", "loss_scale"}
    assert sorted(sd["masters"]) == [0, 1, 2, 3]  # the bf16 params; the fp32 one has none
    # A plain torch AdamW over FP32 copies of the masters takes the inner state as it is.
    plain = torch.optim.AdamW([m.detach().clone() for m in run.masters()], lr=3e-3,
                              weight_decay=0.1)
    plain.load_state_dict(sd["optimizer"])
    for i, st in plain.state_dict()["state"].items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].item() == 3


# (missing and extra keys, another loss-scale mode, a master's shape and dtype, the scaler's
# state: the bad-input matrix's MPO state-dict rows)
LOAD_BAD = [
    ("not a dict", lambda sd: [sd], TypeError, "state_dict must be a dict"),
    ("master missing", lambda sd: dict(sd, masters={0: sd["masters"][0]}), ValueError,
     "masters has entries"),
    ("inner groups", lambda sd: dict(sd, optimizer=dict(sd["optimizer"], param_groups=[])),
     ValueError, "different number of parameter groups"),
]


@pytest.mark.parametrize("what,mutate,exc,match", LOAD_BAD, ids=[c[0] for c in LOAD_BAD])
def test_bad_state_dict_changes_nothing(what, mutate, exc, match):
    src = Run("cpu", "torch_adamw", torch.float16)
    _train(src, 3, 0)
    dst = Run("cpu", "torch_adamw", torch.float16, seed=2)
    _train(dst, 2, 0)
    before, scale = snapshot(dst.mpo), dst.mpo.get_scale()
    with pytest.raises(exc, match=match):
        dst.mpo.load_state_dict(mutate(src.mpo.state_dict()))
    assert_same(snapshot(dst.mpo), before)
    assert dst.mpo.get_scale() == scale


# --------------------------------------------------------------------------------------------
# Host reads.


@pytest.mark.parametrize("name", ["torch_adamw", "mpext_adamw", "sgd_fused"])
def test_step_makes_no_host_read(device, name):
    """Dynamic scale, clipping, an LR scheduler, an overflowing step: no read of a tensor
    value in backward/step/zero_grad (on CUDA also torch's sync debug mode set to error)."""
    run = Run(device, name, torch.float16, max_grad_norm=3.0, init_scale=2.0 ** 8,
              growth_interval=2)
    sched = torch.optim.lr_scheduler.StepLR(run.mpo, step_size=2, gamma=0.9)
    x = torch.randn(4, 13).to(device, torch.float16)
    reads = HostReads()
    results = []
    for step in range(8):
        counted = step >= 2  # after the lazy initialisations
        if counted and device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            with reads.counting() if counted else contextlib.nullcontext():
                run.mpo.zero_grad()
                loss = (x @ run.params[0]).float().square().mean() + run.params[4].sum()
                if step == 5:
                    loss = loss * float("inf")
                run.mpo.backward(loss)
                results.append(run.mpo.step())
                sched.step()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    assert reads.calls == []
    assert [bool(r) for r in results] == [s != 5 for s in range(8)]


def test_generic_path_reads_found_inf_once_per_step():
    """An inner optimizer that cannot skip on the device (plain SGD) costs exactly one read of
    the inf/NaN flag per step, as torch.amp.GradScaler.step does for it."""
    run = Run("cpu", "sgd_nesterov", torch.float16)
    reads = HostReads()
    for step in range(4):
        run.set_grads(step, scale=2.0 ** 16 if step == 0 else run.mpo.get_scale())
        with reads.counting():
            run.mpo.step()
    assert reads.calls == ["item"] * 4


def test_found_inf_is_reduced_before_it_is_used(monkeypatch):
    """The flag goes through GradScaler._reduce_found_inf_ (the all-reduce under DDP) before
    the step reads it: a flag raised there (as another rank's overflow would) skips the step."""
    for name in ("torch_adamw", "sgd_nesterov", "sgd_fused"):
        run = Run("cpu", name, torch.float16)
        seen = []

        def remote_overflow(found_inf):
            seen.append(found_inf)
            found_inf.fill_(1.0)

        monkeypatch.setattr(run.mpo.scaler, "_reduce_found_inf_", remote_overflow,
                            raising=False)
        run.set_grads(0, scale=run.mpo.get_scale())
        before, scale = snapshot(run.mpo), run.mpo.get_scale()
        assert not bool(run.mpo.step())
        assert len(seen) == 1
        assert_unchanged(run.mpo, before, name)
        assert run.mpo.get_scale() == scale / 2


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_sync_found_inf_all_reduces_through_the_process_group(tmp_path, monkeypatch):
    """sync_found_inf=True (a scaler option) sends each step's flag through an all-reduce
    (MAX) of the process group: a one-rank gloo group here, the collective really runs."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    try:
        reduced = []
        real = dist.all_reduce

        def spy(tensor, *args, **kwargs):
            reduced.append(tensor.clone())
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", spy)
        for kw in (dict(init_scale=256.0), dict(loss_scale=8.0), dict(loss_scale=None)):
            run = Run("cpu", "torch_adamw", torch.float16, sync_found_inf=True, **kw)
            reduced.clear()
            for step in range(3):
                run.set_grads(step, scale=run.mpo.get_scale(),
                              poison=(0, float("nan")) if step == 1 else None)
                assert bool(run.mpo.step()) is (step != 1)
            assert [float(t) for t in reduced] == [0.0, 1.0, 0.0], kw
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Construction: defaults, warnings, errors.


def test_defaults_and_torch_optimizer_interface():
    bf = MPO(torch.optim.SGD([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], lr=1))
    fp = MPO(torch.optim.SGD([torch.zeros(3, dtype=torch.float16, requires_grad=True)], lr=1))
    mixed = MPO(torch.optim.SGD([torch.zeros(3, dtype=torch.float16, requires_grad=True),
                                 torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)], lr=1))
    assert (bf.loss_scale, fp.loss_scale, mixed.loss_scale) == (None, "dynamic", "dynamic")
    assert fp.get_scale() == 2.0 ** 16 and bf.get_scale() == 1.0
    assert fp.scale.dtype == torch.float32 and fp.scale.dim() == 0
    assert isinstance(bf, torch.optim.Optimizer)
    assert bf.param_groups is bf.optimizer.param_groups and bf.state is bf.optimizer.state
    assert bf.defaults is bf.optimizer.defaults
    calls = []
    bf.register_step_pre_hook(lambda *a: calls.append("pre"))
    bf.register_step_post_hook(lambda *a: calls.append("post"))
    bf.step()
    assert calls == ["pre", "post"]
    with pytest.raises(NotImplementedError, match="inner optimizer"):
        bf.register_state_dict_pre_hook(lambda *a: None)


def test_fp32_only_warns_and_still_scales():
    p = torch.randn(4, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    with pytest.warns(UserWarning, match="FP32 params only"):
        mpo = MPO(torch.optim.SGD([p], lr=0.1, momentum=0.9), loss_scale=64.0)
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for step in range(3):
        g = torch.randn(4)
        p.grad, q.grad = g * 64, g.clone()
        mpo.step()
        ref.step()
        assert_bitwise(p.detach(), q.detach())


def test_state_made_before_wrapping_moves_to_the_master():
    """SGD stepped on bf16 params, then wrapped: its momentum buffers become the masters'
    (upcast), and training goes on as torch's SGD with that upcast state."""
    ps = [torch.randn(4, 3).bfloat16().requires_grad_(), torch.randn(5).requires_grad_()]
    opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt.step()
    buf = opt.state[ps[0]]["momentum_buffer"]
    ref_ps = [p.detach().float().requires_grad_() for p in ps]
    ref = torch.optim.SGD(ref_ps, lr=0.1, momentum=0.9)
    for p, q in zip(ps, ref_ps):
        ref.state[q]["momentum_buffer"] = opt.state[p]["momentum_buffer"].float()
    mpo = MPO(opt)
    master = mpo.master_param(ps[0])
    assert ps[0] not in opt.state
    assert_bitwise(opt.state[master]["momentum_buffer"], buf.float())
    for step in range(3):
        for p, q in zip(ps, ref_ps):
            p.grad = torch.randn(p.shape).to(p.dtype)
            q.grad = p.grad.float()
        mpo.step()
        ref.step()
        assert_bitwise(master, ref_ps[0].detach())
        assert_bitwise(ps[1].detach(), ref_ps[1].detach())


def _params(*specs):
    return [torch.zeros(s, dtype=d, requires_grad=d.is_floating_point) for s, d in specs]


def _sgd(**kw):
    return lambda: (torch.optim.SGD(_params(((3,), torch.float16), ((2,), torch.float32)),
                                    lr=0.1), kw)


def _wrapped():
    opt = torch.optim.SGD(_params(((3,), torch.bfloat16)), lr=0.1)
    return MPO(opt), {}


# The other refusals (a duplicate, overlapping, strided, float64 or other-device param; the
# loss_scale, max_grad_norm and scaler options' values) are the bad-input matrix's
# (tests/test_bad_inputs.py, MPO rows: the inner optimizer, its params' identities and bytes
# unchanged); these are the rest.
CTOR_BAD = [
    ("not an optimizer", lambda: ([torch.zeros(2)], {}), TypeError,
     "must be a torch.optim.Optimizer"),
    ("wrapped twice", _wrapped, TypeError, "already a MixedPrecisionOptimizer"),
    ("int param", lambda: (torch.optim.SGD(_params(((2,), torch.int32)), lr=0.1), {}),
     TypeError, "dtype int32"),
    ("loss_scale bool", _sgd(loss_scale=True), ValueError, "loss_scale must be"),
    ("max_grad_norm str", _sgd(max_grad_norm="1"), ValueError, "max_grad_norm must be"),
    ("reserved option", _sgd(enabled=False), TypeError, "enabled is set by the wrapper"),
]


@pytest.mark.parametrize("what,make,exc,match", CTOR_BAD, ids=[c[0] for c in CTOR_BAD])
def test_constructor_rejects_and_changes_nothing(what, make, exc, match):
    opt, kw = make()
    groups = ([list(g["params"]) for g in opt.param_groups]
              if isinstance(opt, torch.optim.Optimizer) else None)
    state = dict(opt.state) if isinstance(opt, torch.optim.Optimizer) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the FP32-only warning is not what is tested here
        with pytest.raises(exc, match=match):
            MPO(opt, **kw)
    if groups is not None:
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == \
            [[id(p) for p in g] for g in groups]
        assert dict(opt.state) == state


STEP_BAD = [
    ("grad dtype", lambda ps: setattr(ps[1], "grad", torch.ones(2, dtype=torch.float16)),
     TypeError, "gradient of param 1 has dtype float16"),
    ("sparse grad", lambda ps: setattr(ps[0], "grad", torch.ones(3, dtype=torch.float16)
                                       .to_sparse()), RuntimeError, "only dense gradients"),
]


@pytest.mark.parametrize("what,spoil,exc,match", STEP_BAD, ids=[c[0] for c in STEP_BAD])
def test_bad_step_changes_nothing(what, spoil, exc, match):
    ps = _params(((3,), torch.float16), ((2,), torch.float32))
    allow_any_grad_dtype(ps)
    mpo = MPO(torch.optim.AdamW(ps, lr=0.1), max_grad_norm=1.0)
    for p in ps:
        p.grad = torch.ones_like(p)
    mpo.step()
    for p in ps:
        p.grad = torch.ones_like(p)
    spoil(ps)
    before, scale = snapshot(mpo), mpo.get_scale()
    with pytest.raises(exc, match=match):
        mpo.step()
    assert_same(snapshot(mpo), before)
    assert mpo.get_scale() == scale
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        mpo.clip_grad_norm_(0.0)


# ---------------------------------------------------------------------------------------------
# Driven as frameworks drive it: their own backward pass, closures, torch.compile, caller-owned
# param groups.


def _lin(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 3, bias=True).to(dtype)


def _data(step, dtype):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=gen).to(dtype), torch.randn(4, 3, generator=gen)


def _loss(lin, step, dtype):
    x, y = _data(step, dtype)
    return ((lin(x).float() - y) ** 2).mean()


@pytest.mark.parametrize("loss_scale", ["dynamic", 64.0])
def test_plain_backward_with_loss_scaling_raises_and_changes_nothing(loss_scale):
    """A framework's plain loss.backward() gives gradients without the scale: unscaling them
    would make the SGD update 1/scale of the right one. step() and clip_grad_norm_() refuse."""
    lin = _lin()
    kw = {"init_scale": 2.0 ** 8} if loss_scale == "dynamic" else {}
    mpo = MPO(torch.optim.SGD(lin.parameters(), lr=0.1), loss_scale=loss_scale, **kw)
    before, scale = snapshot(mpo), mpo.get_scale()
    _loss(lin, 0, torch.float16).backward()
    with pytest.raises(RuntimeError, match=r"did not go through the loss scale.*"
                                           r"opt\.scale_loss\(loss\)\.backward\(\)"):
        mpo.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="did not go through the loss scale"):
        mpo.step()
    assert_same(snapshot(mpo), before)
    assert mpo.get_scale() == scale
    # Mixed: a scaled pass and a plain one accumulate into the same gradients.
    mpo.zero_grad()
    mpo.backward(_loss(lin, 1, torch.float16))
    _loss(lin, 2, torch.float16).backward()
    with pytest.raises(RuntimeError, match="did not go through the loss scale"):
        mpo.step()
    # zero_grad starts a clean iteration.
    mpo.zero_grad()
    mpo.backward(_loss(lin, 3, torch.float16))
    assert bool(mpo.step())


@pytest.mark.parametrize("how", ["backward", "scale_loss", "autograd_backward",
                                 "reentrant_checkpoint"])
def test_scaled_backward_gives_the_exact_sgd_update(how):
    """Through backward(), scale_loss() (also with torch.autograd.backward and a reentrant
    checkpoint, whose backward pass runs nested inside the outer one) the master moves by
    exactly -lr * g, g the unscaled gradient (a power-of-two scale is exact)."""
    import torch.utils.checkpoint as checkpoint
    lin = _lin()
    mpo = MPO(torch.optim.SGD(lin.parameters(), lr=0.5), loss_scale="dynamic",
              init_scale=2.0 ** 10)
    w0 = mpo.master_param(lin.weight).clone()
    x, y = _data(0, torch.float16)
    x.requires_grad_()  # a reentrant checkpoint differentiates only through inputs that do
    if how == "reentrant_checkpoint":
        out = checkpoint.checkpoint(lin, x, use_reentrant=True)
    else:
        out = lin(x)
    loss = ((out.float() - y) ** 2).mean()
    ref_lin = _lin(torch.float32)
    ref_loss = ((ref_lin(x.float()) - y) ** 2).mean()
    g = torch.autograd.grad(ref_loss, ref_lin.weight)[0]
    if how == "backward":
        mpo.backward(loss)
    elif how == "autograd_backward":
        torch.autograd.backward([mpo.scale_loss(loss)])
    else:
        mpo.scale_loss(loss).backward()
    grad = lin.weight.grad.float() / 2.0 ** 10  # the fp16 gradient carries the scale
    assert bool(mpo.step())
    assert_bitwise(mpo.master_param(lin.weight), w0 - 0.5 * grad)
    # The same as what the FP32 model's gradient gives, up to fp16 rounding of the gradient.
    torch.testing.assert_close(mpo.master_param(lin.weight), w0 - 0.5 * g, rtol=0, atol=2e-3)


def test_hand_set_gradients_are_taken_as_scaled():
    """Gradients assigned by hand (no backward pass) are taken to carry the scale, as the
    rest of this file relies on; bf16 without loss scaling takes a plain backward."""
    lin = _lin(torch.bfloat16)
    mpo = MPO(torch.optim.SGD(lin.parameters(), lr=0.5))
    assert mpo.loss_scale is None
    _loss(lin, 0, torch.bfloat16).backward()
    w0, g = mpo.master_param(lin.weight).clone(), lin.weight.grad.float()
    assert bool(mpo.step())
    assert_bitwise(mpo.master_param(lin.weight), w0 - 0.5 * g)
    assert mpo.scale_loss(torch.ones(())) is not None


@pytest.mark.parametrize("name", ["torch_adamw", "sgd_nesterov"])
def test_step_with_closure_like_torch(name):
    """step(closure) runs the closure with gradients enabled (step itself runs under no_grad),
    returns its loss, and trains exactly as backward() + step() do."""
    cls, kw, _ = INNER[name]
    a, b = _lin(seed=1), _lin(seed=1)
    ma = MPO(cls(a.parameters(), **kw), max_grad_norm=1.0, init_scale=2.0 ** 8)
    mb = MPO(cls(b.parameters(), **kw), max_grad_norm=1.0, init_scale=2.0 ** 8)
    for step in range(4):
        seen = []

        def closure():
            seen.append(torch.is_grad_enabled())
            ma.zero_grad()
            loss = _loss(a, step, torch.float16)
            ma.backward(loss)
            return loss

        loss = ma.step(closure)
        assert seen == [True]
        assert isinstance(loss, torch.Tensor) and loss.requires_grad
        mb.zero_grad()
        ref_loss = _loss(b, step, torch.float16)
        mb.backward(ref_loss)
        mb.step()
        assert_bitwise(loss.detach(), ref_loss.detach())
        for p, q in zip(a.parameters(), b.parameters()):
            assert_bitwise(p.detach(), q.detach())
            assert_bitwise(ma.master_param(p), mb.master_param(q))
        assert ma.get_scale() == mb.get_scale()


def test_closure_with_a_plain_backward_is_refused():
    lin = _lin()
    mpo = MPO(torch.optim.SGD(lin.parameters(), lr=0.1), init_scale=2.0 ** 8)
    before = snapshot(mpo)

    def closure():
        loss = _loss(lin, 0, torch.float16)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="did not go through the loss scale"):
        mpo.step(closure)
    assert_same(snapshot(mpo), before)


@pytest.mark.parametrize("name", ["torch_adamw", "mpext_adamw", "sgd_nesterov", "sgd_fused"])
def test_compiled_step_matches_eager_bit_for_bit(name, monkeypatch):
    """torch.compile(opt.step) runs (the fused path whole; the generic path breaks the graph at
    its one host read) and matches eager, an overflowing step included: bit for bit on the fused
    path (mpext's kernels only); on the generic path the inner torch optimizer's own math is
    compiled by inductor, which contracts into FMAs, so the masters agree to rounding there and
    everything mpext decides (scale, skip, the rounded params) exactly. No step after the first
    probes the dispatcher for kernels."""
    torch._dynamo.reset()
    cls, kw, fused = INNER[name]
    a, b = _lin(seed=2), _lin(seed=2)
    ma = MPO(cls(a.parameters(), **kw), loss_scale="dynamic", init_scale=2.0 ** 8,
             growth_interval=2, max_grad_norm=2.0)
    mb = MPO(cls(b.parameters(), **kw), loss_scale="dynamic", init_scale=2.0 ** 8,
             growth_interval=2, max_grad_norm=2.0)
    compiled = torch.compile(ma.step)
    probes = []
    real_probe = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda *args: probes.append(args) or real_probe(*args))
    for step in range(6):
        if step == 1:
            probes.clear()  # a first lookup may probe; the steps after it must not
        for lin, mpo, run in ((a, ma, compiled), (b, mb, mb.step)):
            mpo.zero_grad()
            mpo.backward(_loss(lin, step, torch.float16))
            if step == 3:
                lin.weight.grad.view(-1)[1] = float("inf")
            run()
        assert ma.get_scale() == mb.get_scale()
        for p, q in zip(a.parameters(), b.parameters()):
            if fused:
                assert_bitwise(p.detach(), q.detach())
                assert_bitwise(ma.master_param(p), mb.master_param(q))
            else:
                torch.testing.assert_close(ma.master_param(p), mb.master_param(q), rtol=1e-6,
                                           atol=1e-7)
            assert_bitwise(p.detach(), ma.master_param(p).to(p.dtype))
    assert ma.scaler.get_skipped_steps() == mb.scaler.get_skipped_steps() == 1
    # mpext's probe names a backend ("CPU"/"CUDA"); torch's functionalization makes probes of
    # its own ("Functionalize"), which are not mpext's to avoid
    assert [p for p in probes if str(p[0]).startswith("mpext::") and p[1] in ("CPU", "CUDA")] \
        == []
    torch._dynamo.reset()


def test_callers_param_group_dicts_are_left_alone():
    """Wrapping must not put the masters into dicts the caller (or ZeroRedundancyOptimizer)
    holds: they keep listing the model's params."""
    lin = _lin(torch.bfloat16)
    groups = [{"params": [lin.weight], "lr": 0.1}, {"params": [lin.bias], "lr": 0.2}]
    inner = torch.optim.AdamW(groups)
    mpo = MPO(inner)
    assert [g["params"] for g in groups] == [[lin.weight], [lin.bias]]
    assert all(p.dtype == torch.bfloat16 for g in groups for p in g["params"])
    assert [g["params"] for g in mpo.param_groups] == [[mpo.master_param(lin.weight)],
                                                       [mpo.master_param(lin.bias)]]
    assert [g["lr"] for g in mpo.param_groups] == [0.1, 0.2]
    mpo.param_groups[0]["lr"] = 0.05  # what an LR scheduler does: the inner optimizer sees it
    assert inner.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("options,asked", [
    (dict(param_remainders=True), "param_remainders=True"),
    (dict(master_weights=False, stochastic_rounding=True), "master_weights=False"),
    (dict(master_weights=False), "master_weights=False"),
])
def test_inner_mpext_storage_options_are_refused_not_ignored(options, asked):
    """The wrapper's masters are the inner optimizer's FP32 params, so an inner mpext.optim
    group asking for remainders or no master cannot be honoured: refused with the way out
    (before, it was silently ignored and each param held a 4-byte master), at construction,
    in add_param_group and when a group is changed before a step -- nothing modified. The
    options it does honour (BF16 / 8-bit moments, ema_decay) and FP32-only groups pass."""
    lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
    before = [p.detach().clone() for p in lin.parameters()]
    inner = mpext.optim.AdamW(lin.parameters(), lr=1e-2, **options)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                   for g in inner.param_groups])
    msg = (r"group 0 of the inner AdamW asks for %s, which MixedPrecisionOptimizer cannot "
           r"honour: .* Use mpext.optim.AdamW directly on the model's params" % asked)
    with pytest.raises(ValueError, match=msg):
        MPO(inner)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, b)
               for p, b in zip(lin.parameters(), before))
    assert [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] \
        == groups_before and not inner.state

    # honoured options, and an FP32-only group that asks for anything, pass
    fine = torch.nn.Linear(8, 4).to(torch.bfloat16)
    norm = torch.nn.LayerNorm(4)
    ok = MPO(mpext.optim.AdamW([{"params": fine.parameters(), "exp_avg_dtype": torch.bfloat16,
                                 "exp_avg_sq_dtype": torch.bfloat16, "ema_decay": 0.9},
                                {"params": norm.parameters(), **options}], lr=1e-2))
    extra = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"add_param_group: group 0 of the inner AdamW asks for "
                                         + asked):
        ok.add_param_group({"params": list(extra.parameters()), **options})
    assert len(ok.param_groups) == 2
    # changed in place after construction: refused at the step, before anything is written
    ok.backward(norm(fine(torch.randn(2, 8).to(torch.bfloat16)).float()).sum())
    ok.param_groups[0].update(options)
    masters = [ok.master_param(p).clone() for p in fine.parameters()]
    with pytest.raises(ValueError, match=r"asks for %s" % asked):
        ok.step()
    assert all(torch.equal(ok.master_param(p), m) for p, m in zip(fine.parameters(), masters))
