/* Plain C tests of the mpext C core, through its public C API (mpext.h, cast.h, scale.h,
 * adam.h, numerics.h).
 *
 * Built and run by tests/c/run.py (CI: -fsanitize=address,undefined; also plain -O3 under
 * valgrind). Every conversion runs on every ISA path this CPU supports and is compared with
 * references written independently of csrc/core and numerics.h:
 *   - fp32 -> bf16/fp16 round to nearest even: double arithmetic (the truncated and next-up
 *     candidates at the format's quantum, nearer one wins, ties to the even significand, then an
 *     encoder from (value, exponent) to bits); for fp16 that reference is itself checked
 *     against the CPU's F16C conversion on every sweep input (when the CPU has F16C) and against
 *     the compiler's _Float16 on the boundary patterns (on all inputs without F16C);
 *   - bf16/fp16 -> fp32: a field decoder built on ldexp (checked against _Float16 for fp16);
 *   - stochastic rounding: the documented definition (the counter-based generator of numerics.h
 *     keyed by the seed, position offset + i, low 16 bits) with this file's own statement, checked
 *     against the Random123 known-answer vectors;
 *   - unscale (mp_unscale): the value decoded to double, multiplied there (exact),
 *     rounded once to fp32, then by the RNE reference above; found and "inv_scale == 1 stores
 *     nothing" (read-only pages on Linux) checked on their own;
 *   - the loss-scale update (mp_update_scale): torch's _amp_update_scale_ restated, and the
 *     hysteresis / min_scale / max_scale / stats extensions restated from scale_rule.h's
 *     documentation, over random sequences of found_inf, plus hand-worked sequences.
 *   - the fused Adam/AdamW step (mp_step, rule MP_RULE_ADAM): rules/adam.h's formula restated in step-by-step float
 *     arithmetic (bit for bit on every path, so the paths agree), with the scalars derived as
 *     the torch binding derives them; a 50-step run against Adam in double; NaN/Inf grads;
 *     sizes, offsets and guards; argument checks; 8-bit moments against the format restated
 *     in double (every code's value, exhaustive nearest/stochastic choice) block by block.
 *   - Lion and SGD (the other rules of mp_step): lion-pytorch's and torch.optim.SGD's
 *     update restated in float (fmaf for each add(alpha=)), in every param storage and moment
 *     format, with the rounding references above (bit for bit on every path).
 *   - grad_norm (mp_grad_norm_sumsq, mp_grad_norm_finish): the documented summation order
 *     restated over values multiplied in double and rounded to fp32 (bit for bit on every path),
 *     accuracy against long double, NaN/Inf, exact-size buffers at every offset.
 *
 * Output: one line per check group, then "N passed, M failed"; exit status 1 if anything failed.
 * Options: --stride S (fp32 sweep step over the 2^32 patterns, odd, default 257), --random N
 * (random patterns added to the sweep, default 2000000), --seed X (seed of the random inputs),
 * --isa NAME (test only that path; "best": the one this CPU selects by default). */
#if defined(__linux__)
#define _DEFAULT_SOURCE 1 /* mmap/mprotect (the inv_scale == 1 read-only test) */
#endif
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpext/adam.h" /* the mp_adam_* aliases of one release (checked in 11f) */
#include "mpext/step.h"
#include "mpext/step_storage.h"
#include "mpext/cast.h"
#include "mpext/mpext.h"
#include "mpext/norm.h"
#include "mpext/numerics.h"
#include "mpext/scale.h"

#if defined(__linux__)
#include <sys/mman.h>
#define HAVE_READONLY_PAGES 1
#else
#define HAVE_READONLY_PAGES 0
#endif

/* The moment format (mpext/formats/formats.h) of moments stored as dtype d: fp32, bf16, or the
 * 8-bit codes (int8 signed, uint8 non-negative); MP_FMT_COUNT (invalid) for any other. */
static int32_t fmt_of(mp_dtype d) {
  return d == MP_F32 ? MP_FMT_F32 : d == MP_BF16 ? MP_FMT_BF16 : d == MP_I8 ? MP_FMT_Q8S
         : d == MP_U8 ? MP_FMT_Q8U : MP_FMT_COUNT;
}

/* ------------------------------------------------------------------------------------------ */
/* Bookkeeping: a check group passes when it saw no failure. */

static int g_passed = 0, g_failed = 0;

#define MAX_DETAILS 8

typedef struct group {
  char name[128];
  long long bad;
  long long count;
  double t0;
} group;

static double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void g_begin(group* g, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->name, sizeof g->name, fmt, ap);
  va_end(ap);
  g->bad = 0;
  g->count = 0;
  g->t0 = now_s();
}

/* Records one failure; prints the first few in detail. */
static void g_fail(group* g, const char* fmt, ...) {
  if (++g->bad <= MAX_DETAILS) {
    va_list ap;
    va_start(ap, fmt);
    printf("    %s: ", g->name);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
  } else if (g->bad == MAX_DETAILS + 1) {
    printf("    %s: (further failures not shown)\n", g->name);
  }
}

/* Checks cond; on failure records it with the message. Returns cond. */
static int g_check(group* g, int cond, const char* fmt, ...) {
  g->count++;
  if (cond) return 1;
  if (++g->bad <= MAX_DETAILS) {
    va_list ap;
    va_start(ap, fmt);
    printf("    %s: ", g->name);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
  } else if (g->bad == MAX_DETAILS + 1) {
    printf("    %s: (further failures not shown)\n", g->name);
  }
  return 0;
}

static void g_end(group* g) {
  double dt = now_s() - g->t0;
  if (g->bad == 0) {
    g_passed++;
    printf("PASS  %s (%lld checks, %.2f s)\n", g->name, g->count, dt);
  } else {
    g_failed++;
    printf("FAIL  %s (%lld of %lld checks failed, %.2f s)\n", g->name, g->bad, g->count, dt);
  }
  fflush(stdout);
}

/* ------------------------------------------------------------------------------------------ */
/* Small helpers. */

static uint64_t splitmix64(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t hash64(uint64_t x) { return splitmix64(&x); }

static float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static void* xmalloc(size_t n) {
  void* p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

/* ------------------------------------------------------------------------------------------ */
/* Reference rounding in double arithmetic. A binary format is described by its significand
 * precision p (with the implicit bit), its smallest normal exponent emin, its exponent-field
 * width and its largest finite value. Every fp32 value is exact in double, and so are the
 * candidates and differences below (at most 24 significant bits, exponents well in range).
 * Powers of two and exponents are read from and built as double bit patterns (all the doubles
 * here are normal), which is exact and much cheaper than ldexp/ilogb in the 19M-input sweep. */

typedef struct fmt {
  int p;       /* significand bits including the implicit one */
  int emin;    /* exponent of the smallest normal */
  int ebits;   /* exponent field width */
  double max;  /* largest finite value */
} fmt;

static const fmt BF16 = {8, -126, 8, 0x1.FEp127};
static const fmt FP16 = {11, -14, 5, 65504.0};

/* 2^e for -1022 <= e <= 1023. */
static double pow2(int e) {
  uint64_t b = (uint64_t)(e + 1023) << 52;
  double d;
  memcpy(&d, &b, sizeof d);
  return d;
}

/* floor(log2(v)) for a normal double v > 0. */
static int exponent_of(double v) {
  uint64_t b;
  memcpy(&b, &v, sizeof b);
  return (int)((b >> 52) & 0x7FFu) - 1023;
}

/* The two format values around ax >= 0 (finite): lo = largest multiple of the quantum <= ax,
 * hi = lo + quantum (which may lie past the largest finite value), and k = lo / quantum. */
typedef struct cands {
  double lo, hi, q;
  uint64_t k;
} cands;

static cands candidates(double ax, const fmt* f) {
  cands c;
  int e = ax == 0.0 ? f->emin : exponent_of(ax);
  if (e < f->emin) e = f->emin;
  c.q = pow2(e - (f->p - 1));
  c.k = (uint64_t)(ax * pow2((f->p - 1) - e)); /* ax / q < 2^p: exact; truncation = floor */
  c.lo = (double)c.k * c.q;
  c.hi = c.lo + c.q;
  return c;
}

/* Round to nearest, ties to the even significand, with an unbounded exponent range above. */
static double round_rne(double ax, const fmt* f) {
  cands c = candidates(ax, f);
  double dl = ax - c.lo, dh = c.hi - ax;
  if (dl < dh) return c.lo;
  if (dh < dl) return c.hi;
  return (c.k % 2u) == 0u ? c.lo : c.hi;
}

/* Encodes a non-negative value of the format (or anything above its largest finite value, which
 * becomes Inf) with the given sign, from its exponent and significand. */
static uint32_t encode(double v, int neg, const fmt* f) {
  int mbits = f->p - 1;
  int bias = (1 << (f->ebits - 1)) - 1;
  uint32_t sign = neg ? (1u << (f->ebits + mbits)) : 0u;
  uint32_t expmask = ((1u << f->ebits) - 1u) << mbits;
  if (v > f->max) return sign | expmask;
  if (v == 0.0) return sign;
  int e = exponent_of(v);
  if (e < f->emin) return sign | (uint32_t)(v * pow2(mbits - f->emin));
  uint32_t m = (uint32_t)(v * pow2(mbits - e)) - (1u << mbits);
  return sign | ((uint32_t)(e + bias) << mbits) | m;
}

/* Decodes bits of the format to a double from the fields (NaN decodes to NAN). */
static double decode(uint32_t h, const fmt* f) {
  int mbits = f->p - 1;
  int bias = (1 << (f->ebits - 1)) - 1;
  uint32_t m = h & ((1u << mbits) - 1u);
  uint32_t e = (h >> mbits) & ((1u << f->ebits) - 1u);
  int neg = (h >> (f->ebits + mbits)) & 1u;
  double v;
  if (e == 0) {
    v = ldexp((double)m, f->emin - mbits);
  } else if (e == (1u << f->ebits) - 1u) {
    v = m ? NAN : INFINITY;
  } else {
    v = ldexp((double)(m + (1u << mbits)), (int)e - bias - mbits);
  }
  return neg ? -v : v;
}

static int is_nan_fmt(uint32_t h, const fmt* f) {
  int mbits = f->p - 1;
  uint32_t expmask = ((1u << f->ebits) - 1u) << mbits;
  return (h & expmask) == expmask && (h & ((1u << mbits) - 1u)) != 0;
}

/* A NaN result for a NaN input: must be NaN; cast.h also documents it as quiet with the input's
 * sign. Returns 0 if fine, else a short reason. */
static const char* nan_result_problem(uint32_t in, uint32_t out, const fmt* f) {
  int mbits = f->p - 1;
  if (!is_nan_fmt(out, f)) return "not a NaN";
  if (!(out & (1u << (mbits - 1)))) return "NaN not quiet";
  if ((out >> (f->ebits + mbits)) != (in >> 31)) return "NaN sign changed";
  return NULL;
}

/* Expected RNE result bits for fp32 bits u; *nan set for NaN inputs (no fixed bits then). */
static uint32_t ref_rne(uint32_t u, const fmt* f, int* nan) {
  float x = f32_of(u);
  *nan = isnan(x) ? 1 : 0;
  if (*nan) return 0;
  int neg = (u >> 31) != 0;
  if (isinf(x)) return encode(INFINITY, neg, f);
  return encode(round_rne(fabs((double)x), f), neg, f);
}

/* Expected stochastic-rounding bf16 bits for fp32 bits u and 16 random bits r16: the magnitude
 * rounds up iff (discarded fraction of a bf16 quantum) * 2^16 + r16 >= 2^16. */
static uint32_t ref_sr(uint32_t u, uint32_t r16, int* nan) {
  float x = f32_of(u);
  *nan = isnan(x) ? 1 : 0;
  if (*nan) return 0;
  int neg = (u >> 31) != 0;
  if (isinf(x)) return encode(INFINITY, neg, &BF16);
  double ax = fabs((double)x);
  cands c = candidates(ax, &BF16);
  double d = (ax - c.lo) / c.q * 65536.0; /* an integer in [0, 65536) */
  return encode(d + (double)r16 >= 65536.0 ? c.hi : c.lo, neg, &BF16);
}

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

/* ------------------------------------------------------------------------------------------ */
/* This file's statement of the stochastic-rounding generator (mpext/numerics.h's documentation):
 * a 32-bit mixer x ^= x >> 16, x *= 0x21F0AAAD, x ^= x >> 15, x *= 0xD35A2D97, x ^= x >> 15; a
 * key = m64(m64(m64(seed + golden) ^ step) ^ stream) with splitmix64's finalizer m64; the bits at
 * position p = m32(lo(p) ^ lo(key) ^ m32(hi(p) ^ hi(key))). */

static uint32_t ref_m32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x21F0AAADu;
  x = (x ^ (x >> 15)) * 0xD35A2D97u;
  return x ^ (x >> 15);
}

static uint64_t ref_m64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t ref_key(uint64_t seed, uint64_t step, uint64_t stream) {
  return ref_m64(ref_m64(ref_m64(seed + 0x9E3779B97F4A7C15ull) ^ step) ^ stream);
}

static uint32_t ref_bits(uint64_t key, uint64_t pos) {
  const uint32_t window = (uint32_t)(key & 0xFFFFFFFFu) ^ ref_m32((uint32_t)(pos >> 32) ^
                                                                  (uint32_t)(key >> 32));
  return ref_m32((uint32_t)(pos & 0xFFFFFFFFu) ^ window);
}

/* The documented random word of a cast's element index idx under seed (stream (seed, 0, 0)),
 * with the key cached across calls of one seed. */
typedef struct sr_stream {
  uint64_t seed, key;
  int valid;
} sr_stream;

static uint32_t sr_word(sr_stream* s, uint64_t seed, uint64_t idx) {
  if (!s->valid || s->seed != seed) {
    s->seed = seed;
    s->key = ref_key(seed, 0, 0);
    s->valid = 1;
  }
  return ref_bits(s->key, idx);
}

/* ------------------------------------------------------------------------------------------ */
/* ISA paths. */

static mp_isa g_isas[MP_ISA_COUNT];
static int g_nisa = 0;

static void select_isa(mp_isa isa) {
  if (mp_cpu_isa_select(isa) != MP_OK) {
    printf("cannot select ISA %s\n", mp_isa_name(isa));
    exit(2);
  }
}

static void describe_skip(mp_isa isa) {
  const char* why = "the CPU lacks it or it was not compiled in";
#if !defined(MP_X86_PATHS)
  if (isa != MP_ISA_SCALAR) why = "not compiled in (MP_X86_PATHS unset: not an x86 build)";
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static char buf[160];
  buf[0] = '\0';
  int missing = 0;
  strcat(buf, "CPU lacks");
#define MP_NEED(feat)                                 \
  do {                                                \
    if (!__builtin_cpu_supports(feat)) {              \
      strcat(buf, " ");                               \
      strcat(buf, feat);                              \
      missing++;                                      \
    }                                                 \
  } while (0)
  MP_NEED("avx2");
  MP_NEED("fma");
  MP_NEED("f16c");
  if (isa == MP_ISA_AVX512) {
    MP_NEED("avx512f");
    MP_NEED("avx512bw");
    MP_NEED("avx512vl");
    MP_NEED("avx512dq");
  }
#undef MP_NEED
  if (missing) why = buf;
#endif
  printf("SKIP  ISA path %s: %s\n", mp_isa_name(isa), why);
}

/* ------------------------------------------------------------------------------------------ */
/* Input patterns for the fp32 sweeps, produced in chunks:
 *   0: specials and hand-picked boundaries (both signs),
 *   1: structured tie/boundary patterns: every sign and exponent, for t = 1..23, the low t
 *      mantissa bits set to one of {0, 1, half-1, half, half+1, all ones} under random high bits
 *      (this hits every bf16 tie (t = 16), every fp16 normal tie (t = 13) and every fp16
 *      subnormal tie (larger t)),
 *   2: every stride-th pattern of the 2^32 (0 and 0xFFFFFFFF included when stride | 2^32-1),
 *   3: random patterns. */

static const uint32_t SPECIALS[] = {
    0x00000000u, 0x00000001u, 0x00000002u, 0x00007FFFu, 0x00008000u, 0x00008001u, 0x00018000u,
    0x0000FFFFu, 0x00010000u, 0x007FFFFFu, 0x007F8000u, 0x007F7FFFu, 0x007FFF00u, 0x00800000u,
    0x00800001u, 0x3F800000u, 0x3F800001u, 0x3F807FFFu, 0x3F808000u, 0x3F808001u, 0x3F818000u,
    0x3F81FFFFu, 0x3FFFFFFFu, 0x3F7FFFFFu, 0x3F7F8000u, 0x3F7F7FFFu, 0x7F7F0000u, 0x7F7F7FFFu,
    0x7F7F8000u, 0x7F7F8001u, 0x7F7FFFFFu, 0x7F7EFFFFu, 0x7F7E8000u, 0x7F800000u, 0x7F800001u,
    0x7F80FFFFu, 0x7F810000u, 0x7FBFFFFFu, 0x7FC00000u, 0x7FC00001u, 0x7FFFFFFFu, 0x7FFF0000u,
    /* fp16 boundaries */
    0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x477FF001u, 0x477FFFFFu, 0x47800000u, 0x477FD000u,
    0x477FC000u, 0x47000000u, 0x38800000u, 0x387FFFFFu, 0x387FF000u, 0x387FEFFFu, 0x387FE000u,
    0x33800000u, 0x337FFFFFu, 0x33000000u, 0x33000001u, 0x32FFFFFFu, 0x33400000u, 0x33C00000u,
    0x33A00000u, 0x33A00001u, 0x34000000u, 0x34400000u, 0x38000000u, 0x38001000u, 0x38002000u,
    0x38003000u, 0x387FC000u, 0x387FE001u, 0x3F801000u, 0x3F803000u, 0x3F800FFFu, 0x3F801001u,
    0x3F802FFFu, 0x2F800000u, 0x1F800000u, 0x4F800000u,
};
#define N_SPECIALS (sizeof SPECIALS / sizeof SPECIALS[0])
#define BOUNDARY_REPS 4u
#define N_BOUNDARY (2u * 256u * 23u * 6u * BOUNDARY_REPS)

typedef struct pat_iter {
  int phase;
  uint64_t i;
  uint64_t stride, n_strided, n_random, seed;
} pat_iter;

static uint32_t boundary_pattern(uint64_t i, uint64_t seed) {
  uint32_t rep = (uint32_t)(i % BOUNDARY_REPS);
  i /= BOUNDARY_REPS;
  uint32_t kind = (uint32_t)(i % 6u);
  i /= 6u;
  uint32_t t = (uint32_t)(i % 23u) + 1u;
  i /= 23u;
  uint32_t e = (uint32_t)(i % 256u);
  uint32_t sign = (uint32_t)(i / 256u);
  uint32_t low_mask = (1u << t) - 1u;
  uint32_t half = 1u << (t - 1u);
  uint32_t lows[6] = {0u, 1u, half - 1u, half, half + 1u, low_mask};
  uint32_t high = (uint32_t)hash64(seed ^ (i * 977u + rep * 131u + kind)) & 0x7FFFFFu & ~low_mask;
  if (rep == 0) high = 0; /* include the all-zero high bits */
  uint32_t m = high | (lows[kind] & low_mask);
  return (sign << 31) | (e << 23) | m;
}

/* Fills up to cap patterns; returns how many (0 when done). */
static size_t next_patterns(pat_iter* it, uint32_t* out, size_t cap) {
  size_t n = 0;
  while (n < cap && it->phase < 4) {
    uint64_t limit = it->phase == 0 ? 2 * N_SPECIALS
                     : it->phase == 1 ? N_BOUNDARY
                     : it->phase == 2 ? it->n_strided
                                      : it->n_random;
    if (it->i >= limit) {
      it->phase++;
      it->i = 0;
      continue;
    }
    uint32_t u;
    switch (it->phase) {
      case 0: u = SPECIALS[it->i / 2] ^ ((uint32_t)(it->i & 1u) << 31); break;
      case 1: u = boundary_pattern(it->i, it->seed); break;
      case 2: u = (uint32_t)(it->i * it->stride); break;
      default: u = (uint32_t)hash64(it->seed * 0x2545F4914F6CDD1Dull + it->i); break;
    }
    out[n++] = u;
    it->i++;
  }
  return n;
}

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

#define CHUNK ((size_t)1 << 16)

typedef struct sweep_opts {
  uint64_t stride, n_random, seed;
} sweep_opts;

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
      /* bf16 RNE */
      memset(out, 0xA5, n * sizeof *out);
      t0 = now_s();
      mp_status stt = mp_to_bf16_f32(src, out, (int64_t)n);
      tk[0][k] += now_s() - t0;
      g_check(&gb[k], stt == MP_OK, "status %d", (int)stt);
      for (size_t i = 0; i < n; ++i) {
        gb[k].count++;
        if (nan[i]) {
          const char* why = nan_result_problem(pat[i], out[i], &BF16);
          if (why) g_fail(&gb[k], "input %08" PRIx32 " (NaN): got %04x: %s", pat[i], out[i], why);
        } else if (out[i] != exp_b[i]) {
          g_fail(&gb[k], "input %08" PRIx32 " (%a): expected %04" PRIx32 ", got %04x", pat[i],
                 (double)src[i], exp_b[i], out[i]);
        }
      }
      /* fp16 RNE */
      memset(out, 0xA5, n * sizeof *out);
      t0 = now_s();
      stt = mp_to_fp16_f32(src, out, (int64_t)n);
      tk[1][k] += now_s() - t0;
      g_check(&gh[k], stt == MP_OK, "status %d", (int)stt);
      for (size_t i = 0; i < n; ++i) {
        gh[k].count++;
        if (nan[i]) {
          const char* why = nan_result_problem(pat[i], out[i], &FP16);
          if (why) g_fail(&gh[k], "input %08" PRIx32 " (NaN): got %04x: %s", pat[i], out[i], why);
        } else if (out[i] != exp_h[i]) {
          g_fail(&gh[k], "input %08" PRIx32 " (%a): expected %04" PRIx32 ", got %04x", pat[i],
                 (double)src[i], exp_h[i], out[i]);
        }
      }
      /* bf16 stochastic rounding */
      memset(out, 0xA5, n * sizeof *out);
      t0 = now_s();
      stt = mp_to_bf16_sr_f32(src, out, (int64_t)n, sr_seed, offset);
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
    mp_to_fp32_bf16(all, out, 65536);
    g_check(&g, mp_to_bf16_f32(out, back, 65536) == MP_OK, "status");
    for (uint32_t h = 0; h < 65536; ++h) {
      if (is_nan_fmt(h, &BF16)) continue;
      g_check(&g, back[h] == h, "bf16 %04" PRIx32 " came back as %04x", h, back[h]);
    }
    mp_to_fp32_bf16(all, out, 65536);
    g_check(&g, mp_to_bf16_sr_f32(out, back, 65536, 99u, 7u) == MP_OK, "status");
    for (uint32_t h = 0; h < 65536; ++h) {
      if (is_nan_fmt(h, &BF16)) continue;
      g_check(&g, back[h] == h, "bf16 %04" PRIx32 " came back from SR as %04x", h, back[h]);
    }
    mp_to_fp32_fp16(all, out, 65536);
    g_check(&g, mp_to_fp16_f32(out, back, 65536) == MP_OK, "status");
    for (uint32_t h = 0; h < 65536; ++h) {
      if (is_nan_fmt(h, &FP16)) continue;
      g_check(&g, back[h] == h, "fp16 %04" PRIx32 " came back as %04x", h, back[h]);
    }
    free(back);
    g_end(&g);
  }
  free(all);
  free(out);
}

