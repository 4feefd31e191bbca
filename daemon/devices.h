/*
 * devices.h — the devices this daemon lends memory from, one pool each.
 * Chosen at start from the config's backend (auto picks cuda where a GPU is
 * present) and device list; addressed by UUID, never by ordinal, because
 * CUDA_VISIBLE_DEVICES renumbers GPUs differently in every process.
 */
#ifndef DEP_DEVICES_H
#define DEP_DEVICES_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "deepep.h"
#include "pool.h"

/* Choose the backend, probe the devices and make their pools (logged).  0 or DEP_ERR_*. */
int devices_init(const struct config *c, char *why, size_t whylen);
void devices_fini(void);

/* "cuda" or "host". */
const char *devices_backend_name(void);
size_t devices_count(void);
struct pool *devices_at(size_t i);

/*
 * The pool for a device UUID (all zero selects the host device on the host
 * backend).  NULL with `why` listing the devices this daemon serves.
 */
struct pool *devices_find(const uint8_t uuid[16], char *why, size_t whylen);

/* Fill st->devices / st->num_devices (free st->devices with free()). */
int devices_fill_status(struct dep_status *st);

#endif /* DEP_DEVICES_H */
