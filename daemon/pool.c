/*
 * pool.c — per-device memory pools: a budget, and blocks made within it and
 * lent to jobs one per arena (pool.h).  Blocks are few (one per job shape
 * in use, plus the reserve), so one list searched from the front is plenty.
 */
#include "pool.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_value.h"
#include "log.h"
#include "slab.h"

/* A size as the config file would write it ("640 KiB", "2 MiB"), for messages. */
#define SIZE_TEXT(v, buf) config_value_size_text((v), (buf), sizeof(buf))

/* Give a block's pieces back to the backend. */
static void pieces_destroy(struct pool *p, struct pool_block *blk) {
  for (uint32_t i = 0; i < blk->n_pieces; i++)
    p->ops->chunk_destroy(&p->dev, &blk->piece[i]);
  blk->n_pieces = 0;
}

/* Make a block of n pieces of `piece` bytes and put it on the pool's list;
 * the caller has made room. */
static int block_make(struct pool *p, uint32_t n, uint64_t piece, struct pool_block **out,
                      char *why, size_t whylen) {
  char a[32], b[32];
  const uint64_t bytes = n * piece;
  if (bytes > p->budget_bytes - p->made_bytes) {
    snprintf(why, whylen, "internal error: a block of %s would take device %s's pool past its "
             "budget of %s", SIZE_TEXT(bytes, a), p->dev.uuid_str, SIZE_TEXT(p->budget_bytes, b));
    return DEP_ERR_INTERNAL;
  }
  struct pool_block *blk = calloc(1, sizeof *blk);
  if (blk == NULL) {
    snprintf(why, whylen, "out of memory for a block record");
    return DEP_ERR_NO_MEMORY;
  }
  blk->piece_bytes = piece;
  for (uint32_t i = 0; i < n; i++) {
    char bwhy[256] = "";
    int rc = p->ops->chunk_create(&p->dev, piece, &blk->piece[i], bwhy, sizeof bwhy);
    if (rc != 0) {
      snprintf(why, whylen, "making a block of %s (allocation %u of %u, %s each) on device %s "
               "(%s): %s", SIZE_TEXT(bytes, a), i + 1, n, SIZE_TEXT(piece, b), p->dev.uuid_str,
               p->dev.name, bwhy);
      pieces_destroy(p, blk);
      free(blk);
      return rc;
    }
    blk->n_pieces = i + 1;
  }
  blk->pool = p;
  blk->state = POOL_BLOCK_FREE;
  blk->next = p->blocks;
  p->blocks = blk;
  p->n_blocks++;
  p->made_bytes += bytes;
  *out = blk;
  return 0;
}

/* Take a block off the pool's list and give its memory back to the backend. */
static void block_unmake(struct pool *p, struct pool_block *blk) {
  for (struct pool_block **pp = &p->blocks; *pp != NULL; pp = &(*pp)->next) {
    if (*pp == blk) {
      *pp = blk->next;
      break;
    }
  }
  if (blk->state == POOL_BLOCK_CACHED)
    p->cached_bytes -= pool_block_bytes(blk);
  else if (blk->state == POOL_BLOCK_LENT)
    p->used_bytes -= pool_block_bytes(blk);
  p->made_bytes -= pool_block_bytes(blk);
  p->n_blocks--;
  /* A rank still mapping it keeps the memory alive for itself alone. */
  pieces_destroy(p, blk);
  free(blk);
}

int pool_init(struct pool *p, const struct backend_ops *ops, const struct backend_dev *dev,
              uint64_t budget_bytes, uint64_t reserve_bytes, bool prealloc, char *why,
              size_t whylen) {
  memset(p, 0, sizeof *p);
  p->ops = ops;
  p->dev = *dev;
  p->budget_bytes = budget_bytes;
  p->reserve_bytes = reserve_bytes;
  if (reserve_bytes == 0 || dev->granularity == 0 || reserve_bytes % dev->granularity != 0) {
    snprintf(why, whylen, "pool.chunk_size %llu is not a multiple of device %s's allocation "
             "granularity %llu", (unsigned long long)reserve_bytes, dev->uuid_str,
             (unsigned long long)dev->granularity);
    pool_fini(p);
    return DEP_ERR_CONFIG;
  }
  if (!prealloc)
    return 0;
  for (uint64_t i = 0; i < budget_bytes / reserve_bytes; i++) {
    struct pool_block *blk;
    int rc = block_make(p, 1, reserve_bytes, &blk, why, whylen);
    if (rc != 0) {
      pool_fini(p);
      return rc;
    }
  }
  return 0;
}

