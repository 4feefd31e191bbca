/*
 * ctl_stats.c — `deepepctl stats [JOB]`: per job, rank and op, the calls,
 * the first call's time, the steady median and p99, first/median, GB/s,
 * errors and timeouts, from the daemon's fold of each rank's stats page
 * (DESIGN §10); then per rank its attach times and what was dropped, and
 * the pools.  The op and rank tables are defined here once, with the
 * Prometheus metrics their columns are, for `metrics` too.
 */
#include "ctl_stats.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "cudadrv.h"
#include "stats_page.h"

int ctl_stats_fetch(dep_client_t *c, const char *job, struct ctl_stats *out) {
  memset(out, 0, sizeof *out);
  struct dep_msg_stats_req req;
  memset(&req, 0, sizeof req);
  snprintf(req.job_id, sizeof req.job_id, "%s", job != NULL ? job : "");
  uint32_t id = 0;
  int rc = client_send_request(c, DEP_MSG_STATS, &req, &id);
  int64_t deadline = client_deadline(CLIENT_REQUEST_TIMEOUT_MS);
  while (rc == 0) {
    struct client_frame f;
    rc = client_read_reply(c, id, "STATS", DEP_MSG_STATS_OK, DEP_MSG_STATS_RANK,
                           CLIENT_REQUEST_TIMEOUT_MS, deadline, &f);
    if (rc != 0)
      break;
    if (f.hdr.type == DEP_MSG_STATS_OK) {
      rc = proto_decode_stats_ok(f.body, f.hdr.body_len, &out->ok);
      client_frame_release(&f);
      if (rc != 0)
        rc = client_seterr(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed STATS_OK");
      else
        return 0;
      break;
    }
    struct dep_msg_stats_rank *grown = realloc(out->ranks, (out->n + 1) * sizeof *out->ranks);
    if (grown == NULL) {
      client_frame_release(&f);
      rc = client_seterr(c, DEP_ERR_NO_MEMORY, "out of memory");
      break;
    }
    out->ranks = grown;
    rc = proto_decode_stats_rank(f.body, f.hdr.body_len, &out->ranks[out->n]);
    client_frame_release(&f);
    if (rc != 0)
      rc = client_seterr(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed STATS_RANK");
    else
      out->n++;
  }
  ctl_stats_free(out);
  return rc;
}

void ctl_stats_free(struct ctl_stats *s) {
  free(s->ranks);
  s->ranks = NULL;
  s->n = 0;
}

/* ---- the op table: one row per (job, rank, op) ------------------------------------ */

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
enum {
  OC_JOB, OC_RANK, OC_OP, OC_DEVICE, OC_STATE, OC_CALLS, OC_FIRST, OC_MEDIAN, OC_P99,
  OC_RATIO, OC_GBPS, OC_ERRORS, OC_TIMEOUTS, OC_BYTES, OC_STEADY, OC_SUM, OC_N
};
static const struct ctl_col op_cols[OC_N] = {
    [OC_JOB] = {"job", "JOB", CTL_STR, CTL_COL_LABEL},
    [OC_RANK] = {"rank", "RANK", CTL_UINT, CTL_COL_LABEL},
    [OC_OP] = {"op", "OP", CTL_STR, CTL_COL_LABEL},
    [OC_DEVICE] = {"device", "DEVICE", CTL_STR, CTL_COL_LABEL | CTL_COL_NOTEXT},
    [OC_STATE] = {"state", "STATE", CTL_STR, 0},
    [OC_CALLS] = {"calls", "CALLS", CTL_UINT, 0},
    [OC_FIRST] = {"first_ns", "FIRST", CTL_NS, 0},
    [OC_MEDIAN] = {"median_ns", "MEDIAN", CTL_NS, 0},
    [OC_P99] = {"p99_ns", "P99", CTL_NS, 0},
    [OC_RATIO] = {"first_over_median", "FIRST/MED", CTL_MILLI, 0},
    [OC_GBPS] = {"gbytes_per_s", "GB/S", CTL_MILLI, 0},
    [OC_ERRORS] = {"errors", "ERRORS", CTL_UINT, 0},
    [OC_TIMEOUTS] = {"timeouts", "TIMEOUTS", CTL_UINT, 0},
    [OC_BYTES] = {"bytes", "BYTES", CTL_BYTES, CTL_COL_NOTEXT},
    [OC_STEADY] = {"steady_calls", "STEADY", CTL_UINT, CTL_COL_NOTEXT},
    [OC_SUM] = {"steady_sum_ns", "SUM", CTL_NS, CTL_COL_NOTEXT},
};

static const struct ctl_metric op_metrics[] = {
    {OC_CALLS, "deepep_op_calls_total", "", "counter", "Calls of the operation that ran.", 1,
     NULL},
    {OC_FIRST, "deepep_op_first_call_seconds", "", "gauge",
     "The first call's time (GPU time on cuda, host clock on the host backend).", 1e-9, NULL},
    {OC_MEDIAN, "deepep_op_latency_seconds", "", "summary",
     "Steady-state call time: every call after the first (log-scale histogram, within 12.5%).",
     1e-9, "quantile=\"0.5\""},
    {OC_P99, "deepep_op_latency_seconds", "", "summary", "", 1e-9, "quantile=\"0.99\""},
    {OC_SUM, "deepep_op_latency_seconds", "_sum", "summary", "", 1e-9, NULL},
    {OC_STEADY, "deepep_op_latency_seconds", "_count", "summary", "", 1, NULL},
    {OC_BYTES, "deepep_op_bytes_total", "", "counter",
     "Hidden-state bytes of the caller's tokens over the calls that ran.", 1, NULL},
    {OC_ERRORS, "deepep_op_errors_total", "", "counter",
     "Calls that failed (timeouts included) or were refused.", 1, NULL},
    {OC_TIMEOUTS, "deepep_op_timeouts_total", "", "counter", "Calls that timed out.", 1, NULL},
};

/* ---- the rank table: one row per rank ----------------------------------------------- */

enum {
  RC_JOB, RC_RANK, RC_DEVICE, RC_LOCAL, RC_PID, RC_STATE, RC_AGE, RC_ENDED, RC_TIMER,
  RC_ATTACH, RC_WAIT, RC_MAP, RC_SETUP, RC_WARMUP, RC_LAYOUTS, RC_DROPPED, RC_N
};
static const struct ctl_col rank_cols[RC_N] = {
    [RC_JOB] = {"job", "JOB", CTL_STR, CTL_COL_LABEL},
    [RC_RANK] = {"rank", "RANK", CTL_UINT, CTL_COL_LABEL},
    [RC_DEVICE] = {"device", "DEVICE", CTL_STR, CTL_COL_LABEL},
    [RC_LOCAL] = {"local_rank", "LOCAL", CTL_UINT, CTL_COL_NOTEXT},
    [RC_PID] = {"pid", "PID", CTL_UINT, 0},
    [RC_STATE] = {"state", "STATE", CTL_STR, 0},
    [RC_AGE] = {"age_ms", "AGE", CTL_MS, 0},
    [RC_ENDED] = {"ended_ms", "ENDED", CTL_MS, CTL_COL_NOTEXT},
    [RC_TIMER] = {"timer", "TIMER", CTL_STR, 0},
    [RC_ATTACH] = {"attach_ns", "ATTACH", CTL_NS, 0},
    [RC_WAIT] = {"attach_wait_ns", "WAIT", CTL_NS, 0},
    [RC_MAP] = {"attach_map_ns", "MAP", CTL_NS, 0},
    [RC_SETUP] = {"attach_setup_ns", "SETUP", CTL_NS, 0},
    [RC_WARMUP] = {"attach_warmup_ns", "WARMUP", CTL_NS, 0},
    [RC_LAYOUTS] = {"layouts", "LAYOUTS", CTL_UINT, 0},
    [RC_DROPPED] = {"dropped", "DROPPED", CTL_UINT, 0},
};

static const struct ctl_metric rank_metrics[] = {
    {RC_ATTACH, "deepep_rank_attach_seconds", "", "gauge",
     "dep_attach's time and its parts (dep_attach_times).", 1e-9, "part=\"total\""},
    {RC_WAIT, "deepep_rank_attach_seconds", "", "gauge", "", 1e-9, "part=\"wait\""},
    {RC_MAP, "deepep_rank_attach_seconds", "", "gauge", "", 1e-9, "part=\"map\""},
    {RC_SETUP, "deepep_rank_attach_seconds", "", "gauge", "", 1e-9, "part=\"setup\""},
    {RC_WARMUP, "deepep_rank_attach_seconds", "", "gauge", "", 1e-9, "part=\"warmup\""},
    {RC_LAYOUTS, "deepep_rank_layouts_total", "", "counter", "Layouts the rank made.", 1, NULL},
    {RC_DROPPED, "deepep_rank_calls_dropped_total", "", "counter",
     "Calls the daemon could not read before the rank's ring overwrote them.", 1, NULL},
};

int ctl_stats_view(const struct ctl_stats *s, bool json, struct ctl_stats_view *v) {
  memset(v, 0, sizeof *v);
  size_t nops = 0;
  for (uint32_t i = 0; i < s->n; i++)
    for (unsigned op = 0; op < DEP_STATS_NOPS; op++)
      nops += s->ranks[i].ops[op].calls > 0 || s->ranks[i].ops[op].errors > 0;
  v->op_cells = calloc(nops * OC_N + 1, sizeof *v->op_cells);
  v->rank_cells = calloc((size_t)s->n * RC_N + 1, sizeof *v->rank_cells);
  v->uuid = calloc((size_t)s->n + 1, sizeof *v->uuid);
  if (v->op_cells == NULL || v->rank_cells == NULL || v->uuid == NULL) {
    ctl_stats_view_free(v);
    return -1;
  }
  size_t row = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const struct dep_msg_stats_rank *r = &s->ranks[i];
    cudadrv_uuid_str(r->device_uuid, v->uuid[i]);
    const char *state = r->finished ? "ended" : "running";
    struct ctl_val *rc = v->rank_cells + (size_t)i * RC_N;
    rc[RC_JOB].s = r->job_id;
    rc[RC_RANK].u = r->rank;
    rc[RC_DEVICE].s = v->uuid[i];
    rc[RC_LOCAL].u = r->local_rank;
    rc[RC_PID].u = r->pid;
    rc[RC_STATE].s = state;
    rc[RC_AGE].u = r->age_ms;
    rc[RC_ENDED].u = r->ended_ms;
    rc[RC_TIMER].s = r->cuda ? "gpu" : "host";
    rc[RC_ATTACH].u = r->attach_total_ns;
    rc[RC_WAIT].u = r->attach_wait_ns;
    rc[RC_MAP].u = r->attach_map_ns;
    rc[RC_SETUP].u = r->attach_setup_ns;
    rc[RC_WARMUP].u = r->attach_warmup_ns;
    rc[RC_LAYOUTS].u = r->layouts;
    rc[RC_DROPPED].u = r->dropped;
    for (unsigned op = 0; op < DEP_STATS_NOPS; op++) {
      const struct dep_msg_stats_op *o = &r->ops[op];
      if (o->calls == 0 && o->errors == 0)
        continue;
      struct ctl_val *oc = v->op_cells + row++ * OC_N;
      oc[OC_JOB].s = r->job_id;
      oc[OC_RANK].u = r->rank;
      oc[OC_OP].s = dep_stats_op_name(op);
      oc[OC_DEVICE].s = v->uuid[i];
      oc[OC_STATE].s = state;
      oc[OC_CALLS].u = o->calls;
      oc[OC_FIRST].u = o->first_ns;
      oc[OC_MEDIAN].u = o->median_ns;
      oc[OC_P99].u = o->p99_ns;
      oc[OC_RATIO].u = o->median_ns > 0 ? o->first_ns * 1000 / o->median_ns : 0;
      /* bytes per ns is GB/s; the mean call, so that it weighs like the bytes. */
      uint64_t mean = o->steady_calls > 0 ? o->steady_sum_ns / o->steady_calls : 0;
      uint64_t per = o->calls > 0 ? o->bytes / o->calls : 0;
      oc[OC_GBPS].u = mean > 0 ? per * 1000 / mean : 0;
      oc[OC_ERRORS].u = o->errors;
      oc[OC_TIMEOUTS].u = o->timeouts;
      oc[OC_BYTES].u = o->bytes;
      oc[OC_STEADY].u = o->steady_calls;
      oc[OC_SUM].u = o->steady_sum_ns;
    }
  }
  (void)json;
  v->ops = (struct ctl_table){"ops", "no calls recorded", op_cols, OC_N, row, v->op_cells, 0};
  v->ranks = (struct ctl_table){"ranks", "no ranks with stats", rank_cols, RC_N, s->n,
                                v->rank_cells, 0};
  v->mops = (struct ctl_mtable){&v->ops, op_metrics, sizeof op_metrics / sizeof op_metrics[0]};
  v->mranks =
      (struct ctl_mtable){&v->ranks, rank_metrics, sizeof rank_metrics / sizeof rank_metrics[0]};
  return 0;
}

void ctl_stats_view_free(struct ctl_stats_view *v) {
  free(v->op_cells);
  free(v->rank_cells);
  free(v->uuid);
  memset(v, 0, sizeof *v);
}

double ctl_stats_skew(const struct ctl_stats *s, const char *job, uint32_t *hot_rank) {
  uint64_t recv[DEP_MAX_LOCAL_RANKS] = {0};
  uint32_t world = 0, reported = 0, expect = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const struct dep_msg_stats_rank *r = &s->ranks[i];
    if (strcmp(r->job_id, job) != 0)
      continue;
    expect = r->world;
    if (r->n_recent == 0 || r->recent_world == 0)
      continue;
    if (world != 0 && r->recent_world != world)
      return 0; /* ranks of two shapes: nothing to compare */
    world = r->recent_world;
    reported++;
    for (uint32_t d = 0; d < world; d++)
      recv[d] += r->recent[0][d];
  }
  if (world == 0 || reported != expect || expect != world)
    return 0;
  uint64_t total = 0, max = 0;
  for (uint32_t d = 0; d < world; d++) {
    total += recv[d];
    if (recv[d] > max) {
      max = recv[d];
      *hot_rank = d;
    }
  }
  if (total == 0)
    return 0;
  return (double)max * world / (double)total;
}

