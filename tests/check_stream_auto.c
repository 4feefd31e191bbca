/*
 * check_stream_auto.c — stream_chunk_rows: auto, the default (config.h,
 * daemon/lend.c lend_check), on real host daemons: a job whose whole blocks
 * do not fit its device's pool streams in the largest chunk that does,
 * which dep_status (deepepctl status's CHUNK) and the daemon's log say,
 * lent the layout of that chunk (dep__slab_layout_nodes) and right against
 * the oracle in every op, on one node and over two; a job that fits runs
 * whole blocks as with 0; stream_chunk_rows: 0 still refuses the big one
 * naming the chunk; and nodes whose pools make auto choose differently
 * fail the job at attach saying what each chose and what to set; a job
 * across nodes on the host backend streams in 64-row chunks even where its
 * whole blocks fit; and a device's check weighs the ranks an even spread over
 * the daemon's devices puts there (lend_ranks_here).
 */
#include <check.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "lend.h"
#include "nodes.h"
#include "opsworld.h"
#include "slab.h"
#include "testutil.h"
#include "xnjob.h"
#include "xring.h"

/* A ceiling for a job's ranks on a loaded 2-core machine, not a timing. */
#define SA_OP_TIMEOUT_MS 20000
#define SA_MIB (1024ull * 1024ull)

/* A pool of n MiB on either backend (the host's is pool.host_size). */
#define SA_POOL(n) "pool:\n  host_size: " #n "MiB\n  size_per_device: " #n "MiB\n  chunk_size: 2MiB\n"

/*
 * World 4, 256 tokens a rank of hidden 256, top-4 of 8 experts (deepepctl size --world 4
 * --tokens 256 --hidden 256 --experts 8 --topk 4 --ll-tokens 8 --chunk-rows N): whole
 * blocks 1.16 MiB a rank on one node (2.3 MiB with the exchange region at 2 a node), chunks
 * of 32 rows 0.61 (1.21), of 16 rows 0.34 (0.66).  A pool of 2 MiB holds 4 ranks, or 2 and
 * their exchange regions, in chunks of 16 rows and not of 32.
 */
static const struct ow_scenario SA_BIG = {4, 256, 4, 8, 256, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
#define SA_BIG_CHUNK 16u
/* The same world of 32 tokens a rank: whole blocks of 0.2 MiB a rank fit 2 MiB. */
static const struct ow_scenario SA_SMALL = {4, 256, 4, 8, 32, 8, P_RANDOM, T_MAX, DEP_INDEX_I32,
                                            0};

/* The same world of 512 tokens a rank: blocks of more than 4 chunks of
 * LEND_AUTO_XNODE_HOST_ROWS, whole blocks well within a pool of 16 MiB on one node or two. */
static const struct ow_scenario SA_LONG = {4, 256, 4, 8, 512, 8, P_RANDOM, T_MAX, DEP_INDEX_I32,
                                           0};

/* What a rank's own daemon said of its job while it ran (shared with the rank processes). */
struct sa_seen {
  uint32_t jobs, chunk_rows;
  uint64_t slab_bytes, host_bytes;
};

/* A rank's run: its daemon's dep_status of the job (the only one), then rounds of every op
 * against the oracle (xn_round, xn_round_modes), FP8 low-latency dispatch in odd ones. */
static int sa_body(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                   struct xn_result *res) {
  struct sa_seen *seen = (struct sa_seen *)run->arg + rank;
  struct dep_status *st = NULL;
  int rc = dep_status(c, &st);
  if (rc != 0) {
    snprintf(res->msg, sizeof res->msg, "dep_status: %s", dep_errmsg(c));
    return rc;
  }
  seen->jobs = st->num_jobs;
  if (st->num_jobs > 0)
    *seen = (struct sa_seen){st->num_jobs, st->jobs[0].chunk_rows, st->jobs[0].slab_bytes,
                             st->jobs[0].host_bytes};
  dep_status_free(st);
  struct ow_outs o;
  ow_outs_alloc(&o, run->d);
  for (uint32_t i = 0; i < run->rounds && rc == 0; i++) {
    rc = xn_round(c, run->d, rank, (int)(i & 1), &o, res);
    if (rc == 0)
      rc = xn_round_modes(c, run->d, rank, &o, res);
    if (rc == 0)
      atomic_fetch_add(&res->rounds, 1);
  }
  ow_outs_free(&o);
  return rc;
}

/* The layout of d's job with lws ranks a node in chunks of `chunk` rows. */
static struct dep_slab_layout sa_layout(const struct ow_case *d, uint32_t lws, uint32_t chunk) {
  struct dep_slab_layout l;
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&d->shape, d->sc.world, lws, chunk, &l, why, sizeof why) ==
                    0, "%s", why);
  return l;
}

