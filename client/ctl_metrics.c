/*
 * ctl_metrics.c — `deepepctl metrics`: the daemon's figures in the
 * Prometheus text exposition format (version 0.0.4), for node-exporter's
 * textfile collector (deepepctl metrics > /var/lib/node_exporter/deepep.prom,
 * written to a temporary file and renamed) or a scrape through a wrapper.
 * The op and rank families come from the tables `stats` renders
 * (ctl_stats.c); the daemon, pool and peer families from the tables here.
 * The format is text: --json is refused (stats --json has the records).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "ctl.h"
#include "ctl_stats.h"

/* The daemon's state is a label of deepep_daemon_up alone: on the other
 * families it would start a new series at every change of state. */
enum { SC_STATE, SC_UP, SC_N };
static const struct ctl_col state_cols[SC_N] = {
    [SC_STATE] = {"state", "STATE", CTL_STR, CTL_COL_LABEL},
    [SC_UP] = {"up", "UP", CTL_UINT, 0},
};
static const struct ctl_metric state_metrics[] = {
    {SC_UP, "deepep_daemon_up", "", "gauge", "1: deepepd answered, in the state labelled.", 1,
     NULL},
};

enum { DC_UPTIME, DC_CLIENTS, DC_JOBS, DC_WARNINGS, DC_N };
static const struct ctl_col daemon_cols[DC_N] = {
    [DC_UPTIME] = {"uptime_ms", "UPTIME", CTL_MS, 0},
    [DC_CLIENTS] = {"clients", "CLIENTS", CTL_UINT, 0},
    [DC_JOBS] = {"jobs", "JOBS", CTL_UINT, 0},
    [DC_WARNINGS] = {"warnings", "WARNINGS", CTL_UINT, 0},
};
static const struct ctl_metric daemon_metrics[] = {
    {DC_UPTIME, "deepep_daemon_uptime_seconds", "", "gauge", "Since deepepd started.", 1e-3, NULL},
    {DC_CLIENTS, "deepep_daemon_clients", "", "gauge", "Connections open.", 1, NULL},
    {DC_JOBS, "deepep_daemon_jobs", "", "gauge", "Jobs the caller may see.", 1, NULL},
    {DC_WARNINGS, "deepep_first_call_warnings_total", "", "counter",
     "First calls slower than warn_first_call_ratio x their op's steady median.", 1, NULL},
};

enum { PC_DEVICE, PC_TOTAL, PC_USED, PC_CACHED, PC_HELD, PC_N };
static const struct ctl_col pool_cols[PC_N] = {
    [PC_DEVICE] = {"device", "DEVICE", CTL_STR, CTL_COL_LABEL},
    [PC_TOTAL] = {"total", "TOTAL", CTL_BYTES, 0},
    [PC_USED] = {"used", "USED", CTL_BYTES, 0},
    [PC_CACHED] = {"cached", "CACHED", CTL_BYTES, 0},
    [PC_HELD] = {"held", "HELD", CTL_BYTES, 0},
};
static const struct ctl_metric pool_metrics[] = {
    {PC_TOTAL, "deepep_pool_bytes", "", "gauge",
     "A device's pool: its budget, lent to live jobs, cached scrubbed, held by gone processes.",
     1, "kind=\"total\""},
    {PC_USED, "deepep_pool_bytes", "", "gauge", "", 1, "kind=\"used\""},
    {PC_CACHED, "deepep_pool_bytes", "", "gauge", "", 1, "kind=\"cached\""},
    {PC_HELD, "deepep_pool_bytes", "", "gauge", "", 1, "kind=\"held\""},
};

