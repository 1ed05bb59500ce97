/* The step's formats on their own (csrc/core/formats/tiles.h, mpext/step_storage.h,
 * mpext/formats/q8.h), compiled into the test as baseline code (the ISA builds run the same
 * source; the test_step_*.c files compare every path bit for bit):
 *   - the 8-bit moment codec against the format restated in double (test_common.h): every
 *     code's value, reference exponents, nearest and stochastic encode by exhaustive search;
 *   - the bf16 remainder (param + remainder = the fp32 master) over all 2^32 fp32 patterns;
 *   - the engine's codecs: every bf16/fp16 pattern, the gradient decode and write-back, the
 *     param storages, the bf16 moments' shared draw, every 8-bit code.
 * No test here calls the step, so run.py --no-fast-paths leaves this file out. */
#include "test_common.h"

#include "mpext/step_storage.h"
#include "formats/tiles.h"

/* 11k. The 8-bit codec functions (mpext/formats/q8.h) against test_common.h's restatement of the
 *      format, exhaustively over codes and on boundary and random values (the whole step with
 *      8-bit moments: test_step_q8.c). */
static uint32_t q8_encode_kernel(const q8_fmt* f, float x, uint32_t ea, uint32_t r16, int nearest) {
  return f->is_signed ? mp_q8_encode_m(x, ea, r16, nearest) : mp_q8_encode_v(x, ea, r16, nearest);
}

static void test_q8_codec(uint64_t seed0) {
  uint64_t s = seed0 ^ 0x0C0DEC8u;
  const q8_fmt* fmts[2] = {&Q8_M, &Q8_V};
  group g;
  g_begin(&g, "8-bit moment codec: decode of every code, reference exponents, encode to nearest "
          "and stochastic against exhaustive search");
  for (int k = 0; k < 2; ++k) {
    const q8_fmt* f = fmts[k];
    const int lo_field = 1 << f->ebits;
    const int eas[] = {lo_field, lo_field + 1, 100, 127, 140, 200, 254};
    int bad = 0;
    /* decode: every code at each reference, exact */
    for (size_t j = 0; j < sizeof eas / sizeof eas[0]; ++j) {
      const float r = mp_q8_ref((uint32_t)eas[j]);
      for (int c = 0; c < 256 && bad < 5; ++c) {
        const float got =
            f->is_signed ? mp_q8_decode_m((uint8_t)c, r) : mp_q8_decode_v((uint8_t)c, r);
        const double want = q8_decode_ref(f, c, eas[j]);
        g.count++;
        if ((double)got != want || !signbit(got) != !signbit(want)) {
          bad++;
          g_fail(&g, "%s decode code %02x ea %d: %a, want %a", k ? "v" : "m", c, eas[j],
                 (double)got, want);
        }
      }
    }
    const float r255 = mp_q8_ref(255u);
    g_check(&g, isnan(f->is_signed ? mp_q8_decode_m(3, r255) : mp_q8_decode_v(3, r255)),
            "a non-finite block decodes to NaN");
    /* reference exponent of an absmax: boundaries and random values */
    for (int i = 0; i < 20000 && bad < 5; ++i) {
      uint32_t a;
      if (i < 256) {
        /* around the round-up point of binade i: 2 - 2^-M and its neighbours */
        const uint32_t top =
            ((uint32_t)(i % 254 + 1) << 23) | (((1u << f->mbits) - 1u) << (23 - f->mbits));
        a = top + (uint32_t)(i % 3) - 1u;
      } else if (i < 260) {
        a = i == 256 ? 0u : i == 257 ? 1u : i == 258 ? 0x7F800000u : 0x7FC00000u;
      } else {
        a = (uint32_t)splitmix64(&s) & 0x7FFFFFFFu;
      }
      const uint32_t got = mp_q8_ref_exp(a, (uint32_t)f->ebits, (uint32_t)f->mbits);
      const int want = q8_ref_exp_ref(f, (double)f32_of(a));
      g.count++;
      if (!(want == 255 ? got >= 255u : got == (uint32_t)want)) {
        bad++;
        g_fail(&g, "%s ref_exp of %08x: %u, want %d", k ? "v" : "m", a, got, want);
      }
    }
    /* encode: every code value, the midpoints and their neighbours, random values in and
     * below the range, each at several references, both roundings */
    for (size_t j = 0; j < sizeof eas / sizeof eas[0] && bad < 5; ++j) {
      const int ea = eas[j];
      for (int i = 0; i < 6000 && bad < 5; ++i) {
        float x;
        const int c = i % (q8_ncodes(f) - 1);
        const int kind = (i / (q8_ncodes(f) - 1)) % 4;
        if (i < 4 * (q8_ncodes(f) - 1)) {
          const double v = kind == 0 ? q8_value(f, c, ea)
                                     : 0.5 * (q8_value(f, c, ea) + q8_value(f, c + 1, ea));
          x = (float)v;
          if (kind == 2) x = nextafterf(x, 0.0f);
          if (kind == 3) x = nextafterf(x, INFINITY);
        } else {
          /* anywhere from far below the smallest code to the top binade */
          const int e = ea - 127 - (int)(splitmix64(&s) % (uint64_t)((1 << f->ebits) + 12));
          x = (float)ldexp(1.0 + (double)(splitmix64(&s) >> 11) * 0x1p-53, e);
          if (!(fabs((double)x) <= q8_value(f, q8_ncodes(f) - 1, ea))) {
            x = (float)q8_value(f, 5, ea);
          }
        }
        if (f->is_signed && (splitmix64(&s) & 1u)) x = -x;
        const uint32_t r16 = (uint32_t)splitmix64(&s) & 0xFFFFu;
        for (int nearest = 0; nearest < 2; ++nearest) {
          const uint32_t got = q8_encode_kernel(f, x, (uint32_t)ea, r16, nearest);
          const int want = q8_encode_full_ref(f, x, ea, r16, nearest);
          g.count++;
          if (got != (uint32_t)want) {
            bad++;
            g_fail(&g, "%s encode %a at ea %d r16 %04x %s: %02x, want %02x", k ? "v" : "m",
                   (double)x, ea, r16, nearest ? "nearest" : "stochastic", got, want);
          }
        }
      }
    }
    /* stochastic rounding is unbiased: a value 3/8 of the way between two codes rounds up for
     * exactly 3/8 of the 2^16 random words */
    {
      const int ea = 127;
      const double v0 = q8_value(f, 20, ea), v1 = q8_value(f, 21, ea);
      const float x = (float)(v0 + 0.375 * (v1 - v0));
      int ups = 0;
      for (uint32_t r16 = 0; r16 < 65536u; ++r16) ups += q8_encode_kernel(f, x, ea, r16, 0) == 21u;
      g_check(&g, ups == 24576, "%s: %d of 65536 random words round up, want 24576",
              k ? "v" : "m", ups);
    }
  }
  g_end(&g);
}

