/*
 * xfer_rdma_stage.c — the staging through which a node channel's chunk
 * crosses once per destination node over RDMA (xfer_rdma.h, xring.h's
 * dep_xfer_rdma_stage): ours for each peer, made and named in our
 * acceptance of its data queue pair (the loop); the frames a proxy thread
 * copies and writes into a peer's, and those it takes from ours, fans out
 * through the data path's own checks (xfer_stage_fn) and credits back.
 */
#include "xfer_rdma.h"

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "peer.h"
#include "rdmaxp.h"
#include "xfer_rdma_internal.h"

/* ---- the loop: our staging for each peer, and the peer's for us ---------------------- */

static _Atomic uint64_t *stage_word(const struct xr_peer *p, uint64_t off) {
  return (_Atomic uint64_t *)(p->stage + off);
}

/* Our staging for peer k, made and registered once (the loop): false when
 * it cannot be (said once), and NODE frames go over TCP. */
static bool stage_ensure(int k) {
  struct xr_peer *p = &XR.p[k];
  if (p->stage != NULL || p->stage_failed)
    return p->stage != NULL;
  uint8_t *m = aligned_alloc(4096, (XR_STAGE_LEN + 4095u) / 4096u * 4096u);
  char why[256] = "out of memory";
  struct ibv_mr *mr = NULL;
  if (m != NULL) {
    memset(m, 0, XR_STAGE_LEN);
    if (rdmaxp_reg_host(m, XR_STAGE_LEN, &mr, why, sizeof why) != 0) {
      free(m);
      m = NULL;
    }
  }
  if (m == NULL) {
    log_warnx("peer %s: no staging for its node channels' frames (%s): they go over TCP",
              peer_name(k), why);
    p->stage_failed = true;
    return false;
  }
  atomic_store_explicit((_Atomic uint64_t *)(m + XR_STAGE_FREED), 1, memory_order_relaxed);
  pthread_mutex_lock(&p->in_mu);
  p->stage = m;
  p->stage_mr = mr;
  pthread_mutex_unlock(&p->in_mu);
  atomic_fetch_or(&XR.staging, 1ull << k);
  return true;
}

/* Post the write of our count of peer k's freed chunks into its staging's
 * credit word, at once (the loop; mu held): when our queue pair into it
 * comes up and when a new one of its is accepted, so that it learns that
 * we can credit it, and from what count.  Skipped when the send queue is
 * full: a chunk taken later credits the same word. */
void xfer_rdma__stage_credit_now(int k, struct xr_peer *p) {
  if (p->out == NULL || !atomic_load(&p->ready) || p->broken || !p->far_known ||
      p->stage == NULL || p->posted - p->done >= rdmaxp_data_depth())
    return;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)(p->stage + XR_STAGE_FREED),
                        .length = sizeof(uint64_t), .lkey = rdmaxp_mr_lkey(p->stage_mr)};
  struct ibv_send_wr wr = {.wr_id = p->posted + 1, .sg_list = &sge, .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED},
                     *bad = NULL;
  wr.wr.rdma.remote_addr = p->far.addr + XR_STAGE_CREDIT;
  wr.wr.rdma.rkey = p->far.rkey;
  int rc = ibv_post_send(rdmaxp_qp_verbs(p->out), &wr, &bad);
  if (rc != 0) {
    log_warnx("peer %s: ibv_post_send of a staging credit failed: %s; its jobs fail",
              peer_name(k), strerror(rc));
    p->broken = true;
    atomic_store(&p->ready, false);
    return;
  }
  p->posted++;
}

/* Our acceptance of peer k's data queue pair: our staging for it, whose
 * chunks it writes from 0 again (its count starts anew with the queue
 * pair), and, if we can already credit it, that we can. */
