/* What the C core's tests share (tests/c/test_*.c that include this header; tests/c/run.py
 * builds each such file into a binary of its own, linked with test_common.c, which holds main):
 *   - check groups: a group passes when none of its checks failed; one line per group;
 *   - the ISA paths under test (g_isas: every path this CPU supports, or the one --isa names);
 *   - the references the ops' tests share, written independently of csrc/core and numerics.h:
 *     fp32 -> bf16/fp16 round to nearest even in double arithmetic, a field decoder built on
 *     ldexp, this suite's statement of the stochastic-rounding generator, the fp32 sweep's
 *     input patterns, the 8-bit moment codes restated in double.
 * The helpers are static inline so that each test keeps its own copy (as when they were one
 * file): the sweeps call them per input.
 *
 * Each test file defines run_tests; main parses the options, picks the ISA paths, calls it, and
 * prints "N passed, M failed" (exit status 1 if anything failed). Options: --stride S (fp32
 * sweep step over the 2^32 patterns, odd, default 257), --random N (random patterns added to
 * the sweep, default 2000000), --seed X (seed of the random inputs), --isa NAME (test only that
 * path; "best": the one this CPU selects by default). */
#ifndef MPEXT_TESTS_C_TEST_COMMON_H
#define MPEXT_TESTS_C_TEST_COMMON_H

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpext/formats/q8.h" /* the 8-bit codes' field widths, restated below */
#include "mpext/mpext.h"
#include "mpext/numerics.h"

/* ------------------------------------------------------------------------------------------ */
/* Bookkeeping (test_common.c): a check group passes when it saw no failure. */

typedef struct group {
  char name[128];
  long long bad;
  long long count;
  double t0;
} group;

double now_s(void);
void g_begin(group* g, const char* fmt, ...);
/* Records one failure; prints the first few in detail. */
void g_fail(group* g, const char* fmt, ...);
/* Checks cond; on failure records it with the message. Returns cond. */
int g_check(group* g, int cond, const char* fmt, ...);
void g_end(group* g);

/* The ISA paths to test, in mp_isa order (test_common.c's main fills them). */
extern mp_isa g_isas[MP_ISA_COUNT];
extern int g_nisa;
/* Makes isa the active path; exits if it cannot. */
void select_isa(mp_isa isa);

