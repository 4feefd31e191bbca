/*
 * host_ops.h — the MoE operations of DESIGN §6 (layout, dispatch, combine
 * and their low-latency forms) in plain C, for the host backend: every rank
 * of a job is a process on this machine and every rank's slab is mapped
 * (MAP_SHARED) into every rank.  The CUDA kernels implement the same
 * semantics on the same slab layout, so what is written here about slots,
 * rows and error records is the contract for them too (the slot's and the
 * error record's structs, and the op codes, are proto/kabi.h's, which
 * both backends include).
 *
 * Protocol, per communicating call (layout is local and takes no part):
 *   - seq = ++ctx->seq, parity = seq & 1.  All ranks make the same sequence
 *     of communicating calls, so seq names the same call everywhere.
 *   - Push only.  For every destination rank d (itself included, even with
 *     zero rows) a rank writes its rows into d's block (parity, self), then
 *     d's control slot (parity, self): rows, op, ref_seq, and last the flag,
 *     stored = seq with release ordering.
 *   - A receiver waits, bounded by timeout_ms, until every source's flag
 *     equals seq (acquire), checks that every source made the same call,
 *     then reads its blocks and writes the caller's outputs.
 *   Because every rank posts to every rank on every call, no rank can start
 *   call n+2 (same parity as n) before every peer has entered call n+1,
 *   i.e. has finished reading call n: parity double-buffering is safe.
 *
 * Masked ranks (DESIGN §14, deepep.h "Masked ranks"): a call reads its
 * mask once as it begins (host_ops__mask_begin: the live mask the daemon
 * writes into this rank's slab, or-ed with this rank's own) and skips
 * every masked rank in both directions: it posts nothing to one, routes
 * no token to its experts (each such (token, k) is counted in the
 * handle's dropped), and waits for nothing from one.  A wait that finds
 * the live mask's epoch changed reads the mask again and stops waiting
 * for a rank that is masked now: the rank stays masked for the rest of
 * the call.  A rank whose own bit is set talks to no rank at all.  The
 * pairwise argument below still holds for every two ranks that are not
 * masked to each other, which post to each other on every call.
 *
 * Split calls (deepep.h DEP_LL_SEND, DEP_LL_RECV): a low-latency call's
 * send consumes its seq and posts, and its receive runs later, maybe after
 * another call's send, with the seq and mask the send had (ops_pending).
 * The argument above then no longer holds: a peer may post call n+1
 * before it has read call n, so a rank that has received n+1 could start
 * n+2 and overwrite n unread.  So each receiver stores, in each slot, the
 * call it has read to its end (taken; a whole call's when the next call
 * begins, a split receive's as it ends), and a rank that begins a call
 * first waits, bounded as every wait, until every peer has taken what it
 * posted into that parity's slot two calls before.  A call whose parity's
 * slots hold a pending send of this rank is refused.
 *
 * Across nodes (DESIGN §7) the same rule holds.  With whole calls only, a
 * rank's out block and the far in block of parity p are free two calls
 * on because the destination posts call n + 1 only after it has read
 * call n, and reading n means this rank's frame of n arrived, so the
 * proxy is done with the out block too; split calls break that.  A
 * remote peer's slots are not mapped here, so it says it has read call f
 * in one of three ways, of which a begin takes the first that holds
 * (host_ops.c read_by): its post of f + 1 carries prev_read (it had read
 * f when it posted: every whole call, and a split receive run before the
 * next send, so a job of whole calls sends nothing more); its post of
 * f + 2 has come (it cannot post f + 2 with f pending); or, when its
 * split receive of f ran after its send of f + 1, it pushes a TAKEN
 * descriptor (xring.h) to each remote source that posted f, whose proxy
 * sends a frame of no payload to the source's daemon, which stores the
 * call into the source's out slot taken word if larger.  What this
 * avoids:
 *   - A receiving daemon never holds a frame: call n + 2's frame cannot
 *     leave before its sender has begun n + 2, which waits for the taken
 *     word, so a daemon writes every frame as it comes and a data
 *     connection carrying several ranks' frames never blocks on one.
 *   - A proxy thread never holds a descriptor: the wait is in the
 *     sender's own call (its thread), before it writes its out block or
 *     pushes a descriptor; a TAKEN descriptor is moved as a credit is.
 *   - Memory: nothing is parked.  A taken word is the out slot's own
 *     (two a remote peer, one a parity), a TAKEN descriptor a ring entry
 *     (the ring's bound, waited on as for every push), a frame a header
 *     of no payload sent as it is taken.
 *   - The two ranks of a pair never wait for each other's next post: a
 *     taken frame goes at the end of the receive, whatever the call after.
 * The cuda backend's kernels do the same (kabi.h "Split calls"): every
 * post carries prev_read, a split receive after a later call pushes the
 * TAKEN descriptors, and a sending CTA's wait at its call's begin is
 * read_by's rule (kernels/ops_dev.cuh wait_taken).
 *
 * Failures: bad arguments are DEP_ERR_INVALID before anything is written
 * anywhere (the call does not consume a seq and may be retried).  A source
 * that made a different call (other op, other FP8 setting, a combine
 * with another dispatch's handle) is DEP_ERR_MISMATCH after the call's
 * flags are all consumed, so the ranks stay in step.  A peer that does not
 * arrive is DEP_ERR_TIMEOUT with an ops_err_record in the error words of
 * this rank's own slab; the context is then broken (DEP_ERR_STATE for every
 * later call), because the ranks no longer agree on seq.  A peer the
 * daemon found gone (its process died, or it detached, while the job ran)
 * is DEP_ERR_PEER as soon as a wait polls this rank's abort words (slab.h),
 * recorded and breaking the context the same way.
 *
 * Outputs: every element a call defines is written; rows past the valid
 * count (num_recv, recv_count[e]) and past num_tokens are left untouched,
 * except that a dispatch with num_worst_tokens writes recv_topk_idx -1 and
 * recv_topk_weights 0 in its rows past num_recv, up to num_worst_tokens.
 * recv_topk_idx holds int32 or, with recv_index_type DEP_INDEX_I64, int64
 * ids: the same values either way.
 * A cached dispatch (deepep.h) sends each token to the rows its handle's
 * dispatch put it in and posts that dispatch's seq as ref_seq, which every
 * receiver checks against its own handle, as a combine's.
 *
 * Duplicate experts in one row of topk_idx: each (t, k) is its own
 * selection.  Dispatch remaps and weighs every such k and counts each in
 * recv_count_per_expert; combine still gets one vector per received row.
 * LL dispatch sends the token once per (rank, local expert), so the expert
 * has one row and recv_count counts it once; LL combine adds
 * topk_weights[t,k] x that row's vector for every k naming it, in k order.
 * Tokens whose ids are all -1 go nowhere and combine to zeros.
 */
