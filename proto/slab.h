/*
 * slab.h — the size and layout of one rank's slab, computed by one function
 * that the daemon (to lend the memory) and the library (to check what it
 * received and to address it) share.  Changing the layout changes what both
 * ends compute, so it is part of the protocol: bump DEP_PROTO_VERSION with it.
 *
 * A slab is the receive side of one rank.  Peers push into it (DESIGN §6):
 *
 *   ctrl    4 KiB-aligned: an error word block, then for each call parity
 *           (2) and each source rank (world_size) one 64-byte slot holding
 *           the source's sequence flag and row count for that call.
 *   data    for each parity, for each source rank, one block of
 *           block_bytes: what that source pushed in a call of that parity
 *           (a channel, when the job streams: below).
 *   priv    4 KiB-aligned, last: the rank's own scratch, which no peer
 *           reads or writes.  The cuda library keeps its operation state,
 *           its FP8 staging rows, its warm-up's world of one and the
 *           warm-up's handle there, rather than allocating them at every
 *           attach, where a cuMemAlloc per rank is a large part of the
 *           attach (BENCHMARKS.md).  dep__slab_priv carves it.
 *
 * A rank of a job that spans nodes has, beside its slab, an exchange
 * region in host memory: the memfd of its ring to the daemon's proxy
 * (xring.h), after the ring.  The ranks on other nodes ("remote", numbered
 * in rank order among the ranks this node does not hold) are reached only
 * through it, so that the daemon moves their bytes with plain loads and
 * stores, never a copy into or out of GPU memory (DESIGN §7):
 *
 *   in_slot   for each parity and each remote source, the 64-byte control
 *             slot the daemon writes for it (rows, op, ref_seq, num_tokens,
 *             then the flag last with release ordering).  Its credit word
 *             is this rank's: the rows of that source's channel it has
 *             taken, which the proxy carries back (below).
 *   out_slot  for each parity and each remote destination, the control
 *             slot this rank means for it, flag included, as it would
 *             have written it into a local peer's ctrl.  Its credit word
 *             is the daemon's: the rows the destination has taken, as its
 *             node's daemon last reported them.
 *   in_mark   for each parity, remote source and chunk of the ring
 *             (DEP_SLAB_CHUNKS), DEP_SLAB_CHAN_AT(call, rows): the count of
 *             that chunk's rows of the call that are in the in block.  The
 *             daemon adds each frame's rows to it (release) once they are
 *             written, starting from 0 when the word names another call;
 *             an RDMA write stores the sender's count behind the rows; and
 *             this rank sets it back to 0 once it has taken the chunk,
 *             before it credits it (no row of a later chunk of the call in
 *             that place comes before the credit).
 *   out_mark  the same words as this rank means them for each remote
 *             destination (the source of an RDMA write of the mark): the
 *             chunk's rows; for a destination whose rows go through a
 *             node channel (xring.h), its start and count in the node's
 *             chunk (DEP_XRING_NODE_AT), which the proxy reads.
 *   in        4 KiB-aligned: for each parity and each remote source, one
 *             block of xblock_bytes: what that source pushed in a call of
 *             that parity, or that source's channel.
 *   out       4 KiB-aligned: for each parity and each remote destination,
 *             one block: the rows this rank means for it, or its channel.
 *
 * A whole block (the low-latency calls, and the throughput calls of a job
 * that does not stream) goes as before: the rank fills out and out_slot and pushes a
 * descriptor (xring.h); the proxy sends both, payload before slot, to the
 * daemon holding the destination, which writes them into its in and
 * in_slot.  A channel between nodes (the throughput calls of a job that
 * streams, on either backend: kernels/ops_stream.cuh on cuda) mirrors a
 * local one: the rank posts its out slot, fills the out channel
 * chunk by chunk as the destination's credit allows (out_slot's credit
 * word), writes each chunk's out_mark and pushes a chunk descriptor; the
 * far daemon writes the rows at the same ring rows of the destination's
 * in channel, then adds to its in_mark.  Chunks may come over different
 * data connections in any order, and a chunk of a node channel (xring.h)
 * holds rows of several destinations' chunks: a chunk's own count, not a
 * tail that counts rows in order, says it is in.  The receiver takes rows in order, stores
 * its credit in in_slot and pushes a credit descriptor; the proxy carries
 * the word to the source's daemon, which stores it into the source's
 * out_slot credit if it is larger (credits too may cross).
 *
 * A receiver reads a local source's slot and block in its slab and a
 * remote source's in its exchange region: the same fields, the same
 * waits, the same ordering.  (A remote source's slot and block in the slab
 * stay unused: the slab's layout is one for every count of remote ranks.)
 *
 * Streaming (DESIGN §6): a job whose chunk_rows (the daemon's
 * stream_chunk_rows) is below max_tokens_per_rank has, for each (parity,
 * source), a channel rather than a whole block: a ring of DEP_SLAB_CHUNKS
 * chunks of chunk_rows rows (chan_rows rows in all) in the same place,
 * which the sender fills as the receiver's credit allows.  Row r of a
 * call's stream from a source is at ring row r % chan_rows.  A local
 * slot's tail and credit words (struct ops_slot, kabi.h) carry the rows
 * published and consumed, packed with the call (DEP_SLAB_CHAN_AT), so that
 * a reader never takes a count from an earlier call of the same parity for
 * this one's; a remote source's chunks are told by their marks.
 *
 * A block holds either max_tokens_per_rank rows of row_bytes (a bf16 token
 * with its remapped top-k ids, weights and source index, or an FP8 token
 * with its scales: dispatch; a bf16 vector: throughput combine), or the
 * low-latency combine's vectors, one bf16 vector per (token, expert on the
 * sending rank): max_ll_tokens * min(topk, local experts) of them.
 */
