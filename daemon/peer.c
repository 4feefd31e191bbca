/*
 * peer.c — the peer daemons (peer.h): the links, once open — running the
 * handshake (its logic is peerauth.c) and handling their frames — the wait
 * for readiness, and the layer's start, stop and queries, all on the loop
 * thread.  Opening links is peerconn.c's, settling their transport
 * peerxport.c's, the clock (keep-alives, timeouts, retries, the loop's
 * stalls) peer_tick.c's (peer_internal.h).
 *
 * Each configured peer has connection_pool_size outbound slots.  A slot
 * is connecting (a non-blocking connect watched with its own uv_poll),
 * authenticating (a link, the handshake under way), settling its
 * transport, up, or in backoff (waiting to try again, with the last
 * error).  Inbound connections are links too; they count for the peer
 * they prove to be once authenticated.  One timer (peer_tick.c) drives
 * retries, keep-alives and the timeouts.
 */
#include "peer.h"

#include <errno.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "devices.h"
#include "link.h"
#include "log.h"
#include "notify.h"
#include "peer_internal.h"
#include "peerauth.h"
#include "rdmaxp.h"

/* Before a link has authenticated its frames are small: a HELLO at most. */
#define PEER_PREAUTH_MAX_BODY 1024u
#define PEER_QUEUE_BYTES (4u * 1024u * 1024u)

static const char *const slot_state_names[] = {
    [SLOT_CONNECTING] = "connecting",
    [SLOT_AUTHENTICATING] = "authenticating",
    [SLOT_TRANSPORT] = "transport",
    [SLOT_UP] = "up",
    [SLOT_BACKOFF] = "backoff",
};

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

int peer__send(struct peer_conn *c, const struct dep_peer_msg *m) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = peer_proto_encode(&b, m);
  if (rc == 0)
    rc = conn_send_raw(c, &b);
  proto_buf_free(&b);
  return rc;
}

/* Tell the far end why (best effort), remember it, log it and drop the link. */
void peer__refuse(struct peer_conn *c, int code, const char *fmt, ...) {
  struct dep_peer_msg m = {.type = DEP_PEER_ERROR};
  m.u.error.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m.u.error.message, sizeof m.u.error.message, fmt, ap);
  va_end(ap);
  snprintf(c->err, sizeof c->err, "%s", m.u.error.message);
  if (link_open(&c->link))
    (void)peer__send(c, &m);
  link_drop(&c->link, "%s", m.u.error.message);
}

int peer__send_hello(struct peer_conn *c) {
  struct proto_buf b;
  proto_buf_init(&b);
  int rc = peerauth_hello(&c->hs, P->node, P->listen_address, P->listen_port, &b);
  if (rc == 0)
    rc = conn_send_raw(c, &b);
  proto_buf_free(&b);
  return rc;
}

static int conn_send_auth(struct peer_conn *c) {
  struct dep_peer_msg m = {.type = DEP_PEER_AUTH};
  peerauth_mac(&c->hs, m.u.auth.mac);
  c->sent_auth = true;
  return peer__send(c, &m);
}
/* ---- slots: state -------------------------------------------------------- */

bool peer__all_up(const struct peer *p) {
  for (uint32_t i = 0; i < P->pool_size; i++)
    if (p->slots[i].state != SLOT_UP)
      return false;
  return true;
}

static uint32_t peer_count_up(const struct peer *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < P->pool_size; i++)
    n += p->slots[i].state == SLOT_UP;
  return n;
}

/* The peer's state: up when every slot is; else the least advanced slot's. */
static const char *peer_state(const struct peer *p) {
  enum peer_slot_state least = SLOT_UP;
  for (uint32_t i = 0; i < P->pool_size; i++) {
    enum peer_slot_state s = p->slots[i].state;
    if (s == SLOT_BACKOFF)
      return slot_state_names[SLOT_BACKOFF];
    if (s < least)
      least = s;
  }
  return slot_state_names[least];
}
/* ---- links: the handshake and what follows ------------------------------- */

