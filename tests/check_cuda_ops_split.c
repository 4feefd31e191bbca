/*
 * check_cuda_ops_split.c — suite cuda_ops's split case (check_cuda_ops.c
 * makes the suite and adds it): low-latency calls split into their send
 * and their receive on the cuda backend (deepep.h "Split calls", kabi.h):
 * every output of a split dispatch and combine equals the whole calls'
 * (bf16 and FP8) bit for bit, with the inputs the receive must not read
 * overwritten between send and receive; two micro-batches interleaved
 * (send A, send B, receive A, receive B); a send with its receive
 * captured in a CUDA graph and replayed; and each invalid sequence
 * refused before anything is launched, the ranks then going on in step.
 * The whole calls (cr_round_ll) are checked against the oracle first, so
 * "equal to the whole calls'" is equal to the oracle too.  Tagged "gpu"
 * and run as check_cuda_ops.c says.
 */
#include <check.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "check_cuda_ops.h"
#include "cudadrv.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "deepep.h"
#include "opsworld.h"

/* The outputs of a low-latency round, as compared: recv_x, recv_scales, recv_count, out. */
enum { S_RX, S_SC, S_CNT, S_OUT, S_N };
static const int s_buf[S_N] = {B_LRX, B_LSC, B_LCNT, B_LOUT};
static const char *const s_name[S_N] = {"recv_x", "recv_scales", "recv_count", "out"};

struct outs {
  uint8_t *p[S_N];
};

static void outs_free(struct outs *o) {
  for (int i = 0; i < S_N; i++)
    free(o->p[i]);
}

/* k's outputs as they are now (poison included), into o. */
static int outs_save(struct rk *k, struct outs *o) {
  for (int i = 0; i < S_N; i++) {
    if (cr_get(k, s_buf[i]))
      return 1;
    o->p[i] = malloc(k->sz[s_buf[i]]);
    if (o->p[i] == NULL)
      return ow_fail(k->msg, "out of memory");
    memcpy(o->p[i], k->host, k->sz[s_buf[i]]);
  }
  return 0;
}

/* The outputs in alt (NULL: k's own buffers), whole buffers, equal want byte for byte. */
static int outs_same(struct rk *k, const struct outs *want, const CUdeviceptr *alt,
                     const char *how, const struct ow_case *d) {
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  for (int i = 0; i < S_N; i++) {
    const int b = s_buf[i];
    CR_CU(k, k->cu->cuMemcpyDtoH(k->host, alt != NULL ? alt[i] : k->b[b], k->sz[b]),
          "cuMemcpyDtoH");
    if (memcmp(k->host, want->p[i], k->sz[b]) != 0)
      return ow_fail(k->msg, "rank %u: %s: %s differs from the whole calls' [%s]", k->rank, how,
                     s_name[i], d->desc);
  }
  return 0;
}

static int outs_poison(struct rk *k, const CUdeviceptr *alt, uint8_t pz) {
  for (int i = 0; i < S_N; i++)
    CR_CU(k, k->cu->cuMemsetD8Async(alt != NULL ? alt[i] : k->b[s_buf[i]], pz, k->sz[s_buf[i]],
                                    k->s),
          "cuMemsetD8Async");
  return 0;
}

static struct dep_ll_dispatch_args ll_disp(struct rk *k, const struct ow_case *d, int fp8,
                                           uint32_t phases, const CUdeviceptr *alt) {
  void *o[S_N];
  for (int i = 0; i < S_N; i++)
    o[i] = alt != NULL ? (void *)(uintptr_t)alt[i] : CR_DEV(k, s_buf[i]);
  return (struct dep_ll_dispatch_args){sizeof(struct dep_ll_dispatch_args), CR_DEV(k, B_X),
                                       CR_DEV(k, B_IDX), d->sc.itype,
                                       d->in_ll[k->rank].num_tokens, fp8, o[S_RX],
                                       fp8 ? o[S_SC] : NULL, o[S_CNT], phases, NULL};
}

