/*
 * backend_cuda.c — the cuda backend: pool chunks are separate VMM
 * allocations (cuMemCreate) on one GPU, each exported as a POSIX file
 * descriptor, so each can be lent to one job alone and imported by any
 * local process.  The daemon keeps its own mapping of every chunk to scrub
 * it with cuMemsetD8, and writes and reads the words of a job's slabs
 * (chunk_batch) through a pinned staging buffer on a stream of its own.
 * The driver is reached through cuda/cudadrv.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cudadrv.h"
#include "uuid.h"

static const struct cudadrv *cu;

/* What chunk_batch copies through per wait: a read of every control slot
 * of 8 local ranks of a 1024-rank world (2 * 1024 * DEP_SLAB_CTRL_SLOT
 * bytes each) in one; the pool cuts a larger batch into pieces. */
#define CUDA_STAGE_BYTES (1u << 20)

/* A device's batches: a stream of the daemon's context and the pinned
 * buffer the copies go through (made with the device: backend.h stage).
 * One batch at a time over all devices: they are few and short. */
struct cuda_stage {
  CUstream stream;
  uint8_t *host;
};
static pthread_mutex_t stage_lock = PTHREAD_MUTEX_INITIALIZER;

bool backend_cuda_available(char *why, size_t whylen) {
  return cudadrv_load(why, whylen) != NULL;
}

#define CU_TRY(call, what)                                                        \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                     \
      snprintf(why, whylen, "%s: %s", what, cudadrv_errstr(r_));                  \
      rc = r_ == 2 /* CUDA_ERROR_OUT_OF_MEMORY */ ? DEP_ERR_NO_MEMORY : DEP_ERR_CUDA; \
      goto fail;                                                                  \
    }                                                                             \
  } while (0)

static void prop_for(const struct backend_dev *d, CUmemAllocationProp *p) {
  memset(p, 0, sizeof *p);
  p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->location.id = d->ordinal;
  p->allocFlags.gpuDirectRDMACapable = d->rdma_capable ? 1 : 0;
}

static void cuda_stage_free(struct backend_dev *d) {
  struct cuda_stage *st = d->stage;
  if (st == NULL)
    return;
  cu->cuCtxSetCurrent((CUcontext)d->ctx);
  if (st->stream != NULL)
    cu->cuStreamDestroy(st->stream);
  if (st->host != NULL) {
    cu->cuMemHostUnregister(st->host);
    free(st->host);
  }
  free(st);
  d->stage = NULL;
}

