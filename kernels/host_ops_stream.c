/*
 * host_ops_stream.c — how the host backend's throughput calls move their
 * rows (DESIGN §6 "Streaming with bounded buffers"): every rank sends
 * every rank its rows and receives every rank's, in one loop that never
 * blocks on one peer while another could make progress.
 *
 * To a rank of this node the rows go through a channel in the receiver's
 * slab (slab.h): the call's slot (rows, op, ref_seq) is posted first, then
 * the rows into a ring of chan_rows rows, the tail (rows published) stored
 * with release ordering after each chunk; the receiver takes rows out as
 * they come and stores its credit (rows taken) after each chunk, which is
 * what lets the sender reuse the ring.  A job whose chunk is a whole block
 * (chan_rows = max_tokens_per_rank) runs the same protocol and never waits
 * for credit.  To a rank on another node the same channel passes through
 * the exchange regions (slab.h): each chunk goes into the out channel and
 * to the proxy as a descriptor (with the slot image, the first), the far
 * daemon writes it into the receiver's in channel and its mark; the
 * receiver's credit comes back through both daemons, and is handed to the
 * proxy only while the sender may still wait for it.
 *
 * Where rows land is the caller's (a take function): dispatch places each
 * source's rows at that source's offset in its output, whatever order they
 * arrive in; combine sums each token's vectors in rank order.  A call that
 * finds something wrong (a mismatch, a count out of range) keeps taking
 * and sending to the end before it says so, so that its peers are not left
 * waiting for credit; only a gone rank, a failed peer or the timeout end
 * it at once.
 */
#include "host_ops_internal.h"

#include <time.h>

static uint64_t stream_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A tail or credit word's rows for this call (0 for a word of an earlier call). */
static inline uint32_t chan_rows_of(const struct ops_ctx *c, uint64_t word) {
  const uint64_t at = DEP_SLAB_CHAN_AT(c->seq, 0);
  return word >= at ? (uint32_t)(word - at) : 0;
}

void host_ops__stream_setup(struct ops_ctx *c) {
  memset(c->peer, 0, c->world * sizeof *c->peer);
  c->stream_rc = 0;
}

/* Record the call's first problem found while it goes on (host_ops__stream). */
int host_ops__stream_fault(struct ops_ctx *c, int rc, const char *fmt, ...) {
  if (c->stream_rc != 0)
    return c->stream_rc;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  c->stream_rc = rc;
  return rc;
}

/* The rows of remote source src whose chunks are in: its marks, in order (slab.h). */
static uint32_t remote_in(struct ops_ctx *c, uint32_t src) {
  struct ops_peer *p = &c->peer[src];
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t chunk = c->lay.chunk_rows, ri = (uint32_t)c->remote[src];
  while (p->from_in < p->from_rows) {
    const uint32_t n = p->from_in / chunk;
    const uint32_t end = p->from_rows - p->from_in > chunk ? (n + 1) * chunk : p->from_rows;
    const _Atomic uint64_t *mark =
        (const _Atomic uint64_t *)(c->xchg + dep_slab_in_mark(&c->lay, parity, ri, n));
    if (atomic_load_explicit(mark, memory_order_acquire) != DEP_SLAB_CHAN_AT(c->seq, end))
      break;
    p->from_in = end;
  }
  return p->from_in;
}

