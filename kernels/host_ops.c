/*
 * host_ops.c — the host backend's operations (DESIGN §6), their common part:
 * ranks are processes that share every rank's slab, push their rows into
 * the receivers' slabs and publish a flag per (receiver, source) with
 * release ordering.  Here are the context and its handles, the number
 * formats, and the protocol by which a call posts its blocks and waits for
 * every source's; the calls themselves are in host_ops_tp.c (layout,
 * dispatch, combine), host_ops_ll.c (the low-latency pair) and
 * host_ops_mask.c (masked ranks).  The
 * protocol, slot, row and error-record layouts are described in host_ops.h.
 *
 * Every order is fixed (sources ascending, tokens ascending, k ascending),
 * and every sum is a float32 sum in that order rounded once to bf16, so the
 * same inputs give bit-identical outputs on every run.
 */
#include "host_ops_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "shape.h"

const char *host_ops_op_name(uint32_t op) {
  switch (op & ~(OPS_OP_FP8 | OPS_OP_CACHED | OPS_OP_WEIGHTS)) {
  case OPS_OP_DISPATCH: return "dispatch";
  case OPS_OP_COMBINE: return "combine";
  case OPS_OP_LL_DISPATCH: return "ll_dispatch";
  case OPS_OP_LL_COMBINE: return "ll_combine";
  default: return "unknown op";
  }
}

/* The modes or-ed into a slot's op, as a mismatch message shows them after the name. */
const char *host_ops__op_modes(uint32_t op) {
  static const char *const modes[8] = {"", " (fp8)", " (cached)", " (fp8, cached)", " (weighted)",
                                       " (fp8, weighted)", " (cached, weighted)",
                                       " (fp8, cached, weighted)"};
  return modes[((op & OPS_OP_FP8) ? 1 : 0) | ((op & OPS_OP_CACHED) ? 2 : 0) |
               ((op & OPS_OP_WEIGHTS) ? 4 : 0)];
}

/* ---- number formats --------------------------------------------------------- */

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

/* ---- context and handles ---------------------------------------------------- */

static int init_nodes(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world,
                      uint32_t rank, uint8_t *const *slabs, struct dep_xring *ring,
                      uint32_t chunk_rows, uint32_t timeout_ms, char *why, size_t whylen);

int host_ops_init(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world, uint32_t rank,
                  uint8_t *const *slabs, uint32_t timeout_ms, char *why, size_t whylen) {
  return host_ops_init_nodes(c, s, world, rank, slabs, NULL, 0, timeout_ms, why, whylen);
}

int host_ops_init_nodes(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world,
                        uint32_t rank, uint8_t *const *slabs, struct dep_xring *ring,
                        uint32_t chunk_rows, uint32_t timeout_ms, char *why, size_t whylen) {
  if (c == NULL || s == NULL || slabs == NULL) {
    snprintf(why, whylen, "host_ops_init: NULL context, shape or slab table");
    return DEP_ERR_INVALID;
  }
  memset(c, 0, sizeof *c);
  if (world == 0 || world > DEP_MAX_WORLD || rank >= world) {
    snprintf(why, whylen, "rank %u of world %u: the operations run 1..%u ranks in all", rank,
             world, DEP_MAX_WORLD);
    return DEP_ERR_INVALID;
  }
  int rc = dep__shape_check(s, world, why, whylen);
  if (rc == 0)
    rc = init_nodes(c, s, world, rank, slabs, ring, chunk_rows, timeout_ms, why, whylen);
  if (rc != 0)
    host_ops_fini(c);
  return rc;
}

/*
 * The nodes this rank's dispatch rows reach through one node channel each,
 * from the fan table the daemon wrote into the ring (xring.h): every remote
 * rank whose entry names a lead is a rank of that lead's node.  What the
 * daemon wrote is checked like anything lent: a lead that is no remote
 * rank, or whose own entry names another, is refused.
 */
