/*
 * ops_node.cuh — a streamed dispatch's node channels on the cuda backend
 * (xring.h "One crossing per destination node"; the host backend's sender
 * is host_ops_stream.c send_node): a token goes over the network once to
 * each node the ring's fan table gives a node channel, whatever number of
 * that node's ranks it is for.  Part of the one translation unit
 * kernels/ops.cu, included by ops_tp.cuh, whose dispatch_unit calls it in
 * a kernel of its own, deepepd::dispatch_node (dispatch_stream's with node
 * channels, kabi.h CUOPS_KERNELS), so that the other kernels' registers
 * are what they were.
 *
 * The node channel's rows are the tokens that go to any of the node's
 * ranks the call sends to (masked ones left out), in token order, each with
 * its global expert ids and its weights as the caller gave them (a cached
 * dispatch: an id naming an expert of each of its ranks there, weights 0),
 * in the ring of the lead's out channel.  The lead's units send them as a
 * rank's units send its own rows: unit (lead, part)'s sender warps each
 * take their group of tokens, whose node rows start after the groups'
 * before (counted with the ranks' rows before the grid met: the node
 * counts follow the ranks' in tcnt, kabi.h), so many warps of several CTAs
 * write one chunk, each its own rows.  Each row is also a row of each of
 * the node's ranks it is for, in that rank's own stream: j, the rows of
 * that rank before the group's (its units' counts) and the group's before
 * it (a count per warp and rank, in shared memory), or, cached, the
 * handle's tp_pos.  A row is written only when every rank it is for has
 * room for it (its credit, per (source, destination rank), as the host
 * backend's rule) and its place in the node channel is free: the proxy
 * has taken the chunk DEP_SLAB_CHUNKS before it (the ring's tail is past
 * the head its push published, node_push); before either wait the warp
 * publishes what it wrote.  The warp adds each row to each of its ranks'
 * count for the chunk and raises their end (node_acc); the warp whose
 * count of the chunk (chan_sent of the lead, as ops_stream.cuh's
 * publish_rows) completes it writes each of the node's ranks' out mark
 * word of the chunk, DEP_XRING_NODE_AT(start, count) or 0, and pushes one
 * NODE descriptor.  A chunk's rows of one rank are consecutive in that
 * rank's stream (both streams are in token order), so the end less the
 * count is its start.  Each rank's slot goes alone (SLOT) at the start of
 * the call (stream_post_slot), and the receiving daemon fans the chunk
 * out into each rank's in channel from this rank (daemon/xfer.c
 * xfer__node_fanout), so the receivers are unchanged.
 *
 * Deadlock: a row waits for the credit of every rank it is for (the host
 * backend's rule), so a receiver that is behind holds back the rows of
 * the node's other ranks from that source too, and the GPU's receivers,
 * unlike the host backend's one loop over every source, wait for rows in
 * their claim order (ops_tp.cuh dispatch_recv: sources from the rank on).
 * The waits still end where every rank of the node claims the other
 * nodes' sources in one order, which holds when the node's ranks are
 * consecutive (rank = node * ranks a node + local rank, as launchers
 * number them; the library gives node channels to such nodes alone,
 * client/cuda_attach.c fan_tables): take the source whose rows are held
 * back that comes first in that order; its earliest row not written is
 * held back by a rank d whose rows of that source before it are all
 * written (every node row before it is), so d's receivers, which wait on
 * no source held back before it in their order, take them and credit
 * d's room.  Every wait here is bounded and abort-aware, as wait_credit's.
 */
#ifndef DEP_OPS_NODE_CUH
#define DEP_OPS_NODE_CUH

#include "ops_stream.cuh"

/* Rank d's node channel (kabi.h CUOPS_FAN), 0 where its rows take a channel of its own. */
__device__ __forceinline__ uint64_t fan_of(const cuops_job &J, uint32_t d) {
  return J.n_nodes != 0 ? (uint64_t)__ldg(J.fan + d) : 0;
}

/* Rank x of the node of fan word fw (its place among them). */
__device__ __forceinline__ uint32_t fan_rank_at(const cuops_job &J, uint64_t fw, uint32_t x) {
  return __ldg(J.fan_rank + CUOPS_FAN_FIRST(fw) + x);
}

