/*
 * tunechild.c — the measurement of one tuning key (autotune.h), in a child
 * process of the daemon:
 *
 *   deepepd --tune-child SOCKET WORLD TOKENS HIDDEN EXPERTS TOPK DTYPE LL RANKS_PER_GPU
 *           CTAS,CTAS,... UUID...
 *
 * The job's world repeats as threads of this process, rank r on the GPU of
 * the r-th UUID, each a client of the daemon through libdeepep-client as a
 * trainer's rank is (ranks as streams of one process run at once without
 * MPS).  For each candidate budget, set by $DEEPEP_KERNEL_CTAS, the world
 * attaches as a job of its own, times TUNE_CHILD_CALLS calls of dispatch,
 * combine and their low-latency forms (bf16) on seeded random routing with
 * every rank released together per call (CUDA events on each rank's
 * stream; a call's time is its slowest rank's), and detaches.  The
 * candidates are timed in turn TUNE_CHILD_PASSES times, so that drift of
 * the machine falls on all of them alike, and each op's figure is the
 * median of its passes' medians (one world that ran slow or fast moves a
 * figure of a 60 us op by several per cent, as much as the choice's
 * threshold).  One line per candidate goes to stdout:
 * "cand CTAS DISPATCH_NS COMBINE_NS LL_DISPATCH_NS LL_COMBINE_NS".
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "autotune.h"
#include "cudadrv.h"
#include "deepep.h"
#include "log.h"
#include "sm_budget.h"
#include "tune.h"
#include "uuid.h"

#define TUNE_CHILD_CALLS 32
#define TUNE_CHILD_WARM 4
#define TUNE_CHILD_PASSES 4

struct tc_world {
  uint32_t world, ll;
  struct dep_job_shape shape;
  const char *socket;
  uint8_t uuid[DEP_MAX_LOCAL_RANKS][16];
  uint32_t cands[TUNE_MAX_CANDS], n_cands;
  pthread_barrier_t bar;
  /* [candidate][rank][op][call] ms, and whether any rank failed */
  float (*t)[DEP_MAX_LOCAL_RANKS][TUNE_NOPS][TUNE_CHILD_CALLS];
  uint32_t pass_ns[TUNE_MAX_CANDS][TUNE_NOPS][TUNE_CHILD_PASSES]; /* each pass's median */
  atomic_bool failed;
};

struct tc_rank {
  struct tc_world *w;
  uint32_t r;
};

static const struct cudadrv *cu;

#define TC_CK(call)                                                                           \
  do {                                                                                        \
    CUresult r_ = (call);                                                                     \
    if (r_ != CUDA_SUCCESS) {                                                                 \
      log_errx("tuning child: rank %u: %s: %s", k->r, #call, cudadrv_errstr(r_));             \
      return -1;                                                                              \
    }                                                                                         \
  } while (0)

/* The rank's device buffers, made once for every candidate's job. */
struct tc_bufs {
  CUdeviceptr x, idx, w, rx, ridx, rw, rcnt, out, llrx, llcnt, llout;
};

static int tc_alloc(struct tc_rank *k, struct tc_bufs *b) {
  const struct dep_job_shape *s = &k->w->shape;
  const size_t T = s->max_tokens_per_rank, H = s->hidden, K = s->topk, W = k->w->world;
  const size_t le = s->num_experts / W, L = k->w->ll;
  const struct {
    CUdeviceptr *p;
    size_t n;
  } all[] = {{&b->x, T * H * 2},          {&b->idx, T * K * 8},      {&b->w, T * K * 4},
             {&b->rx, W * T * H * 2},     {&b->ridx, W * T * K * 4}, {&b->rw, W * T * K * 4},
             {&b->rcnt, le * 4},          {&b->out, T * H * 2},      {&b->llrx, le * W * L * H * 2},
             {&b->llcnt, le * 4},         {&b->llout, L * H * 2}};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    TC_CK(cu->cuMemAlloc(all[i].p, all[i].n));
    TC_CK(cu->cuMemsetD8(*all[i].p, 0x3c, all[i].n)); /* small bf16 values, no NaN */
  }
  /* Routing: top-k distinct experts per token, seeded by rank; weights 1/k. */
  int64_t *idx = malloc(T * K * 8);
  float *wt = malloc(T * K * 4);
  if (idx == NULL || wt == NULL) {
    free(idx), free(wt);
    log_errx("tuning child: out of memory");
    return -1;
  }
  unsigned seed = 42u + k->r;
  for (size_t t = 0; t < T; t++)
    for (size_t j = 0; j < K; j++) {
      int64_t e;
      bool dup;
      do {
        e = (int64_t)(rand_r(&seed) % s->num_experts);
        dup = false;
        for (size_t i = 0; i < j; i++)
          dup |= idx[t * K + i] == e;
      } while (dup);
      idx[t * K + j] = e;
      wt[t * K + j] = 1.0f / (float)K;
    }
  CUresult r1 = cu->cuMemcpyHtoD(b->idx, idx, T * K * 8), r2 = cu->cuMemcpyHtoD(b->w, wt, T * K * 4);
  free(idx), free(wt);
  TC_CK(r1);
  TC_CK(r2);
  return 0;
}

