/*
 * check_xnode_faults.c — faults of jobs that span nodes (DESIGN §7), on
 * real daemons on 127.0.0.1 that are each other's peers (nodes.h) and real
 * rank processes (xnjob.h): a data connection cut while its link stays
 * comes back; a remote rank or a remote daemon killed while the job runs,
 * or the link between two daemons in two network namespaces taken down
 * (root only), fails every survivor's call within the op timeout, and the
 * daemons carry on; a rank's own daemon killed or restarted fails it at
 * once with DEP_ERR_DAEMON_GONE, and its job can be joined again.
 */
#include <check.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "nodes.h"
#include "opsworld.h"
#include "peer.h"
#include "testhooks.h"
#include "testutil.h"
#include "xfer.h"
#include "xnjob.h"
#include "xnround.h"

/* ---- faults ---------------------------------------------------------------------- */

/* A job of d's world placed over `nodes` nodes as split runs 2 rounds as job
 * (xn_run_job fails the test otherwise). */
static void run_two_rounds(const struct nodes *ns, const uint32_t *split, int nodes,
                           const struct ow_case *d, const char *job) {
  struct xn_place p;
  memset(&p, 0, sizeof p);
  xn_place(&p, split, nodes);
  struct xn_run run = {.d = d, .rounds = 2};
  struct xn_result *r = xn_results(d->sc.world);
  xn_run_job(ns, &p, job, &run, r);
  munmap(r, d->sc.world * sizeof *r);
}

/*
 * Spawn job `job` of 2 + 2 ranks on ns as run says (placed in *p, pids in
 * pids), its results in a fresh xn_results(4), returned once rank watch
 * has run 20 rounds (the test fails where it has not within 20 s).
 */
static struct xn_result *spawn_2_plus_2_running(const struct nodes *ns, struct xn_place *p,
                                                const char *job, const struct xn_run *run,
                                                pid_t *pids, uint32_t watch) {
  memset(p, 0, sizeof *p);
  const uint32_t split[NODES_MAX] = {2, 2};
  xn_place(p, split, 2);
  struct xn_result *res = xn_results(4);
  xn_spawn(ns, p, job, run, res, pids);
  xn_await_rounds(res, watch, 20, 20000);
  return res;
}

/*
 * A data connection cut while its peer link stays up comes back: each
 * daemon closes its first inbound data connection as soon as it is opened
 * ($DEEPEPD_TEST_DATA_DROPS=1, daemon/testhooks.h); within a few of the
 * loop's ticks both nodes have their three connections each way again
 * (connection_pool_size 2 and the control lane; the listener offers a
 * token for the missing one, the opener replaces the cut one), and a job
 * across them runs.
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
      xn_ctl_json_at(&ns, i, "peers", out, sizeof out);
      back = strstr(out, "\"data_out\":3,\"data_in\":3") != NULL;
      if (!back)
        dw_sleep_ms(50);
    }
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_msg(strstr(log, "inbound data connection closed at once") != NULL,
                  "node %d cut no data connection:\n%s", i, log);
    ck_assert_msg(back, "node %d: not three connections each way 10 s after one was cut: %s"
                  "\n%s", i, out, log);
    ck_assert_msg(strstr(log, "offering new ones") != NULL, "node %d offered none:\n%s", i, log);
    free(log);
  }
  ow_seed_init(61);
  const struct xn_layout *L = &xn_layouts[2]; /* 2 + 2 ranks */
  struct ow_case *d = xn_case_new(&L->sc, L->sc.fp8);
  run_two_rounds(&ns, L->split, L->nodes, d, "after-the-cut");
  printf("xnode: a data connection cut while its link stayed came back on both nodes; a job "
         "ran across them\n");
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

/* The CPUs the traffic check's daemons count as theirs ($DEEPEPD_TEST_CPUS). */
#define XF_CPUS 16u
#define XF_CPUS_STR "16"

/*
 * A running job's traffic shows: per peer (deepepctl peers) and per job
 * (status): connection_pool_size 2 data connections and the control lane
 * each way, and the proxy threads proxy_threads 0 gives a host daemon that counts
 * XF_CPUS CPUs ($DEEPEPD_TEST_CPUS, as on a larger machine: more than one thread, where the
 * old default gave one, taking the host backend's one device for a GPU).  A peer's second
 * data connection may still be opening while the
 * first carries the job (each one proves the key in a round trip of its own,
 * which takes long on a loaded machine), so the count is waited for, up to
 * 20 s, a bound far above any handshake.
 */
