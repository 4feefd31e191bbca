/*
 * stats.h — the daemon's side of the per-rank stats (DESIGN §10): it lends
 * each rank of a running job its stats page (proto/stats_page.h), reads the pages
 * on a timer on the loop and folds their calls into histograms of its own,
 * logs a first call slower than warn_first_call_ratio x its op's steady
 * median, keeps an ended job's last figures for a while, answers STATS and
 * CLIENTS, and keeps systemd's STATUS= line current.
 *
 * The module learns that a job ended by looking it up on its timer (the
 * job table needs no hook): a job gone from the table, or replaced by a
 * newer one of the same id, has ended.
 */
#ifndef DEP_DAEMON_STATS_H
#define DEP_DAEMON_STATS_H

#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "proto.h"

struct conn;

/* Ended jobs whose figures are kept, and for how long after they ended. */
#define STATS_KEEP_JOBS 16u
#define STATS_KEEP_S 900u
/* Steady calls an op needs before its median counts for the first-call check. */
#define STATS_WARN_MIN_STEADY 8u

/* Start with the running configuration (read at each use: reload rewrites it). */
void stats_init(uv_loop_t *loop, const struct config *cfg);
void stats_fini(void);

/* STATS_LEND from connection c: lend its rank its page (replies itself). */
void stats_lend(struct conn *c, uint32_t request_id);
/* Connection c's rank was given its SM budget (autotune.c): its page's record says so, if
 * the page is lent already (else stats_lend copies it). */
void stats_tuned(const struct conn *c);
/* STATS: the ranks of the jobs c may see (one job, or all), then STATS_OK. */
void stats_reply(struct conn *c, uint32_t request_id, const struct dep_msg_stats_req *req);
/* Every rank's figures, as STATS gives them to root (metrics.listen): *ranks
 * malloc'd (free it), *n of them, and STATS_OK's figures.  0 or DEP_ERR_NO_MEMORY. */
int stats_snapshot(struct dep_msg_stats_rank **ranks, uint32_t *n, struct dep_msg_stats_ok *ok);
/* CLIENTS: the connections c may see. */
void stats_clients(struct conn *c, uint32_t request_id);

#endif /* DEP_DAEMON_STATS_H */
