/*
 * deepep.h — the public C API of libdeepep-client.
 *
 * A trainer process (one MoE rank) links this library to attach to the
 * node's deepepd: it connects over a Unix socket, negotiates the protocol,
 * registers its rank in a job, and receives the job's warm memory as file
 * descriptors.  Every function returns 0 (DEP_OK) or a negative DEP_ERR_*
 * code; the detailed message of the last failure on a handle is available
 * from dep_errmsg().  The library never prints and never exits.
 *
 * Handles are independent: several ranks may live in one process, one
 * dep_client_t each.  A handle must not be used from two threads at once.
 */
#ifndef DEEPEP_H
#define DEEPEP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define DEP_EXPORT __attribute__((visibility("default")))
#else
#define DEP_EXPORT
#endif

/* Library version; the wire protocol has its own version (proto/proto.h). */
#define DEP_VERSION_MAJOR 0
#define DEP_VERSION_MINOR 6
#define DEP_VERSION_PATCH 10
#define DEP_VERSION_STRING "0.6.10"

/* Where the daemon listens unless the caller or $DEEPEPD_SOCKET says otherwise. */
#define DEP_DEFAULT_SOCKET "/run/deepepd/deepepd.sock"
#define DEP_SOCKET_ENV "DEEPEPD_SOCKET"

/*
 * The one error table.  The wire carries the same numbers, so a code never
 * changes meaning once released; new codes are appended.
 *   XX(NAME, value, "short description")
 */
#define DEP_ERRNO_MAP(XX)                                                        \
  XX(OK, 0, "success")                                                           \
  XX(INVALID, -1, "invalid argument")                                            \
  XX(NO_MEMORY, -2, "out of memory (host, pool or device)")                      \
  XX(TIMEOUT, -3, "timed out")                                                   \
  XX(DAEMON_GONE, -4, "connection to deepepd lost")                              \
  XX(NO_DAEMON, -5, "deepepd is not running")                                    \
  XX(VERSION, -6, "protocol version mismatch")                                   \
  XX(PERMISSION, -7, "permission denied")                                        \
  XX(PROTOCOL, -8, "malformed or unexpected message")                            \
  XX(EXISTS, -9, "already exists")                                               \
  XX(NOT_FOUND, -10, "not found")                                                \
  XX(LIMIT, -11, "limit reached")                                                \
  XX(MISMATCH, -12, "job parameters disagree between ranks")                     \
  XX(CUDA, -13, "CUDA driver error")                                             \
  XX(IO, -14, "I/O error")                                                       \
  XX(CONFIG, -15, "configuration error")                                         \
  XX(UNSUPPORTED, -16, "not supported by this build or backend")                 \
  XX(STATE, -17, "operation not valid in the current state")                     \
  XX(INTERNAL, -18, "internal error")                                            \
  XX(PEER, -19, "a rank or node of the job failed")

typedef enum dep_err {
#define DEP__ERR_ENUM(name, val, desc) DEP_ERR_##name = (val),
  DEP_ERRNO_MAP(DEP__ERR_ENUM)
#undef DEP__ERR_ENUM
} dep_err_t;
#define DEP_OK DEP_ERR_OK

/* A fixed description of an error code ("unknown error" for others). */
DEP_EXPORT const char *dep_strerror(int err);
/* The symbolic name of an error code, e.g. "DEP_ERR_TIMEOUT". */
DEP_EXPORT const char *dep_errname(int err);

/*
 * Structs grow.  Every struct passed to or filled by the library begins
 * with `uint32_t size`: for one the caller passes or fills in (argument
 * structs, dep_attach_info, dep_attach_times, dep_shape_sizes), the caller
 * sets it to sizeof the struct it was compiled with (designated
 * initializers: `{.size = sizeof(struct dep_attach_args), ...}`).  The
 * library reads only the fields that size covers and takes the rest as 0;
 * into one it fills it writes only what size covers, and writes back into
 * `size` the bytes it filled (the smaller of the two structs).  So a caller
 * built against an older deepep.h keeps working, and a newer one can tell
 * which fields an older library filled.  A size of 0 or below the struct's first layout is
 * DEP_ERR_INVALID, as is one above 4096 (no struct here comes near it: such a
 * size was never set with sizeof, and the library does not read that far past
 * the struct), and a newer caller's larger struct is
 * DEP_ERR_UNSUPPORTED unless the fields this library does not know are all
 * zero.  Fields are only ever appended, and never into the tail padding of
 * an earlier layout (its callers may leave those bytes unset, and their
 * size covers them): such bytes become a `reserved` field the library does
 * not read.  dep_status, which the library
 * allocates, learns the caller's sizes from the dep_status() macro (as
 * zlib's inflateInit does) and reports in its size fields what it filled.
 * dep_job_shape is the one exception: it is embedded in dep_attach_args and
 * never grows; new job-wide fields are appended to dep_attach_args.
 */

/* ---- connection --------------------------------------------------------- */

typedef struct dep_client dep_client_t;

/* Allocate an unconnected handle.  DEP_ERR_NO_MEMORY or DEP_ERR_INVALID. */
DEP_EXPORT int dep_client_new(dep_client_t **out);
/* Close the connection (detaching if attached) and free the handle; on cuda,
 * give back the handle's reference to the GPU's primary context, if it holds one. */