static struct dep_ll_combine_args ll_comb(struct rk *k, const struct ow_case *d, uint32_t phases,
                                          const CUdeviceptr *alt) {
  return (struct dep_ll_combine_args){sizeof(struct dep_ll_combine_args), CR_DEV(k, B_LX),
                                      CR_DEV(k, B_IDX), d->sc.itype, CR_DEV(k, B_W),
                                      alt != NULL ? (void *)(uintptr_t)alt[S_OUT]
                                                  : CR_DEV(k, B_LOUT),
                                      phases, NULL};
}

/* The caller's work between a send and its receive: buffer i overwritten (on the stream). */
static int clobber(struct rk *k, int i) {
  CR_CU(k, k->cu->cuMemsetD8Async(k->b[i], 0x7f, k->sz[i], k->s), "cuMemsetD8Async");
  return 0;
}

/* A dispatch and its combine, each split, the send's inputs overwritten before the receive
 * (a dispatch's x, a combine's x: deepep.h says the receive does not read them). */
static int split_pair(struct rk *k, const struct ow_case *d, int fp8) {
  struct dep_ll_dispatch_args ds = ll_disp(k, d, fp8, DEP_LL_SEND, NULL);
  struct dep_ll_dispatch_args dr = ll_disp(k, d, fp8, DEP_LL_RECV, NULL);
  struct dep_ll_combine_args cs = ll_comb(k, d, DEP_LL_SEND, NULL);
  struct dep_ll_combine_args cr = ll_comb(k, d, DEP_LL_RECV, NULL);
  CALL(k, dep_ll_dispatch(k->c, &ds, k->h, k->s), "dep_ll_dispatch (DEP_LL_SEND)");
  if (clobber(k, B_X))
    return 1;
  CALL(k, dep_ll_dispatch(k->c, &dr, k->h, k->s), "dep_ll_dispatch (DEP_LL_RECV)");
  CALL(k, dep_ll_combine(k->c, &cs, k->h, k->s), "dep_ll_combine (DEP_LL_SEND)");
  if (clobber(k, B_LX))
    return 1;
  CALL(k, dep_ll_combine(k->c, &cr, k->h, k->s), "dep_ll_combine (DEP_LL_RECV)");
  return 0;
}

/* The whole calls of case d (checked against the oracle by cr_round_ll) with outputs
 * poisoned with pz, saved into want; the inputs uploaded again after. */
static int whole_first(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz,
                       struct outs *want) {
  uint64_t dig = 0;
  if (cr_upload(k, d) || cr_poison(k, B_LSC, pz) || cr_round_ll(k, d, fp8, pz, &dig) ||
      outs_save(k, want))
    return 1;
  return cr_upload(k, d);
}

enum split_test { T_SPLIT, T_PAIRS, T_GRAPH, T_REFUSE };

struct split_arg {
  const struct ow_case *d;
  enum split_test test;
};

static int body_split(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz) {
  struct outs want = {0};
  int rc = whole_first(k, d, fp8, pz, &want) || outs_poison(k, NULL, pz) ||
           split_pair(k, d, fp8) || outs_same(k, &want, NULL, "split calls", d);
  outs_free(&want);
  return rc;
}

