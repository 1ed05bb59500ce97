/* Plain C tests of the gradient telemetry kernel (mpext/telemetry.h, csrc/core/telemetry.c).
 *
 * Built and run by tests/c/run.py beside test_core.c (ASan + UBSan in CI). On every ISA path this
 * CPU supports, mp_unscale_stats is compared with
 *   - mp_unscale (scale.h, tested on its own in test_core.c): the same bits in every gradient
 *     and the same found flag, on a copy of the same input;
 *   - a reference written here: each element decoded to double by a field decoder built on
 *     ldexp (independent of numerics.h), classified in double arithmetic (0; 0 < |v| < 2^emin;
 *     finite and 2|v| > the format's max; NaN/Inf), and the largest finite |v| times
 *     stat_inv_scale in double (exact: 24 x 24 bits), rounded once to float.
 * Inputs: random bit patterns with many specials (zeros, subnormals, the largest values, NaN,
 * Inf), sizes around the kernel's vector width and its 2^14-element blocks, offsets that leave
 * the data misaligned, accumulation into non-zero totals, inv_scale == 1 (nothing stored).
 * Options: --seed X, --isa NAME; other arguments are ignored (run.py passes test_core's).
 * Output: one line per check group; exit status 1 if anything failed. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpext/mpext.h"
#include "mpext/scale.h"
#include "mpext/telemetry.h"

static int g_failed = 0, g_passed = 0;
static long long g_bad = 0;
static const char* g_name = "";

static void begin(const char* name) {
  g_name = name;
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

/* ---- the reference ---- */

typedef struct fmtdesc {
  int bits, mant, ebits, bias;
} fmtdesc;
static const fmtdesc FMT[3] = {{32, 23, 8, 127}, {16, 7, 8, 127}, {16, 10, 5, 15}};

static int elem_bytes(int dtype) { return dtype == MP_F32 ? 4 : 2; }
static const char* dname(int dtype) { return dtype == MP_F32 ? "f32" : dtype == MP_BF16 ? "bf16" : "fp16"; }

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

/* value of a bit pattern; *nonfinite set for NaN/Inf */
static double decode(int dtype, uint32_t u, int* nonfinite) {
  const fmtdesc f = FMT[dtype];
  const uint32_t sign = u >> (f.bits - 1);
  const uint32_t e = (u >> f.mant) & ((1u << f.ebits) - 1u);
  const uint32_t m = u & ((1u << f.mant) - 1u);
  *nonfinite = e == (1u << f.ebits) - 1u;
  if (*nonfinite) return 0.0;
  double v = e == 0 ? ldexp((double)m, 1 - f.bias - f.mant)
                    : ldexp((double)(m | (1u << f.mant)), (int)e - f.bias - f.mant);
  return sign ? -v : v;
}

static double fmt_max(int dtype) {
  const fmtdesc f = FMT[dtype];
  return ldexp((double)((2u << f.mant) - 1u), ((1 << f.ebits) - 2) - f.bias - f.mant);
}

typedef struct ref_stats {
  int64_t count[4];
  double max_abs;
} ref_stats;

static ref_stats reference(const void* g, int dtype, int64_t n) {
  ref_stats r = {{0, 0, 0, 0}, 0.0};
  const double smallest_normal = ldexp(1.0, 1 - FMT[dtype].bias);
  const double max = fmt_max(dtype);
  for (int64_t i = 0; i < n; ++i) {
    int bad;
    const double v = fabs(decode(dtype, raw_at(g, dtype, i), &bad));
    if (bad) {
      r.count[3]++;
      continue;
    }
    if (v == 0.0) r.count[0]++;
    if (v > 0.0 && v < smallest_normal) r.count[1]++;
    if (v * 2.0 > max) r.count[2]++;
    if (v > r.max_abs) r.max_abs = v;
  }
  return r;
}

/* ---- inputs ---- */

