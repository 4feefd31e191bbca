/*
 * peer.c — the peer daemons (peer.h): the listener, the outbound pools,
 * running the handshake (its logic is peerauth.c), keep-alive and
 * reconnection, all on the loop thread.
 *
 * Each configured peer has connection_pool_size outbound slots.  A slot
 * is connecting (a non-blocking connect watched with its own uv_poll),
 * authenticating (a link, the handshake under way), up, or in backoff
 * (waiting to try again, with the last error).  Inbound connections are
 * links too; they count for the peer they prove to be once authenticated.
 * One timer (PEER_TICK_MS) drives retries, keep-alives and the timeouts.
 */
#include "peer.h"

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

#include "link.h"
#include "log.h"
#include "notify.h"
#include "devices.h"
#include "peerauth.h"
#include "rdmaxp.h"
#include "xfer.h"

#define PEER_TICK_MS 100
#define PEER_ACCEPT_BUDGET 64
#define PEER_ACCEPT_PAUSE_MS 1000
#define PEER_MAX_ADDRS 8
/* Before a link has authenticated its frames are small: a HELLO at most. */
#define PEER_PREAUTH_MAX_BODY 1024u
/* Inbound connections not yet authenticated, at most: each lasts at most
 * PEER_HANDSHAKE_MS, and a configured peer opens connection_pool_size of
 * them at once, so this leaves room for many peers reconnecting together
 * while a flood of strangers cannot take the daemon's fds. */
#define PEER_PREAUTH_MAX 256u
#define PEER_QUEUE_BYTES (4u * 1024u * 1024u)

/* A link is up once it authenticated and settled its transport (peer_proto.h XPORT). */
enum peer_slot_state { SLOT_CONNECTING, SLOT_AUTHENTICATING, SLOT_TRANSPORT, SLOT_UP, SLOT_BACKOFF };

static const char *const slot_state_names[] = {
    [SLOT_CONNECTING] = "connecting",
    [SLOT_AUTHENTICATING] = "authenticating",
    [SLOT_TRANSPORT] = "transport",
    [SLOT_UP] = "up",
    [SLOT_BACKOFF] = "backoff",
};

struct peer;

/* One connection, outbound (in a slot) or inbound (in the inbound list). */
struct peer_conn {
  struct link link;      /* once linked; link.user points here */
  uv_poll_t cpoll;       /* outbound, while the connect is under way */
  int fd;
  struct peer *peer;     /* outbound: always; inbound: once identified */
  int slot;              /* outbound slot, -1 inbound */
  bool linked;           /* link_init ran: the link owns fd */
  bool cpoll_closing;    /* the connect's poll is being closed */
  bool up;               /* authenticated both ways, transport settled */
  bool got_hello, sent_auth, verified, acked;
  bool authed;           /* verified and acked: the transport is being settled */
  bool rdma;             /* settled on an RDMA queue pair (else TCP) */
  bool handed_off;       /* a data connection: its socket is xfer's now */
  struct rdmaxp_qp *qp;  /* the link's queue pair, offered, connecting or up */
  uint64_t authed_ms;
  struct peerauth_hs hs;
  char from[INET6_ADDRSTRLEN + 8]; /* inbound: the source address, for log lines */
  struct sockaddr_storage src;
  uint64_t opened_ms, last_rx_ms, last_tx_ms;
  uint64_t last_ping_ms;      /* our last KEEPALIVE: each side pings on its own clock, so that
                                 both measure the round trip (replies are traffic, not pings) */
  char err[DEP_MSG_TEXT_MAX]; /* why it is closing, for the slot's last error */
  struct peer_conn *next;     /* inbound list */
};

struct peer_slot {
  struct peer_conn *conn;
  enum peer_slot_state state;
  uint64_t backoff_ms; /* the next wait's base */
  uint64_t retry_at_ms;
  bool awaits_address; /* connects as soon as the peer's host resolves */
};

struct peer {
  char host[256];
  uint16_t port;
  char name[272]; /* "host:port" */
  char node[DEP_PEER_NODE_MAX];
  struct peer_slot *slots;
  struct sockaddr_storage addrs[PEER_MAX_ADDRS];
  int naddrs;
  bool resolving;
  uint64_t resolved_ms;
  uv_getaddrinfo_t gai;
  char last_error[DEP_MSG_TEXT_MAX];
  uint64_t reconnects, bytes_in, bytes_out, rtt_us;
  uint64_t rdma_rtt_us;          /* the last queue-pair keep-alive's round trip */
  enum config_transport transport; /* auto, rdma or tcp: its own or the daemon's */
  bool said_tcp;                 /* auto fell back to TCP: said once */
  uint32_t inbound_up;
  bool linked_up; /* some link up, as last told to the job table */
  char label[300]; /* "host:port (node)" */
  bool was_up; /* every slot up at the last look, for one log line per change */
};

static struct {
  uv_loop_t *loop;
  bool active;
  bool stopping;
  uint32_t pool_size;
  uint32_t wait_ms;
  char listen_address[256];
  uint16_t listen_port;
  char node[DEP_PEER_NODE_MAX];
  uint8_t key[PEERAUTH_KEY_MAX];
  size_t keylen;
  bool authenticated; /* a key is in use (else peer_insecure) */
  size_t n;
  struct peer peers[CONFIG_MAX_LIST];
  struct peer_conn *inbound;
  int listen_fd;
  uv_poll_t listen_poll;
  bool listening;
  uint64_t accept_paused_until;
  uv_timer_t tick;
  uint64_t start_ms;
  peer_ready_fn *ready_cb;
  char status[DEP_MSG_TEXT_MAX]; /* the last STATUS= sent while waiting */
  const struct peer_events *ev;
} P = {.listen_fd = -1};

static uint64_t now_ms(void) { return uv_now(P.loop); }

/* Copy src into dst[size], cut to fit (log lines and messages only). */
static void cut(char *dst, size_t size, const char *src) {
  size_t n = strnlen(src, size - 1);
  memcpy(dst, src, n);
  dst[n] = '\0';
}

/* ---- naming and sending -------------------------------------------------- */

static void peer_describe(const struct link *l, char *buf, size_t len) {
  const struct peer_conn *c = l->user;
  if (c->slot >= 0)
    snprintf(buf, len, "peer %s (connection %d)", c->peer->name, c->slot);
  else if (c->peer != NULL)
    snprintf(buf, len, "peer %s (inbound from %s)", c->peer->name, c->from);
  else
    snprintf(buf, len, "peer connection from %s", c->from);
}

