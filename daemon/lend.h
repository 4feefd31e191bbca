/*
 * lend.h — what a job is lent (DESIGN §4): its arenas, one pool block per
 * device holding the slabs of its local ranks there, made or reused when
 * its rendezvous completes and given back when its last rank is gone; the
 * SLAB frames that carry them; and the abort words (slab.h) that tell a
 * running job's ranks that one of them is gone.  job.c is the job table and
 * the rendezvous; it calls these at the points of a job's life.
 */
#ifndef DEP_DAEMON_LEND_H
#define DEP_DAEMON_LEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "job.h"
#include "peer_proto.h"
#include "slab.h"

struct pool_region;

/*
 * A local rank's ring to the proxy and exchange region (xring.h, slab.h):
 * one sealed memfd of host memory (pool.h's region), mapped by the
 * daemon, lent to the rank at XRING_LEND, registered with the NIC where
 * there is one (peers write into its in blocks and slots).  Made with the
 * arenas of a job that spans nodes, or taken with its registration from
 * the cache of an earlier job of the same uid, shape, world and local
 * ranks, its ring and slots reset; cached again when the job ends.
 */
struct lend_xchg {
  struct pool_region *region; /* NULL: none */
  bool lent;               /* its rank was sent it (XRING_LEND) */
};

/* Start lending with the running configuration (read at each use: it is
 * rewritten on reload) and the loop that reaps exited holders. */
void lend_init(uv_loop_t *loop, const struct config *cfg);
void lend_fini(void);

/* Whether a job of a's worlds spans nodes: ranks elsewhere, and peers to hold them (with
 * none configured, the job completes with its local ranks, laid out for its world). */
bool lend_spans_nodes(const struct dep_attach_args *a);

/*
 * auto's chunk for a job across nodes on the host backend, where it fits: there a call's
 * packing, the wire and unpacking overlap chunk by chunk, its first call comes nearer its
 * median than with whole blocks, its throughput is no worse, and the channels bound the
 * memory (BENCHMARKS.md, "Whole blocks against chunks on the host backend").  On cuda the
 * streamed kernels are slower than whole blocks, and within a node the host backend's gain
 * is within the noise: there auto keeps whole blocks where they fit.
 */
#define LEND_AUTO_XNODE_HOST_ROWS 64u

/* What a job of a shape is lent on a device (lend_check). */
struct lend_fit {
  uint32_t chunk_rows;  /* its chunk (slab.h; 0: whole blocks): the one asked, or auto's */
  bool by_auto;         /* auto chose chunk_rows: 0 where whole blocks fit the pool */
  bool xnode;           /* ... as LEND_AUTO_XNODE_HOST_ROWS, the host backend's across nodes */
  uint32_t here;        /* the job's local ranks weighed on the device (lend_ranks_here) */
  uint64_t slab_bytes;  /* the layout's size of a slab */
  uint64_t host_bytes;  /* a rank's ring and exchange region (0 on one node) */
  uint64_t whole_bytes; /* by_auto: a rank's bytes with whole blocks (what auto weighed) */
  uint64_t pool_bytes;  /* the device's pool's budget (pool_total_bytes) */
};

/*
 * How many of a job's local_world local ranks a check weighs on one device
 * of the `devices` this daemon serves, `seated_here` of them already seated
 * there: as many as spreading them evenly puts on a device (all of them on
 * a daemon of one device), or the seated ones and this one where more came.
 * The first rank's count is the same on every node of a configuration, so
 * auto's choice is too; a later rank that finds its device fuller than
 * spread is weighed as it is, and refused at attach where that does not fit.
 */
uint32_t lend_ranks_here(uint32_t local_world, size_t devices, uint32_t seated_here);

/*
 * Before a rank joins: its device is one this daemon serves, and an arena of
 * the job's shape for lend_ranks_here's count of its ranks fits that
 * device's pool at all, its channels of chunks of chunk_rows rows (0: whole
 * blocks; CONFIG_CHUNK_ROWS_AUTO: whole blocks where they fit, else the
 * largest chunk that does, chosen from the shape, the worlds, the GPUs
 * served and the pool's budget alone; a job across nodes on the host
 * backend LEND_AUTO_XNODE_HOST_ROWS where they fit).  seated_here: the job's
 * ranks already seated on the rank's device.  0 with *f, or
 * DEP_ERR_NOT_FOUND / NO_MEMORY / INVALID with why.
 */
int lend_check(const struct dep_attach_args *a, uint32_t chunk_rows, uint32_t seated_here,
               struct lend_fit *f, char *why, size_t whylen);

/* The rendezvous completed: lend the job its arenas and place every local
 * rank's slab (j->slab_bytes becomes the stride), and for a job that spans
 * nodes make each local rank's ring and exchange region (j->xchg).  0, or
 * DEP_ERR_* with why, and nothing lent. */
int lend_arenas(struct job *j, char *why, size_t whylen);

/* What a peer needs to write into the job's local ranks (MEMBERSHIP's
 * windows): each rank's exchange region, registered with the NIC first
 * unless it was before; a window with rkey 0 where it could not be.  0, or
 * DEP_ERR_LIMIT with why. */
int lend_windows(const struct job *j, struct dep_peer_membership *x, char *why, size_t whylen);

/* Local rank lr's ring and exchange region is being sent to connection c's
 * process, which may map it until it exits. */
void lend_xchg_hold(const struct job *j, uint32_t lr);

/* Send connection c every arena of the job, one SLAB frame each; c's process
 * is a holder of them from here. */
int lend_send(const struct job *j, struct conn *c, uint32_t request_id);

/* Give the job's arenas back: scrubbed and cached or freed, or, when
 * abandon (the daemon is stopping), let go of unscrubbed (DESIGN §13); its
 * rings and exchange regions are cached (with the arenas' rule,
 * buffer_cache.enabled) or go (a rank that mapped one keeps its pages
 * until it unmaps them). */
void lend_release(struct job *j, bool abandon);

/* Rank `gone` of the running job j left (how: DEP_SLAB_GONE_*, slab.h): write
 * the abort words into the slab of every local rank still in it (logged). */
void lend_tell_gone(struct job *j, const struct job_rank *gone, uint32_t how);

#endif /* DEP_DAEMON_LEND_H */
