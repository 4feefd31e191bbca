/*
 * ops.cu — the cuda backend's MoE kernels (DESIGN §6): layout, dispatch,
 * combine and their low-latency forms, on the slab layout and protocol of
 * the host backend (kernels/host_ops.h), launched by client/cuda_ops.c.
 * This is the one translation unit of the fatbin (nvcc -fatbin takes one
 * input); its building blocks are in ops_dev.cuh.
 *
 * Grid of every communicating kernel: world * P sender CTAs (P per
 * destination, P = J.parts) then world * P receiver CTAs.  Senders never
 * wait; receivers wait, bounded, for every source's flag.  Every order is
 * the host's (sources, tokens, k ascending) and every sum a float32 sum in
 * that order with explicit round-to-nearest adds and multiplies (no FMA
 * contraction), so outputs are bit-identical to the host backend's and
 * from run to run.
 */
#include "ops_dev.cuh"

#define KERNEL extern "C" __global__ void __launch_bounds__(CUOPS_THREADS)

/* ---- layout: local, no communication ------------------------------------------- */

KERNEL dep_k_layout(const cuops_job J, const cuops_layout_args a) {
  const uint32_t K = J.topk;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens;
       t += gridDim.x * blockDim.x) {
    uint64_t mask = 0;
    for (uint32_t k = 0; k < K; k++) {
      int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + k, 0, true);
      if (e < 0)
        continue;
      atomicAdd(&a.tpe[e], 1);
      mask |= 1ull << (e / J.le);
    }
    for (uint32_t d = 0; d < J.world; d++) {
      uint32_t in = (uint32_t)(mask >> d) & 1u;
      a.tir[(uint64_t)t * J.world + d] = (uint8_t)in;
      if (in)
        atomicAdd(&a.tpr[d], 1);
    }
  }
}

/* ---- throughput dispatch ---------------------------------------------------------- */

/* Sender part `part` for destination d: every part scans every token (so all
 * agree on row numbers); rows are copied by the parts' warps in turn. */
__device__ __forceinline__ void dispatch_send(const cuops_job &J, const cuops_dispatch_args &a, const call &k,
                              uint32_t d, uint32_t part) {
  __shared__ uint32_t s_tok[CUOPS_THREADS];
  const uint32_t K = J.topk, h = J.hidden, lane = threadIdx.x & 31u;
  const uint32_t stride = J.parts * CUOPS_WARPS, me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  uint8_t *blk = block_at(J, d, k.parity, J.rank);
  uint32_t running = 0;
  for (uint32_t base = 0; base < a.num_tokens; base += CUOPS_THREADS) {
    uint32_t t = base + threadIdx.x, go = 0, total;
    if (t < a.num_tokens)
      for (uint32_t j = 0; j < K; j++) {
        int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + j, CUOPS_OP_DISPATCH,
                               d == 0 && part == 0);
        go |= e >= 0 && (uint64_t)e / J.le == d;
      }
    uint32_t off = block_scan(go, &total);
    if (go)
      s_tok[off] = t;
    if (t < a.num_tokens && part == 0)
      a.h.tp_pos[(uint64_t)t * J.world + d] = go ? (int32_t)(running + off) : -1;
    __syncthreads();
    for (uint32_t i = 0; i < total; i++) {
      uint32_t row = running + i;
      if (row % stride != me)
        continue;
      uint32_t tt = s_tok[i];
      uint8_t *dst = blk + (uint64_t)row * J.row_bytes;
      warp_copy(dst, (const uint8_t *)a.x + (uint64_t)tt * h * 2, 2ull * h);
      int32_t *meta = (int32_t *)(dst + 2ull * h);
      int32_t *ids = meta + 4;
      float *w = (float *)(ids + K);
      if (lane == 0) {
        meta[0] = (int32_t)tt;
        meta[1] = (int32_t)K;
      }
      for (uint32_t j = lane; j < K; j += 32) {
        int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)tt * K + j, CUOPS_OP_DISPATCH, false);
        bool mine = e >= 0 && (uint64_t)e / J.le == d;
        ids[j] = mine ? (int32_t)(e % J.le) : -1;
        w[j] = mine ? a.w[(uint64_t)tt * K + j] : 0.0f;
      }
    }
    running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0 && part == 0)
    a.h.tp_sent[d] = running;
  __syncthreads();
  if (threadIdx.x == 0)
    post(J, k, d, running, CUOPS_OP_DISPATCH, 0, a.num_tokens);
}

