/*
 * peer_proto.c — the peer protocol codec (peer_proto.h): one encoder and one
 * bounds-checked decoder per message, byte by byte in little-endian order.
 * A peer is untrusted input until it has authenticated, so the decoder
 * reads nothing past `len`, allocates nothing and accepts only exact
 * lengths.
 */
#include "peer_proto.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- writer: errors are sticky, a failed encode is rolled back ---------- */

struct pw {
  struct proto_buf *b;
  size_t start;
  int err;
};

static void pw_bytes(struct pw *w, const void *src, size_t n) {
  if (w->err != 0 || n == 0)
    return;
  struct proto_buf *b = w->b;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 128;
    while (cap < b->len + n)
      cap *= 2;
    uint8_t *d = realloc(b->data, cap);
    if (d == NULL) {
      w->err = DEP_ERR_NO_MEMORY;
      return;
    }
    b->data = d;
    b->cap = cap;
  }
  memcpy(b->data + b->len, src, n);
  b->len += n;
}

static void pw_uint(struct pw *w, uint64_t v, size_t n) {
  uint8_t p[8];
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(v >> (8 * i));
  pw_bytes(w, p, n);
}

static void pw_str(struct pw *w, const char *s, size_t size) {
  size_t n = strnlen(s, size);
  if (n >= size) {
    w->err = DEP_ERR_INVALID;
    return;
  }
  pw_uint(w, n, 2);
  pw_bytes(w, s, n);
}

/* ---- reader: any failure is DEP_ERR_PROTOCOL ---------------------------- */

struct pr {
  const uint8_t *p;
  size_t left;
  bool bad;
};

static const uint8_t *pr_take(struct pr *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *p = r->p;
  r->p += n;
  r->left -= n;
  return p;
}

