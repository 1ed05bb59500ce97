/* What the tools' timings share: the calling thread's CPU time (the machine is shared: a
 * thread's CPU time moves less with the load than the wall clock) and a qsort comparator for
 * taking medians of doubles. Include after defining _POSIX_C_SOURCE. */
#ifndef MPEXT_TOOLS_AB_CLOCK_H
#define MPEXT_TOOLS_AB_CLOCK_H

#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

#endif /* MPEXT_TOOLS_AB_CLOCK_H */
