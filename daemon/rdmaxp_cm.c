/*
 * rdmaxp_cm.c — the RDMA transport's connection manager (rdmaxp.h,
 * rdmaxp_internal.h): the connecting end of a link's or a data queue
 * pair's connection (dial, the route, the request with its proof), the
 * accepting end (a request must name an open offer and prove the peer
 * key), and the events of the manager's channel that drive both.
 */
#include "rdmaxp.h"

#include <errno.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "codec.h"
#include "log.h"
#include "peerauth.h"
#include "rdmadrv.h"
#include "rdmaxp_internal.h"
#include "testhooks.h"
#include "xfer.h"

/* What an RC connection request's private data holds: a link's is
 * peer_proto.h's dep_peer_qp_req, a data queue pair's xring.h's
 * dep_xfer_rdma_req. */
#define PRIV_MAX 56
/* What an RC connection's acceptance carries: a data queue pair's is
 * xring.h's dep_xfer_rdma_stage (the acceptor's staging for the peer). */
#define PRIV_REP_MAX 64
_Static_assert(sizeof(struct dep_xfer_rdma_stage) <= PRIV_REP_MAX,
               "a data queue pair's acceptance is the acceptor's staging");
_Static_assert(sizeof(struct dep_peer_qp_req) <= PRIV_MAX,
               "RC connection private data holds 56 bytes");
_Static_assert(sizeof(struct dep_xfer_rdma_req) <= PRIV_MAX &&
                   sizeof((struct dep_xfer_rdma_req *)0)->token == DEP_PEER_TOKEN_LEN,
               "a data queue pair's request is its token, version and proof");

/* Both ends' connection parameters: one RDMA read in flight each way (none
 * is made), and a reliable connection's retries at their most. */
static struct rdma_conn_param conn_param(const void *priv, uint8_t privlen) {
  return (struct rdma_conn_param){
      .private_data = priv,
      .private_data_len = privlen,
      .responder_resources = 1,
      .initiator_depth = 1,
      .retry_count = 7,
      .rnr_retry_count = 7,
  };
}

/* The accepting end, a link's or the data path's: q takes the request's id,
 * gets its queue pair and accepts; on a failure the request is rejected and
 * q fails. */
static void qp_accept(struct rdmaxp_qp *q, struct rdma_cm_id *id) {
  q->id = id;
  id->context = q;
  char why[256];
  if (rdmaxp__qp_create(q, why, sizeof why) != 0) {
    (void)R.rd->cm.reject(id, NULL, 0);
    rdmaxp__qp_fail(q, "%s", why);
    return;
  }
  uint8_t priv[PRIV_REP_MAX];
  size_t len = 0;
  if (q->data && R.dev_ev != NULL && R.dev_ev->reply != NULL)
    len = R.dev_ev->reply(q->owner, priv, sizeof priv);
  struct rdma_conn_param p = conn_param(len > 0 ? priv : NULL, (uint8_t)len);
  if (R.rd->cm.accept(id, &p) != 0)
    rdmaxp__qp_fail(q, "rdma_accept: %s", strerror(errno));
}

static void on_route_resolved(struct rdmaxp_qp *q) {
  char why[256];
  if (rdmaxp__qp_create(q, why, sizeof why) != 0) {
    rdmaxp__qp_fail(q, "%s", why);
    return;
  }
  uint8_t priv[PRIV_MAX];
  size_t len;
  if (q->data) {
    struct dep_xfer_rdma_req req = {.version = DEP_XFER_VERSION};
    memcpy(req.token, q->token, sizeof req.token);
    memcpy(req.proof, q->proof, sizeof req.proof);
    memcpy(priv, &req, sizeof req);
    len = sizeof req;
  } else {
    const uint64_t mbox = (uintptr_t)q->mbox;
    const uint32_t rkey = rdmaxp_mr_rkey(q->mbox_mr);
    memcpy(priv, q->token, DEP_PEER_QP_TOKEN_NAME);
    codec_put_u64(priv + offsetof(struct dep_peer_qp_req, mbox_addr), mbox);
    codec_put_u32(priv + offsetof(struct dep_peer_qp_req, mbox_rkey), rkey);
    peerauth_qp_proof(q->dkey, q->token, mbox, rkey,
                      priv + offsetof(struct dep_peer_qp_req, proof));
    if (!q->wrong) /* else qp_redial makes the right one with it */
      sodium_memzero(q->dkey, sizeof q->dkey);
    len = sizeof(struct dep_peer_qp_req);
  }
  struct rdma_conn_param p = conn_param(priv, (uint8_t)len);
  if (R.rd->cm.connect(q->id, &p) != 0)
    rdmaxp__qp_fail(q, "rdma_connect: %s", strerror(errno));
}

