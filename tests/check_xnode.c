/*
 * check_xnode.c — operations of jobs that span nodes (DESIGN §7): real
 * daemons on 127.0.0.1 that are each other's peers (nodes.h), real rank
 * processes on the public API (xnjob.h), random inputs from a printed seed
 * (opsworld.h).  Every rank checks what it can against the oracle (counts,
 * sums) and folds everything it received into a digest; the same job run
 * with every rank on one daemon must give every rank the same digest, bit
 * for bit.  Tagged gpu (make check-gpu): the same kind of job on the cuda
 * backend, two or three daemons sharing one machine's GPU over TCP on
 * loopback (the kernels' exchange region and ring in host memory, which
 * the daemons read and write with no CUDA call), held against the oracle.
 * The faults (a remote rank, a remote daemon or a link lost mid-run) are
 * check_xnode_faults.c; the host backend's side of the ring with no proxy,
 * check_xnode_ring.c; split calls across daemons on the GPU,
 * check_xnode_split.c.
 */
#include <check.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "slab.h"
#include "sm_budget.h"
#include "testutil.h"
#include "xnjob.h"
#include "xngpu.h"
#include "xnround.h"
#include "xring.h"

#define XN_ROUNDS_MAX 250

/* ---- correctness: across nodes as on one node ------------------------------------ */

/* Each layout's daemons run 1, 2 or 3 proxy threads in turn, so that rings of one node are
 * drained by several threads at once (a rank's by thread local_rank mod their count) whatever
 * this machine's default. */
START_TEST(a_job_across_nodes_gives_every_rank_what_it_gets_on_one_node) {
  const struct xn_layout *L = &xn_layouts[_i];
  ow_seed_init(1000 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  char limits[64], extra[32];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", XN_OP_TIMEOUT_MS * 4);
  const int proxies = 1 + _i % 3;
  snprintf(extra, sizeof extra, "proxy_threads: %d\n", proxies);
  nodes_config_with(&ns, L->nodes, 20000, limits, extra);
  nodes_start_all(&ns);
  const uint32_t n = L->sc.world;
  struct xn_run run = {.d = d, .rounds = 2};
  /* On one node first: node 0 holds every rank. */
  struct xn_place one, spread;
  memset(&one, 0, sizeof one);
  memset(&spread, 0, sizeof spread);
  uint32_t all[NODES_MAX] = {n};
  xn_place(&one, all, 1);
  xn_place(&spread, L->split, L->nodes);
  struct xn_result *r1 = xn_results(n), *r2 = xn_results(n);
  char job[64];
  snprintf(job, sizeof job, "one-%d", _i);
  xn_run_job(&ns, &one, job, &run, r1);
  snprintf(job, sizeof job, "spread-%d", _i);
  xn_run_job(&ns, &spread, job, &run, r2);
  for (uint32_t g = 0; g < n; g++)
    ck_assert_msg(r1[g].digest == r2[g].digest,
                  "rank %u (node %u of %d) got other outputs across nodes than on one node "
                  "[%s] (seed %llu)", g, spread.node[g], L->nodes, d->desc,
                  (unsigned long long)ow_seed);
  printf("xnode: %s over %d nodes, %d proxy thread(s) each: every rank as on one node\n",
         d->desc, L->nodes, proxies);
  munmap(r1, n * sizeof *r1);
  munmap(r2, n * sizeof *r2);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/* 250 rounds of every op (1,250 calls, LL FP8 on in odd rounds) on 2 + 2 ranks. */
START_TEST(a_thousand_calls_back_to_back_across_nodes_stay_as_on_one_node) {
  ow_seed_init(77);
  struct ow_scenario sc = {4, 128, 2, 8, 8, 8, P_RANDOM, T_MIXED, DEP_INDEX_I32, 0};
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &sc, 1);
  struct nodes ns;
  nodes_config_with(&ns, 2, 20000, ", op_timeout_ms: 16000", "");
  nodes_start_all(&ns);
  struct xn_run run = {.d = d, .rounds = XN_ROUNDS_MAX, .alternate_fp8 = true};
  struct xn_place one, spread;
  memset(&one, 0, sizeof one);
  memset(&spread, 0, sizeof spread);
  uint32_t all[NODES_MAX] = {4}, split[NODES_MAX] = {2, 2};
  xn_place(&one, all, 1);
  xn_place(&spread, split, 2);
  struct xn_result *r1 = xn_results(4), *r2 = xn_results(4);
  int64_t t0 = xn_mono_ms();
  xn_run_job(&ns, &one, "b2b-one", &run, r1);
  int64_t t1 = xn_mono_ms();
  xn_run_job(&ns, &spread, "b2b-spread", &run, r2);
  int64_t t2 = xn_mono_ms();
  for (uint32_t g = 0; g < 4; g++) {
    ck_assert_uint_eq(r2[g].rounds, XN_ROUNDS_MAX);
    ck_assert_msg(r1[g].digest == r2[g].digest, "rank %u: 1,250 calls across nodes differ from "
                  "one node (seed %llu)", g, (unsigned long long)ow_seed);
  }
  printf("xnode: 1,250 calls on 4 ranks: %lld ms on one node, %lld ms over 2 nodes\n",
         (long long)(t1 - t0), (long long)(t2 - t1));
  munmap(r1, 4 * sizeof *r1);
  munmap(r2, 4 * sizeof *r2);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/*
 * Warm exchange regions (pool.h's regions): a second job of the same uid,
 * shape, world and placement across the same two daemons gets the rings
 * and exchange regions of the first back, reset (each node says so), and
 * runs as the first did, digest for digest, though every slot's flag of
 * the first job's calls was left in them; a job of another uid of the
 * same shape gets fresh ones (root only: it runs as nobody).  Then
 * limits.memory_per_uid counts the regions: a quota that holds the arenas
 * but not one more region refuses the job, naming the limit.
 */
static int count_in(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle))
    n++;
  return n;
}