static void peer_limits(const struct link *l, struct link_limits *out) {
  const struct peer_conn *c = l->user;
  out->max_body = c->up ? DEP_PROTO_MAX_BODY : PEER_PREAUTH_MAX_BODY;
  out->queue_bytes = PEER_QUEUE_BYTES;
  out->queue_key = "PEER_QUEUE_BYTES";
}

/* Send the encoded peer message in b as one PEER frame. */
static int conn_send_raw(struct peer_conn *c, const struct proto_buf *b) {
  struct dep_msg_opaque o = {.data = b->data, .len = b->len};
  int rc = link_send(&c->link, DEP_MSG_PEER, 0, &o, NULL, 0);
  if (rc == 0) {
    c->last_tx_ms = now_ms();
    if (c->peer != NULL)
      c->peer->bytes_out += DEP_PROTO_HDR_LEN + b->len;
  }
  return rc;
}

static int conn_send(struct peer_conn *c, const struct dep_peer_msg *m) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = peer_proto_encode(&b, m);
  if (rc == 0)
    rc = conn_send_raw(c, &b);
  proto_buf_free(&b);
  return rc;
}

/* Tell the far end why (best effort), remember it, log it and drop the link. */
static void conn_refuse(struct peer_conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void conn_refuse(struct peer_conn *c, int code, const char *fmt, ...) {
  struct dep_peer_msg m = {.type = DEP_PEER_ERROR};
  m.u.error.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m.u.error.message, sizeof m.u.error.message, fmt, ap);
  va_end(ap);
  snprintf(c->err, sizeof c->err, "%s", m.u.error.message);
  if (link_open(&c->link))
    (void)conn_send(c, &m);
  link_drop(&c->link, "%s", m.u.error.message);
}

static int conn_send_hello(struct peer_conn *c) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = peerauth_hello(&c->hs, P.node, P.listen_address, P.listen_port, &b);
  if (rc == 0)
    rc = conn_send_raw(c, &b);
  proto_buf_free(&b);
  return rc;
}

static int conn_send_auth(struct peer_conn *c) {
  struct dep_peer_msg m = {.type = DEP_PEER_AUTH};
  peerauth_mac(&c->hs, m.u.auth.mac);
  c->sent_auth = true;
  return conn_send(c, &m);
}

/* ---- slots: state, backoff ------------------------------------------------ */

static bool peer_all_up(const struct peer *p) {
  for (uint32_t i = 0; i < P.pool_size; i++)
    if (p->slots[i].state != SLOT_UP)
      return false;
  return true;
}

static uint32_t peer_count_up(const struct peer *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < P.pool_size; i++)
    n += p->slots[i].state == SLOT_UP;
  return n;
}

/* The peer's state: up when every slot is; else the least advanced slot's. */
static const char *peer_state(const struct peer *p) {
  enum peer_slot_state least = SLOT_UP;
  for (uint32_t i = 0; i < P.pool_size; i++) {
    enum peer_slot_state s = p->slots[i].state;
    if (s == SLOT_BACKOFF)
      return slot_state_names[SLOT_BACKOFF];
    if (s < least)
      least = s;
  }
  return slot_state_names[least];
}

static void peer_check_ready(void);

