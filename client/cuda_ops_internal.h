/*
 * cuda_ops_internal.h — what the cuda backend's three files share:
 * cuda_ops.c (the operations, the error record), cuda_attach.c (loading the
 * kernels, binding them to the job, the warm-up) and cuda_handles.c (each
 * handle's device arrays).  The driver's table, a driver error as a
 * DEP_ERR_*, the rank's context made current on the caller's thread, where
 * a handle's arrays lie, and the launch and the error record's report that
 * the warm-up shares with the operations.  Seen by no file outside these
 * three.
 */
#ifndef DEP_CUDA_OPS_INTERNAL_H
#define DEP_CUDA_OPS_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "client_internal.h"

/* A handle's device arrays, made on its first cuda dispatch for one job shape. */
struct cuops_hmem {
  CUcontext ctx;
  CUdeviceptr base;
  bool lent; /* base is not ours to free (handle_reserve) */
  uint32_t world, max_tokens, max_ll, topk, kd;
  struct cuops_hdl p;
};

static inline const struct cudadrv *drv(void) { return cudadrv_load(NULL, 0); }

static inline int cu_fail(dep_client_t *c, const char *op, const char *what, CUresult r) {
  return client_seterr(c, r == CUDA_ERROR_OUT_OF_MEMORY ? DEP_ERR_NO_MEMORY : DEP_ERR_CUDA,
                       "%s: %s: %s", op, what, cudadrv_errstr(r));
}

/* The caller's thread may have no context, or another one, current. */
struct ctx_guard {
  bool pushed;
};
static inline int ctx_enter(dep_client_t *c, struct ctx_guard *g, const char *op) {
  CUcontext cur = NULL;
  g->pushed = false;
  if (drv()->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == c->cuops.ctx)
    return 0;
  CUresult r = drv()->cuCtxPushCurrent(c->cuops.ctx);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, op, "cuCtxPushCurrent", r);
  g->pushed = true;
  return 0;
}
static inline void ctx_leave(struct ctx_guard *g) {
  CUcontext dummy;
  if (g->pushed)
    drv()->cuCtxPopCurrent(&dummy);
}

/* The refusal of a library built without nvcc, whose cuda client has no kernels. */
static inline int no_kernels(dep_client_t *c, const char *op) {
  return client_seterr(c, DEP_ERR_UNSUPPORTED,
                       "%s: this libdeepep-client was built without nvcc, so it has no CUDA "
                       "kernels; rebuild it with CUDA_HOME set to a CUDA toolkit, or run deepepd "
                       "with backend: host", op);
}

static inline struct cuops_hdl hdl_of(const struct dep_handle *h) {
  return ((const struct cuops_hmem *)h->cuda)->p;
}

/* Size the handle's device arrays for this job (once) and fill its host
 * fields; the arrays are lent memory where that is not 0 (cuda_handles.c). */
int cuops_handle_reserve(dep_client_t *c, struct dep_handle *h, const char *op,
                         CUdeviceptr lent);

/* Launch kernel k on stream s with the job and args as its two parameters,
 * in the rank's context (cuda_ops.c). */
int cuops_launch(dep_client_t *c, enum cuops_kernel k, unsigned grid, void *args, CUstream s,
                 const char *op);
/* The dynamic shared memory kernel k is launched with in a job of `world` ranks and
 * num_experts experts (dep__kernel_shmem: the receiving kernels' per-source state, the
 * low-latency dispatch's experts besides); 0 for the kernels that receive nothing. */
unsigned dep__shmem_of(enum cuops_kernel k, uint32_t world, uint32_t num_experts);
/* Report what the kernels recorded, if anything; `own`: the record is this
 * synchronised call's (cuda_ops.c). */
int cuops_poll(dep_client_t *c, const char *op, CUstream s, bool own);

#endif /* DEP_CUDA_OPS_INTERNAL_H */
