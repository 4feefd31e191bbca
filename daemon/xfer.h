/*
 * xfer.h — the daemon's half of the data path between nodes (DESIGN §7).
 *
 * A rank of a job that spans nodes writes what it means for a rank on
 * another node into the out block and out slot of its exchange region
 * (proto/slab.h: host memory, after its ring in the memfd lend.c makes and
 * this module lends it, XRING_LEND) and pushes a descriptor into its ring
 * (proto/xring.h).  Proxy threads (never the loop) drain the rings: for
 * each descriptor they read the out block and out slot in place (plain
 * loads: no copy out of GPU memory on cuda), and send both in one frame
 * (xring.h's dep_xfer_hdr, then the payload) over a data connection to
 * the daemon that holds the destination rank; frames for one peer found in
 * one sweep go in one send.  That daemon's receiver thread checks the frame
 * against the job (the sender's node holds the source rank, the
 * destination is held here, the sizes fit the layout) and writes the
 * payload, then the slot with its flag last, into the in block and in slot
 * of the destination rank's exchange region (plain stores), where the
 * rank's wait finds it as it finds a local peer's in its slab.
 *
 * Data connections are TCP, made for each peer once it is up: this daemon
 * offers single-use tokens over the authenticated peer link (DATA_OFFER),
 * the peer opens a connection to our listener whose first frame is
 * DATA_HELLO with one (peer.c hands the socket over), proves on it that it
 * holds the peer key (xring.h's challenge and proof), and from then on it
 * carries the peer's frames to us.  Each direction has its own
 * connections: min(connection_pool_size, XFER_DATA_CONNS_MAX) for the data
 * and one more, the control lane, which carries only the credits and taken
 * words, so that none waits behind a data batch in a socket's queue or
 * in the far end's receiver (xfer_send.c).
 *
 * Where the peer's links are on RDMA and both exchange regions are
 * registered with the NIC, blocks go instead as RDMA writes straight into
 * the destination's exchange region, on a queue pair of the data path's own opened with one more
 * DATA_OFFER token, with no receiver thread (xfer_rdma.h); the log says
 * per peer which the data path uses.
 *
 * Everything the loop calls is on the loop thread; the route table the
 * threads read is guarded by a reader-writer lock, and a job's route goes
 * (xfer_job_end) before its arenas and exchange regions go (lend_release).
 */
#ifndef DEP_DAEMON_XFER_H
#define DEP_DAEMON_XFER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "config.h"
#include "peer.h"
#include "peer_proto.h"
#include "proto.h"

struct conn;
struct job;

/* Data connections each way to a peer at most; each direction has one
 * more, its control lane (xfer_send.c), so XFER_CONNS_MAX in all. */
#define XFER_DATA_CONNS_MAX 8
#define XFER_CONNS_MAX (XFER_DATA_CONNS_MAX + 1)

/* Make ready when peers are configured; the proxy threads (cfg->proxy_threads,
 * or xfer_proxy_threads_default's) start with the first job that spans nodes.
 * 0, or -1 after logging why not. */
int xfer_init(const struct config *cfg);
/* Stop the threads and close every data connection. */
void xfer_fini(void);

/* The proxy threads a daemon runs where proxy_threads is 0: one per served
 * GPU; a daemon that serves none (the host backend, whose ranks pack
 * their blocks on the CPU) one per XFER_CPUS_PER_PROXY of the CPUs it may
 * run on, at least one and at most XFER_HOST_PROXY_MAX.  One thread moves
 * every byte a node sends (each send a copy into the kernel), which holds a
 * node of four busy ranks to about half of what its links carry
 * (BENCHMARKS.md, "Proxy threads on the host backend"). */
#define XFER_CPUS_PER_PROXY 4u
#define XFER_HOST_PROXY_MAX 8u
uint32_t xfer_proxy_threads_default(size_t gpus, uint32_t cpus);
/* The CPUs this process may run on (its affinity: a cpuset or taskset counts), or 1. */
uint32_t xfer_usable_cpus(void);

/* XRING_LEND from an attached rank of a running job that spans nodes. */
void xfer_lend_ring(struct conn *c, uint32_t request_id);

/* What peer k said of job j in its MEMBERSHIP (its ranks, their exchange
 * windows and keys), or NULL when it said nothing for j: job_members.c's records
 * (job_membership), valid for the length of the call it is handed to. */
typedef const struct dep_peer_membership *xfer_membership_fn(const struct job *j, int peer);

/* The job table's events.  who[r] for each global rank r < world: -1 for a
 * rank held here, else the peer that holds it (job_members.c's job_who); membership
 * reads the peers' records of j during the call only, so xfer asks nothing
 * of the job table. */
