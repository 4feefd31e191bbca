/*
 * ctl_stats.h — what `stats`, `metrics` and `doctor` share: fetching the
 * daemon's per-rank figures (STATS) and the two output tables they are
 * rendered from, each defined once with the metrics its columns are
 * (ctl_stats.c).
 */
#ifndef DEP_CTL_STATS_H
#define DEP_CTL_STATS_H

#include <stdint.h>

#include "ctl.h"
#include "deepep.h"
#include "proto.h"

struct ctl_stats {
  struct dep_msg_stats_rank *ranks; /* n of them, in the daemon's order */
  uint32_t n;
  struct dep_msg_stats_ok ok;
};

/* STATS for one job (NULL or "": every job the caller may see).  0, or the
 * request's failure with its message on c. */
int ctl_stats_fetch(dep_client_t *c, const char *job, struct ctl_stats *out);
void ctl_stats_free(struct ctl_stats *s);

/* The op table (one row per job, rank and op that ran) and the rank table
 * (one per rank), and the metrics of each. */
struct ctl_stats_view {
  struct ctl_table ops, ranks;
  struct ctl_mtable mops, mranks;
  struct ctl_val *op_cells, *rank_cells;
  char (*uuid)[DEP_UUID_STR_LEN]; /* per rank */
};
int ctl_stats_view(const struct ctl_stats *s, bool json, struct ctl_stats_view *v);
void ctl_stats_view_free(struct ctl_stats_view *v);

/* Load balance (doctor): the largest tokens any rank receives over the
 * mean, from the newest layout every rank of the job reported; 0 when the
 * job has no layout from every rank. */
double ctl_stats_skew(const struct ctl_stats *s, const char *job, uint32_t *hot_rank);

#endif /* DEP_CTL_STATS_H */
