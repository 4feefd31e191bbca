/*
 * xfer.c — the data path between nodes (xfer.h, DESIGN §7): the routes of
 * the jobs that span nodes and the rings lent to their ranks, which the
 * proxy threads of xfer_proxy.c drain (RDMA writes through xfer_rdma.c,
 * else frames over the TCP data connections of xfer_conn.c).  Every byte moves
 * between exchange regions (proto/slab.h), host memory the daemon maps:
 * plain loads and stores, no call into the backend, on cuda as on host.
 */
#include "xfer.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
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
#include "job.h"
#include "kabi.h"
#include "lend.h"
#include "log.h"
#include "pages.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "shape.h"
#include "slab.h"
#include "testhooks.h"
#include "xfer_internal.h"
#include "xfer_rdma.h"
#include "xring.h"

/* How long an ended job's route waits for a receive into its regions
 * before it cuts the connections it is read from (xfer_job_end). */
#define XFER_END_CUT_MS 2000

/* The thread that maps a new route's regions into the daemon (fill_main; top -H), and the
 * pieces it maps them in, looking between them whether the job has ended. */
#define XFER_FILL_THREAD_NAME "deepepd-fill"
#define XFER_FILL_PIECE (1ull << 20)

struct xfer_state xfer__state;

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

/*
 * The fan table of route r's rings (xring.h): each node with more than one
 * rank of the job takes a dispatch's rows as one node channel, led by its
 * first rank, and its daemon fans them out, whether they come over TCP or
 * into its staging by RDMA writes (xfer_rdma.h); a node of one rank keeps
 * its channel (its node channel would be its own).  Written before the
 * rings are lent: the ranks read it once, at attach.
 */
static void route_fan(struct xfer_route *r) {
  uint32_t ranks[CONFIG_MAX_LIST] = {0}, lead[CONFIG_MAX_LIST];
  for (uint32_t g = r->world; g-- > 0;) {
    const int k = r->peer_of[g];
    if (k < 0 || k >= CONFIG_MAX_LIST)
      continue;
    ranks[k]++;
    lead[k] = g; /* the lowest, walking down */
  }
  for (uint32_t g = 0; g < r->world; g++) {
    const int k = r->peer_of[g];
    const bool fan = k >= 0 && k < CONFIG_MAX_LIST && ranks[k] > 1;
    for (uint32_t i = 0; i < r->local_world && k >= 0; i++)
      r->ring[i]->fan[r->remote_of[g]] = fan ? (uint16_t)(r->remote_of[lead[k]] + 1) : 0;
  }
}

/* ---- the populate of a new route's regions ---------------------------------------- */

/*
 * Every page of a rank's ring and exchange region is mapped into the daemon's
 * own page tables once its route is made: the rank's warm-up maps them into
 * its own mapping (warm.c), not this one, and the receivers writing the first
 * call's rows (and the proxy reading them) took a fault a page on the first
 * call of each parity.  A region an earlier job left cached (warm) is mapped
 * in already: the daemon keeps its mapping.  The mapping is a thread's, not
 * the loop's: for a large region it takes as long as touching every page,
 * and every other client's request would wait behind it.  The job's ranks
 * are answered once it is done (xfer_job_filled): a page not mapped yet
 * would be faulted in by the receiver's first write, in the job's first
 * calls.  It holds one of the route's users, so that the regions go back to
 * the pool only after it stops, which it does between pieces once the job
 * has ended.
 */
struct xfer_fill {
  struct xfer_route *r;
  uint32_t n;
  struct xfer_fill_part {
    uint8_t *p;
    uint64_t len;
  } part[DEP_MAX_LOCAL_RANKS];
};

static bool fill_stopped(const struct xfer_route *r) {
  return atomic_load_explicit(&r->ending, memory_order_relaxed) || atomic_load(&X->stop);
}

/* A test's hold ($DEEPEPD_TEST_XCHG_FILL_HOLD_FD): true once the descriptor is readable or
 * closed, false if the job ends (or the threads stop) first.  It looks every 10 ms. */
static bool fill_held(const struct xfer_route *r, int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  while (!fill_stopped(r)) {
    p.revents = 0;
    const int n = poll(&p, 1, 10);
    if (n > 0 || (n < 0 && errno != EINTR))
      return true;
  }
  return false;
}