/* Micro-batch B's outputs, in buffers of the test's own (alt) and handle h2. */
static int pairs_run(struct rk *k, const struct ow_case *d, int fp8, const CUdeviceptr *alt,
                     dep_handle_t *h2) {
  struct dep_ll_dispatch_args as = ll_disp(k, d, fp8, DEP_LL_SEND, NULL);
  struct dep_ll_dispatch_args ar = ll_disp(k, d, fp8, DEP_LL_RECV, NULL);
  struct dep_ll_dispatch_args bs = ll_disp(k, d, fp8, DEP_LL_SEND, alt);
  struct dep_ll_dispatch_args br = ll_disp(k, d, fp8, DEP_LL_RECV, alt);
  CALL(k, dep_ll_dispatch(k->c, &as, k->h, k->s), "dep_ll_dispatch (A, DEP_LL_SEND)");
  CALL(k, dep_ll_dispatch(k->c, &bs, h2, k->s), "dep_ll_dispatch (B, DEP_LL_SEND)");
  CALL(k, dep_ll_dispatch(k->c, &ar, k->h, k->s), "dep_ll_dispatch (A, DEP_LL_RECV)");
  CALL(k, dep_ll_dispatch(k->c, &br, h2, k->s), "dep_ll_dispatch (B, DEP_LL_RECV)");
  struct dep_ll_combine_args cas = ll_comb(k, d, DEP_LL_SEND, NULL);
  struct dep_ll_combine_args car = ll_comb(k, d, DEP_LL_RECV, NULL);
  struct dep_ll_combine_args cbs = ll_comb(k, d, DEP_LL_SEND, alt);
  struct dep_ll_combine_args cbr = ll_comb(k, d, DEP_LL_RECV, alt);
  CALL(k, dep_ll_combine(k->c, &cas, k->h, k->s), "dep_ll_combine (A, DEP_LL_SEND)");
  CALL(k, dep_ll_combine(k->c, &cbs, h2, k->s), "dep_ll_combine (B, DEP_LL_SEND)");
  /* received in the other order this time */
  CALL(k, dep_ll_combine(k->c, &cbr, h2, k->s), "dep_ll_combine (B, DEP_LL_RECV)");
  CALL(k, dep_ll_combine(k->c, &car, k->h, k->s), "dep_ll_combine (A, DEP_LL_RECV)");
  return 0;
}

/* A second micro-batch's outputs (alt, as s_buf's) and handle (*h2), for split calls that
 * interleave two: 0, or 1 with k->msg; batch_b_end frees what it made, either way. */
static int batch_b_new(struct rk *k, CUdeviceptr *alt, dep_handle_t **h2) {
  int rc = 0;
  for (int i = 0; rc == 0 && i < S_N; i++)
    if (k->cu->cuMemAlloc(&alt[i], k->sz[s_buf[i]]) != CUDA_SUCCESS)
      rc = ow_fail(k->msg, "rank %u: cuMemAlloc failed", k->rank);
  if (rc == 0 && dep_handle_new(k->c, h2) != 0)
    rc = ow_fail(k->msg, "rank %u: dep_handle_new: %s", k->rank, dep_errmsg(k->c));
  return rc;
}

/* Wait for the stream, then free what batch_b_new made: rc, or the first failure. */
static int batch_b_end(struct rk *k, CUdeviceptr *alt, dep_handle_t *h2, int rc) {
  if (k->cu->cuStreamSynchronize(k->s) != CUDA_SUCCESS && rc == 0)
    rc = ow_fail(k->msg, "rank %u: cuStreamSynchronize failed", k->rank);
  dep_handle_free(h2);
  for (int i = 0; i < S_N; i++)
    if (alt[i] != 0)
      k->cu->cuMemFree(alt[i]);
  return rc;
}

static int body_pairs(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz) {
  struct outs want = {0};
  CUdeviceptr alt[S_N] = {0};
  dep_handle_t *h2 = NULL;
  int rc = whole_first(k, d, fp8, pz, &want);
  rc = rc || batch_b_new(k, alt, &h2);
  rc = rc || outs_poison(k, NULL, pz) || outs_poison(k, alt, pz) ||
       pairs_run(k, d, fp8, alt, h2) || outs_same(k, &want, NULL, "micro-batch A", d) ||
       outs_same(k, &want, alt, "micro-batch B", d);
  rc = batch_b_end(k, alt, h2, rc);
  outs_free(&want);
  return rc;
}

/* The driver's graph calls, which cudadrv.h (the library's table) does not load: the
 * library never makes a graph, the caller does. */
typedef void *gr_graph;
typedef void *gr_exec;
struct gr_fns {
  CUresult (*begin)(CUstream, int);
  CUresult (*end)(CUstream, gr_graph *);
  CUresult (*inst)(gr_exec *, gr_graph, unsigned long long);
  CUresult (*launch)(gr_exec, CUstream);
  CUresult (*exec_free)(gr_exec);
  CUresult (*free)(gr_graph);
};
#define GR_CAPTURE_RELAXED 2 /* CU_STREAM_CAPTURE_MODE_RELAXED */
#define GR_REPLAYS 3