#ifndef DEP_SLAB_H
#define DEP_SLAB_H

#include <stdint.h>

#include "ccuda.h"
#include "deepep.h"

#define DEP_SLAB_CTRL_SLOT 64u  /* bytes per (parity, source) control slot */
#define DEP_SLAB_ERR_BYTES 64u  /* error words at the start of ctrl */
#define DEP_SLAB_ALIGN 4096u
/*
 * The abort words: the last 16 of the error words, after the rank's own
 * error record (host_ops.h).  The daemon writes them when a rank of a
 * running job is gone (its process died, or it detached), into the slab of
 * every rank left: rank and pid first, code last with release ordering.
 * Every bounded wait of the operations polls code once its own condition
 * is not met, so the peers of a dead rank fail within milliseconds with
 * DEP_ERR_PEER naming it, not after limits.op_timeout_ms.
 */
#define DEP_SLAB_ABORT_OFF 48u
struct dep_slab_abort {
  uint32_t rank;   /* the global rank that is gone */
  uint32_t pid;    /* its process */
  uint32_t detached; /* DEP_SLAB_GONE_*: how it went */
  int32_t code;    /* 0, or DEP_ERR_PEER: written last */
};
/* dep_slab_abort.detached.  A rank that died or detached fails the waits
 * that depend on it; a lost node (its daemon's peer link dropped), every
 * wait: its other ranks are gone with it, whatever they posted.  The
 * library itself writes DEP_SLAB_GONE_DAEMON into its own rank's words
 * (client/watch.c) when its control connection to this node's daemon
 * closes in a job that spans nodes: the daemon's proxy carried the job's
 * links to the other nodes, so every wait fails, with
 * DEP_ERR_DAEMON_GONE; rank is then DEP_SLAB_GONE_NO_RANK, which names no
 * rank of any world, so that a reader that knows only the codes above
 * (the kernels) fails every wait too.  DEP_SLAB_GONE_CUT: this node's part
 * of an elastic job lost a split (daemon/job_elastic.c elastic_cut), and
 * the job went on without this node: rank names one of this node's own
 * ranks (live in every view its ranks may hold, so that every wait fails),
 * and pid is not a pid but a rank of the part that went on, whose node
 * deepepctl status names.  Its value skips 4 and 5, the job events'
 * (proto.h DEP_JOB_EVENT_*), so that a reason and an event never share a
 * number.  How it went is 3 bits in an error record (kabi.h OPS_ERR_GONE). */
