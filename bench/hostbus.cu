/*
 * hostbus.cu — the bus between a GPU and pinned host memory, measured the
 * way the cuda backend uses it between nodes: its kernels store a block
 * into the exchange region (host memory mapped for the device), poll flags
 * there with system-scope acquire loads and read remote blocks out of it
 * (DESIGN §6, docs/between-nodes.md).  These are the ceilings a call across
 * daemons is read against (BENCHMARKS.md), taken on the same machine in the
 * same run:
 *
 *   - a kernel of CTAS CTAs storing BYTES into host memory, loading them
 *     back, and the copy engine (cudaMemcpyAsync) both ways, for each size;
 *   - one thread's dependent `ld.acquire.sys` loads of host memory (a
 *     flag poll's round trip), at strides from 8 B to 2 MiB (a page-walk or
 *     IOMMU cost would show as a stride cost);
 *   - the same loads from 1 to 2 × CTAS CTAs at once, alone and beside a
 *     kernel that keeps storing a low-latency block into host memory (the
 *     senders' traffic a receiver's polls share the bus with).
 *
 * Host memory is pinned as the library pins the exchange region
 * (malloc'd pages, cudaHostRegister portable and mapped); -A uses
 * cudaHostAlloc instead.  Times are CUDA events around each launch (so a
 * kernel's include its launch), medians of REPS after 3 warm-up runs; the
 * loads' are the kernel's own %globaltimer.
 *
 *   hostbus [-c CTAS] [-r REPS] [-b BYTES,...] [-A]
 */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <vector>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "hostbus: %s: %s\n", #x, cudaGetErrorString(e_));           \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

static const size_t POOL = 64ull << 20; /* the largest size measured, and the loads' span */
static const int THREADS = 256;
static const int LOADS = 200;           /* dependent loads a thread times */
static const size_t LL_BLOCK = 115ull << 10; /* a low-latency dispatch block at 1+1 (BENCHMARKS) */

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* dst[i] = src[i] over the grid, 16 B a thread a step; then a system fence, as a sender's. */
__global__ void copy16(uint4 *dst, const uint4 *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
  __threadfence_system();
}

/* Thread 0 of each CTA: LOADS dependent acquire loads of host words, each
 * address depending on the value before; ns[cta] = their time.  CTA c starts
 * at word c * span (its own lines), stepping `stride` words. */
__global__ void chase(const uint64_t *h, size_t span, size_t stride, long long *ns) {
  if (threadIdx.x != 0)
    return;
  const uint64_t *p = h + (size_t)blockIdx.x * span;
  uint64_t acc = 0, at = 0;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < LOADS; i++) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p + at) : "memory");
    acc += v;
    at = (at + stride + (v & 1)) % span;
  }
  ns[blockIdx.x] = (long long)(now_ns() - t0) + (long long)(acc & 1);
}

/* A sender's traffic: the block stored into host memory again and again, fenced each time. */
__global__ void store_loop(uint4 *dst, size_t n, int times) {
  for (int r = 0; r < times; r++) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
      dst[i] = make_uint4(r, r, r, r);
    __threadfence_system();
  }
}

struct op {
  enum { KERNEL, ENGINE } how;
  void *dst;
  const void *src;
  size_t bytes;
  int ctas;
};

static void launch(const op &o, cudaStream_t s) {
  if (o.how == op::KERNEL)
    copy16<<<o.ctas, THREADS, 0, s>>>((uint4 *)o.dst, (const uint4 *)o.src, o.bytes / 16);
  else
    CHECK(cudaMemcpyAsync(o.dst, o.src, o.bytes, cudaMemcpyDefault, s));
}

/* The median of reps timed launches of o, in microseconds. */
static double median_us(const op &o, int reps, cudaStream_t s) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < reps + 3; r++) {
    CHECK(cudaEventRecord(a, s));
    launch(o, s);
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (r >= 3)
      ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1e3;
}

static void usage(FILE *f) {
  fprintf(f, "usage: hostbus [-c CTAS] [-r REPS] [-b BYTES,...] [-A]\n"
             "  -c  CTAs of the copying kernels and of the sender beside the polls; the polls\n"
             "      run on 1, 8, CTAS/2, CTAS and 2*CTAS CTAs (96)\n"
             "  -r  timed runs of each copy, after 3 warm-up runs (20)\n"
             "  -b  sizes copied, bytes, each a multiple of 16 up to 64 MiB\n"
             "      (117760,1048576,16777216,67108864)\n"
             "  -A  host memory from cudaHostAlloc rather than registered pages\n");
}

struct opts {
  int ctas = 96, reps = 20;
  bool host_alloc = false;
  std::vector<size_t> sizes;
};

/* The options, checked: 0, or the exit status (usage said, or the fault). */
static int parse(int argc, char **argv, opts *o) {
  int opt;
  while ((opt = getopt(argc, argv, "c:r:b:Ah")) != -1) {
    switch (opt) {
    case 'c': o->ctas = atoi(optarg); break;
    case 'r': o->reps = atoi(optarg); break;
    case 'A': o->host_alloc = true; break;
    case 'b':
      for (char *t = strtok(optarg, ","); t != NULL; t = strtok(NULL, ","))
        o->sizes.push_back(strtoull(t, NULL, 0));
      break;
    case 'h': usage(stdout); exit(0);
    default: usage(stderr); return 2;
    }
  }
  if (o->sizes.empty())
    o->sizes = {LL_BLOCK, 1ull << 20, 16ull << 20, POOL};
  for (size_t n : o->sizes)
    if (n == 0 || n % 16 != 0 || n > POOL) {
      fprintf(stderr, "hostbus: -b %zu: give sizes that are multiples of 16, 16 B to 64 MiB\n", n);
      return 2;
    }
  if (o->ctas < 1 || o->ctas > 1024 || o->reps < 1) {
    fprintf(stderr, "hostbus: -c takes 1 to 1024 CTAs and -r at least 1 run\n");
    return 2;
  }
  return 0;
}

