/*
 * pool.h — one device's pool of fixed-size chunks, and the slabs (runs of
 * chunks) lent from it to the ranks of a job (DESIGN §4).
 *
 * Life of a chunk: made (at start with preallocation, else on first
 * demand) → lent in a slab → scrubbed when its job ends → free, or cached
 * with its slab for the next job of the same shape and owner.  A chunk is
 * only ever in one slab, so one job alone can reach it.
 */
#ifndef DEP_POOL_H
#define DEP_POOL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "backend.h"

enum pool_chunk_state { POOL_CHUNK_FREE = 0, POOL_CHUNK_LENT, POOL_CHUNK_CACHED };

struct pool_chunk {
  struct chunk_mem mem;
  bool made;
  enum pool_chunk_state state;
  bool has_owner;
  uid_t last_uid;           /* owner of the last job it served */
};

struct pool_slab {
  struct pool *pool;
  uint64_t bytes;           /* n * chunk_bytes: what the client maps */
  uint32_t n;
  uint32_t *idx;            /* chunk indices, in mapping order */
  uid_t uid;
  uint64_t shape_key;       /* what the cache matches on */
  struct pool_slab *next;   /* in the pool's cache list */
};

struct pool {
  struct backend_dev dev;
  const struct backend_ops *ops;
  uint64_t chunk_bytes;
  uint32_t n_chunks;
  struct pool_chunk *chunks;
  struct pool_slab *cache;  /* scrubbed slabs of finished jobs */
  uint64_t used_bytes;
  uint64_t cached_bytes;
  uint64_t made_bytes;
};

/*
 * Set up a pool of total_bytes / chunk_bytes chunks on dev; with prealloc
 * make every chunk now.  Returns 0 or DEP_ERR_* with why.
 */
int pool_init(struct pool *p, const struct backend_ops *ops, const struct backend_dev *dev,
              uint64_t total_bytes, uint64_t chunk_bytes, bool prealloc, char *why,
              size_t whylen);
void pool_fini(struct pool *p);

/*
 * Lend a slab of at least `bytes` to a job of `uid`.  A cached slab of the
 * same shape_key and uid is taken first.  DEP_ERR_NO_MEMORY (with why) when
 * the pool cannot hold it even after evicting the cache.
 */
int pool_slab_get(struct pool *p, uint64_t bytes, uid_t uid, uint64_t shape_key,
                  struct pool_slab **out, char *why, size_t whylen);

/* Return a slab: scrub its chunks, then cache it (cache = true) or free them. */
void pool_slab_put(struct pool_slab *s, bool cache);

/* Drop every cached slab back to free chunks (buffer cache turned off). */
void pool_cache_flush(struct pool *p);

/* The fd of the i-th chunk of a slab (owned by the pool: do not close). */
int pool_slab_fd(const struct pool_slab *s, uint32_t i);

uint64_t pool_total_bytes(const struct pool *p);

#endif /* DEP_POOL_H */
