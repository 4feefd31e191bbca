/*
 * ops_stream.cuh — the channels of a job that streams (slab.h "Streaming",
 * DESIGN §6 "Streaming with bounded buffers") on the cuda backend: what
 * deepepd::dispatch_stream and deepepd::combine_stream (ops_tp.cuh) add to
 * the throughput kernels, which they otherwise share.  Part of the one
 * translation unit kernels/ops.cu.
 *
 * Within a node a channel is the host backend's (host_ops_stream.c): the
 * sender posts its slot first (rows, op, ref_seq, then the flag), then
 * writes row j of its stream into ring row j % chan_rows of its channel in
 * the receiver's slab once the receiver has credited j - chan_rows + 1
 * rows (ops_slot.credit, DEP_SLAB_CHAN_AT(call, rows) stored with release
 * ordering, at each chunk's end and the stream's); the receiver copies
 * each row to its place in the output (the layout's offsets, as a whole
 * block's) and credits the rows it has taken.  How a row is published is
 * the cuda kernels' own, as for a whole block: many warps write a stream's
 * rows, each its own span, in no order among them, so each row carries its
 * stamp (ops_rows.cuh stamp_at: the call and the row's number, stored after
 * a system fence) where the host backend's one writer moves a tail; the
 * slot's tail word stays unused here, and both ends of a channel in a node
 * are this backend's kernels.  The receive claims rows (dispatch) or tokens
 * (combine) from a counter in stream order, so the rows of one source are
 * taken by many warps at once, in any order: each, once it has copied its
 * claim's rows out, counts them per chunk (cuops_dev.chan_took, one atomic
 * add per source and chunk), and the chunks taken whole are credited in
 * order, by whoever takes the last row of the first chunk not credited
 * (chunk_taken, cuops_dev.chan_front).  Taking never waits, so a receiver
 * waits only for rows: bounded, since a stream's earlier rows are claimed
 * first, and once those are taken their chunks are credited, so the
 * senders may write the rows claimed next (a claim's rows of a source fit
 * in the ring past the chunks credited: ops_tp.cuh, RECV_CLAIM and
 * REDUCE_CLAIM).
 *
 * Deadlock: a sender that waits for credit must not hold back any
 * receiver, its own rank's or another's, for every rank's senders may be
 * waiting on every rank's receivers at once.  So a CTA's warps are
 * specialised: its first STREAM_SEND_WARPS warps send (the rows for rank
 * b / parts, as every CTA of a whole-block call does), the others receive
 * (claiming from the grid's counter); all are resident (the SM budget,
 * kabi.h), so a receiver always runs.  Warps rather than CTAs, because the
 * grid, the SM budget and call_begin's wait for the one rank a CTA sends
 * to stay what they are; interleaving sends and receives within a warp
 * would hold a sender's rows behind receives that wait for other ranks.
 * A whole-block call keeps its kernels (every warp sends, then receives):
 * they are the same functions instantiated without the ring.
 *
 * Across nodes a cuda job does not stream yet: the library refuses to
 * attach such a job (cuda_attach.c), and the daemon refuses to lend it
 * (daemon/lend.c), naming why.
 */
#ifndef DEP_OPS_STREAM_CUH
#define DEP_OPS_STREAM_CUH

#include "ops_dev.cuh"
#include "ops_rows.cuh"

/* The warps of a CTA that send in a streamed call; the rest receive. */
#define STREAM_SEND_WARPS (CUOPS_WARPS / 2)
/* The receiving warps' threads, and the named barrier they meet at (0 is __syncthreads'). */
#define STREAM_RECV_BASE (STREAM_SEND_WARPS * 32)
#define STREAM_RECV_THREADS (CUOPS_THREADS - STREAM_RECV_BASE)
#define STREAM_RECV_BAR 1

/* The receiving threads of a CTA meet: all of them (RING: the receiving warps alone). */
template <bool RING> __device__ __forceinline__ void recv_sync() {
  if (RING)
    asm volatile("bar.sync %0, %1;" ::"n"(STREAM_RECV_BAR), "n"(STREAM_RECV_THREADS) : "memory");
  else
    __syncthreads();
}

/* Row j of a stream in its block: the block's row j, or (RING) its ring row j % chan_rows. */
template <bool RING>
__device__ __forceinline__ uint8_t *stream_row(const cuops_job &J, uint8_t *blk, uint32_t j) {
  return blk + (uint64_t)(RING ? j % J.chan_rows : j) * J.row_bytes;
}

