/*
 * fuzz_peer.c — libFuzzer harness for the peer protocol decoder
 * (proto/peer_proto.c) and the PEERS_OK body (make fuzz).  The input is
 * decoded as one peer message; whatever decodes must re-encode to the very
 * same bytes, and a mismatch aborts so libFuzzer keeps the input.  The same
 * bytes are then decoded as a PEERS_OK body, which allocates: it must be
 * freed and re-encode alike.  Seeds: tests/corpus/peer/.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer_proto.h"
#include "proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void die(const char *what) {
  fprintf(stderr, "fuzz_peer: %s\n", what);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct dep_peer_msg m;
  char why[256];
  struct proto_buf b;
  proto_buf_init(&b);
  if (peer_proto_decode(data, size, &m, why, sizeof why) == 0) {
    if (peer_proto_encode(&b, &m) != 0)
      die("a decoded message does not encode");
    if (b.len != size || memcmp(b.data, data, size) != 0)
      die("a decoded message re-encodes differently");
  }
  proto_buf_reset(&b);
  struct dep_msg_peers p;
  if (proto_decode_peers(data, size, &p) == 0) {
    if (proto_encode_peers(&b, &p) != 0)
      die("a decoded PEERS_OK does not encode");
    if (b.len != size || memcmp(b.data, data, size) != 0)
      die("a decoded PEERS_OK re-encodes differently");
    proto_peers_free(&p);
  }
  proto_buf_free(&b);
  return 0;
}
