/*
 * lend.c — lending (DESIGN §4): the arenas a job's local ranks are lent
 * from the device pools when its rendezvous completes, the checks that a
 * job's memory can be lent at all, the SLAB frames that carry the arenas'
 * fds, the abort words written into the slabs of a running job's ranks,
 * and the reaping of memory that processes held after their jobs.  The job
 * table and rendezvous (job.c) decide when; this module decides what.
 */
#include "lend.h"
#include "nicreg.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "config_value.h"
#include "conn.h"
#include "devices.h"
#include "held.h"
#include "log.h"
#include "peer.h"
#include "pool.h"
#include "proto.h"
#include "rdmaxp.h"
#include "shape.h"
#include "slab.h"
#include "xring.h"

static const struct config *lend_cfg;
static uv_timer_t lend_reaper;
static bool lend_reaper_open;

/* How often the pools look for processes that have exited with memory they held. */
#define LEND_REAP_MS 1000

static void lend_on_reap(uv_timer_t *t) {
  bool changed = false;
  for (size_t i = 0; i < devices_count(); i++) {
    struct pool *p = devices_at(i);
    uint64_t before = pool_held_bytes(p);
    pool_reap(p);
    changed |= pool_held_bytes(p) != before;
  }
  if (changed)
    held_changed();
}

/* What the buffer cache matches on: the same shape and world (slab.h). */
static uint64_t lend_shape_key(const struct job *j) {
  return dep__slab_key(&j->shape, j->world_size, j->chunk_rows);
}

/* What a ring and exchange region is cached under: the layout's inputs,
 * shape and world (the slab's key) and the count of local ranks. */
static uint64_t lend_xchg_key(const struct job *j) {
  return lend_shape_key(j) * 0x9e3779b97f4a7c15ull + j->local_world_size;
}

/* Let go of the job's rings and exchange regions (the proxy no longer uses
 * them): cached for the next job of its uid and key, or unmade. */
static void lend_xchg_free(struct job *j, bool cache) {
  if (j->xchg == NULL)
    return;
  for (uint32_t i = 0; i < j->local_world_size; i++)
    if (j->xchg[i].region != NULL)
      pool_region_put(j->xchg[i].region, cache);
  free(j->xchg);
  j->xchg = NULL;
}

/*
 * A region taken from the cache: what the last job left that the new one
 * must not see.  The ring's indices and entries, and every slot (a flag
 * of the last job's calls would pass for one of this job's: sequences
 * start again at each job); the blocks keep the same uid's bytes, which a
 * receiver reads only after a slot's flag of this job says they are in.
 */
static void lend_xchg_reset(uint8_t *map, const struct dep_slab_layout *l) {
  memset(map, 0, DEP_XRING_BYTES);
  memset(map + DEP_XRING_BYTES + l->in_slot_off, 0, l->in_off - l->in_slot_off);
}

/*
 * A job that spans nodes, of any world: one ring and exchange region per
 * local rank from its device's pool (pool.h: cached from an earlier job of
 * the uid and key, reset, or made zero), its ring's header written (the
 * ranks check it).  0, or
 * DEP_ERR_NO_MEMORY / LIMIT / INVALID with why.
 */
static int lend_xchg_make(struct job *j, char *why, size_t whylen) {
  if (!j->multinode || j->xchg != NULL)
    return 0;
  struct dep_slab_layout l;
  int rc = dep__slab_layout_nodes(&j->shape, j->world_size, j->local_world_size, j->chunk_rows, &l,
                                  why, whylen);
  if (rc != 0)
    return rc;
  j->xchg = calloc(j->local_world_size, sizeof *j->xchg);
  if (j->xchg == NULL) {
    snprintf(why, whylen, "out of memory for the rings of %u local ranks", j->local_world_size);
    return DEP_ERR_NO_MEMORY;
  }
  const uint64_t bytes = DEP_XRING_BYTES + l.xchg_bytes, key = lend_xchg_key(j);
  uint32_t warm = 0, registered = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct pool *p = j->ranks[i].arena->pool; /* lend_arenas placed every rank */
    struct pool_region *r = NULL;
    rc = pool_region_get(p, bytes, j->owner_uid, key, lend_cfg->memory_per_uid, &r, why, whylen);
    if (rc != 0) {
      lend_xchg_free(j, lend_cfg->buffer_cache_enabled);
      return rc;
    }
    j->xchg[i].region = r;
    if (r->warm) {
      lend_xchg_reset(r->map, &l);
      warm++;
      registered += r->mr != NULL;
    }
    struct dep_xring *ring = r->map;
    ring->magic = DEP_XRING_MAGIC;
    ring->version = DEP_XRING_VERSION;
    ring->entries = DEP_XRING_ENTRIES;
    ring->rank = j->ranks[i].rank;
    ring->xchg_bytes = l.xchg_bytes;
  }
  char a[32];
  if (warm > 0)
    log_info("job %s: %u of its %u local rank(s)' exchange regions (%s each) reused from an "
             "earlier job of uid %u of this shape, %u with their NIC registration", j->id, warm,
             j->local_world_size, config_value_size_text(bytes, a, sizeof a),
             (unsigned)j->owner_uid, registered);
  return 0;
}

