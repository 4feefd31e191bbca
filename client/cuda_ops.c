/*
 * cuda_ops.c — the cuda backend's MoE operations: argument checks, kernel
 * launches on the caller's stream, and the error record the kernels leave
 * in pinned host memory (see cuda_ops.h for the protocol and for what is
 * checked where); the handles' device arrays are cuda_handles.c's.  The kernels are the
 * embedded fatbin (kernels/ops.cu), loaded once per attachment with
 * cuModuleLoadData: no run-time compilation.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "cuda_ops_internal.h"
#include "kimage.h"
#include "shape.h"
#include "xring.h"

/* The kernels restate host_ops.h's layouts; hold them to it. */
_Static_assert(CUOPS_OP_DISPATCH == OPS_OP_DISPATCH && CUOPS_OP_COMBINE == OPS_OP_COMBINE &&
                   CUOPS_OP_LL_DISPATCH == OPS_OP_LL_DISPATCH &&
                   CUOPS_OP_LL_COMBINE == OPS_OP_LL_COMBINE && CUOPS_OP_FP8 == OPS_OP_FP8 &&
                   CUOPS_OP_CACHED == OPS_OP_CACHED && CUOPS_OP_WEIGHTS == OPS_OP_WEIGHTS,
               "op codes differ from host_ops.h");
_Static_assert(CUOPS_SLOT_BYTES == DEP_SLAB_CTRL_SLOT && CUOPS_ERR_BYTES == DEP_SLAB_ERR_BYTES,
               "slab control layout differs from slab.h");
_Static_assert(offsetof(struct ops_slot, rows) == 8 && offsetof(struct ops_slot, op) == 12 &&
                   offsetof(struct ops_slot, ref_seq) == 16 &&
                   offsetof(struct ops_slot, num_tokens) == 24,
               "ops_slot layout differs from what the kernels write");
_Static_assert(offsetof(struct ops_err_record, seq) == offsetof(struct cuops_err, seq) &&
                   offsetof(struct ops_err_record, waited_ms) ==
                       offsetof(struct cuops_err, waited_ms) &&
                   sizeof(struct ops_err_record) == sizeof(struct cuops_err),
               "error record layout differs from host_ops.h");
_Static_assert(CUOPS_GONE_NODE == DEP_SLAB_GONE_NODE, "abort words' node-lost value differs");
_Static_assert(CUOPS_ABORT_OFF == DEP_SLAB_ABORT_OFF &&
                   sizeof(struct cuops_abort) == sizeof(struct dep_slab_abort) &&
                   offsetof(struct cuops_abort, rank) == offsetof(struct dep_slab_abort, rank) &&
                   offsetof(struct cuops_abort, pid) == offsetof(struct dep_slab_abort, pid) &&
                   offsetof(struct cuops_abort, detached) ==
                       offsetof(struct dep_slab_abort, detached) &&
                   offsetof(struct cuops_abort, code) == offsetof(struct dep_slab_abort, code),
               "abort words differ from slab.h");
_Static_assert(CUOPS_ERR_GONE(0xfffffffeu, 7) == OPS_ERR_GONE(0xfffffffeu, 7),
               "a gone rank's record differs from host_ops.h");
_Static_assert(CUOPS_SLOT_BYTES == DEP_SLAB_CTRL_SLOT, "slot images differ from slab.h");
_Static_assert(offsetof(struct dep_xring, head) == CUOPS_XRING_HEAD_OFF &&
                   offsetof(struct dep_xring, tail) == CUOPS_XRING_TAIL_OFF &&
                   offsetof(struct dep_xring, failed) == CUOPS_XRING_FAILED_OFF &&
                   offsetof(struct dep_xring, desc) == CUOPS_XRING_DESC_OFF &&
                   CUOPS_XRING_ENTRIES == DEP_XRING_ENTRIES &&
                   sizeof(struct cuops_xdesc) == sizeof(struct dep_xring_desc) &&
                   offsetof(struct cuops_xdesc, seq) == offsetof(struct dep_xring_desc, seq) &&
                   offsetof(struct cuops_xdesc, bytes) == offsetof(struct dep_xring_desc, bytes),
               "the kernels' view of the proxy's ring differs from xring.h");
_Static_assert(CUOPS_MAX_RANKS <= 64, "remote_mask has a bit per rank");
_Static_assert(CUOPS_MAX_TOKENS == DEP_SHAPE_MAX_TOKENS && CUOPS_MAX_TOPK == DEP_SHAPE_MAX_TOPK,
               "the kernels' arrays are sized for other shape limits than proto/shape.h's");

#ifdef DEP_HAVE_FATBIN
static const char *const kernel_names[CUOPS_K_COUNT] = {
#define CUOPS__NAME(name, sym) sym,
    CUOPS_KERNELS(CUOPS__NAME)
#undef CUOPS__NAME
};
#endif

/* ---- the error record -------------------------------------------------------------- */

static const char *op_name(uint32_t op) {
  return op == 0 ? "layout" : host_ops_op_name(op);
}

/*
 * Report what the kernels recorded, if anything: the record's code with a
 * message.  `own` says the record is this synchronised call's: its ranks
 * stayed in step, so a failure other than a timeout or a gone rank is
 * cleared and the context stays usable.  A record found at the start of a call comes from
 * an earlier, unsynchronised call; this call is then not made, and since
 * the peers make it, the context is broken from here on.
 */
