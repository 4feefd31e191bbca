/*
 * ep.c — the dispatch/combine benchmark (issue 4), written against the
 * public API only (deepep.h), plus the CUDA driver seam for the caller's
 * own device buffers, streams and events on the cuda backend.
 *
 *   ep -s SOCKET [-S SOCKET_NO_WARMUP] [-n 2,4,8] [-m processes,threads] [-g GPUS]
 *      [-c CALLS] [-w WARMUP] [-r COPY_REPS] [-t TOKENS] [-l LL_TOKENS] [-H HIDDEN]
 *      [-e EXPERTS] [-k TOPK] [-x SEED] [-o RAW.csv] [-F]
 *
 * For each rank count and mode (ranks as processes, or as threads of one
 * process, one client handle and stream each) a fresh world attaches as
 * one job, then times with every rank released together per call:
 *   - the first call of each operation after dep_attach, in this order:
 *     dispatch, combine, ll_dispatch (bf16), ll_combine, ll_dispatch (FP8),
 *     ll_combine (the one after the FP8 dispatch);
 *   - WARMUP untimed pairs, then CALLS timed pairs of each (dispatch then
 *     combine, as a trainer alternates them); median and p99 of the
 *     per-call time, which is the slowest rank's time for that call;
 *   - a copy ceiling in the same run: every rank copies, at the same time,
 *     as many bytes as it moved in the operation (memcpy on the host
 *     backend, cuMemcpyDtoDAsync on the cuda one); COPY_REPS reps, median.
 * With -g N (cuda) the ranks spread over N GPUs, rank r on GPU r % N (-g 0:
 * every visible GPU), and the ceiling becomes the peer copy: every rank at
 * once copies to every rank (itself included) the bytes the op sent that
 * rank, by cuMemcpyPeerAsync into a buffer on the destination's GPU (or
 * cuMemcpyDtoDAsync on its own GPU), one stream per destination.  Such a
 * run also prints the plain pairwise figure once: 256 MiB from GPU 0 to
 * GPU 1 by cuMemcpyPeerAsync, alone and in both directions at once.
 * With -S, a second world per (ranks, mode) attaches to a daemon whose
 * config says kernel_warmup: false and times only the first calls; -F
 * times only attach and the first calls against -s (where two daemons'
 * pools would not fit at once, run the warm-up-off daemon separately).
 *
 * Bytes moved per call (summed over ranks; every row passes through a
 * slab, the rank's own rows included):
 *   dispatch     rows sent x (2*hidden + 16 + 8*topk): token, source index,
 *                id count, remapped ids and weights (the row of host_ops.h)
 *   combine      vectors sent back (= rows received) x 2*hidden
 *   ll_dispatch  rows sent x (payload + 16 + 4*ids), payload 2*hidden (bf16)
 *                or hidden + 4*hidden/128 (FP8 with scales), ids = the
 *                token's distinct experts on that rank
 *   ll_combine   vectors sent back (one per token and expert) x 2*hidden
 * GB/s = bytes / median time, and per rank (rankGB/s) the smallest rank's
 * own bytes / the same median.  The copy moves the same bytes once (each
 * byte read once and written once); "frac" = op GB/s / copy GB/s.  The
 * operations pass each byte twice (push into the receiver's slab, then the
 * receiver copies it out or reduces it), so two passes at the copy's
 * speed would score 0.5.
 *
 * Timing: on the host backend CLOCK_MONOTONIC from the common release to
 * the rank's return; on cuda, CUDA events on the rank's stream around the
 * call (the GPU reaches the first at once, so host work in the call counts).
 * Inputs are seeded random bf16 tokens, top-k distinct experts and weights;
 * the first calls' outputs are checked (counts exactly, combines against the
 * known sums) so no figure times a call that did nothing.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
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

#define MAX_RANKS 8
#define MAX_CALLS 10000
#define BARRIER_TIMEOUT_S 300.0

enum { OP_D, OP_C, OP_LLD, OP_LLC, OP_LLD8, OP_LLC8, NOPS };
static const char *op_name[NOPS] = {"dispatch",    "combine",         "ll_dispatch",
                                    "ll_combine",  "ll_dispatch_fp8", "ll_combine_fp8"};

struct opts {
  const char *sock, *sock_nowarm, *raw;
  int counts[8], ncounts;
  bool modes[2]; /* [0] processes, [1] threads */
  bool first_only; /* -F: only attach and the first calls */
  int calls, warm, reps;
  int gpus_want; /* -g: 0 means every visible GPU */
  int gpus;      /* ranks spread over this many GPUs: rank r on GPU r % gpus (cuda) */
  bool peer;     /* ranks on several GPUs: the ceiling is the peer copy */
  uint64_t seed;
  struct dep_job_shape shape;
};

/* What the ranks of one world share: a barrier, the first failure, results. */
struct shm {
  _Atomic unsigned bar_count, bar_gen;
  _Atomic int failed;
  double t_release;
  char err[512];
  double attach_ms[MAX_RANKS];
  double first[MAX_RANKS][NOPS];
  uint64_t bytes[MAX_RANKS][NOPS][MAX_RANKS]; /* [source][op][destination], per call */
  double t[]; /* calls: [rank][op][calls], then copies: [rank][op][reps] */
};

/* The bytes rank r sends in one call of op, to every rank (itself included). */
static uint64_t rank_bytes(const struct shm *s, int r, int op, int n) {
  uint64_t b = 0;
  for (int d = 0; d < n; d++)
    b += s->bytes[r][op][d];
  return b;
}

static void usage(void) {
  fprintf(stderr,
          "usage: ep -s SOCKET [-S SOCKET_NO_WARMUP] [-n 2,4,8] [-m processes,threads] [-g GPUS]\n"
          "          [-c CALLS] [-w WARMUP] [-r COPY_REPS] [-t TOKENS] [-l LL_TOKENS] [-H HIDDEN]\n"
          "          [-e EXPERTS] [-k TOPK] [-x SEED] [-o RAW.csv] [-F]\n"
          "  -s  deepepd socket (its backend, host or cuda, is the one benchmarked)\n"
          "  -S  a second deepepd with kernel_warmup: false: time its first calls too\n"
          "  -n  rank counts (default 2,4,8)        -m  modes (default processes,threads)\n"
          "  -g  spread the ranks over GPUS GPUs, rank r on GPU r %% GPUS (default 1: all on\n"
          "      GPU 0; 0: every visible GPU); with 2 or more the ceiling is the peer copy,\n"
          "      and GPU 0 -> GPU 1 peer copy figures are printed once\n"
          "  -c  timed calls per op (default 200)   -w  untimed warm-up pairs (default 5)\n"
          "  -r  copy-ceiling reps (default 20)     -o  append every raw time to a CSV file\n"
          "  -F  attach and time the first calls only (e.g. against a kernel_warmup: false daemon)\n"
          "  shape: -t 4096 tokens, -l 128 low-latency tokens, -H 7168, -e 256, -k 8\n");
  exit(2);
}

