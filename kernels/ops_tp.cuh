/*
 * ops_tp.cuh — the cuda backend's throughput kernels: layout, dispatch (with
 * DeepEP's expert alignment after it) and combine, the host backend's
 * kernels/host_ops_tp.c on the GPU.  Part of the one translation unit
 * kernels/ops.cu (whose banner describes the grid), included there once.
 */
#ifndef DEP_OPS_TP_CUH
#define DEP_OPS_TP_CUH

#include "ops_dev.cuh"
#include "ops_stream.cuh"

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
  dep_stats_layout *entry = dep_stats_layout_at(J.stats, J.world, n % DEP_STATS_LAYOUT_RING);
  volatile dep_stats_layout *e = entry;
  volatile uint32_t *tokens = dep_stats_layout_tokens(entry);
  e->n = 0; /* being rewritten: the daemon skips it */
  const uint64_t ns = globaltimer_ns() - t0;
  e->ns = ns > 0xffffffffull ? 0xffffffffu : (uint32_t)ns;
  e->status = code;
  e->world = code == 0 ? J.world : 0;
  for (uint32_t d = 0; d < J.world; d++)
    tokens[d] = (uint32_t)*(volatile int32_t *)&a.tpr[d];
  __threadfence_system(); /* a layout is not the latency path: its entry is whole when seen */
  e->n = n;
}

KERNEL dep__k_layout(const cuops_job J, const cuops_layout_args a) {
  const uint32_t K = J.topk;
  const uint64_t t0 = J.stats != nullptr && threadIdx.x == 0 ? globaltimer_ns() : 0;
  for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens;
       t += gridDim.x * blockDim.x) {
    /* The token's destinations: a bit each in a world of at most 64 ranks; in a larger one
     * its row of tir itself, cleared first (the thread's own bytes), each set once. */
    uint64_t mask = 0;
    uint8_t *tir = a.tir + (uint64_t)t * J.world;
    const bool wide = J.world > 64u;
    for (uint32_t d = 0; wide && d < J.world; d++)
      tir[d] = 0;
    for (uint32_t k = 0; k < K; k++) {
      int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + k, 0, true);
      if (e < 0)
        continue;
      atomicAdd(&a.tpe[e], 1);
      const uint32_t d = (uint32_t)(e / J.le);
      if (!wide) {
        mask |= 1ull << d;
      } else if (tir[d] == 0) {
        tir[d] = 1;
        atomicAdd(&a.tpr[d], 1);
      }
    }
    for (uint32_t d = 0; !wide && d < J.world; d++) {
      uint32_t in = (uint32_t)(mask >> d) & 1u;
      tir[d] = (uint8_t)in;
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
 * every CTA is resident, kabi.h), learn from the counts of the groups
 * before theirs where their rows go, and write them, marking them as they
 * go (the row marks of ops_rows.cuh); part 0's first warp posts the rank's
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
                                  OPS_OP_DISPATCH, report)
                     : -1;
  return *e >= 0 && (uint64_t)*e / J.le == d;
}

/* The op a dispatch posts and checks: DISPATCH, with FP8 and CACHED or-ed in. */
__device__ __forceinline__ uint32_t dispatch_op(const cuops_dispatch_args &a) {
  return OPS_OP_DISPATCH | (a.fp8 ? OPS_OP_FP8 : 0u) | (a.cached ? OPS_OP_CACHED : 0u);
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

#include "ops_node.cuh"

/*
 * Step 3 of dispatch_send: the calling sender warp writes the rows of its
 * group's tokens t0..t1 (go_bits) for rank d from row `before` on, marked
 * every few (RING: into d's channel, each once d has room for it, and
 * published, publish_rows; p: the stream's slot).  False when a RING wait
 * ended it: the call failed, or d left the job (nothing more goes to it).
 */
template <bool RING>
__device__ __forceinline__ bool dispatch_rows(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k, uint32_t d, uint32_t t0, uint32_t t1,
                                              const uint32_t *go_bits, uint32_t before,
                                              const stream_post &p) {
  const uint32_t lane = threadIdx.x & 31u, K = J.topk, h = J.hidden;
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t row = before, marked = before, credited = 0;
  for (uint32_t b = t0; b < t1; b += 32) {
    for (uint32_t bits = go_bits[(b - t0) / 32]; bits != 0; bits &= bits - 1) {
      const uint32_t t = b + __ffs(bits) - 1;
      if (RING && row >= J.chan_rows + credited) {
        publish_rows(J, k, blk, d, marked, 1, row, p);
        marked = row;
        if (wait_credit(J, k, dispatch_op(a), d, row, &credited) <= 0)
          return false;
      }
      uint8_t *dst = stream_row<RING>(J, blk, row);
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
        if (RING)
          publish_rows(J, k, blk, d, marked, 1, row, p);
        else
          mark_rows(J, k, blk, marked, 1, row);
        marked = row;
      }
    }
  }
  if (RING)
    publish_rows(J, k, blk, d, marked, 1, row, p);
  else if (row > marked)
    mark_rows(J, k, blk, marked, 1, row);
  return true;
}

