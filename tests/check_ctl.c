/*
 * check_ctl.c — deepepctl as its manual page describes it, run as the real
 * binary against the real deepepd: errors as JSON objects under --json
 * with the usual exit codes, --version and `version` with and without a
 * daemon, drain / drain --wait / drain --cancel end to end (the ATTACHes
 * they refuse and let through are spoken on raw sockets, daemonwire.h),
 * the daemon's state in status, a socket path that is not a socket, and a
 * help that lists every command.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctl.h"
#include "ctl_view.h"
#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "slab.h"
#include "stats_page.h"
#include "statsranks.h"
#include "testutil.h"
#include "xring.h"

#define NOBODY 65534

/* ---- running deepepctl -------------------------------------------------------- */

/* One deepepctl process, its stdout and stderr going to files in dir. */
struct ctl_proc {
  pid_t pid;
  int status; /* its wait status, once reaped */
  bool reaped;
  char dir[200];
};

/* Start deepepctl with args (NULL-terminated), as uid when uid >= 0. */
static void ctl_spawn_as(struct ctl_proc *p, int uid, const char *const *args) {
  memset(p, 0, sizeof *p);
  tu_tmpdir(p->dir, sizeof p->dir);
  char fout[256], ferr[256];
  dw_sfmt(fout, sizeof fout, "%s/out", p->dir);
  dw_sfmt(ferr, sizeof ferr, "%s/err", p->dir);
  const char *argv[16] = {"deepepctl"};
  int n = 1;
  for (; args[n - 1] != NULL; n++) {
    ck_assert_int_lt(n, 15);
    argv[n] = args[n - 1];
  }
  argv[n] = NULL;
  /* Another uid runs a copy it can reach (tu_otheruid). */
  struct tu_otheruid other = {.fd = {-1, -1}};
  if (uid >= 0)
    ck_assert_msg(tu_otheruid_prepare(&other, "deepepctl") == 0,
                  "cannot copy deepepctl for uid %d: %s", uid, strerror(errno));
  p->pid = fork();
  ck_assert_int_ge(p->pid, 0);
  if (p->pid == 0) {
    if (uid >= 0)
      tu_otheruid_child(&other);
    int o = open(fout, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    int e = open(ferr, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (o < 0 || e < 0)
      _exit(126);
    dup2(o, 1);
    dup2(e, 2);
    if (uid >= 0 && (setgroups(0, NULL) != 0 || setgid((gid_t)uid) != 0 ||
                     setuid((uid_t)uid) != 0))
      _exit(125);
    unsetenv(DEP_SOCKET_ENV);
    execv(uid >= 0 ? other.path : tu_bin("deepepctl"), (char *const *)argv);
    _exit(127);
  }
  if (uid >= 0)
    tu_otheruid_done(&other);
}

static void ctl_spawn(struct ctl_proc *p, const char *const *args) { ctl_spawn_as(p, -1, args); }

/* Whether it is still running (reaping it if not). */
static bool ctl_running(struct ctl_proc *p) {
  if (!p->reaped && waitpid(p->pid, &p->status, WNOHANG) == p->pid)
    p->reaped = true;
  return !p->reaped;
}

/* Wait (up to timeout_ms) for it to exit; its exit code, outputs malloc'd. */
static int ctl_reap(struct ctl_proc *p, int timeout_ms, char **out, char **err) {
  int64_t deadline = dw_now_ms() + timeout_ms;
  while (ctl_running(p) && dw_now_ms() < deadline)
    dw_sleep_ms(10);
  if (!p->reaped) {
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &p->status, 0);
    ck_abort_msg("deepepctl did not exit within %d ms", timeout_ms);
  }
  char path[256];
  dw_sfmt(path, sizeof path, "%s/out", p->dir);
  *out = dw_slurp(path);
  dw_sfmt(path, sizeof path, "%s/err", p->dir);
  *err = dw_slurp(path);
  tu_rmtree(p->dir);
  ck_assert_msg(WIFEXITED(p->status), "deepepctl did not exit normally (status 0x%x)",
                p->status);
  return WEXITSTATUS(p->status);
}

/* Run deepepctl with args to the end (10 s at most). */
static int ctl_run(const char *const *args, char **out, char **err) {
  struct ctl_proc p;
  ctl_spawn(&p, args);
  return ctl_reap(&p, 10000, out, err);
}

/* Whether s begins with prefix. */
static bool starts(const char *s, const char *prefix) {
  return strncmp(s, prefix, strlen(prefix)) == 0;
}

/*
 * The output is exactly one JSON error object, on one line:
 * {"error":{"code":<code>,"name":"<its name>","message":"..."}}.
 * Returns the message's text as it appears (escaped) for further checks.
 */
static const char *expect_json_error(const char *out, int code) {
  char head[160];
  dw_sfmt(head, sizeof head, "{\"error\":{\"code\":%d,\"name\":\"%s\",\"message\":\"", code,
          dep_errname(code));
  ck_assert_msg(starts(out, head), "not a %s error object: %s",
                dep_errname(code), out);
  size_t len = strlen(out);
  ck_assert_msg(len >= 4 && strcmp(out + len - 4, "\"}}\n") == 0, "unterminated: %s", out);
  ck_assert_msg(strchr(out, '\n') == out + len - 1, "more than one line: %s", out);
  return out + strlen(head);
}

/* ---- raw ranks -------------------------------------------------------------------- */

/* A greeted connection that sends ATTACH for local rank lr of the job (lws ranks). */
static int attach_rank(const struct tu_daemon *d, const char *job, uint32_t lr, uint32_t lws) {
  int fd = dw_client(d);
  struct dep_attach_args a = dw_job_args(job, lr, lws);
  dw_attach(fd, &a, 10 + lr);
  return fd;
}

/* A one-rank job, attached: its connection. */
static int attached_job(const struct tu_daemon *d, const char *job) {
  int fd = attach_rank(d, job, 0, 1);
  dw_expect_attach_ok(fd, 10, NULL);
  return fd;
}

/* Wait (up to 3 s) until STATUS lists the job, or (listed false) no longer does. */
static bool job_listed_within(int fd, const char *id, bool listed) {
  for (int i = 0; i < 300; i++) {
    if (dw_job_listed(fd, id, NULL, NULL) == listed)
      return true;
    dw_sleep_ms(10);
  }
  return false;
}

static void expect_state(int fd, const char *state) {
  struct dep_status *st = dw_status(fd);
  ck_assert_str_eq(st->state, state);
  dep_status_free(st);
}

/* ---- errors under --json -------------------------------------------------------- */

START_TEST(json_errors_are_one_object_with_code_and_name_and_the_usual_exit_status) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(sock, sizeof sock, "%s/none.sock", dir);
  char *out, *err;

  /* No daemon: exit 1, the object on stdout, nothing on stderr. */
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "-s", sock, "status"), &out, &err), 1);
  const char *msg = expect_json_error(out, DEP_ERR_NO_DAEMON);
  ck_assert_msg(strstr(msg, sock) != NULL, "the message does not name %s: %s", sock, out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  /* --json after the command counts the same. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "status", "--json"), &out, &err), 1);
  expect_json_error(out, DEP_ERR_NO_DAEMON);
  free(out);
  free(err);
  /* Without --json the same failure stays text on stderr. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "status"), &out, &err), 1);
  ck_assert_str_eq(out, "");
  ck_assert_msg(starts(err, "deepepctl: deepepd not running: no socket at "), "%s", err);
  free(out);
  free(err);

  /* Usage errors: exit 2, DEP_ERR_INVALID, also when --json comes after the mistake. */
  ck_assert_int_eq(ctl_run(DW_ARGS("bogus", "--json"), &out, &err), 2);
  msg = expect_json_error(out, DEP_ERR_INVALID);
  ck_assert_msg(starts(msg, "unknown command \\\"bogus\\\""), "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("--frobnicate", "-j", "status"), &out, &err), 2);
  expect_json_error(out, DEP_ERR_INVALID);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json"), &out, &err), 2);
  expect_json_error(out, DEP_ERR_INVALID);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-j", "status", "extra"), &out, &err), 2);
  expect_json_error(out, DEP_ERR_INVALID);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "-s"), &out, &err), 2);
  expect_json_error(out, DEP_ERR_INVALID);
  free(out);
  free(err);
  /* -s's argument is a path, not the option it looks like. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", "--json", "bogus"), &out, &err), 2);
  ck_assert_str_eq(out, "");
  ck_assert_ptr_nonnull(strstr(err, "usage: deepepctl"));
  free(out);
  free(err);
  /* A usage error says what was wrong, the usage line and where the help is: three lines, not
   * the whole help (it once printed all 25 lines of it). */
  ck_assert_int_eq(ctl_run(DW_ARGS("bogus"), &out, &err), 2);
  ck_assert_str_eq(out, "");
  ck_assert_str_eq(err, "deepepctl: unknown command \"bogus\"\n"
                        "usage: deepepctl [-s SOCKET] [--json] COMMAND [OPTIONS]\n"
                        "see deepepctl --help\n");
  free(out);
  free(err);
  tu_rmtree(dir);
}
END_TEST

