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
 *   PEERS_OK   str node (<= 63), str listen (<= 271), u32 auth (0/1), u32 n_peers
 *              (<= 64), then n_peers records:
 *     peer     str address (<= 271), str node (<= 63), str state (<= 15),
 *              str transport (<= 7), str last_error (<= 511), u32 conns_up,
 *              u32 conns_total, u32 inbound_up, u64 reconnects, u64 bytes_in,
 *              u64 bytes_out, u64 rtt_us, u64 backoff_ms
 *   PEER       the bytes of one peer protocol message (peer_proto.h), passed through
 *   JOB_NODES_OK  u32 n (<= 256), then n records: str job_id (<= 63),
 *              u32 world_size, u32 local_ranks, u32 remote_ranks, u32 nodes
 *   STATUS, DETACH, DETACH_OK, SHUTDOWN, RELOAD, PEERS, JOB_NODES: empty
 */
#include "proto.h"
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

static void set_why(char *why, size_t whylen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_why(char *why, size_t whylen, const char *fmt, ...) {
  if (why == NULL || whylen == 0)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, whylen, fmt, ap);
  va_end(ap);
}

/* ---- little-endian packing ---------------------------------------------- */

static void put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
         ((uint32_t)p[3] << 24);
}

static uint64_t get_u64(const uint8_t *p) {
  return (uint64_t)get_u32(p) | ((uint64_t)get_u32(p + 4) << 32);
}

/* ---- header -------------------------------------------------------------- */

void proto_hdr_encode(const struct dep_frame_hdr *h, uint8_t out[DEP_PROTO_HDR_LEN]) {
  put_u32(out + 0, h->magic);
  put_u16(out + 4, h->version);
  put_u16(out + 6, h->type);
  put_u32(out + 8, h->flags);
  put_u32(out + 12, h->request_id);
  put_u32(out + 16, h->body_len);
  put_u32(out + 20, 0); /* reserved */
}

int proto_hdr_decode(const uint8_t in[DEP_PROTO_HDR_LEN], uint32_t max_body,
                     struct dep_frame_hdr *h, char *why, size_t whylen) {
  h->magic = get_u32(in + 0);
  h->version = get_u16(in + 4);
  h->type = get_u16(in + 6);
  h->flags = get_u32(in + 8);
  h->request_id = get_u32(in + 12);
  h->body_len = get_u32(in + 16);
  uint32_t reserved = get_u32(in + 20);

  if (h->magic != DEP_PROTO_MAGIC) {
    set_why(why, whylen,
            "bad frame magic 0x%08x (expected 0x%08x): the peer is not speaking the deepepd "
            "protocol",
            h->magic, DEP_PROTO_MAGIC);
    return DEP_ERR_PROTOCOL;
  }
  if (h->version != DEP_PROTO_VERSION) {
    set_why(why, whylen,
            "peer speaks protocol version %u, this build speaks %u: upgrade deepepd and "
            "libdeepep-client together",
            (unsigned)h->version, (unsigned)DEP_PROTO_VERSION);
    return DEP_ERR_VERSION;
  }
  if (h->type == 0 || h->type >= DEP_MSG_TYPE_MAX_) {
    set_why(why, whylen, "unknown message type %u (known: 1..%u)", (unsigned)h->type,
            (unsigned)(DEP_MSG_TYPE_MAX_ - 1));
    return DEP_ERR_PROTOCOL;
  }
  if ((h->flags & ~DEP_FRAME_F_KNOWN) != 0) {
    set_why(why, whylen, "unknown frame flags 0x%08x on a %s frame (known: 0x%08x)", h->flags,
            proto_type_name(h->type), DEP_FRAME_F_KNOWN);
    return DEP_ERR_PROTOCOL;
  }
  if (h->body_len > max_body) {
    set_why(why, whylen, "%s frame body of %u bytes exceeds the limit of %u bytes",
            proto_type_name(h->type), h->body_len, max_body);
    return DEP_ERR_PROTOCOL;
  }
  if (reserved != 0) {
    set_why(why, whylen, "reserved header field is 0x%08x, must be zero", reserved);
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

/* Make room for n more bytes and return where they go, or NULL. */
static uint8_t *buf_grow(struct proto_buf *b, size_t n) {
  if (n > SIZE_MAX - b->len)
    return NULL;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) {
      if (cap > SIZE_MAX / 2)
        return NULL;
      cap *= 2;
    }
    uint8_t *d = realloc(b->data, cap);
    if (d == NULL)
      return NULL;
    b->data = d;
    b->cap = cap;
  }
  uint8_t *p = b->data + b->len;
  b->len += n;
  return p;
}

