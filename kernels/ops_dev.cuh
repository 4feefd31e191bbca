/*
 * ops_dev.cuh — device-side building blocks of the cuda backend's MoE
 * kernels (kernels/ops.cu): slab addressing, the call's masks, the flag
 * protocol (release / acquire at system scope, bounded waits on
 * %globaltimer, the error record) and the declaration every kernel has
 * (KERNEL); the number formats are ops_fmt.cuh's, the ordered loads and
 * stores ops_order.cuh's, the copies and the block-wide prefix sum
 * ops_copy.cuh's, the throughput rows' marks ops_rows.cuh's.  The ABI and the protocol are
 * described in proto/kabi.h.
 */
#ifndef DEP_OPS_DEV_CUH
#define DEP_OPS_DEV_CUH

#include <stddef.h>
#include <stdint.h>

#include "kabi.h"

/* A kernel: C linkage (the launcher looks each up by name in the one module),
 * CUOPS_THREADS threads a CTA, CUOPS_CTAS_PER_SM CTAs resident per SM. */
#define KERNEL extern "C" __global__ void __launch_bounds__(CUOPS_THREADS, CUOPS_CTAS_PER_SM)

/* The four kernels a profiler times: C++ names in namespace deepepd, so that
 * their names hold "::dispatch" or "::combine" as DeepEP's do (its tests'
 * bench_kineto finds an op by them), looked up by their mangled names
 * (kabi.h CUOPS_KERNELS).  The kernels beside them keep C names, which hold
 * neither word. */
#define TIMED_KERNEL __global__ void __launch_bounds__(CUOPS_THREADS, CUOPS_CTAS_PER_SM)
namespace deepepd {
TIMED_KERNEL dispatch(const cuops_job J, const cuops_dispatch_args a);
TIMED_KERNEL combine(const cuops_job J, const cuops_combine_args a);
TIMED_KERNEL dispatch_stream(const cuops_job J, const cuops_dispatch_args a);
TIMED_KERNEL combine_stream(const cuops_job J, const cuops_combine_args a);
TIMED_KERNEL dispatch_node(const cuops_job J, const cuops_dispatch_args a);
namespace ll {
TIMED_KERNEL dispatch(const cuops_job J, const cuops_ll_dispatch_args a);
TIMED_KERNEL combine(const cuops_job J, const cuops_ll_combine_args a);
} // namespace ll
} // namespace deepepd

#define FULL_MASK 0xffffffffu
/* A wait on this rank's own CTAs, for no source rank (gone_blocks). */
#define CUOPS_NO_SRC 0xffffffffu

/* ---- slab addressing (proto/slab.h's functions, on the job's numbers) ------- */

/*
 * Where a rank's slab and its place among the remote ranks are kept: in
 * the job descriptor itself for a world of at most CUOPS_MAX_RANKS (its
 * slabs[] and the bits of remote_mask, kernel parameters: no load from
 * memory), in the world arrays beyond it (kabi.h wslabs, xnum).  The test
 * is on a kernel parameter, the same for every thread.
 */
__device__ __forceinline__ uint8_t *slab_of(const cuops_job &J, uint32_t r) {
  /* A branch the compiler lays out for the small world (a select kept both tables' operands
   * live, and the streamed combine spilled). */
  if (__builtin_expect(J.world > CUOPS_MAX_RANKS, 0))
    return J.wslabs[r];
  return J.slabs[r];
}

__device__ __forceinline__ uint8_t *slot_at(const cuops_job &J, uint32_t slab, unsigned parity,
                                            uint32_t src) {
  return slab_of(J, slab) + DEP_SLAB_CTRL_SLOT_AT(J.world, parity, src);
}

__device__ __forceinline__ uint8_t *block_at(const cuops_job &J, uint32_t slab, unsigned parity,
                                             uint32_t src) {
  return slab_of(J, slab) +
         DEP_SLAB_BLOCK_AT(J.data_off, J.parity_bytes, J.block_bytes, parity, src);
}

/* Whether rank d is on another node: reached through the exchange region and the ring. */
__device__ __forceinline__ bool is_remote(const cuops_job &J, uint32_t d) {
  return J.world <= CUOPS_MAX_RANKS ? ((J.remote_mask >> d) & 1ull) != 0 : J.xnum[d] >= 0;
}

/* The exchange region's entry of remote rank d in a call of parity: its
 * index among (parity, remote rank) pairs (slab.h DEP_XCHG_INDEX), the
 * remote ranks numbered in rank order. */
__device__ __forceinline__ uint64_t out_index(const cuops_job &J, unsigned parity, uint32_t d) {
  const uint32_t ri = J.world <= CUOPS_MAX_RANKS
                          ? (uint32_t)__popcll(J.remote_mask & ((1ull << d) - 1ull))
                          : (uint32_t)J.xnum[d];
  return DEP_XCHG_INDEX(J.n_remote, parity, ri);
}

/* Where this rank's block (and slot) for destination d goes in a call of
 * parity: d's slab, or (d on another node) the out block (out slot) of
 * this rank's exchange region. */
__device__ __forceinline__ uint8_t *send_block(const cuops_job &J, unsigned parity, uint32_t d) {
  return is_remote(J, d)
             ? J.xchg + DEP_XCHG_ENTRY_AT(J.out_off, J.block_bytes, out_index(J, parity, d))
             : block_at(J, d, parity, J.rank);
}

