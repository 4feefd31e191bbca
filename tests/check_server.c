/*
 * check_server.c — deepepd's socket and admission as a whole process: who
 * the socket is taken from at start (a live daemon keeps it, a dead one's
 * is replaced), where it may be made, how many connections each kind of
 * peer gets (the HELLO deadline, max_clients and the reserve, per uid, the
 * fd limit), and the start-up during which the pools are being made.  How
 * it answers what it cannot read is check_server_proto.c's.
 * Other uids are played by forked children that become uid 65534 (the
 * tests run as root; without root those parts are skipped).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemonwire.h"
#include "deepep.h"
#include "proto.h"
#include "testutil.h"

#define NOBODY 65534
#define ALLOW_NOBODY "allow:\n  users: [\"65534\"]\n"

/* ---- helpers ------------------------------------------------------------- */

/* Run fn(arg) in a child that became uid/gid 65534; its exit code (0: as expected). */
static int as_nobody(int (*fn)(void *), void *arg) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
      _exit(100);
    _exit(fn(arg));
  }
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 200 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

/* Send HELLO on a fresh connection; -1 when it cannot. */
static int hello_conn(const char *sock) {
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return -1;
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION, .pid = (uint32_t)getpid()};
  snprintf(h.name, sizeof h.name, "check_server");
  (void)dw_send_frame(fd, DEP_MSG_HELLO, 1, &h); /* a refused peer may be closed first */
  return fd;
}

/*
 * The first frame on fd within ms: its type (and an ERROR's code and
 * message), -1 on EOF, -2 on timeout.  No ck_assert: children use it.
 */
static int first_frame(int fd, int ms, int *code, char *msg, size_t len) {
  static struct dw_frame f;
  int rc = dw_recv_frame(fd, &f, ms);
  if (rc != 0)
    return rc == -2 ? -2 : -1;
  if (f.h.type == DEP_MSG_ERROR) {
    struct dep_msg_error e;
    if (proto_decode_error(f.body, f.h.body_len, &e) != 0)
      return -3;
    if (code != NULL)
      *code = e.code;
    if (msg != NULL)
      snprintf(msg, len, "%s", e.message);
  }
  return f.h.type;
}

/* A greeted connection (HELLO_OK read), or -1.  No ck_assert: children use it. */
static int greeted(const char *sock) {
  int fd = hello_conn(sock);
  if (fd < 0)
    return -1;
  if (first_frame(fd, 5000, NULL, NULL, 0) != DEP_MSG_HELLO_OK) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Refused with DEP_ERR_LIMIT, the message naming `key`, then closed: true. */
static bool refused_naming(int fd, const char *key, char *msg, size_t len) {
  int code = 0;
  msg[0] = '\0';
  if (first_frame(fd, 5000, &code, msg, len) != DEP_MSG_ERROR || code != DEP_ERR_LIMIT ||
      strstr(msg, key) == NULL)
    return false;
  return first_frame(fd, 5000, NULL, NULL, 0) == -1;
}

static bool is_root(const char *test) {
  if (getuid() == 0)
    return true;
  tu_skip(test, "needs root to become uid %d", NOBODY);
  return false;
}

/* ---- who has the socket (item: restart after SIGKILL) --------------------- */

START_TEST(test_restart_right_after_sigkill) {
  struct tu_daemon d;
  /* A larger pool makes the dead daemon's teardown take longer. */
  dw_start(&d, "pool:\n  host_size: 256MiB\n  chunk_size: 2MiB\n");
  int old_client = dw_client(&d);
  pid_t dead = d.pid;
  ck_assert_int_eq(kill(dead, SIGKILL), 0);
  /* At once, before the dead one is even reaped. */
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  printf("%s: the new daemon started %lld ms after the SIGKILL\n", __func__,
         (long long)(dw_now_ms() - t0));
  ck_assert_int_eq(waitpid(dead, NULL, 0), dead);
  ck_assert(dw_log_has(&d, "stale socket", 1000));
  int fd = dw_client(&d);
  struct dep_status *s = dw_status(fd);
  ck_assert_uint_eq(s->pid, (uint32_t)d.pid);
  dep_status_free(s);
  close(fd);
  close(old_client);
  dw_stop_ok(&d);
}
END_TEST

/*
 * A listening socket whose process is gone: what a SIGKILLed daemon leaves
 * until the kernel has torn it down (for a large daemon, most of a
 * second).  A child calls listen(), so the peer credentials name it, and
 * exits; this process keeps the socket, which accepts and never answers.
 */
START_TEST(test_socket_of_a_dead_process_is_replaced) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s/d.sock", d.dir);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  pid_t child = fork();
  ck_assert_int_ge(child, 0);
  if (child == 0)
    _exit(listen(s, 16) == 0 ? 0 : 1);
  int st;
  ck_assert_int_eq(waitpid(child, &st, 0), child);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  int probe = tu_connect_raw(sa.sun_path);
  ck_assert_msg(probe >= 0, "the dead process's socket should still accept");
  close(probe);

  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  int64_t took = dw_now_ms() - t0;
  printf("%s: started in %lld ms beside the silent socket\n", __func__, (long long)took);
  char want[128];
  dw_sfmt(want, sizeof want, "replaced the stale socket %s: its daemon (pid %d)", sa.sun_path,
          (int)child);
  ck_assert_msg(dw_log_has(&d, want, 1000), "no \"%s\" in the log", want);
  int fd = dw_client(&d);
  close(fd);
  close(s);
  dw_stop_ok(&d);
}
END_TEST

