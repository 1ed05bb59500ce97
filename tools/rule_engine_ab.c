/* SGD and Lion through the CPU engine's tile pipeline, A/B in one process: mp_k_step_generic of
 * two builds of step.c ("old", e.g. `git show HEAD:csrc/core/step.c`, of the same kernel ABI --
 * before the rename of adam.c to step.c, this file's own history has the harness of that ABI --
 * and "new", this checkout's), on the same arrays, interleaved call by call (the order alternating
 * each round), per storage format, one core. Times are the thread's CPU time
 * (CLOCK_THREAD_CPUTIME_ID), which a busy shared machine disturbs less than the wall clock.
 * Reported per format: each build's median ns per element, and the median [q1, q3] of the
 * per-round ratios new/old. With the same source on both sides it gives the pipeline's own
 * figures and the spread of an A/A run (docs/lean_state.md, "SGD and Lion on the pipeline").
 *
 *   F="-std=c11 -O3 -fno-math-errno -fno-trapping-math -DMP_X86_PATHS=1"
 *   ISA="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mprefer-vector-width=512"
 *   for s in old new; do  # OLD, NEW: two checkouts (or the same one twice)
 *     d=$([ $s = old ] && echo $OLD || echo $NEW)
 *     gcc $F $ISA -I$d/csrc/include -I$d/csrc/core -DMP_ISA_SUFFIX=$s -DMP_NO_FAST_PATHS -c $d/csrc/core/step.c -o /tmp/$s.o
 *   done
 *   gcc $F -O2 -Icsrc/include tools/rule_engine_ab.c /tmp/old.o /tmp/new.o -lm -o /tmp/rab
 * (the rows against the pipeline: compile step.c for "new" without -DMP_NO_FAST_PATHS, then
 *   for f in adam_fused lion_fused; do gcc $F $ISA -I$NEW/csrc/include -I$NEW/csrc/core \
 *     -DMP_ISA_SUFFIX=new -c $NEW/csrc/core/fast/$f.c -o /tmp/$f.o; done
 *   gcc $F -O2 -DAB_ROWS -Icsrc/include tools/rule_engine_ab.c /tmp/new.o /tmp/adam_fused.o \
 *     /tmp/lion_fused.o -lm -o /tmp/rab)
 *   /tmp/rab [numel=16M] [rounds=9] [formats: "all" or a comma list, e.g. sgd_sr_q8,lion_master]
 *            [calls per timing=1: more for arrays that fit a cache] [roofline=0: 1 adds it]
 * GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before the command puts the arrays on 2 MiB pages.
 *
 * With roofline 1, every round also times the in-place roofline (x += 0.5 over 64M fp32, 256
 * MiB, far past the caches, counted as 8 bytes per element: benchmarks/README.md), and each
 * format gets its bytes per element (what the step must read and write, as bench_adam counts
 * them, less the inf check) and, per round, the new build's fraction of its bytes bound at that
 * round's roofline: median [q1, q3], and the ns per element 90% of the bound allows. With the
 * arrays in L2 (numel 32768, calls 300) the fraction says how near the bound the step's
 * instructions alone let it come (docs/fast_paths.md, "Lion"). */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpext/step.h"
#include "mpext/step_storage.h"

#define DECL(s)                                                                                  \
  void mp_k_step_generic__##s(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,  \
                              const mp_rule_scalars*);
#if defined(AB_ROWS)
/* -DAB_ROWS: the fast rows against the pipeline of one build ("new", step.c compiled without
 * MP_NO_FAST_PATHS and linked with csrc/core/fast/'s objects): old is its pipeline alone
 * (mp_k_step_generic), new its step with the rows (mp_k_step); no old.o. */
DECL(new)
void mp_k_step__new(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                    const mp_rule_scalars*);
#define OLD_STEP mp_k_step_generic__new
#define NEW_STEP mp_k_step__new
#else
DECL(old)
DECL(new)
#define OLD_STEP mp_k_step_generic__old
#define NEW_STEP mp_k_step_generic__new
#endif

#include "ab_clock.h"

/* The formats of benchmarks/bench_adam.py (bf16 params and grads), plus an fp32 master with
 * 8-bit moments. */
static const char* const FORMATS[] = {"master", "remainder", "rem_bf16m", "sr_bf16m", "sr",
                                      "rem_q8", "sr_q8",     "master_q8", "rne"};
#define NFMT 9
#define MAX_ROUNDS 64
/* Bytes per element the step moves, per format: bf16 grad read and bf16 param written (2 + 2),
 * an fp32 master read and written (8) or a remainder (4), the moment read and written (fp32 8,
 * bf16 4, 8-bit 2; the 8-bit scales are 8 bytes per 256). */
static const int BYTES[NFMT] = {20, 18, 14, 10, 14, 12, 8, 14, 14};

#define ROOF_N (64l << 20)

/* One in-place pass over the roofline buffer: its CPU time. */
static double roof_pass(float* x) {
  const double t0 = now();
  for (long i = 0; i < ROOF_N; ++i) x[i] += 0.5f;
  __asm__ volatile("" ::"r"(x) : "memory");
  return now() - t0;
}

