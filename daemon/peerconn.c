/*
 * peerconn.c — opening the peer links (peer_internal.h): resolving each
 * peer's host, connecting its slots with a non-blocking connect and
 * backing off with jitter when one fails or drops, accepting inbound
 * connections (only from peers' addresses, each address with its share of
 * the places for connections still authenticating; paused on EMFILE), the
 * listener, and the refusals' log lines, counted per source.  A connection
 * becomes a link (link.h) once it is open; peer.c runs it from there.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "peer_internal.h"

#define PEER_ACCEPT_BUDGET 64
#define PEER_ACCEPT_PAUSE_MS 1000
/* Inbound connections not yet authenticated, at most, in all: the fds that
 * connections from peers' addresses can hold before proving anything.  Each
 * address's share is its peers' part of it (conn_admit), so that a flood
 * from one address leaves every other peer its places. */
#define PEER_PREAUTH_MAX 256u
/* A connection still authenticating gives its place to a newer one from its
 * address only once it is this old: a peer's own connection says HELLO at
 * once and authenticates within two round trips, while a flood's idle ones
 * would otherwise hold the place for the whole PEER_HANDSHAKE_MS. */
#define PEER_PREAUTH_GRACE_MS 1000

/* ---- slots: backoff ------------------------------------------------------ */

/* A slot's connection failed or was lost: wait, with jitter, then try again. */
void peerconn_backoff(struct peer *p, int i, const char *why) {
  struct peer_slot *s = &p->slots[i];
  bool was_up = s->state == SLOT_UP;
  s->conn = NULL;
  s->state = SLOT_BACKOFF;
  p->reconnects++;
  if (why != NULL && why[0] != '\0')
    snprintf(p->last_error, sizeof p->last_error, "%s", why);
  /* Half the base plus up to half again: many daemons restarting together spread out. */
  uint64_t base = s->backoff_ms;
  uint64_t wait = base / 2 + randombytes_uniform((uint32_t)(base / 2 + 1));
  s->retry_at_ms = now_ms() + wait;
  s->backoff_ms = base * 2 > PEER_BACKOFF_MAX_MS ? PEER_BACKOFF_MAX_MS : base * 2;
  if (p->was_up && was_up)
    log_warnx("peer %s: connection %d lost (%s); reconnecting", p->name, i, p->last_error);
  else
    log_debug("peer %s: connection %d: %s; next try in %llu ms", p->name, i, p->last_error,
              (unsigned long long)wait);
  p->was_up = false;
}

/* ---- outbound: resolve, connect, hand to a link -------------------------- */

static void peer_on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
  struct peer *p = req->data;
  p->resolving = false;
  if (P->stopping) {
    uv_freeaddrinfo(res);
    return;
  }
  if (status != 0) {
    snprintf(p->last_error, sizeof p->last_error, "cannot resolve %s: %s", p->host,
             uv_strerror(status));
    log_warnx("peer %s: %s", p->name, p->last_error);
  } else {
    p->naddrs = 0;
    for (struct addrinfo *a = res; a != NULL && p->naddrs < PEER_MAX_ADDRS; a = a->ai_next) {
      if ((a->ai_family == AF_INET || a->ai_family == AF_INET6) &&
          a->ai_addrlen <= sizeof p->addrs[0])
        memcpy(&p->addrs[p->naddrs++], a->ai_addr, a->ai_addrlen);
    }
    p->resolved_ms = now_ms();
  }
  uv_freeaddrinfo(res);
  /* The slots waiting for an address connect now, not at the next tick:
   * at start that is the difference between a few ms and PEER_TICK_MS. */
  for (uint32_t i = 0; p->naddrs > 0 && i < P->pool_size; i++)
    if (p->slots[i].state == SLOT_BACKOFF && p->slots[i].awaits_address)
      peerconn_connect(p, (int)i);
}