/* Receiver part `part` for source src: its rows go to recv_x after every
 * earlier source's rows. */
__device__ __forceinline__ void dispatch_recv(const cuops_job &J, const cuops_dispatch_args &a, const call &k,
                              uint32_t src, uint32_t part) {
  __shared__ peers s_p;
  __shared__ uint32_t s_ok, s_off;
  const uint32_t K = J.topk, h = J.hidden, lane = threadIdx.x & 31u;
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, CUOPS_OP_DISPATCH, &s_p) == 0, off = 0, total = 0;
    for (uint32_t s = 0; ok && s < J.world; s++) {
      if (s_p.op[s] != CUOPS_OP_DISPATCH || s_p.rows[s] > J.max_tokens) {
        if (src == 0 && part == 0)
          rec_fail(J, DEP_ERR_MISMATCH, CUOPS_OP_DISPATCH, s, CUOPS_PHASE_PEER, k.seq,
                   ((uint64_t)s_p.op[s] << 32) | s_p.rows[s], 0);
        ok = 0;
      }
      off += s < src ? s_p.rows[s] : 0;
      total += s_p.rows[s];
    }
    s_ok = ok, s_off = off;
    if (ok && part == 0) {
      a.h.tp_from[src] = s_p.rows[src];
      ((volatile uint32_t *)J.host->recv_from)[src] = s_p.rows[src];
      if (src == 0) {
        *(volatile uint32_t *)&J.host->num_recv = total;
        *a.h.seq = k.seq;
      }
    }
  }
  __syncthreads();
  if (!s_ok)
    return;
  const uint32_t n = s_p.rows[src], stride = J.parts * CUOPS_WARPS;
  const uint8_t *blk = block_at(J, J.rank, k.parity, src);
  for (uint32_t j = part * CUOPS_WARPS + (threadIdx.x >> 5); j < n; j += stride) {
    const uint8_t *row = blk + (uint64_t)j * J.row_bytes;
    uint64_t out = (uint64_t)s_off + j;
    warp_copy((uint8_t *)a.rx + out * h * 2, row, 2ull * h);
    const int32_t *ids = (const int32_t *)(row + 2ull * h) + 4;
    const float *w = (const float *)(ids + K);
    for (uint32_t i = lane; i < K; i += 32) {
      int32_t id = __ldcg(ids + i);
      int32_t l = id >= 0 && (uint32_t)id < J.le ? id : -1;
      a.ridx[out * K + i] = l;
      a.rw[out * K + i] = l >= 0 ? __ldcg(w + i) : 0.0f;
      if (l >= 0)
        atomicAdd(&a.cnt[l], 1);
    }
  }
}

KERNEL dep_k_dispatch(const cuops_job J, const cuops_dispatch_args a) {
  call k = call_begin(J);
  const uint32_t senders = J.world * J.parts;
  if (!k.skip) {
    if (blockIdx.x < senders)
      dispatch_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts);
    else
      dispatch_recv(J, a, k, (blockIdx.x - senders) / J.parts, (blockIdx.x - senders) % J.parts);
  }
  call_end(J, k);
}

/* ---- throughput combine ------------------------------------------------------------- */

/* Receiver side shared by both combines: wait, then check that every source
 * answered this handle's dispatch with the expected number of vectors. */
