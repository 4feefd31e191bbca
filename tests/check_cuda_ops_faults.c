/*
 * check_cuda_ops_faults.c — suite cuda_ops's faults case (check_cuda_ops.c
 * makes the suite and adds it): a rank that never calls (DEP_ERR_TIMEOUT
 * within the bound, the daemon healthy after), a rank the daemon found gone
 * (DEP_ERR_PEER at once), a rank whose process ends (DEP_ERR_PEER through
 * the daemon's abort words), out-of-range ids (DEP_ERR_INVALID through the
 * error word) and bad arguments refused before any launch.  Tagged "gpu"
 * and run as check_cuda_ops.c says: each test skips, saying why, unless
 * DEP_TEST_BACKEND=cuda and a GPU is present.
 */
#include <check.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check_cuda_ops.h"
#include "cudadrv.h"
#include "deepep.h"
#include "opsworld.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "slab.h"
#include "testutil.h"

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

/* The calls the fault tests make, on the rank's buffers, for n tokens. */
struct fault_calls {
  struct dep_dispatch_args da;
  struct dep_ll_dispatch_args la;
  struct dep_ll_combine_args lc;
  uint32_t nrecv;
};

static void fault_calls(struct rk *k, const struct ow_case *d, uint32_t n, struct fault_calls *f) {
  f->nrecv = 0;
  f->da = (struct dep_dispatch_args){.size = sizeof(struct dep_dispatch_args), .x = CR_DEV(k, B_X),
                                     .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                     .topk_weights = CR_DEV(k, B_W),
                                     .num_tokens = n, .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX), .recv_topk_weights = CR_DEV(k, B_RW),
                                     .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &f->nrecv};
  f->la = (struct dep_ll_dispatch_args){sizeof(struct dep_ll_dispatch_args), CR_DEV(k, B_X),
                                        CR_DEV(k, B_IDX), d->sc.itype, n, 0,
                                        CR_DEV(k, B_LRX), NULL, CR_DEV(k, B_LCNT), 0, NULL};
  f->lc = (struct dep_ll_combine_args){sizeof(struct dep_ll_combine_args), CR_DEV(k, B_LX),
                                       CR_DEV(k, B_IDX), d->sc.itype,
                                       CR_DEV(k, B_W), CR_DEV(k, B_LOUT), 0, NULL};
}

/* Rank 1 attaches but never calls; rank 0's call must fail within the bound. */
static int body_silent_peer(struct rk *k, void *arg) {
  const struct fault_arg *a = arg;
  const struct ow_case *d = a->d;
  if (k->rank == 1) {
    usleep(2500000);
    return 0;
  }
  if (cr_upload(k, d))
    return 1;
  struct fault_calls f;
  fault_calls(k, d, d->in[0].num_tokens, &f);
  uint64_t t0 = cr_ms_now(), waited;
  if (!a->ll) {
    EXPECT(k, dep_dispatch(k->c, &f.da, k->h, k->s), DEP_ERR_TIMEOUT, "dep_dispatch");
    waited = cr_ms_now() - t0;
  } else {
    EXPECT(k, dep_ll_dispatch(k->c, &f.la, k->h, k->s), 0, "dep_ll_dispatch");
    if (cr_ms_now() - t0 > 200)
      return ow_fail(k->msg, "dep_ll_dispatch blocked %llu ms; it must not synchronise",
                     (unsigned long long)(cr_ms_now() - t0));
    CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
    waited = cr_ms_now() - t0;
    EXPECT(k, dep_ll_combine(k->c, &f.lc, k->h, k->s), DEP_ERR_TIMEOUT, "dep_ll_combine");
  }
  if (waited < 450 || waited > 2000)
    return ow_fail(k->msg, "the call failed after %llu ms; the bound is 500 ms",
                   (unsigned long long)waited);
  if (strstr(dep_errmsg(k->c), "waiting for rank 1") == NULL)
    return ow_fail(k->msg, "the message does not name rank 1: %s", dep_errmsg(k->c));
  printf("cuda_ops: %s with a silent peer: DEP_ERR_TIMEOUT after %llu ms: %s\n",
         a->ll ? "ll_dispatch" : "dispatch", (unsigned long long)waited, dep_errmsg(k->c));
  fflush(stdout); /* a rank process ends with _exit */
  EXPECT(k, dep_ll_dispatch(k->c, &f.la, k->h, k->s), DEP_ERR_STATE, "a call after the timeout");
  return 0;
}

