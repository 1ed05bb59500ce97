/* Plain C tests of the int8 block code of saved activations (mpext/int8_block.h,
 * csrc/core/int8_block.c).
 *
 * Built and run by tests/c/run.py beside the other tests/c files (ASan + UBSan in CI). On every
 * ISA path this CPU supports, mp_int8_block_quantize / _dequantize are compared bit for bit with
 * a reference written here from the spec (the torch-op code of mpext.activations_codes), in plain
 * scalar C with branches and libm, sharing no code with int8_block_rule.h:
 *   scale = max(fp32 absmax / 127, 2^-126), rounded up to a power of two by frexpf with pow2,
 *     NaN if the block holds a NaN, else Inf if it holds an Inf;
 *   code = clamp(nearbyintf(x / scale), -127, 127), the sign of x where that is 0 and x is not,
 *     0 where x / scale is NaN;
 *   restored = code * scale (code * bf16(scale) for bf16) rounded once to the output dtype by
 *     test_common.h's rounding in double (exact for these products), decoded fields compared as
 *     values (a NaN only as NaN: its payload is not part of the code).
 * Inputs: random values over many magnitudes with zeros, subnormals, values far below a step,
 * exact ties, NaN and Inf; rows whose last block is short or whole, blocks of 1 to 1000, data at
 * odd offsets; every bf16 and fp16 bit pattern in blocks of two; bad arguments write nothing.
 * Options and output: test_common.h's (main in test_common.c). */
#include "test_common.h"

#include "mpext/int8_block.h"

/* The current check group: the checks below report into it (test_common.h's bookkeeping). */
static group g_cur;
#define CHECK(cond, ...) g_check(&g_cur, (cond), __VA_ARGS__)

static uint64_t rng_state;
static uint64_t next64(void) { return splitmix64(&rng_state); }
static double uniform(void) { return (double)(next64() >> 11) * 0x1p-53; }

static int elem_bytes(int dtype) { return dtype == MP_F32 ? 4 : 2; }
static const char* dname(int dtype) { return U_NAME[dtype]; }

/* ---- formats, by their fields (test_common.h's decoder and rounding, not numerics.h) ---- */

/* The value of element i's bit pattern (NaN decodes to NAN, Inf to +-Inf); p may be at any
 * byte offset (the tests put the data at odd ones), hence memcpy. */
static double value_at(const void* p, int dtype, int64_t i) {
  uint32_t u = 0;
  uint16_t h;
  if (dtype == MP_F32) {
    memcpy(&u, (const char*)p + 4 * i, 4);
    return (double)f32_of(u);
  }
  memcpy(&h, (const char*)p + 2 * i, 2);
  return decode(h, u_fmt(dtype));
}

/* v (exact in double) rounded to nearest even in the 16-bit dtype, as a double; overflow to
 * +-Inf. */
static double round_to(int dtype, double v) {
  if (v != v || v == 0.0 || isinf(v)) return v;
  const double r = round_rne(fabs(v), u_fmt(dtype));
  return copysign(r > u_fmt(dtype)->max ? HUGE_VAL : r, v);
}

/* ---- the reference ---- */

static float ref_scale(const float* xs, int64_t n, int pow2) {
  int nan = 0, inf = 0;
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (isnan(xs[i])) nan = 1;
    else if (isinf(xs[i])) inf = 1;
    else if (fabsf(xs[i]) > amax) amax = fabsf(xs[i]);
  }
  if (nan) return NAN;
  if (inf) return INFINITY;
  float s = amax / 127.0f;
  if (s < 0x1p-126f) s = 0x1p-126f;
  if (pow2) {
    int e;
    const float m = frexpf(s, &e);
    if (m != 0.5f) s = ldexpf(1.0f, e);
  }
  return s;
}

static int ref_code(float x, float s) {
  const float y = x / s;
  if (isnan(y)) return 0;
  float r = nearbyintf(y);
  if (r > 127.0f) r = 127.0f;
  if (r < -127.0f) r = -127.0f;
  if (r == 0.0f && x != 0.0f && !isnan(x)) r = x > 0.0f ? 1.0f : -1.0f;
  return (int)r;
}

