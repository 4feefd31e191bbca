/*
 * job_internal.h — what the job table's three files share, and nothing
 * outside them includes: job.c (the table and the node-local rendezvous),
 * job_members.c (the peers' MEMBERSHIP records and the gathering across
 * nodes) and job_failed.c (failures remembered for late ranks).  job.h is
 * the job table's face to the rest of the daemon.
 */
#ifndef DEP_DAEMON_JOB_INTERNAL_H
#define DEP_DAEMON_JOB_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "job.h"
#include "peer.h"
#include "peer_proto.h"
#include "proc.h"
#include "proto.h"

struct conn;
struct job_failed; /* one failure remembered (job_failed.c) */

/* ---- job.c: the table ---------------------------------------------------- */

extern struct job *job_list;          /* every live job, newest first */
extern const struct config *job_cfg;  /* the running configuration (rewritten on reload) */

struct job *job_find(const char *id);
/* Fail every rank still waiting for the rendezvous, then tear the job down;
 * a multi-node job's failure is remembered for its late ranks, as on node
 * `where` (NULL: this one) for `reason`. */
void job_fail_from(struct job *j, int code, const char *msg, const char *where,
                   const char *reason);
/* job_fail_from on this node, for msg. */
void job_fail(struct job *j, int code, const char *msg);
/* Lend j its arenas unless they are; false after failing the job (everywhere). */
bool job_lend(struct job *j);
/* Every rank is here: lend memory (unless it was) and answer them all. */
void job_complete(struct job *j);
/* job_complete for a multi-node job whose route just started (xfer_job_start): ready at
 * once, its ranks answered at once when its exchange regions are mapped in
 * (xfer_job_filled), else once they are, polled every JOB_FILL_POLL_MS on fill_timer, or at
 * its attach deadline (created_ns + timeout_ms) whatever they are.  A ready job's events
 * (a rank that leaves, a peer's word) are a ready job's while its ranks wait. */
void job_complete_filled(struct job *j);
/* The rejoin of local rank local_rank of j, which waited for the other daemons, ended:
 * 0, its process is answered as a rank of the job; else refused with code and why, and
 * the rank masked again. */
void job_rejoined(struct job *j, uint32_t local_rank, int code, const char *why);

/* ---- job_members.c: across nodes ----------------------------------------- */

/* What job.c hands peer.c (peer_set_events). */
extern const struct peer_events job_peer_events;

/* "0-3,8,10-11" into buf (cut with ",..." when long) from a byte per world rank (1: in). */
void ranks_fmt(const uint8_t *set, uint32_t world, char *buf, size_t len);
/* Whether a peer holds id for another uid than `uid`, and none for uid. */
bool member_taken(const char *id, uid_t uid);
/* The peer whose record of j holds global rank `rank`, or -1 (none: this node's, or a
 * lost node's). */
int member_holder(const struct job *j, uint32_t rank);
/* A JOB_FAIL (code < 0) or JOB_END (code 0) about the job (owner, id). */
struct dep_peer_msg job_event(const char *id, uint32_t owner, int code, uint32_t rank,
                              bool detached, const char *msg);
/* Peer k's bit in a set of peers (a job's `accepted`, a rejoin's answers to wait for):
 * peers are at most CONFIG_MAX_LIST, 64 at most. */
uint64_t job_peer_bit(int k);
/* Send m to every peer that is up. */
void job_send_peers(const struct dep_peer_msg *m);
/* Send JOB_FAIL (code < 0) or JOB_END (code 0) about j to every peer that is up. */
void job_tell_peers(const struct job *j, int code, uint32_t rank, bool detached,
                    const char *msg);
/* Fail j on every node: the peers are told (JOB_FAIL), the local ranks answered. */
void job_fail_everywhere(struct job *j, int code, const char *msg);
/* Something changed for the gathering multi-node job j: announce, check, complete. */
void job_progress(struct job *j);
/* The multi-node job j timed out: name the missing world ranks and the peers. */
void job_timeout_multinode(struct job *j);
/* c's uid asked for an id that another uid holds (here: j; else a peer's record). */
void job_refuse_taken(struct conn *c, uint32_t request_id, const char *id,
                      const struct job *j);
/* Forget every peer's record (the daemon is stopping). */
void job_members_fini(void);