static void tc_free(struct tc_bufs *b) {
  if (cu == NULL)
    return;
  CUdeviceptr all[] = {b->x, b->idx, b->w, b->rx, b->ridx, b->rw, b->rcnt, b->out, b->llrx,
                       b->llcnt, b->llout};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (all[i] != 0)
      cu->cuMemFree(all[i]);
}

static int tc_op(struct tc_rank *k, dep_client_t *c, dep_handle_t *htp, dep_handle_t *hll,
                 const struct tc_bufs *b, CUstream st, int op) {
  const struct dep_job_shape *s = &k->w->shape;
  uint32_t nrecv = 0;
  void *x = (void *)(uintptr_t)b->x, *idx = (void *)(uintptr_t)b->idx;
  float *w = (float *)(uintptr_t)b->w;
  switch (op) {
  case TUNE_OP_DISPATCH: {
    struct dep_dispatch_args a = {.size = sizeof(struct dep_dispatch_args),
                                  .x = x, .topk_idx = idx, .index_type = DEP_INDEX_I64,
                                  .topk_weights = w, .num_tokens = s->max_tokens_per_rank,
                                  .recv_x = (void *)(uintptr_t)b->rx,
                                  .recv_topk_idx = (int32_t *)(uintptr_t)b->ridx,
                                  .recv_topk_weights = (float *)(uintptr_t)b->rw,
                                  .recv_count_per_expert = (int32_t *)(uintptr_t)b->rcnt,
                                  .num_recv = &nrecv};
    return dep_dispatch(c, &a, htp, st);
  }
  case TUNE_OP_COMBINE: {
    struct dep_combine_args a = {.size = sizeof(struct dep_combine_args),
                                  .x = (void *)(uintptr_t)b->rx, .out = (void *)(uintptr_t)b->out};
    return dep_combine(c, &a, htp, st);
  }
  case TUNE_OP_LL_DISPATCH: {
    struct dep_ll_dispatch_args a = {.size = sizeof(struct dep_ll_dispatch_args),
                                  .x = x, .topk_idx = idx, .index_type = DEP_INDEX_I64,
                                     .num_tokens = k->w->ll, .recv_x = (void *)(uintptr_t)b->llrx,
                                     .recv_count = (int32_t *)(uintptr_t)b->llcnt};
    return dep_ll_dispatch(c, &a, hll, st);
  }
  default: {
    struct dep_ll_combine_args a = {.size = sizeof(struct dep_ll_combine_args),
                                  .x = (void *)(uintptr_t)b->llrx, .topk_idx = idx,
                                    .index_type = DEP_INDEX_I64, .topk_weights = w,
                                    .out = (void *)(uintptr_t)b->llout};
    return dep_ll_combine(c, &a, hll, st);
  }
  }
}