static double ref_restore(int code, float s, int dtype) {
  if (dtype == MP_BF16) {
    const double sb = round_to(MP_BF16, (double)s);
    return round_to(MP_BF16, (double)code * sb); /* exact: 8 x 8 bits */
  }
  const float p = (float)code * s; /* one fp32 rounding, then the output's */
  return dtype == MP_F32 ? (double)p : round_to(MP_F16, (double)p);
}

/* ---- inputs ---- */

static float random_value(int special_per_mille) {
  const uint64_t r = next64();
  if ((int)(r % 1000) < special_per_mille) {
    switch ((r >> 10) % 7) {
      case 0: return 0.0f;
      case 1: return -0.0f;
      case 2: return (r >> 20) & 1 ? INFINITY : -INFINITY;
      case 3: return NAN;
      case 4: return 0x1p-140f * (float)((r >> 20) % 1000); /* subnormal in fp32 */
      case 5: return 1e-9f;                                 /* far below a step */
      default: return 127.5f * 0x1p-20f;                    /* a tie if absmax is 2^-13 */
    }
  }
  /* Gaussian-ish values over a wide exponent range */
  const double g = uniform() + uniform() + uniform() - 1.5;
  return (float)ldexp(g, (int)(next64() % 60) - 30);
}

/* x as stored in dtype: its bits at byte offset off of buf, and the fp32 values in xs. */
static void fill(char* buf, int dtype, int64_t n, int special, float* xs) {
  for (int64_t i = 0; i < n; ++i) {
    float v = random_value(special);
    if (dtype == MP_F32) {
      memcpy(buf + 4 * i, &v, 4);
    } else {
      int nan;
      uint16_t h = (uint16_t)ref_rne(bits_of(v), u_fmt(dtype), &nan);
      if (nan) h = dtype == MP_BF16 ? 0x7FC1u : 0x7E01u;
      memcpy(buf + 2 * i, &h, 2);
      v = (float)value_at(buf, dtype, i);
    }
    xs[i] = v;
  }
}

/* ---- the checks ---- */

/* One call on rows x cols of dtype at odd offsets, against the reference, and each restoration. */
static void one_case(int dtype, int64_t rows, int64_t cols, int64_t block, int pow2, int special) {
  const int64_t n = rows * cols, nb = (cols + block - 1) / block;
  const unsigned off = (unsigned)(next64() % 7);
  char* xbuf = malloc((size_t)n * 4 + 16);
  char* qbuf = malloc((size_t)n + 16);
  char* sbuf = malloc((size_t)(rows * nb) * 4 + 16);
  float* xs = malloc((size_t)n * 4 + 4);
  char* x = xbuf + off * elem_bytes(dtype) / 2;
  int8_t* q = (int8_t*)(qbuf + off);
  float* s = (float*)(sbuf + 4);
  fill(x, dtype, n, special, xs);
  CHECK(mp_int8_block_quantize(x, (mp_dtype)dtype, q, s, rows, cols, block, pow2) == MP_OK,
        "status");
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t len = cols - b * block < block ? cols - b * block : block;
      const float want = ref_scale(xs + start, len, pow2);
      const float got = s[r * nb + b];
      CHECK(memcmp(&got, &want, 4) == 0 || (isnan(got) && isnan(want)),
            "%s %" PRId64 "x%" PRId64 "/%" PRId64 " pow2 %d: scale[%" PRId64 ",%" PRId64
            "] %a, want %a", dname(dtype), rows, cols, block, pow2, r, b, (double)got,
            (double)want);
      for (int64_t i = start; i < start + len; ++i) {
        const int wc = ref_code(xs[i], want);
        CHECK(q[i] == wc, "%s %" PRId64 "x%" PRId64 "/%" PRId64 " pow2 %d: code[%" PRId64
              "] of %a (scale %a) is %d, want %d", dname(dtype), rows, cols, block, pow2, i,
              (double)xs[i], (double)want, q[i], wc);
      }
    }
  }
  for (int out = MP_F32; out <= MP_F16; ++out) {
    char* obuf = malloc((size_t)n * 4 + 16);
    char* o = obuf + 2 * (off & 1);
    memset(obuf, 0xAB, (size_t)n * 4 + 16);
    CHECK(mp_int8_block_dequantize(q, s, o, (mp_dtype)out, rows, cols, block) == MP_OK,
          "dequantize status");
    for (int64_t i = 0; i < n; ++i) {
      const double want = ref_restore(q[i], s[(i / cols) * nb + (i % cols) / block], out);
      const double got = value_at(o, out, i);
      const int nan = isnan(got);
      CHECK(nan ? isnan(want) : (got == want && signbit(got) == signbit(want)),
            "%s -> %s %" PRId64 "x%" PRId64 "/%" PRId64 ": restored[%" PRId64 "] %a, want %a",
            dname(dtype), dname(out), rows, cols, block, i, nan ? NAN : got, want);
    }
    const unsigned char* tail = (const unsigned char*)o + n * elem_bytes(out);
    CHECK(tail[0] == 0xAB && tail[1] == 0xAB, "a store past the output");
    free(obuf);
  }
  free(xbuf);
  free(qbuf);
  free(sbuf);
  free(xs);
}

