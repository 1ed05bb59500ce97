/* The CPU step engine's speed on the Adam rule, A/B in one process: the C core's mp_k_step as
 * built from this checkout ("new": the tile pipeline with the fast paths csrc/core/fast/ keeps),
 * the same step through the pipeline alone ("generic"), and an older step.c ("old", of the same
 * kernel ABI: `git show REV:csrc/core/step.c > /tmp/step_old.c`, REV since the rename of
 * adam.c to step.c; before it, this file's own history has the harness of that ABI), on the same
 * arrays, interleaved call by call (the order alternating), per storage mode. Times are the
 * thread's CPU time (CLOCK_THREAD_CPUTIME_ID), which a busy shared machine disturbs less than
 * the wall clock; reported: each build's median, and the medians of the per-round ratios with
 * their quartiles (the spread).
 *
 *   F="-std=c11 -O3 -fno-math-errno -fno-trapping-math -DMP_X86_PATHS=1 -Icsrc/include -Icsrc/core"
 *   ISA="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mprefer-vector-width=512"
 *   gcc $F $ISA -DMP_ISA_SUFFIX=old -c /tmp/step_old.c -o /tmp/old.o
 *   gcc $F $ISA -DMP_ISA_SUFFIX=new -c csrc/core/step.c -o /tmp/new.o
 *   gcc $F $ISA -DMP_ISA_SUFFIX=new -c csrc/core/fast/adam_fused.c -o /tmp/fused.o
 *   gcc $F -O2 tools/adam_engine_ab.c /tmp/old.o /tmp/new.o /tmp/fused.o -lm -o /tmp/ab
 *   /tmp/ab [numel=16M] [rounds=15] [modes: a comma list, default all]
 * (ISA="" and -DMP_ISA_SUFFIX as you like for the other paths; without an old build, compile
 * the harness with -DNO_OLD and old is the generic step; the old step.c needs a fast path too:
 * compile it with -DMP_NO_FAST_PATHS, or link a fast/adam_fused.c of its own suffix.) */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpext/step.h"
#include "mpext/step_storage.h"

typedef void (*step_fn)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                        const mp_rule_scalars*);
void mp_k_step__new(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                    const mp_rule_scalars*);
void mp_k_step_generic__new(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                            const mp_rule_scalars*);
#ifdef NO_OLD
#define mp_k_step__old mp_k_step_generic__new
#else
void mp_k_step__old(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                    const mp_rule_scalars*);
#endif

#include "ab_clock.h"

/* param storage: 0 fp32 param, 1 master, 2 remainder, 3 none; moments 0 fp32, 1 bf16, 8 the
 * 8-bit pair; dtypes 0 fp32, 1 bf16, 2 fp16 */
typedef struct mode {
  const char* name;
  int pt, gt, kind, md, wb, ema, sr, nearest;
} mode;

