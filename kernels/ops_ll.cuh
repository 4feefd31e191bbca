/*
 * ops_ll.cuh — the cuda backend's low-latency kernels: the low-latency
 * dispatch, its FP8 cast, the low-latency combine and the read-back of
 * where a dispatch's rows came from, the host backend's
 * kernels/host_ops_ll.c on the GPU.  Part of the one translation unit
 * kernels/ops.cu (whose banner describes the grid), included there once.
 */
#ifndef DEP_OPS_LL_CUH
#define DEP_OPS_LL_CUH

#include "ops_combine.cuh"
#include "ops_dev.cuh"

/* ---- low-latency dispatch --------------------------------------------------------------- */

/* One token's distinct local experts on rank d, in order of first appearance. */
__device__ __forceinline__ uint32_t ll_select(const cuops_job &J, const void *idx, int32_t itype,
                                              uint32_t t, uint32_t d, bool report, int32_t *ids) {
  uint32_t n = 0;
  for (uint32_t j = 0; j < J.topk; j++) {
    int64_t e = checked_id(J, idx, itype, (uint64_t)t * J.topk + j, OPS_OP_LL_DISPATCH, report);
    if (e < 0 || (uint64_t)e / J.le != d)
      continue;
    int32_t l = (int32_t)(e % J.le);
    uint32_t i = 0;
    while (i < n && ids[i] != l)
      i++;
    if (i == n)
      ids[n++] = l;
  }
  return n;
}

/*
 * One token to FP8 by one warp: per 128 channels, scale = max(amax, 1e-4) /
 * 448.  A half-warp holds one group of 128 channels (8 per lane, one 16-byte
 * load); each lane loads FP8_UNROLL groups' worth before converting any.
 */
#define FP8_UNROLL 4

__device__ __forceinline__ void warp_fp8(uint8_t *dst, const uint16_t *x, uint32_t h) {
  const uint32_t lane = threadIdx.x & 31u, half = lane >> 4, sub = lane & 15u;
  const uint32_t G = h / 128;
  const bool vec = ((uintptr_t)x & 15u) == 0;
  float *scales = (float *)(dst + h);
  for (uint32_t g0 = 0; g0 < G; g0 += 2 * FP8_UNROLL) { /* warp-uniform: shuffles below */
    int4 q[FP8_UNROLL];
#pragma unroll
    for (int u = 0; u < FP8_UNROLL; u++) {
      const uint32_t g = g0 + 2 * u + half;
      if (g < G && vec) {
        q[u] = __ldg((const int4 *)(x + g * 128 + sub * 8));
      } else if (g < G) { /* x is only 2-byte aligned */
        uint16_t e[8];
        for (int i = 0; i < 8; i++)
          e[i] = x[g * 128 + sub * 8 + i];
        q[u] = make_int4((int)(e[0] | (uint32_t)e[1] << 16), (int)(e[2] | (uint32_t)e[3] << 16),
                         (int)(e[4] | (uint32_t)e[5] << 16), (int)(e[6] | (uint32_t)e[7] << 16));
      }
    }
#pragma unroll
    for (int u = 0; u < FP8_UNROLL; u++) {
      const uint32_t g = g0 + 2 * u + half;
      if (g0 + 2 * u >= G)
        break;
      const uint32_t w[4] = {(uint32_t)q[u].x, (uint32_t)q[u].y, (uint32_t)q[u].z, (uint32_t)q[u].w};
      float v[8], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; i++) {
        v[i] = g < G ? bf2f(w[i / 2] >> (16 * (i % 2))) : 0.0f;
        amax = fmaxf(amax, fabsf(v[i]));
      }
      for (int o = 8; o > 0; o >>= 1) /* within the half-warp */
        amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
      if (g >= G)
        continue;
      float scale = __fdiv_rn(amax > 1e-4f ? amax : 1e-4f, 448.0f);
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        lo |= f2e4m3(__fdiv_rn(v[i], scale)) << (8 * i);
        hi |= f2e4m3(__fdiv_rn(v[4 + i], scale)) << (8 * i);
      }
      *(uint2 *)(dst + g * 128 + sub * 8) = make_uint2(lo, hi);
      if (sub == 0)
        scales[g] = scale;
    }
  }
}

