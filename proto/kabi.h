/*
 * kabi.h — the interface between the cuda backend's launcher
 * (client/cuda_ops.c, cuda_attach.c, cuda_handles.c) and its kernels
 * (kernels/ops.cu), defined once and read by both: C11 and CUDA C++
 * alike (ccuda.h).  It builds on what the host backend and the daemon
 * already share: the slab and exchange region layouts and the abort words
 * (slab.h), the proxy's ring (xring.h) and the shape's limits (shape.h).
 * The semantics and the row layout are the host backend's
 * (kernels/host_ops.h); the op codes, the control slot and the error
 * record, which both backends write, are defined here.
 *
 * Protocol on the GPU (DESIGN §6, kernel rules):
 *   - The call counter lives in device memory (cuops_dev.seq): each
 *     communicating kernel reads it, uses seq + 1, and its last CTA to
 *     finish stores seq + 1.  Nothing a call needs comes from the host at
 *     launch time except pointers and num_tokens, so low-latency calls can
 *     be captured in a CUDA graph and replayed.
 *   - Push only: sender CTAs write rows into the peers' slabs, the last
 *     sender CTA of each destination fences (system scope) and stores the
 *     flag with st.release.sys; receiver CTAs wait with ld.acquire.sys.
 *     The throughput ops post the flag (with the row count) before the
 *     rows, and mark each row with the call in its meta word 3 after a
 *     system fence; receivers wait for the flag, then for each row's mark.
 *     Every rank posts to every rank on every call, zero rows included.
 *     A job that streams (slab.h "Streaming": its chan_rows below
 *     max_tokens) launches deepepd::dispatch_stream and ::combine_stream
 *     instead, whose rows go through each receiver's channel as its credit
 *     allows, each CTA's warps split into senders and receivers
 *     (kernels/ops_stream.cuh says how, and why); to a rank on another
 *     node through the exchange region's channels, chunk by chunk, as the
 *     host backend does (slab.h, xring.h CHUNK and CREDIT descriptors).
 *   - A rank on another node (cuops_job.remote_mask) is reached through
 *     this rank's daemon (DESIGN §7, proto/xring.h) and this rank's
 *     exchange region (proto/slab.h): host memory the daemon lent after
 *     the ring, which the library registered for the device.  The rows
 *     and slot for that rank go into the region's out block and out slot
 *     for it instead of a slab, and once every sender of that destination
 *     is done (the arrive counter), one thread fences at system scope and
 *     pushes a descriptor into the ring: a slot of the ring reserved with
 *     an atomic on the device, the descriptor written, then the ring's
 *     head published in reservation order.  A full ring is a bounded wait;
 *     a ring the proxy stopped serving fails the call with the proxy's
 *     code (CUOPS_PHASE_RING).  The daemon's proxy reads the block and
 *     slot with plain loads and sends them (TCP) or writes them (RDMA)
 *     into the exchange region of the remote rank, whose daemon (TCP)
 *     stores the block, then the slot, then the flag with release
 *     ordering, plain stores into host memory: no daemon copies into or
 *     out of GPU memory, so no call waits for the daemon's own context to
 *     get the GPU.  The receiving kernels read a remote source's slot and
 *     rows in the in slot and in block of their exchange region
 *     (recv_slot, recv_block: host memory over the mapping) and a local
 *     source's in their slab, with the same acquire loads at system
 *     scope, bounded waits, error records and abort polling.
 *   - Every wait is bounded by op_timeout_ms on %globaltimer.  A failure
 *     is claimed once (cuops_dev.claim) and recorded in pinned host memory
 *     (cuops_host.err, read by the library without a sync) and in the
 *     slab's error words; the kernel returns, it never traps.
 *   - A wait whose condition is not met after CUOPS_ABORT_POLL_NS also
 *     polls, every time it reads the clock, the abort code in this rank's
 *     own slab (slab.h DEP_SLAB_ABORT_OFF: the daemon writes it when a
 *     rank of the running job is gone), so a dead peer fails the call within
 *     microseconds of the daemon noticing (DEP_ERR_PEER, CUOPS_PHASE_GONE)
 *     rather than after op_timeout_ms; waits shorter than that never load
 *     it, so the steady state pays nothing.  The flag or row is always
 *     checked first, and the abort counts only for a wait on the gone rank
 *     itself or while the gone rank has not posted this call: a peer that
 *     pushed its part and then left (it detached after its last call) is
 *     no error, not even for a wait on another, slower rank.
 *   - Masked ranks (deepep.h): thread 0 of every CTA reads the mask once
 *     as the CTA begins (cuops_mask: the live mask in this rank's slab, or-ed
 *     with cuops_job.own_mask; a bitmap of the world, a word per 64 ranks,
 *     which the CTA keeps in shared memory and every thread's word 0 in a
 *     register, so that a world of at most 64 ranks reads no more than one
 *     word did) and the call skips every masked rank: no
 *     slot or row to it (a CTA still arrives at the counters, so that they
 *     stay in step; the last one posts nothing), no wait for its flag or
 *     rows, no row from it (0 in every count; a cached dispatch's rows from
 *     it, whose place the handle keeps, are zeros), and its experts'
 *     contributions to a combine are zero.  Unlike the host backend's: a
 *     live mask written while a call's CTAs start may be seen by some of
 *     them only, which leaves that call's outputs undefined (a "from call"
 *     word, for the daemon to write, would close it: one edit, in
 *     cuops_mask).  A wait for a source's post that is still unmet after
 *     CUOPS_ABORT_POLL_NS also reads the live bits (left_since): a source
 *     masked since the call began is skipped for the rest of it (its rows
 *     0, its contributions to a combine zero), as on the host backend.
 *   - SM budget: every communicating kernel's sends are world * P units
 *     (unit u: part u % P of the rows for peer u / P) and its grid is
 *     G = min(world * P, B) CTAs of CUOPS_THREADS threads
 *     (dep__kernel_grid, sm_budget.h).  CTA b first sends units b, b + G,
 *     b + 2G, ... in turn, then receives (in the throughput ops, work
 *     claimed from a counter, so that CTAs done sending early receive
 *     while others still push across NVLink).  Every CTA of a kernel must
 *     be resident at once (grid barriers; every rank waits on every rank),
 *     so the grid is never larger than B, whatever the world: a world
 *     above B loops rather than grows.  P = max(1, B / world), where B, the
 *     rank's budget, is the GPU's SMs divided by the job's ranks on that
 *     GPU, at most CUOPS_MAX_CTAS: ranks sharing one GPU all fit at once
 *     (8 ranks on 132 SMs: 16 CTAs each), and a rank alone on its GPU
 *     leaves the rest of it to the trainer's kernels; in a job that spans
 *     nodes, at most CUOPS_XNODE_PARTS * world (dep__xnode_budget: every
 *     CTA of its kernels works across the bus).  $DEEPEP_KERNEL_CTAS
 *     sets B for every rank (at most CUOPS_CTAS_PER_SM * SMs / ranks on the
 *     GPU, or the CTAs an SM holds of a large world's kernels where that
 *     is fewer (dep__fit_ctas: "Shared memory" below), so that all stay
 *     resident; below the world too).  "Ranks on the
 *     GPU" are the job's ranks that this rank's daemon holds there: daemons
 *     that share one GPU
 *     (a test of nodes on one machine) do not see each other's, and must
 *     be given a budget that fits them all.  Each lane keeps
 *     several 16-byte loads in flight (ops_dev.cuh), since a copy with one
 *     load in flight per thread runs at the memory's latency.
 *
 */
