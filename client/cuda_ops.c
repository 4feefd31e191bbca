/*
 * cuda_ops.c — the cuda backend's MoE operations: argument checks, kernel
 * launches on the caller's stream, and the error record the kernels leave
 * in pinned host memory (see kabi.h for the protocol, cuda_ops.h for what is
 * checked where); the handles' device arrays are cuda_handles.c's, loading
 * the kernels and binding them to the job (attach) cuda_attach.c's.  The
 * kernels are the embedded fatbin (kernels/ops.cu).
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "cuda_ops_internal.h"
#include "shape.h"
#include "sm_budget.h"
#include "xring.h"

/* ---- the error record -------------------------------------------------------------- */

static const char *op_name(uint32_t op) {
  return op == 0 ? "layout" : host_ops_op_name(op);
}

/* Whether rank r of the job is on another node (the host's table, for every world). */
static bool source_far(const dep_client_t *c, uint32_t r) {
  return r < c->ops.world && c->ops.remote != NULL && c->ops.remote[r] >= 0;
}

/* The words for a split call's failures (kabi.h "Split calls"), into m. */
static void cuops_split_words(const dep_client_t *c, const struct ops_err_record *r,
                              int32_t code, const char *what, char *m, size_t len) {
  const bool far = source_far(c, r->source);
  if (r->phase == CUOPS_PHASE_TAKEN && code == DEP_ERR_DAEMON_GONE)
    snprintf(m, len, "%s (call %llu, waiting for rank %u on another node to read call %llu): "
             OPS_DAEMON_GONE_WHY, what, (unsigned long long)r->seq, r->source,
             (unsigned long long)r->seen_flag);
  else if (r->phase == CUOPS_PHASE_TAKEN && code != DEP_ERR_TIMEOUT)
    snprintf(m, len, "%s: the daemon's proxy stopped serving this rank while call %llu waited "
             "for rank %u on another node to read call %llu: %s; restart the job", what,
             (unsigned long long)r->seq, r->source, (unsigned long long)r->seen_flag,
             code == DEP_ERR_PEER ? "a node of the job is gone" : dep_strerror(code));
  else if (r->phase == CUOPS_PHASE_TAKEN)
    snprintf(m, len, "call %llu: rank %u has not read call %llu in %u ms, and %s reuses its "
             "slots: that rank has not run call %llu's receive (DEP_LL_RECV), or has stopped%s; "
             "every rank must receive each of its split calls", (unsigned long long)r->seq,
             r->source, (unsigned long long)r->seen_flag, r->waited_ms, what,
             (unsigned long long)r->seen_flag,
             far ? ", or its node's daemon or the link to it is stuck (deepepctl peers on both "
                   "nodes)"
                 : "");
  else
    snprintf(m, len, "%s: the receive (DEP_LL_RECV) of call %llu found no send of that call on "
             "the device (it holds call %llu's); a CUDA graph that counts calls was replayed, or "
             "a call launched on another stream, between the send and its receive: keep a split "
             "call's send, the calls between, and its receive on one stream, and a captured "
             "send with its receive", what, (unsigned long long)r->seq,
             (unsigned long long)r->seen_flag);
}

