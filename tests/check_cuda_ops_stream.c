/*
 * check_cuda_ops_stream.c — suite cuda_ops's stream case (check_cuda_ops.c
 * makes the suite and adds it): a cuda daemon with stream_chunk_rows set
 * lends slabs whose blocks are channels of 4 chunks (slab.h "Streaming"),
 * and the throughput dispatch and combine run through them
 * (kernels/ops_stream.cuh).  Every throughput op (plain, FP8, cached,
 * num_worst_tokens, weighted combine) against the oracle with chunks of 1
 * and 3 rows and of 16 (a channel of 64 rows, below the shapes' 128-512
 * tokens), worlds 2, 4 and 8, rows of all -1, all to one rank and 0 tokens;
 * rows that lap their channels many times over several calls (the chunks
 * taken in any order, credited in order); a receiver that comes late to every call (its senders wait for its
 * credit and overwrite nothing); a rank whose process ends while its peer
 * streams to it (DEP_ERR_PEER through the daemon's abort words, never a
 * hang).  Its stream_budget case streams on a budget below the world
 * ($DEEPEP_KERNEL_CTAS: each CTA sends to several ranks in turn).  A job across daemons that stream is suite xnode_stream's
 * (check_xnode_stream.c); the stream_lend case, which needs no GPU, checks
 * the layout such a job is lent.  Tagged "gpu" and run as
 * check_cuda_ops.c says: each test skips, saying why, unless
 * DEP_TEST_BACKEND=cuda and a GPU is present.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check_cuda_ops.h"
#include "cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "deepep.h"
#include "opsworld.h"
#include "slab.h"
#include "sm_budget.h"

/* The chunks every case streams in: one row, three, and sixteen. */
static const uint32_t chunks[] = {1, 3, 16};
#define N_CHUNKS (sizeof chunks / sizeof chunks[0])

/* The daemon's configuration for chunks of `chunk` rows, in yaml[len]; its slabs checked to be
 * channels (so that no case passes on whole blocks). */
static void stream_yaml(const struct ow_case *d, uint32_t chunk, char *yaml, size_t len) {
  struct dep_slab_layout l;
  char why[256] = "";
  ck_assert_msg(dep__slab_layout_nodes(&d->shape, d->sc.world, d->sc.world, chunk, &l, why,
                                       sizeof why) == 0, "%s", why);
  ck_assert_msg(l.chan_rows < l.max_tokens, "test set-up: chunks of %u rows make whole blocks "
                "of %u rows [%s]", chunk, l.max_tokens, d->desc);
  snprintf(yaml, len, "stream_chunk_rows: %u\n", chunk);
}

static const struct ow_scenario scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {2, 2048, 2, 8, 128, 64, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {2, 128, 4, 4, 128, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 0}, /* every row to one rank */
  {4, 7168, 8, 32, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 1},
  {4, 128, 8, 16, 128, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0},    /* every id -1 */
  {4, 128, 1, 4, 512, 64, P_ONE_EXPERT, T_MAX, DEP_INDEX_I64, 0},
  {8, 2048, 8, 64, 128, 32, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1},
  {8, 128, 2, 8, 128, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 0},  /* no tokens */
  {8, 128, 16, 128, 128, 16, P_DUP, T_MAX, DEP_INDEX_I64, 1},
};
#define N_SCENARIOS (sizeof scenarios / sizeof scenarios[0])

/* Every scenario in every chunk: layout, dispatch and combine (and the low-latency calls, which
 * share the blocks) as the oracle says, twice, bit for bit; on the old daemon the attach was
 * refused (DEP_ERR_UNSUPPORTED: only the host backend streamed). */
static void stream_case(const struct ow_scenario *sc, uint32_t chunk, int salt,
                        const char *what) {
  ow_seed_init((uint64_t)salt);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, sc, sc->fp8);
  char yaml[64], job[32];
  stream_yaml(d, chunk, yaml, sizeof yaml);
  struct cr_world w;
  cr_world_start(&w, yaml);
  struct cr_rounds a = {d, 1, 2};
  snprintf(job, sizeof job, "stream-%d", salt);
  const uint64_t t0 = cr_ms_now();
  cr_run_procs(&w, job, &d->shape, sc->world, cr_body_rounds, &a, d->desc);
  printf("cuda_ops stream: chunks of %u rows%s: %s: ok in %llu ms\n", chunk, what, d->desc,
         (unsigned long long)(cr_ms_now() - t0));
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}

