/*
 * ops.c — the public dispatch/combine entry points (DESIGN §6).  Each
 * checks its arguments and the handle's state, then runs the operation of
 * the job's backend.  The host backend's operations are the plain-C ones of
 * kernels/host_ops.h over the shared-memory slabs; the stream argument is
 * ignored there.  The cuda backend's are kernels launched on the caller's
 * stream by client/cuda_ops.c, which does its own checks (it must not read
 * device memory on the host).
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "shape.h"
#include "slab.h"

/* The handle must be attached, and a job that spans nodes must have its ring
 * and its daemon (watch.h: once the daemon is gone every call fails at once,
 * as the call that was waiting did).  The first call waits for the host
 * warm-up (warm.h), so that it runs at steady speed. */
static int ops_ready(dep_client_t *c, const char *op) {
  if (!c->attached)
    return client_seterr(c, DEP_ERR_STATE, "%s: not attached to a job; call dep_attach first", op);
  warm_wait(c);
  if (watch_gone(c))
    return client_seterr(c, DEP_ERR_DAEMON_GONE, "%s: " OPS_DAEMON_GONE_WHY, op);
  if (!client_ops_here(c))
    return client_seterr(c, DEP_ERR_UNSUPPORTED,
                         "%s: job %s spans nodes (world %u, %u on this node), but %s", op,
                         c->job_id, c->args.world_size, c->args.local_world_size, c->xring_why);
  return 0;
}

/* An argument struct as this library knows it (client_args_take): `last`
 * is the last field of the struct's first layout. */
#define TAKE(op, type, last, a, out) CLIENT_TAKE(c, op, type, last, a, out)

/*
 * A failure's message names the public function once.  The kernels'
 * messages (and the cuda backend's) begin with the operation as they know
 * it, "combine: ...", for their own callers and tests; behind the public
 * name that read "dep_combine: combine: ...".  why past that leading name.
 */
static const char *ops_why_body(const char *op, const char *why) {
  const char *kop = op + strlen("dep_"); /* "dep_combine": "combine" */
  size_t k = strlen(kop);
  return strncmp(why, kop, k) == 0 && strncmp(why + k, ": ", 2) == 0 ? why + k + 2 : why;
}

/* A refusal or failure of op, "op: why", the operation named once. */
static int ops_fail(dep_client_t *c, const char *op, int rc, const char *why) {
  return client_seterr(c, rc, "%s: %s", op, ops_why_body(op, why));
}

/* The cuda backend set its own "op: why" (client/cuda_ops.c); name op once there too. */
static int ops_cuda_result(dep_client_t *c, const char *op, int rc) {
  size_t n = strlen(op);
  if (rc != 0 && strncmp(c->errmsg, op, n) == 0 && strncmp(c->errmsg + n, ": ", 2) == 0) {
    char *body = c->errmsg + n + 2;
    const char *rest = ops_why_body(op, body);
    memmove(body, rest, strlen(rest) + 1);
  }
  return rc;
}

/* Map an operation's result to the handle's message. */
static int ops_result(dep_client_t *c, const char *op, int rc) {
  return rc != 0 ? ops_fail(c, op, rc, c->ops.why) : 0;
}

DEP_EXPORT int dep_handle_new(dep_client_t *c, dep_handle_t **out) {
  if (c == NULL || out == NULL)
    return DEP_ERR_INVALID;
  dep_handle_t *h = calloc(1, sizeof *h);
  if (h == NULL)
    return client_seterr(c, DEP_ERR_NO_MEMORY, "dep_handle_new: out of memory");
  host_ops_handle_init(h);
  if (c->cuda && c->attached) {
    int rc = cuda_ops_handle_new(c, h, "dep_handle_new");
    if (rc != 0) {
      free(h);
      return rc;
    }
  }
  *out = h;
  return 0;
}

/* The bytes of a handle's arrays in the attached job: each backend's one
 * carve, which its handle_reserve lays out in a dep_handle_new_in's memory. */
