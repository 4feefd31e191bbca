/*
 * check_cuda_ops.c — the cuda backend's kernels as a specification (DESIGN
 * §6): ranks attach to a real deepepd on the cuda backend, as separate
 * processes and as threads (streams) of one process, and every
 * output of layout, dispatch, combine and the low-latency forms (bf16 and
 * FP8) is held against the reference oracle (kernels/ref.c): moves bit for
 * bit, sums bit for bit against the host backend's float32 order (and within
 * the oracle's bound).  Outputs are poisoned before every call, so an
 * unwritten element or a write past the valid count fails.  Also: 240
 * calls back to back, a rank that never calls (DEP_ERR_TIMEOUT within the
 * bound, the daemon healthy after), out-of-range ids (DEP_ERR_INVALID
 * through the error word) and bad arguments refused before any launch.
 *
 * Tagged "gpu": each test skips, saying why, unless DEP_TEST_BACKEND=cuda
 * and a GPU is present (make check-gpu).  The test process never touches
 * CUDA before it forks its rank processes; each rank finds its GPU's UUID
 * through the driver itself.  Inputs are random from a printed seed
 * (DEP_TEST_SEED replays).
 *
 * DEP_TEST_GPUS spreads the ranks (processes or threads) over GPUs: rank r
 * on GPU r % N, N = DEP_TEST_GPUS or every visible GPU for "all"; unset,
 * all on GPU 0.  Asking for more GPUs than are visible fails each test.
 */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudadrv.h"
#include "deepep.h"
#include "host_ops.h"
#include "opsworld.h"
#include "ref.h"
#include "testutil.h"

static bool on_cuda(void) {
  const char *b = getenv("DEP_TEST_BACKEND");
  return b != NULL && strcmp(b, "cuda") == 0;
}

/* Skip (saying why) without a cuda daemon or a GPU; fail when DEP_TEST_GPUS
 * cannot be met; else what the probe found in *g.  The probe initialises
 * CUDA in a child, never here. */
static bool gpu_probe(const char *test, struct tu_gpus *g) {
  size_t n = strlen(test); /* __func__ of a Check test ends in "_fn" */
  if (!on_cuda()) {
    printf("%.*s: skipped: runs against a cuda daemon; set DEP_TEST_BACKEND=cuda (make check-gpu) "
           "on a machine with a GPU\n", (int)(n - 3), test);
    return false;
  }
  char why[256] = "";
  int rc = tu_gpus_probe(g, why, sizeof why);
  ck_assert_msg(rc >= 0, "%s", why);
  if (rc == 0)
    printf("%.*s: skipped: no usable GPU (%s)\n", (int)(n - 3), test, why);
  return rc > 0;
}

static bool gpu_ready(const char *test) {
  struct tu_gpus g;
  return gpu_probe(test, &g);
}
#define NEEDS_GPU()              \
  do {                           \
    if (!gpu_ready(__func__))    \
      return;                    \
  } while (0)

static uint64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- one rank: its client, stream and device buffers ------------------------------ */

enum { B_X, B_IDX, B_W, B_CX, B_LX, B_TPR, B_TPE, B_TIR, B_RX, B_RIDX, B_RW, B_CNT, B_OUT, B_LRX,
       B_LSC, B_LCNT, B_LOUT, B_COUNT };

struct rk {
  const struct cudadrv *cu;
  CUdevice dev;    /* this rank's GPU (DEP_TEST_GPUS) */
  CUcontext ctx;   /* its primary context, retained and current on the rank's thread */
  dep_client_t *c;
  dep_handle_t *h;
  CUstream s;
  uint32_t rank, W, h_, K, E, mt, le, rows, maxll;
  CUdeviceptr b[B_COUNT];
  size_t sz[B_COUNT];
  uint8_t *host; /* readback, as large as the largest buffer */
  char *msg;
};

#define DEV(k, i) ((void *)(uintptr_t)(k)->b[i])
#define CU(k, expr, what)                                                                  \
  do {                                                                                     \
    CUresult r_ = (expr);                                                                  \
    if (r_ != CUDA_SUCCESS)                                                                \
      return ow_fail((k)->msg, "rank %u: %s: %s", (k)->rank, what, cudadrv_errstr(r_));   \
  } while (0)

