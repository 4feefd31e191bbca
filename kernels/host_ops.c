/*
 * host_ops.c — layout, dispatch, combine and the low-latency forms on the
 * host backend (DESIGN §6): ranks are processes that share every rank's
 * slab, push their rows into the receivers' slabs and publish a flag per
 * (receiver, source) with release ordering.  The protocol, slot, row and
 * error-record layouts are described in host_ops.h.
 *
 * Every order is fixed (sources ascending, tokens ascending, k ascending),
 * and every sum is a float32 sum in that order rounded once to bf16, so the
 * same inputs give bit-identical outputs on every run.
 */
#include "host_ops.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "shape.h"

/* ---- small helpers -------------------------------------------------------- */

static int set_why(struct ops_ctx *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int set_why(struct ops_ctx *c, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  return rc;
}

static inline int64_t idx_at(const void *idx, int type, size_t i) {
  return type == DEP_INDEX_I64 ? ((const int64_t *)idx)[i] : ((const int32_t *)idx)[i];
}

/* Store a received id as the dispatch's recv_index_type says (0: int32). */
static inline void ridx_put(void *idx, int wide, size_t i, int32_t v) {
  if (wide)
    ((int64_t *)idx)[i] = v;
  else
    ((int32_t *)idx)[i] = v;
}

static inline struct ops_slot *slot_at(const struct ops_ctx *c, uint32_t slab, unsigned parity,
                                       uint32_t src) {
  return (struct ops_slot *)(c->slabs[slab] + dep_slab_ctrl_slot(&c->lay, parity, src));
}

static inline uint8_t *row_at(const struct ops_ctx *c, uint32_t slab, unsigned parity,
                              uint32_t src, uint32_t row) {
  return c->slabs[slab] + dep_slab_row(&c->lay, parity, src, row);
}

/* What source src posted to this rank in a call of parity: its slot and
 * block in our slab, or (src on another node) in our exchange region,
 * where the daemon writes them. */
static inline struct ops_slot *in_slot(const struct ops_ctx *c, unsigned parity, uint32_t src) {
  if (c->remote[src] < 0)
    return slot_at(c, c->rank, parity, src);
  return (struct ops_slot *)(c->xchg + dep_slab_in_slot(&c->lay, parity, (uint32_t)c->remote[src]));
}

static inline uint8_t *in_row(const struct ops_ctx *c, unsigned parity, uint32_t src,
                              uint32_t row) {
  if (c->remote[src] < 0)
    return row_at(c, c->rank, parity, src, row);
  return c->xchg + dep_slab_in_block(&c->lay, parity, (uint32_t)c->remote[src]) +
         (uint64_t)row * c->lay.row_bytes;
}

/* Where this rank's block for dest goes in a call of parity: dest's slab,
 * or (dest on another node) the out block of our exchange region, for the
 * proxy. */
static inline uint8_t *out_block(const struct ops_ctx *c, uint32_t dest, unsigned parity) {
  if (c->remote[dest] < 0)
    return c->slabs[dest] + dep_slab_block(&c->lay, parity, c->rank);
  return c->xchg + dep_slab_out_block(&c->lay, parity, (uint32_t)c->remote[dest]);
}

static inline uint8_t *out_row(const struct ops_ctx *c, uint32_t dest, unsigned parity,
                               uint32_t row) {
  return out_block(c, dest, parity) + (uint64_t)row * c->lay.row_bytes;
}

static inline uint32_t local_experts(const struct ops_ctx *c) {
  return c->shape.num_experts / c->world;
}

const char *host_ops_op_name(uint32_t op) {
  switch (op & ~OPS_OP_FP8) {
  case OPS_OP_DISPATCH: return "dispatch";
  case OPS_OP_COMBINE: return "combine";
  case OPS_OP_LL_DISPATCH: return "ll_dispatch";
  case OPS_OP_LL_COMBINE: return "ll_combine";
  default: return "unknown op";
  }
}

/* ---- number formats --------------------------------------------------------- */

uint8_t host_ops_float_to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u)
    return sign | 0x7fu;           /* NaN */
  if (a >= 0x43e00000u)
    return sign | 0x7eu;           /* >= 448, infinity included: saturate */
  if (a < 0x3c800000u) {
    /* Below 2^-6, the e4m3 subnormals m * 2^-9: round |f| * 2^9 to an
     * integer, nearest even.  A result of 8 is 2^-6, which is code 0x08. */
    if (a < 0x00800000u)
      return sign;                 /* float32 subnormal: far below 2^-10 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int e = (int)(a >> 23) - 127;  /* |f| = m * 2^(e-23), so |f| * 2^9 = m >> (14 - e) */
    unsigned shift = (unsigned)(14 - e); /* >= 21 because e <= -7 */
    if (shift > 25)
      return sign;
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u)))
      q++;
    return sign | (uint8_t)q;
  }
  /* Normal: keep 3 mantissa bits, nearest even; a carry moves into the
   * exponent by itself.  e4m3's bias is 7, float32's 127. */
  uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  uint32_t code = r - (120u << 3);
  return sign | (uint8_t)(code > 0x7eu ? 0x7eu : code);
}

float host_ops_e4m3_to_float(uint8_t c) {
  uint32_t e = (c >> 3) & 15u, m = c & 7u;
  float v;
  if ((c & 0x7fu) == 0x7fu)
    v = __builtin_nanf("");
  else if (e == 0)
    v = (float)m / 512.0f;
  else
    v = (1.0f + (float)m / 8.0f) * (float)(1u << e) / 128.0f;
  return (c & 0x80u) ? -v : v;
}

