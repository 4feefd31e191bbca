/*
 * mem.c — mapping lent slabs into this process (see mem.h).
 */
#include "mem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cudadrv.h"
#include "deepep.h"
#include "uuid.h"

static void close_fds(int *fds, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

static int map_host(struct mem_map *m, int *fds, char *why, size_t whylen) {
  void *base = mmap(NULL, m->bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    snprintf(why, whylen, "reserving %llu bytes of address space: %s",
             (unsigned long long)m->bytes, strerror(errno));
    return DEP_ERR_NO_MEMORY;
  }
  for (uint32_t i = 0; i < m->n_chunks; i++) {
    struct stat sb;
    /* The daemon is trusted, but a chunk shorter than announced would turn
     * an access into SIGBUS: check before mapping. */
    if (fstat(fds[i], &sb) != 0 || (uint64_t)sb.st_size < m->chunk_bytes) {
      snprintf(why, whylen, "chunk %u of the slab is not %llu bytes long", i,
               (unsigned long long)m->chunk_bytes);
      munmap(base, m->bytes);
      return DEP_ERR_PROTOCOL;
    }
    void *at = (char *)base + (uint64_t)i * m->chunk_bytes;
    if (mmap(at, m->chunk_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[i], 0) ==
        MAP_FAILED) {
      snprintf(why, whylen, "mapping chunk %u: %s", i, strerror(errno));
      munmap(base, m->bytes);
      return DEP_ERR_NO_MEMORY;
    }
  }
  m->base = base;
  return 0;
}

static int map_cuda(struct mem_map *m, int *fds, int dev, char *why, size_t whylen) {
  const struct cudadrv *cu = cudadrv_load(why, whylen);
  if (cu == NULL)
    return DEP_ERR_UNSUPPORTED;
  m->handles = calloc(m->n_chunks, sizeof *m->handles);
  if (m->handles == NULL) {
    snprintf(why, whylen, "out of memory");
    return DEP_ERR_NO_MEMORY;
  }
  CUdeviceptr va = 0;
  uint32_t mapped = 0;
  CUresult r = cu->cuMemAddressReserve(&va, m->bytes, 0, 0, 0);
  const char *what = "cuMemAddressReserve";
  for (uint32_t i = 0; r == CUDA_SUCCESS && i < m->n_chunks; i++) {
    CUmemGenericAllocationHandle h;
    what = "cuMemImportFromShareableHandle";
    r = cu->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fds[i],
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS)
      break;
    m->handles[i] = h;
    what = "cuMemMap";
    r = cu->cuMemMap(va + (uint64_t)i * m->chunk_bytes, m->chunk_bytes, 0, h, 0);
    if (r == CUDA_SUCCESS)
      mapped++;
  }
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, dev},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    what = "cuMemSetAccess";
    r = cu->cuMemSetAccess(va, m->bytes, &acc, 1);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(why, whylen, "%s: %s", what, cudadrv_errstr(r));
    for (uint32_t i = 0; i < mapped; i++)
      cu->cuMemUnmap(va + (uint64_t)i * m->chunk_bytes, m->chunk_bytes);
    for (uint32_t i = 0; i < m->n_chunks; i++)
      if (m->handles[i] != 0)
        cu->cuMemRelease(m->handles[i]);
    if (va != 0)
      cu->cuMemAddressFree(va, m->bytes);
    free(m->handles);
    m->handles = NULL;
    return r == CUDA_ERROR_OUT_OF_MEMORY ? DEP_ERR_NO_MEMORY : DEP_ERR_CUDA;
  }
  m->base = (void *)(uintptr_t)va;
  return 0;
}

int mem_map_slab(struct mem_map *m, bool cuda, int *fds, uint32_t n, uint64_t chunk_bytes,
                 int access_dev, char *why, size_t whylen) {
  memset(m, 0, sizeof *m);
  if (n == 0 || chunk_bytes == 0 || chunk_bytes > UINT64_MAX / n) {
    close_fds(fds, n);
    snprintf(why, whylen, "a slab of %u chunks of %llu bytes cannot be mapped", n,
             (unsigned long long)chunk_bytes);
    return DEP_ERR_PROTOCOL;
  }
  m->cuda = cuda;
  m->chunk_bytes = chunk_bytes;
  m->n_chunks = n;
  m->bytes = chunk_bytes * n;
  int rc = cuda ? map_cuda(m, fds, access_dev, why, whylen) : map_host(m, fds, why, whylen);
  close_fds(fds, n);
  if (rc != 0)
    memset(m, 0, sizeof *m);
  return rc;
}

