/*
 * benchlib.c — shared benchmark helpers (benchlib.h).
 */
#include "benchlib.h"

#include <stdlib.h>
#include <time.h>

double bench_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

void bench_sort(double *v, size_t n) { qsort(v, n, sizeof *v, cmp_double); }
