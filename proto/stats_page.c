/*
 * stats_page.c — the stats page's names and its histogram's buckets and
 * quantiles (stats_page.h): the daemon folds calls into buckets with these, and
 * the tests check them, so there is one definition of what a bucket holds.
 */
#include "stats_page.h"

#include <stddef.h>

const char *dep__stats_op_name(unsigned op) {
  static const char *const names[DEP_STATS_NOPS] = {
#define DEP__STATS_NAME(name, str) [DEP_STATS_OP_##name] = str,
      DEP_STATS_OPS(DEP__STATS_NAME)
#undef DEP__STATS_NAME
  };
  return op < DEP_STATS_NOPS ? names[op] : "unknown";
}

/*
 * Below 8 ns a bucket per nanosecond; from there four per power of two:
 * the bucket is 4 * (msb - 1) plus the two bits after the most significant
 * one, so bucket 8 starts at 8 ns, 12 at 16 ns, and 127 at 3.75 * 2^30 ns.
 */
unsigned dep__stats_bucket(uint64_t ns) {
  if (ns < 8)
    return (unsigned)ns;
  unsigned msb = 63u - (unsigned)__builtin_clzll(ns);
  unsigned b = 4u * (msb - 1u) + (unsigned)((ns >> (msb - 2u)) & 3u);
  return b < DEP_STATS_BUCKETS ? b : DEP_STATS_BUCKETS - 1u;
}

uint64_t dep__stats_bucket_low(unsigned b) {
  if (b < 8)
    return b;
  unsigned msb = b / 4u + 1u;
  return (uint64_t)(4u + b % 4u) << (msb - 2u);
}

uint64_t dep__stats_quantile(const uint32_t hist[DEP_STATS_BUCKETS], uint64_t n, double q) {
  if (n == 0)
    return 0;
  /* The rank of the call at quantile q, 1-based: ceil(q * n), at least 1. */
  double want = q * (double)n;
  uint64_t target = (uint64_t)want;
  if ((double)target < want)
    target++;
  if (target == 0)
    target = 1;
  uint64_t seen = 0;
  for (unsigned b = 0; b < DEP_STATS_BUCKETS; b++) {
    seen += hist[b];
    if (seen >= target) {
      uint64_t lo = dep__stats_bucket_low(b);
      if (b < 8)
        return lo;
      uint64_t hi = b + 1 < DEP_STATS_BUCKETS ? dep__stats_bucket_low(b + 1) : lo + lo / 7;
      /* The middle of [lo, hi): at most 12.5 % from any value in it. */
      return (lo + hi) / 2;
    }
  }
  return dep__stats_bucket_low(DEP_STATS_BUCKETS - 1);
}
