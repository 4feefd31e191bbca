/*
 * xfer_rdma_internal.h — what the files of the data path's RDMA half share,
 * private to them (xfer_rdma.h): its limits, a peer's queue pairs and
 * staging, a job's targets, the proxy threads' chains and the state.
 * xfer_rdma.c keeps the queue pairs, the routes and the chains;
 * xfer_rdma_stage.c the staging that node channels' frames go through.
 */
#ifndef DEP_DAEMON_XFER_RDMA_INTERNAL_H
#define DEP_DAEMON_XFER_RDMA_INTERNAL_H

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "slab.h"
#include "xfer.h"
#include "xfer_rdma.h"
#include "xring.h"

/* Work requests in one thread's chain for one peer: a quarter of the send
 * queue, so that a chain always finds room once the one before it is out. */
#define XR_CHAIN 128u
/* A block's payload spans at most this many (source piece, target window) segments. */
#define XR_SEGS 8u
/* Windows per remote slab kept: MEMBERSHIP's pieces per rank. */
#define XR_WIN_MAX 4u
/* A full send queue is waited on this long before the queue pair is taken as broken. */
#define XR_ROOM_MS 10000ull
/* A route's end waits this long for its writes in flight. */
#define XR_QUIESCE_MS 2000ull
/* A peer's staging (xfer_rdma.h): chunks, and the bytes of each (its ready
 * word's room, then a NODE frame: its header and payload).  A node
 * channel's chunk larger than that goes in pieces (xfer_proxy.c). */
#define XR_STAGE_CHUNKS 4u
#define XR_STAGE_BYTES (2ull << 20)
/* Where our staging for a peer keeps its words and chunks: the credit word
 * the peer writes (1 + our chunks it has freed), ours for it (1 + its
 * chunks we have freed, the source of our credit writes), then the chunks
 * it writes into, then those we copy our frames into for it. */
#define XR_STAGE_CREDIT 0u
#define XR_STAGE_FREED 8u
#define XR_STAGE_IN(i) (DEP_XFER_STAGE_HEAD + (uint64_t)(i) * XR_STAGE_BYTES)
#define XR_STAGE_OUT(i) XR_STAGE_IN(XR_STAGE_CHUNKS + (i))
#define XR_STAGE_LEN XR_STAGE_IN(2u * XR_STAGE_CHUNKS)

struct xr_win {
  uint64_t slab_off, len, addr; /* slab_off: of the exchange region (peer_proto.h) */
  uint32_t rkey;
};

/* One remote rank's exchange region, as an RDMA target. */
struct xr_dest {
  int16_t peer;                   /* -1: held here */
  uint32_t local;                 /* held here: its number among the ranks held here */
  uint32_t n;                     /* windows; 0: not a target (a window without a key) */
  struct xr_win w[XR_WIN_MAX];
};

/* What went to a peer as RDMA writes: blocks taken, the work requests they made, the chains
 * posted (one ibv_post_send each) and the bytes the writes carry. */
struct xr_count {
  _Atomic uint64_t blocks, writes, posts, bytes;
};

struct xfer_rdma_route {
  char id[DEP_JOB_ID_MAX];
  struct dep_slab_layout lay_of[CONFIG_MAX_LIST]; /* peer k's ranks' layout: where blocks land
                                                     in their exchange regions */
  uint32_t world;
  uint64_t peers;                 /* bit k: peer k holds ranks of it */
  struct xr_count by_peer[CONFIG_MAX_LIST];
  /* [local number * CONFIG_MAX_LIST + peer]: a rank held here is remote rank
   * number ri_at[..] of that peer's ranks (their exchange regions are by it):
   * counted once here, not per block. */
  uint32_t *ri_at;
  struct xr_dest dest[];          /* by global rank: world entries */
};

/* What rdmaxp's callbacks are given as owner: one per peer and direction,
 * and the test's queue pair with a wrong proof (TESTHOOK_RDMA_BAD_PROOFS_ENV). */
struct xr_end {
  int peer;
  bool out, wrong;
};

