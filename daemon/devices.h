/*
 * devices.h — the devices this daemon lends memory from, one pool each.
 * Chosen at start from the config's backend (auto picks cuda where a GPU is
 * present) and device list; addressed by UUID, never by ordinal, because
 * CUDA_VISIBLE_DEVICES renumbers GPUs differently in every process.
 */
#ifndef DEP_DEVICES_H
#define DEP_DEVICES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "deepep.h"
#include "pool.h"

/* What devices_init reports on the loop thread: 0, or DEP_ERR_* and why. */
typedef void devices_done_fn(int rc, const char *why);

/*
 * Choose the backend now (HELLO names it from the start), then probe the
 * devices and make their pools (logged) on libuv's thread pool, from a copy
 * of c; `done` runs on the loop thread when that is over, with every pool
 * in service (rc 0) or none.  Until then the daemon serves no device:
 * devices_count() is 0 and STATUS lists none.  0, or DEP_ERR_* (logged)
 * when the work cannot start.
 */
int devices_init(uv_loop_t *loop, const struct config *c, devices_done_fn *done);
/* Whether the pools are still being made (devices_fini must wait for them). */
bool devices_pending(void);
void devices_fini(void);

/*
 * The file descriptors the pools hold (one per piece of every made block);
 * while they are being made, what the preallocation will hold.
 */
size_t devices_fd_count(const struct config *c);

/* "cuda" or "host". */
const char *devices_backend_name(void);
size_t devices_count(void);
/* The GPUs this daemon serves: devices_count() on cuda, 0 on the host backend (whose one
 * device is the host, and whose ranks do their work on the CPUs). */
size_t devices_gpus(void);
struct pool *devices_at(size_t i);

/*
 * The pool for a device UUID (all zero selects the host device on the host
 * backend).  NULL with `why` listing the devices this daemon serves.
 */
struct pool *devices_find(const uint8_t uuid[16], char *why, size_t whylen);

/* Fill st->devices / st->num_devices (free st->devices with free()). */
int devices_fill_status(struct dep_status *st);

#endif /* DEP_DEVICES_H */
