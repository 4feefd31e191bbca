/*
 * proto_ctl.c — the bodies of what deepepctl asks about the daemon itself
 * (proto.h; the library's dep_status asks STATUS too): STATUS_OK, RELOAD_OK,
 * the text of DRAIN_OK, DRAIN, PEERS_OK and JOB_NODES_OK, with the
 * shared codec (codec.h).  Each record's fields are one table below, in wire
 * order, which drives its encoder, its decoder and its smallest size (a
 * string's bound is its member's array, less the NUL); a body with records
 * is the head's fields, a u32 count, then that many records (STATUS_OK: two
 * counts, devices then jobs), every count bounded by what the body can hold
 * before anything is allocated.  RELOAD_OK is a string and two lists of
 * key names; DRAIN_OK is one string, DRAIN one u32 (0 or 1).
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "proto.h"
#include "slab.h"

/* ---- STATUS_OK's fields ------------------------------------------------------ */

/* The head, before the two counts and their records. */
static const struct codec_field status_head[] = {
    CODEC_STR(struct dep_status, version),     CODEC_U32(struct dep_status, proto_version),
    CODEC_U32(struct dep_status, pid),         CODEC_U64(struct dep_status, uptime_ms),
    CODEC_STR(struct dep_status, backend),     CODEC_STR(struct dep_status, state),
    CODEC_U32(struct dep_status, num_clients),
};

static const struct codec_field status_device[] = {
    CODEC_STR(struct dep_status_device, uuid),
    CODEC_STR(struct dep_status_device, name),
    CODEC_STR(struct dep_status_device, backend),
    CODEC_U64(struct dep_status_device, pool_total_bytes),
    CODEC_U64(struct dep_status_device, pool_used_bytes),
    CODEC_U64(struct dep_status_device, pool_cached_bytes),
    CODEC_U64(struct dep_status_device, pool_held_bytes),
};

static const struct codec_field status_job[] = {
    CODEC_STR(struct dep_status_job, job_id),       CODEC_U32(struct dep_status_job, owner_uid),
    CODEC_U32(struct dep_status_job, ranks_attached),
    CODEC_U32(struct dep_status_job, ranks_expected),
    CODEC_U32(struct dep_status_job, world_size),   CODEC_U64(struct dep_status_job, slab_bytes),
    CODEC_U64(struct dep_status_job, age_ms),       CODEC_U64(struct dep_status_job, host_bytes),
    CODEC_U32(struct dep_status_job, flags),        CODEC_U32(struct dep_status_job, masked),
    CODEC_U64(struct dep_status_job, epoch),        CODEC_STR(struct dep_status_job, mask),
    CODEC_U32(struct dep_status_job, chunk_rows),
};

/* ---- STATUS_OK ----------------------------------------------------------- */

int proto_encode_status(struct proto_buf *b, const struct dep_status *m) {
  if ((m->num_devices > 0 && m->devices == NULL) || (m->num_jobs > 0 && m->jobs == NULL))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, status_head, CODEC_NFIELDS(status_head), m);
  codec_w_u32(&w, m->num_devices);
  codec_w_u32(&w, m->num_jobs);
  for (uint32_t i = 0; i < m->num_devices && !w.err; i++)
    codec_w_rec(&w, status_device, CODEC_NFIELDS(status_device), &m->devices[i]);
  for (uint32_t i = 0; i < m->num_jobs && !w.err; i++)
    codec_w_rec(&w, status_job, CODEC_NFIELDS(status_job), &m->jobs[i]);
  return codec_w_finish(&w);
}

