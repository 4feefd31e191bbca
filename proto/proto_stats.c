/*
 * proto_stats.c — the bodies of the stats and clients messages (proto.h),
 * with the shared codec (codec.h), bounds-checked like the rest of the
 * control protocol: each record's fields are one table below, in wire
 * order, driving its encoder and its decoder.  STATS_LEND_OK and
 * XRING_LEND_OK are the same body (the page's or the ring's memfd rides on
 * it); STATS_RANK is its head, u32 n_ops (= DEP_STATS_WIRE_OPS) op records,
 * u64 layouts, u32 tokens_world (<= DEP_MAX_WORLD), tokens_world u32 (the
 * newest layout's tokens to each rank: 16 KiB at most), then its tail;
 * STATS_OK its head, then u32 n_pools (<= DEP_STATS_WIRE_POOLS) pool
 * records; CLIENTS_OK u32 n (<= DEP_CLIENTS_MAX), u32 left_out, then n
 * client records.  CLIENTS is empty.
 */
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "proto.h"
#include "stats_page.h"

_Static_assert(DEP_STATS_WIRE_OPS == DEP_STATS_NOPS, "the wire carries every op of stats_page.h");
/* A STATS_RANK of the largest world fits a frame, with room to spare for its fixed fields. */
_Static_assert(DEP_MAX_WORLD * sizeof(uint32_t) <= DEP_PROTO_MAX_BODY / 2,
               "the tokens of a world of DEP_MAX_WORLD fit a STATS_RANK");

static const struct codec_field lend_ok_fields[] = {
    CODEC_U32(struct dep_msg_lend_ok, version),
    CODEC_U32(struct dep_msg_lend_ok, bytes),
};

#define RANK_F(kind, m) CODEC_##kind(struct dep_msg_stats_rank, m)
static const struct codec_field stats_rank_head[] = {
    RANK_F(STR, job_id),           RANK_F(U32, rank),           RANK_F(U32, local_rank),
    RANK_F(U32, world),            RANK_F(U32, pid),            RANK_F(U32, uid),
    RANK_F(BYTES, device_uuid),    RANK_F(U32, finished),       RANK_F(U32, cuda),
    RANK_F(U64, age_ms),           RANK_F(U64, ended_ms),       RANK_F(U32, attached),
    RANK_F(U64, attach_total_ns),  RANK_F(U64, attach_wait_ns), RANK_F(U64, attach_map_ns),
    RANK_F(U64, attach_setup_ns),  RANK_F(U64, attach_warmup_ns), RANK_F(U64, dropped),
};
/* After the recent layouts. */
static const struct codec_field stats_rank_tail[] = {
    RANK_F(U32, kernel_ctas),
    RANK_F(U32, ctas_how),
};
#undef RANK_F

#define OP_F(m) CODEC_U64(struct dep_msg_stats_op, m)
static const struct codec_field stats_op[] = {
    OP_F(calls),         OP_F(first_ns), OP_F(steady_calls), OP_F(median_ns), OP_F(p99_ns),
    OP_F(steady_sum_ns), OP_F(bytes),    OP_F(errors),       OP_F(timeouts),
};
#undef OP_F

#define OK_F(kind, m) CODEC_##kind(struct dep_msg_stats_ok, m)
static const struct codec_field stats_ok_head[] = {
    OK_F(U32, ranks),            OK_F(U32, finished_jobs), OK_F(U32, keep_jobs),
    OK_F(U32, keep_s),           OK_F(U32, warn_ratio_milli), OK_F(U64, warnings),
    OK_F(STR, largest_job),      OK_F(BYTES, largest_uuid), OK_F(U64, largest_bytes),
    OK_F(U32, tokens_left_out),
};
#undef OK_F

static const struct codec_field stats_pool[] = {
    CODEC_BYTES(struct dep_msg_stats_pool, uuid),
    CODEC_U64(struct dep_msg_stats_pool, made_bytes),
};

#define CLIENT_F(kind, m) CODEC_##kind(struct dep_msg_client, m)
static const struct codec_field client_record[] = {
    CLIENT_F(U32, pid),        CLIENT_F(U32, uid),          CLIENT_F(STR, name),
    CLIENT_F(STR, job_id),     CLIENT_F(U32, rank),         CLIENT_F(U32, local_rank),
    CLIENT_F(U32, attached),   CLIENT_F(BYTES, device_uuid), CLIENT_F(U64, connected_ms),
    CLIENT_F(U64, attached_ms),
};
#undef CLIENT_F

static const struct codec_field stats_req_fields[] = {
    CODEC_STR(struct dep_msg_stats_req, job_id), /* "" for every job */
};
CODEC_BODY(lend_ok, struct dep_msg_lend_ok, lend_ok_fields, NULL, NULL)
CODEC_BODY(stats_req, struct dep_msg_stats_req, stats_req_fields, NULL, NULL)

