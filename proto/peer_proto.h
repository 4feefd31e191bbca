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
 *   MEMBERSHIP str job_id (<= 63), u32 owner_uid, u16 nfields (==
 *              DEP_SHAPE_NFIELDS), nfields x u32: the shape table's fields
 *              in its order (shape.h, world_size first), u32
 *              local_world_size, u32 n_ranks (== local_world_size), n_ranks
 *              x u32 global ranks, u16 opaque_len (<= DEP_PEER_OPAQUE_MAX)
 *              + bytes
 *   JOB_FAIL   str job_id, u32 owner_uid, u32 rank (DEP_PEER_NO_RANK: none),
 *              u32 detached (0/1), i32 code (< 0), str message (<= 511)
 *   JOB_END    as JOB_FAIL, with code 0
 *
 * Multi-node jobs (job.c): a daemon whose local ranks of a job have all
 * attached sends MEMBERSHIP (which global ranks it holds, under which uid
 * and shape) to every peer that is up, and again to a peer whose link
 * comes up later.  JOB_FAIL says the job failed on the sender (a conflict,
 * a timeout, a rank that left it while it ran: `rank`), so the receiver
 * fails or aborts its side; JOB_END says the sender's part of the job is
 * gone, so the receiver forgets its MEMBERSHIP.  MEMBERSHIP's opaque bytes
 * are room for what the data path will carry (slab addresses, NIC keys):
 * empty today, carried and ignored.  The shape travels as the table's
 * fields with their count, so a build whose shape has another field is
 * refused by name rather than misread; adding a row to the shape table is
 * a layout change of MEMBERSHIP and bumps DEP_PEER_VERSION.
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
 *   1  initial: HELLO, AUTH, AUTH_OK, ERROR, KEEPALIVE, CLOSE.  Added
 *      since, without a bump (new types only): MEMBERSHIP, JOB_FAIL,
 *      JOB_END (multi-node jobs).
 */
#ifndef DEP_PEER_PROTO_H
#define DEP_PEER_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "proto.h"
#include "shape.h"

#define DEP_PEER_MAGIC 0x31505044u /* "DPP1" */
#define DEP_PEER_VERSION 1
#define DEP_PEER_HDR_LEN 8
#define DEP_PEER_CHALLENGE_LEN 32
#define DEP_PEER_MAC_LEN 32
#define DEP_PEER_NODE_MAX 64
#define DEP_PEER_ADDR_MAX 256
/* MEMBERSHIP's room for the data path's fields (opaque today). */
#define DEP_PEER_OPAQUE_MAX 1024
/* JOB_FAIL / JOB_END that name no rank. */
#define DEP_PEER_NO_RANK UINT32_MAX
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
  DEP_PEER_MEMBERSHIP = 7,
  DEP_PEER_JOB_FAIL = 8,
  DEP_PEER_JOB_END = 9,
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

/* MEMBERSHIP: the global ranks of a job that the sender holds, all attached. */
struct dep_peer_membership {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;          /* the uid number: uids must agree across nodes */
  struct dep_shape_world sw;   /* the job's shape and world_size */
  uint32_t local_world_size;   /* the sender's */
  uint32_t n_ranks;            /* == local_world_size */
  uint32_t ranks[DEP_MAX_LOCAL_RANKS];
  uint32_t opaque_len;         /* 0..DEP_PEER_OPAQUE_MAX */
  uint8_t opaque[DEP_PEER_OPAQUE_MAX];
};

/* JOB_FAIL and JOB_END. */
struct dep_peer_job_event {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t rank;     /* the global rank that left, or DEP_PEER_NO_RANK */
  uint32_t detached; /* 1: it detached; 0: it died or the job failed */
  int32_t code;      /* JOB_FAIL: < 0; JOB_END: 0 */
  char message[DEP_MSG_TEXT_MAX];
};

/* One decoded message: the type says which member is set. */
struct dep_peer_msg {
  uint16_t type;
  union {
    struct dep_peer_hello hello;
    struct dep_peer_auth auth;
    struct dep_peer_error error; /* ERROR, CLOSE */
    struct dep_peer_keepalive keepalive;
    struct dep_peer_membership membership;
    struct dep_peer_job_event job; /* JOB_FAIL, JOB_END */
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
