/*
 * attach.c — attach-to-ready: how long N local rank processes take from
 * connect to "every local slab mapped, library ready" through deepepd,
 * beside the cold path the daemon removes: the same ranks making their own
 * memory (allocate, export, exchange over a Unix-socket rendezvous, import,
 * map), measured in the same run.
 *
 *   attach -s SOCKET [-n 1,2,4,8] [-i 20] [-p PAUSE_MS] [-d STAGGER_MS] [-g GPUS]
 *          [-t TOKENS] [-H HIDDEN] [-k TOPK] [-e EXPERTS]
 *
 * Rounds are PAUSE_MS apart (default 50): the daemon scrubs a finished
 * job's slabs between jobs, and restarts are not back to back.
 *
 * The backend is the daemon's (cuda or host).  Each rank process sets up
 * its CUDA context before the clock starts, in both paths: a trainer has
 * one already.  With -g N the ranks spread over N GPUs (rank r on GPU
 * r % N; -g 0: every visible GPU); in the cold path each rank makes its
 * memory on its own GPU and gives its own GPU access to its peers'.  A
 * round starts when the parent releases every rank at once (with -d, when
 * it releases the last of them, D ms apart: a restarted job's processes
 * do not start together); it ends when the last rank is ready.  Prints one table row per rank count: the first
 * warm round (the daemon's first job of that shape), median and worst of
 * the rounds, for warm and cold, the ratio, and where the slowest warm
 * rank's time went (with -d, the last one released's; dep_attach_times:
 * wait, map, setup, warmup; medians).  A rank is ready when dep_attach
 * returns; the host backend's warm-up runs after that, until the first
 * call (client/warm.h), so its column is not part of the ready time there.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "cudadrv.h"
#include "deepep.h"
#include "fdpass.h"
#include "slab.h"

#define MAX_RANKS 8
#define MAX_ROUNDS 200

struct opts {
  const char *sock;
  int counts[8], ncounts;
  int rounds;
  int pause_ms;
  int stagger_ms; /* rank r released r * stagger_ms after rank 0 */
  int gpus; /* ranks spread over this many GPUs: rank r on GPU r % gpus */
  struct dep_job_shape shape;
};

static void die(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "attach: ");
  fprintf(stderr, fmt, a, b);
  fputc('\n', stderr);
  exit(1);
}

/* ---- the rank's device (cuda) -------------------------------------------- */

/* Each rank is a process of its own: these are that rank's. */
static const struct cudadrv *cu;
static uint8_t gpu_uuid[16];
static int gpu_dev;

/* This rank's GPU (r % gpus), its primary context current. */
static void rank_cuda_setup(int rank, int gpus) {
  char why[256];
  cu = cudadrv_load(why, sizeof why);
  if (cu == NULL)
    die("%s%s", why, "");
  int ordinal = bench_gpu_of_rank(rank, gpus);
  CUdevice d;
  CUuuid u;
  CUcontext ctx;
  CUresult r = cu->cuDeviceGet(&d, ordinal);
  if (r == CUDA_SUCCESS)
    r = cu->cuDeviceGetUuid(&u, d);
  if (r == CUDA_SUCCESS)
    r = cu->cuDevicePrimaryCtxRetain(&ctx, d);
  if (r == CUDA_SUCCESS)
    r = cu->cuCtxSetCurrent(ctx);
  if (r != CUDA_SUCCESS) {
    char dev[32];
    snprintf(dev, sizeof dev, "%d", ordinal);
    die("cannot set up CUDA device %s: %s", dev, cudadrv_errstr(r));
  }
  memcpy(gpu_uuid, u.bytes, 16);
  gpu_dev = d;
}

/* ---- warm path: deepepd ---------------------------------------------------- */

/* What a warm rank reports besides its ready time: dep_attach_times' parts. */
#define PHASES 4
static const char *const phase_names[PHASES] = {"wait", "map", "setup", "warmup"};

