/* The fast paths (csrc/core/fast/README.md): every storage mode stepped through the kernel
 * table's step (a hand-fused row where one matches) and through step_generic (the tile pipeline
 * alone), every byte compared, on every ISA path this CPU supports. Built without the fast
 * paths (run.py --no-fast-paths) both are the pipeline and it passes as well. */
#include "test_common.h"

#include "mpext/step.h"
#include "mpext/step_storage.h"
#include "formats/tiles.h"
#include "isa.h"

#include "test_step.h"
#include "mpext/telemetry.h"
#include "telemetry_sums.h" /* the counted rows' error sums: their tolerance */

/* The counted step's entry points of each ISA build (telemetry.c, adam_fused.c; step.c's stub
 * in a build without fast paths): the counted row of a mode (0 where none is kept), the counted
 * pipeline alone, and the uncounted row. */
#define FUSED_STS_DECL(isa)                                                                    \
  int mp_k_fast_step_stats__##isa(const mp_step_tensor* t, int64_t start, int64_t n,           \
                                  const mp_step_scalars* s, const mp_rule_scalars* r, int kind, \
                                  double* row);                                                \
  void mp_k_step_stats_generic__##isa(const mp_step_tensor* t, int64_t start, int64_t n,       \
                                      const mp_step_scalars* s, const mp_rule_scalars* r,      \
                                      double* row);                                            \
  int mp_k_fast_step__##isa(const mp_step_tensor* t, int64_t start, int64_t n,                 \
                            const mp_step_scalars* s, const mp_rule_scalars* r, int kind);
FUSED_STS_DECL(scalar)
#if defined(MP_X86_PATHS)
FUSED_STS_DECL(avx2)
FUSED_STS_DECL(avx512)
#endif

typedef struct fused_counted_fns {
  int (*row)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
             const mp_rule_scalars*, int, double*);
  void (*pipeline)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                   const mp_rule_scalars*, double*);
  int (*uncounted)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                   const mp_rule_scalars*, int);
} fused_counted_fns;

static fused_counted_fns counted_of(mp_isa isa) {
#define FUSED_STS_FNS(isa) \
  { mp_k_fast_step_stats__##isa, mp_k_step_stats_generic__##isa, mp_k_fast_step__##isa }
#if defined(MP_X86_PATHS)
  if (isa == MP_ISA_AVX2) return (fused_counted_fns)FUSED_STS_FNS(avx2);
  if (isa == MP_ISA_AVX512) return (fused_counted_fns)FUSED_STS_FNS(avx512);
#endif
  return (fused_counted_fns)FUSED_STS_FNS(scalar);
#undef FUSED_STS_FNS
}

/* 11n. The hand-fused loops the engine keeps (csrc/core/fast/adam_fused.c) against its tile
 *      pipeline alone (the kernel table's adam_step_generic): every valid storage mode (param
 *      and grad dtype, master / remainder / none with either rounding, fp32 / bf16 / 8-bit
 *      moments, write-back, bf16 moments to nearest, ema) on every ISA path, three steps from
 *      the same random state with NaN/Inf/ties among the values, the range also stepped from
 *      an offset; every byte of every array must agree. The modes without a fused loop check
 *      that the dispatch falls through to the pipeline unchanged. */

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
  int rule; /* MP_RULE_ADAM, or MP_RULE_LION (one moment: exp_avg_sq is not read) */
} fused_mode;

/* Mode number `code` of the 3 * 2 * 5 * 4 * 8 the fast-path tests enumerate (param dtype, grad
 * dtype, storage, moments, write-back/nearest/ema flags) into *fm; 0 for an invalid mode. */
static int mode_of(int code, fused_mode* fm) {
  static const mp_dtype dts[3] = {MP_F32, MP_BF16, MP_F16};
  const int pi = code % 3, gi = code / 3 % 2, kind = code / 6 % 5, mom = code / 30 % 4;
  const int flags = code / 120;
  fm->pt = dts[pi];
  fm->gt = gi ? MP_F32 : fm->pt;
  fm->kind = kind;
  fm->md = mom == 3 ? MP_I8 : mom == 1 ? MP_BF16 : MP_F32;
  fm->vd = mom == 3 ? MP_U8 : mom >= 1 ? MP_BF16 : MP_F32;
  fm->wb = flags & 1;
  fm->nearest = (flags >> 1) & 1;
  fm->ema = flags >> 2;
  fm->rule = MP_RULE_ADAM;
  if ((gi && fm->pt == MP_F32) || (fm->pt == MP_F32) != (kind == MP_PV_F32)) return 0;
  return !(kind == MP_PV_REMAINDER && fm->pt != MP_BF16);
}

