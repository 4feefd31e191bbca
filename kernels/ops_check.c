/*
 * ops_check.c — argument checks for the MoE operations, shared by the host
 * and CUDA backends.  Each check runs before anything is written to any
 * slab, and each refusal names the argument and what would make it valid,
 * so a caller's bug is a DEP_ERR_INVALID with a sentence, never a crash,
 * a hang or a silent wrong answer (DESIGN §6).
 *
 * Inputs of a call with num_tokens == 0 may be NULL (an empty tensor's data
 * pointer often is); outputs that peers fill must always be given.
 */
#include <stdarg.h>
#include <stdio.h>

#include "host_ops.h"
#include "shape.h"
#include "why.h"


/* FNV-1a over the int64 values, so an int32 and an int64 copy hash alike. */
uint64_t ops_check_idx_hash(const void *idx, int index_type, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) {
    int64_t v = index_type == DEP_INDEX_I64 ? ((const int64_t *)idx)[i]
                                            : ((const int32_t *)idx)[i];
    uint64_t u = (uint64_t)v;
    for (int b = 0; b < 8; b++) {
      h ^= (u >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

int ops_check_ctx(const struct ops_ctx *c, char *why, size_t whylen) {
  if (c == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "ops context is NULL (attach first)");
  if (c->world == 0 || c->world > DEP_MAX_WORLD || c->rank >= c->world)
    return why_fail(why, whylen, DEP_ERR_INVALID, "rank %u of world %u out of range (the host backend runs 1..%u ranks)",
                c->rank, c->world, DEP_MAX_WORLD);
  if (c->slabs == NULL || c->remote == NULL || c->per_rank == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "ops context has no tables (make it with "
                    "host_ops_init)");
  int rc = dep__shape_check(&c->shape, c->world, why, whylen);
  if (rc != 0)
    return rc;
  if (c->lay.world_size != c->world || c->lay.max_ll_tokens != dep__shape_max_ll(&c->shape))
    return why_fail(why, whylen, DEP_ERR_INVALID, "ops context's slab layout is not its shape's (make it with "
                "host_ops_init)");
  /* A rank with no slab here is one on another node, served through the ring. */
  for (uint32_t r = 0; r < c->world; r++)
    if (c->slabs[r] == NULL && (c->remote[r] < 0 || c->ring == NULL || r == c->rank))
      return why_fail(why, whylen, DEP_ERR_INVALID, "slab of rank %u is not mapped", r);
  return 0;
}

static int check_index_type(int t, const char *op, char *why, size_t whylen) {
  if (t != DEP_INDEX_I64 && t != DEP_INDEX_I32)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: index_type %d is neither DEP_INDEX_I64 (%d) nor "
                "DEP_INDEX_I32 (%d)", op, t, DEP_INDEX_I64, DEP_INDEX_I32);
  return 0;
}

/* Every topk_idx entry in [-1, num_experts). */
static int check_idx(const struct ops_ctx *c, const void *idx, int t, uint32_t n, const char *op,
                     char *why, size_t whylen) {
  uint32_t k = c->shape.topk;
  int64_t ne = c->shape.num_experts;
  for (uint64_t i = 0; i < (uint64_t)n * k; i++) {
    int64_t v = t == DEP_INDEX_I64 ? ((const int64_t *)idx)[i] : ((const int32_t *)idx)[i];
    if (v < -1 || v >= ne)
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: topk_idx[%llu][%llu] = %lld outside [-1, %lld): expert ids "
                  "must be below num_experts, -1 for none", op, (unsigned long long)(i / k),
                  (unsigned long long)(i % k), (long long)v, (long long)ne);
  }
  return 0;
}

/* A pointer argument must be given and aligned for its element type. */
#define NEED_AL(ptr, align, op, name)                                                      \
  do {                                                                                     \
    if ((ptr) == NULL)                                                                     \
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: %s is NULL", op, name);                                \
    if ((uintptr_t)(ptr) % (align) != 0)                                                   \
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: %s is not %u-byte aligned", op, name, (unsigned)(align)); \
  } while (0)
