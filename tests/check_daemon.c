/*
 * check_daemon.c — deepepd as a whole process: its socket, its clients, its
 * signals, who may connect.  Every test starts the real daemon on a
 * temporary socket and speaks the protocol with proto_* on a raw socket
 * (daemonwire.h), so these tests do not depend on the client library.  The
 * job table's rendezvous has its own suite, check_job.c.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
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

/* ---- clients -------------------------------------------------------------- */

START_TEST(test_64_clients_at_once) {
  enum { N = 64 };
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fds[N];
  /* Every client connects and sends HELLO and STATUS before anyone reads. */
  for (int i = 0; i < N; i++) {
    fds[i] = tu_connect_raw(d.sock);
    ck_assert_int_ge(fds[i], 0);
  }
  for (int i = 0; i < N; i++) {
    dw_hello_as(fds[i], DEP_PROTO_VERSION);
    ck_assert_int_eq(dw_send_frame(fds[i], DEP_MSG_STATUS, 100 + (uint32_t)i, NULL), 0);
  }
  for (int i = 0; i < N; i++) {
    dw_expect_hello_ok(fds[i]);
    struct dep_status *st = dw_recv_status(fds[i], 100 + (uint32_t)i);
    ck_assert_uint_ge(st->num_clients, 1);
    ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
    ck_assert_str_eq(st->version, DEP_VERSION_STRING);
    ck_assert_uint_eq(st->proto_version, DEP_PROTO_VERSION);
    ck_assert_str_eq(st->backend, "host");
    ck_assert_uint_eq(st->num_devices, 1);
    ck_assert_str_eq(st->devices[0].name, "host");
    dep_status_free(st);
  }
  /* All of them are still connected and counted. */
  struct dep_status *st = dw_status(fds[0]);
  ck_assert_uint_eq(st->num_clients, N);
  dep_status_free(st);
  for (int i = 0; i < N; i++)
    close(fds[i]);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_disconnect_mid_frame) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int good = dw_client(&d);

  /* Half a header, then gone. */
  int a = tu_connect_raw(d.sock);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_HELLO, .request_id = 1, .body_len = 1000};
  proto_hdr_encode(&h, hdr);
  ck_assert_int_eq(dw_send_all(a, hdr, 12), 0);
  close(a);
  /* A header promising 1000 bytes, 10 of them, then gone. */
  int b = tu_connect_raw(d.sock);
  uint8_t ten[10] = {0};
  ck_assert_int_eq(dw_send_all(b, hdr, sizeof hdr), 0);
  ck_assert_int_eq(dw_send_all(b, ten, sizeof ten), 0);
  close(b);

  ck_assert(dw_log_has(&d, "middle of a frame header (12 of 24 bytes)", 3000));
  ck_assert(dw_log_has(&d, "middle of a HELLO frame body (10 of 1000 bytes)", 3000));
  /* The daemon serves the old client and a new one. */
  struct dep_status *st = dw_status(good);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  int fresh = dw_client(&d);
  st = dw_status(fresh);
  ck_assert_uint_eq(st->num_clients, 2);
  dep_status_free(st);
  close(good);
  close(fresh);
  dw_stop_ok(&d);
}
END_TEST

/* Send raw bytes on a fresh greeted connection; expect ERROR code, then EOF. */
static void offend(const struct tu_daemon *d, const void *bytes, size_t len, int code,
                   bool greet) {
  int fd = greet ? dw_client(d) : tu_connect_raw(d->sock);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(dw_send_all(fd, bytes, len), 0);
  dw_expect_error(fd, code, NULL, 0);
  dw_expect_eof(fd);
  close(fd);
}