static uint64_t pr_uint(struct pr *r, size_t n) {
  const uint8_t *p = pr_take(r, n);
  uint64_t v = 0;
  for (size_t i = 0; p != NULL && i < n; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static int32_t pr_i32(struct pr *r) {
  uint32_t u = (uint32_t)pr_uint(r, 4);
  return u <= INT32_MAX ? (int32_t)u : -(int32_t)(UINT32_MAX - u) - 1;
}

static void pr_bytes(struct pr *r, void *dst, size_t n) {
  const uint8_t *p = pr_take(r, n);
  if (p != NULL)
    memcpy(dst, p, n);
}

/* A string into dst[size]: at most size - 1 bytes, no NUL inside. */
static void pr_str(struct pr *r, char *dst, size_t size) {
  dst[0] = '\0';
  size_t n = (size_t)pr_uint(r, 2);
  if (r->bad)
    return;
  if (n >= size) {
    r->bad = true;
    return;
  }
  const uint8_t *s = pr_take(r, n);
  if (s == NULL)
    return;
  if (memchr(s, '\0', n) != NULL) {
    r->bad = true;
    return;
  }
  memcpy(dst, s, n);
  dst[n] = '\0';
}

/* ---- messages ------------------------------------------------------------ */

int peer_proto_encode(struct proto_buf *b, const struct dep_peer_msg *m) {
  struct pw w = {.b = b, .start = b->len, .err = 0};
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_)
    return DEP_ERR_INVALID;
  pw_uint(&w, DEP_PEER_MAGIC, 4);
  pw_uint(&w, DEP_PEER_VERSION, 2);
  pw_uint(&w, m->type, 2);
  switch (m->type) {
  case DEP_PEER_HELLO:
    pw_uint(&w, m->u.hello.version, 4);
    pw_str(&w, m->u.hello.node, sizeof m->u.hello.node);
    pw_str(&w, m->u.hello.listen_address, sizeof m->u.hello.listen_address);
    pw_uint(&w, m->u.hello.listen_port, 2);
    pw_bytes(&w, m->u.hello.challenge, DEP_PEER_CHALLENGE_LEN);
    break;
  case DEP_PEER_AUTH:
    pw_bytes(&w, m->u.auth.mac, DEP_PEER_MAC_LEN);
    break;
  case DEP_PEER_AUTH_OK:
    break;
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    if (m->u.error.code > 0 || (m->type == DEP_PEER_ERROR && m->u.error.code == 0))
      w.err = DEP_ERR_INVALID;
    pw_uint(&w, (uint32_t)m->u.error.code, 4);
    pw_str(&w, m->u.error.message, sizeof m->u.error.message);
    break;
  case DEP_PEER_KEEPALIVE:
    if (m->u.keepalive.reply > 1)
      w.err = DEP_ERR_INVALID;
    pw_uint(&w, m->u.keepalive.reply, 4);
    pw_uint(&w, m->u.keepalive.stamp, 8);
    break;
  case DEP_PEER_MEMBERSHIP: {
    const struct dep_peer_membership *x = &m->u.membership;
    if (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size ||
        x->opaque_len > DEP_PEER_OPAQUE_MAX)
      w.err = DEP_ERR_INVALID;
    pw_str(&w, x->job_id, sizeof x->job_id);
    pw_uint(&w, x->owner_uid, 4);
    pw_uint(&w, DEP_SHAPE_NFIELDS, 2);
    for (unsigned f = 0; f < DEP_SHAPE_NFIELDS; f++)
      pw_uint(&w, dep_shape_raw(&x->sw.shape, x->sw.world_size, f), 4);
    pw_uint(&w, x->local_world_size, 4);
    pw_uint(&w, x->n_ranks, 4);
    for (uint32_t i = 0; i < x->n_ranks && w.err == 0; i++)
      pw_uint(&w, x->ranks[i], 4);
    pw_uint(&w, x->opaque_len, 2);
    if (w.err == 0)
      pw_bytes(&w, x->opaque, x->opaque_len);
    break;
  }
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END: {
    const struct dep_peer_job_event *x = &m->u.job;
    if ((m->type == DEP_PEER_JOB_FAIL) != (x->code < 0) || x->code > 0 || x->detached > 1)
      w.err = DEP_ERR_INVALID;
    pw_str(&w, x->job_id, sizeof x->job_id);
    pw_uint(&w, x->owner_uid, 4);
    pw_uint(&w, x->rank, 4);
    pw_uint(&w, x->detached, 4);
    pw_uint(&w, (uint32_t)x->code, 4);
    pw_str(&w, x->message, sizeof x->message);
    break;
  }
  }
  if (w.err != 0)
    b->len = w.start;
  return w.err;
}

int peer_proto_decode(const uint8_t *p, size_t len, struct dep_peer_msg *m, char *why,
                    size_t whylen) {
  memset(m, 0, sizeof *m);
  struct pr r = {.p = p, .left = len, .bad = false};
  if (len < DEP_PEER_HDR_LEN) {
    set_why(why, whylen, "peer message of %zu bytes is shorter than its %d-byte header", len,
            DEP_PEER_HDR_LEN);
    return DEP_ERR_PROTOCOL;
  }
  uint32_t magic = (uint32_t)pr_uint(&r, 4);
  uint16_t version = (uint16_t)pr_uint(&r, 2);
  m->type = (uint16_t)pr_uint(&r, 2);
  if (magic != DEP_PEER_MAGIC) {
    set_why(why, whylen, "bad peer message magic 0x%08x (expected 0x%08x)", magic,
            DEP_PEER_MAGIC);
    return DEP_ERR_PROTOCOL;
  }
  if (version != DEP_PEER_VERSION) {
    set_why(why, whylen,
            "the peer speaks peer protocol version %u, this deepepd speaks %u: run the same "
            "deepepd version on every node",
            (unsigned)version, (unsigned)DEP_PEER_VERSION);
    return DEP_ERR_VERSION;
  }
  if (m->type == 0 || m->type >= DEP_PEER_TYPE_MAX_) {
    set_why(why, whylen, "unknown peer message type %u (known: 1..%u)", (unsigned)m->type,
            (unsigned)(DEP_PEER_TYPE_MAX_ - 1));
    return DEP_ERR_UNSUPPORTED;
  }
  switch (m->type) {
  case DEP_PEER_HELLO:
    m->u.hello.version = (uint32_t)pr_uint(&r, 4);
    pr_str(&r, m->u.hello.node, sizeof m->u.hello.node);
    pr_str(&r, m->u.hello.listen_address, sizeof m->u.hello.listen_address);
    m->u.hello.listen_port = (uint16_t)pr_uint(&r, 2);
    pr_bytes(&r, m->u.hello.challenge, DEP_PEER_CHALLENGE_LEN);
    break;
  case DEP_PEER_AUTH:
    pr_bytes(&r, m->u.auth.mac, DEP_PEER_MAC_LEN);
    break;
  case DEP_PEER_AUTH_OK:
    break;
  case DEP_PEER_ERROR:
  case DEP_PEER_CLOSE:
    m->u.error.code = pr_i32(&r);
    pr_str(&r, m->u.error.message, sizeof m->u.error.message);
    if (!r.bad && (m->u.error.code > 0 || (m->type == DEP_PEER_ERROR && m->u.error.code == 0))) {
      set_why(why, whylen, "peer %s carries code %d, which is not an error code",
              peer_proto_type_name(m->type), (int)m->u.error.code);
      return DEP_ERR_PROTOCOL;
    }
    break;
  case DEP_PEER_KEEPALIVE:
    m->u.keepalive.reply = (uint32_t)pr_uint(&r, 4);
    m->u.keepalive.stamp = pr_uint(&r, 8);
    if (!r.bad && m->u.keepalive.reply > 1) {
      set_why(why, whylen, "peer KEEPALIVE reply %u is not 0 or 1",
              (unsigned)m->u.keepalive.reply);
      return DEP_ERR_PROTOCOL;
    }
    break;
  case DEP_PEER_MEMBERSHIP: {
    struct dep_peer_membership *x = &m->u.membership;
    pr_str(&r, x->job_id, sizeof x->job_id);
    x->owner_uid = (uint32_t)pr_uint(&r, 4);
    unsigned nfields = (unsigned)pr_uint(&r, 2);
    if (!r.bad && nfields != DEP_SHAPE_NFIELDS) {
      set_why(why, whylen,
              "peer MEMBERSHIP carries a shape of %u fields, this deepepd knows %u: run the same "
              "deepepd version on every node",
              nfields, (unsigned)DEP_SHAPE_NFIELDS);
      return DEP_ERR_PROTOCOL;
    }
    for (unsigned f = 0; f < DEP_SHAPE_NFIELDS && !r.bad; f++) {
      uint32_t v = (uint32_t)pr_uint(&r, 4);
      memcpy((uint8_t *)&x->sw + dep_shape_fields[f].off, &v, sizeof v);
    }
    x->local_world_size = (uint32_t)pr_uint(&r, 4);
    x->n_ranks = (uint32_t)pr_uint(&r, 4);
    if (!r.bad && (x->n_ranks > DEP_MAX_LOCAL_RANKS || x->n_ranks != x->local_world_size)) {
      set_why(why, whylen, "peer MEMBERSHIP holds %u ranks for local_world_size %u (at most %u)",
              (unsigned)x->n_ranks, (unsigned)x->local_world_size, DEP_MAX_LOCAL_RANKS);
      return DEP_ERR_PROTOCOL;
    }
    for (uint32_t i = 0; i < x->n_ranks && !r.bad; i++)
      x->ranks[i] = (uint32_t)pr_uint(&r, 4);
    x->opaque_len = (uint32_t)pr_uint(&r, 2);
    if (!r.bad && x->opaque_len > DEP_PEER_OPAQUE_MAX) {
      set_why(why, whylen, "peer MEMBERSHIP carries %u opaque bytes (at most %d)",
              (unsigned)x->opaque_len, DEP_PEER_OPAQUE_MAX);
      return DEP_ERR_PROTOCOL;
    }
    pr_bytes(&r, x->opaque, x->opaque_len);
    break;
  }
  case DEP_PEER_JOB_FAIL:
  case DEP_PEER_JOB_END: {
    struct dep_peer_job_event *x = &m->u.job;
    pr_str(&r, x->job_id, sizeof x->job_id);
    x->owner_uid = (uint32_t)pr_uint(&r, 4);
    x->rank = (uint32_t)pr_uint(&r, 4);
    x->detached = (uint32_t)pr_uint(&r, 4);
    x->code = pr_i32(&r);
    pr_str(&r, x->message, sizeof x->message);
    if (!r.bad && ((m->type == DEP_PEER_JOB_FAIL) != (x->code < 0) || x->code > 0 ||
                   x->detached > 1)) {
      set_why(why, whylen, "peer %s carries code %d, detached %u", peer_proto_type_name(m->type),
              (int)x->code, (unsigned)x->detached);
      return DEP_ERR_PROTOCOL;
    }
    break;
  }
  }
  if (r.bad || r.left != 0) {
    set_why(why, whylen, "malformed peer %s message (%zu bytes)", peer_proto_type_name(m->type), len);
    return DEP_ERR_PROTOCOL;
  }
  return 0;
}

const char *peer_proto_type_name(uint16_t type) {
  static const char *const names[DEP_PEER_TYPE_MAX_] = {
      [DEP_PEER_HELLO] = "HELLO",         [DEP_PEER_AUTH] = "AUTH",
      [DEP_PEER_AUTH_OK] = "AUTH_OK",     [DEP_PEER_ERROR] = "ERROR",
      [DEP_PEER_KEEPALIVE] = "KEEPALIVE", [DEP_PEER_CLOSE] = "CLOSE",
      [DEP_PEER_MEMBERSHIP] = "MEMBERSHIP", [DEP_PEER_JOB_FAIL] = "JOB_FAIL",
      [DEP_PEER_JOB_END] = "JOB_END",
  };
  return type < DEP_PEER_TYPE_MAX_ && names[type] != NULL ? names[type] : "UNKNOWN";
}
