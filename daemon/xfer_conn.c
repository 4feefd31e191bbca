/*
 * xfer_conn.c — the TCP data connections between nodes (xfer.h,
 * xfer_internal.h): the single-use tokens this daemon offers a peer once
 * it is up (DATA_OFFER; the connector threads that dial a peer's are
 * xfer_dial.c's), a receiver thread per inbound connection that checks the proof,
 * then reads each frame's payload straight into the destination rank's in
 * block (or drops a frame of a job not held here).  What goes out on them
 * is sent by xfer_send.c.
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
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "job.h"
#include "log.h"
#include "peer.h"
#include "peerauth.h"
#include "pool.h"
#include "proto.h"
#include "testhooks.h"
#include "xfer_internal.h"
#include "xfer_rdma.h"
#include "xring.h"

/* The largest payload a frame may carry (a block of the largest shape fits). */
#define XFER_MAX_PAYLOAD (1ull << 32)

/* ---- socket helpers (threads) ------------------------------------------------ */

/* Send or receive all len bytes, waiting at most ms for any progress. */
int xfer__io_within(int fd, void *buf, size_t len, bool send_it, int ms) {
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
    int r = poll(&pf, 1, ms);
    if (r == 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    if (r < 0 && errno != EINTR)
      return -1;
  }
  return 0;
}

int xfer__io_all(int fd, void *buf, size_t len, bool send_it) {
  return xfer__io_within(fd, buf, len, send_it, XFER_IO_MS);
}

/* Read and drop n bytes of fd (a payload no job here reads), through scratch. */
static int drain(int fd, struct xfer_batch *scratch, uint64_t n) {
  while (n > 0) {
    size_t c = n < (1u << 20) ? (size_t)n : 1u << 20;
    if (!xfer__batch_room(scratch, c)) {
      errno = ENOMEM;
      return -1;
    }
    if (xfer__io_all(fd, scratch->buf, c, false) != 0)
      return -1;
    n -= c;
  }
  return 0;
}

/* Wait until fd is readable, checking for stop each second, until until_ms
 * (mono_ns ms; 0: no end): 1 readable, 0 stopping or timed out, -1 error. */
int xfer__wait_readable_until(int fd, uint64_t until_ms) {
  for (;;) {
    if (atomic_load(&X->stop))
      return 0;
    const uint64_t now = mono_ns() / 1000000ull;
    if (until_ms != 0 && now >= until_ms)
      return 0;
    const int ms = until_ms != 0 && until_ms - now < 1000 ? (int)(until_ms - now) : 1000;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    int r = poll(&pf, 1, ms);
    if (r > 0)
      return 1;
    if (r < 0 && errno != EINTR)
      return -1;
  }
}

/* Wait until fd is readable, looking (yielding) for X->rx_spin_ns after
 * `last` (mono_ns), then blocked: as xfer__wait_readable_until without an end. */
static int wait_readable(int fd, uint64_t last) {
  const uint64_t spin = atomic_load_explicit(&X->rx_spin_ns, memory_order_relaxed);
  while (mono_ns() - last < spin && !atomic_load(&X->stop)) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, 0) > 0)
      return 1;
    sched_yield();
  }
  return xfer__wait_readable_until(fd, 0);
}

void xfer__tune_socket(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int buf = 4 << 20;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  /* A credit goes out behind what the socket holds unsent (xfer_proxy.c
   * sends a sweep's credits first, but an earlier sweep's data may still
   * fill the send buffer), and its sender waits for it: the socket takes
   * more only while less than this is unsent.  What is sent and not yet
   * acknowledged (the link's bandwidth-delay product) is not counted, so
   * the link stays full while the proxy thread wakes to write more. */
  int unsent = XFER_NOTSENT_LOWAT;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &unsent, sizeof unsent);
}

void xfer__out_close(struct xfer_peer *xp, uint32_t i) {
  if (xp->out[i].fd >= 0) {
    shutdown(xp->out[i].fd, SHUT_RDWR);
    close(xp->out[i].fd);
    xp->out[i].fd = -1;
  }
}

