/*
 * elastic.c — what an elastic job (DESIGN §14, issue 25) costs when a rank
 * dies and when a replacement comes back, beside a restart, on the public
 * API only (deepep.h), on the host backend (its buffers are host memory).
 *
 *   elastic -s SOCKET[,SOCKET...] [-n RANKS] [-c CYCLES] [-t TOKENS] [-H HIDDEN] [-e EXPERTS]
 *           [-k TOPK] [-g]
 *
 * RANKS processes (8) attach as one elastic job and call without pause,
 * every rank the same operation (a throughput dispatch, or a low-latency
 * one), each call's received row count checked against what the routing
 * gives with the ranks live then.  Each cycle, in one mode at a time:
 *   (a) kill: the ranks stop at one call boundary; the victim makes no more
 *       calls, the others enter their next call and wait for it; SIGKILL;
 *       the time from the kill to the last survivor's return of that call,
 *       which must hold the rows of the survivors only;
 *   (b) rejoin: a new process (forked, connected: its start-up is reported
 *       beside, not counted) calls dep_attach with the victim's id while the
 *       survivors keep calling; the time from that dep_attach to the last of
 *       every rank's first call with the victim's rows in it (the
 *       replacement's first call is its join call);
 * and then, the same number of times,
 *   (c) restart, what a job that is not elastic pays: every rank stops,
 *       dep_detach, dep_attach to a new job (the daemon warm) and makes its
 *       first call; the time from the release to the last first call.
 * Medians and worst over the cycles; the ranks' processes stay up in (c)
 * (a trainer restarted from scratch pays its own start-up, reported beside).
 * With -g the ranks' buffers are device memory and each rank process uses
 * the GPU (rank r on GPU r % the GPUs visible), for a daemon with the cuda
 * backend; the replacement makes its CUDA context before the clock (its
 * start-up, beside, includes it).
 * With several sockets, one daemon a node (each other's peers), the ranks
 * spread over them in equal blocks and the job spans them; the replacement
 * of (b) attaches on the killed rank's node, whose daemon agrees on the join
 * call with the others, and (c) is not measured.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchlib.h"
#include "cudadrv.h"
#include "deepep.h"

#define EB_MAXW 64
#define EB_NONE UINT64_MAX
/* How long the parent or a rank waits for the others before it gives up:
 * a ceiling for a loaded machine, far above any figure this measures. */
#define EB_CEILING_MS 60000.0

enum eb_op { EB_TP, EB_LL };
enum eb_cmd { EB_RUN, EB_RESTART, EB_EXIT };

/* Shared by the parent and every rank process. */
struct eb_ctl {
  _Atomic int pause_req;              /* the parent asks the ranks to stop ... */
  _Atomic uint64_t stop_at;           /* ... at this call (rank 0 names it) */
  _Atomic uint32_t stopped;           /* ranks stopped there */
  _Atomic uint32_t gen;               /* bumped: the stopped ranks go on */
  _Atomic int cmd, op;
  _Atomic uint32_t job_gen;           /* EB_RESTART: the job's new name */
  _Atomic int idle[EB_MAXW];          /* this rank makes no more calls (the victim) */
  _Atomic int calling[EB_MAXW];       /* this rank has entered a call since the resume */
  _Atomic int dead[EB_MAXW];          /* the rows to expect: these ranks' are missing */
  _Atomic int rec_a, rec_b, rec_c;    /* record the time of the (a), (b), (c) call */
  _Atomic int got[EB_MAXW];
  double t[EB_MAXW];
  _Atomic uint64_t n_join;            /* rank 0's call index of its first call with the victim */
  _Atomic int rep_go, rep_ready, rep_done;
  double rep_fork, rep_connected, rep_attach, rep_attached, rep_first;
  int rep_retries;
  _Atomic int failed;
  char why[512];
};

static struct eb_ctl *ctl;
static uint32_t W = 8, T = 64, H = 2048, E = 64, K = 8, CYCLES = 20;
static const char *sock;          /* -s as given */
static char *socks[EB_MAXW];       /* one a node */
static uint32_t nodes, lws;    /* ranks a node: rank r is on node r / lws */
static char job_base[48];
static int use_gpu, ngpus;        /* -g: device buffers, on ngpus GPUs */
static const struct cudadrv *cu;  /* -g: loaded in each rank process, after its fork */
static uint8_t gpu_uuid[16];      /* -g: this rank process's GPU */

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (atomic_exchange(&ctl->failed, 1) == 0)
    vsnprintf(ctl->why, sizeof ctl->why, fmt, ap);
  va_end(ap);
}