#define DEP_SLAB_GONE_DIED 0u     /* it disconnected (its process ended) */
#define DEP_SLAB_GONE_DETACHED 1u /* it detached (or freed its handle) */
#define DEP_SLAB_GONE_NODE 2u     /* rank names the first rank of a node that is lost */
#define DEP_SLAB_GONE_DAEMON 3u   /* this node's daemon stopped, died or restarted */
#define DEP_SLAB_GONE_CUT 6u      /* this node lost a split; pid: a rank of the part that went on */
/* Whether the words fail every wait (a node's ranks all gone), not only those on the rank. */
#define DEP_SLAB_GONE_EVERY(how) ((how) == DEP_SLAB_GONE_NODE || (how) == DEP_SLAB_GONE_CUT)
#define DEP_SLAB_GONE_NO_RANK 0xffffffffu
DEP_STATIC_ASSERT(DEP_SLAB_ABORT_OFF + sizeof(struct dep_slab_abort) <= DEP_SLAB_ERR_BYTES,
                  "the abort words must fit the error words");
/*
 * The live mask (DESIGN §14): after the control slots, an epoch word, then
 * one bit per rank of the world (bit r % 64 of word r / 64 set: rank r is
 * masked).  The daemon alone writes it, into the slab of every rank left,
 * when a rank of an elastic job is gone or rejoins: the bits first, the
 * epoch last with release ordering, so that an operation that reads the
 * epoch (acquire) and then the bits sees the mask of that epoch or of a
 * later one.  It starts zero (epoch 0, every rank live) in a new job and
 * stays zero in a job that is not elastic.  A rank's own mask (DeepEP's
 * low_latency_update_mask_buffer) is the library's, not these words.
 *
 * After the bits, a join word per rank (dep_slab_mask_join): the first call
 * (seq) in which that rank takes part again after it was masked; 0 for a
 * rank never brought back.  Rank r is masked in call s iff its bit is set
 * or s < join[r]: a rule that needs no memory of earlier epochs, so a
 * reader that skipped one decides as every other.  The daemon clears a
 * rank's bit only when a process has taken its place (it attached with the
 * rank's id), writing join first: a call J above every call the survivors
 * have posted (their slots' flags), checked again after the epoch is out
 * (daemon/job_elastic.c), so that no survivor starts call J before it can
 * see the epoch that makes the rank live from J.  The process that came
 * back reads join for its own rank and makes J its first call.
 */
#define DEP_SLAB_MASK_BIT(rank) (1ull << ((rank) % 64u))
#define DEP_SLAB_MASK_WORDS(world) (((uint64_t)(world) + 63u) / 64u)
/* The whole area: the epoch, the bits and the join words. */
#define DEP_SLAB_MASK_AREA_BYTES(world) \
  (sizeof(uint64_t) * (1u + DEP_SLAB_MASK_WORDS(world) + (uint64_t)(world)))

/* The largest GPU (in SMs) whose per-CTA scratch the private area holds. */
#define DEP_SLAB_MAX_SMS 512u

/* Chunks in a channel's ring: a sender fills one while the receiver drains others. */
#define DEP_SLAB_CHUNKS 4u
/* A channel's tail or credit word: rows counted in call seq, comparable
 * across calls (a later call's count is larger than any earlier one's).
 * Rows stay below 2^20 (shape.h's DEP_SHAPE_MAX_TOKENS is 2^16); the call
 * counter stays below 2^44 for 200 days at a million calls a second (a
 * throughput call takes tens of microseconds at the least). */