/* ---- deepepctl stats --------------------------------------------------------------- */

static const struct ctl_col stats_fields[] = {
    {"warn_first_call_ratio", "first-call warning ratio", CTL_MILLI, 0},
    {"first_call_warnings", "first-call warnings", CTL_UINT, 0},
    {"ended_jobs_kept", "ended jobs kept", CTL_UINT, 0},
    {"keep_jobs", "kept at most", CTL_UINT, 0},
    {"keep_ms", "kept for", CTL_MS, 0},
};
#define STATS_NFIELDS (sizeof stats_fields / sizeof stats_fields[0])

static const struct ctl_col pool_cols[] = {
    {"uuid", "DEVICE", CTL_STR, 0},
    {"pool_total_bytes", "POOL", CTL_BYTES, 0},
    {"pool_used_bytes", "USED", CTL_BYTES, 0},
    {"pool_cached_bytes", "CACHED", CTL_BYTES, 0},
    {"pool_held_bytes", "HELD", CTL_BYTES, 0},
};
#define POOL_NCOLS (sizeof pool_cols / sizeof pool_cols[0])

static const struct ctl_col conn_cols[] = {
    {"address", "PEER", CTL_STR, 0},
    {"state", "STATE", CTL_STR, 0},
    {"transport", "TRANSPORT", CTL_STR, 0},
    {"conns_up", "CONNS", CTL_UINT, 0},
    {"conns_total", "", CTL_UINT, CTL_COL_JOIN},
    {"bytes_in", "RX", CTL_BYTES, 0},
    {"bytes_out", "TX", CTL_BYTES, 0},
};
#define CONN_NCOLS (sizeof conn_cols / sizeof conn_cols[0])

