"""Independent pure-Python references used by the tests."""
import math
import struct

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Philox4x32-10 (Salmon et al., SC'11) on a 4-word counter and a 2-word key."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = M0 * c0
        p1 = M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, \
            ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0 = (k0 + W0) & MASK32
        k1 = (k1 + W1) & MASK32
    return c0, c1, c2, c3


def sr_random_bits(seed, position):
    """The documented stochastic-rounding stream: word position % 4 of Philox block
    position // 4, keyed by the 64-bit seed."""
    seed &= (1 << 64) - 1
    position &= (1 << 64) - 1  # positions wrap modulo 2^64
    block = position // 4
    out = philox4x32_10((block & MASK32, block >> 32, 0, 0), (seed & MASK32, seed >> 32))
    return out[position % 4]


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


def fp16_bits_to_float(h):
    """fp16 bits -> Python float via the struct module's IEEE binary16 decoder."""
    return struct.unpack("<e", struct.pack("<H", h))[0]


def bf16_bits_to_f32_bits(h):
    return np.asarray(h, dtype=np.uint32) << 16


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
    exp_avg_sq, step) out; step is the count before the step."""
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
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    m_hat = m / (1.0 - beta1 ** t)
    v_hat_sqrt = np.sqrt(v) / math.sqrt(1.0 - beta2 ** t)
    p = p - lr * m_hat / (v_hat_sqrt + eps)
    return p, m, v, t
