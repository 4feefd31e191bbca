/*
 * proto_ctl.c — the bodies of what deepepctl asks about the daemon itself
 * (proto.h; the library's dep_status asks STATUS too): STATUS_OK, the text
 * of RELOAD_OK and DRAIN_OK, DRAIN, PEERS_OK and JOB_NODES_OK, field by
 * field with the shared codec (codec.h), every count bounded by what the
 * body can hold before anything is allocated:
 *
 *   STATUS_OK  str version (<= 31), u32 proto_version, u32 pid, u64 uptime_ms,
 *              str backend (<= 7), str state (<= 15), u32 num_clients, u32 num_devices,
 *              u32 num_jobs, then num_devices device records, then num_jobs
 *              job records
 *     device   str uuid (<= 36), str name (<= 63), str backend (<= 7),
 *              u64 pool_total_bytes, u64 pool_used_bytes, u64 pool_cached_bytes,
 *              u64 pool_held_bytes
 *     job      str job_id (<= 63), u32 owner_uid, u32 ranks_attached,
 *              u32 ranks_expected, u32 world_size, u64 slab_bytes, u64 age_ms
 *   RELOAD_OK, DRAIN_OK  str text (<= 511)
 *   DRAIN      u32 drain (0 or 1)
 *   PEERS_OK   str node (<= 63), str listen (<= 271), u32 auth (0/1), str rdma
 *              (<= 511), u64 nic_bytes, u32 proxy_threads, u64 proxy_busy_us,
 *              u32 n_peers (<= 64), then n_peers records:
 *     peer     str address (<= 271), str node (<= 63), str state (<= 15),
 *              str transport (<= 7), str wanted (<= 7), str last_error (<= 511),
 *              u32 conns_up, u32 conns_total, u32 inbound_up, u32 qps_up,
 *              u64 reconnects, u64 bytes_in, u64 bytes_out, u64 rtt_us,
 *              u64 backoff_ms, u64 rdma_rtt_us, u32 data_out, u32 data_in,
 *              u64 data_bytes_out, u64 data_bytes_in, u64 data_frames_out,
 *              u64 data_frames_in
 *   JOB_NODES_OK  u32 n (<= 256), then n records: str job_id (<= 63),
 *              u32 world_size, u32 local_ranks, u32 remote_ranks, u32 nodes,
 *              u64 bytes_out, u64 bytes_in, u64 frames_out, u64 frames_in,
 *              u32 ring_peak, u32 ring_entries
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "proto.h"

/* The smallest encoding of a status record: three empty strings + 4 u64,
 * and an empty string + 4 u32 + 2 u64.  Counts are bounded by these before
 * anything is allocated, so a tiny frame cannot ask for a huge array. */
#define STATUS_DEVICE_MIN (3 * 2 + 4 * 8)
#define STATUS_JOB_MIN (2 + 4 * 4 + 2 * 8)

/* ---- STATUS_OK ----------------------------------------------------------- */

int proto_encode_status(struct proto_buf *b, const struct dep_status *m) {
  if ((m->num_devices > 0 && m->devices == NULL) || (m->num_jobs > 0 && m->jobs == NULL))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_str(&w, m->version, sizeof m->version);
  codec_w_u32(&w, m->proto_version);
  codec_w_u32(&w, m->pid);
  codec_w_u64(&w, m->uptime_ms);
  codec_w_str(&w, m->backend, sizeof m->backend);
  codec_w_str(&w, m->state, sizeof m->state);
  codec_w_u32(&w, m->num_clients);
  codec_w_u32(&w, m->num_devices);
  codec_w_u32(&w, m->num_jobs);
  for (uint32_t i = 0; i < m->num_devices && !w.err; i++) {
    const struct dep_status_device *d = &m->devices[i];
    codec_w_str(&w, d->uuid, sizeof d->uuid);
    codec_w_str(&w, d->name, sizeof d->name);
    codec_w_str(&w, d->backend, sizeof d->backend);
    codec_w_u64(&w, d->pool_total_bytes);
    codec_w_u64(&w, d->pool_used_bytes);
    codec_w_u64(&w, d->pool_cached_bytes);
    codec_w_u64(&w, d->pool_held_bytes);
  }
  for (uint32_t i = 0; i < m->num_jobs && !w.err; i++) {
    const struct dep_status_job *j = &m->jobs[i];
    codec_w_str(&w, j->job_id, sizeof j->job_id);
    codec_w_u32(&w, j->owner_uid);
    codec_w_u32(&w, j->ranks_attached);
    codec_w_u32(&w, j->ranks_expected);
    codec_w_u32(&w, j->world_size);
    codec_w_u64(&w, j->slab_bytes);
    codec_w_u64(&w, j->age_ms);
  }
  return codec_w_finish(&w);
}

