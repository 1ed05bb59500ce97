/* Plain C tests of the telemetry kernels (mpext/telemetry.h, csrc/core/telemetry.c): the
 * gradient counters of mp_unscale_stats, and the optimizer step's of mp_step_stats (below,
 * "the step's counters").
 *
 * Built and run by tests/c/run.py beside the other tests/c files (ASan + UBSan in CI). On every
 * ISA path this CPU supports, mp_unscale_stats is compared with
 *   - mp_unscale (scale.h, tested on its own in test_scale.c): the same bits in every gradient
 *     and the same found flag, on a copy of the same input;
 *   - a reference written here: each element decoded to double by a field decoder built on
 *     ldexp (independent of numerics.h), classified in double arithmetic (0; 0 < |v| < 2^emin;
 *     finite and 2|v| > the format's max; NaN/Inf), and the largest finite |v| times
 *     stat_inv_scale in double (exact: 24 x 24 bits), rounded once to float.
 * Inputs: random bit patterns with many specials (zeros, subnormals, the largest values, NaN,
 * Inf), sizes around the kernel's vector width and its 2^14-element blocks, offsets that leave
 * the data misaligned, accumulation into non-zero totals, inv_scale == 1 (nothing stored).
 * Options: --seed X, --isa NAME; other arguments are ignored (run.py passes the others' sweep
 * options).
 * Output: one line per check group; exit status 1 if anything failed. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpext/mpext.h"
#include "mpext/scale.h"
#include "mpext/step_storage.h" /* mp_step_scalars_of: the q8 floor of the fp32 reference run */
#include "mpext/telemetry.h"
#include "telemetry_sums.h" /* MP_STS_RUN: the counted rows' fp32 runs */

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
static const char* dname(int dtype) {
  return dtype == MP_F32 ? "f32" : dtype == MP_BF16 ? "bf16" : "fp16";
}

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

/* ---- the step's counters (mp_step_stats) ----
 *
 * Every mode: each rule (Adam, Lion, SGD with and without momentum, Muon's two phases), every
 * param storage (fp32; bf16 with master, remainder, none to nearest, none stochastic; fp16 with
 * master, none to nearest, none stochastic), every moment format the rule keeps (fp32, bf16,
 * 8-bit codes), with and without an ema, fp32 or same-dtype grads, over two ranges. Per mode:
 *   - on/off: mp_step on one copy, mp_step_stats on another: every byte of every array equal;
 *   - counts: a reference computed here from the arrays before and after, and the fp32 values x
 *     the step rounded, taken from a third copy stepped with fp32 storage from the same decoded
 *     values (the rule's arithmetic is the same whatever the storage; what the counters count
 *     is the storage's rounding): the counts exact, the sums of errors to 1e-12 relative (the
 *     same terms in double, added in another order) on the scalar path, which counts through
 *     the pipeline; where the counted fast rows may count (AVX2, AVX-512), which add the terms
 *     in fp32 runs of MP_STS_RUN before double, to (MP_STS_RUN + 1) 2^-24 more
 *     (telemetry_sums.h derives it). The 8-bit codes are decoded here by ldexp, not by the
 *     kernel's codec. */

typedef struct sarr {
  void* param; void* grad; float* master; int16_t* rem; void* m; void* v;
  float* ms; float* vs; float* ema; float step;
} sarr;

static double ref_q8_decode(uint8_t c, float scale, int is_signed) {
  /* R = 2^(E - 127), E the scale's exponent field rounded up to 5 significant bits, >= 2^ebits */
  const uint32_t ebits = is_signed ? 3u : 4u, t = (1u << ebits) - 1u;
  uint32_t a;
  memcpy(&a, &scale, 4);
  a &= 0x7FFFFFFFu;
  uint32_t e = (a + ((1u << 19) - 1u)) >> 23;
  if (e < (1u << ebits)) e = 1u << ebits;
  if (e >= 255u) return NAN;
  const double r = ldexp(1.0, (int)e - 127);
  const uint32_t mag = is_signed ? (c & 0x7Fu) : c;
  const uint32_t ce = mag >> 4, f = mag & 15u;
  const double v = ce == 0 ? r * ldexp((double)f / 16.0, 1 - (int)t)
                           : r * ldexp(1.0 + (double)f / 16.0, (int)ce - (int)t);
  return is_signed && (c & 0x80u) ? -v : v;
}

