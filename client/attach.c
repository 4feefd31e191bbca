/*
 * attach.c — dep_attach / dep_detach: join a job through the daemon's
 * node-local rendezvous, then map every local rank's slab (DESIGN §5).
 *
 * The ATTACH reply is a stream: one SLAB frame per local rank, its chunk
 * fds riding on it, then ATTACH_OK.  Each slab is mapped as it arrives and
 * checked against the layout this library computes itself from the shape,
 * so a daemon of another layout cannot hand over a slab too small.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "client_internal.h"

/* The client-side bound on the ATTACH wait: $DEEPEPD_ATTACH_TIMEOUT_MS + margin. */
static int attach_timeout(dep_client_t *c, int *timeout_ms) {
  const char *e = getenv(CLIENT_ATTACH_TIMEOUT_ENV);
  unsigned long long v = CLIENT_ATTACH_TIMEOUT_DEFAULT_MS;
  if (e != NULL && e[0] != '\0') {
    char *end = NULL;
    errno = 0;
    v = strtoull(e, &end, 10);
    if (e[0] < '0' || e[0] > '9' || errno != 0 || *end != '\0' || v == 0 || v > 86400000ull)
      return client_seterr(c, DEP_ERR_INVALID,
                           "$" CLIENT_ATTACH_TIMEOUT_ENV "=\"%s\" is not a number of "
                           "milliseconds from 1 to 86400000; fix or unset it",
                           e);
  }
  *timeout_ms = (int)v + CLIENT_ATTACH_MARGIN_MS;
  return 0;
}

double client_clock_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/*
 * Before a rank of a job that spans nodes lets go: wait, bounded by the op
 * timeout, until the daemon's proxy has taken every descriptor it pushed.
 * Its last call's blocks for other nodes are then on their way, and the
 * daemon may end the job here (and let go of the exchange region) as soon
 * as it hears.  A proxy that stopped serving the ring (failed: the job
 * failed, or the watcher found the daemon gone) or a daemon whose
 * connection closed since the watcher stopped takes nothing more: no wait.
 */
static void xring_drain(dep_client_t *c) {
  struct dep_xring *r = c->xring;
  const uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
  const double t0 = client_clock_ms(), limit = c->attach_ok.op_timeout_ms;
  while (atomic_load_explicit(&r->tail, memory_order_acquire) != head &&
         atomic_load_explicit(&r->failed, memory_order_acquire) == 0 &&
         client_clock_ms() - t0 < limit && !watch_hung_up(c->fd)) {
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

void client_unmap(dep_client_t *c) {
  warm_stop(c); /* it maps the slabs' pages in: joined before they go */
  watch_stop(c); /* it writes to the slab and the ring: joined before they go */
  cuda_ops_detach(c); /* the kernels and their memory go before the slabs they address */
  statrec_unmap(c);
  host_ops_fini(&c->ops);
  if (c->xring != NULL) {
    xring_drain(c);
    munmap(c->xring, DEP_XRING_BYTES + c->layout.xchg_bytes);
  }
  c->xring = NULL;
  for (uint32_t i = 0; i < c->n_arenas; i++)
    mem_unmap_slab(&c->arenas[i]);
  c->n_arenas = 0;
  c->ranks_on_dev = 0;
  memset(c->slabs, 0, sizeof c->slabs);
  memset(c->ranks, 0, sizeof c->ranks);
}

/*
 * Check an arena's slab list before mapping it: each slab inside the arena,
 * none overlapping another, each local rank named once in the whole reply.
 * The layout's size depends on the job's streaming chunk, which ATTACH_OK
 * (after the arenas) says; until then each slab must hold the smallest
 * layout the shape has (c->layout, laid out for one-row chunks), and
 * attach_check_slabs holds them to the job's own once it is known.
 */
static int attach_check_arena(dep_client_t *c, const struct dep_msg_slab *m, const bool *seen) {
  if (m->chunk_bytes > UINT64_MAX / m->n_chunks)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent an arena of impossible size");
  uint64_t bytes = m->chunk_bytes * m->n_chunks, need = c->layout.total_bytes;
  for (uint32_t i = 0; i < m->n_ranks; i++) {
    const struct dep_msg_slab_rank *r = &m->ranks[i];
    if (r->local_rank >= c->args.local_world_size || seen[r->local_rank])
      return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent local rank %u's slab twice or out "
                         "of range (local world size %u)", r->local_rank,
                         c->args.local_world_size);
    if (r->offset % 64 != 0 || r->offset > bytes || bytes - r->offset < need)
      return client_fail(c, DEP_ERR_PROTOCOL,
                         "deepepd placed local rank %u's slab at offset %llu of an arena of %llu "
                         "bytes; this library's layout needs %llu bytes there (daemon and "
                         "library of different versions?)", r->local_rank,
                         (unsigned long long)r->offset, (unsigned long long)bytes,
                         (unsigned long long)need);
    for (uint32_t k = 0; k < i; k++) {
      uint64_t o = m->ranks[k].offset;
      if (m->ranks[k].local_rank == r->local_rank || (o < r->offset + need && r->offset < o + need))
        return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's arena holds overlapping slabs for "
                           "local ranks %u and %u", m->ranks[k].local_rank, r->local_rank);
    }
  }
  return 0;
}

