/*
 * stats_page.h — the per-rank stats page (DESIGN §10), defined once for the
 * daemon that lends and reads it and the library (and, on cuda, its
 * kernels) that write it.
 *
 * At attach the daemon lends each rank one page of host memory (a sealed
 * memfd, STATS_LEND): the rank writes what each of its calls took, with
 * plain stores and no system call, and the daemon reads the page on a timer
 * and keeps the figures (daemon/stats.c).  So the trainer's hot path pays a
 * clock read and a few stores, and the figures outlive the trainer.
 *
 * The writer keeps no histogram: it logs each call into a ring, and the
 * daemon folds the ring into its own histograms.  That keeps the writer's
 * work to stores it need not read back, which matters on cuda, where the
 * writer is the last CTA of each kernel and the page is host memory across
 * PCIe (a load there costs microseconds; a store is posted).
 *
 *   calls[]    one entry per communicating call (dispatch, combine and their
 *              low-latency forms), at calls[seq % DEP_STATS_RING], where
 *              seq is the call number the operations already keep
 *              (host_ops.h, kabi.h): the entry's seq is stored last,
 *              with release ordering, and a reader takes an entry only when
 *              it reads the same seq before and after copying it.
 *   layouts    after calls[], one entry per layout, in slot
 *              n % DEP_STATS_LAYOUT_RING, n counting layouts from 1: its
 *              time and the tokens it sends to each rank of the job (the
 *              load-balance figures read these).  An entry holds a count per
 *              rank of the job's world, so the page is sized by the world
 *              at attach (dep_stats_page_bytes) and an entry is found with
 *              dep_stats_layout_at: for a world of 1024 ranks, 16 entries
 *              of 4 KiB each after the calls' 128 KiB.
 *   rejected[] calls the library refused before anything ran (bad
 *              arguments, wrong state), per op: they have no seq.
 *   attach_*   dep_attach_times, written once when dep_attach returns, then
 *              attached = 1 (release).
 *
 * The page is input from another process: the daemon checks the header it
 * wrote itself is unchanged and bounds every index it derives from it.  Its
 * work on a page is bounded whatever the page holds: a fold takes at most
 * one ring's worth of entries and passes over the ring at most once more,
 * and it stops reading a page whose ring holds a number where no honest
 * writer puts one (a seq not in calls[seq % DEP_STATS_RING], an n not in
 * layout slot n % DEP_STATS_LAYOUT_RING, either past DEP_STATS_SEQ_LIMIT),
 * keeping the rank's figures so far.
 * Changing this layout changes what both ends compute: bump
 * DEP_STATS_VERSION (the STATS_LEND reply carries it; a library of another
 * version goes without stats rather than writing a layout the daemon
 * misreads).
 */
#ifndef DEP_STATS_PAGE_H
#define DEP_STATS_PAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The kernels (kernels/ops.cu) compute a call's bytes the way the host does. */
#ifdef __CUDACC__
#define DEP_STATS_HD __host__ __device__
#else
#define DEP_STATS_HD
#endif

#define DEP_STATS_MAGIC 0x53504544u /* "DEPS" */
#define DEP_STATS_VERSION 2u /* 2: layouts after the calls, sized by the world */

/* Calls the ring holds: the daemon reads it every DEP_STATS_POLL_MS, so a
 * rank may make this many calls per poll before entries are overwritten
 * unread (counted as dropped: 40,960 calls a second at 100 ms). */
#define DEP_STATS_RING 4096u
#define DEP_STATS_LAYOUT_RING 16u
#define DEP_STATS_POLL_MS 100u
/* No call or layout is numbered this high (2^63: centuries of calls at any
 * rate), so the daemon's arithmetic on the numbers it reads cannot wrap. */
#define DEP_STATS_SEQ_LIMIT (1ull << 63)

/* The operations, in the order of every per-op array.  XX(NAME, "name") */
#define DEP_STATS_OPS(XX)            \
  XX(LAYOUT, "layout")               \
  XX(DISPATCH, "dispatch")           \
  XX(COMBINE, "combine")             \
  XX(LL_DISPATCH, "ll_dispatch")     \
  XX(LL_COMBINE, "ll_combine")

enum dep_stats_op {
#define DEP__STATS_OP(name, str) DEP_STATS_OP_##name,
  DEP_STATS_OPS(DEP__STATS_OP)
#undef DEP__STATS_OP
  DEP_STATS_NOPS
};

/* One communicating call.  32 bytes, naturally aligned, so that each field
 * is one store on both the CPU and the GPU. */
struct dep_stats_call {
  uint64_t seq;    /* the call's number (1, 2, ...); 0: empty; stored last */
  uint64_t bytes;  /* hidden-state bytes of the caller's tokens (dep_stats_bytes) */
  uint32_t ns;     /* how long it took, saturating at UINT32_MAX */
  uint16_t op;     /* enum dep_stats_op */
  int16_t status;  /* 0, or the DEP_ERR_* it failed with */
  uint64_t reserved;
};

