/*
 * xring.h — how a rank of a job that spans nodes hands blocks to its
 * daemon's proxy (DESIGN §7), defined once for the library that fills the
 * ring and the daemon that drains it.
 *
 * A rank's ring is the start of one sealed memfd the daemon makes when the
 * job's local ranks are all attached and lends after the attach
 * (XRING_LEND), mapped by both; the rank's exchange region (slab.h: its
 * in and out slots and blocks, host memory) follows it at
 * DEP_XRING_BYTES, and the memfd is DEP_XRING_BYTES + xchg_bytes long.
 * The rank is the ring's only producer, one proxy thread of the daemon
 * its only consumer.  For each remote destination of a call the rank has
 * filled the out block and out slot of its exchange region and then
 * pushes one descriptor:
 *
 *   entries[head % entries] = {dest, parity, seq, bytes, kind = BLOCK};
 *   head = head + 1               (store with release ordering)
 *
 * and the proxy, having taken the block and then the slot (into a frame,
 * or as RDMA writes into the remote rank's in block and in slot), stores
 * tail = tail + 1 (release).  The daemon that holds the destination writes
 * a frame's payload into the destination's in block, then the slot's
 * fields, then its flag (release), with plain stores into the memfd: on
 * the cuda backend the kernels wait on that flag in host memory mapped for
 * the device, and no daemon copies into or out of GPU memory.  A full ring
 * (head - tail == entries) makes the rank wait, bounded by the op timeout
 * like every wait of the operations; it never overwrites.
 *
 * A channel between nodes (slab.h; the streamed throughput calls, on
 * either backend) is moved chunk by chunk instead: a CHUNK descriptor names rows
 * row0 .. row0 + bytes / row_bytes of the call's stream to dest, at their
 * ring rows of the out channel, with the slot image too when SLOT is set
 * (the first chunk of a call, or the slot alone for a stream of no rows);
 * the far daemon writes the rows into the destination's in channel, then
 * the chunk's mark, then (SLOT) the slot.  A CREDIT descriptor names a
 * remote source (dest) whose channel to this rank it has taken rows of:
 * the proxy carries the rank's credit word (its in slot's) to the daemon
 * holding the source.  A TAKEN descriptor names a remote source (dest)
 * whose post of call seq this rank has read to its end after it posted a
 * later call (a split receive, host_ops.h "Split calls"): the proxy
 * carries the rank's taken word (its in slot's) to the daemon holding the
 * source, which stores it into the source's out slot taken word if it is
 * larger, as a credit.
 *
 * One crossing per destination node (DESIGN §7): where the daemon says so
 * in the ring's fan table (below), a dispatch's rows for the ranks of one
 * node go as one node channel instead of one channel per rank: each token
 * that goes to any of that node's ranks is one row, in token order, with
 * its global expert ids and its weights as the caller gave them (a cached
 * dispatch: ids naming an expert of each destination, weights unread).
 * The node channel's ring is the out channel of the node's lead remote
 * rank (the fan table's), chan_rows rows; a NODE descriptor names rows
 * row0 .. row0 + bytes / row_bytes of it (dest: the lead), and for each
 * remote rank d of the node the out mark word of d at chunk row0 /
 * chunk_rows holds DEP_XRING_NODE_AT(start, count): d's rows of the chunk
 * are its stream's rows start .. start + count.  The proxy sends the
 * chunk with those words as a table (dep_xfer_node, dep_xfer_node_dest)
 * in front of the rows, and the far daemon writes each row, its ids and
 * weights remapped as the rank would have written them, into each
 * destination's in channel from this rank at that destination's ring
 * row, then adds the rows it wrote to each chunk's mark.  Each
 * destination's slot goes alone (SLOT, no rows) at the start of the call,
 * and credits stay per (source, destination rank) as above.
 *
 * Nothing the ring holds is trusted by the daemon: each descriptor is
 * checked against the job's layout (a destination on another node, a
 * parity of 0 or 1, bytes within a block) before anything moves, and a
 * rank that writes a bad one has its job failed.
 */
#ifndef DEP_XRING_H
#define DEP_XRING_H

#include <stddef.h>
#include <stdint.h>

#include "ccuda.h"
#include "deepep.h"
#include "slab.h"

/*
 * The ring's layout history (DEP_XRING_VERSION, the only one; XRING_LEND_OK
 * states it and the library maps only its own, which the control
 * protocol's version window already implies: proto.h, version 6):
 *   1  the ring alone.
 *   2  the exchange region follows the ring in the memfd (xchg_bytes).
 *   3  a descriptor says its kind (block, chunk, credit) and a chunk's
 *      first row, and the exchange region has its chunks' marks.
 *   4  the fan table after the descriptors, NODE descriptors (a node
 *      channel's chunk), and a chunk's mark counts the rows in (slab.h)
 *      rather than naming the call and the chunk's last row.
 *   5  TAKEN descriptors (a split receive's taken word, carried back to
 *      the source's out slot).
 */