/* One bf16 token to FP8: h e4m3 bytes, then h/128 float32 scales. */
static void token_to_fp8(const uint16_t *x, uint32_t hidden, uint8_t *out) {
  float *scales = (float *)(out + hidden);
  for (uint32_t g = 0; g < hidden / 128; g++) {
    const uint16_t *xg = x + (size_t)g * 128;
    float amax = 0.0f;
    for (int i = 0; i < 128; i++) {
      float v = host_ops_bf16_to_float(xg[i]);
      v = v < 0 ? -v : v;
      amax = v > amax ? v : amax;
    }
    float scale = (amax > 1e-4f ? amax : 1e-4f) / 448.0f;
    scales[g] = scale;
    for (int i = 0; i < 128; i++)
      out[g * 128 + i] = host_ops_float_to_e4m3(host_ops_bf16_to_float(xg[i]) / scale);
  }
}

/* ---- context and handles ---------------------------------------------------- */

int host_ops_init(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world, uint32_t rank,
                  uint8_t *const *slabs, uint32_t timeout_ms, char *why, size_t whylen) {
  return host_ops_init_nodes(c, s, world, rank, slabs, NULL, timeout_ms, why, whylen);
}

int host_ops_init_nodes(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world,
                        uint32_t rank, uint8_t *const *slabs, struct dep_xring *ring,
                        uint32_t timeout_ms, char *why, size_t whylen) {
  if (c == NULL || s == NULL || slabs == NULL) {
    snprintf(why, whylen, "host_ops_init: NULL context, shape or slab table");
    return DEP_ERR_INVALID;
  }
  memset(c, 0, sizeof *c);
  if (world == 0 || world > DEP_MAX_LOCAL_RANKS || rank >= world) {
    snprintf(why, whylen, "rank %u of world %u: the operations run 1..%u ranks in all", rank,
             world, DEP_MAX_LOCAL_RANKS);
    return DEP_ERR_INVALID;
  }
  int rc = dep__shape_check(s, world, why, whylen);
  if (rc != 0)
    return rc;
  uint32_t local = 0;
  for (uint32_t r = 0; r < world; r++) {
    c->remote[r] = slabs[r] == NULL ? (int32_t)(r - local) : -1;
    local += slabs[r] != NULL;
    if (slabs[r] != NULL && (uintptr_t)slabs[r] % 64 != 0) {
      snprintf(why, whylen, "slab of rank %u is not 64-byte aligned", r);
      return DEP_ERR_INVALID;
    }
    c->slabs[r] = slabs[r];
  }
  for (uint32_t r = 0; r < world; r++)
    if (slabs[r] == NULL && (r == rank || ring == NULL)) {
      snprintf(why, whylen, "slab of rank %u is not mapped%s", r,
               r == rank ? "" : " (a rank on another node is reached through the proxy's ring: "
                                "host_ops_init_nodes)");
      return DEP_ERR_INVALID;
    }
  if (ring != NULL && (ring->magic != DEP_XRING_MAGIC || ring->entries != DEP_XRING_ENTRIES ||
                       ring->rank != rank)) {
    snprintf(why, whylen, "the proxy's ring is not one for rank %u of this build (magic %#x, "
             "%u entries, rank %u)", rank, ring->magic, ring->entries, ring->rank);
    return DEP_ERR_INVALID;
  }
  c->ring = local < world ? ring : NULL;
  rc = dep__slab_layout_nodes(s, world, local, &c->lay, why, whylen);
  if (rc != 0)
    return rc;
  if (c->ring != NULL && c->ring->xchg_bytes != c->lay.xchg_bytes) {
    snprintf(why, whylen, "the proxy's ring has an exchange region of %llu bytes, this job's "
             "layout needs %llu (a daemon of another build?)",
             (unsigned long long)c->ring->xchg_bytes, (unsigned long long)c->lay.xchg_bytes);
    return DEP_ERR_INVALID;
  }
  c->xchg = c->ring != NULL ? dep_xring_xchg(c->ring) : NULL;
  if (timeout_ms == 0) {
    snprintf(why, whylen, "op timeout is 0 ms; give a bound (e.g. 10000)");
    return DEP_ERR_INVALID;
  }
  c->shape = *s;
  c->world = world;
  c->rank = rank;
  c->timeout_ms = timeout_ms;
  c->acc = malloc((size_t)s->hidden * sizeof *c->acc);
  c->stage = malloc((size_t)s->hidden + (s->hidden / 128) * sizeof(float));
  if (c->acc == NULL || c->stage == NULL) {
    host_ops_fini(c);
    snprintf(why, whylen, "out of memory for %u-channel scratch buffers", s->hidden);
    return DEP_ERR_NO_MEMORY;
  }
  return 0;
}

void host_ops_fini(struct ops_ctx *c) {
  if (c == NULL)
    return;
  free(c->acc);
  free(c->stage);
  c->acc = NULL;
  c->stage = NULL;
}

void host_ops_handle_init(struct dep_handle *h) { memset(h, 0, sizeof *h); }

void host_ops_handle_fini(struct dep_handle *h) {
  if (h == NULL)
    return;
  if (h->mem == NULL) {
    free(h->token_ranks);
    free(h->ll_rows);
  }
  memset(h, 0, sizeof *h);
}

/* A handle's arrays for c's shape: token_ranks (TP) then ll_rows (LL),
 * each from a DEP_HANDLE_ALIGN boundary of the caller's memory. */