int proto_decode_status(const uint8_t *p, size_t len, struct dep_status *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->size = sizeof *m; /* deepep.h: structs grow; this library's own layout */
  m->device_size = sizeof *m->devices;
  m->job_size = sizeof *m->jobs;
  codec_r_rec(&r, status_head, CODEC_NFIELDS(status_head), m);
  uint32_t ndev = codec_r_u32(&r);
  uint32_t njob = codec_r_u32(&r);
  if (r.bad)
    return DEP_ERR_PROTOCOL;
  /* Bound both counts by what is left before allocating anything. */
  if ((uint64_t)ndev * codec_rec_min(status_device, CODEC_NFIELDS(status_device)) +
          (uint64_t)njob * codec_rec_min(status_job, CODEC_NFIELDS(status_job)) >
      r.left)
    return DEP_ERR_PROTOCOL;

  if (ndev > 0) {
    m->devices = calloc(ndev, sizeof *m->devices);
    if (m->devices == NULL)
      return DEP_ERR_NO_MEMORY;
  }
  if (njob > 0) {
    m->jobs = calloc(njob, sizeof *m->jobs);
    if (m->jobs == NULL) {
      free(m->devices);
      m->devices = NULL;
      return DEP_ERR_NO_MEMORY;
    }
  }
  m->num_devices = ndev;
  m->num_jobs = njob;
  for (uint32_t i = 0; i < ndev && !r.bad; i++)
    codec_r_rec(&r, status_device, CODEC_NFIELDS(status_device), &m->devices[i]);
  for (uint32_t i = 0; i < njob && !r.bad; i++)
    codec_r_rec(&r, status_job, CODEC_NFIELDS(status_job), &m->jobs[i]);
  int rc = codec_r_finish(&r);
  if (rc != 0) {
    free(m->devices);
    free(m->jobs);
    m->devices = NULL;
    m->jobs = NULL;
    m->num_devices = 0;
    m->num_jobs = 0;
  }
  return rc;
}

DEP_EXPORT void dep_status_free(struct dep_status *st) {
  if (st == NULL)
    return;
  free(st->devices);
  free(st->jobs);
  free(st);
}

/* ---- DRAIN and DRAIN_OK ---------------------------------------------------- */

static const struct codec_field drain_fields[] = {
    CODEC_U32(struct dep_msg_drain, drain), /* 0 or 1 */
};
static const struct codec_field text_fields[] = {
    CODEC_STR(struct dep_msg_text, text),
};
static bool drain_check(const void *rec) { return ((const struct dep_msg_drain *)rec)->drain <= 1; }
CODEC_BODY(drain, struct dep_msg_drain, drain_fields, drain_check, drain_check)
CODEC_BODY(text, struct dep_msg_text, text_fields, NULL, NULL)

/* ---- RELOAD_OK ---------------------------------------------------------------
 * Its message, then two lists of key names: each a u32 count and that many strings. */

static const struct codec_field reload_ok_head[] = {
    CODEC_STR(struct dep_msg_reload_ok, message),
};

static void reload_ok_w_names(struct codec_w *w, uint32_t n,
                              const char (*names)[DEP_RELOAD_KEY_MAX]) {
  codec_w_u32(w, n);
  for (uint32_t i = 0; i < n && !w->err; i++)
    codec_w_str(w, names[i], DEP_RELOAD_KEY_MAX);
}

int proto_encode_reload_ok(struct proto_buf *b, const struct dep_msg_reload_ok *m) {
  if (m->n_applied > DEP_RELOAD_KEYS_MAX || m->n_restart > DEP_RELOAD_KEYS_MAX)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, reload_ok_head, CODEC_NFIELDS(reload_ok_head), m);
  reload_ok_w_names(&w, m->n_applied, m->applied);
  reload_ok_w_names(&w, m->n_restart, m->restart);
  return codec_w_finish(&w);
}

/* A list's count, bounded before any name is read, then its names. */
static uint32_t reload_ok_r_names(struct codec_r *r, char (*names)[DEP_RELOAD_KEY_MAX]) {
  uint32_t n = codec_r_u32(r);
  if (n > DEP_RELOAD_KEYS_MAX) {
    r->bad = true;
    return 0;
  }
  for (uint32_t i = 0; i < n && !r->bad; i++)
    codec_r_str(r, names[i], DEP_RELOAD_KEY_MAX);
  return r->bad ? 0 : n;
}

