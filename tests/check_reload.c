/*
 * check_reload.c — reloading the configuration with a real daemon (DESIGN
 * §9, §10): the file is read off the loop, so clients are served while a
 * reload waits for it; a client that leaves before its answer harms no
 * other; a reload asked for meanwhile follows and reads the file again; the
 * answer and the log name every live key that changed, with both values;
 * users and groups the file names must exist.  And the log itself: a time
 * stamp on every line off the journal, and client bytes escaped.
 *
 * A reload is made to wait by a write lease on the file (fcntl F_SETLEASE):
 * the daemon's open(2) of it then blocks until the test lets go, as a
 * read from a slow disk or NFS would, which makes "while a reload runs"
 * last exactly as long as a test needs.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemonwire.h"
#include "log.h"

/* The daemon's file as tu_daemon_start wrote it, plus `extra`, put in place atomically (a
 * rename: a write to the file itself would wait on the test's own lease). */
static void rewrite_conf(const struct tu_daemon *d, const char *base, const char *extra) {
  char tmp[300];
  dw_sfmt(tmp, sizeof tmp, "%s.new", d->conf);
  size_t len = strlen(base) + strlen(extra) + 1;
  char *text = malloc(len);
  ck_assert_ptr_nonnull(text);
  snprintf(text, len, "%s%s", base, extra);
  ck_assert_int_eq(tu_write_file(tmp, text), 0);
  ck_assert_int_eq(rename(tmp, d->conf), 0);
  free(text);
}

/* A write lease on path: until lease_release, any other process's open(2) of it waits. */
static int lease_hold(const char *path) {
  signal(SIGIO, SIG_IGN); /* the kernel's notice that someone waits */
  int fd = open(path, O_RDONLY);
  ck_assert_int_ge(fd, 0);
  ck_assert_msg(fcntl(fd, F_SETLEASE, F_WRLCK) == 0, "F_SETLEASE on %s: %s", path,
                strerror(errno));
  return fd;
}

static void lease_release(int fd) {
  ck_assert_int_eq(fcntl(fd, F_SETLEASE, F_UNLCK), 0);
  close(fd);
}

/* Whether one of pid's threads is inside open(2) (/proc/PID/task/TID/syscall). */
static bool thread_in_open(pid_t pid) {
  char dir[64];
  dw_sfmt(dir, sizeof dir, "/proc/%d/task", (int)pid);
  DIR *dp = opendir(dir);
  if (dp == NULL)
    return false;
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(dp)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[128];
    dw_sfmt(path, sizeof path, "%s/%s/syscall", dir, e->d_name);
    FILE *f = fopen(path, "r");
    long nr = -1;
    if (f != NULL) {
      if (fscanf(f, "%ld", &nr) != 1)
        nr = -1;
      fclose(f);
    }
    found = nr == SYS_openat;
#ifdef SYS_open
    found = found || nr == SYS_open;
#endif
  }
  closedir(dp);
  return found;
}

/* Wait (up to 5 s) until the daemon is blocked opening its leased file. */
static void wait_reload_blocked(const struct tu_daemon *d) {
  for (int i = 0; i < 500; i++) {
    if (thread_in_open(d->pid))
      return;
    dw_sleep_ms(10);
  }
  ck_abort_msg("no thread of deepepd is opening the leased file");
}

/* The next frame on fd is RELOAD_OK for req, in *m. */
static void expect_reload_ok(int fd, uint32_t req, struct dep_msg_reload_ok *m) {
  struct dw_frame *f = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(fd, f, 5000), 0);
  ck_assert_str_eq(proto_type_name(f->h.type), "RELOAD_OK");
  ck_assert_uint_eq(f->h.request_id, req);
  ck_assert_int_eq(proto_decode_reload_ok(f->body, f->h.body_len, m), 0);
  free(f);
}

/* STATUS on fd answers within ms milliseconds. */
static void expect_status_within(int fd, int ms) {
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_STATUS, 9, NULL), 0);
  struct dw_frame *f = dw_frame_new();
  int rc = dw_recv_frame(fd, f, ms);
  int64_t took = dw_now_ms() - t0;
  ck_assert_msg(rc == 0, "STATUS got no answer in %d ms while a reload waited for its file", ms);
  ck_assert_str_eq(proto_type_name(f->h.type), "STATUS_OK");
  free(f);
  ck_assert_msg(took < ms, "STATUS took %lld ms", (long long)took);
}

/* ---- the loop serves while a reload reads ------------------------------------------------ */

