/* Loss scaling (mpext/scale.h), on every ISA path this CPU supports:
 *   - unscale (mp_unscale): the value decoded to double, multiplied there (exact), rounded once
 *     to fp32, then by the RNE reference of test_common.h; found and "inv_scale == 1 stores
 *     nothing" (read-only pages on Linux) checked on their own;
 *   - the loss-scale update (mp_update_scale): torch's _amp_update_scale_ restated, and the
 *     hysteresis / min_scale / max_scale / stats extensions restated from scale_rule.h's
 *     documentation, over random sequences of found_inf, plus hand-worked sequences. */
#if defined(__linux__)
#define _DEFAULT_SOURCE 1 /* mmap/mprotect (the inv_scale == 1 read-only test) */
#endif
#include "test_common.h"

#include "mpext/scale.h"

#if defined(__linux__)
#include <sys/mman.h>
#define HAVE_READONLY_PAGES 1
#else
#define HAVE_READONLY_PAGES 0
#endif

/* ------------------------------------------------------------------------------------------ */
/* 9. Loss scaling: mp_unscale (g *= inv_scale in place, *found = 1 if any input
 *    was NaN/Inf), per ISA path, against a reference in double arithmetic: the value is decoded
 *    (fp32 exactly, bf16/fp16 by the field decoder), multiplied by inv_scale in double (exact:
 *    at most 24 x 24 significant bits), rounded once to fp32 (= the fp32 product, as torch
 *    computes it), then for bf16/fp16 rounded to the format by this file's ref_rne. */


/* inv_scale values: powers of two, inexact factors, huge/subnormal/zero/negative/non-finite ones,
 * and the neighbours of 1 (which must multiply, unlike 1 itself). */
static const float U_INVS[] = {1.0f, 0.5f, 0x1p-16f, 0x1p-24f, 1.0f / 3.0f, 0.1f, 3.0f, 65536.0f,
                               1e-30f, 0x1p-149f, 0x1.fffffcp-127f, 0x1.fffffep127f, 0.0f,
                               -0.0f, -0.25f, INFINITY, NAN, 0x1.000002p0f, 0x1.fffffep-1f};

#define N_U_INVS (sizeof U_INVS / sizeof U_INVS[0])

/* The expected bits of element bits x of type dt after unscaling by inv. *nan: the result must
 * be a NaN (no fixed bits); *bad: x is NaN or +-Inf (must set found). */
static uint32_t ref_unscale(int dt, uint32_t x, float inv, int* nan, int* bad) {
  double v = dt == U_F32 ? (double)f32_of(x) : decode(x, u_fmt(dt));
  *bad = !isfinite(v);
  float r = (float)(v * (double)inv);
  *nan = isnan(r) ? 1 : 0;
  if (*nan) return 0;
  if (dt == U_F32) return bits_of(r);
  int n2;
  return ref_rne(bits_of(r), u_fmt(dt), &n2);
}

static int u_is_nan(int dt, uint32_t x) {
  return dt == U_F32 ? (x & 0x7FFFFFFFu) > 0x7F800000u : is_nan_fmt(x, u_fmt(dt));
}

static mp_status call_unscale(int dt, void* g, int64_t n, float inv, int32_t* found) {
  return mp_unscale(g, (mp_dtype)dt, n, inv, found);
}

/* Checks n elements at out (unscaled from in by inv) against the reference; returns the
 * reference's "some input was NaN/Inf". */
static int check_unscaled(group* g, int dt, const void* in, const void* out, int64_t n, float inv,
                          const char* what) {
  int any_bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t x = u_get(in, dt, i), got = u_get(out, dt, i);
    int nan, bad;
    uint32_t want = ref_unscale(dt, x, inv, &nan, &bad);
    any_bad |= bad;
    g->count++;
    if (inv == 1.0f) {
      if (got != x) {
        g_fail(g, "%s %s n %" PRId64 " i %" PRId64 ": inv_scale 1 changed %08" PRIx32
               " to %08" PRIx32, what, U_NAME[dt], n, i, x, got);
      }
    } else if (nan) {
      if (!u_is_nan(dt, got)) {
        g_fail(g, "%s %s i %" PRId64 ": input %08" PRIx32 " x inv %a: expected a NaN, got %08"
               PRIx32, what, U_NAME[dt], i, x, (double)inv, got);
      }
    } else if (got != want) {
      g_fail(g, "%s %s n %" PRId64 " i %" PRId64 ": input %08" PRIx32 " x inv %a: expected %08"
             PRIx32 ", got %08" PRIx32, what, U_NAME[dt], n, i, x, (double)inv, want, got);
    }
  }
  return any_bad;
}

