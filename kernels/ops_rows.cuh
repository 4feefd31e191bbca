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
  const ops_err_record *rec = (const ops_err_record *)J.slabs[r];
  const int32_t code = (int32_t)ld_acquire_sys32((const uint32_t *)&rec->code);
  return code != 0 && *(const volatile uint64_t *)&rec->seq == k.seq ? code : 0;
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
 * stopped its part of the call (peer_stopped) fails the wait too.  Lane
 * `src` names the failing source in the error record.
 * True when every row is there; false when the call failed (recorded here
 * or by another CTA).  Ends with __syncwarp, which orders each lane's
 * acquire before the warp's reads of any of the rows.
 */
template <bool RING = false>
__device__ __forceinline__ bool wait_rows(const cuops_job &J, const call &k, uint32_t op,
                                          const uint8_t *row, uint32_t src, uint32_t j = 0) {
  const uint64_t want = RING ? DEP_SLAB_CHAN_AT(k.seq, j) : row_tag(k.seq);
  const void *tag = row == NULL ? NULL
                    : RING      ? (const void *)stamp_at(J, (uint8_t *)row)
                                : (const void *)row_tag_at(J, (uint8_t *)row);
  for (uint32_t i = 0;; i++) {
    uint64_t seen = tag == NULL ? want
                    : RING      ? ld_acquire_sys((const uint64_t *)tag)
                                : ld_acquire_sys32((const uint32_t *)tag);
    uint32_t late = __ballot_sync(FULL_MASK, seen != want);
    if (late == 0)
      break;
    if ((i & 31u) == 31u) {
      /* lane 0's reading for all: the warp must leave together */
      uint64_t waited = __shfl_sync(FULL_MASK, globaltimer_ns() - k.t0, 0);
      bool broken = __shfl_sync(FULL_MASK, *(volatile uint32_t *)&J.dev->broken, 0) != 0;
      /* the first late lane's source: the rank this wait is stuck on */
      const uint32_t late_src = __shfl_sync(FULL_MASK, src, __ffs(late) - 1);
      bool gone = __shfl_sync(FULL_MASK, (threadIdx.x & 31u) == 0 && !broken &&
                                             job_aborted(J, k, late_src, waited), 0);
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
      __nanosleep(32);
    }
  }
  __syncwarp();
  return true;
}

#endif /* DEP_OPS_ROWS_CUH */