static int cuops_poll(dep_client_t *c, const char *op, CUstream s, bool own) {
  volatile struct cuops_err *e = &c->cuops.host->err;
  int32_t code = e->code;
  if (code == 0)
    return 0;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  struct cuops_err r = {.code = code, .op = e->op, .rank = e->rank, .source = e->source,
                        .seq = e->seq, .seen_flag = e->seen_flag, .waited_ms = e->waited_ms,
                        .phase = e->phase};
  const char *what = op_name(r.op & ~(CUOPS_OP_FP8 | CUOPS_OP_CACHED | CUOPS_OP_WEIGHTS));
  if (!own || code == DEP_ERR_TIMEOUT || code == DEP_ERR_PEER || r.phase == CUOPS_PHASE_AHEAD ||
      r.phase == CUOPS_PHASE_RING) {
    c->cuops.broken = true;
  } else {
    e->code = 0;
    drv()->cuMemsetD32Async(c->cuops.dev + offsetof(struct cuops_dev, claim), 0, 1, s);
  }
  char m[600];
  switch (r.phase) {
  case CUOPS_PHASE_WAIT:
    snprintf(m, sizeof m, "timeout in %s waiting for rank %u (call %llu, %u ms, its flag read "
             "%llu): that rank did not make the same call; check that every rank runs the same "
             "sequence of operations and is alive", what, r.source, (unsigned long long)r.seq,
             r.waited_ms, (unsigned long long)r.seen_flag);
    break;
  case CUOPS_PHASE_ROW:
    snprintf(m, sizeof m, "timeout in %s waiting for rows from rank %u (call %llu, %u ms, a row's "
             "mark read %#llx): that rank posted the call but stopped sending (it died or its "
             "GPU is stuck); restart the job", what, r.source, (unsigned long long)r.seq,
             r.waited_ms, (unsigned long long)r.seen_flag);
    break;
  case CUOPS_PHASE_GONE:
    snprintf(m, sizeof m, "rank %u (pid %u) of the job is gone (%s) while this rank waited in %s "
             "(call %llu, after %u ms); the job cannot go on: restart it", r.source,
             (uint32_t)r.seen_flag,
             (r.seen_flag >> 32) == DEP_SLAB_GONE_NODE ? "its node is lost: the peer link to its "
                                                         "daemon dropped"
             : (r.seen_flag >> 32) == DEP_SLAB_GONE_DETACHED ? "it detached"
                                                             : "its process ended",
             what, (unsigned long long)r.seq, r.waited_ms);
    break;
  case CUOPS_PHASE_RING:
    if (code == DEP_ERR_TIMEOUT)
      snprintf(m, sizeof m, "%s: the proxy's ring stayed full for %u ms (call %llu, for rank %u "
               "on another node); the daemon's proxy is stuck or its link to that node is too "
               "slow: see deepepctl peers", what, r.waited_ms, (unsigned long long)r.seq,
               r.source);
    else
      snprintf(m, sizeof m, "%s: the daemon's proxy stopped serving this rank (call %llu, for "
               "rank %u on another node): %s; restart the job", what, (unsigned long long)r.seq,
               r.source, code == DEP_ERR_PEER ? "a node of the job is gone" : dep_strerror(code));
    break;
  case CUOPS_PHASE_AHEAD:
    snprintf(m, sizeof m, "in %s rank %u is at call %llu, this rank at call %llu; a rank "
             "restarted or the slabs were not fresh: restart the job", what, r.source,
             (unsigned long long)r.seen_flag, (unsigned long long)r.seq);
    break;
  case CUOPS_PHASE_WORST:
    snprintf(m, sizeof m, "%s (call %llu) received %llu rows, more than its num_worst_tokens; "
             "give num_worst_tokens at least the rows a rank can receive (world_size * "
             "max_tokens_per_rank at most); the call's outputs are not valid", what,
             (unsigned long long)r.seq, (unsigned long long)r.seen_flag);
    break;
  case CUOPS_PHASE_IDS:
    snprintf(m, sizeof m, "%s found topk_idx of token %u = %lld: expert ids must be in [-1, "
             "num_experts %u)%s; the call's outputs are not valid", what, r.source,
             (long long)r.seen_flag, c->args.shape.num_experts,
             (r.op & ~CUOPS_OP_FP8) == CUOPS_OP_LL_COMBINE
                 ? " and equal to those given to the matching dep_ll_dispatch" : "");
    break;
  default:
    snprintf(m, sizeof m, "call %llu (%s): rank %u made another call, combined another dispatch "
             "or sent malformed rows (its slot read %#llx); every rank must make the same "
             "sequence of calls, each combine with the handle of the same dispatch; outputs were "
             "not written", (unsigned long long)r.seq, what, r.source,
             (unsigned long long)r.seen_flag);
  }
  if (own)
    return client_seterr(c, code, "%s: %s", op, m);
  return client_seterr(c, code, "%s: not run: an earlier call failed on the GPU: %s; this rank "
                       "is now out of step with its peers: detach and restart the job", op, m);
}

/* What every cuda operation does first. */
static int cuops_begin(dep_client_t *c, const char *op, CUstream s) {
  if (!c->cuops.ready)
    return no_kernels(c, op);
  if (c->cuops.broken)
    return client_seterr(c, DEP_ERR_STATE, "%s: an earlier call timed out or found a rank of the "
                         "job gone, so the ranks are out of step; detach and restart the job", op);
  return cuops_poll(c, op, s, false);
}

static int launch(dep_client_t *c, enum cuops_kernel k, unsigned grid, unsigned shmem,
                  void *args, CUstream s, const char *op) {
  struct ctx_guard g;
  int rc = ctx_enter(c, &g, op);
  if (rc != 0)
    return rc;
  void *params[2] = {&c->cuops.job, args};
  CUresult r = drv()->cuLaunchKernel(c->cuops.fn[k], grid, 1, 1, CUOPS_THREADS, 1, 1, shmem, s,
                                     params, NULL);
  ctx_leave(&g);
  return r == CUDA_SUCCESS ? 0 : cu_fail(c, op, "cuLaunchKernel", r);
}

/* ---- argument checks: ops_check_* with num_tokens 0 never reads device memory -------- */

static int need(char *why, size_t len, const void *p, size_t align, const char *op,
                const char *name) {
  if (p == NULL) {
    snprintf(why, len, "%s: %s is NULL", op, name);
    return DEP_ERR_INVALID;
  }
  if ((uintptr_t)p % align != 0) {
    snprintf(why, len, "%s: %s is not %zu-byte aligned", op, name, align);
    return DEP_ERR_INVALID;
  }
  return 0;
}

static int tokens_ok(char *why, size_t len, uint32_t n, uint32_t max, const char *op,
                     const char *bound) {
  if (n <= max)
    return 0;
  snprintf(why, len, "%s: num_tokens %u exceeds %s %u of the job's shape", op, n, bound, max);
  return DEP_ERR_INVALID;
}

#define IDX_ALIGN(t) ((t) == DEP_INDEX_I64 ? 8u : 4u)

/* The grid of a communicating kernel (cuda_ops.h: the SM budget). */
static unsigned comm_grid(const dep_client_t *c) {
  return c->cuops.job.world * c->cuops.job.parts;
}

