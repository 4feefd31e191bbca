/*
 * ctl_view.h — the daemon's records as output tables, defined once for
 * the two programs that render them: deepepctl (`stats` as text or JSON,
 * `metrics`) and deepepd itself (metrics.listen serves the same
 * Prometheus exposition over HTTP, daemon/metrics_http.c).  The tables
 * are ctl_out.h's; both programs link this file and ctl_out.c, which is
 * why they live in render/, in neither program's folder.
 */
#ifndef DEP_CTL_VIEW_H
#define DEP_CTL_VIEW_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ctl_out.h"
#include "deepep.h"
#include "proto.h"

/* The daemon's per-rank figures (STATS), as deepepctl fetches them or deepepd holds them. */
struct ctl_stats {
  struct dep_msg_stats_rank *ranks; /* n of them, in the daemon's order */
  uint32_t n;
  struct dep_msg_stats_ok ok;
};

/*
 * A job's load balance as one daemon sees it: the tokens its ranks there send to each rank of
 * the job in their newest layouts, summed.  Ranks whose newest layout is of another world, or
 * that repeat a rank already counted (an earlier run of the same job id), are left out.
 */
#define CTL_BALANCE_TOP 3 /* the hot ranks named: enough to act on, short enough for a line */
struct ctl_balance {
  uint32_t world;       /* the job's; 0: no rank of the job here has a layout */
  uint32_t ranks;       /* ranks whose layout was counted */
  uint64_t *to;         /* [world]: tokens to each rank */
  uint64_t total, min, median, max;
  uint32_t top[CTL_BALANCE_TOP]; /* the ranks receiving most, most first (ties: lower rank) */
  uint32_t ntop;        /* those that receive any */
};
/* Whether s->ranks[i] is the first of its job's rows in s (a job's tables are made once). */
static inline bool ctl_stats_job_first(const struct ctl_stats *s, uint32_t i) {
  for (uint32_t j = 0; j < i; j++)
    if (strcmp(s->ranks[j].job_id, s->ranks[i].job_id) == 0)
      return false;
  return true;
}
/* The balance of job in s: 0, or -1 out of memory.  Free with ctl_balance_free. */
int ctl_balance_of(const struct ctl_stats *s, const char *job, struct ctl_balance *b);
void ctl_balance_free(struct ctl_balance *b);

/* The op table (one row per job, rank and op that ran), the rank table
 * (one per rank, with the tokens of its newest layout to each rank in
 * JSON) and the metrics of each; the balance table (one row per job with
 * a layout: its ctl_balance summarised). */
struct ctl_view {
  struct ctl_table ops, ranks, balance;
  struct ctl_mtable mops, mranks;
  struct ctl_val *op_cells, *rank_cells, *balance_cells;
  char (*uuid)[DEP_UUID_STR_LEN]; /* per rank */
  char (*top)[CTL_BALANCE_TOP * 24]; /* per balance row: "100:812 7:640 33:601" */
  uint32_t (*top_ranks)[CTL_BALANCE_TOP]; /* per balance row */
};
/* 0, or -1 out of memory.  v points into s: keep s until ctl_view_free. */
int ctl_view_stats(const struct ctl_stats *s, struct ctl_view *v);
void ctl_view_free(struct ctl_view *v);

/*
 * The whole Prometheus text exposition (version 0.0.4) of one daemon: its
 * state and counts (st), its pools (st's devices), its peers and data path
 * (pm, NULL for none), its jobs that span nodes (jn, NULL for none) and
 * every rank's ops (s; of the runs of one job id, the latest
 * run's alone, so that each series is named once).  0, or -1 (out of
 * memory, or f failed).
 */
int ctl_view_metrics(FILE *f, const struct dep_status *st, const struct ctl_stats *s,
                     const struct dep_msg_peers *pm, const struct dep_msg_job_nodes *jn);

/* The exposition's media type, for an HTTP Content-Type. */
#define CTL_VIEW_METRICS_TYPE "text/plain; version=0.0.4; charset=utf-8"

#endif /* DEP_CTL_VIEW_H */