/* The words for a streamed call's failures (kernels/ops_stream.cuh), into m. */
static void cuops_stream_words(const dep_client_t *c, const struct ops_err_record *r,
                               int32_t code, const char *what, char *m, size_t len) {
  const bool far = source_far(c, r->source);
  if (r->phase == CUOPS_PHASE_CREDIT && code == DEP_ERR_DAEMON_GONE)
    snprintf(m, len, "%s (call %llu, waiting for rank %u on another node to take this rank's "
             "rows): " OPS_DAEMON_GONE_WHY, what, (unsigned long long)r->seq, r->source);
  else if (r->phase == CUOPS_PHASE_CREDIT && code != DEP_ERR_TIMEOUT)
    snprintf(m, len, "%s: the daemon's proxy stopped serving this rank while call %llu waited "
             "for rank %u on another node to take this rank's rows: %s; restart the job", what,
             (unsigned long long)r->seq, r->source,
             code == DEP_ERR_PEER ? "a node of the job is gone" : dep_strerror(code));
  else if (r->phase == CUOPS_PHASE_CREDIT)
    snprintf(m, len, "timeout in %s waiting for rank %u to take this rank's rows out of its "
             "channel (call %llu, %u ms, %llu rows taken): that rank posted the call but stopped "
             "receiving (it died or its GPU is stuck%s); restart the job", what, r->source,
             (unsigned long long)r->seq, r->waited_ms, (unsigned long long)r->seen_flag,
             far ? ", or its node's daemon or the link to it is stuck: deepepctl peers on both "
                   "nodes"
                 : "");
  else
    snprintf(m, len, "in %s (call %llu) rank %u failed its part of the call with %s, and sends "
             "or takes no more of its rows (its own error says why); %s", what,
             (unsigned long long)r->seq, r->source, dep_errname((int)(int32_t)r->seen_flag),
             code == DEP_ERR_PEER ? "the job cannot go on: restart it"
                                  : "this call's outputs are not valid");
}

/* The words for a kernel's error record r (code as cuops_poll reads it, what the
 * operation's name), into m: which rank, which call, what it waited for, and what to do. */
static void cuops_record_words(const dep_client_t *c, const struct ops_err_record *r,
                               int32_t code, const char *what, char *m, size_t len) {
  switch (r->phase) {
  case CUOPS_PHASE_WAIT:
    snprintf(m, len, "timeout in %s waiting for rank %u (call %llu, %u ms, its flag read "
             "%llu): that rank did not make the same call%s; check that every rank runs the same "
             "sequence of operations and is alive", what, r->source, (unsigned long long)r->seq,
             r->waited_ms, (unsigned long long)r->seen_flag,
             source_far(c, r->source)
                 ? ", or its node's daemon or the link to it is stuck (deepepctl peers on both "
                   "nodes)"
                 : "");
    break;
  case CUOPS_PHASE_ROW:
    snprintf(m, len, "timeout in %s waiting for rows from rank %u (call %llu, %u ms, a row's "
             "mark read %#llx): that rank posted the call but stopped sending (it died or its "
             "GPU is stuck); restart the job", what, r->source, (unsigned long long)r->seq,
             r->waited_ms, (unsigned long long)r->seen_flag);
    break;
  case CUOPS_PHASE_GONE: {
    if (code == DEP_ERR_DAEMON_GONE) {
      snprintf(m, len, "%s (call %llu, after %u ms): " OPS_DAEMON_GONE_WHY, what,
               (unsigned long long)r->seq, r->waited_ms);
      break;
    }
    const uint32_t how = OPS_ERR_GONE_HOW(r->seen_flag), pid = OPS_ERR_GONE_PID(r->seen_flag);
    if (how == DEP_SLAB_GONE_CUT) { /* source names this node's rank, pid the winner's */
      snprintf(m, len, "%s (call %llu, after %u ms): " OPS_CUT_WHY, what,
               (unsigned long long)r->seq, r->waited_ms, pid);
      break;
    }
    char pidtext[24] = ""; /* no pid: a rank on another node, whose pid this daemon never learns */
    if (pid != 0)
      snprintf(pidtext, sizeof pidtext, " (pid %u)", pid);
    snprintf(m, len, "rank %u%s of the job is gone (%s) while this rank waited in %s "
             "(call %llu, after %u ms); the job cannot go on: restart it", r->source, pidtext,
             how == DEP_SLAB_GONE_NODE ? "its node is lost: the peer link to its daemon dropped"
             : how == DEP_SLAB_GONE_DETACHED ? "it detached"
                                             : "its process ended",
             what, (unsigned long long)r->seq, r->waited_ms);
    break;
  }
  case CUOPS_PHASE_RING:
    if (code == DEP_ERR_TIMEOUT)
      snprintf(m, len, "%s: the proxy's ring stayed full for %u ms (call %llu, for rank %u "
               "on another node); the daemon's proxy is stuck or its link to that node is too "
               "slow: see deepepctl peers", what, r->waited_ms, (unsigned long long)r->seq,
               r->source);
    else if (code == DEP_ERR_DAEMON_GONE)
      snprintf(m, len, "%s (call %llu, for rank %u on another node): " OPS_DAEMON_GONE_WHY,
               what, (unsigned long long)r->seq, r->source);
    else
      snprintf(m, len, "%s: the daemon's proxy stopped serving this rank (call %llu, for "
               "rank %u on another node): %s; restart the job", what, (unsigned long long)r->seq,
               r->source, code == DEP_ERR_PEER ? "a node of the job is gone" : dep_strerror(code));
    break;
  case CUOPS_PHASE_AHEAD:
    snprintf(m, len, "in %s rank %u is at call %llu, this rank at call %llu; a rank "
             "restarted or the slabs were not fresh: restart the job", what, r->source,
             (unsigned long long)r->seen_flag, (unsigned long long)r->seq);
    break;
  case CUOPS_PHASE_WORST:
    snprintf(m, len, "%s (call %llu) received %llu rows, more than its num_worst_tokens; "
             "give num_worst_tokens at least the rows a rank can receive (world_size * "
             "max_tokens_per_rank at most); the call's outputs are not valid", what,
             (unsigned long long)r->seq, (unsigned long long)r->seen_flag);
    break;
  case CUOPS_PHASE_IDS:
    snprintf(m, len, "%s found topk_idx of token %u = %lld: expert ids must be in [-1, "
             "num_experts %u)%s; the call's outputs are not valid", what, r->source,
             (long long)r->seen_flag, c->args.shape.num_experts,
             (r->op & ~OPS_OP_FP8) == OPS_OP_LL_COMBINE
                 ? " and equal to those given to the matching dep_ll_dispatch" : "");
    break;
  case CUOPS_PHASE_TAKEN:
  case CUOPS_PHASE_UNSENT:
    cuops_split_words(c, r, code, what, m, len);
    break;
  case CUOPS_PHASE_CREDIT:
  case CUOPS_PHASE_STOPPED:
    cuops_stream_words(c, r, code, what, m, len);
    break;
  default:
    snprintf(m, len, "call %llu (%s): rank %u made another call, combined another dispatch "
             "or sent malformed rows (its slot read %#llx); every rank must make the same "
             "sequence of calls, each combine with the handle of the same dispatch; outputs were "
             "not written", (unsigned long long)r->seq, what, r->source,
             (unsigned long long)r->seen_flag);
  }
}