START_TEST(test_bad_frames_drop_only_the_offender) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int good = dw_client(&d);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr ok = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                             .type = DEP_MSG_STATUS, .request_id = 9};
  struct dep_frame_hdr h;

  h = ok;
  h.magic = 0xdeadbeef;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);
  struct dep_status *st = dw_status(good);
  dep_status_free(st);

  h = ok;
  h.body_len = DEP_PROTO_MAX_BODY + 1;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);
  st = dw_status(good);
  dep_status_free(st);

  /* A type the daemon does not know is no offence: it is answered and the
   * connection stays (server/protocol). */

  /* A reply type sent by a client. */
  h = ok;
  h.type = DEP_MSG_HELLO_OK;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_PROTOCOL, true);

  /* A STATUS with a body it must not have. */
  uint8_t with_body[DEP_PROTO_HDR_LEN + 4] = {0};
  h = ok;
  h.body_len = 4;
  proto_hdr_encode(&h, with_body);
  offend(&d, with_body, sizeof with_body, DEP_ERR_PROTOCOL, true);

  /* Garbage before any HELLO. */
  uint8_t junk[200];
  srand(42);
  for (size_t i = 0; i < sizeof junk; i++)
    junk[i] = (uint8_t)rand();
  offend(&d, junk, sizeof junk, DEP_ERR_PROTOCOL, false);

  /* A request before HELLO. */
  h = ok;
  proto_hdr_encode(&h, hdr);
  offend(&d, hdr, sizeof hdr, DEP_ERR_STATE, false);

  ck_assert(dw_log_has(&d, "dropped: bad frame magic", 3000));
  /* The good client kept its one connection through all of it. */
  st = dw_status(good);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  close(good);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_client_sending_fds_is_dropped) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int good = dw_client(&d);
  int fd = dw_client(&d);
  uint8_t hdr[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_STATUS, .request_id = 3};
  proto_hdr_encode(&h, hdr);
  int passed = open("/dev/null", O_RDONLY);
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &passed, sizeof passed);
  ck_assert_int_eq(sendmsg(fd, &msg, MSG_NOSIGNAL), (ssize_t)sizeof hdr);
  close(passed);
  dw_expect_eof(fd);
  ck_assert(dw_log_has(&d, "clients never send any", 3000));
  struct dep_status *st = dw_status(good);
  dep_status_free(st);
  close(fd);
  close(good);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_version_mismatch_names_both_versions) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  char msg[DEP_MSG_TEXT_MAX];
  /* HELLO from a newer client.  A frame header of another version is
   * server/protocol's (its refusal carries that version in its header). */
  int fd = tu_connect_raw(d.sock);
  dw_hello_as(fd, DEP_PROTO_VERSION + 1);
  dw_expect_error(fd, DEP_ERR_VERSION, msg, sizeof msg);
  char want[64];
  dw_sfmt(want, sizeof want, "speaks version %d", DEP_PROTO_VERSION + 1);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  dw_sfmt(want, sizeof want, "speaks protocol versions %d..%d", DEP_PROTO_MIN_VERSION,
          DEP_PROTO_VERSION);
  ck_assert_msg(strstr(msg, want) != NULL, "\"%s\" does not contain \"%s\"", msg, want);
  dw_expect_eof(fd);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_client_that_does_not_read_is_dropped) {
  struct tu_daemon d;
  dw_start(&d, "limits:\n  client_queue_bytes: 64KiB\n");
  int good = dw_client(&d);
  int fd = dw_client(&d);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  uint8_t req[DEP_PROTO_HDR_LEN];
  struct dep_frame_hdr h = {.magic = DEP_PROTO_MAGIC, .version = DEP_PROTO_VERSION,
                            .type = DEP_MSG_STATUS, .request_id = 1};
  proto_hdr_encode(&h, req);
  /* Ask and ask and never read: the replies pile up in the daemon. */
  bool cut_off = false;
  int64_t deadline = dw_now_ms() + 10000;
  while (!cut_off && dw_now_ms() < deadline) {
    ssize_t n = send(fd, req, sizeof req, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      struct pollfd pfd = {.fd = fd, .events = POLLOUT};
      poll(&pfd, 1, 50);
    } else if (n < 0) {
      cut_off = true; /* EPIPE / ECONNRESET: the daemon closed us */
    } else {
      ck_assert_int_eq(n, (ssize_t)sizeof req); /* 24 bytes never split here */
    }
  }
  ck_assert_msg(cut_off, "the daemon kept a client that never reads");
  ck_assert(dw_log_has(&d, "does not read its replies", 3000));
  struct dep_status *st = dw_status(good);
  ck_assert_uint_eq(st->num_clients, 1);
  dep_status_free(st);
  close(fd);
  close(good);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_max_clients) {
  struct tu_daemon d;
  /* No reserve: the test runs as root, whom limits.reserved_clients lets past (check_server). */
  dw_start(&d, "limits:\n  max_clients: 2\n  reserved_clients: 0\n");
  int a = dw_client(&d), b = dw_client(&d);
  int c = tu_connect_raw(d.sock);
  ck_assert_int_ge(c, 0);
  char msg[DEP_MSG_TEXT_MAX];
  dw_expect_error(c, DEP_ERR_LIMIT, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "limits.max_clients") != NULL, "said: %s", msg);
  dw_expect_eof(c);
  close(c);
  close(b);
  /* A freed place is taken again (the close is noticed asynchronously). */
  bool served = false;
  for (int i = 0; i < 100 && !served; i++) {
    int e = tu_connect_raw(d.sock);
    dw_hello_as(e, DEP_PROTO_VERSION);
    struct dw_frame *f = dw_frame_new();
    served = dw_recv_frame(e, f, 5000) == 0 && f->h.type == DEP_MSG_HELLO_OK;
    free(f);
    close(e);
    if (!served)
      dw_sleep_ms(10);
  }
  ck_assert(served);
  close(a);
  dw_stop_ok(&d);
}
END_TEST

