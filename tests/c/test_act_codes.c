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
 *   restored = code * scale (code * bf16(scale) for bf16) rounded once to the output dtype by a
 *     rounding written on ldexp/nearbyint in double (exact for these products), decoded fields
 *     compared as values (a NaN only as NaN: its payload is not part of the code).
 * Inputs: random values over many magnitudes with zeros, subnormals, values far below a step,
 * exact ties, NaN and Inf; rows whose last block is short or whole, blocks of 1 to 1000, data at
 * odd offsets; every bf16 and fp16 bit pattern in blocks of two; bad arguments write nothing.
 * Options: --seed X, --isa NAME; other arguments are ignored (run.py passes test_core's).
 * Output: one line per check group; exit status 1 if anything failed. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpext/int8_block.h"
#include "mpext/mpext.h"

static int g_failed = 0, g_passed = 0;
static long long g_bad = 0;
static char g_name[160];

static void begin(const char* name) {
  snprintf(g_name, sizeof g_name, "%s", name);
  g_bad = 0;
}
static void end(void) {
  if (g_bad) {
    g_failed++;
    printf("FAIL  %s (%lld failures)\n", g_name, g_bad);
  } else {
    g_passed++;
    printf("PASS  %s\n", g_name);
  }
  fflush(stdout);
}
#define CHECK(cond, ...)                    \
  do {                                      \
    if (!(cond)) {                          \
      if (++g_bad <= 8) {                   \
        printf("    %s: ", g_name);         \
        printf(__VA_ARGS__);                \
        printf("\n");                       \
      }                                     \
    }                                       \
  } while (0)

static uint64_t rng_state;
static uint64_t next64(void) {
  uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double uniform(void) { return (double)(next64() >> 11) * 0x1p-53; }

static int elem_bytes(int dtype) { return dtype == MP_F32 ? 4 : 2; }
static const char* dname(int dtype) {
  return dtype == MP_F32 ? "f32" : dtype == MP_BF16 ? "bf16" : "fp16";
}

/* ---- formats, by their fields (independent of numerics.h) ---- */

typedef struct fmtdesc {
  int bits, mant, ebits, bias;
} fmtdesc;
static const fmtdesc FMT[3] = {{32, 23, 8, 127}, {16, 7, 8, 127}, {16, 10, 5, 15}};

static uint32_t raw_at(const void* p, int dtype, int64_t i) {
  if (dtype == MP_F32) {
    uint32_t u;
    memcpy(&u, (const char*)p + 4 * i, 4);
    return u;
  }
  uint16_t h;
  memcpy(&h, (const char*)p + 2 * i, 2);
  return h;
}

/* The value of a bit pattern; *nan set for NaN (Inf decodes as +-HUGE_VAL). */
static double decode(int dtype, uint32_t u, int* nan) {
  const fmtdesc f = FMT[dtype];
  const uint32_t sign = u >> (f.bits - 1);
  const uint32_t e = (u >> f.mant) & ((1u << f.ebits) - 1u);
  const uint32_t m = u & ((1u << f.mant) - 1u);
  *nan = e == (1u << f.ebits) - 1u && m != 0;
  double v = e == (1u << f.ebits) - 1u ? HUGE_VAL
             : e == 0 ? ldexp((double)m, 1 - f.bias - f.mant)
                      : ldexp((double)(m | (1u << f.mant)), (int)e - f.bias - f.mant);
  return sign ? -v : v;
}

/* v (exact in double) rounded to nearest even in dtype, as a double; overflow to +-Inf. */
static double round_to(int dtype, double v) {
  const fmtdesc f = FMT[dtype];
  if (v != v || v == 0.0 || isinf(v)) return v;
  int e;
  frexp(v, &e); /* |v| in [2^(e-1), 2^e) */
  const int emin = 1 - f.bias;
  const int q = (e - 1 > emin ? e - 1 : emin) - f.mant; /* the exponent of one ulp */
  const double r = ldexp(nearbyint(ldexp(v, -q)), q);
  const double max = ldexp((double)((2u << f.mant) - 1u), ((1 << f.ebits) - 2) - f.bias - f.mant);
  return fabs(r) > max ? copysign(HUGE_VAL, v) : r;
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
      const double r = isnan(v) ? v : round_to(dtype, (double)v);
      /* encode r: search the 16-bit patterns of its sign by decoding (exact, monotone) */
      uint32_t lo = 0, hi = dtype == MP_BF16 ? 0x7F80u : 0x7C00u; /* +0 .. +Inf */
      const double a = fabs(r);
      while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (decode(dtype, mid, &nan) < a) lo = mid + 1; else hi = mid;
      }
      uint16_t h = (uint16_t)(lo | (signbit(r) ? 0x8000u : 0u));
      if (isnan(v)) h = dtype == MP_BF16 ? 0x7FC1u : 0x7E01u;
      memcpy(buf + 2 * i, &h, 2);
      v = (float)decode(dtype, h, &nan);
      if (nan) v = NAN;
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
      int nan;
      const double got = decode(out, raw_at(o, out, i), &nan);
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
  char name[160];
  for (int dtype = MP_F32; dtype <= MP_F16; ++dtype) {
    for (int pow2 = 0; pow2 <= 1; ++pow2) {
      snprintf(name, sizeof name, "[%s] int8 block code %s pow2 %d: every shape vs the reference",
               isa, dname(dtype), pow2);
      begin(name);
      for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; ++k) {
        one_case(dtype, shapes[k][0], shapes[k][1], shapes[k][2], pow2, 30);
        one_case(dtype, shapes[k][0], shapes[k][1], shapes[k][2], pow2, 0); /* finite blocks */
      }
      end();
    }
  }
  /* quotients at and a few ulps around half-integers, under scales that are not powers of two:
   * where x * (1 / s) and x / s may round to different codes (the kernel then divides) */
  snprintf(name, sizeof name, "[%s] int8 block code: quotients near half-integers", isa);
  begin(name);
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
  end();
  /* every 16-bit pattern x next to a fixed partner, so each is both the absmax and a small
   * element of some block: blocks of two */
  for (int dtype = MP_BF16; dtype <= MP_F16; ++dtype) {
    snprintf(name, sizeof name, "[%s] int8 block code: every %s bit pattern", isa, dname(dtype));
    begin(name);
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
          int nan;
          float xs[16];
          for (int64_t j = 0; j < bl; ++j) {
            xs[j] = (float)decode(dtype, x[bl * k + j], &nan);
            if (nan) xs[j] = NAN;
          }
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
    end();
  }
}

