"""mpext.MixedPrecisionOptimizer enters the step engine through the door mpext.optim's own
step uses (the rule's hyperparameters, state and launch): for mpext.optim's and torch's
Adam/AdamW it does (tests/test_mixed_precision.py checks their results), and the door takes
any rule: with Lion and SGD let through (mixed_precision._FAST_RULES, which keeps them on the
generic path by default) the fast path follows the rule's reference optimizer (lion-pytorch,
torch.optim.SGD) on FP32 copies and the generic path, bit for bit where the rule's master
format is (Lion), within the master format's tolerance of tests/test_sgd.py otherwise."""
import pickle

import pytest
import torch

import mpext
from mpext import MixedPrecisionOptimizer as MPO
from mpext.amp import mixed_precision
from mpext.optim._base import FusedOptimizer

import optim_table as T

try:
    from lion_pytorch import Lion as RefLion
except ImportError:  # the reference is a test dependency; without it only the SGD rows run
    RefLion = None

SHAPES = [(13, 7), (31,), (2, 3, 5), (1,)]
# name -> (mpext.optim class, its reference on FP32 params, keyword arguments, bitwise?)
RULES = {
    "lion": (mpext.optim.Lion, RefLion, dict(lr=1e-3, weight_decay=0.1), True),
    "sgd_momentum": (mpext.optim.SGD, torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), False),
    "sgd": (mpext.optim.SGD, torch.optim.SGD, dict(lr=0.05), False),
}


def close(a, b, exact, what):
    if exact:
        T.assert_bits(a, b, what)
    else:  # tests/test_sgd.py's tolerance for a master's step against torch's FP32 one
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


@pytest.fixture
def all_rules_fast(monkeypatch):
    monkeypatch.setattr(mixed_precision, "_FAST_RULES",
                        (mpext.optim.Adam, mpext.optim.AdamW, mpext.optim.Lion, mpext.optim.SGD))


def _rule(name):
    cls, ref, kw, _ = RULES[name]
    if ref is None:
        pytest.skip("lion-pytorch (the Lion reference) is not installed")
    return cls, ref, kw


class Run:
    """BF16/FP16 params (and one FP32) wrapped around an inner mpext.optim optimizer, with the
    reference optimizer on FP32 copies fed the same gradients, unscaled."""

    def __init__(self, device, name, dtype, use_fused=True, **mpo_kw):
        cls, ref, kw = _rule(name)
        gen = torch.Generator().manual_seed(3)
        self.params = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_()
                       for s in SHAPES] + [torch.randn(9, generator=gen).to(device)
                                           .requires_grad_()]
        self.ref = [p.detach().float().cpu().clone().requires_grad_() for p in self.params]
        self.inner = cls(self.params, **kw)
        self.mpo = MPO(self.inner, **mpo_kw)
        self.mpo._use_fused = use_fused
        self.ref_opt = ref(self.ref, **kw)
        self.device = device

    def step(self, step, scale, poison=False):
        gen = torch.Generator().manual_seed(7919 * step + 1)
        for p, q in zip(self.params, self.ref):
            g = torch.randn(p.shape, generator=gen).to(p.dtype)  # the gradient backward makes
            p.grad = (g.float() * scale).to(self.device, p.dtype)  # a power of two: exact
            q.grad = g.float()
        if poison:
            self.params[0].grad.view(-1)[0] = float("inf")
        applied = bool(self.mpo.step())
        if applied:
            self.ref_opt.step()
        return applied

    def masters(self):
        return [self.mpo.master_param(p) if p.dtype != torch.float32 else p
                for p in self.params]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_enters_the_door(device, name, dtype, all_rules_fast):
    exact = RULES[name][3]
    run = Run(device, name, dtype, loss_scale="dynamic", init_scale=2.0 ** 8, growth_interval=3)
    launched = []
    launch = run.inner._launch

    def spy(items, inv_scale, found_inf):
        launched.append({it.param.dtype for it in items})
        launch(items, inv_scale, found_inf)

    run.inner._launch = spy
    skipped = 0
    for step in range(8):
        scale = run.mpo.get_scale()
        applied = run.step(step, scale, poison=step == 4)
        assert applied is (step != 4)
        skipped += not applied
        for i, (p, m, q) in enumerate(zip(run.params, run.masters(), run.ref)):
            close(m.detach().cpu(), q.detach(), exact, "step %d param %d" % (step, i))
            if p.dtype != torch.float32:  # the model param is its master rounded
                T.assert_bits(p.detach().cpu(), m.detach().cpu().to(p.dtype))
    # the rule's own launch stepped the model's params (the fast path), not the masters
    assert launched and all(dtype in kinds for kinds in launched)
    assert run.mpo.scaler.get_skipped_steps() == skipped == 1
    # its state is the reference's: torch's keys, FP32
    for q, r in zip(run.inner.param_groups[0]["params"], run.ref):
        for key, v in run.ref_opt.state[r].items():
            if isinstance(v, torch.Tensor) and key != "step":
                close(run.inner.state[q][key].cpu(), v, exact, key)