/* ---- the socket ------------------------------------------------------------ */

START_TEST(test_second_daemon_refuses_to_start) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fd = dw_client(&d);
  char out[300];
  dw_sfmt(out, sizeof out, "%s/second.log", d.dir);
  const char *args[] = {"-c", d.conf, NULL};
  char want[300];
  dw_sfmt(want, sizeof want, "another deepepd is already listening on %s (pid %d)", d.sock,
          (int)d.pid);
  dw_deepepd_exits(args, out, 1, want);
  /* The first keeps its socket file and its clients, and takes new ones. */
  struct stat sb;
  ck_assert_int_eq(stat(d.sock, &sb), 0);
  struct dep_status *s = dw_status(fd);
  ck_assert_uint_eq(s->pid, (uint32_t)d.pid);
  dep_status_free(s);
  int fresh = dw_client(&d);
  close(fresh);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_stale_socket_is_reclaimed) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  char path[300];
  dw_sfmt(path, sizeof path, "%s/d.sock", d.dir);
  /* A daemon that died without removing its socket leaves this behind. */
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s", path);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  close(s);
  ck_assert_int_lt(tu_connect_raw(path), 0);
  ck_assert_int_eq(tu_daemon_start_in(&d, d.dir, NULL), 0);
  ck_assert(dw_log_has(&d, "removed the stale socket", 1000));
  int fd = dw_client(&d);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_non_socket_at_path_is_left_alone) {
  char dir[200], path[300], conf[300], out[300], yaml[600];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(path, sizeof path, "%s/d.sock", dir);
  dw_sfmt(conf, sizeof conf, "%s/deepepd.yaml", dir);
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  dw_sfmt(yaml, sizeof yaml, "socket:\n  path: %s\nbackend: host\n", path);
  ck_assert_int_eq(tu_write_file(conf, yaml), 0);
  ck_assert_int_eq(tu_write_file(path, "precious\n"), 0);
  const char *args[] = {"-c", conf, NULL};
  dw_deepepd_exits(args, out, 1, "exists and is not a socket");
  char *text = dw_slurp(path);
  ck_assert_str_eq(text, "precious\n");
  free(text);
  tu_rmtree(dir);
}
END_TEST

START_TEST(test_socket_path_too_long_fails_loudly) {
  char dir[200];
  tu_tmpdir(dir, sizeof dir);
  char longpath[300];
  memset(longpath, 'x', sizeof longpath);
  dw_sfmt(longpath, sizeof longpath, "%s/", dir);
  longpath[strlen(longpath)] = 'x';
  longpath[150] = '\0';
  char out[300];
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  const char *args[] = {"--backend", "host", "-s", longpath, NULL};
  /* A malformed -s, as an empty one is: status 2, as deepepd(8) says. */
  dw_deepepd_exits(args, out, 2, "socket path too long (150 bytes, max 107");
  tu_rmtree(dir);
}
END_TEST