/* ---- job_elastic.c: elastic jobs (DESIGN §14) ---------------------------- */

/* Make j's mask and history (j->elastic) for a job of world_size ranks; false: no memory. */
bool elastic_new(struct job *j);
/* Free them (the job goes). */
void elastic_free(struct job *j);
/* Local rank r of the running elastic job j left (how: DEP_SLAB_GONE_DIED or
 * DETACHED): its bit set in every local slab, a new epoch, the peers told (JOB_MASK). */
void elastic_leave(struct job *j, const struct job_rank *r, uint32_t how);
/* The ranks peer k held of the running elastic job j are gone with it (the
 * link dropped, or its part of the job ended): each one masked here, and a
 * rejoin waiting for k's answer waits no more. */
void elastic_node_lost(struct job *j, int k, const struct dep_peer_membership *x);
/* Peer k's JOB_MASK about j: taken when it is news (job_elastic.c). */
void elastic_on_mask(struct job *j, int k, const struct dep_peer_membership *x,
                     const struct dep_peer_job_mask *m);
/* Before a process takes the slot of a rank that left the running elastic job
 * j: scrub what its protocol reads (job_elastic.c says which bytes).  0, or
 * DEP_ERR_* with why. */
int elastic_scrub(struct job *j, const struct job_rank *slot, char *why, size_t whylen);
/* Process pid takes the slot of the masked rank `slot` of j (scrubbed): the
 * rank is made live from a call above every call the survivors posted
 * (slab.h's join word), and its history says so.  0; or, when the
 * survivors' calls ran past that call meanwhile, the rank masked again and
 * DEP_ERR_STATE with why (or another DEP_ERR_* where a slab could not be
 * read, or while another rank of j is being brought back).  In a job
 * across nodes 0 may come with *asked: the other daemons were asked, and
 * job_rejoined says how it ended. */
int elastic_join(struct job *j, const struct job_rank *slot, pid_t pid, bool *asked, char *why,
                 size_t whylen);
/* Peer k's JOB_JOINED about j: its answer to the rejoin that waits, if it is that one's. */
void elastic_on_joined(struct job *j, int k, const struct dep_peer_job_joined *m);
/* Whether global rank `rank` of j is masked now. */
bool elastic_masked(const struct job *j, uint32_t rank);
/* j's status: its masked ranks' count, epoch and ranks as text (dep_status_job). */
void elastic_status(const struct job *j, struct dep_status_job *o);
/* Append j's history to m (JOB_EVENTS_OK), within its bound. */
void elastic_events(const struct job *j, struct dep_msg_job_events *m);
/* The link to peer k of the running elastic job j came up: send k this node's view of
 * the job (JOB_HELD) and keep it, for settling a split (job_elastic.c). */
void elastic_held_tell(struct job *j, int k);
/* Peer k's JOB_HELD about j: when the two views show a split, the part the rule picks
 * goes on and this node's part ends if it is the other (job_elastic.c). */
void elastic_on_held(struct job *j, int k, const struct dep_peer_job_held *m);
/* The link to peer k went down: a view sent it is of that link's last return. */
void elastic_peer_down(struct job *j, int k);

/* ---- job_failed.c: failures remembered ----------------------------------- */

/* A told process that waited in the job when it failed: past it for every rank. */
#define JOB_TOLD_ANY UINT32_MAX

/* The live record of (uid, id), or NULL. */
struct job_failed *failed_find(uint32_t uid, const char *id);
/* Record that process p heard failure f as global rank `rank` (or JOB_TOLD_ANY). */
void failed_tell(struct job_failed *f, const struct proc_id *p, uint32_t rank);
/* Remember that the job (uid, id) failed while it gathered (job_failed.c says how). */
void job_remember_failure(uint32_t uid, const char *id, int code, const char *where,
                          const char *reason, const struct job *j);
/* Answer a late rank of a failed attempt with its failure (true), or touch nothing. */
bool job_refuse_late(struct conn *c, uint32_t request_id, const struct dep_attach_args *a);
/* The first rank of a multi-node job was refused before the job was made:
 * its other nodes and its later ranks here are told. */
void job_refuse_first(struct conn *c, const struct dep_attach_args *a, int code,
                      const char *msg);

#endif /* DEP_DAEMON_JOB_INTERNAL_H */