static void warm_round(const struct opts *o, bool cuda, int n, int rank, int round) {
  dep_client_t *c;
  if (dep_client_new(&c) != 0)
    die("%s%s", "out of memory", "");
  struct dep_attach_args a = {.size = sizeof a, .rank = (uint32_t)rank, .world_size = (uint32_t)n,
                              .local_rank = (uint32_t)rank, .local_world_size = (uint32_t)n,
                              .shape = o->shape};
  snprintf(a.job_id, sizeof a.job_id, "bench-%d-%d-%d", (int)getppid(), n, round);
  if (cuda)
    memcpy(a.device_uuid, gpu_uuid, 16);
  int rc = dep_connect(c, o->sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0)
    die("warm attach failed: %s (%s)", dep_errmsg(c), dep_strerror(rc));
  /* Ready: every slab is mapped; touch each so a lazy mapping cannot hide. */
  struct dep_attach_info info = {.size = sizeof info};
  dep_attach_info(c, &info);
  for (int i = 0; i < n; i++)
    if (info.slabs[i] == NULL)
      die("%s%s", "a slab pointer is missing", "");
  /* Ready once dep_attach returned: the host warm-up runs on behind it until the
   * rank's first call (client/warm.h).  dep_attach_times finishes it to say how
   * long it took, so it is asked once every rank is ready (it would take the
   * CPU from the ranks still attaching). */
  const double ready = bench_now_ms();
  char go;
  if (write(STDOUT_FILENO, &ready, sizeof ready) != sizeof ready ||
      read(STDIN_FILENO, &go, 1) != 1) /* hold the job until every rank reported */
    exit(1);
  struct dep_attach_times tm = {.size = sizeof tm};
  if (dep_attach_times(c, &tm) != 0)
    die("%s%s", "dep_attach_times failed", "");
  double t[PHASES] = {tm.wait_ms, tm.map_ms, tm.setup_ms, tm.warmup_ms};
  if (write(STDOUT_FILENO, t, sizeof t) != sizeof t)
    exit(1);
  dep_detach(c);
  dep_client_free(c);
}

/* ---- cold path: each rank makes and exchanges its own memory -------------- */

struct cold_mem {
  int fd;
  void *host;
  unsigned long long handle;
};

static void cold_alloc(bool cuda, uint64_t bytes, struct cold_mem *m) {
  memset(m, 0, sizeof *m);
  if (!cuda) {
    m->fd = memfd_create("cold", MFD_CLOEXEC);
    if (m->fd < 0 || ftruncate(m->fd, (off_t)bytes) != 0)
      die("%s%s", "memfd", "");
    /* Populated, as the daemon's pools are: the same memory, made cold. */
    m->host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m->fd, 0);
    if (m->host == MAP_FAILED)
      die("%s%s", "mmap", "");
    return;
  }
  CUmemAllocationProp p = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                           .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                           .location = {CU_MEM_LOCATION_TYPE_DEVICE, gpu_dev}};
  if (cu->cuMemCreate(&m->handle, bytes, &p, 0) != 0 ||
      cu->cuMemExportToShareableHandle(&m->fd, m->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                       0) != 0)
    die("%s%s", "cuMemCreate/export", "");
}

/* Map a peer's exported memory (on the peer's GPU) into this process, for this rank's GPU. */
static void *cold_map(bool cuda, int fd, uint64_t bytes, unsigned long long *h_out,
                      CUdeviceptr *va_out) {
  if (!cuda) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      die("%s%s", "mmap peer", "");
    return p;
  }
  CUmemGenericAllocationHandle h;
  CUdeviceptr va;
  CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, gpu_dev},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (cu->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0 ||
      cu->cuMemAddressReserve(&va, bytes, 0, 0, 0) != 0 || cu->cuMemMap(va, bytes, 0, h, 0) != 0 ||
      cu->cuMemSetAccess(va, bytes, &acc, 1) != 0)
    die("%s%s", "import/map peer", "");
  *h_out = h;
  *va_out = va;
  return (void *)(uintptr_t)va;
}

/*
 * Rendezvous through a Unix socket: rank 0 listens, every other rank sends
 * its fd, rank 0 sends all n fds back to each.  The socket is bound before
 * the clock starts (it stands for the process group a trainer has).
 */
