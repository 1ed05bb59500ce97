/* mpext: what every optimizer rule shares with the formats -- the rounding macros of one fp32
 * operation (CUDA intrinsics on the device, plain ISO C on the host, never contracted unless
 * written as MP_FFMA), the exact power of the bias corrections, a bf16 master's storage (the tie
 * rule, the remainder split and join), the 8-bit block codes and torch's lerp. Used by the rule
 * headers (mpext/rules/), the engine's storage (mpext/step_storage.h), the C core's codecs (csrc/core/formats.h) and
 * the CUDA kernels. Header-only; __host__ __device__ under nvcc. */
#ifndef MPEXT_STEP_COMMON_H
#define MPEXT_STEP_COMMON_H

#include <math.h>
#include <stdint.h>

#include "mpext/numerics.h" /* MP_HD */

#if defined(__CUDA_ARCH__)
#define MP_FADD(a, b) __fadd_rn((a), (b))
#define MP_FSUB(a, b) __fsub_rn((a), (b))
#define MP_FMUL(a, b) __fmul_rn((a), (b))
#define MP_FDIV(a, b) __fdiv_rn((a), (b))
#define MP_FSQRT(a) __fsqrt_rn(a)
#define MP_FFMA(a, b, c) __fmaf_rn((a), (b), (c))
#define MP_DFMA(a, b, c) __fma_rn((a), (b), (c))
#define MP_DADD(a, b) __dadd_rn((a), (b))
#define MP_DSUB(a, b) __dsub_rn((a), (b))
#define MP_DMUL(a, b) __dmul_rn((a), (b))
#define MP_DDIV(a, b) __ddiv_rn((a), (b))
#else
#define MP_FADD(a, b) ((a) + (b))
#define MP_FSUB(a, b) ((a) - (b))
#define MP_FMUL(a, b) ((a) * (b))
#define MP_FDIV(a, b) ((a) / (b))
#define MP_FSQRT(a) __builtin_sqrtf(a)
#define MP_FFMA(a, b, c) fmaf((a), (b), (c)) /* one rounding, as torch's add(alpha=) */
#define MP_DFMA(a, b, c) fma((a), (b), (c))
#define MP_DADD(a, b) ((a) + (b))
#define MP_DSUB(a, b) ((a) - (b))
#define MP_DMUL(a, b) ((a) * (b))
#define MP_DDIV(a, b) ((a) / (b))
#endif

/* (*h, *l) = (ah + al) * (bh + bl) in double-double: the product of the high parts exactly
 * (through a fused multiply-add), the cross terms added once. */
MP_HD void mp_dd_mul(double ah, double al, double bh, double bl, double* h, double* l) {
  const double p = MP_DMUL(ah, bh);
  const double e = MP_DADD(MP_DFMA(ah, bh, -p), MP_DADD(MP_DMUL(ah, bl), MP_DMUL(al, bh)));
  *h = MP_DADD(p, e);
  *l = MP_DSUB(e, MP_DSUB(*h, p));
}

/* beta^t for a step count t (a whole number, as torch's float step is), in double. Torch calls
 * the library pow, whose last bit differs between glibc and CUDA's libdevice; this computes the
 * power by squaring in double-double (relative error near 2^-100) and rounds it once, with the
 * same operations on both tiers, so CPU and CUDA agree bit for bit. It is the correctly rounded
 * double except where beta^t is subnormal (there 1 - beta^t == 1 whatever the last bits); glibc's
 * pow (documented within 0.52 ulp) differs from it in about 4 of 10,000 (beta, t), by one ulp
 * of double, which moves the fp32 scalars only when that ulp straddles an fp32 rounding
 * boundary. A t that is not a whole number in [1, 2^64) falls back to pow. */
MP_HD double mp_pow_exact(double beta, double t) {
  if (!(t >= 1.0 && t < 18446744073709551616.0 && t == (double)(uint64_t)t)) return pow(beta, t);
  uint64_t n = (uint64_t)t;
  double rh = 1.0, rl = 0.0, bh = beta, bl = 0.0;
  for (;;) {
    if (n & 1u) mp_dd_mul(rh, rl, bh, bl, &rh, &rl);
    n >>= 1;
    if (n == 0u) break;
    mp_dd_mul(bh, bl, bh, bl, &bh, &bl);
  }
  return MP_DADD(rh, rl);
}
/* ---- how the values are stored ---- */

/* A bf16 param's new fp32 master, as stored: a value exactly halfway between two bf16 values
 * above an even one (low half 0x8000 with bit 16 clear, not NaN/Inf) one ulp lower, so that it
 * still rounds to the same even param and its remainder fits 16 bits (see mp_step_tensor). */
MP_HD uint32_t mp_bf16_master_bits(uint32_t x) {
  const uint32_t tie_below_even = (x & 0x1FFFFu) == 0x8000u && (x & 0x7F800000u) != 0x7F800000u;
  return x - (tie_below_even ? 1u : 0u);
}

/* The remainder of master bits x (as stored) under its bf16 param p = mp_bf16_rne_bits(x): the
 * difference, in [-0x8000, 0x7FFF] for every stored master, and back. */
MP_HD uint16_t mp_bf16_remainder(uint32_t x, uint16_t p) {
  return (uint16_t)(x - ((uint32_t)p << 16));
}

MP_HD uint32_t mp_bf16_join(uint16_t p, uint16_t r) {
  return ((uint32_t)p << 16) + (uint32_t)(int32_t)(int16_t)r;
}

/* torch.lerp(a, b, w) in fp32, with rest = 1 - w and from_start = w < 0.5: torch's two forms,
 * chosen by the weight, each rounded as torch rounds it. */
MP_HD float mp_lerp(float a, float b, float w, float rest, int32_t from_start) {
  const float diff = MP_FSUB(b, a);
  return from_start ? MP_FADD(a, MP_FMUL(w, diff)) : MP_FSUB(b, MP_FMUL(diff, rest));
}

/* The moment formats' codecs shared by both tiers (the 8-bit block codes). */
#include "mpext/formats/q8.h"

#endif /* MPEXT_STEP_COMMON_H */
