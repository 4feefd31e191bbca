/*
 * ctl_ask.c — one request of deepepctl and its one reply, decoded: what
 * every subcommand that asks the daemon something did for itself before
 * (send, wait, decode, say what was malformed, release the frame).
 */
#include "client_internal.h"
#include "ctl.h"

/* The decoders' own types differ by their out struct; calling one through a
 * pointer of another type is undefined, so each gets a void * twin here. */
#define CTL_DECODE_DEF_(body)                                                                     \
  int ctl_decode_##body(const uint8_t *p, size_t len, void *out) {                                \
    return proto_decode_##body(p, len, out);                                                      \
  }
CTL_REPLY_BODIES(CTL_DECODE_DEF_)
#undef CTL_DECODE_DEF_

int ctl_ask(dep_client_t *c, uint16_t type, const void *req, uint16_t ok_type,
            ctl_decode_fn decode, void *out) {
  struct client_frame f;
  int rc = client_request(c, type, req, ok_type, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc != 0)
    return rc;
  if (decode(f.body, f.hdr.body_len, out) != 0)
    rc = client_seterr(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed %s",
                       proto_type_name(ok_type));
  client_frame_release(&f);
  return rc;
}