static double ref_half_ulp(uint16_t h, int pd) {
  if (pd == MP_BF16) {
    int e = (h >> 7) & 0xFF;
    return ldexp(1.0, (e ? e : 1) - 127 - 8);
  }
  int e = (h >> 10) & 0x1F;
  return ldexp(1.0, (e ? e : 1) - 15 - 11);
}

static float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float widen16(uint16_t h, int pd) {
  int bad;
  return pd == MP_BF16 ? f32_of((uint32_t)h << 16) : (float)decode(MP_F16, h, &bad);
}
static float rnd_uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)((next64() >> 40) * 0x1p-24);
}

/* The fp32 value of param i as stored (kind: 0 fp32, 1 master, 2 remainder, 3/4 none). */
static float value_of(const sarr* a, int pd, int kind, int64_t i) {
  if (pd == MP_F32) return ((float*)a->param)[i];
  const uint16_t h = ((uint16_t*)a->param)[i];
  if (kind == 1) return a->master[i];
  if (kind == 2) return f32_of(((uint32_t)h << 16) + (uint32_t)(int32_t)a->rem[i]);
  return widen16(h, pd);
}

typedef struct smode {
  int rule; double b1, b2, wd; int nmom;
  int pd, gd, kind, mf; /* mf: 0 fp32, 1 bf16, 2 q8 (both moments) */
  int ema; float step;
} smode;

static const char* kind_name[5] = {"fp32", "master", "remainder", "rne", "sr"};
static const char* rule_name(int r) {
  return r == MP_RULE_ADAM ? "adam" : r == MP_RULE_LION ? "lion" : r == MP_RULE_SGD ? "sgd"
         : r == MP_RULE_MUON_MOMENTUM ? "muon_momentum" : "muon_update";
}

#define SN 1000   /* elements: two ranges, [0, 512) and [512, SN), and a short last 8-bit block */
#define SB 64     /* q8_block */

static size_t mbytes(int mf) { return mf == 0 ? 4 : mf == 1 ? 2 : 1; }

static void alloc_arrays(sarr* a, const smode* md) {
  memset(a, 0, sizeof *a);
  a->param = calloc(SN, 4);
  a->grad = calloc(SN, 4);
  if (md->kind == 1) a->master = calloc(SN, 4);
  if (md->kind == 2) a->rem = calloc(SN, 2);
  if (md->nmom >= 1) a->m = calloc(SN, 4);
  if (md->nmom >= 2) a->v = calloc(SN, 4);
  if (md->mf == 2) {
    a->ms = calloc(SN / SB + 1, 4);
    if (md->nmom >= 2) a->vs = calloc(SN / SB + 1, 4);
  }
  if (md->ema) a->ema = calloc(SN, 4);
}
static void free_arrays(sarr* a) {
  free(a->param); free(a->grad); free(a->master); free(a->rem); free(a->m); free(a->v);
  free(a->ms); free(a->vs); free(a->ema);
}
static void copy_arrays(sarr* d, const sarr* s, const smode* md) {
  const size_t pb = elem_bytes(md->pd), gb = elem_bytes(md->gd), nb = SN / SB + 1;
  memcpy(d->param, s->param, SN * pb);
  memcpy(d->grad, s->grad, SN * gb);
  if (s->master) memcpy(d->master, s->master, SN * 4);
  if (s->rem) memcpy(d->rem, s->rem, SN * 2);
  if (s->m) memcpy(d->m, s->m, SN * mbytes(md->mf));
  if (s->v) memcpy(d->v, s->v, SN * mbytes(md->mf));
  if (s->ms) memcpy(d->ms, s->ms, nb * 4);
  if (s->vs) memcpy(d->vs, s->vs, nb * 4);
  if (s->ema) memcpy(d->ema, s->ema, SN * 4);
  d->step = s->step;
}
static int same_arrays(const sarr* a, const sarr* b, const smode* md) {
  const size_t pb = elem_bytes(md->pd), gb = elem_bytes(md->gd), nb = (SN + SB - 1) / SB;
  int ok = !memcmp(a->param, b->param, SN * pb) && !memcmp(a->grad, b->grad, SN * gb);
  if (a->master) ok &= !memcmp(a->master, b->master, SN * 4);
  if (a->rem) ok &= !memcmp(a->rem, b->rem, SN * 2);
  if (a->m) ok &= !memcmp(a->m, b->m, SN * mbytes(md->mf));
  if (a->v) ok &= !memcmp(a->v, b->v, SN * mbytes(md->mf));
  if (a->ms) ok &= !memcmp(a->ms, b->ms, nb * 4);
  if (a->vs) ok &= !memcmp(a->vs, b->vs, nb * 4);
  if (a->ema) ok &= !memcmp(a->ema, b->ema, SN * 4);
  return ok && a->step == b->step;
}