int proto_encode_stats_rank(struct proto_buf *b, const struct dep_msg_stats_rank *m) {
  if (m->tokens_world > DEP_MAX_WORLD || (m->tokens_world > 0 && m->tokens == NULL))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, stats_rank_head, CODEC_NFIELDS(stats_rank_head), m);
  codec_w_u32(&w, DEP_STATS_WIRE_OPS);
  for (unsigned i = 0; i < DEP_STATS_WIRE_OPS; i++)
    codec_w_rec(&w, stats_op, CODEC_NFIELDS(stats_op), &m->ops[i]);
  codec_w_u64(&w, m->layouts);
  codec_w_u32(&w, m->tokens_world);
  for (uint32_t k = 0; k < m->tokens_world; k++)
    codec_w_u32(&w, m->tokens[k]);
  codec_w_rec(&w, stats_rank_tail, CODEC_NFIELDS(stats_rank_tail), m);
  return codec_w_finish(&w);
}

int proto_decode_stats_rank(const uint8_t *p, size_t len, struct dep_msg_stats_rank *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, stats_rank_head, CODEC_NFIELDS(stats_rank_head), m);
  if (codec_r_u32(&r) != DEP_STATS_WIRE_OPS)
    return DEP_ERR_PROTOCOL;
  for (unsigned i = 0; i < DEP_STATS_WIRE_OPS; i++)
    codec_r_rec(&r, stats_op, CODEC_NFIELDS(stats_op), &m->ops[i]);
  m->layouts = codec_r_u64(&r);
  uint32_t n = codec_r_u32(&r);
  /* Bounded before anything is allocated: by the largest world, and by the bytes there are. */
  if (r.bad || n > DEP_MAX_WORLD || n > r.left / sizeof(uint32_t))
    return DEP_ERR_PROTOCOL;
  if (n > 0 && (m->tokens = malloc((size_t)n * sizeof *m->tokens)) == NULL)
    return DEP_ERR_NO_MEMORY;
  m->tokens_world = n;
  for (uint32_t k = 0; k < n; k++)
    m->tokens[k] = codec_r_u32(&r);
  codec_r_rec(&r, stats_rank_tail, CODEC_NFIELDS(stats_rank_tail), m);
  int rc = codec_r_finish(&r);
  if (rc != 0)
    proto_stats_rank_free(m);
  return rc;
}

void proto_stats_rank_free(struct dep_msg_stats_rank *m) {
  free(m->tokens);
  m->tokens = NULL;
  m->tokens_world = 0;
}

int proto_encode_stats_ok(struct proto_buf *b, const struct dep_msg_stats_ok *m) {
  if (m->n_pools > DEP_STATS_WIRE_POOLS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, stats_ok_head, CODEC_NFIELDS(stats_ok_head), m);
  codec_w_u32(&w, m->n_pools);
  for (uint32_t i = 0; i < m->n_pools; i++)
    codec_w_rec(&w, stats_pool, CODEC_NFIELDS(stats_pool), &m->pools[i]);
  return codec_w_finish(&w);
}

int proto_decode_stats_ok(const uint8_t *p, size_t len, struct dep_msg_stats_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, stats_ok_head, CODEC_NFIELDS(stats_ok_head), m);
  m->n_pools = codec_r_u32(&r);
  if (r.bad || m->n_pools > DEP_STATS_WIRE_POOLS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_pools; i++)
    codec_r_rec(&r, stats_pool, CODEC_NFIELDS(stats_pool), &m->pools[i]);
  return codec_r_finish(&r);
}

int proto_encode_clients(struct proto_buf *b, const struct dep_msg_clients *m) {
  if (m->n > DEP_CLIENTS_MAX || (m->n > 0 && m->clients == NULL))
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_list(&w, m->n, m->left_out, client_record, CODEC_NFIELDS(client_record), m->clients,
               sizeof m->clients[0]);
  return codec_w_finish(&w);
}

int proto_decode_clients(const uint8_t *p, size_t len, struct dep_msg_clients *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  uint32_t n = 0;
  codec_r_list_head(&r, DEP_CLIENTS_MAX, client_record, CODEC_NFIELDS(client_record), &n,
                    &m->left_out);
  if (r.bad)
    return DEP_ERR_PROTOCOL;
  if (n > 0 && (m->clients = calloc(n, sizeof *m->clients)) == NULL)
    return DEP_ERR_NO_MEMORY;
  m->n = n;
  for (uint32_t i = 0; i < n && !r.bad; i++)
    codec_r_rec(&r, client_record, CODEC_NFIELDS(client_record), &m->clients[i]);
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
