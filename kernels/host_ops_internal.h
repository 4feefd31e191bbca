/*
 * host_ops_internal.h — what the host backend's files (host_ops.c,
 * host_ops_tp.c, host_ops_ll.c) share and no one else sees: where a slot or
 * row lies in the slabs and the exchange region, and the protocol's steps.
 * The public interface is host_ops.h.
 */
#ifndef DEP_HOST_OPS_INTERNAL_H
#define DEP_HOST_OPS_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#include "host_ops.h"

/* Why a call on a broken context (c->broken) is refused: the ranks are out of step. */
#define OPS_BROKEN_WHY                                                                          \
  "an earlier call timed out or found a rank of the job gone, so the ranks are out of step; "   \
  "detach and restart the job"

/* Say why in c->why and return rc, so that a failure reads `return set_why(...)`. */
static inline int set_why(struct ops_ctx *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline int set_why(struct ops_ctx *c, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  return rc;
}

static inline int64_t idx_at(const void *idx, int type, size_t i) {
  return type == DEP_INDEX_I64 ? ((const int64_t *)idx)[i] : ((const int32_t *)idx)[i];
}

/* Whether rank r is masked for the running call (host_ops.h "Masked ranks"). */
static inline bool ops_masked(const struct ops_ctx *c, uint32_t r) {
  return c->nmasked != 0 && ((c->mask[r / 64u] >> (r % 64u)) & 1u) != 0;
}

/* Store a received id as the dispatch's recv_index_type says (0: int32). */
static inline void ridx_put(void *idx, int wide, size_t i, int32_t v) {
  if (wide)
    ((int64_t *)idx)[i] = v;
  else
    ((int32_t *)idx)[i] = v;
}

static inline struct ops_slot *slot_at(const struct ops_ctx *c, uint32_t slab, unsigned parity,
                                       uint32_t src) {
  return (struct ops_slot *)(c->slabs[slab] + dep_slab_ctrl_slot(&c->lay, parity, src));
}

static inline uint8_t *row_at(const struct ops_ctx *c, uint32_t slab, unsigned parity,
                              uint32_t src, uint32_t row) {
  return c->slabs[slab] + dep_slab_row(&c->lay, parity, src, row);
}

/* What source src posted to this rank in a call of parity: its slot and
 * block in our slab, or (src on another node) in our exchange region,
 * where the daemon writes them. */
static inline struct ops_slot *in_slot(const struct ops_ctx *c, unsigned parity, uint32_t src) {
  if (c->remote[src] < 0)
    return slot_at(c, c->rank, parity, src);
  return (struct ops_slot *)(c->xchg + dep_slab_in_slot(&c->lay, parity, (uint32_t)c->remote[src]));
}

static inline uint8_t *in_row(const struct ops_ctx *c, unsigned parity, uint32_t src,
                              uint32_t row) {
  if (c->remote[src] < 0)
    return row_at(c, c->rank, parity, src, row);
  return c->xchg + dep_slab_in_block(&c->lay, parity, (uint32_t)c->remote[src]) +
         (uint64_t)row * c->lay.row_bytes;
}

/* Where this rank's block for dest goes in a call of parity: dest's slab,
 * or (dest on another node) the out block of our exchange region, for the
 * proxy. */
static inline uint8_t *out_block(const struct ops_ctx *c, uint32_t dest, unsigned parity) {
  if (c->remote[dest] < 0)
    return c->slabs[dest] + dep_slab_block(&c->lay, parity, c->rank);
  return c->xchg + dep_slab_out_block(&c->lay, parity, (uint32_t)c->remote[dest]);
}

/* The slot this rank announces its rows of this call to dest by: in dest's
 * slab, or (dest on another node) the out slot image of our exchange region. */
static inline struct ops_slot *out_slot(const struct ops_ctx *c, uint32_t dest) {
  const unsigned parity = (unsigned)(c->seq & 1);
  if (c->remote[dest] < 0)
    return slot_at(c, dest, parity, c->rank);
  return (struct ops_slot *)(c->xchg + dep_slab_out_slot(&c->lay, parity,
                                                         (uint32_t)c->remote[dest]));
}

static inline uint8_t *out_row(const struct ops_ctx *c, uint32_t dest, unsigned parity,
                               uint32_t row) {
  return out_block(c, dest, parity) + (uint64_t)row * c->lay.row_bytes;
}

static inline uint32_t local_experts(const struct ops_ctx *c) {
  return c->shape.num_experts / c->world;
}

/*
 * The ranks token t of topk_idx (topk ids per token) goes to: those owning
 * one of its experts, each once, ascending, into dest (at most topk);
 * returns how many.  O(topk^2) per token whatever the world: a token's ids
 * are few.  The operations' calls skip the ranks masked for the call
 * (skip_masked); a layout, which is local, does not.
 */
static inline uint32_t token_dests_of(const struct ops_ctx *c, const void *idx, int type,
                                      uint32_t t, uint32_t *dest, bool skip_masked) {
  const uint32_t k = c->shape.topk, le = local_experts(c);
  uint32_t n = 0;
  for (uint32_t j = 0; j < k; j++) {
    int64_t e = idx_at(idx, type, (size_t)t * k + j);
    if (e < 0)
      continue;
    uint32_t d = (uint32_t)(e / le), i = n;
    if (skip_masked && ops_masked(c, d))
      continue;
    while (i > 0 && dest[i - 1] > d)
      i--;
    if (i > 0 && dest[i - 1] == d)
      continue;
    memmove(dest + i + 1, dest + i, (n - i) * sizeof *dest);
    dest[i] = d;
    n++;
  }
  return n;
}
static inline uint32_t token_dests(const struct ops_ctx *c, const void *idx, int type, uint32_t t,
                                   uint32_t *dest) {
  return token_dests_of(c, idx, type, t, dest, true);
}

/* The call's mask as it begins: the live mask or-ed with this rank's own. */
void host_ops__mask_begin(struct ops_ctx *c);
/* In a wait: whether the live mask's epoch moved and masked a rank more
 * (or-ed into the call's mask, which never loses a bit mid-call). */
bool host_ops__mask_grew(struct ops_ctx *c);
/* (token, k) pairs of topk_idx whose expert's rank is masked (a handle's dropped). */
uint64_t host_ops__dropped(const struct ops_ctx *c, const void *idx, int type, uint32_t tokens);

/* The modes or-ed into a slot's op, as a mismatch message shows them after the name. */
const char *host_ops__op_modes(uint32_t op);
/* The i-th look of a wait that is not met yet: yield, then sleep (many ranks, few cores). */
void host_ops__backoff(uint32_t i);
/* Push a descriptor of kind (xring.h DEP_XRING_*) for dest to the proxy's ring. */
int host_ops__ring_push(struct ops_ctx *c, uint32_t op, uint32_t dest, uint32_t kind,
                        uint32_t row0, uint64_t bytes);
/* Fill dest's slot for this call (out_slot): its fields, then its flag with release ordering. */
void host_ops__slot_post(struct ops_ctx *c, uint32_t dest, uint32_t rows, uint32_t op,
                         uint64_t ref_seq, uint32_t num_tokens);
/* Publish this rank's block for the current call (rows of it, bytes long) to dest. */
int host_ops__post(struct ops_ctx *c, uint32_t dest, uint32_t rows, uint32_t op, uint64_t ref_seq,
                   uint32_t num_tokens, uint64_t bytes);
/* This rank's abort words (slab.h), which the daemon writes when a rank of the job is gone. */
static inline const struct dep_slab_abort *host_ops__abort_words(const struct ops_ctx *c) {
  return (const struct dep_slab_abort *)(c->slabs[c->rank] + DEP_SLAB_ABORT_OFF);
}
/* The abort words once the daemon has written them (their code read with acquire, so the
 * rest is visible), NULL while no rank of the job is gone. */
static inline const struct dep_slab_abort *host_ops__gone(const struct ops_ctx *c) {
  const struct dep_slab_abort *ab = host_ops__abort_words(c);
  return __atomic_load_n(&ab->code, __ATOMIC_ACQUIRE) != 0 ? ab : NULL;
}
/* Whether a gone rank (the abort words) fails a wait of this call for src. */
int host_ops__aborted(const struct ops_ctx *c, unsigned parity, uint32_t src);
/* Record a failed wait for src in this rank's error record (host_ops.h), code
 * last with release ordering, and break the context: the ranks are out of step. */
void host_ops__record_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t seen,
                           uint64_t waited_ns, int32_t code);