/* ------------------------------------------------------------------------------------------ */
/* 5. Stochastic rounding: determinism, splitting, statistics. */

static uint32_t random_input(uint64_t* s) {
  uint64_t r = splitmix64(s);
  switch (r % 8u) {
    case 0: return (uint32_t)(r >> 32);                                   /* any pattern */
    case 1: return (uint32_t)(r >> 32) & 0x807FFFFFu;                     /* subnormal */
    case 2: return ((uint32_t)(r >> 32) & 0xFFFF0000u) | 0x7F7F0000u;     /* huge */
    default: return ((uint32_t)(r >> 32) & 0x807FFFFFu) | ((uint32_t)(100 + r % 60u) << 23);
  }
}

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

#define GUARD 32
#define SENT16 0xBEEFu
#define SENT32 0xDEADBEEFu

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
            for (size_t i = 0; i < cap; ++i) {
              if ((int64_t)i >= GUARD + dof && (int64_t)i < GUARD + dof + n) continue;
              g_check(&g, hdst[i] == SENT16, "fn %d n %" PRId64 " offsets %" PRId64 "/%" PRId64
                      ": wrote outside [0, n) at %" PRId64, fn, n, so, dof,
                      (int64_t)i - GUARD - dof);
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
            for (size_t i = 0; i < cap; ++i) {
              if ((int64_t)i >= GUARD + dof && (int64_t)i < GUARD + dof + n) continue;
              g_check(&g, bits_of(fdst[i]) == SENT32, "fn %d n %" PRId64 " offsets %" PRId64
                      "/%" PRId64 ": wrote outside [0, n) at %" PRId64, fn, n, so, dof,
                      (int64_t)i - GUARD - dof);
            }
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

/* ------------------------------------------------------------------------------------------ */
/* 8. ISA names, support and selection. */

static void test_isa_api(mp_isa initial_active) {
  group g;
  g_begin(&g, "ISA names: mp_isa_name / mp_isa_from_name round trip, unknown names rejected");
  static const char* const names[MP_ISA_COUNT] = {"scalar", "avx2", "avx512"};
  for (int i = 0; i < MP_ISA_COUNT; ++i) {
    const char* nm = mp_isa_name((mp_isa)i);
    g_check(&g, nm != NULL && strcmp(nm, names[i]) == 0, "mp_isa_name(%d) = %s, expected %s", i,
            nm ? nm : "NULL", names[i]);
    mp_isa out = (mp_isa)-1;
    mp_status r = mp_isa_from_name(nm ? nm : names[i], &out);
    g_check(&g, r == MP_OK && out == (mp_isa)i, "mp_isa_from_name(%s): status %d, isa %d",
            names[i], (int)r, (int)out);
  }
  g_check(&g, mp_isa_name(MP_ISA_COUNT) == NULL, "mp_isa_name(MP_ISA_COUNT) is not NULL");
  g_check(&g, mp_isa_name((mp_isa)-1) == NULL, "mp_isa_name(-1) is not NULL");
  g_check(&g, mp_isa_name((mp_isa)1000) == NULL, "mp_isa_name(1000) is not NULL");
  static const char* const bad[] = {"", "avx", "avx512f", "avx-512", "scalar ", " scalar",
                                    "sse2", "neon", "avx22", "native", "auto"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    mp_isa out = (mp_isa)77;
    mp_status r = mp_isa_from_name(bad[i], &out);
    g_check(&g, r == MP_ERR_INVALID_ARGUMENT, "mp_isa_from_name(\"%s\") returned %d", bad[i],
            (int)r);
    g_check(&g, out == (mp_isa)77, "mp_isa_from_name(\"%s\") wrote %d on failure", bad[i],
            (int)out);
  }
  mp_isa out = (mp_isa)77;
  g_check(&g, mp_isa_from_name(NULL, &out) == MP_ERR_INVALID_ARGUMENT && out == (mp_isa)77,
          "mp_isa_from_name(NULL, &out) not rejected");
  g_check(&g, mp_isa_from_name("scalar", NULL) == MP_ERR_INVALID_ARGUMENT,
          "mp_isa_from_name(\"scalar\", NULL) not rejected");
  g_end(&g);

  g_begin(&g, "ISA support and selection: unsupported paths rejected, active path unchanged");
  mp_isa best = mp_cpu_isa_best();
  g_check(&g, mp_cpu_isa_supported(MP_ISA_SCALAR) == 1, "scalar not supported");
  g_check(&g, mp_cpu_isa_supported(best) == 1, "best path %d not supported", (int)best);
  g_check(&g, initial_active == best, "initial active path %d is not the best %d",
          (int)initial_active, (int)best);
  for (int i = (int)best + 1; i < MP_ISA_COUNT; ++i) {
    g_check(&g, !mp_cpu_isa_supported((mp_isa)i), "path %d above best %d is supported", i,
            (int)best);
  }
  g_check(&g, mp_cpu_isa_supported(MP_ISA_COUNT) == 0, "MP_ISA_COUNT reported supported");
  g_check(&g, mp_cpu_isa_supported((mp_isa)-1) == 0, "isa -1 reported supported");
  int n_unsupported = 0;
  for (int a = 0; a < MP_ISA_COUNT; ++a) {
    if (!mp_cpu_isa_supported((mp_isa)a)) continue;
    select_isa((mp_isa)a);
    g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "selected %d, active %d", a,
            (int)mp_cpu_isa_active());
    for (int b = 0; b < MP_ISA_COUNT; ++b) {
      if (mp_cpu_isa_supported((mp_isa)b)) continue;
      n_unsupported++;
      mp_status r = mp_cpu_isa_select((mp_isa)b);
      g_check(&g, r == MP_ERR_UNSUPPORTED_ISA, "selecting unsupported %s returned %d",
              mp_isa_name((mp_isa)b), (int)r);
      g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "active path changed from %s to %d after "
              "selecting unsupported %s", mp_isa_name((mp_isa)a), (int)mp_cpu_isa_active(),
              mp_isa_name((mp_isa)b));
    }
    static const int out_of_range[] = {MP_ISA_COUNT, -1, 1000};
    for (int j = 0; j < 3; ++j) {
      mp_status r = mp_cpu_isa_select((mp_isa)out_of_range[j]);
      g_check(&g, r != MP_OK, "selecting isa %d returned MP_OK", out_of_range[j]);
      g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "active path changed after selecting isa %d",
              out_of_range[j]);
    }
  }
  if (n_unsupported == 0) {
    printf("      (every ISA path is supported here: the unsupported-selection case is not "
           "exercised)\n");
  }
  select_isa(best);
  g_end(&g);
}

/* ------------------------------------------------------------------------------------------ */
/* 9. Loss scaling: mp_unscale (g *= inv_scale in place, *found = 1 if any input
 *    was NaN/Inf), per ISA path, against a reference in double arithmetic: the value is decoded
 *    (fp32 exactly, bf16/fp16 by the field decoder), multiplied by inv_scale in double (exact:
 *    at most 24 x 24 significant bits), rounded once to fp32 (= the fp32 product, as torch
 *    computes it), then for bf16/fp16 rounded to the format by this file's ref_rne. */

enum { U_F32 = MP_F32, U_BF16 = MP_BF16, U_FP16 = MP_F16 };
static const char* const U_NAME[3] = {"fp32", "bf16", "fp16"};

/* inv_scale values: powers of two, inexact factors, huge/subnormal/zero/negative/non-finite ones,
 * and the neighbours of 1 (which must multiply, unlike 1 itself). */
static const float U_INVS[] = {1.0f, 0.5f, 0x1p-16f, 0x1p-24f, 1.0f / 3.0f, 0.1f, 3.0f, 65536.0f,
                               1e-30f, 0x1p-149f, 0x1.fffffcp-127f, 0x1.fffffep127f, 0.0f,
                               -0.0f, -0.25f, INFINITY, NAN, 0x1.000002p0f, 0x1.fffffep-1f};
#define N_U_INVS (sizeof U_INVS / sizeof U_INVS[0])

static const fmt* u_fmt(int dt) { return dt == U_BF16 ? &BF16 : &FP16; }

static uint32_t u_get(const void* p, int dt, int64_t i) {
  return dt == U_F32 ? ((const uint32_t*)p)[i] : ((const uint16_t*)p)[i];
}

static void u_put(void* p, int dt, int64_t i, uint32_t v) {
  if (dt == U_F32) {
    ((uint32_t*)p)[i] = v;
  } else {
    ((uint16_t*)p)[i] = (uint16_t)v;
  }
}

static size_t u_size(int dt) { return dt == U_F32 ? 4u : 2u; }

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

