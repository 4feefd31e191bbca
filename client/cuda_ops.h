/*
 * cuda_ops.h — the cuda backend's MoE operations: the kernels in
 * kernels/ops.cu (one fatbin embedded in the library) and their launcher in
 * client/cuda_ops.c.  The semantics, slot, row and error-record layouts are
 * the host backend's (kernels/host_ops.h); this header holds what both the
 * C launcher and the CUDA kernels must agree on (the kernel ABI), plus the
 * launcher's entry points for client/ops.c and client/attach.c.
 *
 * Protocol on the GPU (DESIGN §6, kernel rules):
 *   - The call counter lives in device memory (cuops_dev.seq): each
 *     communicating kernel reads it, uses seq + 1, and its last CTA to
 *     finish stores seq + 1.  Nothing a call needs comes from the host at
 *     launch time except pointers and num_tokens, so low-latency calls can
 *     be captured in a CUDA graph and replayed.
 *   - Push only: sender CTAs write rows into the peers' slabs, the last
 *     sender CTA of each destination fences (system scope) and stores the
 *     flag with st.release.sys; receiver CTAs wait with ld.acquire.sys.
 *     The throughput ops post the flag (with the row count) before the
 *     rows, and mark each row with the call in its meta word 3 after a
 *     system fence; receivers wait for the flag, then for each row's mark.
 *     Every rank posts to every rank on every call, zero rows included.
 *   - A rank on another node (cuops_job.remote_mask) is reached through
 *     this rank's daemon (DESIGN §7, proto/xring.h) and this rank's
 *     exchange region (proto/slab.h): host memory the daemon lent after
 *     the ring, which the library registered for the device.  The rows
 *     and slot for that rank go into the region's out block and out slot
 *     for it instead of a slab, and once every sender of that destination
 *     is done (the arrive counter), one thread fences at system scope and
 *     pushes a descriptor into the ring: a slot of the ring reserved with
 *     an atomic on the device, the descriptor written, then the ring's
 *     head published in reservation order.  A full ring is a bounded wait;
 *     a ring the proxy stopped serving fails the call with the proxy's
 *     code (CUOPS_PHASE_RING).  The daemon's proxy reads the block and
 *     slot with plain loads and sends them (TCP) or writes them (RDMA)
 *     into the exchange region of the remote rank, whose daemon (TCP)
 *     stores the block, then the slot, then the flag with release
 *     ordering, plain stores into host memory: no daemon copies into or
 *     out of GPU memory, so no call waits for the daemon's own context to
 *     get the GPU.  The receiving kernels read a remote source's slot and
 *     rows in the in slot and in block of their exchange region
 *     (recv_slot, recv_block: host memory over the mapping) and a local
 *     source's in their slab, with the same acquire loads at system
 *     scope, bounded waits, error records and abort polling.
 *   - Every wait is bounded by op_timeout_ms on %globaltimer.  A failure
 *     is claimed once (cuops_dev.claim) and recorded in pinned host memory
 *     (cuops_host.err, read by the library without a sync) and in the
 *     slab's error words; the kernel returns, it never traps.
 *   - A wait whose condition is not met after CUOPS_ABORT_POLL_NS also
 *     polls, every time it reads the clock, the abort code in this rank's
 *     own slab (CUOPS_ABORT_OFF: the daemon writes it when a rank of the
 *     running job is gone), so a dead peer fails the call within
 *     microseconds of the daemon noticing (DEP_ERR_PEER, CUOPS_PHASE_GONE)
 *     rather than after op_timeout_ms; waits shorter than that never load
 *     it, so the steady state pays nothing.  The flag or row is always
 *     checked first, and the abort counts only for a wait on the gone rank
 *     itself or while the gone rank has not posted this call: a peer that
 *     pushed its part and then left (it detached after its last call) is
 *     no error, not even for a wait on another, slower rank.
 *   - SM budget: every communicating kernel is world * P CTAs of
 *     CUOPS_THREADS threads, each of which first sends (part of the rows
 *     for one peer) then receives (in the throughput ops, work claimed
 *     from a counter, so that CTAs done sending early receive while others
 *     still push across NVLink).  P = max(1, B / world), where B, the
 *     rank's budget, is the GPU's SMs divided by the job's ranks on that
 *     GPU, at most CUOPS_MAX_CTAS: ranks sharing one GPU all fit at once
 *     (8 ranks on 132 SMs: 16 CTAs each), and a rank alone on its GPU
 *     leaves the rest of it to the trainer's kernels.  $DEEPEP_KERNEL_CTAS
 *     sets B for every rank (at most CUOPS_CTAS_PER_SM * SMs / ranks on the
 *     GPU, so that all stay resident).  "Ranks on the GPU" are the job's
 *     ranks that this rank's daemon holds there: daemons that share one GPU
 *     (a test of nodes on one machine) do not see each other's, and must
 *     be given a budget that fits them all.  Each lane keeps
 *     several 16-byte loads in flight (ops_dev.cuh), since a copy with one
 *     load in flight per thread runs at the memory's latency.
 *
 * What is checked where:
 *   - On the host, before any launch: everything ops_check_* checks that
 *     needs no look at device memory — the context, index_type, num_tokens
 *     against the job's bounds, use_fp8, every pointer non-NULL and aligned
 *     for its type, the handle's kind and job.
 *   - On the device: topk_idx values (an id outside [-1, num_experts) is
 *     DEP_ERR_INVALID through the error word and is treated as -1, so no
 *     memory is touched out of range), that ll_combine's topk_idx equals
 *     its dispatch's (DEP_ERR_INVALID), peers' ops, handles and row counts
 *     (DEP_ERR_MISMATCH; outputs then left unwritten), waits
 *     (DEP_ERR_TIMEOUT) and a rank the daemon found gone (DEP_ERR_PEER);
 *     the context is then broken.
 *   - Reporting: dep_dispatch synchronises its stream and returns the
 *     call's own error.  The other calls do not synchronise: an error the
 *     device recorded is returned by the next dep_* call on the handle
 *     (dep_dispatch also by itself).  DEP_ERR_INVALID and DEP_ERR_MISMATCH
 *     are reported once, then cleared; DEP_ERR_TIMEOUT and DEP_ERR_PEER
 *     make every later call DEP_ERR_STATE.
 *   Calls on one client must be ordered (one stream, or streams the caller
 *   orders), as on the host; its streams must be idle before dep_detach.
 *
 * Ranks in one process share the CUDA context, and the driver may make a
 * device-memory allocation or free (cuMemAlloc, cuMemFree, mapping slabs)
 * wait for running kernels.  A rank's kernels may be waiting for another
 * rank of the same process, so every such rank must have returned from
 * dep_attach and made its handles (dep_handle_new allocates their device
 * arrays) before any of them makes a call; until then a call times out.
 * The library itself allocates nothing on the operations' path once a
 * handle exists, and frees nothing before dep_detach / dep_handle_free.
 * Such ranks also need a hardware queue per stream: set
 * CUDA_DEVICE_MAX_CONNECTIONS (e.g. 32) at least to the number of streams
 * before CUDA starts, or a kernel queued behind another rank's kernel in a
 * shared queue waits for it (a false dependency) and the call times out.
 */