static void test_path(const char* isa) {
  static const int64_t shapes[][3] = {{1, 1, 1},    {3, 5, 2},     {2, 31, 32},  {4, 32, 32},
                                      {3, 33, 32},  {40, 128, 128}, {5, 300, 128}, {2, 300, 7},
                                      {1, 1000, 1000}, {7, 129, 64}, {2, 16, 128}};
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype) {
    for (int pow2 = 0; pow2 <= 1; ++pow2) {
      g_begin(&g_cur, "[%s] int8 block code %s pow2 %d: every shape vs the reference",
               isa, dname(dtype), pow2);
      for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; ++k) {
        one_case(dtype, shapes[k][0], shapes[k][1], shapes[k][2], pow2, 30);
        one_case(dtype, shapes[k][0], shapes[k][1], shapes[k][2], pow2, 0); /* finite blocks */
      }
      g_end(&g_cur);
    }
  }
  /* quotients at and a few ulps around half-integers, under scales that are not powers of two:
   * where x * (1 / s) and x / s may round to different codes (the kernel then divides) */
  g_begin(&g_cur, "[%s] int8 block code: quotients near half-integers", isa);
  {
    const int64_t block = 64, nblk = 4000;
    float* x = malloc((size_t)(block * nblk) * 4);
    int8_t* q = malloc((size_t)(block * nblk));
    float* s = malloc((size_t)nblk * 4);
    for (int64_t b = 0; b < nblk; ++b) {
      const float amax = (float)ldexp(1.0 + uniform(), (int)(next64() % 40) - 20);
      const float sc = ref_scale(&amax, 1, 0);
      x[b * block] = amax;
      for (int64_t i = 1; i < block; ++i) {
        const int k = (int)(next64() % 254) - 127;
        uint32_t u;
        float v = (float)((k + 0.5) * (double)sc);
        memcpy(&u, &v, 4);
        u += (uint32_t)((int)(next64() % 9) - 4); /* -4..4 ulps */
        memcpy(&v, &u, 4);
        x[b * block + i] = fabsf(v) <= amax ? v : 0.0f;
      }
    }
    CHECK(mp_int8_block_quantize(x, MP_F32, q, s, nblk, block, block, 0) == MP_OK, "status");
    for (int64_t b = 0; b < nblk; ++b) {
      const float want = ref_scale(x + b * block, block, 0);
      CHECK(s[b] == want, "block %" PRId64 ": scale %a, want %a", b, (double)s[b], (double)want);
      for (int64_t i = 0; i < block; ++i) {
        const int wc = ref_code(x[b * block + i], want);
        CHECK(q[b * block + i] == wc, "block %" PRId64 " element %" PRId64 ": x / s = %.9g "
              "coded %d, want %d", b, i, (double)(x[b * block + i] / want), q[b * block + i], wc);
      }
    }
    free(x);
    free(q);
    free(s);
  }
  g_end(&g_cur);
  /* every 16-bit pattern x next to a fixed partner, so each is both the absmax and a small
   * element of some block: blocks of two */
  for (int dtype = MP_BF16; dtype <= MP_F16; ++dtype) {
    g_begin(&g_cur, "[%s] int8 block code: every %s bit pattern", isa, dname(dtype));
    const int64_t n = 16 * 65536;
    uint16_t* x = malloc((size_t)n * 2);
    int8_t* q = malloc((size_t)n);
    float* s = malloc((size_t)65536 * 4);
    static const uint16_t partner[2][3] = {{0x3F80u, 0x0001u, 0x4B00u},  /* bf16 1, tiny, 2^23 */
                                           {0x3C00u, 0x0001u, 0x7BFFu}}; /* fp16 1, tiny, max */
    /* blocks of 2, and of 16 (a whole vector: the AVX-512 path's blocks), the pattern first */
    for (int64_t bl = 2; bl <= 16; bl += 14) {
      for (int p = 0; p < 3; ++p) {
        const int64_t m = 65536 * bl;
        for (int64_t k = 0; k < m; ++k) {
          x[k] = k % bl ? partner[dtype - MP_BF16][p] : (uint16_t)(k / bl);
        }
        CHECK(mp_int8_block_quantize(x, (mp_dtype)dtype, q, s, 1, m, bl, p == 2) == MP_OK,
              "status");
        for (int64_t k = 0; k < 65536; ++k) {
          float xs[16];
          for (int64_t j = 0; j < bl; ++j) xs[j] = (float)value_at(x, dtype, bl * k + j);
          const float want = ref_scale(xs, bl, p == 2);
          CHECK(memcmp(&s[k], &want, 4) == 0 || (isnan(s[k]) && isnan(want)),
                "pattern %04" PRIx64 " (blocks of %" PRId64 "): scale %a, want %a", k, bl,
                (double)s[k], (double)want);
          for (int64_t j = 0; j < bl; ++j) {
            CHECK(q[bl * k + j] == ref_code(xs[j], want), "pattern %04" PRIx64 " (blocks of %"
                  PRId64 ") element %" PRId64 ": code %d, want %d", k, bl, j, q[bl * k + j],
                  ref_code(xs[j], want));
          }
        }
      }
    }
    free(x);
    free(q);
    free(s);
    g_end(&g_cur);
  }
}