static uint32_t random_bits(int dtype, int special_per_mille) {
  const fmtdesc f = FMT[dtype];
  const uint32_t mask = f.bits == 32 ? 0xFFFFFFFFu : 0xFFFFu;
  const uint32_t sign = (uint32_t)(next64() & 1u) << (f.bits - 1);
  const uint32_t expmask = ((1u << f.ebits) - 1u) << f.mant;
  const uint32_t mant = (uint32_t)next64() & ((1u << f.mant) - 1u);
  if ((int)(next64() % 1000) < special_per_mille) {
    switch (next64() % 8) {
      case 0: return sign;                                      /* +-0 */
      case 1: return sign | (mant ? mant : 1u);                 /* subnormal */
      case 2: return sign | expmask;                            /* +-Inf */
      case 3: return sign | expmask | (mant ? mant : 1u);       /* NaN */
      case 4: return sign | (expmask - (1u << f.mant)) | mant;  /* top binade: no headroom */
      case 5: return sign | (expmask - (2u << f.mant)) | mant;  /* the binade below it */
      case 6: return sign | (1u << f.mant) | mant;              /* smallest normal binade */
      default: return sign | ((1u << f.mant) - 1u);             /* largest subnormal */
    }
  }
  /* mixed magnitudes: a random exponent, mostly finite */
  const uint32_t e = (uint32_t)(next64() % ((1u << f.ebits) - 1u));
  return (sign | (e << f.mant) | mant) & mask;
}

static void fill(void* p, int dtype, int64_t n, int special) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = random_bits(dtype, special);
    if (dtype == MP_F32) {
      memcpy((char*)p + 4 * i, &u, 4);
    } else {
      const uint16_t h = (uint16_t)u;
      memcpy((char*)p + 2 * i, &h, 2);
    }
  }
}

/* ---- the checks ---- */

/* One call on n elements at byte offset `off` of a fresh buffer, stats starting from `start`:
 * compared with mp_unscale on a copy and with the reference. */
static void one_case(int dtype, int64_t n, unsigned off, float inv, float stat_inv, int special,
                     mp_grad_stats start) {
  const size_t bytes = (size_t)n * elem_bytes(dtype);
  char* a = malloc(bytes + 16);
  char* b = malloc(bytes + 16);
  void* ga = a + off;
  void* gb = b + off;
  fill(ga, dtype, n, special);
  memcpy(gb, ga, bytes);
  const ref_stats r = reference(ga, dtype, n);
  int32_t found_a = 0, found_b = 0;
  mp_grad_stats s = start;
  CHECK(mp_unscale_stats(ga, (mp_dtype)dtype, n, inv, stat_inv, &found_a, &s) == MP_OK,
        "status");
  CHECK(mp_unscale(gb, (mp_dtype)dtype, n, inv, &found_b) == MP_OK, "unscale status");
  CHECK(memcmp(ga, gb, bytes) == 0, "%s n=%" PRId64 " off=%u: gradients differ from mp_unscale",
        dname(dtype), n, off);
  CHECK(found_a == found_b, "%s n=%" PRId64 ": found %d, mp_unscale %d", dname(dtype), n,
        found_a, found_b);
  CHECK(found_a == (r.count[3] > 0), "%s n=%" PRId64 ": found %d, reference non-finite %" PRId64,
        dname(dtype), n, found_a, r.count[3]);
  for (int j = 0; j < 4; ++j) {
    CHECK(s.count[j] == start.count[j] + r.count[j],
          "%s n=%" PRId64 " off=%u: count[%d] = %" PRId64 ", want %" PRId64, dname(dtype), n, off,
          j, s.count[j], start.count[j] + r.count[j]);
  }
  const float want_here = (float)(r.max_abs * (double)stat_inv);
  const float want = want_here > start.max_abs ? want_here : start.max_abs;
  uint32_t gw, ww;
  memcpy(&gw, &s.max_abs, 4);
  memcpy(&ww, &want, 4);
  CHECK(gw == ww, "%s n=%" PRId64 ": max_abs %a, want %a", dname(dtype), n, (double)s.max_abs,
        (double)want);
  free(a);
  free(b);
}