/* A live process that holds the socket and does not answer may be a hung daemon: left alone. */
START_TEST(test_silent_live_process_keeps_the_socket) {
  char dir[200], conf[300], out[300], yaml[600];
  tu_tmpdir(dir, sizeof dir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s/d.sock", dir);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(s, 16), 0);
  dw_sfmt(conf, sizeof conf, "%s/deepepd.yaml", dir);
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s\nbackend: host\npool:\n  host_size: 4MiB\n  chunk_size: 2MiB\n",
          sa.sun_path);
  ck_assert_int_eq(tu_write_file(conf, yaml), 0);
  const char *args[] = {"-c", conf, NULL};
  char want[300];
  dw_sfmt(want, sizeof want, "<3>process %d holds %s and accepts connections but did not answer",
          (int)getpid(), sa.sun_path);
  dw_deepepd_exits(args, out, 1, want);
  struct stat sb;
  ck_assert_int_eq(stat(sa.sun_path, &sb), 0);
  close(s);
  tu_rmtree(dir);
}
END_TEST

/* ---- where the socket may be made ----------------------------------------- */

START_TEST(test_missing_socket_directory_is_made) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  char rundir[300], sock[320];
  dw_sfmt(rundir, sizeof rundir, "%s/run", d.dir);
  dw_sfmt(sock, sizeof sock, "%s/deepepd.sock", rundir);
  mode_t old = umask(077); /* the daemon's umask must not narrow it */
  struct tu_daemon_opts o = {.socket = sock};
  int rc = tu_daemon_start_opts(&d, d.dir, NULL, &o);
  umask(old);
  ck_assert_int_eq(rc, 0);
  struct stat sb;
  ck_assert_int_eq(stat(rundir, &sb), 0);
  ck_assert(S_ISDIR(sb.st_mode));
  ck_assert_uint_eq(sb.st_mode & 07777, 0755);
  char want[400];
  dw_sfmt(want, sizeof want, "made the socket's directory %s (mode 0755)", rundir);
  ck_assert(dw_log_has(&d, want, 1000));
  int fd = dw_client(&d);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* The daemon, as uid 65534, fails on a socket path it may not make; its log. */
static char *failed_start_as_nobody(struct tu_daemon *d, const char *sock) {
  struct tu_daemon_opts o = {.socket = sock, .uid = NOBODY, .wait = TU_WAIT_NONE};
  ck_assert_int_eq(tu_daemon_start_opts(d, d->dir, NULL, &o), 0);
  int st = tu_daemon_wait_exit(d, 10000);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 1, "wait status %d", st);
  return tu_daemon_log(d);
}