static int rk_open(struct rk *k, const char *sock, const char *job, const struct dep_job_shape *sh,
                   uint32_t rank, uint32_t W) {
  char why[256] = "";
  k->rank = rank, k->W = W;
  k->cu = cudadrv_load(why, sizeof why);
  if (k->cu == NULL)
    return ow_fail(k->msg, "rank %u: %s", rank, why);
  struct dep_attach_args a = {.rank = rank, .world_size = W, .local_rank = rank,
                              .local_world_size = W, .shape = *sh};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  /* This rank's GPU's primary context current on this thread before
   * anything else: dep_attach keeps a current context of the device it
   * binds, and the stream and buffers below are made in it. */
  int ordinal = 0;
  if (tu_gpu_for_rank(rank, &ordinal, why, sizeof why) != 0)
    return ow_fail(k->msg, "rank %u: %s", rank, why);
  CUuuid u;
  CU(k, k->cu->cuDeviceGet(&k->dev, ordinal), "cuDeviceGet");
  CU(k, k->cu->cuDeviceGetUuid(&u, k->dev), "cuDeviceGetUuid");
  CU(k, k->cu->cuDevicePrimaryCtxRetain(&k->ctx, k->dev), "cuDevicePrimaryCtxRetain");
  CU(k, k->cu->cuCtxSetCurrent(k->ctx), "cuCtxSetCurrent");
  memcpy(a.device_uuid, u.bytes, 16);
  if (dep_client_new(&k->c) != 0 || dep_connect(k->c, sock) != 0 || dep_attach(k->c, &a) != 0)
    return ow_fail(k->msg, "rank %u: connect/attach: %s", rank, dep_errmsg(k->c));
  if (dep_handle_new(k->c, &k->h) != 0)
    return ow_fail(k->msg, "rank %u: dep_handle_new", rank);
  CU(k, k->cu->cuStreamCreate(&k->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  struct dep_slab_layout lay;
  ck_assert_int_eq(dep_slab_layout(sh, W, &lay, why, sizeof why), 0);
  k->h_ = sh->hidden, k->K = sh->topk, k->E = sh->num_experts, k->mt = sh->max_tokens_per_rank;
  k->le = k->E / W, k->maxll = lay.max_ll_tokens, k->rows = W * lay.max_ll_tokens;
  size_t h = k->h_, rows_tp = (size_t)W * k->mt, lrows = (size_t)k->le * k->rows;
  size_t sz[B_COUNT] = {k->mt * h * 2, k->mt * k->K * 8, k->mt * k->K * 4, rows_tp * h * 2,
                        lrows * h * 2, W * 4, k->E * 4, (size_t)k->mt * W, rows_tp * h * 2,
                        rows_tp * k->K * 4, rows_tp * k->K * 4, k->le * 4, k->mt * h * 2,
                        lrows * h * 2, lrows * (h / 128) * 4, k->le * 4, k->maxll * h * 2};
  size_t most = 0;
  for (int i = 0; i < B_COUNT; i++) {
    k->sz[i] = sz[i];
    most = sz[i] > most ? sz[i] : most;
    CU(k, k->cu->cuMemAlloc(&k->b[i], sz[i] + 16), "cuMemAlloc");
  }
  k->host = malloc(most + 16);
  return k->host == NULL ? ow_fail(k->msg, "out of memory") : 0;
}

static void rk_close(struct rk *k) {
  if (k->cu != NULL && k->s != NULL)
    k->cu->cuStreamSynchronize(k->s);
  for (int i = 0; i < B_COUNT; i++)
    if (k->b[i] != 0)
      k->cu->cuMemFree(k->b[i]);
  if (k->s != NULL)
    k->cu->cuStreamDestroy(k->s);
  dep_handle_free(k->h);
  if (k->c != NULL)
    dep_detach(k->c);
  dep_client_free(k->c);
  free(k->host);
  if (k->ctx != NULL)
    k->cu->cuDevicePrimaryCtxRelease(k->dev);
}

static int put(struct rk *k, int i, const void *src, size_t n) {
  if (n > 0)
    CU(k, k->cu->cuMemcpyHtoD(k->b[i], src, n), "cuMemcpyHtoD");
  return 0;
}
static int poison(struct rk *k, int i, uint8_t pz) {
  CU(k, k->cu->cuMemsetD8Async(k->b[i], pz, k->sz[i], k->s), "cuMemsetD8Async");
  return 0;
}
/* Synchronise, then copy buffer i back into k->host. */
static int get(struct rk *k, int i) {
  CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  CU(k, k->cu->cuMemcpyDtoH(k->host, k->b[i], k->sz[i]), "cuMemcpyDtoH");
  return 0;
}

#define CALL(k, expr, op)                                                                 \
  do {                                                                                    \
    int rc_ = (expr);                                                                     \
    if (rc_ != 0)                                                                         \
      return ow_fail((k)->msg, "rank %u: %s returned %s: %s [%s]", (k)->rank, op,         \
                     dep_errname(rc_), dep_errmsg((k)->c), d->desc);                      \
  } while (0)

/* ---- what the kernels must give -------------------------------------------------- */

/* The host backend's float32 sums in its order, rounded once: bit for bit. */
static void want_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc) {
  const uint32_t h = d->sc.hidden;
  for (uint32_t t = 0; t < d->in[o].num_tokens; t++) {
    memset(acc, 0, h * sizeof *acc);
    for (uint32_t r = 0; r < d->sc.world; r++)
      for (uint32_t i = 0; i < d->disp[r].num_recv; i++)
        if (d->disp[r].from[i].rank == o && d->disp[r].from[i].token == t)
          for (uint32_t c = 0; c < h; c++)
            acc[c] += host_ops_bf16_to_float(d->cx[r][(size_t)i * h + c]);
    for (uint32_t c = 0; c < h; c++)
      want[(size_t)t * h + c] = host_ops_float_to_bf16(acc[c]);
  }
}

static void want_ll_combine(const struct ow_case *d, uint32_t o, uint16_t *want, float *acc) {
  const uint32_t h = d->sc.hidden, K = d->sc.topk;
  const struct ref_rank_in *in = &d->in_ll[o];
  for (uint32_t t = 0; t < in->num_tokens; t++) {
    memset(acc, 0, h * sizeof *acc);
    for (uint32_t j = 0; j < K; j++) {
      int64_t e = in->topk_idx[(size_t)t * K + j];
      if (e < 0)
        continue;
      uint32_t r = (uint32_t)(e / d->le), l = (uint32_t)(e % d->le);
      for (int32_t i = 0; i < d->ll[r].count[l]; i++) {
        size_t row = (size_t)l * d->rows_ll + (size_t)i;
        if (d->ll[r].from[row].rank != o || d->ll[r].from[row].token != t)
          continue;
        float w = in->topk_weights[(size_t)t * K + j];
        for (uint32_t c = 0; c < h; c++)
          acc[c] += w * host_ops_bf16_to_float(d->lx[r][row * h + c]);
      }
    }
    for (uint32_t c = 0; c < h; c++)
      want[(size_t)t * h + c] = host_ops_float_to_bf16(acc[c]);
  }
}

/* A summed output: within the oracle's bound, then bit for bit, then untouched past n. */
static int check_sum(struct rk *k, const struct ow_case *d, const struct ref_sum *ref,
                     const uint16_t *want, uint32_t n, uint32_t cap, uint8_t pz, const char *op) {
  const uint16_t *got = (const uint16_t *)k->host;
  const size_t h = d->sc.hidden;
  if (ow_check_sum(got, ref, n, (uint32_t)h, op, d->desc, k->msg))
    return 1;
  for (size_t i = 0; i < n * h; i++)
    if (got[i] != want[i])
      return ow_fail(k->msg, "%s: token %zu channel %zu: 0x%04x, the host's float32 order gives "
                     "0x%04x [%s]", op, i / h, i % h, got[i], want[i], d->desc);
  if (ow_unpoisoned(got + n * h, (cap - n) * h * 2, pz) >= 0)
    return ow_fail(k->msg, "%s: wrote past num_tokens %u [%s]", op, n, d->desc);
  return 0;
}

/* ---- one round: layout, dispatch, combine, LL bf16 (and FP8) ------------------------------ */

static int round_tp(struct rk *k, const struct ow_case *d, uint8_t pz, uint64_t *dig) {
  const uint32_t r = k->rank, h = k->h_, K = k->K, W = k->W, n = d->in[r].num_tokens;
  const struct ref_rank_in *in = &d->in[r];
  const struct ref_dispatch_out *e = &d->disp[r];
  int32_t tpr[OW_MAXW], *tpe = malloc(k->E * 4);
  uint8_t *tir = malloc((size_t)n * W + 1);
  ref_layout(&d->shape, W, in, tpr, tpe, tir);
  int bad = poison(k, B_TPR, pz) || poison(k, B_TPE, pz) || poison(k, B_TIR, pz);
  struct dep_layout_args la = {DEV(k, B_IDX), d->sc.itype, n, DEV(k, B_TPR), DEV(k, B_TPE),
                               DEV(k, B_TIR)};
  int rc = bad ? 0 : dep_layout(k->c, &la, k->s);
  bad = bad || rc != 0 || get(k, B_TPR) || memcmp(k->host, tpr, W * 4) != 0 ||
        get(k, B_TPE) || memcmp(k->host, tpe, k->E * 4) != 0 || get(k, B_TIR) ||
        memcmp(k->host, tir, (size_t)n * W) != 0 ||
        ow_unpoisoned(k->host + (size_t)n * W, (size_t)(k->mt - n) * W, pz) >= 0;
  free(tpe);
  free(tir);
  if (bad)
    return k->msg[0] ? 1 : ow_fail(k->msg, "layout: %s, outputs differ from the oracle [%s]",
                                   rc ? dep_errmsg(k->c) : "ok", d->desc);

  if (poison(k, B_RX, pz) || poison(k, B_RIDX, pz) || poison(k, B_RW, pz) || poison(k, B_CNT, pz))
    return 1;
  uint32_t nrecv = 0xdeadbeef;
  struct dep_dispatch_args da = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W), n,
                                 DEV(k, B_RX), DEV(k, B_RIDX), DEV(k, B_RW), DEV(k, B_CNT), &nrecv};
  CALL(k, dep_dispatch(k->c, &da, k->h, k->s), "dep_dispatch");
  if (nrecv != e->num_recv)
    return ow_fail(k->msg, "dispatch: num_recv %u, want %u [%s]", nrecv, e->num_recv, d->desc);
  size_t rows = k->sz[B_RX] / (h * 2);
  if (get(k, B_RX))
    return 1;
  if (memcmp(k->host, e->x, (size_t)nrecv * h * 2) != 0)
    return ow_fail(k->msg, "dispatch: recv_x differs from the oracle [%s]", d->desc);
  if (ow_unpoisoned(k->host + (size_t)nrecv * h * 2, (rows - nrecv) * h * 2, pz) >= 0)
    return ow_fail(k->msg, "dispatch: recv_x written past num_recv [%s]", d->desc);
  *dig = ow_fnv(*dig, k->host, (size_t)nrecv * h * 2);
  if (get(k, B_RIDX) || memcmp(k->host, e->topk_idx, (size_t)nrecv * K * 4) != 0 ||
      ow_unpoisoned(k->host + (size_t)nrecv * K * 4, (rows - nrecv) * K * 4, pz) >= 0)
    return ow_fail(k->msg, "dispatch: recv_topk_idx differs [%s]", d->desc);
  if (get(k, B_RW) || memcmp(k->host, e->topk_weights, (size_t)nrecv * K * 4) != 0)
    return ow_fail(k->msg, "dispatch: recv_topk_weights differ [%s]", d->desc);
  if (get(k, B_CNT) || memcmp(k->host, e->count, k->le * 4) != 0)
    return ow_fail(k->msg, "dispatch: recv_count_per_expert differs [%s]", d->desc);

  if (poison(k, B_OUT, pz))
    return 1;
  struct dep_combine_args ca = {DEV(k, B_CX), DEV(k, B_OUT)};
  CALL(k, dep_combine(k->c, &ca, k->h, k->s), "dep_combine");
  uint16_t *want = malloc(((size_t)n * h + 1) * 2);
  float *acc = malloc(h * 4);
  want_combine(d, r, want, acc);
  rc = get(k, B_OUT) || check_sum(k, d, &d->comb[r], want, n, k->mt, pz, "combine");
  free(want);
  free(acc);
  *dig = ow_fnv(*dig, k->host, (size_t)n * h * 2);
  return rc;
}

