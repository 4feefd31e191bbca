/*
 * ops_combine.cuh — what the two combines of the cuda backend share
 * (ops_tp.cuh deepepd::combine, ops_ll.cuh deepepd::ll::combine): the receiver's
 * check that every source answered the handle's dispatch, and a warp's
 * ordered float32 sum of a token's rows.  Part of the one translation unit
 * kernels/ops.cu.
 */
#ifndef DEP_OPS_COMBINE_CUH
#define DEP_OPS_COMBINE_CUH

#include "ops_dev.cuh"
#include "ops_stream.cuh"

/* Receiver side shared by both combines: wait, then check that every source
 * answered this handle's dispatch with the expected number of vectors (one
 * that left the job during the wait is masked in k from here on).  Every
 * thread of the CTA calls it, or (RING, a streamed combine: ops_stream.cuh)
 * every receiving one. */
template <bool RING = false>
__device__ __forceinline__ bool combine_wait(const cuops_job &J, call &k, uint32_t op, uint64_t hseq,
                             const uint32_t *expect, bool report, int64_t *cost = nullptr) {
  const peers s_p = peers_of(J);
  __shared__ uint32_t s_ok;
  /* The receivers' mask from the wait on: the call's with the sources that left.  A copy of
   * their own, since a streamed combine's sending warps go on reading the call's. */
  __shared__ uint64_t s_rmask[CUOPS_MASK_WORDS];
  if (threadIdx.x == (RING ? STREAM_RECV_BASE : 0)) {
    uint32_t ok = wait_peers(J, k, op, &s_p, cost) == 0;
    for (uint32_t i = 0; i < mask_words(J); i++)
      s_rmask[i] = k.maskw[i] | s_p.left[i];
    for (uint32_t s = 0; ok && s < J.world; s++)
      if (!skipped(k, s_p, s) &&
          (s_p.op[s] != op || s_p.ref[s] != hseq || s_p.rows[s] != expect[s])) {
        if (report)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq, s_p.ref[s], 0);
        ok = 0;
      }
    s_ok = ok;
  }
  recv_sync<RING>();
  /* A source gone during the wait (wait_peers) is masked for the rest of the call: its
   * vectors are never read, their contribution zero. */
  k.mask |= s_p.left[0];
  k.maskw = s_rmask;
  return s_ok != 0;
}

/*
 * One warp writes one token's output: out[c] = bf16 of the float32 sum, in
 * order, of src[i][c] (times w[i] when `weighted`) over its n sources.
 * Lane i < n holds source i's row (src_lane) and weight (w_lane); n <= 32
 * per call, `acc` carries a longer sum over calls.  Each lane loads
 * RED_C x RED_S 16-byte vectors before it adds any, so a token's sources
 * are read in parallel, not one latency at a time.
 */
#define RED_C 2
#define RED_S 4

struct red_acc {
  float v[RED_C][8];
};

__device__ __forceinline__ void red_add(red_acc &acc, uint32_t c0, uint32_t h, uint64_t src_lane,
                                        float w_lane, bool weighted, uint32_t n) {
  for (uint32_t i = 0; i < n; i += RED_S) {
    int4 q[RED_S][RED_C];
#pragma unroll
    for (int s = 0; s < RED_S; s++) {
      const uint8_t *row = (const uint8_t *)__shfl_sync(FULL_MASK, src_lane, (i + s) & 31u);
#pragma unroll
      for (int cc = 0; cc < RED_C; cc++)
        if (i + s < n && c0 + 256u * cc < h)
          q[s][cc] = __ldcg((const int4 *)(row + 2ull * (c0 + 256u * cc)));
    }
#pragma unroll
    for (int s = 0; s < RED_S; s++) {
      float w = __shfl_sync(FULL_MASK, w_lane, (i + s) & 31u);
      if (i + s >= n)
        break;
#pragma unroll
      for (int cc = 0; cc < RED_C; cc++) {
        const uint32_t u[4] = {(uint32_t)q[s][cc].x, (uint32_t)q[s][cc].y, (uint32_t)q[s][cc].z,
                               (uint32_t)q[s][cc].w};
#pragma unroll
        for (int e = 0; e < 8; e++) {
          float v = bf2f(u[e / 2] >> (16 * (e % 2)));
          acc.v[cc][e] = __fadd_rn(acc.v[cc][e], weighted ? __fmul_rn(w, v) : v);
        }
      }
    }
  }
}

__device__ __forceinline__ void red_store(const red_acc &acc, uint8_t *out, uint32_t c0, uint32_t h,
                                          bool vec) {
#pragma unroll
  for (int cc = 0; cc < RED_C; cc++)
    if (c0 + 256u * cc < h)
      store8(out + 2ull * (c0 + 256u * cc), vec, acc.v[cc]);
}

#endif /* DEP_OPS_COMBINE_CUH */