/* READY=1 once listening, RELOADING=1 + READY=1 on SIGHUP, STOPPING=1 on SIGTERM. */
static void check_notify(bool abstract) {
  struct tu_daemon d;
  int ns = dw_start_notifying(&d, abstract);
  dw_expect_notify(ns, "READY=1");
  /* Ready means listening. */
  int fd = dw_client(&d);
  close(fd);
  kill(d.pid, SIGHUP);
  dw_expect_notify(ns, "RELOADING=1");
  dw_expect_notify(ns, "READY=1");
  kill(d.pid, SIGTERM);
  dw_expect_notify(ns, "STOPPING=1");
  int st;
  ck_assert_int_eq(waitpid(d.pid, &st, 0), d.pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  d.pid = 0;
  close(ns);
  tu_daemon_cleanup(&d);
}

/* The next datagram on ns within ms into got (NUL-terminated): its length, or -1. */
static ssize_t notify_next(int ns, char *got, size_t len, int ms) {
  struct pollfd pfd = {.fd = ns, .events = POLLIN};
  if (poll(&pfd, 1, ms) <= 0)
    return -1;
  ssize_t n = recv(ns, got, len - 1, 0);
  ck_assert_int_gt(n, 0);
  got[n] = '\0';
  return n;
}

/*
 * A reload during the start, here while READY=1 waits for a peer that is
 * down (peer_wait_ms), neither says RELOADING=1 nor READY=1: systemd must
 * see the daemon ready only once the start is over (deepepd(8): READY=1
 * waits until every peer is up or peer_wait_ms passes).
 */
START_TEST(test_reload_while_starting_does_not_say_ready) {
  struct tu_daemon d;
  memset(&d, 0, sizeof d);
  tu_tmpdir(d.dir, sizeof d.dir);
  dw_sfmt(d.sock, sizeof d.sock, "%s/d.sock", d.dir);
  dw_sfmt(d.conf, sizeof d.conf, "%s/deepepd.yaml", d.dir);
  dw_sfmt(d.log, sizeof d.log, "%s/deepepd.log", d.dir);
  int port = 4000 + (int)(getpid() % 2000) * 8 + 6; /* and port + 1, where nobody listens */
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s\nbackend: host\npool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n"
          "listen: {address: 127.0.0.1, port: %d}\npeers: [{host: 127.0.0.1, port: %d}]\n"
          "peer_insecure: true\npeer_wait_ms: 4000\n",
          d.sock, port, port + 1);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  dw_sfmt(sa.sun_path, sizeof sa.sun_path, "%s/notify", d.dir);
  int ns = socket(AF_UNIX, SOCK_DGRAM, 0);
  ck_assert_int_ge(ns, 0);
  ck_assert_int_eq(bind(ns, (struct sockaddr *)&sa, sizeof sa), 0);
  fflush(NULL);
  d.pid = fork();
  ck_assert_int_ge(d.pid, 0);
  if (d.pid == 0) {
    int fd = open(d.log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, 2);
    setenv("NOTIFY_SOCKET", sa.sun_path, 1);
    execl(tu_bin("deepepd"), "deepepd", "-c", d.conf, (char *)NULL);
    _exit(127);
  }
  /* The pools are made and READY=1 waits for the peer. */
  char got[512] = "";
  for (int64_t dl = dw_now_ms() + 15000; strncmp(got, "STATUS=waiting for peers", 24) != 0;) {
    ck_assert_msg(dw_now_ms() < dl, "no STATUS=waiting for peers (last: %s)", got);
    if (notify_next(ns, got, sizeof got, 100) > 0)
      ck_assert_msg(strncmp(got, "READY=1", 7) != 0, "READY=1 before the peer wait");
  }
  /* RELOAD_OK comes after whatever the reload notifies (sent before it, on a local socket). */
  int fd = dw_client(&d);
  struct dep_msg_reload_ok m;
  dw_reload(fd, 2, &m);
  close(fd);
  while (notify_next(ns, got, sizeof got, 0) > 0)
    ck_assert_msg(strncmp(got, "READY=1", 7) != 0 && strncmp(got, "RELOADING=1", 11) != 0,
                  "a reload during the start said %s", got);
  /* The start's own READY=1 still comes, once peer_wait_ms has passed. */
  dw_expect_notify(ns, "READY=1");
  kill(d.pid, SIGTERM);
  int st;
  ck_assert_int_eq(waitpid(d.pid, &st, 0), d.pid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  d.pid = 0;
  close(ns);
  tu_daemon_cleanup(&d);
}
END_TEST

START_TEST(test_sd_notify_path) { check_notify(false); }
END_TEST

START_TEST(test_sd_notify_abstract) { check_notify(true); }
END_TEST

/* ---- signals --------------------------------------------------------------- */

START_TEST(test_sigterm_tells_clients_and_exits_cleanly) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fds[3];
  for (int i = 0; i < 3; i++)
    fds[i] = dw_client(&d);
  /* One of them is waiting in a rendezvous when the daemon stops. */
  struct dep_attach_args a = {.size = sizeof a, .rank = 0, .world_size = 2, .local_rank = 0,
                              .local_world_size = 2,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  dw_sfmt(a.job_id, sizeof a.job_id, "stopping-job");
  ck_assert_int_eq(dw_send_frame(fds[2], DEP_MSG_ATTACH, 4, &a), 0);
  ck_assert(dw_log_has(&d, "attached (1 of 2", 3000));
  int st = tu_daemon_stop(&d);
  ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "wait status %d", st);
  struct dw_frame *f = dw_frame_new();
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(dw_recv_frame(fds[i], f, 2000), 0);
    ck_assert_str_eq(proto_type_name(f->h.type), "SHUTDOWN");
    ck_assert_uint_eq(f->h.request_id, 0);
    dw_expect_eof(fds[i]);
    close(fds[i]);
  }
  free(f);
  ck_assert_msg(access(d.sock, F_OK) != 0 && errno == ENOENT, "the socket file is left behind");
  tu_daemon_cleanup(&d);
}
END_TEST

