/*
 * proto.c — the deepepd control protocol codec (DESIGN §8, proto.h): the
 * frame header, one encoder and one decoder per message body, and the field
 * checks both ends share.  Everything is packed byte by byte in
 * little-endian order, so the wire format does not depend on the compiler's
 * struct layout or the host's byte order.
 *
 * Body layouts (strings are u16 length + bytes, no NUL):
 *   ERROR      i32 code (< 0), str message (<= 511)
 *   HELLO      u32 version, u32 pid, str name (<= 63)
 *   HELLO_OK   u32 version, str daemon_version (<= 31), str backend (<= 7)
 *   STATUS_OK  str version (<= 31), u32 proto_version, u32 pid, u64 uptime_ms,
 *              str backend (<= 7), str state (<= 15), u32 num_clients, u32 num_devices,
 *              u32 num_jobs, then num_devices device records, then num_jobs
 *              job records
 *     device   str uuid (<= 36), str name (<= 63), str backend (<= 7),
 *              u64 pool_total_bytes, u64 pool_used_bytes, u64 pool_cached_bytes,
 *              u64 pool_held_bytes
 *     job      str job_id (<= 63), u32 owner_uid, u32 ranks_attached,
 *              u32 ranks_expected, u32 world_size, u64 slab_bytes, u64 age_ms
 *   ATTACH     str job_id (<= 63), u32 rank, u32 world_size, u32 local_rank,
 *              u32 local_world_size, 16 bytes device_uuid,
 *              u32 max_tokens_per_rank, u32 hidden, u32 num_experts,
 *              u32 topk, u32 dtype, u32 max_ll_tokens_per_rank
 *   ATTACH_OK  u64 slab_bytes, u32 local_world_size, u32 num_fds (<= 250),
 *              str backend (<= 7), u32 op_timeout_ms, u32 kernel_warmup (0/1)
 *   SLAB       u64 chunk_bytes, u32 n_chunks (1..250), 16 bytes device_uuid,
 *              u32 n_ranks (1..64), n_ranks x {u32 local_rank, u32 rank,
 *              u64 offset}
 *   RELOAD_OK, DRAIN_OK  str text (<= 511)
 *   DRAIN      u32 drain (0 or 1)
 *   PEERS_OK   str node (<= 63), str listen (<= 271), u32 auth (0/1), str rdma
 *              (<= 511), u64 nic_bytes, u32 n_peers (<= 64), then n_peers records:
 *     peer     str address (<= 271), str node (<= 63), str state (<= 15),
 *              str transport (<= 7), str wanted (<= 7), str last_error (<= 511),
 *              u32 conns_up, u32 conns_total, u32 inbound_up, u32 qps_up,
 *              u64 reconnects, u64 bytes_in, u64 bytes_out, u64 rtt_us,
 *              u64 backoff_ms, u64 rdma_rtt_us
 *   PEER       the bytes of one peer protocol message (peer_proto.h), passed through
 *   JOB_NODES_OK  u32 n (<= 256), then n records: str job_id (<= 63),
 *              u32 world_size, u32 local_ranks, u32 remote_ranks, u32 nodes
 *   STATS_LEND_OK, STATS, STATS_RANK, STATS_OK, CLIENTS_OK: proto_stats.c
 *   KERNELS    16 bytes device_uuid
 *   KERNELS_OK u32 arch, i32 driver, str build (64 hex digits), u64 bytes
 *              (1..DEP_KERNELS_MAX_BYTES); the cubin's fd rides on it
 *   STATUS, DETACH, DETACH_OK, SHUTDOWN, RELOAD, PEERS, JOB_NODES, STATS_LEND,
 *   CLIENTS: empty
 */
#include "proto.h"
#include "codec.h"
#include "why.h"
#include "shape.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The smallest encoding of a status record: three empty strings + 4 u64,
 * and an empty string + 4 u32 + 2 u64.  Counts are bounded by these before
 * anything is allocated, so a tiny frame cannot ask for a huge array. */
#define STATUS_DEVICE_MIN (3 * 2 + 4 * 8)
#define STATUS_JOB_MIN (2 + 4 * 4 + 2 * 8)


/* ---- header -------------------------------------------------------------- */

