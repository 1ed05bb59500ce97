/* The step (mp_step, mpext/step.h) with rule MP_RULE_ADAM, on every ISA path this CPU supports,
 * against this file's reference: rules/adam.h's formula restated in step-by-step float
 * arithmetic (bit for bit on every path, so the paths agree), with the scalars derived as the
 * torch binding derives them; a 50-step run against Adam in double; NaN/Inf grads; sizes,
 * offsets and guards; argument checks; ranges, the step count, found_inf, unscale_grads. */
#include "test_common.h"

#include "mpext/adam.h" /* the mp_adam_* aliases of one release (checked in 11f) */
#include "mpext/step.h"

#include "test_step.h"

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

/* mp_step over elements [0, n) of arrays that start at offsets o; the step count before
 * the step is hp->t - 1, and is left as it is (mp_step only reads it). */
static mp_status call_adam(adam_buf* b, adam_off o, int64_t n, const ref_scalars* hp) {
  float step = hp->t - 1.0f;
  const float inv = hp->inv_scale;
  const mp_step_tensor t = {(char*)b->param + o.p * a_size(b->pt), b->pt,
                            (char*)b->grad + o.g * a_size(b->gt), b->gt,
                            b->master ? b->master + o.w : NULL, b->m + o.m, b->v + o.v, &step, n,
                            NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL, 0};
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

/* Three buffers of one shape: the inputs, the reference's result and the core's. */
static void abuf_init3(adam_buf* in, adam_buf* want, adam_buf* got, mp_dtype pt, mp_dtype gt,
                       size_t cap) {
  abuf_init(in, pt, gt, cap);
  abuf_init(want, pt, gt, cap);
  abuf_init(got, pt, gt, cap);
}

static void abuf_free3(adam_buf* in, adam_buf* want, adam_buf* got) {
  abuf_free(in);
  abuf_free(want);
  abuf_free(got);
}

/* want = the reference's step of in; then on every ISA path k, got = in stepped by the core,
 * its status and every array checked against want in g[k]. extra: for the messages; tk (or
 * NULL): each path's seconds. */
static void adam_check_paths(group* g, const adam_buf* in, adam_buf* want, adam_buf* got,
                             adam_off o, int64_t n, const ref_scalars* hp, const char* pair,
                             const char* extra, double* tk) {
  abuf_copy(want, in);
  ref_adam(want, o, n, hp);
  for (int k = 0; k < g_nisa; ++k) {
    select_isa(g_isas[k]);
    abuf_copy(got, in);
    const double t0 = now_s();
    const mp_status rs = call_adam(got, o, n, hp);
    if (tk) tk[k] = now_s() - t0;
    char ctx[480];
    adam_describe(ctx, sizeof ctx, pair, mp_isa_name(g_isas[k]), hp, extra);
    g_check(&g[k], rs == MP_OK, "%s: status %d", ctx, (int)rs);
    adam_compare(&g[k], in, want, got, o, n, ctx);
  }
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
      (nulls & 64) ? NULL : &step, n, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL, 0};
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
    abuf_init3(&in, &want, &got, pr->pt, pr->gt, N);
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
        char extra[48];
        snprintf(extra, sizeof extra, " (t %.0f, lr %a)", (double)steps[st], (double)cfg.lr);
        adam_check_paths(g, &in, &want, &got, ADAM_OFF0, (int64_t)N, &hp, pr->name, extra, NULL);
        abuf_copy(&in, &want); /* the next step starts from the expected state */
      }
    }
    abuf_free3(&in, &want, &got);
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
    abuf_init3(&in, &want, &got, pr->pt, gt, N);
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
    abuf_free3(&in, &want, &got);
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
    abuf_init3(&in, &want, &got, pr->pt, pr->gt, cap);
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
        char extra[96];
        snprintf(extra, sizeof extra, " (n %" PRId64 ", offsets param %zu grad %zu master %zu "
                 "exp_avg %zu exp_avg_sq %zu)", n, o.p - GUARD, o.g - GUARD, o.w - GUARD,
                 o.m - GUARD, o.v - GUARD);
        adam_check_paths(g, &in, &want, &got, o, n, &hp, pr->name, extra, NULL);
      }
    }
    abuf_free3(&in, &want, &got);
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);

  /* Large: 2^20 + 3 elements, the arrays at different odd/even offsets. */
  const int64_t BIG = ((int64_t)1 << 20) + 3;
  const adam_off ob = {1, 3, 0, 2, 5};
  double tk[N_ADAM_PAIRS][MP_ISA_COUNT];
  for (int k = 0; k < g_nisa; ++k) {
    g_begin(&g[k], "adam: n = %" PRId64 " at offsets 1/3/0/2/5 (vector body, tails), 5 dtype "
            "pairs == reference, guards intact [%s]", BIG, mp_isa_name(g_isas[k]));
  }
  for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
    const adam_pair* pr = &ADAM_PAIRS[pi];
    adam_buf in, want, got;
    const size_t bcap = (size_t)BIG + 8u;
    abuf_init3(&in, &want, &got, pr->pt, pr->gt, bcap);
    adam_fill(&in, &s, 0);
    adam_cfg cfg = {2e-3f, pi % 2 ? 0.3 : 0.9, 0.999, 1e-8, 0.01, (int)(pi % 2 == 0),
                    (int)(pi == 3)};
    ref_scalars hp = adam_scalars(&cfg, 3.0f, 1.0f / 3.0f);
    adam_check_paths(g, &in, &want, &got, ob, BIG, &hp, pr->name, " (large)", tk[pi]);
    abuf_free3(&in, &want, &got);
  }
  for (int k = 0; k < g_nisa; ++k) {
    printf("      adam kernels [%s]:", mp_isa_name(g_isas[k]));
    for (size_t pi = 0; pi < N_ADAM_PAIRS; ++pi) {
      printf(" %s %.2f ns/elt%s", ADAM_PAIRS[pi].name, 1e9 * tk[pi][k] / (double)BIG,
             pi + 1 < N_ADAM_PAIRS ? "," : "\n");
    }
  }
  for (int k = 0; k < g_nisa; ++k) g_end(&g[k]);
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
      abuf_init3(&in, &one, &split, pr->pt, pr->gt, N);
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
                           (int64_t)N, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL, 0};
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
      abuf_free3(&in, &one, &split);
      abuf_free(&want);
    }
    g_end(&g);
  }
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
          abuf_init3(&in, &want, &got, pr->pt, pr->gt, N);
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
                                    got.v, &step, (int64_t)N, NULL, MP_FMT_F32, MP_FMT_F32, 0, NULL, NULL, NULL, 0};
          g_check(&g, mp_step(&t, 0, (int64_t)N, &op) == MP_OK, "%s: status", pr->name);
          char ctx[96];
          snprintf(ctx, sizeof ctx, "%s inv_scale %a%s", pr->name, (double)inv,
                   skip ? " found_inf" : "");
          adam_compare(&g, &in, &want, &got, ADAM_OFF0, (int64_t)N, ctx);
          abuf_free3(&in, &want, &got);
        }
      }
    }
    g_end(&g);
  }
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_adam_arguments();
  test_adam_exact(o->seed);
  test_adam_double(o->seed);
  test_adam_nonfinite(o->seed);
  test_adam_sizes(o->seed);
  test_adam_ranges_and_steps(o->seed);
  test_adam_unscale_grads(o->seed);
}
