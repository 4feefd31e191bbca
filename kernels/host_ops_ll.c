/*
 * host_ops_ll.c — the host backend's low-latency pair (DESIGN §6):
 * ll_dispatch, which sends a token once to each rank owning one of its
 * experts (cast to FP8 here when asked) and expands it there into its
 * experts' rows, and ll_combine, which sends each expert's vector back and
 * sums them weighted at the origin, over the protocol of host_ops.c; and
 * ll_handle_info, which reads back from a dispatch's handle where each row
 * came from.
 */
#include "host_ops_internal.h"

#include "shape.h"

/*
 * One bf16 token to FP8: h e4m3 bytes, then h/128 float32 scales.  Each
 * group's loops have no branch and no dependence between elements, so the
 * compiler makes them vector code: the largest magnitude compared as the
 * bits of |x| (ordered as the floats are; a NaN counts as 0, as a float
 * comparison would skip it), and the quotients divided, not multiplied by
 * a reciprocal, to round as the cuda kernels do.
 */
static void token_to_fp8(const uint16_t *restrict x, uint32_t hidden, uint8_t *restrict out) {
  float *scales = (float *)(out + hidden);
  for (uint32_t g = 0; g < hidden / 128; g++) {
    const uint16_t *xg = x + (size_t)g * 128;
    uint32_t amax_bits = 0;
    for (int i = 0; i < 128; i++) {
      const uint32_t a = ((uint32_t)xg[i] << 16) & 0x7fffffffu;
      const uint32_t m = a > 0x7f800000u ? 0 : a;
      amax_bits = m > amax_bits ? m : amax_bits;
    }
    float amax;
    memcpy(&amax, &amax_bits, sizeof amax);
    const float scale = (amax > 1e-4f ? amax : 1e-4f) / 448.0f;
    scales[g] = scale;
    uint8_t *og = out + (size_t)g * 128;
    for (int i = 0; i < 128; i++)
      og[i] = host_ops_float_to_e4m3(host_ops_bf16_to_float(xg[i]) / scale);
  }
}

/* ---- low-latency mode --------------------------------------------------------------- */

/* A token's ranks, ascending, and its distinct experts on each, in order
 * of first appearance: a list of at most topk, whatever the world. */
struct token_sel {
  uint32_t nd;                                 /* ranks it goes to */
  uint32_t dest[DEP_SHAPE_MAX_TOPK];           /* those ranks */
  uint8_t n[DEP_SHAPE_MAX_TOPK];               /* distinct local experts on dest[i] */
  int32_t ids[DEP_SHAPE_MAX_TOPK][DEP_SHAPE_MAX_TOPK]; /* those local experts */
  int32_t vec[DEP_SHAPE_MAX_TOPK]; /* per k: index among its rank's distinct experts */
};

static void select_token(const struct ops_ctx *c, const void *idx, int type, uint32_t t,
                         struct token_sel *s) {
  const uint32_t k = c->shape.topk, le = local_experts(c);
  s->nd = token_dests(c, idx, type, t, s->dest);
  memset(s->n, 0, s->nd * sizeof s->n[0]);
  for (uint32_t j = 0; j < k; j++) {
    int64_t e = idx_at(idx, type, (size_t)t * k + j);
    s->vec[j] = -1;
    if (e < 0)
      continue;
    uint32_t d = (uint32_t)(e / le), p = 0;
    int32_t l = (int32_t)(e % le);
    if (ops_masked(c, d))
      continue; /* dropped: its rank is masked (token_dests left it out) */
    while (s->dest[p] != d)
      p++;
    uint32_t i = 0;
    while (i < s->n[p] && s->ids[p][i] != l)
      i++;
    if (i == s->n[p])
      s->ids[p][s->n[p]++] = l;
    s->vec[j] = (int32_t)i;
  }
}

/* The send half of a low-latency dispatch: each token once to each rank owning one of
 * its experts (cast to FP8 once per token), with its index and those experts' local ids;
 * sent[d] counts the rows for rank d. */
