/*
 * fuzz_frame.c — libFuzzer harness for the protocol decoders (make fuzz).
 * The input's first 24 bytes are decoded as a frame header and the rest as
 * the body of every message type, through the decoder its callers use:
 * proto_body_decode, or for the bodies it leaves to their callers
 * (PEERS_OK, JOB_NODES_OK, CLIENTS_OK) their own decoders (STATS_RANK's
 * allocates its tokens, freed as ctl_stats_free does).  Whatever
 * decodes must re-encode to the very same bytes and pass the field checks
 * without crashing, and what a decoder allocated is freed as its callers
 * free it (a refused body must leave nothing allocated); a mismatch aborts
 * so libFuzzer keeps the input.  The input, and its first
 * DEP_XFER_HDR_WIRE bytes, are also decoded as a data connection's frame
 * header (xring.h), which must refuse all but its exact length, say why it
 * refuses, and re-encode what it takes to the same bytes.  Seeds:
 * tests/corpus/frame/.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"
#include "xring.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);


static void die(const char *what, uint16_t type) {
  fprintf(stderr, "fuzz_frame: %s for %s\n", what, proto_type_name(type));
  abort();
}

/* The bodies proto_body_decode leaves to their callers' own decoders.
 * JOB_NODES_OK is a fixed array too large for the stack, so all three live
 * here (libFuzzer runs one input at a time). */
static struct dep_msg_peers peers;
static struct dep_msg_job_nodes job_nodes;
static struct dep_msg_job_events job_events;
static struct dep_msg_clients clients;

/* Decodes `body` as type t with the decoder its callers use and points *msg
 * at the result. */
static int decode_type(uint16_t t, const uint8_t *body, size_t len, union dep_msg_body *m,
                       const void **msg) {
  switch (t) {
  case DEP_MSG_PEERS_OK:
    *msg = &peers;
    return proto_decode_peers(body, len, &peers);
  case DEP_MSG_JOB_NODES_OK:
    *msg = &job_nodes;
    return proto_decode_job_nodes(body, len, &job_nodes);
  case DEP_MSG_JOB_EVENTS_OK:
    *msg = &job_events;
    return proto_decode_job_events(body, len, &job_events);
  case DEP_MSG_CLIENTS_OK:
    *msg = &clients;
    return proto_decode_clients(body, len, &clients);
  default:
    *msg = m;
    return proto_body_decode(t, body, len, m);
  }
}

/* Frees what decoding type t allocated, as its callers do. */
static void free_type(uint16_t t, union dep_msg_body *m) {
  if (t == DEP_MSG_STATUS_OK) {
    free(m->status.devices);
    free(m->status.jobs);
  } else if (t == DEP_MSG_PEERS_OK) {
    proto_peers_free(&peers);
  } else if (t == DEP_MSG_CLIENTS_OK) {
    proto_clients_free(&clients);
  } else if (t == DEP_MSG_STATS_RANK) {
    proto_stats_rank_free(&m->stats_rank);
  }
}

static void decode_every_type(const uint8_t *body, size_t len) {
  struct proto_buf b;
  proto_buf_init(&b);
  for (uint16_t t = 0; t <= DEP_MSG_TYPE_MAX_; t++) {
    union dep_msg_body m;
    const void *msg;
    int rc = decode_type(t, body, len, &m, &msg);
    if (rc == DEP_ERR_PROTOCOL) {
      if ((t == DEP_MSG_PEERS_OK && (peers.peers != NULL || peers.n_peers != 0)) ||
          (t == DEP_MSG_CLIENTS_OK && (clients.clients != NULL || clients.n != 0)) ||
          (t == DEP_MSG_STATS_RANK &&
           (m.stats_rank.tokens != NULL || m.stats_rank.tokens_world != 0)))
        die("refused body left its records allocated", t);
      continue;
    }
    if (rc != 0)
      die("unexpected decode error", t);
    char why[256];
    if (t == DEP_MSG_ATTACH) {
      /* Any decoded value is fair game for the shared field checks. */
      if (proto_check_attach(&m.attach, why, sizeof why) != 0 && why[0] == '\0')
        die("attach check failed without saying why", t);
      proto_check_job_id(m.attach.job_id, why, sizeof why);
    }
    proto_buf_reset(&b);
    if (proto_frame_encode(&b, t, DEP_FRAME_F_FDS, 7, msg) != 0)
      die("re-encode failed", t);
    if (b.len != DEP_PROTO_HDR_LEN + len || memcmp(b.data + DEP_PROTO_HDR_LEN, body, len) != 0)
      die("round trip changed the body", t);
    struct dep_frame_hdr h;
    if (proto_hdr_decode(b.data, DEP_PROTO_MAX_BODY, &h, why, sizeof why) != 0 || h.type != t ||
        h.body_len != len || h.request_id != 7 || h.flags != DEP_FRAME_F_FDS)
      die("re-encoded header does not decode", t);
    free_type(t, &m);
  }
  proto_buf_free(&b);
}

/* data[0, len) as a data connection's frame header. */
static void decode_xfer_hdr(const uint8_t *data, size_t len) {
  struct dep_xfer_hdr h;
  char why[256] = "";
  int rc = dep__xfer_hdr_decode(data, len, &h, why, sizeof why);
  if (rc != 0 && (rc != DEP_ERR_PROTOCOL || why[0] == '\0'))
    die("data frame header refused wrongly or without saying why", 0);
  if (rc == 0 && len != DEP_XFER_HDR_WIRE)
    die("data frame header of the wrong length taken", 0);
  if (rc != 0)
    return;
  struct proto_buf b;
  proto_buf_init(&b);
  if (dep__xfer_hdr_encode(&b, &h) != 0 || b.len != len || memcmp(b.data, data, len) != 0)
    die("data frame header round trip changed bytes", 0);
  proto_buf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  decode_xfer_hdr(data, size);
  if (size > DEP_XFER_HDR_WIRE)
    decode_xfer_hdr(data, DEP_XFER_HDR_WIRE);
  if (size < DEP_PROTO_HDR_LEN) {
    decode_every_type(data, size);
    return 0;
  }
  struct dep_frame_hdr h;
  char why[256] = "";
  int rc = proto_hdr_decode(data, DEP_PROTO_MAX_BODY, &h, why, sizeof why);
  if (rc != 0 && rc != DEP_ERR_PROTOCOL && rc != DEP_ERR_VERSION && rc != DEP_ERR_UNSUPPORTED)
    die("unexpected header error", 0);
  if (rc != 0 && why[0] == '\0')
    die("header refused without saying why", 0);
  /* An unknown type is the one refusal whose frame is skipped and the
   * link kept: the rest of its header must be right. */
  if (rc == DEP_ERR_UNSUPPORTED &&
      (proto_type_known(h.type) || h.type == 0 || !proto_version_known(h.version) ||
       h.body_len > DEP_PROTO_MAX_BODY || (h.flags & ~DEP_FRAME_F_KNOWN) != 0))
    die("unknown type reported of a header wrong otherwise", h.type);
  if (rc == 0 || rc == DEP_ERR_UNSUPPORTED) {
    uint8_t again[DEP_PROTO_HDR_LEN];
    proto_hdr_encode(&h, again);
    if (memcmp(again, data, DEP_PROTO_HDR_LEN) != 0)
      die("header round trip changed bytes", h.type);
  }
  decode_every_type(data + DEP_PROTO_HDR_LEN, size - DEP_PROTO_HDR_LEN);
  return 0;
}
