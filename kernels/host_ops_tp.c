/*
 * host_ops_tp.c — the host backend's throughput mode (DESIGN §6): layout,
 * which is local, and the dispatch and combine pair, over the protocol of
 * host_ops.c.  Every order is fixed and every sum a float32 sum rounded
 * once to bf16, so the same inputs give bit-identical outputs on every run.
 */
#include "host_ops_internal.h"

#include "shape.h"

/* ---- layout ------------------------------------------------------------------ */

int host_ops_layout(struct ops_ctx *c, const struct dep_layout_args *a) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_layout(c, a, c->why, sizeof c->why);
  if (rc != 0)
    return rc;
  /* A layout waits for no rank, but once the ranks are out of step every
   * operation is refused (deepep(3)), as on cuda: the job cannot go on. */
  if (c->broken)
    return set_why(c, DEP_ERR_STATE, "%s", OPS_BROKEN_WHY);
  uint32_t k = c->shape.topk;
  uint32_t dest[DEP_SHAPE_MAX_TOPK];
  memset(a->tokens_per_rank, 0, c->world * sizeof(int32_t));
  memset(a->tokens_per_expert, 0, c->shape.num_experts * sizeof(int32_t));
  for (uint32_t t = 0; t < a->num_tokens; t++) {
    for (uint32_t j = 0; j < k; j++) {
      int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
      if (e >= 0)
        a->tokens_per_expert[e]++;
    }
    uint8_t *in = a->token_in_rank + (size_t)t * c->world;
    memset(in, 0, c->world);
    for (uint32_t i = 0, n = token_dests_of(c, a->topk_idx, a->index_type, t, dest, false); i < n;
         i++) {
      in[dest[i]] = 1;
      a->tokens_per_rank[dest[i]]++;
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
 * token order either way), payload only, and h is left as it was.  The
 * rows move through host_ops__stream: each source's land at that source's
 * offset in the outputs (sources ascending, then the source's token
 * order), whatever order they arrive in.
 */
struct disp_call {
  const struct dep_dispatch_args *a;
  struct dep_handle *h;
  uint64_t cap;       /* rows the caller's outputs hold */
  uint32_t known;     /* sources 0..known-1 have their counts, hence their offsets */
  uint64_t next_base; /* the first row of source `known` */
};

/* Row j for dest: the j-th of the tokens that go to dest, in token order. */
static void disp_fill(struct ops_ctx *c, void *arg, uint32_t d, uint32_t j, uint8_t *row) {
  const struct disp_call *x = arg;
  const struct dep_dispatch_args *a = x->a;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  const uint32_t t = c->rowlist[c->rowoff[d] + j];
  put_payload(c, a, t, row);
  int32_t *meta = (int32_t *)(row + ops_meta_off(hid));
  meta[0] = (int32_t)t;
  meta[1] = (int32_t)k;
  if (a->cached)
    return;
  int32_t *ids = (int32_t *)(row + ops_ids_off(hid));
  float *w = (float *)(row + ops_weights_off(hid, k));
  for (uint32_t i = 0; i < k; i++) {
    int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + i);
    int mine = e >= 0 && (uint64_t)e / le == d;
    ids[i] = mine ? (int32_t)(e % le) : -1;
    w[i] = mine ? a->topk_weights[(size_t)t * k + i] : 0.0f;
  }
}

/*
 * Token t's row as a node channel carries it (xring.h): its payload and
 * source, and every k's global id and weight, which the far daemon remaps
 * for each rank of the node the token goes to as disp_fill would have.  A
 * cached dispatch sends no ids or weights: its ids name an expert of each
 * of the token's ranks in its handle, so that the far daemon finds them.
 */
static void disp_fill_node(struct ops_ctx *c, void *arg, uint32_t t, uint8_t *row) {
  const struct disp_call *x = arg;
  const struct dep_dispatch_args *a = x->a;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  put_payload(c, a, t, row);
  int32_t *meta = (int32_t *)(row + ops_meta_off(hid));
  meta[0] = (int32_t)t;
  meta[1] = (int32_t)k;
  int32_t *ids = (int32_t *)(row + ops_ids_off(hid));
  float *w = (float *)(row + ops_weights_off(hid, k));
  for (uint32_t i = 0; i < k; i++) {
    if (a->cached) {
      ids[i] = i < x->h->token_nranks[t] ? (int32_t)(x->h->token_ranks[(size_t)t * k + i] * le)
                                         : -1;
      w[i] = 0.0f;
    } else {
      int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + i);
      ids[i] = e >= 0 ? (int32_t)e : -1;
      w[i] = a->topk_weights[(size_t)t * k + i];
    }
  }
}

