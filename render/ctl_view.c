/*
 * ctl_view.c — the daemon's records as output tables (ctl_view.h), for
 * `deepepctl stats` and `metrics` and for deepepd's metrics listener: the
 * op and rank tables with the Prometheus metrics their columns are, and
 * the daemon, pool and peer tables that only the exposition shows.
 */
#include "ctl_view.h"

#include <stdlib.h>
#include <string.h>

#include "stats_page.h"
#include "uuid.h"

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
    {OC_CALLS, "deepep_op_calls_total", "", "counter", "Calls of the operation that ran.", 0,
     NULL},
    {OC_FIRST, "deepep_op_first_call_seconds", "", "gauge",
     "The first call's time (GPU time on cuda, host clock on the host backend).", 9, NULL},
    {OC_MEDIAN, "deepep_op_latency_seconds", "", "summary",
     "Steady-state call time: every call after the first (log-scale histogram, within 12.5%).",
     9, "quantile=\"0.5\""},
    {OC_P99, "deepep_op_latency_seconds", "", "summary", "", 9, "quantile=\"0.99\""},
    {OC_SUM, "deepep_op_latency_seconds", "_sum", "summary", "", 9, NULL},
    {OC_STEADY, "deepep_op_latency_seconds", "_count", "summary", "", 0, NULL},
    {OC_BYTES, "deepep_op_bytes_total", "", "counter",
     "Hidden-state bytes of the caller's tokens over the calls that ran.", 0, NULL},
    {OC_ERRORS, "deepep_op_errors_total", "", "counter",
     "Calls that failed (timeouts included) or were refused.", 0, NULL},
    {OC_TIMEOUTS, "deepep_op_timeouts_total", "", "counter", "Calls that timed out.", 0, NULL},
};

/* ---- the rank table: one row per rank ----------------------------------------------- */

enum {
  RC_JOB, RC_RANK, RC_DEVICE, RC_LOCAL, RC_PID, RC_STATE, RC_AGE, RC_ENDED, RC_TIMER,
  RC_ATTACH, RC_WAIT, RC_MAP, RC_SETUP, RC_WARMUP, RC_LAYOUTS, RC_DROPPED, RC_CTAS, RC_CTAS_FROM,
  RC_TOKENS_TO, RC_N
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
    /* the SM budget its kernels run with, and where it came from (adaptive_optimization) */
    [RC_CTAS] = {"kernel_ctas", "CTAS", CTL_UINT, 0},
    [RC_CTAS_FROM] = {"kernel_ctas_from", "CTAS_FROM", CTL_STR, 0},
    /* its newest layout's tokens to each rank of the job: the balance table sums them */
    [RC_TOKENS_TO] = {"tokens_to", "TOKENS_TO", CTL_UINTS, CTL_COL_NOTEXT},
};

static const struct ctl_metric rank_metrics[] = {
    {RC_ATTACH, "deepep_rank_attach_seconds", "", "gauge",
     "dep_attach's time and its parts (dep_attach_times).", 9, "part=\"total\""},
    {RC_WAIT, "deepep_rank_attach_seconds", "", "gauge", "", 9, "part=\"wait\""},
    {RC_MAP, "deepep_rank_attach_seconds", "", "gauge", "", 9, "part=\"map\""},
    {RC_SETUP, "deepep_rank_attach_seconds", "", "gauge", "", 9, "part=\"setup\""},
    {RC_WARMUP, "deepep_rank_attach_seconds", "", "gauge", "", 9, "part=\"warmup\""},
    {RC_LAYOUTS, "deepep_rank_layouts_total", "", "counter", "Layouts the rank made.", 0, NULL},
    {RC_DROPPED, "deepep_rank_calls_dropped_total", "", "counter",
     "Calls the daemon could not read before the rank's ring overwrote them.", 0, NULL},
};

/* ---- the balance table: one row per job with a layout --------------------------------- */

static int ctl_balance_cmp(const void *x, const void *y) {
  uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
  return (a > b) - (a < b);
}