START_TEST(json_errors_carry_the_daemons_reply) {
  struct tu_daemon d;
  dw_start(&d, "allow:\n  users: [\"65534\"]\n");
  char *out, *err;
  /* An error reply: drain by a user the daemon serves but who is neither
   * root nor the daemon's own user. */
  if (geteuid() != 0) {
    printf("%s: the uid %d part skipped: needs root\n", __func__, NOBODY);
  } else {
    struct ctl_proc p;
    ctl_spawn_as(&p, NOBODY, DW_ARGS("-s", d.sock, "--json", "drain"));
    ck_assert_int_eq(ctl_reap(&p, 10000, &out, &err), 1);
    const char *msg = expect_json_error(out, DEP_ERR_PERMISSION);
    ck_assert_msg(starts(msg, "drain: only root or deepepd's own user"), "%s", out);
    ck_assert_str_eq(err, "");
    free(out);
    free(err);
    ctl_spawn_as(&p, NOBODY, DW_ARGS("-s", d.sock, "drain"));
    ck_assert_int_eq(ctl_reap(&p, 10000, &out, &err), 1);
    ck_assert_msg(starts(err, "deepepctl: drain: only root"), "%s", err);
    free(out);
    free(err);
    int fd = dw_client(&d);
    expect_state(fd, "ready");
    close(fd);
  }
  /* An error reply with the daemon's own code: RELOAD of a file that does not parse. */
  ck_assert_int_eq(tu_write_file(d.conf, "pool: [unclosed\n"), 0);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "-s", d.sock, "reload"), &out, &err), 1);
  const char *msg = expect_json_error(out, DEP_ERR_CONFIG);
  ck_assert_msg(starts(msg, "reload: "), "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  dw_stop_ok(&d);
}
END_TEST

/* ---- versions ----------------------------------------------------------------------- */

START_TEST(version_option_prints_deepepctls_version_and_protocol) {
  char want_text[128], want_json[128];
  dw_sfmt(want_text, sizeof want_text, "deepepctl: %s\nprotocol:  %d\n", DEP_VERSION_STRING,
          DEP_PROTO_VERSION);
  dw_sfmt(want_json, sizeof want_json, "{\"version\":\"%s\",\"proto_version\":%d}\n",
          DEP_VERSION_STRING, DEP_PROTO_VERSION);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("--version"), &out, &err), 0);
  ck_assert_str_eq(out, want_text);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-V"), &out, &err), 0);
  ck_assert_str_eq(out, want_text);
  free(out);
  free(err);
  /* --json counts wherever it is; -V never needs a daemon. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-V", "--json", "-s", "/nonexistent"), &out, &err), 0);
  ck_assert_str_eq(out, want_json);
  free(out);
  free(err);
}
END_TEST

START_TEST(version_shows_the_daemon_or_says_none_answers) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(sock, sizeof sock, "%s/none.sock", dir);
  char head[128];
  dw_sfmt(head, sizeof head, "{\"version\":\"%s\",\"proto_version\":%d,", DEP_VERSION_STRING,
          DEP_PROTO_VERSION);
  char *out, *err;
  /* None: still exit 0 (deepepctl's own part is the answer), saying why. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "version"), &out, &err), 0);
  ck_assert_msg(strstr(out, DEP_VERSION_STRING) != NULL, "%s", out);
  ck_assert_msg(strstr(out, "\ndaemon:\n  deepepd not running: no socket at ") != NULL, "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "--json", "version"), &out, &err), 0);
  ck_assert_msg(starts(out, head), "%s", out);
  ck_assert_msg(strstr(out, ",\"daemon\":null}\n") != NULL, "%s", out);
  free(out);
  free(err);

  struct tu_daemon d;
  dw_start(&d, NULL);
  char want[160];
  dw_sfmt(want, sizeof want, "\"daemon\":{\"version\":\"%s\",\"proto_version\":%d,\"backend\":\"",
          DEP_VERSION_STRING, DEP_PROTO_VERSION);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "version"), &out, &err), 0);
  ck_assert_msg(starts(out, head) && strstr(out, want) != NULL, "%s", out);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "version"), &out, &err), 0);
  ck_assert_msg(strstr(out, "\ndaemon:\n  VERSION") != NULL, "%s", out);
  free(out);
  free(err);
  dw_stop_ok(&d);
  tu_rmtree(dir);
}
END_TEST

/* ---- drain ------------------------------------------------------------------------------ */