#define DEP_SLAB_CHAN_SHIFT 20u
#define DEP_SLAB_CHAN_AT(seq, rows) (((uint64_t)(seq) << DEP_SLAB_CHAN_SHIFT) | (uint64_t)(rows))

struct dep_slab_layout {
  uint32_t world_size;
  uint32_t max_tokens;
  uint32_t chunk_rows;   /* rows a sender publishes at a time (max_tokens: no streaming) */
  uint32_t chan_rows;    /* rows a local channel holds: max_tokens, or DEP_SLAB_CHUNKS chunks */
  uint64_t ctrl_off;    /* always 0 */
  uint64_t ctrl_bytes;   /* error words, control slots and the live mask */
  uint64_t mask_off;     /* the live mask's epoch word; its bits follow */
  uint32_t max_ll_tokens; /* the low-latency bound in effect */
  uint64_t row_bytes;
  uint64_t block_bytes;  /* one source's block (or channel) in one parity of the slab */
  uint64_t xblock_bytes; /* one block (or channel) of the exchange region: block_bytes */
  uint64_t data_off;
  uint64_t parity_bytes; /* world_size * block_bytes */
  uint64_t priv_off;     /* the rank's own scratch: after the data, 4 KiB aligned */
  uint64_t priv_bytes;
  uint64_t total_bytes;  /* priv_off + priv_bytes, before rounding to chunks */
  /* The exchange region (above), offsets from its start; all 0 in a
   * single-node job.  Each holds 2 * n_remote slots or blocks, by
   * (parity, remote rank number). */
  uint32_t n_remote;     /* ranks of the job on other nodes (0: a single-node job) */
  uint64_t in_slot_off, out_slot_off, in_mark_off, out_mark_off, in_off, out_off;
  uint64_t xchg_bytes;   /* the region's size: out_off + its blocks, 4 KiB aligned */
};

/*
 * Compute the layout for a job shape whose local_world_size ranks of
 * world_size are on this node (the rest, on other nodes, give it an
 * exchange region), streaming in chunks of chunk_rows rows (0, or at least
 * max_tokens_per_rank: whole blocks).  Returns 0, or DEP_ERR_INVALID when
 * the shape is out of range, local_world_size is not 1..world_size or the
 * size would overflow (message in why).
 */
int dep__slab_layout_nodes(const struct dep_job_shape *shape, uint32_t world_size,
                          uint32_t local_world_size, uint32_t chunk_rows,
                          struct dep_slab_layout *out, char *why, size_t whylen);

/* The rows of a channel chunk_rows makes for max_tokens rows a call (0: whole blocks). */
static inline uint32_t dep_slab_chan_rows(uint32_t max_tokens, uint32_t chunk_rows) {
  if (chunk_rows == 0 || (uint64_t)chunk_rows * DEP_SLAB_CHUNKS >= max_tokens)
    return max_tokens;
  return chunk_rows * DEP_SLAB_CHUNKS;
}

/* The layout of a single-node job that does not stream: dep__slab_layout_nodes with every rank local. */
int dep__slab_layout(const struct dep_job_shape *shape, uint32_t world_size,
                    struct dep_slab_layout *out, char *why, size_t whylen);

/*
 * The private area's parts, as offsets from its start, and its size (end):
 * the cuda library's counters (struct cuops_dev, kabi.h) and its counters
 * per rank of the world (world: kabi.h cuops_world_carve), the layout's
 * per-expert scratch, the low-latency FP8 staging rows, the dispatch's
 * per-warp count scratch (tcnt, tcnt_bytes: for a GPU of up to
 * DEP_SLAB_MAX_SMS SMs), the warm-up's counters, their arrays for its
 * world of one, and that world's slab (loop_dev, loop_world, loop_slab)
 * and its handle (warm_handle).  One function carves
 * it: the layout's priv_bytes is its end, and the library addresses the
 * parts by its offsets, so the two cannot disagree.  The host backend keeps
 * nothing there; the area is part of the layout all the same, which is one
 * for both backends.
 */