/* Chunk c's place of lead L's node channel: its push (node_push), and rank d's counts of it. */
__device__ __forceinline__ unsigned long long *node_push_at(const cuops_job &J, uint32_t L,
                                                            uint32_t c) {
  return J.node_push + ((uint64_t)L * DEP_SLAB_CHUNKS + c % DEP_SLAB_CHUNKS) * 2;
}
__device__ __forceinline__ uint32_t *node_acc_at(const cuops_job &J, uint32_t d, uint32_t c) {
  return J.node_acc + ((uint64_t)d * DEP_SLAB_CHUNKS + c % DEP_SLAB_CHUNKS) * 2;
}

/* Whether token t goes to a rank of lead L's node (fan word fw) that the call sends to: by its
 * ids, or (cached) by the handle's rows.  One lane, its own token. */
__device__ __forceinline__ bool node_token(const cuops_job &J, const cuops_dispatch_args &a,
                                           const call &k, uint32_t L, uint64_t fw, uint32_t t) {
  if (a.cached) {
    for (uint32_t x = 0; x < CUOPS_FAN_N(fw); x++) {
      const uint32_t d = fan_rank_at(J, fw, x);
      if (!masked(k, d) && a.h.tp_pos[(uint64_t)t * J.world + d] >= 0)
        return true;
    }
    return false;
  }
  for (uint32_t j = 0; j < J.topk; j++) {
    const int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * J.topk + j, OPS_OP_DISPATCH,
                                 false);
    if (e < 0)
      continue;
    const uint32_t d = (uint32_t)((uint64_t)e / J.le);
    if (!masked(k, d) && CUOPS_FAN_LEAD(fan_of(J, d)) == L)
      return true;
  }
  return false;
}

/* Step 1 for lead L's node channel: the calling sender warp's count of the node rows of its
 * group's tokens t0..t1, lane i taking every 32nd. */
__device__ __forceinline__ uint32_t node_count(const cuops_job &J, const cuops_dispatch_args &a,
                                               const call &k, uint32_t L, uint32_t t0,
                                               uint32_t t1) {
  const uint64_t fw = fan_of(J, L);
  uint32_t c = 0;
  for (uint32_t b = t0; b < t1; b += 32) {
    const uint32_t t = b + (threadIdx.x & 31u);
    c += __popc(__ballot_sync(FULL_MASK, t < t1 && node_token(J, a, k, L, fw, t)));
  }
  return c;
}

/* Every lane of a sender warp: token t's ranks of lead L's node (fan word fw) that the call
 * sends to, a bit each by their place among the node's ranks. */
__device__ __forceinline__ uint64_t node_dests(const cuops_job &J, const cuops_dispatch_args &a,
                                               const call &k, uint32_t L, uint64_t fw,
                                               uint32_t t) {
  const uint32_t lane = threadIdx.x & 31u;
  uint64_t m = 0;
  if (a.cached) {
    for (uint32_t x = lane; x < CUOPS_FAN_N(fw); x += 32) {
      const uint32_t d = fan_rank_at(J, fw, x);
      if (!masked(k, d) && a.h.tp_pos[(uint64_t)t * J.world + d] >= 0)
        m |= 1ull << x;
    }
  } else if (lane < J.topk) {
    const int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * J.topk + lane,
                                 OPS_OP_DISPATCH, false);
    const uint32_t d = e >= 0 ? (uint32_t)((uint64_t)e / J.le) : 0;
    const uint64_t w = e >= 0 ? fan_of(J, d) : 0;
    if (e >= 0 && !masked(k, d) && CUOPS_FAN_LEAD(w) == L)
      m = 1ull << CUOPS_FAN_IDX(w);
  }
  for (int o = 16; o > 0; o >>= 1)
    m |= __shfl_xor_sync(FULL_MASK, m, o);
  return m;
}

/*
 * A sender warp, before it writes a row of chunk c (c >= DEP_SLAB_CHUNKS)
 * of lead L's node channel: wait, bounded and abort-aware, until the
 * chunk DEP_SLAB_CHUNKS before it, in the same place, is pushed and the
 * proxy has taken it (its tail past the head that push published: the
 * proxy copies a streamed node chunk, daemon/xfer_proxy.c).  The caller
 * has published every row it wrote before.  False: the call failed.
 */