static mp_step_tensor tensor_of(sarr* a, const smode* md, uint64_t stream) {
  mp_step_tensor t;
  memset(&t, 0, sizeof t);
  t.param = a->param; t.param_dtype = md->pd; t.grad = a->grad; t.grad_dtype = md->gd;
  t.master = a->master; t.remainder = a->rem; t.exp_avg = a->m; t.exp_avg_sq = a->v;
  t.step = &a->step; t.n = SN; t.sr_stream = stream; t.ema = a->ema; t.offset = 0;
  const int fmt = md->mf == 0 ? MP_FMT_F32 : md->mf == 1 ? MP_FMT_BF16 : MP_FMT_Q8S;
  t.exp_avg_format = fmt;
  t.exp_avg_sq_format = md->mf == 2 ? MP_FMT_Q8U : fmt;
  t.exp_avg_scale = a->ms; t.exp_avg_sq_scale = a->vs;
  return t;
}

static void fill_step(sarr* a, const smode* md) {
  for (int64_t i = 0; i < SN; ++i) {
    /* magnitudes from 2^-3 to 2^3: updates of lr 1e-3 land on both sides of half an ulp */
    const float x = ldexpf(rnd_uniform(1.0f, 2.0f), (int)(next64() % 7) - 3) *
                    ((next64() & 1) ? -1.0f : 1.0f);
    const float g = (next64() % 16 == 0) ? 0.0f : rnd_uniform(-1.0f, 1.0f);
    if (md->pd == MP_F32) {
      ((float*)a->param)[i] = x;
    } else {
      const uint16_t h = md->pd == MP_BF16 ? (uint16_t)(bits_of(x) >> 16)
                                            : (uint16_t)0; /* set below */
      if (md->pd == MP_BF16) ((uint16_t*)a->param)[i] = h;
      else {
        /* fp16 by rounding through the decoder: the nearest of a few candidates is enough */
        uint16_t best = 0; double bd = 1e30; int bad;
        const uint32_t u = bits_of(x);
        const int e = (int)((u >> 23) & 0xFF) - 127 + 15;
        const uint16_t c =
            (uint16_t)(((u >> 31) << 15) | ((uint32_t)e << 10) | ((u >> 13) & 0x3FF));
        for (int d = -1; d <= 1; ++d) {
          const double dv = fabs(decode(MP_F16, (uint16_t)(c + d), &bad) - x);
          if (!bad && dv < bd) { bd = dv; best = (uint16_t)(c + d); }
        }
        ((uint16_t*)a->param)[i] = best;
      }
      if (md->kind == 1) a->master[i] = x;
      if (md->kind == 2) a->rem[i] = (int16_t)(next64() & 0xFFFF) / 2; /* |r| < 2^14 */
    }
    if (md->gd == MP_F32) ((float*)a->grad)[i] = g;
    else if (md->gd == MP_BF16) ((uint16_t*)a->grad)[i] = (uint16_t)(bits_of(g) >> 16);
    else ((uint16_t*)a->grad)[i] = (uint16_t)(g == 0.0f ? 0 : 0x2E00u | (next64() & 0x81FFu));
    const float mv = rnd_uniform(-0.1f, 0.1f), vv = rnd_uniform(1e-6f, 1e-2f);
    if (md->nmom >= 1) {
      if (md->mf == 0) ((float*)a->m)[i] = mv;
      else if (md->mf == 1) ((uint16_t*)a->m)[i] = (uint16_t)(bits_of(mv) >> 16);
      else ((uint8_t*)a->m)[i] = (uint8_t)next64();
    }
    if (md->nmom >= 2) {
      if (md->mf == 0) ((float*)a->v)[i] = vv;
      else if (md->mf == 1) ((uint16_t*)a->v)[i] = (uint16_t)(bits_of(vv) >> 16);
      else ((uint8_t*)a->v)[i] = (uint8_t)next64();
    }
    if (md->ema) a->ema[i] = x + rnd_uniform(-0.01f, 0.01f);
  }
  if (md->mf == 2) {
    for (int64_t k = 0; k < (SN + SB - 1) / SB; ++k) {
      a->ms[k] = rnd_uniform(0.01f, 0.2f);
      if (a->vs) a->vs[k] = rnd_uniform(1e-4f, 1e-2f);
    }
  }
  a->step = md->step;
}