static void cold_round(bool cuda, uint64_t bytes, int n, int rank, const char *path, int lfd) {
  struct cold_mem mine;
  cold_alloc(cuda, bytes, &mine);
  int fds[MAX_RANKS];
  char b = 'x';
  int nf = 0;
  if (rank == 0) {
    int conns[MAX_RANKS];
    fds[0] = mine.fd;
    for (int i = 1; i < n; i++) {
      conns[i] = accept(lfd, NULL, NULL);
      int got[1], ng = 0;
      uint32_t who;
      if (conns[i] < 0 || fdpass_recv(conns[i], &who, sizeof who, got, 1, &ng) != sizeof who || ng != 1)
        die("%s%s", "rendezvous recv", "");
      fds[who] = got[0];
    }
    for (int i = 1; i < n; i++) {
      if (fdpass_send(conns[i], &b, 1, fds, n) != 1)
        die("%s%s", "rendezvous send", "");
      close(conns[i]);
    }
    nf = n;
  } else {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    while (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0)
      ;
    uint32_t who = (uint32_t)rank;
    if (fdpass_send(s, &who, sizeof who, &mine.fd, 1) != sizeof who ||
        fdpass_recv(s, &b, 1, fds, MAX_RANKS, &nf) != 1 || nf != n)
      die("%s%s", "rendezvous exchange", "");
    close(s);
  }
  void *ptrs[MAX_RANKS];
  unsigned long long handles[MAX_RANKS] = {0};
  CUdeviceptr vas[MAX_RANKS] = {0};
  for (int i = 0; i < n; i++)
    ptrs[i] = i == rank && !cuda ? mine.host : cold_map(cuda, fds[i], bytes, &handles[i], &vas[i]);
  double t = bench_now_ms();
  if (write(STDOUT_FILENO, &t, sizeof t) != sizeof t)
    exit(1);
  char go;
  if (read(STDIN_FILENO, &go, 1) != 1)
    exit(1);
  for (int i = 0; i < n; i++) {
    if (cuda) {
      cu->cuMemUnmap(vas[i], bytes);
      cu->cuMemAddressFree(vas[i], bytes);
      cu->cuMemRelease(handles[i]);
    } else if (ptrs[i] != mine.host) {
      munmap(ptrs[i], bytes);
    }
    if (fds[i] != mine.fd)
      close(fds[i]);
  }
  if (cuda)
    cu->cuMemRelease(mine.handle);
  else
    munmap(mine.host, bytes);
  close(mine.fd);
}

/* ---- driver ------------------------------------------------------------------ */

struct rank_proc {
  pid_t pid;
  int to, from; /* pipes: parent → rank stdin, rank stdout → parent */
};

