/*
 * cudadrv.h — the narrow seam to the CUDA driver API, reached with
 * dlopen("libcuda.so.1") so that the daemon and libdeepep-client load and
 * run on machines with no GPU (host backend).  The few driver types used
 * are declared here with the driver's ABI layout, so the build needs no
 * CUDA toolkit either.
 *
 * Usage: cudadrv_load() once (cheap after the first time, thread-safe);
 * then call through the table it returns.  CU_CHECK-style logging is the
 * caller's: cudadrv_errstr() turns a CUresult into the driver's text.
 */
#ifndef DEP_CUDADRV_H
#define DEP_CUDADRV_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUevent_st *CUevent;
typedef struct CUlinkState_st *CUlinkState;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_IMAGE 200
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_COMPUTE_MODE 20
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103
#define CU_DEVICE_ATTRIBUTE_MPS_ENABLED 133
#define CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID 134
#define CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR 81
#define CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN 97
#define CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK 111
#define CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES 1
#define CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_DISABLE_TIMING 0x2
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CUDA_ERROR_NOT_READY 600
/* The JIT linker (the daemon's kernel cache: compile the fatbin's PTX once). */
#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6
#define CU_JIT_INPUT_FATBINARY 2
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 0x1
#define CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED 110
/* What memory a pointer is (dep_handle_new_in checks the caller's). */
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2

typedef struct {
  int type;
  int id;
} CUmemLocation;

typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED */
  int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

typedef struct {
  char bytes[16];
} CUuuid;

struct cudadrv {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorString)(CUresult, const char **);
  CUresult (*cuDriverGetVersion)(int *);
  CUresult (*cuDeviceGetCount)(int *);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDeviceGetName)(char *, int, CUdevice);
  CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice);
  CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
  CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuDevicePrimaryCtxGetState)(CUdevice, unsigned int *, int *);
  CUresult (*cuCtxGetCurrent)(CUcontext *);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetDevice)(CUdevice *);
  CUresult (*cuCtxSynchronize)(void);
  CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int,
                                           unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                  unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*cuModuleLoadData)(CUmodule *, const void *);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
  CUresult (*cuStreamSynchronize)(CUstream);
  /* The operations' launcher (client/cuda_ops.c), its tests and benchmarks. */
  CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
  CUresult (*cuMemHostUnregister)(void *);
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
  CUresult (*cuStreamCreate)(CUstream *, unsigned int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext *);
  CUresult (*cuEventCreate)(CUevent *, unsigned int);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  /* Copies between GPUs (the benchmarks' peer-copy ceiling). */
  CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
  CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned int);
  CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
  /* The daemon's kernel cache: the fatbin's PTX compiled once into a cubin. */
  CUresult (*cuLinkCreate)(unsigned int, int *, void **, CUlinkState *);
  CUresult (*cuLinkAddData)(CUlinkState, int, void *, size_t, const char *, unsigned int, int *,
                            void **);
  CUresult (*cuLinkComplete)(CUlinkState, void **, size_t *);
  CUresult (*cuLinkDestroy)(CUlinkState);
  /* dep_handle_new_in: that the caller's memory is the rank's GPU's. */
  CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
  /* deepepctl doctor: a GPU's free memory against its pool's budget. */
  CUresult (*cuMemGetInfo)(size_t *, size_t *);
  CUresult (*cuFuncGetAttribute)(int *, int, CUfunction);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
};

/*
 * Load libcuda.so.1 and resolve the table (once per process).  Returns the
 * table, or NULL with `why` set ("libcuda.so.1: cannot open shared object
 * file" / "cuInit failed: no CUDA-capable device").  Calls cuInit(0): never
 * call it before fork() in a process whose child will use CUDA.
 */
const struct cudadrv *cudadrv_load(char *why, size_t whylen);

/* The driver's name for a result ("CUDA_ERROR_OUT_OF_MEMORY: out of memory"). */
const char *cudadrv_errstr(CUresult r);

/* Find the device ordinal with this UUID in the calling process; 0 or -1. */
int cudadrv_device_by_uuid(const struct cudadrv *cu, const uint8_t uuid[16], CUdevice *out);

#endif /* DEP_CUDADRV_H */