#ifndef DEP_KABI_H
#define DEP_KABI_H

#include <stdint.h>

#include "ccuda.h"
#include "deepep.h"
#include "shape.h"
#include "slab.h"
#include "stats_page.h"
#include "xring.h"

#define CUOPS_THREADS 256
#define CUOPS_WARPS (CUOPS_THREADS / 32)
#define CUOPS_MAX_RANKS DEP_MAX_LOCAL_RANKS
/*
 * Shared memory: a receiving CTA keeps the receives' first row (and
 * offset, or count) of each source and what it read of every source's
 * slot (ops_dev.cuh peers: rows, op, ref_seq) in dynamic shared memory
 * sized by the job's world, at these byte offsets for a world of W (the
 * first rows at 0, where the receive's claims scan them at fixed
 * addresses); the low-latency dispatch's per-expert part (CUOPS_LL_SHMEM)
 * follows at CUOPS_SHM_SRC(W).
 * dep__kernel_shmem (sm_budget.h) says what each kernel is launched with;
 * above the 48 KiB a kernel gets without asking, the library opts in as
 * it loads the module (client/cuda_attach.c shmem_fit: up to the GPU's
 * CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, else it refuses
 * the world), and the SM budget's residency counts the CTA's bytes
 * (dep__ctas_per_sm).  So the kernels serve every world up to
 * DEP_MAX_WORLD.
 */
#define CUOPS_SHM_FIRST(W) 0u
#define CUOPS_SHM_OFF(W) (4u * (uint32_t)(W) + 4u)
#define CUOPS_SHM_ROWS(W) (8u * (uint32_t)(W) + 4u)
#define CUOPS_SHM_OP(W) (12u * (uint32_t)(W) + 4u)
#define CUOPS_SHM_REF(W) (16u * (uint32_t)(W) + 8u)
#define CUOPS_SHM_SRC(W) ((24u * (uint32_t)(W) + 8u + 15u) & ~15u)
#define CUOPS_MAX_CTAS 96u
/* A job whose ranks span nodes: its default budget is at most this many CTAs
 * a rank of the world (P at most this: dep__xnode_budget). */
