/*
 * xfer_rdma.h — the RDMA half of the data path between nodes (DESIGN §7,
 * xfer.h): where a peer can be reached over RDMA and both exchange regions
 * (proto/slab.h: host memory) are registered with the NIC (lend.h), a
 * proxy thread moves a block by RDMA writes from the sender's out block
 * straight into the in block of the destination rank's exchange region
 * (the windows of the receiver's MEMBERSHIP: addr, rkey), then writes the
 * out slot into the in slot behind it on the same queue pair, its flag
 * last; no thread of the receiving daemon takes part.  A node channel's
 * chunk, which the receiving daemon fans out, goes into that daemon's
 * staging instead (below).  Anything else goes over TCP, as xfer.c does
 * it.
 *
 * The queue pairs are the data path's own, one per peer and direction,
 * not the peer links' (rdmaxp.h): they are opened like the TCP data
 * connections, with a single-use token of a DATA_OFFER (the peer offers
 * one more when RDMA may be had; the first that comes is spent on the
 * queue pair, in the private data of the connection request that the
 * offering daemon's connection manager listener checks) and a proof of
 * the peer key beside it (xring.h's dep_xfer_rdma_req: a MAC over the
 * token with the key derived for the direction), without which the token
 * opens nothing and stays open for the peer; and their
 * completion queue has no channel: the proxy thread that posts polls it
 * itself.  So no completion queue is drained by two threads, and the
 * loop is never on the path of a block.  A mutex per peer makes one proxy
 * thread at a time the queue pair's poster and poller, and lets the loop
 * take the queue pair away (its peer went down, the far end closed it)
 * only between two of them.
 *
 * Descriptors a proxy thread takes in one sweep go, per peer, into one
 * chain of work requests (payload, slot fields, flag for each block),
 * posted with one ibv_post_send at the end of the sweep or when the chain
 * is full.  Only the last request of a chain is signalled (and one every
 * quarter of the send queue within a long chain); its completion retires
 * every request before it, and no more than the send queue's depth is
 * ever outstanding.
 */
#ifndef DEP_DAEMON_XFER_RDMA_H
#define DEP_DAEMON_XFER_RDMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "peer_proto.h"
#include "slab.h"
#include "xfer.h"
#include "xring.h"

struct job;
struct xfer_rdma_route;

/*
 * The data path's offer table, as the queue pairs use it (xfer.c hands it
 * in, so this file calls nothing of the data path above it), each on the
 * loop thread: `peer` and `spend`, xfer_offer_peer and xfer_offer_spend
 * (xfer.h); `to_tcp`, a DATA_OFFER of peer k's whose token no queue pair of
 * ours spends after all, for a TCP data connection (xfer_on_offer).
 */
struct xfer_rdma_offers {
  int (*peer)(const uint8_t *token);
  int (*spend)(const uint8_t *token);
  void (*to_tcp)(int k, const struct dep_peer_data_offer *o);
};

/* With the data path (xfer_init): hook the data queue pairs into rdmaxp;
 * offers is kept, not copied. */
void xfer_rdma_init(const struct config *cfg, const struct xfer_rdma_offers *offers);
/* Close every data queue pair (the proxy threads have stopped). */
void xfer_rdma_fini(void);

/*
 * What went to peer k as RDMA writes since the daemon started, every job's together: the
 * blocks (each a descriptor: a block, a chunk or a credit), the work requests they made, the
 * chains posted and the bytes written.  Only the sender counts them: a write lands in the
 * peer's memory without its daemon taking part.  Any thread.
 */
struct xfer_rdma_stats {
  uint64_t blocks, writes, posts, bytes;
};
void xfer_rdma_peer_stats(int k, struct xfer_rdma_stats *out);

/* Whether blocks for peer k may go over RDMA: an RDMA device here and a
 * transport other than tcp for k.  Then one more DATA_OFFER goes to k. */
bool xfer_rdma_wanted(int k);
/* A DATA_OFFER from peer k: true when its token was spent opening our
 * data queue pair to k (there was none), false when it is TCP's. */
bool xfer_rdma_on_offer(int k, const uint8_t token[DEP_PEER_TOKEN_LEN]);
/* Peer k is gone: its data queue pairs close (the loop). */
void xfer_rdma_peer_down(int k);

/*
 * The RDMA targets of job j, which xfer.c's route keeps: for each remote
 * rank (who[g] >= 0), its exchange region's windows from the MEMBERSHIP of
 * the peer holding it (membership: job_members.c's records), when all of them carry a key.
 * NULL (out of memory, or no RDMA here): every block goes over TCP.  Logs
 * per peer which transport its blocks take.
 */