static int init_fan(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world, char *why,
                    size_t whylen) {
  const uint32_t nr = c->lay.n_remote;
  uint32_t *node_of_lead = malloc((size_t)nr * sizeof *node_of_lead);
  c->node_of = malloc((size_t)world * sizeof *c->node_of);
  c->node = calloc(nr, sizeof *c->node);
  c->node_ranks = malloc((size_t)nr * sizeof *c->node_ranks);
  c->nodelist = malloc((size_t)s->max_tokens_per_rank * s->topk * sizeof *c->nodelist);
  if (node_of_lead == NULL || c->node_of == NULL || c->node == NULL || c->node_ranks == NULL ||
      c->nodelist == NULL) {
    free(node_of_lead);
    snprintf(why, whylen, "out of memory for the node tables of %u remote ranks", nr);
    return DEP_ERR_NO_MEMORY;
  }
  for (uint32_t i = 0; i < nr; i++)
    node_of_lead[i] = OPS_NO_NODE;
  int rc = 0;
  for (uint32_t r = 0; r < world && rc == 0; r++) {
    c->node_of[r] = OPS_NO_NODE;
    const uint32_t v = c->remote[r] >= 0 ? c->ring->fan[c->remote[r]] : 0;
    if (v == 0)
      continue;
    if (v > nr || c->ring->fan[v - 1] != v) {
      snprintf(why, whylen, "the proxy's ring names remote rank number %u as the lead of rank "
               "%u's node, which is not one (a daemon of another build?)", v - 1, r);
      rc = DEP_ERR_INVALID;
      break;
    }
    if (node_of_lead[v - 1] == OPS_NO_NODE)
      node_of_lead[v - 1] = c->n_nodes++;
    c->node_of[r] = node_of_lead[v - 1];
    c->node[c->node_of[r]].n++;
  }
  free(node_of_lead);
  if (rc != 0)
    return rc;
  /* Each node's ranks, ascending; its lead is the one the table names. */
  for (uint32_t n = 0, at = 0; n < c->n_nodes; n++) {
    c->node[n].first = at;
    at += c->node[n].n;
    c->node[n].n = 0;
  }
  for (uint32_t r = 0; r < world; r++) {
    if (c->node_of[r] == OPS_NO_NODE)
      continue;
    struct ops_node *n = &c->node[c->node_of[r]];
    c->node_ranks[n->first + n->n++] = r;
    if (c->ring->fan[c->remote[r]] == (uint32_t)c->remote[r] + 1)
      n->lead = r;
  }
  return 0;
}

/* host_ops_init_nodes past its checks of the world and the shape; what it
 * allocated is the caller's to free (host_ops_fini) whatever it returns. */
static int init_nodes(struct ops_ctx *c, const struct dep_job_shape *s, uint32_t world,
                      uint32_t rank, uint8_t *const *slabs, struct dep_xring *ring,
                      uint32_t chunk_rows, uint32_t timeout_ms, char *why, size_t whylen) {
  /* Every per-rank table is sized by the job's world, once, here: no call
   * allocates.  (The rows of each rank's tokens, rowlist, are at most a
   * row per (token, k).) */
  c->slabs = calloc(world, sizeof *c->slabs);
  c->remote = calloc(world, sizeof *c->remote);
  c->per_rank = calloc((size_t)OPS_PER_RANK * world, sizeof *c->per_rank);
  c->peer = calloc(world, sizeof *c->peer);
  c->rowoff = calloc((size_t)world + 1, sizeof *c->rowoff);
  c->rowlist = calloc((size_t)s->max_tokens_per_rank * s->topk, sizeof *c->rowlist);
  c->own = calloc(DEP_SLAB_MASK_WORDS(world), sizeof *c->own);
  c->mask = calloc(DEP_SLAB_MASK_WORDS(world), sizeof *c->mask);
  c->live = calloc(DEP_SLAB_MASK_WORDS(world), sizeof *c->live);
  c->pend[0].mask = calloc(DEP_SLAB_MASK_WORDS(world), sizeof *c->mask);
  c->pend[1].mask = calloc(DEP_SLAB_MASK_WORDS(world), sizeof *c->mask);
  if (c->slabs == NULL || c->remote == NULL || c->per_rank == NULL || c->peer == NULL ||
      c->rowoff == NULL || c->rowlist == NULL || c->own == NULL || c->mask == NULL ||
      c->live == NULL || c->pend[0].mask == NULL || c->pend[1].mask == NULL) {
    snprintf(why, whylen, "out of memory for the tables of a world of %u ranks", world);
    return DEP_ERR_NO_MEMORY;
  }
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
  int rc = dep__slab_layout_nodes(s, world, local, chunk_rows, &c->lay, why, whylen);
  if (rc != 0)
    return rc;
  if (c->ring != NULL && c->ring->xchg_bytes != c->lay.xchg_bytes) {
    snprintf(why, whylen, "the proxy's ring has an exchange region of %llu bytes, this job's "
             "layout needs %llu (a daemon of another build?)",
             (unsigned long long)c->ring->xchg_bytes, (unsigned long long)c->lay.xchg_bytes);
    return DEP_ERR_INVALID;
  }
  c->xchg = c->ring != NULL ? dep_xring_xchg(c->ring) : NULL;
  if (c->ring != NULL && (rc = init_fan(c, s, world, why, whylen)) != 0)
    return rc;
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
  free(c->slabs);
  free(c->remote);
  free(c->per_rank);
  free(c->peer);
  free(c->rowoff);
  free(c->rowlist);
  free(c->node);
  free(c->node_of);
  free(c->node_ranks);
  free(c->nodelist);
  c->node = NULL;
  c->node_of = NULL;
  c->node_ranks = NULL;
  c->nodelist = NULL;
  c->n_nodes = 0;
  free(c->own);
  free(c->mask);
  free(c->live);
  c->own = NULL;
  c->mask = NULL;
  c->live = NULL;
  c->live_epoch = c->live_join_max = 0;
  for (int p = 0; p < 2; p++) {
    free(c->pend[p].mask);
    c->pend[p] = (struct ops_pending){0};
  }
  c->nmasked = 0;
  c->peer = NULL;
  c->rowoff = NULL;
  c->rowlist = NULL;
  c->acc = NULL;
  c->stage = NULL;
  c->slabs = NULL;
  c->remote = NULL;
  c->per_rank = NULL;
}

