/*
 * cudadrv.c — dlopen seam to the CUDA driver (see cudadrv.h).
 */
#include "cudadrv.h"

#include <ctype.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static struct cudadrv drv;
static const struct cudadrv *drv_ok;
static char drv_why[256];
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* Resolve one symbol by its exact (versioned) name. */
#define RESOLVE(field, sym)                                                      \
  do {                                                                           \
    *(void **)(&drv.field) = dlsym(h, sym);                                      \
    if (drv.field == NULL) {                                                     \
      snprintf(drv_why, sizeof drv_why, "libcuda.so.1 lacks %s (driver too old?)", sym); \
      return;                                                                    \
    }                                                                            \
  } while (0)

static void drv_load_once(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    snprintf(drv_why, sizeof drv_why, "no CUDA driver: %s", dlerror());
    return;
  }
  RESOLVE(cuInit, "cuInit");
  RESOLVE(cuGetErrorString, "cuGetErrorString");
  RESOLVE(cuDriverGetVersion, "cuDriverGetVersion");
  RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
  RESOLVE(cuDeviceGet, "cuDeviceGet");
  RESOLVE(cuDeviceGetName, "cuDeviceGetName");
  RESOLVE(cuDeviceGetUuid, "cuDeviceGetUuid_v2");
  RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
  RESOLVE(cuDeviceTotalMem, "cuDeviceTotalMem_v2");
  RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  RESOLVE(cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState");
  RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent");
  RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent");
  RESOLVE(cuCtxGetDevice, "cuCtxGetDevice");
  RESOLVE(cuCtxSynchronize, "cuCtxSynchronize");
  RESOLVE(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  RESOLVE(cuMemCreate, "cuMemCreate");
  RESOLVE(cuMemRelease, "cuMemRelease");
  RESOLVE(cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  RESOLVE(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  RESOLVE(cuMemAddressReserve, "cuMemAddressReserve");
  RESOLVE(cuMemAddressFree, "cuMemAddressFree");
  RESOLVE(cuMemMap, "cuMemMap");
  RESOLVE(cuMemUnmap, "cuMemUnmap");
  RESOLVE(cuMemSetAccess, "cuMemSetAccess");
  RESOLVE(cuMemsetD8, "cuMemsetD8_v2");
  RESOLVE(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  RESOLVE(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  RESOLVE(cuModuleLoadData, "cuModuleLoadData");
  RESOLVE(cuModuleUnload, "cuModuleUnload");
  RESOLVE(cuModuleGetFunction, "cuModuleGetFunction");
  RESOLVE(cuLaunchKernel, "cuLaunchKernel");
  RESOLVE(cuStreamSynchronize, "cuStreamSynchronize");
  RESOLVE(cuMemAlloc, "cuMemAlloc_v2");
  RESOLVE(cuMemFree, "cuMemFree_v2");
  RESOLVE(cuMemHostRegister, "cuMemHostRegister_v2");
  RESOLVE(cuMemHostUnregister, "cuMemHostUnregister");
  RESOLVE(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
  RESOLVE(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  RESOLVE(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  RESOLVE(cuMemsetD8Async, "cuMemsetD8Async");
  RESOLVE(cuMemsetD32Async, "cuMemsetD32Async");
  RESOLVE(cuStreamCreate, "cuStreamCreate");
  RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2");
  RESOLVE(cuStreamQuery, "cuStreamQuery");
  RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  RESOLVE(cuEventCreate, "cuEventCreate");
  RESOLVE(cuEventRecord, "cuEventRecord");
  RESOLVE(cuEventSynchronize, "cuEventSynchronize");
  RESOLVE(cuEventElapsedTime, "cuEventElapsedTime"); /* v1: older drivers lack _v2 */
  RESOLVE(cuEventDestroy, "cuEventDestroy_v2");
  RESOLVE(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
  RESOLVE(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
  RESOLVE(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
  RESOLVE(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
  RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent");
  RESOLVE(cuLinkCreate, "cuLinkCreate_v2");
  RESOLVE(cuLinkAddData, "cuLinkAddData_v2");
  RESOLVE(cuLinkComplete, "cuLinkComplete");
  RESOLVE(cuLinkDestroy, "cuLinkDestroy");
  RESOLVE(cuPointerGetAttribute, "cuPointerGetAttribute");
  RESOLVE(cuMemGetInfo, "cuMemGetInfo_v2");
  *(void **)(&drv.cuMemGetHandleForAddressRange) = dlsym(h, "cuMemGetHandleForAddressRange");
  CUresult r = drv.cuInit(0);
  if (r != CUDA_SUCCESS) {
    snprintf(drv_why, sizeof drv_why, "cuInit failed: %s", cudadrv_errstr(r));
    return;
  }
  int n = 0;
  r = drv.cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS || n <= 0) {
    snprintf(drv_why, sizeof drv_why, "the CUDA driver reports no device");
    return;
  }
  drv_ok = &drv;
}

const struct cudadrv *cudadrv_load(char *why, size_t whylen) {
  pthread_once(&drv_once, drv_load_once);
  if (drv_ok == NULL && why != NULL && whylen > 0)
    snprintf(why, whylen, "%s", drv_why);
  return drv_ok;
}

const char *cudadrv_errstr(CUresult r) {
  const char *s = NULL;
  if (drv.cuGetErrorString != NULL && drv.cuGetErrorString(r, &s) == CUDA_SUCCESS && s != NULL)
    return s;
  return "unknown CUDA error";
}

void cudadrv_uuid_str(const uint8_t u[16], char out[37]) {
  snprintf(out, 37,
           "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
           u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

int cudadrv_uuid_parse(const char *s, uint8_t out[16]) {
  if (strncmp(s, "GPU-", 4) == 0)
    s += 4;
  int n = 0;
  for (; *s != '\0'; s++) {
    if (*s == '-')
      continue;
    if (!isxdigit((unsigned char)*s) || n >= 32 || !isxdigit((unsigned char)s[1]))
      return -1;
    unsigned v;
    if (sscanf(s, "%2x", &v) != 1)
      return -1;
    out[n / 2] = (uint8_t)v;
    n += 2;
    s++;
  }
  return n == 32 ? 0 : -1;
}

int cudadrv_device_by_uuid(const struct cudadrv *cu, const uint8_t uuid[16], CUdevice *out) {
  int n = 0;
  if (cu->cuDeviceGetCount(&n) != CUDA_SUCCESS)
    return -1;
  for (int i = 0; i < n; i++) {
    CUdevice d;
    CUuuid u;
    if (cu->cuDeviceGet(&d, i) != CUDA_SUCCESS || cu->cuDeviceGetUuid(&u, d) != CUDA_SUCCESS)
      continue;
    if (memcmp(u.bytes, uuid, 16) == 0) {
      *out = d;
      return 0;
    }
  }
  return -1;
}