#define CUOPS_XNODE_PARTS 2u
/* CTAs of one communicating kernel resident per SM (__launch_bounds__: ops_dev.cuh KERNEL). */
#define CUOPS_CTAS_PER_SM 2u
/* Low-latency dispatch keeps per-(source, local expert) counts and offsets
 * in dynamic shared memory (after the per-source state): 8 bytes per expert. */
#define CUOPS_LL_MAX_EXPERTS 4096u
#define CUOPS_LL_SHMEM(num_experts) (8u * (num_experts))

/* How long a wait goes unmet before it polls the abort code (slab.h's
 * abort words) too. */
#define CUOPS_ABORT_POLL_NS 20000u

/* Communicating operations, as carried in slots and error records. */
enum ops_op {
  OPS_OP_DISPATCH = 1,
  OPS_OP_COMBINE = 2,
  OPS_OP_LL_DISPATCH = 3,
  OPS_OP_LL_COMBINE = 4,
};
#define OPS_OP_FP8 0x100u /* or-ed into a slot's op: the rows carry FP8 */
#define OPS_OP_CACHED 0x200u /* or-ed into a dispatch's op: routed by a handle (cached mode) */
#define OPS_OP_WEIGHTS 0x400u /* or-ed into a combine's op: its rows carry topk weights */

/*
 * One (parity, source) control slot at dep_slab_ctrl_slot() of the
 * receiver's slab.  The sender fills rows/op/ref_seq, then stores flag.
 */
struct ops_slot {
  DEP_ATOMIC(uint64_t) flag; /* seq of the call that filled the slot */
  uint32_t rows;         /* rows (LL combine: vectors) in the block */
  uint32_t op;           /* enum ops_op, | OPS_OP_FP8 */
  uint64_t ref_seq;      /* combines: seq of the dispatch their handle holds */
  uint32_t num_tokens;   /* the sender's num_tokens in this call (diagnostics) */
  /* 1 when the sender had read the call before this one to its end as it
   * posted this one (a whole call, or a split receive that ran before this
   * send): what a source on another node learns of this rank's reading
   * without a frame of its own (host_ops.h, "Split calls").  Both
   * backends write it. */
  uint32_t prev_read;
  /* A streamed call (slab.h): the rows the sender has published into the
   * channel and the rows the receiver has taken out of it, each
   * DEP_SLAB_CHAN_AT(call, rows) stored with release ordering; credit is
   * the one word of the slot the receiver writes. */
  DEP_ATOMIC(uint64_t) tail;
  DEP_ATOMIC(uint64_t) credit;
  /* The call whose post in this slot the receiver has read to its end
   * (release), which a sender checks before it writes the slot's parity
   * again (host_ops.h, "Split calls"; on cuda below, "Split calls"); the
   * receiver writes it. */
  DEP_ATOMIC(uint64_t) taken;
};
DEP_STATIC_ASSERT(sizeof(struct ops_slot) <= DEP_SLAB_CTRL_SLOT, "slot exceeds DEP_SLAB_CTRL_SLOT");

/*
 * The error words at offset 0 of a rank's own slab, written by that rank
 * when a wait times out or finds a peer gone (code last, with release
 * ordering), so that the daemon and deepepctl can say which rank waited
 * for whom.  The cuda backend's kernels write the same record into pinned
 * host memory too (cuops_host.err), for the library to read without a sync.
 */
struct ops_err_record {
  DEP_ATOMIC(int32_t) code; /* 0, or the DEP_ERR_* of the failed call */
  uint32_t op;          /* enum ops_op */
  uint32_t rank;        /* the rank that waited (this slab's owner) */
  uint32_t source;      /* the rank it waited for; DEP_ERR_PEER: the rank that is gone */
  uint64_t seq;         /* the call */
  uint64_t seen_flag;   /* the source's flag when it gave up; DEP_ERR_PEER: OPS_ERR_GONE */
  uint32_t waited_ms;
  uint32_t phase;       /* cuda: where it failed (enum cuops_phase); the host backend
                           does not write it */
};
/* DEP_ERR_PEER's seen_flag: the gone rank's pid (DEP_SLAB_GONE_CUT: a rank
 * of the part that went on), and in bits 32-34 how it went: the abort
 * words' detached (slab.h DEP_SLAB_GONE_*).  OPS_ERR_GONE_PID and
 * OPS_ERR_GONE_HOW read them back. */