/*
 * Step 1 of a dispatch unit (part `part` for rank d, dispatch_send): the
 * calling sender warp counts its group's rows for d, lane i taking every
 * 32nd of the group's tokens t0..t1, and marks which of them go to d
 * (go_bits, a bit each).  first: the unit's first count, which also sets
 * tp_pos to -1 where a token does not go to d and reads every id with rank
 * 0's senders reporting bad ones; a count again (a CTA of several units
 * whose bits are another unit's by now) only reads.
 */
__device__ __forceinline__ uint32_t dispatch_count(const cuops_job &J,
                                                   const cuops_dispatch_args &a, const call &k,
                                                   uint32_t d, uint32_t t0, uint32_t t1,
                                                   uint32_t *go_bits, bool first) {
  const uint32_t lane = threadIdx.x & 31u, K = J.topk;
  uint32_t c = 0;
  for (uint32_t b = t0; b < t1; b += 32) {
    const uint32_t t = b + lane;
    bool go = false;
    for (uint32_t j = 0; t < t1 && j < K; j++) {
      int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + j, OPS_OP_DISPATCH,
                             first && d == 0);
      go |= e >= 0 && (uint64_t)e / J.le == d && !masked(k, d);
    }
    if (first && t < t1 && !go)
      a.h.tp_pos[(uint64_t)t * J.world + d] = -1;
    const uint32_t bits = __ballot_sync(FULL_MASK, go);
    if (lane == 0)
      go_bits[(b - t0) / 32] = bits;
    c += __popc(bits);
  }
  __syncwarp(); /* lane 0's bits before every lane reads them */
  return c;
}

/*
 * A sender warp's share of unit u (part u % parts for rank d = u / parts,
 * kabi.h "SM budget"), steps 1' (cached) or 2 (the counts met) and 3; false
 * when a RING wait ended it: the call failed, or d left the job (nothing
 * more goes to it).  recount: the counts of step 1 were met, but this
 * warp's bits are of a later unit of its CTA (dispatch_count again).
 */
template <bool RING, bool NODES>
__device__ __forceinline__ bool dispatch_unit(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k, uint32_t u, uint32_t *go_bits,
                                              bool recount) {
  constexpr uint32_t NW = RING ? STREAM_SEND_WARPS : CUOPS_WARPS; /* sender warps a CTA */
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const uint32_t d = u / J.parts, part = u % J.parts;
  const uint32_t ng = J.parts * NW, g = part * NW + warp;
  const uint32_t gs = (a.num_tokens + ng - 1) / ng;
  const uint32_t t0 = min(g * gs, a.num_tokens), t1 = min(t0 + gs, a.num_tokens);
  const uint32_t *cnt = J.tcnt + (uint64_t)d * ng; /* unit u's warps' counts from cnt + part * NW */
  uint32_t before = 0, all = 0; /* the rows before the group's, and to d in all */
  const uint64_t fw = NODES ? fan_of(J, d) : 0; /* d's rows go through its node's channel */
  __syncwarp(); /* every lane done with the bits of the unit before */
  if (a.cached) {
    /* 1'. the handle says which tokens go to d and where the group's rows start */
    bool first = true;
    for (uint32_t b = t0; b < t1; b += 32) {
      const uint32_t t = b + lane;
      const int32_t p = t < t1 && !masked(k, d) ? a.h.tp_pos[(uint64_t)t * J.world + d] : -1;
      const uint32_t bits = __ballot_sync(FULL_MASK, p >= 0);
      if (lane == 0)
        go_bits[(b - t0) / 32] = bits;
      if (first && bits != 0) {
        before = (uint32_t)__shfl_sync(FULL_MASK, p, __ffs(bits) - 1);
        first = false;
      }
    }
    __syncwarp();
    all = masked(k, d) ? 0 : a.h.tp_sent[d];
    if (g == 0 && lane == 0 && !masked(k, d) && RING)
      stream_post_slot(J, k, d, {all, dispatch_op(a), *a.h.seq, a.num_tokens}, fw != 0);
    else if (g == 0 && lane == 0 && !masked(k, d))
      post_header(J, k, d, all, dispatch_op(a), *a.h.seq, a.num_tokens);
  } else {
    if (recount)
      (void)dispatch_count(J, a, k, d, t0, t1, go_bits, false);
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
    if (g == 0 && lane == 0) /* the count first: receivers place their rows by it */
      a.h.tp_sent[d] = all;
    if (g == 0 && lane == 0 && !masked(k, d) && RING)
      stream_post_slot(J, k, d, {all, dispatch_op(a), 0, a.num_tokens}, fw != 0);
    else if (g == 0 && lane == 0 && !masked(k, d))
      post_header(J, k, d, all, dispatch_op(a), 0, a.num_tokens);
  }
  if (fw != 0) { /* 3'. d's rows are the node channel's (ops_node.cuh): their places alone */
    for (uint32_t b = t0, row = before; !a.cached && b < t1; b += 32)
      for (uint32_t bits = go_bits[(b - t0) / 32]; bits != 0; bits &= bits - 1, row++)
        if (lane == 0)
          a.h.tp_pos[(uint64_t)(b + __ffs(bits) - 1) * J.world + d] = (int32_t)row;
    return CUOPS_FAN_LEAD(fw) != d || node_rows(J, a, k, d, g, ng, t0, t1);
  }
  /* 3. the rows, marked every few (RING: published, each once d has room for it) */
  const stream_post p = {all, dispatch_op(a), a.cached ? *a.h.seq : 0, a.num_tokens};
  if (!dispatch_rows<RING>(J, a, k, d, t0, t1, go_bits, before, p))
    return false;
  __syncwarp();
  if (!RING && lane == 0) /* a remote d: the block goes to the proxy once every group's rows are in */
    arrive(J, k, d, ng, false, 0, dispatch_op(a), 0, a.num_tokens, (uint64_t)all * J.row_bytes);
  return true;
}