static const mode MODES[] = {
    {"master", 1, 1, 1, 0, 0, 0, 0, 0},          {"master_wb", 1, 1, 1, 0, 1, 0, 0, 0},
    {"master_g32", 1, 0, 1, 0, 0, 0, 0, 0},      {"fp16_master", 2, 2, 1, 0, 0, 0, 0, 0},
    {"fp32", 0, 0, 0, 0, 0, 0, 0, 0},            {"fp32_wb", 0, 0, 0, 0, 1, 0, 0, 0},
    {"remainder", 1, 1, 2, 0, 0, 0, 0, 0},       {"remainder_wb", 1, 1, 2, 0, 1, 0, 0, 0},
    {"remainder_bf16m", 1, 1, 2, 1, 0, 0, 0, 0}, {"remainder_bf16m_ema", 1, 1, 2, 1, 0, 1, 0, 0},
    {"sr_bf16m", 1, 1, 3, 1, 0, 0, 1, 0},        {"sr", 1, 1, 3, 0, 0, 0, 1, 0},
    {"rne", 1, 1, 3, 0, 0, 0, 0, 0},             {"q8_remainder", 1, 1, 2, 8, 0, 0, 0, 0},
    {"q8_sr", 1, 1, 3, 8, 0, 0, 1, 0},           {"fp16_sr", 2, 2, 3, 0, 0, 0, 1, 0},
    {"bf16m_nearest", 1, 1, 2, 1, 0, 0, 0, 1},   {"master_ema", 1, 1, 1, 0, 0, 1, 0, 0},
    {"sr_wb", 1, 1, 3, 0, 1, 0, 1, 0},           {"rne_wb", 1, 1, 3, 0, 1, 0, 0, 0},
    {"sr_bf16m_wb", 1, 1, 3, 1, 1, 0, 1, 0},     {"remainder_bf16m_wb", 1, 1, 2, 1, 1, 0, 0, 0},
    {"master_bf16m", 1, 1, 1, 1, 0, 0, 0, 0},    {"master_bf16m_wb", 1, 1, 1, 1, 1, 0, 0, 0},
    {"fp32_bf16m", 0, 0, 0, 1, 0, 0, 0, 0},      {"fp16_master_wb", 2, 2, 1, 0, 1, 0, 0, 0},
    {"fp16_rne", 2, 2, 3, 0, 0, 0, 0, 0},        {"fp16_sr_wb", 2, 2, 3, 0, 1, 0, 1, 0},
    {"master_g32_wb", 1, 0, 1, 0, 1, 0, 0, 0},   {"fp32_ema", 0, 0, 0, 0, 0, 1, 0, 0},
    {"sr_ema", 1, 1, 3, 0, 0, 1, 1, 0},          {"sr_bf16m_ema", 1, 1, 3, 1, 0, 1, 1, 0},
    {"q8_remainder_wb", 1, 1, 2, 8, 1, 0, 0, 0}, {"q8_sr_wb", 1, 1, 3, 8, 1, 0, 1, 0},
    {"q8_master", 1, 1, 1, 8, 0, 0, 0, 0},       {"remainder_g32", 1, 0, 2, 0, 0, 0, 0, 0},
    {"sr_g32", 1, 0, 3, 0, 0, 0, 1, 0},          {"remainder_bf16m_g32", 1, 0, 2, 1, 0, 0, 0, 0},
};

