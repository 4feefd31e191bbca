/*
 * vmm_map.c — where attach time goes on the cuda backend: N processes on
 * one GPU each import and map memory another process exported, released
 * together, timed per phase (import, reserve, map, set access).  Two
 * layouts of the same bytes: `slabs` (N allocations of S bytes, every
 * process maps all N: what deepepd lends today with one chunk per slab) and
 * `arena` (one allocation of N*S bytes, every process maps it once).
 *
 *   vmm_map [-n 8] [-s SLAB_MIB] [-i ROUNDS]
 *
 * The exporting process is the parent; it makes the allocations before the
 * children start (as the daemon's pool does).  Children set up their CUDA
 * context before the clock starts.  Prints the median over rounds of the
 * slowest process, per layout and phase.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "cudadrv.h"
#include "fdpass.h"

#define MAXN 8
#define MAXR 50

static void check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "vmm_map: %s: %s\n", what, cudadrv_errstr(r));
    exit(1);
  }
}

/* Load the driver and make GPU 0's primary context current in this process. */
static const struct cudadrv *gpu0(CUdevice *d) {
  char why[256];
  const struct cudadrv *cu = cudadrv_load(why, sizeof why);
  if (cu == NULL) {
    fprintf(stderr, "vmm_map: %s\n", why);
    exit(1);
  }
  CUcontext ctx;
  check(cu->cuDeviceGet(d, 0), "cuDeviceGet");
  check(cu->cuDevicePrimaryCtxRetain(&ctx, *d), "cuDevicePrimaryCtxRetain");
  check(cu->cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return cu;
}

/* One child: receive the fds, wait for go, import+map each, report 4 phase times. */
static void child(int sock, int nalloc, size_t bytes, int rounds) {
  CUdevice d;
  const struct cudadrv *cu = gpu0(&d);
  for (int r = 0; r < rounds; r++) {
    int fds[MAXN], nf = 0;
    char go;
    if (fdpass_recv(sock, &go, 1, fds, MAXN, &nf) != 1 || nf != nalloc)
      exit(1);
    double t[5] = {0};
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
    t[0] = t1 - t0, t[1] = t2 - t1, t[2] = t3 - t2, t[3] = t4 - t3, t[4] = t4;
    if (write(sock, t, sizeof t) != sizeof t)
      exit(1);
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
  for (int i = 0; i < nalloc; i++) {
    check(cu->cuMemCreate(&h[i], bytes, &p, 0), "create");
    check(cu->cuMemExportToShareableHandle(&fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                           0), "export");
  }
  sleep(2); /* every child has its context */
  double worst[5][MAXR];
  for (int r = 0; r < rounds; r++) {
    double t0 = bench_now_ms();
    for (int c = 0; c < n; c++)
      fdpass_send(socks[c], "g", 1, fds, nalloc);
    double w[5] = {0};
    for (int c = 0; c < n; c++) {
      double t[5];
      if (read(socks[c], t, sizeof t) != sizeof t)
        exit(1);
      for (int k = 0; k < 4; k++)
        if (t[k] > w[k])
          w[k] = t[k];
      if (t[4] - t0 > w[4])
        w[4] = t[4] - t0;
    }
    for (int k = 0; k < 5; k++)
      worst[k][r] = w[k];
    struct timespec pause = {0, 20000000};
    nanosleep(&pause, NULL);
  }
  for (int c = 0; c < n; c++) {
    waitpid(pids[c], NULL, 0);
    close(socks[c]);
  }
  for (int k = 0; k < 5; k++)
    bench_sort(worst[k], (size_t)rounds);
  int m = rounds / 2;
  printf("%-6s %5d %6d %10zu %10.3f %10.3f %10.3f %10.3f %10.3f\n", name, n, nalloc, bytes >> 20,
         worst[0][m], worst[1][m], worst[2][m], worst[3][m], worst[4][m]);
  for (int i = 0; i < nalloc; i++) {
    close(fds[i]);
    cu->cuMemRelease(h[i]);
  }
}

int main(int argc, char **argv) {
  int n = 8, rounds = 20;
  size_t slab_mib = 902;
  int o;
  while ((o = getopt(argc, argv, "n:s:i:")) != -1) {
    if (o == 'n')
      n = atoi(optarg);
    else if (o == 's')
      slab_mib = (size_t)atoi(optarg);
    else if (o == 'i')
      rounds = atoi(optarg);
    else {
      fprintf(stderr, "usage: vmm_map [-n 8] [-s SLAB_MIB] [-i ROUNDS]\n");
      return 2;
    }
  }
  if (n < 1 || n > MAXN || rounds < 1 || rounds > MAXR)
    return 2;
  /* Fork the children before this process touches CUDA. */
  size_t slab = (slab_mib << 20) / (2u << 20) * (2u << 20);
  printf("# median over %d rounds of the slowest of N processes, ms\n", rounds);
  printf("%-6s %5s %6s %10s %10s %10s %10s %10s %10s\n", "layout", "procs", "allocs", "MiB_each",
         "import", "reserve", "map", "access", "total");
  for (int k = 1; k <= n; k *= 2) {
    fflush(stdout);
    pid_t p = fork();
    if (p == 0) {
      struct procs slabs, arena;
      spawn(&slabs, k, k, slab, rounds);
      spawn(&arena, k, 1, slab * (size_t)k, rounds);
      CUdevice d;
      const struct cudadrv *cu = gpu0(&d);
      run(cu, &slabs, k, slab, rounds, "slabs");
      run(cu, &arena, 1, slab * (size_t)k, rounds, "arena");
      fflush(stdout);
      exit(0);
    }
    waitpid(p, NULL, 0);
  }
  return 0;
}