static int gr_load(struct rk *k, struct gr_fns *g) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == NULL)
    lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == NULL)
    return ow_fail(k->msg, "rank %u: dlopen libcuda.so.1: %s", k->rank, dlerror());
  *(void **)&g->begin = dlsym(lib, "cuStreamBeginCapture_v2");
  *(void **)&g->end = dlsym(lib, "cuStreamEndCapture");
  *(void **)&g->inst = dlsym(lib, "cuGraphInstantiateWithFlags");
  *(void **)&g->launch = dlsym(lib, "cuGraphLaunch");
  *(void **)&g->exec_free = dlsym(lib, "cuGraphExecDestroy");
  *(void **)&g->free = dlsym(lib, "cuGraphDestroy");
  if (!g->begin || !g->end || !g->inst || !g->launch || !g->exec_free || !g->free)
    return ow_fail(k->msg, "rank %u: the driver lacks a CUDA graph call", k->rank);
  return 0;
}

/* A split dispatch and combine captured in one graph (x overwritten between each send and
 * receive, in the graph too), replayed GR_REPLAYS times, each with fresh inputs and outputs
 * poisoned: every replay's outputs are the whole calls'. */
static int body_graph(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz) {
  struct outs want = {0};
  struct gr_fns g = {0};
  gr_graph graph = NULL;
  gr_exec exec = NULL;
  int rc = gr_load(k, &g) || whole_first(k, d, fp8, pz, &want);
  if (rc == 0 && g.begin(k->s, GR_CAPTURE_RELAXED) != CUDA_SUCCESS)
    rc = ow_fail(k->msg, "rank %u: cuStreamBeginCapture failed", k->rank);
  if (rc == 0) {
    const int in = split_pair(k, d, fp8);
    const CUresult ended = g.end(k->s, &graph); /* whatever the calls returned */
    rc = in || (ended != CUDA_SUCCESS &&
                ow_fail(k->msg, "rank %u: cuStreamEndCapture: %s", k->rank,
                        cudadrv_errstr(ended)));
  }
  if (rc == 0 && g.inst(&exec, graph, 0) != CUDA_SUCCESS)
    rc = ow_fail(k->msg, "rank %u: cuGraphInstantiateWithFlags failed", k->rank);
  for (int r = 0; rc == 0 && r < GR_REPLAYS; r++) {
    char how[64];
    snprintf(how, sizeof how, "graph replay %d", r);
    rc = cr_upload(k, d) || outs_poison(k, NULL, pz);
    if (rc == 0 && g.launch(exec, k->s) != CUDA_SUCCESS)
      rc = ow_fail(k->msg, "rank %u: cuGraphLaunch failed", k->rank);
    rc = rc || outs_same(k, &want, NULL, how, d);
  }
  if (exec != NULL)
    g.exec_free(exec);
  if (graph != NULL)
    g.free(graph);
  outs_free(&want);
  /* The device counted the replays' calls; the library's next call reads its count (and
   * cr_round_ll after this one shows the ranks still in step). */
  uint64_t dig = 0;
  return rc || cr_upload(k, d) || cr_round_ll(k, d, fp8, pz, &dig);
}

/* rc must be want; the call was refused before anything was launched. */
static int refused(struct rk *k, int rc, int want, const char *what, const struct ow_case *d) {
  if (rc == want)
    return 0;
  return ow_fail(k->msg, "rank %u: %s returned %s, expected %s (%s) [%s]", k->rank, what,
                 dep_errname(rc), dep_errname(want), rc ? dep_errmsg(k->c) : "it ran", d->desc);
}

/* Each invalid sequence of deepep.h "Split calls" refused on cuda (DEP_ERR_INVALID), then
 * the valid calls received and a whole round matching the oracle: nothing was sent by a
 * refused call, so the ranks stayed in step. */