#define DEP_XRING_MAGIC 0x47525844u /* "DXRG" */
#define DEP_XRING_VERSION 5
/* Descriptors a ring holds, a power of two: every remote rank's block of
 * two calls in flight for worlds of up to ~512 remote ranks; above that a
 * rank's posts wait for the proxy to drain (bounded by the op timeout, as
 * every wait), which is correct and slower. */
#define DEP_XRING_ENTRIES 1024u

/* dep_xring_desc.kind, and a frame's (dep_xfer_hdr): what it moves. */
#define DEP_XRING_BLOCK 0u  /* the block's first `bytes`, then the slot image */
#define DEP_XRING_CHUNK 1u  /* rows of the channel from row0, then the chunk's mark */
#define DEP_XRING_SLOT 2u   /* or-ed into CHUNK: the slot image after the mark */
#define DEP_XRING_CREDIT 4u /* the credit word for the channel from dest */
#define DEP_XRING_NODE 8u   /* rows of a node channel from row0, for the ranks of dest's node */
#define DEP_XRING_TAKEN 16u /* the taken word for the slot of call seq from dest */
/* A node channel's out mark word for one destination rank (above): the
 * destination's rows of the chunk are its stream's start .. start + count. */
#define DEP_XRING_NODE_AT(start, count) (((uint64_t)(start) << 32) | (uint32_t)(count))

/* One block, chunk or credit for the proxy to move (32 bytes). */
struct dep_xring_desc {
  uint32_t dest;   /* the global rank it is for: one on another node */
  uint32_t parity; /* seq & 1: which outbox block and slot image */
  uint64_t seq;    /* the call: the slot image's flag */
  uint64_t bytes;  /* of the payload: a block's from its start (<= xblock_bytes), a chunk's
                      from row0's ring row (whole rows, at most chunk_rows of them) */
  uint32_t kind;   /* DEP_XRING_*: BLOCK, CHUNK (| SLOT), SLOT, CREDIT, NODE or TAKEN */
  uint32_t row0;   /* CHUNK: the chunk's first row in the call's stream (a multiple of
                      chunk_rows) */
};

struct dep_xring {
  uint32_t magic, version;
  uint32_t entries;           /* DEP_XRING_ENTRIES */
  uint32_t rank;              /* the global rank that fills it */
  uint64_t xchg_bytes;        /* the exchange region's size after the ring (slab.h) */
  uint8_t pad0[40];
  DEP_ATOMIC(uint64_t) head;     /* descriptors pushed: the rank's */
  uint8_t pad1[56];
  DEP_ATOMIC(uint64_t) tail;     /* descriptors moved: the proxy's */
  uint8_t pad2[56];
  /* The proxy's word for the rank: 0, or the DEP_ERR_* code with which it
   * stopped draining this ring (its job failed, its peer is gone); a rank
   * waiting for room reads it and stops waiting. */
  DEP_ATOMIC(int32_t) failed;
  uint8_t pad3[60];
  struct dep_xring_desc desc[DEP_XRING_ENTRIES];
  /*
   * The fan table, written by the daemon before it lends the ring: for
   * each remote rank number ri (slab.h), 0 when this rank's rows for it
   * cross one channel per rank, else 1 + the remote rank number of the
   * lead of its node, whose out channel carries the node channel.  Every
   * node of more than one rank of the job takes one, over TCP or over
   * RDMA (into the far daemon's staging, dep_xfer_rdma_stage below): its
   * daemon fans it out either way.
   */
  uint16_t fan[DEP_MAX_WORLD];
};

#define DEP_XRING_BYTES ((sizeof(struct dep_xring) + 4095u) / 4096u * 4096u)

/* The exchange region of the memfd whose ring is r: right after it. */
static inline uint8_t *dep_xring_xchg(struct dep_xring *r) {
  return (uint8_t *)r + DEP_XRING_BYTES;
}

