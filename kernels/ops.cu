/*
 * ops.cu — the cuda backend's MoE kernels (DESIGN §6): layout, dispatch,
 * combine and their low-latency forms, on the slab layout and protocol of
 * the host backend (kernels/host_ops.h), launched by client/cuda_ops.c.
 * This is the one translation unit of the fatbin (nvcc -fatbin takes one
 * input); its building blocks are in ops_dev.cuh.
 *
 * Grid of every communicating kernel: world * P CTAs (P = J.parts, the SM
 * budget: client/cuda_ops.c).  CTA b first sends, as part b % P of the
 * rows for peer b / P, without waiting; then it receives: it waits,
 * bounded, for every source's flag and takes its share of the receive
 * work — in the low-latency ops a fixed share (part b % P of source
 * b / P's rows, or every gridDim.x-th token or row), in the throughput ops
 * rows or tokens claimed from a counter as each becomes ready (the row
 * marks of ops_dev.cuh).  Every CTA doing both halves keeps every warp
 * busy in each phase (a receiver-only CTA idles while the senders run).  Every order is
 * the host's (sources, tokens, k ascending) and every sum a float32 sum in
 * that order with explicit round-to-nearest adds and multiplies (no FMA
 * contraction), so outputs are bit-identical to the host backend's and
 * from run to run.
 */
#include "ops_dev.cuh"

#define KERNEL extern "C" __global__ void __launch_bounds__(CUOPS_THREADS, CUOPS_CTAS_PER_SM)

/* ---- layout: local, no communication ------------------------------------------- */

/*
 * The last CTA of a layout logs it in the stats page: its time from that
 * CTA's start, its status, and the tokens it sends each rank, read back
 * from tokens_per_rank once every CTA has added to it (each fenced before
 * counting itself done).  Only where the rank has a stats page: a layout
 * without one pays nothing.
 */
__device__ __forceinline__ void layout_end(const cuops_job &J, const cuops_layout_args &a,
                                           uint64_t t0) {
  __syncthreads();
  if (threadIdx.x != 0)
    return;
  __threadfence();
  if (atomicAdd(&J.dev->layout_done, 1u) != gridDim.x - 1)
    return;
  J.dev->layout_done = 0;
  const uint64_t n = J.dev->layouts + 1;
  J.dev->layouts = n;
  const int32_t code = *(volatile int32_t *)&J.dev->code;
  if (code != 0)
    J.dev->code = 0;
  volatile dep_stats_layout *e = &J.stats->layouts[n % DEP_STATS_LAYOUT_RING];
  e->n = 0; /* being rewritten: the daemon skips it */
  const uint64_t ns = globaltimer_ns() - t0;
  e->ns = ns > 0xffffffffull ? 0xffffffffu : (uint32_t)ns;
  e->status = code;
  e->world = code == 0 ? J.world : 0;
  for (uint32_t d = 0; d < J.world; d++)
    e->tokens[d] = (uint32_t)*(volatile int32_t *)&a.tpr[d];
  __threadfence_system(); /* a layout is not the latency path: its entry is whole when seen */
  e->n = n;
}

KERNEL dep__k_layout(const cuops_job J, const cuops_layout_args a) {
  const uint32_t K = J.topk;
  const uint64_t t0 = J.stats != nullptr && threadIdx.x == 0 ? globaltimer_ns() : 0;
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
  if (J.stats != nullptr)
    layout_end(J, a, t0);
}

/* ---- throughput dispatch ----------------------------------------------------------
 * Every CTA sends, then receives.  CTA b sends part b % P of the rows for
 * rank b / P: its warps take contiguous groups of tokens, count the rows
 * each group makes for that rank, meet once (a barrier of the whole grid:
 * every CTA is resident, cuda_ops.h), learn from the counts of the groups
 * before theirs where their rows go, and write them, marking them as they
 * go (the row marks of ops_dev.cuh); part 0's first warp posts the rank's
 * row count before any row.  Then each warp claims rows to receive from a
 * counter shared by the grid, sources from this rank onwards (its own rows
 * come first: they are written soonest), waits for each row's mark and
 * copies it out.  So a CTA whose sends are quick (to this GPU) receives
 * while the CTAs sending across NVLink are still pushing, and on one GPU
 * every CTA does both halves.
 */