#ifndef DEP_HOST_OPS_H
#define DEP_HOST_OPS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "deepep.h"
#include "kabi.h"
#include "slab.h"
#include "xring.h"

/* The op codes, the control slot (struct ops_slot) and the error record
 * (struct ops_err_record) are kabi.h's: the kernels write them too. */

/*
 * A row (dep_slab_row, row_bytes apart) in a dispatch block:
 *   [0, 2h)         bf16 token; with FP8, h e4m3 bytes then h/128 float32 scales
 *   [2h, 2h+16)     int32 source token, int32 id count, 8 bytes reserved
 *   then int32 ids[topk]    dispatch: remapped ids of all k (-1 elsewhere);
 *                           LL: the distinct local experts, first-appearance order
 *   then float weights[topk] dispatch only (0 where not this rank's)
 * Throughput combine: a bf16 vector at the start of each row, and with
 * topk_weights its float32 weights at the weights offset.  LL combine:
 * vector i at block + i * 2h, in the order the origin enumerates them.
 */
static inline uint64_t ops_meta_off(uint32_t hidden) { return 2ull * hidden; }
static inline uint64_t ops_ids_off(uint32_t hidden) { return DEP_SLAB_IDS_OFF(hidden); }
static inline uint64_t ops_weights_off(uint32_t hidden, uint32_t topk) {
  return DEP_SLAB_WEIGHTS_OFF(hidden, topk);
}