#define NEED(ptr, op, name) NEED_AL(ptr, _Alignof(__typeof__(*(ptr))), op, name)
#define NEED_IDX(ptr, t, op) NEED_AL(ptr, (t) == DEP_INDEX_I64 ? 8u : 4u, op, "topk_idx")
#define NEED_BF16(ptr, op, name) NEED_AL(ptr, 2u, op, name)

static int check_tokens(uint32_t n, uint32_t max, const char *op, const char *bound, char *why,
                        size_t whylen) {
  if (n > max)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: num_tokens %u exceeds %s %u of the job's shape", op, n, bound,
                max);
  return 0;
}

int ops_check_layout(const struct ops_ctx *c, const struct dep_layout_args *a, char *why,
                     size_t whylen) {
  const char *op = "layout";
  int rc = ops_check_ctx(c, why, whylen);
  if (rc != 0)
    return rc;
  NEED(a, op, "args");
  if ((rc = check_index_type(a->index_type, op, why, whylen)) != 0 ||
      (rc = check_tokens(a->num_tokens, c->shape.max_tokens_per_rank, op, "max_tokens_per_rank",
                         why, whylen)) != 0)
    return rc;
  NEED(a->tokens_per_rank, op, "tokens_per_rank");
  NEED(a->tokens_per_expert, op, "tokens_per_expert");
  if (a->num_tokens > 0) {
    NEED_IDX(a->topk_idx, a->index_type, op);
    NEED(a->token_in_rank, op, "token_in_rank");
    return check_idx(c, a->topk_idx, a->index_type, a->num_tokens, op, why, whylen);
  }
  return 0;
}

/* The handle holds a dispatch of `kind` made on a context like c. */
static int check_handle(const struct ops_ctx *c, const struct dep_handle *h, uint32_t kind,
                        const char *op, char *why, size_t whylen) {
  const char *want = kind == OPS_HANDLE_TP ? "dep_dispatch" : "dep_ll_dispatch";
  if (h == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: handle is NULL; pass the handle of the matching %s", op, want);
  if (h->kind == OPS_HANDLE_EMPTY)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: handle holds no dispatch; pass the handle of the matching %s", op,
                want);
  if (h->kind != kind)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: handle holds a %s, not a %s", op,
                h->kind == OPS_HANDLE_TP ? "dep_dispatch" : "dep_ll_dispatch", want);
  if (h->world != c->world || h->rank != c->rank || h->hidden != c->shape.hidden ||
      h->topk != c->shape.topk || h->num_experts != c->shape.num_experts ||
      h->max_tokens != c->shape.max_tokens_per_rank || h->max_ll_tokens != c->lay.max_ll_tokens)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: handle was filled by rank %u of world %u in another job shape; "
                "use a handle of this attachment", op, h->rank, h->world);
  return 0;
}

/* The most a dispatch's expert_alignment may be (deepep.h). */
#define OPS_MAX_ALIGNMENT 65536u

/* An argument a mode does not read must not be given (it would be silently ignored). */
#define UNUSED_IN(ptr, op, name, mode)                                                   \
  do {                                                                                   \
    if ((ptr) != NULL)                                                                   \
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: %s is not read %s; pass NULL",   \
                      op, name, mode);                                                   \
  } while (0)

/* A cached dispatch's own checks: the handle routes, so what routing would read or
 * write is refused, and the handle's token and row counts must fit the call. */
static int check_dispatch_cached(const struct ops_ctx *c, const struct dep_dispatch_args *a,
                                 const struct dep_handle *h, char *why, size_t whylen) {
  const char *op = "dispatch";
  int rc;
  if ((rc = check_handle(c, h, OPS_HANDLE_TP, "dispatch (cached)", why, whylen)) != 0)
    return rc;
  UNUSED_IN(a->topk_idx, op, "topk_idx", "in cached mode (the handle routes)");
  UNUSED_IN(a->topk_weights, op, "topk_weights", "in cached mode");
  UNUSED_IN(a->recv_topk_idx, op, "recv_topk_idx", "in cached mode (not written)");
  UNUSED_IN(a->recv_topk_weights, op, "recv_topk_weights", "in cached mode (not written)");
  UNUSED_IN(a->recv_count_per_expert, op, "recv_count_per_expert", "in cached mode (not written)");
  UNUSED_IN(a->recv_count_per_expert_host, op, "recv_count_per_expert_host",
            "in cached mode (no counts are written)");
  if (a->expert_alignment > 1)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: expert_alignment is not used in cached mode (no counts "
                    "are written); give 0 or 1");
  if (a->num_tokens != h->num_tokens)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch (cached): num_tokens %u, but the handle's dispatch had "
                    "%u; x must hold the same tokens", a->num_tokens, h->num_tokens);
  if (h->worst != 0 && a->num_worst_tokens == 0)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch (cached): the handle's dispatch gave num_worst_tokens %u "
                    "and so did not learn its row count; give num_worst_tokens here too", h->worst);
  if (h->worst == 0 && a->num_worst_tokens != 0 && a->num_worst_tokens < h->num_recv)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch (cached): num_worst_tokens %u is below the %u rows the "
                    "handle's dispatch received", a->num_worst_tokens, h->num_recv);
  return 0;
}