/*
 * Report what the kernels recorded, if anything: the record's code with a
 * message.  `own` says the record is this synchronised call's: its ranks
 * stayed in step, so a failure other than a timeout or a gone rank is
 * cleared and the context stays usable.  A record found at the start of a call comes from
 * an earlier, unsynchronised call; this call is then not made, and since
 * the peers make it, the context is broken from here on.
 */
int cuops_poll(dep_client_t *c, const char *op, CUstream s, bool own) {
  volatile struct ops_err_record *e = &c->cuops.host->err;
  int32_t code = e->code;
  if (code == 0)
    return 0;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  struct ops_err_record r = {.code = code, .op = e->op, .rank = e->rank, .source = e->source,
                        .seq = e->seq, .seen_flag = e->seen_flag, .waited_ms = e->waited_ms,
                        .phase = e->phase};
  const char *what = op_name(r.op & ~(OPS_OP_FP8 | OPS_OP_CACHED | OPS_OP_WEIGHTS));
  /* The kernels record every abort as DEP_ERR_PEER; words the library wrote
   * because this node's daemon is gone (cuda_ops_daemon_gone) say so. */
  if (r.phase == CUOPS_PHASE_GONE && OPS_ERR_GONE_HOW(r.seen_flag) == DEP_SLAB_GONE_DAEMON)
    code = DEP_ERR_DAEMON_GONE;
  if (!own || code == DEP_ERR_TIMEOUT || code == DEP_ERR_PEER || code == DEP_ERR_DAEMON_GONE ||
      r.phase == CUOPS_PHASE_AHEAD || r.phase == CUOPS_PHASE_RING ||
      r.phase == CUOPS_PHASE_TAKEN) {
    c->cuops.broken = true;
  } else {
    e->code = 0;
    drv()->cuMemsetD32Async(c->cuops.dev + offsetof(struct cuops_dev, claim), 0, 1, s);
  }
  char m[600];
  cuops_record_words(c, &r, code, what, m, sizeof m);
  if (own)
    return client_seterr(c, code, "%s: %s", op, m);
  return client_seterr(c, code, "%s: not run: an earlier call failed on the GPU: %s; this rank "
                       "is now out of step with its peers: detach and restart the job", op, m);
}