/* 11j. The split of a bf16 param's master into param and remainder, over all 2^32 fp32 bit
 *      patterns: the param is the round to nearest even; join(param, remainder) is the master
 *      exactly, except for the 2^15 values exactly halfway above an even bf16, which are stored
 *      one ulp lower (and give the same param); a NaN stays a NaN. */
static void test_bf16_remainder_all(void) {
  group g;
  g_begin(&g, "bf16 remainder split/join over all 2^32 fp32 patterns");
  uint64_t exact = 0, lowered = 0, nans = 0;
  int bad = 0;
  for (uint64_t k = 0; k <= 0xFFFFFFFFull; ++k) {
    const uint32_t x = (uint32_t)k;
    const uint32_t st = mp_bf16_master_bits(x);
    const uint16_t p = mp_bf16_rne_bits(st);
    const uint32_t back = mp_bf16_join(p, mp_bf16_remainder(st, p));
    const int is_nan = (x & 0x7FFFFFFFu) > 0x7F800000u;
    int ok;
    if (is_nan) {
      ok = (back & 0x7FFFFFFFu) > 0x7F800000u;
      nans++;
    } else if (st != x) {
      ok = st == x - 1u && (x & 0x1FFFFu) == 0x8000u && back == st && p == mp_bf16_rne_bits(x);
      lowered++;
    } else {
      ok = back == x && p == mp_bf16_rne_bits(x);
      exact++;
    }
    if (!ok && bad++ < 5) {
      g_fail(&g, "x %08x: stored %08x param %04x joined %08x", x, st, p, back);
    }
  }
  g.count += 1;
  /* low 17 bits 0x08000: 2^15 patterns, less the 2 x 2^6 of them with exponent 0xFF */
  g_check(&g, lowered == 32768u - 128u, "%" PRIu64 " values stored one ulp lower", lowered);
  printf("      bf16 remainders: %" PRIu64 " masters exact, %" PRIu64 " ties stored one ulp "
         "lower, %" PRIu64 " NaNs\n", exact, lowered, nans);
  g_end(&g);
}