int proto_decode_status(const uint8_t *p, size_t len, struct dep_status *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->size = sizeof *m; /* deepep.h: structs grow; this library's own layout */
  m->device_size = sizeof *m->devices;
  m->job_size = sizeof *m->jobs;
  codec_r_str(&r, m->version, sizeof m->version);
  m->proto_version = codec_r_u32(&r);
  m->pid = codec_r_u32(&r);
  m->uptime_ms = codec_r_u64(&r);
  codec_r_str(&r, m->backend, sizeof m->backend);
  codec_r_str(&r, m->state, sizeof m->state);
  m->num_clients = codec_r_u32(&r);
  uint32_t ndev = codec_r_u32(&r);
  uint32_t njob = codec_r_u32(&r);
  if (r.bad)
    return DEP_ERR_PROTOCOL;
  /* Bound both counts by what is left before allocating anything. */
  if ((uint64_t)ndev * STATUS_DEVICE_MIN + (uint64_t)njob * STATUS_JOB_MIN > r.left)
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
  for (uint32_t i = 0; i < ndev && !r.bad; i++) {
    struct dep_status_device *d = &m->devices[i];
    codec_r_str(&r, d->uuid, sizeof d->uuid);
    codec_r_str(&r, d->name, sizeof d->name);
    codec_r_str(&r, d->backend, sizeof d->backend);
    d->pool_total_bytes = codec_r_u64(&r);
    d->pool_used_bytes = codec_r_u64(&r);
    d->pool_cached_bytes = codec_r_u64(&r);
    d->pool_held_bytes = codec_r_u64(&r);
  }
  for (uint32_t i = 0; i < njob && !r.bad; i++) {
    struct dep_status_job *j = &m->jobs[i];
    codec_r_str(&r, j->job_id, sizeof j->job_id);
    j->owner_uid = codec_r_u32(&r);
    j->ranks_attached = codec_r_u32(&r);
    j->ranks_expected = codec_r_u32(&r);
    j->world_size = codec_r_u32(&r);
    j->slab_bytes = codec_r_u64(&r);
    j->age_ms = codec_r_u64(&r);
  }
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

/* ---- DRAIN ------------------------------------------------------------------ */

int proto_encode_drain(struct proto_buf *b, const struct dep_msg_drain *m) {
  if (m->drain > 1)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->drain);
  return codec_w_finish(&w);
}

int proto_decode_drain(const uint8_t *p, size_t len, struct dep_msg_drain *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  m->drain = codec_r_u32(&r);
  if (!r.bad && m->drain > 1)
    return DEP_ERR_PROTOCOL;
  return codec_r_finish(&r);
}

int proto_encode_text(struct proto_buf *b, const struct dep_msg_text *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_str(&w, m->text, sizeof m->text);
  return codec_w_finish(&w);
}

int proto_decode_text(const uint8_t *p, size_t len, struct dep_msg_text *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_str(&r, m->text, sizeof m->text);
  return codec_r_finish(&r);
}

/* ---- PEERS_OK --------------------------------------------------------------- */

/* The smallest peer record: six empty strings, 6 u32 and 10 u64. */
#define PEERS_RECORD_MIN (6 * 2 + 6 * 4 + 10 * 8)

