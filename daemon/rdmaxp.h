/*
 * rdmaxp.h — the RDMA transport of deepepd's peer links (DESIGN §7): one
 * RDMA device (the one listen.address is on, else the first), its
 * protection domain, on which the ranks' exchange regions are registered
 * (nicreg.h),
 * and one reliable-connected queue pair per authenticated peer link, set
 * up with librdmacm and kept as long as its link.
 *
 * Everything runs on the loop thread: the connection manager's event
 * channel and the completion channel are non-blocking fds watched with
 * uv_poll, so completions are waited on as events, never spun on (rxe
 * turns a busy poll into a scheduler tick per message).  The data path
 * does not share these queue pairs: it has its own (below), whose
 * completions its proxy threads poll, so that no completion queue is
 * drained by two threads and none waits on the loop.
 *
 * A queue pair is bound to the TCP link that authenticated it: the end
 * that accepted the link makes an offer (peer_proto.h XPORT) with a random,
 * single-use token and its mailbox; the end that connected opens the RDMA
 * connection with that token in its private data, and a proof of the peer
 * key over it (peer_proto.h's dep_peer_qp_req).  A connection request
 * whose token matches no open offer is rejected and logged; one whose
 * proof is wrong too (rate-limited), and the offer stays open for the
 * link's own.  The token travels in clear over the authenticated link: it
 * names the offer, and holding the key, not having seen the token, is
 * what opens a queue pair (whichever queue pair it is, it may write into
 * every region registered on the protection domain whose key it learns).
 * Nothing is encrypted: DESIGN §7's fabric is trusted as NCCL's is.
 *
 * Each queue pair has a mailbox, 64 registered bytes per end, through which
 * its keep-alive goes as RDMA writes with immediate data: the round trip
 * that `deepepctl peers` shows for rdma, and the proof, every second, that
 * the queue pair still carries writes.
 */
#ifndef DEP_DAEMON_RDMAXP_H
#define DEP_DAEMON_RDMAXP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "config.h"
#include "peer_proto.h"
#include "xring.h"

struct ibv_mr;
struct rdmaxp_qp;

/* What the transport tells the owner of a queue pair (peer.c's link). */
struct rdmaxp_events {
  /* The queue pair is connected and carries writes. */
  void (*up)(void *owner, struct rdmaxp_qp *q);
  /* It failed or went (why says how); q is freed once this returns. */
  void (*down)(void *owner, const char *why);
  /* A keep-alive came back after rtt_us. */
  void (*pong)(void *owner, uint64_t rtt_us);
};

/* A connect, a route or an address taking longer than this fails the queue pair. */
#define RDMAXP_RESOLVE_MS 2000
/*
 * Open the RDMA device for the peer links when a configured peer may use
 * RDMA (transport auto or rdma): the connection manager's listener on
 * listen.address:listen.port (its own port space beside TCP's), the
 * protection domain and the channels.  Returns 0 whether or not a device
 * could be had (rdmaxp_active() says, rdmaxp_why() why not, logged once); -1
 * only when a peer requires rdma and none can be had, after logging why
 * deepepd cannot start.
 */
int rdmaxp_init(uv_loop_t *loop, const struct config *cfg, const struct rdmaxp_events *ev);
/* Close every queue pair (no down callbacks), the listener, the device. */
void rdmaxp_fini(void);

bool rdmaxp_active(void);
/* Why there is no RDMA transport ("" while active), for messages. */
const char *rdmaxp_why(void);
/* The device in use ("rxe0", "mlx5_0"), "" when none. */
const char *rdmaxp_device(void);

/*
 * Register host memory the daemon maps with the device for remote writes
 * and reads (ibv_reg_mr: the exchange regions).  0 with *mr, or
 * DEP_ERR_UNSUPPORTED (no device) / DEP_ERR_NO_MEMORY (RLIMIT_MEMLOCK, the
 * NIC's tables) / DEP_ERR_IO with why.  GPU memory is not registered: the
 * data path stages through host memory (DESIGN §7 says where it goes next).
 */
int rdmaxp_reg_host(void *addr, size_t len, struct ibv_mr **mr, char *why, size_t whylen);
void rdmaxp_dereg(struct ibv_mr *mr);
uint32_t rdmaxp_mr_rkey(const struct ibv_mr *mr);
uint32_t rdmaxp_mr_lkey(const struct ibv_mr *mr);

