/* main and the bookkeeping of the C core's tests (test_common.h): linked into every test binary
 * whose source includes test_common.h (tests/c/run.py), which supplies run_tests. */
#include "test_common.h"

static int g_passed = 0, g_failed = 0;

#define MAX_DETAILS 8

double now_s(void) {
  struct timespec ts;
  timespec_get(&ts, TIME_UTC);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void g_begin(group* g, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->name, sizeof g->name, fmt, ap);
  va_end(ap);
  g->bad = 0;
  g->count = 0;
  g->t0 = now_s();
}

/* One failure of group g: printed in detail while there are few. */
static void g_report(group* g, const char* fmt, va_list ap) {
  if (++g->bad <= MAX_DETAILS) {
    printf("    %s: ", g->name);
    vprintf(fmt, ap);
    printf("\n");
  } else if (g->bad == MAX_DETAILS + 1) {
    printf("    %s: (further failures not shown)\n", g->name);
  }
}

void g_fail(group* g, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  g_report(g, fmt, ap);
  va_end(ap);
}

int g_check(group* g, int cond, const char* fmt, ...) {
  g->count++;
  if (cond) return 1;
  va_list ap;
  va_start(ap, fmt);
  g_report(g, fmt, ap);
  va_end(ap);
  return 0;
}

void g_end(group* g) {
  double dt = now_s() - g->t0;
  if (g->bad == 0) {
    g_passed++;
    printf("PASS  %s (%lld checks, %.2f s)\n", g->name, g->count, dt);
  } else {
    g_failed++;
    printf("FAIL  %s (%lld of %lld checks failed, %.2f s)\n", g->name, g->bad, g->count, dt);
  }
  fflush(stdout);
}

/* ------------------------------------------------------------------------------------------ */
/* ISA paths. */
mp_isa g_isas[MP_ISA_COUNT];
int g_nisa = 0;

void select_isa(mp_isa isa) {
  if (mp_cpu_isa_select(isa) != MP_OK) {
    printf("cannot select ISA %s\n", mp_isa_name(isa));
    exit(2);
  }
}

static void describe_skip(mp_isa isa) {
  const char* why = "the CPU lacks it or it was not compiled in";
#if !defined(MP_X86_PATHS)
  if (isa != MP_ISA_SCALAR) why = "not compiled in (MP_X86_PATHS unset: not an x86 build)";
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static char buf[160];
  buf[0] = '\0';
  int missing = 0;
  strcat(buf, "CPU lacks");
#define MP_NEED(feat)                                 \
  do {                                                \
    if (!__builtin_cpu_supports(feat)) {              \
      strcat(buf, " ");                               \
      strcat(buf, feat);                              \
      missing++;                                      \
    }                                                 \
  } while (0)
  MP_NEED("avx2");
  MP_NEED("fma");
  MP_NEED("f16c");
  if (isa == MP_ISA_AVX512) {
    MP_NEED("avx512f");
    MP_NEED("avx512bw");
    MP_NEED("avx512vl");
    MP_NEED("avx512dq");
  }
#undef MP_NEED
  if (missing) why = buf;
#endif
  printf("SKIP  ISA path %s: %s\n", mp_isa_name(isa), why);
}

/* ------------------------------------------------------------------------------------------ */
/* main. */

static uint64_t parse_u64(const char* s, const char* what) {
  char* end;
  unsigned long long v = strtoull(s, &end, 0);
  if (*s == '\0' || *end != '\0') {
    fprintf(stderr, "bad value for %s: %s\n", what, s);
    exit(2);
  }
  return (uint64_t)v;
}

int main(int argc, char** argv) {
  /* Before anything selects a path: the initial active path must be the best one. */
  mp_isa initial_active = mp_cpu_isa_active();
  sweep_opts o = {257u, 2000000u, 0x6D70657874ull};
  const char* only = NULL;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--stride") == 0 && i + 1 < argc) {
      o.stride = parse_u64(argv[++i], "--stride");
    } else if (strcmp(argv[i], "--random") == 0 && i + 1 < argc) {
      o.n_random = parse_u64(argv[++i], "--random");
    } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      o.seed = parse_u64(argv[++i], "--seed");
    } else if (strcmp(argv[i], "--isa") == 0 && i + 1 < argc) {
      only = argv[++i];
      /* "best": the path this CPU would run (what a one-path run, CI's ctest-nofast, tests) */
      if (strcmp(only, "best") == 0) only = mp_isa_name(mp_cpu_isa_best());
    } else {
      fprintf(stderr, "usage: %s [--stride S] [--random N] [--seed X] [--isa NAME|best]\n",
              argv[0]);
      return 2;
    }
  }
  if (o.stride % 2u == 0u) {
    fprintf(stderr, "--stride must be odd (to reach every low-bit pattern)\n");
    return 2;
  }

  double t0 = now_s();
  printf("mpext C core tests: best ISA %s, initially active %s; seed 0x%" PRIx64 ", stride %"
         PRIu64 ", %" PRIu64 " random\n", mp_isa_name(mp_cpu_isa_best()),
         mp_isa_name(initial_active), o.seed, o.stride, o.n_random);
  for (int i = 0; i < MP_ISA_COUNT; ++i) {
    if (!mp_cpu_isa_supported((mp_isa)i)) {
      describe_skip((mp_isa)i);
      continue;
    }
    if (only && strcmp(only, mp_isa_name((mp_isa)i)) != 0) {
      printf("SKIP  ISA path %s: --isa %s given\n", mp_isa_name((mp_isa)i), only);
      continue;
    }
    g_isas[g_nisa++] = (mp_isa)i;
  }
  if (g_nisa == 0) {
    fprintf(stderr, "no ISA path to test\n");
    return 2;
  }
  printf("      testing ISA paths:");
  for (int k = 0; k < g_nisa; ++k) printf(" %s", mp_isa_name(g_isas[k]));
  printf("\n");

  run_tests(&o, initial_active);

  printf("      total %.2f s\n", now_s() - t0);
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