static void test_unscale(const sweep_opts* o) {
  /* fp32 sweep inputs: the cast sweep's specials and boundary patterns, a sparser stride
   * (stride * 255 is odd and, for the default 257, divides 2^32 - 1) and a twentieth of its
   * random patterns. */
  uint64_t stride = o->stride * 255u;
  uint64_t n_strided = (0xFFFFFFFFull / stride) + 1u;
  uint32_t* pat = xmalloc(CHUNK * sizeof *pat);
  uint32_t* buf = xmalloc(CHUNK * sizeof *buf);
  uint16_t* all = xmalloc(65536 * sizeof *all);
  uint16_t* h = xmalloc(65536 * sizeof *h);
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;

    g_begin(&g, "unscale fp32: sweep x %d inv_scale values = fp32 product, found iff NaN/Inf "
            "[%s]", (int)N_U_INVS, nm);
    pat_iter it = {0, 0, stride, n_strided, o->n_random / 20u, o->seed ^ 0x5CA1Eu};
    size_t n;
    uint64_t total = 0;
    while ((n = next_patterns(&it, pat, CHUNK)) > 0) {
      for (size_t v = 0; v < N_U_INVS; ++v) {
        memcpy(buf, pat, n * sizeof *pat);
        int32_t found = 0;
        mp_status st = mp_unscale((void*)buf, MP_F32, (int64_t)n, U_INVS[v], &found);
        g_check(&g, st == MP_OK, "status %d", (int)st);
        int want = check_unscaled(&g, U_F32, pat, buf, (int64_t)n, U_INVS[v], "sweep");
        g_check(&g, found == want, "inv %a: found %d, expected %d", (double)U_INVS[v],
                (int)found, want);
      }
      total += n;
    }
    printf("      unscale fp32 sweep: %" PRIu64 " patterns (specials, boundaries, every %" PRIu64
           "th, random) per inv_scale\n", total, stride);
    g_end(&g);

    for (int dt = U_BF16; dt <= U_FP16; ++dt) {
      g_begin(&g, "unscale %s: all 65536 values x %d inv_scale values = fp32 product, RNE; found "
              "iff NaN/Inf [%s]", U_NAME[dt], (int)N_U_INVS, nm);
      for (uint32_t i = 0; i < 65536; ++i) all[i] = (uint16_t)i;
      for (size_t v = 0; v < N_U_INVS; ++v) {
        memcpy(h, all, 65536 * sizeof *h);
        int32_t found = 0;
        g_check(&g, call_unscale(dt, h, 65536, U_INVS[v], &found) == MP_OK, "status");
        check_unscaled(&g, dt, all, h, 65536, U_INVS[v], "all values");
        g_check(&g, found == 1, "inv %a: found %d over all values", (double)U_INVS[v],
                (int)found);
        /* the finite values only (both signs, all exponents but the top one): found stays 0 */
        uint32_t top = dt == U_BF16 ? 0x7F80u : 0x7C00u;
        int64_t m = 0;
        for (uint32_t i = 0; i < 65536; ++i) {
          if ((i & top) != top) h[m++] = (uint16_t)i;
        }
        memcpy(all, h, (size_t)m * sizeof *h);
        found = 0;
        g_check(&g, call_unscale(dt, h, m, U_INVS[v], &found) == MP_OK, "status");
        check_unscaled(&g, dt, all, h, m, U_INVS[v], "finite values");
        g_check(&g, found == 0, "inv %a: found %d over finite values only", (double)U_INVS[v],
                (int)found);
        for (uint32_t i = 0; i < 65536; ++i) all[i] = (uint16_t)i;
      }
      g_end(&g);
    }
  }
  free(pat);
  free(buf);
  free(all);
  free(h);
}

/* Sizes, alignments, a lone NaN/Inf at every position, guards, and found's contract: set to 1
 * when a NaN/Inf was read, otherwise left exactly as it was (never cleared). */
