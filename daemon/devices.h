/*
 * devices.h — which memory backend the daemon serves and the devices it
 * reports.  This is the seam where the memory pools (the next layer) plug
 * in: today the host backend has one device, "host", with no pool yet.
 */
#ifndef DEP_DAEMON_DEVICES_H
#define DEP_DAEMON_DEVICES_H

#include "config.h"
#include "deepep.h"

/* Choose the backend from the configuration.  Returns 0 or -1 (logged). */
int devices_init(const struct config *cfg);
void devices_fini(void);
/* "host" or "cuda". */
const char *devices_backend_name(void);
/* Fill st->devices / st->num_devices (free st->devices with free()). */
int devices_fill_status(struct dep_status *st);

#endif /* DEP_DAEMON_DEVICES_H */