__device__ __forceinline__ uint8_t *send_slot(const cuops_job &J, unsigned parity, uint32_t d) {
  return is_remote(J, d)
             ? J.xchg +
                   DEP_XCHG_ENTRY_AT(J.out_slot_off, DEP_SLAB_CTRL_SLOT, out_index(J, parity, d))
             : slot_at(J, d, parity, J.rank);
}

/* Where source s's block (and slot) for this rank is in a call of parity:
 * this rank's slab, or (s on another node) the in block (in slot) of its
 * exchange region, which the daemons fill (host memory over the mapping). */
__device__ __forceinline__ uint8_t *recv_block(const cuops_job &J, unsigned parity, uint32_t s) {
  return is_remote(J, s)
             ? J.xchg + DEP_XCHG_ENTRY_AT(J.in_off, J.block_bytes, out_index(J, parity, s))
             : block_at(J, J.rank, parity, s);
}

__device__ __forceinline__ uint8_t *recv_slot(const cuops_job &J, unsigned parity, uint32_t s) {
  return is_remote(J, s)
             ? J.xchg +
                   DEP_XCHG_ENTRY_AT(J.in_slot_off, DEP_SLAB_CTRL_SLOT, out_index(J, parity, s))
             : slot_at(J, J.rank, parity, s);
}

__device__ __forceinline__ int64_t idx_at(const void *idx, int32_t itype, uint64_t i) {
  return itype == DEP_INDEX_I64 ? ((const int64_t *)idx)[i] : (int64_t)((const int32_t *)idx)[i];
}

#include "ops_order.cuh"

/* ---- failures ------------------------------------------------------------------ */

/*
 * Record a failure once per client until the library clears it: the pinned
 * record (read by the library without a sync) and the slab's error words
 * (read by tools), code stored last.  A timeout, a gone rank, or a peer
 * ahead of this call, breaks the context: later kernels do nothing.
 */
__device__ __forceinline__ void rec_fail(const cuops_job &J, int32_t code, uint32_t op, uint32_t src,
                                      uint32_t phase, uint64_t seq, uint64_t seen,
                                      uint64_t waited_ns) {
  if (code == DEP_ERR_TIMEOUT || code == DEP_ERR_PEER || phase == CUOPS_PHASE_AHEAD)
    atomicExch(&J.dev->broken, 1u);
  /* The call's status in the stats page (stats_call): its first failure. */
  atomicCAS((unsigned *)&J.dev->code, 0u, (unsigned)code);
  if (atomicCAS(&J.dev->claim, 0u, 1u) != 0u)
    return;
  volatile ops_err_record *rec[2] = {&J.host->err, (volatile ops_err_record *)slab_of(J, J.rank)};
  for (int i = 0; i < 2; i++) {
    rec[i]->op = op;
    rec[i]->rank = J.rank;
    rec[i]->source = src;
    rec[i]->seq = seq;
    rec[i]->seen_flag = seen;
    rec[i]->waited_ms = (uint32_t)(waited_ns / 1000000u);
    rec[i]->phase = phase;
  }
  __threadfence_system();
  rec[1]->code = code;
  rec[0]->code = code;
  __threadfence_system();
}

/* Defined with the call below: what a wait is part of. */
struct call;
__device__ __forceinline__ bool gone_blocks(const cuops_job &J, const call &k, uint32_t src);

/*
 * The abort code in this rank's own slab (slab.h DEP_SLAB_ABORT_OFF):
 * nonzero once the daemon found a rank of the job gone, and that rank one
 * this wait depends on (gone_blocks).  One thread asks, and only once its
 * wait has gone unmet for CUOPS_ABORT_POLL_NS (waited).
 */
__device__ __forceinline__ bool job_aborted(const cuops_job &J, const call &k, uint32_t src,
                                            uint64_t waited) {
  if (waited < CUOPS_ABORT_POLL_NS)
    return false;
  const uint8_t *w = slab_of(J, J.rank) + DEP_SLAB_ABORT_OFF;
  if (ld_acquire_sys32((const uint32_t *)(w + offsetof(dep_slab_abort, code))) == 0u)
    return false;
  return gone_blocks(J, k, src);
}

/* After job_aborted: record DEP_ERR_PEER naming the gone rank.  The code
 * is read again with acquire here (the caller may be another lane than
 * the one that asked), so the words stored before it are visible. */
__device__ __forceinline__ void rec_gone(const cuops_job &J, uint32_t op, uint64_t seq,
                                         uint64_t waited) {
  const uint8_t *w = slab_of(J, J.rank) + DEP_SLAB_ABORT_OFF;
  (void)ld_acquire_sys32((const uint32_t *)(w + offsetof(dep_slab_abort, code)));
  const volatile dep_slab_abort *a = (const volatile dep_slab_abort *)w;
  rec_fail(J, DEP_ERR_PEER, op, a->rank, CUOPS_PHASE_GONE, seq, OPS_ERR_GONE(a->pid, a->detached),
           waited);
}

/* An expert id from the caller's topk_idx: out of range is recorded and read as -1. */
__device__ __forceinline__ int64_t checked_id(const cuops_job &J, const void *idx, int32_t itype,
                                              uint64_t i, uint32_t op, bool report) {
  int64_t e = idx_at(idx, itype, i);
  if (e < -1 || e >= (int64_t)J.num_experts) {
    if (report)
      rec_fail(J, DEP_ERR_INVALID, op, (uint32_t)(i / J.topk), CUOPS_PHASE_IDS, 0, (uint64_t)e, 0);
    return -1;
  }
  return e;
}