void peerconn_resolve(struct peer *p) {
  if (p->resolving)
    return;
  char port[8];
  snprintf(port, sizeof port, "%u", (unsigned)p->port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  p->gai.data = p;
  int rc = uv_getaddrinfo(P->loop, &p->gai, peer_on_resolved, p->host, port, &hints);
  if (rc != 0) {
    snprintf(p->last_error, sizeof p->last_error, "cannot resolve %s: %s", p->host,
             uv_strerror(rc));
    return;
  }
  p->resolving = true;
}

static void conn_on_cpoll_failed(uv_handle_t *h) {
  struct peer_conn *c = h->data;
  close(c->fd);
  free(c);
}

static void conn_on_cpoll_connected(uv_handle_t *h) {
  struct peer_conn *c = h->data;
  struct peer *p = c->peer;
  if (P->stopping) {
    close(c->fd);
    free(c);
    return;
  }
  if (link_init(&c->link, P->loop, c->fd, &peer__link_ops, c) != 0) {
    close(c->fd);
    int i = c->slot;
    free(c);
    peerconn_backoff(p, i, "cannot watch the socket");
    return;
  }
  c->linked = true;
  p->slots[c->slot].state = SLOT_AUTHENTICATING;
  c->last_rx_ms = now_ms();
  (void)peer__send_hello(c);
}

/* The connect ended (or timed out: why set): go on to the link, or back off. */
void peerconn_connect_done(struct peer_conn *c, const char *why) {
  if (c->cpoll_closing)
    return;
  c->cpoll_closing = true;
  uv_poll_stop(&c->cpoll);
  if (why != NULL) {
    struct peer *p = c->peer;
    int i = c->slot;
    uv_close((uv_handle_t *)&c->cpoll, conn_on_cpoll_failed);
    peerconn_backoff(p, i, why);
    return;
  }
  uv_close((uv_handle_t *)&c->cpoll, conn_on_cpoll_connected);
}

static void conn_on_cpoll(uv_poll_t *h, int status, int events) {
  struct peer_conn *c = h->data;
  /* libuv reports POLLERR as UV_EBADF: the socket's own error says what happened. */
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
    err = errno;
  if (err == 0 && status < 0)
    err = -status;
  if (err == EINPROGRESS)
    return;
  char why[DEP_MSG_TEXT_MAX];
  snprintf(why, sizeof why, "connect to %s: %s", c->peer->name, strerror(err));
  peerconn_connect_done(c, err != 0 ? why : NULL);
}

void peerconn_connect(struct peer *p, int i) {
  struct peer_slot *s = &p->slots[i];
  if (p->naddrs == 0) {
    /* Not resolved yet (or it failed): ask again; connect when the answer
     * comes, or at a later tick if it does not. */
    peerconn_resolve(p);
    s->state = SLOT_BACKOFF;
    s->retry_at_ms = now_ms() + PEER_BACKOFF_MIN_MS;
    s->awaits_address = true;
    return;
  }
  s->awaits_address = false;
  const struct sockaddr_storage *a = &p->addrs[(unsigned)i % (unsigned)p->naddrs];
  int fd = socket(a->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  char why[DEP_MSG_TEXT_MAX];
  if (fd < 0) {
    snprintf(why, sizeof why, "socket: %s", strerror(errno));
    peerconn_backoff(p, i, why);
    return;
  }
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  socklen_t alen = a->ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
  if (connect(fd, (const struct sockaddr *)a, alen) != 0 && errno != EINPROGRESS) {
    snprintf(why, sizeof why, "connect to %s: %s", p->name, strerror(errno));
    close(fd);
    peerconn_backoff(p, i, why);
    return;
  }
  struct peer_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    close(fd);
    peerconn_backoff(p, i, "out of memory");
    return;
  }
  c->fd = fd;
  c->peer = p;
  c->slot = i;
  c->hs.connector = true;
  c->hs.key = P->key;
  c->hs.keylen = P->keylen;
  c->opened_ms = now_ms();
  if (uv_poll_init(P->loop, &c->cpoll, fd) != 0) {
    close(fd);
    free(c);
    peerconn_backoff(p, i, "cannot watch the socket");
    return;
  }
  c->cpoll.data = c;
  uv_poll_start(&c->cpoll, UV_WRITABLE, conn_on_cpoll);
  s->conn = c;
  s->state = SLOT_CONNECTING;
}

/* ---- refusals: counted per source, said once per interval ---------------- */

static const char *const refusal_names[PEER_REFUSAL_KINDS] = {
    [PEER_REFUSED_PROTOCOL] = "broke the protocol",
    [PEER_REFUSED_ADDRESS] = "not from a configured peer's address",
    [PEER_REFUSED_BUSY] = "no place left for its address",
    [PEER_REFUSED_EVICTED] = "unauthenticated, closed for a newer one",
    [PEER_REFUSED_TIMEOUT] = "did not authenticate in time",
    [PEER_REFUSED_UNLISTED] = "not a configured peer's listen port",
    [PEER_REFUSED_AUTH] = "failed authentication",
    [PEER_REFUSED_TOKEN] = "named a data connection token not offered",
};

bool peerconn_same_address(const struct sockaddr_storage *x, const struct sockaddr_storage *y) {
  if (x->ss_family == AF_INET && y->ss_family == AF_INET)
    return ((const struct sockaddr_in *)x)->sin_addr.s_addr ==
           ((const struct sockaddr_in *)y)->sin_addr.s_addr;
  if (x->ss_family == AF_INET6 && y->ss_family == AF_INET6)
    return memcmp(&((const struct sockaddr_in6 *)x)->sin6_addr,
                  &((const struct sockaddr_in6 *)y)->sin6_addr, 16) == 0;
  return false;
}

/* a's address, numeric, without its port. */
static void addr_text(const struct sockaddr_storage *a, char *buf, size_t len) {
  snprintf(buf, len, "?");
  (void)getnameinfo((const struct sockaddr *)a, sizeof *a, buf, (socklen_t)len, NULL, 0,
                    NI_NUMERICHOST);
}

void peerconn_refused(const struct sockaddr_storage *src, enum peer_refusal kind,
                      const char *why) {
  struct peer_refusals *r = NULL, *vacant = NULL;
  for (size_t i = 0; i < PEER_REFUSAL_SOURCES && r == NULL; i++) {
    struct peer_refusals *q = &P->refusals[i];
    if (q->used && peerconn_same_address(&q->addr, src))
      r = q;
    else if (!q->used && vacant == NULL)
      vacant = q;
  }
  if (r == NULL && vacant != NULL) {
    r = vacant;
    memset(r, 0, sizeof *r);
    r->used = true;
    r->addr = *src;
    r->since_ms = now_ms();
  }
  if (r == NULL) { /* more sources than the table: one count for the rest */
    r = &P->refusals_other;
    if (!r->used) {
      memset(r, 0, sizeof *r);
      r->used = true;
      r->since_ms = now_ms();
    }
    r->count[kind]++;
    return;
  }
  if ((r->said & (1u << kind)) == 0) {
    r->said |= 1u << kind;
    char addr[INET6_ADDRSTRLEN];
    addr_text(&r->addr, addr, sizeof addr);
    log_warnx("peers: refused a connection from %s: %s (further refusals from %s are counted "
              "and logged every %d s)", addr, why, addr, PEER_REFUSAL_LOG_MS / 1000);
    return;
  }
  r->count[kind]++;
}

/* Log r's counts in one line, if any, and start its next interval; a
 * source with none is forgotten, so that its next refusal is said at once. */
static void refusals_say(struct peer_refusals *r, uint64_t now, bool other) {
  uint32_t total = 0;
  char kinds[512] = "";
  size_t o = 0;
  for (int k = 0; k < PEER_REFUSAL_KINDS; k++) {
    if (r->count[k] == 0)
      continue;
    total += r->count[k];
    int n = snprintf(kinds + o, sizeof kinds - o, "%s%u %s", o ? ", " : "", r->count[k],
                     refusal_names[k]);
    if (n > 0 && (size_t)n < sizeof kinds - o)
      o += (size_t)n;
  }
  if (total == 0) {
    r->used = false;
    return;
  }
  char addr[INET6_ADDRSTRLEN + 16];
  if (other)
    snprintf(addr, sizeof addr, "other addresses");
  else
    addr_text(&r->addr, addr, sizeof addr);
  log_warnx("peers: refused %u %sconnection%s from %s in the last %llu s: %s", total,
            other ? "" : "more ", total == 1 ? "" : "s", addr,
            (unsigned long long)((now - r->since_ms + 500) / 1000), kinds);
  memset(r->count, 0, sizeof r->count);
  r->since_ms = now;
}

void peerconn_refusals_tick(uint64_t now, bool all) {
  for (size_t i = 0; i < PEER_REFUSAL_SOURCES; i++) {
    struct peer_refusals *r = &P->refusals[i];
    if (r->used && (all || now - r->since_ms >= PEER_REFUSAL_LOG_MS))
      refusals_say(r, now, false);
  }
  struct peer_refusals *r = &P->refusals_other;
  if (r->used && (all || now - r->since_ms >= PEER_REFUSAL_LOG_MS))
    refusals_say(r, now, true);
}

/* ---- inbound ------------------------------------------------------------- */

/* How many configured peers have a among their addresses. */
static uint32_t peers_at(const struct sockaddr_storage *a) {
  uint32_t n = 0;
  for (size_t k = 0; k < P->n; k++) {
    const struct peer *p = &P->peers[k];
    for (int i = 0; i < p->naddrs; i++) {
      if (peerconn_same_address(&p->addrs[i], a)) {
        n++;
        break;
      }
    }
  }
  return n;
}

/*
 * Whether a connection from src may take a place while it authenticates.
 * Only a configured peer's address may; its share of PEER_PREAUTH_MAX is
 * its peers' part.  When the share (or the whole) is taken, the oldest
 * connection from that address (or any) past PEER_PREAUTH_GRACE_MS gives
 * way; when none is that old, the new one is refused (*kind, why).
 */
static bool conn_admit(const struct sockaddr_storage *src, enum peer_refusal *kind, char *why,
                       size_t len) {
  uint32_t at = peers_at(src);
  if (at == 0) {
    uint32_t unresolved = 0;
    for (size_t k = 0; k < P->n; k++)
      unresolved += P->peers[k].naddrs == 0;
    *kind = PEER_REFUSED_ADDRESS;
    if (unresolved > 0)
      snprintf(why, len, "not the address of a configured peer (%u of %zu peers' hosts are not "
               "resolved yet)", unresolved, P->n);
    else
      snprintf(why, len, "not the address of a configured peer");
    return false;
  }
  uint32_t share = (uint32_t)(PEER_PREAUTH_MAX * at / P->n);
  if (share == 0)
    share = 1;
  uint32_t total = 0, mine = 0;
  struct peer_conn *oldest_mine = NULL, *oldest = NULL;
  uint64_t now = now_ms();
  for (struct peer_conn *q = P->inbound; q != NULL; q = q->next) {
    if (q->authed || q->handed_off || !link_open(&q->link))
      continue;
    total++;
    bool same = peerconn_same_address(&q->src, src);
    mine += same;
    if (now - q->opened_ms < PEER_PREAUTH_GRACE_MS)
      continue;
    if (oldest == NULL || q->opened_ms < oldest->opened_ms)
      oldest = q;
    if (same && (oldest_mine == NULL || q->opened_ms < oldest_mine->opened_ms))
      oldest_mine = q;
  }
  if (mine < share && total < PEER_PREAUTH_MAX)
    return true;
  struct peer_conn *victim = mine >= share ? oldest_mine : oldest;
  if (victim == NULL) {
    *kind = PEER_REFUSED_BUSY;
    if (mine >= share)
      snprintf(why, len, "%u connections from its address (its share of places) are still "
               "authenticating, none of them for %d ms yet", mine, PEER_PREAUTH_GRACE_MS);
    else
      snprintf(why, len, "%u inbound connections are still authenticating, none of them for "
               "%d ms yet", total, PEER_PREAUTH_GRACE_MS);
    return false;
  }
  victim->refusal = PEER_REFUSED_EVICTED;
  link_drop(&victim->link, "not authenticated after %llu ms when a newer connection needed its "
            "place", (unsigned long long)(now - victim->opened_ms));
  return true;
}

/* ss as the address to compare: an IPv4 caller on a dual-stack socket as IPv4. */
static void addr_plain(const struct sockaddr_storage *ss, struct sockaddr_storage *out) {
  *out = *ss;
  if (ss->ss_family != AF_INET6)
    return;
  const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)ss;
  if (!IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr))
    return;
  struct sockaddr_in s4 = {.sin_family = AF_INET, .sin_port = s6->sin6_port};
  memcpy(&s4.sin_addr, s6->sin6_addr.s6_addr + 12, 4);
  memset(out, 0, sizeof *out);
  memcpy(out, &s4, sizeof s4);
}

