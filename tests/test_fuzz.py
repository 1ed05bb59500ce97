"""Property-based fuzzing (hypothesis) of every mpext op against an independent reference, and
one test that every CPU path (thread count x ISA) gives the same bits.

Inputs: random lengths (0, 1, odd, around SIMD widths, a few across the threads' work split),
views at random element offsets (so vector loads and stores are misaligned; guard elements
around each view must stay untouched), and values that mix ordinary numbers with +-0,
subnormals, the largest finite values, +-Inf and NaNs with payloads (quiet and signalling).

References: ``Tensor.to`` for the casts, the stochastic-rounding generator reference of
tests/reference.py, ``torch._amp_foreach_non_finite_check_and_unscale_``,
``torch._amp_update_scale_`` (and the pure-Python model of the extended rule), the float64 Adam
of tests/reference.py (and ``torch.optim`` for non-finite values), ``torch.linalg.vector_norm``.
Where torch canonicalizes NaNs only NaN-ness is compared; where mpext promises bits (the
exact widening casts, copies, cross-thread/ISA identity) the payload bits are compared too.

Profiles (``MPEXT_FUZZ_PROFILE``): ``dev`` (the default: 40 examples per test, random each
run), ``ci`` (the default when ``CI=true``: the same count, derandomized so CI is
reproducible) and ``fuzz`` (2000 examples per test, for a long local run)::

    MPEXT_FUZZ_PROFILE=fuzz python -m pytest tests/test_fuzz.py

No example database is written; a failure prints the example and a ``@reproduce_failure`` line.
"""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mpext
from mpext import ops

from reference import (ScaleRuleModel, adam_step_reference, assert_bits_or_both_nan,
                       bf16_sr_reference, sr_random_bits)

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("mpext-dev", max_examples=40, **_COMMON)
settings.register_profile("mpext-ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("mpext-fuzz", max_examples=2000, **_COMMON)
_PROFILE = os.environ.get("MPEXT_FUZZ_PROFILE") or (
    "ci" if os.environ.get("CI", "").lower() == "true" else "dev")
if _PROFILE not in ("dev", "ci", "fuzz"):
    raise ValueError("MPEXT_FUZZ_PROFILE must be dev, ci or fuzz, got %r" % _PROFILE)
# Applied per test, so loading this module changes no other module's hypothesis settings.
FUZZ = settings(settings.get_profile("mpext-" + _PROFILE))

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (F32, BF16, F16)
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# ---------------------------------------------------------------------------------------------
# Strategies.

F32_SPECIAL = [
    0x00000000, 0x80000000,              # +-0
    0x00000001, 0x80000001, 0x007FFFFF,  # subnormals: smallest, largest
    0x00800000, 0x80800000,              # smallest normals
    0x7F7FFFFF, 0xFF7FFFFF,              # largest finite
    0x7F800000, 0xFF800000,              # +-Inf
    0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs, payloads
    0x7F800001, 0xFF800001, 0x7FBFFFFF,  # signalling NaNs
    0x3F808000, 0x3F818000, 0x3F807FFF,  # bf16 ties / not
    0x7F7F8000, 0x7F7F7FFF,              # bf16 overflow boundary
    0x477FF000, 0x477FEFFF, 0x47800000,  # fp16 overflow boundary
    0x33000000, 0x33000001, 0x387FFFFF,  # fp16 subnormal boundaries
    0x3F800000, 0xBF800000,              # +-1
]
H16_SPECIAL = {
    BF16: [0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
           0xFFC1, 0x7F81, 0x7FFF, 0x3F80],
    F16: [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
          0xFE01, 0x7C01, 0x7FFF, 0x3C00],
}
LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65,
                                     127, 129]),
                    st.integers(0, 700))
OFFSETS = st.integers(0, 9)  # elements before the view: 0..9 misaligns any vector width