__device__ __forceinline__ bool wait_place(const cuops_job &J, const call &k, uint32_t op,
                                           uint32_t L, uint32_t c) {
  const uint32_t lane = threadIdx.x & 31u;
  const unsigned long long *w = node_push_at(J, L, c);
  const uint64_t want = DEP_SLAB_CHAN_AT(k.seq, c - DEP_SLAB_CHUNKS + 1);
  int go = 2; /* lane 0 decides for the warp: 2, wait on */
  for (uint32_t i = 0;; i++) {
    if (lane == 0 && ld_acquire_gpu(w + 1) == want) {
      const unsigned long long head = *(volatile const unsigned long long *)w;
      unsigned long long tail = *(volatile unsigned long long *)&J.dev->xr_tail;
      if (tail < head) {
        tail = ld_acquire_sys((const uint64_t *)(J.ring + offsetof(dep_xring, tail)));
        atomicMax(&J.dev->xr_tail, tail);
      }
      go = tail >= head ? 1 : 2;
    }
    if (lane == 0 && go == 2 && (i & 7u) == 7u) {
      const uint64_t waited = globaltimer_ns() - k.t0;
      const int32_t failed =
          (int32_t)ld_acquire_sys32((const uint32_t *)(J.ring + offsetof(dep_xring, failed)));
      if (*(volatile uint32_t *)&J.dev->broken) {
        go = 0;
      } else if (job_aborted(J, k, L, waited)) {
        rec_gone(J, op, k.seq, waited);
        go = 0;
      } else if (failed != 0 || waited > J.timeout_ns) {
        atomicExch(&J.dev->broken, 1u); /* the node gets no more of this call */
        rec_fail(J, failed != 0 ? failed : DEP_ERR_TIMEOUT, op, L, CUOPS_PHASE_RING, k.seq, c,
                 waited);
        go = 0;
      }
    }
    go = __shfl_sync(FULL_MASK, go, 0);
    if (go != 2)
      break;
    __nanosleep(256);
  }
  __syncwarp(); /* lane 0's acquire before every lane's stores into the place */
  return go == 1;
}

/*
 * One lane, whose count completed chunk c (len rows) of lead L's node
 * channel: every row of it is written, and added to its ranks' counts,
 * each by its writer before that writer counted it.  Each of the node's
 * ranks' out mark word of the chunk (its start and count, 0 for none:
 * the proxy's table leaves it out), their counts back to 0 for the chunk
 * DEP_SLAB_CHUNKS later (written only once this one is taken), one NODE
 * descriptor, then the head it published, for the writers of that later
 * chunk (wait_place).
 */
__device__ __forceinline__ void node_chunk_sent(const cuops_job &J, const call &k, uint32_t op,
                                                uint32_t L, uint32_t c, uint32_t len) {
  const uint64_t fw = fan_of(J, L);
  __threadfence_system(); /* the other writers' rows and counts, seen through chan_sent */
  for (uint32_t x = 0; x < CUOPS_FAN_N(fw); x++) {
    const uint32_t d = fan_rank_at(J, fw, x);
    uint32_t *acc = node_acc_at(J, d, c);
    const uint32_t n = atomicExch(acc, 0u), end = atomicExch(acc + 1, 0u);
    *(volatile uint64_t *)out_mark_at(J, k.parity, d, c) =
        n != 0 ? DEP_XRING_NODE_AT(end - n, n) : 0;
  }
  __threadfence_system();
  unsigned long long head = 0;
  if (!xring_push(J, k, op, L, (uint64_t)len * J.row_bytes, DEP_XRING_NODE, c * J.chunk_rows,
                  &head))
    return;
  unsigned long long *w = node_push_at(J, L, c);
  *(volatile unsigned long long *)w = head;
  st_release_gpu(w + 1, DEP_SLAB_CHAN_AT(k.seq, c + 1));
}

/*
 * Every lane of a sender warp, after writing node rows first..end - 1 of
 * lead L's node channel (rows in all): publish them, a count per chunk
 * (chan_sent of the lead, as publish_rows), the warp whose count completes
 * a chunk handing it on (node_chunk_sent).
 */