START_TEST(drain_refuses_new_jobs_while_a_gathering_job_completes) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int obs = dw_client(&d);
  /* Rank 0 of a two-rank job is waiting for rank 1 when the drain comes. */
  int r0 = attach_rank(&d, "gathering", 0, 2);
  ck_assert(job_listed_within(obs, "gathering", true));
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "drain"), &out, &err), 0);
  ck_assert_msg(starts(out, "drain: draining"), "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  expect_state(obs, "draining");

  /* A new job is refused, and says why. */
  int fresh = attach_rank(&d, "fresh", 0, 1);
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fresh, DEP_ERR_STATE, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "draining") != NULL, "%s", msg);
  ck_assert(!dw_job_listed(obs, "fresh", NULL, NULL));
  close(fresh);

  /* The gathering job's last rank still gets in, and both hear ATTACH_OK. */
  int r1 = attach_rank(&d, "gathering", 1, 2);
  dw_expect_attach_ok(r0, 10, NULL);
  dw_expect_attach_ok(r1, 11, NULL);
  close(r0);
  close(r1);
  ck_assert(job_listed_within(obs, "gathering", false));
  expect_state(obs, "draining");
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(drain_wait_returns_once_the_last_job_detaches) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int job = attached_job(&d, "running");
  struct ctl_proc p;
  ctl_spawn(&p, DW_ARGS("-s", d.sock, "drain", "--wait", "--timeout", "30"));
  /* It waits while the job runs... */
  dw_sleep_ms(500);
  ck_assert_msg(ctl_running(&p), "drain --wait returned with a job still running");
  int obs = dw_client(&d);
  expect_state(obs, "draining");
  /* ...and returns, exit 0, once the job has left. */
  ck_assert_int_eq(dw_send_frame(job, DEP_MSG_DETACH, 20, NULL), 0);
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(job, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "DETACH_OK");
  free(f);
  char *out, *err;
  ck_assert_int_eq(ctl_reap(&p, 5000, &out, &err), 0);
  ck_assert_msg(strstr(out, "drain:") != NULL && strstr(out, "\nwaited:") != NULL, "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  /* With no job left it returns at once; JSON says how long it waited. */
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "drain", "--wait"), &out, &err), 0);
  ck_assert_msg(starts(out, "{\"result\":\"draining") &&
                    strstr(out, ",\"waited_ms\":") != NULL,
                "%s", out);
  free(out);
  free(err);
  close(job);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(drain_wait_timeout_exits_1_naming_the_jobs_left) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int job = attached_job(&d, "stays");
  char *out, *err;
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(
      ctl_run(DW_ARGS("-s", d.sock, "drain", "--wait", "--timeout", "0.3"), &out, &err), 1);
  ck_assert_int_ge(dw_now_ms() - t0, 300);
  ck_assert_msg(starts(err, "deepepctl: drain --wait: 1 job(s) still running") &&
                    strstr(err, "stays (ranks 1/1)") != NULL,
                "%s", err);
  ck_assert_str_eq(out, "");
  free(out);
  free(err);
  ck_assert_int_eq(
      ctl_run(DW_ARGS("-s", d.sock, "--json", "drain", "--wait", "--timeout", "0"), &out, &err), 1);
  const char *msg = expect_json_error(out, DEP_ERR_TIMEOUT);
  ck_assert_msg(strstr(msg, "stays") != NULL, "%s", out);
  free(out);
  free(err);
  /* The drain stays in force after the timeout. */
  int obs = dw_client(&d);
  expect_state(obs, "draining");
  close(obs);
  close(job);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(drain_cancel_lets_new_jobs_in_again) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "drain"), &out, &err), 0);
  free(out);
  free(err);
  int fd = attach_rank(&d, "refused", 0, 1);
  dw_expect_error(fd, DEP_ERR_STATE, NULL, 0);
  close(fd);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "drain", "--cancel"), &out, &err), 0);
  ck_assert_msg(starts(out, "{\"result\":\"accepting new jobs"), "%s", out);
  free(out);
  free(err);
  int obs = dw_client(&d);
  expect_state(obs, "ready");
  fd = attached_job(&d, "welcome");
  ck_assert(dw_job_listed(obs, "welcome", NULL, NULL));
  close(fd);
  close(obs);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(drain_options_that_do_not_fit_are_usage_errors_naming_them) {
  const struct {
    const char *const *args;
    const char *says;
  } bad[] = {
      {DW_ARGS("drain", "--timeout", "5"), "--timeout goes with --wait"},
      {DW_ARGS("drain", "--wait", "--timeout", "x"), "--timeout needs a number of seconds"},
      {DW_ARGS("drain", "--wait", "--timeout", "-1"), "--timeout needs a number of seconds"},
      {DW_ARGS("drain", "--wait", "--timeout", "inf"), "--timeout needs a number of seconds"},
      {DW_ARGS("drain", "--cancel", "--wait"), "--cancel takes neither --wait nor --timeout"},
      {DW_ARGS("drain", "now"), "drain takes no argument \"now\""},
      {DW_ARGS("drain", "--timeout"), "option --timeout needs an argument"},
      {DW_ARGS("drain", "--frobnicate"), "unknown option --frobnicate"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char *out, *err;
    ck_assert_int_eq(ctl_run(bad[i].args, &out, &err), 2);
    ck_assert_str_eq(out, "");
    ck_assert_msg(strstr(err, bad[i].says) != NULL && strstr(err, "usage: deepepctl") != NULL,
                  "no \"%s\" and usage in: %s", bad[i].says, err);
    free(out);
    free(err);
  }
}
END_TEST

/*
 * deepepctl size says, with no daemon, what a job of a shape is lent per
 * rank: the layout's slab, and for a job across nodes the pinned ring and
 * exchange region; streaming (--chunk-rows) shrinks the slab; a bad number
 * or a node larger than the world is a usage error naming it.
 */
START_TEST(size_says_what_a_shape_is_lent_per_rank_before_the_job_starts) {
  const struct dep_job_shape s = {.max_tokens_per_rank = 4096, .hidden = 7168,
                                  .num_experts = 256, .topk = 8, .dtype = DEP_DTYPE_BF16};
  for (uint32_t chunk = 0; chunk <= 32; chunk += 32) {
    char chunk_arg[16];
    snprintf(chunk_arg, sizeof chunk_arg, "%u", chunk);
    char *out, *err;
    ck_assert_int_eq(ctl_run(DW_ARGS("size", "--world", "64", "--ranks-per-node", "8",
                                     "--chunk-rows", chunk_arg, "--json"), &out, &err), 0);
    struct dep_slab_layout l;
    char why[256], want[256];
    ck_assert_int_eq(dep__slab_layout_nodes(&s, 64, 8, chunk, &l, why, sizeof why), 0);
    snprintf(want, sizeof want, "\"slab_bytes\":%llu,\"pinned_host_bytes\":%llu,"
             "\"total_bytes\":%llu}", (unsigned long long)l.total_bytes,
             (unsigned long long)(DEP_XRING_BYTES + l.xchg_bytes),
             (unsigned long long)(l.total_bytes + DEP_XRING_BYTES + l.xchg_bytes));
    ck_assert_msg(strstr(out, want) != NULL, "want %s in %s", want, out);
    ck_assert_msg(chunk == 0 || strstr(out, "\"channel_rows\":128,") != NULL, "%s", out);
    free(out);
    free(err);
  }
  const struct {
    const char *const *args;
    const char *says;
  } bad[] = {
      {DW_ARGS("size", "--world", "8", "--ranks-per-node", "9"),
       "--ranks-per-node 9 is more than --world 8"},
      {DW_ARGS("size", "--tokens", "x"), "--tokens needs a number from 1 to 65536"},
      {DW_ARGS("size", "--world", "0"), "--world needs a number from 1 to 4096"},
      {DW_ARGS("size", "--experts", "100", "--world", "8"), "num_experts"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char *out, *err;
    ck_assert_int_eq(ctl_run(bad[i].args, &out, &err), 2);
    ck_assert_msg(strstr(err, bad[i].says) != NULL, "no \"%s\" in: %s", bad[i].says, err);
    free(out);
    free(err);
  }
}
END_TEST

/* ---- status, sockets, help ---------------------------------------------------------- */

START_TEST(status_shows_the_daemons_state) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "status"), &out, &err), 0);
  ck_assert_msg(strstr(out, "\nstate:    ready\n") != NULL, "%s", out);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "drain"), &out, &err), 0);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "status"), &out, &err), 0);
  ck_assert_msg(strstr(out, ",\"state\":\"draining\",") != NULL, "%s", out);
  free(out);
  free(err);
  dw_stop_ok(&d);
}
END_TEST