/* ---- one rank ------------------------------------------------------------- */

static const struct cudadrv *cu; /* the driver, through the seam (cudadrv.h) */

struct rank {
  const struct opts *o;
  struct shm *s;
  int r, n;
  bool cuda, first_only;
  const char *sock, *job;
  dep_client_t *c;
  dep_handle_t *htp, *hll;
  CUdevice dev; /* this rank's GPU: r % gpus */
  CUcontext ctx;
  CUstream st;
  CUevent e0, e1;
  uint32_t le, llrows, num_recv, exp_recv;
  uint16_t *hx;     /* host copy of x */
  int64_t *hidx;    /* host copy of topk_idx */
  float *hw;        /* host copy of topk_weights */
  uint8_t *mult;    /* per token: ranks that receive it */
  int32_t *exp_tp;  /* per local expert: (row, k) pairs naming it */
  int32_t *exp_ll;  /* per local expert: LL rows */
  /* Buffers of the backend (host or device memory). */
  void *x, *idx, *w, *rx, *ridx, *rw, *rcnt, *out, *llrx, *llrx8, *llsc, *llcnt, *llout;
};

static struct shm *g_shm; /* for fail() */

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...) {
  int z = 0;
  if (g_shm != NULL && atomic_compare_exchange_strong(&g_shm->failed, &z, 1)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_shm->err, sizeof g_shm->err, fmt, ap);
    va_end(ap);
  }
  _exit(1);
}

#define CK(call)                                                                  \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS)                                                       \
      fail("%s failed: %s", #call, cudadrv_errstr(r_));                           \
  } while (0)

static void cuda_load(void) {
  char why[256];
  cu = cudadrv_load(why, sizeof why);
  if (cu == NULL)
    fail("CUDA: %s", why);
}

static void *balloc(struct rank *k, size_t n) {
  if (!k->cuda) {
    void *p = calloc(1, n ? n : 1);
    if (p == NULL)
      fail("rank %d: out of memory for %zu bytes", k->r, n);
    return p;
  }
  CUdeviceptr d;
  CK(cu->cuMemAlloc(&d, n ? n : 1));
  return (void *)(uintptr_t)d;
}

static void bfree(struct rank *k, void *p) {
  if (!k->cuda)
    free(p);
  else if (p != NULL)
    CK(cu->cuMemFree((CUdeviceptr)(uintptr_t)p));
}

static void upload(struct rank *k, void *dst, const void *src, size_t n) {
  if (!k->cuda)
    memcpy(dst, src, n);
  else
    CK(cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, n));
}

static void download(struct rank *k, void *dst, const void *src, size_t n) {
  if (!k->cuda)
    memcpy(dst, src, n);
  else
    CK(cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, n));
}

/* A bounded barrier over the world; returns the time the last rank arrived. */
static double bar_wait(struct rank *k) {
  struct shm *s = k->s;
  unsigned gen = atomic_load(&s->bar_gen);
  if (atomic_fetch_add(&s->bar_count, 1) == (unsigned)k->n - 1) {
    s->t_release = bench_now_ms();
    atomic_store(&s->bar_count, 0);
    atomic_fetch_add(&s->bar_gen, 1);
    return s->t_release;
  }
  double t0 = bench_now_ms();
  for (unsigned i = 0; atomic_load(&s->bar_gen) == gen; i++) {
    if (atomic_load(&s->failed))
      _exit(1);
    if (i < 1000)
      continue;
    sched_yield();
    if (i % 4096 == 0 && bench_now_ms() - t0 > BARRIER_TIMEOUT_S * 1e3)
      fail("rank %d: a peer never reached the barrier in %.0f s", k->r, BARRIER_TIMEOUT_S);
  }
  return s->t_release;
}

/* ---- inputs and what they must produce -------------------------------------- */

static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Rank r's topk_idx: top-k distinct experts per token, from its own stream. */
static void gen_idx(const struct opts *o, int r, int64_t *idx) {
  uint64_t s = o->seed * 1000003u + (uint64_t)r * 7919u + 1;
  uint32_t k = o->shape.topk, e = o->shape.num_experts;
  for (uint32_t t = 0; t < o->shape.max_tokens_per_rank; t++)
    for (uint32_t j = 0; j < k; j++) {
      int64_t v;
      bool dup;
      do {
        v = (int64_t)(mix(&s) % e);
        dup = false;
        for (uint32_t i = 0; i < j; i++)
          dup |= idx[(size_t)t * k + i] == v;
      } while (dup);
      idx[(size_t)t * k + j] = v;
    }
}

/*
 * Make this rank's inputs, and from every rank's topk_idx (each rank's
 * stream is known) what it must receive, and the bytes it moves per call.
 */
static void make_inputs(struct rank *k) {
  const struct opts *o = k->o;
  const uint32_t T = o->shape.max_tokens_per_rank, H = o->shape.hidden, K = o->shape.topk;
  const uint32_t L = o->shape.max_ll_tokens_per_rank, le = k->le;
  k->hx = malloc((size_t)T * H * 2);
  k->hidx = malloc((size_t)T * K * 8);
  k->hw = malloc((size_t)T * K * 4);
  k->mult = calloc(T, 1);
  k->exp_tp = calloc(le, 4);
  k->exp_ll = calloc(le, 4);
  int64_t *other = malloc((size_t)T * K * 8);
  if (!k->hx || !k->hidx || !k->hw || !k->mult || !k->exp_tp || !k->exp_ll || !other)
    fail("rank %d: out of host memory for inputs", k->r);
  uint64_t s = o->seed * 2000003u + (uint64_t)k->r * 104729u + 2;
  for (size_t i = 0; i < (size_t)T * H; i++) {
    float v = (float)((double)(mix(&s) >> 11) / 9007199254740992.0 * 4.0 - 2.0);
    k->hx[i] = f2bf(v == 0.0f ? 0.5f : v);
  }
  for (size_t i = 0; i < (size_t)T * K; i++)
    k->hw[i] = (float)((double)((mix(&s) >> 40) + 1) / 16777216.0);
  gen_idx(o, k->r, k->hidx);
  /* b[op][d]: what this rank sends rank d per call.  Dispatches send rows
   * to the ranks holding a token's experts; combines send back, to each
   * source, the vectors made from its rows. */
  uint64_t (*b)[MAX_RANKS] = k->s->bytes[k->r];
  const uint64_t fp8_payload = H + 4ull * (H / 128);
  for (int src = 0; src < k->n; src++) {
    const int64_t *idx = k->hidx;
    if (src != k->r) {
      gen_idx(o, src, other);
      idx = other;
    }
    for (uint32_t t = 0; t < T; t++) {
      uint32_t ids_on[MAX_RANKS] = {0};
      for (uint32_t j = 0; j < K; j++) {
        uint32_t e = (uint32_t)idx[(size_t)t * K + j], d = e / le;
        ids_on[d]++;
        if (d == (uint32_t)k->r) {
          k->exp_tp[e % le]++;
          if (t < L) {
            k->exp_ll[e % le]++;
            b[OP_LLC][src] += 2ull * H; /* one vector per (token, expert) back to src */
          }
        }
      }
      if (ids_on[k->r] > 0) {
        k->exp_recv++;
        b[OP_C][src] += 2ull * H; /* one summed vector per row back to src */
      }
      if (src != k->r)
        continue;
      for (int d = 0; d < k->n; d++) {
        if (ids_on[d] == 0)
          continue;
        k->mult[t]++;
        b[OP_D][d] += 2ull * H + 16 + 8ull * K;
        if (t < L) {
          b[OP_LLD][d] += 2ull * H + 16 + 4ull * ids_on[d];
          b[OP_LLD8][d] += fp8_payload + 16 + 4ull * ids_on[d];
        }
      }
    }
  }
  free(other);
  for (int d = 0; d < k->n; d++)
    b[OP_LLC8][d] = b[OP_LLC][d];
}