def bit_patterns(dtype, special=True, finite=False):
    """Element bit patterns (as unsigned ints) for dtype: uniform random bits, special values
    and ordinary numbers, mixed."""
    width = 32 if dtype == F32 else 16
    pools = [st.integers(0, 2 ** width - 1)]
    if special:
        pools.append(st.sampled_from(F32_SPECIAL if dtype == F32 else H16_SPECIAL[dtype]))
    floats = st.floats(-1e4, 1e4, width=32, allow_subnormal=True)
    pools.append(floats.map(lambda v: _to_bits(v, dtype)))
    s = st.one_of(*pools)
    return s.filter(lambda b: _finite_bits(b, dtype)) if finite else s


def _to_bits(v, dtype):
    t = torch.tensor([v], dtype=F32).to(dtype)
    return int(t.view(INT[t.element_size()]).item()) & (2 ** (8 * t.element_size()) - 1)


def _finite_bits(b, dtype):
    if dtype == F32:
        return (b & 0x7F800000) != 0x7F800000
    if dtype == BF16:
        return (b & 0x7F80) != 0x7F80
    return (b & 0x7C00) != 0x7C00


def tensor_from_bits(bits, dtype):
    width = np.uint32 if dtype == F32 else np.uint16
    arr = np.array(bits, dtype=np.uint64).astype(width)
    signed = arr.view(np.int32 if dtype == F32 else np.int16)
    return torch.from_numpy(signed.copy()).view(dtype)


@st.composite
def placed(draw, dtype, n=None, finite=False, special=True):
    """A 1-D tensor of dtype at a random element offset inside a larger buffer whose guard
    elements hold a known pattern: (view, buffer, offset)."""
    n = draw(LENGTHS) if n is None else n
    off = draw(OFFSETS)
    tail = draw(st.integers(0, 3))
    bits = draw(st.lists(bit_patterns(dtype, special, finite), min_size=n, max_size=n))
    buf = torch.full((off + n + tail,), 0.375, dtype=F32).to(dtype)
    view = buf[off:off + n]
    if n:
        view.copy_(tensor_from_bits(bits, dtype))
    return view, buf, off


def int_view(t):
    return t.view(INT[t.element_size()])


def assert_bits(ours, ref, what=""):
    """Bitwise equal, NaN payloads included."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    bad = int_view(ours.contiguous()) != int_view(ref.contiguous())
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise AssertionError("%s: first difference at %d: ours 0x%x, reference 0x%x" % (
            what, i, int(int_view(ours).reshape(-1)[i]), int(int_view(ref).reshape(-1)[i])))


def assert_guards(buf, off, n, before, what=""):
    """The buffer's elements outside the view [off, off + n) are unchanged."""
    assert_bits(buf[:off], before[:off], what + " (guard before)")
    assert_bits(buf[off + n:], before[off + n:], what + " (guard after)")


# ---------------------------------------------------------------------------------------------
# Casts.


@FUZZ
@given(data=st.data(), target=st.sampled_from([BF16, F16]))
def test_rne_casts_match_tensor_to(data, target):
    x, _, _ = data.draw(placed(F32))
    fn = ops.to_bf16 if target == BF16 else ops.to_fp16
    assert_bits_or_both_nan(fn(x), x.to(target), "fp32 -> %s" % target)


@FUZZ
@given(data=st.data(), source=st.sampled_from([BF16, F16]))
def test_widening_casts_are_exact(data, source):
    x, _, _ = data.draw(placed(source))
    ours = ops.to_fp32(x)
    ref = x.to(F32)
    if source == BF16:
        assert_bits(ours, ref, "bf16 -> fp32 (a shift: payloads kept)")
    else:
        assert_bits_or_both_nan(ours, ref, "fp16 -> fp32")


@FUZZ
@given(data=st.data(), seed=st.integers(0, 2 ** 64 - 1),
       offset=st.one_of(st.integers(0, 64), st.integers(0, 2 ** 63 - 2 ** 20)))
