/*
 * ops_rows.cuh — how a throughput row is published and waited for on the
 * cuda backend: a whole block's row marks, a streamed call's row stamps
 * (ops_stream.cuh), and the one wait for either.  Part of the one
 * translation unit kernels/ops.cu.
 */
#ifndef DEP_OPS_ROWS_CUH
#define DEP_OPS_ROWS_CUH

#include "ops_dev.cuh"

/* ---- row marks (throughput ops) ----------------------------------------------------
 * A throughput row carries, in its meta word 3 (host_ops.h leaves it
 * unused), the call that wrote it: never 0 (a scrubbed slab), and a row
 * left from the call before of the same parity holds another value, so a
 * receiver waits on exactly this call's row.  Calls 2^31 apart share a
 * mark; a row index is rewritten long before that.
 */
__device__ __forceinline__ uint32_t row_tag(uint64_t seq) {
  return ((uint32_t)seq & 0x7fffffffu) | 0x80000000u;
}

__device__ __forceinline__ uint32_t *row_tag_at(const cuops_job &J, uint8_t *row) {
  return (uint32_t *)(row + 2ull * J.hidden + 12);
}

/*
 * Every lane of a sender warp, after writing its rows: make them visible
 * (system scope: the receiver may be another GPU), then mark them.  Lane
 * L marks the warp's L-th row in the list (first, first + step, ...).
 */
__device__ __forceinline__ void mark_rows(const cuops_job &J, const call &k, uint8_t *blk,
                                          uint32_t first, uint32_t step, uint32_t end) {
  __syncwarp();
  __threadfence_system();
  const uint32_t lane = threadIdx.x & 31u, tag = row_tag(k.seq);
  for (uint32_t i = first + lane * step; i < end; i += 32 * step)
    *(volatile uint32_t *)row_tag_at(J, blk + (uint64_t)i * J.row_bytes) = tag;
}

/*
 * A streamed call's row (kernels/ops_stream.cuh) carries in its meta words
 * 2 and 3 (host_ops.h: reserved) its stamp, DEP_SLAB_CHAN_AT(call, row):
 * the call and the row's number in the call's stream from its source,
 * which no other row written into that place of the ring, in this call or
 * an earlier one, carries.
 */
__device__ __forceinline__ uint64_t *stamp_at(const cuops_job &J, uint8_t *row) {
  return (uint64_t *)(row + 2ull * J.hidden + 8);
}

/*
 * In a streamed call, whether local rank r (this rank included) has
 * stopped its part of call k: its error record (the first words of its
 * slab) holds a failure of this call, after which it sends and takes
 * nothing more of it, so a wait for its rows or its credit would not end.
 * Its code, or 0.
 */
__device__ __forceinline__ int32_t peer_stopped(const cuops_job &J, const call &k, uint32_t r) {
  if (r >= J.world || is_remote(J, r))
    return 0;
  const ops_err_record *rec = (const ops_err_record *)slab_of(J, r);
  const int32_t code = (int32_t)ld_acquire_sys32((const uint32_t *)&rec->code);
  return code != 0 && *(const volatile uint64_t *)&rec->seq == k.seq ? code : 0;
}

/*
 * The words of chunk c's mark (slab.h in_mark, out_mark) of a streamed
 * call's channel from remote source s, or to remote destination d, in a
 * call of parity: in the exchange region, host memory.
 */
__device__ __forceinline__ uint64_t *in_mark_at(const cuops_job &J, unsigned parity, uint32_t s,
                                                uint32_t c) {
  return (uint64_t *)(J.xchg + DEP_XCHG_MARK_AT(J.in_mark_off, out_index(J, parity, s), c));
}
__device__ __forceinline__ uint64_t *out_mark_at(const cuops_job &J, unsigned parity, uint32_t d,
                                                 uint32_t c) {
  return (uint64_t *)(J.xchg + DEP_XCHG_MARK_AT(J.out_mark_off, out_index(J, parity, d), c));
}

/*
 * Whether chunk c of remote source s's stream may be looked for in its in
 * mark: the mark's place holds chunk c - DEP_SLAB_CHUNKS's count until
 * that chunk is taken whole, its count set back to 0 and then credited
 * (chunk_taken, ops_stream.cuh), so chunk c is looked for only once the
 * chunks credited (cuops_job.chan_front, read with acquire: the reset
 * before it) reach past that one, as the host's remote_in does.  The sender
 * writes no row of chunk c before that credit either, so this adds no wait.
 */
__device__ __forceinline__ bool in_mark_open(const cuops_job &J, uint32_t s, uint32_t c) {
  return c < DEP_SLAB_CHUNKS ||
         (ld_acquire_gpu32(&J.chan_front[s]) & ((1u << CUOPS_CHAN_DONE_SHIFT) - 1u)) +
                 DEP_SLAB_CHUNKS > c;
}

/*
 * In a streamed call, whether a wait for rank r ends because a rank of the
 * job is gone: job_aborted's rule, and, for r on another node, any rank
 * that died and is not masked (host_ops_stream.c remote_may_have_stopped):
 * r's rows and credit stream as its own call goes on, and r stops when
 * that call fails because it depended on the dead rank, which r's error
 * record, on its own node, cannot tell this rank.  One thread asks.
 */