static int handle_bytes(dep_client_t *c, const char *op, uint64_t *out) {
  if (!c->attached)
    return client_seterr(c, DEP_ERR_STATE, "%s: not attached to a job; call dep_attach first "
                         "(a handle's size is its job's)", op);
  /* A job spanning nodes without its ring has no operations, so no
   * operations' context to size a handle by (its world is 0). */
  int rc = ops_ready(c, op);
  if (rc != 0)
    return rc;
  if (c->cuda)
    return cuda_ops_handle_bytes(c, op, out);
  *out = host_ops_handle_bytes(&c->ops);
  return 0;
}

DEP_EXPORT int dep_handle_bytes(dep_client_t *c, size_t *bytes) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (bytes == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "dep_handle_bytes: bytes is NULL");
  uint64_t n = 0;
  int rc = handle_bytes(c, "dep_handle_bytes", &n);
  if (rc == 0)
    *bytes = (size_t)n;
  return rc;
}

DEP_EXPORT int dep_handle_new_in(dep_client_t *c, void *mem, size_t bytes, dep_handle_t **out) {
  const char *op = "dep_handle_new_in";
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (out == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: out is NULL", op);
  *out = NULL;
  uint64_t need = 0;
  int rc = handle_bytes(c, op, &need);
  if (rc != 0)
    return rc;
  const char *kind = c->cuda ? "device memory of the rank's GPU" : "host memory";
  if (mem == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: mem is NULL; lend dep_handle_bytes (%llu) "
                         "bytes of %s, or use dep_handle_new", op, (unsigned long long)need,
                         kind);
  if ((uintptr_t)mem % DEP_HANDLE_ALIGN != 0)
    return client_seterr(c, DEP_ERR_INVALID, "%s: mem %p is not %d-byte aligned "
                         "(DEP_HANDLE_ALIGN); cuMemAlloc's and torch's allocations are, malloc's "
                         "are not (use aligned_alloc)", op, mem, DEP_HANDLE_ALIGN);
  if (bytes < need)
    return client_seterr(c, DEP_ERR_INVALID, "%s: bytes %zu is less than a handle of this job "
                         "takes (%llu, dep_handle_bytes); lend that many bytes of %s", op, bytes,
                         (unsigned long long)need, kind);
  if (c->cuda && (rc = cuda_ops_handle_mem_check(c, op, mem, need)) != 0)
    return rc;
  dep_handle_t *h = calloc(1, sizeof *h);
  if (h == NULL)
    return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory", op);
  host_ops_handle_init(h);
  h->mem = mem;
  h->mem_bytes = bytes;
  if (c->cuda && (rc = cuda_ops_handle_new(c, h, op)) != 0) {
    free(h);
    return rc;
  }
  *out = h;
  return 0;
}

/* A dep_handle_new_in handle's memory is the caller's: cuda_ops_handle_free
 * and host_ops_handle_fini leave it. */
DEP_EXPORT void dep_handle_free(dep_handle_t *h) {
  if (h == NULL)
    return;
  cuda_ops_handle_free(h);
  host_ops_handle_fini(h);
  free(h);
}

/* A handle filled by a dispatch of an earlier attachment (another job, or
 * the same one before a dep_detach) routes nothing of this one. */
static int handle_of_this_attach(dep_client_t *c, const char *op, const dep_handle_t *h) {
  if (h == NULL || h->kind == OPS_HANDLE_EMPTY || h->attach_id == c->attach_id)
    return 0;
  return client_seterr(c, DEP_ERR_INVALID, "%s: the handle holds a dispatch of an earlier "
                       "attachment (before the last dep_attach); pass the handle of this job's "
                       "matching dispatch", op);
}

DEP_EXPORT int dep_handle_recv_from(dep_client_t *c, const dep_handle_t *h, uint32_t *out,
                                    uint32_t n) {
  const char *op = "dep_handle_recv_from";
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (h == NULL || out == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: %s is NULL", op, h == NULL ? "h" : "out");
  int rc = ops_ready(c, op);
  if (rc != 0 || (rc = handle_of_this_attach(c, op, h)) != 0)
    return rc;
  if (h->kind != OPS_HANDLE_TP)
    return client_seterr(c, DEP_ERR_INVALID, "%s: the handle holds %s; pass the handle of "
                         "a throughput dispatch (dep_dispatch)", op,
                         h->kind == OPS_HANDLE_LL ? "a low-latency dispatch" : "no dispatch");
  if (n < c->ops.world)
    return client_seterr(c, DEP_ERR_INVALID, "%s: n is %u; the job has %u ranks, one count "
                         "each", op, n, c->ops.world);
  /* On cuda such a dispatch never waits, so its counts stay on the device. */
  if (c->cuda && h->worst != 0)
    return client_seterr(c, DEP_ERR_STATE, "%s: the dispatch had num_worst_tokens on the cuda "
                         "backend, which leaves the counts on the device", op);
  memcpy(out, h->recv_from, c->ops.world * sizeof *out);
  return 0;
}

/*
 * The four operations that move tokens differ only in their argument struct and the
 * backend functions they call; one descriptor each says which, and ops_call runs the
 * path they share.  The adapters below take the argument struct as the caller's (taken)
 * copy behind a void pointer; a call reads h (a combine's, a cached dispatch's) and a
 * dispatch fills `fill`, which is NULL for a combine.
 */
struct ops_desc {
  const char *name; /* the public function, in messages */
  unsigned sop;     /* DEP_STATS_OP_*: its line in the stats page */
  int (*check)(const struct ops_ctx *o, const void *a, const dep_handle_t *h, char *why,
               size_t whylen);
  int (*run)(struct ops_ctx *o, const void *a, const dep_handle_t *h, dep_handle_t *fill);
  int (*cuda_run)(dep_client_t *c, const void *a, const dep_handle_t *h, dep_handle_t *fill,
                  dep_stream_t stream);
  /* The call's bytes for the stats page, asked only of a call that ran on the host. */
  uint64_t (*bytes)(const dep_client_t *c, const void *a, const dep_handle_t *h);
};

/* A combine moves the rows of its handle's dispatch back, unquantised. */
static uint64_t bytes_combine(const dep_client_t *c, const void *a, const dep_handle_t *h) {
  return dep_stats_bytes(h ? h->num_tokens : 0, c->ops.shape.hidden, false);
}

static int check_dispatch(const struct ops_ctx *o, const void *a, const dep_handle_t *h,
                          char *why, size_t whylen) {
  return ops_check_dispatch(o, a, h, why, whylen);
}
static int run_dispatch(struct ops_ctx *o, const void *a, const dep_handle_t *h,
                        dep_handle_t *fill) {
  return host_ops_dispatch(o, a, fill);
}
static int cuda_dispatch(dep_client_t *c, const void *a, const dep_handle_t *h,
                         dep_handle_t *fill, dep_stream_t stream) {
  return cuda_ops_dispatch(c, a, fill, stream);
}
static uint64_t bytes_dispatch(const dep_client_t *c, const void *a, const dep_handle_t *h) {
  const struct dep_dispatch_args *d = a;
  return dep_stats_bytes(d->num_tokens, c->ops.shape.hidden, d->use_fp8 != 0);
}

static int check_combine(const struct ops_ctx *o, const void *a, const dep_handle_t *h,
                         char *why, size_t whylen) {
  return ops_check_combine(o, a, h, why, whylen);
}
static int run_combine(struct ops_ctx *o, const void *a, const dep_handle_t *h,
                       dep_handle_t *fill) {
  return host_ops_combine(o, a, h);
}
static int cuda_combine(dep_client_t *c, const void *a, const dep_handle_t *h,
                        dep_handle_t *fill, dep_stream_t stream) {
  return cuda_ops_combine(c, a, h, stream);
}

static int check_ll_dispatch(const struct ops_ctx *o, const void *a, const dep_handle_t *h,
                             char *why, size_t whylen) {
  return ops_check_ll_dispatch(o, a, h, why, whylen);
}
static int run_ll_dispatch(struct ops_ctx *o, const void *a, const dep_handle_t *h,
                           dep_handle_t *fill) {
  return host_ops_ll_dispatch(o, a, fill);
}
static int cuda_ll_dispatch(dep_client_t *c, const void *a, const dep_handle_t *h,
                            dep_handle_t *fill, dep_stream_t stream) {
  return cuda_ops_ll_dispatch(c, a, fill, stream);
}
static uint64_t bytes_ll_dispatch(const dep_client_t *c, const void *a, const dep_handle_t *h) {
  const struct dep_ll_dispatch_args *d = a;
  return dep_stats_bytes(d->num_tokens, c->ops.shape.hidden, d->use_fp8 != 0);
}

static int check_ll_combine(const struct ops_ctx *o, const void *a, const dep_handle_t *h,
                            char *why, size_t whylen) {
  return ops_check_ll_combine(o, a, h, why, whylen);
}
static int run_ll_combine(struct ops_ctx *o, const void *a, const dep_handle_t *h,
                          dep_handle_t *fill) {
  return host_ops_ll_combine(o, a, h);
}
static int cuda_ll_combine(dep_client_t *c, const void *a, const dep_handle_t *h,
                           dep_handle_t *fill, dep_stream_t stream) {
  return cuda_ops_ll_combine(c, a, h, stream);
}

static const struct ops_desc op_dispatch = {"dep_dispatch", DEP_STATS_OP_DISPATCH,
                                            check_dispatch, run_dispatch, cuda_dispatch,
                                            bytes_dispatch};
static const struct ops_desc op_combine = {"dep_combine", DEP_STATS_OP_COMBINE, check_combine,
                                           run_combine, cuda_combine, bytes_combine};
static const struct ops_desc op_ll_dispatch = {"dep_ll_dispatch", DEP_STATS_OP_LL_DISPATCH,
                                               check_ll_dispatch, run_ll_dispatch,
                                               cuda_ll_dispatch, bytes_ll_dispatch};
static const struct ops_desc op_ll_combine = {"dep_ll_combine", DEP_STATS_OP_LL_COMBINE,
                                              check_ll_combine, run_ll_combine, cuda_ll_combine,
                                              bytes_combine};

/* One call of an operation, as its public function hands it to ops_call. */
struct ops_call {
  const void *a;         /* the argument struct, taken (TAKE) */
  const dep_handle_t *h; /* the handle the call reads */
  dep_handle_t *fill;    /* the handle a dispatch fills; NULL for a combine */
  bool routed;           /* h routes the call, so it must be this attachment's */
};

/*
 * On the host backend each call is timed on the host clock around the
 * synchronous C code and logged in the stats page (statrec.h): a call that
 * ran consumed a seq and is logged under it, with its status; one refused
 * before it ran (bad arguments, a broken context) is counted as refused.
 * On cuda the kernels log their own calls, on the GPU's timer.  A dispatch
 * that routed afresh makes the handle it filled this attachment's.
 */
static int ops_call(dep_client_t *c, const struct ops_desc *d, const struct ops_call *k,
                    dep_stream_t stream) {
  const char *op = d->name;
  int rc = ops_ready(c, op);
  if (rc != 0)
    return rc;
  if (k->routed && (rc = handle_of_this_attach(c, op, k->h)) != 0) {
    statrec_rejected(&c->stats, d->sop);
    return rc;
  }
  /* A low-latency send not yet received holds its handle (the LL checks say so for their
   * own calls, host_ops.h "Split calls"); no other call may fill or read it meanwhile. */
  const uint64_t held = d->sop == DEP_STATS_OP_LL_DISPATCH || d->sop == DEP_STATS_OP_LL_COMBINE
                            ? 0 : host_ops_pending(&c->ops, k->h);
  if (held != 0) {
    statrec_rejected(&c->stats, d->sop);
    return client_seterr(c, DEP_ERR_INVALID, "%s: the handle holds the send of low-latency "
                         "call %llu, whose receive (DEP_LL_RECV) has not run; run it first, or "
                         "use another handle", op, (unsigned long long)held);
  }
  const bool stamp = k->fill != NULL && !k->routed;
  if (c->cuda) {
    rc = d->cuda_run(c, k->a, k->h, k->fill, stream);
    if (rc == 0 && stamp)
      k->fill->attach_id = c->attach_id;
    return ops_cuda_result(c, op, rc);
  }
  char why[256] = "";
  rc = d->check(&c->ops, k->a, k->h, why, sizeof why);
  if (rc != 0) {
    statrec_rejected(&c->stats, d->sop);
    return ops_fail(c, op, rc, why);
  }
  const uint64_t seq = c->ops.seq, t0 = statrec_now_ns();
  rc = d->run(&c->ops, k->a, k->h, k->fill);
  const uint64_t ns = statrec_now_ns() - t0;
  if (rc == 0 && stamp)
    k->fill->attach_id = c->attach_id;
  if (c->ops.seq != seq)
    statrec_call(&c->stats, d->sop, c->ops.seq, ns, rc, d->bytes(c, k->a, k->h));
  else if (rc != 0)
    statrec_rejected(&c->stats, d->sop);
  return ops_result(c, op, rc);
}

DEP_EXPORT int dep_layout(dep_client_t *c, const struct dep_layout_args *a_in,
                          dep_stream_t stream) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_layout_args a_[1];
  int rc = TAKE("dep_layout", dep_layout_args, token_in_rank, a_in, a_);
  if (rc != 0)
    return rc;
  const struct dep_layout_args *const a = a_;
  rc = ops_ready(c, "dep_layout");
  if (rc != 0)
    return rc;
  if (c->cuda)
    return ops_cuda_result(c, "dep_layout", cuda_ops_layout(c, a, stream));
  char why[256] = "";
  if ((rc = ops_check_layout(&c->ops, a, why, sizeof why)) != 0) {
    statrec_rejected(&c->stats, DEP_STATS_OP_LAYOUT);
    return ops_fail(c, "dep_layout", rc, why);
  }
  /* A layout is local (no seq): its own ring, with the tokens it sends each rank. */
  const uint64_t t0 = statrec_now_ns();
  rc = host_ops_layout(&c->ops, a);
  statrec_layout(&c->stats, statrec_now_ns() - t0, rc, a->tokens_per_rank, c->ops.world);
  return ops_result(c, "dep_layout", rc);
}

DEP_EXPORT int dep_dispatch(dep_client_t *c, const struct dep_dispatch_args *a_in,
                            dep_handle_t *h, dep_stream_t stream) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_dispatch_args a[1];
  int rc = TAKE(op_dispatch.name, dep_dispatch_args, expert_alignment, a_in, a);
  if (rc != 0)
    return rc;
  /* A cached dispatch is routed by the handle; any other routes afresh and fills it. */
  return ops_call(c, &op_dispatch,
                  &(struct ops_call){.a = a, .h = h, .fill = h, .routed = a->cached == 1},
                  stream);
}