/* 11m. The engine's codecs (csrc/core/formats.h), each on its own, against this suite's
 *      references: every bf16 and fp16 pattern widened (the field decoder) and narrowed back
 *      to nearest even (the RNE reference: the same pattern, a NaN quiet with its sign); the
 *      gradient decode (the product in double, rounded once) and its write-back; the param
 *      storages (master with the tie rule restated, remainder, nearest, stochastic with the
 *      documented generator at each element's position) decoded back to what they stored; the
 *      bf16 moment encode with the shared draw (exp_avg the low 16 bits, exp_avg_sq the high);
 *      every 8-bit code of both formats decoded and a block of them encoded back to the same
 *      codes and scale. Compiled into the test as baseline code: the ISA builds run the same
 *      source, and the test_step_*.c files compare every path bit for bit. */

/* The stored master of fp32 bits x, restated from adam.h: a finite value whose low 17 bits
 * are 0x08000 is stored one ulp lower. */
static uint32_t ref_master_stored(uint32_t x) {
  return ((x & 0x1FFFFu) == 0x08000u && (x & 0x7F800000u) != 0x7F800000u) ? x - 1u : x;
}

static int same_rne(uint32_t u, uint32_t got, const fmt* f) {
  int nan;
  const uint32_t want = ref_rne(u, f, &nan);
  return nan ? nan_result_problem(u, got, f) == NULL : got == want;
}

