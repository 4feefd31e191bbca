/*
 * pages.c — mapping a shared region's pages in ahead of use (pages.h).
 */
#include "pages.h"

#include <sys/mman.h>
#include <unistd.h>

void dep__pages_populate(void *p, uint64_t len) {
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t a = (uintptr_t)p & ~(page - 1);
  const uintptr_t b = ((uintptr_t)p + len + page - 1) & ~(page - 1);
#ifdef MADV_POPULATE_READ
  if (madvise((void *)a, b - a, MADV_POPULATE_READ) == 0)
    return;
#endif
  for (uintptr_t q = a; q < b; q += page)
    (void)*(volatile const uint8_t *)q;
}
