/*
 * check_lifecycle.c — what a job's ranks live through (DESIGN §13, §5): the
 * daemon stopping or dying under a running job, a new daemon beside them,
 * a rank dying mid-operation.  Real daemons, real rank processes linking
 * the library, on the host backend.
 *
 * The ranks run throughput dispatch and combine with top-1 routing, so
 * that every token comes back from exactly one rank and combine must give
 * back the dispatched rows bit for bit: any scrub, relend or lost flag
 * under them shows as a wrong word, a timeout or an error code.
 */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "slab.h"
#include "testutil.h"

#define LC_W 2
#define LC_TOKENS 16u
#define LC_HIDDEN 128u

static const struct dep_job_shape LC_SHAPE = {
    .max_tokens_per_rank = LC_TOKENS, .hidden = LC_HIDDEN, .num_experts = LC_W, .topk = 1,
    .dtype = DEP_DTYPE_BF16};

static int64_t lc_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* One rank process: its pid, a pipe to it ("go") and one from it (reports). */
struct lc_rank {
  pid_t pid;
  int to, from;
};

/* What a rank reports: a step reached, or how an operation ended. */
struct lc_report {
  int32_t step;   /* LC_* below */
  int32_t rc;     /* a DEP_ERR_* */
  int64_t at_us;  /* lc_now_us() when it happened */
  char msg[240];
};
enum { LC_ATTACHED = 1, LC_RAN, LC_DETACHED, LC_WAITING, LC_OP_ENDED };

static void lc_send(int fd, int32_t step, int32_t rc, const char *msg) {
  struct lc_report r = {.step = step, .rc = rc, .at_us = lc_now_us()};
  snprintf(r.msg, sizeof r.msg, "%s", msg != NULL ? msg : "");
  if (write(fd, &r, sizeof r) != (ssize_t)sizeof r)
    _exit(3);
}

static void lc_wait_go(int fd) {
  char c;
  if (read(fd, &c, 1) != 1)
    _exit(4);
}

/* What a rank does once attached. */
enum lc_script {
  LC_RUN_AFTER_GO,  /* attach, report, wait; run LC_ITERS calls checking them; detach */
  LC_WAIT_FOREVER,  /* attach, report, then never make a call (the test kills it) */
  LC_ONE_CALL,      /* attach, report, wait; make one dispatch and report how it ended */
};
#define LC_ITERS 200

/* Top-1 routing: token t of rank r goes to rank (t + r) % W. */
static int lc_iterate(dep_client_t *c, uint32_t rank, char *msg, size_t len) {
  uint16_t x[LC_TOKENS * LC_HIDDEN], out[LC_TOKENS * LC_HIDDEN];
  static uint16_t rx[LC_W * LC_TOKENS * LC_HIDDEN];
  int64_t idx[LC_TOKENS];
  float w[LC_TOKENS], rw[LC_W * LC_TOKENS];
  int32_t ridx[LC_W * LC_TOKENS], cnt[1];
  dep_handle_t *h = NULL;
  int rc = dep_handle_new(c, &h);
  if (rc != 0)
    return snprintf(msg, len, "dep_handle_new: %s", dep_errmsg(c)), rc;
  for (int it = 0; it < LC_ITERS && rc == 0; it++) {
    for (uint32_t t = 0; t < LC_TOKENS; t++) {
      idx[t] = (int64_t)((t + rank + (uint32_t)it) % LC_W);
      w[t] = 1.0f;
      for (uint32_t k = 0; k < LC_HIDDEN; k++) /* small integers: exact in bf16 */
        x[t * LC_HIDDEN + k] = (uint16_t)(0x3f80 + ((t * 7 + k + rank * 3 + (uint32_t)it) & 63));
    }
    uint32_t num_recv = 0;
    struct dep_dispatch_args d = {.size = sizeof(struct dep_dispatch_args), .x = x, .topk_idx = idx,
                                  .index_type = DEP_INDEX_I64,
                                  .topk_weights = w, .num_tokens = LC_TOKENS, .recv_x = rx,
                                  .recv_topk_idx = ridx, .recv_topk_weights = rw,
                                  .recv_count_per_expert = cnt, .num_recv = &num_recv};
    if ((rc = dep_dispatch(c, &d, h, NULL)) != 0) {
      snprintf(msg, len, "call %d: dep_dispatch: %s: %s", it, dep_errname(rc), dep_errmsg(c));
      break;
    }
    struct dep_combine_args cb = {.size = sizeof(struct dep_combine_args), .x = rx, .out = out};
    if ((rc = dep_combine(c, &cb, h, NULL)) != 0) {
      snprintf(msg, len, "call %d: dep_combine: %s: %s", it, dep_errname(rc), dep_errmsg(c));
      break;
    }
    if (memcmp(out, x, sizeof x) != 0) {
      snprintf(msg, len, "call %d: combine did not give back the dispatched rows", it);
      rc = DEP_ERR_INTERNAL;
    }
  }
  dep_handle_free(h);
  return rc;
}