/* Random element bits: finite (normal, subnormal, zero, huge) unless bad, then NaN or +-Inf. */
static uint32_t u_random(uint64_t* s, int dt, int bad) {
  uint64_t r = splitmix64(s);
  uint32_t hi = (uint32_t)(r >> 32);
  if (dt == U_F32) {
    if (bad) {
      return (hi & 0x80000000u) | 0x7F800000u | ((r & 1u) ? (hi & 0x7FFFFFu) | 1u : 0u);
    }
    uint32_t u = random_input(s); /* any pattern, subnormal, huge or moderate */
    if ((u & 0x7F800000u) == 0x7F800000u) u &= 0xBFFFFFFFu; /* NaN/Inf -> finite */
    return u;
  }
  uint32_t emask = dt == U_BF16 ? 0x7F80u : 0x7C00u, mmask = dt == U_BF16 ? 0x7Fu : 0x3FFu;
  if (bad) return (hi & 0x8000u) | emask | ((r & 1u) ? (hi & mmask) | 1u : 0u);
  uint32_t h = hi & 0xFFFFu;
  if ((h & emask) == emask) h &= ~0x4000u; /* bit 14 lies in both exponent fields */
  return h;
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

/* ------------------------------------------------------------------------------------------ */
/* 11. The fused Adam/AdamW step, mp_step (step.h, rules/adam.h), per ISA path, against this file's
 *     reference: adam.h's per-element formula restated in float arithmetic, one rounding per
 *     operation in the documented order. Every intermediate is assigned to a float (this file is
 *     ISO C, which does not contract a * b + c into an FMA; where float arithmetic is carried out
 *     in a wider format, an assignment rounds, and the double rounding of + - * / and sqrt from
 *     64 to 24 bits is harmless), the loads are this file's decoders, sqrt is taken in double
 *     and rounded once (which is the correctly rounded sqrtf), and a bf16/fp16 param is ref_rne
 *     of the new master. The core promises these bits on every path, so every value that is not
 *     NaN is compared bit for bit (which makes the paths identical to one another too) and a NaN
 *     must be a NaN of the array's type. The scalars are derived from the step count as
 *     csrc/torch/adam.cpp derives them: in double, from a float32 t and a float32 lr. Separately,
 *     50 steps against Adam/AdamW in double check the formula itself. */

typedef struct adam_pair {
  mp_dtype pt, gt;
  const char* name;
} adam_pair;

static const adam_pair ADAM_PAIRS[] = {
    {MP_F32, MP_F32, "f32/f32"}, {MP_BF16, MP_BF16, "bf16/bf16"}, {MP_BF16, MP_F32, "bf16/f32"},
    {MP_F16, MP_F16, "f16/f16"}, {MP_F16, MP_F32, "f16/f32"},
};
#define N_ADAM_PAIRS (sizeof ADAM_PAIRS / sizeof ADAM_PAIRS[0])

static size_t a_size(mp_dtype t) { return t == MP_F32 ? 4u : 2u; }

static uint32_t a_get(const void* p, mp_dtype t, size_t i) {
  return t == MP_F32 ? ((const uint32_t*)p)[i] : ((const uint16_t*)p)[i];
}

static void a_put(void* p, mp_dtype t, size_t i, uint32_t b) {
  if (t == MP_F32) {
    ((uint32_t*)p)[i] = b;
  } else {
    ((uint16_t*)p)[i] = (uint16_t)b;
  }
}

/* The value of element bits b of type t (bf16 is the top half of an fp32; fp16 by the field
 * decoder, which is exact). */
static float a_value(mp_dtype t, uint32_t b) {
  if (t == MP_F32) return f32_of(b);
  if (t == MP_BF16) return f32_of(b << 16);
  return (float)decode(b, &FP16);
}

static int a_isnan(mp_dtype t, uint32_t b) {
  if (t == MP_F32) return (b & 0x7FFFFFFFu) > 0x7F800000u;
  return is_nan_fmt(b, t == MP_BF16 ? &BF16 : &FP16);
}

/* The optimizer's settings as the Python side holds them (lr is a float32 tensor). */
typedef struct adam_cfg {
  float lr;
  double beta1, beta2, eps, weight_decay;
  int decoupled, maximize;
} adam_cfg;

/* The per-step scalars of one call, as this file restates them, plus what the call is made of
 * (the settings, the step count t after the step and the gradient multiplier). */
typedef struct ref_scalars {
  float beta1, beta2, eps, lerp_weight, one_minus_beta2, weight_decay, decay, step_size;
  float bias_correction2_sqrt, inv_scale;
  int decoupled, maximize;
  adam_cfg cfg;
  float t;
} ref_scalars;

/* The per-param scalars, restated from torch's single-tensor Adam: computed in double from the
 * incremented float32 step count t and the float32 lr, each rounded once to float. */
static ref_scalars adam_scalars(const adam_cfg* c, float t, float inv_scale) {
  ref_scalars p;
  memset(&p, 0, sizeof p);
  p.cfg = *c;
  p.t = t;
  const double lr = (double)c->lr, td = (double)t;
  p.beta1 = (float)c->beta1;
  p.beta2 = (float)c->beta2;
  p.eps = (float)c->eps;
  p.lerp_weight = (float)(1.0 - c->beta1);
  p.one_minus_beta2 = (float)(1.0 - c->beta2);
  p.weight_decay = c->decoupled ? 0.0f : (float)c->weight_decay;
  p.decay = c->decoupled ? (float)(1.0 - lr * c->weight_decay) : 1.0f;
  p.step_size = (float)(lr / (1.0 - pow(c->beta1, td)));
  p.bias_correction2_sqrt = (float)sqrt(1.0 - pow(c->beta2, td));
  p.inv_scale = inv_scale;
  p.decoupled = c->decoupled ? 1 : 0;
  p.maximize = c->maximize ? 1 : 0;
  return p;
}

/* adam.h's formula for one element: grad is the decoded gradient, *p the fp32 param or master,
 * *m and *v the moments; all three are updated. */
static void ref_adam_elem(const ref_scalars* hp, float grad, float* p_io, float* m_io,
                          float* v_io) {
  float g = grad * hp->inv_scale;
  if (hp->maximize) g = -g;
  float p = *p_io;
  if (hp->decoupled) {
    p = p * hp->decay;
  } else {
    const float wp = hp->weight_decay * p;
    g = g + wp;
  }
  const float m0 = *m_io, v0 = *v_io, w = hp->lerp_weight;
  const float diff = g - m0;
  float m;
  if (w < 0.5f) {
    const float step = w * diff;
    m = m0 + step;
  } else {
    const float one_minus_w = 1.0f - w;
    const float back = diff * one_minus_w;
    m = g - back;
  }
  const float vb = v0 * hp->beta2;
  const float a = hp->one_minus_beta2 * g;
  const float aa = a * g;
  const float v = vb + aa;
  const float root = (float)sqrt((double)v);
  const float q = root / hp->bias_correction2_sqrt;
  const float denom = q + hp->eps;
  const float neg_step = -hp->step_size;
  const float num = neg_step * m;
  const float upd = num / denom;
  *p_io = p + upd;
  *m_io = m;
  *v_io = v;
}

/* The five arrays of one call, each of cap elements (master NULL for an f32 param). */
typedef struct adam_buf {
  mp_dtype pt, gt;
  size_t cap;
  void* param;
  void* grad;
  float* master;
  float* m;
  float* v;
} adam_buf;

/* Element offsets of a call's first element in each array. */
typedef struct adam_off {
  size_t p, g, w, m, v;
} adam_off;

static const adam_off ADAM_OFF0 = {0, 0, 0, 0, 0};

static void abuf_init(adam_buf* b, mp_dtype pt, mp_dtype gt, size_t cap) {
  b->pt = pt;
  b->gt = gt;
  b->cap = cap;
  b->param = xmalloc(cap * a_size(pt));
  b->grad = xmalloc(cap * a_size(gt));
  b->master = pt == MP_F32 ? NULL : xmalloc(cap * sizeof(float));
  b->m = xmalloc(cap * sizeof(float));
  b->v = xmalloc(cap * sizeof(float));
}

static void abuf_free(adam_buf* b) {
  free(b->param);
  free(b->grad);
  free(b->master);
  free(b->m);
  free(b->v);
}

static void abuf_copy(adam_buf* dst, const adam_buf* src) {
  memcpy(dst->param, src->param, src->cap * a_size(src->pt));
  memcpy(dst->grad, src->grad, src->cap * a_size(src->gt));
  if (src->master) memcpy(dst->master, src->master, src->cap * sizeof(float));
  memcpy(dst->m, src->m, src->cap * sizeof(float));
  memcpy(dst->v, src->v, src->cap * sizeof(float));
}

/* Array a of b: 0 param, 1 grad, 2 master, 3 exp_avg, 4 exp_avg_sq. */
static const char* const A_NAMES[5] = {"param", "grad", "master", "exp_avg", "exp_avg_sq"};

static void* a_arr(const adam_buf* b, int a) {
  switch (a) {
    case 0: return b->param;
    case 1: return b->grad;
    case 2: return b->master;
    case 3: return b->m;
    default: return b->v;
  }
}

static mp_dtype a_type(const adam_buf* b, int a) {
  return a == 0 ? b->pt : a == 1 ? b->gt : MP_F32;
}

static size_t a_off(adam_off o, int a) {
  switch (a) {
    case 0: return o.p;
    case 1: return o.g;
    case 2: return o.w;
    case 3: return o.m;
    default: return o.v;
  }
}

/* A random finite fp32 of either sign: 1.f x 2^e with e uniform in [emin, emax]; one in 64 is
 * a zero, one in 64 a subnormal. */
static float adam_rand(uint64_t* s, int emin, int emax) {
  uint64_t r = splitmix64(s);
  uint32_t sign = (uint32_t)(r >> 63) << 31;
  uint32_t kind = (uint32_t)(r % 64u);
  if (kind == 0) return f32_of(sign);
  if (kind == 1) return f32_of(sign | (((uint32_t)(r >> 8) & 0x7FFFFFu) | 1u));
  int e = emin + (int)((r >> 6) % (uint64_t)(emax - emin + 1));
  return f32_of(sign | ((uint32_t)(e + 127) << 23) | ((uint32_t)(r >> 32) & 0x7FFFFFu));
}

/* A random finite gradient element of type t. */
static uint32_t adam_rand_grad(uint64_t* s, mp_dtype t) {
  if (t == MP_F32) return bits_of(adam_rand(s, -30, 8));
  if (t == MP_BF16) return bits_of(adam_rand(s, -30, 8)) >> 16; /* truncation: still finite */
  return u_random(s, U_FP16, 0); /* any finite fp16: subnormals up to 65504 */
}

/* Fills [from, to) of every array with random inputs: finite grads; params/masters spread
 * over the range (fp16 masters past 65504 and below its normals); moments zero or random (v
 * >= 0). The bf16/fp16 param gets random bits, NaN patterns included: it is only written. */
static void adam_fill_range(adam_buf* b, uint64_t* s, int zero_moments, size_t from, size_t to) {
  for (size_t i = from; i < to; ++i) {
    a_put(b->grad, b->gt, i, adam_rand_grad(s, b->gt));
    if (b->pt == MP_F32) {
      a_put(b->param, MP_F32, i, bits_of(adam_rand(s, -20, 6)));
    } else {
      b->master[i] = b->pt == MP_F16 ? adam_rand(s, -26, 17) : adam_rand(s, -30, 20);
      a_put(b->param, b->pt, i, (uint32_t)splitmix64(s) & 0xFFFFu);
    }
    b->m[i] = zero_moments ? 0.0f : adam_rand(s, -30, 8);
    b->v[i] = zero_moments ? 0.0f : fabsf(adam_rand(s, -60, 16));
  }
}

static void adam_fill(adam_buf* b, uint64_t* s, int zero_moments) {
  adam_fill_range(b, s, zero_moments, 0, b->cap);
}

/* This file's reference step over n elements at offsets o, in place. */
static void ref_adam(adam_buf* b, adam_off o, int64_t n, const ref_scalars* hp) {
  for (size_t i = 0; i < (size_t)n; ++i) {
    float g = a_value(b->gt, a_get(b->grad, b->gt, o.g + i));
    float p = b->master ? b->master[o.w + i] : f32_of(a_get(b->param, MP_F32, o.p + i));
    float m = b->m[o.m + i], v = b->v[o.v + i];
    ref_adam_elem(hp, g, &p, &m, &v);
    b->m[o.m + i] = m;
    b->v[o.v + i] = v;
    if (b->master) {
      /* adam.h: a bf16 param's master exactly halfway above an even bf16 is stored one ulp
       * lower (its param, the round to nearest even, is the same). */
      if (b->pt == MP_BF16 && (bits_of(p) & 0x1FFFFu) == 0x8000u && !isinf(p) && !isnan(p)) {
        p = f32_of(bits_of(p) - 1u);
      }
      b->master[o.w + i] = p;
      int nan;
      uint32_t r = ref_rne(bits_of(p), b->pt == MP_BF16 ? &BF16 : &FP16, &nan);
      if (nan) r = b->pt == MP_BF16 ? 0x7FC0u : 0x7E00u; /* any NaN will do */
      a_put(b->param, b->pt, o.p + i, r);
    } else {
      a_put(b->param, MP_F32, o.p + i, bits_of(p));
    }
  }
}

/* The options of the call hp describes: lr as a value, inv_scale through a pointer. */
static mp_step_options adam_options(const ref_scalars* hp, const float* inv_scale) {
  mp_step_options op;
  memset(&op, 0, sizeof op);
  op.beta1 = hp->cfg.beta1;
  op.beta2 = hp->cfg.beta2;
  op.eps = hp->cfg.eps;
  op.weight_decay = hp->cfg.weight_decay;
  op.decoupled = hp->cfg.decoupled;
  op.maximize = hp->cfg.maximize;
  op.lr_value = hp->cfg.lr;
  op.inv_scale = inv_scale;
  return op;
}

/* mp_step over elements [0, n) of arrays that start at offsets o; the step count before
 * the step is hp->t - 1, and is left as it is (mp_step only reads it). */
static mp_status call_adam(adam_buf* b, adam_off o, int64_t n, const ref_scalars* hp) {
  float step = hp->t - 1.0f;
  const float inv = hp->inv_scale;
  const mp_step_tensor t = {(char*)b->param + o.p * a_size(b->pt), b->pt,
                            (char*)b->grad + o.g * a_size(b->gt), b->gt,
                            b->master ? b->master + o.w : NULL, b->m + o.m, b->v + o.v, &step, n,
                            NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL};
  const mp_step_options op = adam_options(hp, &inv);
  const mp_status st = mp_step(&t, 0, n, &op);
  if (step != hp->t - 1.0f) return (mp_status)99; /* the step count was written */
  return st;
}

/* Describes the scalars of a call, for failure messages. */
static void adam_describe(char* buf, size_t size, const char* pair, const char* isa,
                          const ref_scalars* hp, const char* extra) {
  snprintf(buf, size, "%s [%s] %s%s step_size %a bc2_sqrt %a lerp_w %a beta2 %a 1-beta2 %a "
           "eps %a wd %a decay %a inv_scale %a%s", pair, isa,
           hp->decoupled ? "AdamW" : "Adam", hp->maximize ? " maximize" : "",
           (double)hp->step_size, (double)hp->bias_correction2_sqrt, (double)hp->lerp_weight,
           (double)hp->beta2, (double)hp->one_minus_beta2, (double)hp->eps,
           (double)hp->weight_decay, (double)hp->decay, (double)hp->inv_scale, extra);
}

/* Compares every element of every array of got with want (whole buffers: outside the call's n
 * elements want holds the inputs, so a stray write shows): bit for bit, except that where a NaN
 * is expected any NaN of the type will do (grads must keep their bits). in: the inputs, for the
 * message. Returns 1 if all matched. */
static int adam_compare(group* g, const adam_buf* in, const adam_buf* want, const adam_buf* got,
                        adam_off o, int64_t n, const char* ctx) {
  int ok = 1;
  for (int a = 0; a < 5; ++a) {
    if (a == 2 && !want->master) continue;
    mp_dtype t = a_type(want, a);
    const void* pw = a_arr(want, a);
    const void* pg = a_arr(got, a);
    for (size_t i = 0; i < want->cap; ++i) {
      uint32_t w = a_get(pw, t, i), x = a_get(pg, t, i);
      g->count++;
      if (w == x || (a != 1 && a_isnan(t, w) && a_isnan(t, x))) continue;
      ok = 0;
      int64_t e = (int64_t)i - (int64_t)a_off(o, a);
      if (e < 0 || e >= n) {
        g_fail(g, "%s: %s[%" PRId64 "] (outside the n = %" PRId64 " elements) changed from %08"
               PRIx32 " to %08" PRIx32, ctx, A_NAMES[a], e, n, w, x);
        continue;
      }
      char inputs[160];
      size_t j = (size_t)e;
      snprintf(inputs, sizeof inputs, "grad %08" PRIx32 " %s %08" PRIx32 " exp_avg %08" PRIx32
               " exp_avg_sq %08" PRIx32, a_get(in->grad, in->gt, o.g + j),
               in->master ? "master" : "param",
               in->master ? bits_of(in->master[o.w + j]) : a_get(in->param, MP_F32, o.p + j),
               bits_of(in->m[o.m + j]), bits_of(in->v[o.v + j]));
      g_fail(g, "%s: element %" PRId64 " (inputs %s): %s expected %08" PRIx32 ", got %08" PRIx32,
             ctx, e, inputs, A_NAMES[a], w, x);
    }
  }
  return ok;
}

/* 11a. Argument checks: every rejected call returns MP_ERR_INVALID_ARGUMENT and writes nothing.
 *      A NULL params, an unknown or foreign dtype and a master mismatch are rejected for n == 0
 *      as well; otherwise n == 0 is MP_OK (with NULL data pointers too, as for the casts) and
 *      writes nothing. A valid call on the same buffers then writes exactly its n elements. */
/* One mp_step call for the argument checks: pt/gt select the buffers; nulls: bit 0 param,
 * 1 grad, 2 master, 3 exp_avg, 4 exp_avg_sq, 5 the options, 6 the step count. */
static mp_status adam_arg_call(int pt, int gt, int master, int nulls, int64_t n, uint32_t* p32,
                               uint16_t* p16, uint32_t* g32, uint16_t* g16, uint32_t* w32,
                               uint32_t* m32, uint32_t* v32, const mp_step_options* opts) {
  static float step = 0.0f;
  const int p_low = pt == MP_BF16 || pt == MP_F16, g_low = gt == MP_BF16 || gt == MP_F16;
  const mp_step_tensor t = {
      (nulls & 1) ? NULL : p_low ? (void*)p16 : (void*)p32, pt,
      (nulls & 2) ? NULL : g_low ? (void*)g16 : (void*)g32, gt,
      (!master || (nulls & 4)) ? NULL : (float*)(void*)w32,
      (nulls & 8) ? NULL : (float*)(void*)m32, (nulls & 16) ? NULL : (float*)(void*)v32,
      (nulls & 64) ? NULL : &step, n, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL};
  return mp_step(&t, 0, n < 0 ? 0 : n, (nulls & 32) ? NULL : opts);
}

static void test_adam_arguments(void) {
  static const int64_t bad_n[] = {-1, -2, -7, INT64_MIN, -((int64_t)1 << 40)};
  /* (param dtype, grad dtype, master given) that are rejected whatever n is */
  static const struct {
    int pt, gt, master;
    const char* what;
  } bad_types[] = {
      {3, MP_F32, 1, "unknown param dtype 3"},     {-1, MP_F32, 1, "unknown param dtype -1"},
      {100, MP_F32, 0, "unknown param dtype 100"}, {3, 3, 1, "unknown dtypes 3/3"},
      {MP_F32, 3, 0, "unknown grad dtype 3"},      {MP_F32, -1, 0, "unknown grad dtype -1"},
      {MP_BF16, 3, 1, "bf16 param, grad dtype 3"}, {MP_F16, -1, 1, "f16 param, grad dtype -1"},
      {MP_BF16, MP_F16, 1, "bf16 param, f16 grad"}, {MP_F16, MP_BF16, 1, "f16 param, bf16 grad"},
      {MP_F32, MP_BF16, 0, "f32 param, bf16 grad"}, {MP_F32, MP_F16, 0, "f32 param, f16 grad"},
      {MP_F32, MP_F32, 1, "master given for an f32 param"},
  };
  adam_cfg cfg = {1e-3f, 0.9, 0.999, 1e-8, 1e-2, 1, 0};
  const ref_scalars hp = adam_scalars(&cfg, 1.0f, 0.5f);
  const float inv_half = 0.5f;
  const mp_step_options hp_opts = adam_options(&hp, &inv_half);
  for (int k = 0; k < g_nisa; ++k) {
    const char* nm = mp_isa_name(g_isas[k]);
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "adam argument checks: n < 0, NULLs, bad or foreign dtypes, master mismatch "
            "rejected, nothing written; n == 0 ok [%s]", nm);
    uint32_t p32[8], g32[8], w32[8], m32[8], v32[8];
    uint16_t p16[8], g16[8];
    /* one call: pt/gt select the buffers; nulls: bit 0 param, 1 grad, 2 master, 3 m, 4 v,
     * 5 params */
#define ADAM_ARG_CALL(PT, GT, MASTER, NULLS, N)                                                 \
  adam_arg_call((PT), (GT), (MASTER), (NULLS), (N), p32, p16, g32, g16, w32, m32, v32, &hp_opts)
    for (int c = 0;; ++c) {
      /* build case c: (pt, gt, master, nulls, n, expected status, description) */
      int pt, gt, master, nulls = 0;
      int64_t n = 4;
      mp_status want = MP_ERR_INVALID_ARGUMENT;
      char what[96];
      const int per_pair = 5 + 5 + 3 + 2 + 2;
      const int n_pair_cases = (int)N_ADAM_PAIRS * per_pair;
      const int n_type_cases = (int)(sizeof bad_types / sizeof bad_types[0]) * 2;
      if (c < n_pair_cases) {
        const adam_pair* pr = &ADAM_PAIRS[c / per_pair];
        int j = c % per_pair;
        pt = pr->pt;
        gt = pr->gt;
        master = pt != MP_F32;
        if (j < 5) {
          n = bad_n[j];
          snprintf(what, sizeof what, "%s, n %" PRId64, pr->name, n);
        } else if (j < 10) {
          static const int null_sets[5] = {1, 2, 8, 16, 1 | 2 | 8 | 16};
          static const char* const null_names[5] = {"param", "grad", "exp_avg", "exp_avg_sq",
                                                    "all data pointers"};
          nulls = null_sets[j - 5];
          snprintf(what, sizeof what, "%s, n 4, NULL %s", pr->name, null_names[j - 5]);
        } else if (j < 13) {
          nulls = 32;
          n = j == 10 ? 4 : j == 11 ? 0 : -1;
          snprintf(what, sizeof what, "%s, NULL params, n %" PRId64, pr->name, n);
        } else if (j < 15) {
          n = 0;
          want = MP_OK;
          nulls = j == 13 ? 0 : (1 | 2 | 8 | 16);
          snprintf(what, sizeof what, "%s, n 0%s", pr->name,
                   j == 13 ? "" : ", NULL param/grad/exp_avg/exp_avg_sq");
        } else {
          nulls = 64;
          n = j == 15 ? 4 : 0;
          snprintf(what, sizeof what, "%s, NULL step, n %" PRId64, pr->name, n);
        }
      } else if (c < n_pair_cases + n_type_cases) {
        int j = c - n_pair_cases;
        pt = bad_types[j / 2].pt;
        gt = bad_types[j / 2].gt;
        master = bad_types[j / 2].master;
        n = (j % 2) == 0 ? 4 : 0;
        /* With no elements only the step count is used: a master given or missing is no
         * error then (the dtypes still are). */
        const int known = pt >= 0 && pt < MP_DTYPE_COUNT && gt >= 0 && gt < MP_DTYPE_COUNT &&
                          (gt == pt || gt == MP_F32);
        if (known && n == 0) want = MP_OK;
        snprintf(what, sizeof what, "%s, n %" PRId64, bad_types[j / 2].what, n);
      } else {
        break;
      }
      for (int i = 0; i < 8; ++i) {
        p32[i] = g32[i] = w32[i] = m32[i] = v32[i] = SENT32;
        p16[i] = g16[i] = SENT16;
      }
      mp_status r = ADAM_ARG_CALL(pt, gt, master, nulls, n);
      g_check(&g, r == want, "%s: status %d, expected %d", what, (int)r, (int)want);
      int untouched = 1;
      for (int i = 0; i < 8; ++i) {
        if (p32[i] != SENT32 || g32[i] != SENT32 || w32[i] != SENT32 || m32[i] != SENT32 ||
            v32[i] != SENT32 || p16[i] != SENT16 || g16[i] != SENT16) {
          untouched = 0;
        }
      }
      g_check(&g, untouched, "%s: something was written", what);
    }
    /* Control: a valid n = 4 call on the same buffers succeeds and writes exactly 4 elements. */
    for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
      const adam_pair* pr = &ADAM_PAIRS[pi];
      for (int i = 0; i < 8; ++i) {
        p32[i] = bits_of(1.5f);
        p16[i] = pr->pt == MP_BF16 ? 0x3FC0u : 0x3E00u;
        w32[i] = bits_of(1.5f);
        g32[i] = bits_of(0.25f);
        g16[i] = pr->gt == MP_BF16 ? 0x3E80u : 0x3400u;
        m32[i] = v32[i] = 0u;
      }
      mp_status r = ADAM_ARG_CALL(pr->pt, pr->gt, pr->pt != MP_F32, 0, 4);
      g_check(&g, r == MP_OK, "%s control call: status %d", pr->name, (int)r);
      for (int i = 0; i < 8; ++i) {
        int changed = pr->pt == MP_F32 ? p32[i] != bits_of(1.5f) : w32[i] != bits_of(1.5f);
        g_check(&g, changed == (i < 4) && (m32[i] != 0u) == (i < 4),
                "%s control call: element %d %s", pr->name, i,
                i < 4 ? "not updated" : "written past n");
      }
    }
#undef ADAM_ARG_CALL
    g_end(&g);
  }
}

/* 11b. Bit-exact against the reference over dtype pairs, both decay modes, maximize, lerp
 *      weights below, at and above 0.5, successive steps with scaled gradients. */
static void test_adam_exact(uint64_t seed0) {
  uint64_t s = seed0 ^ 0xADA3E1u;
  const size_t N = 1031;
  static const float steps[] = {1.0f, 2.0f, 3.0f, 7.0f, 50.0f, 1000.0f, 123457.0f};
  static const float invs[] = {1.0f, 0x1p-16f, 1.0f / 3.0f, 3.0e-5f, 0.7f, 1024.0f, 0.5f};
  static const double beta1s[] = {0.9, 0.5, 0.3};
  static const float lrs[] = {1e-3f, 3e-2f, 1.0f, 1e-4f};
  static const double beta2s[] = {0.999, 0.95, 0.99, 0.9999};
  static const double epss[] = {1e-8, 1e-6, 1e-12, 1e-3};
  static const double wds[] = {1e-2, 0.0, 0.1, 1e-4};
  const int n_steps = (int)(sizeof steps / sizeof steps[0]);
  group g[MP_ISA_COUNT];
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam == float reference bit for bit: 5 dtype pairs, AdamW/Adam, maximize, "
            "beta1 .9/.5/.3, t 1..123457, inv_scale != 1 [%s]", mp_isa_name(g_isas[k]));
  }
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    adam_buf in, want, got;
    abuf_init(&in, pr->pt, pr->gt, N);
    abuf_init(&want, pr->pt, pr->gt, N);
    abuf_init(&got, pr->pt, pr->gt, N);
    for (int c = 0; c < 12; ++c) {
      uint64_t r = splitmix64(&s);
      adam_cfg cfg = {lrs[r % 4u], beta1s[c / 4], beta2s[(r >> 8) % 4u], epss[(r >> 16) % 4u],
                      wds[(r >> 24) % 4u], c & 1, (c >> 1) & 1};
      adam_fill(&in, &s, 1); /* the first step starts from zero moments */
      for (int st = 0; st < n_steps; ++st) {
        if (st > 0) {
          for (size_t i = 0; i < N; ++i) a_put(in.grad, in.gt, i, adam_rand_grad(&s, in.gt));
        }
        ref_scalars hp = adam_scalars(&cfg, steps[st], invs[(st + c) % n_steps]);
        abuf_copy(&want, &in);
        ref_adam(&want, ADAM_OFF0, (int64_t)N, &hp);
        for (int k = 0; k < g_nisa; ++k) {
          select_isa(g_isas[k]);
          abuf_copy(&got, &in);
          mp_status rs = call_adam(&got, ADAM_OFF0, (int64_t)N, &hp);
          char ctx[400], extra[48];
          snprintf(extra, sizeof extra, " (t %.0f, lr %a)", (double)steps[st], (double)cfg.lr);
          adam_describe(ctx, sizeof ctx, pr->name, mp_isa_name(g_isas[k]), &hp, extra);
          g_check(&g[k], rs == MP_OK, "%s: status %d", ctx, (int)rs);
          adam_compare(&g[k], &in, &want, &got, ADAM_OFF0, (int64_t)N, ctx);
        }
        abuf_copy(&in, &want); /* the next step starts from the expected state */
      }
    }
    abuf_free(&in);
    abuf_free(&want);
    abuf_free(&got);
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);
}

/* 11c. The formula itself: 50 steps against Adam/AdamW computed in double (torch's
 *      single-tensor algorithm, the scalars from the same settings), fp32 params or masters
 *      within 1e-5 relative; bf16/fp16 params = RNE of the master after every step. */
static void test_adam_double(uint64_t seed0) {
  const int STEPS = 50;
  const size_t N = 301;
  const float INV = 0x1p-10f; /* the grads are stored scaled by 1024 */
  const double TOL = 1e-5;
  group g[MP_ISA_COUNT];
  double maxrel[MP_ISA_COUNT] = {0};
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam, 50 steps vs Adam/AdamW in double: relative error < %g (f32 param or "
            "master), param = RNE(master) [%s]", TOL, mp_isa_name(g_isas[k]));
  }
  double* pd = xmalloc(N * sizeof *pd);
  double* md = xmalloc(N * sizeof *md);
  double* vd = xmalloc(N * sizeof *vd);
  uint64_t s = seed0 ^ 0xD0B1Eu;
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    adam_buf b[MP_ISA_COUNT];
    for (int k = 0; k < g_nisa; ++k) abuf_init(&b[k], pr->pt, pr->gt, N);
    for (int c = 0; c < 8; ++c) {
      adam_cfg cfg = {1e-3f, (c & 4) ? 0.3 : 0.9, 0.999, 1e-8, 1e-2, c & 1, (c >> 1) & 1};
      for (size_t i = 0; i < N; ++i) {
        uint64_t r = splitmix64(&s);
        /* |p0| in [1, 4): 50 steps of lr 1e-3 keep it far from 0 */
        float p0 = f32_of(((uint32_t)(r >> 63) << 31) | ((uint32_t)(127 + (r & 1u)) << 23) |
                          ((uint32_t)(r >> 8) & 0x7FFFFFu));
        pd[i] = (double)p0;
        md[i] = vd[i] = 0.0;
        for (int k = 0; k < g_nisa; ++k) {
          if (b[k].master) {
            b[k].master[i] = p0;
            a_put(b[k].param, pr->pt, i, 0u);
          } else {
            a_put(b[k].param, MP_F32, i, bits_of(p0));
          }
          b[k].m[i] = b[k].v[i] = 0.0f;
        }
      }
      for (int t = 1; t <= STEPS; ++t) {
        /* the true gradient +-1.f x 2^e, e in [-12, 1], stored scaled by 1024 in the grad dtype
         * (bf16 truncated, fp16 rounded: the double reference uses the stored value) */
        const double bc1 = 1.0 - pow(cfg.beta1, t), bc2 = 1.0 - pow(cfg.beta2, t);
        for (size_t i = 0; i < N; ++i) {
          uint64_t r = splitmix64(&s);
          int e = -12 + (int)(r % 14u);
          float x = f32_of(((uint32_t)(r >> 63) << 31) | ((uint32_t)(e + 10 + 127) << 23) |
                           ((uint32_t)(r >> 8) & 0x7FFFFFu));
          uint32_t gb = bits_of(x);
          if (pr->gt == MP_BF16) {
            gb >>= 16;
          } else if (pr->gt == MP_F16) {
            int nan;
            gb = ref_rne(gb, &FP16, &nan);
          }
          for (int k = 0; k < g_nisa; ++k) a_put(b[k].grad, pr->gt, i, gb);
          /* Adam / AdamW in double */
          double gd = (double)a_value(pr->gt, gb) * (double)INV;
          if (cfg.maximize) gd = -gd;
          const double lr = (double)cfg.lr;
          if (cfg.decoupled) {
            pd[i] *= 1.0 - lr * cfg.weight_decay;
          } else {
            gd += cfg.weight_decay * pd[i];
          }
          md[i] = cfg.beta1 * md[i] + (1.0 - cfg.beta1) * gd;
          vd[i] = cfg.beta2 * vd[i] + (1.0 - cfg.beta2) * gd * gd;
          pd[i] -= lr / bc1 * md[i] / (sqrt(vd[i]) / sqrt(bc2) + cfg.eps);
        }
        ref_scalars hp = adam_scalars(&cfg, (float)t, INV);
        for (int k = 0; k < g_nisa; ++k) {
          select_isa(g_isas[k]);
          mp_status rs = call_adam(&b[k], ADAM_OFF0, (int64_t)N, &hp);
          g_check(&g[k], rs == MP_OK, "%s: status %d", pr->name, (int)rs);
          for (size_t i = 0; i < N; ++i) {
            double p = b[k].master ? (double)b[k].master[i]
                                   : (double)f32_of(a_get(b[k].param, MP_F32, i));
            double rel = fabs(p - pd[i]) / fabs(pd[i]);
            if (!(rel <= maxrel[k])) maxrel[k] = rel;
            g_check(&g[k], rel < TOL, "%s %s%s beta1 %g step %d element %" PRIu64 ": %.9g, "
                    "double reference %.9g (relative error %.3g)", pr->name,
                    cfg.decoupled ? "AdamW" : "Adam", cfg.maximize ? " maximize" : "",
                    cfg.beta1, t, (uint64_t)i, p, pd[i], rel);
            if (b[k].master) {
              int nan;
              uint32_t want = ref_rne(bits_of(b[k].master[i]),
                                      pr->pt == MP_BF16 ? &BF16 : &FP16, &nan);
              uint32_t got = a_get(b[k].param, pr->pt, i);
              g_check(&g[k], !nan && got == want, "%s step %d element %" PRIu64 ": master %08"
                      PRIx32 ", param %04" PRIx32 ", expected %04" PRIx32, pr->name, t,
                      (uint64_t)i, bits_of(b[k].master[i]), got, want);
            }
          }
        }
      }
    }
    for (int k = 0; k < g_nisa; ++k) abuf_free(&b[k]);
  }
  for (int k = 0; k < g_nisa; ++k) {
    printf("      adam vs double [%s]: largest relative error of the param/master %.3g\n",
           mp_isa_name(g_isas[k]), maxrel[k]);
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);
  free(pd);
  free(md);
  free(vd);
}