START_TEST(a_restarted_job_gets_its_exchange_regions_back_and_another_uid_does_not) {
  ow_seed_init(83);
  const struct xn_layout *L = &xn_layouts[2]; /* 2 + 2 ranks */
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  nodes_config_with(&ns, 2, 20000, ", op_timeout_ms: 16000", "allow: {any_user: true}\n");
  nodes_start_all(&ns);
  for (int i = 0; i < 2; i++)
    chmod(ns.d[i].dir, 0755); /* uid 65534 reaches the sockets */
  const uint32_t n = L->sc.world;
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, L->split, L->nodes);
  struct xn_run run = {.d = d, .rounds = 2};
  struct xn_result *r1 = xn_results(n), *r2 = xn_results(n);
  xn_run_job(&ns, &spread, "warm-first", &run, r1);
  for (int i = 0; i < 2; i++) {
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_msg(count_in(log, "reused from an earlier job") == 0,
                  "node %d: the first job of its shape reused regions:\n%s", i, log);
    free(log);
  }
  xn_run_job(&ns, &spread, "warm-second", &run, r2);
  for (uint32_t g = 0; g < n; g++)
    ck_assert_msg(r1[g].digest == r2[g].digest, "rank %u: the job on reused exchange regions "
                  "got other outputs than the first (seed %llu)", g, (unsigned long long)ow_seed);
  for (int i = 0; i < 2; i++) {
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_msg(strstr(log, "job warm-second: 2 of its 2 local rank(s)' exchange regions") !=
                      NULL, "node %d: the second job did not get both regions back:\n%s", i,
                  log);
    free(log);
  }
  if (geteuid() == 0) {
    struct xn_run other = run;
    other.uid = 65534;
    struct xn_result *r3 = xn_results(n);
    xn_run_job(&ns, &spread, "warm-nobody", &other, r3);
    for (int i = 0; i < 2; i++) {
      char *log = tu_daemon_log(&ns.d[i]);
      ck_assert_msg(count_in(log, "reused from an earlier job of uid 65534") == 0,
                    "node %d: uid 65534's job got another uid's regions:\n%s", i, log);
      free(log);
    }
    munmap(r3, n * sizeof *r3);
  }
  printf("xnode: a second job of the shape got its exchange regions back on both nodes and ran "
         "as the first%s\n", geteuid() == 0 ? "; another uid's job got fresh ones" : "");
  munmap(r1, n * sizeof *r1);
  munmap(r2, n * sizeof *r2);
  nodes_stop(&ns);

  /* The quota: the arenas of a node's ranks fit, their regions do not (a
   * larger shape: the limit is at least 2 MiB). */
  const struct xn_layout *Q = &xn_layouts[8]; /* 4 + 4 ranks */
  struct ow_case *q = malloc(sizeof *q);
  ck_assert_ptr_nonnull(q);
  ow_case_make(q, &Q->sc, Q->sc.fp8);
  const uint32_t qn = Q->sc.world, lws = Q->split[0];
  struct dep_slab_layout l;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&q->shape, qn, lws, 0, &l, why, sizeof why), 0);
  const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  const uint64_t stride = (l.total_bytes + 65535) / 65536 * 65536;
  const uint64_t arena = (lws * stride + page - 1) / page * page;
  const uint64_t region = DEP_XRING_BYTES + l.xchg_bytes;
  const uint64_t quota = (arena + region + 1023) / 1024; /* KiB: under the arenas and two */
  ck_assert_uint_ge(quota, 2048);
  /* Node 0 alone has the quota, and its ranks start once all of node 1's wait in the job:
   * the refusal then reaches every rank as the ATTACH of the job it waits in.  (A node lends
   * at its last local rank's attach, so with ranks arriving in any order the first node to
   * refuse may fail the job on the other while only some of that node's ranks are there;
   * its later ones are told the failure as late ranks, when their processes started a clock
   * tick before it: multinode/daemons' a_failed_jobs_late_ranks_hear_it_at_once...) */
  nodes_config_with(&ns, 2, 20000, ", op_timeout_ms: 8000", "");
  char *lim = strstr(ns.yaml[0], "op_timeout_ms: 8000}");
  ck_assert_ptr_nonnull(lim);
  char rest[sizeof ns.yaml[0]];
  snprintf(rest, sizeof rest, "%s", lim + strlen("op_timeout_ms: 8000"));
  snprintf(lim, sizeof ns.yaml[0] - (size_t)(lim - ns.yaml[0]),
           "op_timeout_ms: 8000, memory_per_uid: %lluKiB%s", (unsigned long long)quota, rest);
  nodes_start_all(&ns);
  struct xn_place qp;
  memset(&qp, 0, sizeof qp);
  xn_place(&qp, Q->split, Q->nodes);
  struct xn_run qrun = {.d = q, .rounds = 1};
  struct xn_result *r4 = xn_results(qn);
  pid_t pids[OW_MAXW];
  xn_spawn_node(&ns, &qp, "over-quota", &qrun, r4, pids, 1);
  int obs = dw_client(&ns.d[1]);
  uint32_t at = 0;
  for (int t = 0; t < 30000 && !(dw_job_listed(obs, "over-quota", &at, NULL) && at == Q->split[1]);
       t += 20)
    dw_sleep_ms(20);
  close(obs);
  ck_assert_msg(at == Q->split[1], "node 1 holds %u of its %u ranks of the job", at, Q->split[1]);
  xn_spawn_node(&ns, &qp, "over-quota", &qrun, r4, pids, 0);
  ck_assert(!xn_reap(pids, qn, 60000));
  for (uint32_t g = 0; g < qn; g++)
    ck_assert_msg(r4[g].rc == DEP_ERR_LIMIT && strstr(r4[g].msg, "memory_per_uid") != NULL,
                  "rank %u: %s (%d)", g, r4[g].msg, r4[g].rc);
  printf("xnode: memory_per_uid counts the exchange regions: %llu KiB of arenas and regions "
         "a node refused under a quota of %llu KiB\n",
         (unsigned long long)((arena + lws * region) / 1024), (unsigned long long)quota);
  ow_case_free(q);
  free(q);
  munmap(r4, qn * sizeof *r4);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/*
 * A daemon that stops under a job that spans nodes: the next one on its
 * socket charges what the job's rank still maps, its ring and exchange
 * region included (the held file names the region's holder too), until the
 * rank exits.  One rank on each of two daemons; node 0's is stopped
 * (SIGTERM) and started again while its rank holds everything it was lent.
 */
