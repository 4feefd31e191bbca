/*
 * devices.c — backend choice, device discovery and one pool per device.
 * The pools are made on libuv's thread pool (a 4 GiB host pool takes
 * seconds), so the daemon answers STATUS meanwhile; the loop sees them only
 * once they are all made.
 */
#include "devices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kcheck.h"
#include "log.h"
#include "proto.h"
#include "uuid.h"

static uint64_t uv_hrtime_ms(void) { return uv_hrtime() / 1000000u; }

#define DEVICES_MAX 64

/*
 * `ops` is set on the loop thread before the work starts and never changes
 * after; `pools` and `made` belong to the work until it ends; `n` is what
 * the loop may use, set on the loop thread when the work is done.
 */
static struct {
  const struct backend_ops *ops;
  size_t n;
  size_t made;
  struct pool pools[DEVICES_MAX];
} devs;

/* The work that makes the pools, and what it reports back to the loop. */
static struct {
  uv_work_t req;
  struct config cfg;   /* its own copy: a reload may change the loop's meanwhile */
  devices_done_fn *done;
  int rc;
  char why[DEP_MSG_TEXT_MAX];
  bool pending;
} devs_work;

static bool listed(const struct config *c, const struct backend_dev *d) {
  if (c->n_devices == 0)
    return true;
  for (size_t i = 0; i < c->n_devices; i++) {
    uint8_t u[16];
    if (dep__uuid_parse(c->devices[i], u) == 0 && memcmp(u, d->uuid, 16) == 0)
      return true;
  }
  return false;
}

static const struct backend_ops *choose_backend(const struct config *c) {
  char why[256] = "";
  switch (c->backend) {
  case CONFIG_BACKEND_HOST:
    log_info("backend: host (configured)");
    return &backend_host_ops;
  case CONFIG_BACKEND_CUDA:
    log_info("backend: cuda (configured)");
    return &backend_cuda_ops;
  case CONFIG_BACKEND_AUTO:
  default:
    if (backend_cuda_available(why, sizeof why)) {
      log_info("backend: cuda (auto: a CUDA GPU is present)");
      return &backend_cuda_ops;
    }
    log_info("backend: host (auto: %s)", why);
    return &backend_host_ops;
  }
}

/* Probe the devices and make their pools; runs on a thread-pool thread. */
static int devices_make(const struct config *c, char *why, size_t whylen) {
  struct backend_dev found[DEVICES_MAX];
  int n = devs.ops->probe(found, DEVICES_MAX, why, whylen);
  if (n < 0)
    return n;
  bool host = devs.ops == &backend_host_ops;
  uint64_t total = host ? c->host_pool_size : c->pool_size_per_device;
  for (int i = 0; i < n; i++) {
    if (!host && !listed(c, &found[i])) {
      log_info("device %s (%s): not in devices:, skipped", found[i].uuid_str, found[i].name);
      devs.ops->release_dev(&found[i]);
      continue;
    }
    uint64_t t0 = uv_hrtime_ms();
    int rc = pool_init(&devs.pools[devs.made], devs.ops, &found[i], total, c->pool_chunk_size,
                       c->preallocation, why, whylen);
    if (rc != 0) {
      while (devs.made > 0)
        pool_fini(&devs.pools[--devs.made]);
      return rc;
    }
    if (c->preallocation)
      log_info("device %s (%s, %s): pool of %llu MiB, made now as %u blocks of %llu MiB; a job "
               "of another size replaces them with one block of its own",
               found[i].uuid_str, found[i].name, devs.ops->name, (unsigned long long)(total >> 20),
               devs.pools[devs.made].n_blocks, (unsigned long long)(c->pool_chunk_size >> 20));
    else
      log_info("device %s (%s, %s): pool of %llu MiB, made on demand: one block per job arena",
               found[i].uuid_str, found[i].name, devs.ops->name, (unsigned long long)(total >> 20));
    log_debug("device %s: pool made in %llu ms", found[i].uuid_str,
              (unsigned long long)(uv_hrtime_ms() - t0));
    devs.made++;
  }
  if (devs.made == 0) {
    snprintf(why, whylen, "no %s device to serve (%d found, none listed in devices:)",
             devs.ops->name, n);
    return DEP_ERR_CONFIG;
  }
  /* The kernels each GPU will run, SASS or a cached compile: before READY=1
   * (DESIGN §10), so that a GPU the library cannot run on fails the start. */
  int rc = host ? 0 : kcheck_run(c, devs.pools, devs.made, why, whylen);
  if (rc != 0) {
    kcheck_fini();
    while (devs.made > 0)
      pool_fini(&devs.pools[--devs.made]);
  }
  return rc;
}