/*
 * Every lane of a sender warp, after writing rows first, first + step, ...
 * (below end) of its stream: make them visible (system scope: the receiver
 * may be another GPU), then stamp them.
 */
__device__ __forceinline__ void stamp_rows(const cuops_job &J, const call &k, uint8_t *blk,
                                           uint32_t first, uint32_t step, uint32_t end) {
  __syncwarp();
  if (first >= end)
    return;
  __threadfence_system();
  const uint32_t lane = threadIdx.x & 31u;
  for (uint32_t i = first + lane * step; i < end; i += 32 * step)
    *(volatile uint64_t *)stamp_at(J, stream_row<true>(J, blk, i)) = DEP_SLAB_CHAN_AT(k.seq, i);
}

/*
 * A sender warp, before it writes row j of its stream to local rank d:
 * wait, bounded and abort-aware, until d has taken rows enough for j's ring
 * row (j - chan_rows + 1; *have: what it was last seen to have taken).
 * The caller has stamped every row it wrote before (the receiver takes
 * them, which is the credit this waits for).  1: write it; 0: the call
 * failed (recorded here or elsewhere); -1: d left the job since the call
 * began (elastic: the daemon masked it), so it is sent nothing more.
 */
__device__ __forceinline__ int wait_credit(const cuops_job &J, const call &k, uint32_t op,
                                           uint32_t d, uint32_t j, uint32_t *have) {
  if (j < J.chan_rows + *have)
    return 1;
  const uint32_t lane = threadIdx.x & 31u, need = j - J.chan_rows + 1;
  const uint64_t *word =
      (const uint64_t *)(slot_at(J, d, k.parity, J.rank) + offsetof(ops_slot, credit));
  const uint64_t at = DEP_SLAB_CHAN_AT(k.seq, 0);
  for (uint32_t i = 0;; i++) {
    const uint64_t w = __shfl_sync(FULL_MASK, lane == 0 ? ld_acquire_sys(word) : 0, 0);
    const uint32_t got = w >= at ? (uint32_t)(w - at) : 0; /* an earlier call's: none yet */
    if (got >= need) {
      *have = got;
      __syncwarp(); /* lane 0's acquire before every lane's stores into the ring */
      return 1;
    }
    if ((i & 31u) != 31u)
      continue;
    int go = 2; /* lane 0 decides for the warp: 2, wait on */
    if (lane == 0) {
      const uint64_t waited = globaltimer_ns() - k.t0;
      int32_t code;
      if (*(volatile uint32_t *)&J.dev->broken) {
        go = 0;
      } else if (job_aborted(J, k, d, waited)) {
        rec_gone(J, op, k.seq, waited);
        go = 0;
      } else if (waited >= CUOPS_ABORT_POLL_NS && left_since(J, d)) {
        go = -1;
      } else if (waited >= CUOPS_ABORT_POLL_NS && (code = peer_stopped(J, k, d)) != 0) {
        rec_stopped(J, k, op, d, code, waited);
        go = 0;
      } else if (waited > J.timeout_ns) {
        rec_fail(J, DEP_ERR_TIMEOUT, op, d, CUOPS_PHASE_CREDIT, k.seq, got, waited);
        go = 0;
      }
    }
    go = __shfl_sync(FULL_MASK, go, 0);
    if (go != 2)
      return go;
    __nanosleep(64);
  }
}

/* Every lane of a receiving warp, once it has read the rows it is to take: every lane's reads
 * before any of the warp's counts (take_rows), one fence for the warp. */
__device__ __forceinline__ void take_fence() {
  __syncwarp();
  __threadfence();
}

/*
 * One lane, once chunk c of local source s's stream (len rows of the
 * stream's `rows`) is taken whole (take_rows): credit it, and every chunk
 * after it already taken whole, once every chunk before it is credited.
 * Nothing waits here: the first chunk not credited yet holds the front
 * (cuops_dev.chan_front), and each chunk taken whole behind it leaves a
 * done bit there, in the same word, so that whoever takes the front's
 * chunk last moves the front over them all (the compare-and-swap that sets
 * a chunk's bit sees every bit set before it, and the one that moves the
 * front past a chunk clears its bit).  Whoever moves the front stores the
 * credit, as a maximum: two that moved it one after the other may store
 * out of order.
 */
