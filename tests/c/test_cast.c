/* The casts (mpext/cast.h: mp_to_bf16_f32, mp_to_fp16_f32, mp_to_bf16_sr_f32, mp_to_fp32_*,
 * mp_cast), on every ISA path this CPU supports, against references written independently of
 * csrc/core and numerics.h (test_common.h):
 *   - fp32 -> bf16/fp16 round to nearest even: double arithmetic (the truncated and next-up
 *     candidates at the format's quantum, nearer one wins, ties to the even significand, then an
 *     encoder from (value, exponent) to bits); for fp16 that reference is itself checked
 *     against the CPU's F16C conversion on every sweep input (when the CPU has F16C) and against
 *     the compiler's _Float16 on the boundary patterns (on all inputs without F16C);
 *   - bf16/fp16 -> fp32: a field decoder built on ldexp (checked against _Float16 for fp16);
 *   - stochastic rounding: the documented definition (the counter-based generator of numerics.h
 *     keyed by the seed, position offset + i, low 16 bits), as test_common.h states it;
 *   - sizes and alignments with guards, argument checks, mp_cast's pairs and its large outputs.
 * --stride and --random set the fp32 sweep (test_common.c). */
#include "test_common.h"

#include "mpext/cast.h"

/* Everything the sweep needs about fp32 bits u for bf16, from one set of candidates: the RNE
 * result, the stochastic-rounding result for r16, and both neighbours (truncated and next-up
 * magnitude; for Inf both are Inf). Returns 1 for NaN (nothing else set). */
typedef struct bf16_ref {
  uint32_t rne, sr, lo, hi;
} bf16_ref;

static int ref_bf16_all(uint32_t u, uint32_t r16, bf16_ref* out) {
  float x = f32_of(u);
  if (isnan(x)) return 1;
  int neg = (u >> 31) != 0;
  if (isinf(x)) {
    out->rne = out->sr = out->lo = out->hi = encode(INFINITY, neg, &BF16);
    return 0;
  }
  double ax = fabs((double)x);
  cands c = candidates(ax, &BF16);
  double dl = ax - c.lo, dh = c.hi - ax;
  out->lo = encode(c.lo, neg, &BF16);
  out->hi = encode(c.hi, neg, &BF16);
  out->rne = dl < dh ? out->lo : dh < dl ? out->hi : (c.k % 2u == 0u ? out->lo : out->hi);
  out->sr = dl / c.q * 65536.0 + (double)r16 >= 65536.0 ? out->hi : out->lo;
  return 0;
}

#if defined(__FLT16_MANT_DIG__)
#define HAVE_FLOAT16 1
static uint32_t f16_by_compiler(uint32_t u) {
  volatile float x = f32_of(u); /* keep it a run-time conversion */
  _Float16 h = (_Float16)x;
  uint16_t b;
  memcpy(&b, &h, sizeof b);
  return b;
}
static uint32_t f32_of_f16_by_compiler(uint16_t b) {
  _Float16 h;
  memcpy(&h, &b, sizeof h);
  volatile _Float16 vh = h;
  return bits_of((float)vh);
}
#else
#define HAVE_FLOAT16 0
#endif

/* The CPU's own conversion (F16C vcvtps2ph, round to nearest even from the immediate, not from
 * MXCSR): a second fp16 reference that is fast enough for the whole sweep (the compiler's
 * _Float16 conversion is libgcc software with exception handling, ~100x slower). Used only when
 * the CPU has F16C; the test itself stays baseline code. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HAVE_F16C_REF 1
__attribute__((target("f16c"))) static void f16_by_f16c(const float* x, uint16_t* out,
                                                        size_t n) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128i h = _mm_cvtps_ph(_mm_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i*)(void*)tmp, h);
    memcpy(out + i, tmp, 4 * sizeof *out);
  }
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}
static int have_f16c(void) { return __builtin_cpu_supports("f16c"); }
#else
#define HAVE_F16C_REF 0
#endif

static uint32_t sr_word(sr_stream* s, uint64_t seed, uint64_t idx) {
  if (!s->valid || s->seed != seed) {
    s->seed = seed;
    s->key = ref_key(seed, 0, 0);
    s->valid = 1;
  }
  return ref_bits(s->key, idx);
}

/* ------------------------------------------------------------------------------------------ */
/* 2. The reference itself: the double-based fp16 rounding against the compiler's _Float16,
 *    and hand-computed bf16/fp16 values. */
typedef struct known {
  uint32_t in;
  uint32_t out;
} known;

