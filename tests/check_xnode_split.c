/*
 * check_xnode_split.c — split low-latency calls (deepep.h "Split calls") in a
 * job across daemons on the cuda backend: two cuda daemons sharing one GPU
 * (check_xnode.c's harness: nodes.h, cudaranks.h), a receiver on one node
 * slow to read, against the oracle.  Tagged gpu (make check-gpu); the host
 * backend's split calls across nodes are check_ops_split.c's.
 */
#include <check.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "testutil.h"
#include "xnjob.h"
#include "xngpu.h"
#include "xnround.h"

/* ---- split calls across daemons on the GPU --------------------------------------- */

/*
 * What the ranks of the split test share (memory shared with the test: they are
 * processes).  Rank GS_SLOW (node 0) is slow to receive the first split call: before its
 * receive it waits, up to GS_EARLY_MS, for both ranks of node 1 to have run their send of
 * the split call two after it (their stream synchronised), which reuses its blocks.
 */
#define GS_SLOW 0u
#define GS_FAR 2u /* the first rank on node 1 */
/* A ceiling the fixed kernels always wait out (node 1's sends cannot end before rank 0
 * has read), not a timing the test relies on; a machine stalled this long could only let
 * the old kernels pass a run. */
#define GS_EARLY_MS 1500
struct gpu_split {
  const struct ow_case *d;
  _Atomic uint32_t sent3; /* ranks on node 1 whose send of the third split call has ended */
  _Atomic int early;      /* 1: they both had before rank GS_SLOW received the first */
};

/* The outputs of a bf16 low-latency pair, as compared: recv_x, recv_count, out. */
enum { GS_RX, GS_CNT, GS_OUT, GS_N };
static const int gs_buf[GS_N] = {B_LRX, B_LCNT, B_LOUT};

/* Step st of an interleaving (xnround.h): micro-batch 0 in the rank's own outputs and
 * handle, micro-batch 1 in alt and h2; the inputs are the same (case d). */
static int gs_step(struct rk *k, const struct ow_case *d, const struct xn_step *st,
                   const CUdeviceptr *alt, dep_handle_t *h2) {
  void *o[GS_N];
  for (int i = 0; i < GS_N; i++)
    o[i] = st->mb != 0 ? (void *)(uintptr_t)alt[i] : CR_DEV(k, gs_buf[i]);
  dep_handle_t *h = st->mb != 0 ? h2 : k->h;
  if (st->op == 'd') {
    struct dep_ll_dispatch_args a = {.size = sizeof a, .x = CR_DEV(k, B_X),
                                     .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                     .num_tokens = d->in_ll[k->rank].num_tokens,
                                     .recv_x = o[GS_RX], .recv_count = o[GS_CNT],
                                     .phases = st->phase};
    CALL(k, dep_ll_dispatch(k->c, &a, h, k->s), "dep_ll_dispatch (split)");
  } else {
    struct dep_ll_combine_args a = {.size = sizeof a, .x = CR_DEV(k, B_LX),
                                    .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                    .topk_weights = CR_DEV(k, B_W), .out = o[GS_OUT],
                                    .phases = st->phase};
    CALL(k, dep_ll_combine(k->c, &a, h, k->s), "dep_ll_combine (split)");
  }
  return 0;
}

/* Micro-batch mb's outputs (alt for 1), whole buffers, equal want byte for byte. */
static int gs_same(struct rk *k, const struct ow_case *d, uint8_t *const *want,
                   const CUdeviceptr *alt, int mb, int mode) {
  CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize");
  for (int i = 0; i < GS_N; i++) {
    const int b = gs_buf[i];
    CR_CU(k, k->cu->cuMemcpyDtoH(k->host, mb != 0 ? alt[i] : k->b[b], k->sz[b]),
          "cuMemcpyDtoH");
    if (memcmp(k->host, want[i], k->sz[b]) != 0)
      return ow_fail(k->msg, "rank %u: split calls, interleaving %d, micro-batch %c: %s is "
                     "not the whole calls' [%s]", k->rank, mode, 'A' + mb,
                     i == GS_RX ? "recv_x" : i == GS_CNT ? "recv_count" : "out", d->desc);
  }
  return 0;
}

/* Both interleavings of xnround.h on device buffers, rank GS_SLOW slow to receive in the
 * first (struct gpu_split), each micro-batch's outputs against the whole calls'. */
static int gs_interleave(struct rk *k, struct gpu_split *g, uint8_t *const *want,
                         const CUdeviceptr *alt, dep_handle_t *h2) {
  const struct ow_case *d = g->d;
  for (int mode = 0; mode < XN_SPLIT_MODES; mode++) {
    for (int i = 0; i < GS_N; i++) /* as cr_round_ll poisoned the whole calls' */
      for (int mb = 0; mb < 2; mb++)
        CR_CU(k, k->cu->cuMemsetD8Async(mb != 0 ? alt[i] : k->b[gs_buf[i]], 0xA5,
                                        k->sz[gs_buf[i]], k->s),
              "cuMemsetD8Async");
    for (int st = 0; st < XN_SPLIT_STEPS; st++) {
      if (mode == 0 && st == 2 && k->rank == GS_SLOW) {
        const uint64_t until = cr_ms_now() + GS_EARLY_MS;
        while (atomic_load(&g->sent3) < k->W - GS_FAR && cr_ms_now() < until)
          dw_sleep_ms(5);
        atomic_store(&g->early, atomic_load(&g->sent3) == k->W - GS_FAR);
      }
      if (gs_step(k, d, &xn_split_modes[mode][st], alt, h2))
        return 1;
      if (mode == 0 && st == 3 && k->rank >= GS_FAR) {
        CR_CU(k, k->cu->cuStreamSynchronize(k->s), "cuStreamSynchronize (the third send)");
        atomic_fetch_add(&g->sent3, 1);
      }
    }
    if (gs_same(k, d, want, alt, 0, mode) || gs_same(k, d, want, alt, 1, mode))
      return 1;
  }
  return 0;
}

