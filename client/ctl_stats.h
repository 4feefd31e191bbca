/*
 * ctl_stats.h — what `stats`, `metrics` and `doctor` share: fetching the
 * daemon's per-rank figures (STATS) into struct ctl_stats, whose output
 * tables ctl_view.h defines, and the load-balance figure doctor judges.
 */
#ifndef DEP_CTL_STATS_H
#define DEP_CTL_STATS_H

#include <stdint.h>

#include "ctl.h"
#include "ctl_view.h"
#include "deepep.h"
#include "proto.h"

/* STATS for one job (NULL or "": every job the caller may see).  0, or the
 * request's failure with its message on c. */
int ctl_stats_fetch(dep_client_t *c, const char *job, struct ctl_stats *out);
void ctl_stats_free(struct ctl_stats *s);

/* Load balance (doctor): the largest tokens any rank receives over the
 * mean, from the newest layout every rank of the job reported; 0 when the
 * job has no layout from every rank. */
double ctl_stats_skew(const struct ctl_stats *s, const char *job, uint32_t *hot_rank);

#endif /* DEP_CTL_STATS_H */