#ifndef DEP_CUDA_OPS_H
#define DEP_CUDA_OPS_H

#include <stdint.h>

#include "deepep.h"
#include "stats_page.h"

#define CUOPS_THREADS 256
#define CUOPS_WARPS (CUOPS_THREADS / 32)
#define CUOPS_MAX_RANKS DEP_MAX_LOCAL_RANKS
#define CUOPS_MAX_CTAS 96u
/* CTAs of one communicating kernel resident per SM (__launch_bounds__: ops_dev.cuh KERNEL). */
#define CUOPS_CTAS_PER_SM 2u
/* Overrides the SM budget (CTAs per communicating kernel) of every rank. */
#define CUOPS_CTAS_ENV "DEEPEP_KERNEL_CTAS"
/* "1": load the library's own fatbin even where the daemon lends a compile
 * of it (the kernel cache): to measure the driver's own JIT, or to rule the
 * cache out; "0" or unset: take the daemon's where it has one. */
#define CUOPS_OWN_KERNELS_ENV "DEEPEP_OWN_KERNELS"
/* Low-latency dispatch keeps per-(source, local expert) counts and offsets
 * in dynamic shared memory: 8 bytes per expert, within the 48 KiB a kernel
 * gets without opting in. */
#define CUOPS_LL_MAX_EXPERTS 4096u
#define CUOPS_LL_SHMEM(num_experts) (8u * (num_experts))