void lend_xchg_hold(const struct job *j, uint32_t lr) {
  if (j->xchg == NULL || lr >= j->local_world_size || j->xchg[lr].region == NULL)
    return;
  pool_region_hold(j->xchg[lr].region, &j->ranks[lr].proc);
  held_changed(); /* the held file names its process (held.h) */
}

_Static_assert(POOL_MAX_PIECES <= DEP_PROTO_MAX_FDS, "an arena's pieces must fit one SLAB frame");

/* pool.max_allocation's value where it is 0 (the daemon chooses) and peer
 * GPUs map the arena: under the 512 MiB from which H200s map a peer GPU's
 * allocation several times slower (BENCHMARKS.md). */
#define LEND_PEER_MAX_ALLOCATION (480ull * 1024 * 1024)

/* Slabs sit this far apart in an arena: the layout's size, 64 KiB aligned. */
#define LEND_SLAB_ALIGN (64u * 1024u)

/* Return every arena the job holds to its pool, scrubbed (or cached), once each. */
void lend_release(struct job *j, bool abandon) {
  lend_xchg_free(j, !abandon && lend_cfg->buffer_cache_enabled);
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct pool_block *arena = j->ranks[i].arena;
    if (arena == NULL)
      continue;
    for (uint32_t k = i; k < j->local_world_size; k++)
      if (j->ranks[k].arena == arena)
        j->ranks[k].arena = NULL;
    /* A stop never scrubs or relends memory a live rank maps (DESIGN §13):
     * the daemon lets go of its handles, and the held file (held.h) tells
     * the next daemon what the ranks still hold. */
    if (abandon)
      pool_block_abandon(arena);
    else
      pool_block_put(arena, lend_cfg->buffer_cache_enabled);
  }
  held_changed();
}

/*
 * The most each allocation of the arena on device `uuid` may be (pool.h;
 * 0: one allocation).  Peers' GPUs map an allocation of 512 MiB or more
 * several times slower than smaller ones (BENCHMARKS.md, vmm_map -g), so
 * on cuda an arena that a rank on another GPU maps is cut at
 * pool.max_allocation, or LEND_PEER_MAX_ALLOCATION where that is 0 (the
 * daemon chooses).  An arena only its own GPU's ranks map stays whole:
 * each further allocation costs every rank an import.  On the host
 * (cuts_only_when_set) an arena is cut only where the key is set.
 * lend_peer_cap is the cap of an arena peers map, the most any arena is cut.
 */
static uint64_t lend_peer_cap(const struct pool *p) {
  const uint64_t set = lend_cfg->pool_max_allocation;
  return set != 0 || p->ops->cuts_only_when_set ? set : LEND_PEER_MAX_ALLOCATION;
}

static uint64_t lend_arena_cap(const struct job *j, const struct pool *p, const uint8_t *uuid) {
  if (p->ops->cuts_only_when_set)
    return lend_peer_cap(p);
  for (uint32_t k = 0; k < j->local_world_size; k++)
    if (memcmp(j->ranks[k].device_uuid, uuid, 16) != 0)
      return lend_peer_cap(p);
  return 0;
}

