/*
 * vmm_map.c — where attach time goes on the cuda backend: N processes on
 * one GPU each import and map memory another process exported, released
 * together, timed per phase (import, reserve, map, set access).  Two
 * layouts of the same bytes: `slabs` (N allocations of S bytes, every
 * process maps all N: what deepepd lends today with one chunk per slab) and
 * `arena` (one allocation of N*S bytes, every process maps it once).
 *
 *   vmm_map [-n 8] [-s SLAB_MIB] [-i ROUNDS] [-m]
 *   vmm_map -q
 *   vmm_map -H [-n 8] [-i ROUNDS]
 *   vmm_map -g GPUS [-s ARENA_MIB] [-c CHUNK_MIB] [-a ALIGN_MIB] [-w] [-i ROUNDS]
 *
 * With -g, the cross-device case (issue 5, one rank per GPU): one
 * allocation of S bytes on each of G GPUs (deepepd's arena per device),
 * G processes, process g on GPU g, each imports and maps all G with access
 * for its own GPU.  Phases are split into the own GPU's arena (`local`)
 * and the G-1 peers' (`remote`), and the same work is then done with one
 * thread per arena (`threads`), to see whether the driver maps peers'
 * memory in parallel.  -c makes each arena of allocations of that size
 * (one reservation still), to find the size the driver maps peers' memory
 * fastest in.  -a aligns the address each arena is mapped at (0:
 * the driver's choice), to see whether the driver maps aligned memory
 * with larger pages.
 *
 * -m: each process then loads the library's embedded kernels
 * (cuModuleLoadData, as dep_attach does), a phase of its own: with the map,
 * the least any attach that brings its own kernels can cost.
 *
 * -H: a host-visible page for each process (the library's error record)
 * two ways, in alternate rounds: `lent`, importing one granule of host
 * memory the parent made (cuMemCreate on the GPU's host NUMA node), mapped
 * for the GPU and the CPU, then a CPU store and load; `pinned`, what the
 * library does today, cuMemHostRegister of a page of its own and
 * cuMemHostGetDevicePointer.  After the clock each lent mapping is checked
 * to be one memory for both (the GPU sets a word, the CPU reads it).
 *
 * -q: does this driver map part of an allocation (granule 2 of 2)?  If it
 * did, a rank could map only what its kernels touch of its peers' slabs.
 *
 * The exporting process is the parent; it makes the allocations before the
 * children start (as the daemon's pool does).  Children set up their CUDA
 * context before the clock starts.  Prints the median over rounds of the
 * slowest process, per layout and phase.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "cudadrv.h"
#include "fdpass.h"

#define MAXN 8
#define MAXR 50

#ifdef DEP_HAVE_FATBIN
extern const unsigned char dep__fatbin[];
#endif
static int load_module; /* -m */
static int host_numa = -1; /* -H, in the parent: the host NUMA node the lent page lives on */

static void check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "vmm_map: %s: %s\n", what, cudadrv_errstr(r));
    exit(1);
  }
}

/* Load the driver and make GPU ord's primary context current in this process. */
static const struct cudadrv *gpu(int ord, CUdevice *d) {
  char why[256];
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    fprintf(stderr, "vmm_map: %s\n", why);
    exit(1);
  }
  CUcontext ctx;
  check(cu->cuDeviceGet(d, ord), "cuDeviceGet");
  check(cu->cuDevicePrimaryCtxRetain(&ctx, *d), "cuDevicePrimaryCtxRetain");
  check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return cu;
}

/*
 * -H, one round of one process: 'L' maps the lent host granule (fd) for
 * this GPU and the CPU and touches it from the CPU; 'P' pins a page of its
 * own.  t[0..3]: the phases the header names; t[5]: the end on the clock.
 */