/* Whether a link's request (priv) that names q's offer proves the key;
 * one that does not is said at most every XFER_SAY_MS, with a count. */
static bool link_proven(const struct rdmaxp_qp *q, const uint8_t *priv) {
  if (peerauth_qp_check(q->dkey, q->token,
                        codec_get_u64(priv + offsetof(struct dep_peer_qp_req, mbox_addr)),
                        codec_get_u32(priv + offsetof(struct dep_peer_qp_req, mbox_rkey)),
                        priv + offsetof(struct dep_peer_qp_req, proof)))
    return true;
  R.bad_proofs++;
  const uint64_t now = uv_hrtime() / 1000000u;
  if (R.bad_said_ms == 0 || now - R.bad_said_ms >= XFER_SAY_MS) {
    log_warnx("rdma: %llu connection request(s) that named a link's open offer but did not "
              "prove the peer key are rejected: someone who saw the offer on the wire",
              (unsigned long long)R.bad_proofs);
    R.bad_proofs = 0;
    R.bad_said_ms = now;
  }
  return false;
}

/* A connection request on the listener: it must name an open offer and
 * prove the peer key (a link's or a data queue pair's way). */
static void on_connect_request(struct rdma_cm_id *id, const uint8_t *priv, size_t privlen) {
  struct rdmaxp_qp *q = NULL;
  bool said = false;
  if (privlen >= sizeof(struct dep_peer_qp_req))
    for (q = R.qps; q != NULL; q = q->next)
      if (q->acceptor && q->id == NULL &&
          sodium_memcmp(q->token, priv, DEP_PEER_QP_TOKEN_NAME) == 0)
        break;
  if (q != NULL && !link_proven(q, priv)) {
    /* The offer stays open for the link's own request. */
    (void)R.rd->cm.reject(id, NULL, 0);
    (void)R.rd->cm.destroy_id(id);
    return;
  }
  if (q == NULL && privlen >= sizeof(struct dep_xfer_rdma_req) && R.dev_ev != NULL &&
      R.dev_ev->accept != NULL) {
    /* Not a link's: perhaps a data connection, with a token the data path offered. */
    char why[256];
    struct dep_xfer_rdma_req req;
    memcpy(&req, priv, sizeof req);
    void *owner = R.dev_ev->accept(&req, &said);
    sodium_memzero(&req, sizeof req);
    if (owner != NULL && (q = rdmaxp__qp_new(owner, true, true, why, sizeof why)) == NULL) {
      log_warnx("rdma: a data connection cannot be accepted: %s", why);
      (void)R.rd->cm.reject(id, NULL, 0);
      (void)R.rd->cm.destroy_id(id);
      return;
    }
    if (q != NULL) {
      qp_accept(q, id);
      return;
    }
  }
  if (q == NULL) {
    if (!said)
      log_warnx("rdma: a connection request that names no open offer of an authenticated peer "
                "link: rejected");
    (void)R.rd->cm.reject(id, NULL, 0);
    (void)R.rd->cm.destroy_id(id);
    return;
  }
  /* Single use: the token is spent whatever happens next. */
  sodium_memzero(q->token, sizeof q->token);
  sodium_memzero(q->dkey, sizeof q->dkey);
  q->far_mbox = codec_get_u64(priv + offsetof(struct dep_peer_qp_req, mbox_addr));
  q->far_rkey = codec_get_u32(priv + offsetof(struct dep_peer_qp_req, mbox_rkey));
  qp_accept(q, id);
}

static void qp_redial(struct rdmaxp_qp *q);