static void lc_rank_main(const char *sock, const char *job, uint32_t rank, enum lc_script script,
                         int go, int rep) {
  dep_client_t *c = NULL;
  struct dep_attach_args a = {.size = sizeof a,
                              .rank = rank, .world_size = LC_W, .local_rank = rank,
                              .local_world_size = LC_W, .shape = LC_SHAPE};
  snprintf(a.job_id, sizeof a.job_id, "%s", job);
  char msg[240] = "";
  int rc = dep_client_new(&c);
  if (rc == 0)
    rc = dep_connect(c, sock);
  if (rc == 0)
    rc = dep_attach(c, &a);
  lc_send(rep, LC_ATTACHED, rc, rc != 0 ? dep_errmsg(c) : NULL);
  if (rc != 0)
    _exit(1);
  if (script == LC_WAIT_FOREVER)
    for (;;)
      pause();
  lc_wait_go(go);
  if (script == LC_ONE_CALL) {
    lc_send(rep, LC_WAITING, 0, NULL);
    rc = lc_iterate(c, rank, msg, sizeof msg);
    lc_send(rep, LC_OP_ENDED, rc, msg);
    dep_client_free(c);
    _exit(0);
  }
  rc = lc_iterate(c, rank, msg, sizeof msg);
  lc_send(rep, LC_RAN, rc, msg);
  rc = dep_detach(c);
  lc_send(rep, LC_DETACHED, rc, dep_errmsg(c));
  dep_client_free(c);
  _exit(0);
}

static void lc_spawn(struct lc_rank *r, const char *sock, const char *job, uint32_t rank,
                     enum lc_script script) {
  struct dw_child c;
  dw_child_fork(&c);
  if (c.pid == 0)
    lc_rank_main(sock, job, rank, script, c.go, c.rep);
  *r = (struct lc_rank){.pid = c.pid, .to = c.go, .from = c.rep};
}

/* The rank's next report (within 30 s), which must be `step`. */
static struct lc_report lc_expect(struct lc_rank *r, int32_t step) {
  struct lc_report rep;
  struct timeval tv = {.tv_sec = 30};
  fd_set fds;
  FD_ZERO(&fds);
  FD_SET(r->from, &fds);
  ck_assert_msg(select(r->from + 1, &fds, NULL, NULL, &tv) == 1, "rank pid %d said nothing "
                "for 30 s (waiting for step %d)", (int)r->pid, step);
  ck_assert_msg(read(r->from, &rep, sizeof rep) == (ssize_t)sizeof rep,
                "rank pid %d exited before step %d", (int)r->pid, step);
  ck_assert_int_eq(rep.step, step);
  return rep;
}

static void lc_go(struct lc_rank *r) { ck_assert_int_eq(write(r->to, "g", 1), 1); }

static int lc_reap(struct lc_rank *r) {
  int st = 0;
  ck_assert_int_eq(waitpid(r->pid, &st, 0), r->pid);
  close(r->to);
  close(r->from);
  return st;
}

/* The daemon's devices' bytes lent to live jobs and held by processes, summed. */
struct lc_pool {
  uint64_t used, held;
};
static struct lc_pool lc_pool(int fd) {
  struct dep_status *st = dw_status(fd);
  struct lc_pool p = {0, 0};
  for (uint32_t i = 0; i < st->num_devices; i++) {
    p.used += st->devices[i].pool_used_bytes;
    p.held += st->devices[i].pool_held_bytes;
  }
  dep_status_free(st);
  return p;
}

/*
 * A daemon that stops (SIGTERM: systemctl stop or restart) or dies
 * (SIGKILL) under a running job: its ranks keep computing, bit-exact, on
 * the memory they mapped — nothing scrubbed or relent under them — and get
 * DEP_ERR_DAEMON_GONE from their next call that needs the daemon; a new
 * daemon starts on the same socket at once and charges the memory the
 * ranks still hold until they exit.
 */