__device__ __forceinline__ bool stream_aborted(const cuops_job &J, const call &k, uint32_t r,
                                               uint64_t waited) {
  if (job_aborted(J, k, r, waited))
    return true;
  if (waited < CUOPS_ABORT_POLL_NS || r >= J.world || !is_remote(J, r))
    return false;
  const uint8_t *w = slab_of(J, J.rank) + DEP_SLAB_ABORT_OFF;
  if (ld_acquire_sys32((const uint32_t *)(w + offsetof(dep_slab_abort, code))) == 0u)
    return false;
  const volatile dep_slab_abort *a = (const volatile dep_slab_abort *)w;
  const uint32_t gone = a->rank;
  return a->detached == DEP_SLAB_GONE_DIED && !(gone < J.world && masked(k, gone));
}

/* After peer_stopped found rank r's code: this call fails too, with DEP_ERR_PEER (which breaks
 * the context) unless r's failure leaves the ranks in step (a mismatch, bad arguments). */
__device__ __forceinline__ void rec_stopped(const cuops_job &J, const call &k, uint32_t op,
                                            uint32_t r, int32_t code, uint64_t waited) {
  const int32_t mine = code == DEP_ERR_MISMATCH || code == DEP_ERR_INVALID ? code : DEP_ERR_PEER;
  rec_fail(J, mine, op, r, CUOPS_PHASE_STOPPED, k.seq, (uint64_t)(uint32_t)code, waited);
}

/*
 * A warp waits, bounded, until every lane's row (row != NULL) carries this
 * call's mark: the whole block's (row_tag), or (RING, a streamed call) the
 * stamp of the lane's row j of the stream (stamp_at), where a source that
 * stopped its part of the call (peer_stopped) fails the wait too.  A row
 * of a streamed call from a source on another node carries no stamp that
 * can be trusted (the daemon writes its bytes in no order): its chunk's
 * count in the in mark (slab.h) says it is in, once it counts the chunk's
 * rows (`rows`: the source's stream, whose last chunk may be short) and
 * the chunk's place is open (in_mark_open); such a wait reads host memory,
 * so it sleeps between reads.  Lane `src` names the failing source in the
 * error record.
 * True when every row is there; false when the call failed (recorded here
 * or by another CTA).  Ends with __syncwarp, which orders each lane's
 * acquire before the warp's reads of any of the rows.
 */
template <bool RING = false>
__device__ __forceinline__ bool wait_rows(const cuops_job &J, const call &k, uint32_t op,
                                          const uint8_t *row, uint32_t src, uint32_t j = 0,
                                          uint32_t rows = 0) {
  const bool far = RING && row != NULL && is_remote(J, src);
  const uint32_t c = far ? j / J.chunk_rows : 0;
  const uint64_t want = !RING ? row_tag(k.seq)
                        : far ? DEP_SLAB_CHAN_AT(k.seq, min(J.chunk_rows, rows - c * J.chunk_rows))
                              : DEP_SLAB_CHAN_AT(k.seq, j);
  const void *tag = row == NULL ? NULL
                    : far       ? (const void *)in_mark_at(J, k.parity, src, c)
                    : RING      ? (const void *)stamp_at(J, (uint8_t *)row)
                                : (const void *)row_tag_at(J, (uint8_t *)row);
  const bool any_far = RING && __any_sync(FULL_MASK, far);
  for (uint32_t i = 0;; i++) {
    uint64_t seen = tag == NULL ? want
                    : far ? (in_mark_open(J, src, c) ? ld_acquire_sys((const uint64_t *)tag) : 0)
                    : RING ? ld_acquire_sys((const uint64_t *)tag)
                           : ld_acquire_sys32((const uint32_t *)tag);
    uint32_t late = __ballot_sync(FULL_MASK, seen != want);
    if (late == 0)
      break;
    if (any_far || (i & 31u) == 31u) {
      /* lane 0's reading for all: the warp must leave together */
      uint64_t waited = __shfl_sync(FULL_MASK, globaltimer_ns() - k.t0, 0);
      bool broken = __shfl_sync(FULL_MASK, *(volatile uint32_t *)&J.dev->broken, 0) != 0;
      /* the first late lane's source: the rank this wait is stuck on */
      const uint32_t late_src = __shfl_sync(FULL_MASK, src, __ffs(late) - 1);
      bool gone = __shfl_sync(FULL_MASK, (threadIdx.x & 31u) == 0 && !broken &&
                                             (RING ? stream_aborted(J, k, late_src, waited)
                                                   : job_aborted(J, k, late_src, waited)), 0);
      const int32_t stopped =
          RING && !broken && !gone && waited >= CUOPS_ABORT_POLL_NS
              ? __shfl_sync(FULL_MASK, (threadIdx.x & 31u) == 0 ? peer_stopped(J, k, late_src) : 0,
                            0)
              : 0;
      const bool first_late = (threadIdx.x & 31u) == (uint32_t)(__ffs(late) - 1);
      if (gone && first_late)
        rec_gone(J, op, k.seq, waited);
      else if (stopped != 0 && first_late)
        rec_stopped(J, k, op, src, stopped, waited);
      else if (waited > J.timeout_ns && !broken && first_late)
        rec_fail(J, DEP_ERR_TIMEOUT, op, src, CUOPS_PHASE_ROW, k.seq, seen, waited);
      if (waited > J.timeout_ns || broken || gone || stopped != 0)
        return false;
      __nanosleep(any_far ? 256 : 32);
    }
  }
  __syncwarp();
  return true;
}

#endif /* DEP_OPS_ROWS_CUH */