/* A dispatch that routes afresh: its ids' type and the outputs routing writes. */
static int check_dispatch_routed(const struct ops_ctx *c, const struct dep_dispatch_args *a,
                                 char *why, size_t whylen) {
  const char *op = "dispatch";
  int rc;
  if ((rc = check_index_type(a->index_type, op, why, whylen)) != 0)
    return rc;
  NEED_AL(a->recv_topk_idx, ops_recv_idx_bytes(a), op, "recv_topk_idx");
  NEED(a->recv_topk_weights, op, "recv_topk_weights");
  NEED(a->recv_count_per_expert, op, "recv_count_per_expert");
  if (a->recv_count_per_expert_host != NULL) {
    /* The copy rides on the wait for num_recv, which num_worst_tokens does without. */
    if (a->num_worst_tokens != 0)
      return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: recv_count_per_expert_host is "
                      "not written with num_worst_tokens (the call does not wait for the "
                      "counts); pass NULL and read recv_count_per_expert");
    NEED(a->recv_count_per_expert_host, op, "recv_count_per_expert_host");
  }
  return 0;
}

int ops_check_dispatch(const struct ops_ctx *c, const struct dep_dispatch_args *a,
                       const struct dep_handle *h, char *why, size_t whylen) {
  const char *op = "dispatch";
  int rc = ops_check_ctx(c, why, whylen);
  if (rc != 0)
    return rc;
  NEED(a, op, "args");
  if (h == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: handle is NULL; make one with dep_handle_new");
  if ((rc = check_tokens(a->num_tokens, c->shape.max_tokens_per_rank, op, "max_tokens_per_rank",
                         why, whylen)) != 0)
    return rc;
  if (a->use_fp8 != 0 && a->use_fp8 != 1)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: use_fp8 is %d; give 0 (bf16) or 1 (e4m3 with scales)",
                    a->use_fp8);
  if (a->recv_index_type != 0 && a->recv_index_type != DEP_INDEX_I32 &&
      a->recv_index_type != DEP_INDEX_I64)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: recv_index_type %d is neither 0 nor "
                    "DEP_INDEX_I32 (%d: int32 ids) nor DEP_INDEX_I64 (%d: int64 ids)",
                    a->recv_index_type, DEP_INDEX_I32, DEP_INDEX_I64);
  if (a->cached != 0 && a->cached != 1)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: cached is %d; give 0 or 1 (reuse the handle's routing)",
                    a->cached);
  const uint64_t cap = (uint64_t)c->world * c->shape.max_tokens_per_rank;
  if (a->num_worst_tokens > cap)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: num_worst_tokens %u exceeds the %llu rows a rank can "
                    "receive (world_size * max_tokens_per_rank)", a->num_worst_tokens,
                    (unsigned long long)cap);
  if (a->expert_alignment > OPS_MAX_ALIGNMENT)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: expert_alignment %u exceeds %u", a->expert_alignment,
                    OPS_MAX_ALIGNMENT);
  NEED_AL(a->recv_x, a->use_fp8 ? 1u : 2u, op, "recv_x");
  if (a->use_fp8) {
    NEED(a->recv_x_scales, op, "recv_x_scales (required with use_fp8)");
  } else {
    UNUSED_IN(a->x_scales, op, "x_scales", "without use_fp8");
    UNUSED_IN(a->recv_x_scales, op, "recv_x_scales", "without use_fp8");
  }
  if (a->num_worst_tokens == 0 && a->num_recv == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "dispatch: num_recv is NULL; give it, or num_worst_tokens "
                    "(outputs of that many rows, no wait for the count)");
  rc = a->cached ? check_dispatch_cached(c, a, h, why, whylen)
                 : check_dispatch_routed(c, a, why, whylen);
  if (rc != 0)
    return rc;
  if (a->num_tokens > 0) {
    NEED_AL(a->x, a->use_fp8 ? 1u : 2u, op, "x");
    if (a->use_fp8)
      NEED(a->x_scales, op, "x_scales (required with use_fp8)");
    if (a->cached)
      return 0;
    NEED_IDX(a->topk_idx, a->index_type, op);
    NEED(a->topk_weights, op, "topk_weights");
    return check_idx(c, a->topk_idx, a->index_type, a->num_tokens, op, why, whylen);
  }
  return 0;
}