/*
 * Part 0 of a sender, for one CTA-wide chunk of tokens: the index of each
 * of this thread's rows among the rows of the chunk's source (this rank)
 * that name the same local expert, in token order — where the receiver
 * puts it, without scanning other rows.  Warps take turns (token order);
 * within a warp a per-expert lane mask in shared memory gives the count
 * of earlier lanes.  run[l]: rows so far that name l.
 */
__device__ __forceinline__ void ll_expert_index(const int32_t *ids, uint32_t n, uint32_t *bits,
                                                uint32_t *run, int32_t *idx) {
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, below = (1u << lane) - 1u;
  for (uint32_t w = 0; w < CUOPS_WARPS; w++) {
    if (warp == w) {
      uint32_t lead = 0;
      for (uint32_t i = 0; i < n; i++)
        atomicOr(&bits[ids[i]], 1u << lane);
      __syncwarp();
      for (uint32_t i = 0; i < n; i++) {
        uint32_t m = bits[ids[i]];
        idx[i] = (int32_t)(run[ids[i]] + __popc(m & below));
        lead |= (m & below) == 0 ? 1u << i : 0u;
      }
      __syncwarp();
      for (uint32_t i = 0; i < n; i++)
        if ((lead >> i) & 1u) {
          run[ids[i]] += __popc(bits[ids[i]]);
          bits[ids[i]] = 0;
        }
    }
    __syncthreads();
  }
}

/*
 * Sender for d: a row per token that names one of d's experts, in token
 * order; its meta: token, n distinct experts, their ids, then (after topk
 * words) each one's index among this rank's rows for that expert.
 */
__device__ __forceinline__ void ll_dispatch_send(const cuops_job &J, const cuops_ll_dispatch_args &a,
                                 const call &k, uint32_t d, uint32_t part, uint32_t op) {
  __shared__ uint32_t s_tok[CUOPS_THREADS];
  uint32_t *const s_dyn = ll_dyn(J); /* [le] lane masks, [le] running counts */
  const uint32_t K = J.topk, h = J.hidden;
  const uint32_t stride = J.parts * CUOPS_WARPS, me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t rows = 0, vecs = 0;
  const bool dead = masked(k, d); /* a masked d is sent nothing (kabi.h) */
  if (part == 0)
    for (uint32_t l = threadIdx.x; l < 2 * J.le; l += CUOPS_THREADS)
      s_dyn[l] = 0;
  __syncthreads();
  for (uint32_t base = 0; base < a.num_tokens; base += CUOPS_THREADS) {
    uint32_t t = base + threadIdx.x, n = 0, trows, tvecs;
    int32_t ids[DEP_SHAPE_MAX_TOPK], idx[DEP_SHAPE_MAX_TOPK];
    if (t < a.num_tokens)
      n = ll_select(J, a.idx, a.itype, t, d, d == 0 && part == 0, ids);
    if (dead)
      n = 0; /* its ids were read all the same: rank 0's senders report bad ones */
    uint32_t roff = block_scan(n > 0, &trows);
    uint32_t voff = block_scan(n, &tvecs);
    if (t < a.num_tokens && part == 0) {
      /* Where the combine finds the vector of each k: its rank's block, this index. */
      for (uint32_t j = 0; j < K; j++) {
        int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + j, 0, false);
        int32_t *route = a.h.ll_route + ((uint64_t)t * K + j) * 2;
        if (e < 0) {
          if (d == 0)
            route[0] = -1, route[1] = 0;
          continue;
        }
        if ((uint64_t)e / J.le != d)
          continue;
        if (dead) { /* dropped: the combine finds no vector for it (its contribution is 0) */
          route[0] = (int32_t)e, route[1] = -1;
          continue;
        }
        uint32_t i = 0;
        while (ids[i] != (int32_t)(e % J.le))
          i++;
        route[0] = (int32_t)e;
        route[1] = (int32_t)(vecs + voff + i);
      }
    }
    if (part == 0)
      ll_expert_index(ids, n, s_dyn, s_dyn + J.le, idx);
    if (n > 0) {
      s_tok[roff] = t;
      if (part == 0) {
        int32_t *meta = (int32_t *)(blk + (uint64_t)(rows + roff) * J.row_bytes + 2ull * h);
        meta[0] = (int32_t)t;
        meta[1] = (int32_t)n;
        for (uint32_t i = 0; i < n; i++) {
          meta[4 + i] = ids[i];
          meta[4 + K + i] = idx[i];
        }
      }
    }
    __syncthreads();
    for (uint32_t i = me; i < trows; i += stride) {
      const uint16_t *x = (const uint16_t *)a.x + (uint64_t)s_tok[i] * h;
      uint8_t *dst = blk + (uint64_t)(rows + i) * J.row_bytes;
      if (a.fp8)
        warp_copy(dst, a.stage + (uint64_t)s_tok[i] * CUOPS_STAGE_ROW(h), h + h / 32);
      else
        warp_copy(dst, x, 2ull * h);
    }
    rows += trows;
    vecs += tvecs;
    __syncthreads();
  }
  if (threadIdx.x == 0 && part == 0)
    a.h.ll_expect[d] = vecs;
  __syncthreads();
  if (threadIdx.x == 0)
    post(J, k, d, rows, op, 0, a.num_tokens, (uint64_t)rows * J.row_bytes);
}