int ctl_balance_of(const struct ctl_stats *s, const char *job, struct ctl_balance *b) {
  memset(b, 0, sizeof *b);
  for (uint32_t i = 0; i < s->n && b->world == 0; i++)
    if (strcmp(s->ranks[i].job_id, job) == 0 && s->ranks[i].tokens_world > 0)
      b->world = s->ranks[i].tokens_world;
  if (b->world == 0)
    return 0;
  b->to = calloc(b->world, sizeof *b->to);
  uint64_t *sorted = calloc(b->world, sizeof *sorted);
  uint8_t *seen = calloc(b->world, 1);
  if (b->to == NULL || sorted == NULL || seen == NULL) {
    free(sorted);
    free(seen);
    ctl_balance_free(b);
    return -1;
  }
  for (uint32_t i = 0; i < s->n; i++) {
    const struct dep_msg_stats_rank *r = &s->ranks[i];
    if (strcmp(r->job_id, job) != 0 || r->tokens_world != b->world || r->rank >= b->world ||
        seen[r->rank])
      continue;
    seen[r->rank] = 1;
    b->ranks++;
    for (uint32_t d = 0; d < b->world; d++)
      b->to[d] += r->tokens[d];
  }
  for (uint32_t d = 0; d < b->world; d++) {
    b->total += b->to[d];
    sorted[d] = b->to[d];
  }
  qsort(sorted, b->world, sizeof *sorted, ctl_balance_cmp);
  b->min = sorted[0];
  b->max = sorted[b->world - 1];
  b->median = sorted[(b->world - 1) / 2];
  /* The top ranks: the largest counts, the lower rank first among equals. */
  for (uint32_t t = 0; t < CTL_BALANCE_TOP; t++) {
    bool found = false;
    uint32_t best = 0;
    for (uint32_t d = 0; d < b->world; d++) {
      bool taken = false;
      for (uint32_t k = 0; k < t && !taken; k++)
        taken = b->top[k] == d;
      if (!taken && b->to[d] > 0 && (!found || b->to[d] > b->to[best])) {
        best = d;
        found = true;
      }
    }
    if (!found)
      break;
    b->top[b->ntop++] = best;
  }
  free(sorted);
  free(seen);
  return 0;
}

void ctl_balance_free(struct ctl_balance *b) {
  free(b->to);
  memset(b, 0, sizeof *b);
}

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
enum {
  BC_JOB, BC_RANKS, BC_WORLD, BC_TOKENS, BC_MIN, BC_MEDIAN, BC_MAX, BC_SKEW, BC_TOP,
  BC_TOP_RANKS, BC_N
};
static const struct ctl_col balance_cols[BC_N] = {
    [BC_JOB] = {"job", "JOB", CTL_STR, CTL_COL_LABEL},
    [BC_RANKS] = {"ranks", "RANKS", CTL_UINT, 0},
    [BC_WORLD] = {"world", "", CTL_UINT, CTL_COL_JOIN},
    [BC_TOKENS] = {"tokens", "TOKENS", CTL_UINT, 0},
    [BC_MIN] = {"to_min", "MIN", CTL_UINT, 0},
    [BC_MEDIAN] = {"to_median", "MEDIAN", CTL_UINT, 0},
    [BC_MAX] = {"to_max", "MAX", CTL_UINT, 0},
    [BC_SKEW] = {"max_over_mean", "MAX/MEAN", CTL_MILLI, 0},
    [BC_TOP] = {"top", "TOP", CTL_STR, 0},
    [BC_TOP_RANKS] = {"top_ranks", "TOP_RANKS", CTL_UINTS, CTL_COL_NOTEXT},
};

/* The balance table's rows into v (its cells allocated for s->n rows, the most there can be). */
static int ctl_view_balance(const struct ctl_stats *s, struct ctl_view *v) {
  size_t rows = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const char *job = s->ranks[i].job_id;
    if (!ctl_stats_job_first(s, i))
      continue;
    struct ctl_balance b;
    if (ctl_balance_of(s, job, &b) != 0)
      return -1;
    if (b.world == 0)
      continue;
    struct ctl_val *c = v->balance_cells + rows * BC_N;
    c[BC_JOB].s = job;
    c[BC_RANKS].u = b.ranks;
    c[BC_WORLD].u = b.world;
    c[BC_TOKENS].u = b.total;
    c[BC_MIN].u = b.min;
    c[BC_MEDIAN].u = b.median;
    c[BC_MAX].u = b.max;
    /* The figure doctor judges (ctl_stats_skew), here for whatever ranks this node holds. */
    c[BC_SKEW] = (struct ctl_val){.u = b.total > 0 ? b.max * b.world * 1000 / b.total : 0,
                                  .none = b.total == 0};
    char *top = v->top[rows];
    top[0] = '\0';
    for (uint32_t t = 0; t < b.ntop; t++) {
      size_t used = strlen(top);
      snprintf(top + used, sizeof v->top[rows] - used, "%s%u:%llu", t > 0 ? " " : "", b.top[t],
               (unsigned long long)b.to[b.top[t]]);
      v->top_ranks[rows][t] = b.top[t];
    }
    c[BC_TOP].s = top;
    c[BC_TOP_RANKS] = (struct ctl_val){.u = b.ntop, .list = v->top_ranks[rows]};
    rows++;
    ctl_balance_free(&b);
  }
  v->balance = (struct ctl_table){"balance", "no layouts recorded", balance_cols, BC_N, rows,
                                  v->balance_cells, 0};
  return 0;
}