/* A slot's connection failed or was lost: wait, with jitter, then try again. */
static void slot_backoff(struct peer *p, int i, const char *why) {
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

/* ---- links: the handshake and what follows -------------------------------- */

/* The inbound connection c, from its source address and HELLO, is which peer? */
static struct peer *peer_identify(const struct peer_conn *c, uint16_t listen_port) {
  for (size_t i = 0; i < P.n; i++) {
    struct peer *p = &P.peers[i];
    if (p->port != listen_port)
      continue;
    for (int a = 0; a < p->naddrs; a++) {
      const struct sockaddr_storage *x = &p->addrs[a], *y = &c->src;
      if (x->ss_family == AF_INET && y->ss_family == AF_INET &&
          ((const struct sockaddr_in *)x)->sin_addr.s_addr ==
              ((const struct sockaddr_in *)y)->sin_addr.s_addr)
        return p;
      if (x->ss_family == AF_INET6 && y->ss_family == AF_INET6 &&
          memcmp(&((const struct sockaddr_in6 *)x)->sin6_addr,
                 &((const struct sockaddr_in6 *)y)->sin6_addr, 16) == 0)
        return p;
    }
  }
  return NULL;
}

static uint32_t peer_links_up(const struct peer *p) { return peer_count_up(p) + p->inbound_up; }

/* Tell the job table when a peer gains its first link or loses its last. */
static void peer_note_links(struct peer *p) {
  bool up = peer_links_up(p) > 0;
  if (up == p->linked_up || P.stopping)
    return;
  p->linked_up = up;
  int k = (int)(p - P.peers);
  if (up && P.ev != NULL && P.ev->up != NULL)
    P.ev->up(k);
  else if (!up && P.ev != NULL && P.ev->down != NULL)
    P.ev->down(k);
}

/* The link's transport is settled: the link is up. */
static void conn_settled(struct peer_conn *c, bool rdma, const char *why) {
  c->up = true;
  c->rdma = rdma;
  struct peer *p = c->peer;
  if (!rdma && p->transport == CONFIG_TRANSPORT_AUTO && !p->said_tcp && why != NULL) {
    log_notice("peer %s: links use TCP: %s", p->name, why);
    p->said_tcp = true;
  }
  if (c->slot >= 0) {
    struct peer_slot *s = &p->slots[c->slot];
    s->state = SLOT_UP;
    s->backoff_ms = PEER_BACKOFF_MIN_MS;
  } else {
    p->inbound_up++;
  }
  peer_note_links(p);
  if (c->slot >= 0 && peer_all_up(p) && !p->was_up) {
    p->was_up = true;
    p->last_error[0] = '\0';
    log_info("peer %s (%s): %u connection(s) up over %s%s", p->name, p->node, P.pool_size,
             rdma ? "RDMA" : "TCP", P.authenticated ? "" : ", unauthenticated (peer_insecure)");
  }
  peer_check_ready();
}

/* RDMA cannot be had on this link (why): with transport rdma the link is
 * refused (and retried), with auto it settles on TCP. */
static void conn_without_rdma(struct peer_conn *c, const char *why) {
  if (c->peer->transport == CONFIG_TRANSPORT_RDMA)
    conn_refuse(c, DEP_ERR_UNSUPPORTED, "transport: rdma, but %s", why);
  else
    conn_settled(c, false, why);
}

static void conn_send_nak(struct peer_conn *c, const char *why) {
  struct dep_peer_msg m = {.type = DEP_PEER_XPORT_NAK};
  m.u.nak.code = DEP_ERR_UNSUPPORTED;
  cut(m.u.nak.message, sizeof m.u.nak.message, why);
  (void)conn_send(c, &m);
}

/* Both ends authenticated: the accepting end offers the transport. */
static void conn_offer(struct peer_conn *c) {
  struct peer *p = c->peer;
  static struct dep_peer_msg m;
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_XPORT;
  char why[DEP_MSG_TEXT_MAX] = "transport: tcp here";
  if (p->transport != CONFIG_TRANSPORT_TCP) {
    c->qp = rdmaxp_offer(c, &m.u.xport, why, sizeof why);
    if (c->qp != NULL) {
      (void)conn_send(c, &m); /* up when the queue pair connects, or TCP on XPORT_NAK */
      return;
    }
  }
  m.u.xport.kind = DEP_PEER_XPORT_TCP;
  snprintf(m.u.xport.reason, sizeof m.u.xport.reason, "%s", why);
  if (conn_send(c, &m) != 0)
    return;
  conn_without_rdma(c, why);
}

static void conn_maybe_up(struct peer_conn *c) {
  if (!c->verified || !c->acked || c->authed)
    return;
  c->authed = true;
  c->authed_ms = now_ms();
  if (c->slot >= 0)
    c->peer->slots[c->slot].state = SLOT_TRANSPORT; /* the acceptor's XPORT comes next */
  else
    conn_offer(c);
}

/* The connecting end: the acceptor's offer. */
static void conn_on_xport(struct peer_conn *c, const struct dep_peer_xport *x) {
  if (c->slot < 0 || c->up || c->qp != NULL) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent XPORT out of turn");
    return;
  }
  struct peer *p = c->peer;
  char why[DEP_MSG_TEXT_MAX + 64];
  char reason[4 * DEP_MSG_TEXT_MAX];
  log_escape(x->reason, strlen(x->reason), reason, sizeof reason);
  if (x->kind == DEP_PEER_XPORT_TCP) {
    char r[DEP_MSG_TEXT_MAX];
    cut(r, sizeof r, reason);
    snprintf(why, sizeof why, "the peer offers TCP only (%.480s)", r);
    conn_without_rdma(c, why);
    return;
  }
  snprintf(why, sizeof why, "transport: tcp here");
  if (p->transport != CONFIG_TRANSPORT_TCP) {
    /* The RDMA connection goes where the TCP one did, from the same local address. */
    struct sockaddr_storage src, dst;
    socklen_t sl = sizeof src, dl = sizeof dst;
    if (getsockname(c->link.fd, (struct sockaddr *)&src, &sl) != 0 ||
        getpeername(c->link.fd, (struct sockaddr *)&dst, &dl) != 0) {
      snprintf(why, sizeof why, "getsockname/getpeername: %s", strerror(errno));
    } else {
      if (src.ss_family == AF_INET)
        ((struct sockaddr_in *)&src)->sin_port = 0;
      else if (src.ss_family == AF_INET6)
        ((struct sockaddr_in6 *)&src)->sin6_port = 0;
      c->qp = rdmaxp_connect(c, (struct sockaddr *)&src, (struct sockaddr *)&dst, x, why,
                             sizeof why);
      if (c->qp != NULL)
        return; /* up when it connects, or down */
    }
  }
  conn_send_nak(c, why);
  conn_without_rdma(c, why);
}

/* The accepting end: the connecting end will not or could not use RDMA. */
static void conn_on_xport_nak(struct peer_conn *c, const struct dep_peer_error *nak) {
  if (c->slot >= 0 || !c->authed) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent XPORT_NAK out of turn");
    return;
  }
  if (c->up)
    return; /* its queue pair failed here first: settled on TCP already */
  rdmaxp_close(c->qp);
  c->qp = NULL;
  char msg[4 * DEP_MSG_TEXT_MAX], why[sizeof msg + 16];
  log_escape(nak->message, strlen(nak->message), msg, sizeof msg);
  snprintf(why, sizeof why, "the peer: %s", msg);
  conn_without_rdma(c, why);
}

/* ---- the RDMA transport's events (rdmaxp.h): owner is the link ----------- */

static void conn_on_qp_up(void *owner, struct rdmaxp_qp *q) {
  struct peer_conn *c = owner;
  if (!c->up)
    conn_settled(c, true, NULL);
}

static void conn_on_qp_down(void *owner, const char *why) {
  struct peer_conn *c = owner;
  c->qp = NULL;
  if (!link_open(&c->link))
    return;
  if (c->up && c->rdma) {
    snprintf(c->err, sizeof c->err, "its RDMA queue pair: %s", why);
    link_drop(&c->link, "%s", c->err);
    return;
  }
  if (c->up)
    return;
  char w[DEP_MSG_TEXT_MAX];
  snprintf(w, sizeof w, "RDMA connection: %s", why);
  if (c->slot >= 0)
    conn_send_nak(c, w);
  conn_without_rdma(c, w);
}

static void conn_on_qp_pong(void *owner, uint64_t rtt_us) {
  struct peer_conn *c = owner;
  if (c->peer != NULL)
    c->peer->rdma_rtt_us = rtt_us;
}

static const struct rdmaxp_events peer_rdma_events = {
    .up = conn_on_qp_up,
    .down = conn_on_qp_down,
    .pong = conn_on_qp_pong,
};

/*
 * The accepting end, its RDMA offer taken (rdma_accept called): whether a
 * frame past the handshake proves the queue pair up before our own
 * ESTABLISHED event says so.  The connecting end sends such frames only
 * once its queue pair is connected, and its ESTABLISHED comes first: ours
 * waits for its RTU, then for the loop to read the connection manager's
 * channel, which it may do after the link's socket (under load it did, and
 * the DATA_OFFERs that followed were refused, leaving the far end without
 * data connections).  rdma_accept moved our queue pair to RTS already.
 */