/* A call refused before launch: counted in the stats page as the host path counts it (ops.c). */
static int cuops_refused(dep_client_t *c, unsigned sop, int rc, const char *op, const char *why) {
  statrec_rejected(&c->stats, sop);
  return client_seterr(c, rc, "%s: %s", op, why);
}

/* ---- the operations ------------------------------------------------------------------- */

int cuda_ops_layout(dep_client_t *c, const struct dep_layout_args *a, dep_stream_t stream) {
  const char *op = "dep_layout";
  CUstream s = stream;
  char why[256] = "";
  struct dep_layout_args z = *a;
  z.num_tokens = 0;
  int rc = ops_check_layout(&c->ops, &z, why, sizeof why);
  if (rc == 0)
    rc = tokens_ok(why, sizeof why, a->num_tokens, c->ops.shape.max_tokens_per_rank, "layout",
                   "max_tokens_per_rank");
  if (rc == 0 && a->num_tokens > 0 &&
      (rc = need(why, sizeof why, a->topk_idx, IDX_ALIGN(a->index_type), "layout", "topk_idx")) == 0)
    rc = need(why, sizeof why, a->token_in_rank, 1, "layout", "token_in_rank");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_LAYOUT, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0)
    return rc;
  struct cuops_layout_args k = {a->topk_idx, a->index_type, a->num_tokens, a->tokens_per_rank,
                                a->tokens_per_expert, a->token_in_rank};
  CUresult r = drv()->cuMemsetD32Async((CUdeviceptr)(uintptr_t)a->tokens_per_rank, 0,
                                       c->ops.world, s);
  if (r == CUDA_SUCCESS)
    r = drv()->cuMemsetD32Async((CUdeviceptr)(uintptr_t)a->tokens_per_expert, 0,
                                c->ops.shape.num_experts, s);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, op, "cuMemsetD32Async", r);
  unsigned grid = (a->num_tokens + CUOPS_THREADS - 1) / CUOPS_THREADS;
  grid = grid < 1 ? 1 : grid > 8 ? 8 : grid;
  return launch(c, CUOPS_K_LAYOUT, grid, 0, &k, s, op);
}

int cuda_ops_dispatch(dep_client_t *c, const struct dep_dispatch_args *a, struct dep_handle *h,
                      dep_stream_t stream) {
  const char *op = "dep_dispatch";
  CUstream s = stream;
  char why[256] = "";
  /* The host must not read device ids: the checks run on num_tokens 0 (a
   * cached dispatch reads none, and its num_tokens is checked against the
   * handle's), then the pointers num_tokens needs. */
  struct dep_dispatch_args z = *a;
  if (!a->cached)
    z.num_tokens = 0;
  int rc = ops_check_dispatch(&c->ops, &z, h, why, sizeof why);
  if (rc == 0)
    rc = tokens_ok(why, sizeof why, a->num_tokens, c->ops.shape.max_tokens_per_rank, "dispatch",
                   "max_tokens_per_rank");
  if (rc == 0 && a->num_tokens > 0 && !a->cached &&
      (rc = need(why, sizeof why, a->x, a->use_fp8 ? 1 : 2, "dispatch", "x")) == 0 &&
      (!a->use_fp8 || (rc = need(why, sizeof why, a->x_scales, 4, "dispatch", "x_scales")) == 0) &&
      (rc = need(why, sizeof why, a->topk_idx, IDX_ALIGN(a->index_type), "dispatch",
                 "topk_idx")) == 0)
    rc = need(why, sizeof why, a->topk_weights, 4, "dispatch", "topk_weights");
  if (rc == 0 && a->cached && h->cuda == NULL)
    rc = DEP_ERR_INVALID, snprintf(why, sizeof why, "dispatch (cached): handle was not filled on the GPU");
  const uint32_t le = c->cuops.job.le;
  if (rc == 0 && a->recv_count_per_expert_host != NULL && le > c->cuops.host_counts_cap)
    rc = DEP_ERR_INTERNAL,
    snprintf(why, sizeof why, "dispatch: the job's %u local experts overrun the pinned room for "
             "recv_count_per_expert_host (%u, made at attach); this is a bug, please report it",
             le, c->cuops.host_counts_cap);
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_DISPATCH, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0 ||
      (!a->cached && (rc = cuops_handle_reserve(c, h, op, 0)) != 0))
    return rc;
  const uint32_t align = a->expert_alignment > 1 && !a->cached ? a->expert_alignment : 0;
  struct cuops_dispatch_args k = {a->x, a->topk_idx, a->topk_weights, a->index_type,
                                  a->num_tokens, a->recv_x, a->recv_topk_idx,
                                  a->recv_topk_weights, a->recv_count_per_expert, a->x_scales,
                                  a->recv_x_scales, a->use_fp8, a->cached, a->num_worst_tokens,
                                  align, a->recv_index_type == DEP_INDEX_I64, 0, hdl_of(h)};
  CUresult r;
  if (!a->cached &&
      (r = drv()->cuMemsetD32Async((CUdeviceptr)(uintptr_t)a->recv_count_per_expert, 0, le,
                                   s)) != CUDA_SUCCESS)
    return cu_fail(c, op, "cuMemsetD32Async", r);
  if ((rc = launch(c, CUOPS_K_DISPATCH, comm_grid(c), 0, &k, s, op)) != 0)
    return rc;
  if (align != 0 && (rc = launch(c, CUOPS_K_ALIGN, 1, 0, &k, s, op)) != 0)
    return rc;
  if (a->cached) {
    /* The routing is the handle's: its row count, where the host learnt it. */
    if (a->num_recv != NULL && a->num_worst_tokens == 0)
      *a->num_recv = h->num_recv;
    return 0;
  }
  if (a->num_worst_tokens != 0) {
    /* No synchronisation: the rows and any error stay on the device (an
     * error is returned by the next call); combine reads the handle's
     * device arrays only. */
    h->num_recv = 0;
    h->worst = a->num_worst_tokens;
    h->num_tokens = a->num_tokens;
    h->kind = OPS_HANDLE_TP;
    return 0;
  }
  /* The counts behind the kernels that write them, so that the wait below covers them too. */
  if (a->recv_count_per_expert_host != NULL &&
      (r = drv()->cuMemcpyDtoHAsync(c->cuops.host_counts,
                                    (CUdeviceptr)(uintptr_t)a->recv_count_per_expert,
                                    le * sizeof(int32_t), s)) != CUDA_SUCCESS)
    return cu_fail(c, op, "cuMemcpyDtoHAsync (recv_count_per_expert_host)", r);
  /* The one synchronising call: num_recv is a host value. */
  if ((r = drv()->cuStreamSynchronize(s)) != CUDA_SUCCESS)
    return cu_fail(c, op, "cuStreamSynchronize", r);
  if ((rc = cuops_poll(c, op, s, true)) != 0)
    return rc;
  if (a->recv_count_per_expert_host != NULL)
    memcpy(a->recv_count_per_expert_host, c->cuops.host_counts, le * sizeof(int32_t));
  const volatile struct cuops_host *hp = c->cuops.host;
  h->num_recv = hp->num_recv;
  for (uint32_t i = 0; i < c->ops.world; i++)
    h->recv_from[i] = hp->recv_from[i];
  *a->num_recv = h->num_recv;
  h->worst = 0;
  h->num_tokens = a->num_tokens;
  h->kind = OPS_HANDLE_TP;
  return 0;
}