static void test_unscale_sizes(uint64_t seed0) {
  const int64_t MAXN = 150, MAXOFF = 17;
  size_t cap = (size_t)(MAXN + MAXOFF + 2 * GUARD);
  uint32_t* in32 = xmalloc(cap * sizeof *in32);
  uint32_t* g32 = xmalloc(cap * sizeof *g32);
  uint16_t* in16 = xmalloc(cap * sizeof *in16);
  uint16_t* g16 = xmalloc(cap * sizeof *g16);
  static const int32_t found_init[] = {0, 1, 7, -1};
  static const float invs[] = {0.5f, 1.0f, 1.0f / 3.0f, 0x1p-24f};
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    uint64_t s = seed0 ^ 0xF00Du; /* same inputs on every path */
    group g;
    g_begin(&g, "unscale: n = 0..%d at offsets 0..%d, no/sparse/lone NaN/Inf, guards intact, "
            "found set or left as it was [%s]", (int)MAXN, (int)MAXOFF, nm);
    for (int dt = U_F32; dt <= U_FP16; ++dt) {
      void* in = dt == U_F32 ? (void*)in32 : (void*)in16;
      void* gb = dt == U_F32 ? (void*)g32 : (void*)g16;
      for (int64_t n = 0; n <= MAXN; ++n) {
        for (int64_t off = 0; off <= MAXOFF; ++off) {
          uint64_t r = splitmix64(&s);
          float inv = invs[r % 4u];
          int32_t f0 = found_init[(r >> 8) % 4u];
          /* 0: all finite; 1: about 1 in 16 NaN/Inf; 2: one NaN/Inf at position (off*7) % n */
          int mode = (int)((r >> 16) % 3u);
          int64_t lone = n ? (off * 7 + n) % n : -1;
          for (size_t i = 0; i < cap; ++i) u_put(in, dt, (int64_t)i, u_random(&s, dt, 0));
          for (int64_t i = 0; i < n; ++i) {
            int bad = mode == 1 ? (splitmix64(&s) % 16u) == 0u : (mode == 2 && i == lone);
            if (bad) u_put(in, dt, GUARD + off + i, u_random(&s, dt, 1));
          }
          memcpy(gb, in, cap * u_size(dt));
          int32_t found = f0;
          char* base = (char*)gb + (size_t)(GUARD + off) * u_size(dt);
          char* src = (char*)in + (size_t)(GUARD + off) * u_size(dt);
          mp_status st = call_unscale(dt, base, n, inv, &found);
          g_check(&g, st == MP_OK, "%s n %" PRId64 ": status %d", U_NAME[dt], n, (int)st);
          int any = check_unscaled(&g, dt, src, base, n, inv, "sizes");
          int32_t want = any ? 1 : f0;
          g_check(&g, found == want, "%s n %" PRId64 " offset %" PRId64 " mode %d inv %a: found "
                  "%d (was %d), expected %d", U_NAME[dt], n, off, mode, (double)inv, (int)found,
                  (int)f0, (int)want);
          for (size_t i = 0; i < cap; ++i) {
            if ((int64_t)i >= GUARD + off && (int64_t)i < GUARD + off + n) continue;
            g_check(&g, u_get(gb, dt, (int64_t)i) == u_get(in, dt, (int64_t)i),
                    "%s n %" PRId64 " offset %" PRId64 ": wrote outside [0, n) at %" PRId64,
                    U_NAME[dt], n, off, (int64_t)i - GUARD - off);
          }
        }
      }
    }
    g_end(&g);

    /* Large odd sizes, one NaN/Inf at the first, the last or a random element (or none). */
    g_begin(&g, "unscale: large odd sizes, a lone NaN/Inf at either end or inside is found [%s]",
            nm);
    const int64_t BIG = 300007;
    uint32_t* bi = xmalloc((size_t)BIG * sizeof *bi);
    uint32_t* bg = xmalloc((size_t)BIG * sizeof *bg);
    memset(bi, 0, (size_t)BIG * sizeof *bi);
    for (int trial = 0; trial < 24; ++trial) {
      int dt = trial % 3;
      int64_t n = BIG - (int64_t)(splitmix64(&s) % 5000u) * 2;
      int64_t off = (int64_t)(splitmix64(&s) % 9u);
      n -= off;
      int where = (trial / 3) % 4; /* none, first, last, inside */
      for (int64_t i = 0; i < n; ++i) u_put(bi, dt, off + i, u_random(&s, dt, 0));
      int64_t pos = where == 1 ? 0 : where == 2 ? n - 1 : (int64_t)(splitmix64(&s) % (uint64_t)n);
      if (where) u_put(bi, dt, off + pos, u_random(&s, dt, 1));
      memcpy(bg, bi, (size_t)BIG * sizeof *bg);
      float inv = trial % 4 == 3 ? 1.0f : 0x1p-13f * 3.0f;
      int32_t found = 0;
      char* gp = (char*)bg + (size_t)off * u_size(dt);
      g_check(&g, call_unscale(dt, gp, n, inv, &found) == MP_OK, "status");
      int any = check_unscaled(&g, dt, (char*)bi + (size_t)off * u_size(dt), gp, n, inv, "large");
      g_check(&g, any == (where != 0), "test bug: reference found %d, where %d", any, where);
      g_check(&g, found == (where != 0), "%s n %" PRId64 " NaN/Inf at %s (%" PRId64 "), inv %a: "
              "found %d", U_NAME[dt], n, where == 0 ? "nowhere" : where == 1 ? "first" :
              where == 2 ? "last" : "inside", pos, (double)inv, (int)found);
    }
    free(bi);
    free(bg);
    g_end(&g);
  }
  free(in32);
  free(g32);
  free(in16);
  free(g16);
}

/* inv_scale == 1 only reads: the values, NaN payloads included, stay bit for bit, and (on Linux)
 * the call succeeds on memory mapped read-only, so it cannot have stored even an equal value. */
static void test_unscale_readonly(void) {
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "unscale, inv_scale == 1: nothing written (%s), NaN payloads kept, found set "
            "[%s]", HAVE_READONLY_PAGES ? "read-only pages" : "bit comparison", nm);
    const size_t bytes = 3 * 4096;
    uint64_t s = 0xAB1Eu;
#if HAVE_READONLY_PAGES
    unsigned char* mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                              -1, 0);
    if (mem == MAP_FAILED) {
      g_check(&g, 0, "mmap failed");
      g_end(&g);
      continue;
    }
#else
    unsigned char* mem = xmalloc(bytes);
#endif
    unsigned char* copy = xmalloc(bytes);
#if HAVE_READONLY_PAGES
    printf("      unscale with inv_scale == 1 on read-only pages [%s]: a crash here means it "
           "stored\n", nm);
    fflush(stdout);
#endif
    for (int dt = U_F32; dt <= U_FP16; ++dt) {
      int64_t cap = (int64_t)(bytes / u_size(dt));
      for (int64_t i = 0; i < cap; ++i) {
        /* signalling and quiet NaNs with payloads, Infs, and finite values */
        uint64_t r = splitmix64(&s);
        uint32_t x = u_random(&s, dt, (r % 5u) == 0u);
        u_put(mem, dt, i, x);
      }
      memcpy(copy, mem, bytes);
#if HAVE_READONLY_PAGES
      g_check(&g, mprotect(mem, bytes, PROT_READ) == 0, "mprotect failed");
#endif
      static const int64_t offs[] = {0, 1, 3, 5, 8, 13};
      for (size_t o = 0; o < sizeof offs / sizeof offs[0]; ++o) {
        int64_t n = cap - offs[o] - (int64_t)o;
        int32_t found = 0;
        mp_status st = call_unscale(dt, mem + (size_t)offs[o] * u_size(dt), n, 1.0f, &found);
        g_check(&g, st == MP_OK && found == 1, "%s offset %" PRId64 ": status %d found %d",
                U_NAME[dt], offs[o], (int)st, (int)found);
      }
#if HAVE_READONLY_PAGES
      g_check(&g, mprotect(mem, bytes, PROT_READ | PROT_WRITE) == 0, "mprotect failed");
#endif
      g_check(&g, memcmp(mem, copy, bytes) == 0, "%s: memory changed", U_NAME[dt]);
    }