/* ---- the call: its number, the waits, the flags -------------------------------- */

struct call {
  uint64_t seq;
  unsigned parity;
  uint64_t t0;
  bool skip; /* the context is broken: do nothing */
  /* The ranks masked for this call (cuops_mask), a bitmap of the world (slab.h
   * DEP_SLAB_MASK_BIT): its word 0 here, every word in the CTA's shared memory (maskw). */
  uint64_t mask;
  const uint64_t *maskw;
  uint32_t phase; /* CUOPS_WHOLE, CUOPS_SEND or CUOPS_RECV (kabi.h "Split calls") */
  /* The destinations of this CTA's units that left the job while it waited for their reads
   * (wait_taken), the same bitmap (word 0, and every word in shared memory): they are sent
   * nothing. */
  uint64_t gone;
  const uint64_t *gonew;
};

/*
 * The send work of a communicating kernel in units (kabi.h "SM budget"):
 * world * parts of them, unit u part u % parts of the rows for destination
 * u / parts.  CTA b sends units b, b + gridDim.x, b + 2 * gridDim.x, ...
 * in that order: the grid is at most the rank's budget, fewer CTAs than
 * units where the world is larger than it.
 */
__device__ __forceinline__ uint32_t units(const cuops_job &J) {
  return J.world * J.parts;
}

/*
 * Bit r of a bitmap of the world whose word 0 is w0 and whose words are w
 * (shared memory): a world of at most 64 ranks asks w0 alone, a register,
 * so its calls load nothing more than when the bitmap was one word.
 */
__device__ __forceinline__ bool world_bit(uint64_t w0, const uint64_t *w, uint32_t r) {
  return r < 64u ? ((w0 >> r) & 1ull) != 0 : ((w[r >> 6] >> (r & 63u)) & 1ull) != 0;
}

/* Whether rank r is masked for the call (kabi.h "Masked ranks"). */
__device__ __forceinline__ bool masked(const call &k, uint32_t r) {
  return world_bit(k.mask, k.maskw, r);
}

/* Whether destination d left the job while this CTA waited for its read (call_begin). */
__device__ __forceinline__ bool gone_to(const call &k, uint32_t d) {
  return world_bit(k.gone, k.gonew, d);
}

/* The words of a bitmap of the world (slab.h DEP_SLAB_MASK_WORDS). */
__device__ __forceinline__ uint32_t mask_words(const cuops_job &J) {
  return (uint32_t)DEP_SLAB_MASK_WORDS(J.world);
}

/*
 * The one place the kernels read the live mask (slab.h): its epoch with
 * acquire (system scope: the daemon writes it from the host), then, once
 * an epoch is written, its words and the join words (for call seq); or-ed
 * with this rank's own mask (cuops_job.own_mask), word by word into m
 * (mask_words of them).  A rank masked itself talks to no rank: every bit
 * set.  Thread 0 of each CTA, once, as the CTA begins (call_begin).
 */
__device__ __forceinline__ void cuops_mask(const cuops_job &J, uint64_t seq, uint64_t *m) {
  const uint8_t *slab = slab_of(J, J.rank);
  const uint32_t nw = mask_words(J);
  const uint64_t epoch = ld_acquire_sys((const uint64_t *)(slab + J.mask_epoch_off));
  for (uint32_t i = 0; i < nw; i++)
    m[i] = (epoch != 0 ? *(const volatile uint64_t *)(slab + J.mask_word_off + 8ull * i) : 0) |
           *(volatile unsigned long long *)&J.own_mask[i];
  /* A rank that came back is masked in the calls before its join call (slab.h). */
  for (uint32_t r = 0; epoch != 0 && r < J.world; r++)
    if (*(const volatile uint64_t *)(slab + J.mask_join_off + 8ull * r) > seq)
      m[r >> 6] |= DEP_SLAB_MASK_BIT(r);
  if (((m[J.rank >> 6] >> (J.rank & 63u)) & 1ull) != 0)
    for (uint32_t i = 0; i < nw; i++)
      m[i] = ~0ull;
}

/*
 * Whether the rank named in the abort words is one a wait for `src` (a
 * source rank, or CUOPS_NO_SRC for a wait on this rank's own CTAs) depends
 * on: src itself, or a rank that has not posted this call into this slab —
 * it never will.  A rank that posted this call and then left (a clean end:
 * it detached after its last call) fails no wait for a live, slower rank.
 */
__device__ __forceinline__ bool gone_blocks(const cuops_job &J, const call &k, uint32_t src) {
  const volatile dep_slab_abort *a =
      (const volatile dep_slab_abort *)(slab_of(J, J.rank) + DEP_SLAB_ABORT_OFF);
  const uint32_t gone = a->rank;
  if (gone < J.world && masked(k, gone))
    return false; /* the call waits for nothing from a masked rank */
  if (gone == src || gone >= J.world || DEP_SLAB_GONE_EVERY(a->detached))
    return true;
  return ld_acquire_sys((const uint64_t *)recv_slot(J, k.parity, gone)) != k.seq;
}