DEP_EXPORT int dep_combine(dep_client_t *c, const struct dep_combine_args *a_in,
                           const dep_handle_t *h, dep_stream_t stream) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_combine_args a[1];
  int rc = TAKE(op_combine.name, dep_combine_args, out_topk_weights, a_in, a);
  if (rc != 0)
    return rc;
  return ops_call(c, &op_combine, &(struct ops_call){.a = a, .h = h, .routed = true}, stream);
}

DEP_EXPORT int dep_ll_dispatch(dep_client_t *c, const struct dep_ll_dispatch_args *a_in,
                               dep_handle_t *h, dep_stream_t stream) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_ll_dispatch_args a[1];
  int rc = TAKE(op_ll_dispatch.name, dep_ll_dispatch_args, recv_count, a_in, a);
  if (rc != 0)
    return rc;
  return ops_call(c, &op_ll_dispatch,
                  &(struct ops_call){.a = a, .h = h, .fill = h, .routed = false},
                  stream);
}

DEP_EXPORT int dep_ll_combine(dep_client_t *c, const struct dep_ll_combine_args *a_in,
                              const dep_handle_t *h, dep_stream_t stream) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_ll_combine_args a[1];
  int rc = TAKE(op_ll_combine.name, dep_ll_combine_args, out, a_in, a);
  if (rc != 0)
    return rc;
  return ops_call(c, &op_ll_combine, &(struct ops_call){.a = a, .h = h, .routed = true}, stream);
}