/* Run `rounds` rounds of one path with n persistent rank processes. */
static void run_path(const struct opts *o, bool cuda, bool warm, int n, double *out,
                     double (*phases)[PHASES]) {
  struct dep_slab_layout l;
  char why[256];
  if (dep__slab_layout(&o->shape, (uint32_t)n, &l, why, sizeof why) != 0)
    die("%s%s", why, "");
  uint64_t bytes = dep_round_up(l.total_bytes, 2u << 20);
  char path[108];
  snprintf(path, sizeof path, "/tmp/dep-bench-%d.sock", (int)getpid());
  struct rank_proc rp[MAX_RANKS];
  for (int r = 0; r < n; r++) {
    int to[2], from[2];
    if (pipe(to) != 0 || pipe(from) != 0)
      die("%s%s", "pipe", "");
    rp[r].pid = fork();
    if (rp[r].pid == 0) {
      dup2(to[0], STDIN_FILENO);
      dup2(from[1], STDOUT_FILENO);
      close(to[1]);
      close(from[0]);
      if (cuda)
        rank_cuda_setup(r, o->gpus);
      for (int round = 0; round < o->rounds; round++) {
        char go;
        int lfd = -1;
        if (!warm && r == 0) {
          unlink(path);
          lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
          struct sockaddr_un sa = {.sun_family = AF_UNIX};
          snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
          if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, MAX_RANKS) != 0)
            die("%s%s", "bind rendezvous", "");
        }
        char ready = 'r';
        if (write(STDOUT_FILENO, &ready, 1) != 1 || read(STDIN_FILENO, &go, 1) != 1)
          _exit(1);
        if (warm)
          warm_round(o, cuda, n, r, round);
        else
          cold_round(cuda, bytes, n, r, path, lfd);
        if (lfd >= 0)
          close(lfd);
      }
      _exit(0);
    }
    close(to[0]);
    close(from[1]);
    rp[r].to = to[1];
    rp[r].from = from[0];
  }
  for (int round = 0; round < o->rounds; round++) {
    char c;
    for (int r = 0; r < n; r++)
      if (read(rp[r].from, &c, 1) != 1)
        die("%s%s", "a rank died before the round", "");
    /* Restarts are not back to back: let the daemon finish scrubbing the
     * last round's slabs, which it does between jobs. */
    struct timespec ps = {.tv_sec = o->pause_ms / 1000, .tv_nsec = (o->pause_ms % 1000) * 1000000L};
    nanosleep(&ps, NULL);
    /* The clock starts when the last rank is released: with -d the ranks
     * start apart, as a restarted job's processes do, and what the job
     * waits for is the time from its last rank's start to every rank
     * ready. */
    double t0 = bench_now_ms();
    for (int r = 0; r < n; r++) {
      if (r > 0 && o->stagger_ms > 0) {
        struct timespec ds = {.tv_sec = o->stagger_ms / 1000,
                              .tv_nsec = (o->stagger_ms % 1000) * 1000000L};
        nanosleep(&ds, NULL);
        t0 = bench_now_ms();
      }
      if (write(rp[r].to, "g", 1) != 1)
        die("%s%s", "release", "");
    }
    double last = t0;
    int slowest = n - 1;
    for (int r = 0; r < n; r++) {
      double t = 0;
      if (read(rp[r].from, &t, sizeof t) != (ssize_t)sizeof t)
        die("%s%s", "a rank died during the round", "");
      /* The phases of the slowest rank; with -d, of the last one released
       * (the others' wait holds the stagger). */
      if (o->stagger_ms == 0 && (t > last || r == 0))
        slowest = r;
      last = t > last ? t : last;
    }
    out[round] = last - t0;
    for (int r = 0; r < n; r++)
      if (write(rp[r].to, "d", 1) != 1)
        die("%s%s", "finish", "");
    for (int r = 0; warm && r < n; r++) {
      double t[PHASES];
      if (read(rp[r].from, t, sizeof t) != (ssize_t)sizeof t)
        die("%s%s", "a rank died after the round", "");
      if (r == slowest)
        memcpy(phases[round], t, sizeof phases[round]);
    }
  }
  for (int r = 0; r < n; r++) {
    int st;
    waitpid(rp[r].pid, &st, 0);
    close(rp[r].to);
    close(rp[r].from);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      die("%s%s", "a rank process failed", "");
  }
  unlink(path);
}

static void usage(void) {
  fprintf(stderr,
          "usage: attach -s SOCKET [-n 1,2,4,8] [-i ROUNDS] [-p PAUSE_MS] [-d STAGGER_MS] [-g GPUS]\n"
          "              [-t TOKENS]"
          " [-H HIDDEN] [-k TOPK] [-e EXPERTS]\n"
          "  -s  deepepd socket (its backend, host or cuda, is the one measured)\n"
          "  -n  rank counts (default 1,2,4,8)      -i  rounds per count (default 20)\n"
          "  -p  pause between rounds in ms (default 50)\n"
          "  -d  release rank r r*D ms after rank 0 (default 0: all at once); times then\n"
          "      run from the last rank's release\n"
          "  -g  spread the ranks over GPUS GPUs, rank r on GPU r %% GPUS (default 1: all on\n"
          "      GPU 0; 0: every visible GPU); cuda backend only\n"
          "  shape: -t 4096 tokens, -H 7168, -k 8, -e 256\n");
  exit(2);
}

