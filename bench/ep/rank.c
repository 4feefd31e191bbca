/*
 * rank.c — one rank of the dispatch/combine benchmark (bench/ep.c): its
 * buffers, inputs and expected outputs, the operations and their checks,
 * and the timed loop.  A rank is a process of its own or a thread of the
 * world's process.
 */
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../benchlib.h"
#include "ep.h"

const struct cudadrv *cu;
struct shm *g_shm;

void fail(const char *fmt, ...) {
  int z = 0;
  if (g_shm != NULL && atomic_compare_exchange_strong(&g_shm->failed, &z, 1)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_shm->err, sizeof g_shm->err, fmt, ap);
    va_end(ap);
  }
  _exit(1);
}


void cuda_load(void) {
  char why[256];
  cu = cudadrv_load(why, sizeof why);
  if (cu == NULL)
    fail("CUDA: %s", why);
}

void *balloc(struct rank *k, size_t n) {
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

void bfree(struct rank *k, void *p) {
  if (!k->cuda)
    free(p);
  else if (p != NULL)
    CK(cu->cuMemFree((CUdeviceptr)(uintptr_t)p));
}

void upload(struct rank *k, void *dst, const void *src, size_t n) {
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

double bar_wait(struct rank *k) {
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

/*
 * Write op's outputs on the GPU, as a trainer's tensors have been used
 * before they meet a call: a first call otherwise pays the GPU's first walk
 * of these pages (470 MB of LL receive buffer at 2 ranks), not the library.
 * Once for every op after they are made, and with -T again just before
 * each op's first call, when the others' use has made them cold.
 */
static void touch_outputs(struct rank *k, int op) {
  const struct dep_job_shape *sh = &k->o->shape;
  const size_t T = sh->max_tokens_per_rank, H = sh->hidden, K = sh->topk, le = k->le;
  const size_t cap = (size_t)k->n * T, llr = (size_t)le * k->llrows;
  struct {
    void *p;
    size_t n;
  } outs[4] = {{NULL, 0}};
  switch (op) {
  case OP_D:
    outs[0].p = k->rx, outs[0].n = cap * H * 2;
    outs[1].p = k->ridx, outs[1].n = cap * K * 4;
    outs[2].p = k->rw, outs[2].n = cap * K * 4;
    outs[3].p = k->rcnt, outs[3].n = le * 4;
    break;
  case OP_C:
    outs[0].p = k->out, outs[0].n = T * H * 2;
    break;
  case OP_LLD:
    outs[0].p = k->llrx, outs[0].n = llr * H * 2;
    outs[1].p = k->llcnt, outs[1].n = le * 4;
    break;
  case OP_LLD8:
    outs[0].p = k->llrx8, outs[0].n = llr * H;
    outs[1].p = k->llsc, outs[1].n = llr * (H / 128) * 4;
    outs[2].p = k->llcnt, outs[2].n = le * 4;
    break;
  default: /* OP_LLC, OP_LLC8 */
    outs[0].p = k->llout, outs[0].n = (size_t)sh->max_ll_tokens_per_rank * H * 2;
  }
  for (int i = 0; i < 4 && outs[i].p != NULL; i++)
    CK(cu->cuMemsetD8Async((CUdeviceptr)(uintptr_t)outs[i].p, 0x7f, outs[i].n, k->st));
  CK(cu->cuStreamSynchronize(k->st));
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
    for (int op = 0; op < NOPS; op++)
      touch_outputs(k, op);
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
    struct dep_dispatch_args a = {.size = sizeof(struct dep_dispatch_args), .x = k->x,
                                  .topk_idx = k->idx, .index_type = DEP_INDEX_I64,
                                  .topk_weights = k->w, .num_tokens = T, .recv_x = k->rx,
                                  .recv_topk_idx = k->ridx, .recv_topk_weights = k->rw,
                                  .recv_count_per_expert = k->rcnt, .num_recv = &k->num_recv};
    return dep_dispatch(k->c, &a, k->htp, k->st);
  }
  case OP_C: {
    struct dep_combine_args a = {.size = sizeof(struct dep_combine_args), .x = k->rx,
                                 .out = k->out};
    return dep_combine(k->c, &a, k->htp, k->st);
  }
  case OP_LLD:
  case OP_LLD8: {
    bool f8 = op == OP_LLD8;
    struct dep_ll_dispatch_args a = {.size = sizeof(struct dep_ll_dispatch_args), .x = k->x,
                                     .topk_idx = k->idx, .index_type = DEP_INDEX_I64,
                                     .num_tokens = L, .use_fp8 = f8,
                                     .recv_x = f8 ? k->llrx8 : k->llrx,
                                     .recv_scales = f8 ? k->llsc : NULL, .recv_count = k->llcnt};
    return dep_ll_dispatch(k->c, &a, k->hll, k->st);
  }
  default: {
    /* Expert outputs = the bf16 rows the bf16 dispatch delivered (the FP8
     * dispatch of the same tokens fills the same rows). */
    struct dep_ll_combine_args a = {.size = sizeof(struct dep_ll_combine_args), .x = k->llrx,
                                    .topk_idx = k->idx,
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

/* Sleep ms milliseconds (0: not at all), whatever signals come. */
static void pause_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (ms > 0 && nanosleep(&t, &t) != 0 && errno == EINTR) {
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

double *tcopy(struct rank *k, int op) {
  return k->s->t + (size_t)k->n * NOPS * k->o->calls + ((size_t)k->r * NOPS + op) * k->o->reps;
}

/* Fill n bytes of the rank's buffer p with its (random) tokens, repeated. */

void rank_run(struct rank *k) {
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
  /* Spread over nodes (-s with several sockets), a rank attaches to its
   * node's daemon as one of that node's n / nodes local ranks. */
  const int per = k->n / o->nodes, node = rank_node(o, k->r, k->n);
  const char *sock = o->nodes > 1 ? o->node_sock[node] : k->sock;
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = (uint32_t)k->r, .world_size = (uint32_t)k->n,
                              .local_rank = (uint32_t)(k->r % per),
                              .local_world_size = (uint32_t)per, .shape = o->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", k->job);
  memcpy(a.device_uuid, uuid, 16);
  bar_wait(k); /* attach_ms is attach's own time, not a wait for slower peers' set-up */
  check_pairs(k);
  int rc = dep_client_new(&k->c);
  if (rc == 0)
    rc = dep_connect(k->c, sock);
  if (rc == 0)
    rc = dep_attach(k->c, &a);
  if (rc == 0)
    rc = dep_handle_new(k->c, &k->htp);
  if (rc == 0)
    rc = dep_handle_new(k->c, &k->hll);
  if (rc != 0)
    fail("rank %d: attach to %s: %s (%s)", k->r, sock, k->c ? dep_errmsg(k->c) : "",
         dep_errname(rc));
  struct dep_attach_info info = {.size = sizeof info};
  dep_attach_info(k->c, &info);
  k->s->attach_ms[k->r] = info.attach_ms;
  /* the trainer's own start-up, which the library's warm-up may overlap */
  pause_ms(o->gap_ms);

  for (int op = 0; op < NOPS; op++) {
    if (o->retouch && k->cuda)
      touch_outputs(k, op);
    k->s->first[k->r][op] = timed(k, op);
    check_op(k, op);
  }
  if (!k->first_only) {
    static const int pairs[3][2] = {{OP_D, OP_C}, {OP_LLD, OP_LLC}, {OP_LLD8, OP_LLC8}};
    for (int p = 0; p < 3; p++) {
      if (!o->pairs[p])
        continue;
      for (int i = -o->warm; i < o->calls; i++) {
        pause_ms(o->idle_ms); /* the trainer's compute between layers */
        for (int j = 0; j < 2; j++) {
          double ms = timed(k, pairs[p][j]);
          if (i >= 0)
            tcall(k, pairs[p][j])[i] = ms;
        }
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

void *rank_thread(void *arg) {
  rank_run(arg);
  return NULL;
}