/*
 * The rendezvous completed: lend the job one arena per device, holding the
 * slabs of every local rank on that device one after another.  One arena
 * rather than one slab per rank, because every rank imports and maps every
 * local slab, and the driver's cost grows with the number of handles
 * imported across processes (BENCHMARKS.md, vmm_map); and each arena is one
 * block of exactly its size, because mapping peer memory costs by the
 * bytes mapped (pool.h).  A failure fails every waiting rank with the
 * returned code.
 */
int lend_arenas(struct job *j, char *why, size_t whylen) {
  uint64_t key = lend_shape_key(j);
  uint64_t stride = dep_round_up(j->slab_bytes, LEND_SLAB_ALIGN);
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *r = &j->ranks[i];
    if (r->arena != NULL)
      continue; /* placed in the arena of an earlier rank's device */
    uint32_t n = 0;
    for (uint32_t k = i; k < j->local_world_size; k++)
      n += j->ranks[k].arena == NULL &&
           memcmp(j->ranks[k].device_uuid, r->device_uuid, 16) == 0;
    struct pool *p = devices_find(r->device_uuid, why, whylen);
    struct pool_block *arena = NULL;
    int rc = p == NULL ? DEP_ERR_NOT_FOUND
                       : pool_block_get(p, n * stride, lend_arena_cap(j, p, r->device_uuid),
                                        j->owner_uid, key, lend_cfg->memory_per_uid, &arena,
                                        why, whylen);
    if (rc != 0) {
      lend_release(j, false);
      return rc;
    }
    uint64_t off = 0;
    for (uint32_t k = i; k < j->local_world_size; k++) {
      struct job_rank *q = &j->ranks[k];
      if (q->arena == NULL && memcmp(q->device_uuid, r->device_uuid, 16) == 0) {
        q->arena = arena;
        q->offset = off;
        off += stride;
      }
    }
  }
  j->slab_bytes = stride;
  int rc = lend_xchg_make(j, why, whylen);
  if (rc != 0)
    lend_release(j, false);
  return rc;
}


int lend_windows(const struct job *j, struct dep_peer_membership *x, char *why, size_t whylen) {
  x->n_windows = 0;
  for (uint32_t i = 0; j->xchg != NULL && i < j->local_world_size; i++) {
    struct pool_region *e = j->xchg[i].region;
    /* A region from the cache keeps its registration. */
    if (e->mr == NULL && rdmaxp_active())
      (void)nicreg_region(e); /* said there when it fails */
    if (x->n_windows == DEP_PEER_WINDOWS_MAX) {
      snprintf(why, whylen, "its %u local ranks need more than %d windows", j->local_world_size,
               DEP_PEER_WINDOWS_MAX);
      return DEP_ERR_LIMIT;
    }
    /* One window: the exchange region, from its first byte (after the ring). */
    x->windows[x->n_windows++] =
        nicreg_window(i, dep_xring_xchg(e->map), e->bytes - DEP_XRING_BYTES, e->mr);
  }
  return 0;
}

/*
 * Send one arena (the one holding local rank i's slab) to connection c: its
 * block's pieces as the frame's chunks, one fd each, in mapping order.
 */
static int lend_send_arena(const struct job *j, uint32_t i, struct conn *c, uint32_t request_id) {
  const struct pool_block *arena = j->ranks[i].arena;
  struct dep_msg_slab m = {.chunk_bytes = pool_block_piece_bytes(arena),
                           .n_chunks = pool_block_pieces(arena)};
  memcpy(m.device_uuid, j->ranks[i].device_uuid, sizeof m.device_uuid);
  for (uint32_t k = 0; k < j->local_world_size; k++) {
    if (j->ranks[k].arena != arena)
      continue;
    m.ranks[m.n_ranks++] = (struct dep_msg_slab_rank){k, j->ranks[k].rank, j->ranks[k].offset};
  }
  int fds[POOL_MAX_PIECES];
  for (uint32_t k = 0; k < m.n_chunks; k++)
    fds[k] = pool_block_fd(arena, k);
  /* From here the process may hold the memory until it exits. */
  pool_block_hold(j->ranks[i].arena, &j->ranks[c->job_local_rank].proc);
  return conn_send(c, DEP_MSG_SLAB, request_id, &m, fds, (int)m.n_chunks);
}

