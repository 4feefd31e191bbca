/*
 * ctl_metrics.c — `deepepctl metrics`: the daemon's figures in the
 * Prometheus text exposition format (version 0.0.4), for node-exporter's
 * textfile collector (deepepctl metrics > /var/lib/node_exporter/deepep.prom,
 * written to a temporary file and renamed) or a scrape through a wrapper.
 * The exposition is ctl_view.c's, the very code deepepd's metrics.listen
 * serves over HTTP.  The format is text: --json is refused (stats --json
 * has the records).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "ctl.h"
#include "ctl_stats.h"

int ctl_metrics(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  if (ctl->json)
    return ctl_usage_error(ctl, "metrics prints the Prometheus text format only; for JSON use "
                                "deepepctl stats --json");
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_status *st = NULL;
  if ((rc = dep_status(c, &st)) != 0)
    return ctl_fail_client(ctl, c, rc, "metrics");
  struct ctl_stats s;
  if ((rc = ctl_stats_fetch(c, NULL, &s)) != 0) {
    dep_status_free(st);
    return ctl_fail_client(ctl, c, rc, "metrics");
  }
  struct dep_msg_peers pm = {0};
  if (ctl_ask(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, ctl_decode_peers, &pm) != 0)
    memset(&pm, 0, sizeof pm);
  /* The jobs that span nodes, for their traffic and rings (as deepepctl status shows them). */
  struct dep_msg_job_nodes *jn = calloc(1, sizeof *jn);
  if (jn != NULL &&
      ctl_ask(c, DEP_MSG_JOB_NODES, NULL, DEP_MSG_JOB_NODES_OK, ctl_decode_job_nodes, jn) != 0)
    jn->n = 0;
  dep_client_free(c);
  int out = jn != NULL ? ctl_view_metrics(stdout, st, &s, &pm, jn) : -1;
  free(jn);
  proto_peers_free(&pm);
  ctl_stats_free(&s);
  dep_status_free(st);
  if (out != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}
