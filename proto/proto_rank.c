/*
 * proto_rank.c — the bodies of what a rank's library asks of its daemon
 * (proto.h): ATTACH and its reply (one SLAB frame per device, then
 * ATTACH_OK), KERNELS and TUNE, field by field with the shared codec
 * (codec.h), and the attach fields' checks both ends run:
 *
 *   ATTACH     str job_id (<= 63), u32 rank, u32 world_size, u32 local_rank,
 *              u32 local_world_size, 16 bytes device_uuid,
 *              u32 max_tokens_per_rank, u32 hidden, u32 num_experts,
 *              u32 topk, u32 dtype, u32 max_ll_tokens_per_rank
 *   ATTACH_OK  u64 slab_bytes, u32 local_world_size, u32 num_fds (<= 250),
 *              str backend (<= 7), u32 op_timeout_ms, u32 kernel_warmup (0/1)
 *   SLAB       u64 chunk_bytes, u32 n_chunks (1..250), 16 bytes device_uuid,
 *              u32 n_ranks (1..64), n_ranks x {u32 local_rank, u32 rank,
 *              u64 offset}
 *   KERNELS    16 bytes device_uuid
 *   KERNELS_OK u32 arch, i32 driver, str build (64 hex digits), u64 bytes
 *              (1..DEP_KERNELS_MAX_BYTES); the cubin's fd rides on it
 *   TUNE       u32 sms (1..DEP_TUNE_MAX_SMS), u32 env_ctas
 *   TUNE_OK    u32 ctas, u32 how (1..DEP_TUNE_HOW_MAX)
 */
#include <stdbool.h>
#include <string.h>

#include "codec.h"
#include "proto.h"
#include "shape.h"
#include "why.h"

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