int cuda_ops_combine(dep_client_t *c, const struct dep_combine_args *a, const struct dep_handle *h,
                     dep_stream_t stream) {
  const char *op = "dep_combine";
  CUstream s = stream;
  char why[256] = "";
  int rc = ops_check_combine(&c->ops, a, h, why, sizeof why);
  if (rc == 0 && h->cuda == NULL)
    rc = DEP_ERR_INVALID, snprintf(why, sizeof why, "combine: handle was not filled on the GPU");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_COMBINE, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0)
    return rc;
  struct cuops_combine_args k = {a->x, a->out, h->num_tokens, 0, a->topk_weights,
                                 a->out_topk_weights, hdl_of(h)};
  return launch(c, CUOPS_K_COMBINE, comm_grid(c), 0, &k, s, op);
}

int cuda_ops_ll_dispatch(dep_client_t *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h, dep_stream_t stream) {
  const char *op = "dep_ll_dispatch";
  CUstream s = stream;
  char why[256] = "";
  struct dep_ll_dispatch_args z = *a;
  z.num_tokens = 0;
  int rc = ops_check_ll_dispatch(&c->ops, &z, h, why, sizeof why);
  if (rc == 0)
    rc = tokens_ok(why, sizeof why, a->num_tokens, c->ops.lay.max_ll_tokens, "ll_dispatch",
                   "max_ll_tokens_per_rank");
  if (rc == 0 && c->ops.shape.num_experts > CUOPS_LL_MAX_EXPERTS)
    rc = DEP_ERR_UNSUPPORTED,
    snprintf(why, sizeof why, "ll_dispatch: the cuda kernels take at most %u experts (the job has "
             "%u); use throughput mode (dep_dispatch) or the host backend", CUOPS_LL_MAX_EXPERTS,
             c->ops.shape.num_experts);
  if (rc == 0 && a->num_tokens > 0 && (rc = need(why, sizeof why, a->x, 2, "ll_dispatch", "x")) == 0)
    rc = need(why, sizeof why, a->topk_idx, IDX_ALIGN(a->index_type), "ll_dispatch", "topk_idx");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_LL_DISPATCH, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0 || (rc = cuops_handle_reserve(c, h, op, 0)) != 0)
    return rc;
  struct cuops_ll_dispatch_args k = {a->x, a->topk_idx, a->index_type, a->num_tokens, a->use_fp8,
                                     0, a->recv_x, a->recv_scales, a->recv_count,
                                     (uint8_t *)(uintptr_t)c->cuops.stage, hdl_of(h)};
  /* FP8: every token cast once, before the senders copy it to each rank
   * that needs it (the cast, not the copy, bounded the call). */
  unsigned cast = (a->num_tokens + CUOPS_WARPS - 1) / CUOPS_WARPS;
  cast = cast < 1 ? 1 : cast > CUOPS_MAX_CTAS ? CUOPS_MAX_CTAS : cast;
  if (a->use_fp8 && (rc = launch(c, CUOPS_K_LL_CAST, cast, 0, &k, s, op)) != 0)
    return rc;
  if ((rc = launch(c, CUOPS_K_LL_DISPATCH, comm_grid(c), CUOPS_LL_SHMEM(c->cuops.job.num_experts), &k,
                   s, op)) != 0)
    return rc;
  /* No synchronisation: what the host cannot know stays on the device. */
  h->num_tokens = a->num_tokens;
  h->num_recv = 0;
  h->idx_hash = 0;
  h->kind = OPS_HANDLE_LL;
  return 0;
}

int cuda_ops_ll_combine(dep_client_t *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h, dep_stream_t stream) {
  const char *op = "dep_ll_combine";
  CUstream s = stream;
  char why[256] = "";
  int rc = 0;
  if (h != NULL) {
    struct dep_handle hz = *h; /* num_tokens 0: the host must not hash device ids */
    hz.num_tokens = 0;
    rc = ops_check_ll_combine(&c->ops, a, &hz, why, sizeof why);
  } else {
    rc = ops_check_ll_combine(&c->ops, a, h, why, sizeof why);
  }
  if (rc == 0 && h->cuda == NULL)
    rc = DEP_ERR_INVALID, snprintf(why, sizeof why, "ll_combine: handle was not filled on the GPU");
  if (rc == 0 && h->num_tokens > 0 &&
      (rc = need(why, sizeof why, a->topk_idx, IDX_ALIGN(a->index_type), "ll_combine",
                 "topk_idx")) == 0 &&
      (rc = need(why, sizeof why, a->topk_weights, 4, "ll_combine", "topk_weights")) == 0)
    rc = need(why, sizeof why, a->out, 2, "ll_combine", "out");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_LL_COMBINE, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0)
    return rc;
  struct cuops_ll_combine_args k = {a->x, a->topk_idx, a->index_type, h->num_tokens,
                                    a->topk_weights, a->out, hdl_of(h)};
  return launch(c, CUOPS_K_LL_COMBINE, comm_grid(c), 0, &k, s, op);
}

/* ---- attach: load, make, warm up ---------------------------------------------------------- */

#ifdef DEP_HAVE_FATBIN
static double mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/*
 * Run every kernel once (bf16 and FP8 low-latency alike) with zero tokens,
 * on a private stream, so that the module is resident and the first real
 * call runs at steady-state latency.  The calls run on a loopback world of
 * one rank whose slab and counters are scratch memory of this client: the
 * same code paths (posting, waiting, the end-of-call ticket) without
 * depending on any peer, without writing into the job's slabs (which stay
 * as the daemon lent them: zero) and without touching the job's call count.
 */