void proto_hdr_encode(const struct dep_frame_hdr *h, uint8_t out[DEP_PROTO_HDR_LEN]) {
  codec_put_u32(out + 0, h->magic);
  codec_put_u16(out + 4, h->version);
  codec_put_u16(out + 6, h->type);
  codec_put_u32(out + 8, h->flags);
  codec_put_u32(out + 12, h->request_id);
  codec_put_u32(out + 16, h->body_len);
  codec_put_u32(out + 20, 0); /* reserved */
}

int proto_hdr_decode(const uint8_t in[DEP_PROTO_HDR_LEN], uint32_t max_body,
                     struct dep_frame_hdr *h, char *why, size_t whylen) {
  h->magic = codec_get_u32(in + 0);
  h->version = codec_get_u16(in + 4);
  h->type = codec_get_u16(in + 6);
  h->flags = codec_get_u32(in + 8);
  h->request_id = codec_get_u32(in + 12);
  h->body_len = codec_get_u32(in + 16);
  uint32_t reserved = codec_get_u32(in + 20);

  if (h->magic != DEP_PROTO_MAGIC) {
    why_set(why, whylen,
            "bad frame magic 0x%08x (expected 0x%08x): the peer is not speaking the deepepd "
            "protocol",
            h->magic, DEP_PROTO_MAGIC);
    return DEP_ERR_PROTOCOL;
  }
  if (h->version != DEP_PROTO_VERSION) {
    why_set(why, whylen,
            "peer speaks protocol version %u, this build speaks %u: upgrade deepepd and "
            "libdeepep-client together",
            (unsigned)h->version, (unsigned)DEP_PROTO_VERSION);
    return DEP_ERR_VERSION;
  }
  if (h->type == 0 || h->type >= DEP_MSG_TYPE_MAX_) {
    why_set(why, whylen, "unknown message type %u (known: 1..%u)", (unsigned)h->type,
            (unsigned)(DEP_MSG_TYPE_MAX_ - 1));
    return DEP_ERR_PROTOCOL;
  }
  if ((h->flags & ~DEP_FRAME_F_KNOWN) != 0) {
    why_set(why, whylen, "unknown frame flags 0x%08x on a %s frame (known: 0x%08x)", h->flags,
            proto_type_name(h->type), DEP_FRAME_F_KNOWN);
    return DEP_ERR_PROTOCOL;
  }
  if (h->body_len > max_body) {
    why_set(why, whylen, "%s frame body of %u bytes exceeds the limit of %u bytes",
            proto_type_name(h->type), h->body_len, max_body);
    return DEP_ERR_PROTOCOL;
  }
  if (reserved != 0) {
    why_set(why, whylen, "reserved header field is 0x%08x, must be zero", reserved);
    return DEP_ERR_PROTOCOL;
  }
  return 0;
}

/* ---- growable buffer ----------------------------------------------------- */

void proto_buf_init(struct proto_buf *b) {
  b->data = NULL;
  b->len = 0;
  b->cap = 0;
}

void proto_buf_free(struct proto_buf *b) {
  free(b->data);
  proto_buf_init(b);
}

void proto_buf_reset(struct proto_buf *b) { b->len = 0; }

/* ---- ERROR --------------------------------------------------------------- */

int proto_encode_error(struct proto_buf *b, const struct dep_msg_error *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->code >= 0) /* an error reply always carries a failure code */
    return DEP_ERR_INVALID;
  codec_w_i32(&w, m->code);
  codec_w_str(&w, m->message, sizeof m->message);
  return codec_w_finish(&w);
}

int proto_decode_error(const uint8_t *p, size_t len, struct dep_msg_error *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->code = codec_r_i32(&r);
  codec_r_str(&r, m->message, sizeof m->message);
  if (!r.bad && m->code >= 0)
    return DEP_ERR_PROTOCOL;
  return codec_r_finish(&r);
}

/* ---- HELLO / HELLO_OK ---------------------------------------------------- */

int proto_encode_hello(struct proto_buf *b, const struct dep_msg_hello *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->version);
  codec_w_u32(&w, m->pid);
  codec_w_str(&w, m->name, sizeof m->name);
  return codec_w_finish(&w);
}