int proto_encode_peers(struct proto_buf *b, const struct dep_msg_peers *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->n_peers > DEP_PEERS_MAX || (m->n_peers > 0 && m->peers == NULL) || m->auth > 1)
    return DEP_ERR_INVALID;
  codec_w_str(&w, m->node, sizeof m->node);
  codec_w_str(&w, m->listen, sizeof m->listen);
  codec_w_u32(&w, m->auth);
  codec_w_str(&w, m->rdma, sizeof m->rdma);
  codec_w_u64(&w, m->nic_bytes);
  codec_w_u32(&w, m->proxy_threads);
  codec_w_u64(&w, m->proxy_busy_us);
  codec_w_u32(&w, m->n_peers);
  for (uint32_t i = 0; i < m->n_peers; i++) {
    const struct dep_msg_peer_info *p = &m->peers[i];
    codec_w_str(&w, p->address, sizeof p->address);
    codec_w_str(&w, p->node, sizeof p->node);
    codec_w_str(&w, p->state, sizeof p->state);
    codec_w_str(&w, p->transport, sizeof p->transport);
    codec_w_str(&w, p->wanted, sizeof p->wanted);
    codec_w_str(&w, p->last_error, sizeof p->last_error);
    codec_w_u32(&w, p->conns_up);
    codec_w_u32(&w, p->conns_total);
    codec_w_u32(&w, p->inbound_up);
    codec_w_u32(&w, p->qps_up);
    codec_w_u64(&w, p->reconnects);
    codec_w_u64(&w, p->bytes_in);
    codec_w_u64(&w, p->bytes_out);
    codec_w_u64(&w, p->rtt_us);
    codec_w_u64(&w, p->backoff_ms);
    codec_w_u64(&w, p->rdma_rtt_us);
    codec_w_u32(&w, p->data_out);
    codec_w_u32(&w, p->data_in);
    codec_w_u64(&w, p->data_bytes_out);
    codec_w_u64(&w, p->data_bytes_in);
    codec_w_u64(&w, p->data_frames_out);
    codec_w_u64(&w, p->data_frames_in);
  }
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
  codec_r_str(&r, m->node, sizeof m->node);
  codec_r_str(&r, m->listen, sizeof m->listen);
  m->auth = codec_r_u32(&r);
  codec_r_str(&r, m->rdma, sizeof m->rdma);
  m->nic_bytes = codec_r_u64(&r);
  m->proxy_threads = codec_r_u32(&r);
  m->proxy_busy_us = codec_r_u64(&r);
  uint32_t n = codec_r_u32(&r);
  /* Bounded by the limit and by what the body can hold, before allocating. */
  if (r.bad || m->auth > 1 || n > DEP_PEERS_MAX || n > r.left / PEERS_RECORD_MIN)
    return DEP_ERR_PROTOCOL;
  if (n > 0) {
    m->peers = calloc(n, sizeof *m->peers);
    if (m->peers == NULL)
      return DEP_ERR_NO_MEMORY;
  }
  m->n_peers = n;
  for (uint32_t i = 0; i < n; i++) {
    struct dep_msg_peer_info *q = &m->peers[i];
    codec_r_str(&r, q->address, sizeof q->address);
    codec_r_str(&r, q->node, sizeof q->node);
    codec_r_str(&r, q->state, sizeof q->state);
    codec_r_str(&r, q->transport, sizeof q->transport);
    codec_r_str(&r, q->wanted, sizeof q->wanted);
    codec_r_str(&r, q->last_error, sizeof q->last_error);
    q->conns_up = codec_r_u32(&r);
    q->conns_total = codec_r_u32(&r);
    q->inbound_up = codec_r_u32(&r);
    q->qps_up = codec_r_u32(&r);
    q->reconnects = codec_r_u64(&r);
    q->bytes_in = codec_r_u64(&r);
    q->bytes_out = codec_r_u64(&r);
    q->rtt_us = codec_r_u64(&r);
    q->backoff_ms = codec_r_u64(&r);
    q->rdma_rtt_us = codec_r_u64(&r);
    q->data_out = codec_r_u32(&r);
    q->data_in = codec_r_u32(&r);
    q->data_bytes_out = codec_r_u64(&r);
    q->data_bytes_in = codec_r_u64(&r);
    q->data_frames_out = codec_r_u64(&r);
    q->data_frames_in = codec_r_u64(&r);
  }
  int rc = codec_r_finish(&r);
  if (rc != 0)
    proto_peers_free(m);
  return rc;
}

/* ---- JOB_NODES_OK ------------------------------------------------------------ */

int proto_encode_job_nodes(struct proto_buf *b, const struct dep_msg_job_nodes *m) {
  if (m->n > DEP_JOB_NODES_MAX)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->n);
  for (uint32_t i = 0; i < m->n; i++) {
    const struct dep_msg_job_node *j = &m->jobs[i];
    codec_w_str(&w, j->job_id, sizeof j->job_id);
    codec_w_u32(&w, j->world_size);
    codec_w_u32(&w, j->local_ranks);
    codec_w_u32(&w, j->remote_ranks);
    codec_w_u32(&w, j->nodes);
    codec_w_u64(&w, j->bytes_out);
    codec_w_u64(&w, j->bytes_in);
    codec_w_u64(&w, j->frames_out);
    codec_w_u64(&w, j->frames_in);
    codec_w_u32(&w, j->ring_peak);
    codec_w_u32(&w, j->ring_entries);
  }
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
  for (uint32_t i = 0; i < n && !r.bad; i++) {
    struct dep_msg_job_node *j = &m->jobs[i];
    codec_r_str(&r, j->job_id, sizeof j->job_id);
    j->world_size = codec_r_u32(&r);
    j->local_ranks = codec_r_u32(&r);
    j->remote_ranks = codec_r_u32(&r);
    j->nodes = codec_r_u32(&r);
    j->bytes_out = codec_r_u64(&r);
    j->bytes_in = codec_r_u64(&r);
    j->frames_out = codec_r_u64(&r);
    j->frames_in = codec_r_u64(&r);
    j->ring_peak = codec_r_u32(&r);
    j->ring_entries = codec_r_u32(&r);
  }
  return codec_r_finish(&r);
}