/*
 * The CTA's sends: its units in turn (kabi.h "SM budget"); false when the
 * call failed.  A masked d is sent nothing: no slot, no row (kabi.h
 * "Masked ranks").  Each of a unit's warps takes a contiguous group of
 * tokens; it counts the group's rows for d (step 1), the whole grid meets
 * once every unit is counted (every CTA is resident, kabi.h), and each
 * group's rows start after the groups' before it.  A cached dispatch
 * (a.cached) sends each token to the row its handle's dispatch gave it
 * (tp_pos), so it needs neither the counts nor the grid barrier: the rows
 * of a group of tokens are still contiguous, in token order.  RING (a
 * streamed call, ops_stream.cuh): the CTA's first STREAM_SEND_WARPS warps
 * send, into each d's channel as its credit allows, and go on to the next
 * unit when one ends early (d left the job, or the call failed, which ends
 * the later units' waits at their first look at the broken word), as CTAs
 * of a unit each did; the others only meet the grid with them, and return
 * true.
 */
template <bool RING, bool NODES = false>
__device__ __forceinline__ bool dispatch_send(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k) {
  constexpr uint32_t NW = RING ? STREAM_SEND_WARPS : CUOPS_WARPS; /* sender warps a CTA */
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const bool sends = warp < NW;
  /* which of the group's tokens go to d, a bit each (the group is at most
   * DEP_SHAPE_MAX_TOKENS / NW tokens: one part, the largest max_tokens_per_rank); one unit's
   * at a time */
  __shared__ uint32_t s_go[DEP_SHAPE_MAX_TOKENS / 32];
  uint32_t *go_bits = s_go + (sends ? warp : 0) * (DEP_SHAPE_MAX_TOKENS / NW / 32);
  const bool several = blockIdx.x + gridDim.x < units(J); /* this CTA sends more than one unit */
  const bool nodes = NODES && J.n_nodes != 0; /* node channels (ops_node.cuh) */
  if (a.cached && !nodes && !sends)
    return true;
  if (!a.cached || nodes) {
    /* 1. every unit's groups counted (tcnt: a word per unit and sender warp; a lead's node
     * channel's after the world's), then the grid meets: each unit's warps read the counts
     * of every unit of its d, any CTA's */
    for (uint32_t u = blockIdx.x; sends && u < units(J); u += gridDim.x) {
      const uint32_t d = u / J.parts, ng = J.parts * NW, g = (u % J.parts) * NW + warp;
      const uint32_t gs = (a.num_tokens + ng - 1) / ng;
      const uint32_t t0 = min(g * gs, a.num_tokens), t1 = min(t0 + gs, a.num_tokens);
      const uint32_t c = a.cached ? 0 : dispatch_count(J, a, k, d, t0, t1, go_bits, true);
      const uint32_t cn =
          nodes && CUOPS_FAN_LEAD(fan_of(J, d)) == d ? node_count(J, a, k, d, t0, t1) : 0;
      if (lane == 0)
        J.tcnt[(uint64_t)d * ng + g] = c;
      if (lane == 0 && nodes)
        J.tcnt[((uint64_t)J.world + d) * ng + g] = cn;
    }
    if (!grid_meet(J, k, OPS_OP_DISPATCH))
      return false;
    if (!sends)
      return true;
  }
  for (uint32_t u = blockIdx.x; u < units(J); u += gridDim.x)
    if (!dispatch_unit<RING, NODES>(J, a, k, u, go_bits, several) && !RING)
      return false;
  return true;
}