/* The inbound connection c, from its source address and HELLO, is which peer? */
static struct peer *peer_identify(const struct peer_conn *c, uint16_t listen_port) {
  for (size_t i = 0; i < P->n; i++) {
    struct peer *p = &P->peers[i];
    if (p->port != listen_port)
      continue;
    for (int a = 0; a < p->naddrs; a++)
      if (peerconn_same_address(&p->addrs[a], &c->src))
        return p;
  }
  return NULL;
}

static uint32_t peer_links_up(const struct peer *p) { return peer_count_up(p) + p->inbound_up; }

/* Tell the data path and the job table when a peer gains its first link or
 * loses its last: the data path first when it comes up, last when it goes. */
void peer__note_links(struct peer *p) {
  bool up = peer_links_up(p) > 0;
  if (up == p->linked_up || P->stopping)
    return;
  p->linked_up = up;
  int k = (int)(p - P->peers);
  if (up) {
    if (P->data != NULL)
      P->data->up(k);
    if (P->ev != NULL && P->ev->up != NULL)
      P->ev->up(k);
  } else {
    if (P->ev != NULL && P->ev->down != NULL)
      P->ev->down(k);
    if (P->data != NULL)
      P->data->down(k);
  }
}
static void conn_on_hello(struct peer_conn *c, const struct dep_peer_msg *m, const uint8_t *raw,
                          size_t len) {
  if (c->got_hello) {
    peer__refuse(c, DEP_ERR_PROTOCOL, "sent a second HELLO");
    return;
  }
  c->got_hello = true;
  const struct dep_peer_hello *h = &m->u.hello;
  if (h->version < DEP_PEER_MIN_VERSION || h->version > DEP_PEER_VERSION) {
    peer__refuse(c, DEP_ERR_VERSION,
                 "the peer speaks peer protocol version %u; this deepepd speaks versions %u..%u: "
                 "run the same deepepd version on every node (upgrade the older)",
                 (unsigned)h->version, (unsigned)DEP_PEER_MIN_VERSION,
                 (unsigned)DEP_PEER_VERSION);
    return;
  }
  if (c->slot < 0) {
    c->peer = peer_identify(c, h->listen_port);
    if (c->peer == NULL) {
      /* Its node name is not repeated: it is the far end's, and unproven. */
      c->refusal = PEER_REFUSED_UNLISTED;
      peer__refuse(c, DEP_ERR_PERMISSION,
                  "%s (listen port %u) is not in this daemon's peers: refused", c->from,
                  (unsigned)h->listen_port);
      return;
    }
  }
  /* Kept for this connection alone until it authenticates (peer__take_node). */
  char node[4 * DEP_PEER_NODE_MAX];
  log_escape(h->node, strlen(h->node), node, sizeof node);
  cut(c->node, sizeof c->node, node);
  peerauth_take(&c->hs, raw, len);
  /* The acceptor answers with its own HELLO only now that it knows the caller. */
  if (c->slot < 0 && peer__send_hello(c) != 0)
    return;
  (void)conn_send_auth(c);
}

/*
 * An inbound connection whose first frame is DATA_HELLO: a peer opening a
 * data connection with a token we offered it (xfer.h).  Identified as a
 * HELLO is (source address and listen port); the socket goes to xfer, and
 * the link closes without touching it (link_hand_off), having read nothing
 * past the frame.
 */
static void conn_on_data_hello(struct peer_conn *c, const struct dep_peer_data_hello *h) {
  if (c->slot >= 0 || c->got_hello) {
    peer__refuse(c, DEP_ERR_PROTOCOL, "sent DATA_HELLO on a link that is not a new inbound one");
    return;
  }
  struct peer *p = peer_identify(c, h->listen_port);
  if (p == NULL) {
    c->refusal = PEER_REFUSED_UNLISTED;
    peer__refuse(c, DEP_ERR_PERMISSION, "%s (listen port %u) is not in this daemon's peers: its "
                "data connection is refused", c->from, (unsigned)h->listen_port);
    return;
  }
  int fd = dup(c->link.fd);
  if (fd < 0) {
    peer__refuse(c, DEP_ERR_INTERNAL, "cannot take the data connection: %s", strerror(errno));
    return;
  }
  const enum peer_token t =
      P->data != NULL ? P->data->accept((int)(p - P->peers), h->token, fd) : PEER_TOKEN_UNKNOWN;
  if (t == PEER_TOKEN_STALE) {
    /* The peer's connector was under way while one end stalled or lost the
     * links: not a stranger's, and the offers made since stand (peer.h;
     * xfer says it). */
    close(fd);
    link_close(&c->link, "its offer expired or was withdrawn");
    return;
  }
  if (t != PEER_TOKEN_TAKEN) {
    close(fd);
    c->refusal = PEER_REFUSED_TOKEN;
    peer__refuse(c, DEP_ERR_PERMISSION, "opened a data connection with a token this daemon did "
                "not offer it (or used it already)");
    return;
  }
  c->handed_off = true;
  /* Not link_close: its drain would read, on the loop, what the peer sends
   * right behind the DATA_HELLO (its proof), which is the receiver's. */
  link_hand_off(&c->link, "handed to the data path");
}