int ctl_view_stats(const struct ctl_stats *s, struct ctl_view *v) {
  memset(v, 0, sizeof *v);
  size_t nops = 0;
  for (uint32_t i = 0; i < s->n; i++)
    for (unsigned op = 0; op < DEP_STATS_NOPS; op++)
      nops += s->ranks[i].ops[op].calls > 0 || s->ranks[i].ops[op].errors > 0;
  v->op_cells = calloc(nops * OC_N + 1, sizeof *v->op_cells);
  v->rank_cells = calloc((size_t)s->n * RC_N + 1, sizeof *v->rank_cells);
  v->uuid = calloc((size_t)s->n + 1, sizeof *v->uuid);
  v->balance_cells = calloc((size_t)s->n * BC_N + 1, sizeof *v->balance_cells);
  v->top = calloc((size_t)s->n + 1, sizeof *v->top);
  v->top_ranks = calloc((size_t)s->n + 1, sizeof *v->top_ranks);
  if (v->op_cells == NULL || v->rank_cells == NULL || v->uuid == NULL ||
      v->balance_cells == NULL || v->top == NULL || v->top_ranks == NULL ||
      ctl_view_balance(s, v) != 0) {
    ctl_view_free(v);
    return -1;
  }
  size_t row = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const struct dep_msg_stats_rank *r = &s->ranks[i];
    dep__uuid_str(r->device_uuid, v->uuid[i]);
    const char *state = r->finished ? "ended" : "running";
    struct ctl_val *rc = v->rank_cells + (size_t)i * RC_N;
    rc[RC_JOB].s = r->job_id;
    rc[RC_RANK].u = r->rank;
    rc[RC_DEVICE].s = v->uuid[i];
    rc[RC_LOCAL].u = r->local_rank;
    rc[RC_PID].u = r->pid;
    rc[RC_STATE].s = state;
    rc[RC_AGE].u = r->age_ms;
    rc[RC_ENDED] = (struct ctl_val){.u = r->ended_ms, .none = !r->finished};
    rc[RC_TIMER].s = r->cuda ? "gpu" : "host";
    rc[RC_ATTACH].u = r->attach_total_ns;
    rc[RC_WAIT].u = r->attach_wait_ns;
    rc[RC_MAP].u = r->attach_map_ns;
    rc[RC_SETUP].u = r->attach_setup_ns;
    rc[RC_WARMUP].u = r->attach_warmup_ns;
    /* A rank that has not written its attach times has none. */
    for (int k = RC_ATTACH; k <= RC_WARMUP; k++)
      rc[k].none = !r->attached;
    rc[RC_LAYOUTS].u = r->layouts;
    rc[RC_DROPPED].u = r->dropped;
    rc[RC_CTAS].u = r->kernel_ctas;
    rc[RC_CTAS_FROM].s = proto_tune_how_name(r->ctas_how);
    /* none (null) before a layout ran */
    rc[RC_TOKENS_TO] = (struct ctl_val){.u = r->tokens_world, .list = r->tokens,
                                        .none = r->tokens_world == 0};
    for (unsigned op = 0; op < DEP_STATS_NOPS; op++) {
      const struct dep_msg_stats_op *o = &r->ops[op];
      if (o->calls == 0 && o->errors == 0)
        continue;
      struct ctl_val *oc = v->op_cells + row++ * OC_N;
      oc[OC_JOB].s = r->job_id;
      oc[OC_RANK].u = r->rank;
      oc[OC_OP].s = dep__stats_op_name(op);
      oc[OC_DEVICE].s = v->uuid[i];
      oc[OC_STATE].s = state;
      oc[OC_CALLS].u = o->calls;
      oc[OC_FIRST].u = o->first_ns;
      oc[OC_MEDIAN].u = o->median_ns;
      oc[OC_P99].u = o->p99_ns;
      /* No call succeeded yet, or none after the first: no time to show ("-", null, NaN). */
      oc[OC_FIRST].none = o->first_ns == 0;
      oc[OC_MEDIAN].none = oc[OC_P99].none = o->steady_calls == 0;
      oc[OC_RATIO].u = o->median_ns > 0 ? o->first_ns * 1000 / o->median_ns : 0;
      /* bytes per ns is GB/s; the mean call, so that it weighs like the bytes. */
      uint64_t mean = o->steady_calls > 0 ? o->steady_sum_ns / o->steady_calls : 0;
      uint64_t per = o->calls > 0 ? o->bytes / o->calls : 0;
      oc[OC_GBPS].u = mean > 0 ? per * 1000 / mean : 0;
      /* Before a steady call there is no median to divide by: "-" in text, as MEDIAN says. */
      oc[OC_RATIO].none = o->median_ns == 0;
      oc[OC_GBPS].none = mean == 0;
      oc[OC_ERRORS].u = o->errors;
      oc[OC_TIMEOUTS].u = o->timeouts;
      oc[OC_BYTES].u = o->bytes;
      oc[OC_STEADY].u = o->steady_calls;
      oc[OC_SUM].u = o->steady_sum_ns;
    }
  }
  v->ops = (struct ctl_table){"ops", "no calls recorded", op_cols, OC_N, row, v->op_cells, 0};
  v->ranks = (struct ctl_table){"ranks", "no ranks with stats", rank_cols, RC_N, s->n,
                                v->rank_cells, 0};
  v->mops = (struct ctl_mtable){&v->ops, op_metrics, sizeof op_metrics / sizeof op_metrics[0]};
  v->mranks =
      (struct ctl_mtable){&v->ranks, rank_metrics, sizeof rank_metrics / sizeof rank_metrics[0]};
  return 0;
}