static int warmup(dep_client_t *c) {
  const char *op = "dep_attach (kernel warm-up)";
  struct cuops_state *st = &c->cuops;
  struct dep_handle *h = calloc(1, sizeof *h);
  if (h == NULL)
    return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory", op);
  host_ops_handle_init(h);
  st->warm_h = h;
  /* Its scratch is in this rank's private area of its slab (zeroed on
   * st->stream, ahead of these calls), which lasts until detach. */
  CUstream s = st->stream;
  CUresult r;
  double t0 = mono_ms();
  const struct cuops_job job = st->job;
  st->job.world = 1;
  st->job.rank = 0;
  st->job.remote_mask = 0; /* no ring, no exchange region: nothing leaves this rank */
  st->job.slabs[0] = (uint8_t *)(uintptr_t)st->loop_slab;
  st->job.le = job.num_experts;
  st->job.kd = job.topk < job.num_experts ? job.topk : job.num_experts;
  st->job.parts = 8;
  st->job.dev = (struct cuops_dev *)(uintptr_t)st->loop_dev;
  int32_t *scr = (int32_t *)(uintptr_t)st->scratch;
  uint32_t nrecv = 0;
  int rc = cuops_handle_reserve(c, h, op, st->warm_mem);
  struct dep_layout_args la = {.size = sizeof la, .index_type = DEP_INDEX_I64,
                               .tokens_per_rank = scr, .tokens_per_expert = scr};
  struct dep_dispatch_args da = {.size = sizeof da, .index_type = DEP_INDEX_I64, .recv_x = scr,
                                 .recv_topk_idx = scr, .recv_topk_weights = (float *)scr,
                                 .recv_count_per_expert = scr, .num_recv = &nrecv,
                                 .expert_alignment = 2 /* dep__k_align warmed too */};
  struct dep_combine_args ca = {.size = sizeof ca};
  struct dep_ll_dispatch_args lda = {.size = sizeof lda, .index_type = DEP_INDEX_I64,
                                     .recv_x = scr, .recv_scales = (float *)scr,
                                     .recv_count = scr};
  struct dep_ll_combine_args lca = {.size = sizeof lca, .x = scr, .index_type = DEP_INDEX_I64};
  if (rc == 0)
    rc = cuda_ops_layout(c, &la, s);
  if (rc == 0)
    rc = cuda_ops_dispatch(c, &da, h, s);
  if (rc == 0)
    rc = cuda_ops_combine(c, &ca, h, s);
  /* Low-latency ops refuse jobs above CUOPS_LL_MAX_EXPERTS: nothing to warm there. */
  const bool ll = job.num_experts <= CUOPS_LL_MAX_EXPERTS;
  for (int fp8 = 0; fp8 < 2 && rc == 0 && ll; fp8++) {
    lda.use_fp8 = fp8;
    rc = cuda_ops_ll_dispatch(c, &lda, h, s);
    if (rc == 0)
      rc = cuda_ops_ll_combine(c, &lca, h, s);
  }
  st->job = job;
  /* The job's own slabs last: read a word of every 64 KiB of each, so the
   * page tables of the peers' memory are walked here, not by the first
   * operation. */
  struct cuops_touch_args ta = {c->layout.total_bytes};
  if (rc == 0)
    rc = launch(c, CUOPS_K_TOUCH, job.world, 0, &ta, s, op);
  if ((r = drv()->cuStreamSynchronize(s)) != CUDA_SUCCESS && rc == 0)
    rc = cu_fail(c, op, "cuStreamSynchronize", r);
  if (rc == 0)
    rc = cuops_poll(c, op, s, true);
  c->times.warmup_ms = mono_ms() - t0;
  return rc;
}
#endif

/*
 * CTAs one communicating kernel of this rank may use (cuda_ops.h: the SM
 * budget): the GPU's SMs shared out among the job's ranks on it, at most
 * CUOPS_MAX_CTAS, so that every rank's kernel is resident at once and a
 * lone rank leaves most of its GPU to the trainer's compute.
 */
uint32_t cuops_most_ctas(int sms, uint32_t sharing) {
  sms = sms < 1 ? 1 : sms;
  sharing = sharing < 1 ? 1 : sharing;
  const uint32_t most = CUOPS_CTAS_PER_SM * (uint32_t)sms / sharing;
  return most < 1 ? 1 : most;
}

int cuops_sm_budget(int sms, uint32_t sharing, const char *env, uint32_t *out, char *why,
                    size_t whylen) {
  sms = sms < 1 ? 1 : sms;
  sharing = sharing < 1 ? 1 : sharing;
  const uint32_t budget = (uint32_t)sms / sharing;
  *out = budget > CUOPS_MAX_CTAS ? CUOPS_MAX_CTAS : budget < 1 ? 1 : budget;
  /* The operator's override; at most what keeps every rank on this GPU
   * resident at once (CUOPS_CTAS_PER_SM each SM, shared out). */
  if (env == NULL || env[0] == '\0')
    return 0;
  const uint32_t most = cuops_most_ctas(sms, sharing);
  char *end = NULL;
  errno = 0;
  unsigned long v = strtoul(env, &end, 10);
  if (env[0] < '0' || env[0] > '9' || errno != 0 || *end != '\0' || v < 1 || v > most) {
    snprintf(why, whylen, "$" CUOPS_CTAS_ENV "=\"%s\" must be a number of CTAs from 1 to %u (%d "
             "SMs, %u ranks of the job on this GPU); fix or unset it", env, most, sms, sharing);
    return DEP_ERR_INVALID;
  }
  *out = (uint32_t)v;
  return 0;
}

