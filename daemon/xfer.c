/*
 * xfer.c — the data path between nodes (xfer.h, DESIGN §7): the routes of
 * the jobs that span nodes, the rings lent to their ranks, and the proxy
 * threads that drain them (RDMA writes through xfer_rdma.c, else frames
 * over the TCP data connections of xfer_conn.c).  Every byte moves
 * between exchange regions (proto/slab.h), host memory the daemon maps:
 * plain loads and stores, no call into the backend, on cuda as on host.
 */
#include "xfer.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <sodium.h>

#include "conn.h"
#include "devices.h"
#include "grow.h"
#include "job.h"
#include "kabi.h"
#include "lend.h"
#include "log.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "slab.h"
#include "xfer_internal.h"
#include "xfer_rdma.h"
#include "xring.h"

/* A sweep's frames for one peer go out in one send, up to this many bytes. */
#define XFER_BATCH_BYTES (4u << 20)
/*
 * The bytes a ring may send in its turn of a proxy thread's round robin
 * (deficit round robin, sweep): as much as one batch, so that a ring alone
 * still fills a batch per sweep, while a ring that is never empty takes no
 * more than this before every other ring of the thread has had its turn.
 */
#define XFER_QUANTUM XFER_BATCH_BYTES
/*
 * A payload shorter than this is copied into its batch beside its header;
 * a longer one is sent from its out block in place (its own iovec).  Below
 * a page the copy costs about what a segment of its own does (the
 * kernel's per-iovec work, and more sendmsg calls: a batch of many small
 * frames would need several of IOV_MAX iovecs each), and copying keeps a
 * run of empty and small frames with their headers in one iovec, as the
 * batch was before; above it the copy grows with the bytes and the
 * iovec's cost does not.
 */
#define XFER_COPY_MAX 4096u
/* How long an ended job's route waits for a receive into its regions
 * before it cuts the connections it is read from (xfer_job_end). */
#define XFER_END_CUT_MS 2000
/* A proxy thread with nothing to do spins this long (yielding) before it
 * sleeps in steps of XFER_NAP_NS: a call's next descriptor usually comes
 * within microseconds of the last. */
#define XFER_SPIN_NS 200000ull
#define XFER_NAP_NS 20000l

struct xfer_state xfer__state;

static int xfer_start_threads(void);

/* ---- routes ------------------------------------------------------------------ */

static struct xfer_route *route_find(const char *id) {
  for (struct xfer_route *r = X->routes; r != NULL; r = r->next)
    if (strcmp(r->id, id) == 0)
      return r;
  return NULL;
}

static struct xfer_route *route_of(const struct job *j) {
  for (struct xfer_route *r = X->routes; r != NULL; r = r->next)
    if (r->job == j)
      return r;
  return NULL;
}

void xfer__route_fail(struct xfer_route *r, int code) {
  int zero = 0;
  if (!atomic_compare_exchange_strong(&r->failed, &zero, code))
    return;
  for (uint32_t i = 0; i < r->local_world; i++)
    if (r->ring[i] != NULL)
      atomic_store_explicit(&r->ring[i]->failed, code, memory_order_release);
}

/* A route was added, or the threads stop: wake whoever waits for one. */
static void routes_wake(void) {
  pthread_mutex_lock(&X->routes_mu);
  atomic_fetch_add(&X->routes_added, 1);
  pthread_cond_broadcast(&X->routes_cv);
  pthread_mutex_unlock(&X->routes_mu);
}

void xfer__routes_wait(uint64_t seen, uint64_t deadline_ns) {
  struct timespec until = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                           .tv_nsec = (long)(deadline_ns % 1000000000ull)};
  pthread_mutex_lock(&X->routes_mu);
  while (atomic_load(&X->routes_added) == seen && !atomic_load(&X->stop) &&
         pthread_cond_timedwait(&X->routes_cv, &X->routes_mu, &until) == 0)
    ; /* woken, perhaps spuriously: look again */
  pthread_mutex_unlock(&X->routes_mu);
}

void xfer__routes_fail_peer(int k, const char *what) {
  for (struct xfer_route *r = X->routes; r != NULL; r = r->next) {
    for (uint32_t g = 0; g < r->world; g++) {
      if (r->peer_of[g] == k) {
        if (!atomic_exchange(&r->said, true))
          log_warnx("job %s: %s %s; the job fails", r->id, what, peer_name(k));
        xfer__route_fail(r, DEP_ERR_PEER);
        break;
      }
    }
  }
}

struct xfer_route *xfer__route_new(uint32_t world) {
  /* The tables after the route, remote_of first (for its alignment). */
  const size_t w = world;
  struct xfer_route *r = calloc(1, sizeof *r + w * (sizeof *r->remote_of + 2 * sizeof *r->peer_of));
  if (r == NULL)
    return NULL;
  r->world = world;
  r->remote_of = (uint32_t *)(r + 1);
  r->peer_of = (int16_t *)(r->remote_of + w);
  r->local_of = r->peer_of + w;
  return r;
}

