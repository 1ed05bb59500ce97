"""The lean optimizer state of mpext.optim.Adam / AdamW: remainders, master-free params with or
without stochastic rounding, bf16 moments, and the generator behind the rounding.

References, none of them mpext:

* ``RefAdam`` below: torch.optim.AdamW's single-tensor algorithm (``foreach=False``), one torch
  fp32 tensor operation per operation of the formula, on fp32 copies. It is not
  ``torch.optim.AdamW`` itself, because on a CPU that one is not bit-reproducible with any
  once-rounded evaluation: its vectorised ``lerp`` and ``addcmul`` contract into FMAs and its
  ``sqrt`` is off by one ulp for about one input in six (see
  ``test_torch_adamw_differs_only_by_its_cpu_kernels_rounding``). So ``RefAdam`` computes
  torch's formula, operation for operation, with every operation rounded once: ``lerp`` as
  torch's scalar formula (``m + w*(g - m)`` for ``w < 0.5``, else ``g - (g - m)*(1 - w)``),
  ``addcmul`` as ``v + (c*g)*g``, ``addcdiv`` as ``p + (s*m)/d``, the square root correctly
  rounded, ``beta^t`` correctly rounded (exact rationals), and the learning rate as the float32
  the kernel reads. It is checked against ``torch.optim.AdamW`` to within those roundings.
* the pure-Python generator and rounding definitions of tests/reference.py (``sr_key``,
  ``sr_bits``, ``bf16_sr_reference``, ``fp16_sr_reference``) and their vectorised forms, which
  are checked against them here;
* float64 expectations, with statistical tests whose false-alarm rates are stated;
* integer arithmetic on bit patterns, over every bf16 high half.

Where the issue asks for "mode A == mode B bitwise" (remainders against fp32 masters, threads,
ISA paths, torch.compile, a resumed run), mpext is compared with itself.
"""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import mpext
from mpext import ops
from mpext.optim import Adam, AdamW

from reference import (adam_step_reference, bf16_sr_array, bf16_sr_reference, fp16_sr_array,
                       fp16_sr_reference, sr_bits, sr_bits_array, sr_key)
from optim_table import u32, allow_any_grad_dtype, bits, positions, roundtrip, same_bits

BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
# |z| < 5 under a normal null: a false alarm in 2 * Phi(-5) = 5.73e-7 of seeds, per test.
Z_LIMIT = 5.0


# --------------------------------------------------------------------------------------------
# Helpers.


def from_u32(a, like):
    """A float32 tensor of ``like``'s shape and layout holding the bit patterns ``a`` (logical
    order)."""
    flat = torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint32).view(np.int32))
    out = torch.empty_like(like, dtype=F32, memory_format=torch.preserve_format)
    return out.copy_(flat.view(F32).reshape(like.shape))


def from_u16(a, like, dtype):
    flat = torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint16).view(np.int16))
    out = torch.empty_like(like, dtype=dtype, memory_format=torch.preserve_format)
    return out.copy_(flat.view(dtype).reshape(like.shape))


_S32 = {}


def s32(x):
    """A float32 scalar as a 0-dim float32 tensor, so that torch computes in float32."""
    x = np.float32(x)
    key = int(x.view(np.uint32))  # by bits: -0.0 is not 0.0
    if key not in _S32:
        _S32[key] = torch.tensor(float(x), dtype=F32)
    return _S32[key]


_POW = {}


def pow_cr(beta, t):
    """beta ** t correctly rounded to double: the exact power (rationals, built up one step
    at a time) divided out once."""
    exact = _POW.get(beta)
    if exact is None or exact[0] > t:
        exact = (0, Fraction(1))
    n, value = exact
    while n < t:
        n, value = n + 1, value * Fraction(beta)
    _POW[beta] = (n, value)
    return float(value)


def sqrt32(x):
    """Correctly rounded float32 square root (numpy's is the IEEE operation)."""
    return torch.from_numpy(np.asarray(np.sqrt(x.detach().contiguous().numpy()))).reshape(x.shape)


def nudge_bits(x):
    """A bf16 master as stored: exactly halfway above an even bf16 value (low 17 bits 0x8000),
    finite, goes one fp32 ulp lower."""
    x = np.asarray(x, dtype=np.uint32)
    tie = ((x & np.uint32(0x1FFFF)) == np.uint32(0x8000)) & \
        ((x & np.uint32(0x7F800000)) != np.uint32(0x7F800000))
    return x - tie.astype(np.uint32)


def rne_bf16_bits(x):
    """fp32 bits -> bf16 bits, to nearest with ties to even, from the definition (the carry
    of a round up moves into the exponent); NaN -> a quiet NaN of the same sign."""
    x = np.asarray(x, dtype=np.uint32)
    high, low = x >> np.uint32(16), x & np.uint32(0xFFFF)
    up = (low > 0x8000) | ((low == 0x8000) & ((high & np.uint32(1)) == 1))
    nan = (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, high | np.uint32(0x40), high + up.astype(np.uint32)).astype(np.uint16)


def assert_same_bits(got, want, what):
    """Bitwise equality, with a useful message."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not same_bits(got, want):
        g, w = got.detach().float().reshape(-1), want.detach().float().reshape(-1)
        diff = (bits(got) != bits(want)).nonzero()
        raise AssertionError("%s: %d bytes differ; first values %s vs %s" % (
            what, diff.numel(), g[:8].tolist(), w[:8].tolist()))


# --------------------------------------------------------------------------------------------
# The reference optimizer.


class RefAdam:
    """torch.optim.Adam/AdamW's single-tensor step on fp32 copies, each operation rounded once
    (see the module docstring), with the lean storage rules written from their definitions:

    * a bf16 param's master is stored one fp32 ulp lower when it lands exactly halfway above an
      even bf16 value (the nudge), and the param is the master's round to nearest even;
    * a master-free param is the fp32 result rounded to nearest even (``Tensor.to``) or, with
      stochastic rounding, by bf16_sr_reference / fp16_sr_reference with the 32 bits at the
      element's position of stream sr_key(seed, t, 2k + 1);
    * a bf16 moment is the fp32 result rounded stochastically with one draw r per element of
      stream sr_key(seed, t, 2k) (exp_avg: r's low 16 bits, exp_avg_sq: r >> 16), or to
      nearest even;

    where t is the param's step count after the step and k its position in the optimizer."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 decoupled=True, master_weights=True, stochastic_rounding=False,
                 exp_avg_dtype=F32, exp_avg_sq_dtype=F32, moment_rounding="stochastic", seed=0,
                 streams=None):
        self.params = [p.detach().cpu().clone() for p in params]
        self.lr = lr if isinstance(lr, list) else [lr] * len(params)
        self.betas, self.eps, self.wd, self.decoupled = betas, eps, weight_decay, decoupled
        self.master_weights, self.sr = master_weights, stochastic_rounding
        self.nearest = moment_rounding == "nearest"
        self.seed = seed
        self.streams = list(range(len(params))) if streams is None else streams
        self.master = [p.float() if p.dtype != F32 and master_weights else None
                       for p in self.params]
        self.m = [torch.zeros_like(p, dtype=exp_avg_dtype, memory_format=torch.preserve_format)
                  for p in self.params]
        self.v = [torch.zeros_like(p, dtype=exp_avg_sq_dtype, memory_format=torch.preserve_format)
                  for p in self.params]
        self.t = [0] * len(params)
        self.pos = [positions(p) for p in self.params]
        self.raw = {}
        self.nudges = 0
        self.not_nearest = 0  # stochastically rounded bytes that differ from round to nearest

    def step(self, grads, inv_scale=None, found_inf=False):
        if found_inf:
            return
        b1, b2 = self.betas
        for k, g in enumerate(grads):
            if g is None:
                continue
            self.t[k] += 1
            t, p = self.t[k], self.params[k]
            lr = float(np.float32(self.lr[k]))  # the kernel reads lr from a float32 tensor
            g = g.detach().cpu().float()
            if inv_scale is not None:
                g = g * s32(inv_scale)
            x = self.master[k] if self.master[k] is not None else p.float()
            if self.wd != 0:
                if self.decoupled:
                    x = x * s32(1.0 - lr * self.wd)
                else:
                    g = g + s32(self.wd) * x
            m, v = self.m[k].float(), self.v[k].float()
            w = np.float32(1.0 - b1)
            if w < 0.5:
                m = m + s32(w) * (g - m)
            else:
                m = g - (g - m) * s32(np.float32(1.0) - w)
            v = v * s32(b2) + (s32(1.0 - b2) * g) * g
            bc1, bc2 = 1.0 - pow_cr(b1, t), 1.0 - pow_cr(b2, t)
            denom = sqrt32(v) / s32(math.sqrt(bc2)) + s32(self.eps)
            x = x + (s32(-np.float32(lr / bc1)) * m) / denom
            self.raw[k] = {"param": x, "exp_avg": m, "exp_avg_sq": v}  # before rounding
            pos = self.pos[k]
            r_m = None
            if self.m[k].dtype == BF16 or self.v[k].dtype == BF16:
                r_m = sr_bits_array(sr_key(self.seed, t, 2 * self.streams[k]), pos)
            self.m[k] = self._moment(m, self.m[k], r_m)
            self.v[k] = self._moment(v, self.v[k], None if r_m is None else r_m >> np.uint32(16))
            if p.dtype == F32:
                self.params[k] = x
            elif self.master[k] is not None:
                if p.dtype == BF16:
                    xb = u32(x)
                    stored = nudge_bits(xb)
                    self.nudges += int((stored != xb).sum())
                    x = from_u32(stored, x)
                self.master[k] = x
                self.params[k] = x.to(p.dtype)
            elif not self.sr:
                self.params[k] = x.to(p.dtype)
            else:
                r_p = sr_bits_array(sr_key(self.seed, t, 2 * self.streams[k] + 1), pos)
                rounded, nan = (bf16_sr_array if p.dtype == BF16 else fp16_sr_array)(u32(x), r_p)
                assert not nan.any()
                self.params[k] = from_u16(rounded, p, p.dtype)
                self.not_nearest += int((bits(self.params[k]) != bits(x.to(p.dtype))).sum())

    def _moment(self, x, old, r):
        if old.dtype == F32:
            return x
        if self.nearest:
            return x.to(BF16)
        rounded, nan = bf16_sr_array(u32(x), r)
        assert not nan.any()
        out = from_u16(rounded, x, BF16)
        self.not_nearest += int((bits(out) != bits(x.to(BF16))).sum())
        return out

    def value(self, k):
        """The fp32 value the optimizer holds for param k."""
        return self.master[k] if self.master[k] is not None else self.params[k].float()