/* Whether an outbound data connection was closed or cut at the other end:
 * after its acknowledgement nothing more comes in on it, so anything to
 * read (the end of the stream) or an error says it is gone. */
bool xfer__out_dead(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  return poll(&p, 1, 0) > 0;
}

/* ---- receivers --------------------------------------------------------------- */

void xfer_job_expect(const struct job *j) {
  if (!X->active)
    return;
  struct xfer_expect *e = calloc(1, sizeof *e);
  pthread_rwlock_wrlock(&X->lock);
  bool have = false;
  for (struct xfer_expect *x = X->expected; x != NULL && !have; x = x->next)
    have = x->job == j;
  bool listed = !have && e != NULL;
  if (listed) {
    e->job = j;
    snprintf(e->id, sizeof e->id, "%s", j->id);
    e->next = X->expected;
    X->expected = e;
  }
  pthread_rwlock_unlock(&X->lock);
  if (listed || have) {
    if (!listed)
      free(e);
    return;
  }
  log_warnx("job %s: out of memory to expect its frames; those that come before its route are "
            "dropped", j->id);
}

void xfer__unexpect(const struct job *j) {
  bool gone = false;
  for (struct xfer_expect **pp = &X->expected; *pp != NULL;) {
    struct xfer_expect *x = *pp;
    if (j == NULL || x->job == j) {
      *pp = x->next;
      free(x);
      gone = true;
    } else {
      pp = &x->next;
    }
  }
  if (!gone)
    return;
  /* A receiver waiting for its route stops waiting. */
  pthread_mutex_lock(&X->routes_mu);
  atomic_fetch_add(&X->routes_added, 1);
  pthread_cond_broadcast(&X->routes_cv);
  pthread_mutex_unlock(&X->routes_mu);
}

/* Whether a job of this id is expected here (lock held). */
static bool expected_here(const char *id) {
  for (const struct xfer_expect *x = X->expected; x != NULL; x = x->next)
    if (strcmp(x->id, id) == 0)
      return true;
  return false;
}

/* The offers (X->offers): made and withdrawn by the loop, spent by the
 * receiver whose connection proves the key. */
pthread_mutex_t xfer__offers_mu = PTHREAD_MUTEX_INITIALIZER;

/* Whether offer x, in use, is open at now: neither withdrawn nor expired. */
static bool offer_open(const struct xfer_offer *x, uint64_t now) {
  return x->peer >= 0 && !x->withdrawn && x->expires_ms >= now;
}

/* The offer with token made to peer k (to any peer: k < 0), open or (stale)
 * withdrawn or expired unused, its place not yet taken by another; xfer__offers_mu
 * held; NULL when none. */
static struct xfer_offer *offer_lookup(int k, const uint8_t *token, bool stale) {
  const uint64_t now = mono_ns() / 1000000ull;
  for (int i = 0; i < XFER_OFFERS_MAX; i++) {
    struct xfer_offer *x = &X->offers[i];
    if (x->peer >= 0 && (k < 0 || x->peer == k) && offer_open(x, now) != stale &&
        sodium_memcmp(x->token, token, DEP_PEER_TOKEN_LEN) == 0)
      return x;
  }
  return NULL;
}

/* The open offer with token made to peer k (to any peer: k < 0), xfer__offers_mu
 * held; NULL when none. */
static struct xfer_offer *offer_find(int k, const uint8_t *token) {
  return offer_lookup(k, token, false);
}

/* Spend the open offer with token (made to peer k, or to any: k < 0): the
 * peer it was made to, or -1 when none is open (single use). */
static int offer_spend(int k, const uint8_t *token) {
  pthread_mutex_lock(&xfer__offers_mu);
  struct xfer_offer *o = offer_find(k, token);
  const int peer = o != NULL ? o->peer : -1;
  if (o != NULL)
    o->peer = -1;
  pthread_mutex_unlock(&xfer__offers_mu);
  return peer;
}

struct receiver {
  int peer;
  int fd;
  int slot; /* in X->peers[peer].in_fds */
  uint8_t token[DEP_PEER_TOKEN_LEN]; /* the offer DATA_HELLO named */
  uint8_t dkey[DEP_PEER_MAC_LEN];    /* peer_data_key(peer, false) */
};

