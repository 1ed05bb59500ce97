/* Numerics both tiers share (mpext/numerics.h, mpext/step_common.h), against this file's and
 * test_common.h's own statements:
 *   - the counter-based generator of stochastic rounding (mp_sr_key, mp_sr_bits): keys and bits
 *     against the documented definition, at the 2^32 and 2^64 wraps and at random positions;
 *   - mp_sr_piece: the cut of a position range into 32-bit pieces the loops can count;
 *   - mp_pow_exact (the bias corrections' power): within one ulp of pow and powl. */
#include "test_common.h"

#include "mpext/step_common.h"

/* ------------------------------------------------------------------------------------------ */
/* 1. The random generator follows its documentation: keys and bits against this file's
 *    statement, at edge positions (the 2^32 and 2^64 wraps) and random ones. */
static void test_sr_generator(void) {
  group g;
  g_begin(&g, "mp_sr_key / mp_sr_bits follow the documented generator");
  uint64_t s = 12345;
  static const uint64_t edge_idx[] = {0u, 1u, 2u, 3u, 4u, 0xFFFFFFFFull, 0x100000000ull,
                                      0x3FFFFFFFFull, 0x400000000ull, 0x400000003ull,
                                      UINT64_MAX, UINT64_MAX - 3u};
  for (int k = 0; k < 20000; ++k) {
    const uint64_t seed = k < 12 ? (k % 2 ? UINT64_MAX : 0u) : splitmix64(&s);
    const uint64_t idx = k < 12 ? edge_idx[k] : splitmix64(&s) >> (k % 40);
    const uint64_t step = (uint64_t)k % 7u, stream = splitmix64(&s) >> (k % 50);
    const uint64_t key = mp_sr_key(seed, step, stream);
    g_check(&g, key == ref_key(seed, step, stream), "key of seed %016" PRIx64 " step %" PRIu64
            " stream %016" PRIx64 ": %016" PRIx64, seed, step, stream, key);
    const uint32_t want = ref_bits(key, idx), got = mp_sr_bits(key, idx);
    g_check(&g, want == got, "key %016" PRIx64 " idx %016" PRIx64 ": expected %08" PRIx32
            " got %08" PRIx32, key, idx, want, got);
  }
  g_end(&g);
}

/* 11g. The power in the bias corrections (mpext/step_common.h, mp_pow_exact): within one ulp of double of
 *      the library pow and of powl for whole t up to 2^20 (every t to 20,000, then sparser), 0
 *      and 1 handled, and equal to pow in all but a small fraction of cases; a t that is not a
 *      whole number is pow's. Both tiers run this same code. */
static void test_adam_pow(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x90Bu;
  group g;
  g_begin(&g, "step_common: mp_pow_exact within 1 ulp of pow and powl, equal to pow in > 99.9%%");
  double betas[64] = {0.9, 0.999, 0.99, 0.95, 0.5, 0.0, 0.3, 0.9999, 0.99999, 0.1};
  for (int i = 10; i < 64; ++i) betas[i] = (double)(splitmix64(&s) >> 11) * 0x1p-53;
  long total = 0, differ = 0;
  for (int i = 0; i < 64; ++i) {
    for (uint64_t t = 1; t <= (1u << 20); t += t < 20000 ? 1 : 1 + t / 64) {
      const double got = mp_pow_exact(betas[i], (double)t), lib = pow(betas[i], (double)t);
      const double ld = (double)powl((long double)betas[i], (long double)t);
      total++;
      if (got != lib) differ++;
      if (lib < 0x1p-1000) continue; /* subnormal powers: 1 - x == 1 either way */
      const double ulp = nextafter(lib, INFINITY) - lib;
      g_check(&g, fabs(got - lib) <= ulp && fabs(got - ld) <= ulp,
              "beta %a t %" PRIu64 ": %a, pow %a, powl %a", betas[i], t, got, lib, ld);
    }
  }
  g_check(&g, differ * 1000 < total, "mp_pow_exact differs from pow in %ld of %ld", differ, total);
  g_check(&g, mp_pow_exact(0.9, 2.5) == pow(0.9, 2.5) && mp_pow_exact(0.0, 1.0) == 0.0 &&
              mp_pow_exact(0.9, 1.0) == 0.9,
          "special cases");
  printf("      mp_pow_exact differs from pow in %ld of %ld (beta, t)\n", differ, total);
  g_end(&g);
}

/* The pieces mp_k_adam_step cuts a range into for its 32-bit loops: they tile the range, stay
 * in one 2^32 window of positions each and fit a 32-bit count -- a piece of 2^32 positions
 * would read as 0 in it and be skipped (the arrays of such a range cannot be allocated here,
 * so the cut itself is checked). */
static void test_sr_pieces(void) {
  group g;
  g_begin(&g, "positions cut into 32-bit pieces: tiled, one window each, counts < 2^32");
  const uint64_t w = (uint64_t)1 << 32;
  const struct { uint64_t pos; int64_t n; } cases[] = {
      {0, 1}, {0, (int64_t)w}, {0, (int64_t)w + 1}, {w, 3 * (int64_t)w + 7}, {w - 1, 2},
      {w - 400, 777}, {5, (int64_t)w}, {7 * w + 123, (int64_t)1 << 34}, {(uint64_t)1 << 62, 1}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
    uint64_t pos = cases[c].pos;
    int64_t n = cases[c].n, pieces = 0, covered = 0;
    int ok = 1;
    while (n > 0 && ok) {
      const int64_t k = mp_sr_piece(pos, n);
      ok = k >= 1 && k <= ((int64_t)1 << 31) && k <= n &&
           ((pos >> 32) == ((pos + (uint64_t)k - 1) >> 32)) && (uint32_t)k == (uint64_t)k;
      pos += (uint64_t)k;
      n -= k;
      covered += k;
      ++pieces;
    }
    g_check(&g, ok && covered == cases[c].n, "case %zu: a bad piece after %" PRId64 " pieces", c,
            pieces);
  }
  g_check(&g, mp_sr_piece(0, (int64_t)w + 1) == ((int64_t)1 << 31), "a whole window in halves");
  g_end(&g);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_sr_generator();
  test_sr_pieces();
  test_adam_pow(o->seed);
}