static void conn_on_auth(struct peer_conn *c, const struct dep_peer_msg *m) {
  if (!c->got_hello || !c->sent_auth || c->verified) {
    peer__refuse(c, DEP_ERR_PROTOCOL, "sent AUTH out of turn");
    return;
  }
  if (!peerauth_check(&c->hs, m->u.auth.mac)) {
    c->refusal = PEER_REFUSED_AUTH;
    peer__refuse(c, DEP_ERR_PERMISSION,
                "authentication failed: a different peer_key_file, or a replayed or reflected "
                "answer");
    return;
  }
  c->verified = true;
  if (peer__send(c, &(struct dep_peer_msg){.type = DEP_PEER_AUTH_OK}) != 0)
    return;
  peer__take_node(c);
  peerxport_begin(c);
}

void peer__take_node(struct peer_conn *c) {
  if (c->peer != NULL && c->verified && c->acked)
    cut(c->peer->node, sizeof c->peer->node, c->node);
}

/*
 * A message of a type this deepepd does not know, from a peer that is up:
 * logged (one line, then at most one per PEER_REFUSAL_LOG_MS with the
 * count between, so a newer peer that keeps probing cannot fill the log),
 * and the link stays.
 */
static void peer_log_unknown(const struct peer_conn *c, const char *what) {
  static uint64_t last_ms;
  static unsigned long skipped;
  uint64_t now = now_ms();
  if (last_ms != 0 && now - last_ms < PEER_REFUSAL_LOG_MS) {
    skipped++;
    return;
  }
  if (skipped > 0)
    log_warnx("peer %s: sent %s, which this deepepd does not know (a newer deepepd?); the link "
              "stays (%lu more such messages since the last line)",
              c->peer->name, what, skipped);
  else
    log_warnx("peer %s: sent %s, which this deepepd does not know (a newer deepepd?); the link "
              "stays", c->peer->name, what);
  last_ms = now;
  skipped = 0;
}

/* A frame's checks before its message is handled: a control frame type of a newer peer
 * is logged, any other control frame refused, the body decoded, and a peer message type
 * of a newer peer answered UNSUPPORTED.  Returns whether *m holds a message to handle;
 * false when the frame has been dealt with here. */
static bool peer_frame_msg(struct peer_conn *c, const struct dep_frame_hdr *h,
                           const uint8_t *body, size_t len, struct dep_peer_msg *m) {
  if (h->type != DEP_MSG_PEER && c->up && !proto_type_known(h->type)) {
    /* A control frame type of a newer peer: not answered, since peers
     * speak to each other only in PEER frames (and before authentication
     * it closes the link, below, as any unexpected frame does). */
    char what[64];
    snprintf(what, sizeof what, "control frame type %u", (unsigned)h->type);
    peer_log_unknown(c, what);
    return false;
  }
  if (h->type != DEP_MSG_PEER) {
    peer__refuse(c, DEP_ERR_PROTOCOL, "sent a %s frame on a peer link", proto_type_name(h->type));
    return false;
  }
  char why[256];
  int rc = peer_proto_decode(body, len, m, why, sizeof why);
  if (rc == DEP_ERR_UNSUPPORTED && c->up) {
    /* A newer peer may probe: say so and keep the link (peer_proto.h). */
    char what[64];
    snprintf(what, sizeof what, "peer message type %u", (unsigned)m->type);
    peer_log_unknown(c, what);
    struct dep_peer_msg e = {.type = DEP_PEER_ERROR};
    e.u.error.code = DEP_ERR_UNSUPPORTED;
    snprintf(e.u.error.message, sizeof e.u.error.message, "%s", why);
    (void)peer__send(c, &e);
    return false;
  }
  if (rc != 0) {
    peer__refuse(c, rc, "%s", why);
    return false;
  }
  return true;
}

