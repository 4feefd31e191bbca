/*
 * rdmaxp.c — the RDMA transport (rdmaxp.h): the device, the connection
 * manager's listener and events, one queue pair with its own completion
 * queue per peer link, and the mailbox keep-alive.  Reached through the
 * dlopen seam (rdmadrv.h); the inline verbs (post_send, post_recv,
 * poll_cq, req_notify_cq) come from the header.
 */
#include "rdmaxp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "deepep.h"
#include "log.h"
#include "peerauth.h"
#include "rdmadrv.h"
#include "xfer.h"

/* Receives kept posted per queue pair: a write with immediate data consumes one. */
#define RDMA_RECV_DEPTH 32
#define RDMA_SEND_DEPTH 64
#define RDMA_CQ_DEPTH (RDMA_RECV_DEPTH + RDMA_SEND_DEPTH)
/* A data queue pair's send queue (rdmaxp_data_depth), and the completion
 * queue that holds its completions, which can be no more than its sends. */
#define RDMA_DATA_DEPTH 512
/* The keep-alive's immediate values, above what the data path may use. */
#define RDMA_IMM_PING 0xfffffff0u
#define RDMA_IMM_PONG 0xfffffff1u
/* The mailbox: incoming ping stamp, incoming pong stamp, outgoing ping, outgoing pong. */
#define MBOX_BYTES 64u
#define MBOX_PING_IN 0u
#define MBOX_PONG_IN 8u
#define MBOX_PING_OUT 16u
#define MBOX_PONG_OUT 24u
/* What an RC connection request's private data holds: a link's is
 * peer_proto.h's dep_peer_qp_req, a data queue pair's xring.h's
 * dep_xfer_rdma_req. */
#define PRIV_MAX 56
_Static_assert(sizeof(struct dep_peer_qp_req) <= PRIV_MAX,
               "RC connection private data holds 56 bytes");
_Static_assert(sizeof(struct dep_xfer_rdma_req) <= PRIV_MAX &&
                   sizeof((struct dep_xfer_rdma_req *)0)->token == DEP_PEER_TOKEN_LEN,
               "a data queue pair's request is its token, version and proof");

struct rdmaxp_qp {
  struct rdmaxp_qp *next;
  uint64_t serial;          /* what its completion queue's context names */
  void *owner;
  bool acceptor;
  bool data;                /* a data path queue pair (rdmaxp_data_connect or the data hook) */
  struct rdma_cm_id *id;    /* NULL: an offer not yet taken */
  struct ibv_cq *cq;
  bool connected;
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint8_t proof[DEP_XFER_RDMA_PROOF_LEN]; /* a data queue pair's, connecting */
  /* A link's: the key its connection request's proof is made with (the
   * connecting end's direction), until the request is made or accepted. */
  uint8_t dkey[DEP_PEER_MAC_LEN];
  /* A link's connecting end, the test's request with a wrong proof
   * (RDMAXP_TEST_BAD_PROOFS_ENV) out: dialled again from src to dst with
   * the right one once it is rejected. */
  bool wrong;
  struct sockaddr_storage src, dst;
  uint8_t *mbox;
  struct ibv_mr *mbox_mr;
  uint64_t far_mbox;
  uint32_t far_rkey;
  uint64_t ping_sent_ms;    /* 0: none out */
  uint64_t ping_stamp_us;
};

static struct {
  const struct rdmadrv *rd;
  uv_loop_t *loop;
  const struct rdmaxp_events *ev;
  bool active;
  char why[256];
  char dev[64];
  struct ibv_context **devs; /* rdma_get_devices: the contexts the manager uses */
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_comp_channel *cch;
  uv_poll_t cch_poll;
  struct rdma_event_channel *ech;
  uv_poll_t ech_poll;
  struct rdma_cm_id *listener;
  struct rdmaxp_qp *qps;
  uint64_t serial;
  const struct rdmaxp_data_events *dev_ev; /* the data path's hooks; NULL: none */
  /* Links' connection requests that named an offer but did not prove the
   * key since the last line about them, and when that was (XFER_SAY_MS). */
  uint64_t bad_proofs, bad_said_ms;
  int test_bad_proofs;      /* $DEEPEPD_TEST_RDMA_BAD_PROOFS left to do for links */
} R;