static int round_ll(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz, uint64_t *dig) {
  const uint32_t r = k->rank, h = k->h_, G = h / 128, rows = k->rows;
  const struct ref_rank_in *in = &d->in_ll[r];
  const struct ref_ll_out *e = &d->ll[r];
  const size_t es = fp8 ? 1 : 2;
  if (poison(k, B_LRX, pz) || poison(k, B_LSC, pz) || poison(k, B_LCNT, pz) || poison(k, B_LOUT, pz))
    return 1;
  struct dep_ll_dispatch_args la = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, in->num_tokens, fp8,
                                    DEV(k, B_LRX), fp8 ? DEV(k, B_LSC) : NULL, DEV(k, B_LCNT)};
  struct dep_ll_combine_args lc = {DEV(k, B_LX), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W),
                                   DEV(k, B_LOUT)};
  /* Back to back with no synchronisation between them, as a graph would run them. */
  CALL(k, dep_ll_dispatch(k->c, &la, k->h, k->s), "dep_ll_dispatch");
  CALL(k, dep_ll_combine(k->c, &lc, k->h, k->s), "dep_ll_combine");
  if (get(k, B_LCNT))
    return 1;
  if (memcmp(k->host, e->count, k->le * 4) != 0)
    return ow_fail(k->msg, "ll_dispatch%s: recv_count differs [%s]", fp8 ? " fp8" : "", d->desc);
  if (get(k, B_LRX))
    return 1;
  for (uint32_t l = 0; l < k->le; l++)
    for (uint32_t i = 0; i < rows; i++) {
      size_t row = (size_t)l * rows + i;
      const uint8_t *got = k->host + row * h * es;
      if ((int32_t)i >= e->count[l]) {
        if (ow_unpoisoned(got, h * es, pz) >= 0)
          return ow_fail(k->msg, "ll_dispatch: expert %u row %u past recv_count written [%s]", l,
                         i, d->desc);
      } else if (memcmp(got, fp8 ? (const void *)(e->x8 + row * h) : (const void *)(e->x + row * h),
                        h * es) != 0) {
        return ow_fail(k->msg, "ll_dispatch%s: expert %u row %u (rank %u token %u) differs [%s]",
                       fp8 ? " fp8" : "", l, i, e->from[row].rank, e->from[row].token, d->desc);
      }
    }
  for (uint32_t l = 0; l < k->le; l++) /* valid rows only: the rest holds this round's poison */
    *dig = ow_fnv(*dig, k->host + (size_t)l * rows * h * es, (size_t)e->count[l] * h * es);
  if (fp8) {
    if (get(k, B_LSC))
      return 1;
    for (uint32_t l = 0; l < k->le; l++)
      for (int32_t i = 0; i < e->count[l]; i++) {
        size_t row = (size_t)l * rows + (size_t)i;
        if (memcmp(k->host + row * G * 4, e->scales + row * G, G * 4) != 0)
          return ow_fail(k->msg, "ll_dispatch fp8: expert %u row %d: scales differ [%s]", l, i,
                         d->desc);
      }
  }
  uint16_t *want = malloc(((size_t)in->num_tokens * h + 1) * 2);
  float *acc = malloc(h * 4);
  want_ll_combine(d, r, want, acc);
  int rc = get(k, B_LOUT) ||
           check_sum(k, d, &d->llc[r], want, in->num_tokens, k->maxll, pz, "ll_combine");
  free(want);
  free(acc);
  *dig = ow_fnv(*dig, k->host, (size_t)in->num_tokens * h * 2);
  return rc;
}