void peerconn_on_accept(uv_poll_t *h, int status, int events) {
  for (int n = 0; n < PEER_ACCEPT_BUDGET; n++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(P->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
        return;
      log_warn("peers: accept: pausing the listener for %d ms", PEER_ACCEPT_PAUSE_MS);
      uv_poll_stop(&P->listen_poll);
      P->accept_paused_until = now_ms() + PEER_ACCEPT_PAUSE_MS;
      return;
    }
    struct sockaddr_storage src;
    addr_plain(&ss, &src);
    enum peer_refusal kind;
    char why[DEP_MSG_TEXT_MAX];
    if (!conn_admit(&src, &kind, why, sizeof why)) {
      close(fd);
      peerconn_refused(&src, kind, why);
      continue;
    }
    struct peer_conn *c = calloc(1, sizeof *c);
    if (c == NULL) {
      close(fd);
      continue;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->slot = -1;
    c->src = src;
    char host[INET6_ADDRSTRLEN] = "?", serv[8] = "?";
    (void)getnameinfo((struct sockaddr *)&c->src, sizeof c->src, host, sizeof host, serv,
                      sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->from, sizeof c->from, "%s:%s", host, serv);
    c->hs.connector = false;
    c->hs.key = P->key;
    c->hs.keylen = P->keylen;
    c->opened_ms = c->last_rx_ms = now_ms();
    if (link_init(&c->link, P->loop, fd, &peer__link_ops, c) != 0) {
      close(fd);
      free(c);
      continue;
    }
    c->linked = true;
    c->next = P->inbound;
    P->inbound = c;
  }
}

int peerconn_listen(void) {
  char port[8];
  snprintf(port, sizeof port, "%u", (unsigned)P->listen_port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE};
  struct addrinfo *res = NULL;
  int rc = getaddrinfo(P->listen_address, port, &hints, &res);
  if (rc != 0) {
    log_errx("listen.address %s: %s", P->listen_address, gai_strerror(rc));
    return -1;
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    log_errx("peers: cannot listen on %s port %u: %s%s", P->listen_address,
             (unsigned)P->listen_port, strerror(err),
             err == EADDRINUSE ? " (another deepepd, or another program, holds it: stop it, or "
                                 "set listen.port here and in the other nodes' peers)"
                               : "");
    if (fd >= 0)
      close(fd);
    freeaddrinfo(res);
    return -1;
  }
  freeaddrinfo(res);
  P->listen_fd = fd;
  if (uv_poll_init(P->loop, &P->listen_poll, fd) != 0) {
    close(fd);
    P->listen_fd = -1;
    return -1;
  }
  uv_poll_start(&P->listen_poll, UV_READABLE, peerconn_on_accept);
  P->listening = true;
  log_info("peers: listening on %s port %u", P->listen_address, (unsigned)P->listen_port);
  return 0;
}
void peerconn_close_for_stop(struct peer_conn *c) {
  if (!c->linked) {
    if (!c->cpoll_closing) { /* else its close callback sees P->stopping */
      c->cpoll_closing = true;
      uv_poll_stop(&c->cpoll);
      uv_close((uv_handle_t *)&c->cpoll, conn_on_cpoll_failed);
    }
    return;
  }
  if (c->up) {
    struct dep_peer_msg m = {.type = DEP_PEER_CLOSE};
    snprintf(m.u.error.message, sizeof m.u.error.message, "deepepd on %s is stopping", P->node);
    (void)peer__send(c, &m);
  }
  link_close(&c->link, "deepepd is stopping");
}
