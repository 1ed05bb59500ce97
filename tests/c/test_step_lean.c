/* The step's lean storage (mp_step with a remainder, bf16 moments, or no master), on every ISA
 * path this CPU supports, against the float reference of test_step.h and the rounding
 * references of test_common.h; and the lean kernels timed (meaningful in a plain build). */
#include "test_common.h"

#include "mpext/step.h"
#include "mpext/step_storage.h"

#include "test_step.h"

/* 11i. Lean storage (adam.h): against this file's reference of the element update,
 *   - a remainder: the same bits as an fp32 master, step after step (param, master = join of
 *     param and remainder, moments), on random data and on masters planted at bf16 ties;
 *   - bf16 moments: the reference's fp32 moments rounded to bf16 stochastically with the
 *     documented bits (stream 2k of the step, position i: low half for exp_avg, high half for
 *     exp_avg_sq), or to nearest with moments_nearest;
 *   - no master: the update from the param's own value, written to nearest or stochastically
 *     (stream 2k + 1) into bf16 and fp16: the rounding stated from its definition here.
 * Every ISA path, ranges split anywhere (the bits depend on the element's position only). */

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
                            mom16 ? MP_FMT_BF16 : MP_FMT_F32, stream, NULL, NULL, NULL, 0};
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

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_adam_lean(o->seed);
  time_adam_lean();
}
