"""Independent pure-Python references used by the tests."""
import math
import struct
from fractions import Fraction

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


def _m32(x):
    """The generator's 32-bit mixer (mpext/numerics.h's documentation)."""
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & MASK32
    x = ((x ^ (x >> 15)) * 0xD35A2D97) & MASK32
    return x ^ (x >> 15)


def _m64(z):
    """splitmix64's finalizer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def sr_key(seed, step=0, stream=0):
    """The key of the stochastic-rounding stream for (seed, step, stream)."""
    seed &= MASK64
    return _m64(_m64(_m64((seed + 0x9E3779B97F4A7C15) & MASK64) ^ step) ^ stream)


def sr_bits(key, position):
    """The 32 random bits at a position of the stream with this key (positions wrap modulo
    2^64): one round of the mixer over the position's low half and the window key, the key's
    low half xored with the mixer of its high half and the position's high half."""
    position &= MASK64
    window = (key & MASK32) ^ _m32((position >> 32) ^ (key >> 32))
    return _m32((position & MASK32) ^ window)


def sr_random_bits(seed, position):
    """The documented stochastic-rounding bits of a cast's element at stream position
    ``position`` under ``seed`` (the stream (seed, 0, 0))."""
    return sr_bits(sr_key(seed), position)


def bf16_sr_reference(x_bits, r):
    """Stochastic rounding of one fp32 bit pattern with 32 random bits r (low 16 used), written
    from the definition: keep the upper 16 bits, round the magnitude up iff the discarded low
    16 bits plus r's low 16 bits carry."""
    if (x_bits & 0x7FFFFFFF) > 0x7F800000:
        return None  # NaN: any NaN is accepted
    if (x_bits & 0x7FFFFFFF) == 0x7F800000:
        return x_bits >> 16
    low = x_bits & 0xFFFF
    up = 1 if low + (r & 0xFFFF) >= 0x10000 else 0
    return (x_bits >> 16) + up


def fp16_sr_reference(x_bits, r):
    """Stochastic rounding of one fp32 bit pattern to fp16 bits with 32 random bits r, written
    from the value-based definition with exact rationals: lo and hi the fp16 values around
    |x|, f = (|x| - lo) / (hi - lo), and |x| goes to hi iff floor(f * 2^32) + r >= 2^32 (so
    with probability f, to 32 bits). The sign is kept (a negative value that goes to 0 gives
    -0). Magnitudes >= 65504 (the largest fp16) and +-Inf round to nearest even, as a
    conversion does; NaN gives None (any NaN is accepted)."""
    x = struct.unpack("<f", struct.pack("<I", x_bits & MASK32))[0]
    if math.isnan(x):
        return None
    sign = 0x8000 if x_bits & 0x80000000 else 0
    a = abs(x)
    if a >= 65504.0:
        return sign | (0x7C00 if a >= 65520.0 else 0x7BFF)  # 65520 is halfway to "65536"
    lo_bits, hi_bits = 0, 0x7BFF  # largest fp16 <= a, by bisection over the ordered patterns
    while lo_bits < hi_bits:
        mid = (lo_bits + hi_bits + 1) // 2
        if fp16_bits_to_float(mid) <= a:
            lo_bits = mid
        else:
            hi_bits = mid - 1
    lo = Fraction(fp16_bits_to_float(lo_bits))
    hi = Fraction(fp16_bits_to_float(lo_bits + 1))
    f = (Fraction(a) - lo) / (hi - lo)
    up = math.floor(f * 2 ** 32) + (r & MASK32) >= 2 ** 32
    return sign | (lo_bits + (1 if up else 0))


def fp16_bits_to_float(h):
    """fp16 bits -> Python float via the struct module's IEEE binary16 decoder."""
    return struct.unpack("<e", struct.pack("<H", h))[0]


def bf16_bits_to_f32_bits(h):
    return np.asarray(h, dtype=np.uint32) << 16