void ctl_view_free(struct ctl_view *v) {
  free(v->op_cells);
  free(v->rank_cells);
  free(v->uuid);
  free(v->balance_cells);
  free(v->top);
  free(v->top_ranks);
  memset(v, 0, sizeof *v);
}

/* ---- the daemon, its pools and peers: the exposition alone ------------------- */

/* The daemon's state is a label of deepep_daemon_up alone: on the other
 * families it would start a new series at every change of state. */
enum { SC_STATE, SC_UP, SC_N };
static const struct ctl_col state_cols[SC_N] = {
    [SC_STATE] = {"state", "STATE", CTL_STR, CTL_COL_LABEL},
    [SC_UP] = {"up", "UP", CTL_UINT, 0},
};
static const struct ctl_metric state_metrics[] = {
    {SC_UP, "deepep_daemon_up", "", "gauge", "1: deepepd answered, in the state labelled.", 0,
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
    {DC_UPTIME, "deepep_daemon_uptime_seconds", "", "gauge", "Since deepepd started.", 3, NULL},
    {DC_CLIENTS, "deepep_daemon_clients", "", "gauge", "Connections open.", 0, NULL},
    {DC_JOBS, "deepep_daemon_jobs", "", "gauge",
     "Jobs running (to deepepctl, those its user may see; to metrics.listen, all).", 0, NULL},
    {DC_WARNINGS, "deepep_first_call_warnings_total", "", "counter",
     "First calls slower than warn_first_call_ratio x their op's steady median.", 0, NULL},
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
     0, "kind=\"total\""},
    {PC_USED, "deepep_pool_bytes", "", "gauge", "", 0, "kind=\"used\""},
    {PC_CACHED, "deepep_pool_bytes", "", "gauge", "", 0, "kind=\"cached\""},
    {PC_HELD, "deepep_pool_bytes", "", "gauge", "", 0, "kind=\"held\""},
};

/* A peer: its control link (peer.c), then the data path's connections and traffic to and from
 * it (PEERS_OK's, as deepepctl peers shows them: what the proxy's TCP connections carried, and
 * what went to the peer as RDMA writes), each counter the daemon's since it started. */