void cuda_ops_daemon_gone(dep_client_t *c) {
  struct cuops_state *st = &c->cuops;
  const struct cudadrv *cu = drv();
  if (!st->ready || cu == NULL || cu->cuCtxPushCurrent(st->ctx) != CUDA_SUCCESS)
    return;
  const CUdeviceptr words = (CUdeviceptr)(uintptr_t)(c->ops.slabs[c->ops.rank] + DEP_SLAB_ABORT_OFF);
  struct dep_slab_abort ab = {.rank = DEP_SLAB_GONE_NO_RANK, .pid = 0,
                           .detached = DEP_SLAB_GONE_DAEMON, .code = 0};
  int32_t told = 0;
  CUstream s = NULL;
  if (cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
    if (cu->cuMemcpyDtoHAsync(&told, words + offsetof(struct dep_slab_abort, code), sizeof told, s) ==
            CUDA_SUCCESS &&
        cu->cuStreamSynchronize(s) == CUDA_SUCCESS && told == 0) {
      /* Who and how first, the code last, in stream order: a kernel that
       * reads the code (acquire, system scope) reads the rest after it. */
      const int32_t code = DEP_ERR_DAEMON_GONE;
      if (cu->cuMemcpyHtoDAsync(words, &ab, offsetof(struct dep_slab_abort, code), s) ==
          CUDA_SUCCESS)
        cu->cuMemcpyHtoDAsync(words + offsetof(struct dep_slab_abort, code), &code, sizeof code, s);
      cu->cuStreamSynchronize(s); /* before ab and code leave scope */
    }
    cu->cuStreamDestroy(s);
  }
  CUcontext dummy;
  cu->cuCtxPopCurrent(&dummy);
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

/* The communicating kernels, the timed four (kabi.h): each begins with call_begin and ends
 * with call_end (ops_dev.cuh), which advances the device's count of calls by one. */
static bool cuops_communicates(enum cuops_kernel k) {
  return k == CUOPS_K_DISPATCH || k == CUOPS_K_COMBINE || k == CUOPS_K_LL_DISPATCH ||
         k == CUOPS_K_LL_COMBINE || k == CUOPS_K_DISPATCH_STREAM || k == CUOPS_K_COMBINE_STREAM ||
         k == CUOPS_K_DISPATCH_NODE;
}

/* The throughput kernel of a job: the streamed one where the layout makes channels (slab.h). */
static enum cuops_kernel tp_kernel(const dep_client_t *c, enum cuops_kernel whole,
                                   enum cuops_kernel streamed) {
  return c->cuops.job.chan_rows < c->cuops.job.max_tokens ? streamed : whole;
}

/* Launch k; `counts`: it is a call of the job's sequence, which the host counts where the
 * host backend counts its own (ops_ctx.seq, from the join call on a rank that came back:
 * cuda_ops_attach), so that dep_next_call reads the same count on both backends without
 * reading device memory; the device's count reaches it as the launched calls end. */
static int launch(dep_client_t *c, enum cuops_kernel k, unsigned grid, void *args, CUstream s,
                  const char *op, bool counts) {
  struct ctx_guard g;
  int rc = ctx_enter(c, &g, op);
  if (rc != 0)
    return rc;
  void *params[2] = {&c->cuops.job, args};
  CUresult r = drv()->cuLaunchKernel(c->cuops.fn[k], grid, 1, 1, CUOPS_THREADS, 1, 1,
                                     dep__shmem_of(k, c->cuops.job.world,
                                                   c->cuops.job.num_experts),
                                     s, params, NULL);
  ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return cu_fail(c, op, "cuLaunchKernel", r);
  if (counts)
    c->ops.seq++;
  return 0;
}

int cuops_launch(dep_client_t *c, enum cuops_kernel k, unsigned grid, void *args, CUstream s,
                 const char *op) {
  return launch(c, k, grid, args, s, op, cuops_communicates(k));
}

unsigned dep__shmem_of(enum cuops_kernel k, uint32_t world, uint32_t num_experts) {
  switch (k) {
  case CUOPS_K_LL_DISPATCH:
    return dep__kernel_shmem(world, num_experts, true);
  case CUOPS_K_DISPATCH:
  case CUOPS_K_COMBINE:
  case CUOPS_K_LL_COMBINE:
  case CUOPS_K_DISPATCH_STREAM:
  case CUOPS_K_COMBINE_STREAM:
  case CUOPS_K_DISPATCH_NODE:
  case CUOPS_K_LL_INFO:
    return dep__kernel_shmem(world, num_experts, false);
  default:
    return 0;
  }
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

/* The grid of a communicating kernel (kabi.h: the SM budget), at most the budget whatever
 * the world: its CTAs loop over the units (dep__kernel_grid). */
static unsigned comm_grid(const dep_client_t *c) {
  return c->cuops.grid;
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
  return cuops_launch(c, CUOPS_K_LAYOUT, grid, &k, s, op);
}

/* cuda_ops_dispatch's checks before launch, on the host: why says what is wrong. */
static int cuops_dispatch_check(const dep_client_t *c, const struct dep_dispatch_args *a,
                                const struct dep_handle *h, char *why, size_t whylen) {
  /* The host must not read device ids: the checks run on num_tokens 0 (a
   * cached dispatch reads none, and its num_tokens is checked against the
   * handle's), then the pointers num_tokens needs. */
  struct dep_dispatch_args z = *a;
  if (!a->cached)
    z.num_tokens = 0;
  int rc = ops_check_dispatch(&c->ops, &z, h, why, whylen);
  if (rc == 0)
    rc = host_ops_slots_free(&c->ops, why, whylen);
  if (rc == 0)
    rc = tokens_ok(why, whylen, a->num_tokens, c->ops.shape.max_tokens_per_rank, "dispatch",
                   "max_tokens_per_rank");
  if (rc == 0 && a->num_tokens > 0 && !a->cached &&
      (rc = need(why, whylen, a->x, a->use_fp8 ? 1 : 2, "dispatch", "x")) == 0 &&
      (!a->use_fp8 || (rc = need(why, whylen, a->x_scales, 4, "dispatch", "x_scales")) == 0) &&
      (rc = need(why, whylen, a->topk_idx, IDX_ALIGN(a->index_type), "dispatch",
                 "topk_idx")) == 0)
    rc = need(why, whylen, a->topk_weights, 4, "dispatch", "topk_weights");
  if (rc == 0 && a->cached && h->cuda == NULL)
    rc = DEP_ERR_INVALID, snprintf(why, whylen, "dispatch (cached): handle was not filled on the GPU");
  const uint32_t le = c->cuops.job.le;
  if (rc == 0 && a->recv_count_per_expert_host != NULL && le > c->cuops.host_counts_cap)
    rc = DEP_ERR_INTERNAL,
    snprintf(why, whylen, "dispatch: the job's %u local experts overrun the pinned room for "
             "recv_count_per_expert_host (%u, made at attach); this is a bug, please report it",
             le, c->cuops.host_counts_cap);
  return rc;
}

int cuda_ops_dispatch(dep_client_t *c, const struct dep_dispatch_args *a, struct dep_handle *h,
                      dep_stream_t stream) {
  const char *op = "dep_dispatch";
  CUstream s = stream;
  char why[256] = "";
  int rc = cuops_dispatch_check(c, a, h, why, sizeof why);
  const uint32_t le = c->cuops.job.le;
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
  /* A job with node channels: its own kernel of the streamed dispatch (kabi.h). */
  const enum cuops_kernel streamed =
      c->cuops.job.n_nodes != 0 ? CUOPS_K_DISPATCH_NODE : CUOPS_K_DISPATCH_STREAM;
  if ((rc = cuops_launch(c, tp_kernel(c, CUOPS_K_DISPATCH, streamed), comm_grid(c), &k, s,
                         op)) != 0)
    return rc;
  if (align != 0 && (rc = cuops_launch(c, CUOPS_K_ALIGN, 1, &k, s, op)) != 0)
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
  const volatile uint32_t *from = c->cuops.host_from;
  h->num_recv = hp->num_recv;
  for (uint32_t i = 0; i < c->ops.world; i++)
    h->recv_from[i] = from[i];
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
  if (rc == 0)
    rc = host_ops_slots_free(&c->ops, why, sizeof why);
  if (rc == 0 && h->cuda == NULL)
    rc = DEP_ERR_INVALID, snprintf(why, sizeof why, "combine: handle was not filled on the GPU");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_COMBINE, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0)
    return rc;
  struct cuops_combine_args k = {a->x, a->out, h->num_tokens, 0, a->topk_weights,
                                 a->out_topk_weights, a->bias_0, a->bias_1, hdl_of(h)};
  return cuops_launch(c, tp_kernel(c, CUOPS_K_COMBINE, CUOPS_K_COMBINE_STREAM), comm_grid(c),
                      &k, s, op);
}

/* A low-latency call's phases as the kernels run them (0 is the whole call). */
static uint32_t ll_phase(uint32_t phases) {
  return phases == 0 ? CUOPS_WHOLE : phases;
}

/* A split send (kabi.h "Split calls") has been launched as call c->ops.seq: what its
 * receive checks (ops_check's phases rules, host_ops_slots_free) and runs with. */
static void ll_sent(dep_client_t *c, uint32_t op, const struct dep_handle *h) {
  struct ops_pending *p = &c->ops.pend[c->ops.seq & 1];
  p->seq = c->ops.seq;
  p->op = op;
  p->h = h;
}

/* A split receive of the send h holds, about to be launched: its `back` (the calls
 * launched since the send, 0 or 1 by host_ops_slots_free), and the send is no longer pending,
 * whatever the launch returns (as on the host backend). */
static uint32_t ll_received(dep_client_t *c, const struct dep_handle *h) {
  const uint64_t sent = host_ops_pending(&c->ops, h);
  struct ops_pending *p = &c->ops.pend[sent & 1];
  p->seq = 0;
  p->h = NULL;
  return (uint32_t)(c->ops.seq - sent);
}

int cuda_ops_ll_dispatch(dep_client_t *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h, dep_stream_t stream) {
  const char *op = "dep_ll_dispatch";
  CUstream s = stream;
  char why[256] = "";
  const uint32_t phase = ll_phase(a->phases);
  /* The host must not read device ids; a receive reads none, and its num_tokens is checked
   * against its send's. */
  struct dep_ll_dispatch_args z = *a;
  if (phase != CUOPS_RECV)
    z.num_tokens = 0;
  int rc = ops_check_ll_dispatch(&c->ops, &z, h, why, sizeof why);
  if (rc == 0 && phase != CUOPS_RECV)
    rc = host_ops_slots_free(&c->ops, why, sizeof why);
  if (rc == 0)
    rc = tokens_ok(why, sizeof why, a->num_tokens, c->ops.lay.max_ll_tokens, "ll_dispatch",
                   "max_ll_tokens_per_rank");
  if (rc == 0 && c->ops.shape.num_experts > CUOPS_LL_MAX_EXPERTS)
    rc = DEP_ERR_UNSUPPORTED,
    snprintf(why, sizeof why, "ll_dispatch: the cuda kernels take at most %u experts (the job has "
             "%u); use throughput mode (dep_dispatch) or the host backend", CUOPS_LL_MAX_EXPERTS,
             c->ops.shape.num_experts);
  if (rc == 0 && phase != CUOPS_RECV && a->num_tokens > 0 &&
      (rc = need(why, sizeof why, a->x, 2, "ll_dispatch", "x")) == 0)
    rc = need(why, sizeof why, a->topk_idx, IDX_ALIGN(a->index_type), "ll_dispatch", "topk_idx");
  if (rc != 0)
    return cuops_refused(c, DEP_STATS_OP_LL_DISPATCH, rc, op, why);
  if ((rc = cuops_begin(c, op, s)) != 0 ||
      (phase != CUOPS_RECV && (rc = cuops_handle_reserve(c, h, op, 0)) != 0))
    return rc;
  struct cuops_ll_dispatch_args k = {a->x, a->topk_idx, a->index_type, a->num_tokens, a->use_fp8,
                                     phase, a->recv_x, a->recv_scales, a->recv_count,
                                     (uint8_t *)(uintptr_t)c->cuops.stage, hdl_of(h),
                                     a->wait_cost, 0, 0};
  if (phase == CUOPS_RECV) {
    k.back = ll_received(c, h);
    return launch(c, CUOPS_K_LL_DISPATCH, comm_grid(c), &k, s, op, false);
  }
  /* FP8: every token cast once, before the senders copy it to each rank
   * that needs it (the cast, not the copy, bounded the call). */
  unsigned cast = (a->num_tokens + CUOPS_WARPS - 1) / CUOPS_WARPS;
  cast = cast < 1 ? 1 : cast > CUOPS_MAX_CTAS ? CUOPS_MAX_CTAS : cast;
  if (a->use_fp8 && (rc = cuops_launch(c, CUOPS_K_LL_CAST, cast, &k, s, op)) != 0)
    return rc;
  if ((rc = cuops_launch(c, CUOPS_K_LL_DISPATCH, comm_grid(c), &k, s, op)) != 0)
    return rc;
  /* No synchronisation: what the host cannot know stays on the device. */
  h->num_tokens = a->num_tokens;
  h->num_recv = 0;
  h->idx_hash = 0;
  h->kind = OPS_HANDLE_LL;
  if (phase == CUOPS_SEND)
    ll_sent(c, OPS_OP_LL_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0u), h);
  return 0;
}