#define OPS_ERR_GONE(pid, detached) ((uint64_t)(uint32_t)(pid) | ((uint64_t)((detached) & 7u) << 32))
#define OPS_ERR_GONE_PID(seen) ((uint32_t)(seen))
#define OPS_ERR_GONE_HOW(seen) ((uint32_t)((seen) >> 32) & 7u)
DEP_STATIC_ASSERT(sizeof(struct ops_err_record) <= DEP_SLAB_ABORT_OFF,
                  "record overlaps the abort words (slab.h)");

/* Where a failure happened (ops_err_record.phase). */
enum cuops_phase {
  CUOPS_PHASE_WAIT = 1,    /* waiting for a peer's flag */
  CUOPS_PHASE_AHEAD = 2,   /* a peer's flag is past this call: ranks out of step */
  CUOPS_PHASE_PEER = 3,    /* a peer made another call, or sent malformed rows */
  CUOPS_PHASE_IDS = 4,     /* the caller's topk_idx */
  CUOPS_PHASE_ROW = 5,     /* waiting for a peer's row (throughput ops) */
  CUOPS_PHASE_GONE = 6,    /* the abort words: source is the gone rank, seen_flag OPS_ERR_GONE */
  CUOPS_PHASE_WORST = 7,   /* dispatch: more rows arrived than num_worst_tokens (seen_flag: rows) */
  CUOPS_PHASE_RING = 8,    /* the proxy's ring: full past the timeout, or no longer served
                              (code: the proxy's); source is the destination rank */
  CUOPS_PHASE_TAKEN = 9,   /* waiting for a peer to read (taken) this rank's post of two calls
                              before, whose slots the call reuses; seen_flag: that call (for
                              a peer on another node code may be the proxy's, its ring failed) */
  CUOPS_PHASE_UNSENT = 10, /* a split receive found no send of its call on the device;
                              seen_flag: the call the device holds sent in that parity */
  CUOPS_PHASE_CREDIT = 11, /* a streamed call (kernels/ops_stream.cuh): waiting for a peer to
                              take rows (its credit); seen_flag: the rows it had taken (for a
                              peer on another node code may be the proxy's, its ring failed) */
  CUOPS_PHASE_STOPPED = 12, /* a streamed call: a local peer (source) failed its part of this
                               call, so it sends or takes no more of it; seen_flag: its code */
};

/* Pinned host memory mapped for the device: written by kernels, read by the library.  The
 * dispatch's rows from each source (cuops_job.recv_from, one word per rank of the world) follow
 * it in the same registration (client/cuda_attach.c). */
struct cuops_host {
  struct ops_err_record err;       /* code stored last */
  uint32_t num_recv;               /* dispatch: rows received */
};

/* Device scratch of one client. */
struct cuops_dev {
  uint64_t seq;                    /* communicating calls made */
  uint32_t done;                   /* CTAs finished in the running launch */
  uint32_t claim;                  /* 1 once a failure is recorded */
  uint32_t broken;                 /* 1 after a timeout: kernels do nothing */
  uint32_t pad;
  uint32_t bar_count, bar_gen;     /* the dispatch's grid barrier (ops_tp.cuh grid_meet) */
  uint32_t ticket;                 /* the throughput ops' receive work, claimed; 0 between calls */
  int32_t code;                    /* the failure rec_fail recorded in the running call, for its
                                      stats entry; 0 between calls */
  uint32_t layout_done;            /* CTAs of the running layout finished */
  uint64_t layouts;                /* layouts made (the stats page's layout ring) */
  /* The proxy's ring: descriptors reserved, published (its head as this
   * rank last stored it) and known taken (its tail as last read). */
  unsigned long long xr_next, xr_pub, xr_tail;
  /* Split calls (below): the call a low-latency send (CUOPS_SEND) made in each parity, whose
   * mask (cuops_job.pend_mask) its receive (CUOPS_RECV) runs with; the receive sets it to 0. */
  uint64_t pend_seq[2];
};