/* A connection that is no rank (deepepctl itself) has no rank, local rank or attach time: the
 * text says "-" there, as it does for its job and device, not rank 0 (which a real rank 0 has);
 * the JSON says null for each (it once said "rank":0, as a real rank 0 has). */
START_TEST(clients_shows_no_rank_for_a_connection_that_is_no_rank) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "clients"), &out, &err), 0);
  const char *row = strstr(out, " deepepctl ");
  ck_assert_msg(row != NULL, "%s", out);
  char name[64], job[64], rank[16], local[16], dev[64], conn[32], att[32], run[16];
  ck_assert_int_eq(sscanf(row, " deepepctl %63s %63s %15s %15s %63s %31s %31s %15s", name, job,
                          rank, local, dev, conn, att, run),
                   8);
  ck_assert_str_eq(job, "-");
  ck_assert_msg(strcmp(rank, "-") == 0 && strcmp(local, "-") == 0 && strcmp(att, "-") == 0,
                "RANK %s LOCAL %s ATTACHED %s for deepepctl's own connection:\n%s", rank, local,
                att, out);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "clients"), &out, &err), 0);
  ck_assert_msg(strstr(out, "\"job\":null,\"rank\":null,\"local_rank\":null,\"device\":null,")
                != NULL && strstr(out, "\"attached_ms\":null,\"attached\":null}") != NULL,
                "%s", out);
  free(out);
  free(err);
  dw_stop_ok(&d);
}
END_TEST

/* A daemon with no peers and no listener has no peer links: peers does not say they run
 * unauthenticated under peer_insecure, which the configuration does not set. */
START_TEST(peers_without_peers_says_none_are_configured_not_peer_insecure) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "peers"), &out, &err), 0);
  ck_assert_msg(strstr(out, "\nauth:          none (no peers or listener configured)\n") != NULL,
                "%s", out);
  ck_assert_msg(strstr(out, "peer_insecure") == NULL, "%s", out);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "peers"), &out, &err), 0);
  ck_assert_msg(strstr(out, "\"auth\":\"none (no peers or listener configured)\"") != NULL, "%s",
                out);
  free(out);
  free(err);
  dw_stop_ok(&d);
}
END_TEST

/* A job on this node alone shows no node columns in the text (deepepctl(1): the table shows
 * NODES, REMOTE, TX, RX and RING_PEAK when a job spans nodes); the JSON keeps their keys. */
START_TEST(status_shows_node_columns_only_for_jobs_that_span_nodes) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fd = attached_job(&d, "one-node");
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "status"), &out, &err), 0);
  const char *jobs = strstr(out, "\njobs:\n");
  ck_assert_msg(jobs != NULL && strstr(jobs, " one-node ") != NULL, "%s", out);
  ck_assert_msg(strstr(jobs, "NODES") == NULL && strstr(jobs, "RING_PEAK") == NULL,
                "node columns for a job on one node:\n%s", out);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", d.sock, "--json", "status"), &out, &err), 0);
  ck_assert_msg(strstr(out, ",\"nodes\":1,\"remote_ranks\":0,\"bytes_out\":0,\"bytes_in\":0,"
                            "\"ring_peak\":0}") != NULL,
                "%s", out);
  free(out);
  free(err);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(a_path_that_is_not_a_socket_is_named_as_such) {
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", "/etc/passwd", "status"), &out, &err), 1);
  ck_assert_msg(starts(err, "deepepctl: /etc/passwd is not a socket: it is a regular file"),
                "%s", err);
  ck_assert_msg(strstr(err, "stale") == NULL, "%s", err);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "-s", "/etc/passwd", "status"), &out, &err), 1);
  const char *msg = expect_json_error(out, DEP_ERR_NO_DAEMON);
  ck_assert_msg(starts(msg, "/etc/passwd is not a socket"), "%s", out);
  free(out);
  free(err);

  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", dir, "status"), &out, &err), 1);
  ck_assert_msg(strstr(err, " is not a socket: it is a directory") != NULL, "%s", err);
  free(out);
  free(err);
  /* The library says the same to a trainer, and the path can come from the environment. */
  dep_client_t *c = NULL;
  ck_assert_int_eq(dep_client_new(&c), 0);
  setenv(DEP_SOCKET_ENV, "/etc/passwd", 1);
  ck_assert_int_eq(dep_connect(c, NULL), DEP_ERR_NO_DAEMON);
  ck_assert_msg(strstr(dep_errmsg(c), "/etc/passwd (from $" DEP_SOCKET_ENV ") is not a socket") !=
                    NULL,
                "%s", dep_errmsg(c));
  unsetenv(DEP_SOCKET_ENV);
  /* A socket nobody listens on is still a stale socket. */
  dw_sfmt(sock, sizeof sock, "%s/stale.sock", dir);
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s", sock);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  close(s);
  ck_assert_int_eq(dep_connect(c, sock), DEP_ERR_NO_DAEMON);
  ck_assert_msg(strstr(dep_errmsg(c), "stale socket") != NULL, "%s", dep_errmsg(c));
  dep_client_free(c);
  tu_rmtree(dir);
}
END_TEST

/* A daemon that accepts but never answers HELLO (hung) is given up on within
 * CTL_HELLO_TIMEOUT_MS, not the library's 30 s, with advice for an operator
 * rather than the library's "reconnect with dep_connect". */
START_TEST(a_daemon_that_never_answers_is_given_up_on_in_seconds) {
  char dir[200], sock[256];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(sock, sizeof sock, "%s/hung.sock", dir);
  /* Listening but never accepting: connect succeeds, HELLO sits unread. */
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_ge(s, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s", sock);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(s, 4), 0);
  char *out, *err;
  int64_t t0 = dw_now_ms();
  struct ctl_proc p;
  ctl_spawn(&p, DW_ARGS("-s", sock, "status"));
  /* ctl_reap aborts the test if it takes longer than the bound and a margin. */
  ck_assert_int_eq(ctl_reap(&p, CTL_HELLO_TIMEOUT_MS + 3000, &out, &err), 1);
  int64_t took = dw_now_ms() - t0;
  ck_assert_msg(took >= CTL_HELLO_TIMEOUT_MS - 100, "gave up after %lld ms", (long long)took);
  ck_assert_str_eq(out, "");
  char want[400];
  dw_sfmt(want, sizeof want,
          "deepepctl: deepepd at %s accepted the connection but did not answer within %d s: it "
          "may be hung; check `systemctl status deepepd`",
          sock, CTL_HELLO_TIMEOUT_MS / 1000);
  ck_assert_msg(starts(err, want), "%s", err);
  ck_assert_msg(strstr(err, "dep_connect") == NULL, "%s", err);
  free(out);
  free(err);
  close(s);
  tu_rmtree(dir);
}
END_TEST

/* A socket path longer than sun_path allows is a malformed option argument: exit 2, as an empty
 * one is (it was exit 1, as if a daemon had been asked and failed). */
START_TEST(a_socket_path_too_long_for_a_unix_socket_is_a_usage_error) {
  char path[121];
  memset(path, 'x', sizeof path - 1);
  path[sizeof path - 1] = '\0';
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", path, "status"), &out, &err), 2);
  ck_assert_str_eq(out, "");
  ck_assert_msg(strstr(err, "120 bytes, longer than the 107") != NULL, "%s", err);
  ck_assert_msg(strstr(err, "usage:") != NULL, "%s", err);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "status", "-s", path), &out, &err), 2);
  expect_json_error(out, DEP_ERR_INVALID);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
}
END_TEST