int proto_decode_hello(const uint8_t *p, size_t len, struct dep_msg_hello *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->version = codec_r_u32(&r);
  m->pid = codec_r_u32(&r);
  codec_r_str(&r, m->name, sizeof m->name);
  return codec_r_finish(&r);
}

int proto_encode_hello_ok(struct proto_buf *b, const struct dep_msg_hello_ok *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->version);
  codec_w_str(&w, m->daemon_version, sizeof m->daemon_version);
  codec_w_str(&w, m->backend, sizeof m->backend);
  return codec_w_finish(&w);
}

int proto_decode_hello_ok(const uint8_t *p, size_t len, struct dep_msg_hello_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->version = codec_r_u32(&r);
  codec_r_str(&r, m->daemon_version, sizeof m->daemon_version);
  codec_r_str(&r, m->backend, sizeof m->backend);
  return codec_r_finish(&r);
}

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

/* ---- ATTACH / ATTACH_OK -------------------------------------------------- */

int proto_encode_attach(struct proto_buf *b, const struct dep_attach_args *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_str(&w, m->job_id, sizeof m->job_id);
  codec_w_u32(&w, m->rank);
  codec_w_u32(&w, m->world_size);
  codec_w_u32(&w, m->local_rank);
  codec_w_u32(&w, m->local_world_size);
  codec_w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  codec_w_u32(&w, m->shape.max_tokens_per_rank);
  codec_w_u32(&w, m->shape.hidden);
  codec_w_u32(&w, m->shape.num_experts);
  codec_w_u32(&w, m->shape.topk);
  codec_w_u32(&w, m->shape.dtype);
  codec_w_u32(&w, m->shape.max_ll_tokens_per_rank);
  return codec_w_finish(&w);
}

/* Only the framing is checked here; the receiver runs proto_check_attach so
 * it can answer a bad field with a message naming it. */
int proto_decode_attach(const uint8_t *p, size_t len, struct dep_attach_args *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->size = sizeof *m; /* not on the wire: this library's own layout */
  codec_r_str(&r, m->job_id, sizeof m->job_id);
  m->rank = codec_r_u32(&r);
  m->world_size = codec_r_u32(&r);
  m->local_rank = codec_r_u32(&r);
  m->local_world_size = codec_r_u32(&r);
  codec_r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  m->shape.max_tokens_per_rank = codec_r_u32(&r);
  m->shape.hidden = codec_r_u32(&r);
  m->shape.num_experts = codec_r_u32(&r);
  m->shape.topk = codec_r_u32(&r);
  m->shape.dtype = codec_r_u32(&r);
  m->shape.max_ll_tokens_per_rank = codec_r_u32(&r);
  return codec_r_finish(&r);
}

