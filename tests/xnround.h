/*
 * xnround.h — one round of every operation on one rank of a job that may
 * span nodes, checked against the oracle (opsworld.h) and folded into a
 * digest: what check_xnode's rank processes run, and tests/rdma/xrank.c
 * in the Soft-RoCE guests.  Prefix xn_.
 */
#ifndef DEP_XNROUND_H
#define DEP_XNROUND_H

#include <stdatomic.h>
#include <stdint.h>

#include "deepep.h"
#include "opsworld.h"

/* What one rank process reports, in memory shared with the test. */
struct xn_result {
  _Atomic int done;        /* 1: finished (rc below is its verdict) */
  int rc;                  /* 0 ok; else the DEP_ERR_* or 1 (a wrong result), msg says */
  _Atomic uint32_t rounds; /* rounds completed so far */
  int64_t fail_ms;         /* when the failing call returned (CLOCK_MONOTONIC ms) */
  uint64_t digest;
  char msg[OW_MSG];
};

/* CLOCK_MONOTONIC in ms. */
int64_t xn_mono_ms(void);

/* Layout, dispatch, combine, LL dispatch (FP8 when fp8), LL combine on rank
 * r of case d, into o: 0, a DEP_ERR_* of a call, or 1 (a result the oracle
 * does not give); res->msg says which, res->digest takes what came back. */
int xn_round(dep_client_t *c, const struct ow_case *d, uint32_t r, int fp8, struct ow_outs *o,
             struct xn_result *res);

#endif /* DEP_XNROUND_H */
