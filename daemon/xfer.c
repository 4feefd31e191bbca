/*
 * xfer.c — the data path between nodes: rings, proxy threads, data
 * connections and their receivers (xfer.h, DESIGN §7).
 */
#include "xfer.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conn.h"
#include "devices.h"
#include "job.h"
#include "log.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "slab.h"
#include "xfer_rdma.h"
#include "xring.h"

/* A DATA_OFFER's token is good for this long. */
#define XFER_OFFER_MS 10000
#define XFER_OFFERS_MAX (CONFIG_MAX_LIST * XFER_CONNS_MAX * 2)
/* A connect, or a send or receive that makes no progress, gives up after this. */
#define XFER_CONNECT_MS 3000
#define XFER_IO_MS 10000
/* A sweep's frames for one peer go out in one send, up to this many bytes. */
#define XFER_BATCH_BYTES (4u << 20)
/* A proxy thread with nothing to do spins this long (yielding) before it
 * sleeps in steps of XFER_NAP_NS: a call's next descriptor usually comes
 * within microseconds of the last. */
#define XFER_SPIN_NS 200000ull
#define XFER_NAP_NS 20000l
/* A frame for a job this node does not run yet waits this long for it: the
 * nodes of a job learn that it is complete one after another, and the
 * first one's ranks may send before the last one has its route. */
#define XFER_ROUTE_WAIT_MS 5000
/* Jobs that ended here, remembered so that their late frames are dropped at once. */
#define XFER_ENDED_MAX 64
/* The largest payload a frame may carry (a block of the largest shape fits). */
#define XFER_MAX_PAYLOAD (1ull << 32)

/* One job that spans nodes, as the threads see it. */
struct xfer_route {
  char id[DEP_JOB_ID_MAX];
  const struct job *job;         /* the loop's handle; never dereferenced by threads */
  uint32_t world, local_world;
  struct dep_slab_layout lay;
  int16_t peer_of[DEP_MAX_LOCAL_RANKS];  /* global rank -> peer holding it; -1: held here */
  int16_t local_of[DEP_MAX_LOCAL_RANKS]; /* global rank -> local rank here; -1: remote */
  uint32_t rank_of[DEP_MAX_LOCAL_RANKS];  /* local rank -> global rank */
  uint32_t remote_of[DEP_MAX_LOCAL_RANKS]; /* global rank -> its number among remote ranks */
  struct pool_block *arena[DEP_MAX_LOCAL_RANKS]; /* by local rank */
  uint64_t offset[DEP_MAX_LOCAL_RANKS];
  struct dep_xring *ring[DEP_MAX_LOCAL_RANKS];   /* by local rank; NULL until lent */
  _Atomic int failed;            /* 0, or the code it stopped with */
  _Atomic bool said;             /* a failure of its frames was logged */
  _Atomic uint64_t bytes_out, bytes_in, frames_out, frames_in; /* deepepctl status */
  _Atomic uint32_t ring_peak;    /* most descriptors a sweep found waiting in one ring */
  struct xfer_rdma_route *rdma;  /* where its blocks may go by RDMA writes (NULL: TCP only) */
  struct xfer_route *next;
};

/* One outbound data connection (we send on it). */
struct xfer_out {
  int fd;                        /* -1: none */
  pthread_mutex_t mu;            /* one sender at a time */
};

struct xfer_offer {
  int peer;                      /* -1: free */
  int spent_by;                  /* the peer it was made to, once spent */
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint64_t expires_ms;
};

struct xfer_peer {
  struct xfer_out out[XFER_CONNS_MAX];
  _Atomic uint32_t next;         /* round robin over out[] */
  _Atomic uint32_t conns_in;
  _Atomic uint64_t bytes_out, bytes_in, frames_out, frames_in;
  _Atomic uint64_t gen;          /* bumped when the peer goes down: connectors of an older one quit */
  int in_fds[XFER_CONNS_MAX];    /* inbound connections' fds, for shutdown (under X.lock) */
};

/* A proxy thread's batch for one peer. */
struct xfer_batch {
  uint8_t *buf;
  size_t len, cap;
};

static struct {
  bool active;
  const struct config *cfg;
  uint32_t nthreads, conns;
  uint16_t listen_port;
  pthread_rwlock_t lock;         /* routes, in_fds */
  pthread_mutex_t idle_mu;
  pthread_cond_t idle_cv;        /* a route was added, or stop */
  struct xfer_route *routes;
  _Atomic bool stop;
  pthread_t threads[64];
  uint32_t started;
  struct xfer_peer peers[CONFIG_MAX_LIST];
  struct xfer_offer offers[XFER_OFFERS_MAX]; /* the loop's */
  char ended[XFER_ENDED_MAX][DEP_JOB_ID_MAX];  /* under lock: the last jobs whose route went */
  uint32_t n_ended;
  _Atomic uint32_t helpers;      /* connector and receiver threads running */
  _Atomic uint64_t busy_ns;      /* proxy threads' time moving blocks, summed */
} X;

static int xfer_start_threads(void);

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- socket helpers (threads) ------------------------------------------------ */