/* Map one SLAB frame's arena; the frame's fds are taken (and closed). */
static int attach_slab(dep_client_t *c, struct client_frame *f, bool *seen) {
  struct dep_msg_slab m;
  if (proto_decode_slab(f->body, f->hdr.body_len, &m) != 0)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed SLAB frame");
  if (m.n_chunks != (uint32_t)f->nfds)
    return client_fail(c, DEP_ERR_PROTOCOL,
                       "deepepd's SLAB frame announces %u chunks but %d descriptors arrived",
                       m.n_chunks, f->nfds);
  if (c->n_arenas >= c->args.local_world_size)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent more arenas than local ranks");
  int rc = attach_check_arena(c, &m, seen);
  if (rc != 0)
    return rc;
  char why[256] = "";
  struct mem_map *arena = &c->arenas[c->n_arenas];
  double t0 = client_clock_ms();
  rc = mem_map_slab(arena, c->cuda, f->fds, m.n_chunks, m.chunk_bytes, c->cuda_dev, why,
                    sizeof why);
  c->times.map_ms += client_clock_ms() - t0;
  f->nfds = 0; /* mem_map_slab closed them */
  if (rc != 0)
    return client_seterr(c, rc, "mapping the slabs of local rank %u: %s", m.ranks[0].local_rank,
                         why);
  c->n_arenas++;
  if (memcmp(m.device_uuid, c->args.device_uuid, sizeof m.device_uuid) == 0)
    c->ranks_on_dev = m.n_ranks; /* the ranks sharing this rank's GPU: its SM budget */
  for (uint32_t i = 0; i < m.n_ranks; i++) {
    seen[m.ranks[i].local_rank] = true;
    c->slabs[m.ranks[i].local_rank] = (uint8_t *)arena->base + m.ranks[i].offset;
    c->ranks[m.ranks[i].local_rank] = m.ranks[i].rank;
  }
  return 0;
}

/* Every local rank's slab holds the job's layout inside its arena, apart from every other's. */
static int attach_check_slabs(dep_client_t *c) {
  const uint64_t need = c->layout.total_bytes;
  for (uint32_t i = 0; i < c->args.local_world_size; i++) {
    const uint8_t *s = c->slabs[i];
    const struct mem_map *in = NULL;
    for (uint32_t a = 0; a < c->n_arenas && in == NULL; a++) {
      const uint8_t *base = c->arenas[a].base;
      if (s >= base && (uint64_t)(s - base) < c->arenas[a].bytes)
        in = &c->arenas[a];
    }
    if (in == NULL || c->arenas[0].base == NULL ||
        in->bytes - (uint64_t)(s - (const uint8_t *)in->base) < need)
      return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's arena does not hold local rank %u's slab "
                         "of %llu bytes, which the job's layout (chunk_rows %u) needs (daemon and "
                         "library of different versions?)", i, (unsigned long long)need,
                         c->attach_ok.chunk_rows);
    for (uint32_t k = 0; k < i; k++) {
      const uint8_t *o = c->slabs[k];
      if (o < s + need && s < o + need)
        return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's arena holds overlapping slabs for "
                           "local ranks %u and %u", k, i);
    }
  }
  return 0;
}