void xfer_job_start(const struct job *j, const int16_t *who, xfer_membership_fn *membership);
/* j's ranks here have all attached and its MEMBERSHIP goes to the peers
 * now (job_members.c, before it is sent): a peer that completes the job first may
 * send frames for it before its route is here, and a receiver waits for
 * the route of such a job only.  A frame of any other job it does not
 * hold (one that ended, however long ago, or never ran here) is dropped
 * at once.  Until xfer_job_end. */
void xfer_job_expect(const struct job *j);
/* Whether j's exchange regions are in this daemon's page tables: false while
 * the thread that maps a new route's regions in (xfer.c struct xfer_fill) is
 * at it.  The job answers its ranks' ATTACH only after (job_members.c): a
 * region a receiver first touched in the job's first calls cost those calls
 * a page fault a page (BENCHMARKS.md). */
bool xfer_job_filled(const struct job *j);
/* j cannot go on (a node or a rank is gone): its rings stop, their ranks'
 * pushes fail with code, and nothing more is moved for it. */
void xfer_job_fail(const struct job *j, int code);
/* j is gone: its route and rings go (before its arenas do). */
void xfer_job_end(const struct job *j);

/* The peer layer's events (peer_data_ops: xfer_init subscribes). */
void xfer_peer_up(int peer);
/* The loop's tick (peer.c, through the peer_data_ops xfer_init registers;
 * so are xfer_on_offer, xfer_accept and the PEERS record's data part): a peer that is up with fewer inbound data
 * connections than connection_pool_size (one dropped while the link
 * stayed) is offered tokens for the missing ones. */
void xfer_tick(void);
void xfer_peer_down(int peer);
void xfer_on_offer(int peer, const struct dep_peer_data_offer *o);

/*
 * An inbound connection from peer `peer` opened with DATA_HELLO: whether
 * the token is one offered to that peer and not yet used (PEER_TOKEN_TAKEN:
 * then fd, which peer.c no longer reads, is xfer's to close: a receiver
 * thread asks it for its proof of the key and spends the offer only on a
 * proof that holds), one withdrawn when the peer went down, or neither (the
 * caller closes fd and the link, peer.h).
 */
enum peer_token xfer_accept(int peer, const uint8_t token[DEP_PEER_TOKEN_LEN], int fd);

/* An RDMA data queue pair's connection request named token (xfer_rdma.h):
 * the peer the open offer that has it was made to, the offer left open
 * (the request's proof is checked first), or -1 when none has it; and the
 * same with the offer spent (single use), once the proof holds. */
int xfer_offer_peer(const uint8_t *token);
int xfer_offer_spend(const uint8_t *token);
/* What a peer does beyond its bounds (DATA_OFFERs past the connections it
 * may have opened, proofs that fail, frames of jobs not here) is said at
 * most once in this long, with a count, so that a peer cannot flood the
 * log either. */
#define XFER_SAY_MS 10000
/* One kind of event a peer causes, said at most once per XFER_SAY_MS with a
 * count (xfer_say_now), from any thread. */
struct xfer_say {
  _Atomic uint64_t last_ms, count;
};
/* Count one more event of s: true when it is to be said now, with *n the
 * events since the last line.  Inline, so that each of the data path's
 * files uses it without calling into another. */
static inline bool xfer_say_now(struct xfer_say *s, uint64_t *n) {
  atomic_fetch_add(&s->count, 1);
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
  uint64_t last = atomic_load(&s->last_ms);
  if (last != 0 && now - last < XFER_SAY_MS)
    return false;
  if (!atomic_compare_exchange_strong(&s->last_ms, &last, now))
    return false;
  *n = atomic_exchange(&s->count, 0);
  return true;
}

/* What `deepepctl peers` shows for peer k (peer_fill, through the data
 * ops): data connections up each way,
 * and bytes and frames moved each way. */
struct xfer_peer_stats {
  uint32_t conns_out, conns_in;
  uint64_t bytes_out, bytes_in, frames_out, frames_in;
};
void xfer_peer_stats(int peer, struct xfer_peer_stats *out);
/* Job j's traffic and its rings' fullest into out (JOB_NODES_OK's record); untouched
 * when j has no route here. */
void xfer_job_stats(const struct job *j, struct dep_msg_job_node *out);
/* Proxy threads running, and their busy time in microseconds. */
void xfer_proxy_stats(uint32_t *threads, uint64_t *busy_us);

#endif /* DEP_DAEMON_XFER_H */