struct dep_slab_priv {
  uint64_t dev, world, scratch, stage, tcnt, tcnt_bytes, loop_dev, loop_world, loop_slab,
      warm_handle, end;
};
void dep__slab_priv(const struct dep_job_shape *shape, uint32_t world_size,
                    const struct dep_slab_layout *lay, struct dep_slab_priv *out);

/* Take the next part of `bytes` (256-byte aligned; 0 takes one unit) from *off. */
static inline uint64_t dep_carve(uint64_t *off, uint64_t bytes) {
  const uint64_t at = *off;
  *off += (((bytes ? bytes : 1) + 255u) / 256u) * 256u;
  return at;
}

/* What memory made for a layout is cached under: dep__shape_key's and the
 * channels' rows (the slab does not depend on how many ranks are remote:
 * their bytes pass through the exchange region, which is not pool memory). */
uint64_t dep__slab_key(const struct dep_job_shape *shape, uint32_t world_size, uint32_t chunk_rows);

/*
 * The addressing is written once, here, on the layout's numbers alone:
 * the functions below apply it to a struct dep_slab_layout, and the
 * kernels (kernels/ops_dev.cuh) to the same numbers in their job
 * descriptor (kabi.h struct cuops_job).  These are macros rather than
 * functions so that the kernels' code stays what it was when they wrote
 * each expression out (a function's arguments are evaluated first, which
 * reorders the loads nvcc emits).
 */

/* Where a dispatch row's ids and weights start (kernels/host_ops.h says
 * what a row holds): here, for the daemon too, which remaps a node
 * channel's rows for each of their destinations (xring.h). */
#define DEP_SLAB_IDS_OFF(hidden) (2ull * (hidden) + 16u)
#define DEP_SLAB_WEIGHTS_OFF(hidden, topk) (DEP_SLAB_IDS_OFF(hidden) + 4ull * (topk))

/* Offset of the control slot of (parity, source rank) in a world of `world`. */
#define DEP_SLAB_CTRL_SLOT_AT(world, parity, src) \
  (DEP_SLAB_ERR_BYTES + ((uint64_t)(parity) * (world) + (src)) * DEP_SLAB_CTRL_SLOT)

/* Offset of the block pushed by source `src` in a call of `parity`. */
#define DEP_SLAB_BLOCK_AT(data_off, parity_bytes, block_bytes, parity, src) \
  ((data_off) + (uint64_t)(parity) * (parity_bytes) + (uint64_t)(src) * (block_bytes))

/* The exchange region's entry of remote rank number `ri` (0..n_remote-1)
 * in a call of `parity`: its index among the (parity, remote rank) pairs,
 * and the offset of entry `index` in an array of `unit`-byte entries at
 * `off` (the in or out slots, or blocks). */
#define DEP_XCHG_INDEX(n_remote, parity, ri) ((uint64_t)(parity) * (n_remote) + (uint64_t)(ri))
#define DEP_XCHG_ENTRY_AT(off, unit, index) ((off) + (index) * (unit))
/* The offset of chunk `chunk`'s mark (the stream's chunk number, taken
 * modulo DEP_SLAB_CHUNKS) of entry `index` in the marks at `off` (the in
 * or out marks). */
#define DEP_XCHG_MARK_AT(off, index, chunk) \
  DEP_XCHG_ENTRY_AT(off, sizeof(uint64_t), (index) * DEP_SLAB_CHUNKS + (chunk) % DEP_SLAB_CHUNKS)

/* Offset of the control slot of (parity, source rank). */
static inline uint64_t dep_slab_ctrl_slot(const struct dep_slab_layout *l, unsigned parity,
                                          uint32_t src) {
  return DEP_SLAB_CTRL_SLOT_AT(l->world_size, parity, src);
}