/*
 * Local on both backends (no seq, no stats entry): it reads the handle a
 * dispatch filled.  The checks are the backends' common ones; on cuda the
 * kernel reads the handle's device arrays, so it needs them made.
 */
DEP_EXPORT int dep_ll_handle_info(dep_client_t *c, const struct dep_ll_handle_info_args *a_in,
                                  const dep_handle_t *h, dep_stream_t stream) {
  const char *op = "dep_ll_handle_info";
  if (c == NULL)
    return DEP_ERR_INVALID;
  struct dep_ll_handle_info_args a[1];
  int rc = TAKE(op, dep_ll_handle_info_args, layout_range, a_in, a);
  if (rc != 0 || (rc = ops_ready(c, op)) != 0)
    return rc;
  if (h == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: h is NULL", op);
  if ((rc = handle_of_this_attach(c, op, h)) != 0)
    return rc;
  if (h->kind != OPS_HANDLE_LL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: the handle holds %s; pass the handle of "
                         "a low-latency dispatch (dep_ll_dispatch)", op,
                         h->kind == OPS_HANDLE_TP ? "a throughput dispatch (dep_dispatch)"
                                                  : "no dispatch");
  const struct {
    const void *p;
    size_t align;
    const char *name;
  } out[] = {{a->src_info, sizeof *a->src_info, "src_info"},
             {a->layout_range, sizeof *a->layout_range, "layout_range"}};
  for (size_t i = 0; i < sizeof out / sizeof out[0]; i++) {
    if (out[i].p == NULL)
      return client_seterr(c, DEP_ERR_INVALID, "%s: %s is NULL", op, out[i].name);
    if ((uintptr_t)out[i].p % out[i].align != 0)
      return client_seterr(c, DEP_ERR_INVALID, "%s: %s is not %zu-byte aligned", op,
                           out[i].name, out[i].align);
  }
  if (c->cuda)
    return ops_cuda_result(c, op, cuda_ops_ll_handle_info(c, a, h, stream));
  return ops_result(c, op, host_ops_ll_handle_info(&c->ops, a, h));
}

DEP_EXPORT int dep_shape_sizes(dep_client_t *c, const struct dep_job_shape *shape,
                               uint32_t world_size, struct dep_shape_sizes *out) {
  const char *op = "dep_shape_sizes";
  struct dep_shape_sizes z;
  int rc = TAKE(op, dep_shape_sizes, slab_bytes, out, &z);
  if (rc != 0)
    return rc;
  if (shape == NULL)
    return c ? client_seterr(c, DEP_ERR_INVALID, "%s: shape is NULL", op) : DEP_ERR_INVALID;
  char why[256] = "";
  struct dep_slab_layout lay;
  if ((rc = dep__slab_layout(shape, world_size, &lay, why, sizeof why)) != 0)
    return c ? client_seterr(c, rc, "%s: %s", op, why) : rc;
  z.max_ll_tokens_per_rank = lay.max_ll_tokens;
  z.local_experts = shape->num_experts / world_size;
  z.scale_groups = shape->hidden / DEP_SHAPE_HIDDEN_STEP;
  z.recv_rows = world_size * shape->max_tokens_per_rank;
  z.ll_recv_rows = world_size * lay.max_ll_tokens;
  z.slab_bytes = lay.total_bytes;
  client_args_give(out, &z, sizeof z);
  return 0;
}

/* ---- masked ranks (DESIGN §14) ------------------------------------------------------------
 * This rank's own mask is kept in the operations' context on both backends (host_ops.h);
 * the cuda kernels read their copy of it (kabi.h cuops_dev.own_mask) and the live mask in
 * the slab themselves.
 */

DEP_EXPORT int dep_mask_update(dep_client_t *c, uint32_t rank, int masked) {
  const char *op = "dep_mask_update";
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_ready(c, op);
  if (rc != 0)
    return rc;
  if (masked != 0 && masked != 1)
    return client_seterr(c, DEP_ERR_INVALID, "%s: masked is %d; give 1 (mask the rank) or 0 "
                         "(unmask it)", op, masked);
  if ((rc = ops_result(c, op, host_ops_mask_update(&c->ops, rank, masked))) != 0)
    return rc;
  return c->cuda ? cuda_ops_mask_own(c, op) : 0;
}

DEP_EXPORT int dep_mask_clear(dep_client_t *c) {
  const char *op = "dep_mask_clear";
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_ready(c, op);
  if (rc != 0)
    return rc;
  host_ops_mask_clear(&c->ops);
  return c->cuda ? cuda_ops_mask_own(c, op) : 0;
}

/*
 * The number of this rank's next communicating call, into *call.  The host
 * counts the calls it makes in c->ops.seq on both backends (cuda: as it
 * launches them, cuda_ops.c), from the join call on a rank that came back
 * (attach.c).  On cuda the device counts too, and its count holds calls
 * the host never saw (a CUDA graph's replays): the larger of the two,
 * which is exact once the calls launched have ended.
 */
static int next_call(dep_client_t *c, const char *op, uint64_t *call) {
  uint64_t made = c->ops.seq, dev = 0;
  int rc = c->cuda ? cuda_ops_device_calls(c, op, &dev) : 0;
  if (rc == 0)
    *call = (dev > made ? dev : made) + 1;
  return rc;
}

DEP_EXPORT int dep_mask_query(dep_client_t *c, int32_t *out, uint32_t n, uint64_t *epoch) {
  const char *op = "dep_mask_query";
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_ready(c, op);
  if (rc != 0)
    return rc;
  if (out == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: out is NULL", op);
  const uint32_t w = c->ops.world;
  if (n < w)
    return client_seterr(c, DEP_ERR_INVALID, "%s: n is %u; the job has %u ranks, one entry "
                         "each", op, n, w);
  uint64_t *words = calloc(DEP_SLAB_MASK_WORDS(w), sizeof *words);
  if (words == NULL)
    return client_seterr(c, DEP_ERR_NO_MEMORY, "%s: out of memory", op);
  memcpy(words, c->ops.own, DEP_SLAB_MASK_WORDS(w) * sizeof *words);
  /* The mask the next call will see: the join rule is a call's. */
  uint64_t e = 0, call = 0;
  rc = next_call(c, op, &call);
  if (rc == 0 && c->cuda) { /* the slab is device memory */
    rc = cuda_ops_mask_live(c, op, call, &e, words);
  } else if (rc == 0) {
    e = host_ops_mask_live(&c->ops, words, 0, call);
  }
  for (uint32_t r = 0; rc == 0 && r < w; r++)
    out[r] = (int32_t)((words[r / 64u] >> (r % 64u)) & 1u);
  free(words);
  if (rc == 0 && epoch != NULL)
    *epoch = e;
  return rc;
}

DEP_EXPORT int dep_next_call(dep_client_t *c, uint64_t *call) {
  const char *op = "dep_next_call";
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (call == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: call is NULL", op);
  int rc = ops_ready(c, op);
  /* On cuda, next_call's read of the device's count refuses as every operation does until
   * the kernels are bound (cuda_ops_attach, where a rank that came back takes its join call). */
  return rc != 0 ? rc : next_call(c, op, call);
}

DEP_EXPORT int dep_handle_dropped(dep_client_t *c, const dep_handle_t *h, uint64_t *pairs) {
  const char *op = "dep_handle_dropped";
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (h == NULL || pairs == NULL)
    return client_seterr(c, DEP_ERR_INVALID, "%s: %s is NULL", op, h == NULL ? "h" : "pairs");
  int rc = ops_ready(c, op);
  if (rc != 0 || (rc = handle_of_this_attach(c, op, h)) != 0)
    return rc;
  if (c->cuda)
    return client_seterr(c, DEP_ERR_UNSUPPORTED, "%s: the cuda kernels do not count the pairs "
                         "they drop (the host backend does); count them from topk_idx and "
                         "dep_mask_query", op);
  if (h->kind == OPS_HANDLE_EMPTY)
    return client_seterr(c, DEP_ERR_INVALID, "%s: the handle holds no dispatch; pass the "
                         "handle of a dep_dispatch or dep_ll_dispatch", op);
  *pairs = h->dropped;
  return 0;
}
