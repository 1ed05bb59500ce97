/* grad_norm (mpext/norm.h: mp_grad_norm_sumsq, mp_grad_norm_finish), on every ISA path this CPU
 * supports: the documented summation order restated over values multiplied in double and
 * rounded to fp32 (bit for bit on every path), accuracy against long double, NaN/Inf,
 * exact-size buffers at every offset. */
#include "test_common.h"

#include "mpext/norm.h"

/* ------------------------------------------------------------------------------------------ */
/* 11. grad_norm: mp_grad_norm_sumsq and mp_grad_norm_finish, per ISA path.
 *     Reference: each value decoded to double (fp32 exactly, bf16/fp16 by the field decoder),
 *     multiplied by inv_scale in double (exact) and rounded once to fp32 (= the fp32 product),
 *     squared in double (exact), and summed in the order norm.h documents (element i of each
 *     group of 16 into accumulator i, the tail into the first accumulators, a balanced tree at
 *     the end): every path must give these bits. The order itself is checked for accuracy
 *     against a long double sum. */
#define GN_LANES 16

static float gn_value(int dt, uint32_t x, float inv) {
  double v = dt == U_F32 ? (double)f32_of(x) : decode(x, u_fmt(dt));
  return (float)(v * (double)inv);
}

static double gn_ref(int dt, const void* x, int64_t n, float inv) {
  double lane[GN_LANES] = {0};
  int64_t full = n - n % GN_LANES;
  for (int64_t i = 0; i < n; ++i) {
    double y = (double)gn_value(dt, u_get(x, dt, i), inv);
    lane[i < full ? i % GN_LANES : i - full] += y * y;
  }
  double a[GN_LANES / 2], b[GN_LANES / 4];
  for (int j = 0; j < GN_LANES / 2; ++j) a[j] = lane[2 * j] + lane[2 * j + 1];
  for (int j = 0; j < GN_LANES / 4; ++j) b[j] = a[2 * j] + a[2 * j + 1];
  return (b[0] + b[1]) + (b[2] + b[3]);
}

/* The sum of squares to about the last bit: each square of an fp32 value is exact in double,
 * and the sum is compensated (Neumaier), so the result holds even where long double has only
 * double precision (valgrind computes x87 arithmetic in 64 bits). */
static long double gn_ref_long(int dt, const void* x, int64_t n, float inv) {
  long double s = 0, c = 0;
  for (int64_t i = 0; i < n; ++i) {
    long double y = gn_value(dt, u_get(x, dt, i), inv);
    long double sq = y * y, t = s + sq;
    c += fabsl(s) >= fabsl(sq) ? (s - t) + sq : (sq - t) + s;
    s = t;
  }
  return s + c;
}

static mp_status call_sumsq(int dt, const void* x, int64_t n, float inv, double* out) {
  return mp_grad_norm_sumsq(x, (mp_dtype)dt, n, inv, out);
}