/* The host backend's op codes and layouts (host_ops.h), restated for the
 * C++ side; cuda_ops.c checks at compile time that they agree. */
#define CUOPS_OP_DISPATCH 1u
#define CUOPS_OP_COMBINE 2u
#define CUOPS_OP_LL_DISPATCH 3u
#define CUOPS_OP_LL_COMBINE 4u
#define CUOPS_OP_FP8 0x100u
#define CUOPS_OP_CACHED 0x200u
#define CUOPS_OP_WEIGHTS 0x400u
#define CUOPS_SLOT_BYTES 64u
#define CUOPS_ERR_BYTES 64u
/* The abort words in the error words (slab.h DEP_SLAB_ABORT_OFF, struct
 * dep_slab_abort): rank, pid, detached, then code, stored last. */
#define CUOPS_ABORT_OFF 48u
struct cuops_abort {
  uint32_t rank;
  uint32_t pid;
  uint32_t detached; /* slab.h's DEP_SLAB_GONE_*; CUOPS_GONE_NODE: every wait fails */
  int32_t code;
};
#define CUOPS_GONE_NODE 2u
/* How long a wait goes unmet before it polls the abort code too. */
#define CUOPS_ABORT_POLL_NS 20000u
/* The shape's limits that size kernel arrays (proto/shape.h; nvcc does not
 * see proto/, so cuda_ops.c holds these to it). */
#define CUOPS_MAX_TOKENS 65536u
#define CUOPS_MAX_TOPK 16u

/* Where a failure happened (cuops_err.phase). */
enum cuops_phase {
  CUOPS_PHASE_WAIT = 1,    /* waiting for a peer's flag */
  CUOPS_PHASE_AHEAD = 2,   /* a peer's flag is past this call: ranks out of step */
  CUOPS_PHASE_PEER = 3,    /* a peer made another call, or sent malformed rows */
  CUOPS_PHASE_IDS = 4,     /* the caller's topk_idx */
  CUOPS_PHASE_ROW = 5,     /* waiting for a peer's row (throughput ops) */
  CUOPS_PHASE_GONE = 6,    /* the abort words: source is the gone rank, seen_flag CUOPS_ERR_GONE */
  CUOPS_PHASE_WORST = 7,   /* dispatch: more rows arrived than num_worst_tokens (seen_flag: rows) */
  CUOPS_PHASE_RING = 8,    /* the proxy's ring: full past the timeout, or no longer served
                              (code: the proxy's); source is the destination rank */
};

/* CUOPS_PHASE_GONE's seen_flag: the gone rank's pid, and in bits 32-33
 * how it went, the abort words' detached (host_ops.h's OPS_ERR_GONE). */
#define CUOPS_ERR_GONE(pid, detached) \
  ((uint64_t)(uint32_t)(pid) | ((uint64_t)((detached) & 3u) << 32))

/* The proxy's ring (proto/xring.h, which nvcc does not see: cuda_ops.c
 * holds these to it): the offsets of head, tail, failed and the
 * descriptors in struct dep_xring, its entries, and one descriptor. */