int main(int argc, char **argv) {
  struct opts o = {.rounds = 20,
                   .pause_ms = 50,
                   .gpus = 1,
                   .shape = {.max_tokens_per_rank = 4096, .hidden = 7168, .num_experts = 256,
                             .topk = 8, .dtype = DEP_DTYPE_BF16}};
  const char *counts = "1,2,4,8";
  int opt;
  int gpus_want = 1;
  while ((opt = getopt(argc, argv, "s:n:i:p:d:g:t:H:k:e:h")) != -1) {
    switch (opt) {
    case 's': o.sock = optarg; break;
    case 'n': counts = optarg; break;
    case 'i': o.rounds = atoi(optarg); break;
    case 'p': o.pause_ms = atoi(optarg); break;
    case 'd': o.stagger_ms = atoi(optarg); break;
    case 'g': gpus_want = atoi(optarg); break;
    case 't': o.shape.max_tokens_per_rank = (uint32_t)atoi(optarg); break;
    case 'H': o.shape.hidden = (uint32_t)atoi(optarg); break;
    case 'k': o.shape.topk = (uint32_t)atoi(optarg); break;
    case 'e': o.shape.num_experts = (uint32_t)atoi(optarg); break;
    default: usage();
    }
  }
  if (o.sock == NULL || optind != argc || o.rounds < 1 || o.rounds > MAX_ROUNDS ||
      o.pause_ms < 0 || o.stagger_ms < 0 || gpus_want < 0)
    usage();
  for (char *s = strdup(counts), *tok = strtok(s, ","); tok != NULL && o.ncounts < 8;
       tok = strtok(NULL, ","))
    o.counts[o.ncounts++] = atoi(tok);
  /* Ask the daemon which backend it serves (no CUDA in this process: the
   * rank processes are forked from it). */
  dep_client_t *c;
  struct dep_status *st = NULL;
  if (dep_client_new(&c) != 0 || dep_connect(c, o.sock) != 0 || dep_status(c, &st) != 0)
    die("cannot query deepepd: %s%s", dep_errmsg(c), "");
  bool cuda = strcmp(st->backend, "cuda") == 0;
  char gwhy[256] = "";
  if (cuda && (o.gpus = bench_gpus(gpus_want, gwhy, sizeof gwhy)) < 0)
    die("%s%s", gwhy, "");
  printf("# attach-to-ready, backend %s, shape %u tokens x %u hidden x top-%u x %u experts, "
         "%d rounds\n", st->backend, o.shape.max_tokens_per_rank, o.shape.hidden, o.shape.topk,
         o.shape.num_experts, o.rounds);
  if (o.stagger_ms > 0)
    printf("# ranks released %d ms apart; times run from the last rank's release\n",
           o.stagger_ms);
  if (!cuda && gpus_want != 1)
    printf("# -g %d ignored: the host backend uses no GPU\n", gpus_want);
  else if (cuda && o.gpus > 1)
    printf("# placement: ranks spread over %d GPUs, rank r on GPU r %% %d\n", o.gpus, o.gpus);
  else if (cuda)
    printf("# placement: every rank on GPU 0 (-g N spreads them over N GPUs)\n");
  dep_status_free(st);
  dep_client_free(c);
  printf("%-6s %14s %12s %12s %12s %12s %12s %8s", "ranks", "slab_MiB", "warm_first_ms",
         "warm_med_ms", "warm_max_ms", "cold_med_ms", "cold_max_ms", "ratio");
  for (int p = 0; p < PHASES; p++)
    printf(" %9s_ms", phase_names[p]);
  printf("\n");
  for (int i = 0; i < o.ncounts; i++) {
    int n = o.counts[i];
    if (n < 1 || n > MAX_RANKS || o.shape.num_experts % (uint32_t)n != 0)
      usage();
    struct dep_slab_layout l;
    char why[256];
    if (dep__slab_layout(&o.shape, (uint32_t)n, &l, why, sizeof why) != 0)
      die("%s%s", why, "");
    double warm[MAX_ROUNDS], cold[MAX_ROUNDS], phases[MAX_ROUNDS][PHASES];
    run_path(&o, cuda, true, n, warm, phases);
    run_path(&o, cuda, false, n, cold, NULL);
    /* Round 0 is the first job of this shape on the daemon: its arena may
     * be made then, and kept by the buffer cache for the later rounds. */
    double first = warm[0];
    bench_sort(warm, (size_t)o.rounds);
    bench_sort(cold, (size_t)o.rounds);
    double wm = warm[o.rounds / 2], cm = cold[o.rounds / 2];
    printf("%-6d %14.1f %12.3f %12.3f %12.3f %12.3f %12.3f %7.1fx", n,
           (double)l.total_bytes / (1 << 20), first, wm, warm[o.rounds - 1], cm,
           cold[o.rounds - 1], cm / wm);
    for (int p = 0; p < PHASES; p++) { /* medians over the rounds, of the slowest rank */
      double v[MAX_ROUNDS];
      for (int r = 0; r < o.rounds; r++)
        v[r] = phases[r][p];
      bench_sort(v, (size_t)o.rounds);
      printf(" %12.3f", v[o.rounds / 2]);
    }
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