static int attach_ok(dep_client_t *c, struct client_frame *f, const bool *seen) {
  struct dep_msg_attach_ok ok;
  if (proto_decode_attach_ok(f->body, f->hdr.body_len, &ok) != 0)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd sent a malformed ATTACH_OK");
  if (ok.num_fds != (uint32_t)f->nfds)
    return client_fail(c, DEP_ERR_PROTOCOL,
                       "deepepd's ATTACH_OK announces %u file descriptors but %d arrived",
                       ok.num_fds, f->nfds);
  if (ok.local_world_size != c->args.local_world_size)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's ATTACH_OK names local world size %u, "
                       "not %u", ok.local_world_size, c->args.local_world_size);
  char why[256] = "";
  const struct dep_attach_args *a = &c->args;
  if (dep__slab_layout_nodes(&a->shape, a->world_size, a->local_world_size, ok.chunk_rows,
                             &c->layout, why, sizeof why) != 0)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's ATTACH_OK: %s", why);
  if (ok.slab_bytes < c->layout.total_bytes)
    return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's slabs are %llu bytes apart; this "
                       "library's layout needs %llu", (unsigned long long)ok.slab_bytes,
                       (unsigned long long)c->layout.total_bytes);
  for (uint32_t i = 0; i < ok.local_world_size; i++)
    if (!seen[i])
      return client_fail(c, DEP_ERR_PROTOCOL, "deepepd's ATTACH reply lacks local rank %u's slab",
                         i);
  c->attach_ok = ok;
  return attach_check_slabs(c);
}

/* Read the SLAB frames and the ATTACH_OK that ends the reply. */
static int attach_reply(dep_client_t *c, uint32_t id, int timeout_ms) {
  bool seen[DEP_MAX_LOCAL_RANKS] = {false};
  int64_t deadline = client_deadline(timeout_ms);
  for (;;) {
    struct client_frame f;
    int rc = client_read_reply(c, id, "ATTACH", DEP_MSG_ATTACH_OK, DEP_MSG_SLAB, timeout_ms,
                               deadline, &f);
    if (rc != 0)
      return rc;
    bool done = f.hdr.type == DEP_MSG_ATTACH_OK;
    rc = done ? attach_ok(c, &f, seen) : attach_slab(c, &f, seen);
    client_frame_release(&f);
    if (rc != 0 || done)
      return rc;
  }
}

/*
 * A job that spans nodes: ask the daemon for this rank's ring to its proxy
 * and the exchange region after it (xring.h, slab.h), filled and read by
 * the C operations (host) or the kernels (cuda, which register it for the
 * device: cuda_ops_attach).  Without one (a daemon with no peers) the rank
 * is attached but its operations refuse, saying why (xring_why).
 */
static void attach_ring(dep_client_t *c) {
  c->xring = NULL;
  void *p = NULL;
  char why[220];
  if (client_lend_map(c, DEP_MSG_XRING_LEND, DEP_MSG_XRING_LEND_OK, DEP_XRING_VERSION,
                      (uint32_t)DEP_XRING_BYTES, DEP_XRING_BYTES + c->layout.xchg_bytes, &p, why,
                      sizeof why) != 0) {
    snprintf(c->xring_why, sizeof c->xring_why, "deepepd lends no ring to its proxy: %s", why);
    return;
  }
  c->xring = p;
}

/*
 * The operations' context over every slab mapped here, by global rank (a
 * table of the job's world, NULL for a rank on another node).  0, or the
 * host operations' refusal (host_ops.h) with why.
 */
static int attach_ops(dep_client_t *c, char *why, size_t whylen) {
  const struct dep_attach_args *a = &c->args;
  uint8_t **slabs = calloc(a->world_size, sizeof *slabs);
  if (slabs == NULL) {
    snprintf(why, whylen, "out of memory for the slab table of a world of %u ranks",
             a->world_size);
    return DEP_ERR_NO_MEMORY;
  }
  for (uint32_t i = 0; i < a->local_world_size; i++)
    slabs[c->ranks[i]] = c->slabs[i];
  int rc = host_ops_init_nodes(&c->ops, &a->shape, a->world_size, a->rank, slabs, c->xring,
                               c->attach_ok.chunk_rows, c->attach_ok.op_timeout_ms, why, whylen);
  free(slabs);
  return rc;
}

/* Where the slabs will live: on cuda, a context on this rank's GPU. */
static int attach_bind_device(dep_client_t *c, const struct dep_attach_args *a) {
  c->cuda = strcmp(c->hello.backend, "cuda") == 0;
  c->cuda_dev = -1;
  if (!c->cuda)
    return 0;
  int rc = cuda_ops_world_check(c, a);
  if (rc != 0)
    return rc;
  char why[256] = "";
  rc = mem_cuda_bind(a->device_uuid, &c->cuda_dev, &c->primary, why, sizeof why);
  if (rc != 0)
    return client_seterr(c, rc, "dep_attach: %s", why);
  return 0;
}

/* dep_attach's checks of its arguments and of the handle, before anything goes on the
 * wire; c->layout is left the smallest layout of the job (attach_check_arena). */