START_TEST(test_socket_setup_failures_are_errors) {
  if (!is_root(__func__))
    return;
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir); /* root's, 0755: uid 65534 may not write in it */
  char sock[300], want[400];
  dw_sfmt(sock, sizeof sock, "%s/d.sock", d.dir);
  char *log = failed_start_as_nobody(&d, sock);
  dw_sfmt(want, sizeof want, "<3>cannot bind the socket %s: Permission denied", sock);
  ck_assert_msg(strstr(log, want) != NULL, "no \"%s\" in:\n%s", want, log);
  free(log);
  unlink(d.log);
  /* Its directory missing, in a place it may not make one. */
  dw_sfmt(sock, sizeof sock, "%s/run/d.sock", d.dir);
  log = failed_start_as_nobody(&d, sock);
  dw_sfmt(want, sizeof want, "<3>cannot make the socket %s: mkdir %s/run: Permission denied",
          sock, d.dir);
  ck_assert_msg(strstr(log, want) != NULL, "no \"%s\" in:\n%s", want, log);
  free(log);
  tu_daemon_cleanup(&d);
}
END_TEST

/* ---- the HELLO deadline ---------------------------------------------------- */

enum { IDLE_CONNS = 200 };

/* As uid 65534: IDLE_CONNS connections that never say HELLO are told and closed in time. */
static int idle_child(void *arg) {
  const char *sock = arg;
  static int fds[IDLE_CONNS];
  int greeter = greeted(sock);
  if (greeter < 0)
    return 1;
  int64_t t0 = dw_now_ms();
  for (int i = 0; i < IDLE_CONNS; i++)
    if ((fds[i] = tu_connect_raw(sock)) < 0)
      return 2;
  int64_t first = -1;
  for (int i = 0; i < IDLE_CONNS; i++) {
    int code = 0;
    char msg[DEP_MSG_TEXT_MAX];
    int left = (int)(t0 + 5000 - dw_now_ms());
    if (first_frame(fds[i], left > 0 ? left : 1, &code, msg, sizeof msg) != DEP_MSG_ERROR)
      return 3; /* no word within 5 s: the connection was left to hold its place */
    if (first < 0)
      first = dw_now_ms() - t0;
    if (code != DEP_ERR_TIMEOUT || strstr(msg, "limits.hello_timeout_ms") == NULL)
      return 4;
    if (first_frame(fds[i], 2000, NULL, NULL, 0) != -1)
      return 5;
    close(fds[i]);
  }
  if (first < 250)
    return 6; /* closed before its time */
  printf("idle_child: the first of %d idle connections was closed after %lld ms, the last "
         "after %lld ms\n",
         IDLE_CONNS, (long long)first, (long long)(dw_now_ms() - t0));
  fflush(stdout);
  /* The connection that said HELLO is still served. */
  if (dw_send_frame(greeter, DEP_MSG_STATUS, 2, NULL) != 0 ||
      first_frame(greeter, 5000, NULL, NULL, 0) != DEP_MSG_STATUS_OK)
    return 7;
  close(greeter);
  return 0;
}

START_TEST(test_connections_without_hello_are_closed) {
  if (!is_root(__func__))
    return;
  struct tu_daemon d;
  dw_start(&d, ALLOW_NOBODY "limits:\n  hello_timeout_ms: 300\n");
  ck_assert_int_eq(as_nobody(idle_child, d.sock), 0);
  ck_assert(dw_log_has(&d, "that sent no HELLO within 300 ms (limits.hello_timeout_ms)", 1000));
  dw_stop_ok(&d);
}
END_TEST

/* ---- max_clients and the reserve ------------------------------------------- */

enum { MAX_CLIENTS = 16 };

struct filler {
  const char *sock;
  int ready[2]; /* the child writes one byte once it holds its connections */
  int done[2];  /* the parent writes one byte when it may let them go */
  int n;        /* connections it holds */
  const char *key; /* the limit its next connection must be refused by */
};

static int filler_child(void *arg) {
  struct filler *f = arg;
  close(f->ready[0]);
  close(f->done[1]);
  static int fds[MAX_CLIENTS];
  for (int i = 0; i < f->n; i++)
    if ((fds[i] = greeted(f->sock)) < 0)
      return 1;
  int extra = hello_conn(f->sock);
  char msg[DEP_MSG_TEXT_MAX];
  if (extra < 0 || !refused_naming(extra, f->key, msg, sizeof msg)) {
    fprintf(stderr, "filler_child: the connection past the limit got: %s\n", msg);
    return 2;
  }
  close(extra);
  if (write(f->ready[1], "r", 1) != 1)
    return 3;
  char c;
  if (read(f->done[0], &c, 1) != 1)
    return 4;
  return 0;
}