/*
 * The accepting end of an authenticated link: a queue pair waiting for the
 * far end's connection, whose request must prove dkey (the key derived for
 * the far end's direction, peerauth_data_key), and the XPORT message (kind
 * rdma) that invites it.  NULL with why when none can be made.
 */
struct rdmaxp_qp *rdmaxp_offer(void *owner, const uint8_t dkey[DEP_PEER_MAC_LEN],
                               struct dep_peer_xport *out, char *why, size_t whylen);
/*
 * The connecting end: connect from src (the link's local address) to dst
 * (the far daemon's listen address and port) with the offer's token and a
 * proof made with dkey (the key derived for our direction).  NULL with why
 * when it cannot start; later failures come as down().
 */
struct rdmaxp_qp *rdmaxp_connect(void *owner, const struct sockaddr *src, const struct sockaddr *dst,
                                 const struct dep_peer_xport *offer,
                                 const uint8_t dkey[DEP_PEER_MAC_LEN], char *why, size_t whylen);
/* Disconnect and free q; no callback follows. */
void rdmaxp_close(struct rdmaxp_qp *q);
/* Whether q is an offer that the far end's connection request took, and
 * that was accepted (its ESTABLISHED may still be on the way). */
bool rdmaxp_qp_accepted(const struct rdmaxp_qp *q);

/*
 * The data path's queue pairs (daemon/xfer_rdma.h): one per peer and
 * direction beside the links', connected with a token of a DATA_OFFER and
 * a proof of the peer key in the private data (xring.h's
 * dep_xfer_rdma_req), set up and torn down on the loop like the links' but
 * driven by a proxy thread: a completion queue of their own with no
 * channel, which that thread polls, no receives, no keep-alive, and only
 * the sends it asks for signalled.  The accepting end's acceptance carries
 * private data of the owner's (reply), which the connecting end's up gets.
 */
struct rdmaxp_data_events {
  /* A connection request whose token names no link's offer: the owner for
   * the queue pair when its token is one the data path offered and its
   * proof holds (the offer spent then), else NULL (it is rejected; *said
   * when the hook logged why, else rdmaxp says it names no offer). */
  void *(*accept)(const struct dep_xfer_rdma_req *req, bool *said);
  /* The private data of our acceptance of the request owner took: written
   * at priv (at most max bytes), its length returned. */
  size_t (*reply)(void *owner, uint8_t *priv, size_t max);
  /* q is connected; at the connecting end, priv holds the acceptance's
   * private data (privlen bytes, as the far end's reply wrote it). */
  void (*up)(void *owner, struct rdmaxp_qp *q, const uint8_t *priv, size_t privlen);
  /* q failed or the far end closed it: called before q is freed, so that
   * the owner's threads let go of it first. */
  void (*down)(void *owner, struct rdmaxp_qp *q, const char *why);
};
void rdmaxp_set_data_events(const struct rdmaxp_data_events *ev);
/* Open a data queue pair to dst (the peer's listen address and port) with
 * token and the proof of the key for it (peerauth_rdma_proof); NULL with
 * why when it cannot start, later failures come as down(). */
struct rdmaxp_qp *rdmaxp_data_connect(void *owner, const struct sockaddr *dst,
                                      const uint8_t token[DEP_PEER_TOKEN_LEN],
                                      const uint8_t proof[DEP_XFER_RDMA_PROOF_LEN], char *why,
                                      size_t whylen);
/* The verbs objects a data queue pair's owner posts on and polls. */
struct ibv_qp *rdmaxp_qp_verbs(const struct rdmaxp_qp *q);
struct ibv_cq *rdmaxp_qp_cq(const struct rdmaxp_qp *q);
/* Work requests a data queue pair's send queue holds. */
uint32_t rdmaxp_data_depth(void);
/* ibv_wc_status_str of a completion's status, for messages. */
const char *rdmaxp_wc_status(int status);

/* Send a keep-alive on q unless one is out; its answer comes as pong().
 * Returns how many ms the one outstanding has been out (0: a new one was sent). */
uint64_t rdmaxp_ping(struct rdmaxp_qp *q, uint64_t now_ms);

#endif /* DEP_DAEMON_RDMAXP_H */