_Static_assert(DEP_XFER_NONCE_LEN == DEP_PEER_CHALLENGE_LEN && DEP_XFER_MAC_LEN == DEP_PEER_MAC_LEN,
               "the data connection's proof is peerauth_data_mac's");

/*
 * The handshake of an inbound data connection (xring.h): a fresh nonce
 * out, the opener's proof of the key in, then the offer spent.  Until the
 * proof holds, the offer stays open: a connection that names a token it
 * saw but cannot prove the key takes nothing from the peer that can.
 * true, or false with why.
 */
static bool receiver_proven(const struct receiver *rv, char *why, size_t whylen) {
  struct dep_xfer_challenge ch = {.magic = DEP_XFER_MAGIC, .version = DEP_XFER_VERSION};
  randombytes_buf(ch.nonce, sizeof ch.nonce);
  struct dep_xfer_proof pr;
  if (xfer__io_within(rv->fd, &ch, sizeof ch, true, XFER_CONNECT_MS) != 0 ||
      xfer__io_within(rv->fd, &pr, sizeof pr, false, XFER_CONNECT_MS) != 0) {
    snprintf(why, whylen, "no proof of the peer key came (%s)",
             errno ? strerror(errno) : "closed");
    return false;
  }
  if (!peerauth_data_check(rv->dkey, ch.nonce, rv->token, pr.mac)) {
    uint64_t n;
    if (xfer_say_now(&X->peers[rv->peer].bad_proofs, &n))
      log_warnx("peer %s: %llu data connection(s) that named a token offered to it but did not "
                "prove the peer key are refused: a different peer_key_file there, or someone "
                "who saw the token on the wire", peer_name(rv->peer), (unsigned long long)n);
    why[0] = '\0'; /* said */
    return false;
  }
  if (offer_spend(rv->peer, rv->token) < 0) {
    snprintf(why, whylen, "its token was spent by another connection, or expired");
    return false;
  }
  return true;
}

/*
 * The route and target of frame h from peer k, the route held (users) on 0,
 * or the DEP_ERR_* of xfer__frame_target (why).  Every check comes before a
 * byte is written: the job runs here, the peer holds the source, the
 * destination is held here, the parity and size fit its layout; the held
 * route keeps the job's regions its own until the payload is read.  A job
 * with no route here (DEP_ERR_STATE) is waited for only while it is
 * expected here (its ranks here all attached, its MEMBERSHIP sent: the peer
 * may have completed it first), until its route is added, woken by
 * xfer_job_start, not polled.  Any other job's frame is dropped at once
 * (DEP_ERR_NOT_FOUND): the peer can send one only after our MEMBERSHIP, so
 * a job not expected is not about to be held (it ended here, however long
 * ago, or never ran), and waiting would stall every other job's frames
 * behind it on this connection.
 */
static int frame_route(int k, const struct dep_xfer_hdr *h, struct xfer_route **route,
                       struct xfer_target *t, char *why, size_t whylen) {
  int rc;
  uint64_t until = mono_ns() + (uint64_t)XFER_ROUTE_WAIT_MS * 1000000ull;
  for (;;) {
    uint64_t seen = atomic_load(&X->routes_added);
    pthread_rwlock_rdlock(&X->lock);
    rc = xfer__frame_target(k, h, route, t, why, whylen);
    if (rc == 0)
      atomic_fetch_add_explicit(&(*route)->users, 1, memory_order_relaxed);
    if (rc == DEP_ERR_STATE && !expected_here(h->job_id))
      rc = DEP_ERR_NOT_FOUND;
    pthread_rwlock_unlock(&X->lock);
    if (rc != DEP_ERR_STATE || atomic_load(&X->stop) || mono_ns() >= until)
      return rc;
    xfer__routes_wait(seen, until);
  }
}

/*
 * Read frame h's payload from fd to its target t on the held route, publish
 * it and put the route back: 0, or -1 (errno) when the connection failed.
 * A node channel's chunk goes into scratch (in), then out to each of its
 * destinations' in channels (one crossing per node, xring.h); one that does
 * not fit the job fails the job, not the connection: the stream is whole.
 */