/* Store received id i as int32, or as int64 where the caller asked (recv_index_type). */
__device__ __forceinline__ void ridx_put(const cuops_dispatch_args &a, uint64_t i, int32_t v) {
  if (a.ri64)
    ((int64_t *)a.ridx)[i] = v;
  else
    ((int32_t *)a.ridx)[i] = v;
}

/* Whether source s's slot is not this dispatch's: another op, too many rows, or (cached)
 * another handle's dispatch or row count.  A masked source's is not read. */
__device__ __forceinline__ bool dispatch_slot_bad(const cuops_job &J,
                                                  const cuops_dispatch_args &a, const call &k,
                                                  const peers &p, uint32_t s, uint32_t op,
                                                  uint64_t hseq) {
  return !skipped(k, p, s) && (p.op[s] != op || p.rows[s] > J.max_tokens ||
                           (a.cached && (p.ref[s] != hseq || p.rows[s] != a.h.tp_from[s])));
}

/* A cached dispatch's rows from a masked source, whose place its handle keeps: zeros, over
 * the grid's receiving threads (nt a CTA, this one tid of them; the host backend's too).
 * Rare: a rank masked since the handle's dispatch. */
__device__ __forceinline__ void dispatch_zero_masked(const cuops_job &J,
                                                     const cuops_dispatch_args &a, const call &k,
                                                     const uint32_t *off, uint32_t tid,
                                                     uint32_t nt) {
  bool any = false; /* a rank masked: word 0 alone in a world of at most 64 ranks */
  for (uint32_t i = 0; i < mask_words(J); i++)
    any |= (i == 0 ? k.mask : k.maskw[i]) != 0;
  if (!a.cached || !any)
    return;
  const uint32_t h = J.hidden, G = h / 128;
  const uint64_t rb = a.fp8 ? h : 2ull * h;
  for (uint32_t s = 0; s < J.world; s++) {
    if (!masked(k, s))
      continue;
    const uint64_t n = (uint64_t)a.h.tp_from[s];
    for (uint64_t i = (uint64_t)blockIdx.x * nt + tid; i < n * rb; i += (uint64_t)gridDim.x * nt)
      ((uint8_t *)a.rx)[(uint64_t)off[s] * rb + i] = 0;
    if (a.fp8)
      for (uint64_t i = (uint64_t)blockIdx.x * nt + tid; i < n * G; i += (uint64_t)gridDim.x * nt)
        a.rxs[(uint64_t)off[s] * G + i] = 0.0f;
  }
}

/* With num_worst_tokens, the rows past the `total` received get ids -1 and weights 0 (DeepEP's
 * padding), over the grid's receiving threads (nt a CTA, this one tid of them). */
__device__ __forceinline__ void dispatch_pad(const cuops_job &J, const cuops_dispatch_args &a,
                                             uint32_t total, uint32_t tid, uint32_t nt) {
  if (a.worst <= total || a.cached)
    return;
  const uint32_t K = J.topk;
  for (uint64_t i = (uint64_t)total * K + (uint64_t)blockIdx.x * nt + tid;
       i < (uint64_t)a.worst * K; i += (uint64_t)gridDim.x * nt) {
    ridx_put(a, i, -1);
    a.rw[i] = 0.0f;
  }
}

/* Every warp (RING: every receiving warp): claim rows from the grid's
 * counter, sources from this rank on, and copy each into recv_x after
 * every earlier source's rows (RING: then take it out of its channel).  A
 * cached dispatch checks that every source routed by the same dispatch,
 * with the rows that dispatch sent here, and leaves the handle as it is;
 * with num_worst_tokens the rows past those received get ids -1 and
 * weights 0 (DeepEP's padding). */