struct handle_carve {
  uint32_t tp_cap;
  uint64_t ll_cap, ll_off, total;
};
static struct handle_carve handle_carve(const struct ops_ctx *c) {
  const uint32_t le = local_experts(c), k = c->shape.topk;
  struct handle_carve v = {.tp_cap = c->shape.max_tokens_per_rank};
  v.ll_cap = (uint64_t)c->world * c->lay.max_ll_tokens * (k < le ? k : le);
  v.ll_off = dep_round_up((uint64_t)v.tp_cap * sizeof(uint64_t), DEP_HANDLE_ALIGN);
  v.total = v.ll_off + dep_round_up(v.ll_cap * sizeof(uint32_t[2]), DEP_HANDLE_ALIGN);
  return v;
}

uint64_t host_ops_handle_bytes(const struct ops_ctx *c) { return handle_carve(c).total; }

/* Size the handle's arrays for c's shape (once, or each time in the
 * caller's memory, which holds both) and mark it empty. */
static int handle_reserve(struct ops_ctx *c, struct dep_handle *h, uint32_t kind) {
  h->kind = OPS_HANDLE_EMPTY;
  const struct handle_carve v = handle_carve(c);
  if (h->mem != NULL) {
    if (v.total > h->mem_bytes)
      return set_why(c, DEP_ERR_INVALID, "the handle's memory (%zu bytes, dep_handle_new_in) is "
                     "less than a handle of this job takes (%llu, dep_handle_bytes): it was made "
                     "for another job; make a new handle", h->mem_bytes,
                     (unsigned long long)v.total);
    h->token_ranks = h->mem;
    h->token_cap = v.tp_cap;
    h->ll_rows = (uint32_t(*)[2])((uint8_t *)h->mem + v.ll_off);
    h->ll_cap = v.ll_cap;
  }
  if (kind == OPS_HANDLE_TP && h->token_cap < v.tp_cap) {
    uint64_t *p = realloc(h->token_ranks, (size_t)v.tp_cap * sizeof *p);
    if (p == NULL)
      return set_why(c, DEP_ERR_NO_MEMORY, "out of memory for a dispatch handle");
    h->token_ranks = p;
    h->token_cap = v.tp_cap;
  }
  if (kind == OPS_HANDLE_LL && h->ll_cap < v.ll_cap) {
    uint32_t(*p)[2] = realloc(h->ll_rows, (size_t)v.ll_cap * sizeof *p);
    if (p == NULL)
      return set_why(c, DEP_ERR_NO_MEMORY, "out of memory for a low-latency dispatch handle");
    h->ll_rows = p;
    h->ll_cap = v.ll_cap;
  }
  h->world = c->world;
  h->rank = c->rank;
  h->hidden = c->shape.hidden;
  h->topk = c->shape.topk;
  h->num_experts = c->shape.num_experts;
  h->max_tokens = c->shape.max_tokens_per_rank;
  h->max_ll_tokens = c->lay.max_ll_tokens;
  return 0;
}

/* ---- the protocol: post, wait ------------------------------------------------- */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int ring_fail(struct ops_ctx *c, uint32_t op, uint32_t dest, int code, uint64_t waited_ns);

/* The i-th look of a wait that is not met yet: yield for a while, then
 * sleep, so that many ranks sharing few cores still make progress. */
static void backoff(uint32_t i) {
  if (i < 2048) {
    sched_yield();
  } else {
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

/*
 * Hand the proxy the out block (bytes of it) and out slot for dest:
 * one descriptor, published with release ordering after everything it
 * names.  A full ring is waited on like a peer (spin, yield, sleep),
 * bounded by the op timeout; a ring the proxy stopped draining (its job
 * failed) fails the call with the proxy's code.
 */
static int ring_push(struct ops_ctx *c, uint32_t op, uint32_t dest, uint64_t bytes) {
  struct dep_xring *r = c->ring;
  uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed), start = 0;
  for (uint32_t i = 0;; i++) {
    int32_t failed = atomic_load_explicit(&r->failed, memory_order_acquire);
    if (failed != 0)
      return ring_fail(c, op, dest, failed, start ? now_ns() - start : 0);
    if (head - atomic_load_explicit(&r->tail, memory_order_acquire) < r->entries)
      break;
    if (i == 0)
      start = now_ns();
    uint64_t waited = now_ns() - start;
    if (waited > (uint64_t)c->timeout_ms * 1000000ull)
      return ring_fail(c, op, dest, DEP_ERR_TIMEOUT, waited);
    backoff(i);
  }
  struct dep_xring_desc *d = &r->desc[head % r->entries];
  d->dest = dest;
  d->parity = (uint32_t)(c->seq & 1);
  d->seq = c->seq;
  d->bytes = bytes;
  d->reserved = 0;
  atomic_store_explicit(&r->head, head + 1, memory_order_release);
  return 0;
}

/*
 * Publish this rank's block for the current call (bytes of it, from its
 * start) to dest: its control slot in dest's slab, or the out slot of our
 * exchange region and a descriptor for the proxy (dest on another node).
 */
static int post(struct ops_ctx *c, uint32_t dest, uint32_t rows, uint32_t op, uint64_t ref_seq,
                uint32_t num_tokens, uint64_t bytes) {
  unsigned parity = (unsigned)(c->seq & 1);
  struct ops_slot *s = c->remote[dest] < 0
                           ? slot_at(c, dest, parity, c->rank)
                           : (struct ops_slot *)(c->xchg +
                                                 dep_slab_out_slot(&c->lay, parity,
                                                                   (uint32_t)c->remote[dest]));
  s->rows = rows;
  s->op = op;
  s->ref_seq = ref_seq;
  s->num_tokens = num_tokens;
  atomic_store_explicit(&s->flag, c->seq, memory_order_release);
  return c->remote[dest] < 0 ? 0 : ring_push(c, op, dest, bytes);
}

/* Post to every rank, rows[d] of row_bytes each (stride: bytes apart). */
static int post_all(struct ops_ctx *c, const uint32_t *rows, uint32_t op, uint64_t ref_seq,
                    uint32_t num_tokens, uint64_t stride) {
  for (uint32_t d = 0; d < c->world; d++) {
    int rc = post(c, d, rows[d], op, ref_seq, num_tokens, (uint64_t)rows[d] * stride);
    if (rc != 0)
      return rc;
  }
  return 0;
}

static int timeout_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t seen,
                        uint64_t waited_ns) {
  struct ops_err_record *er = (struct ops_err_record *)c->slabs[c->rank];
  er->op = op & ~OPS_OP_FP8;
  er->rank = c->rank;
  er->source = src;
  er->seq = c->seq;
  er->seen_flag = seen;
  er->waited_ms = (uint32_t)(waited_ns / 1000000u);
  atomic_store_explicit(&er->code, DEP_ERR_TIMEOUT, memory_order_release);
  c->broken = 1;
  return set_why(c, DEP_ERR_TIMEOUT, "timeout in %s waiting for rank %u (call %llu, %u ms): that "
                 "rank did not make the same call; check that every rank runs the same sequence "
                 "of operations and is alive", host_ops_op_name(op), src,
                 (unsigned long long)c->seq, c->timeout_ms);
}