def test_stochastic_rounding_matches_generator_reference(data, seed, offset):
    x, _, _ = data.draw(placed(F32, n=data.draw(st.integers(0, 90))))
    ours = ops.to_bf16(x, stochastic=True, seed=seed, offset=offset)
    bits = x.view(torch.int32).numpy().view(np.uint32).tolist()
    got = ours.view(torch.int16).numpy().view(np.uint16).tolist()
    for i, (b, g) in enumerate(zip(bits, got)):
        want = bf16_sr_reference(b, sr_random_bits(seed, offset + i))
        if want is None:  # NaN in, any NaN out
            assert (g & 0x7F80) == 0x7F80 and (g & 0x7F) != 0, i
        else:
            assert g == want & 0xFFFF, (i, hex(b), hex(g), hex(want))


CAST_KINDS = [(F32, BF16), (F32, F16), (BF16, F32), (F16, F32), (F32, F32), (BF16, BF16),
              (F16, F16)]


@FUZZ
@given(data=st.data(), stochastic=st.booleans(), seed=st.integers(0, 2 ** 64 - 1),
       offset=st.integers(0, 2 ** 40))
def test_cast_list_matches_per_pair_reference(data, stochastic, seed, offset):
    kinds = data.draw(st.lists(st.sampled_from(CAST_KINDS), min_size=0, max_size=6))
    if stochastic:
        kinds = [k for k in kinds if k != (F32, F16)]
    srcs, dsts = [], []
    for s_dt, d_dt in kinds:
        n = data.draw(st.integers(0, 80))
        srcs.append(data.draw(placed(s_dt, n=n))[0])
        dsts.append(data.draw(placed(d_dt, n=n, special=False)))
    before = [b.clone() for _, b, _ in dsts]
    ops.cast_([d for d, _, _ in dsts], srcs, stochastic=stochastic, seed=seed, offset=offset)
    position = offset
    for k, ((d, buf, off), s, b0) in enumerate(zip(dsts, srcs, before)):
        assert_guards(buf, off, d.numel(), b0, "pair %d" % k)
        if s.dtype == d.dtype:
            assert_bits(d, s, "pair %d (a copy keeps every bit)" % k)
        elif stochastic and d.dtype == BF16:
            bits = s.view(torch.int32).numpy().view(np.uint32).tolist()
            got = d.view(torch.int16).numpy().view(np.uint16).tolist()
            for i, (xb, g) in enumerate(zip(bits, got)):
                want = bf16_sr_reference(xb, sr_random_bits(seed, position + i))
                if want is None:
                    assert (g & 0x7F80) == 0x7F80 and (g & 0x7F), (k, i)
                else:
                    assert g == want & 0xFFFF, (k, i)
        elif s.dtype == BF16:
            assert_bits(d, s.to(F32), "pair %d" % k)
        else:
            assert_bits_or_both_nan(d, s.to(d.dtype), "pair %d" % k)
        position += s.numel()


# ---------------------------------------------------------------------------------------------
# Loss scaling.

INV_SCALES = st.one_of(
    st.sampled_from([1.0, 0.0, -0.0, 2.0 ** -24, 2.0 ** -149, 2.0 ** -126, 3.4e38, 65504.0,
                     1.0 / 3.0, math.inf, -math.inf, math.nan, 0.5, 2.0 ** 16]),
    st.floats(width=32, allow_nan=False, allow_infinity=False))