/*
 * Once every rank has made its inputs: the per-pair counts agree across
 * ranks.  The rows each source says it dispatches to this rank are the
 * vectors this rank's combine sends it back, and add up to the rows this
 * rank expects to receive.
 */
static void check_pairs(struct rank *k) {
  const uint64_t H = k->o->shape.hidden, row = 2 * H + 16 + 8ull * k->o->shape.topk;
  uint64_t rows = 0;
  for (int src = 0; src < k->n; src++) {
    uint64_t in = k->s->bytes[src][OP_D][k->r] / row, back = k->s->bytes[k->r][OP_C][src] / (2 * H);
    if (in != back)
      fail("rank %d: rank %d dispatches it %llu rows but its combine sends back %llu", k->r, src,
           (unsigned long long)in, (unsigned long long)back);
    rows += in;
  }
  if (rows != k->exp_recv)
    fail("rank %d: the sources dispatch it %llu rows, it expects %u", k->r,
         (unsigned long long)rows, k->exp_recv);
}

static void alloc_buffers(struct rank *k) {
  const struct dep_job_shape *sh = &k->o->shape;
  const size_t T = sh->max_tokens_per_rank, H = sh->hidden, K = sh->topk, le = k->le;
  const size_t cap = (size_t)k->n * T, llr = (size_t)le * k->llrows;
  k->x = balloc(k, T * H * 2);
  k->idx = balloc(k, T * K * 8);
  k->w = balloc(k, T * K * 4);
  upload(k, k->x, k->hx, T * H * 2);
  upload(k, k->idx, k->hidx, T * K * 8);
  upload(k, k->w, k->hw, T * K * 4);
  k->rx = balloc(k, cap * H * 2);
  k->ridx = balloc(k, cap * K * 4);
  k->rw = balloc(k, cap * K * 4);
  k->rcnt = balloc(k, le * 4);
  k->out = balloc(k, T * H * 2);
  k->llrx = balloc(k, llr * H * 2);
  k->llrx8 = balloc(k, llr * H);
  k->llsc = balloc(k, llr * (H / 128) * 4);
  k->llcnt = balloc(k, le * 4);
  k->llout = balloc(k, (size_t)sh->max_ll_tokens_per_rank * H * 2);
  if (k->cuda) {
    /* Touch every output once, as a trainer's tensors have been used before
     * they meet a call: a first call otherwise pays the GPU's first walk of
     * these pages (470 MB of LL receive buffer at 2 ranks), not the library. */
    void *outs[] = {k->rx, k->ridx, k->rw, k->rcnt, k->out, k->llrx, k->llrx8, k->llsc,
                    k->llcnt, k->llout};
    size_t lens[] = {cap * H * 2, cap * K * 4, cap * K * 4, le * 4, T * H * 2, llr * H * 2,
                     llr * H, llr * (H / 128) * 4, le * 4, (size_t)sh->max_ll_tokens_per_rank * H * 2};
    for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++)
      CK(cu->cuMemsetD8((CUdeviceptr)(uintptr_t)outs[i], 0x7f, lens[i]));
    CK(cu->cuCtxSynchronize());
    return;
  }
  /* Fault in the host pages the calls will write (a trainer's tensors are
   * resident), so that first calls show the library's cost, not ours; only
   * those, since 8 ranks' full capacities would not fit beside the pool. */
  memset(k->rx, 0x7f, (size_t)k->exp_recv * H * 2);
  memset(k->ridx, 0x7f, (size_t)k->exp_recv * K * 4);
  memset(k->rw, 0x7f, (size_t)k->exp_recv * K * 4);
  memset(k->out, 0x7f, T * H * 2);
  memset(k->llout, 0x7f, (size_t)sh->max_ll_tokens_per_rank * H * 2);
  for (size_t l = 0; l < le; l++) {
    size_t at = l * k->llrows, rows = (size_t)k->exp_ll[l];
    memset((uint8_t *)k->llrx + at * H * 2, 0x7f, rows * H * 2);
    memset((uint8_t *)k->llrx8 + at * H, 0x7f, rows * H);
    memset((uint8_t *)k->llsc + at * (H / 128) * 4, 0x7f, rows * (H / 128) * 4);
  }
}

static void free_buffers(struct rank *k) {
  void *all[] = {k->x,    k->idx,   k->w,    k->rx,    k->ridx,  k->rw,   k->rcnt,
                 k->out,  k->llrx,  k->llrx8, k->llsc, k->llcnt, k->llout};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    bfree(k, all[i]);
}

/* ---- the operations, and checks that they did their work ---------------------- */

static int run_op(struct rank *k, int op) {
  const uint32_t T = k->o->shape.max_tokens_per_rank, L = k->o->shape.max_ll_tokens_per_rank;
  switch (op) {
  case OP_D: {
    struct dep_dispatch_args a = {.x = k->x, .topk_idx = k->idx, .index_type = DEP_INDEX_I64,
                                  .topk_weights = k->w, .num_tokens = T, .recv_x = k->rx,
                                  .recv_topk_idx = k->ridx, .recv_topk_weights = k->rw,
                                  .recv_count_per_expert = k->rcnt, .num_recv = &k->num_recv};
    return dep_dispatch(k->c, &a, k->htp, k->st);
  }
  case OP_C: {
    struct dep_combine_args a = {.x = k->rx, .out = k->out};
    return dep_combine(k->c, &a, k->htp, k->st);
  }
  case OP_LLD:
  case OP_LLD8: {
    bool f8 = op == OP_LLD8;
    struct dep_ll_dispatch_args a = {.x = k->x, .topk_idx = k->idx, .index_type = DEP_INDEX_I64,
                                     .num_tokens = L, .use_fp8 = f8,
                                     .recv_x = f8 ? k->llrx8 : k->llrx,
                                     .recv_scales = f8 ? k->llsc : NULL, .recv_count = k->llcnt};
    return dep_ll_dispatch(k->c, &a, k->hll, k->st);
  }
  default: {
    /* Expert outputs = the bf16 rows the bf16 dispatch delivered (the FP8
     * dispatch of the same tokens fills the same rows). */
    struct dep_ll_combine_args a = {.x = k->llrx, .topk_idx = k->idx,
                                    .index_type = DEP_INDEX_I64, .topk_weights = k->w,
                                    .out = k->llout};
    return dep_ll_combine(k->c, &a, k->hll, k->st);
  }
  }
}

