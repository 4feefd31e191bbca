/*
 * ctl_status.c — `deepepctl status`: the daemon's version, state, uptime,
 * backend, devices, clients and jobs (with each elastic job's epoch, masked
 * ranks and history), as text or JSON from the same records.
 */
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"
#include "ctl.h"

/* The JSON keys are an interface: deepepctl(1) lists them; never rename. */
static const struct ctl_col status_fields[] = {
    {"version", "version", CTL_STR, 0},
    {"state", "state", CTL_STR, 0},
    {"pid", "pid", CTL_UINT, 0},
    {"uptime_ms", "uptime", CTL_MS, 0},
    {"backend", "backend", CTL_STR, 0},
    {"proto_version", "protocol", CTL_UINT, 0},
    {"clients", "clients", CTL_UINT, 0},
};
#define STATUS_NFIELDS (sizeof status_fields / sizeof status_fields[0])

static const struct ctl_col device_cols[] = {
    {"uuid", "UUID", CTL_STR, 0},
    {"name", "NAME", CTL_STR, 0},
    {"backend", "BACKEND", CTL_STR, 0},
    {"pool_total_bytes", "TOTAL", CTL_BYTES, 0},
    {"pool_used_bytes", "USED", CTL_BYTES, 0},
    {"pool_cached_bytes", "CACHED", CTL_BYTES, 0},
    {"pool_held_bytes", "HELD", CTL_BYTES, 0},
};
#define DEVICE_NCOLS (sizeof device_cols / sizeof device_cols[0])

static const struct ctl_col job_cols[] = {
    {"job_id", "JOB", CTL_STR, 0},
    {"owner_uid", "UID", CTL_UINT, 0},
    {"ranks_attached", "RANKS", CTL_UINT, 0},
    {"ranks_expected", "", CTL_UINT, CTL_COL_JOIN},
    {"world_size", "WORLD", CTL_UINT, 0},
    {"slab_bytes", "SLAB", CTL_BYTES, 0},
    {"chunk_rows", "CHUNK", CTL_UINT, 0},
    {"age_ms", "AGE", CTL_MS, 0},
    {"elastic", "ELASTIC", CTL_BOOL, 0},
    {"epoch", "EPOCH", CTL_UINT, 0},
    {"masked_ranks", "MASKED", CTL_STR, 0},
    {"host_bytes", "HOST", CTL_BYTES, 0},
    {"nodes", "NODES", CTL_UINT, 0},
    {"remote_ranks", "REMOTE", CTL_UINT, 0},
    {"bytes_out", "TX", CTL_BYTES, 0},
    {"bytes_in", "RX", CTL_BYTES, 0},
    {"ring_peak", "RING_PEAK", CTL_UINT, 0},
    {"payload_out", "PAYLOAD_TX", CTL_BYTES, 0},
};
#define JOB_NCOLS (sizeof job_cols / sizeof job_cols[0])

/* The node columns, job_cols[JOB_NODE_COL...]: when no job spans nodes (no pinned host
 * memory, one node, nothing sent or received, an empty ring) they stay in the JSON but out
 * of the text table, as deepepctl(1) says. */
#define JOB_NODE_COL 11
/* The elastic columns, job_cols[JOB_ELASTIC_COL...]: out of the text table when no job is
 * elastic, as deepepctl(1) says. */
#define JOB_ELASTIC_COL 8
_Static_assert(JOB_NCOLS == JOB_NODE_COL + 7, "the node columns end the job columns");

/* An elastic job's history (JOB_EVENTS_OK): who left, when and why; who came back. */
static const struct ctl_col event_cols[] = {
    {"job_id", "JOB", CTL_STR, 0},
    {"age_ms", "AT", CTL_MS, 0},
    {"rank", "RANK", CTL_UINT, 0},
    {"event", "EVENT", CTL_STR, 0},
    {"pid", "PID", CTL_UINT, 0},
    {"epoch", "EPOCH", CTL_UINT, 0},
};
#define EVENT_NCOLS (sizeof event_cols / sizeof event_cols[0])

/* The history's rows (JOB_EVENTS_OK) into cells, EVENT_NCOLS a row. */
static void event_rows(const struct dep_msg_job_events *ev, struct ctl_val *cells) {
  for (uint32_t i = 0; ev != NULL && i < ev->n; i++) {
    const struct dep_msg_job_event *e = &ev->ev[i];
    struct ctl_val *row = cells + (size_t)i * EVENT_NCOLS;
    row[0].s = e->job_id;
    row[1].u = e->age_ms;
    row[2].u = e->rank;
    row[3].s = proto_job_event_name(e->why);
    row[4].u = e->pid;
    row[5].u = e->epoch;
  }
}