# ---------------------------------------------------------------------------------------------
# Vectorised forms of the stochastic-rounding references above, for whole tensors (numpy). The
# scalar functions are the definitions; tests/test_lean_state.py checks these against them.


def _m32_array(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0xD35A2D97)
    return x ^ (x >> np.uint32(15))


def sr_bits_array(key, positions):
    """sr_bits(key, p) for every p of an integer array (values in [0, 2^64)): a uint32 array of
    its shape."""
    pos = np.asarray(positions, dtype=np.uint64)
    lo = (pos & np.uint64(MASK32)).astype(np.uint32)
    hi = (pos >> np.uint64(32)).astype(np.uint32)
    window = np.uint32(key & MASK32) ^ _m32_array(hi ^ np.uint32(key >> 32))
    return _m32_array(lo ^ window)


def bf16_sr_array(x_bits, r):
    """bf16_sr_reference over arrays: (uint16 bf16 bits, NaN mask); where the mask is set the
    bits are meaningless (any NaN is accepted)."""
    x = np.asarray(x_bits, dtype=np.uint32)
    r = np.asarray(r, dtype=np.uint32)
    mag = x & np.uint32(0x7FFFFFFF)
    nan = mag > np.uint32(0x7F800000)
    carry = ((x & np.uint32(0xFFFF)) + (r & np.uint32(0xFFFF))) >= np.uint32(0x10000)
    up = carry & (mag != np.uint32(0x7F800000))
    return ((x >> np.uint32(16)) + up.astype(np.uint32)).astype(np.uint16), nan


_FP16_VALUES = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)


