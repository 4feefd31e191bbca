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
 * taken by many warps at once, in any order: each, once it has copied its
 * claim's rows out, counts them per chunk (cuops_job.chan_took, one atomic
 * add per source and chunk), and the chunks taken whole are credited in
 * order, by whoever takes the last row of the first chunk not credited
 * (chunk_taken, cuops_job.chan_front).  Taking never waits, so a receiver
 * waits only for rows: bounded, since a stream's earlier rows are claimed
 * first, and once those are taken their chunks are credited, so the
 * senders may write the rows claimed next (a claim's rows of a source fit
 * in the ring past the chunks credited: ops_tp.cuh, RECV_CLAIM and
 * REDUCE_CLAIM).
 *
 * Deadlock: a sender that waits for credit must not hold back any
 * receiver, its own rank's or another's, for every rank's senders may be
 * waiting on every rank's receivers at once.  So a CTA's warps are
 * specialised: its first STREAM_SEND_WARPS warps send (the CTA's units in
 * turn, as every CTA of a whole-block call does), the others receive
 * (claiming from the grid's counter); all are resident (the SM budget,
 * kabi.h), so a receiver always runs.  Warps rather than CTAs, because the
 * grid, the SM budget and call_begin's waits for the ranks a CTA sends
 * to stay what they are; interleaving sends and receives within a warp
 * would hold a sender's rows behind receives that wait for other ranks.
 * A CTA with several units (a world above the budget) sends them one
 * after the other, each to its end, and every CTA of every rank takes its
 * units in ascending order: a unit that waits for credit from rank d
 * waits on d's receivers, which wait for every source's unit of d (its
 * post, its rows); a source not at its unit of d yet is at a unit of a
 * lower-numbered rank (a CTA has several units only where P is 1), so no
 * cycle of waits closes: the lowest rank still waited on always moves.  Each wait stays bounded and abort-aware
 * (wait_credit), and a unit that ends early (its d left the job) hands on
 * to the CTA's next.
 * A whole-block call keeps its kernels (every warp sends, then receives):
 * they are the same functions instantiated without the ring.
 *
 * Across nodes a channel is the host backend's too, and both ends may be
 * either backend: the out channel and out slot of this rank's exchange
 * region (host memory mapped for the device) to a destination on another
 * node, the in channel and in slot from a source on another node.  The
 * stamps cannot say a row from another node is in (its daemon writes a
 * frame's bytes in no order), so a chunk is the unit there, as on the host
 * backend: the sending warps count the rows they have written into each
 * chunk (cuops_job.chan_sent, after a system fence), and the warp whose
 * count completes a chunk writes the chunk's out mark and pushes one CHUNK
 * descriptor to the proxy (chunk_sent; the first chunk's with the slot
 * image, SLOT, which that warp posts; a stream of no rows pushes the slot
 * alone); a sender waits for credit in its out slot's credit word, which
 * this node's daemon stores when the receiver's credit comes back.  The
 * far daemon counts each chunk's rows into the receiver's in mark, which
 * the receiving warps wait on (wait_rows) once the chunk before it in
 * that place is credited (in_mark_open); they copy rows out as from a
 * local source, and whoever credits chunks of such a source sets their
 * marks back to 0 first, stores the credit into the in slot and pushes a
 * CREDIT descriptor while the sender may still wait for it (chunk_taken).
 * A dispatch's rows for the ranks of a node that the ring's fan table
 * (xring.h) gives a node channel go once per token through that channel
 * instead (ops_node.cuh), as the host backend's, and the far daemon fans
 * them out into the same in channels; a combine's rows, and every rank's
 * of a node without one, take a channel per rank.
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
 * A sender warp, before it writes row j of its stream to rank d: wait,
 * bounded and abort-aware, until d has taken rows enough for j's ring row
 * (j - chan_rows + 1; *have: what it was last seen to have taken).  A
 * local d's credit is in its slab's slot; one on another node's is in the
 * out slot, where this node's daemon stores what d's credit descriptors
 * carried back (host memory: the wait sleeps between reads, and fails as
 * well when the proxy stopped serving this rank's ring, with its code).
 * The caller has published every row it wrote before (publish_rows: the
 * receiver takes them, which is the credit this waits for).  1: write it;
 * 0: the call failed (recorded here or elsewhere); -1: d left the job
 * since the call began (elastic: the daemon masked it), so it is sent
 * nothing more.
 */
__device__ __forceinline__ int wait_credit(const cuops_job &J, const call &k, uint32_t op,
                                           uint32_t d, uint32_t j, uint32_t *have) {
  if (j < J.chan_rows + *have)
    return 1;
  const uint32_t lane = threadIdx.x & 31u, need = j - J.chan_rows + 1;
  const bool far = is_remote(J, d);
  const uint64_t *word = (const uint64_t *)(send_slot(J, k.parity, d) + offsetof(ops_slot, credit));
  const uint64_t at = DEP_SLAB_CHAN_AT(k.seq, 0);
  for (uint32_t i = 0;; i++) {
    const uint64_t w = __shfl_sync(FULL_MASK, lane == 0 ? ld_acquire_sys(word) : 0, 0);
    const uint32_t got = w >= at ? (uint32_t)(w - at) : 0; /* an earlier call's: none yet */
    if (got >= need) {
      *have = got;
      __syncwarp(); /* lane 0's acquire before every lane's stores into the ring */
      return 1;
    }
    /* Lane 0 reads the clock and the abort and ring words every 32nd read of a local word,
     * every 8th of one in host memory, which it reads once a sleep. */
    const uint32_t every = far ? 7u : 31u;
    if ((i & every) != every) {
      if (far)
        __nanosleep(256);
      continue;
    }
    int go = 2; /* lane 0 decides for the warp: 2, wait on */
    if (lane == 0) {
      const uint64_t waited = globaltimer_ns() - k.t0;
      const int32_t failed =
          far ? (int32_t)ld_acquire_sys32((const uint32_t *)(J.ring + offsetof(dep_xring, failed)))
              : 0;
      int32_t code;
      if (*(volatile uint32_t *)&J.dev->broken) {
        go = 0;
      } else if (stream_aborted(J, k, d, waited)) {
        rec_gone(J, op, k.seq, waited);
        go = 0;
      } else if (waited >= CUOPS_ABORT_POLL_NS && left_since(J, d)) {
        go = -1;
      } else if (waited >= CUOPS_ABORT_POLL_NS && (code = peer_stopped(J, k, d)) != 0) {
        rec_stopped(J, k, op, d, code, waited);
        go = 0;
      } else if (failed != 0 || waited > J.timeout_ns) {
        if (failed != 0)
          atomicExch(&J.dev->broken, 1u); /* d will get no more of this call, whatever the code */
        rec_fail(J, failed != 0 ? failed : DEP_ERR_TIMEOUT, op, d, CUOPS_PHASE_CREDIT, k.seq, got,
                 waited);
        go = 0;
      }
    }
    go = __shfl_sync(FULL_MASK, go, 0);
    if (go != 2)
      return go;
    __nanosleep(far ? 256 : 64);
  }
}

/* What a streamed call posts in its slot for a destination (post_header's fields). */
struct stream_post {
  uint32_t rows, op;
  uint64_t ref_seq;
  uint32_t num_tokens;
};

/*
 * The first sender warp's lane 0 for destination d, once the stream's row
 * count is known: post the slot.  A local d's goes into its slab before
 * any row; one on another node's goes with the stream's first chunk, whose
 * last writer posts it (chunk_sent), or, for a stream of no rows or one
 * whose rows go through d's node channel (alone: ops_node.cuh), alone now
 * (a SLOT descriptor, as the host backend's).  Nothing goes to a
 * destination on another node that left since the call began (k.gone, as
 * arrive): its daemon has no reader for it.
 */
__device__ __forceinline__ void stream_post_slot(const cuops_job &J, const call &k, uint32_t d,
                                                 const stream_post &p, bool alone = false) {
  if (!is_remote(J, d)) {
    post_header(J, k, d, p.rows, p.op, p.ref_seq, p.num_tokens);
    return;
  }
  if ((p.rows != 0 && !alone) || gone_to(k, d))
    return;
  post_header(J, k, d, p.rows, p.op, p.ref_seq, p.num_tokens);
  __threadfence_system();
  xring_push(J, k, p.op, d, 0, DEP_XRING_SLOT);
}

/*
 * One lane, whose count completed chunk c (len rows) of this rank's stream
 * to remote rank d (publish_rows): every row of it is written and fenced
 * by its writer before that writer counted it.  Hand it to the proxy as
 * the host backend does (host_ops_stream.c push_chunk): the chunk's out
 * mark (its count of rows, the source of an RDMA write of the in mark),
 * then one CHUNK descriptor; the first chunk's carries the slot image too
 * (SLOT), which this lane posts first, so that the image is written before
 * the descriptor names it whichever warp completes the chunk.  Chunks may
 * be pushed in any order: the far daemon counts each into its own mark.
 */
__device__ __forceinline__ void chunk_sent(const cuops_job &J, const call &k, uint32_t d,
                                           uint32_t c, uint32_t len, const stream_post &p) {
  if (gone_to(k, d))
    return; /* d left the job: nothing more goes to it (stream_post_slot) */
  __threadfence_system(); /* the other writers' rows, seen through their counts, before the mark */
  *(volatile uint64_t *)out_mark_at(J, k.parity, d, c) = DEP_SLAB_CHAN_AT(k.seq, len);
  uint32_t kind = DEP_XRING_CHUNK;
  if (c == 0) {
    post_header(J, k, d, p.rows, p.op, p.ref_seq, p.num_tokens);
    kind |= DEP_XRING_SLOT;
  }
  __threadfence_system();
  xring_push(J, k, p.op, d, (uint64_t)len * J.row_bytes, kind, c * J.chunk_rows);
}

/*
 * One lane: add m rows to chunk c's count in a packed counter (chan_took,
 * chan_sent: CUOPS_CHAN_TOOK_BITS a chunk, by the chunk's place in the ring)
 * and say whether the add completed the chunk (len rows).  The lane whose
 * add completes it sets the count back to 0 for the chunk DEP_SLAB_CHUNKS
 * later in that place, whose rows nobody counts before this chunk is
 * handed on (sent, or credited), which only that lane does, after this.
 */
__device__ __forceinline__ bool chunk_count(unsigned long long *counter, uint32_t c, uint32_t m,
                                            uint32_t len) {
  const uint32_t shift = CUOPS_CHAN_TOOK_BITS * (c % DEP_SLAB_CHUNKS);
  const unsigned long long add = (unsigned long long)m << shift;
  const unsigned long long now = atomicAdd(counter, add) + add;
  if (((now >> shift) & ((1u << CUOPS_CHAN_TOOK_BITS) - 1u)) != len)
    return false;
  atomicAdd(counter, 0ull - ((unsigned long long)len << shift));
  return true;
}

/*
 * Every lane of a sender warp, after writing rows first, first + step, ...
 * (below end) of its stream to rank d (p.rows rows in all) into blk, d's
 * channel: publish them.  To a local d, each row's stamp (stamp_rows).  To
 * one on another node, a count per chunk (cuops_job.chan_sent, one atomic
 * add per chunk the rows touch, after a system fence: many warps write one
 * chunk, each its own rows, in no order among them); the warp whose count
 * completes a chunk sets the chunk's count back to 0 for the chunk
 * DEP_SLAB_CHUNKS later (whose rows no warp writes before this chunk is
 * credited, which it cannot be before it is pushed) and pushes it
 * (chunk_sent).  Each row is published once.
 */
__device__ __forceinline__ void publish_rows(const cuops_job &J, const call &k, uint8_t *blk,
                                             uint32_t d, uint32_t first, uint32_t step,
                                             uint32_t end, const stream_post &p) {
  if (!is_remote(J, d)) {
    stamp_rows(J, k, blk, first, step, end);
    return;
  }
  __syncwarp();
  if (first >= end)
    return;
  __threadfence_system(); /* every lane's stores into the out channel before the counts */
  __syncwarp();
  if ((threadIdx.x & 31u) != 0)
    return;
  for (uint32_t i = first; i < end;) {
    const uint32_t c = i / J.chunk_rows, len = min(J.chunk_rows, p.rows - c * J.chunk_rows);
    uint32_t m = 0;
    for (; i < end && i / J.chunk_rows == c; i += step)
      m++;
    if (chunk_count(&J.chan_sent[d], c, m, len))
      chunk_sent(J, k, d, c, len, p);
  }
}

/* Every lane of a receiving warp, once it has read the rows it is to take: every lane's reads
 * before any of the warp's counts (take_rows), one fence for the warp. */
__device__ __forceinline__ void take_fence() {
  __syncwarp();
  __threadfence();
}

/*
 * One lane, once chunk c of source s's stream (len rows of the stream's
 * `rows`) is taken whole (take_rows): credit it, and every chunk after it
 * already taken whole, once every chunk before it is credited.  Nothing
 * waits here: the first chunk not credited yet holds the front
 * (cuops_job.chan_front), and each chunk taken whole behind it leaves a
 * done bit there, in the same word, so that whoever takes the front's
 * chunk last moves the front over them all (the compare-and-swap that sets
 * a chunk's bit sees every bit set before it, and the one that moves the
 * front past a chunk clears its bit).  Whoever moves the front stores the
 * credit, as a maximum: two that moved it one after the other may store
 * out of order.  A source on another node's chunk first has its in mark
 * set back to 0 (slab.h: before the credit lets the sender write its
 * place again, and before in_mark_open lets a receiver look at it), and
 * its credit, stored in the in slot (below: host memory), goes back
 * through the proxy (a CREDIT descriptor, which carries the word as it is
 * when the proxy takes it; the far daemon keeps the largest) only while
 * the sender may still wait for it, as the host backend's
 * (host_ops__stream_taken): while the credit before this move leaves rows
 * of the stream beyond the ring.  The movers that push are the first ones
 * (the rule is monotone in the front), each after its word is the front
 * it last read, so the credit pushed last lets the sender write every row.
 */
__device__ __forceinline__ void chunk_taken(const cuops_job &J, const call &k, uint32_t op,
                                            uint32_t s, uint32_t c, uint32_t len, uint32_t rows) {
  const uint32_t place = c % DEP_SLAB_CHUNKS, front_mask = (1u << CUOPS_CHAN_DONE_SHIFT) - 1u;
  const bool far = is_remote(J, s);
  if (far) {
    *(volatile uint64_t *)in_mark_at(J, k.parity, s, c) = 0;
    __threadfence_system();
  } else {
    __threadfence();
  }
  uint32_t *front = &J.chan_front[s];
  uint32_t was = *(volatile uint32_t *)front, now, f;
  for (;;) {
    now = was | 1u << (CUOPS_CHAN_DONE_SHIFT + place);
    for (f = now & front_mask;; f++) { /* over the chunks taken whole from the front on */
      const uint32_t done = 1u << (CUOPS_CHAN_DONE_SHIFT + f % DEP_SLAB_CHUNKS);
      if ((now & done) == 0)
        break;
      now &= ~done;
    }
    now = (now & ~front_mask) | f;
    const uint32_t seen = atomicCAS(front, was, now);
    if (seen == was)
      break;
    was = seen;
  }
  if (f == (was & front_mask))
    return; /* a chunk before it is not taken whole yet: whoever takes it credits this one */
  __threadfence_system(); /* the reads of every row it credits (counted after a fence) first */
  uint64_t *word = (uint64_t *)(recv_slot(J, k.parity, s) + offsetof(ops_slot, credit));
  if (!far) {
    red_max_release_sys(word, DEP_SLAB_CHAN_AT(k.seq, min(f * J.chunk_rows, rows)));
    return;
  }
  /* The in slot is host memory, where an atomic of the device is not one the host (or, without
   * the bus's atomics, the device) can count on: a plain store, then the front read again; a
   * mover whose store came after a later mover's (a smaller credit over a larger) sees the
   * front past its own and stores that, so the store that comes last is the front's. */
  for (uint32_t stored = f;;) {
    st_release_sys(word, DEP_SLAB_CHAN_AT(k.seq, min(stored * J.chunk_rows, rows)));
    __threadfence_system();
    const uint32_t at = ld_acquire_gpu32(front) & front_mask;
    if (at == stored)
      break;
    stored = at;
  }
  if ((uint64_t)(was & front_mask) * J.chunk_rows + J.chan_rows < rows)
    xring_push(J, k, op, s, 0, DEP_XRING_CREDIT);
}

/*
 * One lane, once its warp has read rows j0..j1 - 1 of source s's
 * stream (`rows` in all), then met at a __syncwarp and fenced (the reads
 * before the counts, take_fence): count them taken, chunk by chunk
 * (cuops_job.chan_took, an atomic add), and credit each chunk the count
 * completes (chunk_taken).  It never waits: the rows of a source are taken
 * in any order, by many warps at once, and a chunk is credited once every
 * row of it and of the chunks before it is taken.
 */
__device__ __forceinline__ void take_rows(const cuops_job &J, const call &k, uint32_t op,
                                          uint32_t s, uint32_t j0, uint32_t j1, uint32_t rows) {
  for (uint32_t j = j0; j < j1;) {
    const uint32_t c = j / J.chunk_rows, end = min((c + 1) * J.chunk_rows, j1);
    const uint32_t len = min(J.chunk_rows, rows - c * J.chunk_rows);
    if (chunk_count(&J.chan_took[s], c, end - j, len))
      chunk_taken(J, k, op, s, c, len, rows);
    j = end;
  }
}

/*
 * A receiving warp, after reading its claimed rows (lane i < n: row j of
 * source src, in stream order: a source's rows are consecutive): take
 * them, the first lane of each source's rows for all of them (take_rows;
 * rows[s]: source s's stream).
 */
__device__ __forceinline__ void take_claimed(const cuops_job &J, const call &k, uint32_t op,
                                             uint32_t n, uint32_t src, uint32_t j,
                                             const uint32_t *rows) {
  const uint32_t lane = threadIdx.x & 31u;
  take_fence();
  const uint32_t prev = __shfl_up_sync(FULL_MASK, src, 1);
  const uint32_t heads = __ballot_sync(FULL_MASK, lane < n && (lane == 0 || src != prev));
  if (((heads >> lane) & 1u) == 0)
    return;
  const uint32_t later = heads & ~((2u << lane) - 1u); /* 2u << 31 wraps to 0: none later */
  const uint32_t last = later != 0 ? (uint32_t)__ffs(later) - 1 : n;
  take_rows(J, k, op, src, j, j + (last - lane), rows[src]);
}

#endif /* DEP_OPS_STREAM_CUH */