START_TEST(test_sighup_reloads_live_keys_and_names_the_rest) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fd = dw_client(&d);
  ck_assert(!dw_log_has(&d, "<7>", 0));
  /* Raise the log level (live) and move the socket (needs a restart). */
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s/elsewhere.sock\n  mode: 0666\nbackend: host\nlog_level: debug\n",
          d.dir);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  kill(d.pid, SIGHUP);
  ck_assert(dw_log_has(&d, "reload: needs restart: socket.path", 3000));
  /* Still here, on the old socket, and now logging at debug. */
  struct dep_status *st = dw_status(fd);
  ck_assert_uint_eq(st->pid, (uint32_t)d.pid);
  dep_status_free(st);
  int fresh = dw_client(&d);
  ck_assert(dw_log_has(&d, "<7>client", 3000));
  close(fresh);
  /* A broken file is reported and the running configuration kept. */
  ck_assert_int_eq(tu_write_file(d.conf, "log_level: [\n"), 0);
  kill(d.pid, SIGHUP);
  ck_assert(dw_log_has(&d, "keeping the running configuration", 3000));
  st = dw_status(fd);
  dep_status_free(st);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* RELOAD as uid 65534: refused, and the daemon says who may. 0 when so. */
static int reload_as_nobody(const char *sock) {
  if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
    return 10;
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return 11;
  dw_hello_as(fd, DEP_PROTO_VERSION);
  dw_expect_hello_ok(fd);
  if (dw_send_frame(fd, DEP_MSG_RELOAD, 2, NULL) != 0)
    return 12;
  char msg[DEP_MSG_TEXT_MAX] = "";
  dw_expect_error(fd, DEP_ERR_PERMISSION, msg, sizeof msg);
  close(fd);
  return strstr(msg, "only root or deepepd's own user") != NULL ? 0 : 13;
}

