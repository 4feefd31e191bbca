/*
 * mem.h — mapping the slabs deepepd lends into this process.
 *
 * A slab arrives as one fd per chunk.  The library reserves one contiguous
 * address range for the slab and maps each chunk into it in order, so a
 * slab is a single pointer to callers whatever its chunking:
 *  - host backend: the fds are memfds, mapped with mmap(MAP_SHARED|MAP_FIXED);
 *  - cuda backend: the fds are exported VMM handles, imported with
 *    cuMemImportFromShareableHandle and mapped with cuMemMap into a range
 *    from cuMemAddressReserve, readable and writable by this rank's GPU.
 * The fds are closed once imported or mapped: the mapping holds the memory.
 */
#ifndef DEP_CLIENT_MEM_H
#define DEP_CLIENT_MEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct mem_map {
  bool cuda;
  void *base;             /* host pointer, or device pointer on cuda */
  uint64_t bytes;
  uint64_t chunk_bytes;
  uint32_t n_chunks;
  unsigned long long *handles; /* cuda: imported allocation handles */
};

/*
 * Map n fds of chunk_bytes each as one slab.  On cuda, `access_dev` is the
 * CUDA device ordinal of this rank (its context must be current).  Every fd
 * is closed, on success or failure.  Returns 0 or DEP_ERR_* with why.
 */
int mem_map_slab(struct mem_map *m, bool cuda, int *fds, uint32_t n, uint64_t chunk_bytes,
                 int access_dev, char *why, size_t whylen);

/* Unmap a slab mapped by mem_map_slab (a zeroed struct is fine). */
void mem_unmap_slab(struct mem_map *m);

/*
 * A handle's reference to a GPU's primary context (dev -1: none).  A handle
 * that works in a primary context holds one reference of its own, whoever
 * made the context current, so that freeing another handle (or the runtime
 * letting go) cannot destroy it under this one's slabs and kernels.
 */
struct mem_ctx_ref {
  int dev;
  void *ctx; /* the CUcontext */
};

/*
 * On cuda: make a context current for the device with this UUID (the
 * caller's own if one is current on it, else the device's primary context)
 * and return its ordinal; where that is the primary context, `ref` holds a
 * reference to it (one per handle, however often it binds), given back by
 * mem_cuda_unbind.  DEP_ERR_NOT_FOUND when no visible GPU has the UUID.
 */
int mem_cuda_bind(const uint8_t uuid[16], int *ordinal, struct mem_ctx_ref *ref, char *why,
                  size_t whylen);
void mem_cuda_unbind(struct mem_ctx_ref *ref);

#endif /* DEP_CLIENT_MEM_H */