static int same_double(double a, double b) {
  return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

static void test_grad_norm_arguments(void) {
  group g;
  g_begin(&g, "grad_norm: argument checks (n < 0, null out, null data with n > 0; n == 0 is 0)");
  float f = 1.0f;
  const uint16_t one16[3] = {0, 0x3F80u, 0x3C00u}; /* 1.0 as bf16, as fp16 */
  double out = -1.0, parts[2] = {4.0, 5.0};
  float norm = -1.0f;
  for (int dt = U_F32; dt <= U_FP16; ++dt) {
    const void* p = dt == U_F32 ? (const void*)&f : (const void*)&one16[dt];
    g_check(&g, call_sumsq(dt, p, -1, 1.0f, &out) == MP_ERR_INVALID_ARGUMENT, "%s n < 0",
            U_NAME[dt]);
    g_check(&g, call_sumsq(dt, p, 1, 1.0f, NULL) == MP_ERR_INVALID_ARGUMENT, "%s null out",
            U_NAME[dt]);
    g_check(&g, call_sumsq(dt, NULL, 1, 1.0f, &out) == MP_ERR_INVALID_ARGUMENT, "%s null x",
            U_NAME[dt]);
    out = -1.0;
    g_check(&g, call_sumsq(dt, NULL, 0, 1.0f, &out) == MP_OK && out == 0.0, "%s n == 0: %g",
            U_NAME[dt], out);
    g_check(&g, call_sumsq(dt, p, 1, 2.0f, &out) == MP_OK && out == 4.0, "%s one value: %g",
            U_NAME[dt], out);
  }
  g_check(&g, mp_grad_norm_finish(parts, -1, &norm) == MP_ERR_INVALID_ARGUMENT, "finish n < 0");
  g_check(&g, mp_grad_norm_finish(parts, 2, NULL) == MP_ERR_INVALID_ARGUMENT, "finish null out");
  g_check(&g, mp_grad_norm_finish(NULL, 2, &norm) == MP_ERR_INVALID_ARGUMENT,
          "finish null partials");
  g_check(&g, mp_grad_norm_finish(NULL, 0, &norm) == MP_OK && norm == 0.0f, "finish n == 0");
  g_check(&g, mp_grad_norm_finish(parts, 2, &norm) == MP_OK && norm == 3.0f, "sqrt(4 + 5): %g",
          (double)norm);
  g_end(&g);

  g_begin(&g, "grad_norm: finish sums left to right in double, rounds once; Inf, NaN, range");
  /* 1 + 2^-53 + 2^-53 is 1 left to right but 1 + 2^-52 right to left */
  double tiny[3] = {1.0, 0x1p-53, 0x1p-53};
  g_check(&g, mp_grad_norm_finish(tiny, 3, &norm) == MP_OK && norm == 1.0f, "order: %a",
          (double)norm);
  double big[2] = {0x1p254, 0x1p254}; /* sqrt = 2^127.5 < FLT_MAX */
  g_check(&g, mp_grad_norm_finish(big, 2, &norm) == MP_OK && norm == (float)sqrt(0x1p255),
          "2^255: %a", (double)norm);
  double over[1] = {0x1p257}; /* sqrt = 2^128.5: beyond fp32 */
  g_check(&g, mp_grad_norm_finish(over, 1, &norm) == MP_OK && isinf(norm) && norm > 0,
          "beyond fp32: %a", (double)norm);
  double inf_nan[3] = {1.0, INFINITY, NAN};
  g_check(&g, mp_grad_norm_finish(inf_nan, 2, &norm) == MP_OK && isinf(norm) && norm > 0,
          "Inf: %a", (double)norm);
  g_check(&g, mp_grad_norm_finish(inf_nan, 3, &norm) == MP_OK && isnan(norm), "NaN: %a",
          (double)norm);
  g_end(&g);
}

static void test_grad_norm(uint64_t seed0) {
  static const float invs[] = {1.0f, 0x1p-16f, 1.0f / 3.0f, 3.0f, 0x1p-100f, 0.0f, -0.5f};
  const int n_invs = (int)(sizeof invs / sizeof invs[0]);
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    uint64_t s = seed0 ^ 0x6E6F726Du; /* same inputs on every path */
    group g;
    /* exact-size buffers: ASan reports any read past the end */
    g_begin(&g, "grad_norm: n = 0..150 at offsets 0..17, exact-size buffers, NaN/Inf == "
            "documented order [%s]", nm);
    for (int dt = U_F32; dt <= U_FP16; ++dt) {
      for (int64_t n = 0; n <= 150; ++n) {
        for (int64_t off = 0; off <= 17; ++off) {
          size_t bytes = (size_t)(off + n) * u_size(dt);
          void* buf = xmalloc(bytes ? bytes : 1u);
          uint64_t r = splitmix64(&s);
          int mode = (int)(r % 4u); /* 0, 1: finite; 2: a lone NaN/Inf; 3: a NaN and an Inf */
          for (int64_t i = 0; i < off + n; ++i) u_put(buf, dt, i, u_random(&s, dt, 0));
          if (mode >= 2 && n > 0) u_put(buf, dt, off + (int64_t)((r >> 8) % (uint64_t)n),
                                        u_random(&s, dt, 1));
          if (mode == 3 && n > 0) u_put(buf, dt, off + (int64_t)((r >> 24) % (uint64_t)n),
                                        dt == U_F32 ? 0x7FC00000u : (dt == U_BF16 ? 0x7FC0u : 0x7E00u));
          const void* x = (const char*)buf + (size_t)off * u_size(dt);
          float inv = invs[(r >> 40) % (uint64_t)n_invs];
          double got = -1.0;
          mp_status st = call_sumsq(dt, x, n, inv, &got);
          double want = gn_ref(dt, x, n, inv);
          g_check(&g, st == MP_OK && same_double(got, want), "%s n %" PRId64 " offset %" PRId64
                  " mode %d inv %a: got %a, expected %a", U_NAME[dt], n, off, mode,
                  (double)inv, got, want);
          g_check(&g, !(got < 0.0), "%s n %" PRId64 ": negative sum %a", U_NAME[dt], n, got);
          free(buf);
        }
      }
    }
    g_end(&g);

    g_begin(&g, "grad_norm: all bf16/fp16 values x %d inv_scale == documented order, within "
            "1e-13 of long double [%s]", n_invs, nm);
    uint16_t* all = xmalloc(65536 * sizeof *all);
    for (int dt = U_BF16; dt <= U_FP16; ++dt) {
      uint32_t top = dt == U_BF16 ? 0x7F80u : 0x7C00u;
      int64_t m = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        if ((i & top) != top) all[m++] = (uint16_t)i;
      }
      for (int v = 0; v < n_invs; ++v) {
        double got = -1.0;
        g_check(&g, call_sumsq(dt, all, m, invs[v], &got) == MP_OK, "status");
        double want = gn_ref(dt, all, m, invs[v]);
        long double exact = gn_ref_long(dt, all, m, invs[v]);
        g_check(&g, same_double(got, want), "%s inv %a: got %a, expected %a", U_NAME[dt],
                (double)invs[v], got, want);
        /* An infinite sum (a value times inv_scale overflows fp32) is checked against the
         * documented order above; valgrind computes long double at double precision, so its
         * long double infinity is not to be relied on here. */
        g_check(&g, isinf(want) || fabsl((long double)got - exact) <= 1e-13L * exact,
                "%s inv %a: %a vs %La",
                U_NAME[dt], (double)invs[v], got, exact);
      }
      all[0] = (uint16_t)top; /* +Inf first: the sum is +Inf */
      double got = 0.0;
      call_sumsq(dt, all, m, 0.5f, &got);
      g_check(&g, isinf(got) && got > 0, "%s with +Inf: %a", U_NAME[dt], got);
      all[m - 1] = (uint16_t)(top | 0x8000u | 1u); /* and a NaN last: NaN */
      call_sumsq(dt, all, m, 0.5f, &got);
      g_check(&g, isnan(got), "%s with a NaN: %a", U_NAME[dt], got);
    }
    free(all);
    g_end(&g);
  }

  /* Large, same bits on every path, accurate against long double. */
  const int64_t BIG = ((int64_t)1 << 20) + 13;
  float* x = xmalloc((size_t)BIG * sizeof *x);
  uint64_t s = seed0 ^ 0xB16u;
  for (int64_t i = 0; i < BIG; ++i) {
    x[i] = (float)((double)(splitmix64(&s) >> 11) * 0x1p-53 - 0.5) * 1e30f; /* squares > fp32 */
  }
  double first = 0.0;
  group g;
  g_begin(&g, "grad_norm: fp32 n = %" PRId64 ", squares beyond fp32: same bits on every path, "
          "within 1e-13 of long double", BIG - 3);
  double want = gn_ref(U_F32, x + 3, BIG - 3, 0x1p-20f);
  long double exact = gn_ref_long(U_F32, x + 3, BIG - 3, 0x1p-20f);
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    double got = -1.0;
    double t0 = now_s();
    g_check(&g, mp_grad_norm_sumsq(x + 3, MP_F32, BIG - 3, 0x1p-20f, &got) == MP_OK, "status");
    printf("      grad_norm sumsq fp32 [%s]: %.3f ns/elt\n", mp_isa_name(g_isas[k]),
           1e9 * (now_s() - t0) / (double)(BIG - 3));
    if (k == 0) first = got;
    g_check(&g, same_double(got, first), "[%s] %a != [%s] %a", mp_isa_name(g_isas[k]), got,
            mp_isa_name(g_isas[0]), first);
    g_check(&g, same_double(got, want), "[%s] %a, documented order gives %a",
            mp_isa_name(g_isas[k]), got, want);
    g_check(&g, isfinite(got) && fabsl((long double)got - exact) <= 1e-13L * exact,
            "[%s] %a vs long double %La", mp_isa_name(g_isas[k]), got, exact);
  }
  g_end(&g);
  free(x);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_grad_norm_arguments();
  test_grad_norm(o->seed);
}
