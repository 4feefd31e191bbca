/*
 * mnrank.h — the multi-node suites' ranks spoken on raw sockets
 * (check_multinode.c, check_multinode_fail.c): ATTACH of a global rank on
 * one node of `struct nodes`, the ready or failed reply, a 1 + 1 job run
 * end to end, and a rank run as uid 65534.
 */
#ifndef DEP_TEST_MNRANK_H
#define DEP_TEST_MNRANK_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "nodes.h"
#include "proto.h"
#include "testutil.h"

/* Global rank `rank` of job `id`, a world of `world` ranks, as local rank lr of lws. */
struct dep_attach_args job_args(const char *id, uint32_t rank, uint32_t world,
                                uint32_t lr, uint32_t lws);

/* ATTACH *a on a new connection to d: the connection. */
int attach_args(const struct tu_daemon *d, const struct dep_attach_args *a);

/* ATTACH global rank `rank` of a job of `world` ranks as local rank lr of lws on d. */
int attach_rank(const struct tu_daemon *d, const char *id, uint32_t rank, uint32_t world,
                uint32_t lr, uint32_t lws);

/* The ATTACH reply: SLAB frames (their fds closed), then ATTACH_OK for lws local ranks. */
void expect_ready(int fd, uint32_t lws);

/* Rank `rank` of job `id`, a world of two, attaches on node `node` (its only
 * local rank); the other node of two says it has the job's MEMBERSHIP
 * within timeout_ms.  The connection. */
int attach_announced(const struct nodes *ns, int node, const char *id, uint32_t rank,
                     int timeout_ms);

/* A job `id` of 1 + 1 ranks (rank 0 on node 0, rank 1 on node 1) is ready on both; then its
 * ranks leave. */
void expect_1_plus_1_runs(const struct nodes *ns, const char *id);

/* An ERROR with this code whose message holds every needle (NULL-terminated). */
void expect_fail(int fd, int code, const char *needle, const char *needle2);

/*
 * In a child that became uid/gid 65534: ATTACH rank `rank` of job `id` of
 * `world` ranks (one local rank) on sock.  want < 0: expect that error, its
 * message holding `needle` and naming neither another uid nor a node (no
 * "uid 0", no address); want 0: expect no reply for 2 s (the job gathers,
 * not failed).  The exit status is 0 when so, else the step that went wrong.
 */
int attach_as_nobody(const char *sock, const char *id, uint32_t rank, uint32_t world,
                     int want, const char *needle);

/* Two nodes (attach_timeout_ms `timeout`) that any user may attach to,
 * node 1's socket open to uid 65534, started; false, with test skipped
 * saying why, unless root (a rank runs as uid 65534). */
bool nodes_start_for_nobody(struct nodes *ns, const char *test, int timeout);

/* Child pid (attach_as_nobody in it) exited 0; else fail, naming what and the step. */
void expect_child_ok(pid_t pid, const char *what);

#endif /* DEP_TEST_MNRANK_H */