static bool conn_far_settled(const struct peer_conn *c) {
  return c->slot < 0 && c->authed && c->qp != NULL && rdmaxp_qp_accepted(c->qp);
}

static void conn_on_hello(struct peer_conn *c, const struct dep_peer_msg *m, const uint8_t *raw,
                          size_t len) {
  if (c->got_hello) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent a second HELLO");
    return;
  }
  c->got_hello = true;
  const struct dep_peer_hello *h = &m->u.hello;
  char node[4 * DEP_PEER_NODE_MAX];
  log_escape(h->node, strlen(h->node), node, sizeof node);
  if (h->version != DEP_PEER_VERSION) {
    conn_refuse(c, DEP_ERR_VERSION, "speaks peer protocol version %u, this deepepd speaks %u",
                (unsigned)h->version, (unsigned)DEP_PEER_VERSION);
    return;
  }
  if (c->slot < 0) {
    c->peer = peer_identify(c, h->listen_port);
    if (c->peer == NULL) {
      conn_refuse(c, DEP_ERR_PERMISSION,
                  "%s (node \"%s\", listen port %u) is not in this daemon's peers: refused",
                  c->from, node, (unsigned)h->listen_port);
      return;
    }
  }
  cut(c->peer->node, sizeof c->peer->node, node);
  peerauth_take(&c->hs, raw, len);
  /* The acceptor answers with its own HELLO only now that it knows the caller. */
  if (c->slot < 0 && conn_send_hello(c) != 0)
    return;
  (void)conn_send_auth(c);
}

/*
 * An inbound connection whose first frame is DATA_HELLO: a peer opening a
 * data connection with a token we offered it (xfer.h).  Identified as a
 * HELLO is (source address and listen port); the socket goes to xfer, and
 * the link closes without touching it, having read nothing past the frame.
 */
static void conn_on_data_hello(struct peer_conn *c, const struct dep_peer_data_hello *h) {
  if (c->slot >= 0 || c->got_hello) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent DATA_HELLO on a link that is not a new inbound one");
    return;
  }
  struct peer *p = peer_identify(c, h->listen_port);
  if (p == NULL) {
    conn_refuse(c, DEP_ERR_PERMISSION, "%s (listen port %u) is not in this daemon's peers: its "
                "data connection is refused", c->from, (unsigned)h->listen_port);
    return;
  }
  int fd = dup(c->link.fd);
  if (fd < 0) {
    conn_refuse(c, DEP_ERR_INTERNAL, "cannot take the data connection: %s", strerror(errno));
    return;
  }
  if (!xfer_accept((int)(p - P.peers), h->token, fd)) {
    close(fd);
    conn_refuse(c, DEP_ERR_PERMISSION, "opened a data connection with a token this daemon did "
                "not offer it (or used it already)");
    return;
  }
  c->handed_off = true;
  link_close(&c->link, "handed to the data path");
}

static void conn_on_auth(struct peer_conn *c, const struct dep_peer_msg *m) {
  if (!c->got_hello || !c->sent_auth || c->verified) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent AUTH out of turn");
    return;
  }
  if (!peerauth_check(&c->hs, m->u.auth.mac)) {
    conn_refuse(c, DEP_ERR_PERMISSION,
                "authentication failed: a different peer_key_file, or a replayed or reflected "
                "answer");
    return;
  }
  c->verified = true;
  if (conn_send(c, &(struct dep_peer_msg){.type = DEP_PEER_AUTH_OK}) != 0)
    return;
  conn_maybe_up(c);
}

static void peer_on_frame(struct link *l, const struct dep_frame_hdr *h, const uint8_t *body,
                          size_t len, int *fds, int nfds) {
  struct peer_conn *c = l->user;
  c->last_rx_ms = now_ms();
  if (c->peer != NULL)
    c->peer->bytes_in += DEP_PROTO_HDR_LEN + len;
  if (h->type != DEP_MSG_PEER) {
    conn_refuse(c, DEP_ERR_PROTOCOL, "sent a %s frame on a peer link", proto_type_name(h->type));
    return;
  }
  struct dep_peer_msg m;
  char why[256];
  int rc = peer_proto_decode(body, len, &m, why, sizeof why);
  if (rc == DEP_ERR_UNSUPPORTED && c->up) {
    /* A newer peer may probe: say so and keep the link (peer_proto.h). */
    struct dep_peer_msg e = {.type = DEP_PEER_ERROR};
    e.u.error.code = DEP_ERR_UNSUPPORTED;
    snprintf(e.u.error.message, sizeof e.u.error.message, "%s", why);
    (void)conn_send(c, &e);
    return;
  }
  if (rc != 0) {
    conn_refuse(c, rc, "%s", why);
    return;
  }
  if (m.type == DEP_PEER_DATA_HELLO) {
    conn_on_data_hello(c, &m.u.data_hello);
    return;
  }
  bool handshake = m.type == DEP_PEER_HELLO || m.type == DEP_PEER_AUTH ||
                   m.type == DEP_PEER_AUTH_OK || m.type == DEP_PEER_ERROR ||
                   (c->authed && (m.type == DEP_PEER_XPORT || m.type == DEP_PEER_XPORT_NAK));
  if (!c->up && !handshake && conn_far_settled(c))
    conn_settled(c, true, NULL);
  if (!c->up && !handshake) {
    conn_refuse(c, DEP_ERR_STATE, "sent %s before authenticating", peer_proto_type_name(m.type));
    return;
  }
  switch (m.type) {
  case DEP_PEER_HELLO:
    conn_on_hello(c, &m, body, len);
    break;
  case DEP_PEER_AUTH:
    conn_on_auth(c, &m);
    break;
  case DEP_PEER_AUTH_OK:
    if (!c->sent_auth || c->acked) {
      conn_refuse(c, DEP_ERR_PROTOCOL, "sent AUTH_OK out of turn");
      return;
    }
    c->acked = true;
    conn_maybe_up(c);
    break;
  case DEP_PEER_ERROR: {
    char msg[4 * DEP_MSG_TEXT_MAX], err[sizeof msg + 32];
    log_escape(m.u.error.message, strlen(m.u.error.message), msg, sizeof msg);
    snprintf(err, sizeof err, "refused by the peer: %s", msg);
    cut(c->err, sizeof c->err, err);
    if (!c->up)
      link_drop(l, "%s", c->err);
    else
      log_warnx("peer %s: says: %s", c->peer->name, msg);
    break;
  }
  case DEP_PEER_KEEPALIVE:
    if (m.u.keepalive.reply == 0) {
      m.u.keepalive.reply = 1;
      (void)conn_send(c, &m);
    } else {
      uint64_t now_us = uv_hrtime() / 1000u;
      if (now_us >= m.u.keepalive.stamp)
        c->peer->rtt_us = now_us - m.u.keepalive.stamp;
    }
    break;
  case DEP_PEER_XPORT:
    conn_on_xport(c, &m.u.xport);
    break;
  case DEP_PEER_XPORT_NAK:
    conn_on_xport_nak(c, &m.u.nak);
    break;
  case DEP_PEER_DATA_OFFER:
    xfer_on_offer((int)(c->peer - P.peers), &m.u.data_offer);
    break;
  case DEP_PEER_DATA_HELLO: /* handled above */
    break;
  case DEP_PEER_MEMBERSHIP:
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END:
    if (P.ev != NULL && P.ev->job_msg != NULL)
      P.ev->job_msg((int)(c->peer - P.peers), &m);
    break;
  case DEP_PEER_CLOSE: {
    char msg[4 * DEP_MSG_TEXT_MAX], err[sizeof msg + 32];
    log_escape(m.u.error.message, strlen(m.u.error.message), msg, sizeof msg);
    snprintf(err, sizeof err, "closed by the peer: %s", msg);
    cut(c->err, sizeof c->err, err);
    link_close(l, c->err);
    break;
  }
  }
}

