/*
 * job.h — deepepd's job table (DESIGN §4, §5): which ranks of which job are
 * attached on this node, and the node-local rendezvous that answers every
 * rank's ATTACH at once when the last local rank arrives (or fails them all
 * when limits.attach_timeout_ms passes first).
 *
 * A job belongs to the uid that created it.  What it is lent (lend.h) is
 * made when the rendezvous completes, before the replies go out, and given
 * back when its last rank is gone.
 *
 * A multi-node job (world_size > local_world_size, DESIGN §7) completes
 * only when every global rank 0..world_size-1 is held by exactly one node:
 * this one, or a peer daemon that reported it in a MEMBERSHIP message
 * (peer_proto.h), and every node holding ranks of it has taken this
 * node's MEMBERSHIP (MEMBERSHIP_OK), so that no refusal comes after its
 * ranks were answered.  Its membership goes to every peer that is up once
 * its local ranks are all here; a conflict, a refusal, a timeout, a peer
 * lost while it gathers fails it on every node.  Operations across nodes
 * run over the job's ring of data connections (xfer.h); a rank whose ring
 * could not be made is refused them with the reason (client/ops.c).
 */
#ifndef DEP_DAEMON_JOB_H
#define DEP_DAEMON_JOB_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "config.h"
#include "deepep.h"
#include "proc.h"
#include "peer_proto.h"
#include "proto.h"

struct conn;
struct pool_block; /* one block of a device's pool (pool.h) */
struct lend_xchg;  /* a rank's ring and exchange region (lend.h) */
struct job_elastic; /* an elastic job's live mask and history (job_elastic.c) */

/* One local rank's place in its job. */
struct job_rank {
  struct conn *conn;         /* NULL: the slot is free */
  uint32_t rank;             /* global rank */
  pid_t pid;                 /* from SO_PEERCRED */
  struct proc_id proc;       /* that process, taken when it joined (pid 0: already gone) */
  uint32_t request_id;       /* of the ATTACH waiting for the rendezvous */
  bool waiting;              /* that ATTACH has no reply yet */
  uint8_t device_uuid[16];   /* the GPU this rank uses */
  struct pool_block *arena;  /* the arena holding its slab: one pool block, shared by the
                                local ranks on its device, lent by job_on_complete */
  uint64_t offset;           /* of its slab in that arena */
};

struct job {
  char id[DEP_JOB_ID_MAX];
  uid_t owner_uid;           /* SO_PEERCRED of the creator */
  uint32_t world_size;
  uint32_t local_world_size;
  uint32_t chunk_rows;       /* its layout's chunk (slab.h; 0: whole blocks), chosen once when
                                the job was made: stream_chunk_rows, or auto's choice */
  bool chunk_auto;           /* stream_chunk_rows: auto chose it, weighing its whole blocks
                                (chunk_whole_bytes a rank) against its pool (chunk_pool_bytes) */
  bool chunk_xnode;          /* ... or as the host backend's chunk for a job across nodes */
  uint64_t chunk_whole_bytes, chunk_pool_bytes;
  struct dep_job_shape shape;
  uint64_t created_ns;       /* uv_hrtime() */
  uint64_t ready_ns;         /* uv_hrtime() when the rendezvous completed (deepepctl clients) */
  uint32_t timeout_ms;       /* limits.attach_timeout_ms when the job was made */
  uint64_t slab_bytes;       /* per rank: the layout's size, then the stride in an arena */
  uint64_t host_bytes;       /* per rank: its ring and exchange region (0 on one node) */
  uint32_t attached;         /* occupied slots in ranks[] */
  bool ready;                /* the rendezvous completed */
  bool multinode;            /* world_size > local_world_size and peers configured: they
                                hold the other ranks */
  bool announced;            /* our MEMBERSHIP went to the peers (local ranks all here) */
  uint64_t accepted;         /* bit k: peer k answered that MEMBERSHIP with MEMBERSHIP_OK */
  bool lent;                 /* its arenas are lent: at the rendezvous, or for a multi-node
                                job once its local ranks are all here (MEMBERSHIP carries
                                where peers write into them) */
  uint64_t filling_ns;       /* uv_hrtime() when its ATTACH replies began to wait for its
                                exchange regions to be mapped in (job_complete_filled) */
  bool dead;                 /* torn down, waiting for the timer's close callback */
  uint32_t told;             /* what the abort words say (lend_tell_gone): 0 nothing yet,
                                else 1 + the DEP_SLAB_GONE_* of the rank they name */
  uint32_t flags;            /* its ranks' DEP_ATTACH_* bits (every rank's, every node's) */
  struct job_elastic *elastic; /* an elastic job's mask and history (job_elastic.c), made
                                  with the job; NULL for a job that is not elastic */
  uv_timer_t timer;          /* the attach timeout */
  uv_timer_t fill_timer;     /* the poll of a filling job (job_complete_filled); closed
                                after timer, and the job is freed with it (job_destroy) */
  struct lend_xchg *xchg;    /* a job that spans nodes, once lent: each local rank's ring and
                                exchange region (lend.h), by local rank; NULL otherwise */
  struct job *next;
  struct job_rank ranks[];   /* local_world_size slots, indexed by local rank */
};