static void expect_traffic(const struct nodes *ns) {
  char out[16384], threads[48];
  ck_assert_uint_gt(xfer_proxy_threads_default(0, XF_CPUS), 1);
  snprintf(threads, sizeof threads, "\"proxy_threads\":%u",
           xfer_proxy_threads_default(0, XF_CPUS));
  for (int waited = 0;; waited += 50) {
    xn_ctl_json(ns, "peers", out, sizeof out);
    if (strstr(out, "\"data_out\":3,\"data_in\":3") != NULL || waited >= 20000)
      break;
    dw_sleep_ms(50);
  }
  ck_assert_msg(strstr(out, "\"data_out\":3,\"data_in\":3") != NULL &&
                strstr(out, threads) != NULL &&
                strstr(out, "\"data_frames_out\":0") == NULL, "peers: %s", out);
  xn_ctl_json(ns, "status", out, sizeof out);
  const char *j = strstr(out, "\"job_id\":\"doomed\"");
  ck_assert_msg(j != NULL && strstr(j, "\"bytes_out\":0,") == NULL &&
                strstr(j, "\"bytes_in\":0,") == NULL && strstr(j, "\"ring_peak\":") != NULL,
                "status: %s", out);
}

/* The bytes the daemon's pools lend (used) or charge to processes (held): 0 once no job is
 * left on it. */
static uint64_t pool_bytes(const struct tu_daemon *dm) {
  int fd = dw_client(dm);
  struct dep_status *st = dw_status(fd);
  uint64_t n = 0;
  for (uint32_t i = 0; i < st->num_devices; i++)
    n += st->devices[i].pool_used_bytes + st->devices[i].pool_held_bytes;
  dep_status_free(st);
  close(fd);
  return n;
}

/*
 * A job of 2 + 2 ranks runs until a call fails; after some rounds the test
 * kills (what 0) a rank on node 1, or (what 1) node 1's daemon and its
 * ranks, or (what 2) takes the veth between the two nodes down while
 * every daemon and rank lives.  Every survivor on node 0 fails within the
 * op timeout with DEP_ERR_PEER or DEP_ERR_TIMEOUT, and a new job on node 0
 * runs.  The veth then comes back: a job that is not elastic failed when it
 * dropped and a returning link does nothing to it (an elastic job's split
 * is settled then: check_elastic_ops's split case), so both daemons are
 * alive with nothing of it left, and a new job over both runs.
 */
static void kill_mid_run(int what) {
  ow_seed_init(90 + (uint64_t)what);
  struct ow_scenario sc = {4, 128, 2, 8, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct nodes ns;
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", XN_OP_TIMEOUT_MS);
  if (what == 2) {
    const char *why = nodes_config_netns(&ns, 20000, limits, "");
    if (why != NULL) {
      tu_skip("a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout", "%s", why);
      xn_case_free(d);
      return;
    }
  } else {
    nodes_config_with(&ns, 2, 20000, limits, "");
  }
  if (what == 0)
    setenv(TESTHOOK_CPUS_ENV, XF_CPUS_STR, 1); /* expect_traffic's proxy threads */
  nodes_start_all(&ns);
  unsetenv(TESTHOOK_CPUS_ENV);
  struct xn_run run = {.d = d, .until_error = true};
  struct xn_place p;
  pid_t pids[OW_MAXW];
  struct xn_result *res = spawn_2_plus_2_running(&ns, &p, "doomed", &run, pids, 0);
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
    /* A remote rank's pid is not known here: the message names none, not "pid 0". */
    ck_assert_msg(strstr(res[g].msg, "(pid 0)") == NULL, "rank %u: %s", g, res[g].msg);
    /* A wait for another node that timed out points at the daemons and the link too. */
    ck_assert_msg(res[g].rc != DEP_ERR_TIMEOUT || strstr(res[g].msg, "deepepctl peers") != NULL,
                  "rank %u: %s", g, res[g].msg);
    printf("xnode: %s: rank %u failed after %lld ms with %s\n",
           what == 0 ? "a remote rank killed" : what == 1 ? "the remote daemon killed"
                                                          : "the veth taken down",
           g, (long long)after, dep_errname(res[g].rc));
  }
  /* The survivors' daemon reclaims the job; a new one-node job runs there. */
  if (what == 1)
    ns.d[1].pid = 0;
  const uint32_t all[NODES_MAX] = {4};
  run_two_rounds(&ns, all, 1, d, "after");
  if (what == 2) {
    ck_assert_int_eq(nodes_sh("ip -n %s link set dv%da up", ns.net.ns[0], (int)getpid()), 0);
    /* A ceiling, not a timing: the links reconnect after their backoff (up to a few seconds
     * after a link that was down this long, longer on a loaded machine). */
    const int64_t until = xn_mono_ms() + 60000;
    bool up = false;
    while (!(up = node_sees_all(&ns, 0) && node_sees_all(&ns, 1)) && xn_mono_ms() < until)
      dw_sleep_ms(100);
    ck_assert_msg(up, "the nodes did not link again within 60 s of the veth coming back");
    for (int i = 0; i < 2; i++) {
      ck_assert_msg(kill(ns.d[i].pid, 0) == 0, "node %d's daemon is gone", i);
      uint64_t left = 0;
      for (int t = 0; t < 200 && (left = pool_bytes(&ns.d[i])) != 0; t++)
        dw_sleep_ms(50);
      ck_assert_msg(left == 0, "node %d still lends or charges %llu bytes", i,
                    (unsigned long long)left);
    }
    const uint32_t split[NODES_MAX] = {2, 2};
    run_two_rounds(&ns, split, 2, d, "again");
  }
  munmap(res, 4 * sizeof *res);
  nodes_stop(&ns);
  xn_case_free(d);
}