uint32_t host_ops__stream_avail(struct ops_ctx *c, const struct ops_stream *s, uint32_t src) {
  struct ops_peer *p = &c->peer[src];
  const unsigned parity = (unsigned)(c->seq & 1);
  const struct ops_slot *sl = in_slot(c, parity, src);
  if (ops_masked(c, src)) { /* masks: nothing (more) is taken from a masked rank */
    p->seen = 1; /* one never seen: 0 rows */
    return p->from_taken;
  }
  if (!p->seen) {
    uint64_t f = atomic_load_explicit(&sl->flag, memory_order_acquire);
    if (f != c->seq) {
      if (f > c->seq && c->stream_rc == 0) {
        c->broken = 1;
        host_ops__stream_fault(c, DEP_ERR_MISMATCH, "%s: rank %u is at call %llu, this rank at "
                               "call %llu; a rank restarted or the slabs were not fresh: restart "
                               "the job", host_ops_op_name(s->op), src, (unsigned long long)f,
                               (unsigned long long)c->seq);
      }
      return 0;
    }
    p->seen = 1;
    p->from_rows = sl->rows;
    if (p->from_rows > c->lay.max_tokens) {
      host_ops__stream_fault(c, DEP_ERR_MISMATCH, "%s: rank %u posted %u rows, over the job's "
                             "max_tokens_per_rank %u", host_ops_op_name(s->op), src, p->from_rows,
                             c->lay.max_tokens);
      p->from_rows = 0; /* nothing of it is read: its rows may not be in the ring's bounds */
    } else if (sl->op != s->op) {
      /* Its rows are not this op's stream, and it takes none of ours. */
      p->other_op = 1;
      p->from_rows = 0;
      host_ops__stream_fault(c, DEP_ERR_MISMATCH, "call %llu: this rank ran %s%s, rank %u ran "
                             "%s%s; every rank must make the same sequence of calls, in the same "
                             "modes (use_fp8, cached, a combine's out_topk_weights)",
                             (unsigned long long)c->seq, host_ops_op_name(s->op),
                             host_ops__op_modes(s->op), src, host_ops_op_name(sl->op),
                             host_ops__op_modes(sl->op));
    } else if (s->see != NULL) {
      s->see(c, s->arg, src, sl);
    }
  }
  if (c->remote[src] >= 0)
    return remote_in(c, src);
  uint32_t tail = chan_rows_of(c, atomic_load_explicit(&sl->tail, memory_order_acquire));
  return tail < p->from_rows ? tail : p->from_rows;
}

const uint8_t *host_ops__stream_row(const struct ops_ctx *c, uint32_t src, uint32_t r) {
  const unsigned parity = (unsigned)(c->seq & 1);
  if (c->remote[src] >= 0)
    return in_row(c, parity, src, r % c->lay.chan_rows);
  return row_at(c, c->rank, parity, src, r % c->lay.chan_rows);
}

void host_ops__stream_taken(struct ops_ctx *c, uint32_t src, uint32_t n) {
  struct ops_peer *p = &c->peer[src];
  p->from_taken += n;
  /* Credit a whole chunk at a time, and the end of the stream: the sender
   * waits for chunks, so a credit between them would buy it nothing. */
  const uint32_t chunk = c->lay.chunk_rows;
  if (p->from_taken != p->from_rows && p->from_taken / chunk == p->from_cred / chunk)
    return;
  p->from_cred = p->from_taken;
  struct ops_slot *sl = in_slot(c, (unsigned)(c->seq & 1), src);
  atomic_store_explicit(&sl->credit, DEP_SLAB_CHAN_AT(c->seq, p->from_taken),
                        memory_order_release);
  /* A sender on another node learns it through the proxies, for as long
   * as it may wait for it: until it may write its last row. */
  if (c->remote[src] >= 0 && p->cred_sent + c->lay.chan_rows < p->from_rows)
    p->cred_due = 1;
}