int cuda_ops_ll_combine(dep_client_t *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h, dep_stream_t stream) {
  const char *op = "dep_ll_combine";
  CUstream s = stream;
  char why[256] = "";
  const uint32_t phase = ll_phase(a->phases);
  int rc;
  if (h != NULL) {
    /* num_tokens 0: the host must not hash device ids.  The phases are checked against h
     * itself: its pending send is found by its address, which the copy has not. */
    struct dep_handle hz = *h;
    struct dep_ll_combine_args az = *a;
    hz.num_tokens = 0;
    az.phases = 0;
    rc = ops_check_ll_combine(&c->ops, &az, &hz, why, sizeof why);
    if (rc == 0)
      rc = ops_check_phases(&c->ops, a->phases, h, OPS_OP_LL_COMBINE, "ll_combine", why,
                            sizeof why);
  } else {
    rc = ops_check_ll_combine(&c->ops, a, h, why, sizeof why);
  }
  if (rc == 0 && phase != CUOPS_RECV)
    rc = host_ops_slots_free(&c->ops, why, sizeof why);
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
                                    a->topk_weights, a->out, hdl_of(h), a->wait_cost, phase, 0};
  if (phase == CUOPS_RECV) {
    k.back = ll_received(c, h);
    return launch(c, CUOPS_K_LL_COMBINE, comm_grid(c), &k, s, op, false);
  }
  if ((rc = cuops_launch(c, CUOPS_K_LL_COMBINE, comm_grid(c), &k, s, op)) != 0)
    return rc;
  if (phase == CUOPS_SEND)
    ll_sent(c, OPS_OP_LL_COMBINE, h);
  return 0;
}