static int body_refuse(struct rk *k, const struct ow_case *d, int fp8, uint8_t pz) {
  dep_handle_t *h2 = NULL, *h3 = NULL;
  if (dep_handle_new(k->c, &h2) != 0 || dep_handle_new(k->c, &h3) != 0) {
    dep_handle_free(h2);
    return ow_fail(k->msg, "rank %u: dep_handle_new: %s", k->rank, dep_errmsg(k->c));
  }
  const uint32_t n = d->in_ll[k->rank].num_tokens;
  struct dep_ll_dispatch_args ds = ll_disp(k, d, fp8, DEP_LL_SEND, NULL);
  struct dep_ll_dispatch_args dr = ll_disp(k, d, fp8, DEP_LL_RECV, NULL);
  struct dep_ll_dispatch_args dw = ll_disp(k, d, fp8, 0, NULL);
  struct dep_ll_dispatch_args dn = dr;
  dn.num_tokens = n == 0 ? 1 : n - 1;
  struct dep_ll_combine_args cr = ll_comb(k, d, DEP_LL_RECV, NULL);
  struct dep_ll_combine_args cw = ll_comb(k, d, 0, NULL);
  struct dep_ll_handle_info_args ia = {sizeof ia, CR_DEV(k, B_LSRC), CR_DEV(k, B_LRANGE)};
  int rc = cr_upload(k, d) ||
           refused(k, dep_ll_dispatch(k->c, &dr, h3, k->s), DEP_ERR_INVALID,
                   "a receive with no send", d) ||
           refused(k, dep_ll_dispatch(k->c, &ds, k->h, k->s), 0, "send A", d) ||
           refused(k, dep_ll_dispatch(k->c, &ds, k->h, k->s), DEP_ERR_INVALID,
                   "a second send into A's handle", d) ||
           refused(k, dep_ll_dispatch(k->c, &dw, k->h, k->s), DEP_ERR_INVALID,
                   "a whole dispatch into A's handle", d) ||
           refused(k, dep_ll_combine(k->c, &cr, k->h, k->s), DEP_ERR_INVALID,
                   "a combine's receive of A's dispatch send", d) ||
           refused(k, dep_ll_combine(k->c, &cw, k->h, k->s), DEP_ERR_INVALID,
                   "a combine of A's handle before its receive", d) ||
           refused(k, dep_ll_handle_info(k->c, &ia, k->h, k->s), DEP_ERR_INVALID,
                   "dep_ll_handle_info of A's handle before its receive", d) ||
           refused(k, dep_ll_dispatch(k->c, &dn, k->h, k->s), DEP_ERR_INVALID,
                   "A's receive with another num_tokens", d) ||
           refused(k, dep_ll_dispatch(k->c, &ds, h2, k->s), 0, "send B", d) ||
           refused(k, dep_ll_dispatch(k->c, &ds, h3, k->s), DEP_ERR_INVALID,
                   "a third send (A's slots)", d) ||
           refused(k, dep_ll_dispatch(k->c, &dw, h3, k->s), DEP_ERR_INVALID,
                   "a whole call on A's slots", d) ||
           refused(k, dep_ll_dispatch(k->c, &dr, h2, k->s), 0, "B's receive", d) ||
           refused(k, dep_ll_dispatch(k->c, &dr, k->h, k->s), 0, "A's receive", d) ||
           refused(k, dep_ll_dispatch(k->c, &dr, k->h, k->s), DEP_ERR_INVALID,
                   "A's receive again", d);
  if (k->cu->cuStreamSynchronize(k->s) != CUDA_SUCCESS && rc == 0)
    rc = ow_fail(k->msg, "rank %u: cuStreamSynchronize failed", k->rank);
  dep_handle_free(h2);
  dep_handle_free(h3);
  uint64_t dig = 0;
  return rc || cr_upload(k, d) || cr_round_ll(k, d, fp8, pz, &dig);
}

static int body(struct rk *k, void *arg) {
  const struct split_arg *a = arg;
  static int (*const run[])(struct rk *, const struct ow_case *, int, uint8_t) = {
      [T_SPLIT] = body_split, [T_PAIRS] = body_pairs, [T_GRAPH] = body_graph,
      [T_REFUSE] = body_refuse};
  for (int fp8 = 0; fp8 <= (a->d->sc.fp8 ? 1 : 0); fp8++)
    for (int round = 0; round < 2; round++)
      if (run[a->test](k, a->d, fp8, round ? 0x5A : 0xA5))
        return 1;
  return 0;
}

static const struct ow_scenario split_cases[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {4, 2048, 4, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 1},
  {2, 128, 2, 8, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0},
  {8, 7168, 8, 32, 16, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 1},
};
#define N_SPLIT_CASES ((int)(sizeof split_cases / sizeof split_cases[0]))

