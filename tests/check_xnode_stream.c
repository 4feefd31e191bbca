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
 * daemon streams to it; a dispatch row that crosses once per destination
 * node (the node channels, kernels/ops_node.cuh), counted by the daemons.  Tagged gpu (make check-gpu); the old library and
 * cuda daemon refused such a job at attach ("within a node only").
 */
#include <check.h>
#include <stdatomic.h>
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
#include "daemonwire.h"
#include "testutil.h"
#include "xnbytes.h"
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

/*
 * One crossing per destination node (xring.h) on the cuda backend: every
 * rank makes one fresh dispatch (its outputs the oracle's), waits for the
 * others, and rank 0 reads what each daemon's proxy sent of the job's rows
 * while the others hold the job (its counters go with it).  Shared with
 * the rank processes.
 */
struct xs_once_sh {
  _Atomic uint32_t done, read;
  uint64_t got[NODES_MAX];
  char why[512];
};
struct xs_once {
  const struct ow_case *d;
  const struct nodes *ns;
  const char *job;
  struct xs_once_sh *sh;
};

/* Wait, at most a ceiling far above a loaded machine's time, until *w is at least n. */
static int xs_await(struct rk *k, _Atomic uint32_t *w, uint32_t n, const char *what) {
  for (int waited = 0; atomic_load(w) < n; waited += 5) {
    if (waited > 120000)
      return ow_fail(k->msg, "rank %u: %s did not come within 120 s", k->rank, what);
    dw_sleep_ms(5);
  }
  return 0;
}

static int body_once(struct rk *k, void *arg) {
  const struct xs_once *o = arg;
  const struct ow_case *d = o->d;
  const uint32_t r = k->rank, h = k->h_;
  if (cr_upload(k, d))
    return 1;
  uint32_t nrecv = 0xdeadbeef;
  struct dep_dispatch_args da = {.size = sizeof(struct dep_dispatch_args), .x = CR_DEV(k, B_X),
                                 .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                 .topk_weights = CR_DEV(k, B_W), .num_tokens = d->in[r].num_tokens,
                                 .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX),
                                 .recv_topk_weights = CR_DEV(k, B_RW),
                                 .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &nrecv};
  CALL(k, dep_dispatch(k->c, &da, k->h, k->s), "dep_dispatch");
  if (nrecv != d->disp[r].num_recv || cr_get(k, B_RX) ||
      memcmp(k->host, d->disp[r].x, (size_t)nrecv * h * 2) != 0)
    return ow_fail(k->msg, "rank %u: dispatch: %u rows, the oracle's %u, or their bytes differ "
                   "[%s]", r, nrecv, d->disp[r].num_recv, d->desc);
  atomic_fetch_add(&o->sh->done, 1);
  if (xs_await(k, &o->sh->done, d->sc.world, "every rank's dispatch"))
    return 1;
  if (r == 0) {
    for (int i = 0; i < o->ns->n; i++)
      o->sh->got[i] = xn_payload_out(o->ns, i, o->job, o->sh->why, sizeof o->sh->why);
    atomic_store(&o->sh->read, 1);
  }
  return xs_await(k, &o->sh->read, 1, "rank 0's reading of the daemons' counts");
}

static const struct xn_layout once_layouts[] = {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8;  nodes, split */
  {{4, 256, 8, 16, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0}, 2, {2, 2}},
  {{6, 256, 8, 24, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0}, 3, {2, 2, 2}},
};
#define N_ONCE (sizeof once_layouts / sizeof once_layouts[0])

/*
 * A dispatch row of a cuda rank crosses the network once to each node
 * holding a rank one of its experts is on: the bytes of rows each
 * daemon's proxy sent for one dispatch (payload_out) are the layout's
 * count of them to the byte, in chunks of 3 and of 16 rows.  The old
 * kernels sent a row once per destination rank, through a channel per
 * rank, whatever the ring's fan table said: those bytes (the test checks
 * its tokens make more of them) are what it got.
 */
START_TEST(on_the_gpu_a_dispatch_row_crosses_once_per_destination_node) {
  CR_NEEDS_GPU();
  static const uint32_t once_chunks[] = {3, 16};
  const struct xn_layout *L = &once_layouts[(uint32_t)_i % N_ONCE];
  const uint32_t chunk = once_chunks[(uint32_t)_i / N_ONCE];
  ow_seed_init(5300 + (uint64_t)_i);
  struct ow_case *d = xn_case_new(&L->sc, 0);
  struct xn_place p;
  memset(&p, 0, sizeof p);
  xn_place(&p, L->split, L->nodes);
  uint64_t rows[NODES_MAX], per_rank[NODES_MAX];
  xn_cross_rows(d, &p, L->nodes, rows, per_rank);
  for (int i = 0; i < L->nodes; i++)
    ck_assert_msg(per_rank[i] > rows[i], "a test whose tokens go to one rank of a node at most "
                  "shows nothing (seed %llu)", (unsigned long long)ow_seed);
  struct dep_slab_layout lay;
  char why[256] = "";
  ck_assert_msg(dep__slab_layout_nodes(&d->shape, L->sc.world, L->split[0], chunk, &lay, why,
                                       sizeof why) == 0, "%s", why);
  struct xs_once_sh *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(sh != MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  struct nodes ns;
  xs_nodes_start(&ns, L->nodes, L->split, d, chunk);
  char job[32];
  snprintf(job, sizeof job, "xstream-once-%d", _i);
  struct xs_once o = {d, &ns, job, sh};
  static char fails[OW_FAILS_LEN];
  const int nfail = xg_run(&ns, L->split, job, d, body_once, &o, false, fails, sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  nodes_stop(&ns);
  for (int i = 0; i < L->nodes; i++) {
    ck_assert_msg(sh->got[i] != UINT64_MAX, "%s", sh->why);
    ck_assert_msg(sh->got[i] == rows[i] * lay.row_bytes, "node %d sent %llu bytes of rows for "
                  "one dispatch in chunks of %u rows [%s]: %llu rows of %llu bytes, once per "
                  "destination node, are %llu; once per destination rank, %llu", i,
                  (unsigned long long)sh->got[i], chunk, d->desc, (unsigned long long)rows[i],
                  (unsigned long long)lay.row_bytes,
                  (unsigned long long)(rows[i] * lay.row_bytes),
                  (unsigned long long)(per_rank[i] * lay.row_bytes));
    printf("xnode_stream gpu: one dispatch (%s, chunks of %u rows): node %d sent %llu row "
           "bytes, %llu once per rank\n", d->desc, chunk, i, (unsigned long long)sh->got[i],
           (unsigned long long)(per_rank[i] * lay.row_bytes));
  }
  munmap(sh, sizeof *sh);
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
  tcase_add_loop_test(g, on_the_gpu_a_dispatch_row_crosses_once_per_destination_node, 0,
                      (int)(N_ONCE * 2));
  tcase_add_test(g, on_the_gpu_a_late_receiver_on_another_daemon_loses_nothing);
  tcase_add_test(g, on_the_gpu_a_rank_that_ends_mid_stream_fails_its_peer_on_another_daemon);
  suite_add_tcase(s, g);
  return s;
}