/*
 * One rank's view of a job: shape, layout and every local rank's slab.  In
 * a job that spans nodes (DESIGN §7) a remote rank has no slab here: what
 * this rank means for it goes into the out block and slot of its exchange
 * region (slab.h, host memory after its ring) and a descriptor into its
 * ring (xring.h), and the daemon's proxy moves it; what a remote rank
 * sent this one is read from the in block and slot there.
 */
/* One rank's side of a streamed throughput call with one peer (host_ops_stream.c). */
struct ops_peer {
  uint32_t to_rows;    /* rows this call sends the peer */
  uint32_t to_done;    /* ... written (into its channel, or its whole block on another node) */
  uint64_t to_base;    /* combine: where they start in its input */
  uint32_t from_rows;  /* rows the peer sends this rank: its slot's count, once seen */
  uint32_t from_taken; /* ... taken out of the channel */
  uint32_t from_cred;  /* ... credited back to it */
  uint32_t want;       /* combine: the vectors it owes this rank */
  uint64_t from_base;  /* dispatch: where its rows start in this rank's outputs */
  uint32_t seen;       /* its slot for this call is seen (and checked) */
  uint32_t other_op;   /* ... and it makes another op: nothing streams with it either way */
  /* A peer on another node (its channels pass through the exchange region). */
  uint32_t to_pushed;  /* our slot image for it is handed to the proxy */
  uint32_t from_in;    /* its rows whose chunks are in (their marks seen) */
  uint32_t cred_sent;  /* the credit last handed to the proxy for it */
  uint32_t node_start; /* its rows go through a node channel: to_done when the node's
                          current chunk began */
};

/*
 * A node whose ranks this rank's dispatch rows reach through one node
 * channel (xring.h: the ring's fan table), and that channel's state in
 * the current call.
 */
struct ops_node {
  uint32_t lead;       /* the global rank whose out channel carries the node channel */
  uint32_t first, n;   /* its ranks: ops_ctx.node_ranks[first .. first + n), ascending */
  uint32_t rows;       /* this call's rows for it: tokens that go to any of its ranks */
  uint32_t done;       /* ... written into the node channel */
  uint32_t off;        /* where its tokens start in ops_ctx.nodelist */
  /* For each chunk of the ring (DEP_SLAB_CHUNKS): the ring's head just after
   * the descriptor of the last chunk written there, which the proxy has
   * copied out once the ring's tail reaches it (then the place is free). */
  uint64_t pushed_at[DEP_SLAB_CHUNKS];
};

/* A low-latency call whose send has run and whose receive has not (at most
 * one per parity: its slots are held until it receives): what its receive
 * runs with. */
struct ops_pending {
  uint64_t seq;                        /* its call; 0: none pending */
  uint32_t op;                         /* OPS_OP_LL_DISPATCH (| OPS_OP_FP8) or _LL_COMBINE */
  const struct dep_handle *h;          /* the handle it fills (dispatch) or reads (combine) */
  uint64_t *mask;                      /* the call's mask as its send left it (and its
                                          epoch and count) */
  uint64_t epoch;
  uint32_t nmasked;
};