/* The peer's ERROR: its words kept for the link's end, or logged while the link stays
 * up. */
static void peer_on_error_msg(struct link *l, struct peer_conn *c,
                              const struct dep_peer_msg *m) {
  if (c->slot < 0 && !c->authed) {
    /* A stranger's words are not repeated in our log. */
    link_drop(l, "sent ERROR before authenticating");
    return;
  }
  char msg[4 * DEP_MSG_TEXT_MAX], err[sizeof msg + 32];
  log_escape(m->u.error.message, strlen(m->u.error.message), msg, sizeof msg);
  snprintf(err, sizeof err, "refused by the peer: %s", msg);
  cut(c->err, sizeof c->err, err);
  if (!c->up)
    link_drop(l, "%s", c->err);
  else
    log_warnx("peer %s: says: %s", c->peer->name, msg);
}

/* The peer's CLOSE: the link ends with its words. */
static void peer_on_close_msg(struct link *l, struct peer_conn *c,
                              const struct dep_peer_msg *m) {
  char msg[4 * DEP_MSG_TEXT_MAX], err[sizeof msg + 32];
  log_escape(m->u.error.message, strlen(m->u.error.message), msg, sizeof msg);
  snprintf(err, sizeof err, "closed by the peer: %s", msg);
  cut(c->err, sizeof c->err, err);
  link_close(l, c->err);
}

static void peer_on_frame(struct link *l, const struct dep_frame_hdr *h, const uint8_t *body,
                          size_t len, int *fds, int nfds) {
  struct peer_conn *c = l->user;
  c->last_rx_ms = now_ms();
  if (c->peer != NULL)
    c->peer->bytes_in += DEP_PROTO_HDR_LEN + len;
  struct dep_peer_msg m;
  if (!peer_frame_msg(c, h, body, len, &m))
    return;
  if (m.type == DEP_PEER_DATA_HELLO) {
    conn_on_data_hello(c, &m.u.data_hello);
    return;
  }
  bool handshake = m.type == DEP_PEER_HELLO || m.type == DEP_PEER_AUTH ||
                   m.type == DEP_PEER_AUTH_OK || m.type == DEP_PEER_ERROR ||
                   (c->authed && (m.type == DEP_PEER_XPORT || m.type == DEP_PEER_XPORT_NAK));
  if (!c->up && !handshake)
    peerxport_proven(c);
  if (!c->up && !handshake) {
    peer__refuse(c, DEP_ERR_STATE, "sent %s before authenticating", peer_proto_type_name(m.type));
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
      peer__refuse(c, DEP_ERR_PROTOCOL, "sent AUTH_OK out of turn");
      return;
    }
    c->acked = true;
    peer__take_node(c);
    peerxport_begin(c);
    break;
  case DEP_PEER_ERROR:
    peer_on_error_msg(l, c, &m);
    break;
  case DEP_PEER_KEEPALIVE:
    peer__on_keepalive(c, &m);
    break;
  case DEP_PEER_XPORT:
    peerxport_on_xport(c, &m.u.xport);
    break;
  case DEP_PEER_XPORT_NAK:
    peerxport_on_nak(c, &m.u.nak);
    break;
  case DEP_PEER_DATA_OFFER:
    if (P->data != NULL)
      P->data->offer((int)(c->peer - P->peers), &m.u.data_offer);
    break;
  case DEP_PEER_DATA_HELLO: /* handled above */
    break;
  case DEP_PEER_MEMBERSHIP:
  case DEP_PEER_MEMBERSHIP_OK:
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END:
  case DEP_PEER_JOB_MASK:
  case DEP_PEER_JOB_JOINED:
  case DEP_PEER_JOB_HELD:
    if (P->ev != NULL && P->ev->job_msg != NULL)
      P->ev->job_msg((int)(c->peer - P->peers), &m);
    break;
  case DEP_PEER_CLOSE:
    peer_on_close_msg(l, c, &m);
    break;
  }
}