struct xfer_rdma_route *xfer_rdma_route_new(const struct job *j, const int16_t *who,
                                            xfer_membership_fn *membership);
/* The job's route goes: wait (bounded) until no write of ours is in
 * flight, say what moved, free it.  NULL is fine. */
void xfer_rdma_route_free(struct xfer_rdma_route *xr);

/*
 * What a descriptor names in its rank's exchange region (xring.h), checked
 * against the job's layout by xfer.c: each part NULL when it has none.
 */
struct xfer_src {
  const uint8_t *payload; /* the descriptor's bytes: a block's, or a chunk's rows */
  uint64_t at;            /* where they go in the destination's in block (a chunk's ring row) */
  const uint8_t *mark;    /* a chunk's mark word (out_mark), after the payload */
  uint32_t chunk;         /* ... its chunk number in the stream */
  const uint8_t *slot;    /* the slot image (out_slot), after the mark */
  const uint8_t *credit;  /* a credit: the rank's credit word (its in slot's); a taken word
                             (DEP_XRING_TAKEN): its in slot's taken word */
};

/*
 * A proxy thread's descriptor d of global rank src, naming s in its
 * exchange region (registered as mr; NULL: not), bound for peer k: true
 * when queued as RDMA writes, false when not RDMA's (the caller sends it
 * over TCP).  The writes go at the next xfer_rdma_flush, or earlier when
 * the chain fills.
 */
struct ibv_mr;
bool xfer_rdma_take(struct xfer_rdma_route *xr, int k, const struct ibv_mr *mr, uint32_t src,
                    const struct dep_xring_desc *d, const struct xfer_src *s);
/* Post what this thread queued (the end of a sweep, with the routes'
 * lock still held, so that no route goes while its writes wait), and
 * retire what completed.  Returns the peers (bit k) whose queue pair
 * failed just now: xfer_proxy.c fails the routes that send to them. */
uint64_t xfer_rdma_flush(void);
/* A proxy thread is ending: its chains go. */
void xfer_rdma_thread_end(void);

/*
 * One crossing per destination node over RDMA (DESIGN §7, xring.h's
 * dep_xfer_rdma_stage).  A NODE frame must be fanned out by the daemon
 * that holds its destinations, which a write into a rank's exchange region
 * never reaches; so each daemon keeps, per peer, a staging of its own
 * (XR_STAGE_CHUNKS chunks of XR_STAGE_BYTES, registered with its NIC,
 * which its acceptance of the peer's data queue pair names): the peer's
 * proxy copies a NODE frame (header, table, rows) into a chunk of its own
 * staging (the rank writes its node channel's place again once the ring's
 * tail is past it), writes it into ours and then the chunk's ready word;
 * a proxy thread here finds the word, fans the frame out as a frame over
 * TCP is (xfer_conn.c) and writes its count of freed chunks back over our
 * queue pair into the peer, whose next frame waits for a free chunk.  So
 * the chunks in flight are bounded, and none is overwritten before it is
 * fanned out.
 */
enum xfer_rdma_node_rc {
  XFER_RDMA_NODE_QUEUED, /* its writes are in this thread's chain */
  XFER_RDMA_NODE_TCP,    /* not RDMA's: no staging at the peer (or larger than its chunk) */
  XFER_RDMA_NODE_WAIT    /* every chunk of the peer's staging is in use: take it again later */
};
/* The most payload (table and rows) a NODE frame into a staging may carry:
 * a larger chunk goes in pieces, each with its own table. */
uint64_t xfer_rdma_node_room(void);
/* NODE frame hdr (its wire form, DEP_XFER_HDR_WIRE bytes) and its payload
 * (table, tab bytes, then rows, n bytes) of route xr for peer k. */
enum xfer_rdma_node_rc xfer_rdma_node(struct xfer_rdma_route *xr, int k, const uint8_t *hdr,
                                      const uint8_t *table, uint64_t tab, const uint8_t *rows,
                                      uint64_t n);
/*
 * What a proxy thread does with a NODE frame peer k staged here: frame
 * (its header's wire form, then its payload) in room bytes; 0 when it is
 * done with it (fanned out, or dropped with a reason said), the route
 * whose count its credit adds to in *to (NULL: none), 1 when it must wait
 * (its job's route is not here yet).  The routes' lock is held.
 */
typedef int xfer_stage_fn(int k, const uint8_t *frame, uint64_t room,
                          struct xfer_rdma_route **to);
/* Take what the peers staged here, in order, with take, and queue the
 * credits (posted at xfer_rdma_flush): the chunks taken. */
uint64_t xfer_rdma_stage_poll(xfer_stage_fn *take);

#endif /* DEP_DAEMON_XFER_RDMA_H */
