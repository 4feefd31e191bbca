/*
 * cuda_handles.c — the cuda backend's handles: each handle's device arrays,
 * made on its first cuda dispatch for the job's shape (in the caller's
 * device memory for a dep_handle_new_in handle, checked to be this rank's
 * GPU's; lent by the warm-up; else a cuMemAlloc of its own), their size
 * (dep_handle_bytes) and their release.  The kernels that fill and read
 * them are launched by cuda_ops.c.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_ops_internal.h"

void cuda_ops_handle_free(struct dep_handle *h) {
  if (h == NULL || h->cuda == NULL)
    return;
  struct cuops_hmem *m = h->cuda;
  const struct cudadrv *cu = drv();
  CUcontext dummy;
  if (!m->lent && cu != NULL && cu->cuCtxPushCurrent(m->ctx) == CUDA_SUCCESS) {
    cu->cuMemFree(m->base);
    cu->cuCtxPopCurrent(&dummy);
  }
  free(m);
  h->cuda = NULL;
}

/* A handle's device arrays for the job c is bound to (cuops_handle_carve's). */
static uint64_t job_handle_carve(const dep_client_t *c, uint64_t at[CUOPS_HDL_ARRAYS]) {
  const struct ops_ctx *o = &c->ops;
  return cuops_handle_carve(o->world, o->shape.max_tokens_per_rank, o->lay.max_ll_tokens,
                      o->shape.topk, c->cuops.job.kd, at);
}

int cuda_ops_handle_bytes(dep_client_t *c, const char *op, uint64_t *bytes) {
  uint64_t at[CUOPS_HDL_ARRAYS];
  if (!c->cuops.ready)
    return no_kernels(c, op);
  *bytes = job_handle_carve(c, at);
  return 0;
}

static int handle_mem_check(dep_client_t *c, const char *op, const void *mem, uint64_t bytes) {
  /* Both ends, so that memory which begins on the GPU but is shorter than
   * it says is caught too; the ordinal where the driver tells it. */
  const CUdeviceptr at[2] = {(CUdeviceptr)(uintptr_t)mem,
                             (CUdeviceptr)(uintptr_t)mem + (bytes ? bytes - 1 : 0)};
  for (int i = 0; i < 2; i++) {
    unsigned type = 0;
    int ord = -1;
    CUresult r = drv()->cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, at[i]);
    if (r == CUDA_SUCCESS && type == CU_MEMORYTYPE_DEVICE &&
        (drv()->cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, at[i]) !=
             CUDA_SUCCESS || ord == c->cuda_dev))
      continue;
    char what[96];
    if (r != CUDA_SUCCESS)
      snprintf(what, sizeof what, "the driver does not know it (%s): host memory?",
               cudadrv_errstr(r));
    else if (type != CU_MEMORYTYPE_DEVICE)
      snprintf(what, sizeof what, "it is %s memory", type == CU_MEMORYTYPE_HOST ? "host" :
               "not device");
    else
      snprintf(what, sizeof what, "it is GPU %d's", ord);
    return client_seterr(c, DEP_ERR_INVALID, "%s: mem%s (%#llx) is not device memory of this "
                         "rank's GPU %d: %s; allocate the handle's %llu bytes on that GPU "
                         "(cuMemAlloc, cudaMalloc, torch.empty on its device)", op,
                         i ? "'s last byte" : "", (unsigned long long)at[i], c->cuda_dev, what,
                         (unsigned long long)bytes);
  }
  return 0;
}

/* The driver answers for the context current on the calling thread, which
 * need not be the rank's (a thread of the caller's own): asked in it. */
int cuda_ops_handle_mem_check(dep_client_t *c, const char *op, const void *mem,
                              uint64_t bytes) {
  struct ctx_guard g;
  int rc = ctx_enter(c, &g, op);
  if (rc != 0)
    return rc;
  rc = handle_mem_check(c, op, mem, bytes);
  ctx_leave(&g);
  return rc;
}