int proto_decode_reload_ok(const uint8_t *p, size_t len, struct dep_msg_reload_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, reload_ok_head, CODEC_NFIELDS(reload_ok_head), m);
  m->n_applied = reload_ok_r_names(&r, m->applied);
  m->n_restart = reload_ok_r_names(&r, m->restart);
  return codec_r_finish(&r);
}

/* ---- PEERS_OK --------------------------------------------------------------- */

static const struct codec_field peers_head[] = {
    CODEC_STR(struct dep_msg_peers, node),          CODEC_STR(struct dep_msg_peers, listen),
    CODEC_U32(struct dep_msg_peers, auth),          CODEC_STR(struct dep_msg_peers, rdma),
    CODEC_U64(struct dep_msg_peers, nic_bytes),     CODEC_U32(struct dep_msg_peers, proxy_threads),
    CODEC_U64(struct dep_msg_peers, proxy_busy_us),
};

#define PEER_F(kind, m) CODEC_##kind(struct dep_msg_peer_info, m)
static const struct codec_field peers_record[] = {
    PEER_F(STR, address),        PEER_F(STR, node),          PEER_F(STR, state),
    PEER_F(STR, transport),      PEER_F(STR, wanted),        PEER_F(STR, last_error),
    PEER_F(U32, conns_up),       PEER_F(U32, conns_total),   PEER_F(U32, inbound_up),
    PEER_F(U32, qps_up),         PEER_F(U64, reconnects),    PEER_F(U64, bytes_in),
    PEER_F(U64, bytes_out),      PEER_F(U64, rtt_us),        PEER_F(U64, backoff_ms),
    PEER_F(U64, rdma_rtt_us),    PEER_F(U32, data_out),      PEER_F(U32, data_in),
    PEER_F(U64, data_bytes_out), PEER_F(U64, data_bytes_in), PEER_F(U64, data_frames_out),
    PEER_F(U64, data_frames_in), PEER_F(U64, rdma_blocks_out), PEER_F(U64, rdma_writes_out),
    PEER_F(U64, rdma_posts_out), PEER_F(U64, rdma_bytes_out),
};
#undef PEER_F

int proto_encode_peers(struct proto_buf *b, const struct dep_msg_peers *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->n_peers > DEP_PEERS_MAX || (m->n_peers > 0 && m->peers == NULL) || m->auth > 1)
    return DEP_ERR_INVALID;
  codec_w_rec(&w, peers_head, CODEC_NFIELDS(peers_head), m);
  codec_w_u32(&w, m->n_peers);
  for (uint32_t i = 0; i < m->n_peers && !w.err; i++)
    codec_w_rec(&w, peers_record, CODEC_NFIELDS(peers_record), &m->peers[i]);
  return codec_w_finish(&w);
}

void proto_peers_free(struct dep_msg_peers *m) {
  free(m->peers);
  m->peers = NULL;
  m->n_peers = 0;
}

int proto_decode_peers(const uint8_t *p, size_t len, struct dep_msg_peers *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, peers_head, CODEC_NFIELDS(peers_head), m);
  uint32_t n = codec_r_u32(&r);
  /* Bounded by the limit and by what the body can hold, before allocating. */
  if (r.bad || m->auth > 1 || n > DEP_PEERS_MAX || n > r.left / codec_rec_min(peers_record, CODEC_NFIELDS(peers_record)))
    return DEP_ERR_PROTOCOL;
  if (n > 0) {
    m->peers = calloc(n, sizeof *m->peers);
    if (m->peers == NULL)
      return DEP_ERR_NO_MEMORY;
  }
  m->n_peers = n;
  for (uint32_t i = 0; i < n && !r.bad; i++)
    codec_r_rec(&r, peers_record, CODEC_NFIELDS(peers_record), &m->peers[i]);
  int rc = codec_r_finish(&r);
  if (rc != 0)
    proto_peers_free(m);
  return rc;
}

/* ---- JOB_NODES_OK ------------------------------------------------------------ */