static mp_step_options options_of(const smode* md, const float* inv, int sr) {
  mp_step_options o;
  memset(&o, 0, sizeof o);
  o.rule = md->rule; o.beta1 = md->b1; o.beta2 = md->b2; o.eps = 1e-8; o.weight_decay = md->wd;
  o.decoupled = md->rule != MP_RULE_SGD; o.lr_value = 1e-3f; o.inv_scale = inv;
  o.unscale_grads = inv != NULL; o.sr_params = sr; o.seed = 1234; o.q8_block = SB;
  o.ema_decay = 0.9;
  return o;
}

/* The fp32 copy: fp32 param at the old value, fp32 grads, fp32 moments at their decoded values
 * (8-bit: with the second moment's floor, as the step decodes it), no master. */
static void fp32_copy(sarr* c, const sarr* a, const smode* md, const mp_step_options* o) {
  memset(c, 0, sizeof *c);
  c->param = calloc(SN, 4); c->grad = calloc(SN, 4);
  if (md->nmom >= 1) c->m = calloc(SN, 4);
  if (md->nmom >= 2) c->v = calloc(SN, 4);
  if (md->ema) c->ema = calloc(SN, 4);
  const mp_step_scalars sc = mp_step_scalars_of(o, a->step, 1.0f, 0);
  for (int64_t i = 0; i < SN; ++i) {
    int bad;
    ((float*)c->param)[i] = value_of(a, md->pd, md->kind, i);
    ((float*)c->grad)[i] = md->gd == MP_F32 ? ((float*)a->grad)[i]
                           : (float)decode(md->gd, ((uint16_t*)a->grad)[i], &bad);
    float m = 0, v = 0;
    if (md->nmom >= 1) {
      m = md->mf == 0 ? ((float*)a->m)[i] : md->mf == 1 ? widen16(((uint16_t*)a->m)[i], MP_BF16)
          : (float)ref_q8_decode(((uint8_t*)a->m)[i], a->ms[i / SB], 1);
      ((float*)c->m)[i] = m;
    }
    if (md->nmom >= 2) {
      v = md->mf == 0 ? ((float*)a->v)[i] : md->mf == 1 ? widen16(((uint16_t*)a->v)[i], MP_BF16)
          : (float)ref_q8_decode(((uint8_t*)a->v)[i], a->vs[i / SB], 0);
      if (md->mf == 2) v = mp_step_q8_floor_v(m, v, &sc);
      ((float*)c->v)[i] = v;
    }
    if (md->ema) c->ema[i] = a->ema[i];
  }
  c->step = a->step;
}

/* The reference counters of one step from the arrays before (a0) and after (a1), the fp32
 * copy after (c1). */
