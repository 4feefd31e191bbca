/*
 * peer_proto.h — the deepepd peer protocol (DESIGN §7): what two daemons say to
 * each other over a peer link, one definition shared by the daemon, its
 * tests and the fuzz harness.
 *
 * A peer message rides as the body of one control-protocol frame of type
 * DEP_MSG_PEER (proto.h), so the framed link (daemon/link.c) carries it
 * unchanged: the outer header gives the length and its bound, the inner one
 * says what the message is and which version of this protocol wrote it.
 *
 *   offset size field
 *        0    4 magic    DEP_PEER_MAGIC ("DPP1" little-endian)
 *        4    2 version  DEP_PEER_VERSION
 *        6    2 type     enum dep_peer_type
 *        8    .  the message's fields, little-endian, strings as u16
 *                length + bytes (no NUL), like proto.c's bodies
 *
 *   HELLO      u32 version, str node (<= 63), str listen_address (<= 255),
 *              u16 listen_port, 32 bytes challenge
 *   AUTH       32 bytes mac
 *   AUTH_OK    (empty)
 *   ERROR      i32 code (< 0), str message (<= 511)
 *   KEEPALIVE  u32 reply (0: asking, 1: the answer), u64 stamp (the
 *              asker's clock, echoed unchanged in the answer)
 *   CLOSE      i32 code (<= 0), str reason (<= 511)
 *
 * The handshake: each end sends HELLO at once; on the other's HELLO it
 * sends AUTH, a MAC (daemon/peer.c) over both HELLOs in a fixed order —
 * the sender's first — and the sender's role (the end that connected or
 * the end that accepted), so an answer only fits the one connection and
 * direction it was made for: a replayed one fails on the fresh challenges,
 * a reflected one on the role and the order.  A verified AUTH is answered
 * with AUTH_OK; a link is up when it has verified the far end's AUTH and
 * received its AUTH_OK.  Before that, any other message drops the link.
 *
 * Rules for growing it (the membership messages of multi-node jobs come
 * next): add message types, never change a layout without bumping the
 * version.  An authenticated peer that receives a type it does not know
 * answers ERROR DEP_ERR_UNSUPPORTED and keeps the link, so a newer daemon
 * can probe an older one.
 *
 * Version history:
 *   1  initial: HELLO, AUTH, AUTH_OK, ERROR, KEEPALIVE, CLOSE.
 */
#ifndef DEP_PEER_PROTO_H
#define DEP_PEER_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "proto.h"

#define DEP_PEER_MAGIC 0x31505044u /* "DPP1" */
#define DEP_PEER_VERSION 1
#define DEP_PEER_HDR_LEN 8
#define DEP_PEER_CHALLENGE_LEN 32
#define DEP_PEER_MAC_LEN 32
#define DEP_PEER_NODE_MAX 64
#define DEP_PEER_ADDR_MAX 256
/* The largest HELLO: the header, fixed fields and both strings at their longest. */
#define DEP_PEER_HELLO_MAX                                                                  \
  (DEP_PEER_HDR_LEN + 4 + 2 + (DEP_PEER_NODE_MAX - 1) + 2 + (DEP_PEER_ADDR_MAX - 1) + 2 + \
   DEP_PEER_CHALLENGE_LEN)

enum dep_peer_type {
  DEP_PEER_HELLO = 1,
  DEP_PEER_AUTH = 2,
  DEP_PEER_AUTH_OK = 3,
  DEP_PEER_ERROR = 4,
  DEP_PEER_KEEPALIVE = 5,
  DEP_PEER_CLOSE = 6,
  DEP_PEER_TYPE_MAX_
};

struct dep_peer_hello {
  uint32_t version;
  char node[DEP_PEER_NODE_MAX];            /* the sender's host name, for people */
  char listen_address[DEP_PEER_ADDR_MAX];  /* its listen.address ("" when it listens on none) */
  uint16_t listen_port;                    /* its listen.port: names it among a host's daemons */
  uint8_t challenge[DEP_PEER_CHALLENGE_LEN];
};

struct dep_peer_auth {
  uint8_t mac[DEP_PEER_MAC_LEN];
};

struct dep_peer_error { /* ERROR and CLOSE */
  int32_t code;
  char message[DEP_MSG_TEXT_MAX];
};

struct dep_peer_keepalive {
  uint32_t reply;
  uint64_t stamp;
};

/* One decoded message: the type says which member is set. */
struct dep_peer_msg {
  uint16_t type;
  union {
    struct dep_peer_hello hello;
    struct dep_peer_auth auth;
    struct dep_peer_error error; /* ERROR, CLOSE */
    struct dep_peer_keepalive keepalive;
  } u;
};

/*
 * Encode one message (header and fields) into b, after what it holds.
 * Returns 0, DEP_ERR_INVALID (a field that cannot be represented: a string
 * too long, an ERROR code that is not negative) or DEP_ERR_NO_MEMORY; on
 * failure b is as it was.
 */
int peer_proto_encode(struct proto_buf *b, const struct dep_peer_msg *m);

/*
 * Decode one message of exactly len bytes.  Checks, in order: the header's
 * length, magic, version, type, then the fields; a short or long body is
 * DEP_ERR_PROTOCOL.  A well-formed header of a type this build does not
 * know is DEP_ERR_UNSUPPORTED with m->type set (the caller decides whether
 * that drops the link).  `why` (may be NULL) says what was wrong.
 */
int peer_proto_decode(const uint8_t *p, size_t len, struct dep_peer_msg *m, char *why,
                    size_t whylen);

/* "HELLO", ..., or "UNKNOWN". */
const char *peer_proto_type_name(uint16_t type);

#endif /* DEP_PEER_PROTO_H */