__device__ __forceinline__ void chunk_taken(const cuops_job &J, const call &k, uint32_t s,
                                            uint32_t c, uint32_t len, uint32_t rows) {
  const uint32_t place = c % DEP_SLAB_CHUNKS, front_mask = (1u << CUOPS_CHAN_DONE_SHIFT) - 1u;
  /* Its count back to 0 for chunk c + DEP_SLAB_CHUNKS, whose rows the sender writes only once
   * this chunk is credited, below. */
  atomicAdd(&J.dev->chan_took[s],
            0ull - ((unsigned long long)len << (CUOPS_CHAN_TOOK_BITS * place)));
  __threadfence();
  uint32_t *front = &J.dev->chan_front[s];
  uint32_t was = *(volatile uint32_t *)front, now, f;
  for (;;) {
    now = was | 1u << (CUOPS_CHAN_DONE_SHIFT + place);
    for (f = now & front_mask;; f++) { /* over the chunks taken whole from the front on */
      const uint32_t done = 1u << (CUOPS_CHAN_DONE_SHIFT + f % DEP_SLAB_CHUNKS);
      if ((now & done) == 0)
        break;
      now &= ~done;
    }
    now = (now & ~front_mask) | f;
    const uint32_t seen = atomicCAS(front, was, now);
    if (seen == was)
      break;
    was = seen;
  }
  if (f == (was & front_mask))
    return; /* a chunk before it is not taken whole yet: whoever takes it credits this one */
  __threadfence_system(); /* the reads of every row it credits (counted after a fence) first */
  red_max_release_sys((uint64_t *)(slot_at(J, J.rank, k.parity, s) + offsetof(ops_slot, credit)),
                       DEP_SLAB_CHAN_AT(k.seq, min(f * J.chunk_rows, rows)));
}

/*
 * One lane, once its warp has read rows j0..j1 - 1 of local source s's
 * stream (`rows` in all), then met at a __syncwarp and fenced (the reads
 * before the counts, take_fence): count them taken, chunk by chunk
 * (cuops_dev.chan_took, an atomic add), and credit each chunk the count
 * completes (chunk_taken).  It never waits: the rows of a source are taken
 * in any order, by many warps at once, and a chunk is credited once every
 * row of it and of the chunks before it is taken.
 */
__device__ __forceinline__ void take_rows(const cuops_job &J, const call &k, uint32_t s,
                                          uint32_t j0, uint32_t j1, uint32_t rows) {
  for (uint32_t j = j0; j < j1;) {
    const uint32_t c = j / J.chunk_rows, end = min((c + 1) * J.chunk_rows, j1);
    const uint32_t len = min(J.chunk_rows, rows - c * J.chunk_rows);
    const uint32_t shift = CUOPS_CHAN_TOOK_BITS * (c % DEP_SLAB_CHUNKS);
    const unsigned long long add = (unsigned long long)(end - j) << shift;
    const unsigned long long now = atomicAdd(&J.dev->chan_took[s], add) + add;
    if (((now >> shift) & ((1u << CUOPS_CHAN_TOOK_BITS) - 1u)) == len)
      chunk_taken(J, k, s, c, len, rows);
    j = end;
  }
}

/*
 * A receiving warp, after reading its claimed rows (lane i < n: row j of
 * source src, in stream order: a source's rows are consecutive): take
 * them, the first lane of each source's rows for all of them (take_rows;
 * rows[s]: source s's stream).
 */
__device__ __forceinline__ void take_claimed(const cuops_job &J, const call &k, uint32_t n,
                                             uint32_t src, uint32_t j, const uint32_t *rows) {
  const uint32_t lane = threadIdx.x & 31u;
  take_fence();
  const uint32_t prev = __shfl_up_sync(FULL_MASK, src, 1);
  const uint32_t heads = __ballot_sync(FULL_MASK, lane < n && (lane == 0 || src != prev));
  if (((heads >> lane) & 1u) == 0)
    return;
  const uint32_t later = heads & ~((2u << lane) - 1u); /* 2u << 31 wraps to 0: none later */
  const uint32_t last = later != 0 ? (uint32_t)__ffs(later) - 1 : n;
  take_rows(J, k, src, j, j + (last - lane), rows[src]);
}

#endif /* DEP_OPS_STREAM_CUH */