static void disp_see(struct ops_ctx *c, void *arg, uint32_t src, const struct ops_slot *sl) {
  const struct disp_call *x = arg;
  if (!x->a->cached)
    return;
  if (sl->ref_seq != x->h->seq)
    host_ops__stream_fault(c, DEP_ERR_MISMATCH, "dispatch (cached): rank %u routed by the "
                           "dispatch of call %llu, this rank by that of call %llu; pass each rank "
                           "the handle of the same dispatch", src,
                           (unsigned long long)sl->ref_seq, (unsigned long long)x->h->seq);
  else if (sl->rows != x->h->recv_from[src])
    host_ops__stream_fault(c, DEP_ERR_MISMATCH, "dispatch (cached): rank %u sent %u rows, its "
                           "dispatch %u", src, sl->rows, x->h->recv_from[src]);
}

/* Received row r of src (its rows begin at out) into the outputs. */
static void disp_put(struct ops_ctx *c, const struct dep_dispatch_args *a, const uint8_t *row,
                     uint64_t off) {
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  if (a->use_fp8) {
    memcpy((uint8_t *)a->recv_x + off * hid, row, hid);
    memcpy(a->recv_x_scales + off * (hid / 128), row + hid, (hid / 128) * sizeof(float));
  } else {
    memcpy((uint8_t *)a->recv_x + off * 2u * hid, row, 2u * hid);
  }
  if (a->cached)
    return;
  const int wide = a->recv_index_type == DEP_INDEX_I64;
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

static int disp_take(struct ops_ctx *c, void *arg, const struct ops_stream *s, uint32_t *awaited) {
  struct disp_call *x = arg;
  int moved = 0;
  /* A source's offset is known once every source before it has its count. */
  while (x->known < c->world) {
    host_ops__stream_avail(c, s, x->known);
    struct ops_peer *p = &c->peer[x->known];
    if (!p->seen)
      break;
    p->from_base = x->next_base;
    /* A cached dispatch's rows lie where its handle's put them, a masked source's too. */
    x->next_base += x->a->cached ? x->h->recv_from[x->known] : p->from_rows;
    x->known++;
  }
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_peer *p = &c->peer[src];
    const uint32_t n = src < x->known ? host_ops__stream_avail(c, s, src) : 0;
    /* Chunk by chunk, each credited as soon as it is taken: the sender
     * waits for the first while this rank copies out the others. */
    while (n > p->from_taken) {
      const uint32_t chunk = c->lay.chunk_rows, from = p->from_taken;
      const uint32_t next = from - from % chunk + chunk; /* the next chunk's first row */
      const uint32_t end = n < next ? n : next;
      for (uint32_t r = from; r < end; r++) {
        const uint64_t off = p->from_base + r;
        /* A fault (a count out of step) and rows past the outputs drain unread. */
        if (c->stream_rc == 0 && off < x->cap)
          disp_put(c, x->a, host_ops__stream_row(c, src, r), off);
      }
      const int rc = host_ops__stream_taken(c, s, src, end - from);
      if (rc != 0)
        return rc;
      moved = 1;
    }
    if (!ops_masked(c, src) && (!p->seen || p->from_taken < p->from_rows) &&
        *awaited == UINT32_MAX)
      *awaited = src;
  }
  return moved;
}

/* The rows of a source masked while it streamed that never came: ids -1 and weights 0 (as
 * DeepEP's padding), the payload zero, so that no row holds another call's bytes. */
static void disp_cut_rows(struct ops_ctx *c, const struct dep_dispatch_args *a,
                          const struct dep_handle *h, uint64_t cap) {
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  const uint64_t bytes = a->use_fp8 ? hid : 2ull * hid;
  for (uint32_t src = 0; src < c->world; src++) {
    const struct ops_peer *p = &c->peer[src];
    if (!ops_masked(c, src))
      continue;
    const uint64_t end = p->from_base + (a->cached ? h->recv_from[src] : p->from_rows);
    for (uint64_t off = p->from_base + p->from_taken; off < end && off < cap; off++) {
      memset((uint8_t *)a->recv_x + off * bytes, 0, bytes);
      if (a->use_fp8)
        memset(a->recv_x_scales + off * (hid / 128), 0, (hid / 128) * sizeof(float));
      if (a->cached)
        continue;
      for (uint32_t i = 0; i < k; i++) {
        ridx_put(a->recv_topk_idx, a->recv_index_type == DEP_INDEX_I64, off * k + i, -1);
        a->recv_topk_weights[off * k + i] = 0.0f;
      }
    }
  }
}