static int attach_check(dep_client_t *c, const struct dep_attach_args *args) {
  char why[256] = "";
  int rc = proto_check_attach(args, why, sizeof why);
  if (rc == 0)
    rc = dep__slab_layout_nodes(&args->shape, args->world_size, args->local_world_size, 1,
                               &c->layout, why, sizeof why); /* the smallest: attach_check_arena */
  if (rc != 0)
    return client_seterr(c, DEP_ERR_INVALID, "dep_attach: %s", why);
  if (c->fd < 0)
    return client_seterr(c, DEP_ERR_STATE, "not connected to deepepd; call dep_connect first");
  if (c->attached)
    return client_seterr(c, DEP_ERR_STATE,
                         "this handle is already attached to job \"%s\"; dep_detach first",
                         c->job_id);
  return 0;
}

/* The ATTACH request and its reply (the memory mapped), with the kernels loaded while
 * the daemon waits for the other local ranks; on failure the mappings are undone. */
static int attach_exchange(dep_client_t *c, const struct dep_attach_args *args,
                           int timeout_ms) {
  uint32_t id = 0;
  int rc = client_send_request(c, DEP_MSG_ATTACH, args, &id);
  /* While the daemon waits for the other local ranks and lends the memory,
   * load the kernels.  A failure here is reported once the reply is read
   * (the daemon's answer must be taken off the socket either way). */
  int prep_rc = 0;
  char prep_msg[CLIENT_ERRMSG_MAX] = "";
  double t_sent = client_clock_ms();
  if (rc == 0 && c->cuda && (prep_rc = cuda_ops_prepare(c)) != 0)
    snprintf(prep_msg, sizeof prep_msg, "%s", c->errmsg);
  if (rc == 0)
    rc = attach_reply(c, id, timeout_ms);
  c->times.wait_ms = client_clock_ms() - t_sent - c->times.map_ms - c->times.setup_ms;
  c->times.wait_ms = c->times.wait_ms > 0 ? c->times.wait_ms : 0;
  if (rc == 0 && prep_rc != 0)
    rc = client_seterr(c, prep_rc, "%s", prep_msg);
  if (rc == DEP_ERR_TIMEOUT && c->fd < 0)
    client_seterr(c, rc,
                  "deepepd did not answer ATTACH of job \"%s\" within %d ms "
                  "($" CLIENT_ATTACH_TIMEOUT_ENV " + %d ms); the connection was closed, "
                  "reconnect with dep_connect",
                  args->job_id, timeout_ms, CLIENT_ATTACH_MARGIN_MS);
  if (rc != 0)
    client_unmap(c);
  return rc;
}

bool client_ops_here(const dep_client_t *c) {
  return c->args.world_size == c->args.local_world_size || c->xring != NULL;
}

/* A failure (rc, the handle's message set) after the attachment was made:
 * detach, keeping the message. */
static int attach_undo(dep_client_t *c, int rc) {
  char msg[CLIENT_ERRMSG_MAX];
  snprintf(msg, sizeof msg, "%s", c->errmsg);
  dep_detach(c);
  return client_seterr(c, rc, "%s", msg);
}

/* What an attached handle needs before its operations can run: the ring between nodes,
 * the operations' context, the warm-up, and on cuda the launcher's state; on failure
 * the handle has been detached. */
static int attach_ops_ready(dep_client_t *c, const struct dep_attach_args *args) {
  char why[256] = "";
  int rc;
  /* The operations run among the ranks of one node; a job spanning nodes
   * attaches (its memory is lent) but its operations need the proxy.  On
   * cuda the context holds device pointers, for the checks and addressing;
   * the kernels are loaded (and warmed up) before dep_attach returns. */
  c->xring_why[0] = '\0';
  if (args->world_size != args->local_world_size)
    attach_ring(c);
  const bool ops_here = client_ops_here(c);
  if (ops_here && (rc = attach_ops(c, why, sizeof why)) != 0) {
    dep_detach(c);
    return client_seterr(c, rc, "dep_attach: %s", why);
  }
  /* A rank that came back to an elastic job starts at its join call
   * (cuda: cuda_ops_attach, from the device's copy of the word). */
  if (!c->cuda && ops_here)
    host_ops_join_at(&c->ops, host_ops_join_word(&c->ops));
  /* A job across nodes: its waits fail at once when this node's daemon goes
   * (watch.h), once everything the watcher writes to is in place. */
  if ((c->cuda && (rc = cuda_ops_attach(c)) != 0) ||
      (c->xring != NULL && (rc = watch_start(c)) != 0))
    return attach_undo(c, rc);
  return 0;
}