static void check_counts(struct rank *k, const void *dev, const int32_t *want, const char *what) {
  int32_t got[4096];
  if (k->le > 4096)
    fail("rank %d: %u local experts: too many to check", k->r, k->le);
  download(k, got, dev, k->le * 4);
  for (uint32_t l = 0; l < k->le; l++)
    if (got[l] != want[l])
      fail("rank %d: %s: local expert %u got %d, expected %d", k->r, what, l, got[l], want[l]);
}

/* Identity experts: combine gives mult[t] * x[t], LL combine sum_k w * x[t]. */
static void check_op(struct rank *k, int op) {
  const size_t T = k->o->shape.max_tokens_per_rank, H = k->o->shape.hidden;
  const size_t K = k->o->shape.topk, L = k->o->shape.max_ll_tokens_per_rank;
  if (op == OP_D) {
    if (k->num_recv != k->exp_recv)
      fail("rank %d: dispatch received %u rows, expected %u", k->r, k->num_recv, k->exp_recv);
    check_counts(k, k->rcnt, k->exp_tp, "dispatch recv_count_per_expert");
  } else if (op == OP_LLD || op == OP_LLD8) {
    check_counts(k, k->llcnt, k->exp_ll, op_name[op]);
  } else if (op == OP_C) {
    uint16_t *o = malloc(T * H * 2);
    if (o == NULL)
      fail("rank %d: out of host memory", k->r);
    download(k, o, k->out, T * H * 2);
    for (size_t t = 0; t < T; t += 61)
      for (size_t i = 0; i < H; i++)
        if (o[t * H + i] != f2bf((float)k->mult[t] * bf2f(k->hx[t * H + i])))
          fail("rank %d: combine out[%zu][%zu] = %g, expected %u x %g", k->r, t, i,
               bf2f(o[t * H + i]), k->mult[t], bf2f(k->hx[t * H + i]));
    free(o);
  } else {
    uint16_t *o = malloc(L * H * 2);
    if (o == NULL)
      fail("rank %d: out of host memory", k->r);
    download(k, o, k->llout, L * H * 2);
    for (size_t t = 0; t < L; t++) {
      float ws = 0;
      for (size_t j = 0; j < K; j++)
        ws += k->hw[t * K + j];
      for (size_t i = 0; i < H; i++) {
        float want = ws * bf2f(k->hx[t * H + i]), got = bf2f(o[t * H + i]);
        if (!(fabsf(got - want) <= 1e-2f * fabsf(want) + 1e-3f))
          fail("rank %d: %s out[%zu][%zu] = %g, expected %g", k->r, op_name[op], t, i, got, want);
      }
    }
    free(o);
  }
}

/* One call, all ranks released together: its time in ms on this rank. */
static double timed(struct rank *k, int op) {
  double rel = bar_wait(k);
  if (k->cuda)
    CK(cu->cuEventRecord(k->e0, k->st));
  int rc = run_op(k, op);
  if (rc != 0)
    fail("rank %d: %s: %s (%s)", k->r, op_name[op], dep_errmsg(k->c), dep_errname(rc));
  if (!k->cuda)
    return bench_now_ms() - rel;
  float ms;
  CK(cu->cuEventRecord(k->e1, k->st));
  CK(cu->cuEventSynchronize(k->e1));
  CK(cu->cuEventElapsedTime(&ms, k->e0, k->e1));
  return ms;
}

static double *tcall(struct rank *k, int op) {
  return k->s->t + ((size_t)k->r * NOPS + op) * (size_t)k->o->calls;
}

static double *tcopy(struct rank *k, int op) {
  return k->s->t + (size_t)k->n * NOPS * k->o->calls + ((size_t)k->r * NOPS + op) * k->o->reps;
}

/* Fill n bytes of the rank's buffer p with its (random) tokens, repeated. */
static void fill_tokens(struct rank *k, uint8_t *p, uint64_t n) {
  size_t xb = (size_t)k->o->shape.max_tokens_per_rank * k->o->shape.hidden * 2;
  for (uint64_t off = 0; off < n; off += xb)
    upload(k, p + off, k->hx, n - off < xb ? (size_t)(n - off) : xb);
}

/*
 * The same-GPU copy ceiling (every rank on one GPU, or the host backend):
 * each rank copies its own byte count of each op, all ranks at once, from a
 * source filled with the (random) tokens.
 */
static void copy_ceiling(struct rank *k) {
  uint64_t most = 0;
  for (int op = 0; op < NOPS; op++) {
    uint64_t b = rank_bytes(k->s, k->r, op, k->n);
    most = b > most ? b : most;
  }
  uint8_t *src = balloc(k, most), *dst = balloc(k, most);
  fill_tokens(k, src, most);
  for (int op = 0; op < NOPS; op++) {
    size_t n = rank_bytes(k->s, k->r, op, k->n);
    double *out = tcopy(k, op);
    for (int i = -2; i < k->o->reps; i++) { /* two untimed copies warm it up */
      double rel = bar_wait(k), ms;
      if (k->cuda) {
        float f;
        CK(cu->cuEventRecord(k->e0, k->st));
        CK(cu->cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n,
                                 k->st));
        CK(cu->cuEventRecord(k->e1, k->st));
        CK(cu->cuEventSynchronize(k->e1));
        CK(cu->cuEventElapsedTime(&f, k->e0, k->e1));
        ms = f;
      } else {
        memcpy(dst, src, n);
        ms = bench_now_ms() - rel;
      }
      if (i >= 0)
        out[i] = ms;
    }
  }
  bfree(k, src);
  bfree(k, dst);
}

/* Where this rank's copies to rank d land, and the stream they run on. */
struct peer_dst {
  CUdevice dev;    /* rank d's GPU */
  CUcontext ctx;   /* the context the buffer was made in: ours, or d's GPU's primary one */
  bool other_gpu;  /* ctx is another GPU's primary context, retained here */
  CUdeviceptr buf;
  CUstream st;     /* this rank's stream for its copies to d (in our context) */
  CUevent done;
};

/*
 * A buffer of n bytes on rank d's GPU for this rank's copies.  On another
 * GPU it is made in that GPU's primary context (retained in this process),
 * with peer access enabled from ours, so the copies go straight over the
 * GPUs' link and not through the host.
 */