static void ref_counts(const sarr* a0, const sarr* a1, const sarr* c1, const smode* md,
                       double* row) {
  memset(row, 0, MP_STS_NCOLS * sizeof(double));
  row[MP_STS_ELEMS] = SN;
  const int free16 = md->pd != MP_F32 && md->kind >= 3;
  for (int64_t i = 0; i < SN; ++i) {
    /* x: the master as stored, or the fp32 result before rounding */
    const float x = md->pd == MP_F32 ? ((float*)a1->param)[i]
                    : free16 ? ((float*)c1->param)[i] : value_of(a1, md->pd, md->kind, i);
    if (md->pd != MP_F32) {
      const float old = value_of(a0, md->pd, md->kind, i);
      const uint16_t q0 = ((uint16_t*)a0->param)[i], q1 = ((uint16_t*)a1->param)[i];
      const int changed = !(x == old);
      row[MP_STS_CHANGED] += changed;
      row[MP_STS_UNMOVED] += changed && q0 == q1;
      if (free16) {
        row[MP_STS_SUBHALF] += changed && fabs((double)x - (double)old) < ref_half_ulp(q0, md->pd);
      }
    }
    if (md->mf == 1) {
      const float xm = ((float*)c1->m)[i];
      row[MP_STS_M_ERR] += fabs((double)widen16(((uint16_t*)a1->m)[i], MP_BF16) - (double)xm);
      row[MP_STS_M_ABS] += fabs((double)xm);
      if (md->nmom >= 2) {
        const float xv = ((float*)c1->v)[i];
        row[MP_STS_V_ERR] += fabs((double)widen16(((uint16_t*)a1->v)[i], MP_BF16) - (double)xv);
        row[MP_STS_V_ABS] += fabs((double)xv);
      }
    }
    if (md->ema) {
      row[MP_STS_EMA_LAG] += fabs((double)a1->ema[i] - (double)x);
      row[MP_STS_EMA_ABS] += fabs((double)x);
    }
  }
  if (md->mf == 2) {
    for (int64_t k = 0; k * SB < SN; ++k) {
      int sat = 0;
      for (int mom = 0; mom < md->nmom; ++mom) {
        const float scale = mom == 0 ? a1->ms[k] : a1->vs[k];
        if (!isfinite(scale)) sat = 1;
        for (int64_t i = k * SB; i < SN && i < (k + 1) * SB; ++i) {
          const uint8_t c = ((uint8_t*)(mom == 0 ? a1->m : a1->v))[i];
          const float xv = ((float*)(mom == 0 ? c1->m : c1->v))[i];
          row[mom == 0 ? MP_STS_M_ERR : MP_STS_V_ERR] +=
              fabs(ref_q8_decode(c, scale, mom == 0) - (double)xv);
          row[mom == 0 ? MP_STS_M_ABS : MP_STS_V_ABS] += fabs((double)xv);
          if (xv != 0.0f && (c & (mom == 0 ? 0x7Fu : 0xFFu)) == 0u) {
            row[MP_STS_Q8_FLUSHED] += 1;
            sat = 1;
          }
        }
      }
      row[MP_STS_Q8_BLOCKS] += 1;
      row[MP_STS_Q8_SATBLOCKS] += sat;
    }
  }
}

static const char* col_name[MP_STS_NCOLS] = {
    "elems", "changed", "unmoved", "subhalf", "m_err", "m_abs", "v_err", "v_abs",
    "q8_flushed", "q8_satblocks", "q8_blocks", "ema_lag", "ema_abs"};

static int g_nonzero[MP_STS_NCOLS]; /* columns some mode counted above zero (the test can fail) */
static int g_row_sums; /* the path has counted fast rows: their sums' fp32 runs (see above) */