static void peer_on_closing(struct link *l) {
  struct peer_conn *c = l->user;
  if (P->stopping)
    return; /* rdmaxp_fini closes the queue pairs */
  rdmaxp_close(c->qp);
  c->qp = NULL;
  if (c->slot >= 0) {
    peerconn_backoff(c->peer, c->slot,
                 c->err[0] ? c->err : c->up ? "connection lost" : "closed during the handshake");
    peer__note_links(c->peer);
    return;
  }
  for (struct peer_conn **pp = &P->inbound; *pp != NULL; pp = &(*pp)->next) {
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  }
  if (c->up && c->peer != NULL) {
    c->peer->inbound_up--;
    peer__note_links(c->peer);
  }
}

static void peer_on_close(struct link *l) {
  struct peer_conn *c = l->user;
  free(c);
}

/* Why l is dropped: an inbound connection not yet authenticated is counted
 * with its source's refusals (a flood logs a line per interval, not one per
 * connection); our own links and authenticated ones are logged as they go. */
static void peer_on_drop(struct link *l, const char *why) {
  struct peer_conn *c = l->user;
  if (c->slot < 0 && !c->authed) {
    peerconn_refused(&c->src, c->refusal, why);
    return;
  }
  char who[300];
  peer_describe(l, who, sizeof who);
  log_warnx("%s: dropped: %s", who, why);
}

const struct link_ops peer__link_ops = {
    .kind = "peers",
    .sends_fds = false,
    .takes_fds = false,
    .limits = peer_limits,
    .describe = peer_describe,
    .on_frame = peer_on_frame,
    .on_closing = peer_on_closing,
    .on_close = peer_on_close,
    .on_drop = peer_on_drop,
};
/* ---- readiness ----------------------------------------------------------- */

/* "a:1 (backoff: ...), b:2 (connecting)" for the peers not up; "" when all are. */
static void peer_missing(char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < P->n && used < len; i++) {
    const struct peer *p = &P->peers[i];
    if (peer__all_up(p))
      continue;
    int k = snprintf(buf + used, len - used, "%s%s (%s%s%s)", used ? ", " : "", p->name,
                     peer_state(p), p->last_error[0] ? ": " : "", p->last_error);
    if (k < 0)
      break;
    used += (size_t)k;
  }
}

void peer__check_ready(void) {
  if (P->ready_cb == NULL)
    return;
  char missing[DEP_MSG_TEXT_MAX];
  peer_missing(missing, sizeof missing);
  bool late = now_ms() - P->start_ms >= P->wait_ms;
  if (missing[0] != '\0' && !late) {
    if (strcmp(missing, P->status) != 0) {
      snprintf(P->status, sizeof P->status, "%s", missing);
      notify_send("STATUS=waiting for peers: %s", missing);
    }
    return;
  }
  peer_ready_fn *cb = P->ready_cb;
  P->ready_cb = NULL;
  if (missing[0] != '\0')
    log_warnx("peers: not up after peer_wait_ms %u: %s; ready without them, still trying",
              (unsigned)P->wait_ms, missing);
  cb(missing[0] != '\0' ? missing : NULL);
}

/* ---- init, fini, queries ------------------------------------------------- */

/* What peerxport.c asks of this file (peer_internal.h). */
static const struct peer_core peer_core = {
    .send = peer__send,
    .refuse = peer__refuse,
    .all_up = peer__all_up,
    .note_links = peer__note_links,
    .check_ready = peer__check_ready,
};