int host_ops_dispatch(struct ops_ctx *c, const struct dep_dispatch_args *a, struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_dispatch(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (!a->cached && (rc = host_ops__handle_reserve(c, h, OPS_HANDLE_TP)) != 0) ||
      (rc = host_ops__begin(c)) != 0)
    return rc;
  const uint32_t k = c->shape.topk, le = local_experts(c);
  const uint32_t op = OPS_OP_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0) |
                      (a->cached ? OPS_OP_CACHED : 0);
  host_ops__stream_setup(c);
  /* Each token's ranks (h's, when cached), then each rank's tokens in
   * order: rowlist[rowoff[d] ..] (a counting sort, O(tokens * topk)). */
  for (uint32_t t = 0; t < a->num_tokens; t++) {
    uint32_t *dest = h->token_ranks + (size_t)t * k;
    if (!a->cached)
      h->token_nranks[t] = (uint8_t)token_dests(c, a->topk_idx, a->index_type, t, dest);
    for (uint32_t i = 0; i < h->token_nranks[t]; i++)
      c->peer[dest[i]].to_rows++;
  }
  c->rowoff[0] = 0;
  for (uint32_t d = 0; d < c->world; d++)
    c->rowoff[d + 1] = c->rowoff[d] + c->peer[d].to_rows;
  for (uint32_t t = 0; t < a->num_tokens; t++)
    for (uint32_t i = 0; i < h->token_nranks[t]; i++) {
      const uint32_t d = h->token_ranks[(size_t)t * k + i];
      c->rowlist[c->rowoff[d] + c->peer[d].to_done++] = t;
    }
  for (uint32_t d = 0; d < c->world; d++)
    c->peer[d].to_done = 0;
  if (!a->cached)
    memset(a->recv_count_per_expert, 0, le * sizeof(int32_t));

  struct disp_call x = {.a = a, .h = h,
                        .cap = a->num_worst_tokens != 0
                                   ? a->num_worst_tokens
                                   : (uint64_t)c->world * c->shape.max_tokens_per_rank};
  const struct ops_stream s = {.op = op, .ref_seq = a->cached ? h->seq : 0,
                               .num_tokens = a->num_tokens, .fill = disp_fill, .see = disp_see,
                               .take = disp_take, .arg = &x, .fill_node = disp_fill_node,
                               .token_ranks = h->token_ranks, .token_nranks = h->token_nranks};
  if ((rc = host_ops__stream(c, &s)) != 0)
    return rc;
  if (c->nmasked != 0)
    disp_cut_rows(c, a, h, x.cap);
  const uint64_t total = x.next_base;
  if (a->num_worst_tokens != 0 && total > a->num_worst_tokens)
    return set_why(c, DEP_ERR_INVALID, "dispatch: num_worst_tokens %u is below the %llu rows "
                   "this rank received; give at least the rows a rank can receive (world_size "
                   "* max_tokens_per_rank at most)", a->num_worst_tokens,
                   (unsigned long long)total);
  if (a->cached) {
    if (a->num_worst_tokens == 0)
      *a->num_recv = (uint32_t)total;
    return 0;
  }
  /* DeepEP's padding of the worst-case rows, and its rounded counts. */
  const int wide = a->recv_index_type == DEP_INDEX_I64;
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
    h->recv_from[src] = c->peer[src].from_rows;
  if (a->num_worst_tokens == 0)
    *a->num_recv = (uint32_t)total;
  h->num_recv = (uint32_t)total;
  h->dropped = host_ops__dropped(c, a->topk_idx, a->index_type, a->num_tokens);
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
 * ascending, after the biases (comb_bias): token by token, each token's
 * vectors taken in rank order as they arrive (host_ops__stream).
 */
struct comb_call {
  const struct dep_combine_args *a;
  const struct dep_handle *h;
  uint32_t t, p;    /* the token being summed, and how many of its ranks are in */
  bool fresh;       /* the token's sum holds nothing yet (no bias, no vector): +0 */
  float wacc[DEP_SHAPE_MAX_TOPK];
};