static void fill_run(struct xfer_fill *f) {
  for (uint32_t i = 0; i < f->n; i++)
    for (uint64_t off = 0; off < f->part[i].len; off += XFER_FILL_PIECE) {
      if (fill_stopped(f->r))
        goto out;
      const uint64_t left = f->part[i].len - off;
      dep__pages_populate(f->part[i].p + off, left < XFER_FILL_PIECE ? left : XFER_FILL_PIECE);
    }
out:
  atomic_store_explicit(&f->r->filling, false, memory_order_release);
}

static void *fill_main(void *arg) {
  struct xfer_fill *f = arg;
  prctl(PR_SET_NAME, XFER_FILL_THREAD_NAME);
  const int hold = X->test_fill_hold;
  if (hold <= 0 || fill_held(f->r, hold))
    fill_run(f);
  struct xfer_route *r = f->r;
  free(f);
  xfer__route_put(r); /* its last touch of the route: xfer_job_end may free it now */
  atomic_fetch_sub(&X->helpers, 1);
  return NULL;
}

/* Map f's regions in on a thread of their own (f is its), r holding a user for it since
 * before it was listed; where no thread can be had, here, as before there was one. */
static void fill_start(struct xfer_fill *f) {
  if (xfer__spawn_helper(fill_main, f))
    return;
  fill_run(f);
  xfer__route_put(f->r);
  free(f);
}

void xfer_job_start(const struct job *j, const int16_t *who, xfer_membership_fn *membership) {
  if (!X->active || j->xchg == NULL)
    return;
  if (X->started == 0 && xfer__start_threads() != 0) {
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
  r->hidden = j->shape.hidden;
  r->topk = j->shape.topk;
  r->experts = j->shape.num_experts;
  char why[256];
  if (dep__slab_layout_nodes(&j->shape, j->world_size, j->local_world_size, j->chunk_rows,
                             &r->lay, why, sizeof why) != 0) {
    log_warnx("job %s: %s", j->id, why);
    free(r);
    return;
  }
  struct xfer_fill *fill = calloc(1, sizeof *fill); /* NULL: mapped here, as before */
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
    /* Its pages mapped into the daemon's page tables (struct xfer_fill). */
    const struct pool_region *g = j->xchg[i].region;
    if (!g->warm && fill != NULL)
      fill->part[fill->n++] = (struct xfer_fill_part){g->map, g->bytes};
    else if (!g->warm)
      dep__pages_populate(g->map, g->bytes);
  }
  r->rdma = xfer_rdma_route_new(j, who, membership);
  route_fan(r);
  r->serial = ++X->serials;
  if (fill != NULL && fill->n > 0) {
    fill->r = r;
    atomic_store(&r->users, 1); /* the populate's, before any thread sees the route */
    atomic_store(&r->filling, true);
  }
  pthread_rwlock_wrlock(&X->lock);
  r->next = X->routes;
  X->routes = r;
  pthread_rwlock_unlock(&X->lock);
  routes_wake();
  if (fill != NULL && fill->n > 0)
    fill_start(fill);
  else
    free(fill);
}