__device__ __forceinline__ bool combine_wait(const cuops_job &J, const call &k, uint32_t op, uint64_t hseq,
                             const uint32_t *expect, bool report) {
  __shared__ peers s_p;
  __shared__ uint32_t s_ok;
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p) == 0;
    for (uint32_t s = 0; ok && s < J.world; s++)
      if (s_p.op[s] != op || s_p.ref[s] != hseq || s_p.rows[s] != expect[s]) {
        if (report)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq, s_p.ref[s], 0);
        ok = 0;
      }
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

KERNEL dep_k_combine(const cuops_job J, const cuops_combine_args a) {
  call k = call_begin(J);
  const uint32_t senders = J.world * J.parts, h = J.hidden, W = J.world;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint64_t hseq = *a.h.seq;
  if (!k.skip && blockIdx.x < senders) {
    /* Rows from source d are contiguous in x, sources ascending: send each
     * back to row j of d's block, in the order they came. */
    const uint32_t d = blockIdx.x / J.parts, part = blockIdx.x % J.parts;
    uint32_t off = 0;
    for (uint32_t s = 0; s < d; s++)
      off += a.h.tp_from[s];
    const uint32_t n = a.h.tp_from[d];
    uint8_t *blk = block_at(J, d, k.parity, J.rank);
    for (uint32_t j = part * CUOPS_WARPS + warp; j < n; j += J.parts * CUOPS_WARPS)
      warp_copy(blk + (uint64_t)j * J.row_bytes,
                (const uint8_t *)a.x + ((uint64_t)off + j) * h * 2, 2ull * h);
    __syncthreads();
    if (threadIdx.x == 0)
      post(J, k, d, n, CUOPS_OP_COMBINE, hseq, a.num_tokens);
  } else if (!k.skip) {
    const uint32_t r = blockIdx.x - senders, R = senders;
    if (combine_wait(J, k, CUOPS_OP_COMBINE, hseq, a.h.tp_sent, r == 0)) {
      const bool vec = ((uintptr_t)a.out & 15u) == 0;
      for (uint32_t t = r * CUOPS_WARPS + warp; t < a.num_tokens; t += R * CUOPS_WARPS) {
        for (uint32_t c = lane * 8; c < h; c += 256) {
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
          for (uint32_t s = 0; s < W; s++) {
            int32_t p = a.h.tp_pos[(uint64_t)t * W + s];
            if (p < 0)
              continue;
            load8(block_at(J, J.rank, k.parity, s) + (uint64_t)p * J.row_bytes + c * 2ull, true,
                  v);
#pragma unroll
            for (int i = 0; i < 8; i++)
              acc[i] = __fadd_rn(acc[i], v[i]);
          }
          store8((uint8_t *)a.out + ((uint64_t)t * h + c) * 2, vec, acc);
        }
      }
    }
  }
  call_end(J, k);
}

/* ---- low-latency dispatch --------------------------------------------------------------- */