# --------------------------------------------------------------------------------------------
# The references themselves: the vectorised generator and roundings against the pure-Python
# definitions, and RefAdam against torch.optim.AdamW.


def test_vectorised_generator_matches_the_definition():
    rng = np.random.default_rng(1)
    keys = [sr_key(0), sr_key(2 ** 64 - 1, 3, 5), sr_key(1234, 1, 2)] + \
        [sr_key(int(s), int(t), int(k)) for s, t, k in rng.integers(0, 2 ** 62, (5, 3))]
    pos = np.concatenate([np.arange(70, dtype=np.uint64),
                          rng.integers(0, 2 ** 64 - 1, 200, dtype=np.uint64, endpoint=True),
                          np.array([2 ** 32 - 1, 2 ** 32, 2 ** 64 - 1], dtype=np.uint64)])
    for key in keys:
        got = sr_bits_array(key, pos)
        assert got.dtype == np.uint32
        assert got.tolist() == [sr_bits(key, int(q)) for q in pos]
    assert sr_bits_array(sr_key(0), [0]).tolist() == [0x70B6394C]  # the pinned value


def test_generator_bits_are_uniform_and_uncorrelated():
    """The generator's raw bits (one round of the mixer per draw since 2026-12-05), from
    position 0 on, where a counter-based generator is weakest: over 2^18 positions of each of
    the streams one optimizer step draws from (a param's moments and value, a neighbouring
    param's, the next step's) and across a 2^32 window boundary, each of the 32 bits is set half
    the time, the low 16 bits (a bf16 rounding's) fill 256 bins evenly, and neighbouring
    positions, two streams at one position and two windows at one low half are uncorrelated.
    Every statistic within 5 standard errors (a chi-square with 255 degrees of freedom: below
    400, about 5.9 standard deviations above its mean)."""
    n = 1 << 18
    lo = np.arange(n, dtype=np.uint64)
    keys = [sr_key(2 ** 40 + 1, step, stream) for step in (1, 2) for stream in (0, 1, 2, 3)]
    draws = [sr_bits_array(key, lo) for key in keys]
    draws.append(sr_bits_array(keys[0], lo + np.uint64(2 ** 32)))  # the next window, same key
    for r in draws:
        bits = ((r[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.float64)
        z = (bits.mean(axis=0) - 0.5) / math.sqrt(0.25 / n)
        assert np.abs(z).max() < 5, np.abs(z).max()
        counts = np.bincount((r & 0xFFFF) >> 8, minlength=256)
        chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
        assert chi2 < 400, chi2

    def z_corr(a, b):
        ua = (a & 0xFFFF).astype(np.float64) / 65536 - 0.5
        ub = (b & 0xFFFF).astype(np.float64) / 65536 - 0.5
        return (ua * ub).sum() / math.sqrt(len(ua)) / (1 / 12)

    for r in draws:
        assert abs(z_corr(r[:-1], r[1:])) < 5  # neighbouring positions
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert abs(z_corr(draws[i], draws[j])) < 5, (i, j)  # two streams or windows


def _edge_fp32_bits():
    """fp32 bit patterns over the whole range: fp16's and bf16's neighbours, ties, the fp16
    subnormal range, fp32 subnormals, the top of fp16's range, Inf, NaN, both signs."""
    rng = np.random.default_rng(2)
    h = np.arange(0, 0x7C00, 97, dtype=np.uint16).view(np.float16).astype(np.float32)
    h = np.concatenate([h, np.array([65504, 65519.996, 65520, 65535, 1e30, np.inf, 2 ** -24,
                                     2 ** -25, 3 * 2 ** -26, 2 ** -14, 2 ** -14 - 2 ** -24,
                                     1e-40, 1e-45, 0.0], dtype=np.float32)])
    hb = h.view(np.uint32)
    near = np.concatenate([hb, hb + 1, hb - 1, hb + 0x1000, hb + 0x0FFF])
    rand = rng.integers(0, 2 ** 32, 3000, dtype=np.uint64).astype(np.uint32)
    logu = (rng.standard_normal(2000) * np.exp(rng.uniform(-40, 12, 2000))).astype(np.float32)
    out = np.concatenate([near, rand, logu.view(np.uint32), np.array([0x7FC00000, 0x7F800001],
                                                                     dtype=np.uint32)])
    return np.concatenate([out, out ^ np.uint32(0x80000000)])


def test_vectorised_roundings_match_the_definitions():
    """bf16_sr_array / fp16_sr_array against bf16_sr_reference / fp16_sr_reference (exact
    rationals) over values across the whole fp32 range, with random draws, the extreme draws,
    and for fp16 the draws just at and just below each value's threshold."""
    x = _edge_fp32_bits()
    rng = np.random.default_rng(3)
    r = rng.integers(0, 2 ** 32, x.size, dtype=np.uint64).astype(np.uint32)
    r[:40] = [0, 2 ** 32 - 1] * 20
    # thresholds: the draw from which |x| goes up is 2^32 - floor(f * 2^32)
    xf = x.view(np.float32)
    pick = np.nonzero(np.isfinite(xf) & (np.abs(xf) < 65504))[0][::7]
    lo = np.abs(xf[pick]).astype(np.float16)
    lo = np.where(lo.astype(np.float32) > np.abs(xf[pick]), np.nextafter(lo, np.float16(0)), lo)
    hi = np.nextafter(lo, np.float16(np.inf))
    f = [(Fraction(float(abs(a))) - Fraction(float(b))) / (Fraction(float(c)) - Fraction(float(b)))
         for a, b, c in zip(xf[pick], lo, hi)]
    threshold = np.array([2 ** 32 - math.floor(q * 2 ** 32) for q in f], dtype=np.uint64)
    keep = (threshold < 2 ** 32) & (threshold > 0)
    assert keep.sum() > 500
    x = np.concatenate([x, x[pick][keep], x[pick][keep]])
    r = np.concatenate([r, threshold[keep].astype(np.uint32),
                        (threshold[keep] - 1).astype(np.uint32)])
    got16, nan16 = fp16_sr_array(x, r)
    gotb, nanb = bf16_sr_array(x, r)
    for i, (xi, ri) in enumerate(zip(x.tolist(), r.tolist())):
        want = fp16_sr_reference(xi, ri)
        assert (want is None) == bool(nan16[i]), hex(xi)
        if want is not None:
            assert int(got16[i]) == want, (hex(xi), hex(ri), hex(int(got16[i])), hex(want))
        want = bf16_sr_reference(xi, ri)
        assert (want is None) == bool(nanb[i]), hex(xi)
        if want is not None:
            assert int(gotb[i]) == want, (hex(xi), hex(ri))
    # exactly at the threshold: a value a quarter of the way between two fp16 values goes up
    # for r >= 3 * 2^30 and not below
    quarter = np.array([np.float32(1 + 2 ** -12)]).view(np.uint32)  # fp16 ulp at 1 is 2^-10
    for rr, up in ((3 * 2 ** 30, True), (3 * 2 ** 30 - 1, False)):
        got, _ = fp16_sr_array(quarter, np.array([rr], dtype=np.uint32))
        assert int(got[0]) == 0x3C00 + up
        assert fp16_sr_reference(int(quarter[0]), rr) == 0x3C00 + up


def _one_step_state(n, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    return p, g, m, v


def test_torch_adamw_differs_only_by_its_cpu_kernels_rounding():
    """RefAdam is torch.optim.AdamW's step: from one state (steps 1, 10 and 1000) the two agree
    to a few fp32 ulps -- not bit for bit, because torch's CPU lerp and addcmul contract into
    FMAs and its sqrt is not correctly rounded; those two operations are within an ulp of
    their once-rounded definitions (RefAdam's), whose sqrt is exact."""
    n = 4099
    p, g, m, v = _one_step_state(n, 0)
    for t0 in (0, 9, 999):
        q = p.clone().requires_grad_()
        q.grad = g.clone()
        topt = torch.optim.AdamW([q], lr=2 ** -7, weight_decay=0.1, foreach=False)
        topt.state[q] = {"step": torch.tensor(float(t0)), "exp_avg": m.clone(),
                         "exp_avg_sq": v.clone()}
        topt.step()
        ref = RefAdam([p], lr=2 ** -7, weight_decay=0.1)
        ref.m, ref.v, ref.t = [m.clone()], [v.clone()], [t0]
        ref.step([g])
        # a few ulps of each value, or of the operands where a difference cancels
        for got, want in ((ref.params[0], q.detach()), (ref.m[0], topt.state[q]["exp_avg"]),
                          (ref.v[0], topt.state[q]["exp_avg_sq"])):
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=4e-7, atol=2.4e-7 * scale)
    # the operations that differ: torch's lerp and sqrt against their once-rounded definitions
    w = 0.1
    once = (m.numpy() + np.float32(w) * (g.numpy() - m.numpy())).astype(np.float32)
    torch.testing.assert_close(m.lerp(g, w), torch.from_numpy(once), rtol=2e-7,
                               atol=1.2e-7 * float(m.abs().max()))
    exact = np.sqrt(v.numpy().astype(np.float64)).astype(np.float32)
    assert torch.equal(sqrt32(v), torch.from_numpy(exact))  # RefAdam's sqrt is exact
    torch.testing.assert_close(torch.sqrt(v), torch.from_numpy(exact), rtol=1.2e-7, atol=0)


# --------------------------------------------------------------------------------------------
# Params, gradients and comparisons.

# (shape, dtype, channels_last): several shapes, a channels_last 4-d param, a zero-size one, a
# 0-dim one, and an fp32 param in the same group.
SPECS = [((13, 7), BF16, False), ((31,), BF16, False), ((2, 3, 4, 5), BF16, True),
         ((0,), BF16, False), ((), BF16, False), ((9,), F32, False)]


def make_params(specs=SPECS, seed=0, low=None, scale=1.0, offset=0.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype, cl in specs:
        dtype = low if (low is not None and dtype != F32) else dtype
        t = (torch.randn(shape, generator=gen) * scale + offset).to(dtype)
        if cl:
            t = t.to(memory_format=torch.channels_last)
        out.append(t.to(device).requires_grad_())
    return out


def twin(params):
    return [p.detach().clone().requires_grad_() for p in params]


def make_grads(params, step, seed=0, scale=1.0, dtype=None, kind="varied"):
    """Gradients of widely varied magnitude (each element log-uniform over 1e-6..1e3; for fp16,
    whose range is narrower, 1e-5..10), times the loss scale, in the param's dtype (or
    ``dtype``); "pow2": +-powers of two in [2^-10, 2^10]."""
    gen = torch.Generator().manual_seed(seed * 1000003 + step)
    out = []
    for p in params:
        if kind == "pow2":
            e = torch.randint(-10, 11, p.shape, generator=gen).float()
            s = torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1
            g = s * torch.pow(2.0, e)
        else:
            lo, hi = (-5, 1) if (dtype or p.dtype) == FP16 else (-6, 3)
            mag = torch.pow(10.0, torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
            g = torch.randn(p.shape, generator=gen) * mag
        out.append((g * scale).to(dtype or p.dtype).to(p.device))
    return out


def set_grads(params, grads):
    allow_any_grad_dtype(params)
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def opt_view(opt, params):
    """What an optimizer holds, per param: the param, its fp32 value (master_param()), the
    moments and the step, with names."""
    out = []
    for k, p in enumerate(params):
        st = opt.state.get(p, {})
        out.append(("param %d" % k, p.detach()))
        out.append(("master %d" % k, opt.master_param(p)))
        for key in ("exp_avg", "exp_avg_sq", "step", "ema_param"):
            if key in st:
                out.append(("%s %d" % (key, k), st[key]))
    return out


def snapshot(opt, params):
    return [(n, t.detach().clone()) for n, t in opt_view(opt, params)] + \
        [("state %d" % k, sorted(opt.state.get(p, {}))) for k, p in enumerate(params)]


def assert_unchanged(opt, params, snap, what=""):
    now = snapshot(opt, params)
    assert [n for n, _ in now] == [n for n, _ in snap], what
    for (name, a), (_, b) in zip(now, snap):
        if isinstance(a, list):
            assert a == b, (what, name)
        else:
            assert_same_bits(a, b, "%s %s" % (what, name))


def assert_same_optimizers(o1, p1, o2, p2, what=""):
    v1, v2 = opt_view(o1, p1), opt_view(o2, p2)
    assert [n for n, _ in v1] == [n for n, _ in v2], what
    for (name, a), (_, b) in zip(v1, v2):
        assert_same_bits(a, b, "%s: %s" % (what, name))


def assert_matches_ref(opt, params, ref, what="", moments=True):
    """Params and their fp32 values bit for bit; with ``moments`` also the moments and step
    counts (a difference there reaches the params a step later anyway)."""
    for k, p in enumerate(params):
        st = opt.state.get(p)
        if not st:
            continue
        assert_same_bits(p.detach(), ref.params[k], "%s: param %d" % (what, k))
        assert_same_bits(opt.master_param(p), ref.value(k), "%s: master %d" % (what, k))
        if moments:
            assert_same_bits(st["exp_avg"], ref.m[k], "%s: exp_avg %d" % (what, k))
            assert_same_bits(st["exp_avg_sq"], ref.v[k], "%s: exp_avg_sq %d" % (what, k))
            assert st["step"].item() == ref.t[k], what


# --------------------------------------------------------------------------------------------
# The fp32-master mode, and so the remainder mode, against the reference, bit for bit.

REF_CONFIGS = {
    # torch's defaults but for the weight decay, under a non-power-of-two loss scale
    "adamw": dict(kw=dict(lr=1e-3, weight_decay=0.1), grads="varied", scale=1000.0,
                  offset=0.0, steps=1000),
    # every update exactly +-2^-8 (betas 0, eps 0, power-of-two gradients) on params in
    # +-[1, 2), where a bf16 ulp is 2^-7: masters land exactly halfway between bf16 values,
    # above even and odd ones, again and again
    "ties": dict(kw=dict(lr=2 ** -8, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0),
                 grads="pow2", scale=1.0, offset=1.5, steps=300),
}


@pytest.mark.parametrize("mode", ["master", "remainder"])
@pytest.mark.parametrize("config", sorted(REF_CONFIGS))
def test_masters_match_the_adamw_reference_with_the_nudge(config, mode):
    """AdamW with fp32 masters (param_remainders=False) and with remainders against RefAdam on
    fp32 copies, the nudge applied after each step: params and masters bit for bit after every
    step, moments and step counts every tenth. "ties" makes masters land exactly halfway
    between bf16 values over and over, and checks that the nudge happened."""
    cfg = REF_CONFIGS[config]
    kw = cfg["kw"]
    params = make_params(scale=0.25 if config == "ties" else 1.0, offset=cfg["offset"])
    if config == "ties":  # half of them negative
        with torch.no_grad():
            for p in params[:2]:
                p.view(-1)[::2].neg_()
    opt = AdamW(params, param_remainders=mode == "remainder", **kw)
    ref = RefAdam(params, lr=kw["lr"], betas=kw.get("betas", (0.9, 0.999)),
                  eps=kw.get("eps", 1e-8), weight_decay=kw["weight_decay"])
    scale = cfg["scale"]
    # the remainder mode is the master mode for >= 1000 steps (below): fewer steps here
    for step in range(cfg["steps"] if mode == "master" else 300):
        grads = make_grads(params, step, scale=scale, kind=cfg["grads"])
        set_grads(params, grads)
        opt.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(0.0))
        ref.step(grads, inv_scale=1.0 / scale)
        assert_matches_ref(opt, params, ref, "step %d" % step, moments=step % 10 == 9)
    if config == "ties":
        assert ref.nudges >= 50, ref.nudges  # the nudge was exercised
    key = "param_remainder" if mode == "remainder" else "master_param"
    for p in params:
        st = opt.state[p]
        assert set(st) == ({"step", "exp_avg", "exp_avg_sq", key} if p.dtype == BF16
                           else {"step", "exp_avg", "exp_avg_sq"})
        if p.dtype == BF16:
            assert st[key].dtype == (torch.int16 if mode == "remainder" else F32)
            assert st[key].stride() == p.stride()  # the param's layout (channels_last too)


# --------------------------------------------------------------------------------------------
# Remainders are the fp32 masters, bit for bit: 1,200 steps under a loss scale with poisoned
# steps, a resume, and conversions between the modes both ways.

PAIR_CONFIGS = {
    "adamw": (AdamW, dict(lr=1e-3, weight_decay=0.1), "varied"),
    "adam_l2": (Adam, dict(lr=2e-3, betas=(0.8, 0.99), weight_decay=0.05), "varied"),
    "adamw_ties": (AdamW, dict(lr=2 ** -8, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0), "pow2"),
}
SCALES = [2.0 ** 12, 1000.0, 1.0, 2.0 ** -3]


def _convert(opt, params, cls, kw, remainders):
    """The optimizer rebuilt from its checkpoint converted to the other storage: the
    checkpoint's groups say ``param_remainders``, and loading converts each param's state."""
    sd = roundtrip(opt.state_dict())
    for group in sd["param_groups"]:
        group["param_remainders"] = remainders
    new = cls(params, param_remainders=remainders, **kw)
    new.load_state_dict(sd)
    return new


def _storage(opt, params):
    return ["master_param" if "master_param" in opt.state[p] else
            "param_remainder" if "param_remainder" in opt.state[p] else None for p in params]


@pytest.mark.parametrize("config", sorted(PAIR_CONFIGS))
def test_remainders_are_the_masters_bit_for_bit(device, config):
    """Run A (fp32 masters) and run B (param_remainders=True) side by side for 1,200 steps:
    params, master_param() (the master, or the param joined with its remainder), moments and
    steps equal bit for bit after every step. Gradients of widely varied magnitude under loss
    scales of 2^12, 1000, 1 and 2^-3 (passed as step(grad_scale=..., found_inf=...)); every
    97th step is poisoned (an Inf in a gradient, found_inf=1) and must change nothing at all.
    B is resumed from its checkpoint at step 300; at step 600 each run continues from its own
    checkpoint converted to the other mode (A: master -> remainder, B: remainder -> master);
    at step 900 both switch back by changing their param group in place."""
    cls, kw, kind = PAIR_CONFIGS[config]
    offset = 1.5 if kind == "pow2" else 0.0
    pa = make_params(seed=3, offset=offset, scale=0.25 if kind == "pow2" else 1.0,
                     device=device)
    pb = twin(pa)
    a = cls(pa, **kw)
    b = cls(pb, param_remainders=True, **kw)
    low = [p.dtype == BF16 for p in pa]
    for step in range(1200):
        scale = SCALES[(step // 100) % len(SCALES)]
        grads = make_grads(pa, step, seed=1, scale=scale, kind=kind)
        poisoned = step % 97 == 50
        if poisoned:
            grads[step % 3].view(-1)[0] = float("inf") if step % 2 else float("nan")
        set_grads(pa, grads)
        set_grads(pb, grads)
        before = (snapshot(a, pa), snapshot(b, pb)) if poisoned else None
        for opt in (a, b):
            opt.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(float(poisoned)))
        if poisoned:
            assert_unchanged(a, pa, before[0], "poisoned step %d (A)" % step)
            assert_unchanged(b, pb, before[1], "poisoned step %d (B)" % step)
        assert_same_optimizers(a, pa, b, pb, "step %d" % step)
        if step == 0:
            assert _storage(a, pa) == ["master_param" if x else None for x in low]
            assert _storage(b, pb) == ["param_remainder" if x else None for x in low]
        elif step == 299:  # B resumes from its checkpoint
            sd = roundtrip(b.state_dict())
            assert all(sd["state"][k]["param_remainder"].dtype == torch.int16
                       for k, x in enumerate(low) if x)
            assert all("master_param" not in v for v in sd["state"].values())
            b = cls(pb, param_remainders=True, **kw)
            b.load_state_dict(sd)
            assert _storage(b, pb) == ["param_remainder" if x else None for x in low]
        elif step == 599:  # checkpoints converted: A to remainders, B to masters (a
            # remainder is joined with its param at the next step: the model may load later)
            a, b = _convert(a, pa, cls, kw, True), _convert(b, pb, cls, kw, False)
            assert _storage(a, pa) == ["param_remainder" if x else None for x in low]
            assert _storage(b, pb) == ["param_remainder" if x else None for x in low]
            assert_same_optimizers(a, pa, b, pb, "after the conversion")
        elif step == 600:
            assert _storage(b, pb) == ["master_param" if x else None for x in low]
        elif step == 899:  # and back, by changing the groups (converted at the next step)
            a.param_groups[0]["param_remainders"] = False
            b.param_groups[0]["param_remainders"] = True
        elif step == 900:
            assert _storage(a, pa) == ["master_param" if x else None for x in low]
            assert _storage(b, pb) == ["param_remainder" if x else None for x in low]
    clean = sum(1 for step in range(1200) if step % 97 != 50)
    assert a.state[pa[0]]["step"].item() == b.state[pb[0]]["step"].item() == clean


def test_torch_adamw_checkpoint_loads_into_remainder_mode():
    """torch.optim.AdamW's state dict (fp32 params, no mpext keys) loaded into a
    param_remainders optimizer over the bf16 params: the constructor's mode, zero remainders
    (the master is the param), torch's moments and step; and from there the same bits as the
    same checkpoint loaded into the fp32-master mode."""
    f32 = make_params(seed=4, low=F32)
    topt = torch.optim.AdamW(f32, lr=1e-3, weight_decay=0.1)
    for step in range(20):
        set_grads(f32, make_grads(f32, step))
        topt.step()
    sd = roundtrip(topt.state_dict())
    pa = [p.detach().to(BF16 if low else F32).requires_grad_()
          for p, low in zip(f32, [s[1] == BF16 for s in SPECS])]
    with torch.no_grad():
        pa[2].data = pa[2].data.to(memory_format=torch.channels_last)
    pb = twin(pa)
    a = AdamW(pa, lr=1e-3, weight_decay=0.1)
    b = AdamW(pb, lr=1e-3, weight_decay=0.1, param_remainders=True)
    a.load_state_dict(sd)
    b.load_state_dict(sd)
    assert b.param_groups[0]["param_remainders"] is True
    for k, p in enumerate(pb):
        st, tst = b.state[p], sd["state"][k]
        assert st["step"].item() == 20 and st["step"].dtype == F32
        assert torch.equal(st["exp_avg"], tst["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], tst["exp_avg_sq"])
        if p.dtype == BF16:
            # no fp32 value in a torch state: the remainder starts at the next step
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
            assert_same_bits(b.master_param(p), p.detach().float(), "master %d" % k)
    for step in range(200):
        grads = make_grads(pa, step, seed=2)
        set_grads(pa, grads)
        set_grads(pb, grads)
        a.step()
        b.step()
        assert_same_optimizers(a, pa, b, pb, "step %d" % step)


# --------------------------------------------------------------------------------------------
# Splitting a master into param + remainder and joining them, through the public path, over
# every bf16 high half.

LOW_HALVES = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]


def _all_masters():
    """fp32 masters: every one of the 2^16 high halves (both signs, zeros, subnormals, normals,
    the largest finite, Inf, NaN) with each low half of LOW_HALVES, among them exact ties
    above even and odd bf16 values (low half 0x8000)."""
    high = np.arange(1 << 16, dtype=np.uint32)
    return ((high[:, None] << np.uint32(16)) | np.array(LOW_HALVES, dtype=np.uint32)).reshape(-1)


def _master_state_dict(param, master, remainders):
    """A master-mode checkpoint of AdamW([param]) holding ``master``, its groups converted to
    ``param_remainders=remainders``."""
    sd = AdamW([param]).state_dict()
    sd["state"] = {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(master),
                       "exp_avg_sq": torch.zeros_like(master), "master_param": master}}
    sd["param_groups"][0]["param_remainders"] = remainders
    return sd


def test_split_and_join_over_every_high_half():
    """A master-mode checkpoint loaded into a param_remainders optimizer: the remainder is the
    stored master's low half under its param, and master_param() gives back the stored master
    -- the master itself, or one fp32 ulp lower where it lies exactly halfway above an even
    bf16 value (the nudge) -- by integer arithmetic on the bits; NaN stays NaN. Loaded back
    into the fp32-master mode it is that master again."""
    x = _all_masters()
    stored = nudge_bits(x)
    nan = (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    pbits = rne_bf16_bits(stored)
    assert nudge_bits(stored).tolist() == stored.tolist()  # nudged once, stays
    # the param is the stored master's round to nearest even, as torch's cast has it
    master = torch.from_numpy(x.view(np.int32).copy()).view(F32)
    torch_round = master.to(BF16).view(torch.int16).numpy().view(np.uint16)
    assert (torch_round[~nan] == rne_bf16_bits(x)[~nan]).all()
    # tie above even: nudged, the param below; tie above odd: kept, the param above
    tie = (x & np.uint32(0xFFFF)) == 0x8000
    even = ((x >> np.uint32(16)) & np.uint32(1)) == 0
    fin = (x & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    assert ((stored != x) == (tie & even & fin)).all()
    assert (pbits[tie & ~even & fin] == ((x[tie & ~even & fin] >> 16) + 1)).all()
    assert (tie & even & fin).sum() > 30000 and (tie & ~even & fin).sum() > 30000

    param = torch.from_numpy(pbits.view(np.int16).copy()).view(BF16).requires_grad_()
    opt = AdamW([param], param_remainders=True)
    opt.load_state_dict(_master_state_dict(param, master.clone(), True))
    st = opt.state[param]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "param_remainder"}
    rem = st["param_remainder"].numpy().view(np.uint16).astype(np.uint32)
    want_rem = (stored - (pbits.astype(np.uint32) << np.uint32(16))) & np.uint32(0xFFFF)
    assert (rem[~nan] == want_rem[~nan]).all()
    # as a signed 16-bit number the remainder is in [-0x8000, 0x7FFF]: the master is exactly
    # (param << 16) + remainder
    signed = rem.astype(np.int64) - ((rem >= 0x8000) << 16)
    rebuilt = ((pbits.astype(np.int64) << 16) + signed) & 0xFFFFFFFF
    assert (rebuilt[~nan] == stored[~nan]).all()
    got = u32(opt.master_param(param))
    assert (got[~nan] == stored[~nan]).all()
    assert np.isnan(got.view(np.float32)[nan]).all()
    assert param.detach().view(torch.int16).numpy().view(np.uint16).tolist() == pbits.tolist()
    # back into the master mode: the stored master, which rounds to the param
    sd = opt.state_dict()
    sd["param_groups"][0]["param_remainders"] = False
    back = AdamW([param])
    back.load_state_dict(sd)  # the remainder is joined with the param at the next step
    assert set(back.state[param]) == {"step", "exp_avg", "exp_avg_sq", "param_remainder"}
    got = u32(back.master_param(param))
    assert (got[~nan] == stored[~nan]).all() and np.isnan(got.view(np.float32)[nan]).all()


def test_a_master_that_is_not_the_params_round_is_refused():
    """A checkpoint whose masters do not round to the model's params (say the model's state was
    not loaded yet) cannot become remainders: ValueError naming the count, nothing changed --
    at load time, and when the group is switched to remainders between steps."""
    p = make_params(specs=[((50,), BF16, False)], seed=5)[0]
    opt = AdamW([p], param_remainders=True)
    set_grads([p], make_grads([p], 0))
    opt.step()
    before = snapshot(opt, [p])
    groups_before = [dict(g) for g in opt.param_groups]
    master = p.detach().float() + 0.0
    master.view(-1)[[3, 7, 11]] += 1.0  # three elements round elsewhere
    msg = (r"its master_param does not round to the param's current value at 3 of 50 "
           r"elements, so it cannot become a param_remainder")
    with pytest.raises(ValueError, match=msg):
        opt.load_state_dict(_master_state_dict(p, master, True))
    assert_unchanged(opt, [p], before, "load")
    assert [dict(g) for g in opt.param_groups] == groups_before
    # a master-mode optimizer holding such a master, switched to remainders between steps
    q = p.detach().clone().requires_grad_()
    mopt = AdamW([q])
    mopt.load_state_dict(_master_state_dict(q, master, False))
    mopt.param_groups[0]["param_remainders"] = True
    set_grads([q], make_grads([q], 1))
    before = snapshot(mopt, [q])
    with pytest.raises(ValueError, match=msg):
        mopt.step()
    assert_unchanged(mopt, [q], before, "step")
    assert set(mopt.state[q]) == {"step", "exp_avg", "exp_avg_sq", "master_param"}


# --------------------------------------------------------------------------------------------
# Master-free params (to nearest, stochastic) and bf16 moments against the reference.

B2 = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
MODE_CASES = {
    # name: (dtype of the low-precision params, optimizer options, seed)
    "rne_bf16": (BF16, dict(master_weights=False), 0),
    "rne_fp16": (FP16, dict(master_weights=False), 0),
    "sr_bf16": (BF16, dict(master_weights=False, stochastic_rounding=True), 12345),
    "sr_fp16": (FP16, dict(master_weights=False, stochastic_rounding=True), 2 ** 64 - 5),
    "sr_bf16_moments_bf16": (BF16, dict(master_weights=False, stochastic_rounding=True, **B2), 7),
    "sr_fp16_moments_bf16": (FP16, dict(master_weights=False, stochastic_rounding=True, **B2), 0),
    "master_moments_bf16": (BF16, dict(B2), 99),
    "remainder_moments_bf16": (BF16, dict(param_remainders=True, **B2), 2 ** 63),
    "master_fp16_exp_avg_bf16": (FP16, dict(exp_avg_dtype=BF16), 5),
    "remainder_exp_avg_sq_bf16": (BF16, dict(param_remainders=True, exp_avg_sq_dtype=BF16), 6),
    "sr_bf16_moments_nearest": (BF16, dict(master_weights=False, stochastic_rounding=True,
                                           moment_rounding="nearest", **B2), 8),
    "master_fp16_exp_avg_sq_nearest": (FP16, dict(exp_avg_sq_dtype=BF16,
                                                  moment_rounding="nearest"), 9),
    "fp32_moments_bf16": (F32, dict(B2), 10),
}
# Two param groups with their own learning rates; in group 0 a param that never has a gradient
# (it still takes a stream number: streams count every param of every group, in order).
GROUP_SPECS = ([((13, 7), BF16, False), ((4,), BF16, False), ((31,), BF16, False),
                ((2, 3, 4, 5), BF16, True)],
               [((0,), BF16, False), ((), BF16, False), ((9,), F32, False)])
NO_GRAD = 1


def _ref_options(opts, seed):
    return dict(master_weights=opts.get("master_weights", True),
                stochastic_rounding=opts.get("stochastic_rounding", False),
                exp_avg_dtype=opts.get("exp_avg_dtype", F32),
                exp_avg_sq_dtype=opts.get("exp_avg_sq_dtype", F32),
                moment_rounding=opts.get("moment_rounding", "stochastic"), seed=seed)


def _grouped_run(case, steps, lrs=(1e-3, 3e-3), check=True, seed_params=6, device="cpu"):
    """The optimizer of MODE_CASES[case] over GROUP_SPECS on ``device`` and RefAdam beside it,
    ``steps`` steps under a loss scale of 2^8 with step 40 poisoned; returns (optimizer, params,
    ref)."""
    low, opts, seed = MODE_CASES[case]
    g0 = make_params(GROUP_SPECS[0], seed=seed_params, low=low, device=device)
    g1 = make_params(GROUP_SPECS[1], seed=seed_params + 1, low=low, device=device)
    params = g0 + g1
    opt = AdamW([{"params": g0}, {"params": g1, "lr": lrs[1]}], lr=lrs[0], weight_decay=0.1,
                seed=seed, **opts)
    ref = RefAdam(params, lr=[lrs[0]] * len(g0) + [lrs[1]] * len(g1), weight_decay=0.1,
                  **_ref_options(opts, seed))
    scale = 2.0 ** 8
    for step in range(steps):
        grads = make_grads(params, step, seed=3, scale=scale)
        grads[2] = grads[2].float()  # an fp32 gradient for a low-precision param
        grads[NO_GRAD] = None
        poisoned = step == 40
        if poisoned:
            grads[0].view(-1)[5] = float("inf")
        set_grads(params, grads)
        opt.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(float(poisoned)))
        ref.step(grads, inv_scale=1.0 / scale, found_inf=poisoned)
        if check:
            assert_matches_ref(opt, params, ref, "%s step %d" % (case, step),
                               moments=step % 10 == 9 or step == steps - 1)
    return opt, params, ref


@pytest.mark.parametrize("case", sorted(MODE_CASES))
def test_lean_modes_match_the_reference_bit_for_bit(device, case):
    """Every mode against RefAdam on fp32 copies with the rounding written from its
    definition: master-free params rounded to nearest even (Tensor.to) or stochastically
    (bf16_sr_reference / fp16_sr_reference with the draws of sr_key(seed, t, 2k + 1)), bf16
    moments stochastically (one draw of sr_key(seed, t, 2k) per element: exp_avg its low 16
    bits, exp_avg_sq r >> 16) or to nearest, and the fp32 masters with the nudge -- params,
    fp32 values, moments and step counts bit for bit, over two param groups, a param without
    a gradient, a channels_last param (positions in memory order), a zero-size and a 0-dim one,
    an fp32 gradient of a low-precision param, a loss scale and a poisoned step. On CUDA, the
    same reference: the same bits as the CPU."""
    opt, params, ref = _grouped_run(case, 150, device=device)
    low, opts, _ = MODE_CASES[case]
    for k, p in enumerate(params):
        st = opt.state.get(p, {})
        if k == NO_GRAD:
            assert not st
            continue
        assert st["exp_avg"].dtype == opts.get("exp_avg_dtype", F32)
        assert st["exp_avg_sq"].dtype == opts.get("exp_avg_sq_dtype", F32)
        assert st["exp_avg"].stride() == p.stride()
        extra = set(st) - {"step", "exp_avg", "exp_avg_sq"}
        if p.dtype == F32 or not opts.get("master_weights", True):
            assert extra == set()
        else:
            assert extra == {"param_remainder" if opts.get("param_remainders") else
                             "master_param"}
    stochastic = opts.get("stochastic_rounding") or (
        opts.get("moment_rounding") != "nearest" and BF16 in (opts.get("exp_avg_dtype"),
                                                              opts.get("exp_avg_sq_dtype")))
    assert (ref.not_nearest > 100) == bool(stochastic)  # the draws mattered


def _sr_run(seed, steps=5, n=512, resume_at=None, **extra):
    """Master-free SR bf16 params with bf16 moments: two params with the same values and
    gradients (different streams). Returns the optimizer and params."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(n, generator=gen).to(BF16)
    params = [base.clone().requires_grad_(), base.clone().requires_grad_()]
    kw = dict(lr=1e-3, master_weights=False, stochastic_rounding=True, seed=seed, **B2, **extra)
    opt = AdamW(params, **kw)
    for step in range(steps):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(BF16)
        set_grads(params, [g, g])
        opt.step()
        if step == resume_at:
            sd = roundtrip(opt.state_dict())
            opt = AdamW(params, **kw)
            opt.load_state_dict(sd)
    return opt, params


def _sr_bits(opt, params):
    return [bits(t) for p in params for t in (p, opt.state[p]["exp_avg"],
                                              opt.state[p]["exp_avg_sq"])]


def test_seed_and_stream_dependence():
    """One seed: the same bits (also across a resume from a checkpoint, whose rounding draws
    what the uninterrupted run would have). Another seed: different bits. Two params with
    equal values and gradients: different bits (each has its own streams). "Different" is
    measured against what independent draws give: a large fraction of the rounded bytes."""
    a = _sr_bits(*_sr_run(seed=1))
    b = _sr_bits(*_sr_run(seed=1))
    resumed = _sr_bits(*_sr_run(seed=1, resume_at=2))
    c = _sr_bits(*_sr_run(seed=2))
    big = _sr_bits(*_sr_run(seed=2 ** 64 - 1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a, resumed))
    for other in (c, big):
        for x, y in zip(a, other):
            assert (x != y).float().mean() > 0.05
    opt, params = _sr_run(seed=1)
    p0, p1 = params
    for key in ("exp_avg", "exp_avg_sq"):
        x, y = bits(opt.state[p0][key]), bits(opt.state[p1][key])
        assert (x != y).float().mean() > 0.05
    assert (bits(p0) != bits(p1)).float().mean() > 0.05


def test_fp16_stochastic_rounding_at_the_edges():
    """mpext.ops.adam_step_ with master_free and stochastic_rounding on fp16 params at fp16's
    edges: the largest finite value (an update past it rounds to nearest: 65504 or Inf, never
    Inf by chance), subnormals, values below the smallest subnormal, zeros of both signs. Each
    update is exactly -lr * sign(g) (betas 0, eps 0, no decay), so the fp32 value is
    param - lr * sign(g), rounded by fp16_sr_array with the draws of sr_key(seed, 1, 1)."""
    vals = [65504.0, -65504.0, 65472.0, 65000.0, 2 ** -24, -(2 ** -24), 2 ** -14, 3 * 2 ** -24,
            0.0, -0.0, 1.0, -1.0, 1000.0, 2 ** -20]
    seed = 321
    for lr in (16.0, 20.0, 40.0, 2 ** -26, 2 ** -30, 2 ** -40, 3e-5, 7e-3):
        for sign in (1.0, -1.0):
            p = torch.tensor(vals * 64, dtype=FP16)
            g = torch.full(p.shape, sign, dtype=FP16)
            x = p.float() - np.float32(lr) * sign  # the fp32 value before rounding
            ops.adam_step_([p], [g], [torch.zeros(p.shape)], [torch.zeros(p.shape)], [],
                           [torch.zeros(())], lr, 0.0, 0.0, 0.0, 0.0, True, False,
                           master_free=True, stochastic_rounding=True, seed=seed)
            r = sr_bits_array(sr_key(seed, 1, 1), np.arange(p.numel(), dtype=np.uint64))
            want, nan = fp16_sr_array(u32(x), r)
            assert not nan.any()
            got = p.view(torch.int16).numpy().view(np.uint16)
            assert (got == want).all(), (lr, sign, np.nonzero(got != want)[0][:5])
            finite_in = np.isfinite(x.numpy())
            big = np.abs(x.numpy()) >= 65520
            assert (np.isinf(p.float().numpy()) == (big & finite_in)).all()


# --------------------------------------------------------------------------------------------
# Unbiasedness and independence, statistically. The runs are deterministic (a fixed seed), so
# each test passes or fails for good; the false-alarm rate stated is the chance, over seeds,
# that an unbiased rounding with independent draws fails it.


def _z(observed, expected, samples):
    se = float(np.std(samples, ddof=1)) / math.sqrt(len(samples))
    return (observed - expected) / se


@pytest.mark.parametrize("dtype,lr", [(BF16, 1e-4), (FP16, 1e-5)], ids=["bf16", "fp16"])
def test_master_free_small_updates_survive_in_expectation(dtype, lr):
    """4096 master-free params at 1.0, 400 AdamW steps with a constant gradient: each update
    (about lr, 1/78 of a bf16 ulp at 1.0, 1/98 of an fp16 one) is below half an ulp. To
    nearest, the params never move (bit for bit). With stochastic rounding their mean moves by
    the float64 sum of the updates (tests/reference.py's float64 Adam): a z-test on the mean
    at |z| < 5, whose false-alarm rate is 2 * Phi(-5) = 5.7e-7; and it moves by more than 20
    standard errors, so the test can tell "unbiased" from "stuck"."""
    n, steps = 4096, 400
    expect = np.ones(1)
    m, v = np.zeros(1), np.zeros(1)
    for t in range(steps):
        expect, m, v, _ = adam_step_reference(expect, -np.ones(1), m, v, t, lr, 0.9, 0.999,
                                              1e-8, 0.0, True, False)
    runs = {}
    for sr in (False, True):
        p = torch.ones(n, dtype=dtype, requires_grad=True)
        opt = AdamW([p], lr=lr, weight_decay=0.0, master_weights=False, stochastic_rounding=sr,
                    seed=17)
        for _ in range(steps):
            p.grad = torch.full((n,), -1.0, dtype=dtype)
            opt.step()
        runs[sr] = p.detach().double().numpy()
    assert (runs[False] == 1.0).all()  # round to nearest loses every update
    got = runs[True]
    z = _z(got.mean(), expect[0], got)
    assert abs(z) < Z_LIMIT, (got.mean(), expect[0], z)
    assert _z(got.mean(), 1.0, got) > 20


def test_bf16_second_moment_decays_in_expectation():
    """exp_avg_sq in bf16 from 1.0 with zero gradients: beta2 = 0.999 is within half a bf16 ulp
    of 1, so to nearest it never moves (bit for bit), while stochastically rounded its mean
    over 4096 elements follows 0.999^t (float64): z-tests at t = 100, 250 and 500, |z| < 5
    each, a false alarm in at most 3 * 5.7e-7 = 1.7e-6 of seeds. (fp32's rounding of 0.999 and
    of each product moves the expectation by under 1e-4 standard errors.)"""
    n, checks = 4096, (100, 250, 500)
    out = {}
    for rounding in ("nearest", "stochastic"):
        p = torch.zeros(n, requires_grad=True)
        opt = AdamW([p], lr=1e-3, weight_decay=0.0, exp_avg_sq_dtype=BF16,
                    moment_rounding=rounding, seed=23)
        sd = opt.state_dict()
        sd["state"] = {0: {"step": torch.tensor(0.0), "exp_avg": torch.zeros(n),
                           "exp_avg_sq": torch.ones(n, dtype=BF16)}}
        opt.load_state_dict(sd)
        seen = {}
        for t in range(1, checks[-1] + 1):
            p.grad = torch.zeros(n)
            opt.step()
            if t in checks:
                seen[t] = opt.state[p]["exp_avg_sq"].double().numpy().copy()
        out[rounding] = seen
    for t in checks:
        assert (out["nearest"][t] == 1.0).all()  # stalled
        got = out["stochastic"][t]
        z = _z(got.mean(), 0.999 ** t, got)
        assert abs(z) < Z_LIMIT, (t, got.mean(), 0.999 ** t, z)
    assert _z(out["stochastic"][100].mean(), 1.0, out["stochastic"][100]) < -20


def test_rounding_decisions_are_unbiased_and_independent():
    """Master-free SR bf16 params with bf16 moments, two params of 2^16 elements, two steps.
    For each stochastically rounded value (param, exp_avg, exp_avg_sq) the decision d (1: away
    from zero, to the larger magnitude) has probability f = the discarded fraction, so
    e = d - f has mean 0 and variance f(1 - f), and under independent draws the products of
    two e's are uncorrelated with mean 0. Ten z-statistics: the mean of e for each of the three
    values; the correlation of e between neighbouring positions (param, exp_avg, exp_avg_sq),
    between exp_avg and exp_avg_sq of one element (one draw, its two halves), between the
    param and its exp_avg (two streams), between the two params (neighbouring streams) and
    between the two steps of one element. Each |z| < 5: a false alarm in at most
    10 * 5.7e-7 = 5.7e-6 of seeds. The draws are checked at positions from 0 (counters near
    zero, where weak generators correlate)."""
    n = 1 << 16
    gen = torch.Generator().manual_seed(31)
    params = [torch.randn(n, generator=gen).to(BF16).requires_grad_() for _ in range(2)]
    kw = dict(lr=1e-3, weight_decay=0.1, master_weights=False, stochastic_rounding=True,
              seed=2 ** 40 + 1, **B2)
    opt = AdamW(params, **kw)
    ref = RefAdam(params, **{k: v for k, v in _ref_options(kw, kw["seed"]).items()},
                  lr=1e-3, weight_decay=0.1)
    e, var = {}, {}
    for step in range(2):
        grads = [torch.randn(n, generator=gen).to(BF16) for _ in params]
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        for k, p in enumerate(params):
            for name in ("param", "exp_avg", "exp_avg_sq"):
                x = u32(ref.raw[k][name])
                got = p if name == "param" else opt.state[p][name]
                got = got.detach().view(torch.int16).numpy().view(np.uint16).reshape(-1)
                assert (got.astype(np.uint32) - (x >> 16) <= 1).all()  # a neighbour
                f = (x & np.uint32(0xFFFF)).astype(np.float64) / 65536.0
                d = (got.astype(np.uint32) != (x >> 16)).astype(np.float64)
                e[step, k, name], var[step, k, name] = d - f, f * (1 - f)

    def z_mean(key):
        return e[key].sum() / math.sqrt(var[key].sum())

    def z_pair(a, b, lag=0):
        ea, eb = (e[a][:-1], e[b][1:]) if lag else (e[a], e[b])
        va, vb = (var[a][:-1], var[b][1:]) if lag else (var[a], var[b])
        return (ea * eb).sum() / math.sqrt((va * vb).sum())

    stats = {
        "mean param": z_mean((1, 0, "param")),
        "mean exp_avg": z_mean((1, 0, "exp_avg")),
        "mean exp_avg_sq": z_mean((1, 0, "exp_avg_sq")),
        "neighbours param": z_pair((0, 0, "param"), (0, 0, "param"), lag=1),
        "neighbours exp_avg": z_pair((0, 0, "exp_avg"), (0, 0, "exp_avg"), lag=1),
        "neighbours exp_avg_sq": z_pair((0, 0, "exp_avg_sq"), (0, 0, "exp_avg_sq"), lag=1),
        "exp_avg vs exp_avg_sq": z_pair((0, 0, "exp_avg"), (0, 0, "exp_avg_sq")),
        "param vs exp_avg": z_pair((0, 0, "param"), (0, 0, "exp_avg")),
        "param 0 vs param 1": z_pair((0, 0, "param"), (0, 1, "param")),
        "step 1 vs step 2": z_pair((0, 0, "param"), (1, 0, "param")),
    }
    assert len(stats) == 10
    bad = {k: v for k, v in stats.items() if not abs(v) < Z_LIMIT}
    assert not bad, stats
    # not vacuous: most values had something to round (a fifth of the first exp_avg, 0.1 * g,
    # are exact: g / 10 for bf16 gradients whose significand is a multiple of 5)
    assert all((v > 0).mean() > 0.75 for v in var.values())


# --------------------------------------------------------------------------------------------
# Bad options and states: a clear error naming the argument, and nothing changed. (The
# options' checks, in the constructor, a trained group and add_param_group, are the table's
# test_bad_options_raise_and_change_nothing; the op's, tests/test_adam.py's OP_BAD.)


def _trained(remainders=True, n=2):
    params = make_params(specs=[((6,), BF16, False), ((5,), BF16, False)][:n], seed=8)
    opt = AdamW(params, param_remainders=remainders)
    set_grads(params, make_grads(params, 0))
    opt.step()
    return opt, params


def test_a_refused_conversion_converts_no_other_param():
    """A group switched to remainders and bf16 moments between steps, where the second param's
    master no longer rounds to it: the step raises, and the first param's state is not
    converted either (its fp32 moments not narrowed, its master not split)."""
    opt, params = _trained(remainders=False)
    with torch.no_grad():
        opt.state[params[1]]["master_param"] += 1.0
    opt.param_groups[0].update(param_remainders=True, exp_avg_dtype=BF16)
    set_grads(params, make_grads(params, 1))
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"does not round to the param's current value"):
        opt.step()
    assert_unchanged(opt, params, before)
    assert opt.state[params[0]]["exp_avg"].dtype == F32


def test_param_changed_to_fp16_after_construction():
    """A param made fp16 in place (param.data = ...) in a remainder group: the step refuses it,
    naming the reason, before anything is written."""
    opt, params = _trained()
    with torch.no_grad():
        params[1].data = params[1].data.to(FP16)
    set_grads(params, make_grads(params, 1))
    before = snapshot(opt, params[:1]) + [("p1", params[1].detach().clone())]
    with pytest.raises(ValueError, match=r"mpext.optim.AdamW: param 1 of group 0 is float16, "
                                         r"and param_remainders=True needs bfloat16 params"):
        opt.step()
    assert_unchanged(opt, params[:1], before[:-1])
    assert_same_bits(params[1].detach(), before[-1][1], "param 1")
    assert opt.state[params[1]]["param_remainder"].dtype == torch.int16


def _bad_state(mutate):
    opt, params = _trained()
    sd = roundtrip(opt.state_dict())
    mutate(sd, params)
    return opt, params, sd


BAD_STATES = [
    ("a mis-shaped param_remainder",
     lambda sd, ps: sd["state"][1].update(param_remainder=torch.zeros(6, dtype=torch.int16)),
     ValueError, r"the state of param 1: param_remainder has shape \(6,\) but the param has "
                 r"shape \(5,\)"),
    ("an int64 param_remainder",
     lambda sd, ps: sd["state"][0].update(param_remainder=torch.zeros(6, dtype=torch.int64)),
     TypeError, r"the state of param 0: param_remainder must be a dense int16 tensor \(or "
                r"int32 of int16 values\), got torch.strided torch.int64"),
    ("an int32 param_remainder beyond int16",  # int32 is how state_dict() gives DTensor ones
     lambda sd, ps: sd["state"][0].update(param_remainder=torch.full((6,), 2 ** 15,
                                                                     dtype=torch.int32)),
     ValueError, r"param_remainder is int32 with values outside int16's range"),
    ("a float param_remainder",
     lambda sd, ps: sd["state"][0].update(param_remainder=torch.zeros(6)),
     TypeError, r"param_remainder must be a dense int16 tensor \(or int32 of int16 values\), "
                r"got torch.strided torch.float32"),
    ("a param_remainder that is not a tensor",
     lambda sd, ps: sd["state"][1].update(param_remainder=[0] * 5),
     TypeError, r"the state of param 1: param_remainder must be a tensor, got list"),
    ("both a master and a remainder",
     lambda sd, ps: sd["state"][0].update(master_param=torch.zeros(6)),
     ValueError, r"the state of param 0 has both a master_param and a param_remainder"),
    ("a master_param that does not round to the param",
     lambda sd, ps: (sd["state"][0].pop("param_remainder"),
                     sd["state"][0].update(master_param=ps[0].detach().float() + 1)),
     ValueError, r"the state of param 0: its master_param does not round to the param's "
                 r"current value at 6 of 6 elements"),
]


@pytest.mark.parametrize("what,mutate,exc,match", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_bad_remainder_states_change_nothing(what, mutate, exc, match):
    opt, params, sd = _bad_state(mutate)
    before = snapshot(opt, params)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(exc, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(opt, params, before, what)
    assert [dict(g) for g in opt.param_groups] == groups


def test_remainder_for_an_fp16_param_is_refused_on_load():
    """A checkpoint with a param_remainder loaded where that param is fp16 (a master-mode
    optimizer over an fp16 model): refused, nothing changed."""
    opt, params = _trained(n=1)
    sd = roundtrip(opt.state_dict())
    p16 = params[0].detach().to(FP16).requires_grad_()
    target = AdamW([p16])
    set_grads([p16], [torch.ones(6, dtype=FP16)])
    target.step()
    before = snapshot(target, [p16])
    sd["param_groups"][0]["param_remainders"] = False
    with pytest.raises(ValueError, match=r"the state of param 0: it has a param_remainder but "
                                         r"the param is float16; only a bfloat16 param has one"):
        target.load_state_dict(sd)
    assert_unchanged(target, [p16], before)


# --------------------------------------------------------------------------------------------
# torch.compile, and MixedPrecisionOptimizer around an inner AdamW with bf16 moments.


def test_compiled_step_matches_eager_bit_for_bit():
    """torch.compile(opt.step) (inductor) over two lean groups -- remainders with bf16 moments
    and an EMA, and master-free fp16 params with stochastic rounding and a bf16 second moment
    -- gives the eager bits, the EMA's included, a poisoned step included."""
    torch._dynamo.reset()
    groups = [dict(specs=[((13, 7), BF16, False), ((2, 3, 4, 5), BF16, True)],
                   opts=dict(param_remainders=True, ema_decay=0.9, **B2)),
              dict(specs=[((31,), FP16, False), ((9,), F32, False)],
                   opts=dict(master_weights=False, stochastic_rounding=True,
                             exp_avg_sq_dtype=BF16, seed=3))]
    runs = []
    for _ in range(2):
        params = [make_params(g["specs"], seed=9 + i) for i, g in enumerate(groups)]
        opt = AdamW([dict(params=ps, **g["opts"]) for ps, g in zip(params, groups)], lr=1e-2)
        runs.append((opt, sum(params, [])))
    compiled = torch.compile(runs[0][0].step)  # inductor, as a user compiles it
    for step in range(5):
        grads = make_grads(runs[0][1], step, scale=64.0)
        if step == 2:
            grads[0].view(-1)[3] = float("inf")
        for (opt, params), run in zip(runs, (compiled, runs[1][0].step)):
            set_grads(params, grads)
            run(grad_scale=torch.tensor(64.0), found_inf=torch.tensor(float(step == 2)))
        assert_same_optimizers(runs[0][0], runs[0][1], runs[1][0], runs[1][1], "step %d" % step)
    assert runs[0][0].state[runs[0][1][0]]["step"].item() == 4
    assert "ema_param" in runs[0][0].state[runs[0][1][0]]
    torch._dynamo.reset()


def test_mixed_precision_optimizer_keeps_bf16_moments():
    """MixedPrecisionOptimizer around mpext.optim.AdamW(exp_avg_dtype=exp_avg_sq_dtype=bf16):
    the inner state keeps bf16 moments, and model params, masters and moments are bit for bit
    those of a plain mpext.optim.AdamW with fp32 masters and the same options (the same seed
    and param positions, so the same rounding streams)."""
    torch.manual_seed(0)
    lin_a = torch.nn.Linear(8, 5).to(BF16)
    lin_b = torch.nn.Linear(8, 5).to(BF16)
    lin_b.load_state_dict(lin_a.state_dict())
    kw = dict(lr=1e-2, weight_decay=0.1, seed=77, **B2)
    mpo = mpext.MixedPrecisionOptimizer(AdamW(lin_a.parameters(), **kw), loss_scale=None)
    plain = AdamW(lin_b.parameters(), **kw)
    for step in range(30):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=gen).to(BF16), torch.randn(4, 5, generator=gen)
        mpo.zero_grad()
        mpo.backward(((lin_a(x).float() - y) ** 2).mean())
        mpo.step()
        plain.zero_grad()
        ((lin_b(x).float() - y) ** 2).mean().backward()
        plain.step()
        for p, q in zip(lin_a.parameters(), lin_b.parameters()):
            assert_same_bits(p.detach(), q.detach(), "step %d: param" % step)
            assert_same_bits(mpo.master_param(p), plain.master_param(q), "step %d: master"
                              % step)
            inner = mpo.optimizer.state[mpo.master_param(p)]
            for key in ("exp_avg", "exp_avg_sq"):
                assert inner[key].dtype == BF16
                assert_same_bits(inner[key], plain.state[q][key], "step %d: %s" % (step, key))


@pytest.mark.parametrize("saved_kw,loaded_kw", [
    (dict(), dict(param_remainders=True)),
    (dict(param_remainders=True), dict()),
    (dict(), dict(param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    (dict(master_weights=False, stochastic_rounding=True), dict()),
], ids=["master_into_remainder", "remainder_into_master", "master_into_bf16_moments",
        "master_free_into_master"])
def test_a_checkpoint_resumes_in_the_loading_optimizers_storage_mode(saved_kw, loaded_kw):
    """The storage settings are the loading optimizer's: the checkpoint's state is converted
    into them (the training settings, lr and the rest, come from the checkpoint, as in
    torch). Masters <-> remainders then continue with the same bits as the saved run."""
    pa = make_params(seed=8)
    a = AdamW(pa, lr=1e-3, weight_decay=0.1, **saved_kw)
    for step in range(5):
        set_grads(pa, make_grads(pa, step))
        a.step()
    sd = roundtrip(a.state_dict())
    pb = twin(pa)
    b = AdamW(pb, lr=5.0, **loaded_kw)  # lr from the checkpoint
    b.load_state_dict(sd)
    group = b.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.1
    for key in ("master_weights", "param_remainders", "stochastic_rounding"):
        assert group[key] == loaded_kw.get(key, key == "master_weights"), key
    assert group["exp_avg_dtype"] is loaded_kw.get("exp_avg_dtype", F32)
    for p in pb:
        st = b.state[p]
        assert st["exp_avg"].dtype is loaded_kw.get("exp_avg_dtype", F32)
        if p.dtype == BF16 and saved_kw.get("master_weights", True):
            want = "param_remainder" if loaded_kw.get("param_remainders") else "master_param"
            if saved_kw.get("param_remainders") and want == "master_param":
                want = "param_remainder"  # joined with the param at the next step
            assert want in st and not ({"master_param", "param_remainder"} - {want}) & set(st)
    if "exp_avg_dtype" not in loaded_kw and saved_kw.get("master_weights", True):
        for step in range(5, 30):  # the modes compute the same bits
            g = make_grads(pa, step)
            set_grads(pa, g)
            set_grads(pb, g)
            a.step()
            b.step()
        for p, q in zip(pa, pb):
            assert_same_bits(p.detach(), q.detach(), "param")
            assert_same_bits(a.master_param(p), b.master_param(q), "master")


@pytest.mark.parametrize("saved_kw,loaded_kw", [
    (dict(param_remainders=True), {}),
    (dict(param_remainders=True, ema_decay=0.9), dict(ema_decay=0.9)),
    ({}, dict(param_remainders=True)),
    (dict(param_remainders=True), dict(param_remainders=True)),
], ids=["remainder_into_master", "with_ema", "master_into_remainder", "remainder"])
def test_model_loaded_after_the_optimizer(saved_kw, loaded_kw):
    """torch lets a checkpoint's optimizer state be loaded before or after the model's: a
    remainder checkpoint resumed with fp32 masters must then join each remainder with the
    model's loaded weights, not with the fresh ones it found at load time. The resumed run
    equals one that loaded the model first, bit for bit (a master that must become a
    remainder needs the model first: its split checks the round, and refuses otherwise)."""
    pa = make_params(seed=11)
    a = AdamW(pa, lr=1e-3, **saved_kw)
    for step in range(4):
        set_grads(pa, make_grads(pa, step))
        a.step()
    osd, msd = roundtrip(a.state_dict()), [p.detach().clone() for p in pa]

    def resume(model_first):
        ps = make_params(seed=12)  # a fresh init, other values
        opt = AdamW(ps, lr=1e-3, **loaded_kw)
        if model_first:
            with torch.no_grad():
                for p, x in zip(ps, msd):
                    p.copy_(x)
        try:
            opt.load_state_dict(osd)
        except ValueError as exc:
            return str(exc)
        if not model_first:
            with torch.no_grad():
                for p, x in zip(ps, msd):
                    p.copy_(x)
        for step in range(4, 8):
            set_grads(ps, make_grads(ps, step))
            opt.step()
        return ps, opt

    first, late = resume(True), resume(False)
    if saved_kw.get("param_remainders") or not loaded_kw.get("param_remainders"):
        for (p, q) in zip(first[0], late[0]):
            assert_same_bits(p.detach(), q.detach(), "param")
            assert_same_bits(first[1].master_param(p), late[1].master_param(q), "master")
            if loaded_kw.get("ema_decay"):
                assert_same_bits(first[1].ema_param(p), late[1].ema_param(q), "ema")
        # and both continue the saved run
        for step in range(4, 8):
            set_grads(pa, make_grads(pa, step))
            a.step()
        for p, q in zip(pa, first[0]):
            assert_same_bits(p.detach(), q.detach(), "param vs the uninterrupted run")
    else:
        assert "does not round to the param's current value" in late


def _stepped(steps=2, **kw):
    params = make_params(seed=21)
    opt = AdamW(params, lr=1e-3, **kw)
    for step in range(steps):
        set_grads(params, make_grads(params, step))
        opt.step()
    return params, opt


def test_load_warns_when_the_checkpoint_replaces_what_the_optimizer_keeps_or_draws():
    """The checkpoint's seed, moment_rounding and ema_decay win, as torch's settings do (the
    resumed run draws and averages as the saved one), and a difference is warned about: an
    optimizer built with an EMA that loads a checkpoint without one keeps none, and says so."""
    import warnings

    params, saved = _stepped()
    sd = roundtrip(saved.state_dict())
    other = AdamW(twin(params), lr=1e-3, ema_decay=0.99, seed=7, moment_rounding="nearest")
    with pytest.warns(UserWarning) as record:
        other.load_state_dict(sd)
    got = " | ".join(str(w.message) for w in record)
    for key, theirs, mine in (("ema_decay", None, 0.99), ("seed", 0, 7),
                              ("moment_rounding", "stochastic", "nearest")):
        assert ("param group 0 takes the checkpoint's %s=%r instead of this optimizer's %r"
                % (key, theirs, mine)) in got
    group = other.param_groups[0]
    assert (group["ema_decay"], group["seed"], group["moment_rounding"]) == (
        None, 0, "stochastic")
    same = AdamW(twin(params), lr=5.0)  # lr differs as torch allows: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(sd)


def test_master_free_round_to_nearest_warns():
    import warnings

    with pytest.warns(UserWarning, match=r"master_weights=False without "
                                         r"stochastic_rounding=True rounds every update"):
        AdamW(make_params(), lr=1e-5, master_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamW(make_params(), lr=1e-5, master_weights=False, stochastic_rounding=True)
        AdamW([torch.zeros(4, requires_grad=True)], master_weights=False)  # FP32: exact


def test_moment_formats_by_name_in_state_dicts_and_dtypes_in_groups():
    """state_dict() names the moment formats by string (torch's gather of full state dicts
    takes no dtype objects); the groups keep torch.dtype values, and a group edit or a
    checkpoint may give either."""
    params, opt = _stepped(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    sd = opt.state_dict()
    assert (sd["param_groups"][0]["exp_avg_dtype"], sd["param_groups"][0]["exp_avg_sq_dtype"]) \
        == ("bfloat16", "bfloat16")
    assert opt.param_groups[0]["exp_avg_dtype"] is BF16
    old = roundtrip(sd)
    old["param_groups"][0]["exp_avg_dtype"] = old["param_groups"][0]["exp_avg_sq_dtype"] = BF16
    for ckpt in (sd, old):  # checkpoints written with strings and with dtypes
        back = AdamW(twin(params), lr=1e-3, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
        back.load_state_dict(roundtrip(ckpt))
        assert back.param_groups[0]["exp_avg_dtype"] is BF16
        assert back.state[back.param_groups[0]["params"][0]]["exp_avg"].dtype == BF16
    for value in (F32, "float32"):  # a group edit: the moments are converted at the next step
        opt.param_groups[0]["exp_avg_dtype"] = value
        set_grads(params, make_grads(params, 9))
        opt.step()
        assert opt.param_groups[0]["exp_avg_dtype"] is F32
        assert opt.state[params[0]]["exp_avg"].dtype == F32
    opt.param_groups[0]["exp_avg_dtype"] = "bf16"
    with pytest.raises(ValueError, match=r"exp_avg_dtype must be torch.float32, "):
        opt.step()


def test_mixed_precision_optimizer_takes_a_moment_format_by_name():
    lin = torch.nn.Linear(8, 5).to(BF16)
    mpo = mpext.MixedPrecisionOptimizer(AdamW(lin.parameters(), lr=1e-3))
    mpo.optimizer.param_groups[0]["exp_avg_dtype"] = "bfloat16"
    mpo.backward(lin(torch.ones(2, 8, dtype=BF16)).float().sum())
    mpo.step()
    inner = mpo.optimizer.state[mpo.master_param(lin.weight)]
    assert inner["exp_avg"].dtype == BF16 and inner["exp_avg_sq"].dtype == F32


def test_mixed_master_and_remainder_groups_step_empty_params(device):
    """One launch over a master group and a remainder group, each holding an empty bf16 param
    (what an FSDP2 rank holds for a param whose shard is empty): it steps, the empty params stay
    empty, and the others take the bits of the same groups without the empty params. The planner
    refused this launch once, taking the other group's "none" placeholder for the empty param's
    storage and finding its shape wrong."""
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(4, 19, generator=gen).to(BF16) for _ in range(2)]
    grads = [[torch.randn(4, 19, generator=gen).to(BF16) for _ in range(2)] for _ in range(3)]

    def run(with_empty):
        ps = [torch.nn.Parameter(t.clone().to(device)) for t in full]
        es = [torch.nn.Parameter(torch.empty(0, 19, dtype=BF16, device=device))
              for _ in range(2)] if with_empty else []
        groups = [{"params": [ps[0]] + es[:1]},
                  {"params": [ps[1]] + es[1:], "param_remainders": True}]
        opt = AdamW(groups, lr=1e-2, weight_decay=0.1)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.to(device)
            for e in es:
                e.grad = torch.empty_like(e)
            opt.step()
        return opt, ps, es

    a, pa, ea = run(True)
    b, pb, _ = run(False)
    assert [tuple(e.shape) for e in ea] == [(0, 19), (0, 19)]
    for x, y in zip(pa, pb):
        assert torch.equal(bits(x), bits(y))
        for key in ("exp_avg", "exp_avg_sq", "master_param", "param_remainder"):
            if key in b.state[y]:
                assert torch.equal(bits(a.state[x][key]), bits(b.state[y][key])), key