static void peer_on_closing(struct link *l) {
  struct peer_conn *c = l->user;
  if (P.stopping)
    return; /* rdmaxp_fini closes the queue pairs */
  rdmaxp_close(c->qp);
  c->qp = NULL;
  if (c->slot >= 0) {
    slot_backoff(c->peer, c->slot,
                 c->err[0] ? c->err : c->up ? "connection lost" : "closed during the handshake");
    peer_note_links(c->peer);
    return;
  }
  for (struct peer_conn **pp = &P.inbound; *pp != NULL; pp = &(*pp)->next) {
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  }
  if (c->up && c->peer != NULL) {
    c->peer->inbound_up--;
    peer_note_links(c->peer);
  }
}

static void peer_on_close(struct link *l) {
  struct peer_conn *c = l->user;
  free(c);
}

static const struct link_ops peer_link_ops = {
    .kind = "peers",
    .sends_fds = false,
    .takes_fds = false,
    .limits = peer_limits,
    .describe = peer_describe,
    .on_frame = peer_on_frame,
    .on_closing = peer_on_closing,
    .on_close = peer_on_close,
};

/* ---- outbound: resolve, connect, hand to a link --------------------------- */

static void slot_connect(struct peer *p, int i);

static void peer_on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
  struct peer *p = req->data;
  p->resolving = false;
  if (P.stopping) {
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
  for (uint32_t i = 0; p->naddrs > 0 && i < P.pool_size; i++)
    if (p->slots[i].state == SLOT_BACKOFF && p->slots[i].awaits_address)
      slot_connect(p, (int)i);
}

static void peer_resolve(struct peer *p) {
  if (p->resolving)
    return;
  char port[8];
  snprintf(port, sizeof port, "%u", (unsigned)p->port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  p->gai.data = p;
  int rc = uv_getaddrinfo(P.loop, &p->gai, peer_on_resolved, p->host, port, &hints);
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
  if (P.stopping) {
    close(c->fd);
    free(c);
    return;
  }
  if (link_init(&c->link, P.loop, c->fd, &peer_link_ops, c) != 0) {
    close(c->fd);
    int i = c->slot;
    free(c);
    slot_backoff(p, i, "cannot watch the socket");
    return;
  }
  c->linked = true;
  p->slots[c->slot].state = SLOT_AUTHENTICATING;
  c->last_rx_ms = now_ms();
  (void)conn_send_hello(c);
}

/* The connect ended (or timed out: why set): go on to the link, or back off. */
static void conn_connect_done(struct peer_conn *c, const char *why) {
  if (c->cpoll_closing)
    return;
  c->cpoll_closing = true;
  uv_poll_stop(&c->cpoll);
  if (why != NULL) {
    struct peer *p = c->peer;
    int i = c->slot;
    uv_close((uv_handle_t *)&c->cpoll, conn_on_cpoll_failed);
    slot_backoff(p, i, why);
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
  conn_connect_done(c, err != 0 ? why : NULL);
}

static void slot_connect(struct peer *p, int i) {
  struct peer_slot *s = &p->slots[i];
  if (p->naddrs == 0) {
    /* Not resolved yet (or it failed): ask again; connect when the answer
     * comes, or at a later tick if it does not. */
    peer_resolve(p);
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
    slot_backoff(p, i, why);
    return;
  }
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  socklen_t alen = a->ss_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
  if (connect(fd, (const struct sockaddr *)a, alen) != 0 && errno != EINPROGRESS) {
    snprintf(why, sizeof why, "connect to %s: %s", p->name, strerror(errno));
    close(fd);
    slot_backoff(p, i, why);
    return;
  }
  struct peer_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    close(fd);
    slot_backoff(p, i, "out of memory");
    return;
  }
  c->fd = fd;
  c->peer = p;
  c->slot = i;
  c->hs.connector = true;
  c->hs.key = P.key;
  c->hs.keylen = P.keylen;
  c->opened_ms = now_ms();
  if (uv_poll_init(P.loop, &c->cpoll, fd) != 0) {
    close(fd);
    free(c);
    slot_backoff(p, i, "cannot watch the socket");
    return;
  }
  c->cpoll.data = c;
  uv_poll_start(&c->cpoll, UV_WRITABLE, conn_on_cpoll);
  s->conn = c;
  s->state = SLOT_CONNECTING;
}

/* ---- inbound -------------------------------------------------------------- */

static void peer_on_accept(uv_poll_t *h, int status, int events) {
  for (int n = 0; n < PEER_ACCEPT_BUDGET; n++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(P.listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
        return;
      log_warn("peers: accept: pausing the listener for %d ms", PEER_ACCEPT_PAUSE_MS);
      uv_poll_stop(&P.listen_poll);
      P.accept_paused_until = now_ms() + PEER_ACCEPT_PAUSE_MS;
      return;
    }
    uint32_t pending = 0;
    for (const struct peer_conn *q = P.inbound; q != NULL; q = q->next)
      pending += !q->up;
    static bool flood_logged; /* once per flood, not per refused connection */
    if (pending >= PEER_PREAUTH_MAX) {
      if (!flood_logged)
        log_warnx("peers: %u inbound connections are still authenticating; refusing more "
                  "until they finish (a flood on the peer port?)", pending);
      flood_logged = true;
      close(fd);
      continue;
    }
    flood_logged = false;
    struct peer_conn *c = calloc(1, sizeof *c);
    if (c == NULL) {
      close(fd);
      continue;
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->slot = -1;
    c->src = ss;
    /* An IPv4 caller on a dual-stack socket: compare it as IPv4. */
    if (ss.ss_family == AF_INET6) {
      struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
      if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) {
        struct sockaddr_in s4 = {.sin_family = AF_INET, .sin_port = s6->sin6_port};
        memcpy(&s4.sin_addr, s6->sin6_addr.s6_addr + 12, 4);
        memset(&c->src, 0, sizeof c->src);
        memcpy(&c->src, &s4, sizeof s4);
      }
    }
    char host[INET6_ADDRSTRLEN] = "?", serv[8] = "?";
    (void)getnameinfo((struct sockaddr *)&c->src, sizeof c->src, host, sizeof host, serv,
                      sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->from, sizeof c->from, "%s:%s", host, serv);
    c->hs.connector = false;
    c->hs.key = P.key;
    c->hs.keylen = P.keylen;
    c->opened_ms = c->last_rx_ms = now_ms();
    if (link_init(&c->link, P.loop, fd, &peer_link_ops, c) != 0) {
      close(fd);
      free(c);
      continue;
    }
    c->linked = true;
    c->next = P.inbound;
    P.inbound = c;
  }
}

static int peer_listen(void) {
  char port[8];
  snprintf(port, sizeof port, "%u", (unsigned)P.listen_port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE};
  struct addrinfo *res = NULL;
  int rc = getaddrinfo(P.listen_address, port, &hints, &res);
  if (rc != 0) {
    log_errx("listen.address %s: %s", P.listen_address, gai_strerror(rc));
    return -1;
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 128) != 0) {
    log_warn("peers: cannot listen on %s port %u", P.listen_address, (unsigned)P.listen_port);
    if (fd >= 0)
      close(fd);
    freeaddrinfo(res);
    return -1;
  }
  freeaddrinfo(res);
  P.listen_fd = fd;
  if (uv_poll_init(P.loop, &P.listen_poll, fd) != 0) {
    close(fd);
    P.listen_fd = -1;
    return -1;
  }
  uv_poll_start(&P.listen_poll, UV_READABLE, peer_on_accept);
  P.listening = true;
  log_info("peers: listening on %s port %u", P.listen_address, (unsigned)P.listen_port);
  return 0;
}