/* Rows a sender warp writes between two marks (one system fence each). */
#define DISPATCH_MARK_EVERY 4u
/* Rows a receiver warp claims at a time (and waits for at once). */
#define RECV_CLAIM 2u

/* Every CTA: wait, bounded, until the whole grid has arrived. */
__device__ __forceinline__ bool grid_meet(const cuops_job &J, const call &k, uint32_t op) {
  __shared__ uint32_t s_ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t ok = 1;
    __threadfence();
    const uint32_t gen = *(volatile uint32_t *)&J.dev->bar_gen;
    __threadfence(); /* read the generation before arriving */
    if (atomicAdd(&J.dev->bar_count, 1u) == gridDim.x - 1) {
      J.dev->bar_count = 0;
      __threadfence();
      atomicAdd(&J.dev->bar_gen, 1u);
    } else {
      for (uint32_t i = 0; *(volatile uint32_t *)&J.dev->bar_gen == gen; i++) {
        if ((i & 31u) != 31u)
          continue;
        uint64_t waited = globaltimer_ns() - k.t0;
        if (waited > J.timeout_ns || *(volatile uint32_t *)&J.dev->broken) {
          if (waited > J.timeout_ns)
            rec_fail(J, DEP_ERR_TIMEOUT, op, J.rank, CUOPS_PHASE_WAIT, k.seq, gen, waited);
          ok = 0;
          break;
        }
        if (job_aborted(J, k, CUOPS_NO_SRC, waited)) {
          rec_gone(J, op, k.seq, waited);
          ok = 0;
          break;
        }
        __nanosleep(64);
      }
    }
    __threadfence();
    s_ok = ok;
  }
  __syncthreads();
  return s_ok != 0;
}

/* Lane j < K: token t's j-th id and whether it is an expert of rank d. */
__device__ __forceinline__ bool id_for(const cuops_job &J, const cuops_dispatch_args &a, uint32_t t,
                                       uint32_t d, bool report, int64_t *e) {
  const uint32_t lane = threadIdx.x & 31u;
  *e = lane < J.topk ? checked_id(J, a.idx, a.itype, (uint64_t)t * J.topk + lane,
                                  CUOPS_OP_DISPATCH, report)
                     : -1;
  return *e >= 0 && (uint64_t)*e / J.le == d;
}

/* The op a dispatch posts and checks: DISPATCH, with FP8 and CACHED or-ed in. */
__device__ __forceinline__ uint32_t dispatch_op(const cuops_dispatch_args &a) {
  return CUOPS_OP_DISPATCH | (a.fp8 ? CUOPS_OP_FP8 : 0u) | (a.cached ? CUOPS_OP_CACHED : 0u);
}

/* One token's payload into a row: bf16, or e4m3 bytes then their scales. */
__device__ __forceinline__ void dispatch_payload(const cuops_job &J, const cuops_dispatch_args &a,
                                                 uint8_t *dst, uint32_t t) {
  const uint32_t h = J.hidden;
  if (a.fp8) {
    warp_copy(dst, (const uint8_t *)a.x + (uint64_t)t * h, h);
    warp_copy(dst + h, a.xs + (uint64_t)t * (h / 128), 4ull * (h / 128));
  } else {
    warp_copy(dst, (const uint8_t *)a.x + (uint64_t)t * h * 2, 2ull * h);
  }
}

/*
 * Sender part `part` for rank d; false when the call failed.  A cached
 * dispatch (a.cached) sends each token to the row its handle's dispatch
 * gave it (tp_pos), so it needs neither the counts nor the grid barrier:
 * the rows of a group of tokens are still contiguous, in token order.
 */