/* ---- body writer: errors are sticky so encoders read straight through ---- */

struct writer {
  struct proto_buf *b;
  size_t start; /* b->len on entry: a failed encode is rolled back to it */
  int err;
};

static void w_init(struct writer *w, struct proto_buf *b) {
  w->b = b;
  w->start = b->len;
  w->err = 0;
}

static uint8_t *w_space(struct writer *w, size_t n) {
  if (w->err)
    return NULL;
  uint8_t *p = buf_grow(w->b, n);
  if (p == NULL)
    w->err = DEP_ERR_NO_MEMORY;
  return p;
}

static void w_u32(struct writer *w, uint32_t v) {
  uint8_t *p = w_space(w, 4);
  if (p)
    put_u32(p, v);
}

static void w_u64(struct writer *w, uint64_t v) {
  uint8_t *p = w_space(w, 8);
  if (p)
    put_u64(p, v);
}

static void w_i32(struct writer *w, int32_t v) { w_u32(w, (uint32_t)v); }

static void w_bytes(struct writer *w, const void *src, size_t n) {
  uint8_t *p = w_space(w, n);
  if (p && n)
    memcpy(p, src, n);
}

/* A string from a fixed char array of `size` bytes; it must hold its NUL,
 * and its length must fit what the decoder accepts (size - 1). */
static void w_str(struct writer *w, const char *s, size_t size) {
  if (w->err)
    return;
  size_t n = strnlen(s, size);
  if (n >= size || n > UINT16_MAX) {
    w->err = DEP_ERR_INVALID;
    return;
  }
  uint8_t *p = w_space(w, 2 + n);
  if (p) {
    put_u16(p, (uint16_t)n);
    memcpy(p + 2, s, n);
  }
}

static int w_finish(struct writer *w) {
  if (w->err)
    w->b->len = w->start;
  return w->err;
}

/* ---- body reader: also sticky; any failure is DEP_ERR_PROTOCOL ----------- */

struct reader {
  const uint8_t *p;
  size_t left;
  bool bad;
};

static const uint8_t *r_take(struct reader *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *p = r->p;
  r->p += n;
  r->left -= n;
  return p;
}

static uint32_t r_u32(struct reader *r) {
  const uint8_t *p = r_take(r, 4);
  return p ? get_u32(p) : 0;
}

static uint64_t r_u64(struct reader *r) {
  const uint8_t *p = r_take(r, 8);
  return p ? get_u64(p) : 0;
}

static int32_t r_i32(struct reader *r) {
  /* Two's complement reinterpretation without implementation-defined casts. */
  uint32_t u = r_u32(r);
  return u <= INT32_MAX ? (int32_t)u : -(int32_t)(UINT32_MAX - u) - 1;
}

static void r_bytes(struct reader *r, void *dst, size_t n) {
  const uint8_t *p = r_take(r, n);
  if (p)
    memcpy(dst, p, n);
}

/* A string into dst[size]: at most size - 1 bytes, no embedded NUL. */
static void r_str(struct reader *r, char *dst, size_t size) {
  dst[0] = '\0';
  const uint8_t *lp = r_take(r, 2);
  if (lp == NULL)
    return;
  size_t n = get_u16(lp);
  if (n >= size) {
    r->bad = true;
    return;
  }
  const uint8_t *s = r_take(r, n);
  if (s == NULL)
    return;
  if (memchr(s, '\0', n) != NULL) {
    r->bad = true;
    return;
  }
  memcpy(dst, s, n);
  dst[n] = '\0';
}

/* The body must be read exactly: trailing bytes are as wrong as missing ones. */
static int r_finish(const struct reader *r) {
  return (r->bad || r->left != 0) ? DEP_ERR_PROTOCOL : 0;
}

static void r_init(struct reader *r, const uint8_t *p, size_t len) {
  r->p = p;
  r->left = len;
  r->bad = false;
}

/* ---- ERROR --------------------------------------------------------------- */

int proto_encode_error(struct proto_buf *b, const struct dep_msg_error *m) {
  struct writer w;
  w_init(&w, b);
  if (m->code >= 0) /* an error reply always carries a failure code */
    return DEP_ERR_INVALID;
  w_i32(&w, m->code);
  w_str(&w, m->message, sizeof m->message);
  return w_finish(&w);
}