__device__ __forceinline__ void publish_node(const cuops_job &J, const call &k, uint32_t op,
                                             uint32_t L, uint32_t first, uint32_t end,
                                             uint32_t rows) {
  __syncwarp();
  if (first >= end)
    return;
  __threadfence_system(); /* every lane's stores into the node channel before the counts */
  __syncwarp();
  if ((threadIdx.x & 31u) != 0)
    return;
  for (uint32_t i = first; i < end;) {
    const uint32_t c = i / J.chunk_rows, stop = min((c + 1) * J.chunk_rows, end);
    const uint32_t len = min(J.chunk_rows, rows - c * J.chunk_rows);
    if (chunk_count(&J.chan_sent[L], c, stop - i, len))
      node_chunk_sent(J, k, op, L, c, len);
    i = stop;
  }
}

/* A sender warp's state for its share of a node channel (node_begin, node_row). */
struct node_send {
  uint64_t fw;    /* the lead's fan word */
  uint32_t all;   /* the node channel's rows in all */
  uint32_t open;  /* places known free: of the chunks below it */
  uint32_t *next; /* per rank of the node: its next row in its own stream (a fresh dispatch) */
  uint32_t *cred; /* ... and its credit last seen */
};

/* A sender warp's share of lead L's node channel, group g of ng: its state, and the node
 * rows before the group's (*before), which its rows follow. */
__device__ __forceinline__ node_send node_begin(const cuops_job &J, const cuops_dispatch_args &a,
                                                uint32_t L, uint32_t g, uint32_t ng,
                                                uint32_t *before) {
  __shared__ uint32_t s_next[STREAM_SEND_WARPS][DEP_MAX_LOCAL_RANKS];
  __shared__ uint32_t s_cred[STREAM_SEND_WARPS][DEP_MAX_LOCAL_RANKS];
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  node_send ns = {fan_of(J, L), 0, DEP_SLAB_CHUNKS, s_next[warp], s_cred[warp]};
  const uint32_t *ncnt = J.tcnt + ((uint64_t)J.world + L) * ng;
  uint32_t b = 0;
  for (uint32_t i = lane; i < ng; i += 32) {
    const uint32_t v = __ldcg(ncnt + i);
    b += i < g ? v : 0;
    ns.all += v;
  }
  for (int o = 16; o > 0; o >>= 1) {
    b += __shfl_xor_sync(FULL_MASK, b, o);
    ns.all += __shfl_xor_sync(FULL_MASK, ns.all, o);
  }
  *before = b;
  /* Each rank's rows before the group's: its units' counts (a cached dispatch reads the
   * handle's rows instead). */
  for (uint32_t x = lane; x < CUOPS_FAN_N(ns.fw); x += 32) {
    uint32_t r = 0;
    const uint32_t *cnt = J.tcnt + (uint64_t)fan_rank_at(J, ns.fw, x) * ng;
    for (uint32_t i = 0; !a.cached && i < g; i++)
      r += __ldcg(cnt + i);
    ns.next[x] = r;
    ns.cred[x] = 0;
  }
  __syncwarp();
  return ns;
}

/* Rank x of the node's row of token t in its own stream: its next, or the handle's. */
__device__ __forceinline__ uint32_t node_row_of(const cuops_job &J, const cuops_dispatch_args &a,
                                                const node_send &ns, uint32_t t, uint32_t x) {
  return a.cached ? (uint32_t)a.h.tp_pos[(uint64_t)t * J.world + fan_rank_at(J, ns.fw, x)]
                  : ns.next[x];
}

/*
 * Every lane of a sender warp, before it copies token t's payload into
 * node row `row` (dst) of lead L's node channel: wait until every rank it
 * is for has room for it and its place is free (publishing the rows
 * written before, from *marked, first), then write its meta words, ids and
 * weights and add it to its ranks' counts of the chunk, c (read only once
 * the row is published, after its payload: the copy, with many loads in
 * flight, then holds none of this).  False when a wait ended it: the call
 * failed.
 */