/* One candidate's job: attach, time every op, detach.  0, or -1 (logged). */
static int tc_job(struct tc_rank *k, unsigned ci, unsigned pass, const struct tc_bufs *b,
                  CUstream st, CUevent e0, CUevent e1) {
  struct tc_world *w = k->w;
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = k->r, .world_size = w->world, .local_rank = k->r,
                              .local_world_size = w->world, .shape = w->shape};
  snprintf(a.job_id, sizeof a.job_id, AUTOTUNE_JOB_PREFIX "%d-%u-%u", (int)getpid(), ci, pass);
  memcpy(a.device_uuid, w->uuid[k->r], 16);
  dep_client_t *c = NULL;
  dep_handle_t *htp = NULL, *hll = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, w->socket);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc == 0)
    rc = dep_handle_new(c, &htp);
  if (rc == 0)
    rc = dep_handle_new(c, &hll);
  /* Ranks of one process: every one has its handles before any calls (cuda_ops.h). */
  pthread_barrier_wait(&w->bar);
  for (int i = -TUNE_CHILD_WARM; i < TUNE_CHILD_CALLS; i++)
    for (int op = 0; op < TUNE_NOPS; op++) {
      pthread_barrier_wait(&w->bar);
      if (rc != 0 || w->failed)
        continue;
      float ms = 0;
      if (cu->cuEventRecord(e0, st) != CUDA_SUCCESS ||
          (rc = tc_op(k, c, htp, hll, b, st, op)) != 0 || cu->cuEventRecord(e1, st) != CUDA_SUCCESS ||
          cu->cuEventSynchronize(e1) != CUDA_SUCCESS || cu->cuEventElapsedTime(&ms, e0, e1) != CUDA_SUCCESS)
        rc = rc != 0 ? rc : DEP_ERR_CUDA;
      if (i >= 0)
        w->t[ci][k->r][op][i] = ms;
    }
  if (rc != 0) {
    log_errx("tuning child: rank %u, %u CTAs: %s: %s", k->r, w->cands[ci], dep_errname(rc),
             c != NULL ? dep_errmsg(c) : "out of memory");
    w->failed = true;
  }
  pthread_barrier_wait(&w->bar); /* every rank's calls are over before any detaches */
  if (c != NULL && dep_detach(c) != 0 && rc == 0) {
    log_errx("tuning child: rank %u: detach: %s", k->r, dep_errmsg(c));
    w->failed = true;
  }
  dep_handle_free(htp);
  dep_handle_free(hll);
  dep_client_free(c);
  return rc == 0 ? 0 : -1;
}

/* A rank's thread: its context, stream and buffers, then one job per candidate and pass.  A
 * rank whose set-up failed still meets every barrier, so that the others end. */
static void *tc_thread(void *arg) {
  struct tc_rank *k = arg;
  struct tc_world *w = k->w;
  CUcontext ctx = NULL;
  CUstream st = NULL;
  CUevent e0 = NULL, e1 = NULL;
  struct tc_bufs b = {0};
  CUdevice dev;
  bool ok = cudadrv_device_by_uuid(cu, w->uuid[k->r], &dev) == 0 &&
            cu->cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS &&
            cu->cuCtxSetCurrent(ctx) == CUDA_SUCCESS &&
            cu->cuStreamCreate(&st, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
            cu->cuEventCreate(&e0, 0) == CUDA_SUCCESS && cu->cuEventCreate(&e1, 0) == CUDA_SUCCESS;
  if (!ok)
    log_errx("tuning child: rank %u: cannot set up on its GPU (not visible, or out of memory)",
             k->r);
  if (ok && tc_alloc(k, &b) != 0)
    ok = false;
  if (!ok)
    w->failed = true;
  for (unsigned pass = 0; pass < TUNE_CHILD_PASSES; pass++)
    for (unsigned ci = 0; ci < w->n_cands; ci++) {
      /* The budget of the next job, set while no rank is inside the library. */
      pthread_barrier_wait(&w->bar);
      if (k->r == 0) {
        char v[16];
        snprintf(v, sizeof v, "%u", w->cands[ci]);
        setenv(CUOPS_CTAS_ENV, v, 1);
      }
      pthread_barrier_wait(&w->bar);
      if (ok && !w->failed)
        tc_job(k, ci, pass, &b, st, e0, e1);
      else
        for (int i = 0; i < 2 + (TUNE_CHILD_WARM + TUNE_CHILD_CALLS) * TUNE_NOPS; i++)
          pthread_barrier_wait(&w->bar); /* tc_job's barriers */
      if (k->r == 0 && !w->failed)
        for (unsigned op = 0; op < TUNE_NOPS; op++) {
          /* A call's time is its slowest rank's; the median of the calls; the lowest pass. */
          float v[TUNE_CHILD_CALLS];
          for (int i = 0; i < TUNE_CHILD_CALLS; i++) {
            v[i] = 0;
            for (uint32_t r = 0; r < w->world; r++)
              v[i] = w->t[ci][r][op][i] > v[i] ? w->t[ci][r][op][i] : v[i];
          }
          for (int i = 1; i < TUNE_CHILD_CALLS; i++)
            for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
              float x = v[j];
              v[j] = v[j - 1], v[j - 1] = x;
            }
          uint32_t ns = (uint32_t)(v[TUNE_CHILD_CALLS / 2] * 1e6f);
          w->pass_ns[ci][op][pass] = ns < 1 ? 1 : ns;
        }
    }
  tc_free(&b);
  if (e0 != NULL)
    cu->cuEventDestroy(e0);
  if (e1 != NULL)
    cu->cuEventDestroy(e1);
  if (st != NULL)
    cu->cuStreamDestroy(st);
  if (ctx != NULL)
    cu->cuDevicePrimaryCtxRelease(dev);
  return NULL;
}