enum {
  XC_PEER, XC_TRANSPORT, XC_UP, XC_CONNS, XC_RX, XC_TX, XC_RECONNECTS, XC_DATA_OUT, XC_DATA_IN,
  XC_DATA_TX, XC_DATA_RX, XC_FRAMES_TX, XC_FRAMES_RX, XC_RDMA_BLOCKS, XC_RDMA_WRITES,
  XC_RDMA_POSTS, XC_RDMA_BYTES, XC_N
};
static const struct ctl_col peer_cols[XC_N] = {
    [XC_PEER] = {"peer", "PEER", CTL_STR, CTL_COL_LABEL},
    [XC_TRANSPORT] = {"transport", "TRANSPORT", CTL_STR, CTL_COL_LABEL},
    [XC_UP] = {"up", "UP", CTL_UINT, 0},
    [XC_CONNS] = {"conns_up", "CONNS", CTL_UINT, 0},
    [XC_RX] = {"bytes_in", "RX", CTL_BYTES, 0},
    [XC_TX] = {"bytes_out", "TX", CTL_BYTES, 0},
    [XC_RECONNECTS] = {"reconnects", "RECONNECTS", CTL_UINT, 0},
    [XC_DATA_OUT] = {"data_out", "DATA", CTL_UINT, 0},
    [XC_DATA_IN] = {"data_in", "", CTL_UINT, 0},
    [XC_DATA_TX] = {"data_bytes_out", "DATA_TX", CTL_BYTES, 0},
    [XC_DATA_RX] = {"data_bytes_in", "DATA_RX", CTL_BYTES, 0},
    [XC_FRAMES_TX] = {"data_frames_out", "FRAMES_TX", CTL_UINT, 0},
    [XC_FRAMES_RX] = {"data_frames_in", "FRAMES_RX", CTL_UINT, 0},
    [XC_RDMA_BLOCKS] = {"rdma_blocks_out", "RDMA_BLOCKS", CTL_UINT, 0},
    [XC_RDMA_WRITES] = {"rdma_writes_out", "RDMA_WRITES", CTL_UINT, 0},
    [XC_RDMA_POSTS] = {"rdma_posts_out", "RDMA_POSTS", CTL_UINT, 0},
    [XC_RDMA_BYTES] = {"rdma_bytes_out", "RDMA_TX", CTL_BYTES, 0},
};
static const struct ctl_metric peer_metrics[] = {
    {XC_UP, "deepep_peer_up", "", "gauge", "1: the peer daemon's connections are up.", 0, NULL},
    {XC_CONNS, "deepep_peer_connections_up", "", "gauge", "Outbound connections up.", 0, NULL},
    {XC_RX, "deepep_peer_received_bytes_total", "", "counter",
     "Bytes from the peer on the control link (the data path's: deepep_peer_data_bytes_total).",
     0, NULL},
    {XC_TX, "deepep_peer_sent_bytes_total", "", "counter",
     "Bytes to the peer on the control link (the data path's: deepep_peer_data_bytes_total).", 0,
     NULL},
    {XC_RECONNECTS, "deepep_peer_reconnects_total", "", "counter",
     "Connections lost or failed and tried again.", 0, NULL},
    {XC_DATA_OUT, "deepep_peer_data_connections", "", "gauge",
     "The data path's TCP connections up to the peer (out) and from it (in).", 0,
     "direction=\"out\""},
    {XC_DATA_IN, "deepep_peer_data_connections", "", "gauge", "", 0, "direction=\"in\""},
    {XC_DATA_TX, "deepep_peer_data_bytes_total", "", "counter",
     "Bytes the data path's TCP connections moved to the peer (out) and from it (in), headers "
     "included.", 0, "direction=\"out\""},
    {XC_DATA_RX, "deepep_peer_data_bytes_total", "", "counter", "", 0, "direction=\"in\""},
    {XC_FRAMES_TX, "deepep_peer_data_frames_total", "", "counter",
     "Frames (a block of a rank's tokens each) the data path's TCP connections moved to the "
     "peer (out) and from it (in).", 0, "direction=\"out\""},
    {XC_FRAMES_RX, "deepep_peer_data_frames_total", "", "counter", "", 0, "direction=\"in\""},
    {XC_RDMA_BLOCKS, "deepep_peer_rdma_blocks_total", "", "counter",
     "Blocks (a block, a chunk or a credit of a rank's) the data path sent to the peer as RDMA "
     "writes; only the sender counts them.", 0, NULL},
    {XC_RDMA_WRITES, "deepep_peer_rdma_writes_total", "", "counter",
     "RDMA write requests those blocks made (payload segments, marks, slot fields and flags).",
     0, NULL},
    {XC_RDMA_POSTS, "deepep_peer_rdma_posts_total", "", "counter",
     "Chains of those requests posted to the peer's queue pair (one ibv_post_send each).", 0,
     NULL},
    {XC_RDMA_BYTES, "deepep_peer_rdma_bytes_total", "", "counter",
     "Bytes the data path's RDMA writes carried to the peer.", 0, NULL},
};