/*
 * The stream of a data connection between two daemons (daemon/xfer.h):
 * after DATA_HELLO (peer_proto.h) the listener sends a challenge (magic,
 * version, a fresh random nonce); the opener answers with its proof, a MAC
 * with a key derived from peer_key_file over the nonce, the DATA_OFFER's
 * token and the direction (daemon/peerauth.h), so that holding the key,
 * not having seen the token, is what opens a data connection; the
 * listener then answers the ack (magic, version), or closes the
 * connection when the proof is wrong.  Then the opener sends frames, each
 * a header (dep_xfer_hdr in its wire form, below) and `bytes` of payload.
 *
 * An RDMA data queue pair (daemon/xfer_rdma.h) is opened with a
 * DATA_OFFER's token too, in its connection request's private data
 * (dep_xfer_rdma_req): there is no stream before the queue pair is
 * accepted to carry a challenge, so the offer's token, fresh, random,
 * single-use and chosen by the accepting end, is the nonce, and the proof
 * is a MAC with the same derived key over the version and the token
 * (daemon/peerauth.h).  The accepting end rejects a request whose proof is
 * wrong and leaves the offer open.
 *
 * Version history (the data stream's own and only one, beside the peer
 * protocol's in peer_proto.h; DEP_XFER_VERSION is the last entry):
 *   1  initial: DATA_HELLO, the ack, frames.
 *   2  the challenge and the proof before the ack (the token alone, seen
 *      in clear on the peer link, no longer opens a connection).
 *   3  an RDMA data queue pair's request carries the version and a proof
 *      beside the token (dep_xfer_rdma_req); before, the token alone, with
 *      12 bytes of zeros, opened it.
 *   4  a frame says its kind (a block, a chunk of a channel, a credit) and
 *      a chunk's first row: the channels between nodes (slab.h).
 *   5  NODE frames (a node channel's chunk: the dep_xfer_node table, then
 *      its rows, fanned out by the receiving daemon), and a chunk's mark
 *      counts its rows in: the receiving daemon adds a frame's rows to it.
 *   6  an RDMA data queue pair's acceptance carries the accepting
 *      daemon's staging for NODE frames (dep_xfer_rdma_stage).
 *   7  TAKEN frames (a receiver's taken word for one call of a source,
 *      seq the call, stored into the source's out slot if larger: split
 *      calls across nodes, host_ops.h).
 *
 * The window this build answers is DEP_XFER_MIN_VERSION..DEP_XFER_VERSION:
 * the opener checks the listener's challenge against it and names both
 * when it is outside.  Versions 1 and 2 are never answered: their
 * connections, or their RDMA queue pairs, open on the token alone.
 */
#define DEP_XFER_MAGIC 0x46584444u /* "DDXF" */
#define DEP_XFER_VERSION 7
#define DEP_XFER_MIN_VERSION 7
#define DEP_XFER_NONCE_LEN 32
#define DEP_XFER_MAC_LEN 32
struct dep_xfer_ack {
  uint32_t magic, version;
};
struct dep_xfer_challenge {
  uint32_t magic, version;
  uint8_t nonce[DEP_XFER_NONCE_LEN];
};
struct dep_xfer_proof {
  uint8_t mac[DEP_XFER_MAC_LEN];
};
/*
 * The private data of an RDMA data queue pair's connection request: the
 * 56 bytes a reliable connection's request carries hold the token (32),
 * the version (4) and 20 bytes of the proof's MAC, its first ones.  A MAC
 * cut to 160 bits is still more than half the hash's 256 (RFC 2104's
 * bound), and each guess at it costs a connection request that is
 * answered with a rejection: the whole MAC would need a token cut short,
 * and the offers are named by their whole token.
 */
#define DEP_XFER_RDMA_PROOF_LEN 20
struct dep_xfer_rdma_req {
  uint8_t token[32];        /* DEP_PEER_TOKEN_LEN (peer_proto.h) */
  uint32_t version;         /* DEP_XFER_VERSION */
  uint8_t proof[DEP_XFER_RDMA_PROOF_LEN];
};
DEP_STATIC_ASSERT(sizeof(struct dep_xfer_rdma_req) == 56,
                  "RC connection private data holds 56 bytes");
/*
 * The private data of an RDMA data queue pair's acceptance (version 6):
 * the accepting daemon's staging for the connecting one, memory of its own
 * registered with its NIC (daemon/xfer_rdma.h).  At `addr` (rkey), a
 * credit word, then `chunks` chunks of `chunk_bytes` each, the first at
 * DEP_XFER_STAGE_HEAD: the connecting daemon writes a NODE frame (its
 * header's wire form, then its payload) into a chunk after the chunk's
 * first 64 bytes, then the chunk's ready word (its first 8: the number of
 * chunks it has written so far, this one included), on one queue pair in
 * order; the accepting daemon fans the frame out as it does a frame over
 * TCP and writes into the connecting daemon's staging's credit word, over
 * its own queue pair into that daemon, 1 + the number of chunks it has
 * freed (0: it has no queue pair into the writer to say it with yet).
 */