static void on_cm_event(enum rdma_cm_event_type type, struct rdma_cm_id *id, int status,
                        const uint8_t *priv, size_t privlen) {
  if (type == RDMA_CM_EVENT_CONNECT_REQUEST) {
    on_connect_request(id, priv, privlen);
    return;
  }
  struct rdmaxp_qp *q = id != NULL && id != R.listener ? id->context : NULL;
  if (q == NULL || rdmaxp__qp_by_serial(q->serial) != q)
    return;
  switch (type) {
  case RDMA_CM_EVENT_ADDR_RESOLVED:
    if (R.rd->cm.resolve_route(id, RDMAXP_RESOLVE_MS) != 0)
      rdmaxp__qp_fail(q, "rdma_resolve_route: %s", strerror(errno));
    break;
  case RDMA_CM_EVENT_ROUTE_RESOLVED:
    on_route_resolved(q);
    break;
  case RDMA_CM_EVENT_ESTABLISHED:
    q->connected = true;
    if (q->wrong)
      log_warnx("rdma: a link's connection request with a wrong proof ($" TESTHOOK_RDMA_BAD_PROOFS_ENV
                ") was accepted: the peer opened the queue pair on the token alone");
    if (q->data && R.dev_ev != NULL && R.dev_ev->up != NULL)
      R.dev_ev->up(q->owner, q, priv, privlen);
    else if (!q->data && R.ev != NULL && R.ev->up != NULL)
      R.ev->up(q->owner, q);
    break;
  case RDMA_CM_EVENT_REJECTED:
    q->connected = false;
    if (q->wrong)
      qp_redial(q);
    else
      rdmaxp__qp_fail(q, "the peer rejected the RDMA connection (status %d)", status);
    break;
  case RDMA_CM_EVENT_DISCONNECTED:
    q->connected = false;
    rdmaxp__qp_fail(q, "the RDMA connection was closed by the peer");
    break;
  case RDMA_CM_EVENT_TIMEWAIT_EXIT:
    break;
  default:
    q->connected = false;
    rdmaxp__qp_fail(q, "rdma connection manager: %s (status %d)", R.rd->cm.event_str(type), status);
    break;
  }
}

void rdmaxp__on_ech(uv_poll_t *h, int status, int events) {
  (void)h, (void)status, (void)events;
  struct rdma_cm_event *e;
  while (R.ech != NULL && R.rd->cm.get_cm_event(R.ech, &e) == 0) {
    /* Copy what the handler needs and acknowledge first: destroying an id
     * waits for its events to be acknowledged. */
    enum rdma_cm_event_type type = e->event;
    struct rdma_cm_id *id = e->id;
    int st = e->status;
    uint8_t priv[64];
    size_t privlen = e->param.conn.private_data_len;
    if (privlen > sizeof priv)
      privlen = sizeof priv;
    if (e->param.conn.private_data != NULL)
      memcpy(priv, e->param.conn.private_data, privlen);
    else
      privlen = 0;
    (void)R.rd->cm.ack_cm_event(e);
    on_cm_event(type, id, st, priv, privlen);
  }
}

/* The connecting end, a link's or the data path's: an id on the event
 * channel, resolving the address from src (NULL: any) to dst; the route,
 * the queue pair and the connect follow as events.  -1 with why when it
 * cannot start (q keeps no id). */
static int dial(struct rdmaxp_qp *q, const struct sockaddr *src, const struct sockaddr *dst,
                char *why, size_t whylen) {
  if (R.rd->cm.create_id(R.ech, &q->id, q, RDMA_PS_TCP) != 0) {
    snprintf(why, whylen, "rdma_create_id: %s", strerror(errno));
    q->id = NULL;
    return -1;
  }
  if (R.rd->cm.resolve_addr(q->id, (struct sockaddr *)src, (struct sockaddr *)dst,
                            RDMAXP_RESOLVE_MS) != 0) {
    snprintf(why, whylen, "rdma_resolve_addr: %s", strerror(errno));
    (void)R.rd->cm.destroy_id(q->id);
    q->id = NULL;
    return -1;
  }
  return 0;
}

/* dial, or NULL with why and q freed. */
static struct rdmaxp_qp *qp_dial(struct rdmaxp_qp *q, const struct sockaddr *src,
                                 const struct sockaddr *dst, char *why, size_t whylen) {
  if (dial(q, src, dst, why, whylen) != 0) {
    rdmaxp__qp_free(q);
    return NULL;
  }
  return q;
}

