"""Fault-injection soak: 5,000 training steps with NaN/+Inf/-Inf injected into gradients.

A tiny FP16 MLP (3,184 params) learns a fixed FP32 teacher on the CPU with dynamic loss
scaling, under mpext.optim.AdamW + mpext.GradScaler and under mpext.MixedPrecisionOptimizer (its
fused path around torch.optim.AdamW, 5,000 steps, and its generic path around torch.optim.Adamax,
1,000 steps). At random steps (seeded; single steps and bursts of up to 12 consecutive steps)
random elements of random params' gradients are overwritten with NaN, +Inf or -Inf after
backward, before the optimizer step. Checked on every step:

* the step is skipped exactly when a gradient is non-finite: when poisoned, or when the scaled
  gradient genuinely overflowed FP16 (detected independently, with ``torch.isfinite`` on the
  gradients before injection); MixedPrecisionOptimizer.step()'s result says the same;
* on a skipped step every param, FP32 master and optimizer state tensor (moments, step counter)
  is bitwise what it was before (compared as raw bytes, so NaN payloads and -0.0 count);
* on an applied step every step counter advanced by one;
* the loss scale is finite, > 0 and a normal float32 (>= ``torch.finfo(torch.float32).tiny``).

At the end the skip count reported by the scaler equals the poisoned steps plus the genuine
overflows, and the final loss on held-out data is close to that of a clean run (same seed, same
data, no injection); see ``LOSS_RTOL`` for what "close" means and why.

The last tests show why mpext's default rule stops backing off at the smallest normal float32:
with torch's rule a long enough run of overflows takes the scale through the subnormals to 0,
after which clean steps write NaN into the params.
"""
import math
import random

import pytest
import torch

import mpext

import resume_worker

STEPS = 5000
TINY = torch.finfo(torch.float32).tiny
VALUES = (float("nan"), float("inf"), float("-inf"))

# The poisoned run loses the batches of its skipped steps (81 of 5,000 here) and trains for a
# while at a lower loss scale after each burst, so its final loss differs from the clean run's
# a little, in either direction. Measured: 1.6% for the AdamW paths (both losses about 8,000x
# below the initial one), 0.2% for the Adamax path over 1,000 steps. 5% leaves room for other
# platforms' rounding; a corruption does not pass: one NaN reaching a master makes the loss NaN,
# and updates applied from poisoned or half-unscaled gradients wreck convergence.
LOSS_RTOL = 0.05


def make_problem(seed=0, batches=64, batch=32):
    """A fixed regression task: inputs and targets of an FP32 teacher MLP, in FP16."""
    g = torch.Generator().manual_seed(seed + 1000)
    teacher = [torch.randn(16, 24, generator=g) / 4, torch.randn(24, 16, generator=g) / 5]

    def target(x):
        return torch.tanh(x.float() @ teacher[0]) @ teacher[1]

    xs = torch.randn(batches, batch, 16, generator=g).to(torch.float16)
    ys = target(xs).to(torch.float16)
    x_eval = torch.randn(256, 16, generator=g).to(torch.float16)
    return xs, ys, x_eval, target(x_eval)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 16)).to(torch.float16)


def poison_plan(seed, steps, shapes, rate=0.005, bursts=8, max_burst=12):
    """{step: [(param index, flat element index, value), ...]}: single poisoned steps at about
    ``rate``, plus ``bursts`` runs of 2..max_burst consecutive poisoned steps. Every value of
    NaN, +Inf, -Inf occurs, and step 0 (before any optimizer state exists) is poisoned."""
    rng = random.Random(seed)
    poisoned = {0} | {s for s in range(steps) if rng.random() < rate}
    for _ in range(bursts):
        start, length = rng.randrange(steps), rng.randint(2, max_burst)
        poisoned.update(range(start, min(steps, start + length)))
    plan = {}
    for s in sorted(poisoned):
        entries = []
        for _ in range(rng.randint(1, 3)):
            pi = rng.randrange(len(shapes))
            entries.append((pi, rng.randrange(math.prod(shapes[pi])), rng.choice(VALUES)))
        plan[s] = entries
    kinds = {repr(v) for e in plan.values() for _, _, v in e}
    assert kinds == {"nan", "inf", "-inf"}
    return plan