static int upload(struct rk *k, const struct ow_case *d) {
  const uint32_t r = k->rank, n = d->in[r].num_tokens, h = k->h_, K = k->K;
  return put(k, B_X, d->in[r].x, (size_t)n * h * 2) ||
         put(k, B_IDX, d->idx[r], (size_t)n * K * (d->sc.itype == DEP_INDEX_I64 ? 8 : 4)) ||
         put(k, B_W, d->in[r].topk_weights, (size_t)n * K * 4) ||
         put(k, B_CX, d->cx[r], (size_t)d->disp[r].num_recv * h * 2) ||
         put(k, B_LX, d->lx[r], k->sz[B_LX]);
}

/* Rounds over cases of one shape: each round every op; a case seen again
 * (under another poison) must give bit-identical outputs. */
struct rounds {
  const struct ow_case *cases;
  int ncases, nrounds;
};

static int body_rounds(struct rk *k, void *arg) {
  const struct rounds *a = arg;
  uint64_t first[16] = {0};
  for (int round = 0; round < a->nrounds; round++) {
    const struct ow_case *d = &a->cases[round % a->ncases];
    uint8_t pz = (round / a->ncases) & 1 ? 0x5A : 0xA5;
    uint64_t dig = 0;
    int rc = upload(k, d) || round_tp(k, d, pz, &dig) || round_ll(k, d, 0, pz, &dig) ||
             (d->sc.fp8 && round_ll(k, d, 1, pz, &dig));
    if (rc) {
      /* A call with no tokens reports what the kernels recorded, if anything. */
      struct dep_layout_args z = {NULL, DEP_INDEX_I64, 0, DEV(k, B_TPR), DEV(k, B_TPE), NULL};
      int zr = dep_layout(k->c, &z, k->s);
      size_t l = strlen(k->msg);
      snprintf(k->msg + l, OW_MSG - l, " (round %d)%s%s", round, zr ? "; the GPU recorded: " : "",
               zr ? dep_errmsg(k->c) : "");
      return 1;
    }
    if (round < a->ncases)
      first[round % 16] = dig;
    else if (dig != first[round % a->ncases % 16])
      return ow_fail(k->msg, "round %d repeats round %d's inputs but its outputs differ [%s]",
                     round, round % a->ncases, d->desc);
  }
  return 0;
}

/* ---- worlds: rank processes, or rank threads -------------------------------------------- */

typedef int (*rank_body)(struct rk *k, void *arg);

struct world {
  struct tu_daemon dm;
  char *msg; /* shared: one message per rank */
};