DEP_EXPORT void dep_client_free(dep_client_t *c);
/* The message of the last failure on this handle ("" if none). */
DEP_EXPORT const char *dep_errmsg(const dep_client_t *c);

/*
 * Connect and say HELLO.  socket_path NULL means $DEEPEPD_SOCKET, else
 * DEP_DEFAULT_SOCKET.  A missing daemon is DEP_ERR_NO_DAEMON with a message
 * naming the path and how to start the daemon.
 */
DEP_EXPORT int dep_connect(dep_client_t *c, const char *socket_path);

/* ---- status --------------------------------------------------------------- */

#define DEP_UUID_STR_LEN 37 /* "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" + NUL */
#define DEP_JOB_ID_MAX 64   /* including the NUL */

/* An element of dep_status.devices; its size is dep_status.device_size. */
struct dep_status_device {
  char uuid[DEP_UUID_STR_LEN]; /* device UUID, text form */
  char name[64];               /* e.g. "NVIDIA H200" or "host" */
  char backend[8];             /* "cuda" or "host" */
  uint64_t pool_total_bytes;   /* made (or to be made) for this device */
  uint64_t pool_used_bytes;    /* lent to live jobs */
  uint64_t pool_cached_bytes;  /* scrubbed slabs kept for the next job */
  /* Of the budget, memory no live job holds but processes it was lent to
   * still may (they keep it until they exit), or that a stopped deepepd
   * lent to processes still running: charged, not lendable to other users. */
  uint64_t pool_held_bytes;
};

/* An element of dep_status.jobs; its size is dep_status.job_size. */
/* dep_status_job.mask's size: the masked ranks as ranges, cut with "..." past it. */
#define DEP_STATUS_MASK_TEXT 128
struct dep_status_job {
  char job_id[DEP_JOB_ID_MAX];
  uint32_t owner_uid;
  uint32_t ranks_attached; /* local ranks attached now */
  uint32_t ranks_expected; /* local world size */
  uint32_t world_size;
  uint64_t slab_bytes;     /* per rank */
  uint64_t age_ms;
  uint64_t host_bytes;     /* per rank: the pinned host memory of a job across nodes (its
                              ring and exchange region); 0 for a job on one node */
  uint32_t flags;          /* its dep_attach_args.flags (DEP_ATTACH_ELASTIC) */
  uint32_t masked;         /* ranks of its world masked now (elastic jobs) */
  uint64_t epoch;          /* its live mask's epoch: 0 until a rank is masked or rejoins */
  char mask[DEP_STATUS_MASK_TEXT]; /* the masked ranks, "3,5-7" ("...": cut) */
  uint32_t chunk_rows;     /* the rows of its channels' chunks (stream_chunk_rows, or the
                              daemon's choice under auto); 0: whole blocks */
};

struct dep_status {
  /* Bytes the library filled of this struct and of each element of devices
   * and jobs: the smaller of the caller's and the library's sizeof.  The
   * arrays are laid out with the caller's element size as stride, so
   * devices[i] and jobs[i] index them as compiled. */
  uint32_t size;
  uint32_t device_size;
  uint32_t job_size;
  char version[32];        /* daemon version string */
  /* "starting" (pools being made: attach waits), "ready", "draining" (no new
   * jobs; running ones go on) or "stopping" */
  char state[16];
  uint32_t proto_version;
  uint32_t pid;
  uint64_t uptime_ms;
  char backend[8];         /* "cuda" or "host" */
  uint32_t num_clients;    /* connections open now */
  uint32_t num_devices;
  uint32_t num_jobs;
  struct dep_status_device *devices;
  struct dep_status_job *jobs;
};

/*
 * Ask the daemon for its status.  Free the result with dep_status_free().
 * dep_status() is a macro that passes the caller's sizeof of the three
 * structs to dep_status_sized (callers through an FFI call that with their
 * own sizes); a size below a struct's first layout is DEP_ERR_INVALID.
 */
DEP_EXPORT int dep_status_sized(dep_client_t *c, struct dep_status **out, uint32_t size,
                                uint32_t device_size, uint32_t job_size);
#define dep_status(c, out)                                                                 \
  dep_status_sized((c), (out), sizeof(struct dep_status), sizeof(struct dep_status_device), \
                   sizeof(struct dep_status_job))
DEP_EXPORT void dep_status_free(struct dep_status *st);

/* ---- attach ---------------------------------------------------------------- */

#define DEP_MAX_WORLD 4096
#define DEP_MAX_LOCAL_RANKS 64

enum dep_dtype { DEP_DTYPE_BF16 = 1, DEP_DTYPE_FP8_E4M3 = 2 };

/* The shape a job's memory is sized for (DESIGN §4). */
struct dep_job_shape {
  uint32_t max_tokens_per_rank; /* 1 .. 65536 */
  uint32_t hidden;              /* multiple of 128, up to 16384 */
  uint32_t num_experts;         /* divisible by world_size */
  uint32_t topk;                /* 1 .. 16 */
  uint32_t dtype;               /* enum dep_dtype */
  /* Low-latency mode's per-rank token bound (its receive buffers scale with
   * it times topk); 0 means min(max_tokens_per_rank, 256). */
  uint32_t max_ll_tokens_per_rank;
};