#define CUOPS_XRING_HEAD_OFF 64u
#define CUOPS_XRING_TAIL_OFF 128u
#define CUOPS_XRING_FAILED_OFF 192u
#define CUOPS_XRING_DESC_OFF 256u
#define CUOPS_XRING_ENTRIES 1024u
struct cuops_xdesc {
  uint32_t dest, parity;
  uint64_t seq, bytes, reserved;
};

/* An ops_err_record (host_ops.h) with its reserved word used for phase. */
struct cuops_err {
  int32_t code;
  uint32_t op;
  uint32_t rank;
  uint32_t source;
  uint64_t seq;
  uint64_t seen_flag;
  uint32_t waited_ms;
  uint32_t phase;
};

/* Pinned host memory mapped for the device: written by kernels, read by the library. */
struct cuops_host {
  struct cuops_err err;            /* code stored last */
  uint32_t num_recv;               /* dispatch: rows received */
  uint32_t recv_from[CUOPS_MAX_RANKS]; /* dispatch: rows from each source */
};

/* Device scratch of one client. */
struct cuops_dev {
  uint64_t seq;                    /* communicating calls made */
  uint32_t done;                   /* CTAs finished in the running launch */
  uint32_t claim;                  /* 1 once a failure is recorded */
  uint32_t broken;                 /* 1 after a timeout: kernels do nothing */
  uint32_t pad;
  uint32_t arrive[CUOPS_MAX_RANKS]; /* sender CTAs done per destination */
  uint32_t bar_count, bar_gen;     /* the dispatch's grid barrier (ops_tp.cuh grid_meet) */
  uint32_t ticket;                 /* the throughput ops' receive work, claimed; 0 between calls */
  int32_t code;                    /* the failure rec_fail recorded in the running call, for its
                                      stats entry; 0 between calls */
  uint32_t layout_done;            /* CTAs of the running layout finished */
  uint64_t layouts;                /* layouts made (the stats page's layout ring) */
  /* The proxy's ring: descriptors reserved, published (its head as this
   * rank last stored it) and known taken (its tail as last read). */
  unsigned long long xr_next, xr_pub, xr_tail;
  /* Per remote source: the call whose flag CTA 0 last saw in the exchange
   * region (CUOPS_XSEEN_FAILED set: that wait failed), for the other CTAs
   * to wait on in device memory (ops_dev.cuh wait_peers). */
  unsigned long long xseen[CUOPS_MAX_RANKS];
};
#define CUOPS_XSEEN_FAILED (1ull << 63)

/* One rank's view of its job, passed by value to every kernel. */
struct cuops_job {
  uint8_t *slabs[CUOPS_MAX_RANKS]; /* every local rank's slab (device pointers), by rank;
                                      NULL for a rank on another node */
  uint64_t data_off, block_bytes, parity_bytes, row_bytes;
  /* A job that spans nodes: bit r set for each rank on another node; the
   * ring to the daemon's proxy and the exchange region after it (device
   * addresses of the registered host mapping, xring.h), and the offsets in
   * the region of its in slots, out slots, in blocks and out blocks
   * (slab.h: by parity and the rank's number among the remote ones). */
  uint64_t remote_mask, in_slot_off, out_slot_off, in_off, out_off;
  uint32_t n_remote, pad0;
  uint8_t *ring;
  uint8_t *xchg;
  uint32_t world, rank, hidden, topk, num_experts, le, kd, max_tokens, max_ll, parts;
  uint32_t *tcnt;                  /* dispatch: [world][parts * warps] rows counted, scratch */
  uint64_t timeout_ns;
  struct cuops_host *host;         /* device address of the pinned block */
  struct cuops_dev *dev;
  /* Device address of the stats page (stats_page.h), pinned, or NULL: the
   * last CTA of each call writes its entry there (ops_dev.cuh stats_call). */
  struct dep_stats_page *stats;
};

/* dep__k_touch: the bytes of each slab to touch. */
struct cuops_touch_args {
  uint64_t bytes;
};