static void world_start(struct world *w, const char *yaml) {
  ck_assert_msg(tu_daemon_start(&w->dm, yaml) == 0, "deepepd did not start on the cuda backend");
  w->msg = mmap(NULL, OW_MAXW * OW_MSG, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(w->msg != MAP_FAILED);
}

/* The daemon must still answer and hold no job, then stop cleanly. */
static void world_stop(struct world *w) {
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  ck_assert_msg(dep_connect(c, w->dm.sock) == 0, "%s", dep_errmsg(c));
  struct dep_status *st = NULL;
  for (int i = 0; i < 200; i++) {
    ck_assert_msg(dep_status(c, &st) == 0, "deepepd stopped answering: %s", dep_errmsg(c));
    uint32_t jobs = st->num_jobs;
    dep_status_free(st);
    if (jobs == 0)
      break;
    ck_assert_msg(i < 199, "deepepd still holds %u jobs", jobs);
    usleep(10000);
  }
  dep_client_free(c);
  ck_assert_int_eq(tu_daemon_stop(&w->dm), 0);
  tu_daemon_cleanup(&w->dm);
  munmap(w->msg, OW_MAXW * OW_MSG);
}

static void report(struct world *w, uint32_t W, const int *failed, const char *what) {
  char out[OW_MAXW * (OW_MSG + 16)] = "";
  size_t len = 0;
  int n = 0;
  for (uint32_t r = 0; r < W; r++)
    if (failed[r]) {
      n++;
      len += (size_t)snprintf(out + len, sizeof out - len, "\n  rank %u: %s", r,
                              w->msg[r * OW_MSG] ? w->msg + r * OW_MSG : "(stopped)");
    }
  ck_assert_msg(n == 0, "%s: %d rank(s) failed (DEP_TEST_SEED=%llu):%s", what, n,
                (unsigned long long)ow_seed, out);
}

/* Fork one process per rank; each attaches, runs fn, detaches. */
static void run_procs(struct world *w, const char *job, const struct dep_job_shape *sh, uint32_t W,
                      rank_body fn, void *arg, const char *what) {
  memset(w->msg, 0, OW_MAXW * OW_MSG);
  pid_t pid[OW_MAXW];
  pid_t parent = getpid();
  for (uint32_t r = 0; r < W; r++) {
    fflush(stdout);
    pid[r] = fork();
    ck_assert(pid[r] >= 0);
    if (pid[r] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent)
        _exit(3);
      struct rk k;
      memset(&k, 0, sizeof k);
      k.msg = w->msg + r * OW_MSG;
      int rc = rk_open(&k, w->dm.sock, job, sh, r, W) || fn(&k, arg);
      rk_close(&k);
      _exit(rc ? 1 : 0);
    }
  }
  int failed[OW_MAXW] = {0}, done[OW_MAXW] = {0}, left = (int)W, nfail = 0;
  uint64_t deadline = ms_now() + 200000;
  while (left > 0) {
    int st, progressed = 0;
    for (uint32_t r = 0; r < W; r++) {
      if (done[r] || waitpid(pid[r], &st, WNOHANG) == 0)
        continue;
      done[r] = 1, left--, progressed = 1;
      failed[r] = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
      nfail += failed[r];
    }
    if (left > 0 && (nfail > 0 || ms_now() > deadline)) {
      for (uint32_t r = 0; r < W; r++) /* peers of a failed rank would only wait out their bound */
        if (!done[r])
          kill(pid[r], SIGKILL);
    } else if (!progressed) {
      usleep(1000);
    }
  }
  report(w, W, failed, what);
}

struct thr {
  pthread_t t;
  pthread_barrier_t *ready;
  struct rk k;
  const char *sock, *job;
  const struct dep_job_shape *sh;
  rank_body fn;
  void *arg;
  int rc;
};

static void *thr_main(void *p) {
  struct thr *t = p;
  t->rc = rk_open(&t->k, t->sock, t->job, t->sh, t->k.rank, t->k.W);
  /* Every rank of the process attached and allocated before any calls:
   * the driver may make an allocation wait for running kernels, which
   * here wait for this very process (see client/cuda_ops.h). */
  pthread_barrier_wait(t->ready);
  t->rc = t->rc || t->fn(&t->k, t->arg);
  rk_close(&t->k);
  return NULL;
}

/* Every rank a thread of this process with its own client and stream. */
static void run_threads(struct world *w, const char *job, const struct dep_job_shape *sh,
                        uint32_t W, rank_body fn, void *arg, const char *what) {
  memset(w->msg, 0, OW_MAXW * OW_MSG);
  /* One hardware queue per stream, or kernels of two ranks queued in one
   * queue wait for each other (cuda_ops.h); this process has not started
   * CUDA yet (gpu_ready probes in a child). */
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  struct thr t[OW_MAXW];
  memset(t, 0, sizeof t);
  pthread_barrier_t ready;
  ck_assert_int_eq(pthread_barrier_init(&ready, NULL, W), 0);
  for (uint32_t r = 0; r < W; r++) {
    t[r] = (struct thr){.ready = &ready, .sock = w->dm.sock, .job = job, .sh = sh, .fn = fn,
                        .arg = arg};
    t[r].k.rank = r, t[r].k.W = W, t[r].k.msg = w->msg + r * OW_MSG;
    ck_assert_int_eq(pthread_create(&t[r].t, NULL, thr_main, &t[r]), 0);
  }
  int failed[OW_MAXW] = {0};
  for (uint32_t r = 0; r < W; r++) {
    pthread_join(t[r].t, NULL);
    failed[r] = t[r].rc != 0;
  }
  pthread_barrier_destroy(&ready);
  report(w, W, failed, what);
}

/* ---- every op against the oracle ------------------------------------------------------- */