/* ------------------------------------------------------------------------------------------ */
/* Small helpers. */
static inline uint64_t splitmix64(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint64_t hash64(uint64_t x) { return splitmix64(&x); }

static inline float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline void* xmalloc(size_t n) {
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
static inline double pow2(int e) {
  uint64_t b = (uint64_t)(e + 1023) << 52;
  double d;
  memcpy(&d, &b, sizeof d);
  return d;
}

/* floor(log2(v)) for a normal double v > 0. */
static inline int exponent_of(double v) {
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

static inline cands candidates(double ax, const fmt* f) {
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
static inline double round_rne(double ax, const fmt* f) {
  cands c = candidates(ax, f);
  double dl = ax - c.lo, dh = c.hi - ax;
  if (dl < dh) return c.lo;
  if (dh < dl) return c.hi;
  return (c.k % 2u) == 0u ? c.lo : c.hi;
}

/* Encodes a non-negative value of the format (or anything above its largest finite value, which
 * becomes Inf) with the given sign, from its exponent and significand. */
static inline uint32_t encode(double v, int neg, const fmt* f) {
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
static inline double decode(uint32_t h, const fmt* f) {
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

static inline int is_nan_fmt(uint32_t h, const fmt* f) {
  int mbits = f->p - 1;
  uint32_t expmask = ((1u << f->ebits) - 1u) << mbits;
  return (h & expmask) == expmask && (h & ((1u << mbits) - 1u)) != 0;
}

/* A NaN result for a NaN input: must be NaN; cast.h also documents it as quiet with the input's
 * sign. Returns 0 if fine, else a short reason. */
static inline const char* nan_result_problem(uint32_t in, uint32_t out, const fmt* f) {
  int mbits = f->p - 1;
  if (!is_nan_fmt(out, f)) return "not a NaN";
  if (!(out & (1u << (mbits - 1)))) return "NaN not quiet";
  if ((out >> (f->ebits + mbits)) != (in >> 31)) return "NaN sign changed";
  return NULL;
}

/* Expected RNE result bits for fp32 bits u; *nan set for NaN inputs (no fixed bits then). */
static inline uint32_t ref_rne(uint32_t u, const fmt* f, int* nan) {
  float x = f32_of(u);
  *nan = isnan(x) ? 1 : 0;
  if (*nan) return 0;
  int neg = (u >> 31) != 0;
  if (isinf(x)) return encode(INFINITY, neg, f);
  return encode(round_rne(fabs((double)x), f), neg, f);
}

/* Expected stochastic-rounding bf16 bits for fp32 bits u and 16 random bits r16: the magnitude
 * rounds up iff (discarded fraction of a bf16 quantum) * 2^16 + r16 >= 2^16. */
static inline uint32_t ref_sr(uint32_t u, uint32_t r16, int* nan) {
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

/* ------------------------------------------------------------------------------------------ */
/* This file's statement of the stochastic-rounding generator (mpext/numerics.h's documentation):
 * a 32-bit mixer x ^= x >> 16, x *= 0x21F0AAAD, x ^= x >> 15, x *= 0xD35A2D97, x ^= x >> 15; a
 * key = m64(m64(m64(seed + golden) ^ step) ^ stream) with splitmix64's finalizer m64; the bits at
 * position p = m32(lo(p) ^ lo(key) ^ m32(hi(p) ^ hi(key))). */
static inline uint32_t ref_m32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x21F0AAADu;
  x = (x ^ (x >> 15)) * 0xD35A2D97u;
  return x ^ (x >> 15);
}

static inline uint64_t ref_m64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint64_t ref_key(uint64_t seed, uint64_t step, uint64_t stream) {
  return ref_m64(ref_m64(ref_m64(seed + 0x9E3779B97F4A7C15ull) ^ step) ^ stream);
}

static inline uint32_t ref_bits(uint64_t key, uint64_t pos) {
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

static inline uint32_t boundary_pattern(uint64_t i, uint64_t seed) {
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
static inline size_t next_patterns(pat_iter* it, uint32_t* out, size_t cap) {
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

#define CHUNK ((size_t)1 << 16)

typedef struct sweep_opts {
  uint64_t stride, n_random, seed;
} sweep_opts;

static inline uint32_t random_input(uint64_t* s) {
  uint64_t r = splitmix64(s);
  switch (r % 8u) {
    case 0: return (uint32_t)(r >> 32);                                   /* any pattern */
    case 1: return (uint32_t)(r >> 32) & 0x807FFFFFu;                     /* subnormal */
    case 2: return ((uint32_t)(r >> 32) & 0xFFFF0000u) | 0x7F7F0000u;     /* huge */
    default: return ((uint32_t)(r >> 32) & 0x807FFFFFu) | ((uint32_t)(100 + r % 60u) << 23);
  }
}

#define GUARD 32

#define SENT16 0xBEEFu

#define SENT32 0xDEADBEEFu

enum { U_F32 = MP_F32, U_BF16 = MP_BF16, U_FP16 = MP_F16 };

static const char* const U_NAME[3] = {"fp32", "bf16", "fp16"};

static inline const fmt* u_fmt(int dt) { return dt == U_BF16 ? &BF16 : &FP16; }

static inline uint32_t u_get(const void* p, int dt, int64_t i) {
  return dt == U_F32 ? ((const uint32_t*)p)[i] : ((const uint16_t*)p)[i];
}

static inline void u_put(void* p, int dt, int64_t i, uint32_t v) {
  if (dt == U_F32) {
    ((uint32_t*)p)[i] = v;
  } else {
    ((uint16_t*)p)[i] = (uint16_t)v;
  }
}

static inline size_t u_size(int dt) { return dt == U_F32 ? 4u : 2u; }

/* Random element bits: finite (normal, subnormal, zero, huge) unless bad, then NaN or +-Inf. */
static inline uint32_t u_random(uint64_t* s, int dt, int bad) {
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

/* 8-bit block-quantized moments (mpext/formats/q8.h): the documented format restated in double:
 * the value of every code by its definition, the nearest code (ties to the even code) and the
 * stochastic choice (up iff floor(fraction * 2^16) + r16 >= 2^16) by comparing against every
 * code's value, the block reference from the absmax by its definition. */
typedef struct q8_fmt {
  int ebits, mbits, is_signed;
} q8_fmt;

static const q8_fmt Q8_M = {MP_Q8_M_EBITS, MP_Q8_M_MBITS, 1};

static const q8_fmt Q8_V = {MP_Q8_V_EBITS, MP_Q8_V_MBITS, 0};

static inline int q8_ncodes(const q8_fmt* f) { return 1 << (f->ebits + f->mbits); }

/* The value of magnitude code c at reference exponent field ea: 2^(e - T) (1 + f / 2^M) or
 * 2^(1 - T) f / 2^M, times 2^(ea - 127). */
static inline double q8_value(const q8_fmt* f, int c, int ea) {
  const int t = (1 << f->ebits) - 1, e = c >> f->mbits, m = c & ((1 << f->mbits) - 1);
  const double rel = e ? ldexp(1.0 + ldexp((double)m, -f->mbits), e - t)
                       : ldexp(ldexp((double)m, -f->mbits), 1 - t);
  return ldexp(rel, ea - 127);
}

/* The reference exponent field of a block with absmax a: the field of a's binade, one more
 * when a exceeds the binade's largest 1 + M significant-bit value, at least 2^ebits; 255 for a
 * NaN or Inf absmax. */
static inline int q8_ref_exp_ref(const q8_fmt* f, double a) {
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
static inline int q8_encode_ref(const q8_fmt* f, double ax, int ea, uint32_t r16, int nearest) {
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

static inline int q8_encode_full_ref(const q8_fmt* f, float x, int ea, uint32_t r16, int nearest) {
  const int c = q8_encode_ref(f, fabs((double)x), ea, r16, nearest);
  return f->is_signed && signbit(x) ? c | 0x80 : c;
}

static inline double q8_decode_ref(const q8_fmt* f, int code, int ea) {
  if (ea >= 255) return NAN;
  const int mag = f->is_signed ? code & 0x7F : code;
  const double v = q8_value(f, mag, ea);
  return f->is_signed && (code & 0x80) ? -v : v;
}

/* ------------------------------------------------------------------------------------------ */
/* Each test file's tests, in its order: o holds the options, initial_active the path that was
 * active before anything selected one. */
void run_tests(const sweep_opts* o, mp_isa initial_active);

#endif