int proto_encode_attach_ok(struct proto_buf *b, const struct dep_msg_attach_ok *m) {
  if (m->num_fds > DEP_PROTO_MAX_FDS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u64(&w, m->slab_bytes);
  codec_w_u32(&w, m->local_world_size);
  codec_w_u32(&w, m->num_fds);
  codec_w_str(&w, m->backend, sizeof m->backend);
  codec_w_u32(&w, m->op_timeout_ms);
  codec_w_u32(&w, m->kernel_warmup);
  return codec_w_finish(&w);
}

int proto_decode_attach_ok(const uint8_t *p, size_t len, struct dep_msg_attach_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->slab_bytes = codec_r_u64(&r);
  m->local_world_size = codec_r_u32(&r);
  m->num_fds = codec_r_u32(&r);
  codec_r_str(&r, m->backend, sizeof m->backend);
  m->op_timeout_ms = codec_r_u32(&r);
  m->kernel_warmup = codec_r_u32(&r);
  if (!r.bad && (m->num_fds > DEP_PROTO_MAX_FDS || m->kernel_warmup > 1))
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

int proto_encode_slab(struct proto_buf *b, const struct dep_msg_slab *m) {
  if (m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->n_ranks == 0 ||
      m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u64(&w, m->chunk_bytes);
  codec_w_u32(&w, m->n_chunks);
  codec_w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  codec_w_u32(&w, m->n_ranks);
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    codec_w_u32(&w, m->ranks[i].local_rank);
    codec_w_u32(&w, m->ranks[i].rank);
    codec_w_u64(&w, m->ranks[i].offset);
  }
  return codec_w_finish(&w);
}

int proto_decode_slab(const uint8_t *p, size_t len, struct dep_msg_slab *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->chunk_bytes = codec_r_u64(&r);
  m->n_chunks = codec_r_u32(&r);
  codec_r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  m->n_ranks = codec_r_u32(&r);
  if (r.bad || m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->chunk_bytes == 0 ||
      m->n_ranks == 0 || m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    m->ranks[i].local_rank = codec_r_u32(&r);
    m->ranks[i].rank = codec_r_u32(&r);
    m->ranks[i].offset = codec_r_u64(&r);
    if (!r.bad && m->ranks[i].local_rank >= DEP_MAX_LOCAL_RANKS)
      return DEP_ERR_PROTOCOL;
  }
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

/* ---- PEER: passed through ---------------------------------------------------- */

int proto_encode_opaque(struct proto_buf *b, const struct dep_msg_opaque *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->len > 0 && m->data == NULL)
    return DEP_ERR_INVALID;
  codec_w_bytes(&w, m->data, m->len);
  return codec_w_finish(&w);
}

int proto_decode_opaque(const uint8_t *p, size_t len, struct dep_msg_opaque *m) {
  m->data = p;
  m->len = len;
  return 0;
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

/* ---- KERNELS, KERNELS_OK ------------------------------------------------------ */

int proto_encode_kernels(struct proto_buf *b, const struct dep_msg_kernels *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  return codec_w_finish(&w);
}

int proto_decode_kernels(const uint8_t *p, size_t len, struct dep_msg_kernels *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  codec_r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  return codec_r_finish(&r);
}

static bool kernels_build_ok(const char *s) {
  if (strlen(s) != 64)
    return false;
  for (; *s != '\0'; s++)
    if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f')))
      return false;
  return true;
}

int proto_encode_kernels_ok(struct proto_buf *b, const struct dep_msg_kernels_ok *m) {
  if (!kernels_build_ok(m->build) || m->bytes == 0 || m->bytes > DEP_KERNELS_MAX_BYTES)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->arch);
  codec_w_i32(&w, m->driver);
  codec_w_str(&w, m->build, sizeof m->build);
  codec_w_u64(&w, m->bytes);
  return codec_w_finish(&w);
}

int proto_decode_kernels_ok(const uint8_t *p, size_t len, struct dep_msg_kernels_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->arch = codec_r_u32(&r);
  m->driver = codec_r_i32(&r);
  codec_r_str(&r, m->build, sizeof m->build);
  m->bytes = codec_r_u64(&r);
  int rc = codec_r_finish(&r);
  if (rc == 0 && (!kernels_build_ok(m->build) || m->bytes == 0 || m->bytes > DEP_KERNELS_MAX_BYTES))
    rc = DEP_ERR_PROTOCOL;
  return rc;
}

/* ---- TUNE, TUNE_OK -------------------------------------------------------------- */

int proto_encode_tune(struct proto_buf *b, const struct dep_msg_tune *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->sms);
  codec_w_u32(&w, m->env_ctas);
  return codec_w_finish(&w);
}

int proto_decode_tune(const uint8_t *p, size_t len, struct dep_msg_tune *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  m->sms = codec_r_u32(&r);
  m->env_ctas = codec_r_u32(&r);
  int rc = codec_r_finish(&r);
  if (rc == 0 && (m->sms < 1 || m->sms > DEP_TUNE_MAX_SMS))
    rc = DEP_ERR_PROTOCOL;
  return rc;
}

int proto_encode_tune_ok(struct proto_buf *b, const struct dep_msg_tune_ok *m) {
  if (m->how < 1 || m->how > DEP_TUNE_HOW_MAX)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->ctas);
  codec_w_u32(&w, m->how);
  return codec_w_finish(&w);
}

int proto_decode_tune_ok(const uint8_t *p, size_t len, struct dep_msg_tune_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  m->ctas = codec_r_u32(&r);
  m->how = codec_r_u32(&r);
  int rc = codec_r_finish(&r);
  if (rc == 0 && (m->how < 1 || m->how > DEP_TUNE_HOW_MAX))
    rc = DEP_ERR_PROTOCOL;
  return rc;
}