#define JOB_NODE_F(kind, m) CODEC_##kind(struct dep_msg_job_node, m)
static const struct codec_field job_node_record[] = {
    JOB_NODE_F(STR, job_id),     JOB_NODE_F(U32, world_size), JOB_NODE_F(U32, local_ranks),
    JOB_NODE_F(U32, remote_ranks), JOB_NODE_F(U32, nodes),    JOB_NODE_F(U64, bytes_out),
    JOB_NODE_F(U64, bytes_in),   JOB_NODE_F(U64, frames_out), JOB_NODE_F(U64, frames_in),
    JOB_NODE_F(U32, ring_peak),  JOB_NODE_F(U32, ring_entries), JOB_NODE_F(U64, payload_out),
};
#undef JOB_NODE_F

int proto_encode_job_nodes(struct proto_buf *b, const struct dep_msg_job_nodes *m) {
  if (m->n > DEP_JOB_NODES_MAX)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->n);
  for (uint32_t i = 0; i < m->n && !w.err; i++)
    codec_w_rec(&w, job_node_record, CODEC_NFIELDS(job_node_record), &m->jobs[i]);
  return codec_w_finish(&w);
}

int proto_decode_job_nodes(const uint8_t *p, size_t len, struct dep_msg_job_nodes *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  uint32_t n = codec_r_u32(&r);
  if (r.bad || n > DEP_JOB_NODES_MAX)
    return DEP_ERR_PROTOCOL;
  m->n = n;
  for (uint32_t i = 0; i < n && !r.bad; i++)
    codec_r_rec(&r, job_node_record, CODEC_NFIELDS(job_node_record), &m->jobs[i]);
  return codec_r_finish(&r);
}

/* ---- JOB_EVENTS_OK ----------------------------------------------------------- */

#define JOB_EVENT_F(kind, m) CODEC_##kind(struct dep_msg_job_event, m)
static const struct codec_field job_event_record[] = {
    JOB_EVENT_F(STR, job_id), JOB_EVENT_F(U64, age_ms), JOB_EVENT_F(U32, rank),
    JOB_EVENT_F(U32, why),    JOB_EVENT_F(U32, pid),    JOB_EVENT_F(U64, epoch),
};
#undef JOB_EVENT_F

static bool job_event_ok(const struct dep_msg_job_event *e) {
  return e->why <= DEP_JOB_EVENT_PARTITIONED && e->why != DEP_SLAB_GONE_DAEMON;
}

int proto_encode_job_events(struct proto_buf *b, const struct dep_msg_job_events *m) {
  if (m->n > DEP_JOB_EVENTS_MAX)
    return DEP_ERR_INVALID;
  for (uint32_t i = 0; i < m->n; i++)
    if (!job_event_ok(&m->ev[i]))
      return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_list(&w, m->n, m->left_out, job_event_record, CODEC_NFIELDS(job_event_record), m->ev,
               sizeof m->ev[0]);
  return codec_w_finish(&w);
}

int proto_decode_job_events(const uint8_t *p, size_t len, struct dep_msg_job_events *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  uint32_t n = 0;
  codec_r_list_head(&r, DEP_JOB_EVENTS_MAX, job_event_record, CODEC_NFIELDS(job_event_record), &n,
                    &m->left_out);
  if (r.bad)
    return DEP_ERR_PROTOCOL;
  m->n = n;
  for (uint32_t i = 0; i < n && !r.bad; i++) {
    codec_r_rec(&r, job_event_record, CODEC_NFIELDS(job_event_record), &m->ev[i]);
    if (!r.bad && !job_event_ok(&m->ev[i]))
      return DEP_ERR_PROTOCOL;
  }
  return codec_r_finish(&r);
}

const char *proto_job_event_name(uint32_t why) {
  switch (why) {
  case DEP_SLAB_GONE_DIED:
    return "died";
  case DEP_SLAB_GONE_DETACHED:
    return "detached";
  case DEP_SLAB_GONE_NODE:
    return "node lost";
  case DEP_JOB_EVENT_REJOINED:
    return "rejoined";
  case DEP_JOB_EVENT_PARTITIONED:
    return "partitioned";
  default:
    return "unknown";
  }
}