size_t xfer_rdma__stage_reply(void *owner, uint8_t *priv, size_t max) {
  const struct xr_end *e = owner;
  struct xr_peer *p = &XR.p[e->peer];
  if (e->out || max < sizeof(struct dep_xfer_rdma_stage) || !stage_ensure(e->peer))
    return 0;
  pthread_mutex_lock(&p->in_mu);
  p->in_next = 0;
  for (uint32_t i = 0; i < XR_STAGE_CHUNKS; i++)
    atomic_store_explicit(stage_word(p, XR_STAGE_IN(i)), 0, memory_order_relaxed);
  atomic_store_explicit(stage_word(p, XR_STAGE_FREED), 1, memory_order_relaxed);
  pthread_mutex_lock(&p->mu);
  xfer_rdma__stage_credit_now(e->peer, p);
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->in_mu);
  const struct dep_xfer_rdma_stage st = {.addr = (uint64_t)(uintptr_t)p->stage,
                                         .rkey = rdmaxp_mr_rkey(p->stage_mr),
                                         .chunks = XR_STAGE_CHUNKS,
                                         .chunk_bytes = XR_STAGE_BYTES};
  memcpy(priv, &st, sizeof st);
  return sizeof st;
}

/* The peer's staging for us, from its acceptance of our queue pair: used
 * only when it is of our own chunks and sizes (one build's), else NODE
 * frames to it go over TCP. */
bool xfer_rdma__stage_far(int k, const uint8_t *priv, size_t privlen,
                          struct dep_xfer_rdma_stage *st) {
  if (privlen < sizeof *st || !stage_ensure(k))
    return false;
  memcpy(st, priv, sizeof *st);
  if (st->addr != 0 && st->rkey != 0 && st->chunks == XR_STAGE_CHUNKS &&
      st->chunk_bytes == XR_STAGE_BYTES)
    return true;
  log_warnx("peer %s: its staging for node channels' frames (%u chunks of %llu bytes) is not "
            "this deepepd's (%u of %llu): they go over TCP", peer_name(k), st->chunks,
            (unsigned long long)st->chunk_bytes, XR_STAGE_CHUNKS,
            (unsigned long long)XR_STAGE_BYTES);
  return false;
}

void xfer_rdma__stage_reset(struct xr_peer *p) {
  if (p->stage != NULL)
    atomic_store_explicit(stage_word(p, XR_STAGE_CREDIT), 0, memory_order_relaxed);
}

void xfer_rdma__stage_free(struct xr_peer *p) {
  if (p->stage != NULL) {
    rdmaxp_dereg(p->stage_mr);
    free(p->stage);
  }
  p->stage = NULL;
  p->stage_mr = NULL;
  p->stage_failed = false;
}

/* ---- the proxy threads: frames into a peer's staging, and what it staged here ---- */

uint64_t xfer_rdma_node_room(void) {
  return XR_STAGE_BYTES - DEP_XFER_STAGE_DATA - DEP_XFER_HDR_WIRE;
}

enum xfer_rdma_node_rc xfer_rdma_node(struct xfer_rdma_route *xr, int k, const uint8_t *hdr,
                                      const uint8_t *table, uint64_t tab, const uint8_t *rows,
                                      uint64_t n) {
  const uint64_t len = DEP_XFER_HDR_WIRE + tab + n;
  if (xr == NULL || k < 0 || k >= CONFIG_MAX_LIST || !(xr->peers >> k & 1) ||
      DEP_XFER_STAGE_DATA + len > XR_STAGE_BYTES)
    return XFER_RDMA_NODE_TCP;
  struct xr_peer *p = &XR.p[k];
  pthread_mutex_lock(&p->mu);
  if (p->out == NULL || !atomic_load(&p->ready) || p->broken || !p->far_known) {
    pthread_mutex_unlock(&p->mu);
    return XFER_RDMA_NODE_TCP;
  }
  /* The peer's word: 0 until it can credit us, then 1 + our frames it has freed. */
  const uint64_t credit = atomic_load_explicit(stage_word(p, XR_STAGE_CREDIT),
                                               memory_order_acquire);
  if (credit == 0) {
    pthread_mutex_unlock(&p->mu);
    return XFER_RDMA_NODE_TCP;
  }
  if (credit - 1 > p->staged || p->staged - (credit - 1) >= XR_STAGE_CHUNKS) {
    pthread_mutex_unlock(&p->mu);
    return XFER_RDMA_NODE_WAIT; /* a word of a queue pair before this one's, or no chunk free */
  }
  const uint64_t seq = ++p->staged;
  const struct dep_xfer_rdma_stage far = p->far;
  pthread_mutex_unlock(&p->mu);
  /* Chunk seq - 1 of ours is this thread's until the peer frees its twin. */
  const uint32_t i = (uint32_t)((seq - 1) % XR_STAGE_CHUNKS);
  uint8_t *c = p->stage + XR_STAGE_OUT(i);
  memcpy(c + DEP_XFER_STAGE_DATA, hdr, DEP_XFER_HDR_WIRE);
  memcpy(c + DEP_XFER_STAGE_DATA + DEP_XFER_HDR_WIRE, table, tab);
  memcpy(c + DEP_XFER_STAGE_DATA + DEP_XFER_HDR_WIRE + tab, rows, n);
  memcpy(c, &seq, sizeof seq);
  /* The frame, then its ready word: one queue pair places them in that order. */
  const uint64_t at = far.addr + DEP_XFER_STAGE_HEAD + (uint64_t)i * far.chunk_bytes;
  const uint32_t lkey = rdmaxp_mr_lkey(p->stage_mr);
  struct ibv_sge sge[2] = {
      {.addr = (uint64_t)(uintptr_t)(c + DEP_XFER_STAGE_DATA), .length = (uint32_t)len, .lkey = lkey},
      {.addr = (uint64_t)(uintptr_t)c, .length = sizeof seq, .lkey = lkey}};
  struct ibv_send_wr wr[2] = {{.num_sge = 1, .opcode = IBV_WR_RDMA_WRITE},
                              {.num_sge = 1, .opcode = IBV_WR_RDMA_WRITE}};
  wr[0].wr.rdma.remote_addr = at + DEP_XFER_STAGE_DATA;
  wr[1].wr.rdma.remote_addr = at;
  wr[0].wr.rdma.rkey = wr[1].wr.rdma.rkey = far.rkey;
  /* Lost (the queue pair broke): the routes to k fail at the sweep's end,
   * and this frame goes over TCP meanwhile. */
  return xfer_rdma__chain_add(k, xr, wr, sge, 2, len + sizeof seq) ? XFER_RDMA_NODE_QUEUED
                                                        : XFER_RDMA_NODE_TCP;
}

