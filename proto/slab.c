/*
 * slab.c — one rank's slab size and layout (see slab.h).
 */
#include "slab.h"

#include <stdio.h>

#include "kabi.h"
#include "proto.h"
#include "shape.h"

static uint64_t max2(uint64_t a, uint64_t b) { return a > b ? a : b; }

int dep__slab_layout(const struct dep_job_shape *s, uint32_t world_size,
                    struct dep_slab_layout *out, char *why, size_t whylen) {
  return dep__slab_layout_nodes(s, world_size, world_size, 0, out, why, whylen);
}

uint64_t dep__slab_key(const struct dep_job_shape *s, uint32_t world_size, uint32_t chunk_rows) {
  const uint32_t chan = dep_slab_chan_rows(s->max_tokens_per_rank, chunk_rows);
  uint64_t k = dep__shape_key(s, world_size);
  /* Whole blocks keep the shape's own key, so memory made before streaming serves them. */
  return chan == s->max_tokens_per_rank ? k : (k ^ chan) * 0x100000001b3ull;
}

int dep__slab_layout_nodes(const struct dep_job_shape *s, uint32_t world_size,
                          uint32_t local_world_size, uint32_t chunk_rows,
                          struct dep_slab_layout *out, char *why, size_t whylen) {
  int rc = dep__shape_check(s, world_size, why, whylen);
  if (rc != 0)
    return rc;
  if (local_world_size == 0 || local_world_size > world_size) {
    if (why != NULL)
      snprintf(why, whylen, "local_world_size %u is out of range (allowed 1..world_size %u)",
               local_world_size, world_size);
    return DEP_ERR_INVALID;
  }
  uint64_t h = s->hidden, k = s->topk;
  /* bf16 token + int32 ids + float32 weights + int32 source index, or an
   * FP8 token + one float32 scale per 128 channels + the same metadata. */
  uint64_t meta = k * 4 + k * 4 + 16;
  uint64_t row = max2(h * 2 + meta, h + (h / 128) * 4 + meta);
  row = dep_round_up(row, 16);
  const uint32_t ll = dep__shape_max_ll(s);
  uint64_t local_experts = s->num_experts / world_size;
  uint64_t ll_vectors = (uint64_t)ll * (k < local_experts ? k : local_experts);
  if (chunk_rows > DEP_SHAPE_MAX_TOKENS) {
    if (why != NULL)
      snprintf(why, whylen, "chunk_rows %u is out of range (allowed 0 = whole blocks, or 1..%u)",
               chunk_rows, DEP_SHAPE_MAX_TOKENS);
    return DEP_ERR_INVALID;
  }
  const uint32_t chan = dep_slab_chan_rows(s->max_tokens_per_rank, chunk_rows);
  /* A block holds a channel's rows (a call's, whole, without streaming),
   * or a low-latency call's whole; the slab's and the exchange region's
   * are one size. */
  const uint64_t ll_bytes = max2(ll_vectors * h * 2, (uint64_t)ll * row);
  const uint64_t block = dep_round_up(max2((uint64_t)chan * row, ll_bytes), 256);
  out->xblock_bytes = block;
  out->chunk_rows = chan == s->max_tokens_per_rank ? chan : chunk_rows;
  out->chan_rows = chan;
  const uint64_t mask_off = DEP_SLAB_ERR_BYTES + 2ull * world_size * DEP_SLAB_CTRL_SLOT;
  const uint64_t ctrl = mask_off + DEP_SLAB_MASK_AREA_BYTES(world_size);
  out->mask_off = mask_off;
  out->world_size = world_size;
  out->max_tokens = s->max_tokens_per_rank;
  out->max_ll_tokens = ll;
  out->block_bytes = block;
  out->ctrl_off = 0;
  out->ctrl_bytes = ctrl;
  out->row_bytes = row;
  out->data_off = dep_round_up(ctrl, DEP_SLAB_ALIGN);
  /* World 4096, 65536 tokens of 16 KiB rows, top-16 (shape.h's limits):
   * far below 2^64, so the checked ranges rule out overflow. */
  out->parity_bytes = (uint64_t)world_size * block;
  uint64_t end = out->data_off + 2 * out->parity_bytes;
  out->priv_off = dep_round_up(end, DEP_SLAB_ALIGN);
  struct dep_slab_priv pv;
  dep__slab_priv(s, world_size, out, &pv);
  out->priv_bytes = dep_round_up(pv.end, DEP_SLAB_ALIGN);
  out->total_bytes = out->priv_off + out->priv_bytes;
  const uint64_t nr = world_size - local_world_size;
  out->n_remote = (uint32_t)nr;
  out->in_slot_off = out->out_slot_off = out->in_mark_off = out->out_mark_off = 0;
  out->in_off = out->out_off = out->xchg_bytes = 0;
  if (nr > 0) {
    const uint64_t marks = 2 * nr * DEP_SLAB_CHUNKS * sizeof(uint64_t);
    out->out_slot_off = 2 * nr * DEP_SLAB_CTRL_SLOT;
    out->in_mark_off = out->out_slot_off + 2 * nr * DEP_SLAB_CTRL_SLOT;
    out->out_mark_off = out->in_mark_off + marks;
    out->in_off = dep_round_up(out->out_mark_off + marks, DEP_SLAB_ALIGN);
    out->out_off = out->in_off + 2 * nr * out->xblock_bytes;
    out->xchg_bytes = dep_round_up(out->out_off + 2 * nr * out->xblock_bytes, DEP_SLAB_ALIGN);
  }
  return 0;
}

void dep__slab_priv(const struct dep_job_shape *s, uint32_t world_size,
                    const struct dep_slab_layout *l, struct dep_slab_priv *out) {
  uint64_t off = 0;
  const uint64_t W = world_size, K = s->topk;
  uint64_t wat[CUOPS_WORLD_ARRAYS];
  out->dev = dep_carve(&off, sizeof(struct cuops_dev));
  out->world = dep_carve(&off, cuops_world_carve(W, wat));
  out->scratch = dep_carve(&off, 4ull * s->num_experts + 256);
  out->stage = dep_carve(&off, (uint64_t)l->max_ll_tokens * CUOPS_STAGE_ROW(s->hidden));
  /* A word per warp of every CTA the largest SM budget may launch (any
   * split of CUOPS_CTAS_PER_SM CTAs an SM among the world's ranks), and a
   * page: the budget is known only after the daemon's reply. */
  out->tcnt_bytes = ((uint64_t)CUOPS_CTAS_PER_SM * DEP_SLAB_MAX_SMS + W) * CUOPS_WARPS * 4 + 4096;
  out->tcnt = dep_carve(&off, out->tcnt_bytes);
  out->loop_dev = dep_carve(&off, sizeof(struct cuops_dev));
  out->loop_world = dep_carve(&off, cuops_world_carve(1, wat));
  /* The warm-up's world of one: its control slots fit the job's, and a page of data. */
  out->loop_slab = dep_carve(&off, l->data_off + 4096);
  /* The warm-up's handle, whose world of one has every expert local. */
  uint64_t at[CUOPS_HDL_ARRAYS];
  out->warm_handle = dep_carve(&off, cuops_handle_carve(W, s->max_tokens_per_rank,
                                                        l->max_ll_tokens, K,
                                                        K < s->num_experts ? K : s->num_experts,
                                                        at));
  out->end = off;
}