void xfer_job_start(const struct job *j, const int16_t *who, xfer_membership_fn *membership) {
  if (!X->active || j->xchg == NULL)
    return;
  if (X->started == 0 && xfer_start_threads() != 0) {
    log_warnx("job %s: no proxy thread runs; its operations between nodes will fail", j->id);
    return;
  }
  struct xfer_route *r = xfer__route_new(j->world_size);
  if (r == NULL) {
    log_warnx("job %s: out of memory for its route between nodes; its operations will time out",
              j->id);
    return;
  }
  snprintf(r->id, sizeof r->id, "%s", j->id);
  r->job = j;
  r->local_world = j->local_world_size;
  char why[256];
  if (dep__slab_layout_nodes(&j->shape, j->world_size, j->local_world_size, j->chunk_rows,
                             &r->lay, why, sizeof why) != 0) {
    log_warnx("job %s: %s", j->id, why);
    free(r);
    return;
  }
  uint32_t remote = 0;
  for (uint32_t g = 0; g < r->world; g++) {
    r->peer_of[g] = who[g] >= 0 ? who[g] : -1;
    r->local_of[g] = -1;
    r->remote_of[g] = who[g] >= 0 ? remote++ : 0;
  }
  for (uint32_t i = 0; i < r->local_world; i++) {
    const struct job_rank *q = &j->ranks[i];
    r->local_of[q->rank] = (int16_t)i;
    r->rank_of[i] = q->rank;
    r->ring[i] = j->xchg[i].region->map;
    r->xchg[i] = dep_xring_xchg(j->xchg[i].region->map);
    r->mr[i] = j->xchg[i].region->mr;
  }
  r->rdma = xfer_rdma_route_new(j, who, membership);
  r->serial = ++X->serials;
  pthread_rwlock_wrlock(&X->lock);
  r->next = X->routes;
  X->routes = r;
  pthread_rwlock_unlock(&X->lock);
  routes_wake();
}

void xfer_job_fail(const struct job *j, int code) {
  if (!X->active)
    return;
  pthread_rwlock_rdlock(&X->lock);
  struct xfer_route *r = route_of(j);
  if (r != NULL)
    xfer__route_fail(r, code);
  pthread_rwlock_unlock(&X->lock);
}

