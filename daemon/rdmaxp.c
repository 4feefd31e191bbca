/*
 * rdmaxp.c — the RDMA transport (rdmaxp.h): the device and the connection
 * manager's listener, one queue pair with its own completion queue per
 * peer link, and the mailbox keep-alive; the manager's events and the
 * connections they make are rdmaxp_cm.c's.  Reached through the dlopen
 * seam (rdmadrv.h); the inline verbs (post_send, post_recv, poll_cq,
 * req_notify_cq) come from the header.
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

#include "deepep.h"
#include "log.h"
#include "rdmadrv.h"
#include "rdmaxp_internal.h"
#include "testhooks.h"

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

struct rdmaxp_state rdmaxp__state;

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

void rdmaxp_dereg(struct ibv_mr *mr) {
  if (mr != NULL && R.rd != NULL)
    (void)R.rd->ibv.dereg_mr(mr);
}

uint32_t rdmaxp_mr_rkey(const struct ibv_mr *mr) { return mr != NULL ? mr->rkey : 0; }
uint32_t rdmaxp_mr_lkey(const struct ibv_mr *mr) { return mr != NULL ? mr->lkey : 0; }

/* ---- queue pairs ------------------------------------------------------------- */

struct rdmaxp_qp *rdmaxp__qp_new(void *owner, bool acceptor, bool data, char *why,
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

void rdmaxp__qp_free(struct rdmaxp_qp *q) {
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

void rdmaxp__qp_fail(struct rdmaxp_qp *q, const char *fmt, ...) {
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
    rdmaxp__qp_free(q);
    return;
  }
  rdmaxp__qp_free(q);
  if (R.ev != NULL && R.ev->down != NULL)
    R.ev->down(owner, why);
}

struct rdmaxp_qp *rdmaxp__qp_by_serial(uint64_t serial) {
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
int rdmaxp__qp_create(struct rdmaxp_qp *q, char *why, size_t whylen) {
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
 * rdma_accept frees q (rdmaxp__qp_fail). */
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
    rdmaxp__qp_fail(q, "ibv_post_send of a keep-alive failed");
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
      rdmaxp__qp_fail(q, "ibv_post_send of a keep-alive answer failed");
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
        rdmaxp__qp_fail(q, "%s failed: %s",
                        wc[i].opcode & IBV_WC_RECV ? "a receive" : "an RDMA write",
                        R.rd->ibv.wc_status_str(wc[i].status));
        return false;
      }
      if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        if (post_recv(q) != 0) {
          rdmaxp__qp_fail(q, "ibv_post_recv failed");
          return false;
        }
        uint64_t serial = q->serial;
        on_imm(q, ntohl(wc[i].imm_data));
        if (rdmaxp__qp_by_serial(serial) == NULL)
          return false;
      }
    }
  }
  if (n < 0) {
    rdmaxp__qp_fail(q, "ibv_poll_cq failed");
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
    struct rdmaxp_qp *q = rdmaxp__qp_by_serial((uint64_t)(uintptr_t)ctx);
    if (q == NULL)
      continue;
    /* Ask for the next event before draining, so that none is lost between. */
    if (ibv_req_notify_cq(q->cq, 0) != 0) {
      rdmaxp__qp_fail(q, "ibv_req_notify_cq failed");
      continue;
    }
    (void)qp_poll(q);
  }
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
    rdmaxp__qp_free(q);
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
  uv_poll_start(&R.ech_poll, UV_READABLE, rdmaxp__on_ech);
  uv_poll_start(&R.cch_poll, UV_READABLE, on_cch);
  return true;
}

static void rdmaxp_teardown(void) {
  while (R.qps != NULL)
    rdmaxp__qp_free(R.qps);
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
  R.test_bad_proofs = testhook_value(TESTHOOK_RDMA_BAD_PROOFS);
  log_info("rdma: peer links on %s%s%s", R.dev,
           cfg->listen_address[0] ? ", listening on " : " (no listener: listen.address unset)",
           cfg->listen_address);
  return 0;
}

void rdmaxp_fini(void) {
  if (R.rd != NULL)
    rdmaxp_teardown();
}