/* ---- the tick: retries, keep-alives, timeouts, readiness ------------------ */

/* Keep-alive and the timeouts of one linked connection. */
static void conn_tick(struct peer_conn *c, uint64_t now) {
  if (!link_open(&c->link))
    return;
  if (!c->up) {
    if (!c->authed && now - c->opened_ms > PEER_HANDSHAKE_MS) {
      snprintf(c->err, sizeof c->err, "did not authenticate within %d ms", PEER_HANDSHAKE_MS);
      link_drop(&c->link, "%s", c->err);
    } else if (c->authed && now - c->authed_ms > PEER_TRANSPORT_MS) {
      snprintf(c->err, sizeof c->err, "its transport was not settled within %d ms (%s)",
               PEER_TRANSPORT_MS, c->qp != NULL ? "the RDMA connection did not complete"
                                                : "no XPORT came");
      link_drop(&c->link, "%s", c->err);
    }
    return;
  }
  if (now - c->last_rx_ms > PEER_DEAD_MS) {
    snprintf(c->err, sizeof c->err, "nothing received for %d ms: dead peer", PEER_DEAD_MS);
    link_drop(&c->link, "%s", c->err);
    return;
  }
  if (now - c->last_ping_ms >= PEER_KEEPALIVE_MS) {
    if (c->qp != NULL && rdmaxp_ping(c->qp, now) > PEER_DEAD_MS) {
      snprintf(c->err, sizeof c->err, "its RDMA queue pair answered no keep-alive for %d ms",
               PEER_DEAD_MS);
      link_drop(&c->link, "%s", c->err);
      return;
    }
    struct dep_peer_msg m = {.type = DEP_PEER_KEEPALIVE};
    m.u.keepalive.stamp = uv_hrtime() / 1000u;
    c->last_ping_ms = now;
    (void)conn_send(c, &m);
  }
}

/* "a:1 (backoff: ...), b:2 (connecting)" for the peers not up; "" when all are. */
static void peer_missing(char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < P.n && used < len; i++) {
    const struct peer *p = &P.peers[i];
    if (peer_all_up(p))
      continue;
    int k = snprintf(buf + used, len - used, "%s%s (%s%s%s)", used ? ", " : "", p->name,
                     peer_state(p), p->last_error[0] ? ": " : "", p->last_error);
    if (k < 0)
      break;
    used += (size_t)k;
  }
}

static void peer_check_ready(void) {
  if (P.ready_cb == NULL)
    return;
  char missing[DEP_MSG_TEXT_MAX];
  peer_missing(missing, sizeof missing);
  bool late = now_ms() - P.start_ms >= P.wait_ms;
  if (missing[0] != '\0' && !late) {
    if (strcmp(missing, P.status) != 0) {
      snprintf(P.status, sizeof P.status, "%s", missing);
      notify_send("STATUS=waiting for peers: %s", missing);
    }
    return;
  }
  peer_ready_fn *cb = P.ready_cb;
  P.ready_cb = NULL;
  if (missing[0] != '\0')
    log_warnx("peers: not up after peer_wait_ms %u: %s; ready without them, still trying",
              (unsigned)P.wait_ms, missing);
  cb(missing[0] != '\0' ? missing : NULL);
}