void mem_unmap_slab(struct mem_map *m) {
  if (m->base == NULL)
    return;
  if (!m->cuda) {
    munmap(m->base, m->bytes);
  } else {
    const struct cudadrv *cu = cudadrv_load(NULL, 0);
    CUdeviceptr va = (CUdeviceptr)(uintptr_t)m->base;
    if (cu != NULL) {
      for (uint32_t i = 0; i < m->n_chunks; i++) {
        cu->cuMemUnmap(va + (uint64_t)i * m->chunk_bytes, m->chunk_bytes);
        cu->cuMemRelease(m->handles[i]);
      }
      cu->cuMemAddressFree(va, m->bytes);
    }
    free(m->handles);
  }
  memset(m, 0, sizeof *m);
}

/* Hold a reference to GPU dev's primary context ctx in ref, giving back any other. */
static void ref_take(const struct cudadrv *cu, struct mem_ctx_ref *ref, int dev, CUcontext ctx) {
  if (ref->dev == dev) {
    cu->cuDevicePrimaryCtxRelease(dev); /* the one taken for this call; ref holds one already */
    return;
  }
  mem_cuda_unbind(ref);
  ref->dev = dev;
  ref->ctx = ctx;
}

int mem_cuda_bind(const uint8_t uuid[16], int *ordinal, struct mem_ctx_ref *ref, char *why,
                  size_t whylen) {
  const struct cudadrv *cu = cudadrv_load(why, whylen);
  if (cu == NULL)
    return DEP_ERR_UNSUPPORTED;
  CUdevice dev;
  if (cudadrv_device_by_uuid(cu, uuid, &dev) != 0) {
    char s[DEP_UUID_STR_LEN];
    dep__uuid_str(uuid, s);
    snprintf(why, whylen, "no visible GPU has UUID %s (check CUDA_VISIBLE_DEVICES)", s);
    return DEP_ERR_NOT_FOUND;
  }
  *ordinal = dev;
  CUcontext cur = NULL, primary = NULL;
  CUdevice curdev = -1;
  if (cu->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != NULL &&
      cu->cuCtxGetDevice(&curdev) == CUDA_SUCCESS && curdev == dev) {
    /* The caller's context.  If it is the primary one (the runtime's, or
     * one an earlier handle made current), hold a reference of our own;
     * only an active primary context is asked about, since retaining an
     * inactive one would make it. */
    unsigned flags = 0;
    int active = 0;
    if (ref->dev != dev && cu->cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS &&
        active && cu->cuDevicePrimaryCtxRetain(&primary, dev) == CUDA_SUCCESS) {
      if (primary == cur)
        ref_take(cu, ref, dev, primary);
      else
        cu->cuDevicePrimaryCtxRelease(dev);
    }
    return 0;
  }
  CUresult r = cu->cuDevicePrimaryCtxRetain(&primary, dev);
  if (r == CUDA_SUCCESS) {
    ref_take(cu, ref, dev, primary);
    r = cu->cuCtxSetCurrent(primary);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(why, whylen, "making a context current on GPU %d: %s", dev, cudadrv_errstr(r));
    return DEP_ERR_CUDA;
  }
  return 0;
}

void mem_cuda_unbind(struct mem_ctx_ref *ref) {
  if (ref->dev < 0)
    return;
  const struct cudadrv *cu = cudadrv_load(NULL, 0);
  cu->cuDevicePrimaryCtxRelease(ref->dev);
  /* If that was the last reference the context is gone: not left current
   * on this thread. */
  unsigned flags = 0;
  int active = 1;
  CUcontext cur = NULL;
  if (cu->cuDevicePrimaryCtxGetState(ref->dev, &flags, &active) == CUDA_SUCCESS && !active &&
      cu->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == (CUcontext)ref->ctx)
    cu->cuCtxSetCurrent(NULL);
  ref->dev = -1;
  ref->ctx = NULL;
}
