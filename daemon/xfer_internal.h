/*
 * xfer_internal.h — what the files of the data path between nodes share,
 * private to them (xfer.h): the routes, the per-peer connections and
 * offers, and the state the loop and the threads share.  xfer.c keeps the
 * routes and the rings; xfer_proxy.c the proxy threads that drain them;
 * xfer_conn.c the TCP data connections (offers, connectors, receivers);
 * xfer_send.c the send of a batch on them.
 */
#ifndef DEP_DAEMON_XFER_INTERNAL_H
#define DEP_DAEMON_XFER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "config.h"
#include "peer_proto.h"
#include "proto.h"
#include "slab.h"
#include "xfer.h"
#include "xring.h"

#define XFER_OFFERS_MAX (CONFIG_MAX_LIST * XFER_CONNS_MAX * 2)
/* A frame for a job expected here (xfer_job_expect) that has no route yet
 * waits at most this long for it: the nodes of a job learn that it is
 * complete one after another, and the first one's ranks may send before
 * the last one has its route.  A frame of a job not expected waits not at
 * all. */
#define XFER_ROUTE_WAIT_MS 5000
/* A connect, or a send or receive that makes no progress, gives up after
 * this; so does a data connection's handshake after DATA_HELLO (the
 * challenge, the proof and the ack), each step of it. */
#define XFER_CONNECT_MS 3000
/* A DATA_OFFER's token is good for this long. */
#define XFER_OFFER_MS 10000
#define XFER_IO_MS 10000
/* The most bytes a data connection holds unsent before its sender waits (xfer__tune_socket). */
#define XFER_NOTSENT_LOWAT (256 << 10)
/* Jobs that ended here, remembered so that their late frames are dropped at once. */
#define XFER_ENDED_MAX 64

struct xfer_rdma_route;
struct ibv_mr;

/* One job that spans nodes, as the threads see it. */
struct xfer_route {
  char id[DEP_JOB_ID_MAX];
  const struct job *job;         /* the loop's handle; never dereferenced by threads */
  uint32_t world, local_world;
  struct dep_slab_layout lay;
  uint32_t hidden, topk, experts; /* the shape's: a node channel's rows are remapped here */
  /* By global rank, world entries each (allocated with the route: a world
   * is bounded by DEP_MAX_WORLD, not by the local ranks). */
  int16_t *peer_of;               /* global rank -> peer holding it; -1: held here */
  int16_t *local_of;              /* global rank -> local rank here; -1: remote */
  uint32_t *remote_of;            /* global rank -> its number among remote ranks */
  uint32_t rank_of[DEP_MAX_LOCAL_RANKS]; /* local rank -> global rank */
  /* By local rank: its ring and the exchange region after it (the job's,
   * lend.h: the route goes before they do), and their registration with
   * the NIC (NULL: none). */
  struct dep_xring *ring[DEP_MAX_LOCAL_RANKS];
  uint8_t *xchg[DEP_MAX_LOCAL_RANKS];
  struct ibv_mr *mr[DEP_MAX_LOCAL_RANKS];
  _Atomic int failed;            /* 0, or the code it stopped with */
  _Atomic bool said;             /* a failure of its frames was logged */
  _Atomic uint64_t bytes_out, bytes_in, frames_out, frames_in; /* deepepctl status */
  _Atomic uint64_t payload_out;  /* of bytes_out, rows of blocks and chunks (no header,
                                    no node channel's table, no slot or credit) */
  _Atomic uint32_t ring_peak;    /* most descriptors a sweep found waiting in one ring */
  struct xfer_rdma_route *rdma;  /* where its blocks may go by RDMA writes (NULL: TCP only) */
  /* Its place in the proxy threads' round robin over rings (xfer_proxy.c's
   * sweep): routes listed later have larger serials.  The loop's, set
   * before the route is listed. */
  uint64_t serial;
  /* By local rank: the bytes the proxy thread serving that ring may still
   * take from it in its current turn (deficit round robin, xfer_proxy.c).  Only
   * that thread (local rank mod proxy threads) reads or writes it. */
  uint64_t deficit[DEP_MAX_LOCAL_RANKS];
  /* By local rank: how much of the NODE descriptor at its ring's tail has
   * gone into the far daemon's staging, a piece at a time (xfer_proxy.c's
   * node_rdma: a chunk larger than one of the staging's): its rows, and
   * each of its table's entries' rows.  Only the thread serving that ring
   * reads or writes it. */
  struct xfer_node_part {
    uint32_t rows;
    uint32_t sent[DEP_MAX_LOCAL_RANKS];
  } part[DEP_MAX_LOCAL_RANKS];
  /* Threads reading or writing its exchange regions without the lock: a
   * proxy's send straight from an out block, a receiver's read straight
   * into an in block.  Taken with the lock held (the route is listed),
   * given back after the I/O; xfer_job_end, having unlisted the route,
   * waits for 0 before the regions go back to the pool.  The populate of
   * its new regions (xfer.c's fill) holds one from before the route is
   * listed until it is done. */
  _Atomic uint32_t users;
  _Atomic bool ending;           /* xfer_job_end has unlisted it: a populate stops */
  _Atomic bool filling;          /* its regions are being mapped in (struct xfer_fill) */
  struct xfer_route *next;
};