/* The distinct experts a received row names, or 0 for a malformed row. */
__device__ __forceinline__ uint32_t ll_row_ids(const cuops_job &J, const uint8_t *row,
                                               int32_t *ids) {
  const int32_t *meta = (const int32_t *)(row + 2ull * J.hidden);
  int32_t n = __ldcg(meta + 1);
  if (n < 1 || (uint32_t)n > J.kd)
    return 0;
  for (int32_t i = 0; i < n; i++)
    ids[i] = __ldcg(meta + 4 + i);
  for (int32_t i = 0; i < n; i++) {
    if (ids[i] < 0 || (uint32_t)ids[i] >= J.le)
      return 0;
    for (int32_t j = 0; j < i; j++)
      if (ids[j] == ids[i])
        return 0;
  }
  return (uint32_t)n;
}

/*
 * Receiver CTA r of R.  Every CTA counts, from the rows' ids, how many
 * rows each source sent each local expert and makes the offsets (expert
 * l's rows are packed from 0 in (source, token) order); then the warps of
 * all CTAs share the rows: each puts its row at offset(l, source) + the
 * index its sender computed, for each expert it names.
 */
__device__ __forceinline__ void ll_dispatch_recv(const cuops_job &J, const cuops_ll_dispatch_args &a,
                                 const call &k, uint32_t r, uint32_t R, uint32_t op) {
  const peers s_p = peers_of(J);
  __shared__ uint32_t s_ok;
  uint32_t *const s_first = src_first(J), *const s_dyn = ll_dyn(J); /* [W][le] offsets, counts */
  const uint32_t h = J.hidden, G = h / 128, W = J.world, le = J.le, K = J.topk;
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint64_t rows_ll = (uint64_t)W * J.max_ll;
  uint32_t *off = s_dyn, *cnt = s_dyn + W * le;
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p, a.wait_cost) == 0;
    for (uint32_t s = 0; ok && s < W; s++)
      if (!skipped(k, s_p, s) && (s_p.op[s] != op || s_p.rows[s] > J.max_ll)) {
        if (r == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq,
                   ((uint64_t)s_p.op[s] << 32) | s_p.rows[s], 0);
        ok = 0;
      }
    s_ok = ok;
    s_first[0] = 0;
    for (uint32_t s = 0; ok && s < W; s++)
      s_first[s + 1] = s_first[s] + s_p.rows[s];
    if (ok && r == 0) {
      for (uint32_t s = 0; s < W; s++)
        a.h.ll_rows[s] = s_p.rows[s];
      *a.h.seq = k.seq;
    }
  }
  for (uint32_t i = threadIdx.x; i < W * le; i += CUOPS_THREADS)
    cnt[i] = 0;
  __syncthreads();
  if (!s_ok)
    return;
  const uint32_t total = s_first[W];
  /* count: a thread per row */
  for (uint32_t f = threadIdx.x; f < total; f += CUOPS_THREADS) {
    uint32_t s = 0;
    while (f >= s_first[s + 1])
      s++;
    int32_t ids[DEP_SHAPE_MAX_TOPK];
    const uint8_t *row = recv_block(J, k.parity, s) + (uint64_t)(f - s_first[s]) * J.row_bytes;
    uint32_t n = ll_row_ids(J, row, ids);
    for (uint32_t i = 0; i < n; i++)
      atomicAdd(&cnt[s * le + (uint32_t)ids[i]], 1u);
  }
  __syncthreads();
  for (uint32_t l = threadIdx.x; l < le; l += CUOPS_THREADS) {
    uint32_t run = 0;
    for (uint32_t s = 0; s < W; s++) {
      off[s * le + l] = run;
      run += cnt[s * le + l];
    }
    if (r == 0)
      a.cnt[l] = (int32_t)run;
  }
  __syncthreads();
  /* place: a warp per row */
  const bool vec = ((uintptr_t)a.rx & 15u) == 0;
  for (uint32_t f = r * CUOPS_WARPS + warp; f < total; f += R * CUOPS_WARPS) {
    uint32_t s = 0;
    while (f >= s_first[s + 1])
      s++;
    const uint32_t j = f - s_first[s];
    const uint8_t *row = recv_block(J, k.parity, s) + (uint64_t)j * J.row_bytes;
    const int32_t *meta = (const int32_t *)(row + 2ull * h);
    int32_t ids[DEP_SHAPE_MAX_TOPK];
    uint32_t n = ll_row_ids(J, row, ids); /* the same for every lane */
    int32_t l = -1, ix = -1;
    if (lane < n) {
      l = ids[lane];
      ix = __ldcg(meta + 4 + K + lane);
    }
    bool bad = lane < n && (ix < 0 || (uint32_t)ix >= cnt[s * le + l]);
    if (__any_sync(FULL_MASK, bad) || n == 0) {
      if (lane == 0)
        rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq, j, 0);
      n = 0;
    }
    const uint32_t pos = lane < n ? off[s * le + l] + (uint32_t)ix : 0;
    const uint64_t at = (uint64_t)(lane < n ? l : 0) * rows_ll + pos;
    if (lane < n) {
      int32_t *m = a.h.ll_map + (((uint64_t)s * J.max_ll + j) * J.kd + lane) * 2;
      m[0] = l;
      m[1] = (int32_t)pos;
    }
    if (lane == 0) {
      a.h.ll_nids[(uint64_t)s * J.max_ll + j] = (int32_t)n;
      a.h.ll_src[(uint64_t)s * J.max_ll + j] = __ldcg(meta); /* dep__k_ll_info's src */
    }
    if (a.fp8) {
      uint64_t dst = (uint64_t)((uint8_t *)a.rx + at * h);
      if (vec) {
        warp_copy_multi(dst, n, row, h);
      } else {
        for (uint32_t i = 0; i < n; i++)
          warp_copy((uint8_t *)__shfl_sync(FULL_MASK, dst, i), row, h);
      }
      for (uint32_t i = 0; i < n; i++) {
        uint64_t sat = __shfl_sync(FULL_MASK, at, i);
        warp_copy(a.rs + sat * G, row + h, 4ull * G);
      }
    } else {
      uint64_t dst = (uint64_t)((uint8_t *)a.rx + at * h * 2);
      if (vec) {
        warp_copy_multi(dst, n, row, 2ull * h);
      } else {
        for (uint32_t i = 0; i < n; i++)
          warp_copy((uint8_t *)__shfl_sync(FULL_MASK, dst, i), row, 2ull * h);
      }
    }
  }
}