static const struct ow_scenario scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {1, 128, 1, 4, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0},
  {1, 7168, 8, 32, 64, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {2, 2048, 2, 8, 128, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {2, 128, 8, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 0},
  {2, 2048, 1, 4, 300, 300, P_RANDOM, T_MAX, DEP_INDEX_I64, 1}, /* scans span several chunks */
  {3, 128, 4, 6, 24, 0, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},     /* max_ll 0: the default */
  {4, 128, 16, 16, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {4, 7168, 2, 8, 16, 8, P_RANDOM, T_ONE, DEP_INDEX_I64, 0},
  {4, 2048, 8, 32, 64, 64, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 1},
  {4, 128, 8, 16, 16, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0},
  {4, 128, 1, 4, 512, 256, P_ONE_EXPERT, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 8, 64, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {8, 7168, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {8, 2048, 16, 128, 32, 16, P_DUP, T_MAX, DEP_INDEX_I64, 0},
  {8, 128, 2, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I32, 1},
  {8, 128, 8, 256, 64, 64, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},  /* 32 experts a rank */
  {8, 2048, 8, 64, 64, 32, P_RANDOM, T_ONE, DEP_INDEX_I64, 0},
};

static void run_scenario(const struct ow_scenario *sc, int salt, bool threads) {
  ow_seed_init((uint64_t)salt);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, sc, sc->fp8);
  struct world w;
  world_start(&w, NULL);
  struct rounds a = {d, 1, 2};
  char job[32];
  snprintf(job, sizeof job, "%s-%d", threads ? "threads" : "procs", salt);
  uint64_t t0 = ms_now();
  if (threads)
    run_threads(&w, job, &d->shape, sc->world, body_rounds, &a, d->desc);
  else
    run_procs(&w, job, &d->shape, sc->world, body_rounds, &a, d->desc);
  printf("cuda_ops %s: %s: ok in %llu ms\n", threads ? "threads" : "processes", d->desc,
         (unsigned long long)(ms_now() - t0));
  world_stop(&w);
  ow_case_free(d);
  free(d);
}

/* Ranks as processes (on one GPU, or spread by DEP_TEST_GPUS): every output as the oracle
 * says, twice, bit-identical. */
START_TEST(ranks_as_processes_match_the_oracle) {
  NEEDS_GPU();
  run_scenario(&scenarios[_i], _i, false);
}
END_TEST

static const struct ow_scenario thread_scenarios[] = {
  {4, 2048, 8, 32, 64, 64, P_RANDOM, T_MIXED, DEP_INDEX_I64, 1},
  {8, 128, 2, 16, 32, 32, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
  {2, 7168, 8, 16, 16, 16, P_DUP, T_MAX, DEP_INDEX_I32, 0},
};

/*
 * Ranks as threads need a hardware queue per stream (cuda_ops.h), and an MPS
 * client gets too few: measured on an H200, CUDA_DEVICE_MAX_CONNECTIONS=32
 * under MPS fails context creation ("hardware resources required to support
 * device connections have been exhausted"), and the default 8 shared among
 * 4-8 rank streams let one rank's kernel wait behind another's.  So these
 * run outside MPS (as make check-gpu's time-sliced case does) and skip,
 * saying so, under it.
 */
static bool threads_ready(const char *test) {
  struct tu_gpus g;
  if (!gpu_probe(test, &g))
    return false;
  if (g.mps) {
    printf("%.*s: skipped: MPS is running; ranks as threads of one process need a hardware "
           "queue per stream, which MPS clients do not get; run this test without MPS\n",
           (int)(strlen(test) - 3), test);
    return false;
  }
  return true;
}

/* Ranks as threads of one process, each its own client and stream: the same. */
START_TEST(ranks_as_threads_of_one_process_match_the_oracle) {
  if (!threads_ready(__func__))
    return;
  run_scenario(&thread_scenarios[_i], 100 + _i, true);
}
END_TEST

/* Without MPS the rank processes time-slice the GPU: slower, never stuck. */
START_TEST(time_sliced_ranks_make_progress) {
  NEEDS_GPU();
  /* Both ranks on one GPU whatever DEP_TEST_GPUS says, or nothing is time-sliced
   * (this test runs in a process of its own, with its ranks its children). */
  setenv("DEP_TEST_GPUS", "1", 1);
  static const struct ow_scenario sc = {2, 128, 2, 8, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1};
  run_scenario(&sc, 200, false);
}
END_TEST

/* 60 rounds of dispatch, combine, LL dispatch, LL combine (240 calls), inputs
 * changing every round, FP8 in alternate sets, every output checked. */
START_TEST(two_hundred_forty_calls_back_to_back_stay_correct) {
  NEEDS_GPU();
  enum { NSETS = 5 };
  ow_seed_init(300);
  struct ow_scenario sc = {4, 2048, 8, 32, 64, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0};
  struct ow_case *cases = malloc(NSETS * sizeof *cases);
  ck_assert_ptr_nonnull(cases);
  static const int patterns[NSETS] = {P_RANDOM, P_DUP, P_ONE_RANK, P_RANDOM, P_ONE_EXPERT};
  for (int i = 0; i < NSETS; i++) {
    sc.itype = i & 1 ? DEP_INDEX_I64 : DEP_INDEX_I32;
    sc.pattern = patterns[i];
    sc.tokens = i == 3 ? T_MAX : T_MIXED;
    ow_case_make(&cases[i], &sc, i & 1);
  }
  struct world w;
  world_start(&w, NULL);
  struct rounds a = {cases, NSETS, 60};
  uint64_t t0 = ms_now();
  run_procs(&w, "back-to-back", &cases[0].shape, sc.world, body_rounds, &a, "240 calls");
  printf("cuda_ops: 240 calls back to back (with checks) in %llu ms\n",
         (unsigned long long)(ms_now() - t0));
  world_stop(&w);
  for (int i = 0; i < NSETS; i++)
    ow_case_free(&cases[i]);
  free(cases);
}
END_TEST

/* ---- faults ------------------------------------------------------------------------------ */

#define SHORT_OPS "limits:\n  op_timeout_ms: 500\n"
static const struct ow_scenario small = {2, 128, 2, 8, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};

#define EXPECT(k, got, want, what)                                                             \
  do {                                                                                         \
    int g_ = (got);                                                                            \
    if (g_ != (want))                                                                          \
      return ow_fail((k)->msg, "rank %u: %s returned %s (%s), expected %s", (k)->rank, what,   \
                     dep_errname(g_), dep_errmsg((k)->c), dep_errname(want));                  \
  } while (0)

struct fault_arg {
  const struct ow_case *d;
  int ll;
};

/* Rank 1 attaches but never calls; rank 0's call must fail within the bound. */
static int body_silent_peer(struct rk *k, void *arg) {
  const struct fault_arg *a = arg;
  const struct ow_case *d = a->d;
  if (k->rank == 1) {
    usleep(2500000);
    return 0;
  }
  if (upload(k, d))
    return 1;
  uint32_t nrecv = 0, n = d->in[0].num_tokens;
  struct dep_dispatch_args da = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W), n,
                                 DEV(k, B_RX), DEV(k, B_RIDX), DEV(k, B_RW), DEV(k, B_CNT), &nrecv};
  struct dep_ll_dispatch_args la = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, n, 0, DEV(k, B_LRX),
                                    NULL, DEV(k, B_LCNT)};
  struct dep_ll_combine_args lc = {DEV(k, B_LX), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W),
                                   DEV(k, B_LOUT)};
  uint64_t t0 = ms_now(), waited;
  if (!a->ll) {
    EXPECT(k, dep_dispatch(k->c, &da, k->h, k->s), DEP_ERR_TIMEOUT, "dep_dispatch");
    waited = ms_now() - t0;
  } else {
    EXPECT(k, dep_ll_dispatch(k->c, &la, k->h, k->s), 0, "dep_ll_dispatch");
    if (ms_now() - t0 > 200)
      return ow_fail(k->msg, "dep_ll_dispatch blocked %llu ms; it must not synchronise",
                     (unsigned long long)(ms_now() - t0));
    CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
    waited = ms_now() - t0;
    EXPECT(k, dep_ll_combine(k->c, &lc, k->h, k->s), DEP_ERR_TIMEOUT, "dep_ll_combine");
  }
  if (waited < 450 || waited > 2000)
    return ow_fail(k->msg, "the call failed after %llu ms; the bound is 500 ms",
                   (unsigned long long)waited);
  if (strstr(dep_errmsg(k->c), "waiting for rank 1") == NULL)
    return ow_fail(k->msg, "the message does not name rank 1: %s", dep_errmsg(k->c));
  printf("cuda_ops: %s with a silent peer: DEP_ERR_TIMEOUT after %llu ms: %s\n",
         a->ll ? "ll_dispatch" : "dispatch", (unsigned long long)waited, dep_errmsg(k->c));
  fflush(stdout); /* a rank process ends with _exit */
  EXPECT(k, dep_ll_dispatch(k->c, &la, k->h, k->s), DEP_ERR_STATE, "a call after the timeout");
  return 0;
}