static void ll_dispatch_send(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                             unsigned parity, uint32_t *sent) {
  const uint32_t hid = c->shape.hidden, groups = hid / 128;
  const size_t payload = a->use_fp8 ? hid + groups * sizeof(float) : 2u * hid;
  const uint16_t *x = a->x;
  memset(sent, 0, c->world * sizeof *sent);
  struct token_sel sel;

  for (uint32_t t = 0; t < a->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    if (sel.nd == 0)
      continue;
    const void *src = x + (size_t)t * hid;
    if (a->use_fp8) {
      token_to_fp8(x + (size_t)t * hid, hid, c->stage); /* once per token, not per rank */
      src = c->stage;
    }
    for (uint32_t p = 0; p < sel.nd; p++) {
      const uint32_t d = sel.dest[p];
      uint8_t *row = out_row(c, d, parity, sent[d]++);
      memcpy(row, src, payload);
      int32_t *meta = (int32_t *)(row + ops_meta_off(hid));
      meta[0] = (int32_t)t;
      meta[1] = sel.n[p];
      memcpy(row + ops_ids_off(hid), sel.ids[p], sel.n[p] * sizeof(int32_t));
    }
  }
}

/* The expansion, once every rank has posted: each received token expanded into its
 * experts' rows, sources ascending and tokens ascending, so each expert's rows are in
 * (source, token) order; the handle learns where each row came from.  A row that names
 * an expert not ours, or overflows one, is a peer's malformed row. */
static int ll_dispatch_expand(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                              struct dep_handle *h, unsigned parity) {
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  const uint32_t kd = k < le ? k : le, groups = hid / 128;
  const uint64_t rows = (uint64_t)c->world * c->lay.max_ll_tokens;
  for (uint32_t src = 0; src < c->world; src++)
    if (!ops_masked(c, src) && in_slot(c, parity, src)->rows > c->lay.max_ll_tokens)
      return set_why(c, DEP_ERR_MISMATCH, "ll_dispatch: rank %u posted %u rows, over the job's "
                     "max_ll_tokens_per_rank %u", src, in_slot(c, parity, src)->rows,
                     c->lay.max_ll_tokens);
  memset(a->recv_count, 0, le * sizeof(int32_t));
  uint64_t nv = 0;
  for (uint32_t src = 0; src < c->world; src++) {
    uint32_t n = ops_masked(c, src) ? 0 : in_slot(c, parity, src)->rows, owed = 0;
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
        h->ll_rows[nv] = (struct ops_ll_vec){.expert = l, .row = pos,
                                             .token = (uint32_t)meta[0]};
        nv++;
        owed++;
      }
    }
    h->recv_from[src] = owed;
  }
  h->num_recv = (uint32_t)nv;
  return 0;
}

/* A call's phases as it runs them (0 is the whole call). */
static uint32_t ll_phases(uint32_t phases) {
  return phases == 0 ? DEP_LL_SEND | DEP_LL_RECV : phases;
}

/*
 * The receive of a split call (DEP_LL_RECV): run recv as the pending call
 * of h (its seq and mask, host_ops.h "Split calls"), then say the call's
 * slots are read, whatever recv returned, and the call is no longer pending.
 */
static int ll_split_recv(struct ops_ctx *c, const struct dep_handle *h, const void *a,
                         int (*recv)(struct ops_ctx *c, const void *a, const struct dep_handle *h)) {
  if (c->broken)
    return set_why(c, DEP_ERR_STATE, "%s", OPS_BROKEN_WHY);
  const unsigned parity = (unsigned)(host_ops_pending(c, h) & 1);
  struct ops_pending keep;
  host_ops__pend_enter(c, parity, &keep);
  int rc = recv(c, a, h);
  host_ops__taken(c, c->seq);
  /* A later call's send said this one was not read yet (prev_read): sources on other
   * nodes learn it now, through the proxy. */
  const int far =
      keep.seq > c->seq && !c->broken ? host_ops__taken_far(c, c->pend[parity].op) : 0;
  host_ops__pend_leave(c, parity, &keep);
  return rc != 0 ? rc : far;
}