/* genkey under --json prints one JSON object on stdout, as every command does, and nothing on
 * stderr: {"result", "file"} for a FILE (it printed its text line on stderr and nothing on stdout),
 * {"key"} to stdout (it printed the bare hex).  An empty FILE is a usage error. */
START_TEST(genkey_under_json_prints_one_object) {
  char dir[200], path[256], want[400];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(path, sizeof path, "%s/peer.key", dir);
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "genkey", path), &out, &err), 0);
  dw_sfmt(want, sizeof want,
          "{\"result\":\"wrote a new peer key to %s (mode 0600); copy it to every node\","
          "\"file\":\"%s\"}\n", path, path);
  ck_assert_str_eq(out, want);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 07777, 0600);
  ck_assert_int_eq(st.st_size, 65);
  ck_assert_int_eq(ctl_run(DW_ARGS("--json", "genkey"), &out, &err), 0);
  ck_assert_msg(starts(out, "{\"key\":\"") && strlen(out) == 8 + 64 + 3 &&
                    strcmp(out + 8 + 64, "\"}\n") == 0 &&
                    strspn(out + 8, "0123456789abcdef") == 64,
                "%s", out);
  ck_assert_str_eq(err, "");
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("genkey", ""), &out, &err), 2);
  ck_assert_msg(strstr(err, "genkey needs a FILE name") != NULL, "%s", err);
  free(out);
  free(err);
  tu_rmtree(dir);
}
END_TEST

/* stats JOB with a JOB no job can have is a usage error: "" listed every job, and a JOB past 63
 * bytes was cut to them and searched for (a "no stats for job" naming another id). */
START_TEST(stats_with_an_impossible_job_id_is_a_usage_error) {
  char job[101];
  memset(job, 'x', sizeof job - 1);
  job[sizeof job - 1] = '\0';
  char *out, *err;
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", "/nonexistent.sock", "stats", ""), &out, &err), 2);
  ck_assert_msg(strstr(err, "stats needs a JOB id, not an empty string") != NULL, "%s", err);
  free(out);
  free(err);
  ck_assert_int_eq(ctl_run(DW_ARGS("-s", "/nonexistent.sock", "--json", "stats", job), &out, &err),
                   2);
  const char *msg = expect_json_error(out, DEP_ERR_INVALID);
  ck_assert_msg(strstr(msg, "is 100 bytes; a job id has at most 63") != NULL, "%s", out);
  free(out);
  free(err);
}
END_TEST

START_TEST(help_lists_every_command_and_option) {
  static const char *const want[] = {
      "\n  status ",  "\n  reload ",  "\n  drain ",    "\n  version ", "\n  help ",
      "--cancel",     "--wait",       "--timeout S", "-V, --version", "-j, --json",
      "-s, --socket", "-h, --help",
  };
  const char *const *const asks[] = {DW_ARGS("-h"), DW_ARGS("help"), DW_ARGS("drain", "--help")};
  for (size_t a = 0; a < sizeof asks / sizeof asks[0]; a++) {
    char *out, *err;
    ck_assert_int_eq(ctl_run(asks[a], &out, &err), 0);
    ck_assert_str_eq(err, "");
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
      ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%s", want[i], out);
    free(out);
    free(err);
  }
}
END_TEST

/* ---- the text renderer ---------------------------------------------------------- */

/* What ctl_out_render prints for doc, malloc'd. */
static char *render_text(const struct ctl_doc *doc) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(ctl_out_render(f, doc, false), 0);
  fclose(f);
  return buf;
}

/* A reload's answer names every key that needs a restart, a drain's every job left and a peer's
 * last error the whole reason: the text shows each string whole, as JSON does, never cut to a
 * column width (it once cut them at 127 bytes: "needs restart ...: so"). */
START_TEST(text_output_shows_long_strings_whole) {
  char longs[DEP_MSG_TEXT_MAX];
  memset(longs, 'k', sizeof longs - 2);
  memcpy(longs + sizeof longs - 12, "socket.mode", 11);
  longs[sizeof longs - 1] = '\0';
  static const struct ctl_col fields[] = {{"result", "reload", CTL_STR, 0}};
  const struct ctl_val vals[] = {{.s = longs}};
  static const struct ctl_col cols[] = {{"address", "PEER", CTL_STR, 0},
                                        {"conns_up", "CONNS", CTL_UINT, 0},
                                        {"conns_total", "", CTL_UINT, CTL_COL_JOIN},
                                        {"last_error", "LAST ERROR", CTL_STR, 0}};
  const struct ctl_val cells[] = {{.s = "10.0.0.2:7470"}, {.u = 3}, {.u = 24}, {.s = longs},
                                  {.s = "b\x01z"},         {.u = 0}, {.u = 24}, {.s = ""}};
  const struct ctl_table tables[] = {{"peers", "no peers", cols, 4, 2, cells, 0}};
  const struct ctl_doc doc = {fields, vals, 1, tables, 1};
  char *out = render_text(&doc);
  char want[DEP_MSG_TEXT_MAX + 32];
  dw_sfmt(want, sizeof want, "reload: %s\n", longs);
  ck_assert_msg(starts(out, want), "the field is not whole:\n%s", out);
  dw_sfmt(want, sizeof want, "  10.0.0.2:7470   3/24  %s\n", longs);
  ck_assert_msg(strstr(out, want) != NULL, "the cell is not whole:\n%s", out);
  /* Control bytes stay out of the terminal; an empty string is "-". */
  ck_assert_msg(strstr(out, "  b?z             0/24  -\n") != NULL, "%s", out);
  free(out);
}
END_TEST

/* A value a row does not have is "-" in text, whatever its kind, and null in JSON (it once kept
 * the number, 0, which reads as a measurement). */
START_TEST(a_value_a_row_lacks_is_a_dash_in_text_and_null_in_json) {
  static const struct ctl_col cols[] = {{"rank", "RANK", CTL_UINT, 0},
                                        {"ratio", "RATIO", CTL_MILLI, 0}};
  const struct ctl_val cells[] = {{.u = 0, .none = true}, {.u = 0, .none = true},
                                  {.u = 0}, {.u = 1500}};
  const struct ctl_table tables[] = {{"rows", "none", cols, 2, 2, cells, 0}};
  const struct ctl_doc doc = {NULL, NULL, 0, tables, 1};
  char *out = render_text(&doc);
  ck_assert_str_eq(out, "\nrows:\n  RANK  RATIO\n     -      -\n     0   1.50\n");
  free(out);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_int_eq(ctl_out_render(f, &doc, true), 0);
  fclose(f);
  ck_assert_str_eq(buf, "{\"rows\":[{\"rank\":null,\"ratio\":null},{\"rank\":0,\"ratio\":1.500}]}\n");
  free(buf);
}
END_TEST

/* The exposition of one node (a device, a peer, a rank of job j that ran dispatches) whose
 * figures are too large for a double's 9 significant digits, or have fractions of seconds. */
