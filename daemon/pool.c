/*
 * pool.c — per-device chunk pools and the slabs lent from them (pool.h).
 */
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static int chunk_make(struct pool *p, struct pool_chunk *c, char *why, size_t whylen) {
  int rc = p->ops->chunk_create(&p->dev, p->chunk_bytes, &c->mem, why, whylen);
  if (rc != 0)
    return rc;
  c->made = true;
  c->has_owner = false;
  p->made_bytes += p->chunk_bytes;
  return 0;
}

static void chunk_unmake(struct pool *p, struct pool_chunk *c) {
  if (!c->made)
    return;
  p->ops->chunk_destroy(&p->dev, &c->mem);
  c->made = false;
  c->has_owner = false;
  p->made_bytes -= p->chunk_bytes;
}

int pool_init(struct pool *p, const struct backend_ops *ops, const struct backend_dev *dev,
              uint64_t total_bytes, uint64_t chunk_bytes, bool prealloc, char *why,
              size_t whylen) {
  memset(p, 0, sizeof *p);
  p->ops = ops;
  p->dev = *dev;
  if (chunk_bytes == 0 || dev->granularity == 0 || chunk_bytes % dev->granularity != 0) {
    snprintf(why, whylen, "pool.chunk_size %llu is not a multiple of device %s's allocation "
             "granularity %llu", (unsigned long long)chunk_bytes, dev->uuid_str,
             (unsigned long long)dev->granularity);
    return DEP_ERR_CONFIG;
  }
  p->chunk_bytes = chunk_bytes;
  p->n_chunks = (uint32_t)(total_bytes / chunk_bytes);
  p->chunks = calloc(p->n_chunks ? p->n_chunks : 1, sizeof *p->chunks);
  if (p->chunks == NULL) {
    snprintf(why, whylen, "out of memory for %u chunk records", p->n_chunks);
    return DEP_ERR_NO_MEMORY;
  }
  for (uint32_t i = 0; i < p->n_chunks; i++)
    p->chunks[i].mem.fd = -1;
  if (!prealloc)
    return 0;
  for (uint32_t i = 0; i < p->n_chunks; i++) {
    int rc = chunk_make(p, &p->chunks[i], why, whylen);
    if (rc != 0) {
      pool_fini(p);
      return rc;
    }
  }
  return 0;
}

static void slab_free(struct pool_slab *s) {
  free(s->idx);
  free(s);
}

void pool_cache_flush(struct pool *p) {
  while (p->cache != NULL) {
    struct pool_slab *s = p->cache;
    p->cache = s->next;
    for (uint32_t i = 0; i < s->n; i++)
      p->chunks[s->idx[i]].state = POOL_CHUNK_FREE;
    p->cached_bytes -= s->bytes;
    slab_free(s);
  }
}

void pool_fini(struct pool *p) {
  if (p->chunks == NULL)
    return;
  pool_cache_flush(p);
  for (uint32_t i = 0; i < p->n_chunks; i++)
    chunk_unmake(p, &p->chunks[i]);
  free(p->chunks);
  p->chunks = NULL;
  if (p->ops != NULL && p->ops->release_dev != NULL)
    p->ops->release_dev(&p->dev);
}

static struct pool_slab *cache_take(struct pool *p, uint64_t bytes, uid_t uid, uint64_t key) {
  for (struct pool_slab **pp = &p->cache; *pp != NULL; pp = &(*pp)->next) {
    struct pool_slab *s = *pp;
    if (s->uid == uid && s->shape_key == key && s->bytes == bytes) {
      *pp = s->next;
      s->next = NULL;
      p->cached_bytes -= s->bytes;
      return s;
    }
  }
  return NULL;
}

static uint32_t free_count(const struct pool *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < p->n_chunks; i++)
    n += p->chunks[i].state == POOL_CHUNK_FREE;
  return n;
}

