/*
 * cudaranks.h — helpers for check_cuda_ops.c: whether a GPU run is asked
 * for and possible, one rank's client, stream and device buffers, and
 * worlds of rank processes or rank threads attached to a real deepepd on
 * the cuda backend, each running a body and reporting every rank's
 * failure.  Prefix cr_ (as memranks' mr_); struct rk and its rk_ calls are
 * what a rank body sees.
 */
#ifndef DEP_CUDARANKS_H
#define DEP_CUDARANKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cudadrv.h"
#include "deepep.h"
#include "opsworld.h"
#include "testutil.h"

/* ---- is a GPU run asked for, and possible ---------------------------------------- */

bool cr_on_cuda(void);
/* Skip (saying why) without a cuda daemon or a GPU; fail when DEP_TEST_GPUS
 * cannot be met; else what the probe found in *g.  The probe initialises
 * CUDA in a child, never here. */
bool cr_gpu_probe(const char *test, struct tu_gpus *g);
bool cr_gpu_ready(const char *test);
#define CR_NEEDS_GPU()           \
  do {                           \
    if (!cr_gpu_ready(__func__)) \
      return;                    \
  } while (0)

uint64_t cr_ms_now(void);

/* ---- one rank: its client, stream and device buffers ------------------------------ */

enum { B_X, B_IDX, B_W, B_CX, B_LX, B_TPR, B_TPE, B_TIR, B_RX, B_RIDX, B_RW, B_CNT, B_OUT, B_LRX,
       B_LSC, B_LCNT, B_LOUT, B_LSRC, B_LRANGE, B_COUNT };

struct rk {
  const struct cudadrv *cu;
  CUdevice dev;    /* this rank's GPU (DEP_TEST_GPUS) */
  CUcontext ctx;   /* its primary context, retained and current on the rank's thread */
  dep_client_t *c;
  dep_handle_t *h;
  CUstream s;
  uint32_t rank, W, h_, K, E, mt, le, rows, maxll;
  CUdeviceptr b[B_COUNT];
  size_t sz[B_COUNT];
  uint8_t *host; /* readback, as large as the largest buffer */
  char *msg;
  uint32_t flags;             /* dep_attach's flags (DEP_ATTACH_ELASTIC): set before rk_open_at */
  struct dep_attach_args args; /* what rk_open_at attached with, for a body that attaches again */
};

#define CR_DEV(k, i) ((void *)(uintptr_t)(k)->b[i])
#define CR_CU(k, expr, what)                                                            \
  do {                                                                                  \
    CUresult r_ = (expr);                                                               \
    if (r_ != CUDA_SUCCESS)                                                             \
      return ow_fail((k)->msg, "rank %u: %s: %s", (k)->rank, what, cudadrv_errstr(r_)); \
  } while (0)

/* Attach rank `rank` of W to job `job` on its GPU (DEP_TEST_GPUS), make its
 * stream and buffers; 0, or a failure written to k->msg. */
int rk_open(struct rk *k, const char *sock, const char *job, const struct dep_job_shape *sh,
            uint32_t rank, uint32_t W);
/* The same for a job of nodes: local rank `local` of the lws ranks on sock's daemon. */
int rk_open_at(struct rk *k, const char *sock, const char *job, const struct dep_job_shape *sh,
               uint32_t rank, uint32_t W, uint32_t local, uint32_t lws);
void rk_close(struct rk *k);
int cr_put(struct rk *k, int i, const void *src, size_t n);
/* The same into dst (a place inside one of k's buffers). */
int cr_put_at(struct rk *k, CUdeviceptr dst, const void *src, size_t n);
int cr_poison(struct rk *k, int i, uint8_t pz);
/* Synchronise, then copy buffer i back into k->host. */
int cr_get(struct rk *k, int i);

/* ---- worlds: rank processes, or rank threads ------------------------------------- */

typedef int (*cr_rank_body)(struct rk *k, void *arg);

struct cr_world {
  struct tu_daemon dm;
  char *msg; /* shared: one message per rank */
};

void cr_world_start(struct cr_world *w, const char *yaml);
/* The daemon must still answer and hold no job, then stop cleanly. */
void cr_world_stop(struct cr_world *w);
/* Fork one process per rank; each attaches, runs fn, detaches. */
void cr_run_procs(struct cr_world *w, const char *job, const struct dep_job_shape *sh, uint32_t W,
                  cr_rank_body fn, void *arg, const char *what);
/* Where each rank of a job attaches: its daemon's socket and its local
 * rank among that daemon's lws[] ranks (a job spread over nodes). */
struct cr_place {
  const char *sock[OW_MAXW];
  uint32_t local[OW_MAXW], lws[OW_MAXW];
  bool wait_all; /* wait for every rank even after one failed (else the rest are killed) */
  uint32_t flags; /* every rank's attach flags (DEP_ATTACH_ELASTIC) */
};
/* cr_run_procs with every rank placed as p says (w->dm need not run):
 * how many ranks failed, their messages in out. */
int cr_run_procs_placed(struct cr_world *w, const struct cr_place *p, const char *job,
                        const struct dep_job_shape *sh, uint32_t W, cr_rank_body fn, void *arg,
                        char *out, size_t len);
/* The per-rank messages of a world whose daemons are started elsewhere (nodes.h). */
void cr_world_msgs(struct cr_world *w);
void cr_world_msgs_free(struct cr_world *w);
/* Every rank a thread of this process with its own client and stream. */
void cr_run_threads(struct cr_world *w, const char *job, const struct dep_job_shape *sh,
                    uint32_t W, cr_rank_body fn, void *arg, const char *what);

#endif /* DEP_CUDARANKS_H */