/* 11d. NaN/Inf in a grad: plain IEEE arithmetic, no test and no skip (skipping the step on an
 *      overflow is the caller's decision, from found_inf). The element's param and master
 *      become NaN; exp_avg_sq becomes NaN for a NaN grad and +Inf for an Inf grad; exp_avg
 *      becomes NaN, except for an Inf grad under a lerp weight < 0.5 (m + w (g - m)), where it
 *      is an Inf of the sign of the (maximize-negated) grad. Every other element is exact. */
static void test_adam_nonfinite(uint64_t seed0) {
  const size_t N = 67;
  static const size_t pos[] = {0, 1, 31, 32, 65, 66};
  const size_t n_pos = sizeof pos / sizeof pos[0];
  uint64_t s = seed0 ^ 0x1AF1u;
  group g[MP_ISA_COUNT];
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam, NaN/Inf grads: param/master NaN, moments NaN/Inf in those elements "
            "only, the rest exact [%s]", mp_isa_name(g_isas[k]));
  }
  printf("      adam with a NaN/Inf grad element: that element's param and master become NaN, "
         "exp_avg_sq NaN (NaN grad) or +Inf (Inf grad), exp_avg NaN or (Inf grad, lerp weight < "
         "0.5) +-Inf; no other element changes; skipping is the caller's job (found_inf)\n");
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    const mp_dtype gt = pr->gt;
    /* +Inf, -Inf, quiet NaN with a payload, negative quiet NaN, signalling NaN, +Inf */
    const uint32_t specials[6] = {
        gt == MP_F32 ? 0x7F800000u : gt == MP_BF16 ? 0x7F80u : 0x7C00u,
        gt == MP_F32 ? 0xFF800000u : gt == MP_BF16 ? 0xFF80u : 0xFC00u,
        gt == MP_F32 ? 0x7FC01234u : gt == MP_BF16 ? 0x7FC3u : 0x7E15u,
        gt == MP_F32 ? 0xFFC00000u : gt == MP_BF16 ? 0xFFC0u : 0xFE00u,
        gt == MP_F32 ? 0x7F800001u : gt == MP_BF16 ? 0x7F81u : 0x7C01u,
        gt == MP_F32 ? 0x7F800000u : gt == MP_BF16 ? 0x7F80u : 0x7C00u,
    };
    adam_buf in, want, got;
    abuf_init(&in, pr->pt, gt, N);
    abuf_init(&want, pr->pt, gt, N);
    abuf_init(&got, pr->pt, gt, N);
    for (int c = 0; c < 16; ++c) {
      const int later = c >= 8; /* a first step from zero moments, or step 5 from random ones */
      adam_cfg cfg = {1e-3f, (c & 4) ? 0.3 : 0.9, 0.999, 1e-8, 1e-2, c & 1, (c >> 1) & 1};
      adam_fill(&in, &s, !later);
      for (size_t j = 0; j < n_pos; ++j) {
        a_put(in.grad, gt, pos[j], specials[(j + (size_t)c) % 6u]);
      }
      ref_scalars hp = adam_scalars(&cfg, later ? 5.0f : 1.0f, later ? 0.25f : 1.0f);
      abuf_copy(&want, &in);
      ref_adam(&want, ADAM_OFF0, (int64_t)N, &hp);
      for (int k = 0; k < g_nisa; ++k) {
        select_isa(g_isas[k]);
        abuf_copy(&got, &in);
        mp_status rs = call_adam(&got, ADAM_OFF0, (int64_t)N, &hp);
        char ctx[400];
        adam_describe(ctx, sizeof ctx, pr->name, mp_isa_name(g_isas[k]), &hp, "");
        g_check(&g[k], rs == MP_OK, "%s: status %d", ctx, (int)rs);
        adam_compare(&g[k], &in, &want, &got, ADAM_OFF0, (int64_t)N, ctx);
        /* the documented outcome, stated directly */
        for (size_t j = 0; j < n_pos; ++j) {
          const size_t i = pos[j];
          const uint32_t gb = a_get(in.grad, gt, i);
          const int isn = a_isnan(gt, gb);
          const int neg = (int)(gb >> (gt == MP_F32 ? 31 : 15)) ^ (cfg.maximize ? 1 : 0);
          const uint32_t pb = a_get(got.param, pr->pt, i), mb = bits_of(got.m[i]);
          const uint32_t vb = bits_of(got.v[i]);
          g_check(&g[k], a_isnan(pr->pt, pb), "%s: grad %08" PRIx32 " at %zu: param %08" PRIx32
                  " is not NaN", ctx, gb, i, pb);
          if (got.master) {
            g_check(&g[k], isnan(got.master[i]), "%s: grad %08" PRIx32 " at %zu: master %08"
                    PRIx32 " is not NaN", ctx, gb, i, bits_of(got.master[i]));
          }
          g_check(&g[k], isn ? isnan(got.v[i]) : vb == 0x7F800000u, "%s: grad %08" PRIx32
                  " at %zu: exp_avg_sq %08" PRIx32, ctx, gb, i, vb);
          int m_ok = (isn || hp.lerp_weight >= 0.5f)
                         ? isnan(got.m[i])
                         : mb == (neg ? 0xFF800000u : 0x7F800000u);
          g_check(&g[k], m_ok, "%s: grad %08" PRIx32 " at %zu: exp_avg %08" PRIx32, ctx, gb, i,
                  mb);
        }
      }
    }
    abuf_free(&in);
    abuf_free(&want);
    abuf_free(&got);
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);
}

/* 11e. Sizes and alignments: n = 0..150 with each array at its own element offset in 0..17
 *      (guard elements around every array must keep their input bits), and a large odd size at
 *      odd offsets, which runs the vectorized body and its tails. */
static void test_adam_sizes(uint64_t seed0) {
  const int64_t MAXN = 150, MAXOFF = 17;
  const size_t cap = (size_t)(MAXN + MAXOFF + 2 * GUARD);
  uint64_t s = seed0 ^ 0x512Eu;
  group g[MP_ISA_COUNT];
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam: n = 0..%d at per-array element offsets 0..%d, 5 dtype pairs == "
            "reference, guards intact [%s]", (int)MAXN, (int)MAXOFF, mp_isa_name(g_isas[k]));
  }
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    adam_buf in, want, got;
    abuf_init(&in, pr->pt, pr->gt, cap);
    abuf_init(&want, pr->pt, pr->gt, cap);
    abuf_init(&got, pr->pt, pr->gt, cap);
    adam_fill(&in, &s, 0);
    for (int64_t n = 0; n <= MAXN; ++n) {
      for (int64_t so = 0; so <= MAXOFF; ++so) {
        const size_t d = (size_t)(MAXOFF + 1);
        adam_off o = {GUARD + (size_t)so, GUARD + (size_t)(so * 7 + n) % d,
                      GUARD + (size_t)(so * 5 + 3) % d, GUARD + (size_t)(so * 11 + 3 * n) % d,
                      GUARD + (size_t)(so + n) % d};
        const int c = (int)((n + so) % 12);
        adam_cfg cfg = {c < 6 ? 1e-3f : 0.1f, (c / 4) == 0 ? 0.9 : (c / 4) == 1 ? 0.5 : 0.3,
                        0.999, 1e-8, 0.05, c & 1, (c >> 1) & 1};
        ref_scalars hp = adam_scalars(&cfg, (float)(1 + so), so & 1 ? 0.125f : 1.0f);
        /* fresh inputs where this call works (the guards keep theirs) */
        adam_fill_range(&in, &s, 0, GUARD, GUARD + (size_t)(MAXN + MAXOFF));
        abuf_copy(&want, &in);
        ref_adam(&want, o, n, &hp);
        for (int k = 0; k < g_nisa; ++k) {
          select_isa(g_isas[k]);
          abuf_copy(&got, &in);
          mp_status rs = call_adam(&got, o, n, &hp);
          char ctx[480], extra[96];
          snprintf(extra, sizeof extra, " (n %" PRId64 ", offsets param %zu grad %zu master %zu "
                   "exp_avg %zu exp_avg_sq %zu)", n, o.p - GUARD, o.g - GUARD, o.w - GUARD,
                   o.m - GUARD, o.v - GUARD);
          adam_describe(ctx, sizeof ctx, pr->name, mp_isa_name(g_isas[k]), &hp, extra);
          g_check(&g[k], rs == MP_OK, "%s: status %d", ctx, (int)rs);
          adam_compare(&g[k], &in, &want, &got, o, n, ctx);
        }
      }
    }
    abuf_free(&in);
    abuf_free(&want);
    abuf_free(&got);
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);

  /* Large: 2^20 + 3 elements, the arrays at different odd/even offsets. */
  const int64_t BIG = ((int64_t)1 << 20) + 3;
  const adam_off ob = {1, 3, 0, 2, 5};
  double tk[MP_ISA_COUNT][N_ADAM_PAIRS];
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam: n = %" PRId64 " at offsets 1/3/0/2/5 (vector body, tails), 5 dtype "
            "pairs == reference, guards intact [%s]", BIG, mp_isa_name(g_isas[k]));
  }
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    adam_buf in, want, got;
    const size_t bcap = (size_t)BIG + 8u;
    abuf_init(&in, pr->pt, pr->gt, bcap);
    abuf_init(&want, pr->pt, pr->gt, bcap);
    abuf_init(&got, pr->pt, pr->gt, bcap);
    adam_fill(&in, &s, 0);
    adam_cfg cfg = {2e-3f, pi % 2 ? 0.3 : 0.9, 0.999, 1e-8, 0.01, (int)(pi % 2 == 0),
                    (int)(pi == 3)};
    ref_scalars hp = adam_scalars(&cfg, 3.0f, 1.0f / 3.0f);
    abuf_copy(&want, &in);
    ref_adam(&want, ob, BIG, &hp);
    for (int k = 0; k < g_nisa; ++k) {
      select_isa(g_isas[k]);
      abuf_copy(&got, &in);
      double t0 = now_s();
      mp_status rs = call_adam(&got, ob, BIG, &hp);
      tk[k][pi] = now_s() - t0;
      char ctx[400];
      adam_describe(ctx, sizeof ctx, pr->name, mp_isa_name(g_isas[k]), &hp, " (large)");
      g_check(&g[k], rs == MP_OK, "%s: status %d", ctx, (int)rs);
      adam_compare(&g[k], &in, &want, &got, ob, BIG, ctx);
    }
    abuf_free(&in);
    abuf_free(&want);
    abuf_free(&got);
  }
  for (int k = 0; k < g_nisa; ++k) {
    printf("      adam kernels [%s]:", mp_isa_name(g_isas[k]));
    for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
      printf(" %s %.2f ns/elt%s", ADAM_PAIRS[pi].name, 1e9 * tk[k][pi] / (double)BIG,
             pi + 1 < N_ADAM_PAIRS ? "," : "\n");
    }
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);
}

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

/* ------------------------------------------------------------------------------------------ */

static uint64_t parse_u64(const char* s, const char* what) {
  char* end;
  unsigned long long v = strtoull(s, &end, 0);
  if (*s == '\0' || *end != '\0') {
    fprintf(stderr, "bad value for %s: %s\n", what, s);
    exit(2);
  }
  return (uint64_t)v;
}

/* 11f. The parts of a step: mp_step over a tensor split into ranges gives the bits of one
 *      call and never writes the step count; mp_step_advance_steps adds 1 to every count; with
 *      found_inf set neither writes anything; a range outside [0, n) is rejected; the options'
 *      pointers (lr, inv_scale) are read as the values they point at. */
static void test_adam_ranges_and_steps(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x5EC7u;
  const size_t N = 777;
  adam_cfg cfg = {3e-3f, 0.9, 0.999, 1e-8, 0.05, 1, 0};
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "adam: ranges == one call, step only read, advance_steps, found_inf skip, "
            "range checks, lr/inv_scale pointers [%s]", mp_isa_name(g_isas[k]));
    for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
      const adam_pair* pr = &ADAM_PAIRS[pi];
      adam_buf in, one, split;
      abuf_init(&in, pr->pt, pr->gt, N);
      abuf_init(&one, pr->pt, pr->gt, N);
      abuf_init(&split, pr->pt, pr->gt, N);
      adam_fill(&in, &s, 0);
      abuf_copy(&one, &in);
      abuf_copy(&split, &in);
      float step = 4.0f;
      const float inv = 0.25f, lr = cfg.lr;
      const ref_scalars hp = adam_scalars(&cfg, 5.0f, inv);
      mp_step_options op = adam_options(&hp, &inv);
      op.lr = &lr; /* through the pointer: lr_value is ignored */
      op.lr_value = 99.0f;
      mp_step_tensor t1 = {one.param, pr->pt, one.grad, pr->gt, one.master, one.m, one.v, &step,
                           (int64_t)N, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL};
      mp_step_tensor t2 = t1;
      t2.param = split.param;
      t2.grad = split.grad;
      t2.master = split.master;
      t2.exp_avg = split.m;
      t2.exp_avg_sq = split.v;
      /* the one call through mp_step's alias of one release, mp_adam_step: the same bits */
      g_check(&g, mp_adam_step(&t1, 0, (int64_t)N, &op) == MP_OK, "%s: one call", pr->name);
      const int64_t cuts[] = {0, 1, 130, 131, 700, (int64_t)N};
      for (int c = 0; c + 1 < 6; ++c) {
        g_check(&g, mp_step(&t2, cuts[c], cuts[c + 1] - cuts[c], &op) == MP_OK,
                "%s: range [%" PRId64 ", %" PRId64 ")", pr->name, cuts[c], cuts[c + 1]);
      }
      adam_buf want;
      abuf_init(&want, pr->pt, pr->gt, N);
      abuf_copy(&want, &in);
      ref_adam(&want, ADAM_OFF0, (int64_t)N, &hp);
      char ctx[64];
      snprintf(ctx, sizeof ctx, "%s one call", pr->name);
      adam_compare(&g, &in, &want, &one, ADAM_OFF0, (int64_t)N, ctx);
      snprintf(ctx, sizeof ctx, "%s in 5 ranges", pr->name);
      adam_compare(&g, &in, &want, &split, ADAM_OFF0, (int64_t)N, ctx);
      g_check(&g, step == 4.0f, "%s: mp_step wrote the step count (%g)", pr->name,
              (double)step);
      /* Out-of-range ranges: nothing written. */
      abuf_copy(&split, &in);
      const int64_t bad[][2] = {{-1, 2}, {0, (int64_t)N + 1}, {(int64_t)N, 1}, {5, -1},
                                {(int64_t)N + 1, 0}, {INT64_MAX, INT64_MAX}};
      for (int b = 0; b < 6; ++b) {
        g_check(&g, mp_step(&t2, bad[b][0], bad[b][1], &op) == MP_ERR_INVALID_ARGUMENT,
                "%s: range (%" PRId64 ", %" PRId64 ") accepted", pr->name, bad[b][0], bad[b][1]);
      }
      snprintf(ctx, sizeof ctx, "%s after rejected ranges", pr->name);
      adam_compare(&g, &in, &in, &split, ADAM_OFF0, 0, ctx);
      /* found_inf: nothing written, the step count not advanced. */
      const float inf_flag = 1.0f, clean = 0.0f;
      op.found_inf = &inf_flag;
      g_check(&g, mp_step(&t2, 0, (int64_t)N, &op) == MP_OK, "%s: skipped call", pr->name);
      snprintf(ctx, sizeof ctx, "%s with found_inf", pr->name);
      adam_compare(&g, &in, &in, &split, ADAM_OFF0, 0, ctx);
      mp_step_tensor both[2] = {t1, t2};
      float step2 = 0.0f;
      both[1].step = &step2;
      g_check(&g, mp_step_advance_steps(both, 2, &op) == MP_OK && step == 4.0f && step2 == 0.0f,
              "%s: advance_steps with found_inf set wrote %g %g", pr->name, (double)step,
              (double)step2);
      op.found_inf = &clean;
      g_check(&g, mp_step_advance_steps(both, 2, &op) == MP_OK && step == 5.0f && step2 == 1.0f,
              "%s: advance_steps gave %g %g", pr->name, (double)step, (double)step2);
      both[1].step = NULL;
      g_check(&g, mp_step_advance_steps(both, 2, &op) == MP_ERR_INVALID_ARGUMENT && step == 5.0f,
              "%s: a NULL step count accepted (or the other written)", pr->name);
      g_check(&g, mp_adam_advance_steps(both, 2, &op) == MP_ERR_INVALID_ARGUMENT && step == 5.0f,
              "%s: the alias mp_adam_advance_steps accepted a NULL step count", pr->name);
      g_check(&g, mp_step_advance_steps(both, -1, &op) == MP_ERR_INVALID_ARGUMENT &&
                  mp_step_advance_steps(NULL, 1, &op) == MP_ERR_INVALID_ARGUMENT &&
                  mp_step_advance_steps(both, 0, NULL) == MP_ERR_INVALID_ARGUMENT,
              "%s: bad advance_steps arguments accepted", pr->name);
      abuf_free(&in);
      abuf_free(&one);
      abuf_free(&split);
      abuf_free(&want);
    }
    g_end(&g);
  }
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

/* 11h. unscale_grads: the gradient is overwritten with its unscaled value (grad * inv_scale in
 *      fp32, rounded to nearest even into a bf16/fp16 gradient) in the same call, and everything
 *      else is what the call without it writes; with inv_scale 1 or found_inf set the gradient
 *      keeps its bits. */
static void test_adam_unscale_grads(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x6AADu;
  const size_t N = 515;
  adam_cfg cfg = {2e-3f, 0.9, 0.999, 1e-8, 0.02, 1, 1};
  static const float invs[] = {0x1p-12f, 1.0f / 3.0f, 1.0f, 65536.0f};
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "adam unscale_grads: grad = RNE(grad * inv_scale), the rest unchanged; inv 1 "
            "and found_inf leave it [%s]", mp_isa_name(g_isas[k]));
    for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
      const adam_pair* pr = &ADAM_PAIRS[pi];
      for (int vi = 0; vi < 4; ++vi) {
        for (int skip = 0; skip < 2; ++skip) {
          adam_buf in, want, got;
          abuf_init(&in, pr->pt, pr->gt, N);
          abuf_init(&want, pr->pt, pr->gt, N);
          abuf_init(&got, pr->pt, pr->gt, N);
          adam_fill(&in, &s, 0);
          abuf_copy(&want, &in);
          abuf_copy(&got, &in);
          const float inv = invs[vi], flag = skip ? 1.0f : 0.0f;
          const ref_scalars hp = adam_scalars(&cfg, 3.0f, inv);
          if (!skip) {
            ref_adam(&want, ADAM_OFF0, (int64_t)N, &hp);
            for (size_t i = 0; i < N && inv != 1.0f; ++i) {
              const float gv = a_value(pr->gt, a_get(in.grad, pr->gt, i)) * inv;
              uint32_t r = bits_of(gv);
              if (pr->gt != MP_F32) {
                int nan;
                r = ref_rne(r, pr->gt == MP_BF16 ? &BF16 : &FP16, &nan);
              }
              a_put(want.grad, pr->gt, i, r);
            }
          }
          float step = 2.0f;
          mp_step_options op = adam_options(&hp, &inv);
          op.unscale_grads = 1;
          op.found_inf = &flag;
          const mp_step_tensor t = {got.param, pr->pt, got.grad, pr->gt, got.master, got.m,
                                    got.v, &step, (int64_t)N, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL};
          g_check(&g, mp_step(&t, 0, (int64_t)N, &op) == MP_OK, "%s: status", pr->name);
          char ctx[96];
          snprintf(ctx, sizeof ctx, "%s inv_scale %a%s", pr->name, (double)inv,
                   skip ? " found_inf" : "");
          adam_compare(&g, &in, &want, &got, ADAM_OFF0, (int64_t)N, ctx);
          abuf_free(&in);
          abuf_free(&want);
          abuf_free(&got);
        }
      }
    }
    g_end(&g);
  }
}

/* 11i. Lean storage (adam.h): against this file's reference of the element update,
 *   - a remainder: the same bits as an fp32 master, step after step (param, master = join of
 *     param and remainder, moments), on random data and on masters planted at bf16 ties;
 *   - bf16 moments: the reference's fp32 moments rounded to bf16 stochastically with the
 *     documented bits (stream 2k of the step, position i: low half for exp_avg, high half for
 *     exp_avg_sq), or to nearest with moments_nearest;
 *   - no master: the update from the param's own value, written to nearest or stochastically
 *     (stream 2k + 1) into bf16 and fp16: the rounding stated from its definition here.
 * Every ISA path, ranges split anywhere (the bits depend on the element's position only). */

/* fp32 value u rounded stochastically to fmt f with 32 random bits r: the dropped fraction of
 * the magnitude as a 32-bit fixed-point number plus r carries (bf16: r's low 16 bits plus the
 * dropped 16 bits). Values past the largest finite (fp16) round as to nearest. */
static uint32_t ref_sr_fmt(uint32_t u, uint32_t r, const fmt* f) {
  int nan;
  if (f == &BF16) return ref_sr(u, r & 0xFFFFu, &nan);
  float x = f32_of(u);
  if (isnan(x) || fabs((double)x) >= f->max) return ref_rne(u, f, &nan);
  double ax = fabs((double)x);
  cands c = candidates(ax, f);
  double d32 = floor((ax - c.lo) / c.q * 4294967296.0);
  return encode(d32 + (double)r >= 4294967296.0 ? c.hi : c.lo, (u >> 31) != 0, f);
}

/* The address at which an array whose first element is element `base` of a param would begin:
 * what a caller passes for a range starting at `base` (the kernel only touches the range). */
static void* lean_at(void* p, int64_t base, int elem_bytes) {
  return (void*)((uintptr_t)p - (uintptr_t)base * (uintptr_t)elem_bytes);
}