/*
 * The device counters a rank keeps for each rank of its world, in arrays
 * of the world's length rather than in struct cuops_dev (whose size is
 * fixed), so that every world the library serves has them:
 *   arrive     sender units (or warps) done per destination (ops_dev.cuh arrive);
 *   xseen      per remote source, the call whose flag CTA 0 last saw in the
 *              exchange region (CUOPS_XSEEN_FAILED set: that wait failed), for
 *              the other CTAs to wait on in device memory (wait_peers);
 *   chan_took  a streamed call (kernels/ops_stream.cuh), for each local source's
 *              channel in the running call: the rows its receiving warps have
 *              taken (copied out) of each chunk not yet credited,
 *              CUOPS_CHAN_TOOK_BITS a chunk, by the chunk's place in the ring
 *              (its number modulo DEP_SLAB_CHUNKS);
 *   chan_front the chunks credited (the bits below CUOPS_CHAN_DONE_SHIFT) and,
 *              from that bit on, one by place for each chunk taken whole but not
 *              credited yet, since a chunk before it is not;
 *   chan_sent  a streamed call's channel to each destination on another node:
 *              the rows its sending warps have written (and fenced) of each chunk
 *              not yet handed to the proxy, packed as chan_took; the warp whose
 *              count completes a chunk sets it back to 0 and publishes the chunk
 *              (ops_stream.cuh chunk_sent);
 *   own_mask   this rank's own mask (deepep.h "Masked ranks"), a bitmap of the
 *              world as the live mask's words are (slab.h DEP_SLAB_MASK_BIT):
 *              written by the library (dep_mask_update), read by every CTA as
 *              it begins (cuops_mask);
 *   pend_mask  split calls (below): for each parity, the mask a low-latency
 *              send ran with, the same bitmap, for its receive to run with;
 *   wslabs     a world above CUOPS_MAX_RANKS: every rank's slab (device
 *              pointers; NULL for a rank on another node), as slabs[] holds
 *              them for a smaller world (ops_dev.cuh slab_of);
 *   xnum       ... and each rank's number among the ranks on other nodes (-1:
 *              a local rank), which remote_mask says for a smaller world
 *              (is_remote, out_index).  The library writes both at attach.
 *   fan        a streamed dispatch's node channels (xring.h "One crossing per
 *              destination node"): for each rank, 0 where its rows take a
 *              channel of its own, else CUOPS_FAN of its node (below), from the
 *              ring's fan table as the host backend reads it (host_ops.c
 *              init_fan), written by the library at attach;
 *   fan_rank   ... each node's ranks, ascending, node after node (CUOPS_FAN_FIRST
 *              is where a node's begin);
 *   node_acc   for each rank of a node and each chunk place of the node channel,
 *              two words: the rows of the chunk for it (count) and one past the
 *              last of them in its own stream, added to and raised by the sending
 *              warps (ops_node.cuh); the warp that completes the chunk makes its
 *              out mark word (DEP_XRING_NODE_AT) of them and sets them back to 0;
 *   node_push  for each lead and chunk place, two words: the ring's head once
 *              the NODE descriptor of the chunk last pushed in that place was
 *              published, then DEP_SLAB_CHAN_AT(call, chunk + 1): a place is
 *              written again only once the proxy's tail is past that head.
 * The chan_* words are 0 between calls (call_end).  They lie in the slab's
 * private area (dep__slab_priv: the job's world, and the warm-up's world of
 * one), where cuops_world_carve places them; cuops_job carries their device
 * addresses.
 */
#define CUOPS_WORLD_ARRAYS 13
static inline uint64_t cuops_world_carve(uint64_t W, uint64_t at[CUOPS_WORLD_ARRAYS]) {
  uint64_t off = 0;
  at[0] = dep_carve(&off, 4 * W);
  at[1] = dep_carve(&off, 8 * W);
  at[2] = dep_carve(&off, 8 * W);
  at[3] = dep_carve(&off, 4 * W);
  at[4] = dep_carve(&off, 8 * W);
  at[5] = dep_carve(&off, 8 * DEP_SLAB_MASK_WORDS(W));
  at[6] = dep_carve(&off, 2 * 8 * DEP_SLAB_MASK_WORDS(W));
  at[7] = dep_carve(&off, 8 * W);
  at[8] = dep_carve(&off, 4 * W);
  at[9] = dep_carve(&off, 8 * W);
  at[10] = dep_carve(&off, 4 * W);
  at[11] = dep_carve(&off, 2 * 4 * DEP_SLAB_CHUNKS * W);
  at[12] = dep_carve(&off, 2 * 8 * DEP_SLAB_CHUNKS * W);
  return off;
}
/*
 * A rank's word of cuops_job.fan where its rows go through its node's
 * channel: 1 + the node's lead (the global rank whose out channel carries
 * it), the rank's place among the node's ranks (idx), their number (n) and
 * where they begin in fan_rank (first).  The library refuses a ring whose
 * fan table makes a node of more than DEP_MAX_LOCAL_RANKS ranks
 * (cuda_attach.c), which these fields and the kernels' per-node arrays
 * are sized by.
 */
#define CUOPS_FAN(lead, idx, n, first)                                                          \
  ((uint64_t)(1u + (lead)) | (uint64_t)(idx) << 16 | (uint64_t)(n) << 24 | (uint64_t)(first) << 32)
