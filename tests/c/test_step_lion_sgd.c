/* Lion and SGD, the other rules of mp_step: lion-pytorch's and torch.optim.SGD's update
 * restated in float (fmaf for each add(alpha=)), in every param storage and moment format, with
 * the rounding references of test_common.h (bit for bit on every path). */
#include "test_common.h"

#include "mpext/step.h"
#include "mpext/step_storage.h"

#include "test_step.h"

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

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_lion_sgd_reference(o->seed);
}