struct ops_ctx {
  struct dep_job_shape shape;
  struct dep_slab_layout lay;
  uint32_t world, rank;
  uint8_t **slabs;                     /* [world]: every local rank's slab mapped here, by
                                          rank; NULL for a remote rank */
  int32_t *remote;                     /* [world]: a remote rank's number among the remote
                                          ranks (slab.h's exchange region); -1 for a local rank */
  struct dep_xring *ring;              /* the proxy's ring: a job that spans nodes only */
  uint8_t *xchg;                       /* ... and the exchange region after it */
  uint64_t seq;                        /* communicating calls made so far */
  uint32_t timeout_ms;                 /* bound on each call's waits */
  int broken;                          /* a wait timed out: the ranks are out of step */
  float *acc;                          /* scratch: hidden float32 accumulators */
  uint8_t *stage;                      /* scratch: one FP8 token with its scales */
  uint32_t *per_rank;                  /* scratch: OPS_PER_RANK counters for each rank */
  struct ops_peer *peer;               /* [world]: a streamed call's state with each rank */
  uint32_t *rowoff, *rowlist;          /* a dispatch's tokens for each rank, in token order:
                                          rowlist[rowoff[d] .. rowoff[d + 1]) */
  /* One crossing per destination node (xring.h), from the ring's fan table. */
  uint32_t n_nodes;
  struct ops_node *node;               /* [n_nodes] */
  uint32_t *node_of;                   /* [world]: a rank's node in node[], or OPS_NO_NODE */
  uint32_t *node_ranks;                /* the nodes' ranks, node by node */
  uint32_t *nodelist;                  /* a dispatch's tokens for each node, in token order */
  int stream_rc;                       /* a streamed call's first fault, said at its end */
  /* Masked ranks (a bit per rank, DEP_SLAB_MASK_WORDS(world) words each). */
  uint64_t *own;                       /* this rank's own mask (host_ops_mask_update) */
  uint64_t *mask;                      /* the running call's: live | own */
  uint64_t epoch;                      /* the live mask's epoch the call last read */
  /* The live mask as the daemon last wrote it, read again only when its
   * epoch moves (a call of an elastic job does not read W join words). */
  uint64_t *live;                      /* its bits */
  uint64_t live_epoch;                 /* the epoch they were read at (0: none yet) */
  uint64_t live_join_max;              /* the largest join word read with them */
  uint32_t nmasked;                    /* bits set in mask (0: the call skips nothing) */
  struct ops_pending pend[2];          /* split calls sent, not received, by parity */
  int64_t *wait_cost;                  /* the running LL receive's (deepep.h), else NULL:
                                          wait_all adds each source's wait, in ns */
  char why[256];                       /* message of the last failure */
};

/* ops_ctx.node_of of a rank whose rows take a channel of their own. */
#define OPS_NO_NODE UINT32_MAX

/* The world-sized counters of ops_ctx.per_rank, for the low-latency calls
 * (the throughput ones keep theirs in ops_ctx.peer): a dispatch's rows sent
 * to each rank; a combine's vectors expected from each rank and where each
 * one's vectors begin. */
#define OPS_PER_RANK 2u

enum ops_handle_kind { OPS_HANDLE_EMPTY = 0, OPS_HANDLE_TP = 1, OPS_HANDLE_LL = 2 };

/* One vector a low-latency dispatch received: the row of local expert
 * `expert` it went to, and the token of its source it is (what
 * dep_ll_handle_info reports as DeepEP's src_info). */
struct ops_ll_vec {
  uint32_t expert, row, token;
};

/*
 * What a dispatch leaves for its combine (the public dep_handle_t).  Arrays
 * are allocated on first use for the ctx's shape and reused afterwards.
 */