#define CUOPS_FAN_LEAD(w) ((uint32_t)((w) & 0xffffu) - 1u)
#define CUOPS_FAN_IDX(w) ((uint32_t)((w) >> 16) & 0xffu)
#define CUOPS_FAN_N(w) ((uint32_t)((w) >> 24) & 0xffu)
#define CUOPS_FAN_FIRST(w) ((uint32_t)((w) >> 32))
DEP_STATIC_ASSERT(DEP_MAX_WORLD < 0xffffu && DEP_MAX_LOCAL_RANKS <= 0xffu,
                  "a fan word holds 1 + a rank, and a node's ranks and a place among them");
/* The most words a bitmap of the world holds (a CTA's copies of the call's masks, in shared
 * memory: ops_dev.cuh call_begin). */
#define CUOPS_MASK_WORDS DEP_SLAB_MASK_WORDS(DEP_MAX_WORLD)
#define CUOPS_XSEEN_FAILED (1ull << 63)
#define CUOPS_CHAN_TOOK_BITS 16u
#define CUOPS_CHAN_DONE_SHIFT 28u
/* A streamed job's chunk_rows * DEP_SLAB_CHUNKS is below max_tokens_per_rank (slab.h). */
DEP_STATIC_ASSERT(DEP_SLAB_CHUNKS * CUOPS_CHAN_TOOK_BITS <= 64 &&
                      DEP_SHAPE_MAX_TOKENS / DEP_SLAB_CHUNKS <= (1u << CUOPS_CHAN_TOOK_BITS) - 1,
                  "chan_took (and chan_sent) holds a count of every chunk of the ring, each up "
                  "to chunk_rows");
DEP_STATIC_ASSERT(DEP_SHAPE_MAX_TOKENS < (1u << CUOPS_CHAN_DONE_SHIFT) &&
                      CUOPS_CHAN_DONE_SHIFT + DEP_SLAB_CHUNKS <= 32,
                  "chan_front holds a stream's chunks and a done bit for each of the ring's");

/* One rank's view of its job, passed by value to every kernel. */
struct cuops_job {
  uint8_t *slabs[CUOPS_MAX_RANKS]; /* a world of at most CUOPS_MAX_RANKS: every local rank's
                                      slab (device pointers), by rank; NULL for a rank on
                                      another node (a larger world: wslabs) */
  uint64_t data_off, block_bytes, parity_bytes, row_bytes;
  /* A job that spans nodes: bit r set for each rank on another node (a world of at most 64
   * ranks; a larger one: xnum); the
   * ring to the daemon's proxy and the exchange region after it (device
   * addresses of the registered host mapping, xring.h), and the offsets in
   * the region of its in slots, out slots, in blocks and out blocks
   * (slab.h: by parity and the rank's number among the remote ones), and
   * of its chunks' in and out marks (a job that streams). */
  uint64_t remote_mask, in_slot_off, out_slot_off, in_off, out_off, in_mark_off, out_mark_off;
  /* n_nodes: the nodes whose ranks take a node channel (fan, below); 0: none, or the job
   * does not stream, and every remote rank's rows take a channel of its own. */
  uint32_t n_remote, n_nodes;
  uint8_t *ring;
  uint8_t *xchg;
  uint32_t world, rank, hidden, topk, num_experts, le, kd, max_tokens, max_ll, parts;
  /* The layout's chunk_rows and chan_rows (slab.h): chan_rows below max_tokens, the job
   * streams its throughput calls through channels (kernels/ops_stream.cuh). */
  uint32_t chunk_rows, chan_rows;
  /* dispatch: [world][parts * warps] rows counted, scratch; a streamed one's sender warps are
   * half of a CTA's, and its node channels' counts ([world][parts * sender warps], by lead)
   * follow its ranks' in the other half */
  uint32_t *tcnt;
  /* The per-world counters (cuops_world_carve's, in its order; device memory) and the
   * dispatch's rows from each source (pinned host memory after cuops_host), [world] each. */
  uint32_t *arrive;
  unsigned long long *xseen, *chan_took;
  uint32_t *chan_front;
  unsigned long long *chan_sent;
  unsigned long long *own_mask, *pend_mask; /* [mask words], [2][mask words] */
  uint8_t **wslabs;                /* a world above CUOPS_MAX_RANKS only (slab_of) */
  int32_t *xnum;                   /* ... (is_remote, out_index) */
  unsigned long long *fan;         /* node channels (n_nodes of them; cuops_world_carve) */
  uint32_t *fan_rank, *node_acc;
  unsigned long long *node_push;
  uint32_t *recv_from;
  uint64_t timeout_ns;
  struct cuops_host *host;         /* device address of the pinned block */
  struct cuops_dev *dev;
  /* Device address of the stats page (stats_page.h), pinned, or NULL: the
   * last CTA of each call writes its entry there (ops_dev.cuh stats_call). */
  struct dep_stats_page *stats;
  /* The live mask in this rank's slab (slab.h dep_slab_mask_epoch; dep_slab_mask_word of
   * rank 0, the first of the world's DEP_SLAB_MASK_WORDS words; dep_slab_mask_join of rank 0,
   * the first of the world's join words). */
  uint64_t mask_epoch_off, mask_word_off, mask_join_off;
};
DEP_STATIC_ASSERT(CUOPS_MAX_RANKS <= 64, "remote_mask has a bit per rank");