/* A rank's bytes with lws ranks a node (its slab, and across nodes its ring and region). */
static uint64_t sa_rank_bytes(const struct ow_case *d, uint32_t lws, uint32_t chunk) {
  const struct dep_slab_layout l = sa_layout(d, lws, chunk);
  return l.total_bytes + (lws < d->sc.world ? DEP_XRING_BYTES + l.xchg_bytes : 0);
}

/* Every rank saw its job lent the layout of `chunk` (0: whole blocks) with lws ranks a node:
 * the slab (its stride rounds it up by less than 64 KiB) and the ring and exchange region. */
static void sa_assert_lent(const struct sa_seen *seen, const struct ow_case *d, uint32_t lws,
                           uint32_t chunk) {
  const struct dep_slab_layout l = sa_layout(d, lws, chunk);
  const uint64_t host = lws < d->sc.world ? DEP_XRING_BYTES + l.xchg_bytes : 0;
  for (uint32_t g = 0; g < d->sc.world; g++) {
    ck_assert_msg(seen[g].jobs == 1 && seen[g].chunk_rows == chunk,
                  "rank %u: its daemon says %u job(s) of chunk %u, want chunks of %u", g,
                  seen[g].jobs, seen[g].chunk_rows, chunk);
    ck_assert_msg(seen[g].slab_bytes >= l.total_bytes &&
                      seen[g].slab_bytes < l.total_bytes + 65536 && seen[g].host_bytes == host,
                  "rank %u: lent a slab of %llu and %llu of host, the layout's %llu and %llu", g,
                  (unsigned long long)seen[g].slab_bytes, (unsigned long long)seen[g].host_bytes,
                  (unsigned long long)l.total_bytes, (unsigned long long)host);
  }
}

/* Run case d as job with its world spread evenly over the first `nodes` daemons of ns, two
 * rounds a rank; every rank's daemon must have lent it the layout of `chunk` (sa_assert_lent). */