struct dep_handle {
  uint32_t kind;       /* enum ops_handle_kind of the last dispatch into it */
  uint64_t seq;        /* that dispatch's call number */
  /* The context it was made on (a handle does not cross jobs or shapes). */
  uint32_t world, rank, hidden, topk, num_experts, max_tokens, max_ll_tokens;
  uint32_t num_tokens; /* tokens this rank dispatched */
  uint32_t num_recv;   /* TP: rows received in total */
  uint32_t worst;      /* TP: the dispatch's num_worst_tokens (0: num_recv is known on the host) */
  /* [world] TP: rows received from each source (they are contiguous, by
   * source).  LL: vectors this rank owes each source in the combine.  Host
   * memory on both backends: carved in mem on the host backend, else the
   * library's own (recv_cap > 0: its length). */
  uint32_t *recv_from;
  uint32_t recv_cap;
  /* TP: for each dispatched token t, the ranks that received it, ascending:
   * token_ranks[t * topk + i] for i < token_nranks[t] (at most topk). */
  uint32_t *token_ranks;
  uint8_t *token_nranks;
  uint64_t tp_bytes;   /* the library's allocation of both (0: none, or carved in mem) */
  /* LL: per vector owed, in (source, source token, order of first
   * appearance in the token's top-k) order (struct ops_ll_vec). */
  struct ops_ll_vec *ll_rows;
  uint64_t ll_cap;
  uint64_t idx_hash;   /* LL: hash of the dispatched topk_idx */
  uint64_t dropped;    /* (token, k) pairs the dispatch dropped: their expert's rank was
                          masked (a cached dispatch leaves it as it was) */
  void *cuda;          /* cuda backend: the device arrays (client/cuda_ops.c) */
  uint64_t attach_id;  /* the attachment whose dispatch filled it (client/ops.c) */
  /* Memory the caller lent for the arrays (dep_handle_new_in), host or
   * device as the backend's: carved, never grown or freed.  NULL: the
   * library allocates them. */
  void *mem;
  size_t mem_bytes;
};

/* ---- context ------------------------------------------------------------ */

/*
 * Make a context for `rank` of `world` (1..DEP_MAX_WORLD) on the
 * mapped slabs (slabs[0..world-1], each 64-byte aligned, laid out by
 * dep__slab_layout for this shape and zero or left by an earlier ctx that
 * ran in step).  0, DEP_ERR_INVALID or DEP_ERR_NO_MEMORY with why.
 */
int host_ops_init(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world, uint32_t rank,
                  uint8_t *const *slabs, uint32_t timeout_ms, char *why, size_t whylen);
/*
 * The same for a job that spans nodes, or streams: slabs[r] is NULL for
 * each rank r on another node, and ring is this rank's ring (xring.h),
 * lent by the daemon, through which its proxy serves those ranks; its
 * exchange region (dep_xring_xchg) must be mapped too, ring->xchg_bytes
 * long.  The layout is dep__slab_layout_nodes's for the local ranks
 * counted and the job's chunk_rows (0: whole blocks).
 */
int host_ops_init_nodes(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world,
                        uint32_t rank, uint8_t *const *slabs, struct dep_xring *ring,
                        uint32_t chunk_rows, uint32_t timeout_ms, char *why, size_t whylen);
void host_ops_fini(struct ops_ctx *c);

/* A handle starts empty; fini frees what dispatches allocated in it (not
 * the caller's memory of a dep_handle_new_in handle). */
void host_ops_handle_init(struct dep_handle *h);
void host_ops_handle_fini(struct dep_handle *h);
/* The bytes of a handle's arrays for c's shape, as handle_reserve carves
 * them in a caller's memory (dep_handle_bytes on the host backend). */
uint64_t host_ops_handle_bytes(const struct ops_ctx *c);

/* ---- argument checks (ops_check.c): DEP_ERR_INVALID naming the argument -- */

int ops_check_ctx(const struct ops_ctx *c, char *why, size_t whylen);
int ops_check_layout(const struct ops_ctx *c, const struct dep_layout_args *a, char *why,
                     size_t whylen);
int ops_check_dispatch(const struct ops_ctx *c, const struct dep_dispatch_args *a,
                       const struct dep_handle *h, char *why, size_t whylen);
int ops_check_combine(const struct ops_ctx *c, const struct dep_combine_args *a,
                      const struct dep_handle *h, char *why, size_t whylen);