static uint64_t pool_bytes(const struct tu_daemon *d, bool held) {
  int fd = dw_client(d);
  struct dep_status *st = dw_status(fd);
  uint64_t n = 0;
  for (uint32_t i = 0; i < st->num_devices; i++)
    n += held ? st->devices[i].pool_held_bytes : st->devices[i].pool_used_bytes;
  dep_status_free(st);
  close(fd);
  return n;
}

START_TEST(a_restarted_daemon_charges_the_exchange_region_a_rank_still_maps) {
  struct nodes ns;
  nodes_config_with(&ns, 2, 20000, "", "");
  nodes_start_all(&ns);
  const struct dep_job_shape shape = {.max_tokens_per_rank = 16, .hidden = 128,
                                      .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16};
  int go[2][2];
  pid_t pids[2];
  for (uint32_t g = 0; g < 2; g++) /* not inherited by the daemon started below */
    ck_assert_int_eq(pipe2(go[g], O_CLOEXEC), 0);
  for (uint32_t g = 0; g < 2; g++) {
    pids[g] = fork();
    ck_assert_int_ge(pids[g], 0);
    if (pids[g] == 0) {
      close(go[0][1]); /* both: each rank's read ends when the test closes its own */
      close(go[1][1]);
      dep_client_t *c = NULL;
      struct dep_attach_args a = {.size = sizeof a, .rank = g, .world_size = 2,
                                  .local_world_size = 1, .shape = shape};
      snprintf(a.job_id, sizeof a.job_id, "held-xchg");
      if (dep_client_new(&c) != 0 || dep_connect(c, ns.d[g].sock) != 0 || dep_attach(c, &a) != 0)
        _exit(2);
      char x;
      (void)read(go[g][0], &x, 1); /* hold everything until told */
      _exit(0);
    }
    close(go[g][0]);
  }
  /* Both ranks attached and lent their rings: node 0 has the arena and the region lent. */
  struct dep_slab_layout l;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 2, 1, 0, &l, why, sizeof why), 0);
  const uint64_t region = DEP_XRING_BYTES + l.xchg_bytes;
  uint64_t lent = 0;
  for (int t = 0; t < 400 && (lent = pool_bytes(&ns.d[0], false)) <= region; t++)
    dw_sleep_ms(25);
  ck_assert_uint_gt(lent, region); /* an arena and a region */
  dw_sleep_ms(200); /* the held file is written off the loop's turn */
  ck_assert_int_eq(tu_daemon_stop(&ns.d[0]), 0);
  node_start(&ns, 0);
  const uint64_t held = pool_bytes(&ns.d[0], true);
  ck_assert_msg(held == lent, "the new daemon charges %llu bytes; the rank holds %llu (its "
                "region, %llu, included)", (unsigned long long)held, (unsigned long long)lent,
                (unsigned long long)region);
  for (int g = 0; g < 2; g++) {
    close(go[g][1]);
    int st;
    ck_assert_int_eq(waitpid(pids[g], &st, 0), pids[g]);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %d exited %#x", g, st);
  }
  uint64_t left = held;
  for (int t = 0; t < 250 && (left = pool_bytes(&ns.d[0], true)) != 0; t++)
    dw_sleep_ms(20);
  ck_assert_uint_eq(left, 0);
  printf("xnode: a restarted daemon charged the %llu bytes its rank held, the exchange region's "
         "%llu included, until it exited\n", (unsigned long long)lent,
         (unsigned long long)region);
  nodes_stop(&ns);
}
END_TEST

/* ---- the cuda backend: daemons sharing one GPU ---------------------------------- */