/* Fork a filler as uid 65534 and wait until it holds its connections; its pid. */
static pid_t filler_start(struct filler *f) {
  ck_assert_int_eq(pipe(f->ready), 0);
  ck_assert_int_eq(pipe(f->done), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
      _exit(100);
    _exit(filler_child(f));
  }
  close(f->ready[1]);
  close(f->done[0]);
  char c;
  ck_assert_msg(read(f->ready[0], &c, 1) == 1, "the uid %d child did not fill its places",
                NOBODY);
  return pid;
}

static void filler_stop(struct filler *f, pid_t pid) {
  ck_assert_int_eq(write(f->done[1], "d", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "filler: wait status %d", st);
  close(f->ready[0]);
  close(f->done[1]);
}

START_TEST(test_reserved_clients_let_root_in_when_others_fill_max_clients) {
  if (!is_root(__func__))
    return;
  struct tu_daemon d;
  char yaml[256];
  dw_sfmt(yaml, sizeof yaml, ALLOW_NOBODY "limits:\n  max_clients: %d\n  reserved_clients: 2\n",
          MAX_CLIENTS);
  dw_start(&d, yaml);
  struct filler f = {.sock = d.sock, .n = MAX_CLIENTS, .key = "limits.max_clients"};
  pid_t pid = filler_start(&f);
  /* Root gets the reserve: deepepctl status still works. */
  int a = dw_client(&d);
  struct dep_status *s = dw_status(a);
  ck_assert_uint_eq(s->num_clients, MAX_CLIENTS + 1);
  dep_status_free(s);
  int b = dw_client(&d);
  /* The reserve is bounded too. */
  int c = hello_conn(d.sock);
  char msg[DEP_MSG_TEXT_MAX];
  ck_assert_msg(refused_naming(c, "limits.reserved_clients", msg, sizeof msg), "said: %s", msg);
  close(c);
  filler_stop(&f, pid);
  close(a);
  close(b);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_max_clients_per_uid) {
  if (!is_root(__func__))
    return;
  struct tu_daemon d;
  dw_start(&d, ALLOW_NOBODY "limits:\n  max_clients_per_uid: 4\n");
  struct filler f = {.sock = d.sock, .n = 4, .key = "limits.max_clients_per_uid"};
  pid_t pid = filler_start(&f);
  /* Another uid is not held back by uid 65534's connections. */
  int fds[6];
  for (int i = 0; i < 6; i++)
    fds[i] = dw_client(&d);
  ck_assert(dw_log_has(&d, "uid 65534 already has 4 connections", 1000));
  filler_stop(&f, pid);
  for (int i = 0; i < 6; i++)
    close(fds[i]);
  dw_stop_ok(&d);
}
END_TEST

/* ---- the fd limit ------------------------------------------------------------ */

START_TEST(test_max_clients_is_clamped_to_the_fd_limit) {
  enum { NOFILE = 512, N = 600 };
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  struct tu_daemon_opts o = {.nofile = NOFILE};
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir, "limits:\n  max_clients: 2000\n", &o), 0);
  ck_assert(dw_log_has(&d, "limits.max_clients clamped to", 1000));
  static int fds[N];
  int64_t t0 = dw_now_ms();
  for (int i = 0; i < N; i++) {
    fds[i] = hello_conn(d.sock);
    ck_assert_int_ge(fds[i], 0);
  }
  /* Every client hears at once: served, or refused with DEP_ERR_LIMIT. */
  int served = 0, refused = 0;
  for (int i = 0; i < N; i++) {
    int code = 0;
    char msg[DEP_MSG_TEXT_MAX];
    int left = (int)(t0 + 10000 - dw_now_ms());
    int type = first_frame(fds[i], left > 0 ? left : 1, &code, msg, sizeof msg);
    ck_assert_msg(type != -2, "client %d heard nothing within 10 s", i);
    if (type == DEP_MSG_HELLO_OK) {
      served++;
    } else {
      ck_assert_msg(type == DEP_MSG_ERROR && code == DEP_ERR_LIMIT,
                    "client %d: frame %d, code %d: %s", i, type, code, msg);
      refused++;
    }
  }
  int64_t took = dw_now_ms() - t0;
  printf("%s: RLIMIT_NOFILE %d: %d clients served, %d refused with DEP_ERR_LIMIT, all within "
         "%lld ms\n",
         __func__, NOFILE, served, refused, (long long)took);
  ck_assert_int_gt(served, 0);
  ck_assert_int_lt(served, NOFILE);
  ck_assert_int_gt(refused, 0);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  dw_stop_ok(&d);
}
END_TEST