/*
 * Whether peer t has read call f, which this rank posted into its slot of
 * f's parity (sl: in t's slab, or the out slot image for t on another
 * node): the rule of host_ops.c read_by.  A local peer says so in the
 * slot's taken word.  One on another node says it in one of three ways
 * (kernels/host_ops.h "Split calls"), asked here in the order a job of
 * whole calls meets them, each a read across the bus: its post of f + 1
 * with prev_read (it had read f as it posted); its post of f + 2 (it posts
 * nothing of f's parity while f is pending); or the taken word its TAKEN
 * descriptor had the daemons store into the out slot.  t cannot post
 * f + 3 before this rank posts f + 2 (its call f + 3 waits for this rank's
 * read of f + 1), so the prev_read read after f + 1's flag is that post's.
 */
__device__ __forceinline__ bool read_by(const cuops_job &J, const call &k, uint32_t t,
                                        const ops_slot *sl, uint64_t f) {
  if (!is_remote(J, t))
    return ld_acquire_sys((const uint64_t *)&sl->taken) >= f;
  const ops_slot *next = (const ops_slot *)recv_slot(J, k.parity ^ 1u, t);
  if (ld_acquire_sys((const uint64_t *)&next->flag) == f + 1 &&
      *(const volatile uint32_t *)&next->prev_read != 0)
    return true;
  return ld_acquire_sys((const uint64_t *)recv_slot(J, k.parity, t)) >= f + 2 ||
         ld_acquire_sys((const uint64_t *)&sl->taken) >= f;
}

/*
 * Whether rank r has left an elastic job since the call read the live mask
 * (cuops_mask): its bit in the live mask now.  The daemon masks a rank that
 * died, detached or whose node was lost instead of aborting the job, so a
 * wait for it would never end; the call goes on as one that began with it
 * masked, as the host backend's does (host_ops__mask_grew).
 */
__device__ __forceinline__ bool left_since(const cuops_job &J, uint32_t r) {
  const uint8_t *slab = slab_of(J, J.rank);
  if (ld_acquire_sys((const uint64_t *)(slab + J.mask_epoch_off)) == 0)
    return false;
  return ((*(const volatile uint64_t *)(slab + J.mask_word_off + 8ull * (r >> 6)) >>
           (r & 63u)) & 1ull) != 0;
}

/* wait_taken's outcomes. */
enum : uint32_t {
  TAKEN_FAILED = 0, /* the wait failed (recorded) */
  TAKEN_FREE = 1,   /* the slot is free: t read it, or holds no post of two calls before */
  TAKEN_LEFT = 2,   /* t left the job since the call began (left_since): it never reads */
};

/*
 * Thread 0 of a CTA that is to send call k to rank t (kabi.h "Split calls"):
 * wait, bounded and abort-aware, until peer t has read (read_by) what this
 * rank posted into its slot of k's parity two calls before.  A slot that
 * holds no post of that call (a masked peer's, a fresh slab's) is free.
 * A peer that left an elastic job while this wait ran (it died with that
 * call unread) will never read it: the call goes on without t (TAKEN_LEFT:
 * it is sent nothing), as the receive waits do (wait_peers) and as the
 * host backend's wait_free does (host_ops__mask_grew), rather than time
 * out and break the context.
 * For t on another node the words are in host memory, so the wait sleeps
 * between reads rather than load the bus, and it fails as well when the
 * proxy stopped serving this rank's ring (its code).
 */
__device__ __forceinline__ uint32_t wait_taken(const cuops_job &J, const call &k, uint32_t op,
                                               uint32_t t) {
  if (t >= J.world || t == J.rank || masked(k, t))
    return TAKEN_FREE;
  const bool far = is_remote(J, t);
  const ops_slot *sl = (const ops_slot *)send_slot(J, k.parity, t);
  for (uint32_t i = 0;; i++) {
    const uint64_t f = ld_acquire_sys((const uint64_t *)&sl->flag);
    if (f + 2 != k.seq || read_by(J, k, t, sl, f))
      return TAKEN_FREE;
    if (far || (i & 31u) == 31u) {
      const uint64_t waited = globaltimer_ns() - k.t0;
      if (*(volatile uint32_t *)&J.dev->broken)
        return TAKEN_FAILED;
      if (job_aborted(J, k, t, waited)) {
        rec_gone(J, op, k.seq, waited);
        return TAKEN_FAILED;
      }
      /* Its read may have come just before it left: the words once more. */
      if (waited >= CUOPS_ABORT_POLL_NS && left_since(J, t))
        return read_by(J, k, t, sl, f) ? TAKEN_FREE : TAKEN_LEFT;
      const int32_t failed =
          far ? (int32_t)ld_acquire_sys32((const uint32_t *)(J.ring + offsetof(dep_xring, failed)))
              : 0;
      if (failed != 0 || waited > J.timeout_ns) {
        if (failed != 0)
          atomicExch(&J.dev->broken, 1u); /* t will not get this call, whatever the code */
        rec_fail(J, failed != 0 ? failed : DEP_ERR_TIMEOUT, op, t, CUOPS_PHASE_TAKEN, k.seq, f,
                 waited);
        return TAKEN_FAILED;
      }
      __nanosleep(far ? 1024 : 64);
    }
  }
}

/*
 * Every CTA of a communicating kernel starts here (all threads).  phase:
 * CUOPS_WHOLE, or a low-latency call's CUOPS_SEND or CUOPS_RECV (kabi.h
 * "Split calls"); a receive runs as the call its send made, `back` calls
 * before the device's count, and sends nothing, so it waits for no taken.
 * op: the call's, for the error record.
 */