/* What a peer did wrong here, said at most every XFER_SAY_MS (the loop's). */
struct xr_peer {
  pthread_mutex_t mu;             /* one poster/poller at a time; the loop's changes */
  struct rdmaxp_qp *out;          /* under mu: our queue pair into the peer, connecting or up */
  _Atomic bool ready;             /* out is up and not broken (read without mu to choose) */
  bool broken;                    /* under mu: a request failed; nothing more is posted */
  uint64_t posted, done;          /* under mu: requests posted, retired by completions */
  struct rdmaxp_qp *in;           /* the loop's: the peer's queue pair into us */
  /* The loop's: the offer's token out was opened with, whether out came
   * up, and whether it failed to (then TCP until the peer is down). */
  uint8_t token[DEP_PEER_TOKEN_LEN];
  bool was_up, no_rdma;
  struct rdmaxp_qp *wrong;        /* the loop's: the test's request with a wrong proof */
  /* Our staging for the peer (XR_STAGE_*, registered as stage_mr), made by
   * the loop with the first queue pair either way and kept to the end. */
  uint8_t *stage;
  struct ibv_mr *stage_mr;
  bool stage_failed;              /* the loop's: it could not be made (said once) */
  /* Under mu: the peer's staging for us (its acceptance of out), and the
   * frames we have written into it on out. */
  struct dep_xfer_rdma_stage far;
  bool far_known;
  uint64_t staged;
  /* in_mu: one proxy thread at a time takes the peer's chunks (in_next:
   * those taken since its queue pair into us was accepted); the loop
   * starts them again from 0 there. */
  pthread_mutex_t in_mu;
  uint64_t in_next;
  /* The loop's: its requests that named an offer but did not prove the
   * key, or were of another data stream version. */
  struct xfer_say bad_proofs, bad_versions;
};

/* One proxy thread's chain for one peer. */
struct xr_chain {
  uint32_t n;
  struct ibv_send_wr wr[XR_CHAIN];
  struct ibv_sge sge[XR_CHAIN];
  struct xfer_rdma_route *routes[8]; /* whose blocks it holds, for their post counts */
  uint32_t n_routes;
};

struct xr_thread {
  uint64_t queued;                /* bit k: a chain for peer k holds requests */
  uint64_t outstanding;           /* bit k: requests posted to k may not be retired */
  struct xr_chain *chain[CONFIG_MAX_LIST];
};

struct xfer_rdma_state {
  bool active;
  const struct config *cfg;
  const struct xfer_rdma_offers *offers;
  struct xr_peer p[CONFIG_MAX_LIST];
  struct xr_end ends[3][CONFIG_MAX_LIST]; /* [0] in, [1] out, [2] the test's wrong proof */
  _Atomic uint64_t lost;          /* peers whose writes in flight were lost (the loop saw it) */
  /* Per peer since the daemon started, every job's together (a route's own counts go with
   * it): counters that only grow, for the metrics (xfer_rdma_peer_stats).  A chain posts
   * blocks of several routes at once, so a peer's posts are counted here, not summed. */
  struct xr_count sent[CONFIG_MAX_LIST];
  int test_bad_proofs;            /* $DEEPEPD_TEST_RDMA_BAD_PROOFS left to do for data queue
                                     pairs (the loop's; the one made for the other direction) */
  _Atomic uint64_t staging;       /* bit k: our staging for peer k is made (the proxies poll it) */
};
extern struct xfer_rdma_state xfer_rdma__state;
/* Each file's short name for it. */
#define XR xfer_rdma__state

/* ---- xfer_rdma.c ---- */

/* Append n work requests (wr, sge) for peer k to this thread's chain, on
 * behalf of route xr (NULL: none), and count them with bytes: false when
 * out of memory or the chain could not be posted (then lost). */
bool xfer_rdma__chain_add(int k, struct xfer_rdma_route *xr, const struct ibv_send_wr *wr,
                          const struct ibv_sge *sge, uint32_t n, uint64_t bytes);

/* ---- xfer_rdma_stage.c (the loop's, but for the proxy threads' of xfer_rdma.h) ---- */

/* Our acceptance of peer k's data queue pair (owner: its in end): our
 * staging for it, written at priv (at most max bytes); its length. */
size_t xfer_rdma__stage_reply(void *owner, uint8_t *priv, size_t max);
/* Our queue pair into peer k is up: its acceptance's private data (priv)
 * names the peer's staging for us, kept in *st; false when it names none
 * we can use (NODE frames to k go over TCP). */
bool xfer_rdma__stage_far(int k, const uint8_t *priv, size_t privlen,
                          struct dep_xfer_rdma_stage *st);
/* mu held, our queue pair into p (peer k) up: tell it at once from what
 * count we credit its frames. */
void xfer_rdma__stage_credit_now(int k, struct xr_peer *p);
/* mu held, p's queue pairs gone: its credits for our frames start anew. */
void xfer_rdma__stage_reset(struct xr_peer *p);
/* The data path stops: p's staging goes. */
void xfer_rdma__stage_free(struct xr_peer *p);

#endif /* DEP_DAEMON_XFER_RDMA_INTERNAL_H */