static int tc_number(const char *s, uint32_t *out) {
  char *end = NULL;
  unsigned long v = strtoul(s, &end, 10);
  if (s[0] < '0' || s[0] > '9' || *end != '\0' || v > UINT32_MAX)
    return -1;
  *out = (uint32_t)v;
  return 0;
}

int autotune_child_main(const char *socket, int argc, char **argv) {
  static struct tc_world w;
  w.socket = socket;
  uint32_t v[8], rpg;
  bool bad = argc < 10;
  for (int i = 0; i < 8 && !bad; i++)
    bad = tc_number(argv[i], &v[i]) != 0;
  if (!bad) {
    w.world = v[0];
    w.shape = (struct dep_job_shape){.max_tokens_per_rank = v[1], .hidden = v[2],
                                     .num_experts = v[3], .topk = v[4], .dtype = v[5],
                                     .max_ll_tokens_per_rank = v[6]};
    rpg = v[7];
    bad = w.world < 1 || w.world > DEP_MAX_LOCAL_RANKS || argc != 9 + (int)w.world ||
          w.shape.num_experts % w.world != 0 || rpg < 1;
  }
  char *save = NULL;
  for (char *t = bad ? NULL : strtok_r(argv[8], ",", &save); t != NULL && !bad;
       t = strtok_r(NULL, ",", &save))
    bad = w.n_cands == TUNE_MAX_CANDS || tc_number(t, &w.cands[w.n_cands++]) != 0;
  for (uint32_t r = 0; r < w.world && !bad; r++)
    bad = dep__uuid_parse(argv[9 + r], w.uuid[r]) != 0;
  if (bad || w.n_cands == 0) {
    log_errx("tuning child: usage: deepepd --" AUTOTUNE_CHILD_OPT " SOCKET WORLD TOKENS HIDDEN "
             "EXPERTS TOPK DTYPE LL RANKS_PER_GPU CTAS,... UUID... (one UUID per rank)");
    return 2;
  }
  const uint32_t T = w.shape.max_tokens_per_rank;
  w.ll = w.shape.max_ll_tokens_per_rank ? w.shape.max_ll_tokens_per_rank : T < 256 ? T : 256;
  /* Ranks of one process need a hardware queue per stream (cuda_ops.h); before CUDA starts. */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  char why[256] = "";
  if ((cu = cudadrv_load(why, sizeof why)) == NULL) {
    log_errx("tuning child: %s", why);
    return 1;
  }
  w.t = calloc(w.n_cands, sizeof *w.t);
  if (w.t == NULL)
    return 1;
  pthread_barrier_init(&w.bar, NULL, w.world);
  struct tc_rank ks[DEP_MAX_LOCAL_RANKS];
  pthread_t th[DEP_MAX_LOCAL_RANKS];
  uint32_t started = 0;
  for (uint32_t r = 0; r < w.world; r++) {
    ks[r] = (struct tc_rank){&w, r};
    if (pthread_create(&th[r], NULL, tc_thread, &ks[r]) != 0) {
      log_errx("tuning child: cannot start rank %u's thread", r);
      _exit(1); /* the others wait at a barrier for it */
    }
    started++;
  }
  for (uint32_t r = 0; r < started; r++)
    pthread_join(th[r], NULL);
  pthread_barrier_destroy(&w.bar);
  if (w.failed)
    return 1;
  /* Each op's figure: the median of its pass medians (of 4: the middle two's mean), so that
   * neither a world that ran slow nor one that ran fast decides. */
  for (uint32_t i = 0; i < w.n_cands; i++) {
    uint32_t f[TUNE_NOPS];
    for (unsigned op = 0; op < TUNE_NOPS; op++) {
      uint32_t *p = w.pass_ns[i][op];
      for (int a = 1; a < TUNE_CHILD_PASSES; a++)
        for (int b = a; b > 0 && p[b - 1] > p[b]; b--) {
          uint32_t x = p[b];
          p[b] = p[b - 1], p[b - 1] = x;
        }
      f[op] = (p[(TUNE_CHILD_PASSES - 1) / 2] + p[TUNE_CHILD_PASSES / 2]) / 2;
    }
    printf("cand %u %u %u %u %u\n", w.cands[i], f[0], f[1], f[2], f[3]);
  }
  fflush(stdout);
  free(w.t);
  return 0;
}