START_TEST(test_status_is_answered_while_a_reload_waits_for_its_file) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *base = dw_slurp(d.conf);
  int a = dw_client(&d), b = dw_client(&d);
  rewrite_conf(&d, base, "limits:\n  max_clients: 512\n");
  int lease = lease_hold(d.conf);
  ck_assert_int_eq(dw_send_frame(a, DEP_MSG_RELOAD, 2, NULL), 0);
  wait_reload_blocked(&d);
  /* The reload waits for its file and another client is served meanwhile. */
  expect_status_within(b, 1000);
  int c = dw_client(&d); /* and a new one greeted */
  expect_status_within(c, 1000);
  dw_expect_silence(a, 200);
  lease_release(lease);
  struct dep_msg_reload_ok m;
  expect_reload_ok(a, 2, &m);
  ck_assert_msg(strstr(m.message, "limits.max_clients 1024 -> 512") != NULL, "RELOAD_OK said: %s",
                m.message);
  close(a);
  close(b);
  close(c);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_sighup_reloads_off_the_loop_too) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *base = dw_slurp(d.conf);
  int b = dw_client(&d);
  rewrite_conf(&d, base, "limits:\n  max_jobs: 9\n");
  int lease = lease_hold(d.conf);
  kill(d.pid, SIGHUP);
  wait_reload_blocked(&d);
  expect_status_within(b, 1000);
  ck_assert(!dw_log_has(&d, "reload: applied", 0));
  lease_release(lease);
  char want[400];
  dw_sfmt(want, sizeof want, "reload: applied %s: limits.max_jobs 64 -> 9", d.conf);
  ck_assert(dw_log_has(&d, want, 3000));
  close(b);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

/*
 * The answer goes to the connection that asked, found by its serial id: one
 * that closed is skipped, and a connection opened since (whose memory may be
 * the closed one's) gets nothing it did not ask for.
 */
START_TEST(test_a_client_gone_before_its_answer_harms_no_other) {
  struct tu_daemon d;
  dw_start(&d, "log_level: debug\n");
  char *base = dw_slurp(d.conf);
  int a = dw_client(&d);
  rewrite_conf(&d, base, "limits:\n  max_clients: 512\n");
  int lease = lease_hold(d.conf);
  ck_assert_int_eq(dw_send_frame(a, DEP_MSG_RELOAD, 2, NULL), 0);
  wait_reload_blocked(&d);
  close(a);
  ck_assert(dw_log_has(&d, "): disconnected", 3000));
  int c = dw_client(&d);
  lease_release(lease);
  ck_assert(dw_log_has(&d, "left before its RELOAD was answered", 3000));
  dw_expect_silence(c, 300);
  expect_status_within(c, 1000);
  close(c);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

/* A reload asked for while one waits follows it and reads the file as it is by then: the
 * first applies what it opened, the second what replaced it. */
START_TEST(test_a_reload_asked_for_meanwhile_follows_and_reads_the_file_again) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *base = dw_slurp(d.conf);
  int a = dw_client(&d), b = dw_client(&d);
  rewrite_conf(&d, base, "limits:\n  max_clients: 512\n");
  int lease = lease_hold(d.conf);
  ck_assert_int_eq(dw_send_frame(a, DEP_MSG_RELOAD, 2, NULL), 0);
  wait_reload_blocked(&d);
  rewrite_conf(&d, base, "limits:\n  max_clients: 256\n");
  ck_assert_int_eq(dw_send_frame(b, DEP_MSG_RELOAD, 3, NULL), 0);
  ck_assert(dw_log_has(&d, "this reload follows, reading it again", 3000));
  dw_expect_silence(b, 100);
  lease_release(lease);
  struct dep_msg_reload_ok m;
  expect_reload_ok(a, 2, &m);
  ck_assert_msg(strstr(m.message, "limits.max_clients 1024 -> 512") != NULL, "first: %s",
                m.message);
  expect_reload_ok(b, 3, &m);
  ck_assert_msg(strstr(m.message, "limits.max_clients 512 -> 256") != NULL, "second: %s",
                m.message);
  close(a);
  close(b);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

/* ---- what a reload says ------------------------------------------------------------------ */

START_TEST(test_reload_names_each_changed_live_key_with_both_values) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char *base = dw_slurp(d.conf);
  int fd = dw_client(&d);
  rewrite_conf(&d, base, "limits:\n  max_clients: 512\nlog_level: debug\n");
  struct dep_msg_reload_ok m;
  dw_reload(fd, 2, &m);
  char want[400];
  dw_sfmt(want, sizeof want,
          "applied %s: limits.max_clients 1024 -> 512, log_level info -> debug; nothing needs a "
          "restart", d.conf);
  ck_assert_str_eq(m.message, want);
  /* ... and names them one by one, as `deepepctl reload --json` lists them. */
  ck_assert_uint_eq(m.n_applied, 2);
  ck_assert_str_eq(m.applied[0], "limits.max_clients");
  ck_assert_str_eq(m.applied[1], "log_level");
  ck_assert_uint_eq(m.n_restart, 0);
  dw_sfmt(want, sizeof want,
          "reload: applied %s: limits.max_clients 1024 -> 512, log_level info -> debug", d.conf);
  ck_assert(dw_log_has(&d, want, 3000));
  /* The same file again changes nothing, and says so. */
  dw_reload(fd, 3, &m);
  dw_sfmt(want, sizeof want, "applied %s: no live key changed; nothing needs a restart", d.conf);
  ck_assert_str_eq(m.message, want);
  ck_assert_uint_eq(m.n_applied, 0);
  ck_assert_uint_eq(m.n_restart, 0);
  close(fd);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_missing_accounts_are_warned_at_start_and_on_reload) {
  struct tu_daemon d;
  dw_start(&d, "allow:\n  users: [root, no-such-user-4d2]\n");
  char want[400];
  dw_sfmt(want, sizeof want,
          "<4>%s: 'allow.users' lists 'no-such-user-4d2': no such user on this host", d.conf);
  ck_assert(dw_log_has(&d, want, 3000));
  char *base = dw_slurp(d.conf);
  int fd = dw_client(&d);
  rewrite_conf(&d, base, "  groups: [no-such-group-4d3]\n");
  struct dep_msg_reload_ok m;
  dw_reload(fd, 2, &m);
  ck_assert_msg(strstr(m.message, "'allow.groups' lists 'no-such-group-4d3': no such group") !=
                    NULL,
                "RELOAD_OK said: %s", m.message);
  ck_assert(dw_log_has(&d, "<4>reload: 'allow.users' lists 'no-such-user-4d2'", 3000));
  close(fd);
  free(base);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_a_missing_socket_group_stops_the_start) {
  char dir[200], conf[300], out[300], yaml[600];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(conf, sizeof conf, "%s/deepepd.yaml", dir);
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s/d.sock\n  group: no-such-group-4d2\nbackend: host\n"
          "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n", dir);
  ck_assert_int_eq(tu_write_file(conf, yaml), 0);
  const char *args[] = {"-c", conf, NULL};
  char want[400];
  dw_sfmt(want, sizeof want, "<3>%s: 'socket.group' is 'no-such-group-4d2': no such group", conf);
  dw_deepepd_exits(args, out, 1, want);
  tu_rmtree(dir);
}
END_TEST