/*
 * A bound far below the op timeout of the next test (60 s) that a loaded
 * machine (and ASan) keeps: a rank learns its daemon is gone from its
 * control connection's close, within milliseconds, and the other node's
 * from the peer link's; a rank that waited out the op timeout, as before,
 * is far past it.
 */
#define XN_GONE_BOUND_MS 10000
#define XN_GONE_OP_TIMEOUT_MS 60000

/*
 * A rank's own daemon goes while a job across nodes runs: node 1's daemon
 * is killed (SIGKILL), or stopped (SIGTERM) and started again at once.  The
 * job's blocks between the nodes went through it, so its ranks (1 of 2 + 2)
 * fail with DEP_ERR_DAEMON_GONE saying so within XN_GONE_BOUND_MS — they
 * learn it from their control connection's close, not the op timeout —
 * and so does their next call, and their dep_detach returns within the
 * bound too; node 0's ranks fail with DEP_ERR_PEER (their daemon's peer
 * link dropped).  Then a job across both daemons runs: after the SIGTERM
 * in the same rank processes, which connect and attach again to the
 * restarted daemon; after the SIGKILL, once node 1 is started again, in new
 * ones.  (A job on one node is not failed by its daemon's restart at all:
 * check_lifecycle's a_sigterm_leaves_running_jobs_computing and
 * a_sigkill_leaves_running_jobs_computing.)
 */
