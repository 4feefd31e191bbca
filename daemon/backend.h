/*
 * backend.h — where pool memory comes from (DESIGN §3).  A backend makes
 * allocations ("chunks") of any size that is a multiple of its device's
 * granularity, each exportable on its own as a file descriptor, and scrubs
 * them between jobs.  Two exist: `cuda` (VMM allocations on a GPU,
 * exported as POSIX fds) and `host` (memfd shared memory).
 */
#ifndef DEP_BACKEND_H
#define DEP_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "deepep.h"

/* One device a backend serves: a GPU, or the single "host" device. */
struct backend_dev {
  uint8_t uuid[16];
  char uuid_str[DEP_UUID_STR_LEN];
  char name[64];
  int ordinal;            /* CUDA device ordinal in the daemon; -1 for host */
  void *ctx;              /* CUcontext (primary context) for cuda */
  uint64_t granularity;   /* allocation sizes must be multiples of this */
  bool rdma_capable;      /* cuda: allocations are made GPUDirect-RDMA capable (the device
                             supports it with VMM), so a NIC may register them */
};

/* One chunk of memory as the backend made it. */
struct chunk_mem {
  int fd;                 /* exported handle: what a client imports */
  uint64_t bytes;
  void *host_ptr;         /* host: the daemon's own mapping (for scrubbing) */
  uint64_t dev_ptr;       /* cuda: the daemon's own mapping (for scrubbing) */
  uint64_t handle;        /* cuda: CUmemGenericAllocationHandle */
  /* host: the memfd's device and inode, by which /proc shows who still holds
   * it (proc.h); 0 where that cannot be seen (cuda: an import leaves no trace) */
  uint64_t file_dev, file_ino;
};

struct backend_ops {
  const char *name;       /* "cuda" or "host"; also the wire name */
  /* Where this backend cuts a job's arena into pieces (job.c): host, only
   * where pool.max_allocation is set (no driver is helped by pieces there,
   * and each costs every rank an fd and an mmap at attach; BENCHMARKS.md);
   * cuda, where a peer GPU maps the arena, at pool.max_allocation or 480 MiB. */
  bool cuts_only_when_set;
  /* Find the devices; fills at most max entries, returns how many or DEP_ERR_*. */
  int (*probe)(struct backend_dev *devs, int max, char *why, size_t whylen);
  int (*chunk_create)(struct backend_dev *d, uint64_t bytes, struct chunk_mem *out,
                      char *why, size_t whylen);
  void (*chunk_destroy)(struct backend_dev *d, struct chunk_mem *m);
  /* Zero the chunk so no byte of one job reaches the next. */
  int (*chunk_scrub)(struct backend_dev *d, struct chunk_mem *m, char *why, size_t whylen);
  /* Write len bytes at off of the chunk, visible to every process that maps
   * it once this returns, in the order of successive calls (the abort words:
   * slab.h).  0 or DEP_ERR_* with why. */
  int (*chunk_write)(struct backend_dev *d, struct chunk_mem *m, uint64_t off, const void *src,
                     size_t len, char *why, size_t whylen);
  /* Read len bytes at off of the chunk as the processes that map it last
   * wrote them (an elastic job's call counters: job_elastic.c).  0 or
   * DEP_ERR_* with why. */
  int (*chunk_read)(struct backend_dev *d, struct chunk_mem *m, uint64_t off, void *dst,
                    size_t len, char *why, size_t whylen);
  void (*release_dev)(struct backend_dev *d);
};

extern const struct backend_ops backend_host_ops;
extern const struct backend_ops backend_cuda_ops;

/* Whether a CUDA device is usable here (for backend: auto); why says why not. */
bool backend_cuda_available(char *why, size_t whylen);

#endif /* DEP_BACKEND_H */