static void nap(void) {
  struct timespec ts = {0, 20000};
  nanosleep(&ts, NULL);
}

/* -g: this rank process's GPU, its primary context current; before any buffer. */
static void eb_gpu(uint32_t r) {
  char why[256] = "";
  CUdevice dev;
  CUcontext ctx;
  CUuuid u;
  cu = cudadrv_load(why, sizeof why);
  if (cu == NULL || cu->cuDeviceGet(&dev, bench_gpu_of_rank((int)r, ngpus)) != CUDA_SUCCESS ||
      cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS ||
      cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
      cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    fail("rank %u: its GPU: %s", r, why[0] ? why : "a CUDA driver call failed");
    _exit(1);
  }
  memcpy(gpu_uuid, u.bytes, sizeof gpu_uuid);
}

/* -g: a device copy of n bytes of host (or, host NULL, n bytes of device memory). */
static void *eb_dev(const void *host, size_t n) {
  CUdeviceptr d = 0;
  if (cu->cuMemAlloc(&d, n ? n : 1) != CUDA_SUCCESS ||
      (host != NULL && cu->cuMemcpyHtoD(d, host, n) != CUDA_SUCCESS)) {
    fail("out of device memory for %zu bytes", n);
    _exit(1);
  }
  return (void *)(uintptr_t)d;
}

/* Token t of rank s goes to ranks t, t+1, ..., t+K-1 (mod W), one expert on
 * each: every rank gets rows from every rank, and one row per (token, rank). */
static int64_t eb_expert(uint32_t s, uint32_t t, uint32_t k) {
  const uint32_t le = E / W;
  return (int64_t)((t + k) % W) * le + (t * 7u + k * 3u + s) % le;
}

/* Rows rank r receives from rank s: tokens of s with r among their ranks. */
static uint32_t eb_rows_from(uint32_t r, uint32_t s) {
  (void)s;
  uint32_t n = 0;
  for (uint32_t t = 0; t < T; t++)
    n += (r + W - t % W) % W < K;
  return n;
}

static uint32_t eb_expect(uint32_t r) {
  uint32_t n = 0;
  for (uint32_t s = 0; s < W; s++)
    if (!atomic_load(&ctl->dead[s]))
      n += eb_rows_from(r, s);
  return n;
}

static uint32_t eb_full(uint32_t r) {
  uint32_t n = 0;
  for (uint32_t s = 0; s < W; s++)
    n += eb_rows_from(r, s);
  return n;
}

/* What the calls take: host memory, or with -g device memory (lcnt_host: the
 * low-latency counts read back). */
struct eb_bufs {
  uint16_t *x, *rx;
  int64_t *idx;
  float *w, *rw, *lscales;
  int32_t *ridx, *cnt, *lcnt, *lcnt_host;
  uint8_t *lx;
};

static void eb_bufs(struct eb_bufs *b, uint32_t r) {
  const size_t rows = (size_t)W * T, le = E / W;
  b->x = calloc((size_t)T * H, 2);
  b->idx = malloc((size_t)T * K * 8);
  b->w = malloc((size_t)T * K * 4);
  b->rx = malloc(rows * H * 2);
  b->ridx = malloc(rows * K * 4);
  b->rw = malloc(rows * K * 4);
  b->cnt = malloc(le * 4);
  b->lcnt = malloc(le * 4);
  b->lx = malloc(le * rows * H * 2);
  b->lscales = malloc(le * rows * (H / 128) * 4);
  if (!b->x || !b->idx || !b->w || !b->rx || !b->ridx || !b->rw || !b->cnt || !b->lcnt ||
      !b->lx || !b->lscales) {
    fprintf(stderr, "elastic: out of memory\n");
    _exit(2);
  }
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t k = 0; k < K; k++) {
      b->idx[(size_t)t * K + k] = eb_expert(r, t, k);
      b->w[(size_t)t * K + k] = 1.0f / (float)K;
    }
  b->lcnt_host = b->lcnt;
  if (!use_gpu)
    return;
  /* The host arrays stay: a rank process lives as long as the run. */
  b->x = eb_dev(b->x, (size_t)T * H * 2);
  b->idx = eb_dev(b->idx, (size_t)T * K * 8);
  b->w = eb_dev(b->w, (size_t)T * K * 4);
  b->rx = eb_dev(NULL, rows * H * 2);
  b->ridx = eb_dev(NULL, rows * K * 4);
  b->rw = eb_dev(NULL, rows * K * 4);
  b->cnt = eb_dev(NULL, le * 4);
  b->lcnt = eb_dev(NULL, le * 4);
  b->lx = eb_dev(NULL, le * rows * H * 2);
  b->lscales = eb_dev(NULL, le * rows * (H / 128) * 4);
}