static void test_adam_lean(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x1EA7u;
  const int64_t N = 777;
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "adam lean storage (positions across 2^32 too): remainder == fp32 master bit "
            "for bit (ties included), bf16 moments and master-free params rounded as "
            "documented, the ema of each [%s]",
            mp_isa_name(g_isas[k]));
    for (int mode = 0; mode < 7; ++mode) {
      /* 0 remainder; 1 bf16 moments SR; 2 bf16 moments nearest; 3/4 no master bf16 RNE/SR;
       * 5/6 no master fp16 RNE/SR */
      const mp_dtype pt = mode >= 5 ? MP_F16 : MP_BF16;
      const int mom16 = mode == 1 || mode == 2 || mode == 4 || mode == 6;
      const int no_master = mode >= 3, sr_p = mode == 4 || mode == 6;
      uint16_t* param = xmalloc((size_t)N * 2);
      uint16_t* param2 = xmalloc((size_t)N * 2);
      uint16_t* grad = xmalloc((size_t)N * 2);
      float* master = xmalloc((size_t)N * 4);
      int16_t* rem = xmalloc((size_t)N * 2);
      float* m32 = xmalloc((size_t)N * 4);
      float* v32 = xmalloc((size_t)N * 4);
      uint16_t* m16 = xmalloc((size_t)N * 2);
      uint16_t* v16 = xmalloc((size_t)N * 2);
      float* ema = xmalloc((size_t)N * 4);  /* an ema of the fp32 value, in every mode */
      float* ema2 = xmalloc((size_t)N * 4); /* the remainder run's */
      for (int64_t i = 0; i < N; ++i) {
        ema[i] = ema2[i] = adam_rand(&s, -8, 3); /* overwritten by the first step's copy */
        float x = adam_rand(&s, -8, 3);
        if (i % 97 == 5) x = f32_of((bits_of(x) & 0xFFFE0000u) | 0x8000u); /* a tie above even */
        if (i % 97 == 6) x = f32_of((bits_of(x) | 0x10000u) | 0x8000u);   /* above odd */
        master[i] = x;
        param[i] = (uint16_t)(pt == MP_BF16 ? mp_bf16_rne_bits(bits_of(x)) : mp_fp16_rne_bits(bits_of(x)));
        if (pt == MP_BF16) master[i] = f32_of(mp_bf16_master_bits(bits_of(x)));
        param[i] = (uint16_t)(pt == MP_BF16 ? mp_bf16_rne_bits(bits_of(master[i]))
                                            : mp_fp16_rne_bits(bits_of(master[i])));
        param2[i] = param[i];
        rem[i] = (int16_t)mp_bf16_remainder(bits_of(master[i]), param[i]);
        m32[i] = mom16 ? f32_of((uint32_t)mp_bf16_rne_bits(bits_of(adam_rand(&s, -20, -4))) << 16)
                       : adam_rand(&s, -20, -4);
        v32[i] = fabsf(mom16 ? f32_of((uint32_t)mp_bf16_rne_bits(bits_of(adam_rand(&s, -40, -8)))
                                      << 16)
                             : adam_rand(&s, -40, -8));
        m16[i] = (uint16_t)(bits_of(m32[i]) >> 16);
        v16[i] = (uint16_t)(bits_of(v32[i]) >> 16);
      }
      adam_cfg cfg = {2e-3f, 0.9, 0.999, 1e-8, 0.01, mode % 2, mode == 3};
      for (int step = 0; step < 4; ++step) {
        for (int64_t i = 0; i < N; ++i) {
          grad[i] = (uint16_t)(pt == MP_BF16 ? mp_bf16_rne_bits(bits_of(adam_rand(&s, -10, 2)))
                                             : mp_fp16_rne_bits(bits_of(adam_rand(&s, -10, 2))));
        }
        float stp = (float)step, stp2 = (float)step;
        const ref_scalars hp = adam_scalars(&cfg, (float)(step + 1), 1.0f);
        mp_step_options op = adam_options(&hp, NULL);
        op.seed = 0xC0FFEEull + (uint64_t)mode;
        op.sr_params = sr_p;
        op.moments_nearest = mode == 2;
        /* both of torch.lerp's forms: weight 1 - decay below 0.5 and not */
        op.ema_decay = mode % 2 ? 0.3 : 0.75;
        const float ema_w = step == 0 ? 1.0f : (float)(1.0 - op.ema_decay);
        const uint64_t stream = 3u + (uint64_t)mode;
        /* the reference: on fp32 copies */
        float* wp = xmalloc((size_t)N * 4);
        float* wm = xmalloc((size_t)N * 4);
        float* wv = xmalloc((size_t)N * 4);
        for (int64_t i = 0; i < N; ++i) {
          float p = no_master ? (pt == MP_BF16 ? f32_of((uint32_t)param[i] << 16)
                                               : (float)decode(param[i], &FP16))
                              : master[i];
          float gv = pt == MP_BF16 ? f32_of((uint32_t)grad[i] << 16) : (float)decode(grad[i], &FP16);
          float mv = mom16 ? f32_of((uint32_t)m16[i] << 16) : m32[i];
          float vv = mom16 ? f32_of((uint32_t)v16[i] << 16) : v32[i];
          ref_adam_elem(&hp, gv, &p, &mv, &vv);
          wp[i] = p;
          wm[i] = mv;
          wv[i] = vv;
        }
        /* mpext, in three ranges. On odd steps the arrays hold positions [base, base + N) of a
         * param of base + N elements, with base + 400 = 2^32, so that the middle range crosses
         * 2^32 (the kernel splits a range there: the random bits' position is 64-bit). */
        const int64_t base = step % 2 ? ((int64_t)1 << 32) - 400 : 0;
        mp_step_tensor t = {lean_at(param, base, 2), pt, lean_at(grad, base, 2),
                            pt, no_master ? NULL : (float*)lean_at(master, base, 4),
                            mom16 ? lean_at(m16, base, 2) : lean_at(m32, base, 4),
                            mom16 ? lean_at(v16, base, 2) : lean_at(v32, base, 4),
                            &stp, base + N, NULL, mom16 ? MP_FMT_BF16 : MP_FMT_F32,
                            mom16 ? MP_FMT_BF16 : MP_FMT_F32, stream, NULL, NULL, NULL};
        t.ema = (float*)lean_at(ema, base, 4);
        mp_step_tensor t2 = t;
        t2.ema = (float*)lean_at(ema2, base, 4);
        float* master2 = NULL;
        float *m2 = NULL, *v2 = NULL;
        if (mode == 0) { /* the remainder run beside the master run */
          t2.param = lean_at(param2, base, 2);
          t2.master = NULL;
          t2.remainder = (int16_t*)lean_at(rem, base, 2);
          t2.step = &stp2;
          master2 = xmalloc((size_t)N * 4);
          memcpy(master2, master, (size_t)N * 4);
          m2 = xmalloc((size_t)N * 4);
          v2 = xmalloc((size_t)N * 4);
          memcpy(m2, m32, (size_t)N * 4);
          memcpy(v2, v32, (size_t)N * 4);
          t2.exp_avg = lean_at(m2, base, 4);
          t2.exp_avg_sq = lean_at(v2, base, 4);
        }
        float* ema_before = xmalloc((size_t)N * 4);
        memcpy(ema_before, ema, (size_t)N * 4);
        const int64_t cuts[] = {0, 13, 500, N};
        for (int c = 0; c < 3; ++c) {
          g_check(&g, mp_step(&t, base + cuts[c], cuts[c + 1] - cuts[c], &op) == MP_OK,
                  "mode %d: status", mode);
          if (mode == 0) {
            g_check(&g, mp_step(&t2, base + cuts[c], cuts[c + 1] - cuts[c], &op) == MP_OK,
                    "remainder: status");
          }
        }
        const uint64_t key_m = ref_key(op.seed, (uint64_t)step + 1u, 2u * stream);
        const uint64_t key_p = ref_key(op.seed, (uint64_t)step + 1u, 2u * stream + 1u);
        int bad = 0;
        for (int64_t i = 0; i < N && bad < 5; ++i) {
          const uint64_t pos = (uint64_t)(base + i);
          const uint32_t rm = ref_bits(key_m, pos), rp = ref_bits(key_p, pos);
          int nan;
          if (mom16) {
            const uint32_t wmb = mode == 2 ? ref_rne(bits_of(wm[i]), &BF16, &nan)
                                           : ref_sr_fmt(bits_of(wm[i]), rm, &BF16);
            const uint32_t wvb = mode == 2 ? ref_rne(bits_of(wv[i]), &BF16, &nan)
                                           : ref_sr_fmt(bits_of(wv[i]), rm >> 16, &BF16);
            if (m16[i] != wmb || v16[i] != wvb) {
              bad++;
              g_fail(&g, "mode %d step %d element %" PRId64 ": moments %04x %04x, want %04x %04x",
                     mode, step, i, m16[i], v16[i], wmb, wvb);
            }
          } else if (bits_of(m32[i]) != bits_of(wm[i]) || bits_of(v32[i]) != bits_of(wv[i])) {
            bad++;
            g_fail(&g, "mode %d step %d element %" PRId64 ": fp32 moments differ", mode, step, i);
          }
          uint32_t want_p;
          /* the ema follows the master as stored, or the fp32 update when there is none */
          float ev = wp[i];
          if (!no_master && (bits_of(ev) & 0x1FFFFu) == 0x8000u) ev = f32_of(bits_of(ev) - 1u);
          const float ed = ev - ema_before[i];
          const float want_ema = ema_w < 0.5f ? ema_before[i] + ema_w * ed
                                              : ev - ed * (1.0f - ema_w);
          if (bits_of(ema[i]) != bits_of(want_ema) || (mode == 0 && bits_of(ema2[i]) != bits_of(ema[i]))) {
            bad++;
            g_fail(&g, "mode %d step %d element %" PRId64 ": ema %08x, want %08x", mode, step, i,
                   bits_of(ema[i]), bits_of(want_ema));
          }
          if (!no_master) {
            uint32_t x = bits_of(wp[i]);
            if ((x & 0x1FFFFu) == 0x8000u) x -= 1u; /* finite here */
            want_p = ref_rne(x, &BF16, &nan);
            if (bits_of(master[i]) != x) {
              bad++;
              g_fail(&g, "mode %d step %d element %" PRId64 ": master %08x, want %08x", mode, step,
                     i, bits_of(master[i]), x);
            }
          } else {
            want_p = sr_p ? ref_sr_fmt(bits_of(wp[i]), rp, pt == MP_BF16 ? &BF16 : &FP16)
                          : ref_rne(bits_of(wp[i]), pt == MP_BF16 ? &BF16 : &FP16, &nan);
          }
          if (param[i] != want_p) {
            bad++;
            g_fail(&g, "mode %d step %d element %" PRId64 ": param %04x, want %04x", mode, step,
                   i, param[i], want_p);
          }
          if (mode == 0) {
            const uint32_t joined = mp_bf16_join(param2[i], (uint16_t)rem[i]);
            if (param2[i] != param[i] || joined != bits_of(master[i]) ||
                bits_of(m2[i]) != bits_of(m32[i]) || bits_of(v2[i]) != bits_of(v32[i])) {
              bad++;
              g_fail(&g, "remainder step %d element %" PRId64 ": param %04x master %08x, want "
                     "%04x %08x", step, i, param2[i], joined, param[i], bits_of(master[i]));
            }
          }
          g.count++;
        }
        if (mode == 0) {
          free(m2);
          free(v2);
          free(master2);
        }
        free(wp);
        free(wm);
        free(wv);
        free(ema_before);
      }
      free(ema);
      free(ema2);
      free(param);
      free(param2);
      free(grad);
      free(master);
      free(rem);
      free(m32);
      free(v32);
      free(m16);
      free(v16);
    }
    g_end(&g);
  }
}

/* 11k. 8-bit block-quantized moments (adam.h, "8-bit moments"). The reference restates the
 *      documented format in double: the value of every code by its definition, the nearest code
 *      (ties to the even code) and the stochastic choice (up iff floor(fraction * 2^16) + r16 >=
 *      2^16) by comparing against every code's value, the block reference from the absmax by
 *      its definition. The codec functions of mpext/step_common.h are checked against it exhaustively
 *      over codes and on boundary and random values; the whole step block by block (decode,
 *      the v floor, the element update, the new absmax, encode) on every ISA path, every param
 *      storage, ranges split at block boundaries, both roundings. */

typedef struct q8_fmt {
  int ebits, mbits, is_signed;
} q8_fmt;

static const q8_fmt Q8_M = {MP_Q8_M_EBITS, MP_Q8_M_MBITS, 1};
static const q8_fmt Q8_V = {MP_Q8_V_EBITS, MP_Q8_V_MBITS, 0};

static int q8_ncodes(const q8_fmt* f) { return 1 << (f->ebits + f->mbits); }

/* The value of magnitude code c at reference exponent field ea: 2^(e - T) (1 + f / 2^M) or
 * 2^(1 - T) f / 2^M, times 2^(ea - 127). */
static double q8_value(const q8_fmt* f, int c, int ea) {
  const int t = (1 << f->ebits) - 1, e = c >> f->mbits, m = c & ((1 << f->mbits) - 1);
  const double rel = e ? ldexp(1.0 + ldexp((double)m, -f->mbits), e - t)
                       : ldexp(ldexp((double)m, -f->mbits), 1 - t);
  return ldexp(rel, ea - 127);
}

/* The reference exponent field of a block with absmax a: the field of a's binade, one more
 * when a exceeds the binade's largest 1 + M significant-bit value, at least 2^ebits; 255 for a
 * NaN or Inf absmax. */
static int q8_ref_exp_ref(const q8_fmt* f, double a) {
  if (!(a <= 3.5e38)) return 255;
  int field = 1 << f->ebits;
  if (a > 0) {
    int e;
    (void)frexp(a, &e); /* a = fr 2^e, fr in [0.5, 1): binade 2^(e-1) */
    int fe = e - 1 + 127;
    if (a > ldexp(2.0 - ldexp(1.0, -f->mbits), e - 1)) fe += 1;
    if (fe > field) field = fe;
  }
  return field;
}

/* The code of magnitude |x| (a double) at ea: nearest (ties to even) or stochastic with r16. */
static int q8_encode_ref(const q8_fmt* f, double ax, int ea, uint32_t r16, int nearest) {
  const int n = q8_ncodes(f);
  int lo = 0;
  for (int c = 0; c < n; ++c) {
    if (q8_value(f, c, ea) <= ax) lo = c;
  }
  if (lo == n - 1 || q8_value(f, lo, ea) == ax) return lo;
  const double vl = q8_value(f, lo, ea), vh = q8_value(f, lo + 1, ea);
  if (nearest) {
    const double dl = ax - vl, dh = vh - ax;
    return dl < dh ? lo : (dh < dl ? lo + 1 : ((lo & 1) ? lo + 1 : lo));
  }
  const double frac = (ax - vl) / (vh - vl); /* exact: vh - vl is a power of two */
  return floor(frac * 65536.0) + (double)r16 >= 65536.0 ? lo + 1 : lo;
}

static int q8_encode_full_ref(const q8_fmt* f, float x, int ea, uint32_t r16, int nearest) {
  const int c = q8_encode_ref(f, fabs((double)x), ea, r16, nearest);
  return f->is_signed && signbit(x) ? c | 0x80 : c;
}

static double q8_decode_ref(const q8_fmt* f, int code, int ea) {
  if (ea >= 255) return NAN;
  const int mag = f->is_signed ? code & 0x7F : code;
  const double v = q8_value(f, mag, ea);
  return f->is_signed && (code & 0x80) ? -v : v;
}

static uint32_t q8_encode_kernel(const q8_fmt* f, float x, uint32_t ea, uint32_t r16, int nearest) {
  return f->is_signed ? mp_q8_encode_m(x, ea, r16, nearest) : mp_q8_encode_v(x, ea, r16, nearest);
}

static void test_q8_codec(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x0C0DEC8u;
  const q8_fmt* fmts[2] = {&Q8_M, &Q8_V};
  group g;
  g_begin(&g, "8-bit moment codec: decode of every code, reference exponents, encode to nearest "
          "and stochastic against exhaustive search");
  for (int k = 0; k < 2; ++k) {
    const q8_fmt* f = fmts[k];
    const int lo_field = 1 << f->ebits;
    const int eas[] = {lo_field, lo_field + 1, 100, 127, 140, 200, 254};
    int bad = 0;
    /* decode: every code at each reference, exact */
    for (size_t j = 0; j < sizeof eas / sizeof eas[0]; ++j) {
      const float r = mp_q8_ref((uint32_t)eas[j]);
      for (int c = 0; c < 256 && bad < 5; ++c) {
        const float got =
            f->is_signed ? mp_q8_decode_m((uint8_t)c, r) : mp_q8_decode_v((uint8_t)c, r);
        const double want = q8_decode_ref(f, c, eas[j]);
        g.count++;
        if ((double)got != want || !signbit(got) != !signbit(want)) {
          bad++;
          g_fail(&g, "%s decode code %02x ea %d: %a, want %a", k ? "v" : "m", c, eas[j],
                 (double)got, want);
        }
      }
    }
    const float r255 = mp_q8_ref(255u);
    g_check(&g, isnan(f->is_signed ? mp_q8_decode_m(3, r255) : mp_q8_decode_v(3, r255)),
            "a non-finite block decodes to NaN");
    /* reference exponent of an absmax: boundaries and random values */
    for (int i = 0; i < 20000 && bad < 5; ++i) {
      uint32_t a;
      if (i < 256) {
        /* around the round-up point of binade i: 2 - 2^-M and its neighbours */
        const uint32_t top =
            ((uint32_t)(i % 254 + 1) << 23) | (((1u << f->mbits) - 1u) << (23 - f->mbits));
        a = top + (uint32_t)(i % 3) - 1u;
      } else if (i < 260) {
        a = i == 256 ? 0u : i == 257 ? 1u : i == 258 ? 0x7F800000u : 0x7FC00000u;
      } else {
        a = (uint32_t)splitmix64(&s) & 0x7FFFFFFFu;
      }
      const uint32_t got = mp_q8_ref_exp(a, (uint32_t)f->ebits, (uint32_t)f->mbits);
      const int want = q8_ref_exp_ref(f, (double)f32_of(a));
      g.count++;
      if (!(want == 255 ? got >= 255u : got == (uint32_t)want)) {
        bad++;
        g_fail(&g, "%s ref_exp of %08x: %u, want %d", k ? "v" : "m", a, got, want);
      }
    }
    /* encode: every code value, the midpoints and their neighbours, random values in and
     * below the range, each at several references, both roundings */
    for (size_t j = 0; j < sizeof eas / sizeof eas[0] && bad < 5; ++j) {
      const int ea = eas[j];
      for (int i = 0; i < 6000 && bad < 5; ++i) {
        float x;
        const int c = i % (q8_ncodes(f) - 1);
        const int kind = (i / (q8_ncodes(f) - 1)) % 4;
        if (i < 4 * (q8_ncodes(f) - 1)) {
          const double v = kind == 0 ? q8_value(f, c, ea)
                                     : 0.5 * (q8_value(f, c, ea) + q8_value(f, c + 1, ea));
          x = (float)v;
          if (kind == 2) x = nextafterf(x, 0.0f);
          if (kind == 3) x = nextafterf(x, INFINITY);
        } else {
          /* anywhere from far below the smallest code to the top binade */
          const int e = ea - 127 - (int)(splitmix64(&s) % (uint64_t)((1 << f->ebits) + 12));
          x = (float)ldexp(1.0 + (double)(splitmix64(&s) >> 11) * 0x1p-53, e);
          if (!(fabs((double)x) <= q8_value(f, q8_ncodes(f) - 1, ea))) {
            x = (float)q8_value(f, 5, ea);
          }
        }
        if (f->is_signed && (splitmix64(&s) & 1u)) x = -x;
        const uint32_t r16 = (uint32_t)splitmix64(&s) & 0xFFFFu;
        for (int nearest = 0; nearest < 2; ++nearest) {
          const uint32_t got = q8_encode_kernel(f, x, (uint32_t)ea, r16, nearest);
          const int want = q8_encode_full_ref(f, x, ea, r16, nearest);
          g.count++;
          if (got != (uint32_t)want) {
            bad++;
            g_fail(&g, "%s encode %a at ea %d r16 %04x %s: %02x, want %02x", k ? "v" : "m",
                   (double)x, ea, r16, nearest ? "nearest" : "stochastic", got, want);
          }
        }
      }
    }
    /* stochastic rounding is unbiased: a value 3/8 of the way between two codes rounds up for
     * exactly 3/8 of the 2^16 random words */
    {
      const int ea = 127;
      const double v0 = q8_value(f, 20, ea), v1 = q8_value(f, 21, ea);
      const float x = (float)(v0 + 0.375 * (v1 - v0));
      int ups = 0;
      for (uint32_t r16 = 0; r16 < 65536u; ++r16) ups += q8_encode_kernel(f, x, ea, r16, 0) == 21u;
      g_check(&g, ups == 24576, "%s: %d of 65536 random words round up, want 24576",
              k ? "v" : "m", ups);
    }
  }
  g_end(&g);
}

/* One param with 8-bit moments, and the reference's copies. */
typedef struct q8_case {
  int64_t n, block;
  mp_dtype pt, gt;
  int storage; /* 0 fp32 param, 1 master, 2 remainder, 3 master-free RNE, 4 master-free SR */
  int write_grad, nearest;
} q8_case;