/* Whether two states stepped from one start agree in every array (fused_values_agree): param,
 * gradient, master, EMA; a remainder unless both params are NaN (its payload's low half); the
 * moments, and for 8-bit moments their scales and every code of a block whose scale is not NaN
 * (such a block reads as NaN whatever its codes). */
static int states_agree(const fused_state* a, const fused_state* b, mp_dtype pt, mp_dtype gt,
                        mp_dtype md, mp_dtype vd, int n) {
  int same = fused_values_agree(a->p, b->p, pt, n) && fused_values_agree(a->g, b->g, gt, n) &&
             fused_values_agree(a->master, b->master, MP_F32, n) &&
             fused_values_agree(a->ema, b->ema, MP_F32, n);
  for (int i = 0; i < n; ++i) {
    if (!(a_isnan(pt, a_get(a->p, pt, (size_t)i)) && a_isnan(pt, a_get(b->p, pt, (size_t)i))))
      same = same && a->rem[i] == b->rem[i];
  }
  if (md == MP_I8) {
    same = same && fused_values_agree(a->ms, b->ms, MP_F32, 4) &&
           fused_values_agree(a->vs, b->vs, MP_F32, 4);
    for (int i = 0; i < n; ++i) {
      const int k = i / 256;
      if (!isnan(a->ms[k]) || !isnan(b->ms[k]))
        same = same && ((uint8_t*)a->m)[i] == ((uint8_t*)b->m)[i];
      if (!isnan(a->vs[k]) || !isnan(b->vs[k]))
        same = same && ((uint8_t*)a->v)[i] == ((uint8_t*)b->v)[i];
    }
    return same;
  }
  return same && fused_values_agree(a->m, b->m, md, n) && fused_values_agree(a->v, b->v, vd, n);
}

/* Three steps of mode fm from one random state through kt's adam_step and its
 * adam_step_generic, each range split in two; 1 if every value agrees (fused_values_agree). */
/* counted (cf != NULL): st[0] through the counted row (the counted pipeline where the mode has
 * none), st[1] through the counted pipeline alone, st[2] through the uncounted row (step_generic
 * where none); every array of the three must agree, the two rows of counters too: the counts
 * exactly, the error sums (which the counted rows add in another order) to within their
 * rounding, and *rows_taken counts the pieces a counted row took, *uncounted_taken those an
 * uncounted one did. */
typedef struct fused_counted {
  fused_counted_fns f;
  int rows_taken, uncounted_taken;
  int finite; /* no NaN/Inf inputs: the error sums are then finite and compared as numbers */
} fused_counted;