struct dep_attach_args {
  uint32_t size;                 /* sizeof(struct dep_attach_args) */
  char job_id[DEP_JOB_ID_MAX];   /* shared by every rank of the job; [A-Za-z0-9._:-] */
  uint32_t rank;                 /* global rank, < world_size */
  uint32_t world_size;
  uint32_t local_rank;           /* < local_world_size */
  uint32_t local_world_size;     /* ranks of this job on this node */
  uint8_t device_uuid[16];       /* the GPU this rank uses; all zero on the host backend */
  struct dep_job_shape shape;
  /* DEP_ATTACH_* bits, the same on every rank of the job (a rank that
   * differs is refused, DEP_ERR_MISMATCH, naming the flag); other bits are
   * DEP_ERR_INVALID. */
  uint32_t flags;
};

/*
 * An elastic job (DESIGN §14): a rank that dies or detaches does not end
 * it.  The daemons mask the rank instead (its bit in every survivor's live
 * mask, slab.h, and a new epoch), every node alike, and hold its memory
 * for a process that attaches later with its rank (deepepctl status shows
 * each job's epoch, mask and history).  Without it a rank that goes fails
 * every wait on it with DEP_ERR_PEER, as before.
 */
#define DEP_ATTACH_ELASTIC 0x1u
/* Every DEP_ATTACH_* bit this library knows. */
#define DEP_ATTACH_FLAGS_KNOWN DEP_ATTACH_ELASTIC

/*
 * Register this rank in its job and wait until every local rank of the job
 * has attached (or the daemon's attach timeout passes: DEP_ERR_TIMEOUT).
 */
DEP_EXPORT int dep_attach(dep_client_t *c, const struct dep_attach_args *args);
/* Leave the job; the connection stays open for another attach. */
DEP_EXPORT int dep_detach(dep_client_t *c);

/*
 * What an attached rank holds: its own slab and every local peer's, mapped
 * into this process (device pointers on the cuda backend, host pointers on
 * the host backend).  Valid until dep_detach / dep_client_free.  The
 * operations own the slabs' contents; on cuda each slab ends in its rank's
 * private area, where that rank's library keeps the operations' state.
 */
struct dep_attach_info {
  uint32_t size;                       /* sizeof(struct dep_attach_info) */
  char backend[8];                     /* "cuda" or "host" */
  uint64_t slab_bytes;                 /* mapped bytes of each slab */
  uint32_t local_rank;
  uint32_t local_world_size;
  void *slabs[DEP_MAX_LOCAL_RANKS];    /* indexed by local rank; slabs[local_rank] is ours */
  uint32_t ranks[DEP_MAX_LOCAL_RANKS]; /* global rank of each local rank */
  double attach_ms;                    /* connect-side time spent in dep_attach */
};

/* Fill `out` (out->size set) for an attached handle; DEP_ERR_STATE when not attached. */
DEP_EXPORT int dep_attach_info(dep_client_t *c, struct dep_attach_info *out);

/*
 * Where the last dep_attach's time went, in milliseconds.  setup runs
 * while the daemon waits for the other local ranks, so wait is the part
 * of the rendezvous that setup did not cover (0 when setup took longer).
 */
struct dep_attach_times {
  uint32_t size;    /* sizeof(struct dep_attach_times) */
  double total_ms;  /* the whole of dep_attach (dep_attach_info's attach_ms) */
  double wait_ms;   /* ATTACH sent until the daemon's reply was in, less setup and map */
  double map_ms;    /* importing and mapping every local slab */
  double setup_ms;  /* cuda: loading the kernels and making their memory (0 on host) */
  double warmup_ms; /* kernel_warmup: cuda, running every kernel once; host, mapping in the
                       slabs' pages the calls touch, which runs after dep_attach returns and
                       which dep_attach_times finishes first; 0 without it */
};

/* Fill `out` (out->size set) for an attached handle; DEP_ERR_STATE when not attached. */
DEP_EXPORT int dep_attach_times(dep_client_t *c, struct dep_attach_times *out);


/* ---- dispatch / combine (DESIGN §6) ----------------------------------------
 * One call per operation, each taking the caller's CUDA stream (a CUstream /
 * cudaStream_t; ignored on the host backend).  On the cuda backend every
 * pointer argument is device memory; on the host backend host memory.
 * Arguments are checked before anything runs: DEP_ERR_INVALID names the bad
 * one.  A peer that never arrives is DEP_ERR_TIMEOUT after the daemon's
 * op timeout, never a hang; one the daemon saw go (its process ended, or
 * it detached, while the job ran) is DEP_ERR_PEER within milliseconds.
 * The operations of a job on one node need no daemon: they go on if it
 * stops (DESIGN §13).  A job that spans nodes moves its blocks between
 * nodes through the daemon: when this node's daemon stops, restarts or
 * dies, a waiting call fails within milliseconds, and every later one at
 * once, with DEP_ERR_DAEMON_GONE (a thread of the library, one per handle
 * attached to such a job, watches the connection); re-attach.
 * Experts are owned in contiguous blocks: expert
 * e lives on rank e / (num_experts / world_size).
 */
typedef void *dep_stream_t;

enum dep_index_type { DEP_INDEX_I64 = 1, DEP_INDEX_I32 = 2 };