/* Send every arena of the job to connection c, one SLAB frame each. */
int lend_send(const struct job *j, struct conn *c, uint32_t request_id) {
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    bool first = true;
    for (uint32_t k = 0; k < i && first; k++)
      first = j->ranks[k].arena != j->ranks[i].arena;
    if (!first)
      continue;
    int rc = lend_send_arena(j, i, c, request_id);
    if (rc != 0)
      return rc;
  }
  /* c's process holds them now: the held file names it (written off this
   * turn of the loop, after the replies; a multi-node job's lending, before
   * its MEMBERSHIP, adds no holder and so no write in its way). */
  held_changed();
  return 0;
}

/*
 * What a job of a's shape takes of pool p when its channels hold chunks of
 * chunk_rows rows (0: whole blocks) and `here` of its local ranks are on
 * this device: their slabs in one arena, one block, in pieces (which round
 * up most), and, across nodes, each one's ring and exchange region
 * (pool.h).  The layout is l's; *xchg is a rank's ring and exchange region.
 */
static int lend_need(struct pool *p, const struct dep_attach_args *a, uint32_t chunk_rows,
                     uint32_t here, struct dep_slab_layout *l, uint64_t *xchg, uint64_t *need,
                     char *why, size_t whylen) {
  int rc = dep__slab_layout_nodes(&a->shape, a->world_size, a->local_world_size, chunk_rows, l,
                                  why, whylen);
  if (rc != 0)
    return rc;
  uint64_t stride = dep_round_up(l->total_bytes, LEND_SLAB_ALIGN);
  uint32_t pieces;
  uint64_t piece;
  *need = pool_block_layout(p, stride * here, lend_peer_cap(p), &pieces, &piece);
  *xchg = l->n_remote > 0 ? DEP_XRING_BYTES + l->xchg_bytes : 0;
  *need += *xchg * here;
  return 0;
}

/* Whether a's job in chunks of `rows` rows fits p's budget (its layout in *l, a rank's ring
 * and exchange region in *xchg). */
static bool lend_fits(struct pool *p, const struct dep_attach_args *a, uint32_t rows,
                      uint32_t here, struct dep_slab_layout *l, uint64_t *xchg) {
  uint64_t need;
  char ignored[8];
  return lend_need(p, a, rows, here, l, xchg, &need, ignored, sizeof ignored) == 0 &&
         need <= pool_total_bytes(p);
}

/*
 * For a job of whole blocks that does not fit: the largest chunk, a power of
 * two below a block's rows, with which `here` of its ranks would (its layout
 * in *l, a rank's ring and exchange region in *xchg), or 0 where streaming
 * does not make it fit either.  The one rule of both auto's choice and the
 * refusal's hint.
 */
static uint32_t lend_fitting_chunk(struct pool *p, const struct dep_attach_args *a, uint32_t here,
                                   struct dep_slab_layout *l, uint64_t *xchg) {
  for (uint32_t rows = 1u << 12; rows >= 1; rows >>= 1) {
    if (4ull * rows >= a->shape.max_tokens_per_rank)
      continue; /* 4 chunks of it hold a whole block: no smaller */
    if (lend_fits(p, a, rows, here, l, xchg))
      return rows;
  }
  return 0;
}

bool lend_spans_nodes(const struct dep_attach_args *a) {
  return a->world_size > a->local_world_size && peer_count() > 0;
}

uint32_t lend_ranks_here(uint32_t local_world, size_t devices, uint32_t seated_here) {
  const uint32_t spread =
      devices <= 1 ? local_world : (uint32_t)((local_world + devices - 1) / devices);
  const uint32_t here = seated_here + 1 > spread ? seated_here + 1 : spread;
  return here < local_world ? here : local_world;
}

/*
 * auto's chunk for a job across nodes on the host backend (lend.h), into *f, where its
 * blocks are larger than 4 such chunks and `here` of its ranks fit p; false otherwise.
 */
static bool lend_auto_xnode(struct pool *p, const struct dep_attach_args *a, uint32_t here,
                            uint64_t whole_bytes, struct lend_fit *f) {
  const uint32_t rows = LEND_AUTO_XNODE_HOST_ROWS;
  if (strcmp(devices_backend_name(), "host") != 0 || !lend_spans_nodes(a) ||
      4ull * rows >= a->shape.max_tokens_per_rank)
    return false;
  struct dep_slab_layout l;
  uint64_t xchg;
  if (!lend_fits(p, a, rows, here, &l, &xchg))
    return false;
  *f = (struct lend_fit){.chunk_rows = rows, .by_auto = true, .xnode = true, .here = here,
                         .slab_bytes = l.total_bytes, .host_bytes = xchg,
                         .whole_bytes = whole_bytes, .pool_bytes = pool_total_bytes(p)};
  return true;
}