/* Offset of the block pushed by source `src` in a call of `parity`. */
static inline uint64_t dep_slab_block(const struct dep_slab_layout *l, unsigned parity,
                                      uint32_t src) {
  return DEP_SLAB_BLOCK_AT(l->data_off, l->parity_bytes, l->block_bytes, parity, src);
}

/* Offset of row `row` pushed by source `src` in a call of `parity` (a
 * channel's ring row: a streamed call's row r is at r % chan_rows). */
static inline uint64_t dep_slab_row(const struct dep_slab_layout *l, unsigned parity,
                                    uint32_t src, uint32_t row) {
  return dep_slab_block(l, parity, src) + (uint64_t)row * l->row_bytes;
}

/* Offsets in the exchange region of the slot and block of remote rank
 * number `ri` (0..n_remote-1) in a call of `parity`: what it sent this
 * rank (in) and what this rank means for it (out). */
static inline uint64_t dep_xchg_index(const struct dep_slab_layout *l, unsigned parity,
                                      uint32_t ri) {
  return DEP_XCHG_INDEX(l->n_remote, parity, ri);
}
static inline uint64_t dep_slab_in_slot(const struct dep_slab_layout *l, unsigned parity,
                                        uint32_t ri) {
  return DEP_XCHG_ENTRY_AT(l->in_slot_off, DEP_SLAB_CTRL_SLOT, dep_xchg_index(l, parity, ri));
}
static inline uint64_t dep_slab_in_block(const struct dep_slab_layout *l, unsigned parity,
                                         uint32_t ri) {
  return DEP_XCHG_ENTRY_AT(l->in_off, l->xblock_bytes, dep_xchg_index(l, parity, ri));
}
static inline uint64_t dep_slab_out_slot(const struct dep_slab_layout *l, unsigned parity,
                                         uint32_t ri) {
  return DEP_XCHG_ENTRY_AT(l->out_slot_off, DEP_SLAB_CTRL_SLOT, dep_xchg_index(l, parity, ri));
}
static inline uint64_t dep_slab_out_block(const struct dep_slab_layout *l, unsigned parity,
                                          uint32_t ri) {
  return DEP_XCHG_ENTRY_AT(l->out_off, l->xblock_bytes, dep_xchg_index(l, parity, ri));
}
/* Offsets of chunk `chunk`'s mark (a stream's chunk number, taken modulo
 * DEP_SLAB_CHUNKS) of the channel from (in) or to (out) remote rank number
 * ri in a call of parity. */
static inline uint64_t dep_slab_in_mark(const struct dep_slab_layout *l, unsigned parity,
                                        uint32_t ri, uint32_t chunk) {
  return DEP_XCHG_MARK_AT(l->in_mark_off, dep_xchg_index(l, parity, ri), chunk);
}
static inline uint64_t dep_slab_out_mark(const struct dep_slab_layout *l, unsigned parity,
                                         uint32_t ri, uint32_t chunk) {
  return DEP_XCHG_MARK_AT(l->out_mark_off, dep_xchg_index(l, parity, ri), chunk);
}

/* Offsets of the live mask's epoch word and of the word holding rank's bit. */
static inline uint64_t dep_slab_mask_epoch(const struct dep_slab_layout *l) {
  return l->mask_off;
}
static inline uint64_t dep_slab_mask_word(const struct dep_slab_layout *l, uint32_t rank) {
  return l->mask_off + sizeof(uint64_t) * (1u + rank / 64u);
}
/* Offset of rank's join word (above). */
static inline uint64_t dep_slab_mask_join(const struct dep_slab_layout *l, uint32_t rank) {
  return l->mask_off + sizeof(uint64_t) * (1u + DEP_SLAB_MASK_WORDS(l->world_size) + rank);
}

/* Round a size up to a whole number of chunks. */
static inline uint64_t dep_round_up(uint64_t n, uint64_t unit) {
  return (n + unit - 1) / unit * unit;
}

#endif /* DEP_SLAB_H */