template <bool RING>
__device__ __forceinline__ void dispatch_recv(const cuops_job &J, const cuops_dispatch_args &a,
                                              const call &k) {
  constexpr uint32_t BASE = RING ? STREAM_RECV_BASE : 0, NT = CUOPS_THREADS - BASE;
  const peers s_p = peers_of(J);
  __shared__ uint32_t s_ok;
  uint32_t *const s_off = src_off(J), *const s_first = src_first(J);
  const uint32_t K = J.topk, h = J.hidden, W = J.world, lane = threadIdx.x & 31u;
  const uint32_t op = dispatch_op(a), tid = threadIdx.x - BASE;
  if (tid == 0) {
    uint32_t ok = wait_peers(J, k, op, &s_p) == 0, off = 0;
    const uint64_t hseq = a.cached ? *a.h.seq : 0;
    for (uint32_t s = 0; ok && s < W; s++) {
      if (dispatch_slot_bad(J, a, k, s_p, s, op, hseq)) {
        if (blockIdx.x == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_PEER, k.seq,
                   ((uint64_t)s_p.op[s] << 32) | s_p.rows[s], 0);
        ok = 0;
      }
      s_off[s] = off; /* none from a masked source; a cached dispatch keeps their place */
      off += masked(k, s) && a.cached ? a.h.tp_from[s] : s_p.rows[s];
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
        ((volatile uint32_t *)J.recv_from)[s] = s_p.rows[s];
      }
      *(volatile uint32_t *)&J.host->num_recv = off;
      if (!a.cached)
        *a.h.seq = k.seq;
    }
  }
  recv_sync<RING>();
  if (!s_ok)
    return;
  const uint32_t total = s_first[W];
  dispatch_zero_masked(J, a, k, s_off, tid, NT);
  dispatch_pad(J, a, total, tid, NT);
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
      row = stream_row<RING>(J, recv_block(J, k.parity, src), j);
    }
    if (!wait_rows<RING>(J, k, op, row, src, j, RING && lane < n ? s_p.rows[src] : 0))
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
    if (RING)
      take_claimed(J, k, op, n, src, j, s_p.rows);
  }
}

TIMED_KERNEL deepepd::dispatch(const cuops_job J, const cuops_dispatch_args a) {
  call k = call_begin(J);
  if (!k.skip && dispatch_send<false>(J, a, k))
    dispatch_recv<false>(J, a, k);
  call_end(J, k, DEP_STATS_OP_DISPATCH, dep_stats_bytes(a.num_tokens, J.hidden, a.fp8 != 0));
}

/* A job that streams (ops_stream.cuh): the same, each CTA's warps sending or receiving. */
TIMED_KERNEL deepepd::dispatch_stream(const cuops_job J, const cuops_dispatch_args a) {
  call k = call_begin(J);
  if (!k.skip && dispatch_send<true>(J, a, k) &&
      threadIdx.x >= STREAM_RECV_BASE)
    dispatch_recv<true>(J, a, k);
  call_end(J, k, DEP_STATS_OP_DISPATCH, dep_stats_bytes(a.num_tokens, J.hidden, a.fp8 != 0));
}

/* A job that streams and has node channels (ops_node.cuh): the same, the lead of each
 * node's units sending its node channel.  A kernel of its own, so that dispatch_stream's
 * registers are what they were (kabi.h CUOPS_KERNELS). */
TIMED_KERNEL deepepd::dispatch_node(const cuops_job J, const cuops_dispatch_args a) {
  call k = call_begin(J);
  if (!k.skip && dispatch_send<true, true>(J, a, k) && threadIdx.x >= STREAM_RECV_BASE)
    dispatch_recv<true>(J, a, k);
  call_end(J, k, DEP_STATS_OP_DISPATCH, dep_stats_bytes(a.num_tokens, J.hidden, a.fp8 != 0));
}

/* DeepEP's expert_alignment: after deepepd::dispatch on the same stream, each
 * local expert's count rounded up to a multiple of a.align (one CTA). */
KERNEL dep__k_align(const cuops_job J, const cuops_dispatch_args a) {
  if (*(volatile uint32_t *)&J.dev->broken)
    return;
  for (uint32_t l = threadIdx.x; l < J.le; l += CUOPS_THREADS)
    a.cnt[l] = (int32_t)(((uint32_t)a.cnt[l] + a.align - 1) / a.align * a.align);
}

/* ---- throughput combine ------------------------------------------------------------- */