/* Argument structs begin with `size` and grow as "Structs grow" above says. */

/*
 * What dispatch leaves for the matching combine (opaque, reusable).
 * dep_handle_new makes one whose arrays the library allocates (on cuda a
 * cuMemAlloc, at dep_handle_new when attached, else at its first
 * dispatch); dep_handle_free frees it with them.  A handle holds the
 * dispatch of one attachment: after the next dep_attach, a combine, LL
 * combine or cached dispatch with it is DEP_ERR_INVALID until a dispatch
 * fills it again.
 */
typedef struct dep_handle dep_handle_t;
DEP_EXPORT int dep_handle_new(dep_client_t *c, dep_handle_t **out);
DEP_EXPORT void dep_handle_free(dep_handle_t *h);

/*
 * A handle whose arrays live in memory the caller lends (appended in
 * 0.4.0): for a caller in which the library must not allocate, as on cuda
 * while its stream captures a CUDA graph (cuMemAlloc is not allowed then;
 * a binding serves the memory from its own allocator, torch's from the
 * graph's pool), so that a capture may hold as many dispatches as it likes.
 *
 * dep_handle_bytes: the bytes such a handle takes in the attached job (the
 * backend's arrays for its shape and world size; the same until the next
 * dep_attach).  DEP_ERR_STATE when not attached; where the operations are
 * DEP_ERR_UNSUPPORTED (on cuda without kernels, a job spanning nodes on a
 * daemon with no peers), so is this, with their message.
 *
 * dep_handle_new_in: a handle whose arrays are the first dep_handle_bytes
 * bytes at mem.  mem is DEP_HANDLE_ALIGN-byte aligned (cuMemAlloc's,
 * cudaMalloc's and torch's allocations are; malloc's are not: use
 * aligned_alloc), at least dep_handle_bytes long (bytes says how long it
 * is), and reachable from the operations: on cuda device memory of the
 * rank's GPU (the library asks the driver, cuPointerGetAttribute, and
 * refuses a host pointer or another GPU's memory), on the host backend
 * this process's memory.  It needs no initialising (a dispatch writes
 * every element before anything reads it).  The library writes nothing
 * outside those bytes and never frees them: mem must stay valid until
 * dep_handle_free, and on cuda until the last kernel queued with the
 * handle has run (for a captured one: for as long as the graph may be
 * replayed).  dep_handle_free frees only the library's host-side state.
 * The handle is used as one of dep_handle_new (one lent memory holds one
 * handle); after a dep_attach to a job whose handles take more than bytes,
 * a dispatch into it is DEP_ERR_INVALID (make a new one).  NULL c or out,
 * NULL or misaligned mem, bytes too small: DEP_ERR_INVALID naming it; not
 * attached: DEP_ERR_STATE.
 *
 * Two calls rather than a field of dep_shape_sizes, because the size is
 * the backend's (cuda's arrays are not the host's) and known at attach;
 * two scalar arguments rather than an argument struct: nothing to grow
 * (a later need is a new function).
 */
#define DEP_HANDLE_ALIGN 256
DEP_EXPORT int dep_handle_bytes(dep_client_t *c, size_t *bytes);
DEP_EXPORT int dep_handle_new_in(dep_client_t *c, void *mem, size_t bytes, dep_handle_t **out);

/*
 * The rows a throughput dispatch into h received from each source rank
 * (added in 0.4.2): out[s] for s in 0..world_size-1, in rank order,
 * the rows being contiguous by source (DeepEP's rank prefix matrix's
 * column of this rank is their running sum).  n is out's length, at least
 * world_size.  NULL c, h or out, n too small, or a handle that holds no
 * dep_dispatch of this attachment (empty, a low-latency one's, an earlier
 * attachment's): DEP_ERR_INVALID; not attached: DEP_ERR_STATE, as after a
 * dispatch with num_worst_tokens on cuda (which never waits, so the counts
 * stay on the device).  A cached dispatch leaves them as they were.
 */
DEP_EXPORT int dep_handle_recv_from(dep_client_t *c, const dep_handle_t *h, uint32_t *out,
                                    uint32_t n);

/* layout: from topk_idx, tokens per rank, tokens per expert, token-in-rank mask. */
struct dep_layout_args {
  uint32_t size;               /* sizeof(struct dep_layout_args) */
  const void *topk_idx;        /* [num_tokens, topk] */
  int index_type;              /* enum dep_index_type */
  uint32_t num_tokens;
  int32_t *tokens_per_rank;    /* out [world_size] */
  int32_t *tokens_per_expert;  /* out [num_experts] */
  uint8_t *token_in_rank;      /* out [num_tokens, world_size], 0/1 */
};
DEP_EXPORT int dep_layout(dep_client_t *c, const struct dep_layout_args *a, dep_stream_t stream);