int cuops_block_layout(const struct dep_job_shape *shape, uint32_t world,
                       const struct dep_slab_layout *lay, int sms, struct cuops_block *out,
                       char *why, size_t whylen) {
  uint64_t off = 0;
  out->dev = carve(&off, sizeof(struct cuops_dev));
  out->scratch = carve(&off, 4ull * shape->num_experts + 256);
  out->stage = carve(&off, (uint64_t)lay->max_ll_tokens * CUOPS_STAGE_ROW(shape->hidden));
  /* The dispatch's count scratch, for the largest SM budget sm_budget can
   * give (any split of CUOPS_CTAS_PER_SM CTAs per SM among the world's
   * ranks): the budget is known only after the daemon's reply. */
  out->tcnt_bytes = ((uint64_t)CUOPS_CTAS_PER_SM * (uint64_t)sms + world) * CUOPS_WARPS * 4 + 4096;
  out->tcnt = carve(&off, out->tcnt_bytes);
  out->loop_dev = carve(&off, sizeof(struct cuops_dev));
  out->loop_slab = carve(&off, lay->data_off + 4096);
  /* The warm-up's handle, whose world of one has every expert local. */
  uint64_t at[9];
  const uint32_t K = shape->topk;
  out->warm_handle = carve(&off, handle_carve(world, shape->max_tokens_per_rank,
                                              lay->max_ll_tokens, K,
                                              K < shape->num_experts ? K : shape->num_experts, at));
  out->end = off;
  if (sms < 1 || off > lay->priv_bytes) {
    snprintf(why, whylen, "the operations' memory (%llu bytes for %d SMs) overruns the slab's "
             "private area (%llu bytes); this is a bug, please report it",
             (unsigned long long)off, sms, (unsigned long long)lay->priv_bytes);
    return DEP_ERR_INTERNAL;
  }
  return 0;
}

#ifdef DEP_HAVE_FATBIN
/* The SMs of the current context's GPU (16 when the driver does not say). */
static int gpu_sms(const struct cudadrv *cu) {
  int sms = 0;
  CUdevice dev;
  if (cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
      sms < 1)
    sms = 16; /* unknown: small enough to fit anywhere */
  return sms;
}

/*
 * The rank's budget: $DEEPEP_KERNEL_CTAS where it is set, else the daemon's
 * choice for the job's key (TUNE: adaptive_optimization's table) where it
 * keeps every rank resident, else the default.  The daemon is told the
 * environment's value, so that deepepctl stats says which one the rank runs
 * with; a daemon that does not know TUNE leaves the default.
 */
static int sm_budget(dep_client_t *c, uint32_t *out) {
  char why[256] = "";
  const char *env = getenv(CUOPS_CTAS_ENV);
  const uint32_t sharing = c->ranks_on_dev ? c->ranks_on_dev : c->ops.world;
  int rc = cuops_sm_budget(c->cuops.sms, sharing, env, out, why, sizeof why);
  if (rc != 0)
    return client_seterr(c, rc, "dep_attach: %s", why);
  const bool by_env = env != NULL && env[0] != '\0';
  struct dep_msg_tune m = {.sms = (uint32_t)c->cuops.sms, .env_ctas = by_env ? *out : 0};
  struct dep_msg_tune_ok ok;
  struct client_frame f;
  if (m.sms > DEP_TUNE_MAX_SMS)
    return 0;
  rc = client_request(c, DEP_MSG_TUNE, &m, DEP_MSG_TUNE_OK, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc != 0)
    return c->fd < 0 ? rc : 0;
  if (!by_env && proto_decode_tune_ok(f.body, f.hdr.body_len, &ok) == 0 && ok.ctas >= 1 &&
      ok.ctas <= cuops_most_ctas(c->cuops.sms, sharing))
    *out = ok.ctas;
  client_frame_release(&f);
  return 0;
}
#endif

/*
 * The error record: host memory the kernels write through a device
 * mapping.  A page of our own pinned with cuMemHostRegister rather than
 * cuMemHostAlloc, which sets up the driver's pinned pool: on an H200 that
 * took 1.31 ms of a lone rank's attach against 0.33 ms registered (2.2
 * against 1.3 ms with 8 ranks attaching at once; BENCHMARKS.md, run 17).
 * After the record, in the same registration, room for `le` counts: a
 * dispatch given recv_count_per_expert_host copies its counts there on its
 * stream (a copy into pinned memory is queued, not staged), before the
 * synchronisation it makes anyway.  One page holds the record and some 950
 * counts.
 */
#ifdef DEP_HAVE_FATBIN
#define HOST_COUNTS_OFF dep_round_up(sizeof(struct cuops_host), 64)

static size_t host_record_bytes(uint32_t le) {
  return dep_round_up(HOST_COUNTS_OFF + (uint64_t)le * sizeof(int32_t),
                      (uint64_t)sysconf(_SC_PAGESIZE));
}

static CUresult host_record_make(const struct cudadrv *cu, struct cuops_state *st, uint32_t le) {
  const size_t bytes = host_record_bytes(le);
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult r = cu->cuMemHostRegister(p, bytes, CU_MEMHOSTREGISTER_PORTABLE |
                                                   CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS) {
    munmap(p, bytes);
    return r;
  }
  st->host = p; /* zero, as anonymous memory is */
  st->host_bytes = bytes;
  st->host_counts = (int32_t *)((uint8_t *)p + HOST_COUNTS_OFF);
  st->host_counts_cap = le;
  return CUDA_SUCCESS;
}
#endif

static void host_record_free(const struct cudadrv *cu, struct cuops_state *st) {
  if (st->host == NULL)
    return;
  cu->cuMemHostUnregister(st->host);
  munmap(st->host, st->host_bytes);
}

void cuda_ops_drop_kernels(dep_client_t *c) {
  if (c->lent_kernels != NULL)
    munmap(c->lent_kernels, c->lent_kernels_bytes);
  c->lent_kernels = NULL;
  c->lent_kernels_bytes = 0;
}

/* Take the cubin of a KERNELS_OK if it is a compile of this very image for this GPU. */
static void take_kernels(dep_client_t *c, const struct client_frame *f, const struct kimage *img,
                         int arch) {
  struct dep_msg_kernels_ok ok;
  int driver = 0;
  struct stat sb;
  if (proto_decode_kernels_ok(f->body, f->hdr.body_len, &ok) != 0 || f->nfds != 1 ||
      ok.arch != (uint32_t)arch || strcmp(ok.build, img->id) != 0 ||
      drv()->cuDriverGetVersion(&driver) != CUDA_SUCCESS || ok.driver != driver ||
      fstat(f->fds[0], &sb) != 0 || (uint64_t)sb.st_size != ok.bytes)
    return; /* another build, driver or GPU (or a malformed reply): the fatbin serves */
  void *p = mmap(NULL, (size_t)ok.bytes, PROT_READ, MAP_PRIVATE, f->fds[0], 0);
  if (p == MAP_FAILED)
    return;
  c->lent_kernels = p;
  c->lent_kernels_bytes = (size_t)ok.bytes;
}