static void host_round(const struct cudadrv *cu, CUdevice d, char how, int fd, size_t bytes,
                       double t[6]) {
  double t0 = bench_now_ms();
  if (how == 'P') {
    long page = sysconf(_SC_PAGESIZE);
    void *p = mmap(NULL, (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      exit(1);
    check(cu->cuMemHostRegister(p, (size_t)page, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP), "cuMemHostRegister");
    double t1 = bench_now_ms();
    CUdeviceptr dp;
    check(cu->cuMemHostGetDevicePointer(&dp, p, 0), "cuMemHostGetDevicePointer");
    double t2 = bench_now_ms();
    t[0] = t1 - t0, t[1] = t2 - t1, t[5] = t2;
    check(cu->cuMemHostUnregister(p), "cuMemHostUnregister");
    munmap(p, (size_t)page);
    return;
  }
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  check(cu->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import");
  double t1 = bench_now_ms();
  check(cu->cuMemAddressReserve(&va, bytes, 0, 0, 0), "reserve");
  check(cu->cuMemMap(va, bytes, 0, h, 0), "map");
  double t2 = bench_now_ms();
  CUmemAccessDesc acc[2] = {{.location = {CU_MEM_LOCATION_TYPE_DEVICE, d},
                             .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE},
                            {.location = {CU_MEM_LOCATION_TYPE_HOST_NUMA, 0}, /* id ignored */
                             .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE}};
  check(cu->cuMemSetAccess(va, bytes, acc, 2), "set access (GPU and CPU)");
  double t3 = bench_now_ms();
  volatile uint32_t *w = (volatile uint32_t *)(uintptr_t)va;
  w[0] = 1u;
  if (w[0] != 1u)
    exit(1);
  double t4 = bench_now_ms();
  t[0] = t1 - t0, t[1] = t2 - t1, t[2] = t3 - t2, t[3] = t4 - t3, t[5] = t4;
  /* Outside the clock: one memory for both sides. */
  check(cu->cuMemsetD32Async(va + 64, 0xabcd1234u, 1, NULL), "cuMemsetD32Async");
  check(cu->cuCtxSynchronize(), "cuCtxSynchronize");
  if (w[16] != 0xabcd1234u) {
    fprintf(stderr, "vmm_map: -H: the CPU reads %#x where the GPU wrote 0xabcd1234\n", w[16]);
    exit(1);
  }
  check(cu->cuMemUnmap(va, bytes), "unmap");
  check(cu->cuMemAddressFree(va, bytes), "address free");
  check(cu->cuMemRelease(h), "release");
}

/* One child: receive the fds, wait for go, import+map each, report 4 phase times. */
static void child(int sock, int nalloc, size_t bytes, int rounds) {
  CUdevice d;
  const struct cudadrv *cu = gpu(0, &d);
  for (int r = 0; r < rounds; r++) {
    int fds[MAXN], nf = 0;
    char go;
    if (fdpass_recv(sock, &go, 1, fds, MAXN, &nf) != 1 || nf != nalloc)
      exit(1);
    if (go == 'L' || go == 'P') {
      double t[6] = {0};
      host_round(cu, d, go, fds[0], bytes, t);
      close(fds[0]);
      if (write(sock, t, sizeof t) != sizeof t)
        exit(1);
      continue;
    }
    double t[6] = {0};
    CUmemGenericAllocationHandle h[MAXN];
    CUdeviceptr va[MAXN];
    double t0 = bench_now_ms();
    for (int i = 0; i < nalloc; i++)
      check(cu->cuMemImportFromShareableHandle(&h[i], (void *)(intptr_t)fds[i],
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import");
    double t1 = bench_now_ms();
    for (int i = 0; i < nalloc; i++)
      check(cu->cuMemAddressReserve(&va[i], bytes, 0, 0, 0), "reserve");
    double t2 = bench_now_ms();
    for (int i = 0; i < nalloc; i++)
      check(cu->cuMemMap(va[i], bytes, 0, h[i], 0), "map");
    double t3 = bench_now_ms();
    CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, d},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    for (int i = 0; i < nalloc; i++)
      check(cu->cuMemSetAccess(va[i], bytes, &acc, 1), "access");
    double t4 = bench_now_ms();
    CUmodule mod = NULL;
#ifdef DEP_HAVE_FATBIN
    if (load_module)
      check(cu->cuModuleLoadData(&mod, dep__fatbin), "cuModuleLoadData");
#endif
    double t5 = bench_now_ms();
    t[0] = t1 - t0, t[1] = t2 - t1, t[2] = t3 - t2, t[3] = t4 - t3, t[4] = t5 - t4, t[5] = t5;
    if (write(sock, t, sizeof t) != sizeof t)
      exit(1);
    if (mod != NULL)
      cu->cuModuleUnload(mod);
    for (int i = 0; i < nalloc; i++) {
      cu->cuMemUnmap(va[i], bytes);
      cu->cuMemAddressFree(va[i], bytes);
      cu->cuMemRelease(h[i]);
      close(fds[i]);
    }
  }
  exit(0);
}

struct procs {
  int n;
  int socks[MAXN];
  pid_t pids[MAXN];
};

/* Fork the importing processes while this process has not touched CUDA. */
static void spawn(struct procs *ps, int n, int nalloc, size_t bytes, int rounds) {
  ps->n = n;
  fflush(stdout);
  for (int c = 0; c < n; c++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
      exit(1);
    ps->pids[c] = fork();
    if (ps->pids[c] == 0) {
      close(sv[0]);
      child(sv[1], nalloc, bytes, rounds);
    }
    close(sv[1]);
    ps->socks[c] = sv[0];
  }
}

/* -H: the medians of the even (lent) and the odd (pinned) rounds, a row each. */
static void host_rows(double worst[6][MAXR], int rounds, int n) {
  for (int way = 0; way < 2; way++) {
    double v[6][MAXR];
    int k = 0;
    for (int r = way; r < rounds; r += 2, k++)
      for (int j = 0; j < 6; j++)
        v[j][k] = worst[j][r];
    for (int j = 0; j < 6; j++)
      bench_sort(v[j], (size_t)k);
    printf("%-6s %5d %10.3f %10.3f %10.3f %10.3f %10.3f\n", way == 0 ? "lent" : "pinned", n,
           v[0][k / 2], v[1][k / 2], v[2][k / 2], v[3][k / 2], v[5][k / 2]);
  }
}

static void run(const struct cudadrv *cu, const struct procs *ps, int nalloc, size_t bytes,
                int rounds, const char *name) {
  int n = ps->n;
  const int *socks = ps->socks;
  const pid_t *pids = ps->pids;
  CUmemGenericAllocationHandle h[MAXN];
  int fds[MAXN];
  CUmemAllocationProp p = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                           .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                           .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
  if (host_numa >= 0)
    p.location = (CUmemLocation){CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa};
  for (int i = 0; i < nalloc; i++) {
    check(cu->cuMemCreate(&h[i], bytes, &p, 0), "create");
    check(cu->cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                           0), "export");
  }
  sleep(2); /* every child has its context */
  double worst[6][MAXR];
  for (int r = 0; r < rounds; r++) {
    double t0 = bench_now_ms();
    /* -H: the two ways in alternate rounds, every process the same way. */
    const char *go = host_numa < 0 ? "g" : r % 2 == 0 ? "L" : "P";
    for (int c = 0; c < n; c++)
      fdpass_send(socks[c], go, 1, fds, nalloc);
    double w[6] = {0};
    for (int c = 0; c < n; c++) {
      double t[6];
      if (read(socks[c], t, sizeof t) != sizeof t)
        exit(1);
      for (int k = 0; k < 5; k++)
        if (t[k] > w[k])
          w[k] = t[k];
      if (t[5] - t0 > w[5])
        w[5] = t[5] - t0;
    }
    for (int k = 0; k < 6; k++)
      worst[k][r] = w[k];
    struct timespec pause = {0, 20000000};
    nanosleep(&pause, NULL);
  }
  for (int c = 0; c < n; c++) {
    waitpid(pids[c], NULL, 0);
    close(socks[c]);
  }
  if (host_numa >= 0) {
    host_rows(worst, rounds, n);
    close(fds[0]);
    cu->cuMemRelease(h[0]);
    return;
  }
  for (int k = 0; k < 6; k++)
    bench_sort(worst[k], (size_t)rounds);
  int m = rounds / 2;
  printf("%-6s %5d %6d %10zu %10.3f %10.3f %10.3f %10.3f", name, n, nalloc, bytes >> 20,
         worst[0][m], worst[1][m], worst[2][m], worst[3][m]);
  if (load_module)
    printf(" %10.3f", worst[4][m]);
  printf(" %10.3f\n", worst[5][m]);
  for (int i = 0; i < nalloc; i++) {
    close(fds[i]);
    cu->cuMemRelease(h[i]);
  }
}

/* ---- -g: one arena per GPU, one process per GPU ------------------------- */

/* Phase times of one process: [0] local arena, all phases; [1..4] the peers'
 * arenas: import, reserve, map, access; [5] total; [6] end on the clock. */
#define XT 7
#define MAXC 16 /* allocations per GPU's arena */

struct xmap {
  const struct cudadrv *cu;
  CUcontext ctx;
  CUdevice dev;
  int nc;              /* allocations making this GPU's arena */
  const int *fds;      /* nc of them */
  size_t chunk, align; /* bytes of each allocation; alignment of the arena's address */
  CUmemGenericAllocationHandle h[MAXC];
  CUdeviceptr va;
  double t[4];
};

static void xmap_one(struct xmap *x) {
  const struct cudadrv *cu = x->cu;
  size_t bytes = x->chunk * (size_t)x->nc;
  double t0 = bench_now_ms();
  for (int c = 0; c < x->nc; c++)
    check(cu->cuMemImportFromShareableHandle(&x->h[c], (void *)(intptr_t)x->fds[c],
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import");
  double t1 = bench_now_ms();
  check(cu->cuMemAddressReserve(&x->va, bytes, x->align, 0, 0), "reserve");
  double t2 = bench_now_ms();
  for (int c = 0; c < x->nc; c++)
    check(cu->cuMemMap(x->va + (size_t)c * x->chunk, x->chunk, 0, x->h[c], 0), "map");
  double t3 = bench_now_ms();
  CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, x->dev},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  check(cu->cuMemSetAccess(x->va, bytes, &acc, 1), "access");
  double t4 = bench_now_ms();
  x->t[0] = t1 - t0, x->t[1] = t2 - t1, x->t[2] = t3 - t2, x->t[3] = t4 - t3;
}

static void *xmap_thread(void *arg) {
  struct xmap *x = arg;
  check(x->cu->cuCtxSetCurrent(x->ctx), "cuCtxSetCurrent");
  xmap_one(x);
  return NULL;
}

static void xunmap(struct xmap *x) {
  for (int c = 0; c < x->nc; c++) {
    x->cu->cuMemUnmap(x->va + (size_t)c * x->chunk, x->chunk);
    x->cu->cuMemRelease(x->h[c]);
    close(x->fds[c]);
  }
  x->cu->cuMemAddressFree(x->va, x->chunk * (size_t)x->nc);
}

/* Process ord of g: per round, the arenas one after another, then one
 * thread each. */
/* -w: before the clock, map a 2 MiB allocation of its own on every other
 * GPU and keep it, to see whether what the driver charges is per peer GPU
 * (set up once per process) rather than per byte or allocation. */
static int peer_warm;

static void warm_peers(const struct cudadrv *cu, CUdevice d, int ord, int g) {
  for (int q = 0; q < g; q++) {
    if (q == ord)
      continue;
    CUmemAllocationProp p = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                             .location = {CU_MEM_LOCATION_TYPE_DEVICE, q}};
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, d},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    check(cu->cuMemCreate(&h, 2u << 20, &p, 0), "warm create");
    check(cu->cuMemAddressReserve(&va, 2u << 20, 0, 0, 0), "warm reserve");
    check(cu->cuMemMap(va, 2u << 20, 0, h, 0), "warm map");
    check(cu->cuMemSetAccess(va, 2u << 20, &acc, 1), "warm access");
  }
}

static void xchild(int sock, int ord, int g, int nc, size_t chunk, size_t align, int rounds) {
  static struct xmap x[MAXN];
  CUdevice d;
  const struct cudadrv *cu = gpu(ord, &d);
  CUcontext ctx;
  check(cu->cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (peer_warm)
    warm_peers(cu, d, ord, g);
  for (int r = 0; r < 2 * rounds; r++) {
    int fds[MAXN * MAXC], nf = 0;
    char go;
    if (fdpass_recv(sock, &go, 1, fds, MAXN * MAXC, &nf) != 1 || nf != g * nc)
      exit(1);
    double t[XT] = {0};
    double t0 = bench_now_ms();
    for (int i = 0; i < g; i++)
      x[i] = (struct xmap){.cu = cu, .ctx = ctx, .dev = d, .nc = nc, .fds = fds + i * nc,
                           .chunk = chunk, .align = align};
    if (go == 's') {
      for (int i = 0; i < g; i++)
        xmap_one(&x[i]);
    } else {
      pthread_t th[MAXN];
      for (int i = 0; i < g; i++)
        if (pthread_create(&th[i], NULL, xmap_thread, &x[i]) != 0)
          exit(1);
      for (int i = 0; i < g; i++)
        pthread_join(th[i], NULL);
    }
    t[6] = bench_now_ms();
    t[5] = t[6] - t0;
    for (int i = 0; i < g; i++)
      for (int k = 0; k < 4; k++) {
        if (i == ord)
          t[0] += x[i].t[k];
        else
          t[1 + k] += x[i].t[k];
      }
    if (write(sock, t, sizeof t) != sizeof t)
      exit(1);
    for (int i = 0; i < g; i++)
      xunmap(&x[i]);
  }
  exit(0);
}

static void xrun(int g, int nc, size_t chunk, size_t align, int rounds) {
  struct procs ps = {.n = g};
  fflush(stdout);
  for (int c = 0; c < g; c++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
      exit(1);
    ps.pids[c] = fork();
    if (ps.pids[c] == 0) {
      close(sv[0]);
      xchild(sv[1], c, g, nc, chunk, align, rounds);
    }
    close(sv[1]);
    ps.socks[c] = sv[0];
  }
  CUdevice d;
  const struct cudadrv *cu = gpu(0, &d);
  CUmemGenericAllocationHandle h[MAXN * MAXC];
  int fds[MAXN * MAXC];
  for (int i = 0; i < g * nc; i++) {
    CUmemAllocationProp p = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                             .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                             .location = {CU_MEM_LOCATION_TYPE_DEVICE, i / nc}};
    check(cu->cuMemCreate(&h[i], chunk, &p, 0), "create");
    check(cu->cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                           0), "export");
  }
  sleep(2); /* every child has its context */
  static double worst[2][XT][MAXR];
  for (int r = 0; r < 2 * rounds; r++) {
    int v = r & 1; /* 0: one after another, 1: threads */
    double t0 = bench_now_ms();
    for (int c = 0; c < g; c++)
      fdpass_send(ps.socks[c], v ? "t" : "s", 1, fds, g * nc);
    double w[XT] = {0};
    for (int c = 0; c < g; c++) {
      double t[XT];
      if (read(ps.socks[c], t, sizeof t) != sizeof t)
        exit(1);
      t[6] -= t0;
      for (int k = 0; k < XT; k++)
        if (t[k] > w[k])
          w[k] = t[k];
    }
    for (int k = 0; k < XT; k++)
      worst[v][k][r / 2] = w[k];
    struct timespec pause = {0, 20000000};
    nanosleep(&pause, NULL);
  }
  for (int c = 0; c < g; c++) {
    waitpid(ps.pids[c], NULL, 0);
    close(ps.socks[c]);
  }
  for (int v = 0; v < 2; v++) {
    for (int k = 0; k < XT; k++)
      bench_sort(worst[v][k], (size_t)rounds);
    int m = rounds / 2;
    printf("%-8s %5d %10zu %8zu %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f\n",
           v ? "threads" : "serial", g, (chunk * (size_t)nc) >> 20, chunk >> 20, worst[v][0][m],
           worst[v][1][m], worst[v][2][m], worst[v][3][m], worst[v][4][m], worst[v][5][m],
           worst[v][6][m]);
  }
  for (int i = 0; i < g * nc; i++) {
    close(fds[i]);
    cu->cuMemRelease(h[i]);
  }
}

/* -H: n processes at once, for 1, 2, 4 ... n; see the top of the file. */
static int host_pages(int n, int rounds) {
  printf("# median over %d rounds (each way in half of them) of the slowest of N processes, ms\n"
         "# lent: a import, b reserve + map, c set access (GPU and CPU), d first CPU store + load\n"
         "# pinned: a cuMemHostRegister of a page, b cuMemHostGetDevicePointer\n", rounds);
  printf("%-6s %5s %10s %10s %10s %10s %10s\n", "how", "procs", "a", "b", "c", "d", "total");
  for (int k = 1; k <= n; k *= 2) {
    fflush(stdout);
    pid_t p = fork();
    if (p == 0) {
      struct procs ps;
      size_t bytes = 2u << 20; /* the host granule, checked against the driver's below */
      spawn(&ps, k, 1, bytes, rounds); /* before this process touches CUDA */
      CUdevice d;
      const struct cudadrv *cu = gpu(0, &d);
      /* Only the allocation names the node: an access for the host ignores it. */
      if (cu->cuDeviceGetAttribute(&host_numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, d) !=
              CUDA_SUCCESS || host_numa < 0)
        host_numa = 0; /* "on systems where NUMA is not available ... id must be set to 0" */
      CUmemAllocationProp pr = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                .location = {CU_MEM_LOCATION_TYPE_HOST_NUMA, host_numa}};
      size_t g = 0;
      check(cu->cuMemGetAllocationGranularity(&g, &pr, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "granularity (host NUMA)");
      if (k == 1)
        printf("# host NUMA node %d, granularity %zu KiB\n", host_numa, g >> 10);
      if (bytes % g != 0) {
        fprintf(stderr, "vmm_map: -H: host granularity %zu does not divide 2 MiB\n", g);
        exit(1);
      }
      run(cu, &ps, 1, bytes, rounds, "lent");
      fflush(stdout);
      exit(0);
    }
    int st = 0;
    if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
      return 1;
  }
  return 0;
}

/* -q: map the second granule of a two-granule allocation, alone. */
static int partial_map_probe(void) {
  CUdevice d;
  const struct cudadrv *cu = gpu(0, &d);
  CUmemAllocationProp p = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                           .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                           .location = {CU_MEM_LOCATION_TYPE_DEVICE, d}};
  size_t g = 0;
  check(cu->cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "granularity");
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  check(cu->cuMemCreate(&h, 2 * g, &p, 0), "create");
  check(cu->cuMemAddressReserve(&va, 2 * g, 0, 0, 0), "reserve");
  int ver = 0;
  cu->cuDriverGetVersion(&ver);
  CUresult r = cu->cuMemMap(va + g, g, g, h, 0);
  printf("driver %d: cuMemMap of granule 2 of 2 (%zu KiB each): %s\n", ver, g >> 10,
         r == CUDA_SUCCESS ? "mapped" : cudadrv_errstr(r));
  if (r == CUDA_SUCCESS)
    cu->cuMemUnmap(va + g, g);
  cu->cuMemAddressFree(va, 2 * g);
  cu->cuMemRelease(h);
  return 0;
}