/* A handle's device arrays (one allocation). */
struct cuops_hdl {
  uint64_t *seq;       /* [1] call number of the dispatch */
  int32_t *tp_pos;     /* [max_tokens * world] row of token t at rank d, -1 if not sent */
  uint32_t *tp_sent;   /* [world] rows sent to each rank */
  uint32_t *tp_from;   /* [world] rows received from each rank */
  int32_t *ll_route;   /* [max_ll * topk * 2] {expert, vector index at its rank} */
  uint32_t *ll_expect; /* [world] vectors each rank owes back */
  uint32_t *ll_rows;   /* [world] rows received from each rank */
  int32_t *ll_nids;    /* [world * max_ll] distinct experts of each received row */
  int32_t *ll_map;     /* [world * max_ll * kd * 2] {local expert, row} of each (row, id) */
};

struct cuops_layout_args {
  const void *idx;
  int32_t itype;
  uint32_t num_tokens;
  int32_t *tpr, *tpe;
  uint8_t *tir;
};

/* A dispatch (deepep.h): bf16 or FP8 rows (fp8: x is e4m3 bytes, xs their
 * scales), fresh or routed by the handle (cached), outputs of `worst` rows
 * or of the rows received (worst 0); align > 1 rounds the counts
 * (dep__k_align, launched after it); ridx holds int32 ids, or int64 with
 * ri64 (recv_index_type DEP_INDEX_I64). */
struct cuops_dispatch_args {
  const void *x, *idx;
  const float *w;
  int32_t itype;
  uint32_t num_tokens;
  void *rx;
  void *ridx;
  float *rw;
  int32_t *cnt;
  const float *xs;
  float *rxs;
  int32_t fp8, cached;
  uint32_t worst, align;
  int32_t ri64;
  uint32_t pad;
  struct cuops_hdl h;
};

/* w/ow: DeepEP's combine of weights (ow NULL: none; w NULL only with no rows),
 * w [rows, topk], ow [num_tokens, topk]. */
struct cuops_combine_args {
  const void *x;
  void *out;
  uint32_t num_tokens;
  uint32_t pad;
  const float *w;
  float *ow;
  struct cuops_hdl h;
};

struct cuops_ll_dispatch_args {
  const void *x, *idx;
  int32_t itype;
  uint32_t num_tokens;
  int32_t fp8;
  uint32_t pad;
  void *rx;
  float *rs;
  int32_t *cnt;
  uint8_t *stage;      /* FP8: this rank's tokens, cast once (dep__k_ll_cast), CUOPS_STAGE_ROW each */
  struct cuops_hdl h;
};

/* A staged FP8 token: hidden bytes of e4m3, then hidden / 128 float32 scales (the row's layout). */
#define CUOPS_STAGE_ROW(hidden) ((((uint64_t)(hidden) + (hidden) / 32u) + 15u) & ~(uint64_t)15u)

struct cuops_ll_combine_args {
  const void *x, *idx;
  int32_t itype;
  uint32_t num_tokens;
  const float *w;
  void *out;
  struct cuops_hdl h;
};

/* Kernel names in the fatbin, in the order of cuops_state.fn[]. */
#define CUOPS_KERNELS(XX)                  \
  XX(LAYOUT, "dep__k_layout")               \
  XX(DISPATCH, "dep__k_dispatch")           \
  XX(COMBINE, "dep__k_combine")             \
  XX(LL_DISPATCH, "dep__k_ll_dispatch")     \
  XX(LL_COMBINE, "dep__k_ll_combine")       \
  XX(LL_CAST, "dep__k_ll_cast")              \
  XX(ALIGN, "dep__k_align")                 \
  XX(TOUCH, "dep__k_touch")

#ifndef __CUDACC__
#include <stdbool.h>

#include "cudadrv.h"
#include "slab.h"

enum cuops_kernel {
#define CUOPS__ENUM(name, sym) CUOPS_K_##name,
  CUOPS_KERNELS(CUOPS__ENUM)
#undef CUOPS__ENUM
  CUOPS_K_COUNT
};

