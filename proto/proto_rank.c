/*
 * proto_rank.c — the bodies of what a rank's library asks of its daemon
 * (proto.h): ATTACH and its reply (one SLAB frame per device, then
 * ATTACH_OK), KERNELS and TUNE, with the shared codec (codec.h): each
 * body's fields are one table below, in wire order, driving its encoder and
 * its decoder, and the checks of the values beside them; a SLAB is its
 * head, then n_ranks (1..64) rank records.  KERNELS_OK's cubin fd rides on
 * its frame.  Then the attach fields' checks both ends run.
 */
#include <stdbool.h>
#include <string.h>

#include "codec.h"
#include "proto.h"
#include "shape.h"
#include "why.h"

/* ---- ATTACH / ATTACH_OK -------------------------------------------------- */

#define ATTACH_F(kind, m) CODEC_##kind(struct dep_attach_args, m)
static const struct codec_field attach_fields[] = {
    ATTACH_F(STR, job_id),           ATTACH_F(U32, rank),
    ATTACH_F(U32, world_size),       ATTACH_F(U32, local_rank),
    ATTACH_F(U32, local_world_size), ATTACH_F(BYTES, device_uuid),
    ATTACH_F(U32, shape.max_tokens_per_rank), ATTACH_F(U32, shape.hidden),
    ATTACH_F(U32, shape.num_experts), ATTACH_F(U32, shape.topk),
    ATTACH_F(U32, shape.dtype),      ATTACH_F(U32, shape.max_ll_tokens_per_rank),
    ATTACH_F(U32, flags),
};
#undef ATTACH_F

static const struct codec_field attach_ok_fields[] = {
    CODEC_U64(struct dep_msg_attach_ok, slab_bytes),
    CODEC_U32(struct dep_msg_attach_ok, local_world_size),
    CODEC_U32(struct dep_msg_attach_ok, num_fds),
    CODEC_STR(struct dep_msg_attach_ok, backend),
    CODEC_U32(struct dep_msg_attach_ok, op_timeout_ms),
    CODEC_U32(struct dep_msg_attach_ok, kernel_warmup), /* 0 or 1 */
    CODEC_U32(struct dep_msg_attach_ok, chunk_rows),
};

static const struct codec_field slab_head[] = {
    CODEC_U64(struct dep_msg_slab, chunk_bytes),  CODEC_U32(struct dep_msg_slab, n_chunks),
    CODEC_BYTES(struct dep_msg_slab, device_uuid), CODEC_U32(struct dep_msg_slab, n_ranks),
};

static const struct codec_field slab_rank[] = {
    CODEC_U32(struct dep_msg_slab_rank, local_rank),
    CODEC_U32(struct dep_msg_slab_rank, rank),
    CODEC_U64(struct dep_msg_slab_rank, offset),
};

static const struct codec_body attach_body = {attach_fields, CODEC_NFIELDS(attach_fields),
                                              sizeof(struct dep_attach_args), NULL, NULL};

int proto_encode_attach(struct proto_buf *b, const struct dep_attach_args *m) {
  return codec_body_encode(b, &attach_body, m);
}

/* Only the framing is checked here; the receiver runs proto_check_attach so
 * it can answer a bad field with a message naming it. */
int proto_decode_attach(const uint8_t *p, size_t len, struct dep_attach_args *m) {
  int rc = codec_body_decode(p, len, &attach_body, m);
  m->size = sizeof *m; /* not on the wire: this library's own layout */
  return rc;
}

/* The fds that ride on it fit one frame; the kernel warm-up is 0 or 1,
 * which the receiver checks (the sender checks the fds alone). */
static bool attach_ok_send_check(const void *rec) {
  return ((const struct dep_msg_attach_ok *)rec)->num_fds <= DEP_PROTO_MAX_FDS;
}
static bool attach_ok_check(const void *rec) {
  const struct dep_msg_attach_ok *m = rec;
  return m->num_fds <= DEP_PROTO_MAX_FDS && m->kernel_warmup <= 1;
}
CODEC_BODY(attach_ok, struct dep_msg_attach_ok, attach_ok_fields, attach_ok_send_check,
           attach_ok_check)