int peer_init(uv_loop_t *loop, const struct config *cfg) {
  P->loop = loop;
  P->core = &peer_core;
  P->pool_size = cfg->connection_pool_size;
  P->wait_ms = cfg->peer_wait_ms;
  P->listen_port = cfg->listen_port;
  snprintf(P->listen_address, sizeof P->listen_address, "%s", cfg->listen_address);
  P->start_ms = uv_now(loop);
  if (gethostname(P->node, sizeof P->node) != 0)
    snprintf(P->node, sizeof P->node, "unknown");
  P->node[sizeof P->node - 1] = '\0';
  if (sodium_init() < 0) {
    log_errx("peers: libsodium failed to initialise");
    return -1;
  }
  bool wanted = cfg->n_peers > 0 || cfg->listen_address[0] != '\0';
  if (cfg->peer_key_file[0] != '\0') {
    char why[DEP_MSG_TEXT_MAX + 256];
    if (peerauth_key_load(cfg->peer_key_file, P->key, sizeof P->key, &P->keylen, why, sizeof why) !=
        0) {
      log_errx("%s", why);
      return -1;
    }
    P->authenticated = true;
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
  if (rdmaxp_init(loop, cfg, &peerxport_events) != 0)
    return -1;
  P->active = true;
  /* Made with P->active, which peer_fini closes it by: a start that fails from here on (its
   * listener's port taken) stops without a libuv assertion on a timer never made. */
  uv_timer_init(P->loop, &P->tick);
  if (P->listen_address[0] != '\0' && peerconn_listen() != 0)
    return -1;
  P->n = cfg->n_peers;
  for (size_t k = 0; k < P->n; k++) {
    struct peer *p = &P->peers[k];
    memset(p, 0, sizeof *p);
    snprintf(p->host, sizeof p->host, "%s", cfg->peers[k].host);
    p->port = cfg->peers[k].port;
    p->transport = config_peer_transport(cfg, &cfg->peers[k]);
    snprintf(p->name, sizeof p->name, "%s:%u", p->host, (unsigned)p->port);
    p->slots = calloc(P->pool_size, sizeof *p->slots);
    if (p->slots == NULL) {
      log_errx("peers: out of memory");
      return -1;
    }
    for (uint32_t i = 0; i < P->pool_size; i++) {
      p->slots[i].state = SLOT_BACKOFF; /* due at once: the first tick connects */
      p->slots[i].backoff_ms = PEER_BACKOFF_MIN_MS;
      p->slots[i].retry_at_ms = 0;
      p->slots[i].awaits_address = true; /* the first connects follow the resolution */
    }
    peerconn_resolve(p);
  }
  peer__tick_start();
  if (P->n > 0)
    log_info("peers: connecting to %zu peer(s), %u connection(s) each", P->n,
             (unsigned)P->pool_size);
  return 0;
}
static void peer_on_listen_closed(uv_handle_t *h) {
  close(P->listen_fd);
  P->listen_fd = -1;
}
void peer_fini(void) {
  if (!P->active)
    return;
  P->stopping = true;
  P->active = false;
  peer__tick_stop();
  if (P->listening) {
    P->listening = false;
    uv_poll_stop(&P->listen_poll);
    uv_close((uv_handle_t *)&P->listen_poll, peer_on_listen_closed);
  }
  for (size_t k = 0; k < P->n; k++) {
    struct peer *p = &P->peers[k];
    if (p->resolving)
      (void)uv_cancel((uv_req_t *)&p->gai);
    for (uint32_t i = 0; i < P->pool_size; i++) {
      if (p->slots[i].conn != NULL)
        peerconn_close_for_stop(p->slots[i].conn);
      p->slots[i].conn = NULL;
    }
  }
  while (P->inbound != NULL) {
    struct peer_conn *c = P->inbound;
    P->inbound = c->next;
    peerconn_close_for_stop(c);
  }
  /* The slots are freed now: every callback still to come sees P->stopping. */
  for (size_t k = 0; k < P->n; k++) {
    free(P->peers[k].slots);
    P->peers[k].slots = NULL;
  }
  peerconn_refusals_tick(uv_now(P->loop), true);
  rdmaxp_fini();
  sodium_memzero(P->key, sizeof P->key);
  P->ready_cb = NULL;
}

void peer_wait(peer_ready_fn *done) {
  P->ready_cb = done;
  P->status[0] = '\0';
  if (!P->active || P->n == 0 || P->wait_ms == 0) {
    P->ready_cb = NULL;
    done(NULL);
    return;
  }
  peer__check_ready();
}

void peer_set_events(const struct peer_events *ev) { P->ev = ev; }

void peer_set_data_ops(const struct peer_data_ops *ops) { P->data = ops; }

int peer_count(void) { return P->active ? (int)P->n : 0; }

bool peer_is_up(int k) {
  return P->active && k >= 0 && (size_t)k < P->n && peer_links_up(&P->peers[k]) > 0;
}

int peer_data_address(int k, struct sockaddr_storage *out, socklen_t *len) {
  if (k < 0 || (size_t)k >= P->n || P->peers[k].naddrs == 0)
    return -1;
  const struct peer *p = &P->peers[k];
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
  if (k < 0 || (size_t)k >= P->n)
    return "?";
  return P->peers[k].name;
}

int peer_send(int k, const struct dep_peer_msg *m) {
  if (!peer_is_up(k))
    return DEP_ERR_STATE;
  struct peer *p = &P->peers[k];
  /* The first outbound link that is up, else an inbound one: one link per
   * peer while it lasts, so that a job's messages keep their order. */
  for (uint32_t i = 0; i < P->pool_size; i++) {
    struct peer_conn *c = p->slots[i].conn;
    if (p->slots[i].state == SLOT_UP && c != NULL && link_open(&c->link))
      return peer__send(c, m) == 0 ? 0 : DEP_ERR_STATE;
  }
  for (struct peer_conn *c = P->inbound; c != NULL; c = c->next)
    if (c->up && c->peer == p && link_open(&c->link))
      return peer__send(c, m) == 0 ? 0 : DEP_ERR_STATE;
  return DEP_ERR_STATE;
}

/* The links' part of PEERS_OK: every peer and its control connections. */
static int peer_fill_links(struct dep_msg_peers *m) {
  memset(m, 0, sizeof *m);
  snprintf(m->node, sizeof m->node, "%s", P->node);
  if (P->listening)
    snprintf(m->listen, sizeof m->listen, "%s:%u", P->listen_address, (unsigned)P->listen_port);
  m->auth = P->authenticated ? 1 : 0;
  if (rdmaxp_active())
    snprintf(m->rdma, sizeof m->rdma, "%s", rdmaxp_device());
  else if (P->active)
    snprintf(m->rdma, sizeof m->rdma, "none: %s", rdmaxp_why());
  for (size_t i = 0; i < devices_count(); i++)
    m->nic_bytes += devices_at(i)->nic_bytes;
  if (P->n == 0 || P->stopping)
    return 0;
  m->peers = calloc(P->n, sizeof *m->peers);
  if (m->peers == NULL)
    return DEP_ERR_NO_MEMORY;
  m->n_peers = (uint32_t)P->n;
  uint64_t now = now_ms();
  for (size_t k = 0; k < P->n; k++) {
    const struct peer *p = &P->peers[k];
    struct dep_msg_peer_info *q = &m->peers[k];
    snprintf(q->address, sizeof q->address, "%s", p->name);
    snprintf(q->node, sizeof q->node, "%s", p->node);
    snprintf(q->state, sizeof q->state, "%s", peer_state(p));
    uint32_t on_rdma = 0, on_tcp = 0;
    for (uint32_t i = 0; i < P->pool_size; i++) {
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
    snprintf(q->last_error, sizeof q->last_error, "%s", p->last_error);
    q->conns_up = peer_count_up(p);
    q->conns_total = P->pool_size;
    q->inbound_up = p->inbound_up;
    q->reconnects = p->reconnects;
    q->bytes_in = p->bytes_in;
    q->bytes_out = p->bytes_out;
    q->rtt_us = p->rtt_us;
    /* The longest wait of a slot in backoff: when the peer is tried next at the latest. */
    for (uint32_t i = 0; i < P->pool_size; i++) {
      const struct peer_slot *s = &p->slots[i];
      if (s->state == SLOT_BACKOFF && s->retry_at_ms > now && s->retry_at_ms - now > q->backoff_ms)
        q->backoff_ms = s->retry_at_ms - now;
    }
  }
  return 0;
}

int peer_fill(struct dep_msg_peers *m) {
  int rc = peer_fill_links(m);
  if (rc == 0 && P->data != NULL)
    P->data->fill(m);
  return rc;
}
