"""Independent pure-Python references used by the tests."""
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
