/*
 * check_xnode_stream.c — a cuda job that streams (stream_chunk_rows, slab.h
 * "Streaming") across daemons: cuda daemons sharing this machine's GPU
 * (check_xnode.c's harness: nodes.h, xngpu.h), the throughput calls'
 * rows to and from ranks of other daemons going chunk by chunk through the
 * exchange regions' channels (kernels/ops_stream.cuh, the host backend's
 * protocol: CHUNK, SLOT and CREDIT descriptors, xring.h).  Every
 * throughput op against the oracle over 1 + 1, 2 + 2 and 1 + 1 + 1 ranks
 * in chunks of 1, 3 and 16 rows; a receiver on another daemon that comes
 * late to every call; a rank whose process ends while a rank of another
 * daemon streams to it.  Tagged gpu (make check-gpu); the old library and
 * cuda daemon refused such a job at attach ("within a node only").
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check_cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "slab.h"
#include "testutil.h"
#include "xngpu.h"
#include "xnjob.h"

/* The chunks every case streams in: one row, three, and sixteen. */
static const uint32_t chunks[] = {1, 3, 16};
#define N_CHUNKS (sizeof chunks / sizeof chunks[0])

/*
 * n daemons sharing the GPU whose jobs stream in chunks of `chunk` rows,
 * started; the layout of a job of case d placed by split on them checked
 * to have channels to every node (so that no case passes on whole blocks).
 */
static void xs_nodes_start(struct nodes *ns, int n, const uint32_t *split,
                           const struct ow_case *d, uint32_t chunk) {
  for (int i = 0; i < n; i++) {
    struct dep_slab_layout l;
    char why[256] = "";
    ck_assert_msg(dep__slab_layout_nodes(&d->shape, d->sc.world, split[i], chunk, &l, why,
                                         sizeof why) == 0, "%s", why);
    ck_assert_msg(l.chan_rows < l.max_tokens && l.n_remote > 0,
                  "test set-up: chunks of %u rows make whole blocks of %u rows, or no remote "
                  "rank [%s]", chunk, l.max_tokens, d->desc);
  }
  char yaml[64];
  snprintf(yaml, sizeof yaml, "stream_chunk_rows: %u\n", chunk);
  nodes_config_with(ns, n, 60000, ", op_timeout_ms: 30000", yaml);
  nodes_start_all(ns);
}

static const struct xn_layout stream_layouts[] = {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8;  nodes, split */
  {{2, 2048, 8, 8, 128, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0}, 2, {1, 1}},
  {{4, 128, 8, 16, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0}, 2, {2, 2}},
  {{3, 128, 4, 12, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0}, 3, {1, 1, 1}},
};
#define N_LAYOUTS (sizeof stream_layouts / sizeof stream_layouts[0])

/* Every rank: layout, dispatch, combine and the low-latency calls (twice, under two poisons,
 * cr_body_rounds), then FP8 dispatch, num_worst_tokens, expert_alignment, cached mode and a
 * weighted combine (ext_gpu_body), each as the oracle says, bit for bit. */
struct xs_ops {
  struct ext_gpu *e;
  struct cr_rounds r;
};
static int body_every_op(struct rk *k, void *arg) {
  struct xs_ops *o = arg;
  return cr_body_rounds(k, &o->r) || ext_gpu_body(k, o->e);
}

/*
 * Every throughput op of a job that streams across daemons, in every
 * chunk: each chunk of a channel to a rank of another daemon goes to the
 * proxy as a CHUNK descriptor when its last row is written (many warps
 * write one chunk), the far daemon counts its rows into the receiver's in
 * mark, and the receiver's credit comes back as a CREDIT descriptor.  A
 * chunk pushed before its rows were all written, a mark read from the
 * chunk before it in the same place, or a credit lost would give a wrong
 * output or hold a call to the op timeout.  The old library refused the
 * attach (DEP_ERR_UNSUPPORTED, "within a node only").
 */