static void test_reference_selfcheck(void) {
  group g;
  g_begin(&g, "test reference: hand-computed bf16/fp16 results");
  static const known kb[] = {
      {0x3F800000u, 0x3F80u}, {0x3F808000u, 0x3F80u}, {0x3F808001u, 0x3F81u},
      {0x3F818000u, 0x3F82u}, {0x3F817FFFu, 0x3F81u}, {0x7F7F7FFFu, 0x7F7Fu},
      {0x7F7F8000u, 0x7F80u}, {0x7F7FFFFFu, 0x7F80u}, {0xFF7F8000u, 0xFF80u},
      {0x00008000u, 0x0000u}, {0x00018000u, 0x0002u}, {0x00008001u, 0x0001u},
      {0x80008000u, 0x8000u}, {0x7F800000u, 0x7F80u}, {0xFF800000u, 0xFF80u},
      {0x007FFFFFu, 0x0080u}, {0x40490FDBu, 0x4049u}, {0xC0490FDBu, 0xC049u},
  };
  static const known kh[] = {
      {0x3F800000u, 0x3C00u}, {0x477FE000u, 0x7BFFu}, {0x477FEFFFu, 0x7BFFu},
      {0x477FF000u, 0x7C00u}, {0x47800000u, 0x7C00u}, {0x38800000u, 0x0400u},
      {0x33800000u, 0x0001u}, {0x33000000u, 0x0000u}, {0x33000001u, 0x0001u},
      {0x33C00000u, 0x0002u}, {0x33A00000u, 0x0001u}, {0x34200000u, 0x0002u},
      {0x387FF000u, 0x0400u}, {0x387FE000u, 0x0400u}, {0x387FC000u, 0x03FFu},
      {0x387F8000u, 0x03FEu}, {0xB3000000u, 0x8000u}, {0x3F801000u, 0x3C00u},
      {0x3F803000u, 0x3C02u}, {0x3F801001u, 0x3C01u}, {0x3F802FFFu, 0x3C01u},
      {0x7F7FFFFFu, 0x7C00u}, {0xFF800000u, 0xFC00u}, {0x00000001u, 0x0000u},
      {0x40490FDBu, 0x4248u}, {0x33400000u, 0x0001u}, {0x33200000u, 0x0001u},
  };
  for (size_t i = 0; i < sizeof kb / sizeof kb[0]; ++i) {
    int nan;
    uint32_t r = ref_rne(kb[i].in, &BF16, &nan);
    g_check(&g, !nan && r == kb[i].out, "bf16 ref of %08" PRIx32 ": want %04" PRIx32
            " got %04" PRIx32, kb[i].in, kb[i].out, r);
  }
  for (size_t i = 0; i < sizeof kh / sizeof kh[0]; ++i) {
    int nan;
    uint32_t r = ref_rne(kh[i].in, &FP16, &nan);
    g_check(&g, !nan && r == kh[i].out, "fp16 ref of %08" PRIx32 ": want %04" PRIx32
            " got %04" PRIx32, kh[i].in, kh[i].out, r);
  }
  g_end(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* 3. The fp32 sweeps: RNE to bf16 and fp16, and stochastic rounding, per ISA path. */


/* SR offsets per chunk: the first chunk's indices end at 2^64 - 1, the second crosses a 2^32-block
 * boundary (the counter's second word carries); the rest are random. Wrapping past 2^64 inside a
 * call is tested on its own (test_sr_wrap). */
static uint64_t chunk_offset(uint64_t chunk, uint64_t seed) {
  switch (chunk) {
    case 0: return (uint64_t)0 - (uint64_t)CHUNK; /* ends exactly at index 2^64 - 1 */
    case 1: return (1ull << 34) - 1001u;
    case 2: return 0u;
    case 3: return 3u;
    default: return hash64(seed ^ (chunk * 0x9E3779B97F4A7C15ull));
  }
}

/* One round-to-nearest-even cast of the chunk on the selected path: status OK, every output
 * the reference's bits (a NaN: one the format allows for its input). Returns the cast's time. */
static double check_rne(group* g, mp_status (*cast)(const float*, uint16_t*, int64_t),
                        const fmt* f, const uint32_t* pat, const float* src, uint16_t* out,
                        const unsigned char* nan, const uint32_t* want, size_t n) {
  memset(out, 0xA5, n * sizeof *out);
  double t0 = now_s();
  mp_status stt = cast(src, out, (int64_t)n);
  double t = now_s() - t0;
  g_check(g, stt == MP_OK, "status %d", (int)stt);
  for (size_t i = 0; i < n; ++i) {
    g->count++;
    if (nan[i]) {
      const char* why = nan_result_problem(pat[i], out[i], f);
      if (why) g_fail(g, "input %08" PRIx32 " (NaN): got %04x: %s", pat[i], out[i], why);
    } else if (out[i] != want[i]) {
      g_fail(g, "input %08" PRIx32 " (%a): expected %04" PRIx32 ", got %04x", pat[i],
             (double)src[i], want[i], out[i]);
    }
  }
  return t;
}

static void test_sweeps(const sweep_opts* o) {
  uint32_t* pat = xmalloc(CHUNK * sizeof *pat);
  float* src = xmalloc(CHUNK * sizeof *src);
  uint16_t* out = xmalloc(CHUNK * sizeof *out);
  uint16_t* first_sr = xmalloc(CHUNK * sizeof *first_sr);
  uint32_t* exp_b = xmalloc(CHUNK * sizeof *exp_b);
  uint32_t* exp_h = xmalloc(CHUNK * sizeof *exp_h);
  uint32_t* exp_s = xmalloc(CHUNK * sizeof *exp_s);
  uint32_t* exp_lo = xmalloc(CHUNK * sizeof *exp_lo);
  uint32_t* exp_hi = xmalloc(CHUNK * sizeof *exp_hi);
  unsigned char* nan = xmalloc(CHUNK);

  group gb[MP_ISA_COUNT], gh[MP_ISA_COUNT], gs[MP_ISA_COUNT], gx, gref, gf16c;
#if HAVE_F16C_REF
  int use_f16c = have_f16c();
#else
  int use_f16c = 0;
#endif
  double tk[3][MP_ISA_COUNT] = {{0}};
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    g_begin(&gb[k], "fp32->bf16 RNE sweep [%s]", nm);
    g_begin(&gh[k], "fp32->fp16 RNE sweep [%s]", nm);
    g_begin(&gs[k], "fp32->bf16 stochastic sweep: one of the two neighbours, = definition [%s]",
            nm);
  }
  g_begin(&gx, "fp32->bf16 stochastic sweep: identical bits on every ISA path");
  g_begin(&gref, "test reference: double-based fp16 rounding == compiler _Float16 (%s)",
          use_f16c ? "specials and boundary patterns" : "all sweep inputs");
  g_begin(&gf16c, "test reference: double-based fp16 rounding == CPU F16C (all sweep inputs)");

  uint64_t n_strided = o->stride ? ((0xFFFFFFFFull / o->stride) + 1u) : 0u;
  pat_iter it = {0, 0, o->stride, n_strided, o->n_random, o->seed};
  uint64_t sr_seed = hash64(o->seed ^ 0x5EEDu);
  sr_stream st = {0};
  uint64_t total = 0, chunk = 0;
  size_t n;
  double t_ref = 0;
  while ((n = next_patterns(&it, pat, CHUNK)) > 0) {
    memcpy(src, pat, n * sizeof *pat);
    uint64_t offset = chunk_offset(chunk, o->seed);
    double t0 = now_s();
    for (size_t i = 0; i < n; ++i) {
      int nh;
      bf16_ref rb = {0, 0, 0, 0};
      uint32_t r = sr_word(&st, sr_seed, offset + i) & 0xFFFFu;
      nan[i] = (unsigned char)ref_bf16_all(pat[i], r, &rb);
      exp_b[i] = rb.rne;
      exp_s[i] = rb.sr;
      exp_lo[i] = rb.lo;
      exp_hi[i] = rb.hi;
      exp_h[i] = ref_rne(pat[i], &FP16, &nh);
      /* second fp16 reference: _Float16 (software) on the specials and boundary patterns, and
       * on everything when the CPU has no F16C */
#if HAVE_FLOAT16
      if (!nh && (total + i < 2 * N_SPECIALS + N_BOUNDARY || !use_f16c)) {
        uint32_t c = f16_by_compiler(pat[i]);
        g_check(&gref, exp_h[i] == c, "input %08" PRIx32 ": double reference %04" PRIx32
                ", _Float16 %04" PRIx32, pat[i], exp_h[i], c);
      }
#endif
    }
#if HAVE_F16C_REF
    if (use_f16c) {
      f16_by_f16c(src, out, n);
      for (size_t i = 0; i < n; ++i) {
        if (nan[i]) continue;
        g_check(&gf16c, exp_h[i] == out[i], "input %08" PRIx32 ": double reference %04" PRIx32
                ", F16C %04x", pat[i], exp_h[i], out[i]);
      }
    }
#endif
    t_ref += now_s() - t0;
    for (int k = 0; k < g_nisa; ++k) {
      const char* nm = mp_isa_name(g_isas[k]);
      select_isa(g_isas[k]);
      tk[0][k] += check_rne(&gb[k], mp_to_bf16_f32, &BF16, pat, src, out, nan, exp_b, n);
      tk[1][k] += check_rne(&gh[k], mp_to_fp16_f32, &FP16, pat, src, out, nan, exp_h, n);
      /* bf16 stochastic rounding */
      memset(out, 0xA5, n * sizeof *out);
      t0 = now_s();
      mp_status stt = mp_to_bf16_sr_f32(src, out, (int64_t)n, sr_seed, offset);
      tk[2][k] += now_s() - t0;
      g_check(&gs[k], stt == MP_OK, "status %d", (int)stt);
      for (size_t i = 0; i < n; ++i) {
        gs[k].count++;
        if (nan[i]) {
          const char* why = nan_result_problem(pat[i], out[i], &BF16);
          if (why) g_fail(&gs[k], "input %08" PRIx32 " (NaN): got %04x: %s", pat[i], out[i], why);
          continue;
        }
        if (out[i] != exp_lo[i] && out[i] != exp_hi[i]) {
          g_fail(&gs[k], "input %08" PRIx32 " (%a): got %04x, not a neighbour (%04" PRIx32
                 " or %04" PRIx32 ")", pat[i], (double)src[i], out[i], exp_lo[i], exp_hi[i]);
          continue;
        }
        if (out[i] != exp_s[i]) {
          g_fail(&gs[k], "input %08" PRIx32 " seed %016" PRIx64 " index %016" PRIx64
                 ": expected %04" PRIx32 ", got %04x", pat[i], sr_seed, offset + i, exp_s[i],
                 out[i]);
        }
      }
      if (k == 0) {
        memcpy(first_sr, out, n * sizeof *out);
      } else {
        for (size_t i = 0; i < n; ++i) {
          g_check(&gx, out[i] == first_sr[i], "input %08" PRIx32 " index %016" PRIx64
                  ": %s gives %04x, %s gives %04x", pat[i], offset + i, mp_isa_name(g_isas[0]),
                  first_sr[i], nm, out[i]);
        }
      }
    }
    total += n;
    chunk++;
  }
  printf("      sweep: %" PRIu64 " fp32 patterns (%zu specials, %u boundary, %" PRIu64
         " every %" PRIu64 "th, %" PRIu64 " random); references %.2f s\n",
         total, 2 * N_SPECIALS, N_BOUNDARY, n_strided, o->stride, o->n_random, t_ref);
  for (int k = 0; k < g_nisa; ++k) {
    printf("      kernels [%s]: bf16 %.2f ns/elt, fp16 %.2f ns/elt, bf16 sr %.2f ns/elt\n",
           mp_isa_name(g_isas[k]), 1e9 * tk[0][k] / (double)total,
           1e9 * tk[1][k] / (double)total, 1e9 * tk[2][k] / (double)total);
  }
#if HAVE_FLOAT16
  g_end(&gref);
#else
  printf("SKIP  test reference vs _Float16: the compiler has no _Float16\n");
#endif
  if (use_f16c) {
    g_end(&gf16c);
  } else {
    printf("SKIP  test reference vs F16C: %s\n",
           HAVE_F16C_REF ? "the CPU has no F16C" : "not an x86 GCC/clang build");
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&gb[k]);
  for (int k = 0; k < g_nisa; ++k) g_end(&gh[k]);
  for (int k = 0; k < g_nisa; ++k) g_end(&gs[k]);
  if (g_nisa > 1) {
    g_end(&gx);
  } else {
    printf("SKIP  cross-ISA identity: only one ISA path available\n");
  }

  free(pat);
  free(src);
  free(out);
  free(first_sr);
  free(exp_b);
  free(exp_h);
  free(exp_s);
  free(exp_lo);
  free(exp_hi);
  free(nan);
}

/* ------------------------------------------------------------------------------------------ */
/* 4. Every bf16 and fp16 value to fp32. */
static void test_widening(void) {
  uint16_t* all = xmalloc(65536 * sizeof *all);
  float* out = xmalloc(65536 * sizeof *out);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = (uint16_t)i;

#if HAVE_FLOAT16
  {
    group g;
    g_begin(&g, "test reference: fp16 field decoder == compiler _Float16 (all 65536)");
    for (uint32_t h = 0; h < 65536; ++h) {
      if (is_nan_fmt(h, &FP16)) continue;
      uint32_t a = bits_of((float)decode(h, &FP16));
      uint32_t b = f32_of_f16_by_compiler((uint16_t)h);
      g_check(&g, a == b, "fp16 %04" PRIx32 ": decoder %08" PRIx32 ", _Float16 %08" PRIx32, h, a,
              b);
    }
    g_end(&g);
  }
#endif

  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;

    g_begin(&g, "bf16->fp32 all 65536 values exact [%s]", nm);
    memset(out, 0xA5, 65536 * sizeof *out);
    g_check(&g, mp_to_fp32_bf16(all, out, 65536) == MP_OK, "status");
    for (uint32_t h = 0; h < 65536; ++h) {
      /* NaNs widen exactly as well (payload and sign kept): the value is the bf16's bits. */
      uint32_t want = is_nan_fmt(h, &BF16) ? (h << 16) : bits_of((float)decode(h, &BF16));
      uint32_t got = bits_of(out[h]);
      g_check(&g, got == want, "bf16 %04" PRIx32 ": expected %08" PRIx32 ", got %08" PRIx32, h,
              want, got);
    }
    g_end(&g);

    g_begin(&g, "fp16->fp32 all 65536 values exact [%s]", nm);
    memset(out, 0xA5, 65536 * sizeof *out);
    g_check(&g, mp_to_fp32_fp16(all, out, 65536) == MP_OK, "status");
    for (uint32_t h = 0; h < 65536; ++h) {
      uint32_t got = bits_of(out[h]);
      if (is_nan_fmt(h, &FP16)) {
        /* NaN stays NaN with its sign and payload; quieting it is allowed. */
        uint32_t want = ((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13);
        g_check(&g, got == want || got == (want | 0x00400000u), "fp16 NaN %04" PRIx32
                ": expected %08" PRIx32 " (or quieted), got %08" PRIx32, h, want, got);
      } else {
        uint32_t want = bits_of((float)decode(h, &FP16));
        g_check(&g, got == want, "fp16 %04" PRIx32 ": expected %08" PRIx32 ", got %08" PRIx32, h,
                want, got);
      }
    }
    g_end(&g);

    /* Round trips: every non-NaN bf16/fp16 survives widening then RNE narrowing. */
    g_begin(&g, "bf16/fp16 -> fp32 -> same format round trip (all values) [%s]", nm);
    uint16_t* back = xmalloc(65536 * sizeof *back);
    for (int trip = 0; trip < 3; ++trip) { /* bf16 by RNE, bf16 by SR, fp16 by RNE */
      const fmt* f = trip < 2 ? &BF16 : &FP16;
      g_check(&g, (trip < 2 ? mp_to_fp32_bf16 : mp_to_fp32_fp16)(all, out, 65536) == MP_OK,
              "status");
      const mp_status st = trip == 0   ? mp_to_bf16_f32(out, back, 65536)
                           : trip == 1 ? mp_to_bf16_sr_f32(out, back, 65536, 99u, 7u)
                                       : mp_to_fp16_f32(out, back, 65536);
      g_check(&g, st == MP_OK, "status");
      for (uint32_t h = 0; h < 65536; ++h) {
        if (is_nan_fmt(h, f)) continue;
        g_check(&g, back[h] == h, "%s %04" PRIx32 " came back%s as %04x", trip < 2 ? "bf16" :
                "fp16", h, trip == 1 ? " from SR" : "", back[h]);
      }
    }
    free(back);
    g_end(&g);
  }
  free(all);
  free(out);
}

/* ------------------------------------------------------------------------------------------ */
/* 5. Stochastic rounding: determinism, splitting, statistics. */
static void test_sr_properties(uint64_t seed0) {
  uint64_t s = seed0 ^ 0xABCDEFu;
  const int64_t NMAX = 4096;
  float* src = xmalloc((size_t)NMAX * sizeof *src);
  uint16_t* whole = xmalloc((size_t)NMAX * sizeof *whole);
  uint16_t* again = xmalloc((size_t)NMAX * sizeof *again);
  uint16_t* pieces = xmalloc((size_t)NMAX * sizeof *pieces);
  static const uint64_t edge_offsets[] = {0u, 1u, 2u, 3u, 255u, 256u, 257u, UINT64_MAX,
                                          UINT64_MAX - 1u, UINT64_MAX - 2u, UINT64_MAX - 300u,
                                          (1ull << 34) - 2u, (1ull << 34) - 777u, 1ull << 63};

  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group gd, gsp, gseed;
    g_begin(&gd, "SR: same (seed, offset) gives the same bits [%s]", nm);
    g_begin(&gsp, "SR: split at arbitrary boundaries (offset + start) == one call [%s]", nm);
    g_begin(&gseed, "SR: a different seed or offset changes the bits [%s]", nm);
    uint64_t ls = s; /* same inputs on every path */
    for (int trial = 0; trial < 300; ++trial) {
      int64_t n = 1 + (int64_t)(splitmix64(&ls) % (uint64_t)NMAX);
      if (trial < 40) n = 1 + trial; /* short calls: only the head, or head + one block */
      uint64_t seed = trial % 5 == 0 ? (uint64_t)trial : splitmix64(&ls);
      uint64_t offset = trial < (int)(sizeof edge_offsets / sizeof edge_offsets[0])
                            ? edge_offsets[trial]
                            : (trial % 3 == 0 ? edge_offsets[trial % 14] + splitmix64(&ls) % 8u
                                              : splitmix64(&ls));
      /* index wrap-around past 2^64 is tested separately (test_sr_wrap) */
      if (offset > UINT64_MAX - (uint64_t)(n - 1)) offset = UINT64_MAX - (uint64_t)(n - 1);
      for (int64_t i = 0; i < n; ++i) src[i] = f32_of(random_input(&ls));
      /* whole, and again */
      g_check(&gd, mp_to_bf16_sr_f32(src, whole, n, seed, offset) == MP_OK, "status");
      memset(again, 0x5A, (size_t)n * sizeof *again);
      g_check(&gd, mp_to_bf16_sr_f32(src, again, n, seed, offset) == MP_OK, "status");
      for (int64_t i = 0; i < n; ++i) {
        g_check(&gd, whole[i] == again[i], "trial %d n %" PRId64 " i %" PRId64 ": %04x then %04x",
                trial, n, i, whole[i], again[i]);
      }
      /* pieces; processed backwards on odd trials, so that a piece writing past its end would
       * clobber an element already written (forward order catches writes before the start) */
      int64_t cuts[4200];
      int ncut = 0;
      int64_t pos = 0;
      cuts[ncut++] = 0;
      while (pos < n) {
        uint64_t r = splitmix64(&ls);
        int64_t len = (r & 3u) == 0 ? (int64_t)(r >> 8) % 8 : (int64_t)(r >> 8) % 700;
        if (pos + len > n) len = n - pos;
        pos += len;
        cuts[ncut++] = pos;
      }
      memset(pieces, 0x5A, (size_t)n * sizeof *pieces);
      for (int c = 0; c + 1 < ncut; ++c) {
        int cc = (trial & 1) ? ncut - 2 - c : c;
        int64_t a = cuts[cc], b = cuts[cc + 1];
        mp_status st = mp_to_bf16_sr_f32(src + a, pieces + a, b - a, seed, offset + (uint64_t)a);
        g_check(&gsp, st == MP_OK, "status %d", (int)st);
      }
      for (int64_t i = 0; i < n; ++i) {
        g_check(&gsp, pieces[i] == whole[i], "trial %d n %" PRId64 " seed %016" PRIx64
                " offset %016" PRIx64 " element %" PRId64 " (input %08" PRIx32
                "): one call %04x, pieces %04x", trial, n, seed, offset, i, bits_of(src[i]),
                whole[i], pieces[i]);
      }
    }
    /* Different seed / offset: over many inputs strictly between two bf16 values, some change. */
    for (int64_t i = 0; i < NMAX; ++i) {
      src[i] = f32_of(0x3F800000u | (uint32_t)(0x4000 + (i * 0x9E37) % 0x8000));
    }
    mp_to_bf16_sr_f32(src, whole, NMAX, 1u, 0u);
    mp_to_bf16_sr_f32(src, again, NMAX, 2u, 0u);
    int64_t diff = 0;
    for (int64_t i = 0; i < NMAX; ++i) diff += whole[i] != again[i];
    g_check(&gseed, diff > NMAX / 8, "seeds 1 and 2 differ in only %" PRId64 " of %" PRId64, diff,
            NMAX);
    mp_to_bf16_sr_f32(src, again, NMAX, 1u, 4u);
    diff = 0;
    for (int64_t i = 0; i < NMAX; ++i) diff += whole[i] != again[i];
    g_check(&gseed, diff > NMAX / 8, "offsets 0 and 4 differ in only %" PRId64 " of %" PRId64,
            diff, NMAX);
    g_end(&gd);
    g_end(&gsp);
    g_end(&gseed);

    /* Statistics: the fraction rounded up equals the discarded fraction (within 6 sigma; the
     * seeds are fixed, so this is deterministic). */
    group gst;
    g_begin(&gst, "SR: probability of rounding up = discarded fraction (both signs) [%s]", nm);
    const int64_t N = 1 << 16;
    float* xs = xmalloc((size_t)N * sizeof *xs);
    uint16_t* ys = xmalloc((size_t)N * sizeof *ys);
    static const uint32_t fracs[] = {1u, 0x0100u, 0x4000u, 0x8000u, 0xC000u, 0xFFFFu};
    for (size_t f = 0; f < sizeof fracs / sizeof fracs[0]; ++f) {
      for (int neg = 0; neg < 2; ++neg) {
        uint32_t base = (neg ? 0xC0490000u : 0x40490000u);
        for (int64_t i = 0; i < N; ++i) xs[i] = f32_of(base | fracs[f]);
        mp_to_bf16_sr_f32(xs, ys, N, 0xC0FFEEu + f, (uint64_t)f << 40);
        int64_t up = 0;
        for (int64_t i = 0; i < N; ++i) up += ys[i] == (uint16_t)((base >> 16) + 1u);
        double p = (double)fracs[f] / 65536.0;
        double mean = p * (double)N, sd = sqrt((double)N * p * (1.0 - p));
        g_check(&gst, fabs((double)up - mean) <= 6.0 * sd + 1.0, "fraction %04" PRIx32
                " sign %d: %" PRId64 " of %" PRId64 " rounded up, expected %.1f +- %.1f",
                fracs[f], neg, up, N, mean, sd);
      }
    }
    free(xs);
    free(ys);
    g_end(&gst);
  }
  free(src);
  free(whole);
  free(again);
  free(pieces);
}