@FUZZ
@given(data=st.data(), inv=INV_SCALES, found0=st.sampled_from([0.0, 1.0]))
def test_unscale_matches_torch(data, inv, found0):
    dtypes = data.draw(st.lists(st.sampled_from(FLOATS), min_size=0, max_size=5))
    placed_grads = [data.draw(placed(d)) for d in dtypes]
    grads = [g for g, _, _ in placed_grads]
    before = [b.clone() for _, b, _ in placed_grads]
    ref = [g.clone() for g in grads]
    found = torch.full((), found0)
    ops.unscale_(grads, found, torch.full((), inv))
    ref_found = torch.full((), found0)
    for dt in FLOATS:
        same = [r for r in ref if r.dtype == dt]
        if same:
            torch._amp_foreach_non_finite_check_and_unscale_(same, ref_found,
                                                             torch.full((), inv))
    assert found.item() == ref_found.item()
    for k, ((g, buf, off), r, b0) in enumerate(zip(placed_grads, ref, before)):
        assert_bits_or_both_nan(g, r, "grads[%d] (%s)" % (k, g.dtype))
        assert_guards(buf, off, g.numel(), b0, "grads[%d]" % k)


FOUND = st.sampled_from([0.0, 0.0, 0.0, 1.0, math.nan, math.inf, -1.0, -0.0, 2.0 ** -149])
SCALES = st.one_of(st.sampled_from([1.0, 65536.0, 3.4e38, 2.0 ** 127, 2.0 ** -149, 2.0 ** -126,
                                    1.5]),
                   st.floats(2.0 ** -149, float(np.finfo(np.float32).max), width=32))
FACTORS = st.floats(2.0 ** -20, 2.0 ** 20, allow_subnormal=False)


@FUZZ
@given(scale=SCALES, growth=FACTORS, backoff=FACTORS, interval=st.integers(1, 5),
       tracker=st.integers(0, 4), flags=st.lists(FOUND, min_size=1, max_size=30))
def test_update_scale_matches_torch(scale, growth, backoff, interval, tracker, flags):
    assume(tracker < interval)
    s, t = torch.full((), scale), torch.full((), tracker, dtype=torch.int32)
    rs, rt = s.clone(), t.clone()
    for f in flags:
        found = torch.full((), f)
        ops.update_scale_(s, t, found, growth, backoff, interval)
        torch._amp_update_scale_(rs, rt, found, growth, backoff, interval)
        assert_bits(s, rs, "scale after found_inf=%r" % f)
        assert t.item() == rt.item()


@FUZZ
@given(scale=SCALES, growth=FACTORS, backoff=FACTORS, interval=st.integers(1, 4),
       hysteresis=st.integers(1, 4),
       min_scale=st.one_of(st.none(), st.floats(2.0 ** -20, 2.0 ** 20)),
       max_scale=st.one_of(st.none(), st.floats(2.0 ** -20, 2.0 ** 40)),
       flags=st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=30))
def test_update_scale_extensions_match_model(scale, growth, backoff, interval, hysteresis,
                                             min_scale, max_scale, flags):
    assume(min_scale is None or max_scale is None or min_scale <= max_scale)
    s, t = torch.full((), scale), torch.zeros((), dtype=torch.int32)
    h = torch.full((), hysteresis, dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int64)
    model = ScaleRuleModel(scale, growth, backoff, interval, hysteresis, min_scale, max_scale)
    for f in flags:
        ops.update_scale_(s, t, torch.full((), f), growth, backoff, interval,
                          hysteresis_tracker=h, hysteresis=hysteresis, min_scale=min_scale,
                          max_scale=max_scale, stats=stats)
        model.step(f)
        assert s.item() == model.scale or (math.isnan(s.item()) and math.isnan(model.scale))
        assert (t.item(), stats.tolist()) == (model.tracker, [model.skipped, model.streak])
        if hysteresis > 1:
            assert h.item() == model.hysteresis_left


# ---------------------------------------------------------------------------------------------
# Adam / AdamW.

HYPER = st.fixed_dictionaries(dict(
    lr=st.one_of(st.just(0.0), st.floats(1e-6, 0.1)),
    beta1=st.one_of(st.just(0.0), st.floats(0.0, 0.999)),
    beta2=st.one_of(st.just(0.0), st.floats(0.5, 0.9999)),
    eps=st.floats(1e-12, 1e-3),  # eps = 0 with v = 0 is 0/0 (tests/test_bad_inputs.py has it)
    weight_decay=st.one_of(st.just(0.0), st.floats(0.0, 0.5)),
    decoupled=st.booleans(), maximize=st.booleans()))