/* Fan NODE frame h (its payload at buf) of peer k out on route (xfer__node_fanout): true, or
 * false with the job failed when it does not fit the job (a TCP stream or a staging goes on). */
static bool node_fan(int k, struct xfer_route *route, const struct dep_xfer_hdr *h,
                     const uint8_t *buf) {
  char bad[256];
  if (xfer__node_fanout(route, h, buf, bad, sizeof bad) == 0)
    return true;
  if (!atomic_exchange(&route->said, true))
    log_warnx("peer %s: %s; the job fails", peer_name(k), bad);
  xfer__route_fail(route, DEP_ERR_PROTOCOL);
  return false;
}

static int frame_take(int k, int fd, struct xfer_route *route, const struct xfer_target *t,
                      const struct dep_xfer_hdr *h, struct xfer_batch *in) {
  int io;
  bool counted = false;
  if (t->node) {
    io = xfer__batch_room(in, h->bytes) ? xfer__io_all(fd, in->buf, h->bytes, false)
                                        : (errno = ENOMEM, -1);
    counted = io == 0 && node_fan(k, route, h, in->buf);
  } else {
    xfer__payload_begin();
    io = h->bytes > 0 ? xfer__io_all(fd, t->payload, h->bytes, false) : 0;
    xfer__payload_end();
    counted = io == 0;
  }
  if (counted) {
    atomic_fetch_add_explicit(&route->bytes_in, DEP_XFER_HDR_WIRE + h->bytes,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&route->frames_in, 1, memory_order_relaxed);
    if (!t->node)
      xfer__frame_publish(t, h);
  }
  xfer__route_put(route);
  return io;
}

/*
 * A NODE frame peer k wrote into our staging by RDMA (xfer_rdma.h's
 * xfer_stage_fn; the routes' lock held by the proxy thread that calls it):
 * checked as a frame over TCP is (xfer__frame_target), then fanned out.
 * A job whose route is not here yet but is expected waits in its chunk
 * (1); anything else is done with (0): fanned out, or dropped and said
 * (a job not here, or a frame that is not a NODE frame of its size: the
 * peer wrote what no deepepd does).
 */
int xfer__stage_take(int k, const uint8_t *frame, uint64_t room, struct xfer_rdma_route **to) {
  struct xfer_peer *xp = &X->peers[k];
  struct dep_xfer_hdr h;
  char why[256];
  *to = NULL;
  int rc = dep__xfer_hdr_decode(frame, DEP_XFER_HDR_WIRE, &h, why, sizeof why);
  if (rc == 0 && (h.kind != DEP_XRING_NODE || h.bytes > room - DEP_XFER_HDR_WIRE)) {
    snprintf(why, sizeof why, "a staged frame of kind %u and %llu bytes: only a node "
             "channel's chunk of at most %llu", h.kind, (unsigned long long)h.bytes,
             (unsigned long long)(room - DEP_XFER_HDR_WIRE));
    rc = DEP_ERR_PROTOCOL;
  }
  struct xfer_route *route = NULL;
  struct xfer_target t;
  if (rc == 0)
    rc = xfer__frame_target(k, &h, &route, &t, why, sizeof why);
  if (rc == DEP_ERR_STATE && expected_here(h.job_id))
    return 1;
  uint64_t n;
  if (rc == DEP_ERR_PROTOCOL) {
    if (xfer_say_now(&xp->bad_staged, &n))
      log_warnx("peer %s: %llu frame(s) written into our staging dropped (the latest: %s)",
                peer_name(k), (unsigned long long)n, why);
    return 0;
  }
  if (rc != 0) {
    if (xfer_say_now(&xp->stale_frames, &n))
      log_warnx("peer %s: %llu frame(s) of jobs that do not run here dropped (the latest of job "
                "%s)", peer_name(k), (unsigned long long)n, h.job_id);
    return 0;
  }
  *to = route->rdma;
  if (node_fan(k, route, &h, frame + DEP_XFER_HDR_WIRE)) {
    atomic_fetch_add_explicit(&route->bytes_in, DEP_XFER_HDR_WIRE + h.bytes,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&route->frames_in, 1, memory_order_relaxed);
  }
  return 0;
}

