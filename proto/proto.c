/*
 * proto.c — the deepepd control protocol codec (DESIGN §8, proto.h): the
 * frame header, the growable buffer, the bodies every connection uses
 * (ERROR, HELLO, HELLO_OK, PEER), and the one dispatch from a message type
 * to its body's encoder and decoder.  Everything is packed byte by byte in
 * little-endian order, so the wire format does not depend on the compiler's
 * struct layout or the host's byte order.
 *
 * Bodies: each one field table (codec.h) driving its encoder and decoder,
 * here ERROR (code < 0), HELLO and HELLO_OK; PEER is the bytes of one peer
 * protocol message (peer_proto.h), passed through;
 *   ATTACH, ATTACH_OK, SLAB, KERNELS, KERNELS_OK, TUNE, TUNE_OK: proto_rank.c
 *   STATUS_OK, RELOAD_OK, DRAIN, DRAIN_OK, PEERS_OK, JOB_NODES_OK: proto_ctl.c
 *   STATS_LEND_OK, XRING_LEND_OK, STATS, STATS_RANK, STATS_OK, CLIENTS_OK: proto_stats.c
 *   STATUS, DETACH, DETACH_OK, SHUTDOWN, RELOAD, PEERS, JOB_NODES, STATS_LEND,
 *   CLIENTS, XRING_LEND: empty
 */
#include "proto.h"
#include "codec.h"
#include "why.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

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
  if (!proto_version_known(h->version)) {
    why_set(why, whylen,
            "the far end speaks protocol version %u; this build speaks versions %u..%u: "
            "upgrade whichever of deepepd and libdeepep-client (or deepepctl) is older",
            (unsigned)h->version, (unsigned)DEP_PROTO_MIN_VERSION, (unsigned)DEP_PROTO_VERSION);
    return DEP_ERR_VERSION;
  }
  /* The type is checked here, in order, but an unknown one is said last:
   * it is the one fault that keeps the connection, so it may be reported
   * only of a header that is right in every other way (its body, within
   * the limit, can then be read and skipped). */
  if (h->type == 0) {
    why_set(why, whylen, "message type 0 is never sent (types start at 1)");
    return DEP_ERR_PROTOCOL;
  }
  bool unknown = !proto_type_known(h->type);
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
  if (unknown) {
    why_set(why, whylen, "unknown message type %u (this build of protocol version %u knows "
            "1..%u)", (unsigned)h->type, (unsigned)DEP_PROTO_VERSION,
            (unsigned)(DEP_MSG_TYPE_MAX_ - 1));
    return DEP_ERR_UNSUPPORTED;
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

static const struct codec_field error_fields[] = {
    CODEC_I32(struct dep_msg_error, code), /* < 0 */
    CODEC_STR(struct dep_msg_error, message),
};

static const struct codec_field hello_fields[] = {
    CODEC_U32(struct dep_msg_hello, version),
    CODEC_U32(struct dep_msg_hello, pid),
    CODEC_STR(struct dep_msg_hello, name),
};

static const struct codec_field hello_ok_fields[] = {
    CODEC_U32(struct dep_msg_hello_ok, version),
    CODEC_STR(struct dep_msg_hello_ok, daemon_version),
    CODEC_STR(struct dep_msg_hello_ok, backend),
};

int proto_encode_error(struct proto_buf *b, const struct dep_msg_error *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  if (m->code >= 0) /* an error reply always carries a failure code */
    return DEP_ERR_INVALID;
  codec_w_rec(&w, error_fields, CODEC_NFIELDS(error_fields), m);
  return codec_w_finish(&w);
}

int proto_decode_error(const uint8_t *p, size_t len, struct dep_msg_error *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, error_fields, CODEC_NFIELDS(error_fields), m);
  if (!r.bad && m->code >= 0)
    return DEP_ERR_PROTOCOL;
  return codec_r_finish(&r);
}

/* ---- HELLO / HELLO_OK ---------------------------------------------------- */

int proto_encode_hello(struct proto_buf *b, const struct dep_msg_hello *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, hello_fields, CODEC_NFIELDS(hello_fields), m);
  return codec_w_finish(&w);
}

int proto_decode_hello(const uint8_t *p, size_t len, struct dep_msg_hello *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, hello_fields, CODEC_NFIELDS(hello_fields), m);
  return codec_r_finish(&r);
}

int proto_encode_hello_ok(struct proto_buf *b, const struct dep_msg_hello_ok *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, hello_ok_fields, CODEC_NFIELDS(hello_ok_fields), m);
  return codec_w_finish(&w);
}

int proto_decode_hello_ok(const uint8_t *p, size_t len, struct dep_msg_hello_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  memset(m, 0, sizeof *m);
  codec_r_rec(&r, hello_ok_fields, CODEC_NFIELDS(hello_ok_fields), m);
  return codec_r_finish(&r);
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
  if (!proto_type_known(type) || (flags & ~DEP_FRAME_F_KNOWN) != 0)
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