/*
 * Size the handle's device arrays for this job (once) and fill its host
 * fields.  The arrays are `lent` memory where that is not 0 (the warm-up's
 * handle, in the rank's private area: no allocation at attach), else the
 * caller's of a dep_handle_new_in handle (h->mem; refused when this job's
 * handle is larger), else a cuMemAlloc of the handle's own.
 */
int cuops_handle_reserve(dep_client_t *c, struct dep_handle *h, const char *op,
                         CUdeviceptr lent) {
  const struct ops_ctx *o = &c->ops;
  const uint32_t W = o->world, mt = o->shape.max_tokens_per_rank, ll = o->lay.max_ll_tokens;
  const uint32_t K = o->shape.topk, kd = c->cuops.job.kd;
  struct cuops_hmem *m = h->cuda;
  if (m != NULL && (m->ctx != c->cuops.ctx || m->world != W || m->max_tokens != mt ||
                    m->max_ll != ll || m->topk != K || m->kd != kd))
    cuda_ops_handle_free(h), m = NULL;
  if (m == NULL) {
    uint64_t at[CUOPS_HDL_ARRAYS];
    uint64_t bytes = job_handle_carve(c, at);
    if (lent == 0 && h->mem != NULL) {
      if (bytes > h->mem_bytes)
        return client_seterr(c, DEP_ERR_INVALID, "%s: the handle's memory (%zu bytes, "
                             "dep_handle_new_in) is less than a handle of this job takes (%llu, "
                             "dep_handle_bytes): it was made for another job; make a new handle",
                             op, h->mem_bytes, (unsigned long long)bytes);
      lent = (CUdeviceptr)(uintptr_t)h->mem;
    }
    m = calloc(1, sizeof *m);
    if (m == NULL)
      return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory for a handle", op);
    if (lent != 0) {
      m->base = lent;
      m->lent = true;
    } else {
      struct ctx_guard g;
      int rc = ctx_enter(c, &g, op);
      if (rc != 0) {
        free(m);
        return rc;
      }
      /* Every element is written by a dispatch before a kernel reads it. */
      CUresult r = drv()->cuMemAlloc(&m->base, bytes);
      ctx_leave(&g);
      if (r != CUDA_SUCCESS) {
        if (m->base != 0)
          drv()->cuMemFree(m->base);
        free(m);
        return cu_fail(c, op, "allocating a handle's device arrays", r);
      }
    }
    m->ctx = c->cuops.ctx;
    m->world = W, m->max_tokens = mt, m->max_ll = ll, m->topk = K, m->kd = kd;
#define AT(i, type) ((type)(uintptr_t)(m->base + at[i]))
    m->p = (struct cuops_hdl){AT(0, uint64_t *), AT(1, int32_t *), AT(2, uint32_t *),
                              AT(3, uint32_t *), AT(4, int32_t *), AT(5, uint32_t *),
                              AT(6, uint32_t *), AT(7, int32_t *), AT(8, int32_t *),
                              AT(9, int32_t *)};
#undef AT
    h->cuda = m;
  }
  /* The counts per source are read on the host (dep_handle_recv_from, a
   * cached dispatch's and a combine's checks): host memory of the
   * library's, never the device memory h->mem lends. */
  if (h->recv_cap < W) {
    uint32_t *p = realloc(h->recv_from, (size_t)W * sizeof *p);
    if (p == NULL)
      return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory for a handle's %u counts",
                           op, W);
    h->recv_from = p;
    h->recv_cap = W;
  }
  h->kind = OPS_HANDLE_EMPTY;
  h->world = W;
  h->rank = o->rank;
  h->hidden = o->shape.hidden;
  h->topk = K;
  h->num_experts = o->shape.num_experts;
  h->max_tokens = mt;
  h->max_ll_tokens = ll;
  return 0;
}

int cuda_ops_handle_new(dep_client_t *c, struct dep_handle *h, const char *op) {
  return c->cuops.ready ? cuops_handle_reserve(c, h, op, 0) : 0;
}
