/*
 * xring.c — the data stream's frame header (xring.h's dep_xfer_hdr) through
 * the codec (codec.h): one field table, in wire order, driving its encoder
 * and its decoder, as the control and peer protocols' bodies are.  A
 * header comes from another node's daemon, untrusted until checked: the
 * decoder takes exactly DEP_XFER_HDR_WIRE bytes and refuses a magic or a
 * job id that is not a deepepd's before its caller acts on any field.
 */
#include "xring.h"

#include <string.h>

#include "codec.h"
#include "why.h"

static const struct codec_field xfer_hdr_f[] = {
    CODEC_U32(struct dep_xfer_hdr, magic), CODEC_U32(struct dep_xfer_hdr, src),
    CODEC_U32(struct dep_xfer_hdr, dest),  CODEC_U32(struct dep_xfer_hdr, parity),
    CODEC_U64(struct dep_xfer_hdr, seq),   CODEC_U64(struct dep_xfer_hdr, bytes),
    CODEC_U32(struct dep_xfer_hdr, kind),  CODEC_U32(struct dep_xfer_hdr, row0),
    CODEC_FSTR(struct dep_xfer_hdr, job_id), CODEC_BYTES(struct dep_xfer_hdr, slot),
};

int dep__xfer_hdr_encode(struct proto_buf *b, const struct dep_xfer_hdr *h) {
  if (h->magic != DEP_XFER_MAGIC)
    return DEP_ERR_INVALID;
  struct codec_w w;
  codec_w_init(&w, b);
  codec_w_rec(&w, xfer_hdr_f, CODEC_NFIELDS(xfer_hdr_f), h);
  return codec_w_finish(&w);
}

int dep__xfer_hdr_decode(const uint8_t *p, size_t len, struct dep_xfer_hdr *h, char *why,
                         size_t whylen) {
  memset(h, 0, sizeof *h);
  if (len != DEP_XFER_HDR_WIRE)
    return why_fail(why, whylen, DEP_ERR_PROTOCOL, "a frame header of %zu bytes, not %u", len,
                    (unsigned)DEP_XFER_HDR_WIRE);
  /* The magic first: a stream that is not a deepepd's is named so, not by
   * whatever its bytes at a job id's place hold. */
  const uint32_t magic = codec_get_u32(p);
  if (magic != DEP_XFER_MAGIC)
    return why_fail(why, whylen, DEP_ERR_PROTOCOL,
                    "a frame with magic %#x, not %#x: not a deepepd's data stream", magic,
                    DEP_XFER_MAGIC);
  struct codec_r r;
  codec_r_init(&r, p, len);
  codec_r_rec(&r, xfer_hdr_f, CODEC_NFIELDS(xfer_hdr_f), h);
  if (codec_r_finish(&r) != 0) {
    memset(h, 0, sizeof *h);
    return why_fail(why, whylen, DEP_ERR_PROTOCOL,
                    "a frame whose job id is not a string of at most %u bytes padded with "
                    "NULs to %u", (unsigned)DEP_JOB_ID_MAX - 1, (unsigned)DEP_JOB_ID_MAX);
  }
  return 0;
}