struct dep_xfer_rdma_stage {
  uint64_t addr;
  uint32_t rkey;
  uint32_t chunks;
  uint64_t chunk_bytes;
};
#define DEP_XFER_STAGE_HEAD 64u /* the credit word's room, before the first chunk */
#define DEP_XFER_STAGE_DATA 64u /* a chunk's ready word's room, before its frame */
/*
 * A frame's header, as the daemons use it; on the wire it is the codec's
 * (codec.h) fixed form of DEP_XFER_HDR_WIRE bytes, one field table
 * (xring.c) in this order, little-endian, no padding:
 *
 *     0  magic u32   4  src u32   8  dest u32   12  parity u32
 *    16  seq u64    24  bytes u64   32  kind u32   36  row0 u32
 *    40  job_id, DEP_JOB_ID_MAX bytes: the id, then NULs (at least one)
 *   104  slot, DEP_SLAB_CTRL_SLOT bytes: the slot image as it is
 *
 * These are the bytes the struct itself has on the little-endian hosts
 * the project builds for, which earlier builds sent raw.
 */
struct dep_xfer_hdr {
  uint32_t magic;           /* DEP_XFER_MAGIC */
  uint32_t src;             /* the sending rank (on the opener's node) */
  uint32_t dest;            /* the receiving rank (on the listener's node) */
  uint32_t parity;
  uint64_t seq;             /* the call; the slot image's flag */
  uint64_t bytes;           /* payload after this header: <= the layout's block_bytes */
  uint32_t kind;            /* DEP_XRING_*, as the descriptor's */
  uint32_t row0;            /* CHUNK: the chunk's first row; CREDIT: the rows taken
                               (TAKEN: 0, seq is the call taken) */
  char job_id[DEP_JOB_ID_MAX];
  uint8_t slot[DEP_SLAB_CTRL_SLOT]; /* the control slot, flag first, as the sender wrote it
                                       into its out slot */
};
#define DEP_XFER_HDR_WIRE (6u * 4u + 2u * 8u + DEP_JOB_ID_MAX + DEP_SLAB_CTRL_SLOT)

/*
 * A NODE frame's payload: this table, then the chunk's rows (row_bytes
 * each, as the sender's node channel holds them).  n_dest entries follow
 * the table's head, one per destination rank with rows in the chunk; the
 * receiving daemon checks each row's destinations (from its ids) against
 * them before it writes a byte.
 */
struct dep_xfer_node {
  uint32_t n_dest; /* entries that follow: 1 .. the ranks of the node */
  uint32_t rows;   /* rows after the table: bytes / row_bytes of the descriptor */
};
struct dep_xfer_node_dest {
  uint32_t dest;   /* a global rank the receiving daemon holds */
  uint32_t start;  /* its first row of the chunk in the call's stream to it */
  uint32_t count;  /* its rows in the chunk: start .. start + count */
  uint32_t pad;
};
/* A NODE frame's table for n destinations, in bytes. */
#define DEP_XFER_NODE_BYTES(n) \
  (sizeof(struct dep_xfer_node) + (uint64_t)(n) * sizeof(struct dep_xfer_node_dest))

struct proto_buf;
/* Append h's wire form (DEP_XFER_HDR_WIRE bytes) to b: 0, or
 * DEP_ERR_INVALID (a magic not DEP_XFER_MAGIC, a job id without its NUL) or
 * DEP_ERR_NO_MEMORY, with b as it was. */
int dep__xfer_hdr_encode(struct proto_buf *b, const struct dep_xfer_hdr *h);
/* Read the len bytes at p, a header's whole wire form, into h: 0, or
 * DEP_ERR_PROTOCOL with why (a length not DEP_XFER_HDR_WIRE, a magic not
 * DEP_XFER_MAGIC, a job id that is not a string NUL-padded to its size). */
int dep__xfer_hdr_decode(const uint8_t *p, size_t len, struct dep_xfer_hdr *h, char *why,
                         size_t whylen);

/*
 * The slot image and the payloads are bytes of the exchange regions,
 * carried as one node's ranks wrote them in its byte order and read as
 * they are by the other node's ranks (and the receiving daemon reads the
 * slot's flag so): the nodes of a job must share a byte order, and the
 * project builds for little-endian hosts only.  The frame header does
 * not need it (the codec); the handshake's words (dep_xfer_ack,
 * dep_xfer_challenge, dep_xfer_rdma_req's version) still go as raw
 * structs and do.
 */
DEP_STATIC_ASSERT(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
                  "the data path carries exchange region bytes between hosts as they are");

#endif /* DEP_XRING_H */