static char *render_metrics(void) {
  struct dep_status_device dev = {.uuid = "00000000-0000-0000-0000-000000000000",
                                  .pool_total_bytes = 1073741824ull,
                                  .pool_used_bytes = 15700000001ull};
  struct dep_status st = {.state = "ready", .uptime_ms = 4710, .num_devices = 1,
                          .devices = &dev};
  struct dep_msg_stats_rank rank = {.job_id = "j"};
  struct dep_msg_stats_op *o = &rank.ops[DEP_STATS_OP_DISPATCH];
  o->calls = 123456789012ull;
  o->bytes = 15700000001ull;
  o->first_ns = 1500;
  o->steady_calls = 3;
  o->steady_sum_ns = 12345678901234ull;
  o->median_ns = o->p99_ns = 2000000000;
  /* One combine, so far: no steady call, no quantile. */
  rank.ops[DEP_STATS_OP_COMBINE].calls = 1;
  rank.ops[DEP_STATS_OP_COMBINE].first_ns = 5000;
  struct ctl_stats s = {.ranks = &rank, .n = 1};
  struct dep_msg_peer_info peer = {.address = "10.0.0.2:7470", .state = "up",
                                   .transport = "tcp", .bytes_out = 15700000001ull,
                                   .data_out = 4, .data_in = 3,
                                   .data_bytes_out = 107374182400ull, .data_bytes_in = 7,
                                   .data_frames_out = 1600, .data_frames_in = 9};
  struct dep_msg_peers pm = {.n_peers = 1, .peers = &peer, .proxy_threads = 2,
                             .proxy_busy_us = 1500001, .nic_bytes = 8};
  static struct dep_msg_job_nodes jn = {
      .n = 1, .jobs = {{.job_id = "xj", .bytes_out = 11, .bytes_in = 12, .frames_out = 13,
                        .frames_in = 14, .ring_peak = 5, .ring_entries = 1024}}};
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  ck_assert_ptr_nonnull(f);
  ck_assert_int_eq(ctl_view_metrics(f, &st, &s, &pm, &jn), 0);
  fclose(f);
  return buf;
}

/* Counters and byte gauges are the integers they are, and seconds exact decimals: %.9g once
 * printed 1073741824 bytes as 1.07374182e+09 (1073741820) and rounded 15.7 GB likewise. */