/* ops.c checked the handle's kind and the pointers; here what the kernel
 * needs: the handle's device arrays, and a grid of one CTA per local expert. */
int cuda_ops_ll_handle_info(dep_client_t *c, const struct dep_ll_handle_info_args *a,
                            const struct dep_handle *h, dep_stream_t stream) {
  const char *op = "dep_ll_handle_info";
  CUstream s = stream;
  if (h->cuda == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: handle was not filled on the GPU", op);
  /* A split send fills the handle's host fields (the host backend's leaves it empty until
   * its receive); its arrays are the receive's to write. */
  const uint64_t held = host_ops_pending(&c->ops, h);
  if (held != 0)
    return client_seterr(c, DEP_ERR_INVALID, "%s: phases: the handle holds the send of call "
                         "%llu, whose receive (DEP_LL_RECV) has not run; run it first", op,
                         (unsigned long long)held);
  int rc = cuops_begin(c, op, s);
  if (rc != 0)
    return rc;
  struct cuops_ll_info_args k = {a->src_info, a->layout_range, hdl_of(h)};
  return cuops_launch(c, CUOPS_K_LL_INFO, c->cuops.job.le, &k, s, op);
}

/* ---- masked ranks (deepep.h; the kernels' side is kabi.h's) ------------------------------- */

/* The mask calls' way in: the kernels bound, the rank's context current (g). */
static int mask_enter(dep_client_t *c, const char *op, struct ctx_guard *g) {
  return c->cuops.ready ? ctx_enter(c, g, op) : no_kernels(c, op);
}

int cuda_ops_mask_own(dep_client_t *c, const char *op) {
  struct ctx_guard g;
  int rc = mask_enter(c, op, &g);
  if (rc != 0)
    return rc;
  /* The bitmap of the world, word for word as the host keeps it (kabi.h cuops_job.own_mask). */
  CUresult r = drv()->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)c->cuops.job.own_mask, c->ops.own,
                                   DEP_SLAB_MASK_WORDS(c->ops.world) * sizeof *c->ops.own);
  ctx_leave(&g);
  return r == CUDA_SUCCESS ? 0 : cu_fail(c, op, "cuMemcpyHtoD (the rank's own mask)", r);
}