/* dep__k_touch: the bytes of each slab to touch. */
struct cuops_touch_args {
  uint64_t bytes;
};

/* A handle's device arrays (one allocation). */
struct cuops_hdl {
  uint64_t *seq;       /* [1] call number of the dispatch */
  int32_t *tp_pos;     /* [max_tokens * world] row of token t at rank d, -1 if not sent */
  uint32_t *tp_sent;   /* [world] rows sent to each rank */
  uint32_t *tp_from;   /* [world] rows received from each rank */
  int32_t *ll_route;   /* [max_ll * topk * 2] {expert, vector index at its rank} */
  uint32_t *ll_expect; /* [world] vectors each rank owes back */
  uint32_t *ll_rows;   /* [world] rows received from each rank */
  int32_t *ll_nids;    /* [world * max_ll] distinct experts of each received row */
  int32_t *ll_map;     /* [world * max_ll * kd * 2] {local expert, row} of each (row, id) */
  int32_t *ll_src;     /* [world * max_ll] the source's token index of each received row */
};

/*
 * Where struct cuops_hdl's arrays lie in one allocation, in its order, for
 * a world of W ranks, mt tokens a rank, ll low-latency tokens, top-K and kd
 * distinct experts a token may have on one rank: their offsets in at[], and
 * the allocation's size returned.  One definition for every handle the
 * library makes and the warm-up's handle in the slab's private area
 * (dep__slab_priv).
 */
#define CUOPS_HDL_ARRAYS 10
static inline uint64_t cuops_handle_carve(uint64_t W, uint64_t mt, uint64_t ll, uint64_t K,
                                          uint64_t kd, uint64_t at[CUOPS_HDL_ARRAYS]) {
  uint64_t off = 0;
  at[0] = dep_carve(&off, 8);
  at[1] = dep_carve(&off, 4 * mt * W);
  at[2] = dep_carve(&off, 4 * W);
  at[3] = dep_carve(&off, 4 * W);
  at[4] = dep_carve(&off, 8 * ll * K);
  at[5] = dep_carve(&off, 4 * W);
  at[6] = dep_carve(&off, 4 * W);
  at[7] = dep_carve(&off, 4 * W * ll);
  at[8] = dep_carve(&off, 8 * W * ll * kd);
  at[9] = dep_carve(&off, 4 * W * ll);
  return off;
}

struct cuops_layout_args {
  const void *idx;
  int32_t itype;
  uint32_t num_tokens;
  int32_t *tpr, *tpe;
  uint8_t *tir;
};

/* A dispatch (deepep.h): bf16 or FP8 rows (fp8: x is e4m3 bytes, xs their
 * scales), fresh or routed by the handle (cached), outputs of `worst` rows
 * or of the rows received (worst 0); align > 1 rounds the counts
 * (dep__k_align, launched after it); ridx holds int32 ids, or int64 with
 * ri64 (recv_index_type DEP_INDEX_I64). */
struct cuops_dispatch_args {
  const void *x, *idx;
  const float *w;
  int32_t itype;
  uint32_t num_tokens;
  void *rx;
  void *ridx;
  float *rw;
  int32_t *cnt;
  const float *xs;
  float *rxs;
  int32_t fp8, cached;
  uint32_t worst, align;
  int32_t ri64;
  uint32_t pad;
  struct cuops_hdl h;
};

/* w/ow: DeepEP's combine of weights (ow NULL: none; w NULL only with no rows),
 * w [rows, topk], ow [num_tokens, topk]; b0/b1: dep_combine_args's bias_0 and
 * bias_1 (NULL: none), bf16 [num_tokens, hidden], where each token's sum begins. */
struct cuops_combine_args {
  const void *x;
  void *out;
  uint32_t num_tokens;
  uint32_t pad;
  const float *w;
  float *ow;
  const void *b0, *b1;
  struct cuops_hdl h;
};

