/*
 * check_ctl.c — deepepctl as its manual page describes it, run as the real
 * binary against the real deepepd: errors as JSON objects under --json
 * with the usual exit codes, --version and `version` with and without a
 * daemon, drain / drain --wait / drain --cancel end to end (the ATTACHes
 * they refuse and let through are spoken on raw sockets, daemonwire.h),
 * the daemon's state in status, a socket path that is not a socket, and a
 * help that lists every command.  The text and metrics renderers are
 * check_ctl_render.c's suite, every command's JSON held to its types and
 * the clients' program names check_ctl_json.c's; running deepepctl is
 * ctlrun.c's.
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
#include "ctlrun.h"
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
 * NODES, REMOTE, TX, RX, RING_PEAK and PAYLOAD_TX when a job spans nodes); the JSON keeps
 * their keys. */
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
                            "\"ring_peak\":0,\"payload_out\":0}") != NULL,
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
  tcase_set_timeout(daemon, 60);
  suite_add_tcase(s, daemon);
  return s;
}