/*
 * The sums run four channels at a time in GCC's vector extensions: each
 * channel's additions keep their order (bias, then the ranks ascending),
 * so every bit is what the one-channel loop gave, and the baseline
 * x86-64 (SSE2) and aarch64 (NEON) targets have these operations, where
 * the scalar loop, whose conversions -O2 does not vectorise, spent most
 * of a combine's time on the rank.  hidden is a multiple of
 * DEP_SHAPE_HIDDEN_STEP (shape.h), so no channel is left over; loads and
 * stores go through memcpy, so rows need no alignment.
 */
typedef float comb_f32x4 __attribute__((vector_size(16)));
typedef uint32_t comb_u32x4 __attribute__((vector_size(16)));
typedef uint16_t comb_u16x4 __attribute__((vector_size(8)));
_Static_assert(DEP_SHAPE_HIDDEN_STEP % 4 == 0, "a row's channels come four at a time");

/* Four bf16 channels as float32 (host_ops_bf16_to_float). */
static inline comb_f32x4 comb_load4(const uint16_t *v) {
  comb_u16x4 h;
  memcpy(&h, v, sizeof h);
  return (comb_f32x4)(__builtin_convertvector(h, comb_u32x4) << 16);
}

/* acc = +0 + v (the sum's first vector; +0 + -0 is +0, as from a zeroed sum). */
static void comb_row_set(float *acc, const uint16_t *v, uint32_t hid) {
  for (uint32_t i = 0; i < hid; i += 4) {
    const comb_f32x4 a = (comb_f32x4){0.0f, 0.0f, 0.0f, 0.0f} + comb_load4(v + i);
    memcpy(acc + i, &a, sizeof a);
  }
}

/* acc += v. */
static void comb_row_add(float *acc, const uint16_t *v, uint32_t hid) {
  for (uint32_t i = 0; i < hid; i += 4) {
    comb_f32x4 a;
    memcpy(&a, acc + i, sizeof a);
    a += comb_load4(v + i);
    memcpy(acc + i, &a, sizeof a);
  }
}

/* out = bf16(acc), as host_ops_float_to_bf16: round to nearest even, a NaN quiet. */
static void comb_row_put(uint16_t *out, const float *acc, uint32_t hid) {
  for (uint32_t i = 0; i < hid; i += 4) {
    comb_u32x4 u;
    memcpy(&u, acc + i, sizeof u);
    const comb_u32x4 nan = (comb_u32x4)((u & 0x7fffffffu) > 0x7f800000u);
    const comb_u32x4 r = ((u >> 16 | 0x40u) & nan) | ((u + 0x7fffu + (u >> 16 & 1u)) >> 16 & ~nan);
    const comb_u16x4 h = __builtin_convertvector(r, comb_u16x4);
    memcpy(out + i, &h, sizeof h);
  }
}

/* Row j back to dest: the vector of the j-th row dest sent this rank. */
static void comb_fill(struct ops_ctx *c, void *arg, uint32_t d, uint32_t j, uint8_t *row) {
  const struct comb_call *x = arg;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  const uint64_t off = c->peer[d].to_base + j;
  memcpy(row, (const uint16_t *)x->a->x + off * hid, 2u * hid);
  if (x->a->out_topk_weights != NULL)
    memcpy(row + ops_weights_off(hid, k), x->a->topk_weights + off * k, k * sizeof(float));
}

static void comb_see(struct ops_ctx *c, void *arg, uint32_t src, const struct ops_slot *sl) {
  const struct comb_call *x = arg;
  if (sl->ref_seq != x->h->seq)
    host_ops__stream_fault(c, DEP_ERR_MISMATCH, "%s: rank %u combined the dispatch of call %llu, "
                           "this rank the dispatch of call %llu; pass each rank the handle of "
                           "the same call", host_ops_op_name(sl->op), src,
                           (unsigned long long)sl->ref_seq, (unsigned long long)x->h->seq);
  else if (sl->rows != c->peer[src].want)
    host_ops__stream_fault(c, DEP_ERR_MISMATCH, "%s: rank %u sent %u vectors back, %u expected",
                           host_ops_op_name(sl->op), src, sl->rows, c->peer[src].want);
}

/* A token's sum begins as DeepEP's does (deepep.h dep_combine_args): bias_0 + bias_1 in
 * float32, a missing one +0, so that the ranks' vectors are added to it before the one
 * rounding; without either, +0 (x->fresh until the first vector). */