PAIRS = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)]


@st.composite
def adam_values(draw, n, dtype, lo=1e-3, hi=1e3, zero_ok=True):
    """n finite values of moderate magnitude (with +-0 and, for fp32, subnormals) so that the
    float64 reference and fp32 arithmetic agree to rounding."""
    mags = st.one_of(st.floats(lo, hi), st.floats(-hi, -lo))
    pool = [mags] + ([st.sampled_from([0.0, -0.0])] if zero_ok else [])
    vals = draw(st.lists(st.one_of(*pool), min_size=n, max_size=n))
    return torch.tensor(vals, dtype=F32).to(dtype)


@FUZZ
@given(data=st.data(), hp=HYPER, step=st.integers(0, 2000),
       inv=st.one_of(st.none(), st.sampled_from([2.0 ** -16, 0.5, 1.0, 1.0 / 3.0])))
def test_adam_step_matches_float64_reference(data, hp, step, inv):
    pairs = data.draw(st.lists(st.sampled_from(PAIRS), min_size=0, max_size=4))
    params, grads, ms, vs, masters, steps, bufs = [], [], [], [], [], [], []
    for p_dt, g_dt in pairs:
        n = data.draw(st.integers(0, 40))
        master = data.draw(adam_values(n, F32))
        p, pbuf, poff = data.draw(placed(p_dt, n=n, special=False))
        p.copy_(master.to(p_dt))
        if p_dt == F32:
            master = p.clone()
        # The scaled gradient must stay finite in its dtype (fp16 tops out at 65504).
        hi = min(1e4, 6e4 * inv) if (g_dt == F16 and inv is not None) else 1e4
        g = data.draw(adam_values(n, g_dt, hi * 1e-8, hi))
        if inv is not None:
            g = (g.float() / inv).to(g_dt)  # a scaled gradient
        m = data.draw(adam_values(n, F32, 1e-4, 10.0))
        v = data.draw(adam_values(n, F32, 1e-4, 100.0, zero_ok=False)).abs()
        params.append(p)
        grads.append(g)
        ms.append(m)
        vs.append(v)
        masters.append(master.clone() if p_dt != F32 else torch.empty(0))
        steps.append(torch.full((), float(step)))
        bufs.append((pbuf, poff, pbuf.clone()))
    before = [(p.clone(), g.clone(), m.clone(), v.clone(), w.clone())
              for p, g, m, v, w in zip(params, grads, ms, vs, masters)]
    ops.adam_step_(params, grads, ms, vs, masters, steps,
                   inv_scale=None if inv is None else torch.full((), inv), **hp)
    for i, ((p0, g0, m0, v0, w0), (buf, off, b0)) in enumerate(zip(before, bufs)):
        p = params[i]
        assert_guards(buf, off, p.numel(), b0, "params[%d]" % i)
        assert steps[i].item() == step + 1
        if p.numel() == 0:
            continue
        low = p.dtype != F32
        start = w0 if low else p0
        ref_p, ref_m, ref_v, _ = adam_step_reference(
            start.double().numpy(), g0.double().numpy(), m0.double().numpy(),
            v0.double().numpy(), step, inv_scale=1.0 if inv is None else inv, **hp)
        got = (masters[i] if low else p).double().numpy()
        # fp32 arithmetic: an error relative to the size of the update, plus the rounding of
        # the result to fp32.
        upd = np.abs(ref_p - start.double().numpy())
        np.testing.assert_allclose(got, ref_p, rtol=2e-7, atol=1e-5 * upd.max() + 1e-30)
        np.testing.assert_allclose(ms[i].double().numpy(), ref_m, rtol=1e-5,
                                   atol=1e-6 * np.abs(ref_m).max() + 1e-30)
        np.testing.assert_allclose(vs[i].double().numpy(), ref_v, rtol=1e-5,
                                   atol=1e-6 * np.abs(ref_v).max() + 1e-30)
        if low:
            assert_bits(p, masters[i].to(p.dtype), "params[%d] = RNE(master)" % i)