int ops_check_combine(const struct ops_ctx *c, const struct dep_combine_args *a,
                      const struct dep_handle *h, char *why, size_t whylen) {
  const char *op = "combine";
  int rc = ops_check_ctx(c, why, whylen);
  if (rc != 0)
    return rc;
  NEED(a, op, "args");
  if ((rc = check_handle(c, h, OPS_HANDLE_TP, op, why, whylen)) != 0)
    return rc;
  /* With num_worst_tokens the host may not know the rows (cuda): x holds that many. */
  const uint32_t rows = h->worst ? h->worst : h->num_recv;
  if (rows > 0)
    NEED_BF16(a->x, op, "x");
  if (h->num_tokens > 0) {
    NEED_BF16(a->out, op, "out");
    /* Biases are optional, so only a given one's alignment is checked. */
    if (a->bias_0 != NULL)
      NEED_BF16(a->bias_0, op, "bias_0");
    if (a->bias_1 != NULL)
      NEED_BF16(a->bias_1, op, "bias_1");
  }
  /* Weighted when out_topk_weights is given (even for no tokens): every rank of the
   * call must say the same, since their rows carry the weights or not. */
  if (a->out_topk_weights == NULL && a->topk_weights != NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "combine: topk_weights is given without out_topk_weights, where "
                    "their sums go; give both (a weighted combine) or neither");
  if (a->out_topk_weights != NULL) {
    if (rows > 0)
      NEED(a->topk_weights, op, "topk_weights (required with out_topk_weights)");
    NEED(a->out_topk_weights, op, "out_topk_weights");
  }
  return 0;
}

/*
 * A low-latency call's phases (deepep.h "Split calls") against the handle:
 * whole, or a send into a handle no send holds, or a receive of the send
 * of `kind` (OPS_OP_LL_*) the handle holds.
 */
int ops_check_phases(const struct ops_ctx *c, uint32_t phases, const struct dep_handle *h,
                     uint32_t kind, const char *op, char *why, size_t whylen) {
  const uint32_t whole = DEP_LL_SEND | DEP_LL_RECV;
  if ((phases & ~whole) != 0)
    return why_fail(why, whylen, DEP_ERR_INVALID, "%s: phases is %u; give 0 or DEP_LL_SEND | "
                    "DEP_LL_RECV (the whole call), DEP_LL_SEND (its send) or DEP_LL_RECV (the "
                    "receive of the send the handle holds)", op, phases);
  if (h == NULL)
    return 0; /* the handle checks say it */
  const uint64_t held = host_ops_pending(c, h);
  const struct ops_pending *p = held != 0 ? &c->pend[held & 1] : NULL;
  if (phases == DEP_LL_RECV) {
    if (p == NULL || (p->op & ~OPS_OP_FP8) != kind)
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: phases is DEP_LL_RECV, but the handle "
                      "holds no pending send of %s%s; send first (phases DEP_LL_SEND), with the "
                      "same handle", op, op, p == NULL ? "" : " (it holds another operation's)");
    return 0;
  }
  if (p != NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "phases: the handle holds the send of call "
                    "%llu (%s), whose receive has not run; run its DEP_LL_RECV first%s",
                    (unsigned long long)held, host_ops_op_name(p->op),
                    kind == OPS_OP_LL_DISPATCH ? ", or dispatch into another handle" : "");
  return 0;
}