enum { XC_PEER, XC_TRANSPORT, XC_UP, XC_CONNS, XC_RX, XC_TX, XC_RECONNECTS, XC_N };
static const struct ctl_col peer_cols[XC_N] = {
    [XC_PEER] = {"peer", "PEER", CTL_STR, CTL_COL_LABEL},
    [XC_TRANSPORT] = {"transport", "TRANSPORT", CTL_STR, CTL_COL_LABEL},
    [XC_UP] = {"up", "UP", CTL_UINT, 0},
    [XC_CONNS] = {"conns_up", "CONNS", CTL_UINT, 0},
    [XC_RX] = {"bytes_in", "RX", CTL_BYTES, 0},
    [XC_TX] = {"bytes_out", "TX", CTL_BYTES, 0},
    [XC_RECONNECTS] = {"reconnects", "RECONNECTS", CTL_UINT, 0},
};
static const struct ctl_metric peer_metrics[] = {
    {XC_UP, "deepep_peer_up", "", "gauge", "1: the peer daemon's connections are up.", 1, NULL},
    {XC_CONNS, "deepep_peer_connections_up", "", "gauge", "Outbound connections up.", 1, NULL},
    {XC_RX, "deepep_peer_received_bytes_total", "", "counter", "Bytes from the peer.", 1, NULL},
    {XC_TX, "deepep_peer_sent_bytes_total", "", "counter", "Bytes to the peer.", 1, NULL},
    {XC_RECONNECTS, "deepep_peer_reconnects_total", "", "counter",
     "Connections lost or failed and tried again.", 1, NULL},
};

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
  struct client_frame f;
  if (client_request(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, CLIENT_REQUEST_TIMEOUT_MS, &f) ==
      0) {
    if (proto_decode_peers(f.body, f.hdr.body_len, &pm) != 0)
      memset(&pm, 0, sizeof pm);
    client_frame_release(&f);
  }
  dep_client_free(c);
  struct ctl_val scells[SC_N] = {[SC_STATE] = {.s = st->state}, [SC_UP] = {.u = 1}};
  struct ctl_val dcells[DC_N] = {
      [DC_UPTIME] = {.u = st->uptime_ms}, [DC_CLIENTS] = {.u = st->num_clients},
      [DC_JOBS] = {.u = st->num_jobs},    [DC_WARNINGS] = {.u = s.ok.warnings},
  };
  struct ctl_val *pcells = calloc((size_t)st->num_devices * PC_N + 1, sizeof *pcells);
  struct ctl_val *xcells = calloc((size_t)pm.n_peers * XC_N + 1, sizeof *xcells);
  struct ctl_stats_view v;
  int out = -1;
  if (pcells != NULL && xcells != NULL && ctl_stats_view(&s, false, &v) == 0) {
    for (uint32_t i = 0; i < st->num_devices; i++) {
      struct ctl_val *row = pcells + (size_t)i * PC_N;
      row[PC_DEVICE].s = st->devices[i].uuid;
      row[PC_TOTAL].u = st->devices[i].pool_total_bytes;
      row[PC_USED].u = st->devices[i].pool_used_bytes;
      row[PC_CACHED].u = st->devices[i].pool_cached_bytes;
      row[PC_HELD].u = st->devices[i].pool_held_bytes;
    }
    for (uint32_t i = 0; i < pm.n_peers; i++) {
      struct ctl_val *row = xcells + (size_t)i * XC_N;
      row[XC_PEER].s = pm.peers[i].address;
      row[XC_TRANSPORT].s = pm.peers[i].transport;
      row[XC_UP].u = strcmp(pm.peers[i].state, "up") == 0;
      row[XC_CONNS].u = pm.peers[i].conns_up;
      row[XC_RX].u = pm.peers[i].bytes_in;
      row[XC_TX].u = pm.peers[i].bytes_out;
      row[XC_RECONNECTS].u = pm.peers[i].reconnects;
    }
    const struct ctl_table stt = {"state", "", state_cols, SC_N, 1, scells, 0};
    const struct ctl_table dt = {"daemon", "", daemon_cols, DC_N, 1, dcells, 0};
    const struct ctl_table pt = {"pools", "", pool_cols, PC_N, st->num_devices, pcells, 0};
    const struct ctl_table xt = {"peers", "", peer_cols, XC_N, pm.n_peers, xcells, 0};
    const struct ctl_mtable all[] = {
        {&stt, state_metrics, sizeof state_metrics / sizeof state_metrics[0]},
        {&dt, daemon_metrics, sizeof daemon_metrics / sizeof daemon_metrics[0]},
        {&pt, pool_metrics, sizeof pool_metrics / sizeof pool_metrics[0]},
        {&xt, peer_metrics, sizeof peer_metrics / sizeof peer_metrics[0]},
        v.mops,
        v.mranks,
    };
    out = ctl_out_metrics(stdout, all, sizeof all / sizeof all[0]);
    ctl_stats_view_free(&v);
  }
  free(pcells);
  free(xcells);
  proto_peers_free(&pm);
  ctl_stats_free(&s);
  dep_status_free(st);
  if (out != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}
