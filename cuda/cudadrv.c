/*
 * cudadrv.c — dlopen seam to the CUDA driver (see cudadrv.h).
 */
#include "cudadrv.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "dlload.h"

static struct cudadrv drv;
static const struct cudadrv *drv_ok;
static char drv_why[256];
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* Every entry point by its exact (versioned) name: the table's type is the version's ABI. */
#define SYM(field, sym) {.name = sym, .at = &drv.field}
static const struct dep_dlsym drv_syms[] = {
    SYM(cuInit, "cuInit"),
    SYM(cuGetErrorString, "cuGetErrorString"),
    SYM(cuDriverGetVersion, "cuDriverGetVersion"),
    SYM(cuDeviceGetCount, "cuDeviceGetCount"),
    SYM(cuDeviceGet, "cuDeviceGet"),
    SYM(cuDeviceGetName, "cuDeviceGetName"),
    SYM(cuDeviceGetUuid, "cuDeviceGetUuid_v2"),
    SYM(cuDeviceGetAttribute, "cuDeviceGetAttribute"),
    SYM(cuDeviceTotalMem, "cuDeviceTotalMem_v2"),
    SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    SYM(cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState"),
    SYM(cuCtxGetCurrent, "cuCtxGetCurrent"),
    SYM(cuCtxSetCurrent, "cuCtxSetCurrent"),
    SYM(cuCtxGetDevice, "cuCtxGetDevice"),
    SYM(cuCtxSynchronize, "cuCtxSynchronize"),
    SYM(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
    SYM(cuMemCreate, "cuMemCreate"),
    SYM(cuMemRelease, "cuMemRelease"),
    SYM(cuMemExportToShareableHandle, "cuMemExportToShareableHandle"),
    SYM(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle"),
    SYM(cuMemAddressReserve, "cuMemAddressReserve"),
    SYM(cuMemAddressFree, "cuMemAddressFree"),
    SYM(cuMemMap, "cuMemMap"),
    SYM(cuMemUnmap, "cuMemUnmap"),
    SYM(cuMemSetAccess, "cuMemSetAccess"),
    SYM(cuMemsetD8, "cuMemsetD8_v2"),
    SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
    SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
    SYM(cuModuleLoadData, "cuModuleLoadData"),
    SYM(cuModuleUnload, "cuModuleUnload"),
    SYM(cuModuleGetFunction, "cuModuleGetFunction"),
    SYM(cuLaunchKernel, "cuLaunchKernel"),
    SYM(cuStreamSynchronize, "cuStreamSynchronize"),
    SYM(cuMemAlloc, "cuMemAlloc_v2"),
    SYM(cuMemFree, "cuMemFree_v2"),
    SYM(cuMemHostRegister, "cuMemHostRegister_v2"),
    SYM(cuMemHostUnregister, "cuMemHostUnregister"),
    SYM(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2"),
    SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    SYM(cuMemsetD8Async, "cuMemsetD8Async"),
    SYM(cuMemsetD32Async, "cuMemsetD32Async"),
    SYM(cuStreamCreate, "cuStreamCreate"),
    SYM(cuStreamDestroy, "cuStreamDestroy_v2"),
    SYM(cuStreamQuery, "cuStreamQuery"),
    SYM(cuCtxPushCurrent, "cuCtxPushCurrent_v2"),
    SYM(cuCtxPopCurrent, "cuCtxPopCurrent_v2"),
    SYM(cuEventCreate, "cuEventCreate"),
    SYM(cuEventRecord, "cuEventRecord"),
    SYM(cuEventSynchronize, "cuEventSynchronize"),
    SYM(cuEventElapsedTime, "cuEventElapsedTime"), /* v1: older drivers lack _v2 */
    SYM(cuEventDestroy, "cuEventDestroy_v2"),
    SYM(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer"),
    SYM(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess"),
    SYM(cuMemcpyPeerAsync, "cuMemcpyPeerAsync"),
    SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"),
    SYM(cuStreamWaitEvent, "cuStreamWaitEvent"),
    SYM(cuLinkCreate, "cuLinkCreate_v2"),
    SYM(cuLinkAddData, "cuLinkAddData_v2"),
    SYM(cuLinkComplete, "cuLinkComplete"),
    SYM(cuLinkDestroy, "cuLinkDestroy"),
    SYM(cuPointerGetAttribute, "cuPointerGetAttribute"),
    SYM(cuMemGetInfo, "cuMemGetInfo_v2"),
    SYM(cuFuncGetAttribute, "cuFuncGetAttribute"),
    SYM(cuFuncSetAttribute, "cuFuncSetAttribute"),
};

static void drv_load_once(void) {
  void *h;
  char why[sizeof drv_why - 40]; /* room in drv_why for the words around it */
  int rc = dep__dl_load("libcuda.so.1", drv_syms, sizeof drv_syms / sizeof drv_syms[0], &h, why,
                       sizeof why);
  if (rc == DEP_DL_NO_LIBRARY) {
    snprintf(drv_why, sizeof drv_why, "no CUDA driver: %s", why);
    return;
  }
  if (rc != DEP_DL_OK) {
    snprintf(drv_why, sizeof drv_why, "%s (driver too old?)", why);
    return;
  }
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