__device__ __forceinline__ call call_begin(const cuops_job &J, uint32_t phase = CUOPS_WHOLE,
                                           uint32_t back = 0, uint32_t op = 0) {
  /* The call's mask and gone destinations, bitmaps of the world (call), this CTA's copies. */
  __shared__ uint64_t s_seq, s_t0, s_mask[CUOPS_MASK_WORDS], s_gone[CUOPS_MASK_WORDS];
  __shared__ uint32_t s_broken;
  const uint32_t nw = mask_words(J);
  if (threadIdx.x == 0) {
    const uint64_t now = *(volatile uint64_t *)&J.dev->seq;
    s_broken = *(volatile uint32_t *)&J.dev->broken;
    s_t0 = globaltimer_ns();
    for (uint32_t i = 0; i < nw; i++)
      s_gone[i] = 0;
    if (phase == CUOPS_RECV) {
      s_seq = now - back;
      const uint64_t sent = *(volatile uint64_t *)&J.dev->pend_seq[s_seq & 1u];
      for (uint32_t i = 0; i < nw; i++)
        s_mask[i] = *(volatile unsigned long long *)&J.pend_mask[(s_seq & 1u) * nw + i];
      if (sent != s_seq && s_broken == 0) {
        if (blockIdx.x == 0)
          rec_fail(J, DEP_ERR_MISMATCH, op, J.rank, CUOPS_PHASE_UNSENT, s_seq, sent, 0);
        s_broken = 1; /* this CTA: nothing to receive */
      }
    } else {
      s_seq = now + 1;
      cuops_mask(J, s_seq, s_mask);
      if (phase == CUOPS_SEND && blockIdx.x == 0) {
        for (uint32_t i = 0; i < nw; i++)
          J.pend_mask[(s_seq & 1u) * nw + i] = s_mask[i];
        J.dev->pend_seq[s_seq & 1u] = s_seq;
      }
    }
  }
  __syncthreads();
  call k;
  k.seq = s_seq;
  k.parity = (unsigned)(s_seq & 1u);
  k.t0 = s_t0;
  k.skip = s_broken != 0;
  k.mask = s_mask[0];
  k.maskw = s_mask;
  k.gone = 0;
  k.gonew = s_gone;
  k.phase = phase;
  /* A CTA writes into the slabs of its units' destinations alone (units, kabi.h "SM
   * budget"), so it waits for those ranks alone, each unit's in turn: one load each in the
   * steady state.  All of them here, before any unit is sent, rather than each before its
   * unit: every thread of the CTA meets here, where the streamed kernels' sending warps have
   * no barrier of their own, and no wait depends on this call (each is for a read of the call
   * two before), so waiting for them in a row holds nothing back but this CTA's first send. */
  if (phase != CUOPS_RECV && !k.skip) {
    __shared__ uint32_t s_free;
    if (threadIdx.x == 0) {
      uint32_t got = TAKEN_FREE;
      for (uint32_t u = blockIdx.x; got != TAKEN_FAILED && u < units(J); u += gridDim.x) {
        const uint32_t d = u / J.parts, f = wait_taken(J, k, op, d);
        got = f == TAKEN_FAILED ? f : got;
        /* A destination that left is sent nothing (arrive), as the host backend's grown
         * mask sends it nothing.  Not k.mask: the receive side meets it as one that left
         * (it posts nothing of this call: its receive of the call two before never ran,
         * so neither did this call's send), and every CTA must lay out its rows alike
         * (ops_tp.cuh). */
        if (f == TAKEN_LEFT)
          s_gone[d >> 6] |= DEP_SLAB_MASK_BIT(d);
      }
      s_free = got;
    }
    __syncthreads();
    k.skip = s_free == TAKEN_FAILED;
    k.gone = s_gone[0];
  }
  return k;
}

/*
 * The last CTA of a call logs it in the rank's stats page (stats_page.h),
 * host memory mapped for the device: the call's time on the global timer
 * from this CTA's start (every CTA of a call is resident and starts at
 * once, kabi.h), its bytes and its status, then its seq.  Stores only,
 * which PCIe posts without waiting: no load crosses the bus.  There is no
 * system fence before the seq either (it would hold the call's end for a
 * round trip): one thread's posted writes arrive in order in practice, and
 * were the seq seen first the daemon would count one call with a stale
 * time, an error of observation only.
 */
__device__ __forceinline__ void stats_call(const cuops_job &J, const call &k, uint32_t op,
                                           uint64_t bytes) {
  const uint64_t ns = globaltimer_ns() - k.t0;
  const int32_t code = *(volatile int32_t *)&J.dev->code;
  if (code != 0)
    J.dev->code = 0;
  volatile dep_stats_call *e = &J.stats->calls[k.seq % DEP_STATS_RING];
  e->bytes = bytes;
  e->ns = ns > 0xffffffffull ? 0xffffffffu : (uint32_t)ns;
  e->op = (uint16_t)op;
  e->status = (int16_t)code;
  e->seq = k.seq;
}

/* Defined below, with the posts: hand a descriptor of kind for rank d to the proxy. */
__device__ __forceinline__ bool xring_push(const cuops_job &J, const call &k, uint32_t op,
                                           uint32_t d, uint64_t bytes,
                                           uint32_t kind = DEP_XRING_BLOCK, uint32_t row0 = 0,
                                           unsigned long long *head = nullptr);

