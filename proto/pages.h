/*
 * pages.h — mapping a shared region's pages in ahead of use, for the
 * library's warm-up (client/attach.c) and the daemon's routes between
 * nodes (daemon/xfer.c): a first touch of each page otherwise costs a
 * fault on the first operation that reaches it, which later calls do not
 * pay.
 */
#ifndef DEP_PAGES_H
#define DEP_PAGES_H

#include <stdint.h>

/* Map in, writable, the pages of [p, p + len): MADV_POPULATE_WRITE, which
 * changes no byte (a peer may be writing there already), or where the
 * kernel has none (before 5.14) a read of each page, which maps a shared
 * memfd's page writable as well. */
void dep__pages_populate(void *p, uint64_t len);

#endif /* DEP_PAGES_H */