const char *proto_tune_how_name(uint32_t how) {
  static const char *const names[DEP_TUNE_HOW_MAX + 1] = {
      [DEP_TUNE_HOW_NONE] = "-",           [DEP_TUNE_HOW_DEFAULT] = "default",
      [DEP_TUNE_HOW_PENDING] = "default-measuring", [DEP_TUNE_HOW_MEASURED] = "measured",
      [DEP_TUNE_HOW_ENV] = "env",          [DEP_TUNE_HOW_FAILED] = "default-failed"};
  return how <= DEP_TUNE_HOW_MAX ? names[how] : "?";
}

/* ---- frames and dispatch ------------------------------------------------- */

static bool type_has_empty_body(uint16_t type) {
  return type == DEP_MSG_STATUS || type == DEP_MSG_DETACH || type == DEP_MSG_DETACH_OK ||
         type == DEP_MSG_SHUTDOWN || type == DEP_MSG_RELOAD || type == DEP_MSG_PEERS ||
         type == DEP_MSG_JOB_NODES || type == DEP_MSG_STATS_LEND || type == DEP_MSG_CLIENTS ||
         type == DEP_MSG_XRING_LEND;
}

static int body_encode(struct proto_buf *b, uint16_t type, const void *msg) {
  if (type_has_empty_body(type))
    return 0;
  if (msg == NULL)
    return DEP_ERR_INVALID;
  switch (type) {
  case DEP_MSG_ERROR:
    return proto_encode_error(b, msg);
  case DEP_MSG_HELLO:
    return proto_encode_hello(b, msg);
  case DEP_MSG_HELLO_OK:
    return proto_encode_hello_ok(b, msg);
  case DEP_MSG_STATUS_OK:
    return proto_encode_status(b, msg);
  case DEP_MSG_ATTACH:
    return proto_encode_attach(b, msg);
  case DEP_MSG_ATTACH_OK:
    return proto_encode_attach_ok(b, msg);
  case DEP_MSG_SLAB:
    return proto_encode_slab(b, msg);
  case DEP_MSG_RELOAD_OK:
  case DEP_MSG_DRAIN_OK:
    return proto_encode_text(b, msg);
  case DEP_MSG_DRAIN:
    return proto_encode_drain(b, msg);
  case DEP_MSG_PEERS_OK:
    return proto_encode_peers(b, msg);
  case DEP_MSG_PEER:
    return proto_encode_opaque(b, msg);
  case DEP_MSG_JOB_NODES_OK:
    return proto_encode_job_nodes(b, msg);
  case DEP_MSG_KERNELS:
    return proto_encode_kernels(b, msg);
  case DEP_MSG_KERNELS_OK:
    return proto_encode_kernels_ok(b, msg);
  case DEP_MSG_TUNE:
    return proto_encode_tune(b, msg);
  case DEP_MSG_TUNE_OK:
    return proto_encode_tune_ok(b, msg);
  case DEP_MSG_STATS_LEND_OK:
  case DEP_MSG_XRING_LEND_OK:
    return proto_encode_lend_ok(b, msg);
  case DEP_MSG_STATS:
    return proto_encode_stats_req(b, msg);
  case DEP_MSG_STATS_RANK:
    return proto_encode_stats_rank(b, msg);
  case DEP_MSG_STATS_OK:
    return proto_encode_stats_ok(b, msg);
  case DEP_MSG_CLIENTS_OK:
    return proto_encode_clients(b, msg);
  default:
    return DEP_ERR_INVALID;
  }
}

/* Appends the frame after whatever b already holds, so several frames can
 * be queued in one buffer; on failure b is left as it was. */
int proto_frame_encode(struct proto_buf *b, uint16_t type, uint32_t flags,
                       uint32_t request_id, const void *msg) {
  if (type == 0 || type >= DEP_MSG_TYPE_MAX_ || (flags & ~DEP_FRAME_F_KNOWN) != 0)
    return DEP_ERR_INVALID;
  size_t start = b->len;
  if (codec_grow(b, DEP_PROTO_HDR_LEN) == NULL)
    return DEP_ERR_NO_MEMORY;
  int rc = body_encode(b, type, msg);
  size_t body_len = b->len - start - DEP_PROTO_HDR_LEN;
  if (rc == 0 && body_len > DEP_PROTO_MAX_BODY)
    rc = DEP_ERR_INVALID;
  if (rc != 0) {
    b->len = start;
    return rc;
  }
  struct dep_frame_hdr h = {
      .magic = DEP_PROTO_MAGIC,
      .version = DEP_PROTO_VERSION,
      .type = type,
      .flags = flags,
      .request_id = request_id,
      .body_len = (uint32_t)body_len,
  };
  proto_hdr_encode(&h, b->data + start);
  return 0;
}

