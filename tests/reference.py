"""Independent pure-Python references used by the tests."""
import math
import struct

import numpy as np

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
    2^64)."""
    position &= MASK64
    x = _m32((position & MASK32) ^ (key & MASK32))
    return _m32(x ^ (position >> 32) ^ (key >> 32))


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