/* One call of the mode: the rows received, or -1 (ctl->why says). */
static long eb_call(dep_client_t *c, struct eb_bufs *b, int op) {
  dep_handle_t *h = NULL;
  int rc = dep_handle_new(c, &h);
  long rows = -1;
  if (rc == 0 && op == EB_TP) {
    uint32_t num_recv = 0;
    struct dep_dispatch_args a = {.size = sizeof a, .x = b->x, .topk_idx = b->idx,
                                  .index_type = DEP_INDEX_I64, .topk_weights = b->w,
                                  .num_tokens = T, .recv_x = b->rx, .recv_topk_idx = b->ridx,
                                  .recv_topk_weights = b->rw, .recv_count_per_expert = b->cnt,
                                  .num_recv = &num_recv};
    if ((rc = dep_dispatch(c, &a, h, NULL)) == 0)
      rows = num_recv;
  } else if (rc == 0) {
    struct dep_ll_dispatch_args a = {.size = sizeof a, .x = b->x, .topk_idx = b->idx,
                                     .index_type = DEP_INDEX_I64, .num_tokens = T,
                                     .recv_x = b->lx, .recv_count = b->lcnt};
    /* On the GPU the counts are read back on the default stream, behind the call. */
    if ((rc = dep_ll_dispatch(c, &a, h, NULL)) == 0 && use_gpu &&
        cu->cuMemcpyDtoH(b->lcnt_host, (CUdeviceptr)(uintptr_t)b->lcnt, (E / W) * 4) !=
            CUDA_SUCCESS)
      rc = DEP_ERR_CUDA;
    if (rc == 0) {
      rows = 0;
      for (uint32_t l = 0; l < E / W; l++)
        rows += b->lcnt_host[l];
    }
  }
  if (rc != 0)
    fail("%s: %s: %s", op == EB_TP ? "dep_dispatch" : "dep_ll_dispatch", dep_errname(rc),
         dep_errmsg(c));
  dep_handle_free(h);
  return rows;
}

static int eb_attach(dep_client_t *c, uint32_t r, uint32_t job_gen) {
  struct dep_attach_args a = {.size = sizeof a, .rank = r, .world_size = W,
                              .local_rank = r % lws, .local_world_size = lws,
                              .flags = DEP_ATTACH_ELASTIC};
  a.shape = (struct dep_job_shape){.max_tokens_per_rank = T, .hidden = H, .num_experts = E,
                                   .topk = K, .dtype = DEP_DTYPE_BF16,
                                   .max_ll_tokens_per_rank = T};
  snprintf(a.job_id, sizeof a.job_id, "%s-%u", job_base, job_gen);
  memcpy(a.device_uuid, gpu_uuid, sizeof a.device_uuid);
  return dep_attach(c, &a);
}

/* Wait (at most the ceiling) until *w != 0; whether it came. */
static int eb_await(_Atomic int *w) {
  const double until = bench_now_ms() + EB_CEILING_MS;
  while (!atomic_load(w)) {
    if (bench_now_ms() > until || atomic_load(&ctl->failed))
      return 0;
    nap();
  }
  return 1;
}