static void own_daemon_goes_mid_run(int sig) {
  ow_seed_init(95 + (uint64_t)sig);
  struct ow_scenario sc = {4, 128, 2, 8, 8, 8, P_RANDOM, T_MAX, DEP_INDEX_I64, 0};
  struct ow_case *d = xn_case_new(&sc, 0);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_GONE_OP_TIMEOUT_MS, "");
  struct xn_run run = {.d = d, .until_error = true, .rounds = 2,
                       .rejoin = sig == SIGTERM ? "rejoined" : NULL};
  struct xn_place p;
  pid_t pids[OW_MAXW];
  struct xn_result *res = spawn_2_plus_2_running(&ns, &p, "goes", &run, pids, 2);
  const int64_t killed = xn_mono_ms();
  kill(ns.d[1].pid, sig);
  int st = tu_daemon_wait_exit(&ns.d[1], 10000);
  ck_assert_msg(st != -1, "node 1's deepepd did not exit on signal %d", sig);
  if (sig == SIGTERM)
    node_start(&ns, 1); /* systemctl restart: the new daemon at once, beside the ranks */
  /* Bounded by 3 x the bound, well below the op timeout, so the old
   * behaviour (waiting it out) fails here rather than hanging the test. */
  for (uint32_t g = 0; g < 4; g++) {
    for (int t = 0; t < 3 * XN_GONE_BOUND_MS && !atomic_load(&res[g].detached); t += 5)
      dw_sleep_ms(5);
    ck_assert_msg(atomic_load(&res[g].detached), "rank %u had not failed and detached %d ms "
                  "after node 1's daemon got signal %d (op timeout %d ms): %s", g,
                  3 * XN_GONE_BOUND_MS, sig, XN_GONE_OP_TIMEOUT_MS,
                  atomic_load(&res[g].done) ? res[g].msg : "still in its call");
  }
  for (uint32_t g = 0; g < 4; g++) {
    const bool own = p.node[g] == 1;
    const int want = own ? DEP_ERR_DAEMON_GONE : DEP_ERR_PEER;
    const int64_t after = res[g].fail_ms - killed;
    ck_assert_msg(res[g].rc == want, "rank %u (node %u): %s, want %s: %s", g, p.node[g],
                  dep_errname(res[g].rc), dep_errname(want), res[g].msg);
    ck_assert_msg(after <= XN_GONE_BOUND_MS, "rank %u failed %lld ms after the signal (bound "
                  "%d ms, op timeout %d ms): %s", g, (long long)after, XN_GONE_BOUND_MS,
                  XN_GONE_OP_TIMEOUT_MS, res[g].msg);
    ck_assert_msg(res[g].detach_ms <= XN_GONE_BOUND_MS, "rank %u's dep_detach took %lld ms",
                  g, (long long)res[g].detach_ms);
    if (own) {
      ck_assert_msg(strstr(res[g].msg, "deepepd on this node stopped or restarted") != NULL &&
                    strstr(res[g].msg, "dep_connect and dep_attach") != NULL, "rank %u: %s", g,
                    res[g].msg);
      ck_assert_msg(res[g].later_rc == DEP_ERR_DAEMON_GONE, "rank %u's next call: %s", g,
                    dep_errname(res[g].later_rc));
      ck_assert_msg(res[g].detach_rc == DEP_ERR_DAEMON_GONE, "rank %u's dep_detach: %s", g,
                    dep_errname(res[g].detach_rc));
    } else {
      ck_assert_msg(res[g].detach_rc == 0, "rank %u's dep_detach: %s", g,
                    dep_errname(res[g].detach_rc));
    }
    printf("xnode: node 1's daemon got signal %d: rank %u (node %u) failed after %lld ms with "
           "%s; dep_detach took %lld ms\n", sig, g, p.node[g], (long long)after,
           dep_errname(res[g].rc), (long long)res[g].detach_ms);
  }
  if (sig == SIGTERM) {
    nodes_wait_up(&ns);
    for (uint32_t g = 0; g < 4; g++)
      atomic_store(&res[g].go, 1);
    bool ok = xn_reap(pids, 4, 120000);
    for (uint32_t g = 0; g < 4; g++)
      ck_assert_msg(res[g].rejoin_rc == 0, "rank %u attached again after the restart: %s: %s",
                    g, dep_errname(res[g].rejoin_rc), res[g].rejoin_msg);
    ck_assert(ok);
  } else {
    xn_reap(pids, 4, 10000); /* every rank exits 1: its call failed, as it must */
    node_start(&ns, 1);
    nodes_wait_up(&ns);
    const uint32_t split[NODES_MAX] = {2, 2};
    run_two_rounds(&ns, split, 2, d, "after");
  }
  munmap(res, 4 * sizeof *res);
  nodes_stop(&ns);
  xn_case_free(d);
}

START_TEST(sigkill_of_a_ranks_own_daemon_fails_it_with_daemon_gone_at_once) {
  own_daemon_goes_mid_run(SIGKILL);
}
END_TEST

START_TEST(a_restart_of_a_ranks_own_daemon_fails_it_with_daemon_gone_and_it_attaches_again) {
  own_daemon_goes_mid_run(SIGTERM);
}
END_TEST

START_TEST(sigkill_of_a_remote_rank_fails_the_others_within_the_op_timeout) { kill_mid_run(0); }
END_TEST

START_TEST(sigkill_of_a_remote_daemon_fails_the_others_within_the_op_timeout) { kill_mid_run(1); }
END_TEST

/* Two daemons in two network namespaces; the veth between them goes down mid-run. */
START_TEST(a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout) { kill_mid_run(2); }
END_TEST

/* ---- frames of a job the receiver forgot ---------------------------------------- */