static void test_adam_q8(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x5108u;
  const q8_case cases[] = {
      {1000, 256, MP_F32, MP_F32, 0, 0, 0},  {777, 32, MP_BF16, MP_BF16, 1, 0, 0},
      {4096 + 77, 256, MP_BF16, MP_BF16, 2, 1, 0}, {3000, 2048, MP_BF16, MP_F32, 4, 0, 0},
      {600, 64, MP_F16, MP_F16, 4, 1, 0},    {513, 128, MP_F16, MP_F32, 1, 0, 1},
      {700, 256, MP_BF16, MP_BF16, 3, 0, 1}, {2100, 512, MP_BF16, MP_BF16, 2, 0, 1},
  };
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "adam 8-bit moments == block reference, every storage, split ranges [%s]",
            mp_isa_name(g_isas[k]));
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci) {
      const q8_case* c = &cases[ci];
      const int64_t n = c->n, b = c->block, nb = (n + b - 1) / b;
      const mp_dtype pt = c->pt;
      const size_t ps = pt == MP_F32 ? 4u : 2u, gs = c->gt == MP_F32 ? 4u : 2u;
      void* param = xmalloc((size_t)n * ps);
      void* grad = xmalloc((size_t)n * gs);
      void* grad0 = xmalloc((size_t)n * gs);
      float* master = xmalloc((size_t)n * 4);
      int16_t* rem = xmalloc((size_t)n * 2);
      uint8_t* mc = xmalloc((size_t)n);
      uint8_t* vc = xmalloc((size_t)n);
      float* ms = xmalloc((size_t)nb * 4);
      float* vs = xmalloc((size_t)nb * 4);
      float* wp = xmalloc((size_t)n * 4);
      float* wm = xmalloc((size_t)n * 4);
      float* wv = xmalloc((size_t)n * 4);
      for (int64_t i = 0; i < n; ++i) {
        const float x = adam_rand(&s, -6, 2);
        const uint32_t xs = pt == MP_BF16 ? mp_bf16_master_bits(bits_of(x)) : bits_of(x);
        master[i] = f32_of(xs);
        if (pt == MP_F32) {
          ((float*)param)[i] = x;
        } else {
          const uint16_t h =
              (uint16_t)(pt == MP_BF16 ? mp_bf16_rne_bits(xs) : mp_fp16_rne_bits(xs));
          ((uint16_t*)param)[i] = h;
          rem[i] = pt == MP_BF16 ? (int16_t)mp_bf16_remainder(xs, h) : 0;
        }
        mc[i] = (uint8_t)splitmix64(&s);
        vc[i] = (uint8_t)splitmix64(&s);
      }
      for (int64_t j = 0; j < nb; ++j) {
        /* scales over many binades; one block of zeros */
        ms[j] = j == 1 ? 0.0f : fabsf(adam_rand(&s, -24, -2));
        vs[j] = j == 1 ? 0.0f : fabsf(adam_rand(&s, -40, -6));
        if (j == 1) {
          for (int64_t i = b; i < 2 * b && i < n; ++i) mc[i] = vc[i] = 0;
        }
      }
      const adam_cfg cfg = {1e-2f, 0.9, 0.99, 1e-8, 0.05, (int)(ci % 2), ci == 5};
      for (int step = 0; step < 3; ++step) {
        for (int64_t i = 0; i < n; ++i) {
          const float gv = adam_rand(&s, -12, 1);
          if (c->gt == MP_F32) {
            ((float*)grad)[i] = gv;
          } else {
            ((uint16_t*)grad)[i] = (uint16_t)(c->gt == MP_BF16 ? mp_bf16_rne_bits(bits_of(gv))
                                                               : mp_fp16_rne_bits(bits_of(gv)));
          }
        }
        memcpy(grad0, grad, (size_t)n * gs);
        const float inv = c->write_grad ? 0.5f : 1.0f;
        const ref_scalars hp = adam_scalars(&cfg, (float)(step + 1), inv);
        mp_step_options op = adam_options(&hp, &inv);
        op.unscale_grads = c->write_grad;
        op.seed = 0xBEEF00ull + ci;
        op.sr_params = c->storage == 4;
        op.moments_nearest = c->nearest;
        op.q8_block = b;
        const uint64_t stream = 7u + ci;
        const double r = cfg.beta1 * cfg.beta1 / cfg.beta2;
        const float inv_k =
            (float)(((1.0 - cfg.beta2) * (1.0 - r)) / ((1.0 - cfg.beta1) * (1.0 - cfg.beta1)));
        const uint64_t key = ref_key(op.seed, (uint64_t)step + 1u, (1ull << 33) + stream);
        const uint64_t key_p = ref_key(op.seed, (uint64_t)step + 1u, 2u * stream + 1u);
        /* the reference, block by block */
        uint8_t* wmc = xmalloc((size_t)n);
        uint8_t* wvc = xmalloc((size_t)n);
        float* wms = xmalloc((size_t)nb * 4);
        float* wvs = xmalloc((size_t)nb * 4);
        for (int64_t j = 0; j < nb; ++j) {
          const int em = q8_ref_exp_ref(&Q8_M, (double)ms[j]);
          const int ev = q8_ref_exp_ref(&Q8_V, (double)vs[j]);
          float am = 0.0f, av = 0.0f;
          const int64_t i1 = (j + 1) * b < n ? (j + 1) * b : n;
          for (int64_t i = j * b; i < i1; ++i) {
            float mv = (float)q8_decode_ref(&Q8_M, mc[i], em);
            float vv = (float)q8_decode_ref(&Q8_V, vc[i], ev);
            const float mm = mv * mv, w = mm * inv_k;
            if (w > vv) vv = w;
            float p = c->storage == 1   ? master[i]
                      : c->storage == 2
                          ? f32_of(mp_bf16_join(((uint16_t*)param)[i], (uint16_t)rem[i]))
                      : pt == MP_F32    ? ((float*)param)[i]
                                        : a_value(pt, ((uint16_t*)param)[i]);
            const uint32_t gb = c->gt == MP_F32 ? bits_of(((float*)grad)[i]) : ((uint16_t*)grad)[i];
            ref_adam_elem(&hp, a_value(c->gt, gb), &p, &mv, &vv);
            wp[i] = p;
            wm[i] = mv;
            wv[i] = vv;
            if (fabsf(mv) > am) am = fabsf(mv);
            if (fabsf(vv) > av) av = fabsf(vv);
          }
          wms[j] = am;
          wvs[j] = av;
          const int nem = q8_ref_exp_ref(&Q8_M, (double)am);
          const int nev = q8_ref_exp_ref(&Q8_V, (double)av);
          for (int64_t i = j * b; i < i1; ++i) {
            const uint32_t rr = ref_bits(key, (uint64_t)i);
            wmc[i] = (uint8_t)q8_encode_full_ref(&Q8_M, wm[i], nem, rr & 0xFFFFu, c->nearest);
            wvc[i] = (uint8_t)q8_encode_full_ref(&Q8_V, wv[i], nev, rr >> 16, c->nearest);
          }
        }
        /* mpext, in ranges cut at block boundaries */
        float stp = (float)step;
        mp_step_tensor t = {param, pt, grad, c->gt, c->storage == 1 ? master : NULL, mc, vc, &stp,
                            n, c->storage == 2 ? rem : NULL, MP_FMT_Q8S, MP_FMT_Q8U, stream, ms, vs, NULL};
        const int64_t cuts[] = {0, b, b * (nb / 2), n};
        for (int cc = 0; cc < 3; ++cc) {
          const int64_t a0 = cuts[cc] < n ? cuts[cc] : n, a1 = cuts[cc + 1] < n ? cuts[cc + 1] : n;
          if (a1 > a0) {
            g_check(&g, mp_step(&t, a0, a1 - a0, &op) == MP_OK, "case %zu: status", ci);
          }
        }
        int bad = 0;
        for (int64_t j = 0; j < nb && bad < 5; ++j) {
          if (bits_of(ms[j]) != bits_of(wms[j]) || bits_of(vs[j]) != bits_of(wvs[j])) {
            bad++;
            g_fail(&g, "case %zu step %d block %" PRId64 ": scales %a %a, want %a %a", ci, step,
                   j, (double)ms[j], (double)vs[j], (double)wms[j], (double)wvs[j]);
          }
        }
        for (int64_t i = 0; i < n && bad < 5; ++i) {
          g.count++;
          if (mc[i] != wmc[i] || vc[i] != wvc[i]) {
            bad++;
            g_fail(&g, "case %zu step %d element %" PRId64 ": codes %02x %02x, want %02x %02x "
                   "(fp32 %a %a)", ci, step, i, mc[i], vc[i], wmc[i], wvc[i], (double)wm[i],
                   (double)wv[i]);
          }
          int nan;
          uint32_t want_p, got_p;
          if (pt == MP_F32) {
            want_p = bits_of(wp[i]);
            got_p = bits_of(((float*)param)[i]);
          } else if (c->storage == 1 || c->storage == 2) {
            uint32_t x = bits_of(wp[i]);
            if (pt == MP_BF16 && (x & 0x1FFFFu) == 0x8000u) x -= 1u;
            want_p = ref_rne(x, pt == MP_BF16 ? &BF16 : &FP16, &nan);
            got_p = ((uint16_t*)param)[i];
            const uint32_t gotw = c->storage == 1 ? bits_of(master[i])
                                                  : mp_bf16_join((uint16_t)got_p, (uint16_t)rem[i]);
            if (gotw != x) {
              bad++;
              g_fail(&g, "case %zu step %d element %" PRId64 ": master %08x, want %08x", ci, step,
                     i, gotw, x);
            }
          } else {
            const fmt* pf = pt == MP_BF16 ? &BF16 : &FP16;
            want_p = c->storage == 4 ? ref_sr_fmt(bits_of(wp[i]), ref_bits(key_p, (uint64_t)i), pf)
                                     : ref_rne(bits_of(wp[i]), pf, &nan);
            got_p = ((uint16_t*)param)[i];
          }
          if (got_p != want_p) {
            bad++;
            g_fail(&g, "case %zu step %d element %" PRId64 ": param %08x, want %08x", ci, step, i,
                   got_p, want_p);
          }
          if (c->write_grad) {
            const uint32_t g0 = a_get(grad0, c->gt, (size_t)i);
            const float gu = a_value(c->gt, g0) * inv;
            const uint32_t wg = c->gt == MP_F32
                                    ? bits_of(gu)
                                    : ref_rne(bits_of(gu), c->gt == MP_BF16 ? &BF16 : &FP16, &nan);
            const uint32_t gg = a_get(grad, c->gt, (size_t)i);
            if (gg != wg) {
              bad++;
              g_fail(&g, "case %zu element %" PRId64 ": unscaled grad %08x, want %08x", ci, i,
                     gg, wg);
            }
          }
        }
        free(wmc);
        free(wvc);
        free(wms);
        free(wvs);
      }
      free(param);
      free(grad);
      free(grad0);
      free(master);
      free(rem);
      free(mc);
      free(vc);
      free(ms);
      free(vs);
      free(wp);
      free(wm);
      free(wv);
    }
    g_end(&g);
  }
}

/* 11l. 8-bit moments: a block whose small second moments decode to 0 beside a large one keeps
 *      m / sqrt(v) bounded (the v floor); a skipped step writes no code and no scale; the
 *      arguments only 8-bit moments have are checked. */
static void test_adam_q8_guards(void) {
  group g;
  g_begin(&g, "adam 8-bit moments: v floor bounds the update, a skipped step writes nothing, "
          "argument checks");
  const int64_t n = 256;
  float* param = xmalloc((size_t)n * 4);
  float* grad = xmalloc((size_t)n * 4);
  uint8_t* mc = xmalloc((size_t)n);
  uint8_t* vc = xmalloc((size_t)n);
  float ms[4] = {0}, vs[4] = {0}, stp = 9.0f; /* 4: the 200-element call below */
  for (int64_t i = 0; i < n; ++i) {
    param[i] = 1.0f;
    grad[i] = 0.0f;
    /* element 0 holds v's absmax; the others a first moment at the top of m's range and a
     * second moment that the code lost (0): an exact average cannot do that */
    mc[i] = i == 0 ? 0u : 0x7Fu;
    vc[i] = i == 0 ? 0xFFu : 0u;
  }
  ms[0] = 1e-3f;
  vs[0] = 1.0f;
  const float lr = 1e-3f;
  mp_step_options op;
  memset(&op, 0, sizeof op);
  op.beta1 = 0.9;
  op.beta2 = 0.999;
  op.eps = 1e-8;
  op.lr_value = lr;
  op.q8_block = 256;
  mp_step_tensor t = {param, MP_F32, grad, MP_F32, NULL, mc, vc, &stp, n, NULL, MP_FMT_Q8S, MP_FMT_Q8U, 0,
                      ms, vs, NULL};
  g_check(&g, mp_step(&t, 0, n, &op) == MP_OK, "status");
  /* |update| <= lr sqrt(K) sqrt(1 - b2^t) / (1 - b1^t), K = (1-b1)^2 / ((1-b2)(1-b1^2/b2)) */
  const double k = 0.01 / (0.001 * (1.0 - 0.81 / 0.999));
  const double bound = lr * sqrt(k) * sqrt(1.0 - pow(0.999, 10.0)) / (1.0 - pow(0.9, 10.0));
  double worst = 0.0;
  for (int64_t i = 1; i < n; ++i) worst = fmax(worst, fabs((double)param[i] - 1.0));
  g_check(&g, worst > 0.0 && worst <= bound * 1.001, "largest update %g, bound %g (without the "
          "floor it would be about %g)", worst, bound, lr * 1e-3 * 1.875 / 1e-8);
  /* a skipped step: nothing written, on every ISA path */
  const float one = 1.0f;
  op.found_inf = &one;
  uint8_t mc0[256], vc0[256];
  memcpy(mc0, mc, 256);
  memcpy(vc0, vc, 256);
  const float ms0 = ms[0], vs0 = vs[0];
  for (int k2 = 0; k2 < g_nisa; ++k2) {
    select_isa(g_isas[k2]);
    for (int64_t i = 0; i < n; ++i) grad[i] = 1e3f;
    g_check(&g, mp_step(&t, 0, n, &op) == MP_OK, "skipped: status");
    g_check(&g, memcmp(mc, mc0, 256) == 0 && memcmp(vc, vc0, 256) == 0 &&
                    bits_of(ms[0]) == bits_of(ms0) && bits_of(vs[0]) == bits_of(vs0),
            "skipped step wrote codes or scales [%s]", mp_isa_name(g_isas[k2]));
  }
  op.found_inf = NULL;
  /* argument checks: each returns MP_ERR_INVALID_ARGUMENT and writes nothing */
  const float p0 = param[5];
  struct {
    const char* what;
    int64_t block, start, count;
    int md, vd, null_ms, extra_scale;
  } bad[] = {
      {"block 0", 0, 0, 256, MP_I8, MP_U8, 0, 0},
      {"block 16", 16, 0, 256, MP_I8, MP_U8, 0, 0},
      {"block 4096", 4096, 0, 256, MP_I8, MP_U8, 0, 0},
      {"block 96 (not a power of two)", 96, 0, 192, MP_I8, MP_U8, 0, 0},
      {"start inside a block", 32, 16, 32, MP_I8, MP_U8, 0, 0},
      {"count ending inside a block", 32, 32, 40, MP_I8, MP_U8, 0, 0},
      {"no exp_avg_scale", 256, 0, 256, MP_I8, MP_U8, 1, 0},
      {"int8 exp_avg with fp32 exp_avg_sq", 256, 0, 256, MP_I8, MP_F32, 0, 0},
      {"bf16 exp_avg with uint8 exp_avg_sq", 256, 0, 256, MP_BF16, MP_U8, 0, 0},
      {"uint8 exp_avg, int8 exp_avg_sq", 256, 0, 256, MP_U8, MP_I8, 0, 0},
      {"scales with fp32 moments", 256, 0, 256, MP_F32, MP_F32, 0, 1},
      {"exp_avg format id out of range", 256, 0, 256, -1, MP_U8, 0, 0},
      {"exp_avg_sq format id out of range", 256, 0, 256, MP_I8, -1, 0, 0},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    mp_step_tensor tb = t;
    mp_step_options ob = op;
    ob.q8_block = bad[i].block;
    tb.exp_avg_format = bad[i].md < 0 ? MP_FMT_COUNT : fmt_of((mp_dtype)bad[i].md);
    tb.exp_avg_sq_format = bad[i].vd < 0 ? MP_FMT_COUNT : fmt_of((mp_dtype)bad[i].vd);
    if (bad[i].null_ms) tb.exp_avg_scale = NULL;
    if (bad[i].md == MP_F32) {
      tb.exp_avg = param;
      tb.exp_avg_sq = grad;
    }
    g_check(&g, mp_step(&tb, bad[i].start, bad[i].count, &ob) == MP_ERR_INVALID_ARGUMENT &&
                    bits_of(param[5]) == bits_of(p0) && memcmp(mc, mc0, 256) == 0,
            "%s: not refused, or something written", bad[i].what);
  }
  /* the last block may end at n anywhere */
  mp_step_tensor t2 = t;
  t2.n = 200;
  op.q8_block = 64;
  g_check(&g, mp_step(&t2, 128, 72, &op) == MP_OK, "a range ending at n inside a block");
  free(param);
  free(grad);
  free(mc);
  free(vc);
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

/* The time of one bf16-param step per storage mode and ISA path on 2^16 + 3 elements (best of
 * 50 calls, one thread), printed beside the results: what the fused loop costs with its arrays
 * in the core's cache, i.e. without waiting for memory, the compute side of its bandwidth.
 * Meaningful in a plain build (run.py --no-sanitize). */
static void time_adam_lean(void) {
  const int64_t N = ((int64_t)1 << 16) + 3;
  static const char* const names[6] = {"master", "remainder", "remainder+bf16 moments",
                                       "no master SR+bf16 moments", "no master SR",
                                       "no master RNE"};
  uint16_t* param = xmalloc((size_t)N * 2);
  uint16_t* grad = xmalloc((size_t)N * 2);
  float* master = xmalloc((size_t)N * 4);
  int16_t* rem = xmalloc((size_t)N * 2);
  float* m = xmalloc((size_t)N * 4);
  float* v = xmalloc((size_t)N * 4);
  for (int64_t i = 0; i < N; ++i) { /* normal values only: a subnormal costs a microcode assist */
    master[i] = 0.02f + 1e-5f * (float)(i % 2001 - 1000);
    param[i] = mp_bf16_rne_bits(bits_of(master[i]));
    rem[i] = 0;
    grad[i] = mp_bf16_rne_bits(bits_of(1e-3f + 1e-6f * (float)(i * 7919 % 2001 - 1000)));
  }
  /* A timing that measured a refused call would be meaningless: every step must succeed. */
  group g;
  g_begin(&g, "adam lean kernels timed: every step succeeds");
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    printf("      adam lean kernels [%s]:", mp_isa_name(g_isas[k]));
    for (int mode = 0; mode < 6; ++mode) {
      const int mom16 = mode == 2 || mode == 3;
      memset(m, 0, (size_t)N * 4);
      memset(v, 0, (size_t)N * 4);
      float step = 0.0f;
      const mp_step_tensor t = {.param = param, .param_dtype = MP_BF16, .grad = grad,
                                .grad_dtype = MP_BF16, .master = mode == 0 ? master : NULL,
                                .exp_avg = m, .exp_avg_sq = v, .step = &step, .n = N,
                                .remainder = mode == 1 || mode == 2 ? rem : NULL,
                                .exp_avg_format = mom16 ? MP_FMT_BF16 : MP_FMT_F32,
                                .exp_avg_sq_format = mom16 ? MP_FMT_BF16 : MP_FMT_F32};
      const mp_step_options o = {.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                 .weight_decay = 0.01, .decoupled = 1, .lr_value = 1e-3f,
                                 .sr_params = mode == 3 || mode == 4, .seed = 7};
      double best = 1e30;
      for (int r = 0; r < 50; ++r) {
        const double t0 = now_s();
        const mp_status st = mp_step(&t, 0, N, &o);
        const double dt = now_s() - t0;
        g_check(&g, st == MP_OK, "[%s] %s, repeat %d: status %d", mp_isa_name(g_isas[k]),
                names[mode], r, (int)st);
        best = dt < best ? dt : best;
      }
      printf(" %s %.2f ns/elt%s", names[mode], 1e9 * best / (double)N, mode < 5 ? "," : "\n");
    }
  }
  g_end(&g);
  free(param);
  free(grad);
  free(master);
  free(rem);
  free(m);
  free(v);
}

/* 11j. The split of a bf16 param's master into param and remainder, over all 2^32 fp32 bit
 *      patterns: the param is the round to nearest even; join(param, remainder) is the master
 *      exactly, except for the 2^15 values exactly halfway above an even bf16, which are stored
 *      one ulp lower (and give the same param); a NaN stays a NaN. */
static void test_bf16_remainder_all(void) {
  group g;
  g_begin(&g, "bf16 remainder split/join over all 2^32 fp32 patterns");
  uint64_t exact = 0, lowered = 0, nans = 0;
  int bad = 0;
  for (uint64_t k = 0; k <= 0xFFFFFFFFull; ++k) {
    const uint32_t x = (uint32_t)k;
    const uint32_t st = mp_bf16_master_bits(x);
    const uint16_t p = mp_bf16_rne_bits(st);
    const uint32_t back = mp_bf16_join(p, mp_bf16_remainder(st, p));
    const int is_nan = (x & 0x7FFFFFFFu) > 0x7F800000u;
    int ok;
    if (is_nan) {
      ok = (back & 0x7FFFFFFFu) > 0x7F800000u;
      nans++;
    } else if (st != x) {
      ok = st == x - 1u && (x & 0x1FFFFu) == 0x8000u && back == st && p == mp_bf16_rne_bits(x);
      lowered++;
    } else {
      ok = back == x && p == mp_bf16_rne_bits(x);
      exact++;
    }
    if (!ok && bad++ < 5) {
      g_fail(&g, "x %08x: stored %08x param %04x joined %08x", x, st, p, back);
    }
  }
  g.count += 1;
  /* low 17 bits 0x08000: 2^15 patterns, less the 2 x 2^6 of them with exponent 0xFF */
  g_check(&g, lowered == 32768u - 128u, "%" PRIu64 " values stored one ulp lower", lowered);
  printf("      bf16 remainders: %" PRIu64 " masters exact, %" PRIu64 " ties stored one ulp "
         "lower, %" PRIu64 " NaNs\n", exact, lowered, nans);
  g_end(&g);
}

/* 11m. The engine's codecs (csrc/core/formats.h), each on its own, against this file's
 *      references: every bf16 and fp16 pattern widened (the field decoder) and narrowed back
 *      to nearest even (the RNE reference: the same pattern, a NaN quiet with its sign); the
 *      gradient decode (the product in double, rounded once) and its write-back; the param
 *      storages (master with the tie rule restated, remainder, nearest, stochastic with the
 *      documented generator at each element's position) decoded back to what they stored; the
 *      bf16 moment encode with the shared draw (exp_avg the low 16 bits, exp_avg_sq the high);
 *      every 8-bit code of both formats decoded and a block of them encoded back to the same
 *      codes and scale. Compiled into the test as baseline code: the ISA builds run the same
 *      source, and the step tests above compare every path bit for bit. */
#include "formats/tiles.h"

/* The stored master of fp32 bits x, restated from adam.h: a finite value whose low 17 bits
 * are 0x08000 is stored one ulp lower. */
static uint32_t ref_master_stored(uint32_t x) {
  return ((x & 0x1FFFFu) == 0x08000u && (x & 0x7F800000u) != 0x7F800000u) ? x - 1u : x;
}

static int same_rne(uint32_t u, uint32_t got, const fmt* f) {
  int nan;
  const uint32_t want = ref_rne(u, f, &nan);
  return nan ? nan_result_problem(u, got, f) == NULL : got == want;
}