START_TEST(test_an_empty_socket_option_is_refused) {
  char dir[200], out[300];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  /* With --check-config the old behaviour (the default socket) would pass as "ok". */
  const char *args[] = {"-s", "", "--check-config", "config/deepepd.yaml", NULL};
  dw_deepepd_exits(args, out, 2, "deepepd: -s/--socket needs a path");
  tu_rmtree(dir);
}
END_TEST

/* ---- the log ----------------------------------------------------------------------------- */

START_TEST(test_log_escape_writes_each_unsafe_byte_as_hex) {
  char out[64];
  static const char in[] = "a\x1b[31mb\x7f\\\n\xc3\xa9\x00z";
  ck_assert_str_eq(log_escape(in, sizeof in - 1, out, sizeof out),
                   "a\\x1b[31mb\\x7f\\x5c\\x0a\\xc3\\xa9\\x00z");
  /* A short buffer is cut before an escape that does not fit, and terminated. */
  char small[6];
  ck_assert_str_eq(log_escape("ab\x1b", 3, small, sizeof small), "ab");
  ck_assert_str_eq(log_escape("abcdefgh", 8, small, sizeof small), "abcde");
  ck_assert_str_eq(log_escape("", 0, small, sizeof small), "");
}
END_TEST

/* Each line of the daemon's log matches `pattern` (POSIX extended); a failing one is shown. */
static void every_log_line_matches(const struct tu_daemon *d, const char *pattern) {
  regex_t re;
  ck_assert_int_eq(regcomp(&re, pattern, REG_EXTENDED | REG_NOSUB), 0);
  char *log = tu_daemon_log(d);
  int lines = 0;
  for (char *line = strtok(log, "\n"); line != NULL; line = strtok(NULL, "\n"), lines++)
    ck_assert_msg(regexec(&re, line, 0, NULL, 0) == 0, "log line \"%s\" is not /%s/", line,
                  pattern);
  ck_assert_int_gt(lines, 2);
  free(log);
  regfree(&re);
}