/* The lowest fd a daemon started with opts has free once idle (its fds are below). */
static int idle_fds(const char *yaml, const struct tu_daemon_opts *o) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir, yaml, o), 0);
  int n = -1, last;
  do { /* until the readiness probe's connection is gone */
    last = n;
    dw_sleep_ms(100);
    n = tu_lowest_free_fd(d.pid);
  } while (n != last);
  dw_stop_ok(&d);
  return n;
}

/*
 * With every fd taken (RLIMIT_NOFILE just what an idle daemon holds), a
 * client still hears why, at once: the daemon gives up its spare fd to
 * accept and refuse it.  Nothing else is sent: not even a readiness probe.
 * The limit is lowered under the running, idle daemon (prlimit), to the
 * lowest fd it has free: started at that limit, the daemon would race its
 * own start-up's transient fds (and under ASan, the runtime's, which reads
 * /proc/self/maps as each pool thread starts) and could fail to make its
 * pools instead.
 */
START_TEST(test_out_of_fds_refuses_with_limit) {
  const char *yaml = "pool:\n  host_size: 4MiB\n  chunk_size: 2MiB\n";
  struct tu_daemon_opts o = {.nofile = 256};
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir, yaml, &o), 0);
  int base = -1, last;
  do { /* until the readiness probe's connection is gone */
    last = base;
    dw_sleep_ms(100);
    base = tu_lowest_free_fd(d.pid);
  } while (base != last);
  ck_assert_int_gt(base, 3);
  struct rlimit lim = {.rlim_cur = (rlim_t)base, .rlim_max = (rlim_t)base};
  ck_assert_msg(prlimit(d.pid, RLIMIT_NOFILE, &lim, NULL) == 0, "prlimit: %s", strerror(errno));
  for (int i = 0; i < 10; i++) {
    int64_t t0 = dw_now_ms();
    int fd = hello_conn(d.sock);
    ck_assert_int_ge(fd, 0);
    char msg[DEP_MSG_TEXT_MAX];
    ck_assert_msg(refused_naming(fd, "out of file descriptors", msg, sizeof msg), "said: %s",
                  msg);
    ck_assert_int_lt(dw_now_ms() - t0, 2000);
    close(fd);
  }
  ck_assert(dw_log_has(&d, "accept: out of file descriptors", 1000));
  dw_stop_ok(&d);
}
END_TEST

/* ---- start-up while the pools are made ------------------------------------ */

/* Read an ATTACH's reply (SLAB frames, their fds closed) up to ATTACH_OK or an ERROR. */
static int attach_reply(int fd, int timeout_ms, char *msg, size_t len) {
  struct dw_frame *f = dw_frame_new();
  int64_t deadline = dw_now_ms() + timeout_ms;
  int type;
  for (;;) {
    int fds[DEP_PROTO_MAX_FDS], nfds = 0;
    int left = (int)(deadline - dw_now_ms());
    int rc = dw_recv_frame_fds(fd, f, left > 0 ? left : 1, fds, &nfds);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    if (rc != 0) {
      type = rc;
      break;
    }
    type = f->h.type;
    if (type == DEP_MSG_ERROR) {
      struct dep_msg_error e;
      ck_assert_int_eq(proto_decode_error(f->body, f->h.body_len, &e), 0);
      dw_sfmt(msg, len, "%s", e.message);
    }
    if (type != DEP_MSG_SLAB)
      break;
  }
  free(f);
  return type;
}