/*
 * Throughput-mode dispatch.  The hidden state is bf16, or with use_fp8
 * e4m3 bytes with one float32 scale per token and 128 channels (moved as
 * they are, in the low-latency FP8 layout).
 *
 * cached = 1 (DeepEP's dispatch with handle=): route as the dispatch whose
 * handle `h` holds did, on every rank; only x (and x_scales) move, and the
 * handle stays as it was, for the combine.  num_tokens must be that
 * dispatch's; topk_idx, topk_weights, recv_topk_idx, recv_topk_weights and
 * recv_count_per_expert must be NULL and expert_alignment 0 or 1.  A cached
 * dispatch never waits: num_recv gets the handle's count, which a dispatch
 * with num_worst_tokens on cuda did not learn, so there give
 * num_worst_tokens to the cached dispatch too.
 *
 * num_worst_tokens > 0: the outputs hold that many rows (at most
 * world_size * max_tokens_per_rank) and the call does not wait for the row
 * count (on cuda: no host synchronisation, so it can be captured in a CUDA
 * graph); num_recv is not written and may be NULL.  Rows past those
 * received have recv_topk_idx -1 in every column and recv_topk_weights 0
 * (DeepEP's padding; recv_x and recv_x_scales there are left unwritten);
 * every received row names at least one local expert, so the first row
 * whose ids are all -1 ends them.  A rank that receives more rows than
 * num_worst_tokens fails the call with DEP_ERR_INVALID.
 *
 * expert_alignment > 1 (DeepEP's): each recv_count_per_expert is rounded
 * up to a multiple of it (at most 65536); the rows are not padded.
 *
 * recv_index_type (appended in 0.4.0): the type of recv_topk_idx's
 * elements, 0 or DEP_INDEX_I32 for int32 (what a caller of an older
 * deepep.h gets), DEP_INDEX_I64 for int64 (DeepEP's topk_idx_t, so that a
 * binding returns the ids without a widening copy); any other value is
 * DEP_ERR_INVALID.  The values, the -1s and the padding are the same
 * either way.  A cached dispatch writes no ids; its type is checked all
 * the same.  A library older than 0.4.0 refuses a non-zero value
 * (DEP_ERR_UNSUPPORTED, "Structs grow").
 *
 * recv_count_per_expert_host (appended in 0.4.1): NULL, or host memory (on
 * cuda too, as num_recv is; int32_t-aligned) of num_experts / world_size
 * counts, where a call that returns 0 leaves a copy of recv_count_per_expert
 * (rounded as expert_alignment says), so that a caller on cuda reads the
 * counts with no device-to-host copy and no synchronisation of its own: the
 * copy is queued on the stream behind the dispatch, into pinned memory of
 * the library's, before the one synchronisation the call makes for num_recv,
 * and copied out after it.  On the host backend it is a plain copy (it may
 * be recv_count_per_expert itself).  Only a call that waits may ask for it:
 * with num_worst_tokens (no wait) or cached (no counts) it is
 * DEP_ERR_INVALID naming it.  A failed call leaves it as it was.  A library
 * older than 0.4.1 refuses a non-NULL value (DEP_ERR_UNSUPPORTED).
 */
struct dep_dispatch_args {
  uint32_t size;               /* sizeof(struct dep_dispatch_args) */
  const void *x;               /* bf16 [num_tokens, hidden]; use_fp8: e4m3 bytes */
  const void *topk_idx;        /* [num_tokens, topk], -1 = none */
  int index_type;
  const float *topk_weights;   /* [num_tokens, topk] */
  uint32_t num_tokens;
  /* Outputs, capacity world_size * max_tokens_per_rank rows (num_worst_tokens with it): */
  void *recv_x;                /* bf16 [rows, hidden]; use_fp8: e4m3 bytes */
  void *recv_topk_idx;         /* [rows, topk] local expert ids (recv_index_type), -1 where
                                  not ours */
  float *recv_topk_weights;    /* [rows, topk], 0 where not ours */
  int32_t *recv_count_per_expert; /* [num_experts / world_size] */
  uint32_t *num_recv;          /* host pointer: rows received (the call waits for it) */
  int use_fp8;                 /* 0: bf16; 1: e4m3 with scales */
  const float *x_scales;       /* use_fp8: [num_tokens, hidden / 128] */
  float *recv_x_scales;        /* use_fp8: [rows, hidden / 128] */
  int cached;                  /* 1: reuse h's routing (see above) */
  uint32_t num_worst_tokens;   /* 0, or the rows the outputs hold: no wait */
  uint32_t expert_alignment;   /* 0 or 1: exact counts; else rounded up to a multiple */
  /* Appended in 0.4.0 (0.3.0's sizeof ends after reserved): */
  uint32_t reserved;           /* 0.3.0's tail padding, which its callers may leave unset: not
                                  read */
  int recv_index_type;         /* recv_topk_idx's type: 0 or DEP_INDEX_I32 int32, or
                                  DEP_INDEX_I64 */
  /* Appended in 0.4.1 (0.4.0's sizeof ends after reserved2): */
  uint32_t reserved2;          /* 0.4.0's tail padding, which its callers may leave unset: not
                                  read */
  int32_t *recv_count_per_expert_host; /* NULL, or host [num_experts / world_size]: the
                                          counts, copied as the call returns (above) */
};
DEP_EXPORT int dep_dispatch(dep_client_t *c, const struct dep_dispatch_args *a, dep_handle_t *h,
                            dep_stream_t stream);