int ops_check_ll_dispatch(const struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                          const struct dep_handle *h, char *why, size_t whylen);
/* A low-latency call's phases against the handle h itself (a pending send is found by
 * its address): whole, a send into a handle no send holds, or a receive of the send of
 * `kind` (OPS_OP_LL_*) it holds; the ops_check_ll_* above call it. */
int ops_check_phases(const struct ops_ctx *c, uint32_t phases, const struct dep_handle *h,
                     uint32_t kind, const char *op, char *why, size_t whylen);
int ops_check_ll_combine(const struct ops_ctx *c, const struct dep_ll_combine_args *a,
                         const struct dep_handle *h, char *why, size_t whylen);

/* Bytes of one of a dispatch's received ids (recv_index_type: 0 is int32). */
static inline uint32_t ops_recv_idx_bytes(const struct dep_dispatch_args *a) {
  return a->recv_index_type == DEP_INDEX_I64 ? 8u : 4u;
}

/* The call whose send holds h and whose receive has not run (split calls), else 0. */
uint64_t host_ops_pending(const struct ops_ctx *c, const struct dep_handle *h);
/* A call that is to send (any operation; a split receive sends nothing): DEP_ERR_INVALID
 * with why while its parity's slots are held by a low-latency send not yet received (at
 * most two calls between send and receive), else 0.  Both backends ask it before a send. */
int host_ops_slots_free(const struct ops_ctx *c, char *why, size_t whylen);

/* Hash of a topk_idx array as int64 values (LL combine checks it matches). */
uint64_t ops_check_idx_hash(const void *idx, int index_type, size_t n);

/* ---- operations: 0 or DEP_ERR_*, message in c->why ---------------------- */

/* Local: no communication, no seq. */
int host_ops_layout(struct ops_ctx *c, const struct dep_layout_args *a);
int host_ops_dispatch(struct ops_ctx *c, const struct dep_dispatch_args *a, struct dep_handle *h);
int host_ops_combine(struct ops_ctx *c, const struct dep_combine_args *a,
                     const struct dep_handle *h);
int host_ops_ll_dispatch(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h);
int host_ops_ll_combine(struct ops_ctx *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h);
/* Local: what the LL dispatch in h received, by source (dep_ll_handle_info). */
int host_ops_ll_handle_info(struct ops_ctx *c, const struct dep_ll_handle_info_args *a,
                            const struct dep_handle *h);

/*
 * What a rank of a job that spans nodes is told when its control
 * connection to this node's daemon closes (DEP_ERR_DAEMON_GONE): by its
 * waiting call, by every later call (client/ops.c), on both backends.
 */
#define OPS_DAEMON_GONE_WHY                                                                     \
  "deepepd on this node stopped or restarted, and the job's links to other nodes went with "   \
  "it: re-attach (dep_detach, then dep_connect and dep_attach, on every rank of the job)"

/* The abort words' DEP_SLAB_GONE_CUT (slab.h), both backends' message: %u is the rank of the
 * part that went on, which the words carry in pid. */
#define OPS_CUT_WHY                                                                             \
  "this node was cut off from the job's other nodes, and the job went on without it, on the "  \
  "node of rank %u (deepepctl status names it): end this node's ranks of the job (dep_detach), " \
  "and restart the job to use this node again"

/*
 * This rank's daemon is gone (client/watch.c saw its control connection
 * close) in a job that spans nodes: mark the proxy's ring failed
 * (DEP_ERR_DAEMON_GONE: a push waiting for room, and the drain before a
 * detach, stop at once) and, where the slabs are host memory, write the
 * abort words of this rank's slab (slab.h DEP_SLAB_GONE_DAEMON: every
 * wait fails within milliseconds); the cuda backend writes its device
 * slab's itself (cuda_ops_daemon_gone).  Neither overwrites what the
 * daemon wrote first.  Called from the watcher's thread while the caller's
 * thread may be inside an operation: it touches only those shared words.
 */