/*
 * Whether the daemon has written this rank's abort code (acquire) naming a
 * rank this wait for `src` depends on: src itself, or a rank that has not
 * posted this call (parity) — it never will.  A rank that posted this call
 * and then left (a clean end: it detached after its last call) does not
 * fail a wait for another, live rank that is merely slower.
 */
static inline int aborted(const struct ops_ctx *c, unsigned parity, uint32_t src) {
  const struct dep_slab_abort *ab = (const struct dep_slab_abort *)(c->slabs[c->rank] +
                                                                    DEP_SLAB_ABORT_OFF);
  if (__atomic_load_n(&ab->code, __ATOMIC_ACQUIRE) == 0)
    return 0;
  uint32_t gone = ab->rank;
  if (gone == src || gone >= c->world || ab->detached == DEP_SLAB_GONE_NODE)
    return 1;
  const struct ops_slot *g = in_slot(c, parity, gone);
  return atomic_load_explicit(&g->flag, memory_order_acquire) != c->seq;
}

/*
 * The daemon found a rank of the job gone and said so in this rank's abort
 * words (slab.h): record it as a timeout is recorded (the gone rank as the
 * source, its pid and whether it detached in seen_flag: host_ops.h) and
 * break the context, since the job cannot go on without that rank.
 */
static int peer_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t waited_ns) {
  const struct dep_slab_abort *ab = (const struct dep_slab_abort *)(c->slabs[c->rank] +
                                                                    DEP_SLAB_ABORT_OFF);
  /* The daemon stores code last with release ordering, and aborted() read
   * it with acquire: the words stored before it are visible here. */
  uint32_t gone = ab->rank, pid = ab->pid, detached = ab->detached;
  struct ops_err_record *er = (struct ops_err_record *)c->slabs[c->rank];
  er->op = op & ~OPS_OP_FP8;
  er->rank = c->rank;
  er->source = gone;
  er->seq = c->seq;
  er->seen_flag = OPS_ERR_GONE(pid, detached);
  er->waited_ms = (uint32_t)(waited_ns / 1000000u);
  atomic_store_explicit(&er->code, DEP_ERR_PEER, memory_order_release);
  c->broken = 1;
  char whom[24] = "it";
  if (gone != src)
    snprintf(whom, sizeof whom, "rank %u", src);
  return set_why(c, DEP_ERR_PEER, "rank %u (pid %u) of the job is gone (%s) while this rank "
                 "waited for %s in %s (call %llu); the job cannot go on: restart it", gone, pid,
                 ab->detached == DEP_SLAB_GONE_NODE ? "its node is lost: the peer link to its "
                                                      "daemon dropped"
                 : detached ? "it detached" : "its process ended", whom, host_ops_op_name(op),
                 (unsigned long long)c->seq);
}

/*
 * The proxy's ring did not take this call's descriptor for dest: it stayed
 * full for the op timeout, or the proxy stopped draining it (code: the
 * job failed, its peer daemon is gone).  Recorded as a wait for dest is,
 * and the context broken, since dest will not get this call.
 */
static int ring_fail(struct ops_ctx *c, uint32_t op, uint32_t dest, int code, uint64_t waited_ns) {
  struct ops_err_record *er = (struct ops_err_record *)c->slabs[c->rank];
  er->op = op & ~OPS_OP_FP8;
  er->rank = c->rank;
  er->source = dest;
  er->seq = c->seq;
  er->seen_flag = 0;
  er->waited_ms = (uint32_t)(waited_ns / 1000000u);
  atomic_store_explicit(&er->code, code, memory_order_release);
  c->broken = 1;
  if (code == DEP_ERR_TIMEOUT)
    return set_why(c, code, "%s: the proxy's ring stayed full for %u ms (call %llu, for rank %u "
                   "on another node); the daemon's proxy is stuck or its link to that node is "
                   "too slow: see deepepctl peers", host_ops_op_name(op), c->timeout_ms,
                   (unsigned long long)c->seq, dest);
  return set_why(c, code, "%s: the daemon's proxy stopped serving this rank (call %llu, for rank "
                 "%u on another node): %s; restart the job", host_ops_op_name(op),
                 (unsigned long long)c->seq, dest,
                 code == DEP_ERR_PEER ? "a node of the job is gone" : dep_strerror(code));
}

/*
 * Wait until every source has posted this call into our slab, then check
 * that each made the same operation.  Spins briefly, then yields, then
 * sleeps, so that many ranks sharing few cores still make progress.  A
 * flag not there yet is then checked against the abort words (never
 * before: a rank that posted everything and then left is no error), and a
 * gone rank this wait depends on (aborted) fails the call at once rather
 * than after the timeout.
 */