START_TEST(every_op_streams_through_channels_as_the_oracle_says) {
  CR_NEEDS_GPU();
  stream_case(&scenarios[(uint32_t)_i % N_SCENARIOS], chunks[(uint32_t)_i / N_SCENARIOS],
              4000 + _i, "");
}
END_TEST

static const struct ow_scenario ext_scenarios[] = {
  /* world hidden topk experts max_tokens max_ll  routing  tokens  index  fp8 */
  {2, 2048, 8, 16, 128, 64, P_DUP, T_MIXED, DEP_INDEX_I32, 0},
  {4, 128, 4, 16, 128, 32, P_RANDOM, T_MIXED, DEP_INDEX_I64, 0},
  {8, 7168, 8, 64, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0},
  {8, 128, 2, 8, 128, 16, P_ONE_RANK, T_ZERO, DEP_INDEX_I64, 0},
};
#define N_EXT (sizeof ext_scenarios / sizeof ext_scenarios[0])

/* FP8 dispatch, num_worst_tokens, expert_alignment, cached mode and a weighted combine through
 * the channels: each as the oracle says, bit for bit (check_cuda_ops.c ext_gpu_body). */
static void stream_ext_case(const struct ow_scenario *sc, uint32_t chunk, int salt,
                            const char *what) {
  ow_seed_init((uint64_t)salt);
  struct ext_gpu *e = malloc(sizeof *e);
  ck_assert_ptr_nonnull(e);
  ext_gpu_make(e, sc);
  char yaml[64], job[32];
  stream_yaml(&e->d, chunk, yaml, sizeof yaml);
  struct cr_world w;
  cr_world_start(&w, yaml);
  snprintf(job, sizeof job, "stream-ext-%d", salt);
  cr_run_procs(&w, job, &e->d.shape, e->d.sc.world, ext_gpu_body, e, e->d.desc);
  printf("cuda_ops stream: extensions, chunks of %u rows%s: %s: ok\n", chunk, what, e->d.desc);
  cr_world_stop(&w);
  ext_gpu_free(e);
  free(e);
}

START_TEST(throughput_extensions_stream_as_the_oracle_says) {
  CR_NEEDS_GPU();
  stream_ext_case(&ext_scenarios[(uint32_t)_i % N_EXT], chunks[(uint32_t)_i / N_EXT], 4200 + _i,
                  "");
}
END_TEST

/*
 * A budget below the world ($DEEPEP_KERNEL_CTAS, kabi.h "SM budget"): each
 * CTA's sending warps send to several ranks in turn, each stream to its
 * end, while its receiving warps take what every rank streams here (a
 * world of 8 on 2 CTAs: 4 destinations a CTA; on 1: all 8).  As the
 * oracle says, bit for bit; a unit that held its CTA's next one back on a
 * receiver that waits for that next one would hang to the op timeout.
 */
static const struct {
  bool ext; /* ext_scenarios[sc] (the throughput extensions), else scenarios[sc] */
  uint32_t sc, chunk;
  const char *ctas;
} budgets[] = {
  {false, 2, 3, "2"},  /* world 4, hidden 7168, FP8 */
  {false, 4, 3, "1"},  /* world 4, 512 tokens to one expert: one CTA laps every channel */
  {false, 5, 1, "2"},  /* world 8, chunks of one row */
  {false, 7, 16, "1"}, /* world 8, duplicate ids, one CTA */
  {false, 6, 3, "2"},  /* world 8, no tokens */
  {true, 1, 3, "2"},   /* world 4, the extensions (cached: no grid barrier) */
  {true, 2, 1, "1"},   /* world 8, hidden 7168, the extensions on one CTA */
};
#define N_BUDGETS (sizeof budgets / sizeof budgets[0])