bool xfer_job_filled(const struct job *j) {
  if (!X->active)
    return true;
  pthread_rwlock_rdlock(&X->lock);
  const struct xfer_route *r = route_of(j);
  const bool filling = r != NULL && atomic_load_explicit(&r->filling, memory_order_acquire);
  pthread_rwlock_unlock(&X->lock);
  return !filling;
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
  atomic_store(&r->ending, true); /* a populate still mapping its regions stops */
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

const char *xfer__chunk_wrong(const struct dep_slab_layout *l, uint32_t kind, uint32_t row0,
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

bool xfer__kind_known(uint32_t kind) {
  return kind == DEP_XRING_BLOCK || kind == DEP_XRING_CHUNK || kind == DEP_XRING_SLOT ||
         kind == (DEP_XRING_CHUNK | DEP_XRING_SLOT) || kind == DEP_XRING_CREDIT ||
         kind == DEP_XRING_NODE || kind == DEP_XRING_TAKEN;
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
      r->local_of[h->dest] < 0 || h->parity > 1 || !xfer__kind_known(h->kind))
    wrong = "the job's membership does not allow";
  else if (h->kind == DEP_XRING_BLOCK && h->bytes > l->xblock_bytes)
    wrong = "more bytes than a block holds";
  else if (h->kind == DEP_XRING_CREDIT && (h->bytes != 0 || h->row0 > l->max_tokens))
    wrong = "a credit past the rows a call holds";
  else if (h->kind == DEP_XRING_TAKEN && (h->bytes != 0 || h->row0 != 0))
    wrong = "a taken word with bytes";
  else if (h->kind == DEP_XRING_NODE &&
           (h->bytes < DEP_XFER_NODE_BYTES(0) ||
            h->bytes > DEP_XFER_NODE_BYTES(r->local_world) + (uint64_t)l->chunk_rows * l->row_bytes ||
            l->chunk_rows == 0 || h->row0 >= l->max_tokens))
    wrong = "a node channel's chunk larger than its table and rows, or past a call's rows";
  else if (h->kind != DEP_XRING_BLOCK && h->kind != DEP_XRING_CREDIT &&
           h->kind != DEP_XRING_NODE && h->kind != DEP_XRING_TAKEN)
    wrong = xfer__chunk_wrong(l, h->kind, h->row0, h->bytes);
  if (wrong != NULL) {
    snprintf(why, whylen, "a frame of job %s from rank %u to rank %u (kind %u, parity %u, row "
             "%u, %llu bytes): %s", r->id, h->src, h->dest, h->kind, h->parity, h->row0,
             (unsigned long long)h->bytes, wrong);
    return DEP_ERR_PROTOCOL;
  }
  if (atomic_load(&r->failed) != 0)
    return DEP_ERR_NOT_FOUND; /* the job cannot go on here; its bytes have no reader */
  if (h->kind == DEP_XRING_NODE) {
    t->node = true; /* its table says where its rows go: xfer__node_fanout */
    return 0;
  }
  uint8_t *x = r->xchg[r->local_of[h->dest]];
  const uint32_t ri = r->remote_of[h->src];
  if (h->kind == DEP_XRING_CREDIT) {
    /* The destination's channel to the source: the credit word of its out slot. */
    t->credit = (_Atomic uint64_t *)(x + dep_slab_out_slot(l, h->parity, ri) +
                                     offsetof(struct ops_slot, credit));
    t->value = DEP_SLAB_CHAN_AT(h->seq, h->row0);
    return 0;
  }
  if (h->kind == DEP_XRING_TAKEN) {
    /* The destination's post of call seq to the source is read (host_ops.h "Split calls"):
     * the taken word of its out slot, which its next call of that parity waits for. */
    t->credit = (_Atomic uint64_t *)(x + dep_slab_out_slot(l, h->parity, ri) +
                                     offsetof(struct ops_slot, taken));
    t->value = h->seq;
    return 0;
  }
  t->payload = x + dep_slab_in_block(l, h->parity, ri);
  if (h->kind & DEP_XRING_CHUNK) {
    const uint32_t n = (uint32_t)(h->bytes / l->row_bytes);
    t->payload += (uint64_t)(h->row0 % l->chan_rows) * l->row_bytes;
    t->mark = (_Atomic uint64_t *)(x + dep_slab_in_mark(l, h->parity, ri,
                                                         h->row0 / l->chunk_rows));
    t->value = DEP_SLAB_CHAN_AT(h->seq, n);
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

/*
 * Add DEP_SLAB_CHAN_AT(seq, n)'s n rows to a chunk's count (slab.h), with
 * release ordering after the rows: from 0 when the word names another
 * call (one whose chunk its reader never took, a call that failed), so
 * that no count of an earlier call passes for this one's.  A chunk's
 * rows may come in several frames at once (a node channel's fan-out, on
 * several data connections): the count is the sum.
 */
static void count_add(_Atomic uint64_t *w, uint64_t value) {
  uint64_t was = atomic_load_explicit(w, memory_order_relaxed), now;
  do {
    const bool same = was >> DEP_SLAB_CHAN_SHIFT == value >> DEP_SLAB_CHAN_SHIFT;
    now = same ? was + (value & ((1u << DEP_SLAB_CHAN_SHIFT) - 1u)) : value;
  } while (!atomic_compare_exchange_weak_explicit(w, &was, now, memory_order_release,
                                                  memory_order_relaxed));
}

/* Where row j of the call's stream from remote source number ri lands in
 * the in channel of exchange region x. */
static uint8_t *in_row_at(const struct dep_slab_layout *l, uint8_t *x, unsigned parity,
                          uint32_t ri, uint32_t j) {
  return x + dep_slab_in_block(l, parity, ri) + (uint64_t)(j % l->chan_rows) * l->row_bytes;
}

/* A node channel row's destinations held here, each once, in the order
 * its ids name them: their table entries (ent_of, by local rank) into e;
 * how many, or -1 when an id is no expert of the job.  A rank the ids
 * name but the table leaves out takes none of this source's rows (it made
 * another op: host_ops_stream.c), and is skipped. */
static int row_dests(const struct xfer_route *r, const uint8_t *row, const int16_t *ent_of,
                     uint32_t *e) {
  const uint32_t le = r->experts / r->world;
  int n = 0;
  for (uint32_t i = 0; i < r->topk; i++) {
    int32_t id;
    memcpy(&id, row + DEP_SLAB_IDS_OFF(r->hidden) + 4u * i, sizeof id);
    if (id < 0)
      continue;
    if ((uint32_t)id >= r->experts)
      return -1;
    const int16_t lr = r->local_of[(uint32_t)id / le];
    if (lr < 0 || ent_of[lr] < 0)
      continue;
    bool again = false;
    for (int j = 0; j < n && !again; j++)
      again = e[j] == (uint32_t)ent_of[lr];
    if (!again)
      e[n++] = (uint32_t)ent_of[lr];
  }
  return n;
}

/* Row `row` for destination d (global), written at `to` with its ids and
 * weights remapped as the source rank would have written them on a
 * channel of d's own (host_ops_tp.c disp_fill): d's experts as local ids,
 * -1 and 0 elsewhere. */
static void row_put(const struct xfer_route *r, const uint8_t *row, uint32_t d, uint8_t *to) {
  const uint32_t le = r->experts / r->world;
  const uint64_t ids = DEP_SLAB_IDS_OFF(r->hidden), w = DEP_SLAB_WEIGHTS_OFF(r->hidden, r->topk);
  memcpy(to, row, r->lay.row_bytes);
  for (uint32_t i = 0; i < r->topk; i++) {
    int32_t id;
    float wt;
    memcpy(&id, row + ids + 4u * i, sizeof id);
    memcpy(&wt, row + w + 4u * i, sizeof wt);
    const bool mine = id >= 0 && (uint32_t)id / le == d;
    const int32_t local = mine ? (int32_t)((uint32_t)id % le) : -1;
    const float weight = mine ? wt : 0.0f;
    memcpy(to + ids + 4u * i, &local, sizeof local);
    memcpy(to + w + 4u * i, &weight, sizeof weight);
  }
}

int xfer__node_fanout(struct xfer_route *r, const struct dep_xfer_hdr *h, const uint8_t *buf,
                      char *why, size_t whylen) {
  const struct dep_slab_layout *l = &r->lay;
  struct dep_xfer_node nh;
  memcpy(&nh, buf, sizeof nh);
  const char *wrong = NULL;
  /* Its rows lie in one chunk of the node channel: the whole chunk, or a
   * piece of it (one staging chunk's worth over RDMA, xfer_proxy.c). */
  if (nh.n_dest > r->local_world || nh.rows == 0 ||
      h->row0 % l->chunk_rows + nh.rows > l->chunk_rows || h->row0 + nh.rows > l->max_tokens ||
      DEP_XFER_NODE_BYTES(nh.n_dest) + (uint64_t)nh.rows * l->row_bytes != h->bytes)
    wrong = "a table that does not fit its frame or a chunk";
  struct dep_xfer_node_dest ent[DEP_MAX_LOCAL_RANKS];
  uint32_t seen[DEP_MAX_LOCAL_RANKS] = {0}, next[DEP_MAX_LOCAL_RANKS];
  int16_t ent_of[DEP_MAX_LOCAL_RANKS];
  for (uint32_t i = 0; i < DEP_MAX_LOCAL_RANKS; i++)
    ent_of[i] = -1;
  for (uint32_t i = 0; wrong == NULL && i < nh.n_dest; i++) {
    memcpy(&ent[i], buf + DEP_XFER_NODE_BYTES(i), sizeof ent[i]);
    const struct dep_xfer_node_dest *e = &ent[i];
    if (e->dest >= r->world || r->local_of[e->dest] < 0 || ent_of[r->local_of[e->dest]] >= 0 ||
        e->count == 0 || e->count > nh.rows || e->start + e->count > l->max_tokens)
      wrong = "a destination not held here, twice, or rows out of its stream";
    else
      ent_of[r->local_of[e->dest]] = (int16_t)i;
    next[i] = e->start;
  }
  /* Every row's destinations against the table before a byte is written. */
  const uint8_t *rows = buf + DEP_XFER_NODE_BYTES(nh.n_dest);
  uint32_t e[DEP_SHAPE_MAX_TOPK];
  for (uint32_t k = 0; wrong == NULL && k < nh.rows; k++) {
    const int n = row_dests(r, rows + (uint64_t)k * l->row_bytes, ent_of, e);
    if (n < 0)
      wrong = "a row whose ids are no experts of the job";
    for (int j = 0; j < n; j++)
      seen[e[j]]++;
  }
  for (uint32_t i = 0; wrong == NULL && i < nh.n_dest; i++)
    if (seen[i] != ent[i].count)
      wrong = "a destination's count that its rows' ids do not give";
  if (wrong != NULL) {
    snprintf(why, whylen, "a node channel's chunk of job %s from rank %u (row %u, %llu bytes): %s",
             r->id, h->src, h->row0, (unsigned long long)h->bytes, wrong);
    return DEP_ERR_PROTOCOL;
  }
  const unsigned parity = h->parity;
  const uint32_t ri = r->remote_of[h->src];
  xfer__payload_begin();
  for (uint32_t k = 0; k < nh.rows; k++) {
    const uint8_t *row = rows + (uint64_t)k * l->row_bytes;
    const int n = row_dests(r, row, ent_of, e);
    for (int j = 0; j < n; j++) {
      const uint32_t d = ent[e[j]].dest;
      row_put(r, row, d, in_row_at(l, r->xchg[r->local_of[d]], parity, ri, next[e[j]]++));
    }
  }
  xfer__payload_end();
  /* Then each destination's counts, chunk by chunk of its own stream. */
  for (uint32_t i = 0; i < nh.n_dest; i++) {
    uint8_t *x = r->xchg[r->local_of[ent[i].dest]];
    for (uint32_t j = ent[i].start, end = ent[i].start + ent[i].count; j < end;) {
      const uint32_t n = j / l->chunk_rows, stop = (n + 1) * l->chunk_rows;
      const uint32_t to = stop < end ? stop : end;
      count_add((_Atomic uint64_t *)(x + dep_slab_in_mark(l, parity, ri, n)),
                DEP_SLAB_CHAN_AT(h->seq, to - j));
      j = to;
    }
  }
  return 0;
}

void xfer__frame_publish(const struct xfer_target *t, const struct dep_xfer_hdr *h) {
  if (t->mark != NULL)
    count_add(t->mark, t->value);
  if (t->slot != NULL) {
    /* The fields the sender writes; the tail and credit words are not a
     * remote slot's (slab.h), and credit is its reader's own. */
    memcpy(t->slot + 8, h->slot + 8, offsetof(struct ops_slot, tail) - 8);
    uint64_t flag;
    memcpy(&flag, h->slot, sizeof flag);
    atomic_store_explicit((_Atomic uint64_t *)t->slot, flag, memory_order_release);
  }
  if (t->credit != NULL) {
    /* Credits (and taken words) may cross on the peer's connections: the largest stands. */
    uint64_t was = atomic_load_explicit(t->credit, memory_order_relaxed);
    while (was < t->value && !atomic_compare_exchange_weak_explicit(
                                 t->credit, &was, t->value, memory_order_release,
                                 memory_order_relaxed)) {
    }
  }
}


/* ---- counters ---------------------------------------------------------------- */

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
    out->payload_out = atomic_load(&r->payload_out);
  }
  pthread_rwlock_unlock(&X->lock);
}

/* ---- start and stop ------------------------------------------------------------- */

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
  X->data_conns = cfg->connection_pool_size < XFER_DATA_CONNS_MAX ? cfg->connection_pool_size
                                                                 : XFER_DATA_CONNS_MAX;
  X->conns = X->data_conns + 1; /* and the control lane, out[data_conns] */
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
  atomic_store(&X->test_drops, testhook_value(TESTHOOK_DATA_DROPS));
  X->test_fill_hold = testhook_value(TESTHOOK_XCHG_FILL_HOLD_FD);
  X->test_cpus = (uint32_t)testhook_value(TESTHOOK_CPUS);
  X->test_awake_ns = (uint64_t)testhook_value(TESTHOOK_AWAKE_US) * 1000u;
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

