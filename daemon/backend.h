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
  void *stage;            /* cuda: chunk_batch's stream and pinned staging buffer */
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

/* One copy of a batch (chunk_batch): len bytes at off of chunk m, from buf or, read, into it. */
struct chunk_io {
  struct chunk_mem *m;
  uint64_t off;
  void *buf;              /* a write's bytes (NULL: zeros), or where a read's go */
  size_t len;
  bool read;
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
  /*
   * A batch of copies between the daemon and chunks of this device, done in
   * list order: a write puts io[i].buf's len bytes (zeros where buf is
   * NULL) at off of io[i].m, visible to every process that maps it once
   * this returns, and in the order of the list to a reader that polls them
   * (the mask words before the epoch: slab.h); a read puts the len bytes at
   * off into buf, as the processes that map the chunk last wrote them (an
   * elastic job's call counters: job_elastic.c), after every write listed
   * before it has landed.  The bytes copied through buf (not zeros) total
   * at most batch_bytes; the pool cuts a larger batch into pieces.  0, or
   * DEP_ERR_* with why when a copy could not be made: the batch failed
   * (copies before it may have landed).  cuda waits for the GPU once a
   * batch, not once a copy: the daemon's context is outside MPS, so a wait
   * may last a time slice of the ranks' kernels.
   */
  int (*chunk_batch)(struct backend_dev *d, const struct chunk_io *io, size_t n, char *why,
                     size_t whylen);
  /* The most bytes one chunk_batch copies through buf (> 0; cuda: its pinned staging buffer). */
  size_t batch_bytes;
  void (*release_dev)(struct backend_dev *d);
};

extern const struct backend_ops backend_host_ops;
extern const struct backend_ops backend_cuda_ops;

/* Whether a CUDA device is usable here (for backend: auto); why says why not. */
bool backend_cuda_available(char *why, size_t whylen);

#endif /* DEP_BACKEND_H */