/* RELOAD over the socket (deepepctl reload) does what SIGHUP does, and says so. */
START_TEST(test_reload_request_reports_and_is_for_root_only) {
  struct tu_daemon d;
  dw_start(&d, "allow:\n  users: [\"65534\"]\n");
  int fd = dw_client(&d);
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s/elsewhere.sock\n  mode: 0666\nbackend: host\nlog_level: debug\n"
          "allow:\n  users: [\"65534\"]\npool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n",
          d.dir);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  struct dep_msg_reload_ok m;
  dw_reload(fd, 2, &m);
  ck_assert_msg(strstr(m.message, "needs restart") != NULL &&
                    strstr(m.message, "socket.path") != NULL,
                "RELOAD_OK said: %s", m.message);
  /* The file leaves pool.size_per_device to its default, which tu_daemon_start's set. */
  ck_assert_uint_eq(m.n_restart, 2);
  ck_assert_str_eq(m.restart[0], "socket.path");
  ck_assert_str_eq(m.restart[1], "pool.size_per_device");
  ck_assert_uint_eq(m.n_applied, 1);
  ck_assert_str_eq(m.applied[0], "log_level");
  ck_assert(dw_log_has(&d, "reload requested by uid", 3000));
  /* A broken file: an error naming the place, and the running configuration kept. */
  ck_assert_int_eq(tu_write_file(d.conf, "log_level: [\n"), 0);
  char msg[DEP_MSG_TEXT_MAX] = "";
  ck_assert_int_eq(dw_send_frame(fd, DEP_MSG_RELOAD, 3, NULL), 0);
  dw_expect_error(fd, DEP_ERR_CONFIG, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "deepepd.yaml:") != NULL &&
                    strstr(msg, "keeping the running configuration") != NULL, "said: %s", msg);
  /* deepepctl reload prints the daemon's answer and fails with it. */
  char out[300], cmd[900];
  dw_sfmt(out, sizeof out, "%s/ctl.out", d.dir);
  dw_sfmt(cmd, sizeof cmd, "%s -s %s reload > %s 2>&1", tu_bin("deepepctl"), d.sock, out);
  int st = system(cmd);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1);
  char *text = dw_slurp(out);
  ck_assert_msg(strstr(text, "deepepctl: reload:") != NULL && strstr(text, "deepepd.yaml:") != NULL,
                "deepepctl said: %s", text);
  free(text);
  dw_sfmt(yaml, sizeof yaml, "socket:\n  path: %s\n  mode: 0666\nbackend: host\n"
          "allow:\n  users: [\"65534\"]\npool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n",
          d.sock);
  ck_assert_int_eq(tu_write_file(d.conf, yaml), 0);
  st = system(cmd);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  text = dw_slurp(out);
  ck_assert_msg(strstr(text, "applied") != NULL, "deepepctl said: %s", text);
  free(text);
  if (getuid() == 0) {
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
      _exit(reload_as_nobody(d.sock));
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "nobody's RELOAD: status %d", st);
  } else {
    tu_skip_part(__func__, "the uid 65534 part needs root");
  }
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* ---- command line ---------------------------------------------------------- */

START_TEST(test_check_config) {
  char dir[200], good[300], bad[300], out[300];
  tu_tmpdir(dir, sizeof dir);
  dw_sfmt(good, sizeof good, "%s/good.yaml", dir);
  dw_sfmt(bad, sizeof bad, "%s/bad.yaml", dir);
  dw_sfmt(out, sizeof out, "%s/out.log", dir);
  ck_assert_int_eq(tu_write_file(good, "backend: host\nlimits:\n  max_jobs: 8\n"), 0);
  ck_assert_int_eq(tu_write_file(bad, "backend: host\nlimits:\n  max_jobz: 8\n"), 0);
  const char *a1[] = {"--check-config", good, NULL};
  char want[400];
  dw_sfmt(want, sizeof want, "%s: ok", good);
  dw_deepepd_exits(a1, out, 0, want);
  const char *a2[] = {"--check-config", bad, NULL};
  dw_sfmt(want, sizeof want, "%s:3:3:", bad);
  dw_deepepd_exits(a2, out, 1, want);
  const char *a3[] = {"--no-such-option", NULL};
  dw_deepepd_exits(a3, out, 2, NULL);
  tu_rmtree(dir);
}
END_TEST

/* ---- who may connect ------------------------------------------------------- */

/*
 * In a child that became uid/gid 65534: connect, HELLO, and return 0 when
 * the outcome is as expected (refused with PERMISSION, or served).
 */
