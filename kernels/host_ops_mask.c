/*
 * host_ops_mask.c — masked ranks on the host backend (DESIGN §14,
 * host_ops.h): the live mask the daemon writes into a rank's slab (its
 * epoch, bits and join words, slab.h), this rank's own mask, and the mask
 * each call takes as it begins and watches in its waits.
 */
#include "host_ops_internal.h"

#include <string.h>

static uint64_t live_epoch(const struct ops_ctx *c) {
  return __atomic_load_n((const uint64_t *)(c->slabs[c->rank] + dep_slab_mask_epoch(&c->lay)),
                         __ATOMIC_ACQUIRE);
}

static void live_or_bits(const struct ops_ctx *c, uint64_t *words) {
  const uint8_t *slab = c->slabs[c->rank];
  for (uint32_t i = 0; i < DEP_SLAB_MASK_WORDS(c->world); i++)
    words[i] |= __atomic_load_n((const uint64_t *)(slab + dep_slab_mask_word(&c->lay, 64u * i)),
                                __ATOMIC_RELAXED);
}

uint64_t host_ops_mask_joins(const uint64_t *join, uint32_t world, uint64_t seq,
                             uint64_t *words) {
  uint64_t most = 0;
  for (uint32_t r = 0; r < world; r++) {
    const uint64_t at = __atomic_load_n(&join[r], __ATOMIC_RELAXED);
    most = at > most ? at : most;
    if (at > seq)
      words[r / 64u] |= DEP_SLAB_MASK_BIT(r);
  }
  return most;
}

static uint64_t live_or_joins(const struct ops_ctx *c, uint64_t *words) {
  return host_ops_mask_joins(
      (const uint64_t *)(c->slabs[c->rank] + dep_slab_mask_join(&c->lay, 0)), c->world, c->seq,
      words);
}

uint64_t host_ops_mask_live(const struct ops_ctx *c, uint64_t *words, uint64_t known,
                            uint64_t call) {
  const uint64_t epoch = live_epoch(c);
  /* 0: never written, every rank live (a job that is not elastic); known: read before. */
  if (epoch == 0 || epoch == known)
    return epoch;
  live_or_bits(c, words);
  (void)host_ops_mask_joins((const uint64_t *)(c->slabs[c->rank] + dep_slab_mask_join(&c->lay, 0)),
                            c->world, call, words);
  return epoch;
}

void host_ops_join_at(struct ops_ctx *c, uint64_t join) {
  if (join > 0)
    c->seq = join - 1;
}

uint64_t host_ops_join_word(const struct ops_ctx *c) {
  return __atomic_load_n((const uint64_t *)(c->slabs[c->rank] +
                                            dep_slab_mask_join(&c->lay, c->rank)),
                         __ATOMIC_ACQUIRE);
}

int host_ops_mask_update(struct ops_ctx *c, uint32_t rank, int masked) {
  if (rank >= c->world)
    return set_why(c, DEP_ERR_INVALID, "rank %u is past the job's world of %u ranks", rank,
                   c->world);
  if (masked)
    c->own[rank / 64u] |= DEP_SLAB_MASK_BIT(rank);
  else
    c->own[rank / 64u] &= ~DEP_SLAB_MASK_BIT(rank);
  return 0;
}

void host_ops_mask_clear(struct ops_ctx *c) {
  memset(c->own, 0, DEP_SLAB_MASK_WORDS(c->world) * sizeof *c->own);
}

/* Count the call's mask (a word at a time: every call does it); a rank masked itself talks
 * to no rank: all are masked (bits past the world too, which no rank reads). */
static void mask_settle(struct ops_ctx *c) {
  const uint32_t n = (uint32_t)DEP_SLAB_MASK_WORDS(c->world);
  if ((c->mask[c->rank / 64u] & DEP_SLAB_MASK_BIT(c->rank)) != 0)
    for (uint32_t i = 0; i < n; i++)
      c->mask[i] = ~0ull;
  c->nmasked = 0;
  for (uint32_t i = 0; i < n; i++)
    c->nmasked += (uint32_t)__builtin_popcountll(c->mask[i]);
}

/* The daemon writes the join words and the bits before the epoch (release):
 * bits cached under an epoch are that epoch's or a later one's, and a
 * later one is read again at the next call that sees its epoch. */
void host_ops__mask_begin(struct ops_ctx *c) {
  const uint32_t n = (uint32_t)DEP_SLAB_MASK_WORDS(c->world);
  const uint64_t epoch = live_epoch(c);
  memcpy(c->mask, c->own, n * sizeof *c->mask);
  if (epoch != c->live_epoch) {
    memset(c->live, 0, n * sizeof *c->live);
    live_or_bits(c, c->live);
    c->live_join_max = live_or_joins(c, c->mask);
    c->live_epoch = epoch;
  } else if (c->live_join_max > c->seq) {
    (void)live_or_joins(c, c->mask);
  }
  for (uint32_t i = 0; i < n; i++)
    c->mask[i] |= c->live[i];
  c->epoch = epoch;
  mask_settle(c);
}

bool host_ops__mask_grew(struct ops_ctx *c) {
  const uint64_t epoch = host_ops_mask_live(c, c->mask, c->epoch, c->seq);
  if (epoch == c->epoch)
    return false;
  const uint32_t before = c->nmasked;
  c->epoch = epoch;
  mask_settle(c);
  return c->nmasked != before;
}

uint64_t host_ops__dropped(const struct ops_ctx *c, const void *idx, int type, uint32_t tokens) {
  if (c->nmasked == 0)
    return 0;
  uint64_t n = 0;
  const uint32_t le = local_experts(c);
  for (size_t i = 0; i < (size_t)tokens * c->shape.topk; i++) {
    const int64_t e = idx_at(idx, type, i);
    n += e >= 0 && ops_masked(c, (uint32_t)(e / le));
  }
  return n;
}