static void comb_bias(struct ops_ctx *c, struct comb_call *x, uint32_t t) {
  const struct dep_combine_args *a = x->a;
  const uint32_t hid = c->shape.hidden;
  const uint16_t *b0 = a->bias_0 ? (const uint16_t *)a->bias_0 + (size_t)t * hid : NULL;
  const uint16_t *b1 = a->bias_1 ? (const uint16_t *)a->bias_1 + (size_t)t * hid : NULL;
  x->fresh = b0 == NULL && b1 == NULL; /* the first vector sets the sum (comb_row_set) */
  if (x->fresh)
    return;
  for (uint32_t i = 0; i < hid; i++)
    c->acc[i] = (b0 ? host_ops_bf16_to_float(b0[i]) : 0.0f) +
                (b1 ? host_ops_bf16_to_float(b1[i]) : 0.0f);
}

static int comb_take(struct ops_ctx *c, void *arg, const struct ops_stream *s, uint32_t *awaited) {
  struct comb_call *x = arg;
  const struct dep_combine_args *a = x->a;
  const struct dep_handle *h = x->h;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  int moved = 0;
  while (c->stream_rc == 0 && x->t < h->num_tokens) {
    const uint32_t t = x->t;
    if (x->p == 0) {
      comb_bias(c, x, t);
      memset(x->wacc, 0, sizeof x->wacc);
    }
    for (; x->p < h->token_nranks[t]; x->p++) {
      const uint32_t r = h->token_ranks[(size_t)t * k + x->p];
      if (ops_masked(c, r))
        continue; /* its vector is zero */
      if (host_ops__stream_avail(c, s, r) <= c->peer[r].from_taken || c->stream_rc != 0) {
        *awaited = r;
        return moved;
      }
      const uint8_t *row = host_ops__stream_row(c, r, c->peer[r].from_taken);
      if (x->fresh)
        comb_row_set(c->acc, (const uint16_t *)row, hid);
      else
        comb_row_add(c->acc, (const uint16_t *)row, hid);
      x->fresh = false;
      if (a->out_topk_weights != NULL) {
        const float *w = (const float *)(row + ops_weights_off(hid, k));
        for (uint32_t j = 0; j < k; j++)
          x->wacc[j] += w[j];
      }
      const int rc = host_ops__stream_taken(c, s, r, 1);
      if (rc != 0)
        return rc;
      moved = 1;
    }
    if (x->fresh) /* nothing came: every vector masked, or none selected */
      memset(c->acc, 0, hid * sizeof *c->acc);
    comb_row_put((uint16_t *)a->out + (size_t)t * hid, c->acc, hid);
    if (a->out_topk_weights != NULL)
      memcpy(a->out_topk_weights + (size_t)t * k, x->wacc, k * sizeof(float));
    x->t++;
    x->p = 0;
  }
  /* Every source's slot is seen (it is checked there), and after a fault
   * every row drains unread. */
  for (uint32_t src = 0; src < c->world; src++) {
    struct ops_peer *p = &c->peer[src];
    const uint32_t n = host_ops__stream_avail(c, s, src);
    if (c->stream_rc != 0 && n > p->from_taken) {
      const int rc = host_ops__stream_taken(c, s, src, n - p->from_taken);
      if (rc != 0)
        return rc;
      moved = 1;
    }
    if (!ops_masked(c, src) && (!p->seen || p->from_taken < p->from_rows) &&
        *awaited == UINT32_MAX)
      *awaited = src;
  }
  return moved;
}

int host_ops_combine(struct ops_ctx *c, const struct dep_combine_args *a,
                     const struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_combine(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (rc = host_ops__begin(c)) != 0)
    return rc;
  const uint32_t k = c->shape.topk;
  const int weighted = a->out_topk_weights != NULL;
  host_ops__stream_setup(c);
  /* Rows from each source are contiguous in x, sources ascending: each
   * goes back to its source in the order it came; and each source owes
   * this rank one vector per row it received. */
  uint64_t off = 0;
  for (uint32_t d = 0; d < c->world; d++) {
    c->peer[d].to_base = off;
    c->peer[d].to_rows = ops_masked(c, d) ? 0 : h->recv_from[d];
    off += h->recv_from[d];
  }
  for (uint32_t t = 0; t < h->num_tokens; t++)
    for (uint32_t i = 0; i < h->token_nranks[t]; i++)
      c->peer[h->token_ranks[(size_t)t * k + i]].want++; /* a masked rank's: never seen */
  struct comb_call x = {.a = a, .h = h};
  const struct ops_stream s = {.op = OPS_OP_COMBINE | (weighted ? OPS_OP_WEIGHTS : 0),
                               .ref_seq = h->seq, .num_tokens = h->num_tokens, .fill = comb_fill,
                               .see = comb_see, .take = comb_take, .arg = &x};
  return host_ops__stream(c, &s);
}