/* The send half of a dispatch: what its handle keeps of the inputs, then the rows posted. */
static int ll_dispatch_post(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                            struct dep_handle *h) {
  int rc = host_ops__handle_reserve(c, h, OPS_HANDLE_LL);
  if (rc != 0 || (rc = host_ops__begin(c)) != 0)
    return rc;
  const uint32_t op = OPS_OP_LL_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0);
  uint32_t *sent = c->per_rank;
  ll_dispatch_send(c, a, (unsigned)(c->seq & 1), sent);
  h->num_tokens = a->num_tokens;
  h->dropped = host_ops__dropped(c, a->topk_idx, a->index_type, a->num_tokens);
  h->idx_hash = ops_check_idx_hash(a->topk_idx, a->index_type,
                                   (size_t)a->num_tokens * c->shape.topk);
  h->seq = c->seq;
  return host_ops__post_all(c, sent, op, 0, a->num_tokens, c->lay.row_bytes);
}

/* The receive half: the rows of the call c->seq, which reads no input of the caller's. */
static int ll_dispatch_recv(struct ops_ctx *c, const void *args, const struct dep_handle *hc) {
  const struct dep_ll_dispatch_args *a = args;
  struct dep_handle *h = (struct dep_handle *)(uintptr_t)hc; /* the caller's, to fill */
  const uint32_t op = OPS_OP_LL_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0);
  c->wait_cost = a->wait_cost;
  int rc = host_ops__wait_all(c, op);
  c->wait_cost = NULL;
  if (rc != 0 || (rc = ll_dispatch_expand(c, a, h, (unsigned)(c->seq & 1))) != 0)
    return rc;
  h->kind = OPS_HANDLE_LL;
  return 0;
}

int host_ops_ll_dispatch(struct ops_ctx *c, const struct dep_ll_dispatch_args *a,
                         struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_ll_dispatch(c, a, h, c->why, sizeof c->why);
  if (rc != 0)
    return rc;
  const uint32_t ph = ll_phases(a->phases);
  if (ph == DEP_LL_RECV)
    return ll_split_recv(c, h, a, ll_dispatch_recv);
  if ((rc = ll_dispatch_post(c, a, h)) != 0)
    return rc;
  if (ph == DEP_LL_SEND) {
    host_ops__pend_save(c, OPS_OP_LL_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0), h);
    return 0;
  }
  return ll_dispatch_recv(c, a, h);
}

/* The send half of a combine: each source one vector per (token, distinct local expert),
 * in the order the dispatch received them, which is the order the origin enumerates them
 * from its topk_idx. */
static int ll_combine_post(struct ops_ctx *c, const struct dep_ll_combine_args *a,
                           const struct dep_handle *h) {
  int rc = host_ops__begin(c);
  if (rc != 0)
    return rc;
  const uint32_t hid = c->shape.hidden;
  const uint64_t rows = (uint64_t)c->world * c->lay.max_ll_tokens;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint16_t *x = a->x;
  uint64_t nv = 0;
  for (uint32_t d = 0; d < c->world; d++) {
    if (ops_masked(c, d)) { /* nothing goes back to a masked rank */
      nv += h->recv_from[d];
      continue;
    }
    uint8_t *block = out_block(c, d, parity);
    for (uint32_t i = 0; i < h->recv_from[d]; i++, nv++) {
      uint64_t at = (uint64_t)h->ll_rows[nv].expert * rows + h->ll_rows[nv].row;
      memcpy(block + (uint64_t)i * 2u * hid, x + at * hid, 2u * hid);
    }
  }
  return host_ops__post_all(c, h->recv_from, OPS_OP_LL_COMBINE, h->seq, h->num_tokens,
                            2ull * hid);
}

/* The receive half: the vectors of the call c->seq, summed as topk_idx and topk_weights
 * (read now, as DeepEP's receive reads them) say. */