void host_ops_handle_init(struct dep_handle *h) { memset(h, 0, sizeof *h); }

void host_ops_handle_fini(struct dep_handle *h) {
  if (h == NULL)
    return;
  if (h->mem == NULL) {
    free(h->token_ranks);
    free(h->ll_rows);
  }
  if (h->recv_cap > 0)
    free(h->recv_from);
  memset(h, 0, sizeof *h);
}

/* A handle's arrays for c's shape, each from a DEP_HANDLE_ALIGN boundary of
 * the caller's memory: token_ranks then token_nranks (TP), recv_from (both
 * kinds), ll_rows (LL). */
struct handle_carve {
  uint32_t tp_cap;
  uint64_t nranks_off, tp_bytes, recv_off, ll_cap, ll_off, total;
};
static struct handle_carve handle_carve(const struct ops_ctx *c) {
  const uint32_t le = local_experts(c), k = c->shape.topk;
  struct handle_carve v = {.tp_cap = c->shape.max_tokens_per_rank};
  v.ll_cap = (uint64_t)c->world * c->lay.max_ll_tokens * (k < le ? k : le);
  v.nranks_off = dep_round_up((uint64_t)v.tp_cap * k * sizeof(uint32_t), DEP_HANDLE_ALIGN);
  v.tp_bytes = v.nranks_off + dep_round_up(v.tp_cap, DEP_HANDLE_ALIGN);
  v.recv_off = v.tp_bytes;
  v.ll_off = v.recv_off + dep_round_up((uint64_t)c->world * sizeof(uint32_t), DEP_HANDLE_ALIGN);
  v.total = v.ll_off + dep_round_up(v.ll_cap * sizeof(struct ops_ll_vec), DEP_HANDLE_ALIGN);
  return v;
}

uint64_t host_ops_handle_bytes(const struct ops_ctx *c) { return handle_carve(c).total; }

/* Size the handle's arrays for c's shape (once, or each time in the
 * caller's memory, which holds them all) and mark it empty. */