#if HAVE_READONLY_PAGES
    munmap(mem, bytes);
#else
    free(mem);
#endif
    free(copy);
    g_end(&g);
  }
}

static void test_unscale_arguments(void) {
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "unscale argument checks: n < 0, NULL g with n > 0, NULL found rejected, nothing "
            "written; n == 0 ok [%s]", nm);
    static const int64_t bad_n[] = {-1, -2, -8, INT64_MIN, -((int64_t)1 << 40)};
    for (int dt = U_F32; dt <= U_FP16; ++dt) {
      /* cases 0..4: negative n; 5: NULL g, n 4; 6: NULL found, n 4; 7: NULL found, n 0;
       * 8: NULL g, n 0 (ok); 9: n 0 (ok) */
      for (int c = 0; c < 10; ++c) {
        uint32_t g32[8];
        uint16_t g16[8];
        for (int i = 0; i < 8; ++i) {
          g32[i] = i == 2 ? 0x7F800000u : 0x40490FDBu; /* an Inf, so found would be set */
          g16[i] = i == 2 ? (dt == U_BF16 ? 0x7F80u : 0x7C00u) : 0x4049u;
        }
        int64_t n = c < 5 ? bad_n[c] : (c == 5 || c == 6) ? 4 : 0;
        void* gp = (c == 5 || c == 8) ? NULL : (dt == U_F32 ? (void*)g32 : (void*)g16);
        int32_t found = 5;
        int32_t* fp = (c == 6 || c == 7) ? NULL : &found;
        mp_status want = c < 8 ? MP_ERR_INVALID_ARGUMENT : MP_OK;
        mp_status r = call_unscale(dt, gp, n, 0.5f, fp);
        g_check(&g, r == want, "%s case %d (n %" PRId64 "): status %d, expected %d", U_NAME[dt],
                c, n, (int)r, (int)want);
        g_check(&g, found == 5, "%s case %d: found written (%d)", U_NAME[dt], c, (int)found);
        int untouched = 1;
        for (int i = 0; i < 8; ++i) {
          uint32_t w32 = i == 2 ? 0x7F800000u : 0x40490FDBu;
          uint32_t w16 = i == 2 ? (dt == U_BF16 ? 0x7F80u : 0x7C00u) : 0x4049u;
          if (g32[i] != w32 || g16[i] != w16) untouched = 0;
        }
        g_check(&g, untouched, "%s case %d: g written", U_NAME[dt], c);
      }
    }
    g_end(&g);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* 10. The dynamic loss-scale update, mp_update_scale, against re-implementations written from
 *     torch's rule and from scale_rule.h's documentation of the extensions. */

/* torch._amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp and the CUDA
 * kernel), restated: found_inf is tested for truth as a float (NaN is an overflow, -0.0 is not);
 * a back-off multiplies in double and rounds to float; growth applies only if the grown float
 * is finite; growth_tracker counts clean steps and is reset on growth and on overflow. */
static void torch_update_scale(float* scale, int32_t* growth_tracker, float found_inf,
                               double growth_factor, double backoff_factor,
                               int64_t growth_interval) {
  if (found_inf) {
    *scale = (float)(*scale * backoff_factor);
    *growth_tracker = 0;
  } else {
    int64_t successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      float new_scale = (float)(*scale * growth_factor);
      if (isfinite(new_scale)) *scale = new_scale;
      *growth_tracker = 0;
    } else {
      *growth_tracker = (int32_t)successful;
    }
  }
}

typedef struct scaler_cfg {
  double growth_factor, backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis;
  int use_tracker, use_stats;
  double min_scale, max_scale;
} scaler_cfg;

typedef struct scaler_state {
  float scale;
  int32_t growth_tracker, hysteresis_tracker;
  int64_t stats[2];
} scaler_state;

/* The extended rule, as scale_rule.h documents it:
 *   hysteresis (hysteresis > 1 and a tracker): an overflow with tolerance left (tracker > 1)
 *     only uses some up; with none left (<= 1) it backs off; a clean step restores it in full;
 *   min_scale > 0: a back-off that would land below min_scale lands on it, or, when the scale
 *     is already below it, leaves the scale where it is;
 *   max_scale > 0: growth that would land above max_scale lands on it, or, when the scale is
 *     already above it, leaves the scale where it is (then the finite check as torch);
 *   stats: [0] counts overflows, [1] the current run of consecutive overflows. */