int proto_decode_error(const uint8_t *p, size_t len, struct dep_msg_error *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->code = r_i32(&r);
  r_str(&r, m->message, sizeof m->message);
  if (!r.bad && m->code >= 0)
    return DEP_ERR_PROTOCOL;
  return r_finish(&r);
}

/* ---- HELLO / HELLO_OK ---------------------------------------------------- */

int proto_encode_hello(struct proto_buf *b, const struct dep_msg_hello *m) {
  struct writer w;
  w_init(&w, b);
  w_u32(&w, m->version);
  w_u32(&w, m->pid);
  w_str(&w, m->name, sizeof m->name);
  return w_finish(&w);
}

int proto_decode_hello(const uint8_t *p, size_t len, struct dep_msg_hello *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->version = r_u32(&r);
  m->pid = r_u32(&r);
  r_str(&r, m->name, sizeof m->name);
  return r_finish(&r);
}

int proto_encode_hello_ok(struct proto_buf *b, const struct dep_msg_hello_ok *m) {
  struct writer w;
  w_init(&w, b);
  w_u32(&w, m->version);
  w_str(&w, m->daemon_version, sizeof m->daemon_version);
  w_str(&w, m->backend, sizeof m->backend);
  return w_finish(&w);
}

int proto_decode_hello_ok(const uint8_t *p, size_t len, struct dep_msg_hello_ok *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->version = r_u32(&r);
  r_str(&r, m->daemon_version, sizeof m->daemon_version);
  r_str(&r, m->backend, sizeof m->backend);
  return r_finish(&r);
}

/* ---- STATUS_OK ----------------------------------------------------------- */

int proto_encode_status(struct proto_buf *b, const struct dep_status *m) {
  if ((m->num_devices > 0 && m->devices == NULL) || (m->num_jobs > 0 && m->jobs == NULL))
    return DEP_ERR_INVALID;
  struct writer w;
  w_init(&w, b);
  w_str(&w, m->version, sizeof m->version);
  w_u32(&w, m->proto_version);
  w_u32(&w, m->pid);
  w_u64(&w, m->uptime_ms);
  w_str(&w, m->backend, sizeof m->backend);
  w_str(&w, m->state, sizeof m->state);
  w_u32(&w, m->num_clients);
  w_u32(&w, m->num_devices);
  w_u32(&w, m->num_jobs);
  for (uint32_t i = 0; i < m->num_devices && !w.err; i++) {
    const struct dep_status_device *d = &m->devices[i];
    w_str(&w, d->uuid, sizeof d->uuid);
    w_str(&w, d->name, sizeof d->name);
    w_str(&w, d->backend, sizeof d->backend);
    w_u64(&w, d->pool_total_bytes);
    w_u64(&w, d->pool_used_bytes);
    w_u64(&w, d->pool_cached_bytes);
    w_u64(&w, d->pool_held_bytes);
  }
  for (uint32_t i = 0; i < m->num_jobs && !w.err; i++) {
    const struct dep_status_job *j = &m->jobs[i];
    w_str(&w, j->job_id, sizeof j->job_id);
    w_u32(&w, j->owner_uid);
    w_u32(&w, j->ranks_attached);
    w_u32(&w, j->ranks_expected);
    w_u32(&w, j->world_size);
    w_u64(&w, j->slab_bytes);
    w_u64(&w, j->age_ms);
  }
  return w_finish(&w);
}

int proto_decode_status(const uint8_t *p, size_t len, struct dep_status *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  r_str(&r, m->version, sizeof m->version);
  m->proto_version = r_u32(&r);
  m->pid = r_u32(&r);
  m->uptime_ms = r_u64(&r);
  r_str(&r, m->backend, sizeof m->backend);
  r_str(&r, m->state, sizeof m->state);
  m->num_clients = r_u32(&r);
  uint32_t ndev = r_u32(&r);
  uint32_t njob = r_u32(&r);
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
    r_str(&r, d->uuid, sizeof d->uuid);
    r_str(&r, d->name, sizeof d->name);
    r_str(&r, d->backend, sizeof d->backend);
    d->pool_total_bytes = r_u64(&r);
    d->pool_used_bytes = r_u64(&r);
    d->pool_cached_bytes = r_u64(&r);
    d->pool_held_bytes = r_u64(&r);
  }
  for (uint32_t i = 0; i < njob && !r.bad; i++) {
    struct dep_status_job *j = &m->jobs[i];
    r_str(&r, j->job_id, sizeof j->job_id);
    j->owner_uid = r_u32(&r);
    j->ranks_attached = r_u32(&r);
    j->ranks_expected = r_u32(&r);
    j->world_size = r_u32(&r);
    j->slab_bytes = r_u64(&r);
    j->age_ms = r_u64(&r);
  }
  int rc = r_finish(&r);
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
  struct writer w;
  w_init(&w, b);
  w_u32(&w, m->drain);
  return w_finish(&w);
}