/* a.phase: the whole call, its send alone or its receive alone (kabi.h "Split calls"); the
 * receive reads none of the caller's inputs, only the slab and the handle. */
TIMED_KERNEL deepepd::ll::dispatch(const cuops_job J, const cuops_ll_dispatch_args a) {
  const uint32_t op = OPS_OP_LL_DISPATCH | (a.fp8 ? OPS_OP_FP8 : 0u);
  call k = call_begin(J, a.phase, a.back, op);
  if (!k.skip) {
    /* the CTA's units in turn (kabi.h "SM budget"): each begins and ends at a __syncthreads
     * of the whole CTA, so the next one's shared counts start over */
    for (uint32_t u = blockIdx.x; (a.phase & CUOPS_SEND) && u < units(J); u += gridDim.x)
      ll_dispatch_send(J, a, k, u / J.parts, u % J.parts, op);
    if (a.phase & CUOPS_RECV)
      ll_dispatch_recv(J, a, k, blockIdx.x, gridDim.x, op);
  }
  call_end(J, k, DEP_STATS_OP_LL_DISPATCH, dep_stats_bytes(a.num_tokens, J.hidden, a.fp8 != 0));
}

/* ---- low-latency combine ------------------------------------------------------------------ */

/* Sender for d: one vector per (row d sent, its distinct expert), in the
 * order d enumerates them, packed from the start of d's block; a warp per row. */
