/*
 * peerxport.c — settling the transport of an authenticated peer link
 * (peer_internal.h, peer_proto.h XPORT): the accepting end offers an RDMA
 * queue pair (rdmaxp.h) or says TCP, the connecting end connects the
 * queue pair or answers XPORT_NAK, and the link is up once the queue pair
 * connects or both ends agree on TCP.  With transport rdma a link that
 * cannot have RDMA is refused (and retried); with auto it settles on TCP.
 * The key that proves the data connections beside the links (xfer.h), and
 * the links' own RDMA connection requests, is derived here, where the
 * link's key and both node names are.
 */
#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "log.h"
#include "peer_internal.h"
#include "rdmaxp.h"

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
    /* The peer is back: it reached us.  Our own connections to it try again
     * at the next tick rather than at the end of a backoff of up to 30 s, so
     * that both ends see the link up together (a job's MEMBERSHIP goes only
     * to a peer this end sees up). */
    uint64_t now = now_ms();
    for (uint32_t i = 0; i < P->pool_size; i++) {
      struct peer_slot *s = &p->slots[i];
      if (s->state == SLOT_BACKOFF && s->retry_at_ms > now) {
        s->retry_at_ms = now;
        s->backoff_ms = PEER_BACKOFF_MIN_MS;
      }
    }
  }
  P->core->note_links(p);
  if (c->slot >= 0 && P->core->all_up(p) && !p->was_up) {
    p->was_up = true;
    p->last_error[0] = '\0';
    log_info("peer %s (%s): %u connection(s) up over %s%s", p->name, p->node, P->pool_size,
             rdma ? "RDMA" : "TCP", P->authenticated ? "" : ", unauthenticated (peer_insecure)");
  }
  P->core->check_ready();
}

/* RDMA cannot be had on this link (why): with transport rdma the link is
 * refused (and retried), with auto it settles on TCP. */
static void conn_without_rdma(struct peer_conn *c, const char *why) {
  if (c->peer->transport == CONFIG_TRANSPORT_RDMA)
    P->core->refuse(c, DEP_ERR_UNSUPPORTED, "transport: rdma, but %s", why);
  else
    conn_settled(c, false, why);
}

static void conn_send_nak(struct peer_conn *c, const char *why) {
  struct dep_peer_msg m = {.type = DEP_PEER_XPORT_NAK};
  m.u.nak.code = DEP_ERR_UNSUPPORTED;
  cut(m.u.nak.message, sizeof m.u.nak.message, why);
  (void)P->core->send(c, &m);
}

/* The key derived for a connection between us and the peer whose node is
 * them, in the direction in which we_open (peerauth_data_key). */
static void derived_key(const char *them, bool we_open, uint8_t out[DEP_PEER_MAC_LEN]) {
  const size_t keylen = P->authenticated ? P->keylen : 0;
  peerauth_data_key(P->key, keylen, we_open ? P->node : them, we_open ? them : P->node, out);
}

/* Both ends authenticated: the accepting end offers the transport. */
static void conn_offer(struct peer_conn *c) {
  struct peer *p = c->peer;
  static struct dep_peer_msg m;
  memset(&m, 0, sizeof m);
  m.type = DEP_PEER_XPORT;
  char why[DEP_MSG_TEXT_MAX] = "transport: tcp here";
  if (p->transport != CONFIG_TRANSPORT_TCP) {
    /* Its connection request must prove the key for the far end's direction. */
    uint8_t dkey[DEP_PEER_MAC_LEN];
    derived_key(p->node, false, dkey);
    c->qp = rdmaxp_offer(c, dkey, &m.u.xport, why, sizeof why);
    sodium_memzero(dkey, sizeof dkey);
    if (c->qp != NULL) {
      (void)P->core->send(c, &m); /* up when the queue pair connects, or TCP on XPORT_NAK */
      return;
    }
  }
  m.u.xport.kind = DEP_PEER_XPORT_TCP;
  snprintf(m.u.xport.reason, sizeof m.u.xport.reason, "%s", why);
  if (P->core->send(c, &m) != 0)
    return;
  conn_without_rdma(c, why);
}

void peerxport_begin(struct peer_conn *c) {
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
void peerxport_on_xport(struct peer_conn *c, const struct dep_peer_xport *x) {
  if (c->slot < 0 || c->up || c->qp != NULL) {
    P->core->refuse(c, DEP_ERR_PROTOCOL, "sent XPORT out of turn");
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
      uint8_t dkey[DEP_PEER_MAC_LEN];
      derived_key(p->node, true, dkey);
      c->qp = rdmaxp_connect(c, (struct sockaddr *)&src, (struct sockaddr *)&dst, x, dkey, why,
                             sizeof why);
      sodium_memzero(dkey, sizeof dkey);
      if (c->qp != NULL)
        return; /* up when it connects, or down */
    }
  }
  conn_send_nak(c, why);
  conn_without_rdma(c, why);
}

/* The accepting end: the connecting end will not or could not use RDMA. */
void peerxport_on_nak(struct peer_conn *c, const struct dep_peer_error *nak) {
  if (c->slot >= 0 || !c->authed) {
    P->core->refuse(c, DEP_ERR_PROTOCOL, "sent XPORT_NAK out of turn");
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

void peer_data_key(int k, bool we_open, uint8_t out[DEP_PEER_MAC_LEN]) {
  derived_key(k >= 0 && (size_t)k < P->n ? P->peers[k].node : "", we_open, out);
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

const struct rdmaxp_events peerxport_events = {
    .up = conn_on_qp_up,
    .down = conn_on_qp_down,
    .pong = conn_on_qp_pong,
};

/*
 * The accepting end, its RDMA offer taken (rdma_accept called), and a
 * frame past the handshake came before our own ESTABLISHED event: the
 * connecting end sends such frames only once its queue pair is connected,
 * and its ESTABLISHED comes first — ours waits for its RTU, then for the
 * loop to read the connection manager's channel, which it may do after
 * the link's socket.  Refusing the frame would drop the link with the
 * DATA_OFFERs that follow, which are not sent again while the peer stays
 * up on another link, and leave the far end without data connections.
 * rdma_accept moved our queue pair to RTS already, so the link is up on
 * it now; our ESTABLISHED, when it comes, changes nothing.
 */
void peerxport_proven(struct peer_conn *c) {
  if (c->slot < 0 && c->authed && !c->up && c->qp != NULL && rdmaxp_qp_accepted(c->qp))
    conn_settled(c, true, NULL);
}