/*
 * Throughput-mode combine: one bf16 vector per received row back to its
 * origin, summed in float32 in source-rank order.  A weighted combine
 * (DeepEP's combine(topk_weights=)) gives out_topk_weights (even with no
 * tokens; every rank of the call must, or none: DEP_ERR_MISMATCH) and
 * topk_weights (which may be NULL with no rows): one float32 row of topk
 * per received row goes back too and out_topk_weights[t] is their sum, in
 * float32 in source-rank order, over the ranks that received t (0 for a
 * token that selected nothing); given each rank's recv_topk_weights it is
 * the origin's topk_weights again.  The vectors are not weighted: that is
 * the caller's, before combine.
 *
 * bias_0, bias_1 (appended in 0.6.0; DeepEP's combine(bias=)): NULL, or
 * bf16 [num_tokens, hidden] of the dispatching call (num_tokens the
 * handle's), in the memory the operations read (device memory on cuda),
 * 2-byte aligned; either may be given without the other, and a call with
 * no tokens reads neither.  Each is added to the origin's sum before its
 * one rounding, in DeepEP's order: for token t and channel c, in float32
 * rounded to nearest, acc = bias_0[t][c] + bias_1[t][c] (a NULL one counts
 * as +0), then acc += the vector of each rank that received t, ranks
 * ascending, and out[t][c] = bf16(acc), rounded once to nearest even.  So
 * the result is not bf16(bf16(sum) + bias): it is DeepEP's bit for bit
 * wherever the ranks' vectors are summed in the same order.  A cached, a
 * weighted and a plain combine take them alike.  A library older than
 * 0.6.0 refuses a non-NULL one (DEP_ERR_UNSUPPORTED, "Structs grow").
 */
struct dep_combine_args {
  uint32_t size;               /* sizeof(struct dep_combine_args) */
  const void *x;               /* bf16 [rows, hidden]: the rows dispatch delivered */
  void *out;                   /* bf16 [num_tokens, hidden] of the dispatching call */
  const float *topk_weights;   /* weighted: [rows, topk] */
  float *out_topk_weights;     /* weighted: [num_tokens, topk]; NULL: not weighted */
  /* Appended in 0.6.0 (0.5.0's sizeof ends after out_topk_weights): */
  const void *bias_0;          /* NULL, or bf16 [num_tokens, hidden]: added before rounding */
  const void *bias_1;          /* NULL, or bf16 [num_tokens, hidden]: added before rounding */
};
DEP_EXPORT int dep_combine(dep_client_t *c, const struct dep_combine_args *a,
                           const dep_handle_t *h, dep_stream_t stream);

/*
 * Low-latency dispatch: fixed-shape per-local-expert output, no host sync.
 *
 * Split calls (phases, appended in 0.6.0, in both low-latency argument
 * structs): 0 or DEP_LL_SEND | DEP_LL_RECV is the whole call.  DEP_LL_SEND
 * runs its send only and returns once the rows (a combine's vectors) have
 * left: written into the peers' slabs and published.  DEP_LL_RECV, with the same arguments, is
 * the receive of the call whose send the handle holds: it waits for what
 * the peers sent and writes the outputs.  The caller computes in between
 * (DeepEP's return_recv_hook).  The send reads the inputs a whole call
 * reads, and the receive does not read them again, except a combine's
 * topk_idx and topk_weights, which its receive reads (as DeepEP's does):
 * a dispatch's x and topk_idx, and a combine's x, may be written once the
 * send returns.  A split call is one call of the job's sequence
 * (dep_next_call, the masks): it is counted, and reads the mask, at its
 * send.  Rules, each DEP_ERR_INVALID naming phases: a receive needs the
 * handle to hold that operation's pending send; a dispatch may not send
 * into, nor any call read, a handle whose send has not received; and at
 * most two calls may be between send and receive (the slots alternate
 * between two call parities), so a call (of any operation) whose parity's
 * slots are held by a send not yet received is refused: receive it first.
 * Every rank makes the same calls, split or not, in the same order; a
 * receive may come after later calls' sends (send A, send B, receive A,
 * receive B).
 *
 * wait_cost (appended in 0.6.0, both low-latency argument structs;
 * DeepEP's dispatch_wait_recv_cost_stats and combine_wait_recv_cost_stats):
 * NULL, or world_size int64 counters (8-byte aligned; device memory on
 * cuda), to which a call that receives adds, for each source rank s, the
 * time from the start of its receive's wait until s's rows were there:
 * nanoseconds on the host backend, the GPU's clock64 cycles on cuda
 * (DeepEP's unit).  A masked source adds 0; a send (DEP_LL_SEND) adds
 * nothing.
 *
 * On cuda each half is a launch of the call's kernel on the caller's
 * stream with no host synchronisation (a captured send and receive replay
 * as a pair); the send, the calls between and the receive must be in
 * stream order.  Where the job spans nodes both backends split calls as
 * on one node (a receive's taken goes back to the senders on other nodes
 * through the daemons).  A library older than
 * 0.6.0 refuses a non-zero phases (DEP_ERR_UNSUPPORTED, "Structs grow").
 */
