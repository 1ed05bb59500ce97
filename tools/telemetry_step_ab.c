/* Precision telemetry's step counters, their cost, A/B in one process (docs/telemetry.md, "The
 * step half"): on the same arrays, interleaved call by call, per storage mode, the thread's CPU
 * time (CLOCK_THREAD_CPUTIME_ID, which a busy shared machine disturbs less than the wall clock)
 * of
 *   - the uncounted step (the kernel table's step: the mode's fast row, or the pipeline),
 *   - the counted step (mp_k_step_stats: the counted row, or the counted pipeline),
 *   - the counted pipeline alone (mp_k_step_stats_generic: the counted step before the rows),
 *   - for the Adam rows, the uncounted row called directly, against an older adam_fused.c's
 *     ("old": its mp_k_fast_step renamed), to show the uncounted rows did not change speed,
 *   - and that older file's counted row (its mp_k_fast_step_stats renamed), the counted step it
 *     gave (the counted pipeline where it had no row for the mode).
 * Reported: the medians of the per-round ratios with their quartiles. avx512 build:
 *
 *   python3 tests/c/run.py --no-sanitize --only test_fast_paths   # the core's objects
 *   git show REV:csrc/core/fast/adam_fused.c > /tmp/old/fast/adam_fused.c (and its headers)
 *   gcc $(cat build/core/plain/avx512/csrc/core/fast/adam_fused.o.cmd | sed 's#-c [^ ]*#-c /tmp/old/fast/adam_fused.c#; s#-o [^ ]*#-o /tmp/old/af.o#')
 *   objcopy --redefine-sym mp_k_fast_step__avx512=old_fast_step__avx512 \
 *       --redefine-sym mp_k_fast_step_stats__avx512=old_fast_step_stats__avx512 /tmp/old/af.o /tmp/old/old.o
 *   gcc -O2 -std=c11 -DMP_X86_PATHS=1 -DMP_ISA_SUFFIX=avx512 -Icsrc/include -Icsrc/core \
 *       tools/telemetry_step_ab.c /tmp/old/old.o $(find build/core/plain -name "*.o") -lm -o /tmp/tab
 *   /tmp/tab [elements, default 2^22] [rounds, default 11]     # ONLY=q8 /tmp/tab: those modes
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "isa.h"
#include "formats/tiles.h"
#include "mpext/step.h"
#include "mpext/step_storage.h"
#include "mpext/telemetry.h"

int old_fast_step__avx512(const mp_step_tensor* t, int64_t start, int64_t n,
                          const mp_step_scalars* s, const mp_rule_scalars* r, int kind);
int old_fast_step_stats__avx512(const mp_step_tensor* t, int64_t start, int64_t n,
                                const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                double* row);
void mp_k_step_stats_generic__avx512(const mp_step_tensor* t, int64_t start, int64_t n,
                                     const mp_step_scalars* s, const mp_rule_scalars* r, double* row);
void mp_k_step_stats__avx512(const mp_step_tensor* t, int64_t start, int64_t n,
                             const mp_step_scalars* s, const mp_rule_scalars* r, double* row);

#include "ab_clock.h"
static uint64_t rs = 88172645463325252ull;
static double urand(void) {
  rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
  return (double)(rs >> 11) * 0x1p-53;
}
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }

typedef struct { const char* name; int rule, kind, md; /* md: 0 f32, 1 bf16, 2 q8 */ double mom; } mode;

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? atoll(argv[1]) : (1 << 22);
  const int R = argc > 2 ? atoi(argv[2]) : 11;
  const mode modes[] = {
      {"AdamW SR + bf16 moments (row sr_bf16m)", MP_RULE_ADAM, MP_PV_NONE_SR, 1, 0},
      {"AdamW RNE (row rne)", MP_RULE_ADAM, MP_PV_NONE_RNE, 0, 0},
      {"AdamW fp32 master (row master)", MP_RULE_ADAM, MP_PV_MASTER, 0, 0},
      {"AdamW remainder (row remainder)", MP_RULE_ADAM, MP_PV_REMAINDER, 0, 0},
      {"AdamW SR (row sr)", MP_RULE_ADAM, MP_PV_NONE_SR, 0, 0},
      {"AdamW remainder + bf16 moments (row remainder_bf16m)", MP_RULE_ADAM, MP_PV_REMAINDER, 1, 0},
      {"AdamW remainder + 8-bit moments (row q8_remainder)", MP_RULE_ADAM, MP_PV_REMAINDER, 2, 0},
      {"AdamW SR + 8-bit moments (row q8_sr)", MP_RULE_ADAM, MP_PV_NONE_SR, 2, 0},
      {"Lion remainder (no row)", MP_RULE_LION, MP_PV_REMAINDER, 0, 0},
      {"SGD momentum SR (no row)", MP_RULE_SGD, MP_PV_NONE_SR, 0, 0.9},
  };
  printf("N = %lld elements, %d rounds, one thread, CPU time\n", (long long)N, R);
  for (size_t k = 0; k < sizeof modes / sizeof modes[0]; ++k) {
    const mode* md = &modes[k];
    if (getenv("ONLY") && !strstr(md->name, getenv("ONLY"))) continue;
    uint16_t* p = malloc(N * 2); uint16_t* g = malloc(N * 2);
    float* master = malloc(N * 4); int16_t* rem = malloc(N * 2);
    void* m = malloc(N * 4); void* v = malloc(N * 4);
    float* ms = malloc((N / 256 + 1) * 4); float* vs = malloc((N / 256 + 1) * 4);
    for (int64_t i = 0; i < N; ++i) {
      const float x = (float)(0.05 * (urand() - 0.5));
      p[i] = bf(x); master[i] = x; rem[i] = (int16_t)(urand() * 30000 - 15000);
      g[i] = bf((float)(1e-3 * (urand() - 0.5)));
      if (md->md == 0) { ((float*)m)[i] = (float)(1e-4 * (urand() - 0.5)); ((float*)v)[i] = (float)(1e-8 * urand()); }
      else if (md->md == 1) { ((uint16_t*)m)[i] = bf((float)(1e-4 * (urand() - 0.5))); ((uint16_t*)v)[i] = bf((float)(1e-8 * urand())); }
      else { ((uint8_t*)m)[i] = (uint8_t)(urand() * 256); ((uint8_t*)v)[i] = (uint8_t)(urand() * 256); }
    }
    for (int64_t b = 0; b <= N / 256; ++b) { ms[b] = 1e-4f; vs[b] = 1e-8f; }
    mp_step_options o;
    memset(&o, 0, sizeof o);
    o.rule = md->rule;
    o.beta1 = md->rule == MP_RULE_ADAM ? 0.9 : md->rule == MP_RULE_LION ? 0.9 : md->mom;
    o.beta2 = 0.999; o.eps = 1e-8; o.weight_decay = 0.01; o.decoupled = 1;
    o.lr_value = 1e-4f; o.sr_params = md->kind == MP_PV_NONE_SR; o.seed = 7; o.q8_block = 256;
    float step = 10.0f;
    mp_step_tensor t;
    memset(&t, 0, sizeof t);
    t.param = p; t.param_dtype = MP_BF16; t.grad = g; t.grad_dtype = MP_BF16;
    t.master = md->kind == MP_PV_MASTER ? master : NULL;
    t.remainder = md->kind == MP_PV_REMAINDER ? rem : NULL;
    const int32_t fm = md->md == 0 ? MP_FMT_F32 : md->md == 1 ? MP_FMT_BF16 : MP_FMT_Q8S;
    const int32_t fv = md->md == 0 ? MP_FMT_F32 : md->md == 1 ? MP_FMT_BF16 : MP_FMT_Q8U;
    t.exp_avg = m; t.exp_avg_sq = v; t.exp_avg_format = fm; t.exp_avg_sq_format = fv;
    t.exp_avg_scale = md->md == 2 ? ms : NULL; t.exp_avg_sq_scale = md->md == 2 ? vs : NULL;
    t.step = &step; t.n = N; t.sr_stream = 3;
    if (md->rule != MP_RULE_ADAM) { t.exp_avg_sq = NULL; t.exp_avg_sq_scale = NULL; }
    if (!mp_step_call_ok(&t, 0, N, &o)) { printf("%s: bad call\n", md->name); continue; }
    const mp_step_scalars sc = mp_step_scalars_now(&o, &step, 3);
    const mp_rule_scalars rc = mp_rule_scalars_now(&o, &step);
    double row[MP_STS_NCOLS] = {0};
    double r_on[64], r_old[64], r_pipe[64], r_oldc[64];
    const int is_row = md->rule == MP_RULE_ADAM;
    for (int w = 0; w < 2; ++w) mp_kernels__avx512.step(&t, 0, N, &sc, &rc); /* warm-up */
    for (int r = 0; r < R; ++r) {
      double t0 = now();
      mp_kernels__avx512.step(&t, 0, N, &sc, &rc);
      double t1 = now();
      mp_k_step_stats__avx512(&t, 0, N, &sc, &rc, row);
      double t2 = now();
      double t3 = t2, t4 = t2;
      if (is_row) {
        old_fast_step__avx512(&t, 0, N, &sc, &rc, md->kind);
        t3 = now();
        mp_k_fast_step__avx512(&t, 0, N, &sc, &rc, md->kind);
        t4 = now();
        r_old[r] = (t4 - t3) / (t3 - t2);
      }
      r_on[r] = (t2 - t1) / (t1 - t0);
      const double t5 = now();
      mp_k_step_stats_generic__avx512(&t, 0, N, &sc, &rc, row);
      const double t6 = now();
      r_pipe[r] = (t6 - t5) / (t1 - t0);
      if (is_row) { /* the older counted row (its pipeline where it took none) */
        if (!old_fast_step_stats__avx512(&t, 0, N, &sc, &rc, md->kind, row)) {
          mp_k_step_stats_generic__avx512(&t, 0, N, &sc, &rc, row);
        }
        r_oldc[r] = (now() - t6) / (t1 - t0);
      }
    }
    qsort(r_on, R, sizeof(double), cmp);
    qsort(r_pipe, R, sizeof(double), cmp);
    printf("%-55s counted/uncounted %.3f [%.3f, %.3f]  counted pipeline/uncounted %.3f [%.3f, %.3f]", md->name, r_on[R / 2], r_on[R / 4], r_on[3 * R / 4], r_pipe[R / 2], r_pipe[R / 4], r_pipe[3 * R / 4]);
    if (is_row) {
      qsort(r_old, R, sizeof(double), cmp);
      qsort(r_oldc, R, sizeof(double), cmp);
      printf("   uncounted new/old %.3f [%.3f, %.3f]   old counted/uncounted %.3f [%.3f, %.3f]",
             r_old[R / 2], r_old[R / 4], r_old[3 * R / 4], r_oldc[R / 2], r_oldc[R / 4],
             r_oldc[3 * R / 4]);
    }
    printf("\n");
    fflush(stdout);
    free(p); free(g); free(master); free(rem); free(m); free(v); free(ms); free(vs);
  }
  return 0;
}