/* The element index offset + i is a uint64_t, so inside one call it may wrap from 2^64 - 1 to 0.
 * Element i must still use the documented word for index (offset + i) mod 2^64 (the same bits as
 * a separate call that starts at offset 0), whatever the call's head/block split. */
static void test_sr_wrap(uint64_t seed0) {
  const int64_t N = 1100;
  float* src = xmalloc((size_t)N * sizeof *src);
  uint16_t* one = xmalloc((size_t)N * sizeof *one);
  uint16_t* split = xmalloc((size_t)N * sizeof *split);
  uint64_t s = seed0 ^ 0x77u;
  sr_stream st = {0};
  /* Normal numbers with random discarded bits: a wrong random word shows in about 1 of 3. */
  for (int64_t i = 0; i < N; ++i) {
    src[i] = f32_of(0x3F800000u | ((uint32_t)splitmix64(&s) & 0x807FFFFFu));
  }
  static const uint64_t dists[] = {1u, 2u, 3u, 4u, 5u, 7u, 8u, 9u, 12u, 16u, 17u, 100u,
                                   255u, 256u, 257u, 260u, 511u, 512u, 1000u, 1024u};
  const uint64_t seed = 1u;
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "SR: index offset + i wraps modulo 2^64 inside one call (= definition, = split "
            "at the wrap) [%s]", nm);
    for (size_t t = 0; t < sizeof dists / sizeof dists[0]; ++t) {
      uint64_t d = dists[t], offset = (uint64_t)0 - d;
      g_check(&g, mp_to_bf16_sr_f32(src, one, N, seed, offset) == MP_OK, "status");
      g_check(&g, mp_to_bf16_sr_f32(src, split, (int64_t)d, seed, offset) == MP_OK, "status");
      g_check(&g, mp_to_bf16_sr_f32(src + d, split + d, N - (int64_t)d, seed, 0u) == MP_OK,
              "status");
      for (int64_t i = 0; i < N; ++i) {
        uint64_t idx = offset + (uint64_t)i;
        uint32_t r16 = sr_word(&st, seed, idx) & 0xFFFFu;
        int isn;
        uint32_t want = ref_sr(bits_of(src[i]), r16, &isn);
        g_check(&g, one[i] == want && split[i] == want,
                "seed %" PRIu64 ", offset 2^64-%" PRIu64 ", n %" PRId64 ": element %" PRId64
                " (index %" PRIu64 ", input %08" PRIx32 ", random low 16 bits %04" PRIx32
                "): expected %04" PRIx32 ", one call gave %04x, split at the wrap gave %04x",
                seed, d, N, i, idx, bits_of(src[i]), r16, want, one[i], split[i]);
      }
    }
    g_end(&g);
  }
  free(src);
  free(one);
  free(split);
}