START_TEST(metrics_print_counts_and_bytes_as_exact_integers) {
  char *out = render_metrics();
  static const char *const want[] = {
      "deepep_pool_bytes{device=\"00000000-0000-0000-0000-000000000000\",kind=\"total\"} "
      "1073741824\n",
      "deepep_pool_bytes{device=\"00000000-0000-0000-0000-000000000000\",kind=\"used\"} "
      "15700000001\n",
      "deepep_peer_sent_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\"} 15700000001\n",
      "\ndeepep_daemon_uptime_seconds 4.71\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 123456789012\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 15700000001\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 0.0000015\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.5\"} 2\n",
      "op=\"dispatch\",device=\"00000000-0000-0000-0000-000000000000\"} 12345.678901234\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

/* A summary's quantiles over no observation are NaN, as Prometheus's own clients print them;
 * they were 0, which reads as a call that took no time. */
START_TEST(metrics_quantiles_of_no_steady_call_are_nan) {
  char *out = render_metrics();
  static const char *const want[] = {
      "op=\"combine\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.5\"} NaN\n",
      "op=\"combine\",device=\"00000000-0000-0000-0000-000000000000\",quantile=\"0.99\"} NaN\n",
      "deepep_op_latency_seconds_count{ep_job=\"j\",rank=\"0\",op=\"combine\","
      "device=\"00000000-0000-0000-0000-000000000000\"} 0\n",
      "deepep_op_first_call_seconds{ep_job=\"j\",rank=\"0\",op=\"combine\","
      "device=\"00000000-0000-0000-0000-000000000000\"} 0.000005\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

/* The data path is in the exposition as deepepctl peers and status show it: per peer its
 * connections, bytes and frames each way; its proxy threads; per job that spans nodes its
 * traffic and its rings' fullest.  It once had the control link's bytes alone. */
START_TEST(metrics_show_the_data_paths_traffic_per_peer_and_job) {
  char *out = render_metrics();
  static const char *const want[] = {
      "deepep_peer_data_connections{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} 4\n",
      "deepep_peer_data_connections{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 3\n",
      "deepep_peer_data_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} "
      "107374182400\n",
      "deepep_peer_data_bytes_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 7\n",
      "deepep_peer_data_frames_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"out\"} "
      "1600\n",
      "deepep_peer_data_frames_total{peer=\"10.0.0.2:7470\",transport=\"tcp\",direction=\"in\"} 9\n",
      "\ndeepep_proxy_threads 2\n",
      "\ndeepep_proxy_busy_seconds_total 1.500001\n",
      "\ndeepep_rdma_registered_bytes 8\n",
      "\ndeepep_job_data_bytes_total{ep_job=\"xj\",direction=\"out\"} 11\n",
      "\ndeepep_job_data_bytes_total{ep_job=\"xj\",direction=\"in\"} 12\n",
      "\ndeepep_job_data_blocks_total{ep_job=\"xj\",direction=\"out\"} 13\n",
      "\ndeepep_job_data_blocks_total{ep_job=\"xj\",direction=\"in\"} 14\n",
      "\ndeepep_job_ring_peak_descriptors{ep_job=\"xj\"} 5\n",
      "\ndeepep_job_ring_entries{ep_job=\"xj\"} 1024\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out, want[i]) != NULL, "no \"%s\" in:\n%.3000s", want[i], out);
  free(out);
}
END_TEST

/* A sanitized build's library loads into python3 only after the sanitizer's runtime, and
 * python3's own allocations are no leak of ours. */
#if defined(__SANITIZE_ADDRESS__)
#define CTL_PY_ENV "LD_PRELOAD=$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 "
#else
#define CTL_PY_ENV ""
#endif

/* A Python trainer in miniature: the library through ctypes, connected, until stdin closes. */
static const char ctl_trainer_py[] =
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "c = ctypes.c_void_p()\n"
    "assert lib.dep_client_new(ctypes.byref(c)) == 0\n"
    "assert lib.dep_connect(c, sys.argv[2].encode()) == 0\n"
    "sys.stdin.read()\n";

/* Whether `deepepctl --json clients` names a connection `name`, within timeout_ms. */
static bool clients_show(const char *sock, const char *name, int timeout_ms) {
  char want[200];
  dw_sfmt(want, sizeof want, "\"name\":\"%s\"", name);
  int64_t deadline = dw_now_ms() + timeout_ms;
  do {
    char *out, *err;
    ck_assert_int_eq(ctl_run(DW_ARGS("-s", sock, "--json", "clients"), &out, &err), 0);
    bool found = strstr(out, want) != NULL;
    free(out);
    free(err);
    if (found)
      return true;
    dw_sleep_ms(50);
  } while (dw_now_ms() < deadline);
  return false;
}

/* A connection of the library is named by its program and the library's version: a C program
 * by its own name, a Python script by the script, not the interpreter (every Python rank was
 * "libdeepep-client 0.4.1"). */
START_TEST(clients_name_each_connections_program) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  /* A C program: this test's process, forked. */
  struct dw_child c;
  dw_child_fork(&c);
  if (c.pid == 0) {
    dep_client_t *h = NULL;
    int rc = dep_client_new(&h);
    if (rc == 0)
      rc = dep_connect(h, d.sock);
    if (write(c.rep, rc == 0 ? "k" : "x", 1) != 1)
      _exit(3);
    char g;
    if (read(c.go, &g, 1) < 0)
      _exit(4);
    dep_client_free(h);
    _exit(rc == 0 ? 0 : 1);
  }
  char got;
  ck_assert_int_eq(read(c.rep, &got, 1), 1);
  ck_assert_int_eq(got, 'k');
  char want[200];
  dw_sfmt(want, sizeof want, "%s (libdeepep-client %s)", program_invocation_short_name,
          DEP_VERSION_STRING);
  ck_assert_msg(clients_show(d.sock, want, 0), "no connection named \"%s\"", want);
  /* A Python script, run as torchrun runs one (python3 -u SCRIPT ARGS). */
  char py[300], cmd[1200];
  dw_sfmt(py, sizeof py, "%s/my_trainer.py", d.dir);
  ck_assert_int_eq(tu_write_file(py, ctl_trainer_py), 0);
  dw_sfmt(cmd, sizeof cmd, CTL_PY_ENV "/usr/bin/python3 -u %s %s %s", py,
          tu_bin("libdeepep-client.so"), d.sock);
  FILE *trainer = popen(cmd, "w");
  ck_assert_ptr_nonnull(trainer);
  /* The script connects once python3 has started: 10 s is a ceiling for a loaded machine. */
  dw_sfmt(want, sizeof want, "my_trainer.py (libdeepep-client %s)", DEP_VERSION_STRING);
  ck_assert_msg(clients_show(d.sock, want, 10000),
                "no connection named \"%s\" (is %s built? make all builds it)", want,
                tu_bin("libdeepep-client.so"));
  ck_assert_int_eq(pclose(trainer), 0);
  ck_assert_int_eq(write(c.go, "g", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(c.pid, &st, 0), c.pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status 0x%x", st);
  close(c.rep);
  close(c.go);
  dw_stop_ok(&d);
}
END_TEST

/* ---- the JSON of every command, held to its types ---------------------------------- */

/*
 * A schema of each command's --json object (and of the error object): every key it has, no
 * other, each of its type (a string, an integer, a number, true or false; "?" where null stands
 * for what the text shows as "-"), and each table a list of at least one row of its own.
 * python3's json module parses; argv: NAME=FILE of each output.
 */
static const char ctl_json_schema_py[] =
    "import json, sys\n"
    "S, I, N, B = 'str', 'int', 'num', 'bool'\n"
    "def opt(t): return ('?', t)\n"
    "DEV = {'uuid': S, 'name': S, 'backend': S, 'pool_total_bytes': I, 'pool_used_bytes': I,\n"
    "       'pool_cached_bytes': I, 'pool_held_bytes': I}\n"
    "JOB = {'job_id': S, 'owner_uid': I, 'ranks_attached': I, 'ranks_expected': I, 'world_size': I,\n"
    "       'slab_bytes': I, 'age_ms': I, 'nodes': I, 'remote_ranks': I, 'bytes_out': I,\n"
    "       'bytes_in': I, 'ring_peak': I}\n"
    "OP = {'job': S, 'rank': I, 'op': S, 'device': S, 'state': S, 'calls': I, 'first_ns': opt(I),\n"
    "      'median_ns': opt(I), 'p99_ns': opt(I), 'first_over_median': opt(N),\n"
    "      'gbytes_per_s': opt(N), 'errors': I, 'timeouts': I, 'bytes': I, 'steady_calls': I,\n"
    "      'steady_sum_ns': I}\n"
    "RANK = {'job': S, 'rank': I, 'device': S, 'local_rank': I, 'pid': I, 'state': S, 'age_ms': I,\n"
    "        'ended_ms': opt(I), 'timer': S, 'attach_ns': opt(I), 'attach_wait_ns': opt(I),\n"
    "        'attach_map_ns': opt(I), 'attach_setup_ns': opt(I), 'attach_warmup_ns': opt(I),\n"
    "        'layouts': I, 'dropped': I, 'kernel_ctas': I, 'kernel_ctas_from': S}\n"
    "POOL = {'uuid': S, 'pool_total_bytes': I, 'pool_used_bytes': I, 'pool_cached_bytes': I,\n"
    "        'pool_held_bytes': I}\n"
    "CONN = {'address': S, 'state': S, 'transport': opt(S), 'conns_up': I, 'conns_total': I,\n"
    "        'bytes_in': I, 'bytes_out': I}\n"
    "PEER = {'address': S, 'node': opt(S), 'state': S, 'transport': opt(S), 'wanted': S,\n"
    "        'conns_up': I, 'conns_total': I, 'qps_up': I, 'inbound_up': I, 'rtt_us': I,\n"
    "        'rdma_rtt_us': I, 'bytes_in': I, 'bytes_out': I, 'reconnects': I, 'backoff_ms': I,\n"
    "        'data_out': I, 'data_in': I, 'data_bytes_out': I, 'data_bytes_in': I,\n"
    "        'data_frames_out': I, 'data_frames_in': I, 'last_error': opt(S)}\n"
    "CLIENT = {'pid': I, 'uid': I, 'name': S, 'job': opt(S), 'rank': opt(I), 'local_rank': opt(I),\n"
    "          'device': opt(S), 'connected_ms': I, 'attached_ms': opt(I), 'attached': opt(S)}\n"
    "CHECK = {'check': S, 'result': S, 'detail': S, 'action': S}\n"
    "# A list is [row]: at least one row, each of the row's schema.\n"
    "SCHEMAS = {\n"
    "    'status': {'version': S, 'state': S, 'pid': I, 'uptime_ms': I, 'backend': S,\n"
    "               'proto_version': I, 'clients': I, 'devices': [DEV], 'jobs': [JOB]},\n"
    "    'reload': {'result': S},\n"
    "    'drain': {'result': S},\n"
    "    'drain_wait': {'result': S, 'waited_ms': I},\n"
    "    'peers': {'node': S, 'listen': opt(S), 'auth': S, 'rdma': opt(S), 'nic_bytes': I,\n"
    "              'proxy_threads': I, 'proxy_busy_us': I, 'peers': [PEER]},\n"
    "    'clients': {'left_out': I, 'clients': [CLIENT]},\n"
    "    'stats': {'warn_first_call_ratio': N, 'first_call_warnings': I, 'ended_jobs_kept': I,\n"
    "              'keep_jobs': I, 'keep_ms': I, 'ops': [OP], 'ranks': [RANK], 'pools': [POOL],\n"
    "              'peers': [CONN]},\n"
    "    'doctor': {'ok': B, 'checks': [CHECK]},\n"
    "    'version': {'version': S, 'proto_version': I,\n"
    "                'daemon': opt({'version': S, 'proto_version': I, 'backend': S})},\n"
    "    'genkey': {'key': S},\n"
    "    'error': {'error': {'code': I, 'name': S, 'message': S}},\n"
    "}\n"
    "def check(v, t, where):\n"
    "    if isinstance(t, tuple):\n"
    "        if v is None:\n"
    "            return\n"
    "        t = t[1]\n"
    "    if t == S:\n"
    "        assert isinstance(v, str), (where, 'not a string', v)\n"
    "    elif t == I:\n"
    "        assert isinstance(v, int) and not isinstance(v, bool), (where, 'not an integer', v)\n"
    "    elif t == N:\n"
    "        assert isinstance(v, (int, float)) and not isinstance(v, bool), (where, 'not a number', v)\n"
    "    elif t == B:\n"
    "        assert isinstance(v, bool), (where, 'not true or false', v)\n"
    "    elif isinstance(t, list):\n"
    "        assert isinstance(v, list) and len(v) > 0, (where, 'not a list of rows', v)\n"
    "        for i, row in enumerate(v):\n"
    "            check(row, t[0], '%s[%d]' % (where, i))\n"
    "    else:\n"
    "        assert isinstance(v, dict), (where, 'not an object', v)\n"
    "        assert set(v) == set(t), (where, 'keys', sorted(set(v) ^ set(t)))\n"
    "        for k in t:\n"
    "            check(v[k], t[k], where + '.' + k)\n"
    "try:\n"
    "    for arg in sys.argv[1:]:\n"
    "        name, path = arg.split('=', 1)\n"
    "        text = open(path).read()\n"
    "        assert text.endswith('}\\n') and text.count('\\n') == 1, (name, 'not one line', text)\n"
    "        check(json.loads(text), SCHEMAS[name], name)\n"
    "except AssertionError as e:\n"
    "    sys.exit('%s' % (e,))\n"
    "print('held', len(sys.argv) - 1)\n";

/* deepepctl's --json output of args into dir/name.json, its exit code one of ok0 and ok1. */
static void json_output(const char *dir, const char *name, const char *const *args, int ok0,
                        int ok1, char *list, size_t len) {
  char *out, *err;
  int rc = ctl_run(args, &out, &err);
  ck_assert_msg(rc == ok0 || rc == ok1, "%s: exit %d: %s%s", name, rc, out, err);
  static unsigned n; /* each output a file of its own, a name's schema held by each */
  char path[300];
  dw_sfmt(path, sizeof path, "%s/%u-%s.json", dir, n++, name);
  ck_assert_int_eq(tu_write_file(path, out), 0);
  size_t used = strlen(list);
  dw_sfmt(list + used, len - used, " %s=%s", name, path);
  free(out);
  free(err);
}

/* Every command's --json holds its schema: a daemon with a peer that never answers and a job
 * whose ranks made one call of each op (no steady call: no median), and deepepctl's own
 * connection, which is no rank.  It once said "ok":"true", "rank":0 for no rank, "median_ns":0
 * for none and "listen":"-". */
START_TEST(every_json_output_holds_its_types) {
  struct tu_daemon d;
  dw_start(&d, "peers: [{host: 127.0.0.1, port: 1}]\npeer_insecure: true\npeer_wait_ms: 0\n");
  struct st_rank r[ST_W];
  const struct st_plan plan = {.pairs = 1, .layouts = 1};
  st_job_start(r, &d, "json-types", &plan);
  char list[4096] = "";
  const char *s = d.sock;
  json_output(d.dir, "status", DW_ARGS("-s", s, "--json", "status"), 0, 0, list, sizeof list);
  json_output(d.dir, "peers", DW_ARGS("-s", s, "--json", "peers"), 0, 0, list, sizeof list);
  json_output(d.dir, "clients", DW_ARGS("-s", s, "--json", "clients"), 0, 0, list, sizeof list);
  json_output(d.dir, "stats", DW_ARGS("-s", s, "--json", "stats"), 0, 0, list, sizeof list);
  /* The peer that never answers fails the connections check: exit 1, the object all the same. */
  json_output(d.dir, "doctor", DW_ARGS("-s", s, "--json", "doctor"), 0, 1, list, sizeof list);
  json_output(d.dir, "version", DW_ARGS("-s", s, "--json", "version"), 0, 0, list, sizeof list);
  json_output(d.dir, "reload", DW_ARGS("-s", s, "--json", "reload"), 0, 0, list, sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain"), 0, 0, list, sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain", "--cancel"), 0, 0, list,
              sizeof list);
  json_output(d.dir, "genkey", DW_ARGS("--json", "genkey"), 0, 0, list, sizeof list);
  json_output(d.dir, "error", DW_ARGS("-s", s, "--json", "stats", "no-such-job"), 1, 1, list,
              sizeof list);
  /* Once the job has ended, a drain that waits says how long it waited. */
  st_job_end(r, false);
  json_output(d.dir, "drain_wait", DW_ARGS("-s", s, "--json", "drain", "--wait"), 0, 0, list,
              sizeof list);
  json_output(d.dir, "drain", DW_ARGS("-s", s, "--json", "drain", "--cancel"), 0, 0, list,
              sizeof list);
  char py[300], res[300], cmd[4600];
  dw_sfmt(py, sizeof py, "%s/schema.py", d.dir);
  dw_sfmt(res, sizeof res, "%s/schema.out", d.dir);
  ck_assert_int_eq(tu_write_file(py, ctl_json_schema_py), 0);
  dw_sfmt(cmd, sizeof cmd, "/usr/bin/python3 %s%s > %s 2>&1", py, list, res);
  int rc = system(cmd);
  char *said = dw_slurp(res);
  ck_assert_msg(rc == 0, "a --json output does not hold its schema: %.2000s", said);
  free(said);
  dw_stop_ok(&d);
}
END_TEST

Suite *ctl_suite(void);
Suite *ctl_suite(void) {
  Suite *s = suite_create("ctl");
  TCase *local = tcase_create("local");
  tcase_add_test(local, json_errors_are_one_object_with_code_and_name_and_the_usual_exit_status);
  tcase_add_test(local, version_option_prints_deepepctls_version_and_protocol);
  tcase_add_test(local, drain_options_that_do_not_fit_are_usage_errors_naming_them);
  tcase_add_test(local, size_says_what_a_shape_is_lent_per_rank_before_the_job_starts);
  tcase_add_test(local, a_path_that_is_not_a_socket_is_named_as_such);
  tcase_add_test(local, help_lists_every_command_and_option);
  tcase_add_test(local, stats_with_an_impossible_job_id_is_a_usage_error);
  tcase_add_test(local, genkey_under_json_prints_one_object);
  tcase_add_test(local, a_socket_path_too_long_for_a_unix_socket_is_a_usage_error);
  tcase_add_test(local, a_daemon_that_never_answers_is_given_up_on_in_seconds);
  tcase_add_test(local, text_output_shows_long_strings_whole);
  tcase_add_test(local, a_value_a_row_lacks_is_a_dash_in_text_and_null_in_json);
  tcase_add_test(local, metrics_print_counts_and_bytes_as_exact_integers);
  tcase_add_test(local, metrics_show_the_data_paths_traffic_per_peer_and_job);
  tcase_add_test(local, metrics_quantiles_of_no_steady_call_are_nan);
  tcase_set_timeout(local, 30);
  suite_add_tcase(s, local);

  TCase *daemon = tcase_create("daemon");
  tcase_add_test(daemon, json_errors_carry_the_daemons_reply);
  tcase_add_test(daemon, version_shows_the_daemon_or_says_none_answers);
  tcase_add_test(daemon, status_shows_the_daemons_state);
  tcase_add_test(daemon, status_shows_node_columns_only_for_jobs_that_span_nodes);
  tcase_add_test(daemon, clients_shows_no_rank_for_a_connection_that_is_no_rank);
  tcase_add_test(daemon, peers_without_peers_says_none_are_configured_not_peer_insecure);
  tcase_add_test(daemon, drain_refuses_new_jobs_while_a_gathering_job_completes);
  tcase_add_test(daemon, drain_wait_returns_once_the_last_job_detaches);
  tcase_add_test(daemon, drain_wait_timeout_exits_1_naming_the_jobs_left);
  tcase_add_test(daemon, drain_cancel_lets_new_jobs_in_again);
  tcase_add_test(daemon, every_json_output_holds_its_types);
  tcase_add_test(daemon, clients_name_each_connections_program);
  tcase_set_timeout(daemon, 60);
  suite_add_tcase(s, daemon);
  return s;
}