/*
 * Every CTA ends here (all threads).  The last one to finish: a call that
 * received (whole, or a split receive) says so in each local source's slot
 * (taken, kabi.h "Split calls"), and a split receive that ran after a
 * later call says so to each source on another node (a TAKEN descriptor);
 * a call that sent (whole, or a split send) publishes seq, and logs the
 * call (op, bytes) in the stats page where the rank has one.  A receive
 * leaves seq as it found it and logs nothing (its call was logged at its
 * send, as on the host backend); what it failed is in the error record.
 */
__device__ __forceinline__ void call_end(const cuops_job &J, const call &k, uint32_t op,
                                         uint64_t bytes) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&J.dev->done, 1u) == gridDim.x - 1) {
      J.dev->done = 0;
      J.dev->ticket = 0; /* the throughput ops' work counter, for the next call */
      for (uint32_t s = 0; J.chan_rows < J.max_tokens && s < J.world; s++) {
        J.chan_took[s] = 0; /* a streamed call's channels, for the next call */
        J.chan_front[s] = 0;
        J.chan_sent[s] = 0;
      }
      if (k.phase != CUOPS_SEND && !k.skip) {
        __threadfence_system(); /* every CTA's reads of the blocks before the word */
        for (uint32_t s = 0; s < J.world; s++)
          if (!is_remote(J, s))
            st_release_sys((uint64_t *)(slot_at(J, J.rank, k.parity, s) +
                                        offsetof(ops_slot, taken)),
                           k.seq);
        /* A split receive after a later call, whose posts said this one was unread
         * (prev_read 0): each source on another node that posted it is told through the
         * proxy, a TAKEN descriptor that carries its in slot's taken word (xring.h). */
        const bool later = *(volatile uint64_t *)&J.dev->seq != k.seq &&
                           *(volatile uint32_t *)&J.dev->broken == 0;
        const uint32_t ll = op == DEP_STATS_OP_LL_DISPATCH ? OPS_OP_LL_DISPATCH : OPS_OP_LL_COMBINE;
        for (uint32_t s = 0; later && k.phase == CUOPS_RECV && s < J.world; s++) {
          uint8_t *in = recv_slot(J, k.parity, s);
          if (!is_remote(J, s) || ld_acquire_sys((const uint64_t *)in) != k.seq)
            continue; /* a local source reads its slot itself; one that posted nothing waits not */
          st_release_sys((uint64_t *)(in + offsetof(ops_slot, taken)), k.seq);
          if (!xring_push(J, k, ll, s, 0, DEP_XRING_TAKEN))
            break;
        }
      }
      if (k.phase == CUOPS_RECV) {
        J.dev->pend_seq[k.parity] = 0;
        J.dev->code = 0;
        __threadfence();
        return;
      }
      *(volatile uint64_t *)&J.dev->seq = k.seq;
      __threadfence();
      if (J.stats != nullptr && !k.skip)
        stats_call(J, k, op, bytes);
    }
  }
}

/*
 * Publish this rank's slot at destination d: the call's row count, op,
 * handle and token count, then the flag (release).  The throughput ops
 * call it before any row is written and mark each row when it lands
 * (row_tag), so receivers copy rows out while the rest are still crossing
 * NVLink: nothing is ordered before the flag but the slot's own fields,
 * which the release store covers.  post() calls it after the rows.
 */
__device__ __forceinline__ void post_header(const cuops_job &J, const call &k, uint32_t d,
                                            uint32_t rows, uint32_t op, uint64_t ref_seq,
                                            uint32_t num_tokens) {
  uint8_t *slot = send_slot(J, k.parity, d);
  volatile ops_slot *sl = (volatile ops_slot *)slot;
  sl->rows = rows;
  sl->op = op;
  sl->ref_seq = ref_seq;
  sl->num_tokens = num_tokens;
  /* Whether the call before is read (not a send whose receive is yet to run): a source on
   * another node reads it here (read_by), as the host backend writes it. */
  sl->prev_read = k.seq == 1 || *(volatile uint64_t *)&J.dev->pend_seq[(k.seq - 1) & 1u] !=
                                    k.seq - 1;
  st_release_sys((uint64_t *)slot, k.seq);
}

/*
 * One thread, once this rank's block (its first `bytes`) and slot image
 * for the remote rank d are written and fenced at system scope: hand them
 * to the daemon's proxy (kabi.h, proto/xring.h).  Reserve a
 * descriptor, wait (bounded) for room — the tail last read is kept in
 * device memory, so the steady state reads nothing across the bus — write
 * it, then publish the ring's head in reservation order: after the
 * descriptors before it, each pushed by another CTA that is resident and
 * pushing.  kind: DEP_XRING_BLOCK, DEP_XRING_TAKEN (bytes 0: the in
 * slot's taken word for source d, call_end), or a streamed call's
 * DEP_XRING_CHUNK (| DEP_XRING_SLOT: rows from row0 of the out channel),
 * DEP_XRING_SLOT alone or DEP_XRING_CREDIT (ops_stream.cuh).  One lane of
 * a warp calls it, and other lanes of the same warp may push at once:
 * each waits for its own reservation, which the lanes that hold the ones
 * before it publish (independent thread scheduling, sm_70 on).  False when
 * the call failed (recorded here, or broken elsewhere); *head (where given):
 * the ring's head it published, which the proxy's tail passes once it has
 * taken the descriptor (a node channel's chunk place, ops_node.cuh).
 */