/* ------------------------------------------------------------------------------------------ */
/* 6. Sizes and alignments: every n in 0..150 at element offsets 0..17 of src and dst, with
 *    guard elements around the destination. */
static void test_sizes_alignment(uint64_t seed0) {
  const int64_t MAXN = 150, MAXOFF = 17;
  size_t cap = (size_t)(MAXN + MAXOFF + 2 * GUARD);
  float* fsrc = xmalloc(cap * sizeof *fsrc);
  float* fdst = xmalloc(cap * sizeof *fdst);
  uint16_t* hsrc = xmalloc(cap * sizeof *hsrc);
  uint16_t* hdst = xmalloc(cap * sizeof *hdst);
  uint64_t s = seed0 ^ 0x1234u;
  sr_stream st = {0};
  for (size_t i = 0; i < cap; ++i) {
    fsrc[i] = f32_of(random_input(&s));
    hsrc[i] = (uint16_t)splitmix64(&s);
  }
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "all five casts: n = 0..%d at src/dst element offsets 0..%d, guards intact [%s]",
            (int)MAXN, (int)MAXOFF, nm);
    for (int64_t n = 0; n <= MAXN; ++n) {
      for (int64_t so = 0; so <= MAXOFF; ++so) {
        int64_t dof = (so * 7 + n) % (MAXOFF + 1);
        const float* fs = fsrc + GUARD + so;
        const uint16_t* hs = hsrc + GUARD + so;
        for (int fn = 0; fn < 5; ++fn) {
          uint64_t seed = (uint64_t)n * 31u + (uint64_t)so, offset = (uint64_t)so * 5u + 1u;
          mp_status r;
          if (fn < 3) {
            for (size_t i = 0; i < cap; ++i) hdst[i] = SENT16;
            uint16_t* d = hdst + GUARD + dof;
            r = fn == 0   ? mp_to_bf16_f32(fs, d, n)
                : fn == 1 ? mp_to_fp16_f32(fs, d, n)
                          : mp_to_bf16_sr_f32(fs, d, n, seed, offset);
            for (int64_t i = 0; i < n; ++i) {
              uint32_t u = bits_of(fs[i]), want;
              int isn;
              if (fn == 2) {
                want = ref_sr(u, sr_word(&st, seed, offset + (uint64_t)i) & 0xFFFFu, &isn);
              } else {
                want = ref_rne(u, fn == 0 ? &BF16 : &FP16, &isn);
              }
              if (isn) {
                g_check(&g, nan_result_problem(u, d[i], fn == 1 ? &FP16 : &BF16) == NULL,
                        "fn %d n %" PRId64 " offsets %" PRId64 "/%" PRId64 " i %" PRId64
                        ": NaN input %08" PRIx32 " gave %04x", fn, n, so, dof, i, u, d[i]);
              } else {
                g_check(&g, d[i] == want, "fn %d n %" PRId64 " offsets %" PRId64 "/%" PRId64
                        " i %" PRId64 ": input %08" PRIx32 " expected %04" PRIx32 " got %04x",
                        fn, n, so, dof, i, u, want, d[i]);
              }
            }
          } else {
            for (size_t i = 0; i < cap; ++i) fdst[i] = f32_of(SENT32);
            float* d = fdst + GUARD + dof;
            const fmt* f = fn == 3 ? &BF16 : &FP16;
            r = fn == 3 ? mp_to_fp32_bf16(hs, d, n) : mp_to_fp32_fp16(hs, d, n);
            for (int64_t i = 0; i < n; ++i) {
              uint32_t h = hs[i], got = bits_of(d[i]);
              if (is_nan_fmt(h, f)) {
                g_check(&g, isnan(d[i]), "fn %d: NaN %04" PRIx32 " gave %08" PRIx32, fn, h, got);
              } else {
                uint32_t want = bits_of((float)decode(h, f));
                g_check(&g, got == want, "fn %d n %" PRId64 " offsets %" PRId64 "/%" PRId64
                        " i %" PRId64 ": input %04" PRIx32 " expected %08" PRIx32 " got %08"
                        PRIx32, fn, n, so, dof, i, h, want, got);
              }
            }
          }
          /* the guards around the destination keep their sentinels */
          for (size_t i = 0; i < cap; ++i) {
            if ((int64_t)i >= GUARD + dof && (int64_t)i < GUARD + dof + n) continue;
            g_check(&g, fn < 3 ? hdst[i] == SENT16 : bits_of(fdst[i]) == SENT32, "fn %d n %"
                    PRId64 " offsets %" PRId64 "/%" PRId64 ": wrote outside [0, n) at %" PRId64,
                    fn, n, so, dof, (int64_t)i - GUARD - dof);
          }
          g_check(&g, r == MP_OK, "fn %d n %" PRId64 ": status %d", fn, n, (int)r);
        }
      }
    }
    g_end(&g);
  }
  free(fsrc);
  free(fdst);
  free(hsrc);
  free(hdst);
}