static void test_path(const char* isa) {
  char name[96];
  const int64_t sizes[] = {1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 16383, 16384, 16385,
                           40000, 70001};
  const float invs[] = {0x1p-16f, 0.5f, 1.0f, 3.0f, 1e-41f, 1e30f};
  for (int dtype = 0; dtype < MP_DTYPE_COUNT; ++dtype) {
    snprintf(name, sizeof name, "[%s] unscale_stats %s: bits of mp_unscale, counts of the "
             "reference", isa, dname(dtype));
    begin(name);
    int c = 0;
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; ++k) {
      for (unsigned off = 0; off < 16; off += (unsigned)elem_bytes(dtype) * 3) {
        const float inv = invs[c % 6];
        /* stat_inv differs from inv on the check-only calls, as the fused-optimizer path uses */
        const float stat_inv = inv == 1.0f ? 0x1p-10f : inv;
        const int special = (int)(c % 3) == 0 ? 0 : (c % 3 == 1 ? 30 : 600);
        mp_grad_stats start = {{0, 0, 0, 0}, 0.0f};
        if (c % 4 == 3) start = (mp_grad_stats){{5, 6, 7, 8}, 1e30f};
        if (c % 4 == 2) start = (mp_grad_stats){{1, 0, 2, 0}, 1e-30f};
        one_case(dtype, sizes[k], off, inv, stat_inv, special, start);
        ++c;
      }
    }
    end();
  }
  snprintf(name, sizeof name, "[%s] unscale_stats: every fp16/bf16 bit pattern", isa);
  begin(name);
  for (int dtype = 1; dtype < MP_DTYPE_COUNT; ++dtype) {
    uint16_t* all = malloc(65536 * 2);
    for (uint32_t u = 0; u < 65536; ++u) all[u] = (uint16_t)u;
    const ref_stats r = reference(all, dtype, 65536);
    mp_grad_stats s = {{0, 0, 0, 0}, 0.0f};
    int32_t found = 0;
    CHECK(mp_unscale_stats(all, (mp_dtype)dtype, 65536, 1.0f, 1.0f, &found, &s) == MP_OK, "st");
    for (int j = 0; j < 4; ++j)
      CHECK(s.count[j] == r.count[j], "%s: count[%d] %" PRId64 " want %" PRId64, dname(dtype), j,
            s.count[j], r.count[j]);
    CHECK(s.max_abs == (float)r.max_abs && found == 1, "%s: max_abs %a", dname(dtype),
          (double)s.max_abs);
    free(all);
  }
  end();
}

static void test_arguments(void) {
  begin("unscale_stats: bad arguments change nothing");
  float g[4] = {1, 2, 3, 4};
  int32_t found = 0;
  mp_grad_stats s = {{0, 0, 0, 0}, 0.0f};
  CHECK(mp_unscale_stats(g, MP_F32, -1, 0.5f, 0.5f, &found, &s) == MP_ERR_INVALID_ARGUMENT, "n<0");
  CHECK(mp_unscale_stats(NULL, MP_F32, 4, 0.5f, 0.5f, &found, &s) == MP_ERR_INVALID_ARGUMENT,
        "g null");
  CHECK(mp_unscale_stats(g, MP_F32, 4, 0.5f, 0.5f, NULL, &s) == MP_ERR_INVALID_ARGUMENT,
        "found null");
  CHECK(mp_unscale_stats(g, MP_F32, 4, 0.5f, 0.5f, &found, NULL) == MP_ERR_INVALID_ARGUMENT,
        "stats null");
  CHECK(mp_unscale_stats(g, (mp_dtype)3, 4, 0.5f, 0.5f, &found, &s) == MP_ERR_INVALID_ARGUMENT,
        "dtype");
  CHECK(mp_unscale_stats(g, MP_I8, 4, 0.5f, 0.5f, &found, &s) == MP_ERR_INVALID_ARGUMENT, "i8");
  CHECK(g[0] == 1 && g[3] == 4 && found == 0 && s.count[0] == 0 && s.max_abs == 0.0f,
        "something was written");
  CHECK(mp_unscale_stats(NULL, MP_F32, 0, 0.5f, 0.5f, &found, &s) == MP_OK, "n == 0");
  end();
}

int main(int argc, char** argv) {
  uint64_t seed = 46;
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
  }
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
