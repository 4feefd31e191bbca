/*
 * kcheck.h — the daemon's kernel check at start (DESIGN §6, §10): for every
 * GPU it serves on the cuda backend, whether the library's fatbin (the very
 * object this daemon links: Makefile, kimage.h) has SASS for the GPU's
 * architecture; where it has only PTX, a cubin from the kernel cache
 * (kcache.h), compiled here once with the driver's JIT linker where none is
 * cached, and lent to each client that asks at attach (KERNELS, proto.h).
 * READY=1 waits for it; a GPU whose kernels cannot be had fails the start.
 */
#ifndef DEP_KCHECK_H
#define DEP_KCHECK_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "pool.h"
#include "proto.h"

/*
 * Check the n pools' GPUs (cuda backend; on host nothing to check).  Runs on
 * the devices' worker thread, after the pools are made; the loop reads its
 * results only after that work is done.  0, or DEP_ERR_* with why saying
 * what to do (the start fails).
 */
int kcheck_run(const struct config *c, struct pool *pools, size_t n, char *why, size_t whylen);

/*
 * What the daemon lends for the GPU `uuid`: 0 with *m filled and *fd the
 * cubin's memfd (the daemon's own: conn_send duplicates it), or
 * DEP_ERR_NOT_FOUND with why (the GPU has SASS, is not served, or the
 * daemon has no kernels).
 */
int kcheck_lend(const uint8_t uuid[16], struct dep_msg_kernels_ok *m, int *fd, char *why,
                size_t whylen);

/* Close the cubins' memfds. */
void kcheck_fini(void);

#endif /* DEP_KCHECK_H */
