/*
 * statrec.c — what the host backend's stats writes cost one call (issue 15),
 * alone, where bench/ep -P measures them inside whole calls and a loaded
 * machine's noise can hide a 1 % difference.
 *
 *   statrec [-n CALLS] [-r REPS]
 *
 * Each rep times CALLS iterations of exactly what client/ops.c adds to a
 * host-backend call with a stats page: two reads of the clock the page is
 * timed with (statrec_now_ns, CLOCK_MONOTONIC through the vDSO) and one
 * entry written into a page-sized ring (statrec_call: four relaxed stores
 * and a release store of its seq), against the same loop with the writes
 * alone and an empty loop.  Prints the median over reps of the ns per
 * iteration of each, and what the clock and entry add per call.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "benchlib.h"
#include "statrec.h"

static double per_call_ns(int mode, struct statrec *s, long calls) {
  volatile uint64_t sink = 0;
  double t0 = bench_now_ms();
  for (long i = 1; i <= calls; i++) {
    uint64_t ns = (uint64_t)i;
    if (mode >= 2) {
      uint64_t a = statrec_now_ns();
      ns = statrec_now_ns() - a;
    }
    if (mode >= 1)
      statrec_call(s, DEP_STATS_OP_LL_DISPATCH, (uint64_t)i, ns, 0, 7168u * 2u * 128u);
    sink += ns;
  }
  (void)sink;
  return (bench_now_ms() - t0) * 1e6 / (double)calls;
}

int main(int argc, char **argv) {
  long calls = 2000000;
  int reps = 21, opt;
  while ((opt = getopt(argc, argv, "n:r:h")) != -1) {
    switch (opt) {
    case 'n': calls = atol(optarg); break;
    case 'r': reps = atoi(optarg); break;
    default:
      fprintf(stderr, "usage: statrec [-n CALLS] [-r REPS]\n");
      return 2;
    }
  }
  if (calls < 1 || reps < 1 || reps > 1000) {
    fprintf(stderr, "statrec: -n and -r must be positive (-r at most 1000)\n");
    return 2;
  }
  struct statrec s = {.world = 8}; /* a node's job: the calls' ring does not depend on it */
  s.bytes = dep_stats_page_bytes(s.world);
  s.page = mmap(NULL, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (s.page == MAP_FAILED) {
    perror("statrec: mmap");
    return 1;
  }
  double *t[3];
  for (int m = 0; m < 3; m++)
    if ((t[m] = calloc((size_t)reps, sizeof(double))) == NULL)
      return 1;
  for (int r = 0; r < reps; r++)
    for (int m = 0; m < 3; m++) /* interleaved, so drift falls on every mode alike */
      t[m][r] = per_call_ns(m, &s, calls);
  for (int m = 0; m < 3; m++)
    bench_sort(t[m], (size_t)reps);
  double empty = t[0][reps / 2], write = t[1][reps / 2], both = t[2][reps / 2];
  printf("# %ld iterations x %d reps, medians, ns per iteration\n", calls, reps);
  printf("empty loop            %8.2f ns\n", empty);
  printf("entry written         %8.2f ns  (+%.2f)\n", write, write - empty);
  printf("clock x2 + entry      %8.2f ns  (+%.2f: what a host call with a stats page pays)\n",
         both, both - empty);
  return 0;
}