int proto_decode_drain(const uint8_t *p, size_t len, struct dep_msg_drain *m) {
  struct reader r;
  r_init(&r, p, len);
  m->drain = r_u32(&r);
  if (!r.bad && m->drain > 1)
    return DEP_ERR_PROTOCOL;
  return r_finish(&r);
}

/* ---- ATTACH / ATTACH_OK -------------------------------------------------- */

int proto_encode_attach(struct proto_buf *b, const struct dep_attach_args *m) {
  struct writer w;
  w_init(&w, b);
  w_str(&w, m->job_id, sizeof m->job_id);
  w_u32(&w, m->rank);
  w_u32(&w, m->world_size);
  w_u32(&w, m->local_rank);
  w_u32(&w, m->local_world_size);
  w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  w_u32(&w, m->shape.max_tokens_per_rank);
  w_u32(&w, m->shape.hidden);
  w_u32(&w, m->shape.num_experts);
  w_u32(&w, m->shape.topk);
  w_u32(&w, m->shape.dtype);
  w_u32(&w, m->shape.max_ll_tokens_per_rank);
  return w_finish(&w);
}

/* Only the framing is checked here; the receiver runs proto_check_attach so
 * it can answer a bad field with a message naming it. */
int proto_decode_attach(const uint8_t *p, size_t len, struct dep_attach_args *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  r_str(&r, m->job_id, sizeof m->job_id);
  m->rank = r_u32(&r);
  m->world_size = r_u32(&r);
  m->local_rank = r_u32(&r);
  m->local_world_size = r_u32(&r);
  r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  m->shape.max_tokens_per_rank = r_u32(&r);
  m->shape.hidden = r_u32(&r);
  m->shape.num_experts = r_u32(&r);
  m->shape.topk = r_u32(&r);
  m->shape.dtype = r_u32(&r);
  m->shape.max_ll_tokens_per_rank = r_u32(&r);
  return r_finish(&r);
}

int proto_encode_attach_ok(struct proto_buf *b, const struct dep_msg_attach_ok *m) {
  if (m->num_fds > DEP_PROTO_MAX_FDS)
    return DEP_ERR_INVALID;
  struct writer w;
  w_init(&w, b);
  w_u64(&w, m->slab_bytes);
  w_u32(&w, m->local_world_size);
  w_u32(&w, m->num_fds);
  w_str(&w, m->backend, sizeof m->backend);
  w_u32(&w, m->op_timeout_ms);
  w_u32(&w, m->kernel_warmup);
  return w_finish(&w);
}

int proto_decode_attach_ok(const uint8_t *p, size_t len, struct dep_msg_attach_ok *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->slab_bytes = r_u64(&r);
  m->local_world_size = r_u32(&r);
  m->num_fds = r_u32(&r);
  r_str(&r, m->backend, sizeof m->backend);
  m->op_timeout_ms = r_u32(&r);
  m->kernel_warmup = r_u32(&r);
  if (!r.bad && (m->num_fds > DEP_PROTO_MAX_FDS || m->kernel_warmup > 1))
    return DEP_ERR_PROTOCOL;
  return r_finish(&r);
}

int proto_encode_text(struct proto_buf *b, const struct dep_msg_text *m) {
  struct writer w;
  w_init(&w, b);
  w_str(&w, m->text, sizeof m->text);
  return w_finish(&w);
}

int proto_decode_text(const uint8_t *p, size_t len, struct dep_msg_text *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  r_str(&r, m->text, sizeof m->text);
  return r_finish(&r);
}

