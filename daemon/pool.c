/*
 * pool.c — per-device memory pools: a budget, and blocks made within it and
 * lent to jobs one per arena (pool.h).  Blocks are few (one per job shape
 * in use, plus the reserve), so one list searched from the front is plenty.
 */
#include "pool.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config_value.h"
#include "log.h"
#include "proc.h"
#include "slab.h"

/* A size as the config file would write it ("640 KiB", "2 MiB"), for messages. */
#define SIZE_TEXT(v, buf) config_value_size_text((v), (buf), sizeof(buf))

/* The budget not yet taken by made blocks or ghosts. */
static uint64_t pool_room(const struct pool *p) {
  uint64_t taken = p->made_bytes + p->ghost_bytes;
  return taken >= p->budget_bytes ? 0 : p->budget_bytes - taken;
}

/*
 * Keep the holders that may still hold the memory, in order; returns how
 * many.  With the files' inodes known (host), a live process that has
 * closed and unmapped them holds nothing; without (cuda), a holder holds
 * until it exits.
 */
static uint32_t holders_reap(struct proc_id *h, uint32_t n, uint64_t dev, const uint64_t *inos,
                             uint32_t n_inos) {
  uint32_t k = 0;
  for (uint32_t i = 0; i < n; i++) {
    bool holds = n_inos == 0 ? proc_alive(&h[i]) : proc_holds_file(&h[i], dev, inos, n_inos) != 0;
    if (holds)
      h[k++] = h[i];
  }
  return k;
}

/* The inodes of a block's pieces, where the backend knows them; returns how many. */
static uint32_t block_files(const struct pool_block *b, uint64_t *dev, uint64_t *inos) {
  uint32_t n = 0;
  *dev = 0;
  for (uint32_t i = 0; i < b->n_pieces; i++) {
    if (b->piece[i].file_ino == 0)
      return 0; /* one piece unknowable: the block is */
    *dev = b->piece[i].file_dev;
    inos[n++] = b->piece[i].file_ino;
  }
  return n;
}

static void block_reap(struct pool_block *b) {
  uint64_t dev, inos[POOL_MAX_PIECES];
  uint32_t n = block_files(b, &dev, inos);
  b->n_holders = holders_reap(b->holders, b->n_holders, dev, inos, n);
}