static void sa_run(const struct nodes *ns, uint32_t nodes, const char *job,
                   const struct ow_case *d, uint32_t chunk) {
  const uint32_t n = d->sc.world;
  struct sa_seen *seen = mmap(NULL, n * sizeof *seen, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(seen, MAP_FAILED);
  memset(seen, 0, n * sizeof *seen);
  struct xn_place p;
  memset(&p, 0, sizeof p);
  uint32_t per[NODES_MAX] = {0};
  for (uint32_t i = 0; i < nodes; i++)
    per[i] = n / nodes;
  xn_place(&p, per, nodes);
  struct xn_run run = {.d = d, .rounds = 2, .body = sa_body, .arg = seen};
  struct xn_result *res = xn_results(n);
  xn_run_job(ns, &p, job, &run, res);
  for (uint32_t g = 0; g < n; g++)
    ck_assert_uint_eq(atomic_load(&res[g].rounds), 2);
  munmap(res, n * sizeof *res);
  sa_assert_lent(seen, d, n / nodes, chunk);
  munmap(seen, n * sizeof *seen);
}

/* The shape's margins the tests rest on: with lws ranks a node in a pool of pool_mib, whole
 * blocks and chunks of twice SA_BIG_CHUNK do not fit, SA_BIG_CHUNK's do, with room. */
static void sa_assert_margins(const struct ow_case *d, uint32_t lws, uint64_t pool_mib) {
  const uint64_t pool = pool_mib * SA_MIB;
  ck_assert_uint_gt(lws * sa_rank_bytes(d, lws, 0), pool);
  ck_assert_uint_gt(lws * sa_rank_bytes(d, lws, 2 * SA_BIG_CHUNK), pool);
  ck_assert_uint_lt(lws * sa_rank_bytes(d, lws, SA_BIG_CHUNK) + SA_MIB / 4, pool);
}

/*
 * (a) A daemon of the default configuration whose pool is too small for a job's whole
 * blocks runs it streamed in the largest chunk that fits: dep_status shows the chunk and the
 * layout's bytes of that chunk, every op of two rounds is the oracle's, and the log says why.
 * (c) A job that fits, on the same daemon, runs whole blocks (chunk 0).  On the old code the
 * big job was refused with DEP_ERR_NO_MEMORY (the default was 0) and status had no chunk.
 */
START_TEST(auto_streams_a_job_whose_whole_blocks_do_not_fit_and_not_one_that_fits) {
  ow_seed_init(8100);
  struct ow_case *big = xn_case_new(&SA_BIG, 0), *small = xn_case_new(&SA_SMALL, 0);
  sa_assert_margins(big, 4, 2);
  ck_assert_uint_lt(4 * sa_rank_bytes(small, 4, 0), 2 * SA_MIB);
  struct nodes ns;
  xn_nodes_start(&ns, 1, 20000, SA_OP_TIMEOUT_MS, SA_POOL(2));
  sa_run(&ns, 1, "auto-big", big, SA_BIG_CHUNK);
  char *log = tu_daemon_log(&ns.d[0]);
  ck_assert_ptr_nonnull(log);
  ck_assert_msg(strstr(log, "job auto-big streams in chunks of 16 rows (stream_chunk_rows: "
                            "auto): its whole blocks need 1.2 MiB a rank") != NULL,
                "the log does not say why auto-big streams:\n%s", log);
  free(log);
  sa_run(&ns, 1, "auto-small", small, 0);
  log = tu_daemon_log(&ns.d[0]);
  ck_assert_ptr_null(strstr(log, "job auto-small streams"));
  free(log);
  nodes_stop(&ns);
  xn_case_free(big);
  xn_case_free(small);
}
END_TEST

/*
 * (b) stream_chunk_rows: 0 keeps its meaning: the same big job on the same pool is refused
 * at attach with DEP_ERR_NO_MEMORY, naming the chunk auto would have chosen.  (Unchanged
 * behaviour; check_memory's refusal test holds its message's figures.)
 */
START_TEST(zero_still_refuses_the_big_job_naming_the_chunk_that_fits) {
  ow_seed_init(8200);
  struct ow_case *big = xn_case_new(&SA_BIG, 0);
  struct nodes ns;
  xn_nodes_start(&ns, 1, 20000, SA_OP_TIMEOUT_MS, SA_POOL(2) "stream_chunk_rows: 0\n");
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  ck_assert_int_eq(dep_connect(c, ns.d[0].sock), 0);
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = 4, .local_rank = 0,
                              .local_world_size = 4, .shape = big->shape};
  snprintf(a.job_id, sizeof a.job_id, "zero-big");
  ck_assert_int_eq(dep_attach(c, &a), DEP_ERR_NO_MEMORY);
  ck_assert_msg(strstr(dep_errmsg(c), "or set stream_chunk_rows: 16 on every node") != NULL,
                "said: %s", dep_errmsg(c));
  dep_client_free(c);
  nodes_stop(&ns);
  xn_case_free(big);
}
END_TEST

/*
 * (d) Two daemons of the default configuration and equal small pools choose the same chunk
 * for a job of 2 + 2 ranks, each from its own pool's size: both lend the layout of that
 * chunk (slab, ring and exchange region), and every op of every rank is the oracle's.  On
 * the old code the job was refused with DEP_ERR_NO_MEMORY on both nodes.
 */