/* The data path as a whole: its proxy threads and the bytes registered with the RDMA device. */
enum { PX_THREADS, PX_BUSY, PX_NIC, PX_N };
static const struct ctl_col proxy_cols[PX_N] = {
    [PX_THREADS] = {"proxy_threads", "PROXY THREADS", CTL_UINT, 0},
    [PX_BUSY] = {"proxy_busy_us", "PROXY BUSY", CTL_UINT, 0},
    [PX_NIC] = {"nic_bytes", "REGISTERED", CTL_BYTES, 0},
};
static const struct ctl_metric proxy_metrics[] = {
    {PX_THREADS, "deepep_proxy_threads", "", "gauge",
     "The data path's proxy threads running (0 until a job that spans nodes needs them).", 0,
     NULL},
    {PX_BUSY, "deepep_proxy_busy_seconds_total", "", "counter",
     "Time the proxy threads spent moving blocks (not polling), summed over them.", 6, NULL},
    {PX_NIC, "deepep_rdma_registered_bytes", "", "gauge",
     "Exchange regions of running jobs registered with the RDMA device.", 0, NULL},
};

/* A job that spans nodes: its traffic through this daemon's proxy, whatever the transport
 * (TCP or RDMA), and its rings' fullest (JOB_NODES_OK's, as deepepctl status shows them). */
enum { JC_JOB, JC_TX, JC_RX, JC_FRAMES_TX, JC_FRAMES_RX, JC_RING_PEAK, JC_RING_ENTRIES, JC_N };
static const struct ctl_col xjob_cols[JC_N] = {
    [JC_JOB] = {"job", "JOB", CTL_STR, CTL_COL_LABEL},
    [JC_TX] = {"bytes_out", "TX", CTL_BYTES, 0},
    [JC_RX] = {"bytes_in", "RX", CTL_BYTES, 0},
    [JC_FRAMES_TX] = {"frames_out", "FRAMES_TX", CTL_UINT, 0},
    [JC_FRAMES_RX] = {"frames_in", "FRAMES_RX", CTL_UINT, 0},
    [JC_RING_PEAK] = {"ring_peak", "RING PEAK", CTL_UINT, 0},
    [JC_RING_ENTRIES] = {"ring_entries", "RING", CTL_UINT, 0},
};
static const struct ctl_metric xjob_metrics[] = {
    {JC_TX, "deepep_job_data_bytes_total", "", "counter",
     "Bytes of the job's blocks the proxy sent to other nodes (out) and received (in).", 0,
     "direction=\"out\""},
    {JC_RX, "deepep_job_data_bytes_total", "", "counter", "", 0, "direction=\"in\""},
    {JC_FRAMES_TX, "deepep_job_data_blocks_total", "", "counter",
     "The job's blocks the proxy sent to other nodes (out) and received (in).", 0,
     "direction=\"out\""},
    {JC_FRAMES_RX, "deepep_job_data_blocks_total", "", "counter", "", 0, "direction=\"in\""},
    {JC_RING_PEAK, "deepep_job_ring_peak_descriptors", "", "gauge",
     "The most descriptors a sweep of the proxy found waiting in one of the job's rings.", 0,
     NULL},
    {JC_RING_ENTRIES, "deepep_job_ring_entries", "", "gauge",
     "The descriptors a ring of the job holds (what the peak is out of).", 0, NULL},
};

/* Whether a is of a later run of its job than b: a running job is the latest; of two that
 * ended, the one that ended last.  A tie keeps the one the daemon listed first (its newest). */