/* Send or receive all len bytes, waiting at most XFER_IO_MS for any progress. */
static int io_all(int fd, void *buf, size_t len, bool send_it) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = send_it ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n == 0 && !send_it) {
      errno = 0; /* the far end closed */
      return -1;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return -1;
    struct pollfd pf = {.fd = fd, .events = send_it ? POLLOUT : POLLIN};
    int r = poll(&pf, 1, XFER_IO_MS);
    if (r == 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    if (r < 0 && errno != EINTR)
      return -1;
  }
  return 0;
}

/* Wait until fd is readable, checking for stop each second: 1 readable, 0 stopping, -1 error. */
static int wait_readable(int fd) {
  for (;;) {
    if (atomic_load(&X.stop))
      return 0;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    int r = poll(&pf, 1, 1000);
    if (r > 0)
      return 1;
    if (r < 0 && errno != EINTR)
      return -1;
  }
}

static void tune_socket(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int buf = 4 << 20;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

/* ---- routes ------------------------------------------------------------------ */

static struct xfer_route *route_find(const char *id) {
  for (struct xfer_route *r = X.routes; r != NULL; r = r->next)
    if (strcmp(r->id, id) == 0)
      return r;
  return NULL;
}

static struct xfer_route *route_of(const struct job *j) {
  for (struct xfer_route *r = X.routes; r != NULL; r = r->next)
    if (r->job == j)
      return r;
  return NULL;
}

/* Stop a route (any thread, lock held for reading at least): its rings say code. */
static void route_fail(struct xfer_route *r, int code) {
  int zero = 0;
  if (!atomic_compare_exchange_strong(&r->failed, &zero, code))
    return;
  for (uint32_t i = 0; i < r->local_world; i++)
    if (r->ring[i] != NULL)
      atomic_store_explicit(&r->ring[i]->failed, code, memory_order_release);
}

void xfer_job_start(const struct job *j, const int16_t *who) {
  if (!X.active || j->world_size > DEP_MAX_LOCAL_RANKS)
    return; /* operations refuse such a world (host_ops.h); the job has memory only */
  if (X.started == 0 && xfer_start_threads() != 0) {
    log_warnx("job %s: no proxy thread runs; its operations between nodes will fail", j->id);
    return;
  }
  struct xfer_route *r = calloc(1, sizeof *r);
  if (r == NULL) {
    log_warnx("job %s: out of memory for its route between nodes; its operations will time out",
              j->id);
    return;
  }
  snprintf(r->id, sizeof r->id, "%s", j->id);
  r->job = j;
  r->world = j->world_size;
  r->local_world = j->local_world_size;
  char why[256];
  if (dep_slab_layout_nodes(&j->shape, j->world_size, j->local_world_size, &r->lay, why,
                            sizeof why) != 0) {
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
    r->arena[i] = q->arena;
    r->offset[i] = q->offset;
  }
  r->rdma = xfer_rdma_route_new(j, who, &r->lay);
  pthread_rwlock_wrlock(&X.lock);
  r->next = X.routes;
  X.routes = r;
  pthread_rwlock_unlock(&X.lock);
  pthread_mutex_lock(&X.idle_mu);
  pthread_cond_broadcast(&X.idle_cv);
  pthread_mutex_unlock(&X.idle_mu);
}

void xfer_job_fail(const struct job *j, int code) {
  if (!X.active)
    return;
  pthread_rwlock_rdlock(&X.lock);
  struct xfer_route *r = route_of(j);
  if (r != NULL)
    route_fail(r, code);
  pthread_rwlock_unlock(&X.lock);
}

void xfer_job_end(const struct job *j) {
  if (!X.active)
    return;
  pthread_rwlock_wrlock(&X.lock);
  struct xfer_route *r = NULL;
  for (struct xfer_route **pp = &X.routes; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->job == j) {
      r = *pp;
      *pp = r->next;
      break;
    }
  }
  if (r != NULL)
    snprintf(X.ended[X.n_ended++ % XFER_ENDED_MAX], DEP_JOB_ID_MAX, "%s", r->id);
  pthread_rwlock_unlock(&X.lock);
  if (r == NULL)
    return;
  xfer_rdma_route_free(r->rdma); /* its writes in flight land first */
  for (uint32_t i = 0; i < r->local_world; i++)
    if (r->ring[i] != NULL)
      munmap(r->ring[i], DEP_XRING_BYTES);
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
  pthread_rwlock_wrlock(&X.lock);
  struct xfer_route *r = X.active ? route_of(j) : NULL;
  uint32_t lr = c->job_local_rank;
  int code = 0;
  const char *what = NULL;
  if (r == NULL) {
    code = DEP_ERR_UNSUPPORTED;
    what = j->world_size > DEP_MAX_LOCAL_RANKS
               ? "its world is larger than the operations serve"
               : "this daemon moves no data between nodes (no peers, or the proxy did not start)";
  } else if (lr >= r->local_world || r->ring[lr] != NULL) {
    code = DEP_ERR_STATE;
    what = "this rank has its ring already";
  }
  int fd = -1;
  struct dep_xring *ring = MAP_FAILED;
  if (code == 0) {
    fd = memfd_create("deepepd-xring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)DEP_XRING_BYTES) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
        (ring = mmap(NULL, DEP_XRING_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
            MAP_FAILED) {
      code = DEP_ERR_NO_MEMORY;
      what = strerror(errno);
    }
  }
  if (code == 0) {
    ring->magic = DEP_XRING_MAGIC;
    ring->version = DEP_XRING_VERSION;
    ring->entries = DEP_XRING_ENTRIES;
    ring->rank = j->ranks[lr].rank;
    atomic_store(&ring->failed, atomic_load(&r->failed));
    r->ring[lr] = ring;
  }
  pthread_rwlock_unlock(&X.lock);
  if (code != 0) {
    if (fd >= 0)
      close(fd);
    conn_send_error(c, request_id, code, "XRING_LEND: job %s: %s", j->id, what);
    return;
  }
  struct dep_msg_lend_ok ok = {.version = DEP_XRING_VERSION,
                                     .bytes = (uint32_t)DEP_XRING_BYTES};
  conn_send(c, DEP_MSG_XRING_LEND_OK, request_id, &ok, &fd, 1);
  close(fd); /* conn_send sends its own duplicate */
}

/* ---- the proxy threads -------------------------------------------------------- */

/* Grow b to hold n more bytes; false when out of memory. */
static bool batch_room(struct xfer_batch *b, size_t n) {
  if (b->len + n <= b->cap)
    return true;
  size_t cap = b->cap ? b->cap : 1u << 16;
  while (cap < b->len + n)
    cap *= 2;
  uint8_t *p = realloc(b->buf, cap);
  if (p == NULL)
    return false;
  b->buf = p;
  b->cap = cap;
  return true;
}

/* Close peer k's outbound connection i (its mutex held). */
static void out_close(struct xfer_peer *xp, uint32_t i) {
  if (xp->out[i].fd >= 0) {
    shutdown(xp->out[i].fd, SHUT_RDWR);
    close(xp->out[i].fd);
    xp->out[i].fd = -1;
  }
}

/*
 * Send batch b to peer k on one of its data connections (round robin).  A
 * peer with none waits for one up to XFER_CONNECT_MS (it is being opened).
 * 0, or -1 with every route that sends to k failed.
 */
static int batch_send(int k, struct xfer_batch *b, uint64_t frames) {
  struct xfer_peer *xp = &X.peers[k];
  uint64_t deadline = mono_ns() + (uint64_t)XFER_CONNECT_MS * 1000000ull;
  for (;;) {
    uint32_t start = atomic_fetch_add(&xp->next, 1);
    for (uint32_t t = 0; t < X.conns; t++) {
      uint32_t i = (start + t) % X.conns;
      pthread_mutex_lock(&xp->out[i].mu);
      if (xp->out[i].fd < 0) {
        pthread_mutex_unlock(&xp->out[i].mu);
        continue;
      }
      int rc = io_all(xp->out[i].fd, b->buf, b->len, true);
      if (rc != 0) {
        log_warnx("peer %s: data connection %u dropped while sending (%s)", peer_name(k), i,
                  strerror(errno));
        out_close(xp, i);
      }
      pthread_mutex_unlock(&xp->out[i].mu);
      if (rc == 0) {
        atomic_fetch_add(&xp->bytes_out, b->len);
        atomic_fetch_add(&xp->frames_out, frames);
        return 0;
      }
    }
    if (atomic_load(&X.stop) || mono_ns() > deadline)
      break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  pthread_rwlock_rdlock(&X.lock);
  for (struct xfer_route *r = X.routes; r != NULL; r = r->next) {
    for (uint32_t g = 0; g < r->world; g++) {
      if (r->peer_of[g] == k) {
        if (!atomic_exchange(&r->said, true))
          log_warnx("job %s: no data connection to node %s takes its blocks; the job fails",
                    r->id, peer_name(k));
        route_fail(r, DEP_ERR_PEER);
        break;
      }
    }
  }
  pthread_rwlock_unlock(&X.lock);
  return -1;
}

/*
 * Take one descriptor of local rank lr's ring in route r into the batch of
 * the peer holding its destination.  false: the descriptor was bad, or the
 * slab could not be read (the route is failed, and said why).
 */
static bool take_desc(struct xfer_route *r, uint32_t lr, const struct dep_xring_desc *d,
                      struct xfer_batch *batches, uint64_t *frames) {
  char why[256] = "";
  int peer = d->dest < r->world ? r->peer_of[d->dest] : -1;
  if (peer < 0 || d->parity > 1 || d->bytes > r->lay.block_bytes) {
    snprintf(why, sizeof why, "a descriptor for rank %u, parity %u, %llu bytes, which the job's "
             "layout does not allow (a remote rank, parity 0 or 1, up to %llu bytes)", d->dest,
             d->parity, (unsigned long long)d->bytes, (unsigned long long)r->lay.block_bytes);
    goto bad;
  }
  uint32_t ri = r->remote_of[d->dest];
  uint64_t base = r->offset[lr];
  int via = xfer_rdma_take(r->rdma, peer, r->arena[lr], base, r->rank_of[lr], ri, d, why,
                           sizeof why);
  if (via < 0)
    goto bad;
  if (via > 0) { /* queued as RDMA writes (xfer_rdma.h) */
    atomic_fetch_add_explicit(&r->bytes_out, DEP_SLAB_CTRL_SLOT + d->bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
    return true;
  }
  struct xfer_batch *b = &batches[peer];
  if (!batch_room(b, sizeof(struct dep_xfer_hdr) + d->bytes)) {
    snprintf(why, sizeof why, "out of memory for a batch of %llu bytes",
             (unsigned long long)(b->len + d->bytes));
    goto bad;
  }
  struct dep_xfer_hdr *h = (struct dep_xfer_hdr *)(b->buf + b->len);
  memset(h, 0, sizeof *h);
  h->magic = DEP_XFER_MAGIC;
  h->src = r->rank_of[lr];
  h->dest = d->dest;
  h->parity = d->parity;
  h->seq = d->seq;
  h->bytes = d->bytes;
  snprintf(h->job_id, sizeof h->job_id, "%s", r->id);
  if (pool_block_read(r->arena[lr], base + dep_slab_out_slot(&r->lay, d->parity, ri), h->slot,
                      sizeof h->slot, why, sizeof why) != 0 ||
      pool_block_read(r->arena[lr], base + dep_slab_out_block(&r->lay, d->parity, ri),
                      (uint8_t *)(h + 1), d->bytes, why, sizeof why) != 0)
    goto bad;
  uint64_t flag;
  memcpy(&flag, h->slot, sizeof flag);
  if (flag != d->seq) {
    snprintf(why, sizeof why, "a descriptor of call %llu whose slot image holds call %llu",
             (unsigned long long)d->seq, (unsigned long long)flag);
    goto bad;
  }
  b->len += sizeof *h + d->bytes;
  frames[peer]++;
  atomic_fetch_add_explicit(&r->bytes_out, sizeof *h + d->bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&r->frames_out, 1, memory_order_relaxed);
  return true;
bad:
  if (!atomic_exchange(&r->said, true))
    log_warnx("job %s: local rank %u's ring holds %s; the job fails", r->id, lr, why);
  route_fail(r, DEP_ERR_PROTOCOL);
  return false;
}

/* One sweep over the rings thread `self` serves; returns descriptors taken. */
static uint64_t sweep(uint32_t self, struct xfer_batch *batches, uint64_t *frames, bool *full) {
  uint64_t taken = 0;
  *full = false;
  pthread_rwlock_rdlock(&X.lock);
  for (struct xfer_route *r = X.routes; r != NULL && !*full; r = r->next) {
    if (atomic_load(&r->failed) != 0)
      continue;
    for (uint32_t lr = self; lr < r->local_world && !*full; lr += X.nthreads) {
      struct dep_xring *ring = r->ring[lr];
      if (ring == NULL)
        continue;
      uint64_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
      uint64_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
      if (head - tail > DEP_XRING_ENTRIES) {
        if (!atomic_exchange(&r->said, true))
          log_warnx("job %s: local rank %u's ring says %llu descriptors are waiting, more than it "
                    "holds; the job fails", r->id, lr, (unsigned long long)(head - tail));
        route_fail(r, DEP_ERR_PROTOCOL);
        break;
      }
      if (head - tail > atomic_load_explicit(&r->ring_peak, memory_order_relaxed))
        atomic_store_explicit(&r->ring_peak, (uint32_t)(head - tail), memory_order_relaxed);
      while (tail != head) {
        struct dep_xring_desc d = ring->desc[tail % DEP_XRING_ENTRIES];
        if (!take_desc(r, lr, &d, batches, frames))
          break;
        tail++;
        taken++;
        atomic_store_explicit(&ring->tail, tail, memory_order_release);
        int peer = r->peer_of[d.dest];
        if (batches[peer].len >= XFER_BATCH_BYTES) {
          *full = true;
          break;
        }
      }
    }
  }
  /* The sweep's RDMA writes go before the lock does, so that no route ends
   * with writes of it still waiting in a chain. */
  uint64_t lost = xfer_rdma_flush();
  for (struct xfer_route *r = X.routes; r != NULL && lost != 0; r = r->next) {
    for (uint32_t g = 0; g < r->world; g++) {
      if (r->peer_of[g] >= 0 && (lost >> r->peer_of[g] & 1)) {
        if (!atomic_exchange(&r->said, true))
          log_warnx("job %s: RDMA writes of its blocks to node %s were lost; the job fails",
                    r->id, peer_name(r->peer_of[g]));
        route_fail(r, DEP_ERR_PEER);
        break;
      }
    }
  }
  pthread_rwlock_unlock(&X.lock);
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
  uint64_t last_work = 0;
  while (!atomic_load(&X.stop)) {
    bool full;
    uint64_t t0 = mono_ns();
    uint64_t taken = sweep(self, batches, frames, &full);
    for (int k = 0; k < CONFIG_MAX_LIST; k++) {
      if (batches[k].len == 0)
        continue;
      (void)batch_send(k, &batches[k], frames[k]);
      batches[k].len = 0;
      frames[k] = 0;
    }
    uint64_t now = mono_ns();
    if (taken > 0 || full) {
      atomic_fetch_add_explicit(&X.busy_ns, now - t0, memory_order_relaxed);
      last_work = now;
      continue;
    }
    pthread_rwlock_rdlock(&X.lock);
    bool none = X.routes == NULL;
    pthread_rwlock_unlock(&X.lock);
    if (none) {
      pthread_mutex_lock(&X.idle_mu);
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += 100000000l;
      if (until.tv_nsec >= 1000000000l) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000l;
      }
      if (!atomic_load(&X.stop))
        pthread_cond_timedwait(&X.idle_cv, &X.idle_mu, &until);
      pthread_mutex_unlock(&X.idle_mu);
    } else if (now - last_work < XFER_SPIN_NS) {
      sched_yield();
    } else {
      struct timespec ts = {0, XFER_NAP_NS};
      nanosleep(&ts, NULL);
    }
  }
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    free(batches[k].buf);
  xfer_rdma_thread_end();
  return NULL;
}

/* ---- receivers --------------------------------------------------------------- */

struct receiver {
  int peer;
  int fd;
  int slot; /* in X.peers[peer].in_fds */
};

static bool ended_here(const char *id) {
  for (uint32_t i = 0; i < XFER_ENDED_MAX && i < X.n_ended; i++)
    if (strcmp(X.ended[i], id) == 0)
      return true;
  return false;
}

/* Check a frame's header against the routes (lock held); on success fill
 * the write's target.  DEP_ERR_NOT_FOUND: no such job here now;
 * DEP_ERR_STATE: none, but it may come (the caller waits for it). */
static int frame_target(int k, const struct dep_xfer_hdr *h, struct xfer_route **route,
                        struct pool_block **arena, uint64_t *block_off, uint64_t *slot_off,
                        char *why, size_t whylen) {
  struct xfer_route *r = route_find(h->job_id);
  *route = r;
  if (r == NULL)
    return ended_here(h->job_id) ? DEP_ERR_NOT_FOUND : DEP_ERR_STATE;
  if (h->src >= r->world || r->peer_of[h->src] != k || h->dest >= r->world ||
      r->local_of[h->dest] < 0 || h->parity > 1 || h->bytes > r->lay.block_bytes) {
    snprintf(why, whylen, "a frame of job %s from rank %u to rank %u (parity %u, %llu bytes) that "
             "the job's membership or layout does not allow", r->id, h->src, h->dest, h->parity,
             (unsigned long long)h->bytes);
    return DEP_ERR_PROTOCOL;
  }
  if (atomic_load(&r->failed) != 0)
    return DEP_ERR_NOT_FOUND; /* the job cannot go on here; its bytes have no reader */
  uint32_t ld = (uint32_t)r->local_of[h->dest];
  *arena = r->arena[ld];
  *block_off = r->offset[ld] + dep_slab_block(&r->lay, h->parity, h->src);
  *slot_off = r->offset[ld] + dep_slab_ctrl_slot(&r->lay, h->parity, h->src);
  return 0;
}

/* Receive frames from peer k on fd and write them into the slabs here. */
static void receive(int k, int fd) {
  struct xfer_peer *xp = &X.peers[k];
  uint8_t *buf = NULL;
  size_t cap = 0;
  char why[256] = "";
  for (;;) {
    int w = wait_readable(fd);
    if (w <= 0)
      break;
    struct dep_xfer_hdr h;
    if (io_all(fd, &h, sizeof h, false) != 0) {
      snprintf(why, sizeof why, "%s", errno ? strerror(errno) : "closed");
      break;
    }
    h.job_id[DEP_JOB_ID_MAX - 1] = '\0';
    if (h.magic != DEP_XFER_MAGIC || h.bytes > XFER_MAX_PAYLOAD) {
      snprintf(why, sizeof why, "a frame with magic %#x and %llu bytes: not deepepd's stream",
               h.magic, (unsigned long long)h.bytes);
      break;
    }
    /* Check before reading the payload, and again before writing it: the
     * job may end while its bytes arrive. */
    struct xfer_route *route;
    struct pool_block *arena;
    uint64_t block_off, slot_off;
    int rc;
    for (int waited = 0;; waited++) {
      pthread_rwlock_rdlock(&X.lock);
      rc = frame_target(k, &h, &route, &arena, &block_off, &slot_off, why, sizeof why);
      pthread_rwlock_unlock(&X.lock);
      if (rc != DEP_ERR_STATE || waited >= XFER_ROUTE_WAIT_MS || atomic_load(&X.stop))
        break;
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
    if (rc == DEP_ERR_PROTOCOL)
      break;
    if (rc == DEP_ERR_STATE)
      log_warnx("peer %s: frames of job %s, which does not run here after %d ms, are dropped",
                peer_name(k), h.job_id, XFER_ROUTE_WAIT_MS);
    if (h.bytes > cap) {
      uint8_t *p = realloc(buf, h.bytes);
      if (p == NULL) {
        snprintf(why, sizeof why, "out of memory for a frame of %llu bytes",
                 (unsigned long long)h.bytes);
        break;
      }
      buf = p;
      cap = h.bytes;
    }
    if (h.bytes > 0 && io_all(fd, buf, h.bytes, false) != 0) {
      snprintf(why, sizeof why, "%s", errno ? strerror(errno) : "closed");
      break;
    }
    atomic_fetch_add(&xp->bytes_in, sizeof h + h.bytes);
    atomic_fetch_add(&xp->frames_in, 1);
    if (rc != 0)
      continue; /* a job that is not (or no longer) here: its bytes have no reader */
    pthread_rwlock_rdlock(&X.lock);
    rc = frame_target(k, &h, &route, &arena, &block_off, &slot_off, why, sizeof why);
    if (rc == 0) {
      atomic_fetch_add_explicit(&route->bytes_in, sizeof h + h.bytes, memory_order_relaxed);
      atomic_fetch_add_explicit(&route->frames_in, 1, memory_order_relaxed);
    }
    /* Payload, then the slot's fields, then its flag: a reader that sees the
     * flag (acquire) sees the rest (pool_block_write's ordering). */
    if (rc == 0 && (pool_block_write(arena, block_off, buf, h.bytes, why, sizeof why) != 0 ||
                    pool_block_write(arena, slot_off + 8, h.slot + 8, sizeof h.slot - 8, why,
                                     sizeof why) != 0 ||
                    pool_block_write(arena, slot_off, h.slot, 8, why, sizeof why) != 0)) {
      struct xfer_route *r = route_find(h.job_id);
      if (r != NULL) {
        log_warnx("job %s: cannot write a block from node %s: %s; the job fails", r->id,
                  peer_name(k), why);
        route_fail(r, DEP_ERR_INTERNAL);
      }
    }
    pthread_rwlock_unlock(&X.lock);
    if (rc == DEP_ERR_PROTOCOL)
      break;
    why[0] = '\0';
  }
  if (why[0] != '\0' && !atomic_load(&X.stop))
    log_warnx("peer %s: inbound data connection dropped: %s", peer_name(k), why);
  free(buf);
}

static void *receiver_main(void *arg) {
  struct receiver rv = *(struct receiver *)arg;
  free(arg);
  prctl(PR_SET_NAME, "deepepd-rx");
  struct dep_xfer_ack ack = {DEP_XFER_MAGIC, DEP_XFER_VERSION};
  if (io_all(rv.fd, &ack, sizeof ack, true) == 0)
    receive(rv.peer, rv.fd);
  pthread_rwlock_wrlock(&X.lock);
  X.peers[rv.peer].in_fds[rv.slot] = -1;
  pthread_rwlock_unlock(&X.lock);
  atomic_fetch_sub(&X.peers[rv.peer].conns_in, 1);
  close(rv.fd);
  atomic_fetch_sub(&X.helpers, 1);
  return NULL;
}

/* Run fn(arg) on a detached thread counted in X.helpers; false when none could start. */
static bool spawn_helper(void *(*fn)(void *), void *arg) {
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  atomic_fetch_add(&X.helpers, 1);
  int rc = pthread_create(&t, &a, fn, arg);
  pthread_attr_destroy(&a);
  if (rc != 0) {
    atomic_fetch_sub(&X.helpers, 1);
    log_warnx("cannot start a thread for the data path: %s", strerror(rc));
    return false;
  }
  return true;
}

/* The open offer with token (made to peer k, or to any peer: k < 0), spent; NULL when none. */
static struct xfer_offer *offer_spend(int k, const uint8_t *token) {
  uint64_t now = mono_ns() / 1000000ull;
  for (int i = 0; i < XFER_OFFERS_MAX; i++) {
    struct xfer_offer *x = &X.offers[i];
    if (x->peer >= 0 && (k < 0 || x->peer == k) && x->expires_ms >= now &&
        sodium_memcmp(x->token, token, DEP_PEER_TOKEN_LEN) == 0) {
      int peer = x->peer;
      x->peer = -1; /* single use */
      x->spent_by = peer;
      return x;
    }
  }
  return NULL;
}

int xfer_offer_spend(const uint8_t *token) {
  struct xfer_offer *o = X.active ? offer_spend(-1, token) : NULL;
  return o != NULL ? o->spent_by : -1;
}

bool xfer_accept(int k, const uint8_t token[DEP_PEER_TOKEN_LEN], int fd) {
  if (!X.active || k < 0 || k >= CONFIG_MAX_LIST)
    return false;
  if (offer_spend(k, token) == NULL)
    return false;
  struct xfer_peer *xp = &X.peers[k];
  pthread_rwlock_wrlock(&X.lock);
  int slot = -1;
  for (int i = 0; i < XFER_CONNS_MAX && slot < 0; i++)
    if (xp->in_fds[i] < 0)
      slot = i;
  if (slot >= 0)
    xp->in_fds[slot] = fd;
  pthread_rwlock_unlock(&X.lock);
  struct receiver *rv = slot >= 0 ? malloc(sizeof *rv) : NULL;
  if (rv == NULL)
    goto fail;
  *rv = (struct receiver){.peer = k, .fd = fd, .slot = slot};
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0)
    (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  tune_socket(fd);
  atomic_fetch_add(&xp->conns_in, 1);
  if (!spawn_helper(receiver_main, rv)) {
    atomic_fetch_sub(&xp->conns_in, 1);
    free(rv);
    goto fail;
  }
  return true;
fail:
  if (slot >= 0) {
    pthread_rwlock_wrlock(&X.lock);
    xp->in_fds[slot] = -1;
    pthread_rwlock_unlock(&X.lock);
  }
  close(fd);
  return true; /* the token was good: fd is ours, and closed */
}

/* ---- connectors --------------------------------------------------------------- */

struct connector {
  int peer;
  uint64_t gen;
  uint8_t token[DEP_PEER_TOKEN_LEN];
  struct sockaddr_storage addr;
  socklen_t addrlen;
};

/* Open a data connection to the peer's listener with the offer's token. */
static int connect_data(const struct connector *c, char *why, size_t whylen) {
  int fd = socket(c->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    snprintf(why, whylen, "socket: %s", strerror(errno));
    return -1;
  }
  tune_socket(fd);
  if (connect(fd, (const struct sockaddr *)&c->addr, c->addrlen) != 0 && errno != EINPROGRESS) {
    snprintf(why, whylen, "connect: %s", strerror(errno));
    goto fail;
  }
  struct pollfd pf = {.fd = fd, .events = POLLOUT};
  int err = 0;
  socklen_t el = sizeof err;
  if (poll(&pf, 1, XFER_CONNECT_MS) != 1 ||
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
    snprintf(why, whylen, "connect: %s", err ? strerror(err) : "timed out");
    goto fail;
  }
  /* One PEER frame holding DATA_HELLO, as a peer link's first frame. */
  struct dep_peer_msg m = {.type = DEP_PEER_DATA_HELLO};
  memcpy(m.u.data_hello.token, c->token, DEP_PEER_TOKEN_LEN);
  m.u.data_hello.listen_port = X.listen_port;
  struct proto_buf inner, frame;
  proto_buf_init(&inner);
  proto_buf_init(&frame);
  int rc = peer_proto_encode(&inner, &m);
  struct dep_msg_opaque o = {.data = inner.data, .len = inner.len};
  if (rc == 0)
    rc = proto_frame_encode(&frame, DEP_MSG_PEER, 0, 0, &o);
  if (rc == 0 && io_all(fd, frame.data, frame.len, true) != 0)
    rc = -1;
  proto_buf_free(&inner);
  proto_buf_free(&frame);
  struct dep_xfer_ack ack;
  if (rc != 0 || io_all(fd, &ack, sizeof ack, false) != 0 || ack.magic != DEP_XFER_MAGIC ||
      ack.version != DEP_XFER_VERSION) {
    snprintf(why, whylen, "the peer did not take the data connection (%s)",
             rc != 0 ? "cannot send DATA_HELLO" : "no acknowledgement");
    goto fail;
  }
  return fd;
fail:
  close(fd);
  return -1;
}

static void *connector_main(void *arg) {
  struct connector c = *(struct connector *)arg;
  free(arg);
  prctl(PR_SET_NAME, "deepepd-dc");
  struct xfer_peer *xp = &X.peers[c.peer];
  char why[256] = "";
  int fd = connect_data(&c, why, sizeof why);
  if (fd < 0) {
    if (!atomic_load(&X.stop))
      log_warnx("peer %s: cannot open a data connection: %s", peer_name(c.peer), why);
  } else {
    bool placed = false;
    for (uint32_t i = 0; i < X.conns && !placed; i++) {
      pthread_mutex_lock(&xp->out[i].mu);
      if (xp->out[i].fd < 0 && atomic_load(&xp->gen) == c.gen && !atomic_load(&X.stop)) {
        xp->out[i].fd = fd;
        placed = true;
      }
      pthread_mutex_unlock(&xp->out[i].mu);
    }
    if (!placed)
      close(fd);
  }
  atomic_fetch_sub(&X.helpers, 1);
  return NULL;
}

void xfer_on_offer(int k, const struct dep_peer_data_offer *o) {
  if (!X.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  if (xfer_rdma_on_offer(k, o->token))
    return; /* spent on our data queue pair to k */
  struct connector *c = calloc(1, sizeof *c);
  if (c == NULL)
    return;
  c->peer = k;
  c->gen = atomic_load(&X.peers[k].gen);
  memcpy(c->token, o->token, DEP_PEER_TOKEN_LEN);
  if (peer_data_address(k, &c->addr, &c->addrlen) != 0) {
    log_warnx("peer %s: a data connection is offered but the peer has no address here",
              peer_name(k));
    free(c);
    return;
  }
  if (!spawn_helper(connector_main, c))
    free(c);
}

void xfer_peer_up(int k) {
  if (!X.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  uint64_t now = mono_ns() / 1000000ull;
  /* One more where RDMA may be had: the peer spends the first on its queue pair. */
  uint32_t offers = X.conns + (xfer_rdma_wanted(k) ? 1u : 0u);
  for (uint32_t n = 0; n < offers; n++) {
    struct xfer_offer *o = NULL;
    for (int i = 0; i < XFER_OFFERS_MAX && o == NULL; i++)
      if (X.offers[i].peer < 0 || X.offers[i].expires_ms < now)
        o = &X.offers[i];
    if (o == NULL)
      return;
    struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
    randombytes_buf(m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
    memcpy(o->token, m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
    o->peer = k;
    o->expires_ms = now + XFER_OFFER_MS;
    if (peer_send(k, &m) != 0) {
      o->peer = -1;
      return;
    }
  }
}

void xfer_peer_down(int k) {
  if (!X.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  struct xfer_peer *xp = &X.peers[k];
  atomic_fetch_add(&xp->gen, 1);
  for (int i = 0; i < XFER_OFFERS_MAX; i++)
    if (X.offers[i].peer == k)
      X.offers[i].peer = -1;
  xfer_rdma_peer_down(k);
  for (uint32_t i = 0; i < X.conns; i++) {
    pthread_mutex_lock(&xp->out[i].mu);
    out_close(xp, i);
    pthread_mutex_unlock(&xp->out[i].mu);
  }
  /* The receivers see their connection end and go. */
  pthread_rwlock_rdlock(&X.lock);
  for (int i = 0; i < XFER_CONNS_MAX; i++)
    if (xp->in_fds[i] >= 0)
      shutdown(xp->in_fds[i], SHUT_RDWR);
  pthread_rwlock_unlock(&X.lock);
}

void xfer_peer_stats(int k, struct xfer_peer_stats *out) {
  memset(out, 0, sizeof *out);
  if (!X.active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  struct xfer_peer *xp = &X.peers[k];
  for (uint32_t i = 0; i < X.conns; i++) {
    pthread_mutex_lock(&xp->out[i].mu);
    out->conns_out += xp->out[i].fd >= 0;
    pthread_mutex_unlock(&xp->out[i].mu);
  }
  out->conns_in = atomic_load(&xp->conns_in);
  out->bytes_out = atomic_load(&xp->bytes_out);
  out->bytes_in = atomic_load(&xp->bytes_in);
  out->frames_out = atomic_load(&xp->frames_out);
  out->frames_in = atomic_load(&xp->frames_in);
}

void xfer_job_stats(const struct job *j, struct dep_msg_job_node *out) {
  if (!X.active)
    return;
  pthread_rwlock_rdlock(&X.lock);
  const struct xfer_route *r = route_of(j);
  if (r != NULL) {
    out->bytes_out = atomic_load(&r->bytes_out);
    out->bytes_in = atomic_load(&r->bytes_in);
    out->frames_out = atomic_load(&r->frames_out);
    out->frames_in = atomic_load(&r->frames_in);
    out->ring_peak = atomic_load(&r->ring_peak);
    out->ring_entries = DEP_XRING_ENTRIES;
  }
  pthread_rwlock_unlock(&X.lock);
}

void xfer_proxy_stats(uint32_t *threads, uint64_t *busy_us) {
  *threads = X.active ? X.started : 0;
  *busy_us = X.active ? atomic_load(&X.busy_ns) / 1000u : 0;
}

/* ---- start and stop ------------------------------------------------------------- */

/* The proxy threads start with the first job that needs them, when the devices are known. */
static int xfer_start_threads(void) {
  X.nthreads = X.cfg->proxy_threads ? X.cfg->proxy_threads
                                    : (devices_count() ? (uint32_t)devices_count() : 1);
  if (X.nthreads > 64)
    X.nthreads = 64;
  for (uint32_t i = 0; i < X.nthreads; i++) {
    int rc = pthread_create(&X.threads[i], NULL, proxy_main, (void *)(uintptr_t)i);
    if (rc != 0) {
      log_errx("cannot start proxy thread %u of %u: %s", i, X.nthreads, strerror(rc));
      X.nthreads = X.started;
      return X.started > 0 ? 0 : -1;
    }
    X.started++;
  }
  log_info("data path between nodes: %u proxy thread(s), %u data connection(s) each way to "
           "each peer", X.nthreads, X.conns);
  return 0;
}

int xfer_init(const struct config *cfg) {
  if (cfg->n_peers == 0)
    return 0; /* a single node: nothing to move */
  if (sodium_init() < 0) {
    log_errx("libsodium cannot start (sodium_init); the data path between nodes needs it");
    return -1;
  }
  memset(&X, 0, sizeof X);
  pthread_rwlock_init(&X.lock, NULL);
  pthread_mutex_init(&X.idle_mu, NULL);
  pthread_cond_init(&X.idle_cv, NULL);
  X.conns = cfg->connection_pool_size < XFER_CONNS_MAX ? cfg->connection_pool_size
                                                       : XFER_CONNS_MAX;
  X.listen_port = cfg->listen_port;
  for (int k = 0; k < CONFIG_MAX_LIST; k++) {
    for (int i = 0; i < XFER_CONNS_MAX; i++) {
      X.peers[k].out[i].fd = -1;
      pthread_mutex_init(&X.peers[k].out[i].mu, NULL);
      X.peers[k].in_fds[i] = -1;
    }
  }
  for (int i = 0; i < XFER_OFFERS_MAX; i++)
    X.offers[i].peer = -1;
  X.cfg = cfg;
  X.active = true;
  xfer_rdma_init(cfg);
  return 0;
}

void xfer_fini(void) {
  if (!X.active)
    return;
  atomic_store(&X.stop, true);
  pthread_mutex_lock(&X.idle_mu);
  pthread_cond_broadcast(&X.idle_cv);
  pthread_mutex_unlock(&X.idle_mu);
  for (uint32_t i = 0; i < X.started; i++)
    pthread_join(X.threads[i], NULL);
  for (int k = 0; k < CONFIG_MAX_LIST; k++)
    xfer_peer_down(k);
  /* Connectors and receivers notice X.stop within a second (wait_readable). */
  for (int i = 0; i < 300 && atomic_load(&X.helpers) > 0; i++) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
  xfer_rdma_fini();
  pthread_rwlock_wrlock(&X.lock);
  while (X.routes != NULL) {
    struct xfer_route *r = X.routes;
    X.routes = r->next;
    xfer_rdma_route_free(r->rdma);
    for (uint32_t i = 0; i < r->local_world; i++)
      if (r->ring[i] != NULL)
        munmap(r->ring[i], DEP_XRING_BYTES);
    free(r);
  }
  pthread_rwlock_unlock(&X.lock);
  X.active = false;
}