/* Turn the daemon's status into the output records and render them. */
static int status_render(const struct ctl *ctl, const struct dep_status *st,
                         const struct dep_msg_job_nodes *mn, bool multinode,
                         const struct dep_msg_job_events *ev, bool elastic) {
  struct ctl_val fields[STATUS_NFIELDS] = {
      {.s = st->version},
      {.s = st->state},
      {.u = st->pid},
      {.u = st->uptime_ms},
      {.s = st->backend},
      {.u = st->proto_version},
      {.u = st->num_clients},
  };
  struct ctl_val *dev = calloc((size_t)st->num_devices * DEVICE_NCOLS + 1, sizeof *dev);
  struct ctl_val *job = calloc((size_t)st->num_jobs * JOB_NCOLS + 1, sizeof *job);
  const uint32_t nev = ev != NULL ? ev->n : 0;
  struct ctl_val *evs = calloc((size_t)nev * EVENT_NCOLS + 1, sizeof *evs);
  if (dev == NULL || job == NULL || evs == NULL) {
    free(dev);
    free(job);
    free(evs);
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  }
  for (uint32_t i = 0; i < st->num_devices; i++) {
    const struct dep_status_device *d = &st->devices[i];
    struct ctl_val *row = dev + (size_t)i * DEVICE_NCOLS;
    row[0].s = d->uuid;
    row[1].s = d->name;
    row[2].s = d->backend;
    row[3].u = d->pool_total_bytes;
    row[4].u = d->pool_used_bytes;
    row[5].u = d->pool_cached_bytes;
    row[6].u = d->pool_held_bytes;
  }
  for (uint32_t i = 0; i < st->num_jobs; i++) {
    const struct dep_status_job *j = &st->jobs[i];
    struct ctl_val *row = job + (size_t)i * JOB_NCOLS;
    row[0].s = j->job_id;
    row[1].u = j->owner_uid;
    row[2].u = j->ranks_attached;
    row[3].u = j->ranks_expected;
    row[4].u = j->world_size;
    row[5].u = j->slab_bytes;
    row[6].u = j->chunk_rows;
    row[7].u = j->age_ms;
    row[JOB_ELASTIC_COL].u = (j->flags & DEP_ATTACH_ELASTIC) != 0;
    row[JOB_ELASTIC_COL + 1].u = j->epoch;
    row[JOB_ELASTIC_COL + 2].s = j->mask;
    row[JOB_NODE_COL].u = j->host_bytes;
    /* One node and no remote ranks, unless JOB_NODES says otherwise. */
    row[JOB_NODE_COL + 1].u = 1;
    row[JOB_NODE_COL + 2].u = 0;
    for (uint32_t k = 0; mn != NULL && k < mn->n; k++) {
      if (strcmp(mn->jobs[k].job_id, j->job_id) == 0) {
        row[JOB_NODE_COL + 1].u = mn->jobs[k].nodes;
        row[JOB_NODE_COL + 2].u = mn->jobs[k].remote_ranks;
        row[JOB_NODE_COL + 3].u = mn->jobs[k].bytes_out;
        row[JOB_NODE_COL + 4].u = mn->jobs[k].bytes_in;
        row[JOB_NODE_COL + 5].u = mn->jobs[k].ring_peak;
        row[JOB_NODE_COL + 6].u = mn->jobs[k].payload_out;
      }
    }
  }
  struct ctl_col jcols[JOB_NCOLS];
  memcpy(jcols, job_cols, sizeof jcols);
  for (size_t k = JOB_NODE_COL; !multinode && k < JOB_NCOLS; k++)
    jcols[k].flags |= CTL_COL_NOTEXT;
  for (size_t k = JOB_ELASTIC_COL; !elastic && k < JOB_NODE_COL; k++)
    jcols[k].flags |= CTL_COL_NOTEXT;
  event_rows(ev, evs);
  const struct ctl_table tables[] = {
      {"devices", "no devices", device_cols, DEVICE_NCOLS, st->num_devices, dev, 0},
      {"jobs", "no jobs", jcols, JOB_NCOLS, st->num_jobs, job, 0},
      {"job_events", "no elastic job events", event_cols, EVENT_NCOLS, nev, evs,
       elastic ? 0u : CTL_TABLE_NOTEXT},
  };
  const struct ctl_doc doc = {status_fields, fields, STATUS_NFIELDS, tables, 3};
  int rc = ctl_out_render(stdout, &doc, ctl->json);
  free(dev);
  free(job);
  free(evs);
  if (rc != 0)
    return ctl_fail(ctl, DEP_ERR_NO_MEMORY, "out of memory");
  return CTL_EXIT_OK;
}

int ctl_status(struct ctl *ctl, int argc, char **argv) {
  int rc = ctl_sub_options(ctl, argc, argv);
  if (rc >= 0)
    return rc;
  dep_client_t *c = ctl_connect(ctl);
  if (c == NULL)
    return CTL_EXIT_FAIL;
  struct dep_status *st = NULL;
  rc = dep_status(c, &st);
  if (rc != 0)
    return ctl_fail_client(ctl, c, rc, NULL);
  /* The nodes of multi-node jobs: a second request, only when there are some. */
  struct dep_msg_job_nodes *mn = NULL;
  bool multinode = false;
  for (uint32_t i = 0; i < st->num_jobs; i++)
    multinode |= st->jobs[i].world_size > st->jobs[i].ranks_expected;
  if (multinode && (mn = calloc(1, sizeof *mn)) != NULL &&
      ctl_ask(c, DEP_MSG_JOB_NODES, NULL, DEP_MSG_JOB_NODES_OK, ctl_decode_job_nodes, mn) != 0)
    mn->n = 0;
  /* The elastic jobs' histories: a third request, only when some job is elastic. */
  struct dep_msg_job_events *ev = NULL;
  bool elastic = false;
  for (uint32_t i = 0; i < st->num_jobs; i++)
    elastic |= (st->jobs[i].flags & DEP_ATTACH_ELASTIC) != 0;
  if (elastic && (ev = calloc(1, sizeof *ev)) != NULL &&
      ctl_ask(c, DEP_MSG_JOB_EVENTS, NULL, DEP_MSG_JOB_EVENTS_OK, ctl_decode_job_events, ev) != 0)
    ev->n = 0;
  dep_client_free(c);
  rc = status_render(ctl, st, mn, multinode, ev, elastic);
  free(mn);
  free(ev);
  dep_status_free(st);
  return ctl_finish_output(rc);
}