/* A rank: calls without pause, stopping where rank 0 says when asked. */
static void eb_rank(dep_client_t *c, uint32_t r, uint64_t n, int *attached) {
  struct eb_bufs b;
  eb_bufs(&b, r);
  for (;;) {
    if (r == 0 && atomic_load(&ctl->pause_req) && atomic_load(&ctl->stop_at) == EB_NONE)
      atomic_store(&ctl->stop_at, n + 1); /* the others are within this call of rank 0 */
    if (n >= atomic_load(&ctl->stop_at)) {
      const uint32_t g = atomic_load(&ctl->gen);
      atomic_fetch_add(&ctl->stopped, 1);
      while (atomic_load(&ctl->gen) == g)
        nap();
      const int cmd = atomic_load(&ctl->cmd);
      if (cmd == EB_EXIT)
        break;
      if (cmd == EB_RESTART) {
        int rc = *attached ? dep_detach(c) : 0;
        *attached = 1;
        if (rc == 0)
          rc = eb_attach(c, r, atomic_load(&ctl->job_gen));
        if (rc != 0) {
          fail("rank %u restarting: %s: %s", r, dep_errname(rc), dep_errmsg(c));
          break;
        }
        n = 0;
      }
      continue;
    }
    if (atomic_load(&ctl->idle[r]))
      for (;;)
        pause(); /* the victim: killed here */
    atomic_store(&ctl->calling[r], 1);
    const int op = atomic_load(&ctl->op);
    const long rows = eb_call(c, &b, op);
    const double now = bench_now_ms();
    if (rows < 0)
      break;
    const uint32_t want = eb_expect(r), full = eb_full(r);
    if ((uint32_t)rows != want && (uint32_t)rows != full) {
      fail("rank %u call %llu: %ld rows, want %u (or %u with every rank)", r,
           (unsigned long long)n, rows, want, full);
      break;
    }
    if (atomic_load(&ctl->rec_a) && !atomic_load(&ctl->got[r])) {
      if ((uint32_t)rows != want) {
        fail("rank %u: its call after the kill had %ld rows, want %u", r, rows, want);
        break;
      }
      ctl->t[r] = now;
      atomic_store(&ctl->got[r], 1);
    }
    if ((atomic_load(&ctl->rec_b) || atomic_load(&ctl->rec_c)) && !atomic_load(&ctl->got[r]) &&
        (uint32_t)rows == full) {
      ctl->t[r] = now;
      if (r == 0)
        atomic_store(&ctl->n_join, n);
      atomic_store(&ctl->got[r], 1);
    }
    n++;
  }
}

/* A rank process. */
static void eb_rank_main(uint32_t r) {
  dep_client_t *c = NULL;
  if (use_gpu)
    eb_gpu(r);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, socks[r / lws]);
  if (rc == 0)
    rc = eb_attach(c, r, 0);
  if (rc != 0) {
    fail("rank %u: %s: %s", r, dep_errname(rc), c ? dep_errmsg(c) : "");
    _exit(1);
  }
  int attached = 1;
  eb_rank(c, r, 0, &attached);
  dep_client_free(c);
  _exit(atomic_load(&ctl->failed) ? 1 : 0);
}

/* The victim's replacement: connect, wait for the word, attach (again while the survivors
 * overtook its join call), make its first call, then go on as the rank. */
static void eb_replacement_main(uint32_t v) {
  dep_client_t *c = NULL;
  if (use_gpu)
    eb_gpu(v);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, socks[v / lws]);
  ctl->rep_connected = bench_now_ms();
  atomic_store(&ctl->rep_ready, 1);
  if (rc != 0 || !eb_await(&ctl->rep_go)) {
    fail("replacement: %s: %s", dep_errname(rc), c ? dep_errmsg(c) : "no word to attach");
    _exit(1);
  }
  ctl->rep_attach = bench_now_ms();
  ctl->rep_retries = 0;
  while ((rc = eb_attach(c, v, atomic_load(&ctl->job_gen))) == DEP_ERR_STATE &&
         ctl->rep_retries < 100)
    ctl->rep_retries++;
  if (rc != 0) {
    fail("replacement attach: %s: %s", dep_errname(rc), dep_errmsg(c));
    _exit(1);
  }
  ctl->rep_attached = bench_now_ms();
  struct eb_bufs b;
  eb_bufs(&b, v);
  const long rows = eb_call(c, &b, atomic_load(&ctl->op));
  ctl->rep_first = bench_now_ms();
  if (rows != (long)eb_full(v)) {
    fail("replacement's first call: %ld rows, want %u", rows, eb_full(v));
    _exit(1);
  }
  atomic_store(&ctl->rep_done, 1);
  /* Its first call was rank 0's first with it in; its count goes on from there. */
  const double until = bench_now_ms() + EB_CEILING_MS;
  while (atomic_load(&ctl->n_join) == EB_NONE && bench_now_ms() < until)
    nap();
  int attached = 1;
  eb_rank(c, v, atomic_load(&ctl->n_join) + 1, &attached);
  dep_client_free(c);
  _exit(atomic_load(&ctl->failed) ? 1 : 0);
}

/* ---- the parent --------------------------------------------------------------- */

static pid_t pids[EB_MAXW];