void xfer_job_end(const struct job *j) {
  if (!X->active)
    return;
  pthread_rwlock_wrlock(&X->lock);
  xfer__unexpect(j); /* its frames are no longer waited for (xfer_conn.c) */
  struct xfer_route *r = NULL;
  for (struct xfer_route **pp = &X->routes; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->job == j) {
      r = *pp;
      *pp = r->next;
      break;
    }
  }
  if (r != NULL)
    snprintf(X->ended[X->n_ended++ % XFER_ENDED_MAX], DEP_JOB_ID_MAX, "%s", r->id);
  pthread_rwlock_unlock(&X->lock);
  if (r == NULL)
    return;
  /* Unlisted, it is taken by no one new; a proxy still sending from its out
   * blocks or a receiver reading into its in blocks finishes first: the
   * regions go back to the pool, for another job, right after this.  A
   * healthy connection finishes a frame in milliseconds; a receive still
   * not done after XFER_END_CUT_MS is one the peer stalls (this loop must
   * not wait out XFER_IO_MS), so the job's peers' inbound connections are
   * cut, their receivers give the route back at once, and the loop's tick
   * offers new ones.  A send waits as xfer_peer_down's does, for its
   * connection's progress or XFER_IO_MS. */
  uint64_t t0 = mono_ns();
  bool cut = false;
  while (atomic_load(&r->users) != 0) {
    if (!cut && mono_ns() - t0 > XFER_END_CUT_MS * 1000000ull) {
      pthread_rwlock_rdlock(&X->lock);
      for (uint32_t g = 0; g < r->world; g++)
        for (int i = 0; r->peer_of[g] >= 0 && i < XFER_CONNS_MAX; i++)
          if (X->peers[r->peer_of[g]].in_fds[i] >= 0)
            shutdown(X->peers[r->peer_of[g]].in_fds[i], SHUT_RDWR);
      pthread_rwlock_unlock(&X->lock);
      log_warnx("job %s: a frame of it was still being received %d ms after it ended; its "
                "peers' inbound data connections are cut (new ones are offered)", r->id,
                XFER_END_CUT_MS);
      cut = true;
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
  uint64_t waited_ms = (mono_ns() - t0) / 1000000u;
  if (waited_ms >= 100)
    log_info("job %s: its route waited %llu ms for sends and receives still using its exchange "
             "regions", r->id, (unsigned long long)waited_ms);
  xfer_rdma_route_free(r->rdma); /* its writes in flight land first */
  free(r);
}

/* ---- rings ------------------------------------------------------------------- */

void xfer_lend_ring(struct conn *c, uint32_t request_id) {
  const struct job *j = c->job;
  if (j == NULL || !j->ready || j->world_size == j->local_world_size) {
    conn_send_error(c, request_id, DEP_ERR_STATE,
                    "XRING_LEND: this connection is no rank of a running job that spans nodes; "
                    "attach to one first");
    return;
  }
  if (!j->multinode) {
    conn_send_error(c, request_id, DEP_ERR_UNSUPPORTED,
                    "XRING_LEND: job %s has %u of its %u ranks here but this daemon has no peers, "
                    "so no node holds the others: configure peers (deepepd.yaml(5))", j->id,
                    j->local_world_size, j->world_size);
    return;
  }
  pthread_rwlock_rdlock(&X->lock);
  const bool routed = X->active && route_of(j) != NULL;
  pthread_rwlock_unlock(&X->lock);
  uint32_t lr = c->job_local_rank;
  if (!routed || j->xchg == NULL) {
    conn_send_error(c, request_id, DEP_ERR_UNSUPPORTED, "XRING_LEND: job %s: this daemon moves "
                    "no data between nodes (no peers, or the proxy did not start)", j->id);
    return;
  }
  if (lr >= j->local_world_size || j->xchg[lr].lent) {
    conn_send_error(c, request_id, DEP_ERR_STATE, "XRING_LEND: job %s: this rank has its ring "
                    "already", j->id);
    return;
  }
  /* bytes is the ring's: the whole memfd (ring, then the exchange region)
   * is larger, and the rank checks its size against its own layout. */
  j->xchg[lr].lent = true;
  lend_xchg_hold(j, lr);
  struct dep_msg_lend_ok ok = {.version = DEP_XRING_VERSION, .bytes = (uint32_t)DEP_XRING_BYTES};
  int fd = j->xchg[lr].region->fd;
  conn_send(c, DEP_MSG_XRING_LEND_OK, request_id, &ok, &fd, 1);
}

static bool ended_here(const char *id) {
  for (uint32_t i = 0; i < XFER_ENDED_MAX && i < X->n_ended; i++)
    if (strcmp(X->ended[i], id) == 0)
      return true;
  return false;
}

/* Why a chunk (rows row0 .. row0 + bytes / row_bytes of a call's stream,
 * kind DEP_XRING_CHUNK and or SLOT) does not fit layout l; NULL when it does. */
static const char *chunk_wrong(const struct dep_slab_layout *l, uint32_t kind, uint32_t row0,
                               uint64_t bytes) {
  if (!(kind & DEP_XRING_CHUNK))
    return bytes == 0 && row0 == 0 ? NULL : "a slot alone with rows";
  if (l->chunk_rows == 0 || bytes % l->row_bytes != 0 || row0 % l->chunk_rows != 0)
    return "rows that are not a chunk of its channel";
  const uint64_t n = bytes / l->row_bytes;
  if (n == 0 || n > l->chunk_rows || row0 + n > l->max_tokens)
    return "more rows than a chunk or a call holds";
  return NULL;
}

/* Whether kind is one a descriptor or frame may have. */
static bool kind_known(uint32_t kind) {
  return kind == DEP_XRING_BLOCK || kind == DEP_XRING_CHUNK || kind == DEP_XRING_SLOT ||
         kind == (DEP_XRING_CHUNK | DEP_XRING_SLOT) || kind == DEP_XRING_CREDIT;
}

int xfer__frame_target(int k, const struct dep_xfer_hdr *h, struct xfer_route **route,
                       struct xfer_target *t, char *why, size_t whylen) {
  struct xfer_route *r = route_find(h->job_id);
  *route = r;
  memset(t, 0, sizeof *t);
  if (r == NULL)
    return ended_here(h->job_id) ? DEP_ERR_NOT_FOUND : DEP_ERR_STATE;
  const struct dep_slab_layout *l = &r->lay;
  const char *wrong = NULL;
  if (h->src >= r->world || r->peer_of[h->src] != k || h->dest >= r->world ||
      r->local_of[h->dest] < 0 || h->parity > 1 || !kind_known(h->kind))
    wrong = "the job's membership does not allow";
  else if (h->kind == DEP_XRING_BLOCK && h->bytes > l->xblock_bytes)
    wrong = "more bytes than a block holds";
  else if (h->kind == DEP_XRING_CREDIT && (h->bytes != 0 || h->row0 > l->max_tokens))
    wrong = "a credit past the rows a call holds";
  else if (h->kind != DEP_XRING_BLOCK && h->kind != DEP_XRING_CREDIT)
    wrong = chunk_wrong(l, h->kind, h->row0, h->bytes);
  if (wrong != NULL) {
    snprintf(why, whylen, "a frame of job %s from rank %u to rank %u (kind %u, parity %u, row "
             "%u, %llu bytes): %s", r->id, h->src, h->dest, h->kind, h->parity, h->row0,
             (unsigned long long)h->bytes, wrong);
    return DEP_ERR_PROTOCOL;
  }
  if (atomic_load(&r->failed) != 0)
    return DEP_ERR_NOT_FOUND; /* the job cannot go on here; its bytes have no reader */
  uint8_t *x = r->xchg[r->local_of[h->dest]];
  const uint32_t ri = r->remote_of[h->src];
  if (h->kind == DEP_XRING_CREDIT) {
    /* The destination's channel to the source: the credit word of its out slot. */
    t->credit = (_Atomic uint64_t *)(x + dep_slab_out_slot(l, h->parity, ri) +
                                     offsetof(struct ops_slot, credit));
    t->value = DEP_SLAB_CHAN_AT(h->seq, h->row0);
    return 0;
  }
  t->payload = x + dep_slab_in_block(l, h->parity, ri);
  if (h->kind & DEP_XRING_CHUNK) {
    const uint32_t n = (uint32_t)(h->bytes / l->row_bytes);
    t->payload += (uint64_t)(h->row0 % l->chan_rows) * l->row_bytes;
    t->mark = (_Atomic uint64_t *)(x + dep_slab_in_mark(l, h->parity, ri,
                                                         h->row0 / l->chunk_rows));
    t->value = DEP_SLAB_CHAN_AT(h->seq, h->row0 + n);
  }
  if (h->kind == DEP_XRING_BLOCK || (h->kind & DEP_XRING_SLOT))
    t->slot = x + dep_slab_in_slot(l, h->parity, ri);
  return 0;
}

void xfer__route_put(struct xfer_route *r) {
  atomic_fetch_sub_explicit(&r->users, 1, memory_order_release);
}

/*
 * A frame's payload lands in its destination rank's block: memory of the
 * job's ranks, shared with them, that this daemon writes and never reads.
 * When a block is written again is the ranks' protocol (a rank sends a
 * block's next frame only after its reader moved on), and a rank that
 * breaks it (check_xfer's flood does, on purpose) overwrites its own job's
 * block, perhaps from two of the peer's data connections at once.  That
 * order runs through other processes, which ThreadSanitizer does not see
 * (it watches this one); so it is told to leave these writes alone, and
 * checks everything else the receivers do.  In any other build these are
 * nothing.
 */
#if defined(__SANITIZE_THREAD__)
#define XFER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define XFER_TSAN 1
#endif
#endif
#ifdef XFER_TSAN
/* The dynamic annotations the ThreadSanitizer runtime exports. */
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
void xfer__payload_begin(void) { AnnotateIgnoreWritesBegin(__FILE__, __LINE__); }
void xfer__payload_end(void) { AnnotateIgnoreWritesEnd(__FILE__, __LINE__); }
#else
void xfer__payload_begin(void) {}
void xfer__payload_end(void) {}
#endif

void xfer__frame_publish(const struct xfer_target *t, const struct dep_xfer_hdr *h) {
  if (t->mark != NULL)
    atomic_store_explicit(t->mark, t->value, memory_order_release);
  if (t->slot != NULL) {
    /* The fields the sender writes; the tail and credit words are not a
     * remote slot's (slab.h), and credit is its reader's own. */
    memcpy(t->slot + 8, h->slot + 8, offsetof(struct ops_slot, tail) - 8);
    uint64_t flag;
    memcpy(&flag, h->slot, sizeof flag);
    atomic_store_explicit((_Atomic uint64_t *)t->slot, flag, memory_order_release);
  }
  if (t->credit != NULL) {
    /* Credits may cross on the peer's connections: the largest stands. */
    uint64_t was = atomic_load_explicit(t->credit, memory_order_relaxed);
    while (was < t->value && !atomic_compare_exchange_weak_explicit(
                                 t->credit, &was, t->value, memory_order_release,
                                 memory_order_relaxed)) {
    }
  }
}

/* ---- the proxy threads -------------------------------------------------------- */

bool xfer__batch_room(struct xfer_batch *b, size_t n) {
  return DEP_GROW(b->buf, b->cap, b->len + n, 1u << 16) == 0;
}

void xfer__batch_reset(struct xfer_batch *b) {
  for (uint32_t i = 0; i < b->n_seg; i++)
    if (b->seg[i].held != NULL)
      xfer__route_put(b->seg[i].held);
  b->n_seg = b->n_mark = 0;
  b->len = b->bytes = 0;
}

void xfer__batch_free(struct xfer_batch *b) {
  xfer__batch_reset(b);
  free(b->buf);
  free(b->seg);
  free(b->mark);
  b->buf = NULL;
  b->seg = NULL;
  b->mark = NULL;
  b->cap = b->cap_seg = b->cap_mark = 0;
}

/* Room in b for `copy` more bytes in buf and two more segments (one
 * frame), so that a frame is appended whole or not at all; false when out
 * of memory. */
static bool batch_reserve(struct xfer_batch *b, size_t copy) {
  return xfer__batch_room(b, copy) && DEP_GROW(b->mark, b->cap_mark, b->n_mark + 1, 64) == 0 &&
         DEP_GROW(b->seg, b->cap_seg, b->n_seg + 2, 64) == 0;
}

/* Count the n bytes written at the end of the batch's buf (b->len on)
 * into one segment with the bytes copied just before. */
static void batch_took(struct xfer_batch *b, size_t n) {
  struct xfer_seg *last = b->n_seg > 0 ? &b->seg[b->n_seg - 1] : NULL;
  if (last == NULL || last->ext != NULL) {
    b->seg[b->n_seg++] = (struct xfer_seg){.off = b->len};
    last = &b->seg[b->n_seg - 1];
  }
  b->len += n;
  last->len += n;
  b->bytes += n;
}

/* Append n bytes copied into the batch's buf (reserved), in one segment
 * with the bytes copied just before. */
static void batch_copy(struct xfer_batch *b, const void *src, size_t n) {
  memcpy(b->buf + b->len, src, n);
  batch_took(b, n);
}

/* Append frame header h's wire form (xring.h; room reserved) as
 * batch_copy does: 0, or the encoder's error with the batch as it was. */
static int batch_hdr(struct xfer_batch *b, const struct dep_xfer_hdr *h) {
  /* The codec appends to a proto_buf: the batch's buf, len and cap are one. */
  struct proto_buf pb = {.data = b->buf, .len = b->len, .cap = b->cap};
  const int rc = dep__xfer_hdr_encode(&pb, h);
  b->buf = pb.data;
  b->cap = pb.cap;
  if (rc == 0)
    batch_took(b, pb.len - b->len);
  return rc;
}

/* Append n bytes sent in place from an exchange region of route r, which
 * the segment holds until the batch is reset (reserved). */
static void batch_ref(struct xfer_batch *b, const uint8_t *src, size_t n, struct xfer_route *r) {
  atomic_fetch_add_explicit(&r->users, 1, memory_order_relaxed);
  b->seg[b->n_seg++] = (struct xfer_seg){.ext = src, .len = n, .held = r};
  b->bytes += n;
}

/*
 * What descriptor d of local rank lr's ring in route r names in its
 * exchange region (xfer_src), checked against the job's layout: true, or
 * false with why.
 */
static bool desc_source(const struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                        struct xfer_src *s, char *why, size_t len) {
  const struct dep_slab_layout *l = &r->lay;
  const int peer = d->dest < r->world ? r->peer_of[d->dest] : -1;
  const char *wrong = NULL;
  memset(s, 0, sizeof *s);
  if (peer < 0 || d->parity > 1 || !kind_known(d->kind))
    wrong = "a remote rank, parity 0 or 1 and a known kind";
  else if (d->kind == DEP_XRING_BLOCK && d->bytes > l->xblock_bytes)
    wrong = "a block's bytes";
  else if (d->kind == DEP_XRING_CREDIT && (d->bytes != 0 || d->row0 != 0))
    wrong = "a credit without bytes";
  else if (d->kind != DEP_XRING_BLOCK && d->kind != DEP_XRING_CREDIT)
    wrong = chunk_wrong(l, d->kind, d->row0, d->bytes) != NULL ? "whole rows of a chunk" : NULL;
  if (wrong != NULL) {
    snprintf(why, len, "a descriptor for rank %u (kind %u, parity %u, row %u, %llu bytes) that "
             "the job's layout does not allow (%s, up to %llu bytes)", d->dest, d->kind,
             d->parity, d->row0, (unsigned long long)d->bytes, wrong,
             (unsigned long long)l->xblock_bytes);
    return false;
  }
  const uint32_t ri = r->remote_of[d->dest];
  const uint8_t *x = r->xchg[lr];
  if (d->kind == DEP_XRING_CREDIT) {
    s->credit = x + dep_slab_in_slot(l, d->parity, ri) + offsetof(struct ops_slot, credit);
    return true;
  }
  s->payload = x + dep_slab_out_block(l, d->parity, ri);
  if (d->kind & DEP_XRING_CHUNK) {
    s->at = (uint64_t)(d->row0 % l->chan_rows) * l->row_bytes;
    s->payload += s->at;
    s->chunk = d->row0 / l->chunk_rows;
    s->mark = x + dep_slab_out_mark(l, d->parity, ri, s->chunk);
  }
  if (d->kind == DEP_XRING_BLOCK || (d->kind & DEP_XRING_SLOT)) {
    /* The rank wrote the slot before the descriptor (the ring's head, read
     * with acquire) and leaves it until the call after next. */
    s->slot = x + dep_slab_out_slot(l, d->parity, ri);
    uint64_t flag = atomic_load_explicit((const _Atomic uint64_t *)s->slot, memory_order_relaxed);
    if (flag != d->seq) {
      snprintf(why, len, "a descriptor of call %llu whose slot image holds call %llu",
               (unsigned long long)d->seq, (unsigned long long)flag);
      return false;
    }
  }
  return true;
}

/*
 * Take one descriptor of local rank lr's ring in route r into the batch of
 * the peer holding its destination, or into RDMA writes: what it names in
 * the exchange region (desc_source), read in place.  false: the descriptor
 * was bad (the route is failed, and said why).
 */
static bool take_desc(struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                      struct xfer_batch *batches, uint64_t *frames) {
  char why[256] = "";
  struct xfer_src s;
  if (!desc_source(r, lr, d, &s, why, sizeof why))
    goto bad;
  const int peer = r->peer_of[d->dest];
  const uint64_t payload = s.payload != NULL ? d->bytes : 0;
  if (xfer_rdma_take(r->rdma, peer, r->mr[lr], r->rank_of[lr], d, &s)) {
    /* queued as RDMA writes (xfer_rdma.h) */
    atomic_fetch_add_explicit(&r->bytes_out, (s.slot ? DEP_SLAB_CTRL_SLOT : 0) + payload +
                                                 (s.mark || s.credit ? sizeof(uint64_t) : 0),
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
    return true;
  }
  /* The header, then the payload: copied in below XFER_COPY_MAX, else sent
   * from the out block in place, which the rank leaves alone until the
   * destination has it (a block until the call after next: the destination
   * sends this rank the next call's block only once it has all of this
   * one's; a chunk until the destination's credit covers it). */
  struct xfer_batch *b = &batches[peer];
  struct dep_xfer_hdr h = {.magic = DEP_XFER_MAGIC, .src = r->rank_of[lr], .dest = d->dest,
                           .parity = d->parity, .seq = d->seq, .bytes = payload,
                           .kind = d->kind, .row0 = d->row0};
  snprintf(h.job_id, sizeof h.job_id, "%s", r->id);
  if (s.slot != NULL)
    memcpy(h.slot, s.slot, sizeof h.slot);
  if (s.credit != NULL) {
    /* The word as it is now: a credit only grows, and any later one is as true. */
    const uint64_t w = atomic_load_explicit((const _Atomic uint64_t *)s.credit,
                                            memory_order_acquire);
    h.seq = w >> DEP_SLAB_CHAN_SHIFT;
    h.row0 = (uint32_t)(w & ((1u << DEP_SLAB_CHAN_SHIFT) - 1u));
  }
  const bool copy = payload < XFER_COPY_MAX;
  if (!batch_reserve(b, DEP_XFER_HDR_WIRE + (copy ? payload : 0))) {
    snprintf(why, sizeof why, "out of memory for a batch of %llu bytes",
             (unsigned long long)(b->bytes + DEP_XFER_HDR_WIRE + payload));
    goto bad;
  }
  const size_t at = b->bytes;
  const int rc = batch_hdr(b, &h);
  if (rc != 0) {
    snprintf(why, sizeof why, "a frame header that does not encode (%s)", dep_strerror(rc));
    goto bad;
  }
  b->mark[b->n_mark++] = at;
  if (copy && payload > 0)
    batch_copy(b, s.payload, payload);
  else if (!copy)
    batch_ref(b, s.payload, payload, r);
  frames[peer]++;
  atomic_fetch_add_explicit(&r->bytes_out, DEP_XFER_HDR_WIRE + payload, memory_order_relaxed);
  atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
  return true;
bad:
  if (!atomic_exchange(&r->said, true))
    log_warnx("job %s: local rank %u's ring holds %s; the job fails", r->id, lr, why);
  xfer__route_fail(r, DEP_ERR_PROTOCOL);
  return false;
}

/*
 * A proxy thread's place in its round robin over the rings it serves (its
 * own, on its stack): the ring its next sweep visits first, by its route's
 * serial and its local rank, and whether that ring is part-way through its
 * turn (a batch filled during it: it goes on with what is left of its
 * quantum, not a new one).  Rings come in the order of the route list
 * (newest route first, serials falling), then by local rank.
 */
struct px_cursor {
  uint64_t serial;
  uint32_t lr;
  bool resume;
};

/* Whether ring lr of route r comes at or after the cursor in the round. */
static bool at_or_after(const struct xfer_route *r, uint32_t lr, const struct px_cursor *c) {
  return r->serial < c->serial || (r->serial == c->serial && lr >= c->lr);
}

/* What a descriptor costs of its ring's deficit: the bytes it puts on the
 * wire.  One the layout does not allow costs nothing, so that take_desc
 * sees it (and fails the job) at once. */
static uint64_t desc_cost(const struct xfer_route *r, const struct dep_xring_desc *d) {
  return d->bytes > r->lay.xblock_bytes || d->kind == DEP_XRING_CREDIT
             ? 0
             : DEP_XFER_HDR_WIRE + d->bytes;
}

enum px_turn {
  PX_DRAINED,  /* the ring had nothing more (as its head read at the start of the turn) */
  PX_SHORT,    /* its next descriptor costs more than its deficit: it waits for its next turn */
  PX_FULL,     /* a peer's batch filled: the sweep ends */
  PX_FAILED    /* the ring was bad: its job is failed */
};

/*
 * One turn of local rank lr's ring in route r (deficit round robin by
 * bytes): the ring's deficit grows by XFER_QUANTUM unless the turn goes on
 * from the last sweep (fresh false), and descriptors are taken while the
 * next one's cost fits in it.  A ring found empty keeps no deficit: a rank
 * cannot save up turns by pausing.  *taken counts the descriptors taken.
 */
static enum px_turn ring_turn(struct xfer_route *r, uint32_t lr, bool fresh,
                              struct xfer_batch *batches, uint64_t *frames, uint64_t *taken) {
  struct dep_xring *ring = r->ring[lr];
  uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  if (head - tail > DEP_XRING_ENTRIES) {
    if (!atomic_exchange(&r->said, true))
      log_warnx("job %s: local rank %u's ring says %llu descriptors are waiting, more than it "
                "holds; the job fails", r->id, lr, (unsigned long long)(head - tail));
    xfer__route_fail(r, DEP_ERR_PROTOCOL);
    return PX_FAILED;
  }
  if (head - tail > atomic_load_explicit(&r->ring_peak, memory_order_relaxed))
    atomic_store_explicit(&r->ring_peak, (uint32_t)(head - tail), memory_order_relaxed);
  if (tail == head) {
    r->deficit[lr] = 0;
    return PX_DRAINED;
  }
  if (fresh)
    r->deficit[lr] += XFER_QUANTUM;
  while (tail != head) {
    struct dep_xring_desc d = ring->desc[tail % DEP_XRING_ENTRIES];
    const uint64_t cost = desc_cost(r, &d);
    if (cost > r->deficit[lr])
      return PX_SHORT;
    if (!take_desc(r, lr, &d, batches, frames))
      return PX_FAILED;
    r->deficit[lr] -= cost;
    tail++;
    (*taken)++;
    atomic_store_explicit(&ring->tail, tail, memory_order_release);
    if (batches[r->peer_of[d.dest]].bytes >= XFER_BATCH_BYTES)
      return PX_FULL;
  }
  r->deficit[lr] = 0;
  return PX_DRAINED;
}

/*
 * One sweep over the rings thread `self` serves: at most one turn of each
 * (ring_turn), in round-robin order from the cursor, until a peer's batch
 * is full.  The next sweep starts where this one stopped; one that went
 * all the way round starts a ring later than this one did, so that no ring
 * is always last in the batches.  A ring with work waiting thus has its
 * turn in every round, however full the others keep theirs: what goes
 * ahead of it is at most a quantum and one block of each other ring.
 * Returns the descriptors taken; *more says whether a ring was left with
 * work waiting (the thread sweeps again at once).
 */
static uint64_t sweep(uint32_t self, struct px_cursor *cur, struct xfer_batch *batches,
                      uint64_t *frames, bool *more) {
  uint64_t taken = 0;
  bool full = false;
  uint32_t visited = 0;
  struct px_cursor next = {.serial = cur->serial, .lr = cur->lr}; /* a new turn for all */
  *more = false;
  pthread_rwlock_rdlock(&X->lock);
  /* The first pass takes the rings at or after the cursor, the second
   * (after wrapping round) those before it. */
  for (int pass = 0; pass < 2 && !full; pass++) {
    for (struct xfer_route *r = X->routes; r != NULL && !full; r = r->next) {
      for (uint32_t lr = self; lr < r->local_world && !full; lr += X->nthreads) {
        if (at_or_after(r, lr, cur) != (pass == 0) || atomic_load(&r->failed) != 0 ||
            r->ring[lr] == NULL)
          continue;
        const bool fresh = !(cur->resume && r->serial == cur->serial && lr == cur->lr);
        enum px_turn t = ring_turn(r, lr, fresh, batches, frames, &taken);
        /* After a whole round, the next sweep starts at the second ring of this one. */
        if (++visited == 2)
          next = (struct px_cursor){.serial = r->serial, .lr = lr};
        if (t == PX_SHORT)
          *more = true;
        if (t == PX_FULL) {
          /* The ring goes on with what is left of its quantum; with nothing
           * left, the next ring has the next turn. */
          full = *more = true;
          next = r->deficit[lr] > 0
                     ? (struct px_cursor){.serial = r->serial, .lr = lr, .resume = true}
                     : (struct px_cursor){.serial = r->serial, .lr = lr + 1};
        }
      }
    }
  }
  if (visited > 0)
    *cur = next;
  /* The sweep's RDMA writes go before the lock does, so that no route ends
   * with writes of it still waiting in a chain. */
  uint64_t lost = xfer_rdma_flush();
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    if (lost >> k & 1)
      xfer__routes_fail_peer(k, "RDMA writes of its blocks were lost on the way to node");
  pthread_rwlock_unlock(&X->lock);
  return taken;
}

static void *proxy_main(void *arg) {
  uint32_t self = (uint32_t)(uintptr_t)arg;
  char name[16];
  snprintf(name, sizeof name, "deepepd-px%u", self);
  prctl(PR_SET_NAME, name);
  prctl(PR_SET_TIMERSLACK, 1000ul); /* naps of XFER_NAP_NS, not the default 50 us more */
  struct xfer_batch batches[CONFIG_MAX_LIST] = {{0}};
  uint64_t frames[CONFIG_MAX_LIST] = {0};
  struct px_cursor cur = {.serial = UINT64_MAX}; /* the newest route's first ring */
  uint64_t last_work = 0;
  while (!atomic_load(&X->stop)) {
    bool more;
    uint64_t t0 = mono_ns();
    uint64_t taken = sweep(self, &cur, batches, frames, &more);
    for (int k = 0; k < CONFIG_MAX_LIST; k++) {
      if (batches[k].n_seg == 0)
        continue;
      (void)xfer__batch_send(k, &batches[k], frames[k]);
      xfer__batch_reset(&batches[k]);
      frames[k] = 0;
    }
    uint64_t now = mono_ns();
    if (taken > 0 || more) {
      atomic_fetch_add_explicit(&X->busy_ns, now - t0, memory_order_relaxed);
      last_work = now;
      continue;
    }
    uint64_t seen = atomic_load(&X->routes_added);
    pthread_rwlock_rdlock(&X->lock);
    bool none = X->routes == NULL;
    pthread_rwlock_unlock(&X->lock);
    if (none) {
      xfer__routes_wait(seen, now + 100000000ull);
    } else if (now - last_work < XFER_SPIN_NS) {
      sched_yield();
    } else {
      struct timespec ts = {0, XFER_NAP_NS};
      nanosleep(&ts, NULL);
    }
  }
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    xfer__batch_free(&batches[k]);
  xfer_rdma_thread_end();
  return NULL;
}

void xfer_job_stats(const struct job *j, struct dep_msg_job_node *out) {
  if (!X->active)
    return;
  pthread_rwlock_rdlock(&X->lock);
  const struct xfer_route *r = route_of(j);
  if (r != NULL) {
    out->bytes_out = atomic_load(&r->bytes_out);
    out->bytes_in = atomic_load(&r->bytes_in);
    out->frames_out = atomic_load(&r->frames_out);
    out->frames_in = atomic_load(&r->frames_in);
    out->ring_peak = atomic_load(&r->ring_peak);
    out->ring_entries = DEP_XRING_ENTRIES;
  }
  pthread_rwlock_unlock(&X->lock);
}

void xfer_proxy_stats(uint32_t *threads, uint64_t *busy_us) {
  *threads = X->active ? X->started : 0;
  *busy_us = X->active ? atomic_load(&X->busy_ns) / 1000u : 0;
}

/* ---- start and stop ------------------------------------------------------------- */

/* The proxy threads start with the first job that needs them, when the devices are known. */
static int xfer_start_threads(void) {
  X->nthreads = X->cfg->proxy_threads ? X->cfg->proxy_threads
                                    : (devices_count() ? (uint32_t)devices_count() : 1);
  if (X->nthreads > 64)
    X->nthreads = 64;
  for (uint32_t i = 0; i < X->nthreads; i++) {
    int rc = pthread_create(&X->threads[i], NULL, proxy_main, (void *)(uintptr_t)i);
    if (rc != 0) {
      log_errx("cannot start proxy thread %u of %u: %s", i, X->nthreads, strerror(rc));
      X->nthreads = X->started;
      return X->started > 0 ? 0 : -1;
    }
    X->started++;
  }
  log_info("data path between nodes: %u proxy thread(s), %u data connection(s) each way to "
           "each peer", X->nthreads, X->conns);
  return 0;
}

/* The data path's part of PEERS_OK: its proxy threads, each peer's data connections and what
 * went to it as RDMA writes. */
static void xfer_fill_peers(struct dep_msg_peers *m) {
  xfer_proxy_stats(&m->proxy_threads, &m->proxy_busy_us);
  for (uint32_t k = 0; k < m->n_peers; k++) {
    struct dep_msg_peer_info *q = &m->peers[k];
    struct xfer_rdma_stats rs;
    xfer_rdma_peer_stats((int)k, &rs);
    q->rdma_blocks_out = rs.blocks;
    q->rdma_writes_out = rs.writes;
    q->rdma_posts_out = rs.posts;
    q->rdma_bytes_out = rs.bytes;
    struct xfer_peer_stats xs;
    xfer_peer_stats((int)k, &xs);
    q->data_out = xs.conns_out;
    q->data_in = xs.conns_in;
    q->data_bytes_out = xs.bytes_out;
    q->data_bytes_in = xs.bytes_in;
    q->data_frames_out = xs.frames_out;
    q->data_frames_in = xs.frames_in;
  }
}

/* What the peer layer hands the data path (peer.h). */
static const struct peer_data_ops xfer_peer_ops = {
    .up = xfer_peer_up,
    .down = xfer_peer_down,
    .accept = xfer_accept,
    .offer = xfer_on_offer,
    .tick = xfer_tick,
    .fill = xfer_fill_peers,
};

/* The offer table as the RDMA data queue pairs use it (xfer_rdma.h). */
static const struct xfer_rdma_offers xfer_rdma_offer_ops = {
    .peer = xfer_offer_peer,
    .spend = xfer_offer_spend,
    .to_tcp = xfer_on_offer,
};

int xfer_init(const struct config *cfg) {
  /* Registered even on a single node, where each of them finds the data
   * path inactive: a stray DATA_HELLO is refused as any unknown token is. */
  peer_set_data_ops(&xfer_peer_ops);
  if (cfg->n_peers == 0)
    return 0; /* a single node: nothing to move */
  if (sodium_init() < 0) {
    log_errx("libsodium cannot start (sodium_init); the data path between nodes needs it");
    return -1;
  }
  memset(X, 0, sizeof *X);
  pthread_rwlock_init(&X->lock, NULL);
  pthread_mutex_init(&X->routes_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* mono_ns's deadlines */
  pthread_cond_init(&X->routes_cv, &ca);
  pthread_condattr_destroy(&ca);
  X->conns = cfg->connection_pool_size < XFER_CONNS_MAX ? cfg->connection_pool_size
                                                       : XFER_CONNS_MAX;
  X->listen_port = cfg->listen_port;
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    for (int i = 0; i < XFER_CONNS_MAX; i++) {
      X->peers[k].out[i].fd = -1;
      pthread_mutex_init(&X->peers[k].out[i].mu, NULL);
      X->peers[k].in_fds[i] = -1;
    }
  }
  for (int i = 0; i < XFER_OFFERS_MAX; i++)
    X->offers[i].peer = -1;
  const char *drops = getenv(XFER_TEST_DROPS_ENV); /* a test's fault (xfer_internal.h) */
  atomic_store(&X->test_drops, drops != NULL ? atoi(drops) : 0);
  X->cfg = cfg;
  X->active = true;
  xfer_rdma_init(cfg, &xfer_rdma_offer_ops);
  return 0;
}

void xfer_fini(void) {
  if (!X->active)
    return;
  atomic_store(&X->stop, true);
  routes_wake();
  for (uint32_t i = 0; i < X->started; i++)
    pthread_join(X->threads[i], NULL);
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    xfer_peer_down(k);
  /* Connectors and receivers notice X->stop within a second (wait_readable). */
  for (int i = 0; i < 300 && atomic_load(&X->helpers) > 0; i++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  xfer_rdma_fini();
  pthread_rwlock_wrlock(&X->lock);
  while (X->routes != NULL) {
    struct xfer_route *r = X->routes;
    X->routes = r->next;
    xfer_rdma_route_free(r->rdma);
    free(r);
  }
  xfer__unexpect(NULL); /* the jobs still here end after this, unseen by xfer_job_end */
  pthread_rwlock_unlock(&X->lock);
  X->active = false;
}