static void step_case(const smode* md, int split, float inv) {
  const float* invp = inv != 1.0f ? &inv : NULL;
  const int sr = md->kind == 4;
  const mp_step_options o = options_of(md, invp, sr);
  sarr a0, a, b, c;
  alloc_arrays(&a0, md); alloc_arrays(&a, md); alloc_arrays(&b, md);
  fill_step(&a0, md);
  copy_arrays(&a, &a0, md);
  copy_arrays(&b, &a0, md);
  fp32_copy(&c, &a0, md, &o);
  smode cm = *md;
  cm.pd = MP_F32; cm.gd = MP_F32; cm.kind = 0; cm.mf = 0;
  mp_step_tensor ta = tensor_of(&a, md, 7), tb = tensor_of(&b, md, 7), tc = tensor_of(&c, &cm, 7);
  double row[MP_STS_NCOLS] = {0};
  int ok = 1;
  if (split) {
    ok &= mp_step(&ta, 0, 512, &o) == MP_OK && mp_step(&ta, 512, SN - 512, &o) == MP_OK;
    ok &= mp_step_stats(&tb, 0, 512, &o, row) == MP_OK;
    ok &= mp_step_stats(&tb, 512, SN - 512, &o, row) == MP_OK;
  } else {
    ok &= mp_step(&ta, 0, SN, &o) == MP_OK && mp_step_stats(&tb, 0, SN, &o, row) == MP_OK;
  }
  mp_step_options oc = o;
  oc.unscale_grads = 0;
  ok &= mp_step(&tc, 0, SN, &oc) == MP_OK;
  CHECK(ok, "%s %s: a call failed", rule_name(md->rule), kind_name[md->kind]);
  CHECK(same_arrays(&a, &b, md), "%s p%d g%d %s mf%d ema%d: counted step wrote other bits",
        rule_name(md->rule), md->pd, md->gd, kind_name[md->kind], md->mf, md->ema);
  double want[MP_STS_NCOLS];
  ref_counts(&a0, &b, &c, md, want);
  for (int j = 0; j < MP_STS_NCOLS; ++j) {
    const int is_sum = j == MP_STS_M_ERR || j == MP_STS_M_ABS || j == MP_STS_V_ERR ||
                       j == MP_STS_V_ABS || j == MP_STS_EMA_LAG || j == MP_STS_EMA_ABS;
    const double runs = g_row_sums ? (MP_STS_RUN + 1) * 0x1p-24 : 0.0;
    const double tol = is_sum ? (1e-12 + runs) * fabs(want[j]) : 0.0;
    if (want[j] > 0) g_nonzero[j] = 1;
    CHECK(fabs(row[j] - want[j]) <= tol, "%s p%d g%d %s mf%d ema%d split%d: %s = %.17g, want %.17g",
          rule_name(md->rule), md->pd, md->gd, kind_name[md->kind], md->mf, md->ema, split,
          col_name[j], row[j], want[j]);
  }
  free_arrays(&a0); free_arrays(&a); free_arrays(&b); free_arrays(&c);
}

static void test_step_counts(const char* isa) {
  char name[128];
  snprintf(name, sizeof name, "[%s] step_stats: every rule x storage x moment format: the "
           "bits of mp_step, the counts of the reference", isa);
  begin(name);
  memset(g_nonzero, 0, sizeof g_nonzero);
  g_row_sums = strcmp(isa, "scalar") != 0;
  const struct { int rule; double b1, b2, wd; int nmom; } rules[] = {
      {MP_RULE_ADAM, 0.9, 0.999, 0.01, 2}, {MP_RULE_LION, 0.9, 0.99, 0.1, 1},
      {MP_RULE_SGD, 0.9, 0.0, 0.01, 1},    {MP_RULE_SGD, 0.0, 0.0, 0.0, 0},
      {MP_RULE_MUON_MOMENTUM, 0.95, 0.0, 0.0, 1}, {MP_RULE_MUON_UPDATE, 0.5, 0.0, 0.01, 0}};
  const struct { int pd, kind; } storages[] = {{MP_F32, 0}, {MP_BF16, 1}, {MP_BF16, 2},
                                               {MP_BF16, 3}, {MP_BF16, 4}, {MP_F16, 1},
                                               {MP_F16, 3},  {MP_F16, 4}};
  int c = 0;
  for (size_t r = 0; r < sizeof rules / sizeof rules[0]; ++r) {
    for (size_t k = 0; k < sizeof storages / sizeof storages[0]; ++k) {
      for (int mf = 0; mf < (rules[r].nmom ? 3 : 1); ++mf) {
        smode md = {rules[r].rule, rules[r].b1, rules[r].b2, rules[r].wd, rules[r].nmom,
                    storages[k].pd, storages[k].pd, storages[k].kind, mf, (c & 1), 3.0f};
        if (c % 3 == 1) md.gd = MP_F32;
        if (c % 5 == 4) md.step = 0.0f; /* first step: the ema is a copy */
        step_case(&md, c & 2, (c % 4 == 1) ? 0.5f : 1.0f);
        ++c;
      }
    }
  }
  for (int j = 0; j < MP_STS_NCOLS; ++j) {
    CHECK(g_nonzero[j], "column %s was never above zero: its test cannot fail", col_name[j]);
  }
  end();
  snprintf(name, sizeof name, "[%s] step_stats: a skipped step counts and writes nothing", isa);
  begin(name);
  smode md = {MP_RULE_ADAM, 0.9, 0.999, 0.0, 2, MP_BF16, MP_BF16, 3, 1, 1, 3.0f};
  sarr a0, a;
  alloc_arrays(&a0, &md); alloc_arrays(&a, &md);
  fill_step(&a0, &md);
  copy_arrays(&a, &a0, &md);
  const float found = 1.0f;
  mp_step_options o = options_of(&md, NULL, 0);
  o.found_inf = &found;
  mp_step_tensor t = tensor_of(&a, &md, 0);
  double row[MP_STS_NCOLS] = {0};
  CHECK(mp_step_stats(&t, 0, SN, &o, row) == MP_OK, "status");
  CHECK(same_arrays(&a, &a0, &md), "something was written");
  for (int j = 0; j < MP_STS_NCOLS; ++j) CHECK(row[j] == 0.0, "%s counted", col_name[j]);
  free_arrays(&a0); free_arrays(&a);
  end();
}