/* Failures of multi-node jobs a node remembers for their late ranks (job_failed.c):
 * past that the oldest is forgotten, and its late ranks gather the id anew. */
#define JOB_FAILED_MAX 128u

/* Start the job table with the running configuration (read at each use:
 * it is rewritten on reload). */
void job_init(uv_loop_t *loop, const struct config *cfg);
/* Tear every job down (the daemon is stopping). */
void job_fini(void);

/*
 * ATTACH from connection c (args already checked by proto_check_attach).
 * Replies itself: an ERROR at once, or ATTACH_OK to every local rank when
 * the last one arrives.
 */
void job_attach(struct conn *c, uint32_t request_id, const struct dep_attach_args *a);
/*
 * An ATTACH that fails before job_attach (its fields did not check out):
 * answer it with code and msg, and fail the gathering job it names, if that
 * job is c's uid's, for every rank waiting in it (DESIGN §5).
 */
void job_refuse_attach(struct conn *c, uint32_t request_id, const struct dep_attach_args *a,
                       int code, const char *msg);
/* DETACH from connection c: leave its job and reply. */
void job_detach(struct conn *c, uint32_t request_id);
/* Connection c is gone (its rank died or left): free its slot. */
void job_conn_closed(struct conn *c);

/* Remote ranks of job j that peers reported, and how many peers reported them. */
uint32_t job_remote_ranks(const struct job *j, uint32_t *nodes);
/* The MEMBERSHIP that peer k sent for job j (its id, under j's uid: its
 * ranks, their exchange regions' windows), NULL when none is held; valid
 * until the loop runs on. */
const struct dep_peer_membership *job_membership(const struct job *j, int peer);
/* Find a live job by id (NULL when none). */
struct job *job_lookup(const char *id);

/* Number of live jobs. */
uint32_t job_count(void);
/*
 * Fill st->jobs / st->num_jobs with the jobs `viewer_uid` may see (root and
 * the daemon's own uid see all; others their own), at most max_jobs of
 * them.  Returns 0 or DEP_ERR_NO_MEMORY; free st->jobs with free().
 */
int job_fill_status(struct dep_status *st, uid_t viewer_uid, uint32_t max_jobs);

/* Fill m (JOB_NODES_OK) with the multi-node jobs viewer_uid may see, as
 * job_fill_status chooses them. */
void job_fill_nodes(struct dep_msg_job_nodes *m, uid_t viewer_uid);
/* Fill m (JOB_EVENTS_OK) with the histories of the elastic jobs viewer_uid may
 * see, as job_fill_status chooses them. */
void job_fill_events(struct dep_msg_job_events *m, uid_t viewer_uid);

#endif /* DEP_DAEMON_JOB_H */