/* One layout: when it ran, and then (dep_stats_layout_tokens) how many of this rank's tokens
 * go to each rank, one u32 per rank of the job's world. */
struct dep_stats_layout {
  uint64_t n;      /* layouts made so far, this one included; 0: empty; stored last */
  uint32_t ns;
  int32_t status;
  uint32_t world;  /* counts in use: the job's world, or 0 for a layout that failed */
  uint32_t reserved;
};

struct dep_stats_page {
  /* written by the daemon when it lends the page, read-only for the rank */
  uint32_t magic, version;
  uint32_t bytes;          /* the page's size as lent */
  uint32_t world;
  uint32_t rank, local_rank;
  /* written by the library */
  uint32_t attached;       /* 1 once attach_* are written (release) */
  uint32_t backend_cuda;   /* 1: times are the kernels' own (GPU time); 0: host clock */
  uint64_t attach_total_ns, attach_wait_ns, attach_map_ns, attach_setup_ns, attach_warmup_ns;
  uint64_t rejected[DEP_STATS_NOPS];
  struct dep_stats_call calls[DEP_STATS_RING];
  /* then DEP_STATS_LAYOUT_RING layout entries of dep_stats_layout_bytes(world) each */
};

/* One layout entry of a world of `world` ranks: its head and a count per rank, rounded to 8
 * bytes so that the next entry's n is aligned. */
static inline DEP_STATS_HD size_t dep_stats_layout_bytes(uint32_t world) {
  return (sizeof(struct dep_stats_layout) + (size_t)world * sizeof(uint32_t) + 7u) / 8u * 8u;
}

/* Where layout slot `slot` (< DEP_STATS_LAYOUT_RING) of a page of a world of `world` ranks
 * starts, in bytes from the page's start. */
static inline DEP_STATS_HD size_t dep_stats_layout_off(uint32_t world, uint32_t slot) {
  return sizeof(struct dep_stats_page) + (size_t)slot * dep_stats_layout_bytes(world);
}

/* What the daemon maps and the library is lent for a job of `world` ranks (1..DEP_MAX_WORLD):
 * the page and its layout entries, rounded to 4 KiB. */
static inline DEP_STATS_HD size_t dep_stats_page_bytes(uint32_t world) {
  return (dep_stats_layout_off(world, DEP_STATS_LAYOUT_RING) + 4095u) / 4096u * 4096u;
}

/* Layout slot `slot` of page p (of a world of `world` ranks), and the entry's counts. */
static inline DEP_STATS_HD struct dep_stats_layout *dep_stats_layout_at(struct dep_stats_page *p,
                                                                        uint32_t world,
                                                                        uint32_t slot) {
  return (struct dep_stats_layout *)((char *)p + dep_stats_layout_off(world, slot));
}
static inline DEP_STATS_HD uint32_t *dep_stats_layout_tokens(struct dep_stats_layout *e) {
  return (uint32_t *)(e + 1);
}

/* The op's name ("ll_dispatch"), or "unknown". */
const char *dep__stats_op_name(unsigned op);

/*
 * The steady-state histogram, fixed size and log-scale: four buckets per
 * power of two of nanoseconds (each 14 to 25 % wide), from 1 ns to 2^32 ns
 * (4.3 s, where the call entry's ns saturates).  A quantile read from it is
 * the middle of its bucket: within 12.5 % of the true value.
 */
#define DEP_STATS_BUCKETS 128u
unsigned dep__stats_bucket(uint64_t ns);
/* The smallest duration bucket b holds. */
uint64_t dep__stats_bucket_low(unsigned b);
/* The q-quantile (0 < q <= 1) of a histogram of n calls, in ns; 0 when n is 0. */
uint64_t dep__stats_quantile(const uint32_t hist[DEP_STATS_BUCKETS], uint64_t n, double q);

/*
 * The bytes a call's figure counts, the same on both backends: the hidden
 * states of the caller's num_tokens tokens, at 2 bytes a channel (bf16), or
 * for an FP8 low-latency dispatch 1 byte plus its scales (4 bytes per 128
 * channels).  GB/s in deepepctl stats is these bytes over the median time.
 */
static inline DEP_STATS_HD uint64_t dep_stats_bytes(uint32_t num_tokens, uint32_t hidden, bool fp8) {
  uint64_t per = fp8 ? (uint64_t)hidden + (uint64_t)hidden / 32u : 2ull * hidden;
  return (uint64_t)num_tokens * per;
}

#ifdef __cplusplus
}
#endif

#endif /* DEP_STATS_PAGE_H */
