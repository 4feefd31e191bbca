/*
 * xnjob.c — a job's rank processes over several daemons (xnjob.h).
 */
#include "xnjob.h"

#include <check.h>
#include <grp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "testutil.h"

const struct xn_layout xn_layouts[] = {
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
const int xn_nlayouts = (int)(sizeof xn_layouts / sizeof xn_layouts[0]);

/* dep_connect to sock and dep_attach as (rank, local_rank of lws) to job on c. */
static int xn_join(dep_client_t *c, const char *sock, const char *job, const struct ow_case *d,
                   uint32_t rank, uint32_t local_rank, uint32_t lws) {
  int rc = dep_connect(c, sock);
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = rank, .world_size = d->sc.world, .local_rank = local_rank,
                              .local_world_size = lws, .shape = d->shape};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  if (rc == 0)
    rc = dep_attach(c, &a);
  return rc;
}

/*
 * After a fault test's failing call: once the test says go (it has
 * restarted what it stopped and checked what came before; bounded, so a
 * test that failed first leaves no rank behind), join run->rejoin on the
 * same handle and run its rounds.  0, or the failure's code (msg says).
 */
static int xn_rejoin(dep_client_t *c, const char *sock, const struct xn_run *run, uint32_t rank,
                     uint32_t local_rank, uint32_t lws, struct ow_outs *o,
                     struct xn_result *res) {
  const int64_t until = xn_mono_ms() + 120000;
  while (!atomic_load(&res->go)) {
    if (xn_mono_ms() > until) {
      snprintf(res->rejoin_msg, sizeof res->rejoin_msg, "the test never said go");
      return 1;
    }
    dw_sleep_ms(5);
  }
  int rc = xn_join(c, sock, run->rejoin, run->d, rank, local_rank, lws);
  if (rc != 0) {
    snprintf(res->rejoin_msg, sizeof res->rejoin_msg, "attach of rank %u to %s: %s: %s", rank,
             run->rejoin, dep_errname(rc), dep_errmsg(c));
    return rc;
  }
  struct xn_result r;
  memset(&r, 0, sizeof r);
  for (uint32_t i = 0; i < run->rounds && rc == 0; i++)
    rc = xn_round(c, run->d, rank, run->d->sc.fp8, o, &r);
  snprintf(res->rejoin_msg, sizeof res->rejoin_msg, "%s", r.msg);
  if (rc == 0 && (rc = dep_detach(c)) != 0)
    snprintf(res->rejoin_msg, sizeof res->rejoin_msg, "dep_detach of %s: %s: %s", run->rejoin,
             dep_errname(rc), dep_errmsg(c));
  return rc;
}

/* A rank process: attach on sock as (rank, local_rank of lws), run, report. */
static void xn_rank_main(const char *sock, const char *job, const struct xn_run *run, uint32_t rank,
                         uint32_t local_rank, uint32_t lws, struct xn_result *res) {
  const struct ow_case *d = run->d;
  dep_client_t *c = NULL;
  if (run->uid != 0 && (setgroups(0, NULL) != 0 || setgid(run->uid) != 0 || setuid(run->uid) != 0))
    _exit(3);
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = xn_join(c, sock, job, d, rank, local_rank, lws);
  if (rc != 0) {
    snprintf(res->msg, sizeof res->msg, "attach of rank %u: %s: %s", rank, dep_errname(rc),
             c ? dep_errmsg(c) : "");
    res->rc = rc;
    atomic_store(&res->done, 1);
    _exit(1);
  }
  struct ow_outs o;
  ow_outs_alloc(&o, d);
  if (run->body != NULL)
    rc = run->body(c, run, rank, res);
  for (uint32_t i = 0; run->body == NULL && (run->until_error || i < run->rounds) && rc == 0;
       i++) {
    int fp8 = run->alternate_fp8 ? (int)(i & 1) : d->sc.fp8;
    if (run->slow_ms > 0 && rank == run->slow_rank)
      dw_sleep_ms((int)run->slow_ms);
    rc = xn_round(c, d, rank, fp8, &o, res);
    if (rc == 0 && run->modes)
      rc = xn_round_modes(c, d, rank, &o, res);
    if (rc == 0)
      atomic_fetch_add(&res->rounds, 1);
  }
  res->rc = rc;
  atomic_store(&res->done, 1);
  if (run->until_error && rc < 0) {
    struct xn_result later;
    memset(&later, 0, sizeof later);
    res->later_rc = xn_round(c, d, rank, d->sc.fp8, &o, &later);
  }
  int64_t t0 = xn_mono_ms();
  res->detach_rc = dep_detach(c);
  res->detach_ms = xn_mono_ms() - t0;
  atomic_store(&res->detached, 1);
  if (run->rejoin != NULL)
    rc = res->rejoin_rc = xn_rejoin(c, sock, run, rank, local_rank, lws, &o, res);
  ow_outs_free(&o);
  dep_client_free(c);
  _exit(rc == 0 ? 0 : 1);
}