/* The test's request with a wrong proof was rejected: q's id, queue pair
 * and completion queue go, and q dials again with the right proof (its
 * owner keeps q). */
static void qp_redial(struct rdmaxp_qp *q) {
  log_info("rdma: a link's connection request with a wrong proof ($" TESTHOOK_RDMA_BAD_PROOFS_ENV
           ") was rejected; sending ours");
  q->wrong = false;
  q->dkey[0] ^= 1; /* the right key again */
  if (q->id->qp != NULL)
    R.rd->cm.destroy_qp(q->id);
  (void)R.rd->cm.destroy_id(q->id);
  q->id = NULL;
  if (q->cq != NULL)
    (void)R.rd->ibv.destroy_cq(q->cq);
  q->cq = NULL;
  char why[256];
  if (dial(q, (struct sockaddr *)&q->src, (struct sockaddr *)&q->dst, why, sizeof why) != 0)
    rdmaxp__qp_fail(q, "%s", why);
}

struct rdmaxp_qp *rdmaxp_offer(void *owner, const uint8_t dkey[DEP_PEER_MAC_LEN],
                               struct dep_peer_xport *out, char *why, size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "%s", R.why);
    return NULL;
  }
  struct rdmaxp_qp *q = rdmaxp__qp_new(owner, true, false, why, whylen);
  if (q == NULL)
    return NULL;
  randombytes_buf(q->token, sizeof q->token);
  memcpy(q->dkey, dkey, sizeof q->dkey);
  memset(out, 0, sizeof *out);
  out->kind = DEP_PEER_XPORT_RDMA;
  memcpy(out->token, q->token, sizeof out->token);
  out->mbox_addr = (uintptr_t)q->mbox;
  out->mbox_rkey = q->mbox_mr->rkey;
  out->mbox_len = MBOX_BYTES;
  return q;
}

struct rdmaxp_qp *rdmaxp_connect(void *owner, const struct sockaddr *src, const struct sockaddr *dst,
                                 const struct dep_peer_xport *offer,
                                 const uint8_t dkey[DEP_PEER_MAC_LEN], char *why, size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "%s", R.why);
    return NULL;
  }
  if (offer->mbox_len < MBOX_BYTES) {
    snprintf(why, whylen, "the peer's mailbox of %u bytes is smaller than %u",
             (unsigned)offer->mbox_len, MBOX_BYTES);
    return NULL;
  }
  struct rdmaxp_qp *q = rdmaxp__qp_new(owner, false, false, why, whylen);
  if (q == NULL)
    return NULL;
  memcpy(q->token, offer->token, sizeof q->token);
  memcpy(q->dkey, dkey, sizeof q->dkey);
  if (R.test_bad_proofs > 0) {
    /* The test's request goes first, its proof made with a key one bit
     * off: without the key. */
    R.test_bad_proofs--;
    q->wrong = true;
    q->dkey[0] ^= 1;
    memcpy(&q->src, src, src->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                     : sizeof(struct sockaddr_in));
    memcpy(&q->dst, dst, dst->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                     : sizeof(struct sockaddr_in));
  }
  q->far_mbox = offer->mbox_addr;
  q->far_rkey = offer->mbox_rkey;
  return qp_dial(q, src, dst, why, whylen);
}

void rdmaxp_set_data_events(const struct rdmaxp_data_events *ev) { R.dev_ev = ev; }

struct rdmaxp_qp *rdmaxp_data_connect(void *owner, const struct sockaddr *dst,
                                      const uint8_t token[DEP_PEER_TOKEN_LEN],
                                      const uint8_t proof[DEP_XFER_RDMA_PROOF_LEN], char *why,
                                      size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "%s", R.why);
    return NULL;
  }
  struct rdmaxp_qp *q = rdmaxp__qp_new(owner, false, true, why, whylen);
  if (q == NULL)
    return NULL;
  memcpy(q->token, token, sizeof q->token);
  memcpy(q->proof, proof, sizeof q->proof);
  return qp_dial(q, NULL, dst, why, whylen);
}