static bool ctl_view_later_run(const struct dep_msg_stats_rank *a,
                               const struct dep_msg_stats_rank *b) {
  if (a->finished != b->finished)
    return !a->finished;
  return a->finished && a->ended_ms < b->ended_ms;
}

/*
 * The ranks whose series the exposition shows: of the records of one job id and rank, only
 * the latest run's.  A job id reused while the daemon still keeps an earlier run's figures
 * would otherwise give two samples of one series, which Prometheus keeps one of, silently.
 * The earlier run's series are dropped rather than told apart by a label: the record has no
 * field unique to a run (a pid is reused; a run number would change STATS_RANK's layout), a
 * label per run would start new series at every run where Prometheus's counters already
 * read a restart as a reset, and `deepepctl stats` keeps showing every run kept.  An ended
 * run's figures stay in the exposition until a later run of its job id starts, so the calls
 * a short job made after the last scrape are still scraped.  *out's ranks are malloc'd.
 */
static int ctl_view_latest_runs(const struct ctl_stats *s, struct ctl_stats *out) {
  *out = *s;
  out->ranks = calloc((size_t)s->n + 1, sizeof *out->ranks);
  if (out->ranks == NULL)
    return -1;
  out->n = 0;
  for (uint32_t i = 0; i < s->n; i++) {
    const struct dep_msg_stats_rank *r = &s->ranks[i];
    bool latest = true;
    for (uint32_t j = 0; j < s->n && latest; j++) {
      const struct dep_msg_stats_rank *o = &s->ranks[j];
      if (j == i || o->rank != r->rank || strcmp(o->job_id, r->job_id) != 0)
        continue;
      /* Another run of the same rank: this one is shown only if no other is later, nor as
       * late and listed before it. */
      latest = !ctl_view_later_run(o, r) && (j > i || ctl_view_later_run(r, o));
    }
    if (latest)
      out->ranks[out->n++] = *r;
  }
  return 0;
}

/* The metrics' rows of the pools, one per device, into cells (PC_N a row). */
static void metrics_pool_rows(struct ctl_val *pcells, const struct dep_status *st) {
  for (uint32_t i = 0; i < st->num_devices; i++) {
    struct ctl_val *row = pcells + (size_t)i * PC_N;
    row[PC_DEVICE].s = st->devices[i].uuid;
    row[PC_TOTAL].u = st->devices[i].pool_total_bytes;
    row[PC_USED].u = st->devices[i].pool_used_bytes;
    row[PC_CACHED].u = st->devices[i].pool_cached_bytes;
    row[PC_HELD].u = st->devices[i].pool_held_bytes;
  }
}

/* The metrics' rows of the peers, one per peer daemon, into cells (XC_N a row). */
static void metrics_peer_rows(struct ctl_val *xcells, const struct dep_msg_peers *pm,
                              uint32_t npeers) {
  for (uint32_t i = 0; i < npeers; i++) {
    struct ctl_val *row = xcells + (size_t)i * XC_N;
    row[XC_PEER].s = pm->peers[i].address;
    row[XC_TRANSPORT].s = pm->peers[i].transport;
    row[XC_UP].u = strcmp(pm->peers[i].state, "up") == 0;
    row[XC_CONNS].u = pm->peers[i].conns_up;
    row[XC_RX].u = pm->peers[i].bytes_in;
    row[XC_TX].u = pm->peers[i].bytes_out;
    row[XC_RECONNECTS].u = pm->peers[i].reconnects;
    row[XC_DATA_OUT].u = pm->peers[i].data_out;
    row[XC_DATA_IN].u = pm->peers[i].data_in;
    row[XC_DATA_TX].u = pm->peers[i].data_bytes_out;
    row[XC_DATA_RX].u = pm->peers[i].data_bytes_in;
    row[XC_FRAMES_TX].u = pm->peers[i].data_frames_out;
    row[XC_FRAMES_RX].u = pm->peers[i].data_frames_in;
    row[XC_RDMA_BLOCKS].u = pm->peers[i].rdma_blocks_out;
    row[XC_RDMA_WRITES].u = pm->peers[i].rdma_writes_out;
    row[XC_RDMA_POSTS].u = pm->peers[i].rdma_posts_out;
    row[XC_RDMA_BYTES].u = pm->peers[i].rdma_bytes_out;
  }
}