#define DEP_LL_SEND 1u
#define DEP_LL_RECV 2u
struct dep_ll_dispatch_args {
  uint32_t size;               /* sizeof(struct dep_ll_dispatch_args) */
  const void *x;               /* bf16 [num_tokens, hidden] */
  const void *topk_idx;
  int index_type;
  uint32_t num_tokens;         /* <= max_ll_tokens_per_rank in effect (dep_shape_sizes) */
  int use_fp8;                 /* e4m3 with one float32 scale per 128 channels */
  /* Outputs; rows = world_size * max_ll_tokens_per_rank per local expert: */
  void *recv_x;                /* [local_experts, rows, hidden] bf16, or fp8 bytes */
  float *recv_scales;          /* [local_experts, rows, hidden / 128] when use_fp8 */
  int32_t *recv_count;         /* [local_experts] valid rows */
  /* Appended in 0.6.0: */
  uint32_t phases;             /* 0 or DEP_LL_SEND | DEP_LL_RECV: whole; or one (above) */
  int64_t *wait_cost;          /* NULL, or [world_size]: the receive's wait per source (below) */
};
DEP_EXPORT int dep_ll_dispatch(dep_client_t *c, const struct dep_ll_dispatch_args *a,
                               dep_handle_t *h, dep_stream_t stream);

/* Low-latency combine: out[t] = sum_k topk_weights[t,k] * (expert output for k), in float32. */
struct dep_ll_combine_args {
  uint32_t size;               /* sizeof(struct dep_ll_combine_args) */
  const void *x;               /* bf16 [local_experts, rows, hidden] expert outputs */
  const void *topk_idx;        /* as given to the matching dispatch */
  int index_type;
  const float *topk_weights;   /* [num_tokens, topk] */
  void *out;                   /* bf16 [num_tokens, hidden] */
  /* Appended in 0.6.0: */
  uint32_t phases;             /* as dep_ll_dispatch_args's */
  int64_t *wait_cost;          /* as dep_ll_dispatch_args's */
};
DEP_EXPORT int dep_ll_combine(dep_client_t *c, const struct dep_ll_combine_args *a,
                              const dep_handle_t *h, dep_stream_t stream);

/*
 * What a low-latency dispatch into h received, as DeepEP's low-latency
 * handle holds it (added in 0.4.3), for a caller that checks or indexes
 * the rows by their origin.  Rows per local expert are packed from row 0
 * in (source rank, source token) order, so:
 *   src_info[l * ll_recv_rows + i]: the index, among its source rank's
 *     tokens (that rank's x of the dispatch), of the token in row i of
 *     local expert l; -1 in the rows past recv_count[l].
 *   layout_range[l * world_size + s]: DEP_LL_RANGE(begin, count), the rows
 *     of local expert l that came from rank s: rows begin .. begin + count - 1
 *     (count may be 0; begin is then where they would start).
 * ll_recv_rows is dep_shape_sizes's (world_size * max_ll_tokens_per_rank).
 * Every element of both is written.  On cuda both are device memory and a
 * kernel on `stream` fills them: queue it behind the dispatch (the same
 * stream, or one that waits for it), as a dep_ll_combine; it never waits
 * on the host, so it can be captured in a CUDA graph.  On the host backend
 * they are host memory, written before the call returns.  The handle is
 * read, not changed: call it any number of times, before or after the
 * dep_ll_combine.  NULL c, a, h, src_info or layout_range, a misaligned
 * pointer, a handle that holds no dep_ll_dispatch of this attachment
 * (empty, a throughput dispatch's, an earlier attachment's):
 * DEP_ERR_INVALID naming it; not attached: DEP_ERR_STATE.
 */
struct dep_ll_handle_info_args {
  uint32_t size;               /* sizeof(struct dep_ll_handle_info_args) */
  int32_t *src_info;           /* out [local_experts, ll_recv_rows] */
  int64_t *layout_range;       /* out [local_experts, world_size], DEP_LL_RANGE */
};
DEP_EXPORT int dep_ll_handle_info(dep_client_t *c, const struct dep_ll_handle_info_args *a,
                                  const dep_handle_t *h, dep_stream_t stream);

/* DeepEP's packing of a (begin, count) of layout_range: begin in the high 32 bits. */
#define DEP_LL_RANGE(begin, count) ((int64_t)(((uint64_t)(begin) << 32) | (uint32_t)(count)))
#define DEP_LL_RANGE_BEGIN(r) ((uint32_t)((uint64_t)(r) >> 32))
#define DEP_LL_RANGE_COUNT(r) ((uint32_t)(uint64_t)(r))

