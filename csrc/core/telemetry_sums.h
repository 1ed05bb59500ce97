/* Internal to the C core and its tests: how the counted fast rows (fast/adam_*.h) add the step
 * counters' error sums (mpext/telemetry.h's MP_STS_*_ERR / _ABS columns), and the bound that
 * follows for their distance from the counted pipeline's double sums and from a float64
 * reference (tests/c/test_fast_paths.c, tests/c/test_step_telemetry.c).
 *
 * A row adds each lane's terms (|stored - fp32| and |fp32| of a bf16 or 8-bit moment) in fp32,
 * MP_STS_RUN terms at most, then adds that partial sum into a double lane: widening every term
 * to double took 4 conversions and 4 double adds per 8 elements and moment, most of what a
 * counted bf16-moment row cost over its uncounted loop (docs/telemetry.md, "The step half").
 *
 * The bound. The terms are non-negative, so a sum's size S is the exact sum. Each term is formed
 * with at most one fp32 rounding (a bf16 moment's |stored - fp32| is exact in fp32; an 8-bit
 * one's may round once where a subnormal code lies far from its value), and a partial sum of
 * k <= K terms adds k - 1 roundings more: every term is off by at most gamma_K = K u / (1 - K u)
 * of itself, u = 2^-24, so the partials together by gamma_K S. The partials are exact in double
 * and their double sum, like the pipeline's sum of the n terms in double, is within
 * (n - 1) 2^-53 S of the exact sum of what it adds. So a row's sum and the pipeline's are within
 *     ((K + 1) 2^-24 + 2 (n + 1) 2^-53) S
 * of each other (gamma_16 < 17 2^-24), and a row's sum within the same of a float64 reference
 * whose own rounding is below 2 (n + 1) 2^-53 S. An fp32 partial sum overflows where a lane's
 * K terms add past 2^128: only for moments above 2^124 (|grad| above about 2^62, where the
 * pipeline's double sums stay finite); such a row's sum reads +Inf. */
#ifndef MPEXT_CORE_TELEMETRY_SUMS_H
#define MPEXT_CORE_TELEMETRY_SUMS_H

/* the most terms one fp32 lane adds before its partial sum goes into double */
#define MP_STS_RUN 16

/* The bound above, relative to S, for sums of n terms. */
static inline double mp_sts_row_sum_tol(double n) {
  return (MP_STS_RUN + 1) * 0x1p-24 + 2.0 * (n + 1.0) * 0x1p-53;
}

#endif /* MPEXT_CORE_TELEMETRY_SUMS_H */