int proto_encode_slab(struct proto_buf *b, const struct dep_msg_slab *m) {
  if (m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->n_ranks == 0 ||
      m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_INVALID;
  struct writer w;
  w_init(&w, b);
  w_u64(&w, m->chunk_bytes);
  w_u32(&w, m->n_chunks);
  w_bytes(&w, m->device_uuid, sizeof m->device_uuid);
  w_u32(&w, m->n_ranks);
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    w_u32(&w, m->ranks[i].local_rank);
    w_u32(&w, m->ranks[i].rank);
    w_u64(&w, m->ranks[i].offset);
  }
  return w_finish(&w);
}

int proto_decode_slab(const uint8_t *p, size_t len, struct dep_msg_slab *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  m->chunk_bytes = r_u64(&r);
  m->n_chunks = r_u32(&r);
  r_bytes(&r, m->device_uuid, sizeof m->device_uuid);
  m->n_ranks = r_u32(&r);
  if (r.bad || m->n_chunks == 0 || m->n_chunks > DEP_PROTO_MAX_FDS || m->chunk_bytes == 0 ||
      m->n_ranks == 0 || m->n_ranks > DEP_MAX_LOCAL_RANKS)
    return DEP_ERR_PROTOCOL;
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    m->ranks[i].local_rank = r_u32(&r);
    m->ranks[i].rank = r_u32(&r);
    m->ranks[i].offset = r_u64(&r);
    if (!r.bad && m->ranks[i].local_rank >= DEP_MAX_LOCAL_RANKS)
      return DEP_ERR_PROTOCOL;
  }
  return r_finish(&r);
}

/* ---- PEERS_OK --------------------------------------------------------------- */

/* The smallest peer record: five empty strings, 3 u32 and 5 u64. */
#define PEERS_RECORD_MIN (5 * 2 + 3 * 4 + 5 * 8)

int proto_encode_peers(struct proto_buf *b, const struct dep_msg_peers *m) {
  struct writer w;
  w_init(&w, b);
  if (m->n_peers > DEP_PEERS_MAX || (m->n_peers > 0 && m->peers == NULL) || m->auth > 1)
    return DEP_ERR_INVALID;
  w_str(&w, m->node, sizeof m->node);
  w_str(&w, m->listen, sizeof m->listen);
  w_u32(&w, m->auth);
  w_u32(&w, m->n_peers);
  for (uint32_t i = 0; i < m->n_peers; i++) {
    const struct dep_msg_peer_info *p = &m->peers[i];
    w_str(&w, p->address, sizeof p->address);
    w_str(&w, p->node, sizeof p->node);
    w_str(&w, p->state, sizeof p->state);
    w_str(&w, p->transport, sizeof p->transport);
    w_str(&w, p->last_error, sizeof p->last_error);
    w_u32(&w, p->conns_up);
    w_u32(&w, p->conns_total);
    w_u32(&w, p->inbound_up);
    w_u64(&w, p->reconnects);
    w_u64(&w, p->bytes_in);
    w_u64(&w, p->bytes_out);
    w_u64(&w, p->rtt_us);
    w_u64(&w, p->backoff_ms);
  }
  return w_finish(&w);
}

void proto_peers_free(struct dep_msg_peers *m) {
  free(m->peers);
  m->peers = NULL;
  m->n_peers = 0;
}

int proto_decode_peers(const uint8_t *p, size_t len, struct dep_msg_peers *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  r_str(&r, m->node, sizeof m->node);
  r_str(&r, m->listen, sizeof m->listen);
  m->auth = r_u32(&r);
  uint32_t n = r_u32(&r);
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
    r_str(&r, q->address, sizeof q->address);
    r_str(&r, q->node, sizeof q->node);
    r_str(&r, q->state, sizeof q->state);
    r_str(&r, q->transport, sizeof q->transport);
    r_str(&r, q->last_error, sizeof q->last_error);
    q->conns_up = r_u32(&r);
    q->conns_total = r_u32(&r);
    q->inbound_up = r_u32(&r);
    q->reconnects = r_u64(&r);
    q->bytes_in = r_u64(&r);
    q->bytes_out = r_u64(&r);
    q->rtt_us = r_u64(&r);
    q->backoff_ms = r_u64(&r);
  }
  int rc = r_finish(&r);
  if (rc != 0)
    proto_peers_free(m);
  return rc;
}

/* ---- PEER: passed through ---------------------------------------------------- */