int proto_body_decode(uint16_t type, const uint8_t *body, size_t len, void *msg) {
  if (type_has_empty_body(type))
    return len == 0 ? 0 : DEP_ERR_PROTOCOL;
  if (msg == NULL)
    return DEP_ERR_INVALID;
  switch (type) {
  case DEP_MSG_ERROR:
    return proto_decode_error(body, len, msg);
  case DEP_MSG_HELLO:
    return proto_decode_hello(body, len, msg);
  case DEP_MSG_HELLO_OK:
    return proto_decode_hello_ok(body, len, msg);
  case DEP_MSG_STATUS_OK:
    return proto_decode_status(body, len, msg);
  case DEP_MSG_ATTACH:
    return proto_decode_attach(body, len, msg);
  case DEP_MSG_ATTACH_OK:
    return proto_decode_attach_ok(body, len, msg);
  case DEP_MSG_SLAB:
    return proto_decode_slab(body, len, msg);
  case DEP_MSG_RELOAD_OK:
  case DEP_MSG_DRAIN_OK:
    return proto_decode_text(body, len, msg);
  case DEP_MSG_DRAIN:
    return proto_decode_drain(body, len, msg);
  /* PEERS_OK allocates: its callers decode it with proto_decode_peers. */
  case DEP_MSG_PEER:
    return proto_decode_opaque(body, len, msg);
  /* JOB_NODES_OK is large (a fixed array): its callers decode it with
   * proto_decode_job_nodes into memory of their own. */
  case DEP_MSG_KERNELS:
    return proto_decode_kernels(body, len, msg);
  case DEP_MSG_KERNELS_OK:
    return proto_decode_kernels_ok(body, len, msg);
  case DEP_MSG_TUNE:
    return proto_decode_tune(body, len, msg);
  case DEP_MSG_TUNE_OK:
    return proto_decode_tune_ok(body, len, msg);
  case DEP_MSG_STATS_LEND_OK:
  case DEP_MSG_XRING_LEND_OK:
    return proto_decode_lend_ok(body, len, msg);
  case DEP_MSG_STATS:
    return proto_decode_stats_req(body, len, msg);
  case DEP_MSG_STATS_RANK:
    return proto_decode_stats_rank(body, len, msg);
  case DEP_MSG_STATS_OK:
    return proto_decode_stats_ok(body, len, msg);
  /* CLIENTS_OK allocates: its callers decode it with proto_decode_clients. */
  default:
    return DEP_ERR_PROTOCOL;
  }
}

const char *proto_type_name(uint16_t type) {
  static const char *const names[DEP_MSG_TYPE_MAX_] = {
      [DEP_MSG_ERROR] = "ERROR",         [DEP_MSG_HELLO] = "HELLO",
      [DEP_MSG_HELLO_OK] = "HELLO_OK",   [DEP_MSG_STATUS] = "STATUS",
      [DEP_MSG_STATUS_OK] = "STATUS_OK", [DEP_MSG_ATTACH] = "ATTACH",
      [DEP_MSG_ATTACH_OK] = "ATTACH_OK", [DEP_MSG_DETACH] = "DETACH",
      [DEP_MSG_DETACH_OK] = "DETACH_OK", [DEP_MSG_SHUTDOWN] = "SHUTDOWN",
      [DEP_MSG_SLAB] = "SLAB",           [DEP_MSG_RELOAD] = "RELOAD",
      [DEP_MSG_RELOAD_OK] = "RELOAD_OK", [DEP_MSG_DRAIN] = "DRAIN",
      [DEP_MSG_DRAIN_OK] = "DRAIN_OK",   [DEP_MSG_PEERS] = "PEERS",
      [DEP_MSG_PEERS_OK] = "PEERS_OK",   [DEP_MSG_PEER] = "PEER",
      [DEP_MSG_JOB_NODES] = "JOB_NODES", [DEP_MSG_JOB_NODES_OK] = "JOB_NODES_OK",
      [DEP_MSG_KERNELS] = "KERNELS",     [DEP_MSG_KERNELS_OK] = "KERNELS_OK",
      [DEP_MSG_STATS_LEND] = "STATS_LEND", [DEP_MSG_STATS_LEND_OK] = "STATS_LEND_OK",
      [DEP_MSG_XRING_LEND] = "XRING_LEND", [DEP_MSG_XRING_LEND_OK] = "XRING_LEND_OK",
      [DEP_MSG_STATS] = "STATS",         [DEP_MSG_STATS_RANK] = "STATS_RANK",
      [DEP_MSG_STATS_OK] = "STATS_OK",   [DEP_MSG_CLIENTS] = "CLIENTS",
      [DEP_MSG_CLIENTS_OK] = "CLIENTS_OK", [DEP_MSG_TUNE] = "TUNE",
      [DEP_MSG_TUNE_OK] = "TUNE_OK",
  };
  return type < DEP_MSG_TYPE_MAX_ && names[type] != NULL ? names[type] : "UNKNOWN";
}