static void die(const char *what) {
  fprintf(stderr, "elastic: %s: %s\n", what, atomic_load(&ctl->failed) ? ctl->why : "timed out");
  for (uint32_t r = 0; r < W; r++)
    if (pids[r] > 0)
      kill(pids[r], SIGKILL);
  exit(1);
}

/* Stop every live rank at one call boundary. */
static void eb_pause(uint32_t live) {
  atomic_store(&ctl->pause_req, 1);
  const double until = bench_now_ms() + EB_CEILING_MS;
  while (atomic_load(&ctl->stopped) < live) {
    if (bench_now_ms() > until || atomic_load(&ctl->failed))
      die("pausing the ranks");
    nap();
  }
  atomic_store(&ctl->pause_req, 0);
  atomic_store(&ctl->stop_at, EB_NONE);
  atomic_store(&ctl->stopped, 0);
  atomic_store(&ctl->rec_a, 0);
  atomic_store(&ctl->rec_b, 0);
  atomic_store(&ctl->rec_c, 0);
  for (uint32_t r = 0; r < W; r++) {
    atomic_store(&ctl->got[r], 0);
    atomic_store(&ctl->calling[r], 0);
  }
}

static void eb_resume(int cmd) {
  atomic_store(&ctl->cmd, cmd);
  atomic_fetch_add(&ctl->gen, 1);
}

/* Wait until every rank but `skip` has recorded its time; the latest of them. */
static double eb_latest(uint32_t skip, const char *what) {
  double last = 0;
  for (uint32_t r = 0; r < W; r++) {
    if (r == skip)
      continue;
    if (!eb_await(&ctl->got[r]))
      die(what);
    last = ctl->t[r] > last ? ctl->t[r] : last;
  }
  return last;
}

static void report(const char *what, double *v, uint32_t n) {
  bench_sort(v, n);
  printf("%-44s median %9.3f ms  worst %9.3f ms  (%u cycles)\n", what, v[n / 2], v[n - 1], n);
}

static void usage(void) {
  fprintf(stderr, "usage: elastic -s SOCKET[,SOCKET...] [-n RANKS] [-c CYCLES] [-t TOKENS] [-H HIDDEN] "
                  "[-e EXPERTS] [-k TOPK] [-g]\n");
  exit(2);
}