START_TEST(a_rank_that_never_calls_is_a_bounded_timeout_and_the_daemon_carries_on) {
  CR_NEEDS_GPU();
  ow_seed_init(400);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  struct cr_world w;
  cr_world_start(&w, SHORT_OPS);
  struct fault_arg tp = {d, 0}, ll = {d, 1};
  cr_run_procs(&w, "silent-tp", &d->shape, 2, body_silent_peer, &tp, "silent peer, dispatch");
  cr_run_procs(&w, "silent-ll", &d->shape, 2, body_silent_peer, &ll, "silent peer, ll_dispatch");
  struct cr_rounds a = {d, 1, 2}; /* a fresh job on the same daemon and GPUs works */
  cr_run_procs(&w, "after-timeouts", &d->shape, 2, cr_body_rounds, &a, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/*
 * The daemon's part (proto/slab.h): the abort words in rank 0's device
 * slab, rank and pid first, code last, 50 ms into rank 0's wait.  From a
 * thread of its own, on a stream of its own (the rank's kernel keeps its
 * stream busy until it sees the code).
 */
struct gpu_abort {
  struct rk *k;
  CUdeviceptr slab;
  CUresult r;
};

static void *abort_slab_later(void *arg) {
  struct gpu_abort *g = arg;
  const struct cudadrv *cu = g->k->cu;
  const uint32_t words[3] = {1, 4242, 0}; /* rank 1, pid 4242, died (not detached) */
  CUstream s = NULL;
  usleep(50000);
  CUresult r = cu->cuCtxSetCurrent(g->k->ctx);
  if (r == CUDA_SUCCESS)
    r = cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  if (r == CUDA_SUCCESS)
    r = cu->cuMemcpyHtoDAsync(g->slab + DEP_SLAB_ABORT_OFF, words, sizeof words, s);
  if (r == CUDA_SUCCESS)
    r = cu->cuMemsetD32Async(g->slab + DEP_SLAB_ABORT_OFF + offsetof(struct dep_slab_abort, code),
                             (unsigned)DEP_ERR_PEER, 1, s);
  if (r == CUDA_SUCCESS)
    r = cu->cuStreamSynchronize(s);
  if (s != NULL)
    cu->cuStreamDestroy(s);
  g->r = r;
  return NULL;
}

/* Rank 1 attaches and never calls; the daemon says it is gone while rank
 * 0's kernel waits for it: the call fails with DEP_ERR_PEER at once, not
 * after the 10 s op timeout, and the context is broken. */
static int body_gone_peer(struct rk *k, void *arg) {
  const struct fault_arg *a = arg;
  const struct ow_case *d = a->d;
  if (k->rank == 1) {
    usleep(1500000);
    return 0;
  }
  if (cr_upload(k, d))
    return 1;
  struct dep_attach_info info = {.size = sizeof info};
  EXPECT(k, dep_attach_info(k->c, &info), 0, "dep_attach_info");
  struct gpu_abort g = {k, (CUdeviceptr)(uintptr_t)info.slabs[info.local_rank], CUDA_SUCCESS};
  pthread_t th;
  if (pthread_create(&th, NULL, abort_slab_later, &g) != 0)
    return ow_fail(k->msg, "rank 0: pthread_create failed");
  struct fault_calls f;
  fault_calls(k, d, d->in[0].num_tokens, &f);
  uint64_t t0 = cr_ms_now();
  int rc;
  if (!a->ll) {
    rc = dep_dispatch(k->c, &f.da, k->h, k->s);
  } else {
    rc = dep_ll_dispatch(k->c, &f.la, k->h, k->s); /* no sync: the next call reports */
    if (rc == 0) {
      CUresult r = k->cu->cuStreamSynchronize(k->s);
      rc = r == CUDA_SUCCESS ? dep_ll_combine(k->c, &f.lc, k->h, k->s) : DEP_ERR_CUDA;
    }
  }
  uint64_t waited = cr_ms_now() - t0;
  pthread_join(th, NULL);
  if (g.r != CUDA_SUCCESS)
    return ow_fail(k->msg, "rank 0: writing the abort words: %s", cudadrv_errstr(g.r));
  if (rc != DEP_ERR_PEER)
    return ow_fail(k->msg, "rank 0: %s returned %s (%s), expected DEP_ERR_PEER",
                   a->ll ? "ll_dispatch then ll_combine" : "dep_dispatch", dep_errname(rc),
                   dep_errmsg(k->c));
  if (waited < 45 || waited > 1000)
    return ow_fail(k->msg, "rank 0: DEP_ERR_PEER after %llu ms; the abort words came after 50",
                   (unsigned long long)waited);
  if (strstr(dep_errmsg(k->c), "rank 1 (pid 4242) of the job is gone (its process ended)") == NULL)
    return ow_fail(k->msg, "rank 0: the message does not name rank 1: %s", dep_errmsg(k->c));
  printf("cuda_ops: %s with a gone peer: DEP_ERR_PEER after %llu ms: %s\n",
         a->ll ? "ll_dispatch" : "dispatch", (unsigned long long)waited, dep_errmsg(k->c));
  fflush(stdout); /* a rank process ends with _exit */
  EXPECT(k, dep_ll_dispatch(k->c, &f.la, k->h, k->s), DEP_ERR_STATE, "a call after it");
  return 0;
}

START_TEST(a_rank_the_daemon_found_gone_fails_the_wait_at_once) {
  CR_NEEDS_GPU();
  ow_seed_init(450);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  struct cr_world w;
  cr_world_start(&w, NULL); /* the default 10 s op timeout */
  struct fault_arg tp = {d, 0}, ll = {d, 1};
  cr_run_procs(&w, "gone-tp", &d->shape, 2, body_gone_peer, &tp, "gone peer, dispatch");
  cr_run_procs(&w, "gone-ll", &d->shape, 2, body_gone_peer, &ll, "gone peer, ll_dispatch");
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Shared with the rank processes: when rank 1 exited (cr_ms_now). */
static void *w_shared_for_dying;

/*
 * The whole path on device memory: rank 1's process ends (no detach) while
 * rank 0's kernel waits for it; the daemon sees the socket close and writes
 * the abort words into rank 0's device slab (a cuda chunk_batch), and
 * the call fails with DEP_ERR_PEER naming rank 1, long before the 10 s op
 * timeout.  The time from rank 1's exit to rank 0's error is printed.
 */
static int body_dying_peer(struct rk *k, void *arg) {
  const struct fault_arg *a = arg;
  const struct ow_case *d = a->d;
  uint64_t *exit_ms = (uint64_t *)(w_shared_for_dying);
  if (k->rank == 1) {
    usleep(300000);
    *exit_ms = cr_ms_now();
    _exit(0); /* no detach, no free: as a crash ends it */
  }
  if (cr_upload(k, d))
    return 1;
  struct fault_calls f;
  fault_calls(k, d, d->in[0].num_tokens, &f);
  int rc = dep_dispatch(k->c, &f.da, k->h, k->s);
  uint64_t now = cr_ms_now();
  if (rc != DEP_ERR_PEER)
    return ow_fail(k->msg, "rank 0: dep_dispatch returned %s (%s), expected DEP_ERR_PEER",
                   dep_errname(rc), dep_errmsg(k->c));
  if (strstr(dep_errmsg(k->c), "rank 1 (pid ") == NULL ||
      strstr(dep_errmsg(k->c), "its process ended") == NULL)
    return ow_fail(k->msg, "rank 0: the message does not name rank 1's end: %s",
                   dep_errmsg(k->c));
  uint64_t ms = now - *exit_ms;
  if (*exit_ms == 0 || ms > 5000)
    return ow_fail(k->msg, "rank 0: DEP_ERR_PEER %llu ms after rank 1's exit",
                   (unsigned long long)ms);
  printf("cuda_ops: a peer's process ended: DEP_ERR_PEER %llu ms after its exit: %s\n",
         (unsigned long long)ms, dep_errmsg(k->c));
  fflush(stdout);
  return 0;
}

START_TEST(a_rank_whose_process_ends_fails_its_peer_through_the_daemon) {
  CR_NEEDS_GPU();
  ow_seed_init(470);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  w_shared_for_dying = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(w_shared_for_dying != MAP_FAILED);
  memset(w_shared_for_dying, 0, 8);
  struct cr_world w;
  cr_world_start(&w, NULL); /* the default 10 s op timeout */
  struct fault_arg tp = {d, 0};
  cr_run_procs(&w, "dying", &d->shape, 2, body_dying_peer, &tp, "a peer whose process ends");
  cr_world_stop(&w);
  munmap(w_shared_for_dying, 4096);
  ow_case_free(d);
  free(d);
}
END_TEST

static int put_bad_idx(struct rk *k, const struct ow_case *d, int64_t bad) {
  size_t n = (size_t)d->in[k->rank].num_tokens * k->K;
  int64_t *idx = malloc(n * 8 + 8);
  memcpy(idx, d->idx[k->rank], n * 8);
  idx[0] = bad;
  int rc = cr_put(k, B_IDX, idx, n * 8);
  free(idx);
  return rc;
}

/* Bad arguments: refused on the host, nothing launched.  Bad expert ids:
 * found by the kernels, DEP_ERR_INVALID through the error word. */
static int body_invalid(struct rk *k, void *arg) {
  const struct ow_case *d = arg;
  const uint32_t n = d->in[k->rank].num_tokens;
  uint64_t dig = 0;
  struct fault_calls f;
  fault_calls(k, d, n, &f);
  if (cr_upload(k, d))
    return 1;
  if (k->rank == 0) { /* only rank 0 makes them: none may count as a call */
    struct dep_dispatch_args b = f.da;
    b.x = NULL;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch with x NULL");
    if (strstr(dep_errmsg(k->c), "x is NULL") == NULL)
      return ow_fail(k->msg, "message does not name x: %s", dep_errmsg(k->c));
    b = f.da;
    b.num_tokens = k->mt + 1;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch over max_tokens");
    b = f.da;
    b.index_type = 7;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch, index_type 7");
    b = f.da;
    b.topk_weights = (const float *)((uintptr_t)CR_DEV(k, B_W) + 2);
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID, "dispatch, unaligned weights");
    int32_t hc[4];
    b = f.da;
    b.recv_count_per_expert_host = hc;
    b.num_worst_tokens = 1;
    EXPECT(k, dep_dispatch(k->c, &b, k->h, k->s), DEP_ERR_INVALID,
           "dispatch, recv_count_per_expert_host with num_worst_tokens");
    if (strstr(dep_errmsg(k->c), "recv_count_per_expert_host is not written") == NULL)
      return ow_fail(k->msg, "message does not name recv_count_per_expert_host: %s",
                     dep_errmsg(k->c));
    struct dep_ll_dispatch_args bl = f.la;
    bl.use_fp8 = 2;
    EXPECT(k, dep_ll_dispatch(k->c, &bl, k->h, k->s), DEP_ERR_INVALID, "ll_dispatch, use_fp8 2");
    bl = f.la;
    bl.use_fp8 = 1; /* recv_scales NULL */
    EXPECT(k, dep_ll_dispatch(k->c, &bl, k->h, k->s), DEP_ERR_INVALID, "fp8 without scales");
    EXPECT(k, dep_ll_combine(k->c, &f.lc, k->h, k->s), DEP_ERR_INVALID, "ll_combine, empty handle");
    struct dep_layout_args lb = {sizeof(struct dep_layout_args), CR_DEV(k, B_IDX), d->sc.itype, n,
                                 NULL, CR_DEV(k, B_TPE),
                                 CR_DEV(k, B_TIR)};
    EXPECT(k, dep_layout(k->c, &lb, k->s), DEP_ERR_INVALID, "layout, tokens_per_rank NULL");
  }
  /* The ranks are still in step: a whole round is right. */
  if (cr_round_tp(k, d, 0xA5, &dig) || cr_round_ll(k, d, 0, 0xA5, &dig))
    return 1;
  /* An id past num_experts in dispatch: that rank's call says so after its sync. */
  if (k->rank == 0 && put_bad_idx(k, d, k->E))
    return 1;
  EXPECT(k, dep_dispatch(k->c, &f.da, k->h, k->s), k->rank == 0 ? DEP_ERR_INVALID : 0,
         "dispatch with topk_idx[0][0] = num_experts on rank 0");
  if (k->rank == 0 && strstr(dep_errmsg(k->c), "topk_idx of token 0") == NULL)
    return ow_fail(k->msg, "message does not name the token: %s", dep_errmsg(k->c));
  /* ... and the job carries on: the ranks stayed in step. */
  if (cr_upload(k, d) || cr_round_tp(k, d, 0x5A, &dig) || cr_round_ll(k, d, 0, 0x5A, &dig))
    return 1;
  /* In ll_dispatch (no sync) the next call reports it and is not made; the
   * peer, left waiting for that call, times out within its bound. */
  if (k->rank == 0 && put_bad_idx(k, d, -2))
    return 1;
  EXPECT(k, dep_ll_dispatch(k->c, &f.la, k->h, k->s), 0, "ll_dispatch (bad id on rank 0)");
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  EXPECT(k, dep_ll_combine(k->c, &f.lc, k->h, k->s), k->rank == 0 ? DEP_ERR_INVALID : 0,
         "the ll_combine after it");
  if (k->rank == 1) {
    /* Left waiting for rank 0's ll_combine, which never comes: a timeout
     * within its bound, or, once rank 0 has finished and detached, sooner,
     * DEP_ERR_PEER naming it (the daemon's abort words). */
    CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
    int rc = dep_ll_dispatch(k->c, &f.la, k->h, k->s);
    if (rc != DEP_ERR_TIMEOUT &&
        !(rc == DEP_ERR_PEER && strstr(dep_errmsg(k->c), "rank 0 (pid ") != NULL &&
          strstr(dep_errmsg(k->c), "detached") != NULL))
      return ow_fail(k->msg, "rank 1: the call after that returned %s (%s), expected "
                     "DEP_ERR_TIMEOUT, or DEP_ERR_PEER for rank 0's detach", dep_errname(rc),
                     dep_errmsg(k->c));
  }
  struct dep_layout_args lay = {sizeof(struct dep_layout_args), CR_DEV(k, B_IDX), d->sc.itype, n,
                                CR_DEV(k, B_TPR), CR_DEV(k, B_TPE),
                                CR_DEV(k, B_TIR)};
  EXPECT(k, dep_layout(k->c, &lay, k->s), DEP_ERR_STATE, "a call once out of step");
  return 0;
}

START_TEST(bad_arguments_and_bad_expert_ids_are_invalid_and_never_corrupt_memory) {
  CR_NEEDS_GPU();
  ow_seed_init(500);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &small, 0);
  struct cr_world w;
  cr_world_start(&w, SHORT_OPS);
  cr_run_procs(&w, "invalid", &d->shape, 2, body_invalid, d, "bad arguments and ids");
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

TCase *cuda_ops_faults_tcase(void) {
  TCase *faults = tcase_create("faults");
  tcase_set_tags(faults, "gpu");
  tcase_set_timeout(faults, 120);
  tcase_add_test(faults, a_rank_that_never_calls_is_a_bounded_timeout_and_the_daemon_carries_on);
  tcase_add_test(faults, a_rank_the_daemon_found_gone_fails_the_wait_at_once);
  tcase_add_test(faults, a_rank_whose_process_ends_fails_its_peer_through_the_daemon);
  tcase_add_test(faults, bad_arguments_and_bad_expert_ids_are_invalid_and_never_corrupt_memory);
  return faults;
}