static int wait_all(struct ops_ctx *c, uint32_t op) {
  unsigned parity = (unsigned)(c->seq & 1);
  uint64_t start = now_ns(), limit = (uint64_t)c->timeout_ms * 1000000ull;
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    for (uint32_t i = 0;; i++) {
      uint64_t f = atomic_load_explicit(&s->flag, memory_order_acquire);
      if (f == c->seq)
        break;
      if (f > c->seq) {
        c->broken = 1;
        return set_why(c, DEP_ERR_MISMATCH, "%s: rank %u is at call %llu, this rank at call %llu; "
                       "a rank restarted or the slabs were not fresh: restart the job",
                       host_ops_op_name(op), src, (unsigned long long)f,
                       (unsigned long long)c->seq);
      }
      if (i < 256)
        continue;
      uint64_t waited = now_ns() - start;
      /* The flag again after the abort words: a rank that posted and then
       * left between the two reads (this one preempted) is no error. */
      if (aborted(c, parity, src) &&
          atomic_load_explicit(&s->flag, memory_order_acquire) != c->seq)
        return peer_fail(c, op, src, waited);
      if (waited > limit)
        return timeout_fail(c, op, src, f, waited);
      backoff(i);
    }
  }
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    if (s->op != op)
      return set_why(c, DEP_ERR_MISMATCH, "call %llu: this rank ran %s%s, rank %u ran %s%s; every "
                     "rank must make the same sequence of calls", (unsigned long long)c->seq,
                     host_ops_op_name(op), (op & OPS_OP_FP8) ? " (fp8)" : "", src,
                     host_ops_op_name(s->op), (s->op & OPS_OP_FP8) ? " (fp8)" : "");
  }
  return 0;
}

/* A combine's sources must all answer the same dispatch with the rows expected. */
static int check_combine_slots(struct ops_ctx *c, const struct dep_handle *h,
                               const uint32_t *expect) {
  unsigned parity = (unsigned)(c->seq & 1);
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    if (s->ref_seq != h->seq)
      return set_why(c, DEP_ERR_MISMATCH, "%s: rank %u combined the dispatch of call %llu, this "
                     "rank the dispatch of call %llu; pass each rank the handle of the same call",
                     host_ops_op_name(s->op), src, (unsigned long long)s->ref_seq,
                     (unsigned long long)h->seq);
    if (s->rows != expect[src])
      return set_why(c, DEP_ERR_MISMATCH, "%s: rank %u sent %u vectors back, %u expected",
                     host_ops_op_name(s->op), src, s->rows, expect[src]);
  }
  return 0;
}

static int begin(struct ops_ctx *c) {
  if (c->acc == NULL || c->stage == NULL)
    return set_why(c, DEP_ERR_STATE, "ops context not initialised (host_ops_init)");
  if (c->broken)
    return set_why(c, DEP_ERR_STATE, "an earlier call timed out or found a rank of the job "
                   "gone, so the ranks are out of step; detach and restart the job");
  c->seq++;
  return 0;
}

/* ---- layout ------------------------------------------------------------------ */

int host_ops_layout(struct ops_ctx *c, const struct dep_layout_args *a) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_layout(c, a, c->why, sizeof c->why);
  if (rc != 0)
    return rc;
  uint32_t k = c->shape.topk, le = local_experts(c);
  memset(a->tokens_per_rank, 0, c->world * sizeof(int32_t));
  memset(a->tokens_per_expert, 0, c->shape.num_experts * sizeof(int32_t));
  for (uint32_t t = 0; t < a->num_tokens; t++) {
    uint64_t mask = 0;
    for (uint32_t j = 0; j < k; j++) {
      int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
      if (e < 0)
        continue;
      a->tokens_per_expert[e]++;
      mask |= 1ull << (e / le);
    }
    for (uint32_t d = 0; d < c->world; d++) {
      uint8_t in = (uint8_t)((mask >> d) & 1u);
      a->token_in_rank[(size_t)t * c->world + d] = in;
      a->tokens_per_rank[d] += in;
    }
  }
  return 0;
}

/* ---- throughput mode ------------------------------------------------------------ */

/* A token's payload into a row: bf16, or h e4m3 bytes then h/128 float32 scales. */
static void put_payload(const struct ops_ctx *c, const struct dep_dispatch_args *a, uint32_t t,
                        uint8_t *row) {
  const uint32_t hid = c->shape.hidden, groups = hid / 128;
  if (a->use_fp8) {
    memcpy(row, (const uint8_t *)a->x + (size_t)t * hid, hid);
    memcpy(row + hid, a->x_scales + (size_t)t * groups, groups * sizeof(float));
  } else {
    memcpy(row, (const uint16_t *)a->x + (size_t)t * hid, 2u * hid);
  }
}

/*
 * Throughput dispatch.  Fresh: each token to every rank owning one of its
 * experts, with its remapped ids and weights.  Cached (a->cached): to the
 * ranks h's dispatch sent it to, in the same rows (each rank's rows are in
 * token order either way), payload only, and h is left as it was.
 */