DEP_EXPORT int dep_attach(dep_client_t *c, const struct dep_attach_args *args_in) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  double t0 = client_clock_ms();
  /* The caller's struct as this library knows it (deepep.h: structs grow). */
  struct dep_attach_args args_[1];
  int rc = CLIENT_TAKE(c, "dep_attach", dep_attach_args, shape, args_in, args_);
  if (rc != 0)
    return rc;
  const struct dep_attach_args *const args = args_;
  if ((rc = attach_check(c, args)) != 0)
    return rc;
  int timeout_ms = 0;
  if ((rc = attach_timeout(c, &timeout_ms)) != 0 || (rc = warm_hold(c)) != 0 ||
      (rc = attach_bind_device(c, args)) != 0)
    return rc;
  c->args = *args;
  memset(&c->times, 0, sizeof c->times);
  /* A compile of the kernels from the daemon where the fatbin has no SASS
   * for this GPU: asked before ATTACH, whose reply may come at once. */
  if (c->cuda && (rc = cuda_ops_fetch_kernels(c)) != 0)
    return rc;
  if ((rc = attach_exchange(c, args, timeout_ms)) != 0)
    return rc;
  static _Atomic uint64_t attachments;
  c->attached = true;
  c->attach_id = atomic_fetch_add(&attachments, 1) + 1;
  snprintf(c->job_id, sizeof c->job_id, "%.*s", (int)sizeof c->job_id - 1, args->job_id);
  if ((rc = attach_ops_ready(c, args)) != 0)
    return rc;
  /* The stats page comes last, so that the warm-up's calls are not counted. */
  statrec_lend(c);
  if (c->cuda)
    cuda_ops_stats_bind(c);
  c->times.total_ms = client_clock_ms() - t0;
  statrec_attached(c);
  /* The host warm-up runs on after dep_attach returns (warm.h), started last so
   * that none of the attach's own work waits behind it. */
  if (!c->cuda && c->attach_ok.kernel_warmup && client_ops_here(c) && (rc = warm_start(c)) != 0)
    return attach_undo(c, rc);
  return DEP_OK;
}

DEP_EXPORT int dep_attach_times(dep_client_t *c, struct dep_attach_times *out) {
  if (c == NULL || out == NULL)
    return DEP_ERR_INVALID;
  struct dep_attach_times z;
  int rc = CLIENT_TAKE(c, "dep_attach_times", dep_attach_times, warmup_ms, out, &z);
  if (rc != 0)
    return rc;
  if (!c->attached)
    return DEP_ERR_STATE;
  warm_wait(c); /* the host warm-up runs on after dep_attach: its time once it is done */
  const uint32_t size = z.size;
  z = c->times;
  z.size = size;
  client_args_give(out, &z, sizeof z);
  return 0;
}

DEP_EXPORT int dep_detach(dep_client_t *c) {
  if (c == NULL)
    return DEP_ERR_INVALID;
  if (c->fd < 0)
    return client_seterr(c, DEP_ERR_STATE, "not connected to deepepd; call dep_connect first");
  if (!c->attached)
    return client_seterr(c, DEP_ERR_STATE, "not attached to a job; nothing to detach");
  /* Unmap before telling the daemon: once it hears DETACH it may scrub and
   * lend the memory to another job. */
  client_unmap(c);
  struct client_frame f;
  int rc = client_request(c, DEP_MSG_DETACH, NULL, DEP_MSG_DETACH_OK, CLIENT_REQUEST_TIMEOUT_MS, &f);
  if (rc == 0)
    client_frame_release(&f);
  /* The daemon answering "not attached" means it already let go. */
  if (rc == 0 || rc == DEP_ERR_STATE || rc == DEP_ERR_NOT_FOUND) {
    c->attached = false;
    c->job_id[0] = '\0';
    memset(&c->attach_ok, 0, sizeof c->attach_ok);
  }
  return rc;
}

DEP_EXPORT int dep_attach_info(dep_client_t *c, struct dep_attach_info *out) {
  if (c == NULL || out == NULL)
    return DEP_ERR_INVALID;
  struct dep_attach_info z;
  int rc = CLIENT_TAKE(c, "dep_attach_info", dep_attach_info, attach_ms, out, &z);
  if (rc != 0)
    return rc;
  if (!c->attached)
    return DEP_ERR_STATE;
  snprintf(z.backend, sizeof z.backend, "%s", c->attach_ok.backend);
  z.slab_bytes = c->attach_ok.slab_bytes;
  z.local_rank = c->args.local_rank;
  z.local_world_size = c->args.local_world_size;
  for (uint32_t i = 0; i < c->args.local_world_size; i++) {
    z.slabs[i] = c->slabs[i];
    z.ranks[i] = c->ranks[i];
  }
  z.attach_ms = c->times.total_ms;
  client_args_give(out, &z, sizeof z);
  return 0;
}