/* Every ISA path gives the scalar path's bytes: codes, scales and restored values bit for bit,
 * NaN payloads included (the reference checks above compare a NaN only as NaN). */
static void test_paths_agree(const char* isa, mp_isa id) {
  static const int64_t shapes[][3] = {{40, 128, 128}, {5, 300, 128}, {7, 129, 64}, {3, 48, 16},
                                      {2, 300, 7}, {9, 256, 32}};
  g_begin(&g_cur, "[%s] int8 block code: the scalar path's bits", isa);
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype) {
    for (int pow2 = 0; pow2 <= 1; ++pow2) {
      for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; ++k) {
        const int64_t rows = shapes[k][0], cols = shapes[k][1], block = shapes[k][2];
        const int64_t n = rows * cols, nb = (cols + block - 1) / block;
        char* x = malloc((size_t)n * 4);
        float* xs = malloc((size_t)n * 4);
        int8_t* q[2] = {malloc((size_t)n), malloc((size_t)n)};
        float* sc[2] = {malloc((size_t)(rows * nb) * 4), malloc((size_t)(rows * nb) * 4)};
        char* o[2] = {malloc((size_t)n * 4), malloc((size_t)n * 4)};
        fill(x, dtype, n, 30, xs);
        if (dtype == MP_F32) { /* NaNs of several payloads and both quiet bits, signed */
          static const uint32_t nans[] = {0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x7FA00000u,
                                          0xFFE12345u};
          for (int64_t i = 0; i < n; i += 97) memcpy(x + 4 * i, &nans[(i / 97) % 5], 4);
        }
        for (int run = 0; run < 2; ++run) {
          mp_cpu_isa_select(run ? id : MP_ISA_SCALAR);
          CHECK(mp_int8_block_quantize(x, (mp_dtype)dtype, q[run], sc[run], rows, cols, block,
                                       pow2) == MP_OK, "status");
        }
        CHECK(memcmp(q[0], q[1], (size_t)n) == 0, "%s %" PRId64 "x%" PRId64 "/%" PRId64
              " pow2 %d: codes differ from the scalar path's", dname(dtype), rows, cols, block,
              pow2);
        CHECK(memcmp(sc[0], sc[1], (size_t)(rows * nb) * 4) == 0, "%s %" PRId64 "x%" PRId64
              "/%" PRId64 " pow2 %d: scales differ from the scalar path's", dname(dtype), rows,
              cols, block, pow2);
        for (int out = MP_F32; out <= MP_F16; ++out) {
          for (int run = 0; run < 2; ++run) {
            mp_cpu_isa_select(run ? id : MP_ISA_SCALAR);
            CHECK(mp_int8_block_dequantize(q[0], sc[0], o[run], (mp_dtype)out, rows, cols,
                                           block) == MP_OK, "dequantize status");
          }
          CHECK(memcmp(o[0], o[1], (size_t)(n * elem_bytes(out))) == 0, "%s -> %s %" PRId64
                "x%" PRId64 "/%" PRId64 ": restored bits differ from the scalar path's",
                dname(dtype), dname(out), rows, cols, block);
        }
        free(x);
        free(xs);
        for (int j = 0; j < 2; ++j) {
          free(q[j]);
          free(sc[j]);
          free(o[j]);
        }
      }
    }
  }
  mp_cpu_isa_select(id);
  g_end(&g_cur);
}

