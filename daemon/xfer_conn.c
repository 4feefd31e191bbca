/*
 * xfer_conn.c — the TCP data connections between nodes (xfer.h,
 * xfer_internal.h): the single-use tokens this daemon offers a peer once
 * it is up (DATA_OFFER), the connector threads that open a connection with
 * a peer's token and prove the peer key on it (xring.h's challenge and
 * proof), a receiver thread per inbound connection that checks the proof,
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

/* A DATA_OFFER's token is good for this long. */
#define XFER_OFFER_MS 10000
/* The largest payload a frame may carry (a block of the largest shape fits). */
#define XFER_MAX_PAYLOAD (1ull << 32)

/* ---- socket helpers (threads) ------------------------------------------------ */

/* Send or receive all len bytes, waiting at most ms for any progress. */
static int io_within(int fd, void *buf, size_t len, bool send_it, int ms) {
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

static int io_all(int fd, void *buf, size_t len, bool send_it) {
  return io_within(fd, buf, len, send_it, XFER_IO_MS);
}

/* Read and drop n bytes of fd (a payload no job here reads), through scratch. */
static int drain(int fd, struct xfer_batch *scratch, uint64_t n) {
  while (n > 0) {
    size_t c = n < (1u << 20) ? (size_t)n : 1u << 20;
    if (!xfer__batch_room(scratch, c)) {
      errno = ENOMEM;
      return -1;
    }
    if (io_all(fd, scratch->buf, c, false) != 0)
      return -1;
    n -= c;
  }
  return 0;
}

/* Wait until fd is readable, checking for stop each second, until until_ms
 * (mono_ns ms; 0: no end): 1 readable, 0 stopping or timed out, -1 error. */
static int wait_readable_until(int fd, uint64_t until_ms) {
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

static int wait_readable(int fd) { return wait_readable_until(fd, 0); }

static void tune_socket(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int buf = 4 << 20;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

void xfer__out_close(struct xfer_peer *xp, uint32_t i) {
  if (xp->out[i].fd >= 0) {
    shutdown(xp->out[i].fd, SHUT_RDWR);
    close(xp->out[i].fd);
    xp->out[i].fd = -1;
  }
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
static pthread_mutex_t offers_mu = PTHREAD_MUTEX_INITIALIZER;

/* Whether offer x, in use, is open at now: neither withdrawn nor expired. */
static bool offer_open(const struct xfer_offer *x, uint64_t now) {
  return x->peer >= 0 && !x->withdrawn && x->expires_ms >= now;
}

/* The offer with token made to peer k (to any peer: k < 0), open or (stale)
 * withdrawn or expired unused, its place not yet taken by another; offers_mu
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

/* The open offer with token made to peer k (to any peer: k < 0), offers_mu
 * held; NULL when none. */
static struct xfer_offer *offer_find(int k, const uint8_t *token) {
  return offer_lookup(k, token, false);
}

/* Spend the open offer with token (made to peer k, or to any: k < 0): the
 * peer it was made to, or -1 when none is open (single use). */
static int offer_spend(int k, const uint8_t *token) {
  pthread_mutex_lock(&offers_mu);
  struct xfer_offer *o = offer_find(k, token);
  const int peer = o != NULL ? o->peer : -1;
  if (o != NULL)
    o->peer = -1;
  pthread_mutex_unlock(&offers_mu);
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
  if (io_within(rv->fd, &ch, sizeof ch, true, XFER_CONNECT_MS) != 0 ||
      io_within(rv->fd, &pr, sizeof pr, false, XFER_CONNECT_MS) != 0) {
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
static int frame_take(int k, int fd, struct xfer_route *route, const struct xfer_target *t,
                      const struct dep_xfer_hdr *h, struct xfer_batch *in) {
  int io;
  bool counted = false;
  if (t->node) {
    io = xfer__batch_room(in, h->bytes) ? io_all(fd, in->buf, h->bytes, false)
                                        : (errno = ENOMEM, -1);
    char bad[256];
    if (io == 0 && xfer__node_fanout(route, h, in->buf, bad, sizeof bad) != 0) {
      if (!atomic_exchange(&route->said, true))
        log_warnx("peer %s: %s; the job fails", peer_name(k), bad);
      xfer__route_fail(route, DEP_ERR_PROTOCOL);
    } else {
      counted = io == 0;
    }
  } else {
    xfer__payload_begin();
    io = h->bytes > 0 ? io_all(fd, t->payload, h->bytes, false) : 0;
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

/* Receive frames from peer k on fd and write them into the exchange regions here. */
static void receive(int k, int fd) {
  struct xfer_peer *xp = &X->peers[k];
  struct xfer_batch in = {0}; /* scratch for payloads no job here reads */
  char why[256] = "";
  for (;;) {
    int w = wait_readable(fd);
    if (w <= 0)
      break;
    uint8_t wire[DEP_XFER_HDR_WIRE];
    struct dep_xfer_hdr h;
    if (io_all(fd, wire, sizeof wire, false) != 0) {
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
    const bool acked = io_all(rv.fd, &ack, sizeof ack, true) == 0;
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
static bool spawn_helper(void *(*fn)(void *), void *arg) {
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
  pthread_mutex_lock(&offers_mu);
  const struct xfer_offer *o = offer_find(-1, token);
  const int peer = o != NULL ? o->peer : -1;
  pthread_mutex_unlock(&offers_mu);
  return peer;
}

int xfer_offer_spend(const uint8_t *token) {
  return X->active ? offer_spend(-1, token) : -1;
}

enum peer_token xfer_accept(int k, const uint8_t token[DEP_PEER_TOKEN_LEN], int fd) {
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return PEER_TOKEN_UNKNOWN;
  pthread_mutex_lock(&offers_mu);
  struct xfer_offer *live = offer_find(k, token);
  const bool offered = live != NULL;
  const bool stale = !offered && offer_lookup(k, token, true) != NULL;
  /* Good until its proof has had its time (receiver_proven's two waits):
   * a daemon that read the DATA_HELLO late, stalled, does not let the offer
   * expire under the connector that used it in time. */
  const uint64_t proof_by = mono_ns() / 1000000ull + 2 * XFER_CONNECT_MS;
  if (offered && live->expires_ms < proof_by)
    live->expires_ms = proof_by;
  pthread_mutex_unlock(&offers_mu);
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
  tune_socket(fd);
  if (!spawn_helper(receiver_main, rv)) {
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

/* ---- connectors --------------------------------------------------------------- */

struct connector {
  int peer;
  uint64_t gen;
  uint64_t until_ms; /* when the offer expires at the peer, at the latest (mono_ns ms) */
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint8_t dkey[DEP_PEER_MAC_LEN];    /* peer_data_key(peer, true) */
  struct sockaddr_storage addr;
  socklen_t addrlen;
};

/*
 * The connectors of the peer's current generation (xfer_peer.dialing): one
 * more of generation gen, if it has fewer than X->conns (the loop's); and
 * one of generation gen done, counted off only while gen is the peer's.
 */
static uint64_t dial_gen(uint64_t gen) { return (gen & 0xffffffffull) << 32; }
static bool dial_take(struct xfer_peer *xp, uint64_t gen) {
  uint64_t v = atomic_load(&xp->dialing);
  for (;;) {
    const uint64_t n = (v & ~0xffffffffull) == dial_gen(gen) ? (v & 0xffffffffull) : 0;
    if (n >= X->conns)
      return false;
    if (atomic_compare_exchange_weak(&xp->dialing, &v, dial_gen(gen) | (n + 1)))
      return true;
  }
}
static void dial_done(struct xfer_peer *xp, uint64_t gen) {
  uint64_t v = atomic_load(&xp->dialing);
  while ((v & ~0xffffffffull) == dial_gen(gen) && (v & 0xffffffffull) > 0 &&
         !atomic_compare_exchange_weak(&xp->dialing, &v, v - 1))
    ;
}

/* Whether an outbound data connection was closed or cut at the other end:
 * after its acknowledgement nothing more comes in on it, so anything to
 * read (the end of the stream) or an error says it is gone. */
static bool out_dead(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  return poll(&p, 1, 0) > 0;
}

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
  m.u.data_hello.listen_port = X->listen_port;
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
  if (rc != 0) {
    snprintf(why, whylen, "cannot send DATA_HELLO: %s", errno ? strerror(errno) : "closed");
    goto fail;
  }
  /* Its challenge (magic and version first, so that another version is
   * named rather than timed out), our proof of the key, its ack.  The
   * challenge is waited for while the peer holds the offer open: a peer
   * whose loop is stalled accepts the connection late, and one given up
   * here would leave the offer standing there, unused, until it expired. */
  struct dep_xfer_challenge ch;
  struct dep_xfer_ack ack;
  const size_t head = sizeof ack;
  const uint64_t now = mono_ns() / 1000000ull;
  const uint64_t until = c->until_ms > now + XFER_CONNECT_MS ? c->until_ms : now + XFER_CONNECT_MS;
  const int io = wait_readable_until(fd, until) == 1
                     ? io_within(fd, &ch, head, false, XFER_CONNECT_MS)
                     : (errno = ETIMEDOUT, -1);
  if (io != 0 || ch.magic != DEP_XFER_MAGIC || ch.version < DEP_XFER_MIN_VERSION ||
      ch.version > DEP_XFER_VERSION) {
    if (io == 0 && ch.magic == DEP_XFER_MAGIC)
      snprintf(why, whylen, "the peer speaks data stream version %u; this deepepd speaks "
               "versions %u..%u: run the same deepepd on every node", ch.version,
               DEP_XFER_MIN_VERSION, DEP_XFER_VERSION);
    else
      snprintf(why, whylen, "the peer did not take the data connection (no challenge)");
    goto fail;
  }
  struct dep_xfer_proof pr;
  if (io_within(fd, (uint8_t *)&ch + head, sizeof ch - head, false, XFER_CONNECT_MS) != 0) {
    snprintf(why, whylen, "the peer did not take the data connection (no challenge)");
    goto fail;
  }
  peerauth_data_mac(c->dkey, ch.nonce, c->token, pr.mac);
  if (io_within(fd, &pr, sizeof pr, true, XFER_CONNECT_MS) != 0 ||
      io_within(fd, &ack, sizeof ack, false, XFER_CONNECT_MS) != 0 ||
      ack.magic != DEP_XFER_MAGIC || ack.version != DEP_XFER_VERSION) {
    snprintf(why, whylen, "the peer refused our proof of the peer key (is peer_key_file the same "
             "on both nodes?)");
    goto fail;
  }
  return fd;
fail:
  close(fd);
  return -1;
}

/* Open a data connection to c's peer with its offer, and place it among
 * the peer's outbound ones (or close it: the peer went down since, or has
 * them all). */
static void connector_dial(struct connector *c) {
  struct xfer_peer *xp = &X->peers[c->peer];
  char why[256] = "";
  int fd = connect_data(c, why, sizeof why);
  sodium_memzero(c->dkey, sizeof c->dkey);
  if (fd < 0) {
    /* The peer went down since the offer: it withdrew the token and closes
     * the connection unread (PEER_TOKEN_STALE), and offers anew. */
    if (atomic_load(&xp->gen) != c->gen)
      log_debug("peer %s: a data connection opened with an offer made before the peer went "
                "down did not complete: %s", peer_name(c->peer), why);
    else if (mono_ns() / 1000000ull >= c->until_ms)
      log_info("peer %s: a data connection was not answered while its offer stood (the peer "
               "is stalled?): %s; the peer offers again", peer_name(c->peer), why);
    else if (!atomic_load(&X->stop))
      log_warnx("peer %s: cannot open a data connection: %s", peer_name(c->peer), why);
  } else {
    bool placed = false;
    for (uint32_t i = 0; i < X->conns && !placed; i++) {
      pthread_mutex_lock(&xp->out[i].mu);
      if (xp->out[i].fd >= 0 && out_dead(xp->out[i].fd))
        xfer__out_close(xp, i); /* cut at the other end: this offer replaces it */
      if (xp->out[i].fd < 0 && atomic_load(&xp->gen) == c->gen && !atomic_load(&X->stop)) {
        xp->out[i].fd = fd;
        placed = true;
      }
      pthread_mutex_unlock(&xp->out[i].mu);
    }
    if (!placed)
      close(fd);
  }
}


/*
 * Queue peer k's offer o (gen: the peer's generation now) for the next
 * connector to finish (the loop's, offers_mu held): false when the peer's
 * X->conns places all hold offers still good, of this generation (it
 * offered more than it may have connections).
 */
static bool offer_queue(int k, const struct dep_peer_data_offer *o, uint64_t gen) {
  struct xfer_peer *xp = &X->peers[k];
  const uint64_t now = mono_ns() / 1000000ull;
  struct xfer_queued *q = NULL;
  for (uint32_t i = 0; i < X->conns && q == NULL; i++)
    if (xp->queued[i].until_ms <= now || xp->queued[i].gen != gen)
      q = &xp->queued[i];
  if (q != NULL) {
    memcpy(q->token, o->token, DEP_PEER_TOKEN_LEN);
    peer_data_key(k, true, q->dkey);
    q->gen = gen;
    q->until_ms = now + XFER_OFFER_MS;
  }
  return q != NULL;
}

/*
 * Connector c has finished: take the queued offer of the peer's current
 * generation that expires last, if one is still good, into c, counted in
 * that generation (c may have been of an older one): whether c dials
 * again; if not, c is counted off.  Under offers_mu, as xfer_on_offer's
 * count and queueing are, so that no offer is queued behind a connector
 * that has looked and is going.
 */
static bool dial_next(struct connector *c) {
  struct xfer_peer *xp = &X->peers[c->peer];
  const uint64_t gen = atomic_load(&xp->gen), now = mono_ns() / 1000000ull;
  pthread_mutex_lock(&offers_mu);
  struct xfer_queued *q = NULL;
  for (uint32_t i = 0; i < X->conns && !atomic_load(&X->stop); i++) {
    struct xfer_queued *e = &xp->queued[i];
    if (e->gen == gen && e->until_ms > now && (q == NULL || e->until_ms > q->until_ms))
      q = e;
  }
  const bool next = q != NULL && (c->gen == gen || dial_take(xp, gen));
  if (c->gen != gen || !next)
    dial_done(xp, c->gen);
  if (next) {
    c->gen = gen;
    c->until_ms = q->until_ms;
    memcpy(c->token, q->token, DEP_PEER_TOKEN_LEN);
    memcpy(c->dkey, q->dkey, DEP_PEER_MAC_LEN);
    sodium_memzero(q, sizeof *q);
  } else {
    atomic_fetch_sub(&xp->connecting, 1);
  }
  pthread_mutex_unlock(&offers_mu);
  return next;
}

/* Open a data connection with c's offer and place it; then with each offer
 * queued for the peer meanwhile (dial_next). */
static void *connector_main(void *arg) {
  struct connector c = *(struct connector *)arg;
  sodium_memzero(arg, sizeof c);
  free(arg);
  prctl(PR_SET_NAME, "deepepd-dc");
  do
    connector_dial(&c);
  while (dial_next(&c));
  sodium_memzero(&c, sizeof c);
  atomic_fetch_sub(&X->helpers, 1);
  return NULL;
}

void xfer_on_offer(int k, const struct dep_peer_data_offer *o) {
  if (!X->active || k < 0 || k >= CONFIG_MAX_LIST)
    return;
  if (xfer_rdma_on_offer(k, o->token))
    return; /* spent on our data queue pair to k */
  /* A connector thread per data connection the peer may have from us, at
   * most, so that no peer, however many offers it sends, makes more
   * threads here than that.  An offer past them waits for the next of
   * them to finish (as many as the peer may have connections; the rest are
   * ignored): the peer counts an offer as pending until it expires
   * (XFER_OFFER_MS) and would not offer again before.  Connectors still
   * under way from before the peer last went down count apart (twice that
   * in all): their tokens are withdrawn at the peer, which closes their
   * connections unread. */
  struct xfer_peer *xp = &X->peers[k];
  const uint64_t gen = atomic_load(&xp->gen);
  pthread_mutex_lock(&offers_mu);
  const bool start = atomic_load(&xp->connecting) < 2 * X->conns && dial_take(xp, gen);
  if (start)
    atomic_fetch_add(&xp->connecting, 1);
  const bool queued = !start && offer_queue(k, o, gen);
  pthread_mutex_unlock(&offers_mu);
  if (queued)
    return;
  if (!start) {
    uint64_t n;
    if (xfer_say_now(&xp->excess_offers, &n))
      log_warnx("peer %s: %llu DATA_OFFER(s) ignored: %u data connection(s) to it are being "
                "opened already, as many as it may have, and as many offers wait for them",
                peer_name(k), (unsigned long long)n, X->conns);
    return;
  }
  struct connector *c = calloc(1, sizeof *c);
  if (c == NULL) {
    dial_done(xp, gen);
    atomic_fetch_sub(&xp->connecting, 1);
    return;
  }
  c->peer = k;
  c->gen = gen;
  c->until_ms = mono_ns() / 1000000ull + XFER_OFFER_MS;
  memcpy(c->token, o->token, DEP_PEER_TOKEN_LEN);
  if (peer_data_address(k, &c->addr, &c->addrlen) != 0) {
    log_warnx("peer %s: a data connection is offered but the peer has no address here",
              peer_name(k));
    dial_done(xp, gen);
    atomic_fetch_sub(&xp->connecting, 1);
    free(c);
    return;
  }
  peer_data_key(k, true, c->dkey);
  if (!spawn_helper(connector_main, c)) {
    dial_done(xp, gen);
    atomic_fetch_sub(&xp->connecting, 1);
    sodium_memzero(c, sizeof *c);
    free(c);
  }
}

/* Offer peer k n tokens for data connections into this daemon (the loop's). */
static void offer(int k, uint32_t offers, uint64_t now) {
  for (uint32_t n = 0; n < offers; n++) {
    struct dep_peer_msg m = {.type = DEP_PEER_DATA_OFFER};
    randombytes_buf(m.u.data_offer.token, DEP_PEER_TOKEN_LEN);
    struct xfer_offer *o = NULL;
    pthread_mutex_lock(&offers_mu);
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
    pthread_mutex_unlock(&offers_mu);
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
    pthread_mutex_lock(&offers_mu);
    for (int i = 0; i < XFER_OFFERS_MAX; i++)
      have += X->offers[i].peer == k && offer_open(&X->offers[i], now);
    pthread_mutex_unlock(&offers_mu);
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
  pthread_mutex_lock(&offers_mu);
  for (int i = 0; i < XFER_OFFERS_MAX; i++)
    if (X->offers[i].peer == k)
      X->offers[i].withdrawn = true;
  sodium_memzero(xp->queued, sizeof xp->queued); /* the peer's offers of before are void */
  pthread_mutex_unlock(&offers_mu);
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
    out->conns_out += xp->out[i].fd >= 0 && !out_dead(xp->out[i].fd); /* cut ones are none */
    pthread_mutex_unlock(&xp->out[i].mu);
  }
  out->conns_in = atomic_load(&xp->conns_in);
  out->bytes_out = atomic_load(&xp->bytes_out);
  out->bytes_in = atomic_load(&xp->bytes_in);
  out->frames_out = atomic_load(&xp->frames_out);
  out->frames_in = atomic_load(&xp->frames_in);
}