static int nobody_child(const char *sock, bool expect_allowed, const char *join_job) {
  if (setgroups(0, NULL) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
    return 10;
  int fd = tu_connect_raw(sock);
  if (fd < 0)
    return 11;
  struct dep_msg_hello h = {.version = DEP_PROTO_VERSION};
  /* A refused peer may be closed before its HELLO arrives: the ERROR is still there to read. */
  if (dw_send_frame(fd, DEP_MSG_HELLO, 1, &h) != 0 && expect_allowed)
    return 12;
  static struct dw_frame f;
  if (dw_recv_frame(fd, &f, 5000) != 0)
    return 13;
  struct dep_msg_error e;
  if (!expect_allowed) {
    if (f.h.type != DEP_MSG_ERROR || proto_decode_error(f.body, f.h.body_len, &e) != 0)
      return 14;
    if (e.code != DEP_ERR_PERMISSION || strstr(e.message, "uid 65534 is not allowed") == NULL)
      return 15;
    return dw_recv_frame(fd, &f, 5000) == -1 ? 0 : 16;
  }
  if (f.h.type != DEP_MSG_HELLO_OK)
    return 17;
  if (join_job == NULL) {
    if (dw_send_frame(fd, DEP_MSG_STATUS, 2, NULL) != 0 || dw_recv_frame(fd, &f, 5000) != 0 ||
        f.h.type != DEP_MSG_STATUS_OK)
      return 18;
    return 0;
  }
  struct dep_attach_args a = {.size = sizeof a, .rank = 1, .world_size = 2, .local_rank = 1,
                              .local_world_size = 2,
                              .shape = {.max_tokens_per_rank = 128, .hidden = 1024,
                                        .num_experts = 8, .topk = 2, .dtype = DEP_DTYPE_BF16}};
  dw_sfmt(a.job_id, sizeof a.job_id, "%s", join_job);
  if (dw_send_frame(fd, DEP_MSG_ATTACH, 3, &a) != 0 || dw_recv_frame(fd, &f, 5000) != 0 ||
      f.h.type != DEP_MSG_ERROR || proto_decode_error(f.body, f.h.body_len, &e) != 0)
    return 19;
  /* Refused, and told nothing about the job but that its id is taken. */
  if (e.code != DEP_ERR_PERMISSION || strstr(e.message, "world_size") != NULL ||
      strstr(e.message, "rank") != NULL)
    return 20;
  /* Nor does STATUS show another user's job. */
  struct dep_status st;
  if (dw_send_frame(fd, DEP_MSG_STATUS, 4, NULL) != 0 || dw_recv_frame(fd, &f, 5000) != 0 ||
      f.h.type != DEP_MSG_STATUS_OK || proto_decode_status(f.body, f.h.body_len, &st) != 0)
    return 21;
  int jobs = (int)st.num_jobs;
  free(st.devices);
  free(st.jobs);
  return jobs == 0 ? 0 : 22;
}

static int run_as_nobody(const char *sock, bool expect_allowed, const char *join_job) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0)
    _exit(nobody_child(sock, expect_allowed, join_job));
  int st;
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

START_TEST(test_allow_list) {
  if (getuid() != 0) {
    tu_skip(__func__, "needs root to become uid %d", NOBODY);
    return;
  }
  struct tu_daemon d;
  dw_start(&d, NULL);
  ck_assert_int_eq(run_as_nobody(d.sock, false, NULL), 0);
  ck_assert(dw_log_has(&d, "uid 65534 is not allowed", 3000));
  dw_stop_ok(&d);
  dw_start(&d, "allow:\n  users: [\"65534\"]\n");
  ck_assert_int_eq(run_as_nobody(d.sock, true, NULL), 0);
  dw_stop_ok(&d);
  /* By group too. */
  dw_start(&d, "allow:\n  groups: [\"65534\"]\n");
  ck_assert_int_eq(run_as_nobody(d.sock, true, NULL), 0);
  dw_stop_ok(&d);
}
END_TEST

/*
 * The members of socket.group may connect, as README and the sysusers
 * snippet say ("set socket.group: deepep ... then add trainer accounts to
 * the group"), without being listed again in allow.groups.
 */
START_TEST(test_socket_group_members_are_allowed) {
  if (getuid() != 0) {
    tu_skip(__func__, "needs root to become uid %d", NOBODY);
    return;
  }
  struct tu_daemon d;
  dw_start(&d, NULL);
  ck_assert_int_eq(tu_daemon_stop(&d), 0);
  char yaml[1024];
  dw_sfmt(yaml, sizeof yaml,
          "socket:\n  path: %s\n  mode: 0660\n  group: \"%d\"\nbackend: host\n"
          "pool:\n  host_size: 64MiB\n  chunk_size: 2MiB\n",
          d.sock, NOBODY);
  const struct tu_daemon_opts whole = {.whole_config = true};
  ck_assert_int_eq(tu_daemon_start_opts(&d, d.dir, yaml, &whole), 0);
  struct stat sb;
  ck_assert_int_eq(stat(d.sock, &sb), 0);
  ck_assert_uint_eq(sb.st_gid, NOBODY);
  ck_assert_int_eq(run_as_nobody(d.sock, true, NULL), 0);
  dw_stop_ok(&d);
}
END_TEST