/* A job whose ranks here have all attached and announced it (xfer_job_expect):
 * frames for it may come before its route. */
struct xfer_expect {
  const struct job *job;         /* the loop's handle; never dereferenced by threads */
  char id[DEP_JOB_ID_MAX];
  struct xfer_expect *next;
};

/* One outbound data connection (we send on it). */
struct xfer_out {
  int fd;                        /* -1: none */
  pthread_mutex_t mu;            /* one sender at a time */
};

/* An offer: made by the loop, spent by the receiver whose connection
 * proves the key (under xfer_conn.c's offers_mu). */
struct xfer_offer {
  int peer;                      /* -1: free */
  bool withdrawn;                /* the peer went down since: stale, as when expired (told
                                    apart from a token never offered: peer.h PEER_TOKEN_STALE) */
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint64_t expires_ms;
};

/* A peer's offer that came while as many of our connectors to it were under
 * way as it may have: the next of them to finish dials it (xfer_conn.c,
 * under its offers_mu).  Free once until_ms has passed. */
struct xfer_queued {
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint8_t dkey[DEP_PEER_MAC_LEN]; /* peer_data_key(peer, true), taken on the loop */
  uint64_t gen;                   /* the peer's generation when it came */
  uint64_t until_ms;              /* when it expires at the peer, at the latest (mono ms) */
};

/* What a peer did beyond its bounds, said at most every XFER_SAY_MS (xfer_conn.c). */
struct xfer_peer {
  struct xfer_out out[XFER_CONNS_MAX];
  _Atomic uint32_t next;         /* round robin over out[] */
  _Atomic uint32_t conns_in;      /* proven and receiving */
  _Atomic uint32_t connecting;    /* connector threads to it, of any generation */
  _Atomic uint64_t dialing;       /* those of generation gen: its low 32 bits << 32 | their
                                     count, at most X->conns (xfer_on_offer) */
  struct xfer_queued queued[XFER_CONNS_MAX]; /* at most X->conns in use */
  struct xfer_say excess_offers, bad_proofs, stale_frames, stale_offers,
      bad_staged;
  _Atomic uint64_t bytes_out, bytes_in, frames_out, frames_in;
  _Atomic uint64_t gen;          /* bumped when the peer goes down: connectors of an older one quit */
  int in_fds[XFER_CONNS_MAX];    /* inbound connections' fds, for shutdown (under X->lock) */
};

/*
 * A part of a batch to send: len bytes of the batch's buf at off (headers,
 * and payloads copied in), or of an out block in place (ext), whose route
 * is held (users) until the batch is sent.
 */
struct xfer_seg {
  size_t off;
  const uint8_t *ext;            /* NULL: in buf */
  size_t len;
  struct xfer_route *held;       /* ext's route, given back after the send */
};

/* A proxy thread's batch for one peer (frames: headers and payloads, in
 * segs, bytes in all), or a receiver's scratch for a payload no job here
 * reads (buf alone). */
struct xfer_batch {
  uint8_t *buf;
  size_t len, cap;
  struct xfer_seg *seg;
  uint32_t n_seg;
  size_t cap_seg;
  size_t bytes;
  size_t *mark;                  /* where each frame starts, in bytes of the batch */
  uint32_t n_mark;
  size_t cap_mark;
};