__device__ __forceinline__ bool xring_push(const cuops_job &J, const call &k, uint32_t op,
                                           uint32_t d, uint64_t bytes, uint32_t kind,
                                           uint32_t row0, unsigned long long *head) {
  uint8_t *r = J.ring;
  const unsigned long long i = atomicAdd(&J.dev->xr_next, 1ull);
  bool written = false;
  for (uint32_t n = 0;; n++) {
    if (!written) {
      unsigned long long tail = *(volatile unsigned long long *)&J.dev->xr_tail;
      if (i - tail >= DEP_XRING_ENTRIES) {
        tail = ld_acquire_sys((const uint64_t *)(r + offsetof(dep_xring, tail)));
        atomicMax(&J.dev->xr_tail, tail);
      }
      if (i - tail < DEP_XRING_ENTRIES) {
        volatile dep_xring_desc *e =
            (volatile dep_xring_desc *)(r + offsetof(dep_xring, desc)) + i % DEP_XRING_ENTRIES;
        e->dest = d;
        e->parity = k.parity;
        e->seq = k.seq;
        e->bytes = bytes;
        e->kind = kind;
        e->row0 = row0;
        written = true;
      }
    }
    if (written && ld_acquire_gpu(&J.dev->xr_pub) == i) {
      __threadfence_system();
      st_release_sys((uint64_t *)(r + offsetof(dep_xring, head)), i + 1);
      __threadfence_system();
      *(volatile unsigned long long *)&J.dev->xr_pub = i + 1;
      if (head != nullptr)
        *head = i + 1;
      return true;
    }
    if ((n & 31u) == 31u) {
      const uint64_t waited = globaltimer_ns() - k.t0;
      const int32_t failed =
          (int32_t)ld_acquire_sys32((const uint32_t *)(r + offsetof(dep_xring, failed)));
      if (failed != 0 || waited > J.timeout_ns) {
        atomicExch(&J.dev->broken, 1u); /* d will not get this call, whatever the code */
        rec_fail(J, failed != 0 ? failed : DEP_ERR_TIMEOUT, op, d, CUOPS_PHASE_RING, k.seq,
                 written ? 1u : 0u, waited);
        return false;
      }
      if (*(volatile uint32_t *)&J.dev->broken)
        return false;
      __nanosleep(64);
    }
  }
}

/*
 * One lane of each of the `senders` warps or units writing this rank's
 * block for destination d (each of d's units' warps, or each of d's units:
 * kabi.h "SM budget"), once its part is written: the last to arrive
 * publishes it.  For a local d that is posting the slot (post, with
 * header) or nothing (the throughput ops posted theirs first: header
 * false); for a remote d, pushing the out block's first `bytes` and
 * its slot image to the proxy, once all of it is written.
 */
__device__ __forceinline__ void arrive(const cuops_job &J, const call &k, uint32_t d,
                                       uint32_t senders, bool header, uint32_t rows, uint32_t op,
                                       uint64_t ref_seq, uint32_t num_tokens, uint64_t bytes) {
  if (!header && !is_remote(J, d))
    return;
  __threadfence_system();
  if (atomicAdd(&J.arrive[d], 1u) != senders - 1)
    return;
  J.arrive[d] = 0;
  if (masked(k, d) || gone_to(k, d))
    return; /* counted, so that the counter stays in step; a masked rank is sent nothing */
  __threadfence_system();
  if (header)
    post_header(J, k, d, rows, op, ref_seq, num_tokens);
  if (is_remote(J, d)) {
    __threadfence_system();
    xring_push(J, k, op, d, bytes);
  }
}

/*
 * Thread 0 of a sender CTA, after the CTA's writes for its unit of
 * destination d: the last of d's J.parts units to arrive publishes the slot
 * and the flag (through the proxy for a remote d: bytes of the block).
 */
__device__ __forceinline__ void post(const cuops_job &J, const call &k, uint32_t d, uint32_t rows,
                                  uint32_t op, uint64_t ref_seq, uint32_t num_tokens,
                                  uint64_t bytes) {
  arrive(J, k, d, J.parts, true, rows, op, ref_seq, num_tokens, bytes);
}

/*
 * The dynamic shared memory of a communicating kernel's CTA (kabi.h
 * "Shared memory"): the receive's state for each source of the job's world
 * at the offsets CUOPS_SHM_* say, then the low-latency dispatch's per-expert
 * part (ll_dyn).  The launch gives each kernel the bytes its world needs
 * (dep__kernel_shmem), so a small world's CTA holds no more than it uses.
 */
extern __shared__ __align__(16) uint8_t cuops_dyn[];

/* What a receiver CTA learns from every source's slot: views of its dynamic shared memory,
 * offsets from one symbol by the job's world (a kernel parameter), so no load finds them. */
struct peers {
  uint32_t *rows, *op;
  uint64_t *ref;
  /* Sources that left the job while this call waited for them, a bitmap of the world. */
  uint64_t *left;
};

__device__ __forceinline__ peers peers_of(const cuops_job &J) {
  __shared__ uint64_t s_left[CUOPS_MASK_WORDS];
  return {(uint32_t *)(cuops_dyn + CUOPS_SHM_ROWS(J.world)),
          (uint32_t *)(cuops_dyn + CUOPS_SHM_OP(J.world)),
          (uint64_t *)(cuops_dyn + CUOPS_SHM_REF(J.world)), s_left};
}

