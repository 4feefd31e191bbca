/*
 * statrec.c — lending, mapping and the less frequent writes of the per-rank
 * stats page (statrec.h); the per-call writes are inline in statrec.h.
 */
#include "statrec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"

uint64_t statrec_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static bool statrec_enabled(void) {
  const char *e = getenv(STATREC_ENV);
  return e == NULL || strcmp(e, "0") != 0;
}

void statrec_lend(dep_client_t *c) {
  c->stats.page = NULL;
  c->stats.layouts = 0;
  if (!statrec_enabled())
    return;
  /* The page holds a count per rank of the job's world in each layout entry: its size is the
   * world's (attach checked the world against DEP_MAX_WORLD). */
  const uint32_t world = c->args.world_size;
  const size_t bytes = dep_stats_page_bytes(world);
  /* An ERROR here (an older daemon's DEP_ERR_UNSUPPORTED, or one out of
   * memory) leaves the connection open and the rank without stats. */
  void *p = NULL;
  char why[256];
  if (client_lend_map(c, DEP_MSG_STATS_LEND, DEP_MSG_STATS_LEND_OK, DEP_STATS_VERSION,
                      (uint32_t)bytes, bytes, &p, why, sizeof why) != 0)
    return;
  struct dep_stats_page *pg = p;
  /* The daemon wrote the header; a page that is not ours to write is left alone. */
  if (pg->magic != DEP_STATS_MAGIC || pg->version != DEP_STATS_VERSION ||
      pg->rank != c->args.rank || pg->world != world || pg->bytes != bytes) {
    munmap(p, bytes);
    return;
  }
  c->stats.page = pg;
  c->stats.bytes = bytes;
  c->stats.world = world;
}

void statrec_attached(dep_client_t *c) {
  struct dep_stats_page *p = c->stats.page;
  if (p == NULL)
    return;
  p->backend_cuda = c->cuda ? 1u : 0u;
  p->attach_total_ns = (uint64_t)(c->times.total_ms * 1e6);
  p->attach_wait_ns = (uint64_t)(c->times.wait_ms * 1e6);
  p->attach_map_ns = (uint64_t)(c->times.map_ms * 1e6);
  p->attach_setup_ns = (uint64_t)(c->times.setup_ms * 1e6);
  p->attach_warmup_ns = (uint64_t)(c->times.warmup_ms * 1e6);
  __atomic_store_n(&p->attached, 1u, __ATOMIC_RELEASE);
}

void statrec_unmap(dep_client_t *c) {
  if (c->stats.page != NULL)
    munmap(c->stats.page, c->stats.bytes);
  c->stats.page = NULL;
}

void statrec_layout(struct statrec *s, uint64_t ns, int status, const int32_t *tokens_per_rank,
                    uint32_t world) {
  if (s->page == NULL)
    return;
  uint64_t n = ++s->layouts;
  struct dep_stats_layout *e = dep_stats_layout_at(s->page, s->world, n % DEP_STATS_LAYOUT_RING);
  __atomic_store_n(&e->n, 0, __ATOMIC_RELAXED); /* being rewritten: a reader skips it */
  __atomic_thread_fence(__ATOMIC_RELEASE);
  if (world > s->world)
    world = s->world;
  e->ns = ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
  e->status = status;
  e->world = status == 0 && tokens_per_rank != NULL ? world : 0;
  uint32_t *tokens = dep_stats_layout_tokens(e);
  for (uint32_t i = 0; i < e->world; i++)
    tokens[i] = tokens_per_rank[i] > 0 ? (uint32_t)tokens_per_rank[i] : 0;
  __atomic_store_n(&e->n, n, __ATOMIC_RELEASE);
}