int pool_slab_get(struct pool *p, uint64_t bytes, uid_t uid, uint64_t shape_key,
                  struct pool_slab **out, char *why, size_t whylen) {
  uint64_t want = (bytes + p->chunk_bytes - 1) / p->chunk_bytes;
  if (want == 0)
    want = 1;
  struct pool_slab *s = cache_take(p, want * p->chunk_bytes, uid, shape_key);
  if (s != NULL) {
    for (uint32_t i = 0; i < s->n; i++)
      p->chunks[s->idx[i]].state = POOL_CHUNK_LENT;
    p->used_bytes += s->bytes;
    *out = s;
    return 0;
  }
  if (want > p->n_chunks || free_count(p) < want)
    pool_cache_flush(p); /* cached slabs give way to a live job */
  uint32_t nfree = free_count(p);
  if (want > nfree) {
    snprintf(why, whylen,
             "a slab of %llu bytes needs %llu chunks of %llu bytes, but device %s (%s) has %u "
             "free of %u; raise pool.size_per_device (or pool.host_size) or lower "
             "max_tokens_per_rank",
             (unsigned long long)bytes, (unsigned long long)want,
             (unsigned long long)p->chunk_bytes, p->dev.uuid_str, p->dev.name, nfree, p->n_chunks);
    return DEP_ERR_NO_MEMORY;
  }
  s = calloc(1, sizeof *s);
  uint32_t *idx = calloc((size_t)want, sizeof *idx);
  if (s == NULL || idx == NULL) {
    free(s);
    free(idx);
    snprintf(why, whylen, "out of memory for a slab record");
    return DEP_ERR_NO_MEMORY;
  }
  s->pool = p;
  s->idx = idx;
  s->uid = uid;
  s->shape_key = shape_key;
  int rc = 0;
  for (uint32_t i = 0; i < p->n_chunks && s->n < want; i++) {
    struct pool_chunk *c = &p->chunks[i];
    if (c->state != POOL_CHUNK_FREE)
      continue;
    /* A scrubbed chunk is clean, but a rank of its last job may still map
     * it (the daemon cannot revoke a mapping).  Another tenant therefore
     * gets fresh memory: the old allocation lives on only for whoever
     * still maps it. */
    if (c->made && c->has_owner && c->last_uid != uid)
      chunk_unmake(p, c);
    if (!c->made && (rc = chunk_make(p, c, why, whylen)) != 0)
      break;
    c->state = POOL_CHUNK_LENT;
    c->has_owner = true;
    c->last_uid = uid;
    s->idx[s->n++] = i;
  }
  if (rc != 0) {
    for (uint32_t i = 0; i < s->n; i++)
      p->chunks[s->idx[i]].state = POOL_CHUNK_FREE;
    slab_free(s);
    return rc;
  }
  s->bytes = (uint64_t)s->n * p->chunk_bytes;
  p->used_bytes += s->bytes;
  *out = s;
  return 0;
}

void pool_slab_put(struct pool_slab *s, bool cache) {
  struct pool *p = s->pool;
  bool clean = true;
  for (uint32_t i = 0; i < s->n; i++) {
    struct pool_chunk *c = &p->chunks[s->idx[i]];
    char why[256];
    if (p->ops->chunk_scrub(&p->dev, &c->mem, why, sizeof why) != 0) {
      /* Never lend memory that could not be scrubbed: drop it instead. */
      log_warnx("pool %s: scrub failed (%s); discarding the chunk", p->dev.uuid_str, why);
      chunk_unmake(p, c);
      clean = false;
    }
  }
  p->used_bytes -= s->bytes;
  if (cache && clean) {
    for (uint32_t i = 0; i < s->n; i++)
      p->chunks[s->idx[i]].state = POOL_CHUNK_CACHED;
    s->next = p->cache;
    p->cache = s;
    p->cached_bytes += s->bytes;
    return;
  }
  for (uint32_t i = 0; i < s->n; i++)
    p->chunks[s->idx[i]].state = POOL_CHUNK_FREE;
  slab_free(s);
}

int pool_slab_fd(const struct pool_slab *s, uint32_t i) {
  return s->pool->chunks[s->idx[i]].mem.fd;
}

uint64_t pool_total_bytes(const struct pool *p) { return (uint64_t)p->n_chunks * p->chunk_bytes; }