struct ow_case *xn_case_new(const struct ow_scenario *sc, int fp8) {
  struct ow_case *d = malloc(sizeof *d);
  ck_assert_ptr_nonnull(d);
  ow_case_make(d, sc, fp8);
  return d;
}

void xn_case_free(struct ow_case *d) {
  ow_case_free(d);
  free(d);
}

void xn_nodes_start(struct nodes *ns, int n, int attach_timeout_ms, int op_timeout_ms,
                    const char *extra) {
  char limits[64];
  snprintf(limits, sizeof limits, ", op_timeout_ms: %d", op_timeout_ms);
  nodes_config_with(ns, n, attach_timeout_ms, limits, extra);
  nodes_start_all(ns);
}

/* Spread ranks over nodes in blocks: split[i] ranks on node i. */
void xn_place(struct xn_place *p, const uint32_t *split, int nodes) {
  uint32_t g = 0;
  for (int i = 0; i < nodes; i++)
    for (uint32_t l = 0; l < split[i]; l++, g++) {
      p->node[g] = (uint32_t)i;
      p->local[g] = l;
      p->lws[g] = split[i];
    }
}

/* Fork every rank; returns their pids (results in res[]). */
void xn_spawn(const struct nodes *ns, const struct xn_place *p, const char *job,
              const struct xn_run *run, struct xn_result *res, pid_t *pids) {
  xn_spawn_node(ns, p, job, run, res, pids, -1);
}

/* Fork the ranks placed on node (every rank: -1); pids[] of the others untouched. */
void xn_spawn_node(const struct nodes *ns, const struct xn_place *p, const char *job,
                   const struct xn_run *run, struct xn_result *res, pid_t *pids, int node) {
  for (uint32_t g = 0; g < run->d->sc.world; g++) {
    if (node >= 0 && p->node[g] != (uint32_t)node)
      continue;
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
bool xn_reap(pid_t *pids, uint32_t n, int timeout_ms) {
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

void xn_await_rounds(const struct xn_result *res, uint32_t g, uint32_t rounds, int ceiling_ms) {
  for (int t = 0; t < ceiling_ms && atomic_load(&res[g].rounds) < rounds &&
                  !atomic_load(&res[g].done); t += 5)
    dw_sleep_ms(5);
  ck_assert_msg(atomic_load(&res[g].rounds) >= rounds, "the job did not run %u rounds: %s",
                rounds, res[g].msg);
}

struct xn_result *xn_results(uint32_t n) {
  struct xn_result *r = mmap(NULL, n * sizeof *r, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(r, MAP_FAILED);
  memset(r, 0, n * sizeof *r);
  return r;
}

/* Run the job placed as p (nodes of ns) and fail the test with every failing rank's message. */
void xn_run_job(const struct nodes *ns, const struct xn_place *p, const char *job,
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

/* deepepctl's output on node i (status or peers, --json) into out. */
void xn_ctl_json_at(const struct nodes *ns, int i, const char *what, char *out, size_t len) {
  char cmd[700];
  dw_sfmt(cmd, sizeof cmd, "%s -s %s %s --json", tu_bin("deepepctl"), ns->d[i].sock, what);
  FILE *f = popen(cmd, "r");
  ck_assert_ptr_nonnull(f);
  size_t got = fread(out, 1, len - 1, f);
  out[got] = '\0';
  ck_assert_int_eq(pclose(f), 0);
}

void xn_ctl_json(const struct nodes *ns, const char *what, char *out, size_t len) {
  xn_ctl_json_at(ns, 0, what, out, len);
}
