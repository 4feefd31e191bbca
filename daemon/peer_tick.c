/*
 * peer_tick.c — the peer layer's clock (peer_internal.h): one timer, every
 * PEER_TICK_MS, that retries the slots whose backoff is over, times out
 * connects and handshakes, sends each link's keep-alive and drops a link
 * silent past PEER_DEAD_MS, resumes an accept paused on EMFILE, and counts
 * the loop's own stalls so that a link's silence counts from the stall's
 * end.  The KEEPALIVE message's echo and round trip are here too, beside
 * the pings they answer.  The links' frames are peer.c's; opening links is
 * peerconn.c's.
 */
#include <stdio.h>

#include "log.h"
#include "peer_internal.h"
#include "rdmaxp.h"

#define PEER_TICK_MS 100
/* A tick this late is said in the log (peer_on_tick). */
#define PEER_STALL_MS (2 * PEER_KEEPALIVE_MS)

/* A KEEPALIVE: a request is echoed as a reply; a reply gives the round trip. */
void peer__on_keepalive(struct peer_conn *c, struct dep_peer_msg *m) {
  if (m->u.keepalive.reply == 0) {
    m->u.keepalive.reply = 1;
    (void)peer__send(c, m);
  } else {
    uint64_t now_us = uv_hrtime() / 1000u;
    if (now_us >= m->u.keepalive.stamp)
      c->peer->rtt_us = now_us - m->u.keepalive.stamp;
  }
}

/* The later of t and the end of the loop's last stall: what a link's wait
 * or silence counts from (peer_on_tick). */
static uint64_t since(uint64_t t) { return t > P->resumed_ms ? t : P->resumed_ms; }

/* Keep-alive and the timeouts of one linked connection. */
static void conn_tick(struct peer_conn *c, uint64_t now) {
  if (!link_open(&c->link))
    return;
  if (!c->up) {
    if (!c->authed && now - since(c->opened_ms) > PEER_HANDSHAKE_MS) {
      c->refusal = PEER_REFUSED_TIMEOUT;
      snprintf(c->err, sizeof c->err, "did not authenticate within %d ms", PEER_HANDSHAKE_MS);
      link_drop(&c->link, "%s", c->err);
    } else if (c->authed && now - since(c->authed_ms) > PEER_TRANSPORT_MS) {
      snprintf(c->err, sizeof c->err, "its transport was not settled within %d ms (%s)",
               PEER_TRANSPORT_MS, c->qp != NULL ? "the RDMA connection did not complete"
                                                : "no XPORT came");
      link_drop(&c->link, "%s", c->err);
    }
    return;
  }
  if (now - since(c->last_rx_ms) > PEER_DEAD_MS) {
    snprintf(c->err, sizeof c->err, "nothing received for %d ms: dead peer", PEER_DEAD_MS);
    link_drop(&c->link, "%s", c->err);
    return;
  }
  if (now - c->last_ping_ms >= PEER_KEEPALIVE_MS) {
    /* The queue pair's keep-alive out, as the link's silence, from the end of a stall at most. */
    if (c->qp != NULL && rdmaxp_ping(c->qp, now) > PEER_DEAD_MS &&
        now - P->resumed_ms > PEER_DEAD_MS) {
      snprintf(c->err, sizeof c->err, "its RDMA queue pair answered no keep-alive for %d ms",
               PEER_DEAD_MS);
      link_drop(&c->link, "%s", c->err);
      return;
    }
    struct dep_peer_msg m = {.type = DEP_PEER_KEEPALIVE};
    m.u.keepalive.stamp = uv_hrtime() / 1000u;
    c->last_ping_ms = now;
    (void)peer__send(c, &m);
  }
}

static void peer_on_tick(uv_timer_t *t) {
  uint64_t now = now_ms();
  /* A loop that ran nothing for this long sent no keep-alive, and its
   * peers may drop its links as silent.  Nor did it read: what they sent
   * meanwhile waits unread, and the tick runs before those reads, so the
   * links' silence (and the handshakes' waits) count from now, not from
   * before the stall; else this daemon would drop every link as dead for
   * its own stall (as both daemons of a pair did when the making of their
   * pools stalled them together at start, withdrawing the offers of the
   * data connections under way). */
  if (now - P->last_tick_ms > PEER_STALL_MS) {
    log_warnx("peers: the loop ran no tick for %llu ms (this daemon was blocked or starved of "
              "CPU); the links' silence counts from now; peers may drop the links as dead past "
              "%d ms", (unsigned long long)(now - P->last_tick_ms), PEER_DEAD_MS);
    P->resumed_ms = now;
  }
  P->last_tick_ms = now;
  if (P->accept_paused_until != 0 && now >= P->accept_paused_until) {
    P->accept_paused_until = 0;
    uv_poll_start(&P->listen_poll, UV_READABLE, peerconn_on_accept);
  }
  for (size_t k = 0; k < P->n; k++) {
    struct peer *p = &P->peers[k];
    for (uint32_t i = 0; i < P->pool_size; i++) {
      struct peer_slot *s = &p->slots[i];
      if (s->state == SLOT_BACKOFF && now >= s->retry_at_ms) {
        peerconn_connect(p, (int)i);
      } else if (s->state == SLOT_CONNECTING && s->conn != NULL && !s->conn->linked &&
                 now - since(s->conn->opened_ms) > PEER_HANDSHAKE_MS) {
        char why[DEP_MSG_TEXT_MAX];
        snprintf(why, sizeof why, "connect to %s: no answer within %d ms", p->name,
                 PEER_HANDSHAKE_MS);
        peerconn_connect_done(s->conn, why);
      } else if (s->conn != NULL && s->conn->linked) {
        conn_tick(s->conn, now);
      }
    }
  }
  for (struct peer_conn *c = P->inbound, *next; c != NULL; c = next) {
    next = c->next; /* conn_tick may drop c, which takes it out of the list */
    conn_tick(c, now);
  }
  if (P->data != NULL)
    P->data->tick(); /* data connections lost while their link stayed */
  peerconn_refusals_tick(now, false);
  peer__check_ready();
}

void peer__tick_start(void) {
  P->last_tick_ms = P->start_ms; /* a stall before the first tick is one too */
  uv_timer_start(&P->tick, peer_on_tick, PEER_TICK_MS, PEER_TICK_MS);
}

void peer__tick_stop(void) { uv_close((uv_handle_t *)&P->tick, NULL); }
