/*
 * xfer_dial.c — the connectors of the TCP data connections between nodes
 * (xfer.h, xfer_internal.h): a peer's DATA_OFFER is dialled by a connector
 * thread, which opens the connection with the offer's token and proves the
 * peer key on it (xring.h's challenge and proof); offers past the
 * connectors under way wait for the next of them to finish.  The offering
 * side and the receivers are xfer_conn.c's.
 */
#include "xfer.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "peer.h"
#include "peerauth.h"
#include "proto.h"
#include "testhooks.h"
#include "xfer_internal.h"
#include "xfer_rdma.h"
#include "xring.h"

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


/* Open a data connection to the peer's listener with the offer's token. */
static int connect_data(const struct connector *c, char *why, size_t whylen) {
  int fd = socket(c->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    snprintf(why, whylen, "socket: %s", strerror(errno));
    return -1;
  }
  xfer__tune_socket(fd);
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
  if (rc == 0 && xfer__io_all(fd, frame.data, frame.len, true) != 0)
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
  const int io = xfer__wait_readable_until(fd, until) == 1
                     ? xfer__io_within(fd, &ch, head, false, XFER_CONNECT_MS)
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
  if (xfer__io_within(fd, (uint8_t *)&ch + head, sizeof ch - head, false, XFER_CONNECT_MS) != 0) {
    snprintf(why, whylen, "the peer did not take the data connection (no challenge)");
    goto fail;
  }
  peerauth_data_mac(c->dkey, ch.nonce, c->token, pr.mac);
  if (xfer__io_within(fd, &pr, sizeof pr, true, XFER_CONNECT_MS) != 0 ||
      xfer__io_within(fd, &ack, sizeof ack, false, XFER_CONNECT_MS) != 0 ||
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
      if (xp->out[i].fd >= 0 && xfer__out_dead(xp->out[i].fd))
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
 * connector to finish (the loop's, xfer__offers_mu held): false when the peer's
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
 * again; if not, c is counted off.  Under xfer__offers_mu, as xfer_on_offer's
 * count and queueing are, so that no offer is queued behind a connector
 * that has looked and is going.
 */
static bool dial_next(struct connector *c) {
  struct xfer_peer *xp = &X->peers[c->peer];
  const uint64_t gen = atomic_load(&xp->gen), now = mono_ns() / 1000000ull;
  pthread_mutex_lock(&xfer__offers_mu);
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
  pthread_mutex_unlock(&xfer__offers_mu);
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
  pthread_mutex_lock(&xfer__offers_mu);
  const bool start = atomic_load(&xp->connecting) < 2 * X->conns && dial_take(xp, gen);
  if (start)
    atomic_fetch_add(&xp->connecting, 1);
  const bool queued = !start && offer_queue(k, o, gen);
  pthread_mutex_unlock(&xfer__offers_mu);
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
  if (!xfer__spawn_helper(connector_main, c)) {
    dial_done(xp, gen);
    atomic_fetch_sub(&xp->connecting, 1);
    sodium_memzero(c, sizeof *c);
    free(c);
  }
}