START_TEST(a_rank_that_never_calls_is_a_bounded_timeout_and_the_daemon_carries_on) {
  NEEDS_GPU();
  ow_seed_init(400);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  struct world w;
  world_start(&w, SHORT_OPS);
  struct fault_arg tp = {d, 0}, ll = {d, 1};
  run_procs(&w, "silent-tp", &d->shape, 2, body_silent_peer, &tp, "silent peer, dispatch");
  run_procs(&w, "silent-ll", &d->shape, 2, body_silent_peer, &ll, "silent peer, ll_dispatch");
  struct rounds a = {d, 1, 2}; /* a fresh job on the same daemon and GPUs works */
  run_procs(&w, "after-timeouts", &d->shape, 2, body_rounds, &a, d->desc);
  world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

static int put_bad_idx(struct rk *k, const struct ow_case *d, int64_t bad) {
  size_t n = (size_t)d->in[k->rank].num_tokens * k->K;
  int64_t *idx = malloc(n * 8 + 8);
  memcpy(idx, d->idx[k->rank], n * 8);
  idx[0] = bad;
  int rc = put(k, B_IDX, idx, n * 8);
  free(idx);
  return rc;
}

/* Bad arguments: refused on the host, nothing launched.  Bad expert ids:
 * found by the kernels, DEP_ERR_INVALID through the error word. */
static int body_invalid(struct rk *k, void *arg) {
  const struct ow_case *d = arg;
  const uint32_t n = d->in[k->rank].num_tokens;
  uint64_t dig = 0;
  uint32_t nrecv = 0;
  struct dep_dispatch_args da = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W), n,
                                 DEV(k, B_RX), DEV(k, B_RIDX), DEV(k, B_RW), DEV(k, B_CNT), &nrecv};
  struct dep_ll_dispatch_args la = {DEV(k, B_X), DEV(k, B_IDX), d->sc.itype, n, 0, DEV(k, B_LRX),
                                    NULL, DEV(k, B_LCNT)};
  struct dep_ll_combine_args lc = {DEV(k, B_LX), DEV(k, B_IDX), d->sc.itype, DEV(k, B_W),
                                   DEV(k, B_LOUT)};
  if (upload(k, d))
    return 1;
  if (k->rank == 0) { /* only rank 0 makes them: none may count as a call */
    struct dep_dispatch_args b = da;
    b.x = NULL;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch with x NULL");
    if (strstr(dep_errmsg(k->c), "x is NULL") == NULL)
      return ow_fail(k->msg, "message does not name x: %s", dep_errmsg(k->c));
    b = da;
    b.num_tokens = k->mt + 1;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch over max_tokens");
    b = da;
    b.index_type = 7;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch, index_type 7");
    b = da;
    b.topk_weights = (const float *)((uintptr_t)DEV(k, B_W) + 2);
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch, unaligned weights");
    struct dep_ll_dispatch_args bl = la;
    bl.use_fp8 = 2;
    EXPECT(k, dep_ll_dispatch(k->c, &bl, k->h, k->s), DEP_ERR_INVALID, "ll_dispatch, use_fp8 2");
    bl = la;
    bl.use_fp8 = 1; /* recv_scales NULL */
    EXPECT(k, dep_ll_dispatch(k->c, &bl, k->h, k->s), DEP_ERR_INVALID, "fp8 without scales");
    EXPECT(k, dep_ll_combine(k->c, &lc, k->h, k->s), DEP_ERR_INVALID, "ll_combine, empty handle");
    struct dep_layout_args lb = {DEV(k, B_IDX), d->sc.itype, n, NULL, DEV(k, B_TPE),
                                 DEV(k, B_TIR)};
    EXPECT(k, dep_layout(k->c, &lb, k->s), DEP_ERR_INVALID, "layout, tokens_per_rank NULL");
  }
  /* The ranks are still in step: a whole round is right. */
  if (round_tp(k, d, 0xA5, &dig) || round_ll(k, d, 0, 0xA5, &dig))
    return 1;
  /* An id past num_experts in dispatch: that rank's call says so after its sync. */
  if (k->rank == 0 && put_bad_idx(k, d, k->E))
    return 1;
  EXPECT(k, dep_dispatch(k->c, &da, k->h, k->s), k->rank == 0 ? DEP_ERR_INVALID : 0,
         "dispatch with topk_idx[0][0] = num_experts on rank 0");
  if (k->rank == 0 && strstr(dep_errmsg(k->c), "topk_idx of token 0") == NULL)
    return ow_fail(k->msg, "message does not name the token: %s", dep_errmsg(k->c));
  /* ... and the job carries on: the ranks stayed in step. */
  if (upload(k, d) || round_tp(k, d, 0x5A, &dig) || round_ll(k, d, 0, 0x5A, &dig))
    return 1;
  /* In ll_dispatch (no sync) the next call reports it and is not made; the
   * peer, left waiting for that call, times out within its bound. */
  if (k->rank == 0 && put_bad_idx(k, d, -2))
    return 1;
  EXPECT(k, dep_ll_dispatch(k->c, &la, k->h, k->s), 0, "ll_dispatch (bad id on rank 0)");
  CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  EXPECT(k, dep_ll_combine(k->c, &lc, k->h, k->s), k->rank == 0 ? DEP_ERR_INVALID : 0,
         "the ll_combine after it");
  if (k->rank == 1) {
    CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
    EXPECT(k, dep_ll_dispatch(k->c, &la, k->h, k->s), DEP_ERR_TIMEOUT, "the call after that");
  }
  struct dep_layout_args lay = {DEV(k, B_IDX), d->sc.itype, n, DEV(k, B_TPR), DEV(k, B_TPE),
                                DEV(k, B_TIR)};
  EXPECT(k, dep_layout(k->c, &lay, k->s), DEP_ERR_STATE, "a call once out of step");
  return 0;
}

