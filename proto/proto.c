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
 * protocol message (peer_proto.h), passed through.  Which file holds each
 * other body: DEP_MSG_BODIES (proto.h).
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

/* ---- ERROR, HELLO, HELLO_OK ---------------------------------------------------- */

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

static bool error_check(const void *m) {
  return ((const struct dep_msg_error *)m)->code < 0; /* an error always carries a failure */
}
CODEC_BODY(error, struct dep_msg_error, error_fields, error_check, error_check)
CODEC_BODY(hello, struct dep_msg_hello, hello_fields, NULL, NULL)
CODEC_BODY(hello_ok, struct dep_msg_hello_ok, hello_ok_fields, NULL, NULL)

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

/* ---- frames and dispatch, from DEP_MSG_MAP and DEP_MSG_BODIES ---------------- */

/* The numbers run 1.. without a gap: proto_type_known is a range.  (A
 * number used twice is two equal case labels below, a compile error.) */
#define COUNT_(...) +1
_Static_assert(0 DEP_MSG_MAP(COUNT_) == DEP_MSG_TYPE_MAX_ - 1,
               "DEP_MSG_MAP: message numbers run 1..DEP_MSG_TYPE_MAX_ - 1 without a gap");
#undef COUNT_

/* Each body's step of the dispatch: an empty body encodes to nothing and
 * decodes only from nothing; any other needs its struct; an OWN body is
 * decoded only by its own decoder. */
static int encode_empty(struct proto_buf *b, const void *msg) { return 0; }
static int decode_empty(const uint8_t *p, size_t len, void *msg) {
  return len == 0 ? 0 : DEP_ERR_PROTOCOL;
}
#define DECODE_UNION(body) proto_decode_##body(p, len, msg)
#define DECODE_OWN(body) DEP_ERR_PROTOCOL
#define BODY_STEPS_(body, type, decoded)                                                         \
  static int encode_##body(struct proto_buf *b, const void *msg) {                               \
    return msg == NULL ? DEP_ERR_INVALID : proto_encode_##body(b, msg);                          \
  }                                                                                              \
  static int decode_##body(const uint8_t *p, size_t len, void *msg) {                            \
    return msg == NULL ? DEP_ERR_INVALID : DECODE_##decoded(body);                               \
  }
DEP_MSG_BODIES(BODY_STEPS_)
#undef BODY_STEPS_
#undef DECODE_UNION
#undef DECODE_OWN

static int body_encode(struct proto_buf *b, uint16_t type, const void *msg) {
  switch (type) {
#define CASE_(NAME, name, number, body, from)                                                    \
  case DEP_MSG_##NAME:                                                                           \
    return encode_##body(b, msg);
    DEP_MSG_MAP(CASE_)
#undef CASE_
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
  switch (type) {
#define CASE_(NAME, name, number, body_, from)                                                   \
  case DEP_MSG_##NAME:                                                                           \
    return decode_##body_(body, len, msg);
    DEP_MSG_MAP(CASE_)
#undef CASE_
  default:
    return msg == NULL ? DEP_ERR_INVALID : DEP_ERR_PROTOCOL;
  }
}

/* Each body by number, `empty` first: a constant to compare. */
enum body_id {
  BODY_ID_empty,
#define ID_(body, type, decoded) BODY_ID_##body,
  DEP_MSG_BODIES(ID_)
#undef ID_
};

/* What the dispatch above does not need, by type. */
static const struct {
  const char *name;
  uint8_t from; /* enum dep_msg_from */
  bool empty;
} msg_info[DEP_MSG_TYPE_MAX_] = {
#define INFO_(NAME, name, number, body, from)                                                    \
  [DEP_MSG_##NAME] = {#NAME, DEP_MSG_FROM_##from, BODY_ID_##body == BODY_ID_empty},
    DEP_MSG_MAP(INFO_)
#undef INFO_
};

const char *proto_type_name(uint16_t type) {
  return proto_type_known(type) ? msg_info[type].name : "UNKNOWN";
}

enum dep_msg_from proto_type_from(uint16_t type) {
  return proto_type_known(type) ? (enum dep_msg_from)msg_info[type].from : 0;
}

bool proto_type_empty(uint16_t type) { return proto_type_known(type) && msg_info[type].empty; }
