/* The C core's ISA paths (mpext.h): names and their round trip, which paths this CPU supports,
 * selection (an unsupported path is rejected and the active one kept), and that the path active
 * before anything selects one is the best this CPU supports. */
#include "test_common.h"

/* ------------------------------------------------------------------------------------------ */
/* 8. ISA names, support and selection. */
static void test_isa_api(mp_isa initial_active) {
  group g;
  g_begin(&g, "ISA names: mp_isa_name / mp_isa_from_name round trip, unknown names rejected");
  static const char* const names[MP_ISA_COUNT] = {"scalar", "avx2", "avx512"};
  for (int i = 0; i < MP_ISA_COUNT; ++i) {
    const char* nm = mp_isa_name((mp_isa)i);
    g_check(&g, nm != NULL && strcmp(nm, names[i]) == 0, "mp_isa_name(%d) = %s, expected %s", i,
            nm ? nm : "NULL", names[i]);
    mp_isa out = (mp_isa)-1;
    mp_status r = mp_isa_from_name(nm ? nm : names[i], &out);
    g_check(&g, r == MP_OK && out == (mp_isa)i, "mp_isa_from_name(%s): status %d, isa %d",
            names[i], (int)r, (int)out);
  }
  g_check(&g, mp_isa_name(MP_ISA_COUNT) == NULL, "mp_isa_name(MP_ISA_COUNT) is not NULL");
  g_check(&g, mp_isa_name((mp_isa)-1) == NULL, "mp_isa_name(-1) is not NULL");
  g_check(&g, mp_isa_name((mp_isa)1000) == NULL, "mp_isa_name(1000) is not NULL");
  static const char* const bad[] = {"", "avx", "avx512f", "avx-512", "scalar ", " scalar",
                                    "sse2", "neon", "avx22", "native", "auto"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    mp_isa out = (mp_isa)77;
    mp_status r = mp_isa_from_name(bad[i], &out);
    g_check(&g, r == MP_ERR_INVALID_ARGUMENT, "mp_isa_from_name(\"%s\") returned %d", bad[i],
            (int)r);
    g_check(&g, out == (mp_isa)77, "mp_isa_from_name(\"%s\") wrote %d on failure", bad[i],
            (int)out);
  }
  mp_isa out = (mp_isa)77;
  g_check(&g, mp_isa_from_name(NULL, &out) == MP_ERR_INVALID_ARGUMENT && out == (mp_isa)77,
          "mp_isa_from_name(NULL, &out) not rejected");
  g_check(&g, mp_isa_from_name("scalar", NULL) == MP_ERR_INVALID_ARGUMENT,
          "mp_isa_from_name(\"scalar\", NULL) not rejected");
  g_end(&g);

  g_begin(&g, "ISA support and selection: unsupported paths rejected, active path unchanged");
  mp_isa best = mp_cpu_isa_best();
  g_check(&g, mp_cpu_isa_supported(MP_ISA_SCALAR) == 1, "scalar not supported");
  g_check(&g, mp_cpu_isa_supported(best) == 1, "best path %d not supported", (int)best);
  g_check(&g, initial_active == best, "initial active path %d is not the best %d",
          (int)initial_active, (int)best);
  for (int i = (int)best + 1; i < MP_ISA_COUNT; ++i) {
    g_check(&g, !mp_cpu_isa_supported((mp_isa)i), "path %d above best %d is supported", i,
            (int)best);
  }
  g_check(&g, mp_cpu_isa_supported(MP_ISA_COUNT) == 0, "MP_ISA_COUNT reported supported");
  g_check(&g, mp_cpu_isa_supported((mp_isa)-1) == 0, "isa -1 reported supported");
  int n_unsupported = 0;
  for (int a = 0; a < MP_ISA_COUNT; ++a) {
    if (!mp_cpu_isa_supported((mp_isa)a)) continue;
    select_isa((mp_isa)a);
    g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "selected %d, active %d", a,
            (int)mp_cpu_isa_active());
    for (int b = 0; b < MP_ISA_COUNT; ++b) {
      if (mp_cpu_isa_supported((mp_isa)b)) continue;
      n_unsupported++;
      mp_status r = mp_cpu_isa_select((mp_isa)b);
      g_check(&g, r == MP_ERR_UNSUPPORTED_ISA, "selecting unsupported %s returned %d",
              mp_isa_name((mp_isa)b), (int)r);
      g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "active path changed from %s to %d after "
              "selecting unsupported %s", mp_isa_name((mp_isa)a), (int)mp_cpu_isa_active(),
              mp_isa_name((mp_isa)b));
    }
    static const int out_of_range[] = {MP_ISA_COUNT, -1, 1000};
    for (int j = 0; j < 3; ++j) {
      mp_status r = mp_cpu_isa_select((mp_isa)out_of_range[j]);
      g_check(&g, r != MP_OK, "selecting isa %d returned MP_OK", out_of_range[j]);
      g_check(&g, mp_cpu_isa_active() == (mp_isa)a, "active path changed after selecting isa %d",
              out_of_range[j]);
    }
  }
  if (n_unsupported == 0) {
    printf("      (every ISA path is supported here: the unsupported-selection case is not "
           "exercised)\n");
  }
  select_isa(best);
  g_end(&g);
}

void run_tests(const sweep_opts* o, mp_isa initial_active) {
  test_isa_api(initial_active);
}
