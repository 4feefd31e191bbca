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
 * daemon writes it into the receiver's in channel and adds its rows to the
 * chunk's count; the receiver's credit comes back through both daemons,
 * and is handed to the proxy only while the sender may still wait for it.
 * A dispatch's rows for the ranks of a node the ring's fan table names
 * (xring.h) go once per token through that node's channel instead, which
 * the far daemon fans out into the same rows of the same in channels: a
 * token crosses the network once per destination node.
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

/* The count word of chunk n of remote source src's channel to this rank (slab.h's in_mark). */
static _Atomic uint64_t *in_count(const struct ops_ctx *c, uint32_t src, uint32_t n) {
  return (_Atomic uint64_t *)(c->xchg + dep_slab_in_mark(&c->lay, (unsigned)(c->seq & 1),
                                                         (uint32_t)c->remote[src], n));
}

/* The rows of remote source src whose chunks are in: each chunk's count
 * of rows in, in order (slab.h).  A chunk's rows may come in several
 * frames (a node channel's fan-out: xring.h), so the count, not one
 * store, says when the last of them is in.  The word of chunk n is the
 * word of chunk n - DEP_SLAB_CHUNKS until that one is taken and credited
 * (its count set back to 0): chunk n is looked at only after. */
static uint32_t remote_in(struct ops_ctx *c, uint32_t src) {
  struct ops_peer *p = &c->peer[src];
  const uint32_t chunk = c->lay.chunk_rows;
  while (p->from_in < p->from_rows) {
    const uint32_t n = p->from_in / chunk;
    if (n >= DEP_SLAB_CHUNKS && p->from_cred < (n - DEP_SLAB_CHUNKS + 1) * chunk)
      break;
    const uint32_t end = p->from_rows - p->from_in > chunk ? (n + 1) * chunk : p->from_rows;
    if (atomic_load_explicit(in_count(c, src, n), memory_order_acquire) !=
        DEP_SLAB_CHAN_AT(c->seq, end - n * chunk))
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

int host_ops__stream_taken(struct ops_ctx *c, const struct ops_stream *s, uint32_t src,
                           uint32_t n) {
  struct ops_peer *p = &c->peer[src];
  p->from_taken += n;
  /* Credit a whole chunk at a time, and the end of the stream: the sender
   * waits for chunks, so a credit between them would buy it nothing. */
  const uint32_t chunk = c->lay.chunk_rows;
  if (p->from_taken != p->from_rows && p->from_taken / chunk == p->from_cred / chunk)
    return 0;
  /* A remote source's chunks taken whole go back to a count of 0 before
   * the credit lets it write their places again (slab.h). */
  for (uint32_t ch = p->from_cred / chunk; c->remote[src] >= 0 && ch * chunk < p->from_taken &&
                                           ((ch + 1) * chunk <= p->from_taken ||
                                            p->from_taken == p->from_rows);
       ch++)
    atomic_store_explicit(in_count(c, src, ch), 0, memory_order_relaxed);
  p->from_cred = p->from_taken;
  struct ops_slot *sl = in_slot(c, (unsigned)(c->seq & 1), src);
  atomic_store_explicit(&sl->credit, DEP_SLAB_CHAN_AT(c->seq, p->from_taken),
                        memory_order_release);
  /* A sender on another node learns it through the proxies, for as long
   * as it may wait for it (until it may write its last row), and at once:
   * the sender waits for it through both daemons, and a take that goes on
   * through later chunks (a combine sums token after token while their
   * vectors are in) must not hold it back until the take returns. */
  if (c->remote[src] < 0 || p->cred_sent + c->lay.chan_rows >= p->from_rows)
    return 0;
  p->cred_sent = p->from_cred;
  return host_ops__ring_push(c, s->op, src, DEP_XRING_CREDIT, 0, 0);
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
 * their chunk's mark (its count of rows), then the descriptor (with the
 * slot image, the first). */
static int push_chunk(struct ops_ctx *c, const struct ops_stream *s, uint32_t dest,
                      uint32_t from, uint32_t end) {
  struct ops_peer *p = &c->peer[dest];
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t ri = (uint32_t)c->remote[dest];
  uint32_t kind = p->to_pushed ? 0u : DEP_XRING_SLOT;
  if (end > from) {
    _Atomic uint64_t *mark = (_Atomic uint64_t *)(c->xchg + dep_slab_out_mark(
                                                      &c->lay, parity, ri, from / c->lay.chunk_rows));
    atomic_store_explicit(mark, DEP_SLAB_CHAN_AT(c->seq, end - from), memory_order_relaxed);
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

/* Whether dest's rows of this call go through its node's channel. */
static bool by_node(const struct ops_ctx *c, const struct ops_stream *s, uint32_t dest) {
  return s->fill_node != NULL && c->n_nodes > 0 && c->node_of[dest] != OPS_NO_NODE;
}

/* Whether rank d takes the rows of node `node`'s channel: one of its ranks
 * that makes the same op (one that makes another takes none of ours, as
 * on a channel of its own: the node channel's table leaves it out, and
 * the far daemon writes it nothing), and is not masked (a rank masked
 * mid-call is sent nothing more and waited for by no one, as on its own
 * channel). */
static bool node_dest(const struct ops_ctx *c, uint32_t d, uint32_t node) {
  return c->node_of[d] == node && !c->peer[d].other_op && !ops_masked(c, d);
}

/* Each node's tokens of this dispatch, in token order: nodelist[off ..
 * off + rows) (a counting sort, O(tokens * topk^2) at most). */
static void node_setup(struct ops_ctx *c, const struct ops_stream *s) {
  const uint32_t k = c->shape.topk;
  for (uint32_t n = 0; n < c->n_nodes; n++) {
    c->node[n].rows = c->node[n].done = 0;
    memset(c->node[n].pushed_at, 0, sizeof c->node[n].pushed_at);
  }
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      for (uint32_t n = 0, at = 0; n < c->n_nodes; n++) {
        c->node[n].off = at;
        at += c->node[n].rows;
        c->node[n].rows = 0;
      }
    for (uint32_t t = 0; t < s->num_tokens; t++) {
      const uint32_t *dest = s->token_ranks + (size_t)t * k;
      for (uint32_t i = 0; i < s->token_nranks[t]; i++) {
        const uint32_t n = c->node_of[dest[i]];
        bool again = n == OPS_NO_NODE;
        for (uint32_t j = 0; j < i && !again; j++)
          again = c->node_of[dest[j]] == n;
        if (again)
          continue;
        if (pass == 1)
          c->nodelist[c->node[n].off + c->node[n].rows] = t;
        c->node[n].rows++;
      }
    }
  }
}

/* The node channel's chunk ending at row `end` is written: each of the
 * node's ranks' start and count in it (xring.h's node out marks), then the
 * descriptor. */
static int push_node(struct ops_ctx *c, const struct ops_stream *s, struct ops_node *n,
                     uint32_t end) {
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t chunk = c->lay.chunk_rows, from = (end - 1) / chunk * chunk;
  for (uint32_t i = 0; i < n->n; i++) {
    const uint32_t d = c->node_ranks[n->first + i];
    const struct ops_peer *p = &c->peer[d];
    _Atomic uint64_t *w = (_Atomic uint64_t *)(c->xchg + dep_slab_out_mark(
                                                   &c->lay, parity, (uint32_t)c->remote[d],
                                                   from / chunk));
    atomic_store_explicit(w, DEP_XRING_NODE_AT(p->node_start, p->to_done - p->node_start),
                          memory_order_relaxed);
  }
  int rc = host_ops__ring_push(c, s->op, n->lead, DEP_XRING_NODE, from,
                               (uint64_t)(end - from) * c->lay.row_bytes);
  if (rc == 0)
    n->pushed_at[from / chunk % DEP_SLAB_CHUNKS] =
        atomic_load_explicit(&c->ring->head, memory_order_relaxed);
  return rc;
}

/*
 * Write what the node channel's room and its ranks' credits allow of node
 * n's rows, each token once, publishing each chunk: 1 if any row moved, 0
 * if none (*blocked: a rank of it whose credit it waits for, or its lead
 * while the proxy has not taken the chunk whose place it needs), or the
 * DEP_ERR_* (below 0) of a failure to hand one to the proxy.  A row goes
 * only when every rank it is for has room for it (credits stay per rank).
 */
static int send_node(struct ops_ctx *c, const struct ops_stream *s, struct ops_node *n,
                     uint32_t *blocked) {
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t chunk = c->lay.chunk_rows, chan = c->lay.chan_rows, k = c->shape.topk;
  const uint32_t node = (uint32_t)(n - c->node);
  int moved = 0;
  while (n->done < n->rows) {
    const uint32_t i = n->done;
    if (i % chunk == 0) {
      /* A chunk's place is free once the proxy has copied out the chunk
       * that was there (xfer_proxy.c copies a streamed node chunk). */
      if (i >= chan && atomic_load_explicit(&c->ring->tail, memory_order_acquire) <
                           n->pushed_at[i / chunk % DEP_SLAB_CHUNKS]) {
        *blocked = n->lead;
        break;
      }
      for (uint32_t j = 0; j < n->n; j++)
        c->peer[c->node_ranks[n->first + j]].node_start =
            c->peer[c->node_ranks[n->first + j]].to_done;
    }
    const uint32_t t = c->nodelist[n->off + i];
    const uint32_t *dest = s->token_ranks + (size_t)t * k;
    uint32_t j = 0;
    for (; j < s->token_nranks[t]; j++)
      if (node_dest(c, dest[j], node) && !room_for(c, dest[j], c->peer[dest[j]].to_done))
        break;
    if (j < s->token_nranks[t]) {
      *blocked = dest[j];
      break;
    }
    s->fill_node(c, s->arg, t, out_row(c, n->lead, parity, i % chan));
    for (j = 0; j < s->token_nranks[t]; j++)
      if (node_dest(c, dest[j], node))
        c->peer[dest[j]].to_done++;
    n->done++;
    moved = 1;
    if (n->done % chunk == 0 || n->done == n->rows) {
      int rc = push_node(c, s, n, n->done);
      if (rc != 0)
        return rc;
    }
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
  if (s->fill_node != NULL && c->n_nodes > 0)
    node_setup(c, s);
  for (uint32_t d = 0; d < c->world; d++) {
    if (ops_masked(c, d))
      continue; /* masks: a masked rank is sent nothing */
    host_ops__slot_post(c, d, c->peer[d].to_rows, s->op, s->ref_seq, s->num_tokens);
    if (c->remote[d] >= 0 && (c->peer[d].to_rows == 0 || by_node(c, s, d)) &&
        (rc = push_chunk(c, s, d, 0, 0)) != 0)
      return rc;
  }
  const uint64_t limit = (uint64_t)c->timeout_ms * 1000000ull;
  uint64_t since = stream_now_ns();
  for (uint32_t i = 0;; i++) {
    int moved = 0;
    uint32_t waiting = UINT32_MAX; /* a rank this pass could not go on without */
    bool sent = true;
    for (uint32_t n = 0; s->fill_node != NULL && n < c->n_nodes; n++) {
      struct ops_node *nd = &c->node[n];
      if (nd->done == nd->rows)
        continue;
      uint32_t blocked = nd->lead;
      int m = send_node(c, s, nd, &blocked);
      if (m < 0)
        return m;
      moved |= m;
      if (nd->done < nd->rows) {
        sent = false;
        waiting = waiting == UINT32_MAX ? blocked : waiting;
      }
    }
    for (uint32_t d = 0; d < c->world; d++) {
      if (c->peer[d].to_done == c->peer[d].to_rows || c->peer[d].other_op || by_node(c, s, d) ||
          ops_masked(c, d))
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
      return taken; /* a credit not handed to the proxy */
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