static void peer_on_tick(uv_timer_t *t) {
  uint64_t now = now_ms();
  if (P.accept_paused_until != 0 && now >= P.accept_paused_until) {
    P.accept_paused_until = 0;
    uv_poll_start(&P.listen_poll, UV_READABLE, peer_on_accept);
  }
  for (size_t k = 0; k < P.n; k++) {
    struct peer *p = &P.peers[k];
    for (uint32_t i = 0; i < P.pool_size; i++) {
      struct peer_slot *s = &p->slots[i];
      if (s->state == SLOT_BACKOFF && now >= s->retry_at_ms) {
        slot_connect(p, (int)i);
      } else if (s->state == SLOT_CONNECTING && s->conn != NULL && !s->conn->linked &&
                 now - s->conn->opened_ms > PEER_HANDSHAKE_MS) {
        char why[DEP_MSG_TEXT_MAX];
        snprintf(why, sizeof why, "connect to %s: no answer within %d ms", p->name,
                 PEER_HANDSHAKE_MS);
        conn_connect_done(s->conn, why);
      } else if (s->conn != NULL && s->conn->linked) {
        conn_tick(s->conn, now);
      }
    }
  }
  for (struct peer_conn *c = P.inbound, *next; c != NULL; c = next) {
    next = c->next; /* conn_tick may drop c, which takes it out of the list */
    conn_tick(c, now);
  }
  peer_check_ready();
}

/* ---- init, fini, queries -------------------------------------------------- */

int peer_init(uv_loop_t *loop, const struct config *cfg) {
  P.loop = loop;
  P.pool_size = cfg->connection_pool_size;
  P.wait_ms = cfg->peer_wait_ms;
  P.listen_port = cfg->listen_port;
  snprintf(P.listen_address, sizeof P.listen_address, "%s", cfg->listen_address);
  P.start_ms = uv_now(loop);
  if (gethostname(P.node, sizeof P.node) != 0)
    snprintf(P.node, sizeof P.node, "unknown");
  P.node[sizeof P.node - 1] = '\0';
  if (sodium_init() < 0) {
    log_errx("peers: libsodium failed to initialise");
    return -1;
  }
  bool wanted = cfg->n_peers > 0 || cfg->listen_address[0] != '\0';
  if (cfg->peer_key_file[0] != '\0') {
    char why[DEP_MSG_TEXT_MAX + 256];
    if (peerauth_key_load(cfg->peer_key_file, P.key, sizeof P.key, &P.keylen, why, sizeof why) !=
        0) {
      log_errx("%s", why);
      return -1;
    }
    P.authenticated = true;
    if (cfg->peer_insecure)
      log_notice("peers: peer_insecure is ignored: peer_key_file %s is in use",
                 cfg->peer_key_file);
  } else if (wanted && !cfg->peer_insecure) {
    log_errx("peers: %s set but no peer_key_file: peers could not authenticate; write a key "
             "(deepepctl genkey /etc/deepepd/peer.key) and set peer_key_file on every node, or, "
             "for tests on one machine only, set peer_insecure: true",
             cfg->n_peers > 0 ? "peers are" : "listen.address is");
    return -1;
  } else if (wanted) {
    log_warnx("peers: peer_insecure: peer connections are NOT authenticated (tests only)");
  }
  if (!wanted)
    return 0;
  if (rdmaxp_init(loop, cfg, &peer_rdma_events) != 0)
    return -1;
  P.active = true;
  if (P.listen_address[0] != '\0' && peer_listen() != 0)
    return -1;
  P.n = cfg->n_peers;
  for (size_t k = 0; k < P.n; k++) {
    struct peer *p = &P.peers[k];
    memset(p, 0, sizeof *p);
    snprintf(p->host, sizeof p->host, "%s", cfg->peers[k].host);
    p->port = cfg->peers[k].port;
    p->transport = config_peer_transport(cfg, &cfg->peers[k]);
    snprintf(p->name, sizeof p->name, "%s:%u", p->host, (unsigned)p->port);
    p->slots = calloc(P.pool_size, sizeof *p->slots);
    if (p->slots == NULL) {
      log_errx("peers: out of memory");
      return -1;
    }
    for (uint32_t i = 0; i < P.pool_size; i++) {
      p->slots[i].state = SLOT_BACKOFF; /* due at once: the first tick connects */
      p->slots[i].backoff_ms = PEER_BACKOFF_MIN_MS;
      p->slots[i].retry_at_ms = 0;
      p->slots[i].awaits_address = true; /* the first connects follow the resolution */
    }
    peer_resolve(p);
  }
  uv_timer_init(loop, &P.tick);
  uv_timer_start(&P.tick, peer_on_tick, PEER_TICK_MS, PEER_TICK_MS);
  if (P.n > 0)
    log_info("peers: connecting to %zu peer(s), %u connection(s) each", P.n,
             (unsigned)P.pool_size);
  return 0;
}

static void peer_on_listen_closed(uv_handle_t *h) {
  close(P.listen_fd);
  P.listen_fd = -1;
}

static void conn_close_for_stop(struct peer_conn *c) {
  if (!c->linked) {
    if (!c->cpoll_closing) { /* else its close callback sees P.stopping */
      c->cpoll_closing = true;
      uv_poll_stop(&c->cpoll);
      uv_close((uv_handle_t *)&c->cpoll, conn_on_cpoll_failed);
    }
    return;
  }
  if (c->up) {
    struct dep_peer_msg m = {.type = DEP_PEER_CLOSE};
    snprintf(m.u.error.message, sizeof m.u.error.message, "deepepd on %s is stopping", P.node);
    (void)conn_send(c, &m);
  }
  link_close(&c->link, "deepepd is stopping");
}

void peer_fini(void) {
  if (!P.active)
    return;
  P.stopping = true;
  P.active = false;
  uv_close((uv_handle_t *)&P.tick, NULL);
  if (P.listening) {
    P.listening = false;
    uv_poll_stop(&P.listen_poll);
    uv_close((uv_handle_t *)&P.listen_poll, peer_on_listen_closed);
  }
  for (size_t k = 0; k < P.n; k++) {
    struct peer *p = &P.peers[k];
    if (p->resolving)
      (void)uv_cancel((uv_req_t *)&p->gai);
    for (uint32_t i = 0; i < P.pool_size; i++) {
      if (p->slots[i].conn != NULL)
        conn_close_for_stop(p->slots[i].conn);
      p->slots[i].conn = NULL;
    }
  }
  while (P.inbound != NULL) {
    struct peer_conn *c = P.inbound;
    P.inbound = c->next;
    conn_close_for_stop(c);
  }
  /* The slots are freed now: every callback still to come sees P.stopping. */
  for (size_t k = 0; k < P.n; k++) {
    free(P.peers[k].slots);
    P.peers[k].slots = NULL;
  }
  rdmaxp_fini();
  sodium_memzero(P.key, sizeof P.key);
  P.ready_cb = NULL;
}