int host_ops__handle_reserve(struct ops_ctx *c, struct dep_handle *h, uint32_t kind) {
  h->kind = OPS_HANDLE_EMPTY;
  const struct handle_carve v = handle_carve(c);
  if (h->mem != NULL) {
    if (v.total > h->mem_bytes)
      return set_why(c, DEP_ERR_INVALID, "the handle's memory (%zu bytes, dep_handle_new_in) is "
                     "less than a handle of this job takes (%llu, dep_handle_bytes): it was made "
                     "for another job; make a new handle", h->mem_bytes,
                     (unsigned long long)v.total);
    h->token_ranks = h->mem;
    h->token_nranks = (uint8_t *)h->mem + v.nranks_off;
    h->recv_from = (uint32_t *)((uint8_t *)h->mem + v.recv_off);
    h->ll_rows = (struct ops_ll_vec *)((uint8_t *)h->mem + v.ll_off);
    h->ll_cap = v.ll_cap;
  } else {
    if (kind == OPS_HANDLE_TP && h->tp_bytes < v.tp_bytes) {
      uint32_t *p = realloc(h->token_ranks, (size_t)v.tp_bytes);
      if (p == NULL)
        return set_why(c, DEP_ERR_NO_MEMORY, "out of memory for a dispatch handle");
      h->token_ranks = p;
      h->tp_bytes = v.tp_bytes;
    }
    if (h->token_ranks != NULL) /* carved again: topk may differ from the last job's */
      h->token_nranks = (uint8_t *)h->token_ranks + v.nranks_off;
    if (h->recv_cap < c->world) {
      uint32_t *p = realloc(h->recv_from, (size_t)c->world * sizeof *p);
      if (p == NULL)
        return set_why(c, DEP_ERR_NO_MEMORY, "out of memory for a handle's %u counts",
                       c->world);
      h->recv_from = p;
      h->recv_cap = c->world;
    }
  }
  if (kind == OPS_HANDLE_LL && h->ll_cap < v.ll_cap) {
    struct ops_ll_vec *p = realloc(h->ll_rows, (size_t)v.ll_cap * sizeof *p);
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
void host_ops__backoff(uint32_t i) {
  if (i < 2048) {
    sched_yield();
  } else {
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

/*
 * Hand the proxy what a descriptor of kind names for dest (xring.h): one
 * descriptor, published with release ordering after everything it names.
 * A full ring is waited on like a peer (spin, yield, sleep), bounded by
 * the op timeout; a ring the proxy stopped draining (its job failed) fails
 * the call with the proxy's code.
 */
int host_ops__ring_push(struct ops_ctx *c, uint32_t op, uint32_t dest, uint32_t kind,
                        uint32_t row0, uint64_t bytes) {
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
    host_ops__backoff(i);
  }
  struct dep_xring_desc *d = &r->desc[head % r->entries];
  d->dest = dest;
  d->parity = (uint32_t)(c->seq & 1);
  d->seq = c->seq;
  d->bytes = bytes;
  d->kind = kind;
  d->row0 = row0;
  atomic_store_explicit(&r->head, head + 1, memory_order_release);
  return 0;
}

/*
 * Publish this rank's block for the current call (bytes of it, from its
 * start) to dest: its control slot in dest's slab, or the out slot of our
 * exchange region and a descriptor for the proxy (dest on another node).
 */
void host_ops__slot_post(struct ops_ctx *c, uint32_t dest, uint32_t rows, uint32_t op,
                         uint64_t ref_seq, uint32_t num_tokens) {
  struct ops_slot *s = out_slot(c, dest);
  s->rows = rows;
  s->op = op;
  s->ref_seq = ref_seq;
  s->num_tokens = num_tokens;
  /* Whether the call before this one is read (not a send whose receive is deferred): a
   * source on another node reads it here instead of waiting for a taken frame. */
  s->prev_read = c->seq == 1 || c->pend[(c->seq - 1) & 1].seq != c->seq - 1;
  atomic_store_explicit(&s->flag, c->seq, memory_order_release);
}

int host_ops__post(struct ops_ctx *c, uint32_t dest, uint32_t rows, uint32_t op, uint64_t ref_seq,
                   uint32_t num_tokens, uint64_t bytes) {
  host_ops__slot_post(c, dest, rows, op, ref_seq, num_tokens);
  return c->remote[dest] < 0 ? 0 : host_ops__ring_push(c, op, dest, DEP_XRING_BLOCK, 0, bytes);
}

/* Post to every rank, rows[d] of row_bytes each (stride: bytes apart). */
int host_ops__post_all(struct ops_ctx *c, const uint32_t *rows, uint32_t op, uint64_t ref_seq,
                       uint32_t num_tokens, uint64_t stride) {
  for (uint32_t d = 0; d < c->world; d++) {
    if (ops_masked(c, d))
      continue; /* it is sent nothing, not even the slot */
    int rc = host_ops__post(c, d, rows[d], op, ref_seq, num_tokens, (uint64_t)rows[d] * stride);
    if (rc != 0)
      return rc;
  }
  return 0;
}

void host_ops__record_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t seen,
                           uint64_t waited_ns, int32_t code) {
  struct ops_err_record *er = (struct ops_err_record *)c->slabs[c->rank];
  er->op = op & ~OPS_OP_FP8;
  er->rank = c->rank;
  er->source = src;
  er->seq = c->seq;
  er->seen_flag = seen;
  er->waited_ms = (uint32_t)(waited_ns / 1000000u);
  atomic_store_explicit(&er->code, code, memory_order_release);
  c->broken = 1;
}

int host_ops__timeout_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t seen,
                           uint64_t waited_ns) {
  host_ops__record_fail(c, op, src, seen, waited_ns, DEP_ERR_TIMEOUT);
  return set_why(c, DEP_ERR_TIMEOUT, "timeout in %s waiting for rank %u (call %llu, %u ms): that "
                 "rank did not make the same call%s; check that every rank runs the same sequence "
                 "of operations and is alive", host_ops_op_name(op), src,
                 (unsigned long long)c->seq, c->timeout_ms,
                 c->remote[src] >= 0 ? ", or its node's daemon or the link to it is stuck "
                                       "(deepepctl peers on both nodes)" : "");
}

/*
 * Whether the daemon has written this rank's abort code (acquire) naming a
 * rank this wait for `src` depends on: src itself, or a rank that has not
 * posted this call (parity) — it never will.  A rank that posted this call
 * and then left (a clean end: it detached after its last call) does not
 * fail a wait for another, live rank that is merely slower.
 */
int host_ops__aborted(const struct ops_ctx *c, unsigned parity, uint32_t src) {
  const struct dep_slab_abort *ab = host_ops__gone(c);
  if (ab == NULL)
    return 0;
  uint32_t gone = ab->rank;
  if (gone < c->world && ops_masked(c, gone))
    return 0; /* the call waits for nothing from a masked rank */
  if (gone == src || gone >= c->world || DEP_SLAB_GONE_EVERY(ab->detached) ||
      ab->detached == DEP_SLAB_GONE_DAEMON)
    return 1;
  const struct ops_slot *g = in_slot(c, parity, gone);
  return atomic_load_explicit(&g->flag, memory_order_acquire) != c->seq;
}

/*
 * The daemon found a rank of the job gone and said so in this rank's abort
 * words (slab.h): record it as a timeout is recorded (the gone rank as the
 * source, its pid and whether it detached in seen_flag: host_ops.h) and
 * break the context, since the job cannot go on without that rank.  Words
 * the library wrote because this node's daemon is gone
 * (host_ops_daemon_gone) are DEP_ERR_DAEMON_GONE, the awaited rank the
 * source: every rank on another node is out of reach.
 */
int host_ops__peer_fail(struct ops_ctx *c, uint32_t op, uint32_t src, uint64_t waited_ns) {
  const struct dep_slab_abort *ab = host_ops__abort_words(c);
  /* The daemon stores code last with release ordering, and aborted() read
   * it with acquire: the words stored before it are visible here. */
  uint32_t gone = ab->rank, pid = ab->pid, detached = ab->detached;
  const int daemon = detached == DEP_SLAB_GONE_DAEMON;
  host_ops__record_fail(c, op, daemon ? src : gone, OPS_ERR_GONE(pid, detached), waited_ns,
                        daemon ? DEP_ERR_DAEMON_GONE : DEP_ERR_PEER);
  if (daemon)
    return set_why(c, DEP_ERR_DAEMON_GONE, "%s (call %llu, waiting for rank %u): "
                   OPS_DAEMON_GONE_WHY, host_ops_op_name(op), (unsigned long long)c->seq, src);
  if (detached == DEP_SLAB_GONE_CUT) /* gone names this node's rank, pid the winner's */
    return set_why(c, DEP_ERR_PEER, "%s (call %llu, waiting for rank %u): " OPS_CUT_WHY,
                   host_ops_op_name(op), (unsigned long long)c->seq, src, pid);
  char whom[24] = "it", pidtext[24] = "";
  if (gone != src)
    snprintf(whom, sizeof whom, "rank %u", src);
  if (pid != 0) /* 0: a rank on another node, whose pid this daemon never learns */
    snprintf(pidtext, sizeof pidtext, " (pid %u)", pid);
  return set_why(c, DEP_ERR_PEER, "rank %u%s of the job is gone (%s) while this rank "
                 "waited for %s in %s (call %llu); the job cannot go on: restart it", gone, pidtext,
                 ab->detached == DEP_SLAB_GONE_NODE ? "its node is lost: the peer link to its "
                                                      "daemon dropped"
                 : detached ? "it detached" : "its process ended", whom, host_ops_op_name(op),
                 (unsigned long long)c->seq);
}

void host_ops_daemon_gone(struct ops_ctx *c, int slabs_on_host) {
  if (c->ring == NULL)
    return;
  int32_t zero = 0;
  atomic_compare_exchange_strong_explicit(&c->ring->failed, &zero, DEP_ERR_DAEMON_GONE,
                                          memory_order_acq_rel, memory_order_acquire);
  if (!slabs_on_host)
    return;
  struct dep_slab_abort *ab = (struct dep_slab_abort *)(c->slabs[c->rank] + DEP_SLAB_ABORT_OFF);
  if (__atomic_load_n(&ab->code, __ATOMIC_ACQUIRE) != 0)
    return; /* the daemon told of a gone rank or node first: that is what broke the job */
  ab->rank = DEP_SLAB_GONE_NO_RANK;
  ab->pid = 0;
  ab->detached = DEP_SLAB_GONE_DAEMON;
  /* Code last, with release ordering, as the daemon writes it (aborted() reads it with acquire). */
  __atomic_store_n(&ab->code, DEP_ERR_DAEMON_GONE, __ATOMIC_RELEASE);
}

/*
 * The proxy's ring did not take this call's descriptor for dest: it stayed
 * full for the op timeout, or the proxy stopped draining it (code: the
 * job failed, its peer daemon is gone).  Recorded as a wait for dest is,
 * and the context broken, since dest will not get this call.
 */
static int ring_fail(struct ops_ctx *c, uint32_t op, uint32_t dest, int code, uint64_t waited_ns) {
  /* The proxy stops serving a job whose rank is gone after the daemon has
   * said which (the abort words): the call fails naming it. */
  if (code == DEP_ERR_PEER && host_ops__gone(c) != NULL)
    return host_ops__peer_fail(c, op, dest, waited_ns);
  host_ops__record_fail(c, op, dest, 0, waited_ns, code);
  if (code == DEP_ERR_TIMEOUT)
    return set_why(c, code, "%s: the proxy's ring stayed full for %u ms (call %llu, for rank %u "
                   "on another node); the daemon's proxy is stuck or its link to that node is "
                   "too slow: see deepepctl peers", host_ops_op_name(op), c->timeout_ms,
                   (unsigned long long)c->seq, dest);
  if (code == DEP_ERR_DAEMON_GONE)
    return set_why(c, code, "%s (call %llu, for rank %u on another node): " OPS_DAEMON_GONE_WHY,
                   host_ops_op_name(op), (unsigned long long)c->seq, dest);
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
int host_ops__wait_all(struct ops_ctx *c, uint32_t op) {
  unsigned parity = (unsigned)(c->seq & 1);
  uint64_t start = now_ns(), limit = (uint64_t)c->timeout_ms * 1000000ull;
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    for (uint32_t i = 0; !ops_masked(c, src); i++) {
      uint64_t f = atomic_load_explicit(&s->flag, memory_order_acquire);
      if (f == c->seq) {
        if (c->wait_cost != NULL)
          c->wait_cost[src] += (int64_t)(now_ns() - start);
        break;
      }
      if (f > c->seq) {
        c->broken = 1;
        return set_why(c, DEP_ERR_MISMATCH, "%s: rank %u is at call %llu, this rank at call %llu; "
                       "a rank restarted or the slabs were not fresh: restart the job",
                       host_ops_op_name(op), src, (unsigned long long)f,
                       (unsigned long long)c->seq);
      }
      if (i < 256)
        continue;
      if (host_ops__mask_grew(c))
        continue; /* src may be masked now: the loop's condition says */
      uint64_t waited = now_ns() - start;
      /* The flag again after the abort words: a rank that posted and then
       * left between the two reads (this one preempted) is no error. */
      if (host_ops__aborted(c, parity, src) &&
          atomic_load_explicit(&s->flag, memory_order_acquire) != c->seq)
        return host_ops__peer_fail(c, op, src, waited);
      if (waited > limit)
        return host_ops__timeout_fail(c, op, src, f, waited);
      host_ops__backoff(i);
    }
  }
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    if (!ops_masked(c, src) && s->op != op)
      return set_why(c, DEP_ERR_MISMATCH, "call %llu: this rank ran %s%s, rank %u ran %s%s; every "
                     "rank must make the same sequence of calls, in the same modes (use_fp8, "
                     "cached, a combine's out_topk_weights)", (unsigned long long)c->seq,
                     host_ops_op_name(op), host_ops__op_modes(op), src, host_ops_op_name(s->op),
                     host_ops__op_modes(s->op));
  }
  return 0;
}