START_TEST(test_job_of_another_uid_cannot_be_joined) {
  if (getuid() != 0) {
    tu_skip(__func__, "needs root to become uid %d", NOBODY);
    return;
  }
  struct tu_daemon d;
  dw_start(&d, "allow:\n  users: [\"65534\"]\n");
  int r0 = dw_client(&d);
  struct dep_attach_args a = dw_job_args("root-job", 0, 2);
  a.world_size = 2;
  dw_attach(r0, &a, 1);
  ck_assert(dw_log_has(&d, "attached (1 of 2", 3000));
  ck_assert_int_eq(run_as_nobody(d.sock, true, "root-job"), 0);
  ck_assert(dw_log_has(&d, "tried to join a job of uid 0", 3000));
  uint32_t at = 0;
  ck_assert(dw_job_listed(r0, "root-job", &at, NULL));
  ck_assert_uint_eq(at, 1);
  close(r0);
  dw_stop_ok(&d);
}
END_TEST

/* ---- test hooks ----------------------------------------------------------- */

/* A daemon started with test faults ($DEEPEPD_TEST_*, daemon/testhooks.h)
 * says so at warning level, naming each hook that is on; a malformed value
 * or a name that is no hook is ignored with a warning that names it, and
 * the daemon runs. */
START_TEST(test_test_hooks_are_announced_and_malformed_ones_named) {
  setenv("DEEPEPD_TEST_DATA_DROPS", "2", 1);
  setenv("DEEPEPD_TEST_RDMA_BAD_PROOFS", "1x", 1);
  setenv("DEEPEPD_TEST_DATA_DROP", "1", 1);
  struct tu_daemon d;
  dw_start(&d, NULL);
  unsetenv("DEEPEPD_TEST_DATA_DROPS");
  unsetenv("DEEPEPD_TEST_RDMA_BAD_PROOFS");
  unsetenv("DEEPEPD_TEST_DATA_DROP");
  /* The lines are written before the daemon answers STATUS (its first module). */
  ck_assert(dw_log_has(&d, "<4>test hooks: test faults are on", 3000));
  ck_assert(dw_log_has(&d, "$DEEPEPD_TEST_DATA_DROPS=2 (the first N inbound data", 0));
  ck_assert(dw_log_has(&d, "<4>test hooks: $DEEPEPD_TEST_RDMA_BAD_PROOFS=\"1x\" is ignored", 0));
  ck_assert(dw_log_has(&d, "<4>test hooks: $DEEPEPD_TEST_DATA_DROP is no test hook", 0));
  /* The malformed hook is off: the line of those that are on leaves it out. */
  ck_assert(!dw_log_has(&d, "$DEEPEPD_TEST_RDMA_BAD_PROOFS=1 (", 0));
  int fd = dw_client(&d);
  close(fd);
  dw_stop_ok(&d);
}
END_TEST

/* Without them, not a word about test hooks. */
START_TEST(test_no_test_hooks_no_warning) {
  struct tu_daemon d;
  dw_start(&d, NULL);
  int fd = dw_client(&d);
  close(fd);
  ck_assert(!dw_log_has(&d, "test hooks", 0));
  dw_stop_ok(&d);
}
END_TEST

Suite *daemon_suite(void);
Suite *daemon_suite(void) {
  Suite *s = suite_create("daemon");
  struct {
    const char *name;
    const TTest *tests[10];
  } cases[] = {
      {"clients",
       {test_64_clients_at_once, test_disconnect_mid_frame, test_bad_frames_drop_only_the_offender,
        test_client_sending_fds_is_dropped, test_version_mismatch_names_both_versions,
        test_client_that_does_not_read_is_dropped, test_max_clients, NULL}},
      {"socket",
       {test_second_daemon_refuses_to_start, test_stale_socket_is_reclaimed,
        test_non_socket_at_path_is_left_alone, test_socket_path_too_long_fails_loudly,
        test_sd_notify_path, test_sd_notify_abstract, test_reload_while_starting_does_not_say_ready,
        NULL}},
      {"signals",
       {test_sigterm_tells_clients_and_exits_cleanly,
        test_sighup_reloads_live_keys_and_names_the_rest,
        test_reload_request_reports_and_is_for_root_only, test_check_config, NULL}},
      {"auth", {test_allow_list, test_socket_group_members_are_allowed,
                test_job_of_another_uid_cannot_be_joined, NULL}},
      {"testhooks",
       {test_test_hooks_are_announced_and_malformed_ones_named, test_no_test_hooks_no_warning,
        NULL}},
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