/* What the test and its lingering rank say to each other, in shared memory. */
struct lingerer {
  _Atomic int ready;  /* the rank ran its first round with its peer */
  _Atomic int go;     /* the test: call on, the peer gone */
  _Atomic int stop;   /* the test: detach */
  _Atomic int calls;  /* rounds it started after go */
  struct xn_result res;
};

/* Rank 0 of job id on node 0: one round with its peer, then, told to, it
 * calls on (each call sends its blocks for rank 1, whose node ended the
 * job, and waits out the op timeout) until told to stop. */
static void linger_main(const struct nodes *ns, const char *id, const struct ow_case *d,
                        struct lingerer *l) {
  dep_client_t *c = NULL;
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, ns->d[0].sock);
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = d->sc.world,
                              .local_rank = 0, .local_world_size = 1, .shape = d->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", id);
  if (rc == 0)
    rc = dep_attach(c, &a);
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  if (rc == 0)
    rc = xn_round(c, d, 0, d->sc.fp8, &o, &l->res);
  l->res.rc = rc;
  atomic_store(&l->ready, 1);
  if (rc != 0)
    _exit(1);
  while (!atomic_load(&l->go) && !atomic_load(&l->stop))
    dw_sleep_ms(5);
  while (!atomic_load(&l->stop)) {
    atomic_fetch_add(&l->calls, 1);
    (void)xn_round(c, d, 0, d->sc.fp8, &o, &l->res); /* times out: rank 1 is gone */
  }
  ow_outs_free(&o);
  dep_detach(c);
  dep_client_free(c);
  _exit(0);
}

/*
 * The data path kept awake, as where the daemon serves GPUs (xfer_internal.h
 * XFER_SPIN_GPU_NS: proxy threads look for work, and each receiver for its
 * connection's next frame, yielding, for a window after their last): the
 * host backend's receivers block at once, so $DEEPEPD_TEST_AWAKE_US gives
 * these daemons a window (20 ms) and the looking receivers run here, under
 * ThreadSanitizer too (make tsan).  Jobs over three daemons and over two,
 * streaming in 3-row chunks (many frames, and credits on the control
 * lane), get every op right against the oracle, each daemon saying its
 * windows; then a daemon killed while a job runs over it, with the path
 * awake, fails the survivors' calls within the op timeout, as asleep.
 */
START_TEST(a_data_path_kept_awake_gets_every_op_right_and_sees_a_daemon_die) {
  setenv("DEEPEPD_TEST_AWAKE_US", "20000", 1);
  struct nodes ns;
  nodes_config_with(&ns, 3, 20000, ", op_timeout_ms: 8000", "stream_chunk_rows: 3\n");
  nodes_start_all(&ns);
  ow_seed_init(4400);
  const int layouts[] = {7, 6, 2}; /* 2 + 2 + 2 and 1 + 1 + 1 over three daemons, 2 + 2 */
  for (int i = 0; i < 3; i++) {
    const struct xn_layout *L = &xn_layouts[layouts[i]];
    struct ow_case *d = xn_case_new(&L->sc, L->sc.fp8);
    char job[32];
    snprintf(job, sizeof job, "awake-%d", i);
    run_two_rounds(&ns, L->split, L->nodes, d, job);
    xn_case_free(d);
  }
  for (int i = 0; i < 3; i++) {
    char *log = tu_daemon_log(&ns.d[i]);
    ck_assert_msg(strstr(log, "proxy threads look for work 20000 us after their last, receivers "
                              "for a frame 20000 us after their last") != NULL,
                  "node %d: not awake:\n%s", i, log);
    free(log);
  }
  nodes_stop(&ns);
  kill_mid_run(1);
  unsetenv("DEEPEPD_TEST_AWAKE_US");
  printf("xnode: a data path kept awake ran jobs right over three daemons and two, and a "
         "daemon killed under it failed its peers' calls\n");
}
END_TEST

/*
 * A receiver remembered the last 64 jobs that ended, and waited 5 s for
 * the route of any other: a frame of an older one (a rank kept attached on
 * node 0 after its peer on node 1 detached, then 70 short jobs) held node
 * 1's data connection for 5 s, and another uid's job, whose blocks came
 * behind it, timed out.  A receiver now waits only for a job whose ranks
 * there have all attached and announced it: the forgotten job's frames are
 * dropped at once (and said), and the other job's calls all return within
 * the op timeout.
 */