static void test_step_arguments(void) {
  begin("step_stats: bad arguments change nothing");
  smode md = {MP_RULE_ADAM, 0.9, 0.999, 0.0, 2, MP_BF16, MP_BF16, 3, 2, 0, 3.0f};
  sarr a0, a;
  alloc_arrays(&a0, &md); alloc_arrays(&a, &md);
  fill_step(&a0, &md);
  copy_arrays(&a, &a0, &md);
  mp_step_options o = options_of(&md, NULL, 0);
  mp_step_tensor t = tensor_of(&a, &md, 0);
  double row[MP_STS_NCOLS] = {0};
  CHECK(mp_step_stats(&t, 0, SN, &o, NULL) == MP_ERR_INVALID_ARGUMENT, "row NULL");
  CHECK(mp_step_stats(NULL, 0, SN, &o, row) == MP_ERR_INVALID_ARGUMENT, "t NULL");
  CHECK(mp_step_stats(&t, 0, SN + 1, &o, row) == MP_ERR_INVALID_ARGUMENT, "range");
  CHECK(mp_step_stats(&t, 32, 64, &o, row) == MP_ERR_INVALID_ARGUMENT, "not on a block");
  o.weight_decay = -1.0;
  CHECK(mp_step_stats(&t, 0, SN, &o, row) == MP_ERR_INVALID_ARGUMENT, "options");
  CHECK(same_arrays(&a, &a0, &md), "something was written");
  for (int j = 0; j < MP_STS_NCOLS; ++j) CHECK(row[j] == 0.0, "%s counted", col_name[j]);
  free_arrays(&a0); free_arrays(&a);
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
  test_step_arguments();
  int best = 0;
  for (int isa = 0; isa < MP_ISA_COUNT; ++isa) {
    if (mp_cpu_isa_supported((mp_isa)isa)) best = isa;
  }
  for (int isa = 0; isa < MP_ISA_COUNT; ++isa) {
    const char* name = mp_isa_name((mp_isa)isa);
    /* "--isa best" (CI's sparser runs): the best path this CPU supports */
    if (only && strcmp(only, name) && !(strcmp(only, "best") == 0 && isa == best)) continue;
    if (!mp_cpu_isa_supported((mp_isa)isa)) {
      printf("SKIP  [%s] not supported by this CPU (or not compiled in)\n", name);
      continue;
    }
    mp_cpu_isa_select((mp_isa)isa);
    test_path(name);
    test_step_counts(name);
  }
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
