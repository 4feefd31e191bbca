/*
 * check_xnode.c — operations of jobs that span nodes (DESIGN §7): real
 * daemons on 127.0.0.1 that are each other's peers (nodes.h), real rank
 * processes on the public API, random inputs from a printed seed
 * (opsworld.h).  Every rank checks what it can against the oracle (counts,
 * sums) and folds everything it received into a digest; the same job run
 * with every rank on one daemon must give every rank the same digest, bit
 * for bit.  Then the faults: a remote rank or a remote daemon killed while
 * the job runs, or the link between two daemons in two network namespaces
 * taken down (root only), fails every survivor's call within the op
 * timeout, and the daemons carry on.  Tagged gpu (make check-gpu): the
 * same kind of job on the cuda backend, two or three daemons sharing one
 * machine's GPU over TCP on loopback (the kernels' exchange region and
 * ring in host memory, which the daemons read and write with no CUDA
 * call), held against the oracle.
 */
#include <check.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ops.h"
#include "cudaranks.h"
#include "cudarounds.h"
#include "daemonwire.h"
#include "host_ops.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "slab.h"
#include "testutil.h"
#include "xnround.h"
#include "xring.h"

#define XN_ROUNDS_MAX 250
#define XN_OP_TIMEOUT_MS 4000

struct xn_run {
  const struct ow_case *d;
  uint32_t rounds;           /* rounds of layout, dispatch, combine, LL dispatch, LL combine */
  bool alternate_fp8;        /* LL dispatch's FP8 on in odd rounds */
  bool until_error;          /* fault tests: go on until a call fails */
  uid_t uid;                 /* 0: the test's own; else the ranks run as it (root only) */
};

/* A rank process: attach on sock as (rank, local_rank of lws), run, report. */
static void xn_rank_main(const char *sock, const char *job, const struct xn_run *run, uint32_t rank,
                         uint32_t local_rank, uint32_t lws, struct xn_result *res) {
  const struct ow_case *d = run->d;
  dep_client_t *c = NULL;
  if (run->uid != 0 && (setgroups(0, NULL) != 0 || setgid(run->uid) != 0 || setuid(run->uid) != 0))
    _exit(3);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = rank, .world_size = d->sc.world, .local_rank = local_rank,
                              .local_world_size = lws, .shape = d->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  if (rc == 0)
    rc = dep_attach(c, &a);
  if (rc != 0) {
    snprintf(res->msg, sizeof res->msg, "attach of rank %u: %s: %s", rank, dep_errname(rc),
             c ? dep_errmsg(c) : "");
    res->rc = rc;
    atomic_store(&res->done, 1);
    _exit(1);
  }
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  for (uint32_t i = 0; (run->until_error || i < run->rounds) && rc == 0; i++) {
    int fp8 = run->alternate_fp8 ? (int)(i & 1) : d->sc.fp8;
    rc = xn_round(c, d, rank, fp8, &o, res);
    if (rc == 0)
      atomic_fetch_add(&res->rounds, 1);
  }
  ow_outs_free(&o);
  res->rc = rc;
  atomic_store(&res->done, 1);
  dep_detach(c);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 1);
}

/* Where each global rank runs: node, local rank, and the node's rank count. */
struct xn_place {
  uint32_t node[OW_MAXW], local[OW_MAXW], lws[OW_MAXW];
};

/* Spread ranks over nodes in blocks: split[i] ranks on node i. */
static void xn_place(struct xn_place *p, const uint32_t *split, int nodes) {
  uint32_t g = 0;
  for (int i = 0; i < nodes; i++)
    for (uint32_t l = 0; l < split[i]; l++, g++) {
      p->node[g] = (uint32_t)i;
      p->local[g] = l;
      p->lws[g] = split[i];
    }
}

/* Fork every rank; returns their pids (results in res[]). */
static void xn_spawn(const struct nodes *ns, const struct xn_place *p, const char *job,
                     const struct xn_run *run, struct xn_result *res, pid_t *pids) {
  for (uint32_t g = 0; g < run->d->sc.world; g++) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
      xn_rank_main(ns->d[p->node[g]].sock, job, run, g, p->local[g], p->lws[g], &res[g]);
    pids[g] = pid;
  }
}

