/* The step with 8-bit block-coded moments (mp_step, MP_FMT_Q8S / MP_FMT_Q8U), on every ISA path
 * this CPU supports, block by block against the format restated in double (test_common.h) and
 * the float reference of test_step.h: every param storage, split ranges, both roundings; the v
 * floor, a skipped step, argument checks. */
#include "test_common.h"

#include "mpext/step.h"
#include "mpext/step_storage.h"

#include "test_step.h"

/* 11k. The whole step with 8-bit moments block by block (decode, the v floor, the element update,
 *      the new absmax, encode) on every ISA path, every param storage, ranges split at block
 *      boundaries, both roundings. */

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
                            n, c->storage == 2 ? rem : NULL, MP_FMT_Q8S, MP_FMT_Q8U, stream, ms, vs, NULL, 0};
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
                      ms, vs, NULL, 0};
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

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_adam_q8(o->seed);
  test_adam_q8_guards();
}