void host_ops_daemon_gone(struct ops_ctx *c, int slabs_on_host);

/*
 * The live mask in this rank's slab (slab.h), the one place the host
 * backend reads it: the epoch with acquire, then, unless it is 0 (never
 * written) or `known` (read before), the bits, or-ed into words
 * (DEP_SLAB_MASK_WORDS(world) of them), with the ranks still before their
 * join call in call `call` (a call's own number, ops_ctx.seq inside it;
 * the next call's outside one); returns the epoch.  The daemon writes the
 * bits before the epoch (release), so the bits read are those of that
 * epoch or of a later one.
 */
uint64_t host_ops_mask_live(const struct ops_ctx *c, uint64_t *words, uint64_t known,
                            uint64_t call);
/* A rank that came back is masked in the calls before its join call
 * (slab.h): with the join words of a world (join[r], as the slab holds
 * them, or a copy) and the calls made so far (ops_ctx.seq), or into words
 * the ranks still before theirs; returns the largest join word.  The one
 * place the host applies the rule (the kernels': cuops_mask). */
uint64_t host_ops_mask_joins(const uint64_t *join, uint32_t world, uint64_t seq,
                             uint64_t *words);
/* A process that took a masked rank's place in an elastic job (DESIGN §14)
 * makes the join call the daemon chose for it (slab.h's join word) its
 * first: host_ops_join_at(c, join) before any call (0: a rank that never
 * left, nothing changes).  host_ops_join_word reads this rank's join word
 * from its slab in host memory (the host backend's; cuda reads it from the
 * device). */
void host_ops_join_at(struct ops_ctx *c, uint64_t join);
uint64_t host_ops_join_word(const struct ops_ctx *c);
/* This rank's own mask: set or clear rank's bit (DEP_ERR_INVALID for a
 * rank past the world), or clear every bit.  Read by the next call. */
int host_ops_mask_update(struct ops_ctx *c, uint32_t rank, int masked);
void host_ops_mask_clear(struct ops_ctx *c);

/* The error record in a slab's error words (a copy; code 0 means none). */
void host_ops_err_read(const uint8_t *slab, struct ops_err_record *out);
/* An op's name (dispatch, combine, ...), whatever modes are or-ed into it. */
const char *host_ops_op_name(uint32_t op);

/* ---- number formats ----------------------------------------------------- */

static inline float host_ops_bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* float32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t host_ops_float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/*
 * float32 -> FP8 e4m3 (the "fn" variant: no infinities, 0x7f is NaN), round
 * to nearest even, saturating to +-448; bit for bit ops_fmt.cuh's f2e4m3.
 * Without branches: a cast's values below 2^-6 (the subnormals) come in no
 * order a branch predictor learns, and a miss a value made the FP8 cast most
 * of a low-latency dispatch.  Both codes are made and one is selected:
 * - normal: keep 3 mantissa bits, nearest even (a carry moves into the
 *   exponent by itself; e4m3's bias is 7, float32's 127), capped at 0x7e,
 *   which also saturates 448 and above, infinity included;
 * - below 2^-6, the subnormals m * 2^-9: |f| * 512 is exact (a power of
 *   two), and adding 2^23 rounds it to an integer, nearest even, in the
 *   float's low mantissa bits (8 is 2^-6, code 0x08; float32 subnormals
 *   round to 0).
 */
static inline uint8_t host_ops_float_to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  normal = normal > 0x7eu ? 0x7eu : normal;
  float af, y;
  memcpy(&af, &a, sizeof af);
  y = af * 512.0f + 0x1p23f;
  uint32_t sub;
  memcpy(&sub, &y, sizeof sub);
  uint32_t code = a < 0x3c800000u ? sub & 0xfu : normal;
  code = a > 0x7f800000u ? 0x7fu : code;
  return (uint8_t)(sign | code);
}
float host_ops_e4m3_to_float(uint8_t c);

#endif /* DEP_HOST_OPS_H */
