/*
 * cuda_ops.h — the cuda backend's MoE operations: the kernels in
 * kernels/ops.cu (one fatbin embedded in the library) and their launcher in
 * client/cuda_ops.c.  What the launcher and the kernels must agree on (the
 * kernel ABI) and the protocol on the GPU are proto/kabi.h's; this header
 * holds the launcher's entry points for client/ops.c and client/attach.c.
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

#include <stdbool.h>
#include <stdint.h>

#include "cudadrv.h"
#include "deepep.h"
#include "kabi.h"
#include "slab.h"

/* "1": load the library's own fatbin even where the daemon lends a compile
 * of it (the kernel cache): to measure the driver's own JIT, or to rule the
 * cache out; "0" or unset: take the daemon's where it has one. */
#define CUOPS_OWN_KERNELS_ENV "DEEPEP_OWN_KERNELS"

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
  uint32_t *host_from;            /* ... then the dispatch's rows from each source, */
  uint32_t host_from_cap;         /* ... room for this many (the world asked for), */
  int32_t *host_counts;           /* ... then where a dispatch's counts land for the caller
                                     (recv_count_per_expert_host), */
  uint32_t host_counts_cap;       /* ... room for this many (the job's local experts) */
  CUstream stream;                /* zeroes the private area, runs the warm-up; gone after attach */
  CUdeviceptr dev;                /* struct cuops_dev */
  CUdeviceptr world_arrays;       /* its counters per rank of the world (cuops_world_carve) */
  CUdeviceptr scratch;            /* warm-up outputs */
  CUdeviceptr stage;              /* FP8 tokens of an ll_dispatch: max_ll_tokens rows */
  CUdeviceptr tcnt;               /* the dispatch senders' counts (cuops_job.tcnt) */
  int sms;                        /* the GPU's SMs (cuda_ops_prepare) */
  uint64_t tcnt_bytes;            /* ... sized for the largest SM budget */
  CUdeviceptr loop_slab, loop_dev, loop_world; /* the warm-up's world of one */
  CUdeviceptr warm_mem;           /* ... and its handle's arrays */
  struct dep_handle *warm_h;      /* the warm-up's handle */
  bool lent_kernels;              /* the module is the daemon's compile (KERNELS), not the fatbin */
  void *stats_pinned;             /* the stats page as registered (cuda_ops_stats_bind), or NULL */
  void *ring_pinned;              /* the ring to the proxy and the exchange region after it, as
                                     registered (a job across nodes) */
  uint32_t grid;                  /* CTAs of a communicating kernel (dep__kernel_grid) */
  uint32_t ctas_per_sm;           /* of the kernels, for the job's world (shmem_fit) */
  struct cuops_job job;
};

struct dep_handle;

/*
 * Where the operations' memory sits in the rank's private area of its
 * slab: dep__slab_priv's carving (slab.h), for a GPU of `sms` SMs.  0, or
 * DEP_ERR_UNSUPPORTED with why for a GPU with more SMs than the area holds
 * scratch for (DEP_SLAB_MAX_SMS).  Every layout the daemon lends is one the
 * kernels run: whole blocks or channels, within a node and across nodes.
 */
int cuops_block_layout(const struct dep_job_shape *shape, uint32_t world,
                       const struct dep_slab_layout *lay, int sms, struct dep_slab_priv *out,
                       char *why, size_t whylen);

/*
 * At dep_attach on cuda, before anything goes on the wire or touches the
 * driver: a world larger than the kernels serve (DEP_MAX_WORLD; whether
 * the GPU gives its CTAs the shared memory the world needs is known once it
 * is bound: cuda_ops_attach) is DEP_ERR_UNSUPPORTED naming the limit; 0
 * otherwise.
 */
int cuda_ops_world_check(dep_client_t *c, const struct dep_attach_args *a);
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
int cuda_ops_ll_handle_info(dep_client_t *c, const struct dep_ll_handle_info_args *a,
                            const struct dep_handle *h, dep_stream_t s);

/* Masked ranks (deepep.h, kabi.h): this rank's own mask (c->ops.own) into the kernels'
 * cuops_job.own_mask, which every call launched after it reads; and the live mask's epoch
 * as it is in this rank's slab (device memory), and once an epoch is written its bits for
 * call (the join rule) or-ed into words (DEP_SLAB_MASK_WORDS(world) of them), for
 * dep_mask_query. */
int cuda_ops_mask_own(dep_client_t *c, const char *op);
int cuda_ops_mask_live(dep_client_t *c, const char *op, uint64_t call, uint64_t *epoch,
                       uint64_t *words);
/* The communicating calls the device has counted (cuops_dev.seq): those the
 * library launched and those replayed from CUDA graphs, once they ended. */
int cuda_ops_device_calls(dep_client_t *c, const char *op, uint64_t *calls);

#endif /* DEP_CUDA_OPS_H */