START_TEST(streams_on_a_budget_below_the_world_as_the_oracle_says) {
  CR_NEEDS_GPU();
  char what[48];
  snprintf(what, sizeof what, ", " CUOPS_CTAS_ENV "=%s", budgets[_i].ctas);
  setenv(CUOPS_CTAS_ENV, budgets[_i].ctas, 1); /* the rank processes inherit it */
  if (budgets[_i].ext)
    stream_ext_case(&ext_scenarios[budgets[_i].sc], budgets[_i].chunk, 4600 + _i, what);
  else
    stream_case(&scenarios[budgets[_i].sc], budgets[_i].chunk, 4500 + _i, what);
  unsetenv(CUOPS_CTAS_ENV);
}
END_TEST

/*
 * Every pair of 8 ranks streams some 340 rows a call (512 tokens, top-8 of 64 experts) through
 * its channel: some 85 laps of a 4-row channel in chunks of 1 row, 5 of a 64-row one in chunks
 * of 16; four rounds, so each call's channels run four times.  The receivers take rows in any order
 * and credit the chunks in order without waiting (ops_stream.cuh chunk_taken): a chunk
 * credited before its rows were read would let its sender overwrite them (a wrong output or a
 * row's wait timing out), one never credited would hold its sender until the op timeout, and
 * counts left from a call would do either in the next.
 */
START_TEST(rows_that_lap_their_channels_many_times_arrive_as_the_oracle_says) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {8, 128, 8, 64, 512, 16, P_RANDOM, T_MAX, DEP_INDEX_I32,
                                        0};
  static const uint32_t laps_chunks[] = {1, 16};
  const uint32_t chunk = laps_chunks[_i];
  ow_seed_init(4600 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &sc, 0);
  char yaml[64], job[32];
  stream_yaml(d, chunk, yaml, sizeof yaml);
  struct cr_world w;
  cr_world_start(&w, yaml);
  struct cr_rounds a = {d, 1, 4};
  snprintf(job, sizeof job, "stream-laps-%d", _i);
  const uint64_t t0 = cr_ms_now();
  cr_run_procs(&w, job, &d->shape, sc.world, cr_body_rounds, &a, d->desc);
  printf("cuda_ops stream: many laps, chunks of %u rows: %s: ok in %llu ms\n", chunk, d->desc,
         (unsigned long long)(cr_ms_now() - t0));
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/* A receiver that comes late: every sender waits for its credit, overwrites nothing it has not
 * taken, and every output is the oracle's. */
START_TEST(a_late_receiver_holds_its_senders_back_and_loses_nothing) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {4, 2048, 4, 8, 128, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  ow_seed_init(4300);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &sc, 0);
  char yaml[64];
  stream_yaml(d, 1, yaml, sizeof yaml);
  struct cr_world w;
  cr_world_start(&w, yaml);
  struct cr_late late = {d, 1}; /* rank 1 comes late; its peers wait for its credit */
  cr_run_procs(&w, "stream-late", &d->shape, sc.world, cr_body_late, &late, d->desc);
  cr_world_stop(&w);
  ow_case_free(d);
  free(d);
}
END_TEST

/* Shared with the rank processes: when rank 1 exited (cr_ms_now). */
static uint64_t *exit_at;

START_TEST(a_rank_whose_process_ends_mid_stream_fails_its_peer_through_the_daemon) {
  CR_NEEDS_GPU();
  /* Every token to rank 1: 128 rows for its 4-row channel. */
  static const struct ow_scenario sc = {2, 128, 2, 4, 128, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64,
                                        0};
  ow_seed_init(4400);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &sc, 0);
  exit_at = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert(exit_at != MAP_FAILED);
  *exit_at = 0;
  char yaml[64];
  stream_yaml(d, 1, yaml, sizeof yaml);
  struct cr_world w;
  cr_world_start(&w, yaml); /* the default 10 s op timeout */
  /* DEP_ERR_PEER naming rank 1's end within 5 s, far below the 10 s op timeout. */
  struct cr_peer_dies pd = {d, exit_at, 5000, {"rank 1 (pid ", "its process ended"},
                            "cuda_ops stream: a peer's process ended mid-stream"};
  cr_run_procs(&w, "stream-dying", &d->shape, 2, cr_body_peer_dies, &pd,
               "a peer that ends mid-stream");
  cr_world_stop(&w);
  munmap(exit_at, 4096);
  ow_case_free(d);
  free(d);
}
END_TEST