static bool block_held(const struct pool_block *b) {
  return b->state != POOL_BLOCK_LENT && b->n_holders > 0;
}

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
  if (bytes > pool_room(p)) {
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

/* A held block is unmade: its holders keep the memory, so it stays charged. */
static struct pool_ghost *ghost_add(struct pool *p, uid_t uid, uint64_t bytes,
                                    const struct proc_id *h, uint32_t n) {
  struct pool_ghost *g = calloc(1, sizeof *g);
  if (g == NULL) {
    /* Forgetting the charge would let the pool lend past its budget; the
     * daemon cannot go on honestly without this record. */
    fatalx("pool %s: out of memory for a held-memory record", p->dev.uuid_str);
  }
  g->uid = uid;
  g->bytes = bytes;
  g->n_holders = n > POOL_MAX_HOLDERS ? POOL_MAX_HOLDERS : n;
  memcpy(g->holders, h, sizeof *h * g->n_holders);
  g->next = p->ghosts;
  p->ghosts = g;
  p->ghost_bytes += bytes;
  return g;
}

/* Take a block off the pool's list and give its memory back to the backend;
 * what live holders still map stays charged as a ghost. */
static void block_unmake(struct pool *p, struct pool_block *blk) {
  if (blk->state != POOL_BLOCK_LENT && blk->n_holders > 0) {
    block_reap(blk);
    if (blk->n_holders > 0) {
      struct pool_ghost *g =
          ghost_add(p, blk->last_uid, pool_block_bytes(blk), blk->holders, blk->n_holders);
      g->n_files = block_files(blk, &g->file_dev, g->file_ino);
    }
  }
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

static void region_reap(struct pool_region *r) {
  r->n_holders = holders_reap(r->holders, r->n_holders, r->file_dev, &r->file_ino, 1);
}

static bool region_held(const struct pool_region *r) {
  return r->state != POOL_BLOCK_LENT && r->n_holders > 0;
}

/* Take a region off the pool's list: its NIC registration, mapping and fd
 * go; what live holders still map stays charged as a ghost. */
static void region_unmake(struct pool *p, struct pool_region *r) {
  if (region_held(r)) {
    region_reap(r);
    if (r->n_holders > 0) {
      struct pool_ghost *g = ghost_add(p, r->uid, r->bytes, r->holders, r->n_holders);
      g->file_dev = r->file_dev;
      g->file_ino[0] = r->file_ino;
      g->n_files = 1;
    }
  }
  for (struct pool_region **pp = &p->regions; *pp != NULL; pp = &(*pp)->next) {
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  }
  if (r->state == POOL_BLOCK_CACHED)
    p->cached_bytes -= r->bytes;
  else if (r->state == POOL_BLOCK_LENT)
    p->used_bytes -= r->bytes;
  p->made_bytes -= r->bytes;
  p->region_bytes -= r->bytes;
  if (r->unregister != NULL)
    r->unregister(r);
  munmap(r->map, r->bytes);
  close(r->fd);
  free(r);
}

/* Ghosts preloaded from a stopped daemon's held file, by device. */
struct pool_preload {
  struct pool_preload *next;
  uint8_t uuid[16];
  struct pool_ghost g;
};
static struct pool_preload *pool_preloaded;

void pool_preload_ghost(const uint8_t uuid[16], uid_t uid, uint64_t bytes,
                        const struct proc_id *holders, uint32_t n_holders) {
  struct pool_preload *e = calloc(1, sizeof *e);
  if (e == NULL)
    fatalx("out of memory for a held-memory record");
  memcpy(e->uuid, uuid, 16);
  e->g.uid = uid;
  e->g.bytes = bytes;
  e->g.n_holders = n_holders > POOL_MAX_HOLDERS ? POOL_MAX_HOLDERS : n_holders;
  memcpy(e->g.holders, holders, sizeof *holders * e->g.n_holders);
  e->g.n_holders = holders_reap(e->g.holders, e->g.n_holders, 0, NULL, 0);
  if (e->g.n_holders == 0) {
    free(e);
    return;
  }
  e->next = pool_preloaded;
  pool_preloaded = e;
}

/* Charge the preloaded ghosts of p's device to p. */
static void pool_take_preloaded(struct pool *p) {
  for (struct pool_preload **pp = &pool_preloaded; *pp != NULL;) {
    struct pool_preload *e = *pp;
    if (memcmp(e->uuid, p->dev.uuid, 16) != 0) {
      pp = &e->next;
      continue;
    }
    char a[32];
    log_notice("pool %s: %s lent by the daemon before this one is still held by %u process(es) "
               "of uid %u (pid %d%s); charged to the budget until they exit", p->dev.uuid_str,
               SIZE_TEXT(e->g.bytes, a), e->g.n_holders, (unsigned)e->g.uid,
               (int)e->g.holders[0].pid, e->g.n_holders > 1 ? ", ..." : "");
    ghost_add(p, e->g.uid, e->g.bytes, e->g.holders, e->g.n_holders);
    *pp = e->next;
    free(e);
  }
}

void pool_reap(struct pool *p) {
  for (struct pool_block *b = p->blocks; b != NULL; b = b->next)
    if (b->state != POOL_BLOCK_LENT && b->n_holders > 0)
      block_reap(b);
  for (struct pool_region *r = p->regions; r != NULL; r = r->next)
    if (region_held(r))
      region_reap(r);
  for (struct pool_ghost **gg = &p->ghosts; *gg != NULL;) {
    struct pool_ghost *g = *gg;
    g->n_holders = holders_reap(g->holders, g->n_holders, g->file_dev, g->file_ino, g->n_files);
    if (g->n_holders > 0) {
      gg = &g->next;
      continue;
    }
    char a[32];
    log_info("pool %s: the processes of uid %u that held %s have exited; it is free again",
             p->dev.uuid_str, (unsigned)g->uid, SIZE_TEXT(g->bytes, a));
    p->ghost_bytes -= g->bytes;
    *gg = g->next;
    free(g);
  }
}

static bool block_is(const struct pool_block *b, uint32_t n, uint64_t piece);

void pool_forget(struct pool *p, uid_t uid, uint64_t shape_key) {
  for (struct pool_block *b = p->blocks, *next; b != NULL; b = next) {
    next = b->next;
    if ((b->state != POOL_BLOCK_FREE && b->state != POOL_BLOCK_CACHED) || !b->has_owner ||
        b->last_uid != uid || b->shape_key != shape_key)
      continue;
    block_reap(b);
    if (b->n_holders > 0)
      continue;
    if (p->prealloc && block_is(b, 1, p->reserve_bytes)) {
      if (b->state == POOL_BLOCK_CACHED)
        p->cached_bytes -= pool_block_bytes(b);
      b->state = POOL_BLOCK_FREE;
      b->has_owner = false;
    } else {
      block_unmake(p, b);
    }
  }
  while (p->prealloc && pool_room(p) >= p->reserve_bytes) {
    struct pool_block *blk;
    char why[256];
    if (block_make(p, 1, p->reserve_bytes, &blk, why, sizeof why) != 0) {
      log_warnx("pool %s: the reserve is short of a block after the warm-up: %s", p->dev.uuid_str,
                why);
      break;
    }
  }
}

uint64_t pool_held_bytes(const struct pool *p) {
  uint64_t n = p->ghost_bytes;
  for (const struct pool_block *b = p->blocks; b != NULL; b = b->next)
    if (block_held(b))
      n += pool_block_bytes(b);
  for (const struct pool_region *r = p->regions; r != NULL; r = r->next)
    if (region_held(r))
      n += r->bytes;
  return n;
}

uint64_t pool_uid_bytes(const struct pool *p, uid_t uid) {
  uint64_t n = 0;
  for (const struct pool_ghost *g = p->ghosts; g != NULL; g = g->next)
    if (g->uid == uid)
      n += g->bytes;
  for (const struct pool_block *b = p->blocks; b != NULL; b = b->next)
    if (b->has_owner && b->last_uid == uid && (b->state == POOL_BLOCK_LENT || b->n_holders > 0))
      n += pool_block_bytes(b);
  for (const struct pool_region *r = p->regions; r != NULL; r = r->next)
    if (r->uid == uid && (r->state == POOL_BLOCK_LENT || r->n_holders > 0))
      n += r->bytes;
  return n;
}

/* Set by the loop thread when the daemon stops; read by the thread making the pools. */
static atomic_bool pool_stopping;

void pool_stop_making(void) { atomic_store(&pool_stopping, true); }

int pool_init(struct pool *p, const struct backend_ops *ops, const struct backend_dev *dev,
              uint64_t budget_bytes, uint64_t reserve_bytes, bool prealloc, char *why,
              size_t whylen) {
  memset(p, 0, sizeof *p);
  p->ops = ops;
  p->dev = *dev;
  p->budget_bytes = budget_bytes;
  p->reserve_bytes = reserve_bytes;
  p->prealloc = prealloc;
  if (reserve_bytes == 0 || dev->granularity == 0 || reserve_bytes % dev->granularity != 0) {
    snprintf(why, whylen, "pool.chunk_size %llu is not a multiple of device %s's allocation "
             "granularity %llu", (unsigned long long)reserve_bytes, dev->uuid_str,
             (unsigned long long)dev->granularity);
    pool_fini(p);
    return DEP_ERR_CONFIG;
  }
  pool_take_preloaded(p);
  if (!prealloc)
    return 0;
  for (uint64_t i = 0, n = pool_room(p) / reserve_bytes; i < n; i++) {
    if (atomic_load(&pool_stopping)) {
      snprintf(why, whylen, "the daemon stopped while the pool of device %s was made (%llu of "
               "%llu blocks)", dev->uuid_str, (unsigned long long)i, (unsigned long long)n);
      pool_fini(p);
      return DEP_ERR_STATE;
    }
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
  while (p->regions != NULL) {
    p->regions->n_holders = 0; /* as for blocks below */
    region_unmake(p, p->regions);
  }
  while (p->blocks != NULL) {
    p->blocks->n_holders = 0; /* the daemon is stopping: the held file has them */
    block_unmake(p, p->blocks);
  }
  while (p->ghosts != NULL) {
    struct pool_ghost *g = p->ghosts;
    p->ghosts = g->next;
    free(g);
  }
  p->ghost_bytes = 0;
  if (p->ops->release_dev != NULL)
    p->ops->release_dev(&p->dev);
  p->ops = NULL;
}

/* Whether b is made of n pieces of `piece` bytes, with room for one more job's holders. */
static bool block_is(const struct pool_block *b, uint32_t n, uint64_t piece) {
  return b->n_pieces == n && b->piece_bytes == piece &&
         b->n_holders + DEP_MAX_LOCAL_RANKS <= POOL_MAX_HOLDERS;
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
    if (b->state != POOL_BLOCK_FREE || b->n_holders > 0)
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
    if (b->state == POOL_BLOCK_CACHED && b->n_holders == 0 &&
        (best == NULL || b->cached_seq < best->cached_seq))
      best = b;
  return best;
}

/* The cached region to evict first, likewise. */
static struct pool_region *cached_region_victim(const struct pool *p) {
  struct pool_region *best = NULL;
  for (struct pool_region *r = p->regions; r != NULL; r = r->next)
    if (r->state == POOL_BLOCK_CACHED && r->n_holders == 0 &&
        (best == NULL || r->cached_seq < best->cached_seq))
      best = r;
  return best;
}

/*
 * Unmake free blocks, then cached ones, until the budget has room for a
 * block of `size`.  The caller has checked that the blocks lent to live
 * jobs leave that room, so this always succeeds.  Logged, so that an
 * operator sees a job of a new shape displace the memory of older ones.
 */
static void make_room(struct pool *p, uint64_t size, uid_t uid, const char *what) {
  uint32_t n_free = 0, n_cached = 0, n_regions = 0;
  uint64_t released = 0;
  while (pool_room(p) < size) {
    struct pool_block *b = free_victim(p, uid);
    struct pool_region *r = NULL;
    if (b != NULL) {
      n_free++;
    } else {
      /* The oldest cached thing, block or region. */
      b = cached_victim(p);
      r = cached_region_victim(p);
      if (b != NULL && r != NULL && r->cached_seq < b->cached_seq)
        b = NULL;
      else if (b != NULL)
        r = NULL;
      if (b == NULL && r == NULL)
        break; /* only lent and held memory left: the caller's check makes this unreachable */
      if (b != NULL)
        n_cached++;
      else
        n_regions++;
    }
    if (r != NULL) {
      released += r->bytes;
      region_unmake(p, r);
    } else {
      released += pool_block_bytes(b);
      block_unmake(p, b);
    }
  }
  if (n_free + n_cached + n_regions == 0)
    return;
  char a[32], c[32], regions[64] = "";
  if (n_regions > 0)
    snprintf(regions, sizeof regions, " and %u cached exchange region(s)", n_regions);
  log_info("pool %s: unmade %u free and %u cached block(s)%s, %s in all, to make room for %s of "
           "%s", p->dev.uuid_str, n_free, n_cached, regions, SIZE_TEXT(released, a), what,
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

/* Refuse a block that would take uid past its quota: fresh memory counts
 * in full, a block already charged to uid (held by its processes) not again. */
static int check_quota(const struct pool *p, uid_t uid, uint64_t quota, uint64_t size,
                       bool charged, char *why, size_t whylen) {
  if (quota == 0)
    return 0;
  uint64_t have = pool_uid_bytes(p, uid);
  if (charged || have + size <= quota)
    return 0;
  char a[32], c[32], d[32];
  snprintf(why, whylen, "uid %u already holds %s on device %s (its jobs, and memory its "
           "processes were lent and may still hold until they exit); a block of %s more would "
           "pass limits.memory_per_uid (%s): end those processes or jobs, or raise the limit",
           (unsigned)uid, SIZE_TEXT(have, a), p->dev.uuid_str, SIZE_TEXT(size, c),
           SIZE_TEXT(quota, d));
  return DEP_ERR_LIMIT;
}

/* Whether the budget can hold `size` more beside what live jobs and holders
 * keep (then make_room finds it); DEP_ERR_NO_MEMORY with why, naming what. */
static int check_room(const struct pool *p, uint64_t size, const char *what, char *why,
                      size_t whylen) {
  char t[32], u[32], v[32], x[32];
  const uint64_t held = pool_held_bytes(p);
  if (size <= p->budget_bytes && p->budget_bytes - size >= p->used_bytes + held)
    return 0;
  char held_text[160] = "";
  if (held > 0)
    snprintf(held_text, sizeof held_text, ", and processes whose jobs ended (or that a "
             "stopped deepepd served) still hold %s until they exit", SIZE_TEXT(held, x));
  snprintf(why, whylen, "device %s (%s) cannot lend this job %s of %s: its pool's budget is %s "
           "and live jobs hold %s of it%s; raise pool.size_per_device (pool.host_size on the "
           "host backend), lower max_tokens_per_rank, or wait for jobs to end", p->dev.uuid_str,
           p->dev.name, what, SIZE_TEXT(size, v), SIZE_TEXT(p->budget_bytes, t),
           SIZE_TEXT(p->used_bytes, u), held_text);
  return DEP_ERR_NO_MEMORY;
}

int pool_block_get(struct pool *p, uint64_t bytes, uint64_t max_piece, uid_t uid,
                   uint64_t shape_key, uint64_t uid_quota, struct pool_block **out, char *why,
                   size_t whylen) {
  uint32_t n;
  uint64_t piece;
  const uint64_t size = pool_block_layout(p, bytes, max_piece, &n, &piece);
  pool_reap(p);
  struct pool_block *b = cached_match(p, n, piece, uid, shape_key);
  if (b == NULL)
    b = free_match(p, n, piece, uid);
  bool charged = b != NULL && b->has_owner && b->last_uid == uid && b->n_holders > 0;
  int rc = check_quota(p, uid, uid_quota, size, charged, why, whylen);
  if (rc != 0)
    return rc;
  if (b == NULL) {
    char t[32], u[32], v[32], w[32];
    if ((rc = check_room(p, size, "a block", why, whylen)) != 0)
      return rc;
    make_room(p, size, uid, "a block");
    rc = block_make(p, n, piece, &b, why, whylen);
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

void pool_block_hold(struct pool_block *b, const struct proc_id *p) {
  if (p->pid <= 0)
    return; /* gone already: it holds nothing */
  const struct proc_id id = *p;
  for (uint32_t i = 0; i < b->n_holders; i++)
    if (b->holders[i].pid == id.pid && b->holders[i].start == id.start)
      return;
  if (b->n_holders == POOL_MAX_HOLDERS)
    b->n_holders = holders_reap(b->holders, b->n_holders, 0, NULL, 0);
  if (b->n_holders < POOL_MAX_HOLDERS)
    b->holders[b->n_holders++] = id;
  else
    log_warnx("pool %s: a block already has %u live holders; pid %d is not tracked",
              b->pool->dev.uuid_str, (unsigned)POOL_MAX_HOLDERS, (int)id.pid);
}

void pool_block_abandon(struct pool_block *b) {
  struct pool *p = b->pool;
  b->n_holders = 0; /* charged by the next daemon, from the held file */
  block_unmake(p, b);
}

/* The backend copies one flush of pool_batch hands it at most: the rest waits for the next. */
#define POOL_BATCH_IOS 64

/* Pool p's part of a batch, as backend copies: cut at the blocks' pieces and
 * at the backend's staging (ops->batch_bytes), a flush whenever either fills. */
static int batch_on(struct pool *p, const struct pool_io *io, size_t n, char *why,
                    size_t whylen) {
  struct chunk_io c[POOL_BATCH_IOS];
  size_t k = 0, staged = 0;
  for (size_t i = 0; i < n; i++) {
    if (io[i].b->pool != p)
      continue;
    const struct pool_block *b = io[i].b;
    for (size_t done = 0; done < io[i].len;) {
      const uint64_t off = io[i].off + done, in = off % b->piece_bytes;
      size_t len = io[i].len - done;
      if (len > b->piece_bytes - in)
        len = (size_t)(b->piece_bytes - in);
      const bool zeros = io[i].buf == NULL;
      if (!zeros && len > p->ops->batch_bytes - staged)
        len = p->ops->batch_bytes - staged;
      if (len > 0)
        c[k++] = (struct chunk_io){.m = &io[i].b->piece[off / b->piece_bytes], .off = in,
                                   .buf = zeros ? NULL : (uint8_t *)io[i].buf + done, .len = len,
                                   .read = io[i].read};
      staged += zeros ? 0 : len;
      done += len;
      if (k == POOL_BATCH_IOS || (!zeros && staged == p->ops->batch_bytes)) {
        int rc = p->ops->chunk_batch(&p->dev, c, k, why, whylen);
        if (rc != 0)
          return rc;
        k = staged = 0;
      }
    }
  }
  return k > 0 ? p->ops->chunk_batch(&p->dev, c, k, why, whylen) : 0;
}

int pool_batch(const struct pool_io *io, size_t n, char *why, size_t whylen) {
  for (size_t i = 0; i < n; i++) {
    if (io[i].read && io[i].buf == NULL) {
      snprintf(why, whylen, "a read of %zu bytes at %llu has nowhere to go", io[i].len,
               (unsigned long long)io[i].off);
      return DEP_ERR_INVALID;
    }
    if (io[i].off > pool_block_bytes(io[i].b) ||
        io[i].len > pool_block_bytes(io[i].b) - io[i].off) {
      snprintf(why, whylen, "%s of %zu bytes at %llu passes the end of a block of %llu bytes",
               io[i].read ? "a read" : "a write", io[i].len, (unsigned long long)io[i].off,
               (unsigned long long)pool_block_bytes(io[i].b));
      return DEP_ERR_INVALID;
    }
  }
  /* Each device's copies at once, in the order of their first. */
  for (size_t i = 0; i < n; i++) {
    bool seen = false;
    for (size_t h = 0; h < i && !seen; h++)
      seen = io[h].b->pool == io[i].b->pool;
    int rc = seen ? 0 : batch_on(io[i].b->pool, io, n, why, whylen);
    if (rc != 0)
      return rc;
  }
  return 0;
}

int pool_block_read(struct pool_block *b, uint64_t off, void *dst, size_t len, char *why,
                    size_t whylen) {
  const struct pool_io io = {.b = b, .off = off, .buf = dst, .len = len, .read = true};
  return pool_batch(&io, 1, why, whylen);
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

/* ---- regions (rings and exchange regions) --------------------------------------- */

/* A cached region of this uid, key and size; one another uid used is never lent. */
static struct pool_region *cached_region(const struct pool *p, uint64_t bytes, uid_t uid,
                                         uint64_t key) {
  for (struct pool_region *r = p->regions; r != NULL; r = r->next)
    if (r->state == POOL_BLOCK_CACHED && r->uid == uid && r->key == key && r->bytes == bytes &&
        r->n_holders + DEP_MAX_LOCAL_RANKS <= POOL_MAX_HOLDERS)
      return r;
  return NULL;
}

/* A new sealed memfd of `bytes`, mapped, zero; put on the pool's list. */
static int region_make(struct pool *p, uint64_t bytes, struct pool_region **out, char *why,
                       size_t whylen) {
  char a[32];
  struct pool_region *r = calloc(1, sizeof *r);
  if (r == NULL) {
    snprintf(why, whylen, "out of memory for a region record");
    return DEP_ERR_NO_MEMORY;
  }
  struct stat st;
  r->map = MAP_FAILED;
  r->fd = memfd_create("deepepd-xchg", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->fd < 0 || ftruncate(r->fd, (off_t)bytes) != 0 ||
      fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      fstat(r->fd, &st) != 0 ||
      (r->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0)) == MAP_FAILED) {
    snprintf(why, whylen, "cannot make a ring and exchange region of %s of host memory: %s",
             SIZE_TEXT(bytes, a), strerror(errno));
    if (r->fd >= 0)
      close(r->fd);
    free(r);
    return DEP_ERR_NO_MEMORY;
  }
  r->pool = p;
  r->bytes = bytes;
  r->file_dev = (uint64_t)st.st_dev;
  r->file_ino = (uint64_t)st.st_ino;
  r->next = p->regions;
  p->regions = r;
  p->made_bytes += bytes;
  p->region_bytes += bytes;
  *out = r;
  return 0;
}

int pool_region_get(struct pool *p, uint64_t bytes, uid_t uid, uint64_t key, uint64_t uid_quota,
                    struct pool_region **out, char *why, size_t whylen) {
  pool_reap(p);
  struct pool_region *r = cached_region(p, bytes, uid, key);
  int rc = check_quota(p, uid, uid_quota, bytes, r != NULL && r->n_holders > 0, why, whylen);
  if (rc != 0)
    return rc;
  if (r != NULL) {
    p->cached_bytes -= bytes;
    r->warm = true;
  } else {
    if ((rc = check_room(p, bytes, "a ring and exchange region", why, whylen)) != 0)
      return rc;
    make_room(p, bytes, uid, "a ring and exchange region");
    if ((rc = region_make(p, bytes, &r, why, whylen)) != 0)
      return rc;
    r->warm = false;
  }
  r->state = POOL_BLOCK_LENT;
  r->uid = uid;
  r->key = key;
  p->used_bytes += bytes;
  *out = r;
  return 0;
}

void pool_region_hold(struct pool_region *r, const struct proc_id *p) {
  if (p->pid <= 0)
    return;
  for (uint32_t i = 0; i < r->n_holders; i++)
    if (r->holders[i].pid == p->pid && r->holders[i].start == p->start)
      return;
  if (r->n_holders == POOL_MAX_HOLDERS)
    r->n_holders = holders_reap(r->holders, r->n_holders, 0, NULL, 0);
  if (r->n_holders < POOL_MAX_HOLDERS)
    r->holders[r->n_holders++] = *p;
  else
    log_warnx("pool %s: a region already has %u live holders; pid %d is not tracked",
              r->pool->dev.uuid_str, (unsigned)POOL_MAX_HOLDERS, (int)p->pid);
}

void pool_region_put(struct pool_region *r, bool cache) {
  struct pool *p = r->pool;
  p->used_bytes -= r->bytes;
  if (!cache) {
    r->state = POOL_BLOCK_FREE; /* not lent: live holders make it a ghost */
    region_unmake(p, r);
    return;
  }
  r->state = POOL_BLOCK_CACHED;
  r->cached_seq = ++p->cache_seq;
  p->cached_bytes += r->bytes;
}