static void test_codecs(uint64_t seed0) {
  uint64_t s = seed0 ^ 0xC0DEC5ull;
  enum { N = 65536 };
  float* x = xmalloc(N * sizeof(float));
  float* y = xmalloc(N * sizeof(float));
  double* yd = xmalloc(MP_TILE * sizeof(double));
  uint16_t* h = xmalloc(N * sizeof(uint16_t));
  uint16_t* h2 = xmalloc(N * sizeof(uint16_t));
  int16_t* rem = xmalloc(N * sizeof(int16_t));
  uint32_t* r = xmalloc(N * sizeof(uint32_t));
  group g;

  g_begin(&g, "codecs: every bf16/fp16 pattern widened and narrowed back");
  const fmt* fmts[2] = {&BF16, &FP16};
  const mp_dtype dts[2] = {MP_BF16, MP_F16};
  for (int k = 0; k < 2; ++k) {
    for (uint32_t i = 0; i < N; ++i) h[i] = (uint16_t)i;
    mp_fmt_widen(x, h, N, dts[k]);
    const mp_pv_tile at = {h2, NULL, NULL};
    mp_pv_encode(MP_PV_NONE_RNE, dts[k], &at, x, N, 0, 0, 0);
    for (uint32_t i = 0; i < N; ++i) {
      const double want = decode(i, fmts[k]);
      const int nan = is_nan_fmt(i, fmts[k]);
      g.count++;
      if (nan ? !isnan(x[i]) || !!signbit(x[i]) != (int)(i >> 15)
              : (double)x[i] != want || !!signbit(x[i]) != !!signbit(want)) {
        g_fail(&g, "%s %04x widened to %08x", k ? "fp16" : "bf16", i, bits_of(x[i]));
      }
      g_check(&g, nan ? nan_result_problem(bits_of(x[i]), h2[i], fmts[k]) == NULL : h2[i] == i,
              "%s %04x narrowed back to %04x", k ? "fp16" : "bf16", i, h2[i]);
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: gradient decode (unscale) and write-back, fp32/bf16/fp16");
  const float invs[3] = {0.5f, 1.0f / 3.0f, 65536.0f};
  for (int dt = 0; dt < 3; ++dt) {
    const mp_dtype t = dt == 0 ? MP_F32 : dts[dt - 1];
    for (int inv_k = 0; inv_k < 3; ++inv_k) {
      for (int wb = 0; wb < 2; ++wb) {
        mp_step_scalars sc;
        memset(&sc, 0, sizeof sc);
        sc.inv_scale = invs[inv_k];
        sc.write_grad = wb;
        float* gf = (float*)r; /* the fp32 grads live in r */
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          const uint32_t u = (uint32_t)splitmix64(&s);
          if (t == MP_F32) gf[i] = f32_of(u); else h[i] = (uint16_t)u;
        }
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          yd[i] = t == MP_F32 ? (double)gf[i] : decode(h[i], t == MP_BF16 ? &BF16 : &FP16);
        }
        const float* gd = mp_grad_decode(x, t == MP_F32 ? (void*)gf : (void*)h, t, MP_TILE, &sc);
        for (uint32_t i = 0; i < MP_TILE; ++i) {
          const float want = (float)(yd[i] * (double)sc.inv_scale);
          g.count++;
          if (isnan(want) ? !isnan(gd[i]) : bits_of(gd[i]) != bits_of(want)) {
            g_fail(&g, "dtype %d inv %g: %a -> %08x", (int)t, sc.inv_scale, yd[i],
                   bits_of(gd[i]));
          }
          if (!wb || t == MP_F32) {
            g_check(&g, t != MP_F32 || wb || (double)gf[i] == yd[i] || isnan(yd[i]),
                    "fp32 grad written without write-back");
            continue;
          }
          g_check(&g, same_rne(bits_of(gd[i]), h[i], t == MP_BF16 ? &BF16 : &FP16),
                  "dtype %d: %08x written back as %04x", (int)t, bits_of(gd[i]), h[i]);
        }
      }
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: param storages (master, remainder, nearest, stochastic) round trips");
  const uint64_t key = ref_key(seed0, 3, 7);
  const uint32_t lo0 = 0xFFFFFF00u - 3u * MP_TILE, hi = 5u; /* lo + i reaches 2^32 - 256 */
  for (uint32_t tile = 0; tile < 3; ++tile) {
    const uint32_t lo = lo0 + tile * MP_TILE;
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      uint32_t u = (uint32_t)splitmix64(&s);
      if (i % 8u == 0u) u = (u & ~0x1FFFFu) | 0x08000u; /* a tie above an even bf16 */
      if (i % 97u == 1u) u = (u & 0x80000000u) | 0x7F800000u;
      x[i] = f32_of(u);
    }
    for (int k = 0; k < 2; ++k) {
      /* master: the param its round to nearest even, the master as stored */
      memcpy(y, x, MP_TILE * sizeof(float));
      const mp_pv_tile am = {h, y, NULL};
      g_check(&g, mp_pv_decode(MP_PV_MASTER, dts[k], &am, NULL, MP_TILE) == y,
              "master decoded to another array");
      mp_pv_encode(MP_PV_MASTER, dts[k], &am, y, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        const uint32_t u = bits_of(x[i]), st = k == 0 ? ref_master_stored(u) : u;
        g.count++;
        if (!isnan(x[i]) && bits_of(y[i]) != st) {
          g_fail(&g, "master %08x stored %08x", u, bits_of(y[i]));
        }
        g_check(&g, same_rne(st, h[i], fmts[k]), "master %08x: param %04x", u, h[i]);
      }
      /* nearest, without a master */
      const mp_pv_tile an = {h2, NULL, NULL};
      mp_pv_encode(MP_PV_NONE_RNE, dts[k], &an, x, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        g.count++;
        g_check(&g, same_rne(bits_of(x[i]), h2[i], fmts[k]), "rne %08x: %04x", bits_of(x[i]),
                h2[i]);
      }
      /* stochastic: bf16 against the reference at the element's position; fp16 one of the
       * two neighbours (the value or the next magnitude up, RNE of the value is either) */
      mp_pv_encode(MP_PV_NONE_SR, dts[k], &an, x, MP_TILE, key, lo, hi);
      for (uint32_t i = 0; i < MP_TILE; ++i) {
        const uint32_t u = bits_of(x[i]);
        const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo + i);
        g.count++;
        if (k == 0) {
          int nan;
          const uint32_t want = ref_sr(u, rb & 0xFFFFu, &nan);
          g_check(&g, nan ? nan_result_problem(u, h2[i], &BF16) == NULL : h2[i] == want,
                  "bf16 sr %08x at %u: %04x, want %04x", u, lo + i, h2[i], want);
        } else {
          g_check(&g, h2[i] == mp_fp16_sr_bits(u, rb), "fp16 sr %08x at %u: %04x", u, lo + i,
                  h2[i]);
        }
      }
    }
    /* remainder: split, then joined back to the stored master */
    memcpy(y, x, MP_TILE * sizeof(float));
    const mp_pv_tile ar = {h, NULL, rem};
    mp_pv_encode(MP_PV_REMAINDER, MP_BF16, &ar, y, MP_TILE, key, lo, hi);
    float* back = mp_pv_decode(MP_PV_REMAINDER, MP_BF16, &ar, x + MP_TILE, MP_TILE);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      const uint32_t u = bits_of(x[i]), st = ref_master_stored(u);
      g.count++;
      if (isnan(x[i])) {
        g_check(&g, isnan(back[i]) && isnan(y[i]), "remainder NaN %08x -> %08x", u,
                bits_of(back[i]));
        continue;
      }
      g_check(&g, bits_of(back[i]) == st && bits_of(y[i]) == st && same_rne(st, h[i], &BF16),
              "remainder %08x: param %04x rem %04x joined %08x", u, h[i], (uint16_t)rem[i],
              bits_of(back[i]));
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: bf16 moments from one draw (exp_avg low 16 bits, exp_avg_sq high 16)");
  for (uint32_t i = 0; i < MP_TILE; ++i) x[i] = f32_of((uint32_t)splitmix64(&s));
  mp_mom_draw(r, MP_TILE, key, lo0, hi);
  for (int shift = 0; shift <= 16; shift += 16) {
    mp_mom_encode_bf16(h, x, MP_TILE, r, (uint32_t)shift, 0);
    mp_mom_encode_bf16(h2, x, MP_TILE, r, (uint32_t)shift, 1);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      const uint32_t u = bits_of(x[i]);
      const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo0 + i);
      int nan;
      const uint32_t want = ref_sr(u, (rb >> shift) & 0xFFFFu, &nan);
      g.count++;
      g_check(&g, r[i] == rb, "draw at %u: %08x, want %08x", lo0 + i, r[i], rb);
      g_check(&g, nan ? nan_result_problem(u, h[i], &BF16) == NULL : h[i] == want,
              "sr shift %d %08x: %04x, want %04x", shift, u, h[i], want);
      g_check(&g, same_rne(u, h2[i], &BF16), "nearest %08x: %04x", u, h2[i]);
    }
    float* wide = mp_mom_decode(MP_BF16, h, y, MP_TILE);
    for (uint32_t i = 0; i < MP_TILE; ++i) {
      g_check(&g, bits_of(wide[i]) == (uint32_t)h[i] << 16, "bf16 moment %04x decoded %08x", h[i],
              bits_of(wide[i]));
    }
  }
  g_end(&g);

  g_begin(&g, "codecs: every 8-bit code decoded, a block of them encoded back");
  {
    /* one block holding every code of both formats (m: 256 signed codes, v: 256): decoded
     * under references from a scale whose exponent field is ea, the v floor off */
    const int eas[3] = {16, 127, 200};
    for (int j = 0; j < 3; ++j) {
      const int ea = eas[j];
      uint8_t mc[256], vc[256], mc2[256], vc2[256];
      for (int c = 0; c < 256; ++c) {
        mc[c] = (uint8_t)c;
        vc[c] = (uint8_t)c;
      }
      mp_step_scalars sc;
      memset(&sc, 0, sizeof sc);
      /* scales: the absmax of the block, the top code's value */
      const float ms = (float)q8_value(&Q8_M, 127, ea), vs = (float)q8_value(&Q8_V, 255, ea);
      mp_q8_decode_tile(mc, vc, x, y, 256, mp_q8_ref_m_of(ms), mp_q8_ref_v_of(vs), &sc);
      for (int c = 0; c < 256; ++c) {
        g.count++;
        g_check(&g, (double)x[c] == q8_decode_ref(&Q8_M, c, ea) &&
                        !!signbit(x[c]) == ((c & 0x80) != 0),
                "m code %02x at %d: %a", c, ea, x[c]);
        g_check(&g, (double)y[c] == q8_decode_ref(&Q8_V, c, ea), "v code %02x at %d: %a", c, ea,
                y[c]);
      }
      for (int nearest = 0; nearest < 2; ++nearest) {
        float ms2 = 0.0f, vs2 = 0.0f;
        mp_q8_encode_block(mc2, vc2, x, y, 256, &ms2, &vs2, key, lo0, hi, nearest);
        g_check(&g, bits_of(ms2) == bits_of(ms) && bits_of(vs2) == bits_of(vs),
                "scales %a %a, want %a %a", ms2, vs2, ms, vs);
        g_check(&g, q8_ref_exp_ref(&Q8_M, ms2) == ea && q8_ref_exp_ref(&Q8_V, vs2) == ea,
                "reference exponent of the encoded block moved from %d", ea);
        for (int c = 0; c < 256; ++c) {
          g.count++;
          g_check(&g, mc2[c] == c && vc2[c] == c, "codes %02x re-encoded as %02x %02x", c,
                  mc2[c], vc2[c]);
        }
      }
    }
    /* values between codes: the block encode against the per-value reference, stochastic
     * with the 8-bit stream's draw at each position */
    for (int i = 0; i < 256; ++i) {
      x[i] = f32_of((uint32_t)(splitmix64(&s) % 0x3F000000u) | (i & 1 ? 0x80000000u : 0u));
      y[i] = f32_of((uint32_t)(splitmix64(&s) % 0x3F000000u));
    }
    uint8_t mc2[256], vc2[256];
    float ms2, vs2;
    for (int nearest = 0; nearest < 2; ++nearest) {
      mp_q8_encode_block(mc2, vc2, x, y, 256, &ms2, &vs2, key, lo0, hi, nearest);
      const int em = q8_ref_exp_ref(&Q8_M, ms2), ev = q8_ref_exp_ref(&Q8_V, vs2);
      for (int i = 0; i < 256; ++i) {
        const uint32_t rb = ref_bits(key, ((uint64_t)hi << 32) + lo0 + (uint32_t)i);
        g.count++;
        g_check(&g, mc2[i] == q8_encode_full_ref(&Q8_M, x[i], em, rb & 0xFFFFu, nearest) &&
                        vc2[i] == q8_encode_full_ref(&Q8_V, y[i], ev, rb >> 16, nearest),
                "value %d (nearest %d): codes %02x %02x", i, nearest, mc2[i], vc2[i]);
      }
    }
  }
  g_end(&g);
  free(x);
  free(y);
  free(yd);
  free(h);
  free(h2);
  free(rem);
  free(r);
}