bool rdmaxp_active(void) { return R.active; }
const char *rdmaxp_why(void) { return R.active ? "" : R.why; }
const char *rdmaxp_device(void) { return R.active ? R.dev : ""; }

static void set_why(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_why(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(R.why, sizeof R.why, fmt, ap);
  va_end(ap);
}

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 ? -1 : 0;
}

/* ---- memory ---------------------------------------------------------------- */

#define MR_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

static int reg_fail(const char *what, int e, char *why, size_t whylen) {
  snprintf(why, whylen, "%s on %s: %s%s", what, R.dev, strerror(e),
           e == ENOMEM || e == EAGAIN ? " (raise RLIMIT_MEMLOCK: LimitMEMLOCK=infinity in the unit)"
                                      : "");
  return e == ENOMEM || e == EAGAIN ? DEP_ERR_NO_MEMORY
         : e == EOPNOTSUPP || e == ENOSYS ? DEP_ERR_UNSUPPORTED
                                          : DEP_ERR_IO;
}

int rdmaxp_reg_host(void *addr, size_t len, struct ibv_mr **mr, char *why, size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "no RDMA device: %s", R.why);
    return DEP_ERR_UNSUPPORTED;
  }
  errno = 0;
  *mr = R.rd->ibv.reg_mr(R.pd, addr, len, MR_ACCESS);
  return *mr != NULL ? 0 : reg_fail("ibv_reg_mr", errno ? errno : EINVAL, why, whylen);
}

int rdmaxp_reg_dmabuf(int fd, uint64_t offset, size_t len, uint64_t iova, struct ibv_mr **mr,
                    char *why, size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "no RDMA device: %s", R.why);
    return DEP_ERR_UNSUPPORTED;
  }
  if (R.rd->ibv.reg_dmabuf_mr == NULL) {
    snprintf(why, whylen, "libibverbs lacks ibv_reg_dmabuf_mr (rdma-core 34 or later needed)");
    return DEP_ERR_UNSUPPORTED;
  }
  errno = 0;
  *mr = R.rd->ibv.reg_dmabuf_mr(R.pd, offset, len, iova, fd, MR_ACCESS);
  return *mr != NULL ? 0 : reg_fail("ibv_reg_dmabuf_mr", errno ? errno : EINVAL, why, whylen);
}

void rdmaxp_dereg(struct ibv_mr *mr) {
  if (mr != NULL && R.rd != NULL)
    (void)R.rd->ibv.dereg_mr(mr);
}

uint32_t rdmaxp_mr_rkey(const struct ibv_mr *mr) { return mr != NULL ? mr->rkey : 0; }
uint32_t rdmaxp_mr_lkey(const struct ibv_mr *mr) { return mr != NULL ? mr->lkey : 0; }

/* ---- queue pairs ------------------------------------------------------------- */

static struct rdmaxp_qp *qp_new(void *owner, bool acceptor, bool data, char *why,
                               size_t whylen) {
  struct rdmaxp_qp *q = calloc(1, sizeof *q);
  if (q == NULL || (!data && posix_memalign((void **)&q->mbox, MBOX_BYTES, MBOX_BYTES) != 0)) {
    free(q);
    snprintf(why, whylen, "out of memory");
    return NULL;
  }
  /* A data queue pair has no keep-alive, so no mailbox: its link has both. */
  if (!data) {
    memset(q->mbox, 0, MBOX_BYTES);
    if (rdmaxp_reg_host(q->mbox, MBOX_BYTES, &q->mbox_mr, why, whylen) != 0) {
      free(q->mbox);
      free(q);
      return NULL;
    }
  }
  q->owner = owner;
  q->acceptor = acceptor;
  q->data = data;
  q->serial = ++R.serial;
  q->next = R.qps;
  R.qps = q;
  return q;
}

