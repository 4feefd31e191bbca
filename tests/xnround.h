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
  /* Fault tests (xn_run.until_error), after the failing call (xnjob.c): */
  int later_rc;            /* the first call of one more round */
  int detach_rc;           /* dep_detach's code */
  int64_t detach_ms;       /* ... and how long it took */
  _Atomic int detached;    /* 1: dep_detach returned (the three above are set) */
  _Atomic int go;          /* set by the test: attach again now (xn_run.rejoin) */
  int rejoin_rc;           /* the rejoined job's verdict, as rc */
  char rejoin_msg[OW_MSG];
};

/* CLOCK_MONOTONIC in ms. */
int64_t xn_mono_ms(void);

/* Layout, dispatch, combine, LL dispatch (FP8 when fp8), LL combine on rank
 * r of case d, into o: 0, a DEP_ERR_* of a call, or 1 (a result the oracle
 * does not give); res->msg says which, res->digest takes what came back. */
int xn_round(dep_client_t *c, const struct ow_case *d, uint32_t r, int fp8, struct ow_outs *o,
             struct xn_result *res);

/* The throughput modes xn_round leaves out, on rank r of case d, each
 * against the oracle: a fresh FP8 dispatch (e4m3 bytes and scales drawn
 * from each token's origin), a cached bf16 dispatch on its handle and a
 * weighted combine.  0, a DEP_ERR_* of a call, or 1; res->msg says which. */
int xn_round_modes(dep_client_t *c, const struct ow_case *d, uint32_t r, struct ow_outs *o,
                   struct xn_result *res);

/*
 * Split low-latency calls (deepep.h DEP_LL_SEND, DEP_LL_RECV) of micro-batches A and B (two
 * cases of one shape, bf16) on rank r, each receive against the oracle, in two
 * interleavings: pipelined (send 1: dispatch A, send 2: dispatch B, receive 1, send 3:
 * combine A, receive 2, send 4: combine B, receive 3, receive 4), then two batches
 * (dispatch sends A, B, receives A, B; combine sends A, B, receives A, B).  o[i] holds
 * micro-batch i's outputs (ow_outs_alloc of its case).  hook, when not NULL, is called
 * before (after 0) and after (after 1) each step of the pipelined interleaving (step from
 * 0).  0, a DEP_ERR_* of a call, or 1; res->msg says which.
 */
typedef void xn_split_hook(uint32_t r, int step, int after, void *arg);
/* The two interleavings, step by step (check_xnode.c's GPU ranks run them on device
 * buffers): dispatch ('d') or combine ('c'), of micro-batch mb, send or receive. */
struct xn_step {
  char op;
  int mb;
  uint32_t phase;
};
#define XN_SPLIT_MODES 2
#define XN_SPLIT_STEPS 8
extern const struct xn_step xn_split_modes[XN_SPLIT_MODES][XN_SPLIT_STEPS];
int xn_round_split(dep_client_t *c, const struct ow_case *a, const struct ow_case *b, uint32_t r,
                   struct ow_outs o[2], xn_split_hook *hook, void *arg, struct xn_result *res);

/* Rank r's low-latency dispatch outputs in o (bf16 rows and counts per local expert) against
 * the oracle's: the first local expert whose count or rows differ, or -1. */
int xn_ll_rows_differ(const struct ow_case *d, uint32_t r, const struct ow_outs *o);

#endif /* DEP_XNROUND_H */