int ops_check_ll_dispatch(const struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                          const struct dep_handle *h, char *why, size_t whylen) {
  const char *op = "ll_dispatch";
  int rc = ops_check_ctx(c, why, whylen);
  if (rc != 0)
    return rc;
  NEED(a, op, "args");
  if (h == NULL)
    return why_fail(why, whylen, DEP_ERR_INVALID, "ll_dispatch: handle is NULL; make one with dep_handle_new");
  if ((rc = ops_check_phases(c, a->phases, h, OPS_OP_LL_DISPATCH, op, why, whylen)) != 0)
    return rc;
  if (a->wait_cost != NULL)
    NEED(a->wait_cost, op, "wait_cost");
  if ((rc = check_index_type(a->index_type, op, why, whylen)) != 0 ||
      (rc = check_tokens(a->num_tokens, c->lay.max_ll_tokens, op, "max_ll_tokens_per_rank", why,
                         whylen)) != 0)
    return rc;
  if (a->use_fp8 != 0 && a->use_fp8 != 1)
    return why_fail(why, whylen, DEP_ERR_INVALID, "ll_dispatch: use_fp8 is %d; give 0 (bf16) or 1 (e4m3)", a->use_fp8);
  NEED_AL(a->recv_x, a->use_fp8 ? 1u : 2u, op, "recv_x");
  NEED(a->recv_count, op, "recv_count");
  if (a->use_fp8)
    NEED(a->recv_scales, op, "recv_scales (required with use_fp8)");
  if (a->phases == DEP_LL_RECV) {
    /* The receive reads no input: they are the send's, which the caller may have written
     * since; the arguments must still be the send's. */
    const struct ops_pending *p = &c->pend[host_ops_pending(c, h) & 1];
    if (a->num_tokens != h->num_tokens || a->use_fp8 != ((p->op & OPS_OP_FP8) != 0))
      return why_fail(why, whylen, DEP_ERR_INVALID, "%s: phases is DEP_LL_RECV with %s %u; its "
                      "send (call %llu) had %u: pass the receive the send's arguments", op,
                      a->num_tokens != h->num_tokens ? "num_tokens" : "use_fp8",
                      a->num_tokens != h->num_tokens ? a->num_tokens : (uint32_t)a->use_fp8,
                      (unsigned long long)p->seq,
                      a->num_tokens != h->num_tokens ? h->num_tokens
                                                     : (uint32_t)((p->op & OPS_OP_FP8) != 0));
    return 0;
  }
  if (a->num_tokens > 0) {
    NEED_BF16(a->x, op, "x");
    NEED_IDX(a->topk_idx, a->index_type, op);
    return check_idx(c, a->topk_idx, a->index_type, a->num_tokens, op, why, whylen);
  }
  return 0;
}

int ops_check_ll_combine(const struct ops_ctx *c, const struct dep_ll_combine_args *a,
                         const struct dep_handle *h, char *why, size_t whylen) {
  const char *op = "ll_combine";
  int rc = ops_check_ctx(c, why, whylen);
  if (rc != 0)
    return rc;
  NEED(a, op, "args");
  if ((rc = ops_check_phases(c, a->phases, h, OPS_OP_LL_COMBINE, op, why, whylen)) != 0 ||
      (rc = check_handle(c, h, OPS_HANDLE_LL, op, why, whylen)) != 0 ||
      (rc = check_index_type(a->index_type, op, why, whylen)) != 0)
    return rc;
  if (a->wait_cost != NULL)
    NEED(a->wait_cost, op, "wait_cost");
  NEED_BF16(a->x, op, "x");
  if (h->num_tokens == 0)
    return 0;
  NEED_IDX(a->topk_idx, a->index_type, op);
  NEED(a->topk_weights, op, "topk_weights");
  NEED_BF16(a->out, op, "out");
  if ((rc = check_idx(c, a->topk_idx, a->index_type, h->num_tokens, op, why, whylen)) != 0)
    return rc;
  if (ops_check_idx_hash(a->topk_idx, a->index_type, (size_t)h->num_tokens * c->shape.topk) !=
      h->idx_hash)
    return why_fail(why, whylen, DEP_ERR_INVALID, "ll_combine: topk_idx differs from the one given to the matching "
                "dep_ll_dispatch; pass the same ids");
  return 0;
}