START_TEST(bad_arguments_and_bad_expert_ids_are_invalid_and_never_corrupt_memory) {
  NEEDS_GPU();
  ow_seed_init(500);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  struct world w;
  world_start(&w, SHORT_OPS);
  run_procs(&w, "invalid", &d->shape, 2, body_invalid, d, "bad arguments and ids");
  world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Where the ranks go, said once: an unchecked fixture runs in the runner
 * process (before the oracle's tests), which the probe keeps free of CUDA. */
static void say_placement(void) {
  if (!on_cuda())
    return;
  struct tu_gpus g;
  char why[256] = "";
  int rc = tu_gpus_probe(&g, why, sizeof why);
  if (rc > 0 && g.n > 1)
    printf("cuda_ops: ranks spread over %d GPUs (rank r on GPU r %% %d; %d visible)\n", g.n, g.n,
           g.visible);
  else if (rc > 0)
    printf("cuda_ops: every rank on GPU 0 (%d visible; DEP_TEST_GPUS=N or all spreads them)\n",
           g.visible);
  else if (rc < 0)
    printf("cuda_ops: %s\n", why); /* and every test fails saying so */
  fflush(stdout);
}

Suite *cuda_ops_suite(void);
Suite *cuda_ops_suite(void) {
  Suite *s = suite_create("cuda_ops");
  TCase *tc = tcase_create("oracle");
  tcase_set_tags(tc, "gpu");
  tcase_add_unchecked_fixture(tc, say_placement, NULL);
  tcase_set_timeout(tc, 240);
  tcase_add_loop_test(tc, ranks_as_processes_match_the_oracle, 0,
                      (int)(sizeof scenarios / sizeof scenarios[0]));
  tcase_add_test(tc, two_hundred_forty_calls_back_to_back_stay_correct);
  suite_add_tcase(s, tc);
  /* Its own case, so that it can run outside MPS alone (CK_RUN_CASE=threads). */
  TCase *th = tcase_create("threads");
  tcase_set_tags(th, "gpu");
  tcase_set_timeout(th, 240);
  tcase_add_loop_test(th, ranks_as_threads_of_one_process_match_the_oracle, 0,
                      (int)(sizeof thread_scenarios / sizeof thread_scenarios[0]));
  suite_add_tcase(s, th);
  TCase *faults = tcase_create("faults");
  tcase_set_tags(faults, "gpu");
  tcase_set_timeout(faults, 120);
  tcase_add_test(faults, a_rank_that_never_calls_is_a_bounded_timeout_and_the_daemon_carries_on);
  tcase_add_test(faults, bad_arguments_and_bad_expert_ids_are_invalid_and_never_corrupt_memory);
  suite_add_tcase(s, faults);
  TCase *ts = tcase_create("timesliced");
  tcase_set_tags(ts, "gpu");
  tcase_set_timeout(ts, 240);
  tcase_add_test(ts, time_sliced_ranks_make_progress);
  suite_add_tcase(s, ts);
  return s;
}