__device__ __forceinline__ void ll_combine_send(const cuops_job &J, const cuops_ll_combine_args &a, const call &k,
                                uint32_t d, uint32_t part, uint64_t hseq) {
  __shared__ uint32_t s_vb[CUOPS_THREADS], s_n[CUOPS_THREADS];
  const uint32_t h = J.hidden, stride = J.parts * CUOPS_WARPS, lane = threadIdx.x & 31u;
  const uint32_t me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  const uint64_t rows_ll = (uint64_t)J.world * J.max_ll, cap = (uint64_t)J.le * rows_ll;
  const uint32_t n = masked(k, d) ? 0 : a.h.ll_rows[d]; /* nothing back to a masked rank */
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t vecs = 0;
  for (uint32_t base = 0; base < n; base += CUOPS_THREADS) {
    uint32_t j = base + threadIdx.x, nids = 0, total;
    if (j < n)
      nids = (uint32_t)a.h.ll_nids[(uint64_t)d * J.max_ll + j];
    uint32_t off = block_scan(nids, &total);
    s_vb[threadIdx.x] = vecs + off;
    s_n[threadIdx.x] = nids;
    __syncthreads();
    for (uint32_t u = me; u < CUOPS_THREADS && base + u < n; u += stride) {
      /* lane i < s_n[u] fetches where vector i of this row lives */
      const uint32_t nv = s_n[u];
      uint64_t src = 0;
      if (lane < nv) {
        const int32_t *m = a.h.ll_map + (((uint64_t)d * J.max_ll + base + u) * J.kd + lane) * 2;
        uint64_t at = (uint64_t)(uint32_t)m[0] * rows_ll + (uint32_t)m[1];
        src = at < cap ? (uint64_t)((const uint8_t *)a.x + at * h * 2) : 0;
      }
      for (uint32_t i = 0; i < nv; i++) {
        const uint8_t *from = (const uint8_t *)__shfl_sync(FULL_MASK, src, i);
        if (from != NULL) /* a malformed dispatch row left this entry unset: skip it */
          warp_copy(blk + (uint64_t)(s_vb[u] + i) * h * 2, from, 2ull * h);
      }
    }
    vecs += total;
    __syncthreads();
  }
  if (threadIdx.x == 0)
    post(J, k, d, vecs, OPS_OP_LL_COMBINE, hseq, a.num_tokens, (uint64_t)vecs * h * 2);
}

/* a.phase as the dispatch's; the receive reads topk_idx and topk_weights (deepep.h), not x. */
TIMED_KERNEL deepepd::ll::combine(const cuops_job J, const cuops_ll_combine_args a) {
  call k = call_begin(J, a.phase, a.back, OPS_OP_LL_COMBINE);
  const uint32_t h = J.hidden, K = J.topk;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint64_t hseq = *a.h.seq, vcap = (uint64_t)J.max_ll * J.kd;
  if (!k.skip) {
    for (uint32_t u = blockIdx.x; (a.phase & CUOPS_SEND) && u < units(J); u += gridDim.x)
      ll_combine_send(J, a, k, u / J.parts, u % J.parts, hseq); /* its units in turn */
    const uint32_t r = blockIdx.x, R = gridDim.x;
    if ((a.phase & CUOPS_RECV) &&
        combine_wait(J, k, OPS_OP_LL_COMBINE, hseq, a.h.ll_expect, r == 0, a.wait_cost)) {
      const bool vec = ((uintptr_t)a.out & 15u) == 0;
      for (uint32_t t = r * CUOPS_WARPS + warp; t < a.num_tokens; t += R * CUOPS_WARPS) {
        /* lane j < K: route j of this token; the ids must be the dispatch's */
        uint64_t src = 0;
        float w = 0.0f;
        if (lane < K) {
          const int32_t *route = a.h.ll_route + ((uint64_t)t * K + lane) * 2;
          int64_t id = idx_at(a.idx, a.itype, (uint64_t)t * K + lane);
          if (id != route[0])
            rec_fail(J, DEP_ERR_INVALID, OPS_OP_LL_COMBINE, t, CUOPS_PHASE_IDS, k.seq,
                     (uint64_t)id, 0);
          int32_t e = route[0];
          uint32_t vi = (uint32_t)route[1];
          if (e >= 0 && vi < vcap && !masked(k, (uint32_t)e / J.le)) { /* masked: zero */
            src = (uint64_t)(recv_block(J, k.parity, (uint32_t)e / J.le) + (uint64_t)vi * h * 2);
            w = a.w[(uint64_t)t * K + lane];
          }
        }
        const uint32_t have = __ballot_sync(FULL_MASK, src != 0);
        const uint32_t from = __fns(have, 0, (int)lane + 1); /* lane i: the i-th present route */
        src = __shfl_sync(FULL_MASK, src, from < 32 ? from : 0);
        w = __shfl_sync(FULL_MASK, w, from < 32 ? from : 0);
        uint8_t *out = (uint8_t *)a.out + (uint64_t)t * h * 2;
        for (uint32_t c = 0; c < h; c += 256u * RED_C) { /* warp-uniform: red_add shuffles */
          const uint32_t c0 = c + lane * 8;
          red_acc acc = {};
          red_add(acc, c0, h, src, w, true, __popc(have));
          red_store(acc, out, c0, h, vec);
        }
      }
    }
  }
  call_end(J, k, DEP_STATS_OP_LL_COMBINE, dep_stats_bytes(a.num_tokens, J.hidden, false));
}