/* Hand the proxy the credits owed to senders on other nodes. */
static int push_credits(struct ops_ctx *c, const struct ops_stream *s) {
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_peer *p = &c->peer[src];
    if (!p->cred_due)
      continue;
    p->cred_due = 0;
    p->cred_sent = p->from_cred;
    int rc = host_ops__ring_push(c, s->op, src, DEP_XRING_CREDIT, 0, 0);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* Whether dest has taken enough to let row j into its ring. */
static bool room_for(const struct ops_ctx *c, uint32_t dest, uint32_t j) {
  const uint32_t chan = c->lay.chan_rows;
  if (j < chan)
    return true;
  const struct ops_slot *sl = out_slot(c, dest);
  return chan_rows_of(c, atomic_load_explicit(&sl->credit, memory_order_acquire)) >= j - chan + 1;
}

/* Rows [from, end) for dest, on another node, are in the out channel:
 * their chunk's mark, then the descriptor (with the slot image, the first). */
static int push_chunk(struct ops_ctx *c, const struct ops_stream *s, uint32_t dest,
                      uint32_t from, uint32_t end) {
  struct ops_peer *p = &c->peer[dest];
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t ri = (uint32_t)c->remote[dest];
  uint32_t kind = p->to_pushed ? 0u : DEP_XRING_SLOT;
  if (end > from) {
    _Atomic uint64_t *mark = (_Atomic uint64_t *)(c->xchg + dep_slab_out_mark(
                                                      &c->lay, parity, ri, from / c->lay.chunk_rows));
    atomic_store_explicit(mark, DEP_SLAB_CHAN_AT(c->seq, end), memory_order_relaxed);
    kind |= DEP_XRING_CHUNK;
  }
  p->to_pushed = 1;
  return host_ops__ring_push(c, s->op, dest, kind, from, (uint64_t)(end - from) * c->lay.row_bytes);
}

/* Write what dest's credit allows of its rows, publishing each chunk: 1 if
 * any row moved, 0 if none, or the DEP_ERR_* (below 0) of a failure to hand
 * one to the proxy. */
static int send_some(struct ops_ctx *c, const struct ops_stream *s, uint32_t dest) {
  struct ops_peer *p = &c->peer[dest];
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t chunk = c->lay.chunk_rows, chan = c->lay.chan_rows;
  const bool remote = c->remote[dest] >= 0;
  int moved = 0;
  while (p->to_done < p->to_rows && room_for(c, dest, p->to_done)) {
    /* The rest of this chunk: the credit came in whole chunks. */
    const uint32_t from = p->to_done;
    uint32_t end = (from / chunk + 1) * chunk;
    end = end < p->to_rows ? end : p->to_rows;
    for (; p->to_done < end; p->to_done++)
      s->fill(c, s->arg, dest, p->to_done,
              remote ? out_row(c, dest, parity, p->to_done % chan)
                     : row_at(c, dest, parity, c->rank, p->to_done % chan));
    if (remote) {
      int rc = push_chunk(c, s, dest, from, end);
      if (rc != 0)
        return rc; /* a DEP_ERR_*, below 0 */
    } else {
      atomic_store_explicit(&out_slot(c, dest)->tail, DEP_SLAB_CHAN_AT(c->seq, p->to_done),
                            memory_order_release);
    }
    moved = 1;
  }
  return moved;
}

/*
 * A local rank this call waits for failed a call of its own (its error
 * record, which it writes before it stops, says so): it will send or take
 * no more, so neither will this rank.  Recorded as a wait for it that
 * found a peer gone.
 */
static int peer_stopped(struct ops_ctx *c, const struct ops_stream *s, uint32_t r,
                        uint64_t waited_ns) {
  /* Stopped by a rank that died or a node lost, most likely: name that
   * one, the cause (one that detached had finished its calls). */
  const struct dep_slab_abort *ab = host_ops__gone(c);
  if (ab != NULL && ab->detached != DEP_SLAB_GONE_DETACHED)
    return host_ops__peer_fail(c, s->op, r, waited_ns);
  struct ops_err_record theirs;
  host_ops_err_read(c->slabs[r], &theirs);
  const int32_t code = atomic_load_explicit(&theirs.code, memory_order_relaxed);
  host_ops__record_fail(c, s->op, r, 0, waited_ns, DEP_ERR_PEER);
  return set_why(c, DEP_ERR_PEER, "%s (call %llu): rank %u stopped in call %llu with %s "
                 "(waiting for rank %u there): the job cannot go on; restart it",
                 host_ops_op_name(s->op), (unsigned long long)c->seq, r,
                 (unsigned long long)theirs.seq, dep_strerror(code), theirs.source);
}

/*
 * Whether a wait for remote rank r may be one that will never end because
 * a rank of the job died: r's rows stream as r's own call goes on, and r
 * stops streaming when that call fails (it depended on the dead rank),
 * which its error record, on its own node, cannot tell this rank.  A rank
 * that detached had finished its calls and stops no one; one whose process
 * ended may have done so mid-call, so every wait for another node's rank
 * fails with DEP_ERR_PEER naming it (the job cannot go on either way).
 */
static bool remote_may_have_stopped(const struct ops_ctx *c, uint32_t r) {
  if (c->remote[r] < 0)
    return false;
  const struct dep_slab_abort *ab = host_ops__gone(c);
  return ab != NULL && ab->detached == DEP_SLAB_GONE_DIED;
}

int host_ops__stream(struct ops_ctx *c, const struct ops_stream *s) {
  const unsigned parity = (unsigned)(c->seq & 1);
  int rc;
  /* The slot before any row: the receiver learns the count at once (one
   * on another node, with the first chunk, or alone for no rows). */
  for (uint32_t d = 0; d < c->world; d++) {
    if (ops_masked(c, d))
      continue; /* masks: a masked rank is sent nothing */
    host_ops__slot_post(c, d, c->peer[d].to_rows, s->op, s->ref_seq, s->num_tokens);
    if (c->remote[d] >= 0 && c->peer[d].to_rows == 0 && (rc = push_chunk(c, s, d, 0, 0)) != 0)
      return rc;
  }
  const uint64_t limit = (uint64_t)c->timeout_ms * 1000000ull;
  uint64_t since = stream_now_ns();
  for (uint32_t i = 0;; i++) {
    int moved = 0;
    uint32_t waiting = UINT32_MAX; /* a rank this pass could not go on without */
    bool sent = true;
    for (uint32_t d = 0; d < c->world; d++) {
      if (c->peer[d].to_done == c->peer[d].to_rows || c->peer[d].other_op || ops_masked(c, d))
        continue;
      int m = send_some(c, s, d);
      if (m < 0)
        return m;
      moved |= m;
      if (c->peer[d].to_done < c->peer[d].to_rows) {
        sent = false;
        waiting = waiting == UINT32_MAX ? d : waiting;
      }
    }
    uint32_t awaited = UINT32_MAX;
    int taken = s->take(c, s->arg, s, &awaited);
    if (taken < 0)
      return c->stream_rc != 0 ? c->stream_rc : DEP_ERR_INTERNAL;
    if ((rc = push_credits(c, s)) != 0)
      return rc;
    moved |= taken > 0;
    if (sent && awaited == UINT32_MAX)
      break;
    if (awaited != UINT32_MAX)
      waiting = awaited;
    if (moved) {
      i = 0;
      since = stream_now_ns();
      continue;
    }
    if (i < 256 || host_ops__mask_grew(c)) /* masks: a rank masked now is waited for no more */
      continue;
    const uint64_t waited = stream_now_ns() - since;
    if (host_ops__aborted(c, parity, waiting) || remote_may_have_stopped(c, waiting))
      return host_ops__peer_fail(c, s->op, waiting, waited);
    if (c->remote[waiting] < 0 && waiting != c->rank) {
      struct ops_err_record theirs;
      host_ops_err_read(c->slabs[waiting], &theirs);
      if (atomic_load_explicit(&theirs.code, memory_order_relaxed) != 0)
        return peer_stopped(c, s, waiting, waited);
    }
    if (waited > limit)
      return host_ops__timeout_fail(c, s->op, waiting,
                                    atomic_load_explicit(&in_slot(c, parity, waiting)->flag,
                                                         memory_order_relaxed),
                                    waited);
    host_ops__backoff(i);
  }
  return c->stream_rc;
}