/* ------------------------------------------------------------------------------------------ */
/* 7. Argument checks. */
static void test_arguments(void) {
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "argument checks: n < 0 / NULL with n > 0 rejected, nothing written; n == 0 ok "
            "[%s]", nm);
    float fs[8], fd[8];
    uint16_t hs[8], hd[8];
    for (int i = 0; i < 8; ++i) {
      fs[i] = (float)i + 0.3f;
      hs[i] = (uint16_t)(0x3C00u + (unsigned)i);
    }
    static const int64_t bad_n[] = {-1, -2, -8, INT64_MIN, -((int64_t)1 << 40)};
    for (int fn = 0; fn < 5; ++fn) {
      /* case 0..4: a negative count with valid pointers; 5: NULL src; 6: NULL dst; 7: both NULL;
       * 8..10: n == 0 with NULL/valid pointers (MP_OK, nothing written). */
      for (int c = 0; c < 11; ++c) {
        int64_t n = c < 5 ? bad_n[c] : (c < 8 ? 4 : 0);
        int null_src = c == 5 || c == 7 || c == 8;
        int null_dst = c == 6 || c == 7 || c == 9;
        mp_status want = c < 8 ? MP_ERR_INVALID_ARGUMENT : MP_OK;
        for (int i = 0; i < 8; ++i) {
          fd[i] = f32_of(SENT32);
          hd[i] = SENT16;
        }
        const float* s32 = null_src ? NULL : fs;
        const uint16_t* s16 = null_src ? NULL : hs;
        float* d32 = null_dst ? NULL : fd;
        uint16_t* d16 = null_dst ? NULL : hd;
        mp_status r;
        switch (fn) {
          case 0: r = mp_to_bf16_f32(s32, d16, n); break;
          case 1: r = mp_to_fp16_f32(s32, d16, n); break;
          case 2: r = mp_to_bf16_sr_f32(s32, d16, n, 1u, 2u); break;
          case 3: r = mp_to_fp32_bf16(s16, d32, n); break;
          default: r = mp_to_fp32_fp16(s16, d32, n); break;
        }
        g_check(&g, r == want, "fn %d case %d (n %" PRId64 ", src %s, dst %s): status %d, "
                "expected %d", fn, c, n, null_src ? "NULL" : "ok", null_dst ? "NULL" : "ok",
                (int)r, (int)want);
        int untouched = 1;
        for (int i = 0; i < 8; ++i) {
          if (bits_of(fd[i]) != SENT32 || hd[i] != SENT16) untouched = 0;
        }
        g_check(&g, untouched, "fn %d case %d (n %" PRId64 "): the destination was written", fn,
                c, n);
      }
    }
    g_end(&g);
  }
  group g;
  g_begin(&g, "mp_status_string gives text for every status");
  static const mp_status all[] = {MP_OK, MP_ERR_INVALID_ARGUMENT, MP_ERR_UNSUPPORTED_ISA,
                                  MP_ERR_CUDA};
  for (int i = 0; i < 4; ++i) {
    const char* t = mp_status_string(all[i]);
    g_check(&g, t != NULL && t[0] != '\0', "status %d has no text", (int)all[i]);
  }
  g_end(&g);
}