/* Receive frames from peer k on fd and write them into the exchange regions here. */
static void receive(int k, int fd) {
  struct xfer_peer *xp = &X->peers[k];
  struct xfer_batch in = {0}; /* scratch for payloads no job here reads */
  char why[256] = "";
  for (uint64_t last = 0;; last = mono_ns()) { /* 0: before the first frame, no looking */
    int w = wait_readable(fd, last);
    if (w <= 0)
      break;
    uint8_t wire[DEP_XFER_HDR_WIRE];
    struct dep_xfer_hdr h;
    if (xfer__io_all(fd, wire, sizeof wire, false) != 0) {
      snprintf(why, sizeof why, "%s", errno ? strerror(errno) : "closed");
      break;
    }
    if (dep__xfer_hdr_decode(wire, sizeof wire, &h, why, sizeof why) != 0)
      break;
    if (h.bytes > XFER_MAX_PAYLOAD) {
      snprintf(why, sizeof why, "a frame of %llu bytes: not a deepepd's data stream",
               (unsigned long long)h.bytes);
      break;
    }
    struct xfer_route *route;
    struct xfer_target t;
    int rc = frame_route(k, &h, &route, &t, why, sizeof why);
    if (rc == DEP_ERR_PROTOCOL)
      break;
    uint64_t n;
    if (rc != 0 && xfer_say_now(&xp->stale_frames, &n))
      log_warnx("peer %s: %llu frame(s) of jobs that do not run here dropped (the latest of job "
                "%s%s)", peer_name(k), (unsigned long long)n, h.job_id,
                rc == DEP_ERR_STATE ? ", expected here but still without its route" : "");
    int io = rc == 0 ? frame_take(k, fd, route, &t, &h, &in)
                     : drain(fd, &in, h.bytes); /* a job not (or no longer) here: no reader */
    if (io != 0) {
      snprintf(why, sizeof why, "%s", errno ? strerror(errno) : "closed");
      break;
    }
    atomic_fetch_add(&xp->bytes_in, sizeof wire + h.bytes);
    atomic_fetch_add(&xp->frames_in, 1);
    why[0] = '\0';
  }
  if (why[0] != '\0' && !atomic_load(&X->stop))
    log_warnx("peer %s: inbound data connection dropped: %s", peer_name(k), why);
  xfer__batch_free(&in);
}

static void *receiver_main(void *arg) {
  struct receiver rv = *(struct receiver *)arg;
  sodium_memzero(arg, sizeof rv);
  free(arg);
  prctl(PR_SET_NAME, "deepepd-rx");
  char why[160] = "";
  const bool proven = receiver_proven(&rv, why, sizeof why);
  sodium_memzero(rv.dkey, sizeof rv.dkey);
  struct xfer_peer *xp = &X->peers[rv.peer];
  if (proven) {
    atomic_fetch_add(&xp->conns_in, 1);
    struct dep_xfer_ack ack = {DEP_XFER_MAGIC, DEP_XFER_VERSION};
    const bool acked = xfer__io_all(rv.fd, &ack, sizeof ack, true) == 0;
    if (acked && atomic_load(&X->test_drops) > 0 && atomic_fetch_sub(&X->test_drops, 1) > 0)
      log_warnx("peer %s: an inbound data connection closed at once ($" TESTHOOK_DATA_DROPS_ENV ")",
                peer_name(rv.peer));
    else if (acked)
      receive(rv.peer, rv.fd);
    atomic_fetch_sub(&xp->conns_in, 1);
  } else if (why[0] != '\0' && !atomic_load(&X->stop)) {
    log_warnx("peer %s: an inbound data connection is refused: %s", peer_name(rv.peer), why);
  }
  pthread_rwlock_wrlock(&X->lock);
  xp->in_fds[rv.slot] = -1;
  pthread_rwlock_unlock(&X->lock);
  close(rv.fd);
  atomic_fetch_sub(&X->helpers, 1);
  return NULL;
}