/* ---- what a low-latency dispatch received, by source (dep_ll_handle_info) ---------------- */

/*
 * CTA l fills local expert l's part of both outputs, from the handle
 * alone (no call of the protocol: it neither posts nor waits): src's rows
 * -1, then each received row that names l writes its source token at its
 * row and counts one for its source; then the counts' running sum over
 * sources gives each source's first row (an expert's rows are packed in
 * (source, token) order).  Every CTA reads every row's ids, which are few
 * beside the rows' payload the dispatch moved.
 */
KERNEL dep__k_ll_info(const cuops_job J, const cuops_ll_info_args a) {
  uint32_t *const s_first = src_first(J), *const s_cnt = src_off(J);
  const uint32_t W = J.world, l = blockIdx.x;
  const uint64_t rows_ll = (uint64_t)W * J.max_ll;
  int32_t *src = a.src + (uint64_t)l * rows_ll;
  for (uint64_t i = threadIdx.x; i < rows_ll; i += CUOPS_THREADS)
    src[i] = -1;
  for (uint32_t s = threadIdx.x; s < W; s += CUOPS_THREADS)
    s_cnt[s] = 0;
  if (threadIdx.x == 0) {
    s_first[0] = 0;
    for (uint32_t s = 0; s < W; s++)
      s_first[s + 1] = s_first[s] + min(a.h.ll_rows[s], J.max_ll);
  }
  __syncthreads();
  for (uint32_t f = threadIdx.x; f < s_first[W]; f += CUOPS_THREADS) {
    uint32_t s = 0;
    while (f >= s_first[s + 1])
      s++;
    const uint64_t at = (uint64_t)s * J.max_ll + (f - s_first[s]);
    const int32_t n = a.h.ll_nids[at];
    for (int32_t i = 0; i < n && (uint32_t)i < J.kd; i++) {
      const int32_t *m = a.h.ll_map + (at * J.kd + (uint32_t)i) * 2;
      if (m[0] == (int32_t)l && (uint32_t)m[1] < rows_ll) {
        src[m[1]] = a.h.ll_src[at];
        atomicAdd(&s_cnt[s], 1u);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t begin = 0;
    for (uint32_t s = 0; s < W; s++) {
      a.range[(uint64_t)l * W + s] = DEP_LL_RANGE(begin, s_cnt[s]);
      begin += s_cnt[s];
    }
  }
}

/* ---- the FP8 cast of a low-latency dispatch --------------------------------------------- */

/* Every token of this rank to FP8 once, a warp per token, into the staging
 * rows that deepepd::ll::dispatch's senders then copy (launched just before it). */
KERNEL dep__k_ll_cast(const cuops_job J, const cuops_ll_dispatch_args a) {
  const uint32_t h = J.hidden;
  for (uint32_t t = blockIdx.x * CUOPS_WARPS + (threadIdx.x >> 5); t < a.num_tokens;
       t += gridDim.x * CUOPS_WARPS)
    warp_fp8(a.stage + (uint64_t)t * CUOPS_STAGE_ROW(h), (const uint16_t *)a.x + (uint64_t)t * h, h);
}

#endif /* DEP_OPS_LL_CUH */