/* Every ISA path gives the scalar path's bytes: codes, scales and restored values bit for bit,
 * NaN payloads included (the reference checks above compare a NaN only as NaN). */
static void test_paths_agree(const char* isa, mp_isa id) {
  static const int64_t shapes[][3] = {{40, 128, 128}, {5, 300, 128}, {7, 129, 64}, {3, 48, 16},
                                      {2, 300, 7}, {9, 256, 32}};
  char name[160];
  snprintf(name, sizeof name, "[%s] int8 block code: the scalar path's bits", isa);
  begin(name);
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
  end();
}

static void test_arguments(void) {
  begin("int8 block code: bad arguments are rejected and write nothing; empty is fine");
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
  end();
}

int main(int argc, char** argv) {
  uint64_t seed = 42;
  const char* only = NULL;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 0);
    else if (!strcmp(argv[i], "--isa") && i + 1 < argc) only = argv[++i];
  }
  rng_state = seed;
  test_arguments();
  for (int isa = 0; isa < MP_ISA_COUNT; ++isa) {
    const char* name = mp_isa_name((mp_isa)isa);
    if (only && strcmp(only, name)) continue;
    if (!mp_cpu_isa_supported((mp_isa)isa)) {
      printf("SKIP  [%s] not supported by this CPU (or not compiled in)\n", name);
      continue;
    }
    mp_cpu_isa_select((mp_isa)isa);
    test_path(name);
    if (isa != MP_ISA_SCALAR) test_paths_agree(name, (mp_isa)isa);
  }
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