/* One token's distinct local experts on rank d, in order of first appearance. */
__device__ __forceinline__ uint32_t ll_select(const cuops_job &J, const void *idx, int32_t itype,
                                              uint32_t t, uint32_t d, bool report, int32_t *ids) {
  uint32_t n = 0;
  for (uint32_t j = 0; j < J.topk; j++) {
    int64_t e = checked_id(J, idx, itype, (uint64_t)t * J.topk + j, CUOPS_OP_LL_DISPATCH, report);
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

/* One token to FP8 by one warp: per 128 channels, scale = max(amax, 1e-4) / 448. */
__device__ __forceinline__ void warp_fp8(uint8_t *dst, const uint16_t *x, uint32_t h) {
  const uint32_t lane = threadIdx.x & 31u;
  float *scales = (float *)(dst + h);
  for (uint32_t g = 0; g < h / 128; g++) {
    float v[4], amax = 0.0f;
    for (int i = 0; i < 4; i++) {
      v[i] = bf2f(x[g * 128 + lane * 4 + i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o > 0; o >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    float scale = __fdiv_rn(amax > 1e-4f ? amax : 1e-4f, 448.0f);
    uint32_t q = 0;
    for (int i = 0; i < 4; i++)
      q |= f2e4m3(__fdiv_rn(v[i], scale)) << (8 * i);
    *(uint32_t *)(dst + g * 128 + lane * 4) = q;
    if (lane == 0)
      scales[g] = scale;
  }
}

__device__ __forceinline__ void ll_dispatch_send(const cuops_job &J, const cuops_ll_dispatch_args &a,
                                 const call &k, uint32_t d, uint32_t part, uint32_t op) {
  __shared__ uint32_t s_tok[CUOPS_THREADS];
  const uint32_t K = J.topk, h = J.hidden;
  const uint32_t stride = J.parts * CUOPS_WARPS, me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  uint8_t *blk = block_at(J, d, k.parity, J.rank);
  uint32_t rows = 0, vecs = 0;
  for (uint32_t base = 0; base < a.num_tokens; base += CUOPS_THREADS) {
    uint32_t t = base + threadIdx.x, n = 0, trows, tvecs;
    int32_t ids[16];
    if (t < a.num_tokens)
      n = ll_select(J, a.idx, a.itype, t, d, d == 0 && part == 0, ids);
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
        uint32_t i = 0;
        while (ids[i] != (int32_t)(e % J.le))
          i++;
        route[0] = (int32_t)e;
        route[1] = (int32_t)(vecs + voff + i);
      }
    }
    if (n > 0) {
      s_tok[roff] = t;
      if (part == 0) {
        int32_t *meta = (int32_t *)(blk + (uint64_t)(rows + roff) * J.row_bytes + 2ull * h);
        meta[0] = (int32_t)t;
        meta[1] = (int32_t)n;
        for (uint32_t i = 0; i < n; i++)
          meta[4 + i] = ids[i];
      }
    }
    __syncthreads();
    for (uint32_t i = 0; i < trows; i++) {
      uint32_t row = rows + i;
      if (row % stride != me)
        continue;
      const uint16_t *x = (const uint16_t *)a.x + (uint64_t)s_tok[i] * h;
      uint8_t *dst = blk + (uint64_t)row * J.row_bytes;
      if (a.fp8)
        warp_fp8(dst, x, h);
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
    post(J, k, d, rows, op, 0, a.num_tokens);
}

/* The distinct experts a received row names, or 0 for a malformed row. */
__device__ __forceinline__ uint32_t ll_row_ids(const cuops_job &J, const uint8_t *row,
                                               int32_t *ids) {
  const int32_t *meta = (const int32_t *)(row + 2ull * J.hidden);
  int32_t n = __ldcg(meta + 1);
  if (n < 1 || (uint32_t)n > J.kd)
    return 0;
  for (int32_t i = 0; i < n; i++) {
    ids[i] = __ldcg(meta + 4 + i);
    if (ids[i] < 0 || (uint32_t)ids[i] >= J.le)
      return 0;
    for (int32_t j = 0; j < i; j++)
      if (ids[j] == ids[i])
        return 0;
  }
  return (uint32_t)n;
}

/* Receiver r of R: experts r, r + R, ...; each expert's rows packed from 0
 * in (source, token) order by a block-wide scan over every received row. */
__device__ __forceinline__ void ll_dispatch_recv(const cuops_job &J, const cuops_ll_dispatch_args &a,
                                 const call &k, uint32_t r, uint32_t R, uint32_t op) {
  __shared__ peers s_p;
  __shared__ uint32_t s_ok, s_row[CUOPS_THREADS];
  const uint32_t h = J.hidden, G = h / 128, warp = threadIdx.x >> 5;
  const uint64_t rows_ll = (uint64_t)J.world * J.max_ll;
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p) == 0;
    for (uint32_t s = 0; ok && s < J.world; s++)
      if (s_p.op[s] != op || s_p.rows[s] > J.max_ll) {
        if (r == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq,
                   ((uint64_t)s_p.op[s] << 32) | s_p.rows[s], 0);
        ok = 0;
      }
    s_ok = ok;
    if (ok && r == 0) {
      for (uint32_t s = 0; s < J.world; s++)
        a.h.ll_rows[s] = s_p.rows[s];
      *a.h.seq = k.seq;
    }
  }
  __syncthreads();
  if (!s_ok)
    return;
  int32_t ids[16];
  if (r == 0) /* the combine needs each row's number of vectors */
    for (uint32_t s = 0; s < J.world; s++)
      for (uint32_t j = threadIdx.x; j < s_p.rows[s]; j += CUOPS_THREADS) {
        const uint8_t *row = block_at(J, J.rank, k.parity, s) + (uint64_t)j * J.row_bytes;
        uint32_t n = ll_row_ids(J, row, ids);
        if (n == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq, j, 0);
        a.h.ll_nids[(uint64_t)s * J.max_ll + j] = (int32_t)n;
      }
  for (uint32_t l = r; l < J.le; l += R) {
    uint32_t pos = 0;
    for (uint32_t s = 0; s < J.world; s++) {
      const uint8_t *blk = block_at(J, J.rank, k.parity, s);
      for (uint32_t base = 0; base < s_p.rows[s]; base += CUOPS_THREADS) {
        uint32_t j = base + threadIdx.x, sel = 0, which = 0, total;
        if (j < s_p.rows[s]) {
          uint32_t n = ll_row_ids(J, blk + (uint64_t)j * J.row_bytes, ids);
          for (uint32_t i = 0; i < n && !sel; i++)
            if ((uint32_t)ids[i] == l)
              sel = 1, which = i;
        }
        uint32_t off = block_scan(sel, &total);
        if (sel) {
          s_row[off] = j;
          int32_t *m = a.h.ll_map + (((uint64_t)s * J.max_ll + j) * J.kd + which) * 2;
          m[0] = (int32_t)l;
          m[1] = (int32_t)(pos + off);
        }
        __syncthreads();
        for (uint32_t i = warp; i < total; i += CUOPS_WARPS) {
          const uint8_t *row = blk + (uint64_t)s_row[i] * J.row_bytes;
          uint64_t at = (uint64_t)l * rows_ll + pos + i;
          if (a.fp8) {
            warp_copy((uint8_t *)a.rx + at * h, row, h);
            warp_copy(a.rs + at * G, row + h, 4ull * G);
          } else {
            warp_copy((uint8_t *)a.rx + at * h * 2, row, 2ull * h);
          }
        }
        pos += total;
        __syncthreads();
      }
    }
    if (threadIdx.x == 0)
      a.cnt[l] = (int32_t)pos;
  }
}

KERNEL dep_k_ll_dispatch(const cuops_job J, const cuops_ll_dispatch_args a) {
  call k = call_begin(J);
  const uint32_t senders = J.world * J.parts;
  const uint32_t op = CUOPS_OP_LL_DISPATCH | (a.fp8 ? CUOPS_OP_FP8 : 0u);
  if (!k.skip) {
    if (blockIdx.x < senders)
      ll_dispatch_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts, op);
    else
      ll_dispatch_recv(J, a, k, blockIdx.x - senders, senders, op);
  }
  call_end(J, k);
}

/* ---- low-latency combine ------------------------------------------------------------------ */

/* Sender for d: one vector per (row d sent, its distinct expert), in the
 * order d enumerates them, packed from the start of d's block. */
__device__ __forceinline__ void ll_combine_send(const cuops_job &J, const cuops_ll_combine_args &a, const call &k,
                                uint32_t d, uint32_t part, uint64_t hseq) {
  __shared__ uint32_t s_vb[CUOPS_THREADS], s_n[CUOPS_THREADS];
  const uint32_t h = J.hidden, stride = J.parts * CUOPS_WARPS;
  const uint32_t me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  const uint64_t rows_ll = (uint64_t)J.world * J.max_ll, cap = (uint64_t)J.le * rows_ll;
  const uint32_t n = a.h.ll_rows[d];
  uint8_t *blk = block_at(J, d, k.parity, J.rank);
  uint32_t vecs = 0;
  for (uint32_t base = 0; base < n; base += CUOPS_THREADS) {
    uint32_t j = base + threadIdx.x, nids = 0, total;
    if (j < n)
      nids = (uint32_t)a.h.ll_nids[(uint64_t)d * J.max_ll + j];
    uint32_t off = block_scan(nids, &total);
    s_vb[threadIdx.x] = vecs + off;
    s_n[threadIdx.x] = nids;
    __syncthreads();
    for (uint32_t u = 0; u < CUOPS_THREADS && base + u < n; u++)
      for (uint32_t i = 0; i < s_n[u]; i++) {
        uint32_t v = s_vb[u] + i;
        if (v % stride != me)
          continue;
        const int32_t *m = a.h.ll_map + (((uint64_t)d * J.max_ll + base + u) * J.kd + i) * 2;
        uint64_t at = (uint64_t)(uint32_t)m[0] * rows_ll + (uint32_t)m[1];
        if (at < cap) /* a malformed dispatch row left this entry unset: skip it */
          warp_copy(blk + (uint64_t)v * h * 2, (const uint8_t *)a.x + at * h * 2, 2ull * h);
      }
    vecs += total;
    __syncthreads();
  }
  if (threadIdx.x == 0)
    post(J, k, d, vecs, CUOPS_OP_LL_COMBINE, hseq, a.num_tokens);
}

KERNEL dep_k_ll_combine(const cuops_job J, const cuops_ll_combine_args a) {
  call k = call_begin(J);
  const uint32_t senders = J.world * J.parts, h = J.hidden, K = J.topk;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint64_t hseq = *a.h.seq, vcap = (uint64_t)J.max_ll * J.kd;
  if (!k.skip && blockIdx.x < senders) {
    ll_combine_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts, hseq);
  } else if (!k.skip) {
    const uint32_t r = blockIdx.x - senders, R = senders;
    if (combine_wait(J, k, CUOPS_OP_LL_COMBINE, hseq, a.h.ll_expect, r == 0)) {
      const bool vec = ((uintptr_t)a.out & 15u) == 0;
      for (uint32_t t = r * CUOPS_WARPS + warp; t < a.num_tokens; t += R * CUOPS_WARPS) {
        if (lane == 0) /* the ids must be the dispatch's */
          for (uint32_t j = 0; j < K; j++)
            if (idx_at(a.idx, a.itype, (uint64_t)t * K + j) != a.h.ll_route[((uint64_t)t * K + j) * 2])
              rec_fail(J, DEP_ERR_INVALID, CUOPS_OP_LL_COMBINE, t, CUOPS_PHASE_IDS, k.seq,
                       (uint64_t)idx_at(a.idx, a.itype, (uint64_t)t * K + j), 0);
        for (uint32_t c = lane * 8; c < h; c += 256) {
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
          for (uint32_t j = 0; j < K; j++) {
            const int32_t *route = a.h.ll_route + ((uint64_t)t * K + j) * 2;
            int32_t e = route[0];
            uint32_t vi = (uint32_t)route[1];
            if (e < 0 || vi >= vcap)
              continue;
            float w = a.w[(uint64_t)t * K + j];
            load8(block_at(J, J.rank, k.parity, (uint32_t)e / J.le) + (uint64_t)vi * h * 2 + c * 2ull,
                  true, v);
#pragma unroll
            for (int i = 0; i < 8; i++)
              acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
          }
          store8((uint8_t *)a.out + ((uint64_t)t * h + c) * 2, vec, acc);
        }
      }
    }
  }
  call_end(J, k);
}
