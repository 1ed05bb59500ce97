/* Where the CPU engine's pipeline spends a Lion step's time, stage by stage: each codec of
 * csrc/core/formats/tiles.h (and the Lion rule's loop, as step.c generates it) timed alone over
 * one tile held in L1, many times over, one core. A stage's ns per element here is its
 * instruction cost with no memory stall, so the sum over a mode's stages says how far that mode
 * can be from its bytes bound whatever the memory does (csrc/core/fast/README.md, "Lion").
 *
 *   gcc -std=c11 -O3 -fno-math-errno -fno-trapping-math -DMP_X86_PATHS=1 \
 *       -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mprefer-vector-width=512 \
 *       -Icsrc/include -Icsrc/core tools/lion_stage_profile.c -lm -o /tmp/lsp
 *   taskset -c 1 /tmp/lsp [repeats=200000]
 * Times are the thread's CPU time; each line is the median of 7 timings. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "formats/tiles.h"
#include "mpext/step.h"

#include "ab_clock.h"

#define N MP_TILE
static _Alignas(64) float g[N], p[N], m[N], master[N];
static _Alignas(64) uint16_t gq[N], pq[N], mq[N];
static _Alignas(64) int16_t rem[N];
static _Alignas(64) uint8_t mc[N];
static _Alignas(64) uint32_t rb[N];
static float ms;
static mp_step_scalars S;
static mp_lion_scalars L;
static long reps;

/* Keeps the compiler from proving a repeat's work dead. */
static void sink(void) { __asm__ volatile("" ::: "memory"); }

#define TIME(name, body)                                                                  \
  do {                                                                                    \
    double ts[7];                                                                         \
    for (int k = 0; k < 7; ++k) {                                                         \
      const double t0 = now();                                                            \
      for (long r = 0; r < reps; ++r) {                                                   \
        body;                                                                             \
        sink();                                                                           \
      }                                                                                   \
      ts[k] = now() - t0;                                                                 \
    }                                                                                     \
    qsort(ts, 7, sizeof(double), cmp);                                                    \
    printf("%-34s %.3f ns/elem\n", name, ts[3] * 1e9 / (double)reps / (double)N);        \
  } while (0)

static void lion_tile(const float* restrict gg, float* restrict pp, float* restrict mm) {
  const mp_lion_scalars s = L;
#pragma GCC ivdep
  for (uint32_t i = 0; i < N; ++i) {
    float mi = mm[i], vi = 0.0f;
    pp[i] = mp_lion_element(gg[i], pp[i], &mi, &vi, &s);
    mm[i] = mi;
  }
}

int main(int argc, char** argv) {
  reps = argc > 1 ? atol(argv[1]) : 200000;
  for (int i = 0; i < N; ++i) {
    const float x = 0.02f + 1e-5f * (float)(i % 2001 - 1000);
    const float gv = 1e-3f * (float)((i * 7919) % 1000 - 500) / 500.0f + 1e-6f;
    master[i] = p[i] = x;
    g[i] = gv;
    m[i] = gv * 0.1f;
    gq[i] = (uint16_t)(mp_fmt_bits(gv) >> 16);
    pq[i] = (uint16_t)(mp_fmt_bits(x) >> 16);
    mq[i] = (uint16_t)(mp_fmt_bits(m[i]) >> 16);
  }
  const mp_step_options o = {.beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.01, .decoupled = 1,
                             .lr_value = 1e-4f, .seed = 7, .q8_block = 256,
                             .rule = MP_RULE_LION};
  float stp = 1.0f;
  S = mp_step_scalars_now(&o, &stp, 0);
  L = mp_rule_scalars_now(&o, &stp).u.lion;
  mp_q8_encode_block_m(mc, m, N, &ms, S.key_q8, 0, 0, 0);
  const mp_pv_tile at = {pq, master, rem};
  printf("tile %d elements, %ld repeats\n", N, reps);
  TIME("grad decode bf16 (unscale)", mp_grad_decode(g, gq, MP_BF16, N, &S));
  TIME("param decode: remainder join", mp_pv_decode(MP_PV_REMAINDER, MP_BF16, &at, p, N));
  TIME("param decode: bf16 widen", mp_pv_decode(MP_PV_NONE_SR, MP_BF16, &at, p, N));
  TIME("moment decode: bf16", mp_mom_decode(MP_BF16, mq, m, N));
  TIME("moment decode: 8-bit", mp_q8_decode_tile_m(mc, m, N, mp_q8_ref_m_of(ms)));
  TIME("rule: lion", lion_tile(g, p, m));
  TIME("param encode: master (bf16 RNE)", mp_pv_encode(MP_PV_MASTER, MP_BF16, &at, p, N, 0, 0, 0));
  TIME("param encode: remainder", mp_pv_encode(MP_PV_REMAINDER, MP_BF16, &at, p, N, 0, 0, 0));
  TIME("param encode: RNE", mp_pv_encode(MP_PV_NONE_RNE, MP_BF16, &at, p, N, 0, 0, 0));
  TIME("param encode: SR", mp_pv_encode(MP_PV_NONE_SR, MP_BF16, &at, p, N, S.key_param, 0, 0));
  TIME("moment draw (bf16 SR bits)", mp_mom_draw(rb, N, S.key_moments, 0, 0));
  TIME("moment encode: bf16 SR", mp_mom_encode_bf16(mq, m, N, rb, 0, 0));
  TIME("moment encode: bf16 RNE", mp_mom_encode_bf16(mq, m, N, rb, 0, 1));
  TIME("moment encode: 8-bit SR (block)", mp_q8_encode_block_m(mc, m, N, &ms, S.key_q8, 0, 0, 0));
  TIME("moment encode: 8-bit RNE (block)", mp_q8_encode_block_m(mc, m, N, &ms, S.key_q8, 0, 0, 1));
  return 0;
}
