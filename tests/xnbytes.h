/*
 * xnbytes.h — what a dispatch between daemons should put on the wire, and
 * what the daemons say they sent: one crossing per destination node
 * (xring.h), predicted from the routing and read from deepepctl status.
 * Shared by the host backend's case (check_stream.c) and the cuda one's
 * (check_xnode_stream.c), so that both check one prediction.
 */
#ifndef DEP_TESTS_XNBYTES_H
#define DEP_TESTS_XNBYTES_H

#include <stdint.h>

#include "nodes.h"
#include "opsworld.h"
#include "xnjob.h"

/*
 * The rows one fresh dispatch of case d, its ranks placed as p over
 * `nodes` nodes, sends between nodes from each node: rows[n] counts each
 * token of a rank on node n once per other node holding a rank one of its
 * experts is on (one crossing per destination node); per_rank[n] once per
 * such rank (one crossing per destination rank, the old way).  Rows of
 * the job's row_bytes each.
 */
void xn_cross_rows(const struct ow_case *d, const struct xn_place *p, int nodes, uint64_t *rows,
                   uint64_t *per_rank);
/* What the proxy on node i sent of job's rows (payload_out in deepepctl status --json), or
 * UINT64_MAX (why in why) when the daemon does not say: it may be read from a rank's process,
 * where a failed assertion would say nothing. */
uint64_t xn_payload_out(const struct nodes *ns, int i, const char *job, char *why, size_t len);

#endif