static void test_codecs(uint64_t seed0) {
  uint64_t s = seed0 ^ 0xC0DEC5ull;
  enum { N = 65536 };
  float* x = xmalloc(N * sizeof(float));
  float* y = xmalloc(N * sizeof(float));
  double* yd = xmalloc(MP_TILE * sizeof(double));
  uint16_t* h = xmalloc(N * sizeof(uint16_t));
  uint16_t* h2 = xmalloc(N * sizeof(uint16_t));
  int16_t* rem = xmalloc(N * sizeof(int16_t));
  uint32_t* r = xmalloc(N * sizeof(uint32_t));
  group g;

  g_begin(&g, "codecs: every bf16/fp16 pattern widened and narrowed back");
  const fmt* fmts[2] = {&BF16, &FP16};
  const mp_dtype dts[2] = {MP_BF16, MP_F16};
  for (int k = 0; k < 2; ++k) {
    for (uint32_t i = 0; i < N; ++i) h[i] = (uint16_t)i;
    mp_fmt_widen(x, h, N, dts[k]);
    const mp_pv_tile at = {h2, NULL, NULL};
    mp_pv_encode(MP_PV_NONE_RNE, dts[k], &at, x, N, 0, 0, 0);
    for (uint32_t i = 0; i < N; ++i) {
      const double want = decode(i, fmts[k]);
      const int nan = is_nan_fmt(i, fmts[k]);
      g.count++;
      if (nan ? !isnan(x[i]) || !!signbit(x[i]) != (int)(i >> 15)
              : (double)x[i] != want || !!signbit(x[i]) != !!signbit(want)) {
        g_fail(&g, "%s %04x widened to %08x", k ? "fp16" : "bf16", i, bits_of(x[i]));
      }
      g_check(&g, nan ? nan_result_problem(bits_of(x[i]), h2[i], fmts[k]) == NULL : h2[i] == i,
              "%s %04x narrowed back to %04x", k ? "fp16" : "bf16", i, h2[i]);
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: gradient decode (unscale) and write-back, fp32/bf16/fp16");
  const float invs[3] = {0.5f, 1.0f / 3.0f, 65536.0f};
  for (int dt = 0; dt < 3; ++dt) {
    const mp_dtype t = dt == 0 ? MP_F32 : dts[dt - 1];
    for (int inv_k = 0; inv_k < 3; ++inv_k) {
      for (int wb = 0; wb < 2; ++wb) {
        mp_step_scalars sc;
        memset(&sc, 0, sizeof sc);
        sc.inv_scale = invs[inv_k];
        sc.write_grad = wb;
        float* gf = (float*)r; /* the fp32 grads live in r */
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          const uint32_t u = (uint32_t)splitmix64(&s);
          if (t == MP_F32) gf[i] = f32_of(u); else h[i] = (uint16_t)u;
        }
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          yd[i] = t == MP_F32 ? (double)gf[i] : decode(h[i], t == MP_BF16 ? &BF16 : &FP16);
        }
        const float* gd = mp_grad_decode(x, t == MP_F32 ? (void*)gf : (void*)h, t, MP_TILE, &sc);
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          const float want = (float)(yd[i] * (double)sc.inv_scale);
          g.count++;
          if (isnan(want) ? !isnan(gd[i]) : bits_of(gd[i]) != bits_of(want)) {
            g_fail(&g, "dtype %d inv %g: %a -> %08x", (int)t, sc.inv_scale, yd[i],
                   bits_of(gd[i]));
          }
          if (!wb || t == MP_F32) {
            g_check(&g, t != MP_F32 || wb || (double)gf[i] == yd[i] || isnan(yd[i]),
                    "fp32 grad written without write-back");
            continue;
          }
          g_check(&g, same_rne(bits_of(gd[i]), h[i], t == MP_BF16 ? &BF16 : &FP16),
                  "dtype %d: %08x written back as %04x", (int)t, bits_of(gd[i]), h[i]);
        }
      }
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: param storages (master, remainder, nearest, stochastic) round trips");
  const uint64_t key = ref_key(seed0, 3, 7);
  const uint32_t lo0 = 0xFFFFFF00u - 3u * MP_TILE, hi = 5u; /* lo + i reaches 2^32 - 256 */
  for (uint32_t tile = 0; tile < 3; ++tile) {
    const uint32_t lo = lo0 + tile * MP_TILE;
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      uint32_t u = (uint32_t)splitmix64(&s);
      if (i % 8u == 0u) u = (u & ~0x1FFFFu) | 0x08000u; /* a tie above an even bf16 */
      if (i % 97u == 1u) u = (u & 0x80000000u) | 0x7F800000u;
      x[i] = f32_of(u);
    }
    for (int k = 0; k < 2; ++k) {
      /* master: the param its round to nearest even, the master as stored */
      memcpy(y, x, MP_TILE * sizeof(float));
      const mp_pv_tile am = {h, y, NULL};
      g_check(&g, mp_pv_decode(MP_PV_MASTER, dts[k], &am, NULL, MP_TILE) == y,
              "master decoded to another array");
      mp_pv_encode(MP_PV_MASTER, dts[k], &am, y, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        const uint32_t u = bits_of(x[i]), st = k == 0 ? ref_master_stored(u) : u;
        g.count++;
        if (!isnan(x[i]) && bits_of(y[i]) != st) {
          g_fail(&g, "master %08x stored %08x", u, bits_of(y[i]));
        }
        g_check(&g, same_rne(st, h[i], fmts[k]), "master %08x: param %04x", u, h[i]);
      }
      /* nearest, without a master */
      const mp_pv_tile an = {h2, NULL, NULL};
      mp_pv_encode(MP_PV_NONE_RNE, dts[k], &an, x, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        g.count++;
        g_check(&g, same_rne(bits_of(x[i]), h2[i], fmts[k]), "rne %08x: %04x", bits_of(x[i]),
                h2[i]);
      }
      /* stochastic: bf16 against the reference at the element's position; fp16 one of the
       * two neighbours (the value or the next magnitude up, RNE of the value is either) */
      mp_pv_encode(MP_PV_NONE_SR, dts[k], &an, x, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        const uint32_t u = bits_of(x[i]);
        const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo + i);
        g.count++;
        if (k == 0) {
          int nan;
          const uint32_t want = ref_sr(u, rb & 0xFFFFu, &nan);
          g_check(&g, nan ? nan_result_problem(u, h2[i], &BF16) == NULL : h2[i] == want,
                  "bf16 sr %08x at %u: %04x, want %04x", u, lo + i, h2[i], want);
        } else {
          g_check(&g, h2[i] == mp_fp16_sr_bits(u, rb), "fp16 sr %08x at %u: %04x", u, lo + i,
                  h2[i]);
        }
      }
    }
    /* remainder: split, then joined back to the stored master */
    memcpy(y, x, MP_TILE * sizeof(float));
    const mp_pv_tile ar = {h, NULL, rem};
    mp_pv_encode(MP_PV_REMAINDER, MP_BF16, &ar, y, MP_TILE, key, lo, hi);
    float* back = mp_pv_decode(MP_PV_REMAINDER, MP_BF16, &ar, x + MP_TILE, MP_TILE);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      const uint32_t u = bits_of(x[i]), st = ref_master_stored(u);
      g.count++;
      if (isnan(x[i])) {
        g_check(&g, isnan(back[i]) && isnan(y[i]), "remainder NaN %08x -> %08x", u,
                bits_of(back[i]));
        continue;
      }
      g_check(&g, bits_of(back[i]) == st && bits_of(y[i]) == st && same_rne(st, h[i], &BF16),
              "remainder %08x: param %04x rem %04x joined %08x", u, h[i], (uint16_t)rem[i],
              bits_of(back[i]));
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: bf16 moments from one draw (exp_avg low 16 bits, exp_avg_sq high 16)");
  for (uint32_t i = 0; i < MP_TILE; ++i) x[i] = f32_of((uint32_t)splitmix64(&s));
  mp_mom_draw(r, MP_TILE, key, lo0, hi);
  for (int shift = 0; shift <= 16; shift += 16) {
    mp_mom_encode_bf16(h, x, MP_TILE, r, (uint32_t)shift, 0);
    mp_mom_encode_bf16(h2, x, MP_TILE, r, (uint32_t)shift, 1);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      const uint32_t u = bits_of(x[i]);
      const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo0 + i);
      int nan;
      const uint32_t want = ref_sr(u, (rb >> shift) & 0xFFFFu, &nan);
      g.count++;
      g_check(&g, r[i] == rb, "draw at %u: %08x, want %08x", lo0 + i, r[i], rb);
      g_check(&g, nan ? nan_result_problem(u, h[i], &BF16) == NULL : h[i] == want,
              "sr shift %d %08x: %04x, want %04x", shift, u, h[i], want);
      g_check(&g, same_rne(u, h2[i], &BF16), "nearest %08x: %04x", u, h2[i]);
    }
    float* wide = mp_mom_decode(MP_BF16, h, y, MP_TILE);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      g_check(&g, bits_of(wide[i]) == (uint32_t)h[i] << 16, "bf16 moment %04x decoded %08x", h[i],
              bits_of(wide[i]));
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: every 8-bit code decoded, a block of them encoded back");
  {
    /* one block holding every code of both formats (m: 256 signed codes, v: 256): decoded
     * under references from a scale whose exponent field is ea, the v floor off */
    const int eas[3] = {16, 127, 200};
    for (int j = 0; j < 3; ++j) {
      const int ea = eas[j];
      uint8_t mc[256], vc[256], mc2[256], vc2[256];
      for (int c = 0; c < 256; ++c) {
        mc[c] = (uint8_t)c;
        vc[c] = (uint8_t)c;
      }
      mp_step_scalars sc;
      memset(&sc, 0, sizeof sc);
      /* scales: the absmax of the block, the top code's value */
      const float ms = (float)q8_value(&Q8_M, 127, ea), vs = (float)q8_value(&Q8_V, 255, ea);
      mp_q8_decode_tile(mc, vc, x, y, 256, mp_q8_ref_m_of(ms), mp_q8_ref_v_of(vs), &sc);
      for (int c = 0; c < 256; ++c) {
        g.count++;
        g_check(&g, (double)x[c] == q8_decode_ref(&Q8_M, c, ea) &&
                        !!signbit(x[c]) == ((c & 0x80) != 0),
                "m code %02x at %d: %a", c, ea, x[c]);
        g_check(&g, (double)y[c] == q8_decode_ref(&Q8_V, c, ea), "v code %02x at %d: %a", c, ea,
                y[c]);
      }
      for (int nearest = 0; nearest < 2; ++nearest) {
        float ms2 = 0.0f, vs2 = 0.0f;
        mp_q8_encode_block(mc2, vc2, x, y, 256, &ms2, &vs2, key, lo0, hi, nearest);
        g_check(&g, bits_of(ms2) == bits_of(ms) && bits_of(vs2) == bits_of(vs),
                "scales %a %a, want %a %a", ms2, vs2, ms, vs);
        g_check(&g, q8_ref_exp_ref(&Q8_M, ms2) == ea && q8_ref_exp_ref(&Q8_V, vs2) == ea,
                "reference exponent of the encoded block moved from %d", ea);
        for (int c = 0; c < 256; ++c) {
          g.count++;
          g_check(&g, mc2[c] == c && vc2[c] == c, "codes %02x re-encoded as %02x %02x", c,
                  mc2[c], vc2[c]);
        }
      }
    }
    /* values between codes: the block encode against the per-value reference, stochastic
     * with the 8-bit stream's draw at each position */
    for (int i = 0; i < 256; ++i) {
      x[i] = f32_of((uint32_t)(splitmix64(&s) % 0x3F000000u) | (i & 1 ? 0x80000000u : 0u));
      y[i] = f32_of((uint32_t)(splitmix64(&s) % 0x3F000000u));
    }
    uint8_t mc2[256], vc2[256];
    float ms2, vs2;
    for (int nearest = 0; nearest < 2; ++nearest) {
      mp_q8_encode_block(mc2, vc2, x, y, 256, &ms2, &vs2, key, lo0, hi, nearest);
      const int em = q8_ref_exp_ref(&Q8_M, ms2), ev = q8_ref_exp_ref(&Q8_V, vs2);
      for (int i = 0; i < 256; ++i) {
        const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo0 + (uint32_t)i);
        g.count++;
        g_check(&g, mc2[i] == q8_encode_full_ref(&Q8_M, x[i], em, rb & 0xFFFFu, nearest) &&
                        vc2[i] == q8_encode_full_ref(&Q8_V, y[i], ev, rb >> 16, nearest),
                "value %d (nearest %d): codes %02x %02x", i, nearest, mc2[i], vc2[i]);
      }
    }
  }
  g_end(&g);
  free(x);
  free(y);
  free(yd);
  free(h);
  free(h2);
  free(rem);
  free(r);
}

/* 11n. The hand-fused loops the engine keeps (csrc/core/fast/adam_fused.c) against its tile
 *      pipeline alone (the kernel table's adam_step_generic): every valid storage mode (param
 *      and grad dtype, master / remainder / none with either rounding, fp32 / bf16 / 8-bit
 *      moments, write-back, bf16 moments to nearest, ema) on every ISA path, three steps from
 *      the same random state with NaN/Inf/ties among the values, the range also stepped from
 *      an offset; every byte of every array must agree. The modes without a fused loop check
 *      that the dispatch falls through to the pipeline unchanged. */
#include "isa.h"

static const mp_kernel_table* kernels_of(mp_isa isa) {
#if defined(MP_X86_PATHS)
  if (isa == MP_ISA_AVX2) return &mp_kernels__avx2;
  if (isa == MP_ISA_AVX512) return &mp_kernels__avx512;
#endif
  return &mp_kernels__scalar;
}

typedef struct fused_state {
  void *p, *g, *m, *v;
  float *master, *ema, *ms, *vs;
  int16_t* rem;
} fused_state;

/* fp32 bits u stored as dtype t (to nearest even). */
static uint32_t fused_narrow(mp_dtype t, uint32_t u) {
  return t == MP_F32 ? u : t == MP_BF16 ? mp_bf16_rne_bits(u) : mp_fp16_rne_bits(u);
}

static void fused_alloc(fused_state* st, int n) {
  const size_t sizes[9] = {4, 4, 4, 4, 4, 4, 2, 4, 4};
  void** arrays[9] = {&st->p, &st->g, &st->m, &st->v, (void**)&st->master, (void**)&st->ema,
                      (void**)&st->rem, (void**)&st->ms, (void**)&st->vs};
  for (int k = 0; k < 9; ++k) *arrays[k] = xmalloc((size_t)(k >= 7 ? 4 : n) * sizes[k]);
}

static void fused_free(fused_state* st) {
  free(st->p);
  free(st->g);
  free(st->m);
  free(st->v);
  free(st->master);
  free(st->ema);
  free(st->rem);
  free(st->ms);
  free(st->vs);
}

/* 1 if n elements of dtype t at a and b have the same bits, or are both NaN: a NaN's sign and
 * payload are not specified (x86 gives an invalid operation's NaN the sign bit and propagates
 * an operand's, so they follow the compiler's choice of operand order and of vector or scalar
 * code, which -O1 and -O3 builds of one loop make differently). */
static int fused_values_agree(const void* a, const void* b, mp_dtype t, int n) {
  for (int i = 0; i < n; ++i) {
    const uint32_t x = a_get(a, t, (size_t)i), y = a_get(b, t, (size_t)i);
    if (x != y && !(a_isnan(t, x) && a_isnan(t, y))) return 0;
  }
  return 1;
}

/* A mode as the tests below step it. */
typedef struct fused_mode {
  mp_dtype pt, gt, md, vd;
  int kind, wb, nearest, ema;
} fused_mode;

/* Three steps of mode fm from one random state through kt's adam_step and its
 * adam_step_generic, each range split in two; 1 if every value agrees (fused_values_agree). */
static int fused_same(const mp_kernel_table* kt, const fused_mode* fm, uint64_t s, int variant) {
  enum { N = 3 * 256 + 77 };
  const mp_dtype pt = fm->pt, gt = fm->gt, md = fm->md, vd = fm->vd;
  fused_state st[2];
  fused_alloc(&st[0], N);
  fused_alloc(&st[1], N);
  for (int i = 0; i < N; ++i) {
    const double u = (double)(splitmix64(&s) >> 11) * 0x1p-53 - 0.5;
    float gv = (float)(1e-3 * (u + 0.1));
    /* 8-bit moments: the first two blocks finite, so that their new scales are too (a NaN
     * anywhere in a block makes its reference NaN), the second with values near 2^-100 (the
     * encode's scale is then two fp32 factors); the third finite for its first 64 (a NaN
     * after a vector loop's chunks) */
    const int specials = md != MP_I8 || i >= 576;
    if (md == MP_I8 && i >= 256 && i < 512) gv *= 1e-27f;
    if (specials && i % 101 == 7) gv = NAN;
    if (specials && i % 103 == 9) gv = -INFINITY;
    uint32_t pb = bits_of((float)(0.05 * u));
    if (i % 16 == 3) pb = (pb & ~0x1FFFFu) | 0x08000u; /* a tie above an even bf16 */
    /* NaNs whose payload fills every bit (a NaN master, a NaN fp32 grad): rounded to 16 bits
     * as if they were numbers they carry into the sign bit, so a vector loop that skips its
     * NaN test gives -0.0 where the scalar rule keeps the NaN */
    if (specials && i % 107 == 11) pb = 0x7FFFFFFFu;
    uint32_t gb = bits_of(gv);
    if (specials && i % 109 == 13) gb = 0xFFFFFFFFu;
    a_put(st[0].p, pt, (size_t)i, pt == MP_F32 ? pb : fused_narrow(pt, pb) | (pb == 0x7FFFFFFFu ? 0x7FFFu : 0u));
    a_put(st[0].g, gt, (size_t)i, gt == MP_F32 ? gb : fused_narrow(gt, gb) | (gb == 0xFFFFFFFFu ? 0xFFFFu : 0u));
    st[0].master[i] = f32_of(pb);
    st[0].ema[i] = f32_of(pb);
    st[0].rem[i] = pb == 0x7FFFFFFFu ? (int16_t)-1 : (int16_t)(splitmix64(&s) & 0x7FFF);
    if (md == MP_I8) {
      ((uint8_t*)st[0].m)[i] = (uint8_t)splitmix64(&s);
      ((uint8_t*)st[0].v)[i] = (uint8_t)splitmix64(&s);
    } else {
      a_put(st[0].m, md, (size_t)i, fused_narrow(md, bits_of((float)(1e-4 * u))));
      a_put(st[0].v, vd, (size_t)i, fused_narrow(vd, bits_of((float)(1e-8 * (u + 0.5)))));
    }
  }
  for (int b = 0; b < 4; ++b) {
    st[0].ms[b] = (b == 1 && md == MP_I8 ? 1e-30f : 1e-4f) * (float)(b + 1);
    st[0].vs[b] = (b == 1 && md == MP_I8 ? 1e-38f : 1e-8f) * (float)(b + 1);
  }
  memcpy(st[1].p, st[0].p, N * 4);
  memcpy(st[1].g, st[0].g, N * 4);
  memcpy(st[1].m, st[0].m, N * 4);
  memcpy(st[1].v, st[0].v, N * 4);
  memcpy(st[1].master, st[0].master, N * 4);
  memcpy(st[1].ema, st[0].ema, N * 4);
  memcpy(st[1].rem, st[0].rem, N * 2);
  memcpy(st[1].ms, st[0].ms, 16);
  memcpy(st[1].vs, st[0].vs, 16);
  mp_step_options o;
  memset(&o, 0, sizeof o);
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = 0.01;
  o.decoupled = (variant & 1) == 0;
  o.maximize = (variant % 7) == 3;
  o.lr_value = 1e-3f;
  o.unscale_grads = fm->wb;
  o.sr_params = fm->kind == MP_PV_NONE_SR;
  o.moments_nearest = fm->nearest;
  o.seed = s;
  o.q8_block = 256;
  o.ema_decay = fm->ema ? 0.99 : 0.0; /* 0: what a group without an ema passes */
  float step[2] = {0.0f, 0.0f};
  for (int it = 0; it < 3; ++it) {
    const float inv = it == 1 ? 2.0f : 0.5f;
    const mp_step_scalars sc = mp_step_scalars_of(&o, step[0], inv, 5u);
    const mp_rule_scalars rc = mp_rule_scalars_of(&o, 1e-3f, step[0]);
    for (int c = 0; c < 2; ++c) {
      mp_step_tensor t;
      memset(&t, 0, sizeof t);
      t.param = st[c].p;
      t.param_dtype = pt;
      t.grad = st[c].g;
      t.grad_dtype = gt;
      t.master = fm->kind == MP_PV_MASTER ? st[c].master : NULL;
      t.remainder = fm->kind == MP_PV_REMAINDER ? st[c].rem : NULL;
      t.exp_avg = st[c].m;
      t.exp_avg_sq = st[c].v;
      t.exp_avg_format = fmt_of(md);
      t.exp_avg_sq_format = fmt_of(vd);
      t.exp_avg_scale = md == MP_I8 ? st[c].ms : NULL;
      t.exp_avg_sq_scale = md == MP_I8 ? st[c].vs : NULL;
      t.ema = fm->ema ? st[c].ema : NULL;
      t.step = &step[c];
      t.n = N;
      t.sr_stream = 5u;
      /* two ranges: [0, 256) and the rest, as threads would split it */
      (c == 0 ? kt->step : kt->step_generic)(&t, 0, 256, &sc, &rc);
      (c == 0 ? kt->step : kt->step_generic)(&t, 256, N - 256, &sc, &rc);
      step[c] += 1.0f;
    }
  }
  int same = fused_values_agree(st[0].p, st[1].p, pt, N) &&
             fused_values_agree(st[0].g, st[1].g, gt, N) &&
             fused_values_agree(st[0].master, st[1].master, MP_F32, N) &&
             fused_values_agree(st[0].ema, st[1].ema, MP_F32, N);
  for (int i = 0; i < N; ++i) { /* a NaN master's remainder is its payload's low half */
    if (!(a_isnan(pt, a_get(st[0].p, pt, (size_t)i)) && a_isnan(pt, a_get(st[1].p, pt, (size_t)i))))
      same = same && st[0].rem[i] == st[1].rem[i];
  }
  if (md == MP_I8) { /* a block whose scale is NaN reads as NaN whatever its codes */
    same = same && fused_values_agree(st[0].ms, st[1].ms, MP_F32, 4) &&
           fused_values_agree(st[0].vs, st[1].vs, MP_F32, 4);
    for (int i = 0; i < N; ++i) {
      const int b = i / 256;
      if (!isnan(st[0].ms[b]) || !isnan(st[1].ms[b]))
        same = same && ((uint8_t*)st[0].m)[i] == ((uint8_t*)st[1].m)[i];
      if (!isnan(st[0].vs[b]) || !isnan(st[1].vs[b]))
        same = same && ((uint8_t*)st[0].v)[i] == ((uint8_t*)st[1].v)[i];
    }
  } else {
    same = same && fused_values_agree(st[0].m, st[1].m, md, N) &&
           fused_values_agree(st[0].v, st[1].v, vd, N);
  }
  fused_free(&st[0]);
  fused_free(&st[1]);
  return same;
}