__device__ __forceinline__ bool dispatch_send(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k, uint32_t d, uint32_t part) {
  const uint32_t lane = threadIdx.x & 31u, K = J.topk, h = J.hidden;
  const uint32_t ng = J.parts * CUOPS_WARPS, g = part * CUOPS_WARPS + (threadIdx.x >> 5);
  const uint32_t gs = (a.num_tokens + ng - 1) / ng;
  const uint32_t t0 = min(g * gs, a.num_tokens), t1 = min(t0 + gs, a.num_tokens);
  uint32_t *cnt = J.tcnt + (uint64_t)d * ng;
  /* which of the group's tokens go to d, a bit each (the group is at most
   * CUOPS_MAX_TOKENS / CUOPS_WARPS tokens: one part, the largest max_tokens_per_rank) */
  __shared__ uint32_t s_go[CUOPS_WARPS][CUOPS_MAX_TOKENS / CUOPS_WARPS / 32];
  uint32_t *go_bits = s_go[threadIdx.x >> 5];
  uint32_t before = 0, all = 0; /* the rows before the group's, and to d in all */
  if (a.cached) {
    /* 1'. the handle says which tokens go to d and where the group's rows start */
    bool first = true;
    for (uint32_t b = t0; b < t1; b += 32) {
      const uint32_t t = b + lane;
      const int32_t p = t < t1 ? a.h.tp_pos[(uint64_t)t * J.world + d] : -1;
      const uint32_t bits = __ballot_sync(FULL_MASK, p >= 0);
      if (lane == 0)
        go_bits[(b - t0) / 32] = bits;
      if (first && bits != 0) {
        before = (uint32_t)__shfl_sync(FULL_MASK, p, __ffs(bits) - 1);
        first = false;
      }
    }
    __syncwarp();
    all = a.h.tp_sent[d];
    if (g == 0 && lane == 0)
      post_header(J, k, d, all, dispatch_op(a), *a.h.seq, a.num_tokens);
  } else {
    /* 1. count the group's rows for d: lane i takes every 32nd token */
    uint32_t c = 0;
    for (uint32_t b = t0; b < t1; b += 32) {
      const uint32_t t = b + lane;
      bool go = false; /* every id read: rank 0's senders report bad ones */
      for (uint32_t j = 0; t < t1 && j < K; j++) {
        int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + j, CUOPS_OP_DISPATCH, d == 0);
        go |= e >= 0 && (uint64_t)e / J.le == d;
      }
      if (t < t1 && !go)
        a.h.tp_pos[(uint64_t)t * J.world + d] = -1;
      const uint32_t bits = __ballot_sync(FULL_MASK, go);
      if (lane == 0)
        go_bits[(b - t0) / 32] = bits;
      c += __popc(bits);
    }
    if (lane == 0)
      cnt[g] = c;
    if (!grid_meet(J, k, CUOPS_OP_DISPATCH))
      return false;
    /* 2. where the group's rows start: the rows of the groups before it */
    for (uint32_t i = lane; i < ng; i += 32) {
      uint32_t v = __ldcg(cnt + i);
      before += i < g ? v : 0;
      all += v;
    }
    for (int o = 16; o > 0; o >>= 1) {
      before += __shfl_xor_sync(FULL_MASK, before, o);
      all += __shfl_xor_sync(FULL_MASK, all, o);
    }
    if (g == 0 && lane == 0) { /* the count first: receivers place their rows by it */
      a.h.tp_sent[d] = all;
      post_header(J, k, d, all, dispatch_op(a), 0, a.num_tokens);
    }
  }
  /* 3. the rows, marked every few */
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t row = before, marked = before;
  for (uint32_t b = t0; b < t1; b += 32) {
    for (uint32_t bits = go_bits[(b - t0) / 32]; bits != 0; bits &= bits - 1) {
      const uint32_t t = b + __ffs(bits) - 1;
      uint8_t *dst = blk + (uint64_t)row * J.row_bytes;
      dispatch_payload(J, a, dst, t);
      int32_t *meta = (int32_t *)(dst + 2ull * h);
      if (lane == 0) {
        meta[0] = (int32_t)t;
        meta[1] = (int32_t)K;
      }
      if (!a.cached) {
        int64_t e;
        const bool mine = id_for(J, a, t, d, false, &e);
        if (lane == 0)
          a.h.tp_pos[(uint64_t)t * J.world + d] = (int32_t)row;
        if (lane < K) {
          ((int32_t *)(meta + 4))[lane] = mine ? (int32_t)((uint64_t)e % J.le) : -1;
          ((float *)(meta + 4 + K))[lane] = mine ? a.w[(uint64_t)t * K + lane] : 0.0f;
        }
      }
      row++;
      if (row - marked == DISPATCH_MARK_EVERY) {
        mark_rows(J, k, blk, marked, 1, row);
        marked = row;
      }
    }
  }
  if (row > marked)
    mark_rows(J, k, blk, marked, 1, row);
  __syncwarp();
  if (lane == 0) /* a remote d: the block goes to the proxy once every group's rows are in */
    arrive(J, k, d, ng, false, 0, dispatch_op(a), 0, a.num_tokens, (uint64_t)all * J.row_bytes);
  return true;
}

