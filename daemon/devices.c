/*
 * devices.c — the daemon's devices and backend.  The memory pools are the
 * next layer of this project; until they exist the daemon serves the host
 * backend only, reports its one device with an empty pool, and refuses to
 * start when `backend: cuda` is asked for rather than pretend to serve it.
 */
#include "devices.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static enum config_backend devices_backend = CONFIG_BACKEND_HOST;

int devices_init(const struct config *cfg) {
  switch (cfg->backend) {
  case CONFIG_BACKEND_HOST:
    devices_backend = CONFIG_BACKEND_HOST;
    break;
  case CONFIG_BACKEND_AUTO:
    devices_backend = CONFIG_BACKEND_HOST;
    log_info("backend auto: this build has no CUDA memory pools yet; serving the host backend");
    break;
  case CONFIG_BACKEND_CUDA:
  default:
    log_errx("backend cuda: this build has no CUDA memory pools yet; set backend: host (or "
             "auto) in the configuration, or pass --backend host");
    return -1;
  }
  log_info("backend: %s", devices_backend_name());
  return 0;
}

void devices_fini(void) {}

const char *devices_backend_name(void) { return config_backend_name(devices_backend); }

int devices_fill_status(struct dep_status *st) {
  st->devices = calloc(1, sizeof *st->devices);
  if (st->devices == NULL)
    return DEP_ERR_NO_MEMORY;
  struct dep_status_device *d = &st->devices[0];
  snprintf(d->uuid, sizeof d->uuid, "00000000-0000-0000-0000-000000000000");
  snprintf(d->name, sizeof d->name, "host");
  snprintf(d->backend, sizeof d->backend, "%s", devices_backend_name());
  d->pool_total_bytes = 0;
  d->pool_used_bytes = 0;
  d->pool_cached_bytes = 0;
  st->num_devices = 1;
  return 0;
}
