/*
 * proto_xring.c — XRING_LEND_OK's body (proto.h): u32 version, u32 bytes;
 * the ring's memfd (xring.h) rides on the frame.
 */
#include "codec.h"
#include "proto.h"

int proto_encode_xring_lend_ok(struct proto_buf *b, const struct dep_msg_xring_lend_ok *m) {
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_u32(&w, m->version);
  codec_w_u32(&w, m->bytes);
  return codec_w_finish(&w);
}

int proto_decode_xring_lend_ok(const uint8_t *p, size_t len, struct dep_msg_xring_lend_ok *m) {
  struct codec_r r;
  codec_r_init(&r, p, len);
  m->version = codec_r_u32(&r);
  m->bytes = codec_r_u32(&r);
  return codec_r_finish(&r);
}
