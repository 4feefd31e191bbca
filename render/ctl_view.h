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

#include "ctl_out.h"
#include "deepep.h"
#include "proto.h"

/* The daemon's per-rank figures (STATS), as deepepctl fetches them or deepepd holds them. */
struct ctl_stats {
  struct dep_msg_stats_rank *ranks; /* n of them, in the daemon's order */
  uint32_t n;
  struct dep_msg_stats_ok ok;
};

/* The op table (one row per job, rank and op that ran) and the rank table
 * (one per rank), and the metrics of each. */
struct ctl_view {
  struct ctl_table ops, ranks;
  struct ctl_mtable mops, mranks;
  struct ctl_val *op_cells, *rank_cells;
  char (*uuid)[DEP_UUID_STR_LEN]; /* per rank */
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