static void devices_work(uv_work_t *req) {
  devs_work.rc = devices_make(&devs_work.cfg, devs_work.why, sizeof devs_work.why);
}

static void devices_work_done(uv_work_t *req, int status) {
  devs_work.pending = false;
  if (status != 0 && devs_work.rc == 0) { /* cancelled: never started */
    devs_work.rc = DEP_ERR_STATE;
    snprintf(devs_work.why, sizeof devs_work.why, "making the pools was cancelled");
  }
  if (devs_work.rc == 0)
    devs.n = devs.made;
  devs_work.done(devs_work.rc, devs_work.why);
}

int devices_init(uv_loop_t *loop, const struct config *c, devices_done_fn *done) {
  memset(&devs, 0, sizeof devs);
  devs.ops = choose_backend(c);
  devs_work.cfg = *c;
  devs_work.done = done;
  devs_work.rc = 0;
  devs_work.why[0] = '\0';
  int rc = uv_queue_work(loop, &devs_work.req, devices_work, devices_work_done);
  if (rc != 0) {
    log_errx("devices: cannot start making the pools: %s", uv_strerror(rc));
    return DEP_ERR_NO_MEMORY;
  }
  devs_work.pending = true;
  return 0;
}

bool devices_pending(void) { return devs_work.pending; }

size_t devices_fd_count(const struct config *c) {
  if (devs_work.pending) {
    /* Being made: what the preallocation will hold, per listed device (one if none is). */
    if (!c->preallocation || c->pool_chunk_size == 0)
      return 0;
    bool host = devs.ops == &backend_host_ops;
    uint64_t per = (host ? c->host_pool_size : c->pool_size_per_device) / c->pool_chunk_size;
    return (size_t)per * (host || c->n_devices == 0 ? 1 : c->n_devices);
  }
  size_t fds = 0;
  for (size_t i = 0; i < devs.n; i++)
    for (const struct pool_block *b = devs.pools[i].blocks; b != NULL; b = b->next)
      fds += b->n_pieces;
  return fds;
}

void devices_fini(void) {
  if (devs_work.pending) {
    log_warnx("devices: the pools are still being made; left to the exit");
    return;
  }
  kcheck_fini();
  for (size_t i = 0; i < devs.n; i++)
    pool_fini(&devs.pools[i]);
  devs.n = 0;
  devs.made = 0;
}

const char *devices_backend_name(void) { return devs.ops != NULL ? devs.ops->name : "none"; }
size_t devices_count(void) { return devs.n; }
size_t devices_gpus(void) { return strcmp(devices_backend_name(), "cuda") == 0 ? devs.n : 0; }
struct pool *devices_at(size_t i) { return i < devs.n ? &devs.pools[i] : NULL; }

struct pool *devices_find(const uint8_t uuid[16], char *why, size_t whylen) {
  for (size_t i = 0; i < devs.n; i++)
    if (memcmp(devs.pools[i].dev.uuid, uuid, 16) == 0)
      return &devs.pools[i];
  char want[DEP_UUID_STR_LEN];
  dep__uuid_str(uuid, want);
  size_t off = 0;
  int k = snprintf(why, whylen, "device %s is not served by this deepepd (%s backend; it serves",
                   want, devices_backend_name());
  for (size_t i = 0; k > 0 && (off += (size_t)k) < whylen && i < devs.n; i++)
    k = snprintf(why + off, whylen - off, " %s", devs.pools[i].dev.uuid_str);
  if (off < whylen)
    snprintf(why + off, whylen - off, "); pass the UUID of one of these");
  return NULL;
}

int devices_fill_status(struct dep_status *st) {
  st->num_devices = 0;
  st->devices = calloc(devs.n ? devs.n : 1, sizeof *st->devices);
  if (st->devices == NULL)
    return DEP_ERR_NO_MEMORY;
  for (size_t i = 0; i < devs.n; i++) {
    const struct pool *p = &devs.pools[i];
    struct dep_status_device *d = &st->devices[i];
    snprintf(d->uuid, sizeof d->uuid, "%s", p->dev.uuid_str);
    snprintf(d->name, sizeof d->name, "%s", p->dev.name);
    snprintf(d->backend, sizeof d->backend, "%s", devs.ops->name);
    d->pool_total_bytes = pool_total_bytes(p);
    d->pool_used_bytes = p->used_bytes;
    d->pool_cached_bytes = p->cached_bytes;
    d->pool_held_bytes = pool_held_bytes(p);
  }
  st->num_devices = (uint32_t)devs.n;
  return 0;
}