/* Included here, where its parts were written when ops.cu was one file: the
 * module's shared variables (combine_wait's) keep their order in the PTX,
 * and with it the fatbin and its build id stay as they were. */
#include "ops_combine.cuh"

/* Where source s put token t in its rows back, or -1: not sent there, or s is masked. */
__device__ __forceinline__ int32_t combine_pos(const cuops_job &J, const cuops_combine_args &a,
                                               const call &k, uint32_t t, uint32_t s) {
  return s < J.world && !masked(k, s) ? a.h.tp_pos[(uint64_t)t * J.world + s] : -1;
}

/* Where a lane's sum of token t begins (deepep.h dep_combine_args): DeepEP's
 * bias_0 + bias_1 in float32, a missing one +0, at the lane's 8 channels of each
 * of its RED_C groups.  A bias 16-byte aligned is read as vectors (hidden is a
 * multiple of 128, so each row is too), any other 2-byte aligned one element by
 * element. */
__device__ __forceinline__ void combine_bias(red_acc &acc, const cuops_combine_args &a,
                                             uint32_t t, uint32_t c0, uint32_t h) {
  const uint8_t *b[2] = {(const uint8_t *)a.b0, (const uint8_t *)a.b1};
#pragma unroll
  for (int cc = 0; cc < RED_C; cc++) {
    float v[2][8] = {};
    const uint32_t c = c0 + 256u * cc;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      if (b[i] == NULL || c >= h)
        continue;
      const uint8_t *p = b[i] + ((uint64_t)t * h + c) * 2;
      uint32_t u[4];
      if (((uintptr_t)b[i] & 15u) == 0) {
        const int4 q = __ldg((const int4 *)p);
        u[0] = (uint32_t)q.x, u[1] = (uint32_t)q.y, u[2] = (uint32_t)q.z, u[3] = (uint32_t)q.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; e++)
          u[e] = (uint32_t)__ldg((const unsigned short *)p + 2 * e) |
                 ((uint32_t)__ldg((const unsigned short *)p + 2 * e + 1) << 16);
      }
#pragma unroll
      for (int e = 0; e < 8; e++)
        v[i][e] = bf2f(u[e / 2] >> (16 * (e % 2)));
    }
#pragma unroll
    for (int e = 0; e < 8; e++)
      acc.v[cc][e] = __fadd_rn(v[0][e], v[1][e]);
  }
}

/* Combine's receive: the calling warp sums each token of [first, last),
 * after its biases (combine_bias), sources ascending, from the rows each
 * source sent back at the positions its dispatch recorded, once they are
 * marked (RING: stamped, then taken out of their channels once summed);
 * false when the call failed. */
template <bool RING>
__device__ __forceinline__ bool combine_reduce(const cuops_job &J, const cuops_combine_args &a,
                                               const call &k, uint32_t first, uint32_t last) {
  const uint32_t h = J.hidden, W = J.world, lane = threadIdx.x & 31u;
  const bool vec = ((uintptr_t)a.out & 15u) == 0;
  for (uint32_t t = first; t < last; t++) {
    uint8_t *out = (uint8_t *)a.out + (uint64_t)t * h * 2;
    for (uint32_t s0 = 0; s0 < W; s0 += 32) { /* every row of the token marked first */
      const uint32_t s = s0 + lane;
      int32_t p = combine_pos(J, a, k, t, s);
      const uint8_t *row = p >= 0 ? stream_row<RING>(J, recv_block(J, k.parity, s), p) : NULL;
      if (!wait_rows<RING>(J, k, OPS_OP_COMBINE, row, s, p, RING && p >= 0 ? a.h.tp_sent[s] : 0))
        return false;
    }
    if (a.ow != NULL && lane < J.topk) {
      /* lane k: the weights' sum over the sources, in order (float32, as the host's) */
      float wsum = 0.0f;
      for (uint32_t s = 0; s < W; s++) {
        const int32_t p = combine_pos(J, a, k, t, s);
        if (p >= 0)
          wsum = __fadd_rn(wsum, __ldcg((const float *)(stream_row<RING>(J, recv_block(J, k.parity,
                                                                                        s), p) +
                                                        2ull * h + 16 + 4ull * J.topk) + lane));
      }
      a.ow[(uint64_t)t * J.topk + lane] = wsum;
    }
    for (uint32_t c = 0; c < h; c += 256u * RED_C) { /* warp-uniform: red_add shuffles */
      const uint32_t c0 = c + lane * 8;
      red_acc acc;
      combine_bias(acc, a, t, c0, h);
      for (uint32_t s0 = 0; s0 < W; s0 += 32) {
        /* this group's sources that hold the token, in order */
        const uint32_t s = s0 + lane;
        int32_t p = combine_pos(J, a, k, t, s);
        uint32_t have = __ballot_sync(FULL_MASK, p >= 0);
        uint64_t row = p >= 0 ? (uint64_t)stream_row<RING>(J, recv_block(J, k.parity, s), p) : 0;
        uint32_t from = __fns(have, 0, (int)lane + 1); /* lane i takes the i-th present row */
        uint64_t mine = __shfl_sync(FULL_MASK, row, from < 32 ? from : 0);
        red_add(acc, c0, h, mine, 1.0f, false, __popc(have));
      }
      red_store(acc, out, c0, h, vec);
    }
  }
  /* RING: the tokens' rows taken, lane i those of each source i (mod 32), a run of
   * consecutive rows at a time: a source's rows of consecutive tokens are consecutive in its
   * stream (it sends back, in order, the rows this rank's dispatch sent it in token order) */
  for (uint32_t s0 = 0; RING && s0 < W; s0 += 32) {
    const uint32_t s = s0 + lane;
    take_fence();
    uint32_t j0 = 0, n = 0; /* a run of n rows from j0, not counted yet */
    for (uint32_t t = first; t < last; t++) {
      const int32_t p = combine_pos(J, a, k, t, s);
      if (p < 0)
        continue;
      if (n != 0 && (uint32_t)p == j0 + n) {
        n++;
        continue;
      }
      if (n != 0)
        take_rows(J, k, OPS_OP_COMBINE, s, j0, j0 + n, a.h.tp_sent[s]);
      j0 = (uint32_t)p;
      n = 1;
    }
    if (n != 0)
      take_rows(J, k, OPS_OP_COMBINE, s, j0, j0 + n, a.h.tp_sent[s]);
  }
  return true;
}