/*
 * The layout a cuda job that streams is lent and bound, on one node and
 * across nodes (no GPU needed): the library binds every one
 * (cuops_block_layout), and across nodes the pinned host memory of each
 * rank's ring and exchange region (what lend_check charges and deepepctl
 * size prints) holds the channels, not whole blocks: less than the same
 * job's without streaming.  The old library refused the layouts across
 * nodes (DEP_ERR_UNSUPPORTED, "within a node only"), and the old cuda
 * daemon refused to lend them, so such a job ran only with whole blocks.
 */
START_TEST(a_cuda_job_that_streams_across_nodes_is_bound_with_its_channels_pinned) {
  const struct dep_job_shape sh = {.max_tokens_per_rank = 4096, .hidden = 7168,
                                   .num_experts = 256, .topk = 8, .dtype = DEP_DTYPE_BF16};
  static const struct {
    uint32_t world, local, chunk;
  } cases[] = {
      {8, 8, 16}, {16, 8, 16}, {16, 8, 1}, {256, 8, 16}, {16, 8, 0}, {16, 8, 1024}, /* whole */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct dep_slab_layout l, whole;
    struct dep_slab_priv b;
    char why[512] = "";
    ck_assert_int_eq(dep__slab_layout_nodes(&sh, cases[i].world, cases[i].local, cases[i].chunk,
                                            &l, why, sizeof why), 0);
    ck_assert_int_eq(dep__slab_layout_nodes(&sh, cases[i].world, cases[i].local, 0, &whole, why,
                                            sizeof why), 0);
    const int rc = cuops_block_layout(&sh, cases[i].world, &l, 132, &b, why, sizeof why);
    ck_assert_msg(rc == 0, "world %u, %u here, chunks of %u: %s (%s)", cases[i].world,
                  cases[i].local, cases[i].chunk, dep_errname(rc), why);
    if (l.chan_rows < l.max_tokens && l.n_remote > 0)
      ck_assert_msg(l.xchg_bytes < whole.xchg_bytes,
                    "world %u, %u here, chunks of %u: %llu bytes of exchange region, whole "
                    "blocks %llu", cases[i].world, cases[i].local, cases[i].chunk,
                    (unsigned long long)l.xchg_bytes, (unsigned long long)whole.xchg_bytes);
  }
}
END_TEST

TCase *cuda_ops_stream_lend_tcase(void) {
  TCase *t = tcase_create("stream_lend");
  tcase_add_test(t, a_cuda_job_that_streams_across_nodes_is_bound_with_its_channels_pinned);
  return t;
}

TCase *cuda_ops_stream_tcase(void) {
  TCase *t = tcase_create("stream");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 240);
  tcase_add_loop_test(t, every_op_streams_through_channels_as_the_oracle_says, 0,
                      (int)(N_SCENARIOS * N_CHUNKS));
  tcase_add_loop_test(t, throughput_extensions_stream_as_the_oracle_says, 0,
                      (int)(N_EXT * N_CHUNKS));
  tcase_add_loop_test(t, rows_that_lap_their_channels_many_times_arrive_as_the_oracle_says, 0, 2);
  tcase_add_test(t, a_late_receiver_holds_its_senders_back_and_loses_nothing);
  tcase_add_test(t, a_rank_whose_process_ends_mid_stream_fails_its_peer_through_the_daemon);
  return t;
}

/* Its own case, so that a GPU pass can run it alone (CK_RUN_CASE=stream_budget). */
TCase *cuda_ops_stream_budget_tcase(void) {
  TCase *t = tcase_create("stream_budget");
  tcase_set_tags(t, "gpu");
  tcase_set_timeout(t, 240);
  tcase_add_loop_test(t, streams_on_a_budget_below_the_world_as_the_oracle_says, 0,
                      (int)N_BUDGETS);
  return t;
}