START_TEST(test_status_is_answered_while_the_pools_are_made) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  /* Seconds of pool making on this kind of machine. */
  struct tu_daemon_opts o = {.wait = TU_WAIT_SOCKET};
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir,
                                        "pool:\n  host_size: 1GiB\n  chunk_size: 64MiB\n"
                                        "preallocation: true\n",
                                        &o),
                   0);
  int64_t t0 = dw_now_ms();
  int fd = dw_client(&d);
  struct dep_status *s = dw_status(fd);
  int64_t took = dw_now_ms() - t0;
  printf("%s: HELLO and STATUS answered in %lld ms while the pools were made\n", __func__,
         (long long)took);
  ck_assert_str_eq(s->state, "starting");
  ck_assert_uint_eq(s->num_devices, 0);
  dep_status_free(s);
  ck_assert_int_lt(took, 250);
  /* A second daemon learns at once that this one is alive. */
  char out[300];
  dw_sfmt(out, sizeof out, "%s/second.log", d.dir);
  const char *args[] = {"-c", d.conf, NULL};
  char want[300];
  dw_sfmt(want, sizeof want, "another deepepd is already listening on %s (pid %d)", d.sock,
          (int)d.pid);
  dw_deepepd_exits(args, out, 1, want);
  /* A waiting ATTACH whose connection goes away is forgotten. */
  int gone = dw_client(&d);
  struct dep_attach_args ga = dw_job_args("gone", 0, 1);
  dw_attach(gone, &ga, 2);
  ck_assert(dw_log_has(&d, "job gone: rank 0 (local 0", 2000));
  close(gone);
  /* One that its connection DETACHes is answered, and so is the DETACH. */
  int cancel = dw_client(&d);
  struct dep_attach_args ca = dw_job_args("cancelled", 0, 1);
  dw_attach(cancel, &ca, 2);
  ck_assert(dw_log_has(&d, "job cancelled: rank 0 (local 0", 2000));
  ck_assert_int_eq(dw_send_frame(cancel, DEP_MSG_DETACH, 3, NULL), 0);
  char cmsg[DEP_MSG_TEXT_MAX];
  dw_expect_error(cancel, DEP_ERR_STATE, cmsg, sizeof cmsg);
  ck_assert_msg(strstr(cmsg, "cancelled by DETACH") != NULL, "said: %s", cmsg);
  struct dw_frame *cf = dw_frame_new();
  ck_assert_int_eq(dw_recv_frame(cancel, cf, 2000), 0);
  ck_assert_str_eq(proto_type_name(cf->h.type), "DETACH_OK");
  free(cf);
  close(cancel);
  /* One that stays is served once the pools are made. */
  struct dep_attach_args a = dw_job_args("early", 0, 1);
  dw_attach(fd, &a, 3);
  char msg[DEP_MSG_TEXT_MAX] = "";
  int type = attach_reply(fd, 60000, msg, sizeof msg);
  ck_assert_msg(type == DEP_MSG_ATTACH_OK, "ATTACH got frame %d: %s", type, msg);
  char *log = tu_daemon_log(&d);
  char early[128], late[128];
  dw_sfmt(early, sizeof early, "job early: rank 0 (local 0, pid %d) attached", (int)getpid());
  dw_sfmt(late, sizeof late, "job gone: rank 0 (local 0, pid %d) attached", (int)getpid());
  const char *ready = strstr(log, "device pools ready in");
  const char *attached = strstr(log, early);
  ck_assert_ptr_nonnull(ready);
  ck_assert_ptr_nonnull(attached);
  ck_assert_msg(ready < attached, "the ATTACH was served before the pools were ready");
  ck_assert_msg(strstr(log, late) == NULL, "the closed connection's ATTACH was served");
  free(log);
  s = dw_status(fd);
  ck_assert_str_eq(s->state, "ready");
  ck_assert_uint_eq(s->num_devices, 1);
  dep_status_free(s);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_pools_that_cannot_be_made_fail_the_waiting_attach) {
  /* The fds an idle daemon holds without a pool, then room for 3 of 8 chunks beside one
   * client and the start-up's probe: making the pool fails at the fourth, after seconds. */
  struct tu_daemon_opts o = {.nofile = 256};
  int base = idle_fds("preallocation: false\n", &o);
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  o.nofile = base + 2 + 3;
  o.wait = TU_WAIT_SOCKET;
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir,
                                        "pool:\n  host_size: 2GiB\n  chunk_size: 256MiB\n"
                                        "preallocation: true\n",
                                        &o),
                   0);
  int fd = -1;
  for (int i = 0; i < 50 && fd < 0; i++)
    if ((fd = greeted(d.sock)) < 0)
      dw_sleep_ms(20);
  ck_assert_int_ge(fd, 0);
  struct dep_attach_args a = dw_job_args("doomed", 0, 1);
  dw_attach(fd, &a, 3);
  char msg[DEP_MSG_TEXT_MAX] = "";
  int type = attach_reply(fd, 60000, msg, sizeof msg);
  ck_assert_msg(type == DEP_MSG_ERROR, "ATTACH got frame %d", type);
  ck_assert_msg(strstr(msg, "could not make its device pools") != NULL &&
                    strstr(msg, "Too many open files") != NULL,
                "said: %s", msg);
  close(fd);
  int st = tu_daemon_wait_exit(&d, 10000);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 1, "wait status %d", st);
  ck_assert(dw_log_has(&d, "<3>devices: ", 0));
  tu_daemon_cleanup(&d);
}
END_TEST