/* Wait for every rank, killing all after timeout_ms; true when all exited 0. */
static bool xn_reap(pid_t *pids, uint32_t n, int timeout_ms) {
  int64_t until = xn_mono_ms() + timeout_ms;
  bool ok = true;
  for (uint32_t g = 0; g < n; g++) {
    int st = 0;
    for (;;) {
      pid_t w = waitpid(pids[g], &st, WNOHANG);
      if (w == pids[g])
        break;
      if (xn_mono_ms() > until) {
        for (uint32_t k = 0; k < n; k++)
          kill(pids[k], SIGKILL);
        waitpid(pids[g], &st, 0);
        ok = false;
        break;
      }
      dw_sleep_ms(5);
    }
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  return ok;
}

static struct xn_result *xn_results(uint32_t n) {
  struct xn_result *r = mmap(NULL, n * sizeof *r, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(r, MAP_FAILED);
  memset(r, 0, n * sizeof *r);
  return r;
}

/* Run the job placed as p (nodes of ns) and fail the test with every failing rank's message. */
static void xn_run_job(const struct nodes *ns, const struct xn_place *p, const char *job,
                       const struct xn_run *run, struct xn_result *res) {
  pid_t pids[OW_MAXW];
  uint32_t n = run->d->sc.world;
  xn_spawn(ns, p, job, run, res, pids);
  bool ok = xn_reap(pids, n, 120000);
  char all[4 * OW_MSG] = "";
  for (uint32_t g = 0; g < n; g++)
    if (res[g].rc != 0 || !res[g].done)
      snprintf(all + strlen(all), sizeof all - strlen(all), "\n  rank %u: %s", g,
               res[g].done ? res[g].msg : "did not finish");
  ck_assert_msg(ok, "job %s (seed %llu): ranks failed:%s", job, (unsigned long long)ow_seed, all);
}

/* ---- correctness: across nodes as on one node ------------------------------------ */

struct xn_layout {
  struct ow_scenario sc;
  int nodes;
  uint32_t split[NODES_MAX];
};

static const struct xn_layout layouts[] = {
  /* world hidden topk experts max_tokens max_ll routing tokens index fp8;  nodes, split */
  {{2, 128, 2, 4, 16, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0}, 2, {1, 1}},
  {{2, 2048, 8, 8, 16, 16, P_RANDOM, T_MIXED, DEP_INDEX_I32, 1}, 2, {1, 1}},
  {{4, 128, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 2, {2, 2}},
  {{4, 2048, 8, 32, 16, 16, P_ONE_RANK, T_MAX, DEP_INDEX_I64, 1}, 2, {3, 1}},
  {{4, 128, 8, 16, 16, 16, P_NONE, T_MAX, DEP_INDEX_I32, 0}, 2, {1, 3}},
  {{4, 128, 2, 8, 16, 16, P_RANDOM, T_ZERO, DEP_INDEX_I64, 1}, 2, {2, 2}},
  {{3, 128, 8, 12, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I64, 0}, 3, {1, 1, 1}},
  {{6, 2048, 16, 18, 8, 8, P_DUP, T_MIXED, DEP_INDEX_I32, 1}, 3, {2, 2, 2}},
  {{8, 7168, 8, 16, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I32, 1}, 2, {4, 4}},
};

START_TEST(a_job_across_nodes_gives_every_rank_what_it_gets_on_one_node) {
  const struct xn_layout *L = &layouts[_i];
  ow_seed_init(1000 + (uint64_t)_i);
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", XN_OP_TIMEOUT_MS * 4);
  nodes_config_with(&ns, L->nodes, 20000, limits, "");
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
  printf("xnode: %s over %d nodes: every rank as on one node\n", d->desc, L->nodes);
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
  const struct xn_layout *L = &layouts[2]; /* 2 + 2 ranks */
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
  const struct xn_layout *Q = &layouts[8]; /* 4 + 4 ranks */
  struct ow_case *q = malloc(sizeof *q);
  ck_assert_ptr_nonnull(q);
  ow_case_make(q, &Q->sc, Q->sc.fp8);
  const uint32_t qn = Q->sc.world, lws = Q->split[0];
  struct dep_slab_layout l;
  char why[256];
  ck_assert_int_eq(dep__slab_layout_nodes(&q->shape, qn, lws, &l, why, sizeof why), 0);
  const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  const uint64_t stride = (l.total_bytes + 65535) / 65536 * 65536;
  const uint64_t arena = (lws * stride + page - 1) / page * page;
  const uint64_t region = DEP_XRING_BYTES + l.xchg_bytes;
  const uint64_t quota = (arena + region + 1023) / 1024; /* KiB: under the arenas and two */
  ck_assert_uint_ge(quota, 2048);
  char limits[128];
  snprintf(limits, sizeof limits, ", op_timeout_ms: 8000, memory_per_uid: %lluKiB",
           (unsigned long long)quota);
  nodes_config_with(&ns, 2, 20000, limits, "");
  nodes_start_all(&ns);
  struct xn_place qp;
  memset(&qp, 0, sizeof qp);
  xn_place(&qp, Q->split, Q->nodes);
  struct xn_run qrun = {.d = q, .rounds = 1};
  struct xn_result *r4 = xn_results(qn);
  pid_t pids[OW_MAXW];
  xn_spawn(&ns, &qp, "over-quota", &qrun, r4, pids);
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
  ck_assert_int_eq(dep__slab_layout_nodes(&shape, 2, 1, &l, why, sizeof why), 0);
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

/* deepepctl's output on node i (status or peers, --json) into out. */
static void ctl_json_at(const struct nodes *ns, int i, const char *what, char *out, size_t len) {
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s %s --json", tu_bin("deepepctl"), ns->d[i].sock, what);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  size_t got = fread(out, 1, len - 1, f);
  out[got] = '\0';
  ck_assert_int_eq(pclose(f), 0);
}

static void ctl_json(const struct nodes *ns, const char *what, char *out, size_t len) {
  ctl_json_at(ns, 0, what, out, len);
}

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
 * Run fn in rank processes of job on the GPU, world ranks placed over ns's
 * daemons in blocks of split (xn_place): how many failed, their messages in
 * fails.  When any did, each daemon's log tail and peers are shown (for a
 * failure on a machine one cannot log into).  Every rank's SM budget is
 * DEEPEP_KERNEL_CTAS=16: every CTA of a rank's call must be resident at
 * once (cuda_ops.h), and each daemon shares the GPU out among the ranks it
 * holds, not knowing those of the others here (one daemon per node is the
 * design): three ranks alone on three daemons took 96 CTAs each, more than
 * an H200 holds under MPS, and the last one's grid barrier waited for CTAs
 * that never started.  16 each keeps 8 ranks on 128 CTAs.
 */
static int gpu_run(const struct nodes *ns, const uint32_t *split, const char *job,
                   const struct ow_case *d, cr_rank_body fn, void *arg, bool wait_all,
                   char *fails, size_t len) {
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, split, ns->n);
  struct cr_place p = {.wait_all = wait_all};
  for (uint32_t g = 0; g < d->sc.world; g++) {
    p.sock[g] = ns->d[spread.node[g]].sock;
    p.local[g] = spread.local[g];
    p.lws[g] = spread.lws[g];
  }
  setenv(CUOPS_CTAS_ENV, "16", 1);
  struct cr_world w;
  cr_world_msgs(&w);
  int nfail = cr_run_procs_placed(&w, &p, job, &d->shape, d->sc.world, fn, arg, fails, len);
  cr_world_msgs_free(&w);
  for (int i = 0; nfail > 0 && i < ns->n; i++) {
    char cmd[700];
    printf("--- node %d: deepepd's log (last 60 lines), then deepepctl peers\n", i);
    fflush(stdout);
    dw_sfmt(cmd, sizeof cmd, "tail -n 60 %s; %s -s %s peers", ns->d[i].log, tu_bin("deepepctl"),
            ns->d[i].sock);
    if (system(cmd) != 0)
      printf("(deepepctl peers failed)\n");
  }
  return nfail;
}

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
  int nfail = gpu_run(&ns, L->split, job, d, cr_body_rounds, &a, false, fails, sizeof fails);
  OW_ASSERT_NONE_FAILED(d->desc, nfail, fails);
  char out[16384];
  ctl_json(&ns, "peers", out, sizeof out);
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
  int nfail = gpu_run(&ns, split, "gpu-change", d, cr_body_rounds, &a, false, fails,
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

/* What the ranks of the lost-node test share. */
struct gpu_loss {
  const struct ow_case *d;
  pid_t victim;        /* node 1's daemon */
  uint32_t first_gone; /* node 1's first rank: it kills the daemon */
  int kill_round;
};

/* Rounds until a call fails.  Node 1's ranks stop at kill_round, the first
 * of them killing its daemon first: node 1 is lost with its ranks.  A
 * failure's message ends with the round and how long its round took. */
static int body_until_node_lost(struct rk *k, void *arg) {
  const struct gpu_loss *g = arg;
  for (int round = 0; round < 100000; round++) {
    if (k->rank >= g->first_gone && round == g->kill_round) {
      if (k->rank == g->first_gone)
        kill(g->victim, SIGKILL);
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
  return ow_fail(k->msg, "rank %u: 100000 rounds and no failure: node 1's loss was not seen",
                 k->rank);
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
  ow_seed_init(77);
  struct ow_scenario sc = {4, 2048, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &sc, 0);
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", OP_MS);
  nodes_config_with(&ns, 2, 60000, limits, "");
  nodes_start_all(&ns);
  const uint32_t split[NODES_MAX] = {2, 2};
  struct gpu_loss g = {.d = d, .victim = ns.d[1].pid, .first_gone = 2, .kill_round = 4};
  static char fails[OW_FAILS_LEN];
  int nfail = gpu_run(&ns, split, "gpu-loss", d, body_until_node_lost, &g, true, fails,
                      sizeof fails);
  ns.d[1].pid = 0; /* killed: nodes_stop must not wait for it */
  ck_assert_msg(nfail == 2, "not just node 0's two ranks failed (%d did):%s", nfail, fails);
  const char *at = fails;
  for (int r = 0; r < 2; r++) {
    char tag[32];
    snprintf(tag, sizeof tag, "rank %d: ", r);
    const char *m = strstr(at, tag);
    ck_assert_msg(m != NULL, "rank %d did not fail:%s", r, fails);
    const char *end = strstr(m + 1, "\n  rank ");
    char one[OW_MSG + 32];
    snprintf(one, sizeof one, "%.*s", end ? (int)(end - m) : (int)strlen(m), m);
    ck_assert_msg(strstr(one, "DEP_ERR_PEER") != NULL || strstr(one, "DEP_ERR_TIMEOUT") != NULL,
                  "rank %d failed otherwise: %s", r, one);
    const char *after = strstr(one, ", after ");
    unsigned long long ms = after ? strtoull(after + 8, NULL, 10) : ~0ull;
    ck_assert_msg(ms <= OP_MS + 5000, "rank %d took %llu ms to fail, past the op timeout: %s", r,
                  ms, one);
    printf("xnode gpu: node 1 lost: %s\n", one);
  }
  char out[16384];
  ctl_json(&ns, "status", out, sizeof out);
  /* A job on node 0 alone runs after the loss. */
  struct ow_scenario sc2 = {2, 2048, 8, 16, 32, 16, P_RANDOM, T_MAX, DEP_INDEX_I32, 0};
  struct ow_case *d2 = malloc(sizeof *d2);
  ck_assert_ptr_nonnull(d2);
  ow_case_make(d2, &sc2, 0);
  struct nodes one = ns;
  one.n = 1;
  const uint32_t all[NODES_MAX] = {2};
  struct cr_rounds a = {d2, 1, 2};
  nfail = gpu_run(&one, all, "gpu-after-loss", d2, cr_body_rounds, &a, false, fails,
                  sizeof fails);
  ck_assert_msg(nfail == 0, "a job on node 0 after node 1's loss failed:%s", fails);
  printf("xnode gpu: node 0 ran a new job after node 1's loss\n");
  nodes_stop(&ns);
  ow_case_free(d2);
  free(d2);
  ow_case_free(d);
  free(d);
}
END_TEST

/* ---- faults ---------------------------------------------------------------------- */

/*
 * A data connection cut while its peer link stays up comes back: each
 * daemon closes its first inbound data connection as soon as it is opened
 * ($DEEPEPD_TEST_DATA_DROPS=1, xfer_internal.h); within a few of the
 * loop's ticks both nodes have their two data connections each way again
 * (the listener offers a token for the missing one, the opener replaces
 * the cut one), and a job across them runs.
 */
START_TEST(a_data_connection_cut_while_its_link_stays_comes_back) {
  setenv("DEEPEPD_TEST_DATA_DROPS", "1", 1);
  struct nodes ns;
  nodes_config_with(&ns, 2, 20000, ", op_timeout_ms: 8000", "");
  nodes_start_all(&ns);
  unsetenv("DEEPEPD_TEST_DATA_DROPS");
  char out[16384];
  for (int i = 0; i < 2; i++) {
    bool back = false;
    for (int t = 0; t < 200 && !back; t++) {
      ctl_json_at(&ns, i, "peers", out, sizeof out);
      back = strstr(out, "\"data_out\":2,\"data_in\":2") != NULL;
      if (!back)
        dw_sleep_ms(50);
    }
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_msg(strstr(log, "inbound data connection closed at once") != NULL,
                  "node %d cut no data connection:\n%s", i, log);
    ck_assert_msg(back, "node %d: not two data connections each way 10 s after one was cut: %s"
                  "\n%s", i, out, log);
    ck_assert_msg(strstr(log, "offering new ones") != NULL, "node %d offered none:\n%s", i, log);
    free(log);
  }
  ow_seed_init(61);
  const struct xn_layout *L = &layouts[2]; /* 2 + 2 ranks */
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, &L->sc, L->sc.fp8);
  struct xn_place spread;
  memset(&spread, 0, sizeof spread);
  xn_place(&spread, L->split, L->nodes);
  struct xn_result *r = xn_results(L->sc.world);
  struct xn_run run = {.d = d, .rounds = 2};
  xn_run_job(&ns, &spread, "after-the-cut", &run, r);
  printf("xnode: a data connection cut while its link stayed came back on both nodes; a job "
         "ran across them\n");
  munmap(r, L->sc.world * sizeof *r);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}
END_TEST

/* A running job's traffic shows: per peer (deepepctl peers) and per job (status). */
static void expect_traffic(const struct nodes *ns) {
  char out[16384];
  ctl_json(ns, "peers", out, sizeof out);
  ck_assert_msg(strstr(out, "\"data_out\":2,\"data_in\":2") != NULL &&
                strstr(out, "\"proxy_threads\":1") != NULL &&
                strstr(out, "\"data_frames_out\":0") == NULL, "peers: %s", out);
  ctl_json(ns, "status", out, sizeof out);
  const char *j = strstr(out, "\"job_id\":\"doomed\"");
  ck_assert_msg(j != NULL && strstr(j, "\"bytes_out\":0,") == NULL &&
                strstr(j, "\"bytes_in\":0,") == NULL && strstr(j, "\"ring_peak\":") != NULL,
                "status: %s", out);
}

/*
 * A job of 2 + 2 ranks runs until a call fails; after some rounds the test
 * kills (what 0) a rank on node 1, or (what 1) node 1's daemon and its
 * ranks.  Every survivor on node 0 fails within the op timeout with
 * DEP_ERR_PEER or DEP_ERR_TIMEOUT, and a new job on node 0 runs.
 */
static void kill_mid_run(int what) {
  ow_seed_init(90 + (uint64_t)what);
  struct ow_scenario sc = {4, 128, 2, 8, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_case *d = malloc(sizeof *d);
  ow_case_make(d, &sc, 0);
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", XN_OP_TIMEOUT_MS);
  if (what == 2) {
    const char *why = nodes_config_netns(&ns, 20000, limits, "");
    if (why != NULL) {
      tu_skip("a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout", "%s", why);
      ow_case_free(d);
      free(d);
      return;
    }
  } else {
    nodes_config_with(&ns, 2, 20000, limits, "");
  }
  nodes_start_all(&ns);
  struct xn_run run = {.d = d, .until_error = true};
  struct xn_place p;
  memset(&p, 0, sizeof p);
  uint32_t split[NODES_MAX] = {2, 2};
  xn_place(&p, split, 2);
  struct xn_result *res = xn_results(4);
  pid_t pids[OW_MAXW];
  xn_spawn(&ns, &p, "doomed", &run, res, pids);
  for (int t = 0; t < 20000 && atomic_load(&res[0].rounds) < 20; t += 5) {
    if (atomic_load(&res[0].done))
      break;
    dw_sleep_ms(5);
  }
  ck_assert_msg(atomic_load(&res[0].rounds) >= 20, "the job did not run 20 rounds: %s",
                res[0].msg);
  if (what == 0)
    expect_traffic(&ns);
  int64_t killed = xn_mono_ms();
  if (what == 0) {
    kill(pids[3], SIGKILL);
  } else if (what == 2) {
    ck_assert_int_eq(nodes_sh("ip -n %s link set dv%da down", ns.net.ns[0], (int)getpid()), 0);
    /* Down once ip has returned, which takes seconds on a loaded machine: the
     * bound runs from there (a call waiting then started no later). */
    killed = xn_mono_ms();
  } else {
    kill(ns.d[1].pid, SIGKILL);
    kill(pids[2], SIGKILL);
    kill(pids[3], SIGKILL);
  }
  bool ok = xn_reap(pids, 4, XN_OP_TIMEOUT_MS * 3);
  (void)ok; /* the survivors exit 1: their call failed, as it must */
  for (uint32_t g = 0; g < (what == 2 ? 4u : 2u); g++) {
    ck_assert_msg(atomic_load(&res[g].done), "rank %u hung after the fault", g);
    ck_assert_msg(res[g].rc == DEP_ERR_PEER || res[g].rc == DEP_ERR_TIMEOUT,
                  "rank %u: %s, want DEP_ERR_PEER or DEP_ERR_TIMEOUT: %s", g,
                  dep_errname(res[g].rc), res[g].msg);
    int64_t after = res[g].fail_ms - killed;
    ck_assert_msg(after <= XN_OP_TIMEOUT_MS + 1500, "rank %u failed %lld ms after the kill, over "
                  "the op timeout of %d ms: %s", g, (long long)after, XN_OP_TIMEOUT_MS,
                  res[g].msg);
    printf("xnode: %s: rank %u failed after %lld ms with %s\n",
           what == 0 ? "a remote rank killed" : what == 1 ? "the remote daemon killed"
                                                          : "the veth taken down",
           g, (long long)after, dep_errname(res[g].rc));
  }
  /* The survivors' daemon reclaims the job; a new one-node job runs there. */
  if (what == 1)
    ns.d[1].pid = 0;
  struct xn_place one;
  memset(&one, 0, sizeof one);
  uint32_t all[NODES_MAX] = {4};
  xn_place(&one, all, 1);
  struct xn_run again = {.d = d, .rounds = 2};
  struct xn_result *r2 = xn_results(4);
  xn_run_job(&ns, &one, "after", &again, r2);
  munmap(res, 4 * sizeof *res);
  munmap(r2, 4 * sizeof *r2);
  nodes_stop(&ns);
  ow_case_free(d);
  free(d);
}

START_TEST(sigkill_of_a_remote_rank_fails_the_others_within_the_op_timeout) { kill_mid_run(0); }
END_TEST

START_TEST(sigkill_of_a_remote_daemon_fails_the_others_within_the_op_timeout) { kill_mid_run(1); }
END_TEST

/* Two daemons in two network namespaces; the veth between them goes down mid-run. */
START_TEST(a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout) { kill_mid_run(2); }
END_TEST


/* ---- the ring, with no proxy: a rank of world 2 whose peer is on another node ------ */

struct ring_rank {
  struct dep_job_shape s;
  struct dep_slab_layout lay;
  uint8_t *slab;
  struct dep_xring *ring;
  struct ops_ctx c;
};

static void ring_rank_open(struct ring_rank *r, uint32_t timeout_ms) {
  memset(r, 0, sizeof *r);
  r->s = (struct dep_job_shape){.max_tokens_per_rank = 4, .hidden = 128, .num_experts = 4,
                                .topk = 2, .dtype = DEP_DTYPE_BF16};
  char why[256];
  ck_assert_msg(dep__slab_layout_nodes(&r->s, 2, 1, &r->lay, why, sizeof why) == 0, "%s", why);
  ck_assert_uint_eq(r->lay.n_remote, 1);
  ck_assert_uint_gt(r->lay.xchg_bytes, 0);
  r->slab = aligned_alloc(4096, dep_round_up(r->lay.total_bytes, 4096));
  r->ring = aligned_alloc(4096, DEP_XRING_BYTES + r->lay.xchg_bytes);
  ck_assert(r->slab != NULL && r->ring != NULL);
  memset(r->slab, 0, r->lay.total_bytes);
  memset(r->ring, 0, DEP_XRING_BYTES + r->lay.xchg_bytes);
  r->ring->magic = DEP_XRING_MAGIC;
  r->ring->version = DEP_XRING_VERSION;
  r->ring->entries = DEP_XRING_ENTRIES;
  r->ring->xchg_bytes = r->lay.xchg_bytes;
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS] = {r->slab, NULL};
  ck_assert_msg(host_ops_init_nodes(&r->c, &r->s, 2, 0, slabs, r->ring, timeout_ms, why,
                                    sizeof why) == 0, "%s", why);
}

static void ring_rank_close(struct ring_rank *r) {
  host_ops_fini(&r->c);
  free(r->slab);
  free(r->ring);
}

/* One token to rank 1 (experts 2 and 3 are its). */
static int ring_dispatch(struct ring_rank *r, dep_handle_t *h, uint16_t *x) {
  static int64_t idx[2] = {2, 3};
  static float w[2] = {0.5f, 0.25f};
  static uint16_t rx[8 * 128];
  static int32_t ridx[8 * 2], cnt[2];
  static float rw[8 * 2];
  static uint32_t nrecv;
  struct dep_dispatch_args a = {.size = sizeof a, .x = x, .topk_idx = idx,
                                .index_type = DEP_INDEX_I64, .topk_weights = w, .num_tokens = 1,
                                .recv_x = rx, .recv_topk_idx = ridx, .recv_topk_weights = rw,
                                .recv_count_per_expert = cnt, .num_recv = &nrecv};
  return host_ops_dispatch(&r->c, &a, h);
}

/* The block for the remote rank goes to the out block of the exchange region (after the
 * ring, not the slab), its slot image to the out slot, one descriptor after. */
START_TEST(a_block_for_a_remote_rank_is_an_out_block_a_slot_image_and_a_descriptor) {
  struct ring_rank r;
  ring_rank_open(&r, 100);
  dep_handle_t h;
  host_ops_handle_init(&h);
  uint16_t x[128];
  for (int i = 0; i < 128; i++)
    x[i] = (uint16_t)(0x3f00 + i);
  ck_assert_int_eq(ring_dispatch(&r, &h, x), DEP_ERR_TIMEOUT); /* no proxy: rank 1 never posts */
  ck_assert_uint_eq(atomic_load(&r.ring->head), 1);
  const struct dep_xring_desc *d = &r.ring->desc[0];
  ck_assert_uint_eq(d->dest, 1);
  ck_assert_uint_eq(d->parity, 1);
  ck_assert_uint_eq(d->seq, 1);
  ck_assert_uint_eq(d->bytes, r.lay.row_bytes);
  uint8_t *xchg = dep_xring_xchg(r.ring);
  const struct ops_slot *sl = (const struct ops_slot *)(xchg + dep_slab_out_slot(&r.lay, 1, 0));
  ck_assert_uint_eq(atomic_load(&sl->flag), 1);
  ck_assert_uint_eq(sl->rows, 1);
  ck_assert_uint_eq(sl->op, OPS_OP_DISPATCH);
  ck_assert_int_eq(memcmp(xchg + dep_slab_out_block(&r.lay, 1, 0), x, sizeof x), 0);
  /* Rank 1 has no slab here, and no byte for it went into ours: the slab's
   * data area past rank 0's own blocks is as it was. */
  for (uint64_t o = dep_slab_block(&r.lay, 0, 1); o < r.lay.data_off + 2 * r.lay.parity_bytes; o++)
    if (o < dep_slab_block(&r.lay, 1, 0) || o >= dep_slab_block(&r.lay, 1, 1))
      ck_assert_uint_eq(r.slab[o], 0);
  host_ops_handle_fini(&h);
  ring_rank_close(&r);
}
END_TEST

/*
 * What the remote rank sent is read from the in slot and in block of the
 * exchange region, as the daemon writes them there: a combine's vector
 * from rank 1, written (block, then slot, flag last) before the call, is
 * summed into rank 0's output; the same bytes in rank 1's slot and block
 * of the slab are not looked at.
 */
START_TEST(a_block_from_a_remote_rank_is_read_from_the_in_block_and_in_slot) {
  struct ring_rank r;
  ring_rank_open(&r, 2000);
  dep_handle_t h;
  host_ops_handle_init(&h);
  uint16_t x[128];
  for (int i = 0; i < 128; i++)
    x[i] = (uint16_t)(0x3f80 + i); /* 1.0, 1.0078, ... */
  /* Rank 1's part of the dispatch (call 1, parity 1): no rows for rank 0. */
  uint8_t *xchg = dep_xring_xchg(r.ring);
  struct ops_slot *in = (struct ops_slot *)(xchg + dep_slab_in_slot(&r.lay, 1, 0));
  in->rows = 0;
  in->op = OPS_OP_DISPATCH;
  in->num_tokens = 0;
  atomic_store_explicit(&in->flag, 1, memory_order_release);
  ck_assert_int_eq(ring_dispatch(&r, &h, x), 0);
  ck_assert_uint_eq(h.recv_from[1], 0);
  ck_assert_uint_eq(h.recv_from[0], 0);
  ck_assert_uint_eq(atomic_load(&r.ring->head), 1);
  /* The combine (call 2, parity 0): rank 1 sends back its vector for our token. */
  uint16_t back[128];
  for (int i = 0; i < 128; i++)
    back[i] = 0x4000; /* 2.0 */
  memcpy(xchg + dep_slab_in_block(&r.lay, 0, 0), back, sizeof back);
  in = (struct ops_slot *)(xchg + dep_slab_in_slot(&r.lay, 0, 0));
  in->rows = 1;
  in->op = OPS_OP_COMBINE;
  in->ref_seq = 1;
  in->num_tokens = 0;
  atomic_store_explicit(&in->flag, 2, memory_order_release);
  /* A decoy in the slab where a local rank 1 would have written. */
  struct ops_slot *decoy = (struct ops_slot *)(r.slab + dep_slab_ctrl_slot(&r.lay, 0, 1));
  decoy->rows = 7;
  uint16_t out[128];
  struct dep_combine_args ca = {.size = sizeof ca, .x = x, .out = out};
  ck_assert_msg(host_ops_combine(&r.c, &ca, &h) == 0, "%s", r.c.why);
  for (int i = 0; i < 128; i++)
    ck_assert_uint_eq(out[i], 0x4000);
  host_ops_handle_fini(&h);
  ring_rank_close(&r);
}
END_TEST

/* A ring the proxy does not drain: the call waits, bounded, and overwrites nothing. */
START_TEST(a_full_ring_is_a_bounded_wait_that_overwrites_nothing) {
  struct ring_rank r;
  ring_rank_open(&r, 300);
  for (uint32_t i = 0; i < DEP_XRING_ENTRIES; i++)
    r.ring->desc[i] = (struct dep_xring_desc){.dest = 7, .parity = 0, .seq = 1000 + i};
  atomic_store(&r.ring->head, DEP_XRING_ENTRIES); /* tail 0: full */
  dep_handle_t h;
  host_ops_handle_init(&h);
  uint16_t x[128] = {0};
  int64_t t0 = xn_mono_ms();
  ck_assert_int_eq(ring_dispatch(&r, &h, x), DEP_ERR_TIMEOUT);
  int64_t waited = xn_mono_ms() - t0;
  ck_assert_msg(waited >= 290 && waited < 3000, "waited %lld ms for a 300 ms bound",
                (long long)waited);
  ck_assert_msg(strstr(r.c.why, "ring stayed full") != NULL, "%s", r.c.why);
  ck_assert_uint_eq(atomic_load(&r.ring->head), DEP_XRING_ENTRIES);
  for (uint32_t i = 0; i < DEP_XRING_ENTRIES; i++)
    ck_assert_uint_eq(r.ring->desc[i].seq, 1000 + i);
  struct ops_err_record er;
  host_ops_err_read(r.slab, &er);
  ck_assert_int_eq(atomic_load(&er.code), DEP_ERR_TIMEOUT);
  ck_assert_uint_eq(er.source, 1);
  /* The context is broken: the ranks are out of step. */
  ck_assert_int_eq(ring_dispatch(&r, &h, x), DEP_ERR_STATE);
  host_ops_handle_fini(&h);
  ring_rank_close(&r);
}
END_TEST

/* A ring the proxy stopped serving (its job failed): the call fails at once with its code. */
START_TEST(a_ring_the_proxy_stopped_fails_the_call_at_once) {
  struct ring_rank r;
  ring_rank_open(&r, 5000);
  atomic_store(&r.ring->failed, DEP_ERR_PEER);
  dep_handle_t h;
  host_ops_handle_init(&h);
  uint16_t x[128] = {0};
  int64_t t0 = xn_mono_ms();
  ck_assert_int_eq(ring_dispatch(&r, &h, x), DEP_ERR_PEER);
  ck_assert_int_lt(xn_mono_ms() - t0, 1000);
  ck_assert_msg(strstr(r.c.why, "stopped serving this rank") != NULL, "%s", r.c.why);
  ck_assert_uint_eq(atomic_load(&r.ring->head), 0);
  host_ops_handle_fini(&h);
  ring_rank_close(&r);
}
END_TEST

/* A remote rank needs a ring, and a ring must be this rank's. */
START_TEST(init_refuses_a_remote_rank_without_a_ring_and_a_ring_of_another_rank) {
  struct ring_rank r;
  ring_rank_open(&r, 100);
  char why[256] = "";
  uint8_t *slabs[DEP_MAX_LOCAL_RANKS] = {r.slab, NULL};
  struct ops_ctx c;
  ck_assert_int_eq(host_ops_init_nodes(&c, &r.s, 2, 0, slabs, NULL, 100, why, sizeof why),
                   DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "slab of rank 1 is not mapped") != NULL, "%s", why);
  r.ring->rank = 1;
  ck_assert_int_eq(host_ops_init_nodes(&c, &r.s, 2, 0, slabs, r.ring, 100, why, sizeof why),
                   DEP_ERR_INVALID);
  ck_assert_msg(strstr(why, "not one for rank 0") != NULL, "%s", why);
  ring_rank_close(&r);
}
END_TEST

Suite *xnode_suite(void);
Suite *xnode_suite(void) {
  Suite *s = suite_create("xnode");
  TCase *r = tcase_create("ring");
  tcase_add_test(r, a_block_for_a_remote_rank_is_an_out_block_a_slot_image_and_a_descriptor);
  tcase_add_test(r, a_block_from_a_remote_rank_is_read_from_the_in_block_and_in_slot);
  tcase_add_test(r, a_full_ring_is_a_bounded_wait_that_overwrites_nothing);
  tcase_add_test(r, a_ring_the_proxy_stopped_fails_the_call_at_once);
  tcase_add_test(r, init_refuses_a_remote_rank_without_a_ring_and_a_ring_of_another_rank);
  suite_add_tcase(s, r);
  TCase *t = tcase_create("correct");
  tcase_set_timeout(t, 300);
  tcase_add_loop_test(t, a_job_across_nodes_gives_every_rank_what_it_gets_on_one_node, 0,
                      (int)(sizeof layouts / sizeof layouts[0]));
  tcase_add_test(t, a_thousand_calls_back_to_back_across_nodes_stay_as_on_one_node);
  tcase_add_test(t, a_restarted_job_gets_its_exchange_regions_back_and_another_uid_does_not);
  tcase_add_test(t, a_restarted_daemon_charges_the_exchange_region_a_rank_still_maps);
  suite_add_tcase(s, t);
  TCase *f = tcase_create("faults");
  tcase_set_timeout(f, 120);
  tcase_add_test(f, a_data_connection_cut_while_its_link_stays_comes_back);
  tcase_add_test(f, sigkill_of_a_remote_rank_fails_the_others_within_the_op_timeout);
  tcase_add_test(f, sigkill_of_a_remote_daemon_fails_the_others_within_the_op_timeout);
  tcase_add_test(f, a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout);
  suite_add_tcase(s, f);
  TCase *g = tcase_create("gpu");
  tcase_set_tags(g, "gpu");
  tcase_set_timeout(g, 240);
  tcase_add_loop_test(g, on_the_gpu_a_job_on_daemons_sharing_it_matches_the_oracle, 0,
                      (int)(sizeof gpu_layouts / sizeof gpu_layouts[0]));
  tcase_add_test(g, on_the_gpu_calls_across_daemons_read_each_calls_own_rows_as_inputs_change);
  tcase_add_test(g, on_the_gpu_a_lost_node_fails_the_survivors_within_the_op_timeout);
  suite_add_tcase(s, g);
  return s;
}