/* The refusal of a job that needs `need` bytes of p for `here` ranks (l and xchg a rank's):
 * what it needs, what the pool holds, and for whole blocks (chunk_rows 0) the chunk that
 * would fit. */
static void lend_refusal(struct pool *p, const struct dep_attach_args *a, uint32_t chunk_rows,
                         uint32_t here, const struct dep_slab_layout *l, uint64_t xchg,
                         uint64_t need, char *why, size_t whylen) {
  const double mib = 1024.0 * 1024.0;
  struct dep_slab_layout sl;
  uint64_t sx = 0;
  const uint32_t fit = chunk_rows == 0 ? lend_fitting_chunk(p, a, here, &sl, &sx) : 0;
  char stream[112] = "";
  if (fit != 0)
    snprintf(stream, sizeof stream,
             ", or set stream_chunk_rows: %u on every node (%.1f MiB per rank; deepepctl size "
             "--chunk-rows N)",
             fit, (double)(sl.total_bytes + sx) / mib);
  /* On a daemon of several GPUs, how the count was reached (lend_ranks_here). */
  char spread[80] = "";
  const uint32_t even = lend_ranks_here(a->local_world_size, devices_count(), 0);
  if (here > even)
    snprintf(spread, sizeof spread, " (an even spread over its %zu GPUs puts %u: spread them)",
             devices_count(), even);
  else if (here < a->local_world_size)
    snprintf(spread, sizeof spread, " (%u local ranks over %zu GPUs)", a->local_world_size,
             devices_count());
  snprintf(why, whylen, "this job shape needs %.1f MiB per rank, %.1f MiB for its %u rank(s) "
           "on device %s%s, but that device's pool holds %.1f MiB; lower max_tokens_per_rank "
           "or hidden, or raise pool.size_per_device (pool.host_size on the host backend)%s",
           (double)(l->total_bytes + xchg) / mib, (double)need / mib, here, p->dev.uuid_str,
           spread, (double)pool_total_bytes(p) / mib, stream);
}

/*
 * Check, before a rank joins, what would otherwise fail only at the
 * rendezvous: its device is one this daemon serves, and the arena of the
 * job's shape for the ranks it would hold fits that device's pool's budget
 * at all (lend_ranks_here).  Under auto the chunk is chosen here, from the
 * shape, the worlds, the count of GPUs served and the pool's budget alone
 * (never what is free), so that nodes of the same configuration and
 * devices choose alike.  A job of whole blocks that streaming would fit is
 * told the chunk that does.
 */
int lend_check(const struct dep_attach_args *a, uint32_t chunk_rows, uint32_t seated_here,
               struct lend_fit *f, char *why, size_t whylen) {
  struct pool *p = devices_find(a->device_uuid, why, whylen);
  if (p == NULL)
    return DEP_ERR_NOT_FOUND;
  const bool by_auto = chunk_rows == CONFIG_CHUNK_ROWS_AUTO;
  const uint32_t here = lend_ranks_here(a->local_world_size, devices_count(), seated_here);
  struct dep_slab_layout l;
  uint64_t xchg, need;
  int rc = lend_need(p, a, by_auto ? 0 : chunk_rows, here, &l, &xchg, &need, why, whylen);
  if (rc != 0)
    return rc;
  if (by_auto && lend_auto_xnode(p, a, here, l.total_bytes + xchg, f))
    return 0;
  *f = (struct lend_fit){.chunk_rows = by_auto ? 0 : chunk_rows, .by_auto = by_auto,
                         .here = here, .whole_bytes = by_auto ? l.total_bytes + xchg : 0,
                         .pool_bytes = pool_total_bytes(p)};
  if (need > f->pool_bytes && by_auto) {
    struct dep_slab_layout sl;
    uint64_t sx = 0;
    const uint32_t fit = lend_fitting_chunk(p, a, here, &sl, &sx);
    if (fit != 0) {
      *f = (struct lend_fit){.chunk_rows = fit, .by_auto = true, .here = here,
                             .slab_bytes = sl.total_bytes, .host_bytes = sx,
                             .whole_bytes = l.total_bytes + xchg, .pool_bytes = f->pool_bytes};
      return 0;
    }
  }
  if (need > f->pool_bytes) { /* auto too where streaming fits no better */
    lend_refusal(p, a, f->chunk_rows, here, &l, xchg, need, why, whylen);
    return DEP_ERR_NO_MEMORY;
  }
  f->slab_bytes = l.total_bytes;
  f->host_bytes = xchg;
  return 0;
}