/*
 * A stop while the pools are made does not wait for them (seconds for a large
 * reserve, which a systemctl stop at start would sit through): the reserve
 * gives up before its next block, and the daemon exits 0, as for any stop.
 */
START_TEST(test_stop_while_the_pools_are_made_is_prompt) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  /* 2048 blocks: seconds to make here, a few ms each. */
  struct tu_daemon_opts o = {.wait = TU_WAIT_SOCKET};
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir,
                                        "pool:\n  host_size: 4GiB\n  chunk_size: 2MiB\n"
                                        "  size_per_device: 8GiB\npreallocation: true\n",
                                        &o),
                   0);
  char state[32];
  ck_assert_ptr_nonnull(tu_daemon_state(d.sock, state, sizeof state));
  ck_assert_str_eq(state, "starting");
  int64_t t0 = dw_now_ms();
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  int st = tu_daemon_wait_exit(&d, 3000);
  int64_t took = dw_now_ms() - t0;
  printf("%s: stopped %lld ms after SIGTERM\n", __func__, (long long)took);
  ck_assert_msg(st >= 0, "deepepd still making its pools 3 s after SIGTERM");
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "wait status %d", st);
  ck_assert(dw_log_has(&d, "the daemon stopped while the pool of device", 0));
  char *log = tu_daemon_log(&d);
  ck_assert_msg(strstr(log, "device pools ready") == NULL, "the pools were finished: %s", log);
  free(log);
  tu_daemon_cleanup(&d);
}
END_TEST

Suite *server_suite(void);
Suite *server_suite(void) {
  Suite *s = suite_create("server");
  struct {
    const char *name;
    const TTest *tests[8];
  } cases[] = {
      {"socket",
       {test_restart_right_after_sigkill, test_socket_of_a_dead_process_is_replaced,
        test_silent_live_process_keeps_the_socket, test_missing_socket_directory_is_made,
        test_socket_setup_failures_are_errors, NULL}},
      {"admission",
       {test_connections_without_hello_are_closed,
        test_reserved_clients_let_root_in_when_others_fill_max_clients, test_max_clients_per_uid,
        test_max_clients_is_clamped_to_the_fd_limit, test_out_of_fds_refuses_with_limit, NULL}},
      {"startup",
       {test_status_is_answered_while_the_pools_are_made,
        test_pools_that_cannot_be_made_fail_the_waiting_attach,
        test_stop_while_the_pools_are_made_is_prompt, NULL}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TCase *tc = tcase_create(cases[i].name);
    tcase_set_timeout(tc, 90);
    for (size_t k = 0; cases[i].tests[k] != NULL; k++)
      tcase_add_test(tc, cases[i].tests[k]);
    suite_add_tcase(s, tc);
  }
  return s;
}