static const struct xn_layout gpu_layouts[] = {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8;  nodes, split */
  {{2, 2048, 8, 8, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1}, 2, {1, 1}},
  {{4, 128, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 2, {2, 2}},
  {{4, 2048, 8, 32, 16, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 1}, 2, {3, 1}},
  {{4, 128, 2, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 0}, 2, {1, 3}},
  {{3, 128, 8, 12, 32, 16, P_NONE, T_MAX, DEP_INDEX_I64, 0}, 3, {1, 1, 1}},
  {{8, 7168, 8, 16, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 2, {4, 4}},
};

/*
 * Rank processes of one job attached to two or three daemons on the cuda
 * backend, all on this machine's GPU 0 (DEP_TEST_GPUS spreads them): the
 * blocks between daemons go from the kernels into the sender's exchange
 * region (host memory mapped for the GPU) -> the proxy's plain loads ->
 * TCP -> the other daemon's plain stores into the receiver's exchange
 * region, where its kernels wait on the flag and read the rows over the
 * mapping; no daemon makes a CUDA call on that path.  Every output, twice (under two poisons), as the oracle says: moves
 * bit for bit, sums bit for bit in the host backend's order, which is what
 * the same job gives on one node.
 */
START_TEST(on_the_gpu_a_job_on_daemons_sharing_it_matches_the_oracle) {
  CR_NEEDS_GPU();
  const struct xn_layout *L = &gpu_layouts[_i];
  ow_seed_init(3000 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  nodes_config_with(&ns, L->nodes, 60000, ", op_timeout_ms: 30000", "");
  nodes_start_all(&ns);
  struct cr_rounds a = {d, 1, 2};
  char job[32];
  snprintf(job, sizeof job, "gpu-spread-%d", _i);
  const uint64_t t0 = cr_ms_now();
  static char fails[OW_FAILS_LEN];
  int nfail = xg_run(&ns, L->split, job, d, cr_body_rounds, &a, false, fails, sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  char out[16384];
  xn_ctl_json(&ns, "peers", out, sizeof out);
  ck_assert_msg(strstr(out, "\"data_frames_out\":0") == NULL,
                "no block went through node 0's proxy: %s", out);
  printf("xnode gpu: %s over %d daemons on one machine: as the oracle says, in %llu ms\n",
         d->desc, L->nodes, (unsigned long long)(cr_ms_now() - t0));
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/*
 * Calls back to back across two daemons on the cuda backend, the inputs
 * changing every round (two cases of one shape, alternating, 8 rounds of
 * 5 calls): a call reuses the exchange region's blocks and slots of the
 * call two before it, now with other rows, which the GPU reads from host
 * memory over the mapping.  A row or slot read stale (from a cache, or
 * before the daemon's stores landed) differs from the oracle; every round
 * repeats the digest of the last round with its inputs.
 */
START_TEST(on_the_gpu_calls_across_daemons_read_each_calls_own_rows_as_inputs_change) {
  CR_NEEDS_GPU();
  ow_seed_init(4242);
  const struct ow_scenario sc = {4, 2048, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1};
  struct ow_case *d = malloc(2 * sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(&d[0], &sc, 1);
  ow_case_make(&d[1], &sc, 1);
  ck_assert_uint_eq(d[0].in[0].num_tokens, d[1].in[0].num_tokens);
  ck_assert_msg(memcmp(d[0].in[0].x, d[1].in[0].x, (size_t)d[0].in[0].num_tokens * 2048 * 2) != 0,
                "the two cases have the same inputs: the test would see no stale row");
  struct nodes ns;
  nodes_config_with(&ns, 2, 60000, ", op_timeout_ms: 30000", "");
  nodes_start_all(&ns);
  const uint32_t split[NODES_MAX] = {2, 2};
  struct cr_rounds a = {d, 2, 8};
  const uint64_t t0 = cr_ms_now();
  static char fails[OW_MAXW * (OW_MSG + 16)];
  int nfail = xg_run(&ns, split, "gpu-change", d, cr_body_rounds, &a, false, fails,
                      sizeof fails);
  ck_assert_msg(nfail == 0, "%s: %d rank(s) failed (DEP_TEST_SEED=%llu):%s", d->desc, nfail,
                (unsigned long long)ow_seed, fails);
  printf("xnode gpu: 8 rounds of changing inputs over 2 daemons: as the oracle says, in %llu ms\n",
         (unsigned long long)(cr_ms_now() - t0));
  nodes_stop(&ns);
  ow_case_free(&d[0]);
  ow_case_free(&d[1]);
  free(d);
}
END_TEST

/* What the ranks of the tests that lose node 1 or its daemon share. */
struct gpu_loss {
  const struct ow_case *d;
  pid_t victim;        /* node 1's daemon */
  uint32_t first_gone; /* node 1's first rank: it kills the daemon */
  int kill_round;
  bool ranks_live_on;  /* node 1's ranks go on after the kill, else they stop with it */
  const char *unseen;  /* what no failure in 100000 rounds means */
};

/* Rounds until a call fails.  Node 1's first rank kills its daemon before
 * round kill_round; then node 1's ranks stop (node 1 is lost with its
 * ranks), or, where ranks_live_on, go on as every rank does.  A failure's
 * message ends with the round and how long its round took. */
static int body_until_failure(struct rk *k, void *arg) {
  const struct gpu_loss *g = arg;
  for (int round = 0; round < 100000; round++) {
    if (k->rank >= g->first_gone && round == g->kill_round) {
      if (k->rank == g->first_gone)
        kill(g->victim, SIGKILL);
      if (!g->ranks_live_on)
        _exit(0);
    }
    uint64_t dig = 0, t0 = cr_ms_now();
    if (cr_upload(k, g->d) || cr_round_tp(k, g->d, 0xA5, &dig) ||
        cr_round_ll(k, g->d, 0, 0xA5, &dig)) {
      size_t l = strlen(k->msg);
      snprintf(k->msg + l, OW_MSG - l, " (round %d, after %llu ms)", round,
               (unsigned long long)(cr_ms_now() - t0));
      return 1;
    }
  }
  return ow_fail(k->msg, "rank %u: 100000 rounds and no failure: %s", k->rank, g->unseen);
}

/* A job of 2 + 2 ranks (a case of seed) on two daemons started in ns with
 * an op timeout of op_ms, node 1's daemon g's victim, run with
 * body_until_failure until its ranks fail: how many did, their messages in
 * fails. */
static int gpu_run_until_failure(struct nodes *ns, uint64_t seed, int op_ms, const char *job,
                                 struct gpu_loss *g, char *fails, size_t len) {
  ow_seed_init(seed);
  const struct ow_scenario sc = {4, 2048, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  xn_nodes_start(ns, 2, 60000, op_ms, "");
  const uint32_t split[NODES_MAX] = {2, 2};
  g->d = d;
  g->victim = ns->d[1].pid;
  int nfail = xg_run(ns, split, job, d, body_until_failure, g, true, fails, len);
  xn_case_free(d);
  return nfail;
}

/* Rank r's failure in fails (gpu_run's), up to the next rank's, into one;
 * the test fails where r did not fail.  Returns how long its last round
 * ran, the " after N ms" body_until_failure appended (~0 where none). */
static unsigned long long gpu_rank_failure(const char *fails, int r, char *one, size_t len) {
  char tag[32];
  snprintf(tag, sizeof tag, "rank %d: ", r);
  const char *m = strstr(fails, tag);
  ck_assert_msg(m != NULL, "rank %d did not fail:%s", r, fails);
  const char *end = strstr(m + 1, "\n  rank ");
  snprintf(one, len, "%.*s", end ? (int)(end - m) : (int)strlen(m), m);
  const char *after = strstr(one, ", after ");
  return after ? strtoull(after + 8, NULL, 10) : ~0ull;
}

/*
 * On the cuda backend, a job of 2 + 2 ranks on two daemons sharing the GPU:
 * node 1's daemon is SIGKILLed with its ranks mid-run.  Node 0's ranks fail
 * within the op timeout with DEP_ERR_PEER naming a lost node (or
 * DEP_ERR_TIMEOUT), their daemon still answers, and a new job on it runs.
 */
START_TEST(on_the_gpu_a_lost_node_fails_the_survivors_within_the_op_timeout) {
  CR_NEEDS_GPU();
  enum { OP_MS = 10000 };
  struct nodes ns;
  struct gpu_loss g = {.first_gone = 2, .kill_round = 4,
                       .unseen = "node 1's loss was not seen"};
  static char fails[OW_FAILS_LEN];
  int nfail = gpu_run_until_failure(&ns, 77, OP_MS, "gpu-loss", &g, fails, sizeof fails);
  ns.d[1].pid = 0; /* killed: nodes_stop must not wait for it */
  ck_assert_msg(nfail == 2, "not just node 0's two ranks failed (%d did):%s", nfail, fails);
  for (int r = 0; r < 2; r++) {
    char one[OW_MSG + 32];
    unsigned long long ms = gpu_rank_failure(fails, r, one, sizeof one);
    ck_assert_msg(strstr(one, "DEP_ERR_PEER") != NULL || strstr(one, "DEP_ERR_TIMEOUT") != NULL,
                  "rank %d failed otherwise: %s", r, one);
    ck_assert_msg(ms <= OP_MS + 5000, "rank %d took %llu ms to fail, past the op timeout: %s", r,
                  ms, one);
    printf("xnode gpu: node 1 lost: %s\n", one);
  }
  char out[16384];
  xn_ctl_json(&ns, "status", out, sizeof out);
  /* A job on node 0 alone runs after the loss. */
  struct ow_scenario sc2 = {2, 2048, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d2 = xn_case_new(&sc2, 0);
  struct nodes one = ns;
  one.n = 1;
  const uint32_t all[NODES_MAX] = {2};
  struct cr_rounds a = {d2, 1, 2};
  nfail = xg_run(&one, all, "gpu-after-loss", d2, cr_body_rounds, &a, false, fails,
                  sizeof fails);
  ck_assert_msg(nfail == 0, "a job on node 0 after node 1's loss failed:%s", fails);
  printf("xnode gpu: node 0 ran a new job after node 1's loss\n");
  nodes_stop(&ns);
  xn_case_free(d2);
}
END_TEST

/*
 * On the cuda backend, a job of 2 + 2 ranks on two daemons sharing the GPU:
 * node 1's daemon is SIGKILLed mid-run and its ranks live on.  Their
 * kernels were told through the abort words of their slabs (device
 * memory, written by the library's watcher thread: cuda_ops_daemon_gone),
 * so they fail within a bound far below the op timeout (60 s) with
 * DEP_ERR_DAEMON_GONE saying so, not DEP_ERR_TIMEOUT after it; node 0's
 * fail with DEP_ERR_PEER.  (check_xnode_faults's own-daemon cases are the
 * host backend's.)
 */
START_TEST(on_the_gpu_a_ranks_own_daemon_killed_fails_it_with_daemon_gone_at_once) {
  CR_NEEDS_GPU();
  enum { OP_MS = 60000, BOUND_MS = 10000 };
  struct nodes ns;
  struct gpu_loss g = {.first_gone = 2, .kill_round = 4, .ranks_live_on = true,
                       .unseen = "the daemon's death was not seen"};
  static char fails[OW_FAILS_LEN];
  int nfail = gpu_run_until_failure(&ns, 78, OP_MS, "gpu-own", &g, fails, sizeof fails);
  tu_daemon_wait_exit(&ns.d[1], 10000);
  ck_assert_msg(nfail == 4, "not every rank failed (%d did):%s", nfail, fails);
  for (int r = 0; r < 4; r++) {
    char one[OW_MSG + 32];
    unsigned long long ms = gpu_rank_failure(fails, r, one, sizeof one);
    /* Node 1's ranks: the daemon-gone message, which the harness shows with
     * the code's name (a call that returned it) or without (dep_layout's
     * outputs checked after it failed); node 0's: as the lost-node test. */
    const char *want = r >= 2 ? "deepepd on this node stopped or restarted" : "DEP_ERR_PEER";
    ck_assert_msg(strstr(one, want) != NULL, "rank %d failed otherwise than \"%s\": %s", r,
                  want, one);
    ck_assert_msg(ms <= BOUND_MS, "rank %d took %llu ms to fail (bound %d ms, op timeout %d ms): "
                  "%s", r, ms, BOUND_MS, OP_MS, one);
    printf("xnode gpu: node 1's daemon killed: %s\n", one);
  }
  nodes_stop(&ns);
}
END_TEST

/* ---- the cuda backend: a rank that rejoins an elastic job across daemons --------- */

/* What the rank processes of the rejoin share (mmap): the rank that leaves and comes back
 * says its first call, as a trainer's store would (deepep.h's rejoin recipe). */
struct gpu_rejoin {
  const struct ow_case *full;          /* the oracle */
  _Atomic uint32_t first_done;         /* ranks that made their first round */
  _Atomic uint64_t first;              /* GR_RANK's first call after it is back; 0 until then */
  _Atomic uint32_t refused;            /* its attaches refused as overtaken */
};
#define GR_RANK 1u
/* Its attaches refused in a row before the test gives up: the daemons' hooks refuse two. */
#define GR_TRIES 20u
/* How long a survivor waits for GR_RANK to be back: a ceiling for a loaded machine. */
#define GR_CEILING_MS 60000

/* One dispatch of d's inputs with GR_RANK masked, its outputs unread: a survivor's call
 * before the join call (the operations' masks are check_cuda_ops_mask.c's; what this test
 * holds is the calls after). */
static int gr_masked_call(struct rk *k, const struct ow_case *d) {
  uint32_t nrecv = 0;
  struct dep_dispatch_args da = {.size = sizeof da, .x = CR_DEV(k, B_X),
                                 .topk_idx = CR_DEV(k, B_IDX), .index_type = d->sc.itype,
                                 .topk_weights = CR_DEV(k, B_W),
                                 .num_tokens = d->in[k->rank].num_tokens,
                                 .recv_x = CR_DEV(k, B_RX), .recv_topk_idx = CR_DEV(k, B_RIDX),
                                 .recv_topk_weights = CR_DEV(k, B_RW),
                                 .recv_count_per_expert = CR_DEV(k, B_CNT), .num_recv = &nrecv};
  CALL(k, dep_dispatch(k->c, &da, k->h, k->s), "dep_dispatch (a rank masked)");
  return 0;
}

/* Every rank: a round; GR_RANK then detaches and attaches again in the same process and
 * client (refused as overtaken, tried again, as bench/elastic's replacement), the others
 * make the calls up to its first one; then every rank's rounds against the full oracle. */
static int body_rejoin(struct rk *k, void *arg) {
  struct gpu_rejoin *g = arg;
  const struct ow_case *d = g->full;
  uint64_t dig = 0, next = 0;
  if (cr_upload(k, d) || cr_round_tp(k, d, 0xA5, &dig))
    return 1;
  atomic_fetch_add(&g->first_done, 1);
  const uint64_t until = cr_ms_now() + GR_CEILING_MS;
  if (k->rank == GR_RANK) {
    while (atomic_load(&g->first_done) < k->W)
      if (cr_ms_now() > until)
        return ow_fail(k->msg, "rank %u: the others never ended their first round", k->rank);
    dep_handle_free(k->h);
    k->h = NULL;
    CALL(k, dep_detach(k->c), "dep_detach");
    int rc;
    uint32_t refused = 0;
    while ((rc = dep_attach(k->c, &k->args)) == DEP_ERR_STATE && refused < GR_TRIES)
      refused++;
    atomic_store(&g->refused, refused);
    CALL(k, rc, "dep_attach (the rank again)");
    CALL(k, dep_handle_new(k->c, &k->h), "dep_handle_new");
    CALL(k, dep_next_call(k->c, &next), "dep_next_call");
    atomic_store(&g->first, next);
  } else {
    uint64_t join;
    while ((join = atomic_load(&g->first)) == 0)
      if (cr_ms_now() > until)
        return ow_fail(k->msg, "rank %u: rank %u never came back", k->rank, GR_RANK);
    CALL(k, dep_next_call(k->c, &next), "dep_next_call");
    if (next > join)
      return ow_fail(k->msg, "rank %u: at call %llu, past rank %u's first call %llu", k->rank,
                     (unsigned long long)next, GR_RANK, (unsigned long long)join);
    for (; next < join; next++)
      if (gr_masked_call(k, d))
        return 1;
  }
  return cr_round_tp(k, d, 0x5A, &dig) || cr_round_ll(k, d, 0, 0x5A, &dig) ||
         cr_round_tp(k, d, 0x3C, &dig);
}

/*
 * On the cuda backend, an elastic job of 2 + 2 ranks on two daemons sharing the GPU: rank 1
 * (node 0) detaches after a round (masked; its ring and exchange region kept for it) and
 * attaches again in the same process and client.  Its first attach is refused as overtaken
 * by node 0, its second by node 1 (DEEPEPD_TEST_JOIN_OVERTAKEN), each undone on both; the
 * third brings it back, and from its first call every rank's outputs match the full oracle.
 * On the old library the kernels of the rank that came back counted their pushes to the
 * ring from 0 while the ring's head and tail stood where its first attach had left them:
 * the proxy read a head behind the tail, failed the job, and every rank's next call
 * timed out.
 */
START_TEST(on_the_gpu_a_rank_that_rejoins_across_daemons_pushes_on_from_its_rings_head) {
  CR_NEEDS_GPU();
  static const struct ow_scenario sc = {4, 2048, 8, 16, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I32,
                                        0};
  ow_seed_init(3100);
  struct ow_case *full = xn_case_new(&sc, 0);
  struct nodes ns;
  nodes_config_with(&ns, 2, 60000, ", op_timeout_ms: 10000", "");
  setenv("DEEPEPD_TEST_JOIN_OVERTAKEN", "1", 1); /* node 0 refuses the first attach itself */
  node_start(&ns, 0);
  setenv("DEEPEPD_TEST_JOIN_OVERTAKEN", "2", 1); /* node 1 the second (it answers both) */
  node_start(&ns, 1);
  unsetenv("DEEPEPD_TEST_JOIN_OVERTAKEN");
  nodes_wait_up(&ns);
  struct gpu_rejoin *g = mmap(NULL, sizeof *g, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                              -1, 0);
  ck_assert_ptr_ne(g, MAP_FAILED);
  memset(g, 0, sizeof *g);
  g->full = full;
  static const uint32_t split[NODES_MAX] = {2, 2};
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, split, ns.n);
  struct cr_place p = {.wait_all = false, .flags = DEP_ATTACH_ELASTIC};
  for (uint32_t r = 0; r < sc.world; r++) {
    p.sock[r] = ns.d[spread.node[r]].sock;
    p.local[r] = spread.local[r];
    p.lws[r] = spread.lws[r];
  }
  setenv(CUOPS_CTAS_ENV, "16", 1); /* as gpu_run: every rank's CTAs resident at once */
  struct cr_world w;
  cr_world_msgs(&w);
  static char fails[OW_FAILS_LEN];
  const int nfail = cr_run_procs_placed(&w, &p, "gpu-rejoin", &full->shape, sc.world,
                                        body_rejoin, g, fails, sizeof fails);
  cr_world_msgs_free(&w);
  for (int i = 0; nfail > 0 && i < ns.n; i++) {
    char cmd[700];
    printf("--- node %d: deepepd's log (last 40 lines)\n", i);
    fflush(stdout);
    dw_sfmt(cmd, sizeof cmd, "tail -n 40 %s", ns.d[i].log);
    if (system(cmd) != 0)
      printf("(tail failed)\n");
  }
  OW_ASSERT_NONE_FAILED("a rank that rejoins across daemons", nfail, fails);
  ck_assert_msg(atomic_load(&g->refused) == 2, "rank %u's attach was refused %u times, want 2 "
                "(once by each node)", GR_RANK, atomic_load(&g->refused));
  char line[64];
  snprintf(line, sizeof line, "is rank %u again, from call %llu ", GR_RANK,
           (unsigned long long)atomic_load(&g->first));
  ck_assert_msg(dw_log_has(&ns.d[0], line, 5000), "node 0's log lacks '%s'", line);
  printf("xnode gpu: rank %u back across daemons after %u refused attaches, from call %llu\n",
         GR_RANK, atomic_load(&g->refused), (unsigned long long)atomic_load(&g->first));
  munmap(g, sizeof *g);
  nodes_stop(&ns);
  xn_case_free(full);
}
END_TEST

/* ---- the first call pays no page faults in the daemons -------------------------- */

/* What the two ranks of the job share (MAP_SHARED): node i's deepepd, and what its
 * mappings of the exchange regions (memfds named deepepd-xchg) hold, in KiB. */
struct xchg_resident {
  pid_t daemon[2];
  uint64_t size_kib[2], rss_kib[2];
  int read[2];               /* 1: read; 0: /proc/pid/smaps could not be read */
};

/* The sizes and resident sizes of pid's mappings of exchange regions (smaps), summed. */
static int xchg_rss(pid_t pid, uint64_t *size_kib, uint64_t *rss_kib) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/smaps", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 0;
  bool in = false;
  *size_kib = *rss_kib = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long long v, lo, hi;
    char perms[8];
    if (sscanf(line, "%llx-%llx %7s", &lo, &hi, perms) == 3)
      in = strstr(line, "deepepd-xchg") != NULL; /* a mapping's first line */
    else if (in && sscanf(line, "Size: %llu kB", &v) == 1)
      *size_kib += v;
    else if (in && sscanf(line, "Rss: %llu kB", &v) == 1)
      *rss_kib += v;
  }
  fclose(f);
  return 1;
}

/* Each rank reads its node's daemon's mappings of the exchange regions once attached,
 * before any call, until they are all resident or 20 s have passed (a bound for a loaded
 * machine, not a timing: the daemon maps them on a thread of its own). */
static int xchg_resident_rank(dep_client_t *c, const struct xn_run *run, uint32_t rank,
                              struct xn_result *res) {
  struct xchg_resident *x = run->arg;
  for (int64_t until = xn_mono_ms() + 20000;; dw_sleep_ms(5)) {
    x->read[rank] = xchg_rss(x->daemon[rank], &x->size_kib[rank], &x->rss_kib[rank]);
    if (!x->read[rank] || x->rss_kib[rank] == x->size_kib[rank] || xn_mono_ms() > until)
      return 0;
  }
}

/*
 * When a job across nodes is attached, each daemon maps every page of its
 * ranks' rings and exchange regions into its own page tables, before their
 * first call: it does so once it makes the job's route (on a thread, off
 * its loop), as the rank's warm-up maps them into its own.  Before, the
 * daemon's mapping was left to fault in: its receivers writing the first
 * call of each parity into the in blocks took a fault for every page they
 * wrote (477 in such a job's first round here), which made the first calls
 * across nodes slower than later ones.
 */
START_TEST(a_jobs_exchange_regions_are_in_the_daemons_page_tables_before_its_first_call) {
  ow_seed_init(6200);
  /* Rows of 14 KiB, 64 a call: in blocks of hundreds of pages. */
  const struct ow_scenario sc = {2, 7168, 8, 16, 64, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS, "");
  struct xn_place pl;
  memset(&pl, 0, sizeof pl);
  const uint32_t split[NODES_MAX] = {1, 1};
  xn_place(&pl, split, 2);
  struct xchg_resident *x = mmap(NULL, sizeof *x, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(x, MAP_FAILED);
  memset(x, 0, sizeof *x);
  x->daemon[0] = ns.d[0].pid;
  x->daemon[1] = ns.d[1].pid;
  struct dep_slab_layout lay;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&d->shape, 2, 1, 0, &lay, why, sizeof why), 0);
  struct xn_result *res = xn_results(2);
  const struct xn_run run = {.d = d, .body = xchg_resident_rank, .arg = x};
  /* The second job of the shape is lent the regions the first one left cached, which the
   * daemon maps in no more (they stayed in its page tables): still every page. */
  static const char *const jobs[] = {"xchg-resident", "xchg-resident-again"};
  for (int k = 0; k < 2; k++) {
    memset(x, 0, sizeof *x);
    x->daemon[0] = ns.d[0].pid;
    x->daemon[1] = ns.d[1].pid;
    xn_run_job(&ns, &pl, jobs[k], &run, res);
    for (int i = 0; i < 2; i++) {
      ck_assert_msg(x->read[i], "node %d's daemon's smaps could not be read", i);
      printf("xnode: %s: node %d's daemon maps %llu of its exchange regions' %llu KiB at "
             "attach\n", jobs[k], i, (unsigned long long)x->rss_kib[i],
             (unsigned long long)x->size_kib[i]);
      ck_assert_msg(x->size_kib[i] * 1024 >= lay.xchg_bytes, "%s: node %d's daemon maps %llu KiB "
                    "of exchange regions, less than the job's one of %llu bytes", jobs[k], i,
                    (unsigned long long)x->size_kib[i], (unsigned long long)lay.xchg_bytes);
      ck_assert_msg(x->rss_kib[i] == x->size_kib[i], "%s: node %d's daemon has %llu of its "
                    "exchange regions' %llu KiB in its page tables 20 s after the attach: its "
                    "receivers fault in the rest on the first calls", jobs[k], i,
                    (unsigned long long)x->rss_kib[i], (unsigned long long)x->size_kib[i]);
    }
  }
  nodes_stop(&ns);
  munmap(res, 2 * sizeof *res);
  munmap(x, sizeof *x);
  xn_case_free(d);
}
END_TEST

Suite *xnode_suite(void);
Suite *xnode_suite(void) {
  Suite *s = suite_create("xnode");
  TCase *t = tcase_create("correct");
  tcase_set_timeout(t, 300);
  tcase_add_loop_test(t, a_job_across_nodes_gives_every_rank_what_it_gets_on_one_node, 0,
                      xn_nlayouts);
  tcase_add_test(t, a_thousand_calls_back_to_back_across_nodes_stay_as_on_one_node);
  tcase_add_test(t, a_restarted_job_gets_its_exchange_regions_back_and_another_uid_does_not);
  tcase_add_test(t, a_restarted_daemon_charges_the_exchange_region_a_rank_still_maps);
  tcase_add_test(t, a_jobs_exchange_regions_are_in_the_daemons_page_tables_before_its_first_call);
  suite_add_tcase(s, t);
  TCase *g = tcase_create("gpu");
  tcase_set_tags(g, "gpu");
  tcase_set_timeout(g, 240);
  tcase_add_loop_test(g, on_the_gpu_a_job_on_daemons_sharing_it_matches_the_oracle, 0,
                      (int)(sizeof gpu_layouts / sizeof gpu_layouts[0]));
  tcase_add_test(g, on_the_gpu_calls_across_daemons_read_each_calls_own_rows_as_inputs_change);
  tcase_add_test(g, on_the_gpu_a_lost_node_fails_the_survivors_within_the_op_timeout);
  tcase_add_test(g, on_the_gpu_a_ranks_own_daemon_killed_fails_it_with_daemon_gone_at_once);
  tcase_add_test(g, on_the_gpu_a_rank_that_rejoins_across_daemons_pushes_on_from_its_rings_head);
  suite_add_tcase(s, g);
  return s;
}