/* 12. mp_cast: every supported pair is the typed conversion (or a copy) with the same bits;
 *     unsupported pairs and stochastic rounding into fp16 are rejected, writing nothing. */
static void test_cast_dispatch(uint64_t seed0) {
  uint64_t s = seed0 ^ 0xCA57u;
  enum { N = 1000 };
  float f[N], f2[N];
  uint16_t h[N], h2[N];
  for (int i = 0; i < N; ++i) {
    f[i] = f32_of(random_input(&s));
    h[i] = (uint16_t)splitmix64(&s);
  }
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "mp_cast: each pair == its typed function, copies exact, bad pairs rejected "
            "[%s]", mp_isa_name(g_isas[k]));
    g_check(&g, mp_cast(f, MP_F32, h2, MP_BF16, N, 0, 0, 0, 0) == MP_OK &&
                mp_to_bf16_f32(f, h, N) == MP_OK && memcmp(h, h2, sizeof h) == 0,
            "f32 -> bf16");
    g_check(&g, mp_cast(f, MP_F32, h2, MP_BF16, N, 1, 7u, 1234u, 0) == MP_OK &&
                mp_to_bf16_sr_f32(f, h, N, 7u, 1234u) == MP_OK && memcmp(h, h2, sizeof h) == 0,
            "f32 -> bf16 stochastic");
    g_check(&g, mp_cast(f, MP_F32, h2, MP_F16, N, 0, 0, 0, 0) == MP_OK &&
                mp_to_fp16_f32(f, h, N) == MP_OK && memcmp(h, h2, sizeof h) == 0,
            "f32 -> f16");
    g_check(&g, mp_cast(h, MP_BF16, f2, MP_F32, N, 0, 0, 0, 0) == MP_OK &&
                mp_to_fp32_bf16(h, f, N) == MP_OK && memcmp(f, f2, sizeof f) == 0,
            "bf16 -> f32");
    g_check(&g, mp_cast(h, MP_F16, f2, MP_F32, N, 0, 0, 0, 0) == MP_OK &&
                mp_to_fp32_fp16(h, f, N) == MP_OK && memcmp(f, f2, sizeof f) == 0,
            "f16 -> f32");
    g_check(&g, mp_cast(f, MP_F32, f2, MP_F32, N, 1, 0, 0, 0) == MP_OK &&
                memcmp(f, f2, sizeof f) == 0 &&
                mp_cast(h, MP_BF16, h2, MP_BF16, N, 0, 0, 0, 0) == MP_OK &&
                memcmp(h, h2, sizeof h) == 0,
            "copies");
    memset(h2, 0xAB, sizeof h2);
    g_check(&g, mp_cast(f, MP_F32, h2, MP_F16, N, 1, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(h, MP_BF16, h2, MP_F16, N, 0, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(h, (mp_dtype)3, h2, MP_F16, N, 0, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(h, MP_F16, h2, (mp_dtype)-1, N, 0, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(NULL, MP_F32, h2, MP_BF16, 1, 0, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(f, MP_F32, h2, MP_BF16, -1, 0, 0, 0, 0) == MP_ERR_INVALID_ARGUMENT &&
                mp_cast(NULL, MP_F32, NULL, MP_BF16, 0, 0, 0, 0, 0) == MP_OK,
            "rejections");
    int untouched = 1;
    for (int i = 0; i < N; ++i) untouched &= h2[i] == 0xABABu;
    g_check(&g, untouched, "a rejected call wrote");
    g_end(&g);
  }
}

/* 12b. mp_cast's dst_fresh: a large output (8 MiB and more per call: streamed with
 *      non-temporal stores unless dst_fresh) has the typed function's bits either way, dst
 *      aligned or not (the streamed path converts a head up to 32-byte alignment, whole blocks,
 *      then a tail), and nothing past its end is written. */
static void test_cast_large_outputs(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x57AEu;
  const int64_t n16 = ((int64_t)8 << 20) / 2 + 1037; /* 16-bit outputs past 8 MiB */
  const int64_t n32 = ((int64_t)8 << 20) / 4 + 1037; /* fp32 outputs past 8 MiB */
  float* f = malloc((size_t)n16 * sizeof *f);
  uint16_t* h = malloc((size_t)n32 * sizeof *h);
  uint16_t* want16 = malloc((size_t)n16 * sizeof *want16);
  uint16_t* got16 = malloc((size_t)(n16 + 2) * sizeof *got16);
  float* want32 = malloc((size_t)n32 * sizeof *want32);
  float* got32 = malloc((size_t)(n32 + 2) * sizeof *got32);
  if (!f || !h || !want16 || !got16 || !want32 || !got32) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  for (int64_t i = 0; i < n16; ++i) f[i] = f32_of(random_input(&s));
  for (int64_t i = 0; i < n32; ++i) h[i] = (uint16_t)splitmix64(&s);
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "mp_cast: outputs past 8 MiB, streamed or not (dst_fresh), == typed function, "
            "any dst alignment [%s]", mp_isa_name(g_isas[k]));
    for (int pair = 0; pair < 4; ++pair) {
      const int to16 = pair < 2;
      const mp_dtype half = pair == 0 || pair == 2 ? MP_BF16 : MP_F16;
      if (to16) {
        if (half == MP_BF16) mp_to_bf16_f32(f, want16, n16);
        else mp_to_fp16_f32(f, want16, n16);
      } else {
        if (half == MP_BF16) mp_to_fp32_bf16(h, want32, n32);
        else mp_to_fp32_fp16(h, want32, n32);
      }
      for (int fresh = 0; fresh < 2; ++fresh) {
        for (int shift = 0; shift < 2; ++shift) { /* dst at +0 and +1 element */
          int ok;
          if (to16) {
            memset(got16, 0xA5, (size_t)(n16 + 2) * sizeof *got16);
            ok = mp_cast(f, MP_F32, got16 + shift, half, n16, 0, 0, 0, fresh) == MP_OK &&
                 memcmp(got16 + shift, want16, (size_t)n16 * sizeof *got16) == 0 &&
                 got16[shift + n16] == 0xA5A5u && (shift == 0 || got16[0] == 0xA5A5u);
          } else {
            memset(got32, 0xA5, (size_t)(n32 + 2) * sizeof *got32);
            uint32_t after, before;
            ok = mp_cast(h, half, got32 + shift, MP_F32, n32, 0, 0, 0, fresh) == MP_OK &&
                 memcmp(got32 + shift, want32, (size_t)n32 * sizeof *got32) == 0;
            memcpy(&after, got32 + shift + n32, sizeof after);
            memcpy(&before, got32, sizeof before);
            ok = ok && after == 0xA5A5A5A5u && (shift == 0 || before == 0xA5A5A5A5u);
          }
          const char* hn = half == MP_BF16 ? "bf16" : "f16";
          g_check(&g, ok, "%s -> %s, dst_fresh %d, dst + %d", to16 ? "f32" : hn,
                  to16 ? hn : "f32", fresh, shift);
        }
      }
    }
    g_end(&g);
  }
  free(f);
  free(h);
  free(want16);
  free(got16);
  free(want32);
  free(got32);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_arguments();
  test_reference_selfcheck();
  test_widening();
  test_sizes_alignment(o->seed);
  test_sr_properties(o->seed);
  test_sr_wrap(o->seed);
  test_cast_dispatch(o->seed);
  test_cast_large_outputs(o->seed);
  test_sweeps(o);
}