/*
 * Rank `gone` of a running job has left: tell every local rank still in it,
 * through the abort words of its slab (slab.h) that their operations' waits
 * poll, so that they fail at once naming it instead of waiting out
 * limits.op_timeout_ms.  Not while the daemon stops: the ranks are fine and
 * go on without it.
 */
void lend_tell_gone(struct job *j, const struct job_rank *gone, uint32_t how) {
  const bool detached = how == DEP_SLAB_GONE_DETACHED;
  /* One record of words: the first death or lost node stays (a rank that
   * detaches after it must not hide it), and a detach names the first rank
   * to leave only while nothing worse was told. */
  if (j->told != 0 && (detached || j->told != 1 + DEP_SLAB_GONE_DETACHED))
    return;
  j->told = 1 + how;
  struct dep_slab_abort ab = {.rank = gone->rank, .pid = (uint32_t)gone->pid, .detached = how,
                              .code = DEP_ERR_PEER};
  /* Who and how first, the code last (a reader that sees the code sees the
   * rest), every local rank's in one batch: its copies land in order. */
  struct pool_io io[2 * DEP_MAX_LOCAL_RANKS];
  uint32_t told = 0;
  for (uint32_t i = 0; i < j->local_world_size; i++) {
    struct job_rank *q = &j->ranks[i];
    if (q == gone || q->conn == NULL || q->arena == NULL)
      continue;
    const uint64_t at = q->offset + DEP_SLAB_ABORT_OFF;
    io[2 * told] = (struct pool_io){q->arena, at, &ab, offsetof(struct dep_slab_abort, code),
                                    false};
    io[2 * told + 1] = (struct pool_io){q->arena, at + offsetof(struct dep_slab_abort, code),
                                        &ab.code, sizeof ab.code, false};
    told++;
  }
  char why[256] = "";
  if (told > 0 && pool_batch(io, 2 * told, why, sizeof why) != 0) {
    log_warnx("job %s: cannot tell its %u local rank(s) that rank %u is gone: %s", j->id, told,
              gone->rank, why);
    told = 0;
  }
  /* A detach is how a job ends, rank by rank; a disconnect mid-job is news. */
  if (told > 0 && detached)
    log_info("job %s: rank %u (pid %d) detached; its %u local peer(s) are told, so that a call "
             "still waiting for it fails with DEP_ERR_PEER", j->id, gone->rank, (int)gone->pid,
             told);
  else if (told > 0 && how == DEP_SLAB_GONE_NODE)
    log_notice("job %s: the node of rank %u is lost; its %u local rank(s) here fail any call "
               "waiting with DEP_ERR_PEER", j->id, gone->rank, told);
  else if (told > 0 && how != DEP_SLAB_GONE_CUT) /* elastic_cut says why itself */
    log_notice("job %s: rank %u (pid %d) disconnected while the job ran; its %u local peer(s) "
               "fail any call waiting for it with DEP_ERR_PEER", j->id, gone->rank,
               (int)gone->pid, told);
}


void lend_init(uv_loop_t *loop, const struct config *cfg) {
  lend_cfg = cfg;
  uv_timer_init(loop, &lend_reaper);
  uv_timer_start(&lend_reaper, lend_on_reap, LEND_REAP_MS, LEND_REAP_MS);
  uv_unref((uv_handle_t *)&lend_reaper);
  lend_reaper_open = true;
}

void lend_fini(void) {
  if (lend_reaper_open) {
    uv_close((uv_handle_t *)&lend_reaper, NULL);
    lend_reaper_open = false;
  }
}