/* 11p. The moment formats' rows (mpext/formats/formats.h) give the map from a moment tensor's
 *      dtype to its format: checked against the formats as the API documents them, for every
 *      dtype and both moments (the first signed, the second non-negative; 8-bit codes pair the
 *      signed int8 code with the non-negative uint8 one), and ids out of range refused. */
static void test_moment_format_map(void) {
  group g;
  g_begin(&g, "moment formats: each stored dtype names the format of each moment (every dtype)");
  /* [dtype][which]: the documented format, MP_FMT_COUNT for none; every mp_dtype value (the
   * floating-point ones, then the codes' MP_I8 and MP_U8) and one past them */
  enum { ND = MP_U8 + 2 };
  int32_t want[ND][2];
  for (int d = 0; d < ND; ++d) want[d][0] = want[d][1] = MP_FMT_COUNT;
  want[MP_F32][0] = want[MP_F32][1] = MP_FMT_F32;
  want[MP_BF16][0] = want[MP_BF16][1] = MP_FMT_BF16;
  want[MP_I8][0] = MP_FMT_Q8S;
  want[MP_U8][1] = MP_FMT_Q8U;
  for (int d = -1; d < ND; ++d) {
    for (int which = 0; which < 2; ++which) {
      const int32_t w = d >= 0 ? want[d][which] : MP_FMT_COUNT;
      const int32_t got = mp_format_for_moment(d, which);
      g_check(&g, got == w, "dtype %d, moment %d: format %d, want %d", d, which, (int)got, (int)w);
      g_check(&g, w == MP_FMT_COUNT || (mp_format_moment_ok(w, which) &&
                                        mp_format_dtype(w) == d),
              "dtype %d, moment %d: the row of format %d disagrees", d, which, (int)w);
    }
  }
  g_check(&g, !mp_format_moment_ok(-1, 0) && !mp_format_moment_ok(MP_FMT_COUNT, 1),
          "an id out of range accepted");
  g_end(&g);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_moment_format_map();
  test_q8_codec(o->seed);
  test_bf16_remainder_all();
  test_codecs(o->seed);
}