static int fused_same_(const mp_kernel_table* kt, const fused_mode* fm, uint64_t s, int variant,
                       fused_counted* cf) {
  enum { N = 3 * 256 + 77 };
  const mp_dtype pt = fm->pt, gt = fm->gt, md = fm->md, vd = fm->vd;
  const int ncopy = cf != NULL ? 3 : 2;
  double row[2][MP_STS_NCOLS];
  memset(row, 0, sizeof row);
  fused_state st[3];
  fused_alloc(&st[0], N);
  fused_alloc(&st[1], N);
  fused_alloc(&st[2], N);
  for (int i = 0; i < N; ++i) {
    const double u = (double)(splitmix64(&s) >> 11) * 0x1p-53 - 0.5;
    float gv = (float)(1e-3 * (u + 0.1));
    /* 8-bit moments: the first two blocks finite, so that their new scales are too (a NaN
     * anywhere in a block makes its reference NaN), the second with values near 2^-100 (the
     * encode's scale is then two fp32 factors); the third finite for its first 64 (a NaN
     * after a vector loop's chunks) */
    const int specials = (cf == NULL || !cf->finite) && (md != MP_I8 || i >= 576);
    if (md == MP_I8 && i >= 256 && i < 512) gv *= 1e-27f;
    if (specials && i % 101 == 7) gv = NAN;
    if (specials && i % 103 == 9) gv = -INFINITY;
    /* Lion keeps a param whose update's sign is 0 (a NaN grad) where there is no weight decay
     * (variant 5): its ties below stay ties, for the master's tie rule */
    if (specials && fm->rule == MP_RULE_LION && i % 16 == 3) gv = NAN;
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
  for (int c = 1; c < 3; ++c) {
    memcpy(st[c].p, st[0].p, N * 4);
    memcpy(st[c].g, st[0].g, N * 4);
    memcpy(st[c].m, st[0].m, N * 4);
    memcpy(st[c].v, st[0].v, N * 4);
    memcpy(st[c].master, st[0].master, N * 4);
    memcpy(st[c].ema, st[0].ema, N * 4);
    memcpy(st[c].rem, st[0].rem, N * 2);
    memcpy(st[c].ms, st[0].ms, 16);
    memcpy(st[c].vs, st[0].vs, 16);
  }
  mp_step_options o;
  memset(&o, 0, sizeof o);
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = fm->rule == MP_RULE_LION && variant == 5 ? 0.0 : 0.01;
  o.decoupled = (variant & 1) == 0;
  o.maximize = (variant % 7) == 3;
  o.lr_value = 1e-3f;
  o.unscale_grads = fm->wb;
  o.sr_params = fm->kind == MP_PV_NONE_SR;
  o.moments_nearest = fm->nearest;
  o.seed = s;
  o.q8_block = 256;
  o.rule = fm->rule;
  o.ema_decay = fm->ema ? 0.99 : 0.0; /* 0: what a group without an ema passes */
  float step[3] = {0.0f, 0.0f, 0.0f};
  for (int it = 0; it < 3; ++it) {
    const float inv = it == 1 ? 2.0f : 0.5f;
    const mp_step_scalars sc = mp_step_scalars_of(&o, step[0], inv, 5u);
    const mp_rule_scalars rc = mp_rule_scalars_of(&o, 1e-3f, step[0]);
    for (int c = 0; c < ncopy; ++c) {
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
      /* Lion's rows draw at the shard's positions: a shard across 2^32 (the engine cuts it
       * there, mp_sr_piece) */
      t.offset = fm->rule == MP_RULE_LION ? ((int64_t)1 << 32) - 512 : 0; /* whole blocks */
      /* two ranges: [0, 256) and the rest, as threads would split it */
      const int64_t r0[2] = {0, 256}, rn[2] = {256, N - 256};
      for (int h = 0; h < 2; ++h) {
        if (cf == NULL) {
          (c == 0 ? kt->step : kt->step_generic)(&t, r0[h], rn[h], &sc, &rc);
        } else if (c == 0) {
          const int took = cf->f.row(&t, r0[h], rn[h], &sc, &rc, fm->kind, row[0]);
          if (!took) cf->f.pipeline(&t, r0[h], rn[h], &sc, &rc, row[0]);
          cf->rows_taken += took;
        } else if (c == 1) {
          cf->f.pipeline(&t, r0[h], rn[h], &sc, &rc, row[1]);
        } else {
          const int took = cf->f.uncounted(&t, r0[h], rn[h], &sc, &rc, fm->kind);
          if (!took) kt->step_generic(&t, r0[h], rn[h], &sc, &rc);
          cf->uncounted_taken += took;
        }
      }
      step[c] += 1.0f;
    }
  }
  int same = states_agree(&st[0], &st[1], pt, gt, md, vd, N);
  if (cf != NULL) { /* the counted row's arrays against the uncounted row's too */
    same = same && states_agree(&st[0], &st[2], pt, gt, md, vd, N);
    /* the counters: the counts exactly, every element counted; but "unmoved" (the 16-bit
     * param kept its bits) of a NaN param compares NaN bits, which are not specified
     * (fused_values_agree): it may differ by one per NaN param and step. The sums (NaN as NaN)
     * add the same 3N non-negative terms, the pipeline in double, a row in fp32 runs of
     * MP_STS_RUN terms then in double: within mp_sts_row_sum_tol(3N) of each other's larger
     * (telemetry_sums.h derives it) */
    int nan_params = 0;
    for (int i = 0; i < N; ++i) nan_params += a_isnan(pt, a_get(st[0].p, pt, (size_t)i));
    const double sum_tol = mp_sts_row_sum_tol(3.0 * N);
    for (int j = 0; j < MP_STS_NCOLS; ++j) {
      const int is_sum = j == MP_STS_M_ERR || j == MP_STS_M_ABS || j == MP_STS_V_ERR ||
                         j == MP_STS_V_ABS || j == MP_STS_EMA_LAG || j == MP_STS_EMA_ABS;
      if (j == MP_STS_UNMOVED) {
        same = same && fabs(row[0][j] - row[1][j]) <= 3.0 * nan_params;
        same = same && (nan_params > 0 || row[0][j] == row[1][j]);
      } else if (is_sum) {
        const double big = fmax(fabs(row[0][j]), fabs(row[1][j]));
        same = same && (fabs(row[0][j] - row[1][j]) <= sum_tol * big ||
                        (isnan(row[0][j]) && isnan(row[1][j])));
      } else {
        same = same && (memcmp(&row[0][j], &row[1][j], sizeof(double)) == 0 ||
                        (isnan(row[0][j]) && isnan(row[1][j])));
      }
    }
    same = same && row[0][MP_STS_ELEMS] == 3.0 * N;
    /* finite inputs: the bf16 and 8-bit moments' sums are finite and not all zero, so that
     * the comparison above compared numbers */
    for (int j = MP_STS_M_ERR; cf->finite && j <= MP_STS_V_ABS; ++j) {
      const mp_dtype d = j < MP_STS_V_ERR ? md : vd;
      if (d == MP_BF16 || d == MP_I8 || d == MP_U8) {
        same = same && isfinite(row[0][j]) && row[0][j] > 0.0;
      }
    }
  }
  fused_free(&st[0]);
  fused_free(&st[1]);
  fused_free(&st[2]);
  return same;
}

static int fused_same(const mp_kernel_table* kt, const fused_mode* fm, uint64_t s, int variant) {
  return fused_same_(kt, fm, s, variant, NULL);
}

static void test_adam_fused_vs_generic(uint64_t seed0) {
  group g;
  g_begin(&g, "adam: hand-fused loops = the tile pipeline, every storage mode and ISA path");
  int modes = 0;
  for (int k = 0; k < g_nisa; ++k) {
    const mp_kernel_table* kt = kernels_of(g_isas[k]);
    /* every valid mode: param and grad dtype, storage, moments (fp32, bf16, mixed, 8-bit),
     * write-back, nearest, ema */
    for (int code = 0; code < 3 * 2 * 5 * 4 * 8; ++code) {
      const int pi = code % 3, gi = code / 3 % 2, kind = code / 6 % 5;
      fused_mode fm;
      if (!mode_of(code, &fm)) continue;
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

/* The modes that must have a counted row in AdamW's usual case on the AVX2 and AVX-512 paths
 * (adam_fused.c's MP_ADAM_COUNTED_ROWS, the modes AdamW commonly runs): a bf16 param and grad
 * with a master
 * (fp32 or 8-bit moments), a remainder or none with stochastic rounding (fp32, bf16 or 8-bit
 * moments), none with round to nearest (fp32 moments); no ema, stochastic moments; where an
 * uncounted row exists (8-bit with a master has no write-back row). And fp32 params with fp32
 * moments, which have nothing to count but their elements. */
static int counted_expected(const fused_mode* fm, mp_isa isa) {
  if (fm->ema || fm->nearest) return 0;
  if (fm->pt == MP_F32) return fm->md == MP_F32 && fm->vd == MP_F32;
  if (fm->pt != MP_BF16 || fm->gt != MP_BF16 || isa == MP_ISA_SCALAR) return 0;
  const int f32 = fm->md == MP_F32 && fm->vd == MP_F32;
  const int bf16 = fm->md == MP_BF16 && fm->vd == MP_BF16;
  const int q8 = fm->md == MP_I8;
  switch (fm->kind) {
    case MP_PV_MASTER: return f32 || (q8 && !fm->wb);
    case MP_PV_REMAINDER: case MP_PV_NONE_SR: return f32 || bf16 || q8;
    case MP_PV_NONE_RNE: return f32;
    default: return 0;
  }
}

/* 11o. The counted rows (mp_step_stats takes a mode's counted row where one is kept: its loop
 *      counting in its registers, adam_fused.c) against the counted pipeline alone
 *      (telemetry.c) and the uncounted row: every valid mode, AdamW's usual case and Adam's, on
 *      every ISA path; every array agrees with both, the counters with the pipeline's (the
 *      counts exactly, the sums to their rounding); a counted row is taken only where an
 *      uncounted one is, and is taken by every mode of counted_expected in AdamW's usual
 *      case where the fast paths are built (none is, without them). */
static int fast_paths_built(void);

static void test_counted_rows(uint64_t seed0) {
  group g;
  const int built = fast_paths_built();
  g_begin(&g, "telemetry: counted rows = the counted pipeline, every storage mode and ISA path");
  for (int k = 0; k < g_nisa; ++k) {
    const mp_kernel_table* kt = kernels_of(g_isas[k]);
    fused_counted cf = {counted_of(g_isas[k]), 0, 0, 0};
    for (int code = 0; code < 3 * 2 * 5 * 4 * 8; ++code) {
      const int pi = code % 3, gi = code / 3 % 2, kind = code / 6 % 5, mom = code / 30 % 4;
      const int flags = code / 120;
      fused_mode fm;
      if (!mode_of(code, &fm)) continue;
      /* the rows are bf16 or fp32 params: fp16 modes run the pipeline both ways (one check) */
      if (fm.pt == MP_F16 && (flags != 0 || mom != 0)) continue;
      const uint64_t s = seed0 ^ ((uint64_t)(code + 1) * 0xD1B54A32D192ED03ull);
      /* AdamW's usual case (the vector loops), then Adam, with NaN/Inf inputs; then AdamW's
       * without (where the error sums are numbers: Adam's takes no counted row but fp32's) */
      for (int j = 0; j < 3; ++j) {
        const int rows0 = cf.rows_taken, unc0 = cf.uncounted_taken;
        cf.finite = j == 2;
        g.count++;
        g_check(&g, fused_same_(kt, &fm, s, j != 1 ? 0 : 2 * code + 1, &cf),
                "[%s] param %s grad %s storage %d moments %d/%d wb %d nearest %d ema %d %s%s: "
                "the counted row differs from the counted pipeline or the uncounted row",
                mp_isa_name(g_isas[k]), U_NAME[pi], U_NAME[gi ? 0 : pi], kind, (int)fm.md,
                (int)fm.vd, fm.wb, fm.nearest, fm.ema, j == 1 ? "adam" : "adamw",
                cf.finite ? ", finite" : "");
        const int rows = cf.rows_taken - rows0, unc = cf.uncounted_taken - unc0;
        g.count++;
        g_check(&g,
                rows <= unc &&
                    (j == 1 || !built || !counted_expected(&fm, g_isas[k]) ||
                     (rows > 0 && rows == unc)),
                "[%s] param %s grad %s storage %d moments %d/%d wb %d %s: %d pieces took a "
                "counted row where %d took an uncounted one", mp_isa_name(g_isas[k]), U_NAME[pi],
                U_NAME[gi ? 0 : pi], kind, (int)fm.md, (int)fm.vd, fm.wb, j == 1 ? "adam" : "adamw",
                rows, unc);
      }
    }
    printf("      [%s] %d pieces through counted rows\n", mp_isa_name(g_isas[k]), cf.rows_taken);
  }
  g_end(&g);
}

/* 11p. Lion's rows (csrc/core/fast/lion_fused.c) against the tile pipeline alone: every valid
 *      storage mode with Lion's one moment (fp32, bf16 either rounding, 8-bit), on every ISA
 *      path, maximized or not, without weight decay (ties kept for the master's tie rule),
 *      a shard whose positions cross 2^32, as 11n compares Adam's; and the dispatch takes a row for
 *      exactly the modes lion_fused.c keeps (its MP_LION_FUSED_ROWS: bf16 param and grad, an
 *      fp32 moment, no write-back or ema, every bf16 param storage), on the AVX-512 path only, in a build with the fast
 *      paths (which Adam's master row, kept on every path, tells apart from one without). */

/* Whether the fast-path dispatch of ISA path isa takes a row for mode fm (a piece of no
 * elements: nothing is read or written). */
static int row_kept(mp_isa isa, const fused_mode* fm) {
  mp_step_options o;
  memset(&o, 0, sizeof o);
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.lr_value = 1e-3f;
  o.decoupled = 1;
  o.unscale_grads = fm->wb;
  o.sr_params = fm->kind == MP_PV_NONE_SR;
  o.moments_nearest = fm->nearest;
  o.q8_block = 256;
  o.rule = fm->rule;
  o.ema_decay = fm->ema ? 0.99 : 0.0;
  /* a scale other than 1: write-back asked for is write-back done */
  const mp_step_scalars sc = mp_step_scalars_of(&o, 0.0f, 0.5f, 5u);
  const mp_rule_scalars rc = mp_rule_scalars_of(&o, 1e-3f, 0.0f);
  float one = 0.0f, step = 0.0f;
  mp_step_tensor t;
  memset(&t, 0, sizeof t);
  t.param = &one;
  t.param_dtype = fm->pt;
  t.grad = &one;
  t.grad_dtype = fm->gt;
  t.master = fm->kind == MP_PV_MASTER ? &one : NULL;
  t.remainder = fm->kind == MP_PV_REMAINDER ? (int16_t*)&one : NULL;
  t.exp_avg = &one;
  t.exp_avg_sq = &one;
  t.exp_avg_format = fmt_of(fm->md);
  t.exp_avg_sq_format = fmt_of(fm->vd);
  t.exp_avg_scale = t.exp_avg_sq_scale = &one;
  t.ema = fm->ema ? &one : NULL;
  t.step = &step;
  return counted_of(isa).uncounted(&t, 0, 0, &sc, &rc, fm->kind);
}

/* Whether this build has the fast paths (MPEXT_FAST_PATHS=0 / tests/c/run.py --no-fast-paths
 * builds without them): Adam's plainest row, kept on every ISA path, is found. */
static int fast_paths_built(void) {
  const fused_mode adam_master = {MP_BF16, MP_BF16, MP_F32, MP_F32, MP_PV_MASTER, 0, 0, 0,
                                  MP_RULE_ADAM};
  return row_kept(MP_ISA_SCALAR, &adam_master);
}

static void test_lion_fused_vs_generic(uint64_t seed0) {
  group g;
  g_begin(&g, "lion: hand-fused loops = the tile pipeline, every storage mode and ISA path");
  const int fast_built = fast_paths_built();
  int modes = 0;
  for (int k = 0; k < g_nisa; ++k) {
    const mp_kernel_table* kt = kernels_of(g_isas[k]);
    int kept = 0, want = 0;
    for (int code = 0; code < 3 * 2 * 5 * 4 * 8; ++code) {
      fused_mode fm;
      if (!mode_of(code, &fm) || (fm.vd == MP_BF16 && fm.md == MP_F32)) continue; /* = fp32 */
      fm.rule = MP_RULE_LION;
      const int has_row = row_kept(g_isas[k], &fm);
      kept += has_row;
      /* (nearest rounds bf16 moments only: an fp32 one takes its row either way) */
      want += fm.pt == MP_BF16 && fm.gt == MP_BF16 && !fm.wb && !fm.ema && fm.md == MP_F32;
      const uint64_t s = seed0 ^ ((uint64_t)(code + 1) * 0xA0761D6478BD642Full);
      /* 3 maximizes; 5 has no weight decay, for the tie rule of a master or remainder; a mode
       * without a row (the pipeline both ways: the fall-through checked) once */
      const int tie_kind = fm.kind == MP_PV_MASTER || fm.kind == MP_PV_REMAINDER;
      const int nvar = !has_row ? 1 : tie_kind ? 3 : 2;
      for (int j = 0; j < nvar; ++j) {
        const int variant = j == 0 ? 0 : 2 * j + 1;
        g.count++;
        g_check(&g, fused_same(kt, &fm, s, variant),
                "[%s] param %s grad %s storage %d moment %d wb %d nearest %d ema %d variant %d: the "
                "lion row differs from the pipeline (row kept: %d)", mp_isa_name(g_isas[k]),
                U_NAME[code % 3], U_NAME[code / 3 % 2 ? 0 : code % 3], fm.kind, (int)fm.md,
                fm.wb, fm.nearest, fm.ema, variant, has_row);
      }
      modes++;
    }
    g.count++;
    if (g_isas[k] == MP_ISA_AVX512 && fast_built) {
      /* four rows, each taken with nearest 0 and 1 */
      g_check(&g, kept == want && want == 8,
              "[%s] the dispatch takes %d lion modes, lion_fused.c keeps %d (want 8)",
              mp_isa_name(g_isas[k]), kept, want);
    } else {
      g_check(&g, kept == 0, "[%s] %d lion modes took a row where none is built",
              mp_isa_name(g_isas[k]), kept);
    }
    printf("      [%s] %d lion modes through rows\n", mp_isa_name(g_isas[k]), kept);
  }
  printf("      %d modes x paths compared\n", modes);
  g_end(&g);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_adam_fused_vs_generic(o->seed);
  test_lion_fused_vs_generic(o->seed);
  test_counted_rows(o->seed);
}