/* The data path's state: what the loop and the threads share. */
struct xfer_state {
  bool active;
  const struct config *cfg;
  uint32_t nthreads;
  uint32_t conns;      /* connections each way to a peer: the data's, then the control lane */
  uint32_t data_conns; /* of them, the data's: out[0..data_conns); out[data_conns] the lane */
  uint16_t listen_port;
  pthread_rwlock_t lock;         /* routes, in_fds */
  pthread_mutex_t routes_mu;      /* routes_cv's */
  pthread_cond_t routes_cv;       /* a route was added, an expected job went, or stop
                                     (CLOCK_MONOTONIC) */
  _Atomic uint64_t routes_added;  /* such changes so far (changed under routes_mu) */
  struct xfer_route *routes;
  uint64_t serials;              /* the loop's: routes listed so far (each one's serial) */
  struct xfer_expect *expected;   /* under lock: jobs whose frames may precede their route */
  _Atomic bool stop;
  pthread_t threads[CONFIG_MAX_PROXY_THREADS];
  uint32_t started;
  struct xfer_peer peers[CONFIG_MAX_LIST];
  struct xfer_offer offers[XFER_OFFERS_MAX]; /* under xfer_conn.c's offers_mu */
  _Atomic int test_drops;        /* $DEEPEPD_TEST_DATA_DROPS left to do (testhooks.h) */
  char ended[XFER_ENDED_MAX][DEP_JOB_ID_MAX];  /* under lock: the last jobs whose route went */
  uint32_t n_ended;
  _Atomic uint32_t helpers;      /* connector, receiver and populate threads running */
  int test_fill_hold;            /* $DEEPEPD_TEST_XCHG_FILL_HOLD_FD (testhooks.h); 0: none */
  uint32_t test_cpus;            /* $DEEPEPD_TEST_CPUS (testhooks.h); 0: the affinity's */
  uint64_t test_awake_ns;        /* $DEEPEPD_TEST_AWAKE_US (testhooks.h), in ns; 0: off */
  _Atomic uint64_t busy_ns;      /* proxy threads' time moving blocks, summed */
  uint64_t spin_ns;              /* a proxy thread's look for work before it naps (below) */
  _Atomic uint64_t rx_spin_ns;   /* a receiver's look for its next frame before it blocks; set
                                    with the proxy threads, while receivers may run */
};

/*
 * How long the data path stays awake after its last work.  A thread that
 * sleeps is woken late: a nap's step, or a blocked receiver's wake-up
 * through the scheduler, paid by every call that comes after a pause and
 * by the first call after attach.  Serving GPUs, the CPUs are otherwise
 * idle and a call's descriptors come from kernels that no host code
 * announces, so the proxy threads (one a GPU) and the receivers of the
 * data connections that carried a frame keep looking across a trainer's
 * gap between layers.  On the host backend the CPUs do the ranks' copies:
 * a proxy thread looks only for a call's next descriptor, which comes
 * within microseconds of the last, and receivers block at once
 * (BENCHMARKS.md, "The data path after a pause").
 */
#define XFER_SPIN_GPU_NS 10000000ull
#define XFER_SPIN_HOST_NS 200000ull

extern struct xfer_state xfer__state;
/* Each file's handle on it. */
static struct xfer_state *const X = &xfer__state;

static inline uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- xfer.c ---- */

/* A route of a world of `world` ranks, zeroed, its per-world tables in the
 * same allocation (free() frees both); NULL when out of memory. */
struct xfer_route *xfer__route_new(uint32_t world);

/* Stop a route (any thread, lock held for reading at least): its rings say code. */
void xfer__route_fail(struct xfer_route *r, int code);
/* Wait until a route is added after `seen` (a value of X->routes_added read
 * before looking for it), stop, or deadline_ns (mono_ns's clock). */
void xfer__routes_wait(uint64_t seen, uint64_t deadline_ns);
/* Fail every route that sends to peer k (lock held for reading at least),
 * with DEP_ERR_PEER, saying once per route "job ID: WHAT NODE; the job
 * fails". */
void xfer__routes_fail_peer(int k, const char *what);
/* Where a frame's parts land in its destination's exchange region (each
 * NULL when it has none), and the word its mark or credit stores. */
struct xfer_target {
  uint8_t *payload;            /* its bytes: the in block, or a chunk's ring rows in it */
  _Atomic uint64_t *mark;      /* a chunk's mark (in_mark) */
  uint8_t *slot;               /* the in slot */
  bool node;                   /* a node channel's chunk: read, then fanned out
                                  (xfer__node_fanout) */
  _Atomic uint64_t *credit;    /* a credit: the destination's out slot's credit word; a
                                  taken word (DEP_XRING_TAKEN): its taken word */
  uint64_t value;              /* what mark or credit stores */
};
/* Why a chunk (rows row0 .. row0 + bytes / row_bytes of a call's stream,
 * kind DEP_XRING_CHUNK and or SLOT) does not fit layout l; NULL when it does. */
