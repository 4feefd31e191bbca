/*
 * ops_copy.cuh — the cuda kernels' copies (a warp's 16-byte vector copies,
 * to one destination or several, and bf16 stores of 8 floats) and the
 * block-wide prefix sum.  ops_dev.cuh includes it; FULL_MASK and
 * CUOPS_WARPS are its and kabi.h's.
 */
#ifndef DEP_OPS_COPY_CUH
#define DEP_OPS_COPY_CUH

#include <stdint.h>

/* ---- copies ---------------------------------------------------------------------- */

/*
 * One warp copies `bytes` (even): 16-byte vectors when both ends allow,
 * else 4- or 2-byte words.  Loads bypass L1 (.cg): slab lines another
 * rank rewrote since this SM last read them must not come from L1.  Each
 * lane keeps COPY_UNROLL loads in flight before it stores: a copy with one
 * load in flight per thread runs at the memory's latency, not its bandwidth.
 */
#define COPY_UNROLL 8

__device__ __forceinline__ void warp_copy(void *dst, const void *src, uint64_t bytes) {
  const uint32_t lane = threadIdx.x & 31u;
  uintptr_t al = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)bytes;
  if ((al & 15u) == 0) {
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    const uint64_t n = bytes / 16;
    for (uint64_t i = lane; i < n; i += 32 * COPY_UNROLL) {
      int4 v[COPY_UNROLL];
#pragma unroll
      for (int u = 0; u < COPY_UNROLL; u++)
        if (i + 32u * u < n)
          v[u] = __ldcg(s + i + 32u * u);
#pragma unroll
      for (int u = 0; u < COPY_UNROLL; u++)
        if (i + 32u * u < n)
          d[i + 32u * u] = v[u];
    }
  } else if ((al & 3u) == 0) {
    const uint32_t *s = (const uint32_t *)src;
    uint32_t *d = (uint32_t *)dst;
    for (uint64_t i = lane; i < bytes / 4; i += 32)
      d[i] = __ldcg(s + i);
  } else {
    const unsigned short *s = (const unsigned short *)src;
    unsigned short *d = (unsigned short *)dst;
    for (uint64_t i = lane; i < bytes / 2; i += 32)
      d[i] = __ldcg(s + i);
  }
}

/*
 * One warp copies `bytes` from src to n destinations, lane i < n holding
 * destination i (dst_lane): the source is read once (16-byte vectors,
 * COPY_UNROLL in flight) and stored n times.  Every pointer and `bytes`
 * must be 16-byte aligned.
 */
__device__ __forceinline__ void warp_copy_multi(uint64_t dst_lane, uint32_t n, const void *src,
                                                uint64_t bytes) {
  const uint32_t lane = threadIdx.x & 31u;
  const int4 *s = (const int4 *)src;
  const uint64_t m = bytes / 16;
  for (uint64_t b = 0; b < m; b += 32 * COPY_UNROLL) { /* warp-uniform: the stores shuffle */
    const uint64_t i = b + lane;
    int4 v[COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; u++)
      if (i + 32u * u < m)
        v[u] = __ldcg(s + i + 32u * u);
    for (uint32_t j = 0; j < n; j++) {
      int4 *d = (int4 *)__shfl_sync(FULL_MASK, dst_lane, j);
#pragma unroll
      for (int u = 0; u < COPY_UNROLL; u++)
        if (i + 32u * u < m)
          d[i + 32u * u] = v[u];
    }
  }
}

/* 8 floats rounded to bf16 at p (16-byte aligned when `vec`). */
__device__ __forceinline__ void store8(void *p, bool vec, const float *v) {
  if (vec) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
      w[i] = f2bf(v[2 * i]) | (f2bf(v[2 * i + 1]) << 16);
    *(int4 *)p = make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
  } else {
    unsigned short *d = (unsigned short *)p;
#pragma unroll
    for (int i = 0; i < 8; i++)
      d[i] = (unsigned short)f2bf(v[i]);
  }
}

/* ---- block-wide exclusive prefix sum (every thread of the CTA calls it) ------------ */

__device__ __forceinline__ uint32_t block_scan(uint32_t v, uint32_t *total) {
  __shared__ uint32_t s_warp[CUOPS_WARPS];
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= (uint32_t)o)
      x += y;
  }
  if (lane == 31)
    s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < CUOPS_WARPS ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(FULL_MASK, w, o);
      if (lane >= (uint32_t)o)
        w += y;
    }
    if (lane < CUOPS_WARPS)
      s_warp[lane] = w;
  }
  __syncthreads();
  uint32_t base = warp ? s_warp[warp - 1] : 0;
  *total = s_warp[CUOPS_WARPS - 1];
  __syncthreads();
  return base + x - v;
}

#endif /* DEP_OPS_COPY_CUH */