static void peer_dst_open(struct rank *k, int d, uint64_t n, struct peer_dst *p) {
  CK(cu->cuDeviceGet(&p->dev, bench_gpu_of_rank(d, k->o->gpus)));
  p->ctx = k->ctx;
  p->other_gpu = p->dev != k->dev;
  if (!p->other_gpu) {
    CK(cu->cuMemAlloc(&p->buf, n));
  } else {
    int can = 0;
    CK(cu->cuDeviceCanAccessPeer(&can, k->dev, p->dev));
    if (!can)
      fail("rank %d: GPU %d cannot reach GPU %d peer to peer (cuDeviceCanAccessPeer), so there "
           "is no peer-copy ceiling to measure; run with -g 1", k->r, (int)k->dev, (int)p->dev);
    CK(cu->cuDevicePrimaryCtxRetain(&p->ctx, p->dev));
    /* From our context (current) to theirs; another rank of this process
     * on our GPU may have done it already. */
    CUresult r = cu->cuCtxEnablePeerAccess(p->ctx, 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
      fail("rank %d: cuCtxEnablePeerAccess(GPU %d -> GPU %d) failed: %s", k->r, (int)k->dev,
           (int)p->dev, cudadrv_errstr(r));
    CUcontext ours;
    CK(cu->cuCtxPushCurrent(p->ctx));
    CK(cu->cuMemAlloc(&p->buf, n));
    CK(cu->cuCtxPopCurrent(&ours));
  }
  CK(cu->cuStreamCreate(&p->st, CU_STREAM_NON_BLOCKING));
  CK(cu->cuEventCreate(&p->done, CU_EVENT_DISABLE_TIMING));
}

static void peer_dst_close(struct peer_dst *p) {
  CK(cu->cuStreamDestroy(p->st));
  CK(cu->cuEventDestroy(p->done));
  if (!p->other_gpu) {
    CK(cu->cuMemFree(p->buf));
    return;
  }
  CUcontext ours;
  CK(cu->cuCtxPushCurrent(p->ctx));
  CK(cu->cuMemFree(p->buf));
  CK(cu->cuCtxPopCurrent(&ours));
  CK(cu->cuDevicePrimaryCtxRelease(p->dev));
}

/*
 * The peer-copy ceiling, for ranks on several GPUs: each op's traffic done
 * by copies, all ranks at once, every rank sending every rank (itself
 * included) the bytes the op sent it: cuMemcpyPeerAsync into a buffer on
 * the destination's GPU, cuMemcpyDtoDAsync where the destination shares
 * this rank's GPU.  The copies to different ranks run on streams of their
 * own, forked from this rank's stream and joined back into it, so they
 * overlap as the operation's writes to every peer do; the time is taken
 * with events on this rank's stream, around the fork and the join.
 */
static void peer_copy_ceiling(struct rank *k) {
  const uint64_t (*b)[MAX_RANKS] = (const uint64_t (*)[MAX_RANKS])k->s->bytes[k->r];
  struct peer_dst dst[MAX_RANKS];
  memset(dst, 0, sizeof dst);
  uint64_t most = 0;
  for (int d = 0; d < k->n; d++) {
    uint64_t m = 0;
    for (int op = 0; op < NOPS; op++)
      m = b[op][d] > m ? b[op][d] : m;
    most = m > most ? m : most;
    if (m > 0)
      peer_dst_open(k, d, m, &dst[d]);
  }
  uint8_t *src = balloc(k, most);
  fill_tokens(k, src, most);
  const CUdeviceptr from = (CUdeviceptr)(uintptr_t)src;
  for (int op = 0; op < NOPS; op++) {
    double *out = tcopy(k, op);
    for (int i = -2; i < k->o->reps; i++) { /* two untimed rounds warm it up */
      bar_wait(k);
      CK(cu->cuEventRecord(k->e0, k->st));
      for (int d = 0; d < k->n; d++) {
        struct peer_dst *p = &dst[d];
        if (b[op][d] == 0)
          continue;
        CK(cu->cuStreamWaitEvent(p->st, k->e0, 0));
        if (p->other_gpu)
          CK(cu->cuMemcpyPeerAsync(p->buf, p->ctx, from, k->ctx, b[op][d], p->st));
        else
          CK(cu->cuMemcpyDtoDAsync(p->buf, from, b[op][d], p->st));
        CK(cu->cuEventRecord(p->done, p->st));
        CK(cu->cuStreamWaitEvent(k->st, p->done, 0));
      }
      float ms;
      CK(cu->cuEventRecord(k->e1, k->st));
      CK(cu->cuEventSynchronize(k->e1));
      CK(cu->cuEventElapsedTime(&ms, k->e0, k->e1));
      if (i >= 0)
        out[i] = ms;
    }
  }
  CK(cu->cuStreamSynchronize(k->st));
  for (int d = 0; d < k->n; d++)
    if (dst[d].buf != 0)
      peer_dst_close(&dst[d]);
  bfree(k, src);
}

static void rank_run(struct rank *k) {
  const struct opts *o = k->o;
  k->le = o->shape.num_experts / (uint32_t)k->n;
  k->llrows = (uint32_t)k->n * o->shape.max_ll_tokens_per_rank;
  uint8_t uuid[16] = {0};
  if (k->cuda) {
    /* This rank's GPU, its primary context current on this thread (a
     * process of its own, or one thread of the world's process) before any
     * buffer, stream or event is made. */
    CUuuid u;
    CK(cu->cuDeviceGet(&k->dev, bench_gpu_of_rank(k->r, o->gpus)));
    CK(cu->cuDeviceGetUuid(&u, k->dev));
    CK(cu->cuDevicePrimaryCtxRetain(&k->ctx, k->dev));
    CK(cu->cuCtxSetCurrent(k->ctx));
    CK(cu->cuStreamCreate(&k->st, CU_STREAM_NON_BLOCKING));
    CK(cu->cuEventCreate(&k->e0, 0));
    CK(cu->cuEventCreate(&k->e1, 0));
    memcpy(uuid, u.bytes, 16);
  }
  make_inputs(k);
  alloc_buffers(k);
  struct dep_attach_args a = {.rank = (uint32_t)k->r, .world_size = (uint32_t)k->n,
                              .local_rank = (uint32_t)k->r, .local_world_size = (uint32_t)k->n,
                              .shape = o->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", k->job);
  memcpy(a.device_uuid, uuid, 16);
  bar_wait(k); /* attach_ms is attach's own time, not a wait for slower peers' set-up */
  check_pairs(k);
  int rc = dep_client_new(&k->c);
  if (rc == 0)
    rc = dep_connect(k->c, k->sock);
  if (rc == 0)
    rc = dep_attach(k->c, &a);
  if (rc == 0)
    rc = dep_handle_new(k->c, &k->htp);
  if (rc == 0)
    rc = dep_handle_new(k->c, &k->hll);
  if (rc != 0)
    fail("rank %d: attach to %s: %s (%s)", k->r, k->sock, k->c ? dep_errmsg(k->c) : "",
         dep_errname(rc));
  struct dep_attach_info info;
  dep_attach_info(k->c, &info);
  k->s->attach_ms[k->r] = info.attach_ms;

  for (int op = 0; op < NOPS; op++) {
    k->s->first[k->r][op] = timed(k, op);
    check_op(k, op);
  }
  if (!k->first_only) {
    static const int pairs[3][2] = {{OP_D, OP_C}, {OP_LLD, OP_LLC}, {OP_LLD8, OP_LLC8}};
    for (int p = 0; p < 3; p++) {
      for (int i = -o->warm; i < o->calls; i++)
        for (int j = 0; j < 2; j++) {
          double ms = timed(k, pairs[p][j]);
          if (i >= 0)
            tcall(k, pairs[p][j])[i] = ms;
        }
      check_op(k, pairs[p][0]); /* the last pair worked too */
      check_op(k, pairs[p][1]);
    }
  }
  bar_wait(k);
  if ((rc = dep_detach(k->c)) != 0)
    fail("rank %d: detach: %s (%s)", k->r, dep_errmsg(k->c), dep_errname(rc));
  dep_handle_free(k->htp);
  dep_handle_free(k->hll);
  dep_client_free(k->c);
  free_buffers(k);
  if (!k->first_only && o->peer)
    peer_copy_ceiling(k);
  else if (!k->first_only)
    copy_ceiling(k);
  free(k->hx);
  free(k->hidx);
  free(k->hw);
  free(k->mult);
  free(k->exp_tp);
  free(k->exp_ll);
}

static void *rank_thread(void *arg) {
  rank_run(arg);
  return NULL;
}

/* ---- driver ------------------------------------------------------------------- */

static size_t shm_bytes(const struct opts *o, int n) {
  return sizeof(struct shm) + (size_t)n * NOPS * ((size_t)o->calls + (size_t)o->reps) * 8;
}

/*
 * Run one world in fresh processes (the parent never touches CUDA, so no
 * module or context carries over between worlds).  Returns 0, or 1 with
 * the first failure in s->err.
 */
static int run_world(const struct opts *o, bool cuda, int n, bool threads, const char *sock,
                     bool first_only, struct shm *s, const char *job) {
  memset(s, 0, shm_bytes(o, n));
  g_shm = s;
  struct rank proto = {.o = o, .s = s, .n = n, .cuda = cuda, .first_only = first_only,
                       .sock = sock, .job = job};
  pid_t pids[MAX_RANKS];
  int np = threads ? 1 : n;
  for (int p = 0; p < np; p++) {
    pids[p] = fork();
    if (pids[p] < 0)
      fail("fork failed");
    if (pids[p] > 0)
      continue;
    if (cuda)
      cuda_load();
    if (!threads) {
      struct rank k = proto;
      k.r = p;
      rank_run(&k);
      _exit(0);
    }
    struct rank ks[MAX_RANKS];
    pthread_t th[MAX_RANKS];
    for (int r = 0; r < n; r++) {
      ks[r] = proto;
      ks[r].r = r;
      if (pthread_create(&th[r], NULL, rank_thread, &ks[r]) != 0)
        fail("pthread_create failed");
    }
    for (int r = 0; r < n; r++)
      pthread_join(th[r], NULL);
    _exit(0);
  }
  int bad = 0;
  for (int left = np; left > 0; left--) {
    int st;
    pid_t w = wait(&st);
    if (w < 0)
      break;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (!bad && !atomic_load(&s->failed))
        snprintf(s->err, sizeof s->err, "a rank process died (status 0x%x)", st);
      bad = 1;
      atomic_store(&s->failed, 1); /* the others leave their barrier */
      for (int p = 0; p < np; p++)
        if (pids[p] != w)
          kill(pids[p], SIGKILL);
    }
  }
  return bad || atomic_load(&s->failed);
}

static void raw_line(FILE *f, const char *be, int n, const char *mode, int op, const char *kind,
                     int i, double ms) {
  if (f != NULL)
    fprintf(f, "%s,%d,%s,%s,%s,%d,%.6f\n", be, n, mode, op_name[op], kind, i, ms);
}

/* The per-call (or per-rep) time of the world, the slowest rank's, in call
 * order (the raw file), then sorted (the statistics). */
static void world_times(const double *base, int n, int stride, double *out, FILE *raw,
                        const char *be, int op, const char *mode, const char *kind) {
  for (int i = 0; i < stride; i++) {
    out[i] = 0;
    for (int r = 0; r < n; r++)
      out[i] = fmax(out[i], base[(size_t)r * NOPS * stride + i]);
    raw_line(raw, be, n, mode, op, kind, i, out[i]);
  }
  bench_sort(out, (size_t)stride);
}

/* One table row per op for a finished world (s), with its warm-up-off twin (s2) if cold. */
static void report(const struct opts *o, const char *be, int n, const char *mode,
                   const struct shm *s, const struct shm *s2, bool cold, FILE *raw) {
  double attach = 0, calls[MAX_CALLS], reps[MAX_CALLS];
  for (int r = 0; r < n; r++)
    attach = fmax(attach, s->attach_ms[r]);
  for (int op = 0; op < NOPS; op++) {
    double first = 0, first2 = 0;
    uint64_t bytes = 0, least = UINT64_MAX; /* all ranks' bytes; the smallest rank's */
    for (int r = 0; r < n; r++) {
      uint64_t rb = rank_bytes(s, r, op, n);
      first = fmax(first, s->first[r][op]);
      first2 = fmax(first2, s2->first[r][op]);
      bytes += rb;
      least = rb < least ? rb : least;
    }
    printf("%-5d %-9s %-15s %8.3f %8.3f", n, mode, op_name[op], attach, first);
    raw_line(raw, be, n, mode, op, "first", 0, first);
    if (o->first_only) {
      printf(" %8s %9s %8.1f\n", "-", "-", (double)bytes / 1e6);
      continue;
    }
    world_times(s->t + (size_t)op * o->calls, n, o->calls, calls, raw, be, op, mode, "call");
    world_times(s->t + (size_t)n * NOPS * o->calls + (size_t)op * o->reps, n, o->reps, reps, raw,
                be, op, mode, "copy");
    double med = calls[o->calls / 2], p99 = calls[(o->calls * 99 + 99) / 100 - 1];
    double cmed = reps[o->reps / 2];
    double gbs = (double)bytes / med / 1e6, cgbs = (double)bytes / cmed / 1e6;
    double rank_gbs = (double)least / med / 1e6, rank_cgbs = (double)least / cmed / 1e6;
    printf(" %8.3f %9.3f %8.1f %8.1f %8.1f %9.1f %10.1f %6.3f %8.2fx", med, p99,
           (double)bytes / 1e6, gbs, rank_gbs, cgbs, rank_cgbs, gbs / cgbs, first / med);
    if (cold) {
      printf(" %9.3f %8.2fx\n", first2, first2 / med);
      raw_line(raw, be, n, mode, op, "first_nowarm", 0, first2);
    } else {
      printf(" %9s %9s\n", "-", "-");
    }
  }
  fflush(stdout);
}

/* ---- the plain pairwise figure: GPU 0 and GPU 1 -------------------------------- */

#define PAIR_BYTES (256ull << 20)

/*
 * In a child process: PAIR_BYTES by cuMemcpyPeerAsync from GPU 0 to GPU 1
 * alone, then in both directions at once (each on a stream of its sending
 * GPU, issued back to back), reps times each after two untimed rounds.
 * one[i] and both[i] get the time of round i, the slower direction's for
 * both.  The process ends after this; the driver frees what it made.
 */
static void pair_measure(const struct opts *o, double *one, double *both) {
  cuda_load();
  CUdevice dv[2];
  CUcontext ctx[2];
  CUstream st[2];
  CUevent e0[2], e1[2];
  CUdeviceptr src[2], dst[2];
  for (int g = 0; g < 2; g++)
    CK(cu->cuDeviceGet(&dv[g], g));
  for (int g = 0; g < 2; g++) {
    int can = 0;
    CK(cu->cuDeviceCanAccessPeer(&can, dv[g], dv[1 - g]));
    if (!can)
      fail("GPU %d cannot reach GPU %d peer to peer (cuDeviceCanAccessPeer)", g, 1 - g);
    CK(cu->cuDevicePrimaryCtxRetain(&ctx[g], dv[g]));
  }
  for (int g = 0; g < 2; g++) { /* GPU g's buffers, stream and events, made in its context */
    CK(cu->cuCtxSetCurrent(ctx[g]));
    CUresult r = cu->cuCtxEnablePeerAccess(ctx[1 - g], 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
      fail("cuCtxEnablePeerAccess(GPU %d -> GPU %d) failed: %s", g, 1 - g, cudadrv_errstr(r));
    CK(cu->cuMemAlloc(&src[g], PAIR_BYTES));
    CK(cu->cuMemAlloc(&dst[g], PAIR_BYTES));
    CK(cu->cuMemsetD8(src[g], 0x5a, PAIR_BYTES));
    CK(cu->cuStreamCreate(&st[g], CU_STREAM_NON_BLOCKING));
    CK(cu->cuEventCreate(&e0[g], CU_EVENT_DEFAULT));
    CK(cu->cuEventCreate(&e1[g], CU_EVENT_DEFAULT));
    CK(cu->cuCtxSynchronize());
  }
  for (int ways = 1; ways <= 2; ways++) { /* GPU g sends to GPU 1 - g, for g < ways */
    double *out = ways == 1 ? one : both;
    for (int i = -2; i < o->reps; i++) {
      for (int g = 0; g < ways; g++) {
        CK(cu->cuCtxSetCurrent(ctx[g]));
        CK(cu->cuEventRecord(e0[g], st[g]));
        CK(cu->cuMemcpyPeerAsync(dst[1 - g], ctx[1 - g], src[g], ctx[g], PAIR_BYTES, st[g]));
        CK(cu->cuEventRecord(e1[g], st[g]));
      }
      double slowest = 0;
      for (int g = 0; g < ways; g++) {
        float ms;
        CK(cu->cuCtxSetCurrent(ctx[g]));
        CK(cu->cuEventSynchronize(e1[g]));
        CK(cu->cuEventElapsedTime(&ms, e0[g], e1[g]));
        slowest = fmax(slowest, ms);
      }
      if (i >= 0)
        out[i] = slowest;
    }
  }
}

/* Measure (in a child: this process never touches CUDA) and print the pairwise figure. */
static int peer_pair_report(const struct opts *o) {
  size_t sb = sizeof(struct shm) + 2 * (size_t)o->reps * sizeof(double);
  struct shm *s = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (s == MAP_FAILED) {
    printf("# peer copy GPU 0 -> GPU 1: out of memory for the results\n");
    return 1;
  }
  memset(s, 0, sb);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    g_shm = s;
    pair_measure(o, s->t, s->t + o->reps);
    _exit(0);
  }
  int st = 0;
  bool ok = pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  if (!ok) {
    printf("# peer copy GPU 0 -> GPU 1: FAILED: %s\n",
           s->err[0] ? s->err : "the measuring process died");
  } else {
    double *one = s->t, *both = s->t + o->reps;
    bench_sort(one, (size_t)o->reps);
    bench_sort(both, (size_t)o->reps);
    double m1 = one[o->reps / 2], m2 = both[o->reps / 2], mb = (double)PAIR_BYTES;
    printf("# peer copy, %llu MiB by cuMemcpyPeerAsync, median of %d: GPU 0 -> GPU 1 alone "
           "%.1f GB/s (%.3f ms); both directions at once %.1f GB/s each way, %.1f GB/s together "
           "(%.3f ms)\n", PAIR_BYTES >> 20, o->reps, mb / m1 / 1e6, m1, mb / m2 / 1e6,
           2 * mb / m2 / 1e6, m2);
  }
  fflush(stdout);
  munmap(s, sb);
  return ok ? 0 : 1;
}

static void parse_args(int argc, char **argv, struct opts *o) {
  const char *counts = "2,4,8", *modes = "processes,threads";
  int opt;
  while ((opt = getopt(argc, argv, "s:S:n:m:c:w:r:t:l:H:e:k:x:o:Fg:h")) != -1) {
    switch (opt) {
    case 's': o->sock = optarg; break;
    case 'S': o->sock_nowarm = optarg; break;
    case 'n': counts = optarg; break;
    case 'm': modes = optarg; break;
    case 'c': o->calls = atoi(optarg); break;
    case 'w': o->warm = atoi(optarg); break;
    case 'r': o->reps = atoi(optarg); break;
    case 't': o->shape.max_tokens_per_rank = (uint32_t)atoi(optarg); break;
    case 'l': o->shape.max_ll_tokens_per_rank = (uint32_t)atoi(optarg); break;
    case 'H': o->shape.hidden = (uint32_t)atoi(optarg); break;
    case 'e': o->shape.num_experts = (uint32_t)atoi(optarg); break;
    case 'k': o->shape.topk = (uint32_t)atoi(optarg); break;
    case 'x': o->seed = strtoull(optarg, NULL, 10); break;
    case 'o': o->raw = optarg; break;
    case 'F': o->first_only = true; break;
    case 'g': o->gpus_want = atoi(optarg); break;
    default: usage();
    }
  }
  const struct dep_job_shape *sh = &o->shape;
  if (o->sock == NULL || optind != argc || o->gpus_want < 0 || o->calls < 1 ||
      o->calls > MAX_CALLS || o->warm < 0 ||
      o->reps < 1 || o->reps > MAX_CALLS || sh->max_tokens_per_rank < 1 || sh->hidden < 128 ||
      sh->hidden % 128 != 0 || sh->topk < 1 || sh->topk > 16 || sh->num_experts < sh->topk ||
      sh->max_ll_tokens_per_rank < 1 || sh->max_ll_tokens_per_rank > sh->max_tokens_per_rank)
    usage();
  char *dup = strdup(counts);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    int n = atoi(t);
    if (o->ncounts == 8 || n < 1 || n > MAX_RANKS || sh->num_experts % (uint32_t)n != 0) {
      fprintf(stderr, "ep: rank count '%s': 1..%d ranks dividing %u experts\n", t, MAX_RANKS,
              sh->num_experts);
      usage();
    }
    o->counts[o->ncounts++] = n;
  }
  free(dup);
  dup = strdup(modes);
  for (char *t = strtok(dup, ","); t != NULL; t = strtok(NULL, ",")) {
    if (strcmp(t, "processes") != 0 && strcmp(t, "threads") != 0)
      usage();
    o->modes[strcmp(t, "threads") == 0] = true;
  }
  free(dup);
}