/* A receive's [world + 1] running first rows of each source, and its [world] offsets (the
 * throughput dispatch's) or counts (dep__k_ll_info's), in the same dynamic shared memory. */
__device__ __forceinline__ uint32_t *src_first(const cuops_job &J) {
  return (uint32_t *)(cuops_dyn + CUOPS_SHM_FIRST(J.world));
}
__device__ __forceinline__ uint32_t *src_off(const cuops_job &J) {
  return (uint32_t *)(cuops_dyn + CUOPS_SHM_OFF(J.world));
}
/* The low-latency dispatch's per-expert words (CUOPS_LL_SHMEM), after the per-source state. */
__device__ __forceinline__ uint32_t *ll_dyn(const cuops_job &J) {
  return (uint32_t *)(cuops_dyn + CUOPS_SHM_SRC(J.world));
}

/* Whether the call takes nothing from source s: masked as it began, or gone since. */
__device__ __forceinline__ bool skipped(const call &k, const peers &p, uint32_t s) {
  return masked(k, s) || ((p.left[s >> 6] >> (s & 63u)) & 1ull) != 0;
}

/*
 * Thread 0: wait, bounded, until every source has posted this call into
 * this rank's slab (a remote source: its exchange region), then read their
 * slots.  0, or 1 when the call failed
 * (recorded here or by another CTA).  cost (the low-latency calls'
 * wait_cost; NULL for the others): CTA 0 adds to cost[s] the clock64
 * cycles from the start of this wait until source s's post was there.
 */
__device__ __forceinline__ int wait_peers(const cuops_job &J, const call &k, uint32_t op,
                                          const peers *p, int64_t *cost = nullptr) {
  const long long start = clock64();
  for (uint32_t i = 0; i < mask_words(J); i++)
    p->left[i] = 0;
  for (uint32_t s = 0; s < J.world; s++) {
    if (masked(k, s)) { /* nothing from it: no rows, no wait (its checks are the callers') */
      p->rows[s] = 0;
      p->op[s] = op;
      p->ref[s] = 0;
      continue;
    }
    uint8_t *slot = recv_slot(J, k.parity, s);
    /* A remote source's flag is in host memory: CTA 0 alone polls it and
     * passes what it saw on through device memory (xseen), which the other
     * CTAs poll.  Every CTA polling across the bus saturates its reads,
     * and the senders' stores and system fences to host memory wait
     * behind them: a call's time grew with its CTAs (BENCHMARKS.md,
     * "Between nodes on the cuda backend").  Acquire (system) in CTA 0,
     * release then acquire (GPU) to the others: the block's bytes are
     * ordered before their reads. */
    const bool mirror = is_remote(J, s) && blockIdx.x != 0;
    unsigned long long *seen = &J.xseen[s];
    bool left = false;
    for (uint32_t i = 0;; i++) {
      uint64_t f = mirror ? ld_acquire_gpu(seen) : ld_acquire_sys((const uint64_t *)slot);
      if (f == k.seq)
        break;
      if (mirror && f == (k.seq | CUOPS_XSEEN_FAILED))
        return 1; /* recorded by CTA 0 */
      if (!mirror && f > k.seq) {
        rec_fail(J, DEP_ERR_MISMATCH, op, s, CUOPS_PHASE_AHEAD, k.seq, f, globaltimer_ns() - k.t0);
        if (is_remote(J, s))
          st_release_gpu(seen, k.seq | CUOPS_XSEEN_FAILED);
        return 1;
      }
      if ((i & 31u) == 31u) {
        uint64_t waited = globaltimer_ns() - k.t0;
        int failed = 0;
        if (waited > J.timeout_ns) {
          rec_fail(J, DEP_ERR_TIMEOUT, op, s, CUOPS_PHASE_WAIT, k.seq, f, waited);
          failed = 1;
        } else if (*(volatile uint32_t *)&J.dev->broken) {
          failed = 1;
        } else if (job_aborted(J, k, s, waited)) {
          rec_gone(J, op, k.seq, waited);
          failed = 1;
        } else if (waited >= CUOPS_ABORT_POLL_NS && left_since(J, s)) {
          /* Its post may have come just before it left: read the flag once more. */
          left = (mirror ? ld_acquire_gpu(seen) : ld_acquire_sys((const uint64_t *)slot)) !=
                 k.seq;
          if (!left)
            break;
        }
        if (failed) {
          if (is_remote(J, s) && !mirror)
            st_release_gpu(seen, k.seq | CUOPS_XSEEN_FAILED);
          return 1;
        }
        if (left)
          break;
        __nanosleep(64);
      }
    }
    if (left) { /* as a masked source's (skipped) */
      p->rows[s] = 0;
      p->op[s] = op;
      p->ref[s] = 0;
      p->left[s >> 6] |= DEP_SLAB_MASK_BIT(s);
      continue;
    }
    if (is_remote(J, s) && !mirror)
      st_release_gpu(seen, k.seq);
    if (cost != nullptr && blockIdx.x == 0)
      atomicAdd((unsigned long long *)&cost[s], (unsigned long long)(clock64() - start));
    const volatile ops_slot *sl = (const volatile ops_slot *)slot;
    p->rows[s] = sl->rows;
    p->op[s] = sl->op;
    p->ref[s] = sl->ref_seq;
  }
  return 0;
}

#include "ops_fmt.cuh"

#include "ops_copy.cuh"

#endif /* DEP_OPS_DEV_CUH */