/* A combine's sources must all answer the same dispatch with the rows expected. */
int host_ops__check_combine_slots(struct ops_ctx *c, const struct dep_handle *h,
                                  const uint32_t *expect) {
  unsigned parity = (unsigned)(c->seq & 1);
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_slot *s = in_slot(c, parity, src);
    if (ops_masked(c, src))
      continue;
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

/* ---- split calls (host_ops.h) --------------------------------------------------- */

/* This rank has read call q to its end: say so in every source's slot of q's parity (a
 * remote source's in the exchange region, where the proxy reads it for a taken frame). */
void host_ops__taken(struct ops_ctx *c, uint64_t q) {
  for (uint32_t src = 0; src < c->world; src++)
    atomic_store_explicit(&in_slot(c, (unsigned)(q & 1), src)->taken, q, memory_order_release);
}

/*
 * A split receive of call c->seq has ended after this rank posted a later
 * call, whose slots said that this one was not read yet (prev_read 0):
 * tell each source on another node that posted it here, through the proxy
 * (a TAKEN descriptor; the far daemon stores the word into the source's
 * out slot).  Its next call of this parity waits for that (wait_free).
 */
int host_ops__taken_far(struct ops_ctx *c, uint32_t op) {
  const unsigned parity = (unsigned)(c->seq & 1);
  for (uint32_t src = 0; c->ring != NULL && src < c->world; src++) {
    if (c->remote[src] < 0 ||
        atomic_load_explicit(&in_slot(c, parity, src)->flag, memory_order_acquire) != c->seq)
      continue; /* a local source reads the slot itself; one that posted nothing waits not */
    const int rc = host_ops__ring_push(c, op, src, DEP_XRING_TAKEN, 0, 0);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/*
 * Whether dest has read call f, which this rank posted to it in the slot
 * s (out_slot: in dest's slab, or the out slot image for one on another
 * node).  A local peer says so in the slot's taken word.  One on another
 * node cannot write here, and says it in one of three ways (host_ops.h
 * "Split calls"): its post of call f + 1 says it had read f (prev_read),
 * or it has posted call f + 2 (a rank whose call f is pending posts
 * nothing of that parity), or its taken frame for f has come back through
 * both daemons into the out slot's taken word.
 */
static bool read_by(const struct ops_ctx *c, uint32_t dest, const struct ops_slot *s,
                    uint64_t f) {
  if (atomic_load_explicit(&s->taken, memory_order_acquire) >= f)
    return true;
  if (c->remote[dest] < 0)
    return false;
  const unsigned parity = (unsigned)(f & 1);
  if (atomic_load_explicit(&in_slot(c, parity, dest)->flag, memory_order_acquire) >= f + 2)
    return true;
  /* dest cannot post f + 3 before this rank posts f + 2 (its call f + 3 waits for this
   * rank's read of f + 1, said no earlier than that post): the fields read after the
   * flag are call f + 1's. */
  const struct ops_slot *next = in_slot(c, parity ^ 1u, dest);
  return atomic_load_explicit(&next->flag, memory_order_acquire) == f + 1 && next->prev_read;
}

/*
 * Before this call writes its parity's blocks: every peer it posts to has
 * read what this rank posted there two calls before (read_by).  A slot
 * that holds no post of that call (a masked peer's, a fresh slab's) is
 * free.  A peer that never reads it is a timeout, or the peer gone (on
 * another node: its node lost, this node's daemon gone, or the proxy
 * stopped serving this rank).
 */
static int wait_free(struct ops_ctx *c) {
  const uint64_t start = now_ns(), limit = (uint64_t)c->timeout_ms * 1000000ull;
  for (uint32_t d = 0; d < c->world; d++) {
    if (d == c->rank)
      continue;
    const struct ops_slot *s = out_slot(c, d);
    const bool far = c->remote[d] >= 0;
    for (uint32_t i = 0; !ops_masked(c, d); i++) {
      const uint64_t f = atomic_load_explicit(&s->flag, memory_order_acquire);
      if (f + 2 != c->seq || read_by(c, d, s, f))
        break;
      if (i < 256)
        continue;
      if (host_ops__mask_grew(c))
        continue;
      const uint64_t waited = now_ns() - start;
      const struct dep_slab_abort *ab = host_ops__gone(c);
      /* A lost node or a gone daemon fails a wait for a rank on another node; a local peer
       * may still read.  A cut ends this node's part: its local peers' calls fail too. */
      if (ab != NULL && (ab->rank == d || ab->rank >= c->world ||
                         ab->detached == DEP_SLAB_GONE_CUT ||
                         (far && (ab->detached == DEP_SLAB_GONE_NODE ||
                                  ab->detached == DEP_SLAB_GONE_DAEMON))))
        return host_ops__peer_fail(c, s->op, d, waited);
      const int32_t failed =
          far ? atomic_load_explicit(&c->ring->failed, memory_order_acquire) : 0;
      if (failed != 0)
        return ring_fail(c, s->op, d, failed, waited);
      if (waited > limit) {
        host_ops__record_fail(c, s->op, d, f, waited, DEP_ERR_TIMEOUT);
        return set_why(c, DEP_ERR_TIMEOUT, "call %llu: rank %u has not read call %llu in %u "
                       "ms, and this call reuses its slots: that rank has not run call %llu's "
                       "receive (DEP_LL_RECV), or has stopped%s; every rank must receive each "
                       "of its split calls", (unsigned long long)c->seq, d,
                       (unsigned long long)f, c->timeout_ms, (unsigned long long)f,
                       far ? ", or its node's daemon or the link to it is stuck (deepepctl "
                             "peers on both nodes)" : "");
      }
      host_ops__backoff(i);
    }
  }
  return 0;
}

int host_ops_slots_free(const struct ops_ctx *c, char *why, size_t whylen) {
  const struct ops_pending *held = &c->pend[(c->seq + 1) & 1];
  if (held->seq == 0)
    return 0;
  snprintf(why, whylen, "phases: call %llu would reuse the slots of call %llu (%s), whose send "
           "(DEP_LL_SEND) has run and whose receive has not: at most 2 calls may be between "
           "send and receive; run call %llu's DEP_LL_RECV first",
           (unsigned long long)(c->seq + 1), (unsigned long long)held->seq,
           host_ops_op_name(held->op), (unsigned long long)held->seq);
  return DEP_ERR_INVALID;
}

/* Whether h is held by a send not yet received: that call's seq, else 0. */
uint64_t host_ops_pending(const struct ops_ctx *c, const struct dep_handle *h) {
  for (int p = 0; p < 2; p++)
    if (c->pend[p].seq != 0 && c->pend[p].h == h)
      return c->pend[p].seq;
  return 0;
}

/* The current call's send has run and its receive is deferred: keep what the receive needs. */
void host_ops__pend_save(struct ops_ctx *c, uint32_t op, const struct dep_handle *h) {
  struct ops_pending *p = &c->pend[c->seq & 1];
  memcpy(p->mask, c->mask, DEP_SLAB_MASK_WORDS(c->world) * sizeof *c->mask);
  p->seq = c->seq;
  p->op = op;
  p->h = h;
  p->epoch = c->epoch;
  p->nmasked = c->nmasked;
}

/* Run the receive of pend[parity] as its call: the context takes the call's seq and mask
 * (the current ones kept in *keep and in the pending entry's arrays) until pend_leave. */
void host_ops__pend_enter(struct ops_ctx *c, unsigned parity, struct ops_pending *keep) {
  struct ops_pending *p = &c->pend[parity];
  *keep = (struct ops_pending){.seq = c->seq, .mask = c->mask, .epoch = c->epoch,
                               .nmasked = c->nmasked};
  c->seq = p->seq;
  c->mask = p->mask;
  c->epoch = p->epoch;
  c->nmasked = p->nmasked;
  p->mask = keep->mask;
}

/* The receive of pend[parity] has ended (well or not): it is no longer pending, and the
 * context is back at its latest call. */
void host_ops__pend_leave(struct ops_ctx *c, unsigned parity, const struct ops_pending *keep) {
  struct ops_pending *p = &c->pend[parity];
  uint64_t *mask = c->mask;
  c->seq = keep->seq;
  c->mask = p->mask;
  c->epoch = keep->epoch;
  c->nmasked = keep->nmasked;
  *p = (struct ops_pending){.mask = mask};
}

int host_ops__begin(struct ops_ctx *c) {
  if (c->acc == NULL || c->stage == NULL)
    return set_why(c, DEP_ERR_STATE, "ops context not initialised (host_ops_init)");
  if (c->broken)
    return set_why(c, DEP_ERR_STATE, "%s", OPS_BROKEN_WHY);
  const int rc = host_ops_slots_free(c, c->why, sizeof c->why);
  if (rc != 0)
    return rc;
  c->seq++;
  host_ops__mask_begin(c);
  /* The calls before this one that are not pending have been read to their end. */
  for (uint64_t q = c->seq - 1; q + 2 >= c->seq && q > 0; q--)
    if (c->pend[q & 1].seq != q)
      host_ops__taken(c, q);
  return wait_free(c);
}

void host_ops_err_read(const uint8_t *slab, struct ops_err_record *out) {
  struct ops_err_record *er = (struct ops_err_record *)(uintptr_t)slab;
  int32_t code = atomic_load_explicit(&er->code, memory_order_acquire);
  memcpy((uint8_t *)out + sizeof out->code, (const uint8_t *)er + sizeof er->code,
         sizeof *out - sizeof out->code);
  atomic_init(&out->code, code);
}