START_TEST(frames_of_a_forgotten_job_are_dropped_at_once_and_stall_no_other_job) {
  ow_seed_init(71);
  const struct xn_layout *L = &xn_layouts[0]; /* 1 + 1 ranks */
  struct ow_case *d = xn_case_new(&L->sc, L->sc.fp8);
  struct nodes ns;
  xn_nodes_start(&ns, 2, 20000, XN_OP_TIMEOUT_MS, "allow: {any_user: true}\n");
  for (int i = 0; i < 2; i++)
    chmod(ns.d[i].dir, 0755); /* uid 65534 reaches the sockets */
  struct xn_place p;
  memset(&p, 0, sizeof p);
  xn_place(&p, L->split, L->nodes);
  /* The job that lingers on node 0, its rank 1 on node 1 gone after a round. */
  struct lingerer *l = mmap(NULL, sizeof *l, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                          -1, 0);
  ck_assert_ptr_ne(l, MAP_FAILED);
  memset(l, 0, sizeof *l);
  fflush(stdout);
  pid_t lp = fork();
  ck_assert_int_ge(lp, 0);
  if (lp == 0)
    linger_main(&ns, "forgotten", d, l);
  struct xn_run one = {.d = d, .rounds = 1};
  struct xn_result *r = xn_results(2);
  pid_t pids[OW_MAXW];
  xn_spawn_node(&ns, &p, "forgotten", &one, r, pids, 1);
  ck_assert_msg(xn_reap(&pids[1], 1, 60000), "rank 1: %s", r[1].msg);
  for (int t = 0; t < 60000 && !atomic_load(&l->ready); t += 5)
    dw_sleep_ms(5);
  ck_assert_msg(atomic_load(&l->ready) && l->res.rc == 0, "rank 0: %s", l->res.msg);
  /* 70 short jobs across both nodes end after it: node 1 forgets it. */
  struct xn_run none = {.d = d, .rounds = 0};
  for (int i = 0; i < 70; i++) {
    char id[32];
    snprintf(id, sizeof id, "short-%d", i);
    memset(r, 0, 2 * sizeof *r);
    xn_run_job(&ns, &p, id, &none, r);
  }
  /* Its rank calls on: its blocks for rank 1 reach node 1. */
  atomic_store(&l->go, 1);
  for (int t = 0; t < 10000 && atomic_load(&l->calls) < 1; t += 5)
    dw_sleep_ms(5);
  /* Another uid's job across the same nodes: every call returns within
   * the op timeout (xn_round fails it otherwise), while forgotten frames
   * keep coming. */
  struct xn_run other = {.d = d, .rounds = 40, .uid = geteuid() == 0 ? 65534 : 0};
  xn_run_job(&ns, &p, "other-uid", &other, r);
  const int calls = atomic_load(&l->calls);
  atomic_store(&l->stop, 1);
  int st = 0;
  ck_assert_int_eq(waitpid(lp, &st, 0), lp);
  char *log = tu_daemon_log(&ns.d[1]);
  ck_assert_msg(strstr(log, "frame(s) of jobs that do not run here dropped") != NULL,
                "node 1 did not say it dropped the forgotten job's frames:\n%s", log);
  ck_assert_msg(strstr(log, "does not run here after") == NULL, "node 1 waited:\n%s", log);
  /* Every job it gathered was expected (nothing here is short of memory). */
  ck_assert_msg(strstr(log, "to expect its frames") == NULL, "node 1:\n%s", log);
  free(log);
  printf("xnode: frames of a forgotten job (%d calls) were dropped at once; another uid's job "
         "ran 40 rounds beside them\n", calls);
  munmap(r, 2 * sizeof *r);
  munmap(l, sizeof *l);
  nodes_stop(&ns);
  xn_case_free(d);
}
END_TEST

/*
 * Two daemons started together that stall together as soon as they see
 * each other up, for longer than PEER_DEAD_MS (as the making of both
 * daemons' pools stalled their loops on a loaded machine; here a SIGSTOP
 * of both, held for PEER_DEAD_MS + 1 s: the fault's length, not a wait for
 * anything), keep their links and data connections: each counts the
 * links' silence from the end of its own stall.  A job of 4 + 4 ranks then
 * runs its first round well within its op timeout (half of it, a ceiling
 * for a loaded machine: a round takes milliseconds once the data
 * connections are there), and neither log has a link dropped as dead or a
 * data connection refused.  Twice over.  Before, each daemon took its own
 * stall for the other's death and dropped every link; the offers of data
 * connections under way were withdrawn with them, their connections
 * refused as naming a token "this daemon did not offer", and the far end,
 * which still counted those connectors, ignored the offers made once the
 * links were back, so that a job's first call waited 10 s (XFER_OFFER_MS)
 * for its data connections, or failed with DEP_ERR_TIMEOUT.
 */