def fp16_sr_array(x_bits, r):
    """fp16_sr_reference over arrays: (uint16 fp16 bits, NaN mask). In float64, which is exact
    here: |x| - lo is exact (Sterbenz: lo <= |x| < 2 lo, or lo = 0), hi - lo is a power of two,
    and floor(f * 2^32) + r < 2^33 is an integer."""
    x = np.asarray(x_bits, dtype=np.uint32)
    r = np.asarray(r, dtype=np.uint32).astype(np.float64)
    xf = x.view(np.float32)
    nan = np.isnan(xf)
    a = np.abs(np.where(nan, np.float32(0), xf)).astype(np.float64)
    top = len(_FP16_VALUES) - 1
    idx = np.clip(np.searchsorted(_FP16_VALUES, a, side="right") - 1, 0, top - 1)
    lo, hi = _FP16_VALUES[idx], _FP16_VALUES[idx + 1]
    with np.errstate(invalid="ignore"):
        f = (a - lo) / (hi - lo)
        up = np.floor(f * 2.0 ** 32) + r >= 2.0 ** 32
    out = (idx + up).astype(np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = np.abs(xf).astype(np.float16).view(np.uint16)  # numpy's cast: to nearest even
    out = np.where(a >= 65504.0, nearest, out)
    sign = ((x >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16)
    return out | sign, nan


# ---------------------------------------------------------------------------------------------
# The dynamic loss-scale rule (mpext.ops.update_scale_), written from its documentation.


def _f32(x):
    """Round a Python float (a double) to the nearest float32, overflowing to +-inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


class ScaleRuleModel:
    """A pure-Python model of the loss-scale rule and its counters.

    Default arguments give torch._amp_update_scale_; ``hysteresis`` (tolerance refilled by a
    clean step, back off only when it is down to 1), ``min_scale`` / ``max_scale`` (None =
    unbounded) and the statistics [skipped, consecutive overflows] are mpext's extensions."""

    def __init__(self, scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 hysteresis=1, min_scale=None, max_scale=None, tracker=0, hysteresis_left=None,
                 skipped=0, streak=0):
        self.scale = _f32(scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.tracker = tracker
        self.hysteresis_left = hysteresis if hysteresis_left is None else hysteresis_left
        self.skipped = skipped
        self.streak = streak

    def step(self, found_inf):
        if found_inf:
            self.skipped += 1
            self.streak += 1
            self.tracker = 0
            if self.hysteresis > 1 and self.hysteresis_left > 1:
                self.hysteresis_left -= 1  # tolerated: no back-off yet
                return
            new = _f32(self.scale * self.backoff_factor)
            if self.min_scale is not None and new < self.min_scale:
                new = min(self.scale, _f32(self.min_scale))
            self.scale = new
            return
        self.streak = 0
        self.hysteresis_left = self.hysteresis
        self.tracker += 1
        if self.tracker == self.growth_interval:
            self.tracker = 0
            new = _f32(self.scale * self.growth_factor)
            if self.max_scale is not None and new > self.max_scale:
                new = max(self.scale, _f32(self.max_scale))
            if math.isfinite(new):
                self.scale = new


# ---------------------------------------------------------------------------------------------
# One Adam / AdamW step (mpext.ops.adam_step_), in float64 from the published algorithm.


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                        weight_decay, decoupled, maximize, inv_scale=1.0):
    """One step of Adam (L2 weight decay added to the gradient) or AdamW (decoupled decay), in
    float64, from the algorithm as torch.optim documents it: bias-corrected moments, and eps
    added to sqrt(v_hat) = sqrt(v) / sqrt(1 - beta2^t). Arrays in, new (param, exp_avg,
    exp_avg_sq, step) out; step is the count before the step. exp_avg moves as torch's lerp
    moves it, toward the gradient with the weight 1 - beta1 as an fp32 number (and from the
    gradient's side with 1 - that weight, once it is 0.5 or more): with beta1 near 0, the exact
    weight would put m off by up to |g - m| * 2^-24, which for a large m and a small g is far more
    than the fp32 arithmetic's own error."""
    p = np.asarray(param, dtype=np.float64).copy()
    g = np.asarray(grad, dtype=np.float64) * float(inv_scale)
    m = np.asarray(exp_avg, dtype=np.float64)
    v = np.asarray(exp_avg_sq, dtype=np.float64)
    t = float(step) + 1.0
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    w = float(np.float32(1.0 - beta1))
    m = m + w * (g - m) if w < 0.5 else g - (g - m) * float(np.float32(1.0 - w))
    v = beta2 * v + (1.0 - beta2) * g * g
    m_hat = m / (1.0 - beta1 ** t)
    v_hat_sqrt = np.sqrt(v) / math.sqrt(1.0 - beta2 ** t)
    p = p - lr * m_hat / (v_hat_sqrt + eps)
    return p, m, v, t


def lerp_f32(a, b, w):
    """torch.lerp(a, b, w) as documented, each operation rounded to float32 (numpy)."""
    a = a.detach().cpu().numpy().astype(np.float32)
    b = b.detach().cpu().numpy().astype(np.float32)
    w = np.float32(w)
    d = np.subtract(b, a, dtype=np.float32)
    if w < 0.5:
        out = np.add(a, np.multiply(w, d, dtype=np.float32), dtype=np.float32)
    else:
        out = np.subtract(b, np.multiply(d, np.float32(np.float32(1) - w), dtype=np.float32),
                          dtype=np.float32)
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------------
# The 8-bit block code of the moments (docs/moments_8bit.md), restated from its definition: a
# code's magnitude is 2^(e-T) (1 + f/2^M) (or 2^(1-T) f/2^M for e = 0) times its block's
# reference 2^(E - 127), E the block absmax's exponent field rounded up to the code's precision
# (at least 2^ebits; 255 for a block that is not finite). "m" is exp_avg's signed code (int8),
# "v" exp_avg_sq's unsigned one (uint8). The scalar functions are the definitions; the array
# forms (checked against them in tests/test_moments_8bit.py) serve whole tensors.

Q8_FMT = {"m": (3, 4, True), "v": (4, 4, False)}  # exponent bits, mantissa bits, signed


def q8_code_values(kind):
    """Magnitude code -> value relative to the block reference, float64, by definition."""
    eb, mb, _ = Q8_FMT[kind]
    t = (1 << eb) - 1
    return np.array([math.ldexp(1 + f / 2 ** mb, e - t) if e else math.ldexp(f / 2 ** mb, 1 - t)
                     for e in range(1 << eb) for f in range(1 << mb)])


Q8_VALUES = {k: q8_code_values(k) for k in Q8_FMT}


def q8_ref_exp(kind, amax):
    """The reference exponent field of a block with float32 absmax amax (255: not finite)."""
    eb, mb, _ = Q8_FMT[kind]
    a = float(amax)
    if not math.isfinite(a):
        return 255
    field = 1 << eb
    if a > 0:
        fr, e = math.frexp(a)  # a = fr 2^e, fr in [0.5, 1)
        fe = e - 1 + 127
        if a > (2 - 2.0 ** -mb) * 2.0 ** (e - 1):
            fe += 1
        field = max(field, fe)
    return field


def q8_ref_decode(kind, code, ea):
    if ea >= 255:
        return np.float32("nan")
    _, _, signed = Q8_FMT[kind]
    mag = code & 0x7F if signed else code
    v = Q8_VALUES[kind][mag] * 2.0 ** (ea - 127)
    return np.float32(-v if signed and code & 0x80 else v)


def q8_ref_encode(kind, x, ea, r16, nearest):
    """The code of x in a block of exponent field ea: the nearest (ties to the even code), or
    stochastically up with the 16 random bits r16."""
    _, _, signed = Q8_FMT[kind]
    vals = Q8_VALUES[kind]
    ax = abs(float(x)) / 2.0 ** (ea - 127)
    lo = int(np.searchsorted(vals, ax, side="right")) - 1
    if lo >= len(vals) - 1 or vals[lo] == ax:
        c = min(lo, len(vals) - 1)
    else:
        dl, dh = ax - vals[lo], vals[lo + 1] - ax
        if nearest:
            c = lo + 1 if dh < dl or (dh == dl and lo % 2) else lo
        else:
            frac = dl / (vals[lo + 1] - vals[lo])
            c = lo + 1 if math.floor(frac * 65536) + r16 >= 65536 else lo
    if signed and math.copysign(1.0, float(x)) < 0:
        c |= 0x80
    return c


def q8_exp_array(kind, amax):
    """q8_ref_exp over a float32 array of block absmaxes: an int64 array."""
    eb, mb, _ = Q8_FMT[kind]
    a = np.asarray(amax, dtype=np.float32).astype(np.float64)
    finite = np.isfinite(a)
    a0 = np.where(finite, a, 0.0)
    fr, e = np.frexp(a0)
    fe = e.astype(np.int64) - 1 + 127
    fe = fe + (a0 > (2 - 2.0 ** -mb) * np.ldexp(1.0, e - 1))
    field = np.where(a0 > 0, np.maximum(fe, 1 << eb), 1 << eb)
    return np.where(finite, field, 255).astype(np.int64)


def q8_encode_array(kind, x, block):
    """The nearest codes (uint8 bit patterns, ties to the even code) and block scales (float32
    absmax) of a flat float32 array of finite values, blocks of ``block`` elements in order."""
    _, _, signed = Q8_FMT[kind]
    vals = Q8_VALUES[kind]
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    nb = -(-x.size // block)
    pad = np.zeros(nb * block, dtype=np.float32)
    pad[:x.size] = np.abs(x)
    scale = pad.reshape(nb, block).max(1) if nb else pad[:0]
    ea = np.repeat(q8_exp_array(kind, scale), block)[:x.size]
    assert (ea < 255).all(), "a block that is not finite"
    ax = np.abs(x.astype(np.float64)) / np.ldexp(1.0, ea - 127)
    lo = np.clip(np.searchsorted(vals, ax, side="right") - 1, 0, len(vals) - 1)
    hi = np.minimum(lo + 1, len(vals) - 1)
    dl, dh = ax - vals[lo], vals[hi] - ax
    up = (hi > lo) & ((dh < dl) | ((dh == dl) & (lo % 2 == 1)))
    code = np.where(up, hi, lo).astype(np.uint8)
    if signed:
        code |= np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return code, scale.astype(np.float32)


def q8_decode_array(kind, codes, scale, block):
    """The float32 values of flat uint8 code patterns with their blocks' float32 scales."""
    _, _, signed = Q8_FMT[kind]
    c = np.asarray(codes, dtype=np.uint8).reshape(-1).astype(np.int64)
    ea = np.repeat(q8_exp_array(kind, scale), block)[:c.size]
    v = Q8_VALUES[kind][c & 0x7F if signed else c] * np.ldexp(1.0, ea - 127)
    v = np.where(ea >= 255, np.nan, v)
    return (np.where(c >= 128, -v, v) if signed else v).astype(np.float32)


# ---- Bitwise comparison helpers shared by the cast, unscale, scaler and bad-input tests (one
# copy: test_cast, test_scale_ops, test_grad_scaler and test_bad_inputs each had their own).


def raw_bytes(t):
    """The bytes of t (NaN payloads included), as a 1-D uint8 tensor on the CPU; a sparse
    tensor's indices then values, coalesced."""
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce()
        return torch.cat([t.indices().reshape(-1).view(torch.uint8), raw_bytes(t.values())])
    return t.contiguous().reshape(-1).view(torch.uint8).cpu()


def snapshot(ts):
    return [t.clone() for t in ts]


def assert_unchanged(before, after):
    """Bitwise equality (NaN payloads included), tensor by tensor."""
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(raw_bytes(a.cpu()), raw_bytes(b.cpu())), "tensor %d changed" % i


def all_16bit(dtype, device="cpu"):
    """Every one of the 65,536 bit patterns of a 16-bit float dtype."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(
        dtype).to(device)


def assert_same_bits_or_both_nan(ours, ref, x):
    """ours == ref bit for bit wherever the input x is not NaN; NaN (any payload) wherever it
    is. x has as many elements as ours and ref, in any float dtype."""
    nan = torch.isnan(x.float()).cpu().reshape(-1)
    ours, ref = ours.cpu().reshape(-1), ref.cpu().reshape(-1)
    ib = {4: torch.int32, 2: torch.int16}[ours.element_size()]
    bad = (ours.view(ib) != ref.view(ib)) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        xi = x.reshape(-1)[i:i + 1].cpu()
        xb = {4: torch.int32, 2: torch.int16}[xi.element_size()]
        raise AssertionError("first mismatch at %d: x=%r (bits 0x%x), ours=%r (0x%x), ref=%r "
                             "(0x%x)" % (i, xi.item(), xi.view(xb).item() & 0xFFFFFFFF,
                                         ours[i].item(), ours.view(ib)[i].item() & 0xFFFFFFFF,
                                         ref[i].item(), ref.view(ib)[i].item() & 0xFFFFFFFF))
    assert torch.equal(torch.isnan(ours.float()), nan), "NaN where the input is not, or not " \
                                                         "where it is"


def assert_bits_or_both_nan(a, b, what=""):
    """Same dtype and shape; NaN at the same places (any payload: torch canonicalizes NaNs),
    bitwise equal everywhere else. Sparse tensors: the same indices, then their values."""
    if a.is_sparse:
        a, b = a.coalesce(), b.coalesce()
        assert torch.equal(a.indices(), b.indices()), what
        a, b = a.values(), b.values()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    a, b = a.detach(), b.detach()
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb), what
    ia = raw_bytes(a.masked_fill(na, 0)).view(-1, a.element_size())
    ib = raw_bytes(b.masked_fill(nb, 0)).view(-1, b.element_size())
    bad = (ia != ib).any(1)
    if bad.any():  # the first element that differs, by value and bits
        i = int(bad.nonzero()[0, 0])
        raise AssertionError("%s: first difference at %d: %r (0x%s) vs %r (0x%s)" % (
            what, i, a.reshape(-1)[i].item(), bytes(ia[i].flip(0).tolist()).hex(),
            b.reshape(-1)[i].item(), bytes(ib[i].flip(0).tolist()).hex()))