int proto_encode_slab(struct proto_buf *b, const struct dep_msg_slab *m) {
  if (m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->n_ranks == 0 ||
      m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, slab_head, CODEC_NFIELDS(slab_head), m);
  for (uint32_t i = 0; i < m->n_ranks && !w.err; i++)
    codec_w_rec(&w, slab_rank, CODEC_NFIELDS(slab_rank), &m->ranks[i]);
  return codec_w_finish(&w);
}

int proto_decode_slab(const uint8_t *p, size_t len, struct dep_msg_slab *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, slab_head, CODEC_NFIELDS(slab_head), m);
  if (r.bad || m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->chunk_bytes == 0 ||
      m->n_ranks == 0 || m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    codec_r_rec(&r, slab_rank, CODEC_NFIELDS(slab_rank), &m->ranks[i]);
    if (!r.bad && m->ranks[i].local_rank >= DEP_MAX_LOCAL_RANKS)
      return DEP_ERR_PROTOCOL;
  }
  return codec_r_finish(&r);
}

/* ---- KERNELS, KERNELS_OK ------------------------------------------------------ */

static const struct codec_field kernels_fields[] = {
    CODEC_BYTES(struct dep_msg_kernels, device_uuid),
};

static const struct codec_field kernels_ok_fields[] = {
    CODEC_U32(struct dep_msg_kernels_ok, arch),  CODEC_I32(struct dep_msg_kernels_ok, driver),
    CODEC_STR(struct dep_msg_kernels_ok, build), /* 64 hex digits */
    CODEC_U64(struct dep_msg_kernels_ok, bytes), /* 1..DEP_KERNELS_MAX_BYTES */
};

/* ---- TUNE, TUNE_OK -------------------------------------------------------------- */

static const struct codec_field tune_fields[] = {
    CODEC_U32(struct dep_msg_tune, sms), /* 1..DEP_TUNE_MAX_SMS */
    CODEC_U32(struct dep_msg_tune, env_ctas),
};

static const struct codec_field tune_ok_fields[] = {
    CODEC_U32(struct dep_msg_tune_ok, ctas),
    CODEC_U32(struct dep_msg_tune_ok, how), /* 1..DEP_TUNE_HOW_MAX */
};

/* ---- their checks and codecs ------------------------------------------------------ */

static bool kernels_build_ok(const char *s) {
  if (strlen(s) != 64)
    return false;
  for (; *s != '\0'; s++)
    if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f')))
      return false;
  return true;
}

static bool kernels_ok_check(const void *rec) {
  const struct dep_msg_kernels_ok *m = rec;
  return kernels_build_ok(m->build) && m->bytes > 0 && m->bytes <= DEP_KERNELS_MAX_BYTES;
}

/* The daemon checks the SMs a rank asks with (the decoder); a TUNE_OK's how
 * is checked on both sides. */
static bool tune_check(const void *rec) {
  const struct dep_msg_tune *m = rec;
  return m->sms >= 1 && m->sms <= DEP_TUNE_MAX_SMS;
}
static bool tune_ok_check(const void *rec) {
  const struct dep_msg_tune_ok *m = rec;
  return m->how >= 1 && m->how <= DEP_TUNE_HOW_MAX;
}

CODEC_BODY(kernels, struct dep_msg_kernels, kernels_fields, NULL, NULL)
CODEC_BODY(kernels_ok, struct dep_msg_kernels_ok, kernels_ok_fields, kernels_ok_check,
           kernels_ok_check)
CODEC_BODY(tune, struct dep_msg_tune, tune_fields, NULL, tune_check)
CODEC_BODY(tune_ok, struct dep_msg_tune_ok, tune_ok_fields, tune_ok_check, tune_ok_check)

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
  if ((a->flags & ~(uint32_t)DEP_ATTACH_FLAGS_KNOWN) != 0) {
    why_set(why, whylen, "flags 0x%x hold bits this deepepd does not know (known: 0x%x, "
            "DEP_ATTACH_ELASTIC); run the same deepep version as the daemon",
            a->flags, (unsigned)DEP_ATTACH_FLAGS_KNOWN);
    return DEP_ERR_INVALID;
  }
  return 0;
}