static void ext_update_scale(scaler_state* s, float found_inf, const scaler_cfg* c) {
  int hyst = c->use_tracker && c->hysteresis > 1;
  if (found_inf) {
    if (hyst && s->hysteresis_tracker > 1) {
      s->hysteresis_tracker--;
    } else {
      float next = (float)((double)s->scale * c->backoff_factor);
      if (c->min_scale > 0 && (double)next < c->min_scale) {
        next = (double)s->scale < c->min_scale ? s->scale : (float)c->min_scale;
      }
      s->scale = next;
    }
    s->growth_tracker = 0;
    if (c->use_stats) {
      s->stats[0]++;
      s->stats[1]++;
    }
    return;
  }
  if ((int64_t)s->growth_tracker + 1 != c->growth_interval) {
    s->growth_tracker++;
  } else {
    float next = (float)((double)s->scale * c->growth_factor);
    if (c->max_scale > 0 && (double)next > c->max_scale) {
      next = (double)s->scale > c->max_scale ? s->scale : (float)c->max_scale;
    }
    if (!isinf(next) && !isnan(next)) s->scale = next;
    s->growth_tracker = 0;
  }
  if (hyst) s->hysteresis_tracker = c->hysteresis;
  if (c->use_stats) s->stats[1] = 0;
}

/* One mp_update_scale call on state s (updated in place) under configuration c. */
/* mp_update_scale with the fields of its struct as arguments. */
static mp_status update_scale_args(float* scale, int32_t* growth_tracker, const float* found_inf,
                                   double growth_factor, double backoff_factor,
                                   int64_t growth_interval, int32_t* hysteresis_tracker,
                                   int32_t hysteresis, double min_scale, double max_scale,
                                   int64_t* stats) {
  const mp_scale_update u = {scale,         growth_tracker, found_inf,      hysteresis_tracker,
                             stats,         growth_factor,  backoff_factor, growth_interval,
                             hysteresis,    min_scale,      max_scale};
  return mp_update_scale(&u);
}

static mp_status call_update_scale(scaler_state* s, float found_inf, const scaler_cfg* c) {
  const float f = found_inf;
  return update_scale_args(&s->scale, &s->growth_tracker, &f, c->growth_factor, c->backoff_factor,
                         c->growth_interval, c->use_tracker ? &s->hysteresis_tracker : NULL,
                         c->hysteresis, c->min_scale, c->max_scale,
                         c->use_stats ? s->stats : NULL);
}

static int same_state(const scaler_state* a, const scaler_state* b) {
  return bits_of(a->scale) == bits_of(b->scale) && a->growth_tracker == b->growth_tracker &&
         a->hysteresis_tracker == b->hysteresis_tracker && a->stats[0] == b->stats[0] &&
         a->stats[1] == b->stats[1];
}

static const float OVERFLOW_FLAGS[] = {1.0f, 2.0f, -1.0f, NAN, INFINITY, 0x1p-149f};

static const float CLEAN_FLAGS[] = {0.0f, -0.0f};

static float random_flag(uint64_t* s, double p_overflow) {
  uint64_t r = splitmix64(s);
  int overflow = (double)(r >> 11) * 0x1p-53 < p_overflow;
  uint32_t pick = (uint32_t)(splitmix64(s) % 16u);
  if (overflow) return pick < 11 ? 1.0f : OVERFLOW_FLAGS[pick % 6u];
  return pick < 14 ? 0.0f : CLEAN_FLAGS[pick % 2u];
}