/* Device d's stream and staging buffer (struct cuda_stage). */
static int cuda_stage_make(struct backend_dev *d, char *why, size_t whylen) {
  int rc = 0;
  struct cuda_stage *st = calloc(1, sizeof *st);
  if (st == NULL || (st->host = aligned_alloc(4096, CUDA_STAGE_BYTES)) == NULL) {
    free(st);
    snprintf(why, whylen, "out of memory for device %s's staging buffer", d->uuid_str);
    return DEP_ERR_NO_MEMORY;
  }
  d->stage = st;
  CU_TRY(cu->cuCtxSetCurrent((CUcontext)d->ctx), "cuCtxSetCurrent");
  /* Non-blocking: the batch waits for its own copies, not for the legacy stream. */
  CU_TRY(cu->cuStreamCreate(&st->stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate (batches)");
  const CUresult r = cu->cuMemHostRegister(st->host, CUDA_STAGE_BYTES, 0);
  if (r != CUDA_SUCCESS) {
    free(st->host); /* never registered: cuda_stage_free must not unregister it */
    st->host = NULL;
    CU_TRY(r, "cuMemHostRegister (the batches' staging buffer)");
  }
  return 0;
fail:
  cuda_stage_free(d);
  return rc;
}

static int cuda_probe(struct backend_dev *devs, int max, char *why, size_t whylen) {
  int rc = 0, n = 0;
  cu = cudadrv_load(why, whylen);
  if (cu == NULL)
    return DEP_ERR_UNSUPPORTED;
  CU_TRY(cu->cuDeviceGetCount(&n), "cuDeviceGetCount");
  int found = 0;
  for (int i = 0; i < n && found < max; i++) {
    struct backend_dev *d = &devs[found];
    memset(d, 0, sizeof *d);
    CUdevice dev;
    CUuuid u;
    int vmm = 0, fdok = 0;
    CU_TRY(cu->cuDeviceGet(&dev, i), "cuDeviceGet");
    CU_TRY(cu->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                    dev), "cuDeviceGetAttribute(VMM)");
    CU_TRY(cu->cuDeviceGetAttribute(&fdok,
                                    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                    dev), "cuDeviceGetAttribute(POSIX fd)");
    if (!vmm || !fdok)
      continue; /* cannot lend memory from this GPU; the caller logs the count */
    CU_TRY(cu->cuDeviceGetUuid(&u, dev), "cuDeviceGetUuid");
    memcpy(d->uuid, u.bytes, 16);
    dep__uuid_str(d->uuid, d->uuid_str);
    CU_TRY(cu->cuDeviceGetName(d->name, (int)sizeof d->name, dev), "cuDeviceGetName");
    d->ordinal = dev;
    CUcontext ctx;
    CU_TRY(cu->cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    d->ctx = ctx;
    rc = cuda_stage_make(d, why, whylen);
    if (rc != 0)
      goto fail;
    int rdma = 0;
    if (cu->cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                 dev) == CUDA_SUCCESS)
      d->rdma_capable = rdma != 0;
    CUmemAllocationProp p;
    prop_for(d, &p);
    size_t gran = 0;
    CU_TRY(cu->cuMemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
           "cuMemGetAllocationGranularity");
    d->granularity = gran;
    found++;
  }
  return found;
fail:
  return rc;
}

static int cuda_chunk_create(struct backend_dev *d, uint64_t bytes, struct chunk_mem *out,
                             char *why, size_t whylen) {
  int rc = 0;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  bool mapped = false;
  int fd = -1;
  memset(out, 0, sizeof *out);
  out->fd = -1;
  CU_TRY(cu->cuCtxSetCurrent((CUcontext)d->ctx), "cuCtxSetCurrent");
  CUmemAllocationProp p;
  prop_for(d, &p);
  CU_TRY(cu->cuMemCreate(&h, bytes, &p, 0), "cuMemCreate");
  CU_TRY(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
         "cuMemExportToShareableHandle");
  CU_TRY(cu->cuMemAddressReserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
  CU_TRY(cu->cuMemMap(va, bytes, 0, h, 0), "cuMemMap");
  mapped = true;
  CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, d->ordinal},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CU_TRY(cu->cuMemSetAccess(va, bytes, &acc, 1), "cuMemSetAccess");
  /* Fresh VMM memory is not guaranteed zero: scrub it once now. */
  CU_TRY(cu->cuMemsetD8(va, 0, bytes), "cuMemsetD8");
  CU_TRY(cu->cuCtxSynchronize(), "cuCtxSynchronize");
  out->fd = fd;
  out->bytes = bytes;
  out->dev_ptr = va;
  out->handle = h;
  return 0;
fail:
  if (mapped)
    cu->cuMemUnmap(va, bytes);
  if (va != 0)
    cu->cuMemAddressFree(va, bytes);
  if (fd >= 0)
    close(fd);
  if (h != 0)
    cu->cuMemRelease(h);
  return rc;
}

static void cuda_chunk_destroy(struct backend_dev *d, struct chunk_mem *m) {
  cu->cuCtxSetCurrent((CUcontext)d->ctx);
  if (m->dev_ptr != 0) {
    cu->cuMemUnmap(m->dev_ptr, m->bytes);
    cu->cuMemAddressFree(m->dev_ptr, m->bytes);
  }
  /* Releasing the daemon's handle frees the memory once every process that
   * imported it has released its own: a rank still mapping it keeps it. */
  if (m->handle != 0)
    cu->cuMemRelease(m->handle);
  if (m->fd >= 0)
    close(m->fd);
  memset(m, 0, sizeof *m);
  m->fd = -1;
}

static int cuda_chunk_scrub(struct backend_dev *d, struct chunk_mem *m, char *why, size_t whylen) {
  int rc = 0;
  CU_TRY(cu->cuCtxSetCurrent((CUcontext)d->ctx), "cuCtxSetCurrent");
  CU_TRY(cu->cuMemsetD8(m->dev_ptr, 0, m->bytes), "cuMemsetD8 (scrub)");
  CU_TRY(cu->cuCtxSynchronize(), "cuCtxSynchronize (scrub)");
  return 0;
fail:
  return rc;
}

/*
 * Every copy of the batch goes on the device's stream, in list order, and
 * the batch waits once, for the last: stream order lands each copy before
 * the next starts (the mask words before the epoch that publishes them;
 * a read after the writes it must see), and all are visible to kernels polling with system-scope loads once the
 * wait returns.  Zeros are a memset on the stream; bytes go through the
 * pinned staging buffer (a copy from pageable memory would wait on its own).
 */
static int cuda_chunk_batch(struct backend_dev *d, const struct chunk_io *io, size_t n,
                            char *why, size_t whylen) {
  struct cuda_stage *st = d->stage;
  int rc = 0;
  size_t used = 0;
  bool queued = false;
  pthread_mutex_lock(&stage_lock);
  CU_TRY(cu->cuCtxSetCurrent((CUcontext)d->ctx), "cuCtxSetCurrent");
  for (size_t i = 0; i < n; i++) {
    const CUdeviceptr at = io[i].m->dev_ptr + io[i].off;
    if (!io[i].read && io[i].buf == NULL) {
      CU_TRY(cu->cuMemsetD8Async(at, 0, io[i].len, st->stream), "cuMemsetD8Async (slab words)");
      queued = true;
      continue;
    }
    if (io[i].len > CUDA_STAGE_BYTES - used) {
      snprintf(why, whylen, "a batch copies more than the %u bytes of its staging buffer",
               CUDA_STAGE_BYTES);
      rc = DEP_ERR_INTERNAL;
      goto fail;
    }
    if (!io[i].read) {
      memcpy(st->host + used, io[i].buf, io[i].len);
      CU_TRY(cu->cuMemcpyHtoDAsync(at, st->host + used, io[i].len, st->stream),
             "cuMemcpyHtoDAsync (slab words)");
    } else {
      CU_TRY(cu->cuMemcpyDtoHAsync(st->host + used, at, io[i].len, st->stream),
             "cuMemcpyDtoHAsync (call counters)");
    }
    queued = true;
    used += io[i].len;
  }
  queued = false; /* the wait below is the batch's, failed or not */
  CU_TRY(cu->cuStreamSynchronize(st->stream), "cuStreamSynchronize (slab words)");
  for (size_t i = 0, o = 0; i < n; i++) {
    if (io[i].read)
      memcpy(io[i].buf, st->host + o, io[i].len);
    o += io[i].buf != NULL ? io[i].len : 0; /* where the next staged copy went */
  }
  pthread_mutex_unlock(&stage_lock);
  return 0;
fail:
  /* The staging buffer is the next batch's only once what was queued is done. */
  if (queued)
    (void)cu->cuStreamSynchronize(st->stream);
  pthread_mutex_unlock(&stage_lock);
  return rc;
}

static void cuda_release_dev(struct backend_dev *d) {
  if (cu != NULL && d->ctx != NULL) {
    cuda_stage_free(d);
    cu->cuDevicePrimaryCtxRelease(d->ordinal);
  }
  d->ctx = NULL;
}

const struct backend_ops backend_cuda_ops = {
    .name = "cuda",
    .cuts_only_when_set = false,
    .probe = cuda_probe,
    .chunk_create = cuda_chunk_create,
    .chunk_destroy = cuda_chunk_destroy,
    .chunk_scrub = cuda_chunk_scrub,
    .chunk_batch = cuda_chunk_batch,
    .batch_bytes = CUDA_STAGE_BYTES,
    .release_dev = cuda_release_dev,
};