static int listed(const char* list, const char* name) {
  if (list == NULL) return 1;
  const size_t n = strlen(name);
  for (const char* p = list; (p = strstr(p, name)) != NULL; p += n) {
    if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == '\0')) return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : (16 << 20);
  const int rounds = argc > 2 ? atoi(argv[2]) : 15;
  const char* only = argc > 3 ? argv[3] : NULL;
  const int dts[3] = {MP_F32, MP_BF16, MP_F16};
  const step_fn fns[3] = {mp_k_step__old, mp_k_step__new, mp_k_step_generic__new};
  printf("numel %lld, %d rounds; per mode: median ns per element of old, new, generic; new/old, "
         "generic/new and generic/old: median [q1, q3] of the per-round ratios\n", (long long)n, rounds);
  for (size_t k = 0; k < sizeof MODES / sizeof *MODES; ++k) {
    const mode* M = &MODES[k];
    if (!listed(only, M->name)) continue;
    const int pt = dts[M->pt], gt = dts[M->gt], q8 = M->md == 8;
    const int mf = q8 ? MP_FMT_Q8S : (M->md ? MP_FMT_BF16 : MP_FMT_F32);
    const int vf = q8 ? MP_FMT_Q8U : mf;
    mp_step_tensor t;
    memset(&t, 0, sizeof t);
    t.param = malloc(n * 4);
    t.param_dtype = pt;
    t.grad = malloc(n * 4);
    t.grad_dtype = gt;
    for (int64_t i = 0; i < n; ++i) { /* grads of about 1e-3, both signs; params 0.02 */
      const float g = 1e-3f * (float)((i * 7919) % 1000 - 500) / 500.0f;
      if (gt == MP_F32) {
        ((float*)t.grad)[i] = g;
      } else {
        ((uint16_t*)t.grad)[i] = (uint16_t)(gt == MP_BF16 ? 0x3A83u : 0x1419u) | (uint16_t)((i & 1) << 15);
      }
      if (pt == MP_F32) {
        ((float*)t.param)[i] = 0.02f;
      } else {
        ((uint16_t*)t.param)[i] = pt == MP_BF16 ? 0x3CA4u : 0x251Fu;
      }
    }
    if (M->kind == 1) {
      t.master = malloc(n * 4);
      for (int64_t i = 0; i < n; ++i) t.master[i] = 0.02f;
    }
    if (M->kind == 2) t.remainder = calloc(n, 2);
    t.exp_avg = calloc(n, 4);
    t.exp_avg_sq = calloc(n, 4);
    t.exp_avg_format = mf;
    t.exp_avg_sq_format = vf;
    float step = 0.0f;
    t.step = &step;
    t.n = n;
    if (q8) {
      t.exp_avg_scale = calloc(n / 256 + 1, 4);
      t.exp_avg_sq_scale = calloc(n / 256 + 1, 4);
    }
    if (M->ema) {
      t.ema = malloc(n * 4);
      for (int64_t i = 0; i < n; ++i) t.ema[i] = 0.02f;
    }
    mp_step_options o; /* rule 0: MP_RULE_ADAM */
    memset(&o, 0, sizeof o);
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.eps = 1e-8;
    o.weight_decay = 1e-2;
    o.decoupled = 1;
    o.lr_value = 1e-3f;
    o.unscale_grads = M->wb;
    o.sr_params = M->sr;
    o.q8_block = 256;
    o.ema_decay = M->ema ? 0.999 : 0.0; /* 0: what a group without an ema passes */
    o.moments_nearest = M->nearest;
    double* tm[3];
    double* ratio[3];
    for (int j = 0; j < 3; ++j) tm[j] = malloc(rounds * sizeof(double));
    for (int j = 0; j < 3; ++j) ratio[j] = malloc(rounds * sizeof(double));
    for (int r = -2; r < rounds; ++r) { /* two warm-up rounds */
      double tt[3];
      for (int w = 0; w < 3; ++w) {
        const int which = (w + r + 3) % 3; /* the order rotates */
        /* x0.5 and x2 in turn: with the grad written back its scale stays put */
        const float inv = (r + 2) % 2 ? 2.0f : 0.5f;
        const mp_step_scalars s = mp_step_scalars_of(&o, step, inv, 1);
        const mp_rule_scalars rs = mp_rule_scalars_of(&o, 1e-3f, step);
        const double t0 = now();
        fns[which](&t, 0, n, &s, &rs);
        tt[which] = now() - t0;
      }
      step += 1.0f;
      if (r < 0) continue;
      for (int j = 0; j < 3; ++j) tm[j][r] = tt[j];
      ratio[0][r] = tt[1] / tt[0];
      ratio[1][r] = tt[2] / tt[1];
      ratio[2][r] = tt[2] / tt[0];
    }
    for (int j = 0; j < 3; ++j) qsort(tm[j], rounds, sizeof(double), cmp);
    for (int j = 0; j < 3; ++j) qsort(ratio[j], rounds, sizeof(double), cmp);
    printf("%-20s old %6.3f new %6.3f generic %6.3f ns | new/old %.3f [%.3f, %.3f] | "
           "generic/new %.3f [%.3f, %.3f] | generic/old %.3f [%.3f, %.3f]\n",
           M->name, 1e9 * tm[0][rounds / 2] / (double)n, 1e9 * tm[1][rounds / 2] / (double)n,
           1e9 * tm[2][rounds / 2] / (double)n,
           ratio[0][rounds / 2], ratio[0][rounds / 4], ratio[0][3 * rounds / 4],
           ratio[1][rounds / 2], ratio[1][rounds / 4], ratio[1][3 * rounds / 4],
           ratio[2][rounds / 2], ratio[2][rounds / 4], ratio[2][3 * rounds / 4]);
    fflush(stdout);
    free(t.param);
    free(t.grad);
    free(t.master);
    free(t.remainder);
    free(t.exp_avg);
    free(t.exp_avg_sq);
    free(t.exp_avg_scale);
    free(t.exp_avg_sq_scale);
    free(t.ema);
    for (int j = 0; j < 3; ++j) free(tm[j]);
    for (int j = 0; j < 3; ++j) free(ratio[j]);
  }
  return 0;
}