int main(int argc, char **argv) {
  int o;
  while ((o = getopt(argc, argv, "s:n:c:t:H:e:k:gh")) != -1) {
    switch (o) {
    case 's': sock = optarg; break;
    case 'n': W = (uint32_t)atoi(optarg); break;
    case 'c': CYCLES = (uint32_t)atoi(optarg); break;
    case 't': T = (uint32_t)atoi(optarg); break;
    case 'H': H = (uint32_t)atoi(optarg); break;
    case 'e': E = (uint32_t)atoi(optarg); break;
    case 'k': K = (uint32_t)atoi(optarg); break;
    case 'g': use_gpu = 1; break;
    default: usage();
    }
  }
  if (sock != NULL) {
    char *list = strdup(sock), *save = NULL;
    for (char *t = strtok_r(list, ",", &save); t != NULL && nodes < EB_MAXW;
         t = strtok_r(NULL, ",", &save))
      socks[nodes++] = t;
  }
  if (nodes == 0 || W % nodes != 0)
    usage();
  lws = W / nodes;
  if (sock == NULL || W < 2 || W > EB_MAXW || CYCLES < 1 || T < W || K > W || E % W != 0 ||
      H % 128 != 0)
    usage();
  char why[256] = "";
  if (use_gpu && (ngpus = bench_gpus(0, why, sizeof why)) < 1) {
    fprintf(stderr, "elastic: -g: %s\n", why);
    return 1;
  }
  ctl = mmap(NULL, sizeof *ctl, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (ctl == MAP_FAILED)
    return 1;
  memset(ctl, 0, sizeof *ctl);
  atomic_store(&ctl->stop_at, EB_NONE);
  atomic_store(&ctl->n_join, EB_NONE);
  snprintf(job_base, sizeof job_base, "bench-elastic-%d", (int)getpid());
  for (uint32_t r = 0; r < W; r++)
    if ((pids[r] = fork()) == 0)
      eb_rank_main(r);
  printf("elastic: %u ranks on %s (%u a node), %u tokens per rank, hidden %u, top-%u of %u experts, "
         "bf16, %s buffers\n", W, sock, lws, T, H, K, E, use_gpu ? "device" : "host");
  double *ka[2], *rb[2], *rc = malloc(CYCLES * sizeof *rc), *start = malloc(2 * CYCLES * sizeof *start),
         *att = malloc(2 * CYCLES * sizeof *att);
  uint32_t retries = 0, jg = 0;
  for (int m = 0; m < 2; m++) {
    ka[m] = malloc(CYCLES * sizeof **ka);
    rb[m] = malloc(CYCLES * sizeof **rb);
  }
  for (uint32_t cyc = 0; cyc < 2 * CYCLES; cyc++) {
    const int op = (int)(cyc % 2);
    const uint32_t v = 1 + cyc % (W - 1), i = cyc / 2; /* rank 0 names the stops: never killed */
    eb_pause(W);
    /* (a): the victim idle, the others in their next call; then the kill. */
    atomic_store(&ctl->op, op);
    atomic_store(&ctl->idle[v], 1);
    atomic_store(&ctl->rec_a, 1);
    eb_resume(EB_RUN);
    for (uint32_t r = 0; r < W; r++)
      if (r != v && !eb_await(&ctl->calling[r]))
        die("waiting for the survivors' call");
    struct timespec in = {0, 1000000}; /* they are in their waits: the case measured */
    nanosleep(&in, NULL);
    atomic_store(&ctl->dead[v], 1);
    const double t0 = bench_now_ms();
    kill(pids[v], SIGKILL);
    waitpid(pids[v], NULL, 0);
    ka[op][i] = eb_latest(v, "the survivors' call after the kill") - t0;
    /* (b): the replacement, connected first, while the survivors keep calling. */
    atomic_store(&ctl->rec_a, 0);
    for (uint32_t r = 0; r < W; r++)
      atomic_store(&ctl->got[r], 0);
    atomic_store(&ctl->rep_ready, 0);
    atomic_store(&ctl->rep_go, 0);
    atomic_store(&ctl->rep_done, 0);
    atomic_store(&ctl->n_join, EB_NONE);
    atomic_store(&ctl->idle[v], 0);
    ctl->rep_fork = bench_now_ms();
    if ((pids[v] = fork()) == 0)
      eb_replacement_main(v);
    if (!eb_await(&ctl->rep_ready))
      die("the replacement's start");
    start[cyc] = ctl->rep_connected - ctl->rep_fork;
    atomic_store(&ctl->rec_b, 1);
    atomic_store(&ctl->rep_go, 1);
    if (!eb_await(&ctl->rep_done))
      die("the replacement's first call");
    double last = eb_latest(v, "the survivors' first call with the replacement");
    last = ctl->rep_first > last ? ctl->rep_first : last;
    rb[op][i] = last - ctl->rep_attach;
    atomic_store(&ctl->dead[v], 0); /* every rank's calls have its rows again */
    att[cyc] = ctl->rep_attached - ctl->rep_attach;
    retries += (uint32_t)ctl->rep_retries;
  }
  /* (c): every rank detaches and attaches to a new job, then its first call. */
  for (uint32_t i = 0; i < CYCLES && nodes == 1; i++) {
    eb_pause(W);
    atomic_store(&ctl->op, (int)(i % 2));
    atomic_store(&ctl->job_gen, ++jg);
    atomic_store(&ctl->rec_c, 1);
    const double t0 = bench_now_ms();
    eb_resume(EB_RESTART);
    rc[i] = eb_latest(EB_MAXW, "the restarted job's first call") - t0;
  }
  eb_pause(W);
  eb_resume(EB_EXIT);
  int bad = 0;
  for (uint32_t r = 0; r < W; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  if (bad || atomic_load(&ctl->failed))
    die("a rank failed");
  report("(a) SIGKILL -> survivors' next call, tp", ka[EB_TP], CYCLES);
  report("(a) SIGKILL -> survivors' next call, ll", ka[EB_LL], CYCLES);
  report("(b) dep_attach -> job's call with it, tp", rb[EB_TP], CYCLES);
  report("(b) dep_attach -> job's call with it, ll", rb[EB_LL], CYCLES);
  report("    of which dep_attach returning", att, 2 * CYCLES);
  report(use_gpu ? "    replacement start-up (fork, CUDA, connect)"
                 : "    replacement start-up (fork, connect)", start, 2 * CYCLES);
  if (nodes == 1)
    report("(c) restart: detach, attach, first call", rc, CYCLES);
  printf("replacement attaches refused as overtaken and tried again: %u\n", retries);
  return 0;
}