/* Fail the call: a gone rank (the abort words) or the op timeout, waiting for src. */
int host_ops__peer_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t waited_ns);
int host_ops__timeout_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t seen,
                           uint64_t waited_ns);

/*
 * A streamed throughput call (host_ops_stream.c).  The caller sets each
 * peer's to_rows (host_ops__stream_setup zeroes the state first); fill
 * writes row j for dest; see checks a source's slot once, when it is first
 * there (a fault: host_ops__stream_fault); take moves what has arrived
 * into the outputs (host_ops__stream_avail, _row, _taken), returns 1 if it
 * moved anything (or _taken's failure, below 0), and names in *awaited a
 * rank it still waits for (UINT32_MAX: it is done).
 *
 * A dispatch also gives fill_node and its tokens' ranks (token_ranks,
 * token_nranks: the handle's): its rows for the ranks of a node in the
 * ring's fan table (xring.h) then go once per token through the node's
 * channel, fill_node writing token t's row as that channel carries it.
 * A call without fill_node (combine) sends every rank its own rows.
 */
struct ops_stream {
  uint32_t op;
  uint64_t ref_seq;
  uint32_t num_tokens;
  void (*fill)(struct ops_ctx *c, void *arg, uint32_t dest, uint32_t j, uint8_t *row);
  void (*fill_node)(struct ops_ctx *c, void *arg, uint32_t t, uint8_t *row);
  const uint32_t *token_ranks; /* [num_tokens * topk]: token t's ranks, ascending */
  const uint8_t *token_nranks; /* [num_tokens]: how many */
  void (*see)(struct ops_ctx *c, void *arg, uint32_t src, const struct ops_slot *slot);
  int (*take)(struct ops_ctx *c, void *arg, const struct ops_stream *s, uint32_t *awaited);
  void *arg;
};
void host_ops__stream_setup(struct ops_ctx *c);
/* Run the call to its end: 0, the first fault found, or the failure that ended it. */
int host_ops__stream(struct ops_ctx *c, const struct ops_stream *s);
int host_ops__stream_fault(struct ops_ctx *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Rows of src there to take in this call (0 until its slot is seen). */
uint32_t host_ops__stream_avail(struct ops_ctx *c, const struct ops_stream *s, uint32_t src);
/* Src's row r of this call. */
const uint8_t *host_ops__stream_row(const struct ops_ctx *c, uint32_t src, uint32_t r);
/* N more of src's rows are taken: credit it (a whole chunk, or its last row), handing the
 * credit of a source on another node to the proxy at once: 0, or the DEP_ERR_* (below 0)
 * of a failure to hand it, which take returns. */
int host_ops__stream_taken(struct ops_ctx *c, const struct ops_stream *s, uint32_t src,
                           uint32_t n);

/* Size h's arrays for c's shape for a handle of kind (OPS_HANDLE_TP or _LL) and mark it empty. */
int host_ops__handle_reserve(struct ops_ctx *c, struct dep_handle *h, uint32_t kind);
/* Start a communicating call: refuse an unready or broken context, else take the next seq. */
int host_ops__begin(struct ops_ctx *c);
/* Split calls (host_ops.h): this rank has read call q; keep the current call's state for
 * its deferred receive; run a pending receive as its call, then come back. */
void host_ops__taken(struct ops_ctx *c, uint64_t q);
/* ... and, its receive having run after a later call's send, tell the sources on other
 * nodes that posted it (inside pend_enter: c->seq is that call). */
int host_ops__taken_far(struct ops_ctx *c, uint32_t op);
void host_ops__pend_save(struct ops_ctx *c, uint32_t op, const struct dep_handle *h);
void host_ops__pend_enter(struct ops_ctx *c, unsigned parity, struct ops_pending *keep);
void host_ops__pend_leave(struct ops_ctx *c, unsigned parity, const struct ops_pending *keep);
/* Post this rank's block to every rank, rows[d] rows of stride bytes each. */
int host_ops__post_all(struct ops_ctx *c, const uint32_t *rows, uint32_t op, uint64_t ref_seq,
                       uint32_t num_tokens, uint64_t stride);
/* Wait for every source's post of this call and check it made the same op. */
int host_ops__wait_all(struct ops_ctx *c, uint32_t op);
/* Check that every source of a combine answered h's dispatch with expect[src] rows. */
int host_ops__check_combine_slots(struct ops_ctx *c, const struct dep_handle *h,
                                  const uint32_t *expect);

#endif