static void run_split(int i, enum split_test test, const char *name) {
  ow_seed_init(700 + (uint64_t)i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &split_cases[i], split_cases[i].fp8);
  struct split_arg a = {d, test};
  struct cr_world w;
  cr_world_start(&w, NULL);
  char job[32];
  snprintf(job, sizeof job, "%s-%d", name, i);
  cr_run_procs(&w, job, &d->shape, d->sc.world, body, &a, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}

/* Each of these fails on the old library at its first split call: DEP_ERR_UNSUPPORTED ("the
 * cuda kernels run a low-latency call whole"). */
START_TEST(split_calls_equal_whole_calls_though_x_is_overwritten_between_send_and_receive) {
  CR_NEEDS_GPU();
  run_split(_i, T_SPLIT, "split");
}
END_TEST

START_TEST(two_micro_batches_interleaved_equal_whole_calls) {
  CR_NEEDS_GPU();
  run_split(_i, T_PAIRS, "pairs");
}
END_TEST

START_TEST(a_captured_send_and_receive_replay_as_whole_calls) {
  CR_NEEDS_GPU();
  run_split(_i, T_GRAPH, "graph");
}
END_TEST

START_TEST(each_invalid_split_sequence_is_refused_and_the_ranks_stay_in_step) {
  CR_NEEDS_GPU();
  run_split(_i, T_REFUSE, "refuse");
}
END_TEST

/* ---- a rank that leaves an elastic job with a split call of its unread ----------- */

/* Shared by the rank processes (mmap). */
struct unread_arg {
  const struct ow_case *d; /* its oracle has the victim masked; its inputs are every call's */
  uint32_t victim;
  _Atomic uint32_t read;   /* survivors that received calls 1 and 2 */
};
/* How long the victim waits for the survivors: a ceiling for a loaded machine. */
#define UNREAD_CEILING_MS 60000

/*
 * Every rank sends calls 1 and 2 (split dispatches, micro-batches A and B).  The victim
 * then waits until the survivors have received both and detaches, never receiving call 1:
 * the daemon masks it (an elastic job).  A survivor, once it has received both, makes a
 * whole dispatch and combine (calls 3 and 4, cr_round_ll against the oracle with the
 * victim masked), whose kernels first wait for every peer's read of calls 1 and 2 (their
 * slots are theirs): they must end when the victim leaves, not at the op timeout.
 */
static int body_unread(struct rk *k, void *arg) {
  struct unread_arg *u = arg;
  const struct ow_case *d = u->d;
  CUdeviceptr alt[S_N] = {0};
  dep_handle_t *h2 = NULL;
  int rc = cr_upload(k, d);
  rc = rc || batch_b_new(k, alt, &h2);
  struct dep_ll_dispatch_args as = ll_disp(k, d, 0, DEP_LL_SEND, NULL);
  struct dep_ll_dispatch_args ar = ll_disp(k, d, 0, DEP_LL_RECV, NULL);
  struct dep_ll_dispatch_args bs = ll_disp(k, d, 0, DEP_LL_SEND, alt);
  struct dep_ll_dispatch_args br = ll_disp(k, d, 0, DEP_LL_RECV, alt);
  if (rc == 0 && (rc = dep_ll_dispatch(k->c, &as, k->h, k->s)) != 0)
    rc = ow_fail(k->msg, "rank %u: send of call 1: %s", k->rank, dep_errmsg(k->c));
  if (rc == 0 && (rc = dep_ll_dispatch(k->c, &bs, h2, k->s)) != 0)
    rc = ow_fail(k->msg, "rank %u: send of call 2: %s", k->rank, dep_errmsg(k->c));
  if (rc == 0 && k->cu->cuStreamSynchronize(k->s) != CUDA_SUCCESS)
    rc = ow_fail(k->msg, "rank %u: cuStreamSynchronize failed", k->rank);
  if (rc == 0 && k->rank == u->victim) {
    const uint64_t until = cr_ms_now() + UNREAD_CEILING_MS;
    while (rc == 0 && atomic_load(&u->read) < k->W - 1)
      if (cr_ms_now() > until)
        rc = ow_fail(k->msg, "rank %u (the victim): the survivors never received calls 1 and 2",
                     k->rank);
    dep_handle_free(h2);
    h2 = NULL;
    dep_handle_free(k->h);
    k->h = NULL;
    if (rc == 0 && (rc = dep_detach(k->c)) != 0)
      rc = ow_fail(k->msg, "rank %u: dep_detach: %s", k->rank, dep_errmsg(k->c));
  } else if (rc == 0) {
    if ((rc = dep_ll_dispatch(k->c, &ar, k->h, k->s)) != 0 ||
        (rc = dep_ll_dispatch(k->c, &br, h2, k->s)) != 0)
      rc = ow_fail(k->msg, "rank %u: receive of call 1 or 2: %s", k->rank, dep_errmsg(k->c));
    if (rc == 0 && k->cu->cuStreamSynchronize(k->s) != CUDA_SUCCESS)
      rc = ow_fail(k->msg, "rank %u: cuStreamSynchronize failed", k->rank);
    if (rc == 0)
      atomic_fetch_add(&u->read, 1);
    uint64_t dig = 0;
    rc = rc || cr_round_ll(k, d, 0, 0xA5, &dig) || cr_round_ll(k, d, 0, 0x5A, &dig);
  }
  rc = batch_b_end(k, alt, h2, rc);
  return rc;
}

/*
 * An elastic job of 4 ranks on one daemon: a rank that sent two split calls and leaves
 * without receiving the first is masked, and the survivors' next calls, whose kernels wait
 * for its read of those calls (wait_taken), end with it masked and match the masked
 * oracle.  On the old kernels that wait looked only at the mask the call began with, and
 * each survivor's call 3 failed DEP_ERR_TIMEOUT after the op timeout (5000 ms here, so that
 * it fails quickly).
 */
START_TEST(a_split_call_waiting_for_the_read_of_a_rank_that_left_ends_with_it_masked) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {4, 2048, 4, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I64,
                                        0};
  ow_seed_init(750 + (uint64_t)_i);
  const uint32_t victim = _i == 0 ? 1u : 3u;
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &sc, 0);
  uint8_t masked[OW_MAXW] = {0};
  masked[victim] = 1;
  ow_case_mask(d, masked);
  struct unread_arg *u = mmap(NULL, sizeof *u, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(u, MAP_FAILED);
  memset(u, 0, sizeof *u);
  u->d = d;
  u->victim = victim;
  struct cr_world w;
  cr_world_start(&w, "limits:\n  op_timeout_ms: 5000\n");
  struct cr_place p = {.wait_all = true, .flags = DEP_ATTACH_ELASTIC};
  for (uint32_t r = 0; r < sc.world; r++) {
    p.sock[r] = w.dm.sock;
    p.local[r] = r;
    p.lws[r] = sc.world;
  }
  static char fails[OW_FAILS_LEN];
  const int nfail = cr_run_procs_placed(&w, &p, "unread", &d->shape, sc.world, body_unread, u,
                                        fails, sizeof fails);
  OW_ASSERT_NONE_FAILED("a split call waiting for a rank that left", nfail, fails);
  cr_world_stop(&w);
  munmap(u, sizeof *u);
  ow_case_free(d);
  free(d);
}
END_TEST

TCase *cuda_ops_split_tcase(void) {
  TCase *t = tcase_create("split");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 300);
  tcase_add_loop_test(
      t, split_calls_equal_whole_calls_though_x_is_overwritten_between_send_and_receive, 0,
      N_SPLIT_CASES);
  tcase_add_loop_test(t, two_micro_batches_interleaved_equal_whole_calls, 0, N_SPLIT_CASES);
  tcase_add_loop_test(t, a_captured_send_and_receive_replay_as_whole_calls, 0, N_SPLIT_CASES);
  tcase_add_loop_test(t, each_invalid_split_sequence_is_refused_and_the_ranks_stay_in_step, 0,
                      N_SPLIT_CASES);
  tcase_add_loop_test(t, a_split_call_waiting_for_the_read_of_a_rank_that_left_ends_with_it_masked,
                      0, 2);
  return t;
}