static void qp_unlink(struct rdmaxp_qp *q) {
  for (struct rdmaxp_qp **pp = &R.qps; *pp != NULL; pp = &(*pp)->next)
    if (*pp == q) {
      *pp = q->next;
      return;
    }
}

static void qp_free(struct rdmaxp_qp *q) {
  qp_unlink(q);
  if (q->id != NULL) {
    if (q->connected)
      (void)R.rd->cm.disconnect(q->id);
    if (q->id->qp != NULL)
      R.rd->cm.destroy_qp(q->id);
    (void)R.rd->cm.destroy_id(q->id);
  }
  if (q->cq != NULL)
    (void)R.rd->ibv.destroy_cq(q->cq);
  rdmaxp_dereg(q->mbox_mr);
  free(q->mbox);
  sodium_memzero(q, sizeof *q);
  free(q);
}

static void qp_fail(struct rdmaxp_qp *q, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void qp_fail(struct rdmaxp_qp *q, const char *fmt, ...) {
  char why[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  void *owner = q->owner;
  if (q->data) {
    /* Its owner's threads may be posting on it: they let go first. */
    if (R.dev_ev != NULL && R.dev_ev->down != NULL)
      R.dev_ev->down(owner, q, why);
    qp_free(q);
    return;
  }
  qp_free(q);
  if (R.ev != NULL && R.ev->down != NULL)
    R.ev->down(owner, why);
}

static struct rdmaxp_qp *qp_by_serial(uint64_t serial) {
  for (struct rdmaxp_qp *q = R.qps; q != NULL; q = q->next)
    if (q->serial == serial)
      return q;
  return NULL;
}

static int post_recv(struct rdmaxp_qp *q) {
  struct ibv_recv_wr wr = {.wr_id = q->serial, .sg_list = NULL, .num_sge = 0}, *bad = NULL;
  return ibv_post_recv(q->id->qp, &wr, &bad);
}

/*
 * The queue pair on q->id with its completion queue, by role.  A link's
 * completions come on the shared channel (the loop waits on it), its
 * receives are posted (a write with immediate data consumes one) and
 * every send is signalled.  A data queue pair is the proxy's: no channel
 * (its thread polls the queue itself), nothing received (plain writes
 * consume no receive), and only the sends it asks for signalled.
 */
static int qp_create(struct rdmaxp_qp *q, char *why, size_t whylen) {
  if (q->id->verbs != R.ctx) {
    snprintf(why, whylen, "the route uses RDMA device %s, deepepd registers its memory with %s",
             q->id->verbs != NULL ? q->id->verbs->device->name : "(none)", R.dev);
    return -1;
  }
  q->cq = q->data ? R.rd->ibv.create_cq(R.ctx, RDMA_DATA_DEPTH, NULL, NULL, 0)
                  : R.rd->ibv.create_cq(R.ctx, RDMA_CQ_DEPTH, (void *)(uintptr_t)q->serial,
                                        R.cch, 0);
  if (q->cq == NULL) {
    snprintf(why, whylen, "ibv_create_cq: %s", strerror(errno));
    return -1;
  }
  struct ibv_qp_init_attr a = {
      .send_cq = q->cq,
      .recv_cq = q->cq,
      .cap = {.max_send_wr = q->data ? RDMA_DATA_DEPTH : RDMA_SEND_DEPTH,
              .max_recv_wr = q->data ? 1 : RDMA_RECV_DEPTH,
              .max_send_sge = 1,
              .max_recv_sge = 1},
      .qp_type = IBV_QPT_RC,
      .sq_sig_all = q->data ? 0 : 1,
  };
  if (R.rd->cm.create_qp(q->id, R.pd, &a) != 0) {
    snprintf(why, whylen, "rdma_create_qp: %s", strerror(errno));
    return -1;
  }
  if (q->data)
    return 0;
  if (ibv_req_notify_cq(q->cq, 0) != 0) {
    snprintf(why, whylen, "ibv_req_notify_cq failed");
    return -1;
  }
  for (int i = 0; i < RDMA_RECV_DEPTH; i++)
    if (post_recv(q) != 0) {
      snprintf(why, whylen, "ibv_post_recv failed");
      return -1;
    }
  return 0;
}

static int post_write_imm(struct rdmaxp_qp *q, uint32_t local_off, uint32_t far_off, uint32_t imm) {
  struct ibv_sge sge = {.addr = (uintptr_t)(q->mbox + local_off), .length = 8,
                        .lkey = q->mbox_mr->lkey};
  struct ibv_send_wr wr = {
      .wr_id = q->serial,
      .sg_list = &sge,
      .num_sge = 1,
      .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
      .imm_data = htonl(imm),
      .wr = {.rdma = {.remote_addr = q->far_mbox + far_off, .rkey = q->far_rkey}},
  }, *bad = NULL;
  return ibv_post_send(q->id->qp, &wr, &bad);
}

/* An offer's id is set when a connection request takes it; a failed
 * rdma_accept frees q (qp_fail). */
bool rdmaxp_qp_accepted(const struct rdmaxp_qp *q) {
  return q != NULL && q->acceptor && q->id != NULL;
}

uint64_t rdmaxp_ping(struct rdmaxp_qp *q, uint64_t now_ms) {
  if (!q->connected)
    return 0;
  if (q->ping_sent_ms != 0)
    return now_ms - q->ping_sent_ms;
  q->ping_stamp_us = uv_hrtime() / 1000u;
  memcpy(q->mbox + MBOX_PING_OUT, &q->ping_stamp_us, 8);
  if (post_write_imm(q, MBOX_PING_OUT, MBOX_PING_IN, RDMA_IMM_PING) != 0) {
    qp_fail(q, "ibv_post_send of a keep-alive failed");
    return 0;
  }
  q->ping_sent_ms = now_ms != 0 ? now_ms : 1;
  return 0;
}

/* A write with immediate data arrived in q's mailbox. */
static void on_imm(struct rdmaxp_qp *q, uint32_t imm) {
  if (imm == RDMA_IMM_PING) {
    /* Echo the far end's stamp back into its mailbox. */
    memcpy(q->mbox + MBOX_PONG_OUT, q->mbox + MBOX_PING_IN, 8);
    if (post_write_imm(q, MBOX_PONG_OUT, MBOX_PONG_IN, RDMA_IMM_PONG) != 0)
      qp_fail(q, "ibv_post_send of a keep-alive answer failed");
  } else if (imm == RDMA_IMM_PONG) {
    uint64_t stamp;
    memcpy(&stamp, q->mbox + MBOX_PONG_IN, 8);
    uint64_t now_us = uv_hrtime() / 1000u;
    q->ping_sent_ms = 0;
    if (stamp == q->ping_stamp_us && now_us >= stamp && R.ev != NULL && R.ev->pong != NULL)
      R.ev->pong(q->owner, now_us - stamp);
  } else {
    log_warnx("rdma: a write with immediate 0x%08x came on a queue pair that carries no data "
              "path yet; ignored", (unsigned)imm);
  }
}

/* Drain q's completion queue; false when q failed (and is freed). */
static bool qp_poll(struct rdmaxp_qp *q) {
  struct ibv_wc wc[16];
  int n;
  while ((n = ibv_poll_cq(q->cq, 16, wc)) > 0) {
    for (int i = 0; i < n; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        qp_fail(q, "%s failed: %s", wc[i].opcode & IBV_WC_RECV ? "a receive" : "an RDMA write",
                R.rd->ibv.wc_status_str(wc[i].status));
        return false;
      }
      if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        if (post_recv(q) != 0) {
          qp_fail(q, "ibv_post_recv failed");
          return false;
        }
        uint64_t serial = q->serial;
        on_imm(q, ntohl(wc[i].imm_data));
        if (qp_by_serial(serial) == NULL)
          return false;
      }
    }
  }
  if (n < 0) {
    qp_fail(q, "ibv_poll_cq failed");
    return false;
  }
  return true;
}