@FUZZ
@given(data=st.data(), decoupled=st.booleans())
def test_adam_step_nonfinite_values_propagate_like_torch(data, decoupled):
    """NaN (any payload), +-Inf, huge and subnormal gradients: every element is non-finite
    exactly where torch.optim's fp32 step makes it so, and finite elements agree closely."""
    n = data.draw(st.integers(1, 60))
    g, _, _ = data.draw(placed(F32, n=n))
    p = data.draw(adam_values(n, F32))
    ours_p, m, v, s = p.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())
    ops.adam_step_([ours_p], [g], [m], [v], None, [s], lr=1e-2, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.01, decoupled=decoupled)
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    cls([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False).step()
    ref = ref.detach()
    assert torch.equal(torch.isnan(ours_p), torch.isnan(ref))
    assert torch.equal(torch.isinf(ours_p), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours_p[fin], ref[fin], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# grad_norm.


@FUZZ
@given(data=st.data(), inv=st.one_of(st.none(), INV_SCALES))
def test_grad_norm_matches_torch(data, inv):
    dtypes = data.draw(st.lists(st.sampled_from(FLOATS), min_size=0, max_size=5))
    placed_ts = [data.draw(placed(d)) for d in dtypes]
    ts = [t for t, _, _ in placed_ts]
    before = [b.clone() for _, b, _ in placed_ts]
    out = ops.grad_norm(ts, inv_scale=None if inv is None else torch.full((), inv))
    vals = [t.float() * (1.0 if inv is None else torch.full((), inv)) for t in ts]
    vals = [v.double() for v in vals] + [torch.zeros(0, dtype=torch.float64)]
    ref = torch.linalg.vector_norm(torch.cat(vals)).float()
    assert out.dtype == F32 and out.shape == ()
    if torch.isnan(ref):
        assert torch.isnan(out)
    else:
        torch.testing.assert_close(out, ref, rtol=3e-7, atol=0)
    for k, ((t, buf, off), b0) in enumerate(zip(placed_ts, before)):
        assert_bits(buf, b0, "tensors[%d] (read only)" % k)


# ---------------------------------------------------------------------------------------------
# Every CPU path gives the same bits: thread counts x ISA paths, for every op.

N_BIG = 3 * 65536 + 7  # several tasks of at::parallel_for (grain 65536), an odd tail


def _random_bits(n, dtype, gen):
    if dtype == F32:
        b = torch.randint(-(1 << 31), 1 << 31, (n,), generator=gen, dtype=torch.int64)
        return b.to(torch.int32).view(F32)
    b = torch.randint(-(1 << 15), 1 << 15, (n,), generator=gen, dtype=torch.int32)
    return b.to(torch.int16).view(dtype)


def _run_op(name, gen_seed):
    """Runs op `name` on fixed pseudo-random inputs; returns every output tensor."""
    gen = torch.Generator().manual_seed(gen_seed)
    if name in ("to_bf16", "to_fp16", "to_bf16_sr"):
        x = _random_bits(N_BIG, F32, gen)[1:]  # misaligned
        if name == "to_bf16_sr":
            return [ops.to_bf16(x, stochastic=True, seed=2 ** 63 + 5, offset=11)]
        return [(ops.to_bf16 if name == "to_bf16" else ops.to_fp16)(x)]
    if name == "to_fp32":
        return [ops.to_fp32(_random_bits(N_BIG, d, gen)[3:]) for d in (BF16, F16)]
    if name == "cast_":
        src = [_random_bits(n, d, gen) for n, d in ((70001, F32), (5, BF16), (N_BIG, F32),
                                                    (65536, F16), (3, F32))]
        dst = [torch.empty(70001, dtype=BF16), torch.empty(5), torch.empty(N_BIG, dtype=BF16),
               torch.empty(65536), torch.empty(3, dtype=F16)]
        out = []
        for stochastic in (False, True):
            d2 = [torch.empty_like(d) for d in dst] if stochastic else dst
            if stochastic:
                src2, d2 = src[:4], d2[:4]
            else:
                src2 = src
            ops.cast_(d2, src2, stochastic=stochastic, seed=9, offset=2 ** 40)
            out += d2
        return out
    if name == "unscale_":
        out = []
        for inv in (2.0 ** -10, 1.0, 3e38):
            grads = [_random_bits(n, d, gen) for n, d in ((N_BIG, F32), (70001, BF16),
                                                          (65537, F16), (1, F32))]
            found = torch.zeros(())
            ops.unscale_(grads, found, torch.full((), inv))
            out += grads + [found]
        return out
    if name == "update_scale_":
        s, t = torch.full((), 2.0 ** 120), torch.zeros((), dtype=torch.int32)
        h, stats = torch.full((), 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
        flags = torch.randint(0, 2, (64,), generator=gen).tolist()
        for f in flags:
            ops.update_scale_(s, t, torch.full((), float(f)), 2.0, 0.5, 3,
                              hysteresis_tracker=h, hysteresis=2, max_scale=2.0 ** 126,
                              stats=stats)
        return [s, t, h, stats]
    if name == "adam_step_":
        shapes = [(N_BIG, F32, F32), (70001, BF16, F32), (65537, F16, F16), (9, BF16, BF16)]
        params, grads, ms, vs, ws, steps = [], [], [], [], [], []
        for n, p_dt, g_dt in shapes:
            w = torch.randn(n, generator=gen)
            params.append(w.to(p_dt))
            ws.append(w if p_dt != F32 else torch.empty(0))
            grads.append((torch.randn(n, generator=gen) * 1e3).to(g_dt))
            ms.append(torch.randn(n, generator=gen))
            vs.append(torch.rand(n, generator=gen))
            steps.append(torch.full((), 5.0))
        grads[0][17] = float("nan")  # a NaN propagates the same way on every path
        ops.adam_step_(params, grads, ms, vs, ws, steps, lr=1e-3, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.1, decoupled=True,
                       inv_scale=torch.full((), 2.0 ** -10))
        return params + ws + ms + vs + steps
    if name == "grad_norm":
        ts = [torch.randn(n, generator=gen).to(d) for n, d in ((N_BIG, F32), (70001, BF16),
                                                               (65537, F16))]
        return [ops.grad_norm(ts), ops.grad_norm(ts, inv_scale=torch.full((), 3e-5)),
                ops.grad_norm(ts + [_random_bits(1000, F32, gen)])]
    raise AssertionError(name)


CPU_OPS = ["to_bf16", "to_bf16_sr", "to_fp16", "to_fp32", "cast_", "unscale_",
           "update_scale_", "adam_step_", "grad_norm"]
@pytest.mark.parametrize("name", CPU_OPS)
def test_every_cpu_path_gives_identical_bits(name, threads):
    """The same inputs under every (CPU ISA path, thread count): identical bits in every
    output, NaN payloads included."""
    isas = mpext.build_info()["cpu_isas_supported"]
    previous = mpext.cpu_isa()
    runs = {}
    try:
        for isa in isas:
            mpext.set_cpu_isa(isa)
            for nt in (1, 2, 3):
                torch.set_num_threads(nt)
                runs[(isa, nt)] = _run_op(name, 1234)
    finally:
        mpext.set_cpu_isa(previous)
    (first_key, first), *rest = runs.items()
    for key, outs in rest:
        assert len(outs) == len(first)
        for k, (a, b) in enumerate(zip(first, outs)):
            assert_bits(b, a, "%s output %d: %s vs %s" % (name, k, key, first_key))