int host_ops_dispatch(struct ops_ctx *c, const struct dep_dispatch_args *a, struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_dispatch(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (!a->cached && (rc = handle_reserve(c, h, OPS_HANDLE_TP)) != 0) ||
      (rc = begin(c)) != 0)
    return rc;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  const uint32_t groups = hid / 128;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t op = OPS_OP_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0) |
                      (a->cached ? OPS_OP_CACHED : 0);
  uint32_t sent[DEP_MAX_LOCAL_RANKS] = {0};

  for (uint32_t t = 0; t < a->num_tokens; t++) {
    uint64_t mask = 0;
    if (a->cached) {
      mask = h->token_ranks[t];
    } else {
      for (uint32_t j = 0; j < k; j++) {
        int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
        if (e >= 0)
          mask |= 1ull << (e / le);
      }
      h->token_ranks[t] = mask;
    }
    for (uint32_t d = 0; d < c->world; d++) {
      if (!((mask >> d) & 1u))
        continue;
      uint8_t *row = out_row(c, d, parity, sent[d]++);
      put_payload(c, a, t, row);
      int32_t *meta = (int32_t *)(row + ops_meta_off(hid));
      meta[0] = (int32_t)t;
      meta[1] = (int32_t)k;
      if (a->cached)
        continue;
      int32_t *ids = (int32_t *)(row + ops_ids_off(hid));
      float *w = (float *)(row + ops_weights_off(hid, k));
      for (uint32_t j = 0; j < k; j++) {
        int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
        int mine = e >= 0 && (uint64_t)e / le == d;
        ids[j] = mine ? (int32_t)(e % le) : -1;
        w[j] = mine ? a->topk_weights[(size_t)t * k + j] : 0.0f;
      }
    }
  }
  if ((rc = post_all(c, sent, op, a->cached ? h->seq : 0, a->num_tokens, c->lay.row_bytes)) != 0 ||
      (rc = wait_all(c, op)) != 0)
    return rc;

  /* Check every source's row count before writing anything. */
  uint32_t from[DEP_MAX_LOCAL_RANKS];
  uint64_t total = 0;
  for (uint32_t src = 0; src < c->world; src++) {
    const struct ops_slot *sl = in_slot(c, parity, src);
    uint32_t n = sl->rows;
    if (n > c->shape.max_tokens_per_rank)
      return set_why(c, DEP_ERR_MISMATCH, "dispatch: rank %u posted %u rows, over the job's "
                     "max_tokens_per_rank %u", src, n, c->shape.max_tokens_per_rank);
    if (a->cached && sl->ref_seq != h->seq)
      return set_why(c, DEP_ERR_MISMATCH, "dispatch (cached): rank %u routed by the dispatch of "
                     "call %llu, this rank by that of call %llu; pass each rank the handle of "
                     "the same dispatch", src, (unsigned long long)sl->ref_seq,
                     (unsigned long long)h->seq);
    if (a->cached && n != h->recv_from[src])
      return set_why(c, DEP_ERR_MISMATCH, "dispatch (cached): rank %u sent %u rows, its "
                     "dispatch %u", src, n, h->recv_from[src]);
    from[src] = n;
    total += n;
  }
  if (a->num_worst_tokens != 0 && total > a->num_worst_tokens)
    return set_why(c, DEP_ERR_INVALID, "dispatch: num_worst_tokens %u is below the %llu rows "
                   "this rank received; give at least the rows a rank can receive (world_size "
                   "* max_tokens_per_rank at most)", a->num_worst_tokens,
                   (unsigned long long)total);
  if (!a->cached)
    memset(a->recv_count_per_expert, 0, le * sizeof(int32_t));
  uint8_t *rx = a->recv_x;
  const int wide = a->recv_index_type == DEP_INDEX_I64;
  uint64_t off = 0;
  for (uint32_t src = 0; src < c->world; src++) {
    for (uint32_t j = 0; j < from[src]; j++, off++) {
      const uint8_t *row = in_row(c, parity, src, j);
      if (a->use_fp8) {
        memcpy(rx + off * hid, row, hid);
        memcpy(a->recv_x_scales + off * groups, row + hid, groups * sizeof(float));
      } else {
        memcpy(rx + off * 2u * hid, row, 2u * hid);
      }
      if (a->cached)
        continue;
      const int32_t *ids = (const int32_t *)(row + ops_ids_off(hid));
      const float *w = (const float *)(row + ops_weights_off(hid, k));
      for (uint32_t i = 0; i < k; i++) {
        int32_t l = ids[i] >= 0 && (uint32_t)ids[i] < le ? ids[i] : -1;
        ridx_put(a->recv_topk_idx, wide, off * k + i, l);
        a->recv_topk_weights[off * k + i] = l >= 0 ? w[i] : 0.0f;
        if (l >= 0)
          a->recv_count_per_expert[l]++;
      }
    }
  }
  if (a->cached) {
    if (a->num_worst_tokens == 0)
      *a->num_recv = (uint32_t)total;
    return 0;
  }
  /* DeepEP's padding of the worst-case rows, and its rounded counts. */
  for (uint64_t i = total * k; i < (uint64_t)a->num_worst_tokens * k; i++) {
    ridx_put(a->recv_topk_idx, wide, i, -1);
    a->recv_topk_weights[i] = 0.0f;
  }
  if (a->expert_alignment > 1)
    for (uint32_t l = 0; l < le; l++) {
      uint32_t m = a->expert_alignment, v = (uint32_t)a->recv_count_per_expert[l];
      a->recv_count_per_expert[l] = (int32_t)((v + m - 1) / m * m);
    }
  if (a->recv_count_per_expert_host != NULL) /* it may be recv_count_per_expert itself */
    memmove(a->recv_count_per_expert_host, a->recv_count_per_expert, le * sizeof(int32_t));
  for (uint32_t src = 0; src < c->world; src++)
    h->recv_from[src] = from[src];
  if (a->num_worst_tokens == 0)
    *a->num_recv = (uint32_t)total;
  h->num_recv = (uint32_t)total;
  h->worst = a->num_worst_tokens;
  h->num_tokens = a->num_tokens;
  h->seq = c->seq;
  h->kind = OPS_HANDLE_TP;
  return 0;
}