static void on_cch(uv_poll_t *h, int status, int events) {
  (void)h, (void)status, (void)events;
  struct ibv_cq *cq;
  void *ctx;
  while (R.rd->ibv.get_cq_event(R.cch, &cq, &ctx) == 0) {
    R.rd->ibv.ack_cq_events(cq, 1);
    struct rdmaxp_qp *q = qp_by_serial((uint64_t)(uintptr_t)ctx);
    if (q == NULL)
      continue;
    /* Ask for the next event before draining, so that none is lost between. */
    if (ibv_req_notify_cq(q->cq, 0) != 0) {
      qp_fail(q, "ibv_req_notify_cq failed");
      continue;
    }
    (void)qp_poll(q);
  }
}

/* ---- the connection manager ---------------------------------------------------- */

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
  if (qp_create(q, why, sizeof why) != 0) {
    (void)R.rd->cm.reject(id, NULL, 0);
    qp_fail(q, "%s", why);
    return;
  }
  struct rdma_conn_param p = conn_param(NULL, 0);
  if (R.rd->cm.accept(id, &p) != 0)
    qp_fail(q, "rdma_accept: %s", strerror(errno));
}

static void on_route_resolved(struct rdmaxp_qp *q) {
  char why[256];
  if (qp_create(q, why, sizeof why) != 0) {
    qp_fail(q, "%s", why);
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
    qp_fail(q, "rdma_connect: %s", strerror(errno));
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
    if (owner != NULL && (q = qp_new(owner, true, true, why, sizeof why)) == NULL) {
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
  if (q == NULL || qp_by_serial(q->serial) != q)
    return;
  switch (type) {
  case RDMA_CM_EVENT_ADDR_RESOLVED:
    if (R.rd->cm.resolve_route(id, RDMAXP_RESOLVE_MS) != 0)
      qp_fail(q, "rdma_resolve_route: %s", strerror(errno));
    break;
  case RDMA_CM_EVENT_ROUTE_RESOLVED:
    on_route_resolved(q);
    break;
  case RDMA_CM_EVENT_ESTABLISHED:
    q->connected = true;
    if (q->wrong)
      log_warnx("rdma: a link's connection request with a wrong proof ($" RDMAXP_TEST_BAD_PROOFS_ENV
                ") was accepted: the peer opened the queue pair on the token alone");
    if (q->data && R.dev_ev != NULL && R.dev_ev->up != NULL)
      R.dev_ev->up(q->owner, q);
    else if (!q->data && R.ev != NULL && R.ev->up != NULL)
      R.ev->up(q->owner, q);
    break;
  case RDMA_CM_EVENT_REJECTED:
    q->connected = false;
    if (q->wrong)
      qp_redial(q);
    else
      qp_fail(q, "the peer rejected the RDMA connection (status %d)", status);
    break;
  case RDMA_CM_EVENT_DISCONNECTED:
    q->connected = false;
    qp_fail(q, "the RDMA connection was closed by the peer");
    break;
  case RDMA_CM_EVENT_TIMEWAIT_EXIT:
    break;
  default:
    q->connected = false;
    qp_fail(q, "rdma connection manager: %s (status %d)", R.rd->cm.event_str(type), status);
    break;
  }
}

static void on_ech(uv_poll_t *h, int status, int events) {
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
    qp_free(q);
    return NULL;
  }
  return q;
}

/* The test's request with a wrong proof was rejected: q's id, queue pair
 * and completion queue go, and q dials again with the right proof (its
 * owner keeps q). */
static void qp_redial(struct rdmaxp_qp *q) {
  log_info("rdma: a link's connection request with a wrong proof ($" RDMAXP_TEST_BAD_PROOFS_ENV
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
    qp_fail(q, "%s", why);
}

struct rdmaxp_qp *rdmaxp_offer(void *owner, const uint8_t dkey[DEP_PEER_MAC_LEN],
                               struct dep_peer_xport *out, char *why, size_t whylen) {
  if (!R.active) {
    snprintf(why, whylen, "%s", R.why);
    return NULL;
  }
  struct rdmaxp_qp *q = qp_new(owner, true, false, why, whylen);
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
  struct rdmaxp_qp *q = qp_new(owner, false, false, why, whylen);
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
  struct rdmaxp_qp *q = qp_new(owner, false, true, why, whylen);
  if (q == NULL)
    return NULL;
  memcpy(q->token, token, sizeof q->token);
  memcpy(q->proof, proof, sizeof q->proof);
  return qp_dial(q, NULL, dst, why, whylen);
}

struct ibv_qp *rdmaxp_qp_verbs(const struct rdmaxp_qp *q) {
  return q != NULL && q->id != NULL ? q->id->qp : NULL;
}
struct ibv_cq *rdmaxp_qp_cq(const struct rdmaxp_qp *q) { return q != NULL ? q->cq : NULL; }
uint32_t rdmaxp_data_depth(void) { return RDMA_DATA_DEPTH; }
const char *rdmaxp_wc_status(int status) {
  return R.rd != NULL ? R.rd->ibv.wc_status_str((enum ibv_wc_status)status) : "?";
}

void rdmaxp_close(struct rdmaxp_qp *q) {
  if (q != NULL)
    qp_free(q);
}

/* ---- start and stop --------------------------------------------------------------- */

static bool rdmaxp_wanted(const struct config *cfg) {
  for (size_t i = 0; i < cfg->n_peers; i++)
    if (config_peer_transport(cfg, &cfg->peers[i]) != CONFIG_TRANSPORT_TCP)
      return true;
  /* A listener with no peers of its own still answers the peers that list it. */
  return cfg->n_peers == 0 && cfg->listen_address[0] != '\0' &&
         cfg->transport != CONFIG_TRANSPORT_TCP;
}

static bool rdmaxp_required(const struct config *cfg) {
  if (cfg->transport == CONFIG_TRANSPORT_RDMA && cfg->listen_address[0] != '\0')
    return true;
  for (size_t i = 0; i < cfg->n_peers; i++)
    if (config_peer_transport(cfg, &cfg->peers[i]) == CONFIG_TRANSPORT_RDMA)
      return true;
  return false;
}

/* Open the device and the listener; false with R.why set. */
static bool rdmaxp_open(const struct config *cfg) {
  char why[256];
  R.rd = rdmadrv_load(why, sizeof why);
  if (R.rd == NULL) {
    set_why("%s", why);
    return false;
  }
  int n = 0;
  R.devs = R.rd->cm.get_devices(&n);
  if (R.devs == NULL || n == 0) {
    set_why("no RDMA devices");
    return false;
  }
  R.ech = R.rd->cm.create_event_channel();
  if (R.ech == NULL || set_nonblocking(R.ech->fd) != 0) {
    set_why("rdma_create_event_channel: %s", strerror(errno));
    return false;
  }
  if (R.rd->cm.create_id(R.ech, &R.listener, NULL, RDMA_PS_TCP) != 0) {
    R.listener = NULL;
    set_why("rdma_create_id: %s", strerror(errno));
    return false;
  }
  /* The listener binds where the TCP one does; its device is the one the
   * peers' connections arrive on, so memory is registered there. */
  if (cfg->listen_address[0] != '\0') {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_flags = AI_NUMERICSERV | AI_PASSIVE},
                    *ai = NULL;
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)cfg->listen_port);
    int g = getaddrinfo(cfg->listen_address, port, &hints, &ai);
    if (g != 0) {
      set_why("listen.address %s: %s", cfg->listen_address, gai_strerror(g));
      return false;
    }
    int rc = R.rd->cm.bind_addr(R.listener, ai->ai_addr);
    int e = errno;
    freeaddrinfo(ai);
    if (rc != 0) {
      set_why("rdma_bind_addr %s:%u: %s%s", cfg->listen_address, (unsigned)cfg->listen_port,
              strerror(e), e == EADDRNOTAVAIL || e == ENODEV ? " (no RDMA device has that address)" : "");
      return false;
    }
    if (R.rd->cm.listen(R.listener, 64) != 0) {
      set_why("rdma_listen %s:%u: %s", cfg->listen_address, (unsigned)cfg->listen_port,
              strerror(errno));
      return false;
    }
  }
  R.ctx = R.listener->verbs != NULL ? R.listener->verbs : R.devs[0];
  snprintf(R.dev, sizeof R.dev, "%s", R.ctx->device->name);
  R.pd = R.rd->ibv.alloc_pd(R.ctx);
  if (R.pd == NULL) {
    set_why("ibv_alloc_pd on %s: %s", R.dev, strerror(errno));
    return false;
  }
  R.cch = R.rd->ibv.create_comp_channel(R.ctx);
  if (R.cch == NULL || set_nonblocking(R.cch->fd) != 0) {
    set_why("ibv_create_comp_channel on %s: %s", R.dev, strerror(errno));
    return false;
  }
  if (uv_poll_init(R.loop, &R.ech_poll, R.ech->fd) != 0 ||
      uv_poll_init(R.loop, &R.cch_poll, R.cch->fd) != 0) {
    set_why("uv_poll_init failed");
    return false;
  }
  uv_poll_start(&R.ech_poll, UV_READABLE, on_ech);
  uv_poll_start(&R.cch_poll, UV_READABLE, on_cch);
  return true;
}