int cuda_ops_fetch_kernels(dep_client_t *c) {
  cuda_ops_drop_kernels(c);
  struct kimage img;
  const struct cudadrv *cu = drv();
  int major = 0, minor = 0;
  if (!kimage_embedded(&img) || cu == NULL ||
      cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                               c->cuda_dev) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                               c->cuda_dev) != CUDA_SUCCESS ||
      kimage_fit(img.data, img.len, major, minor) == KIMAGE_SASS)
    return 0;
  const char *own = getenv(CUOPS_OWN_KERNELS_ENV);
  if (own != NULL && own[0] != '\0' && strcmp(own, "0") != 0) {
    if (strcmp(own, "1") == 0)
      return 0;
    return client_seterr(c, DEP_ERR_INVALID, "$" CUOPS_OWN_KERNELS_ENV "=\"%s\" must be 0 or 1; "
                         "fix or unset it", own);
  }
  struct dep_msg_kernels m;
  memcpy(m.device_uuid, c->args.device_uuid, sizeof m.device_uuid);
  struct client_frame f;
  int rc = client_request(c, DEP_MSG_KERNELS, &m, DEP_MSG_KERNELS_OK, CLIENT_REQUEST_TIMEOUT_MS,
                          &f);
  if (rc != 0)
    return c->fd < 0 ? rc : 0; /* the daemon has none to lend: the fatbin's PTX serves */
  take_kernels(c, &f, &img, major * 10 + minor);
  client_frame_release(&f);
  return 0;
}

int cuda_ops_prepare(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  memset(st, 0, sizeof *st);
#ifndef DEP_HAVE_FATBIN
  return 0; /* memory is lent all the same; the operations say why they cannot run */
#else
  const char *op = "dep_attach";
  char why[256] = "";
  double t0 = mono_ms();
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL)
    return client_seterr(c, DEP_ERR_UNSUPPORTED, "%s: %s", op, why);
  CUresult r = cu->cuCtxGetCurrent(&st->ctx);
  if (r != CUDA_SUCCESS || st->ctx == NULL)
    return client_seterr(c, DEP_ERR_CUDA, "%s: no CUDA context is current", op);
  /* The daemon's compile where it lent one (a driver that refuses it still
   * has the fatbin to compile), else the embedded fatbin. */
  struct kimage img;
  kimage_embedded(&img);
  r = CUDA_ERROR_INVALID_IMAGE;
  if (c->lent_kernels != NULL && (r = cu->cuModuleLoadData(&st->mod, c->lent_kernels)) != CUDA_SUCCESS)
    st->mod = NULL;
  st->lent_kernels = r == CUDA_SUCCESS;
  cuda_ops_drop_kernels(c);
  if (!st->lent_kernels && (r = cu->cuModuleLoadData(&st->mod, img.data)) != CUDA_SUCCESS) {
    st->mod = NULL;
    return cu_fail(c, op, "loading the embedded kernels (cuModuleLoadData)", r);
  }
  for (int k = 0; k < CUOPS_K_COUNT; k++)
    if ((r = cu->cuModuleGetFunction(&st->fn[k], st->mod, kernel_names[k])) != CUDA_SUCCESS)
      return client_seterr(c, DEP_ERR_CUDA, "%s: kernel %s: %s", op, kernel_names[k],
                           cudadrv_errstr(r));
  /* The job's local experts as this rank asks for them (the daemon checks the shape; one
   * it refuses gets no room, and no call). */
  const struct dep_attach_args *aa = &c->args;
  const uint32_t le = aa->world_size > 0 && aa->shape.num_experts <= DEP_SHAPE_MAX_EXPERTS
                          ? aa->shape.num_experts / aa->world_size : 0;
  if ((r = host_record_make(cu, st, le)) != CUDA_SUCCESS)
    return cu_fail(c, op, "pinning the error record (cuMemHostRegister)", r);
  if ((r = cu->cuMemHostGetDevicePointer(&st->host_dev, st->host, 0)) != CUDA_SUCCESS)
    return cu_fail(c, op, "cuMemHostGetDevicePointer (the error record)", r);
  /* The operations' memory is this rank's private area of its slab
   * (slab.h), placed by cuda_ops_attach once the slabs are mapped: one
   * cuMemAlloc fewer, which cost each of 8 ranks attaching at once 0.75 ms
   * (BENCHMARKS.md).  It is zeroed on this private stream, which the
   * warm-up then runs on. */
  st->sms = gpu_sms(cu);
  if ((r = cu->cuStreamCreate(&st->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
    st->stream = NULL;
    return cu_fail(c, op, "cuStreamCreate", r);
  }
  st->prepared = true;
  c->times.setup_ms = mono_ms() - t0;
  return 0;
#endif
}

#ifdef DEP_HAVE_FATBIN
/*
 * A job that spans nodes: the proxy's ring and the exchange region after it
 * (xring.h, slab.h), one host mapping registered for the device, where the
 * kernels push their descriptors, write their blocks for other nodes and
 * read and wait on the blocks from them (cuda_ops.h).  cuda_ops_detach
 * unregisters it, before client_unmap drains and unmaps it.
 */
static int ring_bind(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  j->in_slot_off = o->lay.in_slot_off;
  j->out_slot_off = o->lay.out_slot_off;
  j->in_off = o->lay.in_off;
  j->out_off = o->lay.out_off;
  j->n_remote = o->lay.n_remote;
  j->ring = j->xchg = NULL;
  if (j->remote_mask == 0)
    return 0;
  const struct cudadrv *cu = drv();
  CUresult r = cu->cuMemHostRegister(c->xring, DEP_XRING_BYTES + o->lay.xchg_bytes,
                                     CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "registering the ring to the daemon's proxy and the exchange "
                   "region for the GPU (cuMemHostRegister)", r);
  st->ring_pinned = c->xring;
  CUdeviceptr d = 0;
  if ((r = cu->cuMemHostGetDevicePointer(&d, c->xring, 0)) != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "cuMemHostGetDevicePointer (the ring to the proxy)", r);
  j->ring = (uint8_t *)(uintptr_t)d;
  j->xchg = j->ring + DEP_XRING_BYTES;
  return 0;
}
#endif

int cuda_ops_attach(dep_client_t *c) {
#ifndef DEP_HAVE_FATBIN
  return 0;
#else
  struct cuops_state *st = &c->cuops;
  /* A job spanning nodes whose daemon lent no ring: its operations refuse
   * (ops.c, saying why), so nothing is bound. */
  if (!st->prepared || (c->args.world_size != c->args.local_world_size && c->xring == NULL))
    return 0;
  const struct cudadrv *cu = drv();
  struct cuops_job *j = &st->job;
  const struct ops_ctx *o = &c->ops;
  struct cuops_block b;
  char why[256] = "";
  int rc = cuops_block_layout(&o->shape, o->world, &o->lay, st->sms, &b, why, sizeof why);
  if (rc != 0)
    return client_seterr(c, rc, "dep_attach: %s", why);
  const CUdeviceptr priv = (CUdeviceptr)(uintptr_t)(o->slabs[o->rank] + o->lay.priv_off);
  st->dev = priv + b.dev;
  st->scratch = priv + b.scratch;
  st->stage = priv + b.stage;
  st->tcnt = priv + b.tcnt;
  st->tcnt_bytes = b.tcnt_bytes;
  st->loop_dev = priv + b.loop_dev;
  st->loop_slab = priv + b.loop_slab;
  st->warm_mem = priv + b.warm_handle;
  CUresult r = cu->cuMemsetD8Async(priv, 0, b.end, st->stream);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, "dep_attach", "zeroing the operations' memory", r);
  j->remote_mask = 0;
  for (uint32_t i = 0; i < o->world; i++) {
    j->slabs[i] = o->slabs[i];
    j->remote_mask |= o->remote[i] >= 0 ? 1ull << i : 0;
  }
  if ((rc = ring_bind(c)) != 0)
    return rc;
  j->data_off = o->lay.data_off;
  j->block_bytes = o->lay.block_bytes;
  j->parity_bytes = o->lay.parity_bytes;
  j->row_bytes = o->lay.row_bytes;
  j->world = o->world;
  j->rank = o->rank;
  j->hidden = o->shape.hidden;
  j->topk = o->shape.topk;
  j->num_experts = o->shape.num_experts;
  j->le = o->shape.num_experts / o->world;
  j->kd = j->topk < j->le ? j->topk : j->le;
  j->max_tokens = o->shape.max_tokens_per_rank;
  j->max_ll = o->lay.max_ll_tokens;
  uint32_t budget = 0;
  rc = sm_budget(c, &budget);
  if (rc != 0)
    return rc;
  j->parts = budget / o->world;
  j->parts = j->parts < 1 ? 1 : j->parts;
  /* The dispatch senders' counts: one word per (destination, sender warp);
   * the warm-up's world of one (8 parts) needs at most this or 4 KiB. */
  if ((uint64_t)o->world * j->parts * CUOPS_WARPS * 4 + 4096 > st->tcnt_bytes)
    return client_seterr(c, DEP_ERR_INTERNAL, "dep_attach: %u parts of %u ranks overrun the "
                         "dispatch's count scratch (%llu bytes); this is a bug, please report it",
                         j->parts, o->world, (unsigned long long)st->tcnt_bytes);
  j->tcnt = (uint32_t *)(uintptr_t)st->tcnt;
  j->timeout_ns = (uint64_t)o->timeout_ms * 1000000ull;
  j->host = (struct cuops_host *)(uintptr_t)st->host_dev;
  j->dev = (struct cuops_dev *)(uintptr_t)st->dev;
  st->ready = true;
  rc = c->attach_ok.kernel_warmup ? warmup(c) : 0;
  /* The block's zeroing is done before any operation uses it. */
  r = cu->cuStreamSynchronize(st->stream);
  if (r != CUDA_SUCCESS && rc == 0)
    rc = cu_fail(c, "dep_attach", "cuStreamSynchronize", r);
  cu->cuStreamDestroy(st->stream);
  st->stream = NULL;
  return rc;
#endif
}