/* Take what peer k staged here (in_mu held): the chunks taken. */
static uint64_t stage_take(int k, struct xr_peer *p, xfer_stage_fn *take) {
  pthread_mutex_lock(&p->mu);
  /* Only while our credits can go back: else the peer would wait for them in vain. */
  const bool can = p->out != NULL && atomic_load(&p->ready) && !p->broken && p->far_known;
  const struct dep_xfer_rdma_stage far = p->far;
  pthread_mutex_unlock(&p->mu);
  uint64_t taken = 0;
  for (; can && taken < XR_STAGE_CHUNKS; taken++) {
    const uint32_t i = (uint32_t)(p->in_next % XR_STAGE_CHUNKS);
    const uint8_t *c = p->stage + XR_STAGE_IN(i);
    if (atomic_load_explicit(stage_word(p, XR_STAGE_IN(i)), memory_order_acquire) !=
        p->in_next + 1)
      break;
    struct xfer_rdma_route *to = NULL;
    if (take(k, c + DEP_XFER_STAGE_DATA, XR_STAGE_BYTES - DEP_XFER_STAGE_DATA, &to) != 0)
      break;
    p->in_next++;
    atomic_store_explicit(stage_word(p, XR_STAGE_FREED), p->in_next + 1, memory_order_relaxed);
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)(p->stage + XR_STAGE_FREED),
                          .length = sizeof(uint64_t), .lkey = rdmaxp_mr_lkey(p->stage_mr)};
    struct ibv_send_wr wr = {.num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
    wr.wr.rdma.remote_addr = far.addr + XR_STAGE_CREDIT;
    wr.wr.rdma.rkey = far.rkey;
    if (!xfer_rdma__chain_add(k, to, &wr, &sge, 1, sizeof(uint64_t))) {
      taken++;
      break; /* the queue pair broke: the routes to k fail at the sweep's end */
    }
  }
  return taken;
}

uint64_t xfer_rdma_stage_poll(xfer_stage_fn *take) {
  uint64_t peers = atomic_load_explicit(&XR.staging, memory_order_relaxed), taken = 0;
  for (int k = 0; peers != 0; k++, peers >>= 1) {
    struct xr_peer *p = &XR.p[k];
    if (!(peers & 1) || pthread_mutex_trylock(&p->in_mu) != 0)
      continue; /* another proxy thread takes its chunks */
    if (p->stage != NULL)
      taken += stage_take(k, p, take);
    pthread_mutex_unlock(&p->in_mu);
  }
  return taken;
}
