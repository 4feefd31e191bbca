/*
 * pages.h — mapping a shared region's pages in ahead of use, for the
 * library's warm-up (client/warm.c) and the daemon's routes between
 * nodes (daemon/xfer.c): a first touch of each page otherwise costs a
 * fault on the first operation that reaches it, which later calls do not
 * pay.
 */
#ifndef DEP_PAGES_H
#define DEP_PAGES_H

#include <stdint.h>

/*
 * Map in the pages of [p, p + len), a shared mapping of a memfd (shmem),
 * changing no byte (a peer may be writing there already):
 * MADV_POPULATE_READ, or where the kernel has none (before 5.14) a read of
 * each page.  A read is enough for a later write too: a shared mapping of
 * shmem keeps no dirty accounting, so the kernel maps a page read in
 * writable, and a write to it takes no fault.  A read also costs less than
 * MADV_POPULATE_WRITE: a read fault maps the pages around it that the file
 * holds already (fault-around), where a write fault maps one.
 */
void dep__pages_populate(void *p, uint64_t len);

#endif /* DEP_PAGES_H */