def raw(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


class Checked:
    """What the soak reads from a trainer of tests/resume_worker.py (backward, step)."""

    def scale(self):
        return self.scaler.get_scale()

    def skipped(self):
        return self.scaler.get_skipped_steps()

    def state_of(self, p):
        """The optimizer state of model param ``p`` ({} before its first step), with its FP32
        master under "master_param"."""
        return self.opt.state.get(p, {})

    def state_tensors(self, params):
        """Everything a skipped step must leave untouched: masters, moments, step counters (every
        tensor of the param's optimizer state)."""
        out = []
        for p in params:
            st = self.state_of(p)
            out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        return out

    def step_counts(self, params):
        states = [self.state_of(p) for p in params]
        if not all("step" in st for st in states):
            return [0] * len(params)
        return [int(c) for c in torch.stack([st["step"] for st in states]).tolist()]


class AdamWScaler(Checked, resume_worker.AdamWScaler):
    """mpext.optim.AdamW (FP32 masters) driven by mpext.GradScaler."""

    def __init__(self, model, **scaler_options):
        super().__init__(model, lr=1e-3, **scaler_options)


class MixedPrecision(Checked, resume_worker.MixedPrecision):
    """mpext.MixedPrecisionOptimizer; step()'s result (was the step applied) is checked against
    the independent expectation."""

    def __init__(self, model, inner="adamw", **scaler_options):
        super().__init__(model, inner, lr=1e-3 if inner == "adamw" else 1e-2, **scaler_options)
        self.expect_applied = None

    def step(self):
        applied = super().step()
        assert applied.dtype == torch.bool and bool(applied) == self.expect_applied

    def state_of(self, p):
        q = self.opt.master_param(p)
        st = self.opt.optimizer.state.get(q, {})
        return {**st, "master_param": q} if st else {}


def soak(variant, plan, steps=STEPS, **options):
    """Trains ``steps`` steps with ``plan``'s injections, checking every step (see the module
    docstring). Returns (initial loss, final loss, skipped steps, genuine overflows, min and
    max scale seen)."""
    xs, ys, x_eval, y_eval = make_problem()
    model = make_model()
    params = list(model.parameters())
    trainer = variant(model, **options)

    def eval_loss():
        with torch.no_grad():
            return (model(x_eval).float() - y_eval).pow(2).mean().item()

    initial = eval_loss()
    expected_skips = genuine = 0
    applied = [0] * len(params)
    scales = []
    for step in range(steps):
        x, y = xs[step % len(xs)], ys[step % len(ys)]
        loss = (model(x).float() - y.float()).pow(2).mean()
        trainer.backward(loss)
        overflow = not bool(torch.cat([p.grad.view(-1) for p in params]).isfinite().all())
        genuine += overflow
        injected = plan.get(step, ())
        for pi, idx, value in injected:
            params[pi].grad.view(-1)[idx] = value
        skip = overflow or bool(injected)
        expected_skips += skip
        before = [raw(t) for t in params + trainer.state_tensors(params)] if skip else None
        had_state = [bool(trainer.state_of(p)) for p in params]
        trainer.expect_applied = not skip

        trainer.step()

        counts = trainer.step_counts(params)
        if skip:
            after = params + trainer.state_tensors(params)
            if all(had_state):
                assert len(after) == len(before)
                for i, (b, a) in enumerate(zip(before, after)):
                    assert torch.equal(b, raw(a)), "step %d: tensor %d changed on a skip" % (
                        step, i)
            else:  # no state yet; if the skip created it, it must be the initial one
                for i, p in enumerate(params):
                    assert torch.equal(before[i], raw(p)), "step %d: param %d changed" % (step, i)
                    st = trainer.state_of(p)
                    if st:
                        assert torch.equal(st["master_param"], p.float())
                        assert not any(st[k].any() for k in st if k.startswith("exp_"))
            assert counts == applied, "step %d was skipped but a step counter moved" % step
        else:
            applied = [c + 1 for c in applied]
            assert counts == applied, "step %d: a clean step did not advance the counters" % step
        scale = trainer.scale()
        assert math.isfinite(scale) and scale >= TINY, "step %d: scale %r" % (step, scale)
        scales.append(scale)

    assert trainer.skipped() == expected_skips
    for p in params:
        assert p.isfinite().all()
        st = trainer.state_of(p)
        for k, v in st.items():
            assert not isinstance(v, torch.Tensor) or v.isfinite().all(), k
    return initial, eval_loss(), expected_skips, genuine, min(scales), max(scales)


# Dynamic scaling with torch's rule plus a floor: min_scale keeps the scale normal however
# many steps are poisoned (without it the rule collapses, see the tests at the end), and a
# growth interval of 100 lets it grow into genuine FP16 overflows in the clean run.
SCALING = dict(init_scale=2.0 ** 12, growth_interval=100, min_scale=2.0 ** 8)
VARIANTS = {
    "adamw+gradscaler": (AdamWScaler, {}, STEPS),
    "mixedprecision(adamw)": (MixedPrecision, dict(inner="adamw"), STEPS),  # the fused path
    "mixedprecision(adamax)": (MixedPrecision, dict(inner="adamax"), 1000),  # the generic path
}


# The scaler rightly warns that the injected NaNs come from outside loss scaling.
@pytest.mark.filterwarnings("ignore:.*already sat at min_scale")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_soak_with_injected_nan_inf(name, threads):
    torch.set_num_threads(1)  # tiny ops: threads only add overhead
    variant, options, steps = VARIANTS[name]
    options = dict(options, **SCALING)
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    plan = poison_plan(7, steps, shapes)
    init_p, final_p, skips_p, genuine_p, lo, hi = soak(variant, plan, steps, **options)
    init_c, final_c, skips_c, genuine_c, _, _ = soak(variant, {}, steps, **options)
    print("%s, %d steps: %d poisoned, %d genuine overflows (clean run: %d); scale in [%g, %g]; "
          "loss %.4g -> poisoned %.5g, clean %.5g (rel. diff %.2g)"
          % (name, steps, len(plan), genuine_p, genuine_c, lo, hi, init_p, final_p, final_c,
             abs(final_p - final_c) / final_c))
    assert init_p == init_c
    assert skips_p == len(plan) + genuine_p and skips_c == genuine_c
    assert final_c < init_c / 10  # the model really learned
    assert abs(final_p - final_c) <= LOSS_RTOL * final_c

def run_scaler(scaler, grads, optimizer=torch.optim.SGD):
    """Steps a one-param optimizer under ``scaler`` with gradients ``grads`` (unscaled values);
    returns the scale after each update, whether each step was skipped (the param did not
    move) and the final param."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = optimizer([p], lr=0.1)
    scales, skipped = [], []
    for g in grads:
        scaler.scale(torch.ones(()))
        before = p.detach().clone()
        p.grad = torch.full((4,), g) * scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(torch.equal(before, p.detach()))
    return scales, skipped, p.detach()


COLLAPSE = [float("nan")] * 200 + [1.0] * 5  # 200 overflowing steps, then clean ones


def test_sustained_overflow_collapses_torchs_rule_not_mpexts():
    """Why mpext's default rule has a floor. Under torch's rule every overflowing step halves
    the scale: 200 in a row from 2^16 take it through the subnormals to 0. From 2^-128 on
    (144 halvings) 1/scale is inf in float32: the clean gradients of the next steps are finite
    (so no overflow is found), and unscaling them by inf writes inf/NaN into the params: silent
    corruption. mpext.GradScaler follows torch value for value down to 2^-126, the smallest
    normal float32, and stays there; the clean steps then train normally."""
    ours = run_scaler(mpext.GradScaler("cpu"), COLLAPSE)
    torchs = run_scaler(torch.amp.GradScaler("cpu"), COLLAPSE)
    # torch: through the subnormals to 0, params NaN.
    assert any(0 < s < TINY for s in torchs[0]) and torchs[0][199] == 0.0
    assert torchs[1] == [True] * 200 + [False] * 5 and torchs[2].isnan().all()
    # mpext: torch's scales while they are normal, then the floor.
    floor_at = torchs[0].index(TINY)
    assert ours[0][:floor_at + 1] == torchs[0][:floor_at + 1]
    assert ours[0][floor_at:200] == [TINY] * (200 - floor_at)
    assert ours[1] == [True] * 200 + [False] * 5
    assert ours[2].isfinite().all() and ours[2].ne(0).all()
    # At 2^-128 (144 halvings) torch's 1/scale is already inf in float32.
    early = [float("nan")] * 144 + [1.0]
    scales, skipped, param = run_scaler(torch.amp.GradScaler("cpu"), early)
    assert scales[143] == 2.0 ** -128 and skipped[-1] is False
    assert not param.isfinite().any()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, mpext.optim.AdamW])
def test_min_scale_keeps_the_scale_normal(optimizer):
    # Overflowing at min_scale: the scaler says (once) that the model, not scaling, is at fault.
    with pytest.warns(RuntimeWarning, match="already sat at min_scale=1"):
        scales, skipped, param = run_scaler(mpext.GradScaler("cpu", min_scale=1.0), COLLAPSE,
                                            optimizer)
    assert min(scales) == 1.0
    assert skipped == [True] * 200 + [False] * 5
    assert param.isfinite().all() and param.ne(0).all()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, mpext.optim.AdamW])
def test_default_scale_stays_normal_and_params_finite(optimizer):
    """What a weeks-long run needs from the default options: the scale never leaves the normal
    float32 range, and no step writes a non-finite value into the params."""
    scales, _, param = run_scaler(mpext.GradScaler("cpu"), COLLAPSE, optimizer)
    assert all(math.isfinite(s) and s >= TINY for s in scales)
    assert param.isfinite().all()
