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
    for (uint32_t i = 0, n = token_dests(c, a->topk_idx, a->index_type, t, dest); i < n; i++) {
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
 * token order either way), payload only, and h is left as it was.
 */
int host_ops_dispatch(struct ops_ctx *c, const struct dep_dispatch_args *a, struct dep_handle *h) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  int rc = ops_check_dispatch(c, a, h, c->why, sizeof c->why);
  if (rc != 0 || (!a->cached && (rc = host_ops__handle_reserve(c, h, OPS_HANDLE_TP)) != 0) ||
      (rc = host_ops__begin(c)) != 0)
    return rc;
  const uint32_t hid = c->shape.hidden, k = c->shape.topk, le = local_experts(c);
  const uint32_t groups = hid / 128;
  const unsigned parity = (unsigned)(c->seq & 1);
  const uint32_t op = OPS_OP_DISPATCH | (a->use_fp8 ? OPS_OP_FP8 : 0) |
                      (a->cached ? OPS_OP_CACHED : 0);
  uint32_t *sent = c->per_rank, *from = sent + c->world;
  memset(sent, 0, c->world * sizeof *sent);

  for (uint32_t t = 0; t < a->num_tokens; t++) {
    uint32_t *dest = h->token_ranks + (size_t)t * k;
    if (!a->cached)
      h->token_nranks[t] = (uint8_t)token_dests(c, a->topk_idx, a->index_type, t, dest);
    for (uint32_t i = 0; i < h->token_nranks[t]; i++) {
      const uint32_t d = dest[i];
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
  if ((rc = host_ops__post_all(c, sent, op, a->cached ? h->seq : 0, a->num_tokens,
                               c->lay.row_bytes)) != 0 ||
      (rc = host_ops__wait_all(c, op)) != 0)
    return rc;

  /* Check every source's row count before writing anything. */
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
  if (rc != 0 || (rc = host_ops__begin(c)) != 0)
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
  if ((rc = host_ops__post_all(c, h->recv_from, op, h->seq, h->num_tokens,
                               c->lay.row_bytes)) != 0 ||
      (rc = host_ops__wait_all(c, op)) != 0)
    return rc;
  uint32_t *expect = c->per_rank + 2 * c->world, *cursor = expect + c->world;
  memset(expect, 0, 2 * c->world * sizeof *expect);
  for (uint32_t t = 0; t < h->num_tokens; t++)
    for (uint32_t i = 0; i < h->token_nranks[t]; i++)
      expect[h->token_ranks[(size_t)t * k + i]]++;
  if ((rc = host_ops__check_combine_slots(c, h, expect)) != 0)
    return rc;

  uint16_t *out = a->out;
  float *acc = c->acc, wacc[DEP_SHAPE_MAX_TOPK];
  for (uint32_t t = 0; t < h->num_tokens; t++) {
    memset(acc, 0, hid * sizeof *acc);
    memset(wacc, 0, sizeof wacc);
    for (uint32_t p = 0; p < h->token_nranks[t]; p++) {
      const uint32_t r = h->token_ranks[(size_t)t * k + p];
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
