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
  for (uint32_t i = 0; i < s->n; i++)
    proto_stats_rank_free(&s->ranks[i]);
  free(s->ranks);
  s->ranks = NULL;
  s->n = 0;
}

double ctl_stats_skew(const struct ctl_stats *s, const char *job, uint32_t *hot_rank) {
  struct ctl_balance b;
  if (ctl_balance_of(s, job, &b) != 0)
    return 0;
  /* Judged only where every rank of the job reported here (a job on this node alone). */
  double skew = 0;
  if (b.world > 0 && b.ranks == b.world && b.total > 0 && b.ntop > 0) {
    *hot_rank = b.top[0];
    skew = (double)b.max * b.world / (double)b.total;
  }
  ctl_balance_free(&b);
  return skew;
}

/* ---- deepepctl stats --------------------------------------------------------------- */

static const struct ctl_col stats_fields[] = {
    {"warn_first_call_ratio", "first-call warning ratio", CTL_MILLI, 0},
    {"first_call_warnings", "first-call warnings", CTL_UINT, 0},
    {"ended_jobs_kept", "ended jobs kept", CTL_UINT, 0},
    {"keep_jobs", "kept at most", CTL_UINT, 0},
    {"keep_ms", "kept for", CTL_MS, 0},
    /* ranks whose tokens did not fit the reply: the balance leaves them out (STATS_OK) */
    {"tokens_left_out", "ranks' tokens left out", CTL_UINT, 0},
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
  /* A JOB no job can have is a usage error, not a silent "every job" ("") or a search for its
   * first 63 bytes (the request holds no more). */
  if (job != NULL && job[0] == '\0')
    return ctl_usage_error(ctl, "stats needs a JOB id, not an empty string (none for every job)");
  if (job != NULL && strlen(job) >= DEP_JOB_ID_MAX)
    return ctl_usage_error(ctl, "stats: JOB \"%.*s...\" is %zu bytes; a job id has at most %d",
                           24, job, strlen(job), DEP_JOB_ID_MAX - 1);
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
  if (ctl_ask(c, DEP_MSG_PEERS, NULL, DEP_MSG_PEERS_OK, ctl_decode_peers, &pm) != 0)
    memset(&pm, 0, sizeof pm);
  dep_client_free(c);
  struct ctl_view v;
  struct ctl_val *pools = calloc((size_t)st->num_devices * POOL_NCOLS + 1, sizeof *pools);
  struct ctl_val *conns = calloc((size_t)pm.n_peers * CONN_NCOLS + 1, sizeof *conns);
  int out = -1;
  if (pools != NULL && conns != NULL && ctl_view_stats(&s, &v) == 0) {
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
      row[2] = (struct ctl_val){.s = pm.peers[i].transport,
                                .none = pm.peers[i].transport[0] == '\0'};
      row[3].u = pm.peers[i].conns_up;
      row[4].u = pm.peers[i].conns_total;
      row[5].u = pm.peers[i].bytes_in;
      row[6].u = pm.peers[i].bytes_out;
    }
    const struct ctl_val fields[STATS_NFIELDS] = {
        {.u = s.ok.warn_ratio_milli}, {.u = s.ok.warnings}, {.u = s.ok.finished_jobs},
        {.u = s.ok.keep_jobs},        {.u = (uint64_t)s.ok.keep_s * 1000},
        {.u = s.ok.tokens_left_out},
    };
    const struct ctl_table tables[] = {
        v.ops,
        v.ranks,
        v.balance,
        {"pools", "no devices", pool_cols, POOL_NCOLS, st->num_devices, pools, 0},
        {"peers", "no peers configured", conn_cols, CONN_NCOLS, pm.n_peers, conns, 0},
    };
    const struct ctl_doc doc = {stats_fields, fields, STATS_NFIELDS, tables,
                                sizeof tables / sizeof tables[0]};
    out = ctl_out_render(stdout, &doc, ctl->json);
    ctl_view_free(&v);
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