/* The cuda backend's state in a client handle (client_internal.h). */
struct cuops_state {
  bool prepared;                  /* module loaded, memory made (cuda_ops_prepare) */
  bool ready;                     /* ... and bound to the job's slabs (cuda_ops_attach) */
  bool broken;                    /* a wait timed out: ranks out of step */
  CUcontext ctx;
  CUmodule mod;
  CUfunction fn[CUOPS_K_COUNT];
  struct cuops_host *host;        /* registered pages, host address: the error record, */
  CUdeviceptr host_dev;           /* ... and its device address */
  size_t host_bytes;              /* ... their length */
  int32_t *host_counts;           /* ... then where a dispatch's counts land for the caller
                                     (recv_count_per_expert_host), */
  uint32_t host_counts_cap;       /* ... room for this many (the job's local experts) */
  CUstream stream;                /* zeroes the next six, runs the warm-up; gone after attach */
  CUdeviceptr dev;                /* struct cuops_dev */
  CUdeviceptr scratch;            /* warm-up outputs */
  CUdeviceptr stage;              /* FP8 tokens of an ll_dispatch: max_ll_tokens rows */
  CUdeviceptr tcnt;               /* the dispatch senders' counts (cuops_job.tcnt) */
  int sms;                        /* the GPU's SMs (cuda_ops_prepare) */
  uint64_t tcnt_bytes;            /* ... sized for the largest SM budget */
  CUdeviceptr loop_slab, loop_dev; /* the warm-up's world of one */
  CUdeviceptr warm_mem;           /* ... and its handle's arrays */
  struct dep_handle *warm_h;      /* the warm-up's handle */
  bool lent_kernels;              /* the module is the daemon's compile (KERNELS), not the fatbin */
  void *stats_pinned;             /* the stats page as registered (cuda_ops_stats_bind), or NULL */
  void *ring_pinned;              /* the ring to the proxy and the exchange region after it, as
                                     registered (a job across nodes) */
  struct cuops_job job;
};

struct dep_handle;

/*
 * Where the operations' memory sits in the rank's private area of its
 * slab (slab.h), as offsets from the area's start: the kernels' counters,
 * the warm-up's outputs, the FP8 staging rows, the dispatch's count
 * scratch (sized for a GPU of `sms` SMs), the warm-up's world of one and
 * its handle.  0, or DEP_ERR_INTERNAL with why when it would overrun the
 * area.
 */
struct cuops_block {
  uint64_t dev, scratch, stage, tcnt, tcnt_bytes, loop_dev, loop_slab, warm_handle, end;
};
int cuops_block_layout(const struct dep_job_shape *shape, uint32_t world,
                       const struct dep_slab_layout *lay, int sms, struct cuops_block *out,
                       char *why, size_t whylen);

/*
 * The SM budget of one rank: CTAs per communicating kernel, the GPU's sms
 * shared out among the `sharing` ranks of the job on it, at most
 * CUOPS_MAX_CTAS; or env (the value of $DEEPEP_KERNEL_CTAS; NULL or "" for
 * none), from 1 to what keeps every rank resident at once.  0 with *out,
 * or DEP_ERR_INVALID with why saying the bounds.
 */
int cuops_sm_budget(int sms, uint32_t sharing, const char *env, uint32_t *out, char *why,
                    size_t whylen);
/* The largest budget of a rank that keeps every one of the `sharing` ranks resident. */
uint32_t cuops_most_ctas(int sms, uint32_t sharing);

/*
 * At dep_attach on cuda, right after ATTACH is sent (so that it runs while
 * the daemon waits for the other local ranks and lends the memory): load
 * the embedded fatbin and every kernel, pin the error record, make the
 * private stream.  Needs the context current, c->args and c->layout.  A
 * build without nvcc attaches all the same; its operations then return
 * DEP_ERR_UNSUPPORTED.
 */