START_TEST(two_daemons_of_equal_pools_choose_the_same_chunk_and_the_job_runs) {
  ow_seed_init(8300);
  struct ow_case *big = xn_case_new(&SA_BIG, 0);
  sa_assert_margins(big, 2, 2);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, SA_OP_TIMEOUT_MS, SA_POOL(2));
  sa_run(&ns, 2, "auto-two", big, SA_BIG_CHUNK);
  nodes_stop(&ns);
  xn_case_free(big);
}
END_TEST

/*
 * (e) Two daemons whose pools differ, so that auto streams the job on one (2 MiB) and not on
 * the other (8 MiB): every rank fails at attach with DEP_ERR_MISMATCH saying that a node
 * chose by stream_chunk_rows: auto and the chunk to set on every node (the smaller, which
 * fits both).  On the old code the small node refused the job (DEP_ERR_NO_MEMORY).
 */
START_TEST(daemons_whose_pools_make_auto_differ_fail_the_job_saying_what_to_set) {
  ow_seed_init(8400);
  struct ow_case *big = xn_case_new(&SA_BIG, 0);
  ck_assert_uint_lt(2 * sa_rank_bytes(big, 2, 0), 8 * SA_MIB); /* whole blocks fit 8 MiB */
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", SA_OP_TIMEOUT_MS);
  nodes_config_with(&ns, 2, 20000, limits, "");
  strncat(ns.yaml[0], SA_POOL(2), sizeof ns.yaml[0] - strlen(ns.yaml[0]) - 1);
  strncat(ns.yaml[1], SA_POOL(8), sizeof ns.yaml[1] - strlen(ns.yaml[1]) - 1);
  nodes_start_all(&ns);
  struct xn_place p;
  memset(&p, 0, sizeof p);
  const uint32_t split[NODES_MAX] = {2, 2};
  xn_place(&p, split, 2);
  struct xn_run run = {.d = big, .rounds = 1};
  struct xn_result *res = xn_results(4);
  pid_t pids[4];
  /* Every rank's process is started before the job can fail: a process started after a
   * job's failure is a new attempt, which gathers anew (job_refuse_late), and on a loaded
   * machine the last fork may come after the first three ranks have met the mismatch.  The
   * daemons answer no one until all four exist and the clock of processes' start times
   * (10 ms ticks) has moved past them. */
  for (int i = 0; i < 2; i++)
    ck_assert_int_eq(kill(ns.d[i].pid, SIGSTOP), 0);
  xn_spawn(&ns, &p, "auto-differ", &run, res, pids);
  dw_sleep_ms(30);
  for (int i = 0; i < 2; i++)
    ck_assert_int_eq(kill(ns.d[i].pid, SIGCONT), 0);
  (void)xn_reap(pids, 4, SA_OP_TIMEOUT_MS * 3);
  for (uint32_t g = 0; g < 4; g++) {
    ck_assert_msg(atomic_load(&res[g].done), "rank %u hung", g);
    ck_assert_msg(res[g].rc == DEP_ERR_MISMATCH &&
                      strstr(res[g].msg, "chose by stream_chunk_rows: auto: its pool holds") != NULL &&
                      strstr(res[g].msg, "set stream_chunk_rows: 16 on every node") != NULL,
                  "rank %u: %s, want DEP_ERR_MISMATCH saying auto chose and what to set: %s", g,
                  dep_errname(res[g].rc), res[g].msg);
    printf("stream_auto: rank %u: %s\n", g, res[g].msg);
  }
  munmap(res, 4 * sizeof *res);
  nodes_stop(&ns);
  xn_case_free(big);
}
END_TEST

/*
 * (f) On the host backend a job across nodes streams by default, in chunks of
 * LEND_AUTO_XNODE_HOST_ROWS rows, though its whole blocks fit (there chunks are the faster,
 * lend.h): two daemons of the default configuration and roomy pools both lend a 2 + 2 job
 * the layout of 64-row chunks, say so in their logs, and every op is the oracle's; the same
 * job on one daemon runs whole blocks.  On the old code (auto: whole blocks where they fit)
 * the job across nodes was lent whole blocks (chunk 0).
 */