/* Store received id i as int32, or as int64 where the caller asked (recv_index_type). */
__device__ __forceinline__ void ridx_put(const cuops_dispatch_args &a, uint64_t i, int32_t v) {
  if (a.ri64)
    ((int64_t *)a.ridx)[i] = v;
  else
    ((int32_t *)a.ridx)[i] = v;
}

/* Every warp: claim rows from the grid's counter, sources from this rank
 * on, and copy each into recv_x after every earlier source's rows.  A
 * cached dispatch checks that every source routed by the same dispatch,
 * with the rows that dispatch sent here, and leaves the handle as it is;
 * with num_worst_tokens the rows past those received get ids -1 and
 * weights 0 (DeepEP's padding). */
__device__ __forceinline__ void dispatch_recv(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k) {
  __shared__ peers s_p;
  __shared__ uint32_t s_ok, s_off[CUOPS_MAX_RANKS], s_first[CUOPS_MAX_RANKS + 1];
  const uint32_t K = J.topk, h = J.hidden, W = J.world, lane = threadIdx.x & 31u;
  const uint32_t op = dispatch_op(a);
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p) == 0, off = 0;
    const uint64_t hseq = a.cached ? *a.h.seq : 0;
    for (uint32_t s = 0; ok && s < W; s++) {
      if (s_p.op[s] != op || s_p.rows[s] > J.max_tokens ||
          (a.cached && (s_p.ref[s] != hseq || s_p.rows[s] != a.h.tp_from[s]))) {
        if (blockIdx.x == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq,
                   ((uint64_t)s_p.op[s] << 32) | s_p.rows[s], 0);
        ok = 0;
      }
      s_off[s] = off;
      off += s_p.rows[s];
    }
    if (ok && a.worst != 0 && off > a.worst) {
      if (blockIdx.x == 0)
        rec_fail(J, DEP_ERR_INVALID, op, J.rank, CUOPS_PHASE_WORST, k.seq, off, 0);
      ok = 0;
    }
    /* the claim order: sources rank, rank + 1, ... (mod world) */
    s_first[0] = 0;
    for (uint32_t q = 0; ok && q < W; q++)
      s_first[q + 1] = s_first[q] + s_p.rows[(J.rank + q) % W];
    s_ok = ok;
    if (ok && blockIdx.x == 0) {
      for (uint32_t s = 0; s < W; s++) {
        if (!a.cached)
          a.h.tp_from[s] = s_p.rows[s];
        ((volatile uint32_t *)J.host->recv_from)[s] = s_p.rows[s];
      }
      *(volatile uint32_t *)&J.host->num_recv = off;
      if (!a.cached)
        *a.h.seq = k.seq;
    }
  }
  __syncthreads();
  if (!s_ok)
    return;
  const uint32_t total = s_first[W];
  if (a.worst > total && !a.cached)
    for (uint64_t i = (uint64_t)total * K + (uint64_t)blockIdx.x * CUOPS_THREADS + threadIdx.x;
         i < (uint64_t)a.worst * K; i += (uint64_t)gridDim.x * CUOPS_THREADS) {
      ridx_put(a, i, -1);
      a.rw[i] = 0.0f;
    }
  const uint32_t G = h / 128;
  uint32_t next = lane == 0 ? atomicAdd(&J.dev->ticket, RECV_CLAIM) : 0;
  next = __shfl_sync(FULL_MASK, next, 0);
  while (next < total) {
    const uint32_t first = next, n = min(RECV_CLAIM, total - first);
    next = lane == 0 ? atomicAdd(&J.dev->ticket, RECV_CLAIM) : 0; /* in flight while we copy */
    next = __shfl_sync(FULL_MASK, next, 0);
    /* lane L < n finds claimed row L; the warp waits for all n marks at once */
    uint32_t src = 0, j = 0;
    const uint8_t *row = NULL;
    if (lane < n) {
      uint32_t q = 0;
      while (first + lane >= s_first[q + 1])
        q++;
      src = (J.rank + q) % W;
      j = first + lane - s_first[q];
      row = recv_block(J, k.parity, src) + (uint64_t)j * J.row_bytes;
    }
    if (!wait_rows(J, k, op, row, src))
      return;
    for (uint32_t i = 0; i < n; i++) {
      const uint8_t *row_i = (const uint8_t *)__shfl_sync(FULL_MASK, (uint64_t)row, i);
      const uint32_t src_i = __shfl_sync(FULL_MASK, src, i), j_i = __shfl_sync(FULL_MASK, j, i);
      const uint64_t out = (uint64_t)s_off[src_i] + j_i;
      if (a.fp8) {
        warp_copy((uint8_t *)a.rx + out * h, row_i, h);
        warp_copy(a.rxs + out * G, row_i + h, 4ull * G);
      } else {
        warp_copy((uint8_t *)a.rx + out * h * 2, row_i, 2ull * h);
      }
      if (a.cached)
        continue;
      const int32_t *ids = (const int32_t *)(row_i + 2ull * h) + 4;
      const float *w = (const float *)(ids + K);
      if (lane < K) {
        int32_t id = __ldcg(ids + lane);
        int32_t l = id >= 0 && (uint32_t)id < J.le ? id : -1;
        ridx_put(a, out * K + lane, l);
        a.rw[out * K + lane] = l >= 0 ? __ldcg(w + lane) : 0.0f;
        if (l >= 0)
          atomicAdd(&a.cnt[l], 1);
      }
    }
  }
}