static void test_arguments(void) {
  g_begin(&g_cur, "int8 block code: bad arguments are rejected and write nothing; empty is fine");
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, s[4] = {-1, -1, -1, -1}, o[8];
  int8_t q[8] = {9, 9, 9, 9, 9, 9, 9, 9};
  CHECK(mp_int8_block_quantize(x, MP_F32, q, s, -1, 4, 4, 0) == MP_ERR_INVALID_ARGUMENT, "rows");
  CHECK(mp_int8_block_quantize(x, MP_F32, q, s, 1, -4, 4, 0) == MP_ERR_INVALID_ARGUMENT, "cols");
  CHECK(mp_int8_block_quantize(x, MP_F32, q, s, 2, 4, 0, 0) == MP_ERR_INVALID_ARGUMENT, "block");
  CHECK(mp_int8_block_quantize(x, MP_I8, q, s, 2, 4, 4, 0) == MP_ERR_INVALID_ARGUMENT, "dtype");
  CHECK(mp_int8_block_quantize(NULL, MP_F32, q, s, 2, 4, 4, 0) == MP_ERR_INVALID_ARGUMENT, "x");
  CHECK(mp_int8_block_quantize(x, MP_F32, q, NULL, 2, 4, 4, 0) == MP_ERR_INVALID_ARGUMENT,
        "scales");
  CHECK(mp_int8_block_quantize(x, MP_F32, q, s, INT64_MAX / 2, 4, 4, 0) ==
            MP_ERR_INVALID_ARGUMENT, "rows * cols overflows");
  CHECK(mp_int8_block_dequantize(q, s, o, MP_U8, 2, 4, 4) == MP_ERR_INVALID_ARGUMENT, "dtype");
  CHECK(mp_int8_block_dequantize(q, s, NULL, MP_F32, 2, 4, 4) == MP_ERR_INVALID_ARGUMENT, "out");
  CHECK(mp_int8_block_dequantize(q, s, o, MP_F32, 2, 4, 0) == MP_ERR_INVALID_ARGUMENT, "block");
  for (int i = 0; i < 8; ++i) CHECK(q[i] == 9, "q[%d] written", i);
  for (int i = 0; i < 4; ++i) CHECK(s[i] == -1.0f, "scales[%d] written", i);
  CHECK(mp_int8_block_quantize(NULL, MP_BF16, NULL, NULL, 0, 4, 4, 0) == MP_OK, "no rows");
  CHECK(mp_int8_block_quantize(NULL, MP_F16, NULL, NULL, 3, 0, 4, 1) == MP_OK, "no cols");
  CHECK(mp_int8_block_dequantize(NULL, NULL, NULL, MP_F32, 0, 0, 1) == MP_OK, "empty");
  g_end(&g_cur);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  (void)initial_active;
  rng_state = o->seed;
  test_arguments();
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    test_path(mp_isa_name(g_isas[k]));
    if (g_isas[k] != MP_ISA_SCALAR) test_paths_agree(mp_isa_name(g_isas[k]), g_isas[k]);
  }
}