START_TEST(two_daemons_stalled_together_as_they_link_keep_links_and_data_connections) {
  enum { OP_MS = 20000, REPS = 2 };
  ow_seed_init(67);
  const struct xn_layout *L = &xn_layouts[xn_nlayouts - 1]; /* 4 + 4 ranks */
  ck_assert_int_eq(L->sc.world, 8);
  struct ow_case *d = xn_case_new(&L->sc, L->sc.fp8);
  for (int rep = 0; rep < REPS; rep++) {
    struct nodes ns;
    xn_nodes_start(&ns, 2, 20000, OP_MS, "");
    for (int i = 0; i < 2; i++)
      ck_assert_int_eq(kill(ns.d[i].pid, SIGSTOP), 0);
    dw_sleep_ms(PEER_DEAD_MS + 1000);
    for (int i = 0; i < 2; i++)
      ck_assert_int_eq(kill(ns.d[i].pid, SIGCONT), 0);
    nodes_wait_up(&ns);
    struct xn_place p;
    memset(&p, 0, sizeof p);
    xn_place(&p, L->split, L->nodes);
    struct xn_run run = {.d = d, .rounds = 1};
    struct xn_result *r = xn_results(d->sc.world);
    const int64_t t0 = xn_mono_ms();
    xn_run_job(&ns, &p, "stalled-together", &run, r);
    const int64_t took = xn_mono_ms() - t0;
    munmap(r, d->sc.world * sizeof *r);
    for (int i = 0; i < 2; i++) {
      char *log = tu_daemon_log(&ns.d[i]);
      const bool stalled = strstr(log, "the loop ran no tick") != NULL;
      const bool dead = strstr(log, "dead peer") != NULL;
      const bool refused = strstr(log, "did not offer") != NULL;
      if (!stalled || dead || refused)
        fprintf(stderr, "node %d's log:\n%s\n", i, log);
      free(log);
      ck_assert_msg(stalled, "node %d saw no stall", i);
      ck_assert_msg(!dead, "node %d dropped a link as dead (its log above)", i);
      ck_assert_msg(!refused, "node %d refused a data connection (its log above)", i);
    }
    ck_assert_msg(took < OP_MS / 2, "repetition %d: the job's round took %lld ms", rep,
                  (long long)took);
    nodes_stop(&ns);
  }
  printf("xnode: two daemons stalled together as they linked kept their links; a job's first "
         "round ran at once, %d times\n", REPS);
  xn_case_free(d);
}
END_TEST

Suite *xnode_faults_suite(void);
Suite *xnode_faults_suite(void) {
  Suite *s = suite_create("xnode_faults");
  TCase *f = tcase_create("faults");
  tcase_set_timeout(f, 120);
  tcase_add_test(f, a_data_connection_cut_while_its_link_stays_comes_back);
  tcase_add_test(f, sigkill_of_a_remote_rank_fails_the_others_within_the_op_timeout);
  tcase_add_test(f, sigkill_of_a_remote_daemon_fails_the_others_within_the_op_timeout);
  tcase_add_test(f, a_link_taken_down_mid_run_fails_every_rank_within_the_op_timeout);
  tcase_add_test(f, frames_of_a_forgotten_job_are_dropped_at_once_and_stall_no_other_job);
  tcase_add_test(f, a_data_path_kept_awake_gets_every_op_right_and_sees_a_daemon_die);
  tcase_add_test(f, sigkill_of_a_ranks_own_daemon_fails_it_with_daemon_gone_at_once);
  tcase_add_test(f, a_restart_of_a_ranks_own_daemon_fails_it_with_daemon_gone_and_it_attaches_again);
  suite_add_tcase(s, f);
  TCase *st = tcase_create("stall");
  tcase_set_timeout(st, 120);
  tcase_add_test(st, two_daemons_stalled_together_as_they_link_keep_links_and_data_connections);
  suite_add_tcase(s, st);
  return s;
}