int ctl_stats(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options_args(ctl, argc, argv, 1);
  if (rc >= 0)
    return rc;
  const char *job = optind < argc ? argv[optind] : NULL;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct ctl_stats s;
  if ((rc = ctl_stats_fetch(c, job, &s)) != 0)
    return ctl_fail_client(ctl, c, rc, "stats");
  struct dep_status *st = NULL;
  if ((rc = dep_status(c, &st)) != 0) {
    ctl_stats_free(&s);
    return ctl_fail_client(ctl, c, rc, "stats");
  }
  /* The peers' connections, where there are peers (an older daemon without PEERS: none). */
  struct dep_msg_peers pm = {0};
  struct client_frame f;
  if (client_request(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, CLIENT_REQUEST_TIMEOUT_MS, &f) ==
      0) {
    if (proto_decode_peers(f.body, f.hdr.body_len, &pm) != 0)
      memset(&pm, 0, sizeof pm);
    client_frame_release(&f);
  }
  dep_client_free(c);
  struct ctl_stats_view v;
  struct ctl_val *pools = calloc((size_t)st->num_devices * POOL_NCOLS + 1, sizeof *pools);
  struct ctl_val *conns = calloc((size_t)pm.n_peers * CONN_NCOLS + 1, sizeof *conns);
  int out = -1;
  if (pools != NULL && conns != NULL && ctl_stats_view(&s, ctl->json, &v) == 0) {
    for (uint32_t i = 0; i < st->num_devices; i++) {
      struct ctl_val *row = pools + (size_t)i * POOL_NCOLS;
      row[0].s = st->devices[i].uuid;
      row[1].u = st->devices[i].pool_total_bytes;
      row[2].u = st->devices[i].pool_used_bytes;
      row[3].u = st->devices[i].pool_cached_bytes;
      row[4].u = st->devices[i].pool_held_bytes;
    }
    for (uint32_t i = 0; i < pm.n_peers; i++) {
      struct ctl_val *row = conns + (size_t)i * CONN_NCOLS;
      row[0].s = pm.peers[i].address;
      row[1].s = pm.peers[i].state;
      row[2].s = pm.peers[i].transport;
      row[3].u = pm.peers[i].conns_up;
      row[4].u = pm.peers[i].conns_total;
      row[5].u = pm.peers[i].bytes_in;
      row[6].u = pm.peers[i].bytes_out;
    }
    const struct ctl_val fields[STATS_NFIELDS] = {
        {.u = s.ok.warn_ratio_milli}, {.u = s.ok.warnings}, {.u = s.ok.finished_jobs},
        {.u = s.ok.keep_jobs},        {.u = (uint64_t)s.ok.keep_s * 1000},
    };
    const struct ctl_table tables[] = {
        v.ops,
        v.ranks,
        {"pools", "no devices", pool_cols, POOL_NCOLS, st->num_devices, pools, 0},
        {"peers", "no peers configured", conn_cols, CONN_NCOLS, pm.n_peers, conns, 0},
    };
    const struct ctl_doc doc = {stats_fields, fields, STATS_NFIELDS, tables, 4};
    out = ctl_out_render(stdout, &doc, ctl->json);
    ctl_stats_view_free(&v);
  }
  free(pools);
  free(conns);
  proto_peers_free(&pm);
  dep_status_free(st);
  ctl_stats_free(&s);
  if (out != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return ctl_finish_output(CTL_EXIT_OK);
}