/* ---- masked ranks (added in 0.5.0; DESIGN §14) ---------------------------------
 * A rank is masked for a call when its bit is set in the live mask, which
 * the daemon writes into this rank's slab when a rank of an elastic job is
 * gone (bits, then an epoch that only grows), or in this rank's own mask
 * (dep_mask_update: DeepEP's low_latency_update_mask_buffer).  For a
 * masked rank r, every operation of this rank, throughput and low-latency:
 *   - dispatch sends r nothing: each (token, k) whose expert is on r is
 *     dropped (the token still goes to its other ranks; DeepEP's shrink
 *     mode) and counted (dep_handle_dropped); nothing waits for r; r sends
 *     no rows (0 from r in every count);
 *   - combine sends nothing back to r and waits for nothing from r; the
 *     contributions of r's experts are zero;
 *   - a call that is waiting for r when r becomes masked (the epoch
 *     changes) stops waiting and completes with r masked for the rest of
 *     the call; a throughput dispatch's rows from r that had not arrived
 *     by then hold zeros with ids -1 and weights 0, in the place r's count
 *     gave them (a cached dispatch's rows from r, whose place its handle
 *     keeps, are zeros too).
 * A rank that masks itself talks to no rank (every rank is masked for it:
 * its calls complete at once, receiving nothing).  Each call reads the
 * mask as it begins; the masks of the ranks that take part in a call must
 * agree (DeepEP's do too), or a rank waits for one that sends it nothing
 * (DEP_ERR_TIMEOUT); a mask cleared between a dispatch and its combine
 * makes that combine DEP_ERR_MISMATCH.  A layout is local and ignores the
 * masks.  A job that never writes the live mask and a rank that never
 * sets its own behave as before: a gone rank is DEP_ERR_PEER.  On the cuda
 * backend each CTA of a call reads the masks as it begins, so two
 * differences: a live mask written while a call's kernel starts may be
 * seen by part of it only (that call's outputs are then undefined); and
 * the kernels do not count the pairs they drop (dep_handle_dropped is
 * DEP_ERR_UNSUPPORTED there).  All need an attached handle (DEP_ERR_STATE).
 *
 * dep_mask_update: set (masked 1) or clear (masked 0) rank's bit in this
 * rank's own mask; rank past the world or masked not 0/1: DEP_ERR_INVALID.
 * dep_mask_clear: clear every bit of it (the live mask is the daemon's).
 * dep_mask_query: out[r] = 1 where rank r is masked (the live mask or-ed
 * with this rank's own: what the next call, dep_next_call's, will use;
 * a rank that came back is masked before its join call), 0 elsewhere, for r
 * in 0..world_size-1; n is out's length, at least world_size; *epoch
 * (epoch may be NULL) the live mask's epoch (0: never written).
 * dep_handle_dropped: the (token, k) pairs the dispatch into h dropped
 * because their expert's rank was masked; a handle that holds no dispatch
 * of this attachment: DEP_ERR_INVALID.
 */
DEP_EXPORT int dep_mask_update(dep_client_t *c, uint32_t rank, int masked);
DEP_EXPORT int dep_mask_clear(dep_client_t *c);
DEP_EXPORT int dep_mask_query(dep_client_t *c, int32_t *out, uint32_t n, uint64_t *epoch);
DEP_EXPORT int dep_handle_dropped(dep_client_t *c, const dep_handle_t *h, uint64_t *pairs);

/*
 * dep_next_call (added in 0.5.0): *call = the number of the next
 * communicating call this rank will make: 1 after a fresh attach, one more
 * after each dispatch, combine, LL dispatch or LL combine that ran, failed
 * or not (a call refused before it ran, for its arguments or state, is not
 * counted, and a layout, dep_ll_handle_info and the mask calls are local).
 * Every rank of a job makes the same calls in the same order, so the ranks
 * agree on it.  On cuda it is the larger of the calls the library launched
 * and those the GPU counted (a CUDA graph's replays are launched by the
 * caller, not the library): exact once the calls launched have ended
 * (synchronise the stream first).  NULL c or call: DEP_ERR_INVALID; refused as the mask calls are
 * (not attached: DEP_ERR_STATE).
 *
 * Rejoin (DEP_ATTACH_ELASTIC): a process that takes a masked rank's place
 * starts at the join call J the daemon chose, above every call the
 * survivors had made; after its dep_attach its dep_next_call is J, and its
 * first call runs as the survivors' call J, which must be the same
 * operation.  The recipe: the replacement reads its dep_next_call (J) and
 * hands it to the survivors through the trainer's own store; each survivor
 * reads its own, n (never above J: the survivors' call J waits for the
 * replacement), and makes J - n calls with the rank still masked (a
 * dispatch of no tokens will do, with or without its combine) before it
 * goes on with the same sequence of operations as the replacement's, whose
 * first is then the survivors' call J.
 */
DEP_EXPORT int dep_next_call(dep_client_t *c, uint64_t *call);

/*
 * The sizes a caller allocates for, as a job of this shape and world size
 * has them (defaults applied: max_ll_tokens_per_rank 0 is the bound in
 * effect here).  Needs no daemon and no attach; c may be NULL (then no
 * message is kept).  out->size must be set as for the argument structs.
 * DEP_ERR_INVALID for a shape the daemon would refuse, naming the field.
 */
struct dep_shape_sizes {
  uint32_t size;                   /* sizeof(struct dep_shape_sizes) */
  uint32_t max_ll_tokens_per_rank; /* the low-latency bound in effect */
  uint32_t local_experts;          /* num_experts / world_size */
  uint32_t scale_groups;           /* hidden / 128: FP8 scales per row */
  uint32_t recv_rows;              /* dispatch's output rows: world_size * max_tokens_per_rank,
                                      the most num_worst_tokens may be */
  uint32_t ll_recv_rows;           /* LL rows per local expert: world_size * max_ll_tokens_per_rank */
  uint64_t slab_bytes;             /* device (or host) memory the daemon lends each rank */
};
DEP_EXPORT int dep_shape_sizes(dep_client_t *c, const struct dep_job_shape *shape,
                               uint32_t world_size, struct dep_shape_sizes *out);

#ifdef __cplusplus
}
#endif
#endif /* DEEPEP_H */