int main(int argc, char **argv) {
  int n = 8, rounds = 20, gpus = 0;
  size_t slab_mib = 902, align_mib = 0, chunk_mib = 0;
  int o;
  int probe = 0, host = 0;
  while ((o = getopt(argc, argv, "n:s:i:g:a:c:wmqH")) != -1) {
    if (o == 'n')
      n = atoi(optarg);
    else if (o == 'g')
      gpus = atoi(optarg);
    else if (o == 'a')
      align_mib = (size_t)atoi(optarg);
    else if (o == 'c')
      chunk_mib = (size_t)atoi(optarg);
    else if (o == 'w')
      peer_warm = 1;
    else if (o == 'm')
      load_module = 1;
    else if (o == 'q')
      probe = 1;
    else if (o == 'H')
      host = 1;
    else if (o == 's')
      slab_mib = (size_t)atoi(optarg);
    else if (o == 'i')
      rounds = atoi(optarg);
    else {
      fprintf(stderr, "usage: vmm_map [-n 8] [-s SLAB_MIB] [-i ROUNDS] [-m]\n"
                      "       vmm_map -q\n"
                      "       vmm_map -H [-n 8] [-i ROUNDS]\n"
                      "       vmm_map -g GPUS [-s ARENA_MIB] [-c CHUNK_MIB] [-a ALIGN_MIB] [-w] "
                      "[-i ROUNDS]\n");
      return 2;
    }
  }
  if (n < 1 || n > MAXN || rounds < 1 || rounds > MAXR || gpus < 0 || gpus > MAXN)
    return 2;
  if (probe)
    return partial_map_probe();
  if (host)
    return host_pages(n, rounds);
#ifndef DEP_HAVE_FATBIN
  if (load_module) {
    fprintf(stderr, "vmm_map: -m needs the kernels, and this build has none (no nvcc)\n");
    return 2;
  }
#endif
  /* Fork the children before this process touches CUDA. */
  size_t slab = (slab_mib << 20) / (2u << 20) * (2u << 20);
  if (gpus > 0) {
    /* The arena as nc allocations of chunk bytes (2 MiB granules), nc <= MAXC. */
    size_t chunk = chunk_mib == 0 || chunk_mib >= slab_mib ? slab : (chunk_mib << 20);
    chunk = (chunk + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    int nc = (int)((slab + chunk - 1) / chunk);
    if (nc > MAXC) {
      fprintf(stderr, "vmm_map: at most %d allocations per arena\n", MAXC);
      return 2;
    }
    slab = chunk * (size_t)nc;
    printf("# one %zu MiB arena per GPU of %d allocations, process g on GPU g maps all at a %zu "
           "MiB aligned address%s; median over %d rounds of the slowest process, ms\n",
           slab >> 20, nc, align_mib,
           peer_warm ? ", every other GPU mapped once before the clock (-w)" : "", rounds);
    printf("%-8s %5s %10s %8s %10s %10s %10s %10s %10s %10s %10s\n", "how", "gpus", "MiB_each",
           "chunkMiB", "local", "r_import", "r_reserve", "r_map", "r_access", "total", "end");
    for (int k = 2; k <= gpus; k *= 2) {
      fflush(stdout);
      pid_t p = fork();
      if (p == 0) {
        xrun(k, nc, chunk, align_mib << 20, rounds);
        fflush(stdout);
        exit(0);
      }
      waitpid(p, NULL, 0);
    }
    return 0;
  }
  printf("# median over %d rounds of the slowest of N processes, ms\n", rounds);
  printf("%-6s %5s %6s %10s %10s %10s %10s %10s", "layout", "procs", "allocs", "MiB_each",
         "import", "reserve", "map", "access");
  if (load_module)
    printf(" %10s", "module");
  printf(" %10s\n", "total");
  for (int k = 1; k <= n; k *= 2) {
    fflush(stdout);
    pid_t p = fork();
    if (p == 0) {
      struct procs slabs, arena;
      spawn(&slabs, k, k, slab, rounds);
      spawn(&arena, k, 1, slab * (size_t)k, rounds);
      CUdevice d;
      const struct cudadrv *cu = gpu(0, &d);
      run(cu, &slabs, k, slab, rounds, "slabs");
      run(cu, &arena, 1, slab * (size_t)k, rounds, "arena");
      fflush(stdout);
      exit(0);
    }
    waitpid(p, NULL, 0);
  }
  return 0;
}