/* The metrics' rows of the jobs across nodes, into cells (JC_N a row). */
static void metrics_job_rows(struct ctl_val *jcells, const struct dep_msg_job_nodes *jn,
                             uint32_t nxjobs) {
  for (uint32_t i = 0; i < nxjobs; i++) {
    struct ctl_val *row = jcells + (size_t)i * JC_N;
    row[JC_JOB].s = jn->jobs[i].job_id;
    row[JC_TX].u = jn->jobs[i].bytes_out;
    row[JC_RX].u = jn->jobs[i].bytes_in;
    row[JC_FRAMES_TX].u = jn->jobs[i].frames_out;
    row[JC_FRAMES_RX].u = jn->jobs[i].frames_in;
    row[JC_RING_PEAK].u = jn->jobs[i].ring_peak;
    row[JC_RING_ENTRIES].u = jn->jobs[i].ring_entries;
  }
}

int ctl_view_metrics(FILE *f, const struct dep_status *st, const struct ctl_stats *all_runs,
                     const struct dep_msg_peers *pm, const struct dep_msg_job_nodes *jn) {
  struct ctl_stats latest;
  if (ctl_view_latest_runs(all_runs, &latest) != 0)
    return -1;
  const struct ctl_stats *s = &latest;
  const uint32_t npeers = pm != NULL ? pm->n_peers : 0;
  struct ctl_val scells[SC_N] = {[SC_STATE] = {.s = st->state}, [SC_UP] = {.u = 1}};
  struct ctl_val dcells[DC_N] = {
      [DC_UPTIME] = {.u = st->uptime_ms}, [DC_CLIENTS] = {.u = st->num_clients},
      [DC_JOBS] = {.u = st->num_jobs},    [DC_WARNINGS] = {.u = s->ok.warnings},
  };
  struct ctl_val *pcells = calloc((size_t)st->num_devices * PC_N + 1, sizeof *pcells);
  struct ctl_val *xcells = calloc((size_t)npeers * XC_N + 1, sizeof *xcells);
  const uint32_t nxjobs = jn != NULL ? jn->n : 0;
  struct ctl_val *jcells = calloc((size_t)nxjobs * JC_N + 1, sizeof *jcells);
  struct ctl_val pxcells[PX_N] = {
      [PX_THREADS] = {.u = pm != NULL ? pm->proxy_threads : 0},
      [PX_BUSY] = {.u = pm != NULL ? pm->proxy_busy_us : 0},
      [PX_NIC] = {.u = pm != NULL ? pm->nic_bytes : 0},
  };
  struct ctl_view v;
  int out = -1;
  if (pcells != NULL && xcells != NULL && jcells != NULL && ctl_view_stats(s, &v) == 0) {
    metrics_pool_rows(pcells, st);
    metrics_peer_rows(xcells, pm, npeers);
    metrics_job_rows(jcells, jn, nxjobs);
    const struct ctl_table stt = {"state", "", state_cols, SC_N, 1, scells, 0};
    const struct ctl_table dt = {"daemon", "", daemon_cols, DC_N, 1, dcells, 0};
    const struct ctl_table pt = {"pools", "", pool_cols, PC_N, st->num_devices, pcells, 0};
    const struct ctl_table xt = {"peers", "", peer_cols, XC_N, npeers, xcells, 0};
    const struct ctl_table pxt = {"proxy", "", proxy_cols, PX_N, pm != NULL, pxcells, 0};
    const struct ctl_table jt = {"jobs", "", xjob_cols, JC_N, nxjobs, jcells, 0};
    const struct ctl_mtable all[] = {
        {&stt, state_metrics, sizeof state_metrics / sizeof state_metrics[0]},
        {&dt, daemon_metrics, sizeof daemon_metrics / sizeof daemon_metrics[0]},
        {&pt, pool_metrics, sizeof pool_metrics / sizeof pool_metrics[0]},
        {&xt, peer_metrics, sizeof peer_metrics / sizeof peer_metrics[0]},
        {&pxt, proxy_metrics, sizeof proxy_metrics / sizeof proxy_metrics[0]},
        {&jt, xjob_metrics, sizeof xjob_metrics / sizeof xjob_metrics[0]},
        v.mops,
        v.mranks,
    };
    out = ctl_out_metrics(f, all, sizeof all / sizeof all[0]);
    ctl_view_free(&v);
  }
  free(pcells);
  free(xcells);
  free(jcells);
  free(latest.ranks);
  return out;
}