/* Rows a combine sender warp writes between two marks. */
#define COMBINE_MARK_EVERY 4u
/* Tokens a reducing warp claims at a time. */
#define REDUCE_CLAIM 2u
/* A streamed call is bounded (ops_stream.cuh) since a claim's rows of one source, from the
 * first not taken on, are in its channel once the chunks before that row are credited: the
 * ring holds that chunk and DEP_SLAB_CHUNKS - 1 more of one row at the least. */
static_assert(RECV_CLAIM <= DEP_SLAB_CHUNKS && REDUCE_CLAIM <= DEP_SLAB_CHUNKS,
              "a claim's rows of one source fit its channel past the chunks credited");

/* Every warp that sums (RING: every receiving warp): claim tokens from the grid's counter
 * and sum each (combine_reduce) until none is left or the call failed. */
template <bool RING>
__device__ __forceinline__ void combine_claim(const cuops_job &J, const cuops_combine_args &a,
                                              const call &k) {
  const uint32_t lane = threadIdx.x & 31u;
  uint32_t next = lane == 0 ? atomicAdd(&J.dev->ticket, REDUCE_CLAIM) : 0;
  next = __shfl_sync(FULL_MASK, next, 0);
  while (next < a.num_tokens) {
    const uint32_t first = next;
    next = lane == 0 ? atomicAdd(&J.dev->ticket, REDUCE_CLAIM) : 0;
    next = __shfl_sync(FULL_MASK, next, 0);
    const uint32_t last = first + REDUCE_CLAIM < a.num_tokens ? first + REDUCE_CLAIM
                                                             : a.num_tokens;
    if (!combine_reduce<RING>(J, a, k, first, last))
      break;
  }
}

/* Unit u of a whole-block combine's sends (kabi.h "SM budget"), every warp
 * of the CTA: part u % P of the rows back to rank d = u / P, its count
 * posted first, rows marked as they land, then (a remote d) the block to
 * the proxy once every warp of d's units is in.  Rows from source d are
 * contiguous in x, sources ascending: each goes back to row j of d's
 * block, in the order they came. */
__device__ __forceinline__ void combine_send(const cuops_job &J, const cuops_combine_args &a,
                                             const call &k, uint32_t u, uint32_t op,
                                             uint64_t hseq) {
  const uint32_t h = J.hidden, warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
  const uint32_t d = u / J.parts, part = u % J.parts;
  const uint32_t stride = J.parts * CUOPS_WARPS, group = stride * COMBINE_MARK_EVERY;
  uint32_t off = 0;
  for (uint32_t s = 0; s < d; s++)
    off += a.h.tp_from[s];
  const bool dead = masked(k, d); /* nothing goes back to a masked rank */
  const uint32_t n = dead ? 0 : a.h.tp_from[d];
  if (part == 0 && threadIdx.x == 0 && !dead)
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
}