/*
 * Throughput combine: every received row's vector back to its origin, and
 * in a weighted combine (out_topk_weights given) its topk weights too, in
 * the row where dispatch put the weights; both summed in float32, sources
 * ascending.
 */
int host_ops_combine(struct ops_ctx *c, const struct dep_combine_args *a,
                     const struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_combine(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (rc = begin(c)) != 0)
    return rc;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint16_t *x = a->x;
  const int weighted = a->out_topk_weights != NULL;
  const uint32_t op = OPS_OP_COMBINE | (weighted ? OPS_OP_WEIGHTS : 0);

  /* Rows from each source are contiguous in x, sources ascending: send each
   * source its rows back, in the order they came. */
  uint64_t off = 0;
  for (uint32_t d = 0; d < c->world; d++)
    for (uint32_t j = 0; j < h->recv_from[d]; j++, off++) {
      uint8_t *row = out_row(c, d, parity, j);
      memcpy(row, x + off * hid, 2u * hid);
      if (weighted)
        memcpy(row + ops_weights_off(hid, k), a->topk_weights + off * k, k * sizeof(float));
    }
  if ((rc = post_all(c, h->recv_from, op, h->seq, h->num_tokens, c->lay.row_bytes)) != 0 ||
      (rc = wait_all(c, op)) != 0)
    return rc;
  uint32_t expect[DEP_MAX_LOCAL_RANKS] = {0}, cursor[DEP_MAX_LOCAL_RANKS] = {0};
  for (uint32_t t = 0; t < h->num_tokens; t++)
    for (uint32_t d = 0; d < c->world; d++)
      expect[d] += (uint32_t)((h->token_ranks[t] >> d) & 1u);
  if ((rc = check_combine_slots(c, h, expect)) != 0)
    return rc;

  uint16_t *out = a->out;
  float *acc = c->acc, wacc[DEP_SHAPE_MAX_TOPK];
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    memset(acc, 0, hid * sizeof *acc);
    memset(wacc, 0, sizeof wacc);
    for (uint32_t r = 0; r < c->world; r++) {
      if (!((h->token_ranks[t] >> r) & 1u))
        continue;
      const uint8_t *row = in_row(c, parity, r, cursor[r]++);
      const uint16_t *v = (const uint16_t *)row;
      for (uint32_t i = 0; i < hid; i++)
        acc[i] += host_ops_bf16_to_float(v[i]);
      if (weighted) {
        const float *w = (const float *)(row + ops_weights_off(hid, k));
        for (uint32_t j = 0; j < k; j++)
          wacc[j] += w[j];
      }
    }
    for (uint32_t i = 0; i < hid; i++)
      out[(size_t)t * hid + i] = host_ops_float_to_bf16(acc[i]);
    if (weighted)
      memcpy(a->out_topk_weights + (size_t)t * k, wacc, k * sizeof(float));
  }
  return 0;
}

/* ---- low-latency mode --------------------------------------------------------------- */

/* A token's distinct experts on each rank, in order of first appearance. */
struct token_sel {
  uint64_t mask;                          /* ranks it goes to */
  uint8_t n[DEP_MAX_LOCAL_RANKS];         /* distinct local experts per rank */
  int32_t ids[DEP_MAX_LOCAL_RANKS][16];   /* those local experts */
  int32_t vec[16];                        /* per k: index among its rank's distinct experts */
};

static void select_token(const struct ops_ctx *c, const void *idx, int type, uint32_t t,
                         struct token_sel *s) {
  const uint32_t k = c->shape.topk, le = local_experts(c);
  s->mask = 0;
  for (uint32_t j = 0; j < k; j++) {
    int64_t e = idx_at(idx, type, (size_t)t * k + j);
    s->vec[j] = -1;
    if (e < 0)
      continue;
    uint32_t d = (uint32_t)(e / le);
    int32_t l = (int32_t)(e % le);
    if (!((s->mask >> d) & 1u)) {
      s->mask |= 1ull << d;
      s->n[d] = 0;
    }
    uint32_t i = 0;
    while (i < s->n[d] && s->ids[d][i] != l)
      i++;
    if (i == s->n[d])
      s->ids[d][s->n[d]++] = l;
    s->vec[j] = (int32_t)i;
  }
}