START_TEST(a_job_across_host_nodes_streams_in_64_row_chunks_and_on_one_node_whole_blocks) {
  ow_seed_init(8500);
  struct ow_case *d = xn_case_new(&SA_LONG, 0);
  ck_assert_uint_gt(d->shape.max_tokens_per_rank, 4 * LEND_AUTO_XNODE_HOST_ROWS);
  ck_assert_uint_lt(4 * sa_rank_bytes(d, 4, 0), 16 * SA_MIB); /* whole blocks fit */
  ck_assert_uint_lt(2 * sa_rank_bytes(d, 2, 0), 16 * SA_MIB);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, SA_OP_TIMEOUT_MS, SA_POOL(16));
  sa_run(&ns, 2, "auto-across", d, LEND_AUTO_XNODE_HOST_ROWS);
  for (int i = 0; i < 2; i++) {
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_ptr_nonnull(log);
    ck_assert_msg(strstr(log, "job auto-across streams in chunks of 64 rows (stream_chunk_rows: "
                              "auto): a job across nodes on the host backend streams") != NULL,
                  "node %d's log does not say why auto-across streams:\n%s", i, log);
    free(log);
  }
  sa_run(&ns, 1, "auto-one-node", d, 0);
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

/*
 * (f) The ranks a device's check weighs (lend_ranks_here): a daemon of one device weighs
 * every local rank on it, as before; one of several weighs what an even spread puts on a
 * device, so that a job of a rank a GPU on an 8-GPU node is not weighed as 8 on one GPU's
 * pool (and streamed or refused for it); a rank that finds its device fuller than spread is
 * weighed with those seated there; never more than the job's local ranks.
 */
START_TEST(a_device_weighs_an_even_spread_of_the_local_ranks_or_those_seated_there) {
  static const struct { uint32_t local; size_t devices; uint32_t seated, want; } cases[] = {
      {8, 1, 0, 8},  {8, 1, 7, 8},  {1, 1, 0, 1},  {8, 0, 0, 8},  /* one device (0: none known) */
      {8, 8, 0, 1},  {8, 8, 1, 2},  {8, 8, 7, 8},  {16, 8, 0, 2}, /* a rank or two a GPU */
      {9, 8, 0, 2},  {4, 8, 0, 1},  {64, 8, 3, 8}, {64, 8, 8, 9}, /* rounded up; fewer ranks */
      {2, 8, 5, 2},                                               /* never past local */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    ck_assert_msg(lend_ranks_here(cases[i].local, cases[i].devices, cases[i].seated) ==
                      cases[i].want,
                  "%u local ranks, %zu devices, %u seated: %u weighed, want %u", cases[i].local,
                  cases[i].devices, cases[i].seated,
                  lend_ranks_here(cases[i].local, cases[i].devices, cases[i].seated),
                  cases[i].want);
}
END_TEST

Suite *stream_auto_suite(void);
Suite *stream_auto_suite(void) {
  Suite *s = suite_create("stream_auto");
  TCase *r = tcase_create("rules");
  tcase_add_test(r, a_device_weighs_an_even_spread_of_the_local_ranks_or_those_seated_there);
  suite_add_tcase(s, r);
  TCase *t = tcase_create("daemons");
  tcase_set_timeout(t, 240);
  tcase_add_test(t, auto_streams_a_job_whose_whole_blocks_do_not_fit_and_not_one_that_fits);
  tcase_add_test(t, zero_still_refuses_the_big_job_naming_the_chunk_that_fits);
  tcase_add_test(t, two_daemons_of_equal_pools_choose_the_same_chunk_and_the_job_runs);
  tcase_add_test(t, daemons_whose_pools_make_auto_differ_fail_the_job_saying_what_to_set);
  tcase_add_test(t, a_job_across_host_nodes_streams_in_64_row_chunks_and_on_one_node_whole_blocks);
  suite_add_tcase(s, t);
  return s;
}