__device__ __forceinline__ bool node_row(const cuops_job &J, const cuops_dispatch_args &a,
                                         const call &k, uint32_t L, node_send &ns, uint32_t t,
                                         uint32_t row, uint32_t *marked, uint8_t *dst) {
  const uint32_t lane = threadIdx.x & 31u, K = J.topk, op = dispatch_op(a);
  const uint32_t c = row / J.chunk_rows;
  const uint64_t m = node_dests(J, a, k, L, ns.fw, t);
  bool full = c >= ns.open;
  for (uint64_t mm = m; mm != 0 && !full; mm &= mm - 1) {
    const uint32_t x = (uint32_t)__ffsll((long long)mm) - 1;
    full = node_row_of(J, a, ns, t, x) >= J.chan_rows + ns.cred[x];
  }
  if (full) {
    publish_node(J, k, op, L, *marked, row, ns.all);
    *marked = row;
    if (c >= ns.open && !wait_place(J, k, op, L, c))
      return false;
    ns.open = max(ns.open, c + 1);
    for (uint64_t mm = m; mm != 0; mm &= mm - 1) {
      const uint32_t x = (uint32_t)__ffsll((long long)mm) - 1;
      uint32_t have = ns.cred[x];
      const int go = wait_credit(J, k, op, fan_rank_at(J, ns.fw, x), node_row_of(J, a, ns, t, x),
                                 &have);
      if (go == 0)
        return false;
      __syncwarp();
      /* d left the job since the call began: its rows still go (their ids name it), its
       * credit is no longer waited for */
      if (lane == 0)
        ns.cred[x] = go < 0 ? 0x7fffffffu : have;
      __syncwarp();
    }
  }
  int32_t *meta = (int32_t *)(dst + 2ull * J.hidden);
  if (lane == 0) {
    meta[0] = (int32_t)t;
    meta[1] = (int32_t)K;
  }
  if (lane < K) {
    int32_t id = -1;
    float wt = 0.0f;
    if (a.cached) { /* the lane-th of its ranks here: an expert of it */
      uint64_t mm = m;
      for (uint32_t i = 0; i < lane && mm != 0; i++)
        mm &= mm - 1;
      if (mm != 0)
        id = (int32_t)(fan_rank_at(J, ns.fw, (uint32_t)__ffsll((long long)mm) - 1) * J.le);
    } else {
      const int64_t e = checked_id(J, a.idx, a.itype, (uint64_t)t * K + lane, OPS_OP_DISPATCH,
                                   false);
      id = e >= 0 ? (int32_t)e : -1;
      wt = a.w[(uint64_t)t * K + lane];
    }
    ((int32_t *)(meta + 4))[lane] = id;
    ((float *)(meta + 4 + K))[lane] = wt;
  }
  if (lane == 0)
    for (uint64_t mm = m; mm != 0; mm &= mm - 1) {
      const uint32_t x = (uint32_t)__ffsll((long long)mm) - 1, j = node_row_of(J, a, ns, t, x);
      uint32_t *acc = node_acc_at(J, fan_rank_at(J, ns.fw, x), c);
      atomicAdd(acc, 1u);
      atomicMax(acc + 1, j + 1);
      ns.next[x] = j + 1;
    }
  __syncwarp();
  return true;
}

/*
 * A sender warp's share of lead L's node channel in a streamed dispatch
 * (dispatch_unit, for the lead's unit): group g of ng, tokens t0..t1, its
 * node rows after the groups' before it, each written once every rank it
 * is for has room for it and its place is free (node_row), published every
 * few and at the end.  False when a wait ended it: the call failed.
 */
__device__ __forceinline__ bool node_rows(const cuops_job &J, const cuops_dispatch_args &a,
                                          const call &k, uint32_t L, uint32_t g, uint32_t ng,
                                          uint32_t t0, uint32_t t1) {
  const uint32_t lane = threadIdx.x & 31u, op = dispatch_op(a);
  uint32_t row;
  node_send ns = node_begin(J, a, L, g, ng, &row);
  uint8_t *blk = send_block(J, k.parity, L);
  uint32_t marked = row;
  for (uint32_t b = t0; b < t1; b += 32) {
    const uint32_t tb = b + lane;
    for (uint32_t bits = __ballot_sync(FULL_MASK, tb < t1 && node_token(J, a, k, L, ns.fw, tb));
         bits != 0; bits &= bits - 1) {
      const uint32_t t = b + __ffs(bits) - 1;
      uint8_t *dst = stream_row<true>(J, blk, row);
      if (!node_row(J, a, k, L, ns, t, row, &marked, dst))
        return false;
      dispatch_payload(J, a, dst, t);
      row++;
      if (row - marked == DISPATCH_MARK_EVERY) {
        publish_node(J, k, op, L, marked, row, ns.all);
        marked = row;
      }
    }
  }
  publish_node(J, k, op, L, marked, row, ns.all);
  return true;
}

#endif /* DEP_OPS_NODE_CUH */
