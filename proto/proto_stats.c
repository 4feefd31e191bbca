/*
 * proto_stats.c — the bodies of the stats and clients messages (proto.h),
 * field by field with the shared codec (codec.h), bounds-checked like the
 * rest of the control protocol:
 *
 *   STATS_LEND_OK  u32 version, u32 bytes; the page's memfd rides on it
 *   (XRING_LEND_OK is the same: its ring's memfd rides on it)
 *   STATS          str job_id ("" or a job id)
 *   STATS_RANK     str job_id, u32 rank, local_rank, world, pid, uid,
 *                  16 bytes device_uuid, u32 finished, u32 cuda, u64 age_ms,
 *                  u64 ended_ms, u32 attached, 5 x u64 attach times,
 *                  u64 dropped, u32 n_ops (= 5), n_ops x 9 u64 (an op),
 *                  u64 layouts, u32 n_recent (<= 16), u32 recent_world
 *                  (<= 64), n_recent x recent_world u32
 *   STATS_OK       u32 ranks, finished_jobs, keep_jobs, keep_s,
 *                  warn_ratio_milli, u64 warnings, str largest_job,
 *                  16 bytes largest_uuid, u64 largest_bytes, u32 n_pools
 *                  (<= 64), n_pools x (16 bytes uuid, u64 made_bytes)
 *   CLIENTS        empty
 *   CLIENTS_OK     u32 n (<= 1024), u32 left_out, then n records: u32 pid,
 *                  u32 uid, str name (<= 63), str job_id (<= 63), u32 rank,
 *                  u32 local_rank, u32 attached, 16 bytes device_uuid,
 *                  u64 connected_ms, u64 attached_ms
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "proto.h"
#include "stats_page.h"

_Static_assert(DEP_STATS_WIRE_OPS == DEP_STATS_NOPS, "the wire carries every op of stats_page.h");
_Static_assert(DEP_STATS_WIRE_LAYOUTS == DEP_STATS_LAYOUT_RING,
               "the wire carries every layout the ring holds");

int proto_encode_lend_ok(struct proto_buf *b, const struct dep_msg_lend_ok *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->version);
  codec_w_u32(&w, m->bytes);
  return codec_w_finish(&w);
}

int proto_decode_lend_ok(const uint8_t *p, size_t len, struct dep_msg_lend_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  m->version = codec_r_u32(&r);
  m->bytes = codec_r_u32(&r);
  return codec_r_finish(&r);
}

int proto_encode_stats_req(struct proto_buf *b, const struct dep_msg_stats_req *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_str(&w, m->job_id, sizeof m->job_id);
  return codec_w_finish(&w);
}

int proto_decode_stats_req(const uint8_t *p, size_t len, struct dep_msg_stats_req *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  codec_r_str(&r, m->job_id, sizeof m->job_id);
  return codec_r_finish(&r);
}

int proto_encode_stats_rank(struct proto_buf *b, const struct dep_msg_stats_rank *m) {
  if (m->n_recent > DEP_STATS_WIRE_LAYOUTS || m->recent_world > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_str(&w, m->job_id, sizeof m->job_id);
  codec_w_u32(&w, m->rank);
  codec_w_u32(&w, m->local_rank);
  codec_w_u32(&w, m->world);
  codec_w_u32(&w, m->pid);
  codec_w_u32(&w, m->uid);
  codec_w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  codec_w_u32(&w, m->finished);
  codec_w_u32(&w, m->cuda);
  codec_w_u64(&w, m->age_ms);
  codec_w_u64(&w, m->ended_ms);
  codec_w_u32(&w, m->attached);
  codec_w_u64(&w, m->attach_total_ns);
  codec_w_u64(&w, m->attach_wait_ns);
  codec_w_u64(&w, m->attach_map_ns);
  codec_w_u64(&w, m->attach_setup_ns);
  codec_w_u64(&w, m->attach_warmup_ns);
  codec_w_u64(&w, m->dropped);
  codec_w_u32(&w, DEP_STATS_WIRE_OPS);
  for (unsigned i = 0; i < DEP_STATS_WIRE_OPS; i++) {
    const struct dep_msg_stats_op *o = &m->ops[i];
    codec_w_u64(&w, o->calls);
    codec_w_u64(&w, o->first_ns);
    codec_w_u64(&w, o->steady_calls);
    codec_w_u64(&w, o->median_ns);
    codec_w_u64(&w, o->p99_ns);
    codec_w_u64(&w, o->steady_sum_ns);
    codec_w_u64(&w, o->bytes);
    codec_w_u64(&w, o->errors);
    codec_w_u64(&w, o->timeouts);
  }
  codec_w_u64(&w, m->layouts);
  codec_w_u32(&w, m->n_recent);
  codec_w_u32(&w, m->recent_world);
  for (uint32_t i = 0; i < m->n_recent; i++)
    for (uint32_t k = 0; k < m->recent_world; k++)
      codec_w_u32(&w, m->recent[i][k]);
  codec_w_u32(&w, m->kernel_ctas);
  codec_w_u32(&w, m->ctas_how);
  return codec_w_finish(&w);
}

int proto_decode_stats_rank(const uint8_t *p, size_t len, struct dep_msg_stats_rank *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_str(&r, m->job_id, sizeof m->job_id);
  m->rank = codec_r_u32(&r);
  m->local_rank = codec_r_u32(&r);
  m->world = codec_r_u32(&r);
  m->pid = codec_r_u32(&r);
  m->uid = codec_r_u32(&r);
  codec_r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  m->finished = codec_r_u32(&r);
  m->cuda = codec_r_u32(&r);
  m->age_ms = codec_r_u64(&r);
  m->ended_ms = codec_r_u64(&r);
  m->attached = codec_r_u32(&r);
  m->attach_total_ns = codec_r_u64(&r);
  m->attach_wait_ns = codec_r_u64(&r);
  m->attach_map_ns = codec_r_u64(&r);
  m->attach_setup_ns = codec_r_u64(&r);
  m->attach_warmup_ns = codec_r_u64(&r);
  m->dropped = codec_r_u64(&r);
  if (codec_r_u32(&r) != DEP_STATS_WIRE_OPS)
    return DEP_ERR_PROTOCOL;
  for (unsigned i = 0; i < DEP_STATS_WIRE_OPS; i++) {
    struct dep_msg_stats_op *o = &m->ops[i];
    o->calls = codec_r_u64(&r);
    o->first_ns = codec_r_u64(&r);
    o->steady_calls = codec_r_u64(&r);
    o->median_ns = codec_r_u64(&r);
    o->p99_ns = codec_r_u64(&r);
    o->steady_sum_ns = codec_r_u64(&r);
    o->bytes = codec_r_u64(&r);
    o->errors = codec_r_u64(&r);
    o->timeouts = codec_r_u64(&r);
  }
  m->layouts = codec_r_u64(&r);
  m->n_recent = codec_r_u32(&r);
  m->recent_world = codec_r_u32(&r);
  if (r.bad || m->n_recent > DEP_STATS_WIRE_LAYOUTS || m->recent_world > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_recent; i++)
    for (uint32_t k = 0; k < m->recent_world; k++)
      m->recent[i][k] = codec_r_u32(&r);
  m->kernel_ctas = codec_r_u32(&r);
  m->ctas_how = codec_r_u32(&r);
  return codec_r_finish(&r);
}

int proto_encode_stats_ok(struct proto_buf *b, const struct dep_msg_stats_ok *m) {
  if (m->n_pools > DEP_STATS_WIRE_POOLS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->ranks);
  codec_w_u32(&w, m->finished_jobs);
  codec_w_u32(&w, m->keep_jobs);
  codec_w_u32(&w, m->keep_s);
  codec_w_u32(&w, m->warn_ratio_milli);
  codec_w_u64(&w, m->warnings);
  codec_w_str(&w, m->largest_job, sizeof m->largest_job);
  codec_w_bytes(&w, m->largest_uuid, sizeof m->largest_uuid);
  codec_w_u64(&w, m->largest_bytes);
  codec_w_u32(&w, m->n_pools);
  for (uint32_t i = 0; i < m->n_pools; i++) {
    codec_w_bytes(&w, m->pools[i].uuid, sizeof m->pools[i].uuid);
    codec_w_u64(&w, m->pools[i].made_bytes);
  }
  return codec_w_finish(&w);
}

int proto_decode_stats_ok(const uint8_t *p, size_t len, struct dep_msg_stats_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->ranks = codec_r_u32(&r);
  m->finished_jobs = codec_r_u32(&r);
  m->keep_jobs = codec_r_u32(&r);
  m->keep_s = codec_r_u32(&r);
  m->warn_ratio_milli = codec_r_u32(&r);
  m->warnings = codec_r_u64(&r);
  codec_r_str(&r, m->largest_job, sizeof m->largest_job);
  codec_r_bytes(&r, m->largest_uuid, sizeof m->largest_uuid);
  m->largest_bytes = codec_r_u64(&r);
  m->n_pools = codec_r_u32(&r);
  if (r.bad || m->n_pools > DEP_STATS_WIRE_POOLS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_pools; i++) {
    codec_r_bytes(&r, m->pools[i].uuid, sizeof m->pools[i].uuid);
    m->pools[i].made_bytes = codec_r_u64(&r);
  }
  return codec_r_finish(&r);
}

int proto_encode_clients(struct proto_buf *b, const struct dep_msg_clients *m) {
  if (m->n > DEP_CLIENTS_MAX || (m->n > 0 && m->clients == NULL))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->n);
  codec_w_u32(&w, m->left_out);
  for (uint32_t i = 0; i < m->n; i++) {
    const struct dep_msg_client *c = &m->clients[i];
    codec_w_u32(&w, c->pid);
    codec_w_u32(&w, c->uid);
    codec_w_str(&w, c->name, sizeof c->name);
    codec_w_str(&w, c->job_id, sizeof c->job_id);
    codec_w_u32(&w, c->rank);
    codec_w_u32(&w, c->local_rank);
    codec_w_u32(&w, c->attached);
    codec_w_bytes(&w, c->device_uuid, sizeof c->device_uuid);
    codec_w_u64(&w, c->connected_ms);
    codec_w_u64(&w, c->attached_ms);
  }
  return codec_w_finish(&w);
}

int proto_decode_clients(const uint8_t *p, size_t len, struct dep_msg_clients *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  uint32_t n = codec_r_u32(&r);
  m->left_out = codec_r_u32(&r);
  if (r.bad || n > DEP_CLIENTS_MAX)
    return DEP_ERR_PROTOCOL;
  if (n > 0 && (m->clients = calloc(n, sizeof *m->clients)) == NULL)
    return DEP_ERR_NO_MEMORY;
  m->n = n;
  for (uint32_t i = 0; i < n && !r.bad; i++) {
    struct dep_msg_client *c = &m->clients[i];
    c->pid = codec_r_u32(&r);
    c->uid = codec_r_u32(&r);
    codec_r_str(&r, c->name, sizeof c->name);
    codec_r_str(&r, c->job_id, sizeof c->job_id);
    c->rank = codec_r_u32(&r);
    c->local_rank = codec_r_u32(&r);
    c->attached = codec_r_u32(&r);
    codec_r_bytes(&r, c->device_uuid, sizeof c->device_uuid);
    c->connected_ms = codec_r_u64(&r);
    c->attached_ms = codec_r_u64(&r);
  }
  int rc = codec_r_finish(&r);
  if (rc != 0)
    proto_clients_free(m);
  return rc;
}

void proto_clients_free(struct dep_msg_clients *m) {
  free(m->clients);
  m->clients = NULL;
  m->n = 0;
}
