/*
 * uuid.h — a GPU's UUID: the 16 bytes the CUDA driver names a device by
 * (cuDeviceGetUuid), which the wire carries (proto.h's device_uuid fields),
 * the held file records and the daemon's configuration names, and its text
 * form, DEP_UUID_STR_LEN bytes (deepep.h: dep_status_device.uuid).  Every
 * part formats and reads UUIDs here, so that none reaches into the CUDA
 * seam (cudadrv.h) for text, and the host backend, which has no driver,
 * writes the same form.
 */
#ifndef DEP_UUID_H
#define DEP_UUID_H

#include <stdint.h>

#include "deepep.h"

/* uuid as "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower-case hex, NUL-terminated. */
void dep__uuid_str(const uint8_t uuid[16], char out[DEP_UUID_STR_LEN]);
/* Read "GPU-xxxxxxxx-..." (as nvidia-smi -L writes it) or "xxxxxxxx-..."
 * into out: 32 hex digits, dashes optional.  0, or -1 when s is not one. */
int dep__uuid_parse(const char *s, uint8_t out[16]);

#endif /* DEP_UUID_H */