int cuda_ops_prepare(dep_client_t *c);
/*
 * Before ATTACH is sent, on cuda: where this library's fatbin has no SASS
 * for the rank's GPU, ask the daemon for its compile of these kernels
 * (KERNELS) and map it for cuda_ops_prepare to load instead of the PTX.
 * A daemon without one (or of another build, driver or architecture) is
 * no error: the fatbin is loaded as before.  0, or the connection's
 * failure (DEP_ERR_DAEMON_GONE, ...) or DEP_ERR_INVALID for a bad
 * $DEEPEP_OWN_KERNELS.
 */
int cuda_ops_fetch_kernels(dep_client_t *c);
/* Unmap what cuda_ops_fetch_kernels mapped, if it is still there. */
void cuda_ops_drop_kernels(dep_client_t *c);
/*
 * At the end of dep_attach, once the warm-up has run: register the rank's
 * stats page (c->stats, statrec.h) for the device and hand it to the
 * kernels, which log each call there on the GPU's timer.  Without a page,
 * or when registering fails, the kernels log nothing (no error: stats are
 * an observation, never a reason to fail an attach).  cuda_ops_detach
 * unregisters it.
 */
void cuda_ops_stats_bind(dep_client_t *c);
/*
 * Then, after the slabs are mapped and c->ops is set up: place the
 * operations' memory in this rank's private area of its slab (zeroed on
 * the private stream), bind the kernels to the job (slabs, SM budget) and
 * with kernel_warmup run every kernel
 * once on zero tokens, on a private loopback world of one rank (no peer,
 * no write to the job's slabs, the job's call count untouched).
 */
int cuda_ops_attach(dep_client_t *c);
/* Undo cuda_ops_attach (client_unmap); safe on a zeroed state. */
void cuda_ops_detach(dep_client_t *c);
/*
 * This rank's daemon is gone in a job that spans nodes (client/watch.c, on
 * its own thread): write the abort words of this rank's slab, device
 * memory, as host_ops_daemon_gone writes a host slab's (slab.h
 * DEP_SLAB_GONE_DAEMON, code last), unless the daemon wrote them first, so
 * that a kernel waiting for any rank fails within microseconds.  The
 * copies go on a stream of their own that does not synchronise with the
 * legacy default stream, so a kernel spinning on the caller's stream does
 * not hold them up.  A driver failure leaves the op timeout as the bound.
 */
void cuda_ops_daemon_gone(dep_client_t *c);
/* Make a new handle's device arrays now (dep_handle_new on an attached cuda
 * client), rather than in its first dispatch, or carve them in h->mem (a
 * dep_handle_new_in handle); a no-op without kernels. */
int cuda_ops_handle_new(dep_client_t *c, struct dep_handle *h, const char *op);
/* The bytes of a handle's device arrays in the attached job, as
 * handle_reserve carves them (dep_handle_bytes on cuda); DEP_ERR_UNSUPPORTED
 * without kernels. */
int cuda_ops_handle_bytes(dep_client_t *c, const char *op, uint64_t *bytes);
/* 0 when the driver says [mem, mem + bytes) begins and ends in device
 * memory of the rank's GPU, else DEP_ERR_INVALID saying what it is. */
int cuda_ops_handle_mem_check(dep_client_t *c, const char *op, const void *mem,
                              uint64_t bytes);
/* Free a handle's device arrays (dep_handle_free). */
void cuda_ops_handle_free(struct dep_handle *h);

int cuda_ops_layout(dep_client_t *c, const struct dep_layout_args *a, dep_stream_t s);
int cuda_ops_dispatch(dep_client_t *c, const struct dep_dispatch_args *a, struct dep_handle *h,
                      dep_stream_t s);
int cuda_ops_combine(dep_client_t *c, const struct dep_combine_args *a, const struct dep_handle *h,
                     dep_stream_t s);
int cuda_ops_ll_dispatch(dep_client_t *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h, dep_stream_t s);
int cuda_ops_ll_combine(dep_client_t *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h, dep_stream_t s);
#endif /* !__CUDACC__ */

#endif /* DEP_CUDA_OPS_H */
