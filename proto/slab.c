/*
 * slab.c — one rank's slab size and layout (see slab.h).
 */
#include "slab.h"

#include <stdio.h>

#include "proto.h"

static uint64_t max2(uint64_t a, uint64_t b) { return a > b ? a : b; }

int dep_slab_layout(const struct dep_job_shape *s, uint32_t world_size,
                    struct dep_slab_layout *out, char *why, size_t whylen) {
  if (s->max_tokens_per_rank == 0 || s->max_tokens_per_rank > 65536 || s->hidden == 0 ||
      s->hidden % 128 != 0 || s->hidden > 16384 || s->topk == 0 || s->topk > 16 ||
      world_size == 0 || world_size > DEP_MAX_WORLD) {
    snprintf(why, whylen, "job shape out of range (max_tokens_per_rank %u, hidden %u, topk %u, "
             "world_size %u)", s->max_tokens_per_rank, s->hidden, s->topk, world_size);
    return DEP_ERR_INVALID;
  }
  uint64_t h = s->hidden, k = s->topk;
  /* bf16 token + int32 ids + float32 weights + int32 source index, or an
   * FP8 token + one float32 scale per 128 channels + the same metadata. */
  uint64_t meta = k * 4 + k * 4 + 16;
  uint64_t row = max2(h * 2 + meta, h + (h / 128) * 4 + meta);
  row = dep_round_up(row, 16);
  uint32_t ll = s->max_ll_tokens_per_rank;
  if (ll == 0)
    ll = s->max_tokens_per_rank < 256 ? s->max_tokens_per_rank : 256;
  if (ll > s->max_tokens_per_rank || s->num_experts == 0 || s->num_experts % world_size != 0) {
    snprintf(why, whylen, "job shape out of range (max_ll_tokens_per_rank %u > max_tokens_per_rank "
             "%u, or num_experts %u not a multiple of world_size %u)", s->max_ll_tokens_per_rank,
             s->max_tokens_per_rank, s->num_experts, world_size);
    return DEP_ERR_INVALID;
  }
  uint64_t local_experts = s->num_experts / world_size;
  uint64_t ll_vectors = (uint64_t)ll * (k < local_experts ? k : local_experts);
  uint64_t block = (uint64_t)s->max_tokens_per_rank * row;
  if (ll_vectors * h * 2 > block)
    block = ll_vectors * h * 2;
  block = dep_round_up(block, 256);
  uint64_t ctrl = DEP_SLAB_ERR_BYTES + 2ull * world_size * DEP_SLAB_CTRL_SLOT;
  out->world_size = world_size;
  out->max_tokens = s->max_tokens_per_rank;
  out->max_ll_tokens = ll;
  out->block_bytes = block;
  out->ctrl_off = 0;
  out->ctrl_bytes = ctrl;
  out->row_bytes = row;
  out->data_off = dep_round_up(ctrl, DEP_SLAB_ALIGN);
  /* World 4096, 65536 tokens of 16 KiB rows, top-16: far below 2^64, so
   * the ranges above rule out overflow. */
  out->parity_bytes = (uint64_t)world_size * block;
  out->priv_off = dep_round_up(out->data_off + 2 * out->parity_bytes, DEP_SLAB_ALIGN);
  /* One FP8 row (a byte per channel and a float scale per 128) for each
   * low-latency token, a count per expert, a word per (rank, warp), and a
   * control area; and a handle's arrays (per token: its destinations,
   * per low-latency token: its top-k and, per rank, its slot and rows). */
  const uint64_t W = world_size, mt = s->max_tokens_per_rank;
  uint64_t fp8_row = dep_round_up(h + h / 32, 16);
  out->priv_bytes = DEP_SLAB_PRIV_FIXED + dep_round_up((uint64_t)ll * fp8_row, 256) +
                    dep_round_up(4ull * s->num_experts, 256) + out->data_off + 32 * W +
                    dep_round_up(4 * mt * W, 256) + dep_round_up(8ull * ll * k, 256) +
                    dep_round_up(4ull * W * ll, 256) + dep_round_up(8ull * W * ll * k, 256) +
                    16 * W;
  out->total_bytes = out->priv_off + out->priv_bytes;
  return 0;
}