static int ll_combine_recv(struct ops_ctx *c, const void *args, const struct dep_handle *h) {
  const struct dep_ll_combine_args *a = args;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk;
  const unsigned parity = (unsigned)(c->seq & 1);
  c->wait_cost = a->wait_cost;
  int rc = host_ops__wait_all(c, OPS_OP_LL_COMBINE);
  c->wait_cost = NULL;
  if (rc != 0)
    return rc;

  struct token_sel sel;
  uint32_t *expect = c->per_rank, *base = expect + c->world;
  memset(expect, 0, 2 * c->world * sizeof *expect);
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    for (uint32_t p = 0; p < sel.nd; p++)
      expect[sel.dest[p]] += sel.n[p];
  }
  if ((rc = host_ops__check_combine_slots(c, h, expect)) != 0)
    return rc;

  uint16_t *out = a->out;
  float *acc = c->acc;
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    select_token(c, a->topk_idx, a->index_type, t, &sel);
    memset(acc, 0, hid * sizeof *acc);
    for (uint32_t j = 0; j < k; j++) {
      int64_t e = idx_at(a->topk_idx, a->index_type, (size_t)t * k + j);
      if (e < 0 || sel.vec[j] < 0)
        continue; /* none, or its rank is masked: its contribution is zero */
      uint32_t d = (uint32_t)(e / (c->shape.num_experts / c->world));
      const uint16_t *v = (const uint16_t *)(in_row(c, parity, d, 0) +
                                             (uint64_t)(base[d] + (uint32_t)sel.vec[j]) * 2u * hid);
      float w = a->topk_weights[(size_t)t * k + j];
      for (uint32_t i = 0; i < hid; i++)
        acc[i] += w * host_ops_bf16_to_float(v[i]);
    }
    for (uint32_t p = 0; p < sel.nd; p++)
      base[sel.dest[p]] += sel.n[p];
    for (uint32_t i = 0; i < hid; i++)
      out[(size_t)t * hid + i] = host_ops_float_to_bf16(acc[i]);
  }
  return 0;
}

int host_ops_ll_combine(struct ops_ctx *c, const struct dep_ll_combine_args *a,
                        const struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_ll_combine(c, a, h, c->why, sizeof c->why);
  if (rc != 0)
    return rc;
  const uint32_t ph = ll_phases(a->phases);
  if (ph == DEP_LL_RECV)
    return ll_split_recv(c, h, a, ll_combine_recv);
  if ((rc = ll_combine_post(c, a, h)) != 0)
    return rc;
  if (ph == DEP_LL_SEND) {
    host_ops__pend_save(c, OPS_OP_LL_COMBINE, h);
    return 0;
  }
  return ll_combine_recv(c, a, h);
}

/*
 * The handle's vectors are in (source, source token) order, each with its
 * row and token, so one pass gives each row's token and each (expert,
 * source)'s count; a source's rows of an expert are contiguous, and begin
 * where the earlier sources' end.
 */
int host_ops_ll_handle_info(struct ops_ctx *c, const struct dep_ll_handle_info_args *a,
                            const struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (h == NULL || h->kind != OPS_HANDLE_LL)
    return set_why(c, DEP_ERR_INVALID, "ll_handle_info: the handle holds no low-latency "
                   "dispatch; pass the handle of a dep_ll_dispatch");
  const uint32_t W = h->world, le = h->num_experts / h->world;
  const uint64_t rows = (uint64_t)W * h->max_ll_tokens;
  for (uint64_t i = 0; i < le * rows; i++)
    a->src_info[i] = -1;
  memset(a->layout_range, 0, (size_t)le * W * sizeof *a->layout_range);
  uint64_t nv = 0;
  for (uint32_t s = 0; s < W; s++)
    for (uint32_t i = 0; i < h->recv_from[s]; i++, nv++) {
      const struct ops_ll_vec *v = &h->ll_rows[nv];
      a->src_info[(uint64_t)v->expert * rows + v->row] = (int32_t)v->token;
      a->layout_range[(uint64_t)v->expert * W + s]++;
    }
  for (uint32_t l = 0; l < le; l++) {
    uint32_t begin = 0;
    for (uint32_t s = 0; s < W; s++) {
      int64_t *r = &a->layout_range[(uint64_t)l * W + s];
      const uint32_t n = (uint32_t)*r;
      *r = DEP_LL_RANGE(begin, n);
      begin += n;
    }
  }
  return 0;
}