int proto_encode_opaque(struct proto_buf *b, const struct dep_msg_opaque *m) {
  struct writer w;
  w_init(&w, b);
  if (m->len > 0 && m->data == NULL)
    return DEP_ERR_INVALID;
  w_bytes(&w, m->data, m->len);
  return w_finish(&w);
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
  struct writer w;
  w_init(&w, b);
  w_u32(&w, m->n);
  for (uint32_t i = 0; i < m->n; i++) {
    const struct dep_msg_job_node *j = &m->jobs[i];
    w_str(&w, j->job_id, sizeof j->job_id);
    w_u32(&w, j->world_size);
    w_u32(&w, j->local_ranks);
    w_u32(&w, j->remote_ranks);
    w_u32(&w, j->nodes);
  }
  return w_finish(&w);
}

int proto_decode_job_nodes(const uint8_t *p, size_t len, struct dep_msg_job_nodes *m) {
  struct reader r;
  r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  uint32_t n = r_u32(&r);
  if (r.bad || n > DEP_JOB_NODES_MAX)
    return DEP_ERR_PROTOCOL;
  m->n = n;
  for (uint32_t i = 0; i < n && !r.bad; i++) {
    struct dep_msg_job_node *j = &m->jobs[i];
    r_str(&r, j->job_id, sizeof j->job_id);
    j->world_size = r_u32(&r);
    j->local_ranks = r_u32(&r);
    j->remote_ranks = r_u32(&r);
    j->nodes = r_u32(&r);
  }
  return r_finish(&r);
}

/* ---- frames and dispatch ------------------------------------------------- */

static bool type_has_empty_body(uint16_t type) {
  return type == DEP_MSG_STATUS || type == DEP_MSG_DETACH || type == DEP_MSG_DETACH_OK ||
         type == DEP_MSG_SHUTDOWN || type == DEP_MSG_RELOAD || type == DEP_MSG_PEERS ||
         type == DEP_MSG_JOB_NODES;
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
  if (buf_grow(b, DEP_PROTO_HDR_LEN) == NULL)
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
    set_why(why, whylen, "job_id is missing: give 1..%d characters of [A-Za-z0-9._:-]",
            DEP_JOB_ID_MAX - 1);
    return DEP_ERR_INVALID;
  }
  size_t n = strnlen(id, DEP_JOB_ID_MAX);
  if (n == 0 || n >= DEP_JOB_ID_MAX) {
    set_why(why, whylen, "job_id length %s%zu is out of range (allowed 1..%d characters)",
            n >= DEP_JOB_ID_MAX ? "at least " : "", n, DEP_JOB_ID_MAX - 1);
    return DEP_ERR_INVALID;
  }
  for (size_t i = 0; i < n; i++) {
    if (!job_id_char_ok(id[i])) {
      unsigned char c = (unsigned char)id[i];
      set_why(why, whylen,
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
  set_why(why, whylen, "%s %u is out of range (allowed %u..%u)", field, v, lo, hi);
  return DEP_ERR_INVALID;
}

int proto_check_attach(const struct dep_attach_args *a, char *why, size_t whylen) {
  int rc;
  if (a == NULL) {
    set_why(why, whylen, "attach arguments are missing");
    return DEP_ERR_INVALID;
  }
  if ((rc = proto_check_job_id(a->job_id, why, whylen)) != 0)
    return rc;
  /* The shape with its world size, world_size first (shape.h's table). */
  if ((rc = dep_shape_check(&a->shape, a->world_size, why, whylen)) != 0)
    return rc;
  if (a->rank >= a->world_size) {
    set_why(why, whylen, "rank %u is out of range (allowed 0..%u for world_size %u)", a->rank,
            a->world_size - 1, a->world_size);
    return DEP_ERR_INVALID;
  }
  if ((rc = check_range("local_world_size", a->local_world_size, 1, DEP_MAX_LOCAL_RANKS, why,
                        whylen)) != 0)
    return rc;
  if (a->local_world_size > a->world_size) {
    set_why(why, whylen,
            "local_world_size %u exceeds world_size %u (allowed 1..%u for that world_size)",
            a->local_world_size, a->world_size, a->world_size);
    return DEP_ERR_INVALID;
  }
  if (a->local_rank >= a->local_world_size) {
    set_why(why, whylen, "local_rank %u is out of range (allowed 0..%u for local_world_size %u)",
            a->local_rank, a->local_world_size - 1, a->local_world_size);
    return DEP_ERR_INVALID;
  }
  return 0;
}