/* As dispatch: the CTA sends its units in turn (combine_send), then every
 * warp claims tokens to sum from the grid's counter, each as soon as its
 * rows are marked. */
TIMED_KERNEL deepepd::combine(const cuops_job J, const cuops_combine_args a) {
  call k = call_begin(J);
  const uint64_t hseq = *a.h.seq;
  if (!k.skip) {
    const uint32_t op = OPS_OP_COMBINE | (a.ow != NULL ? OPS_OP_WEIGHTS : 0u);
    for (uint32_t u = blockIdx.x; u < units(J); u += gridDim.x)
      combine_send(J, a, k, u, op, hseq);
    if (combine_wait(J, k, op, hseq, a.h.tp_sent, blockIdx.x == 0))
      combine_claim<false>(J, a, k);
  }
  call_end(J, k, DEP_STATS_OP_COMBINE, dep_stats_bytes(a.num_tokens, J.hidden, false));
}

/*
 * A streamed combine's sending warps (ops_stream.cuh), for unit u: part
 * u % P of the rows back to rank d = u / P, its count posted first, each
 * row into d's channel once d has room for it, stamped every few.
 */
__device__ __forceinline__ void combine_send_ring(const cuops_job &J, const cuops_combine_args &a,
                                                  const call &k, uint32_t u, uint32_t op,
                                                  uint64_t hseq) {
  const uint32_t h = J.hidden, K = J.topk, lane = threadIdx.x & 31u;
  const uint32_t d = u / J.parts, part = u % J.parts;
  const uint32_t stride = J.parts * STREAM_SEND_WARPS, mine = part * STREAM_SEND_WARPS +
                                                              (threadIdx.x >> 5);
  uint32_t off = 0;
  for (uint32_t s = 0; s < d; s++)
    off += a.h.tp_from[s];
  const bool dead = masked(k, d); /* nothing goes back to a masked rank */
  const uint32_t n = dead ? 0 : a.h.tp_from[d];
  const stream_post p = {n, op, hseq, a.num_tokens};
  if (part == 0 && threadIdx.x == 0 && !dead)
    stream_post_slot(J, k, d, p);
  uint8_t *blk = send_block(J, k.parity, d);
  uint32_t credited = 0, marked = mine, written = 0;
  for (uint32_t j = mine; j < n; j += stride) {
    if (j >= J.chan_rows + credited) {
      publish_rows(J, k, blk, d, marked, stride, j, p);
      marked = j;
      if (wait_credit(J, k, op, d, j, &credited) <= 0)
        return; /* failed, or d left the job: nothing more for it */
    }
    uint8_t *row = stream_row<true>(J, blk, j);
    warp_copy(row, (const uint8_t *)a.x + ((uint64_t)off + j) * h * 2, 2ull * h);
    if (a.ow != NULL && lane < K) /* the weights where a dispatch row has them */
      ((float *)(row + 2ull * h + 16 + 4ull * K))[lane] = a.w[((uint64_t)off + j) * K + lane];
    if (++written % COMBINE_MARK_EVERY == 0) {
      publish_rows(J, k, blk, d, marked, stride, j + 1, p);
      marked = j + stride;
    }
  }
  publish_rows(J, k, blk, d, marked, stride, n, p);
}

/* A job that streams (ops_stream.cuh): each CTA's first warps send, the others sum. */
TIMED_KERNEL deepepd::combine_stream(const cuops_job J, const cuops_combine_args a) {
  call k = call_begin(J);
  const uint64_t hseq = *a.h.seq;
  const uint32_t op = OPS_OP_COMBINE | (a.ow != NULL ? OPS_OP_WEIGHTS : 0u);
  if (!k.skip) {
    /* the sending warps: the CTA's units in turn, each to its end or to its early end (d
     * left the job, or the call failed, which ends the later units' waits at their first
     * look at the broken word), as CTAs of a unit each did */
    if (threadIdx.x < STREAM_RECV_BASE)
      for (uint32_t u = blockIdx.x; u < units(J); u += gridDim.x)
        combine_send_ring(J, a, k, u, op, hseq);
    else if (combine_wait<true>(J, k, op, hseq, a.h.tp_sent, blockIdx.x == 0))
      combine_claim<true>(J, a, k);
  }
  call_end(J, k, DEP_STATS_OP_COMBINE, dep_stats_bytes(a.num_tokens, J.hidden, false));
}


#endif /* DEP_OPS_TP_CUH */