static void daemon_goes_under_a_running_job(int sig) {
  struct tu_daemon d1, d2;
  ck_assert_int_eq(tu_daemon_start(&d1, NULL), 0);
  struct lc_rank r[LC_W];
  for (uint32_t i = 0; i < LC_W; i++)
    lc_spawn(&r[i], d1.sock, "running", i, LC_RUN_AFTER_GO);
  for (uint32_t i = 0; i < LC_W; i++)
    ck_assert_int_eq(lc_expect(&r[i], LC_ATTACHED).rc, 0);
  int obs1 = dw_client(&d1);
  const uint64_t lent = lc_pool(obs1).used;
  ck_assert_uint_gt(lent, 0);
  close(obs1);
  kill(d1.pid, sig);
  int st = 0;
  ck_assert_int_eq(waitpid(d1.pid, &st, 0), d1.pid);
  d1.pid = 0;
  if (sig == SIGTERM)
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "deepepd exited %#x on SIGTERM", st);
  /* A new daemon at once, on the same socket, beside the running ranks. */
  ck_assert_int_eq(tu_daemon_start_in(&d2, d1.dir, NULL), 0);
  int obs = dw_client(&d2);
  ck_assert_uint_eq(lc_pool(obs).held, lent);
  for (uint32_t i = 0; i < LC_W; i++)
    lc_go(&r[i]);
  for (uint32_t i = 0; i < LC_W; i++) {
    struct lc_report rep = lc_expect(&r[i], LC_RAN);
    ck_assert_msg(rep.rc == 0, "rank %u after the daemon went: %s (%s)", i, dep_errname(rep.rc),
                  rep.msg);
  }
  for (uint32_t i = 0; i < LC_W; i++) {
    struct lc_report rep = lc_expect(&r[i], LC_DETACHED);
    ck_assert_msg(rep.rc == DEP_ERR_DAEMON_GONE, "rank %u's dep_detach gave %s (%s)", i,
                  dep_errname(rep.rc), rep.msg);
    ck_assert_int_eq(lc_reap(&r[i]), 0);
  }
  /* The ranks are gone: the new daemon's charge goes with them. */
  int64_t t0 = lc_now_us();
  while (lc_pool(obs).held != 0 && lc_now_us() - t0 < 5000000)
    dw_sleep_ms(20);
  ck_assert_uint_eq(lc_pool(obs).held, 0);
  close(obs);
  dw_stop_ok(&d2);
}

START_TEST(a_sigterm_leaves_running_jobs_computing) { daemon_goes_under_a_running_job(SIGTERM); }
END_TEST

START_TEST(a_sigkill_leaves_running_jobs_computing) { daemon_goes_under_a_running_job(SIGKILL); }
END_TEST

/*
 * A rank that dies mid-operation: its peer, waiting for it inside dispatch,
 * fails with DEP_ERR_PEER naming it as soon as the daemon sees its socket
 * close, not after limits.op_timeout_ms (10 s).  The time from SIGKILL to
 * the peer's error is printed (bench/ has no harness for it; the figure is
 * for BENCHMARKS.md).
 */
START_TEST(a_rank_that_dies_fails_its_peers_at_once_naming_it) {
  struct tu_daemon d;
  ck_assert_int_eq(tu_daemon_start(&d, NULL), 0);
  struct lc_rank r0, r1;
  lc_spawn(&r0, d.sock, "doomed", 0, LC_ONE_CALL);
  lc_spawn(&r1, d.sock, "doomed", 1, LC_WAIT_FOREVER);
  ck_assert_int_eq(lc_expect(&r0, LC_ATTACHED).rc, 0);
  struct lc_report a1 = lc_expect(&r1, LC_ATTACHED);
  ck_assert_int_eq(a1.rc, 0);
  lc_go(&r0);
  lc_expect(&r0, LC_WAITING);
  dw_sleep_ms(100); /* rank 0 is inside dispatch, waiting for rank 1 */
  int64_t killed = lc_now_us();
  kill(r1.pid, SIGKILL);
  struct lc_report end = lc_expect(&r0, LC_OP_ENDED);
  double ms = (double)(end.at_us - killed) / 1000.0;
  printf("a_rank_that_dies_fails_its_peers_at_once: SIGKILL to the peer's %s in %.1f ms\n",
         dep_errname(end.rc), ms);
  ck_assert_msg(end.rc == DEP_ERR_PEER, "the peer got %s (%s)", dep_errname(end.rc), end.msg);
  char want[64];
  snprintf(want, sizeof want, "rank 1 (pid %d)", (int)r1.pid);
  ck_assert_msg(strstr(end.msg, want) != NULL, "the error does not name %s: %s", want, end.msg);
  ck_assert_msg(ms < 5000, "the peer's error came %.0f ms after the kill, half the op timeout",
                ms);
  ck_assert_int_eq(lc_reap(&r0), 0);
  lc_reap(&r1);
  dw_stop_ok(&d);
}
END_TEST

Suite *lifecycle_suite(void);
Suite *lifecycle_suite(void) {
  Suite *s = suite_create("lifecycle");
  TCase *tc = tcase_create("daemon");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, a_sigterm_leaves_running_jobs_computing);
  tcase_add_test(tc, a_sigkill_leaves_running_jobs_computing);
  suite_add_tcase(s, tc);
  tc = tcase_create("rank");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, a_rank_that_dies_fails_its_peers_at_once_naming_it);
  suite_add_tcase(s, tc);
  return s;
}