static void rdmaxp_teardown(void) {
  while (R.qps != NULL)
    qp_free(R.qps);
  if (R.listener != NULL)
    (void)R.rd->cm.destroy_id(R.listener);
  R.listener = NULL;
  if (R.cch != NULL) {
    if (uv_is_active((uv_handle_t *)&R.cch_poll) || R.cch_poll.loop != NULL)
      uv_close((uv_handle_t *)&R.cch_poll, NULL);
    (void)R.rd->ibv.destroy_comp_channel(R.cch);
  }
  R.cch = NULL;
  if (R.pd != NULL)
    (void)R.rd->ibv.dealloc_pd(R.pd);
  R.pd = NULL;
  if (R.ech != NULL) {
    if (R.ech_poll.loop != NULL)
      uv_close((uv_handle_t *)&R.ech_poll, NULL);
    R.rd->cm.destroy_event_channel(R.ech);
  }
  R.ech = NULL;
  if (R.devs != NULL)
    R.rd->cm.free_devices(R.devs);
  R.devs = NULL;
  R.ctx = NULL;
  R.active = false;
}

int rdmaxp_init(uv_loop_t *loop, const struct config *cfg, const struct rdmaxp_events *ev) {
  R.loop = loop;
  R.ev = ev;
  if (!rdmaxp_wanted(cfg)) {
    set_why(cfg->n_peers == 0 && cfg->listen_address[0] == '\0' ? "no peers configured"
                                                                 : "transport: tcp");
    return 0;
  }
  if (sodium_init() < 0) {
    set_why("libsodium failed to initialise");
    return -1;
  }
  if (!rdmaxp_open(cfg)) {
    rdmaxp_teardown();
    if (rdmaxp_required(cfg)) {
      log_errx("transport: rdma, but %s: deepepd cannot start (use transport: auto to fall back "
               "to TCP, or fix the RDMA set-up)", R.why);
      return -1;
    }
    /* With no device to open, the probe at start (rdmadrv_probe_log) says
     * that peers use TCP, and why, in a line of its own: this one would say
     * it a second time in other words.  Only a failure past the probe
     * (devices that the connection manager cannot use) is news. */
    if (rdmadrv_probe(NULL, 0) > 0)
      log_info("rdma: %s: peer links use TCP", R.why);
    return 0;
  }
  R.active = true;
  const char *t = getenv(RDMAXP_TEST_BAD_PROOFS_ENV);
  R.test_bad_proofs = t != NULL ? atoi(t) : 0;
  log_info("rdma: peer links on %s%s%s", R.dev,
           cfg->listen_address[0] ? ", listening on " : " (no listener: listen.address unset)",
           cfg->listen_address);
  return 0;
}

void rdmaxp_fini(void) {
  if (R.rd != NULL)
    rdmaxp_teardown();
}