START_TEST(on_the_gpu_every_throughput_op_streams_across_daemons_as_the_oracle_says) {
  CR_NEEDS_GPU();
  const struct xn_layout *L = &stream_layouts[(uint32_t)_i % N_LAYOUTS];
  const uint32_t chunk = chunks[(uint32_t)_i / N_LAYOUTS];
  ow_seed_init(5000 + (uint64_t)_i);
  struct ext_gpu *e = malloc(sizeof *e);
  ck_assert_ptr_nonnull(e);
  ext_gpu_make(e, &L->sc);
  struct xs_ops o = {e, {&e->d, 1, 2}};
  struct nodes ns;
  xs_nodes_start(&ns, L->nodes, L->split, &e->d, chunk);
  char job[32];
  snprintf(job, sizeof job, "xstream-%d", _i);
  const uint64_t t0 = cr_ms_now();
  static char fails[OW_FAILS_LEN];
  const int nfail = xg_run(&ns, L->split, job, &e->d, body_every_op, &o, false, fails,
                           sizeof fails);
  OW_ASSERT_NONE_FAILED(e->d.desc, nfail, fails);
  printf("xnode_stream gpu: chunks of %u rows, %s over %d daemons: as the oracle says, in %llu "
         "ms\n", chunk, e->d.desc, L->nodes, (unsigned long long)(cr_ms_now() - t0));
  nodes_stop(&ns);
  ext_gpu_free(e);
  free(e);
}
END_TEST

/* A receiver on another daemon that comes late, in chunks of one row: every sender waits for
 * its credit, overwrites nothing it has not taken (a row overwritten differs from the
 * oracle), and every output is the oracle's. */
START_TEST(on_the_gpu_a_late_receiver_on_another_daemon_loses_nothing) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {4, 2048, 4, 8, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  static const uint32_t split[NODES_MAX] = {2, 2};
  ow_seed_init(5100);
  struct ow_case *d = xn_case_new(&sc, 0);
  struct nodes ns;
  xs_nodes_start(&ns, 2, split, d, 1);
  static char fails[OW_FAILS_LEN];
  /* Rank 2 (node 1) comes late: node 0's senders fill its channels and wait for its credit,
   * which comes back through both daemons. */
  struct cr_late late = {d, 2};
  const int nfail = xg_run(&ns, split, "xstream-late", d, cr_body_late, &late, false, fails,
                           sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

/* Shared with the rank processes: when rank 1 exited (cr_ms_now). */
static uint64_t *exit_at;

START_TEST(on_the_gpu_a_rank_that_ends_mid_stream_fails_its_peer_on_another_daemon) {
  CR_NEEDS_GPU();
  /* Every token to rank 1: 128 rows for its 4-row channel. */
  static const struct ow_scenario sc = {2, 128, 2, 4, 128, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64,
                                        0};
  static const uint32_t split[NODES_MAX] = {1, 1};
  ow_seed_init(5200);
  struct ow_case *d = xn_case_new(&sc, 0);
  exit_at = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(exit_at != MAP_FAILED);
  *exit_at = 0;
  struct nodes ns;
  xs_nodes_start(&ns, 2, split, d, 1);
  static char fails[OW_FAILS_LEN];
  /* DEP_ERR_PEER naming rank 1 within 10 s, far below the 30 s op timeout. */
  struct cr_peer_dies pd = {d, exit_at, 10000, {"rank 1", NULL},
                            "xnode_stream gpu: a peer on another daemon ended mid-stream"};
  const int nfail = xg_run(&ns, split, "xstream-dying", d, cr_body_peer_dies, &pd, false, fails,
                           sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  nodes_stop(&ns);
  munmap(exit_at, 4096);
  xn_case_free(d);
}
END_TEST

Suite *xnode_stream_suite(void);
Suite *xnode_stream_suite(void) {
  Suite *s = suite_create("xnode_stream");
  TCase *g = tcase_create("gpu");
  tcase_set_tags(g, "gpu");
  tcase_set_timeout(g, 240);
  tcase_add_loop_test(g, on_the_gpu_every_throughput_op_streams_across_daemons_as_the_oracle_says,
                      0, (int)(N_LAYOUTS * N_CHUNKS));
  tcase_add_test(g, on_the_gpu_a_late_receiver_on_another_daemon_loses_nothing);
  tcase_add_test(g, on_the_gpu_a_rank_that_ends_mid_stream_fails_its_peer_on_another_daemon);
  suite_add_tcase(s, g);
  return s;
}