/* Every rank: the whole low-latency calls against the oracle (their outputs kept), both
 * split interleavings against them, then a whole round against the oracle again. */
static int body_split(struct rk *k, void *arg) {
  struct gpu_split *g = arg;
  const struct ow_case *d = g->d;
  uint64_t dig = 0;
  uint8_t *want[GS_N] = {0};
  CUdeviceptr alt[GS_N] = {0};
  dep_handle_t *h2 = NULL;
  int rc = cr_upload(k, d) || cr_round_ll(k, d, 0, 0xA5, &dig);
  for (int i = 0; rc == 0 && i < GS_N; i++) {
    rc = cr_get(k, gs_buf[i]);
    if (rc == 0 && (want[i] = malloc(k->sz[gs_buf[i]])) == NULL)
      rc = ow_fail(k->msg, "out of memory");
    if (rc == 0)
      memcpy(want[i], k->host, k->sz[gs_buf[i]]);
    if (rc == 0 && k->cu->cuMemAlloc(&alt[i], k->sz[gs_buf[i]]) != CUDA_SUCCESS)
      rc = ow_fail(k->msg, "rank %u: cuMemAlloc failed", k->rank);
  }
  if (rc == 0 && dep_handle_new(k->c, &h2) != 0)
    rc = ow_fail(k->msg, "rank %u: dep_handle_new: %s", k->rank, dep_errmsg(k->c));
  rc = rc || gs_interleave(k, g, want, alt, h2) || cr_round_ll(k, d, 0, 0x5A, &dig);
  if (k->cu->cuStreamSynchronize(k->s) != CUDA_SUCCESS && rc == 0)
    rc = ow_fail(k->msg, "rank %u: cuStreamSynchronize failed", k->rank);
  dep_handle_free(h2);
  for (int i = 0; i < GS_N; i++) {
    free(want[i]);
    if (alt[i] != 0)
      k->cu->cuMemFree(alt[i]);
  }
  return rc;
}

/*
 * Split low-latency calls (deepep.h DEP_LL_SEND, DEP_LL_RECV) over two
 * daemons sharing the GPU, the cuda counterpart of ops_split's
 * across_nodes_a_slow_receiver_is_not_overwritten: 2 + 2 ranks, micro-
 * batches A and B pipelined (send 1, send 2, receive 1, send 3, ...) and
 * as two batches (xnround.h), every output equal to the whole calls',
 * which match the oracle.  Rank 0 is slow to receive call 1; call 3
 * reuses call 1's blocks, so node 1's sends of call 3 must not end before
 * rank 0 has read it (its receive's TAKEN descriptor, or its post of call
 * 3: kabi.h "Split calls").  The two-batch interleaving needs the TAKEN
 * descriptors: each rank receives calls 1 and 2 before it posts call 3,
 * so without them every rank's send of call 3 waits for the others'.  The
 * old library refused the first split send here (DEP_ERR_UNSUPPORTED).
 */
START_TEST(on_the_gpu_split_calls_across_daemons_never_overwrite_a_slow_receiver) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {4, 2048, 8, 16, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32,
                                        0};
  ow_seed_init(3300);
  struct gpu_split *g = mmap(NULL, sizeof *g, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                             -1, 0);
  ck_assert_ptr_ne(g, MAP_FAILED);
  memset(g, 0, sizeof *g);
  g->d = xn_case_new(&sc, 0);
  struct nodes ns;
  nodes_config_with(&ns, 2, 60000, ", op_timeout_ms: 30000", "");
  nodes_start_all(&ns);
  static const uint32_t split[NODES_MAX] = {2, 2};
  const uint64_t t0 = cr_ms_now();
  static char fails[OW_FAILS_LEN];
  const int nfail = xg_run(&ns, split, "gpu-split", g->d, body_split, g, false, fails,
                            sizeof fails);
  OW_ASSERT_NONE_FAILED(g->d->desc, nfail, fails);
  ck_assert_msg(!atomic_load(&g->early), "the ranks on node 1 ended their send of call 3 before "
                "rank %u read call 1, whose blocks call 3 reuses (DEP_TEST_SEED=%llu)", GS_SLOW,
                (unsigned long long)ow_seed);
  printf("xnode gpu: split calls over 2 daemons, rank %u slow to receive: as the whole calls, "
         "in %llu ms\n", GS_SLOW, (unsigned long long)(cr_ms_now() - t0));
  nodes_stop(&ns);
  xn_case_free((struct ow_case *)g->d);
  munmap(g, sizeof *g);
}
END_TEST

Suite *xnode_split_suite(void);
Suite *xnode_split_suite(void) {
  Suite *s = suite_create("xnode_split");
  TCase *g = tcase_create("gpu");
  tcase_set_tags(g, "gpu");
  tcase_set_timeout(g, 120);
  tcase_add_test(g, on_the_gpu_split_calls_across_daemons_never_overwrite_a_slow_receiver);
  suite_add_tcase(s, g);
  return s;
}