const char *xfer__chunk_wrong(const struct dep_slab_layout *l, uint32_t kind, uint32_t row0,
                              uint64_t bytes);
/* Whether kind is one a descriptor or frame may have. */
bool xfer__kind_known(uint32_t kind);
/* Check a frame's header from peer k against the routes (lock held); on
 * success say where its parts go (t), valid while the lock is held.
 * DEP_ERR_NOT_FOUND: no such job here now; DEP_ERR_STATE: none, but it may
 * come (the caller waits for it); DEP_ERR_PROTOCOL with why: the job does
 * not allow it. */
int xfer__frame_target(int k, const struct dep_xfer_hdr *h, struct xfer_route **route,
                       struct xfer_target *t, char *why, size_t whylen);
/* Write node channel chunk h (its payload, buf: the table, then the rows)
 * into the in channels of its destinations held here, route r held: every
 * row, then each chunk's count.  0, or DEP_ERR_PROTOCOL with why (nothing
 * written): the table or a row's ids do not fit the job. */
int xfer__node_fanout(struct xfer_route *r, const struct dep_xfer_hdr *h, const uint8_t *buf,
                      char *why, size_t whylen);
/* A NODE frame that peer k wrote into our staging by RDMA: xfer_rdma.h's
 * xfer_stage_fn (xfer_conn.c), the routes' lock held. */
int xfer__stage_take(int k, const uint8_t *frame, uint64_t room, struct xfer_rdma_route **to);
/* Once a frame's payload is in (t->payload), store its mark (release),
 * then its slot's fields and flag (release), or its credit if larger:
 * plain stores into host memory, which a kernel waiting on the flag over
 * the device mapping sees in that order (the route held). */
void xfer__frame_publish(const struct xfer_target *t, const struct dep_xfer_hdr *h);
/* Around a receiver's write of a payload into a rank's block: the ranks'
 * memory, whose order ThreadSanitizer cannot see (xfer.c). */
void xfer__payload_begin(void);
void xfer__payload_end(void);
/* Give back a route taken (users) for I/O outside the lock. */
void xfer__route_put(struct xfer_route *r);

/* ---- xfer_proxy.c ---- */

/* The proxy threads start with the first job that needs them, when the
 * devices are known: 0 once one of them runs, else -1. */
int xfer__start_threads(void);
/* Grow b's buf to hold n more bytes past its len; false when out of memory. */
bool xfer__batch_room(struct xfer_batch *b, size_t n);
/* Empty a sent (or failed) batch, giving back the routes its segments hold. */
void xfer__batch_reset(struct xfer_batch *b);
void xfer__batch_free(struct xfer_batch *b);

/* ---- xfer_conn.c ---- */

/* Forget j's expectation, or every one (NULL: xfer_fini); lock held for writing. */
void xfer__unexpect(const struct job *j);
/* Close peer k's outbound connection i (its mutex held). */
void xfer__out_close(struct xfer_peer *xp, uint32_t i);
/* Send or receive all len bytes, waiting at most ms for any progress (xfer__io_all:
 * XFER_IO_MS): 0, or -1. */
int xfer__io_within(int fd, void *buf, size_t len, bool send_it, int ms);
int xfer__io_all(int fd, void *buf, size_t len, bool send_it);
/* Wait until fd is readable, checking for stop each second, until until_ms (mono_ns ms;
 * 0: no end): 1 readable, 0 stopping or timed out, -1 error. */
int xfer__wait_readable_until(int fd, uint64_t until_ms);
/* Whether a connection's other end has closed it (or sent what none expects). */
bool xfer__out_dead(int fd);
/* Guards the offers this daemon made and each peer's queued offers (xfer_peer.queued). */
extern pthread_mutex_t xfer__offers_mu;
/* A data connection's socket options. */
void xfer__tune_socket(int fd);
/* Run fn(arg) on a detached thread counted in X->helpers; false when none could start. */
bool xfer__spawn_helper(void *(*fn)(void *), void *arg);

/* ---- xfer_send.c ---- */

/* Send batch b (frames of them) to peer k on its data connections, or a
 * batch of credits and taken words (ctl) on its control lane (xfer_send.c):
 * 0, or -1 with every route that sends to k failed. */
int xfer__batch_send(int k, struct xfer_batch *b, uint64_t frames, bool ctl);

#endif /* DEP_DAEMON_XFER_INTERNAL_H */
