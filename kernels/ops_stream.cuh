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
 * taken by several warps: each, once it has copied a row out, waits until
 * the rows before it are taken (cuops_dev.chan_took) and counts it, and the
 * one that completes a chunk stores the credit.  Bounded: a stream's earlier
 * rows are claimed first, by warps that wait only for rows the senders may
 * write.
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

/*
 * One lane, once its warp has read row j of local source s's stream (a
 * __syncwarp after the reads): wait, bounded, until the rows before it are
 * taken (by this or other warps: they were claimed first), count it, and
 * at the end of a chunk or of the stream (rows in all) store the credit.
 * False when the call failed (recorded here or elsewhere).
 */
__device__ __forceinline__ bool take_row(const cuops_job &J, const call &k, uint32_t op,
                                         uint32_t s, uint32_t j, uint32_t rows) {
  volatile uint16_t *took = &J.dev->chan_took[s];
  for (uint32_t i = 0; *took != (uint16_t)j; i++) {
    if ((i & 31u) != 31u)
      continue;
    if (*(volatile uint32_t *)&J.dev->broken)
      return false;
    const uint64_t waited = globaltimer_ns() - k.t0;
    if (waited > J.timeout_ns) {
      rec_fail(J, DEP_ERR_TIMEOUT, op, s, CUOPS_PHASE_ROW, k.seq, j, waited);
      return false;
    }
    __nanosleep(32);
  }
  __threadfence(); /* the earlier rows' credit, stored by whoever took them, before ours */
  const uint32_t n = j + 1;
  if (n % J.chunk_rows == 0 || n == rows) {
    __threadfence_system(); /* the warp's reads of the rows before the credit */
    st_release_sys((uint64_t *)(slot_at(J, J.rank, k.parity, s) + offsetof(ops_slot, credit)),
                   DEP_SLAB_CHAN_AT(k.seq, n));
  }
  __threadfence();
  *took = (uint16_t)n;
  return true;
}

/* A receiving warp, after reading its claimed rows (lane i < n: row j of source src): take
 * them in claim order (take_row; rows[s]: source s's stream).  False when the call failed. */
__device__ __forceinline__ bool take_claimed(const cuops_job &J, const call &k, uint32_t op,
                                             uint32_t n, uint32_t src, uint32_t j,
                                             const uint32_t *rows) {
  __syncwarp();
  for (uint32_t i = 0; i < n; i++) {
    const uint32_t s = __shfl_sync(FULL_MASK, src, i), r = __shfl_sync(FULL_MASK, j, i);
    const bool ok = (threadIdx.x & 31u) != 0 || take_row(J, k, op, s, r, rows[s]);
    if (!__shfl_sync(FULL_MASK, ok, 0))
      return false;
  }
  return true;
}

#endif /* DEP_OPS_STREAM_CUH */