static void test_update_scale(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x5CA1Eu;
  group g;

  /* 1. The default configuration is torch's rule, over random sequences. */
  g_begin(&g, "update_scale: defaults == torch._amp_update_scale_ on random sequences (NaN, -0.0 "
          "flags; tracker untouched)");
  static const double gfs[] = {2.0, 1.5, 3.0, 1.0001, 1.0, 0.75, 1e30, 65536.0};
  static const double bfs[] = {0.5, 0.25, 0.9, 1.0, 0.999999, 1e-30, 0.1};
  static const int64_t intervals[] = {1, 2, 3, 7, 100, 2000, INT32_MAX};
  static const float scales[] = {65536.0f, 1.0f, 0x1p-140f, 0x1p-149f, 0x1.fffffep127f,
                                 0x1p127f, 0x1.8p126f, 3.0e38f, 0.1f, 0.0f};
  for (int trial = 0; trial < 3000; ++trial) {
    scaler_cfg c = {gfs[splitmix64(&s) % 8u], bfs[splitmix64(&s) % 7u],
                    intervals[splitmix64(&s) % 7u], 1, 0, 0, 0.0, 0.0};
    if (trial % 5 == 1) c.hysteresis = (int32_t)(splitmix64(&s) % 2u) - 1; /* 0 or -1 */
    c.use_tracker = trial % 3 == 2; /* given, but hysteresis <= 1: never touched */
    scaler_state a = {scales[splitmix64(&s) % 10u], 0, 12345, {0, 0}};
    if (c.growth_interval > 1) {
      a.growth_tracker = (int32_t)(splitmix64(&s) % (uint64_t)(c.growth_interval < 50 ? c.growth_interval : 50));
    }
    if (c.growth_interval == INT32_MAX && trial % 2) a.growth_tracker = INT32_MAX - 3;
    float ts = a.scale;
    int32_t tg = a.growth_tracker;
    double p = (double)(splitmix64(&s) % 5u) / 4.0; /* 0, 0.25, 0.5, 0.75, 1 */
    int steps = 50 + (int)(splitmix64(&s) % 400u);
    for (int step = 0; step < steps; ++step) {
      float flag = random_flag(&s, p);
      scaler_state before = a;
      mp_status st = call_update_scale(&a, flag, &c);
      torch_update_scale(&ts, &tg, flag, c.growth_factor, c.backoff_factor, c.growth_interval);
      if (!g_check(&g, st == MP_OK && bits_of(a.scale) == bits_of(ts) && a.growth_tracker == tg &&
                   a.hysteresis_tracker == 12345 && a.stats[0] == 0,
                   "trial %d step %d (found_inf %a, growth %g, backoff %g, interval %" PRId64
                   "): scale %a -> %a, tracker %d -> %d; torch gives %a, %d (status %d)", trial,
                   step, (double)flag, c.growth_factor, c.backoff_factor, c.growth_interval,
                   (double)before.scale, (double)a.scale, (int)before.growth_tracker,
                   (int)a.growth_tracker, (double)ts, (int)tg, (int)st)) {
        break;
      }
    }
  }
  g_end(&g);

  /* 2. Growth up to the fp32 limit never makes the scale Inf (nor does it stop short). */
  g_begin(&g, "update_scale: growth up to the fp32 limit, never Inf; a growth to Inf keeps the "
          "scale, resets the tracker");
  {
    static const double gf2[] = {2.0, 3.0, 1.5, 10.0, 1.0000001, 1e30};
    for (size_t i = 0; i < sizeof gf2 / sizeof gf2[0]; ++i) {
      for (int interval = 1; interval <= 3; ++interval) {
        scaler_cfg c = {gf2[i], 0.5, interval, 1, 0, 0, 0.0, 0.0};
        scaler_state a = {1.0f, 0, 0, {0, 0}};
        if (gf2[i] < 1.01) a.scale = 0x1.ffff00p127f;
        float prev = a.scale;
        int grew_to_limit = 0;
        for (int step = 0; step < 3000; ++step) {
          int32_t tracker_before = a.growth_tracker;
          call_update_scale(&a, 0.0f, &c);
          g_check(&g, isfinite(a.scale) && a.scale >= prev, "growth %g step %d: scale %a after %a",
                  gf2[i], step, (double)a.scale, (double)prev);
          if (tracker_before + 1 == interval) {
            double want = (double)prev * gf2[i];
            float wf = (float)want;
            g_check(&g, a.growth_tracker == 0, "growth %g: tracker %d after a growth step",
                     gf2[i], (int)a.growth_tracker);
            g_check(&g, isfinite(wf) ? a.scale == wf : a.scale == prev, "growth %g step %d: %a "
                    "-> %a (grown %a)", gf2[i], step, (double)prev, (double)a.scale, want);
            if (!isfinite(wf)) grew_to_limit = 1;
          }
          prev = a.scale;
        }
        g_check(&g, grew_to_limit, "growth %g interval %d: never reached the limit", gf2[i],
                interval);
        g_check(&g, (double)a.scale * gf2[i] >= 0x1.ffffffp127, "growth %g: stopped at %a",
                gf2[i], (double)a.scale);
      }
    }
    /* FLT_MAX with growth 2 stays FLT_MAX; one overflow then halves it. */
    scaler_cfg c = {2.0, 0.5, 1, 1, 0, 0, 0.0, 0.0};
    scaler_state a = {0x1.fffffep127f, 0, 0, {0, 0}};
    call_update_scale(&a, 0.0f, &c);
    g_check(&g, a.scale == 0x1.fffffep127f && a.growth_tracker == 0, "FLT_MAX grew to %a",
            (double)a.scale);
    call_update_scale(&a, 1.0f, &c);
    g_check(&g, a.scale == 0x1.fffffep126f, "FLT_MAX backed off to %a", (double)a.scale);
  }
  g_end(&g);

  /* 3. Hysteresis by hand: hysteresis = 3 tolerates two overflows in a row, backs off on the
   *    third and on every further one; a clean step restores the full tolerance. */
  g_begin(&g, "update_scale: hysteresis N tolerates N-1 overflows, a clean step refills; "
          "overflows reset growth_tracker; stats");
  {
    scaler_cfg c = {2.0, 0.5, 4, 3, 1, 1, 0.0, 0.0};
    scaler_state a = {1024.0f, 2, 3, {0, 0}};
    /* flag, then expected scale, growth tracker, hysteresis tracker, stats[0], stats[1] */
    static const struct {
      float flag, scale;
      int32_t gt, ht;
      int64_t s0, s1;
    } steps[] = {
        {1, 1024, 0, 2, 1, 1},  {1, 1024, 0, 1, 2, 2}, {1, 512, 0, 1, 3, 3},
        {1, 256, 0, 1, 4, 4},   {0, 256, 1, 3, 4, 0},  {1, 256, 0, 2, 5, 1},
        {0, 256, 1, 3, 5, 0},   {0, 256, 2, 3, 5, 0},  {0, 256, 3, 3, 5, 0},
        {0, 512, 0, 3, 5, 0},   {1, 512, 0, 2, 6, 1},  {1, 512, 0, 1, 7, 2},
        {0, 512, 1, 3, 7, 0},   {1, 512, 0, 2, 8, 1},  {1, 512, 0, 1, 9, 2},
        {1, 256, 0, 1, 10, 3},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; ++i) {
      mp_status st = call_update_scale(&a, steps[i].flag, &c);
      g_check(&g, st == MP_OK && a.scale == steps[i].scale && a.growth_tracker == steps[i].gt &&
              a.hysteresis_tracker == steps[i].ht && a.stats[0] == steps[i].s0 &&
              a.stats[1] == steps[i].s1, "step %zu (found %g): scale %g gt %d ht %d stats %" PRId64
              "/%" PRId64 ", expected %g %d %d %" PRId64 "/%" PRId64, i, (double)steps[i].flag,
              (double)a.scale, (int)a.growth_tracker, (int)a.hysteresis_tracker, a.stats[0],
              a.stats[1], (double)steps[i].scale, (int)steps[i].gt, (int)steps[i].ht,
              steps[i].s0, steps[i].s1);
    }
  }
  g_end(&g);

  /* 4. min_scale and max_scale by hand. */
  g_begin(&g, "update_scale: min_scale floors back-off, max_scale caps growth (a scale past "
          "either stays), inexact bounds");
  {
    scaler_cfg c = {2.0, 0.5, 1, 1, 0, 0, 0.75, 0.0};
    scaler_state a = {4.0f, 0, 0, {0, 0}};
    static const float down[] = {2.0f, 1.0f, 0.75f, 0.75f, 0.75f};
    for (size_t i = 0; i < 5; ++i) {
      call_update_scale(&a, 1.0f, &c);
      g_check(&g, a.scale == down[i], "min 0.75: overflow %zu gave %g, expected %g", i,
              (double)a.scale, (double)down[i]);
    }
    a.scale = 0.25f; /* already below the floor: stays */
    call_update_scale(&a, 1.0f, &c);
    g_check(&g, a.scale == 0.25f, "below min: backed off to %g", (double)a.scale);
    call_update_scale(&a, 0.0f, &c); /* growth is not limited by min_scale */
    g_check(&g, a.scale == 0.5f, "below min: grew to %g", (double)a.scale);

    c = (scaler_cfg){2.0, 0.5, 1, 1, 0, 0, 0.0, 3000.0};
    a = (scaler_state){1000.0f, 0, 0, {0, 0}};
    static const float up[] = {2000.0f, 3000.0f, 3000.0f};
    for (size_t i = 0; i < 3; ++i) {
      call_update_scale(&a, 0.0f, &c);
      g_check(&g, a.scale == up[i], "max 3000: growth %zu gave %g, expected %g", i,
              (double)a.scale, (double)up[i]);
    }
    a.scale = 5000.0f; /* already above the cap: stays; a back-off is not limited by it */
    call_update_scale(&a, 0.0f, &c);
    g_check(&g, a.scale == 5000.0f, "above max: grew to %g", (double)a.scale);
    call_update_scale(&a, 1.0f, &c);
    g_check(&g, a.scale == 2500.0f, "above max: backed off to %g", (double)a.scale);

    /* bounds that are not floats: the scale lands on the nearest float */
    c = (scaler_cfg){10.0, 0.1, 1, 1, 0, 0, 0.1, 1e10};
    a = (scaler_state){0.5f, 0, 0, {0, 0}};
    call_update_scale(&a, 1.0f, &c);
    g_check(&g, a.scale == 0.1f, "min 0.1: backed off to %a", (double)a.scale);
    a.scale = 3e9f;
    call_update_scale(&a, 0.0f, &c);
    g_check(&g, a.scale == 1e10f, "max 1e10: grew to %a", (double)a.scale);
    /* max_scale above the fp32 range: growth still never reaches Inf */
    c = (scaler_cfg){4.0, 0.5, 1, 1, 0, 0, 0.0, 1e300};
    a = (scaler_state){0x1p126f, 0, 0, {0, 0}};
    call_update_scale(&a, 0.0f, &c);
    g_check(&g, a.scale == 0x1p126f, "max 1e300: 2^126 x 4 gave %a", (double)a.scale);
  }
  g_end(&g);

  /* 5. Every extension at random, over random sequences, against the extended reference; with
   *    the extensions off the extended reference is also checked against torch's rule. */
  g_begin(&g, "update_scale: hysteresis/min/max/stats at random == documented rule on random "
          "sequences; never Inf");
  for (int trial = 0; trial < 4000; ++trial) {
    uint64_t r = splitmix64(&s);
    scaler_cfg c;
    c.growth_factor = gfs[r % 6u]; /* the finite-growth ones mostly */
    c.backoff_factor = bfs[(r >> 4) % 7u];
    c.growth_interval = intervals[(r >> 8) % 5u];
    static const int32_t hs[] = {1, 1, 2, 3, 5, 0};
    c.hysteresis = hs[(r >> 12) % 6u];
    c.use_tracker = c.hysteresis > 1 || ((r >> 16) & 1u);
    c.use_stats = (int)((r >> 17) & 1u);
    static const double mins[] = {0.0, 0.0, 1.0, 0.75, 0x1p-20, 0.1, 1e-45, 1e-50};
    static const double maxs[] = {0.0, 0.0, 65536.0, 3000.0, 0x1p100, 1e10, 3.4e38, 1e300};
    c.min_scale = mins[(r >> 18) % 8u];
    c.max_scale = maxs[(r >> 21) % 8u];
    if (c.max_scale > 0 && c.min_scale > c.max_scale) c.min_scale = 0.0;
    scaler_state a = {scales[(r >> 24) % 10u], 0, 0, {0, 0}};
    if (c.growth_interval > 1) {
      a.growth_tracker = (int32_t)((r >> 28) % (uint64_t)c.growth_interval);
    }
    a.hysteresis_tracker = c.use_tracker ? (int32_t)((r >> 40) % 6u) : 0;
    a.stats[0] = (int64_t)((r >> 44) % 100u);
    a.stats[1] = (int64_t)((r >> 50) % 3u);
    scaler_state e = a;
    float ts = a.scale;
    int32_t tg = a.growth_tracker;
    int plain = c.hysteresis <= 1 && c.min_scale <= 0 && c.max_scale <= 0;
    double p = (double)(splitmix64(&s) % 9u) / 8.0;
    int steps = 50 + (int)(splitmix64(&s) % 300u);
    for (int step = 0; step < steps; ++step) {
      float flag = random_flag(&s, p);
      scaler_state before = a;
      mp_status st = call_update_scale(&a, flag, &c);
      ext_update_scale(&e, flag, &c);
      int ok = g_check(&g, st == MP_OK && same_state(&a, &e),
                       "trial %d step %d (found %a; growth %g backoff %g interval %" PRId64
                       " hysteresis %d%s min %g max %g%s): scale %a -> %a (expected %a), gt %d -> "
                       "%d (%d), ht %d -> %d (%d), stats %" PRId64 "/%" PRId64 " (%" PRId64
                       "/%" PRId64 ")", trial, step, (double)flag, c.growth_factor,
                       c.backoff_factor, c.growth_interval, (int)c.hysteresis,
                       c.use_tracker ? "" : " no tracker", c.min_scale, c.max_scale,
                       c.use_stats ? " stats" : "", (double)before.scale, (double)a.scale,
                       (double)e.scale, (int)before.growth_tracker, (int)a.growth_tracker,
                       (int)e.growth_tracker, (int)before.hysteresis_tracker,
                       (int)a.hysteresis_tracker, (int)e.hysteresis_tracker, a.stats[0],
                       a.stats[1], e.stats[0], e.stats[1]);
      if (plain) {
        torch_update_scale(&ts, &tg, flag, c.growth_factor, c.backoff_factor, c.growth_interval);
        ok &= g_check(&g, bits_of(ts) == bits_of(e.scale) && tg == e.growth_tracker,
                      "test bug: extended reference differs from torch's rule at trial %d step %d",
                      trial, step);
      }
      ok &= g_check(&g, !isinf(a.scale), "trial %d step %d: scale became Inf", trial, step);
      if (c.max_scale > 0 && !flag && before.scale <= (float)c.max_scale) {
        ok &= g_check(&g, (double)a.scale <= c.max_scale || a.scale == (float)c.max_scale,
                      "trial %d step %d: grew past max_scale %g to %a", trial, step, c.max_scale,
                      (double)a.scale);
      }
      if (c.min_scale > 0 && flag && (double)before.scale >= c.min_scale) {
        ok &= g_check(&g, (double)a.scale >= c.min_scale || a.scale == (float)c.min_scale,
                      "trial %d step %d: backed off below min_scale %g to %a", trial, step,
                      c.min_scale, (double)a.scale);
      }
      if (!ok) break;
      a = e; /* continue from the expected state after a failure was reported */
    }
  }
  g_end(&g);

  /* 6. Argument checks: NULL scale / growth_tracker / found_inf, or hysteresis > 1 without a
   *    tracker, are rejected and nothing is written; found_inf is never written. */
  g_begin(&g, "update_scale argument checks: NULLs, hysteresis without a tracker rejected, "
          "nothing written");
  {
    float sc = 8.0f, fi = 1.0f;
    int32_t gt = 3, ht = 2;
    int64_t stats[2] = {4, 5};
    mp_status r[5];
    r[0] = update_scale_args(NULL, &gt, &fi, 2.0, 0.5, 10, &ht, 2, 0.0, 0.0, stats);
    r[1] = update_scale_args(&sc, NULL, &fi, 2.0, 0.5, 10, &ht, 2, 0.0, 0.0, stats);
    r[2] = update_scale_args(&sc, &gt, NULL, 2.0, 0.5, 10, &ht, 2, 0.0, 0.0, stats);
    r[3] = update_scale_args(&sc, &gt, &fi, 2.0, 0.5, 10, NULL, 2, 0.0, 0.0, stats);
    r[4] = update_scale_args(&sc, &gt, &fi, 2.0, 0.5, 10, NULL, 7, 1.0, 9.0, NULL);
    for (int i = 0; i < 5; ++i) {
      g_check(&g, r[i] == MP_ERR_INVALID_ARGUMENT, "case %d: status %d", i, (int)r[i]);
    }
    g_check(&g, sc == 8.0f && gt == 3 && ht == 2 && stats[0] == 4 && stats[1] == 5 && fi == 1.0f,
            "a rejected call wrote: scale %g gt %d ht %d stats %" PRId64 "/%" PRId64, (double)sc,
            (int)gt, (int)ht, stats[0], stats[1]);
    g_check(&g, mp_update_scale(NULL) == MP_ERR_INVALID_ARGUMENT, "a NULL update accepted");
    g_check(&g, update_scale_args(&sc, &gt, &fi, 2.0, 0.5, 10, NULL, 1, 0.0, 0.0, NULL) == MP_OK,
            "hysteresis 1 without a tracker rejected");
    g_check(&g, sc == 4.0f && gt == 0 && fi == 1.0f, "overflow step: scale %g gt %d found %g",
            (double)sc, (int)gt, (double)fi);
  }
  g_end(&g);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_unscale_arguments();
  test_unscale_readonly();
  test_unscale_sizes(o->seed);
  test_unscale(o);
  test_update_scale(o->seed);
}