void cuda_ops_stats_bind(dep_client_t *c) {
#ifdef DEP_HAVE_FATBIN
  struct cuops_state *st = &c->cuops;
  const struct cudadrv *cu = drv();
  if (c->stats.page == NULL || !st->ready || cu == NULL)
    return;
  CUcontext dummy;
  if (cu->cuCtxPushCurrent(st->ctx) != CUDA_SUCCESS)
    return;
  CUdeviceptr d = 0;
  void *p = c->stats.page;
  if (cu->cuMemHostRegister(p, DEP_STATS_PAGE_BYTES, CU_MEMHOSTREGISTER_PORTABLE |
                                                        CU_MEMHOSTREGISTER_DEVICEMAP) ==
      CUDA_SUCCESS) {
    if (cu->cuMemHostGetDevicePointer(&d, p, 0) == CUDA_SUCCESS) {
      st->stats_pinned = p;
      st->job.stats = (struct dep_stats_page *)(uintptr_t)d;
    } else {
      cu->cuMemHostUnregister(p);
    }
  }
  cu->cuCtxPopCurrent(&dummy);
#else
  (void)c;
#endif
}

void cuda_ops_detach(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  cuda_ops_drop_kernels(c);
  if (st->ctx == NULL && st->warm_h == NULL) {
    memset(st, 0, sizeof *st);
    return; /* never loaded: do not initialise CUDA here (a parent may fork after) */
  }
  const struct cudadrv *cu = drv();
  if (st->warm_h != NULL) {
    cuda_ops_handle_free(st->warm_h);
    host_ops_handle_fini(st->warm_h);
    free(st->warm_h);
  }
  if (cu != NULL && st->ctx != NULL) {
    CUcontext dummy;
    bool pushed = cu->cuCtxPushCurrent(st->ctx) == CUDA_SUCCESS;
    if (st->mod != NULL)
      cu->cuModuleUnload(st->mod);
    host_record_free(cu, st);
    if (st->stats_pinned != NULL)
      cu->cuMemHostUnregister(st->stats_pinned);
    if (st->ring_pinned != NULL)
      cu->cuMemHostUnregister(st->ring_pinned);
    if (st->stream != NULL)
      cu->cuStreamDestroy(st->stream);
    if (pushed)
      cu->cuCtxPopCurrent(&dummy);
  }
  memset(st, 0, sizeof *st);
}