/* Host memory pinned and mapped for the device as the library pins the exchange region (or
 * by cudaHostAlloc), zeroed. */
static void *host_pool(bool host_alloc) {
  void *host;
  if (host_alloc) {
    CHECK(cudaHostAlloc(&host, POOL, cudaHostAllocPortable | cudaHostAllocMapped));
  } else {
    host = aligned_alloc(4096, POOL);
    if (host == NULL) {
      fprintf(stderr, "hostbus: cannot allocate %zu bytes of host memory\n", POOL);
      exit(1);
    }
    CHECK(cudaHostRegister(host, POOL, cudaHostRegisterPortable | cudaHostRegisterMapped));
  }
  memset(host, 0, POOL);
  return host;
}

/* Each size stored into host memory and loaded back by a kernel, and by the copy engine. */
static void copies(const opts &o, void *host, void *d0, void *d1, cudaStream_t s) {
  printf("%12s %12s %12s %12s %12s %10s %10s %10s\n", "bytes", "kstore_us", "kload_us",
         "ceD2H_us", "ceH2D_us", "kstGB/s", "kldGB/s", "ceGB/s");
  for (size_t n : o.sizes) {
    const double st = median_us({op::KERNEL, host, d0, n, o.ctas}, o.reps, s);
    const double ld = median_us({op::KERNEL, d1, host, n, o.ctas}, o.reps, s);
    const double d2h = median_us({op::ENGINE, host, d0, n, 0}, o.reps, s);
    const double h2d = median_us({op::ENGINE, d1, host, n, 0}, o.reps, s);
    printf("%12zu %12.1f %12.1f %12.1f %12.1f %10.2f %10.2f %10.2f\n", n, st, ld, d2h, h2d,
           n / st / 1e3, n / ld / 1e3, n / d2h / 1e3);
  }
}

/* One thread's dependent loads of host memory, by stride. */
static void strides(void *host, long long *ns, cudaStream_t s) {
  printf("# one thread's dependent ld.acquire.sys loads of host memory, by stride\n");
  for (size_t stride : {8ul, 4096ul, 65536ul, 2ul << 20}) {
    for (int r = 0; r < 3; r++) /* the last run's time */
      chase<<<1, 32, 0, s>>>((const uint64_t *)host, POOL / 8, stride / 8, ns);
    CHECK(cudaStreamSynchronize(s));
    printf("stride %8zu B: %6.2f us a load\n", stride, ns[0] / 1e3 / LOADS);
  }
}

/* The same loads from many CTAs at once, alone and beside a sender's stores into host memory. */
static void polls(const opts &o, void *host, void *sink, long long *ns, cudaStream_t s,
                  cudaStream_t bg) {
  printf("# the same loads from many CTAs at once (each its own lines), alone and beside a kernel\n"
         "# storing a %zu-byte block into host memory again and again\n", LL_BLOCK);
  printf("%6s %14s %14s %14s %14s\n", "ctas", "alone_us", "alone_worst", "beside_us",
         "beside_worst");
  for (int n : {1, 8, o.ctas / 2 > 0 ? o.ctas / 2 : 1, o.ctas, 2 * o.ctas}) {
    double mean[2], worst[2];
    for (int beside = 0; beside < 2; beside++) {
      for (int r = 0; r < 3; r++) {
        if (beside)
          store_loop<<<o.ctas, THREADS, 0, bg>>>((uint4 *)sink, LL_BLOCK / 16, 400);
        chase<<<n, 32, 0, s>>>((const uint64_t *)host, POOL / 8 / (size_t)n, 1, ns);
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaStreamSynchronize(bg));
      }
      double sum = 0, mx = 0;
      for (int c = 0; c < n; c++) {
        sum += (double)ns[c];
        mx = std::max(mx, (double)ns[c]);
      }
      mean[beside] = sum / n / LOADS / 1e3;
      worst[beside] = mx / LOADS / 1e3;
    }
    printf("%6d %14.2f %14.2f %14.2f %14.2f\n", n, mean[0], worst[0], mean[1], worst[1]);
  }
}

int main(int argc, char **argv) {
  opts o;
  int rc = parse(argc, argv, &o);
  if (rc != 0)
    return rc;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    fprintf(stderr, "hostbus: no CUDA device here (%s): run it on a machine with a GPU\n",
            e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 1;
  }
  cudaDeviceProp prop;
  int dev;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaGetDeviceProperties(&prop, dev));
  void *host = host_pool(o.host_alloc);
  void *sink; /* the sender's traffic goes elsewhere than the polled words */
  CHECK(cudaHostAlloc(&sink, LL_BLOCK, cudaHostAllocPortable | cudaHostAllocMapped));
  void *d0, *d1;
  CHECK(cudaMalloc(&d0, POOL));
  CHECK(cudaMalloc(&d1, POOL));
  CHECK(cudaMemset(d0, 1, POOL));
  long long *ns;
  CHECK(cudaMallocManaged(&ns, 2048 * sizeof *ns));
  cudaStream_t s, bg;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&bg, cudaStreamNonBlocking));
  printf("# hostbus: %s, host memory %s, %d CTAs x %d threads, medians of %d runs\n", prop.name,
         o.host_alloc ? "cudaHostAlloc" : "cudaHostRegister", o.ctas, THREADS, o.reps);
  copies(o, host, d0, d1, s);
  strides(host, ns, s);
  polls(o, host, sink, ns, s, bg);
  return 0;
}