int host_ops_ll_dispatch(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_ll_dispatch(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (rc = handle_reserve(c, h, OPS_HANDLE_LL)) != 0 || (rc = begin(c)) != 0)
    return rc;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  const uint32_t kd = k < le ? k : le, groups = hid / 128;
  const uint64_t rows = (uint64_t)c->world * c->lay.max_ll_tokens;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t op = OPS_OP_LL_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0);
  const size_t payload = a->use_fp8 ? hid + groups * sizeof(float) : 2u * hid;
  const uint16_t *x = a->x;
  uint32_t sent[DEP_MAX_LOCAL_RANKS] = {0};
  struct token_sel sel;

  for (uint32_t t = 0; t < a->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    if (sel.mask == 0)
      continue;
    const void *src = x + (size_t)t * hid;
    if (a->use_fp8) {
      token_to_fp8(x + (size_t)t * hid, hid, c->stage); /* once per token, not per rank */
      src = c->stage;
    }
    for (uint32_t d = 0; d < c->world; d++) {
      if (!((sel.mask >> d) & 1u))
        continue;
      uint8_t *row = out_row(c, d, parity, sent[d]++);
      memcpy(row, src, payload);
      int32_t *meta = (int32_t *)(row + ops_meta_off(hid));
      meta[0] = (int32_t)t;
      meta[1] = sel.n[d];
      memcpy(row + ops_ids_off(hid), sel.ids[d], sel.n[d] * sizeof(int32_t));
    }
  }
  if ((rc = post_all(c, sent, op, 0, a->num_tokens, c->lay.row_bytes)) != 0 ||
      (rc = wait_all(c, op)) != 0)
    return rc;

  for (uint32_t src = 0; src < c->world; src++)
    if (in_slot(c, parity, src)->rows > c->lay.max_ll_tokens)
      return set_why(c, DEP_ERR_MISMATCH, "ll_dispatch: rank %u posted %u rows, over the job's "
                     "max_ll_tokens_per_rank %u", src, in_slot(c, parity, src)->rows,
                     c->lay.max_ll_tokens);
  /* Expand each received token into its experts' rows: sources ascending,
   * tokens ascending, so each expert's rows are in (source, token) order. */
  memset(a->recv_count, 0, le * sizeof(int32_t));
  uint64_t nv = 0;
  for (uint32_t src = 0; src < c->world; src++) {
    uint32_t n = in_slot(c, parity, src)->rows, owed = 0;
    for (uint32_t j = 0; j < n; j++) {
      const uint8_t *row = in_row(c, parity, src, j);
      const int32_t *meta = (const int32_t *)(row + ops_meta_off(hid));
      const int32_t *ids = (const int32_t *)(row + ops_ids_off(hid));
      uint32_t nids = meta[1] >= 0 && (uint32_t)meta[1] <= kd ? (uint32_t)meta[1] : 0;
      for (uint32_t i = 0; i < nids; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= le || (uint64_t)a->recv_count[ids[i]] >= rows)
          return set_why(c, DEP_ERR_MISMATCH, "ll_dispatch: rank %u sent a malformed row %u",
                         src, j);
        uint32_t l = (uint32_t)ids[i], pos = (uint32_t)a->recv_count[l]++;
        uint64_t at = (uint64_t)l * rows + pos;
        if (a->use_fp8) {
          memcpy((uint8_t *)a->recv_x + at * hid, row, hid);
          memcpy(a->recv_scales + at * groups, row + hid, groups * sizeof(float));
        } else {
          memcpy((uint16_t *)a->recv_x + at * hid, row, 2u * hid);
        }
        h->ll_rows[nv][0] = l;
        h->ll_rows[nv][1] = pos;
        nv++;
        owed++;
      }
    }
    h->recv_from[src] = owed;
  }
  h->num_tokens = a->num_tokens;
  h->num_recv = (uint32_t)nv;
  h->idx_hash = ops_check_idx_hash(a->topk_idx, a->index_type, (size_t)a->num_tokens * k);
  h->seq = c->seq;
  h->kind = OPS_HANDLE_LL;
  return 0;
}

int host_ops_ll_combine(struct ops_ctx *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_ll_combine(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (rc = begin(c)) != 0)
    return rc;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  const uint64_t rows = (uint64_t)c->world * c->lay.max_ll_tokens;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint16_t *x = a->x;

  /* Send each source one vector per (token, distinct local expert), in
   * the order the dispatch received them, which is the order the origin
   * enumerates them from its topk_idx. */
  uint64_t nv = 0;
  for (uint32_t d = 0; d < c->world; d++) {
    uint8_t *block = out_block(c, d, parity);
    for (uint32_t i = 0; i < h->recv_from[d]; i++, nv++) {
      uint64_t at = (uint64_t)h->ll_rows[nv][0] * rows + h->ll_rows[nv][1];
      memcpy(block + (uint64_t)i * 2u * hid, x + at * hid, 2u * hid);
    }
  }
  if ((rc = post_all(c, h->recv_from, OPS_OP_LL_COMBINE, h->seq, h->num_tokens, 2ull * hid)) != 0 ||
      (rc = wait_all(c, OPS_OP_LL_COMBINE)) != 0)
    return rc;

  struct token_sel sel;
  uint32_t expect[DEP_MAX_LOCAL_RANKS] = {0}, base[DEP_MAX_LOCAL_RANKS] = {0};
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    for (uint32_t d = 0; d < c->world; d++)
      if ((sel.mask >> d) & 1u)
        expect[d] += sel.n[d];
  }
  if ((rc = check_combine_slots(c, h, expect)) != 0)
    return rc;

  uint16_t *out = a->out;
  float *acc = c->acc;
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    memset(acc, 0, hid * sizeof *acc);
    for (uint32_t j = 0; j < k; j++) {
      int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
      if (e < 0)
        continue;
      uint32_t d = (uint32_t)(e / (c->shape.num_experts / c->world));
      const uint16_t *v = (const uint16_t *)(in_row(c, parity, d, 0) +
                                             (uint64_t)(base[d] + (uint32_t)sel.vec[j]) * 2u * hid);
      float w = a->topk_weights[(size_t)t * k + j];
      for (uint32_t i = 0; i < hid; i++)
        acc[i] += w * host_ops_bf16_to_float(v[i]);
    }
    for (uint32_t d = 0; d < c->world; d++)
      if ((sel.mask >> d) & 1u)
        base[d] += sel.n[d];
    for (uint32_t i = 0; i < hid; i++)
      out[(size_t)t * hid + i] = host_ops_float_to_bf16(acc[i]);
  }
  return 0;
}

void host_ops_err_read(const uint8_t *slab, struct ops_err_record *out) {
  struct ops_err_record *er = (struct ops_err_record *)(uintptr_t)slab;
  int32_t code = atomic_load_explicit(&er->code, memory_order_acquire);
  memcpy((uint8_t *)out + sizeof out->code, (const uint8_t *)er + sizeof er->code,
         sizeof *out - sizeof out->code);
  atomic_init(&out->code, code);
}