void pool_fini(struct pool *p) {
  if (p->ops == NULL)
    return;
  while (p->blocks != NULL)
    block_unmake(p, p->blocks);
  if (p->ops->release_dev != NULL)
    p->ops->release_dev(&p->dev);
  p->ops = NULL;
}

/* Whether b is made of n pieces of `piece` bytes. */
static bool block_is(const struct pool_block *b, uint32_t n, uint64_t piece) {
  return b->n_pieces == n && b->piece_bytes == piece;
}

/* The warm path: a block cached by an earlier job of this uid, shape and layout. */
static struct pool_block *cached_match(const struct pool *p, uint32_t n, uint64_t piece,
                                       uid_t uid, uint64_t key) {
  for (struct pool_block *b = p->blocks; b != NULL; b = b->next)
    if (b->state == POOL_BLOCK_CACHED && b->last_uid == uid && b->shape_key == key &&
        block_is(b, n, piece))
      return b;
  return NULL;
}

/*
 * A free block of exactly this layout that this uid may have.  A scrubbed
 * block is clean, but a rank of its last job may still map it (the daemon
 * cannot revoke a mapping), so a block another uid used is never lent to
 * this one: make_room unmakes it, and this uid gets fresh memory.  One this
 * uid used is taken before one nobody has used, which any uid may have.
 */
static struct pool_block *free_match(const struct pool *p, uint32_t n, uint64_t piece, uid_t uid) {
  struct pool_block *unused = NULL;
  for (struct pool_block *b = p->blocks; b != NULL; b = b->next) {
    if (b->state != POOL_BLOCK_FREE || !block_is(b, n, piece))
      continue;
    if (b->has_owner && b->last_uid == uid)
      return b;
    if (!b->has_owner && unused == NULL)
      unused = b;
  }
  return unused;
}

/* The free block to unmake first: one another uid used, then the largest. */
static struct pool_block *free_victim(const struct pool *p, uid_t uid) {
  struct pool_block *best = NULL;
  bool best_foreign = false;
  for (struct pool_block *b = p->blocks; b != NULL; b = b->next) {
    if (b->state != POOL_BLOCK_FREE)
      continue;
    bool foreign = b->has_owner && b->last_uid != uid;
    if (best == NULL || foreign > best_foreign ||
        (foreign == best_foreign && pool_block_bytes(b) > pool_block_bytes(best))) {
      best = b;
      best_foreign = foreign;
    }
  }
  return best;
}

/* The cached block to evict first: the one cached longest ago. */
static struct pool_block *cached_victim(const struct pool *p) {
  struct pool_block *best = NULL;
  for (struct pool_block *b = p->blocks; b != NULL; b = b->next)
    if (b->state == POOL_BLOCK_CACHED && (best == NULL || b->cached_seq < best->cached_seq))
      best = b;
  return best;
}

/*
 * Unmake free blocks, then cached ones, until the budget has room for a
 * block of `size`.  The caller has checked that the blocks lent to live
 * jobs leave that room, so this always succeeds.  Logged, so that an
 * operator sees a job of a new shape displace the memory of older ones.
 */
static void make_room(struct pool *p, uint64_t size, uid_t uid) {
  uint32_t n_free = 0, n_cached = 0;
  uint64_t released = 0;
  while (p->budget_bytes - p->made_bytes < size) {
    struct pool_block *b = free_victim(p, uid);
    if (b != NULL)
      n_free++;
    else if ((b = cached_victim(p)) != NULL)
      n_cached++;
    else
      break; /* only lent blocks left: the caller's check makes this unreachable */
    released += pool_block_bytes(b);
    block_unmake(p, b);
  }
  if (n_free + n_cached == 0)
    return;
  char a[32], c[32];
  log_info("pool %s: unmade %u free and %u cached block(s), %s in all, to make room for a "
           "block of %s", p->dev.uuid_str, n_free, n_cached, SIZE_TEXT(released, a),
           SIZE_TEXT(size, c));
}