static void test_adam_fused_vs_generic(uint64_t seed0) {
  const mp_dtype dts[3] = {MP_F32, MP_BF16, MP_F16};
  group g;
  g_begin(&g, "adam: hand-fused loops = the tile pipeline, every storage mode and ISA path");
  int modes = 0;
  for (int k = 0; k < g_nisa; ++k) {
    const mp_kernel_table* kt = kernels_of(g_isas[k]);
    /* every valid mode: param and grad dtype, storage, moments (fp32, bf16, mixed, 8-bit),
     * write-back, nearest, ema */
    for (int code = 0; code < 3 * 2 * 5 * 4 * 8; ++code) {
      const int pi = code % 3, gi = code / 3 % 2, kind = code / 6 % 5, mom = code / 30 % 4;
      const int flags = code / 120;
      fused_mode fm;
      fm.pt = dts[pi];
      fm.gt = gi ? MP_F32 : fm.pt;
      fm.kind = kind;
      fm.md = mom == 3 ? MP_I8 : mom == 1 ? MP_BF16 : MP_F32;
      fm.vd = mom == 3 ? MP_U8 : mom >= 1 ? MP_BF16 : MP_F32;
      fm.wb = flags & 1;
      fm.nearest = (flags >> 1) & 1;
      fm.ema = flags >> 2;
      if ((gi && fm.pt == MP_F32) || (fm.pt == MP_F32) != (kind == MP_PV_F32)) continue;
      if (kind == MP_PV_REMAINDER && fm.pt != MP_BF16) continue;
      const uint64_t s = seed0 ^ ((uint64_t)(code + 1) * 0x9E3779B97F4A7C15ull);
      /* each mode as Adam and as AdamW (variant's low bit), which the fused loops build apart */
      for (int j = 0; j < 2 + (fm.md == MP_I8); ++j) {
        /* 8-bit moments: AdamW's usual case too (variant 0), the one their vector loops take */
        const int variant = j < 2 ? 2 * code + j : 0;
        g.count++;
        g_check(&g, fused_same(kt, &fm, s, variant),
                "[%s] param %s grad %s storage %d moments %d/%d wb %d nearest %d ema %d %s: the "
                "fused step differs from the pipeline", mp_isa_name(g_isas[k]), U_NAME[pi],
                U_NAME[gi ? 0 : pi], kind, (int)fm.md, (int)fm.vd, fm.wb, fm.nearest, fm.ema,
                variant & 1 ? "adam" : "adamw");
      }
      modes++;
    }
  }
  printf("      %d modes x paths compared\n", modes);
  g_end(&g);
}

/* 11o. Lion and SGD (mp_step_options.rule, rules/lion.h, rules/sgd.h) through mp_step on
 *      every ISA path, against a scalar reference written here from the rules' documented
 *      formulas (lion-pytorch's and torch.optim.SGD's order of operations, each add(x, alpha=a)
 *      one fmaf, every other operation rounded to float) and the storage formats' definitions:
 *      every param storage (fp32; bf16 / fp16 master; bf16 remainder; bf16 / fp16 without a
 *      master, to nearest or stochastically), the grad in the param's dtype or fp32, every
 *      moment format (fp32, bf16 stochastic or to nearest, 8-bit block codes; none for SGD
 *      without momentum); SGD with and without momentum, dampening, nesterov, maximize, weight
 *      decay; Lion with and without weight decay and maximize. Three steps (SGD's buffer is the
 *      gradient on the first), ranges split at a block boundary; every bit must agree. */

typedef struct rule_case {
  int rule; /* MP_RULE_LION or MP_RULE_SGD */
  double beta1, beta2, weight_decay, dampening;
  int nesterov, maximize;
} rule_case;

/* Lion, one element (lion-pytorch's update_fn): p decayed, the sign of the interpolation, the
 * moment's own interpolation. */
static float ref_lion_elem(const rule_case* c, float lr, float g, float* p, float m) {
  if (c->maximize) g = -g;
  const float decay = (float)(1.0 - (double)lr * c->weight_decay);
  float x = *p * decay;
  const float mix = fmaf(g, (float)(1.0 - c->beta1), m * (float)c->beta1);
  const float u = mix > 0.0f ? 1.0f : mix < 0.0f ? -1.0f : 0.0f; /* torch.sgn: 0 for NaN */
  *p = fmaf(u, -lr, x);
  return fmaf(g, (float)(1.0 - c->beta2), m * (float)c->beta2);
}

/* SGD, one element (torch's _single_tensor_sgd); returns the new buffer (b unread on the first
 * step or without a momentum). */
static float ref_sgd_elem(const rule_case* c, float lr, int first, float g, float* p, float b) {
  if (c->maximize) g = -g;
  if (c->weight_decay != 0.0) g = fmaf(*p, (float)c->weight_decay, g);
  if (c->beta1 != 0.0) {
    b = first ? g : fmaf(g, (float)(1.0 - c->dampening), b * (float)c->beta1);
    g = c->nesterov ? fmaf(b, (float)c->beta1, g) : b;
  }
  *p = fmaf(g, -lr, *p);
  return b;
}

/* A 16-bit value widened to fp32 (bf16: the high half; fp16: exactly, by its definition). */
static float widen16(mp_dtype t, uint16_t h) {
  return t == MP_BF16 ? f32_of((uint32_t)h << 16) : (float)decode(h, &FP16);
}

/* The fp32 value of a bf16 param and its remainder: (param << 16) + remainder (signed), mod
 * 2^32, as docs/lean_state.md defines it. */
static uint32_t ref_join(uint16_t param, int16_t rem) {
  return (uint32_t)(((uint64_t)param << 16) + (uint64_t)(int64_t)rem);
}

/* Param storages: 0 fp32, 1 bf16 master, 2 fp16 master, 3 bf16 remainder, 4 bf16 nearest,
 * 5 bf16 stochastic, 6 fp16 nearest, 7 fp16 stochastic. Moments: 0 fp32, 1 bf16 stochastic,
 * 2 bf16 nearest, 3 8-bit, 4 none. */
static const char* const RULE_STORAGE[8] = {"fp32", "bf16 master", "fp16 master",
                                            "bf16 remainder", "bf16 nearest", "bf16 stochastic",
                                            "fp16 nearest", "fp16 stochastic"};
static const char* const RULE_MOMENT[5] = {"fp32", "bf16 stochastic", "bf16 nearest", "8-bit",
                                           "none"};

/* One case of (rule, storage, grad dtype, moment format): 3 steps through mp_adam_step on the
 * active path against the reference. Returns the number of elements compared. */
static int64_t rule_case_run(group* g, const rule_case* c, int storage, int grad_f32, int mom,
                             uint64_t s) {
  enum { N = 2 * 256 + 77, B = 256, NB = (N + B - 1) / B };
  const mp_dtype pt = storage == 0 ? MP_F32 : (storage == 2 || storage >= 6) ? MP_F16 : MP_BF16;
  const mp_dtype gt = grad_f32 ? MP_F32 : pt;
  const fmt* pf = pt == MP_F16 ? &FP16 : &BF16;
  const int has_master = storage == 1 || storage == 2, has_rem = storage == 3;
  const int sr_p = storage == 5 || storage == 7;
  const int nmom = mom == 4 ? 0 : 1;
  uint32_t* param = xmalloc(N * 4);  /* fp32 bits, or 16-bit values in the low half */
  uint16_t* p16 = xmalloc(N * 2);
  uint32_t* g32 = xmalloc(N * 4);
  uint16_t* g16 = xmalloc(N * 2);
  float* master = xmalloc(N * 4);
  int16_t* rem = xmalloc(N * 2);
  float* m32 = xmalloc(N * 4);
  uint16_t* m16 = xmalloc(N * 2);
  uint8_t* mc = xmalloc(N);
  float* ms = xmalloc(NB * 4);
  float* wm = xmalloc(N * 4);
  float* wp = xmalloc(N * 4);
  for (int i = 0; i < N; ++i) {
    float x = adam_rand(&s, -6, 2);
    if (i % 97 == 5) x = f32_of((bits_of(x) & 0xFFFE0000u) | 0x8000u); /* a bf16 tie */
    uint32_t xb = bits_of(x);
    if (pt == MP_BF16 && (xb & 0x1FFFFu) == 0x8000u) xb -= 1u; /* a master as the kernel keeps */
    int nan;
    master[i] = f32_of(xb);
    if (pt == MP_F32) {
      param[i] = xb;
    } else {
      p16[i] = (uint16_t)ref_rne(xb, pf, &nan);
      if (pt == MP_BF16) rem[i] = (int16_t)(uint16_t)(xb - ((uint32_t)p16[i] << 16));
    }
    const float mv = i % 13 == 0 ? 0.0f : adam_rand(&s, -12, -2);
    m32[i] = mv;
    m16[i] = (uint16_t)ref_rne(bits_of(mv), &BF16, &nan);
    mc[i] = (uint8_t)splitmix64(&s);
  }
  for (int j = 0; j < NB; ++j) ms[j] = j == 1 ? 0.0f : fabsf(adam_rand(&s, -12, -4));
  for (int i = B; i < 2 * B; ++i) mc[i] = 0; /* a block of zeros, absmax 0 */
  mp_step_options o;
  memset(&o, 0, sizeof o);
  o.rule = c->rule;
  o.beta1 = c->beta1;
  o.beta2 = c->beta2;
  o.weight_decay = c->weight_decay;
  o.dampening = c->dampening;
  o.nesterov = c->nesterov;
  o.maximize = c->maximize;
  o.decoupled = c->rule == MP_RULE_LION;
  o.lr_value = c->rule == MP_RULE_LION ? 1e-3f : 2e-2f;
  o.sr_params = sr_p;
  o.moments_nearest = mom == 2;
  o.seed = s;
  o.q8_block = B;
  const float inv = 0.5f;
  o.inv_scale = &inv;
  const uint64_t stream = 3u;
  float stp = 0.0f;
  int64_t compared = 0;
  int bad = 0;
  for (int step = 0; step < 3 && bad < 5; ++step) {
    for (int i = 0; i < N; ++i) {
      const float gv = i % 11 == 0 ? 0.0f : adam_rand(&s, -10, 1);
      int nan;
      g32[i] = bits_of(gv);
      g16[i] = (uint16_t)ref_rne(bits_of(gv), pf, &nan);
    }
    /* the reference, block by block (a block's 8-bit codes share its absmax) */
    const uint64_t t = (uint64_t)step + 1u;
    const uint64_t key_m = ref_key(o.seed, t, 2u * stream), key_p = ref_key(o.seed, t, 2u * stream + 1u);
    const uint64_t key_q8 = ref_key(o.seed, t, (1ull << 33) + stream);
    uint8_t wmc[N];
    float wms[NB];
    for (int j = 0; j < NB; ++j) {
      const int ea = q8_ref_exp_ref(&Q8_M, (double)ms[j]);
      const int i1 = (j + 1) * B < N ? (j + 1) * B : N;
      float am = 0.0f;
      for (int i = j * B; i < i1; ++i) {
        float p = pt == MP_F32 ? f32_of(param[i])
                  : has_master ? master[i]
                  : has_rem    ? f32_of(ref_join(p16[i], rem[i]))
                               : widen16(pt, p16[i]);
        const float gin = gt == MP_F32 ? f32_of(g32[i]) : widen16(gt, g16[i]);
        const float gv = gin * inv;
        float m = mom == 0 ? m32[i] : mom == 3 ? (float)q8_decode_ref(&Q8_M, mc[i], ea)
                                    : widen16(MP_BF16, m16[i]);
        m = c->rule == MP_RULE_LION ? ref_lion_elem(c, o.lr_value, gv, &p, m)
                                    : ref_sgd_elem(c, o.lr_value, step == 0, gv, &p, m);
        wp[i] = p;
        wm[i] = m;
        if (fabsf(m) > am) am = fabsf(m);
      }
      wms[j] = am;
      const int nea = q8_ref_exp_ref(&Q8_M, (double)am);
      for (int i = j * B; i < i1; ++i) {
        wmc[i] = (uint8_t)q8_encode_full_ref(&Q8_M, wm[i], nea, ref_bits(key_q8, (uint64_t)i) & 0xFFFFu,
                                             mom == 2);
      }
    }
    /* mpext, in two ranges cut at a block boundary */
    mp_step_tensor tt;
    memset(&tt, 0, sizeof tt);
    tt.param = pt == MP_F32 ? (void*)param : (void*)p16;
    tt.param_dtype = pt;
    tt.grad = gt == MP_F32 ? (void*)g32 : (void*)g16;
    tt.grad_dtype = gt;
    tt.master = has_master ? master : NULL;
    tt.remainder = has_rem ? rem : NULL;
    tt.exp_avg = !nmom ? NULL : mom == 0 ? (void*)m32 : mom == 3 ? (void*)mc : (void*)m16;
    tt.exp_avg_format = mom == 0 || mom == 4 ? MP_FMT_F32 : mom == 3 ? MP_FMT_Q8S : MP_FMT_BF16;
    /* one moment (Lion, SGD): exp_avg_sq and its format are not read */
    tt.exp_avg_scale = mom == 3 ? ms : NULL;
    tt.step = &stp;
    tt.n = N;
    tt.sr_stream = stream;
    g_check(g, mp_step(&tt, 0, B, &o) == MP_OK && mp_step(&tt, B, N - B, &o) == MP_OK,
            "status");
    stp += 1.0f;
    for (int i = 0; i < N && bad < 5; ++i) {
      int nan;
      uint32_t want_p, got_p = pt == MP_F32 ? param[i] : p16[i];
      if (pt == MP_F32) {
        want_p = bits_of(wp[i]);
      } else if (has_master || has_rem) {
        uint32_t x = bits_of(wp[i]);
        if (pt == MP_BF16 && (x & 0x1FFFFu) == 0x8000u) x -= 1u; /* the master's tie rule */
        want_p = ref_rne(x, pf, &nan);
        const uint32_t got_w = has_master ? bits_of(master[i]) : ref_join(p16[i], rem[i]);
        if (got_w != x) {
          bad++;
          g_fail(g, "step %d element %d: fp32 value %08x, want %08x", step, i, got_w, x);
        }
      } else {
        want_p = sr_p ? ref_sr_fmt(bits_of(wp[i]), ref_bits(key_p, (uint64_t)i), pf)
                      : ref_rne(bits_of(wp[i]), pf, &nan);
      }
      if (got_p != want_p) {
        bad++;
        g_fail(g, "step %d element %d: param %08x, want %08x (fp32 %a)", step, i, got_p, want_p,
               (double)wp[i]);
      }
      uint32_t got_m = 0, want_m = 0;
      if (mom == 0) {
        got_m = bits_of(m32[i]);
        want_m = bits_of(wm[i]);
      } else if (mom == 1 || mom == 2) {
        got_m = m16[i];
        want_m = mom == 2 ? ref_rne(bits_of(wm[i]), &BF16, &nan)
                          : ref_sr_fmt(bits_of(wm[i]), ref_bits(key_m, (uint64_t)i), &BF16);
      } else if (mom == 3) {
        got_m = mc[i];
        want_m = wmc[i];
      }
      if (got_m != want_m) {
        bad++;
        g_fail(g, "step %d element %d: moment %08x, want %08x (fp32 %a)", step, i, got_m, want_m,
               (double)wm[i]);
      }
      compared++;
      g->count++;
    }
    for (int j = 0; mom == 3 && j < NB; ++j) {
      if (bits_of(ms[j]) != bits_of(wms[j])) {
        bad++;
        g_fail(g, "step %d block %d: scale %a, want %a", step, j, (double)ms[j], (double)wms[j]);
      }
    }
  }
  free(param);
  free(p16);
  free(g32);
  free(g16);
  free(master);
  free(rem);
  free(m32);
  free(m16);
  free(mc);
  free(ms);
  free(wm);
  free(wp);
  return compared;
}

static void test_lion_sgd_reference(uint64_t seed0) {
  const rule_case cases[] = {
      {MP_RULE_LION, 0.9, 0.99, 0.0, 0.0, 0, 0},  {MP_RULE_LION, 0.95, 0.98, 0.1, 0.0, 0, 1},
      {MP_RULE_SGD, 0.0, 0.0, 0.0, 0.0, 0, 0},    {MP_RULE_SGD, 0.0, 0.0, 0.05, 0.0, 0, 1},
      {MP_RULE_SGD, 0.9, 0.0, 0.05, 0.1, 0, 0},   {MP_RULE_SGD, 0.9, 0.0, 0.0, 0.0, 1, 0},
      {MP_RULE_SGD, 0.5, 0.0, 0.01, 0.0, 1, 1},
  };
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    group g;
    g_begin(&g, "lion and sgd == scalar reference, every param storage, grad dtype and moment "
            "format [%s]", mp_isa_name(g_isas[k]));
    int64_t elems = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci) {
      const rule_case* c = &cases[ci];
      const int no_moment = c->rule == MP_RULE_SGD && c->beta1 == 0.0;
      for (int storage = 0; storage < 8; ++storage) {
        for (int grad_f32 = 0; grad_f32 < (storage == 0 ? 1 : 2); ++grad_f32) {
          for (int mom = no_moment ? 4 : 0; mom < (no_moment ? 5 : 4); ++mom) {
            const uint64_t s = seed0 ^ ((uint64_t)(ci * 1000 + storage * 10 + grad_f32 * 5 + mom + 1) *
                                        0x9E3779B97F4A7C15ull);
            const long long bad = g.bad;
            elems += rule_case_run(&g, c, storage, grad_f32, mom, s);
            if (g.bad != bad) {
              printf("      (in: %s case %zu (beta1 %g beta2 %g wd %g dampening %g nesterov %d "
                     "maximize %d), %s param, %s grad, %s moment)\n",
                     c->rule == MP_RULE_LION ? "lion" : "sgd", ci, c->beta1, c->beta2,
                     c->weight_decay, c->dampening, c->nesterov, c->maximize,
                     RULE_STORAGE[storage], grad_f32 ? "fp32" : "param-dtype", RULE_MOMENT[mom]);
            }
          }
        }
      }
    }
    printf("      %" PRId64 " elements x steps compared\n", elems);
    g_end(&g);
  }
}

int main(int argc, char** argv) {
  /* Before anything selects a path: the initial active path must be the best one. */
  mp_isa initial_active = mp_cpu_isa_active();
  sweep_opts o = {257u, 2000000u, 0x6D70657874ull};
  const char* only = NULL;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--stride") == 0 && i + 1 < argc) {
      o.stride = parse_u64(argv[++i], "--stride");
    } else if (strcmp(argv[i], "--random") == 0 && i + 1 < argc) {
      o.n_random = parse_u64(argv[++i], "--random");
    } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      o.seed = parse_u64(argv[++i], "--seed");
    } else if (strcmp(argv[i], "--isa") == 0 && i + 1 < argc) {
      only = argv[++i];
      /* "best": the path this CPU would run (what a one-path run, CI's ctest-nofast, tests) */
      if (strcmp(only, "best") == 0) only = mp_isa_name(mp_cpu_isa_best());
    } else {
      fprintf(stderr, "usage: %s [--stride S] [--random N] [--seed X] [--isa NAME|best]\n",
              argv[0]);
      return 2;
    }
  }
  if (o.stride % 2u == 0u) {
    fprintf(stderr, "--stride must be odd (to reach every low-bit pattern)\n");
    return 2;
  }

  double t0 = now_s();
  printf("mpext C core tests: best ISA %s, initially active %s; seed 0x%" PRIx64 ", stride %"
         PRIu64 ", %" PRIu64 " random\n", mp_isa_name(mp_cpu_isa_best()),
         mp_isa_name(initial_active), o.seed, o.stride, o.n_random);
  for (int i = 0; i < MP_ISA_COUNT; ++i) {
    if (!mp_cpu_isa_supported((mp_isa)i)) {
      describe_skip((mp_isa)i);
      continue;
    }
    if (only && strcmp(only, mp_isa_name((mp_isa)i)) != 0) {
      printf("SKIP  ISA path %s: --isa %s given\n", mp_isa_name((mp_isa)i), only);
      continue;
    }
    g_isas[g_nisa++] = (mp_isa)i;
  }
  if (g_nisa == 0) {
    fprintf(stderr, "no ISA path to test\n");
    return 2;
  }
  printf("      testing ISA paths:");
  for (int k = 0; k < g_nisa; ++k) printf(" %s", mp_isa_name(g_isas[k]));
  printf("\n");

  test_isa_api(initial_active);
  test_arguments();
  test_sr_generator();
  test_reference_selfcheck();
  test_widening();
  test_sizes_alignment(o.seed);
  test_sr_properties(o.seed);
  test_sr_wrap(o.seed);
  test_unscale_arguments();
  test_unscale_readonly();
  test_unscale_sizes(o.seed);
  test_unscale(&o);
  test_update_scale(o.seed);
  test_adam_arguments();
  test_adam_exact(o.seed);
  test_adam_double(o.seed);
  test_adam_nonfinite(o.seed);
  test_adam_sizes(o.seed);
  test_adam_ranges_and_steps(o.seed);
  test_adam_unscale_grads(o.seed);
  test_adam_lean(o.seed);
  test_sr_pieces();
  test_q8_codec(o.seed);
  test_adam_q8(o.seed);
  test_adam_q8_guards();
  time_adam_lean();
  test_bf16_remainder_all();
  test_codecs(o.seed);
  test_adam_fused_vs_generic(o.seed);
  test_lion_sgd_reference(o.seed);
  test_adam_pow(o.seed);
  test_cast_dispatch(o.seed);
  test_cast_large_outputs(o.seed);
  test_grad_norm_arguments();
  test_grad_norm(o.seed);
  test_sweeps(&o);

  printf("      total %.2f s\n", now_s() - t0);
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