int cuda_ops_mask_live(dep_client_t *c, const char *op, uint64_t call, uint64_t *epoch,
                       uint64_t *words) {
  struct ctx_guard g;
  int rc = mask_enter(c, op, &g);
  if (rc != 0)
    return rc;
  const struct cuops_job *J = &c->cuops.job;
  const size_t nw = DEP_SLAB_MASK_WORDS(J->world);
  /* The live words, then the world's join words after them. */
  uint64_t *live = calloc(nw + J->world, sizeof *live);
  if (live == NULL) {
    ctx_leave(&g);
    return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory", op);
  }
  /* This rank's slab from the host's table: the job descriptor's slabs[] holds a world of at
   * most CUOPS_MAX_RANKS ranks only (kabi.h). */
  const CUdeviceptr slab = (CUdeviceptr)(uintptr_t)c->ops.slabs[c->ops.rank];
  const char *what = "cuMemcpyDtoH (the live mask)";
  CUresult r = drv()->cuMemcpyDtoH(epoch, slab + J->mask_epoch_off, sizeof *epoch);
  if (r == CUDA_SUCCESS && *epoch != 0)
    r = drv()->cuMemcpyDtoH(live, slab + J->mask_word_off, nw * sizeof *live);
  /* The join words too, as the kernels read them (cuops_mask): a rank that
   * came back is masked before its join call, and the query says so. */
  if (r == CUDA_SUCCESS && *epoch != 0) {
    what = "cuMemcpyDtoH (the live mask's join words)";
    r = drv()->cuMemcpyDtoH(live + nw, slab + J->mask_join_off, J->world * sizeof *live);
    if (r == CUDA_SUCCESS)
      (void)host_ops_mask_joins(live + nw, J->world, call, live);
    for (size_t i = 0; r == CUDA_SUCCESS && i < nw; i++)
      words[i] |= live[i];
  }
  ctx_leave(&g);
  free(live);
  return r == CUDA_SUCCESS ? 0 : cu_fail(c, op, what, r);
}

int cuda_ops_device_calls(dep_client_t *c, const char *op, uint64_t *calls) {
  struct ctx_guard g;
  int rc = mask_enter(c, op, &g);
  if (rc != 0)
    return rc;
  CUresult r = drv()->cuMemcpyDtoH(calls, c->cuops.dev + offsetof(struct cuops_dev, seq),
                                   sizeof *calls);
  ctx_leave(&g);
  return r == CUDA_SUCCESS ? 0 : cu_fail(c, op, "cuMemcpyDtoH (the device's count of calls)", r);
}