START_TEST(test_log_lines_carry_the_local_time_off_the_journal) {
  /* No $JOURNAL_STREAM, and one that names some other stream (inherited from a service): both
   * mean stderr is not the journal. */
  for (int i = 0; i < 2; i++) {
    if (i == 0)
      unsetenv("JOURNAL_STREAM");
    else
      setenv("JOURNAL_STREAM", "1:1", 1);
    time_t before = time(NULL);
    struct tu_daemon d;
    dw_start(&d, NULL);
    every_log_line_matches(&d, "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3} "
                               "<[0-7]>[^ ]");
    /* The stamp is the local time now. */
    char *log = tu_daemon_log(&d);
    struct tm tm = {0};
    ck_assert_ptr_nonnull(strptime(log, "%Y-%m-%dT%H:%M:%S", &tm));
    tm.tm_isdst = -1;
    time_t stamp = mktime(&tm);
    ck_assert_msg(stamp >= before - 1 && stamp <= time(NULL) + 1, "stamped %s", log);
    free(log);
    dw_stop_ok(&d);
  }
}
END_TEST

START_TEST(test_journal_lines_carry_only_the_priority) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  char log[300], js[64];
  dw_sfmt(log, sizeof log, "%s/deepepd.log", d.dir);
  ck_assert_int_eq(tu_write_file(log, ""), 0);
  struct stat st;
  ck_assert_int_eq(stat(log, &st), 0);
  dw_sfmt(js, sizeof js, "%llu:%llu", (unsigned long long)st.st_dev,
          (unsigned long long)st.st_ino);
  setenv("JOURNAL_STREAM", js, 1);
  ck_assert_msg(tu_daemon_start_in(&d, d.dir, NULL) == 0, "deepepd did not start");
  every_log_line_matches(&d, "^<[0-7]>[^ ]");
  dw_stop_ok(&d);
}
END_TEST

/* A HELLO name with terminal escapes, on the version-mismatch path and on the normal one. */
START_TEST(test_a_hello_name_reaches_log_and_error_escaped) {
  struct tu_daemon d;
  dw_start(&d, "log_level: debug\n");
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION + 1, .pid = (uint32_t)getpid()};
  dw_sfmt(h.name, sizeof h.name, "\x1b[31mX");
  int fd = tu_connect_raw(d.sock);
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_HELLO, 1, &h), 0);
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(fd, DEP_ERR_VERSION, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "the client (\\x1b[31mX) speaks version") != NULL, "said: %s", msg);
  ck_assert_ptr_null(strchr(msg, '\x1b'));
  close(fd);
  ck_assert(dw_log_has(&d, "the client (\\x1b[31mX) speaks version", 3000));
  h.version = DEP_PROTO_VERSION;
  fd = tu_connect_raw(d.sock);
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_HELLO, 1, &h), 0);
  dw_expect_hello_ok(fd);
  ck_assert(dw_log_has(&d, "HELLO from \"\\x1b[31mX\"", 3000));
  close(fd);
  char *log = tu_daemon_log(&d);
  ck_assert_msg(strchr(log, '\x1b') == NULL, "an ESC byte reached the log:\n%s", log);
  free(log);
  dw_stop_ok(&d);
}
END_TEST

Suite *reload_suite(void);
Suite *reload_suite(void) {
  Suite *s = suite_create("reload");
  struct {
    const char *name;
    const TTest *tests[8];
  } cases[] = {
      {"async",
       {test_status_is_answered_while_a_reload_waits_for_its_file,
        test_sighup_reloads_off_the_loop_too, test_a_client_gone_before_its_answer_harms_no_other,
        test_a_reload_asked_for_meanwhile_follows_and_reads_the_file_again, NULL}},
      {"report",
       {test_reload_names_each_changed_live_key_with_both_values,
        test_missing_accounts_are_warned_at_start_and_on_reload,
        test_a_missing_socket_group_stops_the_start, test_an_empty_socket_option_is_refused,
        NULL}},
      {"log",
       {test_log_escape_writes_each_unsafe_byte_as_hex,
        test_log_lines_carry_the_local_time_off_the_journal,
        test_journal_lines_carry_only_the_priority,
        test_a_hello_name_reaches_log_and_error_escaped, NULL}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TCase *tc = tcase_create(cases[i].name);
    tcase_set_timeout(tc, 60);
    for (size_t k = 0; cases[i].tests[k] != NULL; k++)
      tcase_add_test(tc, cases[i].tests[k]);
    suite_add_tcase(s, tc);
  }
  return s;
}