/*
 * Split calls (deepep.h DEP_LL_SEND, DEP_LL_RECV) on the GPU: both phases
 * are launches of the same kernel (deepepd::ll::dispatch, ::combine), its
 * phase argument CUOPS_SEND, CUOPS_RECV or both (CUOPS_WHOLE).  The send
 * counts the call as a whole call does (call_begin takes seq + 1 and the
 * mask, call_end publishes seq) and keeps both in cuops_dev.pend_*[parity];
 * it posts and returns.  The receive takes that call's seq as the device's
 * count less `back` (the calls the host launched since the send: 0 or 1,
 * the same on every replay of a captured pair), its mask from pend_mask,
 * waits and unpacks, and leaves cuops_dev.seq as it found it.
 * A peer may thus post call n+1 before it has read call n, so every
 * receive, whole or split, stores in each local source's slot of its
 * parity the call it has read to its end (ops_slot.taken, release, by the
 * receive's last CTA), and every CTA of a communicating kernel that sends,
 * as it begins (call_begin), waits, bounded and abort-aware as every wait,
 * until the peer it sends to has read what this rank posted there two
 * calls before.  A peer on another node says so as on the host backend
 * (host_ops.h "Split calls"): every post carries prev_read, and a split
 * receive that ran after a later call pushes a TAKEN descriptor (xring.h)
 * for each source on another node that posted it.  The
 * library refuses what the host backend refuses (ops_check, and a call
 * whose parity a pending send holds), before launching anything.
 */
#define CUOPS_SEND DEP_LL_SEND
#define CUOPS_RECV DEP_LL_RECV
#define CUOPS_WHOLE (DEP_LL_SEND | DEP_LL_RECV)

struct cuops_ll_dispatch_args {
  const void *x, *idx;
  int32_t itype;
  uint32_t num_tokens;
  int32_t fp8;
  uint32_t phase;      /* CUOPS_SEND, CUOPS_RECV or CUOPS_WHOLE (split calls, above) */
  void *rx;
  float *rs;
  int32_t *cnt;
  uint8_t *stage;      /* FP8: this rank's tokens, cast once (dep__k_ll_cast), CUOPS_STAGE_ROW each */
  struct cuops_hdl h;
  int64_t *wait_cost;  /* NULL, or [world]: clock64 cycles the receive waited for each source */
  uint32_t back;       /* CUOPS_RECV: calls counted since its send (split calls, above) */
  uint32_t pad;
};

/* A staged FP8 token: hidden bytes of e4m3, then hidden / 128 float32 scales (the row's layout). */
#define CUOPS_STAGE_ROW(hidden) ((((uint64_t)(hidden) + (hidden) / 32u) + 15u) & ~(uint64_t)15u)

struct cuops_ll_combine_args {
  const void *x, *idx;
  int32_t itype;
  uint32_t num_tokens;
  const float *w;
  void *out;
  struct cuops_hdl h;
  int64_t *wait_cost;  /* as cuops_ll_dispatch_args's */
  uint32_t phase, back; /* as cuops_ll_dispatch_args's */
};

/* dep__k_ll_info (dep_ll_handle_info): src [le, world * max_ll] and range [le, world]
 * from a low-latency dispatch's handle. */
struct cuops_ll_info_args {
  int32_t *src;
  int64_t *range;
  struct cuops_hdl h;
};

/* Kernel names in the fatbin, in the order of cuops_state.fn[]: the timed
 * ones by their mangled C++ names (deepepd::dispatch, deepepd::combine,
 * deepepd::ll::dispatch, deepepd::ll::combine, and the streamed
 * deepepd::dispatch_stream and deepepd::combine_stream that a job with
 * channels launches instead of the first two, deepepd::dispatch_node for
 * dispatch_stream where it has node channels (cuops_job.n_nodes: its own
 * kernel, so that the node channels' code costs the other kernels no
 * registers): kernels/ops_dev.cuh says why), the rest by their C names. */
#define CUOPS_KERNELS(XX)                                                   \
  XX(LAYOUT, "dep__k_layout")                                                \
  XX(DISPATCH, "_ZN7deepepd8dispatchE9cuops_job19cuops_dispatch_args")       \
  XX(COMBINE, "_ZN7deepepd7combineE9cuops_job18cuops_combine_args")          \
  XX(LL_DISPATCH, "_ZN7deepepd2ll8dispatchE9cuops_job22cuops_ll_dispatch_args") \
  XX(LL_COMBINE, "_ZN7deepepd2ll7combineE9cuops_job21cuops_ll_combine_args")    \
  XX(LL_CAST, "dep__k_ll_cast")              \
  XX(ALIGN, "dep__k_align")                 \
  XX(TOUCH, "dep__k_touch")                 \
  XX(LL_INFO, "dep__k_ll_info")              \
  XX(DISPATCH_STREAM, "_ZN7deepepd15dispatch_streamE9cuops_job19cuops_dispatch_args") \
  XX(COMBINE_STREAM, "_ZN7deepepd14combine_streamE9cuops_job18cuops_combine_args") \
  XX(DISPATCH_NODE, "_ZN7deepepd13dispatch_nodeE9cuops_job19cuops_dispatch_args")

#endif /* DEP_KABI_H */