/* Run fn(arg) on a detached thread counted in X->helpers; false when none could start. */
bool xfer__spawn_helper(void *(*fn)(void *), void *arg) {
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  atomic_fetch_add(&X->helpers, 1);
  int rc = pthread_create(&t, &a, fn, arg);
  pthread_attr_destroy(&a);
  if (rc != 0) {
    atomic_fetch_sub(&X->helpers, 1);
    log_warnx("cannot start a thread for the data path: %s", strerror(rc));
    return false;
  }
  return true;
}

int xfer_offer_peer(const uint8_t *token) {
  if (!X->active)
    return -1;
  pthread_mutex_lock(&xfer__offers_mu);
  const struct xfer_offer *o = offer_find(-1, token);
  const int peer = o != NULL ? o->peer : -1;
  pthread_mutex_unlock(&xfer__offers_mu);
  return peer;
}

int xfer_offer_spend(const uint8_t *token) {
  return X->active ? offer_spend(-1, token) : -1;
}

enum peer_token xfer_accept(int k, const uint8_t token[DEP_PEER_TOKEN_LEN], int fd) {
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return PEER_TOKEN_UNKNOWN;
  pthread_mutex_lock(&xfer__offers_mu);
  struct xfer_offer *live = offer_find(k, token);
  const bool offered = live != NULL;
  const bool stale = !offered && offer_lookup(k, token, true) != NULL;
  /* Good until its proof has had its time (receiver_proven's two waits):
   * a daemon that read the DATA_HELLO late, stalled, does not let the offer
   * expire under the connector that used it in time. */
  const uint64_t proof_by = mono_ns() / 1000000ull + 2 * XFER_CONNECT_MS;
  if (offered && live->expires_ms < proof_by)
    live->expires_ms = proof_by;
  pthread_mutex_unlock(&xfer__offers_mu);
  struct xfer_peer *xp = &X->peers[k];
  if (stale) {
    uint64_t n;
    if (xfer_say_now(&xp->stale_offers, &n))
      log_info("peer %s: %llu data connection(s) named an offer of ours that expired unused or "
               "was withdrawn when the links to it went down (one end was stalled or lost the "
               "links meanwhile): closed; the offers made since stand", peer_name(k),
               (unsigned long long)n);
    return PEER_TOKEN_STALE;
  }
  if (!offered)
    return PEER_TOKEN_UNKNOWN;
  /* A receiver thread per slot at most: a peer, or whoever names its
   * tokens, has at most XFER_CONNS_MAX of them here, proving or proven. */
  pthread_rwlock_wrlock(&X->lock);
  int slot = -1;
  for (int i = 0; i < XFER_CONNS_MAX && slot < 0; i++)
    if (xp->in_fds[i] < 0)
      slot = i;
  if (slot >= 0)
    xp->in_fds[slot] = fd;
  pthread_rwlock_unlock(&X->lock);
  struct receiver *rv = slot >= 0 ? malloc(sizeof *rv) : NULL;
  if (rv == NULL)
    goto fail;
  *rv = (struct receiver){.peer = k, .fd = fd, .slot = slot};
  memcpy(rv->token, token, DEP_PEER_TOKEN_LEN);
  peer_data_key(k, false, rv->dkey);
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0)
    (void)fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  xfer__tune_socket(fd);
  if (!xfer__spawn_helper(receiver_main, rv)) {
    sodium_memzero(rv, sizeof *rv);
    free(rv);
    goto fail;
  }
  return PEER_TOKEN_TAKEN;
fail:
  if (slot >= 0) {
    pthread_rwlock_wrlock(&X->lock);
    xp->in_fds[slot] = -1;
    pthread_rwlock_unlock(&X->lock);
  }
  close(fd);
  return PEER_TOKEN_TAKEN; /* the token was one offered: fd is ours, and closed */
}

