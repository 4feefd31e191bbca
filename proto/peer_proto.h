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
 *                length + bytes (no NUL), like the control protocol's bodies
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
 *              x u32 global ranks, u16 n_windows (<= DEP_PEER_WINDOWS_MAX),
 *              n_windows x {u32 rank_index (< n_ranks), u64 slab_off, u64
 *              len (> 0), u64 addr, u32 rkey}
 *   XPORT      u32 kind (0: tcp, 1: rdma), 32 bytes token, u64 mbox_addr,
 *              u32 mbox_rkey, u32 mbox_len, str reason (<= 511)
 *   XPORT_NAK  i32 code (< 0), str reason (<= 511)
 *   JOB_FAIL   str job_id, u32 owner_uid, u32 rank (DEP_PEER_NO_RANK: none),
 *              u32 detached (0/1), i32 code (< 0), str message (<= 511)
 *   JOB_END    as JOB_FAIL, with code 0
 *   MEMBERSHIP_OK str job_id, u32 owner_uid
 *   MEMBERSHIP carries, after chunk_rows, u32 flags (the job's
 *              DEP_ATTACH_* bits, deepep.h)
 *   JOB_MASK   str job_id, u32 owner_uid, u32 rank, u32 gen, u32 why
 *              (gen odd: DEP_SLAB_GONE_DIED, DETACHED or NODE; gen even:
 *              DEP_JOB_EVENT_REJOINED), u64 epoch (the sender's after it),
 *              u64 join (gen even: the rank's join call, > 0; odd: 0)
 *   JOB_JOINED str job_id, u32 owner_uid, u32 rank, u32 gen (even: the
 *              JOB_MASK's it answers), u32 ok (0/1), u64 posted (the
 *              largest call the sender's ranks had posted)
 *   JOB_HELD   str job_id, u32 owner_uid, u32 world_size (1..DEP_MAX_WORLD),
 *              DEP_PEER_RANK_BYTES bytes live (bit r of byte r / 8: rank r
 *              is live in the sender's mask), DEP_PEER_RANK_BYTES bytes
 *              held (the sender's own live ranks: not empty, within live;
 *              no bit at or past world_size in either)
 *
 * Multi-node jobs (daemon/job_members.c): a daemon whose local ranks of a job have all
 * attached sends MEMBERSHIP (which global ranks it holds, under which uid
 * and shape) to every peer that is up, and again to a peer whose link
 * comes up later.  JOB_FAIL says the job failed on the sender (a conflict,
 * a timeout, a rank that left it while it ran: `rank`), so the receiver
 * fails or aborts its side; JOB_END says the sender's part of the job is
 * gone, so the receiver forgets its MEMBERSHIP.  MEMBERSHIP_OK says the
 * sender took the receiver's MEMBERSHIP of that job (owner uid and id) as
 * a record; a MEMBERSHIP it cannot take it answers with JOB_FAIL instead.
 * JOB_MASK is an elastic job's (DESIGN §14): the sender holds `rank`, which
 * left (gen odd) or which a new process takes from call `join` on (gen
 * even), and this is that rank's gen'th change (its leaves and returns);
 * the receiver takes it when gen is above the one it holds for the rank
 * (daemon/job_elastic.c says how the daemons agree on the epoch).  A
 * receiver that takes a return answers JOB_JOINED: ok when none of its
 * ranks had posted call join - 1 once the change was in their slabs, so
 * that each of them sees the rank live from join on; the sender seats the
 * process only when every daemon of the job said ok, and else masks the
 * rank again with the next (odd) count.
 * JOB_HELD is an elastic job's too: a daemon sends it, for each elastic job
 * it runs that spans nodes, to a peer whose link has just come up, since
 * while the link was down each side may have masked the other's ranks as a
 * lost node's and gone on alone (a partition, not a death).  Both daemons
 * then hold the same two views (what each sent) and pick the same side to
 * go on: the one with more live ranks, on a tie the one whose view holds
 * the lowest rank the two views disagree on; the other side's daemon fails
 * its ranks of the job (job_elastic.c, elastic_on_held).
 * A node answers its ranks' ATTACH only once every node holding ranks of
 * the job has taken its MEMBERSHIP, so that a refusal never reaches a job
 * that has started.  MEMBERSHIP's windows say
 * where a writer puts bytes for each of the sender's ranks: bytes
 * [slab_off, slab_off + len) of rank ranks[rank_index]'s exchange region
 * (proto/slab.h: host memory, where blocks from other nodes land) are at
 * `addr` under `rkey` on the sender's NIC (daemon/lend.h; rkey 0: not
 * registered with one, so not a target of RDMA writes).  Each rank has one
 * window today; the field names keep their version-3 spelling.  The shape travels
 * as the table's fields with their count, so a build whose shape has
 * another field is refused by name rather than misread; adding a row to
 * the shape table is a layout change of MEMBERSHIP and bumps
 * DEP_PEER_VERSION.
 *
 * The transport of a link (daemon/peerxport.c, daemon/rdmaxp.h): once both ends
 * have authenticated, the end that accepted sends XPORT: kind tcp (with
 * the reason: its transport is tcp, or it has no RDMA device), or kind
 * rdma with a single-use token and its mailbox (a small registered buffer
 * for the queue pair's keep-alive).  The end that connected either opens
 * an RDMA connection to the acceptor's listen address and port (librdmacm,
 * its private data carrying the token's first bytes, its own mailbox and
 * a proof of the peer key over the whole token and that mailbox:
 * dep_peer_qp_req below; the token, seen in clear, binds the queue pair to
 * this authenticated link, the proof is what opens it), or answers
 * XPORT_NAK with why it will not or could not.  A link is up once its
 * transport is settled: RDMA connected, or TCP agreed.  The end that dialled the queue pair
 * learns it is connected first and may send at once; so at the end that
 * accepted, a frame past the handshake on a link whose queue pair it has
 * already accepted settles the link as RDMA (it is proof the queue pair
 * is up) rather than dropping it.

 * The handshake: each end sends HELLO at once; on the other's HELLO it
 * sends AUTH, a MAC (daemon/peer.c) over both HELLOs in a fixed order —
 * the sender's first — and the sender's role (the end that connected or
 * the end that accepted), so an answer only fits the one connection and
 * direction it was made for: a replayed one fails on the fresh challenges,
 * a reflected one on the role and the order.  A verified AUTH is answered
 * with AUTH_OK; a link is up when it has verified the far end's AUTH and
 * received its AUTH_OK.  Before that, any other message drops the link
 * (with the one exception of a settling RDMA transport, above).
 *
 * Rules for growing it: add message types, never change a layout without
 * bumping the version.  An authenticated peer that receives a type it does not know
 * answers ERROR DEP_ERR_UNSUPPORTED, logs it (at a bounded rate) and keeps
 * the link, so a newer daemon can probe an older one; a control frame of
 * a type it does not know around it is logged and ignored likewise.
 * Before authentication an unknown type closes the connection, as any
 * unexpected message does.
 *
 * Version history (the only one: DEP_PEER_VERSION is the last entry):
 *   1  initial: HELLO, AUTH, AUTH_OK, ERROR, KEEPALIVE, CLOSE.  Added
 *      since, without a bump (new types only): MEMBERSHIP, JOB_FAIL,
 *      JOB_END (multi-node jobs).
 *   2  MEMBERSHIP carries windows in place of its opaque bytes; XPORT and
 *      XPORT_NAK settle each link's transport (TCP or an RDMA queue pair).
 *   3  DATA_OFFER and DATA_HELLO (the data path's connections, xring.h).
 *   4  MEMBERSHIP's windows cover each rank's exchange region, no longer
 *      its slab (the same layout, another meaning: an older peer would
 *      write blocks where no one reads them).
 *   5  a link's RDMA connection request carries a proof of the peer key
 *      (dep_peer_qp_req); before, XPORT's token alone, with the mailbox,
 *      opened the queue pair.  Added since, without a bump: MEMBERSHIP_OK
 *      (a peer that sends none leaves the jobs it holds ranks of to time
 *      out, saying so).
 *   6  MEMBERSHIP carries the job's chunk_rows: the exchange regions hold
 *      channels of that many rows' chunks (slab.h), and a frame of version
 *      4 of the data stream (xring.h) writes into them.
 *   7  MEMBERSHIP carries the job's flags (DEP_ATTACH_ELASTIC: every node
 *      must agree); JOB_MASK (an elastic job's rank masked or back).
 *   8  JOB_MASK carries the join call, and says a rank's return (gen even);
 *      JOB_JOINED answers it: a rank rejoins an elastic job across nodes.
 *   9  JOB_HELD: an elastic job split by a link that dropped while both
 *      daemons lived is reconciled when the link comes back (an older peer
 *      would leave both halves running).
 */
#ifndef DEP_PEER_PROTO_H
#define DEP_PEER_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "proto.h"
#include "shape.h"

#define DEP_PEER_MAGIC 0x31505044u /* "DPP1" */
/* The version this build speaks (the history above), and the oldest it
 * answers.  Today the window is this one version: each bump so far changed
 * what a message means to the receiver (MEMBERSHIP's windows, where blocks
 * land) or let a queue pair open without the key, which an older peer would
 * get wrong silently or allow.  A peer outside it is refused at its HELLO,
 * before authentication, naming the window; an older peer reads that ERROR
 * as a version mismatch naming both versions, since every version checks
 * the version before anything else. */
#define DEP_PEER_VERSION 9
#define DEP_PEER_MIN_VERSION 9
#define DEP_PEER_HDR_LEN 8
#define DEP_PEER_CHALLENGE_LEN 32
#define DEP_PEER_MAC_LEN 32
#define DEP_PEER_NODE_MAX 64
#define DEP_PEER_ADDR_MAX 256
/* MEMBERSHIP's windows at most: every local rank's slab in up to 4 pieces. */
#define DEP_PEER_WINDOWS_MAX (4 * DEP_MAX_LOCAL_RANKS)
#define DEP_PEER_TOKEN_LEN 32
/* JOB_HELD's sets of ranks: a bit per rank of the largest world. */
#define DEP_PEER_RANK_BYTES (DEP_MAX_WORLD / 8)
/* JOB_FAIL / JOB_END that name no rank. */
#define DEP_PEER_NO_RANK UINT32_MAX
/* The largest HELLO: the header, fixed fields and both strings at their longest. */
#define DEP_PEER_HELLO_MAX                                                                  \
  (DEP_PEER_HDR_LEN + 4 + 2 + (DEP_PEER_NODE_MAX - 1) + 2 + (DEP_PEER_ADDR_MAX - 1) + 2 + \
   DEP_PEER_CHALLENGE_LEN)

/*
 * Every peer message type, one line each: X(NAME, number, body, table).
 *   NAME    DEP_PEER_<NAME>, and the type's name in logs
 *   number  its type on the wire: never reused, never renumbered; the
 *           numbers run 1.. without a gap
 *   body    TABLE: its body is the field table `table` of peer_proto.c,
 *           over the member of dep_peer_msg's union the table names;
 *           EMPTY: no body; OWN: a codec of its own (MEMBERSHIP's counted
 *           arrays)
 * The type enum, the names and the codec's dispatch are made from it; the
 * checks of a body's values are peer_check's (peer_proto.c).
 */
#define DEP_PEER_MAP(X)                                                                           \
  X(HELLO, 1, TABLE, hello_f)                                                                     \
  X(AUTH, 2, TABLE, auth_f)                                                                       \
  X(AUTH_OK, 3, EMPTY, none)                                                                      \
  X(ERROR, 4, TABLE, error_f)                                                                     \
  X(KEEPALIVE, 5, TABLE, keepalive_f)                                                             \
  X(CLOSE, 6, TABLE, error_f)                                                                     \
  X(MEMBERSHIP, 7, OWN, none)                                                                     \
  X(JOB_FAIL, 8, TABLE, job_f)                                                                    \
  X(JOB_END, 9, TABLE, job_f)                                                                     \
  X(XPORT, 10, TABLE, xport_f)                                                                    \
  X(XPORT_NAK, 11, TABLE, nak_f)                                                                  \
  X(DATA_OFFER, 12, TABLE, data_offer_f)                                                          \
  X(DATA_HELLO, 13, TABLE, data_hello_f)                                                          \
  X(MEMBERSHIP_OK, 14, TABLE, membership_ok_f)                                                   \
  X(JOB_MASK, 15, TABLE, job_mask_f)                                                             \
  X(JOB_JOINED, 16, TABLE, job_joined_f)                                                         \
  X(JOB_HELD, 17, TABLE, job_held_f)

enum dep_peer_type {
#define DEP_PEER_ENUM_(NAME, number, body, table) DEP_PEER_##NAME = number,
  DEP_PEER_MAP(DEP_PEER_ENUM_)
#undef DEP_PEER_ENUM_
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

/* One window of MEMBERSHIP: where a writer puts bytes of one rank's exchange region. */
struct dep_peer_window {
  uint32_t rank_index; /* into ranks[] */
  uint64_t slab_off;   /* the first byte of the exchange region this window covers */
  uint64_t len;
  uint64_t addr;       /* the address an RDMA write of slab_off names */
  uint32_t rkey;       /* its remote key; 0: not registered with a NIC */
};

/* MEMBERSHIP: the global ranks of a job that the sender holds, all attached. */
struct dep_peer_membership {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;          /* the uid number: uids must agree across nodes */
  struct dep_shape_world sw;   /* the job's shape and world_size */
  uint32_t chunk_rows;         /* the job's channels' chunk (slab.h): the same on every node */
  uint32_t flags;              /* the job's DEP_ATTACH_* bits: the same on every node */
  uint32_t local_world_size;   /* the sender's */
  uint32_t n_ranks;            /* == local_world_size */
  uint32_t ranks[DEP_MAX_LOCAL_RANKS];
  uint32_t n_windows;          /* 0..DEP_PEER_WINDOWS_MAX */
  struct dep_peer_window windows[DEP_PEER_WINDOWS_MAX];
};

enum dep_peer_xport_kind { DEP_PEER_XPORT_TCP = 0, DEP_PEER_XPORT_RDMA = 1 };

/* XPORT: the accepting end's offer for a link's transport. */
struct dep_peer_xport {
  uint32_t kind;                         /* enum dep_peer_xport_kind */
  uint8_t token[DEP_PEER_TOKEN_LEN];     /* rdma: what the RDMA connection must carry */
  uint64_t mbox_addr;                    /* rdma: the acceptor's mailbox */
  uint32_t mbox_rkey, mbox_len;
  char reason[DEP_MSG_TEXT_MAX];         /* tcp: why not RDMA */
};
/*
 * The private data of a link's RDMA connection request, little-endian, all
 * 56 bytes that a reliable connection's request holds: the first 16 bytes
 * of XPORT's token (they name the offer; the proof covers all of it), the
 * connecting end's mailbox, and the first 28 bytes of its proof
 * (daemon/peerauth.h: a MAC with the key derived for the direction over
 * the token and the mailbox).  The mailbox and a whole token leave no
 * room for a whole MAC; 224 bits of it is far past RFC 2104's half of the
 * hash, and each guess costs a connection request.
 */
#define DEP_PEER_QP_TOKEN_NAME 16
#define DEP_PEER_QP_PROOF_LEN 28
struct dep_peer_qp_req {
  uint8_t token[DEP_PEER_QP_TOKEN_NAME];
  uint64_t mbox_addr;
  uint32_t mbox_rkey;
  uint8_t proof[DEP_PEER_QP_PROOF_LEN];
};
_Static_assert(sizeof(struct dep_peer_qp_req) == 56, "RC connection private data holds 56 bytes");

/*
 * The data connections of the inter-node data path (daemon/xfer.h).  Over
 * an authenticated link a daemon sends DATA_OFFER: a random single-use
 * token.  The peer then opens a TCP connection to the sender's listener
 * whose first and only frame is DATA_HELLO with that token and its own
 * listen_port; from there on the connection carries the data stream
 * (xring.h: the listener's challenge, the opener's proof of the peer key,
 * the ack, then dep_xfer_hdr and payloads, from the opener to the
 * listener).  The token names the offer; the proof, not the token, is
 * what opens the connection.
 */
struct dep_peer_data_offer {
  uint8_t token[DEP_PEER_TOKEN_LEN];
};
struct dep_peer_data_hello {
  uint8_t token[DEP_PEER_TOKEN_LEN];
  uint16_t listen_port; /* the opener's listen.port: names it among a host's daemons */
};

/* JOB_FAIL and JOB_END; MEMBERSHIP_OK carries job_id and owner_uid only. */
struct dep_peer_job_event {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t rank;     /* the global rank that left, or DEP_PEER_NO_RANK */
  uint32_t detached; /* 1: it detached; 0: it died or the job failed */
  int32_t code;      /* JOB_FAIL: < 0; JOB_END: 0 */
  char message[DEP_MSG_TEXT_MAX];
};

/* JOB_MASK: rank `rank` of an elastic job, held by the sender, left it or comes back. */
struct dep_peer_job_mask {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t rank;   /* the global rank */
  uint32_t gen;    /* its changes so far, this one included: odd (masked), even (back) */
  uint32_t why;    /* DEP_SLAB_GONE_DIED / DETACHED / NODE; DEP_JOB_EVENT_REJOINED (even) */
  uint64_t epoch;  /* the sender's epoch after it (for the logs: the receiver computes its own) */
  uint64_t join;   /* gen even: the first call the rank takes part in again; odd: 0 */
};

/* JOB_JOINED: the answer to a JOB_MASK that brings a rank back (gen even). */
struct dep_peer_job_joined {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t rank;   /* the JOB_MASK's */
  uint32_t gen;    /* the JOB_MASK's (even) */
  uint32_t ok;     /* 1: no rank of the sender had posted join - 1; 0: they ran past it */
  uint64_t posted; /* the largest call the sender's ranks had posted (for the refusal) */
};

/* JOB_HELD: the sender runs this elastic job, and this is its view (sets: bit r of byte r / 8). */
struct dep_peer_job_held {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t world_size;
  uint8_t live[DEP_PEER_RANK_BYTES]; /* the ranks live in the sender's mask */
  uint8_t held[DEP_PEER_RANK_BYTES]; /* of those, the ones the sender holds */
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
    struct dep_peer_job_event job; /* JOB_FAIL, JOB_END, MEMBERSHIP_OK */
    struct dep_peer_job_mask mask; /* JOB_MASK */
    struct dep_peer_job_joined joined; /* JOB_JOINED */
    struct dep_peer_job_held held; /* JOB_HELD */
    struct dep_peer_xport xport;
    struct dep_peer_error nak;     /* XPORT_NAK */
    struct dep_peer_data_offer data_offer;
    struct dep_peer_data_hello data_hello;
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