static void step(int new_build, const mp_step_tensor* t, int64_t n, const mp_step_scalars* s,
                 const mp_rule_scalars* r) {
  (new_build ? NEW_STEP : OLD_STEP)(t, 0, n, s, r);
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : (16 << 20);
  int rounds = argc > 2 ? atoi(argv[2]) : 9;
  const char* only = argc > 3 && strcmp(argv[3], "all") != 0 ? argv[3] : NULL;
  const int calls = argc > 4 ? atoi(argv[4]) : 1;
  const int roofline = argc > 5 && atoi(argv[5]) != 0;
  float* roof = roofline ? calloc((size_t)ROOF_N, 4) : NULL;
  if (roofline && roof == NULL) return 1;
  rounds = rounds < 1 ? 1 : rounds > MAX_ROUNDS ? MAX_ROUNDS : rounds;
  uint16_t* param = malloc((size_t)n * 2);
  uint16_t* grad = malloc((size_t)n * 2);
  float* master = malloc((size_t)n * 4);
  int16_t* rem = calloc((size_t)n, 2);
  float* m = calloc((size_t)n, 4);
  float* ms = calloc((size_t)(n / 32 + 1), 4);
  if (!param || !grad || !master || !rem || !m || !ms) return 1;
  printf("numel %lld, %d rounds, %d calls per timing: median ns per element of old and new; "
         "new/old median [q1, q3] of the per-round ratios\n", (long long)n, rounds, calls);
  for (int lion = 1; lion >= 0; --lion) {
    for (int f = 0; f < NFMT; ++f) {
      char name[64];
      snprintf(name, sizeof name, "%s_%s", lion ? "lion" : "sgd", FORMATS[f]);
      if (only != NULL) { /* a whole entry of the comma list */
        const size_t len = strlen(name);
        const char* p = only;
        while ((p = strstr(p, name)) != NULL && ((p != only && p[-1] != ',') ||
                                                 (p[len] != ',' && p[len] != '\0')))
          p += len;
        if (p == NULL) continue;
      }
      const int q8 = f >= 5 && f <= 7, bf16m = f == 2 || f == 3;
      const int remainder = f == 1 || f == 2 || f == 5;
      const int sr = f == 3 || f == 4 || f == 6, has_master = f == 0 || f == 7;
      for (int64_t i = 0; i < n; ++i) { /* normal values only: a subnormal costs an assist */
        const float x = 0.02f + 1e-5f * (float)(i % 2001 - 1000);
        const float g = 1e-3f * (float)((i * 7919) % 1000 - 500) / 500.0f + 1e-6f;
        uint32_t u;
        master[i] = x;
        memcpy(&u, &x, 4);
        param[i] = (uint16_t)(u >> 16);
        memcpy(&u, &g, 4);
        grad[i] = (uint16_t)(u >> 16);
      }
      memset(rem, 0, (size_t)n * 2);
      memset(m, 0, (size_t)n * 4);
      memset(ms, 0, (size_t)(n / 32 + 1) * 4);
      float stp = 1.0f;
      const mp_step_tensor t = {.param = param, .param_dtype = MP_BF16, .grad = grad,
                                .grad_dtype = MP_BF16, .master = has_master ? master : NULL,
                                .exp_avg = m, .step = &stp, .n = n,
                                .remainder = remainder ? rem : NULL,
                                .exp_avg_format = q8 ? MP_FMT_Q8S : bf16m ? MP_FMT_BF16 : MP_FMT_F32,
                                .exp_avg_scale = q8 ? ms : NULL};
      const mp_step_options o = {.beta1 = 0.9, .beta2 = lion ? 0.99 : 0.0, .weight_decay = 0.01,
                                 .decoupled = lion, .lr_value = 1e-3f, .sr_params = sr,
                                 .seed = 7, .q8_block = 256,
                                 .rule = lion ? MP_RULE_LION : MP_RULE_SGD};
      const mp_step_scalars s = mp_step_scalars_now(&o, &stp, 0);
      const mp_rule_scalars rs = mp_rule_scalars_now(&o, &stp);
      double t_old[MAX_ROUNDS], t_new[MAX_ROUNDS], ratio[MAX_ROUNDS];
      double frac[MAX_ROUNDS], roof_ns[MAX_ROUNDS];
      for (int r = -1; r < rounds; ++r) { /* round -1 warms both up */
        double took[2] = {0.0, 0.0};
        for (int w = 0; w < 2; ++w) {
          const int b = ((r & 1) ^ w) != 0; /* which build runs first alternates */
          const double t0 = now();
          for (int c = 0; c < calls; ++c) step(b, &t, n, &s, &rs);
          took[b] = now() - t0;
        }
        const double rt = roofline ? roof_pass(roof) : 0.0;
        if (r < 0) continue;
        t_old[r] = took[0];
        t_new[r] = took[1];
        ratio[r] = took[1] / took[0];
        roof_ns[r] = 1e9 * rt / (double)ROOF_N; /* per 8 bytes */
        frac[r] = BYTES[f] / 8.0 * roof_ns[r] / (1e9 * took[1] / (double)n / (double)calls);
      }
      qsort(t_old, (size_t)rounds, sizeof(double), cmp);
      qsort(t_new, (size_t)rounds, sizeof(double), cmp);
      qsort(ratio, (size_t)rounds, sizeof(double), cmp);
      const double per = 1e9 / (double)n / (double)calls;
      printf("%-16s %.3f %.3f  %.3f [%.3f, %.3f]", name, t_old[rounds / 2] * per,
             t_new[rounds / 2] * per, ratio[rounds / 2], ratio[rounds / 4],
             ratio[(3 * rounds) / 4]);
      if (roofline) {
        qsort(frac, (size_t)rounds, sizeof(double), cmp);
        qsort(roof_ns, (size_t)rounds, sizeof(double), cmp);
        printf("  %2d B: new %.0f%% [%.0f, %.0f] of the bound (roofline %.3f ns/8 B; 90%%: "
               "%.3f ns)", BYTES[f], 100 * frac[rounds / 2], 100 * frac[rounds / 4],
               100 * frac[(3 * rounds) / 4], roof_ns[rounds / 2],
               BYTES[f] / 8.0 * roof_ns[rounds / 2] / 0.9);
      }
      printf("\n");
    }
  }
  return 0;
}