/* Offer peer k n tokens for data connections into this daemon (the loop's). */
static void offer(int k, uint32_t offers, uint64_t now) {
  for (uint32_t n = 0; n < offers; n++) {
    struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
    randombytes_buf(m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
    struct xfer_offer *o = NULL;
    pthread_mutex_lock(&xfer__offers_mu);
    for (int i = 0; i < XFER_OFFERS_MAX && o == NULL; i++)
      if (X->offers[i].peer < 0)
        o = &X->offers[i];
    /* Else a stale one: remembered only to close its connection quietly. */
    for (int i = 0; i < XFER_OFFERS_MAX && o == NULL; i++)
      if (!offer_open(&X->offers[i], now))
        o = &X->offers[i];
    if (o != NULL) {
      memcpy(o->token, m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
      o->peer = k;
      o->withdrawn = false;
      o->expires_ms = now + XFER_OFFER_MS;
    }
    pthread_mutex_unlock(&xfer__offers_mu);
    if (o == NULL)
      return;
    if (peer_send(k, &m) != 0) { /* not sent: no one holds it (outside the lock: a
                                    failed send may take the peer down here) */
      (void)offer_spend(k, m.u.data_offer.token);
      return;
    }
  }
}

void xfer_peer_up(int k) {
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  /* One more where RDMA may be had: the peer spends the first on its queue pair. */
  offer(k, X->conns + (xfer_rdma_wanted(k) ? 1u : 0u), mono_ns() / 1000000ull);
}

void xfer_tick(void) {
  if (!X->active)
    return;
  const uint64_t now = mono_ns() / 1000000ull;
  for (int k = 0; k < peer_count() && k < CONFIG_MAX_LIST; k++) {
    if (!peer_is_up(k))
      continue;
    /* What it has, and what it may still open with the tokens it holds. */
    uint32_t have = atomic_load(&X->peers[k].conns_in);
    pthread_mutex_lock(&xfer__offers_mu);
    for (int i = 0; i < XFER_OFFERS_MAX; i++)
      have += X->offers[i].peer == k && offer_open(&X->offers[i], now);
    pthread_mutex_unlock(&xfer__offers_mu);
    if (have >= X->conns)
      continue;
    log_info("peer %s: %u of its %u data connections into this node are missing; offering "
             "new ones", peer_name(k), X->conns - have, X->conns);
    offer(k, X->conns - have, now);
  }
}

void xfer_peer_down(int k) {
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  struct xfer_peer *xp = &X->peers[k];
  atomic_fetch_add(&xp->gen, 1);
  /* Withdrawn, and remembered until their places are needed: a connector
   * the peer started with one before its links went down may reach us yet,
   * and is closed then without counting as a stranger's (PEER_TOKEN_STALE). */
  pthread_mutex_lock(&xfer__offers_mu);
  for (int i = 0; i < XFER_OFFERS_MAX; i++)
    if (X->offers[i].peer == k)
      X->offers[i].withdrawn = true;
  sodium_memzero(xp->queued, sizeof xp->queued); /* the peer's offers of before are void */
  pthread_mutex_unlock(&xfer__offers_mu);
  xfer_rdma_peer_down(k);
  for (uint32_t i = 0; i < X->conns; i++) {
    pthread_mutex_lock(&xp->out[i].mu);
    xfer__out_close(xp, i);
    pthread_mutex_unlock(&xp->out[i].mu);
  }
  /* The receivers see their connection end and go. */
  pthread_rwlock_rdlock(&X->lock);
  for (int i = 0; i < XFER_CONNS_MAX; i++)
    if (xp->in_fds[i] >= 0)
      shutdown(xp->in_fds[i], SHUT_RDWR);
  pthread_rwlock_unlock(&X->lock);
}

void xfer_peer_stats(int k, struct xfer_peer_stats *out) {
  memset(out, 0, sizeof *out);
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  struct xfer_peer *xp = &X->peers[k];
  for (uint32_t i = 0; i < X->conns; i++) {
    pthread_mutex_lock(&xp->out[i].mu);
    out->conns_out += xp->out[i].fd >= 0 && !xfer__out_dead(xp->out[i].fd); /* cut ones are none */
    pthread_mutex_unlock(&xp->out[i].mu);
  }
  out->conns_in = atomic_load(&xp->conns_in);
  out->bytes_out = atomic_load(&xp->bytes_out);
  out->bytes_in = atomic_load(&xp->bytes_in);
  out->frames_out = atomic_load(&xp->frames_out);
  out->frames_in = atomic_load(&xp->frames_in);
}

