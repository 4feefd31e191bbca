/*
 * rdmaxp_internal.h — what the files of the RDMA transport share, private
 * to them (rdmaxp.h): a queue pair, the mailbox it keeps alive with, and
 * the transport's state.  rdmaxp.c keeps the memory, the queue pairs and
 * their completions, start and stop; rdmaxp_cm.c the connection manager
 * (dialling, accepting and its events).
 */
#ifndef DEP_DAEMON_RDMAXP_INTERNAL_H
#define DEP_DAEMON_RDMAXP_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "peer_proto.h"
#include "rdmadrv.h"
#include "rdmaxp.h"
#include "xring.h"

/* The mailbox: incoming ping stamp, incoming pong stamp, outgoing ping, outgoing pong. */
#define MBOX_BYTES 64u
#define MBOX_PING_IN 0u
#define MBOX_PONG_IN 8u
#define MBOX_PING_OUT 16u
#define MBOX_PONG_OUT 24u

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
   * ($DEEPEPD_TEST_RDMA_BAD_PROOFS, testhooks.h) out: dialled again from src to dst with
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

/* The transport's state: the loop's alone (no thread touches it). */
struct rdmaxp_state {
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
};

extern struct rdmaxp_state rdmaxp__state;
/* Each file's short name for it. */
#define R rdmaxp__state

/* ---- rdmaxp.c ---- */

/* A queue pair of owner, listed, with its mailbox registered unless it is
 * a data queue pair; NULL with why when out of memory or registration fails. */
struct rdmaxp_qp *rdmaxp__qp_new(void *owner, bool acceptor, bool data, char *why,
                                 size_t whylen);
/* Unlist q, close its id, queue pair and completion queue, and free it. */
void rdmaxp__qp_free(struct rdmaxp_qp *q);
/* Free q and tell its owner why (the data path's down hook or the link's). */
void rdmaxp__qp_fail(struct rdmaxp_qp *q, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The listed queue pair of that serial; NULL when it went. */
struct rdmaxp_qp *rdmaxp__qp_by_serial(uint64_t serial);
/* The queue pair on q->id with its completion queue, by role (rdmaxp.c says
 * how); -1 with why. */
int rdmaxp__qp_create(struct rdmaxp_qp *q, char *why, size_t whylen);

/* ---- rdmaxp_cm.c ---- */

/* The connection manager's event channel is readable (the loop's poll). */
void rdmaxp__on_ech(uv_poll_t *h, int status, int events);

#endif /* DEP_DAEMON_RDMAXP_INTERNAL_H */