void peer_wait(peer_ready_fn *done) {
  P.ready_cb = done;
  P.status[0] = '\0';
  if (!P.active || P.n == 0 || P.wait_ms == 0) {
    P.ready_cb = NULL;
    done(NULL);
    return;
  }
  peer_check_ready();
}

void peer_set_events(const struct peer_events *ev) { P.ev = ev; }

int peer_count(void) { return P.active ? (int)P.n : 0; }

bool peer_is_up(int k) {
  return P.active && k >= 0 && (size_t)k < P.n && peer_links_up(&P.peers[k]) > 0;
}

int peer_data_address(int k, struct sockaddr_storage *out, socklen_t *len) {
  if (k < 0 || (size_t)k >= P.n || P.peers[k].naddrs == 0)
    return -1;
  const struct peer *p = &P.peers[k];
  *out = p->addrs[0];
  if (out->ss_family == AF_INET) {
    ((struct sockaddr_in *)out)->sin_port = htons(p->port);
    *len = sizeof(struct sockaddr_in);
  } else {
    ((struct sockaddr_in6 *)out)->sin6_port = htons(p->port);
    *len = sizeof(struct sockaddr_in6);
  }
  return 0;
}

const char *peer_name(int k) {
  if (k < 0 || (size_t)k >= P.n)
    return "?";
  struct peer *p = &P.peers[k];
  char tmp[sizeof p->label];
  if (p->node[0] != '\0')
    snprintf(tmp, sizeof tmp, "%s (%s)", p->name, p->node);
  else
    snprintf(tmp, sizeof tmp, "%s", p->name);
  memcpy(p->label, tmp, sizeof tmp);
  return p->label;
}

int peer_send(int k, const struct dep_peer_msg *m) {
  if (!peer_is_up(k))
    return DEP_ERR_STATE;
  struct peer *p = &P.peers[k];
  /* The first outbound link that is up, else an inbound one: one link per
   * peer while it lasts, so that a job's messages keep their order. */
  for (uint32_t i = 0; i < P.pool_size; i++) {
    struct peer_conn *c = p->slots[i].conn;
    if (p->slots[i].state == SLOT_UP && c != NULL && link_open(&c->link))
      return conn_send(c, m) == 0 ? 0 : DEP_ERR_STATE;
  }
  for (struct peer_conn *c = P.inbound; c != NULL; c = c->next)
    if (c->up && c->peer == p && link_open(&c->link))
      return conn_send(c, m) == 0 ? 0 : DEP_ERR_STATE;
  return DEP_ERR_STATE;
}

int peer_fill(struct dep_msg_peers *m) {
  memset(m, 0, sizeof *m);
  snprintf(m->node, sizeof m->node, "%s", P.node);
  if (P.listening)
    snprintf(m->listen, sizeof m->listen, "%s:%u", P.listen_address, (unsigned)P.listen_port);
  m->auth = P.authenticated ? 1 : 0;
  if (rdmaxp_active())
    snprintf(m->rdma, sizeof m->rdma, "%s", rdmaxp_device());
  else if (P.active)
    snprintf(m->rdma, sizeof m->rdma, "none: %s", rdmaxp_why());
  for (size_t i = 0; i < devices_count(); i++)
    m->nic_bytes += devices_at(i)->nic_bytes;
  xfer_proxy_stats(&m->proxy_threads, &m->proxy_busy_us);
  if (P.n == 0 || P.stopping)
    return 0;
  m->peers = calloc(P.n, sizeof *m->peers);
  if (m->peers == NULL)
    return DEP_ERR_NO_MEMORY;
  m->n_peers = (uint32_t)P.n;
  uint64_t now = now_ms();
  for (size_t k = 0; k < P.n; k++) {
    const struct peer *p = &P.peers[k];
    struct dep_msg_peer_info *q = &m->peers[k];
    snprintf(q->address, sizeof q->address, "%s", p->name);
    snprintf(q->node, sizeof q->node, "%s", p->node);
    snprintf(q->state, sizeof q->state, "%s", peer_state(p));
    uint32_t on_rdma = 0, on_tcp = 0;
    for (uint32_t i = 0; i < P.pool_size; i++) {
      const struct peer_conn *c = p->slots[i].conn;
      if (p->slots[i].state == SLOT_UP && c != NULL) {
        on_rdma += c->rdma;
        on_tcp += !c->rdma;
      }
    }
    snprintf(q->transport, sizeof q->transport, "%s",
             on_rdma && on_tcp ? "mixed" : on_rdma ? "rdma" : on_tcp ? "tcp" : "");
    snprintf(q->wanted, sizeof q->wanted, "%s", config_transport_name(p->transport));
    q->qps_up = on_rdma;
    q->rdma_rtt_us = p->rdma_rtt_us;
    struct xfer_peer_stats xs;
    xfer_peer_stats((int)k, &xs);
    q->data_out = xs.conns_out;
    q->data_in = xs.conns_in;
    q->data_bytes_out = xs.bytes_out;
    q->data_bytes_in = xs.bytes_in;
    q->data_frames_out = xs.frames_out;
    q->data_frames_in = xs.frames_in;
    snprintf(q->last_error, sizeof q->last_error, "%s", p->last_error);
    q->conns_up = peer_count_up(p);
    q->conns_total = P.pool_size;
    q->inbound_up = p->inbound_up;
    q->reconnects = p->reconnects;
    q->bytes_in = p->bytes_in;
    q->bytes_out = p->bytes_out;
    q->rtt_us = p->rtt_us;
    /* The longest wait of a slot in backoff: when the peer is tried next at the latest. */
    for (uint32_t i = 0; i < P.pool_size; i++) {
      const struct peer_slot *s = &p->slots[i];
      if (s->state == SLOT_BACKOFF && s->retry_at_ms > now && s->retry_at_ms - now > q->backoff_ms)
        q->backoff_ms = s->retry_at_ms - now;
    }
  }
  return 0;
}