static void block_lend(struct pool *p, struct pool_block *b, uid_t uid, uint64_t key) {
  if (b->state == POOL_BLOCK_CACHED)
    p->cached_bytes -= pool_block_bytes(b);
  b->state = POOL_BLOCK_LENT;
  b->has_owner = true;
  b->last_uid = uid;
  b->shape_key = key;
  p->used_bytes += pool_block_bytes(b);
}

uint64_t pool_block_layout(const struct pool *p, uint64_t bytes, uint64_t max_piece,
                           uint32_t *n, uint64_t *piece) {
  const uint64_t g = p->dev.granularity;
  const uint64_t size = dep_round_up(bytes > 0 ? bytes : 1, g);
  const uint64_t cap = max_piece == 0 ? 0 : max_piece < g ? g : max_piece / g * g;
  uint64_t k = cap == 0 ? 1 : (size + cap - 1) / cap;
  k = k > POOL_MAX_PIECES ? POOL_MAX_PIECES : k;
  *n = (uint32_t)k;
  *piece = dep_round_up((size + k - 1) / k, g);
  return k * *piece;
}

int pool_block_get(struct pool *p, uint64_t bytes, uint64_t max_piece, uid_t uid,
                   uint64_t shape_key, struct pool_block **out, char *why, size_t whylen) {
  uint32_t n;
  uint64_t piece;
  const uint64_t size = pool_block_layout(p, bytes, max_piece, &n, &piece);
  struct pool_block *b = cached_match(p, n, piece, uid, shape_key);
  if (b == NULL)
    b = free_match(p, n, piece, uid);
  if (b == NULL) {
    char t[32], u[32], v[32], w[32];
    if (size > p->budget_bytes - p->used_bytes) {
      snprintf(why, whylen, "device %s (%s) cannot lend this job a block of %s: its pool's "
               "budget is %s and live jobs hold %s of it; raise pool.size_per_device "
               "(pool.host_size on the host backend), lower max_tokens_per_rank, or wait for "
               "jobs to end", p->dev.uuid_str, p->dev.name, SIZE_TEXT(size, v),
               SIZE_TEXT(p->budget_bytes, t), SIZE_TEXT(p->used_bytes, u));
      return DEP_ERR_NO_MEMORY;
    }
    make_room(p, size, uid);
    int rc = block_make(p, n, piece, &b, why, whylen);
    if (rc != 0)
      return rc;
    log_info("pool %s: made a block of %s (%u allocation(s) of %s) for a job of uid %u (none "
             "of that layout was free or cached); %s of the %s budget now made", p->dev.uuid_str,
             SIZE_TEXT(size, v), n, SIZE_TEXT(piece, w), (unsigned)uid,
             SIZE_TEXT(p->made_bytes, t), SIZE_TEXT(p->budget_bytes, u));
  }
  block_lend(p, b, uid, shape_key);
  *out = b;
  return 0;
}

void pool_block_put(struct pool_block *b, bool cache) {
  struct pool *p = b->pool;
  char why[256] = "";
  for (uint32_t i = 0; i < b->n_pieces; i++) {
    if (p->ops->chunk_scrub(&p->dev, &b->piece[i], why, sizeof why) != 0) {
      /* Never lend memory that could not be scrubbed: drop it instead. */
      log_warnx("pool %s: scrub failed (%s); discarding the block", p->dev.uuid_str, why);
      block_unmake(p, b);
      return;
    }
  }
  p->used_bytes -= pool_block_bytes(b);
  if (cache) {
    b->state = POOL_BLOCK_CACHED;
    b->cached_seq = ++p->cache_seq;
    p->cached_bytes += pool_block_bytes(b);
  } else {
    b->state = POOL_BLOCK_FREE;
  }
}

uint64_t pool_block_bytes(const struct pool_block *b) { return b->n_pieces * b->piece_bytes; }

uint32_t pool_block_pieces(const struct pool_block *b) { return b->n_pieces; }

uint64_t pool_block_piece_bytes(const struct pool_block *b) { return b->piece_bytes; }

int pool_block_fd(const struct pool_block *b, uint32_t i) {
  return i < b->n_pieces ? b->piece[i].fd : -1;
}

uint64_t pool_total_bytes(const struct pool *p) { return p->budget_bytes; }