@pytest.mark.parametrize("name", sorted(RULES))
def test_fast_path_equals_generic_path(name, all_rules_fast):
    """The fast path and the generic path (the inner optimizer's own step over the masters,
    after the cast and unscale passes) give the same bits, clipping and an overflow included."""
    runs = [Run("cpu", name, torch.bfloat16, use_fused=f, loss_scale="dynamic",
                init_scale=2.0 ** 6, max_grad_norm=2.0) for f in (True, False)]
    for step in range(6):
        for run in runs:
            run.step(step, run.mpo.get_scale(), poison=step == 2)
        for a, b in zip(runs[0].masters(), runs[1].masters()):
            close(a.detach(), b.detach(), RULES[name][3], "step %d" % step)
    assert runs[0].mpo.get_scale() == runs[1].mpo.get_scale()


def test_torch_adamw_is_stepped_by_mpext_rule_over_its_masters():
    """For torch.optim.AdamW the rule is an mpext.optim.AdamW over the inner optimizer's params
    that holds nothing itself; a pickled wrapper makes its own again and continues alike."""
    p = torch.randn(40).bfloat16().requires_grad_()
    mpo = MPO(torch.optim.AdamW([p], lr=1e-2))
    rule = mpo._rule
    assert isinstance(rule, mpext.optim.AdamW) and isinstance(rule, FusedOptimizer)
    assert rule.param_groups[0]["params"][0] is mpo.master_param(p)
    for step in range(3):
        p.grad = torch.randn(40, generator=torch.Generator().manual_seed(step)).bfloat16()
        mpo.step()
    assert len(rule.state) == 0 and len(mpo.state) == 1
    twin = pickle.loads(pickle.dumps(mpo))
    assert isinstance(twin._rule, mpext.optim.AdamW) and twin._rule is not rule
    (tp,) = [e[0] for e in twin._entries]
    g = torch.randn(40, generator=torch.Generator().manual_seed(9)).bfloat16()
    p.grad, tp.grad = g.clone(), g.clone()
    mpo.step()
    twin.step()
    T.assert_bits(tp.detach(), p.detach())
    T.assert_bits(twin.master_param(tp).detach(), mpo.master_param(p).detach())


@pytest.mark.parametrize("cls,fast", [(mpext.optim.AdamW, True), (mpext.optim.Adam, True),
                                      (torch.optim.AdamW, True), (torch.optim.Adam, True),
                                      (mpext.optim.Lion, False), (mpext.optim.SGD, False)])
def test_which_inner_optimizers_take_the_fast_path(cls, fast):
    """By default the fast path steps the model's BF16 params through the rule's launch for
    Adam/AdamW (mpext's and torch's); Lion and SGD keep the generic path, whose launch is the
    inner optimizer's own step over the FP32 masters."""
    p = torch.randn(40).bfloat16().requires_grad_()
    mpo = MPO(cls([p], lr=1e-3))
    rule = mpo._rule if fast else mpo.optimizer
    assert isinstance(rule, FusedOptimizer)
    launched = []
    launch = rule._launch

    def spy(items, *args):  # a list of StepItems, or the inner step's cached plan of them
        launched.append([it.param.dtype for it in items] if isinstance(items, list)
                        else "its own step's plan")
        launch(items, *args)

    rule._launch = spy
    p.grad = torch.randn(40).bfloat16()
    mpo.step()
    if fast:
        assert launched == [[torch.bfloat16]]
    else:
        assert launched in (["its own step's plan"], [[torch.float32]])