/* ---- field checks -------------------------------------------------------- */

static bool job_id_char_ok(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == ':' || c == '-';
}

int proto_check_job_id(const char *id, char *why, size_t whylen) {
  if (id == NULL) {
    why_set(why, whylen, "job_id is missing: give 1..%d characters of [A-Za-z0-9._:-]",
            DEP_JOB_ID_MAX - 1);
    return DEP_ERR_INVALID;
  }
  size_t n = strnlen(id, DEP_JOB_ID_MAX);
  if (n == 0 || n >= DEP_JOB_ID_MAX) {
    why_set(why, whylen, "job_id length %s%zu is out of range (allowed 1..%d characters)",
            n >= DEP_JOB_ID_MAX ? "at least " : "", n, DEP_JOB_ID_MAX - 1);
    return DEP_ERR_INVALID;
  }
  for (size_t i = 0; i < n; i++) {
    if (!job_id_char_ok(id[i])) {
      unsigned char c = (unsigned char)id[i];
      why_set(why, whylen,
              "job_id \"%s\" has character 0x%02x at offset %zu (allowed: [A-Za-z0-9._:-])",
              id, c, i);
      return DEP_ERR_INVALID;
    }
  }
  return 0;
}

static int check_range(const char *field, uint32_t v, uint32_t lo, uint32_t hi, char *why,
                       size_t whylen) {
  if (v >= lo && v <= hi)
    return 0;
  why_set(why, whylen, "%s %u is out of range (allowed %u..%u)", field, v, lo, hi);
  return DEP_ERR_INVALID;
}

int proto_check_attach(const struct dep_attach_args *a, char *why, size_t whylen) {
  int rc;
  if (a == NULL) {
    why_set(why, whylen, "attach arguments are missing");
    return DEP_ERR_INVALID;
  }
  if ((rc = proto_check_job_id(a->job_id, why, whylen)) != 0)
    return rc;
  /* The shape with its world size, world_size first (shape.h's table). */
  if ((rc = dep__shape_check(&a->shape, a->world_size, why, whylen)) != 0)
    return rc;
  if (a->rank >= a->world_size) {
    why_set(why, whylen, "rank %u is out of range (allowed 0..%u for world_size %u)", a->rank,
            a->world_size - 1, a->world_size);
    return DEP_ERR_INVALID;
  }
  if ((rc = check_range("local_world_size", a->local_world_size, 1, DEP_MAX_LOCAL_RANKS, why,
                        whylen)) != 0)
    return rc;
  if (a->local_world_size > a->world_size) {
    why_set(why, whylen,
            "local_world_size %u exceeds world_size %u (allowed 1..%u for that world_size)",
            a->local_world_size, a->world_size, a->world_size);
    return DEP_ERR_INVALID;
  }
  if (a->local_rank >= a->local_world_size) {
    why_set(why, whylen, "local_rank %u is out of range (allowed 0..%u for local_world_size %u)",
            a->local_rank, a->local_world_size - 1, a->local_world_size);
    return DEP_ERR_INVALID;
  }
  return 0;
}