KERNEL dep__k_dispatch(const cuops_job J, const cuops_dispatch_args a) {
  call k = call_begin(J);
  if (!k.skip && dispatch_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts))
    dispatch_recv(J, a, k);
  call_end(J, k, DEP_STATS_OP_DISPATCH, dep_stats_bytes(a.num_tokens, J.hidden, a.fp8 != 0));
}

/* DeepEP's expert_alignment: after dep__k_dispatch on the same stream, each
 * local expert's count rounded up to a multiple of a.align (one CTA). */
KERNEL dep__k_align(const cuops_job J, const cuops_dispatch_args a) {
  if (*(volatile uint32_t *)&J.dev->broken)
    return;
  for (uint32_t l = threadIdx.x; l < J.le; l += CUOPS_THREADS)
    a.cnt[l] = (int32_t)(((uint32_t)a.cnt[l] + a.align - 1) / a.align * a.align);
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

/* Combine's receive: the calling warp sums each token of [first, last),
 * sources ascending, from the rows each source sent back at the positions
 * its dispatch recorded, once they are marked; false when the call failed. */
__device__ __forceinline__ bool combine_reduce(const cuops_job &J, const cuops_combine_args &a,
                                               const call &k, uint32_t first, uint32_t last) {
  const uint32_t h = J.hidden, W = J.world, lane = threadIdx.x & 31u;
  const bool vec = ((uintptr_t)a.out & 15u) == 0;
  for (uint32_t t = first; t < last; t++) {
    uint8_t *out = (uint8_t *)a.out + (uint64_t)t * h * 2;
    for (uint32_t s0 = 0; s0 < W; s0 += 32) { /* every row of the token marked first */
      const uint32_t s = s0 + lane;
      int32_t p = s < W ? a.h.tp_pos[(uint64_t)t * W + s] : -1;
      const uint8_t *row = p >= 0 ? recv_block(J, k.parity, s) + (uint64_t)p * J.row_bytes : NULL;
      if (!wait_rows(J, k, CUOPS_OP_COMBINE, row, s))
        return false;
    }
    if (a.ow != NULL && lane < J.topk) {
      /* lane k: the weights' sum over the sources, in order (float32, as the host's) */
      float wsum = 0.0f;
      for (uint32_t s = 0; s < W; s++) {
        const int32_t p = a.h.tp_pos[(uint64_t)t * W + s];
        if (p >= 0)
          wsum = __fadd_rn(wsum, __ldcg((const float *)(recv_block(J, k.parity, s) +
                                                        (uint64_t)p * J.row_bytes + 2ull * h +
                                                        16 + 4ull * J.topk) + lane));
      }
      a.ow[(uint64_t)t * J.topk + lane] = wsum;
    }
    for (uint32_t c = 0; c < h; c += 256u * RED_C) { /* warp-uniform: red_add shuffles */
      const uint32_t c0 = c + lane * 8;
      red_acc acc = {};
      for (uint32_t s0 = 0; s0 < W; s0 += 32) {
        /* this group's sources that hold the token, in order */
        const uint32_t s = s0 + lane;
        int32_t p = s < W ? a.h.tp_pos[(uint64_t)t * W + s] : -1;
        uint32_t have = __ballot_sync(FULL_MASK, p >= 0);
        uint64_t row =
            p >= 0 ? (uint64_t)(recv_block(J, k.parity, s) + (uint64_t)p * J.row_bytes) : 0;
        uint32_t from = __fns(have, 0, (int)lane + 1); /* lane i takes the i-th present row */
        uint64_t mine = __shfl_sync(FULL_MASK, row, from < 32 ? from : 0);
        red_add(acc, c0, h, mine, 1.0f, false, __popc(have));
      }
      red_store(acc, out, c0, h, vec);
    }
  }
  return true;
}

/* Rows a combine sender warp writes between two marks. */
#define COMBINE_MARK_EVERY 4u
/* Tokens a reducing warp claims at a time. */
#define REDUCE_CLAIM 2u

/* As dispatch: CTA b sends part b % P of the rows back to rank b / P (its
 * count posted first, rows marked as they land), then every warp claims
 * tokens to sum from the grid's counter, each as soon as its rows are
 * marked. */
KERNEL dep__k_combine(const cuops_job J, const cuops_combine_args a) {
  call k = call_begin(J);
  const uint32_t h = J.hidden, warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint64_t hseq = *a.h.seq;
  if (!k.skip) {
    /* Rows from source d are contiguous in x, sources ascending: send each
     * back to row j of d's block, in the order they came. */
    const uint32_t d = blockIdx.x / J.parts, part = blockIdx.x % J.parts;
    const uint32_t stride = J.parts * CUOPS_WARPS, group = stride * COMBINE_MARK_EVERY;
    uint32_t off = 0;
    for (uint32_t s = 0; s < d; s++)
      off += a.h.tp_from[s];
    const uint32_t n = a.h.tp_from[d];
    const uint32_t op = CUOPS_OP_COMBINE | (a.ow != NULL ? CUOPS_OP_WEIGHTS : 0u);
    if (part == 0 && threadIdx.x == 0)
      post_header(J, k, d, n, op, hseq, a.num_tokens);
    uint8_t *blk = send_block(J, k.parity, d);
    const uint32_t K = J.topk;
    for (uint32_t g = part * CUOPS_WARPS + warp; g < n; g += group) {
      const uint32_t end = g + group < n ? g + group : n;
      for (uint32_t j = g; j < end; j += stride) {
        uint8_t *row = blk + (uint64_t)j * J.row_bytes;
        warp_copy(row, (const uint8_t *)a.x + ((uint64_t)off + j) * h * 2, 2ull * h);
        if (a.ow != NULL && lane < K) /* the weights where a dispatch row has them */
          ((float *)(row + 2ull * h + 16 + 4ull * K))[lane] = a.w[((uint64_t)off + j) * K + lane];
      }
      mark_rows(J, k, blk, g, stride, end);
    }
    __syncwarp();
    if (lane == 0) /* a remote d: the block goes to the proxy once every warp's rows are in */
      arrive(J, k, d, stride, false, 0, op, hseq, a.num_tokens, (uint64_t)n * J.row_bytes);
    if (combine_wait(J, k, op, hseq, a.h.tp_sent, blockIdx.x == 0)) {
      uint32_t next = lane == 0 ? atomicAdd(&J.dev->ticket, REDUCE_CLAIM) : 0;
      next = __shfl_sync(FULL_MASK, next, 0);
      while (next < a.num_tokens) {
        const uint32_t first = next;
        next = lane == 0 ? atomicAdd(&J.dev->ticket, REDUCE_CLAIM) : 0;
        next = __shfl_sync(FULL_MASK, next, 0);
        const uint32_t last = first + REDUCE_CLAIM < a.num_tokens ? first + REDUCE_CLAIM
                                                                 : a.num_tokens;
        if (!combine_reduce(J, a, k, first, last))
          break;
      }
    }
  }
  call_end(J, k, DEP_STATS_OP_COMBINE, dep_stats_bytes(a.num_tokens, J.hidden, false));
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
  extern __shared__ uint32_t s_dyn[]; /* [le] lane masks, [le] running counts */
  const uint32_t K = J.topk, h = J.hidden;
  const uint32_t stride = J.parts * CUOPS_WARPS, me = part * CUOPS_WARPS + (threadIdx.x >> 5);
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t rows = 0, vecs = 0;
  if (part == 0)
    for (uint32_t l = threadIdx.x; l < 2 * J.le; l += CUOPS_THREADS)
      s_dyn[l] = 0;
  __syncthreads();
  for (uint32_t base = 0; base < a.num_tokens; base += CUOPS_THREADS) {
    uint32_t t = base + threadIdx.x, n = 0, trows, tvecs;
    int32_t ids[CUOPS_MAX_TOPK], idx[CUOPS_MAX_TOPK];
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
  __shared__ peers s_p;
  __shared__ uint32_t s_ok, s_first[CUOPS_MAX_RANKS + 1];
  extern __shared__ uint32_t s_dyn[]; /* [world][le] offsets, then [world][le] counts */
  const uint32_t h = J.hidden, G = h / 128, W = J.world, le = J.le, K = J.topk;
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint64_t rows_ll = (uint64_t)W * J.max_ll;
  uint32_t *off = s_dyn, *cnt = s_dyn + W * le;
  if (threadIdx.x == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p) == 0;
    for (uint32_t s = 0; ok && s < W; s++)
      if (s_p.op[s] != op || s_p.rows[s] > J.max_ll) {
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
    int32_t ids[CUOPS_MAX_TOPK];
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
    int32_t ids[CUOPS_MAX_TOPK];
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
    if (lane == 0)
      a.h.ll_nids[(uint64_t)s * J.max_ll + j] = (int32_t)n;
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

KERNEL dep__k_ll_dispatch(const cuops_job J, const cuops_ll_dispatch_args a) {
  call k = call_begin(J);
  const uint32_t op = CUOPS_OP_LL_DISPATCH | (a.fp8 ? CUOPS_OP_FP8 : 0u);
  if (!k.skip) {
    ll_dispatch_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts, op);
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
  const uint32_t n = a.h.ll_rows[d];
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
    post(J, k, d, vecs, CUOPS_OP_LL_COMBINE, hseq, a.num_tokens, (uint64_t)vecs * h * 2);
}

KERNEL dep__k_ll_combine(const cuops_job J, const cuops_ll_combine_args a) {
  call k = call_begin(J);
  const uint32_t h = J.hidden, K = J.topk;
  const uint32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint64_t hseq = *a.h.seq, vcap = (uint64_t)J.max_ll * J.kd;
  if (!k.skip) {
    ll_combine_send(J, a, k, blockIdx.x / J.parts, blockIdx.x % J.parts, hseq);
    const uint32_t r = blockIdx.x, R = gridDim.x;
    if (combine_wait(J, k, CUOPS_OP_LL_COMBINE, hseq, a.h.ll_expect, r == 0)) {
      const bool vec = ((uintptr_t)a.out & 15u) == 0;
      for (uint32_t t = r * CUOPS_WARPS + warp; t < a.num_tokens; t += R * CUOPS_WARPS) {
        /* lane j < K: route j of this token; the ids must be the dispatch's */
        uint64_t src = 0;
        float w = 0.0f;
        if (lane < K) {
          const int32_t *route = a.h.ll_route + ((uint64_t)t * K + lane) * 2;
          int64_t id = idx_at(a.idx, a.itype, (uint64_t)t * K + lane);
          if (id != route[0])
            rec_fail(J, DEP_ERR_INVALID, CUOPS_OP_LL_COMBINE, t, CUOPS_PHASE_IDS, k.seq,
                     (uint64_t)id, 0);
          int32_t e = route[0];
          uint32_t vi = (uint32_t)route[1];
          if (e >= 0 && vi < vcap) {
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

/* ---- the FP8 cast of a low-latency dispatch --------------------------------------------- */

/* Every token of this rank to FP8 once, a warp per token, into the staging
 * rows that dep__k_ll_dispatch's senders then copy (launched just before it). */
KERNEL dep__k_ll_cast(const cuops_job J, const cuops_ll_dispatch_args a) {
  const uint32_t h = J.hidden;
  for (uint32_t t = blockIdx.x * CUOPS_WARPS + (threadIdx.x >> 5); t < a.num_tokens;
       t += gridDim.x * CUOPS_WARPS)
    warp_fp8(a.stage + (uint64_t)t * CUOPS_STAGE_ROW(h), (const uint16_t *)a.x + (uint64_t)t * h, h);
}

/* ---- warm-up: touch every slab --------------------------------------------------------- */

/*
 * CTA s reads one word in every 64 KiB of rank s's slab, so that the GPU's
 * page tables for the peers' memory (mapped at attach, on this GPU or
 * another) are walked now and not by the first operation (which then ran
 * 1.5 to 3.4 times its steady time across GPUs).  Reads only: the slabs
 * are the job's.
 */
KERNEL dep__k_touch(const cuops_job J, const cuops_touch_args a) {
  uint32_t v = 0;
  const uint8_t *slab = J.slabs[blockIdx.x];
  if (slab == nullptr) /* a rank on another node: its blocks come through the exchange region */
    return;
  for (uint64_t off = (uint64_t)threadIdx.x << 16; off < a.bytes; off += (uint64_t)CUOPS_THREADS << 16)
    v += *(const volatile uint32_t *)(slab + off);
  if (v == 0x9e3779b9u) /* never in practice; keeps the reads */
    J.dev->pad = v;
}