/*
 * The daemon's backend and device, asked from a child: the library may
 * initialise the CUDA driver (dep_client_free does), and a driver
 * initialised before fork() is unusable in the forked ranks.
 */
static int query_backend(const char *sock, char backend[8], char dev[64]) {
  struct q { int ok; char backend[8], dev[64], err[256]; } *q =
      mmap(NULL, sizeof *q, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (q == MAP_FAILED)
    return -1;
  pid_t qp = fork();
  if (qp == 0) {
    dep_client_t *c = NULL;
    struct dep_status *st = NULL;
    if (dep_client_new(&c) != 0 || dep_connect(c, sock) != 0 || dep_status(c, &st) != 0) {
      snprintf(q->err, sizeof q->err, "%s", c ? dep_errmsg(c) : "out of memory");
      _exit(1);
    }
    snprintf(q->backend, sizeof q->backend, "%s", st->backend);
    snprintf(q->dev, sizeof q->dev, "%s", st->num_devices ? st->devices[0].name : "?");
    q->ok = 1;
    _exit(0);
  }
  int st, ok = qp > 0 && waitpid(qp, &st, 0) == qp && q->ok;
  if (!ok)
    fprintf(stderr, "ep: cannot query deepepd at %s: %s\n", sock, q->err);
  memcpy(backend, q->backend, 8);
  memcpy(dev, q->dev, 64);
  munmap(q, sizeof *q);
  return ok ? 0 : -1;
}

int main(int argc, char **argv) {
  static struct opts o = {.calls = 200, .warm = 5, .reps = 20, .seed = 42, .gpus_want = 1,
                          .gpus = 1,
                          .shape = {.max_tokens_per_rank = 4096, .hidden = 7168,
                                    .num_experts = 256, .topk = 8, .dtype = DEP_DTYPE_BF16,
                                    .max_ll_tokens_per_rank = 128}};
  parse_args(argc, argv, &o);
  const struct dep_job_shape *sh = &o.shape;
  char backend[8], dev[64];
  if (query_backend(o.sock, backend, dev) != 0)
    return 1;
  bool cuda = strcmp(backend, "cuda") == 0;
  char why[256];
  if (cuda && (o.gpus = bench_gpus(o.gpus_want, why, sizeof why)) < 0) {
    fprintf(stderr, "ep: %s\n", why);
    return 1;
  }
  o.peer = cuda && o.gpus > 1;
  FILE *raw = o.raw ? fopen(o.raw, "a") : NULL;
  if (o.raw && raw == NULL) {
    fprintf(stderr, "ep: cannot open %s for appending\n", o.raw);
    return 1;
  }
  printf("# ep: backend %s (%s), %u tokens x %u hidden x top-%u x %u experts, LL %u tokens, "
         "%d calls (+%d warm-up pairs), copy ceiling %d reps, seed %llu%s\n",
         backend, dev, sh->max_tokens_per_rank, sh->hidden, sh->topk, sh->num_experts,
         sh->max_ll_tokens_per_rank, o.calls, o.warm, o.reps, (unsigned long long)o.seed,
         o.sock_nowarm ? ", kernel_warmup-off daemon too" : "");
  if (!cuda && o.gpus_want != 1)
    printf("# -g %d ignored: the host backend uses no GPU\n", o.gpus_want);
  else if (o.peer)
    printf("# placement: ranks spread over %d GPUs, rank r on GPU r %% %d\n", o.gpus, o.gpus);
  else if (cuda)
    printf("# placement: every rank on GPU 0 (-g N spreads them over N GPUs)\n");
  printf("# times: %s; bytes: what each rank sends per call, to every rank (itself included), "
         "counted once\n",
         cuda ? "CUDA events on each rank's stream" : "CLOCK_MONOTONIC from the common release");
  printf("# GB/s: all ranks' bytes / median; rankGB/s: the smallest rank's bytes / median; "
         "frac = GB/s / %s GB/s\n", o.peer ? "peer" : "copy");
  if (o.peer)
    printf("# peer: the ceiling of peer copies: every rank at once copies to every rank the bytes "
           "the op sent it (cuMemcpyPeerAsync to a buffer on its GPU, cuMemcpyDtoDAsync on its "
           "own), one stream per destination; slowest rank, median of %d\n", o.reps);
  else
    printf("# copy: the ceiling of a copy %s: every rank at once copies its bytes (%s); "
           "slowest rank, median of %d\n", cuda ? "within the GPU" : "in host memory",
           cuda ? "cuMemcpyDtoDAsync" : "memcpy", o.reps);
  int status = 0;
  if (o.peer && !o.first_only && peer_pair_report(&o) != 0)
    status = 1;
  printf("%-5s %-9s %-15s %8s %8s %8s %9s %8s %8s %8s %9s %10s %6s %9s %9s %9s\n", "ranks",
         "mode", "op", "attachms", "first_ms", "med_ms", "p99_ms", "MB/call", "GB/s", "rankGB/s",
         o.peer ? "peerGB/s" : "copyGB/s", o.peer ? "rkpeerGB/s" : "rkcopyGB/s", "frac",
         "first/med", "nowarm_ms", "nowarm/med");
  fflush(stdout);
  for (int ci = 0; ci < o.ncounts; ci++) {
    int n = o.counts[ci];
    size_t sb = shm_bytes(&o, n);
    struct shm *s = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    struct shm *s2 = mmap(NULL, sb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED || s2 == MAP_FAILED) {
      fprintf(stderr, "ep: out of memory for the results\n");
      return 1;
    }
    for (int m = 0; m < 2; m++) {
      if (!o.modes[m])
        continue;
      const char *mode = m ? "threads" : "processes";
      char job[64];
      snprintf(job, sizeof job, "ep-%d-%d-%c", (int)getpid(), n, mode[0]);
      if (run_world(&o, cuda, n, m, o.sock, o.first_only, s, job)) {
        printf("%-5d %-9s FAILED: %s\n", n, mode, s->err);
        fflush(stdout);
        status = 1;
        continue;
      }
      bool cold = false;
      if (o.sock_nowarm && !o.first_only) {
        snprintf(job, sizeof job, "ep-%d-%d-%c-nowarm", (int)getpid(), n, mode[0]);
        cold = run_world(&o, cuda, n, m, o.sock_nowarm, true, s2, job) == 0;
        if (!cold) {
          printf("# %d %s kernel_warmup-off world FAILED: %s\n", n, mode, s2->err);
          status = 1;
        }
      }
      report(&o, backend, n, mode, s, s2, cold, raw);
    }
    munmap(s, sb);
    munmap(s2, sb);
  }
  if (raw != NULL)
    fclose(raw);
  return status;
}
